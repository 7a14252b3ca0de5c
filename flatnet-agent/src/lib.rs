//! flatnet's node agent: interfaces, CNI service and the eBPF data plane.

/// Where the agent's rights are granted, named when the API server
/// refuses it something.
pub const AGENT_RBAC: &str = "grant it in the flatnet-agent ClusterRole (or, in the release \
namespace, Role) of charts/flatnet/templates/agent-rbac.yaml";

pub mod atomic_file;
pub mod cluster_config;
pub mod cluster_settings;
pub mod cni;
pub mod cni_service;
pub mod crash_point;
pub mod cri;
pub mod datapath;
pub mod desired;
pub mod floating;
pub mod install;
pub mod journal;
pub mod link;
pub mod mac_conflict;
pub mod metrics;
pub mod netns;
pub mod node_heartbeat;
pub mod packet;
pub mod phases;
pub mod policy_compiler;
pub mod policy_controller;
pub mod probe;
pub mod records;
pub mod rpc;
pub mod wire_report;
