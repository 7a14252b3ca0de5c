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
    /// Starts the agent with its files under `dir` and [`bench_state`].
    pub(super) fn start(
        binaries: &ReleaseBinaries,
        dir: &Path,
        node: &Netns,
        pin: &PinRoot,
    ) -> anyhow::Result<Self> {
        std::fs::write(dir.join("state.yaml"), bench_state(""))?;
        let arg = |p: &str| dir.join(p).display().to_string();
        let admin = free_local_address()?;
        let child = Command::new(&binaries.agent)
            .args(["run", "--standalone"])
            .args(["--state-file", &arg("state.yaml")])
            .args(["--state-dir", &arg("state")])
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
            // The reference plugin has no conflict probe; see the notes.
            .args(["--conflict-probe-ms", "0"])
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
    let (node, _lan) = node_and_lan("fb")?;

    let dir = tempfile_dir("flatnet-bench-cni")?;
    let pin = PinRoot::new("bench-cni");
    let agent = Agent::start(&binaries, &dir, &node, &pin)?;
    let plugins = plugins(&agent, &node);
    if !plugins[1].binary.exists() {
        bail!("{} is missing", plugins[1].binary.display());
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
            phases_before = Some(phases::scrape(agent.admin)?);
        }
        // Alternate who goes first, so neither always runs right after the other.
        let order: [usize; 2] = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for p in order {
            let pod = pods(i..i + 1)?;
            let version = plugins[p].exec_config(
                "VERSION",
                i,
                &pod[0].path(),
                json!({"cniVersion": "1.0.0"}),
            )?;
            let add = plugins[p].exec("ADD", i, &pod[0].path())?;
            let del = plugins[p].exec("DEL", i, &pod[0].path())?;
            if i >= WARM_UP {
                results[p].add.push(add);
                results[p].del.push(del);
                results[p].version.push(version);
            }
        }
    }
    let phases = phases::Breakdown::between(
        &phases_before.expect("scraped after the warm-up"),
        &phases::scrape(agent.admin)?,
    );
    if !args.quick {
        for (plugin, measured) in plugins.iter().zip(&mut results) {
            let pods = pods(0..args.parallel_adds)?;
            let paths: Vec<PathBuf> = pods.iter().map(Netns::path).collect();
            measured.adds_per_second = parallel_rate(plugin, "ADD", &paths, args.parallel)?;
            measured.dels_per_second = parallel_rate(plugin, "DEL", &paths, args.parallel)?;
        }
    }
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
    for m in &mut results {
        m.add.sort();
        m.del.sort();
        m.version.sort();
    }

    let ratios = Ratios::of(&results[0], &results[1]);
    let breakdown = phases.table(&results[0]);
    if args.quick {
        print!("{}", latency_table(&plugins, &results));
        print!("{breakdown}");
        println!("{ratios}");
        return ratios.guard();
    }
    let table = table(&plugins, &results, args.parallel);
    print!("{table}");
    print!("{breakdown}");
    println!("{ratios}");
    if args.no_write {
        return Ok(());
    }
    let section = format!(
        "## CNI ADD and DEL: flatnet vs the reference macvlan plugin\n\n\
         Command: `cargo xtask bench cni` (root; installs Debian's\n\
         `containernetworking-plugins` {} for the reference).\n\
         {}.\n\n\
         Each ADD and DEL is one execution of the plugin binary, timed from spawn\n\
         to exit as a runtime sees it, with cniVersion 1.0.0, IPv4, a fresh pod\n\
         namespace per ADD, and the same master for both plugins: a veth in a\n\
         node namespace whose peer is a LAN namespace. flatnet is\n\
         `flatnet-agent run --standalone` (allocating from its state file) with\n\
         the `flatnet-cni` it installed, both the static musl release builds\n\
         the images carry; the reference is `macvlan` (bridge\n\
         mode) with `static` IPAM, run inside the node namespace. The two run\n\
         interleaved in one process: {iterations} sequential ADD+DEL pairs each (after {WARM_UP}\n\
         unmeasured), then {} ADDs and as many DELs with {} at a time.\n\
         The agent runs with `--conflict-probe-ms 0`: the reference has no\n\
         conflict probe, and the probe's default 500 ms of listening for an\n\
         answer would be added to every flatnet ADD.\n\n{table}\n{ratios}\n\n\
         ### Where flatnet's ADD and DEL spend their time\n\n\
         Mean wall time per phase over the sequential pairs, from the agent's\n\
         `flatnet_agent_cni_phase_seconds` histograms scraped before and after\n\
         them in the same run. `total` is the agent's handler; nested phases\n\
         (`attach.*`, `detach.*`) are part of `link_attach` and `link_detach`.\n\
         VERSION is the plugin binary starting and exiting with no work.\n\n{breakdown}",
        package_version("containernetworking-plugins"),
        machine,
        args.parallel_adds,
        args.parallel,
    );
    report::write_section("cni", &section)
}

/// flatnet (through the agent) and the reference, on the same master.
fn plugins(agent: &Agent, node: &Netns) -> [Plugin; 2] {
    let socket = agent.socket.clone();
    [
        Plugin {
            label: "flatnet (agent + flatnet-cni)",
            binary: agent.installed_cni.clone(),
            netns: None,
            config: Box::new(move |_| {
                json!({"cniVersion": "1.0.0", "name": "flatnet-bench", "type": "flatnet-cni",
                       "agentSocket": socket})
            }),
        },
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

/// flatnet's p50s over the reference's, from one run.
struct Ratios {
    add: f64,
    del: f64,
}

impl Ratios {
    fn of(flatnet: &Measured, reference: &Measured) -> Self {
        let ratio = |a: &[Duration], b: &[Duration]| {
            percentile(a, 0.5).as_secs_f64() / percentile(b, 0.5).as_secs_f64()
        };
        Self {
            add: ratio(&flatnet.add, &reference.add),
            del: ratio(&flatnet.del, &reference.del),
        }
    }

    /// Fails when either p50 is more than [`QUICK_GUARD_RATIO`] times the
    /// reference's.
    fn guard(&self) -> anyhow::Result<()> {
        if self.add > QUICK_GUARD_RATIO || self.del > QUICK_GUARD_RATIO {
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
        write!(
            f,
            "flatnet / reference, same run: ADD p50 {:.2}x, DEL p50 {:.2}x",
            self.add, self.del
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
                        // Offset the indexes so they never meet the sequential ones.
                        plugin.exec(command, 10_000 + i, pod)?;
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
