//! `flatnet-agent run`: the node daemon serving CNI requests.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use clap::Args;
use flatnet_agent::{
    cluster_config,
    cluster_settings::{self, EnvSettings, SettingsView},
    cni::plugin::DEFAULT_AGENT_SOCKET,
    cni_service::{AgentService, ServiceConfig, SpecSettings},
    datapath::{Datapath, DatapathConfig, PolicyMaps},
    desired::{
        DesiredState,
        kubernetes::Kubernetes,
        standalone::{Standalone, StateSource},
    },
    floating::{
        self,
        kubernetes::{AttachUplink, Floating},
        pods::PodAddresses,
    },
    install,
    link::{AnnounceSettings, Attachments, DEFAULT_LEASE_DIR, SharedNetlink},
    mac_conflict,
    metrics::Metrics,
    node_heartbeat::{self, Heartbeat, Readiness},
    policy_compiler::{NetworkNames, api::DEFAULT_NETWORK_NAME},
    policy_controller::{
        self, PinnedPolicy, PolicyController, PolicyTrigger, standalone::StandalonePolicies,
    },
    records::{DEFAULT_RECORD_DIR, Records},
    rpc::{AgentServer, ServerConfig},
    wire_report,
};
use flatnet_common::pin::PIN_ROOT;
use flatnet_k8s::{
    agent_heartbeat::{REASON_PROGRAMS_NOT_LOADED, REASON_START_FAILED},
    env,
};
use ipnet::IpNet;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// This node's name (Kubernetes `spec.nodeName`); the hostname when unset.
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    /// Unix socket flatnet-cni talks to.
    #[arg(long, env = "FLATNET_AGENT_SOCKET", default_value = DEFAULT_AGENT_SOCKET)]
    socket: PathBuf,
    /// Directory on the BPF filesystem for pinned maps.
    #[arg(long, env = "FLATNET_BPF_PIN_ROOT", default_value = PIN_ROOT)]
    pin_root: PathBuf,
    #[command(flatten)]
    attach: super::datapath::AttachArgs,
    /// Directory of the attachment records.
    #[arg(long, env = "FLATNET_RECORD_DIR", default_value = DEFAULT_RECORD_DIR)]
    record_dir: PathBuf,
    /// Directory of the VLAN interface leases.
    #[arg(long, env = "FLATNET_VLAN_LEASE_DIR", default_value = DEFAULT_LEASE_DIR)]
    lease_dir: PathBuf,
    /// Where `flatnet-cni` is installed.
    #[arg(long, env = "FLATNET_CNI_BIN_DIR", default_value = "/opt/cni/bin")]
    cni_bin_dir: PathBuf,
    /// The `flatnet-cni` to install; the one next to this executable when unset.
    #[arg(long, env = "FLATNET_CNI_BINARY")]
    cni_binary: Option<PathBuf>,
    /// Do not install `flatnet-cni` (it is installed by other means).
    #[arg(long, env = "FLATNET_SKIP_CNI_INSTALL")]
    skip_cni_install: bool,
    /// Also write a network configuration list into this directory.
    #[arg(long, env = "FLATNET_CNI_CONF_DIR")]
    cni_conf_dir: Option<PathBuf>,
    /// Network name of that configuration list.
    #[arg(long, env = "FLATNET_CNI_NETWORK_NAME", default_value = "flatnet")]
    cni_network_name: String,
    /// File name of that configuration list.
    #[arg(
        long,
        env = "FLATNET_CNI_CONF_FILE",
        default_value = "10-flatnet.conflist"
    )]
    cni_conf_file: String,
    /// How pod addresses are announced after set-up: `arp_notify` or
    /// `arping`; another value is `arp_notify`, with a warning, as the
    /// original read it.
    #[arg(long, env = env::FLAT_NETWORK_CNI_ARP_POLICY, default_value = env::DEFAULT_ARP_POLICY)]
    arp_policy: String,
    /// Turn on proxy ARP (`proxy_arp`) on every pod's flat interface, as
    /// rancher-flat-network's `proxyARP` did (a Go boolean; another value
    /// is `false`, with a warning).
    #[arg(long, env = env::FLAT_NETWORK_CNI_PROXY_ARP, default_value = "false")]
    proxy_arp: String,
    /// Cluster pod CIDRs kept on the primary interface (comma-separated).
    #[arg(long, env = env::FLAT_NETWORK_CLUSTER_CIDR, default_value = env::DEFAULT_CLUSTER_CIDR, value_delimiter = ',')]
    cluster_cidr: Vec<IpNet>,
    /// Service CIDRs kept on the primary interface (comma-separated).
    #[arg(long, env = env::FLAT_NETWORK_SERVICE_CIDR, default_value = env::DEFAULT_SERVICE_CIDR, value_delimiter = ',')]
    service_cidr: Vec<IpNet>,
    /// How long ADD listens for another host answering for a new address
    /// (milliseconds, 0 turns the probe off). The FlatNetworkConfig's
    /// `spec.agents.conflictProbe` wins over it.
    #[arg(long, env = "FLATNET_CONFLICT_PROBE_MS", default_value_t = 500)]
    conflict_probe_ms: u64,
    /// Enforce MultiNetworkPolicies (false: pods send and receive
    /// unfiltered). The FlatNetworkConfig's `spec.agents.policyEnforcement`
    /// wins over it.
    #[arg(long, env = "FLATNET_POLICY_ENFORCEMENT", default_value_t = true, action = clap::ArgAction::Set)]
    policy_enforcement: bool,
    /// Kubernetes: how long ADD waits for the operator's allocation.
    #[arg(long, env = "FLATNET_ALLOCATION_WAIT_SECONDS", default_value_t = 30)]
    allocation_wait_seconds: u64,
    /// Serve `/healthz`, `/readyz` and Prometheus `/metrics` on this address.
    #[arg(long, env = "FLATNET_ADMIN_ADDRESS")]
    admin_address: Option<SocketAddr>,
    /// Run without Kubernetes, from `--state-file`.
    #[arg(long, env = "FLATNET_STANDALONE", requires = "state_file")]
    standalone: bool,
    /// Standalone: the YAML file of subnets and networks.
    #[arg(long, env = "FLATNET_STATE_FILE")]
    state_file: Option<PathBuf>,
    /// Standalone: directory of the allocation file.
    #[arg(long, env = "FLATNET_STATE_DIR", default_value = "/var/lib/flatnet")]
    state_dir: PathBuf,
    /// The node's network namespace file, when the agent runs outside it
    /// (the lab and tests); the agent's own namespace when unset.
    #[arg(long, env = "FLATNET_HOST_NETNS")]
    host_netns: Option<PathBuf>,
    /// The container runtime's CRI socket, where the network namespace of
    /// a pod this agent did not attach is found (hot-plugging into it);
    /// empty: not looked up.
    #[arg(long, env = "FLATNET_CRI_SOCKET", default_value = flatnet_agent::cri::DEFAULT_CRI_SOCKET)]
    cri_socket: PathBuf,
    /// Kubernetes: answer for the floating addresses of LoadBalancer
    /// Services this node is eligible for (heartbeats with the other agents).
    #[arg(long, env = "FLATNET_FLOATING_IP", default_value_t = true, action = clap::ArgAction::Set)]
    floating_ip: bool,
    /// Kubernetes: the UDP port agents exchange floating-address heartbeats
    /// on (every node's, the same).
    #[arg(long, env = "FLATNET_FLOATING_IP_PORT", default_value_t = flatnet_agent::floating::heartbeat::HEARTBEAT_PORT)]
    floating_ip_port: u16,
    /// Kubernetes: also serve LoadBalancer Services without a
    /// loadBalancerClass (as the operator's `FLATNET_FLOATING_IP_CLASSLESS`).
    #[arg(long, env = "FLATNET_FLOATING_IP_CLASSLESS", default_value_t = false, action = clap::ArgAction::Set)]
    floating_ip_classless: bool,
    /// Network names a MultiNetworkPolicy's `k8s.v1.cni.cncf.io/policy-for`
    /// must mention to be enforced (`name` or `namespace/name`).
    #[arg(long = "policy-network", env = "FLATNET_POLICY_NETWORKS", value_delimiter = ',',
          default_value = DEFAULT_NETWORK_NAME)]
    policy_networks: Vec<String>,
    /// Kubernetes: flatnet's namespace, where the node's readiness
    /// heartbeat (Lease `flatnet-agent-<node>`) is written; the service
    /// account's when unset.
    #[arg(long, env = "POD_NAMESPACE")]
    namespace: Option<String>,
    /// Kubernetes: the agent's pod name, owner of its heartbeat.
    #[arg(long, env = "POD_NAME", requires = "pod_uid")]
    pod_name: Option<String>,
    /// Kubernetes: the agent's pod UID, owner of its heartbeat.
    #[arg(long, env = "POD_UID", requires = "pod_name")]
    pod_uid: Option<String>,
}

