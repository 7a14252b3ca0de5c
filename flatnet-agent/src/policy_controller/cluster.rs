//! What the Kubernetes watchers have seen, reduced to what the policy
//! compiler needs: policies, namespace labels, labels and node of flat
//! pods, and their flat addresses (FlatNetworkIP `status.addr`; a
//! dual-stack pod has two records, `<pod>` and `<pod>.ipv6`). Pure; the
//! watchers feed it events ([`ClusterView`] methods), the controller takes
//! snapshots.

use std::{collections::BTreeMap, net::IpAddr};

use flatnet_k8s::{api::FlatNetworkIP, keys::annotation};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::{Resource, ResourceExt, runtime::watcher};

use super::PolicySnapshot;
use crate::policy_compiler::{FlatPod, MultiNetworkPolicy, selector::Labels};

/// `(namespace, name)`; the namespace is empty for cluster-scoped objects.
type ObjectKey = (String, String);

/// Objects of one kind, kept as the watcher reports them, relists included.
#[derive(Debug)]
struct Collection<T> {
    items: BTreeMap<ObjectKey, T>,
    /// A relist in progress: it replaces `items` when complete.
    relist: Option<BTreeMap<ObjectKey, T>>,
    /// Whether a first list completed.
    synced: bool,
}

impl<T> Default for Collection<T> {
    fn default() -> Self {
        Self {
            items: BTreeMap::new(),
            relist: None,
            synced: false,
        }
    }
}

impl<T> Collection<T> {
    /// Applies a watcher event; `extract` keeps what matters of an object
    /// (`None`: the object is not relevant, as if absent).
    fn apply<K: Resource>(&mut self, event: watcher::Event<K>, extract: impl Fn(&K) -> Option<T>) {
        match event {
            watcher::Event::Apply(object) => {
                let key = key_of(&object);
                match extract(&object) {
                    Some(value) => self.items.insert(key, value),
                    None => self.items.remove(&key),
                };
            }
            watcher::Event::Delete(object) => {
                self.items.remove(&key_of(&object));
            }
            watcher::Event::Init => self.relist = Some(BTreeMap::new()),
            watcher::Event::InitApply(object) => {
                if let (Some(relist), Some(value)) = (self.relist.as_mut(), extract(&object)) {
                    relist.insert(key_of(&object), value);
                }
            }
            watcher::Event::InitDone => {
                if let Some(relist) = self.relist.take() {
                    self.items = relist;
                }
                self.synced = true;
            }
        }
    }
}

fn key_of<K: Resource>(object: &K) -> ObjectKey {
    (
        object.meta().namespace.clone().unwrap_or_default(),
        object.meta().name.clone().unwrap_or_default(),
    )
}

/// Labels and node of a pod on the flat network.
#[derive(Clone, Debug, PartialEq)]
struct PodFacts {
    labels: Labels,
    node: Option<String>,
}

/// The cluster as the policy controller of node `node` sees it.
#[derive(Debug)]
pub struct ClusterView {
    node: String,
    policies: Collection<MultiNetworkPolicy>,
    namespaces: Collection<Labels>,
    pods: Collection<PodFacts>,
    /// Record → (its pod's name, the allocated address).
    addresses: Collection<(String, IpAddr)>,
    policy_api_missing: bool,
}

impl ClusterView {
    /// An empty view for node `node`.
    pub fn new(node: &str) -> Self {
        Self {
            node: node.to_owned(),
            policies: Collection::default(),
            namespaces: Collection::default(),
            pods: Collection::default(),
            addresses: Collection::default(),
            policy_api_missing: false,
        }
    }

    /// A MultiNetworkPolicy event.
    /// A MultiNetworkPolicy event. Returns whether it shows the API served
    /// again after it was found missing.
    pub fn policy_event(&mut self, event: watcher::Event<MultiNetworkPolicy>) -> bool {
        // `Init` opens every list, retries of a failing one included, before
        // the request is made: it says nothing of whether the API is served.
        let served = !matches!(event, watcher::Event::Init);
        let served_again = served && self.policy_api_missing;
        if served {
            self.policy_api_missing = false;
        }
        self.policies.apply(event, |p| Some(p.clone()));
        served_again
    }

