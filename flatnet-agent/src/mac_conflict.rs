//! MAC conflicts: frames on this node's uplinks whose MAC is one flatnet
//! handed to a pod (from the MAC pool, or a fixed MAC the pod asked for)
//! where that pod cannot have sent them.
//!
//! Pods with flatnet MACs on other nodes send frames over the LAN all the
//! time, so a sighting of such a MAC alone says nothing. The uplink
//! program's wire inventory records, per address, the MAC last seen
//! claiming it (ARP and NDP). A sighting of the MAC `M` of a live
//! FlatNetworkIP is a **MAC conflict** when:
//!
//! - [`MacConflictKind::OtherAddress`]: `M` claims an address that no live
//!   record naming `M` holds (nor the 6to4 address of one of them, nor an
//!   address of a FloatingIPPool, which pods announce from their own MACs,
//!   nor the IPv6 address autoconfiguration forms from `M`);
//! - [`MacConflictKind::PodOnThisNode`]: `M` arrives from the wire on this
//!   node, where the pod with `M` is attached: its own frames leave through
//!   the uplink and never come back in (except in VEPA mode, where the
//!   switch reflects them; those subnets are left out).
//!
//! Only sightings after the record was allocated count (the inventory
//! keeps claims for a day, and a MAC freed long ago may have had another
//! holder). Every new sighting is counted in
//! `flatnet_agent_mac_conflicts_total{reason}` by every node that sees it;
//! one node reports it ([`reported_by`]): the record gets a Warning Event
//! `MACConflict` and the condition `MACConflict` at most once per (record,
//! claimed address) per [`REPORT_INTERVAL`], and the condition goes back
//! to `False` once that node has seen no conflict on the record for
//! [`CLEAR_AFTER`].

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    fmt,
    net::IpAddr,
    time::Duration,
};

use flatnet_k8s::{
    api::{CONDITION_MAC_CONFLICT, FlatNetworkIP, FloatingIPPool},
    events::EventRecorder,
    ipam::six_to_four,
};
use ipnet::IpNet;
use k8s_openapi::{
    api::core::v1::ObjectReference,
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{Patch, PatchParams},
    runtime::events::{Event, EventType, Reporter},
};
use prometheus_client::metrics::{counter::Counter, family::Family};
use serde_json::json;
use tokio::time::Instant;

use flatnet_common::wire::WireKind;

use crate::{
    datapath::{WireClaimEntry, format_mac},
    link::parse_mac,
    records::{AttachmentRecord, RecordPhase},
};

/// How often the inventory (at most 32 Ki entries) is read for conflicts.
pub const SCAN_INTERVAL: Duration = Duration::from_secs(10);

/// Least time between two reports (Event and condition) of one claimed
/// address on one record: a rogue host that keeps talking costs two API
/// writes per interval, however many frames it sends.
pub const REPORT_INTERVAL: Duration = Duration::from_secs(600);

/// How long after this node last saw a conflict on a record it sets the
/// record's condition back to `False`.
pub const CLEAR_AFTER: Duration = Duration::from_secs(3600);

/// Field manager of the `MACConflict` condition (its own: an apply of the
/// condition alone under another manager would drop that manager's fields).
pub const FIELD_MANAGER: &str = "flatnet-agent-mac-conflict";

/// Event and condition reason.
pub const REASON: &str = "MACConflict";

/// Why a sighting is a conflict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MacConflictKind {
    /// The MAC claimed an address its records do not hold.
    OtherAddress,
    /// The MAC came in from the wire on the node its pod is attached to.
    PodOnThisNode,
}

impl MacConflictKind {
    /// The metric label and log name.
    pub const fn name(self) -> &'static str {
        match self {
            Self::OtherAddress => "other_address",
            Self::PodOnThisNode => "pod_on_this_node",
        }
    }

    const fn explanation(self) -> &'static str {
        match self {
            Self::OtherAddress => "an address none of its FlatNetworkIPs holds",
            Self::PodOnThisNode => {
                "its own address, arriving from the LAN on the node its pod is attached to"
            }
        }
    }
}

