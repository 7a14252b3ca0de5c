//! Floating-address controllers against the resourceVersion-enforcing fake
//! API server: class filter, fixed addresses, dual stack, sharing, quota,
//! exhaustion, release, pool and quota status, and racing allocators.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
    time::Duration,
};

use flatnet_k8s::{
    api::{
        FloatingIPPool, FloatingIPPoolSpec, FloatingIPProjectQuota, FloatingIPProjectQuotaSpec,
        IpRange,
    },
    floating::{INTERFACE_MAPPINGS, LOAD_BALANCER_CLASS, annotation, pods::assigned_ips},
    ipam::used_ranges,
};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, Service};
use kube::{ResourceExt, api::ObjectMeta};

use super::{Caches, Context, Error, Settings, pods, pools, quotas, services};
use crate::{
    allocation::{events::Events, fake_api::FakeApiServer, subnets::OrphanClock},
    controller::Backoff,
    fixtures::{NS, shuffled, store},
    metrics::Metrics,
};

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// Pool `name` over `cidrs`, handing out `ranges`, announced on eth0.
fn pool(name: &str, cidrs: &[&str], ranges: &[(&str, &str)]) -> FloatingIPPool {
    FloatingIPPool::new(
        name,
        FloatingIPPoolSpec {
            cidrs: cidrs.iter().map(|c| (*c).to_owned()).collect(),
            ranges: ranges
                .iter()
                .map(|(f, t)| IpRange::new(ip(f), ip(t)))
                .collect(),
            target_network_interface: "eth0.100".into(),
            ..FloatingIPPoolSpec::default()
        },
    )
}

/// The LoadBalancer Service `name` of [`NS`] with flatnet's class,
/// exposing TCP `port`.
fn lb(name: &str, port: i32) -> Service {
    let mut service = crate::fixtures::service(name);
    service.metadata.resource_version = None;
    let spec = service.spec.as_mut().unwrap();
    spec.type_ = Some("LoadBalancer".into());
    spec.load_balancer_class = Some(LOAD_BALANCER_CLASS.into());
    spec.ports.as_mut().unwrap().truncate(1);
    spec.ports.as_mut().unwrap()[0].port = port;
    service
}

fn annotated(mut service: Service, key: &str, value: &str) -> Service {
    service
        .annotations_mut()
        .insert(key.to_owned(), value.to_owned());
    service
}

fn namespace(name: &str, project: Option<&str>) -> Namespace {
    Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: project
                .map(|p| BTreeMap::from([("field.cattle.io/projectId".to_owned(), p.to_owned())])),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    }
}

/// A context whose caches hold what `server` holds now.
pub(super) fn context(server: &FakeApiServer, settings: Settings) -> Arc<Context> {
    let client = server.client();
    Arc::new(Context {
        events: Events::new(client.clone()),
        client,
        metrics: Arc::new(Metrics::new()),
        caches: Caches {
            services: store(server.list()).0,
            pools: store(server.list()).0,
            quotas: store(server.list()).0,
            namespaces: store(server.list()).0,
            pods: store(server.list()).0,
        },
        settings,
        backoff: Backoff::default(),
        orphans: OrphanClock::default(),
    })
}

fn server_with(objects: &[Service], pools: &[FloatingIPPool]) -> FakeApiServer {
    let server = FakeApiServer::new();
    server.insert(&namespace(NS, Some("c-1:p-shop")));
    for p in pools {
        server.insert(p);
    }
    for s in objects {
        server.insert(s);
    }
    server
}

fn get(server: &FakeApiServer, name: &str) -> Option<Service> {
    server
        .list::<Service>()
        .into_iter()
        .find(|s| s.name_any() == name)
}

/// The ingress addresses of Service `name`.
fn ingress(server: &FakeApiServer, name: &str) -> Vec<IpAddr> {
    get(server, name)
        .and_then(|s| s.status?.load_balancer?.ingress)
        .unwrap_or_default()
        .iter()
        .filter_map(|i| i.ip.as_deref()?.parse().ok())
        .collect()
}

fn ledger(server: &FakeApiServer, name: &str) -> Vec<IpRange> {
    server
        .list::<FloatingIPPool>()
        .into_iter()
        .find(|p| p.name_any() == name)
        .and_then(|p| p.status)
        .unwrap_or_default()
        .used_ip
}

