//! Tests of the migrator: pure conversions on fixtures holding every V1
//! field, and the commands against a mocked API server that checks each
//! request (so a dry run provably writes nothing).

use std::{collections::BTreeMap, future::Future, time::Duration};

use flatnet_k8s::api::{IpRange, Route, RouteSettings};
use k8s_openapi::api::core::v1::Service;
use serde_json::{Value, json};

use super::{
    backup,
    convert::{self, Issue},
    kinds,
    migration::{self, Options},
    v1::MacvlanSubnet,
};
use crate::fixtures::{ApiServerVerifier, list, mock_client, not_found, ok};

const NAD: &str = "rancher-flat-network";

/// A V1 subnet with every field of the V1 API set.
fn v1_subnet_json() -> Value {
    json!({
        "apiVersion": "macvlan.cluster.cattle.io/v1",
        "kind": "MacvlanSubnet",
        "metadata": {
            "name": "vlan10", "namespace": "kube-system", "uid": "u-1", "resourceVersion": "7",
            "labels": {"team": "net"},
            "annotations": {"note": "lab", "kubectl.kubernetes.io/last-applied-configuration": "{}"}
        },
        "spec": {
            "master": "eth0", "vlan": 10, "cidr": "10.10.0.0/24", "mode": "bridge",
            "gateway": "10.10.0.1",
            "ranges": [{"rangeStart": "10.10.0.100", "rangeEnd": "10.10.0.150"},
                       {"rangeStart": "10.10.0.200", "rangeEnd": "10.10.0.210"}],
            "routes": [{"dst": "192.168.5.7", "gw": "10.10.0.254", "iface": "eth1"},
                       {"dst": "172.16.0.0/12", "iface": "eth0"},
                       {"dst": "fd00::9"}],
            "podDefaultGateway": {"enable": true, "serviceCidr": "10.43.0.0/16"},
            "ipDelayReuse": 300
        },
        "status": {"phase": "Active", "failureMessage": "", "usedIP": [{"rangeStart": "10.10.0.1", "rangeEnd": "10.10.0.1"}],
                   "usedIPCount": 1, "usedMac": null}
    })
}

fn v1_subnet() -> MacvlanSubnet {
    serde_json::from_value(v1_subnet_json()).expect("the V1 fixture decodes")
}

fn fields(issues: &[Issue]) -> Vec<&str> {
    issues.iter().map(|i| i.field.as_str()).collect()
}

#[test]
fn v1_types_keep_every_field() {
    let back = serde_json::to_value(v1_subnet()).unwrap();
    let original = v1_subnet_json();
    assert_eq!(back["spec"], original["spec"]);
    assert_eq!(back["status"]["usedIP"], original["status"]["usedIP"]);
}

#[test]
fn subnet_conversion_maps_every_v1_field() {
    let (v2, issues) = convert::subnet(&v1_subnet());
    assert_eq!(v2.metadata.name.as_deref(), Some("vlan10"));
    assert_eq!(
        v2.metadata.namespace.as_deref(),
        Some("cattle-flat-network")
    );
    assert_eq!(
        v2.metadata.labels,
        Some(BTreeMap::from([("team".into(), "net".into())]))
    );
    assert_eq!(
        v2.metadata.annotations,
        Some(BTreeMap::from([("note".into(), "lab".into())])),
        "kubectl's record of the V1 manifest is not copied"
    );
    let spec = &v2.spec;
    assert_eq!(
        (
            spec.flat_mode.as_str(),
            spec.master.as_str(),
            spec.vlan,
            spec.cidr.as_str(),
            spec.mode.as_str()
        ),
        ("macvlan", "eth0", 10, "10.10.0.0/24", "bridge")
    );
    assert_eq!(spec.ipvlan_flag, "");
    assert_eq!(spec.gateway, Some("10.10.0.1".parse().unwrap()));
    assert_eq!(
        spec.ranges,
        [
            IpRange::new(
                "10.10.0.100".parse().unwrap(),
                "10.10.0.150".parse().unwrap()
            ),
            IpRange::new(
                "10.10.0.200".parse().unwrap(),
                "10.10.0.210".parse().unwrap()
            ),
        ]
    );
    assert_eq!(
        spec.routes,
        [
            Route {
                dev: "eth1".into(),
                dst: "192.168.5.7/32".into(),
                src: None,
                via: Some("10.10.0.254".parse().unwrap()),
                priority: 0
            },
            Route {
                dev: "eth0".into(),
                dst: "172.16.0.0/12".into(),
                src: None,
                via: None,
                priority: 0
            },
            Route {
                dev: "eth1".into(),
                dst: "fd00::9/128".into(),
                src: None,
                via: None,
                priority: 0
            },
        ]
    );
    assert_eq!(
        spec.route_settings,
        RouteSettings {
            flat_network_default_gateway: true,
            add_service_cidr: true,
            ..RouteSettings::default()
        }
    );
    assert_eq!(v2.status, None, "status is the operator's to compute");
    assert_eq!(
        fields(&issues),
        [
            "spec.routes[2].iface",
            "spec.podDefaultGateway.serviceCidr",
            "spec.ipDelayReuse"
        ],
        "every inexact value is reported: {issues:#?}"
    );
}

