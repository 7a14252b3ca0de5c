//! Controller tests: exact requests against a scripted API server, and
//! races of two allocators against the in-memory fake API server.

use std::{collections::BTreeSet, net::IpAddr, sync::Arc, time::Duration};

use flatnet_k8s::{
    annotations::parse_pod_request,
    api::{
        FlatNetworkIP, FlatNetworkIPStatus, FlatNetworkSubnet, FlatNetworkSubnetSpec,
        FlatNetworkSubnetStatus, IpRange, phase,
    },
    ipam::used_ranges,
    keys::SUBNET_NAMESPACE,
};
use k8s_openapi::{
    api::core::v1::{Namespace, Node, Pod},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    jiff::Timestamp,
};
use kube::{
    ResourceExt,
    api::{PartialObjectMeta, PartialObjectMetaExt},
    runtime::controller::Action,
};
use serde_json::{Value, json};

use super::{
    Backoff, CachedPod, Caches, Context, Settings, commit,
    events::Events,
    fake_api::FakeApiServer,
    ips, pods,
    records::{self, FINALIZER, RecordContext},
    subnets,
};
use crate::{
    controller::CONFLICT_RETRY,
    fixtures::{
        ApiServerVerifier, NS, PodExt, mock_client, ok, pod, shuffled, status_error, store, to_json,
    },
    metrics::Metrics,
};

const SUBNET: &str =
    "/apis/flatnetwork.pandaria.io/v1/namespaces/cattle-flat-network/flatnetworksubnets/net1";
const RECORDS: &str = "/apis/flatnetwork.pandaria.io/v1/namespaces/shop/flatnetworkips";
/// Any event creation in the test namespace.
const EVENT_POSTS: &str = "/apis/events.k8s.io/v1/namespaces/shop/events?*";

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// The cached form of node `name`.
fn node_meta(name: &str) -> PartialObjectMeta<Node> {
    ObjectMeta {
        name: Some(name.into()),
        ..ObjectMeta::default()
    }
    .into_response_partial::<Node>()
}

/// Caches holding exactly the given objects, and the node `node-1` of the
/// fixture pods.
fn caches(records: Vec<FlatNetworkIP>, subnets: Vec<FlatNetworkSubnet>, pods: Vec<Pod>) -> Caches {
    caches_with_nodes(records, subnets, pods, &["node-1"])
}

/// Caches holding exactly the given objects and nodes.
fn caches_with_nodes(
    records: Vec<FlatNetworkIP>,
    subnets: Vec<FlatNetworkSubnet>,
    pods: Vec<Pod>,
    nodes: &[&str],
) -> Caches {
    Caches {
        records: store(records).0,
        subnets: store(subnets).0,
        pods: store(pods.iter().map(CachedPod::from).collect()).0,
        namespaces: store::<Namespace>(Vec::new()).0,
        nodes: store(nodes.iter().map(|n| node_meta(n)).collect()).0,
    }
}

pub(crate) fn context(client: kube::Client, caches: Caches, settings: Settings) -> Arc<Context> {
    Arc::new(Context {
        events: Events::new(client.clone()),
        client,
        metrics: Arc::new(Metrics::new()),
        caches,
        settings,
        backoff: Backoff::default(),
        orphans: subnets::OrphanClock::default(),
        nodes: Arc::default(),
        ledgers: Default::default(),
        departed: Arc::new(super::pods::Marks::departed()),
        created: super::pods::Marks::created(),
        wire: super::wire_exclusion::WireView::empty(flatnet_k8s::ipam::DEFAULT_WIRE_WINDOW),
        mac_pool: Default::default(),
    })
}

/// Active subnet `net1`: 10.0.0.0/29 with gateway .1, ledger `used`.
fn subnet(used: &[(&str, &str)], version: &str) -> FlatNetworkSubnet {
    let mut subnet = FlatNetworkSubnet::new(
        "net1",
        FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth0".into(),
            cidr: "10.0.0.0/29".into(),
            gateway: Some(ip("10.0.0.1")),
            ..FlatNetworkSubnetSpec::default()
        },
    );
    subnet.metadata.namespace = Some(SUBNET_NAMESPACE.into());
    subnet.metadata.resource_version = Some(version.into());
    subnet.metadata.finalizers = Some(vec![subnets::FINALIZER.into()]);
    subnet.status = Some(FlatNetworkSubnetStatus {
        phase: phase::ACTIVE.into(),
        gateway: Some(ip("10.0.0.1")),
        used_ip: used
            .iter()
            .map(|(f, t)| IpRange::new(ip(f), ip(t)))
            .collect(),
        ..FlatNetworkSubnetStatus::default()
    });
    subnet
}

/// The record the pod controller writes for fixture pod `name`.
fn record_of(pod: &Pod, version: &str) -> FlatNetworkIP {
    let annotations = pod.annotations();
    let request = parse_pod_request(
        &annotations["flatnetwork.pandaria.io/subnet"],
        &annotations["flatnetwork.pandaria.io/ip"],
        "",
    )
    .unwrap();
    let mut record =
        records::desired_record(&CachedPod::from(pod), &RecordContext::plain(&request));
    record.metadata.resource_version = Some(version.into());
    record.metadata.uid = Some(format!("uid-record-{}", pod.name_any()));
    record.metadata.creation_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
    record
}

fn used_ip(body: &Value) -> Vec<(String, String)> {
    body["status"]["usedIP"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["from"].as_str().unwrap().into(),
                r["to"].as_str().unwrap().into(),
            )
        })
        .collect()
}

fn pair(a: &str, b: &str) -> (String, String) {
    (a.into(), b.into())
}

/// Plays `script` as the API server while `run` uses the client.
async fn scripted<S, F, R, Fut>(script: S, run: R) -> Result<Action, super::Error>
where
    S: FnOnce(ApiServerVerifier) -> F + Send + 'static,
    F: std::future::Future<Output = ApiServerVerifier> + Send + 'static,
    R: FnOnce(kube::Client) -> Fut,
    Fut: std::future::Future<Output = Result<Action, super::Error>>,
{
    let (client, verifier) = mock_client();
    let server = tokio::spawn(async move { script(verifier).await.expect_no_more().await });
    let result = run(client).await;
    if let Err(join) = server.await {
        std::panic::resume_unwind(join.into_panic());
    }
    result
}

/// The pod controller reconciling `pod` with caches holding it and `subnets`.
async fn reconcile_pod(
    client: kube::Client,
    pod: Pod,
    subnets: Vec<FlatNetworkSubnet>,
) -> Result<Action, super::Error> {
    let ctx = context(
        client,
        caches(vec![], subnets, vec![pod.clone()]),
        Settings::default(),
    );
    pods::reconcile(Arc::new(CachedPod::from(&pod)), ctx).await
}

/// The IP controller reconciling `record` with caches holding it and `pods`.
async fn reconcile_record(
    client: kube::Client,
    record: FlatNetworkIP,
    pods: Vec<Pod>,
) -> Result<Action, super::Error> {
    let ctx = context(
        client,
        caches(vec![record.clone()], vec![], pods),
        Settings::default(),
    );
    ips::reconcile(Arc::new(record), ctx).await
}

