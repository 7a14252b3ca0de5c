//! flatnet-operator: the cluster side of flatnet.
//!
//! This crate holds the operator runtime (configuration, leader election,
//! health and metrics), the flat-network Service controller, the
//! NetworkAttachmentDefinition controller and the admission webhook with its
//! managed TLS. The binary in `main.rs` only parses the command line and
//! calls [`runtime::run`].
//! health and metrics), the allocation controllers and the flat-network
//! Service controller. The binary in `main.rs` only parses the command line and calls [`runtime::run`].

// Timers compare durations all over the controllers: a subtraction that
// can underflow panics, so every one must say what happens then.
#![warn(clippy::unchecked_time_subtraction)]

pub mod admin;
pub mod allocation;
pub mod cache;
#[cfg(any(test, feature = "fake-api"))]
pub mod chaos;
pub mod cidr;
pub mod cluster_config;
pub mod cluster_health;
pub mod config;
pub mod controller;
pub mod flat_services;
pub mod floating;
pub mod leader;
pub mod metrics;
pub mod migrate;
pub mod nad;
pub mod runtime;
pub mod runtime_config;
pub mod telemetry;
pub mod tls;
pub mod webhook;
pub mod workloads;

#[cfg(test)]
mod compat_tests;

#[cfg(test)]
mod doc_examples;
#[cfg(test)]
mod fixtures;
