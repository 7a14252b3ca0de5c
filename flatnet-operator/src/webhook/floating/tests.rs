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
    admission::{AdmissionRequest, AdmissionResponse, AdmissionReview},
};
use serde_json::{Value, json};

use crate::{
    allocation::fake_api::FakeApiServer,
    metrics::Metrics,
    webhook::{Validator, workload},
};

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

/// Quota `shop-quota` allowing project p-shop `limit` addresses of `lan`.
fn limit_shop(server: &FakeApiServer, limit: u32) {
    server.insert(
        &serde_json::from_value::<FloatingIPProjectQuota>(json!({
            "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPProjectQuota",
            "metadata": {"name": "shop-quota"},
            "spec": {"project": "p-shop", "limits": {"lan": limit}},
        }))
        .unwrap(),
    );
}

/// Pod vnf-0 of set `pair`, holding 192.168.10.6 of `lan`.
fn insert_pair_member(server: &FakeApiServer) {
    let mut member = floating_pod(
        "vnf-0",
        json!({POOL_KEY: "lan", SET_KEY: "pair",
               "flatnetwork.pandaria.io/floating-ip-assigned": "192.168.10.6"}),
    );
    member["metadata"]["labels"] = json!({"flatnetwork.pandaria.io/floating-ip-assigned": "true"});
    server.insert(&serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(member).unwrap());
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
    limit_shop(&server, 1);
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
    let response = respond(server, operation, object, old).await;
    (!response.allowed).then_some(response.result.message)
}

/// The webhook's whole answer to `operation` of `object` (an update from
/// `old`).
async fn respond(
    server: &FakeApiServer,
    operation: &str,
    object: &Value,
    old: Option<Value>,
) -> AdmissionResponse {
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
    validator.review(&request).await
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
    limit_shop(&server, 2);
    insert_pair_member(&server);
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

const POOL_KEY: &str = "flatnetwork.pandaria.io/floating-ip-pool";
const FIXED_KEY: &str = "flatnetwork.pandaria.io/floating-ip";
const SET_KEY: &str = "flatnetwork.pandaria.io/floating-ip-set";

/// The workload kinds whose pod template may ask for a floating address.
fn template_kinds() -> impl Iterator<Item = &'static str> {
    workload::KINDS.into_iter().filter(|k| *k != "Pod")
}

/// Workload `w` of `kind` in namespace shop whose pod template carries
/// `annotations`; `spec` is merged into its spec (for a CronJob, into its
/// job's spec).
fn workload(kind: &str, annotations: Value, spec: Value) -> Value {
    let template = json!({
        "metadata": {"labels": {"app": "w"}, "annotations": annotations},
        "spec": {"containers": [{"name": "vnf", "image": "vnf"}]},
    });
    let mut pods = json!({"template": template});
    if !matches!(kind, "Job" | "CronJob") {
        pods["selector"] = json!({"matchLabels": {"app": "w"}});
    }
    let (api_version, mut own) = match kind {
        "Job" => ("batch/v1", pods),
        "CronJob" => (
            "batch/v1",
            json!({"schedule": "* * * * *", "jobTemplate": {"spec": pods}}),
        ),
        _ => ("apps/v1", pods),
    };
    let target = if kind == "CronJob" {
        &mut own["jobTemplate"]["spec"]
    } else {
        &mut own
    };
    for (key, value) in spec.as_object().into_iter().flatten() {
        target[key] = value.clone();
    }
    json!({
        "apiVersion": api_version, "kind": kind,
        "metadata": {"name": "w", "namespace": "shop"},
        "spec": own,
    })
}

/// How the messages name `key` on `kind`'s pod template.
fn template_field(kind: &str, key: &str) -> String {
    if kind == "CronJob" {
        format!("spec.jobTemplate.spec.template.metadata.annotations[{key}]")
    } else {
        format!("spec.template.metadata.annotations[{key}]")
    }
}

