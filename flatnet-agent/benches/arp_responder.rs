//! ARP answering: the uplink program against the kernel's proxy_arp, side
//! by side in one run, on a veth pair between a LAN and a node namespace.
//!
//! Run as root: `cargo bench -p flatnet-agent --bench arp_responder`.
//! Prints a Markdown table (replies per second seen by the LAN host, and
//! the program's own cost per answer from BPF_PROG_TEST_RUN).

#[path = "../tests/support/mod.rs"]
mod support;

use std::{
    net::Ipv4Addr,
    thread,
    time::{Duration, Instant},
};

use etherparse::ArpOperation;
use flatnet_agent::{
    datapath::{Datapath, DatapathConfig, detach_uplink},
    netns::run_in_netns,
    packet::{BROADCAST, RawSocket, Receive, arp_frame},
};
use support::{TestNetns, TestPinRoot, veth_pair};

const ETHERTYPE_ARP: u16 = 0x0806;
const REQUESTS: u64 = 60_000;
const BURST: u64 = 20;
const LAN_MAC: [u8; 6] = [0x02, 0, 0x5e, 0, 0, 0x01];
const NODE_MAC: [u8; 6] = [0x02, 0, 0x5e, 0, 0, 0xbb];
const TARGET: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 7);
const LAN_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 200);

fn main() {
    // `cargo test --all-targets` runs bench binaries without `--bench`:
    // measuring belongs to `cargo bench` only.
    if !std::env::args().any(|a| a == "--bench") {
        println!("arp_responder: measured by `cargo bench`, nothing to test");
        return;
    }
    if !nix::unistd::geteuid().is_root() {
        support::report_skip("arp_responder benchmark needs root (namespaces, BPF)");
        return;
    }
    let lan = TestNetns::new("fb-lan");
    let node = TestNetns::new("fb-node");
    let other = TestNetns::new("fb-oth");
    veth_pair(&lan, "lan0", &node, "up0");
    veth_pair(&node, "side0", &other, "side1");
    lan.ip(&["link", "set", "lan0", "address", "02:00:5e:00:00:01"]);
    node.ip(&["link", "set", "up0", "address", "02:00:5e:00:00:bb"]);
    for (ns, ifname) in [
        (&lan, "lan0"),
        (&node, "up0"),
        (&node, "side0"),
        (&other, "side1"),
    ] {
        ns.ip(&["link", "set", ifname, "up"]);
    }
    lan.ip(&["addr", "add", "198.51.100.200/25", "dev", "lan0"]);
    node.ip(&["addr", "add", "198.51.100.1/25", "dev", "up0"]);
    let request = arp_frame(
        LAN_MAC,
        BROADCAST,
        ArpOperation::REQUEST,
        (LAN_MAC, LAN_IP),
        ([0; 6], TARGET),
    )
    .unwrap();

    // The program: TARGET listed in the responder table of the uplink.
    let pin = TestPinRoot::new();
    let mut datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).unwrap();
    let ifindex = node
        .exec("cat", &["/sys/class/net/up0/ifindex"])
        .trim()
        .parse()
        .unwrap();
    datapath
        .responders()
        .unwrap()
        .insert(ifindex, TARGET.into(), NODE_MAC)
        .unwrap();
    run_in_netns(&node.path(), || datapath.attach_uplink("up0"))
        .unwrap()
        .unwrap();
    let program = measure(&lan, &request);
    // Program cost alone, as if on loopback (its own responder entry).
    datapath
        .responders()
        .unwrap()
        .insert(1, TARGET.into(), NODE_MAC)
        .unwrap();
    let per_answer_ns = datapath
        .test_run_uplink(&request, 1_000_000)
        .unwrap()
        .duration_ns;
    run_in_netns(&node.path(), || detach_uplink(&pin.path, "up0"))
        .unwrap()
        .unwrap();

    // The kernel: proxy_arp on the uplink for a route behind another link,
    // without the default random delay, so both answer as fast as they can.
    node.ip(&["route", "add", "198.51.100.0/28", "dev", "side0"]);
    for (key, value) in [
        ("net.ipv4.ip_forward", "1"),
        ("net.ipv4.conf.up0.proxy_arp", "1"),
        ("net.ipv4.neigh.up0.proxy_delay", "0"),
        ("net.ipv4.neigh.up0.proxy_qlen", "4096"),
    ] {
        node.sysctl(key, value);
    }
    let kernel = measure(&lan, &request);

    println!("| responder | requests sent | replies received | replies/s (LAN host) |");
    println!("| --- | ---: | ---: | ---: |");
    for (name, m) in [
        ("flatnet uplink program", program),
        ("kernel proxy_arp (proxy_delay 0)", kernel),
    ] {
        println!(
            "| {name} | {REQUESTS} | {} | {:.0} |",
            m.replies,
            m.replies as f64 / m.elapsed.as_secs_f64()
        );
    }
    println!();
    println!(
        "Program cost per answered request (BPF_PROG_TEST_RUN, 1,000,000 repeats): {per_answer_ns} ns"
    );
}

struct Measurement {
    replies: u64,
    elapsed: Duration,
}

/// Sends REQUESTS ARP requests from the LAN host in paced bursts while
/// counting the ARP replies that reach it.
fn measure(lan: &TestNetns, request: &[u8]) -> Measurement {
    run_in_netns(&lan.path(), || {
        let receiver = ArpReceiver::open("lan0");
        let sender = RawSocket::open("lan0").unwrap();
        let started = Instant::now();
        thread::scope(|scope| {
            let counting = scope.spawn(|| receiver.count_replies(REQUESTS));
            let mut sent = 0;
            while sent < REQUESTS {
                for _ in 0..BURST {
                    sender.send(request).unwrap();
                }
                sent += BURST;
                thread::sleep(Duration::from_micros(200));
            }
            let (replies, last) = counting.join().unwrap();
            Measurement {
                replies,
                elapsed: last.duration_since(started),
            }
        })
    })
    .unwrap()
}

/// A raw socket receiving the ARP frames of one interface.
struct ArpReceiver {
    socket: RawSocket,
}

impl ArpReceiver {
    /// No reply within this long: no more are coming.
    const QUIET: Duration = Duration::from_millis(300);

    fn open(ifname: &str) -> Self {
        let socket = RawSocket::open_receiving(ifname, Receive::EtherType(ETHERTYPE_ARP)).unwrap();
        // Room for the bursts of replies while the counter catches up.
        socket.set_receive_buffer(8 << 20).unwrap();
        Self { socket }
    }

    /// Counts incoming ARP replies for TARGET until `expected` arrived or
    /// none came within [`Self::QUIET`]; returns the count and the time of
    /// the last one.
    fn count_replies(&self, expected: u64) -> (u64, Instant) {
        let mut buf = [0u8; 128];
        let mut replies = 0;
        let mut last = Instant::now();
        while replies < expected {
            let Ok(Some(received)) = self.socket.receive(&mut buf, Self::QUIET) else {
                break; // Timed out: no more replies are coming.
            };
            let frame = &buf[..received.len];
            // The socket also sees our own requests; count only replies for TARGET.
            if frame.len() >= 42 && frame[20..22] == [0, 2] && frame[28..32] == TARGET.octets() {
                replies += 1;
                last = Instant::now();
            }
        }
        (replies, last)
    }
}
