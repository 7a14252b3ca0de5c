//! Per-packet cost of the policy programs, measured in the kernel with
//! `BPF_PROG_TEST_RUN` and `repeat`. Run through `cargo xtask bench-policy`
//! (root). Prints a Markdown table on stdout.
//!
//! The baselines are the uplink program (which only reads the EtherType of
//! an IPv4 frame: the cost of running any TC program at all) and the policy
//! program for a pod without policy (allow-all). The isolated cases install
//! N ingress rules, each allowing TCP 80 from its own /32, and send from the
//! last rule's address. Every case runs on the programs loaded with kernel
//! logs off and on; the uplink program also answers an ARP request, a
//! logged path, and records the sender of an ARP request and the target of
//! a neighbour advertisement in the wire inventory, and the requester of an
//! ARP request for a watched (floating) address in `RESOLVERS`.
//!
//! The policy programs track allowed flows, so repeating one frame measures
//! a tracked flow's later packets. The first packet of a flow (the full
//! judgement) is measured one run at a time on [`NEW_FLOWS`] frames that
//! differ in their source port; the kernel's timer around a single run adds
//! its own cost, shown by a calibration row that measures tracked packets
//! the same way.

use std::{collections::BTreeMap, net::Ipv4Addr};

use anyhow::{Context, bail};
use flatnet_agent::{
    datapath::{Datapath, DatapathConfig, PolicyMaps, PolicyRuleIds},
    policy_compiler::{FlatPod, MultiNetworkPolicy, NetworkNames, PolicyInputs, compile},
};
use flatnet_common::{policy::Direction, verdict};

/// Runs per measurement; the kernel reports the mean time per run.
const REPEAT: u32 = 1_000_000;
/// Measurements per case; the median is reported.
const ROUNDS: usize = 5;
/// New flows measured (one run each) per first-packet case; the median is reported.
const NEW_FLOWS: u16 = 2_001;
const POD: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
/// `BPF_PROG_TEST_RUN` runs the uplink program as if on the loopback interface.
const LOOPBACK_IFINDEX: u32 = 1;
/// The address the uplink program answers ARP requests for.
const ANSWERED: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 50);
/// A floating address another node answers for: its requesters are recorded.
const WATCHED: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 51);
const NODE_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0xbb];

fn main() -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("bench-policy needs root (it loads eBPF programs)");
    }
    let pin_root = std::path::Path::new(flatnet_common::pin::PIN_ROOT)
        .join(format!("bench-{}", std::process::id()));
    let result = run(&pin_root);
    let _ = std::fs::remove_dir_all(&pin_root);
    result
}

