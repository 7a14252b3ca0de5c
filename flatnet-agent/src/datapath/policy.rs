//! The network-policy side of the data plane: attaching the pod-interface
//! programs, installing compiled tables in the pinned maps, and reading
//! counters and drop events back.
//!
//! The maps are opened through their pins, so the agent and a second
//! process (`flatnet-agent datapath policy show`) see the same state, and a
//! restarted agent continues from what the kernel enforces.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    hash::{DefaultHasher, Hash, Hasher},
    net::IpAddr,
    path::Path,
};

use aya::{
    Ebpf,
    maps::{
        HashMap, LpmTrie, Map, MapData, MapError, PerCpuArray, PerCpuValues, RingBuf, lpm_trie::Key,
    },
    programs::TcAttachType,
};
use flatnet_common::{
    FrameCounter,
    pin::{
        MAP_POLICY_CIDRS, MAP_POLICY_EVENTS, MAP_POLICY_RULE_STATS, MAP_POLICY_STATS,
        MAP_POLICY_SUBJECTS, POLICY_TC_PRIORITY, PROG_POLICY_EGRESS, PROG_POLICY_INGRESS,
    },
    policy::{
        Direction, DropReason, POLICY_RULES_MAX, PolicyAllow, PolicyDropEvent, PolicyLpmData,
        PolicyStat, PolicySubject, PolicySubjectKey, PortMatch,
    },
};
use ipnet::IpNet;
use serde::Serialize;

use super::{
    DatapathError, map_error, map_pin_path,
    tc::{self, AttachMechanism, Slot},
};
use crate::policy_compiler::{CompiledPolicy, RuleRef, tables};

/// The program enforcing `direction`.
pub fn program_name(direction: Direction) -> &'static str {
    match direction {
        Direction::Ingress => PROG_POLICY_INGRESS,
        Direction::Egress => PROG_POLICY_EGRESS,
    }
}

/// Where the program of `direction` sits on a pod interface.
fn slot(direction: Direction) -> Slot {
    let attach_type = match direction {
        Direction::Ingress => TcAttachType::Ingress,
        Direction::Egress => TcAttachType::Egress,
    };
    Slot {
        program: program_name(direction),
        attach_type,
        priority: POLICY_TC_PRIORITY,
    }
}

/// Attaches both policy programs to the pod interface `interface` in the
/// calling thread's network namespace, replacing earlier flatnet policy
/// attachments. The attachments outlive the process.
pub(super) fn attach(
    ebpf: &mut Ebpf,
    pin_root: &Path,
    mechanism: AttachMechanism,
    interface: &str,
) -> Result<(), DatapathError> {
    let slots = [Direction::Ingress, Direction::Egress].map(slot);
    tc::attach_or_replace(ebpf, pin_root, mechanism, interface, &slots)
}

/// Removes flatnet's policy programs from `interface` (calling thread's
/// network namespace; TCX links pinned under `pin_root`). Returns whether
/// anything was attached.
pub fn detach_policy(pin_root: &Path, interface: &str) -> Result<bool, DatapathError> {
    let slots = [Direction::Ingress, Direction::Egress].map(slot);
    tc::detach_all(pin_root, interface, &slots)
}

/// Stable counter ids of policy rules across updates. Keep one per agent;
/// a fresh one (after a restart) gives rules new ids, never ids in use.
#[derive(Clone, Debug, Default)]
pub struct PolicyRuleIds {
    ids: BTreeMap<RuleRef, u32>,
}

impl PolicyRuleIds {
    /// The rule a counter id belongs to, if known.
    pub fn rule(&self, id: u32) -> Option<&RuleRef> {
        self.ids.iter().find(|(_, v)| **v == id).map(|(r, _)| r)
    }
}

/// What an update changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ApplyReport {
    /// LPM entries written (new or changed).
    pub entries_written: usize,
    /// LPM entries removed.
    pub entries_removed: usize,
    /// Subject addresses in the table after the update.
    pub subjects: usize,
    /// Subjects whose policy changed: their tracked flows are judged again.
    pub subjects_rejudged: usize,
}

type LpmMap = LpmTrie<MapData, PolicyLpmData, PolicyAllow>;
type SubjectMap = HashMap<MapData, PolicySubjectKey, PolicySubject>;

