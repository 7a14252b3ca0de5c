//! Subnet validation and conflict detection, shared by the admission webhook
//! and the subnet controller (which re-checks because admission can be
//! bypassed or race with a parallel create).
//!
//! [`validate_subnet`] turns a raw spec into a [`ValidSubnet`] whose fields
//! are typed and checked; everything downstream (the IPAM pool, the node
//! agent) takes a `ValidSubnet`, so it never re-parses strings. Every error
//! names the field and how to fix it, and all problems of a spec are reported
//! at once.

use std::{fmt, net::IpAddr};

use crate::{
    api::{FlatNetworkSubnetSpec, Route},
    ipam::{Cidr, Family, to_u128},
};

/// Interface kind created in the pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FlatMode {
    /// A macvlan child of the parent link.
    Macvlan,
    /// An ipvlan child of the parent link.
    Ipvlan,
}

impl fmt::Display for FlatMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FlatMode::Macvlan => "macvlan",
            FlatMode::Ipvlan => "ipvlan",
        })
    }
}

/// macvlan mode (`spec.mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MacvlanMode {
    /// Children talk to each other directly (the default).
    Bridge,
    /// All traffic goes to the external switch.
    Vepa,
    /// Children are isolated from each other.
    Private,
    /// The single child takes over the parent.
    Passthru,
}

/// ipvlan mode (`spec.mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IpvlanMode {
    /// Layer 2 switching (the default).
    L2,
    /// Layer 3 routing.
    L3,
    /// Layer 3 routing through netfilter.
    L3s,
}

/// ipvlan flag (`spec.ipvlanFlag`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IpvlanFlag {
    /// Children talk to each other directly (the default).
    Bridge,
    /// Children are isolated from each other.
    Private,
    /// All traffic goes to the external switch.
    Vepa,
}

/// A mode or flag name that is not one of the accepted values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} {value:?}; expected one of {expected}")]
pub struct UnknownName {
    /// What was parsed (`macvlan mode`, ...).
    pub what: &'static str,
    /// The rejected text.
    pub value: String,
    /// The accepted values, comma-separated.
    pub expected: &'static str,
}

/// Gives an enum the names the API uses: `as_str`, `NAMES` (for messages),
/// `Display` and `FromStr` (exact names; the API's empty default is the
/// caller's business).
macro_rules! api_names {
    ($ty:ident, $what:literal, $first:ident = $first_name:literal $(, $variant:ident = $name:literal)*) => {
        api_names!(@impl $ty, $what, concat!($first_name $(, ", ", $name)*), $first = $first_name $(, $variant = $name)*);
    };
    (@impl $ty:ident, $what:literal, $names:expr, $($variant:ident = $name:literal),+) => {
        impl $ty {
            /// The accepted names, comma-separated, for messages.
            pub const NAMES: &'static str = $names;

            /// The name the API uses.
            pub fn as_str(&self) -> &'static str {
                match self { $(Self::$variant => $name),+ }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl core::str::FromStr for $ty {
            type Err = UnknownName;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                match s {
                    $($name => Ok(Self::$variant),)+
                    _ => Err(UnknownName {
                        what: $what,
                        value: s.to_owned(),
                        expected: Self::NAMES,
                    }),
                }
            }
        }
    };
}

api_names!(
    MacvlanMode,
    "macvlan mode",
    Bridge = "bridge",
    Vepa = "vepa",
    Private = "private",
    Passthru = "passthru"
);
api_names!(IpvlanMode, "ipvlan mode", L2 = "l2", L3 = "l3", L3s = "l3s");
api_names!(
    IpvlanFlag,
    "ipvlan flag",
    Bridge = "bridge",
    Private = "private",
    Vepa = "vepa"
);

/// The complete interface configuration of a subnet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkMode {
    /// macvlan with its mode.
    Macvlan(MacvlanMode),
    /// ipvlan with its mode and flag.
    Ipvlan(IpvlanMode, IpvlanFlag),
}

impl LinkMode {
    /// The interface kind.
    pub fn flat_mode(&self) -> FlatMode {
        match self {
            LinkMode::Macvlan(_) => FlatMode::Macvlan,
            LinkMode::Ipvlan(..) => FlatMode::Ipvlan,
        }
    }

    /// Whether the pod interface speaks ARP/NDP itself. ipvlan L3 and L3S
    /// children do not (the kernel drops such frames); their addresses must
    /// be answered for on the parent link instead.
    pub fn announces(&self) -> bool {
        !matches!(self, LinkMode::Ipvlan(IpvlanMode::L3 | IpvlanMode::L3s, _))
    }
}

/// Highest usable 802.1Q VLAN id (4095 is reserved).
pub const MAX_VLAN_ID: u16 = 4094;

/// The host interface pod interfaces hang off: `master`, or the VLAN
/// sub-interface `master.vlan`. Subnets on the same parent link are siblings.
/// Carried from the subnet's validation to netlink and into the agent's
/// attachment records (`{"master": "eth0", "vlan": 100}`).
#[derive(
    Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct ParentLink {
    /// Host interface name (`spec.master`).
    pub master: String,
    /// VLAN ID, `0` for none (`spec.vlan`).
    pub vlan: u16,
}

impl ParentLink {
    /// The name of the node interface pod interfaces are created on:
    /// `master`, or `<master>.<vlan>`, the VLAN interface flatnet makes.
    pub fn ifname(&self) -> String {
        self.to_string()
    }

    /// The rules of `spec.master` and `spec.vlan`: `master` is an
    /// interface name, `vlan` is 0 (none) or 1 to [`MAX_VLAN_ID`], and
    /// [`ParentLink::ifname`] is an interface name too.
    pub fn check(&self) -> Result<(), SubnetError> {
        if check_ifname(&self.master).is_err() {
            return Err(SubnetError::Master(self.master.clone()));
        }
        if self.vlan > MAX_VLAN_ID {
            return Err(SubnetError::Vlan(i64::from(self.vlan)));
        }
        if check_ifname(&self.ifname()).is_err() {
            return Err(SubnetError::VlanLinkName {
                master: self.master.clone(),
                vlan: self.vlan,
            });
        }
        Ok(())
    }
}

impl fmt::Display for ParentLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.vlan {
            0 => f.write_str(&self.master),
            vlan => write!(f, "{}.{vlan}", self.master),
        }
    }
}

