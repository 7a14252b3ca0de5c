//! Kubernetes-mode ADD against standalone ADD, in one process: the time
//! from the CNI request reaching the agent's handler to its answer, when
//! the pod's FlatNetworkIP is already allocated. Run through
//! `cargo xtask bench cni --kubernetes` (root). Prints a Markdown table.
//!
//! Two CNI services of the agent run side by side on one node namespace,
//! each on its own master (a veth whose peer is in a LAN namespace), with
//! their own records and pinned maps: one with the Kubernetes desired
//! state against the operator's in-memory API server (`FakeApiServer`,
//! every request delayed by `--latency-ms`), one with the standalone
//! desired state (its allocation file). Their ADD+DEL pairs alternate, a
//! fresh pod namespace each. Before each Kubernetes ADD the operator's
//! part is done: the pod's FlatNetworkIP exists, allocated. Two Kubernetes
//! modes: with the agent's watch-driven copies of the FlatNetworkIPs and
//! subnets (`Kubernetes::follow_allocations`, the agent's default; the
//! ADD starts once the copy holds the allocation, as it does when the
//! operator allocated before the runtime called), and without them (a
//! list of the FlatNetworkIP, a lookup of a second record, the subnet).
//! Both apply the node label and the Active status right after answering;
//! the DEL waits for them (untimed), so the requests column counts them.
//!
//! What the runtime sees on top (starting `flatnet-cni`, the socket round
//! trip) is the same for both modes; `cargo xtask bench cni` measures it.

#[path = "../tests/support/mod.rs"]
mod support;

use std::{
    ffi::OsString,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use flatnet_agent::{
    cni::{CniEnv, CniRequest, Invocation},
    cni_service::{AgentService, ServiceConfig},
    datapath::{Datapath, DatapathConfig},
    desired::{
        DesiredState,
        kubernetes::Kubernetes,
        standalone::{Standalone, StateFile},
    },
    link::Attachments,
    metrics::Metrics,
    records::Records,
    rpc::CniHandler,
};
use flatnet_k8s::{
    api::{FlatNetworkIP, FlatNetworkSubnet},
    keys::SUBNET_NAMESPACE,
};
use flatnet_operator::allocation::fake_api::{FakeApiServer, Realism};
use kube::ResourceExt;
use serde_json::json;
use support::{TestNetns, TestPinRoot, unique_name, veth_pair};

/// Unmeasured pairs per mode before the measured ones.
const WARM_UP: usize = 5;
/// The CNI network both modes serve.
const NETWORK: &str = "flatnet-bench";

fn main() -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("bench_cni_kubernetes needs root (namespaces, eBPF programs)");
    }
    let args: Vec<String> = std::env::args().collect();
    let iterations: usize = arg(&args, "--iterations").unwrap_or(100);
    let latencies: Vec<u64> = arg::<String>(&args, "--latency-ms")
        .unwrap_or_else(|| "0,1".into())
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .context("--latency-ms takes milliseconds, comma-separated")?;
    let runtime = tokio::runtime::Runtime::new()?;
    println!(
        "| desired state | API latency per request | ADD p50 | ADD p99 | ADD p50 − standalone p50 (same run) | API requests per ADD |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: |");
    for latency in latencies {
        let run = runtime.block_on(measure(iterations, Duration::from_millis(latency)))?;
        let standalone = p50(&run.adds[STANDALONE]);
        println!(
            "| standalone (same run) | – | {} | {} | | |",
            ms(standalone),
            ms(p99(&run.adds[STANDALONE])),
        );
        for (mode, label) in [
            (
                FOLLOWED,
                "Kubernetes, allocations followed (the agent's default)",
            ),
            (READ, "Kubernetes, allocation read per ADD"),
        ] {
            println!(
                "| {label} | {latency} ms | {} | {} | {} | {:.1} |",
                ms(p50(&run.adds[mode])),
                ms(p99(&run.adds[mode])),
                ms(p50(&run.adds[mode]) - standalone),
                run.requests_per_add[mode],
            );
        }
    }
    Ok(())
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1)?.parse().ok()
}

/// The modes, in the order of [`Run::adds`].
const STANDALONE: usize = 0;
/// Kubernetes with [`Kubernetes::follow_allocations`].
const FOLLOWED: usize = 1;
/// Kubernetes reading the allocation from the API server on each ADD.
const READ: usize = 2;

/// ADD durations of each mode from one run, sorted, in seconds.
struct Run {
    adds: [Vec<f64>; 3],
    requests_per_add: [f64; 3],
}

