//! `cargo xtask lab`: flatnet on a simulated LAN, on one machine.
//!
//! Network namespaces make the LAN: a switch (a Linux bridge), a LAN host,
//! a rogue host and two nodes whose uplinks are the macvlan/ipvlan masters.
//! Each node runs its own `flatnet-agent run --standalone`; pods are
//! attached through real `flatnet-cni` calls. The lab then checks, step by
//! step, what flatnet promises: cross-node pod traffic, pods and the LAN,
//! address announcements, conflict detection, network policy and floating
//! addresses (node-answered and pod-held) failing over. Every step
//! prints a progress line; a table closes the run; any failed check makes
//! the command fail. Everything is removed at the end, also after Ctrl-C or
//! SIGTERM, and leftovers of a killed run are removed at the start.

pub(crate) mod capture;
mod floating;
pub(crate) mod netns;
mod node;
mod policy;
pub(crate) mod process;
mod report;
pub(crate) mod topology;

use std::{
    fs,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use clap::{Args, ValueEnum};
use flatnet_packet_socket::RawSocket;
use serde_json::json;

use self::{
    capture::Capture,
    netns::{DfEcho, EchoServer, expect_tcp, ping},
    node::{AgentImage, Binaries, DUAL_NETWORK, EXTRA_NETWORK, IPVLAN_NETWORK, Node},
    policy::{ALLOWED_PORT, BLOCKED_PORT, PolicyPod},
    process::{Interrupted, interrupted},
    report::{Outcome, Report, StepRecord},
    topology::{LAN_HOST, LAN_HOST_IPVLAN_V4, LAN_HOST_V4, LAN_HOST_V6, NODE1, NODE2, ROGUE},
};
use crate::{charts, ebpf, images, images::podman::ChartContainer, workspace};

/// Options of `cargo xtask lab`.
#[derive(Args, Debug, Default)]
pub struct LabArgs {
    /// Send this process SIGINT right after the given step, as Ctrl-C
    /// would; the lab must then clean up everything and exit with 130.
    #[arg(long, value_enum)]
    pub interrupt_after: Option<Step>,
    /// Use the binaries already in target/debug instead of building them
    /// (where cargo cannot run, such as inside the test VM).
    #[arg(long)]
    pub skip_build: bool,
    /// Run each node's agent from the agent image under podman, as the
    /// chart runs it (capabilities, read-only root, host network), built
    /// by `cargo xtask images` (with --skip-build: the images already loaded).
    #[arg(long)]
    pub images: bool,
    /// Leave these steps out (repeat the option); each is reported as
    /// skipped, never as passed.
    #[arg(long = "skip", value_enum)]
    pub skip: Vec<Step>,
}

impl LabArgs {
    /// The lab with the agents run from their image.
    pub fn with_images() -> Self {
        Self {
            images: true,
            ..Self::default()
        }
    }
}

/// The lab's steps, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Step {
    Build,
    Leftovers,
    Topology,
    Agents,
    Pods,
    Announce,
    Ipvlan,
    CrossNode,
    Lan,
    Policy,
    Conflict,
    WireIpam,
    Floating,
    FloatingPods,
    Runtime,
    Teardown,
}

impl Step {
    const ALL: [Step; 16] = [
        Step::Build,
        Step::Leftovers,
        Step::Topology,
        Step::Agents,
        Step::Pods,
        Step::Announce,
        Step::Ipvlan,
        Step::CrossNode,
        Step::Lan,
        Step::Policy,
        Step::Conflict,
        Step::WireIpam,
        Step::Floating,
        Step::FloatingPods,
        Step::Runtime,
        Step::Teardown,
    ];

