//! Runtime network configuration of running pods, the cluster side: what
//! PodNetworkConfigs ask of each pod ([`desired`], a pure function), the
//! controller turning that into the FlatNetworkIPs of hot-plugged
//! interfaces and the configurations' status ([`controller`]), and how
//! many pods carry their subnet's `spec.mtu` ([`mtu_status`]). The node
//! agents change the interfaces; see `docs/runtime-config.md`.

pub mod controller;
pub mod desired;
pub mod mtu_status;
