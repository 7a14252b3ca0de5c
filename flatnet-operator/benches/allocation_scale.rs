//! Allocation at scale: the allocation controllers, run as the operator runs
//! them, against the fake API server with a per-request latency and lagging
//! watches. N pods are created at once in one subnet; once all are
//! addressed, half are deleted and as many new ones created at once.
//!
//! Reports the seconds until every pod is addressed (both phases), the API
//! requests per pod by verb, and the process's peak RSS (operator and fake
//! API server together: an upper bound for the operator).
//!
//! `cargo bench -p flatnet-operator --features fake-api --bench allocation_scale -- 1000`
//! (one pod count per run, so the peak RSS is that run's).

use std::{
    collections::BTreeMap,
    ops::Range,
    time::{Duration, Instant},
};

use flatnet_k8s::api::FlatNetworkIP;
use flatnet_operator::allocation::{
    Settings,
    fake_api::{FakeApiServer, Realism},
    fake_cluster::{FakeCluster, subnet},
};

/// Workers per controller: the operator's default.
const WORKERS: u16 = 5;

/// The stated latency of every API request.
const LATENCY: Duration = Duration::from_millis(3);

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

/// The index `i` of a record named `pod-<i>`.
fn index(record: &serde_json::Value) -> Option<usize> {
    record["metadata"]["name"]
        .as_str()?
        .strip_prefix("pod-")?
        .parse()
        .ok()
}

/// Live records (no deletionTimestamp) of the pods `live` holding an address.
fn addressed(server: &FakeApiServer, live: &Range<usize>) -> usize {
    server.count::<FlatNetworkIP>(|v| {
        v["metadata"]["deletionTimestamp"].is_null()
            && v["status"]["addr"].is_string()
            && index(v).is_some_and(|i| live.contains(&i))
    })
}

/// Seconds until the records are exactly those of the pods `live`, all
/// holding an address (so the records of deleted pods are gone too).
async fn until_addressed(server: &FakeApiServer, live: Range<usize>, started: Instant) -> f64 {
    let want = live.len();
    loop {
        if server.count::<FlatNetworkIP>(|_| true) == want && addressed(server, &live) == want {
            return started.elapsed().as_secs_f64();
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "not addressed within 600 s: {} of {want}",
            addressed(server, &live)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Peak resident set size of this process, in MiB.
fn peak_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0)
}

fn per_pod(
    before: &BTreeMap<&'static str, u64>,
    after: &BTreeMap<&'static str, u64>,
    pods: usize,
) -> String {
    let mut parts = Vec::new();
    let mut writes = 0;
    for (verb, count) in after {
        let delta = count - before.get(verb).copied().unwrap_or(0);
        if matches!(*verb, "create" | "update" | "patch" | "delete") {
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

async fn run(pods: usize) {
    let server = FakeApiServer::realistic(realism());
    server.insert(&subnet("scale", "10.16.0.0/16", Some("10.16.0.1"), &[]));
    let cluster = FakeCluster::start(server.clone(), Settings::default(), WORKERS);
    cluster
        .wait_active("scale", Duration::from_secs(30))
        .await
        .expect("subnet Active");

    let before = server.requests_by_verb();
    let started = Instant::now();
    for i in 0..pods {
        cluster.create_pod(&format!("pod-{i}"), "scale");
    }
    let first = until_addressed(&server, 0..pods, started).await;
    let after_first = server.requests_by_verb();

    let started = Instant::now();
    for i in 0..pods / 2 {
        cluster.delete_pod(&format!("pod-{i}"));
    }
    for i in pods..pods + pods / 2 {
        cluster.create_pod(&format!("pod-{i}"), "scale");
    }
    let second = until_addressed(&server, pods / 2..pods + pods / 2, started).await;
    let after_second = server.requests_by_verb();

    let view = cluster.view("scale");
    view.check().expect("ledger exact after the run");
    cluster.stop().await;
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
        "  peak RSS (operator and fake API server): {:.0} MiB",
        peak_rss_mib()
    );
}

fn main() {
    let pods: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let pods = if pods.is_empty() { vec![1000] } else { pods };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    for n in pods {
        runtime.block_on(run(n));
    }
}
