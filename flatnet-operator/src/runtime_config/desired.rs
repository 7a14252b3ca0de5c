//! From PodNetworkConfigs to what one running pod must have: a pure
//! function of the pod, its namespace's labels, the configurations of that
//! namespace and the subnets, so the controller, the webhook and the tests
//! agree on it.
//!
//! Rules, applied to the configurations of the pod's namespace whose
//! `podSelector` matches its labels, in name order:
//! - primary MTU: the smallest asked for (a lower MTU is always safe);
//! - attachments: one per interface name, the first configuration (by
//!   name) naming it wins; a later one naming it again, an attachment whose
//!   subnet is missing or does not admit the namespace, and a selector that
//!   cannot be evaluated are reported as problems of that configuration;
//! - VLANs and bridges: the union, each once.

use std::collections::{BTreeMap, BTreeSet};

use flatnet_k8s::{
    api::{ExtraAttachment, FlatNetworkSubnet, NodeBridge, NodeVlan, PodNetworkConfig},
    selector::{Labels, matches},
};
use kube::ResourceExt;

/// One pod as the computation sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodView {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Labels.
    pub labels: Labels,
}

/// An extra interface the pod must have, and the configuration asking.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WantedAttachment {
    /// The PodNetworkConfig's name.
    pub config: String,
    /// What it asks for.
    pub attachment: ExtraAttachment,
}

/// Everything the matching configurations ask of one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodDesired {
    /// Names of the configurations that match the pod.
    pub matched: BTreeSet<String>,
    /// MTU of the primary interface, when one is asked for.
    pub primary_mtu: Option<u32>,
    /// Whether a configuration asking for a primary MTU also asks for TCP
    /// MSS clamping on the primary interface.
    pub tcp_mss_clamp: bool,
    /// Extra interfaces by interface name.
    pub attachments: BTreeMap<String, WantedAttachment>,
    /// VLANs the pod's node must have.
    pub vlans: BTreeSet<(String, i64)>,
    /// Bridges the pod's node must have, by name, with their ports.
    pub bridges: BTreeMap<String, BTreeSet<String>>,
    /// Configuration name → what could not be applied to this pod.
    pub problems: BTreeMap<String, Vec<String>>,
}

/// What `configs` (any namespace; others are ignored) ask of `pod`, whose
/// namespace has `namespace_labels`, given the `subnets`.
#[must_use]
pub fn desired_for_pod(
    pod: &PodView,
    namespace_labels: &Labels,
    configs: &[PodNetworkConfig],
    subnets: &[FlatNetworkSubnet],
) -> PodDesired {
    let subnets: BTreeMap<String, &FlatNetworkSubnet> =
        subnets.iter().map(|s| (s.name_any(), s)).collect();
    let mut ordered: Vec<&PodNetworkConfig> = configs
        .iter()
        .filter(|c| c.namespace().as_deref() == Some(pod.namespace.as_str()))
        .collect();
    ordered.sort_by_key(|c| c.name_any());
    let mut desired = PodDesired::default();
    for config in ordered {
        let name = config.name_any();
        let mut problems = Vec::new();
        match matches(&config.spec.pod_selector, &pod.labels) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(error) => {
                desired
                    .problems
                    .entry(name)
                    .or_default()
                    .push(format!("spec.podSelector: {error}"));
                continue;
            }
        }
        desired.matched.insert(name.clone());
        if let Some(primary) = &config.spec.primary
            && let Some(mtu) = primary.mtu
        {
            desired.primary_mtu = Some(desired.primary_mtu.map_or(mtu, |m| m.min(mtu)));
            desired.tcp_mss_clamp |= primary.tcp_mss_clamp;
        }
        for attachment in &config.spec.attachments {
            if let Some(problem) =
                subnet_problem(attachment, &pod.namespace, namespace_labels, &subnets)
            {
                problems.push(problem);
                continue;
            }
            if let Some(first) = desired.attachments.get(&attachment.interface) {
                problems.push(format!(
                    "interface {} is already asked for by PodNetworkConfig {}; give this attachment another interface name",
                    attachment.interface, first.config
                ));
                continue;
            }
            desired.attachments.insert(
                attachment.interface.clone(),
                WantedAttachment {
                    config: name.clone(),
                    attachment: attachment.clone(),
                },
            );
        }
        desired.vlans.extend(
            config
                .spec
                .vlans
                .iter()
                .map(|NodeVlan { master, id }| (master.clone(), *id)),
        );
        for NodeBridge {
            name: bridge,
            ports,
        } in &config.spec.bridges
        {
            desired
                .bridges
                .entry(bridge.clone())
                .or_default()
                .extend(ports.iter().cloned());
        }
        if !problems.is_empty() {
            desired.problems.entry(name).or_default().extend(problems);
        }
    }
    desired
}

