//! Publishing the wire inventory's foreign claims against the operator's
//! fake API server: one object per subnet, written only when it changed or
//! its subnet asks for a fresh report, at most once per publish interval,
//! owned by its subnet.

use std::{collections::BTreeMap, time::Duration};

use flatnet_agent::wire_report::{PUBLISH_INTERVAL, WirePublisher};
use flatnet_k8s::{
    api::{FlatNetworkSubnet, FlatNetworkSubnetSpec, FlatNetworkWireClaims, ForeignClaim},
    keys::SUBNET_NAMESPACE,
};
use flatnet_operator::allocation::fake_api::FakeApiServer;
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::ResourceExt;
use tokio::time::Instant;

fn subnet(name: &str) -> FlatNetworkSubnet {
    let mut s = FlatNetworkSubnet::new(
        name,
        FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth0".into(),
            cidr: "192.0.2.0/24".into(),
            ..FlatNetworkSubnetSpec::default()
        },
    );
    s.metadata.namespace = Some(SUBNET_NAMESPACE.into());
    s.metadata.uid = Some(format!("uid-{name}"));
    s
}

fn claim(last: u8, seen_s: i64) -> ForeignClaim {
    ForeignClaim {
        ip: format!("192.0.2.{last}").parse().unwrap(),
        mac: format!("02:00:00:00:00:{last:02x}"),
        last_seen: Time(Timestamp::from_second(1_800_000_000 + seen_s).unwrap()),
        kind: "arp_request".into(),
    }
}

fn writes(server: &FakeApiServer) -> u64 {
    let verbs = server.requests_by_verb();
    verbs.get("create").copied().unwrap_or(0) + verbs.get("update").copied().unwrap_or(0)
}

#[tokio::test]
async fn a_report_is_written_once_per_change_and_at_most_once_per_interval() {
    let server = FakeApiServer::new();
    let lan = subnet("lan");
    server.insert(&lan);
    let subnets = vec![lan];
    let mut publisher = WirePublisher::new(server.client(), "node-1");
    let t0 = Instant::now();
    let summary = |claims: Vec<ForeignClaim>| BTreeMap::from([("lan".to_owned(), claims)]);

    assert_eq!(
        publisher
            .publish(&summary(vec![claim(7, 0)]), &subnets, t0)
            .await
            .unwrap(),
        1
    );
    assert_eq!(writes(&server), 1, "created");
    let report: FlatNetworkWireClaims = server.list().remove(0);
    assert_eq!(report.name_any(), "lan.node-1");
    assert_eq!(report.spec.claims, vec![claim(7, 0)]);
    let owner = &report.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.uid.as_str()),
        ("FlatNetworkSubnet", "uid-lan")
    );

    // Unchanged: never written again, however much time passes.
    for s in [1, 31, 600] {
        let at = t0 + Duration::from_secs(s);
        publisher
            .publish(&summary(vec![claim(7, 0)]), &subnets, at)
            .await
            .unwrap();
    }
    assert_eq!(writes(&server), 1, "no change, no write");

    // A change every second for five minutes: written at most once per
    // interval, and the last state is what the object holds at the end.
    let start = t0 + Duration::from_secs(600);
    let seconds = 300;
    for s in 1..=seconds {
        let claims: Vec<ForeignClaim> = (1..=u8::try_from(s % 50 + 1).unwrap())
            .map(|last| claim(last, i64::from(last)))
            .collect();
        publisher
            .publish(&summary(claims), &subnets, start + Duration::from_secs(s))
            .await
            .unwrap();
    }
    let bound = seconds / PUBLISH_INTERVAL.as_secs() + 1;
    let written = writes(&server) - 1;
    assert!(
        written <= bound && written >= bound - 1,
        "{written} writes for {seconds} s of changes (bound {bound})"
    );
    // The final state goes out once the interval has passed.
    let last: Vec<ForeignClaim> = (1..=3).map(|l| claim(l, 9)).collect();
    let end = start + Duration::from_secs(seconds + PUBLISH_INTERVAL.as_secs());
    publisher
        .publish(&summary(last.clone()), &subnets, end)
        .await
        .unwrap();
    let report: FlatNetworkWireClaims = server.list().remove(0);
    assert_eq!(report.spec.claims, last);
}

