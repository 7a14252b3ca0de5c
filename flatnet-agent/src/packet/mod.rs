//! Building and sending raw L2 frames: ARP and IPv6 neighbour discovery.
//!
//! Used to announce pod addresses (gratuitous ARP, unsolicited neighbour
//! advertisements) without any external binary, and by tests to inject
//! exact frames. The socket itself is `flatnet-packet-socket`'s, re-exported
//! here.

mod frames;

pub use flatnet_packet_socket::{RawSocket, RawSocketError, Receive, Received};
pub use frames::{
    BROADCAST, FrameError, MacAddr, NdpMessage, arp_frame, dad_probe_frame, ipv6_multicast_mac,
    ndp_frame, solicited_node,
};
