//! Unit tests of the MAC conflict classification and its rate limits.

use flatnet_common::wire::WireKind;
use serde_json::{Value, json};

use super::*;

const POD_MAC: [u8; 6] = [0x02, 0x10, 0, 0, 0, 0x07];
const SECOND: u64 = 1_000_000_000;

fn allocated_at() -> Timestamp {
    Timestamp::from_second(1_800_000_000).unwrap()
}

/// A FlatNetworkIP `name` with `addr` and `mac`, from the pool unless
/// `fixed` names it.
fn record(name: &str, addr: &str, mac: &str, pool: bool) -> FlatNetworkIP {
    let mut value = json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkIP",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"subnet": "lan"},
        "status": {"phase": "Active", "addr": addr, "mac": mac, "macFromPool": pool,
                   "allocatedTimeStamp": allocated_at().to_string()}
    });
    if !pool {
        value["spec"]["macs"] = json!([mac]);
    }
    serde_json::from_value(value).unwrap()
}

fn pod_record() -> FlatNetworkIP {
    record("web-0", "192.0.2.10", "02:10:00:00:00:07", true)
}

/// An attachment of this node with `mac`, on a subnet in `mode`.
fn attachment(mac: [u8; 6], mode: &str, phase: &str) -> AttachmentRecord {
    let value: Value = json!({
        "containerId": "c1", "ifname": "eth1", "network": "flat", "netns": "/proc/1/ns/net",
        "phase": phase,
        "subnets": [{"name": "lan", "spec": {"flatMode": "macvlan", "master": "up0",
                                              "cidr": "192.0.2.0/24", "mode": mode}}],
        "addresses": ["192.0.2.10/24"],
        "mac": format_mac(mac),
        "uplink": {"ifname": "up0", "ifindex": 7, "ownerMac": format_mac(mac), "responder": false}
    });
    serde_json::from_value(value).unwrap()
}

fn claim(addr: &str, mac: [u8; 6], last_seen_ns: u64) -> WireClaimEntry {
    WireClaimEntry {
        ifindex: 7,
        vlan: 0,
        addr: addr.parse().unwrap(),
        mac,
        kind: Some(WireKind::GratuitousArp),
        last_seen_ns,
    }
}

fn after_allocation() -> Timestamp {
    allocated_at() + SignedDuration::from_secs(60)
}

fn classify_one(
    claim: &WireClaimEntry,
    records: &[FlatNetworkIP],
    local: &LocalPods,
) -> Option<MacConflict> {
    classify(
        claim,
        after_allocation(),
        &MacHolders::new(records),
        local,
        &FloatingNetworks::default(),
    )
}

#[test]
fn a_pool_mac_claiming_another_address_is_a_conflict() {
    let found = classify_one(
        &claim("192.0.2.77", POD_MAC, 5),
        &[pod_record()],
        &LocalPods::default(),
    )
    .expect("a conflict");
    assert_eq!(found.kind, MacConflictKind::OtherAddress);
    assert_eq!(found.record.to_string(), "default/web-0");
    assert_eq!(found.addr, "192.0.2.77".parse::<IpAddr>().unwrap());
    assert_eq!(found.frame, "gratuitous_arp");
    // The same with a fixed MAC: also flatnet's.
    let fixed = record("db-0", "192.0.2.11", "02:10:00:00:00:07", false);
    assert!(
        classify_one(
            &claim("192.0.2.77", POD_MAC, 5),
            &[fixed],
            &LocalPods::default()
        )
        .is_some()
    );
    // Out of the address space of any record too: anything the MAC claims.
    assert!(
        classify_one(
            &claim("203.0.113.5", POD_MAC, 5),
            &[pod_record()],
            &LocalPods::default()
        )
        .is_some()
    );
}

#[test]
fn a_pod_on_another_node_claiming_its_own_addresses_is_no_conflict() {
    // The second record names the interface's MAC, not from the pool.
    let mut six = record("web-0.ipv6", "2001:db8::10", "02:10:00:00:00:07", false);
    six.spec.macs.clear();
    let records = [pod_record(), six];
    let local = LocalPods::default();
    // The last: the SLAAC address of 02:10:00:00:00:07 in a prefix a router
    // advertises.
    for addr in [
        "192.0.2.10",
        "2001:db8::10",
        "2002:c000:20a::",
        "2001:db8:1:2:10:ff:fe00:7",
    ] {
        assert_eq!(
            classify_one(&claim(addr, POD_MAC, 5), &records, &local),
            None,
            "{addr}: the pod's own (the dual-stack sibling's, the 6to4 one, SLAAC)"
        );
    }
    // Another MAC's SLAAC address is no address of the pod.
    let other_slaac = claim("2001:db8:1:2:10:ff:fe00:8", POD_MAC, 5);
    assert!(classify_one(&other_slaac, &records, &local).is_some());
    // Another address of the IPv6 family goes to the IPv6 record.
    let found = classify_one(&claim("2001:db8::99", POD_MAC, 5), &records, &local).unwrap();
    assert_eq!(found.record.name, "web-0.ipv6");
}