/// Reconciles Service `name` once with fresh caches.
async fn reconcile(server: &FakeApiServer, settings: &Settings, name: &str) -> Result<(), Error> {
    let service = get(server, name).expect("service exists");
    services::reconcile(Arc::new(service), context(server, settings.clone()))
        .await
        .map(|_| ())
}

#[tokio::test]
async fn only_flatnets_class_is_served_unless_classless_is_enabled() {
    let mut plain = lb("plain", 80);
    plain.spec.as_mut().unwrap().load_balancer_class = None;
    let mut metallb = lb("metallb", 80);
    metallb.spec.as_mut().unwrap().load_balancer_class = Some("metallb.io/metallb".into());
    let server = server_with(
        &[lb("web", 80), plain, metallb],
        &[pool(
            "lan",
            &["192.168.10.0/24"],
            &[("192.168.10.10", "192.168.10.20")],
        )],
    );
    let strict = Settings::default();
    for name in ["web", "plain", "metallb"] {
        reconcile(&server, &strict, name).await.unwrap();
    }
    assert_eq!(ingress(&server, "web"), vec![ip("192.168.10.10")]);
    assert!(ingress(&server, "plain").is_empty());
    assert!(get(&server, "plain").unwrap().finalizers().is_empty());
    assert!(used_ranges::contains(
        &ledger(&server, "lan"),
        ip("192.168.10.10")
    ));
    assert!(
        get(&server, "web")
            .unwrap()
            .finalizers()
            .contains(&services::FINALIZER.to_owned())
    );

    let classless = Settings {
        classless: true,
        ..Settings::default()
    };
    reconcile(&server, &classless, "plain").await.unwrap();
    reconcile(&server, &classless, "metallb").await.unwrap();
    assert_eq!(ingress(&server, "plain"), vec![ip("192.168.10.11")]);
    assert!(
        ingress(&server, "metallb").is_empty(),
        "another class is never served"
    );
}

#[tokio::test]
async fn fixed_addresses_are_given_once_and_released_on_type_change_and_delete() {
    let mut fixed = lb("fixed", 80);
    fixed.spec.as_mut().unwrap().load_balancer_ip = Some("192.168.10.15".into());
    let twin = annotated(lb("twin", 81), annotation::ADDRESSES, "192.168.10.15");
    let server = server_with(
        &[fixed, twin, lb("web", 80)],
        &[pool(
            "lan",
            &["192.168.10.0/24"],
            &[("192.168.10.10", "192.168.10.20")],
        )],
    );
    let settings = Settings::default();
    reconcile(&server, &settings, "fixed").await.unwrap();
    assert_eq!(ingress(&server, "fixed"), vec![ip("192.168.10.15")]);
    let error = reconcile(&server, &settings, "twin").await.unwrap_err();
    assert!(
        error.to_string().contains("192.168.10.15") && error.needs_user(),
        "{error}"
    );
    assert!(ingress(&server, "twin").is_empty());
    reconcile(&server, &settings, "web").await.unwrap();

    // web becomes a ClusterIP Service: ingress cleared, address released,
    // finalizer gone.
    let mut web = get(&server, "web").unwrap();
    web.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
    server.insert(&web);
    reconcile(&server, &settings, "web").await.unwrap();
    assert!(ingress(&server, "web").is_empty());
    assert!(get(&server, "web").unwrap().finalizers().is_empty());
    assert!(!used_ranges::contains(
        &ledger(&server, "lan"),
        ip("192.168.10.10")
    ));

    // fixed is deleted: the finalizer holds it until its address is back.
    server.delete::<Service>(NS, "fixed");
    assert!(
        get(&server, "fixed")
            .unwrap()
            .metadata
            .deletion_timestamp
            .is_some()
    );
    reconcile(&server, &settings, "fixed").await.unwrap();
    assert!(get(&server, "fixed").is_none());
    assert!(ledger(&server, "lan").is_empty());
    // Now twin gets the address it asked for.
    reconcile(&server, &settings, "twin").await.unwrap();
    assert_eq!(ingress(&server, "twin"), vec![ip("192.168.10.15")]);
}

