//! Chaos runs: two operator replicas, elected through the fake API server's
//! Lease with the operator's own [`leader`] code, run the allocation
//! controllers through thousands of seeded random operations (pod creates
//! and deletes, StatefulSet scaling, subnet range edits, node deletions)
//! while replicas are killed and restarted at random points and the server
//! injects conflicts, errors, timeouts, cut watches and deaths in the middle
//! of a request, including between a ledger write and its record write.
//!
//! After every burst of operations no address and no fixed MAC may be held
//! by two live records; at every quiet point (and at the end) every pod is
//! addressed, and the ledgers (`usedIP`, `usedMac`, the MAC ledger) hold
//! exactly what live records name: nothing leaked once the grace periods
//! have passed. A replica is killed by shutting down its Tokio runtime, so
//! everything it ran stops at once, as a killed process does.
//!
//! `cargo xtask chaos [--seed N] [--ops N]` runs it; the seed reproduces a
//! run's operations and faults (the interleaving with the controllers
//! depends on timing, as on a real cluster).

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::IpAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use flatnet_k8s::{
    api::{FlatNetworkIP, FlatNetworkSubnet, IpRange},
    ipam::Mac,
    keys::SUBNET_NAMESPACE,
};
use k8s_openapi::api::{
    apps::v1::StatefulSet,
    core::v1::{ConfigMap, Node, Pod},
};
use kube::{
    Api,
    api::{Patch, PatchParams},
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::{
    admin::Health,
    allocation::{
        self, Settings,
        fake_api::{
            Access, FakeApiServer, Realism,
            faults::{FaultRates, Faults},
        },
        fake_cluster::{POD_NAMESPACE, View, subnet},
        mac_ledger::LEDGER_PREFIX,
    },
    config::ElectionTiming,
    leader::{self, Outcome},
    metrics::Metrics,
};

/// The subnet of the run: a /24 whose ranges the run edits.
const SUBNET: &str = "chaos";
/// Range sets the edits switch between; each leaves room for every pod.
const RANGES: [&[(&str, &str)]; 3] = [
    &[("10.7.0.10", "10.7.0.250")],
    &[("10.7.0.10", "10.7.0.160")],
    &[("10.7.0.10", "10.7.0.100"), ("10.7.0.120", "10.7.0.250")],
];
/// Most plain pods alive at once.
const MAX_PODS: usize = 90;
/// StatefulSets and their largest scale.
const STATEFULSETS: [&str; 2] = ["db", "web"];
const MAX_REPLICAS: usize = 6;
/// Nodes pods are bound to.
const NODES: usize = 4;
/// Fixed MACs pods may ask for.
const MACS: u8 = 40;
/// Controller workers of each replica.
const WORKERS: u16 = 4;
/// How long a quiet point may take: the grace periods below, a replica
/// restart and a lease takeover, and retries of injected faults, on a
/// loaded machine.
const SETTLE: Duration = Duration::from_secs(120);
/// The Lease the replicas campaign on.
const LEASE: &str = "flatnet-operator";

/// What a run does.
#[derive(Clone, Debug)]
pub struct Options {
    /// Seed of the operations, kills and faults.
    pub seed: u64,
    /// Operations to run.
    pub ops: usize,
    /// Operations between quiet points.
    pub quiet_every: usize,
    /// Kills of a random replica per million operations.
    pub kills: u32,
    /// The server's faults.
    pub rates: FaultRates,
    /// Go on after an invariant broke (to see what the run asks of the API
    /// server whatever happens); the first break is still the outcome.
    pub keep_going: bool,
    /// How long a quiet point may take.
    pub settle: Duration,
}

impl Options {
    /// `ops` operations from `seed` at the default rates.
    #[must_use]
    pub fn new(seed: u64, ops: usize) -> Self {
        Self {
            seed,
            ops,
            quiet_every: 1000,
            kills: 4_000,
            rates: FaultRates::default(),
            keep_going: false,
            settle: SETTLE,
        }
    }
}

/// The controllers' settings: grace periods short enough to pass many
/// times within a run, in the proportions the operator requires.
fn settings() -> Settings {
    Settings {
        pending_timeout: Duration::from_secs(3600),
        resync: Duration::from_secs(5),
        orphan_grace: Duration::from_secs(5),
        write_deadline: Duration::from_secs(1),
        node_gone_grace: Duration::from_secs(1),
        ..Settings::default()
    }
}

/// The figures of a run.
#[derive(Debug, Default)]
pub struct Report {
    /// Seed.
    pub seed: u64,
    /// Operations by kind.
    pub ops: BTreeMap<&'static str, u64>,
    /// Replica kills and exits by cause.
    pub kills: BTreeMap<&'static str, u64>,
    /// Injected faults by kind.
    pub faults: BTreeMap<&'static str, u64>,
    /// Invariant checks passed: after each burst and at each quiet point.
    pub checks: u64,
    /// Quiet points reached.
    pub quiet_points: u64,
    /// Times a replica became leader.
    pub terms: u64,
    /// Samples at which both replicas believed they led (a lease taken
    /// over from a holder that has not noticed yet).
    pub overlaps: u64,
    /// Requests the server answered.
    pub requests: u64,
    /// The kinds of request the replicas sent.
    pub accesses: BTreeSet<Access>,
    /// Wall time.
    pub elapsed: Duration,
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let total = |m: &BTreeMap<&'static str, u64>| m.values().sum::<u64>();
        let list = |m: &BTreeMap<&'static str, u64>| {
            m.iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        writeln!(f, "chaos seed {} ({:.0?})", self.seed, self.elapsed)?;
        writeln!(f, "operations: {} ({})", total(&self.ops), list(&self.ops))?;
        writeln!(
            f,
            "replica kills and exits: {} ({})",
            total(&self.kills),
            list(&self.kills)
        )?;
        writeln!(
            f,
            "injected faults: {} ({})",
            total(&self.faults),
            list(&self.faults)
        )?;
        writeln!(
            f,
            "invariant checks: {} passed, {} quiet points",
            self.checks, self.quiet_points
        )?;
        write!(
            f,
            "leader terms: {}, samples with two leaders: {}, API requests: {}",
            self.terms, self.overlaps, self.requests
        )
    }
}