/// A subnet whose spec passed [`validate_subnet`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidSubnet {
    /// Object name.
    pub name: String,
    /// Host interface.
    pub parent: ParentLink,
    /// Interface kind and mode.
    pub link_mode: LinkMode,
    /// The network, canonical.
    pub cidr: Cidr,
    /// Gateway inside `cidr`, if any.
    pub gateway: Option<IpAddr>,
    /// Allocation pools inside `cidr`, each `from <= to`, pairwise disjoint,
    /// in spec order; empty means the whole CIDR.
    pub ranges: Vec<(IpAddr, IpAddr)>,
    /// Validated custom routes.
    pub routes: Vec<Route>,
    /// MTU of the pod interfaces, within the family's range; `None`
    /// inherits.
    pub mtu: Option<u32>,
}

impl ValidSubnet {
    /// The address intervals allocation may draw from (before excluding the
    /// network address, broadcast and gateway): `ranges`, or the whole CIDR.
    pub fn pool_intervals(&self) -> Vec<(u128, u128)> {
        if self.ranges.is_empty() {
            vec![(self.cidr.first(), self.cidr.last())]
        } else {
            self.ranges
                .iter()
                .map(|&(from, to)| (to_u128(from), to_u128(to)))
                .collect()
        }
    }
}

/// One problem in a subnet spec. The text names the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubnetError {
    /// `flatMode` is not supported.
    #[error("spec.flatMode {0:?} is not supported: use \"macvlan\" or \"ipvlan\"")]
    FlatMode(String),
    /// `mode` does not belong to the flat mode.
    #[error(
        "spec.mode {mode:?} is not a {flat_mode} mode: use one of {allowed} (empty means the first)"
    )]
    Mode {
        /// The interface kind.
        flat_mode: FlatMode,
        /// The rejected mode.
        mode: String,
        /// The accepted modes.
        allowed: &'static str,
    },
    /// `ipvlanFlag` set on a macvlan subnet.
    #[error("spec.ipvlanFlag {0:?} only applies to ipvlan: remove it for a macvlan subnet")]
    FlagOnMacvlan(String),
    /// `ipvlanFlag` is not supported.
    #[error(
        "spec.ipvlanFlag {0:?} is not supported: use \"bridge\", \"private\" or \"vepa\" (empty means bridge)"
    )]
    IpvlanFlag(String),
    /// `master` is not a usable interface name.
    #[error(
        "spec.master {0:?} is not a valid interface name: use the host interface, e.g. \"eth0\" (1-15 characters, no '/', ':' or spaces)"
    )]
    Master(String),
    /// `vlan` is out of range.
    #[error("spec.vlan {0} is out of range: use 0 (no VLAN) or 1..4094")]
    Vlan(i64),
    /// `master.vlan` is too long for an interface name.
    #[error(
        "spec.master {master:?} with spec.vlan {vlan} gives the interface name {master}.{vlan}, longer than 15 characters: use a shorter master name"
    )]
    VlanLinkName {
        /// The master interface.
        master: String,
        /// The VLAN ID.
        vlan: u16,
    },
    /// `cidr` does not parse.
    #[error("spec.cidr: {0}")]
    Cidr(#[from] crate::ipam::CidrError),
    /// `gateway` is outside the CIDR or of the other family.
    #[error(
        "spec.gateway {gateway} is not inside spec.cidr {cidr}: use an address of the subnet or leave it empty"
    )]
    GatewayOutside {
        /// The gateway.
        gateway: IpAddr,
        /// The subnet.
        cidr: Cidr,
    },
    /// `gateway` is the network or broadcast address.
    #[error("spec.gateway {gateway} is the {what} address of {cidr}: use a host address")]
    GatewayReserved {
        /// The gateway.
        gateway: IpAddr,
        /// The subnet.
        cidr: Cidr,
        /// `network` or `broadcast`.
        what: &'static str,
    },
    /// A range lacks an end.
    #[error(
        "spec.ranges[{index}] needs both from and to: set both ends (a single address is from == to)"
    )]
    RangeIncomplete {
        /// Position in `spec.ranges`.
        index: usize,
    },
    /// A range end is outside the CIDR.
    #[error(
        "spec.ranges[{index}].{end} {ip} is not inside spec.cidr {cidr}: keep ranges inside the subnet"
    )]
    RangeOutside {
        /// Position in `spec.ranges`.
        index: usize,
        /// `from` or `to`.
        end: &'static str,
        /// The offending address.
        ip: IpAddr,
        /// The subnet.
        cidr: Cidr,
    },
    /// A range runs backwards.
    #[error("spec.ranges[{index}] runs backwards ({from} > {to}): swap from and to")]
    RangeReversed {
        /// Position in `spec.ranges`.
        index: usize,
        /// Start.
        from: IpAddr,
        /// End.
        to: IpAddr,
    },
    /// Two ranges of the same subnet overlap.
    #[error("spec.ranges[{index}] overlaps spec.ranges[{other}]: merge them into one range")]
    RangesOverlap {
        /// Position of the later range.
        index: usize,
        /// Position of the earlier range.
        other: usize,
    },
    /// A route has no `dev`.
    #[error("spec.routes[{index}].dev is empty: name the pod interface, e.g. \"eth1\"")]
    RouteDev {
        /// Position in `spec.routes`.
        index: usize,
    },
    /// A route's `dst` is not a CIDR.
    #[error("spec.routes[{index}].dst: {source}")]
    RouteDst {
        /// Position in `spec.routes`.
        index: usize,
        /// Why it does not parse.
        source: crate::ipam::CidrError,
    },
    /// A route's `via` or `src` is of the other family than `dst`.
    #[error(
        "spec.routes[{index}].{field} {ip} is not {family} like dst: use an address of the destination's family"
    )]
    RouteFamily {
        /// Position in `spec.routes`.
        index: usize,
        /// `via` or `src`.
        field: &'static str,
        /// The offending address.
        ip: IpAddr,
        /// Family of `dst`.
        family: Family,
    },
    /// A route priority is out of range.
    #[error("spec.routes[{index}].priority {priority} is out of range: use 0..2147483647")]
    RoutePriority {
        /// Position in `spec.routes`.
        index: usize,
        /// The rejected value.
        priority: i64,
    },
    /// `mtu` is out of the range the subnet's family allows.
    #[error(
        "spec.mtu {mtu} is out of range for an {family} subnet: use {min}..65535 (1280 is IPv6's minimum, 68 IPv4's), or leave it unset to inherit"
    )]
    Mtu {
        /// The rejected value.
        mtu: u32,
        /// Family of `cidr`.
        family: Family,
        /// The family's minimum.
        min: u32,
    },
}