fn run(pin_root: &std::path::Path) -> anyhow::Result<()> {
    let config = DatapathConfig::pinned_at(pin_root);
    // The same object twice, kernel logs off and on; the second adopts the
    // maps the first pinned, so both see the same tables.
    let mut quiet = Datapath::load_with_kernel_logs(&config, false)?;
    let mut logging = Datapath::load_with_kernel_logs(&config, true)?;
    let mut maps = quiet.policy_maps()?;
    let mut ids = PolicyRuleIds::default();
    quiet
        .responders()?
        .insert(LOOPBACK_IFINDEX, ANSWERED.into(), NODE_MAC)?;
    // An object without the resolver maps (an older build measured side by
    // side) has no such case.
    let watching = match quiet.pinned_maps() {
        Ok(mut pinned) => match pinned.resolve_watch() {
            Ok(mut watch) => watch.insert(LOOPBACK_IFINDEX, WATCHED.into()).is_ok(),
            Err(_) => false,
        },
        Err(_) => false,
    };

    println!(
        "| case | rules | LPM entries | ns/packet, kernel logs off | ns/packet, kernel logs on | verdict |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | --- |");
    let frame = tcp_frame(peer(1), POD, 80);
    let mut uplink = |frame: &[u8]| -> anyhow::Result<(u32, u32)> {
        Ok((
            median(|| Ok(quiet.test_run_uplink(frame, REPEAT)?.duration_ns))?,
            median(|| Ok(logging.test_run_uplink(frame, REPEAT)?.duration_ns))?,
        ))
    };
    let (off, on) = uplink(&frame)?;
    println!("| baseline: uplink program (parse EtherType, pass) | – | – | {off} | {on} | pass |");
    let (off, on) = uplink(&arp_request(ANSWERED))?;
    println!("| uplink program: ARP request answered (logged) | – | – | {off} | {on} | redirect |");
    let (off, on) = uplink(&arp_request(Ipv4Addr::new(192, 0, 2, 99)))?;
    println!("| uplink program: ARP request not for us | – | – | {off} | {on} | pass |");
    if watching {
        let (off, on) = uplink(&arp_request(WATCHED))?;
        println!(
            "| uplink program: ARP request for a watched floating address (requester recorded) | – | – | {off} | {on} | pass |"
        );
    }
    let (off, on) = uplink(&lan_neighbor_advertisement())?;
    println!(
        "| uplink program: neighbour advertisement from a LAN host | – | – | {off} | {on} | pass |"
    );
    let (off, on) = measure(&mut quiet, &mut logging, &frame)?;
    println!(
        "| baseline: policy program, pod not isolated (allow-all), tracked flow | 0 | 0 | {off} | {on} | pass |"
    );
    let (off, on) = measure_new_flows(&mut quiet, &mut logging, peer(0), 20_000)?;
    println!(
        "| policy program, pod not isolated (allow-all), first packet of a flow † | 0 | 0 | {off} | {on} | pass |"
    );

    for (round, rules) in [1u32, 100, 10_000].into_iter().enumerate() {
        let entries = install(&mut maps, &mut ids, rules)?;
        let allowed = tcp_frame(peer(rules), POD, 80);
        let verdict = verdict_of(&mut quiet, &allowed)?;
        let (off, on) = measure(&mut quiet, &mut logging, &allowed)?;
        println!(
            "| isolated, allowed (last rule matches), tracked flow | {rules} | {entries} | {off} | {on} | {verdict} |"
        );
        if round == 0 {
            let (off, on) = measure_one_at_a_time(&mut quiet, &mut logging, &allowed)?;
            println!(
                "| isolated, allowed, tracked flow, one run at a time † (timer calibration) | {rules} | {entries} | {off} | {on} | {verdict} |"
            );
        }
        // Source ports no earlier case used, so every frame starts a flow.
        let first_port = 20_000 + (round as u16 + 1) * (2 * NEW_FLOWS);
        let (off, on) = measure_new_flows(&mut quiet, &mut logging, peer(rules), first_port)?;
        println!(
            "| isolated, allowed (last rule matches), first packet of a flow † | {rules} | {entries} | {off} | {on} | {verdict} |"
        );
        let denied = tcp_frame(Ipv4Addr::new(172, 16, 0, 1), POD, 80);
        let (off, on) = measure(&mut quiet, &mut logging, &denied)?;
        let verdict = verdict_of(&mut quiet, &denied)?;
        println!(
            "| isolated, denied (no rule matches) | {rules} | {entries} | {off} | {on} | {verdict} |"
        );
    }
    Ok(())
}

fn verdict_of(datapath: &mut Datapath, frame: &[u8]) -> anyhow::Result<&'static str> {
    Ok(
        match datapath
            .test_run_policy(Direction::Ingress, frame, 1)?
            .verdict
        {
            verdict::DROP => "drop",
            verdict::PASS => "pass",
            _ => "other",
        },
    )
}

/// The ingress policy program's cost on `frame`, kernel logs off and on.
fn measure(
    quiet: &mut Datapath,
    logging: &mut Datapath,
    frame: &[u8],
) -> anyhow::Result<(u32, u32)> {
    let cost = |datapath: &mut Datapath| {
        median(|| {
            Ok(datapath
                .test_run_policy(Direction::Ingress, frame, REPEAT)?
                .duration_ns)
        })
    };
    Ok((cost(quiet)?, cost(logging)?))
}

/// The ingress policy program's cost on the first packet of a flow from
/// `src`, kernel logs off and on: [`NEW_FLOWS`] frames with source ports
/// from `first_port` on (the next [`NEW_FLOWS`] ports for the logging
/// programs, which share the tracking map), one run each; the medians.
fn measure_new_flows(
    quiet: &mut Datapath,
    logging: &mut Datapath,
    src: Ipv4Addr,
    first_port: u16,
) -> anyhow::Result<(u32, u32)> {
    let frames = |first: u16| {
        (first..first + NEW_FLOWS).map(move |port| tcp_frame_from_port(src, port, POD, 80))
    };
    Ok((
        median_of_single_runs(quiet, frames(first_port))?,
        median_of_single_runs(logging, frames(first_port + NEW_FLOWS))?,
    ))
}

/// The ingress policy program's cost on `frame` measured like
/// [`measure_new_flows`] (one run per measurement), kernel logs off and on.
fn measure_one_at_a_time(
    quiet: &mut Datapath,
    logging: &mut Datapath,
    frame: &[u8],
) -> anyhow::Result<(u32, u32)> {
    let frames = || (0..NEW_FLOWS).map(|_| frame.to_vec());
    Ok((
        median_of_single_runs(quiet, frames())?,
        median_of_single_runs(logging, frames())?,
    ))
}