/// The policy maps pinned under a pin root.
pub struct PolicyMaps {
    cidrs: LpmMap,
    subjects: SubjectMap,
    rule_stats: PerCpuArray<MapData, FrameCounter>,
    stats: PerCpuArray<MapData, u64>,
}

impl PolicyMaps {
    /// Opens the maps pinned under `pin_root` (by a loaded [`super::Datapath`]).
    pub fn open(pin_root: &Path) -> Result<Self, DatapathError> {
        let pinned = |name: &'static str| {
            MapData::from_pin(map_pin_path(pin_root, name)).map_err(map_error(name))
        };
        Ok(Self {
            cidrs: LpmTrie::try_from(Map::LpmTrie(pinned(MAP_POLICY_CIDRS)?))
                .map_err(map_error(MAP_POLICY_CIDRS))?,
            subjects: HashMap::try_from(Map::HashMap(pinned(MAP_POLICY_SUBJECTS)?))
                .map_err(map_error(MAP_POLICY_SUBJECTS))?,
            rule_stats: PerCpuArray::try_from(Map::PerCpuArray(pinned(MAP_POLICY_RULE_STATS)?))
                .map_err(map_error(MAP_POLICY_RULE_STATS))?,
            stats: PerCpuArray::try_from(Map::PerCpuArray(pinned(MAP_POLICY_STATS)?))
                .map_err(map_error(MAP_POLICY_STATS))?,
        })
    }

    /// Installs `compiled` so that every packet is judged, at every moment
    /// of the update, either by the old or by the new policy, never by a
    /// mix that allows more (or less) than both:
    ///
    /// 1. directions that stop being isolated are released first;
    /// 2. new and changed LPM entries are written longest prefix first, so
    ///    a shorter prefix never carries its new value while a longer new
    ///    prefix below it is still missing;
    /// 3. directions that become isolated are isolated;
    /// 4. stale LPM entries are removed shortest prefix first, so a packet
    ///    falling back from a stale prefix lands on a valid one;
    /// 5. each pod whose policy changed gets its new policy digest, so the
    ///    flows tracked under the old one are judged again by the new
    ///    tables. Until then (steps 1-4) tracked flows keep passing as the
    ///    old policy allowed them.
    ///
    /// Counter ids of rules that stay are kept; new rules get ids no
    /// current entry uses, with zeroed counters.
    pub fn apply(
        &mut self,
        compiled: &CompiledPolicy,
        ids: &mut PolicyRuleIds,
    ) -> Result<ApplyReport, DatapathError> {
        let current = self.lpm_entries()?;
        let current_subjects = self.subject_entries()?;

        // Counter ids.
        let mut in_use: BTreeSet<u32> = current
            .values()
            .flat_map(|allow| active_matches(allow).iter().map(|m| m.rule))
            .collect();
        in_use.extend(ids.ids.values().copied());
        let mut rule_ids = Vec::with_capacity(compiled.rules.len());
        let mut next_free = 0u32;
        for rule in &compiled.rules {
            let id = match ids.ids.get(rule) {
                Some(&id) => id,
                None => {
                    while in_use.contains(&next_free) {
                        next_free += 1;
                    }
                    if next_free >= POLICY_RULES_MAX {
                        return Err(DatapathError::PolicyTooLarge(format!(
                            "more than {POLICY_RULES_MAX} policy rules; remove or merge rules"
                        )));
                    }
                    let id = next_free;
                    in_use.insert(id);
                    self.zero_rule_counter(id)?;
                    ids.ids.insert(rule.clone(), id);
                    id
                }
            };
            rule_ids.push(id);
        }

        // Desired state.
        let mut desired: BTreeMap<(u32, PolicyLpmData), PolicyAllow> = BTreeMap::new();
        let mut desired_subjects: BTreeMap<PolicySubjectKey, u32> = BTreeMap::new();
        for (&addr, subject) in &compiled.subjects {
            let mut isolated = 0;
            for direction in [Direction::Ingress, Direction::Egress] {
                let Some(table) = subject.table(direction) else {
                    continue;
                };
                isolated |= direction.bit();
                for (&remote, specs) in &table.entries {
                    let key = tables::lpm_key(direction, addr, remote);
                    desired.insert(key, tables::encode_allow(specs, |rule| rule_ids[rule]));
                }
            }
            if isolated != 0 {
                desired_subjects.insert(
                    PolicySubjectKey {
                        addr: tables::mapped(addr),
                    },
                    isolated,
                );
            }
        }
        let digests = policy_digests(&desired, &desired_subjects);
        if desired.len() > flatnet_common::policy::POLICY_CIDRS_MAX_ENTRIES as usize {
            return Err(DatapathError::PolicyTooLarge(format!(
                "{} prefix entries exceed the map capacity of {}; simplify the policies",
                desired.len(),
                flatnet_common::policy::POLICY_CIDRS_MAX_ENTRIES
            )));
        }

        // The digest in force until step 5.
        let old_digest =
            |key: &PolicySubjectKey| current_subjects.get(key).map_or(0, |s| s.policy_digest);

        // 1. Release directions that stop being isolated.
        for (key, old) in &current_subjects {
            let new = desired_subjects.get(key).copied().unwrap_or(0);
            if old.isolated & new != old.isolated {
                self.set_subject(key, old.isolated & new, old.policy_digest)?;
            }
        }
        // 2. Write entries, longest prefix first.
        let mut report = ApplyReport::default();
        let mut writes: Vec<_> = desired
            .iter()
            .filter(|(key, allow)| current.get(key) != Some(allow))
            .collect();
        writes.sort_by_key(|((len, _), _)| std::cmp::Reverse(*len));
        for ((len, data), allow) in writes {
            self.cidrs
                .insert(&Key::new(*len, *data), allow, 0)
                .map_err(map_error(MAP_POLICY_CIDRS))?;
            report.entries_written += 1;
        }
        // 3. Isolate.
        for (key, &new) in &desired_subjects {
            let old = current_subjects.get(key).map_or(0, |s| s.isolated);
            if old & new != new {
                self.set_subject(key, new, old_digest(key))?;
            }
        }
        // 4. Remove stale entries, shortest prefix first.
        let mut stale: Vec<_> = current
            .keys()
            .filter(|k| !desired.contains_key(k))
            .collect();
        stale.sort_by_key(|(len, _)| *len);
        for (len, data) in stale {
            match self.cidrs.remove(&Key::new(*len, *data)) {
                Ok(()) | Err(MapError::KeyNotFound) => report.entries_removed += 1,
                Err(e) => return Err(map_error(MAP_POLICY_CIDRS)(e)),
            }
        }
        for key in current_subjects.keys() {
            if !desired_subjects.contains_key(key) {
                match self.subjects.remove(key) {
                    Ok(()) | Err(MapError::KeyNotFound) => {}
                    Err(e) => return Err(map_error(MAP_POLICY_SUBJECTS)(e)),
                }
            }
        }
        // 5. New digests.
        for (key, &isolated) in &desired_subjects {
            let digest = digests[key];
            let current = current_subjects.get(key);
            if current.map(|s| (s.isolated, s.policy_digest)) != Some((isolated, digest)) {
                self.set_subject(key, isolated, digest)?;
                report.subjects_rejudged += 1;
            }
        }
        let live: BTreeSet<&RuleRef> = compiled.rules.iter().collect();
        ids.ids.retain(|rule, _| live.contains(rule));
        report.subjects = desired_subjects.len();
        Ok(report)
    }

    fn set_subject(
        &mut self,
        key: &PolicySubjectKey,
        isolated: u32,
        policy_digest: u64,
    ) -> Result<(), DatapathError> {
        let subject = PolicySubject {
            isolated,
            reserved: 0,
            policy_digest,
        };
        self.subjects
            .insert(key, subject, 0)
            .map_err(map_error(MAP_POLICY_SUBJECTS))
    }

    fn zero_rule_counter(&mut self, id: u32) -> Result<(), DatapathError> {
        let cpus = aya::util::nr_cpus().map_err(|(_, e)| DatapathError::Io(e))?;
        let zeros = PerCpuValues::try_from(vec![FrameCounter::default(); cpus])
            .map_err(|e| DatapathError::Io(std::io::Error::other(e)))?;
        self.rule_stats
            .set(id, zeros, 0)
            .map_err(map_error(MAP_POLICY_RULE_STATS))
    }

    fn lpm_entries(&self) -> Result<BTreeMap<(u32, PolicyLpmData), PolicyAllow>, DatapathError> {
        let mut out = BTreeMap::new();
        for item in self.cidrs.iter() {
            let (key, value) = item.map_err(map_error(MAP_POLICY_CIDRS))?;
            out.insert((key.prefix_len(), key.data()), value);
        }
        Ok(out)
    }

    fn subject_entries(&self) -> Result<BTreeMap<PolicySubjectKey, PolicySubject>, DatapathError> {
        let mut out = BTreeMap::new();
        for item in self.subjects.iter() {
            let (key, value) = item.map_err(map_error(MAP_POLICY_SUBJECTS))?;
            out.insert(key, value);
        }
        Ok(out)
    }

    /// The installed tables with per-rule counters, for inspection.
    pub fn installed(&self) -> Result<InstalledPolicy, DatapathError> {
        let mut subjects = Vec::new();
        for (key, subject) in self.subject_entries()? {
            let addr = tables::unmapped(key.addr);
            let directions = [Direction::Ingress, Direction::Egress]
                .into_iter()
                .filter(|&d| subject.is_isolated(d))
                .map(|d| d.name())
                .collect();
            subjects.push(InstalledSubject {
                addr,
                isolated: directions,
                policy_digest: format!("{:016x}", subject.policy_digest),
            });
        }
        let mut entries = Vec::new();
        for ((len, data), allow) in self.lpm_entries()? {
            let Some((direction, subject, remote)) = tables::lpm_key_parts(len, &data) else {
                continue;
            };
            let mut matches = Vec::new();
            for m in active_matches(&allow) {
                matches.push(InstalledMatch {
                    rule_id: m.rule,
                    protocol: protocol_name(m),
                    ports: format!("{}-{}", m.port_min, m.port_max),
                    counter: self.rule_counter(m.rule)?,
                });
            }
            entries.push(InstalledEntry {
                subject,
                direction: direction.name(),
                remote,
                matches,
            });
        }
        Ok(InstalledPolicy { subjects, entries })
    }

    /// Packets and bytes allowed by the rule with counter `id`, summed over CPUs.
    pub fn rule_counter(&self, id: u32) -> Result<Counter, DatapathError> {
        let values = self
            .rule_stats
            .get(&id, 0)
            .map_err(map_error(MAP_POLICY_RULE_STATS))?;
        let sum = values
            .iter()
            .fold(FrameCounter::default(), |acc, c| acc.merged(*c));
        Ok(Counter {
            packets: sum.packets,
            bytes: sum.bytes,
        })
    }

    /// The programs' verdict counters, summed over CPUs.
    pub fn stats(&self) -> Result<PolicyStats, DatapathError> {
        let mut out = BTreeMap::new();
        for stat in PolicyStat::ALL {
            let values = self
                .stats
                .get(&(stat as u32), 0)
                .map_err(map_error(MAP_POLICY_STATS))?;
            out.insert(stat.name(), values.iter().sum());
        }
        Ok(PolicyStats(out))
    }
}

