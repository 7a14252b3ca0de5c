//! An in-memory Kubernetes API server for tests and benchmarks.
//!
//! It keeps objects as JSON and implements the semantics the controllers
//! rely on: `GET`, `LIST` (namespace, equality label selectors and the
//! field selectors a real server supports, others refused; in
//! pages with `limit` and `continue`, from a snapshot of the first page's
//! time, 410 Gone for an unknown token), `POST`
//! (409 when the name exists; the status is dropped), `PUT` of an object or its `status`
//! subresource, JSON merge `PATCH` and server-side apply (field ownership
//! per manager as [`ownership`] models it; an apply creates a missing
//! object, and one without `force` that would take fields from another
//! manager gets 409 Conflict naming them), all rejecting a stale
//! `metadata.resourceVersion` with 409 Conflict (and a `PUT` without one,
//! of a custom resource or another kind whose strategy disallows an
//! unconditional update, with 422 Invalid), and `DELETE` that only
//! marks objects with finalizers (`deletionTimestamp`) and removes them
//! once the last finalizer goes.
//!
//! Like a real server it also serves watches (`?watch=true` from a
//! resourceVersion), so kube-runtime's reflectors and controllers run
//! against it unchanged, and with [`Realism`] it behaves as a real server
//! does where it matters to them:
//!
//! - every request takes a per-request latency;
//! - watch events arrive late and in bursts, each kind with its own delay,
//!   so events of different kinds arrive reordered and the reflector caches
//!   lag behind the writes;
//! - only the newest events are kept: a watch from an older
//!   resourceVersion gets 410 Gone and the client lists again;
//! - the garbage collector deletes the dependents of a removed owner
//!   (`ownerReferences` uid) asynchronously, after a delay.
//!
//! It always refuses, as etcd does, to store an object larger than
//! [`MAX_OBJECT_BYTES`].
//!
//! With [`FakeApiServer::with_chaos`] every request yields to the scheduler
//! a seeded random number of times before and after it is applied, so
//! concurrent clients interleave differently per seed, and a share of the
//! FlatNetworkIP status writes fail (before or after being applied, like a
//! crash or a lost response).
//!
//! With [`FakeApiServer::with_rbac`], a clone's requests are authorized by
//! a ServiceAccount's rules as the real RBAC authorizer does ([`rbac`]),
//! the `create` an apply of a missing object needs included, and refused
//! with the real server's 403.
//!
//! With [`FakeApiServer::with_faults`], the requests of clients made with
//! [`FakeApiServer::for_client`] meet seeded [`faults`]: conflicts, errors,
//! timeouts, cut watches and the death of the client mid-request. With
//! [`FakeApiServer::script_fault`], one named write meets one fault.
//!
//! Its clients send 429, 503 and 504 answers again, as the operator's
//! client does: a write applied and answered 504 comes back as 409.

pub mod faults;
pub mod ownership;
pub mod rbac;

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, VecDeque},
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use futures::{StreamExt, stream::BoxStream};
use http::{Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::StreamBody;
use kube::{Resource, client::Body};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Value, json};
use tokio::time::Instant;

/// Key of a stored object: collection (`group/version/plural`), namespace, name.
type Key = (String, String, String);

/// The body of every reply: one chunk, or the events of a watch.
pub type ReplyBody = StreamBody<BoxStream<'static, Result<Frame<Bytes>, Infallible>>>;

/// Waits `latency` to within tens of microseconds, on a blocking thread:
/// tokio's timer rounds every sleep up to its next millisecond tick, which
/// made a 1 ms request take nearly 2.
async fn request_latency(latency: Duration) {
    if tokio::task::spawn_blocking(move || std::thread::sleep(latency))
        .await
        .is_err()
    {
        // The runtime is shutting down; the request is moot.
        futures::future::pending::<()>().await;
    }
}

/// How far the server behaves like a real one (see the module docs).
#[derive(Clone, Debug)]
pub struct Realism {
    /// Time every request takes before it is applied.
    pub latency: Duration,
    /// Least delay of a watch event after its write.
    pub watch_delay: Duration,
    /// Each kind's watch events are delayed by up to this much more (a
    /// seeded share per kind), so kinds arrive reordered.
    pub watch_spread: Duration,
    /// Watch events are delivered in bursts at most this often.
    pub burst: Duration,
    /// Events kept for watches; a watch from before them gets 410 Gone.
    pub history: usize,
    /// Delay of the garbage collector.
    pub gc_delay: Duration,
    /// Seed of the per-kind delays.
    pub seed: u64,
}

impl Default for Realism {
    /// A server without delays that keeps a long history.
    fn default() -> Self {
        Self {
            latency: Duration::ZERO,
            watch_delay: Duration::ZERO,
            watch_spread: Duration::ZERO,
            burst: Duration::ZERO,
            history: 1 << 20,
            gc_delay: Duration::ZERO,
            seed: 0,
        }
    }
}