/// The node, its masters and the services of every mode.
async fn measure(iterations: usize, latency: Duration) -> anyhow::Result<Run> {
    let node = TestNetns::new("kn");
    let lan = TestNetns::new("kl");
    let masters = [unique_name("sm"), unique_name("fm"), unique_name("rm")];
    for master in &masters {
        let peer = unique_name("lp");
        veth_pair(&node, master, &lan, &peer);
        node.ip(&["link", "set", master, "up"]);
        lan.ip(&["link", "set", &peer, "up"]);
    }
    let dir = tempfile::tempdir()?;
    let pins = [TestPinRoot::new(), TestPinRoot::new(), TestPinRoot::new()];

    let state = StateFile::parse(
        &dir.path().join("state.yaml"),
        &format!(
            "subnets:\n  - name: bench\n    spec:\n      flatMode: macvlan\n      master: {}\n      \
             cidr: 198.18.0.0/15\n      ranges: [{{from: 198.18.8.0, to: 198.18.15.255}}]\n\
             networks:\n  - {{name: {NETWORK}, subnets: [bench]}}\n",
            masters[STANDALONE]
        ),
    )?
    .validate()
    .map_err(|problems| anyhow::anyhow!("state file: {}", problems.join("; ")))?;
    let standalone = service(
        &node,
        &dir.path().join("s"),
        &pins[STANDALONE],
        Standalone::open(state, &dir.path().join("s/state"))?,
    )?;
    // One API server per Kubernetes mode, each with its own subnet.
    let apis = [FOLLOWED, READ].map(|mode| {
        let api = FakeApiServer::realistic(Realism {
            latency,
            ..Realism::default()
        });
        api.insert(&subnet_object(&masters[mode]));
        api
    });
    let followed = Kubernetes::new(apis[0].client(), "bench-node", Duration::from_secs(30));
    followed.follow_allocations();
    while !followed.allocations_followed() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let followed = service(&node, &dir.path().join("f"), &pins[FOLLOWED], followed)?;
    let read = service(
        &node,
        &dir.path().join("r"),
        &pins[READ],
        Kubernetes::new(apis[1].client(), "bench-node", Duration::from_secs(30)),
    )?;

    let mut run = Run {
        adds: Default::default(),
        requests_per_add: [0.0; 3],
    };
    let mut requests = [0; 3];
    for i in 0..WARM_UP + iterations {
        // A different mode goes first each time.
        for step in 0..3 {
            let mode = (i + step) % 3;
            let pod = TestNetns::new("kp");
            let (took, asked) = match mode {
                STANDALONE => (add_then_del(&standalone, i, &pod, None).await?, 0),
                _ => {
                    let api = &apis[mode - 1];
                    api.insert(&allocated_ip(i));
                    // The operator's write reaches the agent's copy first.
                    if mode == FOLLOWED {
                        wait_for_copy(followed.desired(), i).await;
                    }
                    let before = api.requests();
                    let took = if mode == FOLLOWED {
                        add_then_del(&followed, i, &pod, Some(api)).await?
                    } else {
                        add_then_del(&read, i, &pod, Some(api)).await?
                    };
                    (took, api.requests() - before)
                }
            };
            if i >= WARM_UP {
                run.adds[mode].push(took.as_secs_f64());
                requests[mode] += asked;
            }
        }
    }
    for (mode, adds) in run.adds.iter_mut().enumerate() {
        adds.sort_by(f64::total_cmp);
        // ADD and DEL together; DEL asks nothing in Kubernetes mode.
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        {
            run.requests_per_add[mode] = requests[mode] as f64 / iterations as f64;
        }
    }
    Ok(run)
}

/// Waits until the copy of `desired` holds pod `i`'s allocation (its
/// watch delivers the operator's write within the API latency).
async fn wait_for_copy(desired: &Kubernetes, i: usize) {
    while !desired.follows(&namespace(i), "pod") {
        tokio::task::yield_now().await;
    }
}

/// A CNI service on `node` with its records in `dir` and maps under `pin`.
fn service<S: DesiredState>(
    node: &TestNetns,
    dir: &std::path::Path,
    pin: &TestPinRoot,
    desired: S,
) -> anyhow::Result<AgentService<S>> {
    let datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path))
        .context("load the eBPF object (run `cargo xtask build-ebpf`)")?;
    let attachments = Attachments {
        host_netns: Some(node.path()),
        lease_dir: dir.join("leases"),
        ..Attachments::default()
    };
    Ok(AgentService::new(
        ServiceConfig {
            node_name: "bench-node".into(),
            attachments,
            // The reference plugin has no conflict probe (as in `bench cni`).
            settings: flatnet_agent::cluster_settings::SettingsView::fixed(
                flatnet_agent::cluster_settings::AgentSettings {
                    probe_wait: Duration::ZERO,
                    policy_enforcement: true,
                    arp_policy: flatnet_agent::link::ArpPolicy::default(),
                    proxy_arp: false,
                },
            ),
            pod_sandboxes: None,
            spec: Default::default(),
        },
        desired,
        Records::open(&dir.join("records"))?,
        datapath,
        Arc::new(Metrics::default()),
    )?)
}

