//! Group commit of the address ledger: every reservation and release
//! waiting for a subnet goes into one `status.usedIP` write.
//!
//! Each subnet has a queue and a book: the ledger as last read or written
//! (its pool and `resourceVersion`), kept in memory. A caller queues its
//! edit and takes the book's lock; whoever holds the lock applies every
//! queued edit to a copy of the pool and replaces the subnet status with the
//! book's `resourceVersion`. On success the copy becomes the book and every
//! caller of the batch gets its answer; on 409 Conflict the book is read
//! again from the API server and the whole batch is chosen again. So the
//! API server still decides uniqueness (exactly one of two writes from the
//! same version wins), while an allocation costs neither a read nor a
//! rebuild of the pool from the records, and a busy subnet costs one ledger
//! write per batch, not per pod.
//!
//! A batch is as large as the allocations waiting at once, which the
//! controller's workers bound (5 by default). So the pod controller also
//! announces each record it is about to create ([`Ledgers::expect`]), and
//! a batch reserves addresses for up to [`Settings::reserve_ahead`](super::Settings::reserve_ahead) announced records as
//! well, in the same write. Such an address is held in memory for its
//! record ([`Ledgers::reserve`] hands it over when the record's allocation
//! comes) and is given back by a later batch when the record goes first or
//! nobody takes it within the write deadline. A new pod thus costs its
//! record's creation, its status write and a share of one ledger write.
//!
//! A release does not even wait for its batch ([`Ledgers::release`]): queued
//! while a write is under way, it is written by that write's caller right
//! after, with every release queued meanwhile, so a deleted pod costs a
//! share of a ledger write too.

use std::{
    collections::{HashMap, VecDeque},
    future::Future,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use flatnet_k8s::{
    api::FlatNetworkSubnet,
    ipam::{LiveAddresses, MacPoolExhausted, MacRange, Pool, PoolError, Reservations},
    keys::SUBNET_NAMESPACE,
    validation::{ParentLink, ValidSubnet},
};
use kube::{Api, ResourceExt, api::PostParams};
use tokio::sync::oneshot;
use tracing::debug;

use super::{
    Context, Error,
    commit::{MAX_ATTEMPTS, ready_subnet},
    errors::{is_conflict, is_not_found},
    mac_ahead::ClaimedMac,
    subnets::set_usage,
};

/// One change to a subnet's ledger.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Edit {
    /// Take a free address: the first free one when `candidates` is empty,
    /// else the first free candidate.
    Reserve {
        /// The requested addresses, if any.
        candidates: Vec<IpAddr>,
        /// The `reservedIP` key of the asking pod's workload: the addresses
        /// it reserved are its to take (see [`Reservations`]).
        workload: Option<String>,
        /// The MAC pool range to take the pod's MAC from, if it takes one.
        mac_pool: Option<MacRange>,
    },
    /// Give addresses back.
    Release {
        /// The addresses.
        addrs: Vec<IpAddr>,
    },
}

/// What an edit came to.
#[derive(Clone, Debug)]
pub enum Committed {
    /// The address reserved, in the subnet as validated at the write.
    Reserved {
        /// The address.
        addr: IpAddr,
        /// The subnet as written.
        subnet: Box<ValidSubnet>,
        /// When the ledger write succeeded.
        at: Instant,
        /// The pool MAC claimed for the pod, and when, if it asked for one.
        mac: Option<ClaimedMac>,
    },
    /// The addresses are free (or were not held).
    Released,
}

/// An address reserved ahead for an announced record.
#[derive(Clone, Debug)]
struct Held {
    addr: IpAddr,
    subnet: Box<ValidSubnet>,
    at: Instant,
}

/// Why a batch failed, for every edit in it (errors are not `Clone`).
#[derive(Clone, Debug)]
enum Failure {
    Pool(PoolError),
    Missing,
    NotReady(String),
    Api(String),
    Contention,
    MacPool(MacPoolExhausted),
}

type Answer = Result<Committed, Failure>;

