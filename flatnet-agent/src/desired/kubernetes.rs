//! Kubernetes desired state: the pod's FlatNetworkIP (same name and
//! namespace as the pod) and its FlatNetworkSubnet (in
//! `cattle-flat-network`), allocated by flatnet-operator.
//!
//! ADD waits by watch (not polling) for the operator to set `status.addr`,
//! bounded by the allocation wait; the agent watches only the one object it
//! needs. After a successful attach it records phase `Active`, the real MAC
//! and its node through the status subresource (server-side apply), and
//! labels the object with its node.

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use flatnet_common::k8s::{
    api::{FlatNetworkIP, FlatNetworkSubnet},
    keys::{SUBNET_NAMESPACE, label},
};
use ipnet::IpNet;
use k8s_openapi::jiff::Timestamp;
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{ListParams, Patch, PatchParams},
    runtime::{
        events::{Event, EventType, Recorder, Reporter},
        wait::await_condition,
    },
};
use serde_json::json;

use super::{
    AttachmentKey, Claim, ClaimRequest, DesiredState, DesiredStateError, NamedSubnet, PodRef,
};
use crate::{
    datapath::Conflict,
    link::{format_mac, parse_mac},
    packet::MacAddr,
};

/// Field manager of the agent's server-side applies.
pub const FIELD_MANAGER: &str = "flatnet-agent";
/// Default bound on waiting for the operator's allocation.
pub const DEFAULT_ALLOCATION_WAIT: Duration = Duration::from_secs(30);

/// Kubernetes desired state.
pub struct Kubernetes {
    client: Client,
    node: String,
    allocation_wait: Duration,
    synced: AtomicBool,
    recorder: Recorder,
}

impl Kubernetes {
    /// The source for node `node`, waiting at most `allocation_wait` for
    /// an allocation.
    pub fn new(client: Client, node: &str, allocation_wait: Duration) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.into(),
                instance: Some(node.to_owned()),
            },
        );
        Self {
            client,
            node: node.to_owned(),
            allocation_wait,
            synced: AtomicBool::new(false),
            recorder,
        }
    }

    /// Checks that the API server serves the FlatNetworkSubnet API; until
    /// then STATUS reports the agent not ready.
    pub async fn sync(&self) -> Result<(), DesiredStateError> {
        let subnets: Api<FlatNetworkSubnet> =
            Api::namespaced(self.client.clone(), SUBNET_NAMESPACE);
        subnets
            .list_metadata(&ListParams::default().limit(1))
            .await
            .map_err(|e| {
                DesiredStateError::Unavailable(format!(
                    "cannot list FlatNetworkSubnets in {SUBNET_NAMESPACE}: {e}; are the flatnet CRDs installed and the agent's RBAC in place?"
                ))
            })?;
        self.synced.store(true, Ordering::Release);
        Ok(())
    }

    fn pod_names<'a>(&self, pod: &'a PodRef) -> Result<(&'a str, &'a str), DesiredStateError> {
        match (pod.namespace.as_deref(), pod.name.as_deref()) {
            (Some(ns), Some(name)) => Ok((ns, name)),
            _ => Err(DesiredStateError::InvalidRequest(
                "CNI_ARGS lack K8S_POD_NAMESPACE and K8S_POD_NAME, which name the pod's FlatNetworkIP; \
                 run flatnet through a Kubernetes runtime or start the agent with --standalone"
                    .into(),
            )),
        }
    }
}

/// Whether the operator has allocated `ip` for the pod with `uid`.
pub fn is_allocated(ip: &FlatNetworkIP, uid: Option<&str>) -> bool {
    let owned = match uid {
        Some(uid) => ip.spec.pod_id.is_empty() || ip.spec.pod_id == uid,
        None => true,
    };
    owned && ip.status.as_ref().is_some_and(|s| s.addr.is_some())
}

