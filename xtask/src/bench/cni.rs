//! `cargo xtask bench cni`: what a container runtime waits for. Each ADD
//! and DEL is one execution of the plugin binary, timed from spawn to exit,
//! exactly as a runtime runs it.
//!
//! flatnet (`flatnet-agent run --standalone` and the `flatnet-cni` it
//! installs, the images' static release builds) and Debian's reference
//! `macvlan` plugin with `static` IPAM run in the same process,
//! interleaved, on the same master (a veth in a node namespace whose peer
//! is a LAN namespace), IPv4, a fresh pod namespace per ADD.

use std::{
    io::Write,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};

mod floor;
mod kubernetes;
mod phases;

use super::{
    Netns, PinRoot, ReleaseBinaries, apt_install, build_release_binaries, command_in_netns,
    machine, package_version, percentile, report,
};

/// Options of `cargo xtask bench cni`.
#[derive(Args)]
pub struct CniArgs {
    /// Sequential ADD+DEL pairs per plugin (after a few unmeasured ones).
    #[arg(long, default_value_t = 200)]
    iterations: usize,
    /// ADDs (then as many DELs) per plugin in the parallel phase.
    #[arg(long, default_value_t = 200)]
    parallel_adds: usize,
    /// Plugin executions at a time in the parallel phase.
    #[arg(long, default_value_t = 4)]
    parallel: usize,
    /// Print the table only; leave docs/benchmarks.md alone.
    #[arg(long)]
    no_write: bool,
    /// The regression guard CI runs: 50 interleaved ADD+DEL per plugin, no
    /// parallel phase, nothing written; fails when flatnet's ADD or DEL
    /// p50 is more than twice the reference's in the same run.
    #[arg(long)]
    quick: bool,
    /// The Kubernetes-mode ADD against the standalone ADD, through the
    /// agent's CNI service and the operator's in-memory API server, instead.
    #[arg(long, conflicts_with = "quick")]
    kubernetes: bool,
}

impl CniArgs {
    /// `--quick`, as `cargo xtask test` runs it.
    pub fn quick() -> Self {
        Self {
            iterations: QUICK_ITERATIONS,
            parallel_adds: 1,
            parallel: 1,
            no_write: true,
            quick: true,
            kubernetes: false,
        }
    }
}

/// `--quick`: sequential pairs per plugin.
const QUICK_ITERATIONS: usize = 50;
/// `--quick` fails when flatnet's p50 exceeds the reference's by this factor.
const QUICK_GUARD_RATIO: f64 = 2.0;

const REFERENCE_DIR: &str = "/usr/lib/cni";
pub(super) const MASTER: &str = "bench0";
const WARM_UP: usize = 5;
/// Both plugins allocate from 198.18.0.0/15 (RFC 2544, benchmarking):
/// flatnet from 198.18.1.0-198.18.7.255, the reference gets 198.18.8.0 + i.
pub(super) const PREFIX_LEN: u8 = 15;

/// One plugin under test: how to run it and its network configuration.
struct Plugin {
    label: &'static str,
    binary: PathBuf,
    /// Namespace the plugin process runs in (the reference looks the
    /// master up in its own namespace; flatnet-cni only talks to the agent).
    netns: Option<PathBuf>,
    config: Box<dyn Fn(usize) -> Value + Sync>,
}

#[derive(Default)]
struct Measured {
    add: Vec<Duration>,
    del: Vec<Duration>,
    /// VERSION: the plugin's start-up and exit, no work.
    version: Vec<Duration>,
    adds_per_second: f64,
    dels_per_second: f64,
}

impl Plugin {
    /// Runs one CNI command for attachment `index` in `pod`; returns its duration.
    fn exec(&self, command: &str, index: usize, pod: &Path) -> anyhow::Result<Duration> {
        self.exec_config(command, index, pod, (self.config)(index))
    }

