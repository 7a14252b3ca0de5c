//! `cargo xtask cluster up|down|status`: a real single-node Kubernetes
//! (v1.28.15, Multus thin) on this machine, for the end-to-end tier.
//!
//! `up` starts etcd, the API server, controller manager, scheduler,
//! containerd and a kubelet as processes of this machine (root), with
//! their state in `target/cluster/`, the node network on the bridge
//! [`NODE_BRIDGE`], Multus thin as the node's first CNI configuration and
//! a flat LAN ([`LAN_BRIDGE`] and the namespaces of [`LAN_HOSTS`]) whose
//! bridge is the master of flat networks. `down` removes all of it, also
//! after a killed `up` or a killed test run.
//!
//! Other xtask code calls [`up`] and [`down`]; every name and address the
//! end-to-end tier needs is a constant of this module.

mod api;
mod binaries;
mod components;
mod images;
mod network;
mod pki;
mod teardown;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::{Args, Subcommand};

pub use self::{
    api::Client,
    binaries::{KUBE_DIR_VAR, binaries_found, kube_dir},
    images::{PAUSE_IMAGE, TEST_IMAGE, import as import_image},
};
use crate::workspace;

/// The node's name (the kubelet's `--hostname-override`).
pub const NODE_NAME: &str = "flatnet-node";
/// The node's address: on [`NODE_BRIDGE`], the kubelet's `--node-ip`, the
/// pods' gateway and where the API server listens.
pub const NODE_IP: &str = "10.42.0.1";
/// The bridge of the cluster network, holding [`NODE_IP`].
pub const NODE_BRIDGE: &str = "cni0";
/// The pods' network on this node (the cluster network's `host-local` range).
pub const POD_SUBNET: &str = "10.42.0.0/24";
/// The controller manager's `--cluster-cidr` (nodes get a /24 each).
pub const CLUSTER_CIDR: &str = "10.42.0.0/16";
/// The Services' range and the `kubernetes` Service's address in it.
pub const SERVICE_CIDR: &str = "10.43.0.0/16";
pub const KUBERNETES_SERVICE_IP: &str = "10.43.0.1";
/// The API server's port on [`NODE_IP`].
pub const API_PORT: u16 = 6443;
/// The name of the cluster network in its CNI configuration.
pub const CLUSTER_NETWORK: &str = "flatnet-cluster";
/// containerd's socket: the default path, which flatnet's chart points at.
pub const CONTAINERD_SOCKET: &str = "/run/containerd/containerd.sock";

/// The flat LAN's switch: a Linux bridge without an address, the master
/// of the flat networks' macvlan interfaces.
pub const LAN_BRIDGE: &str = "flatlan0";
/// The flat LAN's subnets and prefix lengths.
pub const LAN_SUBNET_V4: &str = "192.168.150.0/24";
pub const LAN_SUBNET_V6: &str = "fd00:150::/64";
/// The LAN's gateway address (held by the first LAN host).
pub const LAN_GATEWAY_V4: &str = "192.168.150.1";
pub const LAN_GATEWAY_V6: &str = "fd00:150::1";

/// A host of the flat LAN: a network namespace cabled to [`LAN_BRIDGE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LanHost {
    /// Its network namespace (`ip netns exec <netns> ...`).
    pub netns: &'static str,
    /// The interface inside the namespace.
    pub ifname: &'static str,
    /// The other end of the cable, a port of [`LAN_BRIDGE`].
    pub port: &'static str,
    pub ipv4: &'static str,
    pub ipv6: &'static str,
}

/// The LAN's hosts. Pods on the flat networks get other addresses of the
/// LAN subnets: 192.168.150.1-9 and fd00:150::1-9 are kept for hosts.
pub const LAN_HOSTS: &[LanHost] = &[LanHost {
    netns: "flatlan-host",
    ifname: "eth0",
    port: "flatlan-host0",
    ipv4: LAN_GATEWAY_V4,
    ipv6: LAN_GATEWAY_V6,
}];

/// Where the cluster's state lives, below the workspace.
pub const STATE_DIR: &str = "target/cluster";

/// `target/cluster` of this workspace.
pub fn state_dir() -> PathBuf {
    workspace::root().join(STATE_DIR)
}