impl DesiredState for Kubernetes {
    fn kind(&self) -> &'static str {
        "kubernetes"
    }

    async fn claim(&self, request: &ClaimRequest) -> Result<Claim, DesiredStateError> {
        let (namespace, name) = self.pod_names(&request.pod)?;
        let object = format!("FlatNetworkIP {namespace}/{name}");
        let ips: Api<FlatNetworkIP> = Api::namespaced(self.client.clone(), namespace);
        let uid = request.pod.uid.clone();
        let condition =
            move |ip: Option<&FlatNetworkIP>| ip.is_some_and(|ip| is_allocated(ip, uid.as_deref()));
        let waited =
            tokio::time::timeout(self.allocation_wait, await_condition(ips, name, condition)).await;
        let ip = match waited {
            Ok(Ok(Some(ip))) => ip,
            Ok(Ok(None)) => {
                return Err(DesiredStateError::NotAllocated(format!(
                    "{object} was deleted while the pod was being set up; the pod will be retried"
                )));
            }
            Ok(Err(error)) => {
                return Err(DesiredStateError::Unavailable(format!(
                    "cannot watch {object}: {error}"
                )));
            }
            Err(_) => {
                return Err(DesiredStateError::NotAllocated(format!(
                    "{object} has no address for this pod after {}s; check that flatnet-operator runs and the pod's flatnetwork.pandaria.io annotations are valid (kubectl describe flip -n {namespace} {name})",
                    self.allocation_wait.as_secs()
                )));
            }
        };
        let subnet_name = ip.spec.subnet.clone();
        let subnets: Api<FlatNetworkSubnet> =
            Api::namespaced(self.client.clone(), SUBNET_NAMESPACE);
        let subnet = subnets
            .get_opt(&subnet_name)
            .await
            .map_err(|e| {
                DesiredStateError::Unavailable(format!(
                    "cannot read FlatNetworkSubnet {SUBNET_NAMESPACE}/{subnet_name}: {e}"
                ))
            })?
            .ok_or_else(|| {
                DesiredStateError::SubnetNotFound(format!(
                    "FlatNetworkSubnet {SUBNET_NAMESPACE}/{subnet_name} named by {object} does not exist; create it or fix the pod's subnet annotation"
                ))
            })?;
        let named = NamedSubnet {
            name: subnet_name,
            spec: subnet.spec,
        };
        let valid = named
            .validate()
            .map_err(|e| DesiredStateError::InvalidDefinition(e.to_string()))?;
        let status = ip.status.unwrap_or_default();
        let addr = status.addr.expect("checked by is_allocated");
        let address = IpNet::new(addr, valid.cidr.prefix_len()).map_err(|_| {
            DesiredStateError::InvalidDefinition(format!(
                "{object} holds {addr}, which is not of the family of subnet {} ({})",
                named.name, valid.cidr
            ))
        })?;
        let mac = Some(status.mac.as_str())
            .filter(|m| !m.is_empty())
            .and_then(parse_mac);
        Ok(Claim {
            subnets: vec![named],
            addresses: vec![address],
            mac,
        })
    }

    async fn activate(
        &self,
        pod: &PodRef,
        _claim: &Claim,
        mac: MacAddr,
    ) -> Result<(), DesiredStateError> {
        let (namespace, name) = self.pod_names(pod)?;
        let ips: Api<FlatNetworkIP> = Api::namespaced(self.client.clone(), namespace);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let unavailable = |e: kube::Error| {
            DesiredStateError::Unavailable(format!(
                "cannot update FlatNetworkIP {namespace}/{name}: {e}"
            ))
        };
        let labels = json!({
            "apiVersion": FlatNetworkIP::api_version(&()),
            "kind": FlatNetworkIP::kind(&()),
            "metadata": {"name": name, "labels": {label::NODE: self.node}},
        });
        ips.patch(name, &params, &Patch::Apply(labels))
            .await
            .map_err(unavailable)?;
        let status = json!({
            "apiVersion": FlatNetworkIP::api_version(&()),
            "kind": FlatNetworkIP::kind(&()),
            "status": {"phase": "Active", "mac": format_mac(mac), "node": self.node},
        });
        ips.patch_status(name, &params, &Patch::Apply(status))
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    async fn release(&self, _network: &str, _key: &AttachmentKey) -> Result<(), DesiredStateError> {
        // The operator releases the address when the pod is deleted.
        Ok(())
    }

    async fn release_except(
        &self,
        _network: &str,
        _keep: &[AttachmentKey],
    ) -> Result<(), DesiredStateError> {
        Ok(())
    }

    fn readiness(&self) -> Result<(), String> {
        if self.synced.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err("the Kubernetes API has not been reached yet".into())
        }
    }

    async fn report_conflict(
        &self,
        pod: &PodRef,
        conflict: &Conflict,
    ) -> Result<(), DesiredStateError> {
        let (namespace, name) = self.pod_names(pod)?;
        let ips: Api<FlatNetworkIP> = Api::namespaced(self.client.clone(), namespace);
        let unavailable = |e: kube::Error| {
            DesiredStateError::Unavailable(format!(
                "cannot report a conflict on FlatNetworkIP {namespace}/{name}: {e}"
            ))
        };
        let ip = ips.get(name).await.map_err(unavailable)?;
        let message = format!(
            "address {} is also claimed by MAC {} ({}) on node {}",
            conflict.addr,
            format_mac(conflict.foreign_mac),
            conflict.kind.name(),
            self.node
        );
        self.recorder
            .publish(
                &Event {
                    type_: EventType::Warning,
                    reason: "IPConflict".into(),
                    note: Some(message.clone()),
                    action: "WatchAddress".into(),
                    secondary: None,
                },
                &ip.object_ref(&()),
            )
            .await
            .map_err(unavailable)?;
        let condition = json!({
            "type": "IPConflict",
            "status": "True",
            "reason": "ForeignClaim",
            "message": message,
            "lastTransitionTime": Timestamp::now().to_string(),
            "observedGeneration": ip.meta().generation.unwrap_or(0),
        });
        let status = json!({
            "apiVersion": FlatNetworkIP::api_version(&()),
            "kind": FlatNetworkIP::kind(&()),
            "status": {"conditions": [condition]},
        });
        ips.patch_status(
            &ip.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(status),
        )
        .await
        .map_err(unavailable)?;
        Ok(())
    }
}