    /// The step's name, as `--interrupt-after` takes it.
    fn name(self) -> &'static str {
        match self {
            Step::Build => "build",
            Step::Leftovers => "leftovers",
            Step::Topology => "topology",
            Step::Agents => "agents",
            Step::Pods => "pods",
            Step::Announce => "announce",
            Step::Ipvlan => "ipvlan",
            Step::CrossNode => "cross-node",
            Step::Lan => "lan",
            Step::Policy => "policy",
            Step::Conflict => "conflict",
            Step::WireIpam => "wire-ipam",
            Step::Floating => "floating",
            Step::FloatingPods => "floating-pods",
            Step::Runtime => "runtime",
            Step::Teardown => "teardown",
        }
    }

    /// What the step checks (progress line and report).
    fn checks(self) -> &'static str {
        match self {
            Step::Build => {
                "eBPF object, flatnet-agent and flatnet-cni (debug) are built (--images: the agent image)"
            }
            Step::Leftovers => "nothing of an earlier lab run is left (fnlab- names, pins, agents)",
            Step::Topology => "switch (bridge), LAN host, rogue host, node1 and node2 are cabled",
            Step::Agents => {
                "flatnet-agent run --standalone on each node answers STATUS and /readyz"
            }
            Step::Pods => {
                "CNI ADD gives pod-a (node1) and pod-b (node2) dual-stack macvlan addresses"
            }
            Step::Announce => "the LAN host received each pod's gratuitous ARP and unsolicited NA",
            Step::Ipvlan => {
                "CNI ADD of an ipvlan L2 pod on node1; it reaches the LAN host and back"
            }
            Step::CrossNode => "pod-a <-> pod-b across nodes: ping and TCP, IPv4 and IPv6",
            Step::Lan => "pods <-> LAN host: ping IPv4 and IPv6 both ways",
            Step::Policy => "a policy on pod-b: TCP 8080 passes, TCP 9090 is dropped (IPv4, IPv6)",
            Step::Conflict => {
                "a rogue host claiming pod-b's IPv4 and IPv6 address is detected by node2's agent"
            }
            Step::WireIpam => {
                "node1's next pod skips the address a silent foreign host used on the LAN"
            }
            Step::Floating => {
                "a floating address answered by one node moves to the other after its loop is SIGKILLed and its uplink goes down; the LAN host's TCP works again (time in the report)"
            }
            Step::FloatingPods => {
                "a floating address held by pod-a while node1 owns it is reached from the LAN host; node1's agent stops (SIGTERM): pod-a gives it up, pod-b on node2 takes it, the LAN host's TCP works again (time in the report)"
            }
            Step::Runtime => {
                "running pod-a gets net1 hot-plugged (LAN host reaches it), then its MTU lowered to 1400 in place (DF ping of 1400 bytes answered, 1401 refused); both undone"
            }
            Step::Teardown => "CNI DEL removes every pod and allocation; agents stop on SIGTERM",
        }
    }

    /// Steps later steps build on: their failure ends the run.
    fn is_setup(self) -> bool {
        matches!(
            self,
            Step::Build | Step::Leftovers | Step::Topology | Step::Agents | Step::Pods
        )
    }
}

/// A pod of the lab: its namespace (also its container ID) and addresses.
struct Pod {
    netns: &'static str,
    ipv4: String,
    ipv6: String,
    /// The pod interface's MAC (ipvlan interfaces share the master's).
    mac: Option<[u8; 6]>,
}

impl Pod {
    fn for_policy(&self) -> PolicyPod<'_> {
        PolicyPod {
            netns: self.netns,
            ipv4: &self.ipv4,
            ipv6: &self.ipv6,
        }
    }
}

const POD_A: &str = "fnlab-pod-a";
const POD_B: &str = "fnlab-pod-b";
const POD_C: &str = "fnlab-pod-c";
/// The two pods of the wire-aware IPAM step.
const POD_W1: &str = "fnlab-pod-w1";
const POD_W2: &str = "fnlab-pod-w2";

/// Everything one lab run holds; dropped (and so stopped) at cleanup.
#[derive(Default)]
struct Lab {
    skip_build: bool,
    images: bool,
    /// Steps left out (`--skip`).
    skip: Vec<Step>,
    report: Report,
    bins: Option<Binaries>,
    nodes: Vec<Node>,
    pods: Vec<Pod>,
    /// Pods on the ipvlan network (none when the kernel lacks ipvlan).
    ipvlan_pods: Vec<Pod>,
    capture: Option<Capture>,
    servers: Vec<EchoServer>,
    /// The floating step's `flatnet-agent floating` processes.
    floating_loops: Vec<floating::FloatingLoop>,
}

/// Runs the lab; fails when any check failed. Exits the process with 130
/// after cleaning up when interrupted.
pub fn run(args: &LabArgs) -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the lab creates network namespaces and loads eBPF programs: run it as root");
    }
    process::install_handler(topology::remove_everything)?;
    let mut lab = Lab {
        skip_build: args.skip_build,
        images: args.images,
        skip: args.skip.clone(),
        ..Lab::default()
    };
    let steps_done = lab.exercise(args.interrupt_after);
    for step in &Step::ALL[steps_done..] {
        lab.report.not_run(step.name(), step.checks());
    }
    let failed = !lab.report.failures().is_empty();
    if failed {
        lab.print_agent_logs();
    }
    lab.cleanup();
    println!();
    println!("{}", lab.report);
    if interrupted() {
        eprintln!("[lab] interrupted; everything the lab made has been removed");
        std::process::exit(130);
    }
    let failures: Vec<&str> = lab.report.failures().iter().map(|s| s.name).collect();
    if !failures.is_empty() {
        bail!("the lab failed: {}", failures.join(", "));
    }
    Ok(())
}

