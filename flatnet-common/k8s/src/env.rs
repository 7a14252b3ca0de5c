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