/// The ledger of one subnet as last read or written.
struct Book {
    subnet: FlatNetworkSubnet,
    valid: ValidSubnet,
    pool: Pool,
    /// `status.reservedIP`: workloads' fixed addresses and V1 pods'.
    reservations: Reservations,
}

/// Edits waiting for a subnet's next batch, with where to answer each.
type Waiting = Mutex<Vec<(Edit, oneshot::Sender<Answer>)>>;

#[derive(Default)]
struct SubnetQueue {
    waiting: Waiting,
    book: tokio::sync::Mutex<Option<Book>>,
    ahead: Mutex<Ahead>,
}

/// Records announced by the pod controller and the addresses held for them.
#[derive(Default)]
struct Ahead {
    /// `namespace/name` and requested addresses of records about to be
    /// created, oldest first.
    announced: VecDeque<(String, Vec<IpAddr>)>,
    /// Addresses reserved for announced records, by `namespace/name`.
    held: HashMap<String, Held>,
    /// Records whose address a batch is reserving ahead right now.
    in_flight: Vec<String>,
    /// Held addresses nobody took (and when they were reserved), to give
    /// back in the next batch.
    unclaimed: Vec<(IpAddr, Instant)>,
}

/// What [`Ahead::take`] found for a record.
enum Take {
    Held(Held),
    /// A batch is reserving for it: wait for the book, then look again.
    InFlight,
    Nothing,
}

impl Ahead {
    fn take(&mut self, key: &str, candidates: &[IpAddr], deadline: Duration) -> Take {
        self.announced.retain(|(k, _)| k != key);
        if self.in_flight.iter().any(|k| k == key) {
            return Take::InFlight;
        }
        let Some(held) = self.held.remove(key) else {
            return Take::Nothing;
        };
        if held.at.elapsed() < deadline
            && (candidates.is_empty() || candidates.contains(&held.addr))
        {
            return Take::Held(held);
        }
        self.unclaimed.push((held.addr, held.at));
        Take::Nothing
    }

    /// Moves the held addresses nobody took within `deadline` to
    /// `unclaimed`, and returns those young enough to give back: a held
    /// address older than half the orphan grace is left to the subnet
    /// repair, which may free it from then on, so giving it back could free
    /// an address someone else has taken since.
    fn take_releasable(
        &mut self,
        deadline: Duration,
        orphan_grace: Duration,
    ) -> Vec<(IpAddr, Instant)> {
        let expired: Vec<String> = self
            .held
            .iter()
            .filter(|(_, h)| h.at.elapsed() >= deadline)
            .map(|(k, _)| k.clone())
            .collect();
        for key in expired {
            if let Some(held) = self.held.remove(&key) {
                self.unclaimed.push((held.addr, held.at));
            }
        }
        self.unclaimed
            .drain(..)
            .filter(|(_, at)| at.elapsed() < orphan_grace / 2)
            .collect()
    }
}

/// The queues and books of every subnet.
#[derive(Default)]
pub struct Ledgers {
    subnets: Mutex<HashMap<String, Arc<SubnetQueue>>>,
}

impl Ledgers {
    fn queue(&self, subnet: &str) -> Arc<SubnetQueue> {
        let mut subnets = self.subnets.lock().unwrap_or_else(|e| e.into_inner());
        Arc::clone(subnets.entry(subnet.to_owned()).or_default())
    }