/// Runs `cargo xtask lab --interrupt-after pods` and checks that the
/// interrupted lab exits with 130 and leaves nothing behind.
pub fn interrupted_run_leaves_nothing() -> anyhow::Result<()> {
    let mut lab = workspace::cargo(None);
    lab.args(["xtask", "lab", "--interrupt-after", "pods"]);
    println!("==> lab interrupted after the pods step: {lab:?}");
    let status = lab.status().context("run the interrupted lab")?;
    let left = topology::leftovers();
    if status.code() != Some(130) {
        bail!("the interrupted lab exited with {status}, expected 130");
    }
    if !left.is_empty() {
        bail!("the interrupted lab left: {}", left.join(", "));
    }
    println!("<== lab interrupted after the pods step: exit 130, nothing left");
    Ok(())
}

impl Lab {
    /// Runs the steps in order; returns how many were recorded.
    fn exercise(&mut self, interrupt_after: Option<Step>) -> usize {
        for (index, step) in Step::ALL.into_iter().enumerate() {
            if interrupted() {
                // The signal came between two steps: this one never started.
                self.report.finish(StepRecord {
                    name: step.name(),
                    checks: step.checks(),
                    outcome: Outcome::Interrupted,
                    took: Duration::ZERO,
                });
                return index + 1;
            }
            self.report
                .begin(index + 1, Step::ALL.len(), step.name(), step.checks());
            let started = Instant::now();
            let outcome = match if self.skip.contains(&step) {
                Ok(Some("left out with --skip".to_owned()))
            } else {
                self.step(step)
            } {
                Ok(None) => Outcome::Passed,
                Ok(Some(reason)) => Outcome::Skipped(reason),
                Err(_) if interrupted() => Outcome::Interrupted,
                Err(e) if e.is::<Interrupted>() => Outcome::Interrupted,
                Err(e) => Outcome::Failed(format!("{e:#}")),
            };
            let stop = match &outcome {
                Outcome::Interrupted => true,
                Outcome::Failed(_) => step.is_setup(),
                _ => false,
            };
            self.report.finish(StepRecord {
                name: step.name(),
                checks: step.checks(),
                outcome,
                took: started.elapsed(),
            });
            if stop {
                return index + 1;
            }
            if interrupt_after == Some(step) {
                println!(
                    "[lab] --interrupt-after {}: sending SIGINT to myself",
                    step.name()
                );
                process::interrupt_self();
            }
        }
        Step::ALL.len()
    }

    /// One step; `Ok(Some(reason))` when it is skipped on this machine.
    fn step(&mut self, step: Step) -> anyhow::Result<Option<String>> {
        match step {
            Step::Build => self.build(),
            Step::Leftovers => remove_leftovers(),
            Step::Topology => topology::build(),
            Step::Agents => self.start_agents(),
            Step::Pods => self.add_pods(),
            Step::Announce => self.check_announcements(),
            Step::Ipvlan => return self.ipvlan_pod(),
            Step::CrossNode => self.cross_node(),
            Step::Lan => self.pods_and_lan(),
            Step::Policy => self.policy(),
            Step::Conflict => self.conflict(),
            Step::WireIpam => self.wire_ipam(),
            Step::Floating => self.floating(),
            Step::FloatingPods => self.floating_pods(),
            Step::Runtime => self.runtime_config(),
            Step::Teardown => self.teardown(),
        }
        .map(|()| None)
    }

    fn bins(&self) -> &Binaries {
        self.bins.as_ref().expect("built in the first step")
    }

    fn build(&mut self) -> anyhow::Result<()> {
        if self.images {
            return self.build_images();
        }
        if !self.skip_build {
            ebpf::build()?;
            let mut build = workspace::cargo(None);
            build.args(["build", "--package", "flatnet-agent", "--bins"]);
            workspace::run("build flatnet-agent and flatnet-cni", &mut build)?;
        }
        let dir = workspace::root().join("target/debug");
        let bins = Binaries {
            agent: dir.join("flatnet-agent"),
            cni: dir.join("flatnet-cni"),
            image: None,
        };
        for binary in [&bins.agent, &bins.cni] {
            if !binary.is_file() {
                bail!("{} is missing; run without --skip-build", binary.display());
            }
        }
        self.bins = Some(bins);
        Ok(())
    }

