//! The pod controller against the resourceVersion-enforcing fake API
//! server: addresses per family of the pool, sets sharing one address,
//! fixed addresses, quota, release, the repair after a pod goes, and
//! racing allocators over sets.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc, time::Duration};

use flatnet_k8s::{
    api::{
        FloatingIPPool, FloatingIPPoolSpec, FloatingIPProjectQuota, FloatingIPProjectQuotaSpec,
        IpRange,
    },
    floating::{
        annotation,
        pods::{assigned_ips, is_labelled_assigned},
    },
    ipam::used_ranges,
};
use k8s_openapi::api::{
    core::v1::{Namespace, Pod},
    events::v1::Event,
};
use kube::{ResourceExt, api::ObjectMeta};

use super::super::{Error, Settings, pools, tests::context};
use crate::{
    allocation::fake_api::FakeApiServer,
    fixtures::{NS, shuffled},
};

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn pool(name: &str, cidrs: &[&str], ranges: &[(&str, &str)]) -> FloatingIPPool {
    FloatingIPPool::new(
        name,
        FloatingIPPoolSpec {
            cidrs: cidrs.iter().map(|c| (*c).to_owned()).collect(),
            ranges: ranges
                .iter()
                .map(|(f, t)| IpRange::new(ip(f), ip(t)))
                .collect(),
            target_network_interface: "eth0".into(),
            ..FloatingIPPoolSpec::default()
        },
    )
}

/// Pod `name` of [`NS`] with `annotations`.
fn pod(name: &str, annotations: &[(&str, &str)]) -> Pod {
    let mut pod = crate::fixtures::pod(name);
    for (k, v) in annotations {
        pod.annotations_mut()
            .insert((*k).to_owned(), (*v).to_owned());
    }
    pod
}

