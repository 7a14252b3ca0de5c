//! Pure computation of the flat EndpointSlices of a Service from its pods.
//!
//! No I/O here: the reconciler hands in the Service, the pods it selects and
//! the flat Service's owner reference, and gets the slices to apply.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use k8s_openapi::{
    api::{
        core::v1::{ObjectReference, Pod, Service, ServicePort},
        discovery::v1::{Endpoint, EndpointConditions, EndpointPort, EndpointSlice},
    },
    apimachinery::pkg::{
        apis::meta::v1::ObjectMeta, apis::meta::v1::OwnerReference, util::intstr::IntOrString,
    },
};
use kube::ResourceExt;

use super::flat_service::short_hash;
use crate::controller::is_flat_pod;
use flatnet_k8s::{
    keys::{annotation, label},
    multus::{FlatAddresses, flat_addresses},
};

/// Most endpoints the API server accepts in one EndpointSlice.
pub const MAX_ENDPOINTS_PER_SLICE: usize = 1000;

/// True when the pod opts its Services out of a flat Service.
#[must_use]
pub fn opts_out(pod: &Pod) -> bool {
    pod.annotations()
        .get(annotation::FLAT_NETWORK_SERVICE)
        .is_some_and(|v| v == annotation::FLAT_NETWORK_SERVICE_DISABLED)
}

/// Address family of an EndpointSlice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// `IPv4`.
    V4,
    /// `IPv6`.
    V6,
}

impl Family {
    /// Family of an address.
    #[must_use]
    pub fn of(addr: IpAddr) -> Self {
        if addr.is_ipv4() { Self::V4 } else { Self::V6 }
    }

    /// The slice's `addressType`.
    #[must_use]
    pub fn address_type(self) -> &'static str {
        match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        }
    }

    /// Lower-case form used in slice names.
    #[must_use]
    pub fn slug(self) -> &'static str {
        match self {
            Self::V4 => "ipv4",
            Self::V6 => "ipv6",
        }
    }
}

/// True when the pod's `Ready` condition is `True`.
#[must_use]
pub fn pod_ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conds| {
            conds
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        })
}

/// Endpoint conditions, with the meaning the built-in controller gives them:
/// `serving` follows pod readiness, `ready` is serving and not terminating,
/// `terminating` is a set deletion timestamp. `publishNotReadyAddresses`
/// makes every endpoint ready and serving.
#[must_use]
pub fn conditions(pod: &Pod, publish_not_ready: bool) -> EndpointConditions {
    let terminating = pod.metadata.deletion_timestamp.is_some();
    let serving = publish_not_ready || pod_ready(pod);
    EndpointConditions {
        ready: Some(publish_not_ready || (serving && !terminating)),
        serving: Some(serving),
        terminating: Some(terminating),
    }
}

/// Port of the pod behind `port`: a numeric target port as is (the service
/// port when unset or zero), a named one looked up among the pod's container
/// ports with the same protocol. `None` when the name is not found.
#[must_use]
pub fn resolve_target_port(pod: &Pod, port: &ServicePort) -> Option<i32> {
    let protocol = port.protocol.as_deref().unwrap_or("TCP");
    match &port.target_port {
        None | Some(IntOrString::Int(0)) => Some(port.port),
        Some(IntOrString::Int(n)) => Some(*n),
        Some(IntOrString::String(name)) => pod
            .spec
            .as_ref()?
            .containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten())
            .find(|cp| {
                cp.name.as_deref() == Some(name)
                    && cp.protocol.as_deref().unwrap_or("TCP") == protocol
            })
            .map(|cp| cp.container_port),
    }
}

/// Why a selected flat pod is not an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// Pod name.
    pub pod: String,
    /// Reason, for the log.
    pub reason: String,
}

/// What the reconciler should write for one Service.
#[derive(Debug, Default)]
pub struct DesiredSlices {
    /// Slices to apply, ordered by name.
    pub slices: Vec<EndpointSlice>,
    /// Pods left out with an invalid annotation (pods merely not ready yet are
    /// not listed).
    pub skipped: Vec<Skipped>,
}

