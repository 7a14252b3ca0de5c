//! Allocation at scale: the allocation controllers, run as the operator runs
//! them, against the fake API server with a per-request latency and lagging
//! watches. N pods are created at once in one subnet; once all are
//! addressed, half are deleted and as many new ones created at once.
//!
//! The fake API server runs in a process of its own (this executable,
//! started again with `--serve-fake`, serving HTTP on localhost), so the
//! peak RSS of this process is the operator's own: its controllers, caches
//! and client, plus a driver that only sends a few HTTP requests.
//!
//! Reports the seconds until every pod is addressed (both phases), the API
//! requests per pod by verb, and the peak RSS of the operator and of the
//! fake API server.
//!
//! `cargo bench -p flatnet-operator --features fake-api --bench allocation_scale -- 1000`
//! (one pod count per run, so the peak RSS is that run's);
//! `--reserve-ahead N` sets [`Settings::reserve_ahead`], `--json` ends the
//! output with one line of JSON holding the figures (what `cargo xtask
//! bench allocation` reads), `--create-only` stops after the first phase
//! (to profile it). The process counts its live heap (a counting global
//! allocator), reported beside the peak RSS: the difference is what the
//! allocator keeps.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    ops::Range,
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use allocation_scale_report::{Figures, Phase};
use flatnet_operator::{
    admin::Health,
    allocation::{
        Settings,
        fake_api::{FakeApiServer, Realism},
        fake_api_http,
        fake_cluster::subnet,
    },
    metrics::Metrics,
};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

mod allocation_scale_report;

/// Counts the live heap of this process (the operator's), beside the RSS.
mod heap {
    use std::{
        alloc::{GlobalAlloc, Layout, System},
        sync::atomic::{AtomicUsize, Ordering},
    };

    static LIVE: AtomicUsize = AtomicUsize::new(0);
    static PEAK: AtomicUsize = AtomicUsize::new(0);
    static LARGEST: AtomicUsize = AtomicUsize::new(0);

    /// The system allocator, counting.
    pub struct Counting;

    // SAFETY: every call is passed to the system allocator unchanged; the
    // counters only observe the sizes.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
            LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
            // SAFETY: as the caller's contract.
            unsafe { System.alloc(layout) }
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            // SAFETY: as the caller's contract.
            unsafe { System.dealloc(ptr, layout) }
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            if new_size >= layout.size() {
                let live = LIVE.fetch_add(new_size - layout.size(), Ordering::Relaxed) + new_size
                    - layout.size();
                PEAK.fetch_max(live, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
            LARGEST.fetch_max(new_size, Ordering::Relaxed);
            // SAFETY: as the caller's contract.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
    }

    fn mib(bytes: usize) -> f64 {
        bytes as f64 / (1024.0 * 1024.0)
    }

    /// Live heap now, its peak and the largest single allocation, in MiB.
    pub fn figures() -> (f64, f64, f64) {
        (
            mib(LIVE.load(Ordering::Relaxed)),
            mib(PEAK.load(Ordering::Relaxed)),
            mib(LARGEST.load(Ordering::Relaxed)),
        )
    }
}

#[global_allocator]
static ALLOCATOR: heap::Counting = heap::Counting;

/// Workers per controller: the operator's default.
const WORKERS: u16 = 5;

/// The stated latency of every API request.
const LATENCY: Duration = Duration::from_millis(3);

/// The argument that makes this executable the fake API server.
const SERVE_FAKE: &str = "--serve-fake";

/// The argument that ends the output with the figures as JSON.
const JSON: &str = "--json";

/// The argument that stops after the first phase (to profile it).
const CREATE_ONLY: &str = "--create-only";

/// The argument setting [`Settings::reserve_ahead`].
const RESERVE_AHEAD: &str = "--reserve-ahead";

/// The subnet of the run.
const SUBNET: &str = "scale";

fn realism() -> Realism {
    Realism {
        latency: LATENCY,
        watch_delay: Duration::from_millis(20),
        watch_spread: Duration::from_millis(30),
        burst: Duration::from_millis(10),
        history: 20_000,
        gc_delay: Duration::from_millis(50),
        seed: 1,
    }
}

/// The fake API server's process: serves on a free localhost port, which
/// it prints first.
async fn serve_fake() {
    let server = FakeApiServer::realistic(realism());
    server.insert(&subnet(SUBNET, "10.16.0.0/16", Some("10.16.0.1"), &[]));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    println!("{}", listener.local_addr().expect("address").port());
    fake_api_http::serve(server, listener).await.expect("serve");
}

/// The fake API server in its own process, and a client of it.
struct Fake {
    process: Child,
    client: kube::Client,
}

impl Fake {
    fn start() -> Self {
        let mut process = Command::new(std::env::current_exe().expect("own path"))
            .arg(SERVE_FAKE)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the fake API server");
        let mut port = String::new();
        BufReader::new(process.stdout.take().expect("stdout"))
            .read_line(&mut port)
            .expect("port");
        let url = format!("http://127.0.0.1:{}", port.trim());
        let config = kube::Config::new(url.parse().expect("url"));
        let client = kube::Client::try_from(config).expect("client");
        Self { process, client }
    }

