//! From an attachment record (subnets, addresses, MAC) and the agent's
//! settings to the [`AttachmentSpec`] the link layer creates, and to the CNI
//! result.

use std::net::IpAddr;

use flatnet_k8s::{
    api::RouteSettings,
    ipam::six_to_four,
    validation::{LinkMode, ValidSubnet, interface_mtu},
};
use ipnet::{IpNet, Ipv6Net};

use crate::{
    cluster_settings::AgentSettings,
    cni::{
        CniError, CniResult, Dns, ErrorCode, FlatNetworkBlock, Interface, IpConfig, IpWithPrefix,
        NetworkConfig, Route,
    },
    link::{ArpPolicy, AttachmentSpec, PrimaryRoutes, RouteSpec, parse_mac},
    records::AttachmentRecord,
};

/// Whether any subnet asks for the node routes to the pod
/// (`addPodIPToHost`); they go through the primary interface, so never in
/// single-NIC mode.
pub fn wants_host_route(record: &AttachmentRecord) -> bool {
    record.key.ifname != PRIMARY_IFNAME
        && record
            .subnets
            .iter()
            .any(|s| s.spec.route_settings.add_pod_ip_to_host)
}

/// Whether the flat interface takes the pod's default route over
/// (`flatNetworkDefaultGateway` on a subnet with a gateway, multi-NIC only).
pub fn moves_default_route(record: &AttachmentRecord) -> bool {
    record.key.ifname != PRIMARY_IFNAME
        && record
            .subnets
            .iter()
            .any(|s| s.spec.route_settings.flat_network_default_gateway && s.spec.gateway.is_some())
}

/// The pod's primary interface (the cluster network's), by convention.
pub const PRIMARY_IFNAME: &str = "eth0";

/// Agent-wide settings that shape every attachment.
#[derive(Clone, Debug, Default)]
pub struct SpecSettings {
    /// Cluster pod CIDRs kept on the primary interface.
    pub cluster_cidrs: Vec<IpNet>,
    /// Service CIDRs kept on the primary interface.
    pub service_cidrs: Vec<IpNet>,
}

/// How a new attachment's addresses are announced on the LAN.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Announcement {
    /// `arp_notify` or `arping`.
    pub arp_policy: ArpPolicy,
    /// `proxy_arp` on the pod's flat interface.
    pub proxy_arp: bool,
}

impl Announcement {
    /// The announcement of an attachment of `network`: its `flatNetwork`
    /// block (the NetworkAttachmentDefinition's, which the operator writes
    /// from the FlatNetworkConfig) field by field over the agent's
    /// `settings` in force (the FlatNetworkConfig's over the environment).
    #[must_use]
    pub fn of(network: &NetworkConfig, settings: &AgentSettings) -> Self {
        let block = network.flat_network.as_ref();
        Self {
            arp_policy: block
                .and_then(FlatNetworkBlock::arp_policy)
                .unwrap_or(settings.arp_policy),
            proxy_arp: block
                .and_then(|b| b.proxy_arp)
                .unwrap_or(settings.proxy_arp),
        }
    }
}

/// The validated subnets of a record.
pub fn valid_subnets(record: &AttachmentRecord) -> Result<Vec<ValidSubnet>, CniError> {
    record
        .subnets
        .iter()
        .map(|s| {
            s.validate().map_err(|invalid| {
                CniError::new(ErrorCode::InvalidNetworkConfig, invalid.to_string())
            })
        })
        .collect()
}