#[tokio::test]
async fn pod_controller_creates_the_record() {
    let web = pod("web-1").flat();
    let result = scripted(
        |mut api| async move {
            let created = api
                .expect("POST", &format!("{RECORDS}?*"), |body| {
                    let mut stored = body.clone();
                    stored["metadata"]["resourceVersion"] = json!("3");
                    (http::StatusCode::CREATED, stored)
                })
                .await;
            let body = &created.body;
            assert_eq!(body["metadata"]["name"], "web-1");
            assert_eq!(body["spec"]["subnet"], "net1");
            assert_eq!(body["spec"]["podId"], "uid-web-1");
            assert_eq!(body["metadata"]["labels"]["subnet"], "net1");
            assert_eq!(
                body["metadata"]["labels"]["flatnetwork.pandaria.io/flatNetworkIPType"],
                "auto"
            );
            assert_eq!(
                body["metadata"]["labels"]["flatnetwork.pandaria.io/node"],
                "node-1"
            );
            assert_eq!(body["metadata"]["ownerReferences"][0]["kind"], "Pod");
            assert_eq!(body["metadata"]["ownerReferences"][0]["uid"], "uid-web-1");
            assert_eq!(body["metadata"]["finalizers"], json!([FINALIZER]));
            assert_eq!(body.get("status"), None);
            api
        },
        |client| reconcile_pod(client, web, vec![subnet(&[], "5")]),
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
}

/// Runs `run` against a server whose only request, `method` on `path`, is
/// answered 409 Conflict.
async fn refused_once<R, Fut>(
    method: &'static str,
    path: String,
    run: R,
) -> Result<Action, super::Error>
where
    R: FnOnce(kube::Client) -> Fut,
    Fut: std::future::Future<Output = Result<Action, super::Error>>,
{
    scripted(
        move |mut api| async move {
            api.expect(method, &path, |_| {
                (http::StatusCode::CONFLICT, status_error(409, "Conflict"))
            })
            .await;
            api
        },
        run,
    )
    .await
}

/// A 409 the server applied to nothing (no newer record exists, so no
/// event follows) must not leave the pod without a record: the pod
/// controller looks again soon instead of waiting for a change.
#[tokio::test]
async fn a_refused_record_creation_is_tried_again() {
    let web = pod("web-1").flat();
    let result = refused_once("POST", format!("{RECORDS}?*"), |client| {
        reconcile_pod(client, web, vec![subnet(&[], "5")])
    })
    .await;
    assert_eq!(result.unwrap(), Action::requeue(CONFLICT_RETRY));
}

/// The same for the finalizer removal of a deleted record: refused, it is
/// tried again (with the current copy), and nothing is released meanwhile.
#[tokio::test]
async fn a_refused_finalizer_removal_is_tried_again_and_releases_nothing() {
    let web = pod("web-1").flat();
    let mut record = record_of(&web, "8");
    record.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
    record.status = Some(FlatNetworkIPStatus {
        phase: phase::ACTIVE.into(),
        addr: Some(ip("10.0.0.3")),
        ..FlatNetworkIPStatus::default()
    });
    let result = refused_once("PATCH", format!("{RECORDS}/web-1?*"), |client| {
        reconcile_record(client, record, vec![])
    })
    .await;
    assert_eq!(result.unwrap(), Action::requeue(CONFLICT_RETRY));
}

#[tokio::test]
async fn bad_annotation_gives_its_events_once_and_no_retry() {
    let web = pod("web-1")
        .flat()
        .annotated("flatnetwork.pandaria.io/ip", "10.0.0.300");
    let result = scripted(
        |mut api| async move {
            let original = api.expect_created(EVENT_POSTS).await;
            assert_eq!(original["reason"], "FlatNetworkIPError");
            let note = original["note"].as_str().unwrap();
            assert!(note.starts_with("InvalidAnnotation: "), "{note}");
            assert!(note.contains("10.0.0.300"), "{note}");
            let event = api.expect_created(EVENT_POSTS).await;
            assert_eq!(event["type"], "Warning");
            assert_eq!(event["reason"], "InvalidAnnotation");
            let note = event["note"].as_str().unwrap();
            assert!(note.contains("flatnetwork.pandaria.io/ip"), "{note}");
            assert!(note.contains("10.0.0.300"), "{note}");
            assert!(note.contains("write \"auto\""), "{note}");
            assert_eq!(event["regarding"]["name"], "web-1");
            api
        },
        |client| reconcile_pod(client, web, vec![]),
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
}

#[tokio::test]
async fn allocation_reserves_in_the_subnet_with_its_resource_version_then_writes_the_record() {
    let web = pod("web-1").flat();
    let mut record = record_of(&web, "3");
    record.metadata.generation = Some(2);
    let result = scripted(
        |mut api| async move {
            api.expect(
                "GET",
                SUBNET,
                ok(to_json(&subnet(&[("10.0.0.1", "10.0.0.2")], "5"))),
            )
            .await;
            let reserve = api
                .expect("PUT", &format!("{SUBNET}/status?*"), |body| {
                    let mut stored = body.clone();
                    stored["metadata"]["resourceVersion"] = json!("6");
                    (http::StatusCode::OK, stored)
                })
                .await;
            assert_eq!(reserve.body["metadata"]["resourceVersion"], "5");
            assert_eq!(used_ip(&reserve.body), [pair("10.0.0.1", "10.0.0.3")]);
            assert_eq!(reserve.body["status"]["usedIPCount"], 3);
            assert_eq!(reserve.body["status"]["totalIPCount"], 5);
            let write = api
                .expect_accepted("PUT", &format!("{RECORDS}/web-1/status?*"))
                .await;
            assert_eq!(write.body["metadata"]["resourceVersion"], "3");
            assert_eq!(write.body["status"]["addr"], "10.0.0.3");
            assert_eq!(write.body["status"]["phase"], "Pending");
            assert!(write.body["status"]["allocatedTimeStamp"].is_string());
            assert_eq!(write.body["status"]["conditions"][0]["reason"], "Allocated");
            assert_eq!(
                write.body["status"]["conditions"][0]["observedGeneration"],
                2
            );
            api
        },
        |client| reconcile_record(client, record, vec![web]),
    )
    .await;
    assert_eq!(
        result.unwrap(),
        Action::requeue(Settings::default().pending_timeout)
    );
}

#[tokio::test]
async fn a_conflict_rereads_the_subnet_and_chooses_again() {
    let web = pod("web-1").flat();
    let record = record_of(&web, "3");
    let result = scripted(
        |mut api| async move {
            api.expect(
                "GET",
                SUBNET,
                ok(to_json(&subnet(&[("10.0.0.1", "10.0.0.2")], "5"))),
            )
            .await;
            let lost = api
                .expect("PUT", &format!("{SUBNET}/status?*"), |_| {
                    (http::StatusCode::CONFLICT, status_error(409, "Conflict"))
                })
                .await;
            assert_eq!(used_ip(&lost.body), [pair("10.0.0.1", "10.0.0.3")]);
            // Meanwhile another allocator took .3.
            api.expect(
                "GET",
                SUBNET,
                ok(to_json(&subnet(&[("10.0.0.1", "10.0.0.3")], "6"))),
            )
            .await;
            let won = api
                .expect_accepted("PUT", &format!("{SUBNET}/status?*"))
                .await;
            assert_eq!(won.body["metadata"]["resourceVersion"], "6");
            assert_eq!(used_ip(&won.body), [pair("10.0.0.1", "10.0.0.4")]);
            let write = api
                .expect_accepted("PUT", &format!("{RECORDS}/web-1/status?*"))
                .await;
            assert_eq!(write.body["status"]["addr"], "10.0.0.4");
            api
        },
        |client| reconcile_record(client, record, vec![web]),
    )
    .await;
    assert!(result.is_ok(), "{result:?}");
}

#[tokio::test]
async fn a_deleted_record_lets_go_of_its_finalizer_then_releases_its_address() {
    let web = pod("web-1").flat();
    let mut record = record_of(&web, "8");
    record.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
    record.status = Some(FlatNetworkIPStatus {
        phase: phase::ACTIVE.into(),
        addr: Some(ip("10.0.0.3")),
        ..FlatNetworkIPStatus::default()
    });
    let released = to_json(&record);
    let result = scripted(
        |mut api| async move {
            let patch = api
                .expect("PATCH", &format!("{RECORDS}/web-1?*"), ok(released))
                .await;
            assert_eq!(
                patch.body,
                json!({"metadata": {"finalizers": [], "resourceVersion": "8"}})
            );
            api.expect(
                "GET",
                SUBNET,
                ok(to_json(&subnet(&[("10.0.0.1", "10.0.0.4")], "5"))),
            )
            .await;
            let release = api
                .expect_accepted("PUT", &format!("{SUBNET}/status?*"))
                .await;
            assert_eq!(release.body["metadata"]["resourceVersion"], "5");
            assert_eq!(
                used_ip(&release.body),
                [pair("10.0.0.1", "10.0.0.2"), pair("10.0.0.4", "10.0.0.4")]
            );
            assert_eq!(release.body["status"]["usedIPCount"], 3);
            api
        },
        |client| reconcile_record(client, record, vec![]),
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
}

/// The cache lags behind a finalizer removal, so a released record comes
/// back to the controller as it was: its address, meanwhile handed to
/// another record, must stay in the ledger.
#[tokio::test]
async fn a_stale_copy_of_a_released_record_releases_nothing() {
    let web = pod("web-1").flat();
    let server = node_cluster(&web);
    // It asks for .3 by name: released addresses are otherwise reused last.
    let filler = pod("filler")
        .flat()
        .annotated("flatnetwork.pandaria.io/ip", "10.0.0.3");
    server.insert(&filler);
    server.delete::<FlatNetworkIP>(NS, "web-1");
    let stale = stored_record(&server, "web-1").unwrap();
    // One operator: its caches hold the terminating record and never catch up.
    let ctx = context_from(&server, Settings::default());
    ips::reconcile(Arc::new(stale.clone()), Arc::clone(&ctx))
        .await
        .unwrap();
    assert!(stored_record(&server, "web-1").is_none());
    assert_eq!(
        ledger(&server),
        [IpRange::new(ip("10.0.0.1"), ip("10.0.0.2"))]
    );
    // The next allocation takes .3 again.
    pods::reconcile(Arc::new(CachedPod::from(&filler)), Arc::clone(&ctx))
        .await
        .unwrap();
    let record = stored_record(&server, "filler").unwrap();
    ips::reconcile(Arc::new(record), Arc::clone(&ctx))
        .await
        .unwrap();
    let filler = stored_record(&server, "filler").unwrap();
    assert_eq!(filler.status.unwrap().addr, Some(ip("10.0.0.3")));
    // The stale copy comes back (any event of the record brings it).
    ips::reconcile(Arc::new(stale), ctx).await.unwrap();
    assert_eq!(
        ledger(&server),
        [IpRange::new(ip("10.0.0.1"), ip("10.0.0.3"))],
        "the address filler holds was released again"
    );
}

#[tokio::test]
async fn an_exhausted_subnet_fails_the_record_and_tells_the_pod_once() {
    let web = pod("web-1").flat();
    let mut record = record_of(&web, "3");
    record.metadata.generation = Some(4);
    let full = subnet(&[("10.0.0.1", "10.0.0.6")], "5");
    let (client, verifier) = mock_client();
    let ctx = context(
        client,
        caches(vec![record.clone()], vec![], vec![web]),
        Settings::default(),
    );
    let server = tokio::spawn(async move {
        let mut api = verifier;
        api.expect("GET", SUBNET, ok(to_json(&full))).await;
        let failed = api
            .expect_accepted("PUT", &format!("{RECORDS}/web-1/status?*"))
            .await;
        assert_eq!(failed.body["status"]["phase"], "Failed");
        let message = failed.body["status"]["failureMessage"].as_str().unwrap();
        assert!(message.contains("no free address"), "{message}");
        let ready = &failed.body["status"]["conditions"][0];
        assert_eq!(
            (&ready["type"], &ready["observedGeneration"]),
            (&json!("Ready"), &json!(4))
        );
        // The original's reason first (existing alerts), then the finer one.
        let event = api.expect_created(EVENT_POSTS).await;
        assert_eq!(event["reason"], "FlatNetworkIPError");
        let note = event["note"].as_str().unwrap();
        assert!(note.starts_with("NoAddressLeft: "), "{note}");
        let event = api.expect_created(EVENT_POSTS).await;
        assert_eq!(event["reason"], "NoAddressLeft");
        api.expect_no_more().await;
    });
    let error = ips::reconcile(Arc::new(record), Arc::clone(&ctx))
        .await
        .unwrap_err();
    assert_eq!(error.metric_label(), "exhausted");
    let first = ips::error_policy(
        Arc::new(FlatNetworkIP::new("web-1", Default::default())),
        &error,
        Arc::clone(&ctx),
    );
    let second = ips::error_policy(
        Arc::new(FlatNetworkIP::new("web-1", Default::default())),
        &error,
        Arc::clone(&ctx),
    );
    assert_eq!(first, Action::requeue(Duration::from_secs(1)));
    assert_eq!(
        second,
        Action::requeue(Duration::from_secs(2)),
        "retries back off"
    );
    drop(ctx);
    if let Err(join) = server.await {
        std::panic::resume_unwind(join.into_panic());
    }
}

#[tokio::test]
async fn a_record_pending_too_long_fails_without_touching_the_pod() {
    let web = pod("web-1").flat();
    let mut record = record_of(&web, "3");
    record.status = Some(FlatNetworkIPStatus {
        phase: phase::PENDING.into(),
        addr: Some(ip("10.0.0.3")),
        allocated_time_stamp: Some(Time(Timestamp::UNIX_EPOCH)),
        ..FlatNetworkIPStatus::default()
    });
    let result = scripted(
        |mut api| async move {
            let failed = api
                .expect_accepted("PUT", &format!("{RECORDS}/web-1/status?*"))
                .await;
            assert_eq!(failed.body["status"]["phase"], "Failed");
            assert_eq!(
                failed.body["status"]["addr"], "10.0.0.3",
                "the address is kept"
            );
            assert_eq!(
                failed.body["status"]["conditions"][0]["reason"],
                "SetupTimeout"
            );
            let event = api.expect_created(EVENT_POSTS).await;
            assert_eq!(event["reason"], "FlatNetworkSetupTimeout");
            api
        },
        |client| reconcile_record(client, record, vec![web]),
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());
}

#[tokio::test]
async fn a_record_of_a_vanished_pod_is_collected_unless_its_statefulset_keeps_it() {
    let web = pod("web-1").flat();
    let record = record_of(&web, "3");
    let result = scripted(
        |mut api| async move {
            api.expect("DELETE", &format!("{RECORDS}/web-1?*"), |_| {
                (http::StatusCode::OK, json!({"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}}))
            })
            .await;
            api
        },
        |client| reconcile_record(client, record, vec![]),
    )
    .await;
    assert_eq!(result.unwrap(), Action::await_change());

    let mut kept = record_of(&web, "3");
    kept.metadata.owner_references.as_mut().unwrap()[0].kind = "StatefulSet".into();
    kept.metadata.owner_references.as_mut().unwrap()[0].api_version = "apps/v1".into();
    let result = scripted(
        |api| async move { api },
        |client| reconcile_record(client, kept, vec![]),
    )
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Settings::default().resync));
}

// ---------------------------------------------------------------------------
// Races against the fake API server.

/// Pods `p0..` in [`NS`]: `auto` ones, then ones requesting `.45-.46-.47`.
fn race_pods(auto: usize, specific: usize) -> Vec<Pod> {
    (0..auto + specific)
        .map(|i| {
            let p = pod(&format!("p{i}"))
                .flat()
                .annotated("flatnetwork.pandaria.io/subnet", "race");
            if i < auto {
                p
            } else {
                p.annotated(
                    "flatnetwork.pandaria.io/ip",
                    "10.0.0.45-10.0.0.46-10.0.0.47",
                )
            }
        })
        .collect()
}

/// Subnet `race`: 10.0.0.0/26 allocating from .10-.49 (40 addresses).
fn race_subnet() -> FlatNetworkSubnet {
    let mut s = FlatNetworkSubnet::new(
        "race",
        FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth0".into(),
            cidr: "10.0.0.0/26".into(),
            ranges: vec![IpRange::new(ip("10.0.0.10"), ip("10.0.0.49"))],
            ..FlatNetworkSubnetSpec::default()
        },
    );
    s.metadata.namespace = Some(SUBNET_NAMESPACE.into());
    s.metadata.finalizers = Some(vec![subnets::FINALIZER.into()]);
    s.status = Some(FlatNetworkSubnetStatus {
        phase: phase::ACTIVE.into(),
        ..FlatNetworkSubnetStatus::default()
    });
    s
}

/// Caches filled from what `server` holds now, with the node `node-1`.
pub(crate) fn caches_from(server: &FakeApiServer) -> Caches {
    caches(server.list(), server.list(), server.list())
}

/// A context whose caches hold what `server` holds now (and node `node-1`).
pub(crate) fn context_from(server: &FakeApiServer, settings: Settings) -> Arc<Context> {
    context(server.client(), caches_from(server), settings)
}

/// Caches filled from what `server` holds now, with exactly `nodes`.
fn caches_from_with_nodes(server: &FakeApiServer, nodes: &[&str]) -> Caches {
    caches_with_nodes(server.list(), server.list(), server.list(), nodes)
}

/// One allocator: `rounds` passes over its (stale) view of the records,
/// the records without an address announced first, as the pod controller
/// announces the records it creates, so that addresses are also reserved
/// ahead.
async fn allocator(server: FakeApiServer, order_seed: u64, rounds: usize) {
    for _ in 0..rounds {
        let ctx = context_from(&server, Settings::default());
        let records: Vec<FlatNetworkIP> = ctx
            .caches
            .records
            .state()
            .iter()
            .map(|r| (**r).clone())
            .collect();
        for record in records.iter().filter(|r| commit::batchable(r)) {
            let key = format!("{}/{}", record.namespace().unwrap(), record.name_any());
            ctx.ledgers
                .expect(&record.spec.subnet, &key, &record.spec.addrs);
        }
        for record in shuffled(&records, order_seed) {
            let _ = ips::reconcile(Arc::new(record), Arc::clone(&ctx)).await;
        }
    }
}

/// The subnet repair running alongside, with the default grace.
async fn repairer(server: FakeApiServer, passes: usize) {
    let ctx = context_from(&server, Settings::default());
    for _ in 0..passes {
        let subnet: FlatNetworkSubnet = server.list::<FlatNetworkSubnet>().remove(0);
        let _ = subnets::reconcile(Arc::new(subnet), Arc::clone(&ctx)).await;
        tokio::task::yield_now().await;
    }
}

/// Every address held by a record, checking no address is held twice and
/// every one is in the subnet's ledger.
fn check_unique(server: &FakeApiServer, seed: u64) -> BTreeSet<IpAddr> {
    let subnet = server.list::<FlatNetworkSubnet>().remove(0);
    let ledger = subnet.status.unwrap_or_default().used_ip;
    let mut held = BTreeSet::new();
    for record in server.list::<FlatNetworkIP>() {
        if let Some(addr) = record.status.and_then(|s| s.addr) {
            assert!(held.insert(addr), "seed {seed}: {addr} handed out twice");
            assert!(
                used_ranges::contains(&ledger, addr),
                "seed {seed}: {addr} held by {} is missing from usedIP {ledger:?}",
                record.metadata.name.unwrap_or_default()
            );
            let v = u32::from(match addr {
                IpAddr::V4(v4) => v4,
                IpAddr::V6(_) => panic!("seed {seed}: IPv6 from an IPv4 subnet"),
            });
            assert!(
                (0x0a00_000a..=0x0a00_0031).contains(&v),
                "seed {seed}: {addr} outside ranges"
            );
        }
    }
    held
}

async fn race(seed: u64) {
    let server = FakeApiServer::new();
    server.insert(&race_subnet());
    let pods = race_pods(44, 4);
    for p in &pods {
        server.insert(p);
    }
    for p in &pods {
        let mut record = record_of(p, "0");
        record.metadata.resource_version = None;
        server.insert(&record);
    }
    let a = allocator(server.with_chaos(seed, 15), seed, 3);
    let b = allocator(
        server.with_chaos(seed ^ 0x5eed, 15),
        seed.rotate_left(17),
        3,
    );
    let r = repairer(server.with_chaos(seed ^ 0xfeed, 0), 6);
    futures::join!(a, b, r);
    check_unique(&server, seed);

    // A calm pass: the repair frees orphaned reservations (no allocation is
    // in flight any more), then one allocator fills the subnet.
    let calm = Settings {
        orphan_grace: Duration::ZERO,
        ..Settings::default()
    };
    let ctx = context_from(&server, calm);
    let subnet = server.list::<FlatNetworkSubnet>().remove(0);
    subnets::reconcile(Arc::new(subnet), ctx).await.unwrap();
    allocator(server.clone(), seed, 1).await;
    let held = check_unique(&server, seed);
    assert_eq!(
        held.len(),
        40,
        "seed {seed}: the subnet is not full after a calm pass"
    );
    let status = server.list::<FlatNetworkSubnet>().remove(0).status.unwrap();
    assert_eq!(status.used_ip_count, 40, "seed {seed}");
}

/// The `race` subnet with the records of `pods`, all announced as the pod
/// controller announces the records it creates.
fn announced(pods: Vec<Pod>) -> (FakeApiServer, Arc<Context>, Vec<FlatNetworkIP>) {
    announced_with(pods, Settings::default())
}

/// [`announced`], with `settings` (reserving ahead is turned on).
fn announced_with(
    pods: Vec<Pod>,
    settings: Settings,
) -> (FakeApiServer, Arc<Context>, Vec<FlatNetworkIP>) {
    let server = FakeApiServer::new();
    server.insert(&race_subnet());
    for p in &pods {
        server.insert(p);
        let mut record = record_of(p, "0");
        record.metadata.resource_version = None;
        server.insert(&record);
    }
    let ahead = Settings {
        reserve_ahead: 128,
        ..settings
    };
    let ctx = context_from(&server, ahead);
    let records: Vec<FlatNetworkIP> = server.list();
    for record in &records {
        let key = format!("{NS}/{}", record.name_any());
        ctx.ledgers
            .expect(&record.spec.subnet, &key, &record.spec.addrs);
    }
    (server, ctx, records)
}

/// `status.usedIPCount` of the server's one subnet.
fn used_ip_count(server: &FakeApiServer) -> i64 {
    server.list::<FlatNetworkSubnet>()[0]
        .status
        .as_ref()
        .unwrap()
        .used_ip_count
}

/// The records the pod controller announces get their addresses reserved
/// ahead by the first ledger write: 20 allocations, one ledger write.
#[tokio::test]
async fn announced_records_share_one_ledger_write() {
    let (server, ctx, records) = announced(race_pods(18, 2));
    let before = server.requests_by_verb();
    for record in records {
        ips::reconcile(Arc::new(record), Arc::clone(&ctx))
            .await
            .unwrap();
    }
    let after = server.requests_by_verb();
    let delta =
        |verb: &str| after.get(verb).copied().unwrap_or(0) - before.get(verb).copied().unwrap_or(0);
    assert_eq!(
        delta("update"),
        20 + 1,
        "20 record status writes and one ledger write"
    );
    assert_eq!(delta("get"), 1, "the ledger is read once");
    let held = check_unique(&server, 0);
    assert_eq!(held.len(), 20);
    let requested: BTreeSet<IpAddr> = ["10.0.0.45", "10.0.0.46"].iter().map(|a| ip(a)).collect();
    assert!(
        requested.is_subset(&held),
        "requested addresses reserved ahead too: {held:?}"
    );
    assert_eq!(
        server.list::<FlatNetworkSubnet>()[0]
            .status
            .as_ref()
            .unwrap()
            .used_ip_count,
        20
    );
}

/// A record deleted before its allocation gives back the address reserved
/// ahead for it at once.
#[tokio::test]
async fn an_announced_record_deleted_first_gives_its_address_back() {
    let (server, ctx, records) = announced(race_pods(2, 0));
    ips::reconcile(Arc::new(records[0].clone()), Arc::clone(&ctx))
        .await
        .unwrap();
    let used = used_ip_count;
    assert_eq!(
        used(&server),
        2,
        "the second record's address is held ahead"
    );
    let mut deleted = records[1].clone();
    deleted.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
    ips::reconcile(Arc::new(deleted), Arc::clone(&ctx))
        .await
        .unwrap();
    assert_eq!(used(&server), 1, "given back with the deletion");
    let key = format!("{NS}/{}", records[1].name_any());
    assert!(!ctx.ledgers.is_expected("race", &key));
}

/// An address held ahead for a record that never comes for it (announced
/// again after its allocation, by a lagging cache) is given back by the
/// timer once the write deadline has passed, with no later batch.
#[tokio::test]
async fn an_address_held_ahead_and_never_taken_is_given_back_after_the_deadline() {
    let deadline = Settings {
        write_deadline: Duration::from_millis(200),
        ..Settings::default()
    };
    let (server, ctx, records) = announced_with(race_pods(2, 0), deadline);
    ips::reconcile(Arc::new(records[0].clone()), Arc::clone(&ctx))
        .await
        .unwrap();
    let used = used_ip_count;
    assert_eq!(used(&server), 2, "the second record's address is held");
    ctx.ledgers.give_back_expired(&ctx).await;
    assert_eq!(used(&server), 2, "still young enough to be taken");
    tokio::time::sleep(Duration::from_millis(250)).await;
    let writes = server.requests_by_verb().get("update").copied();
    ctx.ledgers.give_back_expired(&ctx).await;
    assert_eq!(used(&server), 1, "given back without another allocation");
    assert_eq!(
        server.requests_by_verb().get("update").copied(),
        writes.map(|w| w + 1),
        "in one ledger write"
    );
    ctx.ledgers.give_back_expired(&ctx).await;
    assert_eq!(
        server.requests_by_verb().get("update").copied(),
        writes.map(|w| w + 1),
        "nothing left to give back: no write"
    );
}

/// A record announced again (the pod controller's cache lagging behind its
/// create) and withdrawn while a batch reserves ahead for it leaves
/// nothing held: the withdrawal waits for the batch.
#[tokio::test]
async fn a_record_withdrawn_while_its_address_is_reserved_ahead_holds_nothing() {
    let (server, ctx, records) = announced(race_pods(2, 0));
    let web = format!("{NS}/{}", records[1].name_any());
    // The first record's allocation batch reserves ahead for the second;
    // the second is withdrawn while that batch is in flight.
    let first = ips::reconcile(Arc::new(records[0].clone()), Arc::clone(&ctx));
    let withdraw = async {
        tokio::task::yield_now().await;
        ctx.ledgers.forsake(&ctx, "race", &web).await.unwrap();
    };
    let (first, ()) = futures::join!(first, withdraw);
    first.unwrap();
    assert!(!ctx.ledgers.is_expected("race", &web));
    let status = server.list::<FlatNetworkSubnet>()[0]
        .status
        .clone()
        .unwrap();
    assert_eq!(status.used_ip_count, 1, "only the first record's address");
}

/// A record announced again while an address is held for it (the pod
/// controller's cache lagging behind its own create) keeps that address:
/// no second one is reserved for it, to be lost when it replaced the first
/// among the held addresses.
#[tokio::test]
async fn a_record_announced_again_while_held_gets_no_second_address() {
    let (server, ctx, records) = announced(race_pods(3, 0));
    ips::reconcile(Arc::new(records[0].clone()), Arc::clone(&ctx))
        .await
        .unwrap();
    let again = format!("{NS}/{}", records[1].name_any());
    ctx.ledgers.expect("race", &again, &[]);
    // Any later batch: here a release of nothing.
    let nothing = super::group_commit::Edit::Release { addrs: Vec::new() };
    ctx.ledgers.commit(&ctx, "race", nothing).await.unwrap();
    for record in &records[1..] {
        ips::reconcile(Arc::new(record.clone()), Arc::clone(&ctx))
            .await
            .unwrap();
    }
    let held = check_unique(&server, 0);
    assert_eq!(held.len(), 3);
    let status = server.list::<FlatNetworkSubnet>()[0]
        .status
        .clone()
        .unwrap();
    assert_eq!(
        status.used_ip_count, 3,
        "usedIP holds the three records' addresses and nothing else"
    );
}

/// The pod controller looking at a pod again before its record cache shows
/// the record it has just created (the record's own watch event often
/// wakes it first) does not create the record again, which the API server
/// would refuse with 409: a wasted write, and a withdrawn announcement.
#[tokio::test]
async fn a_pod_looked_at_again_before_its_record_is_cached_gets_one_create() {
    let server = FakeApiServer::new();
    server.insert(&race_subnet());
    let pod = race_pods(1, 0).remove(0);
    server.insert(&pod);
    // Caches as of now: they never show the record.
    let ctx = context_from(&server, Settings::default());
    let cached = Arc::new(CachedPod::from(&pod));
    for _ in 0..2 {
        pods::reconcile(Arc::clone(&cached), Arc::clone(&ctx))
            .await
            .unwrap();
    }
    let creates = server.requests_by_kind();
    assert_eq!(creates.get("create flatnetworkips 201"), Some(&1));
    assert_eq!(
        creates.get("create flatnetworkips 409"),
        None,
        "no second create: {creates:?}"
    );
}

/// Releases arriving while a ledger write is under way do not wait for
/// it: each returns at once, and the writer of that batch writes them all
/// in one ledger write after its own.
#[tokio::test]
async fn releases_queued_behind_a_ledger_write_share_one_write() {
    let (server, ctx, records) = announced(race_pods(10, 0));
    for record in &records {
        ips::reconcile(Arc::new(record.clone()), Arc::clone(&ctx))
            .await
            .unwrap();
    }
    let held: Vec<IpAddr> = check_unique(&server, 0).into_iter().collect();
    assert_eq!(held.len(), 10);
    let used = used_ip_count;
    let writes = |server: &FakeApiServer| {
        server
            .requests_by_kind()
            .get("update flatnetworksubnets/status 200")
            .copied()
    };
    let before = writes(&server);
    // A writer holding the book (here the subnet repair's exclusive hold)
    // while ten releases come.
    let (go, wait) = tokio::sync::oneshot::channel::<()>();
    let holder = ctx.ledgers.exclusive(&ctx, "race", async move {
        let _ = wait.await;
    });
    let releases = async {
        tokio::task::yield_now().await;
        for addr in &held {
            ctx.ledgers
                .release(&ctx, "race", vec![*addr])
                .await
                .unwrap();
        }
        // Every release returned while the book was held.
        assert_eq!(used(&server), 10, "nothing written yet");
        go.send(()).unwrap();
    };
    futures::join!(holder, releases);
    assert_eq!(
        used(&server),
        0,
        "all ten released once the book was let go"
    );
    assert_eq!(
        writes(&server),
        before.map(|w| w + 1),
        "in one ledger write"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn two_allocators_never_hand_out_an_address_twice() {
    for seed in 1..=24 {
        race(seed).await;
    }
}

#[tokio::test]
async fn two_allocators_on_threads_never_hand_out_an_address_twice() {
    // The multi-threaded runtime adds real parallelism to the seeded order.
    for seed in 100..104 {
        race(seed).await;
    }
}

/// A server holding pod `web-1`, its Active record naming 10.0.0.3, and
/// subnet `net1` with the ledger `used`.
fn active_web_1(used: &[(&str, &str)]) -> FakeApiServer {
    let server = FakeApiServer::new();
    let web = pod("web-1").flat();
    server.insert(&web);
    let mut record = record_of(&web, "0");
    record.metadata.resource_version = None;
    record.status = Some(FlatNetworkIPStatus {
        phase: phase::ACTIVE.into(),
        addr: Some(ip("10.0.0.3")),
        ..FlatNetworkIPStatus::default()
    });
    server.insert(&record);
    let mut net = subnet(used, "0");
    net.metadata.resource_version = None;
    server.insert(&net);
    server
}

#[tokio::test]
async fn the_repair_frees_only_unclaimed_addresses_after_the_grace() {
    let server = active_web_1(&[("10.0.0.1", "10.0.0.5")]);

    let reconcile = |settings: Settings| {
        let server = server.clone();
        async move {
            let ctx = context_from(&server, settings);
            let subnet = server.list::<FlatNetworkSubnet>().remove(0);
            subnets::reconcile(Arc::new(subnet), ctx).await.unwrap();
            server.list::<FlatNetworkSubnet>().remove(0).status.unwrap()
        }
    };
    let kept = reconcile(Settings::default()).await;
    assert_eq!(
        kept.used_ip,
        [IpRange::new(ip("10.0.0.1"), ip("10.0.0.5"))],
        "unclaimed .2, .4, .5 are kept within the grace"
    );
    let freed = reconcile(Settings {
        orphan_grace: Duration::ZERO,
        ..Settings::default()
    })
    .await;
    assert_eq!(
        freed.used_ip,
        [
            IpRange::new(ip("10.0.0.1"), ip("10.0.0.1")),
            IpRange::new(ip("10.0.0.3"), ip("10.0.0.3"))
        ]
    );
    assert_eq!((freed.used_ip_count, freed.total_ip_count), (2, 5));
    assert_eq!(freed.phase, phase::ACTIVE);
    let ready = freed
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("True", "Active")
    );
    let _ = commit::CONTENTION_RETRY;
}

/// Repairs the (first) subnet of `server` with no grace and a cache that
/// has seen no record.
async fn repair_with_a_blind_cache(server: &FakeApiServer) {
    let calm = Settings {
        orphan_grace: Duration::ZERO,
        ..Settings::default()
    };
    let stale = caches(Vec::new(), server.list(), server.list());
    let ctx = context(server.client(), stale, calm);
    // The first pass sets the subnet's labels, the second its status.
    for _ in 0..2 {
        let subnet = server.list::<FlatNetworkSubnet>().remove(0);
        subnets::reconcile(Arc::new(subnet), Arc::clone(&ctx))
            .await
            .unwrap();
    }
}

/// The repair's cache lags behind a record write (its watch was cut, say):
/// an address the ledger holds and only that cache says nobody names is
/// not freed, however long it has looked unclaimed, while the records read
/// from the API server name it.
#[tokio::test]
async fn the_repair_frees_no_address_a_record_names_that_its_cache_has_not_seen() {
    let server = active_web_1(&[("10.0.0.1", "10.0.0.5")]);
    repair_with_a_blind_cache(&server).await;
    assert_eq!(
        ledger(&server),
        [
            IpRange::new(ip("10.0.0.1"), ip("10.0.0.1")),
            IpRange::new(ip("10.0.0.3"), ip("10.0.0.3"))
        ],
        "web-1's .3 was freed on the word of a stale cache"
    );
}

/// The repair frees an unclaimed address, and another replica reserves it
/// again at once (its record write is on its way): that reservation gets a
/// whole grace, the clock of the freed entry does not carry over.
#[tokio::test]
async fn an_address_freed_and_reserved_again_gets_a_new_grace() {
    let server = active_web_1(&[("10.0.0.1", "10.0.0.4")]);
    let grace = Duration::from_millis(300);
    let settings = Settings {
        orphan_grace: grace,
        ..Settings::default()
    };
    let ctx = context_from(&server, settings);
    let repair = || async {
        let subnet = server.list::<FlatNetworkSubnet>().remove(0);
        subnets::reconcile(Arc::new(subnet), Arc::clone(&ctx))
            .await
            .unwrap();
    };
    // Labels, then the first sight of the unclaimed .2 and .4.
    repair().await;
    repair().await;
    assert_eq!(
        ledger(&server),
        [IpRange::new(ip("10.0.0.1"), ip("10.0.0.4"))]
    );
    tokio::time::sleep(grace).await;
    repair().await;
    let freed = [
        IpRange::new(ip("10.0.0.1"), ip("10.0.0.1")),
        IpRange::new(ip("10.0.0.3"), ip("10.0.0.3")),
    ];
    assert_eq!(ledger(&server), freed);
    let mut net = server.list::<FlatNetworkSubnet>().remove(0);
    let status = net.status.as_mut().unwrap();
    status.used_ip = vec![
        IpRange::new(ip("10.0.0.1"), ip("10.0.0.1")),
        IpRange::new(ip("10.0.0.3"), ip("10.0.0.4")),
    ];
    server.insert(&net);
    repair().await;
    assert_eq!(
        ledger(&server),
        [
            IpRange::new(ip("10.0.0.1"), ip("10.0.0.1")),
            IpRange::new(ip("10.0.0.3"), ip("10.0.0.4"))
        ],
        "the new reservation of .4 was freed at once"
    );
}

/// The fake API server with `hook` run once, after the first request whose
/// method and path match, before its answer reaches the client: a way to
/// make another controller act at an exact point of a reconcile.
#[derive(Clone)]
struct Hooked {
    server: FakeApiServer,
    method: http::Method,
    path: String,
    hook: Arc<std::sync::Mutex<Option<futures::future::BoxFuture<'static, ()>>>>,
}

impl tower::Service<http::Request<kube::client::Body>> for Hooked {
    type Response = http::Response<super::fake_api::ReplyBody>;
    type Error = std::convert::Infallible;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<kube::client::Body>) -> Self::Future {
        let hit = request.method() == self.method && request.uri().path() == self.path;
        let hook = if hit {
            self.hook.lock().unwrap().take()
        } else {
            None
        };
        let mut server = self.server.clone();
        Box::pin(async move {
            let reply = server.call(request).await;
            if let Some(hook) = hook {
                hook.await;
            }
            reply
        })
    }
}

/// The repair-vs-release race: the subnet repair confirms that a live
/// record names an address the ledger lacks, the record is deleted and its
/// release finds the address absent (nothing to do), then the repair writes
/// the address back: held by nobody until the orphan grace. The repair's
/// confirmation and write now exclude releases of the subnet.
#[tokio::test]
async fn a_release_during_the_repair_confirmation_is_not_undone() {
    let server = active_web_1(&[("10.0.0.1", "10.0.0.1")]);
    // The first reconcile writes the subnet's labels and stops there.
    let plain = context_from(&server, Settings::default());
    let net = server.list::<FlatNetworkSubnet>().remove(0);
    subnets::reconcile(Arc::new(net), plain).await.unwrap();

    let hook = Arc::new(std::sync::Mutex::new(None));
    let hooked = Hooked {
        server: server.clone(),
        method: http::Method::GET,
        path: format!("{RECORDS}/web-1"),
        hook: Arc::clone(&hook),
    };
    let ctx = context(
        kube::Client::new(hooked, "default"),
        caches_from(&server),
        Settings::default(),
    );
    // Right after the repair reads the record: the pod goes, the record is
    // deleted and its controller releases the address.
    let released = {
        let (server, ctx) = (server.clone(), Arc::clone(&ctx));
        let (done_tx, done_rx) = tokio::sync::oneshot::channel();
        *hook.lock().unwrap() = Some(Box::pin(async move {
            assert!(server.delete::<FlatNetworkIP>(NS, "web-1"));
            let deleted = server.list::<FlatNetworkIP>().remove(0);
            tokio::spawn(async move {
                let result = ips::reconcile(Arc::new(deleted), ctx).await;
                let _ = done_tx.send(result.map(|_| ()).map_err(|e| e.to_string()));
            });
            // Long enough for the release to finish, unless it must wait.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }) as futures::future::BoxFuture<'static, ()>);
        done_rx
    };
    let net = server.list::<FlatNetworkSubnet>().remove(0);
    subnets::reconcile(Arc::new(net), Arc::clone(&ctx))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), released)
        .await
        .expect("the repair read the record and the release ran")
        .unwrap()
        .unwrap();
    assert!(server.list::<FlatNetworkIP>().is_empty(), "record gone");
    assert_eq!(
        ledger(&server),
        [IpRange::new(ip("10.0.0.1"), ip("10.0.0.1"))],
        "the released address is not written back"
    );
}

/// The reported leak: the subnet controller rebuilt `usedIP` from a cache
/// that still showed records whose addresses had just been released (being
/// deleted, or not even that yet) and wrote the addresses back, where only
/// the orphan repair freed them, after its grace.
#[tokio::test]
async fn released_addresses_stay_free_whatever_the_caches_show() {
    let server = FakeApiServer::new();
    server.insert(&race_subnet());
    let pods = race_pods(6, 0);
    for p in &pods {
        server.insert(p);
        let mut record = record_of(p, "0");
        record.metadata.resource_version = None;
        server.insert(&record);
    }
    allocator(server.clone(), 1, 1).await;
    assert_eq!(check_unique(&server, 1).len(), 6);
    // A cache from before the deletions, and one showing them.
    let before = caches_from(&server);
    for gone in ["p0", "p1", "p2"] {
        assert!(server.delete::<FlatNetworkIP>(NS, gone));
    }
    let deleting = caches_from(&server);
    let ctx = context(server.client(), deleting.clone(), Settings::default());
    for record in server.list::<FlatNetworkIP>() {
        if record.metadata.deletion_timestamp.is_some() {
            ips::reconcile(Arc::new(record), Arc::clone(&ctx))
                .await
                .unwrap();
        }
    }
    let live: Vec<IpAddr> = server
        .list::<FlatNetworkIP>()
        .into_iter()
        .filter_map(|r| r.status?.addr)
        .collect();
    assert_eq!(live.len(), 3, "three records are gone");
    for stale in [deleting, before] {
        let ctx = context(server.client(), stale, Settings::default());
        let subnet = server.list::<FlatNetworkSubnet>().remove(0);
        subnets::reconcile(Arc::new(subnet), ctx).await.unwrap();
        assert_eq!(
            ledger(&server),
            used_ranges::compress(live.iter().copied()),
            "usedIP holds exactly the addresses of the live records"
        );
    }
    let status = server.list::<FlatNetworkSubnet>().remove(0).status.unwrap();
    assert_eq!(status.used_ip_count, 3);
}

/// A subnet of 65,536 addresses with every other one used: the worst case
/// of the range encoding of `usedIP`, which then holds a cover and
/// `usedIPCompact` the exact ranges (see `docs/ipam.md`, "Ledger size").
/// The fake refuses objects larger than etcd does; the ledger must still
/// be written and read back.
async fn fragmented_ledger_takes_writes(cidr: &str, first: IpAddr) {
    let (family_v4, base) = match first {
        IpAddr::V4(v4) => (true, u128::from(u32::from(v4))),
        IpAddr::V6(v6) => (false, u128::from(v6)),
    };
    let at = |offset: u128| -> IpAddr {
        if family_v4 {
            IpAddr::from(std::net::Ipv4Addr::from(
                u32::try_from(base + offset).unwrap(),
            ))
        } else {
            IpAddr::from(std::net::Ipv6Addr::from(base + offset))
        }
    };
    let used: Vec<IpRange> = (2..65_534)
        .step_by(2)
        .map(|o| IpRange::new(at(o), at(o)))
        .collect();
    let server = FakeApiServer::new();
    let mut net = race_subnet();
    net.metadata.name = Some("race".into());
    net.spec.cidr = cidr.into();
    net.spec.ranges = Vec::new();
    net.spec.gateway = Some(at(1));
    net.status.as_mut().unwrap().set_used_ranges(used.clone());
    server.insert(&net);
    let stored = serde_json::to_vec(&server.list::<FlatNetworkSubnet>()[0]).unwrap();
    assert!(stored.len() < super::fake_api::MAX_OBJECT_BYTES / 3);
    println!(
        "{cidr}: {} ranges in usedIP, subnet object {} bytes (etcd limit {})",
        used.len(),
        stored.len(),
        super::fake_api::MAX_OBJECT_BYTES
    );
    let web = pod("web-1")
        .flat()
        .annotated("flatnetwork.pandaria.io/subnet", "race");
    server.insert(&web);
    let mut record = record_of(&web, "0");
    record.metadata.resource_version = None;
    server.insert(&record);
    allocator(server.clone(), 1, 1).await;
    let held = stored_record(&server, "web-1")
        .and_then(|r| r.status?.addr)
        .expect("the record got an address");
    assert_eq!(held, at(3), "the first free address");
    let written = ledger(&server);
    assert!(used_ranges::contains(&written, held));
    assert_eq!(written.len(), used.len() - 1, "3 joined 2 and 4");
    let status = server.list::<FlatNetworkSubnet>().remove(0).status.unwrap();
    assert!(status.used_ip_compact.is_some(), "still compact");
    assert_eq!(
        status.used_ip_count,
        32_767 + 1,
        "the gateway and 32,767 records"
    );
}

#[tokio::test]
async fn a_fully_fragmented_ipv4_slash_16_ledger_is_written() {
    fragmented_ledger_takes_writes("10.16.0.0/16", ip("10.16.0.0")).await;
}

#[tokio::test]
async fn a_fully_fragmented_ipv6_slash_112_ledger_is_written() {
    fragmented_ledger_takes_writes("fd00:16::/112", ip("fd00:16::")).await;
}

#[tokio::test]
async fn a_subnet_in_use_is_not_deleted() {
    let server = FakeApiServer::new();
    let web = pod("web-1").flat();
    let mut record = record_of(&web, "0");
    record.metadata.resource_version = None;
    server.insert(&record);
    let mut net = subnet(&[], "0");
    net.metadata.resource_version = None;
    server.insert(&net);
    let subnets_api: kube::Api<FlatNetworkSubnet> =
        kube::Api::namespaced(server.client(), SUBNET_NAMESPACE);
    subnets_api
        .delete("net1", &Default::default())
        .await
        .unwrap();

    let ctx = context_from(&server, Settings::default());
    let deleting = server.list::<FlatNetworkSubnet>().remove(0);
    let action = subnets::reconcile(Arc::new(deleting), ctx).await.unwrap();
    assert_eq!(action, Action::requeue(Duration::from_secs(30)));
    let blocked = server.list::<FlatNetworkSubnet>().remove(0);
    let ready = blocked.status.unwrap().conditions;
    assert_eq!(ready[0].reason, "InUse");
    assert!(
        ready[0].message.contains("shop/web-1"),
        "{}",
        ready[0].message
    );

    // The record goes: the subnet goes.
    let records_api: kube::Api<FlatNetworkIP> = kube::Api::namespaced(server.client(), NS);
    records_api
        .patch(
            "web-1",
            &Default::default(),
            &kube::api::Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .unwrap();
    records_api
        .delete("web-1", &Default::default())
        .await
        .unwrap();
    let ctx = context_from(&server, Settings::default());
    let deleting = server.list::<FlatNetworkSubnet>().remove(0);
    subnets::reconcile(Arc::new(deleting), ctx).await.unwrap();
    assert!(server.list::<FlatNetworkSubnet>().is_empty());
}

#[tokio::test]
async fn an_invalid_subnet_is_failed_with_the_reason() {
    let server = FakeApiServer::new();
    let mut net = subnet(&[], "0");
    net.metadata.resource_version = None;
    net.spec.gateway = Some(ip("10.9.9.9"));
    net.status = None;
    server.insert(&net);
    let ctx = context_from(&server, Settings::default());
    subnets::reconcile(Arc::new(server.list::<FlatNetworkSubnet>().remove(0)), ctx)
        .await
        .unwrap();
    let status = server.list::<FlatNetworkSubnet>().remove(0).status.unwrap();
    assert_eq!(status.phase, phase::FAILED);
    assert!(
        status.failure_message.contains("gateway"),
        "{}",
        status.failure_message
    );
    let valid = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Valid")
        .unwrap();
    assert_eq!(
        (valid.status.as_str(), valid.reason.as_str()),
        ("False", "Invalid")
    );
}

#[tokio::test]
async fn a_new_subnet_gets_labels_canonical_cidr_and_finalizer_then_status() {
    let server = FakeApiServer::new();
    let mut net = subnet(&[], "0");
    net.metadata.resource_version = None;
    net.metadata.finalizers = None;
    net.spec.cidr = "10.0.0.5/29".into();
    net.status = None;
    server.insert(&net);
    for _ in 0..2 {
        let ctx = context_from(&server, Settings::default());
        subnets::reconcile(Arc::new(server.list::<FlatNetworkSubnet>().remove(0)), ctx)
            .await
            .unwrap();
    }
    let done = server.list::<FlatNetworkSubnet>().remove(0);
    assert_eq!(done.spec.cidr, "10.0.0.0/29");
    assert_eq!(done.labels()["master"], "eth0");
    assert_eq!(done.labels()["vlan"], "0");
    assert_eq!(done.labels()["flatMode"], "macvlan");
    assert_eq!(done.finalizers(), [subnets::FINALIZER]);
    let status = done.status.unwrap();
    assert_eq!(status.phase, phase::ACTIVE);
    assert_eq!(
        status.used_ip,
        [IpRange::new(ip("10.0.0.1"), ip("10.0.0.1"))]
    );
    assert_eq!((status.used_ip_count, status.total_ip_count), (1, 5));
    assert_eq!(status.gateway, done.spec.gateway, "the gateway in effect");
    assert_eq!(status.gateway, Some(ip("10.0.0.1")));
}

/// Pod `web-0` of StatefulSet `web` (uid `uid-set`) with `uid`, asking for
/// fixed MAC `mac` when given.
fn set_pod(uid: &str, mac: Option<&str>) -> Pod {
    let mut p = pod("web-0").flat();
    if let Some(mac) = mac {
        p = p.annotated("flatnetwork.pandaria.io/mac", mac);
    }
    p.metadata.uid = Some(uid.into());
    p.metadata.owner_references = Some(vec![
        k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
            api_version: "apps/v1".into(),
            kind: "StatefulSet".into(),
            name: "web".into(),
            uid: "uid-set".into(),
            controller: Some(true),
            block_owner_deletion: Some(true),
        },
    ]);
    p
}

/// A server with the empty subnet `net1` and StatefulSet `web`.
fn statefulset_cluster() -> FakeApiServer {
    let server = FakeApiServer::new();
    let mut net = subnet(&[], "0");
    net.metadata.resource_version = None;
    server.insert(&net);
    // The owner exists, or the garbage collector takes the record.
    let set: k8s_openapi::api::apps::v1::StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "web", "namespace": NS, "uid": "uid-set"}
    }))
    .unwrap();
    server.insert(&set);
    server
}

