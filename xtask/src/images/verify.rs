//! `cargo xtask images --verify`: the built images run what the chart runs.
//!
//! Both containers are started by podman from the chart's default render
//! ([`ChartContainer`]): same image, command, environment, user,
//! capabilities, read-only root and host paths.
//!
//! - The agent's `mount-bpffs` init container, privileged as in the chart,
//!   must find bpffs mounted and exit 0.
//! - The agent, on the host network of a node (a network namespace with a
//!   veth uplink to a LAN host), installs `flatnet-cni` and its conflist
//!   into the node's CNI directories; that installed plugin, run on the
//!   node, then adds a pod (address, its gratuitous ARP on the LAN, traffic
//!   to the LAN host) and deletes it.
//!   The agent runs standalone, as no cluster is reachable here.
//! - The operator, pointed at a minimal API server that reports the leader
//!   Lease held by another replica, answers `/healthz` and `/readyz` as a
//!   non-leading replica does, as uid 65532 on a read-only root.
//!
//! Every object made is named `fnimg-...` and removed again, also after a
//! failure; leftovers of a killed run are removed first.

use std::{
    collections::BTreeMap,
    fs,
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, bail, ensure};
use serde_json::{Value, json};

use super::{
    ChartImages, Component,
    podman::{ChartContainer, POD_NAMESPACE as NAMESPACE, agent_pod_env, host_path_below},
    qualify,
};
use crate::{
    charts,
    lab::{capture::Capture, netns, parse_mac, process},
    workspace,
};

const NODE: &str = "fnimg-node";
const LAN: &str = "fnimg-lan";
const POD: &str = "fnimg-pod";
const OPERATOR_NETNS: &str = "fnimg-op";
const AGENT_CONTAINER: &str = "fnimg-agent";
const INIT_CONTAINER: &str = "fnimg-mount-bpffs";
const OPERATOR_CONTAINER: &str = "fnimg-operator";
/// Host side of the chart's host paths, the state file and the kubeconfig.
const WORK_DIR: &str = "/run/fnimg";
/// Pin root of the agent under test, beside any real agent's.
const PIN_ROOT: &str = "/sys/fs/bpf/fnimg";
const LAN_HOST: &str = "192.0.2.1";
const POD_ADDRESS: &str = "192.0.2.10";
/// Where the standalone state file is mounted in the agent container.
const STATE_FILE: &str = "/etc/flatnet/state.yaml";
const KUBECONFIG: &str = "/etc/flatnet/kubeconfig";
/// A bound on waiting for start-up, not a measurement.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs both proofs; fails with what did not hold.
pub fn run() -> anyhow::Result<()> {
    ensure!(
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() } == 0,
        "the image checks create network namespaces and run podman: run them as root"
    );
    let root = workspace::root();
    let chart = ChartImages::read(&root)?;
    let rendered = root.join(charts::RENDERED);
    remove_everything();
    let _cleanup = Cleanup;
    timed(
        "operator image answers /healthz and /readyz, non-root, read-only root",
        || operator(&chart, &rendered),
    )?;
    timed(
        "agent image serves CNI ADD/DEL through the flatnet-cni it installed",
        || agent(&chart, &rendered),
    )
}

fn timed(what: &str, check: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
    println!("==> image check: {what}");
    let started = Instant::now();
    let outcome = check();
    println!(
        "<== image check: {} in {:.1}s",
        if outcome.is_ok() { "ok" } else { "FAILED" },
        started.elapsed().as_secs_f64()
    );
    outcome.with_context(|| format!("image check failed: {what}"))
}

/// Removes what the checks make when dropped.
struct Cleanup;

impl Drop for Cleanup {
    fn drop(&mut self) {
        remove_everything();
    }
}

fn remove_everything() {
    for container in [INIT_CONTAINER, AGENT_CONTAINER, OPERATOR_CONTAINER] {
        let _ = podman()
            .args(["rm", "--force", "--time", "0", container])
            .output();
    }
    for netns in [POD, NODE, LAN, OPERATOR_NETNS] {
        let _ = Command::new("ip").args(["netns", "del", netns]).output();
    }
    let _ = fs::remove_dir_all(WORK_DIR);
    let _ = fs::remove_dir_all(PIN_ROOT);
}

/// podman on the machine's store (where `cargo xtask images` loaded the images).
fn podman() -> Command {
    let mut command = Command::new("podman");
    command.args(["--runtime", "runc"]);
    command
}

