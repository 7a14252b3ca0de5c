//! The allocation controllers running against the fake API server, as the
//! operator runs them, with what tests and benchmarks need around them:
//! annotated pods to create and delete, and the invariants of the ledger.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    sync::Arc,
    time::Duration,
};

use flatnet_k8s::{
    api::{FlatNetworkIP, FlatNetworkSubnet, FlatNetworkSubnetSpec, IpRange, phase},
    ipam::used_ranges,
    keys::SUBNET_NAMESPACE,
};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{Settings, fake_api::FakeApiServer};
use crate::{admin::Health, metrics::Metrics};

/// Namespace of the pods this harness creates.
pub const POD_NAMESPACE: &str = "churn";

/// The controllers running against `server`.
pub struct FakeCluster {
    /// The API server.
    pub server: FakeApiServer,
    /// The controllers' readiness, as the operator's `/readyz` reads it.
    pub health: Arc<Health>,
    stop: CancellationToken,
    controllers: JoinHandle<()>,
}

/// A subnet as a user writes it: spec only, the controller does the rest.
#[must_use]
pub fn subnet(
    name: &str,
    cidr: &str,
    gateway: Option<&str>,
    ranges: &[(&str, &str)],
) -> FlatNetworkSubnet {
    let parse = |a: &str| a.parse::<IpAddr>().expect("valid address");
    let mut subnet = FlatNetworkSubnet::new(
        name,
        FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth0".into(),
            cidr: cidr.into(),
            gateway: gateway.map(parse),
            ranges: ranges
                .iter()
                .map(|(f, t)| IpRange::new(parse(f), parse(t)))
                .collect(),
            ..FlatNetworkSubnetSpec::default()
        },
    );
    subnet.metadata.namespace = Some(SUBNET_NAMESPACE.into());
    subnet
}

/// A pod of [`POD_NAMESPACE`] asking for an automatic address in `subnet`.
///
/// # Panics
/// Never: the pod is a literal.
#[must_use]
pub fn pod(name: &str, subnet: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": POD_NAMESPACE,
                     "annotations": {"flatnetwork.pandaria.io/ip": "auto",
                                     "flatnetwork.pandaria.io/subnet": subnet}},
        "spec": {"containers": [{"name": "c", "image": "pause"}]}
    }))
    .expect("pod literal")
}

/// What the stored objects say, for the invariants.
#[derive(Debug)]
pub struct View {
    /// Pods asking for an address.
    pub pods: BTreeSet<String>,
    /// Address of each live record (no deletionTimestamp), by pod name.
    pub addressed: BTreeMap<String, IpAddr>,
    /// Records being deleted.
    pub terminating: usize,
    /// `status.usedIP` of the subnet.
    pub used_ip: Vec<IpRange>,
    /// `status.usedIPCount` of the subnet.
    pub used_ip_count: i64,
    /// The subnet's gateway, when it has one.
    pub gateway: Option<IpAddr>,
}

impl View {
    /// What `server` stores now, for `subnet`.
    ///
    /// # Panics
    /// When the subnet does not exist.
    #[must_use]
    pub fn read(server: &FakeApiServer, subnet: &str) -> Self {
        let pods = server
            .list::<Pod>()
            .into_iter()
            .filter_map(|p| p.metadata.name)
            .collect();
        let mut addressed = BTreeMap::new();
        let mut terminating = 0;
        for record in server.list::<FlatNetworkIP>() {
            if record.spec.subnet != subnet {
                continue;
            }
            if record.metadata.deletion_timestamp.is_some() {
                terminating += 1;
                continue;
            }
            if let Some(addr) = record.status.and_then(|s| s.addr) {
                addressed.insert(record.metadata.name.unwrap_or_default(), addr);
            }
        }
        let subnet = server
            .list::<FlatNetworkSubnet>()
            .into_iter()
            .find(|s| s.metadata.name.as_deref() == Some(subnet))
            .expect("subnet exists");
        let status = subnet.status.unwrap_or_default();
        View {
            pods,
            addressed,
            terminating,
            used_ip: status.used_ranges(),
            used_ip_count: status.used_ip_count,
            gateway: status.gateway,
        }
    }

    /// Whether every pod has its address and no record is terminating.
    #[must_use]
    pub fn quiet(&self) -> bool {
        self.terminating == 0
            && self.addressed.len() == self.pods.len()
            && self.pods.iter().all(|p| self.addressed.contains_key(p))
    }

    /// The addresses of live records, or the first one two of them hold:
    /// that never heals, so it is wrong at any time, not only at a quiet
    /// point.
    ///
    /// # Errors
    /// The address handed out twice.
    pub fn unique(&self) -> Result<BTreeSet<IpAddr>, String> {
        let mut seen = BTreeSet::new();
        for (pod, addr) in &self.addressed {
            if !seen.insert(*addr) {
                return Err(format!("{addr} handed out twice (again to {pod})"));
            }
        }
        Ok(seen)
    }

