//! The heartbeat agents send each other over the flat link, and its UDP
//! transport.
//!
//! A heartbeat is one small JSON datagram: who sends it, its incarnation
//! (process start time, so a restarted agent replaces its old entry) and
//! the floating addresses it can serve. Datagrams that do not parse are
//! dropped: anyone on the LAN can send to the port.

use std::{
    io,
    net::{IpAddr, SocketAddr, UdpSocket},
    time::Duration,
};

use serde::{Deserialize, Serialize};

/// How often an agent sends its heartbeat.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_millis(100);

/// The UDP port heartbeats are sent to.
pub const HEARTBEAT_PORT: u16 = 7946;

/// Largest heartbeat accepted (one Ethernet frame's payload).
pub const MAX_HEARTBEAT_BYTES: usize = 1400;

/// One agent's heartbeat.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Heartbeat {
    /// The node name.
    pub node: String,
    /// The agent's process start, in nanoseconds since the epoch.
    pub incarnation: u64,
    /// The floating addresses this agent can serve now.
    pub candidate_for: Vec<IpAddr>,
}

/// Why a datagram is not a heartbeat.
#[derive(Debug, thiserror::Error)]
pub enum HeartbeatError {
    /// Larger than [`MAX_HEARTBEAT_BYTES`].
    #[error("heartbeat of {0} bytes is larger than {MAX_HEARTBEAT_BYTES}")]
    TooLarge(usize),
    /// Not the JSON of a heartbeat.
    #[error("not a heartbeat: {0}")]
    Malformed(#[from] serde_json::Error),
    /// The socket failed.
    #[error("heartbeat socket: {0}")]
    Io(#[from] io::Error),
}

impl Heartbeat {
    /// The datagram.
    ///
    /// # Errors
    /// [`HeartbeatError::TooLarge`] when too many addresses are listed.
    pub fn encode(&self) -> Result<Vec<u8>, HeartbeatError> {
        let bytes = serde_json::to_vec(self)?;
        if bytes.len() > MAX_HEARTBEAT_BYTES {
            return Err(HeartbeatError::TooLarge(bytes.len()));
        }
        Ok(bytes)
    }

    /// Parses a datagram.
    ///
    /// # Errors
    /// Too large, or not a heartbeat.
    pub fn decode(bytes: &[u8]) -> Result<Self, HeartbeatError> {
        if bytes.len() > MAX_HEARTBEAT_BYTES {
            return Err(HeartbeatError::TooLarge(bytes.len()));
        }
        Ok(serde_json::from_slice(bytes)?)
    }
}

/// A UDP socket sending heartbeats to the peers and receiving theirs.
pub struct HeartbeatSocket {
    socket: UdpSocket,
}

impl HeartbeatSocket {
    /// Binds `local` (the node's address on the flat link and
    /// [`HEARTBEAT_PORT`] in the daemon; any address in tests).
    ///
    /// # Errors
    /// The bind failed.
    pub fn bind(local: SocketAddr) -> Result<Self, HeartbeatError> {
        Ok(Self {
            socket: UdpSocket::bind(local)?,
        })
    }

    /// The bound address.
    ///
    /// # Errors
    /// The socket failed.
    pub fn local_addr(&self) -> Result<SocketAddr, HeartbeatError> {
        Ok(self.socket.local_addr()?)
    }

    /// Sends `heartbeat` to every peer; a peer that cannot be reached now
    /// (its link down) is skipped.
    ///
    /// # Errors
    /// The heartbeat does not encode.
    pub fn send(&self, heartbeat: &Heartbeat, peers: &[SocketAddr]) -> Result<(), HeartbeatError> {
        let bytes = heartbeat.encode()?;
        for peer in peers {
            if let Err(error) = self.socket.send_to(&bytes, peer) {
                tracing::debug!(%peer, %error, "heartbeat not sent");
            }
        }
        Ok(())
    }

    /// The next heartbeat within `timeout`, `None` when none came.
    /// Datagrams that are not heartbeats are skipped.
    ///
    /// # Errors
    /// The socket failed.
    pub fn receive(&self, timeout: Duration) -> Result<Option<Heartbeat>, HeartbeatError> {
        self.socket
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
        let mut buffer = [0u8; MAX_HEARTBEAT_BYTES + 1];
        match self.socket.recv_from(&mut buffer) {
            Ok((len, from)) => match Heartbeat::decode(&buffer[..len]) {
                Ok(heartbeat) => Ok(Some(heartbeat)),
                Err(error) => {
                    tracing::debug!(%from, %error, "dropping a datagram that is not a heartbeat");
                    Ok(None)
                }
            },
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn heartbeat(node: &str, addrs: &[&str]) -> Heartbeat {
        Heartbeat {
            node: node.into(),
            incarnation: 7,
            candidate_for: addrs.iter().map(|a| a.parse().unwrap()).collect(),
        }
    }

    #[test]
    fn heartbeats_round_trip_and_garbage_is_refused() {
        let beat = heartbeat("node-a", &["192.168.50.10", "fd00:50::10"]);
        assert_eq!(Heartbeat::decode(&beat.encode().unwrap()).unwrap(), beat);
        for garbage in [
            &b"{}"[..],
            b"\xff\x00",
            br#"{"node":"a","incarnation":1,"candidateFor":[],"x":1}"#,
        ] {
            assert!(matches!(
                Heartbeat::decode(garbage),
                Err(HeartbeatError::Malformed(_))
            ));
        }
        let many: Vec<String> = (0..200).map(|i| format!("fd00:50::{i:x}")).collect();
        let refs: Vec<&str> = many.iter().map(String::as_str).collect();
        assert!(matches!(
            heartbeat("n", &refs).encode(),
            Err(HeartbeatError::TooLarge(_))
        ));
        assert!(matches!(
            Heartbeat::decode(&[b' '; 2000]),
            Err(HeartbeatError::TooLarge(2000))
        ));
    }

    #[test]
    fn heartbeats_cross_a_real_udp_socket_and_garbage_is_skipped() {
        let a = HeartbeatSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let b = HeartbeatSocket::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let to_b = [b.local_addr().unwrap()];
        UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .send_to(b"not a heartbeat", to_b[0])
            .unwrap();
        let beat = heartbeat("node-a", &["192.168.50.10"]);
        a.send(&beat, &to_b).unwrap();
        assert_eq!(
            b.receive(Duration::from_secs(2)).unwrap(),
            None,
            "garbage first, skipped"
        );
        assert_eq!(b.receive(Duration::from_secs(2)).unwrap(), Some(beat));
        assert_eq!(b.receive(Duration::from_millis(20)).unwrap(), None);
    }
}
