//! MAC pool and MAC conflicts end to end in Kubernetes mode, on the real
//! kernel (root): the operator's in-memory API server (served over HTTP in
//! this process) with the allocation controllers and a MAC pool, the real
//! `flatnet-agent run` in Kubernetes mode and the real `flatnet-cni`, on a
//! simulated LAN. The pod's interface carries the MAC its FlatNetworkIP
//! got from the pool; a LAN host sending frames with that MAC is reported
//! on the record (Warning Event, condition) and in the agent's metrics,
//! while the pod's own traffic is not, nor, on a VEPA subnet, the pod's own
//! frames a switch reflects back to the node, nor, on a Linux bridge
//! master, what the node's pods and interfaces say to each other.

mod support;

use std::net::{IpAddr, Ipv4Addr};

use flatnet_k8s::{
    api::{
        CONDITION_MAC_CONFLICT, FlatNetworkIP, FlatNetworkIPStatus, FlatNetworkSubnet,
        FlatNetworkWireClaims,
    },
    ipam::{
        Mac, MacRange,
        foreign_macs::{foreign_macs, inside},
    },
};
use flatnet_operator::allocation::{fake_api::FakeApiServer, mac_pool::ActivePool};
use k8s_openapi::api::{core::v1::Pod, events::v1::Event};
use kube::ResourceExt;
use serde_json::json;
use support::{
    TestNetns,
    agent::{
        FlatPodCluster, StandaloneAgent, assert_agent_authorized, free_local_address, http_get,
        macvlan_subnet, serve_with_allocation,
    },
    cni::{IFNAME, run_cni},
    lan::{SimulatedLan, send_arp_requests, send_neighbour_advertisements},
    ping, privileged, wait_until,
};

const NODE: &str = "node-1";
/// `run_cni` names the pod of container `c1` `default/pod-c1`.
const POD: &str = "pod-c1";
const POD_ADDRESS: &str = "192.0.2.10";
/// An address of the subnet no pod holds, which the rogue host claims.
const ROGUE_ADDRESS: &str = "192.0.2.77";
const POOL_START: &str = "02:aa:00:00:00:01";
const POOL_END: &str = "02:aa:00:00:00:ff";

/// The API server with the allocation controllers, the LAN, the node and
/// its agent.
struct Cluster {
    /// First field: the agent stops before the namespaces go.
    agent: StandaloneAgent,
    server: FakeApiServer,
    /// Runs the API server and the operator's controllers.
    _runtime: tokio::runtime::Runtime,
    /// The agent's `/metrics` address.
    admin: String,
    node: TestNetns,
    lan: TestNetns,
    master: String,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Stops the agent; fails naming any request of it the chart's RBAC
    /// refused during the test.
    fn stop(&mut self) {
        self.agent.stop();
        assert_agent_authorized(&self.server);
    }

    /// The cluster with the pod's subnet in macvlan `mode`; a
    /// `dual_stack` pod also gets an address of the IPv6 subnet `lan6`.
    fn running_for_test(test: &str, mode: &str, dual_stack: bool) -> Option<Self> {
        Self::running(test, dual_stack, || {
            FlatPodCluster::new("mc", mode, NODE, POD)
        })
    }

    /// The cluster `make` sets up (once the test is known to run).
    fn running(
        test: &str,
        dual_stack: bool,
        make: impl FnOnce() -> FlatPodCluster,
    ) -> Option<Self> {
        if !privileged(test) {
            return None;
        }
        let FlatPodCluster {
            node,
            lan,
            master,
            dir,
            runtime,
            server,
        } = make();
        if dual_stack {
            server.insert(&macvlan_subnet(
                "lan6",
                (&master, "bridge"),
                "2001:db8:5::/64",
                ("2001:db8:5::10", "2001:db8:5::20"),
            ));
            let mut pod = server
                .list::<Pod>()
                .into_iter()
                .find(|p| p.name_any() == POD)
                .expect("the pod");
            pod.annotations_mut()
                .insert("flatnetwork.pandaria.io/subnet".into(), "lan4,lan6".into());
            server.insert(&pod);
        }
        let pool = ActivePool {
            range: MacRange::parse(POOL_START, POOL_END).unwrap(),
            mode: flatnet_k8s::api::MacPoolMode::OptOut,
        };
        let kubeconfig = dir.path().join("kubeconfig");
        serve_with_allocation(&runtime, &server, Some(pool), &kubeconfig);
        let admin = free_local_address();
        let cni_bin_dir = dir.path().join("bin").display().to_string();
        let agent = StandaloneAgent::new(
            dir.path(),
            &node,
            &[
                "--cni-bin-dir",
                &cni_bin_dir,
                "--conflict-probe-ms",
                "0",
                "--admin-address",
                &admin,
                "--floating-ip",
                "false",
            ],
        )
        .in_kubernetes(&kubeconfig, NODE);
        let mut this = Self {
            agent,
            server,
            _runtime: runtime,
            admin,
            node,
            lan,
            master,
            _dir: dir,
        };
        this.agent.start_until_status("flat4", None);
        Some(this)
    }

