//! Latency from a foreign claim on the wire to the Kubernetes Event and the
//! FlatNetworkIP condition. Run through `cargo xtask bench conflicts` (root).
//! Prints a Markdown table on stdout.
//!
//! A node namespace's uplink (one end of a veth pair) runs the uplink
//! program with N managed addresses, each the address of a recorded pod. A
//! rogue namespace on the other end sends one gratuitous ARP reply per
//! address from a foreign MAC (raw `AF_PACKET`), noting the time just before
//! each send. The agent's own conflict path follows: ring buffer →
//! `ConflictMonitor` → `AgentService::watch_conflicts` (metric, log line,
//! per-address rate limit) → `Kubernetes::report_conflict` against an
//! in-process API server (`tower-test`), which notes when each Event POST
//! and each status patch arrives. Distinct addresses keep the per-address
//! rate limits (kernel and agent) out of the way.

#[path = "../tests/support/mod.rs"]
mod support;

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use etherparse::ArpOperation;
use flatnet_agent::{
    cni_service::{AgentService, ServiceConfig},
    datapath::{Datapath, DatapathConfig},
    desired::{AttachmentKey, PodRef, kubernetes::Kubernetes},
    metrics::Metrics,
    netns::run_in_netns,
    packet::{BROADCAST, RawSocket, arp_frame},
    records::{AttachmentRecord, RecordPhase, Records, UplinkRecord},
};
use http::{Request, Response, StatusCode};
use kube::client::Body;
use serde_json::{Value, json};
use support::{TestNetns, TestPinRoot, veth_pair};

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

const NAMESPACE: &str = "bench";
const OWNER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0a];
const ROGUE_MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x00, 0x00, 0xee];
/// How long to wait for the last report after the last frame.
const DRAIN: Duration = Duration::from_secs(10);

/// When each conflict's frame was sent and its reports arrived.
#[derive(Default)]
struct Timeline {
    sent: Vec<Option<Instant>>,
    event: Vec<Option<Instant>>,
    condition: Vec<Option<Instant>>,
}

fn main() -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("bench_conflicts needs root (namespaces, eBPF programs)");
    }
    let args: Vec<String> = std::env::args().collect();
    let count: usize = arg(&args, "--addresses").unwrap_or(200);
    let interval = Duration::from_millis(arg(&args, "--interval-ms").unwrap_or(10));
    // The agent's runtime; the conflict path shares it with nothing else here.
    let runtime = tokio::runtime::Runtime::new()?;
    let paced = runtime.block_on(measure(count, interval))?;
    let burst = runtime.block_on(measure(count, Duration::ZERO))?;
    println!(
        "| Sending | Conflicts reported | Frame → Event p50 / p99 / max | Frame → condition p50 / p99 / max |"
    );
    println!("|---|---|---|---|");
    for (label, timeline) in [
        (
            format!("one frame every {} ms", interval.as_millis()),
            paced,
        ),
        ("all frames back to back".to_owned(), burst),
    ] {
        println!(
            "| {label} | {} / {count} | {} | {} |",
            timeline.condition.iter().flatten().count(),
            summary(&timeline.sent, &timeline.event),
            summary(&timeline.sent, &timeline.condition),
        );
    }
    Ok(())
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    let at = args.iter().position(|a| a == name)?;
    args.get(at + 1)?.parse().ok()
}