/// Stores `p` (replacing a pod of its name), runs the pod controller and
/// then the FlatNetworkIP controller on its record; the record as stored.
async fn pod_cycle(server: &FakeApiServer, p: Pod) -> FlatNetworkIP {
    server.insert(&p);
    let ctx = context_from(server, Settings::default());
    pods::reconcile(Arc::new(CachedPod::from(&p)), Arc::clone(&ctx))
        .await
        .unwrap();
    let ctx = context_from(server, Settings::default());
    let record = stored_record(server, &p.name_any()).unwrap();
    ips::reconcile(Arc::new(record), ctx).await.unwrap();
    stored_record(server, &p.name_any()).unwrap()
}

#[tokio::test]
async fn a_statefulset_pod_gets_its_address_back() {
    let server = statefulset_cluster();
    // An earlier pod took .2, then a filler took .3.
    let before = pod_cycle(&server, set_pod("uid-first", None)).await;
    assert_eq!(before.owner_references()[0].kind, "StatefulSet");
    let filler = pod_cycle(&server, pod("filler").flat()).await;
    assert_eq!(filler.status.unwrap().addr, Some(ip("10.0.0.3")));
    // The pod is replaced (new uid): same record, same address, Pending.
    let after = pod_cycle(&server, set_pod("uid-second", None)).await;
    assert_eq!(after.spec.pod_id, "uid-second");
    let status = after.status.unwrap();
    assert_eq!(status.addr, before.status.unwrap().addr);
    assert_eq!(status.addr, Some(ip("10.0.0.2")));
    assert_eq!(status.phase, phase::PENDING);
}