/// Why `attachment` cannot use its subnet from `namespace` (labelled
/// `namespace_labels`), if it cannot: the subnet is missing or does not
/// admit the namespace. The webhook asks the same.
#[must_use]
pub fn subnet_problem(
    attachment: &ExtraAttachment,
    namespace: &str,
    namespace_labels: &Labels,
    subnets: &BTreeMap<String, &FlatNetworkSubnet>,
) -> Option<String> {
    let Some(subnet) = subnets.get(&attachment.subnet) else {
        return Some(format!(
            "subnet {} of interface {} does not exist; create it or name an existing FlatNetworkSubnet",
            attachment.subnet, attachment.interface
        ));
    };
    match subnet.spec.admits(namespace_labels) {
        Ok(true) => None,
        Ok(false) => Some(format!(
            "subnet {} does not admit namespace {namespace} (its spec.namespaceSelector); ask its administrator or use another subnet",
            attachment.subnet
        )),
        Err(error) => Some(format!(
            "subnet {}: spec.namespaceSelector: {error}",
            attachment.subnet
        )),
    }
}

#[cfg(test)]
mod tests {
    use flatnet_k8s::api::{PodNetworkConfigSpec, PrimarySettings};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
    use proptest::prelude::*;

    use super::*;
    use crate::allocation::fake_cluster::subnet;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn selector(pairs: &[(&str, &str)]) -> LabelSelector {
        LabelSelector {
            match_labels: Some(labels(pairs)),
            ..LabelSelector::default()
        }
    }

    fn config(name: &str, spec: PodNetworkConfigSpec) -> PodNetworkConfig {
        let mut config = PodNetworkConfig::new(name, spec);
        config.metadata.namespace = Some("shop".into());
        config
    }

    fn attach(subnet: &str, interface: &str) -> ExtraAttachment {
        ExtraAttachment {
            subnet: subnet.into(),
            interface: interface.into(),
            ..ExtraAttachment::default()
        }
    }

    fn web() -> PodView {
        PodView {
            namespace: "shop".into(),
            name: "web-0".into(),
            labels: labels(&[("app", "web")]),
        }
    }

    fn subnets() -> Vec<FlatNetworkSubnet> {
        let open = subnet("lan", "10.0.0.0/24", None, &[]);
        let mut closed = subnet("secure", "10.1.0.0/24", None, &[]);
        closed.spec.namespace_selector = Some(selector(&[("tenant", "bank")]));
        vec![open, closed]
    }

