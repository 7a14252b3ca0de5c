//! The MAC ledger of one parent link.
//!
//! MACs are unique per parent link (`master` plus `vlan`), which several
//! sibling subnets share, so no subnet's `usedMac` can serialise them. Every
//! parent link has one ledger, a ConfigMap in `cattle-flat-network` named
//! by [`ledger_name`], whose data maps each fixed MAC (`02-00-00-00-00-01`)
//! to the claims on it: `namespace/record#token`, space-separated. Only the
//! records of one pod may share a MAC (the two records of a dual-stack pod
//! on one interface).
//!
//! MACs of the MAC pool are claimed without an owner, as ranges under
//! `pool.claimed` (see [`mac_ahead`](super::mac_ahead)): the record naming
//! one (`macFromPool`) is its holder, as for an address in `usedIP`, and a
//! claimed MAC no record names is freed by the subnet repair after the
//! orphan grace. So a claim costs no per-MAC entry, and many pods' claims
//! cost one write.
//!
//! A claim is made by a write carrying the resourceVersion that was read
//! (a create when the ledger does not exist yet), so of two allocators
//! claiming one MAC for two pods, the API server accepts exactly one; the
//! other re-reads, sees the MAC taken and fails with `RequestedMacTaken`
//! or takes its next candidate. The token makes every claim distinct: a
//! claim is removed only by the allocation that made it (when it gives up),
//! by the release of its record, or by the subnet repair once no record has
//! named it for the orphan grace.

use std::{
    collections::{BTreeMap, BTreeSet},
    hash::{BuildHasher, Hasher},
};

use flatnet_k8s::{
    ipam::{IntervalSet, Mac, MacPoolState},
    keys::SUBNET_NAMESPACE,
    validation::ParentLink,
};
use k8s_openapi::{api::core::v1::ConfigMap, apimachinery::pkg::apis::meta::v1::ObjectMeta};
use kube::{Api, api::PostParams};

use super::{
    Error,
    errors::{is_conflict, is_not_found},
    records::SECONDARY_SUFFIX,
};

/// Prefix of the ledger names.
pub const LEDGER_PREFIX: &str = "flatnet-macs-";

/// Data key of the MAC pool's cursor.
const POOL_CURSOR_KEY: &str = "pool.cursor";
/// Data key of the MAC pool's quarantine.
const POOL_QUARANTINE_KEY: &str = "pool.quarantine";
/// Data key of the pool MACs claimed without an owner.
const POOL_CLAIMED_KEY: &str = "pool.claimed";

/// Annotations naming the parent link of a ledger, for people.
const MASTER_ANNOTATION: &str = "flatnetwork.pandaria.io/master";
const VLAN_ANNOTATION: &str = "flatnetwork.pandaria.io/vlan";

/// The ConfigMap name of `parent`'s ledger: `flatnet-macs-<vlan>-<master
/// in hex>`. Interface names may hold characters object names cannot, so
/// the master is hex-encoded; the annotations spell it out.
#[must_use]
pub fn ledger_name(parent: &ParentLink) -> String {
    let hex: String = parent.master.bytes().map(|b| format!("{b:02x}")).collect();
    format!("{LEDGER_PREFIX}{}-{hex}", parent.vlan)
}

/// One claim on a MAC: the record and the token of the allocation that
/// made it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct LedgerClaim {
    /// `namespace/name` of the record.
    pub record: String,
    /// Distinguishes this claim from earlier claims of the same record.
    pub token: String,
}

impl LedgerClaim {
    /// A new claim of `record` with a token no other claim has.
    #[must_use]
    pub fn new(record: &str) -> Self {
        // A randomly keyed hash: a fresh 64-bit value per call.
        let token = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        Self {
            record: record.to_owned(),
            token: format!("{token:016x}"),
        }
    }

    fn parse(text: &str) -> Option<Self> {
        let (record, token) = text.split_once('#')?;
        Some(Self {
            record: record.to_owned(),
            token: token.to_owned(),
        })
    }
}

