//! The Kubernetes desired-state source against a mocked API server
//! (`tower-test`) and the in-memory one: waiting by watch for the
//! operator's allocation, the bounded wait, the subnet lookup and the
//! Active status written after attach (and kept by the later reports).

use std::time::Duration;

use flatnet_agent::{
    cni::ErrorCode,
    desired::{AttachmentKey, ClaimRequest, DesiredState, PodRef, kubernetes::Kubernetes},
};
use http::{Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

const IPS: &str = "/apis/flatnetwork.pandaria.io/v1/namespaces/default/flatnetworkips";
const SUBNETS: &str =
    "/apis/flatnetwork.pandaria.io/v1/namespaces/cattle-flat-network/flatnetworksubnets";

fn source(wait: Duration) -> (Kubernetes, Handle) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    (Kubernetes::new(client, "node-1", wait), handle)
}

fn request() -> ClaimRequest {
    ClaimRequest {
        network: "rancher-flat-network".into(),
        subnet: None,
        key: AttachmentKey {
            container_id: "c1".into(),
            ifname: "eth1".into(),
        },
        pod: PodRef {
            namespace: Some("default".into()),
            name: Some("web-0".into()),
            uid: Some("uid-1".into()),
        },
        requested_ips: Vec::new(),
        requested_mac: None,
    }
}

fn flip(addr: Option<&str>) -> Value {
    let mut ip = json!({
        "apiVersion": "flatnetwork.pandaria.io/v1",
        "kind": "FlatNetworkIP",
        "metadata": {"name": "web-0", "namespace": "default", "resourceVersion": "5"},
        "spec": {"subnet": "lan4", "podId": "uid-1"},
        "status": {"phase": "Pending"}
    });
    if let Some(addr) = addr {
        ip["status"]["addr"] = json!(addr);
        ip["status"]["mac"] = json!("02:00:00:00:00:07");
    }
    ip
}

fn list(items: Vec<Value>) -> Value {
    json!({
        "apiVersion": "flatnetwork.pandaria.io/v1",
        "kind": "FlatNetworkIPList",
        "metadata": {"resourceVersion": "5"},
        "items": items
    })
}

/// Answers the next request, checking method and path (prefix match on
/// `path`, which excludes the query), and returns the request's URI and JSON body.
async fn answer(
    handle: &mut Handle,
    method: &str,
    path: &str,
    status: StatusCode,
    body: Body,
) -> (String, Value) {
    let (request, send) = handle
        .next_request()
        .await
        .unwrap_or_else(|| panic!("expected {method} {path}, got nothing"));
    let uri = request.uri().to_string();
    assert_eq!(request.method().as_str(), method, "{uri}");
    assert!(
        request.uri().path().starts_with(path),
        "expected {path}, got {uri}"
    );
    let bytes = request.into_body().collect_bytes().await.unwrap();
    let json = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap()
    };
    send.send_response(Response::builder().status(status).body(body).unwrap());
    (uri, json)
}

fn json_body(value: &Value) -> Body {
    Body::from(serde_json::to_vec(value).unwrap())
}

/// [`answer`] with 200 OK and `value` as the response.
async fn answer_ok(
    handle: &mut Handle,
    method: &str,
    path: &str,
    value: &Value,
) -> (String, Value) {
    answer(handle, method, path, StatusCode::OK, json_body(value)).await
}

/// Takes the next request (the watch) and never answers it; returns it
/// with the handle, keeping both alive until the server task is aborted.
async fn never_answer(
    mut handle: Handle,
) -> (
    Handle,
    Option<(
        Request<Body>,
        tower_test::mock::SendResponse<Response<Body>>,
    )>,
) {
    let pending = handle.next_request().await;
    (handle, pending)
}

/// Answers the next request, a list of FlatNetworkIPs, with `items`;
/// returns the request's URI.
async fn answer_list(handle: &mut Handle, items: Vec<Value>) -> String {
    let (uri, _) = answer(handle, "GET", IPS, StatusCode::OK, json_body(&list(items))).await;
    uri
}