#[test]
fn unparsable_values_are_reported_not_dropped_silently() {
    let mut subnet = v1_subnet();
    subnet.spec.gateway = "10.10.0.x".into();
    subnet.spec.ranges[1].range_end = String::new();
    subnet.spec.routes[0].dst = "not-an-address".into();
    subnet.spec.routes[1].gw = "bad".into();
    subnet.spec.pod_default_gateway.service_cidr.clear();
    subnet.spec.ip_delay_reuse = 0;
    subnet.spec.routes[2].iface = "eth1".into();
    let (v2, issues) = convert::subnet(&subnet);
    assert_eq!(
        fields(&issues),
        [
            "spec.gateway",
            "spec.ranges[1]",
            "spec.routes[0].dst",
            "spec.routes[1].gw"
        ]
    );
    assert!(
        issues
            .iter()
            .all(|i| i.object == "MacvlanSubnet kube-system/vlan10")
    );
    assert_eq!(v2.spec.gateway, None);
    assert_eq!(v2.spec.ranges.len(), 1);
    assert_eq!(v2.spec.routes.len(), 1);
    assert!(issues[0].to_string().contains("10.10.0.x"), "{}", issues[0]);
}

fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).into(), (*v).into()))
        .collect()
}

#[test]
fn every_v1_annotation_key_is_renamed_or_reported() {
    let before = annotations(&[
        ("macvlan.pandaria.cattle.io/ip", "10.10.0.5-10.10.0.6"),
        ("macvlan.pandaria.cattle.io/subnet", "vlan10"),
        (
            "macvlan.pandaria.cattle.io/mac",
            "aa:bb:cc:dd:ee:01-aa:bb:cc:dd:ee:02",
        ),
        ("macvlan.panda.io/ingress", "true"),
        ("macvlan.panda.io/macvlanService", "disabled"),
        ("macvlan.panda.io/ipv6to4", "true"),
        ("macvlan.panda.io/ipDelayReuseTimestamp", "1700000000"),
        ("macvlan.panda.io/somethingElse", "x"),
        (
            "k8s.v1.cni.cncf.io/networks",
            r#"[{"name":"static-macvlan-cni-attach","interface":"eth1"}]"#,
        ),
        ("app", "web"),
    ]);
    let rewrite = convert::annotations("Deployment shop/web", &before, NAD);
    let after = rewrite.apply(&before);
    assert_eq!(
        after,
        annotations(&[
            ("flatnetwork.pandaria.io/ip", "10.10.0.5-10.10.0.6"),
            ("flatnetwork.pandaria.io/subnet", "vlan10"),
            (
                "flatnetwork.pandaria.io/mac",
                "aa:bb:cc:dd:ee:01-aa:bb:cc:dd:ee:02"
            ),
            ("flatnetwork.pandaria.io/ingress", "true"),
            ("flatnetwork.pandaria.io/flatNetworkService", "disabled"),
            ("flatnetwork.pandaria.io/ipv6to4", "true"),
            (
                "k8s.v1.cni.cncf.io/networks",
                r#"[{"interface":"eth1","name":"rancher-flat-network"}]"#
            ),
            ("app", "web"),
        ])
    );
    assert_eq!(fields(&rewrite.issues), ["macvlan.panda.io/somethingElse"]);
    let patch = rewrite.merge_patch();
    assert_eq!(patch["macvlan.pandaria.cattle.io/ip"], Value::Null);
    assert_eq!(patch["flatnetwork.pandaria.io/subnet"], "vlan10");
    assert!(
        patch.get("app").is_none(),
        "untouched keys stay out of the patch"
    );
}