/// Where the policy controller reads policies from.
enum PolicySource {
    /// The state file's policy sections and the attachment records,
    /// starting from the text of the state file in force.
    Standalone {
        /// The state file, followed.
        path: PathBuf,
        /// The text in force (the last good copy's when the file is rejected).
        text: String,
    },
    /// Watches on the Kubernetes API.
    Kubernetes(kube::Client),
}

impl RunArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("start the async runtime")?;
        runtime.block_on(self.run_async())
    }

    /// The pod interface settings.
    fn spec_settings(&self) -> SpecSettings {
        SpecSettings {
            cluster_cidrs: self.cluster_cidr.clone(),
            service_cidrs: self.service_cidr.clone(),
        }
    }

    async fn run_async(self) -> anyhow::Result<()> {
        let node_name = match &self.node_name {
            Some(name) => name.clone(),
            None => std::fs::read_to_string("/proc/sys/kernel/hostname")
                .context("read the hostname (set NODE_NAME)")?
                .trim()
                .to_owned(),
        };
        tracing::info!(node = %node_name, standalone = self.standalone, "flatnet-agent starting");
        self.install_cni()?;
        let metrics = Arc::new(Metrics::default());
        if self.standalone {
            let state_file = self.state_file.as_deref().expect("clap requires it");
            let rejected = metrics.state_file_rejected.clone();
            let state = StateSource::new(state_file, &self.state_dir, rejected);
            let desired =
                Standalone::following(state, &self.state_dir)?.with_wire_inventory(&self.pin_root);
            let records = Records::open(&self.record_dir)?;
            desired
                .adopt_records(&records.all()?)
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let source = PolicySource::Standalone {
                path: state_file.to_owned(),
                text: desired.state_text().await,
            };
            let readiness = Readiness::default();
            let settings = cluster_settings::from_environment(self.env_settings());
            self.serve(
                node_name,
                desired,
                records,
                (source, settings),
                metrics,
                readiness,
                |_| async {},
            )
            .await
        } else {
            let client = kube::Client::try_default()
                .await
                .context("connect to the Kubernetes API (in-cluster, or KUBECONFIG); use --standalone without Kubernetes")?;
            let wait = Duration::from_secs(self.allocation_wait_seconds);
            let desired = Kubernetes::new(client.clone(), &node_name, wait);
            desired.follow_allocations();
            let records = Records::open(&self.record_dir)?;
            let source = PolicySource::Kubernetes(client.clone());
            // One watch of the FlatNetworkConfig `cluster` for every reader.
            let cluster = cluster_config::watch(client.clone());
            let settings = cluster_settings::follow(cluster.clone(), self.env_settings());
            let (node, pin_root) = (node_name.clone(), self.pin_root.clone());
            let floating_metrics = metrics.floating.clone();
            let mac_conflicts = metrics.mac_conflicts.clone();
            let pod_records = records.clone();
            let conflict_records = records.clone();
            let readiness = Readiness::default();
            let namespace = self
                .namespace
                .clone()
                .unwrap_or_else(|| client.default_namespace().to_owned());
            let floating = self.floating_config(&node_name, &namespace);
            let heartbeat = Heartbeat::new(
                client.clone(),
                node_heartbeat::Settings::new(
                    &namespace,
                    &node_name,
                    self.pod_name.clone().zip(self.pod_uid.clone()),
                ),
            );
            tokio::spawn(heartbeat.clone().run(readiness.clone()));
            let served = self
                .serve(
                    node_name,
                    desired,
                    records,
                    (source, settings),
                    metrics,
                    readiness.clone(),
                    |service| async move {
                        // Kept for the agent's life: dropping it stops the loop.
                        let _floating = floating.map(|config| {
                            let attach_service = service.clone();
                            let attach: AttachUplink = Arc::new(move |interface: String| {
                                let service = attach_service.clone();
                                Box::pin(async move {
                                    service
                                        .attach_uplink(&interface)
                                        .await
                                        .map_err(|e| e.to_string())
                                })
                            });
                            let floating = Floating::start(
                                client.clone(),
                                config,
                                floating_metrics.clone(),
                                attach,
                            );
                            let pods = PodAddresses::start(
                                client.clone(),
                                node.clone(),
                                pod_records,
                                floating_metrics,
                                floating.agent_link(),
                            );
                            (floating, pods)
                        });
                        sync_until_reachable(service.desired()).await;
                        tokio::join!(
                            wire_report::run(
                                service.desired(),
                                client.clone(),
                                cluster,
                                &node,
                                &pin_root,
                            ),
                            mac_conflict::run(
                                service.desired(),
                                client,
                                &node,
                                &pin_root,
                                conflict_records,
                                mac_conflicts,
                            ),
                        );
                    },
                )
                .await;
            // The last word before exiting: why, or that it stops.
            if let Err(error) = &served
                && !readiness.has_failed()
            {
                readiness.failed(REASON_START_FAILED, format!("{error:#}"));
            }
            heartbeat
                .publish_last(&readiness.current(), LAST_HEARTBEAT_WAIT)
                .await;
            served
        }
    }

    /// The run-time settings as the environment (flags) gives them, the
    /// original's variables read as it read them: an unusable value is
    /// replaced by the default and logged.
    fn env_settings(&self) -> EnvSettings {
        let arp_policy = env::cni_arp_policy(&self.arp_policy);
        let proxy_arp = env::cni_proxy_arp(&self.proxy_arp);
        for warning in [&arp_policy.warning, &proxy_arp.warning]
            .into_iter()
            .flatten()
        {
            tracing::warn!("{warning}");
        }
        EnvSettings {
            probe_wait: Duration::from_millis(self.conflict_probe_ms),
            policy_enforcement: self.policy_enforcement,
            arp_policy: arp_policy.value,
            proxy_arp: proxy_arp.value,
        }
    }

    /// The floating addresses' settings, `None` when turned off.
    fn floating_config(
        &self,
        node_name: &str,
        namespace: &str,
    ) -> Option<floating::kubernetes::Config> {
        if !self.floating_ip {
            tracing::info!("floating addresses turned off (FLATNET_FLOATING_IP=false)");
            return None;
        }
        let mut settings = floating::owner::Settings::new(node_name, self.pin_root.clone());
        // Every address, both families: the peers are the nodes' InternalIPs.
        settings.bind = SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, self.floating_ip_port));
        // Beside the CNI socket (`/run/flatnet`), for `inspect floating`.
        settings.status_file = Some(
            self.socket
                .parent()
                .unwrap_or(std::path::Path::new("/run/flatnet"))
                .join("floating.json"),
        );
        Some(floating::kubernetes::Config {
            settings,
            classless: self.floating_ip_classless,
            host_netns: self.host_netns.clone(),
            // The address Leases live beside the node heartbeats.
            lease_namespace: Some(namespace.to_owned()),
        })
    }

    fn install_cni(&self) -> anyhow::Result<()> {
        if !self.skip_cni_install {
            let source = self
                .cni_binary
                .clone()
                .or_else(install::default_cni_binary)
                .context("cannot locate flatnet-cni; pass --cni-binary")?;
            for installed in install::install_binary(&source, &self.cni_bin_dir)? {
                tracing::info!(path = %installed.display(), "CNI plugin installed");
            }
        }
        if let Some(dir) = &self.cni_conf_dir {
            let path = install::install_conflist(
                dir,
                &self.cni_conf_file,
                &self.cni_network_name,
                &self.socket,
            )?;
            tracing::info!(path = %path.display(), "CNI network configuration written");
        }
        Ok(())
    }

    #[allow(
        clippy::too_many_arguments,
        reason = "each is one part of the agent handed over once at start"
    )]
    async fn serve<S, F, Fut>(
        self,
        node_name: String,
        desired: S,
        records: Records,
        (policy_source, settings): (PolicySource, SettingsView),
        metrics: Arc<Metrics>,
        readiness: Readiness,
        after_start: F,
    ) -> anyhow::Result<()>
    where
        S: DesiredState,
        F: FnOnce(AgentService<S>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let mut datapath = Datapath::load(&DatapathConfig {
            pin_root: self.pin_root.clone(),
            tc_attach: self.attach.tc_attach,
        })
        .context("load the flatnet eBPF programs")
        .inspect_err(|error| readiness.failed(REASON_PROGRAMS_NOT_LOADED, format!("{error:#}")))?;
        tracing::info!(
            mechanism = %datapath.attach_mechanism(),
            "programs are attached through {}",
            datapath.attach_mechanism()
        );
        let monitor = datapath
            .conflict_monitor()
            .context("open the conflict monitor")?;
        if let Some(logs) = datapath
            .kernel_logs()
            .context("open the kernel log ring buffer")?
        {
            tokio::spawn(logs.forward());
        }
        let policy_maps = PolicyMaps::open(&self.pin_root).context("open the policy maps")?;
        let config = ServiceConfig {
            node_name: node_name.clone(),
            attachments: Attachments {
                host_netns: self.host_netns.clone(),
                lease_dir: self.lease_dir.clone(),
                announce: AnnounceSettings::default(),
                host_link: SharedNetlink::default(),
            },
            settings: settings.clone(),
            pod_sandboxes: (!self.cri_socket.as_os_str().is_empty())
                .then(|| flatnet_agent::cri::PodSandboxes::new(&self.cri_socket)),
            spec: self.spec_settings(),
        };
        let service = AgentService::new(
            config,
            desired,
            records.clone(),
            datapath,
            Arc::clone(&metrics),
        )
        .context("open the pinned table maps")?;
        service
            .recover()
            .await
            .map_err(|e| anyhow::anyhow!("recovering the attachments: {e}"))?;
        let sink = PinnedPolicy::new(policy_maps);
        // The CNI service signals new pods and waits for their tables.
        let (trigger, changes) = PolicyTrigger::new();
        service.set_policy_trigger(trigger.clone());
        tokio::spawn(policy_controller::follow_enforcement(
            settings.clone(),
            trigger.clone(),
        ));
        match policy_source {
            PolicySource::Standalone { path, text } => {
                let policies =
                    StandalonePolicies::open_from(&path, text, records, metrics.policy.clone())
                        .map_err(|e| anyhow::anyhow!("{e}"))?;
                let networks = policies.networks(&self.policy_networks);
                let controller = PolicyController::new(sink, networks, metrics.policy.clone())
                    .enforcing_as(settings);
                tokio::spawn(policy_controller::standalone::run(
                    Arc::new(policies),
                    controller,
                    trigger,
                    changes,
                ));
            }
            PolicySource::Kubernetes(client) => {
                let networks = NetworkNames::new(self.policy_networks.clone());
                let controller = PolicyController::new(sink, networks, metrics.policy.clone())
                    .enforcing_as(settings);
                let policy_metrics = metrics.policy.clone();
                tokio::spawn(async move {
                    policy_controller::kubernetes::run(
                        client,
                        &node_name,
                        controller,
                        policy_metrics,
                        (trigger, changes),
                    )
                    .await;
                });
            }
        }
        tokio::spawn({
            let service = service.clone();
            async move { service.watch_conflicts(monitor).await }
        });
        // Addresses allocated to pods on this node are probed before their
        // ADD comes (Kubernetes mode), so the ADD finds the verdict made.
        tokio::spawn({
            let service = service.clone();
            async move { service.probe_ahead().await }
        });
        // What changes at run time reaches running pods: extra interfaces
        // the desired state lists, a subnet's changed spec.mtu, primary MTUs,
        // the node's VLANs and bridges.
        tokio::spawn({
            let service = service.clone();
            async move {
                tokio::join!(
                    service.follow_hotplug(flatnet_agent::cni_service::HOTPLUG_FOLLOW_INTERVAL),
                    service.follow_subnet_mtus(flatnet_agent::cni_service::MTU_FOLLOW_INTERVAL),
                    service
                        .follow_primary_mtus(flatnet_agent::cni_service::HOTPLUG_FOLLOW_INTERVAL),
                    service.follow_node_links(flatnet_agent::cni_service::HOTPLUG_FOLLOW_INTERVAL),
                );
            }
        });
        tokio::spawn(after_start(service.clone()));
        tokio::spawn({
            let service = service.clone();
            async move { service.verify_programs().await }
        });
        if let Some(address) = self.admin_address {
            serve_admin(address, metrics, service.clone()).await?;
        }
        let check = {
            let service = service.clone();
            node_heartbeat::serving_check(self.socket.clone(), move || service.readiness())
        };
        let server = AgentServer::bind(
            ServerConfig {
                socket_path: self.socket.clone(),
                ..ServerConfig::default()
            },
            service,
        )?;
        readiness.serving(check);
        server
            .serve(async {
                shutdown_signal().await;
                readiness.stopping();
            })
            .await;
        tracing::info!("flatnet-agent stopped; pinned maps and uplink programs stay in place");
        Ok(())
    }
}

