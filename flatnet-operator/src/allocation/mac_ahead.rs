//! Pool MACs claimed ahead, per parent link, so that a pod's pool MAC
//! costs a share of one MAC ledger write, like its address costs a share
//! of one subnet ledger write ([`group_commit`](super::group_commit)).
//!
//! A group commit that needs pool MACs takes them from the parent link's
//! spare MACs: MACs already claimed in the link's ledger
//! ([`mac_ledger`](super::mac_ledger), `pool.claimed`, no owner) and not
//! handed out yet. When too few are spare, one ledger write (with the
//! resourceVersion of the ledger kept in memory, no read) claims what the
//! batch needs plus [`CLAIM_AHEAD`] more. On 409 the ledger is read again
//! and the MACs chosen again, so two operators never claim one MAC.
//!
//! A spare MAC is handed out only while its claim is younger than half the
//! write deadline, so the record naming it is written long before the
//! subnet repair may free a claim no record names (after the orphan
//! grace). Older spare MACs are given back by the next claim write while
//! they are younger than half the orphan grace, else left to the repair.
//! A leader that dies loses at most its spare MACs until the repair frees
//! them; a small pool claims nothing ahead.
//!
//! Releases are group-committed per link too: a release queues itself and
//! takes the link's lock; whoever holds the lock next (another release, or
//! a claim write) applies every queued release in its one write and
//! answers them all. So under churn many pods' MACs go back into the pool
//! (and its quarantine) in one ledger write, and the link's lock and the
//! ledger's resourceVersion still order every change.

use std::{
    collections::{BTreeSet, HashMap},
    sync::{Arc, Mutex},
    time::Instant,
};

use flatnet_k8s::{
    ipam::{Mac, MacRange, macs_in_use},
    validation::ParentLink,
};
use kube::ResourceExt;
use tokio::sync::oneshot;
use tracing::debug;

use super::{
    Context, Error,
    commit::MAX_ATTEMPTS,
    mac_ledger::{self, Ledger},
};

/// Pool MACs a claim write takes beyond what its batch needs, at most.
pub const CLAIM_AHEAD: usize = 32;

/// MACs claimed ahead are at most this share of the pool's free MACs, so
/// a small pool is not held by spare claims a dead leader leaves behind.
const AHEAD_SHARE: u64 = 64;

/// A pool MAC claimed in the ledger, and when.
pub type ClaimedMac = (Mac, Instant);

/// The spare MACs of one parent link and its ledger as last read or
/// written.
#[derive(Default)]
struct Link {
    /// Serialises this operator's claim writes on the link.
    book: tokio::sync::Mutex<Option<Ledger>>,
    /// Claimed, not handed out; oldest first.
    spare: Mutex<Vec<ClaimedMac>>,
    /// Releases waiting for the next write of the ledger.
    releases: Mutex<Vec<Release>>,
}

impl Link {
    /// Takes every queued release, deciding now, with the records cache
    /// as it is, which MACs another live record still names.
    fn take_releases(&self, ctx: &Context) -> Releases {
        let queued = std::mem::take(&mut *self.releases.lock().unwrap_or_else(|e| e.into_inner()));
        Releases::decide(ctx, queued)
    }

    /// Queues `releases` again, unanswered: their write failed, and each
    /// releaser, finding no answer once it holds the lock, writes them.
    fn requeue(&self, releases: Releases) {
        let mut queued = self.releases.lock().unwrap_or_else(|e| e.into_inner());
        queued.extend(releases.0.into_iter().map(|(release, _)| release));
    }
}

/// Why a batch of releases was not written, for every release in it.
#[derive(Clone, Debug)]
enum Failure {
    Contention,
    Api(String),
}

/// A release of a MAC waiting for its link's next ledger write.
struct Release {
    mac: Mac,
    /// `namespace/name` of the record that held it.
    key: String,
    answer: oneshot::Sender<Result<(), Failure>>,
}

/// Queued releases, each with whether another live record still names its
/// MAC (then only the record's own claims go; the pool keeps the MAC).
#[derive(Default)]
struct Releases(Vec<(Release, bool)>);

