//! The figures `allocation_scale --json` prints and `cargo xtask bench
//! allocation` reads: one definition for both ends of that report (xtask
//! includes this file by path).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// What one phase (create at once, or delete half and replace) came to.
#[derive(Serialize, Deserialize)]
pub struct Phase {
    /// Seconds until every pod was addressed.
    pub seconds: f64,
    /// Requests per pod of the phase, by verb.
    pub per_verb: BTreeMap<String, f64>,
    /// Writes (create, update, patch, delete) per pod.
    pub writes: f64,
    /// Requests per pod by verb, resource and reply code.
    pub per_kind: BTreeMap<String, f64>,
}

/// The figures of one run.
#[derive(Serialize, Deserialize)]
pub struct Figures {
    pub pods: usize,
    pub workers: u16,
    pub latency_ms: u64,
    pub reserve_ahead: usize,
    pub create: Phase,
    pub replace: Phase,
    pub operator_peak_rss_mib: f64,
    /// The operator's largest live heap (what it allocated and had not
    /// freed), below the RSS by what the allocator keeps.
    pub operator_peak_heap_mib: f64,
    pub fake_peak_rss_mib: f64,
}