/// The fixed MACs the subnet's `usedMac` and the MAC ledger hold.
fn held_macs(server: &FakeApiServer) -> (Vec<String>, Vec<String>) {
    let used = server
        .list::<FlatNetworkSubnet>()
        .remove(0)
        .status
        .unwrap_or_default()
        .used_mac;
    let claimed = mac_claims(server)
        .into_iter()
        .map(|(mac, _)| mac.replace('-', ":"))
        .collect();
    (used, claimed)
}

/// A StatefulSet pod that comes back asking for another fixed MAC, or for
/// none, gets what it asks: its record keeps the address, drops the MAC of
/// the pod before and gives that MAC's claims back.
#[tokio::test]
async fn a_statefulset_pod_back_with_another_mac_request_gets_it() {
    const FIRST: &str = "02:00:00:00:00:0a";
    const SECOND: &str = "02:00:00:00:00:0b";
    let server = statefulset_cluster();
    let before = pod_cycle(&server, set_pod("uid-first", Some(FIRST))).await;
    let status = before.status.unwrap();
    assert_eq!(status.mac, FIRST);
    let addr = status.addr;
    assert_eq!(held_macs(&server), (vec![FIRST.into()], vec![FIRST.into()]));

    let second = pod_cycle(&server, set_pod("uid-second", Some(SECOND))).await;
    let status = second.status.unwrap();
    assert_eq!((status.mac.as_str(), status.addr), (SECOND, addr));
    assert_eq!(status.phase, phase::PENDING);
    assert_eq!(
        held_macs(&server),
        (vec![SECOND.into()], vec![SECOND.into()])
    );

    let third = pod_cycle(&server, set_pod("uid-third", None)).await;
    let status = third.status.unwrap();
    assert_eq!((status.mac.as_str(), status.addr), ("", addr));
    assert_eq!(held_macs(&server), (vec![], vec![]));
}