/// How long an exiting agent waits to write its last heartbeat.
const LAST_HEARTBEAT_WAIT: Duration = Duration::from_secs(5);

/// Retries the first API call with backoff; STATUS reports not ready
/// until it succeeds.
async fn sync_until_reachable(desired: &Kubernetes) {
    let mut delay = Duration::from_secs(1);
    loop {
        match desired.sync().await {
            Ok(()) => {
                tracing::info!("Kubernetes API reachable; ready to serve ADD");
                return;
            }
            Err(error) => {
                tracing::warn!(%error, retry_in = ?delay, "Kubernetes API not reachable yet");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        }
    }
}

/// Serves `/healthz` (the process answers), `/readyz` (ADD can be served:
/// the same test as CNI STATUS) and `/metrics` on `address` in the background.
async fn serve_admin<S: DesiredState>(
    address: SocketAddr,
    metrics: Arc<Metrics>,
    service: AgentService<S>,
) -> anyhow::Result<()> {
    use axum::{http::StatusCode, routing::get};
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .with_context(|| format!("listen for the admin endpoints on {address}"))?;
    let app = axum::Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let service = service.clone();
                async move {
                    match service.readiness() {
                        Ok(()) => (StatusCode::OK, "ready".to_owned()),
                        Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason),
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let metrics = Arc::clone(&metrics);
                async move { metrics.encode() }
            }),
        );
    tokio::spawn(async move {
        if let Err(error) = axum::serve(listener, app).await {
            tracing::error!(%error, "the admin server stopped");
        }
    });
    Ok(())
}