#[test]
fn an_existing_v2_value_wins_and_the_v1_one_is_reported() {
    let before = annotations(&[
        ("macvlan.pandaria.cattle.io/ip", "auto"),
        ("flatnetwork.pandaria.io/ip", "10.0.0.5"),
    ]);
    let rewrite = convert::annotations("Deployment shop/web", &before, NAD);
    assert_eq!(
        rewrite.apply(&before),
        annotations(&[("flatnetwork.pandaria.io/ip", "10.0.0.5")])
    );
    assert_eq!(fields(&rewrite.issues), ["macvlan.pandaria.cattle.io/ip"]);
}

#[test]
fn multus_selections_in_both_forms_point_at_the_new_attachment() {
    assert_eq!(
        convert::multus_networks(
            r#"[{"name":"static-macvlan-cni-attach","namespace":"kube-system","interface":"eth0"},{"name":"other"}]"#,
            NAD
        )
        .as_deref(),
        Some(r#"[{"interface":"eth0","name":"rancher-flat-network"},{"name":"other"}]"#)
    );
    assert_eq!(
        convert::multus_networks("kube-system/static-macvlan-cni-attach@eth1, other", NAD)
            .as_deref(),
        Some("rancher-flat-network@eth1,other")
    );
    assert_eq!(
        convert::multus_networks("static-macvlan-cni-attach", NAD).as_deref(),
        Some(NAD)
    );
    assert_eq!(convert::multus_networks(r#"[{"name":"other"}]"#, NAD), None);
    assert_eq!(convert::multus_networks("other@eth1", NAD), None);
}

#[test]
fn a_selection_multus_cannot_parse_as_json_is_left_alone() {
    // Found by the multus_annotations fuzz target: read as a list, the V1
    // entry was replaced and the trimmed entries joined into valid JSON.
    for broken in [
        "[{\"name\":\"a\",\"interface\":\"x,\tstatic-macvlan-cni-attach,\ty\"}]",
        "[static-macvlan-cni-attach]",
        "{\"name\":\"static-macvlan-cni-attach\"}",
    ] {
        assert_eq!(convert::multus_networks(broken, NAD), None, "{broken:?}");
    }
}

fn v1_service() -> Service {
    serde_json::from_value(json!({
        "metadata": {"name": "web-macvlan", "namespace": "shop",
                     "annotations": {"k8s.v1.cni.cncf.io/networks": "static-macvlan-cni-attach"},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": "u-web"}]},
        "spec": {"type": "NodePort", "clusterIP": "10.43.0.9", "selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 80, "targetPort": 8080, "nodePort": 30080}]}
    }))
    .unwrap()
}

#[test]
fn v1_services_become_headless_flat_network_services() {
    assert!(convert::is_v1_service(&v1_service()));
    let mut plain = v1_service();
    plain.metadata.name = Some("web".into());
    assert!(
        !convert::is_v1_service(&plain),
        "the name must end in -macvlan"
    );
    let flat = serde_json::to_value(convert::flat_service(&v1_service(), NAD)).unwrap();
    assert_eq!(flat["metadata"]["name"], "web-flat-network");
    assert_eq!(
        flat["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"],
        NAD
    );
    assert_eq!(flat["metadata"]["ownerReferences"][0]["uid"], "u-web");
    assert_eq!(flat["spec"]["clusterIP"], "None");
    assert_eq!(flat["spec"]["type"], "ClusterIP");
    assert_eq!(flat["spec"]["selector"], json!({"app": "web"}));
    assert_eq!(
        flat["spec"]["ports"],
        json!([{"name": "http", "port": 80, "targetPort": 8080}])
    );
}

fn workload(kind: &kinds::Kind, name: &str, template_annotations: Value) -> Value {
    let template =
        json!({"metadata": {"annotations": template_annotations}, "spec": {"containers": []}});
    let spec = if *kind == kinds::CRON_JOB {
        json!({"schedule": "* * * * *", "jobTemplate": {"spec": {"template": template}}})
    } else {
        json!({"template": template})
    };
    json!({
        "apiVersion": kind.api_version, "kind": kind.kind,
        "metadata": {"name": name, "namespace": "shop", "labels": {"macvlan.pandaria.cattle.io/subnet": "vlan10", "app": name}},
        "spec": spec
    })
}

fn v1_template() -> Value {
    json!({"macvlan.pandaria.cattle.io/ip": "auto", "macvlan.pandaria.cattle.io/subnet": "vlan10"})
}

#[test]
fn cronjobs_are_read_and_patched_at_their_pod_template() {
    let cron = workload(&kinds::CRON_JOB, "nightly", v1_template());
    assert_eq!(
        migration::template_annotations(&kinds::CRON_JOB, &cron).len(),
        2
    );
    let mut issues = Vec::new();
    let changes = migration::plan_workloads(&kinds::CRON_JOB, &[cron], NAD, &mut issues);
    assert!(issues.is_empty(), "{issues:?}");
    let patch = &changes[0].patch;
    let at_template = &patch["spec"]["jobTemplate"]["spec"]["template"]["metadata"]["annotations"];
    assert_eq!(at_template["flatnetwork.pandaria.io/ip"], "auto");
    assert_eq!(
        at_template["macvlan.pandaria.cattle.io/subnet"],
        Value::Null
    );
    assert_eq!(
        patch["metadata"]["labels"],
        json!({"macvlan.pandaria.cattle.io/subnet": null})
    );
}

#[test]
fn owned_workloads_are_left_to_their_owner_and_jobs_are_reported() {
    let mut owned = workload(&kinds::REPLICA_SET, "web-6d8f", v1_template());
    owned["metadata"]["ownerReferences"] = json!([{"kind": "Deployment", "name": "web", "uid": "u", "controller": true, "apiVersion": "apps/v1"}]);
    let mut issues = Vec::new();
    assert!(migration::plan_workloads(&kinds::REPLICA_SET, &[owned], NAD, &mut issues).is_empty());
    assert!(issues.is_empty());

    let job = workload(&kinds::JOB, "once", v1_template());
    assert!(migration::plan_workloads(&kinds::JOB, &[job], NAD, &mut issues).is_empty());
    assert_eq!(issues.len(), 1);
    assert!(
        issues[0].outcome.contains("recreate the Job"),
        "{}",
        issues[0]
    );

    let plain = workload(&kinds::DEPLOYMENT, "plain", json!({"app": "x"}));
    let mut plain = plain;
    plain["metadata"]["labels"] = json!({"app": "plain"});
    assert!(migration::plan_workloads(&kinds::DEPLOYMENT, &[plain], NAD, &mut issues).is_empty());
}

#[test]
fn restore_reads_backups_in_dependency_order_and_refuses_unknown_kinds() {
    let dir = tempfile::tempdir().unwrap();
    let write = |path: &str, value: Value| {
        let path = dir.path().join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, value.to_string()).unwrap();
    };
    write("macvlansubnet/kube-system.vlan10.json", v1_subnet_json());
    write(
        "customresourcedefinition/macvlansubnets.macvlan.cluster.cattle.io.json",
        json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition", "metadata": {"name": "macvlansubnets.macvlan.cluster.cattle.io"}}),
    );
    write(
        "namespace/cattle-flat-network.json",
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "cattle-flat-network"}}),
    );
    let objects = backup::read_backup(dir.path()).unwrap();
    let order: Vec<&str> = objects.iter().map(|(k, _)| k.kind).collect();
    assert_eq!(
        order,
        ["CustomResourceDefinition", "Namespace", "MacvlanSubnet"]
    );

    write(
        "x/secret.json",
        json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}}),
    );
    let err = backup::read_backup(dir.path()).unwrap_err();
    assert!(
        matches!(err, super::MigrateError::UnknownKind { .. }),
        "{err}"
    );
}

