//! The allocation controllers as the operator runs them (watches, caches,
//! workers) against the fake API server behaving like a real one: late and
//! bursty watch events, lagging caches, asynchronous garbage collection,
//! 410 Gone. The invariants of the ledger are checked at every quiet point.

use std::time::Duration;

use super::{
    Settings,
    fake_api::{FakeApiServer, Realism},
    fake_cluster::{FakeCluster, subnet},
};

/// Subnet of these tests: 241 allocatable addresses, gateway .1.
const SUBNET: &str = "churn";

/// How long after the last change a quiet point must be reached, and the
/// ledger be right: seconds, where the leak lasted the orphan grace (10
/// minutes); generous for a loaded machine.
const SETTLE: Duration = Duration::from_secs(15);

/// A server that lags as a loaded real one does.
fn lagging(seed: u64) -> FakeApiServer {
    FakeApiServer::realistic(realism(seed))
}

/// The delays of [`lagging`].
fn realism(seed: u64) -> Realism {
    Realism {
        latency: Duration::from_millis(1),
        watch_delay: Duration::from_millis(5),
        watch_spread: Duration::from_millis(60),
        burst: Duration::from_millis(10),
        history: 400,
        gc_delay: Duration::from_millis(30),
        seed,
    }
}

async fn started(seed: u64) -> FakeCluster {
    let server = lagging(seed);
    server.insert(&subnet(
        SUBNET,
        "10.9.0.0/24",
        Some("10.9.0.1"),
        &[("10.9.0.10", "10.9.0.250")],
    ));
    let cluster = FakeCluster::start(server, Settings::default(), 8);
    cluster
        .wait_active(SUBNET, Duration::from_secs(10))
        .await
        .unwrap();
    cluster
}

/// An operator starting among existing pods, more than one page of list
/// (the fake pages lists as a real server does), reports ready once its
/// caches have synced, and addresses the pods it found.
#[tokio::test]
async fn an_operator_starting_among_many_pods_becomes_ready() {
    // A history longer than the startup burst of changes (about 3,700):
    // watches that fall behind relist (see the test below), and a relist of
    // 1,100 pods reconciles every pod again; this test is about the paged
    // first list and readiness.
    let server = FakeApiServer::realistic(Realism {
        history: 20_000,
        ..realism(3)
    });
    server.insert(&subnet(
        SUBNET,
        "10.9.0.0/21",
        Some("10.9.0.1"),
        &[("10.9.0.10", "10.9.7.250")],
    ));
    // kube's watcher lists 500 objects a page.
    let pods = 1_100;
    for i in 0..pods {
        server.insert(&super::fake_cluster::pod(&format!("pod-{i}"), SUBNET));
    }
    let cluster = FakeCluster::start(server, Settings::default(), 5);
    assert!(
        !cluster.health.is_ready(),
        "not ready before the caches sync"
    );
    let deadline = tokio::time::Instant::now() + SETTLE;
    while !cluster.health.is_ready() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the allocation controllers never reported ready"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let view = cluster.settle(SUBNET, SETTLE * 4).await.unwrap();
    assert_eq!(view.addressed.len(), pods);
    cluster.stop().await;
}

/// The scenario: N pods, half deleted, the ledger right within a
/// few seconds (not after the orphan grace), the other half created.
#[tokio::test]
async fn deleting_half_the_pods_frees_their_addresses_at_once() {
    let cluster = started(7).await;
    for i in 0..40 {
        cluster.create_pod(&format!("pod-{i}"), SUBNET);
    }
    let full = cluster.settle(SUBNET, SETTLE).await.unwrap();
    assert_eq!(full.used_ip_count, 41, "40 pods and the gateway");
    for i in 0..20 {
        cluster.delete_pod(&format!("pod-{i}"));
    }
    let half = cluster.settle(SUBNET, SETTLE).await.unwrap();
    assert_eq!(half.addressed.len(), 20);
    assert_eq!(half.used_ip_count, 21, "usedIPCount follows the deletions");
    for i in 40..60 {
        cluster.create_pod(&format!("pod-{i}"), SUBNET);
    }
    let refilled = cluster.settle(SUBNET, SETTLE).await.unwrap();
    assert_eq!(refilled.used_ip_count, 41);
    cluster.stop().await;
}

/// Requests of kinds starting with `prefix` (such as `create flatnetworkips`)
/// between two counts of [`FakeApiServer::requests_by_kind`], any reply.
fn delta(
    before: &std::collections::BTreeMap<String, u64>,
    after: &std::collections::BTreeMap<String, u64>,
    prefix: &str,
) -> u64 {
    after
        .iter()
        .filter(|(kind, _)| kind.starts_with(prefix))
        .map(|(kind, n)| n - before.get(kind).copied().unwrap_or(0))
        .sum()
}

