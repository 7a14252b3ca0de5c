//! Reviews of pools, quotas and LoadBalancer Services against the fake API
//! server holding a small cluster.

use std::sync::Arc;

use flatnet_k8s::{
    api::{FloatingIPPool, FloatingIPProjectQuota},
    floating::LOAD_BALANCER_CLASS,
};
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::core::{
    DynamicObject,
    admission::{AdmissionRequest, AdmissionReview},
};
use serde_json::{Value, json};

use crate::{allocation::fake_api::FakeApiServer, metrics::Metrics, webhook::Validator};

fn pool(name: &str, cidr: &str) -> Value {
    json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPPool",
        "metadata": {"name": name},
        "spec": {"cidrs": [cidr], "targetNetworkInterface": "eth0"},
    })
}

fn service(name: &str, ingress: Option<&str>) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": {"type": "LoadBalancer", "loadBalancerClass": LOAD_BALANCER_CLASS,
                 "ports": [{"port": 80, "protocol": "TCP"}]},
        "status": {"loadBalancer": {"ingress": ingress.map(|ip| vec![json!({"ip": ip})])}},
    })
}

/// Pool `lan` (192.168.10.0/24), Service `web` holding .5 in project
/// p-shop, and quota `shop-quota` allowing it one address of `lan`.
fn cluster() -> FakeApiServer {
    let server = FakeApiServer::new();
    server
        .insert(&serde_json::from_value::<FloatingIPPool>(pool("lan", "192.168.10.0/24")).unwrap());
    server.insert(&serde_json::from_value::<Namespace>(json!({"apiVersion": "v1", "kind": "Namespace",
                  "metadata": {"name": "shop", "labels": {"field.cattle.io/projectId": "c-1:p-shop"}}})).unwrap());
    server
        .insert(&serde_json::from_value::<Service>(service("web", Some("192.168.10.5"))).unwrap());
    server.insert(
        &serde_json::from_value::<FloatingIPProjectQuota>(json!({
            "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPProjectQuota",
            "metadata": {"name": "shop-quota"},
            "spec": {"project": "p-shop", "limits": {"lan": 1}},
        }))
        .unwrap(),
    );
    server
}

/// The verdict on `operation` of `object`: `None` when allowed, else the
/// message.
async fn verdict(server: &FakeApiServer, operation: &str, object: &Value) -> Option<String> {
    let kind = object["kind"].as_str().unwrap();
    let api_version = object["apiVersion"].as_str().unwrap();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let resource = format!("{}s", kind.to_lowercase());
    let review: AdmissionReview<DynamicObject> = serde_json::from_value(json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": "1",
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "name": object["metadata"]["name"],
            "namespace": object["metadata"]["namespace"],
            "operation": operation,
            "userInfo": {"username": "alice"},
            "object": if operation == "DELETE" { Value::Null } else { object.clone() },
            "oldObject": if operation == "DELETE" { object.clone() } else { Value::Null },
            "dryRun": false,
        }
    }))
    .unwrap();
    let request: AdmissionRequest<DynamicObject> = review.try_into().unwrap();
    let validator = Validator::new(server.client(), Arc::new(Metrics::new()));
    let response = validator.review(&request).await;
    (!response.allowed).then_some(response.result.message)
}

#[tokio::test]
async fn pools_are_valid_disjoint_and_kept_while_in_use() {
    let server = cluster();
    assert_eq!(
        verdict(&server, "CREATE", &pool("wan", "192.168.20.0/24")).await,
        None
    );
    let overlap = verdict(&server, "CREATE", &pool("wide", "192.168.0.0/16"))
        .await
        .unwrap();
    assert!(overlap.contains("FloatingIPPool lan"), "{overlap}");
    let invalid = verdict(&server, "CREATE", &pool("bad", "192.168.30.0/33"))
        .await
        .unwrap();
    assert!(invalid.contains("spec.cidrs"), "{invalid}");
    let in_use = verdict(&server, "DELETE", &pool("lan", "192.168.10.0/24"))
        .await
        .unwrap();
    assert!(in_use.contains("shop/web"), "{in_use}");
    assert_eq!(
        verdict(&server, "DELETE", &pool("wan", "192.168.20.0/24")).await,
        None
    );
}

#[tokio::test]
async fn a_service_over_quota_is_denied_naming_the_quota() {
    let server = cluster();
    let denial = verdict(&server, "CREATE", &service("api", None))
        .await
        .unwrap();
    assert!(
        denial.contains("FloatingIPProjectQuota shop-quota") && denial.contains("lan"),
        "{denial}"
    );
    // The Service already holding its address may be updated.
    assert_eq!(
        verdict(&server, "UPDATE", &service("web", Some("192.168.10.5"))).await,
        None
    );
    // A Service of another class is not ours to judge.
    let mut other = service("api", None);
    other["spec"]["loadBalancerClass"] = json!("metallb.io/metallb");
    assert_eq!(verdict(&server, "CREATE", &other).await, None);
    // A fixed address that is not one names the field.
    let mut bad = service("api", None);
    bad["spec"]["loadBalancerIP"] = json!("192.168.10.300");
    let denial = verdict(&server, "CREATE", &bad).await.unwrap();
    assert!(denial.contains("spec.loadBalancerIP"), "{denial}");
}

#[tokio::test]
async fn quotas_name_exactly_one_target() {
    let server = cluster();
    let both = json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPProjectQuota",
        "metadata": {"name": "q"},
        "spec": {"project": "p-1", "namespace": "shop", "limits": {}},
    });
    let denial = verdict(&server, "CREATE", &both).await.unwrap();
    assert!(
        denial.contains("exactly one of spec.project and spec.namespace"),
        "{denial}"
    );
}