    /// The runtime's `command` (ADD, DEL) for the pod in `netns`; it must succeed.
    fn cni(&self, command: &str, netns: &TestNetns) {
        self.cni_for(command, "c1", netns);
    }

    /// The runtime's `command` for container `container` (pod
    /// `pod-<container>`) in `netns`; it must succeed.
    fn cni_for(&self, command: &str, container: &str, netns: &TestNetns) {
        let (ok, out) = run_cni(
            &self.agent.socket(),
            command,
            "flat4",
            container,
            Some(&netns.path()),
            json!({}),
        );
        assert!(ok, "the runtime's {command} of {container}: {out}");
    }

    /// The status of the pod's record `name`.
    fn status_of(&self, name: &str) -> FlatNetworkIPStatus {
        self.server
            .list::<FlatNetworkIP>()
            .into_iter()
            .find(|r| r.name_any() == name)
            .and_then(|r| r.status)
            .unwrap_or_default()
    }

    /// The status of the pod's (first) record.
    fn status(&self) -> FlatNetworkIPStatus {
        self.status_of(POD)
    }

    /// The notes of the `MACConflict` Events on the pod's (first) record.
    fn conflict_events(&self) -> Vec<String> {
        self.conflict_events_on(POD)
    }

    /// The notes of the `MACConflict` Events on the pod's record `record`.
    fn conflict_events_on(&self, record: &str) -> Vec<String> {
        self.server
            .list::<Event>()
            .into_iter()
            .filter(|e| {
                e.reason.as_deref() == Some("MACConflict")
                    && e.type_.as_deref() == Some("Warning")
                    && e.regarding.as_ref().is_some_and(|r| {
                        r.kind.as_deref() == Some("FlatNetworkIP")
                            && r.name.as_deref() == Some(record)
                            && r.namespace.as_deref() == Some("default")
                    })
            })
            .filter_map(|e| e.note)
            .collect()
    }

