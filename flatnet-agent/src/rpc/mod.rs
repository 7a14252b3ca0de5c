//! The agent's unix socket protocol.