/// A FlatNetworkIP, by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RecordName {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

impl fmt::Display for RecordName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A live record holding a flatnet MAC.
#[derive(Clone, Debug, PartialEq)]
struct Holder {
    record: RecordName,
    addr: IpAddr,
    /// When the record got its address and MAC.
    allocated_at: Option<Timestamp>,
    /// The node its pod is attached to (empty before).
    node: String,
}

/// The live records that hold a flatnet MAC (a pool MAC or a fixed MAC:
/// kernel-chosen MACs are left out, ipvlan pods' are the node's own), by MAC.
#[derive(Clone, Debug, Default)]
pub struct MacHolders {
    by_mac: HashMap<[u8; 6], Vec<Holder>>,
}

impl MacHolders {
    /// The holders among `records`: not being deleted, with an address and
    /// a ledgered MAC, or the MAC another such record ledgers (the second
    /// record of a dual-stack pod names its interface's MAC, which the
    /// first record holds in the ledger).
    pub fn new<'a>(records: impl IntoIterator<Item = &'a FlatNetworkIP> + Clone) -> Self {
        let live = |record: &&FlatNetworkIP| record.metadata.deletion_timestamp.is_none();
        let ledgered: BTreeSet<[u8; 6]> = records
            .clone()
            .into_iter()
            .filter(live)
            .filter_map(|r| r.ledgered_mac().and_then(parse_mac))
            .collect();
        let mut by_mac: HashMap<[u8; 6], Vec<Holder>> = HashMap::new();
        for record in records.into_iter().filter(live) {
            let Some(status) = record.status.as_ref() else {
                continue;
            };
            let (Some(mac), Some(addr)) = (parse_mac(&status.mac), status.addr) else {
                continue;
            };
            if !ledgered.contains(&mac) {
                continue;
            }
            by_mac.entry(mac).or_default().push(Holder {
                record: RecordName {
                    namespace: record.namespace().unwrap_or_default(),
                    name: record.name_any(),
                },
                addr,
                allocated_at: status.allocated_time_stamp.as_ref().map(|t| t.0),
                node: status.node.clone(),
            });
        }
        for holders in by_mac.values_mut() {
            holders.sort_by(|a, b| a.record.cmp(&b.record));
        }
        Self { by_mac }
    }

    /// Whether no record holds a flatnet MAC.
    pub fn is_empty(&self) -> bool {
        self.by_mac.is_empty()
    }
}

/// What this node knows of its own pods: its name, the flatnet MACs
/// attached here (on subnets not in VEPA mode) and its uplinks' names.
#[derive(Clone, Debug, Default)]
pub struct LocalPods {
    node: String,
    macs: BTreeSet<[u8; 6]>,
    uplinks: BTreeMap<u32, String>,
}

impl LocalPods {
    /// From the attachment records of `node`.
    pub fn new<'a>(node: &str, records: impl IntoIterator<Item = &'a AttachmentRecord>) -> Self {
        let mut local = Self {
            node: node.to_owned(),
            ..Self::default()
        };
        for record in records {
            if let Some(uplink) = &record.uplink {
                local.uplinks.insert(uplink.ifindex, uplink.ifname.clone());
            }
            // A VEPA switch sends the pod's own frames back in.
            let reflected = record
                .subnets
                .iter()
                .any(|s| s.spec.mode.eq_ignore_ascii_case("vepa"));
            if record.phase != RecordPhase::Ready || reflected {
                continue;
            }
            if let Some(mac) = record.mac.as_deref().and_then(parse_mac) {
                local.macs.insert(mac);
            }
        }
        local
    }

    /// The name of uplink `ifindex`, else `ifindex <n>`.
    pub fn uplink_name(&self, ifindex: u32) -> String {
        self.uplinks
            .get(&ifindex)
            .cloned()
            .unwrap_or_else(|| format!("ifindex {ifindex}"))
    }
}

