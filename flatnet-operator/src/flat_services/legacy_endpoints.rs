//! core/v1 Endpoints of the flat Service, next to its EndpointSlices: the
//! original wrote them and tools still read them. They are built from the
//! slices flatnet just wrote (one subset per slice), carry
//! `endpointslice.kubernetes.io/skip-mirror` so the mirroring controller
//! does not copy them back into slices, and are owned by the flat Service.
//! A cluster that no longer serves core/v1 Endpoints answers 404 to the
//! apply; that is not an error.

use std::collections::BTreeMap;

use flatnet_k8s::keys::label;
use k8s_openapi::{
    api::{
        core::v1::{EndpointAddress, EndpointPort, EndpointSubset, Endpoints, ObjectReference},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::OwnerReference,
};
use kube::{
    Api, Client,
    api::{ObjectMeta, Patch, PatchParams},
};
use tracing::debug;

use super::{Error, FIELD_MANAGER};

/// The Endpoints of flat Service `name` holding what `slices` hold.
#[must_use]
pub fn desired(
    namespace: &str,
    name: &str,
    owner: &OwnerReference,
    slices: &[EndpointSlice],
) -> Endpoints {
    let subsets: Vec<EndpointSubset> = slices
        .iter()
        .filter(|slice| !slice.endpoints.is_empty())
        .map(|slice| {
            let mut ready = Vec::new();
            let mut not_ready = Vec::new();
            for endpoint in &slice.endpoints {
                let Some(ip) = endpoint.addresses.first() else {
                    continue;
                };
                let address = EndpointAddress {
                    ip: ip.clone(),
                    hostname: endpoint.hostname.clone(),
                    node_name: endpoint.node_name.clone(),
                    target_ref: endpoint.target_ref.clone().map(|r| ObjectReference {
                        resource_version: None,
                        ..r
                    }),
                };
                let is_ready = endpoint
                    .conditions
                    .as_ref()
                    .and_then(|c| c.ready)
                    .unwrap_or(true);
                if is_ready {
                    ready.push(address);
                } else {
                    not_ready.push(address);
                }
            }
            EndpointSubset {
                addresses: Some(ready).filter(|a| !a.is_empty()),
                not_ready_addresses: Some(not_ready).filter(|a| !a.is_empty()),
                ports: slice.ports.as_ref().map(|ports| {
                    ports
                        .iter()
                        .filter_map(|p| {
                            Some(EndpointPort {
                                name: p.name.clone(),
                                port: p.port?,
                                protocol: p.protocol.clone(),
                                app_protocol: p.app_protocol.clone(),
                            })
                        })
                        .collect()
                }),
            }
        })
        .collect();
    Endpoints {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([
                (
                    label::ENDPOINTSLICE_SKIP_MIRROR.to_owned(),
                    "true".to_owned(),
                ),
                (
                    label::MANAGED_BY.to_owned(),
                    label::MANAGED_BY_FLATNET.to_owned(),
                ),
            ])),
            owner_references: Some(vec![owner.clone()]),
            ..ObjectMeta::default()
        },
        subsets: Some(subsets),
    }
}

/// Applies [`desired`]; a cluster without core/v1 Endpoints is skipped.
///
/// # Errors
/// The apply failed otherwise.
pub async fn apply(
    client: &Client,
    namespace: &str,
    name: &str,
    owner: &OwnerReference,
    slices: &[EndpointSlice],
) -> Result<(), Error> {
    let api: Api<Endpoints> = Api::namespaced(client.clone(), namespace);
    let wanted = desired(namespace, name, owner, slices);
    match api
        .patch(
            name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&wanted),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) if status.code == 404 => {
            debug!("core/v1 Endpoints are not served by this cluster; only EndpointSlices written");
            Ok(())
        }
        Err(error) => Err(Error::kube("apply", "Endpoints", namespace, name)(error)),
    }
}
