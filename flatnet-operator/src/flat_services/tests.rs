//! Reconciler tests against a mocked API server: each test scripts the exact
//! requests the reconciler must make, in order, and nothing else.

use std::{future::Future, time::Duration};

use k8s_openapi::api::core::v1::Service;
use kube::runtime::{reflector::store::Writer, watcher};
use serde_json::{Value, json};

use super::*;
use crate::fixtures::{
    ApiServerVerifier, NS, PodExt, applied, list, mock_client, not_found, ok, pod, service, to_json,
};

const PODS_OF_WEB: &str = "/api/v1/namespaces/shop/pods?&labelSelector=app%3Dweb&resourceVersion=0&resourceVersionMatch=NotOlderThan";
const FLAT_SVC: &str = "/api/v1/namespaces/shop/services/web-flat-network";
const APPLY: &str = "?&force=true&fieldManager=flatnet-operator";
const SLICES: &str = "/apis/discovery.k8s.io/v1/namespaces/shop/endpointslices";
const ENDPOINTS: &str = "/api/v1/namespaces/shop/endpoints/web-flat-network";

/// Runs `reconcile` for `svc` while `script` plays the API server, then
/// checks the script saw every request and no other.
async fn run_scenario<S, F>(svc: Service, script: S) -> (Result<Action, Error>, Arc<Metrics>)
where
    S: FnOnce(ApiServerVerifier) -> F + Send + 'static,
    F: Future<Output = ApiServerVerifier> + Send + 'static,
{
    let (client, verifier) = mock_client();
    let metrics = Arc::new(Metrics::new());
    let ctx = Arc::new(Context {
        client,
        metrics: Arc::clone(&metrics),
        attachment: "rancher-flat-network".into(),
        resync: Duration::from_secs(600),
    });
    let server = tokio::spawn(async move { script(verifier).await.expect_no_more().await });
    let svc = Arc::new(svc);
    let result = reconcile(Arc::clone(&svc), Arc::clone(&ctx)).await;
    if let Err(error) = &result {
        error_policy(svc, error, Arc::clone(&ctx));
    }
    drop(ctx);
    if let Err(join) = server.await {
        std::panic::resume_unwind(join.into_panic());
    }
    (result, metrics)
}

fn pods(items: Vec<Pod>) -> Value {
    list("PodList", "v1", items.iter().map(to_json).collect())
}

fn slice_list(names: &[&str]) -> Value {
    let items = names
        .iter()
        .map(|n| json!({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {"name": n, "namespace": NS}}))
        .collect();
    list("PartialObjectMetadataList", "meta.k8s.io/v1", items)
}

/// The flat Service flatnet owns, as stored.
fn existing_flat_service() -> Value {
    let mut flat = to_json(
        &flat_service::desired_flat_service(&service("web"), "rancher-flat-network").unwrap(),
    );
    flat["metadata"]["uid"] = json!("uid-flat");
    flat
}

fn endpoint_summary(slice: &Value) -> Vec<(String, bool, bool, bool)> {
    slice["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let c = &e["conditions"];
            (
                e["addresses"][0].as_str().unwrap().to_owned(),
                c["ready"].as_bool().unwrap(),
                c["serving"].as_bool().unwrap(),
                c["terminating"].as_bool().unwrap(),
            )
        })
        .collect()
}