fn checked(command: &mut Command) -> anyhow::Result<String> {
    let out = process::output(command, &[])?;
    ensure!(
        out.status.success(),
        "{command:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn container_state(name: &str, field: &str) -> anyhow::Result<String> {
    checked(podman().args([
        "inspect",
        "--format",
        &format!("{{{{.State.{field}}}}}"),
        name,
    ]))
}

/// Stops the container with SIGTERM and checks it exited with 0.
fn stop_cleanly(name: &str) -> anyhow::Result<()> {
    checked(podman().args(["stop", "--time", "20", name]))?;
    let code = container_state(name, "ExitCode")?;
    ensure!(
        code == "0",
        "{name} exited with {code} on SIGTERM:\n{}",
        logs(name)
    );
    Ok(())
}

fn logs(name: &str) -> String {
    podman()
        .args(["logs", "--tail", "40", name])
        .output()
        .map(|o| {
            format!(
                "{}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        })
        .unwrap_or_default()
}

/// Waits until `ready` holds while the container runs.
fn wait_for(name: &str, what: &str, ready: impl Fn() -> bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if ready() {
            return Ok(());
        }
        if container_state(name, "Running")? != "true" {
            bail!("{name} exited before {what}:\n{}", logs(name));
        }
        if Instant::now() > deadline {
            bail!(
                "{name}: no {what} within {START_TIMEOUT:?}:\n{}",
                logs(name)
            );
        }
        process::sleep(Duration::from_millis(200))?;
    }
}

/// Whether `GET path` on `address` inside `netns_name` answers 200 with `body`.
fn answers(netns_name: &str, address: SocketAddr, path: &str, body: &str) -> bool {
    netns::in_netns(netns_name, || netns::http_get(address, path))
        .and_then(|got| got)
        .is_ok_and(|got| got.trim() == body)
}

/// The port of an `address:port` variable of the chart.
fn admin_address(container: &ChartContainer) -> anyhow::Result<SocketAddr> {
    let (_, value) = container
        .env
        .iter()
        .find(|(name, _)| name == "FLATNET_ADMIN_ADDRESS")
        .context("the chart sets no FLATNET_ADMIN_ADDRESS")?;
    let port = value
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse::<u16>().ok())
        .with_context(|| format!("FLATNET_ADMIN_ADDRESS {value:?} has no port"))?;
    Ok(SocketAddr::from(([127, 0, 0, 1], port)))
}

fn chart_env<'a>(container: &'a ChartContainer, name: &str) -> anyhow::Result<&'a str> {
    container
        .env
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| v.as_str())
        .with_context(|| format!("the chart sets no {name}"))
}

// --- the agent --------------------------------------------------------------

