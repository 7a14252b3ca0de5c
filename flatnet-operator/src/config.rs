//! Command line and environment of the operator, validated into [`Config`].
//!
//! Flag and environment names follow the original rancher-flat-network
//! operator, so its Helm values and manifests keep working.

use std::{
    ffi::OsStr,
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    time::Duration,
};

use clap::{ArgAction, Command, CommandFactory, FromArgMatches, Parser, ValueEnum};

pub use flatnet_k8s::env::ArpPolicy;
use flatnet_k8s::{env, ipam::StatefulSetAddressPolicy};

use crate::cidr::{Cidr, CidrError};

/// Worker count used when `--worker` is outside [`WORKER_RANGE`], as the original did.
const DEFAULT_WORKERS: u16 = 5;
const WORKER_RANGE: std::ops::RangeInclusive<u16> = 1..=50;

/// Command-line interface of the operator; every setting also reads an environment variable.
#[derive(Parser, Debug, Clone)]
#[command(name = "flatnet-operator", version, about, disable_version_flag = true)]
pub struct Cli {
    /// Print the version and exit.
    #[arg(short = 'v', long = "version", action = ArgAction::Version)]
    version: Option<bool>,

    /// Kubeconfig file; the in-cluster service account is used when unset.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,

    /// API server URL, overriding the one from the kubeconfig or the cluster.
    #[arg(long)]
    pub master: Option<String>,

    /// Debug logging (`RUST_LOG` overrides the level when set).
    #[arg(long)]
    pub debug: bool,

    /// Log format.
    #[arg(long, env = "FLATNET_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    /// Reconciles run in parallel per controller; values outside 1..=50 fall back to 5.
    #[arg(long, default_value_t = DEFAULT_WORKERS)]
    pub worker: u16,

    /// Address of the health and metrics server (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, env = "FLATNET_ADMIN_ADDRESS", default_value = "0.0.0.0:8080")]
    pub admin_address: SocketAddr,