/// A backup file as the original migrator writes it: YAML documents, the
/// Namespace and the V2 subnet without apiVersion and kind, a blanked
/// last-applied annotation, an empty document.
const UPSTREAM_BACKUP: &str = r#"---
apiVersion: v1
kind: Service
metadata:
  name: web-macvlan
  namespace: shop
  annotations:
    k8s.v1.cni.cncf.io/networks: static-macvlan-cni-attach
spec:
  clusterIP: None
  selector: {app: web}
---
metadata:
  name: vlan10
  namespace: cattle-flat-network
  annotations:
    kubectl.kubernetes.io/last-applied-configuration: ""
spec:
  flatMode: macvlan
  master: eth0
  vlan: 10
  cidr: 10.10.0.0/24
status:
  phase: Active
---
metadata:
  name: cattle-flat-network
---
---
apiVersion: macvlan.cluster.cattle.io/v1
kind: MacvlanSubnet
metadata:
  name: vlan10
  namespace: kube-system
spec:
  master: eth0
  vlan: 10
  cidr: 10.10.0.0/24
"#;

#[test]
fn an_upstream_backup_file_is_read_with_its_untyped_objects() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("flat-network-backup-output.yaml");
    std::fs::write(&file, UPSTREAM_BACKUP).unwrap();
    let objects = backup::read_backup(&file).unwrap();
    let order: Vec<&str> = objects.iter().map(|(k, _)| k.kind).collect();
    assert_eq!(
        order,
        ["Namespace", "MacvlanSubnet", "FlatNetworkSubnet", "Service"]
    );
    let subnet = &objects[2].1;
    assert_eq!(subnet["apiVersion"], "flatnetwork.pandaria.io/v1");
    assert_eq!(subnet["spec"]["vlan"], 10);
    assert_eq!(subnet["status"]["phase"], "Active", "status is restored");
    assert_eq!(subnet["metadata"]["annotations"], json!({}));

    std::fs::write(&file, "metadata: {name: mystery, namespace: shop}\n").unwrap();
    let err = backup::read_backup(&file).unwrap_err();
    assert!(
        matches!(err, super::MigrateError::UnknownKind { .. }),
        "{err}"
    );
}

