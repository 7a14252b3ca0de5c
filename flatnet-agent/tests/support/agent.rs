//! A real `flatnet-agent run` process (`--standalone`, or in Kubernetes
//! mode against an API server named by a kubeconfig) with its files under
//! one directory and a private pin root; killed on drop, its log printed
//! when the test fails.

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use crate::support::{TestNetns, TestPinRoot};

/// A standalone agent working on a node namespace. Its files (state file,
/// state, record and lease directories, socket, log) live under `dir`.
pub struct StandaloneAgent {
    dir: PathBuf,
    pub pin: TestPinRoot,
    host_netns: PathBuf,
    /// Arguments after the common ones, e.g. the CNI directories.
    args: Vec<String>,
    /// Kubernetes mode: the kubeconfig and the node's name.
    kubernetes: Option<(PathBuf, String)>,
    /// Run in a mount namespace without `/var/run`, as in the agent's image.
    without_var_run: bool,
    /// Run in a mount namespace whose `/proc/sys` is read-only, as in the
    /// chart's (unprivileged) container.
    read_only_proc_sys: bool,
    process: Option<Child>,
}

impl StandaloneAgent {
    /// An agent (not started yet) with its files under `dir`, working on
    /// `node`, started with `args` besides the common ones.
    pub fn new(dir: &Path, node: &TestNetns, args: &[&str]) -> Self {
        Self {
            dir: dir.to_path_buf(),
            pin: TestPinRoot::new(),
            host_netns: node.path(),
            args: args.iter().map(|a| (*a).to_owned()).collect(),
            kubernetes: None,
            without_var_run: false,
            read_only_proc_sys: false,
            process: None,
        }
    }

    /// The agent runs in a mount namespace of its own whose `/var` is empty,
    /// as in its image (no `/var/run`, the host's `/run/netns` mounted).
    #[allow(dead_code, reason = "not every test binary needs the image's mounts")]
    pub fn without_var_run(&mut self) {
        self.without_var_run = true;
    }

