//! The headless `<service>-flat-network` Service derived from an ordinary Service.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::core::v1::{Service, ServicePort, ServiceSpec},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{Resource, ResourceExt};

use flatnet_k8s::keys::{annotation, label};

/// Suffix of every flat Service name, as in the original.
pub const FLAT_SERVICE_SUFFIX: &str = "-flat-network";

/// Longest Service name (an RFC 1035 label).
const MAX_SERVICE_NAME: usize = 63;

/// Name of the flat Service of `service`: `<service>-flat-network`, or, when
/// that exceeds 63 characters, the service name cut short plus a hash of the
/// full name, so distinct long names still get distinct flat Services.
#[must_use]
pub fn flat_service_name(service: &str) -> String {
    let plain = format!("{service}{FLAT_SERVICE_SUFFIX}");
    if plain.len() <= MAX_SERVICE_NAME {
        return plain;
    }
    let hash = short_hash(service);
    // `<prefix>-<8 hex>-flat-network` is exactly 63 characters.
    let keep = MAX_SERVICE_NAME - FLAT_SERVICE_SUFFIX.len() - hash.len() - 1;
    // Service names are ASCII, so any byte index is a char boundary.
    let prefix = service.get(..keep).unwrap_or(service);
    format!("{prefix}-{hash}{FLAT_SERVICE_SUFFIX}")
}

/// Eight hex digits of the 32-bit FNV-1a hash of `text`: stable across
/// releases and platforms, which `std`'s hasher does not promise.
#[must_use]
pub fn short_hash(text: &str) -> String {
    let hash = text.bytes().fold(0x811c_9dc5_u32, |hash, byte| {
        (hash ^ u32::from(byte)).wrapping_mul(0x0100_0193)
    });
    format!("{hash:08x}")
}

/// True when the Service was created by flatnet (it is never a parent itself).
#[must_use]
pub fn is_managed_by_flatnet(service: &Service) -> bool {
    service.labels().get(label::MANAGED_BY).map(String::as_str) == Some(label::MANAGED_BY_FLATNET)
}

