//! The Kubernetes policy controller against an in-process API server (a
//! `tower-test` mock answering lists, long-polled watches and Event
//! creation): the compiled tables follow changes of a policy, of a pod's
//! labels and of a namespace's labels; diagnostics become one Event per
//! policy change; a missing MultiNetworkPolicy CRD enforces nothing and
//! does not stop the controller.

use std::{
    collections::{BTreeMap, HashSet},
    net::IpAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use flatnet_agent::{
    datapath::{ApplyReport, DatapathError},
    policy_compiler::{CompiledPolicy, NetworkNames},
    policy_controller::PolicyMetrics,
    policy_controller::{PolicyController, PolicySink, PolicyTrigger, kubernetes},
};
use http::{Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};
use tokio::sync::mpsc;

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;
type Reply = tower_test::mock::SendResponse<Response<Body>>;

const POLICIES: &str = "/apis/k8s.cni.cncf.io/v1beta1/multi-networkpolicies";
const NAMESPACES: &str = "/api/v1/namespaces";
const PODS: &str = "/api/v1/pods";
const IPS: &str = "/apis/flatnetwork.pandaria.io/v1/flatnetworkips";

/// One collection: current objects, the change log and parked watches.
#[derive(Default)]
struct Collection {
    items: BTreeMap<String, Value>,
    log: Vec<(u64, Value)>,
    parked: Vec<(u64, Reply)>,
}

/// The fake API server's state.
#[derive(Default)]
struct Api {
    version: u64,
    collections: BTreeMap<&'static str, Collection>,
    missing: HashSet<&'static str>,
    events: Vec<Value>,
    /// Requests for MultiNetworkPolicies, answered or not.
    policy_requests: usize,
}

impl Api {
    fn put(&mut self, path: &'static str, mut object: Value) {
        self.version += 1;
        object["metadata"]["resourceVersion"] = json!(self.version.to_string());
        let key = format!(
            "{}/{}",
            object["metadata"]["namespace"].as_str().unwrap_or(""),
            object["metadata"]["name"].as_str().unwrap()
        );
        let collection = self.collections.entry(path).or_default();
        let kind = if collection.items.contains_key(&key) {
            "MODIFIED"
        } else {
            "ADDED"
        };
        collection.items.insert(key, object.clone());
        collection
            .log
            .push((self.version, json!({"type": kind, "object": object})));
        // Answer the watches waiting for news.
        for (since, reply) in std::mem::take(&mut collection.parked) {
            reply.send_response(watch_response(&collection.log, since));
        }
    }

    fn serve(&mut self, request: &Request<Body>, body: Value, reply: Reply) {
        let path = request.uri().path().to_owned();
        let query = request.uri().query().unwrap_or("").to_owned();
        if request.method() == "POST" && path.ends_with("/events") {
            self.events.push(body.clone());
            reply.send_response(json_response(StatusCode::CREATED, &body));
            return;
        }
        let Some(&name) = [POLICIES, NAMESPACES, PODS, IPS]
            .iter()
            .find(|p| **p == path)
        else {
            reply.send_response(json_response(StatusCode::NOT_FOUND, &not_found()));
            return;
        };
        if name == POLICIES {
            self.policy_requests += 1;
        }
        if self.missing.contains(name) {
            reply.send_response(json_response(StatusCode::NOT_FOUND, &not_found()));
            return;
        }
        let collection = self.collections.entry(name).or_default();
        if query.contains("watch=true") {
            let since: u64 = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("resourceVersion="))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            if collection.log.iter().any(|(v, _)| *v > since) {
                reply.send_response(watch_response(&collection.log, since));
            } else {
                collection.parked.push((since, reply));
            }
        } else {
            let list = json!({
                "apiVersion": "v1", "kind": "List",
                "metadata": {"resourceVersion": self.version.to_string()},
                "items": collection.items.values().collect::<Vec<_>>(),
            });
            reply.send_response(json_response(StatusCode::OK, &list));
        }
    }
}

fn watch_response(log: &[(u64, Value)], since: u64) -> Response<Body> {
    let mut text = String::new();
    for (_, event) in log.iter().filter(|(v, _)| *v > since) {
        text.push_str(&event.to_string());
        text.push('\n');
    }
    Response::builder()
        .status(StatusCode::OK)
        .body(Body::from(text.into_bytes()))
        .unwrap()
}

fn json_response(status: StatusCode, value: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .body(Body::from(serde_json::to_vec(value).unwrap()))
        .unwrap()
}

fn not_found() -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
           "message": "the server could not find the requested resource",
           "reason": "NotFound", "code": 404})
}