/// `namespace/pod` of a record key: the records of a dual-stack pod are
/// `<pod>` and `<pod>.ipv6`.
#[must_use]
pub fn pod_of(record: &str) -> &str {
    record.strip_suffix(SECONDARY_SUFFIX).unwrap_or(record)
}

/// A ledger as read from the API server.
#[derive(Clone, Debug)]
pub struct Ledger {
    /// The ConfigMap, `None` when it does not exist yet.
    stored: Option<ConfigMap>,
    /// The parent link.
    parent: ParentLink,
    /// The claims on each MAC.
    pub claims: BTreeMap<Mac, BTreeSet<LedgerClaim>>,
    /// The MAC pool's cursor and quarantine on this parent link.
    pub pool: MacPoolState,
    /// Pool MACs claimed without an owner (by value, see [`Mac::to_u64`]).
    pub pool_claimed: IntervalSet,
}

impl Ledger {
    /// The MACs claimed by records of another pod than `record`'s.
    #[must_use]
    pub fn taken_from(&self, record: &str) -> BTreeSet<Mac> {
        let pod = pod_of(record);
        self.claims
            .iter()
            .filter(|(_, claims)| claims.iter().any(|c| pod_of(&c.record) != pod))
            .map(|(mac, _)| *mac)
            .collect()
    }

    /// Whether every claim on `mac` is by `record`'s pod (true when none).
    #[must_use]
    pub fn only_pod_of(&self, mac: Mac, record: &str) -> bool {
        let pod = pod_of(record);
        self.claims
            .get(&mac)
            .is_none_or(|claims| claims.iter().all(|c| pod_of(&c.record) == pod))
    }

    /// The claims of `record` on `mac`.
    #[must_use]
    pub fn claims_of(&self, mac: Mac, record: &str) -> Vec<LedgerClaim> {
        self.claims
            .get(&mac)
            .into_iter()
            .flatten()
            .filter(|c| c.record == record)
            .cloned()
            .collect()
    }

    /// Whether `mac` is a pool MAC claimed without an owner.
    #[must_use]
    pub fn pool_holds(&self, mac: Mac) -> bool {
        self.pool_claimed.contains(u128::from(mac.to_u64()))
    }

    /// Every MAC claimed on this parent link, with an owner or without.
    #[must_use]
    pub fn claimed(&self) -> BTreeSet<Mac> {
        let mut macs: BTreeSet<Mac> = self.claims.keys().copied().collect();
        macs.extend(pool_macs(&self.pool_claimed));
        macs
    }

