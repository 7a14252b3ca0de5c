//! The policy step: a MultiNetworkPolicy lets only one TCP port into a pod.
//!
//! The policy is installed by hand with `flatnet-agent datapath policy
//! attach` and `apply` on JSON files; this is the one place to change when
//! the agent installs policy from its own desired state.

use std::{fs, net::SocketAddr, path::Path};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::{
    netns::tcp_exchange,
    node::{Binaries, Node},
    process,
};

/// The port the policy lets in.
pub const ALLOWED_PORT: u16 = 8080;
/// A port the policy keeps out.
pub const BLOCKED_PORT: u16 = 9090;

/// A pod taking part in the policy step.
pub struct PolicyPod<'a> {
    pub netns: &'a str,
    pub ipv4: &'a str,
    pub ipv6: &'a str,
}

/// Isolates `server`'s ingress so that only TCP [`ALLOWED_PORT`] passes,
/// and checks from `client` (on another node) that it holds: before the
/// policy both ports answer; after it the allowed port answers over IPv4
/// and IPv6, the blocked one does not, and the programs counted the drop.
/// Echo servers on both ports must already run in `server`.
pub fn allow_only_one_port(
    bins: &Binaries,
    server_node: &Node,
    server: &PolicyPod,
    client: &PolicyPod,
) -> anyhow::Result<()> {
    let v4 = |port: u16| -> SocketAddr { format!("{}:{port}", server.ipv4).parse().unwrap() };
    let v6 = |port: u16| -> SocketAddr { format!("[{}]:{port}", server.ipv6).parse().unwrap() };
    if !tcp_exchange(client.netns, v4(BLOCKED_PORT))? {
        bail!("before any policy, TCP port {BLOCKED_PORT} should answer; it does not");
    }

    let dir = Path::new(super::topology::WORK_DIR).join("policy");
    fs::create_dir_all(&dir)?;
    let policies = dir.join("policies.json");
    let pods = dir.join("pods.json");
    fs::write(&policies, policy_json().to_string())?;
    fs::write(&pods, pods_json(server, client).to_string())?;
    let pin_root = server_node.pin_root.display().to_string();
    let agent = bins.agent.display().to_string();
    let netns = format!("/run/netns/{}", server.netns);
    process::run(
        &agent,
        &[
            "datapath",
            "policy",
            "attach",
            "--netns",
            &netns,
            "--interface",
            "eth1",
            "--pin-root",
            &pin_root,
        ],
    )?;
    let applied = process::run(
        &agent,
        &[
            "datapath",
            "policy",
            "apply",
            "--policies",
            &policies.display().to_string(),
            "--pods",
            &pods.display().to_string(),
            "--pin-root",
            &pin_root,
        ],
    )?;
    println!("[lab]       {}", applied.trim());

    for target in [v4(ALLOWED_PORT), v6(ALLOWED_PORT)] {
        if !tcp_exchange(client.netns, target)? {
            bail!("TCP to the allowed port {target} failed under the policy");
        }
    }
    for target in [v4(BLOCKED_PORT), v6(BLOCKED_PORT)] {
        if tcp_exchange(client.netns, target)? {
            bail!("TCP to {target} passed although the policy blocks it");
        }
    }
    let shown = process::run(
        &agent,
        &[
            "datapath",
            "policy",
            "show",
            "-o",
            "json",
            "--pin-root",
            &pin_root,
        ],
    )?;
    let shown: Value = serde_json::from_str(&shown).context("parse `policy show -o json`")?;
    let denied = shown["stats"]["denied_no_rule"].as_u64().unwrap_or(0);
    if denied == 0 {
        bail!(
            "the policy programs counted no denied packet: {}",
            shown["stats"]
        );
    }
    println!("[lab]       policy programs denied {denied} packets with no matching rule");
    Ok(())
}

/// Ingress of pods labelled `app=web`: TCP [`ALLOWED_PORT`] from anywhere.
fn policy_json() -> Value {
    json!({
        "apiVersion": "k8s.cni.cncf.io/v1beta1",
        "kind": "MultiNetworkPolicy",
        "metadata": {
            "name": "web-allow-8080",
            "namespace": "lab",
            "annotations": {"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}
        },
        "spec": {
            "podSelector": {"matchLabels": {"app": "web"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"ports": [{"protocol": "TCP", "port": ALLOWED_PORT}]}]
        }
    })
}

fn pods_json(server: &PolicyPod, client: &PolicyPod) -> Value {
    json!([
        {"namespace": "lab", "name": server.netns, "labels": {"app": "web"},
         "ips": [server.ipv4, server.ipv6], "local": true},
        {"namespace": "lab", "name": client.netns, "labels": {"app": "client"},
         "ips": [client.ipv4, client.ipv6], "local": false}
    ])
}