/// The attachment spec of a record.
///
/// - Gateways: each subnet's gateway.
/// - Default route through the flat interface when a subnet sets
///   `routeSettings.flatNetworkDefaultGateway` and the flat interface is not
///   the primary one.
/// - Through the primary interface (multi-NIC only): the cluster CIDRs
///   (`addClusterCIDR`), service CIDRs (`addServiceCIDR`) and the node's
///   networks (`addNodeCIDR`).
/// - Custom routes: a subnet route whose `dev` is the pod interface goes on
///   the flat interface; another `dev` (the primary `eth0`, ...) must exist
///   in the pod. When the flat interface is the primary one (single-NIC),
///   routes naming other interfaces describe the multi-NIC layout of the
///   same subnet and are left out.
/// - Node routes to the pod (`addPodIPToHost`): the record's, resolved
///   before the pod interface was made.
/// - MTU: the subnets' `spec.mtu` (the smallest when both of a dual-stack
///   pair set one), else the network configuration's `mtu`, else the
///   parent's.
/// - Announcement: `announcement`.
pub fn attachment_spec(
    record: &AttachmentRecord,
    subnets: &[ValidSubnet],
    settings: &SpecSettings,
    announcement: Announcement,
) -> Result<AttachmentSpec, CniError> {
    let first = subnets.first().ok_or_else(|| {
        CniError::new(
            ErrorCode::AgentInternal,
            format!("attachment record of {} has no subnet", record.key),
        )
    })?;
    let names: Vec<&str> = subnets.iter().map(|s| s.name.as_str()).collect();
    let ifname = &record.key.ifname;
    let gateways: Vec<IpAddr> = subnets.iter().filter_map(|s| s.gateway).collect();
    let is_primary = ifname == PRIMARY_IFNAME;
    let asks = |setting: fn(&RouteSettings) -> bool| {
        record
            .subnets
            .iter()
            .any(|s| setting(&s.spec.route_settings))
    };
    let default_route = moves_default_route(record);

    let mut routes = Vec::new();
    for subnet in subnets {
        for route in &subnet.routes {
            let dev = (&route.dev != ifname).then(|| route.dev.clone());
            if is_primary && dev.is_some() {
                continue;
            }
            let destination: IpNet = route.dst.parse().map_err(|_| {
                CniError::new(
                    ErrorCode::InvalidNetworkConfig,
                    format!(
                        "route {} of subnet {} is not a CIDR; fix spec.routes",
                        route.dst, subnet.name
                    ),
                )
            })?;
            let destination = destination.trunc();
            if dev.is_none() && default_route && destination.prefix_len() == 0 {
                // The gateway default route already covers it.
                continue;
            }
            routes.push(RouteSpec {
                destination,
                via: route.via,
                dev,
                source: route.src,
                metric: u32::try_from(route.priority).ok().filter(|p| *p > 0),
            });
        }
    }

    let mut destinations = Vec::new();
    if asks(|r| r.add_cluster_cidr) {
        destinations.extend(settings.cluster_cidrs.iter().map(IpNet::trunc));
    }
    if asks(|r| r.add_service_cidr) {
        destinations.extend(settings.service_cidrs.iter().map(IpNet::trunc));
    }
    destinations.sort();
    destinations.dedup();
    let node_networks = asks(|r| r.add_node_cidr);
    let primary_routes =
        (!is_primary && (node_networks || !destinations.is_empty())).then(|| PrimaryRoutes {
            ifname: PRIMARY_IFNAME.into(),
            destinations,
            node_networks,
        });

    let kind = first.link_mode;
    let mac = match (&record.requested_mac, kind) {
        (Some(text), LinkMode::Macvlan(_)) => Some(parse_mac(text).ok_or_else(|| {
            CniError::new(
                ErrorCode::InvalidNetworkConfig,
                format!(
                    "MAC {text:?} of {} is not valid; use aa:bb:cc:dd:ee:ff",
                    record.key
                ),
            )
        })?),
        _ => None,
    };
    Ok(AttachmentSpec {
        subnet: names.join(","),
        parent: first.parent.clone(),
        kind,
        netns: record.netns.clone(),
        ifname: ifname.clone(),
        mac,
        mtu: interface_mtu(subnets).or(record.mtu),
        addresses: record.addresses.clone(),
        extra_addresses: six_to_four_addresses(record),
        gateways,
        default_route,
        routes,
        primary_routes,
        host_route: record.host_route.clone(),
        arp_policy: announcement.arp_policy,
        proxy_arp: announcement.proxy_arp,
    })
}

