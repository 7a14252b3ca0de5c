//! `status.podsAtMTU` of each FlatNetworkSubnet: how many of its
//! FlatNetworkIPs report (through their node agent's `status.mtu`) that the
//! pod's interface carries the subnet's `spec.mtu`.
//!
//! Counted from watch-driven copies of both kinds at a fixed interval and
//! written only when it changed, so a rollout of a new MTU over thousands
//! of pods costs at most one status write per subnet per interval.

use std::{collections::BTreeMap, time::Duration};

use flatnet_k8s::{
    api::{FlatNetworkIP, FlatNetworkSubnet, phase},
    keys::SUBNET_NAMESPACE,
};
use futures::StreamExt;
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
    runtime::{WatchStreamExt, reflector, watcher},
};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::cache;

/// How often the counts are compared with the subnets' status.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);

/// Field manager of the count's writes.
pub const FIELD_MANAGER: &str = "flatnet-operator-mtu";

/// The count `subnet`'s status should show: its FlatNetworkIPs that are
/// Active with `status.mtu` equal to `spec.mtu`; `None` while `spec.mtu`
/// is unset.
#[must_use]
pub fn pods_at_mtu<'a>(
    subnet: &FlatNetworkSubnet,
    ips: impl IntoIterator<Item = &'a FlatNetworkIP>,
) -> Option<i64> {
    let mtu = subnet.spec.mtu?;
    let name = subnet.name_any();
    let count = ips
        .into_iter()
        .filter(|ip| ip.spec.subnet == name)
        .filter_map(|ip| ip.status.as_ref())
        .filter(|status| status.phase == phase::ACTIVE && status.mtu == Some(mtu))
        .count();
    Some(i64::try_from(count).unwrap_or(i64::MAX))
}

/// Keeps `status.podsAtMTU` of every subnet up to date until `stop`.
pub async fn run(client: Client, interval: Duration, stop: CancellationToken) {
    let (subnets, subnet_writer) = reflector::store();
    let (ips, ip_writer) = reflector::store();
    let subnet_api: Api<FlatNetworkSubnet> = Api::namespaced(client.clone(), SUBNET_NAMESPACE);
    let follow_subnets = reflector::reflector(
        subnet_writer,
        watcher(subnet_api.clone(), watcher::Config::default()),
    )
    .default_backoff()
    .for_each(|_| async {});
    let follow_ips = reflector::reflector(
        ip_writer,
        watcher(
            Api::<FlatNetworkIP>::all(client),
            watcher::Config::default(),
        ),
    )
    .default_backoff()
    .for_each(|_| async {});
    let count = async {
        if tokio::join!(cache::synced(&subnets), cache::synced(&ips)) != (true, true) {
            return;
        }
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let all_ips = ips.state();
            let mut by_subnet: BTreeMap<String, Vec<&FlatNetworkIP>> = BTreeMap::new();
            for ip in &all_ips {
                by_subnet
                    .entry(ip.spec.subnet.clone())
                    .or_default()
                    .push(ip.as_ref());
            }
            for subnet in subnets.state() {
                let name = subnet.name_any();
                let wanted =
                    pods_at_mtu(&subnet, by_subnet.get(&name).into_iter().flatten().copied());
                let shown = subnet.status.as_ref().and_then(|s| s.pods_at_mtu);
                if wanted == shown {
                    continue;
                }
                // A merge patch of the one field: null removes it.
                let patch = Patch::Merge(json!({"status": {"podsAtMTU": wanted}}));
                match subnet_api.patch_status(&name, &params, &patch).await {
                    Ok(_) => debug!(subnet = %name, ?wanted, "podsAtMTU updated"),
                    Err(error) => {
                        warn!(subnet = %name, %error, "cannot update podsAtMTU; retrying");
                    }
                }
            }
        }
    };
    tokio::select! {
        () = stop.cancelled() => {}
        () = follow_subnets => {}
        () = follow_ips => {}
        () = count => {}
    }
}