/// Computes the flat EndpointSlices of `original` from its selected `pods`.
///
/// Endpoints are grouped by address family and by the ports they resolve to;
/// each group becomes one slice named `<flat>-<family>-<hash of ports>` (plus
/// `-<n>` past 1000 endpoints), so a family normally has exactly one slice.
/// Pods that are not flat, have finished (`Succeeded`/`Failed`) or have no
/// flat address yet are left out.
#[must_use]
pub fn desired_slices(
    original: &Service,
    flat_name: &str,
    flat_owner: &OwnerReference,
    pods: &[Pod],
    attachment: &str,
) -> DesiredSlices {
    let spec = original.spec.as_ref();
    let publish_not_ready = spec
        .and_then(|s| s.publish_not_ready_addresses)
        .unwrap_or(false);
    let service_ports: &[ServicePort] = spec.and_then(|s| s.ports.as_deref()).unwrap_or_default();
    let mut groups: BTreeMap<(Family, Vec<PortKey>), Vec<Endpoint>> = BTreeMap::new();
    let mut skipped = Vec::new();

    for pod in pods.iter().filter(|p| is_flat_pod(*p) && !finished(p)) {
        let addrs = match flat_addresses(pod, attachment) {
            FlatAddresses::Found(addrs) => addrs,
            FlatAddresses::NotYet => continue,
            FlatAddresses::Invalid(reason) => {
                skipped.push(Skipped {
                    pod: pod.name_any(),
                    reason,
                });
                continue;
            }
        };
        let ports: Vec<PortKey> = service_ports
            .iter()
            .filter_map(|sp| {
                resolve_target_port(pod, sp).map(|port| PortKey {
                    name: sp.name.clone().unwrap_or_default(),
                    port,
                    protocol: sp.protocol.clone().unwrap_or_else(|| "TCP".into()),
                    app_protocol: sp.app_protocol.clone(),
                })
            })
            .collect();
        let distinct: BTreeSet<IpAddr> = addrs.into_iter().collect();
        for addr in distinct {
            groups
                .entry((Family::of(addr), ports.clone()))
                .or_default()
                .push(endpoint(pod, addr, &original.name_any(), publish_not_ready));
        }
    }

    let mut slices = Vec::new();
    for ((family, ports), mut endpoints) in groups {
        endpoints.sort_by(|a, b| {
            let key = |e: &Endpoint| {
                (
                    e.target_ref.as_ref().and_then(|r| r.name.clone()),
                    e.addresses.clone(),
                )
            };
            key(a).cmp(&key(b))
        });
        let base = format!("{flat_name}-{}-{}", family.slug(), ports_hash(&ports));
        for (n, chunk) in endpoints.chunks(MAX_ENDPOINTS_PER_SLICE).enumerate() {
            let name = if n == 0 {
                base.clone()
            } else {
                format!("{base}-{n}")
            };
            slices.push(slice(
                original,
                flat_name,
                flat_owner,
                name,
                family,
                &ports,
                chunk.to_vec(),
            ));
        }
    }
    slices.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
    DesiredSlices { slices, skipped }
}

/// A resolved endpoint port; the grouping key of slices.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct PortKey {
    name: String,
    port: i32,
    protocol: String,
    app_protocol: Option<String>,
}

fn ports_hash(ports: &[PortKey]) -> String {
    let text: Vec<String> = ports
        .iter()
        .map(|p| {
            format!(
                "{}/{}/{}/{}",
                p.name,
                p.protocol,
                p.port,
                p.app_protocol.as_deref().unwrap_or("")
            )
        })
        .collect();
    short_hash(&text.join(","))
}

fn finished(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, Some("Succeeded" | "Failed"))
}

fn endpoint(pod: &Pod, addr: IpAddr, original_name: &str, publish_not_ready: bool) -> Endpoint {
    let spec = pod.spec.as_ref();
    // Same rule as the built-in controller, against the original Service:
    // a pod whose subdomain names it gets `<hostname>.<flat service>` records.
    let hostname = spec
        .filter(|s| s.subdomain.as_deref() == Some(original_name))
        .and_then(|s| s.hostname.clone())
        .filter(|h| !h.is_empty());
    Endpoint {
        addresses: vec![addr.to_string()],
        conditions: Some(conditions(pod, publish_not_ready)),
        hostname,
        node_name: spec.and_then(|s| s.node_name.clone()),
        target_ref: Some(ObjectReference {
            kind: Some("Pod".into()),
            namespace: pod.namespace(),
            name: Some(pod.name_any()),
            uid: pod.uid(),
            ..ObjectReference::default()
        }),
        ..Endpoint::default()
    }
}

fn slice(
    original: &Service,
    flat_name: &str,
    flat_owner: &OwnerReference,
    name: String,
    family: Family,
    ports: &[PortKey],
    endpoints: Vec<Endpoint>,
) -> EndpointSlice {
    EndpointSlice {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: original.namespace(),
            labels: Some(BTreeMap::from([
                (
                    label::ENDPOINTSLICE_SERVICE_NAME.to_owned(),
                    flat_name.to_owned(),
                ),
                (
                    label::ENDPOINTSLICE_MANAGED_BY.to_owned(),
                    label::ENDPOINTSLICE_MANAGED_BY_VALUE.to_owned(),
                ),
                (label::PARENT_SERVICE.to_owned(), original.name_any()),
            ])),
            owner_references: Some(vec![flat_owner.clone()]),
            ..ObjectMeta::default()
        },
        address_type: family.address_type().to_owned(),
        endpoints,
        ports: Some(
            ports
                .iter()
                .map(|p| EndpointPort {
                    app_protocol: p.app_protocol.clone(),
                    name: Some(p.name.clone()),
                    port: Some(p.port),
                    protocol: Some(p.protocol.clone()),
                })
                .collect(),
        ),
    }
}

#[cfg(test)]
mod tests;
