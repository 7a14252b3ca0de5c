//! Parsing of the pod annotations that request a flat-network address.
//!
//! # Syntax
//!
//! | annotation | value |
//! |---|---|
//! | `flatnetwork.pandaria.io/subnet` | a subnet name, or `v4name,v6name` for dual stack |
//! | `flatnetwork.pandaria.io/ip` | `auto`, an address, or a dash-separated candidate list (`10.0.0.5-10.0.0.6`) |
//! | `flatnetwork.pandaria.io/mac` | empty or `auto` (kernel-chosen), a MAC, or a dash-separated list |
//!
//! With a single subnet the `ip` candidates must all be of one family (a
//! subnet has one family). IPv6 addresses contain no `-`, so dash lists work
//! for both families.
//!
//! **Dual stack.** `subnet: v4name,v6name` names an IPv4 and an IPv6
//! subnet, in that order. The `ip` value then is `auto` (an automatic address
//! from each), or two comma-separated groups in the same order, each `auto`,
//! an address or a dash list of that group's family:
//! `10.0.0.5,fd00::5`, `auto,fd00::5`, `10.0.0.5-10.0.0.6,auto`. Each pod gets
//! one address per family and one MAC for its single flat interface.
//!
//! MACs must be written with colons (or Cisco dots): `-` separates entries.

use std::{collections::BTreeSet, net::IpAddr};

use crate::{
    ipam::{Family, Mac, MacError},
    keys::annotation,
};

/// One subnet's share of a pod's request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubnetRequest {
    /// The subnet's name.
    pub subnet: String,
    /// The family the subnet must have: set for dual stack (first IPv4, then
    /// IPv6), or by the requested addresses; `None` for a single `auto`.
    pub family: Option<Family>,
    /// Candidate addresses in order; empty for `auto`.
    pub candidates: Vec<IpAddr>,
}

/// A pod's parsed flat-network request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRequest {
    /// One entry per subnet: one, or two for dual stack (IPv4 first).
    pub subnets: Vec<SubnetRequest>,
    /// Candidate MACs in order; empty means kernel-chosen.
    pub macs: Vec<Mac>,
}

impl PodRequest {
    /// Whether every address is automatic (label value `auto` vs `specific`).
    pub fn is_auto(&self) -> bool {
        self.subnets.iter().all(|s| s.candidates.is_empty())
    }
}