/// The 6to4 addresses of the record's IPv4 addresses whose subnet asks for
/// them (`ipv6to4`).
fn six_to_four_addresses(record: &AttachmentRecord) -> Vec<IpNet> {
    record
        .subnets
        .iter()
        .zip(&record.addresses)
        .filter(|(subnet, _)| subnet.ipv6to4)
        .filter_map(|(_, address)| match address {
            IpNet::V4(v4) => six_to_four(v4.addr(), v4.prefix_len()),
            IpNet::V6(_) => None,
        })
        .filter_map(|(addr, prefix_len)| Ipv6Net::new(addr, prefix_len).ok().map(IpNet::V6))
        .collect()
}

/// The CNI result of an attachment.
pub fn cni_result(spec: &AttachmentSpec, mac: Option<&str>, dns: &Dns) -> CniResult {
    let gateway_for = |addr: IpAddr| {
        spec.gateways
            .iter()
            .copied()
            .find(|g| g.is_ipv4() == addr.is_ipv4())
    };
    let ip_config = |net: &IpNet, gateway: Option<IpAddr>| IpConfig {
        address: IpWithPrefix {
            addr: net.addr(),
            prefix_len: net.prefix_len(),
        },
        gateway,
        interface: Some(0),
    };
    let ips = spec
        .addresses
        .iter()
        .map(|net| ip_config(net, gateway_for(net.addr())))
        // A 6to4 address has no gateway (as in rancher-flat-network).
        .chain(spec.extra_addresses.iter().map(|net| ip_config(net, None)))
        .collect();
    let mut routes: Vec<Route> = Vec::new();
    if spec.default_route {
        for gateway in &spec.gateways {
            let any = if gateway.is_ipv4() {
                IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
            } else {
                IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
            };
            routes.push(route(
                IpWithPrefix {
                    addr: any,
                    prefix_len: 0,
                },
                Some(*gateway),
            ));
        }
    }
    for custom in &spec.routes {
        let dst = IpWithPrefix {
            addr: custom.destination.addr(),
            prefix_len: custom.destination.prefix_len(),
        };
        routes.push(route(dst, custom.via));
    }
    CniResult {
        interfaces: vec![Interface {
            name: spec.ifname.clone(),
            mac: mac.map(str::to_owned),
            sandbox: Some(spec.netns.display().to_string()),
            ..Interface::default()
        }],
        ips,
        routes,
        dns: dns.clone(),
    }
}

fn route(dst: IpWithPrefix, gw: Option<IpAddr>) -> Route {
    Route {
        dst,
        gw,
        mtu: None,
        advmss: None,
        priority: None,
        table: None,
        scope: None,
    }
}

#[cfg(test)]
mod tests {
    use flatnet_k8s::api::{FlatNetworkSubnetSpec, Route as SubnetRoute};

    use super::*;
    use crate::{
        desired::{AttachmentKey, NamedSubnet, PodRef},
        records::RecordPhase,
    };

    fn record(spec: FlatNetworkSubnetSpec, ifname: &str) -> AttachmentRecord {
        AttachmentRecord {
            key: AttachmentKey {
                container_id: "c".into(),
                ifname: ifname.into(),
            },
            network: "flat".into(),
            netns: "/run/netns/p".into(),
            pod: PodRef::default(),
            phase: RecordPhase::Pending,
            subnets: vec![NamedSubnet {
                name: "lan".into(),
                spec,
                ipv6to4: false,
            }],
            addresses: vec!["192.0.2.5/24".parse().unwrap()],
            requested_mac: Some("02:00:00:00:00:05".into()),
            mac: None,
            mtu: Some(1400),
            uplink: None,
            host_route: None,
            primary_defaults: None,
            parent: None,
            unreported_mtu: None,
        }
    }