#[cfg(test)]
mod tests {
    use flatnet_k8s::api::{FlatNetworkIPSpec, FlatNetworkIPStatus, FlatNetworkSubnetStatus};
    use proptest::prelude::*;

    use super::*;
    use crate::allocation::{fake_api::FakeApiServer, fake_cluster::subnet};

    fn ip(name: &str, subnet: &str, phase: &str, mtu: Option<u32>) -> FlatNetworkIP {
        let mut ip = FlatNetworkIP::new(
            name,
            FlatNetworkIPSpec {
                subnet: subnet.into(),
                ..FlatNetworkIPSpec::default()
            },
        );
        ip.metadata.namespace = Some("shop".into());
        ip.status = Some(FlatNetworkIPStatus {
            phase: phase.into(),
            mtu,
            ..FlatNetworkIPStatus::default()
        });
        ip
    }

    fn lan(mtu: Option<u32>) -> FlatNetworkSubnet {
        let mut lan = subnet("lan", "10.0.0.0/24", None, &[]);
        lan.spec.mtu = mtu;
        lan
    }

    #[test]
    fn only_active_records_of_the_subnet_at_its_mtu_count() {
        let ips = [
            ip("a", "lan", phase::ACTIVE, Some(1400)),
            ip("b", "lan", phase::ACTIVE, Some(1500)),
            ip("c", "lan", phase::PENDING, Some(1400)),
            ip("d", "other", phase::ACTIVE, Some(1400)),
            ip("e", "lan", phase::ACTIVE, None),
        ];
        assert_eq!(pods_at_mtu(&lan(Some(1400)), &ips), Some(1));
        assert_eq!(pods_at_mtu(&lan(None), &ips), None);
    }

    proptest! {
        /// The count never exceeds the subnet's records and grows by one
        /// for each further record reporting the subnet's MTU.
        #[test]
        fn the_count_is_bounded_and_monotone(
            mtus in proptest::collection::vec(proptest::option::of(1280u32..1290), 0..40),
            wanted in 1280u32..1290,
        ) {
            let mut ips: Vec<FlatNetworkIP> = mtus
                .iter()
                .enumerate()
                .map(|(i, mtu)| ip(&format!("p{i}"), "lan", phase::ACTIVE, *mtu))
                .collect();
            let subnet = lan(Some(wanted));
            let before = pods_at_mtu(&subnet, &ips).unwrap();
            prop_assert!(before <= i64::try_from(ips.len()).unwrap());
            ips.push(ip("new", "lan", phase::ACTIVE, Some(wanted)));
            prop_assert_eq!(pods_at_mtu(&subnet, &ips).unwrap(), before + 1);
        }
    }

    #[tokio::test]
    async fn the_status_follows_the_reports_and_goes_with_spec_mtu() {
        let server = FakeApiServer::new();
        server.insert(&lan(Some(1400)));
        server.insert(&ip("a", "lan", phase::ACTIVE, Some(1500)));
        server.insert(&ip("b", "lan", phase::ACTIVE, Some(1400)));
        let stop = CancellationToken::new();
        let task = tokio::spawn(run(
            server.client(),
            Duration::from_millis(20),
            stop.clone(),
        ));
        let shown = || {
            server
                .list::<FlatNetworkSubnet>()
                .into_iter()
                .find_map(|s| s.status)
                .and_then(|s| s.pods_at_mtu)
        };
        let settle = |wanted: Option<i64>| async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            while shown() != wanted {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "podsAtMTU {:?}, not {wanted:?}",
                    shown()
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        settle(Some(1)).await;
        // The other pod's agent reports the new MTU.
        server.insert(&ip("a", "lan", phase::ACTIVE, Some(1400)));
        settle(Some(2)).await;
        // Unset: the count goes.
        let mut unset = lan(None);
        unset.status = Some(FlatNetworkSubnetStatus {
            pods_at_mtu: Some(2),
            ..FlatNetworkSubnetStatus::default()
        });
        server.insert(&unset);
        settle(None).await;
        stop.cancel();
        task.await.unwrap();
    }
}
