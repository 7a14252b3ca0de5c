//! Types shared by the flatnet eBPF programs (`flatnet-ebpf`) and user space.
//!
//! Everything here is `#![no_std]` and `#[repr(C)]` without implicit padding,
//! so the kernel and user space agree on every byte. The `user` feature adds
//! `aya::Pod` impls; the `k8s` feature (std) holds the API types and IPAM
//! engine shared by the operator and the agent.
// `k8s` is user-space only and needs std throughout; every other build stays
// `no_std` so the kernel programs can depend on this crate.
#![cfg_attr(not(feature = "k8s"), no_std)]

pub mod conflict;
pub mod frame_counter;
pub mod pin;
pub mod policy;
pub mod responder;
pub mod verdict;

#[cfg(feature = "k8s")]
pub use flatnet_k8s as k8s;

pub use frame_counter::{FrameCounter, FrameKind};