/// A success forgets the failures of the pod and of the subnet, so their
/// next failure is retried soon again and the backoff holds no entry for
/// objects that are fine.
#[tokio::test]
async fn pod_and_subnet_successes_reset_their_backoff() {
    let server = active_web_1(&[("10.0.0.1", "10.0.0.1")]);
    let ctx = context_from(&server, Settings::default());
    ctx.backoff.next("subnet/net1");
    ctx.backoff.next("pod/shop/web-1");
    assert_eq!(ctx.backoff.len(), 2);
    let net = server.list::<FlatNetworkSubnet>().remove(0);
    subnets::reconcile(Arc::new(net), Arc::clone(&ctx))
        .await
        .unwrap();
    let web = server.list::<Pod>().remove(0);
    pods::reconcile(Arc::new(CachedPod::from(&web)), Arc::clone(&ctx))
        .await
        .unwrap();
    assert!(ctx.backoff.is_empty(), "{} entries left", ctx.backoff.len());
}

#[test]
fn backoff_doubles_and_resets() {
    let backoff = Backoff::default();
    assert_eq!(backoff.next("a"), Duration::from_secs(1));
    assert_eq!(backoff.next("a"), Duration::from_secs(2));
    assert_eq!(backoff.next("a"), Duration::from_secs(4));
    assert_eq!(backoff.next("b"), Duration::from_secs(1));
    backoff.reset("a");
    assert_eq!(backoff.next("a"), Duration::from_secs(1));
    for _ in 0..20 {
        backoff.next("c");
    }
    assert_eq!(backoff.next("c"), Duration::from_secs(300));
}