    /// The agent runs in a mount namespace of its own whose `/proc/sys` is
    /// read-only, as in the chart's container.
    #[allow(
        dead_code,
        reason = "not every test binary needs the container's mounts"
    )]
    pub fn with_read_only_proc_sys(&mut self) {
        self.read_only_proc_sys = true;
    }

    /// The same agent in Kubernetes mode: the API server `kubeconfig`
    /// names, node `node_name`.
    #[allow(dead_code, reason = "not every test binary runs Kubernetes mode")]
    #[must_use]
    pub fn in_kubernetes(mut self, kubeconfig: &Path, node_name: &str) -> Self {
        self.kubernetes = Some((kubeconfig.to_path_buf(), node_name.to_owned()));
        self
    }

    /// The running agent's process id.
    #[allow(dead_code, reason = "not every test binary looks into the process")]
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(Child::id)
    }

    /// `path` under the agent's directory.
    pub fn path(&self, path: &str) -> PathBuf {
        self.dir.join(path)
    }

    /// The desired-state file the agent reads (and watches).
    pub fn state_file(&self) -> PathBuf {
        self.path("state.yaml")
    }

    /// Writes the desired-state file.
    pub fn write_state(&self, yaml: &str) {
        std::fs::write(self.state_file(), yaml).unwrap();
    }

    /// The socket flatnet-cni talks to.
    pub fn socket(&self) -> PathBuf {
        self.path("run/agent.sock")
    }

    /// The agent's log (stderr of every run, appended).
    pub fn log_file(&self) -> PathBuf {
        self.path("agent.log")
    }

    /// Starts the agent, with `env` set for it, and waits until `serving`
    /// says it answers.
    pub fn start(&mut self, env: Option<(&str, &str)>, serving: impl Fn(&Self) -> bool) {
        let arg = |p: &str| self.path(p).display().to_string();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_file())
            .unwrap();
        let mut command = Command::new(package_binary(option_env!("CARGO_BIN_EXE_flatnet-agent")));
        command.args(["--log-level", "debug", "run"]);
        match &self.kubernetes {
            None => {
                command
                    .arg("--standalone")
                    .arg("--state-file")
                    .arg(self.state_file())
                    .args(["--state-dir", &arg("state")]);
            }
            Some((kubeconfig, node_name)) => {
                command
                    .env("KUBECONFIG", kubeconfig)
                    .env("NODE_NAME", node_name);
            }
        }
        if self.without_var_run || self.read_only_proc_sys {
            use std::os::unix::process::CommandExt as _;

            use nix::{
                mount::{MsFlags, mount},
                sched::{CloneFlags, unshare},
            };
            let (empty_var, read_only_sys) = (self.without_var_run, self.read_only_proc_sys);
            // SAFETY: between fork and exec the closure makes only the
            // unshare(2) and mount(2) system calls, which are async-signal-safe.
            unsafe {
                command.pre_exec(move || {
                    unshare(CloneFlags::CLONE_NEWNS)?;
                    // Slave, as the chart's HostToContainer volumes: the
                    // runtime's later namespace mounts reach the agent, and
                    // the empty /var stays in its namespace.
                    mount(
                        None::<&str>,
                        "/",
                        None::<&str>,
                        MsFlags::MS_REC | MsFlags::MS_SLAVE,
                        None::<&str>,
                    )?;
                    if empty_var {
                        mount(
                            Some("tmpfs"),
                            "/var",
                            Some("tmpfs"),
                            MsFlags::empty(),
                            None::<&str>,
                        )?;
                    }
                    if read_only_sys {
                        mount(
                            Some("/proc/sys"),
                            "/proc/sys",
                            None::<&str>,
                            MsFlags::MS_BIND | MsFlags::MS_REC,
                            None::<&str>,
                        )?;
                        mount(
                            None::<&str>,
                            "/proc/sys",
                            None::<&str>,
                            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
                            None::<&str>,
                        )?;
                    }
                    Ok(())
                });
            }
        }
        let child = command
            .args(["--record-dir", &arg("records")])
            .args(["--lease-dir", &arg("leases")])
            .arg("--socket")
            .arg(self.socket())
            .args([
                "--cni-binary",
                package_binary(option_env!("CARGO_BIN_EXE_flatnet-cni")),
            ])
            .args(["--pin-root", &self.pin.path.display().to_string()])
            .args(["--host-netns", &self.host_netns.display().to_string()])
            .args(&self.args)
            .envs(env)
            .stdin(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start flatnet-agent");
        self.process = Some(child);
        // Not a timing assertion: a bound on waiting for start-up, generous
        // because loading the programs under software emulation (the VM
        // stage) takes far longer than on hardware.
        let deadline = Instant::now() + Duration::from_secs(300);
        while !serving(self) {
            if let Some(status) = self.process_mut().try_wait().unwrap() {
                // What it did just before exiting may be what was awaited.
                if serving(self) {
                    break;
                }
                panic!("flatnet-agent exited during start-up: {status}");
            }
            assert!(Instant::now() < deadline, "flatnet-agent did not start");
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Starts the agent (with `crash_at`, to abort at that test crash
    /// point) and waits until it answers CNI STATUS for `network`.
    #[allow(dead_code, reason = "not every test binary uses crash points")]
    pub fn start_until_status(&mut self, network: &str, crash_at: Option<&str>) {
        let env = crash_at.map(|step| (flatnet_agent::crash_point::CRASH_AT_ENV, step));
        self.start(env, |agent| {
            crate::support::cni::run_cni(&agent.socket(), "STATUS", network, "", None, json!({})).0
        });
    }

    fn process_mut(&mut self) -> &mut Child {
        self.process.as_mut().expect("flatnet-agent is running")
    }

    /// Stops the agent with SIGTERM and checks it exits successfully.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.process.take() {
            let pid = nix::unistd::Pid::from_raw(child.id().cast_signed());
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let status = child.wait().unwrap();
            assert!(status.success(), "flatnet-agent exited with {status}");
        }
    }

    /// Kills the agent with SIGKILL, as the OOM killer or a node crash
    /// would, and waits for it.
    pub fn kill(&mut self) {
        let mut child = self.process.take().expect("flatnet-agent is running");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// Waits for the agent to exit on its own (e.g. at a crash point).
    pub fn wait_for_exit(&mut self) -> ExitStatus {
        let mut child = self.process.take().expect("flatnet-agent is running");
        child.wait().unwrap()
    }

    /// The standalone allocation file; no allocations when it is not there yet.
    pub fn allocations(&self) -> Value {
        match std::fs::read(self.path("state/allocations.json")) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap(),
            Err(_) => json!({"allocations": []}),
        }
    }

    /// How many attachment records the agent keeps.
    /// Whether the agent has a record of `container`.
    pub fn has_record(&self, container: &str) -> bool {
        flatnet_agent::records::Records::read(&self.path("records"))
            .is_ok_and(|records| records.iter().any(|r| r.key.container_id == container))
    }

    pub fn records(&self) -> usize {
        flatnet_agent::records::Records::read(&self.path("records"))
            .map(|records| records.len())
            .unwrap_or(0)
    }
}

