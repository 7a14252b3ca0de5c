//! Test builders for Services and pods, and a mocked API server.
//!
//! The mock follows kube's controller examples: a `tower_test` pair gives a
//! [`kube::Client`] and a handle; the test scripts the exact requests the
//! reconciler must make and the responses it gets, and fails on any other.

use std::collections::BTreeMap;

use http::{Request, Response, StatusCode};
use k8s_openapi::{
    api::core::v1::{
        Container, ContainerPort, Pod, PodCondition, PodSpec, PodStatus, Service, ServicePort,
        ServiceSpec,
    },
    apimachinery::pkg::{
        apis::meta::v1::ObjectMeta, apis::meta::v1::Time, util::intstr::IntOrString,
    },
};
use kube::{
    Resource,
    client::Body,
    runtime::{
        reflector::{self, store::Writer},
        watcher,
    },
};
use serde_json::{Value, json};

use flatnet_k8s::keys::annotation;

/// Namespace of every fixture.
pub const NS: &str = "shop";

/// Service `name` in [`NS`] selecting `app=web`, with port `http` 80 → `web`
/// (a named container port) and `metrics` 9100 → 9100.
pub fn service(name: &str) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            uid: Some(format!("uid-{name}")),
            resource_version: Some("1".into()),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some("10.43.0.10".into()),
            type_: Some("ClusterIP".into()),
            selector: Some(BTreeMap::from([("app".into(), "web".into())])),
            ports: Some(vec![
                ServicePort {
                    name: Some("http".into()),
                    port: 80,
                    protocol: Some("TCP".into()),
                    target_port: Some(IntOrString::String("web".into())),
                    ..ServicePort::default()
                },
                ServicePort {
                    name: Some("metrics".into()),
                    port: 9100,
                    protocol: Some("TCP".into()),
                    target_port: Some(IntOrString::Int(9100)),
                    ..ServicePort::default()
                },
            ]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// A ready pod `name` labelled `app=web`, on `node-1`, without flat annotations.
pub fn pod(name: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NS.into()),
            uid: Some(format!("uid-{name}")),
            labels: Some(BTreeMap::from([("app".into(), "web".into())])),
            annotations: Some(BTreeMap::new()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some("node-1".into()),
            containers: vec![Container {
                name: "web".into(),
                ports: Some(vec![ContainerPort {
                    name: Some("web".into()),
                    container_port: 8080,
                    protocol: Some("TCP".into()),
                    ..ContainerPort::default()
                }]),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: "True".into(),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        }),
    }
}

/// Builder-style changes to a fixture pod.
pub trait PodExt {
    /// Adds the flat `ip: auto` and `subnet` annotations.
    fn flat(self) -> Self;
    /// Sets the Multus network-status with `ips` on `rancher-flat-network`
    /// (plus the primary CNI entry).
    fn with_flat_ips(self, ips: &[&str]) -> Self;
    /// Sets a raw annotation.
    fn annotated(self, key: &str, value: &str) -> Self;
    /// Marks the pod not ready.
    fn not_ready(self) -> Self;
    /// Marks the pod terminating.
    fn terminating(self) -> Self;
    /// Opts out of the flat Service.
    fn opted_out(self) -> Self;
}

impl PodExt for Pod {
    fn flat(self) -> Self {
        self.annotated(annotation::IP, "auto")
            .annotated(annotation::SUBNET, "net1")
    }

    fn with_flat_ips(self, ips: &[&str]) -> Self {
        let status = json!([
            {"name": "cbr0", "interface": "eth0", "ips": ["10.42.0.7"], "default": true},
            {"name": "shop/rancher-flat-network", "interface": "eth1", "ips": ips},
        ]);
        self.annotated(annotation::MULTUS_NETWORK_STATUS, &status.to_string())
    }

    fn annotated(mut self, key: &str, value: &str) -> Self {
        self.metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(key.into(), value.into());
        self
    }

    fn not_ready(mut self) -> Self {
        if let Some(conds) = self.status.as_mut().and_then(|s| s.conditions.as_mut()) {
            conds[0].status = "False".into();
        }
        self
    }