    /// Name of the Multus attachment whose addresses become the flat endpoints.
    #[arg(
        long,
        env = "FLATNET_NETWORK_ATTACHMENT",
        default_value = "rancher-flat-network"
    )]
    pub network_attachment: String,

    /// Any non-empty value: debug logs and the election timing of wrangler's
    /// dev mode (lease 45h, renew deadline 30h), as the original.
    #[arg(long, env = "CATTLE_DEV_MODE")]
    pub dev_mode: Option<String>,

    /// `false`: no leader election, this process always leads (one replica only).
    #[arg(long, env = "FLATNET_LEADER_ELECTION", default_value_t = true, action = ArgAction::Set)]
    pub leader_election: bool,

    /// Period of the full re-reconcile of every object, in minutes.
    #[arg(long, env = "CATTLE_RESYNC_DEFAULT", default_value_t = 10)]
    pub resync_minutes: u64,

    /// Lease duration (Go duration such as `45s`).
    #[arg(long, env = "CATTLE_ELECTION_LEASE_DURATION", default_value = "45s")]
    pub election_lease_duration: String,

    /// Time the leader has to renew its lease (Go duration).
    #[arg(long, env = "CATTLE_ELECTION_RENEW_DEADLINE", default_value = "30s")]
    pub election_renew_deadline: String,

    /// Retry period of the election (Go duration); validated, see docs/operator.md.
    #[arg(long, env = "CATTLE_ELECTION_RETRY_PERIOD", default_value = "2s")]
    pub election_retry_period: String,

    /// Name of the coordination.k8s.io Lease that elects the leader.
    #[arg(
        long,
        env = "FLATNET_LEASE_NAME",
        default_value = "rancher-flat-network-operator"
    )]
    pub lease_name: String,

    /// Namespace of the Lease (the operator's own namespace).
    #[arg(long, env = "POD_NAMESPACE", default_value = "cattle-flat-network")]
    pub lease_namespace: String,

    /// Identity in the Lease; the pod name.
    #[arg(long, env = "HOSTNAME")]
    pub identity: Option<String>,

    /// Pod CIDRs of the cluster, comma separated (v4,v6 on dual stack).
    #[arg(
        long,
        env = "FLAT_NETWORK_CLUSTER_CIDR",
        default_value = "10.42.0.0/16"
    )]
    pub cluster_cidr: String,

    /// Service CIDRs of the cluster, comma separated (v4,v6 on dual stack).
    #[arg(
        long,
        env = "FLAT_NETWORK_SERVICE_CIDR",
        default_value = "10.43.0.0/16"
    )]
    pub service_cidr: String,

    /// How the CNI announces a new address: `arp_notify` or `arping`.
    #[arg(
        long,
        env = "FLAT_NETWORK_CNI_ARP_POLICY",
        default_value = "arp_notify"
    )]
    pub arp_policy: String,

    /// Proxy ARP on the pod interface (Go boolean: `true`, `false`, `1`, `0`, ...).
    #[arg(long, env = "FLAT_NETWORK_CNI_PROXY_ARP", default_value = "false")]
    pub proxy_arp: String,

    /// MTU of the pod interfaces written into the attachment; 0 leaves it to the parent link.
    #[arg(long, env = "FLATNET_CNI_MTU", default_value_t = 1500)]
    pub cni_mtu: u32,

    /// Serve the admission webhook (`--webhook-server=false` turns it off).
    #[arg(long, env = "FLATNET_WEBHOOK_SERVER", default_value_t = true, action = ArgAction::Set)]
    pub webhook_server: bool,

    /// Address the webhook listens on.
    #[arg(long, env = "FLATNET_WEBHOOK_BIND_ADDRESS", default_value = "0.0.0.0")]
    pub bind_address: IpAddr,

    /// Port the webhook listens on.
    #[arg(long, env = "FLATNET_WEBHOOK_PORT", default_value_t = 443)]
    pub port: u16,

    /// Service in front of the webhook (in the operator's namespace).
    #[arg(
        long,
        env = "FLATNET_WEBHOOK_SERVICE",
        default_value = "rancher-flat-network-webhook-svc"
    )]
    pub webhook_service: String,

    /// Secret holding the webhook's CA and serving certificate (created or adopted).
    #[arg(
        long,
        env = "FLATNET_WEBHOOK_SECRET",
        default_value = "rancher-flat-network-webhook-certs"
    )]
    pub webhook_secret: String,

    /// ValidatingWebhookConfiguration the operator registers and keeps the caBundle of.
    #[arg(
        long,
        env = "FLATNET_WEBHOOK_CONFIG",
        default_value = "rancher-flat-network-subnets-validating-config"
    )]
    pub webhook_config: String,

    /// Development out of cluster: register the webhook with this URL
    /// (`https://127.0.0.1:8443/validate`) instead of the Service.
    #[arg(long, env = "FLATNET_WEBHOOK_URL")]
    pub webhook_url: Option<String>,
    /// A one-off command instead of the operator (`migrate ...`).
    #[command(subcommand)]
    pub command: Option<crate::migrate::OperatorCommand>,
    /// Whether StatefulSet pods keep their address when deleted (`sticky`)
    /// or release it like other pods (`release`).
    #[arg(
        long,
        env = "FLATNET_STATEFULSET_ADDRESS_POLICY",
        value_enum,
        default_value_t = StatefulSetPolicy::Sticky
    )]
    pub statefulset_address_policy: StatefulSetPolicy,

    /// How long an allocated address waits for the node to set the pod up
    /// before the FlatNetworkIP is marked Failed (Go duration).
    #[arg(long, env = "FLATNET_PENDING_TIMEOUT", default_value = "5m")]
    pub pending_timeout: String,

    /// How long a pod's node may be missing before the pod's addresses are
    /// released (Go duration); a node recreated sooner keeps them.
    #[arg(long, env = "FLATNET_NODE_GONE_GRACE", default_value = "5m")]
    pub node_gone_grace: String,

    /// How long an address that a host outside flatnet claimed on the LAN
    /// stays out of the pool after it was last seen (Go duration; 0s turns
    /// wire-aware allocation off).
    #[arg(long, env = "FLATNET_WIRE_WINDOW", default_value = "1h")]
    pub wire_window: String,
    /// Also give floating addresses to LoadBalancer Services that name no
    /// `loadBalancerClass` (only when no other load balancer serves them).
    #[arg(long, env = "FLATNET_FLOATING_IP_CLASSLESS", default_value_t = false, action = ArgAction::Set)]
    pub floating_ip_classless: bool,
    /// The agent DaemonSet (in the operator's namespace), whose rollout the
    /// FlatNetworkConfig's conditions report.
    #[arg(long, env = "FLATNET_AGENT_DAEMONSET", default_value = "flatnet-agent")]
    pub agent_daemonset: String,
}

/// `--statefulset-address-policy` values.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatefulSetPolicy {
    /// Keep the address for the next pod of the same name.
    Sticky,
    /// Release the address with the pod.
    Release,
}

/// Output format of the logs.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Leader-election timing, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElectionTiming {
    /// How long a lease is valid after its last renewal.
    pub lease_duration: Duration,
    /// How long after a renewal the leader renews again; shorter than the lease.
    pub renew_deadline: Duration,
    /// Retry period of the original; kept for compatibility.
    pub retry_period: Duration,
}