/// The networks of the FloatingIPPools: pods holding a floating address
/// announce it from their own MAC.
#[derive(Clone, Debug, Default)]
pub struct FloatingNetworks(Vec<IpNet>);

impl FloatingNetworks {
    /// The CIDRs of `pools` (unparsable ones are the webhook's business).
    pub fn new<'a>(pools: impl IntoIterator<Item = &'a FloatingIPPool>) -> Self {
        Self(
            pools
                .into_iter()
                .flat_map(|p| p.spec.cidrs.iter())
                .filter_map(|c| c.trim().parse::<IpNet>().ok())
                .collect(),
        )
    }

    fn contains(&self, addr: IpAddr) -> bool {
        self.0.iter().any(|n| n.contains(&addr))
    }
}

/// One conflicting sighting.
#[derive(Clone, Debug, PartialEq)]
pub struct MacConflict {
    /// The record the report goes to.
    pub record: RecordName,
    /// Why it is a conflict.
    pub kind: MacConflictKind,
    /// The record's MAC.
    pub mac: [u8; 6],
    /// The address the frame claimed.
    pub addr: IpAddr,
    /// The frame's kind (`arp_reply`, ...).
    pub frame: &'static str,
    /// The uplink it arrived on.
    pub ifindex: u32,
    /// Its VLAN tag (0: none).
    pub vlan: u16,
    /// Monotonic time of the sighting.
    pub last_seen_ns: u64,
    /// Whether this node reports it to the API server (every node counts
    /// it): see [`reported_by`].
    pub reported_here: bool,
}

/// Whether the node `local` reports (Event, condition) a conflict on the
/// record of `holder` seen in a `frame`: the node of the record's pod (any
/// node while the pod is attached nowhere) reports frames that reach every
/// node (broadcast ARP, multicast NDP); frames sent to one host (ARP
/// replies, neighbour advertisements, which may be unicast) are reported
/// by the node that saw them. So one rogue broadcast costs one node's
/// writes, not every node's.
fn reported_by(local: &LocalPods, holder: &Holder, frame: Option<WireKind>) -> bool {
    let directed = matches!(
        frame,
        Some(WireKind::ArpReply | WireKind::NeighborAdvertisement)
    );
    directed || holder.node.is_empty() || holder.node == local.node
}

/// Whether `claim`, seen at wall time `seen_at`, is a MAC conflict, and on
/// which record. A claim of an address one holder of the MAC holds goes to
/// that holder; otherwise to the holder of the same address family (the
/// dual-stack pod's record of that family), else the first.
pub fn classify(
    claim: &WireClaimEntry,
    seen_at: Timestamp,
    holders: &MacHolders,
    local: &LocalPods,
    floating: &FloatingNetworks,
) -> Option<MacConflict> {
    let holders: Vec<&Holder> = holders
        .by_mac
        .get(&claim.mac)?
        .iter()
        // Before the allocation the MAC may have been another record's.
        .filter(|h| h.allocated_at.is_none_or(|at| at <= seen_at))
        .collect();
    let own = holders.iter().find(|h| holds(h, claim.addr));
    let (kind, holder) = match own {
        Some(holder) if local.macs.contains(&claim.mac) => {
            (MacConflictKind::PodOnThisNode, *holder)
        }
        Some(_) => return None,
        None if floating.contains(claim.addr) || is_slaac_of(claim.addr, claim.mac) => {
            return None;
        }
        None => {
            let target = holders
                .iter()
                .find(|h| h.addr.is_ipv4() == claim.addr.is_ipv4())
                .or(holders.first())?;
            (MacConflictKind::OtherAddress, *target)
        }
    };
    Some(MacConflict {
        record: holder.record.clone(),
        reported_here: reported_by(local, holder, claim.kind),
        kind,
        mac: claim.mac,
        addr: claim.addr,
        frame: claim.kind.map_or("unknown", |k| k.name()),
        ifindex: claim.ifindex,
        vlan: claim.vlan,
        last_seen_ns: claim.last_seen_ns,
    })
}