// ---------------------------------------------------------------------------
// Records of pods on deleted nodes.

/// A server with subnet `net1` whose ledger holds .1-.3, and the Active
/// record of `pod` holding .3 on `node-1`.
fn node_cluster(pod: &Pod) -> FakeApiServer {
    let server = FakeApiServer::new();
    let mut net = subnet(&[("10.0.0.1", "10.0.0.3")], "0");
    net.metadata.resource_version = None;
    server.insert(&net);
    let mut record = record_of(pod, "0");
    record.metadata.resource_version = None;
    record.status = Some(FlatNetworkIPStatus {
        phase: phase::ACTIVE.into(),
        addr: Some(ip("10.0.0.3")),
        node: "node-1".into(),
        ..FlatNetworkIPStatus::default()
    });
    server.insert(&record);
    server
}

fn stored_record(server: &FakeApiServer, name: &str) -> Option<FlatNetworkIP> {
    server
        .list::<FlatNetworkIP>()
        .into_iter()
        .find(|r| r.name_any() == name)
}

fn ledger(server: &FakeApiServer) -> Vec<IpRange> {
    server
        .list::<FlatNetworkSubnet>()
        .remove(0)
        .status
        .unwrap()
        .used_ranges()
}

/// Reconciles every stored record once, with the caches as they are now.
async fn reconcile_records(server: &FakeApiServer, ctx: &Arc<Context>) -> Vec<Action> {
    let mut actions = Vec::new();
    for record in server.list::<FlatNetworkIP>() {
        actions.push(
            ips::reconcile(Arc::new(record), Arc::clone(ctx))
                .await
                .unwrap(),
        );
    }
    actions
}

fn gone_now() -> Settings {
    Settings {
        node_gone_grace: Duration::ZERO,
        ..Settings::default()
    }
}

#[tokio::test]
async fn records_of_a_deleted_node_whose_pods_are_gone_are_released() {
    let web = pod("web-1").flat();
    let server = node_cluster(&web);
    // The node and its pod are gone: the record is deleted, then its
    // finalizer gives the address back.
    for _ in 0..2 {
        let ctx = context(
            server.client(),
            caches_from_with_nodes(&server, &[]),
            gone_now(),
        );
        reconcile_records(&server, &ctx).await;
    }
    assert!(stored_record(&server, "web-1").is_none());
    assert_eq!(
        ledger(&server),
        [IpRange::new(ip("10.0.0.1"), ip("10.0.0.2"))]
    );
}

#[tokio::test]
async fn a_pod_left_on_a_deleted_node_gives_its_address_back_in_place() {
    // The pod object stays (its deletion is held by a finalizer) while its
    // node is gone.
    let mut web = pod("web-1").flat();
    web.metadata.deletion_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
    web.metadata.finalizers = Some(vec!["example.com/hold".into()]);
    let server = node_cluster(&web);
    server.insert(&web);
    let ctx = context(
        server.client(),
        caches_from_with_nodes(&server, &[]),
        gone_now(),
    );
    let actions = reconcile_records(&server, &ctx).await;
    assert_eq!(actions, [Action::await_change()]);

    let record = stored_record(&server, "web-1").expect("the record stays");
    let status = record.status.unwrap();
    assert_eq!(status.addr, None);
    assert_eq!(status.phase, phase::FAILED);
    let ready = status
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .unwrap();
    assert_eq!(ready.reason, "NodeGone");
    assert!(
        status.failure_message.contains("node-1"),
        "{}",
        status.failure_message
    );
    assert_eq!(
        ledger(&server),
        [IpRange::new(ip("10.0.0.1"), ip("10.0.0.2"))]
    );
    assert!(
        ctx.metrics.render().lines().any(
            |l| l == r#"flatnet_operator_flatnetworkips_collected_total{reason="node_gone"} 1"#
        ),
        "{}",
        ctx.metrics.render()
    );
    let events = server.list::<k8s_openapi::api::events::v1::Event>();
    assert!(
        events
            .iter()
            .any(|e| e.reason.as_deref() == Some("NodeGone")
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("web-1")),
        "{events:?}"
    );

    // Looked at again while the node is still gone: no new allocation.
    let ctx = context(
        server.client(),
        caches_from_with_nodes(&server, &[]),
        gone_now(),
    );
    reconcile_records(&server, &ctx).await;
    assert_eq!(
        stored_record(&server, "web-1")
            .unwrap()
            .status
            .unwrap()
            .addr,
        None
    );
    assert_eq!(
        ledger(&server),
        [IpRange::new(ip("10.0.0.1"), ip("10.0.0.2"))]
    );
}

#[tokio::test]
async fn a_statefulset_pod_moved_to_another_node_keeps_its_address() {
    let set_pod = |uid: &str, node: &str| {
        let mut p = set_pod(uid, None);
        p.spec.as_mut().unwrap().node_name = Some(node.into());
        p
    };
    let old = set_pod("uid-old", "node-1");
    let server = node_cluster(&old);
    // node-1 is deleted; the StatefulSet's new web-0 runs on node-2.
    let moved = set_pod("uid-new", "node-2");
    server.insert(&moved);
    let ctx = context(
        server.client(),
        caches_from_with_nodes(&server, &["node-2"]),
        gone_now(),
    );
    pods::reconcile(Arc::new(CachedPod::from(&moved)), Arc::clone(&ctx))
        .await
        .unwrap();
    let ctx = context(
        server.client(),
        caches_from_with_nodes(&server, &["node-2"]),
        gone_now(),
    );
    reconcile_records(&server, &ctx).await;

    let record = stored_record(&server, "web-0").expect("kept");
    assert_eq!(record.spec.pod_id, "uid-new");
    assert_eq!(record.labels()["flatnetwork.pandaria.io/node"], "node-2");
    let status = record.status.unwrap();
    assert_eq!(
        status.addr,
        Some(ip("10.0.0.3")),
        "same address on the new node"
    );
    assert_eq!(status.phase, phase::PENDING, "for node-2 to set up");
    assert!(used_ranges::contains(&ledger(&server), ip("10.0.0.3")));
}

#[tokio::test]
async fn a_pod_on_a_node_recreated_within_the_grace_keeps_its_address() {
    let web = pod("web-1").flat();
    let server = node_cluster(&web);
    server.insert(&web);
    let settings = Settings {
        node_gone_grace: Duration::from_secs(3600),
        ..Settings::default()
    };
    let clock = Arc::new(super::nodes::NodeClock::default());
    let with_nodes = |nodes: &[&str]| {
        let mut ctx = Arc::try_unwrap(context(
            server.client(),
            caches_from_with_nodes(&server, nodes),
            settings.clone(),
        ))
        .ok()
        .unwrap();
        ctx.nodes = Arc::clone(&clock);
        Arc::new(ctx)
    };
    // Deleted: the record waits for the rest of the grace.
    let waiting = reconcile_records(&server, &with_nodes(&[])).await;
    assert_eq!(waiting.len(), 1);
    assert_ne!(waiting[0], Action::await_change());
    assert_ne!(waiting[0], Action::requeue(settings.resync));
    // The kubelet registers the node again.
    let back = reconcile_records(&server, &with_nodes(&["node-1"])).await;
    assert_eq!(back, [Action::requeue(settings.resync)]);
    // Missing again later: a new grace period starts, nothing is released.
    reconcile_records(&server, &with_nodes(&[])).await;
    let status = stored_record(&server, "web-1").unwrap().status.unwrap();
    assert_eq!(status.addr, Some(ip("10.0.0.3")));
    assert_eq!(status.phase, phase::ACTIVE);
    assert_eq!(
        ledger(&server),
        [IpRange::new(ip("10.0.0.1"), ip("10.0.0.3"))]
    );
}