/// Serves requests from `handle` until the client is gone.
async fn serve(mut handle: Handle, api: Arc<Mutex<Api>>) {
    while let Some((request, reply)) = handle.next_request().await {
        let (parts, body) = request.into_parts();
        let bytes = body.collect_bytes().await.unwrap();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        let request = Request::from_parts(parts, Body::empty());
        api.lock().unwrap().serve(&request, body, reply);
    }
}

/// Hands every compiled policy to the test.
struct Recording(mpsc::UnboundedSender<CompiledPolicy>);

impl PolicySink for Recording {
    fn install(&mut self, compiled: &CompiledPolicy) -> Result<ApplyReport, DatapathError> {
        let _ = self.0.send(compiled.clone());
        Ok(ApplyReport::default())
    }
}

fn namespace(name: &str, team: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace",
           "metadata": {"name": name, "labels": {"team": team}}})
}

fn pod(namespace: &str, name: &str, node: &str, app: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": namespace, "labels": {"app": app},
                        "annotations": {"flatnetwork.pandaria.io/subnet": "lan"}},
           "spec": {"nodeName": node, "containers": []}})
}

fn flat_ip(namespace: &str, name: &str, addr: &str) -> Value {
    json!({"apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkIP",
           "metadata": {"name": name, "namespace": namespace},
           "spec": {"subnet": "lan"}, "status": {"addr": addr}})
}

/// Ingress of app=web in namespace `a`: TCP `port` from app=client pods
/// in team=b namespaces.
fn policy(port: Value) -> Value {
    json!({"apiVersion": "k8s.cni.cncf.io/v1beta1", "kind": "MultiNetworkPolicy",
           "metadata": {"name": "web", "namespace": "a",
                        "annotations": {"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}},
           "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                    "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "b"}},
                                           "podSelector": {"matchLabels": {"app": "client"}}}],
                                 "ports": [{"port": port}]}]}})
}

const WEB: &str = "10.0.0.1";
const CLIENT: &str = "10.0.0.2";

/// The ports web's ingress allows from the client, `None` when web is not
/// isolated.
fn client_ports(compiled: &CompiledPolicy) -> Option<Vec<(u16, u16)>> {
    let web: IpAddr = WEB.parse().unwrap();
    let table = compiled.subjects.get(&web)?.ingress.as_ref()?;
    Some(
        table
            .longest_match(CLIENT.parse().unwrap())
            .unwrap_or_default()
            .iter()
            .map(|s| (s.port_min, s.port_max))
            .collect(),
    )
}

struct Cluster {
    api: Arc<Mutex<Api>>,
    compiled: mpsc::UnboundedReceiver<CompiledPolicy>,
    metrics: PolicyMetrics,
}

impl Cluster {
    fn start(api: Api) -> Self {
        let api = Arc::new(Mutex::new(api));
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        tokio::spawn(serve(handle, Arc::clone(&api)));
        let client = kube::Client::new(service, "default");
        let (sender, compiled) = mpsc::unbounded_channel();
        let metrics = PolicyMetrics::default();
        let controller =
            PolicyController::new(Recording(sender), NetworkNames::default(), metrics.clone());
        let run_metrics = metrics.clone();
        tokio::spawn(async move {
            kubernetes::run(
                client,
                "node-1",
                controller,
                run_metrics,
                PolicyTrigger::new(),
            )
            .await;
        });
        Self {
            api,
            compiled,
            metrics,
        }
    }

    fn put(&self, path: &'static str, object: Value) {
        self.api.lock().unwrap().put(path, object);
    }

