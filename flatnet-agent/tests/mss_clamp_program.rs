//! The TCP MSS clamping programs on the real kernel, run with
//! `BPF_PROG_TEST_RUN` on crafted frames as if on an interface of MTU
//! 1400 (a veth in a fresh network namespace): SYNs and SYN-ACKs of both
//! families, tagged or not, with their MSS anywhere among the options, get
//! MTU - 40 (IPv4) or MTU - 60 (IPv6) and a TCP checksum that verifies;
//! everything else, hostile or truncated frames included, passes
//! byte for byte.

mod support;

use std::net::{Ipv4Addr, Ipv6Addr};

use flatnet_agent::{
    datapath::{Datapath, DatapathConfig},
    netns::run_in_netns,
};
use flatnet_common::{policy::Direction, verdict::PASS};
use support::{
    TestNetns, TestPinRoot,
    frames::{TCP, UDP, eth, ext8, frag6, ipv4, ipv6, ports, vlan_tagged},
    privileged,
};

const MTU: u32 = 1400;
const SYN: u8 = 0x02;
const SYN_ACK: u8 = 0x12;
const ACK: u8 = 0x10;

/// Linux's SYN options: MSS 1460, SACK permitted, timestamps, NOP,
/// window scale 7.
fn linux_options(mss: u16) -> Vec<u8> {
    let mut o = vec![2, 4];
    o.extend_from_slice(&mss.to_be_bytes());
    o.extend_from_slice(&[4, 2, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 1, 3, 3, 7]);
    o
}

/// A TCP header with `flags` and `options` (padded to whole words) and a
/// few payload-free bytes; the checksum is left 0 and set by [`seal4`] /
/// [`seal6`].
fn tcp(flags: u8, options: &[u8]) -> Vec<u8> {
    let mut h = ports(40000, 80);
    h[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
    let mut options = options.to_vec();
    while !options.len().is_multiple_of(4) {
        options.push(0);
    }
    h[12] = (((20 + options.len()) / 4) << 4) as u8;
    h[13] = flags;
    h[14..16].copy_from_slice(&64240u16.to_be_bytes());
    h.extend_from_slice(&options);
    h
}

/// The one's complement sum of `data`, folded.
fn sum(data: &[u8]) -> u32 {
    let mut total: u32 = data
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while total > 0xffff {
        total = (total & 0xffff) + (total >> 16);
    }
    total
}

fn pseudo4(src: Ipv4Addr, dst: Ipv4Addr, len: usize) -> Vec<u8> {
    let mut p = src.octets().to_vec();
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&[0, TCP]);
    p.extend_from_slice(&(len as u16).to_be_bytes());
    p
}

fn pseudo6(src: Ipv6Addr, dst: Ipv6Addr, len: usize) -> Vec<u8> {
    let mut p = src.octets().to_vec();
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&(len as u32).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, TCP]);
    p
}

/// Whether the TCP segment `segment` checksums right under `pseudo`.
fn verifies(pseudo: &[u8], segment: &[u8]) -> bool {
    let mut all = pseudo.to_vec();
    all.extend_from_slice(segment);
    sum(&all) == 0xffff
}

fn set_checksum(pseudo: &[u8], segment: &mut [u8]) {
    segment[16..18].fill(0);
    let mut all = pseudo.to_vec();
    all.extend_from_slice(segment);
    let checksum = !(sum(&all) as u16);
    segment[16..18].copy_from_slice(&checksum.to_be_bytes());
}

const SRC4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
const DST4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 20);
const SRC6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x10);
const DST6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0, 0, 0, 0, 0, 0, 0x20);

/// An IPv4 frame around `segment` with a right TCP checksum.
fn seal4(mut segment: Vec<u8>) -> Vec<u8> {
    set_checksum(&pseudo4(SRC4, DST4, segment.len()), &mut segment);
    eth(0x0800, &ipv4(SRC4, DST4, TCP, 7, 0x4000, &segment))
}

/// An IPv6 frame around `extensions` and `segment` (`next` the first next
/// header) with a right TCP checksum.
fn seal6(next: u8, extensions: &[u8], mut segment: Vec<u8>) -> Vec<u8> {
    set_checksum(&pseudo6(SRC6, DST6, segment.len()), &mut segment);
    let mut payload = extensions.to_vec();
    payload.extend_from_slice(&segment);
    eth(0x86dd, &ipv6(SRC6, DST6, next, &payload))
}

/// The loaded programs and an interface of MTU [`MTU`] to run them on.
struct Fixture {
    datapath: Datapath,
    netns: TestNetns,
    ifindex: u32,
    _pin: TestPinRoot,
}