#[tokio::test]
async fn every_workload_kinds_template_gets_the_pods_checks_naming_the_template_path() {
    let server = cluster();
    let mut narrow = pool("narrow", "192.168.40.0/24");
    narrow["spec"]["namespaceSelector"] = json!({"matchLabels": {"team": "net"}});
    server.insert(&serde_json::from_value::<FloatingIPPool>(narrow).unwrap());
    let mut broken = pool("broken", "192.168.50.0/24");
    broken["spec"]["targetNetworkInterface"] = json!("eth0.5000");
    server.insert(&serde_json::from_value::<FloatingIPPool>(broken).unwrap());
    for kind in template_kinds() {
        let deny = async |annotations: Value| {
            verdict(&server, "CREATE", &workload(kind, annotations, json!({})))
                .await
                .unwrap_or_else(|| panic!("{kind}: allowed"))
        };
        let missing = deny(json!({POOL_KEY: "lab"})).await;
        assert!(
            missing.starts_with(&format!("{kind} w: FloatingIPPool lab ("))
                && missing.contains(&template_field(kind, POOL_KEY))
                && missing.contains("does not exist")
                && missing.contains("[broken, lan, narrow]"),
            "{missing}"
        );
        let invalid = deny(json!({POOL_KEY: "broken"})).await;
        assert!(
            invalid.starts_with(&format!("{kind} w: "))
                && invalid.contains("spec.targetNetworkInterface")
                && invalid.contains("fix the pool first"),
            "{invalid}"
        );
        let not_serving = deny(json!({POOL_KEY: "narrow"})).await;
        assert!(
            not_serving.contains(&template_field(kind, POOL_KEY))
                && not_serving.contains("does not serve namespace shop"),
            "{not_serving}"
        );
        let garbage = deny(json!({FIXED_KEY: "192.168.10.300"})).await;
        assert!(
            garbage.starts_with(&format!("{kind} w: "))
                && garbage.contains(&template_field(kind, FIXED_KEY))
                && garbage.contains("\"192.168.10.300\""),
            "{garbage}"
        );
        let twice = deny(json!({FIXED_KEY: "192.168.10.7,192.168.10.8", SET_KEY: "s"})).await;
        assert!(
            twice.contains(&template_field(kind, FIXED_KEY))
                && twice.contains("lists two IPv4 addresses"),
            "{twice}"
        );
        let outside = deny(json!({POOL_KEY: "lan", FIXED_KEY: "192.168.11.5", SET_KEY: "s"})).await;
        assert!(
            outside.contains("192.168.11.5")
                && outside.contains(&template_field(kind, FIXED_KEY))
                && outside.contains("outside FloatingIPPool lan")
                && outside.contains("192.168.10.0-192.168.10.255"),
            "{outside}"
        );
        // The project's one address of lan is held by Service web: not
        // one pod of the workload could get an address.
        let over = deny(json!({POOL_KEY: "lan"})).await;
        assert!(
            over.starts_with(&format!("{kind} w: "))
                && over.contains("FloatingIPProjectQuota shop-quota"),
            "{over}"
        );
        // Annotations on the workload itself are not its pods'.
        let mut own = workload(kind, json!({}), json!({}));
        own["metadata"]["annotations"] = json!({POOL_KEY: "lab"});
        assert_eq!(verdict(&server, "CREATE", &own).await, None, "{kind}");
    }
}

#[tokio::test]
async fn a_fixed_address_for_several_pods_needs_a_set() {
    let server = cluster();
    // Quota out of the way: these are about the address.
    limit_shop(&server, 10);
    let fixed = json!({FIXED_KEY: "192.168.10.9"});
    let in_set = json!({FIXED_KEY: "192.168.10.9", SET_KEY: "pair"});
    for (kind, several, field) in [
        ("Deployment", json!({"replicas": 3}), "spec.replicas 3"),
        ("ReplicaSet", json!({"replicas": 2}), "spec.replicas 2"),
        ("StatefulSet", json!({"replicas": 2}), "spec.replicas 2"),
        ("DaemonSet", json!({}), "a pod on every node it selects"),
        ("Job", json!({"parallelism": 2}), "spec.parallelism 2"),
        (
            "CronJob",
            json!({"parallelism": 2}),
            "spec.jobTemplate.spec.parallelism 2",
        ),
    ] {
        let denial = verdict(
            &server,
            "CREATE",
            &workload(kind, fixed.clone(), several.clone()),
        )
        .await
        .unwrap_or_else(|| panic!("{kind}: allowed"));
        assert!(
            denial.starts_with(&format!("{kind} w: "))
                && denial.contains(&template_field(kind, FIXED_KEY))
                && denial.contains(&format!("({field})"))
                && denial.contains(&template_field(kind, SET_KEY)),
            "{denial}"
        );
        // An active/standby set shares it.
        assert_eq!(
            verdict(
                &server,
                "CREATE",
                &workload(kind, in_set.clone(), several.clone())
            )
            .await,
            None,
            "{kind}"
        );
        // A pool address per pod.
        assert_eq!(
            verdict(
                &server,
                "CREATE",
                &workload(kind, json!({POOL_KEY: "lan"}), several)
            )
            .await,
            None,
            "{kind}"
        );
    }
    // One pod at a time: allowed; a Deployment, ReplicaSet or StatefulSet
    // is warned that its replacement pods wait for the address.
    for kind in template_kinds().filter(|k| *k != "DaemonSet") {
        let response = respond(
            &server,
            "CREATE",
            &workload(kind, fixed.clone(), json!({})),
            None,
        )
        .await;
        assert!(response.allowed, "{kind}: {}", response.result.message);
        let warned = response.warnings.unwrap_or_default();
        if matches!(kind, "Job" | "CronJob") {
            assert!(warned.is_empty(), "{kind}: {warned:?}");
        } else {
            assert!(
                warned.len() == 1 && warned[0].contains(&template_field(kind, SET_KEY)),
                "{kind}: {warned:?}"
            );
        }
        let set = respond(
            &server,
            "CREATE",
            &workload(kind, in_set.clone(), json!({})),
            None,
        )
        .await;
        assert!(
            set.allowed && set.warnings.unwrap_or_default().is_empty(),
            "{kind}"
        );
    }
    // Scaled up in the object (kubectl apply) with the request unchanged:
    // reviewed, and denied; an unchanged update is not.
    let one = workload("Deployment", fixed.clone(), json!({"replicas": 1}));
    let three = workload("Deployment", fixed.clone(), json!({"replicas": 3}));
    let denial = verdict_on(&server, "UPDATE", &three, Some(one.clone()))
        .await
        .unwrap();
    assert!(denial.contains("spec.replicas 3"), "{denial}");
    assert_eq!(
        verdict_on(&server, "UPDATE", &three, Some(three.clone())).await,
        None
    );
    let mut relabelled = one.clone();
    relabelled["metadata"]["labels"] = json!({"tier": "x"});
    assert_eq!(
        verdict_on(&server, "UPDATE", &relabelled, Some(one)).await,
        None
    );
}

