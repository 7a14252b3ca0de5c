//! `cargo xtask lab`: the flatnet data plane on one machine.
//!
//! Builds a simulated LAN from network namespaces (a bridge as the switch, a
//! LAN host and a node), runs the real `flatnet-agent` to attach the uplink
//! program on the node, drives ARP and NDP traffic from the LAN host, and
//! reports what the data plane saw. Everything is removed at the end, also
//! after Ctrl-C.

use std::{
    path::{Path, PathBuf},
    process::Command,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use anyhow::{Context, bail};
use serde_json::Value;

use crate::{ebpf, workspace};

/// Every namespace the lab creates starts with this prefix.
const PREFIX: &str = "fnlab-";
const SWITCH: &str = "fnlab-switch";
const LAN_HOST: &str = "fnlab-lanhost";
const NODE: &str = "fnlab-node1";
const PIN_ROOT: &str = "/sys/fs/bpf/flatnet/lab";

const NODE_V4: &str = "192.0.2.1";
const LAN_V4: &str = "192.0.2.10";
const NODE_V6: &str = "2001:db8::1";
const LAN_V6: &str = "2001:db8::10";

/// Runs the lab end to end.
pub fn run() -> anyhow::Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the lab creates network namespaces and loads eBPF programs: run it as root");
    }
    let interrupted = Arc::new(AtomicBool::new(false));
    {
        let interrupted = interrupted.clone();
        ctrlc::set_handler(move || {
            interrupted.store(true, Ordering::SeqCst);
            eprintln!("\ninterrupted: cleaning up the lab");
            cleanup();
            std::process::exit(130);
        })
        .context("install Ctrl-C handler")?;
    }

    progress("building the eBPF object and flatnet-agent");
    ebpf::build()?;
    let mut build = workspace::cargo(None);
    build.args(["build", "--package", "flatnet-agent"]);
    workspace::run("build flatnet-agent", &mut build)?;
    let agent = workspace::root().join("target/debug/flatnet-agent");

    cleanup(); // Leftovers of an earlier run that was killed hard.
    let result = exercise(&agent);
    progress("cleaning up");
    cleanup();
    result
}

fn exercise(agent: &Path) -> anyhow::Result<()> {
    progress("building the LAN: switch (bridge), LAN host, node1");
    build_topology()?;

    progress("node1: flatnet-agent attaches the uplink program to eth0");
    let node_netns = format!("/run/netns/{NODE}");
    sh(
        agent,
        &[
            "datapath",
            "attach",
            "--interface",
            "eth0",
            "--netns",
            &node_netns,
            "--pin-root",
            PIN_ROOT,
        ],
    )?;

    progress("LAN host: ARP requests for node1 (arping)");
    sh_in(
        LAN_HOST,
        "arping",
        &["-c", "3", "-w", "5", "-I", "eth0", NODE_V4],
    )?;
    progress("LAN host: IPv6 neighbour solicitation for node1 (ndisc6)");
    sh_in(LAN_HOST, "ndisc6", &["-r", "3", NODE_V6, "eth0"])?;

    progress("node1: uplink counters from the pinned map");
    let table = sh(agent, &["inspect", "counters", "--pin-root", PIN_ROOT])?;
    print!("{table}");
    let json = sh(
        agent,
        &[
            "inspect",
            "counters",
            "--pin-root",
            PIN_ROOT,
            "--output",
            "json",
        ],
    )?;
    let counters: Value = serde_json::from_str(&json).context("parse counters JSON")?;
    let packets = |kind: &str| counters["frames"][kind]["packets"].as_u64().unwrap_or(0);
    let arp = packets("arp_request");
    let ns = packets("ndp_neighbor_solicitation");

    progress("node1: detaching the uplink program");
    sh(
        agent,
        &[
            "datapath",
            "detach",
            "--interface",
            "eth0",
            "--netns",
            &node_netns,
        ],
    )?;

    println!();
    println!("lab report");
    println!("  ARP requests seen by node1's uplink program:        {arp} (sent 3)");
    println!("  neighbour solicitations seen by the uplink program: {ns} (sent at least 1)");
    if arp < 3 || ns < 1 {
        bail!("the uplink program missed traffic the LAN host sent");
    }
    println!("  result: the data plane saw the LAN's ARP and NDP traffic");
    Ok(())
}

fn build_topology() -> anyhow::Result<()> {
    for ns in [SWITCH, LAN_HOST, NODE] {
        sh_path("ip", &["netns", "add", ns])?;
        ip(ns, &["link", "set", "lo", "up"])?;
    }
    ip(SWITCH, &["link", "add", "br0", "type", "bridge"])?;
    ip(SWITCH, &["link", "set", "br0", "up"])?;
    for (ns, port, addr4, addr6) in [
        (LAN_HOST, "p-lan", LAN_V4, LAN_V6),
        (NODE, "p-node1", NODE_V4, NODE_V6),
    ] {
        sh_path(
            "ip",
            &[
                "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns",
                SWITCH,
            ],
        )?;
        ip(SWITCH, &["link", "set", port, "master", "br0", "up"])?;
        ip(ns, &["addr", "add", &format!("{addr4}/24"), "dev", "eth0"])?;
        ip(
            ns,
            &[
                "addr",
                "add",
                &format!("{addr6}/64"),
                "dev",
                "eth0",
                "nodad",
            ],
        )?;
        ip(ns, &["link", "set", "eth0", "up"])?;
    }
    Ok(())
}

/// Removes every lab namespace and the lab's pins; never fails.
fn cleanup() {
    if let Ok(out) = Command::new("ip").args(["netns", "list"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let Some(name) = line
                .split_whitespace()
                .next()
                .filter(|n| n.starts_with(PREFIX))
            {
                let _ = Command::new("ip").args(["netns", "del", name]).status();
            }
        }
    }
    let _ = std::fs::remove_dir_all(PIN_ROOT);
}

fn progress(message: &str) {
    println!("[lab] {message}");
}

fn ip(ns: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut full = vec!["-n", ns];
    full.extend_from_slice(args);
    sh_path("ip", &full)
}

fn sh_in(ns: &str, program: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut full = vec!["netns", "exec", ns, program];
    full.extend_from_slice(args);
    sh_path("ip", &full)
}

fn sh_path(program: &str, args: &[&str]) -> anyhow::Result<String> {
    sh(&PathBuf::from(program), args)
}

/// Runs a command and returns its stdout, failing with its stderr.
fn sh(program: &Path, args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {}", program.display()))?;
    if !out.status.success() {
        bail!(
            "{} {} failed: {}",
            program.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
