//! Types shared by the flatnet eBPF programs (`flatnet-ebpf`) and user space.
//!
//! Everything here is `#![no_std]` and `#[repr(C)]` without implicit padding,
//! so the kernel and user space agree on every byte. The `user` feature adds
//! `aya::Pod` impls. The Kubernetes core (std) is the crate beside this one,
//! `flatnet-k8s` in `flatnet-common/k8s`.
#![no_std]

pub mod conflict;
pub mod frame_counter;
pub mod mss;
pub mod node_macs;
pub mod pin;
pub mod policy;
pub mod resolver;
pub mod responder;
pub mod verdict;
pub mod wire;

pub use frame_counter::{FrameCounter, FrameKind};
