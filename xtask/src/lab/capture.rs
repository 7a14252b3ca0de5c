//! Capturing the frames a namespace's interface receives (a raw `AF_PACKET`
//! socket, no tool needed) and recognising address announcements in them.

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
};

use anyhow::{Context, bail};

use super::netns::in_netns;

const ETH_P_ALL: u16 = 0x0003;
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
        let socket = in_netns(netns, || open_packet_socket(ifname))?
            .with_context(|| format!("open a packet socket on {ifname} in {netns}"))?;
        let frames = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::spawn({
            let (frames, stop) = (frames.clone(), stop.clone());
            move || {
                let mut buf = vec![0u8; 2048];
                while !stop.load(Ordering::SeqCst) {
                    // SAFETY: recv into a buffer of the given length; the
                    // socket has a receive timeout so the loop sees `stop`.
                    let n = unsafe {
                        libc::recv(socket.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0)
                    };
                    if n > 14 {
                        let frame = &buf[..n as usize];
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

fn open_packet_socket(ifname: &str) -> anyhow::Result<OwnedFd> {
    let protocol = ETH_P_ALL.to_be();
    // SAFETY: plain socket(2) call; the descriptor is owned right away.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW, i32::from(protocol)) };
    if fd < 0 {
        bail!("socket(AF_PACKET): {}", std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor nobody else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let name = std::ffi::CString::new(ifname)?;
    // SAFETY: a NUL-terminated name; resolved in this thread's namespace.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        bail!("no interface {ifname}");
    }
    // SAFETY: sockaddr_ll is plain data; zeroed is a valid start.
    let mut address: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    address.sll_family = libc::AF_PACKET as u16;
    address.sll_protocol = protocol;
    address.sll_ifindex = index as i32;
    // SAFETY: bind with a correctly sized sockaddr_ll.
    let bound = unsafe {
        libc::bind(
            socket.as_raw_fd(),
            (&raw const address).cast(),
            std::mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if bound != 0 {
        bail!("bind to {ifname}: {}", std::io::Error::last_os_error());
    }
    let timeout = libc::timeval {
        tv_sec: 0,
        tv_usec: 50_000,
    };
    // SAFETY: SO_RCVTIMEO with a timeval of the right size.
    let set = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const timeout).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    if set != 0 {
        bail!("SO_RCVTIMEO: {}", std::io::Error::last_os_error());
    }
    Ok(socket)
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

    fn arp(src: [u8; 6], op: u16, sender: Ipv4Addr, target: Ipv4Addr) -> Vec<u8> {
        let mut frame = ethernet(src, ETHERTYPE_ARP);
        frame.extend_from_slice(&[0, 1, 0x08, 0, 6, 4]);
        frame.extend_from_slice(&op.to_be_bytes());
        frame.extend_from_slice(&src);
        frame.extend_from_slice(&sender.octets());
        frame.extend_from_slice(&[0; 6]);
        frame.extend_from_slice(&target.octets());
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