#[tokio::test]
async fn creates_the_flat_service_and_one_slice_per_family() {
    let selected = vec![
        pod("a").flat().with_flat_ips(&["192.168.1.10"]),
        pod("b").flat().with_flat_ips(&["fd00::b"]).not_ready(),
        pod("c")
            .flat()
            .with_flat_ips(&["192.168.1.12"])
            .terminating(),
        pod("pending").flat(),
        pod("plain"),
    ];
    let (result, _) = run_scenario(service("web"), |mut api| async move {
        api.expect("GET", PODS_OF_WEB, ok(pods(selected))).await;
        api.expect("GET", FLAT_SVC, not_found()).await;
        let svc = api
            .expect("PATCH", &format!("{FLAT_SVC}{APPLY}"), applied("uid-flat"))
            .await;
        assert_eq!(svc.body["spec"]["clusterIP"], "None");
        assert_eq!(
            svc.body["spec"].get("selector"),
            None,
            "the flat Service must have no selector"
        );
        assert_eq!(svc.body["spec"]["ports"][0]["port"], 80);
        assert_eq!(svc.body["metadata"]["ownerReferences"][0]["uid"], "uid-web");
        assert_eq!(
            svc.body["metadata"]["ownerReferences"][0]["controller"],
            true
        );

        let listed = api
            .expect(
                "GET",
                &format!("{SLICES}?&labelSelector=*"),
                ok(slice_list(&["web-flat-network-ipv4-old"])),
            )
            .await;
        assert!(
            listed
                .uri
                .contains("kubernetes.io%2Fservice-name%3Dweb-flat-network"),
            "{}",
            listed.uri
        );
        let v4 = api
            .expect(
                "PATCH",
                &format!("{SLICES}/web-flat-network-ipv4-*"),
                applied("uid-s4"),
            )
            .await;
        assert!(v4.uri.ends_with(APPLY), "{}", v4.uri);
        assert_eq!(v4.body["addressType"], "IPv4");
        assert_eq!(
            endpoint_summary(&v4.body),
            [
                ("192.168.1.10".into(), true, true, false),
                ("192.168.1.12".into(), false, true, true),
            ]
        );
        assert_eq!(
            v4.body["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"],
            "flatnet.pandaria.io"
        );
        assert_eq!(v4.body["metadata"]["ownerReferences"][0]["uid"], "uid-flat");
        assert_eq!(v4.body["endpoints"][0]["targetRef"]["name"], "a");
        assert_eq!(v4.body["endpoints"][0]["nodeName"], "node-1");
        assert_eq!(v4.body["ports"][0]["port"], 8080);

        let v6 = api
            .expect(
                "PATCH",
                &format!("{SLICES}/web-flat-network-ipv6-*"),
                applied("uid-s6"),
            )
            .await;
        assert_eq!(v6.body["addressType"], "IPv6");
        assert_eq!(
            endpoint_summary(&v6.body),
            [("fd00::b".into(), false, false, false)]
        );

        api.expect(
            "DELETE",
            &format!("{SLICES}/web-flat-network-ipv4-old?"),
            ok(json!({"kind": "Status", "status": "Success"})),
        )
        .await;
        // core/v1 Endpoints beside the slices, as the original wrote them.
        let endpoints = api
            .expect("PATCH", &format!("{ENDPOINTS}{APPLY}"), applied("uid-ep"))
            .await;
        assert_eq!(
            endpoints.body["metadata"]["labels"]["endpointslice.kubernetes.io/skip-mirror"],
            "true"
        );
        assert_eq!(
            endpoints.body["metadata"]["ownerReferences"][0]["uid"],
            "uid-flat"
        );
        let subsets = &endpoints.body["subsets"];
        assert_eq!(subsets[0]["addresses"][0]["ip"], "192.168.1.10");
        assert_eq!(subsets[0]["addresses"][0]["targetRef"]["name"], "a");
        assert_eq!(subsets[0]["notReadyAddresses"][0]["ip"], "192.168.1.12");
        assert_eq!(subsets[0]["ports"][0]["port"], 8080);
        assert_eq!(subsets[1]["notReadyAddresses"][0]["ip"], "fd00::b");
        assert_eq!(subsets[1].get("addresses"), None);
        api
    })
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(600)));
}

#[tokio::test]
async fn an_opted_out_pod_deletes_the_flat_service() {
    let selected = vec![
        pod("a").flat().with_flat_ips(&["192.168.1.10"]),
        pod("b").flat().opted_out(),
    ];
    let (result, _) = run_scenario(service("web"), |mut api| async move {
        api.expect("GET", PODS_OF_WEB, ok(pods(selected))).await;
        api.expect("GET", FLAT_SVC, ok(existing_flat_service()))
            .await;
        api.expect(
            "DELETE",
            &format!("{FLAT_SVC}?"),
            ok(json!({"kind": "Status", "status": "Success"})),
        )
        .await;
        api
    })
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(600)));
}

