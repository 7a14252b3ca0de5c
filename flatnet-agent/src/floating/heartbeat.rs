//! The heartbeat agents send each other over the flat link, and its UDP
//! transport.
//!
//! A heartbeat is one small JSON datagram: who sends it, its incarnation
//! (process start time, so a restarted agent replaces its old entry) and
//! the floating addresses it can serve. More addresses than fit one
//! datagram are sent as several parts ([`Heartbeat::split`]), each saying
//! which part of how many it is. Datagrams that do not parse are dropped:
//! anyone on the LAN can send to the port.

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

/// Addresses per heartbeat part: 25 of the longest IPv6 text (41 bytes
/// quoted) and the rest of the message stay under [`MAX_HEARTBEAT_BYTES`].
pub const ADDRESSES_PER_PART: usize = 25;

/// One agent's heartbeat.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Heartbeat {
    /// The node name.
    pub node: String,
    /// The agent's process start, in nanoseconds since the epoch.
    pub incarnation: u64,
    /// The floating addresses this agent can serve now (this part's).
    pub candidate_for: Vec<IpAddr>,
    /// Which part this is, from 0.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub part: u16,
    /// How many parts the agent's addresses take (1 when unset).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub parts: u16,
}

fn is_zero(n: &u16) -> bool {
    *n == 0
}

fn one() -> u16 {
    1
}

fn is_one(n: &u16) -> bool {
    *n == 1
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
    /// The heartbeat(s) of `node` offering `candidate_for`: one part per
    /// [`ADDRESSES_PER_PART`] addresses, at least one.
    pub fn split(node: &str, incarnation: u64, candidate_for: &[IpAddr]) -> Vec<Self> {
        let chunks: Vec<&[IpAddr]> = if candidate_for.is_empty() {
            vec![&[]]
        } else {
            candidate_for.chunks(ADDRESSES_PER_PART).collect()
        };
        let parts = u16::try_from(chunks.len()).unwrap_or(u16::MAX);
        chunks
            .into_iter()
            .zip(0..parts)
            .map(|(chunk, part)| Self {
                node: node.to_owned(),
                incarnation,
                candidate_for: chunk.to_vec(),
                part,
                parts,
            })
            .collect()
    }

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
        let dual_stack = self.socket.local_addr()?.is_ipv6();
        for peer in peers {
            // An IPv6 socket reaches IPv4 peers at their mapped address.
            let peer = match peer {
                SocketAddr::V4(v4) if dual_stack => {
                    SocketAddr::from((v4.ip().to_ipv6_mapped(), v4.port()))
                }
                other => *other,
            };
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
            // Interrupted: a signal (SIGTERM) the caller's loop looks at.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
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
            part: 0,
            parts: 1,
        }
    }

    #[test]
    fn many_addresses_are_split_into_parts_that_each_fit_a_datagram() {
        let many: Vec<IpAddr> = (0..130u16)
            .map(|i| {
                format!("fd00:ffff:ffff:ffff:ffff:ffff:ffff:{i:x}")
                    .parse()
                    .unwrap()
            })
            .collect();
        let parts = Heartbeat::split("a-node-with-a-rather-long-name", u64::MAX, &many);
        assert_eq!(parts.len(), 6);
        let mut joined = Vec::new();
        for (index, part) in parts.iter().enumerate() {
            let bytes = part.encode().expect("every part fits");
            assert_eq!(&Heartbeat::decode(&bytes).unwrap(), part);
            assert_eq!((usize::from(part.part), part.parts), (index, 6));
            joined.extend(part.candidate_for.iter().copied());
        }
        assert_eq!(joined, many);
        let none = Heartbeat::split("n", 1, &[]);
        assert_eq!(none.len(), 1);
        assert!(none[0].candidate_for.is_empty());
        // One part is sent without the part fields.
        let text = String::from_utf8(none[0].encode().unwrap()).unwrap();
        assert!(!text.contains("part"), "{text}");
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
