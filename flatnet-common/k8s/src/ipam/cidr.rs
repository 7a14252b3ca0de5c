//! Address families, CIDRs and the `u128` view of addresses used by the pool.
//!
//! Both families map onto `u128` so one interval structure serves IPv4 and
//! IPv6: an IPv4 address is its 32-bit value, an IPv6 address its 128-bit
//! value. The family travels alongside (a pool is single-family), so the two
//! spaces never mix.

use std::{
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    str::FromStr,
};

/// An IP address family.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Family {
    /// IPv4 (32-bit addresses).
    V4,
    /// IPv6 (128-bit addresses).
    V6,
}

impl Family {
    /// The family of `ip`.
    pub fn of(ip: IpAddr) -> Self {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// Address width in bits.
    pub fn bits(self) -> u8 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        })
    }
}

/// `ip` as an integer in its family's address space.
pub fn to_u128(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u128::from(u32::from(v4)),
        IpAddr::V6(v6) => u128::from(v6),
    }
}

/// The address with integer value `value` in `family`.
///
/// # Panics
/// When `value` does not fit an IPv4 address; pool arithmetic never produces
/// such values because every interval lies inside a CIDR of `family`.
pub fn from_u128(family: Family, value: u128) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4(Ipv4Addr::from(
            u32::try_from(value).expect("IPv4 value out of range"),
        )),
        Family::V6 => IpAddr::V6(Ipv6Addr::from(value)),
    }
}

/// Why a CIDR string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CidrError {
    /// No `/` separates address and prefix length.
    #[error("{0:?} has no prefix length: write it as address/length, e.g. 10.0.0.0/24")]
    MissingPrefix(String),
    /// The address part does not parse.
    #[error("{0:?} has an invalid address part: use an IPv4 or IPv6 network address")]
    InvalidAddress(String),
    /// The prefix length is not a number in range for the family.
    #[error("{value:?} has an invalid prefix length: use 0..={max}")]
    InvalidPrefix {
        /// The rejected CIDR text.
        value: String,
        /// Largest prefix length of the family.
        max: u8,
    },
}

/// A network in CIDR notation, always held in canonical form (host bits zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cidr {
    family: Family,
    network: u128,
    prefix_len: u8,
}

impl Cidr {
    /// The network of `ip` with `prefix_len` bits; host bits are cleared.
    ///
    /// # Panics
    /// When `prefix_len` exceeds the family's width.
    pub fn new(ip: IpAddr, prefix_len: u8) -> Self {
        let family = Family::of(ip);
        assert!(prefix_len <= family.bits(), "prefix length too long");
        let host_mask = host_mask(family, prefix_len);
        Self {
            family,
            network: to_u128(ip) & !host_mask,
            prefix_len,
        }
    }

    /// Parses `address/length`. Host bits are accepted and cleared, so
    /// `10.2.3.7/24` parses as `10.2.3.0/24`; compare [`Cidr::to_string`] with
    /// the input to learn whether the text was canonical.
    pub fn parse(text: &str) -> Result<Self, CidrError> {
        let (addr, len) = text
            .split_once('/')
            .ok_or_else(|| CidrError::MissingPrefix(text.to_owned()))?;
        let ip = IpAddr::from_str(addr).map_err(|_| CidrError::InvalidAddress(text.to_owned()))?;
        let max = Family::of(ip).bits();
        let prefix_len = len
            .parse::<u8>()
            .ok()
            .filter(|len| *len <= max)
            .ok_or_else(|| CidrError::InvalidPrefix {
                value: text.to_owned(),
                max,
            })?;
        Ok(Self::new(ip, prefix_len))
    }

    /// Address family of the network.
    pub fn family(&self) -> Family {
        self.family
    }

