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
use k8s_openapi::api::core::v1::ConfigMap;

use super::*;
use crate::allocation::{mac_ledger, mac_pool::ActivePool};

/// A pool of eight MACs: small, so racing allocators collide.
fn pool(mode: MacPoolMode) -> ActivePool {
    ActivePool {
        range: MacRange::parse("02:aa:00:00:00:01", "02:aa:00:00:00:08").unwrap(),
        mode,
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

/// One allocator with the pool: `rounds` passes over its stale view.
async fn pool_allocator(server: FakeApiServer, order_seed: u64, rounds: usize) {
    for _ in 0..rounds {
        let ctx = pool_context(&server, pool(MacPoolMode::OptOut), Vec::new());
        let records: Vec<FlatNetworkIP> = server.list();
        for record in shuffled(&records, order_seed) {
            let _ = ips::reconcile(Arc::new(record), Arc::clone(&ctx)).await;
        }
    }
}

/// The pool MAC of each record holding an address, or why the state is
/// wrong: a MAC held twice, a record without a pool MAC, a ledger that
/// does not claim a record's MAC for exactly that record's pod.
fn pool_macs(server: &FakeApiServer) -> Result<BTreeMap<Mac, String>, String> {
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
        if !pool(MacPoolMode::OptOut).range.contains(mac) {
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
    for (mac, holder) in &holders {
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
/// subnets MACs from one pool; the outcome of the race, and the MACs held
/// after a calm pass.
async fn pool_race(server: &FakeApiServer, seed: u64) -> Result<usize, String> {
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
    let a = pool_allocator(server.with_chaos(seed, 15), seed, 2);
    let b = pool_allocator(server.with_chaos(seed ^ 0x5eed, 15), seed.rotate_left(9), 2);
    futures::join!(a, b);
    pool_macs(server)?;
    // Calm: claims of allocations that gave up midway go, then every pod
    // is looked at again.
    calm_repair(server).await;
    pool_allocator(server.clone(), seed, 2).await;
    pool_macs(server).map(|held| held.len())
}

#[tokio::test(flavor = "current_thread")]
async fn racing_allocators_never_hand_out_a_pool_mac_twice() {
    for seed in 1..=30 {
        let server = FakeApiServer::new();
        let held = pool_race(&server, seed)
            .await
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(
            held, 6,
            "seed {seed}: every pod has its MAC after a calm pass"
        );
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
        if pool_race(&server, seed).await.is_err() {
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
    assert_eq!(
        subnet.status.unwrap().used_mac,
        ["02:aa:00:00:00:01"],
        "in the subnet's usedMac too"
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
