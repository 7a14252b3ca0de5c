//! Environment variable names (and their defaults) read by flatnet's
//! processes. They are the original's names, kept in one place so a chart
//! and a binary can never disagree on a spelling.

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
pub const DEFAULT_ARP_POLICY: &str = "arp_notify";
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

/// The values of [`FLAT_NETWORK_CNI_ARP_POLICY`].
pub const ARP_POLICIES: [&str; 2] = ["arp_notify", "arping"];

/// [`FLAT_NETWORK_CNI_ARP_POLICY`] (`--arp-policy`): one of [`ARP_POLICIES`];
/// anything else is [`DEFAULT_ARP_POLICY`], as the original did.
#[must_use]
pub fn cni_arp_policy(value: &str) -> Legacy<&'static str> {
    match ARP_POLICIES.iter().find(|p| **p == value.trim()) {
        Some(policy) => Legacy {
            value: policy,
            warning: None,
        },
        None => Legacy {
            value: DEFAULT_ARP_POLICY,
            warning: Some(format!(
                "{FLAT_NETWORK_CNI_ARP_POLICY} (--arp-policy) {value:?} is not supported, using \"arp_notify\" (the other choice is \"arping\")"
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
        for policy in ARP_POLICIES {
            assert_eq!(
                cni_arp_policy(&format!(" {policy} ")),
                Legacy {
                    value: policy,
                    warning: None
                }
            );
        }
        let bad = cni_arp_policy("garp");
        assert_eq!(bad.value, "arp_notify");
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