/// Where and whether to run leader election.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Election {
    /// Dev mode: this process is always the leader.
    Disabled,
    /// Elect through a Lease.
    Lease {
        /// Lease name.
        name: String,
        /// Lease namespace.
        namespace: String,
        /// Holder identity of this process.
        identity: String,
        /// Timing.
        timing: ElectionTiming,
    },
}

/// Validated configuration of the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Kubeconfig file; in-cluster when `None`.
    pub kubeconfig: Option<PathBuf>,
    /// API server URL override.
    pub master: Option<String>,
    /// Debug logging.
    pub debug: bool,
    /// Log format.
    pub log_format: LogFormat,
    /// Parallel reconciles per controller.
    pub workers: u16,
    /// Health and metrics address.
    pub admin_address: SocketAddr,
    /// Multus attachment of the flat network.
    pub network_attachment: String,
    /// Period of the full re-reconcile.
    pub resync: Duration,
    /// Leader election.
    pub election: Election,
    /// Pod CIDRs of the cluster.
    pub cluster_cidrs: Vec<Cidr>,
    /// Service CIDRs of the cluster.
    pub service_cidrs: Vec<Cidr>,
    /// Settings copied into the NetworkAttachmentDefinitions.
    pub cni: CniSettings,
    /// The admission webhook.
    pub webhook: WebhookSettings,
    /// Settings of the allocation controllers.
    pub allocation: crate::allocation::Settings,
    /// Settings of the floating-address controllers.
    pub floating: crate::floating::Settings,
    /// What the FlatNetworkConfig's conditions look at.
    pub cluster_health: crate::cluster_health::Settings,
}

/// Settings the operator writes into every NetworkAttachmentDefinition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniSettings {
    /// Address announcement.
    pub arp_policy: ArpPolicy,
    /// Proxy ARP on the pod interface.
    pub proxy_arp: bool,
    /// Pod interface MTU; `None` leaves it to the parent link.
    pub mtu: Option<u16>,
}

/// Where and how the admission webhook is served and registered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookSettings {
    /// Serve it at all.
    pub enabled: bool,
    /// Listening address.
    pub listen: SocketAddr,
    /// Namespace of the Service and the Secret (the operator's).
    pub namespace: String,
    /// Service in front of the replicas.
    pub service: String,
    /// Secret with the CA and serving certificate.
    pub secret: String,
    /// ValidatingWebhookConfiguration name.
    pub configuration: String,
    /// Out-of-cluster URL registered instead of the Service.
    pub url: Option<WebhookUrl>,
}

/// A development URL of the webhook: `https://host:port/path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookUrl {
    /// The URL as given.
    pub url: String,
    /// Its host, put in the serving certificate.
    pub host: String,
}

/// A setting that cannot be used; the message names the flag, its variable and the fix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// Not a Go duration.
    #[error(
        "{setting}: {value:?} is not a duration; write it like Go does, e.g. `45s`, `2m`, `1h30m`"
    )]
    Duration {
        /// Flag and variable.
        setting: &'static str,
        /// What was given.
        value: String,
    },
    /// A duration of zero or less.
    #[error("{setting}: {value:?} must be longer than zero")]
    NotPositive {
        /// Flag and variable.
        setting: &'static str,
        /// What was given.
        value: String,
    },
    /// Renew deadline not shorter than the lease.
    #[error(
        "CATTLE_ELECTION_RENEW_DEADLINE ({renew:?}) must be shorter than CATTLE_ELECTION_LEASE_DURATION ({lease:?}) by at least a second"
    )]
    RenewNotBeforeExpiry {
        /// Renew deadline.
        renew: Duration,
        /// Lease duration.
        lease: Duration,
    },
    /// Renew deadline under a second (the lease works in whole seconds).
    #[error("CATTLE_ELECTION_RENEW_DEADLINE ({0:?}) must be at least 1s")]
    RenewTooShort(Duration),
    /// Resync of zero minutes.
    #[error("CATTLE_RESYNC_DEFAULT (--resync-minutes) must be at least 1 minute")]
    ZeroResync,
    /// A bad CIDR list.
    #[error("{setting}: {source}; give a comma-separated list such as `10.42.0.0/16,fd42::/56`")]
    Cidr {
        /// Flag and variable.
        setting: &'static str,
        /// The parse error.
        #[source]
        source: CidrError,
    },
    /// No identity for the lease.
    #[error("no lease identity: set HOSTNAME (the pod name) or --identity")]
    NoIdentity,
    /// Empty attachment name.
    #[error("FLATNET_NETWORK_ATTACHMENT (--network-attachment) must not be empty")]
    EmptyAttachment,
    /// MTU out of range.
    #[error(
        "FLATNET_CNI_MTU (--cni-mtu) {0} is out of range: use 68..65535, or 0 to inherit the parent link's MTU"
    )]
    Mtu(u32),
    /// The webhook URL is not `https://host[:port]/path`.
    #[error(
        "FLATNET_WEBHOOK_URL (--webhook-url) {0:?} is not an https URL: write it like https://127.0.0.1:8443/validate"
    )]
    WebhookUrl(String),
}