/// The policy digest of each subject: a hash of its isolated directions and
/// of all its LPM entries (prefixes, port matches and rule counter ids), so
/// it changes exactly when what decides the subject's packets changes. It is
/// the same in every agent process of one build, so a restarted agent with
/// the same policies keeps the tracked flows; never 0 (0 means "no entry").
fn policy_digests(
    desired: &BTreeMap<(u32, PolicyLpmData), PolicyAllow>,
    desired_subjects: &BTreeMap<PolicySubjectKey, u32>,
) -> BTreeMap<PolicySubjectKey, u64> {
    let mut hashers: BTreeMap<PolicySubjectKey, DefaultHasher> = desired_subjects
        .iter()
        .map(|(key, isolated)| {
            let mut hasher = DefaultHasher::new();
            isolated.hash(&mut hasher);
            (*key, hasher)
        })
        .collect();
    // BTreeMap order: each subject's entries are hashed in one fixed order.
    for (entry, allow) in desired {
        let key = PolicySubjectKey {
            addr: entry.1.subject,
        };
        if let Some(hasher) = hashers.get_mut(&key) {
            (entry, allow).hash(hasher);
        }
    }
    hashers
        .into_iter()
        .map(|(key, hasher)| (key, hasher.finish().max(1)))
        .collect()
}