impl Fixture {
    fn for_test(test: &str) -> Option<Self> {
        if !privileged(test) {
            return None;
        }
        let pin = TestPinRoot::new();
        let datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.path)).expect("load");
        let netns = TestNetns::new("mss");
        netns.ip(&["link", "add", "m0", "type", "veth", "peer", "name", "m1"]);
        netns.ip(&["link", "set", "m0", "mtu", &MTU.to_string()]);
        let ifindex = run_in_netns(&netns.path(), || {
            nix::net::if_::if_nametoindex("m0").expect("m0")
        })
        .expect("enter netns");
        Some(Self {
            datapath,
            netns,
            ifindex,
            _pin: pin,
        })
    }

    /// The frame after the program of `direction` ran on it.
    fn run(&mut self, direction: Direction, frame: &[u8]) -> Vec<u8> {
        let (datapath, ifindex) = (&mut self.datapath, self.ifindex);
        let out = run_in_netns(&self.netns.path(), || {
            datapath.test_run_mss_clamp(direction, frame, ifindex)
        })
        .expect("enter netns")
        .unwrap_or_else(|e| panic!("test run of a {}-byte frame: {e}", frame.len()));
        assert_eq!(out.verdict, PASS, "the programs never drop");
        out.frame
    }

    /// Runs `frame` both ways and asserts it comes out unchanged.
    fn untouched(&mut self, what: &str, frame: &[u8]) {
        for direction in [Direction::Ingress, Direction::Egress] {
            assert_eq!(
                self.run(direction, frame),
                frame,
                "{what} ({direction:?}) must pass untouched"
            );
        }
    }
}

/// Asserts `out` is `input` with the MSS at `mss_at` (a frame offset) set
/// to `mss` and a checksum that verifies, nothing else changed.
fn clamped(input: &[u8], out: &[u8], l4: usize, mss_at: usize, mss: u16, pseudo: &[u8]) {
    assert_eq!(out.len(), input.len());
    assert_eq!(
        u16::from_be_bytes([out[mss_at], out[mss_at + 1]]),
        mss,
        "MSS clamped"
    );
    assert!(verifies(pseudo, &out[l4..]), "TCP checksum verifies");
    for (i, (a, b)) in input.iter().zip(out).enumerate() {
        let rewritten = (mss_at..mss_at + 2).contains(&i) || (l4 + 16..l4 + 18).contains(&i);
        assert!(rewritten || a == b, "byte {i} changed: {a:#x} -> {b:#x}");
    }
}

#[test]
fn syns_of_both_families_get_the_mss_the_mtu_leaves_with_a_checksum_that_verifies() {
    let Some(mut fx) = Fixture::for_test("syns_of_both_families_get_the_mss_the_mtu_leaves") else {
        return;
    };
    let l4v4 = 14 + 20;
    for (flags, direction) in [
        (SYN, Direction::Ingress),
        (SYN_ACK, Direction::Ingress),
        (SYN, Direction::Egress),
        (SYN_ACK, Direction::Egress),
    ] {
        let frame = seal4(tcp(flags, &linux_options(1460)));
        let out = fx.run(direction, &frame);
        let pseudo = pseudo4(SRC4, DST4, frame.len() - l4v4);
        clamped(&frame, &out, l4v4, l4v4 + 22, 1360, &pseudo);
    }

    // IPv6: MTU - 60; also behind a hop-by-hop and a destination options
    // header, and in a first fragment.
    let l4v6 = 14 + 40;
    let frame = seal6(TCP, &[], tcp(SYN, &linux_options(1440)));
    let out = fx.run(Direction::Ingress, &frame);
    let pseudo = pseudo6(SRC6, DST6, frame.len() - l4v6);
    clamped(&frame, &out, l4v6, l4v6 + 22, 1340, &pseudo);
    let mut extensions = ext8(60);
    extensions.extend(ext8(44));
    extensions.extend(frag6(TCP, 0, true, 9));
    let frame = seal6(0, &extensions, tcp(SYN_ACK, &linux_options(8940)));
    let l4 = l4v6 + 24;
    let out = fx.run(Direction::Egress, &frame);
    let pseudo = pseudo6(SRC6, DST6, frame.len() - l4);
    clamped(&frame, &out, l4, l4 + 22, 1340, &pseudo);

    // 802.1Q-tagged in the payload, twice (QinQ).
    let frame = vlan_tagged(
        &vlan_tagged(&seal4(tcp(SYN, &linux_options(1460))), 200),
        300,
    );
    let out = fx.run(Direction::Ingress, &frame);
    let l4 = l4v4 + 8;
    let pseudo = pseudo4(SRC4, DST4, frame.len() - l4);
    clamped(&frame, &out, l4, l4 + 22, 1360, &pseudo);
}

