//! End to end with a real container runtime: podman (CNI backend, runc)
//! runs a busybox container on a flatnet network. The network's conflist and
//! `flatnet-cni` are the ones a real standalone `flatnet-agent` installs; the
//! master is a veth whose peer is a LAN host in another namespace.
//!
//! Podman runs with private configuration, storage, runtime state and CNI
//! directories under a temporary root, so nothing of the machine's podman
//! setup is used or changed.

mod support;

use std::{
    io::{BufRead, BufReader, Write},
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::{Value, json};
use support::{
    REQUIRE_PRIVILEGED, TestNetns, agent::StandaloneAgent, lan::SimulatedLan, privileged,
    report_skip, unique_name,
};

const LAN_HOST: &str = "192.0.2.1";
const FIRST_ADDRESS: &str = "192.0.2.10";
const NETWORK: &str = "flatnet-e2e";
const IMAGE: &str = "localhost/flatnet-e2e-busybox:latest";
const TCP_PORT: u16 = 7070;

/// Host directories the runtime stack creates as root whatever it is told
/// (libcni's result cache, containers/image's blob cache); removed again
/// when this test created them.
const RUNTIME_GLOBAL_DIRS: &[&str] = &["/var/lib/cni", "/var/lib/containers"];

/// Whether a missing tool must fail the test rather than skip it: in CI
/// (`CI` true) or when privileged tests are required.
fn tools_required() -> bool {
    let ci = std::env::var("CI").is_ok_and(|v| matches!(v.as_str(), "true" | "1" | "yes"));
    ci || std::env::var_os(REQUIRE_PRIVILEGED).is_some()
}

/// Path of `program` on `PATH`.
fn which(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

/// Whether the ELF file asks for a dynamic loader (has a `PT_INTERP`
/// program header): such a busybox cannot run in an image holding only it.
fn is_dynamically_linked(elf: &[u8]) -> bool {
    const PT_INTERP: u32 = 3;
    let read_u16 = |at: usize| u16::from_le_bytes([elf[at], elf[at + 1]]) as usize;
    if elf.len() < 64 || &elf[..4] != b"\x7fELF" || elf[4] != 2 {
        return false;
    }
    let phoff = u64::from_le_bytes(elf[32..40].try_into().unwrap()) as usize;
    let (phentsize, phnum) = (read_u16(54), read_u16(56));
    (0..phnum).any(|i| {
        let at = phoff + i * phentsize;
        elf.get(at..at + 4)
            .is_some_and(|t| u32::from_le_bytes(t.try_into().unwrap()) == PT_INTERP)
    })
}

/// The static busybox to build the image from, or why there is none.
fn static_busybox() -> Result<PathBuf, String> {
    let path = which("busybox").ok_or("busybox is not installed (apt: busybox-static)")?;
    let bytes = std::fs::read(&path).map_err(|e| format!("read {}: {e}", path.display()))?;
    if is_dynamically_linked(&bytes) {
        return Err(format!(
            "{} is dynamically linked; install busybox-static",
            path.display()
        ));
    }
    Ok(path)
}

/// Checks podman, runc and a static busybox. Prints the skip and returns
/// `None` when one is missing, or panics when [`tools_required`].
fn tools(test: &str) -> Option<PathBuf> {
    let mut missing: Vec<String> = ["podman", "runc", "tar"]
        .into_iter()
        .filter(|tool| which(tool).is_none())
        .map(|tool| format!("{tool} is not installed"))
        .collect();
    let busybox = static_busybox().map_err(|why| missing.push(why)).ok();
    if missing.is_empty() {
        return busybox;
    }
    let why = format!(
        "{test}: {} (bash .ci/provision installs them)",
        missing.join(", ")
    );
    assert!(
        !tools_required(),
        "{why}; CI or {REQUIRE_PRIVILEGED} requires this test to run"
    );
    report_skip(&why);
    None
}

/// Runs a command to completion; returns stdout, panicking with the output
/// when it fails.
fn output(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// podman with every path it writes under `root`.
struct Podman {
    root: PathBuf,
}

impl Podman {
    fn new(root: &Path, cni_bin_dir: &Path, cni_conf_dir: &Path) -> Self {
        let root = root.to_path_buf();
        let conf = format!(
            r#"[network]
network_backend = "cni"
cni_plugin_dirs = ["{bin}"]
network_config_dir = "{net}"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "none"
static_dir = "{root}/storage/libpod"
tmp_dir = "{root}/tmp"
volume_path = "{root}/storage/volumes"
"#,
            bin = cni_bin_dir.display(),
            net = cni_conf_dir.display(),
            root = root.display(),
        );
        std::fs::write(root.join("containers.conf"), conf).unwrap();
        let storage = format!(
            "[storage]\ndriver = \"vfs\"\ngraphroot = \"{root}/storage\"\nrunroot = \"{root}/runroot\"\n",
            root = root.display()
        );
        std::fs::write(root.join("storage.conf"), storage).unwrap();
        std::fs::write(root.join("registries.conf"), "").unwrap();
        Self { root }
    }

    /// A podman command; the same configuration reaches the clean-up
    /// process conmon starts when a container exits.
    fn command(&self) -> Command {
        let mut cmd = Command::new("podman");
        cmd.env("CONTAINERS_CONF", self.root.join("containers.conf"))
            .env("CONTAINERS_STORAGE_CONF", self.root.join("storage.conf"))
            .env(
                "CONTAINERS_REGISTRIES_CONF",
                self.root.join("registries.conf"),
            )
            .arg("--runtime")
            .arg("runc")
            .arg("--runtime-flag")
            .arg(format!("root={}", self.root.join("runc").display()))
            .stdin(Stdio::null());
        cmd
    }

    fn run(&self, args: &[&str]) -> String {
        output(self.command().args(args))
    }

    /// Imports an image holding only a static busybox and its applet links.
    fn import_busybox(&self, busybox: &Path) {
        let rootfs = self.root.join("rootfs");
        std::fs::create_dir_all(rootfs.join("bin")).unwrap();
        std::fs::copy(busybox, rootfs.join("bin/busybox")).unwrap();
        for applet in ["sh", "ip", "ping", "nc", "sleep", "cat", "echo"] {
            std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet)).unwrap();
        }
        let tarball = self.root.join("rootfs.tar");
        output(
            Command::new("tar")
                .arg("-C")
                .arg(&rootfs)
                .arg("-cf")
                .arg(&tarball)
                .arg("."),
        );
        self.run(&["import", &tarball.display().to_string(), IMAGE]);
    }
}

/// Removes every container and image of the private store, then the host
/// directories the runtime stack created during the test.
struct PodmanCleanup<'a> {
    podman: &'a Podman,
    created_global_dirs: Vec<&'static str>,
}

