//! flatnet's node agent: interfaces, CNI service and the eBPF data plane.

pub mod datapath;