/// Why a run failed.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    /// An invariant broke.
    #[error(
        "seed {seed}, after {done} operations: {broken} (FLATNET_CHAOS_SEED={seed} replays the run)"
    )]
    Broken {
        /// Seed.
        seed: u64,
        /// Operations done.
        done: usize,
        /// What broke.
        broken: String,
    },
    /// A replica's runtime could not be built.
    #[error("cannot start a replica: {0}")]
    Runtime(#[from] std::io::Error),
}

/// xorshift64: the run's seeded choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n.max(1) as u64).unwrap_or_default()
    }

    /// True `per_million` times in a million.
    fn chance(&mut self, per_million: u32) -> bool {
        self.next() % 1_000_000 < u64::from(per_million)
    }
}

/// One operator replica: leader election and, while it leads, the
/// allocation controllers, on a runtime of its own.
struct Replica {
    identity: String,
    /// The server's client id of this process (new at each restart).
    client: u64,
    runtime: Option<tokio::runtime::Runtime>,
    leading: Arc<AtomicBool>,
    ended: Arc<Mutex<Option<&'static str>>>,
    restart_at: Option<Instant>,
}

impl Replica {
    fn start(identity: &str, client: u64, server: &FakeApiServer) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name(identity)
            .enable_all()
            .build()?;
        let leading = Arc::new(AtomicBool::new(false));
        let ended = Arc::new(Mutex::new(None));
        let server = server.for_client(client);
        let (lead, end, name) = (
            Arc::clone(&leading),
            Arc::clone(&ended),
            identity.to_owned(),
        );
        runtime.spawn(async move {
            let client = server.client();
            let timing = ElectionTiming {
                lease_duration: Duration::from_secs(2),
                renew_deadline: Duration::from_secs(1),
                retry_period: Duration::from_secs(1),
            };
            let why =
                match leader::campaign(client.clone(), LEASE, SUBNET_NAMESPACE, &name, &timing)
                    .await
                {
                    Err(_) => "exit: lease not set up",
                    Ok((claims, _election)) => {
                        let outcome = leader::run_while_leader(
                            claims,
                            CancellationToken::new(),
                            |leads| lead.store(leads, Ordering::SeqCst),
                            |stop| {
                                allocation::run(
                                    client,
                                    Arc::new(Metrics::new()),
                                    settings(),
                                    WORKERS,
                                    allocation::mac_pool::MacPoolView::new(mac_pool()),
                                    Arc::new(Health::default()),
                                    stop,
                                )
                            },
                        )
                        .await;
                        match outcome {
                            Outcome::LeaseLost => "exit: lease lost",
                            Outcome::ControllersEnded => "exit: controllers ended",
                            Outcome::Shutdown => "exit: shutdown",
                        }
                    }
                };
            *end.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
        });
        Ok(Self {
            identity: identity.to_owned(),
            client,
            runtime: Some(runtime),
            leading,
            ended,
            restart_at: None,
        })
    }

    /// Kills the process: every task of its runtime stops where it is.
    fn kill(&mut self, restart_in: Duration) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
        self.leading.store(false, Ordering::SeqCst);
        self.restart_at = Some(Instant::now() + restart_in);
    }

    fn alive(&self) -> bool {
        self.runtime.is_some()
    }

    fn ended(&self) -> Option<&'static str> {
        *self.ended.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The cluster as the run drives it, and the replicas.
