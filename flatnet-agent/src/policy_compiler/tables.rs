//! The compiled policy: what the kernel maps hold, in user-space form.

use std::{
    collections::BTreeMap,
    fmt,
    net::{IpAddr, Ipv6Addr},
};

use flatnet_common::policy::{
    Direction, LPM_FIXED_BITS, MAX_PORT_MATCHES, PolicyAllow, PolicyLpmData, PortMatch,
};
use ipnet::IpNet;
use serde::Serialize;

/// A rule of a MultiNetworkPolicy: `<namespace>/<name> <direction>[<index>]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct RuleRef {
    /// Namespace of the policy.
    pub namespace: String,
    /// Name of the policy.
    pub policy: String,
    /// `ingress` or `egress`.
    #[serde(serialize_with = "serialize_direction")]
    pub direction: Direction,
    /// Index of the rule in the policy's list for that direction.
    pub index: usize,
}

impl RuleRef {
    /// (`namespace`, `name`) of the rule's policy.
    pub fn policy_key(&self) -> (String, String) {
        (self.namespace.clone(), self.policy.clone())
    }
}

impl fmt::Display for RuleRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{} {}[{}]",
            self.namespace,
            self.policy,
            self.direction.name(),
            self.index
        )
    }
}

/// Which protocol a port spec matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProtocolMatch {
    /// Every packet (the rule lists no ports).
    Any,
    /// One IP protocol (TCP, UDP or SCTP) and a port range.
    Ip(u8),
}

/// One allowed protocol and destination-port range, and the rule allowing it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct PortSpec {
    /// Protocol.
    pub protocol: ProtocolMatch,
    /// First port.
    pub port_min: u16,
    /// Last port, inclusive.
    pub port_max: u16,
    /// Index into [`CompiledPolicy::rules`].
    pub rule: usize,
}

impl PortSpec {
    /// Everything, allowed by `rule`.
    pub fn any(rule: usize) -> Self {
        Self {
            protocol: ProtocolMatch::Any,
            port_min: 0,
            port_max: u16::MAX,
            rule,
        }
    }

    /// The kernel form, with `rule_id` as the counter index.
    pub fn to_port_match(&self, rule_id: u32) -> PortMatch {
        PortMatch {
            rule: rule_id,
            protocol: match self.protocol {
                ProtocolMatch::Any => PortMatch::ANY_PROTOCOL,
                ProtocolMatch::Ip(p) => p,
            },
            reserved: 0,
            port_min: self.port_min,
            port_max: self.port_max,
            reserved2: 0,
        }
    }
}

/// What one pod address may exchange in one isolated direction: remote
/// prefixes and what each allows. Longest-prefix match decides; every
/// prefix already holds the union of the rules that cover it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DirectionTable {
    /// Remote prefix → allowed port specs (at most [`MAX_PORT_MATCHES`]).
    #[serde(serialize_with = "serialize_entries")]
    pub entries: BTreeMap<IpNet, Vec<PortSpec>>,
}

impl DirectionTable {
    /// The port specs of the longest prefix containing `remote`.
    pub fn longest_match(&self, remote: IpAddr) -> Option<&[PortSpec]> {
        let max_len = match remote {
            IpAddr::V4(_) => 32,
            IpAddr::V6(_) => 128,
        };
        (0..=max_len).rev().find_map(|len| {
            let net = IpNet::new(remote, len).ok()?.trunc();
            self.entries.get(&net).map(Vec::as_slice)
        })
    }

    /// Whether the table allows a packet, evaluated exactly as the kernel
    /// does (through [`PolicyAllow::first_match`]). Returns the rule index.
    pub fn allows(&self, remote: IpAddr, protocol: u8, port: Option<u16>) -> Option<usize> {
        let specs = self.longest_match(remote)?;
        let allow = encode_allow(specs, |rule| rule as u32);
        allow
            .first_match(protocol, port)
            .map(|rule_id| rule_id as usize)
    }
}

/// The kernel value for a prefix; `rule_id` maps rule indexes to counter ids.
pub fn encode_allow(specs: &[PortSpec], rule_id: impl Fn(usize) -> u32) -> PolicyAllow {
    let mut allow = PolicyAllow::default();
    for (slot, spec) in allow.matches.iter_mut().zip(specs) {
        *slot = spec.to_port_match(rule_id(spec.rule));
    }
    allow.count = specs.len().min(MAX_PORT_MATCHES) as u32;
    allow
}

/// The kernel LPM key data and prefix length for `remote` under `subject`.
pub fn lpm_key(direction: Direction, subject: IpAddr, remote: IpNet) -> (u32, PolicyLpmData) {
    let remote_bits = match remote {
        IpNet::V4(v4) => 96 + u32::from(v4.prefix_len()),
        IpNet::V6(v6) => u32::from(v6.prefix_len()),
    };
    let data = PolicyLpmData {
        direction: direction as u32,
        subject: mapped(subject),
        remote: mapped(remote.network()),
    };
    (LPM_FIXED_BITS + remote_bits, data)
}