/// A pod annotation that cannot be used. The text names the annotation and
/// the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnnotationError {
    /// The Multus network selection asks for an unusable MAC on the flat
    /// attachment.
    #[error(
        "annotation {} asks for an unusable MAC on {attachment}: {source}",
        annotation::MULTUS_NETWORKS
    )]
    MultusMac {
        /// The attachment name.
        attachment: String,
        /// Why the MAC is unusable.
        source: crate::ipam::MacError,
    },
    /// A required annotation is empty.
    #[error("annotation {key} is empty: {fix}")]
    Empty {
        /// The annotation key.
        key: &'static str,
        /// What to write.
        fix: &'static str,
    },
    /// The subnet list is malformed.
    #[error(
        "annotation {} value {value:?} is not a subnet name or \"v4name,v6name\": name one subnet, or an IPv4 and an IPv6 subnet separated by one comma",
        annotation::SUBNET
    )]
    SubnetList {
        /// The rejected value.
        value: String,
    },
    /// An `ip` list member does not parse.
    #[error(
        "annotation {} entry {entry:?} is not an IP address: write \"auto\", an address, or addresses joined by '-'",
        annotation::IP
    )]
    Ip {
        /// The rejected entry.
        entry: String,
    },
    /// An address is listed twice.
    #[error(
        "annotation {} lists {ip} twice: list each address once",
        annotation::IP
    )]
    DuplicateIp {
        /// The repeated address.
        ip: IpAddr,
    },
    /// Addresses of different families for one subnet.
    #[error(
        "annotation {} mixes IPv4 and IPv6 addresses for subnet {subnet}: a subnet has one family; for dual stack name two subnets (\"v4name,v6name\") and write \"v4addrs,v6addrs\"",
        annotation::IP
    )]
    MixedFamilies {
        /// The subnet.
        subnet: String,
    },
    /// A dual-stack group holds an address of the wrong family.
    #[error(
        "annotation {} lists {ip} for subnet {subnet}, which is the {family} subnet: put {family} addresses in group {position} of \"v4addrs,v6addrs\"",
        annotation::IP
    )]
    WrongFamily {
        /// The offending address.
        ip: IpAddr,
        /// The subnet it was requested from.
        subnet: String,
        /// That subnet's family by position.
        family: Family,
        /// 1 for IPv4, 2 for IPv6.
        position: usize,
    },
    /// The number of `ip` groups does not match the number of subnets.
    #[error(
        "annotation {} has {groups} comma-separated groups but {} names {subnets} subnet(s): write \"auto\" or one group per subnet",
        annotation::IP,
        annotation::SUBNET
    )]
    GroupCount {
        /// Groups in the `ip` value.
        groups: usize,
        /// Subnets in the `subnet` value.
        subnets: usize,
    },
    /// A `mac` list member does not parse.
    #[error("annotation {}: {source}", annotation::MAC)]
    Mac {
        /// Why.
        #[source]
        source: MacError,
    },
    /// A MAC is listed twice.
    #[error("annotation {} lists {mac} twice: list each MAC once", annotation::MAC)]
    DuplicateMac {
        /// The repeated MAC.
        mac: Mac,
    },
}

/// Parses the three annotations (pass `""` for a missing `mac`).
pub fn parse_pod_request(subnet: &str, ip: &str, mac: &str) -> Result<PodRequest, AnnotationError> {
    let names = parse_subnets(subnet)?;
    let groups = parse_ip_groups(ip, names.len())?;
    let dual_stack = names.len() == 2;
    let subnets = names
        .into_iter()
        .zip(groups)
        .enumerate()
        .map(|(index, (name, candidates))| {
            let family = if dual_stack {
                let family = [Family::V4, Family::V6][index];
                if let Some(ip) = candidates.iter().find(|ip| Family::of(**ip) != family) {
                    return Err(AnnotationError::WrongFamily {
                        ip: *ip,
                        subnet: name,
                        family,
                        position: index + 1,
                    });
                }
                Some(family)
            } else {
                single_family(&name, &candidates)?
            };
            Ok(SubnetRequest {
                subnet: name,
                family,
                candidates,
            })
        })
        .collect::<Result<_, _>>()?;
    Ok(PodRequest {
        subnets,
        macs: parse_macs(mac)?,
    })
}

fn parse_subnets(value: &str) -> Result<Vec<String>, AnnotationError> {
    let value = value.trim();
    if value.is_empty() {
        return Err(AnnotationError::Empty {
            key: annotation::SUBNET,
            fix: "name a FlatNetworkSubnet of namespace cattle-flat-network",
        });
    }
    let names: Vec<String> = value.split(',').map(|n| n.trim().to_owned()).collect();
    let distinct = names.len() != 2 || names[0] != names[1];
    if names.len() > 2 || names.iter().any(String::is_empty) || !distinct {
        return Err(AnnotationError::SubnetList {
            value: value.to_owned(),
        });
    }
    Ok(names)
}

/// One candidate list per subnet; `auto` alone means auto for every subnet.
fn parse_ip_groups(value: &str, subnets: usize) -> Result<Vec<Vec<IpAddr>>, AnnotationError> {
    let value = value.trim();
    if value.is_empty() {
        return Err(AnnotationError::Empty {
            key: annotation::IP,
            fix: "write \"auto\" for any free address, or the address(es) to use",
        });
    }
    if value == "auto" {
        return Ok(vec![Vec::new(); subnets]);
    }
    let groups: Vec<&str> = value.split(',').collect();
    if groups.len() != subnets {
        return Err(AnnotationError::GroupCount {
            groups: groups.len(),
            subnets,
        });
    }
    let mut seen = BTreeSet::new();
    groups
        .into_iter()
        .map(|group| parse_ip_list(group.trim(), &mut seen))
        .collect()
}

