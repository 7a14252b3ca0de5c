//! Kubernetes mode: watchers (no polling) on MultiNetworkPolicies,
//! Namespaces, Pods and FlatNetworkIPs feed a [`ClusterView`]; every event
//! triggers the (debounced) controller. Compiler diagnostics become Events
//! on the MultiNetworkPolicy concerned.
//!
//! When the MultiNetworkPolicy CRD is not installed the agent says so once,
//! sets `flatnet_agent_policy_source_problem`, enforces nothing (there are
//! no policies) and keeps retrying with backoff until the API appears.

use std::{
    fmt::Debug,
    sync::{Arc, Mutex},
};

use flatnet_k8s::{api::FlatNetworkIP, events::EventRecorder};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::{
    Api, Client, Resource,
    runtime::{
        events::{Event, EventType, Reporter},
        utils::Backoff as _,
        watcher::{self, DefaultBackoff, watcher},
    },
};
use serde::de::DeserializeOwned;

use super::{
    PolicyChanges, PolicyController, PolicyMetrics, PolicySink, PolicyTrigger,
    cluster::ClusterView, report::DiagnosticEvents,
};
use crate::{desired::kubernetes::FIELD_MANAGER, policy_compiler::MultiNetworkPolicy};

/// Longest Event note (the API server rejects longer ones).
const MAX_NOTE: usize = 1000;

/// Runs the controller for node `node` until the process ends; the
/// watchers signal through `trigger` (which the CNI service holds too).
pub async fn run<S: PolicySink>(
    client: Client,
    node: &str,
    controller: PolicyController<S>,
    metrics: PolicyMetrics,
    (trigger, changes): (PolicyTrigger, PolicyChanges),
) {
    let view = Arc::new(Mutex::new(ClusterView::new(node)));
    let policies: Api<MultiNetworkPolicy> = Api::all(client.clone());
    let feed = Feed {
        view: Arc::clone(&view),
        trigger: trigger.clone(),
        metrics: metrics.clone(),
    };
    tokio::spawn(follow(policies, feed.clone(), {
        let metrics = metrics.clone();
        move |view, event| {
            if view.policy_event(event) {
                tracing::info!("the MultiNetworkPolicy API is served now; enforcing policies");
                metrics.source_problem.set(0);
            }
        }
    }));
    tokio::spawn(follow(
        Api::<Namespace>::all(client.clone()),
        feed.clone(),
        ClusterView::namespace_event,
    ));
    tokio::spawn(follow(
        Api::<Pod>::all(client.clone()),
        feed.clone(),
        ClusterView::pod_event,
    ));
    tokio::spawn(follow(
        Api::<FlatNetworkIP>::all(client.clone()),
        feed,
        ClusterView::address_event,
    ));
    drop(trigger);
    let events = PolicyEvents {
        recorder: EventRecorder::new(
            client,
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(node.to_owned()),
            },
        ),
    };
    let snapshot_view = Arc::clone(&view);
    controller
        .run(
            changes,
            move || snapshot_view.lock().expect("view lock").snapshot(),
            events,
        )
        .await;
}

/// What every watch feeds.
#[derive(Clone)]
struct Feed {
    view: Arc<Mutex<ClusterView>>,
    trigger: PolicyTrigger,
    metrics: PolicyMetrics,
}

/// Feeds every event of a watch on `api` into the view (through `apply`)
/// and triggers the controller. Errors are retried with backoff; a missing
/// MultiNetworkPolicy API is recorded in the view.
///
/// The backoff is kube's default, reset only by an event that shows the
/// API answering: kube's `StreamBackoff` also resets on the `Init` that
/// opens every retried list, so a missing CRD was listed every 0.8 s by
/// every agent, for as long as it stayed missing.
async fn follow<K>(
    api: Api<K>,
    feed: Feed,
    apply: impl Fn(&mut ClusterView, watcher::Event<K>) + Send + 'static,
) where
    K: Resource + Clone + DeserializeOwned + Debug + Send + 'static,
    K::DynamicType: Default,
{
    let kind = K::kind(&K::DynamicType::default()).into_owned();
    let mut stream = watcher(api, watcher::Config::default()).boxed();
    let mut backoff = DefaultBackoff::default();
    let mut last_error = String::new();
    loop {
        let next = stream.try_next().await;
        match &next {
            Ok(Some(watcher::Event::Init)) => {}
            Ok(_) => backoff.reset(),
            Err(_) => {
                if let Some(pause) = backoff.next() {
                    tokio::time::sleep(pause).await;
                }
            }
        }
        match next {
            Ok(Some(event)) => {
                last_error.clear();
                apply(&mut feed.view.lock().expect("view lock"), event);
                feed.trigger.changed();
            }
            Ok(None) => return,
            Err(error) if kind == "MultiNetworkPolicy" && is_not_found(&error) => {
                let mut view = feed.view.lock().expect("view lock");
                if !view.is_policy_api_missing() {
                    feed.metrics.source_problem.set(1);
                    tracing::warn!(
                        "the MultiNetworkPolicy CRD (k8s.cni.cncf.io/v1beta1) is not installed: no network policy is enforced on flat-network pods; install it (for example with the multi-networkpolicy project's CRD) and the agent picks it up"
                    );
                    view.policy_api_missing();
                    feed.trigger.changed();
                }
            }
            Err(error) => {
                // The watcher retries with backoff; say it once per kind of failure.
                let message = error.to_string();
                if message != last_error {
                    tracing::warn!(%kind, %error, "watch failed; retrying with backoff");
                    last_error = message;
                }
            }
        }
    }
}

fn is_not_found(error: &watcher::Error) -> bool {
    match error {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status)) => status.code == 404,
        _ => false,
    }
}

/// Publishes diagnostics as Warning Events on the policy.
struct PolicyEvents {
    recorder: EventRecorder,
}

impl DiagnosticEvents for PolicyEvents {
    async fn publish(&mut self, policy: &MultiNetworkPolicy, messages: &[String]) {
        let mut note = messages.join("; ");
        if note.len() > MAX_NOTE {
            let mut cut = MAX_NOTE - 3;
            while !note.is_char_boundary(cut) {
                cut -= 1;
            }
            note.truncate(cut);
            note.push_str("...");
        }
        let event = Event {
            type_: EventType::Warning,
            reason: "PolicyNotEnforcedAsWritten".into(),
            note: Some(note),
            action: "CompilePolicy".into(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, &policy.object_ref(&())).await {
            tracing::warn!(%error, "cannot publish an Event on a MultiNetworkPolicy");
        }
    }
}