/// Answers the list of the FlatNetworkIP `name` with `pending` (only that
/// object is asked for), then its watch with the operator's `allocated`
/// version (a watch, not polling).
async fn allocate_by_watch(handle: &mut Handle, name: &str, pending: Value, allocated: Value) {
    let uri = answer_list(handle, vec![pending]).await;
    assert!(
        uri.contains(&format!("fieldSelector=metadata.name%3D{name}&")) || uri.ends_with(name),
        "only the object {name}: {uri}"
    );
    let event = json!({"type": "MODIFIED", "object": allocated});
    let (uri, _) = answer(
        handle,
        "GET",
        IPS,
        StatusCode::OK,
        Body::from(format!("{event}\n").into_bytes()),
    )
    .await;
    assert!(uri.contains("watch=true"), "a watch, not polling: {uri}");
}

/// Answers the lookup of the FlatNetworkSubnet `name`.
async fn answer_subnet(handle: &mut Handle, name: &str, cidr: &str, gateway: &str) {
    let path = format!("{SUBNETS}/{name}");
    answer_ok(handle, "GET", &path, &subnet(name, cidr, gateway)).await;
}

/// The MAC address of the interface [`activate`] reports as attached.
const ATTACHED_MAC: [u8; 6] = [2, 0, 0, 0, 0, 9];
/// The MTU of the interface [`activate`] reports as attached.
const ATTACHED_MTU: u32 = 1450;

/// Reports the claim of pod `web-0` (see [`request`]) Active, attached
/// with [`ATTACHED_MAC`].
async fn activate(source: &Kubernetes, claim: &flatnet_agent::desired::DesiredInterface) {
    source
        .report_active(
            &request().key,
            &request().pod,
            &claim.subnets,
            ATTACHED_MAC,
            ATTACHED_MTU,
        )
        .await
        .unwrap();
}

/// Answers the activation of the FlatNetworkIP `name`: the patch that
/// labels it with the node, then the one that applies the Active status
/// with [`ATTACHED_MAC`].
async fn answer_activation(handle: &mut Handle, name: &str) {
    let path = format!("{IPS}/{name}");
    let (uri, body) = answer_ok(handle, "PATCH", &path, &flip(Some("192.0.2.10"))).await;
    assert!(uri.contains("fieldManager=flatnet-agent"), "{uri}");
    assert_eq!(body["metadata"]["name"], name);
    assert_eq!(
        body["metadata"]["labels"]["flatnetwork.pandaria.io/node"],
        "node-1"
    );
    let status_path = format!("{path}/status");
    let (uri, body) = answer_ok(handle, "PATCH", &status_path, &flip(Some("192.0.2.10"))).await;
    assert!(uri.contains("force=true"), "{uri}");
    assert!(uri.contains(&format!("{name}/status")), "{uri}");
    assert_eq!(
        body["status"],
        json!({"phase": "Active", "mac": "02:00:00:00:00:09", "node": "node-1", "mtu": ATTACHED_MTU})
    );
}

/// An in-memory API server holding subnet `lan4` and the FlatNetworkIP of
/// pod `web-0` allocated in it, and a source on it.
fn allocated_in_memory() -> (
    flatnet_operator::allocation::fake_api::FakeApiServer,
    Kubernetes,
) {
    use flatnet_k8s::api::{FlatNetworkIP, FlatNetworkSubnet};

    let api = flatnet_operator::allocation::fake_api::FakeApiServer::new();
    let subnet: FlatNetworkSubnet =
        serde_json::from_value(subnet("lan4", "192.0.2.0/24", "192.0.2.1")).unwrap();
    api.insert(&subnet);
    let allocated: FlatNetworkIP = serde_json::from_value(flip(Some("192.0.2.10"))).unwrap();
    api.insert(&allocated);
    let source = Kubernetes::new(api.client(), "node-1", Duration::from_secs(5));
    (api, source)
}

/// Answers the next request (a GET of `path`) with 404.
async fn not_found(handle: &mut Handle, path: &str) {
    let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404, "message": "not found"});
    answer(
        handle,
        "GET",
        path,
        StatusCode::NOT_FOUND,
        json_body(&status),
    )
    .await;
}

fn subnet(name: &str, cidr: &str, gateway: &str) -> Value {
    json!({
        "apiVersion": "flatnetwork.pandaria.io/v1",
        "kind": "FlatNetworkSubnet",
        "metadata": {"name": name, "namespace": "cattle-flat-network"},
        "spec": {"flatMode": "macvlan", "master": "eth0", "cidr": cidr, "gateway": gateway}
    })
}

