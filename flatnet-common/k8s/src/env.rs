//! Environment variable names (and their defaults) read by flatnet's
//! processes. They are the original's names, kept in one place so a chart
//! and a binary can never disagree on a spelling.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Non-empty: debug logging and long leader-election leases (development).
pub const CATTLE_DEV_MODE: &str = "CATTLE_DEV_MODE";
/// Informer resync period in whole minutes.
pub const CATTLE_RESYNC_DEFAULT: &str = "CATTLE_RESYNC_DEFAULT";
/// Leader-election lease duration (Go duration syntax, e.g. `45s`).
pub const CATTLE_ELECTION_LEASE_DURATION: &str = "CATTLE_ELECTION_LEASE_DURATION";
/// Leader-election renew deadline (Go duration syntax).
pub const CATTLE_ELECTION_RENEW_DEADLINE: &str = "CATTLE_ELECTION_RENEW_DEADLINE";
/// Leader-election retry period (Go duration syntax).
pub const CATTLE_ELECTION_RETRY_PERIOD: &str = "CATTLE_ELECTION_RETRY_PERIOD";
/// Address announcement after setup: `arp_notify` (default) or `arping`.
pub const FLAT_NETWORK_CNI_ARP_POLICY: &str = "FLAT_NETWORK_CNI_ARP_POLICY";
/// `true` enables proxy ARP on the pod interface.
pub const FLAT_NETWORK_CNI_PROXY_ARP: &str = "FLAT_NETWORK_CNI_PROXY_ARP";
/// Cluster pod CIDRs, comma-separated for dual stack.
pub const FLAT_NETWORK_CLUSTER_CIDR: &str = "FLAT_NETWORK_CLUSTER_CIDR";
/// Service CIDRs, comma-separated for dual stack.
pub const FLAT_NETWORK_SERVICE_CIDR: &str = "FLAT_NETWORK_SERVICE_CIDR";
/// Path of a kubeconfig; in-cluster configuration when unset.
pub const KUBECONFIG: &str = "KUBECONFIG";

/// Default of [`FLAT_NETWORK_CNI_ARP_POLICY`].
pub const DEFAULT_ARP_POLICY: &str = ArpPolicy::ArpNotify.as_str();
/// Default of [`FLAT_NETWORK_CLUSTER_CIDR`].
pub const DEFAULT_CLUSTER_CIDR: &str = "10.42.0.0/16";
/// Default of [`FLAT_NETWORK_SERVICE_CIDR`].
pub const DEFAULT_SERVICE_CIDR: &str = "10.43.0.0/16";

/// A setting of the original read as the original read it: a value it did
/// not know stands for the default, with a warning naming the variable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Legacy<T> {
    /// The value to use.
    pub value: T,
    /// Why the given value was replaced, to be logged; `None` when it was usable.
    pub warning: Option<String>,
}

/// How a pod's new addresses are announced on the LAN once its flat
/// interface is up: [`FLAT_NETWORK_CNI_ARP_POLICY`], a NetworkAttachmentDefinition's
/// `flatNetwork.arpPolicy` and the FlatNetworkConfig's `spec.arpPolicy`
/// (the original's names and values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArpPolicy {
    /// The kernel announces: the interface's `arp_notify` and
    /// `ndisc_notify` sysctls are 1 before it comes up.
    #[default]
    ArpNotify,
    /// flatnet sends gratuitous ARP (IPv4) and unsolicited neighbour
    /// advertisements with Override set (IPv6), a few times.
    Arping,
}

impl ArpPolicy {
    /// Every policy.
    pub const ALL: [Self; 2] = [Self::ArpNotify, Self::Arping];

    /// The policy's name, as written in the environment, an attachment
    /// and the FlatNetworkConfig.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::ArpNotify => "arp_notify",
            Self::Arping => "arping",
        }
    }

    /// The policy named exactly `name`.
    #[must_use]
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.as_str() == name)
    }

    /// The names, for messages: `arp_notify or arping`.
    #[must_use]
    pub fn choices() -> String {
        Self::ALL.map(Self::as_str).join(" or ")
    }
}

impl fmt::Display for ArpPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// [`FLAT_NETWORK_CNI_ARP_POLICY`] (`--arp-policy`): a policy's name;
/// anything else is [`DEFAULT_ARP_POLICY`], as the original did.
#[must_use]
pub fn cni_arp_policy(value: &str) -> Legacy<ArpPolicy> {
    match ArpPolicy::parse(value.trim()) {
        Some(policy) => Legacy {
            value: policy,
            warning: None,
        },
        None => Legacy {
            value: ArpPolicy::default(),
            warning: Some(format!(
                "{FLAT_NETWORK_CNI_ARP_POLICY} (--arp-policy) {value:?} is not supported, using \"{DEFAULT_ARP_POLICY}\" (the choices are {})",
                ArpPolicy::choices()
            )),
        },
    }
}

/// [`FLAT_NETWORK_CNI_PROXY_ARP`] (`--proxy-arp`) as Go's
/// `strconv.ParseBool` reads it; anything else is `false`, as the original did.
#[must_use]
pub fn cni_proxy_arp(value: &str) -> Legacy<bool> {
    match go_bool(value) {
        Some(value) => Legacy {
            value,
            warning: None,
        },
        None => Legacy {
            value: false,
            warning: Some(format!(
                "{FLAT_NETWORK_CNI_PROXY_ARP} (--proxy-arp) {value:?} is not a boolean, using false"
            )),
        },
    }
}

/// Go's `strconv.ParseBool`.
#[must_use]
pub fn go_bool(value: &str) -> Option<bool> {
    match value.trim() {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_arp_policies_are_kept_and_others_fall_back_with_a_warning() {
        for policy in ArpPolicy::ALL {
            assert_eq!(
                cni_arp_policy(&format!(" {policy} ")),
                Legacy {
                    value: policy,
                    warning: None
                }
            );
        }
        let bad = cni_arp_policy("garp");
        assert_eq!(bad.value, ArpPolicy::ArpNotify);
        let warning = bad.warning.unwrap();
        assert!(
            warning.starts_with("FLAT_NETWORK_CNI_ARP_POLICY"),
            "{warning}"
        );
        assert!(warning.contains("\"garp\""), "{warning}");
    }

    #[test]
    fn proxy_arp_reads_go_booleans_and_falls_back_to_false() {
        for (text, value) in [("1", true), ("True", true), ("f", false), ("FALSE", false)] {
            assert_eq!(
                cni_proxy_arp(text),
                Legacy {
                    value,
                    warning: None
                }
            );
        }
        for text in ["yes", "", "2", "on"] {
            let bad = cni_proxy_arp(text);
            assert!(!bad.value);
            assert!(
                bad.warning
                    .unwrap()
                    .starts_with("FLAT_NETWORK_CNI_PROXY_ARP"),
                "{text}"
            );
        }
    }
}