#[tokio::test]
async fn dual_stack_follows_ip_families_in_order() {
    let mut web = lb("web", 80);
    web.spec.as_mut().unwrap().ip_families = Some(vec!["IPv6".into(), "IPv4".into()]);
    let server = server_with(
        &[web, lb("v4only", 80)],
        &[pool("lan", &["192.168.10.0/28", "fd00:10::/120"], &[])],
    );
    let settings = Settings::default();
    reconcile(&server, &settings, "web").await.unwrap();
    reconcile(&server, &settings, "v4only").await.unwrap();
    assert_eq!(
        ingress(&server, "web"),
        vec![ip("fd00:10::1"), ip("192.168.10.1")]
    );
    assert_eq!(ingress(&server, "v4only"), vec![ip("192.168.10.2")]);
    let status = server.list::<FloatingIPPool>()[0].status.clone().unwrap();
    assert_eq!(status.used_ip_count, 3);
    assert_eq!(status.total_ip_count, 14 + 255);
}

#[tokio::test]
async fn a_sharing_key_shares_an_address_unless_ports_clash() {
    let key = annotation::SHARING_KEY;
    let server = server_with(
        &[
            annotated(lb("http", 80), key, "front"),
            annotated(lb("https", 443), key, "front"),
            annotated(lb("clash", 80), key, "front"),
        ],
        &[pool(
            "lan",
            &["192.168.10.0/24"],
            &[("192.168.10.10", "192.168.10.20")],
        )],
    );
    let settings = Settings::default();
    reconcile(&server, &settings, "http").await.unwrap();
    reconcile(&server, &settings, "https").await.unwrap();
    assert_eq!(ingress(&server, "http"), ingress(&server, "https"));
    let error = reconcile(&server, &settings, "clash").await.unwrap_err();
    assert!(
        matches!(&error, Error::PortClash { port: 80, .. }),
        "{error}"
    );
    assert!(error.to_string().contains("TCP/80"), "{error}");
    let status = server.list::<FloatingIPPool>()[0].status.clone().unwrap();
    assert_eq!(status.used_ip_count, 1, "a shared address is one address");

    // The address stays while one of its Services holds it.
    server.delete::<Service>(NS, "http");
    reconcile(&server, &settings, "http").await.unwrap();
    assert_eq!(ledger(&server, "lan").len(), 1);
    server.delete::<Service>(NS, "https");
    reconcile(&server, &settings, "https").await.unwrap();
    assert!(ledger(&server, "lan").is_empty());
}

#[tokio::test]
async fn quota_and_exhaustion_are_reported_with_the_quota_and_pool_named() {
    let server = server_with(
        &[
            lb("one", 80),
            lb("two", 80),
            lb("three", 80),
            lb("four", 80),
        ],
        &[
            pool(
                "a-small",
                &["192.168.10.0/24"],
                &[("192.168.10.10", "192.168.10.11")],
            ),
            pool(
                "b-next",
                &["192.168.20.0/24"],
                &[("192.168.20.10", "192.168.20.10")],
            ),
        ],
    );
    server.insert(&FloatingIPProjectQuota::new(
        "shop-quota",
        FloatingIPProjectQuotaSpec {
            project: "p-shop".into(),
            limits: BTreeMap::from([("b-next".to_owned(), 0)]),
            ..FloatingIPProjectQuotaSpec::default()
        },
    ));
    let settings = Settings::default();
    reconcile(&server, &settings, "one").await.unwrap();
    reconcile(&server, &settings, "two").await.unwrap();
    // a-small is exhausted; b-next, the next eligible pool, is at its quota.
    let error = reconcile(&server, &settings, "three").await.unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, Error::Quota(_)), "{text}");
    assert!(
        text.contains("FloatingIPProjectQuota shop-quota") && text.contains("b-next"),
        "{text}"
    );

    // Named pool, no quota on it: exhaustion names the pool.
    let four = annotated(get(&server, "four").unwrap(), annotation::POOL, "a-small");
    server.insert(&four);
    let error = reconcile(&server, &settings, "four").await.unwrap_err();
    assert!(
        error.to_string().contains("FloatingIPPool a-small")
            && error.to_string().contains("no free address"),
        "{error}"
    );

    // The quota's status counts what the project holds.
    let quota = server.list::<FloatingIPProjectQuota>().remove(0);
    quotas::reconcile(Arc::new(quota), context(&server, settings.clone()))
        .await
        .unwrap();
    let status = server
        .list::<FloatingIPProjectQuota>()
        .remove(0)
        .status
        .unwrap();
    assert_eq!(status.used.get("a-small"), Some(&2));
    assert_eq!(status.observed_generation, Some(1));
    let exhausted = status
        .conditions
        .iter()
        .find(|c| c.type_ == quotas::CONDITION_EXHAUSTED)
        .unwrap();
    assert_eq!(exhausted.status, "True");
    assert!(
        exhausted.message.contains("b-next (0)"),
        "{}",
        exhausted.message
    );
}