    /// The agent image, loaded into podman, and the chart's agent container
    /// (rendered by the chart check, which also checks it against the binaries).
    fn build_images(&mut self) -> anyhow::Result<()> {
        let root = workspace::root();
        if !self.skip_build {
            images::run(&images::ImagesArgs::default())?;
            charts::check(&images::binary_dir(&root))?;
        }
        let chart = images::ChartImages::read(&root)?;
        let container =
            ChartContainer::read(&root.join(charts::RENDERED), "DaemonSet", "agent", "agent")?;
        let dir = images::binary_dir(&root);
        self.bins = Some(Binaries {
            agent: dir.join("flatnet-agent"),
            cni: dir.join("flatnet-cni"),
            image: Some(AgentImage {
                reference: chart.qualified_reference(images::Component::Agent),
                chart: container,
            }),
        });
        Ok(())
    }

    fn start_agents(&mut self) -> anyhow::Result<()> {
        self.nodes = vec![Node::new(NODE1, 10)?, Node::new(NODE2, 20)?];
        let bins = self.bins().clone();
        for node in &mut self.nodes {
            node.start(&bins)?;
        }
        for node in &mut self.nodes {
            node.wait_ready(&bins)?;
        }
        Ok(())
    }

    /// pod-a on node1, pod-b on node2, both on the dual-stack macvlan
    /// network; the LAN host listens for their announcements meanwhile.
    fn add_pods(&mut self) -> anyhow::Result<()> {
        self.capture = Some(Capture::start(LAN_HOST, "eth0")?);
        for (index, netns) in [(0, POD_A), (1, POD_B)] {
            let pod = self.add_pod(index, netns, DUAL_NETWORK)?;
            self.pods.push(pod);
        }
        for port in [ALLOWED_PORT, BLOCKED_PORT] {
            self.servers.push(EchoServer::start(POD_B, port)?);
        }
        Ok(())
    }

    /// CNI ADD of `netns` as the first pod of node `node`'s `network`;
    /// checks the addresses it got.
    fn add_pod(&self, node: usize, netns: &'static str, network: &str) -> anyhow::Result<Pod> {
        topology::create_netns(netns)?;
        let node = &self.nodes[node];
        let result = node.cni(self.bins(), "ADD", network, Some(netns), json!({}))?;
        let addresses: Vec<&str> = result["ips"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|ip| ip["address"].as_str())
            .collect();
        let mac = result["interfaces"][0]["mac"].as_str().and_then(parse_mac);
        let (ipv4, ipv6) = node.pod_address(0);
        let (ipv4, ipv6, expected) = if network == IPVLAN_NETWORK {
            let v4 = format!("198.51.100.{}", node.base);
            (v4.clone(), String::new(), vec![format!("{v4}/24")])
        } else {
            let expected = vec![format!("{ipv4}/24"), format!("{ipv6}/64")];
            (ipv4, ipv6, expected)
        };
        if addresses != expected {
            bail!("{netns} got {addresses:?} from {network}, expected {expected:?}");
        }
        println!(
            "[lab]       {netns} on {}: {} (MAC {})",
            node.netns,
            addresses.join(", "),
            result["interfaces"][0]["mac"].as_str().unwrap_or_default()
        );
        Ok(Pod {
            netns,
            ipv4,
            ipv6,
            mac,
        })
    }

    fn check_announcements(&mut self) -> anyhow::Result<()> {
        let capture = self.capture.as_ref().context("no capture running")?;
        // The agent announces three times a second apart; give it a while.
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut missing = Vec::new();
        loop {
            missing.clear();
            for pod in &self.pods {
                let v4: Ipv4Addr = pod.ipv4.parse()?;
                let v6: Ipv6Addr = pod.ipv6.parse()?;
                let mac = pod
                    .mac
                    .with_context(|| format!("the ADD result of {} has no MAC", pod.netns))?;
                if !capture.saw_gratuitous_arp(mac, v4) {
                    missing.push(format!("gratuitous ARP for {v4}"));
                }
                if !capture.saw_unsolicited_na(mac, v6) {
                    missing.push(format!("unsolicited NA for {v6}"));
                }
            }
            if missing.is_empty() || Instant::now() > deadline {
                break;
            }
            process::sleep(Duration::from_millis(100))?;
        }
        self.capture = None;
        if !missing.is_empty() {
            bail!("the LAN host never received: {}", missing.join(", "));
        }
        Ok(())
    }

