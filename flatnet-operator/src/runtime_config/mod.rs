//! Runtime network configuration of running pods, the cluster side: how
//! many pods carry their subnet's `spec.mtu` ([`mtu_status`]). The node
//! agents change the interfaces; see `docs/runtime-config.md`.

pub mod mtu_status;
