//! flatnet's one raw `AF_PACKET` socket: whole Ethernet frames sent out of,
//! and received on, one interface of the calling thread's network namespace.
//!
//! The agent (address announcements, the ADD-time conflict probe), its tests
//! and benchmarks, and xtask's lab capture all use this type, so the unsafe
//! socket calls live in this one file. It is a crate of its own, beside the
//! `no_std` map types, because xtask cannot depend on the agent: the agent's
//! build script needs the eBPF object that xtask builds.

use std::{
    ffi::CString,
    io,
    mem::size_of,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    time::{Duration, SystemTime, UNIX_EPOCH},
};

/// `ETH_P_ALL`: every protocol.
const ETH_P_ALL: u16 = 0x0003;

/// Errors of raw frame I/O.
#[derive(Debug, thiserror::Error)]
pub enum RawSocketError {
    /// The interface does not exist in the calling thread's network namespace.
    #[error("interface {interface} not found: {source}")]
    NoInterface {
        /// Interface name.
        interface: String,
        /// Why the lookup failed.
        #[source]
        source: io::Error,
    },
    /// A socket call failed (opening one needs `CAP_NET_RAW`).
    #[error("{op} on raw socket for {interface}: {source}")]
    Io {
        /// The operation.
        op: &'static str,
        /// Interface name.
        interface: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

/// The frames a socket receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Receive {
    /// None: a send-only socket never queues frames.
    Nothing,
    /// Every frame of the interface, incoming and outgoing.
    All,
    /// Frames of one EtherType (host byte order, for example `0x0806` for ARP).
    EtherType(u16),
}

impl Receive {
    /// The protocol number as `socket(2)` and `bind(2)` take it (network byte order).
    fn protocol(self) -> u16 {
        match self {
            Self::Nothing => 0,
            Self::All => ETH_P_ALL.to_be(),
            Self::EtherType(ethertype) => ethertype.to_be(),
        }
    }
}

/// One received frame: its length in the caller's buffer and its direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Received {
    /// Bytes written to the buffer (frames longer than it are cut).
    pub len: usize,
    /// The interface sent it (a copy of an outgoing frame), rather than received it.
    pub outgoing: bool,
    /// When the kernel received it (wall clock), on a socket that
    /// [`RawSocket::timestamp_arrivals`] asked for it.
    pub arrived: Option<SystemTime>,
}

/// A raw packet socket bound to one interface of the calling thread's
/// network namespace.
#[derive(Debug)]
pub struct RawSocket {
    fd: OwnedFd,
    ifindex: i32,
    interface: String,
}

impl RawSocket {
    /// Opens a send-only socket on `interface`.
    pub fn open(interface: &str) -> Result<Self, RawSocketError> {
        Self::open_receiving(interface, Receive::Nothing)
    }

