//! Reconcile throughput of the allocation controllers for 1000 pods against
//! the in-memory fake API server: the pod controller creates each pod's
//! FlatNetworkIP, then the FlatNetworkIP controller allocates its address
//! (subnet read, resourceVersion-checked ledger write, record write), with
//! the MAC pool off and on (each pod's MAC then claimed in the MAC ledger).
//! Then the release: every record deleted, and the FlatNetworkIP controller
//! releasing them with its five workers (each pod's address, and with the
//! pool its MAC, given back), the pool off and on.
//!
//! `cargo bench -p flatnet-operator --features fake-api --bench allocation`

use std::{
    collections::{BTreeMap, BTreeSet},
    hint::black_box,
    sync::Arc,
    time::Duration,
};

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use flatnet_k8s::{
    api::{
        FlatNetworkIP, FlatNetworkSubnet, FlatNetworkSubnetSpec, FlatNetworkSubnetStatus,
        MacPoolMode, phase,
    },
    ipam::MacRange,
    keys::SUBNET_NAMESPACE,
};
use flatnet_operator::{
    allocation::{
        Backoff, CachedPod, Caches, Context, Settings,
        events::Events,
        fake_api::FakeApiServer,
        ips,
        mac_pool::{ActivePool, MacPoolView},
        pods::{self, Marks},
        subnets::OrphanClock,
        wire_exclusion::WireView,
    },
    metrics::Metrics,
};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::{
    Api, Resource, ResourceExt,
    api::{DeleteParams, PartialObjectMeta},
    runtime::{reflector, watcher},
};
use serde_json::json;

const PODS: usize = 1000;

/// The FlatNetworkIP controller's workers (the operator's default).
const WORKERS: usize = 5;

fn store<K>(objects: Vec<K>) -> reflector::Store<K>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    let (store, mut writer) = reflector::store();
    writer.apply_watcher_event(&watcher::Event::Init);
    for object in objects {
        writer.apply_watcher_event(&watcher::Event::InitApply(object));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    // The store stays readable after its writer is gone.
    store
}

fn context(server: &FakeApiServer, pool: Option<ActivePool>) -> Arc<Context> {
    let client = server.client();
    Arc::new(Context {
        events: Events::new(client.clone()),
        client,
        metrics: Arc::new(Metrics::new()),
        caches: Caches {
            records: store(server.list::<FlatNetworkIP>()),
            subnets: store(server.list::<FlatNetworkSubnet>()),
            pods: store(server.list::<CachedPod>()),
            namespaces: store(Vec::<Namespace>::new()),
            nodes: store(Vec::<PartialObjectMeta<Node>>::new()),
        },
        settings: Settings::default(),
        backoff: Backoff::default(),
        orphans: OrphanClock::default(),
        nodes: Arc::default(),
        ledgers: Default::default(),
        departed: Arc::new(Marks::departed()),
        created: Marks::created(),
        wire: WireView::empty(flatnet_k8s::ipam::DEFAULT_WIRE_WINDOW),
        mac_pool: MacPoolView::new(pool),
    })
}

/// A server with one Active /22 subnet and `PODS` annotated pods.
fn cluster() -> FakeApiServer {
    let server = FakeApiServer::new();
    let mut subnet = FlatNetworkSubnet::new(
        "bench",
        FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth0".into(),
            cidr: "10.8.0.0/22".into(),
            ..FlatNetworkSubnetSpec::default()
        },
    );
    subnet.metadata.namespace = Some(SUBNET_NAMESPACE.into());
    subnet.status = Some(FlatNetworkSubnetStatus {
        phase: phase::ACTIVE.into(),
        ..FlatNetworkSubnetStatus::default()
    });
    server.insert(&subnet);
    for i in 0..PODS {
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": format!("pod-{i}"), "namespace": "bench", "uid": format!("uid-{i}"),
                         "annotations": {"flatnetwork.pandaria.io/ip": "auto",
                                         "flatnetwork.pandaria.io/subnet": "bench"}},
            "spec": {"containers": [{"name": "c", "image": "pause"}]}
        }))
        .expect("pod");
        server.insert(&pod);
    }
    server
}

/// Creates every record, then allocates every address; the caches are
/// refreshed between the phases as the watches would.
async fn reconcile_all(server: FakeApiServer, pool: Option<ActivePool>) {
    let ctx = context(&server, pool);
    for pod in ctx.caches.pods.state() {
        pods::reconcile(pod, Arc::clone(&ctx))
            .await
            .expect("record");
    }
    let ctx = context(&server, pool);
    for record in ctx.caches.records.state() {
        ips::reconcile(record, Arc::clone(&ctx))
            .await
            .expect("allocation");
    }
}

/// A server holding `PODS` allocated pods whose records are all deleted
/// (held by their finalizer, waiting for the release).
fn deleted_cluster(runtime: &tokio::runtime::Runtime, pool: Option<ActivePool>) -> FakeApiServer {
    let server = cluster();
    runtime.block_on(async {
        reconcile_all(server.clone(), pool).await;
        let api: Api<FlatNetworkIP> = Api::namespaced(server.client(), "bench");
        for record in server.list::<FlatNetworkIP>() {
            api.delete(&record.name_any(), &DeleteParams::default())
                .await
                .expect("delete");
        }
    });
    server
}

