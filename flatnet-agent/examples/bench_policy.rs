//! Per-packet cost of the policy programs, measured in the kernel with
//! `BPF_PROG_TEST_RUN` and `repeat`. Run through `cargo xtask bench-policy`
//! (root). Prints a Markdown table on stdout.
//!
//! Every case runs the same IPv4 TCP frame; the baselines are the uplink
//! program (which only reads the EtherType of an IPv4 frame: the cost of
//! running any TC program at all) and the policy program for a pod without
//! policy (allow-all). The isolated cases install N ingress rules, each
//! allowing TCP 80 from its own /32, and send from the last rule's address.

use std::{collections::BTreeMap, net::Ipv4Addr};

use anyhow::{Context, bail};
use flatnet_agent::{
    datapath::{Datapath, DatapathConfig, PolicyMaps, PolicyRuleIds},
    policy::{FlatPod, MultiNetworkPolicy, NetworkNames, PolicyInputs, compile},
};
use flatnet_common::policy::Direction;

/// Runs per measurement; the kernel reports the mean time per run.
const REPEAT: u32 = 1_000_000;
/// Measurements per case; the median is reported.
const ROUNDS: usize = 5;
const POD: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);

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
    let mut datapath = Datapath::load(&DatapathConfig {
        pin_root: pin_root.to_path_buf(),
    })?;
    let mut maps = datapath.policy_maps()?;
    let mut ids = PolicyRuleIds::default();

    println!(
        "| case | rules | LPM entries | ns/packet (median of {ROUNDS} × {REPEAT} runs) | verdict |"
    );
    println!("| --- | ---: | ---: | ---: | --- |");
    let frame = tcp_frame(peer(1), POD, 80);
    let ns = median(|| Ok(datapath.test_run_uplink(&frame, REPEAT)?.duration_ns))?;
    println!("| baseline: uplink program (parse EtherType, pass) | – | – | {ns} | pass |");
    let ns = median(|| {
        Ok(datapath
            .test_run_policy(Direction::Ingress, &frame, REPEAT)?
            .duration_ns)
    })?;
    println!("| baseline: policy program, pod not isolated (allow-all) | 0 | 0 | {ns} | pass |");

    for rules in [1u32, 100, 10_000] {
        let entries = install(&mut maps, &mut ids, rules)?;
        let allowed = tcp_frame(peer(rules), POD, 80);
        let (ns, verdict) = measure(&mut datapath, &allowed)?;
        println!(
            "| isolated, allowed (last rule matches) | {rules} | {entries} | {ns} | {verdict} |"
        );
        let denied = tcp_frame(Ipv4Addr::new(172, 16, 0, 1), POD, 80);
        let (ns, verdict) = measure(&mut datapath, &denied)?;
        println!("| isolated, denied (no rule matches) | {rules} | {entries} | {ns} | {verdict} |");
    }
    Ok(())
}

fn measure(datapath: &mut Datapath, frame: &[u8]) -> anyhow::Result<(u32, &'static str)> {
    let verdict = match datapath
        .test_run_policy(Direction::Ingress, frame, 1)?
        .verdict
    {
        2 => "drop",
        3 => "pass",
        _ => "other",
    };
    let ns = median(|| {
        Ok(datapath
            .test_run_policy(Direction::Ingress, frame, REPEAT)?
            .duration_ns)
    })?;
    Ok((ns, verdict))
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

/// Ethernet + IPv4 + TCP header (SYN) from `src` to `dst:port`.
fn tcp_frame(src: Ipv4Addr, dst: Ipv4Addr, port: u16) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    let mut ip = vec![0x45, 0, 0, 40, 0, 1, 0x40, 0, 64, 6, 0, 0];
    ip.extend_from_slice(&src.octets());
    ip.extend_from_slice(&dst.octets());
    f.extend_from_slice(&ip);
    let mut tcp = vec![0u8; 20];
    tcp[0..2].copy_from_slice(&40000u16.to_be_bytes());
    tcp[2..4].copy_from_slice(&port.to_be_bytes());
    tcp[12] = 0x50;
    tcp[13] = 0x02;
    f.extend_from_slice(&tcp);
    f
}
