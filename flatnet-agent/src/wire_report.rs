//! Publishing what the wire says: the node's share of wire-aware IPAM.
//!
//! Every [`PUBLISH_INTERVAL`] the agent reads the uplink program's wire
//! inventory, keeps the claims made by MACs of no live flatnet record (no
//! FlatNetworkIP anywhere records the MAC, or only records being deleted:
//! hosts outside flatnet, and pods that are gone) on addresses of a subnet
//! (and, by MACs of the MAC pool's range, on any address), within the wire
//! window, and writes them into one `FlatNetworkWireClaims`
//! per subnet (`<subnet>.<node>`, owned by the subnet) with the time it read
//! them (`observedAt`). API writes stay few: `lastSeen` is rounded down to
//! [`LAST_SEEN_GRANULARITY`], an object is written only when its content
//! changed or its subnet asks for a report observed after a time
//! (`status.wireReportsWanted`, set by the operator while an address no
//! record names waits to be freed), and at most once per
//! [`PUBLISH_INTERVAL`]; one pass writes each such object once.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    net::IpAddr,
    time::Duration,
};

use flatnet_k8s::{
    api::{
        FlatNetworkConfig, FlatNetworkIP, FlatNetworkSubnet, FlatNetworkWireClaims,
        FlatNetworkWireClaimsSpec, ForeignClaim,
    },
    ipam::{Mac, MacRange},
    keys::SUBNET_NAMESPACE,
};
use ipnet::IpNet;
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{OwnerReference, Time},
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api, Resource, ResourceExt,
    api::{ObjectMeta, PostParams},
};
use tokio::time::Instant;

use crate::datapath::{WireClaimEntry, format_mac};

/// Least time between two writes of one object (and the period of the
/// publishing loop).
pub const PUBLISH_INTERVAL: Duration = Duration::from_secs(30);

/// `lastSeen` is published rounded down to this: a host that keeps
/// talking changes its entry once per granularity, not once per frame.
pub const LAST_SEEN_GRANULARITY: Duration = Duration::from_secs(300);

/// How far back the agent reports claims; the operator's window
/// (`FLATNET_WIRE_WINDOW`) decides which of them count, up to this.
pub const REPORT_HORIZON: Duration = Duration::from_secs(24 * 3600);

/// Errors of a publishing pass.
#[derive(Debug, thiserror::Error)]
pub enum WireReportError {
    /// Writing the report of a subnet failed.
    #[error("write FlatNetworkWireClaims {name}: {source}")]
    Write {
        /// The object's name.
        name: String,
        /// The API error.
        source: kube::Error,
    },
}

/// The foreign claims of each subnet, from the inventory `claims` read at
/// monotonic time `mono_now_ns` (wall time `now`).
///
/// A claim belongs to every subnet whose CIDR holds its address (and whose
/// VLAN is the frame's, when the frame was tagged); claims by
/// `flatnet_macs`, or older than `window`, are left out. A claim on an
/// address of no subnet by a MAC of the cluster's MAC pool range
/// `mac_pool` goes to the first subnet (by name) of the frame's VLAN: the
/// operator skips the MACs of every report, and without it such a MAC
/// could be handed to a pod.
pub fn foreign_claims(
    claims: &[WireClaimEntry],
    subnets: &[FlatNetworkSubnet],
    flatnet_macs: &HashSet<[u8; 6]>,
    mac_pool: Option<MacRange>,
    (mono_now_ns, now): (u64, Timestamp),
    window: Duration,
) -> BTreeMap<String, Vec<ForeignClaim>> {
    let mut networks: Vec<(String, IpNet, i64)> = subnets
        .iter()
        .filter_map(|s| {
            let net: IpNet = s.spec.cidr.parse().ok()?;
            Some((s.name_any(), net.trunc(), s.spec.vlan))
        })
        .collect();
    networks.sort();
    let in_pool = |mac: [u8; 6]| mac_pool.is_some_and(|range| range.contains(Mac(mac)));
    let mut out: BTreeMap<String, BTreeMap<IpAddr, ForeignClaim>> = networks
        .iter()
        .map(|(name, _, _)| (name.clone(), BTreeMap::new()))
        .collect();
    for claim in claims {
        let age = claim.age(mono_now_ns);
        if age > window || flatnet_macs.contains(&claim.mac) {
            continue;
        }
        let seen = now
            .checked_sub(SignedDuration::try_from(age).unwrap_or(SignedDuration::MAX))
            .unwrap_or(now);
        let last_seen = round_down(seen);
        let entry = ForeignClaim {
            ip: claim.addr,
            mac: format_mac(claim.mac),
            last_seen: Time(last_seen),
            kind: claim.kind.map_or("unknown", |k| k.name()).to_owned(),
        };
        let on_vlan = |vlan: i64| claim.vlan == 0 || i64::from(claim.vlan) == vlan;
        let mut homes: Vec<&String> = networks
            .iter()
            .filter(|(_, net, vlan)| net.contains(&claim.addr) && on_vlan(*vlan))
            .map(|(name, _, _)| name)
            .collect();
        if homes.is_empty() && in_pool(claim.mac) {
            homes.extend(
                networks
                    .iter()
                    .find(|(_, _, vlan)| on_vlan(*vlan))
                    .map(|(name, _, _)| name),
            );
        }
        for name in homes {
            let slot = out.get_mut(name).expect("every subnet has a slot");
            // Seen on two uplinks (or VLANs): the latest sighting counts.
            if slot
                .get(&claim.addr)
                .is_none_or(|c| c.last_seen.0 < entry.last_seen.0)
            {
                slot.insert(claim.addr, entry.clone());
            }
        }
    }
    out.into_iter()
        .map(|(name, claims)| (name, claims.into_values().collect()))
        .collect()
}