/// Writes a kubeconfig at `path` naming the API server at `server` (an
/// `http://` URL, no credentials), namespace `default`.
#[allow(dead_code, reason = "not every test binary runs Kubernetes mode")]
pub fn write_kubeconfig(path: &Path, server: &str) {
    let config = json!({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}],
    });
    std::fs::write(path, serde_json::to_vec(&config).unwrap()).unwrap();
}

/// Inserts the Node `name` into `server`: the allocation keeps no address
/// on a node that does not exist.
#[allow(dead_code, reason = "not every test binary runs Kubernetes mode")]
pub fn insert_node(server: &flatnet_operator::allocation::fake_api::FakeApiServer, name: &str) {
    server.insert(&k8s_openapi::api::core::v1::Node {
        metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        ..Default::default()
    });
}

/// The agent's namespace in these tests: the kubeconfig's, as its
/// ServiceAccount's is in a pod.
const AGENT_NAMESPACE: &str = "default";

/// `server` as the agent meets it on a cluster installed from the chart:
/// its requests authorized by the chart's rules for the agent's
/// ServiceAccount in `namespace`, as a real API server does (a refusal is
/// the real server's 403), and recorded apart from the operator's.
#[allow(dead_code, reason = "not every test binary runs Kubernetes mode")]
pub fn as_agent(
    server: &flatnet_operator::allocation::fake_api::FakeApiServer,
    namespace: &str,
) -> flatnet_operator::allocation::fake_api::FakeApiServer {
    use flatnet_operator::allocation::fake_api::rbac::Rbac;
    server
        .for_client(1)
        .with_rbac(Rbac::from_chart("flatnet-agent").in_release_namespace(namespace))
}

/// Where the agent's tests in Kubernetes mode leave the kinds of request
/// the agent sent, a file per test, for `agent_rbac` to compare with the
/// chart's grants after the whole suite.
#[allow(dead_code, reason = "not every test binary runs Kubernetes mode")]
pub fn agent_accesses_dir() -> PathBuf {
    // Cargo names it to integration tests only (see `package_binary`).
    let tmp: Option<&str> = option_env!("CARGO_TARGET_TMPDIR");
    Path::new(tmp.expect("the target's tmp folder is known to integration tests"))
        .join("agent-accesses")
}

/// Fails naming every request of the agent the chart's rules refused, and
/// leaves the kinds of request it sent in [`agent_accesses_dir`].
#[allow(dead_code, reason = "not every test binary runs Kubernetes mode")]
pub fn assert_agent_authorized(server: &flatnet_operator::allocation::fake_api::FakeApiServer) {
    let dir = agent_accesses_dir();
    std::fs::create_dir_all(&dir).unwrap();
    let binary = std::env::current_exe().unwrap();
    let binary = binary.file_stem().unwrap().to_string_lossy();
    let test = std::thread::current()
        .name()
        .unwrap_or("main")
        .replace("::", "-");
    let lines: Vec<String> = server.accesses().iter().map(|a| a.to_line()).collect();
    std::fs::write(dir.join(format!("{binary}-{test}")), lines.join("\n")).unwrap();
    let refused: Vec<String> = server
        .requests_by_kind()
        .into_iter()
        .filter(|(kind, _)| kind.ends_with(" 403"))
        .map(|(kind, count)| format!("{kind} ×{count}"))
        .collect();
    assert!(
        refused.is_empty(),
        "the chart's agent RBAC (charts/flatnet/templates/agent-rbac.yaml) refused: {refused:?}"
    );
}

/// Serves `server` over HTTP on a loopback port from `runtime`, with the
/// operator's allocation controllers (MAC pool `mac_pool`) running against
/// it until the runtime ends, and writes a kubeconfig naming it at
/// `kubeconfig`. The agent's requests are authorized by the chart's rules
/// ([`as_agent`]); the controllers' are not.
#[allow(dead_code, reason = "not every test binary runs Kubernetes mode")]
pub fn serve_with_allocation(
    runtime: &tokio::runtime::Runtime,
    server: &flatnet_operator::allocation::fake_api::FakeApiServer,
    mac_pool: Option<flatnet_operator::allocation::mac_pool::ActivePool>,
    kubeconfig: &Path,
) {
    use flatnet_operator::allocation::{Settings, fake_api_http, fake_cluster::FakeCluster};
    let address = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(fake_api_http::serve(
            as_agent(server, AGENT_NAMESPACE),
            listener,
        ));
        // Its tasks run on when the handle goes; the runtime ends them.
        drop(FakeCluster::start_with_mac_pool(
            server.clone(),
            Settings::default(),
            2,
            mac_pool,
        ));
        address
    });
    write_kubeconfig(kubeconfig, &format!("http://{address}"));
}