struct Run {
    server: FakeApiServer,
    user: kube::Client,
    faults: Arc<Faults>,
    rng: Rng,
    /// Choices that depend on timing (restart delays), apart so that the
    /// operations of a seed do not.
    timing: Rng,
    replicas: Vec<Replica>,
    next_client: u64,
    /// Plain pods alive, with their node.
    pods: BTreeMap<String, String>,
    next_pod: u64,
    /// Scale of each StatefulSet, with its uid.
    sets: BTreeMap<&'static str, (String, usize)>,
    /// Nodes deleted and not back.
    missing_nodes: BTreeSet<String>,
    report: Report,
    was_leading: Vec<bool>,
    kill_rate: u32,
}

fn node_name(i: usize) -> String {
    format!("node-{i}")
}

fn mac(i: u8) -> Mac {
    Mac([0x02, 0xfa, 0, 0, 0, i])
}

fn ranges(set: &[(&str, &str)]) -> Vec<IpRange> {
    set.iter()
        .map(|(f, t)| {
            IpRange::new(
                f.parse().expect("literal address"),
                t.parse().expect("literal address"),
            )
        })
        .collect()
}

impl Run {
    fn count_op(&mut self, kind: &'static str) {
        *self.report.ops.entry(kind).or_insert(0) += 1;
    }

    fn count_kill(&mut self, kind: &'static str) {
        *self.report.kills.entry(kind).or_insert(0) += 1;
    }

    fn present_node(&mut self) -> String {
        let present: Vec<String> = (0..NODES)
            .map(node_name)
            .filter(|n| !self.missing_nodes.contains(n))
            .collect();
        present[self.rng.below(present.len())].clone()
    }

