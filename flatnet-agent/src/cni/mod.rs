//! The CNI plugin protocol (specification 0.3.0 to 1.1.0): what flatnet-cni
//! reads from the runtime, what it prints back, and the validated requests it
//! forwards to the agent. Pure data and parsing; no I/O besides
//! [`plugin::run`]'s call into an [`plugin::AgentConnection`].

pub mod args;
pub mod config;
pub mod env;
pub mod error;
pub mod names;
pub mod plugin;
pub mod request;
pub mod result;
pub mod version;

pub use args::CniArgs;
pub use config::{Dns, FlatNetworkBlock, NetworkConfig, RuntimeConfig, ValidAttachment};
pub use env::{CniCommand, CniEnv};
pub use error::{CniError, ErrorCode};
pub use request::{
    Admission, AttachRequest, Attachment, CniRequest, DetachRequest, GcRequest, Invocation,
    StatusRequest,
};
pub use result::{CniResult, Interface, IpConfig, IpWithPrefix, Route};
pub use version::{CniVersion, VersionInfo};