/// `target/cluster/kubeconfig`: the admin's kubeconfig (`O=system:masters`).
pub fn kubeconfig_path() -> PathBuf {
    state_dir().join("kubeconfig")
}

/// The API server's audit log: every request a workload's ServiceAccount
/// made (the control plane's own, in kube-system, left out), one JSON event
/// per line, written before the answer (the log backend blocks).
pub fn audit_log() -> PathBuf {
    log_dir().join("audit.log")
}

/// `target/cluster/logs`: one log per component.
pub fn log_dir() -> PathBuf {
    state_dir().join("logs")
}

/// Options of [`up`].
#[derive(Args, Debug, Clone, Default)]
pub struct Options {
    /// Directory of the xz-compressed Kubernetes binaries (default: the
    /// `FLATNET_KUBE_DIR` variable, else `<workspace>/../shared/kube`).
    #[arg(long)]
    pub kube_dir: Option<PathBuf>,
}

/// A running cluster: what a test needs to use it.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// The admin kubeconfig.
    pub kubeconfig: PathBuf,
    pub node_name: &'static str,
    pub node_ip: &'static str,
    /// `https://10.42.0.1:6443`.
    pub server: String,
    pub lan_bridge: &'static str,
    pub lan_hosts: &'static [LanHost],
    /// The component logs.
    pub logs: PathBuf,
}

impl Cluster {
    fn describe() -> Self {
        Self {
            kubeconfig: kubeconfig_path(),
            node_name: NODE_NAME,
            node_ip: NODE_IP,
            server: server_url(),
            lan_bridge: LAN_BRIDGE,
            lan_hosts: LAN_HOSTS,
            logs: log_dir(),
        }
    }

    /// An API client with the admin's credentials (in the kubeconfig's directory).
    pub fn client(&self) -> anyhow::Result<Client> {
        Client::admin(
            self.kubeconfig
                .parent()
                .context("a kubeconfig has a directory")?,
        )
    }
}

/// `https://<node IP>:<port>`.
pub fn server_url() -> String {
    format!("https://{NODE_IP}:{API_PORT}")
}

/// `cargo xtask cluster ...`.
#[derive(Subcommand, Debug)]
pub enum ClusterCommand {
    /// Start the single-node cluster (removes leftovers of an earlier run first).
    Up(Options),
    /// Stop it and remove everything it made on this machine.
    Down,
    /// Which components run, and whether the API server and the node are ready.
    Status,
    /// Create or update the objects of a YAML file (server-side apply).
    Apply {
        /// The file (`-` for stdin); several documents separated by `---`.
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
    },
    /// One API request with the admin's credentials; prints the answer.
    Api {
        /// GET, DELETE, POST, PUT or PATCH (merge patch).
        method: String,
        /// `/api/v1/namespaces/default/pods`.
        path: String,
        /// JSON or YAML body, from this file.
        #[arg(short = 'f', long = "filename")]
        file: Option<PathBuf>,
    },
}

/// Runs `cargo xtask cluster ...`.
pub fn run(command: ClusterCommand) -> anyhow::Result<()> {
    match command {
        ClusterCommand::Up(options) => {
            let cluster = up(&options)?;
            println!(
                "\nThe cluster is up: node {} at {}, API {}\n  \
                 export KUBECONFIG={}\n  \
                 images: {TEST_IMAGE} (test), {PAUSE_IMAGE} (sandbox)\n  \
                 flat LAN: bridge {} ({LAN_SUBNET_V4}, {LAN_SUBNET_V6}), hosts {}\n  \
                 component logs: {}\n  \
                 stop it: cargo xtask cluster down",
                cluster.node_name,
                cluster.node_ip,
                cluster.server,
                cluster.kubeconfig.display(),
                cluster.lan_bridge,
                cluster
                    .lan_hosts
                    .iter()
                    .map(|h| format!("{} ({}, {})", h.netns, h.ipv4, h.ipv6))
                    .collect::<Vec<_>>()
                    .join(", "),
                cluster.logs.display()
            );
            Ok(())
        }
        ClusterCommand::Down => down(),
        ClusterCommand::Status => status(),
        ClusterCommand::Apply { file } => {
            let text = read_input(&file)?;
            let client = Cluster::describe().client()?;
            for line in client.apply_yaml(&text)? {
                println!("{line}");
            }
            Ok(())
        }
        ClusterCommand::Api { method, path, file } => {
            let body = file.as_deref().map(read_input).transpose()?;
            let client = Cluster::describe().client()?;
            let answer = client.call(&method, &path, body.as_deref())?;
            println!("{answer}");
            Ok(())
        }
    }
}

