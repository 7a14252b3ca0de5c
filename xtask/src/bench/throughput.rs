//! `cargo xtask bench throughput`: single-stream TCP throughput (iperf3)
//! with the eBPF programs attached against no programs, in the same run.
//!
//! Two macvlan pods (bridge mode) on one master, a veth in a node namespace
//! whose peer is a LAN host. Two paths: pod to pod (macvlan bridging inside
//! the node) and pod to LAN host (through the master). "Programs" means the
//! uplink program on the master and the policy programs on both pod
//! interfaces, with a policy that isolates both pods and allows the iperf3
//! port, so every packet is judged by the policy (the first of each flow in
//! full, the others through connection tracking). The programs are measured
//! attached both ways the agent attaches them: netlink (clsact filters) and,
//! on Linux 6.6 and later, TCX links.

use std::{
    path::Path,
    process::{Child, Stdio},
    time::Duration,
};

use anyhow::{Context, bail};
use clap::Args;
use serde_json::{Value, json};

use super::{
    Netns, PinRoot, apt_install, build_release_binaries, machine, median, package_version,
    percentile,
    program_cost::{self, AttachedProgram, ProgramCost},
    report, sh,
};

/// Options of `cargo xtask bench throughput`.
#[derive(Args)]
pub struct ThroughputArgs {
    /// Measurements per path and mode; the median is reported.
    #[arg(long, default_value_t = 9)]
    repetitions: usize,
    /// Seconds per iperf3 measurement.
    #[arg(long, default_value_t = 10)]
    seconds: u32,
    /// Print the table only; leave docs/benchmarks.md alone.
    #[arg(long)]
    no_write: bool,
}

const MASTER: &str = "bench0";
const LAN_HOST: &str = "192.0.2.1";
const POD_A: &str = "192.0.2.10";
const POD_B: &str = "192.0.2.11";
const IPERF_PORT: u16 = 5201;

/// A measured flow: the client's namespace and the server's address.
struct Flow<'a> {
    label: &'static str,
    client: &'a Netns,
    server_address: &'static str,
}

/// How the programs are attached, if at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mechanism {
    None,
    Netlink,
    Tcx,
}

impl Mechanism {
    /// The agent's `--tc-attach` value.
    fn tc_attach(self) -> &'static str {
        match self {
            Mechanism::None => unreachable!("nothing to attach"),
            Mechanism::Netlink => "netlink",
            Mechanism::Tcx => "tcx",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Mechanism::None => "no programs",
            Mechanism::Netlink => "programs, netlink",
            Mechanism::Tcx => "programs, TCX",
        }
    }

    /// The modes measured on a kernel of `release` (`6.18.4-...`): TCX
    /// only where the kernel has it (6.6 and later).
    fn measured_on(release: &str) -> Vec<Mechanism> {
        let mut numbers = release
            .split(|c: char| !c.is_ascii_digit())
            .map(|n| n.parse::<u32>().unwrap_or(0));
        let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
        if version >= (6, 6) {
            vec![Mechanism::None, Mechanism::Netlink, Mechanism::Tcx]
        } else {
            vec![Mechanism::None, Mechanism::Netlink]
        }
    }
}

/// Attaches and detaches the programs with the agent's CLI.
struct Programs<'a> {
    agent: &'a Path,
    pin: &'a PinRoot,
    node: &'a Netns,
    pods: [&'a Netns; 2],
}