    /// Prefix length in bits.
    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }

    /// The network address (all host bits zero).
    pub fn network(&self) -> IpAddr {
        from_u128(self.family, self.network)
    }

    /// First address of the network as an integer.
    pub fn first(&self) -> u128 {
        self.network
    }

    /// Last address of the network as an integer (the IPv4 broadcast).
    pub fn last(&self) -> u128 {
        self.network | host_mask(self.family, self.prefix_len)
    }

    /// Whether `ip` is of the same family and inside the network.
    pub fn contains(&self, ip: IpAddr) -> bool {
        Family::of(ip) == self.family && (self.first()..=self.last()).contains(&to_u128(ip))
    }

    /// Whether the two networks share at least one address. Networks either
    /// nest or are disjoint, so this is "one contains the other".
    pub fn overlaps(&self, other: &Cidr) -> bool {
        self.family == other.family && self.first() <= other.last() && other.first() <= self.last()
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network(), self.prefix_len)
    }
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

/// The host bits of a `prefix_len` network in `family` set to one.
fn host_mask(family: Family, prefix_len: u8) -> u128 {
    let host_bits = u32::from(family.bits() - prefix_len);
    // A shift by 128 overflows, hence the explicit full-width case.
    if host_bits == 128 {
        u128::MAX
    } else {
        (1u128 << host_bits) - 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_clears_host_bits() {
        let cidr = Cidr::parse("10.2.3.7/24").unwrap();
        assert_eq!(cidr.to_string(), "10.2.3.0/24");
        assert_eq!(cidr.family(), Family::V4);
        assert_eq!(cidr.first(), to_u128("10.2.3.0".parse().unwrap()));
        assert_eq!(cidr.last(), to_u128("10.2.3.255".parse().unwrap()));
    }

    #[test]
    fn parse_ipv6_and_extremes() {
        assert_eq!(Cidr::parse("fd00::5/64").unwrap().to_string(), "fd00::/64");
        let all = Cidr::parse("::/0").unwrap();
        assert_eq!((all.first(), all.last()), (0, u128::MAX));
        let host = Cidr::parse("10.0.0.1/32").unwrap();
        assert_eq!(host.first(), host.last());
    }

    #[test]
    fn parse_errors_say_what_is_wrong() {
        assert!(matches!(
            Cidr::parse("10.0.0.0"),
            Err(CidrError::MissingPrefix(_))
        ));
        assert!(matches!(
            Cidr::parse("10.0.0/8"),
            Err(CidrError::InvalidAddress(_))
        ));
        assert_eq!(
            Cidr::parse("10.0.0.0/33"),
            Err(CidrError::InvalidPrefix {
                value: "10.0.0.0/33".into(),
                max: 32
            })
        );
        assert!(Cidr::parse("fd00::/129").is_err());
        assert!(Cidr::parse("10.0.0.0/x").is_err());
    }

    #[test]
    fn contains_checks_family_and_bounds() {
        let cidr = Cidr::parse("10.0.0.0/24").unwrap();
        assert!(cidr.contains("10.0.0.0".parse().unwrap()));
        assert!(cidr.contains("10.0.0.255".parse().unwrap()));
        assert!(!cidr.contains("10.0.1.0".parse().unwrap()));
        assert!(!cidr.contains("::a00:1".parse().unwrap()));
    }

    #[test]
    fn overlap_is_nesting() {
        let a = Cidr::parse("10.0.0.0/16").unwrap();
        let b = Cidr::parse("10.0.5.0/24").unwrap();
        let c = Cidr::parse("10.1.0.0/16").unwrap();
        assert!(a.overlaps(&b) && b.overlaps(&a));
        assert!(!a.overlaps(&c));
        assert!(!a.overlaps(&Cidr::parse("::/0").unwrap()));
    }

    #[test]
    fn u128_round_trip() {
        for ip in [
            "0.0.0.0",
            "255.255.255.255",
            "::",
            "fd00::1",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            assert_eq!(from_u128(Family::of(ip), to_u128(ip)), ip);
        }
    }
}