    fn ipvlan_pod(&mut self) -> anyhow::Result<Option<String>> {
        let probe = [
            "link",
            "add",
            "fnlab-ipvprobe",
            "link",
            topology::IPVLAN_UPLINK,
            "type",
            "ipvlan",
            "mode",
            "l2",
        ];
        if let Err(e) = process::ip(NODE1, &probe) {
            let message = format!("{e:#}");
            let missing =
                message.contains("Unknown device type") || message.contains("not supported");
            // The VM run sets this: there a kernel without ipvlan is a failure, not a skip.
            if missing && std::env::var_os("FLATNET_REQUIRE_KERNEL_FEATURES").is_none() {
                return Ok(Some(
                    "this kernel has no ipvlan (`ip link add ... type ipvlan`: Unknown device type); \
                     run the lab on Linux 6.1 with `cargo xtask vm-test --memory 1024 -- target/debug/xtask lab --skip-build`"
                        .into(),
                ));
            }
            return Err(e);
        }
        process::ip(NODE1, &["link", "del", "fnlab-ipvprobe"])?;
        let pod = self.add_pod(0, POD_C, IPVLAN_NETWORK)?;
        let pod_v4 = pod.ipv4.clone();
        self.ipvlan_pods.push(pod);
        ping(POD_C, LAN_HOST_IPVLAN_V4)?;
        ping(LAN_HOST, &pod_v4)?;
        Ok(None)
    }

    fn cross_node(&mut self) -> anyhow::Result<()> {
        let (a, b) = (&self.pods[0], &self.pods[1]);
        ping(a.netns, &b.ipv4)?;
        ping(a.netns, &b.ipv6)?;
        ping(b.netns, &a.ipv4)?;
        ping(b.netns, &a.ipv6)?;
        expect_tcp(a.netns, socket(&b.ipv4, ALLOWED_PORT))?;
        expect_tcp(a.netns, socket(&b.ipv6, ALLOWED_PORT))?;
        Ok(())
    }

    fn pods_and_lan(&mut self) -> anyhow::Result<()> {
        for pod in &self.pods {
            ping(pod.netns, LAN_HOST_V4)?;
            ping(pod.netns, LAN_HOST_V6)?;
            ping(LAN_HOST, &pod.ipv4)?;
            ping(LAN_HOST, &pod.ipv6)?;
        }
        Ok(())
    }

    fn policy(&mut self) -> anyhow::Result<()> {
        policy::allow_only_one_port(
            self.bins(),
            &self.nodes[1],
            &self.pods[1].for_policy(),
            &self.pods[0].for_policy(),
        )
    }

    /// The rogue host takes pod-b's addresses: IPv4 announced with
    /// gratuitous ARP, IPv6 through its kernel's duplicate address
    /// detection. node2's agent must count and log both claims.
    fn conflict(&mut self) -> anyhow::Result<()> {
        const METRIC: &str = "flatnet_agent_ip_conflicts_total";
        let node2 = &self.nodes[1];
        let pod = &self.pods[1];
        let rogue_mac = process::exec_in(ROGUE, "cat", &["/sys/class/net/eth0/address"])?
            .trim()
            .to_owned();
        let (v4, v6) = (format!("{}/24", pod.ipv4), format!("{}/64", pod.ipv6));
        let before = node2.metric(METRIC)?;
        process::ip(ROGUE, &["addr", "add", &v4, "dev", "eth0"])?;
        let mut arping = std::process::Command::new("ip");
        arping.args([
            "netns", "exec", ROGUE, "arping", "-U", "-c", "2", "-I", "eth0",
        ]);
        arping.arg(&pod.ipv4);
        // Unsolicited ARP expects no reply, so arping's exit status says
        // nothing; the agent's counter and log are the checks.
        process::output(&mut arping, &[])?;
        process::ip(ROGUE, &["addr", "add", &v6, "dev", "eth0"])?;
        let logged = |ip: &str| {
            node2.log_has_line(&[
                "IP conflict",
                &format!("address {ip} ("),
                &format!("claimed by {rogue_mac}"),
            ])
        };
        let deadline = Instant::now() + Duration::from_secs(5);
        while !(logged(&pod.ipv4) && logged(&pod.ipv6)) && Instant::now() < deadline {
            process::sleep(Duration::from_millis(100))?;
        }
        let after = node2.metric(METRIC)?;
        for address in [&v4, &v6] {
            process::ip(ROGUE, &["addr", "del", address, "dev", "eth0"])?;
        }
        for ip in [&pod.ipv4, &pod.ipv6] {
            process::ip(LAN_HOST, &["neigh", "flush", "to", ip])?;
        }
        let missing: Vec<&str> = [pod.ipv4.as_str(), pod.ipv6.as_str()]
            .into_iter()
            .filter(|ip| !logged(ip))
            .collect();
        if !missing.is_empty() {
            bail!(
                "node2's agent logged no conflict on {} claimed by the rogue host ({rogue_mac})",
                missing.join(", ")
            );
        }
        if after < before + 2 {
            bail!("{METRIC} on node2 went from {before} to {after}; two claims were made");
        }
        println!(
            "[lab]       node2: {METRIC} {before} -> {after}; conflicts on {} and {} logged",
            pod.ipv4, pod.ipv6
        );
        Ok(())
    }