    fn pod(name: &str, node: &str, mac: Option<Mac>, owner: Option<(&str, &str)>) -> Pod {
        let mut annotations = json!({
            "flatnetwork.pandaria.io/ip": "auto",
            "flatnetwork.pandaria.io/subnet": SUBNET,
        });
        if let Some(mac) = mac {
            annotations["flatnetwork.pandaria.io/mac"] = json!(mac.to_string());
        }
        let owners = owner.map_or_else(Vec::new, |(set, uid)| {
            vec![
                json!({"apiVersion": "apps/v1", "kind": "StatefulSet", "name": set,
                        "uid": uid, "controller": true}),
            ]
        });
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": POD_NAMESPACE,
                         "annotations": annotations, "ownerReferences": owners},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": "pause"}]}
        }))
        .expect("pod literal")
    }

    /// A fixed MAC no record and no ledger claim holds, now and then.
    fn free_mac(&mut self) -> Option<Mac> {
        if self.rng.below(3) != 0 {
            return None;
        }
        let mut taken: BTreeSet<Mac> = BTreeSet::new();
        for record in self.server.list::<FlatNetworkIP>() {
            taken.extend(record.spec.macs.iter().filter_map(|m| Mac::parse(m).ok()));
        }
        taken.extend(ledger_macs(&self.server));
        for pod in self.server.list::<Pod>() {
            let wanted = pod
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("flatnetwork.pandaria.io/mac"))
                .and_then(|m| Mac::parse(m).ok());
            taken.extend(wanted);
        }
        let pick = self.rng.next();
        let free: Vec<Mac> = (1..=MACS).map(mac).filter(|m| !taken.contains(m)).collect();
        let len = u64::try_from(free.len()).unwrap_or(1).max(1);
        free.get(usize::try_from(pick % len).unwrap_or_default())
            .copied()
    }

    fn create_pod(&mut self) {
        let name = format!("pod-{}", self.next_pod);
        self.next_pod += 1;
        let node = self.present_node();
        let mac = self.free_mac();
        self.server.insert(&Self::pod(&name, &node, mac, None));
        self.pods.insert(name, node);
        self.count_op("pod create");
    }

    fn delete_pod(&mut self) {
        let names: Vec<String> = self.pods.keys().cloned().collect();
        let victim = names[self.rng.below(names.len())].clone();
        self.server.delete::<Pod>(POD_NAMESPACE, &victim);
        self.pods.remove(&victim);
        self.count_op("pod delete");
    }

    /// The pod `ordinal` of `set`; the pods of the first StatefulSet ask
    /// for a fixed MAC of their own, the same each time they come back.
    fn create_set_pod(&mut self, set: &str, uid: &str, ordinal: usize) {
        let node = self.present_node();
        let mac = (set == STATEFULSETS[0])
            .then(|| mac(0x80 + u8::try_from(ordinal).expect("small ordinal")));
        self.server.insert(&Self::pod(
            &format!("{set}-{ordinal}"),
            &node,
            mac,
            Some((set, uid)),
        ));
    }

    fn scale(&mut self) {
        let set = STATEFULSETS[self.rng.below(STATEFULSETS.len())];
        let (uid, old) = self.sets[set].clone();
        let new = self.rng.below(MAX_REPLICAS + 1);
        for ordinal in old..new {
            self.create_set_pod(set, &uid, ordinal);
        }
        for ordinal in (new..old).rev() {
            self.server
                .delete::<Pod>(POD_NAMESPACE, &format!("{set}-{ordinal}"));
        }
        self.sets.insert(set, (uid, new));
        self.count_op(if new >= old {
            "statefulset scale up"
        } else {
            "statefulset scale down"
        });
    }

    async fn edit_ranges(&mut self) {
        let set = RANGES[self.rng.below(RANGES.len())];
        let api: Api<FlatNetworkSubnet> = Api::namespaced(self.user.clone(), SUBNET_NAMESPACE);
        let patch = json!({"spec": {"ranges": ranges(set)}});
        api.patch(SUBNET, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("the user's requests meet no faults");
        self.count_op("subnet range edit");
    }

    /// Deletes a node; half the time the pod garbage collector deletes its
    /// pods at once (the StatefulSet controller recreating its pods on
    /// another node), else they stay until the node comes back.
    fn delete_node(&mut self) {
        if self.missing_nodes.len() + 1 >= NODES {
            return self.add_node();
        }
        let node = self.present_node();
        self.server.delete::<Node>("", &node);
        self.missing_nodes.insert(node.clone());
        self.count_op("node delete");
        if self.rng.below(2) == 0 {
            return;
        }
        let doomed: Vec<String> = self
            .pods
            .iter()
            .filter(|(_, n)| **n == node)
            .map(|(p, _)| p.clone())
            .collect();
        for pod in doomed {
            self.server.delete::<Pod>(POD_NAMESPACE, &pod);
            self.pods.remove(&pod);
        }
        for pod in self.server.list::<Pod>() {
            let on_node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(&node);
            let name = pod.metadata.name.clone().unwrap_or_default();
            let set = STATEFULSETS
                .iter()
                .find(|s| name.starts_with(&format!("{s}-")));
            if let (true, Some(set)) = (on_node, set) {
                let uid = self.sets[set].0.clone();
                let ordinal = name[set.len() + 1..].parse().expect("ordinal");
                self.server.delete::<Pod>(POD_NAMESPACE, &name);
                self.create_set_pod(set, &uid, ordinal);
            }
        }
    }

    fn add_node(&mut self) {
        let Some(node) = self.missing_nodes.iter().next().cloned() else {
            return;
        };
        insert_node(&self.server, &node);
        self.missing_nodes.remove(&node);
        self.count_op("node back");
    }

    async fn operation(&mut self) {
        match self.rng.below(100) {
            0..40 if self.pods.len() < MAX_PODS => self.create_pod(),
            0..73 if !self.pods.is_empty() => self.delete_pod(),
            0..73 => self.create_pod(),
            73..85 => self.scale(),
            85..91 => self.edit_ranges().await,
            91..96 => self.delete_node(),
            _ => self.add_node(),
        }
    }

    /// Kills what died or exited, restarts what is due, counts leaders.
    fn tend_replicas(&mut self, restarts: bool) -> Result<(), std::io::Error> {
        for (client, kind) in self.faults.take_crashed() {
            if let Some(r) = self.replicas.iter_mut().find(|r| r.client == client) {
                let delay = Duration::from_millis(self.timing.next() % 1500);
                r.kill(delay);
                self.count_kill(kind);
            }
        }
        for i in 0..self.replicas.len() {
            if let Some(why) = self.replicas[i].ended()
                && self.replicas[i].alive()
            {
                self.replicas[i].kill(Duration::ZERO);
                self.count_kill(why);
            }
            let due = self.replicas[i]
                .restart_at
                .is_some_and(|at| at <= Instant::now() || !restarts);
            if !self.replicas[i].alive() && (due || !restarts) {
                self.next_client += 1;
                let identity = self.replicas[i].identity.clone();
                self.replicas[i] = Replica::start(&identity, self.next_client, &self.server)?;
                self.was_leading[i] = false;
            }
        }
        let leading: Vec<bool> = self
            .replicas
            .iter()
            .map(|r| r.leading.load(Ordering::SeqCst))
            .collect();
        for (was, now) in self.was_leading.iter_mut().zip(&leading) {
            if *now && !*was {
                self.report.terms += 1;
            }
            *was = *now;
        }
        if leading.iter().filter(|l| **l).count() > 1 {
            self.report.overlaps += 1;
        }
        Ok(())
    }

    fn random_kill(&mut self) {
        let i = self.rng.below(self.replicas.len());
        if self.replicas[i].alive() {
            let delay = Duration::from_millis(self.timing.next() % 1500);
            self.replicas[i].kill(delay);
            self.count_kill("killed at a random point");
        }
    }

    /// No address and no fixed MAC held by two live records.
    fn check_unique(&mut self) -> Result<(), String> {
        let mut addrs: BTreeMap<IpAddr, String> = BTreeMap::new();
        let mut macs: BTreeMap<String, String> = BTreeMap::new();
        for record in self.server.list::<FlatNetworkIP>() {
            if record.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let name = record.metadata.name.clone().unwrap_or_default();
            let Some(status) = &record.status else {
                continue;
            };
            if let Some(addr) = status.addr
                && let Some(first) = addrs.insert(addr, name.clone())
            {
                return Err(format!("{addr} held by {first} and {name}"));
            }
            if !status.mac.is_empty()
                && (record.spec.macs.contains(&status.mac) || status.mac_from_pool)
                && let Some(first) = macs.insert(status.mac.clone(), name.clone())
            {
                return Err(format!("MAC {} held by {first} and {name}", status.mac));
            }
        }
        self.report.checks += 1;
        Ok(())
    }

    /// Whether the cluster is quiet and right: every pod addressed, no
    /// record terminating, records without a pod only those StatefulSets
    /// keep, and the ledgers exactly what live records name.
    fn settled(&self) -> Result<(), String> {
        let view = View::read(&self.server, SUBNET);
        if view.terminating > 0 {
            return Err(format!("{} records terminating", view.terminating));
        }
        if let Some(pod) = view.pods.iter().find(|p| !view.addressed.contains_key(*p)) {
            return Err(format!("pod {pod} has no address"));
        }
        let sticky = |name: &str| {
            STATEFULSETS
                .iter()
                .any(|s| name.starts_with(&format!("{s}-")))
        };
        if let Some(record) = view
            .addressed
            .keys()
            .find(|r| !view.pods.contains(*r) && !sticky(r))
        {
            return Err(format!("record {record} holds an address without a pod"));
        }
        view.check()?;
        let named: BTreeSet<Mac> = self
            .server
            .list::<FlatNetworkIP>()
            .into_iter()
            .filter_map(|r| {
                let mac = r.status?.mac;
                r.spec.macs.contains(&mac).then(|| Mac::parse(&mac).ok())?
            })
            .collect();
        // Pool MACs a record holds through the single path have an owner
        // claim too; their uniqueness is `check_unique`'s.
        let mut ledger = ledger_macs(&self.server);
        if let Some(pool) = mac_pool() {
            ledger.retain(|mac| !pool.range.contains(*mac));
        }
        if ledger != named {
            let extra: Vec<String> = ledger.difference(&named).map(ToString::to_string).collect();
            let claims: Vec<String> = self
                .server
                .list::<ConfigMap>()
                .into_iter()
                .flat_map(|m| {
                    m.data
                        .unwrap_or_default()
                        .into_iter()
                        .map(|(k, v)| format!("{k}={v}"))
                })
                .collect();
            let holders: Vec<String> = self
                .server
                .list::<FlatNetworkIP>()
                .into_iter()
                .filter(|r| {
                    claims.iter().any(|c| {
                        c.contains(&format!(
                            "/{}#",
                            r.metadata.name.clone().unwrap_or_default()
                        ))
                    })
                })
                .map(|r| {
                    format!(
                        "{} spec {:?} status {:?}",
                        r.metadata.name.unwrap_or_default(),
                        r.spec.macs,
                        r.status.map(|s| (s.mac, s.addr, s.phase))
                    )
                })
                .collect();
            return Err(format!(
                "the MAC ledger holds {} MACs, live records name {}: extra {extra:?}; claims {claims:?}; records {holders:?}",
                ledger.len(),
                named.len()
            ));
        }
        let used_mac: BTreeSet<Mac> = self
            .server
            .list::<FlatNetworkSubnet>()
            .into_iter()
            .flat_map(|s| s.status.unwrap_or_default().used_mac)
            .filter_map(|m| Mac::parse(&m).ok())
            .collect();
        if used_mac != named {
            return Err(format!(
                "usedMac holds {} MACs, live records name {}",
                used_mac.len(),
                named.len()
            ));
        }
        Ok(())
    }

    /// Stops killing, brings every replica and node back, and waits for a
    /// settled cluster (faults other than deaths go on).
    async fn quiet_point(&mut self, done: usize, settle: Duration) -> Result<(), ChaosError> {
        self.faults.set_crashes(false);
        while !self.missing_nodes.is_empty() {
            self.add_node();
        }
        let deadline = Instant::now() + settle;
        let outcome = loop {
            self.tend_replicas(false)?;
            let settled = self.settled();
            if settled.is_ok() || Instant::now() >= deadline {
                break settled;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        self.faults.set_crashes(true);
        outcome.map_err(|broken| ChaosError::Broken {
            seed: self.report.seed,
            done,
            broken: format!("not settled within {settle:?}: {broken}"),
        })?;
        self.report.checks += 1;
        self.report.quiet_points += 1;
        Ok(())
    }
}

/// The MAC pool of the run: `FLATNET_CHAOS_MAC_POOL=1` turns it on.
fn mac_pool() -> Option<allocation::mac_pool::ActivePool> {
    std::env::var_os("FLATNET_CHAOS_MAC_POOL").map(|_| allocation::mac_pool::ActivePool {
        range: flatnet_k8s::ipam::MacRange::locally_administered(0xfa10),
        mode: flatnet_k8s::api::MacPoolMode::OptOut,
    })
}

/// The fixed MACs the MAC ledgers hold.
fn ledger_macs(server: &FakeApiServer) -> BTreeSet<Mac> {
    server
        .list::<ConfigMap>()
        .into_iter()
        .filter(|m| {
            m.metadata
                .name
                .as_deref()
                .is_some_and(|n| n.starts_with(LEDGER_PREFIX))
        })
        .flat_map(|m| m.data.unwrap_or_default().into_keys())
        .filter_map(|k| Mac::parse(&k.replace('-', ":")).ok())
        .collect()
}

fn insert_node(server: &FakeApiServer, name: &str) {
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node", "metadata": {"name": name}
    }))
    .expect("node literal");
    server.insert(&node);
}