/// The MACs `records` name, but for records being deleted: their pod is
/// gone, and what their MAC still claims is what the operator must hear.
pub fn live_record_macs<'a>(
    records: impl IntoIterator<Item = &'a FlatNetworkIP>,
) -> HashSet<[u8; 6]> {
    records
        .into_iter()
        .filter(|r| r.metadata.deletion_timestamp.is_none())
        .filter_map(|r| crate::link::parse_mac(&r.status.as_ref()?.mac))
        .collect()
}

fn round_down(t: Timestamp) -> Timestamp {
    let step = i64::try_from(LAST_SEEN_GRANULARITY.as_secs())
        .unwrap_or(1)
        .max(1);
    let second = t.as_second();
    Timestamp::from_second(second - second.rem_euclid(step)).unwrap_or(t)
}

/// What was last written for one subnet, and when.
struct Published {
    claims: Vec<ForeignClaim>,
    at: Instant,
    /// The `observedAt` written.
    observed_at: Timestamp,
}

/// The time after which `subnet` wants a report observed, if it does.
fn wanted_since(subnet: Option<&FlatNetworkSubnet>) -> Option<Timestamp> {
    Some(subnet?.status.as_ref()?.wire_reports_wanted.as_ref()?.0)
}

/// Writes one node's reports, only changes, at a bounded rate.
pub struct WirePublisher {
    api: Api<FlatNetworkWireClaims>,
    node: String,
    published: HashMap<String, Published>,
}

impl WirePublisher {
    /// A publisher for `node`'s reports through `client`.
    pub fn new(client: kube::Client, node: &str) -> Self {
        Self {
            api: Api::namespaced(client, SUBNET_NAMESPACE),
            node: node.to_owned(),
            published: HashMap::new(),
        }
    }

    /// Writes the report of every subnet of `summary` whose claims differ
    /// from what was last written, or that wants a report observed after
    /// the last one, and whose last write is at least [`PUBLISH_INTERVAL`]
    /// before `now`. A subnet with nothing to report, nothing reported
    /// before and no report wanted gets no object. Returns the number of
    /// objects written; a failed write is tried again next pass.
    ///
    /// # Errors
    /// The first failed write (the others are still attempted).
    pub async fn publish(
        &mut self,
        summary: &BTreeMap<String, Vec<ForeignClaim>>,
        subnets: &[FlatNetworkSubnet],
        now: Instant,
    ) -> Result<usize, WireReportError> {
        let mut written = 0;
        let mut first_error = None;
        for (subnet, claims) in summary {
            let owner = subnets.iter().find(|s| s.name_any() == *subnet);
            let wanted = wanted_since(owner);
            let due = match self.published.get(subnet) {
                Some(last) => {
                    let stale = wanted.is_some_and(|w| last.observed_at < w);
                    (last.claims != *claims || stale)
                        && now.duration_since(last.at) >= PUBLISH_INTERVAL
                }
                None => !claims.is_empty() || wanted.is_some(),
            };
            if !due {
                continue;
            }
            // Whole seconds: what the API keeps of a time.
            let observed_at = Timestamp::from_second(Timestamp::now().as_second())
                .unwrap_or(Timestamp::UNIX_EPOCH);
            match self.write(subnet, claims, owner, observed_at).await {
                Ok(()) => {
                    written += 1;
                    self.published.insert(
                        subnet.clone(),
                        Published {
                            claims: claims.clone(),
                            at: now,
                            observed_at,
                        },
                    );
                }
                Err(error) => {
                    tracing::warn!(%error, "wire claims not published; retrying next pass");
                    first_error.get_or_insert(error);
                }
            }
        }
        first_error.map_or(Ok(written), Err)
    }