    /// A pod on node1 gets address A; a foreign host on the LAN sends ARP
    /// requests from A+1 and nothing else (it never answers for A+1);
    /// node1's next pod must get A+2: its uplink program saw A+1 in use,
    /// and standalone allocation skips what the wire inventory shows live.
    fn wire_ipam(&mut self) -> anyhow::Result<()> {
        let node1 = &self.nodes[0];
        let add = |netns: &str| -> anyhow::Result<Ipv4Addr> {
            topology::create_netns(netns)?;
            let result = node1.cni(self.bins(), "ADD", DUAL_NETWORK, Some(netns), json!({}))?;
            result["ips"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|ip| ip["address"].as_str()?.split('/').next()?.parse().ok())
                .next()
                .with_context(|| format!("{netns} got no IPv4 address: {result}"))
        };
        let first = add(POD_W1)?;
        let foreign = Ipv4Addr::from(u32::from(first) + 1);
        let expected = Ipv4Addr::from(u32::from(first) + 2);
        let rogue_mac = process::exec_in(ROGUE, "cat", &["/sys/class/net/eth0/address"])?;
        let mac = parse_mac(rogue_mac.trim())
            .with_context(|| format!("the rogue host's MAC {rogue_mac:?}"))?;
        // Sent from a packet socket, not with an `arping`: its options
        // differ between implementations (busybox's has no `-S`).
        let request = capture::arp_request(mac, foreign, LAN_HOST_V4.parse()?);
        netns::in_netns(ROGUE, || -> anyhow::Result<()> {
            let socket = RawSocket::open(topology::UPLINK)?;
            for _ in 0..2 {
                socket.send(&request)?;
                std::thread::sleep(Duration::from_millis(100));
            }
            Ok(())
        })??;
        // What allocation reads: without the claim there, the step would
        // test nothing.
        let claimed = || {
            node1
                .wire_claims(self.bins())
                .is_ok_and(|claims| claims.iter().any(|c| c == &(foreign.into(), mac)))
        };
        if settle(
            "the foreign host's claim in node1's wire inventory",
            &claimed,
        )
        .is_err()
        {
            bail!(
                "node1's wire inventory never listed {foreign} claimed by the foreign host ({}): {}",
                rogue_mac.trim(),
                node1.wire_inventory(self.bins())
            );
        }
        println!(
            "[lab]       a foreign host ({}) used {foreign} on the LAN and fell silent",
            rogue_mac.trim()
        );
        let second = add(POD_W2)?;
        for netns in [POD_W1, POD_W2] {
            node1.cni(self.bins(), "DEL", DUAL_NETWORK, Some(netns), json!({}))?;
        }
        if second != expected {
            bail!(
                "{POD_W2} got {second} after {POD_W1} got {first} and a foreign host used {foreign}; expected {expected}; node1's wire inventory: {}",
                node1.wire_inventory(self.bins())
            );
        }
        println!("[lab]       {POD_W1} got {first}, {POD_W2} got {second}: {foreign} skipped");
        Ok(())
    }

    /// Runtime configuration of a running pod on node1, timed from the
    /// state-file write: an extra interface hot-plugged until the LAN host
    /// reaches it, the subnets' MTU lowered until the pod's interface
    /// carries it; then both undone, also when a check failed, so no
    /// hot-plugged address outlives the step.
    fn runtime_config(&mut self) -> anyhow::Result<()> {
        let changed = self.runtime_changes();
        let undone = self.undo_runtime_changes();
        match (changed, undone) {
            (Err(failed), Err(undo)) => bail!("{failed:#}; undoing it failed too: {undo:#}"),
            (changed, undone) => changed.and(undone),
        }
    }