    /// Runs one CNI command with `config` on stdin; returns its duration.
    fn exec_config(
        &self,
        command: &str,
        index: usize,
        pod: &Path,
        config: Value,
    ) -> anyhow::Result<Duration> {
        let mut cmd = match &self.netns {
            Some(netns) => command_in_netns(&self.binary, netns)?,
            None => Command::new(&self.binary),
        };
        cmd.env_clear()
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", format!("bench{index:06}"))
            .env("CNI_NETNS", pod)
            .env("CNI_IFNAME", "eth0")
            // As kubelet passes them, to every plugin.
            .env(
                "CNI_ARGS",
                format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod-{index};\
                     K8S_POD_UID=uid-{index}"
                ),
            )
            .env("CNI_PATH", REFERENCE_DIR)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let config = config.to_string();
        let started = Instant::now();
        let mut child = cmd
            .spawn()
            .with_context(|| format!("run {}", self.binary.display()))?;
        // A plugin may exit without reading (the reference on VERSION).
        match child
            .stdin
            .take()
            .expect("piped")
            .write_all(config.as_bytes())
        {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => return Err(e.into()),
            _ => {}
        }
        let out = child.wait_with_output()?;
        let elapsed = started.elapsed();
        if !out.status.success() {
            bail!(
                "{} {command} {index} failed ({}): {}{}",
                self.label,
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(elapsed)
    }
}

/// Pod namespaces for attachments `range`, created before timing starts.
fn pods(range: std::ops::Range<usize>) -> anyhow::Result<Vec<Netns>> {
    range
        .map(|i| Netns::new(format!("fbpod-{}-{i}", std::process::id() % 100_000)))
        .collect()
}

/// The flatnet agent, running until dropped.
pub(super) struct Agent {
    child: Child,
    socket: PathBuf,
    installed_cni: PathBuf,
    /// `/metrics` and friends (the phase histograms).
    admin: SocketAddr,
}

/// A node namespace `<prefix>node-<pid>` whose [`MASTER`] is a veth to
/// `lan0` in a LAN namespace `<prefix>lan-<pid>`, both up.
pub(super) fn node_and_lan(prefix: &str) -> anyhow::Result<(Netns, Netns)> {
    let pid = std::process::id() % 100_000;
    let node = Netns::new(format!("{prefix}node-{pid}"))?;
    let lan = Netns::new(format!("{prefix}lan-{pid}"))?;
    super::sh(
        "ip",
        &[
            "link", "add", MASTER, "netns", &node.name, "type", "veth", "peer", "name", "lan0",
            "netns", &lan.name,
        ],
    )?;
    node.ip(&["link", "set", MASTER, "up"])?;
    lan.ip(&["link", "set", "lan0", "up"])?;
    Ok((node, lan))
}

/// The benchmark's state file: subnet `bench` on [`MASTER`], network
/// `flatnet-bench`, then `extra` (more sections).
pub(super) fn bench_state(extra: &str) -> String {
    format!(
        "subnets:\n  - name: bench\n    spec:\n      flatMode: macvlan\n      master: {MASTER}\n      \
         cidr: 198.18.0.0/{PREFIX_LEN}\n      ranges: [{{from: 198.18.1.0, to: 198.18.7.255}}]\n\
         networks:\n  - {{name: flatnet-bench, subnets: [bench]}}\n{extra}"
    )
}

impl Agent {
    /// Starts the standalone agent with its files under `dir`, the state
    /// file [`bench_state`] and the conflict probe off.
    pub(super) fn start(
        binaries: &ReleaseBinaries,
        dir: &Path,
        node: &Netns,
        pin: &PinRoot,
    ) -> anyhow::Result<Self> {
        std::fs::write(dir.join("state.yaml"), bench_state(""))?;
        let arg = |p: &str| dir.join(p).display().to_string();
        Self::spawn(binaries, dir, node, pin, |command| {
            command
                .args(["run", "--standalone"])
                .args(["--state-file", &arg("state.yaml")])
                .args(["--state-dir", &arg("state")])
                // The reference plugin has no conflict probe; see the notes.
                .args(["--conflict-probe-ms", "0"]);
        })
    }