    fn terminating(mut self) -> Self {
        self.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        self
    }

    fn opted_out(self) -> Self {
        self.annotated(annotation::FLAT_NETWORK_SERVICE, "disabled")
    }
}

/// Handle on the mocked API server.
pub type ApiServerHandle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// A client talking to a mocked API server, and the handle that scripts it.
pub fn mock_client() -> (kube::Client, ApiServerVerifier) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (kube::Client::new(service, NS), ApiServerVerifier(handle))
}

/// One request as the mock saw it.
#[derive(Debug)]
pub struct SeenRequest {
    /// HTTP method.
    pub method: http::Method,
    /// Path and query.
    pub uri: String,
    /// JSON body (`Null` when empty).
    pub body: Value,
}

/// Scripts the mocked API server one request at a time.
pub struct ApiServerVerifier(ApiServerHandle);

impl ApiServerVerifier {
    /// Waits for the next request and checks its method and path+query
    /// (`uri` ending in `*` matches by prefix); replies with what `respond`
    /// makes of the request body, and returns the request for closer checks.
    ///
    /// # Panics
    /// When no request comes or it is not the expected one.
    pub async fn expect(
        &mut self,
        method: &str,
        uri: &str,
        respond: impl FnOnce(&Value) -> (StatusCode, Value),
    ) -> SeenRequest {
        let (request, send) = self.0.next_request().await.unwrap_or_else(|| {
            panic!("expected {method} {uri}, but the client sent nothing more");
        });
        let seen = SeenRequest {
            method: request.method().clone(),
            uri: request.uri().to_string(),
            body: {
                let bytes = request
                    .into_body()
                    .collect_bytes()
                    .await
                    .expect("request body");
                if bytes.is_empty() {
                    Value::Null
                } else {
                    serde_json::from_slice(&bytes).expect("request body is JSON")
                }
            },
        };
        let uri_matches = match uri.strip_suffix('*') {
            Some(prefix) => seen.uri.starts_with(prefix),
            None => seen.uri == uri,
        };
        assert!(
            seen.method.as_str() == method && uri_matches,
            "expected {method} {uri}, got {} {} with body {}",
            seen.method,
            seen.uri,
            seen.body
        );
        let (status, response) = respond(&seen.body);
        let reply = Response::builder()
            .status(status)
            .body(Body::from(
                serde_json::to_vec(&response).expect("response serialises"),
            ))
            .expect("response builds");
        send.send_response(reply);
        seen
    }

    /// Expects a POST to `uri` (prefix match with a trailing `*`), answers
    /// 201 with the posted object, as the API server does for a create, and
    /// returns the posted body.
    ///
    /// # Panics
    /// As [`Self::expect`].
    pub async fn expect_created(&mut self, uri: &str) -> Value {
        self.expect("POST", uri, |body| (StatusCode::CREATED, body.clone()))
            .await
            .body
    }

    /// Expects `method` on `uri` (prefix match with a trailing `*`),
    /// answers 200 with the object sent, as the API server does for an
    /// accepted update, and returns the request.
    ///
    /// # Panics
    /// As [`Self::expect`].
    pub async fn expect_accepted(&mut self, method: &str, uri: &str) -> SeenRequest {
        self.expect(method, uri, |body| (StatusCode::OK, body.clone()))
            .await
    }

    /// Checks the client sent nothing else before it was dropped.
    ///
    /// # Panics
    /// On any further request.
    pub async fn expect_no_more(mut self) {
        if let Some((request, _)) = self.0.next_request().await {
            panic!("unexpected request {} {}", request.method(), request.uri());
        }
    }
}

/// Replies 200 with `body`.
pub fn ok(body: Value) -> impl FnOnce(&Value) -> (StatusCode, Value) {
    move |_| (StatusCode::OK, body)
}

/// Replies 404.
pub fn not_found() -> impl FnOnce(&Value) -> (StatusCode, Value) {
    |_| (StatusCode::NOT_FOUND, status_error(404, "NotFound"))
}