    /// The MultiNetworkPolicy API is not served (CRD not installed): there
    /// are no policies, so every pod passes everything.
    pub fn policy_api_missing(&mut self) {
        self.policy_api_missing = true;
        self.policies = Collection::default();
    }

    /// Whether the MultiNetworkPolicy API was found missing.
    pub fn is_policy_api_missing(&self) -> bool {
        self.policy_api_missing
    }

    /// A Namespace event.
    pub fn namespace_event(&mut self, event: watcher::Event<Namespace>) {
        self.namespaces.apply(event, |ns| Some(ns.labels().clone()));
    }

    /// A Pod event; only pods with the flat-network subnet annotation
    /// are kept.
    pub fn pod_event(&mut self, event: watcher::Event<Pod>) {
        self.pods.apply(event, |pod| {
            pod.annotations()
                .contains_key(annotation::SUBNET)
                .then(|| PodFacts {
                    labels: pod.labels().clone(),
                    node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                })
        });
    }

    /// A FlatNetworkIP event; only allocated ones are kept.
    pub fn address_event(&mut self, event: watcher::Event<FlatNetworkIP>) {
        self.addresses.apply(event, |ip| {
            let addr = ip.status.as_ref().and_then(|s| s.addr)?;
            Some((ip.pod_name(), addr))
        });
    }