impl Cli {
    /// Parses the process arguments and environment, exiting with clap's
    /// message on a usage error. An empty environment variable counts as
    /// unset: Helm charts pass `""` for values left blank.
    #[must_use]
    pub fn parse_args() -> Self {
        let empty = |var: &OsStr| std::env::var_os(var).is_some_and(|v| v.is_empty());
        let matches = without_env(<Self as CommandFactory>::command(), empty).get_matches();
        <Self as FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }

    /// Checks every setting and builds the [`Config`].
    ///
    /// # Errors
    /// A [`ConfigError`] naming the first unusable setting.
    pub fn into_config(self) -> Result<Config, ConfigError> {
        let dev_mode = self.dev_mode.as_deref().is_some_and(|v| !v.is_empty());
        // The Lease lives in the operator's namespace, and so do the webhook's objects.
        let operator_namespace = self.lease_namespace.clone();
        let floating_namespace = operator_namespace.clone();
        let wire_window = go_duration("FLATNET_WIRE_WINDOW (--wire-window)", &self.wire_window)?;
        let cluster_health = crate::cluster_health::Settings {
            namespace: operator_namespace.clone(),
            daemonset: self.agent_daemonset.clone(),
            leader: self
                .identity
                .clone()
                .filter(|i| !i.is_empty())
                .unwrap_or_else(|| "the only replica".to_owned()),
            interval: crate::cluster_health::DEFAULT_INTERVAL,
            ca_bundle_interval: crate::cluster_health::DEFAULT_CA_BUNDLE_INTERVAL,
            wire_window,
        };
        let election = if self.leader_election {
            let mut timing = election_timing(
                &self.election_lease_duration,
                &self.election_renew_deadline,
                &self.election_retry_period,
            )?;
            if dev_mode {
                timing.lease_duration = DEV_MODE_LEASE_DURATION;
                timing.renew_deadline = DEV_MODE_RENEW_DEADLINE;
            }
            Election::Lease {
                name: self.lease_name,
                namespace: self.lease_namespace,
                identity: self
                    .identity
                    .filter(|i| !i.is_empty())
                    .ok_or(ConfigError::NoIdentity)?,
                timing,
            }
        } else {
            Election::Disabled
        };
        if self.resync_minutes == 0 {
            return Err(ConfigError::ZeroResync);
        }
        if self.network_attachment.is_empty() {
            return Err(ConfigError::EmptyAttachment);
        }
        let attachment = self.network_attachment.clone();
        Ok(Config {
            kubeconfig: self.kubeconfig,
            master: self.master.filter(|m| !m.is_empty()),
            debug: self.debug || dev_mode,
            log_format: self.log_format,
            workers: if WORKER_RANGE.contains(&self.worker) {
                self.worker
            } else {
                DEFAULT_WORKERS
            },
            admin_address: self.admin_address,
            network_attachment: self.network_attachment,
            resync: Duration::from_secs(self.resync_minutes.saturating_mul(60)),
            election,
            cluster_cidrs: cidr_list("FLAT_NETWORK_CLUSTER_CIDR", &self.cluster_cidr)?,
            service_cidrs: cidr_list("FLAT_NETWORK_SERVICE_CIDR", &self.service_cidr)?,
            cni: CniSettings {
                arp_policy: env::cni_arp_policy(&self.arp_policy).value,
                proxy_arp: env::cni_proxy_arp(&self.proxy_arp).value,
                mtu: match self.cni_mtu {
                    0 => None,
                    mtu @ 68..=65535 => Some(u16::try_from(mtu).unwrap_or(u16::MAX)),
                    other => return Err(ConfigError::Mtu(other)),
                },
            },
            webhook: WebhookSettings {
                enabled: self.webhook_server,
                listen: SocketAddr::new(self.bind_address, self.port),
                namespace: operator_namespace,
                service: self.webhook_service,
                secret: self.webhook_secret,
                configuration: self.webhook_config,
                url: self
                    .webhook_url
                    .filter(|u| !u.is_empty())
                    .map(|u| webhook_url(&u))
                    .transpose()?,
            },
            allocation: crate::allocation::Settings {
                statefulset_policy: match self.statefulset_address_policy {
                    StatefulSetPolicy::Sticky => StatefulSetAddressPolicy::Sticky,
                    StatefulSetPolicy::Release => StatefulSetAddressPolicy::Release,
                },
                pending_timeout: go_duration(
                    "FLATNET_PENDING_TIMEOUT (--pending-timeout)",
                    &self.pending_timeout,
                )?,
                node_gone_grace: go_duration(
                    "FLATNET_NODE_GONE_GRACE (--node-gone-grace)",
                    &self.node_gone_grace,
                )?,
                wire_window,
                resync: Duration::from_secs(self.resync_minutes.saturating_mul(60)),
                attachment,
                ..crate::allocation::Settings::default()
            },
            floating: crate::floating::Settings {
                classless: self.floating_ip_classless,
                namespace: floating_namespace,
                resync: Duration::from_secs(self.resync_minutes.saturating_mul(60)),
                ..crate::floating::Settings::default()
            },
            cluster_health,
        })
    }