#[test]
fn the_original_migrators_flags_are_accepted() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: super::MigrateCommand,
    }
    let cli = Cli::try_parse_from([
        "migrate",
        "migrate",
        "--yes",
        "--context",
        "prod",
        "--migrate-service=false",
        "--workload",
        "deployment,cronjob",
    ])
    .unwrap();
    let super::MigrateCommand::Migrate {
        migrate_service,
        common,
        workload,
        ..
    } = cli.command
    else {
        panic!("not the migrate step");
    };
    assert!(!migrate_service);
    assert!(common.yes);
    assert_eq!(common.context(), Some("prod".to_owned()));
    assert_eq!(workload.len(), 2);
    let cli = Cli::try_parse_from([
        "migrate",
        "restore",
        "-f",
        "flat-network-backup-output.yaml",
    ])
    .unwrap();
    assert!(matches!(cli.command, super::MigrateCommand::Restore { .. }));
}

// --- against a mocked API server -------------------------------------------

const V1_SUBNETS: &str = "/apis/macvlan.cluster.cattle.io/v1/macvlansubnets?";
const V2_SUBNET: &str =
    "/apis/flatnetwork.pandaria.io/v1/namespaces/cattle-flat-network/flatnetworksubnets";

fn workload_lists() -> [(&'static str, &'static str); 6] {
    [
        ("/apis/apps/v1/deployments?", "DeploymentList"),
        ("/apis/apps/v1/statefulsets?", "StatefulSetList"),
        ("/apis/apps/v1/daemonsets?", "DaemonSetList"),
        ("/apis/apps/v1/replicasets?", "ReplicaSetList"),
        ("/apis/batch/v1/jobs?", "JobList"),
        ("/apis/batch/v1/cronjobs?", "CronJobList"),
    ]
}

/// Runs `command` while `script` plays the API server; checks the script
/// saw every request and no other.
async fn with_server<S, F, C, T>(script: S, command: C) -> T
where
    S: FnOnce(ApiServerVerifier) -> F + Send + 'static,
    F: Future<Output = ApiServerVerifier> + Send + 'static,
    C: AsyncFnOnce(kube::Client) -> T,
{
    let (client, verifier) = mock_client();
    let server = tokio::spawn(async move { script(verifier).await.expect_no_more().await });
    let result = command(client).await;
    if let Err(join) = server.await {
        std::panic::resume_unwind(join.into_panic());
    }
    result
}

