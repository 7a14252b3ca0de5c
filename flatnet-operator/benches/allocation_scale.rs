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
//! (one pod count per run, so the peak RSS is that run's).

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    ops::Range,
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

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

/// Workers per controller: the operator's default.
const WORKERS: u16 = 5;

/// The stated latency of every API request.
const LATENCY: Duration = Duration::from_millis(3);

/// The argument that makes this executable the fake API server.
const SERVE_FAKE: &str = "--serve-fake";

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
                "not addressed within 600 s: {addressed} of {want}"
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

fn per_pod(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, pods: usize) -> String {
    let mut parts = Vec::new();
    let mut writes = 0;
    for (verb, count) in after {
        let delta = count - before.get(verb).copied().unwrap_or(0);
        if matches!(verb.as_str(), "create" | "update" | "patch" | "delete") {
            writes += delta;
        }
        parts.push(format!("{verb} {:.2}", delta as f64 / pods as f64));
    }
    format!(
        "{} | writes {:.2}",
        parts.join(", "),
        writes as f64 / pods as f64
    )
}

/// The requests of a phase per verb, resource and reply code, per pod.
fn per_kind(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>, pods: usize) -> String {
    after
        .iter()
        .map(|(kind, count)| (kind, count - before.get(kind).copied().unwrap_or(0)))
        .filter(|(_, delta)| *delta > 0)
        .map(|(kind, delta)| format!("{kind}: {:.3}", delta as f64 / pods as f64))
        .collect::<Vec<_>>()
        .join(", ")
}

async fn run(pods: usize) {
    let fake = Fake::start();
    let stop = CancellationToken::new();
    let controllers = tokio::spawn(flatnet_operator::allocation::run(
        fake.client.clone(),
        Arc::new(Metrics::new()),
        Settings::default(),
        WORKERS,
        flatnet_operator::allocation::mac_pool::MacPoolView::default(),
        Arc::new(Health::default()),
        stop.clone(),
    ));
    let active = format!("/fake/subnet?name={SUBNET}");
    while fake.call("GET", &active).await["active"] != Value::Bool(true) {
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

    let state = fake.call("GET", &active).await;
    assert!(
        state["check"].is_null(),
        "ledger exact after the run: {}",
        state["check"]
    );
    let operator_rss = peak_rss_of("/proc/self/status");
    let fake_rss = fake.peak_rss_mib();
    stop.cancel();
    let _ = controllers.await;
    println!(
        "{pods} pods, {WORKERS} workers, {} ms per request",
        LATENCY.as_millis()
    );
    println!(
        "  all addressed: {first:.1} s | requests per pod: {}",
        per_pod(&before, &after_first, pods)
    );
    println!(
        "  half deleted and replaced, all addressed: {second:.1} s | requests per replaced pod: {}",
        per_pod(&after_first, &after_second, pods / 2)
    );
    println!(
        "  requests per pod by kind and reply, first phase: {}",
        per_kind(&kinds_before, &kinds_after_first, pods)
    );
    println!(
        "  requests per replaced pod by kind and reply: {}",
        per_kind(&kinds_after_first, &kinds_after_second, pods / 2)
    );
    println!(
        "  peak RSS: operator {operator_rss:.0} MiB, fake API server (own process) {fake_rss:.0} MiB"
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    if args.iter().any(|a| a == SERVE_FAKE) {
        runtime.block_on(serve_fake());
        return;
    }
    let pods: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let pods = if pods.is_empty() { vec![1000] } else { pods };
    for n in pods {
        runtime.block_on(run(n));
    }
}