fn active_matches(allow: &PolicyAllow) -> &[PortMatch] {
    &allow.matches[..(allow.count as usize).min(allow.matches.len())]
}

fn protocol_name(m: &PortMatch) -> String {
    use flatnet_common::policy::proto;
    match m.protocol {
        PortMatch::ANY_PROTOCOL => "any".into(),
        proto::TCP => "tcp".into(),
        proto::UDP => "udp".into(),
        proto::SCTP => "sctp".into(),
        other => other.to_string(),
    }
}

/// Packets and bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Counter {
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}

/// Verdict counters by [`PolicyStat::name`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PolicyStats(pub BTreeMap<&'static str, u64>);

impl PolicyStats {
    /// The value of one stat.
    pub fn get(&self, stat: PolicyStat) -> u64 {
        self.0.get(stat.name()).copied().unwrap_or(0)
    }
}

/// The installed policy state, as `datapath policy show` prints it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct InstalledPolicy {
    /// Pod addresses with at least one isolated direction.
    pub subjects: Vec<InstalledSubject>,
    /// Every LPM entry.
    pub entries: Vec<InstalledEntry>,
}

/// A pod address and its isolated directions.
#[derive(Clone, Debug, Serialize)]
pub struct InstalledSubject {
    /// The address.
    pub addr: IpAddr,
    /// `ingress` and/or `egress`.
    pub isolated: Vec<&'static str>,
    /// The policy digest (hex) tracked flows of this address were allowed
    /// under; it changes whenever the address's policy changes.
    pub policy_digest: String,
}

