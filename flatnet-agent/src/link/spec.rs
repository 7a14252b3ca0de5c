//! What a pod attachment is, and the rules it must satisfy before any
//! side effect (validate → set up → tear down).

use std::{
    fmt,
    net::IpAddr,
    path::{Path, PathBuf},
};

pub use flatnet_k8s::env::ArpPolicy;
pub use flatnet_k8s::validation::{
    IpvlanFlag, IpvlanMode, LinkMode, MAX_IFNAME_LEN, MAX_VLAN_ID, MacvlanMode, ParentLink,
};
use ipnet::IpNet;

use flatnet_k8s::validation::SubnetError;

use super::LinkError;
use crate::packet::MacAddr;

/// Smallest MTU the kernel accepts for IPv4 (RFC 791).
const MIN_MTU_IPV4: u32 = 68;
/// Smallest MTU IPv6 allows (RFC 8200 §5).
const MIN_MTU_IPV6: u32 = 1280;

/// A route in the pod (a subnet's `spec.routes` entry).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RouteSpec {
    /// Destination; `0.0.0.0/0` or `::/0` is a default route.
    pub destination: IpNet,
    /// Next hop; `None` makes the route on-link (scope link).
    pub via: Option<IpAddr>,
    /// Another pod interface the route goes through (the primary `eth0`,
    /// for instance); `None` is the flat interface. It must exist when the
    /// attachment is made.
    pub dev: Option<String>,
    /// Preferred source address; on the flat interface it must be one of
    /// the pod's addresses.
    pub source: Option<IpAddr>,
    /// Route metric (priority); the kernel default when `None`.
    pub metric: Option<u32>,
}

/// Destinations (cluster, service and node CIDRs) routed through the pod's
/// primary interface, via that interface's default gateway of the same
/// family.
///
/// A family whose default route moves to the flat interface must have a
/// primary default gateway (else the attach fails); for the others a
/// destination is skipped when the primary has none (a single-stack primary
/// network with dual-stack cluster CIDRs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PrimaryRoutes {
    /// The primary interface in the pod (normally `eth0`).
    pub ifname: String,
    /// The destinations.
    pub destinations: Vec<IpNet>,
    /// Also route the node's own networks (`addNodeCIDR`): the networks of
    /// the addresses on the node's default-route interfaces. A node network
    /// that overlaps a pod address's network becomes a host route to the
    /// node address alone, so the flat subnet itself stays on the flat
    /// interface.
    pub node_networks: bool,
}

/// Node routes to each pod address through the pod's primary network
/// (`addPodIPToHost`): macvlan children cannot talk to their parent, so
/// this is how the node reaches its own pods. Made by
/// [`super::Attachments::resolve_host_route`].
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HostRoute {
    /// The node-side link the routes go through (the pod's veth peer, or
    /// the bridge it hangs off).
    pub link: String,
    /// Next hops, at most one per family: the primary interface's
    /// addresses. A family without one is routed on-link.
    #[serde(default)]
    pub via: Vec<IpAddr>,
}

impl HostRoute {
    /// The next hop for `address`'s family.
    pub fn via_for(&self, address: IpAddr) -> Option<IpAddr> {
        self.via
            .iter()
            .copied()
            .find(|v| v.is_ipv4() == address.is_ipv4())
    }
}

/// The default gateways of the pod's primary interface before the flat
/// interface took the default route over, so that removing a half-made
/// attachment (an ADD interrupted by a crash) gives the pod its default
/// routes back.
#[derive(Clone, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PrimaryDefaults {
    /// The primary interface in the pod.
    pub ifname: String,
    /// Its default gateways, at most one per family.
    pub gateways: Vec<IpAddr>,
}

