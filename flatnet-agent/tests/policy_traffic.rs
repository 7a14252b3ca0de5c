//! The policy programs on real traffic: two macvlan pods (bridge mode) on
//! one veth parent of a node namespace, and a LAN namespace on the other
//! end of the veth. TCP and UDP flows between them are allowed or dropped
//! by the installed MultiNetworkPolicy, and a policy update takes effect
//! without re-attaching anything.

mod support;

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream, UdpSocket},
    thread,
    time::Duration,
};

use flatnet_agent::{
    datapath::{Datapath, DatapathConfig, PolicyMaps, PolicyRuleIds},
    netns::run_in_netns,
    policy_compiler::MultiNetworkPolicy,
};
use flatnet_common::policy::PolicyStat;
use support::{
    TestNetns, TestPinRoot,
    policy::{app_pod, compile_cleanly},
    privileged, veth_pair,
};

const WEB: &str = "10.9.0.1";
const CLIENT: &str = "10.9.0.2";
const LAN: &str = "10.9.0.100";
/// How long a dropped connection attempt or datagram is waited for. Only
/// decides when to give up on a packet that never comes; nothing is
/// asserted about durations.
const GIVE_UP: Duration = Duration::from_millis(1500);

/// Ingress of web: TCP 8080 from app=client pods and UDP 5353 from the LAN
/// host (plus `extra_ingress`); egress of web: TCP 9000 to the LAN host.
fn web_policy(extra_ingress: &str) -> MultiNetworkPolicy {
    let json = format!(
        r#"{{
  "apiVersion": "k8s.cni.cncf.io/v1beta1", "kind": "MultiNetworkPolicy",
  "metadata": {{"name": "web", "namespace": "a",
               "annotations": {{"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}}}},
  "spec": {{
    "podSelector": {{"matchLabels": {{"app": "web"}}}},
    "policyTypes": ["Ingress", "Egress"],
    "ingress": [
      {{"from": [{{"podSelector": {{"matchLabels": {{"app": "client"}}}}}}], "ports": [{{"port": 8080}}]}},
      {{"from": [{{"ipBlock": {{"cidr": "{LAN}/32"}}}}], "ports": [{{"protocol": "UDP", "port": 5353}}]}}
      {extra_ingress}
    ],
    "egress": [
      {{"to": [{{"ipBlock": {{"cidr": "{LAN}/32"}}}}], "ports": [{{"port": 9000}}]}}
    ]
  }}
}}"#
    );
    serde_json::from_str(&json).expect("policy JSON")
}

struct Lab {
    lan: TestNetns,
    web: TestNetns,
    client: TestNetns,
    _node: TestNetns,
    datapath: Datapath,
    maps: PolicyMaps,
    ids: PolicyRuleIds,
    _pin: TestPinRoot,
}

impl Lab {
    fn new() -> Self {
        let node = TestNetns::new("flpn-");
        let lan = TestNetns::new("flpl-");
        let web = TestNetns::new("flpw-");
        let client = TestNetns::new("flpc-");
        for ns in [&node, &lan, &web, &client] {
            ns.sysctl("net.ipv6.conf.all.disable_ipv6", "1");
        }
        let parent = support::unique_name("par");
        let lan_if = support::unique_name("lan");
        veth_pair(&node, &parent, &lan, &lan_if);
        node.ip(&["link", "set", &parent, "up"]);
        lan.ip(&["addr", "add", &format!("{LAN}/24"), "dev", &lan_if]);
        lan.ip(&["link", "set", &lan_if, "up"]);
        for (pod, addr) in [(&web, WEB), (&client, CLIENT)] {
            let link = support::unique_name("mv");
            node.ip(&[
                "link", "add", &link, "link", &parent, "type", "macvlan", "mode", "bridge",
            ]);
            node.ip(&["link", "set", &link, "netns", &pod.name]);
            pod.ip(&["link", "set", &link, "name", "eth1"]);
            pod.ip(&["addr", "add", &format!("{addr}/24"), "dev", "eth1"]);
            pod.ip(&["link", "set", "eth1", "up"]);
        }

        let pin = TestPinRoot::new();
        let mut datapath =
            Datapath::load(&DatapathConfig::pinned_at(&pin.path)).expect("load eBPF object");
        for pod in [&web, &client] {
            run_in_netns(&pod.path(), || datapath.attach_policy("eth1"))
                .expect("enter pod netns")
                .expect("attach policy programs");
        }
        let maps = datapath.policy_maps().expect("open policy maps");
        Self {
            lan,
            web,
            client,
            _node: node,
            datapath,
            maps,
            ids: PolicyRuleIds::default(),
            _pin: pin,
        }
    }

    fn apply(&mut self, policies: &[MultiNetworkPolicy]) {
        let pods = [
            app_pod("web", "web", &[WEB], true),
            app_pod("client", "client", &[CLIENT], true),
        ];
        let compiled = compile_cleanly(policies, &pods);
        self.maps.apply(&compiled, &mut self.ids).expect("apply");
    }
}

/// A TCP server in `ns` on `port` that answers each connection's byte with
/// the same byte. Runs until the process ends.
fn tcp_server(ns: &TestNetns, addr: &str, port: u16) {
    let listener = run_in_netns(&ns.path(), || TcpListener::bind((addr, port)))
        .expect("enter netns")
        .expect("bind TCP server");
    thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            let mut byte = [0u8; 1];
            if stream.read_exact(&mut byte).is_ok() {
                let _ = stream.write_all(&byte);
            }
        }
    });
}