    /// Checks the invariants of a quiet point: no address twice, and
    /// `usedIP` is exactly the addresses of live records plus the gateway.
    ///
    /// # Errors
    /// What does not hold.
    pub fn check(&self) -> Result<(), String> {
        let mut want = self.unique()?;
        want.extend(self.gateway);
        let want_ranges = used_ranges::compress(want.iter().copied());
        if self.used_ip != want_ranges {
            let (v4, _) = used_ranges::to_intervals(&self.used_ip);
            let ledger: BTreeSet<u128> = v4.iter().flatten().collect();
            let held: BTreeSet<u128> = want
                .iter()
                .map(|a| flatnet_k8s::ipam::to_u128(*a))
                .collect();
            let leaked = ledger.difference(&held).count();
            let lost = held.difference(&ledger).count();
            return Err(format!(
                "usedIP holds {leaked} address(es) no live record names and lacks {lost} that records name ({} live records)",
                self.addressed.len()
            ));
        }
        let count = i64::try_from(want.len()).unwrap_or(i64::MAX);
        if self.used_ip_count != count {
            return Err(format!(
                "usedIPCount is {} for {count} used addresses",
                self.used_ip_count
            ));
        }
        Ok(())
    }
}

impl FakeCluster {
    /// Starts the allocation controllers with `workers` workers each
    /// against `server`, which holds `subnet`.
    pub fn start(server: FakeApiServer, settings: Settings, workers: u16) -> Self {
        Self::start_with_mac_pool(server, settings, workers, None)
    }

    /// [`Self::start`] with the MAC pool `pool` (as the FlatNetworkConfig
    /// watch would set it).
    pub fn start_with_mac_pool(
        server: FakeApiServer,
        settings: Settings,
        workers: u16,
        pool: Option<super::mac_pool::ActivePool>,
    ) -> Self {
        let stop = CancellationToken::new();
        let health = Arc::new(Health::default());
        let controllers = tokio::spawn(super::run(
            server.client(),
            Arc::new(Metrics::new()),
            settings,
            workers,
            super::mac_pool::MacPoolView::new(pool),
            Arc::clone(&health),
            stop.clone(),
        ));
        Self {
            server,
            health,
            stop,
            controllers,
        }
    }

    /// Creates pod `name` asking for an address in `subnet`.
    pub fn create_pod(&self, name: &str, subnet: &str) {
        self.server.insert(&pod(name, subnet));
    }

    /// Deletes pod `name`; the garbage collector deletes its record.
    pub fn delete_pod(&self, name: &str) {
        self.server.delete::<Pod>(POD_NAMESPACE, name);
    }

    /// The stored objects as they are now, for `subnet`.
    ///
    /// # Panics
    /// When the subnet does not exist.
    #[must_use]
    pub fn view(&self, subnet: &str) -> View {
        View::read(&self.server, subnet)
    }

    /// Waits until `subnet` is Active.
    ///
    /// # Errors
    /// When it is not within `within`.
    pub async fn wait_active(&self, subnet: &str, within: Duration) -> Result<(), String> {
        self.wait(within, || {
            self.server.list::<FlatNetworkSubnet>().iter().any(|s| {
                s.metadata.name.as_deref() == Some(subnet)
                    && s.status
                        .as_ref()
                        .is_some_and(|st| st.phase == phase::ACTIVE)
            })
        })
        .await
        .map_err(|()| format!("subnet {subnet} not Active within {within:?}"))
    }

    /// Waits for a quiet point of `subnet` (every pod addressed, no record
    /// terminating), then for the invariants to hold.
    ///
    /// # Errors
    /// When either does not happen within `within`; the message says what.
    pub async fn settle(&self, subnet: &str, within: Duration) -> Result<View, String> {
        let quiet = self.wait(within, || self.view(subnet).quiet()).await;
        let view = self.view(subnet);
        if quiet.is_err() {
            return Err(format!(
                "not quiet within {within:?}: {} pods, {} addressed, {} terminating",
                view.pods.len(),
                view.addressed.len(),
                view.terminating
            ));
        }
        // The ledger follows the records within the same bound.
        let settled = self
            .wait(within, || self.view(subnet).check().is_ok())
            .await;
        let view = self.view(subnet);
        match settled {
            Ok(()) => Ok(view),
            Err(()) => Err(view.check().err().unwrap_or_default()),
        }
    }

    async fn wait(&self, within: Duration, done: impl Fn() -> bool) -> Result<(), ()> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if done() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops the controllers.
    pub async fn stop(self) {
        self.stop.cancel();
        let _ = self.controllers.await;
    }
}

/// The seed in environment variable `var`, else one from the clock (printed
/// by the runs so that a failure can be replayed).
#[must_use]
pub fn seed_from_env(var: &str) -> u64 {
    std::env::var(var)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_secs())
        })
}