fn server_with(pods: &[Pod], pools: &[FloatingIPPool]) -> FakeApiServer {
    let server = FakeApiServer::new();
    server.insert(&Namespace {
        metadata: ObjectMeta {
            name: Some(NS.into()),
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    });
    for p in pools {
        server.insert(p);
    }
    for p in pods {
        server.insert(p);
    }
    server
}

fn get(server: &FakeApiServer, name: &str) -> Option<Pod> {
    server
        .list::<Pod>()
        .into_iter()
        .find(|p| p.name_any() == name)
}

fn assigned(server: &FakeApiServer, name: &str) -> Vec<IpAddr> {
    get(server, name)
        .map(|p| assigned_ips(&p))
        .unwrap_or_default()
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

fn in_ledger(server: &FakeApiServer, pool: &str, addr: IpAddr) -> bool {
    used_ranges::contains(&ledger(server, pool), addr)
}

/// Reconciles pod `name` once with fresh caches.
async fn reconcile(server: &FakeApiServer, name: &str) -> Result<(), Error> {
    let pod = get(server, name).expect("pod exists");
    super::reconcile(Arc::new(pod), context(server, Settings::default()))
        .await
        .map(|_| ())
}

/// Changes pod `name`'s annotations on the server.
fn annotate(server: &FakeApiServer, name: &str, key: &str, value: Option<&str>) {
    let mut pod = get(server, name).unwrap();
    match value {
        Some(v) => {
            pod.annotations_mut().insert(key.into(), v.into());
        }
        None => {
            pod.annotations_mut().remove(key);
        }
    }
    server.insert(&pod);
}

fn notes(server: &FakeApiServer, reason: &str) -> Vec<String> {
    server
        .list::<Event>()
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .filter_map(|e| e.note)
        .collect()
}

#[tokio::test]
async fn a_pod_gets_an_address_of_every_family_of_its_pool_and_gives_it_back() {
    let server = server_with(
        &[pod("plain", &[]), pod("vnf", &[(annotation::POOL, "lan")])],
        &[pool(
            "lan",
            &["10.9.0.0/24", "fd00:9::/120"],
            &[("10.9.0.10", "10.9.0.19"), ("fd00:9::10", "fd00:9::19")],
        )],
    );
    reconcile(&server, "plain").await.unwrap();
    assert!(assigned(&server, "plain").is_empty());
    assert!(
        !get(&server, "plain")
            .unwrap()
            .annotations()
            .contains_key(annotation::ASSIGNED)
    );

    reconcile(&server, "vnf").await.unwrap();
    let addrs = assigned(&server, "vnf");
    assert_eq!(addrs, [ip("10.9.0.10"), ip("fd00:9::10")]);
    // Labelled for the agents' watch.
    assert!(is_labelled_assigned(&get(&server, "vnf").unwrap()));
    assert!(!is_labelled_assigned(&get(&server, "plain").unwrap()));
    assert!(addrs.iter().all(|a| in_ledger(&server, "lan", *a)));
    assert_eq!(
        notes(&server, "FloatingIPAssigned"),
        ["floating address(es) 10.9.0.10, fd00:9::10 assigned"]
    );
    // Reconciling again keeps them.
    reconcile(&server, "vnf").await.unwrap();
    assert_eq!(assigned(&server, "vnf"), addrs);

    // The request withdrawn: the annotation goes, the ledger frees them.
    annotate(&server, "vnf", annotation::POOL, None);
    reconcile(&server, "vnf").await.unwrap();
    assert!(assigned(&server, "vnf").is_empty());
    assert!(!is_labelled_assigned(&get(&server, "vnf").unwrap()));
    assert!(ledger(&server, "lan").is_empty());
}

#[tokio::test]
async fn a_pod_assigned_before_the_label_existed_gets_it() {
    let server = server_with(
        &[pod(
            "old",
            &[
                (annotation::POOL, "lan"),
                (annotation::ASSIGNED, "10.9.0.10"),
            ],
        )],
        &[pool("lan", &["10.9.0.0/24"], &[])],
    );
    reconcile(&server, "old").await.unwrap();
    assert_eq!(assigned(&server, "old"), [ip("10.9.0.10")]);
    assert!(is_labelled_assigned(&get(&server, "old").unwrap()));
}

#[tokio::test]
async fn a_set_shares_one_address_until_its_last_member_lets_go() {
    let member = |name| {
        pod(
            name,
            &[(annotation::POOL, "lan"), (annotation::SET, "pair")],
        )
    };
    let mut other_namespace = member("c");
    other_namespace.metadata.namespace = Some("elsewhere".into());
    let server = server_with(
        &[member("a"), member("b"), other_namespace],
        &[pool("lan", &["10.9.0.0/24"], &[("10.9.0.10", "10.9.0.19")])],
    );
    reconcile(&server, "a").await.unwrap();
    reconcile(&server, "b").await.unwrap();
    reconcile(&server, "c").await.unwrap();
    assert_eq!(assigned(&server, "a"), [ip("10.9.0.10")]);
    assert_eq!(assigned(&server, "b"), [ip("10.9.0.10")]);
    // The same set name in another namespace is another set.
    assert_eq!(assigned(&server, "c"), [ip("10.9.0.11")]);

    // a leaves the set: b still holds the address, so the ledger keeps it.
    annotate(&server, "a", annotation::POOL, None);
    reconcile(&server, "a").await.unwrap();
    assert!(assigned(&server, "a").is_empty());
    assert!(in_ledger(&server, "lan", ip("10.9.0.10")));
    annotate(&server, "b", annotation::POOL, None);
    reconcile(&server, "b").await.unwrap();
    assert!(!in_ledger(&server, "lan", ip("10.9.0.10")));
}

#[tokio::test]
async fn two_members_that_reserved_at_once_converge_on_the_lower_address() {
    let member = |name, addr| {
        pod(
            name,
            &[
                (annotation::POOL, "lan"),
                (annotation::SET, "pair"),
                (annotation::ASSIGNED, addr),
            ],
        )
    };
    let mut lan = pool("lan", &["10.9.0.0/24"], &[("10.9.0.10", "10.9.0.19")]);
    lan.status = Some(Default::default());
    let server = server_with(
        &[member("a", "10.9.0.12"), member("b", "10.9.0.11")],
        &[lan],
    );
    // The ledger learns both from the repair, as after the race.
    let pool_object = server.list::<FloatingIPPool>().remove(0);
    pools::reconcile(Arc::new(pool_object), context(&server, Settings::default()))
        .await
        .unwrap();
    assert!(in_ledger(&server, "lan", ip("10.9.0.12")));
    reconcile(&server, "a").await.unwrap();
    reconcile(&server, "b").await.unwrap();
    assert_eq!(assigned(&server, "a"), [ip("10.9.0.11")]);
    assert_eq!(assigned(&server, "b"), [ip("10.9.0.11")]);
    assert!(!in_ledger(&server, "lan", ip("10.9.0.12")));
}

#[tokio::test]
async fn fixed_addresses_bad_ones_and_taken_ones_are_named() {
    let server = server_with(
        &[
            pod("first", &[(annotation::ADDRESSES, "10.9.0.15")]),
            pod("second", &[(annotation::ADDRESSES, "10.9.0.15")]),
            pod("typo", &[(annotation::ADDRESSES, "10.9.0.x")]),
            pod("nowhere", &[(annotation::ADDRESSES, "10.99.0.1")]),
        ],
        &[pool("lan", &["10.9.0.0/24"], &[("10.9.0.10", "10.9.0.19")])],
    );
    reconcile(&server, "first").await.unwrap();
    assert_eq!(assigned(&server, "first"), [ip("10.9.0.15")]);
    let taken = reconcile(&server, "second").await.unwrap_err().to_string();
    assert!(taken.starts_with("FloatingIPPool lan:"), "{taken}");
    assert!(taken.contains("10.9.0.15"), "{taken}");
    let typo = reconcile(&server, "typo").await.unwrap_err().to_string();
    assert!(
        typo.contains("Pod shop/typo: flatnetwork.pandaria.io/floating-ip holds \"10.9.0.x\""),
        "{typo}"
    );
    let nowhere = reconcile(&server, "nowhere").await.unwrap_err().to_string();
    assert!(
        nowhere.contains(
            "Pod shop/nowhere: no FloatingIPPool holding 10.99.0.1 serves namespace shop"
        ),
        "{nowhere}"
    );
    // Each failure is a Warning on the pod.
    assert_eq!(notes(&server, "FloatingIPFailed").len(), 3);
    assert!(assigned(&server, "second").is_empty());
}

#[tokio::test]
async fn a_quota_counts_a_sets_address_once_and_denies_the_next_pod() {
    let quota = FloatingIPProjectQuota::new(
        "shop",
        FloatingIPProjectQuotaSpec {
            namespace: NS.into(),
            limits: BTreeMap::from([("lan".to_owned(), 1)]),
            ..FloatingIPProjectQuotaSpec::default()
        },
    );
    let member = |name| {
        pod(
            name,
            &[(annotation::POOL, "lan"), (annotation::SET, "pair")],
        )
    };
    let server = server_with(
        &[
            member("a"),
            member("b"),
            pod("lone", &[(annotation::POOL, "lan")]),
        ],
        &[pool("lan", &["10.9.0.0/24"], &[("10.9.0.10", "10.9.0.19")])],
    );
    server.insert(&quota);
    reconcile(&server, "a").await.unwrap();
    reconcile(&server, "b").await.unwrap();
    assert_eq!(assigned(&server, "b"), [ip("10.9.0.10")]);
    let denied = reconcile(&server, "lone").await.unwrap_err().to_string();
    assert!(
        denied.starts_with(
            "FloatingIPProjectQuota shop allows namespace shop 1 address(es) of FloatingIPPool lan"
        ),
        "{denied}"
    );
    assert!(assigned(&server, "lone").is_empty());
}

#[tokio::test]
async fn a_deleted_pods_address_is_freed_by_the_repair_once_it_is_gone() {
    let server = server_with(
        &[pod("vnf", &[(annotation::POOL, "lan")])],
        &[pool("lan", &["10.9.0.0/24"], &[("10.9.0.10", "10.9.0.19")])],
    );
    reconcile(&server, "vnf").await.unwrap();
    let calm = Settings {
        orphan_grace: Duration::ZERO,
        ..Settings::default()
    };
    let repair = |server: &FakeApiServer| {
        let pool = server.list::<FloatingIPPool>().remove(0);
        let ctx = context(server, calm.clone());
        async move { pools::reconcile(Arc::new(pool), ctx).await.unwrap() }
    };
    // While the pod exists its address is named and kept.
    repair(&server).await;
    assert!(in_ledger(&server, "lan", ip("10.9.0.10")));
    assert!(server.delete::<Pod>(NS, "vnf"));
    repair(&server).await;
    assert!(ledger(&server, "lan").is_empty());
}

/// One allocator: `rounds` passes over its stale view of the pods.
async fn allocator(server: FakeApiServer, seed: u64, rounds: usize) {
    for round in 0..rounds {
        let ctx = context(&server, Settings::default());
        let all: Vec<Pod> = server.list();
        for pod in shuffled(&all, seed.wrapping_add(round as u64)) {
            let _ = super::reconcile(Arc::new(pod), Arc::clone(&ctx)).await;
        }
    }
}

#[tokio::test]
async fn racing_allocators_give_each_set_one_address_and_no_address_to_two_sets() {
    for seed in 1..=6u64 {
        // Five sets of two pods and four pods alone, for ten addresses.
        let mut pods: Vec<Pod> = (0..10)
            .map(|i| {
                let set = format!("set{}", i / 2);
                pod(
                    &format!("m{i}"),
                    &[(annotation::POOL, "lan"), (annotation::SET, &set)],
                )
            })
            .collect();
        pods.extend((0..4).map(|i| pod(&format!("lone{i}"), &[(annotation::POOL, "lan")])));
        let server = server_with(
            &pods,
            &[pool("lan", &["10.9.0.0/24"], &[("10.9.0.10", "10.9.0.19")])],
        );
        let a = allocator(server.with_chaos(seed, 0), seed, 3);
        let b = allocator(server.with_chaos(seed ^ 0x5eed, 0), seed.rotate_left(17), 3);
        futures::join!(a, b);
        // Calm passes: the repair frees orphans, the sets converge.
        let calm = Settings {
            orphan_grace: Duration::ZERO,
            ..Settings::default()
        };
        for _ in 0..2 {
            let pool = server.list::<FloatingIPPool>().remove(0);
            pools::reconcile(Arc::new(pool), context(&server, calm.clone()))
                .await
                .unwrap();
            allocator(server.clone(), seed, 1).await;
        }
        let mut owner: BTreeMap<IpAddr, String> = BTreeMap::new();
        let ledger = ledger(&server, "lan");
        for pod in server.list::<Pod>() {
            let group = pod
                .annotations()
                .get(annotation::SET)
                .cloned()
                .unwrap_or_else(|| pod.name_any());
            let addrs = assigned_ips(&pod);
            assert_eq!(
                addrs.len(),
                1,
                "seed {seed}: {} holds {addrs:?}",
                pod.name_any()
            );
            let addr = addrs[0];
            assert!(
                used_ranges::contains(&ledger, addr),
                "seed {seed}: {addr} not in the ledger"
            );
            let first = owner.entry(addr).or_insert_with(|| group.clone());
            assert_eq!(*first, group, "seed {seed}: {addr} given to two groups");
        }
        assert_eq!(owner.len(), 9, "seed {seed}: {owner:?}");
    }
}
