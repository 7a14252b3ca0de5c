//! Floating addresses, the pure part: pool and quota validation, what a
//! Service asks for, port clashes between Services sharing an address,
//! quota counting and the deterministic choice of the node that owns an
//! address. Shared by the operator's controller, its webhook and the agent.
//!
//! A pool is validated into one [`ValidSubnet`] per CIDR (flat mode
//! macvlan, no gateway), so its addresses come from the same IPAM
//! [`Pool`] and its interface follows the same parent-link rules as a
//! FlatNetworkSubnet's.

use std::{collections::BTreeMap, fmt, net::IpAddr};

use k8s_openapi::api::core::v1::Service;

use crate::{
    api::{FlatNetworkSubnetSpec, FloatingIPPoolSpec, FloatingIPProjectQuotaSpec},
    ipam::{Cidr, Family, Pool},
    selector::{self, SelectorError},
    validation::{MAX_VLAN_ID, ParentLink, ValidSubnet, join, validate_subnet},
};

/// `spec.loadBalancerClass` of the Services flatnet gives floating addresses.
pub const LOAD_BALANCER_CLASS: &str = "flatnetwork.pandaria.io/floating-ip";

/// Name of the ConfigMap mapping each pool to its `targetNetworkInterface`,
/// kept for tools written for rancher-fip-cluster-manager.
pub const INTERFACE_MAPPINGS: &str = "network-interface-mappings";

/// Service annotations.
pub mod annotation {
    /// The pool to take the address from (default: the first eligible pool
    /// by name).
    pub const POOL: &str = "flatnetwork.pandaria.io/floating-ip-pool";
    /// Fixed addresses, comma-separated (one per family); also read from
    /// `spec.loadBalancerIP`.
    pub const ADDRESSES: &str = "flatnetwork.pandaria.io/floating-ip";
    /// Services with the same key (in one namespace) share one address when
    /// their ports do not clash.
    pub const SHARING_KEY: &str = "flatnetwork.pandaria.io/floating-ip-sharing-key";
    /// On a pod: pods of one namespace with the same set share one address
    /// per family, held by the set's active pod ([`super::pods`]).
    pub const SET: &str = "flatnetwork.pandaria.io/floating-ip-set";
    /// On a pod, written by the operator: the floating addresses it was
    /// given, comma-separated.
    pub const ASSIGNED: &str = "flatnetwork.pandaria.io/floating-ip-assigned";
}

pub mod pods;

/// A problem in a FloatingIPPool spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolSpecError {
    /// No CIDR, more than two, or two of one family.
    #[error(
        "spec.cidrs must hold one IPv4 and/or one IPv6 network, got {0:?}: list at most one per family"
    )]
    Cidrs(Vec<String>),
    /// `targetNetworkInterface` is not `<master>` or `<master>.<vlan>`.
    #[error(
        "spec.targetNetworkInterface {0:?} is not an interface name or <master>.<vlan>: use e.g. \"eth0\" or \"eth0.100\""
    )]
    Interface(String),
    /// A range of a family the pool has no CIDR of, or incomplete.
    #[error(
        "spec.ranges[{index}] is incomplete or of a family spec.cidrs does not hold: give from and to inside one of the CIDRs"
    )]
    RangeFamily {
        /// Index in `spec.ranges`.
        index: usize,
    },
    /// A selector whose operator is none there is: it could select nothing.
    #[error("spec.{field}: {error}")]
    Selector {
        /// `nodeSelector` or `namespaceSelector`.
        field: &'static str,
        /// Why it cannot be evaluated.
        error: SelectorError,
    },
    /// A per-family check of the shared subnet rules failed.
    #[error("{0}")]
    Network(String),
}

/// Every problem of one pool's spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("FloatingIPPool {name} is invalid: {}", join(errors))]
pub struct InvalidPool {
    /// The pool's name.
    pub name: String,
    /// The problems.
    pub errors: Vec<PoolSpecError>,
}

/// A pool whose spec passed [`validate_pool`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidPool {
    /// Object name.
    pub name: String,
    /// The node interface addresses are announced on.
    pub parent: ParentLink,
    /// One network per family, IPv4 first.
    pub networks: Vec<ValidSubnet>,
}

