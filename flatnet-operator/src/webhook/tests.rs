//! The admission handler, table-driven: real AdmissionReview JSON posted to
//! `/validate`, lookups answered by a mocked API server holding a small
//! cluster.

use std::sync::{Arc, Mutex};

use http::{Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::fixtures::{admission_review, list, status_error};

// ---------------------------------------------------------------------------
// The cluster the mocked API server serves.

const NS: &str = "shop";
const SUBNETS: &str =
    "/apis/flatnetwork.pandaria.io/v1/namespaces/cattle-flat-network/flatnetworksubnets";
const IPS: &str = "/apis/flatnetwork.pandaria.io/v1/flatnetworkips";

fn subnet(name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
        "metadata": {"name": name, "namespace": "cattle-flat-network", "uid": format!("uid-{name}")},
        "spec": spec,
    })
}

/// `net1`: macvlan on eth0, 10.1.0.0/24, gateway .1, pool .100-.200.
fn net1_spec() -> Value {
    json!({"flatMode": "macvlan", "master": "eth0", "vlan": 0, "cidr": "10.1.0.0/24",
           "gateway": "10.1.0.1", "ranges": [{"from": "10.1.0.100", "to": "10.1.0.200"}]})
}

fn subnets() -> Vec<Value> {
    vec![
        subnet("net1", net1_spec()),
        subnet(
            "net6",
            json!({"flatMode": "macvlan", "master": "eth0", "cidr": "fd00:1::/64"}),
        ),
        subnet(
            "ipv",
            json!({"flatMode": "ipvlan", "master": "eth1", "vlan": 20, "cidr": "10.2.0.0/24"}),
        ),
        subnet(
            "vlan30",
            json!({"flatMode": "macvlan", "master": "eth0", "vlan": 30, "cidr": "10.3.0.0/24",
                                 "ranges": [{"from": "10.3.0.10", "to": "10.3.0.20"}]}),
        ),
        // Only for namespaces labelled tenant=bank.
        subnet(
            "secure",
            json!({"flatMode": "macvlan", "master": "eth5", "cidr": "10.9.0.0/24",
                   "namespaceSelector": {"matchLabels": {"tenant": "bank"}}}),
        ),
        // Stored before validation existed.
        subnet(
            "broken",
            json!({"flatMode": "bogus", "master": "eth0", "cidr": "10.4.0.0/24"}),
        ),
    ]
}

fn owner(api_version: &str, kind: &str, name: &str) -> Value {
    json!([{"apiVersion": api_version, "kind": kind, "name": name, "uid": format!("uid-{name}"), "controller": true}])
}

fn ip_record(name: &str, subnet: &str, addr: &str, mac: &str, owners: Value) -> Value {
    json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkIP",
        "metadata": {"name": name, "namespace": NS, "ownerReferences": owners},
        "spec": {"subnet": subnet},
        "status": {"phase": "Active", "addr": addr, "mac": mac},
    })
}

fn ips() -> Vec<Value> {
    vec![
        ip_record(
            "web-abc-1",
            "net1",
            "10.1.0.100",
            "0a:00:00:00:00:01",
            owner("v1", "Pod", "web-abc-1"),
        ),
        ip_record(
            "db-0",
            "net1",
            "10.1.0.150",
            "",
            owner("apps/v1", "StatefulSet", "db"),
        ),
        ip_record(
            "lonely",
            "net1",
            "10.1.0.160",
            "",
            owner("v1", "Pod", "lonely"),
        ),
        ip_record(
            "nightly-123-x",
            "net1",
            "10.1.0.170",
            "",
            owner("v1", "Pod", "nightly-123-x"),
        ),
        ip_record("gone", "net1", "10.1.0.180", "", owner("v1", "Pod", "gone")),
    ]
}

fn meta(name: &str, owners: Value) -> Value {
    json!({"name": name, "namespace": NS, "uid": format!("uid-{name}"), "ownerReferences": owners})
}

