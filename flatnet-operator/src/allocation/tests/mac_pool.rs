//! The MAC pool in allocation: pods that name no MAC get one from the pool,
//! recorded on their FlatNetworkIP and unique on the parent link even when
//! two allocators race; freed MACs are quarantined; namespaces opt out.

use std::collections::BTreeMap;

use flatnet_k8s::{
    api::MacPoolMode,
    ipam::{Mac, MacRange},
    keys::label,
    validation::ParentLink,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;

use super::*;
use crate::allocation::{mac_ledger, mac_pool::ActivePool};

/// A pool of eight MACs: small, so racing allocators collide (and too
/// small to claim MACs ahead).
fn pool(mode: MacPoolMode) -> ActivePool {
    ActivePool {
        range: MacRange::parse("02:aa:00:00:00:01", "02:aa:00:00:00:08").unwrap(),
        mode,
    }
}

/// A pool of 16,777,216 MACs, as a cluster without a configured range
/// gets: claims take MACs ahead.
fn wide_pool() -> ActivePool {
    ActivePool {
        range: MacRange::locally_administered(0xaa00),
        mode: MacPoolMode::OptOut,
    }
}

/// Pod `name` in `subnet` naming no MAC, and its record.
fn plain_pod(name: &str, subnet: &str) -> (Pod, FlatNetworkIP) {
    pod_and_record(name, subnet, "")
}

/// A context whose MAC pool is `pool`, over what `server` holds now.
fn pool_context(
    server: &FakeApiServer,
    pool: ActivePool,
    namespaces: Vec<Namespace>,
) -> Arc<Context> {
    let mut caches = caches_from(server);
    caches.namespaces = store(namespaces).0;
    let ctx = context(server.client(), caches, Settings::default());
    ctx.mac_pool.set(Some(pool));
    ctx
}

/// One allocator with `pool`: `rounds` passes over its stale view (a new
/// context each: spare MACs claimed ahead are left behind, as by a leader
/// that goes).
async fn pool_allocator(server: FakeApiServer, pool: ActivePool, order_seed: u64, rounds: usize) {
    for _ in 0..rounds {
        let ctx = pool_context(&server, pool, Vec::new());
        let records: Vec<FlatNetworkIP> = server.list();
        for record in shuffled(&records, order_seed) {
            let _ = ips::reconcile(Arc::new(record), Arc::clone(&ctx)).await;
        }
    }
}

/// The pool MAC of each record holding an address, or why the state is
/// wrong: a MAC held twice, a record without a pool MAC, a ledger that
/// does not claim a record's MAC (for the pool, or for exactly that
/// record's pod).
fn pool_macs(server: &FakeApiServer) -> Result<BTreeMap<Mac, String>, String> {
    pool_macs_of(server, pool(MacPoolMode::OptOut).range)
}

/// [`pool_macs`] for MACs of `range`.
fn pool_macs_of(server: &FakeApiServer, range: MacRange) -> Result<BTreeMap<Mac, String>, String> {
    let mut holders: BTreeMap<Mac, String> = BTreeMap::new();
    for record in server.list::<FlatNetworkIP>() {
        let status = record.status.clone().unwrap_or_default();
        if status.addr.is_none() {
            continue;
        }
        if !status.mac_from_pool {
            return Err(format!(
                "{} has no MAC from the pool: {status:?}",
                record.name_any()
            ));
        }
        let mac = Mac::parse(&status.mac).map_err(|e| e.to_string())?;
        if !range.contains(mac) {
            return Err(format!("{mac} is outside the pool"));
        }
        if let Some(other) = holders.insert(mac, record.name_any()) {
            return Err(format!(
                "{mac} handed out twice: {other} and {}",
                record.name_any()
            ));
        }
    }
    let ledger = ledger_data(server);
    let for_pool = pool_claimed(&ledger);
    for (mac, holder) in &holders {
        if for_pool.contains(mac) {
            continue;
        }
        let claims = ledger
            .get(&mac.to_string().replace(':', "-"))
            .cloned()
            .unwrap_or_default();
        let claimants: Vec<&str> = claims
            .split_whitespace()
            .filter_map(|c| c.split_once('#').map(|(r, _)| r))
            .collect();
        if claimants.is_empty() || claimants.iter().any(|c| *c != format!("{NS}/{holder}")) {
            return Err(format!("{mac} of {holder} is claimed by {claimants:?}"));
        }
    }
    Ok(holders)
}

/// The MACs the ledger claims for the pool without an owner.
fn pool_claimed(ledger: &BTreeMap<String, String>) -> BTreeSet<Mac> {
    let text = ledger.get("pool.claimed").map_or("", String::as_str);
    text.split_whitespace()
        .flat_map(|entry| {
            let (start, end) = entry.split_once('-').unwrap_or((entry, entry));
            let (start, end) = (mac_value(start), mac_value(end));
            (start..=end).map(Mac::from_u64)
        })
        .collect()
}

fn mac_value(text: &str) -> u64 {
    Mac::parse(text).unwrap().to_u64()
}

/// The data of the `eth0` MAC ledger.
fn ledger_data(server: &FakeApiServer) -> BTreeMap<String, String> {
    let name = mac_ledger::ledger_name(&ParentLink {
        master: "eth0".into(),
        vlan: 0,
    });
    server
        .list::<ConfigMap>()
        .into_iter()
        .find(|m| m.metadata.name.as_deref() == Some(name.as_str()))
        .and_then(|m| m.data)
        .unwrap_or_default()
}

/// Two allocators with chaos give three pods in each of two sibling
/// subnets MACs from `pool`; the outcome of the race, and the MACs held
/// after a calm pass.
async fn pool_race(server: &FakeApiServer, pool: ActivePool, seed: u64) -> Result<usize, String> {
    server.insert(&sibling_subnet("left", "10.0.1.0/29"));
    server.insert(&sibling_subnet("right", "10.0.2.0/29"));
    // An existing ledger: every claim is a replace carrying a resourceVersion.
    server.insert(&ConfigMap {
        metadata: ObjectMeta {
            name: Some(mac_ledger::ledger_name(&ParentLink {
                master: "eth0".into(),
                vlan: 0,
            })),
            namespace: Some(SUBNET_NAMESPACE.into()),
            ..ObjectMeta::default()
        },
        ..ConfigMap::default()
    });
    for i in 0..3 {
        for subnet in ["left", "right"] {
            let (p, record) = plain_pod(&format!("{subnet}-{i}"), subnet);
            server.insert(&p);
            server.insert(&record);
        }
    }
    let a = pool_allocator(server.with_chaos(seed, 15), pool, seed, 2);
    let b = pool_allocator(
        server.with_chaos(seed ^ 0x5eed, 15),
        pool,
        seed.rotate_left(9),
        2,
    );
    futures::join!(a, b);
    pool_macs_of(server, pool.range)?;
    // Calm: claims of allocations that gave up midway go, then every pod
    // is looked at again.
    calm_repair(server).await;
    pool_allocator(server.clone(), pool, seed, 2).await;
    pool_macs_of(server, pool.range).map(|held| held.len())
}

#[tokio::test(flavor = "current_thread")]
async fn racing_allocators_never_hand_out_a_pool_mac_twice() {
    for (pool, name) in [(pool(MacPoolMode::OptOut), "small"), (wide_pool(), "wide")] {
        for seed in 1..=30 {
            let server = FakeApiServer::new();
            let held = pool_race(&server, pool, seed)
                .await
                .unwrap_or_else(|e| panic!("{name} pool, seed {seed}: {e}"));
            assert_eq!(
                held, 6,
                "{name} pool, seed {seed}: every pod has its MAC after a calm pass"
            );
        }
    }
}

/// The race test above would notice a server that let a stale ledger
/// write through: with the MAC ledger's resourceVersion check off, some
/// seed hands one MAC out twice.
#[tokio::test(flavor = "current_thread")]
async fn the_pool_race_fails_without_the_ledger_precondition() {
    let mut duplicates = 0;
    for seed in 1..=30 {
        let server = FakeApiServer::new().without_version_checks("configmaps");
        if pool_race(&server, pool(MacPoolMode::OptOut), seed)
            .await
            .is_err()
        {
            duplicates += 1;
        }
    }
    assert!(duplicates > 0, "no seed noticed the missing precondition");
}

#[tokio::test]
async fn a_pool_mac_is_recorded_released_into_quarantine_and_reused_last() {
    let server = FakeApiServer::new();
    server.insert(&sibling_subnet("left", "10.0.1.0/29"));
    let (first_pod, first) = plain_pod("first", "left");
    server.insert(&first_pod);
    server.insert(&first);
    let ctx = pool_context(&server, pool(MacPoolMode::OptOut), Vec::new());
    reconcile_records(&server, &ctx).await;
    let held = pool_macs(&server).unwrap();
    let (mac, _) = held.first_key_value().unwrap();
    assert_eq!(mac.to_string(), "02:aa:00:00:00:01");
    let subnet = server.list::<FlatNetworkSubnet>().remove(0);
    assert!(
        subnet.status.unwrap().used_mac.is_empty(),
        "usedMac lists fixed MACs only"
    );
    assert_eq!(
        ledger_data(&server).get("pool.claimed").map(String::as_str),
        Some("02:aa:00:00:00:01"),
        "claimed for the pool in the MAC ledger"
    );

    // The pod goes: its MAC is released into the quarantine.
    let api: kube::Api<FlatNetworkIP> = kube::Api::namespaced(server.client(), NS);
    api.delete("first", &Default::default()).await.unwrap();
    let ctx = pool_context(&server, pool(MacPoolMode::OptOut), Vec::new());
    ips::reconcile(Arc::new(stored_record(&server, "first").unwrap()), ctx)
        .await
        .unwrap();
    let ledger = ledger_data(&server);
    assert!(!ledger.contains_key("02-aa-00-00-00-01"), "{ledger:?}");
    assert_eq!(
        ledger.get("pool.quarantine").map(String::as_str),
        Some("02:aa:00:00:00:01")
    );

    // The next pods get the other seven MACs before the freed one (the
    // /29 holds five pods; the rest go to a sibling subnet).
    server.insert(&sibling_subnet("spare", "10.0.3.0/28"));
    let mut order = Vec::new();
    for i in 0..8 {
        let name = format!("next-{i}");
        let (p, record) = plain_pod(&name, if i < 5 { "left" } else { "spare" });
        server.insert(&p);
        server.insert(&record);
        let ctx = pool_context(&server, pool(MacPoolMode::OptOut), Vec::new());
        let record = stored_record(&server, &name).unwrap();
        ips::reconcile(Arc::new(record), ctx).await.unwrap();
        order.push(stored_record(&server, &name).unwrap().status.unwrap().mac);
    }
    assert_eq!(
        order.last().map(String::as_str),
        Some("02:aa:00:00:00:01"),
        "{order:?}"
    );
    assert_eq!(order.iter().collect::<BTreeSet<_>>().len(), 8, "{order:?}");
}

#[tokio::test]
async fn namespaces_opt_out_and_in_by_label() {
    let namespace = |value: Option<&str>| Namespace {
        metadata: ObjectMeta {
            name: Some(NS.into()),
            labels: value.map(|v| BTreeMap::from([(label::MAC_POOL.to_owned(), v.to_owned())])),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    for (mode, label_value, gets_one) in [
        (MacPoolMode::OptOut, None, true),
        (MacPoolMode::OptOut, Some("disabled"), false),
        (MacPoolMode::OptIn, None, false),
        (MacPoolMode::OptIn, Some("enabled"), true),
        (MacPoolMode::Disabled, Some("enabled"), false),
    ] {
        let server = FakeApiServer::new();
        server.insert(&sibling_subnet("left", "10.0.1.0/29"));
        let (p, record) = plain_pod("web", "left");
        server.insert(&p);
        server.insert(&record);
        let ctx = pool_context(&server, pool(mode), vec![namespace(label_value)]);
        reconcile_records(&server, &ctx).await;
        let status = stored_record(&server, "web").unwrap().status.unwrap();
        assert!(status.addr.is_some());
        assert_eq!(status.mac_from_pool, gets_one, "{mode:?} {label_value:?}");
        assert_eq!(!status.mac.is_empty(), gets_one, "{mode:?} {label_value:?}");
    }
}

/// A MAC the Multus selection gives the flat attachment (which Multus
/// hands the CNI as `runtimeConfig.mac`) is the pod's fixed MAC: the record
/// asks for it, and the pool gives it none.
#[tokio::test]
async fn the_multus_mac_is_a_fixed_mac_not_a_pool_one() {
    let server = FakeApiServer::new();
    server.insert(&sibling_subnet("left", "10.0.1.0/29"));
    let selection =
        r#"[{"name":"rancher-flat-network","interface":"eth1","mac":"0a:00:00:00:00:09"}]"#;
    let p = pod("web")
        .flat()
        .annotated("flatnetwork.pandaria.io/subnet", "left")
        .annotated("k8s.v1.cni.cncf.io/networks", selection);
    server.insert(&p);
    let ctx = pool_context(&server, pool(MacPoolMode::OptOut), Vec::new());
    pods::reconcile(Arc::new(super::CachedPod::from(&p)), ctx)
        .await
        .unwrap();
    let record = stored_record(&server, "web").unwrap();
    assert_eq!(record.spec.macs, ["0a:00:00:00:00:09"]);
    let ctx = pool_context(&server, pool(MacPoolMode::OptOut), Vec::new());
    reconcile_records(&server, &ctx).await;
    let status = stored_record(&server, "web").unwrap().status.unwrap();
    assert_eq!(
        (status.mac.as_str(), status.mac_from_pool),
        ("0a:00:00:00:00:09", false)
    );

    // An unusable one is the pod's annotation error, naming the fix.
    let bad = pod("bad")
        .flat()
        .annotated("flatnetwork.pandaria.io/subnet", "left")
        .annotated(
            "k8s.v1.cni.cncf.io/networks",
            r#"[{"name":"rancher-flat-network","mac":"01:00:00:00:00:01"}]"#,
        );
    server.insert(&bad);
    let ctx = pool_context(&server, pool(MacPoolMode::OptOut), Vec::new());
    let _ = pods::reconcile(Arc::new(super::CachedPod::from(&bad)), ctx).await;
    assert!(
        stored_record(&server, "bad").is_none(),
        "no record for a bad MAC"
    );
}

/// Pods of a busy parent link share MAC ledger writes: one write claims
/// the MACs of many pods (the rest spare, handed out without a write),
/// and no allocation reads the ledger once it is known.
#[tokio::test]
async fn pool_macs_cost_a_share_of_one_ledger_write() {
    let server = FakeApiServer::new();
    server.insert(&sibling_subnet("left", "10.0.1.0/24"));
    server.insert(&sibling_subnet("right", "10.0.2.0/24"));
    const PODS: usize = 80;
    for i in 0..PODS {
        let (p, record) = plain_pod(
            &format!("web-{i}"),
            if i % 2 == 0 { "left" } else { "right" },
        );
        server.insert(&p);
        server.insert(&record);
    }
    let ctx = pool_context(&server, wide_pool(), Vec::new());
    let before = server.requests_by_kind();
    let records: Vec<FlatNetworkIP> = server.list();
    futures::future::join_all(
        records
            .into_iter()
            .map(|r| ips::reconcile(Arc::new(r), Arc::clone(&ctx))),
    )
    .await
    .into_iter()
    .collect::<Result<Vec<_>, _>>()
    .unwrap();
    let held = pool_macs_of(&server, wide_pool().range).unwrap();
    assert_eq!(held.len(), PODS, "every pod has its own pool MAC");
    let spent = |kind: &str| {
        let after = server.requests_by_kind();
        after
            .iter()
            .filter(|(k, _)| k.contains(kind))
            .map(|(k, n)| n - before.get(k).copied().unwrap_or(0))
            .sum::<u64>()
    };
    let writes = spent("configmaps");
    // PODS / (1 + CLAIM_AHEAD) claims at least; a few more when
    // concurrent batches of the two subnets find the spare MACs taken.
    assert!(
        writes * 8 <= PODS as u64,
        "{writes} MAC ledger requests for {PODS} pods: {:?}",
        server.requests_by_kind()
    );
    assert_eq!(spent("get configmaps"), 1, "the ledger is read once");
}

/// A leader that goes leaves its spare MACs claimed; the subnet repair
/// frees them once no record has named them for the orphan grace, and
/// keeps every MAC a record names.
#[tokio::test]
async fn spare_pool_macs_left_behind_are_freed_by_the_repair() {
    let server = FakeApiServer::new();
    server.insert(&sibling_subnet("left", "10.0.1.0/29"));
    let (p, record) = plain_pod("web", "left");
    server.insert(&p);
    server.insert(&record);
    let ctx = pool_context(&server, wide_pool(), Vec::new());
    reconcile_records(&server, &ctx).await;
    drop(ctx);
    let held = pool_macs_of(&server, wide_pool().range).unwrap();
    assert_eq!(held.len(), 1);
    let claimed = pool_claimed(&ledger_data(&server));
    assert!(claimed.len() > 1, "MACs were claimed ahead: {claimed:?}");

    calm_repair(&server).await;
    let claimed = pool_claimed(&ledger_data(&server));
    assert_eq!(
        claimed,
        held.keys().copied().collect::<BTreeSet<_>>(),
        "only the pod's MAC stays claimed"
    );
    // The freed ones were never a pod's, but the repair cannot know: they
    // are quarantined, so they come last.
    assert!(ledger_data(&server).contains_key("pool.quarantine"));
}

/// A fixed MAC the pool has handed out is taken: the pod asking for it
/// gets the error saying so, and the pool pod keeps it.
#[tokio::test]
async fn a_fixed_mac_request_never_takes_a_pool_mac() {
    let server = FakeApiServer::new();
    server.insert(&sibling_subnet("left", "10.0.1.0/29"));
    let (p, record) = plain_pod("pooled", "left");
    server.insert(&p);
    server.insert(&record);
    let ctx = pool_context(&server, pool(MacPoolMode::OptOut), Vec::new());
    reconcile_records(&server, &ctx).await;
    let held = pool_macs(&server).unwrap();
    let (mac, _) = held.first_key_value().unwrap();

    let (p, record) = pod_and_record("fixed", "left", &mac.to_string());
    server.insert(&p);
    server.insert(&record);
    let ctx = pool_context(&server, pool(MacPoolMode::OptOut), Vec::new());
    let record = stored_record(&server, "fixed").unwrap();
    let result = ips::reconcile(Arc::new(record), ctx).await;
    let status = stored_record(&server, "fixed")
        .unwrap()
        .status
        .unwrap_or_default();
    assert!(
        status.addr.is_none() && status.mac.is_empty(),
        "{result:?} {status:?}"
    );
    assert!(
        status.failure_message.contains("MAC") || format!("{result:?}").contains("Mac"),
        "{result:?} {status:?}"
    );
    assert_eq!(
        pool_macs(&server).unwrap().len(),
        1,
        "the pool pod keeps it"
    );
}

/// A pool of 32 MACs: room for the pods of the churn tests below, too
/// small to claim MACs ahead (every claim is a write of its own).
fn churn_pool() -> ActivePool {
    ActivePool {
        range: MacRange::parse("02:aa:00:00:00:01", "02:aa:00:00:00:20").unwrap(),
        mode: MacPoolMode::OptOut,
    }
}

/// `count` pods of `prefix` in subnet `left`, their records allocated
/// (concurrently) with `pool`.
async fn allocated_pods(server: &FakeApiServer, pool: ActivePool, prefix: &str, count: usize) {
    for i in 0..count {
        let (p, record) = plain_pod(&format!("{prefix}-{i}"), "left");
        server.insert(&p);
        server.insert(&record);
    }
    let ctx = pool_context(server, pool, Vec::new());
    let records: Vec<FlatNetworkIP> = server
        .list::<FlatNetworkIP>()
        .into_iter()
        .filter(|r| r.name_any().starts_with(&format!("{prefix}-")))
        .collect();
    futures::future::join_all(
        records
            .into_iter()
            .map(|r| ips::reconcile(Arc::new(r), Arc::clone(&ctx))),
    )
    .await;
}

/// Deletes the records of `prefix` (they keep their finalizer, so they
/// stay, marked for deletion).
async fn delete_records(server: &FakeApiServer, prefix: &str) -> usize {
    let api: kube::Api<FlatNetworkIP> = kube::Api::namespaced(server.client(), NS);
    let mut deleted = 0;
    for record in server.list::<FlatNetworkIP>() {
        if record.name_any().starts_with(&format!("{prefix}-")) {
            api.delete(&record.name_any(), &Default::default())
                .await
                .unwrap();
            deleted += 1;
        }
    }
    deleted
}

/// The requests of `kind` (such as `update configmaps`) served since
/// `before`.
fn spent_since(server: &FakeApiServer, before: &BTreeMap<String, u64>, kind: &str) -> u64 {
    server
        .requests_by_kind()
        .iter()
        .filter(|(k, _)| k.starts_with(kind))
        .map(|(k, n)| n - before.get(k).copied().unwrap_or(0))
        .sum()
}

/// Pods deleted at once give their pool MACs back in a few MAC ledger
/// writes, not one each, and every MAC still enters the quarantine.
#[tokio::test(flavor = "current_thread")]
async fn pool_mac_releases_share_ledger_writes() {
    const PODS: usize = 20;
    // Requests yield to the scheduler, as network requests do, so the
    // releases of concurrent reconciles overlap.
    let server = FakeApiServer::new().with_chaos(7, 0);
    server.insert(&sibling_subnet("left", "10.0.1.0/24"));
    allocated_pods(&server, churn_pool(), "web", PODS).await;
    let held = pool_macs_of(&server, churn_pool().range).unwrap();
    assert_eq!(held.len(), PODS);

    assert_eq!(delete_records(&server, "web").await, PODS);
    let ctx = pool_context(&server, churn_pool(), Vec::new());
    let before = server.requests_by_kind();
    // The controller's five workers.
    let records: Vec<FlatNetworkIP> = server.list();
    futures::stream::iter(records)
        .map(|r| ips::reconcile(Arc::new(r), Arc::clone(&ctx)))
        .buffer_unordered(5)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();

    assert!(server.list::<FlatNetworkIP>().is_empty(), "all released");
    let ledger = ledger_data(&server);
    assert!(pool_claimed(&ledger).is_empty(), "{ledger:?}");
    let quarantined: BTreeSet<Mac> = ledger
        .get("pool.quarantine")
        .map_or("", String::as_str)
        .split_whitespace()
        .map(|m| Mac::parse(m).unwrap())
        .collect();
    assert_eq!(
        quarantined,
        held.keys().copied().collect::<BTreeSet<_>>(),
        "every released MAC is quarantined"
    );
    let writes = spent_since(&server, &before, "update configmaps");
    assert!(
        writes * 2 <= PODS as u64,
        "{writes} MAC ledger writes for {PODS} releases: {:?}",
        server.requests_by_kind()
    );
    assert_eq!(
        spent_since(&server, &before, "get configmaps"),
        1,
        "the ledger is read once, then kept in memory"
    );
}

/// Pods going and new pods coming on one parent link at once, each side
/// with a cache that lags (the allocator still sees the old records
/// holding their MACs) and requests interleaved per seed: a MAC is never
/// held twice, the old pods' MACs go back into the pool, and the new
/// pods get MACs nobody used before the quarantined ones.
#[tokio::test(flavor = "current_thread")]
async fn releases_racing_allocations_never_hand_out_a_pool_mac_twice() {
    for seed in 1..=20 {
        let server = FakeApiServer::new();
        server.insert(&sibling_subnet("left", "10.0.1.0/24"));
        allocated_pods(&server, churn_pool(), "old", 12).await;
        let old: BTreeSet<Mac> = pool_macs_of(&server, churn_pool().range)
            .unwrap()
            .into_keys()
            .collect();
        for i in 0..12 {
            let (p, record) = plain_pod(&format!("new-{i}"), "left");
            server.insert(&p);
            server.insert(&record);
        }
        // The allocator's cache is from before the deletions.
        let allocating = pool_context(&server.with_chaos(seed, 0), churn_pool(), Vec::new());
        delete_records(&server, "old").await;
        let releasing = pool_context(
            &server.with_chaos(seed ^ 0x5eed, 0),
            churn_pool(),
            Vec::new(),
        );
        let records: Vec<FlatNetworkIP> = server.list();
        let release = futures::future::join_all(
            records
                .iter()
                .filter(|r| r.metadata.deletion_timestamp.is_some())
                .map(|r| ips::reconcile(Arc::new(r.clone()), Arc::clone(&releasing))),
        );
        let allocate = futures::future::join_all(
            shuffled(&records, seed)
                .into_iter()
                .filter(|r| r.metadata.deletion_timestamp.is_none())
                .map(|r| ips::reconcile(Arc::new(r), Arc::clone(&allocating))),
        );
        let (released, allocated) = futures::join!(release, allocate);
        for result in released.into_iter().chain(allocated) {
            result.unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        }
        let held = pool_macs_of(&server, churn_pool().range)
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(held.len(), 12, "seed {seed}: every new pod has a MAC");
        assert!(
            held.keys().all(|m| !old.contains(m)),
            "seed {seed}: a released MAC was reused before unused ones: {held:?}"
        );
        let ledger = ledger_data(&server);
        let claimed = pool_claimed(&ledger);
        assert!(
            old.iter().all(|m| !claimed.contains(m)),
            "seed {seed}: the old pods' MACs are released: {ledger:?}"
        );
        let quarantine = ledger.get("pool.quarantine").cloned().unwrap_or_default();
        for mac in &old {
            assert!(
                quarantine.contains(&mac.to_string()),
                "seed {seed}: {mac} quarantined: {quarantine}"
            );
        }
    }
}

/// A record write the API server applied but answered 504 (it outlived
/// the request's deadline) is sent again by the client, as the operator's
/// client sends 504s again, and the repeat meets 409 Conflict: the record
/// names the allocation's MAC and address by then. They stay its own; the
/// next pod gets others.
#[tokio::test]
async fn a_record_write_that_landed_before_its_conflict_keeps_its_mac_and_address() {
    use crate::allocation::fake_api::faults::{Fault, Plan};
    let server = FakeApiServer::new();
    server.insert(&sibling_subnet("left", "10.0.1.0/29"));
    for name in ["first", "second"] {
        let (p, record) = plain_pod(name, "left");
        server.insert(&p);
        server.insert(&record);
    }
    server.script_fault(
        "flatnetworkips/status",
        "first",
        Plan::After(Fault::Timeout),
    );
    let ctx = pool_context(&server, pool(MacPoolMode::OptOut), Vec::new());
    for name in ["first", "second"] {
        let record = stored_record(&server, name).unwrap();
        ips::reconcile(Arc::new(record), Arc::clone(&ctx))
            .await
            .unwrap();
    }
    let held = pool_macs(&server).unwrap();
    assert_eq!(held.len(), 2, "{held:?}");
    let addrs: BTreeSet<IpAddr> = ["first", "second"]
        .iter()
        .filter_map(|name| stored_record(&server, name)?.status?.addr)
        .collect();
    assert_eq!(addrs.len(), 2, "{addrs:?}");
    let used = ledger(&server);
    for addr in &addrs {
        assert!(
            used_ranges::contains(&used, *addr),
            "{addr} is in usedIP: {used:?}"
        );
    }
    assert!(
        pool_claimed(&ledger_data(&server)).len() >= 2,
        "both MACs stay claimed: {:?}",
        ledger_data(&server)
    );
}
