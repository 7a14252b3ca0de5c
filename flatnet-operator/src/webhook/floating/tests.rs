//! Reviews of pools, quotas, LoadBalancer Services and pods' floating
//! requests against the fake API server holding a small cluster.

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
    let old = (operation == "DELETE").then(|| object.clone());
    verdict_on(server, operation, object, old).await
}

/// [`verdict`] of an update from `old`, or of a delete.
async fn verdict_on(
    server: &FakeApiServer,
    operation: &str,
    object: &Value,
    old: Option<Value>,
) -> Option<String> {
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
            "oldObject": old.unwrap_or(Value::Null),
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

fn floating_pod(name: &str, annotations: Value) -> Value {
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "shop", "annotations": annotations},
        "spec": {"containers": [{"name": "vnf", "image": "vnf"}]},
    })
}

#[tokio::test]
async fn pod_requests_name_a_missing_pool_an_address_outside_it_and_the_quota() {
    let server = cluster();
    let pool_key = "flatnetwork.pandaria.io/floating-ip-pool";
    let fixed_key = "flatnetwork.pandaria.io/floating-ip";
    let missing = verdict(
        &server,
        "CREATE",
        &floating_pod("vnf", json!({pool_key: "lab"})),
    )
    .await
    .unwrap();
    assert!(
        missing.contains("FloatingIPPool lab")
            && missing.contains("does not exist")
            && missing.contains("[lan]"),
        "{missing}"
    );
    let outside = verdict(
        &server,
        "CREATE",
        &floating_pod("vnf", json!({pool_key: "lan", fixed_key: "192.168.11.5"})),
    )
    .await
    .unwrap();
    assert!(
        outside.contains("192.168.11.5")
            && outside.contains("outside FloatingIPPool lan")
            && outside.contains("192.168.10.0-192.168.10.255"),
        "{outside}"
    );
    let garbage = verdict(
        &server,
        "CREATE",
        &floating_pod("vnf", json!({fixed_key: "192.168.10.300"})),
    )
    .await
    .unwrap();
    assert!(garbage.contains("192.168.10.300"), "{garbage}");
    // The project's one address is held by Service web.
    let over = verdict(
        &server,
        "CREATE",
        &floating_pod("vnf", json!({pool_key: "lan"})),
    )
    .await
    .unwrap();
    assert!(
        over.contains("pod vnf")
            && over.contains("FloatingIPProjectQuota shop-quota")
            && over.contains("flatnetwork.pandaria.io/floating-ip-set"),
        "{over}"
    );
    // A pool that does not serve the namespace.
    let mut narrow = pool("narrow", "192.168.40.0/24");
    narrow["spec"]["namespaceSelector"] = json!({"matchLabels": {"team": "net"}});
    server.insert(&serde_json::from_value::<FloatingIPPool>(narrow).unwrap());
    let not_serving = verdict(
        &server,
        "CREATE",
        &floating_pod("vnf", json!({pool_key: "narrow"})),
    )
    .await
    .unwrap();
    assert!(
        not_serving.contains("does not serve namespace shop"),
        "{not_serving}"
    );
}

#[tokio::test]
async fn a_pod_joining_a_set_that_holds_an_address_and_unchanged_requests_pass() {
    let server = cluster();
    let pool_key = "flatnetwork.pandaria.io/floating-ip-pool";
    let set_key = "flatnetwork.pandaria.io/floating-ip-set";
    // Raise the quota to 2; an active pod of set `pair` holds .6.
    server.insert(
        &serde_json::from_value::<FloatingIPProjectQuota>(json!({
            "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPProjectQuota",
            "metadata": {"name": "shop-quota"},
            "spec": {"project": "p-shop", "limits": {"lan": 2}},
        }))
        .unwrap(),
    );
    let mut active = floating_pod(
        "vnf-0",
        json!({pool_key: "lan", set_key: "pair",
               "flatnetwork.pandaria.io/floating-ip-assigned": "192.168.10.6"}),
    );
    active["metadata"]["labels"] = json!({"flatnetwork.pandaria.io/floating-ip-assigned": "true"});
    server.insert(&serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(active).unwrap());
    // Quota full (web and the set); the standby shares the set's address.
    let standby = floating_pod("vnf-1", json!({pool_key: "lan", set_key: "pair"}));
    assert_eq!(verdict(&server, "CREATE", &standby).await, None);
    let loner = floating_pod("vnf-2", json!({pool_key: "lan"}));
    assert!(verdict(&server, "CREATE", &loner).await.is_some());
    // An update leaving the request as it was (the operator's own write,
    // a relabel) passes even over quota.
    let mut relabelled = loner.clone();
    relabelled["metadata"]["labels"] = json!({"tier": "x"});
    assert_eq!(
        verdict_on(&server, "UPDATE", &relabelled, Some(loner)).await,
        None
    );
    // A pod asking for nothing is not reviewed here.
    assert_eq!(
        verdict(&server, "CREATE", &floating_pod("plain", json!({}))).await,
        None
    );
}