    /// The runtime step's changes and their checks.
    fn runtime_changes(&mut self) -> anyhow::Result<()> {
        let node1 = &self.nodes[0];
        let address = || -> Option<String> {
            let shown = process::ip(POD_A, &["-4", "-j", "addr", "show", "dev", "net1"]).ok()?;
            let shown: serde_json::Value = serde_json::from_str(&shown).ok()?;
            shown[0]["addr_info"][0]["local"]
                .as_str()
                .map(str::to_owned)
        };
        let reachable = || {
            address().is_some_and(|a| {
                process::exec_in(LAN_HOST, "ping", &["-4", "-c", "1", "-W", "1", &a]).is_ok()
            })
        };
        let started = Instant::now();
        write_runtime_state(node1, None, true)?;
        settle(
            "net1 hot-plugged into pod-a and reached from the LAN host",
            &reachable,
        )?;
        let hotplugged = started.elapsed();
        let net1 = address().unwrap_or_default();
        println!(
            "[lab]       {POD_A}: net1 {net1} hot-plugged and reached from the LAN host {:.1} ms after the state-file write",
            hotplugged.as_secs_f64() * 1e3
        );
        self.report.timing(
            "hot-plug: state file written -> LAN host reaches the new interface",
            hotplugged,
        );

        let started = Instant::now();
        write_runtime_state(node1, Some(RUNTIME_MTU), true)?;
        settle("pod-a's eth1 at the lower MTU", &|| {
            pod_a_mtu() == Some(RUNTIME_MTU)
        })?;
        let lowered = started.elapsed();
        self.report.timing(
            "MTU: state file written -> the running pod's interface carries it",
            lowered,
        );
        let gateway: Ipv4Addr = LAN_HOST_V4.parse().expect("the LAN host's address");
        // Three tries: the first may wait for the neighbour entry the MTU
        // change flushed.
        let fits = netns::df_echo(POD_A, gateway, RUNTIME_MTU, 3)?;
        let too_big = netns::df_echo(POD_A, gateway, RUNTIME_MTU + 1, 3)?;
        if fits != DfEcho::Answered {
            bail!(
                "after the MTU change a ping with Don't Fragment of {RUNTIME_MTU} bytes from {POD_A} to {gateway} must be answered; it was {fits:?}"
            );
        }
        if too_big != (DfEcho::TooBig { mtu: RUNTIME_MTU }) {
            bail!(
                "after the MTU change {POD_A} must refuse a ping with Don't Fragment of {} bytes to {gateway} (its route's MTU {RUNTIME_MTU}); it was {too_big:?}",
                RUNTIME_MTU + 1
            );
        }
        println!(
            "[lab]       {POD_A}: eth1 at MTU {RUNTIME_MTU} {:.1} ms after the write, same interface; DF ping {RUNTIME_MTU} passes, {} is refused (path MTU {RUNTIME_MTU})",
            lowered.as_secs_f64() * 1e3,
            RUNTIME_MTU + 1
        );
        Ok(())
    }

    /// The MTU back to the uplink's, `net1` removed, then the state file
    /// as the agent started with it.
    fn undo_runtime_changes(&self) -> anyhow::Result<()> {
        let node1 = &self.nodes[0];
        write_runtime_state(node1, Some(1500), false)?;
        settle("pod-a's eth1 back at 1500", &|| pod_a_mtu() == Some(1500))?;
        settle("net1 removed from pod-a", &|| {
            process::ip(POD_A, &["link", "show", "dev", "net1"]).is_err()
        })?;
        write_runtime_state(node1, None, false)
    }

    fn teardown(&mut self) -> anyhow::Result<()> {
        self.servers.clear();
        self.delete_pods(self.bins())?;
        for node in &mut self.nodes {
            node.stop()?;
        }
        Ok(())
    }