#[tokio::test]
async fn pool_status_mappings_overlap_and_repair() {
    let server = server_with(
        &[],
        &[
            pool(
                "lan",
                &["192.168.10.0/24"],
                &[("192.168.10.10", "192.168.10.20")],
            ),
            pool("z-clash", &["192.168.10.16/28"], &[]),
        ],
    );
    // An orphaned reservation: in the ledger, named by no Service.
    let mut lan = server
        .list::<FloatingIPPool>()
        .into_iter()
        .find(|p| p.name_any() == "lan")
        .unwrap();
    lan.status = Some(flatnet_k8s::api::FloatingIPPoolStatus {
        used_ip: vec![IpRange::new(ip("192.168.10.12"), ip("192.168.10.12"))],
        ..Default::default()
    });
    server.insert(&lan);
    let keep = Settings::default();
    let free = Settings {
        orphan_grace: Duration::ZERO,
        ..Settings::default()
    };
    for p in server.list::<FloatingIPPool>() {
        pools::reconcile(Arc::new(p), context(&server, keep.clone()))
            .await
            .unwrap();
    }
    let lan = server
        .list::<FloatingIPPool>()
        .into_iter()
        .find(|p| p.name_any() == "lan")
        .unwrap();
    let status = lan.status.clone().unwrap();
    assert_eq!(
        (status.used_ip_count, status.total_ip_count),
        (1, 11),
        "kept for its grace"
    );
    assert_eq!(status.observed_generation, Some(1));
    let clash = server
        .list::<FloatingIPPool>()
        .into_iter()
        .find(|p| p.name_any() == "z-clash")
        .unwrap();
    let ready = &clash.status.unwrap().conditions[0];
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "Overlap")
    );
    assert!(
        ready.message.contains("FloatingIPPool lan"),
        "{}",
        ready.message
    );

    pools::reconcile(Arc::new(lan), context(&server, free))
        .await
        .unwrap();
    assert!(ledger(&server, "lan").is_empty(), "freed after the grace");

    let map = server
        .list::<ConfigMap>()
        .into_iter()
        .find(|c| c.name_any() == INTERFACE_MAPPINGS)
        .unwrap();
    assert_eq!(map.namespace().as_deref(), Some("cattle-flat-network"));
    assert_eq!(
        map.data.unwrap(),
        BTreeMap::from([
            ("lan".to_owned(), "eth0.100".to_owned()),
            ("z-clash".to_owned(), "eth0.100".to_owned()),
        ])
    );
}

/// One allocator: `rounds` passes over its stale view of the Services.
async fn allocator(server: FakeApiServer, seed: u64, rounds: usize) {
    for round in 0..rounds {
        let ctx = context(&server, Settings::default());
        let all: Vec<Service> = server.list();
        for service in shuffled(&all, seed.wrapping_add(round as u64)) {
            let _ = services::reconcile(Arc::new(service), Arc::clone(&ctx)).await;
        }
    }
}

/// No address held by two Services, every held address in the ledger.
fn check_unique(server: &FakeApiServer, seed: u64) -> BTreeSet<IpAddr> {
    let ledger = ledger(server, "lan");
    let mut held = BTreeSet::new();
    for service in server.list::<Service>() {
        for addr in ingress(server, &service.name_any()) {
            assert!(
                held.insert(addr),
                "seed {seed}: {addr} given to two Services"
            );
            assert!(
                used_ranges::contains(&ledger, addr),
                "seed {seed}: {addr} missing from the ledger"
            );
        }
    }
    held
}