/// Completes on SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).expect("install the SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("install the SIGINT handler");
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received, shutting down"),
        _ = int.recv() => tracing::info!("SIGINT received, shutting down"),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};
    use flatnet_agent::link::ArpPolicy;

    fn run_args(args: &[&str]) -> RunArgs {
        let cli = Cli::try_parse_from(["flatnet-agent", "run"].iter().chain(args))
            .expect("the agent starts whatever these values are");
        match cli.command {
            Command::Run(args) => *args,
            other => panic!("parsed as {other:?}"),
        }
    }

    /// As the original: an unknown ARP policy or a non-boolean proxy ARP
    /// is the default (the warning is the shared reading's, tested there),
    /// never a refusal to start.
    #[test]
    fn unusable_arp_settings_fall_back_to_the_defaults() {
        let env = run_args(&["--arp-policy", "garp", "--proxy-arp", "yes"]).env_settings();
        assert_eq!(env.arp_policy, ArpPolicy::ArpNotify);
        assert!(!env.proxy_arp);
        let env = run_args(&["--arp-policy", "arping", "--proxy-arp", "1"]).env_settings();
        assert_eq!(env.arp_policy, ArpPolicy::Arping);
        assert!(env.proxy_arp);
        let env = run_args(&[]).env_settings();
        assert_eq!(env.arp_policy, ArpPolicy::ArpNotify);
        assert!(!env.proxy_arp);
    }
}