/// The second (IPv6) record of the dual-stack pod `web-0`.
fn flip6(addr: Option<&str>) -> Value {
    let mut ip = flip(None);
    ip["metadata"]["name"] = json!("web-0.ipv6");
    ip["spec"]["subnet"] = json!("lan6");
    if let Some(addr) = addr {
        ip["status"]["addr"] = json!(addr);
    }
    ip
}

#[tokio::test]
async fn claim_waits_by_watch_for_the_allocation_then_reads_the_subnet() {
    let (source, mut handle) = source(Duration::from_secs(30));
    let server = tokio::spawn(async move {
        allocate_by_watch(&mut handle, "web-0", flip(None), flip(Some("192.0.2.10"))).await;
        not_found(&mut handle, &format!("{IPS}/web-0.ipv6")).await;
        answer_subnet(&mut handle, "lan4", "192.0.2.0/24", "192.0.2.1").await;
        handle
    });
    let claim = source.claim(&request()).await.unwrap();
    assert_eq!(
        claim.addresses,
        ["192.0.2.10/24".parse::<ipnet::IpNet>().unwrap()]
    );
    assert_eq!(claim.subnets[0].name, "lan4");
    assert_eq!(claim.mac, Some([2, 0, 0, 0, 0, 7]));
    assert!(!claim.subnets[0].ipv6to4, "no 6to4 address unless marked");
    server.await.unwrap();
}

/// The operator copies a subnet's `ipv6to4` annotation onto its records;
/// the claim carries it so the agent adds the 6to4 address.
#[tokio::test]
async fn a_record_marked_ipv6to4_asks_for_the_6to4_address() {
    let (source, mut handle) = source(Duration::from_secs(30));
    let mut allocated = flip(Some("192.0.2.10"));
    allocated["metadata"]["annotations"] = json!({"flatnetwork.pandaria.io/ipv6to4": "true"});
    let server = tokio::spawn(async move {
        allocate_by_watch(&mut handle, "web-0", flip(None), allocated).await;
        not_found(&mut handle, &format!("{IPS}/web-0.ipv6")).await;
        answer_subnet(&mut handle, "lan4", "192.0.2.0/24", "192.0.2.1").await;
        handle
    });
    let claim = source.claim(&request()).await.unwrap();
    assert!(claim.subnets[0].ipv6to4);
    server.await.unwrap();
}

#[tokio::test]
async fn no_allocation_in_time_is_try_again_later_naming_the_object() {
    let (source, mut handle) = source(Duration::from_millis(300));
    let server = tokio::spawn(async move {
        answer_list(&mut handle, vec![]).await;
        // The watch never reports an allocation.
        never_answer(handle).await
    });
    let error = source.claim(&request()).await.unwrap_err().to_cni();
    assert_eq!(error.code, ErrorCode::TryAgainLater);
    assert!(
        error.msg.contains("FlatNetworkIP default/web-0"),
        "{}",
        error.msg
    );
    server.abort();
}

#[tokio::test]
async fn an_object_of_another_pod_is_not_taken() {
    let (source, mut handle) = source(Duration::from_millis(300));
    let server = tokio::spawn(async move {
        let mut stale = flip(Some("192.0.2.10"));
        stale["spec"]["podId"] = json!("uid-of-an-earlier-pod");
        answer_list(&mut handle, vec![stale]).await;
        never_answer(handle).await
    });
    let error = source.claim(&request()).await.unwrap_err().to_cni();
    assert_eq!(error.code, ErrorCode::TryAgainLater, "{}", error.msg);
    server.abort();
}

#[tokio::test]
async fn a_missing_subnet_is_subnet_not_found() {
    let (source, mut handle) = source(Duration::from_secs(30));
    let server = tokio::spawn(async move {
        answer_list(&mut handle, vec![flip(Some("192.0.2.10"))]).await;
        not_found(&mut handle, &format!("{IPS}/web-0.ipv6")).await;
        not_found(&mut handle, &format!("{SUBNETS}/lan4")).await;
        handle
    });
    let error = source.claim(&request()).await.unwrap_err().to_cni();
    assert_eq!(error.code, ErrorCode::SubnetNotFound);
    assert!(
        error.msg.contains("cattle-flat-network/lan4"),
        "{}",
        error.msg
    );
    server.await.unwrap();
}

