//! Hand-built frames for the policy program tests: every header byte is
//! under the test's control, including broken ones.
#![allow(dead_code)]

use std::net::{Ipv4Addr, Ipv6Addr};

pub const TCP: u8 = 6;
pub const UDP: u8 = 17;
pub const SCTP: u8 = 132;
pub const ICMP: u8 = 1;
pub const ICMPV6: u8 = 58;

const POD_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
const PEER_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

/// Ethernet II frame around `payload`.
pub fn eth(ether_type: u16, payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(14 + payload.len());
    f.extend_from_slice(&POD_MAC);
    f.extend_from_slice(&PEER_MAC);
    f.extend_from_slice(&ether_type.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// IPv4 packet; `frag` is the flags/fragment-offset field.
pub fn ipv4(
    src: Ipv4Addr,
    dst: Ipv4Addr,
    protocol: u8,
    id: u16,
    frag: u16,
    payload: &[u8],
) -> Vec<u8> {
    let mut h = vec![0u8; 20];
    h[0] = 0x45;
    h[2..4].copy_from_slice(&((20 + payload.len()) as u16).to_be_bytes());
    h[4..6].copy_from_slice(&id.to_be_bytes());
    h[6..8].copy_from_slice(&frag.to_be_bytes());
    h[8] = 64;
    h[9] = protocol;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    h.extend_from_slice(payload);
    h
}

/// IPv6 packet with the given first next-header and payload (which may
/// start with extension headers).
pub fn ipv6(src: Ipv6Addr, dst: Ipv6Addr, next_header: u8, payload: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; 40];
    h[0] = 0x60;
    h[4..6].copy_from_slice(&(payload.len() as u16).to_be_bytes());
    h[6] = next_header;
    h[7] = 64;
    h[8..24].copy_from_slice(&src.octets());
    h[24..40].copy_from_slice(&dst.octets());
    h.extend_from_slice(payload);
    h
}

/// A transport header with ports (TCP-sized, enough for UDP and SCTP too).
pub fn ports(src_port: u16, dst_port: u16) -> Vec<u8> {
    let mut h = vec![0u8; 20];
    h[0..2].copy_from_slice(&src_port.to_be_bytes());
    h[2..4].copy_from_slice(&dst_port.to_be_bytes());
    h
}

/// An ICMP / ICMPv6 message header.
pub fn icmp(icmp_type: u8, id: u16) -> Vec<u8> {
    let mut h = vec![icmp_type, 0, 0, 0, 0, 0, 0, 1];
    h[4..6].copy_from_slice(&id.to_be_bytes());
    h
}

/// An IPv4 frame carrying `protocol` with ports.
pub fn v4(src: &str, dst: &str, protocol: u8, src_port: u16, dst_port: u16) -> Vec<u8> {
    let l4 = if protocol == ICMP {
        icmp(8, src_port)
    } else {
        ports(src_port, dst_port)
    };
    eth(
        0x0800,
        &ipv4(
            src.parse().unwrap(),
            dst.parse().unwrap(),
            protocol,
            1,
            0,
            &l4,
        ),
    )
}

/// An IPv6 frame carrying `protocol` with ports.
pub fn v6(src: &str, dst: &str, protocol: u8, src_port: u16, dst_port: u16) -> Vec<u8> {
    let l4 = if protocol == ICMPV6 {
        icmp(128, src_port)
    } else {
        ports(src_port, dst_port)
    };
    eth(
        0x86dd,
        &ipv6(src.parse().unwrap(), dst.parse().unwrap(), protocol, &l4),
    )
}

/// An IPv6 extension header of 8 bytes (hop-by-hop, destination options, ...).
pub fn ext8(next_header: u8) -> Vec<u8> {
    vec![next_header, 0, 1, 4, 0, 0, 0, 0]
}

/// An IPv6 fragment header.
pub fn frag6(next_header: u8, offset_units: u16, more: bool, id: u32) -> Vec<u8> {
    let mut h = vec![next_header, 0];
    h.extend_from_slice(&((offset_units << 3) | u16::from(more)).to_be_bytes());
    h.extend_from_slice(&id.to_be_bytes());
    h
}

/// Inserts an 802.1Q tag after the MAC addresses.
pub fn vlan_tagged(frame: &[u8], vid: u16) -> Vec<u8> {
    let mut out = frame[..12].to_vec();
    out.extend_from_slice(&0x8100u16.to_be_bytes());
    out.extend_from_slice(&vid.to_be_bytes());
    out.extend_from_slice(&frame[12..]);
    out
}

/// An ICMP / ICMPv6 error message of `icmp_type` quoting `quoted` (an IP
/// packet, possibly cut short).
pub fn icmp_error(icmp_type: u8, quoted: &[u8]) -> Vec<u8> {
    let mut m = vec![icmp_type, 0, 0, 0, 0, 0, 0, 0];
    m.extend_from_slice(quoted);
    m
}