impl Releases {
    fn decide(ctx: &Context, queued: Vec<Release>) -> Self {
        if queued.is_empty() {
            return Self::default();
        }
        let macs: BTreeSet<String> = queued.iter().map(|r| r.mac.to_string()).collect();
        // The holders of the queued MACs, in one pass over the cache.
        let mut holders: HashMap<String, Vec<String>> = HashMap::new();
        for record in ctx.caches.records.state().iter() {
            if record.metadata.deletion_timestamp.is_some() {
                continue;
            }
            if let Some(status) = &record.status
                && macs.contains(&status.mac)
            {
                let key = super::key_of(record.namespace().as_deref(), &record.name_any());
                holders.entry(status.mac.clone()).or_default().push(key);
            }
        }
        Self(
            queued
                .into_iter()
                .map(|release| {
                    let named_elsewhere = holders
                        .get(&release.mac.to_string())
                        .is_some_and(|keys| keys.iter().any(|k| *k != release.key));
                    (release, named_elsewhere)
                })
                .collect(),
        )
    }

    /// Applies every release to `ledger`: the record's claims on its MAC
    /// go, and the pool's claim when no other record names it (the MAC
    /// then enters the quarantine). Whether the ledger changed.
    fn apply(&self, ledger: &mut Ledger) -> bool {
        let mut changed = false;
        for (release, named_elsewhere) in &self.0 {
            changed |= ledger.remove(release.mac, |c| c.record == release.key);
            if !named_elsewhere {
                changed |= ledger.unclaim_from_pool(release.mac, true);
            }
        }
        changed
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn answer(self, answer: &Result<(), Failure>) {
        for (release, _) in self.0 {
            let _ = release.answer.send(answer.clone());
        }
    }
}

/// The spare pool MACs of every parent link.
#[derive(Default)]
pub struct MacAhead {
    links: Mutex<HashMap<String, Arc<Link>>>,
}

impl MacAhead {
    /// The link whose ledger is `parent`'s: keyed by the ledger's name,
    /// since two parent links may print alike (`eth0` with VLAN 100, and
    /// `eth0.100`) and one book must never stand for two ledgers.
    fn link(&self, parent: &ParentLink) -> Arc<Link> {
        let mut links = self.links.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(links.entry(mac_ledger::ledger_name(parent)).or_default())
    }

    /// Takes up to `count` spare MACs of `range` young enough to hand out.
    fn take_spare(ctx: &Context, link: &Link, range: MacRange, count: usize) -> Vec<ClaimedMac> {
        let usable_for = ctx.settings.write_deadline / 2;
        let mut spare = link.spare.lock().unwrap_or_else(|e| e.into_inner());
        let mut taken = Vec::new();
        let mut i = 0;
        while taken.len() < count && i < spare.len() {
            let (mac, at) = spare[i];
            if range.contains(mac) && at.elapsed() < usable_for {
                taken.push(spare.remove(i));
            } else {
                i += 1;
            }
        }
        taken
    }

    /// Spare MACs that can no longer be handed out (too old, or outside
    /// the pool's range now), removed from the spare list.
    fn take_stale(ctx: &Context, link: &Link, range: MacRange) -> Vec<ClaimedMac> {
        let usable_for = ctx.settings.write_deadline / 2;
        let mut spare = link.spare.lock().unwrap_or_else(|e| e.into_inner());
        let (stale, keep): (Vec<ClaimedMac>, Vec<ClaimedMac>) = spare
            .drain(..)
            .partition(|(mac, at)| !range.contains(*mac) || at.elapsed() >= usable_for);
        *spare = keep;
        stale
    }

    /// `count` pool MACs of `range` on `parent`, each claimed in the
    /// parent link's ledger, with when it was claimed.
    ///
    /// # Errors
    /// [`Error::MacPool`] when the pool has fewer free MACs, the API
    /// failing, or [`Error::MacLedgerContention`].
    pub async fn take(
        &self,
        ctx: &Context,
        parent: &ParentLink,
        range: MacRange,
        count: usize,
    ) -> Result<Vec<ClaimedMac>, Error> {
        let link = self.link(parent);
        let mut taken = Self::take_spare(ctx, &link, range, count);
        if taken.len() == count {
            return Ok(taken);
        }
        let mut book = link.book.lock().await;
        // Another batch may have claimed ahead while this one waited.
        taken.extend(Self::take_spare(ctx, &link, range, count - taken.len()));
        if taken.len() == count {
            return Ok(taken);
        }
        let needed = count - taken.len();
        match claim(ctx, &link, &mut book, parent, range, needed).await {
            Ok(claimed) => {
                taken.extend(claimed);
                Ok(taken)
            }
            Err(error) => {
                self.put_back(parent, taken);
                Err(error)
            }
        }
    }

