//! Wire-aware allocation against the fake API server: addresses the node
//! agents reported live on the LAN are skipped, counted in the subnet's
//! status, and refused with the claim named when a pod asks for one.

use std::sync::Arc;

use flatnet_k8s::{
    api::{
        FlatNetworkIP, FlatNetworkSubnet, FlatNetworkWireClaims, FlatNetworkWireClaimsSpec,
        ForeignClaim,
    },
    keys::SUBNET_NAMESPACE,
};
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::{SignedDuration, Timestamp},
};
use kube::ResourceExt;

use super::{
    super::wire_exclusion::WireView, Context, FakeApiServer, Settings, caches_from, context,
    context_from, ip, ips, race_pods, race_subnet, record_of, store, subnets,
};

/// What node `node-1` reported in subnet `race`: (address, MAC, seconds ago).
fn report(claims: &[(&str, &str, i64)]) -> FlatNetworkWireClaims {
    // Whole seconds: what the API keeps of a time.
    let now = Timestamp::from_second(Timestamp::now().as_second()).unwrap();
    let mut report = FlatNetworkWireClaims::new(
        &FlatNetworkWireClaims::object_name("race", "node-1"),
        FlatNetworkWireClaimsSpec {
            subnet: "race".into(),
            node: "node-1".into(),
            observed_at: None,
            claims: claims
                .iter()
                .map(|(addr, mac, ago)| ForeignClaim {
                    ip: ip(addr),
                    mac: (*mac).into(),
                    last_seen: Time(now.checked_sub(SignedDuration::from_secs(*ago)).unwrap()),
                    kind: "arp_request".into(),
                })
                .collect(),
        },
    );
    report.metadata.namespace = Some(SUBNET_NAMESPACE.into());
    report
}

/// The allocation context over what `server` holds, reports included.
fn wire_context(server: &FakeApiServer) -> Arc<Context> {
    let ctx = context_from(server, Settings::default());
    let mut ctx = Arc::into_inner(ctx).expect("only reference");
    ctx.wire = WireView::new(store(server.list()).0, ctx.settings.wire_window);
    Arc::new(ctx)
}

fn server_with(
    pods: &[k8s_openapi::api::core::v1::Pod],
    report: &FlatNetworkWireClaims,
) -> FakeApiServer {
    let server = FakeApiServer::new();
    server.insert(&race_subnet());
    server.insert(report);
    for p in pods {
        server.insert(p);
        let mut record = record_of(p, "0");
        record.metadata.resource_version = None;
        server.insert(&record);
    }
    server
}

fn address_of(server: &FakeApiServer, name: &str) -> Option<std::net::IpAddr> {
    server
        .list::<FlatNetworkIP>()
        .into_iter()
        .find(|r| r.name_any() == name)
        .and_then(|r| r.status?.addr)
}

/// `race` allocates from 10.0.0.10: a host that only sent ARP requests
/// from .10 ten minutes ago and one seen at .11 just now keep both out;
/// .12, last seen two hours ago (beyond the 1 h window), is handed out.
#[tokio::test]
async fn live_addresses_are_skipped_and_counted_in_the_subnet_status() {
    let pods = race_pods(2, 0);
    let server = server_with(
        &pods,
        &report(&[
            ("10.0.0.10", "02:00:00:00:0a:10", 600),
            ("10.0.0.11", "02:00:00:00:0a:11", 0),
            ("10.0.0.12", "02:00:00:00:0a:12", 7200),
        ]),
    );
    let ctx = wire_context(&server);
    for record in server.list::<FlatNetworkIP>() {
        ips::reconcile(Arc::new(record), Arc::clone(&ctx))
            .await
            .unwrap();
    }
    assert_eq!(address_of(&server, "p0"), Some(ip("10.0.0.12")));
    assert_eq!(address_of(&server, "p1"), Some(ip("10.0.0.13")));

    // The first pass may only write the subnet's metadata; the second
    // (with the subnet as written) writes the status.
    for _ in 0..2 {
        let ctx = wire_context(&server);
        let subnet = server.list::<FlatNetworkSubnet>().remove(0);
        subnets::reconcile(Arc::new(subnet), ctx).await.unwrap();
    }
    let status = server.list::<FlatNetworkSubnet>()[0]
        .status
        .clone()
        .unwrap();
    assert_eq!(status.wire_excluded_count, 2, "{status:?}");
    assert_eq!(status.used_ip_count, 2, "live addresses are not used ones");
}

