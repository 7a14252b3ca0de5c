//! Workload reservations (`status.reservedIP`) against the fake API server:
//! an address a workload reserved goes to that workload's pods only, on the
//! batched and the direct allocation path, with stale books and caches; and
//! the other tie of a record to its workload, the Rancher workload selector
//! of a CronJob's pod.

use std::{collections::BTreeMap, sync::Arc};

use flatnet_k8s::api::{FlatNetworkIP, FlatNetworkSubnet, IpRange, phase};
use k8s_openapi::{
    api::{
        apps::v1::{ReplicaSet, StatefulSet},
        core::v1::Pod,
    },
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time},
    jiff::Timestamp,
};
use kube::{
    Api, ResourceExt,
    api::{Patch, PatchParams},
};
use serde_json::json;

use super::{
    FakeApiServer, NS, PodExt, Settings, commit, context_from, ip, ips, pod, race_subnet, record_of,
};
use flatnet_k8s::keys::SUBNET_NAMESPACE;

fn owned(kind: &str, name: &str) -> OwnerReference {
    OwnerReference {
        api_version: "apps/v1".into(),
        kind: kind.into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        controller: Some(true),
        block_owner_deletion: None,
    }
}

/// ReplicaSet `<deployment>-rs` of Deployment `deployment`.
fn replica_set(deployment: &str) -> ReplicaSet {
    ReplicaSet {
        metadata: ObjectMeta {
            name: Some(format!("{deployment}-rs")),
            namespace: Some(NS.into()),
            owner_references: Some(vec![owned("Deployment", deployment)]),
            ..ObjectMeta::default()
        },
        ..ReplicaSet::default()
    }
}

/// Pod `name` of subnet `race` asking for `ip` (`auto` or addresses),
/// controlled by `owner` (a ReplicaSet or StatefulSet) when given.
fn race_pod(name: &str, ip_request: &str, owner: Option<OwnerReference>) -> Pod {
    let mut p = pod(name)
        .flat()
        .annotated("flatnetwork.pandaria.io/subnet", "race")
        .annotated("flatnetwork.pandaria.io/ip", ip_request);
    p.metadata.owner_references = owner.map(|o| vec![o]);
    p
}

/// Subnet `race` with `reserved` as its `reservedIP`.
fn server_with(reserved: &[(&str, &str, &str)]) -> FakeApiServer {
    let server = FakeApiServer::new();
    let mut subnet = race_subnet();
    subnet
        .status
        .get_or_insert_with(Default::default)
        .reserved_ip = reservations(reserved);
    server.insert(&subnet);
    server.insert(&replica_set("web"));
    server.insert(&replica_set("other"));
    server.insert(&StatefulSet {
        metadata: ObjectMeta {
            name: Some("db".into()),
            namespace: Some(NS.into()),
            ..ObjectMeta::default()
        },
        ..StatefulSet::default()
    });
    server
}

fn reservations(reserved: &[(&str, &str, &str)]) -> BTreeMap<String, Vec<IpRange>> {
    let mut map: BTreeMap<String, Vec<IpRange>> = BTreeMap::new();
    for (key, from, to) in reserved {
        map.entry((*key).to_owned())
            .or_default()
            .push(IpRange::new(ip(from), ip(to)));
    }
    map
}

/// Creates `p` and its record, then runs the IP controller on the record
/// once with caches read from `server` now; the record as stored after.
async fn allocate(server: &FakeApiServer, ctx: &Arc<super::Context>, p: &Pod) -> FlatNetworkIP {
    let record = stored_pod_record(server, p);
    let _ = ips::reconcile(Arc::new(record), Arc::clone(ctx)).await;
    stored(server, &p.name_any())
}

fn stored_pod_record(server: &FakeApiServer, p: &Pod) -> FlatNetworkIP {
    server.insert(p);
    let mut record = record_of(p, "0");
    record.metadata.resource_version = None;
    server.insert(&record);
    stored(server, &p.name_any())
}

fn stored(server: &FakeApiServer, name: &str) -> FlatNetworkIP {
    server
        .list::<FlatNetworkIP>()
        .into_iter()
        .find(|r| r.name_any() == name)
        .expect("record stored")
}

fn addr(record: &FlatNetworkIP) -> Option<std::net::IpAddr> {
    record.status.as_ref().and_then(|s| s.addr)
}