/// The description of one pod interface on the flat network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AttachmentSpec {
    /// Name of the FlatNetworkSubnet, used in messages that tell what to fix.
    pub subnet: String,
    /// The node interface the child is made on: the master, or its VLAN
    /// interface (`vlan` 0 means untagged, the child sits on `master`).
    pub parent: ParentLink,
    /// macvlan or ipvlan, with mode and flag.
    pub kind: LinkMode,
    /// The pod's network namespace file.
    pub netns: PathBuf,
    /// The interface name in the pod (`CNI_IFNAME`).
    pub ifname: String,
    /// Fixed MAC address (macvlan only); the kernel picks one when `None`.
    pub mac: Option<MacAddr>,
    /// MTU; the parent's when `None`.
    pub mtu: Option<u32>,
    /// Addresses with the subnet's prefix length (IPv4, IPv6 or both).
    pub addresses: Vec<IpNet>,
    /// Further addresses on the interface, outside the subnets: no
    /// gateway, routes, announcement or node route (the 6to4 address).
    pub extra_addresses: Vec<IpNet>,
    /// Gateways, at most one per family.
    pub gateways: Vec<IpAddr>,
    /// Whether the flat interface carries the pod's default route for each
    /// family that has a gateway. Existing default routes of those families
    /// (through the primary interface) are replaced; other families are
    /// left alone.
    pub default_route: bool,
    /// Extra routes on the flat interface.
    pub routes: Vec<RouteSpec>,
    /// Destinations kept on the primary interface.
    pub primary_routes: Option<PrimaryRoutes>,
    /// Optional node-side routes to the pod addresses.
    pub host_route: Option<HostRoute>,
    /// How the addresses are announced.
    pub arp_policy: ArpPolicy,
    /// Set `proxy_arp` on the interface, so the pod answers ARP for the
    /// addresses it routes elsewhere (rancher-flat-network's `proxyARP`).
    pub proxy_arp: bool,
}

/// An [`AttachmentSpec`] that passed [`AttachmentSpec::validate`].
#[derive(Clone, Debug)]
pub struct ValidSpec {
    spec: AttachmentSpec,
    parent: String,
}

impl ValidSpec {
    /// The validated spec.
    pub fn spec(&self) -> &AttachmentSpec {
        &self.spec
    }

    /// The node interface the child is created on: `master` or
    /// `<master>.<vlan>`.
    pub fn parent(&self) -> &str {
        &self.parent
    }

    /// The gateway of the family of `addr`, if any.
    pub fn gateway_for(&self, addr: IpAddr) -> Option<IpAddr> {
        self.spec
            .gateways
            .iter()
            .copied()
            .find(|gw| gw.is_ipv4() == addr.is_ipv4())
    }
}

/// Checks a Linux interface name by the project's one rule
/// ([`flatnet_k8s::validation::check_ifname`], the kernel's).
pub fn check_ifname(name: &str) -> Result<(), String> {
    flatnet_k8s::validation::check_ifname(name).map_err(|e| e.to_string())
}