/// The listings `migrate` makes, answered with one V1 subnet, one V1
/// Deployment and one V1 Service.
async fn answer_migrate_listings(api: &mut ApiServerVerifier, subnet: Value) {
    api.expect(
        "GET",
        V1_SUBNETS,
        ok(list(
            "MacvlanSubnetList",
            "macvlan.cluster.cattle.io/v1",
            vec![subnet],
        )),
    )
    .await;
    let v1_ip = json!({"apiVersion": "macvlan.cluster.cattle.io/v1", "kind": "MacvlanIP",
        "metadata": {"name": "web-0", "namespace": "shop"},
        "spec": {"subnet": "vlan10", "ip": "auto", "mac": "", "podId": "p"},
        "status": {"phase": "Active", "ip": "10.10.0.101/24", "mac": ""}});
    let pending = json!({"apiVersion": "macvlan.cluster.cattle.io/v1", "kind": "MacvlanIP",
        "metadata": {"name": "web-1", "namespace": "shop"},
        "spec": {"subnet": "vlan10", "ip": "auto", "mac": "", "podId": "q"}});
    api.expect(
        "GET",
        "/apis/macvlan.cluster.cattle.io/v1/macvlanips?",
        ok(list(
            "MacvlanIPList",
            "macvlan.cluster.cattle.io/v1",
            vec![v1_ip, pending],
        )),
    )
    .await;
    for (uri, kind) in workload_lists() {
        let items = if kind == "DeploymentList" {
            vec![workload(&kinds::DEPLOYMENT, "web", v1_template())]
        } else {
            vec![]
        };
        api.expect("GET", uri, ok(list(kind, "apps/v1", items)))
            .await;
    }
    api.expect(
        "GET",
        "/api/v1/services?",
        ok(list(
            "ServiceList",
            "v1",
            vec![serde_json::to_value(v1_service()).unwrap()],
        )),
    )
    .await;
}

fn options(dry_run: bool, accept_losses: bool) -> Options {
    Options {
        attachment: NAD.into(),
        workloads: kinds::WORKLOADS.to_vec(),
        services: true,
        accept_losses,
        dry_run,
    }
}

#[tokio::test]
async fn migrate_dry_run_reads_and_writes_nothing() {
    let result = with_server(
        |mut api| async move {
            answer_migrate_listings(&mut api, v1_subnet_json()).await;
            api.expect("GET", &format!("{V2_SUBNET}/vlan10"), not_found())
                .await;
            api.expect(
                "GET",
                "/api/v1/namespaces/shop/services/web-flat-network",
                not_found(),
            )
            .await;
            api
        },
        async |client| migration::migrate(&client, &options(true, false)).await,
    )
    .await;
    result.expect("a dry run reports losses without failing");
}

#[tokio::test]
async fn migrate_refuses_losses_before_writing_anything() {
    let err = with_server(
        |mut api| async move {
            answer_migrate_listings(&mut api, v1_subnet_json()).await;
            api
        },
        async |client| migration::migrate(&client, &options(false, false)).await,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, super::MigrateError::Losses(3)), "{err}");
}

#[tokio::test]
async fn migrate_creates_the_subnet_patches_the_workload_and_creates_the_service() {
    with_server(
        |mut api| async move {
            answer_migrate_listings(&mut api, v1_subnet_json()).await;
            api.expect("GET", &format!("{V2_SUBNET}/vlan10"), not_found()).await;
            let created = api
                .expect("POST", &format!("{V2_SUBNET}?"), |body| (http::StatusCode::CREATED, body.clone()))
                .await;
            assert_eq!(created.body["kind"], "FlatNetworkSubnet");
            assert_eq!(created.body["spec"]["master"], "eth0");
            assert_eq!(created.body["spec"]["ranges"][0], json!({"from": "10.10.0.100", "to": "10.10.0.150"}));
            // Before the workload rolls: the V1 pod's address is reserved.
            let stored = created.body.clone();
            let reserved = api
                .expect("PATCH", &format!("{V2_SUBNET}/vlan10/status?"), move |_| (http::StatusCode::OK, stored.clone()))
                .await;
            assert_eq!(
                reserved.body,
                json!({"status": {"reservedIP": {"MacvlanIP/shop/web-0": [{"from": "10.10.0.101", "to": "10.10.0.101"}]}}})
            );
            let patched = api
                .expect("PATCH", "/apis/apps/v1/namespaces/shop/deployments/web?", |body| {
                    (http::StatusCode::OK, workload(&kinds::DEPLOYMENT, "web", body["spec"]["template"]["metadata"]["annotations"].clone()))
                })
                .await;
            assert_eq!(
                patched.body["spec"]["template"]["metadata"]["annotations"],
                json!({
                    "flatnetwork.pandaria.io/ip": "auto", "flatnetwork.pandaria.io/subnet": "vlan10",
                    "macvlan.pandaria.cattle.io/ip": null, "macvlan.pandaria.cattle.io/subnet": null
                })
            );
            api.expect("GET", "/api/v1/namespaces/shop/services/web-flat-network", not_found()).await;
            let svc = api
                .expect("POST", "/api/v1/namespaces/shop/services?", |body| (http::StatusCode::CREATED, body.clone()))
                .await;
            assert_eq!(svc.body["metadata"]["name"], "web-flat-network");
            api
        },
        async |client| migration::migrate(&client, &options(false, true)).await,
    )
    .await
    .expect("migration succeeds with --accept-losses");
}