/// The object a GET of `path` returns, if it exists.
fn object_at(path: &str) -> Option<Value> {
    if let Some(name) = path.strip_prefix("/api/v1/namespaces/")
        && !name.contains('/')
    {
        let labels = if name == "bank" {
            json!({"tenant": "bank"})
        } else {
            json!({})
        };
        return Some(json!({"apiVersion": "v1", "kind": "Namespace",
                           "metadata": {"name": name, "labels": labels}}));
    }
    let pods = format!("/api/v1/namespaces/{NS}/pods/");
    let replicasets = format!("/apis/apps/v1/namespaces/{NS}/replicasets/");
    let jobs = format!("/apis/batch/v1/namespaces/{NS}/jobs/");
    if let Some(name) = path.strip_prefix(&pods) {
        let owners = match name {
            "web-abc-1" => owner("apps/v1", "ReplicaSet", "web-abc"),
            "nightly-123-x" => owner("batch/v1", "Job", "nightly-123"),
            "lonely" => json!([]),
            _ => return None,
        };
        return Some(json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta(name, owners)}));
    }
    if path.strip_prefix(&replicasets) == Some("web-abc") {
        return Some(json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
                           "metadata": meta("web-abc", owner("apps/v1", "Deployment", "web"))}));
    }
    if path.strip_prefix(&jobs) == Some("nightly-123") {
        return Some(json!({"apiVersion": "batch/v1", "kind": "Job",
                           "metadata": meta("nightly-123", owner("batch/v1", "CronJob", "nightly"))}));
    }
    None
}

fn answer(path: &str) -> (StatusCode, Value) {
    match path {
        SUBNETS => (
            StatusCode::OK,
            list(
                "FlatNetworkSubnetList",
                "flatnetwork.pandaria.io/v1",
                subnets(),
            ),
        ),
        IPS => (
            StatusCode::OK,
            list("FlatNetworkIPList", "flatnetwork.pandaria.io/v1", ips()),
        ),
        _ => match object_at(path) {
            Some(object) => (StatusCode::OK, object),
            None => (StatusCode::NOT_FOUND, status_error(404, "NotFound")),
        },
    }
}

/// A client on the mocked cluster, and the log of the requests it made.
fn cluster() -> (kube::Client, Arc<Mutex<Vec<String>>>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            assert_eq!(
                request.method(),
                "GET",
                "the webhook only reads: {}",
                request.uri()
            );
            let path = request.uri().path().to_owned();
            log.lock().unwrap().push(path.clone());
            let (status, body) = answer(&path);
            send.send_response(
                Response::builder()
                    .status(status)
                    .body(Body::from(serde_json::to_vec(&body).unwrap()))
                    .unwrap(),
            );
        }
    });
    (kube::Client::new(service, NS), seen)
}

// ---------------------------------------------------------------------------
// Reviewed objects.

fn annotations(subnet: Option<&str>, ip: Option<&str>, mac: Option<&str>) -> Value {
    let mut map = serde_json::Map::new();
    for (key, value) in [
        ("flatnetwork.pandaria.io/subnet", subnet),
        ("flatnetwork.pandaria.io/ip", ip),
        ("flatnetwork.pandaria.io/mac", mac),
    ] {
        if let Some(value) = value {
            map.insert(key.into(), value.into());
        }
    }
    map.insert(
        "k8s.v1.cni.cncf.io/networks".into(),
        "[{\"name\":\"rancher-flat-network\",\"interface\":\"eth1\"}]".into(),
    );
    Value::Object(map)
}

fn flat(subnet: &str, ip: &str) -> Value {
    annotations(Some(subnet), Some(ip), None)
}

fn template(annotations: Value) -> Value {
    json!({"metadata": {"annotations": annotations}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
}

fn pod(name: &str, owners: Value, annotations: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": NS, "ownerReferences": owners, "annotations": annotations},
           "spec": {"containers": [{"name": "c", "image": "busybox"}]}})
}

/// A workload of `kind` named `name` whose pods carry `annotations`.
fn workload(kind: &str, name: &str, annotations: Value) -> Value {
    let (api_version, spec) = match kind {
        "CronJob" => (
            "batch/v1",
            json!({"schedule": "@daily", "jobTemplate": {"spec": {"template": template(annotations)}}}),
        ),
        "Job" => ("batch/v1", json!({"template": template(annotations)})),
        _ => (
            "apps/v1",
            json!({"selector": {"matchLabels": {"app": name}}, "template": template(annotations)}),
        ),
    };
    json!({"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": NS}, "spec": spec})
}

fn new_subnet(name: &str, spec: Value) -> Value {
    subnet(name, spec)
}

fn with_spec(name: &str, change: impl FnOnce(&mut Value)) -> Value {
    let mut object = subnet(name, net1_spec());
    change(&mut object["spec"]);
    object
}

