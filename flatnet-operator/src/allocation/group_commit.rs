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

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::Instant,
};

use flatnet_k8s::{
    api::FlatNetworkSubnet,
    ipam::{Pool, PoolError},
    keys::SUBNET_NAMESPACE,
    validation::ValidSubnet,
};
use kube::{Api, ResourceExt, api::PostParams};
use tokio::sync::oneshot;
use tracing::debug;

use super::{
    Context, Error,
    commit::{MAX_ATTEMPTS, ready_subnet},
    errors::{is_conflict, is_not_found},
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
    },
    /// The addresses are free (or were not held).
    Released,
}

/// Why a batch failed, for every edit in it (errors are not `Clone`).
#[derive(Clone, Debug)]
enum Failure {
    Pool(PoolError),
    Missing,
    NotReady(String),
    Api(String),
    Contention,
}

type Answer = Result<Committed, Failure>;

/// The ledger of one subnet as last read or written.
struct Book {
    subnet: FlatNetworkSubnet,
    valid: ValidSubnet,
    pool: Pool,
    /// Free in the ledger but held by V1 pods (`reservedIP`, migrator).
    v1_held: Vec<IpAddr>,
}

#[derive(Default)]
struct SubnetQueue {
    waiting: Mutex<Vec<(Edit, oneshot::Sender<Answer>)>>,
    book: tokio::sync::Mutex<Option<Book>>,
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

    /// Forgets the book of `subnet`, so the next batch reads the ledger.
    pub fn forget(&self, subnet: &str) {
        self.subnets
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(subnet);
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
        let (tx, mut rx) = oneshot::channel();
        queue
            .waiting
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((edit, tx));
        let mut book = queue.book.lock().await;
        // An earlier holder of the lock may have committed this edit.
        let answer = match rx.try_recv() {
            Ok(answer) => answer,
            Err(_) => {
                let batch =
                    std::mem::take(&mut *queue.waiting.lock().unwrap_or_else(|e| e.into_inner()));
                commit_batch(ctx, subnet, &mut book, batch).await;
                rx.try_recv().unwrap_or(Err(Failure::Contention))
            }
        };
        drop(book);
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
        })
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
    pool.reserve_ranges(&status.used_ip);
    // Addresses V1 pods still hold during a migration: never chosen, never
    // written to the ledger (no record of flatnet names them).
    let v1_held = status
        .held_by_v1()
        .into_iter()
        .filter(|ip| pool.is_allocatable(*ip) && !pool.is_used(*ip))
        .collect();
    Ok(Book {
        subnet,
        valid,
        pool,
        v1_held,
    })
}

/// Commits `batch` to the ledger of `name` and answers every edit in it.
async fn commit_batch(
    ctx: &Context,
    name: &str,
    book: &mut Option<Book>,
    batch: Vec<(Edit, oneshot::Sender<Answer>)>,
) {
    let api: Api<FlatNetworkSubnet> = Api::namespaced(ctx.client.clone(), SUBNET_NAMESPACE);
    let fail_all = |batch: Vec<(Edit, oneshot::Sender<Answer>)>, failure: Failure| {
        for (edit, tx) in batch {
            // Nothing to release in a subnet that is gone.
            let answer = match (&edit, &failure) {
                (Edit::Release { .. }, Failure::Missing) => Ok(Committed::Released),
                _ => Err(failure.clone()),
            };
            let _ = tx.send(answer);
        }
    };
    for attempt in 1..=MAX_ATTEMPTS {
        let current = match book.take() {
            Some(current) => current,
            None => match read_book(&api, name).await {
                Ok(read) => read,
                Err(failure) => return fail_all(batch, failure),
            },
        };
        let mut pool = current.pool.clone();
        for held in &current.v1_held {
            let _ = pool.mark_used(*held);
        }
        let mut changed = false;
        let answers: Vec<Result<Option<IpAddr>, PoolError>> = batch
            .iter()
            .map(|(edit, _)| match edit {
                Edit::Reserve { candidates } => {
                    let addr = if candidates.is_empty() {
                        pool.allocate_auto()
                    } else {
                        pool.allocate_requested(candidates)
                    }?;
                    changed = true;
                    Ok(Some(addr))
                }
                Edit::Release { addrs } => {
                    for addr in addrs {
                        changed |= pool.release(*addr);
                    }
                    Ok(None)
                }
            })
            .collect();
        let at = Instant::now();
        for held in &current.v1_held {
            pool.release(*held);
        }
        let written = if changed {
            let mut updated = current.subnet.clone();
            set_usage(updated.status.get_or_insert_with(Default::default), &pool);
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
                Err(error) if is_not_found(&error) => return fail_all(batch, Failure::Missing),
                Err(error) => return fail_all(batch, Failure::Api(error.to_string())),
            }
        } else {
            current.subnet.clone()
        };
        debug!(subnet = %name, edits = batch.len(), version = ?written.resource_version(), "ledger committed");
        for ((_, tx), answer) in batch.into_iter().zip(answers) {
            let answer = match answer {
                Ok(Some(addr)) => Ok(Committed::Reserved {
                    addr,
                    subnet: Box::new(current.valid.clone()),
                    at,
                }),
                Ok(None) => Ok(Committed::Released),
                Err(error) => Err(Failure::Pool(error)),
            };
            let _ = tx.send(answer);
        }
        *book = Some(Book {
            subnet: written,
            valid: current.valid,
            pool,
            v1_held: current.v1_held,
        });
        return;
    }
    fail_all(batch, Failure::Contention);
}