impl ValidPool {
    /// The network of `family`, if the pool has one.
    pub fn network(&self, family: Family) -> Option<&ValidSubnet> {
        self.networks.iter().find(|n| n.cidr.family() == family)
    }

    /// The network holding `addr`, if any.
    pub fn network_of(&self, addr: IpAddr) -> Option<&ValidSubnet> {
        self.networks.iter().find(|n| n.cidr.contains(addr))
    }

    /// An empty IPAM pool of `family`'s network.
    pub fn pool(&self, family: Family) -> Option<Pool> {
        self.network(family).map(Pool::new)
    }

    /// Whether the two pools share an address.
    pub fn overlaps(&self, other: &ValidPool) -> bool {
        self.networks
            .iter()
            .any(|a| other.networks.iter().any(|b| a.cidr.overlaps(&b.cidr)))
    }
}

/// `eth0` or `eth0.100` as a parent link, checked with the subnets' rules.
///
/// # Errors
/// [`PoolSpecError::Interface`] naming the text.
pub fn parse_interface(text: &str) -> Result<ParentLink, PoolSpecError> {
    let bad = || PoolSpecError::Interface(text.to_owned());
    let parent = match text.rsplit_once('.') {
        Some((master, vlan)) => ParentLink {
            master: master.to_owned(),
            vlan: vlan
                .parse::<u16>()
                .ok()
                .filter(|v| (1..=MAX_VLAN_ID).contains(v))
                .ok_or_else(bad)?,
        },
        None => ParentLink {
            master: text.to_owned(),
            vlan: 0,
        },
    };
    parent.check().map_err(|_| bad())?;
    Ok(parent)
}

/// Checks `spec` of the pool `name` and returns its typed form.
///
/// # Errors
/// Every problem found, at once.
pub fn validate_pool(name: &str, spec: &FloatingIPPoolSpec) -> Result<ValidPool, InvalidPool> {
    let mut errors = Vec::new();
    let parent = parse_interface(spec.target_network_interface.trim())
        .map_err(|e| errors.push(e))
        .ok();
    let cidrs: Vec<Cidr> = spec
        .cidrs
        .iter()
        .filter_map(|c| Cidr::parse(c.trim()).ok())
        .collect();
    let families_distinct = cidrs.len() < 2 || cidrs[0].family() != cidrs[1].family();
    if cidrs.is_empty() || cidrs.len() != spec.cidrs.len() || !families_distinct {
        errors.push(PoolSpecError::Cidrs(spec.cidrs.clone()));
    }
    for (index, range) in spec.ranges.iter().enumerate() {
        let family = range
            .bounds()
            .and_then(|(from, _)| cidrs.iter().find(|c| c.family() == Family::of(from)));
        if family.is_none() {
            errors.push(PoolSpecError::RangeFamily { index });
        }
    }
    for (field, selector) in [
        ("nodeSelector", &spec.node_selector),
        ("namespaceSelector", &spec.namespace_selector),
    ] {
        if let Some(Err(error)) = selector.as_ref().map(selector::check) {
            errors.push(PoolSpecError::Selector { field, error });
        }
    }
    let mut networks = Vec::new();
    if let Some(parent) = &parent
        && families_distinct
    {
        for cidr in &cidrs {
            let as_subnet = FlatNetworkSubnetSpec {
                flat_mode: "macvlan".into(),
                master: parent.master.clone(),
                vlan: i64::from(parent.vlan),
                cidr: cidr.to_string(),
                ranges: spec
                    .ranges
                    .iter()
                    .filter(|r| {
                        r.bounds()
                            .is_some_and(|(f, _)| Family::of(f) == cidr.family())
                    })
                    .cloned()
                    .collect(),
                ..FlatNetworkSubnetSpec::default()
            };
            match validate_subnet(name, &as_subnet) {
                Ok(valid) => networks.push(valid),
                Err(invalid) => errors.extend(
                    invalid
                        .errors
                        .iter()
                        .map(|e| PoolSpecError::Network(format!("{cidr}: {e}"))),
                ),
            }
        }
    }
    networks.sort_by_key(|n| n.cidr.family() != Family::V4);
    match parent {
        Some(parent) if errors.is_empty() => Ok(ValidPool {
            name: name.to_owned(),
            parent,
            networks,
        }),
        _ => Err(InvalidPool {
            name: name.to_owned(),
            errors,
        }),
    }
}