#[derive(Clone, Copy)]
enum Op {
    Create,
    Update,
    Delete,
}

/// One admission request: the operation, the object and the old object.
struct Case {
    name: &'static str,
    op: Op,
    object: Option<Value>,
    old: Option<Value>,
    /// `None`: allowed. `Some((reason, fragments))`: denied with that metric
    /// reason and a message containing every fragment.
    denied: Option<(&'static str, &'static [&'static str])>,
}

fn create(
    name: &'static str,
    object: Value,
    denied: Option<(&'static str, &'static [&'static str])>,
) -> Case {
    Case {
        name,
        op: Op::Create,
        object: Some(object),
        old: None,
        denied,
    }
}

fn update(
    name: &'static str,
    old: Value,
    object: Value,
    denied: Option<(&'static str, &'static [&'static str])>,
) -> Case {
    Case {
        name,
        op: Op::Update,
        object: Some(object),
        old: Some(old),
        denied,
    }
}

fn review_json(case: &Case) -> Value {
    let operation = match case.op {
        Op::Create => "CREATE",
        Op::Update => "UPDATE",
        Op::Delete => "DELETE",
    };
    admission_review(
        &format!("uid-{}", case.name),
        operation,
        case.object.as_ref(),
        case.old.as_ref(),
    )
}

/// Posts `body` to `/validate` and returns the status line and the JSON reply.
async fn post(addr: std::net::SocketAddr, body: &Value) -> (String, Value) {
    let body = body.to_string();
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!(
        "POST /validate HTTP/1.1\r\nHost: webhook\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    let (head, reply) = response.split_once("\r\n\r\n").expect("an HTTP response");
    let status = head.lines().next().unwrap_or_default().to_owned();
    (status, serde_json::from_str(reply).unwrap_or(Value::Null))
}

async fn run(case: &Case) {
    let (client, seen) = cluster();
    let metrics = Arc::new(Metrics::new());
    let app = router(Arc::new(Validator::new(client, Arc::clone(&metrics))));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let (status, reply) = post(addr, &review_json(case)).await;
    server.abort();
    let name = case.name;
    assert!(status.starts_with("HTTP/1.1 200"), "{name}: {status}");
    assert_eq!(reply["apiVersion"], "admission.k8s.io/v1", "{name}");
    assert_eq!(reply["kind"], "AdmissionReview", "{name}");
    let response = &reply["response"];
    assert_eq!(response["uid"], format!("uid-{name}"), "{name}");
    let message = response["status"]["message"].as_str().unwrap_or_default();
    match case.denied {
        None => assert_eq!(
            response["allowed"],
            true,
            "{name}: denied with {message:?}; requests {:?}",
            seen.lock().unwrap()
        ),
        Some((reason, fragments)) => {
            assert_eq!(
                response["allowed"],
                false,
                "{name}: allowed; requests {:?}",
                seen.lock().unwrap()
            );
            for fragment in fragments {
                assert!(
                    message.contains(fragment),
                    "{name}: {message:?} lacks {fragment:?}"
                );
            }
            let kind = review_json(case)["request"]["kind"]["kind"]
                .as_str()
                .unwrap()
                .to_owned();
            let line = format!(
                "flatnet_operator_webhook_denials_total{{kind=\"{kind}\",reason=\"{reason}\"}} 1"
            );
            assert!(
                metrics.render().lines().any(|l| l == line),
                "{name}: no {line:?} in\n{}",
                metrics.render()
            );
        }
    }
}

fn deny(
    reason: &'static str,
    fragments: &'static [&'static str],
) -> Option<(&'static str, &'static [&'static str])> {
    Some((reason, fragments))
}

// ---------------------------------------------------------------------------
// The table.

fn bad_subnets() -> Vec<Case> {
    vec![
        create(
            "flat-mode",
            new_subnet(
                "s",
                json!({"flatMode": "bridge", "master": "eth0", "cidr": "10.9.0.0/24"}),
            ),
            deny(
                "invalid_subnet",
                &["spec.flatMode \"bridge\"", "use \"macvlan\" or \"ipvlan\""],
            ),
        ),
        create(
            "vlan-range",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "vlan": 4095, "cidr": "10.9.0.0/24"}),
            ),
            deny("invalid_subnet", &["spec.vlan 4095", "1..4094"]),
        ),
        create(
            "negative-vlan",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "vlan": -1, "cidr": "10.9.0.0/24"}),
            ),
            deny("invalid_subnet", &["spec.vlan -1"]),
        ),
        create(
            "mtu-below-ipv6-minimum",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "cidr": "fd09::/64", "mtu": 1200}),
            ),
            deny(
                "invalid_subnet",
                &["spec.mtu 1200", "IPv6", "use 1280..65535"],
            ),
        ),
        create(
            "bad-cidr",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "cidr": "10.9.0.0/33"}),
            ),
            deny("invalid_subnet", &["spec.cidr"]),
        ),
        create(
            "gateway-outside",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "cidr": "10.9.0.0/24", "gateway": "10.8.0.1"}),
            ),
            deny(
                "invalid_subnet",
                &["spec.gateway 10.8.0.1 is not inside spec.cidr"],
            ),
        ),
        create(
            "range-outside",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "cidr": "10.9.0.0/24",
                "ranges": [{"from": "10.9.0.10", "to": "10.9.1.10"}]}),
            ),
            deny(
                "invalid_subnet",
                &[
                    "spec.ranges[0].to 10.9.1.10",
                    "keep ranges inside the subnet",
                ],
            ),
        ),
        create(
            "range-reversed",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "cidr": "10.9.0.0/24",
                "ranges": [{"from": "10.9.0.20", "to": "10.9.0.10"}]}),
            ),
            deny("invalid_subnet", &["spec.ranges[0] runs backwards"]),
        ),
        create(
            "flag-on-macvlan",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "cidr": "10.9.0.0/24", "ipvlanFlag": "private"}),
            ),
            deny(
                "invalid_subnet",
                &["spec.ipvlanFlag \"private\" only applies to ipvlan"],
            ),
        ),
        create(
            "ipvlan-mode",
            new_subnet(
                "s",
                json!({"flatMode": "ipvlan", "master": "eth5", "cidr": "10.9.0.0/24", "mode": "bridge"}),
            ),
            deny(
                "invalid_subnet",
                &["spec.mode \"bridge\" is not a ipvlan mode"],
            ),
        ),
        create(
            "route-dst",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "cidr": "10.9.0.0/24",
                "routes": [{"dev": "eth1", "dst": "somewhere"}]}),
            ),
            deny("invalid_subnet", &["spec.routes[0].dst"]),
        ),
        create(
            "wrong-namespace",
            {
                let mut s = new_subnet(
                    "s",
                    json!({"flatMode": "macvlan", "master": "eth0", "cidr": "10.9.0.0/24"}),
                );
                s["metadata"]["namespace"] = json!("default");
                s
            },
            deny(
                "wrong_namespace",
                &["create subnets in namespace cattle-flat-network"],
            ),
        ),
        create(
            "cidr-overlap",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "cidr": "10.1.0.0/16"}),
            ),
            deny(
                "subnet_conflict",
                &["overlaps subnet net1", "disjoint spec.ranges"],
            ),
        ),
        create(
            "mixed-flat-mode",
            new_subnet(
                "s",
                json!({"flatMode": "ipvlan", "master": "eth0", "cidr": "10.9.0.0/24"}),
            ),
            deny(
                "subnet_conflict",
                &["already uses eth0 in flatMode macvlan"],
            ),
        ),
        create(
            "range-overlap",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "vlan": 30, "cidr": "10.3.0.0/24",
                "ranges": [{"from": "10.3.0.20", "to": "10.3.0.25"}]}),
            ),
            deny(
                "subnet_conflict",
                &["overlaps range 10.3.0.10-10.3.0.20 of subnet vlan30"],
            ),
        ),
        create(
            "one-interface-two-spellings",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0.30", "cidr": "10.8.0.0/24"}),
            ),
            deny(
                "subnet_conflict",
                &[
                    "subnet vlan30 reaches interface eth0.30 as master eth0 vlan 30",
                    "name it as subnet vlan30 does (master eth0, vlan 30)",
                ],
            ),
        ),
        update(
            "cidr-change-in-use",
            subnet("net1", net1_spec()),
            with_spec("net1", |s| {
                s["cidr"] = json!("10.9.0.0/24");
                s["gateway"] = json!(null);
                s["ranges"] = json!([]);
            }),
            deny(
                "subnet_in_use",
                &[
                    "leaves 10.1.0.100",
                    "outside spec.cidr 10.9.0.0/24",
                    "delete that pod first",
                ],
            ),
        ),
        update(
            "ranges-shrink-in-use",
            subnet("net1", net1_spec()),
            with_spec("net1", |s| {
                s["ranges"] = json!([{"from": "10.1.0.10", "to": "10.1.0.50"}]);
            }),
            deny(
                "subnet_in_use",
                &["leaves 10.1.0.100", "outside spec.ranges"],
            ),
        ),
        update(
            "gateway-onto-held-address",
            subnet("net1", net1_spec()),
            with_spec("net1", |s| s["gateway"] = json!("10.1.0.100")),
            deny("subnet_in_use", &["10.1.0.100", "the gateway"]),
        ),
        update(
            "master-change-in-use",
            subnet("net1", net1_spec()),
            with_spec("net1", |s| s["master"] = json!("eth9")),
            deny(
                "subnet_in_use",
                &[
                    "spec.master of FlatNetworkSubnet net1 cannot change",
                    "5 FlatNetworkIP(s)",
                    "and 2 more",
                ],
            ),
        ),
        Case {
            name: "delete-in-use",
            op: Op::Delete,
            object: None,
            old: Some(subnet("net1", net1_spec())),
            denied: deny(
                "subnet_in_use",
                &[
                    "FlatNetworkSubnet net1 is still used by 5",
                    "shop/web-abc-1",
                ],
            ),
        },
    ]
}