    /// Creates or replaces the report of `subnet`.
    async fn write(
        &self,
        subnet: &str,
        claims: &[ForeignClaim],
        owner: Option<&FlatNetworkSubnet>,
        observed_at: Timestamp,
    ) -> Result<(), WireReportError> {
        let name = FlatNetworkWireClaims::object_name(subnet, &self.node);
        let error = |source| WireReportError::Write {
            name: name.clone(),
            source,
        };
        let mut report = FlatNetworkWireClaims {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: Some(SUBNET_NAMESPACE.into()),
                // Deleted with its subnet.
                owner_references: owner.and_then(owner_reference).map(|o| vec![o]),
                ..ObjectMeta::default()
            },
            spec: FlatNetworkWireClaimsSpec {
                subnet: subnet.to_owned(),
                node: self.node.clone(),
                observed_at: Some(Time(observed_at)),
                claims: claims.to_vec(),
            },
        };
        match self.api.get_opt(&name).await.map_err(error)? {
            Some(current) => {
                report.metadata.resource_version = current.resource_version();
                self.api
                    .replace(&name, &PostParams::default(), &report)
                    .await
                    .map_err(error)?;
            }
            None => {
                self.api
                    .create(&PostParams::default(), &report)
                    .await
                    .map_err(error)?;
            }
        }
        Ok(())
    }
}

fn owner_reference(subnet: &FlatNetworkSubnet) -> Option<OwnerReference> {
    Some(OwnerReference {
        api_version: FlatNetworkSubnet::api_version(&()).into_owned(),
        kind: FlatNetworkSubnet::kind(&()).into_owned(),
        name: subnet.name_any(),
        uid: subnet.uid()?,
        ..OwnerReference::default()
    })
}

/// Publishes the node's foreign claims every [`PUBLISH_INTERVAL`], reading
/// the inventory pinned under `pin_root`, for as long as the agent runs.
/// The MAC pool's range comes from `cluster`, the agent's one watch of the
/// FlatNetworkConfig `cluster`.
pub async fn run(
    desired: &crate::desired::kubernetes::Kubernetes,
    client: kube::Client,
    cluster: crate::cluster_config::ClusterConfigView,
    node: &str,
    pin_root: &std::path::Path,
) {
    let mut publisher = WirePublisher::new(client, node);
    let mut tick = tokio::time::interval(PUBLISH_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(flatnet_macs) = desired.flatnet_macs() else {
            continue;
        };
        let subnets = desired.followed_subnets();
        let claims =
            match crate::datapath::PinnedMaps::open(pin_root).and_then(|maps| maps.wire_claims()) {
                Ok(claims) => claims,
                Err(error) => {
                    tracing::warn!(%error, "wire inventory not readable; nothing published");
                    continue;
                }
            };
        let now = (crate::datapath::monotonic_ns(), Timestamp::now());
        // Foreign MACs in the MAC pool's range are reported wherever they
        // claim (without the object, or before its first list: none).
        let mac_pool = cluster
            .borrow()
            .as_ref()
            .and_then(FlatNetworkConfig::mac_range);
        let summary = foreign_claims(
            &claims,
            &subnets,
            &flatnet_macs,
            mac_pool,
            now,
            REPORT_HORIZON,
        );
        // Failures are logged by `publish` and retried next pass.
        let _ = publisher.publish(&summary, &subnets, Instant::now()).await;
    }
}

#[cfg(test)]
mod tests {
    use flatnet_common::wire::WireKind;
    use flatnet_k8s::api::FlatNetworkSubnetSpec;

    use super::*;

    const SECOND: u64 = 1_000_000_000;

    fn subnet(name: &str, cidr: &str, vlan: i64) -> FlatNetworkSubnet {
        FlatNetworkSubnet::new(
            name,
            FlatNetworkSubnetSpec {
                cidr: cidr.into(),
                vlan,
                ..FlatNetworkSubnetSpec::default()
            },
        )
    }

    fn entry(addr: &str, mac_last: u8, vlan: u16, seen_ns: u64) -> WireClaimEntry {
        WireClaimEntry {
            ifindex: 2,
            vlan,
            addr: addr.parse().unwrap(),
            mac: [0x02, 0, 0, 0, 0, mac_last],
            kind: Some(WireKind::ArpRequest),
            last_seen_ns: seen_ns,
        }
    }