/// One run over fresh namespaces, tables and records.
async fn measure(count: usize, interval: Duration) -> anyhow::Result<Timeline> {
    let node = TestNetns::new("fb-node");
    let rogue = TestNetns::new("fb-rogue");
    let uplink = support::unique_name("up");
    let rogue_if = support::unique_name("rg");
    veth_pair(&node, &uplink, &rogue, &rogue_if);
    rogue.sysctl("net.ipv6.conf.all.disable_ipv6", "1");
    node.ip(&["link", "set", &uplink, "up"]);
    rogue.ip(&["link", "set", &rogue_if, "up"]);

    let pin = TestPinRoot::new();
    let mut datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path))
        .context("load the eBPF object (run `cargo xtask build-ebpf`)")?;
    let ifindex = run_in_netns(&node.path(), || -> anyhow::Result<u32> {
        datapath.attach_uplink(&uplink)?;
        Ok(nix::net::if_::if_nametoindex(uplink.as_str())?)
    })??;

    let records_dir = tempfile::tempdir()?;
    let records = Records::open(records_dir.path())?;
    let addrs: Vec<Ipv4Addr> = (0..count).map(address).collect();
    {
        let mut managed = datapath.managed_addrs()?;
        for (i, addr) in addrs.iter().enumerate() {
            managed.insert(ifindex, IpAddr::V4(*addr), OWNER_MAC)?;
            records.save(&record(i, *addr, &uplink, ifindex))?;
        }
    }
    let monitor = datapath.conflict_monitor()?;

    let timeline = Arc::new(Mutex::new(Timeline {
        sent: vec![None; count],
        event: vec![None; count],
        condition: vec![None; count],
    }));
    let (client, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    tokio::spawn(serve(handle, Arc::clone(&timeline)));
    let desired = Kubernetes::new(
        kube::Client::new(client, "default"),
        "bench-node",
        Duration::from_secs(1),
    );
    let metrics = Arc::new(Metrics::default());
    let service = AgentService::new(
        ServiceConfig {
            node_name: "bench-node".into(),
            attachments: Default::default(),
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
        records,
        datapath,
        Arc::clone(&metrics),
    )?;
    let watcher = tokio::spawn({
        let service = service.clone();
        async move { service.watch_conflicts(monitor).await }
    });

    let sender = {
        let timeline = Arc::clone(&timeline);
        let rogue_path = rogue.path();
        tokio::task::spawn_blocking(move || {
            run_in_netns(&rogue_path, || -> anyhow::Result<()> {
                let socket = RawSocket::open(&rogue_if)?;
                for (i, addr) in addrs.iter().enumerate() {
                    let frame = arp_frame(
                        ROGUE_MAC,
                        BROADCAST,
                        ArpOperation::REPLY,
                        (ROGUE_MAC, *addr),
                        (BROADCAST, *addr),
                    )?;
                    let now = Instant::now();
                    timeline.lock().unwrap().sent[i] = Some(now);
                    socket.send(&frame)?;
                    if !interval.is_zero() {
                        std::thread::sleep(interval);
                    }
                }
                Ok(())
            })
        })
    };
    sender.await???;

    let deadline = Instant::now() + DRAIN;
    while Instant::now() < deadline {
        if timeline
            .lock()
            .unwrap()
            .condition
            .iter()
            .all(Option::is_some)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    watcher.abort();
    eprintln!(
        "{} frames sent, {} conflicts counted by the agent",
        count,
        metrics.conflicts()
    );
    let timeline = std::mem::take(&mut *timeline.lock().unwrap());
    Ok(timeline)
}

/// The `i`-th managed address (10.77.0.1, …).
fn address(i: usize) -> Ipv4Addr {
    let i = u32::try_from(i).expect("address count fits u32");
    Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 77, 0, 1)) + i)
}

fn pod_name(i: usize) -> String {
    format!("pod-{i}")
}

fn record(i: usize, addr: Ipv4Addr, uplink: &str, ifindex: u32) -> AttachmentRecord {
    AttachmentRecord {
        key: AttachmentKey {
            container_id: format!("bench{i:060}"),
            ifname: "eth1".into(),
        },
        network: "rancher-flat-network".into(),
        netns: format!("/run/netns/bench-pod-{i}").into(),
        pod: PodRef {
            namespace: Some(NAMESPACE.into()),
            name: Some(pod_name(i)),
            uid: None,
        },
        phase: RecordPhase::Ready,
        subnets: Vec::new(),
        addresses: vec![ipnet::IpNet::new(IpAddr::V4(addr), 16).expect("prefix /16")],
        requested_mac: None,
        mac: Some("02:00:00:00:00:0a".into()),
        mtu: None,
        uplink: Some(UplinkRecord {
            ifname: uplink.into(),
            ifindex,
            owner_mac: "02:00:00:00:00:0a".into(),
            responder: false,
        }),
        host_route: None,
        primary_defaults: None,
        parent: None,
        unreported_mtu: None,
    }
}