    fn ahead<T>(&self, subnet: &str, f: impl FnOnce(&mut Ahead) -> T) -> T {
        let queue = self.queue(subnet);
        let mut ahead = queue.ahead.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut ahead)
    }

    /// Runs `work` (a writer of `subnet`'s ledger outside the batches)
    /// while no batch of `subnet` runs, then forgets the book, which `work`
    /// may have made stale.
    ///
    /// So a ledger edit decided on what the API server said during `work`
    /// cannot interleave with a release: the subnet repair adding back an
    /// address a live record names, for one, must not land after that
    /// record's release found the address absent and did nothing.
    pub async fn exclusive<T>(
        &self,
        ctx: &Context,
        subnet: &str,
        work: impl Future<Output = T>,
    ) -> T {
        let queue = self.queue(subnet);
        let mut book = queue.book.lock().await;
        let out = work.await;
        *book = None;
        drop(book);
        flush_left(ctx, subnet, &queue).await;
        out
    }

    /// Announces that record `key` (asking for `candidates`, or any address
    /// when empty) is about to be created in `subnet`, so the next batch may
    /// reserve its address ahead.
    pub fn expect(&self, subnet: &str, key: &str, candidates: &[IpAddr]) {
        self.ahead(subnet, |ahead| {
            ahead.announced.retain(|(k, _)| k != key);
            ahead
                .announced
                .push_back((key.to_owned(), candidates.to_vec()));
        });
    }

    /// Withdraws the announcement of record `key` (its creation failed, or
    /// it was deleted before its allocation) and gives back an address held
    /// for it.
    ///
    /// # Errors
    /// As [`Ledgers::commit`].
    pub async fn forsake(&self, ctx: &Context, subnet: &str, key: &str) -> Result<(), Error> {
        let mut held = false;
        for _ in 0..2 {
            let found = self.ahead(subnet, |ahead| {
                ahead.announced.retain(|(k, _)| k != key);
                if ahead.in_flight.iter().any(|k| k == key) {
                    return Take::InFlight;
                }
                match ahead.held.remove(key) {
                    Some(found) => {
                        ahead.unclaimed.push((found.addr, found.at));
                        Take::Held(found)
                    }
                    None => Take::Nothing,
                }
            });
            match found {
                // The batch holds the book until its answer is in `held`.
                Take::InFlight => self.wait_for_batch(ctx, subnet).await,
                Take::Held(_) => {
                    held = true;
                    break;
                }
                Take::Nothing => break,
            }
        }
        if !held {
            return Ok(());
        }
        // A batch gives back whatever is unclaimed. A subnet that cannot
        // allocate (being deleted) leaves it to the repair.
        match self
            .commit(ctx, subnet, Edit::Release { addrs: Vec::new() })
            .await
        {
            Ok(_) | Err(Error::SubnetNotReady { .. }) => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// Gives back, in one ledger write per subnet, the addresses held ahead
    /// that nobody took within the write deadline (and those already
    /// forsaken), with the releases whose write failed and were queued
    /// again: a subnet that goes quiet after a burst has no later batch to
    /// write them, and would keep them until the orphan grace.
    pub async fn give_back_expired(&self, ctx: &Context) {
        let deadline = ctx.settings.write_deadline;
        let due: Vec<String> = {
            let subnets = self.subnets.lock().unwrap_or_else(|e| e.into_inner());
            subnets
                .iter()
                .filter(|(_, queue)| {
                    let ahead = queue.ahead.lock().unwrap_or_else(|e| e.into_inner());
                    !ahead.unclaimed.is_empty()
                        || ahead.held.values().any(|h| h.at.elapsed() >= deadline)
                        || !queue
                            .waiting
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .is_empty()
                })
                .map(|(name, _)| name.clone())
                .collect()
        };
        for subnet in due {
            let release = Edit::Release { addrs: Vec::new() };
            if let Err(error) = self.commit(ctx, &subnet, release).await {
                debug!(%subnet, %error, "held addresses not given back yet");
            }
        }
    }

    /// Whether an address is held ahead for record `key`, or it is
    /// announced (tests and benchmarks).
    #[must_use]
    pub fn is_expected(&self, subnet: &str, key: &str) -> bool {
        self.ahead(subnet, |ahead| {
            ahead.held.contains_key(key) || ahead.announced.iter().any(|(k, _)| k == key)
        })
    }

    /// Reserves an address for record `key` of a pod of `workload` (its
    /// `reservedIP` key, needed only when it asks for `candidates`), and a
    /// MAC from `mac_pool` when given: the address held ahead for it when
    /// it is still young enough to be written, else through a batch like
    /// any [`Edit::Reserve`].
    ///
    /// # Errors
    /// As [`Ledgers::commit`].
    pub async fn reserve(
        &self,
        ctx: &Context,
        subnet: &str,
        key: &str,
        candidates: &[IpAddr],
        workload: Option<&str>,
        mac_pool: Option<MacRange>,
    ) -> Result<Committed, Error> {
        let deadline = ctx.settings.write_deadline;
        for _ in 0..2 {
            match self.ahead(subnet, |ahead| ahead.take(key, candidates, deadline)) {
                Take::Held(held) => {
                    let mac = match mac_pool {
                        None => None,
                        Some(range) => {
                            let taken = ctx
                                .mac_pool
                                .ahead
                                .take(ctx, &held.subnet.parent, range, 1)
                                .await;
                            match taken {
                                Ok(mut macs) => macs.pop(),
                                Err(error) => {
                                    // The next batch gives the address back.
                                    self.ahead(subnet, |a| a.unclaimed.push((held.addr, held.at)));
                                    return Err(error);
                                }
                            }
                        }
                    };
                    return Ok(Committed::Reserved {
                        addr: held.addr,
                        subnet: held.subnet,
                        at: held.at,
                        mac,
                    });
                }
                // The batch holds the book until its answer is in `held`.
                Take::InFlight => self.wait_for_batch(ctx, subnet).await,
                Take::Nothing => break,
            }
        }
        self.commit(
            ctx,
            subnet,
            Edit::Reserve {
                candidates: candidates.to_vec(),
                workload: workload.map(str::to_owned),
                mac_pool,
            },
        )
        .await
    }

    /// Applies `edit` to `subnet`'s ledger, together with whatever else is
    /// waiting for it.
    ///
    /// # Errors
    /// Subnet missing or not ready, nothing allocatable, the API failing,
    /// or [`Error::Contention`] after [`MAX_ATTEMPTS`] conflicts.
    pub async fn commit(
        &self,
        ctx: &Context,
        subnet: &str,
        edit: Edit,
    ) -> Result<Committed, Error> {
        let queue = self.queue(subnet);
        let rx = queue.push(edit);
        let book = queue.book.lock().await;
        let answer = answer_as_holder(ctx, subnet, &queue, book, rx).await;
        Self::answer(subnet, answer)
    }

    /// Releases `addrs` in `subnet`'s ledger without waiting behind a batch
    /// being written: when one is, its writer takes the release with the
    /// edits that queued up meanwhile, in one write (see [`flush_left`]),
    /// and this returns at once. So a burst of deletions costs a ledger
    /// write per batch of releases, not one per few releases, which is what
    /// bounded the rate at which pods were replaced. A release whose write
    /// fails is queued again, for the next batch or the timer
    /// ([`Ledgers::give_back_expired`]).
    ///
    /// # Errors
    /// As [`Ledgers::commit`], when this call wrote the ledger itself.
    pub async fn release(
        &self,
        ctx: &Context,
        subnet: &str,
        addrs: Vec<IpAddr>,
    ) -> Result<(), Error> {
        let queue = self.queue(subnet);
        let rx = queue.push(Edit::Release { addrs });
        let Ok(book) = queue.book.try_lock() else {
            // The writer of the batch under way writes it next.
            return Ok(());
        };
        let answer = answer_as_holder(ctx, subnet, &queue, book, rx).await;
        Self::answer(subnet, answer).map(|_| ())
    }

    /// Waits until the batch under way (which holds the book until its
    /// answers are in) is done, then writes what queued up meanwhile.
    async fn wait_for_batch(&self, ctx: &Context, subnet: &str) {
        let queue = self.queue(subnet);
        drop(queue.book.lock().await);
        flush_left(ctx, subnet, &queue).await;
    }

    fn answer(subnet: &str, answer: Answer) -> Result<Committed, Error> {
        answer.map_err(|failure| match failure {
            Failure::Pool(error) => Error::Pool(error),
            Failure::Missing => Error::SubnetMissing {
                subnet: subnet.to_owned(),
            },
            Failure::NotReady(reason) => Error::SubnetNotReady {
                subnet: subnet.to_owned(),
                reason,
            },
            Failure::Api(message) => Error::LedgerWrite {
                subnet: subnet.to_owned(),
                message,
            },
            Failure::Contention => Error::Contention {
                subnet: subnet.to_owned(),
                attempts: MAX_ATTEMPTS,
            },
            Failure::MacPool(error) => Error::MacPool(error),
        })
    }
}

impl SubnetQueue {
    /// Queues `edit` for the next batch; its answer comes on the receiver.
    fn push(&self, edit: Edit) -> oneshot::Receiver<Answer> {
        let (tx, rx) = oneshot::channel();
        self.waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((edit, tx));
        rx
    }
}

/// As the holder of `queue`'s book: the answer `rx` waits for, committing
/// what waits unless an earlier holder already committed it; then, with
/// the book let go, what queued up meanwhile.
async fn answer_as_holder(
    ctx: &Context,
    subnet: &str,
    queue: &SubnetQueue,
    mut book: tokio::sync::MutexGuard<'_, Option<Book>>,
    mut rx: oneshot::Receiver<Answer>,
) -> Answer {
    let answer = match rx.try_recv() {
        Ok(answer) => answer,
        Err(_) => {
            commit_waiting(ctx, subnet, queue, &mut book).await;
            rx.try_recv().unwrap_or(Err(Failure::Contention))
        }
    };
    drop(book);
    flush_left(ctx, subnet, queue).await;
    answer
}

/// Commits every edit waiting for `queue`'s subnet (the caller holds its
/// book). Whether the ledger was written (or needed no write).
async fn commit_waiting(
    ctx: &Context,
    subnet: &str,
    queue: &SubnetQueue,
    book: &mut Option<Book>,
) -> bool {
    let batch = std::mem::take(&mut *queue.waiting.lock().unwrap_or_else(|e| e.into_inner()));
    commit_batch(ctx, subnet, queue, book, batch).await
}

/// Writes the edits queued while the book was held, unless another caller
/// holds it now (which then writes them). Called after the book is let go:
/// an edit queued by [`Ledgers::release`] while it was held is either seen
/// here or finds the book free itself, so none is left behind.
async fn flush_left(ctx: &Context, subnet: &str, queue: &SubnetQueue) {
    let waiting = || {
        !queue
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    };
    // Edits queued while this writes are this caller's to write too, for
    // as long as writes succeed: releases whose write failed (queued
    // again) are left to the next batch or the timer, not retried here
    // without end.
    while waiting() {
        let Ok(mut book) = queue.book.try_lock() else {
            // Its holder writes them.
            return;
        };
        if !commit_waiting(ctx, subnet, queue, &mut book).await {
            return;
        }
    }
}

/// Reads the ledger of `name` into a book.
async fn read_book(api: &Api<FlatNetworkSubnet>, name: &str) -> Result<Book, Failure> {
    let subnet = api
        .get_opt(name)
        .await
        .map_err(|e| Failure::Api(e.to_string()))?
        .ok_or(Failure::Missing)?;
    let valid = ready_subnet(&subnet).map_err(|e| match e {
        Error::SubnetNotReady { reason, .. } => Failure::NotReady(reason),
        other => Failure::NotReady(other.to_string()),
    })?;
    let mut pool = Pool::new(&valid);
    let status = subnet.status.clone().unwrap_or_default();
    pool.reserve_ranges(&status.used_ranges());
    let reservations = Reservations::of(&status);
    Ok(Book {
        subnet,
        valid,
        pool,
        reservations,
    })
}

/// Commits `batch` to the ledger of `name` and answers every edit in it;
/// gives back the held addresses nobody took and reserves ahead for the
/// records announced meanwhile, in the same write.
async fn commit_batch(
    ctx: &Context,
    name: &str,
    queue: &SubnetQueue,
    book: &mut Option<Book>,
    batch: Vec<(Edit, oneshot::Sender<Answer>)>,
) -> bool {
    let lock_ahead = || queue.ahead.lock().unwrap_or_else(|e| e.into_inner());
    let (release_ahead, announced) = {
        let mut ahead = lock_ahead();
        let release = ahead.take_releasable(ctx.settings.write_deadline, ctx.settings.orphan_grace);
        // A record announced again while an address is held for it keeps
        // that one: a second would replace it in `held`, never given back.
        let mut announced: Vec<(String, Vec<IpAddr>)> = Vec::new();
        while announced.len() < ctx.settings.reserve_ahead {
            let Some(next) = ahead.announced.pop_front() else {
                break;
            };
            if !ahead.held.contains_key(&next.0) {
                announced.push(next);
            }
        }
        ahead.in_flight = announced.iter().map(|(k, _)| k.clone()).collect();
        (release, announced)
    };
    let held = write_batch(
        ctx,
        name,
        &queue.waiting,
        book,
        batch,
        &release_ahead,
        &announced,
    )
    .await;
    let mut ahead = lock_ahead();
    ahead.in_flight.clear();
    match held {
        Some(held) => {
            for (key, hold) in held {
                if let Some(earlier) = ahead.held.insert(key, hold) {
                    ahead.unclaimed.push((earlier.addr, earlier.at));
                }
            }
            true
        }
        // Not written: the next batch tries again.
        None => {
            ahead.unclaimed.extend(release_ahead);
            false
        }
    }
}

/// Writes `batch`, the release of `release_ahead` and reservations for
/// `announced` into one ledger write, rereading and choosing again on
/// conflict; answers every edit of `batch`. Returns the addresses reserved
/// ahead, or `None` when nothing was written.
async fn write_batch(
    ctx: &Context,
    name: &str,
    queue_waiting: &Waiting,
    book: &mut Option<Book>,
    batch: Vec<(Edit, oneshot::Sender<Answer>)>,
    release_ahead: &[(IpAddr, Instant)],
    announced: &[(String, Vec<IpAddr>)],
) -> Option<Vec<(String, Held)>> {
    let api: Api<FlatNetworkSubnet> = Api::namespaced(ctx.client.clone(), SUBNET_NAMESPACE);
    let fail_all = |batch: Vec<(Edit, oneshot::Sender<Answer>)>, failure: Failure| {
        let mut again = Vec::new();
        for (edit, tx) in batch {
            // Nothing to release in a subnet that is gone.
            let answer = match (&edit, &failure) {
                (Edit::Release { .. }, Failure::Missing) => Ok(Committed::Released),
                // A release nobody waits for (see `Ledgers::release`) is
                // tried again by the next batch; a subnet that cannot
                // allocate leaves it to the repair.
                (Edit::Release { .. }, Failure::Api(_) | Failure::Contention) if tx.is_closed() => {
                    again.push((edit, tx));
                    continue;
                }
                _ => Err(failure.clone()),
            };
            let _ = tx.send(answer);
        }
        if !again.is_empty() {
            queue_waiting
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(again);
        }
        None
    };
    let live = ctx.wire.avoided(name);
    // The batch's pool MACs, taken once (a conflict re-chooses addresses only).
    let mut macs: Option<BatchMacs> = None;
    let give_back = |macs: Option<BatchMacs>| {
        if let Some(macs) = macs {
            macs.give_back(ctx, |_| true);
        }
    };
    for attempt in 1..=MAX_ATTEMPTS {
        let current = match book.take() {
            Some(current) => current,
            None => match read_book(&api, name).await {
                Ok(read) => read,
                Err(failure) => {
                    give_back(macs);
                    return fail_all(batch, failure);
                }
            },
        };
        if macs.is_none() {
            macs = Some(BatchMacs::take(ctx, &current.valid.parent, &batch).await);
        }
        let batch_macs = macs.as_ref().map_or(&[][..], |m| &m.macs[..]);
        let mut pool = current.pool.clone();
        let mut changed = false;
        for (addr, _) in release_ahead {
            changed |= pool.release(*addr);
        }
        // Reserved addresses free in the ledger are held as used for the
        // batch: never chosen, never written to the ledger, except the ones
        // a pod of the reserving workload asks for.
        let mut kept_out = KeptOut::new(&current.reservations, &mut pool);
        let answers: Vec<Result<Option<IpAddr>, Failure>> = batch
            .iter()
            .zip(batch_macs)
            .map(|((edit, _), mac)| match edit {
                Edit::Reserve {
                    candidates,
                    workload,
                    ..
                } => {
                    mac.clone()?;
                    let addr = kept_out
                        .reserve(&mut pool, candidates, workload.as_deref(), &live)
                        .map_err(Failure::Pool)?;
                    changed = true;
                    Ok(Some(addr))
                }
                Edit::Release { addrs } => {
                    for addr in addrs {
                        changed |= kept_out.release(&mut pool, *addr);
                    }
                    Ok(None)
                }
            })
            .collect();
        // A record whose address cannot be reserved ahead gets its answer
        // (and the Event saying why) from its own allocation.
        let ahead: Vec<(String, IpAddr)> = announced
            .iter()
            .filter_map(|(key, candidates)| {
                Some((key.clone(), reserve_in(&mut pool, candidates, &live).ok()?))
            })
            .collect();
        changed |= !ahead.is_empty();
        let at = Instant::now();
        kept_out.give_back(&mut pool);
        let written = if changed {
            let mut updated = current.subnet.clone();
            let generation = updated.metadata.generation;
            set_usage(
                updated.status.get_or_insert_with(Default::default),
                &pool,
                generation,
            );
            match api
                .replace_status(name, &PostParams::default(), &updated)
                .await
            {
                Ok(written) => written,
                Err(error) if is_conflict(&error) => {
                    ctx.metrics.allocation_conflict();
                    debug!(subnet = %name, attempt, "ledger changed since read; choosing again");
                    continue;
                }
                Err(error) if is_not_found(&error) => {
                    give_back(macs);
                    return fail_all(batch, Failure::Missing);
                }
                Err(error) => {
                    give_back(macs);
                    return fail_all(batch, Failure::Api(error.to_string()));
                }
            }
        } else {
            current.subnet.clone()
        };
        let reserved: Vec<IpAddr> = answers
            .iter()
            .filter_map(|answer| *answer.as_ref().ok()?)
            .chain(ahead.iter().map(|(_, addr)| *addr))
            .collect();
        ctx.orphans.reserved(name, &reserved);
        debug!(subnet = %name, edits = batch.len(), ahead = ahead.len(), version = ?written.resource_version(), "ledger committed");
        let valid = Box::new(current.valid.clone());
        let macs = macs.unwrap_or_default();
        // MACs of edits that reserved nothing stay claimed, spare.
        macs.give_back(ctx, |i| !matches!(answers[i], Ok(Some(_))));
        for (((_, tx), answer), mac) in batch.into_iter().zip(answers).zip(macs.macs) {
            let answer = match answer {
                Ok(Some(addr)) => Ok(Committed::Reserved {
                    addr,
                    subnet: valid.clone(),
                    at,
                    mac: mac.ok().flatten(),
                }),
                Ok(None) => Ok(Committed::Released),
                Err(failure) => Err(failure),
            };
            let _ = tx.send(answer);
        }
        *book = Some(Book {
            subnet: written,
            valid: current.valid,
            pool,
            reservations: current.reservations,
        });
        let held = ahead
            .into_iter()
            .map(|(key, addr)| {
                let subnet = valid.clone();
                (key, Held { addr, subnet, at })
            })
            .collect();
        return Some(held);
    }
    give_back(macs);
    fail_all(batch, Failure::Contention)
}

/// The pool MACs of a batch, by edit: `Ok(None)` for an edit taking none.
#[derive(Default)]
struct BatchMacs {
    parent: Option<ParentLink>,
    macs: Vec<Result<Option<ClaimedMac>, Failure>>,
}

impl BatchMacs {
    /// Takes a MAC for every reservation of `batch` asking for one from
    /// the pool, in as few MAC ledger writes as there are ranges asked for
    /// (one; none when enough were claimed ahead).
    async fn take(
        ctx: &Context,
        parent: &ParentLink,
        batch: &[(Edit, oneshot::Sender<Answer>)],
    ) -> Self {
        let wanted: Vec<Option<MacRange>> = batch
            .iter()
            .map(|(edit, _)| match edit {
                Edit::Reserve { mac_pool, .. } => *mac_pool,
                Edit::Release { .. } => None,
            })
            .collect();
        let mut macs: Vec<Result<Option<ClaimedMac>, Failure>> =
            wanted.iter().map(|_| Ok(None)).collect();
        let mut ranges: Vec<MacRange> = Vec::new();
        for range in wanted.iter().flatten() {
            if !ranges.contains(range) {
                ranges.push(*range);
            }
        }
        for range in ranges {
            let edits: Vec<usize> = (0..wanted.len())
                .filter(|i| wanted[*i] == Some(range))
                .collect();
            match ctx
                .mac_pool
                .ahead
                .take(ctx, parent, range, edits.len())
                .await
            {
                Ok(taken) => {
                    for (i, mac) in edits.into_iter().zip(taken) {
                        macs[i] = Ok(Some(mac));
                    }
                }
                Err(error) => {
                    let failure = match error {
                        Error::MacPool(exhausted) => Failure::MacPool(exhausted),
                        other => Failure::Api(other.to_string()),
                    };
                    for i in edits {
                        macs[i] = Err(failure.clone());
                    }
                }
            }
        }
        Self {
            parent: Some(parent.clone()),
            macs,
        }
    }

    /// Returns the MACs of the edits `which` selects to the spare MACs.
    fn give_back(&self, ctx: &Context, which: impl Fn(usize) -> bool) {
        let Some(parent) = &self.parent else {
            return;
        };
        let unused: Vec<ClaimedMac> = self
            .macs
            .iter()
            .enumerate()
            .filter(|(i, _)| which(*i))
            .filter_map(|(_, mac)| mac.clone().ok().flatten())
            .collect();
        ctx.mac_pool.ahead.put_back(parent, unused);
    }
}

/// The reserved addresses a batch holds as used in its pool.
struct KeptOut<'a> {
    reservations: &'a Reservations,
    addrs: Vec<IpAddr>,
}

