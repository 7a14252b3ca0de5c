//! The conflict probe of one ADD, on a thread of its own.
//!
//! The ADD waits only as long as its LAN takes to answer
//! ([`super::wait::ReplyTimes`], from the kernel's arrival times of the
//! gateway's answers, so the agent's own scheduling does not inflate it),
//! or the whole window when the wire inventory saw another host use one of
//! the addresses. The probe's thread decides: at the end of the wait it
//! first reads every frame that reached the node by then, so an answer in
//! time refuses the pod however late the thread runs; then it closes its
//! socket (a node starting many pods at once keeps no listener per pod).
//! Halfway through the window the probes are sent once more; an answer
//! after the verdict reaches the uplink program, which by then watches the
//! pod's addresses and reports the conflict.

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
    /// Where the waits are counted.
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
    /// `conflict_probe_waits_total{basis}`: probes (at ADD or ahead of
    /// it) by what their wait was sized from ([`WaitBasis`]).
    pub waits: Family<[(&'static str, &'static str); 1], Counter>,
    /// `conflict_probe_add_verdicts_total{source}`: ADDs by where their
    /// verdict came from (`ahead`: a probe made before the ADD; `at_add`:
    /// one the ADD sent).
    pub add_verdicts: Family<[(&'static str, &'static str); 1], Counter>,
}

impl ProbeMetrics {
    /// Registers the counters in `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "conflict_probe_waits",
            "Conflict probes (sent by an ADD or ahead of it) by what their wait for an answer was sized from (reply_time, no_reply_time, seen_on_wire)",
            self.waits.clone(),
        );
        registry.register(
            "conflict_probe_add_verdicts",
            "ADDs by where their conflict verdict came from (ahead: a probe sent before the ADD, checked against the wire inventory since; at_add: a probe the ADD sent)",
            self.add_verdicts.clone(),
        );
    }
}

/// A running probe, as the ADD that started it sees it (or, probed ahead
/// of the ADD, as everyone who asks sees it).
#[derive(Clone)]
pub struct Probing {
    shared: Arc<Shared>,
    /// The probe's window: the ADD never waits longer than this.
    window: Duration,
}

struct Shared {
    state: Mutex<State>,
    changed: tokio::sync::Notify,
    /// The probe frames, once built: sent again halfway through the window.
    frames: Mutex<Vec<Vec<u8>>>,
    /// The uplink's interface index, once its socket is open.
    uplink_index: std::sync::OnceLock<u32>,
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
    /// The wait ended without an answer: the ADD goes on.
    Released,
}