fn agent(chart: &ChartImages, rendered: &Path) -> anyhow::Result<()> {
    let container = ChartContainer::read(rendered, "DaemonSet", "agent", "agent")?;
    ensure!(
        qualify(&container.image) == chart.qualified_reference(Component::Agent),
        "the chart's agent image {} is not the one built",
        container.image
    );
    ensure!(
        container.host_network && !container.privileged,
        "the chart's agent is expected on the host network, unprivileged"
    );
    for netns_name in [NODE, LAN, POD] {
        process::run("ip", &["netns", "add", netns_name])?;
        process::ip(netns_name, &["link", "set", "lo", "up"])?;
    }
    process::ip(
        NODE,
        &[
            "link", "add", "uplink", "type", "veth", "peer", "name", "eth0", "netns", LAN,
        ],
    )?;
    process::ip(NODE, &["link", "set", "uplink", "up"])?;
    process::ip(
        LAN,
        &["addr", "add", &format!("{LAN_HOST}/24"), "dev", "eth0"],
    )?;
    process::ip(LAN, &["link", "set", "eth0", "up"])?;

    let work = Path::new(WORK_DIR);
    let scratch = work.join("host");
    let host = host_path_below(&scratch);
    container.create_host_dirs(host)?;
    let network = "flatnet";
    let state = work.join("state.yaml");
    fs::write(
        &state,
        format!(
            "subnets:\n  - name: lan4\n    spec:\n      flatMode: macvlan\n      master: uplink\n      \
             cidr: 192.0.2.0/24\n      gateway: {LAN_HOST}\n      \
             ranges: [{{from: {POD_ADDRESS}, to: 192.0.2.20}}]\n\
             networks:\n  - {{name: {network}, subnets: [lan4]}}\n"
        ),
    )?;
    let mut args = container.podman_args(
        AGENT_CONTAINER,
        host,
        &agent_pod_env(NODE),
        &BTreeMap::from([("FLATNET_BPF_PIN_ROOT", PIN_ROOT.to_owned())]),
    )?;
    args.extend([
        "--volume".into(),
        format!("{}:{STATE_FILE}:ro", state.display()),
        qualify(&container.image),
    ]);
    args.extend(container.command.iter().cloned());
    // Standalone: the desired state comes from the file, not a cluster.
    args.extend(["--standalone", "--state-file", STATE_FILE].map(str::to_owned));
    init_container(rendered, &host)?;
    // The node's host network is the namespace podman runs in.
    let mut start = Command::new("nsenter");
    start
        .arg(format!("--net=/run/netns/{NODE}"))
        .arg("podman")
        .args(["--runtime", "runc"])
        .args(&args);
    checked(&mut start)?;

    let cni_bin = host(chart_env(&container, "FLATNET_CNI_BIN_DIR")?);
    let plugin = PathBuf::from(&cni_bin).join("flatnet-cni");
    let socket_in_container = chart_env(&container, "FLATNET_AGENT_SOCKET")?.to_owned();
    let socket_dir = Path::new(&socket_in_container)
        .parent()
        .context("socket path without a directory")?;
    let socket = Path::new(&host(&socket_dir.display().to_string())).join(
        Path::new(&socket_in_container)
            .file_name()
            .context("socket name")?,
    );
    // A conflist in the runtime's configuration directory could be taken
    // for the cluster network (the first file there wins): the chart's
    // agent writes none; Multus reads the flat network from its
    // NetworkAttachmentDefinition.
    ensure!(
        chart_env(&container, "FLATNET_CNI_CONF_DIR").is_err(),
        "the chart makes the agent write a conflist into the runtime's configuration directory"
    );
    let cni = Cni {
        plugin: plugin.clone(),
        cni_bin: cni_bin.clone(),
        socket,
        network: network.to_owned(),
    };
    wait_for(
        AGENT_CONTAINER,
        "installed flatnet-cni answering STATUS",
        || plugin.is_file() && cni.call("STATUS").is_ok(),
    )?;
    let admin = admin_address(&container)?;
    wait_for(AGENT_CONTAINER, "/healthz", || {
        answers(NODE, admin, "/healthz", "ok")
    })?;
    let mode = fs::metadata(&plugin)?.permissions().mode();
    ensure!(
        mode & 0o111 != 0,
        "the installed flatnet-cni is not executable ({mode:o})"
    );

    let capture = Capture::start(LAN, "eth0")?;
    let added = cni.call("ADD")?;
    let address = added["ips"][0]["address"].as_str().unwrap_or_default();
    ensure!(
        address == format!("{POD_ADDRESS}/24"),
        "ADD gave {added}, expected {POD_ADDRESS}/24"
    );
    let shown = process::ip(POD, &["-o", "-4", "addr", "show", "dev", "eth0"])?;
    ensure!(
        shown.contains(&format!("inet {POD_ADDRESS}/24")),
        "eth0 of the pod: {shown}"
    );
    // The chart's arp_notify policy on a read-only /proc/sys: the agent
    // announces the address itself.
    let mac = added["interfaces"]
        .as_array()
        .into_iter()
        .flatten()
        .find_map(|i| i["mac"].as_str().and_then(parse_mac))
        .with_context(|| format!("no interface MAC in the ADD result {added}"))?;
    let address: std::net::Ipv4Addr = POD_ADDRESS.parse()?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while !capture.saw_gratuitous_arp(mac, address) {
        ensure!(
            Instant::now() < deadline,
            "the LAN host received no gratuitous ARP for {POD_ADDRESS} (policy {})",
            chart_env(&container, "FLAT_NETWORK_CNI_ARP_POLICY")?
        );
        process::sleep(Duration::from_millis(100))?;
    }
    drop(capture);
    netns::ping(POD, LAN_HOST)?;
    cni.call("DEL")?;
    ensure!(
        process::ip(POD, &["link", "show", "eth0"]).is_err(),
        "eth0 is still in the pod after DEL"
    );
    // The debugging tools the image carries work inside it, with its privileges.
    let counters = format!("{PIN_ROOT}/FRAME_COUNTERS");
    let map = checked(podman().args([
        "exec",
        AGENT_CONTAINER,
        "bpftool",
        "map",
        "show",
        "pinned",
        &counters,
    ]))?;
    ensure!(
        map.contains("name FRAME_COUNTERS"),
        "bpftool in the image: {map}"
    );
    // On the host network, podman exec stays in the caller's namespace: the node's here.
    let uplink = checked(
        Command::new("nsenter")
            .arg(format!("--net=/run/netns/{NODE}"))
            .args(["podman", "--runtime", "runc", "exec", AGENT_CONTAINER])
            .args(["ip", "-br", "link", "show", "uplink"]),
    )?;
    ensure!(uplink.starts_with("uplink"), "ip in the image: {uplink}");
    stop_cleanly(AGENT_CONTAINER)
}

