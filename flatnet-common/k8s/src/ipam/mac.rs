//! Fixed MAC addresses: parsing, and picking one that no sibling uses.
//!
//! MACs only need to be unique per layer-2 segment, which is the parent link
//! (master plus VLAN): every subnet on the same parent link shares one MAC
//! space, whatever its CIDR.

use std::{collections::BTreeSet, fmt, str::FromStr};

use crate::{api::FlatNetworkSubnet, validation::ParentLink};

/// A unicast Ethernet MAC address. Displays lower-case, colon-separated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mac(pub [u8; 6]);

/// Why a MAC text was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MacError {
    /// The text is no 6-byte MAC in a supported notation.
    #[error("{0:?} is not a MAC address: write it as aa:bb:cc:dd:ee:ff or aabb.ccdd.eeff")]
    Syntax(String),
    /// A hyphenated MAC: `-` separates list members in annotations.
    #[error(
        "{0:?} uses '-' between bytes, but '-' separates list entries: write it with colons, e.g. aa:bb:cc:dd:ee:ff"
    )]
    Hyphenated(String),
    /// A multicast or broadcast MAC cannot be an interface address.
    #[error(
        "{0} is a multicast address (lowest bit of the first byte set): use a unicast MAC, e.g. with first byte 02"
    )]
    Multicast(Mac),
    /// The all-zero MAC is not an interface address.
    #[error("00:00:00:00:00:00 is not a usable MAC: choose another one")]
    Zero,
}

impl Mac {
    /// Parses `aa:bb:cc:dd:ee:ff` (any case) or `aabb.ccdd.eeff`, and
    /// rejects hyphenated, multicast and all-zero MACs.
    pub fn parse(text: &str) -> Result<Self, MacError> {
        let text = text.trim();
        let mac = parse_colon(text)
            .or_else(|| parse_dotted(text))
            .ok_or_else(|| {
                if parse_colon(&text.replace('-', ":")).is_some() {
                    MacError::Hyphenated(text.to_owned())
                } else {
                    MacError::Syntax(text.to_owned())
                }
            })?;
        if mac.0 == [0; 6] {
            Err(MacError::Zero)
        } else if mac.0[0] & 1 == 1 {
            Err(MacError::Multicast(mac))
        } else {
            Ok(mac)
        }
    }
}

fn parse_colon(text: &str) -> Option<Mac> {
    let mut bytes = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut bytes {
        let part = parts.next()?;
        if part.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    parts.next().is_none().then_some(Mac(bytes))
}

fn parse_dotted(text: &str) -> Option<Mac> {
    let mut bytes = [0u8; 6];
    let mut parts = text.split('.');
    for pair in bytes.chunks_mut(2) {
        let part = parts.next()?;
        if part.len() != 4 {
            return None;
        }
        let value = u16::from_str_radix(part, 16).ok()?;
        pair.copy_from_slice(&value.to_be_bytes());
    }
    parts.next().is_none().then_some(Mac(bytes))
}

impl FromStr for Mac {
    type Err = MacError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for Mac {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [a, b, c, d, e, g] = self.0;
        write!(f, "{a:02x}:{b:02x}:{c:02x}:{d:02x}:{e:02x}:{g:02x}")
    }
}

/// Why no MAC could be chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "all requested MACs are in use on {parent} ({}): add a free MAC to the request or free one of them",
    list(candidates)
)]
pub struct MacsTaken {
    /// The shared parent link.
    pub parent: ParentLink,
    /// The requested MACs.
    pub candidates: Vec<Mac>,
}

fn list(macs: &[Mac]) -> String {
    macs.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The fixed MACs in use on `parent`: the union of `status.usedMac` of every
/// subnet on that parent link. Unparsable entries are skipped.
pub fn macs_in_use<'a>(
    parent: &ParentLink,
    subnets: impl IntoIterator<Item = &'a FlatNetworkSubnet>,
) -> BTreeSet<Mac> {
    subnets
        .into_iter()
        .filter(|s| s.spec.master == parent.master && s.spec.vlan == i64::from(parent.vlan))
        .filter_map(|s| s.status.as_ref())
        .flat_map(|status| status.used_mac.iter())
        .filter_map(|text| Mac::parse(text).ok())
        .collect()
}