#[tokio::test]
async fn a_templates_quota_is_checked_once_when_a_user_creates_it() {
    let server = cluster();
    // Quota full: Service web holds the project's one address of lan.
    let asking = json!({POOL_KEY: "lan"});
    assert!(
        verdict(
            &server,
            "CREATE",
            &workload("Deployment", asking.clone(), json!({}))
        )
        .await
        .unwrap()
        .contains("FloatingIPProjectQuota shop-quota")
    );
    // The ReplicaSet a Deployment makes, the Job a CronJob makes: their
    // parent was checked, and each pod is reviewed when created.
    for (kind, parent) in [("ReplicaSet", "Deployment"), ("Job", "CronJob")] {
        let mut child = workload(kind, asking.clone(), json!({}));
        child["metadata"]["ownerReferences"] = json!([{
            "apiVersion": if parent == "Deployment" { "apps/v1" } else { "batch/v1" },
            "kind": parent, "name": "w", "uid": "u1", "controller": true,
        }]);
        assert_eq!(verdict(&server, "CREATE", &child).await, None, "{kind}");
        // The other checks still apply to it.
        let mut lost = child.clone();
        let path = "/spec/template/metadata/annotations";
        *lost.pointer_mut(path).unwrap() = json!({POOL_KEY: "lab"});
        assert!(verdict(&server, "CREATE", &lost).await.is_some(), "{kind}");
    }
    // An update changing the request: its own pods hold the addresses its
    // new pods replace, so the quota is left to the pods.
    let before = workload(
        "StatefulSet",
        json!({POOL_KEY: "lan", SET_KEY: "a"}),
        json!({}),
    );
    let after = workload(
        "StatefulSet",
        json!({POOL_KEY: "lan", SET_KEY: "b"}),
        json!({}),
    );
    assert_eq!(
        verdict_on(&server, "UPDATE", &after, Some(before)).await,
        None
    );
    // A set that already holds an address needs none.
    limit_shop(&server, 2);
    insert_pair_member(&server);
    let joining = workload(
        "StatefulSet",
        json!({POOL_KEY: "lan", SET_KEY: "pair"}),
        json!({"replicas": 2}),
    );
    assert_eq!(verdict(&server, "CREATE", &joining).await, None);
    let alone = workload("StatefulSet", json!({POOL_KEY: "lan"}), json!({}));
    assert!(verdict(&server, "CREATE", &alone).await.is_some());
}

/// A pool serves only the namespaces its `namespaceSelector` selects and
/// its `projects` hold: a Service or a pod of another namespace naming it
/// is refused, naming the pool and both fields.
#[tokio::test]
async fn a_pool_refuses_namespaces_it_does_not_select_and_other_projects() {
    let server = cluster();
    let mut narrow = pool("narrow", "192.168.40.0/24");
    narrow["spec"]["namespaceSelector"] = json!({"matchLabels": {"team": "net"}});
    server.insert(&serde_json::from_value::<FloatingIPPool>(narrow).unwrap());
    let mut ops = pool("ops", "192.168.41.0/24");
    ops["spec"]["projects"] = json!(["p-ops"]);
    server.insert(&serde_json::from_value::<FloatingIPPool>(ops).unwrap());

    for name in ["narrow", "ops"] {
        let mut requester = service("api", None);
        requester["metadata"]["annotations"] = json!({POOL_KEY: name});
        let refusals = [
            verdict(&server, "CREATE", &requester).await,
            verdict(
                &server,
                "CREATE",
                &floating_pod("vnf", json!({POOL_KEY: name})),
            )
            .await,
        ];
        for refusal in refusals {
            let refusal = refusal.unwrap_or_else(|| panic!("pool {name} serves shop"));
            assert!(
                refusal.contains(&format!("FloatingIPPool {name}"))
                    && refusal.contains("does not serve namespace shop")
                    && refusal.contains("spec.namespaceSelector or spec.projects"),
                "{refusal}"
            );
        }
    }
    // A Service that holds an address of the pool already (the namespace's
    // labels changed since) is left alone: the operator's writes go through.
    let mut holder = service("api", Some("192.168.40.7"));
    holder["metadata"]["annotations"] = json!({POOL_KEY: "narrow"});
    assert_eq!(verdict(&server, "UPDATE", &holder).await, None);
}
