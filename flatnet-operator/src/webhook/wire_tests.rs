//! The admission warning for a subnet or range that covers addresses the
//! node agents saw live on the LAN, against the fake API server.

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
    let kind =
        json!({"group": "flatnetwork.pandaria.io", "version": "v1", "kind": "FlatNetworkSubnet"});
    let resource = json!({"group": "flatnetwork.pandaria.io", "version": "v1", "resource": "flatnetworksubnets"});
    let review: AdmissionReview<DynamicObject> = serde_json::from_value(json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "u", "kind": kind, "resource": resource,
            "requestKind": kind, "requestResource": resource,
            "name": "lan", "namespace": SUBNET_NAMESPACE,
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