#[tokio::test]
async fn clean_refuses_while_v1_pods_remain_and_deletes_nothing() {
    let err = with_server(
        |mut api| async move {
            let ip = json!({"apiVersion": "macvlan.cluster.cattle.io/v1", "kind": "MacvlanIP",
                            "metadata": {"name": "web-0", "namespace": "shop"}, "spec": {"subnet": "vlan10", "ip": "auto", "mac": "", "podId": "p"}});
            api.expect("GET", "/apis/macvlan.cluster.cattle.io/v1/macvlanips?", ok(list("MacvlanIPList", "macvlan.cluster.cattle.io/v1", vec![ip]))).await;
            api.expect("GET", V1_SUBNETS, ok(list("MacvlanSubnetList", "macvlan.cluster.cattle.io/v1", vec![]))).await;
            for (uri, kind) in workload_lists() {
                api.expect("GET", uri, ok(list(kind, "apps/v1", vec![]))).await;
            }
            api
        },
        async |client| migration::clean(&client, false).await,
    )
    .await
    .unwrap_err();
    assert!(matches!(err, super::MigrateError::NotVerified(1)), "{err}");
}

#[tokio::test]
async fn backup_writes_complete_objects_with_their_type() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("backup");
    let count = with_server(
        |mut api| async move {
            for crd in [
                "macvlansubnets.macvlan.cluster.cattle.io",
                "macvlanips.macvlan.cluster.cattle.io",
                "flatnetworksubnets.flatnetwork.pandaria.io",
                "flatnetworkips.flatnetwork.pandaria.io",
            ] {
                api.expect(
                    "GET",
                    &format!("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd}"),
                    not_found(),
                )
                .await;
            }
            api.expect("GET", "/api/v1/namespaces/cattle-flat-network", not_found())
                .await;
            // List items come without apiVersion/kind, as the API server sends them.
            let mut item = v1_subnet_json();
            item.as_object_mut().unwrap().remove("kind");
            item.as_object_mut().unwrap().remove("apiVersion");
            api.expect(
                "GET",
                V1_SUBNETS,
                ok(list(
                    "MacvlanSubnetList",
                    "macvlan.cluster.cattle.io/v1",
                    vec![item],
                )),
            )
            .await;
            api.expect(
                "GET",
                "/apis/macvlan.cluster.cattle.io/v1/macvlanips?",
                not_found(),
            )
            .await;
            api.expect(
                "GET",
                "/apis/flatnetwork.pandaria.io/v1/flatnetworksubnets?",
                ok(list(
                    "FlatNetworkSubnetList",
                    "flatnetwork.pandaria.io/v1",
                    vec![],
                )),
            )
            .await;
            api.expect(
                "GET",
                "/api/v1/services?",
                ok(list(
                    "ServiceList",
                    "v1",
                    vec![serde_json::to_value(v1_service()).unwrap()],
                )),
            )
            .await;
            for (uri, kind) in workload_lists() {
                let items = if kind == "DeploymentList" {
                    vec![
                        workload(&kinds::DEPLOYMENT, "web", v1_template()),
                        workload(&kinds::DEPLOYMENT, "plain", json!({})),
                    ]
                } else {
                    vec![]
                };
                api.expect("GET", uri, ok(list(kind, "apps/v1", items)))
                    .await;
            }
            api
        },
        async |client| backup::backup(&client, &out, false).await,
    )
    .await
    .unwrap();
    assert_eq!(
        count, 3,
        "the V1 subnet, the V1 service and the V1 deployment"
    );
    let saved: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("macvlansubnet/kube-system.vlan10.json")).unwrap(),
    )
    .unwrap();
    let mut expected = v1_subnet_json();
    let metadata = expected["metadata"].as_object_mut().unwrap();
    metadata.remove("uid");
    metadata.remove("resourceVersion");
    assert_eq!(
        saved, expected,
        "every field and the type are kept, server fields are not"
    );
    assert!(out.join("service/shop.web-macvlan.json").exists());
    assert!(out.join("deployment/shop.web.json").exists());
    assert!(!out.join("deployment/shop.plain.json").exists());

    let again = with_server(
        |api| async move { api },
        async |client| backup::backup(&client, &out, false).await,
    )
    .await;
    assert!(
        matches!(again, Err(super::MigrateError::BackupExists(_))),
        "an existing backup is never overwritten"
    );
}