/// A context whose caches hold what `server` holds now (the pods included,
/// so the IP controller finds them).
fn fresh(server: &FakeApiServer) -> Arc<super::Context> {
    context_from(server, Settings::default())
}

#[tokio::test]
async fn auto_allocation_skips_reserved_addresses_and_their_workload_gets_them() {
    let server = server_with(&[
        ("Deployment/shop/web", "10.0.0.10", "10.0.0.11"),
        ("StatefulSet/shop/db", "10.0.0.12", "10.0.0.12"),
        ("MacvlanIP/shop/old", "10.0.0.13", "10.0.0.13"),
    ]);
    // Every pod is known to the caches before its record is reconciled.
    let pods = [
        race_pod("auto-0", "auto", None),
        race_pod("auto-1", "auto", None),
        race_pod("web-1", "10.0.0.11", Some(owned("ReplicaSet", "web-rs"))),
        race_pod("db-0", "10.0.0.12", Some(owned("StatefulSet", "db"))),
    ];
    for p in &pods {
        server.insert(p);
    }
    let ctx = fresh(&server);
    let given: Vec<_> = {
        let mut given = Vec::new();
        for p in &pods {
            given.push(addr(&allocate(&server, &ctx, p).await));
        }
        given
    };
    assert_eq!(
        given,
        [
            Some(ip("10.0.0.14")),
            Some(ip("10.0.0.15")),
            // A Deployment's pod (via its ReplicaSet) and a StatefulSet's
            // pod get what their workload reserved.
            Some(ip("10.0.0.11")),
            Some(ip("10.0.0.12")),
        ]
    );
    // Nothing reserved went into the ledger but what was handed out.
    let used = server.list::<FlatNetworkSubnet>()[0]
        .status
        .clone()
        .unwrap()
        .used_ip;
    assert!(!flatnet_k8s::ipam::used_ranges::contains(
        &used,
        ip("10.0.0.10")
    ));
    assert!(!flatnet_k8s::ipam::used_ranges::contains(
        &used,
        ip("10.0.0.13")
    ));
}

#[tokio::test]
async fn another_workloads_pod_is_refused_the_reserved_address_and_told_whose_it_is() {
    let server = server_with(&[("Deployment/shop/web", "10.0.0.10", "10.0.0.10")]);
    let batched = race_pod(
        "other-1",
        "10.0.0.10",
        Some(owned("ReplicaSet", "other-rs")),
    );
    // A fixed MAC takes the direct path (no group commit).
    let direct = race_pod("bare", "10.0.0.10", None)
        .annotated("flatnetwork.pandaria.io/mac", "0a:00:00:00:00:01");
    server.insert(&batched);
    server.insert(&direct);
    let ctx = fresh(&server);
    for (p, path) in [(&batched, "batched"), (&direct, "direct")] {
        let mut record = stored_pod_record(&server, p);
        if path == "direct" {
            record.spec.macs = vec!["0a:00:00:00:00:01".into()];
            server.insert(&record);
            record = stored(&server, &p.name_any());
        }
        assert_eq!(commit::batchable(&record), path == "batched");
        let error = ips::reconcile(Arc::new(record), Arc::clone(&ctx))
            .await
            .unwrap_err();
        assert_eq!(error.event_reason(), "RequestedAddressReserved", "{path}");
        let record = stored(&server, &p.name_any());
        let status = record.status.unwrap();
        assert_eq!(status.phase, phase::FAILED, "{path}");
        assert!(
            status
                .failure_message
                .contains("10.0.0.10 of subnet race is reserved by Deployment/shop/web"),
            "{path}: {}",
            status.failure_message
        );
        assert_eq!(status.addr, None, "{path}");
    }
}