    /// The first compiled policy for which `done` holds.
    async fn until(
        &mut self,
        what: &str,
        done: impl Fn(&CompiledPolicy) -> bool,
    ) -> CompiledPolicy {
        // A bound on waiting for a round that never comes, not a timing check.
        tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let compiled = self.compiled.recv().await.expect("controller stopped");
                if done(&compiled) {
                    return compiled;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no compiled policy where {what}"))
    }
}

fn populated() -> Api {
    let mut api = Api::default();
    api.put(NAMESPACES, namespace("a", "a"));
    api.put(NAMESPACES, namespace("b", "b"));
    api.put(PODS, pod("a", "web", "node-1", "web"));
    api.put(PODS, pod("b", "client", "node-2", "client"));
    api.put(IPS, flat_ip("a", "web", WEB));
    api.put(IPS, flat_ip("b", "client", CLIENT));
    api
}

#[tokio::test]
async fn tables_follow_policy_pod_label_and_namespace_label_changes() {
    let mut api = populated();
    api.put(POLICIES, policy(json!(80)));
    let mut cluster = Cluster::start(api);

    let first = cluster
        .until("the client may reach web on 80", |c| {
            client_ports(c) == Some(vec![(80, 80)])
        })
        .await;
    assert!(
        !first.subjects.contains_key(&CLIENT.parse().unwrap()),
        "the client runs on another node: a peer, without tables"
    );

    // The client pod loses its label: no longer a peer.
    cluster.put(PODS, pod("b", "client", "node-2", "other"));
    cluster
        .until("the relabelled client is denied", |c| {
            client_ports(c) == Some(vec![])
        })
        .await;
    cluster.put(PODS, pod("b", "client", "node-2", "client"));
    cluster
        .until("the client is allowed again", |c| {
            client_ports(c) == Some(vec![(80, 80)])
        })
        .await;

    // Its namespace changes teams: no longer selected.
    cluster.put(NAMESPACES, namespace("b", "c"));
    cluster
        .until("the client's namespace no longer matches", |c| {
            client_ports(c) == Some(vec![])
        })
        .await;
    cluster.put(NAMESPACES, namespace("b", "b"));

    // The policy changes its port.
    cluster.put(POLICIES, policy(json!(8080)));
    cluster
        .until("the new port is in force", |c| {
            client_ports(c) == Some(vec![(8080, 8080)])
        })
        .await;
    assert!(cluster.metrics.applies.get() >= 5);
    assert_eq!(cluster.metrics.policies.get(), 1);
    assert!(
        cluster.api.lock().unwrap().events.is_empty(),
        "nothing to report"
    );
}

#[tokio::test]
async fn diagnostics_become_one_event_per_policy_change() {
    let mut api = populated();
    api.put(POLICIES, policy(json!("http")));
    let mut cluster = Cluster::start(api);
    cluster
        .until("the named port is reported", |c| !c.diagnostics.is_empty())
        .await;
    // An unrelated change compiles again; the policy did not change.
    cluster.put(PODS, pod("a", "web2", "node-1", "web"));
    cluster.put(IPS, flat_ip("a", "web2", "10.0.0.3"));
    cluster
        .until("the new pod has tables", |c| {
            c.subjects.contains_key(&"10.0.0.3".parse().unwrap())
        })
        .await;
    let events = cluster.api.lock().unwrap().events.clone();
    assert_eq!(events.len(), 1, "{events:#?}");
    assert_eq!(events[0]["reason"], "PolicyNotEnforcedAsWritten");
    assert_eq!(events[0]["regarding"]["kind"], "MultiNetworkPolicy");
    assert_eq!(events[0]["regarding"]["name"], "web");
    assert!(
        events[0]["note"].as_str().unwrap().contains("named port"),
        "{}",
        events[0]["note"]
    );
    assert_eq!(cluster.metrics.diagnostics.get(), 1);
}

/// A missing CRD is asked for again with a growing pause, not every 0.8 s
/// (each retried list opens with an event that reset the backoff).
#[tokio::test(start_paused = true)]
async fn a_missing_crd_is_asked_for_with_a_growing_pause() {
    let mut api = populated();
    api.missing.insert(POLICIES);
    let mut cluster = Cluster::start(api);
    cluster.until("a round without policies", |_| true).await;
    let before = cluster.api.lock().unwrap().policy_requests;
    // Ten minutes of virtual time: a pause growing to kube's 30 s cap asks
    // about 25 times; a pause reset at every retry, 750 times.
    tokio::time::sleep(Duration::from_secs(600)).await;
    let asked = cluster.api.lock().unwrap().policy_requests - before;
    assert!(
        (1..=40).contains(&asked),
        "{asked} requests for the missing API in 10 minutes"
    );
    assert_eq!(cluster.metrics.source_problem.get(), 1);
}

#[tokio::test]
async fn without_the_crd_nothing_is_isolated_and_the_controller_keeps_running() {
    let mut api = populated();
    api.missing.insert(POLICIES);
    let mut cluster = Cluster::start(api);
    let compiled = cluster.until("a round without policies", |_| true).await;
    assert!(
        compiled
            .subjects
            .values()
            .all(|s| s.ingress.is_none() && s.egress.is_none())
    );
    assert_eq!(cluster.metrics.source_problem.get(), 1);
    // Other changes are still followed.
    cluster.put(PODS, pod("a", "web3", "node-1", "web"));
    cluster.put(IPS, flat_ip("a", "web3", "10.0.0.4"));
    cluster
        .until("the new pod is seen", |c| {
            c.subjects.contains_key(&"10.0.0.4".parse().unwrap())
        })
        .await;
}