fn bad_requests() -> Vec<Case> {
    let rs_owner = owner("apps/v1", "ReplicaSet", "web-abc");
    vec![
        create(
            "ip-syntax",
            pod("p", json!([]), flat("net1", "10.1.0.300")),
            deny(
                "bad_annotation",
                &["flatnetwork.pandaria.io/ip entry \"10.1.0.300\" is not an IP address"],
            ),
        ),
        create(
            "ip-without-subnet",
            pod("p", json!([]), annotations(None, Some("auto"), None)),
            deny(
                "bad_annotation",
                &["flatnetwork.pandaria.io/subnet is empty"],
            ),
        ),
        create(
            "subnet-without-ip",
            pod("p", json!([]), annotations(Some("net1"), None, None)),
            deny(
                "bad_annotation",
                &["flatnetwork.pandaria.io/ip is empty", "auto"],
            ),
        ),
        create(
            "duplicate-ip",
            pod("p", json!([]), flat("net1", "10.1.0.101-10.1.0.101")),
            deny("bad_annotation", &["lists 10.1.0.101 twice"]),
        ),
        create(
            "hyphenated-mac",
            pod(
                "p",
                json!([]),
                annotations(Some("net1"), Some("auto"), Some("0a-00-00-00-00-09")),
            ),
            deny("bad_annotation", &["flatnetwork.pandaria.io/mac"]),
        ),
        create(
            "mac-syntax",
            pod(
                "p",
                json!([]),
                annotations(Some("net1"), Some("auto"), Some("0a:00:00:00:00")),
            ),
            deny("bad_annotation", &["flatnetwork.pandaria.io/mac"]),
        ),
        create(
            "three-subnets",
            pod("p", json!([]), flat("net1,net6,ipv", "auto")),
            deny(
                "bad_annotation",
                &["not a subnet name or \"v4name,v6name\""],
            ),
        ),
        create(
            "mixed-families",
            pod("p", json!([]), flat("net1", "10.1.0.101-fd00:1::5")),
            deny("bad_annotation", &["mixes IPv4 and IPv6"]),
        ),
        create(
            "unknown-subnet",
            pod("p", json!([]), flat("nope", "auto")),
            deny(
                "subnet_not_found",
                &["FlatNetworkSubnet nope, which does not exist in namespace cattle-flat-network"],
            ),
        ),
        create(
            "invalid-subnet",
            pod("p", json!([]), flat("broken", "auto")),
            deny(
                "subnet_invalid",
                &[
                    "FlatNetworkSubnet broken is invalid",
                    "fix the subnet first",
                ],
            ),
        ),
        create(
            "outside-ranges",
            pod("p", json!([]), flat("net1", "10.1.0.50")),
            deny(
                "address_not_allocatable",
                &[
                    "10.1.0.50 is outside spec.ranges of subnet net1",
                    "inside spec.ranges",
                ],
            ),
        ),
        create(
            "outside-cidr",
            pod("p", json!([]), flat("net1", "10.7.0.5")),
            deny(
                "address_not_allocatable",
                &["10.7.0.5 is not inside subnet net1 (10.1.0.0/24)"],
            ),
        ),
        create(
            "gateway-requested",
            pod("p", json!([]), flat("ipv", "10.2.0.0")),
            deny(
                "address_not_allocatable",
                &["10.2.0.0 is the network address of subnet ipv"],
            ),
        ),
        create(
            "ipv6-on-ipv4-subnet",
            pod("p", json!([]), flat("net1", "fd00:1::5")),
            deny(
                "wrong_family",
                &["requests IPv6 addresses, but subnet net1 (10.1.0.0/24) is IPv4"],
            ),
        ),
        create(
            "dual-stack-reversed",
            pod("p", json!([]), flat("net6,net1", "auto")),
            deny(
                "wrong_family",
                &[
                    "lists net6 first, but it is an IPv6 subnet",
                    "IPv4 subnet first",
                ],
            ),
        ),
        create(
            "dual-stack-wrong-group",
            pod("p", json!([]), flat("net1,net6", "fd00:1::5,10.1.0.101")),
            deny("bad_annotation", &["which is the IPv4 subnet"]),
        ),
        create(
            "mac-on-ipvlan",
            pod(
                "p",
                json!([]),
                annotations(Some("ipv"), Some("auto"), Some("0a:00:00:00:00:09")),
            ),
            deny("mac_on_ipvlan", &["subnet ipv is ipvlan", "eth1.20"]),
        ),
        create(
            "deployment-takes-anothers-address",
            workload("Deployment", "api", flat("net1", "10.1.0.101-10.1.0.100")),
            deny(
                "address_in_use",
                &["10.1.0.100 of subnet net1 is held by pod shop/web-abc-1 of Deployment shop/web"],
            ),
        ),
        create(
            "statefulset-takes-anothers-address",
            workload("StatefulSet", "cache", flat("net1", "10.1.0.150")),
            deny(
                "address_in_use",
                &["held by pod shop/db-0 of StatefulSet shop/db"],
            ),
        ),
        create(
            "bare-pod-takes-anothers-address",
            pod("intruder", json!([]), flat("net1", "10.1.0.160")),
            deny(
                "address_in_use",
                &["held by pod shop/lonely of Pod shop/lonely"],
            ),
        ),
        create(
            "cronjob-takes-anothers-address",
            workload("CronJob", "weekly", flat("net1", "10.1.0.170")),
            deny(
                "address_in_use",
                &["held by pod shop/nightly-123-x of CronJob shop/nightly"],
            ),
        ),
        create(
            "address-of-a-deleted-pod",
            workload("DaemonSet", "agent", flat("net1", "10.1.0.180")),
            deny(
                "address_in_use",
                &["held by pod shop/gone of Pod shop/gone"],
            ),
        ),
        create(
            "mac-in-use",
            workload(
                "Deployment",
                "api",
                annotations(Some("net1"), Some("auto"), Some("0A:00:00:00:00:01")),
            ),
            deny(
                "mac_in_use",
                &["0a:00:00:00:00:01 is held by pod shop/web-abc-1 of Deployment shop/web"],
            ),
        ),
        create(
            "replicaset-of-another-deployment",
            {
                let mut rs = workload("ReplicaSet", "api-1", flat("net1", "10.1.0.100"));
                rs["metadata"]["ownerReferences"] = owner("apps/v1", "Deployment", "api");
                rs
            },
            deny("address_in_use", &["of Deployment shop/web"]),
        ),
        create(
            "job-bad-annotation",
            workload("Job", "once", flat("net1", "ten")),
            deny("bad_annotation", &["entry \"ten\" is not an IP address"]),
        ),
        create(
            "daemonset-unknown-subnet",
            workload("DaemonSet", "agent", flat("missing", "auto")),
            deny("subnet_not_found", &["FlatNetworkSubnet missing"]),
        ),
        // The original skipped updates that changed its labels: not here.
        update(
            "relabelled-update-is-still-checked",
            pod("p", rs_owner.clone(), flat("net1", "auto")),
            {
                let mut p = pod("p", rs_owner.clone(), flat("net1", "10.1.0.160"));
                p["metadata"]["labels"] =
                    json!({"flatnetwork.pandaria.io/flatNetworkIPType": "specific"});
                p
            },
            deny("address_in_use", &["of Pod shop/lonely"]),
        ),
        // The original only looked at pods of workloads with a Multus annotation.
        create(
            "pod-without-multus-annotation",
            pod(
                "p",
                json!([]),
                json!({"flatnetwork.pandaria.io/subnet": "net1", "flatnetwork.pandaria.io/ip": "x"}),
            ),
            deny("bad_annotation", &["entry \"x\""]),
        ),
    ]
}

