//! Work inside the lab's network namespaces from this process: sockets are
//! created on a thread that joined the namespace (a socket stays in the
//! namespace it was created in), so the lab itself never changes namespace.

use std::{
    fs::File,
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream},
    os::fd::AsRawFd,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, anyhow, bail};
use nix::{
    errno::Errno,
    // `sockopt_impl!` expands to the other two.
    getsockopt_impl,
    setsockopt_impl,
    sockopt_impl,
    sys::{
        socket::{
            AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, SockaddrIn, connect,
            getsockopt, recv, send, setsockopt, socket, sockopt,
        },
        time::TimeVal,
    },
};

use super::process::{self, POLL};

/// How long a TCP connection or reply is waited for before the exchange
/// counts as failed (a dropped SYN is never answered).
const GIVE_UP: Duration = Duration::from_millis(1500);

/// Runs `work` on a thread that joined the named network namespace.
pub fn in_netns<T: Send>(netns: &str, work: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
    let path = format!("/run/netns/{netns}");
    let file = File::open(&path).with_context(|| format!("open network namespace {path}"))?;
    thread::scope(|scope| {
        scope
            .spawn(|| {
                // SAFETY: setns(2) on an open namespace file; it changes only
                // this short-lived thread's namespace.
                if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(anyhow!(
                        "enter network namespace {path}: {}",
                        std::io::Error::last_os_error()
                    ));
                }
                Ok(work())
            })
            .join()
            .map_err(|_| anyhow!("work inside network namespace {netns} panicked"))?
    })
}

/// `GET path` on `address` over HTTP/1.0 from the calling thread's
/// namespace; the body of a 200 answer.
pub fn http_get(address: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("HTTP response without a header end")?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        bail!("GET {path}: {}", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_owned())
}

/// A TCP echo server (one byte per connection) inside a namespace, on every
/// address of the namespace, IPv4 and IPv6; stopped when dropped.
pub struct EchoServer {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl EchoServer {
    /// Listens on `[::]:port` in `netns`.
    pub fn start(netns: &str, port: u16) -> anyhow::Result<Self> {
        let listener = in_netns(netns, || TcpListener::bind(("::", port)))?
            .with_context(|| format!("listen on TCP port {port} in {netns}"))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::spawn({
            let stop = stop.clone();
            move || {
                while !stop.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((mut stream, _)) => {
                            let _ = stream.set_nonblocking(false);
                            let _ = stream.set_read_timeout(Some(GIVE_UP));
                            let mut byte = [0u8; 1];
                            if stream.read_exact(&mut byte).is_ok() {
                                let _ = stream.write_all(&byte);
                            }
                        }
                        Err(_) => thread::sleep(POLL),
                    }
                }
            }
        });
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Connects from `netns` to `target`, sends a byte and reads it back.
/// `Ok(false)` when the connection or the reply does not come (dropped or
/// refused).
pub fn tcp_exchange(netns: &str, target: SocketAddr) -> anyhow::Result<bool> {
    process::check_interrupt()?;
    in_netns(netns, || {
        let Ok(mut stream) = TcpStream::connect_timeout(&target, GIVE_UP) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(GIVE_UP));
        let mut byte = [0u8; 1];
        stream.write_all(b"f").is_ok() && stream.read_exact(&mut byte).is_ok() && &byte == b"f"
    })
}

/// A TCP exchange that must succeed.
pub fn expect_tcp(netns: &str, target: SocketAddr) -> anyhow::Result<()> {
    if !tcp_exchange(netns, target)? {
        bail!("TCP exchange {netns} -> {target} failed");
    }
    Ok(())
}

/// One ICMP echo from `netns` to `target` (IPv4 or IPv6) that must be answered.
pub fn ping(netns: &str, target: &str) -> anyhow::Result<()> {
    let family = if target.contains(':') { "-6" } else { "-4" };
    process::exec_in(netns, "ping", &[family, "-c", "1", "-W", "3", target])
        .map(drop)
        .with_context(|| format!("ping {netns} -> {target}"))
}

/// IPv4 and ICMP header bytes in front of an echo's payload.
const IPV4_ICMP_HEADERS: usize = 20 + 8;
const ICMP_ECHO_REPLY: u8 = 0;
const ICMP_ECHO_REQUEST: u8 = 8;

sockopt_impl!(
    /// `IP_MTU_DISCOVER`: whether the kernel sets Don't Fragment and
    /// refuses datagrams larger than the path MTU (`IP_PMTUDISC_DO`).
    PmtuDiscover,
    Both,
    libc::IPPROTO_IP,
    libc::IP_MTU_DISCOVER,
    libc::c_int
);

/// What an IPv4 echo request with Don't Fragment met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DfEcho {
    /// Answered.
    Answered,
    /// Refused by the sending namespace: larger than the MTU its route to
    /// the target carries (`EMSGSIZE`), which it names.
    TooBig { mtu: u32 },
    /// Sent, never answered.
    Unanswered,
}

