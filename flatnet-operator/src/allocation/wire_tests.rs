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
    super::wire_exclusion::WireView, Context, FakeApiServer, Settings, context_from, ip, ips,
    race_pods, race_subnet, record_of, store, subnets,
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