/// The allocator's book (the ledger as last written, kept in memory) and
/// its caches predate a reservation: the ledger write, conditional on the
/// subnet's resourceVersion, conflicts, and the batch is chosen again with
/// the reservation in view.
#[tokio::test]
async fn a_reservation_written_after_the_book_was_read_is_honoured() {
    let server = server_with(&[]);
    let first = race_pod("auto-0", "auto", None);
    let second = race_pod("auto-1", "auto", None);
    server.insert(&first);
    server.insert(&second);
    let ctx = fresh(&server);
    assert_eq!(
        addr(&allocate(&server, &ctx, &first).await),
        Some(ip("10.0.0.10"))
    );
    // The workload controller reserves the next free address now.
    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(server.client(), SUBNET_NAMESPACE);
    subnets
        .patch_status(
            "race",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"reservedIP": {
                "Deployment/shop/web": [{"from": "10.0.0.11", "to": "10.0.0.11"}]
            }}})),
        )
        .await
        .unwrap();
    let gets = |server: &FakeApiServer| server.requests_by_verb().get("get").copied();
    let before = gets(&server);
    assert_eq!(
        addr(&allocate(&server, &ctx, &second).await),
        Some(ip("10.0.0.12"))
    );
    assert_eq!(
        gets(&server).unwrap_or(0) - before.unwrap_or(0),
        1,
        "the stale book's write was refused and the subnet read again"
    );
    // The reserving workload's pod gets it from the same (now fresh) book.
    let web = race_pod("web-1", "10.0.0.11", Some(owned("ReplicaSet", "web-rs")));
    server.insert(&web);
    let ctx_with_web = fresh(&server);
    assert_eq!(
        addr(&allocate(&server, &ctx_with_web, &web).await),
        Some(ip("10.0.0.11"))
    );
}

/// A reserved address given back by its workload's pod stays out of
/// automatic allocation within the same book, and a reservation the
/// workload controller removed frees the address for everyone.
#[tokio::test]
async fn a_released_reserved_address_is_not_handed_to_an_auto_pod() {
    let server = server_with(&[("Deployment/shop/web", "10.0.0.10", "10.0.0.10")]);
    let web = race_pod("web-1", "10.0.0.10", Some(owned("ReplicaSet", "web-rs")));
    let later = race_pod("auto-0", "auto", None);
    server.insert(&web);
    server.insert(&later);
    let ctx = fresh(&server);
    let held = allocate(&server, &ctx, &web).await;
    assert_eq!(addr(&held), Some(ip("10.0.0.10")));
    // The pod goes; its record is deleted and releases the address.
    let mut deleted = held.clone();
    deleted.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
    ips::reconcile(Arc::new(deleted), Arc::clone(&ctx))
        .await
        .unwrap();
    assert_eq!(
        addr(&allocate(&server, &ctx, &later).await),
        Some(ip("10.0.0.11"))
    );
    // The workload is gone: the controller drops its reservation.
    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(server.client(), SUBNET_NAMESPACE);
    subnets
        .patch_status(
            "race",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"reservedIP": {"Deployment/shop/web": null}}})),
        )
        .await
        .unwrap();
    let next = race_pod("auto-1", "auto", None);
    server.insert(&next);
    let ctx = fresh(&server);
    assert_eq!(
        addr(&allocate(&server, &ctx, &next).await),
        Some(ip("10.0.0.10"))
    );
}

/// A CronJob's pod gets the original's `cronjob-<namespace>-<name>`
/// workload selector, read through its Job; a plain Job's pod
/// `job-<namespace>-<name>`.
#[tokio::test]
async fn a_cronjob_pods_record_carries_the_cronjob_workload_selector() {
    use k8s_openapi::api::batch::v1::Job;
    let server = server_with(&[]);
    let job = |name: &str, cronjob: Option<&str>| Job {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            owner_references: cronjob.map(|c| {
                vec![OwnerReference {
                    api_version: "batch/v1".into(),
                    ..owned("CronJob", c)
                }]
            }),
            ..ObjectMeta::default()
        },
        ..Job::default()
    };
    server.insert(&job("nightly-29000000", Some("nightly")));
    server.insert(&job("once", None));
    let job_owner = |name: &str| OwnerReference {
        api_version: "batch/v1".into(),
        ..owned("Job", name)
    };
    let nightly = race_pod(
        "nightly-29000000-x",
        "auto",
        Some(job_owner("nightly-29000000")),
    );
    let once = race_pod("once-y", "auto", Some(job_owner("once")));
    server.insert(&nightly);
    server.insert(&once);
    let ctx = fresh(&server);
    for (p, selector) in [(&nightly, "cronjob-shop-nightly"), (&once, "job-shop-once")] {
        super::pods::reconcile(Arc::new(super::CachedPod::from(p)), Arc::clone(&ctx))
            .await
            .unwrap();
        let record = stored(&server, &p.name_any());
        assert_eq!(
            record.labels()["workload.user.cattle.io/workloadselector"],
            selector
        );
    }
}