fn parse_ip_list(group: &str, seen: &mut BTreeSet<IpAddr>) -> Result<Vec<IpAddr>, AnnotationError> {
    if group == "auto" {
        return Ok(Vec::new());
    }
    group
        .split('-')
        .map(|entry| {
            let ip: IpAddr = entry.trim().parse().map_err(|_| AnnotationError::Ip {
                entry: entry.to_owned(),
            })?;
            if !seen.insert(ip) {
                return Err(AnnotationError::DuplicateIp { ip });
            }
            Ok(ip)
        })
        .collect()
}

fn single_family(subnet: &str, candidates: &[IpAddr]) -> Result<Option<Family>, AnnotationError> {
    let mut families = candidates.iter().map(|ip| Family::of(*ip));
    let Some(first) = families.next() else {
        return Ok(None);
    };
    if families.any(|f| f != first) {
        return Err(AnnotationError::MixedFamilies {
            subnet: subnet.to_owned(),
        });
    }
    Ok(Some(first))
}

/// Parses the `mac` annotation: empty or `auto` gives no candidate.
pub fn parse_macs(value: &str) -> Result<Vec<Mac>, AnnotationError> {
    let value = value.trim();
    if value.is_empty() || value == "auto" {
        return Ok(Vec::new());
    }
    let hyphenated = || AnnotationError::Mac {
        source: MacError::Hyphenated(value.to_owned()),
    };
    let mut seen = BTreeSet::new();
    let mut macs = Vec::new();
    for entry in value.split('-') {
        let mac = Mac::parse(entry).map_err(|source| {
            // A two-digit entry means the user wrote aa-bb-cc-...: say so.
            if entry.trim().len() == 2 && entry.trim().chars().all(|c| c.is_ascii_hexdigit()) {
                hyphenated()
            } else {
                AnnotationError::Mac { source }
            }
        })?;
        if !seen.insert(mac) {
            return Err(AnnotationError::DuplicateMac { mac });
        }
        macs.push(mac);
    }
    Ok(macs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn single(subnet: &str, ip_value: &str) -> Result<SubnetRequest, AnnotationError> {
        parse_pod_request(subnet, ip_value, "").map(|r| r.subnets.into_iter().next().unwrap())
    }

    #[test]
    fn auto_single_and_lists() {
        let auto = parse_pod_request(" net1 ", " auto ", "").unwrap();
        assert!(auto.is_auto());
        assert_eq!(
            auto.subnets,
            [SubnetRequest {
                subnet: "net1".into(),
                family: None,
                candidates: vec![]
            }]
        );
        assert_eq!(
            single("net1", "10.0.0.5").unwrap().candidates,
            [ip("10.0.0.5")]
        );
        let list = single("net1", "10.0.0.5-10.0.0.7- 10.0.0.6").unwrap();
        assert_eq!(
            list.candidates,
            [ip("10.0.0.5"), ip("10.0.0.7"), ip("10.0.0.6")]
        );
        assert_eq!(list.family, Some(Family::V4));
        let v6 = single("net6", "fd00::5-fd00::6").unwrap();
        assert_eq!((v6.family, v6.candidates.len()), (Some(Family::V6), 2));
    }

    #[test]
    fn ip_errors_name_the_annotation() {
        let empty = single("net1", " ").unwrap_err();
        assert!(matches!(
            empty,
            AnnotationError::Empty {
                key: annotation::IP,
                ..
            }
        ));
        assert!(
            empty.to_string().contains("flatnetwork.pandaria.io/ip"),
            "{empty}"
        );
        assert_eq!(
            single("net1", "10.0.0.5--10.0.0.6"),
            Err(AnnotationError::Ip {
                entry: String::new()
            })
        );
        assert_eq!(
            single("net1", "10.0.0.300"),
            Err(AnnotationError::Ip {
                entry: "10.0.0.300".into()
            })
        );
        assert_eq!(
            single("net1", "10.0.0.5-10.0.0.5"),
            Err(AnnotationError::DuplicateIp { ip: ip("10.0.0.5") })
        );
        assert_eq!(
            single("net1", "10.0.0.5-fd00::5"),
            Err(AnnotationError::MixedFamilies {
                subnet: "net1".into()
            })
        );
        assert_eq!(
            single("net1", "10.0.0.5,fd00::5"),
            Err(AnnotationError::GroupCount {
                groups: 2,
                subnets: 1
            })
        );
    }

    #[test]
    fn subnet_errors() {
        assert!(matches!(
            single("", "auto"),
            Err(AnnotationError::Empty {
                key: annotation::SUBNET,
                ..
            })
        ));
        for bad in ["a,b,c", "a,", ",b", "a,a"] {
            assert_eq!(
                single(bad, "auto"),
                Err(AnnotationError::SubnetList { value: bad.into() }),
                "{bad}"
            );
        }
    }

    #[test]
    fn dual_stack() {
        let both_auto = parse_pod_request("v4net,v6net", "auto", "").unwrap();
        assert_eq!(both_auto.subnets.len(), 2);
        assert_eq!(both_auto.subnets[0].family, Some(Family::V4));
        assert_eq!(both_auto.subnets[1].family, Some(Family::V6));
        let fixed = parse_pod_request("v4net, v6net", "10.0.0.5-10.0.0.6 , fd00::5", "").unwrap();
        assert_eq!(
            fixed.subnets[0].candidates,
            [ip("10.0.0.5"), ip("10.0.0.6")]
        );
        assert_eq!(fixed.subnets[1].candidates, [ip("fd00::5")]);
        let half = parse_pod_request("v4net,v6net", "auto,fd00::5", "").unwrap();
        assert!(half.subnets[0].candidates.is_empty() && !half.is_auto());
        assert_eq!(
            parse_pod_request("v4net,v6net", "fd00::5,10.0.0.5", ""),
            Err(AnnotationError::WrongFamily {
                ip: ip("fd00::5"),
                subnet: "v4net".into(),
                family: Family::V4,
                position: 1
            })
        );
        assert_eq!(
            parse_pod_request("v4net,v6net", "10.0.0.5", ""),
            Err(AnnotationError::GroupCount {
                groups: 1,
                subnets: 2
            })
        );
    }

    #[test]
    fn macs() {
        assert_eq!(parse_macs(""), Ok(vec![]));
        assert_eq!(parse_macs("auto"), Ok(vec![]));
        let macs = parse_macs("02:00:00:00:00:0A-0200.0000.000b").unwrap();
        let texts: Vec<String> = macs.iter().map(ToString::to_string).collect();
        assert_eq!(texts, ["02:00:00:00:00:0a", "02:00:00:00:00:0b"]);
        let hyphen = parse_macs("02-00-00-00-00-0a").unwrap_err();
        assert!(matches!(
            hyphen,
            AnnotationError::Mac {
                source: MacError::Hyphenated(_)
            }
        ));
        assert!(
            hyphen.to_string().contains("flatnetwork.pandaria.io/mac")
                && hyphen.to_string().contains("colons")
        );
        assert!(matches!(
            parse_macs("02:00:00:00:00:zz"),
            Err(AnnotationError::Mac {
                source: MacError::Syntax(_)
            })
        ));
        assert!(matches!(
            parse_macs("02:00:00:00:00:01-02:00:00:00:00:01"),
            Err(AnnotationError::DuplicateMac { .. })
        ));
        let request = parse_pod_request("net1", "auto", "02:00:00:00:00:01").unwrap();
        assert_eq!(request.macs.len(), 1);
    }
}