/// Smallest MTU of an IPv4 interface (RFC 791).
pub const MIN_MTU_IPV4: u32 = 68;
/// Smallest MTU of an IPv6 interface (RFC 8200 §5).
pub const MIN_MTU_IPV6: u32 = 1280;
/// Largest MTU a netlink link carries.
pub const MAX_MTU: u32 = 65535;

/// The smallest MTU `family` allows.
#[must_use]
pub fn min_mtu(family: Family) -> u32 {
    match family {
        Family::V4 => MIN_MTU_IPV4,
        Family::V6 => MIN_MTU_IPV6,
    }
}

/// The MTU of an interface on `subnets` (one, or a dual-stack pair): the
/// smallest `spec.mtu` among them, `None` when none sets one.
#[must_use]
pub fn interface_mtu<'a>(subnets: impl IntoIterator<Item = &'a ValidSubnet>) -> Option<u32> {
    subnets.into_iter().filter_map(|s| s.mtu).min()
}

/// Every problem found in one subnet's spec.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("FlatNetworkSubnet {name} is invalid: {}", join(errors))]
pub struct InvalidSubnet {
    /// The subnet's name.
    pub name: String,
    /// The problems, in field order.
    pub errors: Vec<SubnetError>,
}

pub(crate) fn join<T: fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// Checks `spec` of the subnet `name` and returns its typed form.
pub fn validate_subnet(
    name: &str,
    spec: &FlatNetworkSubnetSpec,
) -> Result<ValidSubnet, InvalidSubnet> {
    let mut errors = Vec::new();
    let link_mode = parse_link_mode(spec, &mut errors);
    let parent = parse_parent(spec, &mut errors);
    let cidr = Cidr::parse(spec.cidr.trim())
        .map_err(|e| errors.push(e.into()))
        .ok();
    let mut ranges = Vec::new();
    if let Some(cidr) = cidr {
        check_gateway(spec.gateway, cidr, &mut errors);
        ranges = check_ranges(spec, cidr, &mut errors);
    }
    check_routes(&spec.routes, &mut errors);
    if let (Some(mtu), Some(cidr)) = (spec.mtu, cidr) {
        let min = min_mtu(cidr.family());
        if !(min..=MAX_MTU).contains(&mtu) {
            errors.push(SubnetError::Mtu {
                mtu,
                family: cidr.family(),
                min,
            });
        }
    }
    match (link_mode, parent, cidr) {
        (Some(link_mode), Some(parent), Some(cidr)) if errors.is_empty() => Ok(ValidSubnet {
            name: name.to_owned(),
            parent,
            link_mode,
            cidr,
            gateway: spec.gateway,
            ranges,
            routes: spec.routes.clone(),
            mtu: spec.mtu,
        }),
        _ => Err(InvalidSubnet {
            name: name.to_owned(),
            errors,
        }),
    }
}

fn parse_link_mode(
    spec: &FlatNetworkSubnetSpec,
    errors: &mut Vec<SubnetError>,
) -> Option<LinkMode> {
    let mode = spec.mode.trim();
    let flag = spec.ipvlan_flag.trim();
    match spec.flat_mode.trim() {
        "macvlan" => {
            let parsed = or_default(mode, MacvlanMode::Bridge);
            if parsed.is_none() {
                errors.push(SubnetError::Mode {
                    flat_mode: FlatMode::Macvlan,
                    mode: mode.to_owned(),
                    allowed: MacvlanMode::NAMES,
                });
            }
            if !flag.is_empty() {
                errors.push(SubnetError::FlagOnMacvlan(flag.to_owned()));
                return None;
            }
            parsed.map(LinkMode::Macvlan)
        }
        "ipvlan" => {
            let parsed_mode = or_default(mode, IpvlanMode::L2);
            if parsed_mode.is_none() {
                errors.push(SubnetError::Mode {
                    flat_mode: FlatMode::Ipvlan,
                    mode: mode.to_owned(),
                    allowed: IpvlanMode::NAMES,
                });
            }
            let parsed_flag = or_default(flag, IpvlanFlag::Bridge);
            if parsed_flag.is_none() {
                errors.push(SubnetError::IpvlanFlag(flag.to_owned()));
            }
            Some(LinkMode::Ipvlan(parsed_mode?, parsed_flag?))
        }
        other => {
            errors.push(SubnetError::FlatMode(other.to_owned()));
            None
        }
    }
}

/// An API name, where empty means `default`.
fn or_default<T: core::str::FromStr>(name: &str, default: T) -> Option<T> {
    if name.is_empty() {
        Some(default)
    } else {
        name.parse().ok()
    }
}

/// Longest Linux interface name in bytes (`IFNAMSIZ` - 1).
pub const MAX_IFNAME_LEN: usize = 15;

/// Why a text is not a Linux interface name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IfnameError {
    /// The empty name.
    #[error("is empty")]
    Empty,
    /// More than [`MAX_IFNAME_LEN`] bytes.
    #[error("{name:?} is {} bytes, longer than the 15 Linux allows", .name.len())]
    TooLong {
        /// The name.
        name: String,
    },
    /// `.` or `..`.
    #[error("{0:?} is reserved")]
    Reserved(String),
    /// A byte the kernel refuses: `/`, `:`, white space or NUL.
    #[error(
        "{name:?} contains {byte:?}, which Linux refuses in interface names ('/', ':', white space)"
    )]
    Character {
        /// The name.
        name: String,
        /// The refused character (as the byte the kernel sees).
        byte: char,
    },
}

