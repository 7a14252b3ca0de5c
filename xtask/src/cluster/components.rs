//! The cluster's processes: their command lines and configuration files,
//! starting them (detached, logging into `target/cluster/logs`), watching
//! them while `up` waits, and the order `up` follows.

use std::{
    fs,
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, bail};
use serde_json::json;

use super::{
    API_PORT, CLUSTER_CIDR, CONTAINERD_SOCKET, NODE_IP, NODE_NAME, Options, SERVICE_CIDR,
    api::Client, audit_log, binaries, images, log_dir, network, pki, server_url, state_dir,
    teardown, timed, wait_for,
};
pub use crate::lab::process::{check_interrupt, interrupted};

/// etcd's ports on loopback: not the default 2379/2380, so an etcd that
/// Debian's package started is never mistaken for the cluster's.
const ETCD_CLIENT: &str = "http://127.0.0.1:12379";
const ETCD_PEER: &str = "http://127.0.0.1:12380";

/// The API server's audit policy (under the state directory).
const AUDIT_POLICY: &str = "audit-policy.yaml";
/// Metadata of every request by a ServiceAccount outside kube-system: what
/// a workload's RBAC is checked against (`cargo xtask e2e`). The first rule
/// that matches decides.
const AUDIT_POLICY_TEXT: &str = "\
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    userGroups: [\"system:serviceaccounts:kube-system\"]
  - level: Metadata
    userGroups: [\"system:serviceaccounts\"]
  - level: None
";

/// A process of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    Etcd,
    Containerd,
    ApiServer,
    ControllerManager,
    Scheduler,
    Kubelet,
}