/// The flat Service flatnet applies for `original`.
///
/// It is headless and has **no selector**: the built-in Endpoints and
/// EndpointSlice controllers only write for Services with a selector, so the
/// slices flatnet writes are the only ones. Ports are copied unchanged (no
/// node ports). `ipFamilyPolicy` is `PreferDualStack`, so the Service carries
/// every family the cluster has; slices are written per address family
/// whatever the Service's families are.
///
/// Returns `None` when `original` has no name or uid yet (not stored by the
/// API server), which cannot be owned.
#[must_use]
pub fn desired_flat_service(original: &Service, attachment: &str) -> Option<Service> {
    let owner = original.controller_owner_ref(&())?;
    let name = flat_service_name(&original.name_any());
    let spec = original.spec.as_ref();
    let ports = spec.and_then(|s| s.ports.as_ref()).map(|ports| {
        ports
            .iter()
            .map(|p| ServicePort {
                app_protocol: p.app_protocol.clone(),
                name: p.name.clone(),
                node_port: None,
                port: p.port,
                protocol: p.protocol.clone(),
                target_port: p.target_port.clone(),
            })
            .collect()
    });
    Some(Service {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: original.namespace(),
            labels: Some(BTreeMap::from([
                (
                    label::MANAGED_BY.to_owned(),
                    label::MANAGED_BY_FLATNET.to_owned(),
                ),
                (label::PARENT_SERVICE.to_owned(), original.name_any()),
            ])),
            annotations: Some(BTreeMap::from([(
                annotation::MULTUS_NETWORKS.to_owned(),
                attachment.to_owned(),
            )])),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".into()),
            cluster_ip: Some("None".into()),
            ip_family_policy: Some("PreferDualStack".into()),
            ports,
            publish_not_ready_addresses: spec.and_then(|s| s.publish_not_ready_addresses),
            ..ServiceSpec::default()
        }),
        status: None,
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
    use proptest::prelude::*;

    use super::*;

    fn original(headless: bool) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some("web".into()),
                namespace: Some("shop".into()),
                uid: Some("uid-web".into()),
                ..ObjectMeta::default()
            },
            spec: Some(ServiceSpec {
                cluster_ip: Some(if headless { "None" } else { "10.43.0.10" }.into()),
                type_: Some("NodePort".into()),
                selector: Some(BTreeMap::from([("app".into(), "web".into())])),
                ports: Some(vec![
                    ServicePort {
                        name: Some("http".into()),
                        port: 80,
                        node_port: Some(30080),
                        protocol: Some("TCP".into()),
                        target_port: Some(IntOrString::String("web".into())),
                        ..ServicePort::default()
                    },
                    ServicePort {
                        name: Some("metrics".into()),
                        port: 9100,
                        protocol: Some("TCP".into()),
                        target_port: Some(IntOrString::Int(9100)),
                        ..ServicePort::default()
                    },
                ]),
                ..ServiceSpec::default()
            }),
            status: None,
        }
    }

    #[test]
    fn short_names_get_the_plain_suffix() {
        assert_eq!(flat_service_name("web"), "web-flat-network");
        let fifty = "a".repeat(50);
        assert_eq!(flat_service_name(&fifty), format!("{fifty}-flat-network"));
    }

    #[test]
    fn long_names_are_cut_with_a_hash_of_the_full_name() {
        let long = "a".repeat(51);
        let name = flat_service_name(&long);
        assert_eq!(name.len(), 63);
        assert_eq!(
            name,
            format!("{}-{}-flat-network", "a".repeat(41), short_hash(&long))
        );
    }

    #[test]
    fn fnv1a_matches_the_reference_values() {
        assert_eq!(short_hash(""), "811c9dc5");
        assert_eq!(short_hash("a"), "e40c292c");
        assert_eq!(short_hash("foobar"), "bf9cf968");
    }

    #[test]
    fn ports_are_copied_unchanged_even_for_headless_originals() {
        for headless in [false, true] {
            let flat = desired_flat_service(&original(headless), "rancher-flat-network").unwrap();
            let ports = flat.spec.unwrap().ports.unwrap();
            assert_eq!(ports[0].port, 80);
            assert_eq!(
                ports[0].target_port,
                Some(IntOrString::String("web".into()))
            );
            assert_eq!(ports[0].node_port, None);
            assert_eq!(ports[1].port, 9100);
            assert_eq!(ports[1].target_port, Some(IntOrString::Int(9100)));
        }
    }

    #[test]
    fn flat_service_is_headless_selectorless_and_owned_by_the_original() {
        let flat = desired_flat_service(&original(false), "rancher-flat-network").unwrap();
        let spec = flat.spec.as_ref().unwrap();
        assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
        assert_eq!(spec.type_.as_deref(), Some("ClusterIP"));
        assert_eq!(spec.selector, None);
        assert_eq!(flat.metadata.name.as_deref(), Some("web-flat-network"));
        assert_eq!(flat.metadata.namespace.as_deref(), Some("shop"));
        let owner = &flat.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str(), owner.uid.as_str()),
            ("Service", "web", "uid-web")
        );
        assert_eq!(owner.controller, Some(true));
        assert!(is_managed_by_flatnet(&flat));
        assert!(!is_managed_by_flatnet(&original(false)));
    }

    #[test]
    fn a_service_without_uid_cannot_be_owned() {
        let mut svc = original(false);
        svc.metadata.uid = None;
        assert!(desired_flat_service(&svc, "rancher-flat-network").is_none());
    }

    proptest! {
        #[test]
        fn names_are_valid_distinct_and_keep_the_suffix(a in "[a-z][a-z0-9-]{0,61}[a-z0-9]", b in "[a-z][a-z0-9-]{0,61}[a-z0-9]") {
            let (fa, fb) = (flat_service_name(&a), flat_service_name(&b));
            prop_assert!(fa.len() <= 63);
            prop_assert!(fa.ends_with(FLAT_SERVICE_SUFFIX));
            prop_assert!(fa.starts_with(&a[..a.len().min(41)]));
            if a != b {
                prop_assert_ne!(fa, fb);
            }
        }
    }
}
