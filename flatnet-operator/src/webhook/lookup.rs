//! What the webhook reads from the API server.
//!
//! Every replica answers reviews, and only the leader runs informers, so
//! every lookup is a direct API call (the API server's watch cache serves
//! the lists).

use flatnet_k8s::{
    api::{FlatNetworkIP, FlatNetworkSubnet, FlatNetworkWireClaims},
    keys::SUBNET_NAMESPACE,
};
use k8s_openapi::{api::core::v1::Pod, apimachinery::pkg::apis::meta::v1::OwnerReference};
use kube::{Api, Client, Resource, ResourceExt, api::ListParams};

use super::workload::{WorkloadRef, controller};

/// A failed lookup.
#[derive(Debug, thiserror::Error)]
#[error("cannot {what} ({source}); retry, and check the operator may read them")]
pub struct LookupError {
    /// What was being read.
    what: String,
    /// The API error.
    #[source]
    source: Box<kube::Error>,
}

fn failed(what: impl Into<String>) -> impl FnOnce(kube::Error) -> LookupError {
    let what = what.into();
    move |source| LookupError {
        what,
        source: Box::new(source),
    }
}

/// Reads subnets, allocation records and owners through `client`.
#[derive(Clone)]
pub struct Lookup {
    client: Client,
}

impl Lookup {
    /// A lookup through `client`.
    #[must_use]
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// Every node's report of the addresses live on the LAN.
    ///
    /// # Errors
    /// The list failed.
    pub async fn wire_claims(&self) -> Result<Vec<FlatNetworkWireClaims>, LookupError> {
        let api: Api<FlatNetworkWireClaims> =
            Api::namespaced(self.client.clone(), SUBNET_NAMESPACE);
        Ok(api
            .list(&ListParams::default().match_any())
            .await
            .map_err(failed("list FlatNetworkWireClaims"))?
            .items)
    }

    /// Every FlatNetworkSubnet (they all live in `cattle-flat-network`).
    ///
    /// # Errors
    /// The list failed.
    pub async fn subnets(&self) -> Result<Vec<FlatNetworkSubnet>, LookupError> {
        let api: Api<FlatNetworkSubnet> = Api::namespaced(self.client.clone(), SUBNET_NAMESPACE);
        Ok(api
            .list(&ListParams::default().match_any())
            .await
            .map_err(failed("list FlatNetworkSubnets"))?
            .items)
    }

    /// The labels of namespace `name` (none when it does not exist).
    ///
    /// # Errors
    /// The read failed.
    pub async fn namespace_labels(
        &self,
        name: &str,
    ) -> Result<flatnet_k8s::selector::Labels, LookupError> {
        let api: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(self.client.clone());
        Ok(api
            .get_opt(name)
            .await
            .map_err(failed(format!("get Namespace {name}")))?
            .map(|namespace| namespace.labels().clone())
            .unwrap_or_default())
    }

    /// Every FlatNetworkIP of the cluster.
    ///
    /// # Errors
    /// The list failed.
    pub async fn ips(&self) -> Result<Vec<FlatNetworkIP>, LookupError> {
        let api: Api<FlatNetworkIP> = Api::all(self.client.clone());
        Ok(api
            .list(&ListParams::default().match_any())
            .await
            .map_err(failed("list FlatNetworkIPs"))?
            .items)
    }

    /// The pods the operator gave floating addresses to (labelled so).
    ///
    /// # Errors
    /// The list failed.
    pub async fn floating_pods(&self) -> Result<Vec<k8s_openapi::api::core::v1::Pod>, LookupError> {
        let api: Api<k8s_openapi::api::core::v1::Pod> = Api::all(self.client.clone());
        Ok(api
            .list(
                &ListParams::default()
                    .match_any()
                    .labels(flatnet_k8s::floating::pods::ASSIGNED_SELECTOR),
            )
            .await
            .map_err(failed("list the pods holding floating addresses"))?
            .items)
    }

    /// Every object of kind `K` in the cluster.
    ///
    /// # Errors
    /// The list failed.
    pub async fn list<K>(&self) -> Result<Vec<K>, LookupError>
    where
        K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        let api: Api<K> = Api::all(self.client.clone());
        Ok(api
            .list(&ListParams::default().match_any())
            .await
            .map_err(failed(format!("list {}s", K::kind(&()))))?
            .items)
    }

    /// The workload an object of `kind` named `name` belongs to (see
    /// [`crate::workloads::owner::workload_of`]).
    ///
    /// # Errors
    /// Reading a ReplicaSet or Job failed (not found is fine).
    pub async fn workload_of(
        &self,
        kind: &str,
        namespace: &str,
        name: &str,
        owners: &[OwnerReference],
    ) -> Result<WorkloadRef, LookupError> {
        crate::workloads::owner::workload_of(&self.client, kind, namespace, name, owners)
            .await
            .map_err(|error| LookupError {
                what: format!("read {} {}/{}", error.kind, error.namespace, error.name),
                source: error.source,
            })
    }

    /// The workload whose pod holds the allocation `record`.
    ///
    /// A record kept for a StatefulSet names it as owner; otherwise the pod
    /// of the same name is read. A record whose pod is gone is held by that
    /// pod until the operator releases it.
    ///
    /// # Errors
    /// Reading the pod or its owners failed.
    pub async fn holder(&self, record: &FlatNetworkIP) -> Result<WorkloadRef, LookupError> {
        let namespace = record.namespace().unwrap_or_default();
        let name = record.name_any();
        if let Some(owner) =
            controller(record.owner_references()).filter(|o| o.kind == "StatefulSet")
        {
            return Ok(WorkloadRef::new("StatefulSet", &namespace, &owner.name));
        }
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &namespace);
        match pods
            .get_opt(&name)
            .await
            .map_err(failed(format!("read Pod {namespace}/{name}")))?
        {
            Some(pod) => {
                self.workload_of("Pod", &namespace, &name, pod.owner_references())
                    .await
            }
            None => Ok(WorkloadRef::new("Pod", &namespace, &name)),
        }
    }
}
