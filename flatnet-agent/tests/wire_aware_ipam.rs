//! Wire-aware IPAM end to end on a real kernel (root): frames from a LAN
//! namespace reach the uplink program over a veth pair, the agent's
//! publisher writes what the inventory saw into the operator's fake API
//! server, and the allocation controllers running against it never hand
//! out an address the LAN still uses, nor a MAC of the pool's range a host
//! on the LAN uses.

mod support;

use std::{net::IpAddr, time::Duration};

use flatnet_agent::{
    datapath::{Datapath, DatapathConfig, monotonic_ns},
    netns::run_in_netns,
    wire_report::{
        PUBLISH_INTERVAL, REPORT_HORIZON, WirePublisher, foreign_claims, live_record_macs,
    },
};
use flatnet_k8s::{
    api::{FlatNetworkIP, FlatNetworkSubnet, FlatNetworkWireClaims, MacPoolMode},
    ipam::{Mac, MacRange},
};
use flatnet_operator::allocation::{
    Settings,
    fake_api::FakeApiServer,
    fake_cluster::{self, FakeCluster},
    mac_pool::ActivePool,
};
use k8s_openapi::jiff::Timestamp;
use support::{TestNetns, TestPinRoot, lan::send_arp_requests, privileged, veth_pair};
use tokio::time::Instant;

const ROGUE_MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x00, 0x00, 0xee];
const POD_MAC: &str = "02:00:5e:00:00:71";
const SETTLE: Duration = Duration::from_secs(30);

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

/// What one agent pass publishes: the inventory read now, summarised
/// against the subnets and records the server holds (and the MAC pool's
/// range `mac_pool`).
async fn publish(
    datapath: &Datapath,
    server: &FakeApiServer,
    publisher: &mut WirePublisher,
    mac_pool: Option<MacRange>,
    at: Instant,
) {
    let subnets: Vec<FlatNetworkSubnet> = server.list();
    let flatnet_macs = live_record_macs(&server.list::<FlatNetworkIP>());
    let claims = datapath.wire_claims().unwrap();
    let summary = foreign_claims(
        &claims,
        &subnets,
        &flatnet_macs,
        mac_pool,
        (monotonic_ns(), Timestamp::now()),
        REPORT_HORIZON,
    );
    publisher.publish(&summary, &subnets, at).await.unwrap();
}