/// Replacing pods costs what creating them costs plus the release: per
/// replaced pod one record creation (tried once), no Event, and a bounded number of
/// writes, however the deletions and creations interleave (a count, not a
/// timing).
#[tokio::test]
async fn replacing_half_the_pods_repeats_no_creation_and_no_event() {
    const PODS: usize = 100;
    let cluster = started(11).await;
    for i in 0..PODS {
        cluster.create_pod(&format!("pod-{i}"), SUBNET);
    }
    cluster.settle(SUBNET, SETTLE).await.unwrap();
    let before = cluster.server.requests_by_kind();
    for i in 0..PODS / 2 {
        cluster.delete_pod(&format!("pod-{i}"));
        cluster.create_pod(&format!("pod-{}", PODS + i), SUBNET);
    }
    let replaced = cluster.settle(SUBNET, SETTLE).await.unwrap();
    assert_eq!(replaced.addressed.len(), PODS);
    let after = cluster.server.requests_by_kind();
    let changed: Vec<String> = after
        .iter()
        .map(|(kind, n)| (kind, n - before.get(kind).copied().unwrap_or(0)))
        .filter(|(_, n)| *n > 0)
        .map(|(kind, n)| format!("{kind}: {n}"))
        .collect();
    println!("requests while replacing {} pods: {changed:?}", PODS / 2);
    let per_pod = |prefix: &str| delta(&before, &after, prefix) as f64 / (PODS / 2) as f64;
    assert_eq!(
        delta(&before, &after, "create flatnetworkips 201"),
        (PODS / 2) as u64,
        "one record created per new pod, none again for a deleted one"
    );
    assert_eq!(
        delta(&before, &after, "create flatnetworkips "),
        (PODS / 2) as u64,
        "no record creation tried twice (refused with 409) while the record \
         cache lags behind the controller's own create"
    );
    assert_eq!(per_pod("create events "), 0.0, "no Event in a healthy run");
    let writes: f64 = ["create ", "update ", "patch ", "delete "]
        .iter()
        .map(|verb| per_pod(verb))
        .sum();
    // The finalizer's removal, the record's creation and its status write,
    // and at most one ledger write for the release and one for the
    // reservation (fewer when batched).
    assert!(writes <= 5.0, "writes per replaced pod: {writes}");
    cluster.stop().await;
}

/// xorshift64: seeded choices without a dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        usize::try_from(self.0 % n.max(1) as u64).unwrap_or_default()
    }
}

/// `ops` random creations and deletions in bursts of up to `burst`, with
/// the invariants checked at the quiet point after each burst.
async fn churn(seed: u64, ops: usize, burst: usize) {
    println!("churn seed {seed} (FLATNET_CHURN_SEED={seed} replays it)");
    let cluster = started(seed).await;
    let mut rng = Rng(seed | 1);
    let mut live: Vec<String> = Vec::new();
    let mut next = 0;
    let mut done = 0;
    while done < ops {
        let this_burst = 1 + rng.below(burst);
        for _ in 0..this_burst {
            // Mostly creations while few pods live, mostly deletions near
            // the cap, so addresses are reused over and over.
            let create = live.len() < 20 || (live.len() < 150 && rng.below(2) == 0);
            if create {
                let name = format!("pod-{next}");
                next += 1;
                cluster.create_pod(&name, SUBNET);
                live.push(name);
            } else {
                let victim = live.swap_remove(rng.below(live.len()));
                cluster.delete_pod(&victim);
            }
        }
        done += this_burst;
        if let Err(broken) = cluster.settle(SUBNET, SETTLE).await {
            panic!("seed {seed}, after {done} operations: {broken}");
        }
    }
    cluster.stop().await;
}

fn seed() -> u64 {
    super::fake_cluster::seed_from_env("FLATNET_CHURN_SEED")
}

#[tokio::test]
async fn churn_keeps_the_ledger_exact() {
    churn(seed(), 600, 40).await;
}

#[tokio::test]
#[ignore = "long: 6,000 operations; run with --ignored"]
async fn long_churn_keeps_the_ledger_exact() {
    churn(seed(), 6000, 60).await;
}

/// Pods created at once produce more changes than the server's history
/// holds while the watches deliver them late: the watches get 410 Gone and
/// relist, and every pod is still addressed, the ledger exact. (The fake
/// once skipped the changes compacted while a burst waited, without a 410:
/// pods and records created then never reached the caches, and were never
/// addressed.)
#[tokio::test]
async fn a_burst_outrunning_the_watch_history_is_addressed_in_full() {
    let server = lagging(5);
    server.insert(&subnet(
        SUBNET,
        "10.9.0.0/21",
        Some("10.9.0.1"),
        &[("10.9.0.10", "10.9.7.250")],
    ));
    let cluster = FakeCluster::start(server, Settings::default(), 5);
    cluster
        .wait_active(SUBNET, Duration::from_secs(10))
        .await
        .unwrap();
    let before = cluster.server.requests_by_kind();
    for i in 0..400 {
        cluster.create_pod(&format!("pod-{i}"), SUBNET);
    }
    let full = cluster.settle(SUBNET, SETTLE * 2).await.unwrap();
    assert_eq!(full.addressed.len(), 400);
    let after = cluster.server.requests_by_kind();
    assert!(
        delta(&before, &after, "list flatnetworkips") > 0,
        "the burst outran the history (400 changes): the record watches relisted"
    );
    assert_eq!(
        delta(&before, &after, "create flatnetworkips 409"),
        0,
        "no record creation tried again while the record cache lagged"
    );
    for i in 0..200 {
        cluster.delete_pod(&format!("pod-{i}"));
    }
    for i in 400..600 {
        cluster.create_pod(&format!("pod-{i}"), SUBNET);
    }
    let replaced = cluster.settle(SUBNET, SETTLE * 2).await.unwrap();
    assert_eq!(replaced.used_ip_count, 401);
    cluster.stop().await;
}