    #[test]
    fn matching_configs_combine_and_conflicts_are_reported_per_config() {
        let configs = [
            config(
                "a",
                PodNetworkConfigSpec {
                    pod_selector: selector(&[("app", "web")]),
                    primary: Some(PrimarySettings {
                        mtu: Some(1450),
                        tcp_mss_clamp: true,
                    }),
                    attachments: vec![attach("lan", "net1"), attach("secure", "net2")],
                    vlans: vec![NodeVlan {
                        master: "eth1".into(),
                        id: 100,
                    }],
                    ..PodNetworkConfigSpec::default()
                },
            ),
            config(
                "b",
                PodNetworkConfigSpec {
                    primary: Some(PrimarySettings {
                        mtu: Some(1400),
                        ..PrimarySettings::default()
                    }),
                    attachments: vec![attach("lan", "net1"), attach("missing", "net3")],
                    bridges: vec![NodeBridge {
                        name: "br0".into(),
                        ports: vec!["eth2".into()],
                    }],
                    ..PodNetworkConfigSpec::default()
                },
            ),
            config(
                "c",
                PodNetworkConfigSpec {
                    pod_selector: selector(&[("app", "db")]),
                    attachments: vec![attach("lan", "net9")],
                    ..PodNetworkConfigSpec::default()
                },
            ),
        ];
        let desired = desired_for_pod(&web(), &labels(&[]), &configs, &subnets());
        assert_eq!(desired.matched, BTreeSet::from(["a".into(), "b".into()]));
        assert_eq!(desired.primary_mtu, Some(1400), "the smallest");
        assert!(desired.tcp_mss_clamp, "asked for by one of them");
        assert_eq!(desired.attachments.keys().collect::<Vec<_>>(), ["net1"]);
        assert_eq!(desired.attachments["net1"].config, "a", "the first by name");
        assert_eq!(desired.vlans, BTreeSet::from([("eth1".into(), 100)]));
        assert_eq!(desired.bridges["br0"], BTreeSet::from(["eth2".into()]));
        let problems = |c: &str| desired.problems[c].join("\n");
        assert!(
            problems("a").contains("does not admit namespace shop"),
            "{}",
            problems("a")
        );
        assert!(problems("b").contains("already asked for by PodNetworkConfig a"));
        assert!(problems("b").contains("subnet missing of interface net3 does not exist"));

        // The tenant's namespace is admitted to the closed subnet.
        let admitted =
            desired_for_pod(&web(), &labels(&[("tenant", "bank")]), &configs, &subnets());
        assert!(admitted.attachments.contains_key("net2"));
    }

    #[test]
    fn configs_of_other_namespaces_and_unmatched_pods_ask_nothing() {
        let mut other = config("a", PodNetworkConfigSpec::default());
        other.metadata.namespace = Some("elsewhere".into());
        other.spec.attachments = vec![attach("lan", "net1")];
        let desired = desired_for_pod(&web(), &labels(&[]), &[other], &subnets());
        assert_eq!(desired, PodDesired::default());
    }

    fn arbitrary_config() -> impl Strategy<Value = PodNetworkConfig> {
        (
            "[a-e]",
            proptest::option::of(prop_oneof![Just("web"), Just("db")]),
            proptest::option::of(1280u32..1500),
            proptest::collection::vec(
                (
                    prop_oneof![Just("lan"), Just("secure"), Just("gone")],
                    "net[1-4]",
                ),
                0..4,
            ),
        )
            .prop_map(|(name, app, mtu, attachments)| {
                config(
                    &name,
                    PodNetworkConfigSpec {
                        pod_selector: app.map(|a| selector(&[("app", a)])).unwrap_or_default(),
                        primary: Some(PrimarySettings {
                            mtu,
                            ..PrimarySettings::default()
                        }),
                        attachments: attachments.iter().map(|(s, i)| attach(s, i)).collect(),
                        ..PodNetworkConfigSpec::default()
                    },
                )
            })
    }

    proptest! {
        /// The order configurations are listed in never matters; every
        /// wanted attachment is on an existing subnet that admits the
        /// namespace and comes from a matching configuration; the MTU is
        /// the smallest of the matching ones.
        #[test]
        fn desired_state_is_order_independent_and_admitted(
            configs in proptest::collection::vec(arbitrary_config(), 0..6),
            tenant in any::<bool>(),
        ) {
            // Names are unique in a namespace.
            let mut seen = BTreeSet::new();
            let configs: Vec<PodNetworkConfig> =
                configs.into_iter().filter(|c| seen.insert(c.name_any())).collect();
            let ns = if tenant { labels(&[("tenant", "bank")]) } else { labels(&[]) };
            let desired = desired_for_pod(&web(), &ns, &configs, &subnets());
            let mut reversed = configs.clone();
            reversed.reverse();
            prop_assert_eq!(&desired, &desired_for_pod(&web(), &ns, &reversed, &subnets()));
            for wanted in desired.attachments.values() {
                prop_assert!(desired.matched.contains(&wanted.config));
                prop_assert!(wanted.attachment.subnet == "lan" || (tenant && wanted.attachment.subnet == "secure"));
            }
            let smallest = configs
                .iter()
                .filter(|c| desired.matched.contains(&c.name_any()))
                .filter_map(|c| c.spec.primary.as_ref().and_then(|p| p.mtu))
                .min();
            prop_assert_eq!(desired.primary_mtu, smallest);
        }
    }
}
