//! A small simulated LAN for attachment tests: a "node" namespace whose
//! master interface is a veth to a "LAN host" namespace, plus pod
//! namespaces. Everything is removed on drop.
#![allow(dead_code)]

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use flatnet_agent::{
    link::{
        AnnounceSettings, ArpPolicy, AttachmentSpec, Attachments, LinkMode, MacvlanMode,
        ParentLink, SharedNetlink,
    },
    netns::run_in_netns,
    packet::{RawSocket, Receive},
};

use crate::support::{TestNetns, lan::SimulatedLan, unique_name};
pub use crate::support::{has_link, ping};

/// LAN host addresses; they are the pods' gateways.
pub const LAN_V4: &str = "192.0.2.1";
pub const LAN_V6: &str = "2001:db8::1";

/// Node and LAN host joined by a veth: `master` in the node, `lan0` in the LAN.
pub struct Lan {
    pub node: TestNetns,
    pub lan: TestNetns,
    pub master: String,
    pub lease_dir: PathBuf,
}

impl Lan {
    pub fn new() -> Self {
        let SimulatedLan { node, lan, master } =
            SimulatedLan::new("fl", &[&format!("{LAN_V4}/24"), &format!("{LAN_V6}/64")]);
        let lease_dir = std::env::temp_dir().join(unique_name("flv-"));
        Self {
            node,
            lan,
            master,
            lease_dir,
        }
    }

    /// The attachment layer working on this LAN's node namespace, with
    /// short announcement repeats.
    pub fn attachments(&self) -> Attachments {
        Attachments {
            host_netns: Some(self.node.path()),
            lease_dir: self.lease_dir.clone(),
            announce: AnnounceSettings {
                count: 2,
                interval: Duration::from_millis(100),
            },
            host_link: SharedNetlink::default(),
        }
    }

    /// A macvlan bridge spec for `pod` with `addresses` and the LAN host
    /// as gateway of each family present.
    pub fn spec(&self, pod: &TestNetns, addresses: &[&str]) -> AttachmentSpec {
        let addresses: Vec<ipnet::IpNet> = addresses.iter().map(|a| a.parse().unwrap()).collect();
        let mut gateways = Vec::new();
        if addresses.iter().any(|a| a.addr().is_ipv4()) {
            gateways.push(LAN_V4.parse().unwrap());
        }
        if addresses.iter().any(|a| a.addr().is_ipv6()) {
            gateways.push(LAN_V6.parse().unwrap());
        }
        AttachmentSpec {
            subnet: "lan".into(),
            parent: ParentLink {
                master: self.master.clone(),
                vlan: 0,
            },
            kind: LinkMode::Macvlan(MacvlanMode::Bridge),
            netns: pod.path(),
            ifname: "eth1".into(),
            mac: None,
            mtu: None,
            addresses,
            extra_addresses: Vec::new(),
            gateways,
            default_route: true,
            routes: Vec::new(),
            primary_routes: None,
            host_route: None,
            arp_policy: ArpPolicy::Arping,
            proxy_arp: false,
        }
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.lease_dir);
    }
}

/// A raw socket receiving every frame of one interface, opened inside a
/// namespace.
pub struct Capture {
    socket: RawSocket,
}

impl Capture {
    pub fn open(ns: &TestNetns, ifname: &str) -> Self {
        let ifname = ifname.to_owned();
        let socket = run_in_netns(&ns.path(), move || {
            RawSocket::open_receiving(&ifname, Receive::All)
        })
        .expect("enter namespace")
        .expect("capture socket");
        Self { socket }
    }

    /// Collects frames until `done` says the collection is complete, or a
    /// generous deadline passes (then the caller's assertions report what
    /// is missing).
    pub fn collect_until(&self, done: impl Fn(&[Vec<u8>]) -> bool) -> Vec<Vec<u8>> {
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut frames = Vec::new();
        let mut buffer = [0u8; 2048];
        while !done(&frames) && Instant::now() < deadline {
            // A short wait, so the loop checks its deadline.
            let received = self
                .socket
                .receive(&mut buffer, Duration::from_millis(200))
                .expect("receive");
            if let Some(received) = received.filter(|r| r.len > 0) {
                frames.push(buffer[..received.len].to_vec());
            }
        }
        frames
    }
}