    /// The pool MACs claimed without an owner.
    pub fn pool_claimed_macs(&self) -> impl Iterator<Item = Mac> + '_ {
        pool_macs(&self.pool_claimed)
    }

    /// Claims `macs` for the pool, without an owner.
    pub fn claim_for_pool(&mut self, macs: &[Mac]) {
        for mac in macs {
            let value = u128::from(mac.to_u64());
            self.pool_claimed.insert(value, value);
        }
    }

    /// Gives back a pool MAC claimed without an owner: into the quarantine
    /// when a pod may have used it (`used`), else simply free again.
    /// Returns whether it was claimed.
    pub fn unclaim_from_pool(&mut self, mac: Mac, used: bool) -> bool {
        let value = u128::from(mac.to_u64());
        let claimed = self.pool_claimed.remove(value, value) > 0;
        if claimed && used && !self.claims.contains_key(&mac) {
            self.pool.free(mac);
        }
        claimed
    }

    /// Adds `claim` on `mac`.
    pub fn add(&mut self, mac: Mac, claim: LedgerClaim) {
        self.claims.entry(mac).or_default().insert(claim);
    }

    /// Removes the claims on `mac` that `which` selects; returns whether
    /// any was removed. A MAC nobody claims any more goes into the pool's
    /// quarantine.
    pub fn remove(&mut self, mac: Mac, which: impl Fn(&LedgerClaim) -> bool) -> bool {
        let Some(claims) = self.claims.get_mut(&mac) else {
            return false;
        };
        let before = claims.len();
        claims.retain(|c| !which(c));
        let removed = claims.len() != before;
        if claims.is_empty() {
            self.claims.remove(&mac);
            self.pool.free(mac);
        }
        removed
    }

    fn to_config_map(&self) -> ConfigMap {
        let mut data: BTreeMap<String, String> = self
            .claims
            .iter()
            .map(|(mac, claims)| {
                let key = mac.to_string().replace(':', "-");
                let value = claims
                    .iter()
                    .map(|c| format!("{}#{}", c.record, c.token))
                    .collect::<Vec<_>>()
                    .join(" ");
                (key, value)
            })
            .collect();
        if let Some(cursor) = self.pool.cursor {
            data.insert(POOL_CURSOR_KEY.to_owned(), cursor.to_string());
        }
        if !self.pool_claimed.is_empty() {
            let ranges: Vec<String> = self
                .pool_claimed
                .iter()
                .map(|range| {
                    let (start, end) = (mac_of(*range.start()), mac_of(*range.end()));
                    if start == end {
                        start.to_string()
                    } else {
                        format!("{start}-{end}")
                    }
                })
                .collect();
            data.insert(POOL_CLAIMED_KEY.to_owned(), ranges.join(" "));
        }
        if !self.pool.quarantine.is_empty() {
            let freed: Vec<String> = self.pool.quarantine.iter().map(Mac::to_string).collect();
            data.insert(POOL_QUARANTINE_KEY.to_owned(), freed.join(" "));
        }
        let mut map = self.stored.clone().unwrap_or_else(|| ConfigMap {
            metadata: ObjectMeta {
                name: Some(ledger_name(&self.parent)),
                namespace: Some(SUBNET_NAMESPACE.to_owned()),
                annotations: Some(BTreeMap::from([
                    (MASTER_ANNOTATION.to_owned(), self.parent.master.clone()),
                    (VLAN_ANNOTATION.to_owned(), self.parent.vlan.to_string()),
                ])),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        });
        map.data = Some(data);
        map
    }
}

fn parse_claims(map: &ConfigMap) -> BTreeMap<Mac, BTreeSet<LedgerClaim>> {
    map.data
        .iter()
        .flatten()
        .filter_map(|(key, value)| {
            let mac = Mac::parse(&key.replace('-', ":")).ok()?;
            let claims: BTreeSet<LedgerClaim> = value
                .split_whitespace()
                .filter_map(LedgerClaim::parse)
                .collect();
            (!claims.is_empty()).then_some((mac, claims))
        })
        .collect()
}

/// The MAC of a value of [`Ledger::pool_claimed`].
fn mac_of(value: u128) -> Mac {
    Mac::from_u64(u64::try_from(value).unwrap_or(u64::MAX))
}

/// The members of a set of pool MACs.
fn pool_macs(set: &IntervalSet) -> impl Iterator<Item = Mac> + '_ {
    set.iter().flat_map(|range| range.map(mac_of))
}

/// `pool.claimed`: ranges `start-end` or single MACs; unparsable entries
/// are skipped.
fn parse_pool_claimed(map: &ConfigMap) -> IntervalSet {
    let mut set = IntervalSet::new();
    let text = map
        .data
        .as_ref()
        .and_then(|d| d.get(POOL_CLAIMED_KEY))
        .map_or("", String::as_str);
    for entry in text.split_whitespace() {
        // A MAC holds no '-' (colons only), so the first one splits.
        let (start, end) = entry.split_once('-').unwrap_or((entry, entry));
        if let (Ok(start), Ok(end)) = (Mac::parse(start), Mac::parse(end))
            && start <= end
        {
            set.insert(u128::from(start.to_u64()), u128::from(end.to_u64()));
        }
    }
    set
}

