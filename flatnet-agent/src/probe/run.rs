//! A conflict probe that outlives the wait of the ADD that started it.
//!
//! The ADD waits only as long as its LAN takes to answer
//! ([`super::wait::ReplyTimes`], from the kernel's arrival times of the
//! gateway's answers, so the agent's own scheduling does not inflate it),
//! or the whole window when the wire inventory saw another host use one of
//! the addresses. The probe's thread decides: at the end of the wait it
//! first reads every frame that reached the node by then, so an answer in
//! time refuses the pod however late the thread runs. It goes on
//! listening, and asks again halfway, for the whole configured window; an
//! answer that comes after the ADD went on goes to the late handler, which
//! raises it as a conflict of the pod.

use std::{
    net::IpAddr,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::{Duration, Instant, SystemTime},
};

use prometheus_client::{
    metrics::{counter::Counter, family::Family},
    registry::Registry,
};

use super::{ForeignClaim, ProbeError, parse_answer, probe_frame, probe_socket};
use crate::{
    packet::{MacAddr, RawSocketError, Received},
    probe::wait::ReplyTimes,
};

/// What one probe asks, and for how long.
#[derive(Clone, Debug)]
pub struct ProbePlan {
    /// The interface the probes go out of and the answers come in on (the
    /// subnet's master, or its VLAN interface).
    pub uplink: String,
    /// The addresses probed.
    pub addrs: Vec<IpAddr>,
    /// An address expected to answer (the subnet's gateway): the time its
    /// answer takes is a sample of the LAN's reply time.
    pub reference: Option<IpAddr>,
    /// How long answers are taken (the probes are sent again halfway).
    pub window: Duration,
}

/// Where the probe's decisions come from: the LAN's reply times, and
/// whether the wire inventory saw another host use an address lately.
pub struct ProbeContext {
    /// The namespace of the uplink (the calling thread's when `None`).
    pub host: Option<PathBuf>,
    /// Reply times per uplink, shared by every probe of the agent.
    pub reply_times: Arc<ReplyTimes>,
    /// Whether the inventory saw another host claim the address on the
    /// uplink (by interface index) lately: the ADD then waits the whole
    /// window.
    pub seen_on_wire: Box<dyn Fn(u32, IpAddr) -> bool + Send + Sync>,
    /// Called with the uplink's index and the claim when an answer comes
    /// after the ADD stopped waiting.
    pub late: Box<dyn FnOnce(u32, ForeignClaim) + Send>,
    /// Where the waits and late answers are counted.
    pub metrics: ProbeMetrics,
}

/// What an ADD's wait for an answer was sized from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitBasis {
    /// The LAN's recent reply times on the uplink.
    ReplyTime,
    /// The whole window: no reply seen on the uplink yet.
    NoReplyTime,
    /// The whole window: the wire inventory saw another host use one of
    /// the addresses lately.
    SeenOnWire,
}

impl WaitBasis {
    /// The metric label value.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::ReplyTime => "reply_time",
            Self::NoReplyTime => "no_reply_time",
            Self::SeenOnWire => "seen_on_wire",
        }
    }
}

/// The probe's counters, registered in the agent's metrics.
#[derive(Clone, Debug, Default)]
pub struct ProbeMetrics {
    /// `conflict_probe_waits_total{basis}`: ADD waits by [`WaitBasis`].
    pub waits: Family<[(&'static str, &'static str); 1], Counter>,
    /// `conflict_probe_late_answers_total`: answers after the ADD's wait,
    /// raised as conflicts of the pod.
    pub late_answers: Counter,
}

impl ProbeMetrics {
    /// Registers the counters in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "conflict_probe_waits",
            "ADDs that waited for an answer to their conflict probe, by what the wait was sized from (reply_time, no_reply_time, seen_on_wire)",
            self.waits.clone(),
        );
        registry.register(
            "conflict_probe_late_answers",
            "Answers to a conflict probe after its ADD stopped waiting, raised as conflicts of the pod",
            self.late_answers.clone(),
        );
    }
}

/// A running probe, as the ADD that started it sees it.
pub struct Probing {
    shared: Arc<Shared>,
    /// The probe's window: the ADD never waits longer than this.
    window: Duration,
}

struct Shared {
    state: Mutex<State>,
    changed: tokio::sync::Notify,
}