impl Programs<'_> {
    fn agent(&self, args: &[&str]) -> anyhow::Result<()> {
        sh(self.agent, args).map(drop)
    }

    fn pin(&self) -> String {
        self.pin.0.display().to_string()
    }

    fn attach(&self, mechanism: Mechanism) -> anyhow::Result<()> {
        let pin = self.pin();
        self.on_every_hook(
            "attach",
            &["--pin-root", &pin, "--tc-attach", mechanism.tc_attach()],
        )
    }

    fn detach(&self) -> anyhow::Result<()> {
        let pin = self.pin();
        self.on_every_hook("detach", &["--pin-root", &pin])
    }

    /// `flatnet-agent datapath [policy] <verb> --interface .. --netns ..
    /// <extra>` for the uplink program on the master, then the policy
    /// programs on each pod's interface.
    fn on_every_hook(&self, verb: &str, extra: &[&str]) -> anyhow::Result<()> {
        let hooks = std::iter::once((vec!["datapath", verb], MASTER, self.node)).chain(
            self.pods
                .iter()
                .map(|pod| (vec!["datapath", "policy", verb], "eth0", *pod)),
        );
        for (mut args, interface, netns) in hooks {
            let netns = netns.path().display().to_string();
            args.extend(["--interface", interface, "--netns", &netns]);
            args.extend(extra);
            self.agent(&args)?;
        }
        Ok(())
    }

    /// The programs attached now, each named by where it runs.
    fn attached(&self) -> anyhow::Result<Vec<AttachedProgram>> {
        let pin = &self.pin.0;
        let mut programs = program_cost::attached(self.node, MASTER, "master", pin)?;
        for (pod, label) in self.pods.iter().zip(["eth0 of pod a", "eth0 of pod b"]) {
            programs.extend(program_cost::attached(pod, "eth0", label, pin)?);
        }
        Ok(programs)
    }

    /// Installs the policy: both pods isolated both ways, TCP to the iperf3
    /// port allowed within the LAN's /24.
    fn apply_policy(&self, dir: &Path) -> anyhow::Result<()> {
        let peers = json!([{"ipBlock": {"cidr": "192.0.2.0/24"}}]);
        let ports = json!([{"protocol": "TCP", "port": IPERF_PORT}]);
        let policy = json!({
            "apiVersion": "k8s.cni.cncf.io/v1beta1",
            "kind": "MultiNetworkPolicy",
            "metadata": {"name": "bench", "namespace": "bench",
                         "annotations": {"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}},
            "spec": {
                "podSelector": {},
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"from": peers, "ports": ports}],
                "egress": [{"to": peers, "ports": ports}],
            }
        });
        let pods = json!([
            {"namespace": "bench", "name": "a", "ips": [POD_A], "local": true},
            {"namespace": "bench", "name": "b", "ips": [POD_B], "local": true},
        ]);
        let policies_file = dir.join("policies.json");
        let pods_file = dir.join("pods.json");
        std::fs::write(&policies_file, policy.to_string())?;
        std::fs::write(&pods_file, pods.to_string())?;
        self.agent(&[
            "datapath",
            "policy",
            "apply",
            "--policies",
            &policies_file.display().to_string(),
            "--pods",
            &pods_file.display().to_string(),
            "--pin-root",
            &self.pin(),
        ])
    }
}

/// CPUs the iperf3 client and server are pinned to (`--affinity`), so the
/// scheduler moving them between CPUs does not add to the spread between
/// runs; none on a single-CPU machine.
fn iperf_cpus() -> Option<(usize, usize)> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cpus >= 2).then_some((0, cpus - 1))
}

/// An iperf3 server in a namespace, stopped on drop.
struct IperfServer(Child);