/// One LPM entry.
#[derive(Clone, Debug, Serialize)]
pub struct InstalledEntry {
    /// Pod address.
    pub subject: IpAddr,
    /// `ingress` or `egress`.
    pub direction: &'static str,
    /// Remote prefix.
    #[serde(serialize_with = "serialize_net")]
    pub remote: IpNet,
    /// What it allows; empty means nothing (an `except` hole).
    pub matches: Vec<InstalledMatch>,
}

/// One port match of an entry with its rule's counter.
#[derive(Clone, Debug, Serialize)]
pub struct InstalledMatch {
    /// Counter id of the rule.
    pub rule_id: u32,
    /// `any`, `tcp`, `udp`, `sctp`.
    pub protocol: String,
    /// `first-last`.
    pub ports: String,
    /// Traffic the rule allowed (across all entries it appears in).
    pub counter: Counter,
}

fn serialize_net<S: serde::Serializer>(net: &IpNet, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&net.to_string())
}

/// One dropped packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PolicyDrop {
    /// Direction.
    #[serde(serialize_with = "serialize_direction")]
    pub direction: Direction,
    /// Why.
    #[serde(serialize_with = "serialize_reason")]
    pub reason: DropReason,
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// Source port (0 when none).
    pub src_port: u16,
    /// Destination port (0 when none).
    pub dst_port: u16,
    /// IP protocol number.
    pub protocol: u8,
    /// Frame length.
    pub len: u32,
}

impl fmt::Display for PolicyDrop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} drop ({}): {}:{} -> {}:{} protocol {} ({} bytes)",
            self.direction.name(),
            self.reason.name(),
            self.src,
            self.src_port,
            self.dst,
            self.dst_port,
            self.protocol,
            self.len
        )
    }
}