fn good() -> Vec<Case> {
    let rs_owner = owner("apps/v1", "ReplicaSet", "web-abc");
    vec![
        create("plain-pod", pod("p", json!([]), json!({})), None),
        create("auto-pod", pod("p", json!([]), flat("net1", "auto")), None),
        create(
            "free-fixed-address",
            pod("p", json!([]), flat("net1", "10.1.0.101")),
            None,
        ),
        create(
            "dual-stack",
            pod("p", json!([]), flat("net1,net6", "10.1.0.120,fd00:1::20")),
            None,
        ),
        create(
            "free-mac-on-macvlan",
            pod(
                "p",
                json!([]),
                annotations(Some("net1"), Some("auto"), Some("0a:00:00:00:00:09")),
            ),
            None,
        ),
        // A pod of Deployment web may take the addresses web's pods hold.
        create(
            "pod-of-the-same-deployment",
            pod("web-abc-2", rs_owner, flat("net1", "10.1.0.100-10.1.0.101")),
            None,
        ),
        // kubectl-made workloads have no Rancher selector label: still their own addresses.
        update(
            "deployment-keeps-its-addresses",
            workload("Deployment", "web", flat("net1", "10.1.0.100")),
            workload("Deployment", "web", flat("net1", "10.1.0.100-10.1.0.101")),
            None,
        ),
        update(
            "cronjob-keeps-its-addresses",
            workload("CronJob", "nightly", flat("net1", "10.1.0.170")),
            workload("CronJob", "nightly", flat("net1", "10.1.0.170-10.1.0.171")),
            None,
        ),
        create(
            "statefulset-pod-comes-back",
            pod(
                "db-0",
                owner("apps/v1", "StatefulSet", "db"),
                flat("net1", "10.1.0.150"),
            ),
            None,
        ),
        update(
            "unchanged-request",
            workload("Deployment", "api", flat("net1", "10.1.0.100")),
            {
                let mut d = workload("Deployment", "api", flat("net1", "10.1.0.100"));
                d["spec"]["replicas"] = json!(3);
                d
            },
            None,
        ),
        create(
            "new-subnet-disjoint-ranges",
            new_subnet(
                "s",
                json!({"flatMode": "macvlan", "master": "eth0", "vlan": 30, "cidr": "10.3.0.0/24",
                "ranges": [{"from": "10.3.0.30", "to": "10.3.0.40"}]}),
            ),
            None,
        ),
        create(
            "new-subnet-other-vlan",
            new_subnet(
                "s",
                json!({"flatMode": "ipvlan", "master": "eth0", "vlan": 40, "cidr": "10.1.0.0/24"}),
            ),
            None,
        ),
        update(
            "labels-only",
            subnet("net1", net1_spec()),
            {
                let mut s = subnet("net1", net1_spec());
                s["metadata"]["labels"] = json!({"master": "eth0"});
                s
            },
            None,
        ),
        update(
            "widen-ranges-in-use",
            subnet("net1", net1_spec()),
            with_spec("net1", |s| {
                s["ranges"] = json!([{"from": "10.1.0.100", "to": "10.1.0.250"}]);
            }),
            None,
        ),
        Case {
            name: "delete-unused",
            op: Op::Delete,
            object: None,
            old: Some(subnet("vlan30", json!({}))),
            denied: None,
        },
        create(
            "other-kinds",
            json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x", "namespace": NS},
            "spec": {}}),
            None,
        ),
    ]
}