impl Component {
    /// In the order `down` stops them: the node first, etcd last.
    pub const ALL: [Component; 6] = [
        Component::Kubelet,
        Component::Containerd,
        Component::Scheduler,
        Component::ControllerManager,
        Component::ApiServer,
        Component::Etcd,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Component::Etcd => "etcd",
            Component::Containerd => "containerd",
            Component::ApiServer => "kube-apiserver",
            Component::ControllerManager => "kube-controller-manager",
            Component::Scheduler => "kube-scheduler",
            Component::Kubelet => "kubelet",
        }
    }

    pub fn log(self) -> PathBuf {
        log_dir().join(format!("{}.log", self.name()))
    }

    pub fn pid_file(self) -> PathBuf {
        state_dir().join("run").join(format!("{}.pid", self.name()))
    }

    fn command(self, state: &Path) -> Command {
        let bin = state.join("bin");
        let pki = state.join("pki");
        let p = |name: &str| pki.join(name).display().to_string();
        let s = |name: &str| state.join(name).display().to_string();
        let mut command;
        match self {
            Component::Etcd => {
                command = Command::new("etcd");
                command.args([
                    "--name=flatnet",
                    &format!("--data-dir={}", s("etcd")),
                    &format!("--listen-client-urls={ETCD_CLIENT}"),
                    &format!("--advertise-client-urls={ETCD_CLIENT}"),
                    &format!("--listen-peer-urls={ETCD_PEER}"),
                    &format!("--initial-advertise-peer-urls={ETCD_PEER}"),
                    &format!("--initial-cluster=flatnet={ETCD_PEER}"),
                ]);
            }
            Component::Containerd => {
                command = Command::new("containerd");
                command.arg("--config").arg(s("containerd.toml"));
            }
            Component::ApiServer => {
                command = Command::new(bin.join("kube-apiserver"));
                command.args([
                    format!("--etcd-servers={ETCD_CLIENT}"),
                    format!("--bind-address={NODE_IP}"),
                    format!("--advertise-address={NODE_IP}"),
                    format!("--secure-port={API_PORT}"),
                    format!("--tls-cert-file={}", p("apiserver.crt")),
                    format!("--tls-private-key-file={}", p("apiserver.key")),
                    format!("--client-ca-file={}", p("ca.crt")),
                    "--authorization-mode=Node,RBAC".into(),
                    "--enable-admission-plugins=NodeRestriction".into(),
                    "--allow-privileged=true".into(),
                    format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                    "--service-account-issuer=https://kubernetes.default.svc.cluster.local".into(),
                    format!("--service-account-key-file={}", p("sa.pub")),
                    format!("--service-account-signing-key-file={}", p("sa.key")),
                    // Webhooks and aggregated APIs are called on their
                    // endpoints' pod addresses: there is no kube-proxy.
                    "--enable-aggregator-routing=true".into(),
                    format!(
                        "--kubelet-client-certificate={}",
                        p("apiserver-kubelet-client.crt")
                    ),
                    format!("--kubelet-client-key={}", p("apiserver-kubelet-client.key")),
                    format!("--kubelet-certificate-authority={}", p("ca.crt")),
                    "--kubelet-preferred-address-types=InternalIP,Hostname".into(),
                    "--profiling=false".into(),
                    format!("--audit-policy-file={}", s(AUDIT_POLICY)),
                    format!("--audit-log-path={}", audit_log().display()),
                    "--audit-log-format=json".into(),
                ]);
            }
            Component::ControllerManager => {
                command = Command::new(bin.join("kube-controller-manager"));
                command.args(control_plane_client_args(&s(
                    "controller-manager.kubeconfig",
                )));
                command.args([
                    "--controllers=*,bootstrapsigner,tokencleaner".to_owned(),
                    "--use-service-account-credentials=true".into(),
                    format!("--root-ca-file={}", p("ca.crt")),
                    format!("--service-account-private-key-file={}", p("sa.key")),
                    format!("--cluster-signing-cert-file={}", p("ca.crt")),
                    format!("--cluster-signing-key-file={}", p("ca.key")),
                    "--allocate-node-cidrs=true".into(),
                    format!("--cluster-cidr={CLUSTER_CIDR}"),
                    "--node-cidr-mask-size=24".into(),
                    format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                ]);
            }
            Component::Scheduler => {
                command = Command::new(bin.join("kube-scheduler"));
                command.args(control_plane_client_args(&s("scheduler.kubeconfig")));
            }
            Component::Kubelet => {
                command = Command::new(bin.join("kubelet"));
                command.args([
                    format!("--config={}", s("kubelet.yaml")),
                    format!("--kubeconfig={}", s("kubelet.kubeconfig")),
                    format!("--hostname-override={NODE_NAME}"),
                    format!("--node-ip={NODE_IP}"),
                    // Keeps the kubelet's image GC off the sandbox image.
                    format!("--pod-infra-container-image={}", images::PAUSE_IMAGE),
                ]);
            }
        }
        command
    }
}

/// containerd's configuration: cgroupfs, no OOM score below its own (root
/// without CAP_SYS_RESOURCE), the offline pause image, the node's CNI dirs.
fn containerd_config() -> String {
    format!(
        r#"version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
# /opt/containerd would outlive the cluster.
disabled_plugins = ["io.containerd.internal.v1.opt"]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
"#,
        pause = images::PAUSE_IMAGE,
        bin = network::CNI_BIN_DIR,
        conf = network::CNI_CONF_DIR,
    )
}