    #[test]
    fn only_foreign_recent_claims_in_a_subnet_are_kept() {
        let subnets = [
            subnet("lan", "192.0.2.0/24", 0),
            subnet("tagged", "198.51.100.0/24", 100),
        ];
        let pods = HashSet::from([[0x02, 0, 0, 0, 0, 0x11]]);
        let mono_now = 10_000 * SECOND;
        let now = Timestamp::from_second(1_800_000_000).unwrap();
        let claims = [
            entry("192.0.2.10", 0x10, 0, mono_now - 5 * SECOND),
            // A flatnet pod's MAC.
            entry("192.0.2.11", 0x11, 0, mono_now),
            // Outside every subnet.
            entry("203.0.113.1", 0x12, 0, mono_now),
            // Beyond the window.
            entry("192.0.2.13", 0x13, 0, mono_now - 3601 * SECOND),
            // Tagged with the subnet's VLAN, then with another.
            entry("198.51.100.5", 0x14, 100, mono_now),
            entry("198.51.100.6", 0x15, 200, mono_now),
        ];
        let out = foreign_claims(
            &claims,
            &subnets,
            &pods,
            None,
            (mono_now, now),
            Duration::from_secs(3600),
        );
        let lan = &out["lan"];
        assert_eq!(lan.len(), 1, "{lan:?}");
        assert_eq!(lan[0].mac, "02:00:00:00:00:10");
        assert_eq!(lan[0].kind, "arp_request");
        // Seen 5 s before `now`, published rounded down to the granularity.
        let step = i64::try_from(LAST_SEEN_GRANULARITY.as_secs()).unwrap();
        let expected = (1_800_000_000 - 5) / step * step;
        assert_eq!(lan[0].last_seen.0.as_second(), expected);
        let tagged = &out["tagged"];
        assert_eq!(tagged.len(), 1, "{tagged:?}");
        assert_eq!(tagged[0].ip, "198.51.100.5".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn a_pool_range_mac_is_reported_whatever_address_it_claims() {
        let subnets = [
            subnet("b-lan", "192.0.2.0/24", 0),
            subnet("a-tagged", "198.51.100.0/24", 100),
            subnet("c-tagged", "203.0.113.0/24", 100),
        ];
        let pool = MacRange::parse("02:00:00:00:00:20", "02:00:00:00:00:2f").unwrap();
        let mono_now = 10_000 * SECOND;
        let now = Timestamp::from_second(1_800_000_000).unwrap();
        let claims = [
            // Outside every subnet, in the pool range: untagged, tagged 100.
            entry("10.9.9.9", 0x21, 0, mono_now),
            entry("10.9.9.10", 0x22, 100, mono_now),
            // Outside every subnet and the pool range: none of flatnet's business.
            entry("10.9.9.11", 0x30, 0, mono_now),
            // Outside every subnet, tagged with a VLAN of no subnet.
            entry("10.9.9.12", 0x23, 200, mono_now),
            // A flatnet pod's pool MAC.
            entry("10.9.9.13", 0x24, 0, mono_now),
            // In a subnet: reported there, as any foreign claim.
            entry("192.0.2.7", 0x25, 0, mono_now),
        ];
        let pods = HashSet::from([[0x02, 0, 0, 0, 0, 0x24]]);
        let report = |pool| {
            foreign_claims(
                &claims,
                &subnets,
                &pods,
                pool,
                (mono_now, now),
                Duration::from_secs(3600),
            )
        };
        let out = report(Some(pool));
        let macs = |name: &str| -> Vec<&str> { out[name].iter().map(|c| c.mac.as_str()).collect() };
        assert_eq!(
            macs("a-tagged"),
            ["02:00:00:00:00:21", "02:00:00:00:00:22"],
            "the first subnet of the frame's VLAN, by name"
        );
        assert_eq!(macs("b-lan"), ["02:00:00:00:00:25"]);
        assert!(out["c-tagged"].is_empty());
        // Without a pool, only the claim in a subnet is reported.
        let without = report(None);
        let count: usize = without.values().map(Vec::len).sum();
        assert_eq!(count, 1);
    }

    #[test]
    fn a_record_being_deleted_does_not_make_its_mac_a_flatnet_one() {
        use flatnet_k8s::api::FlatNetworkIPStatus;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let record = |name: &str, mac: &str, deleting: bool| {
            let mut r = FlatNetworkIP::new(name, flatnet_k8s::api::FlatNetworkIPSpec::default());
            r.status = Some(FlatNetworkIPStatus {
                mac: mac.into(),
                ..FlatNetworkIPStatus::default()
            });
            r.metadata.deletion_timestamp = deleting.then(|| Time(Timestamp::now()));
            r
        };
        let records = [
            record("live", "02:00:00:00:00:01", false),
            record("gone", "02:00:00:00:00:02", true),
            record("unset", "", false),
        ];
        assert_eq!(
            live_record_macs(&records),
            HashSet::from([[0x02, 0, 0, 0, 0, 1]])
        );
    }
}