#[tokio::test]
async fn rejects_every_bad_request_with_its_field_and_fix() {
    let bad: Vec<Case> = bad_subnets().into_iter().chain(bad_requests()).collect();
    assert!(bad.len() >= 30, "{} bad cases", bad.len());
    for case in &bad {
        run(case).await;
    }
}

#[tokio::test]
async fn admits_the_good_requests() {
    for case in &good() {
        run(case).await;
    }
}

#[tokio::test]
async fn pods_without_a_flat_request_cost_no_lookup() {
    let (client, seen) = cluster();
    let validator = Validator::new(client, Arc::new(Metrics::new()));
    let case = create("plain", pod("p", json!([]), json!({"app": "x"})), None);
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_value(review_json(&case)).unwrap();
    let request: AdmissionRequest<DynamicObject> = review.try_into().unwrap();
    assert!(validator.review(&request).await.allowed);
    assert!(seen.lock().unwrap().is_empty());
}

#[tokio::test]
async fn a_body_that_is_not_a_review_is_refused() {
    let (client, _) = cluster();
    let app = router(Arc::new(Validator::new(client, Arc::new(Metrics::new()))));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(async move { axum::serve(listener, app).await });
    let (status, _) = post(addr, &json!({"hello": "world"})).await;
    assert!(status.starts_with("HTTP/1.1 4"), "{status}");
    let (status, reply) = post(
        addr,
        &json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
    )
    .await;
    assert!(status.starts_with("HTTP/1.1 200"), "{status}");
    assert_eq!(reply["response"]["allowed"], false);
    server.abort();
}