/// Replies 200 with the applied object as the server stores it (with a uid).
pub fn applied(uid: &'static str) -> impl FnOnce(&Value) -> (StatusCode, Value) {
    move |body| {
        let mut stored = body.clone();
        stored["metadata"]["uid"] = json!(uid);
        stored["metadata"]["resourceVersion"] = json!("7");
        (StatusCode::OK, stored)
    }
}

/// A `Status` body for error replies.
pub fn status_error(code: u16, reason: &str) -> Value {
    json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": reason, "reason": reason, "code": code,
    })
}

/// A list response of `kind` holding `items`.
pub fn list(kind: &str, api_version: &str, items: Vec<Value>) -> Value {
    json!({"kind": kind, "apiVersion": api_version, "metadata": {"resourceVersion": "5"}, "items": items})
}

/// Serialises an object as the API server would return it.
pub fn to_json<T: serde::Serialize>(obj: &T) -> Value {
    serde_json::to_value(obj).expect("object serialises")
}

/// An `AdmissionReview` request as the API server sends it to the webhook:
/// `operation` (`CREATE`, `UPDATE`, `DELETE`) of `object` (and `old`), by
/// an ordinary user. The resource is the kind's plural.
pub fn admission_review(
    uid: &str,
    operation: &str,
    object: Option<&Value>,
    old: Option<&Value>,
) -> Value {
    let subject = object.or(old).expect("a review has an object");
    let kind = subject["kind"].as_str().expect("the object has a kind");
    let api_version = subject["apiVersion"]
        .as_str()
        .expect("the object has an apiVersion");
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let resource = format!("{}s", kind.to_lowercase());
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "requestKind": {"group": group, "version": version, "kind": kind},
            "requestResource": {"group": group, "version": version, "resource": resource},
            "name": subject["metadata"]["name"],
            "namespace": subject["metadata"]["namespace"],
            "operation": operation,
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": old,
            "dryRun": false,
            "options": null,
        }
    })
}

/// A synced informer cache holding exactly `objects`, and its writer.
pub fn store<K>(objects: Vec<K>) -> (reflector::Store<K>, Writer<K>)
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    let (store, mut writer) = reflector::store();
    writer.apply_watcher_event(&watcher::Event::Init);
    for object in objects {
        writer.apply_watcher_event(&watcher::Event::InitApply(object));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    (store, writer)
}

/// `items` in a seeded random order (xorshift), for races.
pub fn shuffled<T: Clone>(items: &[T], seed: u64) -> Vec<T> {
    let mut items = items.to_vec();
    let mut state = seed | 1;
    for i in (1..items.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let j = usize::try_from(state % (i as u64 + 1)).unwrap();
        items.swap(i, j);
    }
    items
}

/// The ValidatingWebhookConfiguration `name` with one webhook whose
/// `caBundle` is the PEM `ca_bundle`.
pub fn webhook_configuration(
    name: &str,
    ca_bundle: &str,
) -> k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration {
    use k8s_openapi::api::admissionregistration::v1::{
        ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
    };
    ValidatingWebhookConfiguration {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        webhooks: Some(vec![ValidatingWebhook {
            name: "subnets.flatnetwork.pandaria.io".into(),
            admission_review_versions: vec!["v1".into()],
            side_effects: "None".into(),
            client_config: WebhookClientConfig {
                ca_bundle: Some(k8s_openapi::ByteString(ca_bundle.as_bytes().to_vec())),
                ..WebhookClientConfig::default()
            },
            ..ValidatingWebhook::default()
        }]),
    }
}

/// An EndpointSlice of Service `namespace/service` with one endpoint,
/// `ready` or not.
pub fn endpoint_slice(
    namespace: &str,
    service: &str,
    ready: bool,
) -> k8s_openapi::api::discovery::v1::EndpointSlice {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": format!("{service}-x1"), "namespace": namespace,
                     "labels": {flatnet_k8s::keys::label::ENDPOINTSLICE_SERVICE_NAME: service}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.42.0.7"], "conditions": {"ready": ready}}]
    }))
    .expect("an EndpointSlice")
}
