//! Verifying that a pod interface still matches its spec (CNI CHECK).
//!
//! Every difference is collected, so one error tells everything that is off.

use netlink_packet_route::link::{InfoData, InfoIpVlan, InfoKind, InfoMacVlan, IpVlanFlags};

use super::{
    Attachments, LinkError,
    attach::{
        default_net, family_name, find_master, ipvlan_flag, ipvlan_mode, macvlan_mode, node_route,
    },
    netlink::{Link, Netlink, Route},
    spec::{LinkMode, ValidSpec, format_mac},
};

pub(super) async fn check(config: &Attachments, valid: &ValidSpec) -> Result<(), LinkError> {
    let spec = valid.spec();
    let host = config.host_link.get(config.host_netns.as_deref())?;
    let master = find_master(&host, spec).await?;
    let parent = if spec.parent.vlan == 0 {
        master
    } else {
        host.existing_link(valid.parent()).await?
    };
    let pod = Netlink::open(Some(&spec.netns))?;
    let link = pod.existing_link(&spec.ifname).await?;

    let mut differences = link_differences(valid, &link, &parent);
    let actual = pod.addresses(link.index).await?;
    for address in &spec.addresses {
        if !actual.contains(address) {
            differences.push(format!("address {address} missing"));
        }
    }
    differences.extend(route_differences(valid, &pod, &link).await?);
    if let Some(host_route_spec) = &spec.host_route {
        match host.link_by_name(&host_route_spec.link).await? {
            None => differences.push(format!(
                "host link {} for the node route is missing",
                host_route_spec.link
            )),
            Some(host_link) => {
                for address in &spec.addresses {
                    let wanted = node_route(address.addr(), host_route_spec, host_link.index, &[]);
                    let routes = host.routes(address.addr().is_ipv4()).await?;
                    if !routes.iter().any(|r| {
                        r.destination == wanted.destination
                            && r.oif == wanted.oif
                            && r.via == wanted.via
                    }) {
                        differences.push(format!(
                            "node route to {} through {} missing",
                            address.addr(),
                            host_route_spec.link
                        ));
                    }
                }
            }
        }
    }

    if differences.is_empty() {
        Ok(())
    } else {
        Err(LinkError::Mismatch {
            ifname: spec.ifname.clone(),
            netns: pod.netns().to_owned(),
            subnet: spec.subnet.clone(),
            differences,
        })
    }
}

/// Kind, mode, flag, parent, MAC, MTU and state.
fn link_differences(valid: &ValidSpec, link: &Link, parent: &Link) -> Vec<String> {
    let spec = valid.spec();
    let mut differences = Vec::new();
    let mut expect = |what: &str, expected: String, found: String| {
        if expected != found {
            differences.push(format!("{what}: expected {expected}, found {found}"));
        }
    };
    let found_kind = link
        .kind
        .as_ref()
        .map_or_else(|| "none".to_owned(), |k| k.to_string());
    match spec.kind {
        LinkMode::Macvlan(mode) => {
            expect("kind", InfoKind::MacVlan.to_string(), found_kind);
            let found = match &link.data {
                Some(InfoData::MacVlan(infos)) => infos.iter().find_map(|i| match i {
                    InfoMacVlan::Mode(m) => Some(*m),
                    _ => None,
                }),
                _ => None,
            };
            expect(
                "macvlan mode",
                format!("{:?}", macvlan_mode(mode)),
                found.map_or_else(|| "none".to_owned(), |m| format!("{m:?}")),
            );
        }
        LinkMode::Ipvlan(mode, flag) => {
            expect("kind", InfoKind::IpVlan.to_string(), found_kind);
            let infos = match &link.data {
                Some(InfoData::IpVlan(infos)) => infos.as_slice(),
                _ => &[],
            };
            let found_mode = infos.iter().find_map(|i| match i {
                InfoIpVlan::Mode(m) => Some(*m),
                _ => None,
            });
            // The kernel omits the flags when they are 0 (bridge).
            let found_flags = infos
                .iter()
                .find_map(|i| match i {
                    InfoIpVlan::Flags(f) => Some(*f),
                    _ => None,
                })
                .unwrap_or(IpVlanFlags::empty());
            expect(
                "ipvlan mode",
                ipvlan_mode(mode).to_string(),
                found_mode.map_or_else(|| "none".to_owned(), |m| m.to_string()),
            );
            expect(
                "ipvlan flag",
                format!("{:?}", ipvlan_flag(flag)),
                format!("{found_flags:?}"),
            );
        }
    }
    expect(
        "parent",
        format!("{} (index {})", parent.name, parent.index),
        link.parent_index.map_or_else(
            || "none".to_owned(),
            |i| {
                if i == parent.index {
                    format!("{} (index {i})", parent.name)
                } else {
                    format!("index {i}")
                }
            },
        ),
    );
    if let Some(mac) = spec.mac {
        expect(
            "MAC",
            format_mac(mac),
            link.mac.map_or_else(|| "none".to_owned(), format_mac),
        );
    }
    if let Some(mtu) = spec.mtu.or(parent.mtu) {
        expect(
            "MTU",
            mtu.to_string(),
            link.mtu
                .map_or_else(|| "none".to_owned(), |m| m.to_string()),
        );
    }
    expect(
        "state",
        "up".into(),
        if link.up { "up" } else { "down" }.into(),
    );
    differences
}