enum State {
    /// The ADD waits: probes being sent, or the wait not over.
    Waiting,
    /// Answered while the ADD waited.
    Claimed(ForeignClaim),
    /// No uplink to probe from (a VLAN interface made by this ADD), or the
    /// window passed without an answer.
    Clear,
    /// The probe could not run.
    Failed(String),
    /// The wait ended without an answer: the ADD goes on, and a later
    /// answer goes to the late handler.
    Released,
}

impl Probing {
    /// Starts `plan` on a blocking thread. Call inside a Tokio runtime.
    #[must_use]
    pub fn start(plan: ProbePlan, context: ProbeContext) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::Waiting),
            changed: tokio::sync::Notify::new(),
        });
        let ProbeContext {
            host,
            reply_times,
            seen_on_wire,
            late,
            metrics,
        } = context;
        let mut late = Some(late);
        let window = plan.window;
        let thread_shared = Arc::clone(&shared);
        let started = Instant::now();
        tokio::task::spawn_blocking(move || {
            let listened = crate::netns::run_in_netns_or_here(host, || {
                listen(
                    started,
                    &plan,
                    &reply_times,
                    &*seen_on_wire,
                    &metrics,
                    &thread_shared,
                )
            });
            let outcome = match listened {
                Ok(outcome) => outcome,
                Err(error) => Err(ProbeError::Namespace(error.to_string())),
            };
            let late_claim = thread_shared.settle(outcome, &mut late);
            if let (Some((ifindex, claim)), Some(late)) = (late_claim, late) {
                metrics.late_answers.inc();
                late(ifindex, claim);
            }
        });
        Self { shared, window }
    }

    /// Waits for the verdict: `Some` when another host's answer reached
    /// the node before the ADD's wait ended (the wait counts from the
    /// probes' sending, so work done meanwhile is not added to it), `None`
    /// when none did.
    ///
    /// # Errors
    /// The probe could not run (the message says why).
    pub async fn verdict(&self) -> Result<Option<ForeignClaim>, String> {
        // Only a thread that never runs leaves the ADD waiting this long.
        let limit = tokio::time::Instant::now() + self.window;
        loop {
            let notified = self.shared.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut state = self.shared.state.lock().expect("probe state lock poisoned");
                match &*state {
                    State::Claimed(claim) => return Ok(Some(*claim)),
                    State::Clear | State::Released => return Ok(None),
                    State::Failed(error) => return Err(error.clone()),
                    State::Waiting if tokio::time::Instant::now() >= limit => {
                        *state = State::Released;
                        return Err("the probe's thread gave no verdict within its window".into());
                    }
                    State::Waiting => {}
                }
            }
            tokio::select! {
                () = &mut notified => {}
                () = tokio::time::sleep_until(limit) => {}
            }
        }
    }
}

impl Shared {
    /// The wait ended without an answer: the ADD goes on.
    fn release(&self) {
        let mut state = self.state.lock().expect("probe state lock poisoned");
        if matches!(*state, State::Waiting) {
            *state = State::Released;
        }
        drop(state);
        self.changed.notify_waiters();
    }

    /// Ends the probe with `outcome`; returns the claim when it is late
    /// (the ADD stopped waiting), for the late handler, which it keeps in
    /// `late` until then.
    fn settle(
        &self,
        outcome: Result<Option<(u32, ForeignClaim)>, ProbeError>,
        late: &mut Option<Box<dyn FnOnce(u32, ForeignClaim) + Send>>,
    ) -> Option<(u32, ForeignClaim)> {
        let mut state = self.state.lock().expect("probe state lock poisoned");
        let waited = matches!(*state, State::Waiting);
        let late_claim = match outcome {
            Ok(Some((_, claim))) if waited => {
                *state = State::Claimed(claim);
                None
            }
            Ok(Some(found)) => Some(found),
            Ok(None) if waited => {
                *state = State::Clear;
                None
            }
            Ok(None) => None,
            Err(error) if waited => {
                *state = State::Failed(error.to_string());
                None
            }
            Err(error) => {
                tracing::warn!(%error, "the conflict probe failed after the ADD's wait");
                None
            }
        };
        drop(state);
        self.changed.notify_waiters();
        if late_claim.is_none() {
            late.take();
        }
        late_claim
    }
}

