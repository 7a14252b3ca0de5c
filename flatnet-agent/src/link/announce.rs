//! Telling the LAN about a pod's addresses once its interface is up.

use std::{fs, net::IpAddr, path::Path, time::Duration};

use etherparse::ArpOperation;
use ipnet::IpNet;

use super::LinkError;
use crate::{
    netns::run_in_netns,
    packet::{BROADCAST, MacAddr, NdpMessage, RawSocket, arp_frame, ipv6_multicast_mac, ndp_frame},
};

/// IPv6 all-nodes multicast address, destination of unsolicited advertisements.
const ALL_NODES: std::net::Ipv6Addr = std::net::Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);

/// How often announcements are repeated ([`super::ArpPolicy::Arping`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnnounceSettings {
    /// Rounds of announcements (at least one is always sent).
    pub count: u32,
    /// Time between rounds. Repeats cover switches and hosts that missed
    /// the first frame while the link came up.
    pub interval: Duration,
}

impl Default for AnnounceSettings {
    /// Three rounds one second apart, as `arping -U -c 3`.
    fn default() -> Self {
        Self {
            count: 3,
            interval: Duration::from_secs(1),
        }
    }
}

/// Makes the kernel announce the interface's IPv6 addresses itself when
/// it comes up (`ndisc_notify`). Call before link up. (IPv4's `arp_notify`
/// is set over netlink, which a read-only `/proc/sys` does not stop; Linux
/// takes no IPv6 device setting over netlink.)
///
/// Returns `false` when `/proc/sys` is read-only, as in a container without
/// privileges (the chart's agent): the caller then sends the IPv6
/// announcements itself, which has the same effect on the LAN.
pub(crate) fn enable_kernel_ndisc_notify(netns: &Path, ifname: &str) -> Result<bool, LinkError> {
    let path = format!("/proc/sys/net/ipv6/conf/{ifname}/ndisc_notify");
    // /proc/sys/net shows the namespace of the thread that opens it.
    run_in_netns(netns, || match fs::write(&path, b"1") {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::ReadOnlyFilesystem => {
            tracing::debug!(
                path,
                "/proc/sys is read-only; announcing IPv6 addresses with frames instead"
            );
            Ok(false)
        }
        Err(source) => Err(LinkError::Io {
            op: "write sysctl",
            path: path.clone().into(),
            source,
        }),
    })?
}

/// The frames announcing `addresses` from `mac`: a gratuitous ARP request
/// per IPv4 address and an unsolicited neighbour advertisement (Override
/// set, Solicited clear, to all nodes) per IPv6 address.
pub(crate) fn announcement_frames(mac: MacAddr, addresses: &[IpNet]) -> Vec<Vec<u8>> {
    addresses
        .iter()
        .map(|net| match net.addr() {
            IpAddr::V4(ip) => arp_frame(
                mac,
                BROADCAST,
                ArpOperation::REQUEST,
                (mac, ip),
                ([0; 6], ip),
            ),
            IpAddr::V6(ip) => ndp_frame(
                mac,
                ipv6_multicast_mac(ALL_NODES),
                ip,
                ALL_NODES,
                NdpMessage::NeighborAdvertisement {
                    target: ip,
                    solicited: false,
                    override_flag: true,
                },
            ),
        })
        .map(|frame| frame.expect("fixed-size ARP and NDP frames always build"))
        .collect()
}

/// Sends the first round of announcements now and the remaining rounds
/// from a background task, so attaching does not wait for them.
pub(crate) async fn announce(
    netns: &Path,
    ifname: &str,
    mac: MacAddr,
    addresses: &[IpNet],
    settings: AnnounceSettings,
) -> Result<(), LinkError> {
    let error = |source| LinkError::Announce {
        ifname: ifname.to_owned(),
        netns: netns.display().to_string(),
        source,
    };
    // The socket belongs to the namespace it is opened in.
    let socket = run_in_netns(netns, || RawSocket::open(ifname))?.map_err(error)?;
    let frames = announcement_frames(mac, addresses);
    for frame in &frames {
        socket.send(frame).map_err(error)?;
    }
    if settings.count > 1 {
        let ifname = ifname.to_owned();
        tokio::spawn(async move {
            for _ in 1..settings.count {
                tokio::time::sleep(settings.interval).await;
                for frame in &frames {
                    if let Err(e) = socket.send(frame) {
                        // The pod went away meanwhile; nothing left to announce.
                        tracing::debug!(%ifname, error = %e, "stopping announcements");
                        return;
                    }
                }
            }
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use etherparse::{Icmpv6Type, NetSlice, SlicedPacket, TransportSlice};

    const MAC: MacAddr = [0x02, 0xaa, 0, 0, 0, 1];

    #[test]
    fn one_frame_per_address_of_the_right_kind() {
        let addresses: Vec<IpNet> = vec![
            "192.0.2.10/24".parse().unwrap(),
            "2001:db8::10/64".parse().unwrap(),
        ];
        let frames = announcement_frames(MAC, &addresses);
        assert_eq!(frames.len(), 2);

        let arp = &frames[0];
        assert_eq!(&arp[0..6], &BROADCAST);
        assert_eq!(&arp[6..12], &MAC);
        assert_eq!(&arp[12..14], &[0x08, 0x06]);
        // Request, sender = target = the pod address, sender MAC = pod MAC.
        assert_eq!(&arp[20..22], &[0, 1]);
        assert_eq!(&arp[22..28], &MAC);
        assert_eq!(&arp[28..32], &[192, 0, 2, 10]);
        assert_eq!(&arp[38..42], &[192, 0, 2, 10]);

        let na = SlicedPacket::from_ethernet(&frames[1]).unwrap();
        let Some(NetSlice::Ipv6(ip)) = na.net else {
            panic!("not IPv6")
        };
        assert_eq!(ip.header().destination_addr(), ALL_NODES);
        assert_eq!(
            ip.header().source_addr(),
            "2001:db8::10".parse::<std::net::Ipv6Addr>().unwrap()
        );
        let Some(TransportSlice::Icmpv6(icmp)) = na.transport else {
            panic!("not ICMPv6")
        };
        let Icmpv6Type::NeighborAdvertisement(header) = icmp.icmp_type() else {
            panic!("not a neighbour advertisement")
        };
        assert!(header.r#override && !header.solicited && !header.router);
        assert_eq!(&frames[1][0..6], &[0x33, 0x33, 0, 0, 0, 1]);
    }
}