    /// Starts the agent as the chart runs it (Kubernetes mode, every
    /// setting the chart's default: the conflict probe on, policies
    /// enforced) against the API server of `kubeconfig`, as node
    /// `bench-node`.
    fn start_kubernetes(
        binaries: &ReleaseBinaries,
        dir: &Path,
        node: &Netns,
        pin: &PinRoot,
        kubeconfig: &Path,
    ) -> anyhow::Result<Self> {
        Self::spawn(binaries, dir, node, pin, |command| {
            command
                .arg("run")
                .env("KUBECONFIG", kubeconfig)
                .env("NODE_NAME", BENCH_NODE);
        })
    }

    /// Starts `flatnet-agent` with `mode`'s arguments (the command first)
    /// and its files under `dir`, and waits until it answers STATUS.
    fn spawn(
        binaries: &ReleaseBinaries,
        dir: &Path,
        node: &Netns,
        pin: &PinRoot,
        mode: impl FnOnce(&mut Command),
    ) -> anyhow::Result<Self> {
        let arg = |p: &str| dir.join(p).display().to_string();
        let admin = free_local_address()?;
        let mut command = Command::new(&binaries.agent);
        mode(&mut command);
        let child = command
            .args(["--record-dir", &arg("records")])
            .args(["--lease-dir", &arg("leases")])
            .args(["--socket", &arg("agent.sock")])
            .args(["--cni-bin-dir", &arg("bin")])
            .arg("--cni-binary")
            .arg(&binaries.cni)
            .arg("--pin-root")
            .arg(&pin.0)
            .arg("--host-netns")
            .arg(node.path())
            .args(["--admin-address", &admin.to_string()])
            .stdin(Stdio::null())
            .stderr(std::fs::File::create(dir.join("agent.log"))?)
            .spawn()
            .context("start flatnet-agent")?;
        let mut agent = Self {
            child,
            socket: dir.join("agent.sock"),
            installed_cni: dir.join("bin/flatnet-cni"),
            admin,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while !agent.ready() {
            if let Some(status) = agent.child.try_wait()? {
                bail!(
                    "flatnet-agent exited ({status}); its log is {}",
                    dir.join("agent.log").display()
                );
            }
            if Instant::now() > deadline {
                bail!("flatnet-agent did not answer STATUS within 60 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(agent)
    }

    fn ready(&self) -> bool {
        let Ok(mut child) = Command::new(&self.installed_cni)
            .env_clear()
            .env("CNI_COMMAND", "STATUS")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
        else {
            return false;
        };
        let config = json!({"cniVersion": "1.1.0", "name": "flatnet-bench",
                            "type": "flatnet-cni", "agentSocket": self.socket});
        let _ = child
            .stdin
            .take()
            .expect("piped")
            .write_all(config.to_string().as_bytes());
        child.wait().is_ok_and(|s| s.success())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The node the Kubernetes-mode agent reports as.
const BENCH_NODE: &str = "bench-node";
/// The master of the Kubernetes-mode agent, and its LAN peer (the LAN
/// host, 198.18.0.1, the subnet's gateway, answers the conflict probe's
/// reference request).
const KUBERNETES_MASTER: &str = "bench1";
const KUBERNETES_LAN: &str = "lan1";
/// Time between the operator's allocation and the ADD: kubelet creates the
/// pod's sandbox (and calls CNI) well after the pod is scheduled, which is
/// when the operator allocates; the agent's watch has the allocation and
/// the pod by then.
const SETTLE: Duration = Duration::from_millis(50);

/// The operator's in-memory API server with its allocation controllers
/// (`flatnet-agent/examples/bench_cluster.rs`), driven line by line.
struct BenchCluster {
    child: Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
    kubeconfig: PathBuf,
}

impl BenchCluster {
    /// Builds and starts the example (`optimized`: a release build, as a
    /// real API server is; else the debug build the tests share); its
    /// subnet is on `master`, pods get `first`..=`last`; its files go to
    /// `dir`.
    fn start(
        master: &str,
        (first, last): (&str, &str),
        dir: &Path,
        optimized: bool,
    ) -> anyhow::Result<Self> {
        let mut cargo = crate::workspace::cargo(None);
        cargo.args([
            "build",
            "-q",
            "-p",
            "flatnet-agent",
            "--example",
            "bench_cluster",
        ]);
        if optimized {
            cargo.arg("--release");
        }
        crate::workspace::run("build the benchmark's API server", &mut cargo)?;
        let profile = if optimized { "release" } else { "debug" };
        let binary = crate::workspace::root()
            .join("target")
            .join(profile)
            .join("examples/bench_cluster");
        let mut child = Command::new(&binary)
            .args(["--master", master, "--first", first, "--last", last])
            .arg("--dir")
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(dir.join("bench-cluster.log"))?)
            .spawn()
            .with_context(|| format!("start {}", binary.display()))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = std::io::BufReader::new(child.stdout.take().expect("piped"));
        let mut cluster = Self {
            child,
            stdin,
            stdout,
            kubeconfig: PathBuf::new(),
        };
        let first_line = cluster.line()?;
        let Some(kubeconfig) = first_line.strip_prefix("kubeconfig ") else {
            bail!("bench_cluster said {first_line:?}, not its kubeconfig");
        };
        cluster.kubeconfig = PathBuf::from(kubeconfig);
        let ready = cluster.line()?;
        if ready != "ready" {
            bail!("bench_cluster said {ready:?}, not ready");
        }
        Ok(cluster)
    }

    fn line(&mut self) -> anyhow::Result<String> {
        use std::io::BufRead as _;
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("bench_cluster exited; see its log");
        }
        Ok(line.trim_end().to_owned())
    }

    /// `create`, `active` or `delete` for pods `range`; waits for `done`.
    fn command(&mut self, command: &str, range: std::ops::Range<usize>) -> anyhow::Result<()> {
        writeln!(self.stdin, "{command} {} {}", range.start, range.end)?;
        self.stdin.flush()?;
        match self.line()?.as_str() {
            "done" => Ok(()),
            other => bail!("bench_cluster {command} {range:?}: {other}"),
        }
    }
}

impl Drop for BenchCluster {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The plugins of a run, in the order of [`plugins`].
const DEFAULT: usize = 0;
const PROBE_OFF: usize = 1;
const REFERENCE: usize = 2;

/// Container and pod indexes of the parallel phase: never the sequential ones.
const PARALLEL_INDEXES: usize = 10_000;

/// Runs the benchmark and writes its section (`--quick`: checks the
/// ratios instead).
pub fn run(args: &CniArgs) -> anyhow::Result<()> {
    if args.kubernetes {
        return kubernetes::run(!args.no_write);
    }
    let iterations = if args.quick {
        QUICK_ITERATIONS
    } else {
        args.iterations
    };
    if iterations == 0 || args.parallel_adds == 0 || args.parallel == 0 {
        bail!("--iterations, --parallel-adds and --parallel must be at least 1");
    }
    if args.parallel_adds > 1792 {
        bail!("--parallel-adds is at most 1792 (the addresses of the benchmark range)");
    }
    apt_install(&["containernetworking-plugins"])?;
    let binaries = build_release_binaries()?;
    let machine = machine();

    // The LAN namespace lives as long as the run (dropping it deletes it).
    let (node, lan) = node_and_lan("fb")?;
    super::sh(
        "ip",
        &[
            "link",
            "add",
            KUBERNETES_MASTER,
            "netns",
            &node.name,
            "type",
            "veth",
            "peer",
            "name",
            KUBERNETES_LAN,
            "netns",
            &lan.name,
        ],
    )?;
    node.ip(&["link", "set", KUBERNETES_MASTER, "up"])?;
    lan.ip(&[
        "addr",
        "add",
        &format!("198.18.0.1/{PREFIX_LEN}"),
        "dev",
        KUBERNETES_LAN,
    ])?;
    lan.ip(&["link", "set", KUBERNETES_LAN, "up"])?;

    let dir = tempfile_dir("flatnet-bench-cni")?;
    let standalone_dir = dir.join("standalone");
    let kubernetes_dir = dir.join("kubernetes");
    std::fs::create_dir_all(&standalone_dir)?;
    std::fs::create_dir_all(&kubernetes_dir)?;
    let floor_binary = floor::empty_binary(&dir)?;
    let mut floor_execs = Vec::new();
    let mut cluster = BenchCluster::start(
        KUBERNETES_MASTER,
        ("198.18.16.0", "198.18.23.255"),
        &kubernetes_dir,
        !args.quick,
    )?;
    let pins = [PinRoot::new("bench-cni-k8s"), PinRoot::new("bench-cni")];
    let installed = Agent::start_kubernetes(
        &binaries,
        &kubernetes_dir,
        &node,
        &pins[0],
        &cluster.kubeconfig,
    )?;
    let probe_off = Agent::start(&binaries, &standalone_dir, &node, &pins[1])?;
    let plugins = plugins(&installed, &probe_off, &node);
    if !plugins[REFERENCE].binary.exists() {
        bail!("{} is missing", plugins[REFERENCE].binary.display());
    }

    let mut results: Vec<Measured> = plugins.iter().map(|_| Measured::default()).collect();
    println!(
        "==> bench cni: {iterations} sequential ADD+DEL per plugin (interleaved){}",
        if args.quick {
            String::new()
        } else {
            format!(
                ", then {} ADDs and DELs {} at a time",
                args.parallel_adds, args.parallel
            )
        }
    );
    let mut phases_before = None;
    for i in 0..WARM_UP + iterations {
        if i == WARM_UP {
            phases_before = Some(phases::scrape(installed.admin)?);
        }
        let floor_exec = floor::exec(&floor_binary)?;
        if i >= WARM_UP {
            floor_execs.push(floor_exec);
        }
        // A different plugin goes first each time.
        for step in 0..plugins.len() {
            let p = (i + step) % plugins.len();
            let pod = pods(i..i + 1)?;
            let version = plugins[p].exec_config(
                "VERSION",
                i,
                &pod[0].path(),
                json!({"cniVersion": "1.0.0"}),
            )?;
            if p == DEFAULT {
                cluster.command("create", i..i + 1)?;
                std::thread::sleep(SETTLE);
            }
            let add = plugins[p].exec("ADD", i, &pod[0].path())?;
            if p == DEFAULT {
                // The Active status follows the answer; a DEL would stop it.
                cluster.command("active", i..i + 1)?;
            }
            let del = plugins[p].exec("DEL", i, &pod[0].path())?;
            if p == DEFAULT {
                cluster.command("delete", i..i + 1)?;
            }
            if i >= WARM_UP {
                results[p].add.push(add);
                results[p].del.push(del);
                results[p].version.push(version);
            }
        }
    }
    let phases = phases::Breakdown::between(
        &phases_before.expect("scraped after the warm-up"),
        &phases::scrape(installed.admin)?,
    );
    let netlink = floor::netlink_round_trips(1000)?;
    // The installed row's phases while its ADDs overlap (full run only).
    let mut parallel_breakdown = None;
    if !args.quick {
        for (p, (plugin, measured)) in plugins.iter().zip(&mut results).enumerate() {
            let pods = pods(0..args.parallel_adds)?;
            let paths: Vec<PathBuf> = pods.iter().map(Netns::path).collect();
            let indexes = PARALLEL_INDEXES..PARALLEL_INDEXES + args.parallel_adds;
            let before = if p == DEFAULT {
                cluster.command("create", indexes.clone())?;
                std::thread::sleep(SETTLE);
                Some(phases::scrape(installed.admin)?)
            } else {
                None
            };
            measured.adds_per_second = parallel_rate(plugin, "ADD", &paths, args.parallel)?;
            if let Some(before) = before {
                parallel_breakdown = Some(
                    phases::Breakdown::between(&before, &phases::scrape(installed.admin)?)
                        .table(None),
                );
                cluster.command("active", indexes.clone())?;
            }
            measured.dels_per_second = parallel_rate(plugin, "DEL", &paths, args.parallel)?;
            if p == DEFAULT {
                cluster.command("delete", indexes)?;
            }
        }
    }
    drop((installed, probe_off, cluster));
    let _ = std::fs::remove_dir_all(&dir);
    for m in &mut results {
        m.add.sort();
        m.del.sort();
        m.version.sort();
    }

    floor_execs.sort();
    let ratios = Ratios::of(&results);
    let breakdown = phases.table(Some(&results[DEFAULT]));
    let start_floor = percentile(&floor_execs, 0.5);
    let of_floor = |m: &Measured| percentile(&m.add, 0.5).as_secs_f64() / start_floor.as_secs_f64();
    let floor = format!(
        "Floor, same run: a static binary that only starts and exits, p50 {} \
         (ADD p50 of flatnet as installed: {:.1}x that; standalone, probe off: {:.1}x; \
         the reference: {:.1}x); one netlink round trip (RTM_GETLINK), p50 {:.0} µs.",
        ms(start_floor),
        of_floor(&results[DEFAULT]),
        of_floor(&results[PROBE_OFF]),
        of_floor(&results[REFERENCE]),
        percentile(&netlink, 0.5).as_secs_f64() * 1e6,
    );
    if args.quick {
        print!("{}", latency_table(&plugins, &results));
        print!("{breakdown}");
        println!("{ratios}\n{floor}");
        return ratios.guard();
    }
    let table = table(&plugins, &results, args.parallel);
    let parallel_breakdown = parallel_breakdown.unwrap_or_default();
    print!("{table}");
    print!("{breakdown}");
    print!("{parallel_breakdown}");
    println!("{ratios}\n{floor}");
    if args.no_write {
        return Ok(());
    }
    let section = format!(
        "## CNI ADD and DEL: flatnet as installed vs the reference macvlan plugin\n\n\
         Command: `cargo xtask bench cni` (root; installs Debian's\n\
         `containernetworking-plugins` {} for the reference).\n\
         {}.\n\n\
         Each ADD and DEL is one execution of the plugin binary, timed from spawn\n\
         to exit as a runtime sees it, with cniVersion 1.0.0, IPv4, the\n\
         `CNI_ARGS` kubelet passes, and a fresh pod namespace per ADD. Three\n\
         plugins run interleaved in one process, on masters that are veths in\n\
         one node namespace whose peers are in a LAN namespace:\n\n\
         - **flatnet as installed** (the headline): `flatnet-agent run` with\n\
           every setting the chart's default, in Kubernetes mode against the\n\
           operator's in-memory API server over HTTP with the operator's\n\
           allocation controllers (`flatnet-agent/examples/bench_cluster.rs`,\n\
           a release build on the same 2 CPUs; a real API server runs on other\n\
           machines; `--quick` runs its debug build).\n\
           The conflict probe is on (window 500 ms; the LAN host is the\n\
           subnet's gateway and answers its reference request), policies are\n\
           enforced and a MultiNetworkPolicy denying ingress is in force on\n\
           the pods' namespace, the agent follows the allocations. Before each\n\
           ADD the Pod exists, bound to the node, the operator has allocated\n\
           its FlatNetworkIP, and {} ms pass (kubelet calls CNI well after\n\
           scheduling); after the ADD its Active status is waited for, and\n\
           after the DEL the Pod is deleted (untimed).\n\
         - **flatnet standalone, probe off**: `flatnet-agent run --standalone`\n\
           (allocating from its state file) with `--conflict-probe-ms 0` and\n\
           no policy.\n\
         - **the reference**: `macvlan` (bridge mode) with `static` IPAM, run\n\
           inside the node namespace; it has no conflict check and no policy.\n\n\
         flatnet runs the static musl release builds the images carry. {iterations}\n\
         sequential ADD+DEL pairs each (after {WARM_UP} unmeasured), then {} ADDs\n\
         and as many DELs with {} at a time.\n\n{table}\n{ratios}\n\n{floor}\n\n\
         ### Where flatnet's ADD and DEL spend their time, as installed\n\n\
         Mean wall time per phase over the sequential pairs of the first row,\n\
         from the agent's `flatnet_agent_cni_phase_seconds` histograms scraped\n\
         before and after them in the same run. `total` is the agent's handler;\n\
         nested phases (`attach.*`, `detach.*`) are part of `link_attach` and\n\
         `link_detach`; `attach.probe_verdict` is what is left of the conflict\n\
         probe's wait when the interface is ready to come up. VERSION is the\n\
         plugin binary starting and exiting with no work.\n\n{breakdown}\n\
         The same, over the {} ADDs of the first row made {} at a time (each\n\
         phase's wall time includes its waits for the others: the CPUs, the\n\
         kernel's RTNL lock):\n\n{parallel_breakdown}",
        package_version("containernetworking-plugins"),
        machine,
        SETTLE.as_millis(),
        args.parallel_adds,
        args.parallel,
        args.parallel_adds,
        args.parallel,
    );
    report::write_section("cni", &section)
}

/// flatnet as installed, flatnet standalone with the probe off, and the
/// reference, in the order [`DEFAULT`], [`PROBE_OFF`], [`REFERENCE`].
fn plugins(installed: &Agent, probe_off: &Agent, node: &Netns) -> [Plugin; 3] {
    let flatnet = |label, agent: &Agent| {
        let socket = agent.socket.clone();
        Plugin {
            label,
            binary: agent.installed_cni.clone(),
            netns: None,
            config: Box::new(move |_| {
                json!({"cniVersion": "1.0.0", "name": "flatnet-bench", "type": "flatnet-cni",
                       "agentSocket": socket})
            }),
        }
    };
    [
        flatnet(
            "flatnet as installed (chart defaults: probe on, policy in force, Kubernetes mode)",
            installed,
        ),
        flatnet("flatnet standalone, probe off, no policy", probe_off),
        Plugin {
            label: "reference macvlan + static IPAM",
            binary: Path::new(REFERENCE_DIR).join("macvlan"),
            netns: Some(node.path()),
            config: Box::new(|i| {
                let address = format!("198.18.{}.{}/{PREFIX_LEN}", 8 + i / 256, i % 256);
                json!({"cniVersion": "1.0.0", "name": "reference-bench", "type": "macvlan",
                       "master": MASTER, "mode": "bridge",
                       "ipam": {"type": "static", "addresses": [{"address": address}]}})
            }),
        },
    ]
}

/// flatnet's p50s over the reference's, from one run: as installed
/// (the headline) and standalone with the probe off.
struct Ratios {
    installed: (f64, f64),
    probe_off: (f64, f64),
    /// ADDs per second over the reference's, in parallel (0 in `--quick`).
    installed_rate: f64,
    probe_off_rate: f64,
}

impl Ratios {
    fn of(results: &[Measured]) -> Self {
        let p50 = |a: &[Duration], b: &[Duration]| {
            percentile(a, 0.5).as_secs_f64() / percentile(b, 0.5).as_secs_f64()
        };
        let reference = &results[REFERENCE];
        let of = |m: &Measured| (p50(&m.add, &reference.add), p50(&m.del, &reference.del));
        let rate = |m: &Measured| {
            if reference.adds_per_second > 0.0 {
                m.adds_per_second / reference.adds_per_second
            } else {
                0.0
            }
        };
        Self {
            installed: of(&results[DEFAULT]),
            probe_off: of(&results[PROBE_OFF]),
            installed_rate: rate(&results[DEFAULT]),
            probe_off_rate: rate(&results[PROBE_OFF]),
        }
    }

    /// Fails when an ADD or DEL p50 of flatnet as installed is more than
    /// [`QUICK_GUARD_RATIO`] times the reference's.
    fn guard(&self) -> anyhow::Result<()> {
        let (add, del) = self.installed;
        if add > QUICK_GUARD_RATIO || del > QUICK_GUARD_RATIO {
            bail!(
                "flatnet's CNI latency regressed: {self}; the guard is {QUICK_GUARD_RATIO}x \
                 (run `cargo xtask bench cni` for the phase breakdown)"
            );
        }
        println!("<== bench cni --quick: within {QUICK_GUARD_RATIO}x of the reference");
        Ok(())
    }
}

impl std::fmt::Display for Ratios {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rate = |r: f64| {
            if r > 0.0 {
                format!(", parallel ADD rate {r:.2}x")
            } else {
                String::new()
            }
        };
        write!(
            f,
            "flatnet / reference, same run: as installed ADD p50 {:.2}x, DEL p50 {:.2}x{}; \
             standalone, probe off: ADD p50 {:.2}x, DEL p50 {:.2}x{}",
            self.installed.0,
            self.installed.1,
            rate(self.installed_rate),
            self.probe_off.0,
            self.probe_off.1,
            rate(self.probe_off_rate),
        )
    }
}

/// Runs `command` for every pod with `parallel` executions at a time;
/// returns completed commands per second.
fn parallel_rate(
    plugin: &Plugin,
    command: &str,
    pods: &[PathBuf],
    parallel: usize,
) -> anyhow::Result<f64> {
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..parallel)
            .map(|_| {
                scope.spawn(|| -> anyhow::Result<()> {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(pod) = pods.get(i) else {
                            return Ok(());
                        };
                        plugin.exec(command, PARALLEL_INDEXES + i, pod)?;
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("worker panicked"))
    })?;
    Ok(pods.len() as f64 / started.elapsed().as_secs_f64())
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// The full table (sorted samples).
fn table(plugins: &[Plugin], results: &[Measured], parallel: usize) -> String {
    let mut out = format!(
        "| plugin | ADD p50 | ADD p99 | DEL p50 | DEL p99 | VERSION p50 | ADD/s ({parallel} parallel) | DEL/s ({parallel} parallel) |\n\
         | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n"
    );
    for (plugin, m) in plugins.iter().zip(results) {
        out += &format!(
            "| {} | {} | {:.0} | {:.0} |\n",
            plugin.label,
            latency_cells(m),
            m.adds_per_second,
            m.dels_per_second,
        );
    }
    out
}

/// The sequential latencies only (`--quick`).
fn latency_table(plugins: &[Plugin], results: &[Measured]) -> String {
    let mut out = "| plugin | ADD p50 | ADD p99 | DEL p50 | DEL p99 | VERSION p50 |\n\
                   | --- | ---: | ---: | ---: | ---: | ---: |\n"
        .to_owned();
    for (plugin, m) in plugins.iter().zip(results) {
        out += &format!("| {} | {} |\n", plugin.label, latency_cells(m));
    }
    out
}

/// ADD p50/p99, DEL p50/p99 and VERSION p50 as table cells.
fn latency_cells(m: &Measured) -> String {
    format!(
        "{} | {} | {} | {} | {}",
        ms(percentile(&m.add, 0.5)),
        ms(percentile(&m.add, 0.99)),
        ms(percentile(&m.del, 0.5)),
        ms(percentile(&m.del, 0.99)),
        ms(percentile(&m.version, 0.5)),
    )
}

/// A local TCP address nobody listens on (for the agent's admin server).
fn free_local_address() -> anyhow::Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?)
}

/// A fresh directory under the system's temporary directory.
pub(super) fn tempfile_dir(prefix: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