/// Default route, custom routes and primary-interface routes.
async fn route_differences(
    valid: &ValidSpec,
    pod: &Netlink,
    link: &Link,
) -> Result<Vec<String>, LinkError> {
    let spec = valid.spec();
    let mut differences = Vec::new();
    let routes_v4 = pod.routes(true).await?;
    let routes_v6 = pod.routes(false).await?;
    let routes = |ipv4: bool| if ipv4 { &routes_v4 } else { &routes_v6 };
    // Interfaces of routes through other pod interfaces, looked up first.
    let mut missing_devs = Vec::new();
    let mut custom_oifs = Vec::new();
    for custom in &spec.routes {
        custom_oifs.push(match &custom.dev {
            None => Some(link.index),
            Some(dev) => pod.link_by_name(dev).await?.map(|l| l.index),
        });
    }
    let mut expect_route = |wanted: Route, what: String| {
        let present = routes(wanted.destination.addr().is_ipv4()).iter().any(|r| {
            r.destination == wanted.destination && r.oif == wanted.oif && r.via == wanted.via
        });
        if !present {
            differences.push(format!("{what} missing"));
        }
    };
    if spec.default_route {
        for gateway in &spec.gateways {
            let ipv4 = gateway.is_ipv4();
            expect_route(
                Route::new(default_net(ipv4), Some(*gateway), link.index),
                format!("{} default route via {gateway}", family_name(ipv4)),
            );
        }
    }
    for (custom, oif) in spec.routes.iter().zip(custom_oifs) {
        match oif {
            Some(oif) => expect_route(
                Route::new(custom.destination, custom.via, oif),
                format!("route {}", custom.destination),
            ),
            None => missing_devs.push(format!(
                "interface {} of route {} missing",
                custom.dev.as_deref().unwrap_or_default(),
                custom.destination
            )),
        }
    }
    differences.extend(missing_devs);
    if let Some(primary) = &spec.primary_routes {
        match pod.link_by_name(&primary.ifname).await? {
            None => differences.push(format!("primary interface {} missing", primary.ifname)),
            Some(primary_link) => {
                for destination in &primary.destinations {
                    let family = routes(destination.addr().is_ipv4());
                    // Skipped at attach: no primary gateway of the family
                    // (attach fails instead when the family needed it).
                    let routed = family
                        .iter()
                        .any(|r| r.oif == Some(primary_link.index) && r.via.is_some());
                    if !routed {
                        continue;
                    }
                    let present = family.iter().any(|r| {
                        r.destination == *destination && r.oif == Some(primary_link.index)
                    });
                    if !present {
                        differences.push(format!(
                            "route {destination} through {} missing",
                            primary.ifname
                        ));
                    }
                }
            }
        }
    }
    Ok(differences)
}
