//! The MultiNetworkPolicy API (`k8s.cni.cncf.io/v1beta1`) and which
//! policies concern the flat network.
//!
//! A MultiNetworkPolicy's spec is a NetworkPolicy spec. It applies to a
//! secondary network only when its `k8s.v1.cni.cncf.io/policy-for`
//! annotation names that network's NetworkAttachmentDefinition.

use std::collections::BTreeMap;

use k8s_openapi::api::networking::v1::{NetworkPolicyEgressRule, NetworkPolicyIngressRule};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// Annotation listing the networks a MultiNetworkPolicy applies to:
/// comma-separated `name` (in the policy's namespace) or `namespace/name`.
pub const POLICY_FOR_ANNOTATION: &str = "k8s.v1.cni.cncf.io/policy-for";

/// The network name flatnet answers to by default (the name of the
/// NetworkAttachmentDefinition rancher-flat-network installs).
pub const DEFAULT_NETWORK_NAME: &str = "rancher-flat-network";

/// The spec of a MultiNetworkPolicy: exactly a NetworkPolicy spec.
#[derive(CustomResource, Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[kube(
    group = "k8s.cni.cncf.io",
    version = "v1beta1",
    kind = "MultiNetworkPolicy",
    // The CRD of the multi-networkpolicy project names its resource so.
    plural = "multi-networkpolicies",
    namespaced,
    schema = "disabled",
    derive = "PartialEq"
)]
#[serde(rename_all = "camelCase")]
pub struct MultiNetworkPolicySpec {
    /// The pods the policy applies to, in its namespace; empty or absent
    /// selects every pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_selector: Option<LabelSelector>,
    /// `Ingress` and/or `Egress`. Absent or empty: `Ingress`, plus `Egress`
    /// when the policy has egress rules.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_types: Option<Vec<String>>,
    /// Allowed incoming traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress: Option<Vec<NetworkPolicyIngressRule>>,
    /// Allowed outgoing traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Vec<NetworkPolicyEgressRule>>,
}

/// The network names a policy's `policy-for` annotation must mention for
/// the policy to apply to the flat network. Each name is either
/// `namespace/name` (that exact NetworkAttachmentDefinition) or a bare
/// `name` (a definition of that name in any namespace).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetworkNames {
    names: Vec<String>,
}

impl Default for NetworkNames {
    fn default() -> Self {
        Self::new([DEFAULT_NETWORK_NAME])
    }
}

impl NetworkNames {
    /// Accepts the given names.
    pub fn new<S: Into<String>>(names: impl IntoIterator<Item = S>) -> Self {
        Self {
            names: names.into_iter().map(Into::into).collect(),
        }
    }

    /// Whether a policy in `namespace` with these annotations applies to
    /// the flat network.
    pub fn selects(&self, namespace: &str, annotations: Option<&BTreeMap<String, String>>) -> bool {
        let Some(value) = annotations.and_then(|a| a.get(POLICY_FOR_ANNOTATION)) else {
            return false;
        };
        value
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
            .any(|item| {
                // A bare name refers to a definition in the policy's namespace.
                let (ns, name) = item.split_once('/').unwrap_or((namespace, item));
                self.names
                    .iter()
                    .any(|accepted| match accepted.split_once('/') {
                        Some((accepted_ns, accepted_name)) => {
                            accepted_ns == ns && accepted_name == name
                        }
                        None => accepted == name,
                    })
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn annotations(value: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(POLICY_FOR_ANNOTATION.to_owned(), value.to_owned())])
    }

    #[test]
    fn policy_for_names() {
        let any_ns = NetworkNames::default();
        assert!(any_ns.selects("a", Some(&annotations("rancher-flat-network"))));
        assert!(any_ns.selects("a", Some(&annotations("kube-system/rancher-flat-network"))));
        assert!(any_ns.selects("a", Some(&annotations("other, rancher-flat-network"))));
        assert!(!any_ns.selects("a", Some(&annotations("other"))));
        assert!(!any_ns.selects("a", Some(&annotations(""))));
        assert!(!any_ns.selects("a", None), "no annotation: not ours");

        let exact = NetworkNames::new(["kube-system/flat"]);
        assert!(exact.selects("a", Some(&annotations("kube-system/flat"))));
        assert!(
            !exact.selects("a", Some(&annotations("flat"))),
            "means a/flat"
        );
        assert!(exact.selects("kube-system", Some(&annotations("flat"))));
    }

    #[test]
    fn parses_a_multi_network_policy() {
        let yaml = r#"{
          "apiVersion": "k8s.cni.cncf.io/v1beta1",
          "kind": "MultiNetworkPolicy",
          "metadata": {"name": "web", "namespace": "a",
                       "annotations": {"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}},
          "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                   "policyTypes": ["Ingress"],
                   "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
                                "ports": [{"protocol": "TCP", "port": 80, "endPort": 90}]}]}
        }"#;
        let policy: MultiNetworkPolicy = serde_json::from_str(yaml).unwrap();
        assert_eq!(policy.metadata.name.as_deref(), Some("web"));
        let rule = &policy.spec.ingress.as_ref().unwrap()[0];
        assert_eq!(rule.ports.as_ref().unwrap()[0].end_port, Some(90));
        assert_eq!(
            rule.from.as_ref().unwrap()[0]
                .ip_block
                .as_ref()
                .unwrap()
                .cidr,
            "10.0.0.0/8"
        );
    }
}