fn read_input(file: &Path) -> anyhow::Result<String> {
    if file == Path::new("-") {
        return std::io::read_to_string(std::io::stdin()).context("read stdin");
    }
    std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))
}

fn require_root(what: &str) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("`cargo xtask cluster {what}` starts and removes system services: run it as root");
    }
    Ok(())
}

/// Prints `what` with how long it took, and passes its result on.
fn timed<T>(what: &str, work: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    components::check_interrupt()?;
    println!("==> cluster: {what}");
    let started = Instant::now();
    let result = work();
    println!(
        "<== cluster: {what}: {} in {:.1}s",
        if result.is_ok() { "ok" } else { "FAILED" },
        started.elapsed().as_secs_f64()
    );
    result
}

/// Starts the cluster and waits until a pod can be created on its node.
/// Leftovers of an earlier (or killed) run are removed first; on failure
/// or SIGINT/SIGTERM, everything started is removed again.
pub fn up(options: &Options) -> anyhow::Result<Cluster> {
    require_root("up")?;
    components::install_handler()?;
    let started = Instant::now();
    let result = components::start(options);
    match result {
        Ok(()) => {
            println!("<== cluster: up in {:.1}s", started.elapsed().as_secs_f64());
            Ok(Cluster::describe())
        }
        Err(error) => {
            eprintln!("cluster: up failed: {error:#}\ncluster: removing what was started");
            teardown::remove_everything();
            if components::interrupted() {
                std::process::exit(130);
            }
            Err(error)
        }
    }
}

/// Stops the cluster and removes everything it made; succeeds when
/// nothing is there. Fails when something could not be removed, naming it.
pub fn down() -> anyhow::Result<()> {
    require_root("down")?;
    let started = Instant::now();
    teardown::remove_everything();
    let left = teardown::leftovers();
    if !left.is_empty() {
        bail!("cluster: down left:\n  {}", left.join("\n  "));
    }
    println!(
        "<== cluster: down in {:.1}s, nothing left",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Prints which components run and whether the cluster answers.
pub fn status() -> anyhow::Result<()> {
    match binaries_found() {
        Some(dir) => println!("Kubernetes binaries: {}", dir.display()),
        None => println!("Kubernetes binaries: not found (set {KUBE_DIR_VAR})"),
    }
    let running = components::running();
    for (component, pid) in &running {
        match pid {
            Some(pid) => println!("{component}: running (pid {pid})"),
            None => println!("{component}: not running"),
        }
    }
    if running.iter().all(|(_, pid)| pid.is_none()) {
        println!("the cluster is down");
        return Ok(());
    }
    let client = Client::admin(&state_dir())?;
    match client.get_text("/readyz") {
        Ok(text) => println!("API server /readyz: {text}"),
        Err(e) => println!("API server: {e:#}"),
    }
    match client.node_ready(NODE_NAME) {
        Ok(ready) => println!(
            "node {NODE_NAME}: {}",
            if ready { "Ready" } else { "not Ready" }
        ),
        Err(e) => println!("node {NODE_NAME}: {e:#}"),
    }
    println!("KUBECONFIG={}", kubeconfig_path().display());
    Ok(())
}

/// Polls `check` every 200 ms until it gives `Some`, failing after
/// `limit` with `what` and the last error.
fn wait_for<T>(
    what: &str,
    limit: Duration,
    mut check: impl FnMut() -> anyhow::Result<Option<T>>,
) -> anyhow::Result<T> {
    let deadline = Instant::now() + limit;
    let mut last = None;
    loop {
        components::check_interrupt()?;
        match check() {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(e) => last = Some(e),
        }
        if Instant::now() > deadline {
            let why = last.map(|e| format!(": {e:#}")).unwrap_or_default();
            bail!("{what} not within {}s{why}", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