/// Whom a quota limits.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum QuotaScope {
    /// Every namespace labelled `field.cattle.io/projectId=<id>`.
    Project(String),
    /// One namespace.
    Namespace(String),
}

impl fmt::Display for QuotaScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Project(p) => write!(f, "project {p}"),
            Self::Namespace(n) => write!(f, "namespace {n}"),
        }
    }
}

/// A problem in a FloatingIPProjectQuota spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuotaSpecError {
    /// Neither or both of project and namespace.
    #[error("FloatingIPProjectQuota {0}: set exactly one of spec.project and spec.namespace")]
    Scope(String),
}

/// The scope of a quota.
///
/// # Errors
/// [`QuotaSpecError::Scope`] unless exactly one of project and namespace
/// is set.
pub fn quota_scope(
    name: &str,
    spec: &FloatingIPProjectQuotaSpec,
) -> Result<QuotaScope, QuotaSpecError> {
    match (spec.project.trim(), spec.namespace.trim()) {
        (p, "") if !p.is_empty() => Ok(QuotaScope::Project(p.to_owned())),
        ("", n) if !n.is_empty() => Ok(QuotaScope::Namespace(n.to_owned())),
        _ => Err(QuotaSpecError::Scope(name.to_owned())),
    }
}

impl QuotaScope {
    /// Whether a Service in `namespace`, whose project label is
    /// `project`, counts against this quota.
    pub fn covers(&self, namespace: &str, project: Option<&str>) -> bool {
        match self {
            Self::Project(p) => project == Some(p.as_str()),
            Self::Namespace(n) => n == namespace,
        }
    }
}

/// A Rancher project label value: `c-xxxxx:p-yyyyy` or `p-yyyyy`; the
/// project part is what quotas and pools name.
pub fn project_of(label: &str) -> &str {
    label.rsplit_once(':').map_or(label, |(_, p)| p)
}

/// A port a Service exposes, for clash checks.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ServicePort {
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
    /// The port.
    pub port: i32,
}

/// What a LoadBalancer Service asks of the floating addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FloatingRequest {
    /// The pool named by annotation.
    pub pool: Option<String>,
    /// Fixed addresses (annotation, else `spec.loadBalancerIP`).
    pub fixed: Vec<IpAddr>,
    /// The families wanted, in `spec.ipFamilies` order (IPv4 when unset).
    pub families: Vec<Family>,
    /// Sharing key, when set.
    pub sharing_key: Option<String>,
    /// The Service's ports.
    pub ports: Vec<ServicePort>,
}

/// Why a Service's request cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// A fixed address that is not an address.
    #[error(
        "{source_field} holds {value:?}, which is not a list of IP addresses: write e.g. \"192.168.10.5\" or \"192.168.10.5,fd00::5\""
    )]
    BadAddress {
        /// The annotation or field.
        source_field: &'static str,
        /// The text.
        value: String,
    },
}

/// Whether flatnet gives `service` a floating address: a LoadBalancer
/// Service of flatnet's class, or of no class when `classless` is on.
pub fn wants_floating(service: &Service, classless: bool) -> bool {
    let Some(spec) = &service.spec else {
        return false;
    };
    spec.type_.as_deref() == Some("LoadBalancer")
        && match spec.load_balancer_class.as_deref() {
            Some(class) => class == LOAD_BALANCER_CLASS,
            None => classless,
        }
}

/// The addresses in `service`'s `status.loadBalancer.ingress` (entries
/// without a parseable `ip` skipped).
pub fn ingress_ips(service: &Service) -> Vec<IpAddr> {
    service
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|i| i.ip.as_deref()?.parse::<IpAddr>().ok())
        .collect()
}

