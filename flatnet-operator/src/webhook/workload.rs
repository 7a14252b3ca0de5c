//! Where the flat-network request of each reviewed kind lives, and which
//! workload an object or a pod belongs to.

use std::collections::BTreeMap;

use flatnet_k8s::keys::annotation;
use kube::core::DynamicObject;

pub use crate::workloads::owner::{WorkloadRef, controller};

/// The kinds the workload webhook reviews.
pub const KINDS: [&str; 7] = [
    "Pod",
    "Deployment",
    "ReplicaSet",
    "StatefulSet",
    "DaemonSet",
    "Job",
    "CronJob",
];

/// The three annotations that make up a flat-network request, as written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlatAnnotations {
    /// `flatnetwork.pandaria.io/subnet`.
    pub subnet: Option<String>,
    /// `flatnetwork.pandaria.io/ip`.
    pub ip: Option<String>,
    /// `flatnetwork.pandaria.io/mac`.
    pub mac: Option<String>,
}

impl FlatAnnotations {
    /// Reads the request from an annotation map.
    #[must_use]
    pub fn from_map(annotations: &BTreeMap<String, String>) -> Self {
        let get = |key: &str| annotations.get(key).cloned();
        Self {
            subnet: get(annotation::SUBNET),
            ip: get(annotation::IP),
            mac: get(annotation::MAC),
        }
    }

    /// Whether any of the three is present: the object asks for the flat network.
    #[must_use]
    pub fn is_requested(&self) -> bool {
        self.subnet.is_some() || self.ip.is_some() || self.mac.is_some()
    }
}

/// JSON path of the pod template's annotations for `kind`; `None` for kinds
/// that are not reviewed.
///
/// A CronJob's pods come from `spec.jobTemplate.spec.template` (the original
/// read the CronJob's own metadata there and never saw the request).
#[must_use]
pub fn annotations_pointer(kind: &str) -> Option<&'static str> {
    match kind {
        "Pod" => Some("/metadata/annotations"),
        "Deployment" | "ReplicaSet" | "StatefulSet" | "DaemonSet" | "Job" => {
            Some("/spec/template/metadata/annotations")
        }
        "CronJob" => Some("/spec/jobTemplate/spec/template/metadata/annotations"),
        _ => None,
    }
}

/// The field path of the pod template's annotations for `kind`, as
/// messages name it (`spec.template.metadata.annotations`); `None` for
/// kinds that are not reviewed.
#[must_use]
pub fn annotations_field(kind: &str) -> Option<String> {
    annotations_pointer(kind).map(|p| p.trim_start_matches('/').replace('/', "."))
}

/// The annotations of the pods `object` (of `kind`) makes: a Pod's own, a
/// workload's pod template's; empty for kinds that are not reviewed.
#[must_use]
pub fn pod_annotations(kind: &str, object: &DynamicObject) -> BTreeMap<String, String> {
    let Some(pointer) = annotations_pointer(kind) else {
        return BTreeMap::new();
    };
    if kind == "Pod" {
        return object.metadata.annotations.clone().unwrap_or_default();
    }
    // `data` holds everything but apiVersion, kind and metadata.
    let path = pointer.trim_start_matches("/spec");
    object
        .data
        .get("spec")
        .and_then(|spec| spec.pointer(path))
        .and_then(|value| serde_json::from_value(value.clone()).ok())
        .unwrap_or_default()
}

/// Why a workload of `kind` may run several pods at once, naming the field
/// (`spec.replicas 3`, `spec.parallelism 2`, or a DaemonSet's pod per
/// node); `None` when its spec runs one pod at a time (or it is a Pod).
#[must_use]
pub fn several_pods(kind: &str, object: &DynamicObject) -> Option<String> {
    let count = |path: &str, field: &str| {
        // Both default to 1.
        let n = object
            .data
            .pointer(path)
            .and_then(serde_json::Value::as_i64)
            .unwrap_or(1);
        (n > 1).then(|| format!("{field} {n}"))
    };
    match kind {
        "Deployment" | "ReplicaSet" | "StatefulSet" => count("/spec/replicas", "spec.replicas"),
        "DaemonSet" => Some("a pod on every node it selects".to_owned()),
        "Job" => count("/spec/parallelism", "spec.parallelism"),
        "CronJob" => count(
            "/spec/jobTemplate/spec/parallelism",
            "spec.jobTemplate.spec.parallelism",
        ),
        _ => None,
    }
}

/// The flat-network annotations of the pods `object` (of `kind`) makes.
#[must_use]
pub fn flat_annotations(kind: &str, object: &DynamicObject) -> FlatAnnotations {
    FlatAnnotations::from_map(&pod_annotations(kind, object))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn object(value: serde_json::Value) -> DynamicObject {
        serde_json::from_value(value).unwrap()
    }

    fn flat(subnet: &str) -> serde_json::Value {
        json!({"flatnetwork.pandaria.io/subnet": subnet, "flatnetwork.pandaria.io/ip": "auto"})
    }

    #[test]
    fn finds_the_pod_template_of_every_kind() {
        let template =
            json!({"metadata": {"annotations": flat("net1")}, "spec": {"containers": []}});
        let pod = object(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "annotations": flat("net1")}, "spec": {"containers": []},
        }));
        assert_eq!(
            flat_annotations("Pod", &pod).subnet.as_deref(),
            Some("net1")
        );
        for kind in [
            "Deployment",
            "ReplicaSet",
            "StatefulSet",
            "DaemonSet",
            "Job",
        ] {
            let obj = object(json!({
                "apiVersion": "apps/v1", "kind": kind,
                "metadata": {"name": "w"}, "spec": {"template": template},
            }));
            let found = flat_annotations(kind, &obj);
            assert_eq!(found.subnet.as_deref(), Some("net1"), "{kind}");
            assert_eq!(found.ip.as_deref(), Some("auto"), "{kind}");
        }
        let cron = object(json!({
            "apiVersion": "batch/v1", "kind": "CronJob",
            // Annotations on the CronJob itself are not the pods'.
            "metadata": {"name": "c", "annotations": flat("wrong")},
            "spec": {"schedule": "* * * * *", "jobTemplate": {"spec": {"template": template}}},
        }));
        assert_eq!(
            flat_annotations("CronJob", &cron).subnet.as_deref(),
            Some("net1")
        );
    }

    #[test]
    fn objects_without_the_annotations_request_nothing() {
        let deployment = object(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "w", "annotations": flat("net1")},
            "spec": {"template": {"metadata": {}}},
        }));
        assert!(!flat_annotations("Deployment", &deployment).is_requested());
        assert!(!flat_annotations("Service", &deployment).is_requested());
        assert_eq!(
            KINDS
                .iter()
                .filter(|k| annotations_pointer(k).is_some())
                .count(),
            7
        );
    }
}