/// What `migrate` reserved for V1 pods is never handed to a rolled pod:
/// the allocation controllers against the fake API server.
#[tokio::test]
async fn addresses_reserved_for_v1_pods_are_never_allocated() {
    use crate::allocation::{
        Settings,
        fake_api::FakeApiServer,
        fake_cluster::{FakeCluster, subnet},
    };
    let server = FakeApiServer::new();
    let mut lan = subnet(
        "vlan10",
        "10.10.0.0/24",
        None,
        &[("10.10.0.100", "10.10.0.104")],
    );
    lan.status = Some(flatnet_k8s::api::FlatNetworkSubnetStatus {
        reserved_ip: BTreeMap::from([
            (
                "MacvlanIP/shop/web-0".to_owned(),
                vec![flatnet_k8s::api::IpRange::new(
                    "10.10.0.100".parse().unwrap(),
                    "10.10.0.101".parse().unwrap(),
                )],
            ),
            // A workload's reservation keeps other pods away too.
            (
                "Deployment/shop/other".to_owned(),
                vec![flatnet_k8s::api::IpRange::new(
                    "10.10.0.102".parse().unwrap(),
                    "10.10.0.102".parse().unwrap(),
                )],
            ),
        ]),
        ..Default::default()
    });
    server.insert(&lan);
    let cluster = FakeCluster::start(server, Settings::default(), 2);
    cluster
        .wait_active("vlan10", Duration::from_secs(10))
        .await
        .unwrap();
    cluster.create_pod("rolled-0", "vlan10");
    cluster.create_pod("rolled-1", "vlan10");
    let view = cluster
        .settle("vlan10", Duration::from_secs(15))
        .await
        .unwrap();
    let mut given: Vec<String> = view.addressed.values().map(ToString::to_string).collect();
    given.sort();
    assert_eq!(given, ["10.10.0.103", "10.10.0.104"]);
    cluster.stop().await;
}

#[test]
fn v1_addresses_become_reservations_and_bad_ones_are_reported() {
    let ip = |name: &str, subnet: &str, addr: &str| -> super::v1::MacvlanIP {
        serde_json::from_value(json!({
            "apiVersion": "macvlan.cluster.cattle.io/v1", "kind": "MacvlanIP",
            "metadata": {"name": name, "namespace": "shop"},
            "spec": {"subnet": subnet, "ip": "auto", "mac": "", "podId": "p"},
            "status": {"phase": "Active", "ip": addr, "mac": ""}
        }))
        .unwrap()
    };
    let mut issues = Vec::new();
    let held = convert::v1_reservations(
        &[
            ip("a", "vlan10", "10.10.0.5/24"),
            ip("b", "vlan10", "10.10.0.6"),
            ip("c", "vlan20", "fd00::7/64"),
            ip("d", "vlan10", ""),
            ip("e", "vlan10", "10.10.0.999"),
        ],
        &mut issues,
    );
    let keys = |subnet: &str| held[subnet].keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys("vlan10"), ["MacvlanIP/shop/a", "MacvlanIP/shop/b"]);
    assert_eq!(keys("vlan20"), ["MacvlanIP/shop/c"]);
    assert_eq!(issues.len(), 1, "{issues:?}");
    assert_eq!(issues[0].object, "MacvlanIP shop/e");
    assert_eq!(issues[0].field, "status.ip");
}