/// Releases every deleted record, `WORKERS` reconciles at a time.
async fn release_all(server: FakeApiServer, pool: Option<ActivePool>) {
    let ctx = context(&server, pool);
    futures::stream::iter(ctx.caches.records.state())
        .map(|record| ips::reconcile(record, Arc::clone(&ctx)))
        .buffer_unordered(WORKERS)
        .for_each(|result| {
            result.expect("release");
            async {}
        })
        .await;
}

/// The requests of each kind `run` sent, by `verb resource`.
fn spent(server: &FakeApiServer, before: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    let mut spent = BTreeMap::new();
    for (kind, count) in server.requests_by_kind() {
        let delta = count - before.get(&kind).copied().unwrap_or(0);
        let verb_resource = kind.rsplit_once(' ').map_or(kind.as_str(), |(k, _)| k);
        if delta > 0 {
            *spent.entry(verb_resource.to_owned()).or_insert(0) += delta;
        }
    }
    spent
}

fn bench(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let mut group = c.benchmark_group("allocation");
    group.throughput(Throughput::Elements(PODS as u64));
    group.sample_size(10);
    group.measurement_time(Duration::from_secs(20));
    for (name, pool) in [
        ("1000_pods_create_and_allocate", None),
        ("1000_pods_create_and_allocate_mac_pool", Some(mac_pool())),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched(
                cluster,
                |server| {
                    runtime.block_on(reconcile_all(server.clone(), pool));
                    black_box(server.requests())
                },
                BatchSize::PerIteration,
            );
        });
    }
    for (name, pool) in [
        ("1000_pods_release", None),
        ("1000_pods_release_mac_pool", Some(mac_pool())),
    ] {
        group.bench_function(name, |b| {
            b.iter_batched(
                || deleted_cluster(&runtime, pool),
                |server| {
                    runtime.block_on(release_all(server.clone(), pool));
                    black_box(server.requests())
                },
                BatchSize::PerIteration,
            );
        });
    }
    group.finish();

    // Correctness of what was measured: every pod got a distinct address,
    // and with the pool a distinct MAC from it.
    for pool in [None, Some(mac_pool())] {
        let server = cluster();
        runtime.block_on(reconcile_all(server.clone(), pool));
        let statuses: Vec<_> = server
            .list::<FlatNetworkIP>()
            .into_iter()
            .filter_map(|r| r.status)
            .collect();
        let addrs: BTreeSet<_> = statuses.iter().filter_map(|s| s.addr).collect();
        assert_eq!(addrs.len(), PODS, "every pod has its own address");
        let macs: BTreeSet<_> = statuses
            .iter()
            .filter(|s| s.mac_from_pool)
            .map(|s| s.mac.clone())
            .collect();
        let expected_macs = if pool.is_some() { PODS } else { 0 };
        assert_eq!(macs.len(), expected_macs, "every pod has its own pool MAC");
        println!(
            "one run (MAC pool {}): {} API requests for {PODS} pods",
            if pool.is_some() { "on" } else { "off" },
            server.requests()
        );
    }
    // And every release gave back what its record held.
    for pool in [None, Some(mac_pool())] {
        let server = deleted_cluster(&runtime, pool);
        let held: Vec<_> = server
            .list::<FlatNetworkIP>()
            .into_iter()
            .filter_map(|r| r.status?.addr)
            .collect();
        let before = server.requests_by_kind();
        runtime.block_on(release_all(server.clone(), pool));
        assert!(
            server.list::<FlatNetworkIP>().is_empty(),
            "every record released"
        );
        let subnet = server.list::<FlatNetworkSubnet>().remove(0);
        let used = subnet.status.unwrap_or_default().used_ranges();
        let still_used = |addr: &std::net::IpAddr| {
            used.iter()
                .any(|r| r.from.is_some_and(|f| f <= *addr) && r.to.is_some_and(|t| *addr <= t))
        };
        assert!(
            held.len() == PODS && !held.iter().any(still_used),
            "every address given back: {used:?}"
        );
        if pool.is_some() {
            let ledger = server
                .list::<k8s_openapi::api::core::v1::ConfigMap>()
                .into_iter()
                .find(|m| m.name_any().starts_with("flatnet-macs-"))
                .and_then(|m| m.data)
                .unwrap_or_default();
            let quarantined = ledger
                .get("pool.quarantine")
                .map_or(0, |q| q.split_whitespace().count());
            assert_eq!(quarantined, PODS, "every pool MAC given back, quarantined");
        }
        let spent = spent(&server, &before);
        println!(
            "one release run (MAC pool {}, {WORKERS} workers): {} API requests for {PODS} pods: {spent:?}",
            if pool.is_some() { "on" } else { "off" },
            spent.values().sum::<u64>(),
        );
    }
}

/// The MAC pool of the `mac_pool` runs: a random range, as a cluster
/// without a configured range gets.
fn mac_pool() -> ActivePool {
    ActivePool {
        range: MacRange::locally_administered(0x1234),
        mode: MacPoolMode::OptOut,
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