/// A binary of this package. Cargo names them to integration tests only;
/// this module is also compiled into examples and benchmarks, which do not
/// start an agent.
pub fn package_binary(path: Option<&'static str>) -> &'static str {
    path.expect("the package's binaries are known to integration tests only")
}

impl Drop for StandaloneAgent {
    fn drop(&mut self) {
        if let Some(mut child) = self.process.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if std::thread::panicking() {
            let log = std::fs::read_to_string(self.log_file()).unwrap_or_default();
            eprintln!("flatnet-agent log:\n{log}");
        }
    }
}

/// The macvlan FlatNetworkSubnet `name` in `mode` over `master`: `cidr`,
/// pods get `from`..`to`.
#[allow(dead_code, reason = "not every test binary runs Kubernetes mode")]
pub fn macvlan_subnet(
    name: &str,
    (master, mode): (&str, &str),
    cidr: &str,
    (from, to): (&str, &str),
) -> flatnet_k8s::api::FlatNetworkSubnet {
    serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
        "metadata": {"name": name, "namespace": flatnet_k8s::keys::SUBNET_NAMESPACE},
        "spec": {"flatMode": "macvlan", "master": master, "mode": mode, "cidr": cidr,
                 "ranges": [{"from": from, "to": to}]}
    }))
    .unwrap()
}

/// A node on a [`SimulatedLan`] (IPv6 off on the LAN host) with the
/// operator's in-memory API server holding one flat pod: the macvlan
/// FlatNetworkSubnet `lan4` in `mode` over the node's master
/// (192.0.2.0/24, pods get 192.0.2.10-192.0.2.20), the Node, and the
/// running pod `default/pod` with a flat interface on `lan4` (an automatic
/// address, no MAC named). Nothing runs yet.
#[allow(dead_code, reason = "not every test binary runs Kubernetes mode")]
pub struct FlatPodCluster {
    pub node: crate::support::TestNetns,
    pub lan: crate::support::TestNetns,
    pub master: String,
    pub dir: tempfile::TempDir,
    pub runtime: tokio::runtime::Runtime,
    pub server: flatnet_operator::allocation::fake_api::FakeApiServer,
}

impl FlatPodCluster {
    /// Namespaces named after `prefix`; the pod `pod` on Node `node`.
    #[allow(dead_code, reason = "not every test binary runs Kubernetes mode")]
    pub fn new(prefix: &str, mode: &str, node_name: &str, pod: &str) -> Self {
        let lan = crate::support::lan::SimulatedLan::new(prefix, &["192.0.2.1/24"]);
        Self::on_lan(lan, mode, node_name, pod)
    }

    /// The same on `lan` (made with the LAN host address 192.0.2.1/24).
    #[allow(dead_code, reason = "not every test binary runs Kubernetes mode")]
    pub fn on_lan(
        lan: crate::support::lan::SimulatedLan,
        mode: &str,
        node_name: &str,
        pod: &str,
    ) -> Self {
        let crate::support::lan::SimulatedLan { node, lan, master } = lan;
        lan.sysctl("net.ipv6.conf.all.disable_ipv6", "1");
        let server = flatnet_operator::allocation::fake_api::FakeApiServer::new();
        server.insert(&macvlan_subnet(
            "lan4",
            (&master, mode),
            "192.0.2.0/24",
            ("192.0.2.10", "192.0.2.20"),
        ));
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": "default",
                         "annotations": {"flatnetwork.pandaria.io/ip": "auto",
                                         "flatnetwork.pandaria.io/subnet": "lan4"}},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "image": "pause"}]},
            "status": {"phase": "Running"}
        }))
        .unwrap();
        server.insert(&pod);
        insert_node(&server, node_name);
        Self {
            node,
            lan,
            master,
            dir: tempfile::tempdir().unwrap(),
            runtime: tokio::runtime::Runtime::new().unwrap(),
            server,
        }
    }
}

/// A loopback address with a port nothing listens on now.
pub fn free_local_address() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

/// The counter `name` (with its labels) of the agent whose admin server
/// listens on `admin`; 0 while not exposed.
#[allow(dead_code, reason = "not every test binary reads the agent's metrics")]
pub fn counted(admin: &str, name: &str) -> u64 {
    let text = http_get(admin, "/metrics");
    let prefix = format!("{name} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |n| n.trim().parse().unwrap())
}

/// The body of `GET path` from the HTTP server at `address`.
pub fn http_get(address: &str, path: &str) -> String {
    let mut stream = TcpStream::connect(address).unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {address}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_owned())
        .unwrap_or_default()
}