/// The kubelet's configuration: cgroupfs, swap allowed, evictions only on
/// an almost full disk, x509 and webhook authentication, its serving cert.
fn kubelet_config(pki: &Path) -> anyhow::Result<String> {
    let p = |name: &str| pki.join(name).display().to_string();
    let config = json!({
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "failSwapOn": false,
        "address": NODE_IP,
        "healthzBindAddress": "127.0.0.1",
        "containerRuntimeEndpoint": format!("unix://{CONTAINERD_SOCKET}"),
        "authentication": {
            "anonymous": {"enabled": false},
            "webhook": {"enabled": true},
            "x509": {"clientCAFile": p("ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": p("kubelet-serving.crt"),
        "tlsPrivateKeyFile": p("kubelet-serving.key"),
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "clusterDomain": "cluster.local",
        "resolvConf": "/etc/resolv.conf",
        "serializeImagePulls": false,
        // No KUBE-FIREWALL chains: nothing of the kubelet stays in iptables.
        "makeIPTablesUtilChains": false,
    });
    Ok(serde_yaml::to_string(&config)?)
}

/// The processes `up` started, watched while it waits.
#[derive(Default)]
struct Started {
    children: Vec<(Component, Child)>,
}

impl Started {
    fn spawn(&mut self, component: Component, state: &Path) -> anyhow::Result<()> {
        let log = component.log();
        let out = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("open {}", log.display()))?;
        let mut command = component.command(state);
        command
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            // Its own process group: a Ctrl-C in the terminal reaches
            // `up` (which tears down), never the cluster directly.
            .process_group(0);
        let child = command.spawn().with_context(|| {
            format!(
                "cannot start {} (`bash .ci/provision` installs etcd-server and containerd)",
                component.name()
            )
        })?;
        let pid_file = component.pid_file();
        fs::create_dir_all(pid_file.parent().context("a pid file has a directory")?)?;
        fs::write(&pid_file, child.id().to_string())?;
        self.children.push((component, child));
        Ok(())
    }

    /// Fails, with the tail of its log, when a started process exited.
    fn check_alive(&mut self) -> anyhow::Result<()> {
        for (component, child) in &mut self.children {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "{} exited ({status}); the end of {}:\n{}",
                    component.name(),
                    component.log().display(),
                    tail(&component.log(), 40)
                );
            }
        }
        Ok(())
    }

    /// `wait_for`, failing early when a component dies.
    fn wait<T>(
        &mut self,
        what: &str,
        limit: Duration,
        mut check: impl FnMut() -> anyhow::Result<Option<T>>,
        blame: Component,
    ) -> anyhow::Result<T> {
        wait_for(what, limit, || {
            self.check_alive()?;
            check()
        })
        .map_err(|e| {
            if interrupted() {
                return e;
            }
            e.context(format!(
                "the end of {}:\n{}",
                blame.log().display(),
                tail(&blame.log(), 40)
            ))
        })
    }
}

/// The last `lines` lines of a log.
pub fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// SIGINT/SIGTERM during `up`: the current step stops, `up` tears down.
pub fn install_handler() -> anyhow::Result<()> {
    crate::lab::process::install_handler(teardown::remove_everything)
}