/// One ADD of pod `i` in `pod`, timed, then its DEL.
async fn add_then_del<S: DesiredState>(
    service: &AgentService<S>,
    i: usize,
    pod: &TestNetns,
    api: Option<&FakeApiServer>,
) -> anyhow::Result<Duration> {
    let add = request("ADD", i, pod)?;
    let CniRequest::Add(add) = add else {
        bail!("not an ADD")
    };
    let started = Instant::now();
    service
        .add(add)
        .await
        .map_err(|e| anyhow::anyhow!("ADD {i}: {}", e.msg))?;
    let took = started.elapsed();
    // The Active status follows the answer; a DEL would stop it.
    while api.is_some_and(|api| !reported_active(api, i)) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let CniRequest::Del(del) = request("DEL", i, pod)? else {
        bail!("not a DEL")
    };
    service
        .del(del)
        .await
        .map_err(|e| anyhow::anyhow!("DEL {i}: {}", e.msg))?;
    Ok(took)
}

/// Whether pod `i`'s FlatNetworkIP is Active in `api`.
fn reported_active(api: &FakeApiServer, i: usize) -> bool {
    api.list::<FlatNetworkIP>().iter().any(|ip| {
        ip.namespace().as_deref() == Some(namespace(i).as_str())
            && ip.status.as_ref().is_some_and(|s| s.phase == "Active")
    })
}

/// The request `flatnet-cni` would send for `command` of pod `i`.
fn request(command: &str, i: usize, pod: &TestNetns) -> anyhow::Result<CniRequest> {
    let netns = pod.path().display().to_string();
    let container = format!("bench{i:06}");
    let args = format!(
        "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME=pod;K8S_POD_UID=uid-{i}",
        namespace(i)
    );
    let lookup = |name: &str| -> Option<OsString> {
        Some(OsString::from(match name {
            "CNI_COMMAND" => command,
            "CNI_CONTAINERID" => &container,
            "CNI_NETNS" => &netns,
            "CNI_IFNAME" => "eth0",
            "CNI_ARGS" => &args,
            "CNI_PATH" => "/opt/cni/bin",
            _ => return None,
        }))
    };
    let env = CniEnv::from_lookup(lookup).map_err(|e| anyhow::anyhow!("{}", e.msg))?;
    let config = json!({"cniVersion": "1.0.0", "name": NETWORK, "type": "flatnet-cni"});
    match Invocation::parse(&env, config.to_string().as_bytes())
        .map_err(|e| anyhow::anyhow!("{}", e.msg))?
    {
        Invocation::Request(request) => Ok(*request),
        _ => bail!("{command} parses into no request"),
    }
}

/// Each pod in its own namespace: the in-memory server does not filter
/// by field selector, so one FlatNetworkIP per namespace keeps the agent's
/// watch on its own object.
fn namespace(i: usize) -> String {
    format!("bench-{i}")
}

fn subnet_object(master: &str) -> FlatNetworkSubnet {
    serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1",
        "kind": "FlatNetworkSubnet",
        "metadata": {"name": "bench", "namespace": SUBNET_NAMESPACE},
        "spec": {"flatMode": "macvlan", "master": master, "cidr": "198.18.0.0/15"}
    }))
    .expect("a valid subnet")
}

/// Pod `i`'s FlatNetworkIP as the operator leaves it: allocated.
fn allocated_ip(i: usize) -> FlatNetworkIP {
    serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1",
        "kind": "FlatNetworkIP",
        "metadata": {"name": "pod", "namespace": namespace(i)},
        "spec": {"subnet": "bench", "podId": format!("uid-{i}")},
        "status": {"phase": "Allocated", "addr": format!("198.18.{}.{}", 1 + i / 250, 1 + i % 250)}
    }))
    .expect("a valid FlatNetworkIP")
}

fn p50(sorted: &[f64]) -> f64 {
    sorted[sorted.len() / 2]
}

fn p99(sorted: &[f64]) -> f64 {
    sorted[(sorted.len() * 99 / 100).min(sorted.len() - 1)]
}

fn ms(seconds: f64) -> String {
    format!("{:.2} ms", seconds * 1000.0)
}