/// The chart's `mount-bpffs` init container, run as rendered (privileged,
/// bpffs mounted back to the host): bpffs is mounted on this machine, so it
/// must say so and exit 0.
fn init_container(rendered: &Path, host: &impl Fn(&str) -> String) -> anyhow::Result<()> {
    let init = ChartContainer::read(rendered, "DaemonSet", "agent", "mount-bpffs")?;
    let mut args = init.podman_args(INIT_CONTAINER, host, &BTreeMap::new(), &BTreeMap::new())?;
    args.push(qualify(&init.image));
    args.extend(init.command.iter().cloned());
    checked(podman().args(&args))?;
    let code = checked(podman().args(["wait", INIT_CONTAINER]))?;
    let output = logs(INIT_CONTAINER);
    ensure!(
        code == "0" && output.contains("already mounted"),
        "mount-bpffs exited with {code}: {output}"
    );
    Ok(())
}

/// The plugin the agent installed, called as a runtime on the node does.
struct Cni {
    plugin: PathBuf,
    cni_bin: String,
    socket: PathBuf,
    network: String,
}

impl Cni {
    fn call(&self, command: &str) -> anyhow::Result<Value> {
        // The conflist names the socket as the container sees it (the same
        // path as on a node); here the node's directory lies under WORK_DIR.
        // 1.1.0: the version with STATUS, which the plugin offers.
        let config = json!({
            "cniVersion": "1.1.0",
            "name": self.network,
            "type": "flatnet-cni",
            "agentSocket": self.socket,
        });
        let mut cni = Command::new(&self.plugin);
        cni.env_clear()
            .env("CNI_COMMAND", command)
            .env("CNI_PATH", &self.cni_bin)
            .env("CNI_CONTAINERID", POD)
            .env("CNI_IFNAME", "eth0")
            .env("CNI_NETNS", format!("/run/netns/{POD}"))
            .env(
                "CNI_ARGS",
                format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={POD}"),
            );
        let out = process::output(&mut cni, config.to_string().as_bytes())?;
        let stdout: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        ensure!(
            out.status.success(),
            "flatnet-cni {command} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(stdout)
    }
}

// --- the operator -----------------------------------------------------------

fn operator(chart: &ChartImages, rendered: &Path) -> anyhow::Result<()> {
    let container = ChartContainer::read(rendered, "Deployment", "operator", "operator")?;
    ensure!(
        qualify(&container.image) == chart.qualified_reference(Component::Operator),
        "the chart's operator image {} is not the one built",
        container.image
    );
    process::run("ip", &["netns", "add", OPERATOR_NETNS])?;
    process::ip(OPERATOR_NETNS, &["link", "set", "lo", "up"])?;
    let lease = chart_env(&container, "FLATNET_LEASE_NAME")?.to_owned();
    let api = StubApi::start(OPERATOR_NETNS, &lease)?;

    let dir = Path::new(WORK_DIR).join("operator");
    fs::create_dir_all(&dir)?;
    let kubeconfig = dir.join("kubeconfig");
    fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\n\
             clusters: [{{name: stub, cluster: {{server: \"http://{}\"}}}}]\n\
             users: [{{name: stub, user: {{token: stub}}}}]\n\
             contexts: [{{name: stub, context: {{cluster: stub, user: stub}}}}]\n\
             current-context: stub\n",
            api.address
        ),
    )?;
    // Readable by the operator's non-root user.
    fs::set_permissions(&kubeconfig, fs::Permissions::from_mode(0o644))?;
    let mut args = container.podman_args(
        OPERATOR_CONTAINER,
        str::to_owned,
        &BTreeMap::from([
            ("POD_NAMESPACE", NAMESPACE.to_owned()),
            ("HOSTNAME", OPERATOR_CONTAINER.to_owned()),
        ]),
        &BTreeMap::new(),
    )?;
    args.extend([
        "--network".into(),
        format!("ns:/run/netns/{OPERATOR_NETNS}"),
        "--volume".into(),
        format!("{}:{KUBECONFIG}:ro", kubeconfig.display()),
        // Out of a cluster: the API server comes from a kubeconfig.
        "--env".into(),
        format!("KUBECONFIG={KUBECONFIG}"),
        qualify(&container.image),
    ]);
    args.extend(container.command.iter().cloned());
    checked(podman().args(&args))?;

    let admin = admin_address(&container)?;
    wait_for(OPERATOR_CONTAINER, "/healthz", || {
        answers(OPERATOR_NETNS, admin, "/healthz", "ok")
    })?;
    wait_for(OPERATOR_CONTAINER, "/readyz", || {
        answers(OPERATOR_NETNS, admin, "/readyz", "ready")
    })?;
    let lease_path = format!("/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{lease}");
    // Ready comes before the first election round: wait for the Lease read.
    let read_lease = format!("GET {lease_path}");
    wait_for(OPERATOR_CONTAINER, "a read of its Lease", || {
        api.requests().iter().any(|r| r.starts_with(&read_lease))
    })
    .with_context(|| format!("the stub API server was asked: {:?}", api.requests()))?;

    let pid = container_state(OPERATOR_CONTAINER, "Pid")?;
    let status = fs::read_to_string(format!("/proc/{pid}/status"))?;
    let uids = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .context("no Uid in /proc/<pid>/status")?;
    let expected_uid = container
        .user
        .as_deref()
        .and_then(|u| u.split(':').next())
        .context("the chart sets no runAsUser for the operator")?;
    ensure!(
        expected_uid != "0" && uids.split_whitespace().all(|u| u == expected_uid),
        "the operator runs with uids {uids}, expected {expected_uid} (non-root)"
    );
    let mountinfo = fs::read_to_string(format!("/proc/{pid}/mountinfo"))?;
    let root = mountinfo
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>())
        .find(|fields| fields.get(4) == Some(&"/"))
        .context("no root mount in the operator's mountinfo")?;
    ensure!(
        root.get(5).is_some_and(|o| o.split(',').any(|o| o == "ro")),
        "the operator's root filesystem is not read-only: {}",
        root.join(" ")
    );
    stop_cleanly(OPERATOR_CONTAINER)?;
    drop(api);
    Ok(())
}

/// The smallest API server the operator starts against: the leader Lease
/// exists and is held by another replica, everything else is 404 (the
/// operator retries those). Runs until dropped.
struct StubApi {
    address: SocketAddr,
    requests: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl StubApi {
    fn start(netns_name: &str, lease: &str) -> anyhow::Result<Self> {
        let listener = netns::in_netns(netns_name, || TcpListener::bind("127.0.0.1:0"))??;
        listener.set_nonblocking(true)?;
        let address = listener.local_addr()?;
        let requests = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (requests, stop, lease) =
                (Arc::clone(&requests), Arc::clone(&stop), lease.to_owned());
            thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((stream, _)) => {
                            if let Some(line) = answer(stream, &lease) {
                                requests.lock().expect("not poisoned").push(line);
                            }
                        }
                        Err(_) => thread::sleep(Duration::from_millis(20)),
                    }
                }
            })
        };
        Ok(Self {
            address,
            requests,
            stop,
            thread: Some(thread),
        })
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().expect("not poisoned").clone()
    }
}

impl Drop for StubApi {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Answers one request (one per connection); returns its request line.
fn answer(mut stream: TcpStream, lease: &str) -> Option<String> {
    stream.set_nonblocking(false).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if stream.read(&mut byte).ok()? == 0 {
            return None;
        }
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    let line = head.lines().next()?.to_owned();
    let path = line.split_whitespace().nth(1).unwrap_or_default();
    let (code, body) = if line.starts_with("GET ") && path.ends_with(&format!("/leases/{lease}")) {
        let now = time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .ok()?;
        (
            "200 OK",
            json!({
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": lease, "namespace": NAMESPACE, "resourceVersion": "1"},
                "spec": {
                    "holderIdentity": "another-replica",
                    "leaseDurationSeconds": 3600,
                    "acquireTime": now,
                    "renewTime": now,
                },
            }),
        )
    } else {
        (
            "404 Not Found",
            json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                   "reason": "NotFound", "code": 404, "message": "not served by the stub"}),
        )
    };
    let body = body.to_string();
    let _ = write!(
        stream,
        "HTTP/1.1 {code}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    Some(line)
}
