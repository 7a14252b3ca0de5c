//! Where a CNI command spends its time: every step of ADD and DEL runs in
//! a `tracing` span named after its phase ([`phase`]), inside the span of
//! its command ([`command`]). The [`PhaseTimings`] layer turns the wall
//! time of each phase span into the `flatnet_agent_cni_phase_seconds`
//! histogram (labels `command`, `phase`), so the breakdown is on
//! `/metrics` in production and read by `cargo xtask bench cni`.

use std::{
    sync::LazyLock,
    time::{Duration, Instant},
};

use prometheus_client::metrics::{
    family::Family,
    histogram::{Histogram, exponential_buckets},
};
use tracing::{
    Span, Subscriber,
    field::{Field, Visit},
    span::{Attributes, Id},
};
use tracing_subscriber::{Layer, layer::Context, registry::LookupSpan};

/// Target of command and phase spans (what [`PhaseTimings`] listens to).
pub const TARGET: &str = "flatnet::phase";

/// Name of the span around one whole CNI command.
const COMMAND_SPAN: &str = "cni_command";
/// Name of the span around one phase.
const PHASE_SPAN: &str = "cni_phase";
/// The phase label of a whole command.
pub const TOTAL: &str = "total";

/// Histogram labels: (`command`, `phase`).
pub type PhaseLabels = [(&'static str, String); 2];

/// Phase durations by command and phase.
pub type PhaseHistograms = Family<PhaseLabels, Histogram, fn() -> Histogram>;

/// The process's phase histograms (one tracing subscriber per process,
/// so one set of histograms).
pub static PHASE_SECONDS: LazyLock<PhaseHistograms> =
    LazyLock::new(|| Family::new_with_constructor(new_histogram));

/// 20 µs to about 0.65 s, doubling.
fn new_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.000_02, 2.0, 16))
}

/// The span of one CNI command (`add`, `del`, ...); phases opened inside
/// it are counted under that command. The command's own wall time is its
/// `total` phase.
pub fn command(name: &'static str) -> Span {
    tracing::info_span!(target: TARGET, COMMAND_SPAN, command = name)
}

/// The span of one phase of the current command.
pub fn phase(name: &'static str) -> Span {
    tracing::info_span!(target: TARGET, PHASE_SPAN, phase = name)
}

/// Runs `work` inside the span of phase `name`.
pub fn timed<T>(name: &'static str, work: impl FnOnce() -> T) -> T {
    phase(name).in_scope(work)
}

/// Records the wall time of command and phase spans into
/// [`PHASE_SECONDS`]. Install it next to the log layer, unfiltered by the
/// log level, so timings do not depend on what is logged.
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseTimings;

/// Kept in a timed span's extensions from creation to close.
struct Started {
    command: String,
    phase: String,
    at: Instant,
}

impl<S> Layer<S> for PhaseTimings
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let metadata = attrs.metadata();
        if metadata.target() != TARGET {
            return;
        }
        let Some(span) = ctx.span(id) else {
            return;
        };
        let mut names = Names::default();
        attrs.record(&mut names);
        let started = match (metadata.name(), names.command, names.phase) {
            (COMMAND_SPAN, Some(command), _) => Started {
                command,
                phase: TOTAL.to_owned(),
                at: Instant::now(),
            },
            (PHASE_SPAN, _, Some(phase)) => {
                // The command is that of the nearest command span above.
                let command = span
                    .scope()
                    .skip(1)
                    .find(|parent| parent.name() == COMMAND_SPAN)
                    .and_then(|parent| {
                        parent
                            .extensions()
                            .get::<Started>()
                            .map(|s| s.command.clone())
                    })
                    .unwrap_or_else(|| "other".to_owned());
                Started {
                    command,
                    phase,
                    at: Instant::now(),
                }
            }
            _ => return,
        };
        span.extensions_mut().insert(started);
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else {
            return;
        };
        if let Some(started) = span.extensions_mut().remove::<Started>() {
            observe(started.command, started.phase, started.at.elapsed());
        }
    }
}

/// Counts one `phase` of `command` that took `elapsed`.
fn observe(command: String, phase: String, elapsed: Duration) {
    PHASE_SECONDS
        .get_or_create(&[("command", command), ("phase", phase)])
        .observe(elapsed.as_secs_f64());
}

/// The `command` and `phase` fields of a span.
#[derive(Default)]
struct Names {
    command: Option<String>,
    phase: Option<String>,
}

impl Visit for Names {
    fn record_str(&mut self, field: &Field, value: &str) {
        match field.name() {
            "command" => self.command = Some(value.to_owned()),
            "phase" => self.phase = Some(value.to_owned()),
            _ => {}
        }
    }

    fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
}