    fn subnet() -> FlatNetworkSubnetSpec {
        FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth9".into(),
            cidr: "192.0.2.0/24".into(),
            gateway: Some("192.0.2.1".parse().unwrap()),
            vlan: 7,
            ..Default::default()
        }
    }

    #[test]
    fn an_ipv6to4_subnet_adds_the_6to4_address_without_a_gateway() {
        let mut record = record(subnet(), "eth1");
        let subnets = valid_subnets(&record).unwrap();
        let settings = SpecSettings::default();
        let plain = attachment_spec(&record, &subnets, &settings, Announcement::default()).unwrap();
        assert!(plain.extra_addresses.is_empty());

        record.subnets[0].ipv6to4 = true;
        let spec = attachment_spec(&record, &subnets, &settings, Announcement::default()).unwrap();
        let six_to_four: IpNet = "2002:c000:205::/40".parse().unwrap();
        assert_eq!(spec.extra_addresses, [six_to_four]);
        let result = cni_result(&spec, None, &Dns::default());
        let ips: Vec<(String, Option<IpAddr>)> = result
            .ips
            .iter()
            .map(|ip| {
                (
                    format!("{}/{}", ip.address.addr, ip.address.prefix_len),
                    ip.gateway,
                )
            })
            .collect();
        assert_eq!(
            ips,
            [
                (
                    "192.0.2.5/24".to_owned(),
                    Some("192.0.2.1".parse().unwrap())
                ),
                ("2002:c000:205::/40".to_owned(), None),
            ]
        );
    }

    #[test]
    fn the_subnet_mtu_takes_precedence_over_the_network_configuration() {
        let mut lan = subnet();
        lan.mtu = Some(1300);
        let record = record(lan, "eth1");
        let subnets = valid_subnets(&record).unwrap();
        let spec = attachment_spec(
            &record,
            &subnets,
            &SpecSettings::default(),
            Announcement::default(),
        )
        .unwrap();
        assert_eq!(spec.mtu, Some(1300), "the subnet's, not the record's 1400");
    }

    /// A subnet route's `src` is the kernel route's preferred source and
    /// its `priority` the metric; priority 0 leaves the kernel's default.
    #[test]
    fn a_subnet_routes_src_and_priority_become_the_routes_source_and_metric() {
        let mut spec = subnet();
        spec.routes = vec![
            SubnetRoute {
                dev: "eth1".into(),
                dst: "198.51.100.0/24".into(),
                src: Some("192.0.2.5".parse().unwrap()),
                priority: 300,
                ..Default::default()
            },
            SubnetRoute {
                dev: "eth1".into(),
                dst: "203.0.113.0/24".into(),
                ..Default::default()
            },
        ];
        let record = record(spec, "eth1");
        let subnets = valid_subnets(&record).unwrap();
        let built = attachment_spec(
            &record,
            &subnets,
            &SpecSettings::default(),
            Announcement::default(),
        )
        .unwrap();
        let route = |dst: &str| {
            let dst: IpNet = dst.parse().unwrap();
            built
                .routes
                .iter()
                .find(|r| r.destination == dst)
                .map(|r| (r.source, r.metric))
                .unwrap()
        };
        assert_eq!(
            route("198.51.100.0/24"),
            (Some("192.0.2.5".parse().unwrap()), Some(300))
        );
        assert_eq!(route("203.0.113.0/24"), (None, None));
    }

    #[test]
    fn spec_follows_the_subnet_and_route_settings() {
        let mut spec = subnet();
        spec.route_settings.flat_network_default_gateway = true;
        spec.route_settings.add_cluster_cidr = true;
        spec.routes = vec![
            SubnetRoute {
                dev: "eth1".into(),
                dst: "198.51.100.0/24".into(),
                via: Some("192.0.2.254".parse().unwrap()),
                ..Default::default()
            },
            SubnetRoute {
                dev: "eth0".into(),
                dst: "203.0.113.0/24".into(),
                ..Default::default()
            },
        ];
        let record = record(spec, "eth1");
        let subnets = valid_subnets(&record).unwrap();
        let settings = SpecSettings {
            cluster_cidrs: vec![
                "10.42.0.0/16".parse().unwrap(),
                "fd42::/48".parse().unwrap(),
            ],
            ..SpecSettings::default()
        };
        let spec = attachment_spec(&record, &subnets, &settings, Announcement::default()).unwrap();
        assert_eq!((spec.parent.master.as_str(), spec.parent.vlan), ("eth9", 7));
        assert!(spec.default_route);
        assert_eq!(spec.mac, Some([2, 0, 0, 0, 0, 5]));
        assert_eq!(spec.mtu, Some(1400));
        let devs: Vec<Option<&str>> = spec.routes.iter().map(|r| r.dev.as_deref()).collect();
        assert_eq!(
            devs,
            [None, Some("eth0")],
            "flat interface, then the primary"
        );
        let primary = spec.primary_routes.clone().unwrap();
        assert_eq!(
            primary.destinations,
            [
                "10.42.0.0/16".parse::<IpNet>().unwrap(),
                "fd42::/48".parse().unwrap()
            ],
            "every family; the link layer skips one the primary cannot route"
        );
        assert!(!primary.node_networks);
        spec.validate().unwrap();
    }

    #[test]
    fn the_primary_interface_keeps_no_implicit_default_route() {
        let mut spec = subnet();
        spec.route_settings.flat_network_default_gateway = true;
        let record = record(spec, "eth0");
        let subnets = valid_subnets(&record).unwrap();
        let spec = attachment_spec(
            &record,
            &subnets,
            &SpecSettings::default(),
            Announcement::default(),
        )
        .unwrap();
        assert!(!spec.default_route);
        assert!(spec.primary_routes.is_none());
        assert!(!moves_default_route(&record));
        assert!(!wants_host_route(&record));
    }

    #[test]
    fn single_nic_pods_skip_routes_of_other_interfaces_and_primary_routes() {
        let mut spec = subnet();
        spec.route_settings.add_node_cidr = true;
        spec.route_settings.add_pod_ip_to_host = true;
        spec.routes = vec![
            SubnetRoute {
                dev: "eth1".into(),
                dst: "198.51.100.0/24".into(),
                ..Default::default()
            },
            SubnetRoute {
                dev: "eth0".into(),
                dst: "0.0.0.0/0".into(),
                via: Some("192.0.2.1".parse().unwrap()),
                ..Default::default()
            },
        ];
        let single = record(spec.clone(), "eth0");
        let subnets = valid_subnets(&single).unwrap();
        let built = attachment_spec(
            &single,
            &subnets,
            &SpecSettings::default(),
            Announcement::default(),
        )
        .unwrap();
        assert_eq!(built.routes.len(), 1, "{:?}", built.routes);
        assert_eq!(built.routes[0].dev, None, "eth0 is the flat interface");
        assert!(built.primary_routes.is_none());
        assert!(!wants_host_route(&single));

        let multi = record(spec, "eth1");
        let built = attachment_spec(
            &multi,
            &subnets,
            &SpecSettings::default(),
            Announcement::default(),
        )
        .unwrap();
        assert!(built.primary_routes.unwrap().node_networks);
        assert!(wants_host_route(&multi));
    }

    #[test]
    fn result_lists_addresses_gateways_and_routes() {
        let mut spec = subnet();
        spec.route_settings.flat_network_default_gateway = true;
        let record = record(spec, "eth1");
        let subnets = valid_subnets(&record).unwrap();
        let spec = attachment_spec(
            &record,
            &subnets,
            &SpecSettings::default(),
            Announcement::default(),
        )
        .unwrap();
        let result = cni_result(&spec, Some("02:00:00:00:00:05"), &Dns::default());
        let json = serde_json::to_value(&result).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "interfaces": [{"name": "eth1", "mac": "02:00:00:00:00:05", "sandbox": "/run/netns/p"}],
                "ips": [{"address": "192.0.2.5/24", "gateway": "192.0.2.1", "interface": 0}],
                "routes": [{"dst": "0.0.0.0/0", "gw": "192.0.2.1"}]
            })
        );
    }
}