fn pod_network_config(namespace: &str, spec: Value) -> Value {
    json!({"apiVersion": "flatnetwork.pandaria.io/v1", "kind": "PodNetworkConfig",
           "metadata": {"name": "extra", "namespace": namespace}, "spec": spec})
}

#[tokio::test]
async fn pod_network_configs_name_their_bad_fields_and_may_use_only_admitted_subnets() {
    let cases = [
        create(
            "pnc-good",
            pod_network_config(
                NS,
                json!({"podSelector": {"matchLabels": {"app": "web"}}, "primary": {"mtu": 1450},
                       "attachments": [{"subnet": "net1", "interface": "net2"}],
                       "vlans": [{"master": "eth1", "id": 200}],
                       "bridges": [{"name": "br0", "ports": ["eth2"]}]}),
            ),
            None,
        ),
        create(
            "pnc-admitted-tenant",
            pod_network_config(
                "bank",
                json!({"attachments": [{"subnet": "secure", "interface": "net2"}]}),
            ),
            None,
        ),
        create(
            "pnc-not-admitted",
            pod_network_config(
                NS,
                json!({"attachments": [{"subnet": "secure", "interface": "net2"}]}),
            ),
            deny(
                "invalid_pod_network_config",
                &["spec.attachments[0]: subnet secure does not admit namespace shop"],
            ),
        ),
        create(
            "pnc-missing-subnet",
            pod_network_config(
                NS,
                json!({"attachments": [{"subnet": "nope", "interface": "net2"}]}),
            ),
            deny(
                "invalid_pod_network_config",
                &["spec.attachments[0]: subnet nope of interface net2 does not exist"],
            ),
        ),
        create(
            "pnc-bad-fields",
            pod_network_config(
                NS,
                json!({"podSelector": {"matchExpressions": [{"key": "tier", "operator": "Within"}]},
                       "primary": {"mtu": 40},
                       "attachments": [{"subnet": "net1", "interface": "eth0"},
                                       {"subnet": "net1", "interface": "net3", "mac": "zz"},
                                       {"subnet": "net1", "interface": "net3"},
                                       {"subnet": "net1", "interface": "Net_4"}],
                       "vlans": [{"master": "averylongname0", "id": 4095}],
                       "bridges": [{"name": "a/b"}]}),
            ),
            deny(
                "invalid_pod_network_config",
                &[
                    "spec.podSelector: unknown label selector operator \"Within\" on key \"tier\"",
                    "spec.primary.mtu 40 is out of range",
                    "spec.attachments[0].interface eth0 is the pod's primary interface",
                    "spec.attachments[1].mac \"zz\" is not a MAC address",
                    "spec.attachments[2].interface net3 is asked for twice",
                    "spec.attachments[3].interface: interface name \"Net_4\" names the interface's FlatNetworkIP too",
                    "spec.vlans[0]",
                    "spec.vlans[0].id 4095 is out of range",
                    "spec.bridges[0].name",
                ],
            ),
        ),
        create(
            "pnc-clamp-without-mtu",
            pod_network_config(NS, json!({"primary": {"tcpMssClamp": true}})),
            deny(
                "invalid_pod_network_config",
                &["spec.primary.tcpMssClamp needs spec.primary.mtu"],
            ),
        ),
    ];
    for case in &cases {
        run(case).await;
    }
}
