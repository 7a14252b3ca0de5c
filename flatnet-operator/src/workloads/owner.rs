//! Which workload an object or a pod belongs to, and its `reservedIP` key.
//!
//! One answer for the three readers of `status.reservedIP`: the workload
//! controller writes it under [`WorkloadRef::key`], the webhook refuses
//! another workload's addresses at admission, and the allocator hands a
//! reserved address only to a pod whose [`workload_of`] holds it.

use std::fmt;

use k8s_openapi::{
    api::{apps::v1::ReplicaSet, batch::v1::Job},
    apimachinery::pkg::apis::meta::v1::OwnerReference,
};
use kube::{Api, Client, Resource, ResourceExt};

/// A workload (or a bare pod) identified by kind, namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct WorkloadRef {
    /// Kind, e.g. `Deployment`; `Pod` for a pod without a controller.
    pub kind: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

impl WorkloadRef {
    /// A reference from its parts.
    #[must_use]
    pub fn new(kind: &str, namespace: &str, name: &str) -> Self {
        Self {
            kind: kind.to_owned(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }

    /// Its key in a subnet's `status.reservedIP`: `<Kind>/<namespace>/<name>`,
    /// as the original wrote it.
    #[must_use]
    pub fn key(&self) -> String {
        format!("{}/{}/{}", self.kind, self.namespace, self.name)
    }
}

impl fmt::Display for WorkloadRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}/{}", self.kind, self.namespace, self.name)
    }
}

/// The controller among `owners`, if any.
#[must_use]
pub fn controller(owners: &[OwnerReference]) -> Option<&OwnerReference> {
    owners.iter().find(|o| o.controller == Some(true))
}

/// Reading an intermediate owner (a ReplicaSet or Job) failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {kind} {namespace}/{name}: {source}")]
pub struct OwnerError {
    /// `ReplicaSet` or `Job`.
    pub kind: String,
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// The API error.
    #[source]
    pub source: Box<kube::Error>,
}

/// The workload an object of `kind` named `name` belongs to, following its
/// controller: a ReplicaSet up to its Deployment, a Job up to its CronJob
/// (the kinds the workload controller keys reservations by). An object
/// without a controller is its own workload.
///
/// # Errors
/// Reading the ReplicaSet or Job failed (not found is fine: the owner is
/// then the workload).
pub async fn workload_of(
    client: &Client,
    kind: &str,
    namespace: &str,
    name: &str,
    owners: &[OwnerReference],
) -> Result<WorkloadRef, OwnerError> {
    let Some(owner) = controller(owners) else {
        return Ok(WorkloadRef::new(kind, namespace, name));
    };
    let parent_owner = match owner.kind.as_str() {
        "ReplicaSet" => owners_of::<ReplicaSet>(client, namespace, &owner.name).await?,
        "Job" => owners_of::<Job>(client, namespace, &owner.name).await?,
        _ => None,
    };
    let top = parent_owner
        .as_ref()
        .and_then(|owners| controller(owners))
        .filter(|o| matches!(o.kind.as_str(), "Deployment" | "CronJob"))
        .unwrap_or(owner);
    Ok(WorkloadRef::new(&top.kind, namespace, &top.name))
}

async fn owners_of<K>(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Option<Vec<OwnerReference>>, OwnerError>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>
        + Clone
        + serde::de::DeserializeOwned
        + std::fmt::Debug,
{
    let api: Api<K> = Api::namespaced(client.clone(), namespace);
    let object = api.get_opt(name).await.map_err(|source| OwnerError {
        kind: K::kind(&()).into_owned(),
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        source: Box::new(source),
    })?;
    Ok(object.map(|o| o.owner_references().to_vec()))
}