/// Pings `target` from `netns` with Don't Fragment set, the packet
/// `size` bytes long (IPv4 header included), up to `tries` times until
/// answered; what `ping -M do -s <size - 28>` of iputils checks, done here
/// because busybox's ping (the test VM's) has no `-M`.
pub fn df_echo(netns: &str, target: Ipv4Addr, size: u32, tries: u16) -> anyhow::Result<DfEcho> {
    process::check_interrupt()?;
    let size = usize::try_from(size)?;
    let payload = size
        .checked_sub(IPV4_ICMP_HEADERS)
        .with_context(|| format!("an echo of {size} bytes has no room for its headers"))?;
    in_netns(netns, || -> anyhow::Result<DfEcho> {
        let fd = socket(
            AddressFamily::Inet,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::Icmp,
        )
        .context("open a raw ICMP socket")?;
        setsockopt(&fd, PmtuDiscover, &libc::IP_PMTUDISC_DO).context("set IP_PMTUDISC_DO")?;
        // Connected: only the target's packets are received, and IP_MTU
        // tells the route's MTU.
        connect(
            fd.as_raw_fd(),
            &SockaddrIn::from(SocketAddrV4::new(target, 0)),
        )
        .with_context(|| format!("connect a raw ICMP socket to {target}"))?;
        setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(0, 200_000))?;
        // The thread id keeps concurrent probes of this process apart.
        let id = u16::try_from(nix::unistd::gettid().as_raw() & 0xffff).unwrap_or_default();
        let mut reply = vec![0u8; size + 64];
        for seq in 1..=tries {
            match send(
                fd.as_raw_fd(),
                &echo_request(id, seq, payload),
                MsgFlags::empty(),
            ) {
                Ok(_) => {}
                Err(Errno::EMSGSIZE) => {
                    let mtu = getsockopt(&fd, sockopt::IpMtu).context("read IP_MTU")?;
                    return Ok(DfEcho::TooBig {
                        mtu: u32::try_from(mtu).unwrap_or_default(),
                    });
                }
                Err(e) => bail!("send an echo request to {target}: {e}"),
            }
            let deadline = Instant::now() + Duration::from_secs(2);
            while Instant::now() < deadline {
                process::check_interrupt()?;
                match recv(fd.as_raw_fd(), &mut reply, MsgFlags::empty()) {
                    Ok(len) if is_echo_reply(&reply[..len], id, seq) => {
                        return Ok(DfEcho::Answered);
                    }
                    Ok(_) | Err(Errno::EAGAIN | Errno::EINTR) => {}
                    Err(e) => bail!("receive from {target}: {e}"),
                }
            }
        }
        Ok(DfEcho::Unanswered)
    })?
}

/// An ICMP echo request (header and `payload` bytes, checksum set).
fn echo_request(id: u16, seq: u16, payload: usize) -> Vec<u8> {
    let mut packet = vec![ICMP_ECHO_REQUEST, 0, 0, 0];
    packet.extend_from_slice(&id.to_be_bytes());
    packet.extend_from_slice(&seq.to_be_bytes());
    packet.extend((0..payload).map(|i| i.to_le_bytes()[0]));
    let checksum = internet_checksum(&packet);
    packet[2..4].copy_from_slice(&checksum.to_be_bytes());
    packet
}

/// Whether `packet` (an IPv4 packet as a raw socket receives it) is the
/// echo reply to request `id`/`seq`.
fn is_echo_reply(packet: &[u8], id: u16, seq: u16) -> bool {
    let header_len = usize::from(packet.first().map_or(0, |b| b & 0x0f)) * 4;
    let Some(icmp) = packet.get(header_len..header_len + 8) else {
        return false;
    };
    icmp[0] == ICMP_ECHO_REPLY && icmp[4..6] == id.to_be_bytes() && icmp[6..8] == seq.to_be_bytes()
}

/// RFC 1071: the ones' complement of the ones' complement sum of 16-bit words.
fn internet_checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|pair| {
            u32::from(u16::from_be_bytes([
                pair[0],
                pair.get(1).copied().unwrap_or(0),
            ]))
        })
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).unwrap_or(u16::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_requests_carry_a_valid_checksum_and_their_size() {
        let request = echo_request(0x1234, 7, 1400 - IPV4_ICMP_HEADERS);
        assert_eq!(request.len() + 20, 1400);
        assert_eq!(&request[4..8], &[0x12, 0x34, 0, 7]);
        // The sum over a packet with its checksum in place is all ones.
        assert_eq!(internet_checksum(&request), 0);
        // An odd length pads with a zero byte.
        assert_eq!(internet_checksum(&[0xff]), 0x00ff);
    }

    #[test]
    fn only_the_reply_to_the_request_counts() {
        let mut packet = vec![0x45u8];
        packet.resize(20, 0);
        packet.extend_from_slice(&[ICMP_ECHO_REPLY, 0, 0, 0, 0x12, 0x34, 0, 7]);
        assert!(is_echo_reply(&packet, 0x1234, 7));
        assert!(!is_echo_reply(&packet, 0x1234, 8), "another sequence");
        assert!(!is_echo_reply(&packet, 0x1235, 7), "another prober");
        packet[20] = ICMP_ECHO_REQUEST;
        assert!(!is_echo_reply(&packet, 0x1234, 7), "a request");
        assert!(!is_echo_reply(&packet[..24], 0x1234, 7), "truncated");
    }
}