    /// Opens a socket on `interface` that sends frames and receives `receive`.
    pub fn open_receiving(interface: &str, receive: Receive) -> Result<Self, RawSocketError> {
        let ifindex = interface_index(interface)?;
        let protocol = receive.protocol();
        // Protocol 0: no frames until the bind below names the protocol
        // with the interface. A socket made with its protocol receives
        // from every interface at once, and its bind then waits for an RCU
        // grace period (milliseconds) to take that back.
        // SAFETY: plain socket(2) call; the result is checked before use.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io_error("socket", interface));
        }
        // SAFETY: `raw` is a freshly created descriptor nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let socket = Self {
            fd,
            ifindex,
            interface: interface.to_owned(),
        };
        if receive != Receive::Nothing {
            // Bound to the interface, so frames of other interfaces never arrive.
            let mut addr = link_address(ifindex);
            addr.sll_protocol = protocol;
            // SAFETY: `addr` is a valid sockaddr_ll of the given length.
            let bound = unsafe {
                libc::bind(
                    socket.fd.as_raw_fd(),
                    (&raw const addr).cast(),
                    socklen::<libc::sockaddr_ll>(),
                )
            };
            if bound < 0 {
                return Err(socket.last_error("bind"));
            }
        }
        Ok(socket)
    }

    /// Also receives frames sent to any multicast group (for example
    /// neighbour advertisements to all nodes), not only the groups the
    /// interface joined.
    pub fn receive_all_multicast(&self) -> Result<(), RawSocketError> {
        // SAFETY: packet_mreq is plain old data; zeroed is a valid value.
        let mut mreq: libc::packet_mreq = unsafe { std::mem::zeroed() };
        mreq.mr_ifindex = self.ifindex;
        mreq.mr_type = libc::PACKET_MR_ALLMULTI as u16;
        self.set_option(
            libc::SOL_PACKET,
            libc::PACKET_ADD_MEMBERSHIP,
            &mreq,
            "PACKET_ADD_MEMBERSHIP",
        )
    }

    /// Sets the kernel's receive queue for this socket to `bytes` (for
    /// bursts that arrive faster than they are read).
    pub fn set_receive_buffer(&self, bytes: usize) -> Result<(), RawSocketError> {
        let bytes = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
        self.set_option(libc::SOL_SOCKET, libc::SO_RCVBUF, &bytes, "SO_RCVBUF")
    }

    /// Sends one complete Ethernet frame (headers included) out of the interface.
    pub fn send(&self, frame: &[u8]) -> Result<(), RawSocketError> {
        let mut addr = link_address(self.ifindex);
        addr.sll_halen = 6;
        let destination = &frame[..6.min(frame.len())];
        addr.sll_addr[..destination.len()].copy_from_slice(destination);
        // SAFETY: `frame` and `addr` are valid for the lengths given.
        let sent = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&raw const addr).cast(),
                socklen::<libc::sockaddr_ll>(),
            )
        };
        if sent < 0 {
            return Err(self.last_error("sendto"));
        }
        Ok(())
    }

    /// The next frame, written to `buffer`, or `None` when nothing arrived
    /// within `wait` (or a signal interrupted the wait).
    pub fn receive(
        &self,
        buffer: &mut [u8],
        wait: Duration,
    ) -> Result<Option<Received>, RawSocketError> {
        // To the nanosecond (poll(2) counts whole milliseconds): the
        // conflict probe's waits are a millisecond or two.
        let timeout = libc::timespec {
            tv_sec: wait.as_secs().try_into().unwrap_or(i32::MAX.into()),
            tv_nsec: wait.subsec_nanos().into(),
        };
        let mut fds = [libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: `fds` is a valid array of one pollfd and `timeout` a valid
        // timespec; no signal mask is given.
        let ready =
            unsafe { libc::ppoll(fds.as_mut_ptr(), 1, &raw const timeout, std::ptr::null()) };
        if ready == 0 {
            return Ok(None);
        }
        if ready < 0 {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::Interrupted {
                return Ok(None);
            }
            return Err(self.error("poll", error));
        }
        // SAFETY: sockaddr_ll is plain old data; zeroed is a valid value.
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        // Room for one timespec control message, aligned as cmsghdr.
        let mut control = [0u64; 8];
        let mut iov = libc::iovec {
            iov_base: buffer.as_mut_ptr().cast(),
            iov_len: buffer.len(),
        };
        // SAFETY: msghdr is plain old data; zeroed is a valid value.
        let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
        message.msg_name = (&raw mut from).cast();
        message.msg_namelen = socklen::<libc::sockaddr_ll>();
        message.msg_iov = &raw mut iov;
        message.msg_iovlen = 1;
        message.msg_control = control.as_mut_ptr().cast();
        // size_t with glibc, socklen_t with musl: 64 fits either.
        message.msg_controllen = std::mem::size_of_val(&control) as _;
        // SAFETY: every pointer in `message` is valid for the length given
        // with it, for the duration of the call.
        let len =
            unsafe { libc::recvmsg(self.fd.as_raw_fd(), &raw mut message, libc::MSG_DONTWAIT) };
        let Ok(len) = usize::try_from(len) else {
            let error = io::Error::last_os_error();
            if error.kind() == io::ErrorKind::WouldBlock {
                return Ok(None);
            }
            return Err(self.error("recvmsg", error));
        };
        Ok(Some(Received {
            len,
            outgoing: from.sll_pkttype == libc::PACKET_OUTGOING,
            // SAFETY: the kernel filled `message`'s control buffer.
            arrived: unsafe { arrival_time(&message) },
        }))
    }

    /// The index of the interface the socket is bound to.
    #[must_use]
    pub fn ifindex(&self) -> u32 {
        self.ifindex.unsigned_abs()
    }

    /// The interface's MAC, as the kernel reports it for the socket bound
    /// to it (one system call, whatever the number of interfaces).
    pub fn hardware_address(&self) -> Result<[u8; 6], RawSocketError> {
        // SAFETY: sockaddr_ll is plain old data; zeroed is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut len = socklen::<libc::sockaddr_ll>();
        // SAFETY: `addr` is valid for `len` bytes.
        let named =
            unsafe { libc::getsockname(self.fd.as_raw_fd(), (&raw mut addr).cast(), &raw mut len) };
        if named < 0 {
            return Err(self.last_error("getsockname"));
        }
        let mut mac = [0u8; 6];
        mac.copy_from_slice(&addr.sll_addr[..6]);
        Ok(mac)
    }

    /// Has the kernel stamp each frame with the time it received it
    /// ([`Received::arrived`]): the time a frame reached the node, however
    /// late the reader runs.
    pub fn timestamp_arrivals(&self) -> Result<(), RawSocketError> {
        let on: libc::c_int = 1;
        self.set_option(
            libc::SOL_SOCKET,
            libc::SO_TIMESTAMPNS,
            &on,
            "SO_TIMESTAMPNS",
        )
    }

    /// The interface this socket is bound to.
    pub fn interface(&self) -> &str {
        &self.interface
    }

    fn set_option<T>(
        &self,
        level: libc::c_int,
        name: libc::c_int,
        value: &T,
        op: &'static str,
    ) -> Result<(), RawSocketError> {
        // SAFETY: `value` is a valid, initialised `T` for its size.
        let set = unsafe {
            libc::setsockopt(
                self.fd.as_raw_fd(),
                level,
                name,
                std::ptr::from_ref(value).cast(),
                socklen::<T>(),
            )
        };
        if set < 0 {
            return Err(self.last_error(op));
        }
        Ok(())
    }

    fn last_error(&self, op: &'static str) -> RawSocketError {
        self.error(op, io::Error::last_os_error())
    }

    fn error(&self, op: &'static str, source: io::Error) -> RawSocketError {
        RawSocketError::Io {
            op,
            interface: self.interface.clone(),
            source,
        }
    }
}