/// The kernel's rule for interface names (`dev_valid_name`): 1 to 15
/// bytes, not `.` or `..`, and no `/`, `:` or byte the kernel's `isspace`
/// accepts (tab to carriage return, space, and 0xa0, which occurs inside
/// UTF-8 sequences). NUL is refused as well: netlink would cut the name there.
/// The one rule for every interface name flatnet takes from outside.
pub fn check_ifname(name: &str) -> Result<(), IfnameError> {
    if name.is_empty() {
        return Err(IfnameError::Empty);
    }
    if name.len() > MAX_IFNAME_LEN {
        return Err(IfnameError::TooLong {
            name: name.to_owned(),
        });
    }
    if name == "." || name == ".." {
        return Err(IfnameError::Reserved(name.to_owned()));
    }
    let refused = |&b: &u8| matches!(b, b'/' | b':' | b'\0' | b'\t'..=b'\r' | b' ' | 0xa0);
    match name.bytes().find(refused) {
        Some(byte) => Err(IfnameError::Character {
            name: name.to_owned(),
            byte: char::from(byte),
        }),
        None => Ok(()),
    }
}

fn parse_parent(spec: &FlatNetworkSubnetSpec, errors: &mut Vec<SubnetError>) -> Option<ParentLink> {
    let master_ok = check_ifname(&spec.master).is_ok();
    if !master_ok {
        errors.push(SubnetError::Master(spec.master.clone()));
    }
    let Some(vlan) = u16::try_from(spec.vlan)
        .ok()
        .filter(|vlan| *vlan <= MAX_VLAN_ID)
    else {
        errors.push(SubnetError::Vlan(spec.vlan));
        return None;
    };
    let parent = ParentLink {
        master: spec.master.clone(),
        vlan,
    };
    match parent.check() {
        Ok(()) => Some(parent),
        // Reported above.
        Err(SubnetError::Master(_)) => None,
        Err(error) => {
            errors.push(error);
            None
        }
    }
}

fn check_gateway(gateway: Option<IpAddr>, cidr: Cidr, errors: &mut Vec<SubnetError>) {
    let Some(gateway) = gateway else { return };
    if !cidr.contains(gateway) {
        errors.push(SubnetError::GatewayOutside { gateway, cidr });
        return;
    }
    let value = to_u128(gateway);
    let what = if has_network_address(cidr) && value == cidr.first() {
        "network"
    } else if has_broadcast_address(cidr) && value == cidr.last() {
        "broadcast"
    } else {
        return;
    };
    errors.push(SubnetError::GatewayReserved {
        gateway,
        cidr,
        what,
    });
}

/// Whether the first address of `cidr` is its network address, never
/// assigned to a host. Point-to-point networks (IPv4 /31 and /32, IPv6 /127
/// and /128) use every address.
pub(crate) fn has_network_address(cidr: Cidr) -> bool {
    cidr.family().bits() - cidr.prefix_len() >= 2
}

/// Whether the last address of `cidr` is an IPv4 broadcast. IPv6 has no
/// broadcast, so its last address is a normal host address.
pub(crate) fn has_broadcast_address(cidr: Cidr) -> bool {
    cidr.family() == Family::V4 && has_network_address(cidr)
}

fn check_ranges(
    spec: &FlatNetworkSubnetSpec,
    cidr: Cidr,
    errors: &mut Vec<SubnetError>,
) -> Vec<(IpAddr, IpAddr)> {
    let mut valid: Vec<(usize, IpAddr, IpAddr)> = Vec::new();
    for (index, range) in spec.ranges.iter().enumerate() {
        let Some((from, to)) = range.bounds() else {
            errors.push(SubnetError::RangeIncomplete { index });
            continue;
        };
        let mut ok = true;
        for (end, ip) in [("from", from), ("to", to)] {
            if !cidr.contains(ip) {
                errors.push(SubnetError::RangeOutside {
                    index,
                    end,
                    ip,
                    cidr,
                });
                ok = false;
            }
        }
        if ok && to_u128(from) > to_u128(to) {
            errors.push(SubnetError::RangeReversed { index, from, to });
            ok = false;
        }
        if !ok {
            continue;
        }
        if let Some(&(other, ..)) = valid
            .iter()
            .find(|&&(_, f, t)| to_u128(f) <= to_u128(to) && to_u128(from) <= to_u128(t))
        {
            errors.push(SubnetError::RangesOverlap { index, other });
            continue;
        }
        valid.push((index, from, to));
    }
    valid.into_iter().map(|(_, from, to)| (from, to)).collect()
}

fn check_routes(routes: &[Route], errors: &mut Vec<SubnetError>) {
    for (index, route) in routes.iter().enumerate() {
        if route.dev.trim().is_empty() {
            errors.push(SubnetError::RouteDev { index });
        }
        match Cidr::parse(route.dst.trim()) {
            Err(source) => errors.push(SubnetError::RouteDst { index, source }),
            Ok(dst) => {
                for (field, ip) in [("via", route.via), ("src", route.src)] {
                    if let Some(ip) = ip.filter(|ip| Family::of(*ip) != dst.family()) {
                        errors.push(SubnetError::RouteFamily {
                            index,
                            field,
                            ip,
                            family: dst.family(),
                        });
                    }
                }
            }
        }
        if !(0..=i64::from(i32::MAX)).contains(&route.priority) {
            errors.push(SubnetError::RoutePriority {
                index,
                priority: route.priority,
            });
        }
    }
}

/// Why a subnet cannot coexist with a sibling on the same parent link.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubnetConflict {
    /// The sibling reaches the same node interface with another master
    /// and VLAN (`eth0` with VLAN 100, and `eth0.100`): MACs are kept
    /// unique per master and VLAN, so the two could share one.
    #[error(
        "subnet {sibling} reaches interface {ifname} as master {} vlan {}, and this subnet as master {} vlan {}: pods of both would be macvlans of one interface, whose MACs are kept unique per spelling; name it as subnet {sibling} does (master {}, vlan {})",
        parent.master, parent.vlan, own.master, own.vlan, parent.master, parent.vlan
    )]
    Spelling {
        /// The sibling's name.
        sibling: String,
        /// The sibling's parent link.
        parent: ParentLink,
        /// This subnet's parent link.
        own: ParentLink,
        /// The node interface both name.
        ifname: String,
    },
    /// The parent link already carries the other interface kind.
    #[error(
        "subnet {sibling} already uses {parent} in flatMode {sibling_mode}: one interface cannot mix macvlan and ipvlan; use flatMode {sibling_mode} or another master/vlan"
    )]
    FlatMode {
        /// The sibling's name.
        sibling: String,
        /// The shared parent link.
        parent: ParentLink,
        /// The sibling's interface kind.
        sibling_mode: FlatMode,
    },
    /// Overlapping CIDRs and at least one side allocates from its whole CIDR.
    #[error(
        "spec.cidr {cidr} overlaps subnet {sibling} ({sibling_cidr}) on {parent} and one of them has no spec.ranges: give both subnets disjoint spec.ranges or use a separate network"
    )]
    Cidr {
        /// The sibling's name.
        sibling: String,
        /// The shared parent link.
        parent: ParentLink,
        /// This subnet's CIDR.
        cidr: Cidr,
        /// The sibling's CIDR.
        sibling_cidr: Cidr,
    },
    /// Both sides have ranges and two of them share an address.
    #[error(
        "spec.ranges {from}-{to} overlaps range {sibling_from}-{sibling_to} of subnet {sibling} on {parent}: make the ranges disjoint"
    )]
    Range {
        /// The sibling's name.
        sibling: String,
        /// The shared parent link.
        parent: ParentLink,
        /// This subnet's range start.
        from: IpAddr,
        /// This subnet's range end.
        to: IpAddr,
        /// The sibling's range start.
        sibling_from: IpAddr,
        /// The sibling's range end.
        sibling_to: IpAddr,
    },
}