    /// The settings replaced by their default because their value is not
    /// usable, as the original did, each with the warning to log.
    #[must_use]
    pub fn fallbacks(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if !WORKER_RANGE.contains(&self.worker) {
            warnings.push(format!(
                "--worker {} must be within 1..=50, using {DEFAULT_WORKERS}",
                self.worker
            ));
        }
        warnings.extend(env::cni_arp_policy(&self.arp_policy).warning);
        warnings.extend(env::cni_proxy_arp(&self.proxy_arp).warning);
        warnings
    }
}

/// Election timing of wrangler's dev mode (`CATTLE_DEV_MODE`): a lease that
/// outlives restarts while debugging.
pub const DEV_MODE_LEASE_DURATION: Duration = Duration::from_secs(45 * 3600);
/// Renew deadline of wrangler's dev mode.
pub const DEV_MODE_RENEW_DEADLINE: Duration = Duration::from_secs(30 * 3600);

/// Stops the arguments whose variable `drop` selects from reading it.
fn without_env(mut cmd: Command, drop: impl Fn(&OsStr) -> bool) -> Command {
    let ids: Vec<String> = cmd
        .get_arguments()
        .filter(|a| a.get_env().is_some_and(&drop))
        .map(|a| a.get_id().to_string())
        .collect();
    for id in ids {
        cmd = cmd.mut_arg(id, |a| a.env(None));
    }
    cmd
}

fn election_timing(lease: &str, renew: &str, retry: &str) -> Result<ElectionTiming, ConfigError> {
    let timing = ElectionTiming {
        lease_duration: go_duration("CATTLE_ELECTION_LEASE_DURATION", lease)?,
        renew_deadline: go_duration("CATTLE_ELECTION_RENEW_DEADLINE", renew)?,
        retry_period: go_duration("CATTLE_ELECTION_RETRY_PERIOD", retry)?,
    };
    // The lease manager works in whole seconds and renews `lease - renew`
    // seconds before expiry, so that gap must be at least one second.
    if timing.renew_deadline.as_secs() == 0 {
        return Err(ConfigError::RenewTooShort(timing.renew_deadline));
    }
    if timing.lease_duration.as_secs() <= timing.renew_deadline.as_secs() {
        return Err(ConfigError::RenewNotBeforeExpiry {
            renew: timing.renew_deadline,
            lease: timing.lease_duration,
        });
    }
    Ok(timing)
}

/// Parses a positive Go duration (`300ms`, `45s`, `1h30m`).
///
/// # Errors
/// [`ConfigError::Duration`] when the text is not a Go duration,
/// [`ConfigError::NotPositive`] when it is zero or negative.
pub fn go_duration(setting: &'static str, value: &str) -> Result<Duration, ConfigError> {
    let nanos =
        go_parse_duration::parse_duration(value.trim()).map_err(|_| ConfigError::Duration {
            setting,
            value: value.to_owned(),
        })?;
    let nanos = u64::try_from(nanos)
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| ConfigError::NotPositive {
            setting,
            value: value.to_owned(),
        })?;
    Ok(Duration::from_nanos(nanos))
}

/// Checks a development webhook URL and takes its host for the certificate.
fn webhook_url(url: &str) -> Result<WebhookUrl, ConfigError> {
    let bad = || ConfigError::WebhookUrl(url.to_owned());
    let rest = url.strip_prefix("https://").ok_or_else(bad)?;
    let authority = rest.split('/').next().unwrap_or_default();
    // `[::1]:8443`, `127.0.0.1:8443`, `localhost`
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next().unwrap_or_default()
    } else {
        authority.split(':').next().unwrap_or_default()
    };
    if host.is_empty() {
        return Err(bad());
    }
    Ok(WebhookUrl {
        url: url.to_owned(),
        host: host.to_owned(),
    })
}