impl Drop for PodmanCleanup<'_> {
    fn drop(&mut self) {
        for args in [
            &["rm", "--all", "--force", "--time", "0"][..],
            &["rmi", "--all", "--force"][..],
        ] {
            let _ = self.podman.command().args(args).output();
        }
        for dir in &self.created_global_dirs {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                eprintln!("cannot remove {dir}: {e}");
            }
        }
    }
}

/// The LAN host, the node with the master, and a standalone agent that
/// installs flatnet-cni and the network's conflist.
struct Lan {
    /// First field: the agent stops before the namespaces go.
    agent: StandaloneAgent,
    _node: TestNetns,
    lan: TestNetns,
}

impl Lan {
    fn start(dir: &Path) -> Self {
        let SimulatedLan { node, lan, master } =
            SimulatedLan::new("fp", &[&format!("{LAN_HOST}/24")]);
        let arg = |p: &str| dir.join(p).display().to_string();
        let mut agent = StandaloneAgent::new(
            dir,
            &node,
            &[
                "--cni-bin-dir",
                &arg("cni/bin"),
                "--cni-conf-dir",
                &arg("cni/net.d"),
                "--cni-network-name",
                NETWORK,
            ],
        );
        agent.write_state(&format!(
            r#"
subnets:
  - name: lan4
    spec:
      flatMode: macvlan
      master: {master}
      cidr: 192.0.2.0/24
      gateway: {LAN_HOST}
      ranges: [{{from: {FIRST_ADDRESS}, to: 192.0.2.20}}]
networks:
  - {{name: {NETWORK}, subnets: [lan4]}}
"#
        ));
        agent.start(None, status_ok);
        Self {
            agent,
            _node: node,
            lan,
        }
    }

    /// The agent's standalone allocations: (container ID, ifname, address).
    fn allocations(&self) -> Vec<(String, String, String)> {
        self.agent.allocations()["allocations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                let field = |k: &str| a[k].as_str().unwrap().to_owned();
                (field("containerId"), field("ifname"), field("address"))
            })
            .collect()
    }

    fn records(&self) -> usize {
        self.agent.records()
    }

    /// A TCP server on the LAN host answering one line with `pong <line>`.
    fn serve_one_tcp_exchange(&self) -> std::thread::JoinHandle<String> {
        let listener = flatnet_agent::netns::run_in_netns(&self.lan.path(), || {
            TcpListener::bind((LAN_HOST, TCP_PORT))
        })
        .unwrap()
        .unwrap();
        std::thread::spawn(move || {
            let (stream, peer) = listener.accept().unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(30)))
                .unwrap();
            let mut line = String::new();
            BufReader::new(&stream).read_line(&mut line).unwrap();
            writeln!(&stream, "pong {}", line.trim()).unwrap();
            peer.ip().to_string()
        })
    }
}

