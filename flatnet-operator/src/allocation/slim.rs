//! What the controllers' caches keep of each object: only what the
//! controllers read, so the operator's memory follows the number of pods,
//! not their size.
//!
//! A pod in a cluster carries its full spec, its status and its
//! `managedFields`, often several KiB; the allocation controllers read its
//! metadata (name, uid, labels, annotations, owners, deletion) and
//! `spec.nodeName` only, so the pod watch reads pods as [`CachedPod`]
//! (about 400 bytes and its strings, where a `Pod` is a fixed 2,176 bytes
//! with its spec inline even when empty). Records and subnets lose their
//! `managedFields`. Each watch strips its objects before the cache stores
//! them ([`crate::cache::cached_controller`]).

use k8s_openapi::{api::core::v1::Pod, apimachinery::pkg::apis::meta::v1::ObjectMeta};
use kube::{Resource, ResourceExt};
use serde::{Deserialize, Serialize};

/// A pod as the allocation controllers keep it: its metadata and the node
/// it is bound to. Read straight from the API server's JSON (the rest of
/// the pod is skipped while parsing), and served under the pod's own
/// kind and path.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct CachedPod {
    /// The pod's metadata (less what [`pod`] drops).
    pub metadata: ObjectMeta,
    /// `spec.nodeName`, when the pod is bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<CachedPodSpec>,
}

/// The part of a pod's spec the controllers read.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CachedPodSpec {
    /// The node the pod is bound to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
}

impl CachedPod {
    /// The node the pod is bound to, if any.
    #[must_use]
    pub fn node_name(&self) -> Option<&str> {
        self.spec.as_ref().and_then(|s| s.node_name.as_deref())
    }
}

impl k8s_openapi::Resource for CachedPod {
    const API_VERSION: &'static str = <Pod as k8s_openapi::Resource>::API_VERSION;
    const GROUP: &'static str = <Pod as k8s_openapi::Resource>::GROUP;
    const KIND: &'static str = <Pod as k8s_openapi::Resource>::KIND;
    const VERSION: &'static str = <Pod as k8s_openapi::Resource>::VERSION;
    const URL_PATH_SEGMENT: &'static str = <Pod as k8s_openapi::Resource>::URL_PATH_SEGMENT;
    type Scope = <Pod as k8s_openapi::Resource>::Scope;
}

impl k8s_openapi::Metadata for CachedPod {
    type Ty = ObjectMeta;

    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl From<&Pod> for CachedPod {
    fn from(full: &Pod) -> Self {
        let mut cached = Self {
            metadata: full.metadata.clone(),
            spec: full.spec.as_ref().map(|spec| CachedPodSpec {
                node_name: spec.node_name.clone(),
            }),
        };
        pod(&mut cached);
        cached
    }
}

/// The annotation `kubectl apply` leaves: a copy of the whole object.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Drops from a cached pod's metadata `managedFields` and the
/// last-applied copy.
pub fn pod(pod: &mut CachedPod) {
    metadata(pod);
    pod.annotations_mut().remove(LAST_APPLIED);
}

/// Drops what no controller reads from any object's metadata.
pub fn metadata<K: Resource>(object: &mut K) {
    object.meta_mut().managed_fields = None;
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
    use serde_json::json;

    use super::*;

    #[test]
    fn a_pod_keeps_what_the_controllers_read() {
        let full: Pod = serde_json::from_value(json!({
            "metadata": {
                "name": "web-1", "namespace": "shop", "uid": "u1",
                "labels": {"app": "web"},
                "annotations": {
                    "flatnetwork.pandaria.io/ip": "auto",
                    LAST_APPLIED: "{\"a\": \"copy\"}",
                },
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet",
                                     "name": "web", "uid": "s1", "controller": true}],
                "managedFields": [{"manager": "kubectl", "operation": "Apply"}],
            },
            "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "pause"}]},
            "status": {"phase": "Running", "podIP": "10.0.0.9"},
        }))
        .unwrap();
        let kept = full.metadata.clone();
        let full = CachedPod::from(&full);
        assert_eq!(full.metadata.name, kept.name);
        assert_eq!(full.metadata.uid, kept.uid);
        assert_eq!(full.metadata.labels, kept.labels);
        assert_eq!(full.metadata.owner_references, kept.owner_references);
        assert_eq!(
            full.annotations().keys().collect::<Vec<_>>(),
            ["flatnetwork.pandaria.io/ip"]
        );
        assert_eq!(
            full.metadata.managed_fields,
            None::<Vec<ManagedFieldsEntry>>
        );
        assert_eq!(full.node_name(), Some("node-1"));
    }

    #[test]
    fn a_pod_read_from_json_keeps_its_metadata_and_node_only() {
        let text = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "web-1", "namespace": "shop", "uid": "u1"},
            "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "pause"}]},
            "status": {"phase": "Running"},
        });
        let cached: CachedPod = serde_json::from_value(text).unwrap();
        assert_eq!(cached.name_any(), "web-1");
        assert_eq!(cached.namespace().as_deref(), Some("shop"));
        assert_eq!(cached.node_name(), Some("node-1"));
        // Served as pods are.
        assert_eq!(CachedPod::kind(&()), "Pod");
        assert_eq!(CachedPod::plural(&()), "pods");
        assert_eq!(CachedPod::api_version(&()), "v1");
    }
}
