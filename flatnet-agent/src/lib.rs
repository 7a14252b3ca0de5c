//! flatnet's node agent: interfaces, CNI service and the eBPF data plane.

pub mod datapath;
pub mod link;
pub mod netns;
pub mod packet;
