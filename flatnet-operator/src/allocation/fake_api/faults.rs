//! Seeded fault injection for the fake API server, per client.
//!
//! Each client of the server can carry an id ([`FakeApiServer::for_client`]
//! (super::FakeApiServer::for_client)); requests of a client with an id
//! meet the faults a real API server and network produce, drawn from one
//! seeded generator: 409 Conflict before a write, 500 before or after it
//! is applied (a lost response), a timeout (504 after a delay, applied or
//! not), watches cut short, and the death of the client itself in the
//! middle of a request, before or after it is applied. A dead client's
//! requests never complete, as nothing answers a killed process; its owner
//! learns of the death through [`Faults::take_crashed`] and kills it.
//!
//! Requests without a client id (the test driving the cluster) meet no
//! faults.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Mutex,
    time::Duration,
};

use http::{Method, StatusCode};
use serde_json::Value;

use super::{Target, status};

/// How often each fault happens, in requests per million.
#[derive(Clone, Debug)]
pub struct FaultRates {
    /// 409 Conflict instead of applying a write.
    pub conflict: u32,
    /// 500 instead of applying a request.
    pub error_before: u32,
    /// 500 after applying a request (the response is lost).
    pub error_after: u32,
    /// 504 after [`FaultRates::timeout_delay`], half of them applied.
    pub timeout: u32,
    /// Watches cut after a random share of [`FaultRates::watch_cut_within`].
    pub watch_cut: u32,
    /// The client dies in the middle of a write, before or after it applies.
    pub crash: u32,
    /// The client dies right after a ledger write (a subnet's status or a
    /// MAC ledger ConfigMap) is applied, before its record is written.
    pub crash_after_ledger: u32,
    /// How long a timed-out request hangs before its 504.
    pub timeout_delay: Duration,
    /// Longest life of a cut watch.
    pub watch_cut_within: Duration,
}

impl Default for FaultRates {
    /// The rates of `cargo xtask chaos`.
    fn default() -> Self {
        Self {
            conflict: 20_000,
            error_before: 10_000,
            error_after: 10_000,
            timeout: 5_000,
            watch_cut: 100_000,
            crash: 1_000,
            crash_after_ledger: 10_000,
            timeout_delay: Duration::from_millis(250),
            watch_cut_within: Duration::from_secs(3),
        }
    }
}

impl FaultRates {
    /// No faults at all.
    #[must_use]
    pub fn none() -> Self {
        Self {
            conflict: 0,
            error_before: 0,
            error_after: 0,
            timeout: 0,
            watch_cut: 0,
            crash: 0,
            crash_after_ledger: 0,
            ..Self::default()
        }
    }
}

/// A fault that answers a request in place of the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// 409 Conflict.
    Conflict,
    /// 500 Internal Server Error.
    ServerError,
    /// 504 after the timeout delay.
    Timeout,
}

/// What happens to one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Served normally.
    Serve,
    /// Answered by the fault, without applying the request.
    Before(Fault),
    /// Applied, then answered by the fault.
    After(Fault),
    /// The client dies; the request is applied first when `applied`.
    Crash {
        /// Whether the request is applied before the death.
        applied: bool,
    },
    /// The client is dead: no answer, ever.
    Hang,
}

/// Counted fault kinds, as [`Faults::counts`] names them.
pub mod kind {
    /// 409 before a write.
    pub const CONFLICT: &str = "409 conflict";
    /// 500 before applying.
    pub const ERROR_BEFORE: &str = "500 before apply";
    /// 500 after applying.
    pub const ERROR_AFTER: &str = "500 after apply (lost response)";
    /// 504 timeouts.
    pub const TIMEOUT: &str = "504 timeout";
    /// Watches cut short.
    pub const WATCH_CUT: &str = "watch disconnect";
    /// Deaths in the middle of a write.
    pub const CRASH: &str = "crash mid-request";
    /// Deaths between a ledger write and the record write.
    pub const CRASH_AFTER_LEDGER: &str = "crash after ledger write";
}