/// Every conflict between one subnet and its siblings.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "FlatNetworkSubnet {name} conflicts with existing subnets: {}",
    join(conflicts)
)]
pub struct SubnetConflicts {
    /// The checked subnet's name.
    pub name: String,
    /// One entry per conflicting sibling.
    pub conflicts: Vec<SubnetConflict>,
}

/// Checks `subnet` against every other valid subnet.
///
/// Only subnets on the same node interface can conflict, so passing all
/// subnets is fine; a sibling with the same name (the subnet's
/// own previous version) is skipped. Every sibling is checked — a compatible
/// sibling never ends the search early — and each conflicting sibling is
/// reported once:
/// - another master and VLAN naming the same interface (`eth0` with VLAN
///   100, and `eth0.100`) conflicts: MACs are unique per master and VLAN;
/// - a different flat mode on the same parent link conflicts;
/// - with the same flat mode, overlapping CIDRs conflict unless both
///   subnets define `ranges` and no two ranges share an address. Range ends
///   are inclusive, so ranges that touch at one address conflict.
pub fn check_siblings<'a>(
    subnet: &ValidSubnet,
    siblings: impl IntoIterator<Item = &'a ValidSubnet>,
) -> Result<(), SubnetConflicts> {
    // Siblings are the subnets on the same node interface: the same master
    // and VLAN, or another spelling of it, which is a conflict of its own.
    let ifname = subnet.parent.ifname();
    let conflicts: Vec<SubnetConflict> = siblings
        .into_iter()
        .filter(|s| s.name != subnet.name && s.parent.ifname() == ifname)
        .filter_map(|sibling| {
            if sibling.parent == subnet.parent {
                conflict_with(subnet, sibling)
            } else {
                Some(SubnetConflict::Spelling {
                    sibling: sibling.name.clone(),
                    parent: sibling.parent.clone(),
                    own: subnet.parent.clone(),
                    ifname: ifname.clone(),
                })
            }
        })
        .collect();
    if conflicts.is_empty() {
        Ok(())
    } else {
        Err(SubnetConflicts {
            name: subnet.name.clone(),
            conflicts,
        })
    }
}