/// Runs `options.ops` operations; the report of a run whose invariants held.
///
/// # Errors
/// The first invariant that broke, with the seed and the operations done.
///
/// # Panics
/// When the fake server refuses a request of the run itself (it meets no
/// faults).
pub async fn run(options: &Options) -> Result<Report, ChaosError> {
    let (report, outcome) = drive(options).await;
    outcome.map(|()| report)
}

/// Runs `options.ops` operations: the report, whatever the outcome.
async fn drive(options: &Options) -> (Report, Result<(), ChaosError>) {
    let started = Instant::now();
    let faults = Arc::new(Faults::new(options.seed, options.rates.clone()));
    let server = FakeApiServer::realistic(Realism {
        latency: Duration::from_millis(1),
        watch_delay: Duration::from_millis(2),
        watch_spread: Duration::from_millis(30),
        burst: Duration::from_millis(5),
        history: 2000,
        gc_delay: Duration::from_millis(20),
        seed: options.seed,
    })
    .with_faults(Arc::clone(&faults), tokio::runtime::Handle::current());
    server.insert(&subnet(SUBNET, "10.7.0.0/24", Some("10.7.0.1"), RANGES[0]));
    for i in 0..NODES {
        insert_node(&server, &node_name(i));
    }
    let mut sets = BTreeMap::new();
    for name in STATEFULSETS {
        let set: StatefulSet = serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": name, "namespace": POD_NAMESPACE}
        }))
        .expect("statefulset literal");
        server.insert(&set);
        let uid = server
            .list::<StatefulSet>()
            .into_iter()
            .find(|s| s.metadata.name.as_deref() == Some(name))
            .and_then(|s| s.metadata.uid)
            .expect("stored with a uid");
        sets.insert(name, (uid, 0));
    }
    let mut run = Run {
        user: server.client(),
        server: server.clone(),
        faults,
        rng: Rng(options.seed | 1),
        timing: Rng(options.seed.rotate_left(17) | 1),
        replicas: Vec::new(),
        next_client: 2,
        pods: BTreeMap::new(),
        next_pod: 0,
        sets,
        missing_nodes: BTreeSet::new(),
        report: Report {
            seed: options.seed,
            ..Report::default()
        },
        was_leading: vec![false, false],
        kill_rate: options.kills,
    };
    let outcome = run_ops(&mut run, options).await;
    for replica in &mut run.replicas {
        replica.kill(Duration::ZERO);
    }
    run.report.faults = run.faults.counts();
    run.report.requests = run.server.requests();
    run.report.accesses = run.server.accesses();
    run.report.elapsed = started.elapsed();
    (run.report, outcome)
}