fn excluded(server: &FakeApiServer) -> i64 {
    server.list::<FlatNetworkSubnet>()[0]
        .status
        .as_ref()
        .map_or(0, |s| s.wire_excluded_count)
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + SETTLE;
    while !done() {
        assert!(Instant::now() < deadline, "{what} within {SETTLE:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn addresses_the_lan_still_uses_are_never_given_to_a_pod() {
    if !privileged("addresses_the_lan_still_uses_are_never_given_to_a_pod") {
        return;
    }
    let WireLab {
        datapath,
        _pin,
        node,
        lan,
        lan_if,
        node_if,
    } = wire_lab("fl-w");
    node.add_address(&node_if, "192.0.2.1/24");

    // A rogue host at 192.0.2.10, the first address of the range, that
    // only ever asks (ARP requests for the gateway) and never answers:
    // nothing on the LAN side holds the address, so nobody can reply.
    send_arp_requests(
        &lan,
        &lan_if,
        ROGUE_MAC,
        "192.0.2.10".parse().unwrap(),
        "192.0.2.1".parse().unwrap(),
    );

    runtime().block_on(async {
        let server = server_with_subnet();
        let cluster = FakeCluster::start(server.clone(), Settings::default(), 2);
        cluster.wait_active("lan", SETTLE).await.unwrap();

        let mut publisher = WirePublisher::new(server.client(), "node-1");
        let t0 = Instant::now();
        wait_for("the rogue host's requests in the inventory", || {
            datapath
                .wire_claims()
                .unwrap()
                .iter()
                .any(|c| c.addr == ip("192.0.2.10") && c.mac == ROGUE_MAC)
        })
        .await;
        publish(&datapath, &server, &mut publisher, None, t0).await;
        wait_for("the subnet counting the rogue address", || {
            excluded(&server) == 1
        })
        .await;

        cluster.create_pod("p0", "lan");
        let view = cluster.settle("lan", SETTLE).await.unwrap();
        assert_eq!(
            view.addressed.get("p0"),
            Some(&ip("192.0.2.11")),
            "the lowest free address, .10, is live on the wire"
        );

        // p0's interface (a macvlan on the LAN side, with its address)
        // still answers after its record is gone.
        let pod_if = support::unique_name("pod");
        lan.ip(&[
            "link", "add", &pod_if, "link", &lan_if, "address", POD_MAC, "type", "macvlan", "mode",
            "bridge",
        ]);
        lan.add_address(&pod_if, "192.0.2.11/24");
        lan.ip(&["link", "set", &pod_if, "up"]);
        cluster.delete_pod("p0");
        wait_for("p0's record collected", || {
            !server
                .list::<FlatNetworkIP>()
                .iter()
                .any(|r| r.metadata.name.as_deref() == Some("p0"))
        })
        .await;
        // Before any node has reported anything about .11: the release
        // itself keeps it back (quarantine), so there is no gap.
        cluster.create_pod("p1", "lan");
        let view = cluster.settle("lan", SETTLE).await.unwrap();
        assert_eq!(
            view.addressed.get("p1"),
            Some(&ip("192.0.2.12")),
            "neither the rogue address nor the one just released"
        );

        // The node resolves .11 and the old interface answers.
        node.try_exec(
            "arping",
            &["-c", "2", "-w", "3", "-I", &node_if, "192.0.2.11"],
        );
        wait_for("the old interface's reply in the inventory", || {
            datapath.wire_claims().unwrap().iter().any(|c| {
                c.addr == ip("192.0.2.11") && flatnet_agent::datapath::format_mac(c.mac) == POD_MAC
            })
        })
        .await;
        publish(
            &datapath,
            &server,
            &mut publisher,
            None,
            t0 + PUBLISH_INTERVAL,
        )
        .await;
        wait_for("the subnet counting both live addresses", || {
            excluded(&server) == 2
        })
        .await;

        // A new operator (a failover) knows nothing of the release: the
        // old interface's answer alone keeps .11 out of the pool now.
        cluster.stop().await;
        let cluster = FakeCluster::start(server.clone(), Settings::default(), 2);
        cluster.wait_active("lan", SETTLE).await.unwrap();
        cluster.create_pod("p2", "lan");
        let view = cluster.settle("lan", SETTLE).await.unwrap();
        assert_eq!(
            view.addressed.get("p2"),
            Some(&ip("192.0.2.13")),
            "the address the old interface still answers for stays out"
        );
        cluster.stop().await;
    });
}

/// The runtime of the operator's controllers and the publisher.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// An API server holding the subnet `lan`, 192.0.2.0/24, pool .10-.30.
fn server_with_subnet() -> FakeApiServer {
    let server = FakeApiServer::new();
    server.insert(&fake_cluster::subnet(
        "lan",
        "192.0.2.0/24",
        Some("192.0.2.1"),
        &[("192.0.2.10", "192.0.2.30")],
    ));
    server
}

/// A LAN host and a node joined by a veth, the node's end (`node_if`)
/// with the uplink program recording what the host says. Fields drop in
/// order: the program before the namespaces.
struct WireLab {
    datapath: Datapath,
    _pin: TestPinRoot,
    node: TestNetns,
    lan: TestNetns,
    lan_if: String,
    node_if: String,
}

#[test]
fn a_pool_mac_a_lan_host_uses_outside_every_subnet_is_never_given_to_a_pod() {
    if !privileged("a_pool_mac_a_lan_host_uses_outside_every_subnet_is_never_given_to_a_pod") {
        return;
    }
    let lab = wire_lab("fl-wm");
    let range = MacRange::parse("02:aa:00:00:00:01", "02:aa:00:00:00:08").unwrap();
    // A host on the LAN (not flatnet's) with the pool's first MAC, on an
    // address of no subnet.
    let rogue = range.start();
    let outside = "10.99.0.5".parse().unwrap();
    send_arp_requests(&lab.lan, &lab.lan_if, rogue.0, outside, outside);

    runtime().block_on(async {
        let server = server_with_subnet();
        wait_for("the host's announcement in the inventory", || {
            lab.datapath
                .wire_claims()
                .unwrap()
                .iter()
                .any(|c| c.mac == rogue.0)
        })
        .await;
        let mut publisher = WirePublisher::new(server.client(), "node-1");
        publish(
            &lab.datapath,
            &server,
            &mut publisher,
            Some(range),
            Instant::now(),
        )
        .await;
        let reports: Vec<FlatNetworkWireClaims> = server.list();
        assert!(
            reports
                .iter()
                .flat_map(|r| &r.spec.claims)
                .any(|c| c.ip == ip("10.99.0.5") && c.mac == rogue.to_string()),
            "reported though outside the subnet: {reports:?}"
        );

        // An operator starting now lists the report before it allocates.
        let pool = ActivePool {
            range,
            mode: MacPoolMode::OptOut,
        };
        let cluster =
            FakeCluster::start_with_mac_pool(server.clone(), Settings::default(), 2, Some(pool));
        cluster.wait_active("lan", SETTLE).await.unwrap();
        cluster.create_pod("p0", "lan");
        cluster.settle("lan", SETTLE).await.unwrap();
        let record = server
            .list::<FlatNetworkIP>()
            .into_iter()
            .find(|r| r.metadata.name.as_deref() == Some("p0"))
            .unwrap();
        let status = record.status.unwrap();
        assert!(status.mac_from_pool, "{status:?}");
        let mac: Mac = status.mac.parse().unwrap();
        assert!(range.contains(mac));
        assert_ne!(mac, rogue, "the MAC the LAN host uses is skipped");
        cluster.stop().await;
    });
}

/// The [`WireLab`] of namespaces named `<prefix>lan…` and `<prefix>node…`.
fn wire_lab(prefix: &str) -> WireLab {
    let lan = TestNetns::new(&format!("{prefix}lan"));
    let node = TestNetns::new(&format!("{prefix}node"));
    lan.sysctl("net.ipv6.conf.all.disable_ipv6", "1");
    let lan_if = support::unique_name("lan");
    let node_if = support::unique_name("up");
    veth_pair(&lan, &lan_if, &node, &node_if);
    lan.ip(&["link", "set", &lan_if, "up"]);
    node.ip(&["link", "set", &node_if, "up"]);
    let pin = TestPinRoot::new();
    let mut datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).unwrap();
    run_in_netns(&node.path(), || datapath.attach_uplink(&node_if))
        .unwrap()
        .unwrap();
    WireLab {
        datapath,
        _pin: pin,
        node,
        lan,
        lan_if,
        node_if,
    }
}