/// A pod asking for 10.0.0.45, which a LAN host claimed five minutes ago,
/// fails with the MAC and the time in the record's failure message; with
/// another candidate it gets that one.
#[tokio::test]
async fn a_requested_live_address_fails_naming_the_mac_and_when() {
    let pods = race_pods(0, 1);
    let claim = report(&[("10.0.0.45", "02:00:00:00:0a:45", 300)]);
    let seen = claim.spec.claims[0].last_seen.0;
    let server = server_with(&pods, &claim);
    // The pod asks for .45 alone.
    let mut only_45 = server.list::<FlatNetworkIP>().remove(0);
    only_45.spec.addrs = vec![ip("10.0.0.45")];
    server.insert(&only_45);
    let ctx = wire_context(&server);
    let record = server.list::<FlatNetworkIP>().remove(0);
    let error = ips::reconcile(Arc::new(record), Arc::clone(&ctx))
        .await
        .unwrap_err();
    assert_eq!(error.metric_label(), "requested_live_on_wire");
    assert_eq!(error.event_reason(), "RequestedAddressLiveOnWire");
    let failed = server.list::<FlatNetworkIP>().remove(0);
    let message = failed.status.unwrap_or_default().failure_message;
    for part in [
        "10.0.0.45",
        "02:00:00:00:0a:45",
        &seen.to_string(),
        "node-1",
    ] {
        assert!(
            message.contains(part),
            "{part} missing in {message:?} ({error})"
        );
    }
    assert_eq!(address_of(&server, "p0"), None);

    let mut two = server.list::<FlatNetworkIP>().remove(0);
    two.spec.addrs = vec![ip("10.0.0.45"), ip("10.0.0.46")];
    two.status = None;
    server.insert(&two);
    let ctx = wire_context(&server);
    ips::reconcile(Arc::new(server.list::<FlatNetworkIP>().remove(0)), ctx)
        .await
        .unwrap();
    assert_eq!(address_of(&server, "p0"), Some(ip("10.0.0.46")));
}

/// A pod's record deleted: its address comes back only after every other
/// free address, from the moment of the release (no node has reported
/// yet, and the pod may never have talked on the LAN).
#[tokio::test]
async fn a_released_address_is_reused_last_before_any_report() {
    let pods = race_pods(3, 0);
    let server = server_with(&pods[..2], &report(&[]));
    let ctx = wire_context(&server);
    for record in server.list::<FlatNetworkIP>() {
        ips::reconcile(Arc::new(record), Arc::clone(&ctx))
            .await
            .unwrap();
    }
    assert_eq!(address_of(&server, "p0"), Some(ip("10.0.0.10")));
    let mut deleted = server
        .list::<FlatNetworkIP>()
        .into_iter()
        .find(|r| r.name_any() == "p0")
        .unwrap();
    deleted.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
    ips::reconcile(Arc::new(deleted), Arc::clone(&ctx))
        .await
        .unwrap();
    assert!(
        !holds(&super::ledger(&server), "10.0.0.10"),
        "released from the ledger"
    );

    server.insert(&pods[2]);
    let mut record = record_of(&pods[2], "0");
    record.metadata.resource_version = None;
    server.insert(&record);
    let record = server
        .list::<FlatNetworkIP>()
        .into_iter()
        .find(|r| r.name_any() == "p2")
        .unwrap();
    // The same operator, its caches now holding p2.
    let mut later = Arc::into_inner(context(
        server.client(),
        caches_from(&server),
        Settings::default(),
    ))
    .expect("only reference");
    later.wire = ctx.wire.clone();
    ips::reconcile(Arc::new(record), Arc::new(later))
        .await
        .unwrap();
    assert_eq!(
        address_of(&server, "p2"),
        Some(ip("10.0.0.12")),
        "the released .10 is quarantined"
    );
}

/// Settings under which an unclaimed ledger entry waits for the wire at
/// once and is otherwise kept for an hour.
fn early_settings() -> Settings {
    Settings {
        orphan_grace: std::time::Duration::from_secs(3600),
        write_deadline: std::time::Duration::ZERO,
        wire_orphan_grace: std::time::Duration::ZERO,
        ..Settings::default()
    }
}

/// A subnet whose ledger holds .20 and .21, which no record names (the
/// releases of dead pods that never happened), and the Node objects.
fn leaked(nodes: &[&str]) -> FakeApiServer {
    let server = FakeApiServer::new();
    let mut subnet = race_subnet();
    subnet.status.get_or_insert_with(Default::default).used_ip =
        vec![flatnet_k8s::api::IpRange::new(
            ip("10.0.0.20"),
            ip("10.0.0.21"),
        )];
    server.insert(&subnet);
    for name in nodes {
        server.insert(&k8s_openapi::api::core::v1::Node {
            metadata: kube::api::ObjectMeta {
                name: Some((*name).into()),
                ..Default::default()
            },
            ..Default::default()
        });
    }
    server
}

