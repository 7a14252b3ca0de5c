//! The cluster `cargo xtask bench cni` runs the installed agent against:
//! the operator's in-memory API server over HTTP on a loopback port, with
//! the operator's allocation controllers, the agent's requests authorized
//! by the chart's rules, the Node `bench-node`, the FlatNetworkSubnet
//! `bench` on the master named by `--master` (198.18.0.0/15, gateway
//! 198.18.0.1, pods from `--first` to `--last`), and a MultiNetworkPolicy
//! denying ingress to every pod of namespace `bench` on network
//! `flatnet-bench`, so each pod's ADD installs a policy in force.
//!
//! It prints `kubeconfig <path>` then `ready`, and then serves commands,
//! one per line on stdin, each answered by `done` (or `error <why>`):
//!
//! - `create A B`: the pods `bench/pod-A` to `pod-(B-1)`, bound to the
//!   node with a flat attachment on `bench`; answered once the operator
//!   allocated every one (their FlatNetworkIPs have an address);
//! - `active A B`: answered once those FlatNetworkIPs are Active (the
//!   agent reports it after ADD's answer);
//! - `delete A B`: deletes those pods (the operator releases their
//!   addresses in its own time).

#[path = "../tests/support/mod.rs"]
mod support;

use std::{
    io::{BufRead, Write},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use flatnet_agent::policy_compiler::MultiNetworkPolicy;
use flatnet_k8s::{api::FlatNetworkIP, keys::SUBNET_NAMESPACE};
use flatnet_operator::allocation::fake_api::FakeApiServer;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::json;
use support::agent::{insert_node, serve_with_allocation};

const NAMESPACE: &str = "bench";
const NODE: &str = "bench-node";
/// How long the operator may take for a command before it fails.
const COMMAND_LIMIT: Duration = Duration::from_secs(60);

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| -> anyhow::Result<String> {
        let at = args
            .iter()
            .position(|a| a == name)
            .with_context(|| format!("{name} is required"))?;
        args.get(at + 1)
            .cloned()
            .with_context(|| format!("{name} takes a value"))
    };
    let (master, first, last, dir) = (
        arg("--master")?,
        arg("--first")?,
        arg("--last")?,
        arg("--dir")?,
    );
    let runtime = tokio::runtime::Runtime::new()?;
    let server = FakeApiServer::new();
    server.insert(&subnet(&master, &first, &last)?);
    insert_node(&server, NODE);
    server.insert(&deny_ingress()?);
    let kubeconfig = std::path::Path::new(&dir).join("kubeconfig");
    serve_with_allocation(&runtime, &server, None, &kubeconfig);
    let mut out = std::io::stdout().lock();
    writeln!(out, "kubeconfig {}", kubeconfig.display())?;
    writeln!(out, "ready")?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        match serve(&server, &line) {
            Ok(()) => writeln!(out, "done")?,
            Err(error) => writeln!(out, "error {error:#}")?,
        }
        out.flush()?;
    }
    Ok(())
}

/// Carries out one command line.
fn serve(server: &FakeApiServer, line: &str) -> anyhow::Result<()> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let [command, from, to] = words[..] else {
        bail!("expected `<create|active|delete> A B`, got {line:?}");
    };
    let range = from.parse::<usize>()?..to.parse::<usize>()?;
    match command {
        "create" => {
            for i in range.clone() {
                server.insert(&pod(i)?);
            }
            wait_for(server, "allocations", |ips| {
                range.clone().all(|i| {
                    ip_of(ips, i)
                        .is_some_and(|ip| ip.status.as_ref().is_some_and(|s| s.addr.is_some()))
                })
            })
        }
        "active" => wait_for(server, "Active statuses", |ips| {
            range.clone().all(|i| {
                ip_of(ips, i)
                    .is_some_and(|ip| ip.status.as_ref().is_some_and(|s| s.phase == "Active"))
            })
        }),
        "delete" => {
            for i in range {
                server.delete::<Pod>(NAMESPACE, &pod_name(i));
            }
            Ok(())
        }
        _ => bail!("unknown command {command:?}"),
    }
}

/// Polls the FlatNetworkIPs until `done` holds them, at most [`COMMAND_LIMIT`].
fn wait_for(
    server: &FakeApiServer,
    what: &str,
    done: impl Fn(&[FlatNetworkIP]) -> bool,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + COMMAND_LIMIT;
    while !done(&server.list::<FlatNetworkIP>()) {
        if Instant::now() > deadline {
            bail!("no {what} within {COMMAND_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

fn ip_of(ips: &[FlatNetworkIP], i: usize) -> Option<&FlatNetworkIP> {
    let name = pod_name(i);
    ips.iter()
        .find(|ip| ip.name_any() == name && ip.namespace().as_deref() == Some(NAMESPACE))
}

fn pod_name(i: usize) -> String {
    format!("pod-{i}")
}

/// Pod `i` as kubelet finds it once scheduled: bound to the node, a flat
/// attachment on `bench` with an automatic address.
fn pod(i: usize) -> anyhow::Result<Pod> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod_name(i), "namespace": NAMESPACE, "uid": format!("uid-{i}"),
                     "labels": {"app": "bench"},
                     "annotations": {"flatnetwork.pandaria.io/ip": "auto",
                                     "flatnetwork.pandaria.io/subnet": "bench"}},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "pause"}]},
        "status": {"phase": "Pending"}
    }))?)
}

fn subnet(
    master: &str,
    first: &str,
    last: &str,
) -> anyhow::Result<flatnet_k8s::api::FlatNetworkSubnet> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
        "metadata": {"name": "bench", "namespace": SUBNET_NAMESPACE},
        "spec": {"flatMode": "macvlan", "master": master, "mode": "bridge",
                 "cidr": "198.18.0.0/15", "gateway": "198.18.0.1",
                 "ranges": [{"from": first, "to": last}]}
    }))?)
}

/// Every ingress to the pods of [`NAMESPACE`] on `flatnet-bench` denied.
fn deny_ingress() -> anyhow::Result<MultiNetworkPolicy> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "k8s.cni.cncf.io/v1beta1", "kind": "MultiNetworkPolicy",
        "metadata": {"name": "deny-ingress", "namespace": NAMESPACE,
                     "annotations": {"k8s.v1.cni.cncf.io/policy-for": "flatnet-bench"}},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}
    }))?)
}