/// Whether the holder's pod has `addr`: its address, or its 6to4 address.
fn holds(holder: &Holder, addr: IpAddr) -> bool {
    if holder.addr == addr {
        return true;
    }
    match (holder.addr, addr) {
        (IpAddr::V4(v4), IpAddr::V6(v6)) => six_to_four(v4, 32).is_some_and(|(a, _)| a == v6),
        _ => false,
    }
}

/// Whether `addr` is an IPv6 address the kernel forms from `mac` by
/// stateless autoconfiguration (modified EUI-64 interface identifier):
/// a pod on a LAN with router advertisements takes one in each
/// advertised prefix, beside the address flatnet gave it.
fn is_slaac_of(addr: IpAddr, mac: [u8; 6]) -> bool {
    let IpAddr::V6(v6) = addr else {
        return false;
    };
    let eui64 = [
        mac[0] ^ 0x02,
        mac[1],
        mac[2],
        0xff,
        0xfe,
        mac[3],
        mac[4],
        mac[5],
    ];
    v6.octets()[8..] == eui64
}

/// The conflicts among the inventory's `claims`, read at monotonic time
/// `mono_now_ns` (wall time `now`).
pub fn conflicts(
    claims: &[WireClaimEntry],
    (mono_now_ns, now): (u64, Timestamp),
    holders: &MacHolders,
    local: &LocalPods,
    floating: &FloatingNetworks,
) -> Vec<MacConflict> {
    if holders.is_empty() {
        return Vec::new();
    }
    claims
        .iter()
        .filter_map(|claim| {
            let age = SignedDuration::try_from(claim.age(mono_now_ns)).ok()?;
            let seen_at = now.checked_sub(age).ok()?;
            classify(claim, seen_at, holders, local, floating)
        })
        .collect()
}

/// What to do after a scan.
#[derive(Debug, Default, PartialEq)]
pub struct Actions {
    /// New sightings, by kind: what the counter adds.
    pub sightings: BTreeMap<MacConflictKind, u64>,
    /// Conflicts to report now (Event and condition).
    pub reports: Vec<MacConflict>,
    /// Records whose condition goes back to `False`.
    pub clears: Vec<RecordName>,
}

/// What was last counted and reported of one (record, claimed address).
struct Seen {
    last_seen_ns: u64,
    /// `None`: counted, never reported by this node.
    reported_at: Option<Instant>,
}

/// Counts and rate-limits the conflicts of successive scans.
#[derive(Default)]
pub struct Limiter {
    seen: HashMap<(RecordName, IpAddr), Seen>,
    /// When each record reported by this node last had a conflict.
    active: HashMap<RecordName, Instant>,
}

