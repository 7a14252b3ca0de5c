//! flatnet's node agent: interfaces, CNI service and the eBPF data plane.

pub mod cni;
pub mod datapath;
pub mod link;
pub mod netns;
pub mod packet;
pub mod policy;
pub mod rpc;
