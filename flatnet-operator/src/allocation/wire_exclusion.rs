//! Wire-aware allocation: the addresses the node agents saw MACs of no
//! live flatnet record claim on the LAN (their `FlatNetworkWireClaims`)
//! stay out of the pool for the wire window, and addresses released within
//! the window are reused after every other free one (the quarantine, kept
//! from the moment of the release, so there is no gap before the nodes'
//! next reports). The rules live in `flatnet_k8s::ipam::wire`; this is the
//! controllers' view of the reports and of the releases. The MACs of
//! hosts outside flatnet stay out of the MAC pool the same way.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use flatnet_k8s::{
    api::FlatNetworkWireClaims,
    ipam::{LiveAddresses, Mac, Pool},
    keys::SUBNET_NAMESPACE,
};
use futures::{Stream, StreamExt};
use k8s_openapi::jiff::Timestamp;
use kube::{
    Api, Client,
    runtime::{
        WatchStreamExt,
        reflector::{self, Store},
        watcher,
    },
};

/// When this operator released each address, per subnet.
type Releases = HashMap<String, BTreeMap<IpAddr, Timestamp>>;

/// The reports of every node, as the allocation controllers read them, and
/// the releases of this operator.
#[derive(Clone)]
pub struct WireView {
    reports: Store<FlatNetworkWireClaims>,
    window: Duration,
    released: Arc<Mutex<Releases>>,
    /// When the view was made: allocation waits for the first list of
    /// the reports, up to [`SYNC_WAIT`] after this.
    since: std::time::Instant,
}

/// Longest allocation waits, after the operator starts, for the reports'
/// first list: without it a new leader would hand out addresses the LAN
/// uses; without the CRD (an older chart) the list never comes, and
/// allocation goes on without the wire.
pub const SYNC_WAIT: Duration = Duration::from_secs(30);

impl WireView {
    /// A view of no reports: nothing is excluded.
    pub fn empty(window: Duration) -> Self {
        let (reports, mut writer) = reflector::store();
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitDone);
        Self::new(reports, window)
    }

    /// A view of the reports in `reports`.
    pub fn new(reports: Store<FlatNetworkWireClaims>, window: Duration) -> Self {
        Self {
            reports,
            window,
            released: Arc::default(),
            since: std::time::Instant::now(),
        }
    }

    /// How long allocation should wait for the reports' first list: `None`
    /// once listed (or once [`SYNC_WAIT`] has passed, or with the wire
    /// window off).
    pub fn unsynced_for(&self) -> Option<Duration> {
        let listed = crate::cache::listed(&self.reports);
        let waited = self.since.elapsed();
        (!listed && !self.window.is_zero() && waited < SYNC_WAIT)
            .then(|| SYNC_WAIT.saturating_sub(waited).min(Duration::from_secs(1)))
    }

    /// A view kept by the returned stream, which watches the reports in
    /// the subnet namespace and must be polled.
    pub fn watch(
        client: Client,
        window: Duration,
    ) -> (Self, impl Stream<Item = ()> + Send + 'static) {
        let (reports, writer) = reflector::store();
        let api: Api<FlatNetworkWireClaims> = Api::namespaced(client, SUBNET_NAMESPACE);
        // With backoff: without the CRD (an older chart) the list fails
        // until it is installed, and must not be retried in a loop.
        let stream = reflector::reflector(writer, watcher(api, watcher::Config::default()))
            .default_backoff()
            .map(|_| ());
        (Self::new(reports, window), stream)
    }

    /// The wire window.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// The cached reports of `subnet`.
    pub fn reports(&self, subnet: &str) -> Vec<Arc<FlatNetworkWireClaims>> {
        let mut reports = self.reports.state();
        reports.retain(|r| r.spec.subnet == subnet);
        reports
    }

    /// The MACs hosts outside flatnet claimed addresses with, in any
    /// subnet, within the wire window: the MAC pool skips them.
    pub fn foreign_macs(&self) -> BTreeSet<Mac> {
        let reports = self.reports.state();
        LiveAddresses::from_reports(
            reports.iter().map(AsRef::as_ref),
            Timestamp::now(),
            self.window,
        )
        .macs()
    }

    /// The addresses of `subnet` live on the wire now.
    pub fn live(&self, subnet: &str) -> LiveAddresses {
        LiveAddresses::from_reports(
            self.reports(subnet).iter().map(AsRef::as_ref),
            Timestamp::now(),
            self.window,
        )
    }

    /// What allocation in `subnet` avoids: the live addresses and those
    /// released within the window.
    pub fn avoided(&self, subnet: &str) -> LiveAddresses {
        let now = Timestamp::now();
        let released: Vec<(IpAddr, Timestamp)> = {
            let mut all = self.released.lock().unwrap_or_else(|e| e.into_inner());
            let Some(released) = all.get_mut(subnet) else {
                return self.live(subnet);
            };
            // Forget what left the window.
            let since = now
                .checked_sub(jiff_window(self.window))
                .unwrap_or(Timestamp::MIN);
            released.retain(|_, at| *at >= since);
            released.iter().map(|(ip, at)| (*ip, *at)).collect()
        };
        self.live(subnet).with_released(released, now, self.window)
    }

    /// `addrs` of `subnet` are being released now: they are quarantined
    /// before they leave the ledger, so they never are ordinary free
    /// addresses while the nodes have not reported whether their pod's MAC
    /// still answers.
    pub fn released(&self, subnet: &str, addrs: &[IpAddr]) {
        if addrs.is_empty() || self.window.is_zero() {
            return;
        }
        let now = Timestamp::now();
        let mut all = self.released.lock().unwrap_or_else(|e| e.into_inner());
        let released = all.entry(subnet.to_owned()).or_default();
        for addr in addrs {
            released.insert(*addr, now);
        }
    }
}

fn jiff_window(window: Duration) -> k8s_openapi::jiff::SignedDuration {
    k8s_openapi::jiff::SignedDuration::try_from(window)
        .unwrap_or(k8s_openapi::jiff::SignedDuration::MAX)
}

/// `status.wireExcludedCount` of a subnet whose pool is `pool`.
pub fn excluded_count(view: &WireView, subnet: &str, pool: &Pool) -> i64 {
    i64::try_from(view.live(subnet).excluded_from(pool)).unwrap_or(i64::MAX)
}