impl AttachmentSpec {
    /// Checks everything that can be checked without touching the system.
    pub fn validate(&self) -> Result<ValidSpec, LinkError> {
        let invalid = |field: &'static str, reason: String| LinkError::InvalidSpec {
            subnet: self.subnet.clone(),
            field,
            reason,
        };
        check_ifname(&self.ifname).map_err(|r| invalid("ifname", r))?;
        self.parent.check().map_err(|e| match e {
            SubnetError::Vlan(_) => invalid("vlan", e.to_string()),
            _ => invalid("master", e.to_string()),
        })?;
        let parent = self.parent.ifname();
        check_path(&self.netns).map_err(|r| invalid("netns", r))?;
        self.validate_mac().map_err(|r| invalid("mac", r))?;
        self.validate_addresses()
            .map_err(|r| invalid("addresses", r))?;
        self.validate_gateways()
            .map_err(|r| invalid("gateways", r))?;
        self.validate_mtu().map_err(|r| invalid("mtu", r))?;
        self.validate_routes().map_err(|r| invalid("routes", r))?;
        if let Some(primary) = &self.primary_routes {
            check_ifname(&primary.ifname).map_err(|r| invalid("primary_routes.ifname", r))?;
            if primary.ifname == self.ifname {
                return Err(invalid(
                    "primary_routes.ifname",
                    format!("{} is the flat interface itself", primary.ifname),
                ));
            }
            if let Some(bad) = primary.destinations.iter().find(|d| d.trunc() != **d) {
                return Err(invalid(
                    "primary_routes.destinations",
                    format!("{bad} has host bits set; use {}", bad.trunc()),
                ));
            }
        }
        if let Some(host) = &self.host_route {
            check_ifname(&host.link).map_err(|r| invalid("host_route.link", r))?;
            let repeated = host.via.iter().enumerate().find_map(|(i, v)| {
                host.via[..i]
                    .iter()
                    .any(|o| o.is_ipv4() == v.is_ipv4())
                    .then_some(v)
            });
            if let Some(twice) = repeated {
                return Err(invalid(
                    "host_route.via",
                    format!("more than one next hop for the family of {twice}"),
                ));
            }
        }
        Ok(ValidSpec {
            spec: self.clone(),
            parent,
        })
    }

    fn validate_mac(&self) -> Result<(), String> {
        let Some(mac) = self.mac else { return Ok(()) };
        if let LinkMode::Ipvlan(..) = self.kind {
            return Err(format!(
                "{} is set, but ipvlan children share the MAC of their parent; \
                 remove the MAC or use macvlan",
                format_mac(mac)
            ));
        }
        if mac[0] & 1 != 0 {
            return Err(format!(
                "{} is a multicast address; a unicast address is needed",
                format_mac(mac)
            ));
        }
        if mac == [0; 6] {
            return Err("00:00:00:00:00:00 is not a usable address".into());
        }
        Ok(())
    }

    fn validate_addresses(&self) -> Result<(), String> {
        if self.addresses.is_empty() {
            return Err("at least one address is needed".into());
        }
        for (i, net) in self.addresses.iter().enumerate() {
            let addr = net.addr();
            if addr.is_unspecified() || addr.is_loopback() || addr.is_multicast() {
                return Err(format!("{net} is not a unicast host address"));
            }
            if self.addresses[..i].iter().any(|n| n.addr() == addr) {
                return Err(format!("{addr} is listed twice"));
            }
        }
        Ok(())
    }

    fn validate_gateways(&self) -> Result<(), String> {
        for (i, gw) in self.gateways.iter().enumerate() {
            if self.gateways[..i]
                .iter()
                .any(|g| g.is_ipv4() == gw.is_ipv4())
            {
                return Err(format!("more than one gateway for the family of {gw}"));
            }
            if self.addresses.iter().any(|n| n.addr() == *gw) {
                return Err(format!("{gw} is also one of the pod's addresses"));
            }
            let link_local_v6 = matches!(gw, IpAddr::V6(v6) if v6.is_unicast_link_local());
            if !link_local_v6 && !self.addresses.iter().any(|n| n.contains(gw)) {
                return Err(format!(
                    "{gw} is outside every pod address's network ({}); it could not be reached",
                    join(&self.addresses)
                ));
            }
        }
        if self.default_route && self.gateways.is_empty() {
            return Err("a default route through the flat interface needs a gateway".into());
        }
        Ok(())
    }

    fn validate_mtu(&self) -> Result<(), String> {
        let Some(mtu) = self.mtu else { return Ok(()) };
        let min = if self.addresses.iter().any(|n| n.addr().is_ipv6()) {
            MIN_MTU_IPV6
        } else {
            MIN_MTU_IPV4
        };
        if !(min..=65535).contains(&mtu) {
            return Err(format!("{mtu} is out of range {min}..=65535"));
        }
        Ok(())
    }

    fn validate_routes(&self) -> Result<(), String> {
        for route in &self.routes {
            let dst = route.destination;
            if dst.trunc() != dst {
                return Err(format!("{dst} has host bits set; use {}", dst.trunc()));
            }
            let v4 = dst.addr().is_ipv4();
            if let Some(via) = route.via
                && via.is_ipv4() != v4
            {
                return Err(format!("{dst} via {via}: families differ"));
            }
            if let Some(src) = route.source
                && src.is_ipv4() != v4
            {
                return Err(format!("{dst} source {src}: families differ"));
            }
            if let Some(dev) = &route.dev {
                check_ifname(dev).map_err(|r| format!("{dst} dev {r}"))?;
            } else {
                // Checks only possible for the flat interface, whose
                // addresses are known before it exists.
                if !self.addresses.iter().any(|n| n.addr().is_ipv4() == v4) {
                    return Err(format!(
                        "{dst}: the pod has no address of that family to send from"
                    ));
                }
                if let Some(src) = route.source
                    && !self.addresses.iter().any(|n| n.addr() == src)
                {
                    return Err(format!("{dst}: source {src} is not a pod address"));
                }
            }
            if dst.prefix_len() == 0
                && self.default_route
                && self.gateways.iter().any(|g| g.is_ipv4() == v4)
            {
                return Err(format!(
                    "{dst} conflicts with the default route through the gateway"
                ));
            }
        }
        Ok(())
    }
}