/// The repair's context over `server`, whose node cache holds
/// `cached_nodes` and whose report cache `feed` fills.
fn repair_context(
    server: &FakeApiServer,
    cached_nodes: &[&str],
) -> (
    Arc<Context>,
    kube::runtime::reflector::store::Writer<FlatNetworkWireClaims>,
) {
    let ctx = context(
        server.client(),
        super::caches_from_with_nodes(server, cached_nodes),
        early_settings(),
    );
    let mut ctx = Arc::into_inner(ctx).expect("only reference");
    let (reports, writer) = store(Vec::new());
    ctx.wire = WireView::new(reports, ctx.settings.wire_window);
    (Arc::new(ctx), writer)
}

/// One repair pass of subnet `race`, as the server has it.
async fn repair(server: &FakeApiServer, ctx: &Arc<Context>) -> FlatNetworkSubnet {
    let subnet = server.list::<FlatNetworkSubnet>().remove(0);
    subnets::reconcile(Arc::new(subnet), Arc::clone(ctx))
        .await
        .unwrap();
    server.list::<FlatNetworkSubnet>().remove(0)
}

/// `node`'s report of `race` observed at `observed`, with `claims`.
fn observed(
    node: &str,
    observed: Timestamp,
    claims: &[(&str, &str, i64)],
) -> FlatNetworkWireClaims {
    let mut r = report(claims);
    r.metadata.name = Some(FlatNetworkWireClaims::object_name("race", node));
    r.spec.node = node.into();
    r.spec.observed_at = Some(Time(observed));
    r
}

fn holds(ledger: &[flatnet_k8s::api::IpRange], addr: &str) -> bool {
    flatnet_k8s::ipam::used_ranges::contains(ledger, ip(addr))
}

fn used(subnet: &FlatNetworkSubnet) -> Vec<flatnet_k8s::api::IpRange> {
    subnet.status.clone().unwrap_or_default().used_ip
}

/// Leaked addresses are freed before the orphan grace once every node has
/// reported, after the subnet asked, that it saw no claim on them; one a
/// node saw claimed stays. The decision is taken on what the API server
/// holds, not on the caches: here the report cache still shows node-2's
/// older report without the claim on .21.
#[tokio::test]
async fn a_leaked_address_no_node_saw_claimed_is_freed_early_and_a_claimed_one_stays() {
    let server = leaked(&["node-1", "node-2"]);
    let (ctx, mut feed) = repair_context(&server, &["node-1", "node-2"]);
    let mut subnet = repair(&server, &ctx).await;
    for _ in 0..2 {
        subnet = repair(&server, &ctx).await;
    }
    let wanted = subnet
        .status
        .clone()
        .unwrap()
        .wire_reports_wanted
        .expect("the subnet asks the nodes for reports");
    assert_eq!(used(&subnet).len(), 1, "nothing freed without the reports");

    let at = wanted.0;
    let quiet_2 = observed("node-2", at, &[]);
    for report in [observed("node-1", at, &[]), quiet_2.clone()] {
        feed.apply_watcher_event(&kube::runtime::watcher::Event::Apply(report.clone()));
        server.insert(&report);
    }
    // The server has node-2's newer report: it saw .21 claimed.
    server.insert(&observed(
        "node-2",
        at,
        &[("10.0.0.21", "02:00:00:00:0a:21", 0)],
    ));
    let subnet = repair(&server, &ctx).await;
    let ledger = used(&subnet);
    assert!(!holds(&ledger, "10.0.0.20"), "{ledger:?}");
    assert!(holds(&ledger, "10.0.0.21"), "{ledger:?}");
}

/// No early free while any node has not reported since the subnet asked:
/// a node whose report is older, and a node the node cache has not seen
/// yet (a late watch) but the API server has.
#[tokio::test]
async fn no_early_free_while_a_node_has_not_reported_since_the_subnet_asked() {
    let server = leaked(&["node-1", "node-2"]);
    // The node cache lags: only node-1.
    let (ctx, mut feed) = repair_context(&server, &["node-1"]);
    let mut subnet = repair(&server, &ctx).await;
    for _ in 0..2 {
        subnet = repair(&server, &ctx).await;
    }
    let wanted = subnet.status.clone().unwrap().wire_reports_wanted.unwrap();
    let report = observed("node-1", wanted.0, &[]);
    feed.apply_watcher_event(&kube::runtime::watcher::Event::Apply(report.clone()));
    server.insert(&report);
    // node-2 reported, but before the subnet asked.
    let before = wanted.0.checked_sub(SignedDuration::from_secs(60)).unwrap();
    server.insert(&observed("node-2", before, &[]));
    let subnet = repair(&server, &ctx).await;
    assert_eq!(
        used(&subnet),
        vec![flatnet_k8s::api::IpRange::new(
            ip("10.0.0.20"),
            ip("10.0.0.21")
        )],
        "kept for the orphan grace"
    );
    assert_eq!(
        subnet.status.unwrap().wire_reports_wanted,
        Some(wanted),
        "the request stands, unchanged (no rewrite per pass)"
    );
}
