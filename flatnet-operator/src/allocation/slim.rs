//! What the controllers' caches keep of each object: only what the
//! controllers read, so the operator's memory follows the number of pods,
//! not their size.
//!
//! A pod in a cluster carries its full spec, its status and its
//! `managedFields`, often several KiB; the allocation controllers read its
//! metadata (name, uid, labels, annotations, owners, deletion) and
//! `spec.nodeName` only. Records and subnets lose their `managedFields`.
//! Each watch strips its objects before the cache stores them
//! ([`cached_controller`]).

use std::{fmt::Debug, hash::Hash};

use k8s_openapi::api::core::v1::{Pod, PodSpec};
use kube::{
    Api, Resource, ResourceExt,
    runtime::{Controller, WatchStreamExt, reflector, watcher},
};
use serde::de::DeserializeOwned;

/// The annotation `kubectl apply` leaves: a copy of the whole object.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// A controller of every `K` whose cache holds the objects as `slim`
/// leaves them.
pub fn cached_controller<K>(api: Api<K>, slim: impl FnMut(&mut K) + Send + 'static) -> Controller<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Unpin,
{
    let (reader, writer) = reflector::store();
    let objects = reflector(
        writer,
        watcher(api, watcher::Config::default()).modify(slim),
    )
    .applied_objects();
    Controller::for_stream(objects, reader)
}

/// Keeps of a pod its metadata (less `managedFields` and the
/// last-applied copy) and `spec.nodeName`.
pub fn pod(pod: &mut Pod) {
    metadata(pod);
    pod.annotations_mut().remove(LAST_APPLIED);
    pod.spec = pod.spec.take().map(|spec| PodSpec {
        node_name: spec.node_name,
        ..PodSpec::default()
    });
    pod.status = None;
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
        let mut full: Pod = serde_json::from_value(json!({
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
        pod(&mut full);
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
        let spec = full.spec.unwrap();
        assert_eq!(spec.node_name.as_deref(), Some("node-1"));
        assert!(spec.containers.is_empty());
        assert!(full.status.is_none());
    }
}