#[tokio::test]
async fn activate_labels_the_node_and_applies_the_active_status() {
    let (source, mut handle) = source(Duration::from_secs(30));
    let server = tokio::spawn(async move {
        answer_activation(&mut handle, "web-0").await;
        handle
    });
    let claim = flatnet_agent::desired::DesiredInterface {
        subnets: Vec::new(),
        addresses: Vec::new(),
        mac: None,
    };
    activate(&source, &claim).await;
    server.await.unwrap();
}

#[tokio::test]
async fn readiness_follows_the_first_successful_api_call() {
    let (source, mut handle) = source(Duration::from_secs(30));
    assert!(source.readiness().is_err());
    let server = tokio::spawn(async move {
        let empty = json!({"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList", "metadata": {}, "items": []});
        answer_ok(&mut handle, "GET", SUBNETS, &empty).await;
        handle
    });
    source.sync().await.unwrap();
    assert!(source.readiness().is_ok());
    server.await.unwrap();
}

#[tokio::test]
async fn a_dual_stack_pod_waits_for_both_records_and_activates_both() {
    let (source, mut handle) = source(Duration::from_secs(30));
    let server = tokio::spawn(async move {
        answer_list(&mut handle, vec![flip(Some("192.0.2.10"))]).await;
        // The operator made the IPv6 record but has not allocated it yet.
        answer_ok(
            &mut handle,
            "GET",
            &format!("{IPS}/web-0.ipv6"),
            &flip6(None),
        )
        .await;
        allocate_by_watch(
            &mut handle,
            "web-0.ipv6",
            flip6(None),
            flip6(Some("2001:db8::10")),
        )
        .await;
        answer_subnet(&mut handle, "lan4", "192.0.2.0/24", "192.0.2.1").await;
        answer_subnet(&mut handle, "lan6", "2001:db8::/64", "2001:db8::1").await;
        // Activation: label and status on both records.
        for name in ["web-0", "web-0.ipv6"] {
            answer_activation(&mut handle, name).await;
        }
        handle
    });
    let claim = source.claim(&request()).await.unwrap();
    assert_eq!(
        claim.addresses,
        [
            "192.0.2.10/24".parse::<ipnet::IpNet>().unwrap(),
            "2001:db8::10/64".parse().unwrap()
        ]
    );
    let names: Vec<&str> = claim.subnets.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["lan4", "lan6"]);
    assert_eq!(
        claim.mac,
        Some([2, 0, 0, 0, 0, 7]),
        "the first record's MAC"
    );
    activate(&source, &claim).await;
    server.await.unwrap();
}

#[tokio::test]
async fn a_dual_stack_pod_whose_ipv6_record_is_never_allocated_names_it() {
    let (source, mut handle) = source(Duration::from_millis(300));
    let server = tokio::spawn(async move {
        answer_list(&mut handle, vec![flip(Some("192.0.2.10"))]).await;
        // The network configuration names two subnets: no lookup needed.
        answer_list(&mut handle, vec![flip6(None)]).await;
        never_answer(handle).await
    });
    let mut request = request();
    request.subnet = Some("lan4,lan6".into());
    let error = source.claim(&request).await.unwrap_err().to_cni();
    assert_eq!(error.code, ErrorCode::TryAgainLater);
    assert!(
        error.msg.contains("FlatNetworkIP default/web-0.ipv6"),
        "{}",
        error.msg
    );
    server.abort();
}