/// The inverse of [`lpm_key`]: `(direction, subject, remote prefix)`.
pub fn lpm_key_parts(prefix_len: u32, data: &PolicyLpmData) -> Option<(Direction, IpAddr, IpNet)> {
    let direction = match data.direction {
        0 => Direction::Ingress,
        1 => Direction::Egress,
        _ => return None,
    };
    let subject = unmapped(data.subject);
    let remote_bits = prefix_len.checked_sub(LPM_FIXED_BITS)?;
    let remote = match unmapped(data.remote) {
        IpAddr::V4(v4) => IpNet::new(
            IpAddr::V4(v4),
            u8::try_from(remote_bits.checked_sub(96)?).ok()?,
        ),
        IpAddr::V6(v6) => IpNet::new(IpAddr::V6(v6), u8::try_from(remote_bits).ok()?),
    }
    .ok()?;
    Some((direction, subject, remote))
}

/// The 16-byte form the maps use (IPv4-mapped for IPv4).
pub fn mapped(addr: IpAddr) -> [u8; 16] {
    match addr {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// The inverse of [`mapped`].
pub fn unmapped(addr: [u8; 16]) -> IpAddr {
    let v6 = Ipv6Addr::from(addr);
    v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4)
}

/// The tables of one pod address.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SubjectTables {
    /// `namespace/name` of the pod.
    pub pod: String,
    /// Ingress table; `None` when ingress is not isolated.
    pub ingress: Option<DirectionTable>,
    /// Egress table; `None` when egress is not isolated.
    pub egress: Option<DirectionTable>,
}

impl SubjectTables {
    /// The table of `direction`, `None` when it is not isolated.
    pub fn table(&self, direction: Direction) -> Option<&DirectionTable> {
        match direction {
            Direction::Ingress => self.ingress.as_ref(),
            Direction::Egress => self.egress.as_ref(),
        }
    }
}

/// Something in the policies flatnet cannot enforce as written. Each names
/// the object and how the traffic is treated, so users can fix it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Diagnostic {
    /// `namespace/name` of the policy (or pod).
    pub object: String,
    /// The policy the diagnostic is about (`namespace`, `name`); `None`
    /// when it concerns a pod (several policies together).
    pub policy: Option<(String, String)>,
    /// What is wrong, how it is enforced and the fix.
    pub message: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.message)
    }
}

/// Everything the kernel needs for the local pods.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct CompiledPolicy {
    /// Every policy rule, indexed by [`PortSpec::rule`].
    pub rules: Vec<RuleRef>,
    /// Per local pod address.
    pub subjects: BTreeMap<IpAddr, SubjectTables>,
    /// Parts of the policies enforced differently from what they say.
    pub diagnostics: Vec<Diagnostic>,
}

impl CompiledPolicy {
    /// Whether the compiled tables allow a packet in `direction` for the
    /// local pod address `subject` from/to `remote`.
    pub fn allows(
        &self,
        direction: Direction,
        subject: IpAddr,
        remote: IpAddr,
        protocol: u8,
        port: Option<u16>,
    ) -> bool {
        match self.subjects.get(&subject).and_then(|s| s.table(direction)) {
            None => true,
            Some(table) => table.allows(remote, protocol, port).is_some(),
        }
    }

    /// Number of LPM entries the tables need.
    pub fn entry_count(&self) -> usize {
        self.subjects
            .values()
            .flat_map(|s| [s.ingress.as_ref(), s.egress.as_ref()])
            .flatten()
            .map(|t| t.entries.len())
            .sum()
    }
}

fn serialize_entries<S: serde::Serializer>(
    entries: &BTreeMap<IpNet, Vec<PortSpec>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    s.collect_map(entries.iter().map(|(net, specs)| (net.to_string(), specs)))
}

fn serialize_direction<S: serde::Serializer>(d: &Direction, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lpm_keys_round_trip() {
        for (subject, remote) in [
            ("10.0.0.5", "10.1.0.0/16"),
            ("10.0.0.5", "0.0.0.0/0"),
            ("fd00::5", "fd00:1::/64"),
            ("fd00::5", "::/0"),
        ] {
            let subject: IpAddr = subject.parse().unwrap();
            let remote: IpNet = remote.parse().unwrap();
            let (len, data) = lpm_key(Direction::Egress, subject, remote);
            assert_eq!(
                lpm_key_parts(len, &data),
                Some((Direction::Egress, subject, remote))
            );
        }
        let (len, _) = lpm_key(
            Direction::Ingress,
            "10.0.0.1".parse().unwrap(),
            "10.0.0.0/8".parse().unwrap(),
        );
        assert_eq!(len, 32 + 128 + 96 + 8);
    }

    #[test]
    fn longest_match_decides() {
        let mut table = DirectionTable::default();
        table
            .entries
            .insert("10.0.0.0/8".parse().unwrap(), vec![PortSpec::any(0)]);
        table.entries.insert("10.1.0.0/16".parse().unwrap(), vec![]);
        assert_eq!(
            table.allows("10.2.0.1".parse().unwrap(), 6, Some(80)),
            Some(0)
        );
        assert_eq!(table.allows("10.1.0.1".parse().unwrap(), 6, Some(80)), None);
        assert_eq!(table.allows("11.0.0.1".parse().unwrap(), 6, Some(80)), None);
    }
}
