//! The policy step: a MultiNetworkPolicy lets only one TCP port into a pod.
//!
//! The policy goes into the server node's state file; the agent notices the
//! edit, compiles it and installs the tables on the programs it attached to
//! the pod interface at ADD. Nothing is attached or applied by hand.

use std::{fs, net::SocketAddr, time::Duration};

use anyhow::{Context, bail};
use serde_json::Value;

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

    let state_file = server_node.state_file_path();
    let mut state = fs::read_to_string(&state_file)
        .with_context(|| format!("read {}", state_file.display()))?;
    state.push_str(&policy_yaml(server.netns));
    fs::write(&state_file, state).with_context(|| format!("write {}", state_file.display()))?;
    let pin_root = server_node.pin_root.display().to_string();
    let agent = bins.agent.display().to_string();
    let show = || -> anyhow::Result<Value> {
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
        serde_json::from_str(&shown).context("parse `policy show -o json`")
    };
    wait_until_isolated(&show, server)?;
    println!(
        "[lab]       {}: the agent reloaded its state file and isolated {} and {}",
        server_node.netns, server.ipv4, server.ipv6
    );

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
    let shown = show()?;
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

/// Waits (bounded) until the agent has installed tables that isolate both
/// of `server`'s addresses for ingress.
fn wait_until_isolated(
    show: &dyn Fn() -> anyhow::Result<Value>,
    server: &PolicyPod,
) -> anyhow::Result<()> {
    for _ in 0..100 {
        let shown = show()?;
        let isolated = shown.to_string();
        if isolated.contains(&format!("\"{}\"", server.ipv4))
            && isolated.contains(&format!("\"{}\"", server.ipv6))
        {
            return Ok(());
        }
        process::sleep(Duration::from_millis(100))?;
    }
    bail!("the agent did not install the state file's policy within 10 s (see its log)")
}

/// The state-file sections: ingress of pods labelled `app=web` allows TCP
/// [`ALLOWED_PORT`] from anywhere, and `server_pod` carries that label.
fn policy_yaml(server_pod: &str) -> String {
    format!(
        r#"policies:
  - apiVersion: k8s.cni.cncf.io/v1beta1
    kind: MultiNetworkPolicy
    metadata:
      name: web-allow-{ALLOWED_PORT}
      namespace: lab
    spec:
      podSelector: {{matchLabels: {{app: web}}}}
      policyTypes: [Ingress]
      ingress: [{{ports: [{{protocol: TCP, port: {ALLOWED_PORT}}}]}}]
pods:
  lab/{server_pod}: {{app: web}}
"#
    )
}