#[test]
fn only_live_flatnet_macs_seen_after_their_allocation_count() {
    let local = LocalPods::default();
    let rogue = claim("192.0.2.77", POD_MAC, 5);
    // Kernel-chosen (ipvlan pods carry the node's MAC): not flatnet's.
    let kernel = record("k", "192.0.2.12", "02:10:00:00:00:07", false);
    let mut kernel = kernel;
    kernel.spec.macs.clear();
    assert_eq!(classify_one(&rogue, &[kernel], &local), None);
    let mut deleting = pod_record();
    deleting.metadata.deletion_timestamp = Some(
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(allocated_at()),
    );
    assert_eq!(classify_one(&rogue, &[deleting], &local), None);
    let holders = MacHolders::new(&[pod_record()]);
    let before = allocated_at() - SignedDuration::from_secs(1);
    assert_eq!(
        classify(
            &rogue,
            before,
            &holders,
            &local,
            &FloatingNetworks::default()
        ),
        None,
        "seen before the MAC was this record's"
    );
    // Another MAC is none of flatnet's business here.
    let other = claim("192.0.2.77", [0x02, 0x10, 0, 0, 0, 0x08], 5);
    assert_eq!(classify_one(&other, &[pod_record()], &local), None);
}

#[test]
fn floating_addresses_are_announced_from_pod_macs() {
    let pool: FloatingIPPool = serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPPool",
        "metadata": {"name": "vip"},
        "spec": {"targetNetworkInterface": "up0", "cidrs": ["198.51.100.0/24"]}
    }))
    .unwrap();
    let floating = FloatingNetworks::new([&pool]);
    let holders = MacHolders::new(&[pod_record()]);
    let local = LocalPods::default();
    let at = after_allocation();
    let vip = claim("198.51.100.5", POD_MAC, 5);
    assert_eq!(classify(&vip, at, &holders, &local, &floating), None);
    let elsewhere = claim("198.51.101.5", POD_MAC, 5);
    assert!(classify(&elsewhere, at, &holders, &local, &floating).is_some());
}

#[test]
fn the_own_address_from_the_wire_on_the_pods_node_is_a_conflict() {
    let own = claim("192.0.2.10", POD_MAC, 5);
    let here = LocalPods::new("node-1", &[attachment(POD_MAC, "bridge", "ready")]);
    let found = classify_one(&own, &[pod_record()], &here).expect("a clone of the pod");
    assert_eq!(found.kind, MacConflictKind::PodOnThisNode);
    assert_eq!(here.uplink_name(7), "up0");
    assert_eq!(here.uplink_name(8), "ifindex 8");
    // A VEPA switch reflects the pod's own frames; an attachment not
    // finished is not attached.
    for (mode, phase) in [("vepa", "ready"), ("bridge", "pending")] {
        let local = LocalPods::new("node-1", &[attachment(POD_MAC, mode, phase)]);
        assert_eq!(
            classify_one(&own, &[pod_record()], &local),
            None,
            "{mode} {phase}"
        );
    }
}

fn conflict(addr: &str, last_seen_ns: u64) -> MacConflict {
    classify_one(
        &claim(addr, POD_MAC, last_seen_ns),
        &[pod_record()],
        &LocalPods::default(),
    )
    .unwrap()
}

#[test]
fn sightings_are_counted_once_and_reported_once_per_interval() {
    let mut limiter = Limiter::default();
    let t0 = Instant::now();
    let first = limiter.scan(vec![conflict("192.0.2.77", SECOND)], t0);
    assert_eq!(first.sightings[&MacConflictKind::OtherAddress], 1);
    assert_eq!(first.reports.len(), 1);

    // The same inventory entry again: nothing new.
    let again = limiter.scan(vec![conflict("192.0.2.77", SECOND)], t0 + SCAN_INTERVAL);
    assert_eq!(again, Actions::default());

    // The rogue keeps talking: counted, not reported within the interval.
    let mut reports = 0;
    for step in 1..=200u32 {
        let at = t0 + SCAN_INTERVAL * step;
        let scan = limiter.scan(
            vec![conflict("192.0.2.77", SECOND * (1 + u64::from(step)))],
            at,
        );
        assert_eq!(scan.sightings[&MacConflictKind::OtherAddress], 1);
        reports += scan.reports.len();
    }
    let elapsed = SCAN_INTERVAL * 200;
    let bound = usize::try_from(elapsed.as_secs() / REPORT_INTERVAL.as_secs()).unwrap();
    assert_eq!(reports, bound, "one report per interval over {elapsed:?}");

    // Another address of the same record is another claim: reported now.
    let other = limiter.scan(
        vec![conflict("192.0.2.78", SECOND)],
        t0 + SCAN_INTERVAL * 201,
    );
    assert_eq!(other.reports.len(), 1);
}

