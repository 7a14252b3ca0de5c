//! The workload controller against the fake API server: labels, the
//! reservations of every kind (CronJobs included), and reservations going
//! with their workload.

use std::{sync::Arc, time::Duration};

use k8s_openapi::api::{
    apps::v1::{Deployment, StatefulSet},
    batch::v1::CronJob,
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::allocation::{fake_api::FakeApiServer, fake_cluster::subnet};

const NS: &str = "shop";

fn template(annotations: &Value) -> Value {
    json!({"metadata": {"annotations": annotations}, "spec": {"containers": [{"name": "c", "image": "i"}]}})
}

fn deployment(name: &str, annotations: &Value) -> Deployment {
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"selector": {}, "template": template(annotations)}
    }))
    .unwrap()
}

fn statefulset(name: &str, annotations: &Value) -> StatefulSet {
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"selector": {}, "serviceName": name, "template": template(annotations)}
    }))
    .unwrap()
}

fn cronjob(name: &str, annotations: &Value) -> CronJob {
    serde_json::from_value(json!({
        "apiVersion": "batch/v1", "kind": "CronJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": template(annotations)}}}
    }))
    .unwrap()
}

fn flat(subnet: &str, ip: &str) -> Value {
    json!({"flatnetwork.pandaria.io/subnet": subnet, "flatnetwork.pandaria.io/ip": ip})
}

fn range(from: &str, to: &str) -> IpRange {
    IpRange::new(from.parse().unwrap(), to.parse().unwrap())
}

#[test]
fn requests_read_the_pod_template_and_the_cronjob_job_template() {
    let web = FlatRequest::of(&deployment("web", &flat("lan", "10.0.0.5-10.0.0.6"))).unwrap();
    assert_eq!(web.key, "Deployment/shop/web");
    assert_eq!(web.labels("macvlan")[label::IP_TYPE], "specific");
    let nightly = FlatRequest::of(&cronjob("nightly", &flat("lan", "auto"))).unwrap();
    assert_eq!(nightly.key, "CronJob/shop/nightly");
    assert_eq!(nightly.labels("ipvlan")[label::IP_TYPE], "auto");
    assert_eq!(nightly.labels("ipvlan")[label::FLAT_MODE], "ipvlan");
    // Both annotations are needed, as in the original.
    assert!(
        FlatRequest::of(&deployment(
            "x",
            &json!({"flatnetwork.pandaria.io/subnet": "lan"})
        ))
        .is_none()
    );
    assert!(FlatRequest::of(&deployment("x", &json!({}))).is_none());
}

#[test]
fn reservations_merge_addresses_and_the_patch_nulls_removed_keys() {
    let a = FlatRequest::of(&deployment("a", &flat("lan", "10.0.0.7-10.0.0.5-10.0.0.6"))).unwrap();
    let b = FlatRequest::of(&deployment("b", &flat("lan", "auto"))).unwrap();
    let wanted = reservations("lan", [&a, &b]);
    assert_eq!(
        wanted,
        BTreeMap::from([(
            "Deployment/shop/a".to_owned(),
            vec![range("10.0.0.5", "10.0.0.7")]
        )])
    );
    let current = BTreeMap::from([(
        "Deployment/shop/gone".to_owned(),
        vec![range("10.0.0.9", "10.0.0.9")],
    )]);
    let patch = reservation_patch(&current, &wanted).unwrap();
    assert_eq!(
        patch,
        json!({"status": {"reservedIP": {
            "Deployment/shop/gone": null,
            "Deployment/shop/a": [{"from": "10.0.0.5", "to": "10.0.0.7"}]
        }}})
    );
    assert_eq!(reservation_patch(&wanted, &wanted), None);
}

/// Polls `check` until it holds, at most `within`.
async fn eventually(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        if check() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    check()
}

fn reserved(server: &FakeApiServer) -> BTreeMap<String, Vec<IpRange>> {
    server
        .list::<FlatNetworkSubnet>()
        .into_iter()
        .find(|s| s.name_any() == "lan")
        .and_then(|s| s.status)
        .map(|s| s.reserved_ip)
        .unwrap_or_default()
}

#[tokio::test]
async fn workloads_are_labelled_and_reserve_their_addresses_until_deleted() {
    let server = FakeApiServer::new();
    server.insert(&subnet("lan", "10.0.0.0/24", None, &[]));
    server.insert(&deployment("web", &flat("lan", "10.0.0.5-10.0.0.6")));
    server.insert(&statefulset("db", &flat("lan", "auto")));
    server.insert(&cronjob("nightly", &flat("lan", "10.0.0.20")));
    server.insert(&deployment("plain", &json!({})));
    let stop = CancellationToken::new();
    let task = tokio::spawn(run(
        server.client(),
        Arc::new(Metrics::new()),
        Duration::from_secs(600),
        2,
        stop.clone(),
    ));

    let expected = BTreeMap::from([
        (
            "CronJob/shop/nightly".to_owned(),
            vec![range("10.0.0.20", "10.0.0.20")],
        ),
        (
            "Deployment/shop/web".to_owned(),
            vec![range("10.0.0.5", "10.0.0.6")],
        ),
    ]);
    assert!(
        eventually(Duration::from_secs(20), || reserved(&server) == expected).await,
        "reservedIP: {:?}",
        reserved(&server)
    );
    let labels_of = |name: &str| -> BTreeMap<String, String> {
        let deployments = server.list::<Deployment>();
        let statefulsets = server.list::<StatefulSet>();
        let cronjobs = server.list::<CronJob>();
        deployments
            .iter()
            .map(|d| (d.name_any(), d.labels().clone()))
            .chain(
                statefulsets
                    .iter()
                    .map(|s| (s.name_any(), s.labels().clone())),
            )
            .chain(cronjobs.iter().map(|c| (c.name_any(), c.labels().clone())))
            .find(|(n, _)| n == name)
            .map(|(_, l)| l)
            .unwrap_or_default()
    };
    assert!(
        eventually(Duration::from_secs(10), || labels_of("db").len() == 3).await,
        "{:?}",
        labels_of("db")
    );
    assert_eq!(
        labels_of("web"),
        BTreeMap::from([
            (label::IP_TYPE.to_owned(), "specific".to_owned()),
            (label::SUBNET.to_owned(), "lan".to_owned()),
            (label::FLAT_MODE.to_owned(), "macvlan".to_owned()),
        ])
    );
    assert_eq!(labels_of("db")[label::IP_TYPE], "auto");
    assert_eq!(labels_of("nightly")[label::SUBNET], "lan");
    assert!(
        labels_of("plain").is_empty(),
        "a workload without the flat network is left alone"
    );

    // The original leaked this reservation (no finalizer): here it goes.
    assert!(server.delete::<Deployment>(NS, "web"));
    let left = BTreeMap::from([(
        "CronJob/shop/nightly".to_owned(),
        vec![range("10.0.0.20", "10.0.0.20")],
    )]);
    assert!(
        eventually(Duration::from_secs(20), || reserved(&server) == left).await,
        "reservedIP after the delete: {:?}",
        reserved(&server)
    );
    stop.cancel();
    task.await.unwrap();
}