impl<'a> KeptOut<'a> {
    /// Holds every reserved address free in `pool`.
    fn new(reservations: &'a Reservations, pool: &mut Pool) -> Self {
        let addrs: Vec<IpAddr> = reservations.free_in(pool).collect();
        for addr in &addrs {
            let _ = pool.mark_used(*addr);
        }
        Self {
            reservations,
            addrs,
        }
    }

    /// Reserves for a pod of `workload`: its own reserved addresses are
    /// free for this one choice.
    fn reserve(
        &mut self,
        pool: &mut Pool,
        candidates: &[IpAddr],
        workload: Option<&str>,
        live: &LiveAddresses,
    ) -> Result<IpAddr, PoolError> {
        let own: Vec<IpAddr> = if candidates.is_empty() {
            Vec::new()
        } else {
            self.reservations.own(&self.addrs, workload).collect()
        };
        for addr in &own {
            pool.release(*addr);
        }
        let result = reserve_in(pool, candidates, live);
        for addr in &own {
            if result.as_ref() != Ok(addr) {
                let _ = pool.mark_used(*addr);
            }
        }
        let addr = result.map_err(|error| self.reservations.explain(error, workload))?;
        self.addrs.retain(|held| *held != addr);
        Ok(addr)
    }

    /// Releases `addr`; a reserved one is held again. Whether the ledger
    /// changed.
    fn release(&mut self, pool: &mut Pool, addr: IpAddr) -> bool {
        let released = pool.release(addr);
        if released && self.reservations.is_reserved(addr) {
            let _ = pool.mark_used(addr);
            self.addrs.push(addr);
        }
        released
    }

    /// Frees the held addresses in `pool` before it is written.
    fn give_back(self, pool: &mut Pool) {
        for addr in self.addrs {
            pool.release(addr);
        }
    }
}

/// The first free address not live on the wire, or the first such one of
/// `candidates`.
fn reserve_in(
    pool: &mut Pool,
    candidates: &[IpAddr],
    live: &LiveAddresses,
) -> Result<IpAddr, PoolError> {
    live.allocate(pool, candidates)
}
