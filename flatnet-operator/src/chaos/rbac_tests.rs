//! The operator's RBAC in the chart against what its code asks for: every
//! kind of request the replicas of a chaos run send to the fake API server
//! (allocation controllers and leader election) must be granted by the
//! rendered chart, and every grant must be used by such a run or be listed
//! in [`NOT_EXERCISED`] with the code that needs it.
//!
//! The chart is read as `cargo xtask charts` renders it (with its default
//! values) to `target/images/chart-default-render.json`.

use std::{collections::BTreeSet, path::Path};

use serde_json::Value;

use super::{Options, drive};
use crate::allocation::fake_api::{Access, faults::FaultRates};

/// Grants a chaos run may not exercise, each with the code that needs it:
/// (API group, resource, verb, who). Some of the allocation's own entries
/// are used by some runs and not others (they depend on timing).
const NOT_EXERCISED: &[(&str, &str, &str, &str)] = &[
    ("", "services", "get", "flat_services"),
    ("", "services", "list", "flat_services"),
    ("", "services", "watch", "flat_services"),
    ("", "services", "create", "flat_services"),
    ("", "services", "patch", "flat_services"),
    ("", "services", "delete", "flat_services"),
    ("discovery.k8s.io", "endpointslices", "get", "flat_services"),
    (
        "discovery.k8s.io",
        "endpointslices",
        "list",
        "flat_services",
    ),
    (
        "discovery.k8s.io",
        "endpointslices",
        "watch",
        "flat_services",
    ),
    (
        "discovery.k8s.io",
        "endpointslices",
        "create",
        "flat_services",
    ),
    (
        "discovery.k8s.io",
        "endpointslices",
        "patch",
        "flat_services",
    ),
    (
        "discovery.k8s.io",
        "endpointslices",
        "delete",
        "flat_services",
    ),
    (
        "k8s.cni.cncf.io",
        "network-attachment-definitions",
        "get",
        "nad",
    ),
    (
        "k8s.cni.cncf.io",
        "network-attachment-definitions",
        "list",
        "nad",
    ),
    (
        "k8s.cni.cncf.io",
        "network-attachment-definitions",
        "watch",
        "nad",
    ),
    (
        "k8s.cni.cncf.io",
        "network-attachment-definitions",
        "create",
        "nad",
    ),
    (
        "k8s.cni.cncf.io",
        "network-attachment-definitions",
        "patch",
        "nad",
    ),
    ("", "namespaces", "get", "nad, webhook"),
    ("apps", "deployments", "get", "webhook"),
    ("apps", "deployments", "list", "webhook"),
    ("apps", "deployments", "watch", "webhook"),
    ("apps", "daemonsets", "get", "webhook"),
    ("apps", "daemonsets", "list", "webhook"),
    ("apps", "daemonsets", "watch", "webhook"),
    ("apps", "statefulsets", "get", "webhook"),
    ("apps", "statefulsets", "list", "webhook"),
    ("apps", "statefulsets", "watch", "webhook"),
    ("apps", "replicasets", "get", "webhook"),
    ("apps", "replicasets", "list", "webhook"),
    ("apps", "replicasets", "watch", "webhook"),
    ("batch", "jobs", "get", "webhook"),
    ("batch", "jobs", "list", "webhook"),
    ("batch", "jobs", "watch", "webhook"),
    ("batch", "cronjobs", "get", "webhook"),
    ("batch", "cronjobs", "list", "webhook"),
    ("batch", "cronjobs", "watch", "webhook"),
    (
        "apps",
        "deployments",
        "patch",
        "workloads: flat-network labels and status.reservedIP",
    ),
    (
        "apps",
        "daemonsets",
        "patch",
        "workloads: flat-network labels and status.reservedIP",
    ),
    (
        "apps",
        "statefulsets",
        "patch",
        "workloads: flat-network labels and status.reservedIP",
    ),
    (
        "batch",
        "jobs",
        "patch",
        "workloads: flat-network labels and status.reservedIP",
    ),
    (
        "batch",
        "cronjobs",
        "patch",
        "workloads: flat-network labels and status.reservedIP",
    ),
    ("", "endpoints", "create", "flat_services::legacy_endpoints"),
    ("", "endpoints", "patch", "flat_services::legacy_endpoints"),
    ("", "pods", "get", "webhook, flat_services"),
    (
        "",
        "pods",
        "patch",
        "allocation::pods: labels of a pod its node set up (no agent here)",
    ),
    (
        "",
        "events",
        "patch",
        "kube's event recorder: a repeated event",
    ),
    ("events.k8s.io", "events", "patch", "kube's event recorder"),
    (
        "events.k8s.io",
        "events",
        "create",
        "kube's event recorder (events.k8s.io where served)",
    ),
    (
        "admissionregistration.k8s.io",
        "validatingwebhookconfigurations",
        "get",
        "tls::manage",
    ),
    (
        "admissionregistration.k8s.io",
        "validatingwebhookconfigurations",
        "patch",
        "tls::manage",
    ),
    (
        "admissionregistration.k8s.io",
        "validatingwebhookconfigurations",
        "update",
        "tls::manage",
    ),
    ("", "secrets", "create", "tls::manage"),
    ("", "secrets", "get", "tls::follow"),
    ("", "secrets", "patch", "tls::manage"),
    ("", "secrets", "update", "tls::manage"),
    (
        "flatnetwork.pandaria.io",
        "flatnetworksubnets",
        "create",
        "migrate",
    ),
    (
        "flatnetwork.pandaria.io",
        "flatnetworksubnets",
        "update",
        "migrate",
    ),
    (
        "flatnetwork.pandaria.io",
        "flatnetworksubnets",
        "delete",
        "migrate",
    ),
    (
        "flatnetwork.pandaria.io",
        "flatnetworkips",
        "delete",
        "allocation::ips: records of vanished pods (after a minute)",
    ),
    (
        "flatnetwork.pandaria.io",
        "flatnetworkips",
        "get",
        "allocation::commit: a record read again after a conflict",
    ),
    (
        "flatnetwork.pandaria.io",
        "flatnetworkips",
        "patch",
        "allocation::ips: finalizers of deleted records",
    ),
    (
        "flatnetwork.pandaria.io",
        "flatnetworkips/status",
        "get",
        "kube's replace_status reads nothing; granted with update",
    ),
    (
        "flatnetwork.pandaria.io",
        "flatnetworkips/status",
        "patch",
        "migrate",
    ),
    (
        "flatnetwork.pandaria.io",
        "flatnetworksubnets/status",
        "get",
        "granted with update",
    ),
    (
        "flatnetwork.pandaria.io",
        "flatnetworksubnets/status",
        "patch",
        "migrate",
    ),
    // Nor does the PodNetworkConfig controller; its requests are those of
    // `runtime_config::controller::tests` against the same fake.
    (
        "flatnetwork.pandaria.io",
        "podnetworkconfigs",
        "list",
        "runtime_config::controller",
    ),
    (
        "flatnetwork.pandaria.io",
        "podnetworkconfigs",
        "watch",
        "runtime_config::controller",
    ),
    (
        "flatnetwork.pandaria.io",
        "podnetworkconfigs/status",
        "patch",
        "runtime_config::controller",
    ),
    // The floating-address controllers do not run in a chaos run; their
    // requests are those of `floating::tests` against the same fake.
    (
        "",
        "services",
        "update",
        "floating::services: the finalizer",
    ),
    (
        "",
        "services/status",
        "update",
        "floating::services: status.loadBalancer.ingress",
    ),
    (
        "flatnetwork.pandaria.io",
        "floatingippools",
        "get",
        "floating::ledger",
    ),
    (
        "flatnetwork.pandaria.io",
        "floatingippools",
        "list",
        "floating::run",
    ),
    (
        "flatnetwork.pandaria.io",
        "floatingippools",
        "watch",
        "floating::run",
    ),
    (
        "flatnetwork.pandaria.io",
        "floatingippools/status",
        "update",
        "floating::ledger, floating::pools",
    ),
    (
        "flatnetwork.pandaria.io",
        "floatingipprojectquotas",
        "list",
        "floating::run",
    ),
    (
        "flatnetwork.pandaria.io",
        "floatingipprojectquotas",
        "watch",
        "floating::run",
    ),
    (
        "flatnetwork.pandaria.io",
        "floatingipprojectquotas/status",
        "update",
        "floating::quotas",
    ),
];