/// What `service` asks for.
///
/// # Errors
/// A fixed address that does not parse.
pub fn request_of(service: &Service) -> Result<FloatingRequest, RequestError> {
    let annotations = service.metadata.annotations.clone().unwrap_or_default();
    let spec = service.spec.clone().unwrap_or_default();
    let text = |s: &str| Some(s.trim().to_owned()).filter(|t| !t.is_empty());
    let (source_field, fixed_text) =
        match annotations.get(annotation::ADDRESSES).and_then(|a| text(a)) {
            Some(a) => (annotation::ADDRESSES, Some(a)),
            None => (
                "spec.loadBalancerIP",
                spec.load_balancer_ip.as_deref().and_then(text),
            ),
        };
    let fixed = match fixed_text {
        None => Vec::new(),
        Some(value) => value
            .split(',')
            .map(|a| a.trim().parse::<IpAddr>())
            .collect::<Result<_, _>>()
            .map_err(|_| RequestError::BadAddress {
                source_field,
                value: value.clone(),
            })?,
    };
    let mut families: Vec<Family> = spec
        .ip_families
        .iter()
        .flatten()
        .filter_map(|f| match f.as_str() {
            "IPv4" => Some(Family::V4),
            "IPv6" => Some(Family::V6),
            _ => None,
        })
        .collect();
    if families.is_empty() {
        families = if fixed.is_empty() {
            vec![Family::V4]
        } else {
            fixed.iter().map(|a| Family::of(*a)).collect()
        };
    }
    families.dedup();
    let mut ports: Vec<ServicePort> = spec
        .ports
        .iter()
        .flatten()
        .map(|p| ServicePort {
            protocol: p.protocol.clone().unwrap_or_else(|| "TCP".into()),
            port: p.port,
        })
        .collect();
    ports.sort();
    Ok(FloatingRequest {
        pool: annotations.get(annotation::POOL).and_then(|p| text(p)),
        fixed,
        families,
        sharing_key: annotations
            .get(annotation::SHARING_KEY)
            .and_then(|k| text(k)),
        ports,
    })
}

/// The first port both lists expose, if any: two Services may share an
/// address only when this is `None`.
pub fn clashing_port<'a>(a: &'a [ServicePort], b: &[ServicePort]) -> Option<&'a ServicePort> {
    a.iter().find(|p| b.contains(p))
}

/// How many distinct addresses of each pool the holders in scope hold:
/// `holders` are (namespace, project label, addresses) per Service, and
/// `pool_of` maps an address to its pool. A shared address counts once.
pub fn quota_usage<'a>(
    scope: &QuotaScope,
    holders: impl IntoIterator<Item = (&'a str, Option<&'a str>, &'a [IpAddr])>,
    pool_of: impl Fn(IpAddr) -> Option<String>,
) -> BTreeMap<String, u32> {
    let mut addresses: BTreeMap<String, std::collections::BTreeSet<IpAddr>> = BTreeMap::new();
    for (namespace, project, addrs) in holders {
        if !scope.covers(namespace, project.map(project_of)) {
            continue;
        }
        for addr in addrs {
            if let Some(pool) = pool_of(*addr) {
                addresses.entry(pool).or_default().insert(*addr);
            }
        }
    }
    addresses
        .into_iter()
        .map(|(pool, set)| (pool, u32::try_from(set.len()).unwrap_or(u32::MAX)))
        .collect()
}

/// The node that owns `addr` among `candidates` (eligible, alive nodes):
/// highest random weight (rendezvous) hashing, so every agent that sees
/// the same candidates picks the same owner without talking, and a node
/// leaving moves only its own addresses.
pub fn choose_owner<'a>(
    addr: IpAddr,
    candidates: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    candidates
        .into_iter()
        .max_by_key(|node| (owner_weight(addr, node), *node))
}

/// FNV-1a over the address and the node name, then a 64-bit finaliser
/// (splitmix) so near-identical names spread evenly.
fn owner_weight(addr: IpAddr, node: &str) -> u64 {
    let octets = match addr {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    };
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in octets.iter().chain([0xff].iter()).chain(node.as_bytes()) {
        hash = (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
    }
    hash = (hash ^ (hash >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash = (hash ^ (hash >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

#[cfg(test)]
mod tests;