impl Realism {
    /// The watch delay of `collection`: the least delay plus a seeded
    /// share of the spread.
    fn delay_of(&self, collection: &str) -> Duration {
        let hash = collection
            .bytes()
            .fold(self.seed ^ 0xcbf2_9ce4_8422_2325, |h, b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
        let share = u32::try_from(hash % 1001).unwrap_or_default();
        self.watch_delay + self.watch_spread.mul_f64(f64::from(share) / 1000.0)
    }
}

/// One change, as a watch delivers it.
struct Change {
    version: u64,
    collection: String,
    namespace: String,
    kind: &'static str,
    object: Value,
    at: Instant,
}

#[derive(Default)]
struct State {
    objects: BTreeMap<Key, Value>,
    version: u64,
    /// The newest changes, oldest first.
    changes: VecDeque<Change>,
    /// The newest version no longer in `changes`.
    compacted: u64,
    /// Uids of removed objects whose dependents the collector must delete.
    orphaned_owners: Vec<String>,
    /// The objects naming each uid in their `ownerReferences`.
    owned_by: HashMap<String, BTreeSet<Key>>,
    /// The uids of the stored objects.
    uids: BTreeSet<String>,
    /// Who owns which fields of each stored object.
    owners: HashMap<Key, ownership::Owners>,
    /// The rest of paginated lists (`limit`), by continue token, with the
    /// version each list was taken at.
    pages: BTreeMap<u64, (Vec<Value>, String)>,
    /// The last continue token given.
    last_page: u64,
}

/// The uids `value` names in its `ownerReferences`.
fn owner_uids(value: &Value) -> Vec<String> {
    value["metadata"]["ownerReferences"]
        .as_array()
        .map(|refs| {
            refs.iter()
                .filter_map(|r| r["uid"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// Most paginated lists kept for their next page; the oldest expire.
const KEPT_PAGES: usize = 64;

impl State {
    /// Keeps the rest of a paginated list; returns its continue token.
    fn keep_page(&mut self, rest: Vec<Value>, version: String) -> u64 {
        self.last_page += 1;
        self.pages.insert(self.last_page, (rest, version));
        while self.pages.len() > KEPT_PAGES {
            self.pages.pop_first();
        }
        self.last_page
    }

    /// Stores `value` at `key` and logs the change.
    fn put(&mut self, key: &Key, kind: &'static str, value: Value, history: usize) {
        self.log(key, kind, &value, history);
        if let Some(old) = self.objects.insert(key.clone(), value) {
            self.unindex(key, &old);
        }
        let value = &self.objects[key];
        if let Some(uid) = value["metadata"]["uid"].as_str() {
            self.uids.insert(uid.to_owned());
        }
        for uid in owner_uids(value) {
            self.owned_by.entry(uid).or_default().insert(key.clone());
        }
    }

    fn unindex(&mut self, key: &Key, old: &Value) {
        for uid in owner_uids(old) {
            if let Some(keys) = self.owned_by.get_mut(&uid) {
                keys.remove(key);
                if keys.is_empty() {
                    self.owned_by.remove(&uid);
                }
            }
        }
    }

    fn log(&mut self, key: &Key, kind: &'static str, object: &Value, history: usize) {
        self.changes.push_back(Change {
            version: self.version,
            collection: key.0.clone(),
            namespace: key.1.clone(),
            kind,
            object: object.clone(),
            at: Instant::now(),
        });
        while self.changes.len() > history.max(1) {
            if let Some(old) = self.changes.pop_front() {
                self.compacted = old.version;
            }
        }
    }

    /// Removes `key`, noting its uid for the garbage collector.
    fn remove(&mut self, key: &Key, history: usize) {
        if let Some(mut gone) = self.objects.remove(key) {
            self.unindex(key, &gone);
            self.owners.remove(key);
            if let Some(uid) = gone["metadata"]["uid"].as_str() {
                self.uids.remove(uid);
            }
            self.version += 1;
            gone["metadata"]["resourceVersion"] = json!(self.version.to_string());
            if let Some(uid) = gone["metadata"]["uid"].as_str()
                && self.owned_by.contains_key(uid)
            {
                self.orphaned_owners.push(uid.to_owned());
            }
            self.log(key, "DELETED", &gone, history);
        }
    }

    /// Deletes `key` as `DELETE` does: marks it when finalizers hold it,
    /// else removes it. Returns the object as it was answered.
    fn delete(&mut self, key: &Key, history: usize) -> Option<Value> {
        let mut stored = self.objects.get(key).cloned()?;
        if has_finalizers(&stored) {
            if !is_deleting(&stored) {
                stored["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
                self.version += 1;
                stored["metadata"]["resourceVersion"] = json!(self.version.to_string());
                self.put(key, "MODIFIED", stored.clone(), history);
            }
        } else {
            self.remove(key, history);
        }
        Some(stored)
    }

    /// Keys of the objects owned by `uid`.
    fn dependents(&self, uid: &str) -> Vec<Key> {
        self.owned_by
            .get(uid)
            .map(|keys| keys.iter().cloned().collect())
            .unwrap_or_default()
    }
}

/// How long a request with a scripted 504 hangs before its answer.
const SCRIPTED_TIMEOUT: Duration = Duration::from_millis(100);

/// Seeded disorder applied to every request.
struct Chaos {
    rng: u64,
    /// Percentage of FlatNetworkIP status writes that fail.
    failing_record_writes: u64,
}

impl Chaos {
    fn next(&mut self) -> u64 {
        xorshift(&mut self.rng)
    }
}

/// xorshift64*: deterministic per seed, no dependency.
fn xorshift(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

/// The fake server; cheap to clone, all clones share the objects.
#[derive(Clone, Default)]
pub struct FakeApiServer {
    state: Arc<Mutex<State>>,
    /// Wakes watches: carries the newest version.
    changed: Arc<tokio::sync::watch::Sender<u64>>,
    realism: Arc<Realism>,
    chaos: Option<Arc<Mutex<Chaos>>>,
    faults: Option<Arc<faults::Faults>>,
    /// Faults for single requests, whatever client sends them.
    scripted: Arc<Mutex<Vec<faults::Scripted>>>,
    /// Who sends this clone's requests (0: nobody in particular, no faults).
    client: u64,
    /// Where the garbage collector runs (else the requesting runtime).
    background: Option<tokio::runtime::Handle>,
    requests: Arc<Mutex<HashMap<&'static str, u64>>>,
    /// Requests per verb, resource and reply code (see
    /// [`FakeApiServer::requests_by_kind`]).
    outcomes: Arc<Mutex<BTreeMap<String, u64>>>,
    /// What the clients of [`FakeApiServer::for_client`] asked for.
    accesses: Arc<Mutex<BTreeSet<Access>>>,
    total: Arc<AtomicU64>,
    /// A resource (plural, such as `configmaps`) whose writes skip the
    /// resourceVersion check, to show a race test fails without it.
    unchecked: Option<&'static str>,
    /// The rules this clone's requests are authorized by (none: every
    /// request is allowed).
    rbac: Option<Arc<rbac::Rbac>>,
}

/// One kind of request, as RBAC grants it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Access {
    /// `get`, `list`, `watch`, `create`, `update`, `patch` or `delete`.
    pub verb: &'static str,
    /// API group (`""` for the core group).
    pub group: String,
    /// Resource (plural).
    pub resource: String,
    /// Subresource, such as `status`.
    pub subresource: Option<String>,
    /// Whether the request named a namespace.
    pub namespaced: bool,
}

impl Access {
    /// The verbs a request can have.
    pub const VERBS: [&str; 7] = [
        "get", "list", "watch", "create", "update", "patch", "delete",
    ];

    /// One line: `verb group resource subresource namespaced`, `-` for
    /// the core group and no subresource.
    #[must_use]
    pub fn to_line(&self) -> String {
        let or_dash = |s: &str| {
            if s.is_empty() {
                "-".to_owned()
            } else {
                s.to_owned()
            }
        };
        format!(
            "{} {} {} {} {}",
            self.verb,
            or_dash(&self.group),
            self.resource,
            or_dash(self.subresource.as_deref().unwrap_or_default()),
            self.namespaced
        )
    }

    /// The access of a [`Access::to_line`] line.
    #[must_use]
    pub fn from_line(line: &str) -> Option<Self> {
        let mut words = line.split_whitespace();
        let verb = words.next()?;
        let verb = Self::VERBS.into_iter().find(|v| *v == verb)?;
        let group = words.next()?;
        let resource = words.next()?.to_owned();
        let subresource = words.next()?;
        let namespaced = words.next()?.parse().ok()?;
        Some(Self {
            verb,
            group: if group == "-" {
                String::new()
            } else {
                group.to_owned()
            },
            resource,
            subresource: (subresource != "-").then(|| subresource.to_owned()),
            namespaced,
        })
    }
}

impl FakeApiServer {
    /// An empty server without delays or chaos.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty server with the delays, history and collector of `realism`.
    #[must_use]
    pub fn realistic(realism: Realism) -> Self {
        Self {
            realism: Arc::new(realism),
            ..Self::default()
        }
    }

    /// The same objects, served with seeded disorder; `failing_record_writes`
    /// percent of FlatNetworkIP status writes fail.
    #[must_use]
    pub fn with_chaos(&self, seed: u64, failing_record_writes: u64) -> Self {
        Self {
            chaos: Some(Arc::new(Mutex::new(Chaos {
                rng: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
                failing_record_writes,
            }))),
            ..self.clone()
        }
    }

    /// The same objects, with `faults` met by the clients of
    /// [`FakeApiServer::for_client`]; the garbage collector runs on
    /// `background`, so it outlives the runtimes of killed clients.
    #[must_use]
    pub fn with_faults(
        &self,
        faults: Arc<faults::Faults>,
        background: tokio::runtime::Handle,
    ) -> Self {
        Self {
            faults: Some(faults),
            background: Some(background),
            ..self.clone()
        }
    }

    /// The same objects, with writes to the resource `collection` (plural,
    /// such as `configmaps`) accepted whatever resourceVersion they carry: a broken
    /// server, which a race test must notice.
    #[must_use]
    pub fn without_version_checks(&self, collection: &'static str) -> Self {
        Self {
            unchecked: Some(collection),
            ..self.clone()
        }
    }

    /// The same server, its requests sent by client `id` (not 0): they meet
    /// the faults of [`FakeApiServer::with_faults`].
    #[must_use]
    pub fn for_client(&self, id: u64) -> Self {
        Self {
            client: id,
            ..self.clone()
        }
    }

    /// The same server, this clone's requests authorized by `rules` as a
    /// real server's RBAC authorizer does ([`rbac`]): a request they do not
    /// allow, and an apply that creates an object without `create`, is
    /// refused with the real server's 403.
    #[must_use]
    pub fn with_rbac(&self, rules: rbac::Rbac) -> Self {
        Self {
            rbac: Some(Arc::new(rules)),
            ..self.clone()
        }
    }

    /// The next write (not a `GET`) of `resource` (plural, with its
    /// subresource: `flatnetworkips/status`) named `name`, by any client,
    /// meets `plan`.
    pub fn script_fault(&self, resource: &str, name: &str, plan: faults::Plan) {
        self.scripted
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(faults::Scripted {
                resource: resource.to_owned(),
                name: name.to_owned(),
                plan,
            });
    }

    /// The scripted plan of a request, taken, if there is one.
    fn take_scripted(&self, method: &Method, target: &Target) -> Option<faults::Plan> {
        let mut scripted = self.scripted.lock().unwrap_or_else(|e| e.into_inner());
        let found = scripted.iter().position(|s| s.matches(method, target))?;
        Some(scripted.remove(found).plan)
    }

    /// The answer of an injected `fault`.
    async fn answer(&self, fault: faults::Fault) -> (StatusCode, Value) {
        match &self.faults {
            Some(faults) => faults.answer(fault).await,
            // A scripted timeout hangs a little, as the request did.
            None => faults::answer(fault, SCRIPTED_TIMEOUT).await,
        }
    }

    /// A client of this server (needs a Tokio runtime). It sends 429, 503
    /// and 504 answers again, as the operator's client does (kube's
    /// `Config::default_retry`): a write the server applied and answered
    /// 504 meets, sent again, 409 Conflict or 404.
    #[must_use]
    pub fn client(&self) -> kube::Client {
        use kube::client::retry::RetryPolicy;
        let service = tower::ServiceBuilder::new()
            .layer(tower::retry::RetryLayer::new(RetryPolicy::server_retry()))
            .map_err(tower::BoxError::from)
            .service(self.clone());
        kube::Client::new(service, "default")
    }

    /// Requests served so far.
    #[must_use]
    pub fn requests(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }

    /// Requests served so far per verb (`get`, `list`, `watch`, `create`,
    /// `update`, `patch`, `delete`).
    #[must_use]
    pub fn requests_by_verb(&self) -> BTreeMap<&'static str, u64> {
        self.requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect()
    }

    /// Requests served so far per verb, resource (with its subresource)
    /// and reply code, such as `create flatnetworkips 409` or
    /// `update flatnetworksubnets/status 200`: what a phase of a run spends
    /// its requests on, and how many of them fail.
    #[must_use]
    pub fn requests_by_kind(&self) -> BTreeMap<String, u64> {
        self.outcomes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Every kind of request the clients of [`FakeApiServer::for_client`]
    /// sent so far.
    #[must_use]
    pub fn accesses(&self) -> BTreeSet<Access> {
        self.accesses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
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
        let key = (collection, namespace, name);
        let mut state = self.lock();
        let kind = if state.objects.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        stamp_new(&mut state, &mut value);
        let stored = state.objects.get(&key).cloned().unwrap_or(Value::Null);
        let owners = state.owners.entry(key.clone()).or_default();
        for scope in [ownership::Scope::Object, ownership::Scope::Status] {
            owners.update(ownership::INSERTED, scope, &stored, &value);
        }
        state.put(&key, kind, value, self.realism.history);
        self.wake(&state);
    }

    /// Deletes object `name` of kind `K` in `namespace` (empty for
    /// cluster-scoped kinds) as a `DELETE` request does, the garbage
    /// collector following. Returns whether it existed.
    pub fn delete<K>(&self, namespace: &str, name: &str) -> bool
    where
        K: Resource<DynamicType = ()>,
    {
        let key = (collection_of::<K>(), namespace.to_owned(), name.to_owned());
        let existed = {
            let mut state = self.lock();
            let existed = state.delete(&key, self.realism.history).is_some();
            self.wake(&state);
            existed
        };
        self.collect_garbage();
        existed
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

    /// How many stored objects of kind `K` satisfy `test` (on their JSON,
    /// without deserializing them: cheap enough to poll).
    pub fn count<K>(&self, test: impl Fn(&Value) -> bool) -> usize
    where
        K: Resource<DynamicType = ()>,
    {
        let collection = collection_of::<K>();
        self.lock()
            .objects
            .iter()
            .filter(|((c, _, _), v)| *c == collection && test(v))
            .count()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wake(&self, state: &State) {
        self.changed.send_replace(state.version);
    }

    /// Deletes, after the collector's delay, what removed owners owned.
    fn collect_garbage(&self) {
        let owners = std::mem::take(&mut self.lock().orphaned_owners);
        if owners.is_empty() {
            return;
        }
        let server = self.clone();
        let collect = async move {
            tokio::time::sleep(server.realism.gc_delay).await;
            let mut owners = owners;
            while !owners.is_empty() {
                {
                    let mut state = server.lock();
                    for uid in &owners {
                        for key in state.dependents(uid) {
                            state.delete(&key, server.realism.history);
                        }
                    }
                    server.wake(&state);
                }
                owners = std::mem::take(&mut server.lock().orphaned_owners);
            }
        };
        if let Some(runtime) = self
            .background
            .clone()
            .or_else(|| tokio::runtime::Handle::try_current().ok())
        {
            runtime.spawn(collect);
        }
    }

    fn count_request(&self, verb: &'static str) {
        self.total.fetch_add(1, Ordering::Relaxed);
        *self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(verb)
            .or_insert(0) += 1;
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

    /// Records `verb` on `target` among the accesses of a client of
    /// [`FakeApiServer::for_client`].
    fn record(&self, verb: &'static str, target: &Target) {
        if self.client == 0 {
            return;
        }
        let (group, resource) = group_and_resource(&target.collection);
        self.accesses
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(Access {
                verb,
                group: group.to_owned(),
                resource: resource.to_owned(),
                subresource: target.subresource.clone(),
                namespaced: target.namespace.is_some(),
            });
    }

    async fn serve(self, request: Request<Body>) -> Response<ReplyBody> {
        let method = request.method().clone();
        let path = request.uri().path().to_owned();
        let query = request.uri().query().unwrap_or_default().to_owned();
        let applying = request
            .headers()
            .get(http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes() == b"application/apply-patch+yaml");
        let body = request
            .into_body()
            .collect_bytes()
            .await
            .map(|b| serde_json::from_slice::<Value>(&b).unwrap_or(Value::Null))
            .unwrap_or(Value::Null);
        let Some(target) = Target::parse(&path) else {
            self.count_request("other");
            return reply(StatusCode::NOT_FOUND, &status(404, "NotFound", &path));
        };
        let watching = is_watch(&method, &target, &query);
        let verb = verb_of(&method, &target, watching);
        self.count_request(verb);
        self.record(verb, &target);
        if let Some(rules) = &self.rbac {
            let (group, resource) = group_and_resource(&target.collection);
            // A list or watch of one name (a `metadata.name` field
            // selector) is authorized for that name.
            let selected = Selector::of(&query, &target.collection)
                .ok()
                .and_then(|selector| selector.exact_name().map(str::to_owned));
            let request = rbac::Attributes {
                verb,
                group,
                resource,
                subresource: target.subresource.as_deref(),
                namespace: target.namespace.as_deref(),
                name: target.name.as_deref().or(selected.as_deref()),
            };
            if !rules.allows(&request) {
                return reply(StatusCode::FORBIDDEN, &rules.refuse(&request));
            }
        }
        if !self.realism.latency.is_zero() {
            request_latency(self.realism.latency).await;
        }
        let plan = match self.take_scripted(&method, &target) {
            Some(plan) => plan,
            None => self.faults.as_ref().map_or(faults::Plan::Serve, |f| {
                f.plan(self.client, &method, &target)
            }),
        };
        match plan {
            faults::Plan::Hang | faults::Plan::Crash { applied: false } => {
                return futures::future::pending().await;
            }
            faults::Plan::Before(fault) => {
                let (code, value) = self.answer(fault).await;
                return reply(code, &value);
            }
            _ => {}
        }
        if watching {
            return self.watch(&target, &query);
        }
        self.disorder().await;
        let record_status_write = method == Method::PUT
            && target.collection.ends_with("/flatnetworkips")
            && target.subresource.as_deref() == Some("status");
        let fail = record_status_write && self.roll(100) < self.failing_record_writes();
        // Half the failures happen before the write is applied, half after.
        if fail && self.roll(2) == 0 {
            return reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                &status(500, "InternalError", "injected"),
            );
        }
        let (code, value) = self.apply(&method, &target, &query, body, applying);
        self.collect_garbage();
        self.disorder().await;
        match plan {
            faults::Plan::Crash { .. } => return futures::future::pending().await,
            faults::Plan::After(fault) => {
                let (code, value) = self.answer(fault).await;
                return reply(code, &value);
            }
            _ => {}
        }
        if fail {
            return reply(
                StatusCode::INTERNAL_SERVER_ERROR,
                &status(500, "InternalError", "injected"),
            );
        }
        reply(code, &value)
    }

    /// The events of `target` after the request's resourceVersion, each
    /// no sooner than its kind's delay after it was written, in bursts;
    /// 410 Gone when that version is older than the history.
    fn watch(&self, target: &Target, query: &str) -> Response<ReplyBody> {
        let since: u64 = query_param(query, "resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| self.lock().version);
        let selector = match Selector::of(query, &target.collection) {
            Ok(selector) => selector,
            Err(refused) => return reply(StatusCode::BAD_REQUEST, &refused),
        };
        let timeout = query_param(query, "timeoutSeconds")
            .and_then(|t| t.parse().ok())
            .map_or(Duration::from_secs(290), Duration::from_secs);
        let collection = target.collection.clone();
        let namespace = target.namespace.clone();
        let delay = self.realism.delay_of(&collection);
        let burst = self.realism.burst;
        let server = self.clone();
        let cut = self.faults.as_ref().and_then(|f| f.watch_cut(self.client));
        let ends = Instant::now() + cut.map_or(timeout, |cut| cut.min(timeout));
        let events = futures::stream::unfold(
            (since, server.changed.subscribe(), false),
            move |(mut cursor, mut wake, gone)| {
                let server = server.clone();
                let collection = collection.clone();
                let namespace = namespace.clone();
                let selector = selector.clone();
                async move {
                    if gone {
                        return None;
                    }
                    let expired = || {
                        let gone = json!({"type": "ERROR", "object": status(410, "Expired", "too old resource version")});
                        line(&gone)
                    };
                    loop {
                        // The first change of this kind after the cursor.
                        let first_due = {
                            let state = server.lock();
                            if cursor < state.compacted {
                                return Some((expired(), (cursor, wake, true)));
                            }
                            let start = state.changes.partition_point(|c| c.version <= cursor);
                            state
                                .changes
                                .range(start..)
                                .find(|c| c.collection == collection)
                                .map(|c| c.at + delay)
                        };
                        if let Some(first_due) = first_due {
                            // A burst: every change due by the first one's
                            // time plus the burst window.
                            let until = first_due.max(Instant::now()) + burst;
                            if until > ends {
                                return None;
                            }
                            tokio::time::sleep_until(until).await;
                            let mut chunk = Vec::new();
                            let state = server.lock();
                            // Compacted while this burst waited: the changes
                            // after the cursor are gone, and a real server
                            // says so rather than skip them.
                            if cursor < state.compacted {
                                return Some((expired(), (cursor, wake, true)));
                            }
                            let start = state.changes.partition_point(|c| c.version <= cursor);
                            for c in state.changes.range(start..) {
                                if c.collection == collection {
                                    if c.at + delay > until {
                                        break;
                                    }
                                    let matches = namespace.as_ref().is_none_or(|n| *n == c.namespace)
                                        && selector.matches(&c.object);
                                    if matches {
                                        chunk.extend_from_slice(&line(&json!({"type": c.kind, "object": c.object})));
                                    }
                                }
                                cursor = c.version;
                            }
                            drop(state);
                            if chunk.is_empty() {
                                continue;
                            }
                            return Some((Bytes::from(chunk), (cursor, wake, false)));
                        }
                        tokio::select! {
                            changed = wake.changed() => if changed.is_err() { return None },
                            () = tokio::time::sleep_until(ends) => return None,
                        }
                    }
                }
            },
        )
        .map(|chunk| Ok(Frame::data(chunk)));
        Response::builder()
            .status(StatusCode::OK)
            .header("content-type", "application/json")
            .body(StreamBody::new(events.boxed()))
            .expect("response builds")
    }

    fn apply(
        &self,
        method: &Method,
        target: &Target,
        query: &str,
        mut body: Value,
        server_side_apply: bool,
    ) -> (StatusCode, Value) {
        let mut state = self.lock();
        let key = |name: &str| {
            (
                target.collection.clone(),
                target.namespace.clone().unwrap_or_default(),
                name.to_owned(),
            )
        };
        let mut method = method.clone();
        let mut name = target.name.as_deref();
        let manager = query_param(query, "fieldManager").unwrap_or(ownership::UNKNOWN);
        let applied = server_side_apply.then(|| body.clone());
        // A server-side apply of an object that does not exist creates it,
        // and is authorized for `create` as well as `patch` (the patch
        // handler asks once it knows it creates). One to a subresource
        // (`status`) never creates: 404, as below.
        if server_side_apply
            && method == Method::PATCH
            && target.subresource.is_none()
            && let Some(missing) = name.filter(|n| !state.objects.contains_key(&key(n)))
        {
            self.record("create", target);
            if let Some(rules) = &self.rbac {
                let (group, resource) = group_and_resource(&target.collection);
                let request = rbac::Attributes {
                    verb: "create",
                    group,
                    resource,
                    subresource: target.subresource.as_deref(),
                    namespace: target.namespace.as_deref(),
                    name: Some(missing),
                };
                if !rules.allows(&request) {
                    return (
                        StatusCode::FORBIDDEN,
                        rbac::Rbac::refuse_apply_create(&request),
                    );
                }
            }
            body["metadata"]["name"] = json!(missing);
            method = Method::POST;
            name = None;
        }
        match (method.clone(), name) {
            (Method::GET, None) => {
                // Pages after the first come from the list as it was when
                // the first was served, as a real server serves them.
                let (items, version) = match query_param(query, "continue")
                    .filter(|t| !t.is_empty())
                {
                    Some(token) => match token.parse().ok().and_then(|t| state.pages.remove(&t)) {
                        Some(rest) => rest,
                        None => {
                            return (
                                StatusCode::GONE,
                                status(410, "Expired", "the continue token has expired"),
                            );
                        }
                    },
                    None => {
                        let selector = match Selector::of(query, &target.collection) {
                            Ok(selector) => selector,
                            Err(refused) => return (StatusCode::BAD_REQUEST, refused),
                        };
                        let items: Vec<Value> = state
                            .objects
                            .iter()
                            .filter(|((c, ns, _), _)| {
                                *c == target.collection
                                    && target.namespace.as_ref().is_none_or(|n| n == ns)
                            })
                            .map(|(_, v)| v)
                            .filter(|v| selector.matches(v))
                            .cloned()
                            .collect();
                        (items, state.version.to_string())
                    }
                };
                let mut items = items;
                let limit = query_param(query, "limit")
                    .and_then(|l| l.parse::<usize>().ok())
                    .filter(|l| *l > 0);
                let rest = limit
                    .filter(|l| *l < items.len())
                    .map(|l| items.split_off(l));
                let mut metadata = json!({"resourceVersion": version});
                if let Some(rest) = rest {
                    metadata["remainingItemCount"] = json!(rest.len());
                    metadata["continue"] = json!(state.keep_page(rest, version).to_string());
                }
                (
                    StatusCode::OK,
                    json!({"apiVersion": "v1", "kind": "List", "metadata": metadata, "items": items}),
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
                // Every kind served here has a status subresource, whose
                // content a real server drops on create: only a write to
                // `/status` sets it.
                if let Some(fields) = value.as_object_mut() {
                    fields.remove("status");
                }
                if too_large(&value) {
                    return too_large_reply();
                }
                stamp_new(&mut state, &mut value);
                let mut owners = ownership::Owners::default();
                match &applied {
                    Some(applied) => {
                        let mut created = value.clone();
                        let scope = ownership::Scope::Object;
                        owners.apply(manager, scope, &Value::Null, &mut created, applied);
                    }
                    None => owners.update(manager, ownership::Scope::Object, &Value::Null, &value),
                }
                state.owners.insert(key(&name), owners);
                // Created after its owner went: the collector deletes it.
                for uid in owner_uids(&value) {
                    if !state.uids.contains(&uid) {
                        state.orphaned_owners.push(uid);
                    }
                }
                state.put(&key(&name), "ADDED", value.clone(), self.realism.history);
                self.wake(&state);
                (StatusCode::CREATED, value)
            }
            (Method::PUT | Method::PATCH, Some(name)) => {
                let Some(stored) = state.objects.get(&key(name)).cloned() else {
                    return not_found(name);
                };
                // Patches keep the stored version; a PUT must name one
                // unless the kind's strategy allows an unconditional update.
                let (group, resource) = group_and_resource(&target.collection);
                if method == Method::PUT
                    && unconditional(&body)
                    && !allows_unconditional_update(group)
                {
                    return (
                        StatusCode::UNPROCESSABLE_ENTITY,
                        version_required(group, resource, name),
                    );
                }
                let wanted_version = body["metadata"]["resourceVersion"].as_str().filter(|_| {
                    self.unchecked.is_none()
                        || self.unchecked != target.collection.rsplit('/').next()
                });
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
                let scope = if status_only {
                    ownership::Scope::Status
                } else {
                    ownership::Scope::Object
                };
                if let Some(applied) = &applied
                    && query_param(query, "force") != Some("true")
                {
                    let owners = state.owners.get(&key(name)).cloned().unwrap_or_default();
                    let conflicts = owners.conflicts(manager, scope, &stored, applied);
                    if !conflicts.is_empty() {
                        return (StatusCode::CONFLICT, apply_conflict(&conflicts));
                    }
                }
                let mut updated = stored.clone();
                if method == Method::PUT {
                    if status_only {
                        updated["status"] = body["status"].clone();
                    } else {
                        updated = body;
                        updated["status"] = stored["status"].clone();
                    }
                } else {
                    if applied.is_some() {
                        ownership::merge(&mut updated, &body);
                    } else {
                        merge_patch(&mut updated, &body);
                    }
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
                let mut owners = state.owners.get(&key(name)).cloned().unwrap_or_default();
                match &applied {
                    Some(applied) => owners.apply(manager, scope, &stored, &mut updated, applied),
                    None => owners.update(manager, scope, &stored, &updated),
                }
                if updated["spec"] != stored["spec"] {
                    let generation = stored["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
                    updated["metadata"]["generation"] = json!(generation);
                }
                if too_large(&updated) {
                    return too_large_reply();
                }
                state.owners.insert(key(name), owners);
                if updated == stored {
                    // A real server does not bump the version of a no-op write.
                    return (StatusCode::OK, updated);
                }
                if is_deleting(&updated) && !has_finalizers(&updated) {
                    state.remove(&key(name), self.realism.history);
                } else {
                    state.version += 1;
                    updated["metadata"]["resourceVersion"] = json!(state.version.to_string());
                    state.put(
                        &key(name),
                        "MODIFIED",
                        updated.clone(),
                        self.realism.history,
                    );
                }
                self.wake(&state);
                (StatusCode::OK, updated)
            }
            (Method::DELETE, Some(name)) => match state.delete(&key(name), self.realism.history) {
                Some(stored) => {
                    self.wake(&state);
                    (StatusCode::OK, stored)
                }
                None => not_found(name),
            },
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

/// The largest object etcd stores (its default `--max-request-bytes`).
pub const MAX_OBJECT_BYTES: usize = 1536 * 1024;

fn too_large(value: &Value) -> bool {
    serde_json::to_vec(value).map_or(true, |v| v.len() > MAX_OBJECT_BYTES)
}

fn too_large_reply() -> (StatusCode, Value) {
    (
        StatusCode::PAYLOAD_TOO_LARGE,
        status(
            413,
            "RequestEntityTooLarge",
            "etcdserver: request is too large",
        ),
    )
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

/// What a list or watch selects: equality label selectors
/// (`labelSelector=k=v,k2=v2`) and field selectors (`fieldSelector=`),
/// the field labels a real server supports for every kind
/// (`metadata.name`, `metadata.namespace`) and for pods (`spec.nodeName`,
/// `status.phase`), `=`/`==` and `!=`.
#[derive(Clone, Debug, Default)]
struct Selector {
    labels: Vec<(String, String)>,
    /// (JSON pointer, value, equal).
    fields: Vec<(String, String, bool)>,
}

impl Selector {
    /// The selector of `query` for `collection`; a field label the real
    /// server does not support for the kind is refused as it refuses it
    /// (400 BadRequest).
    fn of(query: &str, collection: &str) -> Result<Self, Value> {
        let decode = |s: &str| {
            s.replace("%3D", "=")
                .replace("%3d", "=")
                .replace("%2C", ",")
                .replace("%2c", ",")
                .replace("%2F", "/")
                .replace("%2f", "/")
                .replace("%21", "!")
        };
        let labels = query
            .split('&')
            .filter_map(|p| p.strip_prefix("labelSelector="))
            .flat_map(|s| {
                decode(s)
                    .split(',')
                    .filter_map(|kv| {
                        let (k, v) = kv.split_once('=')?;
                        Some((k.to_owned(), v.to_owned()))
                    })
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut fields = Vec::new();
        for term in query
            .split('&')
            .filter_map(|p| p.strip_prefix("fieldSelector="))
            .flat_map(|s| decode(s).split(',').map(str::to_owned).collect::<Vec<_>>())
            .filter(|t| !t.is_empty())
        {
            let (label, value, equal) = if let Some((l, v)) = term.split_once("!=") {
                (l, v, false)
            } else if let Some((l, v)) = term.split_once("==") {
                (l, v, true)
            } else if let Some((l, v)) = term.split_once('=') {
                (l, v, true)
            } else {
                return Err(status(
                    400,
                    "BadRequest",
                    &format!("invalid field selector: {term:?}"),
                ));
            };
            let pods = collection == "/v1/pods";
            let pointer = match label {
                "metadata.name" => "/metadata/name",
                "metadata.namespace" => "/metadata/namespace",
                "spec.nodeName" if pods => "/spec/nodeName",
                "status.phase" if pods => "/status/phase",
                _ => {
                    return Err(status(
                        400,
                        "BadRequest",
                        &format!("field label not supported: {label}"),
                    ));
                }
            };
            fields.push((pointer.to_owned(), value.to_owned(), equal));
        }
        Ok(Self { labels, fields })
    }

    /// The name an equality `metadata.name` field selector asks for (what
    /// a real server authorizes a list or watch as).
    fn exact_name(&self) -> Option<&str> {
        self.fields
            .iter()
            .find(|(pointer, _, equal)| pointer == "/metadata/name" && *equal)
            .map(|(_, name, _)| name.as_str())
    }

    /// Whether `object` is selected (an absent field reads as empty).
    fn matches(&self, object: &Value) -> bool {
        self.labels
            .iter()
            .all(|(k, want)| object["metadata"]["labels"][k].as_str() == Some(want))
            && self.fields.iter().all(|(pointer, want, equal)| {
                let value = object
                    .pointer(pointer)
                    .and_then(Value::as_str)
                    .unwrap_or("");
                (value == want) == *equal
            })
    }
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

/// The API group and resource (plural) of a collection (`group/version/plural`).
fn group_and_resource(collection: &str) -> (&str, &str) {
    let mut parts = collection.splitn(3, '/');
    let group = parts.next().unwrap_or_default();
    let resource = parts.nth(1).unwrap_or_default();
    (group, resource)
}

/// Whether `body` names no resourceVersion (absent, empty or `0`, which a
/// real server reads as none).
fn unconditional(body: &Value) -> bool {
    body["metadata"]["resourceVersion"]
        .as_str()
        .is_none_or(|v| v.is_empty() || v == "0")
}

/// Whether a real (v1.28) server accepts a PUT of a kind of `group`
/// without resourceVersion: the `AllowUnconditionalUpdate` of its
/// strategy. True for the built-in kinds of the groups listed; false for
/// Leases (coordination.k8s.io), webhook configurations
/// (admissionregistration.k8s.io), CustomResourceDefinitions and every
/// custom resource (`*.pandaria.io`, `k8s.cni.cncf.io`,
/// `macvlan.cluster.cattle.io`...).
fn allows_unconditional_update(group: &str) -> bool {
    match group {
        // pods, services, endpoints, namespaces, nodes, configmaps, secrets,
        // events...; deployments, daemonsets, statefulsets; jobs, cronjobs;
        // endpointslices; roles, bindings; events.
        ""
        | "apps"
        | "batch"
        | "discovery.k8s.io"
        | "rbac.authorization.k8s.io"
        | "events.k8s.io" => true,
        _ => false,
    }
}

/// The real server's 422 for a PUT without resourceVersion of a kind that
/// needs one (`apierrors.NewInvalid` on the resource, as its store does).
fn version_required(group: &str, resource: &str, name: &str) -> Value {
    let qualified = if group.is_empty() {
        resource.to_owned()
    } else {
        format!("{resource}.{group}")
    };
    let error = "Invalid value: 0x0: must be specified for an update";
    let mut value = status(
        422,
        "Invalid",
        &format!("{qualified} \"{name}\" is invalid: metadata.resourceVersion: {error}"),
    );
    value["details"] = json!({
        "name": name,
        "group": group,
        "kind": resource,
        "causes": [{"reason": "FieldValueInvalid", "message": error,
                    "field": "metadata.resourceVersion"}],
    });
    value
}

fn status(code: u16, reason: &str, message: &str) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": message, "reason": reason, "code": code})
}

/// The real server's 409 for an apply without `force` that would take
/// fields from other managers: `(manager as printed, field)` each.
fn apply_conflict(conflicts: &[(String, String)]) -> Value {
    let message = match conflicts {
        [(manager, field)] => {
            format!("Apply failed with 1 conflict: conflict with {manager}: {field}")
        }
        _ => {
            let mut by_manager: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
            for (manager, field) in conflicts {
                by_manager.entry(manager).or_default().push(field);
            }
            let lines: Vec<String> = by_manager
                .iter()
                .map(|(manager, fields)| {
                    let fields: Vec<String> = fields.iter().map(|f| format!("- {f}")).collect();
                    format!("conflicts with {manager}:\n{}", fields.join("\n"))
                })
                .collect();
            format!(
                "Apply failed with {} conflicts: {}",
                conflicts.len(),
                lines.join("\n")
            )
        }
    };
    let causes: Vec<Value> = conflicts
        .iter()
        .map(|(manager, field)| {
            json!({"reason": "FieldManagerConflict", "message": format!("conflict with {manager}"),
                   "field": field})
        })
        .collect();
    let mut value = status(409, "Conflict", &message);
    value["details"] = json!({"causes": causes});
    value
}

fn not_found(name: &str) -> (StatusCode, Value) {
    (StatusCode::NOT_FOUND, status(404, "NotFound", name))
}

fn reply(code: StatusCode, value: &Value) -> Response<ReplyBody> {
    let chunk = Bytes::from(serde_json::to_vec(value).expect("JSON serializes"));
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(StreamBody::new(
            futures::stream::once(async move { Ok(Frame::data(chunk)) }).boxed(),
        ))
        .expect("response builds")
}

/// One watch event as a line of the stream.
fn line(event: &Value) -> Bytes {
    let mut bytes = serde_json::to_vec(event).expect("JSON serializes");
    bytes.push(b'\n');
    Bytes::from(bytes)
}

/// The value of `name` in a query string.
fn query_param<'a>(query: &'a str, name: &str) -> Option<&'a str> {
    query
        .split('&')
        .find_map(|p| p.strip_prefix(name)?.strip_prefix('='))
}

/// Whether a request is a watch.
fn is_watch(method: &Method, target: &Target, query: &str) -> bool {
    method == Method::GET
        && target.name.is_none()
        && query_param(query, "watch").is_some_and(|w| w == "true" || w == "1")
}

/// The verb a request is counted under.
fn verb_of(method: &Method, target: &Target, watching: bool) -> &'static str {
    match (method.as_str(), target.name.is_some()) {
        _ if watching => "watch",
        ("GET", true) => "get",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", _) => "delete",
        _ => "other",
    }
}

impl tower::Service<Request<Body>> for FakeApiServer {
    type Response = Response<ReplyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ReplyBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let server = self.clone();
        Box::pin(async move {
            let method = request.method().clone();
            let query = request.uri().query().unwrap_or_default().to_owned();
            let target = Target::parse(request.uri().path());
            let reply = server.clone().serve(request).await;
            if let Some(target) = target {
                let watching = is_watch(&method, &target, &query);
                let resource = target.collection.rsplit('/').next().unwrap_or_default();
                let resource = match &target.subresource {
                    Some(sub) => format!("{resource}/{sub}"),
                    None => resource.to_owned(),
                };
                let key = format!(
                    "{} {resource} {}",
                    verb_of(&method, &target, watching),
                    reply.status().as_u16()
                );
                *server
                    .outcomes
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(key)
                    .or_insert(0) += 1;
            }
            Ok(reply)
        })
    }
}

#[cfg(test)]
mod tests;