/// One rule line: group, resource (`plural/sub`), verb, and whether it is
/// granted in every namespace (a ClusterRole) or in one (a Role).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Clone)]
struct Grant {
    group: String,
    resource: String,
    verb: String,
    cluster: bool,
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

/// The operator's grants in the rendered chart.
fn operator_grants() -> BTreeSet<Grant> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/images/chart-default-render.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}; `cargo xtask charts` renders it", path.display()));
    let objects: Vec<Value> = serde_json::from_str(&text).expect("the render is a JSON list");
    let mut grants = BTreeSet::new();
    for object in objects {
        let kind = object["kind"].as_str().unwrap_or_default();
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        if !matches!(kind, "Role" | "ClusterRole") || name != "flatnet-operator" {
            continue;
        }
        for rule in object["rules"].as_array().into_iter().flatten() {
            for group in strings(&rule["apiGroups"]) {
                for resource in strings(&rule["resources"]) {
                    for verb in strings(&rule["verbs"]) {
                        grants.insert(Grant {
                            group: group.clone(),
                            resource: resource.clone(),
                            verb,
                            cluster: kind == "ClusterRole",
                        });
                    }
                }
            }
        }
    }
    assert!(!grants.is_empty(), "no flatnet-operator role in the render");
    grants
}

fn resource_of(access: &Access) -> String {
    match &access.subresource {
        Some(sub) => format!("{}/{sub}", access.resource),
        None => access.resource.clone(),
    }
}

fn grants_access(grant: &Grant, access: &Access) -> bool {
    grant.group == access.group
        && grant.resource == resource_of(access)
        && grant.verb == access.verb
        && (grant.cluster || access.namespaced)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_grants_what_the_operator_asks_for_and_nothing_more() {
    let grants = operator_grants();
    let mut options = Options::new(0x5bac, 300);
    options.rates = FaultRates::none();
    options.quiet_every = 300;
    options.keep_going = true;
    options.settle = std::time::Duration::from_secs(10);
    // The invariants are the chaos run's business; here only the requests
    // count.
    let (report, _) = drive(&options).await;
    assert!(
        report.ops.values().sum::<u64>() > 200,
        "the run did its operations"
    );

    let missing: Vec<&Access> = report
        .accesses
        .iter()
        .filter(|a| !grants.iter().any(|g| grants_access(g, a)))
        .collect();
    assert!(
        missing.is_empty(),
        "the operator sends requests its RBAC does not grant: {missing:#?}"
    );

    let unused: Vec<&Grant> = grants
        .iter()
        .filter(|g| !report.accesses.iter().any(|a| grants_access(g, a)))
        .filter(|g| {
            !NOT_EXERCISED.iter().any(|(group, resource, verb, _)| {
                g.group == *group && g.resource == *resource && g.verb == *verb
            })
        })
        .collect();
    assert!(
        unused.is_empty(),
        "granted, never used, and not listed in NOT_EXERCISED: {unused:?}"
    );
}