fn serialize_direction<S: serde::Serializer>(d: &Direction, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

fn serialize_reason<S: serde::Serializer>(r: &DropReason, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(r.name())
}

/// The drop events of the policy programs, read from the pinned ring buffer.
pub struct PolicyDrops {
    ring: RingBuf<MapData>,
}

impl PolicyDrops {
    /// Opens the ring buffer pinned under `pin_root`. Only one reader
    /// should consume it at a time.
    pub fn open(pin_root: &Path) -> Result<Self, DatapathError> {
        let data = MapData::from_pin(map_pin_path(pin_root, MAP_POLICY_EVENTS))
            .map_err(map_error(MAP_POLICY_EVENTS))?;
        Ok(Self {
            ring: RingBuf::try_from(Map::RingBuf(data)).map_err(map_error(MAP_POLICY_EVENTS))?,
        })
    }

    /// The next drop already in the ring buffer, without waiting.
    pub fn try_next(&mut self) -> Option<PolicyDrop> {
        while let Some(item) = self.ring.next() {
            if item.len() < std::mem::size_of::<PolicyDropEvent>() {
                continue;
            }
            // SAFETY: the kernel wrote a whole PolicyDropEvent (checked length).
            let event =
                unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<PolicyDropEvent>()) };
            let direction = match event.direction {
                0 => Direction::Ingress,
                1 => Direction::Egress,
                _ => continue,
            };
            let Some(reason) = DropReason::from_u8(event.reason) else {
                continue;
            };
            return Some(PolicyDrop {
                direction,
                reason,
                src: tables::unmapped(event.src),
                dst: tables::unmapped(event.dst),
                src_port: event.src_port,
                dst_port: event.dst_port,
                protocol: event.protocol,
                len: event.len,
            });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use flatnet_common::policy::{PortMatch, proto};

    use super::*;

    fn subject(addr: &str) -> PolicySubjectKey {
        PolicySubjectKey {
            addr: tables::mapped(addr.parse().unwrap()),
        }
    }

    fn allow(port: u16) -> PolicyAllow {
        let mut allow = PolicyAllow::default();
        allow.matches[0] = PortMatch {
            rule: 0,
            protocol: proto::TCP,
            port_min: port,
            port_max: port,
            ..PortMatch::default()
        };
        allow.count = 1;
        allow
    }

    /// Two isolated pods, each with one ingress entry.
    fn tables(
        port_a: u16,
        port_b: u16,
    ) -> (
        BTreeMap<(u32, PolicyLpmData), PolicyAllow>,
        BTreeMap<PolicySubjectKey, u32>,
    ) {
        let remote = "192.168.0.0/16".parse().unwrap();
        let entry = |pod: &str| tables::lpm_key(Direction::Ingress, pod.parse().unwrap(), remote);
        let desired = BTreeMap::from([
            (entry("10.0.0.1"), allow(port_a)),
            (entry("10.0.0.2"), allow(port_b)),
        ]);
        let subjects = BTreeMap::from([
            (subject("10.0.0.1"), Direction::Ingress.bit()),
            (subject("10.0.0.2"), Direction::Ingress.bit()),
        ]);
        (desired, subjects)
    }

    #[test]
    fn digests_change_only_for_the_pod_whose_policy_changed() {
        let (desired, subjects) = tables(80, 80);
        let before = policy_digests(&desired, &subjects);
        assert_eq!(before, policy_digests(&desired, &subjects), "deterministic");
        assert_ne!(
            before[&subject("10.0.0.1")],
            before[&subject("10.0.0.2")],
            "the subject's own entries are hashed"
        );

        let (desired, subjects) = tables(80, 443);
        let after = policy_digests(&desired, &subjects);
        assert_eq!(after[&subject("10.0.0.1")], before[&subject("10.0.0.1")]);
        assert_ne!(after[&subject("10.0.0.2")], before[&subject("10.0.0.2")]);
    }

    #[test]
    fn digests_cover_isolation_and_are_never_zero() {
        let (desired, mut subjects) = tables(80, 80);
        let before = policy_digests(&desired, &subjects);
        subjects.insert(
            subject("10.0.0.1"),
            Direction::Ingress.bit() | Direction::Egress.bit(),
        );
        let after = policy_digests(&desired, &subjects);
        assert_ne!(after[&subject("10.0.0.1")], before[&subject("10.0.0.1")]);

        // Isolated without any entry (deny all) still has a digest.
        let lone = BTreeMap::from([(subject("10.0.0.9"), Direction::Egress.bit())]);
        let digests = policy_digests(&BTreeMap::new(), &lone);
        assert_ne!(digests[&subject("10.0.0.9")], 0);
    }
}