#[test]
fn a_record_quiet_for_long_enough_is_cleared_once() {
    let mut limiter = Limiter::default();
    let t0 = Instant::now();
    limiter.scan(vec![conflict("192.0.2.77", SECOND)], t0);
    let stale = vec![conflict("192.0.2.77", SECOND)];
    let early = limiter.scan(stale.clone(), t0 + CLEAR_AFTER - SCAN_INTERVAL);
    assert!(early.clears.is_empty(), "not quiet long enough");
    // The inventory still holds the old sighting: that is no new conflict.
    let cleared = limiter.scan(stale.clone(), t0 + CLEAR_AFTER);
    assert_eq!(cleared.clears.len(), 1);
    assert_eq!(cleared.clears[0].name, "web-0");
    assert!(limiter.scan(stale, t0 + CLEAR_AFTER * 2).clears.is_empty());
    // Seen again later: reported again at once.
    let back = limiter.scan(
        vec![conflict("192.0.2.77", SECOND * 9000)],
        t0 + CLEAR_AFTER * 3,
    );
    assert_eq!(back.reports.len(), 1);
}

#[test]
fn a_broadcast_is_reported_by_the_pods_node_and_a_directed_frame_by_whoever_saw_it() {
    let mut on_node_1 = pod_record();
    on_node_1.status.as_mut().unwrap().node = "node-1".into();
    let records = [on_node_1];
    let seen_on = |node: &str, kind: WireKind| {
        let local = LocalPods::new(node, &[]);
        let mut rogue = claim("192.0.2.77", POD_MAC, 5);
        rogue.kind = Some(kind);
        classify_one(&rogue, &records, &local)
            .unwrap()
            .reported_here
    };
    for kind in [
        WireKind::GratuitousArp,
        WireKind::ArpRequest,
        WireKind::ArpProbe,
        WireKind::NeighborSolicitation,
        WireKind::DuplicateAddressDetection,
    ] {
        assert!(seen_on("node-1", kind), "{kind:?} on the pod's node");
        assert!(!seen_on("node-2", kind), "{kind:?} reaches node-1 too");
    }
    for kind in [WireKind::ArpReply, WireKind::NeighborAdvertisement] {
        assert!(seen_on("node-2", kind), "{kind:?} may reach node-2 alone");
    }
    // A pod attached nowhere yet: every node that sees it reports.
    let local = LocalPods::new("node-2", &[]);
    let unattached = classify_one(&claim("192.0.2.77", POD_MAC, 5), &[pod_record()], &local);
    assert!(unattached.unwrap().reported_here);
}

#[test]
fn a_conflict_another_node_reports_is_counted_here_only() {
    let mut limiter = Limiter::default();
    let t0 = Instant::now();
    let mut elsewhere = conflict("192.0.2.77", SECOND);
    elsewhere.reported_here = false;
    let scan = limiter.scan(vec![elsewhere.clone()], t0);
    assert_eq!(scan.sightings[&MacConflictKind::OtherAddress], 1);
    assert!(scan.reports.is_empty());
    assert_eq!(
        limiter.scan(vec![elsewhere.clone()], t0),
        Actions::default()
    );
    let later = MacConflict {
        last_seen_ns: 2 * SECOND,
        ..elsewhere
    };
    assert_eq!(limiter.scan(vec![later], t0 + CLEAR_AFTER * 2).clears, []);
}

#[test]
fn a_condition_set_before_a_restart_is_cleared_by_the_node_that_set_it() {
    let mut limiter = Limiter::default();
    let t0 = Instant::now();
    let with_condition = |node: &str| {
        let mut record = pod_record();
        let text = message(&conflict("192.0.2.77", SECOND), node, "up0");
        record.status.as_mut().unwrap().conditions = vec![
            serde_json::from_value(json!({
                "type": CONDITION_MAC_CONFLICT, "status": "True", "reason": REASON,
                "message": text, "lastTransitionTime": "2027-01-15T08:00:00Z"
            }))
            .unwrap(),
        ];
        record
    };
    limiter.adopt(&[with_condition("node-2")], "node-1", t0);
    assert!(
        limiter.scan(vec![], t0 + CLEAR_AFTER).clears.is_empty(),
        "another node's"
    );
    limiter.adopt(&[with_condition("node-1")], "node-1", t0);
    let scan = limiter.scan(vec![], t0 + CLEAR_AFTER);
    assert_eq!(scan.clears.len(), 1);
    assert_eq!(scan.clears[0].name, "web-0");
}

#[test]
fn the_message_names_mac_address_node_and_interface() {
    let mut tagged = conflict("192.0.2.77", SECOND);
    tagged.vlan = 100;
    let text = message(&tagged, "node-1", "up0");
    for part in [
        "02:10:00:00:00:07",
        "192.0.2.77",
        "gratuitous_arp",
        "node node-1",
        "interface up0 VLAN 100",
    ] {
        assert!(text.contains(part), "{part} missing in {text}");
    }
}