#[tokio::test]
async fn racing_allocators_never_give_an_address_twice() {
    for seed in 1..=8u64 {
        let services: Vec<Service> = (0..14).map(|i| lb(&format!("s{i}"), 80)).collect();
        let server = server_with(
            &services,
            &[pool("lan", &["10.9.0.0/24"], &[("10.9.0.10", "10.9.0.19")])],
        );
        let a = allocator(server.with_chaos(seed, 0), seed, 3);
        let b = allocator(server.with_chaos(seed ^ 0x5eed, 0), seed.rotate_left(17), 3);
        let repair = async {
            let ctx = context(&server, Settings::default());
            for _ in 0..6 {
                let pool = server.list::<FloatingIPPool>().remove(0);
                let _ = pools::reconcile(Arc::new(pool), Arc::clone(&ctx)).await;
                tokio::task::yield_now().await;
            }
        };
        futures::join!(a, b, repair);
        check_unique(&server, seed);

        // A calm pass frees what no Service names, then fills the pool.
        let calm = Settings {
            orphan_grace: Duration::ZERO,
            ..Settings::default()
        };
        let pool = server.list::<FloatingIPPool>().remove(0);
        pools::reconcile(Arc::new(pool), context(&server, calm))
            .await
            .unwrap();
        allocator(server.clone(), seed, 1).await;
        let held = check_unique(&server, seed);
        assert_eq!(
            held.len(),
            10,
            "seed {seed}: the pool is not full after a calm pass"
        );
    }
}

/// The objects of `docs/floating-ip/*.yaml`, in file order.
fn documented_example() -> Vec<serde_json::Value> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/floating-ip");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    files
        .iter()
        .flat_map(|path| {
            let text = std::fs::read_to_string(path).unwrap();
            crate::doc_examples::documents(&text, &path.display().to_string())
        })
        .collect()
}

#[tokio::test]
async fn the_documented_example_gets_the_documented_addresses() {
    let server = FakeApiServer::new();
    // The standalone state file (no kind) is the agent's to check.
    for object in documented_example()
        .into_iter()
        .filter(|o| o.get("kind").is_some())
    {
        match object["kind"].as_str().unwrap() {
            "FloatingIPPool" => {
                server.insert(&serde_json::from_value::<FloatingIPPool>(object).unwrap());
            }
            "FloatingIPProjectQuota" => {
                server.insert(&serde_json::from_value::<FloatingIPProjectQuota>(object).unwrap());
            }
            "Namespace" => server.insert(&serde_json::from_value::<Namespace>(object).unwrap()),
            "Service" => server.insert(&serde_json::from_value::<Service>(object).unwrap()),
            "Pod" => server.insert(&serde_json::from_value::<Pod>(object).unwrap()),
            // The pods' own addresses are the allocation controller's.
            "FlatNetworkSubnet" => {}
            other => panic!("no step for {other}"),
        }
    }
    let settings = Settings::default();
    for name in ["web", "api", "api-grpc"] {
        reconcile(&server, &settings, name).await.unwrap();
    }
    assert_eq!(ingress(&server, "web"), vec![ip("192.168.50.15")]);
    assert_eq!(
        ingress(&server, "api"),
        vec![ip("fd00:50::10"), ip("192.168.50.10")]
    );
    assert_eq!(ingress(&server, "api-grpc"), ingress(&server, "api"));
    let usage = |name: &str| {
        let pool = server
            .list::<FloatingIPPool>()
            .into_iter()
            .find(|p| p.name_any() == name);
        let status = pool.and_then(|p| p.status).unwrap();
        (status.used_ip_count, status.total_ip_count)
    };
    assert_eq!(usage("lan-50"), (3, 26));
    // The active/standby pair shares one address.
    for name in ["vnf-0", "vnf-1"] {
        let pod = server
            .list::<Pod>()
            .into_iter()
            .find(|p| p.name_any() == name)
            .unwrap();
        pods::reconcile(Arc::new(pod), context(&server, settings.clone()))
            .await
            .unwrap();
    }
    for pod in server.list::<Pod>() {
        assert_eq!(
            assigned_ips(&pod),
            vec![ip("192.168.60.10")],
            "{}",
            pod.name_any()
        );
    }
    assert_eq!(usage("vnf-60"), (1, 10));
}