    fn delete_pods(&self, bins: &Binaries) -> anyhow::Result<()> {
        let attached = [
            (0, &self.pods[0], DUAL_NETWORK),
            (1, &self.pods[1], DUAL_NETWORK),
        ]
        .into_iter()
        .chain(self.ipvlan_pods.iter().map(|p| (0, p, IPVLAN_NETWORK)));
        // DEL answers once the pod's addresses are out of the tables; the
        // interface, the address and the record go right after.
        let settled = |done: &dyn Fn() -> anyhow::Result<bool>| -> anyhow::Result<bool> {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while std::time::Instant::now() < deadline {
                if done()? {
                    return Ok(true);
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            done()
        };
        for (node, pod, network) in attached {
            self.nodes[node].cni(bins, "DEL", network, Some(pod.netns), json!({}))?;
            let gone = || Ok(process::ip(pod.netns, &["link", "show", "dev", "eth1"]).is_err());
            if !settled(&gone)? {
                bail!("CNI DEL left eth1 in {} for 10 s", pod.netns);
            }
        }
        for node in &self.nodes {
            if !settled(&|| Ok(node.allocations()?.is_empty()))? {
                bail!(
                    "{} still allocates {:?} 10 s after DEL",
                    node.netns,
                    node.allocations()?
                );
            }
        }
        Ok(())
    }

    fn print_agent_logs(&self) {
        for node in &self.nodes {
            println!("[lab] last lines of the agent log of {}:", node.netns);
            println!("{}", node.log_tail());
        }
    }

    /// Stops whatever runs and removes everything; a report line of its own.
    fn cleanup(&mut self) {
        let checks = "agents stopped; namespaces, links, pins and files removed";
        self.report
            .begin(Step::ALL.len() + 1, Step::ALL.len() + 1, "cleanup", checks);
        let started = Instant::now();
        self.capture = None;
        self.servers.clear();
        for node in &mut self.nodes {
            node.kill();
        }
        topology::remove_everything();
        let left = topology::leftovers();
        let outcome = if left.is_empty() {
            Outcome::Passed
        } else {
            Outcome::Failed(format!("left behind: {}", left.join(", ")))
        };
        self.report.finish(StepRecord {
            name: "cleanup",
            checks,
            outcome,
            took: started.elapsed(),
        });
    }
}

/// The MTU the runtime step gives pod-a's subnets.
const RUNTIME_MTU: u32 = 1400;

/// node1's state file with the runtime step's changes: the subnets' MTU,
/// and the `hotplug` entry giving pod-a `net1` on the extra network.
fn write_runtime_state(node1: &Node, mtu: Option<u32>, hotplug: bool) -> anyhow::Result<()> {
    let entry = format!(
        "{{name: lab-extra, netns: /run/netns/{POD_A}, pod: lab/pod-a, attachments: [{{network: {EXTRA_NETWORK}, ifname: net1}}]}}"
    );
    let path = node1.state_file_path();
    fs::write(
        &path,
        node1.state_file_with(mtu, hotplug.then_some(entry.as_str())),
    )
    .with_context(|| format!("write {}", path.display()))
}

/// Waits up to 10 s for `done`; how long it took.
fn settle(what: &str, done: &dyn Fn() -> bool) -> anyhow::Result<Duration> {
    let started = Instant::now();
    while !done() {
        process::check_interrupt()?;
        if started.elapsed() > Duration::from_secs(10) {
            bail!("{what}: not within 10 s");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    Ok(started.elapsed())
}

/// The MTU of pod-a's `eth1`.
fn pod_a_mtu() -> Option<u32> {
    let shown = process::ip(POD_A, &["-j", "link", "show", "dev", "eth1"]).ok()?;
    let mtu = serde_json::from_str::<serde_json::Value>(&shown).ok()?[0]["mtu"].as_u64()?;
    u32::try_from(mtu).ok()
}

fn remove_leftovers() -> anyhow::Result<()> {
    let found = topology::leftovers();
    if !found.is_empty() {
        println!("[lab]       removing leftovers: {}", found.join(", "));
    }
    topology::remove_everything();
    let left = topology::leftovers();
    if !left.is_empty() {
        bail!("cannot remove: {}", left.join(", "));
    }
    Ok(())
}

fn socket(ip: &str, port: u16) -> SocketAddr {
    let ip: std::net::IpAddr = ip.parse().expect("lab addresses are valid");
    SocketAddr::new(ip, port)
}

pub(crate) fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let bytes: Vec<u8> = text
        .split(':')
        .map(|b| u8::from_str_radix(b, 16).ok())
        .collect::<Option<_>>()?;
    bytes.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_are_the_interrupt_after_values() {
        for step in Step::ALL {
            assert_eq!(Step::from_str(step.name(), false), Ok(step));
        }
        assert_eq!(Step::CrossNode.name(), "cross-node");
    }

    #[test]
    fn macs_parse_from_cni_results() {
        assert_eq!(
            parse_mac("5a:1e:9c:00:11:22"),
            Some([0x5a, 0x1e, 0x9c, 0, 0x11, 0x22])
        );
        assert_eq!(parse_mac("5a:1e:9c:00:11"), None);
        assert_eq!(parse_mac("zz:1e:9c:00:11:22"), None);
    }

    #[test]
    fn only_the_first_steps_end_a_run_when_they_fail() {
        let setup: Vec<Step> = Step::ALL.into_iter().filter(|s| s.is_setup()).collect();
        assert_eq!(setup, &Step::ALL[..5]);
    }
}