/// The index of `interface` in the calling thread's namespace.
fn interface_index(interface: &str) -> Result<i32, RawSocketError> {
    let no_interface = |source| RawSocketError::NoInterface {
        interface: interface.to_owned(),
        source,
    };
    let name = CString::new(interface)
        .map_err(|e| no_interface(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
    // SAFETY: a NUL-terminated name, resolved in this thread's namespace.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(no_interface(io::Error::last_os_error()));
    }
    i32::try_from(index).map_err(|e| no_interface(io::Error::new(io::ErrorKind::InvalidData, e)))
}

/// A link-layer address for interface `ifindex`, every other field zero.
fn link_address(ifindex: i32) -> libc::sockaddr_ll {
    // SAFETY: sockaddr_ll is plain old data; zeroed is a valid value.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_ifindex = ifindex;
    addr
}

/// The `SCM_TIMESTAMPNS` time in `message`'s control data, if any.
///
/// # Safety
/// `message` is a `msghdr` a successful `recvmsg` filled.
unsafe fn arrival_time(message: &libc::msghdr) -> Option<SystemTime> {
    // SAFETY: the caller's; the CMSG_* helpers stay within msg_controllen.
    unsafe {
        let mut header = libc::CMSG_FIRSTHDR(message);
        while !header.is_null() {
            if (*header).cmsg_level == libc::SOL_SOCKET
                && (*header).cmsg_type == libc::SCM_TIMESTAMPNS
            {
                let stamp: libc::timespec =
                    std::ptr::read_unaligned(libc::CMSG_DATA(header).cast());
                let seconds = u64::try_from(stamp.tv_sec).ok()?;
                let nanos = u32::try_from(stamp.tv_nsec).ok()?;
                return UNIX_EPOCH.checked_add(Duration::new(seconds, nanos));
            }
            header = libc::CMSG_NXTHDR(message, header);
        }
    }
    None
}

/// `size_of::<T>()` as a socket length (every type passed is a few bytes).
fn socklen<T>() -> libc::socklen_t {
    libc::socklen_t::try_from(size_of::<T>()).expect("socket structures are small")
}

fn io_error(op: &'static str, interface: &str) -> RawSocketError {
    RawSocketError::Io {
        op,
        interface: interface.to_owned(),
        source: io::Error::last_os_error(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_interface_is_named_in_the_error() {
        let error = RawSocket::open("flatnet-none0").unwrap_err();
        assert!(
            matches!(&error, RawSocketError::NoInterface { interface, .. } if interface == "flatnet-none0"),
            "{error:?}"
        );
        assert!(error.to_string().contains("flatnet-none0"), "{error}");
    }

    #[test]
    fn protocols_are_in_network_byte_order() {
        assert_eq!(Receive::Nothing.protocol(), 0);
        assert_eq!(Receive::All.protocol().to_ne_bytes(), [0x00, 0x03]);
        assert_eq!(
            Receive::EtherType(0x0806).protocol().to_ne_bytes(),
            [0x08, 0x06]
        );
    }
}
