//! The committed CRD chart must match the Rust API types.

use flatnet_k8s::{api, crd_yaml};
use kube::CustomResourceExt;

#[test]
fn committed_crds_match_the_api_types() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../charts/flatnet-crd/templates/crds.yaml"
    );
    let committed = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    assert!(
        committed == crd_yaml(),
        "{path} is out of date: run `cargo xtask crds` and commit the result"
    );
}

#[test]
fn crds_have_the_original_names_and_keep_policy() {
    let subnet = api::FlatNetworkSubnet::crd();
    let ip = api::FlatNetworkIP::crd();
    assert_eq!(
        subnet.metadata.name.as_deref(),
        Some("flatnetworksubnets.flatnetwork.pandaria.io")
    );
    assert_eq!(
        ip.metadata.name.as_deref(),
        Some("flatnetworkips.flatnetwork.pandaria.io")
    );
    assert_eq!(
        subnet.spec.names.short_names.as_deref(),
        Some(
            &[
                "flatnetworksubnet".to_owned(),
                "flsubnet".into(),
                "flsubnets".into()
            ][..]
        )
    );
    assert_eq!(
        ip.spec.names.short_names.as_deref(),
        Some(&["flatnetworkip".to_owned(), "flip".into(), "flips".into()][..])
    );
    for crd in [&subnet, &ip] {
        assert_eq!(crd.spec.scope, "Namespaced");
        let keep = crd
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("helm.sh/resource-policy"));
        assert_eq!(keep.map(String::as_str), Some("keep"));
        let version = &crd.spec.versions[0];
        assert!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some()
        );
    }
}

/// Looks up `spec.versions[0].schema` at a path of property names.
fn schema_at(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    path: &[&str],
) -> serde_json::Value {
    let schema = crd.spec.versions[0]
        .schema
        .as_ref()
        .unwrap()
        .open_api_v3_schema
        .as_ref()
        .unwrap();
    let mut value = serde_json::to_value(schema).unwrap();
    for name in path {
        value = value["properties"][name].clone();
    }
    value
}

/// The names of the printer columns of `spec.versions[0]`.
fn printer_columns(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> Vec<String> {
    crd.spec.versions[0]
        .additional_printer_columns
        .iter()
        .flatten()
        .map(|c| c.name.clone())
        .collect()
}

#[test]
fn schema_validates_what_the_original_did_not() {
    let crd = api::FlatNetworkSubnet::crd();
    assert_eq!(
        schema_at(&crd, &["spec", "flatMode"])["enum"],
        serde_json::json!(["macvlan", "ipvlan"])
    );
    assert_eq!(schema_at(&crd, &["spec", "vlan"])["maximum"], 4094.0);
    assert_eq!(schema_at(&crd, &["spec", "vlan"])["minimum"], 0.0);
    assert_eq!(schema_at(&crd, &["spec", "mtu"])["minimum"], 68.0);
    assert_eq!(schema_at(&crd, &["spec", "mtu"])["maximum"], 65535.0);
    assert_eq!(
        schema_at(&crd, &["spec"])["required"],
        serde_json::json!(["cidr", "flatMode", "master"])
    );
    let conditions = schema_at(&crd, &["status", "conditions"]);
    assert_eq!(conditions["x-kubernetes-list-type"], "map");
    let columns = printer_columns(&crd);
    assert_eq!(
        columns,
        [
            "FlatMode",
            "Mode",
            "CIDR",
            "Master",
            "VLAN",
            "MTU",
            "Used",
            "Total",
            "WireExcluded",
            "Phase",
            "Age"
        ]
    );
    // A default that fails its own field's schema makes the API server
    // reject the CRD; none is emitted.
    assert!(!crd_yaml().contains("default:"));
}

#[test]
fn pod_network_config_is_namespaced_with_printer_columns_and_bounds() {
    let crd = api::PodNetworkConfig::crd();
    assert_eq!(crd.spec.scope, "Namespaced");
    assert_eq!(crd.spec.names.kind, "PodNetworkConfig");
    assert_eq!(crd.spec.names.short_names, Some(vec!["pnc".to_owned()]));
    let columns = printer_columns(&crd);
    assert_eq!(columns, ["Matched", "Applied", "Failed", "Age"]);
    assert!(
        crd.spec.versions[0]
            .subresources
            .as_ref()
            .unwrap()
            .status
            .is_some()
    );
    assert_eq!(
        schema_at(&crd, &["spec", "primary", "mtu"])["minimum"],
        68.0
    );
    assert_eq!(
        schema_at(&crd, &["spec", "primary", "tcpMssClamp"])["type"],
        "boolean"
    );
    let attachments = schema_at(&crd, &["spec", "attachments"]);
    assert_eq!(
        attachments["items"]["required"],
        serde_json::json!(["interface", "subnet"])
    );
    assert_eq!(
        schema_at(&crd, &["spec", "vlans"])["items"]["properties"]["id"]["maximum"],
        4094.0
    );
    let subnet = api::FlatNetworkSubnet::crd();
    assert!(schema_at(&subnet, &["spec", "namespaceSelector"]).is_object());
    assert!(crd_yaml().contains("kind: PodNetworkConfig"));
}

#[test]
fn floating_ip_crds_are_cluster_scoped_with_usage_columns() {
    let pool = api::FloatingIPPool::crd();
    let quota = api::FloatingIPProjectQuota::crd();
    assert_eq!(
        pool.metadata.name.as_deref(),
        Some("floatingippools.flatnetwork.pandaria.io")
    );
    assert_eq!(
        quota.metadata.name.as_deref(),
        Some("floatingipprojectquotas.flatnetwork.pandaria.io")
    );
    for crd in [&pool, &quota] {
        assert_eq!(crd.spec.scope, "Cluster");
        let version = &crd.spec.versions[0];
        assert!(
            version
                .subresources
                .as_ref()
                .and_then(|s| s.status.as_ref())
                .is_some()
        );
    }
    let columns: Vec<&str> = pool.spec.versions[0]
        .additional_printer_columns
        .iter()
        .flatten()
        .map(|c| c.json_path.as_str())
        .collect();
    for path in [
        ".spec.cidrs",
        ".spec.targetNetworkInterface",
        ".status.usedIPCount",
        ".status.totalIPCount",
    ] {
        assert!(columns.contains(&path), "{path} missing from {columns:?}");
    }
}
