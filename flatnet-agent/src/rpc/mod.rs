//! The agent's unix socket protocol: flatnet-cni (client, blocking std)
//! sends one [`protocol::AgentRequest`] per connection and reads one
//! [`protocol::AgentResponse`]; the agent (server, tokio) answers through a
//! [`handler::CniHandler`]. Messages are JSON in length-prefixed frames
//! ([`frame`]). See `docs/cni.md`.

pub mod client;
pub mod frame;
pub mod handler;
pub mod protocol;
pub mod server;

pub use client::SocketAgent;
pub use handler::CniHandler;
pub use protocol::{AgentRequest, AgentResponse, PROTOCOL_VERSION};
pub use server::{AgentServer, ServerConfig, ServerError};