struct State {
    rng: u64,
    enabled: bool,
    crashes_enabled: bool,
    counts: BTreeMap<&'static str, u64>,
    dead: BTreeSet<u64>,
    crashed: Vec<(u64, &'static str)>,
}

/// The seeded faults of one run; shared by every clone of the server.
pub struct Faults {
    rates: FaultRates,
    state: Mutex<State>,
}

const MILLION: u64 = 1_000_000;

impl Faults {
    /// Faults at `rates`, drawn from `seed`.
    #[must_use]
    pub fn new(seed: u64, rates: FaultRates) -> Self {
        Self {
            rates,
            state: Mutex::new(State {
                rng: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
                enabled: true,
                crashes_enabled: true,
                counts: BTreeMap::new(),
                dead: BTreeSet::new(),
                crashed: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Turns every fault on or off (dead clients stay dead).
    pub fn set_enabled(&self, enabled: bool) {
        self.lock().enabled = enabled;
    }

    /// Turns the deaths of clients on or off, the other faults staying.
    pub fn set_crashes(&self, enabled: bool) {
        self.lock().crashes_enabled = enabled;
    }

    /// The clients that died since the last call, with the kind of death.
    pub fn take_crashed(&self) -> Vec<(u64, &'static str)> {
        std::mem::take(&mut self.lock().crashed)
    }

    /// Injected faults so far, by kind.
    #[must_use]
    pub fn counts(&self) -> BTreeMap<&'static str, u64> {
        self.lock().counts.clone()
    }

    /// The plan for a request of `client` (0: no faults).
    pub(super) fn plan(&self, client: u64, method: &Method, target: &Target) -> Plan {
        if client == 0 {
            return Plan::Serve;
        }
        let mut state = self.lock();
        if state.dead.contains(&client) {
            return Plan::Hang;
        }
        if !state.enabled {
            return Plan::Serve;
        }
        let write = *method != Method::GET;
        let ledger_write = *method == Method::PUT
            && ((target.collection.ends_with("/flatnetworksubnets")
                && target.subresource.as_deref() == Some("status"))
                || target.collection == "/v1/configmaps");
        let roll = state.next() % MILLION;
        let rates = &self.rates;
        // The faults take consecutive slices of the roll.
        let mut edge = 0;
        let mut within = |rate: u32| {
            let start = edge;
            edge += u64::from(rate);
            (start..edge).contains(&roll)
        };
        let crash_rate = if ledger_write {
            rates.crash_after_ledger
        } else if write {
            rates.crash
        } else {
            0
        };
        let crashes = state.crashes_enabled;
        let (plan, counted) = if within(crash_rate) && crashes {
            let applied = ledger_write || state.next().is_multiple_of(2);
            state.dead.insert(client);
            let kind = if ledger_write {
                kind::CRASH_AFTER_LEDGER
            } else {
                kind::CRASH
            };
            state.crashed.push((client, kind));
            (Plan::Crash { applied }, kind)
        } else if within(if write { rates.conflict } else { 0 }) {
            (Plan::Before(Fault::Conflict), kind::CONFLICT)
        } else if within(rates.error_before) {
            (Plan::Before(Fault::ServerError), kind::ERROR_BEFORE)
        } else if within(rates.error_after) {
            (Plan::After(Fault::ServerError), kind::ERROR_AFTER)
        } else if within(rates.timeout) {
            if state.next().is_multiple_of(2) {
                (Plan::Before(Fault::Timeout), kind::TIMEOUT)
            } else {
                (Plan::After(Fault::Timeout), kind::TIMEOUT)
            }
        } else {
            return Plan::Serve;
        };
        *state.counts.entry(counted).or_insert(0) += 1;
        plan
    }

    /// How long a watch of `client` may live before it is cut, if it is.
    pub(super) fn watch_cut(&self, client: u64) -> Option<Duration> {
        if client == 0 {
            return None;
        }
        let mut state = self.lock();
        if !state.enabled || state.next() % MILLION >= u64::from(self.rates.watch_cut) {
            return None;
        }
        *state.counts.entry(kind::WATCH_CUT).or_insert(0) += 1;
        let share = state.next() % 1000;
        Some(
            self.rates
                .watch_cut_within
                .mul_f64(f64::from(u32::try_from(share).unwrap_or(0)) / 1000.0),
        )
    }

    /// The status code and body a fault answers with, after its delay.
    pub(super) async fn answer(&self, fault: Fault) -> (StatusCode, Value) {
        answer(fault, self.rates.timeout_delay).await
    }
}

/// The status code and body `fault` answers with; a timeout after
/// `timeout_delay`.
pub(super) async fn answer(fault: Fault, timeout_delay: Duration) -> (StatusCode, Value) {
    match fault {
        Fault::Conflict => (
            StatusCode::CONFLICT,
            status(
                409,
                "Conflict",
                "the object has been modified; please apply your changes to the latest version and try again",
            ),
        ),
        Fault::ServerError => (
            StatusCode::INTERNAL_SERVER_ERROR,
            status(500, "InternalError", "injected: etcdserver: leader changed"),
        ),
        Fault::Timeout => {
            tokio::time::sleep(timeout_delay).await;
            (
                StatusCode::GATEWAY_TIMEOUT,
                status(
                    504,
                    "Timeout",
                    "injected: the request did not complete within the allowed duration",
                ),
            )
        }
    }
}

/// A fault for one request, whatever client sends it: the next write
/// (not a `GET`) of `resource` named `name` meets `plan`.
#[derive(Clone, Debug)]
pub struct Scripted {
    /// The resource, plural, with its subresource: `flatnetworkips/status`.
    pub resource: String,
    /// The object's name.
    pub name: String,
    /// What happens to the request.
    pub plan: Plan,
}

impl Scripted {
    /// Whether it is meant for a request of `method` on `target`.
    pub(super) fn matches(&self, method: &Method, target: &Target) -> bool {
        let (_, plural) = super::group_and_resource(&target.collection);
        let resource = match &target.subresource {
            Some(sub) => format!("{plural}/{sub}"),
            None => plural.to_owned(),
        };
        *method != Method::GET
            && resource == self.resource
            && target.name.as_deref() == Some(self.name.as_str())
    }
}

impl State {
    fn next(&mut self) -> u64 {
        super::xorshift(&mut self.rng)
    }
}