/// Whether the agent answers STATUS through the flatnet-cni and the
/// conflist it installed.
fn status_ok(agent: &StandaloneAgent) -> bool {
    let Ok(conflist) = std::fs::read(agent.path("cni/net.d/10-flatnet.conflist")) else {
        return false;
    };
    let conflist: Value = serde_json::from_slice(&conflist).unwrap();
    let mut config = conflist["plugins"][0].clone();
    config["cniVersion"] = json!("1.1.0");
    config["name"] = conflist["name"].clone();
    let mut child = Command::new(agent.path("cni/bin/flatnet-cni"))
        .env_clear()
        .env("CNI_COMMAND", "STATUS")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let _ = child
        .stdin
        .take()
        .unwrap()
        .write_all(config.to_string().as_bytes());
    child.wait().unwrap().success()
}

#[test]
fn podman_container_on_a_flatnet_network_reaches_the_lan() {
    const TEST: &str = "podman_container_on_a_flatnet_network_reaches_the_lan";
    if !privileged(TEST) {
        return;
    }
    let Some(busybox) = tools(TEST) else {
        return;
    };
    let created_global_dirs = RUNTIME_GLOBAL_DIRS
        .iter()
        .copied()
        .filter(|dir| !Path::new(dir).exists())
        .collect();
    let root = tempfile::tempdir().unwrap();
    let lan = Lan::start(root.path());
    let podman = Podman::new(
        root.path(),
        &root.path().join("cni/bin"),
        &root.path().join("cni/net.d"),
    );
    let _cleanup = PodmanCleanup {
        podman: &podman,
        created_global_dirs,
    };
    podman.import_busybox(&busybox);
    assert!(
        podman
            .run(&["network", "ls", "--format", "{{.Name}}"])
            .lines()
            .any(|name| name == NETWORK),
        "podman does not list the network from the agent's conflist"
    );

    let name = unique_name("fpc");
    let container = podman
        .run(&[
            "run",
            "--detach",
            "--name",
            &name,
            "--network",
            NETWORK,
            "--cap-add",
            "NET_RAW",
            "--ulimit",
            "nofile=1024:1024",
            "--ulimit",
            "nproc=1024:1024",
            IMAGE,
            "sleep",
            "600",
        ])
        .trim()
        .to_owned();

    // ADD: the agent allocated the first address of the range for this
    // container's eth0, and podman and the container see it.
    assert_eq!(
        lan.allocations(),
        vec![(container.clone(), "eth0".into(), FIRST_ADDRESS.into())]
    );
    assert_eq!(lan.records(), 1);
    let inspected = podman.run(&[
        "inspect",
        &name,
        "--format",
        &format!("{{{{(index .NetworkSettings.Networks \"{NETWORK}\").IPAddress}}}}"),
    ]);
    assert_eq!(inspected.trim(), FIRST_ADDRESS);
    let addresses = podman.run(&[
        "exec", &name, "ip", "-o", "-4", "addr", "show", "dev", "eth0",
    ]);
    assert!(
        addresses.contains(&format!("inet {FIRST_ADDRESS}/24")),
        "eth0 in the container: {addresses}"
    );

    // Traffic to the LAN host: ICMP, then a TCP exchange.
    podman.run(&["exec", &name, "ping", "-c", "1", "-W", "5", LAN_HOST]);
    let server = lan.serve_one_tcp_exchange();
    let reply = podman.run(&[
        "exec",
        &name,
        "sh",
        "-c",
        &format!("echo hello-from-podman | nc {LAN_HOST} {TCP_PORT}"),
    ]);
    assert_eq!(reply.trim(), "pong hello-from-podman");
    assert_eq!(server.join().unwrap(), FIRST_ADDRESS, "TCP peer address");

    // DEL: removing the container releases the address and the record.
    podman.run(&["rm", "--force", "--time", "0", &name]);
    // DEL answers first; the record and the address go right after.
    support::wait_until("the agent never finished the DEL", || lan.records() == 0);
    assert_eq!(lan.allocations(), vec![]);
    assert_eq!(lan.records(), 0);
}

#[test]
fn a_dynamically_linked_elf_is_recognised() {
    // The test binary itself asks for the dynamic loader.
    let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
    assert!(is_dynamically_linked(&me));
    assert!(!is_dynamically_linked(b"#!/bin/sh\n"));
}