    /// Returns MACs taken with [`MacAhead::take`] that no record names
    /// (their allocation failed): they stay claimed, spare.
    pub fn put_back(&self, parent: &ParentLink, macs: Vec<ClaimedMac>) {
        if macs.is_empty() {
            return;
        }
        let link = self.link(parent);
        let mut spare = link.spare.lock().unwrap_or_else(|e| e.into_inner());
        spare.extend(macs);
        spare.sort_by_key(|(_, at)| *at);
    }

    /// Releases `mac`, which record `key` held: its claims in the ledger,
    /// and the pool's claim when no other record names it (the MAC then
    /// goes into the quarantine). Written together with the other releases
    /// and claims of the link waiting at the time.
    ///
    /// # Errors
    /// The API failing, or [`Error::MacLedgerContention`].
    pub async fn release(
        &self,
        ctx: &Context,
        parent: &ParentLink,
        mac: Mac,
        key: &str,
    ) -> Result<(), Error> {
        let link = self.link(parent);
        let (answer, mut rx) = oneshot::channel();
        link.releases
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Release {
                mac,
                key: key.to_owned(),
                answer,
            });
        // Releases come in waves (a subnet's group commit answers many at
        // once): let the rest of the wave queue before this one writes.
        tokio::task::yield_now().await;
        let mut book = link.book.lock().await;
        // An earlier holder of the lock may have written this release.
        let answer = match rx.try_recv() {
            Ok(answer) => answer,
            Err(_) => {
                let releases = link.take_releases(ctx);
                let count = releases.len();
                let written = edit(ctx, parent, &mut book, |ledger| releases.apply(ledger)).await;
                debug!(%parent, count, ok = written.is_ok(), "pool MAC releases committed");
                releases.answer(&written.map_err(|error| match error {
                    Error::MacLedgerContention { .. } => Failure::Contention,
                    other => Failure::Api(other.to_string()),
                }));
                rx.try_recv().unwrap_or(Err(Failure::Contention))
            }
        };
        drop(book);
        answer.map_err(|failure| match failure {
            Failure::Contention => Error::MacLedgerContention {
                parent: parent.to_string(),
                attempts: MAX_ATTEMPTS,
            },
            Failure::Api(message) => Error::MacLedgerWrite {
                parent: parent.to_string(),
                message,
            },
        })
    }
}

/// Applies `change` to `parent`'s ledger (`book`, or read when `None`)
/// and writes it when it changed anything, reading and applying again on
/// conflict; `book` then holds the ledger as written.
///
/// # Errors
/// The API failing, or [`Error::MacLedgerContention`].
pub async fn edit(
    ctx: &Context,
    parent: &ParentLink,
    book: &mut Option<Ledger>,
    change: impl Fn(&mut Ledger) -> bool,
) -> Result<(), Error> {
    for _ in 0..MAX_ATTEMPTS {
        let mut ledger = match book.take() {
            Some(ledger) => ledger,
            None => mac_ledger::read(&ctx.client, parent).await?,
        };
        if !change(&mut ledger) {
            *book = Some(ledger);
            return Ok(());
        }
        if mac_ledger::write(&ctx.client, &mut ledger).await? {
            *book = Some(ledger);
            return Ok(());
        }
        ctx.metrics.allocation_conflict();
    }
    Err(Error::MacLedgerContention {
        parent: parent.to_string(),
        attempts: MAX_ATTEMPTS,
    })
}