#[tokio::test]
async fn services_without_flat_pods_make_no_writes() {
    let (result, _) = run_scenario(service("web"), |mut api| async move {
        api.expect("GET", PODS_OF_WEB, ok(pods(vec![pod("a"), pod("b")])))
            .await;
        api.expect("GET", FLAT_SVC, not_found()).await;
        api
    })
    .await;
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(600)));
}

#[tokio::test]
async fn services_without_selector_list_no_pods() {
    let mut svc = service("web");
    svc.spec.as_mut().unwrap().selector = None;
    let (result, _) = run_scenario(svc, |mut api| async move {
        api.expect("GET", FLAT_SVC, not_found()).await;
        api
    })
    .await;
    assert!(result.is_ok());
}

#[tokio::test]
async fn flat_pods_without_addresses_get_the_service_and_no_slices() {
    let (result, _) = run_scenario(service("web"), |mut api| async move {
        api.expect("GET", PODS_OF_WEB, ok(pods(vec![pod("a").flat()])))
            .await;
        api.expect("GET", FLAT_SVC, ok(existing_flat_service()))
            .await;
        api.expect("PATCH", &format!("{FLAT_SVC}{APPLY}"), applied("uid-flat"))
            .await;
        api.expect(
            "GET",
            &format!("{SLICES}?&labelSelector=*"),
            ok(slice_list(&["web-flat-network-ipv4-1234abcd"])),
        )
        .await;
        api.expect(
            "DELETE",
            &format!("{SLICES}/web-flat-network-ipv4-1234abcd?"),
            not_found(),
        )
        .await;
        // A cluster that removed core/v1 Endpoints: not an error.
        let endpoints = api
            .expect("PATCH", &format!("{ENDPOINTS}{APPLY}"), not_found())
            .await;
        assert_eq!(endpoints.body["subsets"], json!([]));
        api
    })
    .await;
    // Waiting for the CNI is no reason to retry early: the pod update will come.
    assert_eq!(result.unwrap(), Action::requeue(Duration::from_secs(600)));
}

#[tokio::test]
async fn a_foreign_service_holding_the_name_is_reported_not_touched() {
    let mut foreign = to_json(&service("web-flat-network"));
    foreign["metadata"]["uid"] = json!("uid-someone-else");
    let (result, metrics) = run_scenario(service("web"), |mut api| async move {
        api.expect(
            "GET",
            PODS_OF_WEB,
            ok(pods(vec![pod("a").flat().with_flat_ips(&["192.168.1.10"])])),
        )
        .await;
        api.expect("GET", FLAT_SVC, ok(foreign)).await;
        api
    })
    .await;
    let error = result.unwrap_err();
    assert!(matches!(error, Error::NameTaken { .. }));
    assert!(
        error.to_string().contains("shop/web-flat-network"),
        "{error}"
    );
    assert!(metrics.render().contains(
        r#"flatnet_operator_reconcile_errors_total{controller="service",error="name_taken"} 1"#
    ));
}

#[tokio::test]
async fn the_original_operators_flat_service_is_replaced() {
    let mut legacy = to_json(&service("web-flat-network"));
    legacy["metadata"]["ownerReferences"] =
        json!([{"apiVersion": "v1", "kind": "Service", "name": "web", "uid": "uid-web"}]);
    legacy["metadata"]["annotations"] =
        json!({"k8s.v1.cni.cncf.io/networks": "rancher-flat-network"});
    let (result, _) = run_scenario(service("web"), |mut api| async move {
        api.expect("GET", PODS_OF_WEB, ok(pods(vec![pod("a").flat()])))
            .await;
        api.expect("GET", FLAT_SVC, ok(legacy)).await;
        api.expect(
            "DELETE",
            &format!("{FLAT_SVC}?"),
            ok(json!({"kind": "Status", "status": "Success"})),
        )
        .await;
        api.expect("PATCH", &format!("{FLAT_SVC}{APPLY}"), applied("uid-flat"))
            .await;
        api.expect(
            "GET",
            &format!("{SLICES}?&labelSelector=*"),
            ok(slice_list(&[])),
        )
        .await;
        api.expect("PATCH", &format!("{ENDPOINTS}{APPLY}"), applied("uid-ep"))
            .await;
        api
    })
    .await;
    assert!(result.is_ok());
}