fn parse_pool(map: &ConfigMap) -> MacPoolState {
    let data = map.data.as_ref();
    let get = |key: &str| data.and_then(|d| d.get(key)).map_or("", String::as_str);
    MacPoolState {
        cursor: Mac::parse(get(POOL_CURSOR_KEY)).ok(),
        quarantine: get(POOL_QUARANTINE_KEY)
            .split_whitespace()
            .filter_map(|m| Mac::parse(m).ok())
            .collect(),
    }
}

fn api(client: &kube::Client) -> Api<ConfigMap> {
    Api::namespaced(client.clone(), SUBNET_NAMESPACE)
}

/// Reads the ledger of `parent` from the API server (never a cache).
///
/// # Errors
/// The API failing.
pub async fn read(client: &kube::Client, parent: &ParentLink) -> Result<Ledger, Error> {
    let name = ledger_name(parent);
    let stored =
        api(client)
            .get_opt(&name)
            .await
            .map_err(Error::kube("get", "ConfigMap", &name))?;
    Ok(Ledger {
        claims: stored.as_ref().map(parse_claims).unwrap_or_default(),
        pool: stored.as_ref().map(parse_pool).unwrap_or_default(),
        pool_claimed: stored.as_ref().map(parse_pool_claimed).unwrap_or_default(),
        stored,
        parent: parent.clone(),
    })
}

