//! An in-memory Kubernetes API server for tests and benchmarks.
//!
//! It keeps objects as JSON and implements the semantics the allocation
//! protocol relies on: `GET`, `LIST` (namespace and equality label
//! selectors), `POST` (409 when the name exists), `PUT` of an object or its
//! `status` subresource and JSON merge `PATCH`, all rejecting a stale
//! `metadata.resourceVersion` with 409 Conflict, and `DELETE` that only
//! marks objects with finalizers. Watches are not served.
//!
//! With [`FakeApiServer::with_chaos`] every request yields to the scheduler
//! a seeded random number of times before and after it is applied, so
//! concurrent clients interleave differently per seed, and a share of the
//! FlatNetworkIP status writes fail (before or after being applied, like a
//! crash or a lost response).

use std::{
    collections::BTreeMap,
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
};

use http::{Method, Request, Response, StatusCode};
use kube::{Resource, client::Body};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Value, json};

/// Key of a stored object: collection (`group/version/plural`), namespace, name.
type Key = (String, String, String);

#[derive(Default)]
struct State {
    objects: BTreeMap<Key, Value>,
    version: u64,
}

/// Seeded disorder applied to every request.
struct Chaos {
    rng: u64,
    /// Percentage of FlatNetworkIP status writes that fail.
    failing_record_writes: u64,
}