async fn run_ops(run: &mut Run, options: &Options) -> Result<(), ChaosError> {
    for (client, identity) in [(1, "replica-a"), (2, "replica-b")] {
        run.replicas
            .push(Replica::start(identity, client, &run.server)?);
    }
    let mut done = 0;
    let mut next_quiet = options.quiet_every.min(options.ops);
    let mut first_break = Ok(());
    while done < options.ops {
        let burst = (1 + run.rng.below(30)).min(options.ops - done);
        for _ in 0..burst {
            run.operation().await;
            if run.rng.chance(run.kill_rate) {
                run.random_kill();
            }
        }
        done += burst;
        run.tend_replicas(true)?;
        let unique = run.check_unique().map_err(|broken| ChaosError::Broken {
            seed: options.seed,
            done,
            broken,
        });
        first_break = first_break.and(unique);
        tokio::time::sleep(Duration::from_millis(5 + run.rng.next() % 60)).await;
        if done >= next_quiet {
            first_break = first_break.and(run.quiet_point(done, options.settle).await);
            // The end is a quiet point too.
            next_quiet = (next_quiet + options.quiet_every).min(options.ops);
        }
        if first_break.is_err() && !options.keep_going {
            break;
        }
    }
    first_break
}

#[cfg(test)]
mod rbac_tests;
#[cfg(test)]
mod tests {
    use super::*;