impl IperfServer {
    fn start(netns: &Netns, address: &str) -> anyhow::Result<Self> {
        let mut command = netns.command("iperf3");
        if let Some((_, server_cpu)) = iperf_cpus() {
            command.args(["--affinity", &server_cpu.to_string()]);
        }
        let child = command
            .args(["--server", "--bind", address, "--port"])
            .arg(IPERF_PORT.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start iperf3 server")?;
        // Let it bind before the first client connects.
        std::thread::sleep(Duration::from_millis(500));
        Ok(Self(child))
    }
}

impl Drop for IperfServer {
    fn drop(&mut self) {
        // `ip netns exec` execs iperf3, so this is the server's own pid.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One iperf3 run; returns the receiver's rate in Gbit/s.
fn iperf(path: &Flow, seconds: u32) -> anyhow::Result<f64> {
    let mut command = path.client.command("iperf3");
    if let Some((client_cpu, _)) = iperf_cpus() {
        command.args(["--affinity", &client_cpu.to_string()]);
    }
    let out = command
        .args(["--client", path.server_address, "--json", "--time"])
        .arg(seconds.to_string())
        .args(["--port", &IPERF_PORT.to_string()])
        .output()
        .context("run iperf3 client")?;
    let report: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("iperf3 output: {}", String::from_utf8_lossy(&out.stdout)))?;
    if !out.status.success() {
        bail!(
            "iperf3 to {} failed: {}",
            path.server_address,
            report["error"]
        );
    }
    report["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .map(|bps| bps / 1e9)
        .context("iperf3 output without end.sum_received.bits_per_second")
}

/// The rows of the cost table for one path's accounted run.
/// `on / off`: ratio of medians; median of the per-repetition ratios and
/// their middle half.
fn ratio_cell(on: &[f64], off: &[f64]) -> String {
    let mut paired: Vec<f64> = on.iter().zip(off).map(|(on, off)| on / off).collect();
    paired.sort_by(f64::total_cmp);
    format!(
        "{:.1} %; {:.1} % ({:.1}-{:.1} %)",
        100.0 * median(on) / median(off),
        100.0 * median(&paired),
        100.0 * percentile(&paired, 0.25),
        100.0 * percentile(&paired, 0.75),
    )
}

fn cost_rows(path: &str, gbps: f64, costs: &[ProgramCost]) -> String {
    let mut rows = String::new();
    for cost in costs.iter().filter(|cost| cost.runs > 0) {
        rows += &format!(
            "| {path} | {} ({}) | {:.0} | {:.0} | {:.1} % |\n",
            cost.program.name,
            cost.program.hook,
            cost.runs_per_second(),
            cost.ns_per_run(),
            100.0 * cost.cpu_share(),
        );
    }
    let total: f64 = costs.iter().map(ProgramCost::cpu_share).sum();
    rows += &format!(
        "| {path} | all programs, at {gbps:.2} Gbit/s | | | {:.1} % |\n",
        100.0 * total
    );
    rows
}

/// A macvlan pod on the master, `eth0` with `address`.
fn macvlan_pod(node: &Netns, name: String, link: &str, address: &str) -> anyhow::Result<Netns> {
    let pod = Netns::new(name)?;
    node.ip(&[
        "link", "add", link, "link", MASTER, "type", "macvlan", "mode", "bridge",
    ])?;
    node.ip(&["link", "set", link, "netns", &pod.name])?;
    pod.ip(&["link", "set", link, "name", "eth0"])?;
    pod.ip(&["addr", "add", &format!("{address}/24"), "dev", "eth0"])?;
    pod.ip(&["link", "set", "eth0", "up"])?;
    Ok(pod)
}

/// Runs the benchmark and writes its section.
pub fn run(args: &ThroughputArgs) -> anyhow::Result<()> {
    if args.repetitions == 0 || args.seconds == 0 {
        bail!("--repetitions and --seconds must be at least 1");
    }
    apt_install(&["iperf3", "bpftool"])?;
    let binaries = build_release_binaries()?;
    let machine = machine();

    let pid = std::process::id() % 100_000;
    let node = Netns::new(format!("ftnode-{pid}"))?;
    let lan = Netns::new(format!("ftlan-{pid}"))?;
    sh(
        "ip",
        &[
            "link", "add", MASTER, "netns", &node.name, "type", "veth", "peer", "name", "lan0",
            "netns", &lan.name,
        ],
    )?;
    node.ip(&["link", "set", MASTER, "up"])?;
    lan.ip(&["addr", "add", &format!("{LAN_HOST}/24"), "dev", "lan0"])?;
    lan.ip(&["link", "set", "lan0", "up"])?;
    let pod_a = macvlan_pod(&node, format!("ftpoda-{pid}"), "mva", POD_A)?;
    let pod_b = macvlan_pod(&node, format!("ftpodb-{pid}"), "mvb", POD_B)?;

    let dir = std::env::temp_dir().join(format!("flatnet-bench-throughput-{pid}"));
    std::fs::create_dir_all(&dir)?;
    let pin = PinRoot::new("bench-throughput");
    let programs = Programs {
        agent: &binaries.agent,
        pin: &pin,
        node: &node,
        pods: [&pod_a, &pod_b],
    };
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")?;
    let modes = Mechanism::measured_on(release.trim());
    let best = *modes.last().expect("at least two modes");
    programs.attach(best)?;
    programs.apply_policy(&dir)?;

    let _servers = [
        IperfServer::start(&pod_b, POD_B)?,
        IperfServer::start(&lan, LAN_HOST)?,
    ];
    let paths = [
        Flow {
            label: "pod to pod (macvlan bridge, same master)",
            client: &pod_a,
            server_address: POD_B,
        },
        Flow {
            label: "pod to LAN host (through the master veth)",
            client: &pod_a,
            server_address: LAN_HOST,
        },
    ];
    // [path][mode], modes as in `modes`.
    let mut samples = vec![vec![Vec::new(); modes.len()]; paths.len()];
    println!(
        "==> bench throughput: {} × {} s per path and mode, rotating",
        args.repetitions, args.seconds
    );
    for rep in 0..args.repetitions {
        // Rotate which mode goes first, so none always follows another.
        for step in 0..modes.len() {
            let index = (rep + step) % modes.len();
            let mode = modes[index];
            match mode {
                Mechanism::None => programs.detach()?,
                attached => programs.attach(attached)?,
            }
            for (path, out) in paths.iter().zip(&mut samples) {
                let gbps = iperf(path, args.seconds)?;
                println!("    {} / {}: {gbps:.2} Gbit/s", path.label, mode.label());
                out[index].push(gbps);
            }
        }
    }
    // One more run per path with the programs, under the kernel's run-time
    // accounting (not among the samples: the accounting itself costs).
    programs.attach(best)?;
    let attached = programs.attached()?;
    let mut cost_table = String::from(
        "| path | program (where it runs) | runs per second | ns per run | share of one CPU |\n\
         | --- | --- | ---: | ---: | ---: |\n",
    );
    for path in &paths {
        let (gbps, costs) = program_cost::measure(&attached, || iperf(path, args.seconds))?;
        println!("    {} / programs, accounted: {gbps:.2} Gbit/s", path.label);
        cost_table += &cost_rows(path.label, gbps, &costs);
    }
    let policy_check = sh(
        &binaries.agent,
        &["datapath", "policy", "show", "--pin-root", &programs.pin()],
    )?;
    programs.detach()?;
    let _ = std::fs::remove_dir_all(&dir);

    let mut table = String::from("| path |");
    for mode in &modes {
        table += &format!(" {} (Gbit/s) |", mode.label());
    }
    for mode in &modes[1..] {
        table += &format!(
            " {} / none: medians; paired median (middle half) |",
            mode.label()
        );
    }
    table += "\n| --- |";
    table += &" ---: |".repeat(2 * modes.len() - 1);
    table += "\n";
    for (path, out) in paths.iter().zip(&samples) {
        table += &format!("| {} |", path.label);
        for runs in out {
            table += &format!(" {:.2} |", median(runs));
        }
        for runs in &out[1..] {
            table += &format!(" {} |", ratio_cell(runs, &out[0]));
        }
        table += "\n";
    }
    print!("{table}\n{cost_table}");
    println!("policy counters after the run:\n{policy_check}");
    if args.no_write {
        return Ok(());
    }
    let section = format!(
        "## TCP throughput with and without the eBPF programs\n\n\
         Command: `cargo xtask bench throughput` (root; installs Debian's `iperf3`\n\
         {}). {}.\n\n\
         Two macvlan pods (bridge mode) on one master, a veth in a node namespace\n\
         whose peer is a LAN host namespace; one iperf3 TCP stream for {} s, median of\n\
         {} runs per path and mode, modes rotating in one run; {}. \"Programs\": the\n\
         uplink program on the master and the policy programs (ingress and egress)\n\
         on both pod interfaces, attached with `flatnet-agent datapath attach` and\n\
         `datapath policy attach`, through netlink (clsact filters, cls_bpf) and,\n\
         on Linux 6.6 and later, through TCX links (`--tc-attach`); a policy isolates both pods both ways and allows\n\
         TCP {IPERF_PORT} within 192.0.2.0/24: the first packet of each flow takes the\n\
         full judgement (subject, LPM prefix, port match), its later packets one\n\
         connection-tracking lookup and the subject lookup, its replies the\n\
         connection-tracking lookup alone. \"No programs\": all of them detached.\n\
         Every frame crosses the sender's egress and the receiver's ingress\n\
         policy program, and the uplink program when it enters the master: pod to\n\
         LAN on the way back, pod to pod both ways (a macvlan in bridge mode hands a\n\
         frame for a sibling to the master's receive path first, for its taps).\n\
         \"Paired\": each repetition ran every mode back to back, so the ratio\n\
         within a repetition cancels what drifts slower than that; its median,\n\
         and the 25th to 75th percentile.\n\n\
         {table}\n\
         What the programs cost on the way: one more run per path with the\n\
         programs attached as the agent attaches them on this kernel ({}) and\n\
         the kernel's eBPF run-time accounting on\n\
         (`kernel.bpf_stats_enabled`, read with Debian's `bpftool` {}; it adds two\n\
         clock reads to every run, which the figures include).\n\n\
         {cost_table}",
        package_version("iperf3"),
        machine,
        args.seconds,
        args.repetitions,
        match iperf_cpus() {
            Some((client, server)) =>
                format!("iperf3 client on CPU {client}, server on CPU {server}"),
            None => "one CPU".to_owned(),
        },
        best.label(),
        package_version("bpftool"),
    );
    report::write_section("throughput", &section)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcx_is_measured_from_linux_6_6() {
        let tcx = |release| Mechanism::measured_on(release).contains(&Mechanism::Tcx);
        assert!(tcx("6.18.44-fc-v595"));
        assert!(tcx("6.6.0"));
        assert!(!tcx("6.1.0-41-amd64"));
        assert!(!tcx("5.15.0"));
        assert_eq!(
            Mechanism::measured_on("6.1.0")[..2],
            [Mechanism::None, Mechanism::Netlink]
        );
    }

    #[test]
    fn ratio_cells_give_medians_and_paired_ratios() {
        let off = [10.0, 8.0, 12.0, 10.0];
        let on = [9.0, 8.0, 12.0, 9.5];
        // medians 10.0 and 9.5; pairs 90 %, 100 %, 100 %, 95 %.
        assert_eq!(ratio_cell(&on, &off), "95.0 %; 100.0 % (90.0-100.0 %)");
    }
}