// ---------------------------------------------------------------------------
// One fixed MAC requested in two sibling subnets at once.

const RACED_MAC: &str = "02:00:00:00:00:01";

/// Active subnet `name` on `eth0` (no VLAN): `cidr`, no gateway.
fn sibling_subnet(name: &str, cidr: &str) -> FlatNetworkSubnet {
    let mut s = FlatNetworkSubnet::new(
        name,
        FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth0".into(),
            cidr: cidr.into(),
            ..FlatNetworkSubnetSpec::default()
        },
    );
    s.metadata.namespace = Some(SUBNET_NAMESPACE.into());
    s.metadata.finalizers = Some(vec![subnets::FINALIZER.into()]);
    s.status = Some(FlatNetworkSubnetStatus {
        phase: phase::ACTIVE.into(),
        ..FlatNetworkSubnetStatus::default()
    });
    s
}

/// Pod `name` in `subnet` asking for [`RACED_MAC`], and its record.
fn mac_pod(name: &str, subnet: &str) -> (Pod, FlatNetworkIP) {
    pod_and_record(name, subnet, RACED_MAC)
}

/// Pod `name` in `subnet` asking for the fixed MAC `mac` (none when
/// empty), and its record, created at the epoch.
fn pod_and_record(name: &str, subnet: &str, mac: &str) -> (Pod, FlatNetworkIP) {
    let mut p = pod(name)
        .flat()
        .annotated("flatnetwork.pandaria.io/subnet", subnet);
    if !mac.is_empty() {
        p = p.annotated("flatnetwork.pandaria.io/mac", mac);
    }
    let request = parse_pod_request(subnet, "auto", mac).unwrap();
    let mut record = records::desired_record(&CachedPod::from(&p), &RecordContext::plain(&request));
    record.metadata.creation_timestamp = Some(Time(Timestamp::UNIX_EPOCH));
    (p, record)
}

/// The claims of the `eth0` ledger as stored (not the MAC pool's memory).
fn mac_claims(server: &FakeApiServer) -> Vec<(String, String)> {
    server
        .list::<k8s_openapi::api::core::v1::ConfigMap>()
        .into_iter()
        .flat_map(|m| m.data.unwrap_or_default())
        .filter(|(key, _)| !key.starts_with("pool."))
        .collect()
}

/// Repairs both subnets (and so the MAC ledger) with no grace.
async fn calm_repair(server: &FakeApiServer) {
    let calm = Settings {
        orphan_grace: Duration::ZERO,
        ..Settings::default()
    };
    let ctx = context_from(server, calm);
    // The first pass sets the subnets' labels, the second their status.
    for _ in 0..2 {
        for subnet in server.list::<FlatNetworkSubnet>() {
            subnets::reconcile(Arc::new(subnet), Arc::clone(&ctx))
                .await
                .unwrap();
        }
    }
}

async fn mac_race(seed: u64) {
    let server = FakeApiServer::new();
    server.insert(&sibling_subnet("left", "10.0.1.0/29"));
    server.insert(&sibling_subnet("right", "10.0.2.0/29"));
    if seed % 2 == 1 {
        // An existing ledger: claims are replaces, not creates.
        server.insert(&k8s_openapi::api::core::v1::ConfigMap {
            metadata: ObjectMeta {
                name: Some(super::mac_ledger::ledger_name(
                    &flatnet_k8s::validation::ParentLink {
                        master: "eth0".into(),
                        vlan: 0,
                    },
                )),
                namespace: Some(SUBNET_NAMESPACE.into()),
                ..ObjectMeta::default()
            },
            ..Default::default()
        });
    }
    for (name, subnet) in [("pa", "left"), ("pb", "right")] {
        let (p, record) = mac_pod(name, subnet);
        server.insert(&p);
        server.insert(&record);
    }
    let a = allocator(server.with_chaos(seed, 15), seed, 2);
    let b = allocator(server.with_chaos(seed ^ 0x5eed, 15), seed.rotate_left(9), 2);
    futures::join!(a, b);
    let raced = ip_mac_holders(&server);
    assert!(
        raced.len() <= 1,
        "seed {seed}: {RACED_MAC} held by {raced:?}"
    );

    // Calm: orphaned claims and reservations go, then both are looked at
    // again; exactly one pod has the MAC.
    calm_repair(&server).await;
    allocator(server.clone(), seed, 1).await;
    let holders = ip_mac_holders(&server);
    assert_eq!(holders.len(), 1, "seed {seed}: holders {holders:?}");
    if let Some(first) = raced.first() {
        assert_eq!(first, &holders[0], "seed {seed}: the MAC moved");
    }
    let winner = &holders[0];
    let loser = server
        .list::<FlatNetworkIP>()
        .into_iter()
        .find(|r| &r.name_any() != winner)
        .unwrap();
    let loser_status = loser.status.clone().unwrap_or_default();
    assert_eq!(loser_status.phase, phase::FAILED, "seed {seed}");
    assert!(
        loser_status.failure_message.contains(RACED_MAC),
        "seed {seed}: {}",
        loser_status.failure_message
    );
    assert_eq!(loser_status.addr, None, "seed {seed}");

    // The ledger: one MAC, claimed only by the winner.
    let claims = mac_claims(&server);
    assert_eq!(claims.len(), 1, "seed {seed}: {claims:?}");
    assert_eq!(claims[0].0, "02-00-00-00-00-01");
    for claim in claims[0].1.split_whitespace() {
        assert!(
            claim.starts_with(&format!("{NS}/{winner}#")),
            "seed {seed}: {claim} in {claims:?}"
        );
    }
    // No address or MAC left behind in either subnet.
    for subnet in server.list::<FlatNetworkSubnet>() {
        let status = subnet.status.unwrap();
        let held: Vec<FlatNetworkIP> = server
            .list::<FlatNetworkIP>()
            .into_iter()
            .filter(|r| r.spec.subnet == subnet.metadata.name.clone().unwrap())
            .filter(|r| r.status.as_ref().is_some_and(|s| s.addr.is_some()))
            .collect();
        assert_eq!(
            status.used_ip_count,
            i64::try_from(held.len()).unwrap(),
            "seed {seed}: {:?} holds {:?}; records {:#?}",
            subnet.metadata.name,
            status.used_ip,
            server
                .list::<FlatNetworkIP>()
                .into_iter()
                .map(|r| r.status)
                .collect::<Vec<_>>()
        );
        let expect_mac: Vec<String> = held
            .iter()
            .filter_map(|r| r.status.as_ref().map(|s| s.mac.clone()))
            .filter(|m| !m.is_empty())
            .collect();
        assert_eq!(
            status.used_mac, expect_mac,
            "seed {seed}: {:?} {status:?} {held:?}",
            subnet.metadata.name
        );
    }

    // The winner goes: the MAC is free for the other pod.
    let records_api: kube::Api<FlatNetworkIP> = kube::Api::namespaced(server.client(), NS);
    records_api
        .delete(winner, &Default::default())
        .await
        .unwrap();
    let ctx = context_from(&server, Settings::default());
    let deleting = stored_record(&server, winner).unwrap();
    ips::reconcile(Arc::new(deleting), ctx).await.unwrap();
    assert!(mac_claims(&server).is_empty(), "seed {seed}: released");
    let ctx = context_from(&server, Settings::default());
    reconcile_records(&server, &ctx).await;
    assert_eq!(ip_mac_holders(&server), [loser.name_any()], "seed {seed}");
}

/// Names of the records holding [`RACED_MAC`].
fn ip_mac_holders(server: &FakeApiServer) -> Vec<String> {
    server
        .list::<FlatNetworkIP>()
        .into_iter()
        .filter(|r| r.status.as_ref().is_some_and(|s| s.mac == RACED_MAC))
        .map(|r| r.name_any())
        .collect()
}

#[tokio::test(flavor = "current_thread")]
async fn one_fixed_mac_in_two_sibling_subnets_goes_to_exactly_one_pod() {
    for seed in 1..=40 {
        mac_race(seed).await;
    }
}

#[tokio::test]
async fn one_fixed_mac_in_two_sibling_subnets_on_threads_goes_to_exactly_one_pod() {
    for seed in 200..210 {
        mac_race(seed).await;
    }
}

/// As for addresses: a fixed MAC whose record the repair's cache has not
/// seen keeps its `usedMac` entry and its MAC ledger claim.
#[tokio::test]
async fn the_repair_frees_no_mac_a_record_names_that_its_cache_has_not_seen() {
    let server = FakeApiServer::new();
    server.insert(&sibling_subnet("left", "10.0.1.0/29"));
    let (p, record) = mac_pod("pa", "left");
    server.insert(&p);
    server.insert(&record);
    allocator(server.clone(), 1, 1).await;
    assert_eq!(ip_mac_holders(&server), ["pa"]);
    repair_with_a_blind_cache(&server).await;
    assert_eq!(
        held_macs(&server),
        (vec![RACED_MAC.to_owned()], vec![RACED_MAC.to_owned()]),
        "pa's MAC was freed on the word of a stale cache"
    );
}

#[path = "wire_tests.rs"]
mod wire;

mod mac_pool;
#[path = "reserved_tests.rs"]
mod reserved;

/// Lists are paginated as a real server paginates them (`limit`,
/// `continue`), from a snapshot taken at the first page, and an unknown
/// continue token gets 410 Gone; so a relist of many objects holds one
/// page at a time in the client.
#[tokio::test]
async fn lists_come_in_pages_from_the_first_pages_snapshot() {
    let server = FakeApiServer::new();
    for i in 0..5 {
        server.insert(&crate::allocation::fake_cluster::pod(&format!("p{i}"), "s"));
    }
    let pods: kube::Api<Pod> = kube::Api::all(server.client());
    let first = pods
        .list(&kube::api::ListParams::default().limit(2))
        .await
        .unwrap();
    assert_eq!(first.items.len(), 2);
    assert_eq!(first.metadata.remaining_item_count, Some(3));
    let token = first.metadata.continue_.clone().expect("a continue token");
    // Created after the first page: not in this list.
    server.insert(&crate::allocation::fake_cluster::pod("p9", "s"));
    let mut names: Vec<String> = first.items.iter().map(ResourceExt::name_any).collect();
    let mut next = Some(token);
    while let Some(token) = next.take() {
        let page = pods
            .list(
                &kube::api::ListParams::default()
                    .limit(2)
                    .continue_token(&token),
            )
            .await
            .unwrap();
        assert!(page.items.len() <= 2);
        assert_eq!(
            page.metadata.resource_version,
            first.metadata.resource_version
        );
        names.extend(page.items.iter().map(ResourceExt::name_any));
        next = page.metadata.continue_.filter(|t| !t.is_empty());
    }
    assert_eq!(names, ["p0", "p1", "p2", "p3", "p4"]);
    let expired = pods
        .list(
            &kube::api::ListParams::default()
                .limit(2)
                .continue_token("12345"),
        )
        .await;
    assert!(
        matches!(&expired, Err(kube::Error::Api(status)) if status.code == 410),
        "{expired:?}"
    );
}