fn cidr_list(setting: &'static str, value: &str) -> Result<Vec<Cidr>, ConfigError> {
    value
        .split(',')
        .map(|part| part.trim().parse::<Cidr>())
        .collect::<Result<_, _>>()
        .map_err(|source| ConfigError::Cidr { setting, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses with an explicit environment: the process environment is
    /// ignored, and each `(VAR, value)` is fed to the argument reading `VAR`.
    fn parse(args: &[&str], env: &[(&str, &'static str)]) -> Result<Config, ConfigError> {
        let mut cmd = <Cli as CommandFactory>::command();
        for (var, value) in env {
            let id = cmd
                .get_arguments()
                .find(|a| a.get_env().is_some_and(|e| e == *var))
                .map(|a| a.get_id().to_string())
                .unwrap_or_else(|| panic!("no argument reads {var}"));
            cmd = cmd.mut_arg(id, |a| a.default_value(*value));
        }
        let matches = without_env(cmd, |_| true)
            .try_get_matches_from(std::iter::once("flatnet-operator").chain(args.iter().copied()))
            .expect("arguments parse");
        let cli = <Cli as FromArgMatches>::from_arg_matches(&matches).expect("matches map to Cli");
        cli.into_config()
    }

    #[test]
    fn empty_variables_are_dropped_and_others_kept() {
        let cmd = without_env(<Cli as CommandFactory>::command(), |var| {
            var == "CATTLE_RESYNC_DEFAULT"
        });
        let env_of = |id: &str| {
            cmd.get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_env())
                .is_some()
        };
        assert!(!env_of("resync_minutes"));
        assert!(env_of("dev_mode"));
    }

    #[test]
    fn settings_read_the_original_variables() {
        let cmd = <Cli as clap::CommandFactory>::command();
        let env_of = |id: &str| {
            cmd.get_arguments()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_env())
                .map(|e| e.to_string_lossy().into_owned())
        };
        for (id, var) in [
            ("kubeconfig", "KUBECONFIG"),
            ("dev_mode", "CATTLE_DEV_MODE"),
            ("resync_minutes", "CATTLE_RESYNC_DEFAULT"),
            ("election_lease_duration", "CATTLE_ELECTION_LEASE_DURATION"),
            ("election_renew_deadline", "CATTLE_ELECTION_RENEW_DEADLINE"),
            ("election_retry_period", "CATTLE_ELECTION_RETRY_PERIOD"),
            ("cluster_cidr", "FLAT_NETWORK_CLUSTER_CIDR"),
            ("service_cidr", "FLAT_NETWORK_SERVICE_CIDR"),
        ] {
            assert_eq!(env_of(id).as_deref(), Some(var), "argument {id}");
        }
    }

    #[test]
    fn allocation_settings_read_their_variables() {
        let config = parse(&["--identity", "op-0"], &[]).unwrap();
        assert_eq!(
            config.allocation.statefulset_policy,
            StatefulSetAddressPolicy::Sticky
        );
        assert_eq!(config.allocation.pending_timeout, Duration::from_secs(300));
        assert_eq!(config.allocation.node_gone_grace, Duration::from_secs(300));
        let config = parse(
            &["--identity", "op-0"],
            &[
                ("FLATNET_STATEFULSET_ADDRESS_POLICY", "release"),
                ("FLATNET_PENDING_TIMEOUT", "90s"),
                ("FLATNET_NODE_GONE_GRACE", "10m"),
                ("CATTLE_RESYNC_DEFAULT", "3"),
            ],
        )
        .unwrap();
        assert_eq!(
            config.allocation.statefulset_policy,
            StatefulSetAddressPolicy::Release
        );
        assert_eq!(config.allocation.pending_timeout, Duration::from_secs(90));
        assert_eq!(config.allocation.node_gone_grace, Duration::from_secs(600));
        assert_eq!(config.allocation.resync, Duration::from_secs(180));
        let err = parse(
            &["--identity", "op-0"],
            &[("FLATNET_PENDING_TIMEOUT", "0s")],
        )
        .unwrap_err();
        assert!(err.to_string().contains("FLATNET_PENDING_TIMEOUT"), "{err}");
    }

    #[test]
    fn defaults_match_the_original() {
        let config = parse(&["--identity", "op-0"], &[]).unwrap();
        assert_eq!(config.workers, 5);
        assert_eq!(config.resync, Duration::from_secs(600));
        assert_eq!(config.network_attachment, "rancher-flat-network");
        assert_eq!(
            config.election,
            Election::Lease {
                name: "rancher-flat-network-operator".into(),
                namespace: "cattle-flat-network".into(),
                identity: "op-0".into(),
                timing: ElectionTiming {
                    lease_duration: Duration::from_secs(45),
                    renew_deadline: Duration::from_secs(30),
                    retry_period: Duration::from_secs(2),
                },
            }
        );
        assert_eq!(config.cluster_cidrs, vec!["10.42.0.0/16".parse().unwrap()]);
        assert_eq!(config.service_cidrs, vec!["10.43.0.0/16".parse().unwrap()]);
        assert!(!config.debug);
    }

    #[test]
    fn election_durations_come_from_cattle_env() {
        let config = parse(
            &[],
            &[
                ("HOSTNAME", "op-1"),
                ("CATTLE_ELECTION_LEASE_DURATION", "2m"),
                ("CATTLE_ELECTION_RENEW_DEADLINE", "1m30s"),
                ("CATTLE_ELECTION_RETRY_PERIOD", "500ms"),
            ],
        )
        .unwrap();
        let Election::Lease {
            timing, identity, ..
        } = config.election
        else {
            panic!("election must be on without CATTLE_DEV_MODE");
        };
        assert_eq!(identity, "op-1");
        assert_eq!(timing.lease_duration, Duration::from_secs(120));
        assert_eq!(timing.renew_deadline, Duration::from_secs(90));
        assert_eq!(timing.retry_period, Duration::from_millis(500));
    }

    #[test]
    fn dev_mode_keeps_the_election_with_wranglers_dev_timing_and_turns_on_debug() {
        let config = parse(
            &["--identity", "x"],
            &[
                ("CATTLE_DEV_MODE", "true"),
                ("CATTLE_ELECTION_RETRY_PERIOD", "3s"),
            ],
        )
        .unwrap();
        assert!(config.debug);
        let Election::Lease { timing, .. } = config.election else {
            panic!("dev mode must still elect: {:?}", config.election);
        };
        assert_eq!(timing.lease_duration, Duration::from_secs(45 * 3600));
        assert_eq!(timing.renew_deadline, Duration::from_secs(30 * 3600));
        assert_eq!(timing.retry_period, Duration::from_secs(3));
        let config = parse(&["--leader-election=false"], &[]).unwrap();
        assert_eq!(config.election, Election::Disabled);
        assert!(!config.debug);
    }

    #[test]
    fn renew_deadline_must_be_shorter_than_the_lease() {
        let err = parse(
            &["--identity", "x"],
            &[("CATTLE_ELECTION_RENEW_DEADLINE", "45s")],
        )
        .unwrap_err();
        assert!(
            matches!(err, ConfigError::RenewNotBeforeExpiry { .. }),
            "{err}"
        );
        let err = parse(
            &["--identity", "x"],
            &[("CATTLE_ELECTION_RENEW_DEADLINE", "900ms")],
        )
        .unwrap_err();
        assert_eq!(err, ConfigError::RenewTooShort(Duration::from_millis(900)));
    }

    #[test]
    fn bad_durations_name_the_variable() {
        let err = parse(
            &["--identity", "x"],
            &[("CATTLE_ELECTION_LEASE_DURATION", "45")],
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("CATTLE_ELECTION_LEASE_DURATION"),
            "{err}"
        );
        let err = parse(
            &["--identity", "x"],
            &[("CATTLE_ELECTION_RETRY_PERIOD", "-2s")],
        )
        .unwrap_err();
        assert!(matches!(err, ConfigError::NotPositive { .. }), "{err}");
    }

    #[test]
    fn out_of_range_workers_fall_back_to_five() {
        let config = parse(&["--identity", "x", "--worker", "51"], &[]).unwrap();
        assert_eq!(config.workers, 5);
        let config = parse(&["--identity", "x", "--worker", "50"], &[]).unwrap();
        assert_eq!(config.workers, 50);
    }

    #[test]
    fn dual_stack_cidr_lists_parse_and_bad_ones_are_rejected() {
        let config = parse(
            &["--identity", "x"],
            &[("FLAT_NETWORK_CLUSTER_CIDR", "10.42.0.0/16, fd42::/56")],
        )
        .unwrap();
        assert_eq!(config.cluster_cidrs.len(), 2);
        let err = parse(
            &["--identity", "x"],
            &[("FLAT_NETWORK_SERVICE_CIDR", "10.43.0.0/33")],
        )
        .unwrap_err();
        assert!(matches!(
            err,
            ConfigError::Cidr {
                setting: "FLAT_NETWORK_SERVICE_CIDR",
                ..
            }
        ));
    }

    #[test]
    fn election_needs_an_identity() {
        assert_eq!(parse(&[], &[]).unwrap_err(), ConfigError::NoIdentity);
        assert_eq!(
            parse(&[], &[("HOSTNAME", "")]).unwrap_err(),
            ConfigError::NoIdentity
        );
    }

    #[test]
    fn cni_settings_follow_the_original_variables() {
        let config = parse(&["--identity", "x"], &[]).unwrap();
        assert_eq!(
            config.cni,
            CniSettings {
                arp_policy: ArpPolicy::ArpNotify,
                proxy_arp: false,
                mtu: Some(1500),
            }
        );
        let config = parse(
            &["--identity", "x", "--cni-mtu", "0"],
            &[
                ("FLAT_NETWORK_CNI_ARP_POLICY", "arping"),
                ("FLAT_NETWORK_CNI_PROXY_ARP", "1"),
            ],
        )
        .unwrap();
        assert_eq!(config.cni.arp_policy, ArpPolicy::Arping);
        assert!(config.cni.proxy_arp);
        assert_eq!(config.cni.mtu, None);
    }

    #[test]
    fn bad_cni_settings_fall_back_with_a_warning_naming_the_variable() {
        let mut cmd = <Cli as CommandFactory>::command();
        for (id, value) in [("arp_policy", "garp"), ("proxy_arp", "yes")] {
            cmd = cmd.mut_arg(id, |a| a.default_value(value));
        }
        let matches = without_env(cmd, |_| true)
            .try_get_matches_from(["flatnet-operator", "--identity", "x"])
            .unwrap();
        let cli = <Cli as FromArgMatches>::from_arg_matches(&matches).unwrap();
        let warnings = cli.fallbacks();
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(
            warnings[0].starts_with("FLAT_NETWORK_CNI_ARP_POLICY"),
            "{warnings:?}"
        );
        assert!(warnings[0].contains("\"garp\""), "{warnings:?}");
        assert!(
            warnings[1].starts_with("FLAT_NETWORK_CNI_PROXY_ARP"),
            "{warnings:?}"
        );
        let config = cli.into_config().unwrap();
        assert_eq!(config.cni.arp_policy, ArpPolicy::ArpNotify);
        assert!(!config.cni.proxy_arp);
        assert!(
            parse(&["--identity", "x"], &[]).is_ok(),
            "good values need no fallback"
        );
        let err = parse(&["--identity", "x", "--cni-mtu", "67"], &[]).unwrap_err();
        assert_eq!(err, ConfigError::Mtu(67));
    }

    #[test]
    fn webhook_defaults_and_dev_url() {
        let config = parse(&["--identity", "x"], &[("POD_NAMESPACE", "flat")]).unwrap();
        let webhook = config.webhook;
        assert!(webhook.enabled);
        assert_eq!(webhook.listen, "0.0.0.0:443".parse().unwrap());
        assert_eq!(webhook.namespace, "flat");
        assert_eq!(webhook.service, "rancher-flat-network-webhook-svc");
        assert_eq!(webhook.secret, "rancher-flat-network-webhook-certs");
        assert_eq!(
            webhook.configuration,
            "rancher-flat-network-subnets-validating-config"
        );
        assert_eq!(webhook.url, None);

        let config = parse(
            &[
                "--identity",
                "x",
                "--webhook-server=false",
                "--port",
                "8443",
                "--webhook-url",
                "https://[::1]:8443/validate",
            ],
            &[],
        )
        .unwrap();
        assert!(!config.webhook.enabled);
        assert_eq!(config.webhook.listen.port(), 8443);
        assert_eq!(config.webhook.url.unwrap().host, "::1");
        for bad in ["http://127.0.0.1/validate", "https:///validate"] {
            let err = parse(&["--identity", "x", "--webhook-url", bad], &[]).unwrap_err();
            assert_eq!(err, ConfigError::WebhookUrl(bad.into()));
        }
        let url = parse(
            &[
                "--identity",
                "x",
                "--webhook-url",
                "https://dev.example:9443/v",
            ],
            &[],
        )
        .unwrap()
        .webhook
        .url
        .unwrap();
        assert_eq!(url.host, "dev.example");
    }

    #[test]
    fn go_durations_parse_like_go() {
        assert_eq!(
            go_duration("X", "1h30m").unwrap(),
            Duration::from_secs(5400)
        );
        assert_eq!(
            go_duration("X", "1.5s").unwrap(),
            Duration::from_millis(1500)
        );
        assert!(go_duration("X", "0s").is_err());
        assert!(go_duration("X", "").is_err());
        assert!(go_duration("X", "5 minutes").is_err());
    }
}