    /// A request to the harness paths of the fake (`/fake/...`).
    async fn call(&self, method: &str, path: &str) -> Value {
        let request = http::Request::builder()
            .method(method)
            .uri(path)
            .body(Vec::new())
            .expect("request");
        let text = self.client.request_text(request).await.expect(path);
        serde_json::from_str(&text).unwrap_or(Value::Null)
    }

    async fn requests_by_verb(&self) -> BTreeMap<String, u64> {
        serde_json::from_value(self.call("GET", "/fake/requests").await).expect("counts")
    }

    /// Requests per verb, resource and reply code.
    async fn requests_by_kind(&self) -> BTreeMap<String, u64> {
        serde_json::from_value(self.call("GET", "/fake/requests/kinds").await).expect("counts")
    }

    /// Whether the operator watches pods and records (after listing them):
    /// one pod watch, three record watches (the record controller's and the
    /// pod and subnet controllers' triggers).
    async fn watched(&self) -> bool {
        let kinds = self.requests_by_kind().await;
        let count = |kind: &str| kinds.get(kind).copied().unwrap_or(0);
        count("watch pods 200") >= 1 && count("watch flatnetworkips 200") >= 3
    }

    /// Seconds until the records are exactly those of the pods `live`, all
    /// holding an address (so the records of deleted pods are gone too).
    async fn until_addressed(&self, live: Range<usize>, started: Instant) -> f64 {
        let want = live.len() as u64;
        let path = format!("/fake/progress?from={}&to={}", live.start, live.end);
        loop {
            let progress = self.call("GET", &path).await;
            let addressed = progress["addressed"].as_u64().unwrap_or(0);
            if progress["records"].as_u64() == Some(want) && addressed == want {
                return started.elapsed().as_secs_f64();
            }
            assert!(
                started.elapsed() < Duration::from_secs(600),
                "pods {}..{} not addressed within 600 s: {addressed} of {want} (records: {})",
                live.start,
                live.end,
                progress["records"]
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Peak RSS of the fake's process, in MiB.
    fn peak_rss_mib(&self) -> f64 {
        peak_rss_of(&format!("/proc/{}/status", self.process.id()))
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// Peak resident set size (`VmHWM`) in a `/proc/<pid>/status`, in MiB.
fn peak_rss_of(status: &str) -> f64 {
    let status = std::fs::read_to_string(status).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

/// The requests of a phase by key (verb, or verb, resource and reply), per pod.
fn per_pod(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    pods: usize,
) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(verb, count)| {
            let delta = count - before.get(verb).copied().unwrap_or(0);
            (verb.clone(), delta as f64 / pods as f64)
        })
        .collect()
}

/// The writes among requests per pod by verb.
fn writes(per_verb: &BTreeMap<String, f64>) -> f64 {
    per_verb
        .iter()
        .filter(|(verb, _)| matches!(verb.as_str(), "create" | "update" | "patch" | "delete"))
        .map(|(_, share)| share)
        .sum()
}

fn show(per_verb: &BTreeMap<String, f64>) -> String {
    let parts: Vec<String> = per_verb
        .iter()
        .map(|(verb, share)| format!("{verb} {share:.2}"))
        .collect();
    format!("{} | writes {:.2}", parts.join(", "), writes(per_verb))
}

/// The requests of a phase per verb, resource and reply code, per pod:
/// those the phase made only.
fn per_kind(
    before: &BTreeMap<String, u64>,
    after: &BTreeMap<String, u64>,
    pods: usize,
) -> BTreeMap<String, f64> {
    per_pod(before, after, pods)
        .into_iter()
        .filter(|(_, share)| *share > 0.0)
        .collect()
}

fn show_kinds(per_kind: &BTreeMap<String, f64>) -> String {
    per_kind
        .iter()
        .map(|(kind, share)| format!("{kind}: {share:.3}"))
        .collect::<Vec<_>>()
        .join(", ")
}

async fn run(pods: usize, settings: Settings) -> Option<Figures> {
    let fake = Fake::start();
    let stop = CancellationToken::new();
    let controllers = tokio::spawn(flatnet_operator::allocation::run(
        fake.client.clone(),
        Arc::new(Metrics::new()),
        settings.clone(),
        WORKERS,
        flatnet_operator::allocation::mac_pool::MacPoolView::default(),
        Arc::new(Health::default()),
        stop.clone(),
    ));
    let active = format!("/fake/subnet?name={SUBNET}");
    // The pods come to an operator that has listed pods and records and
    // watches them, as in a running cluster (an operator starting among
    // existing pods lists them in pages instead).
    while !fake.watched().await || fake.call("GET", &active).await["active"] != Value::Bool(true) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let before = fake.requests_by_verb().await;
    let kinds_before = fake.requests_by_kind().await;
    let started = Instant::now();
    fake.call(
        "POST",
        &format!("/fake/pods?subnet={SUBNET}&from=0&to={pods}"),
    )
    .await;
    let first = fake.until_addressed(0..pods, started).await;
    let heap_after_first = heap::figures();
    if std::env::args().any(|a| a == CREATE_ONLY) {
        let (live, peak, largest) = heap_after_first;
        println!(
            "{pods} pods addressed in {first:.1} s; operator peak RSS {:.0} MiB, \
             heap live {live:.1} MiB, peak {peak:.1} MiB, largest allocation {largest:.1} MiB",
            peak_rss_of("/proc/self/status")
        );
        stop.cancel();
        let _ = controllers.await;
        return None;
    }
    let after_first = fake.requests_by_verb().await;
    let kinds_after_first = fake.requests_by_kind().await;

    let started = Instant::now();
    fake.call("DELETE", &format!("/fake/pods?from=0&to={}", pods / 2))
        .await;
    fake.call(
        "POST",
        &format!(
            "/fake/pods?subnet={SUBNET}&from={pods}&to={}",
            pods + pods / 2
        ),
    )
    .await;
    let second = fake
        .until_addressed(pods / 2..pods + pods / 2, started)
        .await;
    let after_second = fake.requests_by_verb().await;
    let kinds_after_second = fake.requests_by_kind().await;

    // The releases of the last deleted records may still be in their
    // ledger write when the last new pod is addressed: the ledger must be
    // exact within a few seconds, as a user checking `usedIPCount` sees.
    let addressed = Instant::now();
    let exact_within = Duration::from_secs(5);
    loop {
        let state = fake.call("GET", &active).await;
        if state["check"].is_null() {
            break;
        }
        assert!(
            addressed.elapsed() < exact_within,
            "ledger exact within {exact_within:?} of the run's end: {}",
            state["check"]
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "  ledger exact {:.0} ms after the last pod was addressed",
        addressed.elapsed().as_secs_f64() * 1000.0
    );
    let operator_rss = peak_rss_of("/proc/self/status");
    let heap = heap::figures();
    let fake_rss = fake.peak_rss_mib();
    stop.cancel();
    let _ = controllers.await;
    let phase = |seconds, before, after, kinds_before, kinds_after, pods| {
        let per_verb = per_pod(before, after, pods);
        Phase {
            seconds,
            writes: writes(&per_verb),
            per_verb,
            per_kind: per_kind(kinds_before, kinds_after, pods),
        }
    };
    let figures = Figures {
        pods,
        workers: WORKERS,
        latency_ms: u64::try_from(LATENCY.as_millis()).unwrap_or(u64::MAX),
        reserve_ahead: settings.reserve_ahead,
        create: phase(
            first,
            &before,
            &after_first,
            &kinds_before,
            &kinds_after_first,
            pods,
        ),
        replace: phase(
            second,
            &after_first,
            &after_second,
            &kinds_after_first,
            &kinds_after_second,
            pods / 2,
        ),
        operator_peak_rss_mib: operator_rss,
        operator_peak_heap_mib: heap.1,
        fake_peak_rss_mib: fake_rss,
    };
    println!(
        "{pods} pods, {WORKERS} workers, {} ms per request, reserving ahead {}",
        LATENCY.as_millis(),
        settings.reserve_ahead
    );
    println!(
        "  all addressed: {first:.1} s | requests per pod: {}",
        show(&figures.create.per_verb)
    );
    println!(
        "  half deleted and replaced, all addressed: {second:.1} s | requests per replaced pod: {}",
        show(&figures.replace.per_verb)
    );
    println!(
        "  requests per pod by kind and reply, first phase: {}",
        show_kinds(&figures.create.per_kind)
    );
    println!(
        "  requests per replaced pod by kind and reply: {}",
        show_kinds(&figures.replace.per_kind)
    );
    println!(
        "  peak RSS: operator {operator_rss:.0} MiB, fake API server (own process) {fake_rss:.0} MiB"
    );
    println!(
        "  operator heap: live {:.1} MiB once all were first addressed, {:.1} MiB at the end; peak {:.1} MiB; largest allocation {:.1} MiB",
        heap_after_first.0, heap.0, heap.1, heap.2
    );
    Some(figures)
}

fn main() {
    // `RUST_LOG=flatnet_operator=debug` shows the operator's log (stderr).
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    if args.iter().any(|a| a == SERVE_FAKE) {
        runtime.block_on(serve_fake());
        return;
    }
    let mut settings = Settings {
        // No node sets the pods up here: none may time out during the run.
        pending_timeout: Duration::from_secs(3600),
        ..Settings::default()
    };
    let mut pods = Vec::new();
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        if arg == RESERVE_AHEAD {
            let value = args.next().map(|v| v.parse());
            let Some(Ok(records)) = value else {
                panic!("{RESERVE_AHEAD} takes a number of records");
            };
            settings.reserve_ahead = records;
        } else if let Ok(count) = arg.parse() {
            pods.push(count);
        }
    }
    let json = std::env::args().any(|a| a == JSON);
    if pods.is_empty() {
        pods.push(1000);
    }
    for n in pods {
        let figures = runtime.block_on(run(n, settings.clone()));
        if let Some(figures) = figures.filter(|_| json) {
            println!(
                "{}",
                serde_json::to_string(&figures).expect("figures serialize")
            );
        }
    }
}