    /// The run of `cargo xtask chaos`: `FLATNET_CHAOS_SEED` and
    /// `FLATNET_CHAOS_OPS` (default 1,500) choose it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "run by `cargo xtask chaos` (and by CI through it)"]
    async fn chaos() {
        // RUST_LOG=flatnet_operator=debug shows what each replica did.
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_thread_names(true)
                .try_init();
        }
        let seed = crate::allocation::fake_cluster::seed_from_env("FLATNET_CHAOS_SEED");
        let ops = std::env::var("FLATNET_CHAOS_OPS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(1500);
        println!("chaos seed {seed}, {ops} operations (FLATNET_CHAOS_SEED={seed} replays it)");
        let mut options = Options::new(seed, ops);
        // FLATNET_CHAOS_ONLY=conflict,error,timeout,watch,crash,kill keeps
        // only those disorders, to find which one a failure needs.
        if let Ok(only) = std::env::var("FLATNET_CHAOS_ONLY") {
            let on = |k: &str| only.split(',').any(|o| o == k);
            let r = &mut options.rates;
            let keep = |on: bool, rate: &mut u32| *rate = if on { *rate } else { 0 };
            keep(on("conflict"), &mut r.conflict);
            keep(on("error"), &mut r.error_before);
            keep(on("error"), &mut r.error_after);
            keep(on("timeout"), &mut r.timeout);
            keep(on("watch"), &mut r.watch_cut);
            keep(on("crash"), &mut r.crash);
            keep(on("crash"), &mut r.crash_after_ledger);
            keep(on("kill"), &mut options.kills);
        }
        // The figures are printed whatever the outcome.
        let (report, outcome) = drive(&options).await;
        println!("{report}");
        if let Err(broken) = outcome {
            panic!("{broken}");
        }
    }
}
