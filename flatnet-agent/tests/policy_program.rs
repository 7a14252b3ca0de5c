//! The pod-interface policy programs on the real kernel, run with
//! `BPF_PROG_TEST_RUN` on crafted frames: compiled MultiNetworkPolicies are
//! installed in the pinned maps exactly as the agent does it.

mod support;

use std::collections::BTreeMap;

use flatnet_agent::{
    datapath::{Datapath, DatapathConfig, PolicyDrops, PolicyMaps, PolicyRuleIds},
    policy_compiler::{FlatPod, MultiNetworkPolicy},
};
use flatnet_common::policy::{Direction, PolicyStat};
use support::{
    TestPinRoot,
    frames::{
        self, ICMP, ICMPV6, SCTP, TCP, UDP, eth, ext8, frag6, icmp, icmp_error, ipv4, ipv6, ports,
        v4, v6,
    },
    policy::{app_pod, compile_cleanly},
    privileged,
};

use flatnet_common::verdict::{DROP, PASS};

/// The policy of pod a/web (10.0.0.1, fd00::1), isolated both ways:
/// - ingress from 192.168.0.0/16 except 192.168.5.0/24 on TCP 80-90, UDP 53, SCTP 5000;
/// - ingress from pods app=db (a/db: 10.0.0.2, fd00::2) on everything;
/// - egress to 10.0.0.0/24 on TCP 5432 and to fd00::/64 on UDP 53.
const WEB_POLICY: &str = r#"{
  "apiVersion": "k8s.cni.cncf.io/v1beta1", "kind": "MultiNetworkPolicy",
  "metadata": {"name": "web", "namespace": "a",
               "annotations": {"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}},
  "spec": {
    "podSelector": {"matchLabels": {"app": "web"}},
    "policyTypes": ["Ingress", "Egress"],
    "ingress": [
      {"from": [{"ipBlock": {"cidr": "192.168.0.0/16", "except": ["192.168.5.0/24"]}}],
       "ports": [{"protocol": "TCP", "port": 80, "endPort": 90},
                 {"protocol": "UDP", "port": 53},
                 {"protocol": "SCTP", "port": 5000}]},
      {"from": [{"podSelector": {"matchLabels": {"app": "db"}}}]}
    ],
    "egress": [
      {"to": [{"ipBlock": {"cidr": "10.0.0.0/24"}}], "ports": [{"port": 5432}]},
      {"to": [{"ipBlock": {"cidr": "fd00::/64"}}], "ports": [{"protocol": "UDP", "port": 53}]}
    ]
  }
}"#;

fn pods() -> Vec<FlatPod> {
    vec![
        app_pod("web", "web", &["10.0.0.1", "fd00::1"], true),
        app_pod("db", "db", &["10.0.0.2", "fd00::2"], true),
        app_pod("other", "other", &["10.0.0.3", "fd00::3"], true),
    ]
}

struct Fixture {
    datapath: Datapath,
    maps: PolicyMaps,
    ids: PolicyRuleIds,
    _pin: TestPinRoot,
}

impl Fixture {
    /// The fixture with [`WEB_POLICY`] installed for `test`, or `None` (the
    /// skip printed) without the privileges it needs.
    fn web_for_test(test: &str) -> Option<Self> {
        privileged(test).then(|| Self::logging(&[WEB_POLICY], false))
    }

    /// A fixture whose programs log (kernel logs) or not.
    fn logging(policies: &[&str], kernel_logs: bool) -> Self {
        let pin = TestPinRoot::new();
        let datapath =
            Datapath::load_with_kernel_logs(&DatapathConfig::pinned_at(&pin.path), kernel_logs)
                .expect("load eBPF object");
        let maps = datapath.policy_maps().expect("open policy maps");
        let mut fixture = Self {
            datapath,
            maps,
            ids: PolicyRuleIds::default(),
            _pin: pin,
        };
        fixture.apply(policies);
        fixture
    }

    fn apply(&mut self, policies: &[&str]) {
        let policies: Vec<MultiNetworkPolicy> = policies
            .iter()
            .map(|p| serde_json::from_str(p).expect("policy JSON"))
            .collect();
        let compiled = compile_cleanly(&policies, &pods());
        self.maps
            .apply(&compiled, &mut self.ids)
            .expect("apply policy");
    }

    fn run(&mut self, direction: Direction, frame: &[u8]) -> i32 {
        self.datapath
            .test_run_policy(direction, frame, 1)
            .expect("BPF_PROG_TEST_RUN")
            .verdict
    }

    fn ingress(&mut self, frame: &[u8]) -> i32 {
        self.run(Direction::Ingress, frame)
    }

    fn egress(&mut self, frame: &[u8]) -> i32 {
        self.run(Direction::Egress, frame)
    }

    fn stat(&self, stat: PolicyStat) -> u64 {
        self.maps.stats().expect("read stats").get(stat)
    }
}

#[test]
fn test_run_allows_and_denies_by_prefix_protocol_and_port() {
    let Some(mut f) =
        Fixture::web_for_test("test_run_allows_and_denies_by_prefix_protocol_and_port")
    else {
        return;
    };
    let (web, lan) = ("10.0.0.1", "192.168.1.1");
    // To web's `port` from `src` port 40000; to fd00::1 (web) over IPv6.
    let to_web = |src, protocol, port| v4(src, web, protocol, 40000, port);
    let to_web6 = |src, protocol, port| v6(src, "fd00::1", protocol, 40000, port);
    let cases = [
        (to_web(lan, TCP, 80), PASS, "TCP 80, start of the range"),
        (to_web(lan, TCP, 90), PASS, "TCP 90, end of the range"),
        (to_web(lan, TCP, 91), DROP, "TCP 91, past endPort"),
        (to_web(lan, TCP, 79), DROP, "TCP 79, before the range"),
        (to_web(lan, UDP, 53), PASS, "UDP 53"),
        (to_web(lan, UDP, 80), DROP, "UDP 80: only TCP"),
        (to_web(lan, SCTP, 5000), PASS, "SCTP 5000"),
        (v4(lan, web, ICMP, 7, 0), DROP, "ICMP has no port"),
        (to_web("192.168.5.5", TCP, 80), DROP, "except block"),
        (
            to_web("192.168.6.5", TCP, 80),
            PASS,
            "next to the except block",
        ),
        (to_web("172.16.0.1", TCP, 80), DROP, "outside every peer"),
        (v4("10.0.0.2", web, ICMP, 7, 0), PASS, "db pod: everything"),
        (to_web("10.0.0.2", TCP, 22), PASS, "db pod: everything"),
        (to_web("10.0.0.3", TCP, 80), DROP, "other pod"),
        (to_web6("fd00::2", TCP, 22), PASS, "db pod over IPv6"),
        (
            v6("fd00::2", "fd00::1", ICMPV6, 9, 0),
            PASS,
            "db pod ICMPv6 echo",
        ),
        (
            to_web6("fd00::99", TCP, 80),
            DROP,
            "IPv4 ipBlock never matches IPv6",
        ),
        (
            v4(lan, "10.0.0.3", TCP, 40000, 9999),
            PASS,
            "pod without policy",
        ),
    ];
    for (frame, expected, why) in &cases {
        assert_eq!(f.ingress(frame), *expected, "ingress: {why}");
    }
    // Egress of web.
    assert_eq!(f.egress(&v4(web, "10.0.0.9", TCP, 40000, 5432)), PASS);
    assert_eq!(f.egress(&v4(web, "10.0.0.9", UDP, 40000, 5432)), DROP);
    assert_eq!(f.egress(&v4(web, "10.0.1.9", TCP, 40000, 5432)), DROP);
    assert_eq!(f.egress(&v6("fd00::1", "fd00::53", UDP, 40000, 53)), PASS);
    assert_eq!(f.egress(&v6("fd00::1", "fd01::53", UDP, 40000, 53)), DROP);

    let denied = cases.iter().filter(|c| c.1 == DROP).count() as u64 + 3;
    assert_eq!(f.stat(PolicyStat::DeniedNoRule), denied);
    let installed = f.maps.installed().expect("read installed tables");
    let counted: u64 = installed
        .entries
        .iter()
        .flat_map(|e| &e.matches)
        .map(|m| (m.rule_id, m.counter.packets))
        .collect::<BTreeMap<_, _>>()
        .values()
        .sum();
    assert_eq!(
        counted,
        f.stat(PolicyStat::AllowedByRule),
        "every packet a rule allowed is counted on that rule"
    );
    assert!(counted > 0);

    // Drops are reported through the ring buffer.
    let mut drops = PolicyDrops::open(f.datapath.pin_root()).expect("open drop events");
    let first = drops.try_next().expect("a drop event");
    assert_eq!(first.direction, Direction::Ingress);
    assert_eq!(
        (first.src.to_string(), first.dst_port),
        ("192.168.1.1".into(), 91)
    );
}

#[test]
fn test_run_replies_of_allowed_flows_pass() {
    let Some(mut f) = Fixture::web_for_test("test_run_replies_of_allowed_flows_pass") else {
        return;
    };
    let reply = v4("10.0.0.9", "10.0.0.1", TCP, 5432, 40000);
    assert_eq!(f.ingress(&reply), DROP, "no flow yet: not a reply");
    assert_eq!(
        f.egress(&v4("10.0.0.1", "10.0.0.9", TCP, 40000, 5432)),
        PASS
    );
    assert_eq!(f.ingress(&reply), PASS, "reply of the allowed flow");
    assert_eq!(
        f.ingress(&v4("10.0.0.9", "10.0.0.1", TCP, 5432, 40001)),
        DROP,
        "another port is not a reply"
    );

    // ICMP echo from db (allowed in): the echo reply may go out although
    // egress allows only TCP 5432 / UDP 53.
    let mut echo_reply = ipv4(
        "10.0.0.1".parse().unwrap(),
        "10.0.0.2".parse().unwrap(),
        ICMP,
        1,
        0,
        &icmp(0, 77),
    );
    echo_reply = eth(0x0800, &echo_reply);
    assert_eq!(f.egress(&echo_reply), DROP, "no request seen yet");
    assert_eq!(f.ingress(&v4("10.0.0.2", "10.0.0.1", ICMP, 77, 0)), PASS);
    assert_eq!(f.egress(&echo_reply), PASS, "echo reply");

    // IPv6 UDP: out to fd00::53:53, reply back in.
    assert_eq!(f.egress(&v6("fd00::1", "fd00::53", UDP, 5555, 53)), PASS);
    assert_eq!(f.ingress(&v6("fd00::53", "fd00::1", UDP, 53, 5555)), PASS);
    assert_eq!(f.ingress(&v6("fd00::53", "fd00::1", UDP, 53, 5556)), DROP);
    assert_eq!(f.stat(PolicyStat::AllowedReply), 3);
}

/// An ICMPv4 error from `from` to `to` quoting the first `len` bytes of a
/// TCP segment `src:sport -> dst:dport`.
fn icmp4_error(
    from: &str,
    to: &str,
    icmp_type: u8,
    quoted: (&str, &str, u16, u16),
    len: usize,
) -> Vec<u8> {
    let (src, dst, sport, dport) = quoted;
    let segment = ipv4(
        src.parse().unwrap(),
        dst.parse().unwrap(),
        TCP,
        9,
        0,
        &ports(sport, dport),
    );
    let error = icmp_error(icmp_type, &segment[..len]);
    eth(
        0x0800,
        &ipv4(
            from.parse().unwrap(),
            to.parse().unwrap(),
            ICMP,
            1,
            0,
            &error,
        ),
    )
}

/// An ICMPv6 error from `from` to `to` quoting the first `len` bytes of a
/// UDP datagram `src:sport -> dst:dport` (after `ext`, extension headers
/// ending in UDP, when given).
fn icmp6_error(
    from: &str,
    to: &str,
    icmp_type: u8,
    quoted: (&str, &str, u16, u16),
    ext: Option<Vec<u8>>,
    len: usize,
) -> Vec<u8> {
    let (src, dst, sport, dport) = quoted;
    let (next, mut payload) = match ext {
        Some(ext) => (60, ext),
        None => (UDP, Vec::new()),
    };
    payload.extend(ports(sport, dport));
    let datagram = ipv6(src.parse().unwrap(), dst.parse().unwrap(), next, &payload);
    let error = icmp_error(icmp_type, &datagram[..len]);
    eth(
        0x86dd,
        &ipv6(from.parse().unwrap(), to.parse().unwrap(), ICMPV6, &error),
    )
}

#[test]
fn test_run_icmpv4_errors_about_tracked_flows_pass() {
    let Some(mut f) = Fixture::web_for_test("test_run_icmpv4_errors_about_tracked_flows_pass")
    else {
        return;
    };
    let (web, remote, router) = ("10.0.0.1", "10.0.0.9", "10.0.0.254");
    let out = (web, remote, 40000, 5432);
    // Destination unreachable quoting the IP header and 8 bytes of TCP.
    let unreachable = icmp4_error(router, web, 3, out, 28);
    assert_eq!(
        f.ingress(&unreachable),
        DROP,
        "no flow yet: no rule for the router"
    );
    assert_eq!(f.egress(&v4(web, remote, TCP, 40000, 5432)), PASS);
    assert_eq!(f.ingress(&unreachable), PASS, "about the allowed flow");
    for icmp_type in [11, 12] {
        assert_eq!(
            f.ingress(&icmp4_error(router, web, icmp_type, out, 28)),
            PASS,
            "type {icmp_type}"
        );
    }
    assert_eq!(
        f.ingress(&icmp4_error(router, web, 3, (web, remote, 40001, 5432), 28)),
        DROP,
        "about another flow"
    );
    assert_eq!(
        f.ingress(&icmp4_error(router, web, 5, out, 28)),
        DROP,
        "a redirect is not an error about the flow"
    );
    // Quotes cut short: inside the ports, inside the IP header.
    assert_eq!(f.ingress(&icmp4_error(router, web, 3, out, 22)), DROP);
    assert_eq!(f.ingress(&icmp4_error(router, web, 3, out, 12)), DROP);
    // Cut short but from a sender a rule allows without ports: the rule decides.
    assert_eq!(f.ingress(&icmp4_error("10.0.0.2", web, 3, out, 12)), PASS);

    // The pod's own error about a flow allowed in goes out, although
    // egress allows only TCP 5432 within 10.0.0.0/24.
    let lan = "192.168.1.1";
    let port_unreachable = icmp4_error(web, lan, 3, (lan, web, 40000, 80), 28);
    assert_eq!(f.egress(&port_unreachable), DROP, "no flow yet");
    assert_eq!(f.ingress(&v4(lan, web, TCP, 40000, 80)), PASS);
    assert_eq!(
        f.egress(&port_unreachable),
        PASS,
        "about the flow allowed in"
    );
    assert_eq!(f.stat(PolicyStat::AllowedRelated), 4);
}

#[test]
fn test_run_icmpv6_errors_about_tracked_flows_pass() {
    let Some(mut f) = Fixture::web_for_test("test_run_icmpv6_errors_about_tracked_flows_pass")
    else {
        return;
    };
    let (web, resolver, router) = ("fd00::1", "fd00::53", "fd00::fe");
    let out = (web, resolver, 5555, 53);
    // Packet too big quoting the IP header and the UDP header.
    let too_big = icmp6_error(router, web, 2, out, None, 48);
    assert_eq!(
        f.ingress(&too_big),
        DROP,
        "no flow yet: no rule for the router"
    );
    assert_eq!(f.egress(&v6(web, resolver, UDP, 5555, 53)), PASS);
    assert_eq!(f.ingress(&too_big), PASS, "about the allowed flow");
    for icmp_type in [1, 3, 4] {
        assert_eq!(
            f.ingress(&icmp6_error(router, web, icmp_type, out, None, 48)),
            PASS,
            "type {icmp_type}"
        );
    }
    assert_eq!(
        f.ingress(&icmp6_error(
            router,
            web,
            2,
            (web, resolver, 5556, 53),
            None,
            48
        )),
        DROP,
        "about another flow"
    );
    // Quotes cut short: inside the ports, inside the IP header; a quote
    // with an extension header is not followed.
    assert_eq!(f.ingress(&icmp6_error(router, web, 2, out, None, 42)), DROP);
    assert_eq!(f.ingress(&icmp6_error(router, web, 2, out, None, 30)), DROP);
    assert_eq!(
        f.ingress(&icmp6_error(router, web, 2, out, Some(ext8(UDP)), 56)),
        DROP
    );
    // Cut short but from a sender a rule allows without ports: the rule decides.
    assert_eq!(
        f.ingress(&icmp6_error("fd00::2", web, 2, out, None, 30)),
        PASS
    );
    assert_eq!(f.stat(PolicyStat::AllowedRelated), 4);
}

#[test]
fn test_run_fragments_follow_their_first_fragment() {
    let Some(mut f) = Fixture::web_for_test("test_run_fragments_follow_their_first_fragment")
    else {
        return;
    };
    let src = "192.168.1.1".parse().unwrap();
    let web = "10.0.0.1".parse().unwrap();
    let first = eth(0x0800, &ipv4(src, web, TCP, 7, 0x2000, &ports(40000, 80)));
    let later = |id| eth(0x0800, &ipv4(src, web, TCP, id, 0x0003, &[0u8; 24]));
    assert_eq!(f.ingress(&later(7)), DROP, "first fragment not seen yet");
    assert_eq!(f.ingress(&first), PASS);
    assert_eq!(
        f.ingress(&later(7)),
        PASS,
        "follows the allowed first fragment"
    );
    assert_eq!(f.ingress(&later(8)), DROP, "another datagram");
    let denied_first = eth(0x0800, &ipv4(src, web, TCP, 9, 0x2000, &ports(40000, 22)));
    assert_eq!(f.ingress(&denied_first), DROP);
    assert_eq!(
        f.ingress(&later(9)),
        DROP,
        "follows the denied first fragment"
    );
    let unisolated = eth(
        0x0800,
        &ipv4(src, "10.0.0.3".parse().unwrap(), UDP, 3, 0x0003, &[0u8; 8]),
    );
    assert_eq!(f.ingress(&unisolated), PASS, "pod without policy");

    // IPv6 fragment header after a hop-by-hop header.
    let (db, web6) = ("fd00::2".parse().unwrap(), "fd00::1".parse().unwrap());
    let mut first6 = ext8(44);
    first6.extend(frag6(TCP, 0, true, 0x1234));
    first6.extend(ports(40000, 22));
    assert_eq!(f.ingress(&eth(0x86dd, &ipv6(db, web6, 0, &first6))), PASS);
    let mut later6 = frag6(TCP, 100, false, 0x1234);
    later6.extend([0u8; 16]);
    assert_eq!(f.ingress(&eth(0x86dd, &ipv6(db, web6, 44, &later6))), PASS);
    let other: std::net::Ipv6Addr = "fd00::99".parse().unwrap();
    assert_eq!(
        f.ingress(&eth(0x86dd, &ipv6(other, web6, 44, &later6))),
        DROP,
        "same id from another source"
    );
    assert_eq!(f.stat(PolicyStat::AllowedFragment), 2);
    assert_eq!(f.stat(PolicyStat::DeniedFragment), 4);
}

#[test]
fn test_run_malformed_truncated_and_non_ip_frames() {
    let Some(mut f) = Fixture::web_for_test("test_run_malformed_truncated_and_non_ip_frames")
    else {
        return;
    };
    let allowed = v4("192.168.1.1", "10.0.0.1", TCP, 40000, 80);
    assert_eq!(f.ingress(&allowed), PASS);

    // (Frames whose IPv4 or IPv6 header itself is cut short cannot be
    // injected here: BPF_PROG_TEST_RUN refuses them with EINVAL.)
    // IHL below 5.
    let mut bad_ihl = allowed.clone();
    bad_ihl[14] = 0x44;
    assert_eq!(f.ingress(&bad_ihl), DROP);
    // Version 6 in an IPv4 frame.
    let mut bad_version = allowed.clone();
    bad_version[14] = 0x65;
    assert_eq!(f.ingress(&bad_version), DROP);
    // TCP header cut before the ports, to an isolated pod and to a pod without policy.
    assert_eq!(f.ingress(&allowed[..14 + 20 + 2]), DROP);
    let open = v4("192.168.1.1", "10.0.0.3", TCP, 40000, 80);
    assert_eq!(f.ingress(&open[..14 + 20 + 2]), PASS);
    // Extension header chain cut short; too many extension headers.
    let (db, web6) = ("fd00::2".parse().unwrap(), "fd00::1".parse().unwrap());
    assert_eq!(
        f.ingress(&eth(0x86dd, &ipv6(db, web6, 60, &[TCP, 0, 0]))),
        DROP
    );
    let mut chain = Vec::new();
    for _ in 0..8 {
        chain.extend(ext8(60));
    }
    chain.extend(ports(40000, 22));
    assert_eq!(f.ingress(&eth(0x86dd, &ipv6(db, web6, 60, &chain))), DROP);
    let mut two = ext8(60);
    two.extend(ext8(TCP));
    two.extend(ports(40000, 22));
    assert_eq!(
        f.ingress(&eth(0x86dd, &ipv6(db, web6, 0, &two))),
        PASS,
        "two extension headers"
    );
    assert_eq!(f.stat(PolicyStat::DeniedMalformed), 5);

    // Always passed: ARP, neighbour discovery, non-IP, runt frames.
    let arp = eth(
        0x0806,
        &[
            0, 1, 8, 0, 6, 4, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ],
    );
    assert_eq!(f.ingress(&arp), PASS);
    assert_eq!(f.egress(&arp), PASS);
    let ns = eth(
        0x86dd,
        &ipv6(
            "fe80::2".parse().unwrap(),
            "ff02::1:ff00:1".parse().unwrap(),
            ICMPV6,
            &icmp(135, 0),
        ),
    );
    assert_eq!(f.ingress(&ns), PASS);
    assert_eq!(f.egress(&ns), PASS);
    assert_eq!(f.ingress(&eth(0x88cc, &[0u8; 46])), PASS, "LLDP");

    // VLAN-tagged frames never reach pod interfaces, but are judged by their IP packet.
    assert_eq!(f.ingress(&frames::vlan_tagged(&allowed, 10)), PASS);
    let denied = v4("192.168.1.1", "10.0.0.1", TCP, 40000, 91);
    assert_eq!(f.ingress(&frames::vlan_tagged(&denied, 10)), DROP);
}

#[test]
fn test_run_policy_updates_change_only_maps() {
    let Some(mut f) = Fixture::web_for_test("test_run_policy_updates_change_only_maps") else {
        return;
    };
    let http = v4("192.168.1.1", "10.0.0.1", TCP, 40000, 80);
    let from_db = v4("10.0.0.2", "10.0.0.1", TCP, 40000, 22);
    assert_eq!(f.ingress(&http), PASS);
    assert_eq!(f.ingress(&from_db), PASS);

    // Only the db rule left: HTTP from the LAN is denied now.
    let db_only = WEB_POLICY.replace("192.168.0.0/16", "203.0.113.0/24");
    f.apply(&[&db_only]);
    assert_eq!(f.ingress(&http), DROP);
    assert_eq!(f.ingress(&from_db), PASS);

    // No policy: nothing isolated, every table entry gone.
    f.apply(&[]);
    assert_eq!(f.ingress(&http), PASS);
    assert_eq!(f.ingress(&v4("172.16.0.1", "10.0.0.1", TCP, 1, 2)), PASS);
    let installed = f.maps.installed().unwrap();
    assert!(installed.entries.is_empty() && installed.subjects.is_empty());

    // Back again.
    f.apply(&[WEB_POLICY]);
    assert_eq!(f.ingress(&v4("172.16.0.1", "10.0.0.1", TCP, 1, 2)), DROP);
}

/// Removes every LPM entry behind the agent's back, leaving the subjects and
/// their policy digests as they are: only packets that are judged in full
/// notice.
fn clear_lpm_entries(pin: &TestPinRoot) {
    use aya::maps::{LpmTrie, Map, MapData};
    use flatnet_common::policy::{PolicyAllow, PolicyLpmData};
    let path = pin.path.join(flatnet_common::pin::MAP_POLICY_CIDRS);
    let data = MapData::from_pin(&path).expect("open the pinned LPM trie");
    let mut trie: LpmTrie<_, PolicyLpmData, PolicyAllow> =
        LpmTrie::try_from(Map::LpmTrie(data)).expect("LPM trie");
    let keys: Vec<_> = trie.keys().map(|k| k.expect("read key")).collect();
    assert!(!keys.is_empty());
    for key in keys {
        trie.remove(&key).expect("remove entry");
    }
}

fn digest_of(f: &Fixture, addr: &str) -> Option<String> {
    let addr: std::net::IpAddr = addr.parse().unwrap();
    f.maps
        .installed()
        .expect("read installed tables")
        .subjects
        .into_iter()
        .find(|s| s.addr == addr)
        .map(|s| s.policy_digest)
}

#[test]
fn test_run_tracked_flows_pass_until_the_policy_changes() {
    let Some(mut f) = Fixture::web_for_test("test_run_tracked_flows_pass_until_the_policy_changes")
    else {
        return;
    };
    let http = v4("192.168.1.1", "10.0.0.1", TCP, 40000, 80);
    assert_eq!(f.ingress(&http), PASS, "first packet: judged by the rules");
    assert_eq!(f.ingress(&http), PASS, "second packet: tracked");
    let rule_packets = |f: &Fixture| -> u64 {
        f.maps
            .installed()
            .unwrap()
            .entries
            .iter()
            .flat_map(|e| &e.matches)
            .filter(|m| m.protocol == "tcp" && m.ports == "80-90")
            .map(|m| (m.rule_id, m.counter.packets))
            .collect::<BTreeMap<_, _>>()
            .values()
            .sum()
    };
    assert_eq!(rule_packets(&f), 2, "tracked packets count on their rule");
    assert_eq!(f.stat(PolicyStat::AllowedByRule), 2);

    // With the rules gone but the digest unchanged, the tracked flow still
    // passes (it is not judged again) while a new flow is denied.
    let digest = digest_of(&f, "10.0.0.1").expect("web is isolated");
    clear_lpm_entries(&f._pin);
    assert_eq!(f.ingress(&http), PASS, "tracked flow: one lookup");
    assert_eq!(
        f.ingress(&v4("192.168.1.1", "10.0.0.1", TCP, 40001, 80)),
        DROP,
        "new flow: judged by the (now empty) rules"
    );

    // The same policy again: same digest, the flow stays tracked.
    f.apply(&[WEB_POLICY]);
    assert_eq!(digest_of(&f, "10.0.0.1"), Some(digest.clone()));
    assert_eq!(f.ingress(&http), PASS);

    // Another policy for web: new digest, the tracked flow is judged again.
    let db_only = WEB_POLICY.replace("192.168.0.0/16", "203.0.113.0/24");
    f.apply(&[&db_only]);
    assert_ne!(digest_of(&f, "10.0.0.1"), Some(digest));
    assert_eq!(
        f.ingress(&http),
        DROP,
        "tracked flow denied by the new policy"
    );

    // A pod that becomes isolated: its flows tracked while it was open are
    // judged by its new policy.
    let to_other = v4("192.168.1.1", "10.0.0.3", TCP, 40000, 22);
    assert_eq!(f.ingress(&to_other), PASS, "other is not isolated");
    assert_eq!(f.ingress(&to_other), PASS, "tracked");
    assert_eq!(digest_of(&f, "10.0.0.3"), None);
    let isolate_other = r#"{
      "apiVersion": "k8s.cni.cncf.io/v1beta1", "kind": "MultiNetworkPolicy",
      "metadata": {"name": "other", "namespace": "a",
                   "annotations": {"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}},
      "spec": {"podSelector": {"matchLabels": {"app": "other"}}, "policyTypes": ["Ingress"]}
    }"#;
    f.apply(&[&db_only, isolate_other]);
    assert_eq!(f.ingress(&to_other), DROP, "other isolated: deny all");

    // The reply side is unaffected by policy changes: replies of a flow web
    // was allowed to start keep passing.
    let out = v4("10.0.0.1", "10.0.0.9", TCP, 40000, 5432);
    let reply = v4("10.0.0.9", "10.0.0.1", TCP, 5432, 40000);
    assert_eq!(f.egress(&out), PASS);
    f.apply(&[WEB_POLICY, isolate_other]);
    assert_eq!(f.ingress(&reply), PASS, "reply of a flow allowed earlier");
}

#[test]
fn test_run_kernel_logs_drops_with_their_reason() {
    if !privileged("test_run_kernel_logs_drops_with_their_reason") {
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _entered = rt.enter();
    let logs = support::with_kernel_log_capture(|| {
        let mut f = Fixture::logging(&[WEB_POLICY], true);
        let mut logs = f.datapath.kernel_logs().unwrap().expect("logging on");
        // Denied: TCP 22 from an allowed prefix. Allowed: TCP 80.
        let denied = v4("192.168.1.1", "10.0.0.1", TCP, 40000, 22);
        let allowed = v4("192.168.1.1", "10.0.0.1", TCP, 40000, 80);
        assert_eq!(f.ingress(&denied), DROP);
        assert_eq!(f.ingress(&allowed), PASS);
        logs.flush();
    });
    let lines: Vec<&str> = logs.lines().collect();
    assert_eq!(lines.len(), 1, "only the drop logs: {logs}");
    assert!(
        lines[0].contains("DEBUG")
            && lines[0].contains("flatnet_ebpf")
            && lines[0].contains(
                "dropped ingress ::ffff:192.168.1.1:40000 -> ::ffff:10.0.0.1:22 protocol 6: no_rule"
            ),
        "{logs}"
    );
}