#[tokio::test]
async fn api_errors_are_counted_and_retried() {
    let (result, metrics) = run_scenario(service("web"), |mut api| async move {
        api.expect("GET", PODS_OF_WEB, |_| {
            (
                http::StatusCode::FORBIDDEN,
                crate::fixtures::status_error(403, "Forbidden"),
            )
        })
        .await;
        api
    })
    .await;
    let error = result.unwrap_err();
    assert!(
        error
            .to_string()
            .starts_with("list Pods selected by Service shop/web"),
        "{error}"
    );
    assert!(metrics.render().contains(
        r#"flatnet_operator_reconcile_errors_total{controller="service",error="kube_api"} 1"#
    ));
}

#[tokio::test]
async fn flat_services_themselves_are_never_parents() {
    let flat = flat_service::desired_flat_service(&service("web"), "rancher-flat-network").unwrap();
    let (result, _) = run_scenario(flat, |api| async move { api }).await;
    assert_eq!(result.unwrap(), Action::await_change());
}

fn store_of(services: Vec<Service>) -> Store<Service> {
    let mut writer = Writer::<Service>::default();
    for svc in services {
        writer.apply_watcher_event(&watcher::Event::Apply(svc));
    }
    writer.as_reader()
}

#[test]
fn pod_events_map_to_the_services_selecting_flat_pods() {
    let mut other_ns = service("web");
    other_ns.metadata.namespace = Some("elsewhere".into());
    let mut other_app = service("api");
    other_app.spec.as_mut().unwrap().selector =
        Some(BTreeMap::from([("app".into(), "api".into())]));
    let flat = flat_service::desired_flat_service(&service("web"), "rancher-flat-network").unwrap();
    let store = store_of(vec![service("web"), other_ns, other_app, flat]);

    let refs = services_selecting(&store, &pod("a").flat());
    assert_eq!(refs, [ObjectRef::new("web").within(NS)]);
    assert_eq!(
        services_selecting(&store, &pod("a").opted_out()),
        [ObjectRef::new("web").within(NS)]
    );
    assert!(
        services_selecting(&store, &pod("a")).is_empty(),
        "plain pods trigger nothing"
    );
}

#[test]
fn slice_events_map_to_the_parent_service() {
    let mut slice = EndpointSlice::default();
    slice.metadata.namespace = Some(NS.into());
    slice.metadata.labels = Some(BTreeMap::from([(
        label::PARENT_SERVICE.into(),
        "web".into(),
    )]));
    assert_eq!(
        parent_of_slice(&slice),
        Some(ObjectRef::new("web").within(NS))
    );
    slice.metadata.labels = None;
    assert_eq!(parent_of_slice(&slice), None);
}

/// The service controllers report ready once their cache has synced, as
/// the leader's `/readyz` needs (kube's own wait on the same store would
/// leave a second waiter asleep).
#[tokio::test]
async fn the_service_controllers_become_ready_once_synced() {
    let server = crate::allocation::fake_api::FakeApiServer::new();
    server.insert(&service("web"));
    let ctx = Arc::new(Context {
        client: server.client(),
        metrics: Arc::new(Metrics::new()),
        attachment: "rancher-flat-network".into(),
        resync: Duration::from_secs(600),
    });
    let health = Arc::new(Health::default());
    let stop = CancellationToken::new();
    let controllers = tokio::spawn(run(ctx, 2, Arc::clone(&health), stop.clone()));
    let ready = tokio::time::timeout(Duration::from_secs(20), async {
        while !health.is_ready() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    stop.cancel();
    controllers.await.unwrap();
    assert!(
        ready.is_ok(),
        "the service controllers never reported ready"
    );
}