impl Probing {
    /// Starts `plan` on a blocking thread. Call inside a Tokio runtime.
    #[must_use]
    pub fn start(plan: ProbePlan, context: ProbeContext) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::Waiting),
            changed: tokio::sync::Notify::new(),
            frames: Mutex::new(Vec::new()),
            uplink_index: std::sync::OnceLock::new(),
        });
        let ProbeContext {
            host,
            reply_times,
            seen_on_wire,
            metrics,
        } = context;
        let window = plan.window;
        let uplink = plan.uplink.clone();
        let thread_shared = Arc::clone(&shared);
        let started = Instant::now();
        let thread_host = host.clone();
        tokio::task::spawn_blocking(move || {
            let listened = crate::netns::run_in_netns_or_here(thread_host, || {
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
            thread_shared.settle(outcome);
        });
        let again = Arc::clone(&shared);
        tokio::spawn(async move {
            tokio::time::sleep(window / 2).await;
            again.send_again(host, uplink).await;
        });
        Self { shared, window }
    }

    /// The index of the uplink probed from; `None` before the probe's
    /// socket was open, or when there is no such uplink.
    #[must_use]
    pub fn uplink_index(&self) -> Option<u32> {
        self.shared.uplink_index.get().copied()
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

    /// Ends the probe with `outcome`, unless the ADD went on already.
    fn settle(&self, outcome: Result<Option<ForeignClaim>, ProbeError>) {
        let mut state = self.state.lock().expect("probe state lock poisoned");
        if matches!(*state, State::Waiting) {
            *state = match outcome {
                Ok(Some(claim)) => State::Claimed(claim),
                Ok(None) => State::Clear,
                Err(error) => State::Failed(error.to_string()),
            };
        } else if let Err(error) = outcome {
            tracing::warn!(%error, "the conflict probe failed after the ADD's wait");
        }
        drop(state);
        self.changed.notify_waiters();
    }

    /// Sends the probes once more, from `uplink` in `host`, when the ADD
    /// went on without an answer: a slow host's answer then reaches the
    /// uplink program, which reports the conflict.
    async fn send_again(&self, host: Option<std::path::PathBuf>, uplink: String) {
        if !matches!(
            *self.state.lock().expect("probe state lock poisoned"),
            State::Released
        ) {
            return;
        }
        let frames = std::mem::take(&mut *self.frames.lock().expect("probe frames lock poisoned"));
        let sent = tokio::task::spawn_blocking(move || {
            crate::netns::run_in_netns_or_here(host, || {
                let socket = crate::packet::RawSocket::open(&uplink)?;
                frames.iter().try_for_each(|frame| socket.send(frame))
            })
        })
        .await;
        if let Ok(Ok(Err(error))) = sent {
            tracing::debug!(%error, "cannot send the conflict probe again");
        }
    }
}

/// Sends the probes of `addrs` out of `uplink` (in `host`) without
/// listening: their answers reach the uplink program, which reports any as
/// a conflict of the pod holding the address. Blocks.
///
/// # Errors
/// The uplink's namespace, its socket or a frame failed.
pub fn send_probes(
    host: Option<PathBuf>,
    uplink: &str,
    addrs: &[IpAddr],
) -> Result<(), ProbeError> {
    crate::netns::run_in_netns_or_here(host, || {
        let socket = crate::packet::RawSocket::open(uplink)?;
        let own_mac = socket.hardware_address()?;
        for addr in addrs {
            socket.send(&probe_frame(own_mac, *addr)?)?;
        }
        Ok(())
    })
    .map_err(|error| ProbeError::Namespace(error.to_string()))?
}

/// Sends the probes (and the reference's) and decides the ADD's verdict at
/// the end of its wait: the first claim on one of the addresses that
/// reached the node in time; `None` when none did (the ADD then went on),
/// or when the uplink does not exist (yet).
fn listen(
    started: Instant,
    plan: &ProbePlan,
    reply_times: &ReplyTimes,
    seen_on_wire: &dyn Fn(u32, IpAddr) -> bool,
    metrics: &ProbeMetrics,
    shared: &Shared,
) -> Result<Option<ForeignClaim>, ProbeError> {
    let socket = match probe_socket(&plan.uplink) {
        Ok(socket) => socket,
        Err(RawSocketError::NoInterface { .. }) => return Ok(None),
        Err(error) => return Err(error.into()),
    };
    let (ifindex, own_mac) = (socket.ifindex(), socket.hardware_address()?);
    let _ = shared.uplink_index.set(ifindex);
    socket.timestamp_arrivals()?;
    let frames = plan
        .addrs
        .iter()
        .chain(&plan.reference)
        .map(|addr| probe_frame(own_mac, *addr))
        .collect::<Result<Vec<_>, _>>()?;
    let (sent, sent_at) = (Instant::now(), SystemTime::now());
    for frame in &frames {
        socket.send(frame)?;
    }
    *shared.frames.lock().expect("probe frames lock poisoned") = frames;
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
    let mut sampled = reference.is_empty();
    let mut buffer = [0u8; 2048];
    // A frame read: the reference's answer is a sample (by its arrival
    // time, however late it is read), a claim the verdict.
    let mut read = |buffer: &[u8], received: Received| {
        if !sampled && claim_in(buffer, received, &reference, own_mac).is_some() {
            sampled = true;
            let took = received
                .arrived
                .and_then(|arrived| arrived.duration_since(sent_at).ok())
                .unwrap_or_else(|| sent.elapsed());
            tracing::debug!(uplink = %plan.uplink, ?took, "the reference answered the conflict probe");
            reply_times.record(&plan.uplink, took);
            return None;
        }
        claim_in(buffer, received, &plan.addrs, own_mac)
    };
    loop {
        let elapsed = sent.elapsed();
        if elapsed >= wait {
            // Every frame that reached the node in time is read before the
            // ADD goes on, however late this thread runs.
            while let Some(received) = socket.receive(&mut buffer, Duration::ZERO)? {
                if let Some(claim) = read(&buffer, received) {
                    return Ok(Some(claim));
                }
            }
            if !sampled && basis == WaitBasis::ReplyTime {
                // A reference that answered before and not within this
                // wait: at least this slow now, so the next waits grow.
                reply_times.record(&plan.uplink, wait);
            }
            shared.release();
            tracing::debug!(uplink = %plan.uplink, since_start = ?started.elapsed(), "no answer to the conflict probe in time; the ADD goes on");
            return Ok(None);
        }
        let Some(received) = socket.receive(&mut buffer, wait - elapsed)? else {
            continue;
        };
        if let Some(claim) = read(&buffer, received) {
            return Ok(Some(claim));
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