    /// The compiler's inputs, once every watcher has listed (the policy
    /// API may instead be missing); `None` before.
    pub fn snapshot(&self) -> Option<PolicySnapshot> {
        let policies_known = self.policies.synced || self.policy_api_missing;
        if !(policies_known && self.namespaces.synced && self.pods.synced && self.addresses.synced)
        {
            return None;
        }
        // A pod's records are in its namespace; a dual-stack pod has two.
        let mut addresses: BTreeMap<ObjectKey, Vec<IpAddr>> = BTreeMap::new();
        for ((namespace, _), (pod, addr)) in &self.addresses.items {
            addresses
                .entry((namespace.clone(), pod.clone()))
                .or_default()
                .push(*addr);
        }
        let pods = addresses
            .into_iter()
            .map(|(key, ips)| {
                let facts = self.pods.items.get(&key);
                let (namespace, name) = key;
                FlatPod {
                    labels: facts.map(|f| f.labels.clone()).unwrap_or_default(),
                    local: facts.is_some_and(|f| f.node.as_deref() == Some(self.node.as_str())),
                    namespace,
                    name,
                    ips,
                }
            })
            .collect();
        Some(PolicySnapshot {
            policies: self.policies.items.values().cloned().collect(),
            namespaces: self
                .namespaces
                .items
                .iter()
                .map(|((_, name), labels)| (name.clone(), labels.clone()))
                .collect(),
            pods,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(name: &str, node: &str, app: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "a", "labels": {"app": app},
                         "annotations": {"flatnetwork.pandaria.io/subnet": "lan"}},
            "spec": {"nodeName": node, "containers": []}
        }))
        .unwrap()
    }

    fn ip(name: &str, addr: &str) -> FlatNetworkIP {
        serde_json::from_value(json!({
            "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkIP",
            "metadata": {"name": name, "namespace": "a"},
            "spec": {"subnet": "lan"},
            "status": {"addr": addr}
        }))
        .unwrap()
    }

    fn synced_view() -> ClusterView {
        let mut view = ClusterView::new("node-1");
        view.policy_event(watcher::Event::InitDone);
        view.namespace_event(watcher::Event::InitDone);
        view.pod_event(watcher::Event::InitDone);
        view.address_event(watcher::Event::InitDone);
        view
    }

    #[test]
    fn no_snapshot_until_every_watcher_listed() {
        let mut view = ClusterView::new("node-1");
        view.namespace_event(watcher::Event::InitDone);
        view.pod_event(watcher::Event::InitDone);
        assert!(view.snapshot().is_none());
        view.address_event(watcher::Event::InitDone);
        assert!(view.snapshot().is_none(), "policies not listed yet");
        view.policy_api_missing();
        assert_eq!(view.snapshot(), Some(PolicySnapshot::default()));
    }

    /// The watcher opens each retry of a failing list with `Init`; only a
    /// list that succeeds shows the API is there (the agent said "served
    /// now" and "not installed" in turn, once a second, while it was not).
    #[test]
    fn a_retried_list_of_a_missing_policy_api_is_no_sign_it_is_served() {
        let mut view = synced_view();
        view.policy_api_missing();
        for _ in 0..3 {
            assert!(!view.policy_event(watcher::Event::Init));
            assert!(view.is_policy_api_missing());
            assert_eq!(view.snapshot(), Some(PolicySnapshot::default()));
        }
        assert!(view.policy_event(watcher::Event::InitDone));
        assert!(!view.is_policy_api_missing());
        assert!(!view.policy_event(watcher::Event::Init), "served already");
    }

    #[test]
    fn pods_join_labels_node_and_address() {
        let mut view = synced_view();
        view.pod_event(watcher::Event::Apply(pod("web", "node-1", "web")));
        view.pod_event(watcher::Event::Apply(pod("db", "node-2", "db")));
        view.address_event(watcher::Event::Apply(ip("web", "10.0.0.1")));
        view.address_event(watcher::Event::Apply(ip("db", "10.0.0.2")));
        let pods = view.snapshot().unwrap().pods;
        assert_eq!(pods.len(), 2);
        let web = pods.iter().find(|p| p.name == "web").unwrap();
        assert!(web.local);
        assert_eq!(web.labels["app"], "web");
        assert_eq!(web.ips, vec!["10.0.0.1".parse::<IpAddr>().unwrap()]);
        assert!(!pods.iter().find(|p| p.name == "db").unwrap().local);

        view.pod_event(watcher::Event::Delete(pod("db", "node-2", "db")));
        view.address_event(watcher::Event::Delete(ip("db", "10.0.0.2")));
        assert_eq!(view.snapshot().unwrap().pods.len(), 1);
    }

    #[test]
    fn a_dual_stack_pod_is_one_pod_with_both_addresses() {
        let mut view = synced_view();
        view.pod_event(watcher::Event::Apply(pod("web", "node-1", "web")));
        view.address_event(watcher::Event::Apply(ip("web", "10.0.0.1")));
        view.address_event(watcher::Event::Apply(ip("web.ipv6", "fd00::1")));
        let pods = view.snapshot().unwrap().pods;
        assert_eq!(pods.len(), 1, "{pods:?}");
        assert_eq!(pods[0].name, "web");
        assert!(pods[0].local);
        assert_eq!(pods[0].labels["app"], "web");
        let ips: Vec<IpAddr> = ["10.0.0.1", "fd00::1"]
            .iter()
            .map(|a| a.parse().unwrap())
            .collect();
        assert_eq!(pods[0].ips, ips);

        view.address_event(watcher::Event::Delete(ip("web.ipv6", "fd00::1")));
        assert_eq!(view.snapshot().unwrap().pods[0].ips, ips[..1]);
    }

    #[test]
    fn a_relist_replaces_what_it_does_not_repeat() {
        let mut view = synced_view();
        view.address_event(watcher::Event::Apply(ip("web", "10.0.0.1")));
        view.address_event(watcher::Event::Init);
        view.address_event(watcher::Event::InitApply(ip("db", "10.0.0.2")));
        // Until the relist completes the old view holds.
        assert_eq!(view.snapshot().unwrap().pods[0].name, "web");
        view.address_event(watcher::Event::InitDone);
        let pods = view.snapshot().unwrap().pods;
        assert_eq!(pods.len(), 1);
        assert_eq!(pods[0].name, "db");
    }

    #[test]
    fn pods_without_the_flat_annotation_are_ignored() {
        let mut view = synced_view();
        let mut plain = pod("plain", "node-1", "x");
        plain.metadata.annotations = None;
        view.pod_event(watcher::Event::Apply(plain));
        view.address_event(watcher::Event::Apply(ip("plain", "10.0.0.3")));
        let pods = view.snapshot().unwrap().pods;
        assert!(!pods[0].local && pods[0].labels.is_empty());
    }
}