impl Chaos {
    fn next(&mut self) -> u64 {
        // xorshift64*: deterministic per seed, no dependency.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// The fake server; cheap to clone, all clones share the objects.
#[derive(Clone, Default)]
pub struct FakeApiServer {
    state: Arc<Mutex<State>>,
    chaos: Option<Arc<Mutex<Chaos>>>,
    requests: Arc<std::sync::atomic::AtomicU64>,
}

impl FakeApiServer {
    /// An empty server without chaos.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// The same objects, served with seeded disorder; `failing_record_writes`
    /// percent of FlatNetworkIP status writes fail.
    #[must_use]
    pub fn with_chaos(&self, seed: u64, failing_record_writes: u64) -> Self {
        Self {
            state: Arc::clone(&self.state),
            chaos: Some(Arc::new(Mutex::new(Chaos {
                rng: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
                failing_record_writes,
            }))),
            requests: Arc::clone(&self.requests),
        }
    }

    /// A client of this server (needs a Tokio runtime).
    #[must_use]
    pub fn client(&self) -> kube::Client {
        kube::Client::new(self.clone(), "default")
    }

    /// Requests served so far.
    #[must_use]
    pub fn requests(&self) -> u64 {
        self.requests.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stores `object` as if created.
    ///
    /// # Panics
    /// When the object has no name or does not serialize.
    pub fn insert<K>(&self, object: &K)
    where
        K: Resource<DynamicType = ()> + Serialize,
    {
        let collection = collection_of::<K>();
        let mut value = serde_json::to_value(object).expect("object serializes");
        value["apiVersion"] = json!(K::api_version(&()));
        value["kind"] = json!(K::kind(&()));
        let namespace = value["metadata"]["namespace"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let name = value["metadata"]["name"]
            .as_str()
            .expect("object has a name")
            .to_owned();
        let mut state = self.lock();
        stamp_new(&mut state, &mut value);
        state.objects.insert((collection, namespace, name), value);
    }

    /// Every stored object of kind `K`.
    ///
    /// # Panics
    /// When a stored object does not deserialize as `K`.
    #[must_use]
    pub fn list<K>(&self) -> Vec<K>
    where
        K: Resource<DynamicType = ()> + DeserializeOwned,
    {
        let collection = collection_of::<K>();
        self.lock()
            .objects
            .iter()
            .filter(|((c, _, _), _)| *c == collection)
            .map(|(_, v)| serde_json::from_value(v.clone()).expect("stored object deserializes"))
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn roll(&self, modulo: u64) -> u64 {
        self.chaos.as_ref().map_or(0, |c| {
            c.lock().unwrap_or_else(|e| e.into_inner()).next() % modulo.max(1)
        })
    }

    async fn disorder(&self) {
        for _ in 0..self.roll(4) {
            tokio::task::yield_now().await;
        }
    }

    fn failing_record_writes(&self) -> u64 {
        self.chaos.as_ref().map_or(0, |c| {
            c.lock()
                .unwrap_or_else(|e| e.into_inner())
                .failing_record_writes
        })
    }

    async fn serve(self, request: Request<Body>) -> Response<Body> {
        self.requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let method = request.method().clone();
        let path = request.uri().path().to_owned();
        let query = request.uri().query().unwrap_or_default().to_owned();
        let body = request
            .into_body()
            .collect_bytes()
            .await
            .map(|b| serde_json::from_slice::<Value>(&b).unwrap_or(Value::Null))
            .unwrap_or(Value::Null);
        self.disorder().await;
        let Some(target) = Target::parse(&path) else {
            return reply(StatusCode::NOT_FOUND, status(404, "NotFound", &path));
        };
        let record_status_write = method == Method::PUT
            && target.collection.ends_with("/flatnetworkips")
            && target.subresource.as_deref() == Some("status");
        let fail = record_status_write && self.roll(100) < self.failing_record_writes();
        // Half the failures happen before the write is applied, half after.
        if fail && self.roll(2) == 0 {
            return reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                status(500, "InternalError", "injected"),
            );
        }
        let (code, value) = self.apply(&method, &target, &query, body);
        self.disorder().await;
        if fail {
            return reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                status(500, "InternalError", "injected"),
            );
        }
        reply(code, value)
    }

    fn apply(
        &self,
        method: &Method,
        target: &Target,
        query: &str,
        body: Value,
    ) -> (StatusCode, Value) {
        let mut state = self.lock();
        let key = |name: &str| {
            (
                target.collection.clone(),
                target.namespace.clone().unwrap_or_default(),
                name.to_owned(),
            )
        };
        match (method.clone(), target.name.as_deref()) {
            (Method::GET, None) => {
                let selector = label_selector(query);
                let items: Vec<Value> = state
                    .objects
                    .iter()
                    .filter(|((c, ns, _), _)| {
                        *c == target.collection && target.namespace.as_ref().is_none_or(|n| n == ns)
                    })
                    .map(|(_, v)| v)
                    .filter(|v| {
                        selector
                            .iter()
                            .all(|(k, want)| v["metadata"]["labels"][k].as_str() == Some(want))
                    })
                    .cloned()
                    .collect();
                let version = state.version.to_string();
                (
                    StatusCode::OK,
                    json!({"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": version}, "items": items}),
                )
            }
            (Method::GET, Some(name)) => match state.objects.get(&key(name)) {
                Some(v) => (StatusCode::OK, v.clone()),
                None => not_found(name),
            },
            (Method::POST, None) => {
                let mut value = body;
                let Some(name) = value["metadata"]["name"].as_str().map(str::to_owned) else {
                    return (
                        StatusCode::UNPROCESSABLE_ENTITY,
                        status(422, "Invalid", "name required"),
                    );
                };
                if state.objects.contains_key(&key(&name)) {
                    return (StatusCode::CONFLICT, status(409, "AlreadyExists", &name));
                }
                if let Some(ns) = &target.namespace {
                    value["metadata"]["namespace"] = json!(ns);
                }
                stamp_new(&mut state, &mut value);
                state.objects.insert(key(&name), value.clone());
                (StatusCode::CREATED, value)
            }
            (Method::PUT | Method::PATCH, Some(name)) => {
                let Some(stored) = state.objects.get(&key(name)).cloned() else {
                    return not_found(name);
                };
                let wanted_version = body["metadata"]["resourceVersion"].as_str();
                if wanted_version
                    .is_some_and(|v| Some(v) != stored["metadata"]["resourceVersion"].as_str())
                {
                    return (
                        StatusCode::CONFLICT,
                        status(
                            409,
                            "Conflict",
                            "the object has been modified; please apply your changes to the latest version and try again",
                        ),
                    );
                }
                let status_only = target.subresource.as_deref() == Some("status");
                let mut updated = stored.clone();
                if *method == Method::PUT {
                    if status_only {
                        updated["status"] = body["status"].clone();
                    } else {
                        updated = body;
                        updated["status"] = stored["status"].clone();
                    }
                } else {
                    merge_patch(&mut updated, &body);
                    if !status_only {
                        updated["status"] = stored["status"].clone();
                    } else {
                        updated["spec"] = stored["spec"].clone();
                    }
                }
                // Server-owned metadata stays the server's.
                for field in [
                    "uid",
                    "creationTimestamp",
                    "deletionTimestamp",
                    "namespace",
                    "name",
                    "generation",
                ] {
                    updated["metadata"][field] = stored["metadata"][field].clone();
                }
                if updated["spec"] != stored["spec"] {
                    let generation = stored["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
                    updated["metadata"]["generation"] = json!(generation);
                }
                state.version += 1;
                updated["metadata"]["resourceVersion"] = json!(state.version.to_string());
                if is_deleting(&updated) && !has_finalizers(&updated) {
                    state.objects.remove(&key(name));
                } else {
                    state.objects.insert(key(name), updated.clone());
                }
                (StatusCode::OK, updated)
            }
            (Method::DELETE, Some(name)) => {
                let Some(mut stored) = state.objects.get(&key(name)).cloned() else {
                    return not_found(name);
                };
                if has_finalizers(&stored) {
                    if !is_deleting(&stored) {
                        stored["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
                        state.version += 1;
                        stored["metadata"]["resourceVersion"] = json!(state.version.to_string());
                        state.objects.insert(key(name), stored.clone());
                    }
                } else {
                    state.objects.remove(&key(name));
                }
                (StatusCode::OK, stored)
            }
            _ => (
                StatusCode::METHOD_NOT_ALLOWED,
                status(405, "MethodNotAllowed", method.as_str()),
            ),
        }
    }
}

fn stamp_new(state: &mut State, value: &mut Value) {
    state.version += 1;
    let meta = &mut value["metadata"];
    meta["resourceVersion"] = json!(state.version.to_string());
    if meta["uid"].is_null() {
        meta["uid"] = json!(format!("uid-{}", state.version));
    }
    if meta["creationTimestamp"].is_null() {
        meta["creationTimestamp"] = json!("2025-01-01T00:00:00Z");
    }
    meta["generation"] = json!(1);
}

fn is_deleting(value: &Value) -> bool {
    !value["metadata"]["deletionTimestamp"].is_null()
}

fn has_finalizers(value: &Value) -> bool {
    value["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|f| !f.is_empty())
}

/// RFC 7386 JSON merge patch.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let target = target.as_object_mut().expect("made an object above");
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// `k=v,k2=v2` from a `labelSelector` query parameter.
fn label_selector(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter_map(|p| p.strip_prefix("labelSelector="))
        .flat_map(|s| {
            let decoded = s
                .replace("%3D", "=")
                .replace("%2C", ",")
                .replace("%2F", "/");
            decoded
                .split(',')
                .filter_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    Some((k.to_owned(), v.to_owned()))
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

fn collection_of<K: Resource<DynamicType = ()>>() -> String {
    format!("{}/{}/{}", K::group(&()), K::version(&()), K::plural(&()))
}

/// What a request path addresses.
struct Target {
    collection: String,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

impl Target {
    fn parse(path: &str) -> Option<Self> {
        let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
        let (group, version, rest) = match parts.as_slice() {
            ["api", version, rest @ ..] => ("", *version, rest),
            ["apis", group, version, rest @ ..] => (*group, *version, rest),
            _ => return None,
        };
        let (namespace, rest) = match rest {
            ["namespaces", ns, rest @ ..] if !rest.is_empty() => (Some((*ns).to_owned()), rest),
            rest => (None, rest),
        };
        let (plural, name, subresource) = match rest {
            [plural] => (*plural, None, None),
            [plural, name] => (*plural, Some(*name), None),
            [plural, name, sub] => (*plural, Some(*name), Some(*sub)),
            _ => return None,
        };
        Some(Self {
            collection: format!("{group}/{version}/{plural}"),
            namespace,
            name: name.map(str::to_owned),
            subresource: subresource.map(str::to_owned),
        })
    }
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

fn not_found(name: &str) -> (StatusCode, Value) {
    (StatusCode::NOT_FOUND, status(404, "NotFound", name))
}

fn reply(code: StatusCode, value: Value) -> Response<Body> {
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Body::from(
            serde_json::to_vec(&value).expect("JSON serializes"),
        ))
        .expect("response builds")
}

impl tower::Service<Request<Body>> for FakeApiServer {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let server = self.clone();
        Box::pin(async move { Ok(server.serve(request).await) })
    }
}