/// Writes `ledger` if nobody wrote it since it was read: `Ok(false)` when
/// another writer was first (read again and decide again). On success the
/// ledger holds what was written, so it can be changed and written again
/// without a read.
///
/// # Errors
/// The API failing.
pub async fn write(client: &kube::Client, ledger: &mut Ledger) -> Result<bool, Error> {
    let name = ledger_name(&ledger.parent);
    let api = api(client);
    let map = ledger.to_config_map();
    let result = if ledger.stored.is_some() {
        api.replace(&name, &PostParams::default(), &map).await
    } else {
        api.create(&PostParams::default(), &map).await
    };
    match result {
        Ok(written) => {
            ledger.stored = Some(written);
            Ok(true)
        }
        // 409: changed since read (or created meanwhile); 404: deleted.
        Err(error) if is_conflict(&error) || is_not_found(&error) => Ok(false),
        Err(error) => Err(Error::kube("write", "ConfigMap", &name)(error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mac(text: &str) -> Mac {
        Mac::parse(text).unwrap()
    }

    fn parent(master: &str, vlan: u16) -> ParentLink {
        ParentLink {
            master: master.into(),
            vlan,
        }
    }

    /// A ledger of `eth0` that does not exist yet.
    fn empty() -> Ledger {
        Ledger {
            stored: None,
            parent: parent("eth0", 0),
            claims: BTreeMap::new(),
            pool: MacPoolState::default(),
            pool_claimed: IntervalSet::new(),
        }
    }

    #[test]
    fn names_are_valid_object_names_and_distinct_per_parent_link() {
        assert_eq!(ledger_name(&parent("eth0", 0)), "flatnet-macs-0-65746830");
        let names: BTreeSet<String> = [
            parent("eth0", 100),
            parent("eth0.1", 0),
            parent("eth01", 0),
            parent("Eth0", 100),
        ]
        .iter()
        .map(ledger_name)
        .collect();
        assert_eq!(names.len(), 4);
        for name in &names {
            assert!(
                name.len() <= 253
                    && name
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'),
                "{name}"
            );
        }
    }

    #[test]
    fn claims_round_trip_and_are_shared_only_within_a_pod() {
        let mut ledger = empty();
        let m = mac("02:00:00:00:00:01");
        ledger.add(m, LedgerClaim::new("shop/web-0"));
        ledger.add(m, LedgerClaim::new("shop/web-0.ipv6"));
        let map = ledger.to_config_map();
        assert_eq!(
            map.metadata.name.as_deref(),
            Some("flatnet-macs-0-65746830")
        );
        let data = map.data.clone().unwrap();
        assert!(data.contains_key("02-00-00-00-00-01"), "{data:?}");
        assert_eq!(parse_claims(&map), ledger.claims);

        assert!(ledger.only_pod_of(m, "shop/web-0.ipv6"));
        assert!(ledger.taken_from("shop/web-0").is_empty());
        assert_eq!(ledger.taken_from("shop/web-1"), BTreeSet::from([m]));
        assert!(!ledger.only_pod_of(m, "shop/web-1"));

        let mine = ledger.claims_of(m, "shop/web-0");
        assert_eq!(mine.len(), 1);
        assert!(ledger.remove(m, |c| *c == mine[0]));
        assert!(!ledger.remove(m, |c| *c == mine[0]), "removed once");
        assert!(ledger.remove(m, |_| true));
        assert!(
            ledger.claims.is_empty(),
            "an unclaimed MAC leaves the ledger"
        );
        assert_eq!(ledger.pool.quarantine, [m], "and enters the quarantine");
        ledger.pool.cursor = Some(mac("02:00:00:00:00:07"));
        let map = ledger.to_config_map();
        assert_eq!(
            parse_pool(&map),
            ledger.pool,
            "the pool's memory round-trips"
        );
        assert!(parse_claims(&map).is_empty(), "and is no claim");
    }

    #[test]
    fn pool_claims_round_trip_as_ranges_and_quarantine_only_used_macs() {
        let mut ledger = empty();
        let macs: Vec<Mac> = (1..=5).map(|x| Mac([2, 0xaa, 0, 0, 0, x])).collect();
        ledger.claim_for_pool(&macs);
        ledger.claim_for_pool(&[mac("02:aa:00:00:01:00")]);
        let map = ledger.to_config_map();
        assert_eq!(
            map.data.as_ref().unwrap()["pool.claimed"],
            "02:aa:00:00:00:01-02:aa:00:00:00:05 02:aa:00:00:01:00"
        );
        assert_eq!(parse_pool_claimed(&map), ledger.pool_claimed);
        assert!(parse_claims(&map).is_empty(), "no owner claim");
        assert_eq!(ledger.claimed().len(), 6);
        assert!(ledger.pool_holds(macs[2]));

        assert!(ledger.unclaim_from_pool(macs[2], true));
        assert!(!ledger.unclaim_from_pool(macs[2], true), "once");
        assert!(ledger.unclaim_from_pool(macs[3], false));
        assert_eq!(ledger.pool.quarantine, [macs[2]], "only the used one");
        assert_eq!(
            ledger.to_config_map().data.unwrap()["pool.claimed"],
            "02:aa:00:00:00:01-02:aa:00:00:00:02 02:aa:00:00:00:05 02:aa:00:00:01:00"
        );
    }

    /// The size of the ledger's data as stored (keys and values).
    fn stored_size(ledger: &Ledger) -> usize {
        ledger
            .to_config_map()
            .data
            .unwrap_or_default()
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum()
    }

    #[test]
    fn pool_claims_beyond_the_per_mac_cap_fit_one_config_map() {
        let mut ledger = empty();
        // Per-MAC claims (about 70 bytes each) filled the 1 MiB ConfigMap
        // at about 15,000 MACs; a run of claimed pool MACs is one range.
        let base = mac("02:aa:00:00:00:00").to_u64();
        let run: Vec<Mac> = (0..100_000).map(|i| Mac::from_u64(base + i)).collect();
        ledger.claim_for_pool(&run);
        assert!(stored_size(&ledger) < 100, "{}", stored_size(&ledger));
        assert_eq!(ledger.claimed().len(), 100_000);
        // The worst case is every other MAC freed: one entry per held MAC
        // (18 bytes), so 40,000 held MACs still fit with room to spare.
        for i in (1..80_000).step_by(2) {
            ledger.unclaim_from_pool(Mac::from_u64(base + i), true);
        }
        let size = stored_size(&ledger);
        assert!(size < 1024 * 1024, "{size}");
        assert_eq!(
            parse_pool_claimed(&ledger.to_config_map()),
            ledger.pool_claimed
        );
    }

    #[test]
    fn tokens_differ_per_claim() {
        assert_ne!(LedgerClaim::new("a/b").token, LedgerClaim::new("a/b").token);
    }
}