/// Claims `needed` MACs of `range` (plus some ahead, kept spare) in one
/// ledger write; gives back the spare MACs that went stale, and writes the
/// releases queued for the link, in the same write.
async fn claim(
    ctx: &Context,
    link: &Link,
    book: &mut Option<Ledger>,
    parent: &ParentLink,
    range: MacRange,
    needed: usize,
) -> Result<Vec<ClaimedMac>, Error> {
    let stale = MacAhead::take_stale(ctx, link, range);
    let give_back: Vec<Mac> = stale
        .iter()
        .filter(|(_, at)| at.elapsed() < ctx.settings.orphan_grace / 2)
        .map(|(mac, _)| *mac)
        .collect();
    let releases = link.take_releases(ctx);
    let outside = outside_the_ledger(ctx, parent);
    let foreign = ctx.wire.foreign_macs();
    let written: Result<Vec<ClaimedMac>, Error> = async {
        for attempt in 1..=MAX_ATTEMPTS {
            let mut ledger = match book.take() {
                Some(ledger) => ledger,
                None => mac_ledger::read(&ctx.client, parent).await?,
            };
            for mac in &give_back {
                ledger.unclaim_from_pool(*mac, false);
            }
            releases.apply(&mut ledger);
            let mut in_use = ledger.claimed();
            in_use.extend(outside.iter().copied());
            let taken_in_range = u64::try_from(
                in_use
                    .iter()
                    .chain(&foreign)
                    .filter(|m| range.contains(**m))
                    .collect::<BTreeSet<_>>()
                    .len(),
            )
            .unwrap_or(u64::MAX);
            let free = range.len().saturating_sub(taken_in_range);
            let ahead = usize::try_from(free / AHEAD_SHARE)
                .unwrap_or(usize::MAX)
                .min(CLAIM_AHEAD);
            let macs = match ledger
                .pool
                .allocate_many(range, &in_use, &foreign, needed + ahead)
            {
                Ok(macs) => macs,
                Err(_) if ahead > 0 => ledger
                    .pool
                    .allocate_many(range, &in_use, &foreign, needed)?,
                Err(error) => return Err(error.into()),
            };
            ledger.claim_for_pool(&macs);
            // Before and after the write: the repair's clock of these MACs
            // starts no earlier than their claim.
            let name = mac_ledger::ledger_name(parent);
            ctx.orphans.pool_claimed(&name, &macs);
            if mac_ledger::write(&ctx.client, &mut ledger).await? {
                let at = Instant::now();
                ctx.orphans.pool_claimed(&name, &macs);
                *book = Some(ledger);
                let mut claimed: Vec<ClaimedMac> = macs.into_iter().map(|m| (m, at)).collect();
                let spare = claimed.split_off(needed);
                link.spare
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend(spare);
                debug!(%parent, needed, ahead, "pool MACs claimed");
                return Ok(claimed);
            }
            ctx.metrics.allocation_conflict();
            debug!(%parent, attempt, "MAC ledger changed since read; choosing again");
        }
        // Not given back: they stay spare-less claims the repair frees.
        Err(Error::MacLedgerContention {
            parent: parent.to_string(),
            attempts: MAX_ATTEMPTS,
        })
    }
    .await;
    if written.is_ok() {
        releases.answer(&Ok(()));
    } else {
        link.requeue(releases);
    }
    written
}

/// MACs in use on `parent` that the ledger may not know: `usedMac` of its
/// subnets and the MACs of cached records on them (left by versions
/// without the ledger, or kernel-chosen MACs the nodes reported). Only
/// avoided, never claimed.
fn outside_the_ledger(ctx: &Context, parent: &ParentLink) -> BTreeSet<Mac> {
    let subnets = ctx.caches.subnets.state();
    let on_link: BTreeSet<String> = subnets
        .iter()
        .filter(|s| s.spec.master == parent.master && s.spec.vlan == i64::from(parent.vlan))
        .map(|s| s.name_any())
        .collect();
    let mut macs = macs_in_use(parent, subnets.iter().map(AsRef::as_ref));
    macs.extend(
        ctx.caches
            .records
            .state()
            .iter()
            .filter(|r| on_link.contains(&r.spec.subnet))
            .filter_map(|r| Mac::parse(&r.status.as_ref()?.mac).ok()),
    );
    macs
}
