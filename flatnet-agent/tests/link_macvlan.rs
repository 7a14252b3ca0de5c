//! The attachment layer on the real kernel: macvlan pod interfaces on a
//! veth master, in fresh network namespaces (root only).

mod link_common;
mod support;

use std::net::{Ipv4Addr, Ipv6Addr};

use etherparse::{Icmpv6Type, NetSlice, SlicedPacket, TransportSlice};
use flatnet_agent::link::{
    ArpPolicy, DetachSpec, HostRoute, LinkError, LinkMode, MacvlanMode, PrimaryRoutes, RouteSpec,
    parse_mac,
};
use flatnet_agent::netns::HeldNetns;
use link_common::{Capture, LAN_V4, LAN_V6, Lan, has_link, ping};
use support::{TestNetns, privileged, veth_pair};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_macvlan_mode_attaches_checks_and_detaches() {
    if !privileged("every_macvlan_mode_attaches_checks_and_detaches") {
        return;
    }
    let lan = Lan::new();
    let attachments = lan.attachments();
    for (i, mode) in [
        MacvlanMode::Bridge,
        MacvlanMode::Vepa,
        MacvlanMode::Private,
        MacvlanMode::Passthru,
    ]
    .into_iter()
    .enumerate()
    {
        let pod = TestNetns::new("flp-");
        let mut spec = lan.spec(&pod, &[&format!("192.0.2.{}/24", 10 + i)]);
        spec.kind = LinkMode::Macvlan(mode);
        let attachment = attachments.attach(&spec).await.unwrap();
        assert_eq!(attachment.parent, lan.master);
        assert_eq!(attachment.sandbox, pod.path());
        assert_eq!(attachment.mtu, 1500, "inherited from the veth master");

        let details = pod.ip(&["-d", "link", "show", "dev", "eth1"]);
        assert!(
            details.contains(&format!("macvlan mode {mode}")),
            "{details}"
        );
        attachments.check(&spec).await.unwrap();
        ping(&pod, LAN_V4);

        let detach = DetachSpec::from(&spec);
        attachments.detach(&detach).await.unwrap();
        assert!(!has_link(&pod, "eth1"));
        // Idempotent: the link, and then the namespace, already gone.
        attachments.detach(&detach).await.unwrap();
        drop(pod);
        attachments.detach(&detach).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dual_stack_with_routes_mtu_and_fixed_mac() {
    if !privileged("dual_stack_with_routes_mtu_and_fixed_mac") {
        return;
    }
    let lan = Lan::new();
    let attachments = lan.attachments();
    let pod = TestNetns::new("flp-");
    let mut spec = lan.spec(&pod, &["192.0.2.20/24", "2001:db8::20/64"]);
    spec.mac = Some(parse_mac("02:00:5e:10:00:20").unwrap());
    spec.mtu = Some(1400);
    spec.routes = vec![
        RouteSpec {
            destination: "198.51.100.0/24".parse().unwrap(),
            via: Some("192.0.2.254".parse().unwrap()),
            dev: None,
            source: None,
            metric: Some(50),
        },
        RouteSpec {
            destination: "203.0.113.0/24".parse().unwrap(),
            via: None,
            dev: None,
            source: Some("192.0.2.20".parse().unwrap()),
            metric: None,
        },
        RouteSpec {
            destination: "2001:db8:1::/48".parse().unwrap(),
            via: Some("2001:db8::fe".parse().unwrap()),
            dev: None,
            source: None,
            metric: None,
        },
    ];
    let attachment = attachments.attach(&spec).await.unwrap();
    assert_eq!(attachment.mac, spec.mac.unwrap());
    assert_eq!(attachment.mtu, 1400);

    let link = pod.ip(&["link", "show", "dev", "eth1"]);
    assert!(
        link.contains("mtu 1400") && link.contains("02:00:5e:10:00:20"),
        "{link}"
    );
    let v4 = pod.ip(&["-4", "route", "show"]);
    assert!(
        v4.contains(&format!("default via {LAN_V4} dev eth1")),
        "{v4}"
    );
    assert!(
        v4.contains("198.51.100.0/24 via 192.0.2.254 dev eth1"),
        "{v4}"
    );
    assert!(v4.contains("metric 50"), "{v4}");
    assert!(
        v4.contains("203.0.113.0/24 dev eth1 proto static scope link src 192.0.2.20"),
        "{v4}"
    );
    let v6 = pod.ip(&["-6", "route", "show"]);
    assert!(
        v6.contains(&format!("default via {LAN_V6} dev eth1")),
        "{v6}"
    );
    assert!(
        v6.contains("2001:db8:1::/48 via 2001:db8::fe dev eth1"),
        "{v6}"
    );
    let addresses = pod.ip(&["addr", "show", "dev", "eth1"]);
    assert!(addresses.contains("inet 192.0.2.20/24"), "{addresses}");
    let global_v6 = addresses
        .lines()
        .find(|l| l.contains("inet6 2001:db8::20/64"))
        .unwrap_or_else(|| panic!("{addresses}"));
    assert!(
        global_v6.contains("nodad") && !global_v6.contains("tentative"),
        "usable at once: {global_v6}"
    );

    attachments.check(&spec).await.unwrap();
    ping(&pod, LAN_V4);
    ping(&pod, LAN_V6);

    // CHECK reports each difference.
    pod.ip(&["link", "set", "dev", "eth1", "mtu", "1300"]);
    pod.ip(&["route", "del", "198.51.100.0/24"]);
    let err = attachments.check(&spec).await.unwrap_err();
    let LinkError::Mismatch { differences, .. } = &err else {
        panic!("unexpected {err}")
    };
    assert_eq!(differences.len(), 2, "{err}");
    assert!(
        err.to_string().contains("MTU: expected 1400, found 1300"),
        "{err}"
    );
    assert!(
        err.to_string().contains("route 198.51.100.0/24 missing"),
        "{err}"
    );

    attachments.detach(&DetachSpec::from(&spec)).await.unwrap();
    assert!(!has_link(&pod, "eth1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_only_attachment() {
    if !privileged("ipv6_only_attachment") {
        return;
    }
    let lan = Lan::new();
    let attachments = lan.attachments();
    let pod = TestNetns::new("flp-");
    let spec = lan.spec(&pod, &["2001:db8::30/64"]);
    attachments.attach(&spec).await.unwrap();
    attachments.check(&spec).await.unwrap();
    ping(&pod, LAN_V6);
    let v4 = pod.ip(&["-4", "route", "show"]);
    assert!(v4.trim().is_empty(), "IPv4 untouched: {v4}");
    attachments.detach(&DetachSpec::from(&spec)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_master_is_named_and_nothing_is_left() {
    if !privileged("missing_master_is_named_and_nothing_is_left") {
        return;
    }
    let lan = Lan::new();
    let pod = TestNetns::new("flp-");
    let mut spec = lan.spec(&pod, &["192.0.2.40/24"]);
    spec.parent.master = "eth9".into();
    let err = lan.attachments().attach(&spec).await.unwrap_err();
    assert!(matches!(err, LinkError::MasterNotFound { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "master interface eth9 not found on this node; fix spec.master of subnet lan"
    );
    let links = pod.ip(&["-o", "link", "show"]);
    assert_eq!(links.lines().count(), 1, "only lo: {links}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn existing_interface_name_is_reported_and_kept() {
    if !privileged("existing_interface_name_is_reported_and_kept") {
        return;
    }
    let lan = Lan::new();
    let pod = TestNetns::new("flp-");
    pod.ip(&[
        "link", "add", "name", "eth1", "type", "veth", "peer", "name", "peer1",
    ]);
    let spec = lan.spec(&pod, &["192.0.2.41/24"]);
    let err = lan.attachments().attach(&spec).await.unwrap_err();
    assert!(matches!(err, LinkError::AlreadyExists { .. }), "{err}");
    assert_eq!(err.errno(), Some(libc::EEXIST));
    let details = pod.ip(&["-d", "link", "show", "dev", "eth1"]);
    assert!(
        details.contains("veth"),
        "the pod's own eth1 stays: {details}"
    );
}

/// Linux 6.1 checks a new link's name in the namespace the request comes
/// from too: a node with its own `eth1` must still give pods an `eth1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_interface_named_like_a_node_interface() {
    if !privileged("pod_interface_named_like_a_node_interface") {
        return;
    }
    let lan = Lan::new();
    lan.node.ip(&[
        "link",
        "add",
        "name",
        "eth1",
        "type",
        "veth",
        "peer",
        "name",
        "nodepeer1",
    ]);
    let pod = TestNetns::new("flp-");
    let spec = lan.spec(&pod, &["192.0.2.42/24"]);
    assert_eq!(spec.ifname, "eth1");
    let attachment = lan.attachments().attach(&spec).await.unwrap();
    assert_eq!(attachment.ifname, "eth1");
    ping(&pod, LAN_V4);
    let node_eth1 = lan.node.ip(&["-d", "link", "show", "dev", "eth1"]);
    assert!(
        node_eth1.contains("veth"),
        "the node's eth1 stays: {node_eth1}"
    );
    let pod_links = pod.ip(&["-o", "link", "show"]);
    assert!(
        !pod_links.contains("fnt"),
        "no temporary name is left in the pod: {pod_links}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mac_already_in_use_rolls_back() {
    if !privileged("mac_already_in_use_rolls_back") {
        return;
    }
    let lan = Lan::new();
    let attachments = lan.attachments();
    let mac = parse_mac("02:00:5e:10:00:42").unwrap();
    let first = TestNetns::new("flp-");
    let mut spec_first = lan.spec(&first, &["192.0.2.42/24"]);
    spec_first.mac = Some(mac);
    attachments.attach(&spec_first).await.unwrap();

    let second = TestNetns::new("flp-");
    let mut spec_second = lan.spec(&second, &["192.0.2.43/24"]);
    spec_second.mac = Some(mac);
    let err = attachments.attach(&spec_second).await.unwrap_err();
    assert_eq!(err.errno(), Some(libc::EADDRINUSE), "{err}");
    assert!(!has_link(&second, "eth1"), "rolled back");
    // The first pod is untouched.
    attachments.check(&spec_first).await.unwrap();
    ping(&first, LAN_V4);
}

/// A runtime deletes the pod's namespace path as soon as DEL answers, and
/// the interface is deleted after. Through the path alone nothing is found
/// then, and the interface, with its MAC, lives on for as long as the
/// namespace does (a process still in it, or until the kernel frees it):
/// the pod's next interface with that MAC is refused. Through the
/// namespace held from before, the interface goes and the MAC is free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_namespace_loses_its_interface_after_its_path_is_deleted() {
    if !privileged("a_held_namespace_loses_its_interface_after_its_path_is_deleted") {
        return;
    }
    let lan = Lan::new();
    let attachments = lan.attachments();
    let mac = parse_mac("02:00:5e:10:00:44").unwrap();
    let pod = TestNetns::new("flp-");
    let mut spec = lan.spec(&pod, &["192.0.2.44/24"]);
    spec.mac = Some(mac);
    attachments.attach(&spec).await.unwrap();
    let held = HeldNetns::open(&pod.path()).expect("the pod's namespace");
    drop(pod);

    attachments.detach(&DetachSpec::from(&spec)).await.unwrap();
    let next = TestNetns::new("flp-");
    let mut spec_next = lan.spec(&next, &["192.0.2.45/24"]);
    spec_next.mac = Some(mac);
    let err = attachments.attach(&spec_next).await.unwrap_err();
    assert_eq!(
        err.errno(),
        Some(libc::EADDRINUSE),
        "through the path, the interface lives on: {err}"
    );

    let mut holding = DetachSpec::from(&spec);
    holding.held_netns = Some(held);
    attachments.detach(&holding).await.unwrap();
    attachments.attach(&spec_next).await.unwrap();
    ping(&next, LAN_V4);
}

/// A pod with a primary interface (`eth0`, a veth to the node) as a CNI
/// like flannel would set it up.
fn with_primary(lan: &Lan, pod: &TestNetns) -> String {
    let node_end = support::unique_name("pv");
    veth_pair(pod, "eth0", &lan.node, &node_end);
    pod.ip(&["link", "set", "eth0", "up"]);
    pod.ip(&["addr", "add", "10.99.0.2/24", "dev", "eth0"]);
    pod.ip(&["route", "add", "default", "via", "10.99.0.1"]);
    lan.node.ip(&["link", "set", &node_end, "up"]);
    lan.node
        .ip(&["addr", "add", "10.99.0.1/24", "dev", &node_end]);
    node_end
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_route_moves_and_primary_and_host_routes_are_kept_in_step() {
    if !privileged("default_route_moves_and_primary_and_host_routes_are_kept_in_step") {
        return;
    }
    let lan = Lan::new();
    let attachments = lan.attachments();
    let pod = TestNetns::new("flp-");
    let node_end = with_primary(&lan, &pod);
    // A stale node route from an earlier pod must not fail the attach.
    lan.node.ip(&[
        "route",
        "add",
        "192.0.2.50/32",
        "dev",
        &node_end,
        "proto",
        "241",
    ]);

    let mut spec = lan.spec(&pod, &["192.0.2.50/24"]);
    spec.primary_routes = Some(PrimaryRoutes {
        ifname: "eth0".into(),
        destinations: vec!["10.96.0.0/12".parse().unwrap()],
        node_networks: false,
    });
    spec.host_route = Some(HostRoute {
        link: node_end.clone(),
        via: vec![],
    });
    attachments.attach(&spec).await.unwrap();

    let routes = pod.ip(&["-4", "route", "show"]);
    assert!(
        routes.contains(&format!("default via {LAN_V4} dev eth1")),
        "{routes}"
    );
    assert!(!routes.contains("default via 10.99.0.1"), "{routes}");
    assert!(
        routes.contains("10.96.0.0/12 via 10.99.0.1 dev eth0"),
        "{routes}"
    );
    let host = lan.node.ip(&["-4", "route", "show", "proto", "241"]);
    assert_eq!(host.trim(), format!("192.0.2.50 dev {node_end} scope link"));
    attachments.check(&spec).await.unwrap();
    // The node reaches the pod through the primary network.
    support::run(
        "ip",
        &[
            "netns",
            "exec",
            &lan.node.name,
            "ping",
            "-c",
            "1",
            "-W",
            "5",
            "192.0.2.50",
        ],
    );

    attachments.detach(&DetachSpec::from(&spec)).await.unwrap();
    let host = lan.node.ip(&["-4", "route", "show", "proto", "241"]);
    assert!(host.trim().is_empty(), "node route removed: {host}");
    attachments.detach(&DetachSpec::from(&spec)).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_after_routes_restores_the_pod_and_node() {
    if !privileged("failure_after_routes_restores_the_pod_and_node") {
        return;
    }
    let lan = Lan::new();
    let pod = TestNetns::new("flp-");
    with_primary(&lan, &pod);
    let routes_before = pod.ip(&["-4", "route", "show"]);

    let mut spec = lan.spec(&pod, &["192.0.2.51/24"]);
    spec.primary_routes = Some(PrimaryRoutes {
        ifname: "eth0".into(),
        destinations: vec!["10.96.0.0/12".parse().unwrap()],
        node_networks: false,
    });
    // The last step fails: the host link does not exist.
    spec.host_route = Some(HostRoute {
        link: "nosuchveth".into(),
        via: vec![],
    });
    let err = lan.attachments().attach(&spec).await.unwrap_err();
    assert!(err.to_string().contains("nosuchveth"), "{err}");
    assert!(!has_link(&pod, "eth1"), "pod link removed");
    assert_eq!(
        pod.ip(&["-4", "route", "show"]),
        routes_before,
        "default route restored, primary route removed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_route_gateway_rolls_back() {
    if !privileged("unreachable_route_gateway_rolls_back") {
        return;
    }
    let lan = Lan::new();
    let pod = TestNetns::new("flp-");
    let mut spec = lan.spec(&pod, &["192.0.2.52/24"]);
    spec.routes = vec![RouteSpec {
        destination: "198.51.100.0/24".parse().unwrap(),
        via: Some("203.0.113.1".parse().unwrap()),
        dev: None,
        source: None,
        metric: None,
    }];
    let err = lan.attachments().attach(&spec).await.unwrap_err();
    assert!(err.errno().is_some(), "kernel errno kept: {err}");
    assert!(err.to_string().contains("198.51.100.0/24"), "{err}");
    assert!(!has_link(&pod, "eth1"));
}

fn is_garp_from(frame: &[u8], mac: [u8; 6], ip: Ipv4Addr) -> bool {
    frame.len() >= 42
        && frame[0..6] == [0xff; 6]
        && frame[6..12] == mac
        && frame[12..14] == [0x08, 0x06]
        && frame[20..22] == [0, 1]
        && frame[22..28] == mac
        && frame[28..32] == ip.octets()
        && frame[38..42] == ip.octets()
}

fn is_unsolicited_na_from(frame: &[u8], mac: [u8; 6], ip: Ipv6Addr) -> bool {
    if frame.len() < 14 || frame[6..12] != mac {
        return false;
    }
    let Ok(packet) = SlicedPacket::from_ethernet(frame) else {
        return false;
    };
    let (Some(NetSlice::Ipv6(ipv6)), Some(TransportSlice::Icmpv6(icmp))) =
        (packet.net, packet.transport)
    else {
        return false;
    };
    let Icmpv6Type::NeighborAdvertisement(header) = icmp.icmp_type() else {
        return false;
    };
    let payload = icmp.payload();
    header.r#override
        && !header.solicited
        && ipv6.header().hop_limit() == 255
        && ipv6.header().source_addr() == ip
        && ipv6.header().destination_addr() == "ff02::1".parse::<Ipv6Addr>().unwrap()
        && payload.len() >= 24
        && payload[..16] == ip.octets()
        // Target link-layer address option carrying the pod's MAC.
        && payload[16..18] == [2, 1]
        && payload[18..24] == mac
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arping_policy_sends_garp_and_unsolicited_na_repeatedly() {
    if !privileged("arping_policy_sends_garp_and_unsolicited_na_repeatedly") {
        return;
    }
    let lan = Lan::new();
    let pod = TestNetns::new("flp-");
    let capture = Capture::open(&lan.lan, "lan0");
    let spec = lan.spec(&pod, &["192.0.2.60/24", "2001:db8::60/64"]);
    let attachment = lan.attachments().attach(&spec).await.unwrap();
    let (mac, v4, v6) = (
        attachment.mac,
        "192.0.2.60".parse().unwrap(),
        "2001:db8::60".parse().unwrap(),
    );
    let counts = move |frames: &[Vec<u8>]| {
        (
            frames.iter().filter(|f| is_garp_from(f, mac, v4)).count(),
            frames
                .iter()
                .filter(|f| is_unsolicited_na_from(f, mac, v6))
                .count(),
        )
    };
    // Two rounds are configured; wait for both.
    let frames = tokio::task::spawn_blocking(move || {
        capture.collect_until(|frames| {
            let (garp, na) = counts(frames);
            garp >= 2 && na >= 2
        })
    })
    .await
    .unwrap();
    let (garp, na) = counts(&frames);
    assert!(garp >= 2, "gratuitous ARP seen {garp} times");
    assert!(na >= 2, "unsolicited NA seen {na} times");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn arp_notify_policy_lets_the_kernel_announce() {
    if !privileged("arp_notify_policy_lets_the_kernel_announce") {
        return;
    }
    let lan = Lan::new();
    let pod = TestNetns::new("flp-");
    let capture = Capture::open(&lan.lan, "lan0");
    let mut spec = lan.spec(&pod, &["192.0.2.61/24"]);
    spec.arp_policy = ArpPolicy::ArpNotify;
    let attachment = lan.attachments().attach(&spec).await.unwrap();
    let sysctl = pod.exec("sysctl", &["-n", "net.ipv4.conf.eth1.arp_notify"]);
    assert_eq!(sysctl.trim(), "1");
    let mac = attachment.mac;
    let ip = "192.0.2.61".parse().unwrap();
    let frames = tokio::task::spawn_blocking(move || {
        capture.collect_until(|frames| frames.iter().any(|f| is_garp_from(f, mac, ip)))
    })
    .await
    .unwrap();
    assert!(
        frames.iter().any(|f| is_garp_from(f, mac, ip)),
        "kernel GARP seen"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pods_on_one_parent_reach_each_other_and_the_lan() {
    if !privileged("two_pods_on_one_parent_reach_each_other_and_the_lan") {
        return;
    }
    let lan = Lan::new();
    let attachments = lan.attachments();
    let a = TestNetns::new("flp-");
    let b = TestNetns::new("flp-");
    let spec_a = lan.spec(&a, &["192.0.2.70/24", "2001:db8::70/64"]);
    let spec_b = lan.spec(&b, &["192.0.2.71/24", "2001:db8::71/64"]);
    attachments.attach(&spec_a).await.unwrap();
    attachments.attach(&spec_b).await.unwrap();
    ping(&a, "192.0.2.71");
    ping(&b, "192.0.2.70");
    ping(&a, "2001:db8::71");
    ping(&a, LAN_V4);
    ping(&b, LAN_V6);
    attachments
        .detach(&DetachSpec::from(&spec_a))
        .await
        .unwrap();
    attachments
        .detach(&DetachSpec::from(&spec_b))
        .await
        .unwrap();
}

/// rancher-flat-network's `proxyARP` and `ipv6to4`: the pod answers ARP
/// for an address it routes through another interface (it forwards), and
/// the 6to4 address sits on the flat interface beside the subnet's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_arp_answers_for_routed_addresses_and_the_6to4_address_is_added() {
    if !privileged("proxy_arp_answers_for_routed_addresses_and_the_6to4_address_is_added") {
        return;
    }
    let lan = Lan::new();
    let attachments = lan.attachments();
    let plain_pod = TestNetns::new("flp-");
    let plain = lan.spec(&plain_pod, &["192.0.2.70/24"]);
    attachments.attach(&plain).await.unwrap();
    let sysctl = |pod: &TestNetns| pod.exec("sysctl", &["-n", "net.ipv4.conf.eth1.proxy_arp"]);
    assert_eq!(sysctl(&plain_pod).trim(), "0", "off unless asked");

    let pod = TestNetns::new("flp-");
    // A network behind the pod, on another interface; the pod forwards.
    // (A veth pair: this kernel may lack the dummy driver.)
    pod.ip(&[
        "link", "add", "inner0", "type", "veth", "peer", "name", "inner1",
    ]);
    pod.ip(&["addr", "add", "198.51.100.1/24", "dev", "inner0"]);
    pod.ip(&["link", "set", "inner0", "up"]);
    pod.ip(&["link", "set", "inner1", "up"]);
    pod.exec("sysctl", &["-w", "net.ipv4.ip_forward=1"]);
    let mut spec = lan.spec(&pod, &["192.0.2.71/24"]);
    spec.proxy_arp = true;
    spec.extra_addresses = vec!["2002:c000:247::/40".parse().unwrap()];
    let attachment = attachments.attach(&spec).await.unwrap();
    assert_eq!(sysctl(&pod).trim(), "1");
    let v6 = pod.ip(&["-6", "addr", "show", "dev", "eth1"]);
    assert!(v6.contains("2002:c000:247::/40"), "{v6}");

    // The LAN host resolves an address of the network behind the pod: the
    // pod's flat interface answers with its own MAC.
    lan.lan
        .ip(&["route", "add", "198.51.100.0/24", "dev", "lan0"]);
    lan.lan
        .try_exec("ping", &["-c", "1", "-W", "1", "198.51.100.7"]);
    let neighbour = lan
        .lan
        .ip(&["-4", "neigh", "show", "198.51.100.7", "dev", "lan0"]);
    let mac = attachment.mac.map(|b| format!("{b:02x}")).join(":");
    assert!(
        neighbour.contains(&format!("lladdr {mac}")),
        "the pod ({mac}) answered for 198.51.100.7: {neighbour:?}"
    );
    attachments.detach(&DetachSpec::from(&spec)).await.unwrap();
    attachments.detach(&DetachSpec::from(&plain)).await.unwrap();
}