#[tokio::test]
async fn subnets_are_written_in_one_pass_and_quiet_ones_get_no_object() {
    let server = FakeApiServer::new();
    let subnets = vec![subnet("a"), subnet("b"), subnet("quiet")];
    for s in &subnets {
        server.insert(s);
    }
    let mut publisher = WirePublisher::new(server.client(), "node-1");
    let t0 = Instant::now();
    let summary = BTreeMap::from([
        ("a".to_owned(), vec![claim(1, 0)]),
        ("b".to_owned(), vec![claim(2, 0)]),
        ("quiet".to_owned(), vec![]),
    ]);
    assert_eq!(publisher.publish(&summary, &subnets, t0).await.unwrap(), 2);
    let mut names: Vec<String> = server
        .list::<FlatNetworkWireClaims>()
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    names.sort();
    assert_eq!(names, ["a.node-1", "b.node-1"]);

    // A subnet whose foreign hosts fell silent is emptied, not left stale.
    let cleared = BTreeMap::from([("a".to_owned(), vec![])]);
    let later = t0 + PUBLISH_INTERVAL;
    assert_eq!(
        publisher.publish(&cleared, &subnets, later).await.unwrap(),
        1
    );
    let a = server
        .list::<FlatNetworkWireClaims>()
        .into_iter()
        .find(|r| r.name_any() == "a.node-1")
        .unwrap();
    assert!(a.spec.claims.is_empty());

    // Another agent process (a restart) finds the object and replaces it.
    let mut restarted = WirePublisher::new(server.client(), "node-1");
    let again = BTreeMap::from([("b".to_owned(), vec![claim(3, 0)])]);
    assert_eq!(restarted.publish(&again, &subnets, later).await.unwrap(), 1);
    let b = server
        .list::<FlatNetworkWireClaims>()
        .into_iter()
        .find(|r| r.name_any() == "b.node-1")
        .unwrap();
    assert_eq!(b.spec.claims, vec![claim(3, 0)]);
}

/// A subnet that asks for reports observed after a time (an address no
/// record names waits to be freed) gets one from this node even when
/// nothing changed, or when the node has nothing to report; once written,
/// it is not written again for the same request.
#[tokio::test]
async fn a_subnet_asking_for_a_fresh_report_gets_one_once() {
    let server = FakeApiServer::new();
    let mut lan = subnet("lan");
    let mut quiet = subnet("quiet");
    server.insert(&lan);
    server.insert(&quiet);
    let mut publisher = WirePublisher::new(server.client(), "node-1");
    let t0 = Instant::now();
    let summary = BTreeMap::from([
        ("lan".to_owned(), vec![claim(7, 0)]),
        ("quiet".to_owned(), vec![]),
    ]);
    let subnets = vec![lan.clone(), quiet.clone()];
    assert_eq!(publisher.publish(&summary, &subnets, t0).await.unwrap(), 1);
    let first = report_of(&server, "lan.node-1").spec.observed_at.unwrap();

    // Both subnets ask for reports observed after now (second resolution).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let wanted = Time(Timestamp::from_second(Timestamp::now().as_second()).unwrap());
    for s in [&mut lan, &mut quiet] {
        s.status
            .get_or_insert_with(Default::default)
            .wire_reports_wanted = Some(wanted.clone());
    }
    let subnets = vec![lan, quiet];
    // Not before the interval has passed since the last write.
    let soon = t0 + Duration::from_secs(1);
    assert_eq!(
        publisher.publish(&summary, &subnets, soon).await.unwrap(),
        1,
        "only the subnet never written"
    );
    assert_eq!(
        report_of(&server, "lan.node-1").spec.observed_at.unwrap(),
        first
    );
    let quiet_report = report_of(&server, "quiet.node-1");
    assert!(quiet_report.spec.claims.is_empty());
    assert!(quiet_report.spec.observed_at.unwrap().0 >= wanted.0);

    let later = t0 + PUBLISH_INTERVAL;
    assert_eq!(
        publisher.publish(&summary, &subnets, later).await.unwrap(),
        1
    );
    let lan_report = report_of(&server, "lan.node-1");
    assert!(lan_report.spec.observed_at.unwrap().0 >= wanted.0);
    assert_eq!(lan_report.spec.claims, vec![claim(7, 0)], "the same claims");

    // Answered: the same request costs nothing more.
    let before = writes(&server);
    for s in [2, 3] {
        let at = t0 + PUBLISH_INTERVAL * s;
        publisher.publish(&summary, &subnets, at).await.unwrap();
    }
    assert_eq!(writes(&server), before);
}

fn report_of(server: &FakeApiServer, name: &str) -> FlatNetworkWireClaims {
    server
        .list::<FlatNetworkWireClaims>()
        .into_iter()
        .find(|r| r.name_any() == name)
        .unwrap_or_else(|| panic!("{name} not written"))
}