/// Whether a TCP exchange (connect, send a byte, get it back) from `ns`
/// to `addr:port` completes.
fn tcp_works(ns: &TestNetns, addr: &str, port: u16) -> bool {
    let target: SocketAddr = format!("{addr}:{port}").parse().unwrap();
    run_in_netns(&ns.path(), || {
        let Ok(mut stream) = TcpStream::connect_timeout(&target, GIVE_UP) else {
            return false;
        };
        stream.set_read_timeout(Some(GIVE_UP)).unwrap();
        let mut byte = [0u8; 1];
        stream.write_all(b"x").is_ok() && stream.read_exact(&mut byte).is_ok() && &byte == b"x"
    })
    .expect("enter netns")
}

/// Whether a UDP datagram from `from` reaches a socket bound in `to` on `addr:port`.
fn udp_arrives(from: &TestNetns, to: &TestNetns, addr: &str, port: u16) -> bool {
    let server = run_in_netns(&to.path(), || UdpSocket::bind((addr, port)))
        .expect("enter netns")
        .expect("bind UDP server");
    server.set_read_timeout(Some(GIVE_UP)).unwrap();
    run_in_netns(&from.path(), || {
        let client = UdpSocket::bind("0.0.0.0:0").expect("bind UDP client");
        client.send_to(b"ping", (addr, port)).expect("send");
    })
    .expect("enter netns");
    let mut buf = [0u8; 16];
    matches!(server.recv_from(&mut buf), Ok((4, _)))
}

#[test]
fn real_tcp_and_udp_flows_follow_the_policy_and_its_updates() {
    if !privileged("real_tcp_and_udp_flows_follow_the_policy_and_its_updates") {
        return;
    }
    let mut lab = Lab::new();
    tcp_server(&lab.web, WEB, 8080);
    tcp_server(&lab.web, WEB, 8081);
    tcp_server(&lab.lan, LAN, 9000);
    tcp_server(&lab.lan, LAN, 9001);

    // No policy yet: everything flows.
    assert!(tcp_works(&lab.lan, WEB, 8081));
    assert!(tcp_works(&lab.client, WEB, 8081));

    lab.apply(&[web_policy("")]);
    // Same-node pod to pod.
    assert!(
        tcp_works(&lab.client, WEB, 8080),
        "client -> web:8080 allowed"
    );
    assert!(
        !tcp_works(&lab.client, WEB, 8081),
        "client -> web:8081 denied"
    );
    assert!(
        !udp_arrives(&lab.client, &lab.web, WEB, 5353),
        "UDP from client denied"
    );
    // LAN to pod.
    assert!(!tcp_works(&lab.lan, WEB, 8080), "LAN -> web:8080 denied");
    assert!(
        udp_arrives(&lab.lan, &lab.web, WEB, 5353),
        "UDP 5353 from LAN allowed"
    );
    assert!(
        !udp_arrives(&lab.lan, &lab.web, WEB, 5354),
        "UDP 5354 from LAN denied"
    );
    // Pod to LAN: the egress rule, and replies through connection tracking
    // although web's ingress allows no TCP from the LAN host.
    assert!(
        tcp_works(&lab.web, LAN, 9000),
        "web -> LAN:9000 allowed, replies pass"
    );
    assert!(!tcp_works(&lab.web, LAN, 9001), "web -> LAN:9001 denied");
    // The client pod has no policy.
    assert!(tcp_works(&lab.client, LAN, 9001));

    let denied = lab.maps.stats().unwrap().get(PolicyStat::DeniedNoRule);
    assert!(denied > 0, "drops are counted");

    // Update: the LAN host may now reach TCP 8080 too. Maps only; the
    // programs stay attached as they are.
    let extra = format!(
        r#", {{"from": [{{"ipBlock": {{"cidr": "{LAN}/32"}}}}], "ports": [{{"port": 8080}}]}}"#
    );
    lab.apply(&[web_policy(&extra)]);
    assert!(
        tcp_works(&lab.lan, WEB, 8080),
        "LAN -> web:8080 allowed after the update"
    );
    assert!(
        !tcp_works(&lab.lan, WEB, 8081),
        "LAN -> web:8081 still denied"
    );

    // Policy removed: web is open again.
    lab.apply(&[]);
    assert!(tcp_works(&lab.lan, WEB, 8081));
    assert!(tcp_works(&lab.web, LAN, 9001));
    drop(lab.datapath);
}