/// The API server: answers the FlatNetworkIP GET, the Event POST and the
/// status patch of each report, noting when the last two arrive.
async fn serve(mut handle: Handle, timeline: Arc<Mutex<Timeline>>) {
    let prefix = format!("/apis/flatnetwork.pandaria.io/v1/namespaces/{NAMESPACE}/flatnetworkips/");
    while let Some((request, reply)) = handle.next_request().await {
        let arrived = Instant::now();
        let (parts, body) = request.into_parts();
        let body: Value = serde_json::from_slice(&body.collect_bytes().await.unwrap_or_default())
            .unwrap_or(Value::Null);
        let path = parts.uri.path();
        let (status, answer) = if parts.method == "POST" && path.ends_with("/events") {
            let name = body["regarding"]["name"].as_str().unwrap_or_default();
            note(&timeline, name, arrived, |t| &mut t.event);
            (StatusCode::CREATED, body)
        } else if let Some(rest) = path.strip_prefix(&prefix) {
            let name = rest.trim_end_matches("/status");
            if rest.ends_with("/status") {
                note(&timeline, name, arrived, |t| &mut t.condition);
            }
            (StatusCode::OK, flat_ip(name))
        } else {
            (
                StatusCode::NOT_FOUND,
                json!({"kind": "Status", "code": 404}),
            )
        };
        reply.send_response(
            Response::builder()
                .status(status)
                .body(Body::from(serde_json::to_vec(&answer).unwrap_or_default()))
                .expect("valid response"),
        );
    }
}

/// Records the first arrival for pod `name` in the column `column` picks.
fn note(
    timeline: &Mutex<Timeline>,
    name: &str,
    arrived: Instant,
    column: impl FnOnce(&mut Timeline) -> &mut Vec<Option<Instant>>,
) {
    let Some(i) = name
        .strip_prefix("pod-")
        .and_then(|n| n.parse::<usize>().ok())
    else {
        return;
    };
    let mut timeline = timeline.lock().unwrap();
    if let Some(slot) = column(&mut timeline).get_mut(i) {
        slot.get_or_insert(arrived);
    }
}

fn flat_ip(name: &str) -> Value {
    json!({
        "apiVersion": "flatnetwork.pandaria.io/v1",
        "kind": "FlatNetworkIP",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": format!("uid-{name}"),
                     "resourceVersion": "5", "generation": 1},
        "spec": {"subnet": "lan4", "podId": "uid-1"},
        "status": {"phase": "Active"}
    })
}

/// "p50 / p99 / max" of `to - from` in milliseconds over the conflicts
/// that got there.
fn summary(from: &[Option<Instant>], to: &[Option<Instant>]) -> String {
    let mut samples: Vec<Duration> = from
        .iter()
        .zip(to)
        .filter_map(|(from, to)| Some(to.as_ref()?.saturating_duration_since(*from.as_ref()?)))
        .collect();
    if samples.is_empty() {
        return "none arrived".into();
    }
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    format!(
        "{:.2} / {:.2} / {:.2} ms",
        ms(percentile(&samples, 0.5)),
        ms(percentile(&samples, 0.99)),
        ms(samples[samples.len() - 1])
    )
}

/// The `p`-th percentile (0..=1) by nearest rank of sorted samples.
#[expect(
    clippy::cast_sign_loss,
    reason = "`p` and the length are not negative, so neither is the rank"
)]
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