fn conflict_with(subnet: &ValidSubnet, sibling: &ValidSubnet) -> Option<SubnetConflict> {
    let sibling_mode = sibling.link_mode.flat_mode();
    if subnet.link_mode.flat_mode() != sibling_mode {
        return Some(SubnetConflict::FlatMode {
            sibling: sibling.name.clone(),
            parent: sibling.parent.clone(),
            sibling_mode,
        });
    }
    if !subnet.cidr.overlaps(&sibling.cidr) {
        return None;
    }
    if subnet.ranges.is_empty() || sibling.ranges.is_empty() {
        return Some(SubnetConflict::Cidr {
            sibling: sibling.name.clone(),
            parent: sibling.parent.clone(),
            cidr: subnet.cidr,
            sibling_cidr: sibling.cidr,
        });
    }
    let overlap = |a: &(IpAddr, IpAddr), b: &(IpAddr, IpAddr)| {
        to_u128(a.0) <= to_u128(b.1) && to_u128(b.0) <= to_u128(a.1)
    };
    subnet.ranges.iter().find_map(|mine| {
        let theirs = sibling.ranges.iter().find(|theirs| overlap(mine, theirs))?;
        Some(SubnetConflict::Range {
            sibling: sibling.name.clone(),
            parent: sibling.parent.clone(),
            from: mine.0,
            to: mine.1,
            sibling_from: theirs.0,
            sibling_to: theirs.1,
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::IpRange;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn spec(flat_mode: &str, cidr: &str) -> FlatNetworkSubnetSpec {
        FlatNetworkSubnetSpec {
            flat_mode: flat_mode.into(),
            master: "eth0".into(),
            cidr: cidr.into(),
            ..Default::default()
        }
    }

    fn errors(spec: &FlatNetworkSubnetSpec) -> Vec<SubnetError> {
        validate_subnet("s", spec).unwrap_err().errors
    }

    #[test]
    fn mode_and_flag_names_parse_and_print_alike() {
        for mode in MacvlanMode::NAMES.split(", ") {
            assert_eq!(mode.parse::<MacvlanMode>().unwrap().to_string(), mode);
        }
        for mode in IpvlanMode::NAMES.split(", ") {
            assert_eq!(mode.parse::<IpvlanMode>().unwrap().to_string(), mode);
        }
        for flag in IpvlanFlag::NAMES.split(", ") {
            assert_eq!(flag.parse::<IpvlanFlag>().unwrap().to_string(), flag);
        }
        assert_eq!(
            "source".parse::<MacvlanMode>().unwrap_err().to_string(),
            "unknown macvlan mode \"source\"; expected one of bridge, vepa, private, passthru"
        );
        assert!(
            "".parse::<IpvlanFlag>().is_err(),
            "the empty default is not a name"
        );
    }

    #[test]
    fn mtu_range_depends_on_the_family_and_the_smallest_wins() {
        let mut v4 = spec("macvlan", "10.0.0.0/24");
        for ok in [68, 1500, 9000, 65535] {
            v4.mtu = Some(ok);
            assert_eq!(validate_subnet("s", &v4).unwrap().mtu, Some(ok));
        }
        for bad in [0, 67, 65536] {
            v4.mtu = Some(bad);
            let errors = errors(&v4);
            assert_eq!(
                errors,
                [SubnetError::Mtu {
                    mtu: bad,
                    family: Family::V4,
                    min: 68
                }]
            );
            assert!(
                errors[0].to_string().contains("use 68..65535"),
                "{}",
                errors[0]
            );
        }
        let mut v6 = spec("macvlan", "fd00::/64");
        v6.mtu = Some(1279);
        assert!(errors(&v6)[0].to_string().contains("use 1280..65535"));
        v6.mtu = Some(1280);
        let v6 = validate_subnet("s6", &v6).unwrap();
        v4.mtu = None;
        let v4 = validate_subnet("s", &v4).unwrap();
        assert_eq!(interface_mtu([&v4]), None);
        assert_eq!(interface_mtu([&v4, &v6]), Some(1280));
    }

    #[test]
    fn only_layer_2_children_announce() {
        assert!(LinkMode::Macvlan(MacvlanMode::Bridge).announces());
        assert!(LinkMode::Ipvlan(IpvlanMode::L2, IpvlanFlag::Bridge).announces());
        assert!(!LinkMode::Ipvlan(IpvlanMode::L3, IpvlanFlag::Bridge).announces());
        assert!(!LinkMode::Ipvlan(IpvlanMode::L3s, IpvlanFlag::Private).announces());
    }

    #[test]
    fn valid_macvlan_defaults_and_canonical_cidr() {
        let mut s = spec("macvlan", "10.2.3.7/24");
        s.vlan = 100;
        s.gateway = Some(ip("10.2.3.1"));
        let valid = validate_subnet("s", &s).unwrap();
        assert_eq!(valid.link_mode, LinkMode::Macvlan(MacvlanMode::Bridge));
        assert_eq!(valid.cidr.to_string(), "10.2.3.0/24");
        assert_eq!(valid.parent.to_string(), "eth0.100");
        assert_eq!(
            valid.pool_intervals(),
            [(valid.cidr.first(), valid.cidr.last())]
        );
    }

    #[test]
    fn mode_and_flag_combinations() {
        let mut s = spec("ipvlan", "10.0.0.0/24");
        assert_eq!(
            validate_subnet("s", &s).unwrap().link_mode,
            LinkMode::Ipvlan(IpvlanMode::L2, IpvlanFlag::Bridge)
        );
        s.mode = "l3s".into();
        s.ipvlan_flag = "private".into();
        assert_eq!(
            validate_subnet("s", &s).unwrap().link_mode,
            LinkMode::Ipvlan(IpvlanMode::L3s, IpvlanFlag::Private)
        );
        s.mode = "bridge".into();
        s.ipvlan_flag = "l2".into();
        assert_eq!(
            errors(&s),
            [
                SubnetError::Mode {
                    flat_mode: FlatMode::Ipvlan,
                    mode: "bridge".into(),
                    allowed: "l2, l3, l3s"
                },
                SubnetError::IpvlanFlag("l2".into()),
            ]
        );
        let mut m = spec("macvlan", "10.0.0.0/24");
        m.mode = "passthru".into();
        assert_eq!(
            validate_subnet("s", &m).unwrap().link_mode,
            LinkMode::Macvlan(MacvlanMode::Passthru)
        );
        m.mode = "l2".into();
        m.ipvlan_flag = "bridge".into();
        let errs = errors(&m);
        assert!(matches!(
            errs[0],
            SubnetError::Mode {
                flat_mode: FlatMode::Macvlan,
                ..
            }
        ));
        assert_eq!(errs[1], SubnetError::FlagOnMacvlan("bridge".into()));
        assert_eq!(
            errors(&spec("bridge", "10.0.0.0/24")),
            [SubnetError::FlatMode("bridge".into())]
        );
    }

    #[test]
    fn interface_names_follow_the_kernel_rule() {
        for good in [
            "eth0",
            "enp0s31f6.4094",
            "...",
            "a",
            "é1",
            "abcdefghijklmno",
        ] {
            assert_eq!(check_ifname(good), Ok(()), "{good:?}");
        }
        for bad in [
            "",
            ".",
            "..",
            "abcdefghijklmnop",
            "eth/0",
            "eth:0",
            "eth 0",
            "eth\t0",
            "eth\n0",
            "eth\x0b0",
            "eth\x000",
            // U+00A0 is C2 A0 in UTF-8, and the kernel's isspace(0xa0) holds.
            "eth\u{a0}0",
            // So is every other character with an A0 byte (U+0120 is C4 A0).
            "eth\u{120}",
        ] {
            assert!(check_ifname(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            check_ifname("eth/0").unwrap_err().to_string(),
            "\"eth/0\" contains '/', which Linux refuses in interface names ('/', ':', white space)"
        );
    }

    #[test]
    fn parent_links_name_their_interface_and_check_like_the_spec() {
        let parent = |master: &str, vlan: u16| ParentLink {
            master: master.into(),
            vlan,
        };
        assert_eq!(parent("eth0", 0).ifname(), "eth0");
        assert_eq!(parent("eth0", 100).ifname(), "eth0.100");
        assert_eq!(parent("eth0", 4094).check(), Ok(()));
        assert_eq!(
            parent("eth/0", 0).check(),
            Err(SubnetError::Master("eth/0".into()))
        );
        assert_eq!(parent("eth0", 4095).check(), Err(SubnetError::Vlan(4095)));
        assert_eq!(
            parent("enp0s31f6abc", 4094).check(),
            Err(SubnetError::VlanLinkName {
                master: "enp0s31f6abc".into(),
                vlan: 4094
            })
        );
        let json = serde_json::to_value(parent("eth0", 7)).unwrap();
        assert_eq!(json, serde_json::json!({"master": "eth0", "vlan": 7}));
    }

    #[test]
    fn master_and_vlan() {
        let mut s = spec("macvlan", "10.0.0.0/24");
        for bad in ["", "eth/0", "eth 0", "a-very-long-ifname", "eth0:1"] {
            s.master = bad.into();
            assert_eq!(errors(&s), [SubnetError::Master(bad.into())], "{bad:?}");
        }
        s.master = "eth0".into();
        for bad in [-1, 4095, 70000] {
            s.vlan = bad;
            assert_eq!(errors(&s), [SubnetError::Vlan(bad)]);
        }
        s.vlan = 4094;
        assert!(validate_subnet("s", &s).is_ok());
        s.master = "enp0s31f6abc".into();
        assert_eq!(
            errors(&s),
            [SubnetError::VlanLinkName {
                master: "enp0s31f6abc".into(),
                vlan: 4094
            }]
        );
    }

    #[test]
    fn cidr_and_gateway() {
        assert!(matches!(
            errors(&spec("macvlan", "10.0.0.0"))[..],
            [SubnetError::Cidr(_)]
        ));
        let mut s = spec("macvlan", "10.0.0.0/24");
        s.gateway = Some(ip("10.0.1.1"));
        assert!(matches!(
            errors(&s)[..],
            [SubnetError::GatewayOutside { .. }]
        ));
        s.gateway = Some(ip("fd00::1"));
        assert!(matches!(
            errors(&s)[..],
            [SubnetError::GatewayOutside { .. }]
        ));
        s.gateway = Some(ip("10.0.0.0"));
        assert!(matches!(
            errors(&s)[..],
            [SubnetError::GatewayReserved {
                what: "network",
                ..
            }]
        ));
        s.gateway = Some(ip("10.0.0.255"));
        assert!(matches!(
            errors(&s)[..],
            [SubnetError::GatewayReserved {
                what: "broadcast",
                ..
            }]
        ));
        let mut v6 = spec("macvlan", "fd00::/64");
        v6.gateway = Some(ip("fd00::ffff:ffff:ffff:ffff"));
        assert!(validate_subnet("s", &v6).is_ok(), "IPv6 has no broadcast");
        let text = SubnetError::GatewayOutside {
            gateway: ip("10.0.1.1"),
            cidr: Cidr::parse("10.0.0.0/24").unwrap(),
        }
        .to_string();
        assert!(
            text.starts_with("spec.gateway") && text.contains("leave it empty"),
            "{text}"
        );
    }

    #[test]
    fn ranges() {
        let mut s = spec("macvlan", "10.0.0.0/24");
        s.ranges = vec![
            IpRange::new(ip("10.0.0.10"), ip("10.0.0.20")),
            IpRange {
                from: Some(ip("10.0.0.30")),
                to: None,
            },
            IpRange::new(ip("10.0.0.50"), ip("10.0.1.5")),
            IpRange::new(ip("10.0.0.90"), ip("10.0.0.80")),
            IpRange::new(ip("10.0.0.20"), ip("10.0.0.25")),
            IpRange::new(ip("10.0.0.100"), ip("10.0.0.100")),
        ];
        assert_eq!(
            errors(&s),
            [
                SubnetError::RangeIncomplete { index: 1 },
                SubnetError::RangeOutside {
                    index: 2,
                    end: "to",
                    ip: ip("10.0.1.5"),
                    cidr: Cidr::parse("10.0.0.0/24").unwrap()
                },
                SubnetError::RangeReversed {
                    index: 3,
                    from: ip("10.0.0.90"),
                    to: ip("10.0.0.80")
                },
                SubnetError::RangesOverlap { index: 4, other: 0 },
            ]
        );
        s.ranges.drain(1..5);
        let valid = validate_subnet("s", &s).unwrap();
        assert_eq!(
            valid.ranges,
            [
                (ip("10.0.0.10"), ip("10.0.0.20")),
                (ip("10.0.0.100"), ip("10.0.0.100"))
            ]
        );
    }

    #[test]
    fn routes() {
        let mut s = spec("macvlan", "10.0.0.0/24");
        s.routes = vec![
            Route {
                dev: "eth1".into(),
                dst: "192.168.0.0/16".into(),
                via: Some(ip("10.0.0.1")),
                ..Default::default()
            },
            Route {
                dev: String::new(),
                dst: "192.168.0.0".into(),
                ..Default::default()
            },
            Route {
                dev: "eth1".into(),
                dst: "fd00::/8".into(),
                via: Some(ip("10.0.0.1")),
                priority: -1,
                ..Default::default()
            },
        ];
        let errs = errors(&s);
        assert_eq!(errs.len(), 4, "{errs:?}");
        assert_eq!(errs[0], SubnetError::RouteDev { index: 1 });
        assert!(matches!(errs[1], SubnetError::RouteDst { index: 1, .. }));
        assert!(matches!(
            errs[2],
            SubnetError::RouteFamily {
                index: 2,
                field: "via",
                ..
            }
        ));
        assert_eq!(
            errs[3],
            SubnetError::RoutePriority {
                index: 2,
                priority: -1
            }
        );
    }

    #[test]
    fn all_errors_in_one_message() {
        let mut s = spec("macvlan", "nope");
        s.vlan = 5000;
        let err = validate_subnet("web", &s).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with("FlatNetworkSubnet web is invalid: "),
            "{text}"
        );
        assert!(
            text.contains("spec.vlan 5000") && text.contains("spec.cidr"),
            "{text}"
        );
    }

    fn subnet(
        name: &str,
        flat_mode: &str,
        vlan: i64,
        cidr: &str,
        ranges: &[(&str, &str)],
    ) -> ValidSubnet {
        let mut s = spec(flat_mode, cidr);
        s.vlan = vlan;
        s.ranges = ranges
            .iter()
            .map(|(f, t)| IpRange::new(ip(f), ip(t)))
            .collect();
        validate_subnet(name, &s).unwrap()
    }

    fn conflicts(new: &ValidSubnet, siblings: &[ValidSubnet]) -> Vec<SubnetConflict> {
        check_siblings(new, siblings)
            .err()
            .map(|e| e.conflicts)
            .unwrap_or_default()
    }

    /// Master `eth0` with VLAN 100 and master `eth0.100` are one node
    /// interface: pods of both are macvlans of it, whose MACs must differ,
    /// but MACs are claimed per spelling (one ledger per master and VLAN),
    /// so the pool could give one MAC to a pod of each.
    #[test]
    fn one_interface_spelled_two_ways_conflicts() {
        let tagged = subnet("tagged", "macvlan", 100, "10.0.0.0/24", &[]);
        let mut named_spec = spec("macvlan", "10.1.0.0/24");
        named_spec.master = "eth0.100".into();
        let named = validate_subnet("named", &named_spec).unwrap();
        assert_eq!(named.parent.ifname(), tagged.parent.ifname());
        let found = conflicts(&named, std::slice::from_ref(&tagged));
        assert!(
            matches!(&found[..], [SubnetConflict::Spelling { sibling, .. }] if sibling == "tagged"),
            "{found:?}"
        );
        let message = check_siblings(&named, std::slice::from_ref(&tagged))
            .unwrap_err()
            .to_string();
        for part in ["tagged", "eth0.100", "master eth0", "vlan 100"] {
            assert!(message.contains(part), "{part}: {message}");
        }
        assert_eq!(conflicts(&tagged, std::slice::from_ref(&named)).len(), 1);
        // The same spelling is a sibling as before; another VLAN is not.
        let also_tagged = subnet("also", "macvlan", 100, "10.1.0.0/24", &[]);
        assert!(check_siblings(&also_tagged, std::slice::from_ref(&tagged)).is_ok());
        let other = subnet("other", "macvlan", 101, "10.1.0.0/24", &[]);
        assert!(check_siblings(&other, std::slice::from_ref(&named)).is_ok());
    }

    #[test]
    fn flat_mode_cannot_mix_on_one_link() {
        let existing = [subnet("a", "macvlan", 10, "10.0.0.0/24", &[])];
        let new = subnet("b", "ipvlan", 10, "10.1.0.0/24", &[]);
        assert!(matches!(
            conflicts(&new, &existing)[..],
            [SubnetConflict::FlatMode {
                sibling_mode: FlatMode::Macvlan,
                ..
            }]
        ));
        let other_vlan = subnet("b", "ipvlan", 11, "10.1.0.0/24", &[]);
        assert!(check_siblings(&other_vlan, &existing).is_ok());
        let same_mode = subnet("b", "macvlan", 10, "10.1.0.0/24", &[]);
        assert!(check_siblings(&same_mode, &existing).is_ok());
    }

    #[test]
    fn cidr_overlap_needs_ranges_on_both_sides() {
        let whole = subnet("a", "macvlan", 0, "10.0.0.0/24", &[]);
        let ranged = subnet(
            "b",
            "macvlan",
            0,
            "10.0.0.0/24",
            &[("10.0.0.100", "10.0.0.200")],
        );
        let contained = subnet("c", "macvlan", 0, "10.0.0.128/25", &[]);
        assert!(matches!(
            conflicts(&ranged, std::slice::from_ref(&whole))[..],
            [SubnetConflict::Cidr { .. }]
        ));
        assert!(matches!(
            conflicts(&whole, std::slice::from_ref(&ranged))[..],
            [SubnetConflict::Cidr { .. }]
        ));
        assert!(matches!(
            conflicts(&contained, std::slice::from_ref(&whole))[..],
            [SubnetConflict::Cidr { .. }]
        ));
        assert!(matches!(
            conflicts(&whole, &[contained])[..],
            [SubnetConflict::Cidr { .. }]
        ));
        let other_net = subnet("d", "macvlan", 0, "10.0.1.0/24", &[]);
        assert!(check_siblings(&other_net, &[whole]).is_ok());
    }

    #[test]
    fn range_overlap_is_symmetric_and_edges_touch() {
        let base = subnet(
            "a",
            "macvlan",
            0,
            "10.0.0.0/24",
            &[("10.0.0.10", "10.0.0.20")],
        );
        for (from, to) in [
            ("10.0.0.10", "10.0.0.20"), // equal
            ("10.0.0.12", "10.0.0.15"), // subset
            ("10.0.0.13", "10.0.0.16"), // strictly inside
            ("10.0.0.5", "10.0.0.10"),  // touches the lower edge
            ("10.0.0.20", "10.0.0.30"), // touches the upper edge
            ("10.0.0.5", "10.0.0.12"),  // partial low
            ("10.0.0.18", "10.0.0.40"), // partial high
            ("10.0.0.1", "10.0.0.250"), // containing
        ] {
            let new = subnet("b", "macvlan", 0, "10.0.0.0/24", &[(from, to)]);
            assert!(
                matches!(
                    conflicts(&new, std::slice::from_ref(&base))[..],
                    [SubnetConflict::Range { .. }]
                ),
                "{from}-{to}"
            );
            assert!(
                matches!(conflicts(&base, &[new])[..], [SubnetConflict::Range { .. }]),
                "symmetric {from}-{to}"
            );
        }
        for (from, to) in [("10.0.0.1", "10.0.0.9"), ("10.0.0.21", "10.0.0.30")] {
            let new = subnet("b", "macvlan", 0, "10.0.0.0/24", &[(from, to)]);
            assert!(
                check_siblings(&new, std::slice::from_ref(&base)).is_ok(),
                "{from}-{to}"
            );
        }
    }

    #[test]
    fn a_compatible_sibling_does_not_end_the_search() {
        let siblings = [
            subnet(
                "a",
                "macvlan",
                0,
                "10.0.0.0/24",
                &[("10.0.0.100", "10.0.0.200")],
            ),
            subnet(
                "b",
                "macvlan",
                0,
                "10.0.0.0/24",
                &[("10.0.0.5", "10.0.0.9")],
            ),
            subnet("c", "macvlan", 0, "10.0.0.0/24", &[]),
        ];
        let new = subnet(
            "n",
            "macvlan",
            0,
            "10.0.0.0/24",
            &[("10.0.0.0", "10.0.0.50")],
        );
        let found = conflicts(&new, &siblings);
        let names: Vec<&str> = found
            .iter()
            .map(|c| match c {
                SubnetConflict::Range { sibling, .. } | SubnetConflict::Cidr { sibling, .. } => {
                    sibling.as_str()
                }
                SubnetConflict::FlatMode { sibling, .. }
                | SubnetConflict::Spelling { sibling, .. } => sibling.as_str(),
            })
            .collect();
        assert_eq!(names, ["b", "c"]);
    }

    #[test]
    fn own_previous_version_and_other_links_are_ignored() {
        let old = subnet("a", "macvlan", 0, "10.0.0.0/24", &[]);
        let updated = subnet(
            "a",
            "macvlan",
            0,
            "10.0.0.0/24",
            &[("10.0.0.5", "10.0.0.9")],
        );
        assert!(check_siblings(&updated, &[old]).is_ok());
        let mut other_master = subnet("b", "macvlan", 0, "10.0.0.0/24", &[]);
        other_master.parent.master = "eth1".into();
        assert!(check_siblings(&updated, &[other_master]).is_ok());
    }
}