/// A watch waiting for a late change whose history is compacted meanwhile
/// gets 410 Gone, as from a real server, never the changes after the gap:
/// a client resuming after the gap would never learn of the changes lost
/// in it (pods and records created in a burst went missing from the
/// controllers' caches for good).
#[tokio::test]
async fn a_watch_whose_changes_are_compacted_while_it_waits_gets_gone() {
    use futures::StreamExt;
    let server = FakeApiServer::realistic(super::fake_api::Realism {
        watch_delay: Duration::from_millis(500),
        // One burst delivers the first change and the later ones.
        burst: Duration::from_secs(1),
        history: 3,
        ..super::fake_api::Realism::default()
    });
    let pods: kube::Api<Pod> = kube::Api::all(server.client());
    let listed = pods.list(&kube::api::ListParams::default()).await.unwrap();
    let since = listed.metadata.resource_version.expect("a list version");
    let mut stream = pods
        .watch(&kube::api::WatchParams::default(), &since)
        .await
        .unwrap()
        .boxed();
    let first = tokio::spawn(async move { stream.next().await });
    server.insert(&crate::allocation::fake_cluster::pod("first", "s"));
    // The watch waits for the first change to be due; meanwhile the
    // history moves past it.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for i in 0..5 {
        server.insert(&crate::allocation::fake_cluster::pod(
            &format!("later-{i}"),
            "s",
        ));
    }
    match first.await.unwrap() {
        Some(Ok(kube::api::WatchEvent::Error(status))) => assert_eq!(status.code, 410),
        other => panic!("a gap delivered as if nothing was lost: {other:?}"),
    }
}

/// Every request takes at least the server's latency, also when several
/// are in flight at once (they wait side by side, not in turn).
#[tokio::test]
async fn every_request_takes_the_latency_side_by_side() {
    let latency = Duration::from_millis(100);
    let server = FakeApiServer::realistic(super::fake_api::Realism {
        latency,
        ..super::fake_api::Realism::default()
    });
    server.insert(&crate::allocation::fake_cluster::pod("p", "s"));
    let pods: kube::Api<Pod> = kube::Api::namespaced(
        server.client(),
        crate::allocation::fake_cluster::POD_NAMESPACE,
    );
    let started = std::time::Instant::now();
    pods.get("p").await.unwrap();
    assert!(started.elapsed() >= latency);
    let started = std::time::Instant::now();
    let (a, b, c, d) = tokio::join!(pods.get("p"), pods.get("p"), pods.get("p"), pods.get("p"));
    let together = started.elapsed();
    for result in [a, b, c, d] {
        result.unwrap();
    }
    assert!(together >= latency);
    assert!(
        together < latency * 3,
        "four requests in flight took {together:?}, as if one after the other"
    );
}

/// A server-side apply of `patch` by `manager`, to the object or (with
/// `status`) its status subresource, of the ConfigMap or FlatNetworkIP
/// `name` in [`NS`].
async fn apply_as<K>(server: &FakeApiServer, manager: &str, name: &str, status: bool, patch: Value)
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
{
    let api: kube::Api<K> = kube::Api::namespaced(server.client(), NS);
    let params = kube::api::PatchParams::apply(manager).force();
    let patch = kube::api::Patch::Apply(patch);
    let applied = if status {
        api.patch_status(name, &params, &patch).await
    } else {
        api.patch(name, &params, &patch).await
    };
    applied.expect("the apply succeeds");
}

/// Applies `data` as ConfigMap `c`'s data, as `manager`.
async fn apply_data(server: &FakeApiServer, manager: &str, data: Value) {
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "data": data});
    apply_as::<k8s_openapi::api::core::v1::ConfigMap>(server, manager, "c", false, cm).await;
}

async fn config_map_data(server: &FakeApiServer, name: &str) -> Value {
    let api: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
        kube::Api::namespaced(server.client(), NS);
    json!(api.get(name).await.unwrap().data)
}

/// As on a real server, a manager's apply that leaves out a field it
/// applied before removes it; a field another manager applied, or also
/// applied, stays.
#[tokio::test]
async fn an_apply_removes_the_fields_its_manager_no_longer_applies() {
    let server = FakeApiServer::new();
    apply_data(&server, "a", json!({"x": "1", "y": "1", "shared": "s"})).await;
    apply_data(&server, "b", json!({"z": "2", "shared": "s"})).await;
    apply_data(&server, "a", json!({"x": "1"})).await;
    assert_eq!(
        config_map_data(&server, "c").await,
        json!({"x": "1", "z": "2", "shared": "s"}),
        "y, applied by a alone, is gone; z and shared, b's, stay"
    );
    // b now leaves out what it alone owns: removed too.
    apply_data(&server, "b", json!({"z": "2"})).await;
    assert_eq!(
        config_map_data(&server, "c").await,
        json!({"x": "1", "z": "2"})
    );
    // A forced apply of another value takes the field over: b leaving it
    // out then keeps it (a owns it now).
    apply_data(&server, "a", json!({"x": "1", "z": "3"})).await;
    apply_data(&server, "b", json!({})).await;
    assert_eq!(
        config_map_data(&server, "c").await,
        json!({"x": "1", "z": "3"})
    );
}

/// Fields written by a non-apply request (here the object's creation) are
/// that request's: an applier leaving them out does not remove them.
#[tokio::test]
async fn an_apply_keeps_the_fields_another_write_set() {
    use k8s_openapi::api::core::v1::ConfigMap;
    let server = FakeApiServer::new();
    let created = ConfigMap {
        metadata: ObjectMeta {
            name: Some("c".into()),
            namespace: Some(NS.into()),
            ..Default::default()
        },
        data: Some([("kept".to_owned(), "k".to_owned())].into()),
        ..Default::default()
    };
    let api: kube::Api<ConfigMap> = kube::Api::namespaced(server.client(), NS);
    api.create(&kube::api::PostParams::default(), &created)
        .await
        .unwrap();
    apply_data(&server, "a", json!({"kept": "k", "mine": "m"})).await;
    apply_data(&server, "a", json!({})).await;
    assert_eq!(config_map_data(&server, "c").await, json!({"kept": "k"}));
}

async fn ip_status(server: &FakeApiServer, name: &str) -> Value {
    let api: kube::Api<FlatNetworkIP> = kube::Api::namespaced(server.client(), NS);
    serde_json::to_value(api.get_status(name).await.unwrap().status).unwrap()
}

fn new_ip(server: &FakeApiServer, name: &str) {
    let mut ip = FlatNetworkIP::new(name, Default::default());
    ip.metadata.namespace = Some(NS.into());
    server.insert(&ip);
}

fn status_apply(status: Value) -> Value {
    json!({
        "apiVersion": "flatnetwork.pandaria.io/v1",
        "kind": "FlatNetworkIP",
        "status": status,
    })
}

fn condition(kind: &str, status: &str) -> Value {
    json!({"type": kind, "status": status, "reason": "Test", "message": "",
           "lastTransitionTime": "2025-01-01T00:00:00Z"})
}

/// `status.conditions` is a map list keyed by `type`: the conditions two
/// managers apply coexist, and a condition its manager leaves out goes
/// while the other manager's stays.
#[tokio::test]
async fn conditions_of_two_managers_merge_per_type() {
    let server = FakeApiServer::new();
    new_ip(&server, "ip");
    let conditions = |cs: Vec<Value>| status_apply(json!({"conditions": cs}));
    let a_both = conditions(vec![condition("A1", "True"), condition("A2", "True")]);
    apply_as::<FlatNetworkIP>(&server, "a", "ip", true, a_both).await;
    let b = conditions(vec![condition("B", "False")]);
    apply_as::<FlatNetworkIP>(&server, "b", "ip", true, b).await;
    // Condition type and status, in stored order.
    let types = |status: Value| -> Vec<(String, String)> {
        let conditions = status["conditions"].as_array().unwrap().clone();
        conditions
            .iter()
            .map(|c| pair(c["type"].as_str().unwrap(), c["status"].as_str().unwrap()))
            .collect()
    };
    assert_eq!(
        types(ip_status(&server, "ip").await),
        [
            ("A1".into(), "True".into()),
            ("A2".into(), "True".into()),
            ("B".into(), "False".into())
        ]
    );
    let a_one = conditions(vec![condition("A2", "False")]);
    apply_as::<FlatNetworkIP>(&server, "a", "ip", true, a_one).await;
    assert_eq!(
        types(ip_status(&server, "ip").await),
        [("A2".into(), "False".into()), ("B".into(), "False".into())],
        "A1, left out by its manager, is gone; B stays"
    );
}

/// The agent once applied a condition to a FlatNetworkIP's status under
/// the manager that had applied its phase and MAC: on a real server (and
/// this one) that erases them. Under a manager of its own they stay.
#[tokio::test]
async fn a_condition_applied_under_the_status_manager_erases_the_status() {
    let server = FakeApiServer::new();
    let active = status_apply(json!({"phase": "Active", "mac": "02:00:00:00:00:01"}));
    let conflict = status_apply(json!({"conditions": [condition("IPConflict", "True")]}));

    new_ip(&server, "same");
    apply_as::<FlatNetworkIP>(&server, "agent", "same", true, active.clone()).await;
    apply_as::<FlatNetworkIP>(&server, "agent", "same", true, conflict.clone()).await;
    let status = ip_status(&server, "same").await;
    assert_eq!(status["phase"], json!(""), "{status}");
    assert!(status.get("mac").is_none(), "{status}");
    assert_eq!(status["conditions"][0]["type"], "IPConflict");

    new_ip(&server, "own");
    apply_as::<FlatNetworkIP>(&server, "agent", "own", true, active).await;
    apply_as::<FlatNetworkIP>(&server, "agent-ip-conflict", "own", true, conflict).await;
    let status = ip_status(&server, "own").await;
    assert_eq!(status["phase"], "Active", "{status}");
    assert_eq!(status["mac"], "02:00:00:00:00:01");
    assert_eq!(status["conditions"][0]["type"], "IPConflict");
}

/// A record write the API server applied but answered 504 after hanging,
/// meanwhile the node set the pod up and applied `Active` with the MAC the
/// kernel chose; the client sends the write again and meets 409. The record
/// names the new address: it stays its own, and the next pod gets another.
#[tokio::test]
async fn a_record_write_that_landed_and_was_activated_before_its_conflict_keeps_its_address() {
    use super::fake_api::faults::{Fault, Plan};
    use kube::api::{Patch, PatchParams};
    let server = FakeApiServer::new();
    server.insert(&sibling_subnet("left", "10.0.1.0/29"));
    for name in ["first", "second"] {
        let (p, record) = pod_and_record(name, "left", "");
        server.insert(&p);
        server.insert(&record);
    }
    server.script_fault(
        "flatnetworkips/status",
        "first",
        Plan::After(Fault::Timeout),
    );
    let ctx = context_from(&server, Settings::default());
    let first = stored_record(&server, "first").unwrap();
    let node = async {
        while stored_record(&server, "first")
            .and_then(|r| r.status?.addr)
            .is_none()
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let api: kube::Api<FlatNetworkIP> = kube::Api::namespaced(server.client(), NS);
        let status = json!({
            "apiVersion": "flatnetwork.pandaria.io/v1",
            "kind": "FlatNetworkIP",
            "status": {"phase": "Active", "mac": "0a:58:0a:00:01:09", "node": "node-1"},
        });
        api.patch_status(
            "first",
            &PatchParams::apply("flatnet-agent").force(),
            &Patch::Apply(status),
        )
        .await
        .unwrap();
    };
    let (allocated, ()) = futures::join!(ips::reconcile(Arc::new(first), Arc::clone(&ctx)), node);
    allocated.unwrap();
    let second = stored_record(&server, "second").unwrap();
    ips::reconcile(Arc::new(second), Arc::clone(&ctx))
        .await
        .unwrap();
    let addrs: Vec<IpAddr> = ["first", "second"]
        .iter()
        .filter_map(|name| stored_record(&server, name)?.status?.addr)
        .collect();
    assert_eq!(addrs.len(), 2, "{addrs:?}");
    assert_ne!(addrs[0], addrs[1], "one address handed out twice");
    let used = ledger(&server);
    for addr in &addrs {
        assert!(
            used_ranges::contains(&used, *addr),
            "{addr} is in usedIP: {used:?}"
        );
    }
}