fn check_path(path: &Path) -> Result<(), String> {
    if path.as_os_str().is_empty() {
        return Err("is empty".into());
    }
    if !path.is_absolute() {
        return Err(format!("{} is not an absolute path", path.display()));
    }
    Ok(())
}

fn join<T: fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Formats a MAC address as `aa:bb:cc:dd:ee:ff`.
pub fn format_mac(mac: MacAddr) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Parses `aa:bb:cc:dd:ee:ff` (case-insensitive).
pub fn parse_mac(text: &str) -> Option<MacAddr> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        let part = parts.next()?;
        if part.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec() -> AttachmentSpec {
        AttachmentSpec {
            subnet: "lan".into(),
            parent: ParentLink {
                master: "eth0".into(),
                vlan: 0,
            },
            kind: LinkMode::Macvlan(MacvlanMode::Bridge),
            netns: "/run/netns/pod".into(),
            ifname: "eth1".into(),
            mac: None,
            mtu: None,
            addresses: vec!["192.0.2.10/24".parse().unwrap()],
            extra_addresses: vec![],
            gateways: vec!["192.0.2.1".parse().unwrap()],
            default_route: true,
            routes: vec![],
            primary_routes: None,
            host_route: None,
            arp_policy: ArpPolicy::Arping,
            proxy_arp: false,
        }
    }

    fn field_of(err: LinkError) -> &'static str {
        match err {
            LinkError::InvalidSpec { field, .. } => field,
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn accepts_a_plain_spec_and_names_the_parent() {
        let valid = spec().validate().unwrap();
        assert_eq!(valid.parent(), "eth0");
        let mut vlan = spec();
        vlan.parent.vlan = 100;
        assert_eq!(vlan.validate().unwrap().parent(), "eth0.100");
    }

    #[test]
    fn vlan_name_over_15_bytes_is_rejected_with_the_fix() {
        let mut s = spec();
        s.parent.master = "enp0s31f6abcde".into();
        s.parent.vlan = 4094;
        let err = s.validate().unwrap_err();
        assert!(err.to_string().contains("shorter master name"), "{err}");
        s.parent.vlan = 4095;
        assert_eq!(field_of(s.validate().unwrap_err()), "vlan");
    }

    #[test]
    fn ipvlan_with_mac_is_rejected() {
        let mut s = spec();
        s.kind = LinkMode::Ipvlan(IpvlanMode::L2, IpvlanFlag::Bridge);
        s.mac = Some([2, 0, 0, 0, 0, 1]);
        let err = s.validate().unwrap_err();
        assert!(err.to_string().contains("ipvlan"), "{err}");
        assert!(err.to_string().contains("subnet lan"), "{err}");
    }

    #[test]
    fn multicast_mac_is_rejected() {
        let mut s = spec();
        s.mac = Some([1, 0, 0x5e, 0, 0, 1]);
        assert_eq!(field_of(s.validate().unwrap_err()), "mac");
    }

    #[test]
    fn gateway_must_be_on_link_and_one_per_family() {
        let mut s = spec();
        s.gateways = vec!["198.51.100.1".parse().unwrap()];
        assert_eq!(field_of(s.validate().unwrap_err()), "gateways");
        s.gateways = vec!["192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap()];
        assert_eq!(field_of(s.validate().unwrap_err()), "gateways");
        // An IPv6 link-local gateway is always on-link.
        s.addresses.push("2001:db8::10/64".parse().unwrap());
        s.gateways = vec!["fe80::1".parse().unwrap()];
        s.validate().unwrap();
    }

    #[test]
    fn default_route_needs_a_gateway() {
        let mut s = spec();
        s.gateways.clear();
        assert_eq!(field_of(s.validate().unwrap_err()), "gateways");
        s.default_route = false;
        s.validate().unwrap();
    }

    #[test]
    fn route_checks() {
        let route = |dst: &str, via: Option<&str>| RouteSpec {
            destination: dst.parse().unwrap(),
            via: via.map(|v| v.parse().unwrap()),
            dev: None,
            source: None,
            metric: None,
        };
        let mut s = spec();
        s.routes = vec![route("10.0.0.1/8", None)];
        assert!(s.validate().unwrap_err().to_string().contains("10.0.0.0/8"));
        s.routes = vec![route("2001:db8::/32", None)];
        assert_eq!(field_of(s.validate().unwrap_err()), "routes");
        s.routes = vec![route("10.0.0.0/8", Some("2001:db8::1"))];
        assert_eq!(field_of(s.validate().unwrap_err()), "routes");
        s.routes = vec![route("0.0.0.0/0", Some("192.0.2.254"))];
        assert_eq!(field_of(s.validate().unwrap_err()), "routes");
        s.routes = vec![route("10.0.0.0/8", Some("192.0.2.254"))];
        s.validate().unwrap();
    }

    #[test]
    fn duplicate_or_special_addresses_are_rejected() {
        let mut s = spec();
        s.addresses.push("192.0.2.10/25".parse().unwrap());
        assert_eq!(field_of(s.validate().unwrap_err()), "addresses");
        s.addresses = vec!["224.0.0.1/24".parse().unwrap()];
        assert_eq!(field_of(s.validate().unwrap_err()), "addresses");
        s.addresses.clear();
        assert_eq!(field_of(s.validate().unwrap_err()), "addresses");
    }

    #[test]
    fn ipv6_needs_mtu_1280() {
        let mut s = spec();
        s.addresses = vec!["2001:db8::10/64".parse().unwrap()];
        s.gateways = vec!["2001:db8::1".parse().unwrap()];
        s.mtu = Some(1279);
        assert_eq!(field_of(s.validate().unwrap_err()), "mtu");
        s.mtu = Some(1280);
        s.validate().unwrap();
    }

    proptest! {
        #[test]
        fn ifname_rule_matches_the_kernel(name in "[a-zA-Z0-9._@-]{0,20}") {
            let ok = !name.is_empty() && name.len() <= 15 && name != "." && name != "..";
            prop_assert_eq!(check_ifname(&name).is_ok(), ok);
        }

        #[test]
        fn ifname_with_separator_is_rejected(a in "[a-z]{1,6}", sep in "[/: \t]", b in "[a-z]{0,6}") {
            let name = format!("{a}{sep}{b}");
            prop_assert!(check_ifname(&name).is_err());
        }

        #[test]
        fn mac_text_round_trips(mac in any::<[u8; 6]>()) {
            prop_assert_eq!(parse_mac(&format_mac(mac)), Some(mac));
        }

        #[test]
        fn any_host_in_the_subnet_with_its_gateway_is_valid(
            host in 2u32..254, prefix in 8u8..=24, gw in 1u32..254
        ) {
            prop_assume!(host != gw);
            let base = u32::from(std::net::Ipv4Addr::new(10, 0, 0, 0));
            let mut s = spec();
            s.addresses = vec![IpNet::new(std::net::Ipv4Addr::from(base + host).into(), prefix).unwrap()];
            s.gateways = vec![std::net::Ipv4Addr::from(base + gw).into()];
            prop_assert!(s.validate().is_ok());
            // The same gateway in another /8 is never on-link.
            s.gateways = vec![std::net::Ipv4Addr::from(base + (1 << 24) + gw).into()];
            prop_assert!(s.validate().is_err());
        }
    }
}