/// Everything `up` does, in order.
pub fn start(options: &Options) -> anyhow::Result<()> {
    let state = state_dir();
    let pki_dir = state.join("pki");
    timed("host tools are present", network::check_host_tools)?;
    timed("leftovers of an earlier run are removed", || {
        teardown::remove_everything();
        let left = teardown::leftovers();
        if !left.is_empty() {
            bail!("could not remove:\n  {}", left.join("\n  "));
        }
        let foreign = teardown::foreign_containerd();
        if !foreign.is_empty() {
            bail!(
                "a containerd the cluster did not start runs (pids {foreign:?}) and would hold \
                 {CONTAINERD_SOCKET}: stop it (`systemctl disable --now containerd` or \
                 `service containerd stop`)"
            );
        }
        Ok(())
    })?;
    // The logs of the last run stay until this one starts.
    let _ = fs::remove_dir_all(log_dir());
    for dir in ["logs", "run"] {
        fs::create_dir_all(state.join(dir))?;
    }
    let kube_dir = timed("Kubernetes binaries in target/cluster/bin", || {
        binaries::install(options.kube_dir.as_deref(), &state.join("bin"))
    })?;
    timed("certificates and kubeconfigs", || {
        pki::write_all(&pki_dir)?;
        let server = server_url();
        for (file, user, stem) in [
            ("kubeconfig", "admin", pki::ADMIN),
            (
                "controller-manager.kubeconfig",
                "system:kube-controller-manager",
                pki::CONTROLLER_MANAGER,
            ),
            (
                "scheduler.kubeconfig",
                "system:kube-scheduler",
                pki::SCHEDULER,
            ),
            ("kubelet.kubeconfig", "kubelet", pki::KUBELET),
        ] {
            let text = pki::kubeconfig(
                &pki_dir,
                &server,
                user,
                &pki::Credentials::Certificate(stem),
            )?;
            fs::write(state.join(file), text)?;
        }
        fs::write(state.join("containerd.toml"), containerd_config())?;
        fs::write(state.join("kubelet.yaml"), kubelet_config(&pki_dir)?)?;
        fs::write(state.join(AUDIT_POLICY), AUDIT_POLICY_TEXT)?;
        Ok(())
    })?;
    timed(
        "node network: shared mounts, cni0, the kubernetes Service, the flat LAN, CNI plugins",
        || network::build(&state.join("bin")),
    )?;
    let mut started = Started::default();
    timed("etcd, containerd and the API server start", || {
        for component in [Component::Etcd, Component::Containerd, Component::ApiServer] {
            started.spawn(component, &state)?;
        }
        Ok(())
    })?;
    timed("images imported into containerd", || {
        started.wait(
            "containerd's socket",
            Duration::from_secs(30),
            || Ok(Path::new(CONTAINERD_SOCKET).exists().then_some(())),
            Component::Containerd,
        )?;
        images::build_and_import(&state.join("images"))
    })?;
    let client = Client::admin(&state)?;
    timed("API server ready (/readyz)", || {
        started.wait(
            "/readyz",
            Duration::from_secs(90),
            || Ok(client.get_text("/readyz").ok().map(drop)),
            Component::ApiServer,
        )
    })?;
    timed("controller manager and scheduler start", || {
        started.spawn(Component::ControllerManager, &state)?;
        started.spawn(Component::Scheduler, &state)
    })?;
    timed(
        "Multus: its ServiceAccount and token, the NetworkAttachmentDefinition CRD, 00-multus.conflist",
        || network::install_multus(&client, &kube_dir, &pki_dir),
    )?;
    timed("kubelet: node Ready", || {
        started.spawn(Component::Kubelet, &state)?;
        started.wait(
            "node Ready",
            Duration::from_secs(90),
            || Ok(client.node_ready(NODE_NAME)?.then_some(())),
            Component::Kubelet,
        )
    })?;
    timed("the default ServiceAccount exists", || {
        started.wait(
            "ServiceAccount default/default",
            Duration::from_secs(60),
            || {
                Ok(client
                    .get("/api/v1/namespaces/default/serviceaccounts/default")?
                    .map(drop))
            },
            Component::ControllerManager,
        )
    })?;
    Ok(())
}

/// Each component with the pid it runs as, if it runs.
pub fn running() -> Vec<(&'static str, Option<i32>)> {
    let ours = teardown::cluster_processes();
    Component::ALL
        .iter()
        .map(|component| {
            let pid = fs::read_to_string(component.pid_file())
                .ok()
                .and_then(|text| text.trim().parse::<i32>().ok())
                .filter(|pid| ours.contains(pid));
            (component.name(), pid)
        })
        .collect()
}

/// What the controller manager and the scheduler share: one kubeconfig for
/// the API and for checking their callers, loopback only, no election (one
/// replica), no profiling endpoint.
fn control_plane_client_args(kubeconfig: &str) -> [String; 6] {
    [
        format!("--kubeconfig={kubeconfig}"),
        format!("--authentication-kubeconfig={kubeconfig}"),
        format!("--authorization-kubeconfig={kubeconfig}"),
        "--bind-address=127.0.0.1".into(),
        "--leader-elect=false".into(),
        "--profiling=false".into(),
    ]
}