    /// The agent's count of MAC conflicts of `reason`.
    fn conflicts_counted(&self, reason: &str) -> u64 {
        let text = http_get(&self.admin, "/metrics");
        let prefix = format!("flatnet_agent_mac_conflicts_total{{reason=\"{reason}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map_or(0, |n| n.trim().parse().unwrap())
    }

    /// Sends three gratuitous ARPs from the LAN host with `mac`, claiming `addr`.
    fn rogue_announces(&self, mac: [u8; 6], addr: &str) {
        let addr: Ipv4Addr = addr.parse().unwrap();
        send_arp_requests(&self.lan, "lan0", mac, addr, addr);
    }
}

fn interface_mac(pod: &TestNetns) -> String {
    let out = pod.ip(&["-o", "link", "show", "dev", IFNAME]);
    let after = out.split("link/ether ").nth(1).expect("an Ethernet link");
    after.split_whitespace().next().unwrap().to_owned()
}

#[test]
fn a_pod_gets_its_pool_mac_and_a_lan_host_using_that_mac_is_reported() {
    let Some(mut cluster) = Cluster::running_for_test(
        "a_pod_gets_its_pool_mac_and_a_lan_host_using_that_mac_is_reported",
        "bridge",
        false,
    ) else {
        return;
    };
    wait_until("the pod's address and pool MAC allocated", || {
        let status = cluster.status();
        status.addr.is_some() && status.mac_from_pool
    });
    let status = cluster.status();
    let range = MacRange::parse(POOL_START, POOL_END).unwrap();
    let pool_mac: Mac = status.mac.parse().unwrap();
    assert!(range.contains(pool_mac), "{} is from the pool", status.mac);
    assert_eq!(status.addr, Some(POD_ADDRESS.parse::<IpAddr>().unwrap()));

    let pod = TestNetns::new("mcp-");
    cluster.cni("ADD", &pod);
    assert_eq!(
        interface_mac(&pod),
        status.mac,
        "the interface carries the record's pool MAC"
    );
    wait_until("the record Active with its MAC", || {
        let now = cluster.status();
        now.phase == "Active" && now.mac == status.mac && now.node == NODE
    });
    // The pod's own traffic: the LAN resolves it and it answers, from
    // the pool MAC, through the uplink.
    ping(&cluster.lan, POD_ADDRESS);
    let mac = pool_mac.0;

    // A LAN host announces another address with the pod's MAC.
    cluster.rogue_announces(mac, ROGUE_ADDRESS);
    wait_until("a MACConflict Event on the record", || {
        !cluster.conflict_events().is_empty()
    });
    let notes = cluster.conflict_events();
    assert_eq!(notes.len(), 1, "{notes:?}");
    for part in [
        status.mac.as_str(),
        ROGUE_ADDRESS,
        "gratuitous_arp",
        &format!("node {NODE}"),
        &format!("interface {}", cluster.master),
        "none of its FlatNetworkIPs holds",
    ] {
        assert!(notes[0].contains(part), "{part} missing in {}", notes[0]);
    }
    // The Event is written before the condition: wait for the second write.
    let mut condition = None;
    wait_until("the MACConflict condition", || {
        condition = cluster
            .status()
            .conditions
            .into_iter()
            .find(|c| c.type_ == CONDITION_MAC_CONFLICT);
        condition.is_some()
    });
    let condition = condition.expect("the MACConflict condition");
    assert_eq!(
        (condition.status.as_str(), condition.reason.as_str()),
        ("True", "MACConflict")
    );
    assert!(condition.message.contains(ROGUE_ADDRESS), "{condition:?}");
    wait_until("the sighting counted", || {
        cluster.conflicts_counted("other_address") >= 1
    });
    // The pod's own frames left through the uplink and were never taken
    // for a conflict (scanned before the rogue's, or with them).
    assert_eq!(cluster.conflicts_counted("pod_on_this_node"), 0);

    // A clone of the pod (its MAC and its address) on the LAN, while the
    // pod runs on this node.
    cluster.rogue_announces(mac, POD_ADDRESS);
    wait_until("the clone reported", || {
        cluster
            .conflict_events()
            .iter()
            .any(|n| n.contains(&format!("claiming {POD_ADDRESS} ")))
    });
    assert!(cluster.conflicts_counted("pod_on_this_node") >= 1);
    let notes = cluster.conflict_events();
    assert!(
        notes
            .iter()
            .any(|n| n.contains("arriving from the LAN on the node its pod is attached to")),
        "{notes:?}"
    );
    // Repeated frames within the report interval: counted, no more Events.
    let counted = cluster.conflicts_counted("other_address");
    cluster.rogue_announces(mac, ROGUE_ADDRESS);
    wait_until("the repeat counted", || {
        cluster.conflicts_counted("other_address") > counted
    });
    assert_eq!(cluster.conflict_events().len(), 2, "one Event per claim");

    cluster.cni("DEL", &pod);
    cluster.stop();
}

/// How many frames the LAN host reflected (its `lan0` ingress filter).
fn reflected(lan: &TestNetns) -> u64 {
    let stats = lan.exec("tc", &["-s", "filter", "show", "dev", "lan0", "ingress"]);
    stats
        .split("Sent ")
        .skip(1)
        .filter_map(|rest| rest.split_whitespace().nth(2)?.parse().ok())
        .max()
        .unwrap_or(0)
}

#[test]
fn a_vepa_switch_reflecting_the_pods_own_frames_is_no_conflict_but_a_rogue_still_is() {
    let Some(mut cluster) = Cluster::running_for_test(
        "a_vepa_switch_reflecting_the_pods_own_frames_is_no_conflict_but_a_rogue_still_is",
        "vepa",
        false,
    ) else {
        return;
    };
    // The LAN side acts as a VEPA switch: every frame from the node goes
    // back to it (hairpin), the pod's ARP among them.
    cluster
        .lan
        .exec("tc", &["qdisc", "add", "dev", "lan0", "clsact"]);
    cluster.lan.exec(
        "tc",
        &[
            "filter", "add", "dev", "lan0", "ingress", "u32", "match", "u32", "0", "0", "action",
            "mirred", "egress", "mirror", "dev", "lan0",
        ],
    );
    wait_until("the pod's address and pool MAC allocated", || {
        let status = cluster.status();
        status.addr.is_some() && status.mac_from_pool
    });
    let status = cluster.status();
    let pod = TestNetns::new("mcv-");
    cluster.cni("ADD", &pod);
    wait_until("the record Active", || cluster.status().phase == "Active");
    // The pod resolves the LAN host: its ARP request (its MAC, its address)
    // comes back in through the uplink.
    // (Whether the echo is answered is not the point here.)
    pod.try_exec("ping", &["-c", "1", "-W", "2", "192.0.2.1"]);
    wait_until("the pod's frames reflected", || reflected(&cluster.lan) > 0);

    // A rogue host with the pod's MAC claiming another address, sent
    // after the reflections: once it is counted, the scan has seen both.
    let mac: Mac = status.mac.parse().unwrap();
    cluster.rogue_announces(mac.0, ROGUE_ADDRESS);
    wait_until("the rogue counted", || {
        cluster.conflicts_counted("other_address") >= 1
    });
    assert_eq!(
        cluster.conflicts_counted("pod_on_this_node"),
        0,
        "the pod's own reflected frames are no conflict on a VEPA subnet"
    );
    let notes = cluster.conflict_events();
    assert!(
        notes.iter().all(|n| n.contains(ROGUE_ADDRESS)),
        "only the rogue is reported: {notes:?}"
    );
    // The reflection of the pod's own request is in the inventory while
    // the pod lives, and goes with it: it must not outlive the pod as a
    // foreign host's claim on its address.
    let pod_address: IpAddr = POD_ADDRESS.parse().unwrap();
    let own_claim = |cluster: &Cluster| {
        inventory(cluster)
            .iter()
            .any(|c| c.addr == pod_address && c.mac == mac.0)
    };
    assert!(own_claim(&cluster), "{:?}", inventory(&cluster));
    cluster.cni("DEL", &pod);
    assert!(!own_claim(&cluster), "{:?}", inventory(&cluster));
    cluster.stop();
}

/// The agent's wire inventory, read from its pinned map.
fn inventory(cluster: &Cluster) -> Vec<flatnet_agent::datapath::WireClaimEntry> {
    flatnet_agent::datapath::PinnedMaps::open(&cluster.agent.pin.path)
        .and_then(|maps| maps.wire_claims())
        .expect("the inventory")
}

#[test]
fn a_dual_stack_pods_mac_claiming_another_ipv6_address_is_reported_on_its_ipv6_record() {
    let Some(mut cluster) = Cluster::running_for_test(
        "a_dual_stack_pods_mac_claiming_another_ipv6_address_is_reported_on_its_ipv6_record",
        "bridge",
        true,
    ) else {
        return;
    };
    let six = format!("{POD}.ipv6");
    wait_until("both records allocated, the pool MAC on the first", || {
        cluster.status().mac_from_pool && cluster.status_of(&six).addr.is_some()
    });
    let status = cluster.status();
    let pod_v6 = cluster.status_of(&six).addr.expect("allocated");
    let pod = TestNetns::new("mcd-");
    cluster.cni("ADD", &pod);
    assert_eq!(interface_mac(&pod), status.mac, "one interface, one MAC");
    let ipv6 = pod.ip(&["-6", "-o", "addr", "show", "dev", IFNAME]);
    assert!(ipv6.contains(&pod_v6.to_string()), "{ipv6}");
    wait_until("both records Active", || {
        cluster.status().phase == "Active" && cluster.status_of(&six).phase == "Active"
    });
    let mac: Mac = status.mac.parse().unwrap();

    // A LAN host advertises another IPv6 address with the pod's MAC.
    let rogue: std::net::Ipv6Addr = "2001:db8:5::77".parse().unwrap();
    send_neighbour_advertisements(&cluster.lan, "lan0", mac.0, rogue);
    wait_until("a MACConflict Event on the IPv6 record", || {
        !cluster.conflict_events_on(&six).is_empty()
    });
    let notes = cluster.conflict_events_on(&six);
    for part in [
        status.mac.as_str(),
        "2001:db8:5::77",
        &format!("node {NODE}"),
    ] {
        assert!(notes[0].contains(part), "{part} missing in {notes:?}");
    }
    // The IPv4 record holds no IPv6 address: nothing reported on it. Its
    // own IPv6 address advertised from its MAC (the pod's DAD and
    // announcements) is no conflict either.
    assert!(
        cluster.conflict_events().is_empty(),
        "{:?}",
        cluster.conflict_events()
    );
    assert_eq!(cluster.conflicts_counted("pod_on_this_node"), 0);
    cluster.cni("DEL", &pod);
    cluster.stop();
}

/// The second pod of [`frames_between_the_nodes_own_interfaces_are_nobody_elses`].
const POD_B: &str = "pod-c2";
/// A LAN host's MAC, outside the pool.
const ROGUE_MAC: [u8; 6] = [0x02, 0xbb, 0, 0, 0, 0x77];
/// The address of the node's own macvlan on the master.
const NODE_SHIM_ADDRESS: &str = "192.0.2.6";

/// The agent's report of `lan4`, if written.
fn wire_report(cluster: &Cluster) -> Option<FlatNetworkWireClaims> {
    cluster
        .server
        .list::<FlatNetworkWireClaims>()
        .into_iter()
        .find(|r| r.name_any() == format!("lan4.{NODE}"))
}

/// Whether `report` lists `ip` claimed by `mac`.
fn lists(report: &FlatNetworkWireClaims, ip: IpAddr, mac: &str) -> bool {
    report
        .spec
        .claims
        .iter()
        .any(|c| c.ip == ip && c.mac == mac)
}

/// `status.wireExcludedCount` of `lan4`.
fn wire_excluded(cluster: &Cluster) -> i64 {
    cluster
        .server
        .list::<FlatNetworkSubnet>()
        .into_iter()
        .find(|s| s.name_any() == "lan4")
        .and_then(|s| s.status)
        .map_or(0, |s| s.wire_excluded_count)
}

/// Two pods on one node, a Linux bridge as their master, and a macvlan of
/// the node itself on that bridge: what they say to each other crosses
/// the bridge's ingress (a macvlan hands a frame for a sibling to its
/// lower device's receive path first) without ever being on the wire. It
/// is no MAC conflict, no foreign claim in the inventory or in the node's
/// report while the pods live or after they are gone, and it neither
/// holds their addresses out of the pool nor puts their MACs among those
/// `MacRangeShared` blames; LAN hosts using a pod's MAC or address still
/// are reported.
#[test]
fn frames_between_the_nodes_own_interfaces_are_nobody_elses() {
    let Some(mut cluster) = Cluster::running(
        "frames_between_the_nodes_own_interfaces_are_nobody_elses",
        false,
        || {
            let lan = SimulatedLan::bridged("mb", &["192.0.2.1/24"]);
            FlatPodCluster::on_lan(lan, "bridge", NODE, POD)
        },
    ) else {
        return;
    };
    let mut second = cluster
        .server
        .list::<Pod>()
        .into_iter()
        .find(|p| p.name_any() == POD)
        .expect("the first pod");
    second.metadata.name = Some(POD_B.into());
    second.metadata.uid = None;
    second.metadata.resource_version = None;
    cluster.server.insert(&second);
    // The node's own macvlan on the master, with an address of the subnet.
    let master = cluster.master.clone();
    cluster.node.ip(&[
        "link", "add", "shim0", "link", &master, "type", "macvlan", "mode", "bridge",
    ]);
    cluster
        .node
        .add_address("shim0", &format!("{NODE_SHIM_ADDRESS}/24"));
    cluster.node.ip(&["link", "set", "shim0", "up"]);

    wait_until("both records allocated with pool MACs", || {
        [POD, POD_B].iter().all(|name| {
            let status = cluster.status_of(name);
            status.addr.is_some() && status.mac_from_pool
        })
    });
    let pod_a = TestNetns::new("mba-");
    let pod_b = TestNetns::new("mbb-");
    cluster.cni_for("ADD", "c1", &pod_a);
    cluster.cni_for("ADD", "c2", &pod_b);
    wait_until("both records Active", || {
        [POD, POD_B]
            .iter()
            .all(|name| cluster.status_of(name).phase == "Active")
    });
    let (a, b) = (cluster.status_of(POD), cluster.status_of(POD_B));
    let (a_ip, b_ip) = (a.addr.expect("allocated"), b.addr.expect("allocated"));
    let a_mac: Mac = a.mac.parse().unwrap();
    let shim_mac = {
        let out = cluster.node.ip(&["-o", "link", "show", "dev", "shim0"]);
        let after = out.split("link/ether ").nth(1).expect("an Ethernet link");
        after.split_whitespace().next().unwrap().to_owned()
    };

    // Each answers the other's ARP request (and its own neighbour
    // discovery) with a unicast reply through the bridge's ingress, and
    // so does the node's macvlan.
    ping(&pod_a, &b_ip.to_string());
    for ns in [&pod_a, &pod_b] {
        ns.ip(&["neigh", "flush", "all"]);
    }
    ping(&pod_b, &a_ip.to_string());
    pod_a.ip(&["neigh", "flush", "all"]);
    ping(&pod_a, NODE_SHIM_ADDRESS);

    // LAN hosts: one with the first pod's MAC claiming another address,
    // one with another MAC claiming the first pod's address.
    cluster.rogue_announces(a_mac.0, ROGUE_ADDRESS);
    let IpAddr::V4(a_v4) = a_ip else {
        panic!("an IPv4 address")
    };
    send_arp_requests(&cluster.lan, "lan0", ROGUE_MAC, a_v4, a_v4);
    wait_until("the rogue counted", || {
        cluster.conflicts_counted("other_address") >= 1
    });
    assert_eq!(
        cluster.conflicts_counted("pod_on_this_node"),
        0,
        "the pods' frames to each other are no clone on the LAN"
    );
    // Counted before its Event is written.
    wait_until("the rogue reported", || {
        !cluster.conflict_events().is_empty()
    });
    let notes = cluster.conflict_events();
    assert!(
        notes.iter().all(|n| n.contains(ROGUE_ADDRESS)),
        "only the rogue is reported: {notes:?}"
    );
    assert!(
        cluster.conflict_events_on(POD_B).is_empty(),
        "{:?}",
        cluster.conflict_events_on(POD_B)
    );

    // The inventory: the rogues, nothing said between the node's own interfaces.
    let own: Vec<String> = vec![a.mac.clone(), b.mac.clone(), shim_mac.clone()];
    let claims = inventory(&cluster);
    let rogue_mac = flatnet_agent::datapath::format_mac(ROGUE_MAC);
    let seen = |ip: IpAddr, mac: &str| {
        claims
            .iter()
            .any(|c| c.addr == ip && flatnet_agent::datapath::format_mac(c.mac) == mac)
    };
    assert!(seen(a_ip, &rogue_mac), "{claims:?}");
    assert!(seen(ROGUE_ADDRESS.parse().unwrap(), &a.mac), "{claims:?}");
    let between_own: Vec<_> = claims
        .iter()
        .filter(|c| own.contains(&flatnet_agent::datapath::format_mac(c.mac)))
        .filter(|c| c.addr != ROGUE_ADDRESS.parse::<IpAddr>().unwrap())
        .collect();
    assert!(
        between_own.is_empty(),
        "claims by the node's own interfaces: {between_own:?}"
    );

    // The pods go; their records with them.
    cluster.cni_for("DEL", "c1", &pod_a);
    cluster.cni_for("DEL", "c2", &pod_b);
    // The fake API server has no garbage collector: the records go as
    // their owner's would.
    for name in [POD, POD_B] {
        cluster.server.delete::<Pod>("default", name);
        cluster.server.delete::<FlatNetworkIP>("default", name);
    }
    // Once the first pod's record is gone its MAC is nobody's in the
    // cluster, so the rogue using it shows in the node's report.
    let rogue_address: IpAddr = ROGUE_ADDRESS.parse().unwrap();
    wait_until("a report written after the records went", || {
        wire_report(&cluster).is_some_and(|r| lists(&r, rogue_address, &a.mac))
    });
    let report = wire_report(&cluster).expect("written");
    assert!(lists(&report, a_ip, &rogue_mac), "{report:?}");
    let own_claims: Vec<_> = report
        .spec
        .claims
        .iter()
        .filter(|c| c.ip != rogue_address)
        .filter(|c| own.contains(&c.mac) || c.ip == b_ip || c.ip.to_string() == NODE_SHIM_ADDRESS)
        .collect();
    assert!(
        own_claims.is_empty(),
        "the node's own frames reported as another host's: {own_claims:?}"
    );
    // Only the address the LAN host took is held out of the pool.
    wait_until("the subnet reading the report", || {
        wire_excluded(&cluster) >= 1
    });
    assert_eq!(wire_excluded(&cluster), 1, "{report:?}");
    // MacRangeShared's view of the reports: the rogue's pool MAC only.
    let reports = cluster.server.list::<FlatNetworkWireClaims>();
    let foreign = foreign_macs(
        reports.iter(),
        k8s_openapi::jiff::Timestamp::now(),
        std::time::Duration::from_secs(3600),
    );
    let range = MacRange::parse(POOL_START, POOL_END).unwrap();
    let in_range: Vec<String> = inside(&range, &foreign)
        .into_iter()
        .map(|c| c.mac)
        .collect();
    assert_eq!(in_range, vec![a.mac.clone()]);
    cluster.stop();
}