/// Chooses the MAC of one allocation.
///
/// - No candidates: `None`, the kernel picks a random MAC.
/// - `current` (the MAC the record already holds) is kept when it is one of
///   the candidates, so re-reconciling never moves a pod's MAC.
/// - Otherwise the first candidate not in `in_use`.
pub fn choose_mac(
    parent: &ParentLink,
    candidates: &[Mac],
    current: Option<Mac>,
    in_use: &BTreeSet<Mac>,
) -> Result<Option<Mac>, MacsTaken> {
    if candidates.is_empty() {
        return Ok(None);
    }
    if let Some(current) = current.filter(|c| candidates.contains(c)) {
        return Ok(Some(current));
    }
    candidates
        .iter()
        .find(|mac| !in_use.contains(mac))
        .map(|mac| Some(*mac))
        .ok_or_else(|| MacsTaken {
            parent: parent.clone(),
            candidates: candidates.to_vec(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{FlatNetworkSubnetSpec, FlatNetworkSubnetStatus};

    fn mac(text: &str) -> Mac {
        Mac::parse(text).unwrap()
    }

    #[test]
    fn parses_and_normalises() {
        assert_eq!(mac("AA:BB:CC:DD:EE:0F").to_string(), "aa:bb:cc:dd:ee:0f");
        assert_eq!(mac("aabb.ccdd.ee10").to_string(), "aa:bb:cc:dd:ee:10");
        assert_eq!(mac(" 02:00:00:00:00:01 ").0, [2, 0, 0, 0, 0, 1]);
    }

    #[test]
    fn rejects_bad_macs_with_the_fix() {
        assert_eq!(
            Mac::parse("aa-bb-cc-dd-ee-ff"),
            Err(MacError::Hyphenated("aa-bb-cc-dd-ee-ff".into()))
        );
        for bad in [
            "aa:bb:cc:dd:ee",
            "aa:bb:cc:dd:ee:ff:00",
            "aa:bb:cc:dd:ee:fg",
            "a:bb:cc:dd:ee:ff",
            "",
        ] {
            assert_eq!(Mac::parse(bad), Err(MacError::Syntax(bad.into())), "{bad}");
        }
        assert_eq!(Mac::parse("00:00:00:00:00:00"), Err(MacError::Zero));
        assert!(matches!(
            Mac::parse("01:00:5e:00:00:01"),
            Err(MacError::Multicast(_))
        ));
        assert!(matches!(
            Mac::parse("ff:ff:ff:ff:ff:ff"),
            Err(MacError::Multicast(_))
        ));
        let text = MacError::Hyphenated("x".into()).to_string();
        assert!(text.contains("colons"), "{text}");
    }

    fn link() -> ParentLink {
        ParentLink {
            master: "eth0".into(),
            vlan: 100,
        }
    }

    #[test]
    fn choose_keeps_current_then_first_free() {
        let (a, b, c) = (
            mac("02:00:00:00:00:0a"),
            mac("02:00:00:00:00:0b"),
            mac("02:00:00:00:00:0c"),
        );
        let in_use = BTreeSet::from([a, c]);
        assert_eq!(choose_mac(&link(), &[], Some(a), &in_use), Ok(None));
        assert_eq!(choose_mac(&link(), &[a, b], None, &in_use), Ok(Some(b)));
        assert_eq!(
            choose_mac(&link(), &[a, c], Some(c), &in_use),
            Ok(Some(c)),
            "own MAC is kept"
        );
        assert_eq!(
            choose_mac(&link(), &[a, b], Some(c), &in_use),
            Ok(Some(b)),
            "stale MAC is replaced"
        );
        let err = choose_mac(&link(), &[a, c], None, &in_use).unwrap_err();
        assert_eq!(err.candidates, [a, c]);
        assert!(err.to_string().contains("eth0.100"), "{err}");
    }

    fn subnet(master: &str, vlan: i64, used: &[&str]) -> FlatNetworkSubnet {
        let mut s = FlatNetworkSubnet::new(
            "s",
            FlatNetworkSubnetSpec {
                master: master.into(),
                vlan,
                ..Default::default()
            },
        );
        s.status = Some(FlatNetworkSubnetStatus {
            used_mac: used.iter().map(|m| m.to_string()).collect(),
            ..Default::default()
        });
        s
    }

    #[test]
    fn macs_in_use_spans_subnets_of_the_same_link_only() {
        let subnets = [
            subnet("eth0", 100, &["02:00:00:00:00:01"]),
            subnet("eth0", 100, &["02:00:00:00:00:02", "garbage"]),
            subnet("eth0", 200, &["02:00:00:00:00:03"]),
            subnet("eth1", 100, &["02:00:00:00:00:04"]),
        ];
        let used = macs_in_use(&link(), &subnets);
        assert_eq!(
            used,
            BTreeSet::from([mac("02:00:00:00:00:01"), mac("02:00:00:00:00:02")])
        );
    }
}
