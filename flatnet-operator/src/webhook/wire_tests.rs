//! The admission warnings for a subnet or range that covers addresses the
//! node agents saw live on the LAN, and for a MAC pool range holding MACs
//! they saw there, against the fake API server.

use std::sync::Arc;

use flatnet_k8s::{
    api::{FlatNetworkWireClaims, FlatNetworkWireClaimsSpec, ForeignClaim},
    keys::SUBNET_NAMESPACE,
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::core::{
    DynamicObject,
    admission::{AdmissionRequest, AdmissionReview},
};
use serde_json::{Value, json};

use super::Validator;
use crate::{allocation::fake_api::FakeApiServer, metrics::Metrics};

fn subnet(range: (&str, &str)) -> Value {
    json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
        "metadata": {"name": "lan", "namespace": SUBNET_NAMESPACE},
        "spec": {"flatMode": "macvlan", "master": "eth0", "cidr": "192.0.2.0/24",
                 "ranges": [{"from": range.0, "to": range.1}]}
    })
}

fn request(object: &Value, old: Option<&Value>) -> AdmissionRequest<DynamicObject> {
    let kind = object["kind"].as_str().unwrap();
    let name = object["metadata"]["name"].as_str().unwrap();
    let namespace = object["metadata"]["namespace"].as_str();
    let kind = json!({"group": "flatnetwork.pandaria.io", "version": "v1", "kind": kind});
    let resource = json!({"group": "flatnetwork.pandaria.io", "version": "v1",
                          "resource": format!("{}s", kind["kind"].as_str().unwrap().to_lowercase())});
    let review: AdmissionReview<DynamicObject> = serde_json::from_value(json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "u", "kind": kind, "resource": resource,
            "requestKind": kind, "requestResource": resource,
            "name": name, "namespace": namespace,
            "operation": if old.is_some() { "UPDATE" } else { "CREATE" },
            "userInfo": {"username": "alice"},
            "object": object, "oldObject": old, "dryRun": false,
        }
    }))
    .unwrap();
    review.try_into().unwrap()
}

fn report(claims: &[(&str, &str, i64)]) -> FlatNetworkWireClaims {
    let now = Timestamp::now().as_second();
    let mut report = FlatNetworkWireClaims::new(
        "lan.node-1",
        FlatNetworkWireClaimsSpec {
            subnet: "lan".into(),
            node: "node-1".into(),
            observed_at: None,
            claims: claims
                .iter()
                .map(|(ip, mac, ago)| ForeignClaim {
                    ip: ip.parse().unwrap(),
                    mac: (*mac).into(),
                    last_seen: Time(Timestamp::from_second(now - ago).unwrap()),
                    kind: "arp_request".into(),
                })
                .collect(),
        },
    );
    report.metadata.namespace = Some(SUBNET_NAMESPACE.into());
    report
}

#[tokio::test]
async fn a_pool_covering_live_addresses_is_allowed_with_a_warning() {
    let server = FakeApiServer::new();
    server.insert(&report(&[
        ("192.0.2.20", "02:00:00:00:00:20", 60),
        ("192.0.2.40", "02:00:00:00:00:40", 60),
        // Beyond the window: not live.
        ("192.0.2.21", "02:00:00:00:00:21", 7200),
    ]));
    let validator = Validator::new(server.client(), Arc::new(Metrics::new()));

    let create = request(&subnet(("192.0.2.10", "192.0.2.30")), None);
    let response = validator.review(&create).await;
    assert!(response.allowed, "a warning, not a denial");
    let warnings = response.warnings.unwrap_or_default();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    for part in ["1 address(es)", "192.0.2.20", "02:00:00:00:00:20"] {
        assert!(
            warnings[0].contains(part),
            "{part} missing: {}",
            warnings[0]
        );
    }

    // Widening the range warns about what it adds only.
    let old = subnet(("192.0.2.10", "192.0.2.30"));
    let update = request(&subnet(("192.0.2.10", "192.0.2.50")), Some(&old));
    let warnings = validator.review(&update).await.warnings.unwrap_or_default();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("192.0.2.40"), "{}", warnings[0]);
    assert!(!warnings[0].contains("192.0.2.20"), "{}", warnings[0]);

    // A range with nothing live gets no warning.
    let quiet = request(&subnet(("192.0.2.100", "192.0.2.110")), None);
    assert_eq!(validator.review(&quiet).await.warnings, None);
}

fn cluster_config(range: Option<(&str, &str)>) -> Value {
    let pool = range.map_or(
        json!({}),
        |(start, end)| json!({"rangeStart": start, "rangeEnd": end}),
    );
    json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkConfig",
        "metadata": {"name": flatnet_k8s::api::CONFIG_NAME},
        "spec": {"macPool": pool}
    })
}

#[tokio::test]
async fn a_mac_range_holding_macs_seen_on_the_lan_is_allowed_with_a_warning() {
    let server = FakeApiServer::new();
    server.insert(&report(&[
        ("192.0.2.20", "02:aa:00:00:00:01", 60),
        ("192.0.2.21", "02:aa:00:00:00:02", 120),
        // Held by a pod of this cluster since the report was written.
        ("192.0.2.22", "02:aa:00:00:00:03", 60),
        // Beyond the window.
        ("192.0.2.23", "02:aa:00:00:00:04", 7200),
        // Outside the range.
        ("192.0.2.24", "02:bb:00:00:00:01", 60),
    ]));
    let held: flatnet_k8s::api::FlatNetworkIP = serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkIP",
        "metadata": {"name": "web-0", "namespace": "default"},
        "spec": {"subnet": "lan"},
        "status": {"addr": "192.0.2.22", "mac": "02:aa:00:00:00:03", "macFromPool": true}
    }))
    .unwrap();
    server.insert(&held);
    let validator = Validator::new(server.client(), Arc::new(Metrics::new()));

    let range = ("02:aa:00:00:00:00", "02:aa:00:ff:ff:ff");
    let create = request(&cluster_config(Some(range)), None);
    let response = validator.review(&create).await;
    assert!(response.allowed, "a warning, not a denial");
    let warnings = response.warnings.unwrap_or_default();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    for part in [
        "2 MAC(s)",
        "02:aa:00:00:00:01 (seen by node node-1 at",
        "02:aa:00:00:00:02",
        "another flatnet cluster",
        "choose another range",
    ] {
        assert!(
            warnings[0].contains(part),
            "{part} missing: {}",
            warnings[0]
        );
    }
    for absent in ["02:aa:00:00:00:03", "02:aa:00:00:00:04", "02:bb"] {
        assert!(!warnings[0].contains(absent), "{absent}: {}", warnings[0]);
    }

    // Moving to that range from a random one warns; an update that keeps
    // the range (another field changes) does not.
    let unset = cluster_config(None);
    let moved = request(&cluster_config(Some(range)), Some(&unset));
    assert_eq!(
        validator.review(&moved).await.warnings.map(|w| w.len()),
        Some(1)
    );
    let mut mtu = cluster_config(Some(range));
    mtu["spec"]["defaultMtu"] = json!(1400);
    let kept = request(&mtu, Some(&cluster_config(Some(range))));
    assert_eq!(validator.review(&kept).await.warnings, None);

    // A range nothing on the LAN uses gets no warning.
    let quiet = request(
        &cluster_config(Some(("02:cc:00:00:00:00", "02:cc:00:ff:ff:ff"))),
        None,
    );
    assert_eq!(validator.review(&quiet).await.warnings, None);
}
