//! An `AF_PACKET` socket bound to one interface, for sending whole frames.

use std::{
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
};

/// Errors of raw frame I/O.
#[derive(Debug, thiserror::Error)]
pub enum RawSocketError {
    /// The interface does not exist in the calling thread's network namespace.
    #[error("interface {interface} not found: {source}")]
    NoInterface {
        /// Interface name.
        interface: String,
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// A socket call failed (needs CAP_NET_RAW).
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

/// A raw packet socket bound to one interface of the calling thread's
/// network namespace.
pub struct RawSocket {
    fd: OwnedFd,
    ifindex: i32,
    interface: String,
}

impl RawSocket {
    /// Opens a send-only `AF_PACKET` socket on `interface`.
    pub fn open(interface: &str) -> Result<Self, RawSocketError> {
        let ifindex = nix::net::if_::if_nametoindex(interface).map_err(|source| {
            RawSocketError::NoInterface {
                interface: interface.to_owned(),
                source,
            }
        })? as i32;
        // Protocol 0: receive nothing, so the socket never queues frames.
        // SAFETY: plain socket(2) call; the result is checked before use.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(RawSocketError::Io {
                op: "socket",
                interface: interface.to_owned(),
                source: io::Error::last_os_error(),
            });
        }
        // SAFETY: `raw` is a freshly created, owned descriptor.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Self {
            fd,
            ifindex,
            interface: interface.to_owned(),
        })
    }

    /// Sends one complete Ethernet frame (headers included) out of the interface.
    pub fn send(&self, frame: &[u8]) -> Result<(), RawSocketError> {
        // SAFETY: sockaddr_ll is plain old data; zeroed is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = libc::AF_PACKET as u16;
        addr.sll_ifindex = self.ifindex;
        addr.sll_halen = 6;
        addr.sll_addr[..6].copy_from_slice(&frame[..6.min(frame.len())]);
        // SAFETY: `frame` and `addr` are valid for the lengths given.
        let sent = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        if sent < 0 {
            return Err(RawSocketError::Io {
                op: "sendto",
                interface: self.interface.clone(),
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}