impl Limiter {
    /// Takes over the conditions an earlier run of the agent on `node` set
    /// to `True` on `records` (its message names the node), as if their
    /// conflict had been seen at `now`: cleared after [`CLEAR_AFTER`]
    /// unless seen again.
    pub fn adopt<'a>(
        &mut self,
        records: impl IntoIterator<Item = &'a FlatNetworkIP>,
        node: &str,
        now: Instant,
    ) {
        let mark = node_mark(node);
        for record in records {
            let set_here = record.status.as_ref().is_some_and(|s| {
                s.conditions.iter().any(|c| {
                    c.type_ == CONDITION_MAC_CONFLICT
                        && c.status == "True"
                        && c.message.contains(&mark)
                })
            });
            if set_here {
                let name = RecordName {
                    namespace: record.namespace().unwrap_or_default(),
                    name: record.name_any(),
                };
                self.active.entry(name).or_insert(now);
            }
        }
    }

    /// The actions for the conflicts of a scan at `now`: a sighting newer
    /// than the one counted before is counted; a (record, address) not
    /// reported within [`REPORT_INTERVAL`] is reported; a record with no
    /// conflict for [`CLEAR_AFTER`] is cleared (once).
    pub fn scan(&mut self, found: Vec<MacConflict>, now: Instant) -> Actions {
        let mut actions = Actions::default();
        for conflict in found {
            let key = (conflict.record.clone(), conflict.addr);
            let fresh = !self.seen.contains_key(&key);
            let seen = self.seen.entry(key).or_insert(Seen {
                last_seen_ns: conflict.last_seen_ns,
                reported_at: None,
            });
            if !fresh && conflict.last_seen_ns <= seen.last_seen_ns {
                continue;
            }
            seen.last_seen_ns = conflict.last_seen_ns;
            *actions.sightings.entry(conflict.kind).or_default() += 1;
            if !conflict.reported_here {
                continue;
            }
            self.active.insert(conflict.record.clone(), now);
            let due = seen
                .reported_at
                .is_none_or(|at| now.duration_since(at) >= REPORT_INTERVAL);
            if due {
                seen.reported_at = Some(now);
                actions.reports.push(conflict);
            }
        }
        let quiet: Vec<RecordName> = self
            .active
            .iter()
            .filter(|(_, at)| now.duration_since(**at) >= CLEAR_AFTER)
            .map(|(record, _)| record.clone())
            .collect();
        for record in quiet {
            self.active.remove(&record);
            self.seen.retain(|(r, _), _| *r != record);
            actions.clears.push(record);
        }
        actions
    }
}

/// The counter `flatnet_agent_mac_conflicts_total{reason}`: two label
/// values, [`MacConflictKind::name`].
pub type MacConflictCounters = Family<[(&'static str, &'static str); 1], Counter>;

/// The message of `conflict`, seen on interface `uplink` of `node`.
pub fn message(conflict: &MacConflict, node: &str, uplink: &str) -> String {
    let vlan = match conflict.vlan {
        0 => String::new(),
        tag => format!(" VLAN {tag}"),
    };
    format!(
        "MAC {} of this record was seen claiming {} ({}){} interface {uplink}{vlan}: {}; another host uses the pod's MAC",
        format_mac(conflict.mac),
        conflict.addr,
        conflict.frame,
        node_mark(node),
        conflict.kind.explanation(),
    )
}

/// How a message names the node that wrote it (what [`Limiter::adopt`]
/// looks for).
fn node_mark(node: &str) -> String {
    format!(" on node {node},")
}

/// Writes the reports of one node.
pub struct MacConflictReporter {
    client: Client,
    node: String,
    events: EventRecorder,
}

impl MacConflictReporter {
    /// A reporter for `node` through `client`.
    pub fn new(client: Client, node: &str) -> Self {
        let reporter = Reporter {
            controller: crate::desired::kubernetes::FIELD_MANAGER.into(),
            instance: Some(node.to_owned()),
        };
        Self {
            events: EventRecorder::new(client.clone(), reporter),
            client,
            node: node.to_owned(),
        }
    }

    /// The Warning Event and the condition of `conflict`.
    ///
    /// # Errors
    /// The first failed API call.
    pub async fn report(&self, conflict: &MacConflict, message: &str) -> Result<(), kube::Error> {
        let reference = ObjectReference {
            api_version: Some(FlatNetworkIP::api_version(&()).into_owned()),
            kind: Some(FlatNetworkIP::kind(&()).into_owned()),
            namespace: Some(conflict.record.namespace.clone()),
            name: Some(conflict.record.name.clone()),
            ..ObjectReference::default()
        };
        self.events
            .publish(
                &Event {
                    type_: EventType::Warning,
                    reason: REASON.into(),
                    note: Some(message.to_owned()),
                    action: "WatchMAC".into(),
                    secondary: None,
                },
                &reference,
            )
            .await?;
        self.condition(&conflict.record, "True", REASON, message)
            .await
    }

