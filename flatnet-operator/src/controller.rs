//! What every controller of the operator shares: the API error with its
//! conflict and not-found tests, per-object retry backoff, the Condition
//! builder, and which pods are flat.

use std::{collections::HashMap, sync::Mutex, time::Duration};

use flatnet_k8s::keys::annotation;
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};
use kube::ResourceExt;

/// Where the operator's rights are granted, named when the API server
/// refuses it something.
pub const OPERATOR_RBAC: &str = "grant it in the flatnet-operator ClusterRole (or, in the release \
namespace, Role) of charts/flatnet/templates/operator-rbac.yaml";

/// `; <what was refused>: <where to grant it>` when `error` is a 403 (for
/// a request sent as `op` to `namespace`), else nothing.
pub(crate) fn forbidden_hint(error: &kube::Error, op: &str, namespace: Option<&str>) -> String {
    flatnet_k8s::forbidden::hint(error, op == "apply", namespace, OPERATOR_RBAC)
}

/// [`forbidden_hint`] for `op` on `object` (`kind namespace/name`).
fn object_hint(error: &kube::Error, op: &str, object: &str) -> String {
    let namespace = object
        .split_once(' ')
        .and_then(|(_, key)| key.split_once('/'))
        .map(|(ns, _)| ns);
    forbidden_hint(error, op, namespace)
}

/// A failed API call: what was attempted on which object; a refusal names
/// what was refused and where to grant it.
#[derive(Debug, thiserror::Error)]
#[error("{op} {object}: {source}{}", object_hint(.source, .op, .object))]
pub struct ApiError {
    /// What was attempted.
    pub op: &'static str,
    /// `kind namespace/name` of the object.
    pub object: String,
    /// The API error.
    #[source]
    pub source: Box<kube::Error>,
}

impl ApiError {
    /// Wraps the error of `op` on the `kind` object `key` (`namespace/name`
    /// or a cluster-scoped name).
    pub fn of(op: &'static str, kind: &str, key: &str) -> impl FnOnce(kube::Error) -> Self + use<> {
        let object = format!("{kind} {key}");
        move |source| Self {
            op,
            object,
            source: Box::new(source),
        }
    }
}

/// Whether an API error is a failed resourceVersion precondition (or a
/// create of a name that exists).
pub(crate) fn is_conflict(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 409)
}

/// How soon an object whose write got 409 Conflict is looked at again.
/// Waiting for the change that should follow is not enough: a 409 the
/// server did not apply to anything newer (an injected fault, a proxy
/// retrying) brings no event, and the object would wait forever.
pub(crate) const CONFLICT_RETRY: Duration = Duration::from_secs(1);

/// Whether an API error is "not found".
pub(crate) fn is_not_found(error: &kube::Error) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == 404)
}

/// Exponential retry delays per object, forgotten on success.
#[derive(Default)]
pub struct Backoff {
    failures: Mutex<HashMap<String, u32>>,
}

impl Backoff {
    /// First retry delay.
    const BASE: Duration = Duration::from_secs(1);
    /// Longest retry delay.
    const MAX: Duration = Duration::from_secs(300);

    /// The delay before the next retry of `key`, doubling per failure.
    pub fn next(&self, key: &str) -> Duration {
        let mut failures = self.failures.lock().unwrap_or_else(|e| e.into_inner());
        let count = failures.entry(key.to_owned()).or_insert(0);
        let delay = Self::BASE.saturating_mul(1 << (*count).min(16));
        *count = count.saturating_add(1);
        delay.min(Self::MAX)
    }

    /// Forgets the failures of `key`: its next failure waits the least.
    pub fn reset(&self, key: &str) {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
    }

    /// Objects with failures on record (tests).
    #[must_use]
    pub fn len(&self) -> usize {
        self.failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Whether no object has failures on record.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A Condition of `type_`, True when `ok`, stamped now and with the
/// generation of the spec it was computed from.
#[must_use]
pub fn condition(
    type_: &str,
    ok: bool,
    reason: &str,
    message: String,
    observed_generation: Option<i64>,
) -> Condition {
    Condition {
        type_: type_.into(),
        status: if ok { "True" } else { "False" }.into(),
        reason: reason.into(),
        message,
        observed_generation,
        last_transition_time: Time(Timestamp::now()),
    }
}

/// True when the pod asks for a flat address: both the `ip` and the `subnet`
/// annotations are non-empty, exactly the original's test.
#[must_use]
pub fn is_flat_pod<K: kube::Resource>(pod: &K) -> bool {
    let annotations = pod.annotations();
    [annotation::IP, annotation::SUBNET]
        .iter()
        .all(|key| annotations.get(*key).is_some_and(|v| !v.trim().is_empty()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forbidden(message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "Forbidden")
                .with_code(403)
                .boxed(),
        )
    }

    /// The real server's refusal of an apply's create says only `is
    /// forbidden: `; the error names what was refused and where to grant it.
    #[test]
    fn a_refused_apply_names_create_its_resource_group_namespace_and_the_role() {
        let error = ApiError::of("apply", "EndpointSlice", "shop/web-flat-network-x")(forbidden(
            "endpointslices.discovery.k8s.io \"web-flat-network-x\" is forbidden: ",
        ));
        let text = error.to_string();
        assert!(
            text.contains(
                "the API server refused to create endpointslices in API group \"discovery.k8s.io\" in the namespace \"shop\""
            ) && text.contains("needs create as well as patch")
                && text.ends_with(OPERATOR_RBAC),
            "{text}"
        );
        // A refusal by the authorization filter names its own verb.
        let error = ApiError::of("update", "ConfigMap", "cattle-flat-network/m")(forbidden(
            "configmaps \"m\" is forbidden: User \"system:serviceaccount:a:b\" cannot update \
             resource \"configmaps\" in API group \"\" in the namespace \"cattle-flat-network\"",
        ));
        assert!(
            error
                .to_string()
                .contains("refused to update configmaps in API group \"\" in the namespace \"cattle-flat-network\""),
            "{error}"
        );
        // Another error says nothing more.
        let error = ApiError::of("apply", "Service", "shop/s")(kube::Error::Api(
            kube::core::Status::failure("boom", "InternalError")
                .with_code(500)
                .boxed(),
        ));
        assert!(!error.to_string().contains("refused"), "{error}");
    }
}