/// The ingress policy program's median cost over `frames`, one run each.
fn median_of_single_runs(
    datapath: &mut Datapath,
    frames: impl Iterator<Item = Vec<u8>>,
) -> anyhow::Result<u32> {
    let mut values = frames
        .map(|frame| {
            Ok(datapath
                .test_run_policy(Direction::Ingress, &frame, 1)?
                .duration_ns)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    values.sort_unstable();
    Ok(values[values.len() / 2])
}

fn median(mut sample: impl FnMut() -> anyhow::Result<u32>) -> anyhow::Result<u32> {
    let mut values = (0..ROUNDS)
        .map(|_| sample())
        .collect::<anyhow::Result<Vec<_>>>()?;
    values.sort_unstable();
    Ok(values[ROUNDS / 2])
}

/// The address of rule `n` (1-based): 10.128.0.0 + n.
fn peer(n: u32) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 128, 0, 0)) + n)
}

/// Installs a policy with `rules` ingress rules for the pod; returns the LPM entries.
fn install(maps: &mut PolicyMaps, ids: &mut PolicyRuleIds, rules: u32) -> anyhow::Result<usize> {
    let ingress: Vec<serde_json::Value> = (1..=rules)
        .map(|n| {
            serde_json::json!({
                "from": [{"ipBlock": {"cidr": format!("{}/32", peer(n))}}],
                "ports": [{"protocol": "TCP", "port": 80}]
            })
        })
        .collect();
    let policy: MultiNetworkPolicy = serde_json::from_value(serde_json::json!({
        "apiVersion": "k8s.cni.cncf.io/v1beta1", "kind": "MultiNetworkPolicy",
        "metadata": {"name": "bench", "namespace": "a",
                     "annotations": {"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": ingress}
    }))
    .context("benchmark policy")?;
    let pods = [FlatPod {
        namespace: "a".into(),
        name: "bench".into(),
        labels: BTreeMap::new(),
        ips: vec![POD.into()],
        local: true,
    }];
    let compiled = compile(PolicyInputs {
        policies: &[policy],
        networks: &NetworkNames::default(),
        namespaces: &BTreeMap::new(),
        pods: &pods,
    });
    maps.apply(&compiled, ids)?;
    Ok(compiled.entry_count())
}

/// A broadcast ARP request for `target`.
fn arp_request(target: Ipv4Addr) -> Vec<u8> {
    let mut f = vec![0xff; 6];
    f.extend_from_slice(&[0x02, 0, 0, 0, 0, 1, 0x08, 0x06]);
    f.extend_from_slice(&[0, 1, 8, 0, 6, 4, 0, 1, 0x02, 0, 0, 0, 0, 1, 192, 0, 2, 200]);
    f.extend_from_slice(&[0; 6]);
    f.extend_from_slice(&target.octets());
    f
}

/// An unsolicited neighbour advertisement of 2001:db8::c8 with its target
/// link-layer option, from a LAN host.
fn lan_neighbor_advertisement() -> Vec<u8> {
    let target: std::net::Ipv6Addr = "2001:db8::c8".parse().expect("literal");
    flatnet_agent::packet::ndp_frame(
        [0x02, 0, 0, 0, 0, 1],
        [0x33, 0x33, 0, 0, 0, 1],
        target,
        "ff02::1".parse().expect("literal"),
        flatnet_agent::packet::NdpMessage::NeighborAdvertisement {
            target,
            solicited: false,
            override_flag: true,
        },
    )
    .expect("a fixed frame builds")
}

/// Ethernet + IPv4 + TCP header (SYN) from `src:40000` to `dst:port`.
fn tcp_frame(src: Ipv4Addr, dst: Ipv4Addr, port: u16) -> Vec<u8> {
    tcp_frame_from_port(src, 40000, dst, port)
}

/// Ethernet + IPv4 + TCP header (SYN) from `src:src_port` to `dst:port`.
fn tcp_frame_from_port(src: Ipv4Addr, src_port: u16, dst: Ipv4Addr, port: u16) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    let mut ip = vec![0x45, 0, 0, 40, 0, 1, 0x40, 0, 64, 6, 0, 0];
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    f.extend_from_slice(&ip);
    let mut tcp = vec![0u8; 20];
    tcp[0..2].copy_from_slice(&src_port.to_be_bytes());
    tcp[2..4].copy_from_slice(&port.to_be_bytes());
    tcp[12] = 0x50;
    tcp[13] = 0x02;
    f.extend_from_slice(&tcp);
    f
}
