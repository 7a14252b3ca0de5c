//! Capturing the frames a namespace's interface receives (flatnet's raw
//! `AF_PACKET` socket, no tool needed), recognising address announcements
//! in them, and the ARP request a foreign host sends.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::Context;
use flatnet_packet_socket::{RawSocket, Receive};

use super::netns::in_netns;

/// How long one receive waits before the capture thread looks at `stop` again.
const POLL: Duration = Duration::from_millis(50);

const ETHERTYPE_ARP: u16 = 0x0806;
const ETHERTYPE_IPV6: u16 = 0x86dd;
const ICMPV6: u8 = 58;
const NEIGHBOR_ADVERTISEMENT: u8 = 136;

/// Frames received on one interface since [`Capture::start`].
pub struct Capture {
    frames: Arc<Mutex<Vec<Vec<u8>>>>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Capture {
    /// Starts capturing the ARP and IPv6 frames `ifname` in `netns` receives.
    pub fn start(netns: &str, ifname: &str) -> anyhow::Result<Self> {
        let socket = in_netns(netns, || RawSocket::open_receiving(ifname, Receive::All))?
            .with_context(|| format!("open a packet socket on {ifname} in {netns}"))?;
        let frames = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::spawn({
            let (frames, stop) = (frames.clone(), stop.clone());
            move || {
                let mut buf = vec![0u8; 2048];
                while !stop.load(Ordering::SeqCst) {
                    // A bounded wait, so the loop sees `stop`.
                    let Ok(Some(received)) = socket.receive(&mut buf, POLL) else {
                        continue;
                    };
                    if received.len > 14 {
                        let frame = &buf[..received.len];
                        if matches!(ethertype(frame), ETHERTYPE_ARP | ETHERTYPE_IPV6) {
                            frames.lock().expect("capture lock").push(frame.to_vec());
                        }
                    }
                }
            }
        });
        Ok(Self {
            frames,
            stop,
            thread: Some(thread),
        })
    }

    /// Whether a gratuitous ARP for `ip` from `mac` has been received.
    pub fn saw_gratuitous_arp(&self, mac: [u8; 6], ip: Ipv4Addr) -> bool {
        self.any(|frame| is_gratuitous_arp(frame, mac, ip))
    }

    /// Whether an unsolicited neighbour advertisement for `ip` from `mac`
    /// has been received.
    pub fn saw_unsolicited_na(&self, mac: [u8; 6], ip: Ipv6Addr) -> bool {
        self.any(|frame| is_unsolicited_na(frame, mac, ip))
    }

    fn any(&self, matches: impl Fn(&[u8]) -> bool) -> bool {
        self.frames
            .lock()
            .expect("capture lock")
            .iter()
            .any(|f| matches(f))
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A broadcast ARP request from `mac` at `sender` asking for `target`:
/// what a host using `sender` sends, and all a silent one ever sends.
pub fn arp_request(mac: [u8; 6], sender: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
    let mut frame = vec![0xff; 6];
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&ETHERTYPE_ARP.to_be_bytes());
    // Ethernet, IPv4, address lengths 6 and 4, opcode 1 (request).
    frame.extend_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
    frame.extend_from_slice(&mac);
    frame.extend_from_slice(&sender.octets());
    frame.extend_from_slice(&[0; 6]);
    frame.extend_from_slice(&target.octets());
    frame
}

fn ethertype(frame: &[u8]) -> u16 {
    u16::from_be_bytes([frame[12], frame[13]])
}

/// An ARP packet (request or reply) whose sender and target address are
/// both `ip`, sent by `mac`: a host announcing that `ip` is at `mac`.
fn is_gratuitous_arp(frame: &[u8], mac: [u8; 6], ip: Ipv4Addr) -> bool {
    if frame.len() < 42 || ethertype(frame) != ETHERTYPE_ARP || frame[6..12] != mac {
        return false;
    }
    let arp = &frame[14..42];
    let sender_mac = &arp[8..14];
    let sender_ip = &arp[14..18];
    let target_ip = &arp[24..28];
    sender_mac == mac && sender_ip == ip.octets() && target_ip == ip.octets()
}

/// An ICMPv6 neighbour advertisement (directly after the IPv6 header) for
/// target `ip` with Solicited clear and Override set, sent by `mac`.
fn is_unsolicited_na(frame: &[u8], mac: [u8; 6], ip: Ipv6Addr) -> bool {
    const IP: usize = 14;
    const ICMP: usize = IP + 40;
    if frame.len() < ICMP + 24 || ethertype(frame) != ETHERTYPE_IPV6 || frame[6..12] != mac {
        return false;
    }
    let next_header = frame[IP + 6];
    let icmp = &frame[ICMP..];
    let flags = icmp[4];
    let solicited = flags & 0x40 != 0;
    let override_flag = flags & 0x20 != 0;
    next_header == ICMPV6
        && icmp[0] == NEIGHBOR_ADVERTISEMENT
        && !solicited
        && override_flag
        && icmp[8..24] == ip.octets()
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0a];
    const OTHER: [u8; 6] = [0x02, 0, 0, 0, 0, 0x0b];

    fn ethernet(src: [u8; 6], ethertype: u16) -> Vec<u8> {
        let mut frame = vec![0xff; 6];
        frame.extend_from_slice(&src);
        frame.extend_from_slice(&ethertype.to_be_bytes());
        frame
    }

    #[test]
    fn an_arp_request_is_what_the_uplink_program_records_as_its_sender_using_the_address() {
        let sender: Ipv4Addr = "192.0.2.12".parse().unwrap();
        let frame = arp_request(MAC, sender, "192.0.2.1".parse().unwrap());
        assert_eq!(frame.len(), 42);
        assert_eq!(frame[..6], [0xff; 6], "broadcast");
        let arp: &[u8; 28] = frame[14..].try_into().unwrap();
        let sighting = flatnet_common::wire::arp_sighting(arp).unwrap();
        assert_eq!(sighting.kind, flatnet_common::wire::WireKind::ArpRequest);
        assert_eq!(sighting.mac, MAC);
        assert_eq!(sighting.addr[12..], sender.octets());
        assert!(sighting.recordable());
    }

    fn arp(src: [u8; 6], op: u16, sender: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
        let mut frame = arp_request(src, sender, target);
        frame[20..22].copy_from_slice(&op.to_be_bytes());
        frame
    }

    fn na(src: [u8; 6], flags: u8, target: Ipv6Addr) -> Vec<u8> {
        let mut frame = ethernet(src, ETHERTYPE_IPV6);
        let mut ip = [0u8; 40];
        ip[0] = 0x60;
        ip[5] = 32;
        ip[6] = ICMPV6;
        ip[7] = 255;
        frame.extend_from_slice(&ip);
        let mut icmp = vec![NEIGHBOR_ADVERTISEMENT, 0, 0, 0, flags, 0, 0, 0];
        icmp.extend_from_slice(&target.octets());
        icmp.extend_from_slice(&[2, 1]);
        icmp.extend_from_slice(&src);
        frame.extend_from_slice(&icmp);
        frame
    }

    #[test]
    fn a_gratuitous_arp_is_recognised_and_a_probe_or_request_is_not() {
        let pod: Ipv4Addr = "192.0.2.10".parse().unwrap();
        let gateway: Ipv4Addr = "192.0.2.1".parse().unwrap();
        assert!(is_gratuitous_arp(&arp(MAC, 1, pod, pod), MAC, pod));
        assert!(is_gratuitous_arp(&arp(MAC, 2, pod, pod), MAC, pod));
        // An ordinary request from the pod, a conflict probe, another sender.
        assert!(!is_gratuitous_arp(&arp(MAC, 1, pod, gateway), MAC, pod));
        let unspecified = Ipv4Addr::UNSPECIFIED;
        assert!(!is_gratuitous_arp(&arp(MAC, 1, unspecified, pod), MAC, pod));
        assert!(!is_gratuitous_arp(&arp(OTHER, 1, pod, pod), MAC, pod));
    }

    #[test]
    fn an_unsolicited_advertisement_is_recognised_and_a_solicited_one_is_not() {
        let pod: Ipv6Addr = "2001:db8::10".parse().unwrap();
        let other: Ipv6Addr = "2001:db8::11".parse().unwrap();
        assert!(is_unsolicited_na(&na(MAC, 0x20, pod), MAC, pod));
        assert!(!is_unsolicited_na(&na(MAC, 0x60, pod), MAC, pod));
        assert!(!is_unsolicited_na(&na(MAC, 0x20, other), MAC, pod));
        assert!(!is_unsolicited_na(&na(OTHER, 0x20, pod), MAC, pod));
        assert!(!is_unsolicited_na(&na(MAC, 0x20, pod)[..60], MAC, pod));
    }
}