/// Sends the probes (and the reference's), decides the ADD's verdict at
/// the end of its wait, and listens for the window: the first claim on one
/// of the addresses, with the uplink's index; `None` when nothing claimed
/// them, or when the uplink does not exist (yet).
fn listen(
    started: Instant,
    plan: &ProbePlan,
    reply_times: &ReplyTimes,
    seen_on_wire: &dyn Fn(u32, IpAddr) -> bool,
    metrics: &ProbeMetrics,
    shared: &Shared,
) -> Result<Option<(u32, ForeignClaim)>, ProbeError> {
    let socket = match probe_socket(&plan.uplink) {
        Ok(socket) => socket,
        Err(RawSocketError::NoInterface { .. }) => return Ok(None),
        Err(error) => return Err(error.into()),
    };
    let (ifindex, own_mac) = (socket.ifindex(), socket.hardware_address()?);
    socket.timestamp_arrivals()?;
    let frames = plan
        .addrs
        .iter()
        .chain(&plan.reference)
        .map(|addr| probe_frame(own_mac, *addr))
        .collect::<Result<Vec<_>, _>>()?;
    let send_all = || -> Result<(Instant, SystemTime), ProbeError> {
        let at = (Instant::now(), SystemTime::now());
        for frame in &frames {
            socket.send(frame)?;
        }
        Ok(at)
    };
    let (sent, sent_at) = send_all()?;
    let suspect = plan.addrs.iter().any(|addr| seen_on_wire(ifindex, *addr));
    let (wait, basis) = match reply_times.wait(&plan.uplink, plan.window) {
        _ if suspect => (plan.window, WaitBasis::SeenOnWire),
        Some(wait) => (wait, WaitBasis::ReplyTime),
        None => (plan.window, WaitBasis::NoReplyTime),
    };
    metrics
        .waits
        .get_or_create(&[("basis", basis.name())])
        .inc();
    tracing::debug!(uplink = %plan.uplink, ?wait, basis = basis.name(), since_start = ?started.elapsed(), "conflict probe sent");
    let reference: Vec<IpAddr> = plan.reference.into_iter().collect();
    let mut released = false;
    let mut resent = false;
    let mut sampled = false;
    let mut buffer = [0u8; 2048];
    loop {
        let elapsed = sent.elapsed();
        if !released && elapsed >= wait {
            // Every frame that reached the node in time is read before the
            // ADD goes on, however late this thread runs.
            while let Some(received) = socket.receive(&mut buffer, Duration::ZERO)? {
                if let Some(claim) = claim_in(&buffer, received, &plan.addrs, own_mac) {
                    return Ok(Some((ifindex, claim)));
                }
            }
            released = true;
            shared.release();
            tracing::debug!(uplink = %plan.uplink, since_start = ?started.elapsed(), "no answer to the conflict probe in time; the ADD goes on");
        }
        if elapsed >= plan.window {
            return Ok(None);
        }
        if !resent && elapsed >= plan.window / 2 {
            resent = true;
            send_all()?;
        }
        let next = [
            (!released).then_some(wait),
            (!resent).then_some(plan.window / 2),
            Some(plan.window),
        ]
        .into_iter()
        .flatten()
        .min()
        .unwrap_or(plan.window);
        let Some(received) = socket.receive(&mut buffer, next.saturating_sub(elapsed))? else {
            continue;
        };
        // Only answers to the first sending: one to the first that came
        // after the second would look faster than it was.
        if !sampled && !resent && claim_in(&buffer, received, &reference, own_mac).is_some() {
            sampled = true;
            let took = received
                .arrived
                .and_then(|arrived| arrived.duration_since(sent_at).ok())
                .unwrap_or_else(|| sent.elapsed());
            tracing::debug!(uplink = %plan.uplink, ?took, "the reference answered the conflict probe");
            reply_times.record(&plan.uplink, took);
            continue;
        }
        if let Some(claim) = claim_in(&buffer, received, &plan.addrs, own_mac) {
            return Ok(Some((ifindex, claim)));
        }
    }
}

/// The claim on one of `addrs` that `received` (in `buffer`) makes, if it
/// is an answer (copies of our own frames are none).
fn claim_in(
    buffer: &[u8],
    received: Received,
    addrs: &[IpAddr],
    own_mac: MacAddr,
) -> Option<ForeignClaim> {
    if received.outgoing {
        return None;
    }
    parse_answer(&buffer[..received.len], addrs, own_mac)
}