/// With the allocations followed, an ADD whose FlatNetworkIP the copy
/// shows allocated asks the API server nothing until it writes the Active
/// status; a pod the copy does not know yet is read as without it.
#[tokio::test]
async fn a_followed_allocation_is_claimed_without_asking_the_api_server() {
    use flatnet_k8s::api::FlatNetworkIP;

    let (api, source) = allocated_in_memory();
    source.follow_allocations();
    tokio::time::timeout(Duration::from_secs(10), async {
        while !(source.allocations_followed() && source.follows("default", "web-0")) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the copies are complete");

    let before = api.requests();
    let claim = source.claim(&request()).await.unwrap();
    assert_eq!(api.requests(), before, "claimed from the copies");
    assert_eq!(
        claim.addresses,
        ["192.0.2.10/24".parse::<ipnet::IpNet>().unwrap()]
    );
    assert_eq!(claim.subnets[0].name, "lan4");
    assert_eq!(claim.mac, Some([2, 0, 0, 0, 0, 7]));
    activate(&source, &claim).await;
    assert_eq!(api.requests(), before + 2, "label and status");
    let stored = api.list::<FlatNetworkIP>();
    let status = stored[0].status.clone().unwrap();
    assert_eq!(status.mac, "02:00:00:00:00:09");
    assert_eq!(status.node, "node-1");

    // Told again (a restarted agent tells every pod whose record owes it),
    // what the copy already shows asks nothing.
    tokio::time::timeout(Duration::from_secs(10), async {
        while !source.follows_active("default", "web-0", ATTACHED_MAC, ATTACHED_MTU) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the copy shows the Active status");
    let before = api.requests();
    activate(&source, &claim).await;
    assert_eq!(api.requests(), before, "nothing new to tell");
    source
        .report_active(
            &request().key,
            &request().pod,
            &claim.subnets,
            [2, 0, 0, 0, 0, 10],
            ATTACHED_MTU,
        )
        .await
        .unwrap();
    assert_eq!(api.requests(), before + 2, "a new MAC is told");

    // A pod whose record the copy lacks is read from the API server (in a
    // namespace of its own: the in-memory server ignores field selectors).
    let mut other = request();
    other.pod.namespace = Some("other".into());
    let mut late = flip(Some("192.0.2.11"));
    late["metadata"]["namespace"] = json!("other");
    let late: FlatNetworkIP = serde_json::from_value(late).unwrap();
    let waiting = tokio::spawn(async move { source.claim(&other).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    api.insert(&late);
    let claim = waiting.await.unwrap().unwrap();
    assert_eq!(
        claim.addresses,
        ["192.0.2.11/24".parse::<ipnet::IpNet>().unwrap()]
    );
}

#[tokio::test]
async fn a_changed_mtu_is_applied_to_both_records_of_a_dual_stack_pod_under_its_own_manager() {
    let (source, mut handle) = source(Duration::from_secs(30));
    let server = tokio::spawn(async move {
        for name in ["web-0", "web-0.ipv6"] {
            let (uri, body) = answer_ok(
                &mut handle,
                "PATCH",
                &format!("{IPS}/{name}/status"),
                &flip(Some("192.0.2.10")),
            )
            .await;
            assert!(uri.contains("fieldManager=flatnet-agent-mtu"), "{uri}");
            assert!(uri.contains("force=true"), "{uri}");
            assert_eq!(body["status"], json!({"mtu": 1400}), "only the MTU: {body}");
        }
        handle
    });
    let subnet = |name: &str| flatnet_agent::desired::NamedSubnet {
        name: name.into(),
        spec: flatnet_k8s::api::FlatNetworkSubnetSpec::default(),
        ipv6to4: false,
    };
    source
        .report_mtu(
            &request().key,
            &request().pod,
            &[subnet("lan4"), subnet("lan6")],
            1400,
        )
        .await
        .unwrap();
    server.await.unwrap();
}

/// Each status report after the activation is applied under a field
/// manager of its own: against a server that removes the fields a manager
/// stops applying (the in-memory one models that), a conflict report or
/// an MTU change leaves the Active status whole.
#[tokio::test]
async fn reports_after_the_activation_keep_the_active_status() {
    use flatnet_agent::datapath::Conflict;
    use flatnet_common::conflict::ClaimKind;
    use flatnet_k8s::api::FlatNetworkIP;

    let (api, source) = allocated_in_memory();
    let claim = source.claim(&request()).await.unwrap();
    activate(&source, &claim).await;

    let conflict = Conflict {
        ifindex: 2,
        addr: "192.0.2.10".parse().unwrap(),
        kind: ClaimKind::GratuitousArp,
        foreign_mac: [2, 0, 0, 0, 0, 0x66],
        owner_mac: ATTACHED_MAC,
        monotonic_ns: 1,
    };
    source
        .report_conflict(&request().pod, &conflict)
        .await
        .unwrap();
    source
        .report_mtu(&request().key, &request().pod, &claim.subnets, 1400)
        .await
        .unwrap();

    let status = api.list::<FlatNetworkIP>()[0].status.clone().unwrap();
    assert_eq!(status.phase, "Active");
    assert_eq!(status.mac, "02:00:00:00:00:09");
    assert_eq!(status.node, "node-1");
    assert_eq!(status.mtu, Some(1400));
    assert!(
        status.conditions.iter().any(|c| c.type_ == "IPConflict"),
        "{:?}",
        status.conditions
    );
}
