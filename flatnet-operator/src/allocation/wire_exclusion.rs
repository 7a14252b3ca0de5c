//! Wire-aware allocation: the addresses the node agents saw hosts outside
//! flatnet claim on the LAN (their `FlatNetworkWireClaims`) stay out of the
//! pool for the wire window. The rules live in `flatnet_k8s::ipam::wire`;
//! this is the controllers' view of the reports. The MACs of those hosts
//! stay out of the MAC pool the same way.

use std::{collections::BTreeSet, time::Duration};

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

/// The reports of every node, as the allocation controllers read them.
#[derive(Clone)]
pub struct WireView {
    reports: Store<FlatNetworkWireClaims>,
    window: Duration,
}

impl WireView {
    /// A view of no reports: nothing is excluded.
    pub fn empty(window: Duration) -> Self {
        Self {
            reports: reflector::store().0,
            window,
        }
    }

    /// A view of the reports in `reports`.
    pub fn new(reports: Store<FlatNetworkWireClaims>, window: Duration) -> Self {
        Self { reports, window }
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
        (Self { reports, window }, stream)
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
        let reports = self.reports.state();
        LiveAddresses::from_reports(
            reports
                .iter()
                .map(AsRef::as_ref)
                .filter(|r| r.spec.subnet == subnet),
            Timestamp::now(),
            self.window,
        )
    }
}

/// `status.wireExcludedCount` of a subnet whose pool is `pool`.
pub fn excluded_count(view: &WireView, subnet: &str, pool: &Pool) -> i64 {
    i64::try_from(view.live(subnet).excluded_from(pool)).unwrap_or(i64::MAX)
}