#[test]
fn the_mss_is_found_anywhere_among_the_options_and_every_copy_is_clamped() {
    let Some(mut fx) = Fixture::for_test("the_mss_is_found_anywhere_among_the_options") else {
        return;
    };
    let l4 = 14 + 20;
    // After NOPs and timestamps, at an odd offset.
    let late = [1, 1, 1, 8, 10, 0, 0, 0, 1, 0, 0, 0, 0, 2, 4, 0x23, 0x28];
    let frame = seal4(tcp(SYN, &late));
    let out = fx.run(Direction::Ingress, &frame);
    let pseudo = pseudo4(SRC4, DST4, frame.len() - l4);
    clamped(&frame, &out, l4, l4 + 20 + 15, 1360, &pseudo);

    // Two MSS options: the kernel takes the last, other stacks the first,
    // so every one is clamped; one of them at an odd offset.
    let twice = [2, 4, 0x05, 0xb4, 1, 2, 4, 0xff, 0xff];
    let frame = seal4(tcp(SYN, &twice));
    let out = fx.run(Direction::Egress, &frame);
    let options = &out[l4 + 20..l4 + 29];
    assert_eq!(options, [2, 4, 0x05, 0x50, 1, 2, 4, 0x05, 0x50]);
    assert!(verifies(&pseudo4(SRC4, DST4, frame.len() - l4), &out[l4..]));
    // A first MSS of 0 (ignored by the kernel) and a large last one.
    let zero_first = [2, 4, 0, 0, 2, 4, 0x05, 0xb4];
    let frame = seal4(tcp(SYN, &zero_first));
    let out = fx.run(Direction::Ingress, &frame);
    assert_eq!(&out[l4 + 20..l4 + 28], [2, 4, 0, 0, 2, 4, 0x05, 0x50]);
    assert!(verifies(&pseudo4(SRC4, DST4, frame.len() - l4), &out[l4..]));

    // 40 option bytes, the MSS last.
    let mut full = [1u8; 40];
    full[36..].copy_from_slice(&[2, 4, 0x05, 0xb4]);
    let frame = seal4(tcp(SYN, &full));
    let out = fx.run(Direction::Ingress, &frame);
    let pseudo = pseudo4(SRC4, DST4, frame.len() - l4);
    clamped(&frame, &out, l4, l4 + 20 + 38, 1360, &pseudo);
}

#[test]
fn everything_else_and_hostile_frames_pass_untouched() {
    let Some(mut fx) = Fixture::for_test("everything_else_and_hostile_frames_pass_untouched")
    else {
        return;
    };
    // Already small enough, or exactly the clamp.
    fx.untouched(
        "MSS below the clamp",
        &seal4(tcp(SYN, &linux_options(1200))),
    );
    fx.untouched("MSS at the clamp", &seal4(tcp(SYN, &linux_options(1360))));
    fx.untouched(
        "IPv6 MSS at the clamp",
        &seal6(TCP, &[], tcp(SYN, &linux_options(1340))),
    );
    // Not a SYN.
    fx.untouched("an ACK", &seal4(tcp(ACK, &linux_options(1460))));
    fx.untouched("a SYN without options", &seal4(tcp(SYN, &[])));
    // Not TCP: UDP with SYN-like bytes where TCP's flags would be.
    let mut udp = tcp(SYN, &linux_options(1460));
    udp[12] = 0x70;
    fx.untouched("UDP", &eth(0x0800, &ipv4(SRC4, DST4, UDP, 7, 0, &udp)));
    // A later IPv4 fragment whose payload looks like a SYN.
    let segment = tcp(SYN, &linux_options(1460));
    fx.untouched(
        "a later IPv4 fragment",
        &eth(0x0800, &ipv4(SRC4, DST4, TCP, 7, 0x0010, &segment)),
    );
    // A later IPv6 fragment likewise.
    let mut later = frag6(TCP, 8, false, 9);
    later.extend_from_slice(&segment);
    fx.untouched(
        "a later IPv6 fragment",
        &eth(0x86dd, &ipv6(SRC6, DST6, 44, &later)),
    );
    // Hostile options: a zero length (the kernel stops there), an end of
    // options before the MSS, an MSS option of the wrong length.
    fx.untouched(
        "an option of length 0",
        &seal4(tcp(SYN, &[8, 0, 2, 4, 5, 0xb4])),
    );
    fx.untouched("EOL before the MSS", &seal4(tcp(SYN, &[0, 2, 4, 5, 0xb4])));
    fx.untouched("an MSS of length 3", &seal4(tcp(SYN, &[2, 3, 5, 0xb4])));
    fx.untouched(
        "an option past the end",
        &seal4(tcp(SYN, &[8, 10, 2, 4, 5, 0xb4])),
    );
    // Truncated: the frame ends inside the MSS value, inside the TCP
    // header, right after the IP header (the kernel refuses to run a
    // program on a frame cut inside the IP header).
    let frame = seal4(tcp(SYN, &linux_options(1460)));
    for cut in [14 + 20 + 23, 14 + 20 + 10, 14 + 20] {
        fx.untouched(&format!("a frame cut at {cut}"), &frame[..cut]);
    }
    // A data offset past the frame's end: the options present are walked
    // until the frame ends, nothing is written beyond.
    let mut claims_more = seal4(tcp(SYN, &[1, 1, 1, 1]));
    claims_more[14 + 20 + 12] = 15 << 4;
    fx.untouched("a data offset past the end", &claims_more);
    // IPv4 header length below 20.
    let mut short_ihl = seal4(tcp(SYN, &linux_options(1460)));
    short_ihl[14] = 0x44;
    fx.untouched("an IHL of 4", &short_ihl);
    // An interface MTU large enough for the MSS: nothing to clamp.
    fx.netns.ip(&["link", "set", "m0", "mtu", "9000"]);
    fx.untouched(
        "MSS 1460 at MTU 9000",
        &seal4(tcp(SYN, &linux_options(1460))),
    );
}