    /// Sets the condition of `record` back to `False`.
    ///
    /// # Errors
    /// The failed API call.
    pub async fn clear(&self, record: &RecordName) -> Result<(), kube::Error> {
        let message = format!(
            "node {} has seen no frame with this record's MAC from another host for {} minutes",
            self.node,
            CLEAR_AFTER.as_secs() / 60
        );
        self.condition(record, "False", "NoConflictSeen", &message)
            .await
    }

    async fn condition(
        &self,
        record: &RecordName,
        status: &str,
        reason: &str,
        message: &str,
    ) -> Result<(), kube::Error> {
        let ips: Api<FlatNetworkIP> = Api::namespaced(self.client.clone(), &record.namespace);
        let patch = Patch::Apply(json!({
            "apiVersion": FlatNetworkIP::api_version(&()),
            "kind": FlatNetworkIP::kind(&()),
            "status": {"conditions": [{
                "type": CONDITION_MAC_CONFLICT,
                "status": status,
                "reason": reason,
                "message": message,
                "lastTransitionTime": Timestamp::now().to_string(),
            }]},
        }));
        match ips
            .patch_status(
                &record.name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &patch,
            )
            .await
        {
            // Gone meanwhile: nothing left to mark.
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            other => other.map(|_| ()),
        }
    }
}

/// Scans the inventory pinned under `pin_root` every [`SCAN_INTERVAL`]
/// and reports the conflicts, for as long as the agent runs.
pub async fn run(
    desired: &crate::desired::kubernetes::Kubernetes,
    client: Client,
    node: &str,
    pin_root: &std::path::Path,
    records: crate::records::Records,
    counters: MacConflictCounters,
) {
    let reporter = MacConflictReporter::new(client.clone(), node);
    let pools = crate::desired::kubernetes::Mirror::follow_notifying(
        Api::<FloatingIPPool>::all(client),
        None,
    );
    let mut limiter = Limiter::default();
    let mut adopted = false;
    let mut tick = tokio::time::interval(SCAN_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        // Without the records (or pools) nothing can be told apart.
        let (Some(flatnet), Some(pools)) = (desired.followed_records(), pools.objects()) else {
            continue;
        };
        if !adopted {
            limiter.adopt(flatnet.iter().map(AsRef::as_ref), node, Instant::now());
            adopted = true;
        }
        let holders = MacHolders::new(flatnet.iter().map(AsRef::as_ref));
        if holders.is_empty() {
            continue;
        }
        let local = match records.all() {
            Ok(all) => LocalPods::new(node, &all),
            Err(error) => {
                tracing::warn!(%error, "MAC conflicts: cannot read the attachment records");
                continue;
            }
        };
        let floating = FloatingNetworks::new(pools.iter().map(AsRef::as_ref));
        let claims =
            match crate::datapath::PinnedMaps::open(pin_root).and_then(|maps| maps.wire_claims()) {
                Ok(claims) => claims,
                Err(error) => {
                    tracing::debug!(%error, "wire inventory not readable; no MAC conflict scan");
                    continue;
                }
            };
        let now = (crate::datapath::monotonic_ns(), Timestamp::now());
        let found = conflicts(&claims, now, &holders, &local, &floating);
        let actions = limiter.scan(found, Instant::now());
        for (kind, count) in &actions.sightings {
            counters
                .get_or_create(&[("reason", kind.name())])
                .inc_by(*count);
        }
        for conflict in &actions.reports {
            let message = message(conflict, node, &local.uplink_name(conflict.ifindex));
            tracing::warn!(record = %conflict.record, %message, "MAC conflict");
            if let Err(error) = reporter.report(conflict, &message).await {
                tracing::warn!(%error, record = %conflict.record, "cannot report the MAC conflict");
            }
        }
        for record in &actions.clears {
            if let Err(error) = reporter.clear(record).await {
                tracing::warn!(%error, %record, "cannot clear the MAC conflict condition");
            }
        }
    }
}

#[cfg(test)]
mod tests;
