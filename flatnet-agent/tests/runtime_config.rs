//! Runtime network configuration of running pods, end to end: the real
//! `flatnet-cni` and `flatnet-agent run --standalone` on a simulated LAN
//! (see `agent_standalone.rs`); what changes in the state file reaches pods
//! that are already running, without restarting them.

mod support;

use std::{
    io::{Read, Write},
    net::{TcpListener, TcpStream},
    time::Duration,
};

use flatnet_agent::netns::run_in_netns;
use serde_json::{Value, json};
use support::{
    TestNetns,
    agent::StandaloneAgent,
    cni::{IFNAME, run_cni},
    has_link,
    lan::AgentOnLan,
    ping, privileged,
    tc_hooks::{CLAMP_PROGRAMS, primary_programs},
    veth_pair, wait_until,
};

const LAN_V4: &str = "192.0.2.1";

/// The LAN, the node, and the agent with its directories.
struct Node {
    /// First field: the agent stops before the namespaces go.
    agent: StandaloneAgent,
    node: TestNetns,
    lan: TestNetns,
    master: String,
    _dir: tempfile::TempDir,
}

impl Node {
    /// The node for `test` with its agent running and subnet `lan4` at
    /// `mtu`, or `None` (the skip printed) without the privileges needed.
    fn running_for_test(test: &str, mtu: u32) -> Option<Self> {
        if !privileged(test) {
            return None;
        }
        let AgentOnLan {
            agent,
            node,
            lan,
            master,
            dir,
        } = AgentOnLan::new(
            "rc",
            &[&format!("{LAN_V4}/24")],
            &["--conflict-probe-ms", "0"],
        );
        let mut this = Self {
            agent,
            node,
            lan,
            master,
            _dir: dir,
        };
        this.write_state(mtu);
        this.start(None);
        Some(this)
    }

    /// Starts the agent (with `crash_at`, to abort at that test crash
    /// point) and waits until it answers STATUS.
    fn start(&mut self, crash_at: Option<&str>) {
        self.agent.start_until_status("flat4", crash_at);
    }

    /// The state file with subnet `lan4` at `mtu`.
    fn write_state(&self, mtu: u32) {
        self.write_state_with(mtu, "");
    }

    /// The state file with subnet `lan4` at `mtu` and `hotplug` (YAML of
    /// the section's entries, empty for none). Network `flat4` is on
    /// `lan4` (192.0.2.10-20), `extra` on `lan4b` (192.0.2.30-40).
    fn write_state_with(&self, mtu: u32, hotplug: &str) {
        self.write_state_full(mtu, hotplug, "");
    }

    /// [`Self::write_state_with`] with `extra` (top-level YAML sections)
    /// appended.
    fn write_state_full(&self, mtu: u32, hotplug: &str, extra: &str) {
        self.agent.write_state(&format!(
            r"
subnets:
  - name: lan4
    spec:
      flatMode: macvlan
      master: {master}
      cidr: 192.0.2.0/24
      ranges: [{{from: 192.0.2.10, to: 192.0.2.20}}]
      mtu: {mtu}
  - name: lan4b
    spec:
      flatMode: macvlan
      master: {master}
      cidr: 192.0.2.0/24
      ranges: [{{from: 192.0.2.30, to: 192.0.2.40}}]
networks:
  - {{name: flat4, subnets: [lan4]}}
  - {{name: extra, subnets: [lan4b]}}
hotplug: [{hotplug}]
{extra}
",
            master = self.master
        ));
    }

    fn cni(&self, command: &str, container: &str, pod: &TestNetns) -> (bool, Value) {
        run_cni(
            &self.agent.socket(),
            command,
            "flat4",
            container,
            Some(&pod.path()),
            json!({}),
        )
    }
}

/// MTU and index of the pod's flat interface.
fn link_of(pod: &TestNetns) -> (u32, u32) {
    let out: Value = serde_json::from_str(&pod.ip(&["-j", "link", "show", "dev", IFNAME])).unwrap();
    let link = &out[0];
    (
        u32::try_from(link["mtu"].as_u64().unwrap()).unwrap(),
        u32::try_from(link["ifindex"].as_u64().unwrap()).unwrap(),
    )
}

/// Whether an IPv4 ping of `mtu` bytes with Don't Fragment set gets
/// through from `from` to `target`.
fn df_ping_to(from: &TestNetns, target: &str, mtu: u32) -> bool {
    // 20 bytes of IPv4 header, 8 of ICMP.
    let payload = (mtu - 28).to_string();
    from.try_exec(
        "ping",
        &["-M", "do", "-s", &payload, "-c", "1", "-W", "2", target],
    )
}

fn assert_carries(pod: &TestNetns, mtu: u32, context: &str) {
    assert_carries_to(pod, LAN_V4, mtu, context);
}

fn assert_carries_to(from: &TestNetns, target: &str, mtu: u32, context: &str) {
    assert!(
        df_ping_to(from, target, mtu),
        "{context}: {mtu} bytes with DF must pass"
    );
    assert!(
        !df_ping_to(from, target, mtu + 1),
        "{context}: {} bytes with DF must not pass",
        mtu + 1
    );
}

#[test]
fn a_subnet_mtu_change_reaches_the_running_pod() {
    let Some(mut node) =
        Node::running_for_test("a_subnet_mtu_change_reaches_the_running_pod", 1400)
    else {
        return;
    };
    let pod = TestNetns::new("rcp-");
    let (ok, out) = node.cni("ADD", "c1", &pod);
    assert!(ok, "ADD: {out}");
    let (mtu, index) = link_of(&pod);
    assert_eq!(mtu, 1400, "the subnet's MTU at ADD");
    assert_carries(&pod, 1400, "at ADD");

    node.write_state(1300);
    wait_until("the pod's MTU follows the subnet", || {
        link_of(&pod).0 == 1300
    });
    assert_eq!(
        link_of(&pod).1,
        index,
        "the same interface, changed in place"
    );
    assert_carries(&pod, 1300, "after lowering");

    // Above the master's 1500: refused with a clear error, the pod keeps
    // its MTU, and a new pod is refused with a configuration error.
    node.write_state(9000);
    let log = node.agent.log_file();
    wait_until("the agent reports the MTU it cannot set", || {
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("MTU 9000 of subnet lan4 is larger than the MTU 1500")
    });
    assert_eq!(link_of(&pod), (1300, index));
    let other = TestNetns::new("rcp-");
    let (ok, out) = node.cni("ADD", "c2", &other);
    assert!(!ok, "{out}");
    assert_eq!(out["code"], 7, "invalid network configuration: {out}");
    assert!(
        out["msg"]
            .as_str()
            .unwrap()
            .contains("lower the subnet's MTU or raise the parent's"),
        "{out}"
    );

    // A restart does not undo what is in force, and raising it again works.
    node.write_state(1500);
    wait_until("raised again", || link_of(&pod).0 == 1500);
    node.agent.stop();
    node.start(None);
    assert_eq!(link_of(&pod), (1500, index));
    assert_carries(&pod, 1500, "after raising");
    let (ok, out) = node.cni("DEL", "c1", &pod);
    assert!(ok, "DEL: {out}");
    node.agent.stop();
}

#[test]
fn an_agent_killed_while_changing_an_mtu_converges_after_restart() {
    let Some(mut node) = Node::running_for_test(
        "an_agent_killed_while_changing_an_mtu_converges_after_restart",
        1400,
    ) else {
        return;
    };
    let pod = TestNetns::new("rcp-");
    let (ok, out) = node.cni("ADD", "c1", &pod);
    assert!(ok, "ADD: {out}");
    node.agent.stop();
    // Dies right after the MTU is set, before the record says so.
    node.start(Some("mtu-set"));
    node.write_state(1280);
    let status = node.agent.wait_for_exit();
    assert!(!status.success(), "the agent died at the crash point");
    assert_eq!(link_of(&pod).0, 1280, "set before the crash");
    let record_dir = node.agent.path("records");
    let recorded = |mtu: u32| {
        let records = flatnet_agent::records::Records::read(&record_dir).unwrap();
        assert_eq!(records.len(), 1);
        records[0].subnets[0].spec.mtu == Some(mtu)
    };
    assert!(!recorded(1280), "the record still has the old MTU");

    node.start(None);
    wait_until("the record catches up", || recorded(1280));
    assert_carries(&pod, 1280, "after the restart");
    let (ok, out) = node.cni("DEL", "c1", &pod);
    assert!(ok, "DEL: {out}");
    node.agent.stop();
}

/// A hot-plug entry giving `pod` interface `net1` on network `extra`.
fn extra_net1(pod: &TestNetns) -> String {
    format!(
        "{{name: web-extra, netns: {}, pod: shop/web, attachments: [{{network: extra, ifname: net1}}]}}",
        pod.path().display()
    )
}

#[test]
fn an_extra_interface_is_hot_plugged_reachable_and_removed_again() {
    let Some(mut node) = Node::running_for_test(
        "an_extra_interface_is_hot_plugged_reachable_and_removed_again",
        1500,
    ) else {
        return;
    };
    let pod = TestNetns::new("rcp-");
    let (ok, out) = node.cni("ADD", "c1", &pod);
    assert!(ok, "the runtime's ADD: {out}");
    let eth1 = link_of(&pod);

    node.write_state_with(1500, &extra_net1(&pod));
    wait_until("net1 hot-plugged", || has_link(&pod, "net1"));
    ping(&node.lan, "192.0.2.30");
    assert_eq!(node.agent.records(), 2, "recorded like the runtime's");
    assert_eq!(link_of(&pod), eth1, "the runtime's interface untouched");

    // The runtime's GC of that network never lists hot-plugged interfaces.
    let (ok, out) = run_cni(
        &node.agent.socket(),
        "GC",
        "extra",
        "",
        None,
        json!({"cni.dev/valid-attachments": []}),
    );
    assert!(ok, "GC: {out}");
    assert!(has_link(&pod, "net1"), "GC left the hot-plugged interface");

    node.write_state(1500);
    wait_until("net1 removed", || !has_link(&pod, "net1"));
    wait_until("its record removed", || node.agent.records() == 1);
    let allocated = node.agent.allocations().to_string();
    assert!(!allocated.contains("192.0.2.30"), "{allocated}");
    assert_eq!(link_of(&pod), eth1);

    // An interface of that name made by hand is never touched.
    pod.ip(&[
        "link", "add", "net1", "type", "veth", "peer", "name", "net1p",
    ]);
    node.write_state_with(1500, &extra_net1(&pod));
    let log = node.agent.log_file();
    wait_until("the refusal is logged", || {
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("interface net1 already exists")
    });
    node.write_state(1500);
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert!(has_link(&pod, "net1"), "the hand-made interface stays");
    assert_eq!(node.agent.records(), 1);
    let (ok, out) = node.cni("DEL", "c1", &pod);
    assert!(ok, "DEL: {out}");
    node.agent.stop();
}

/// A hot-plugged interface takes the MTU of the network configuration
/// the pod's own flat interface was attached by (the
/// NetworkAttachmentDefinition's `mtu`), where its subnet sets none.
#[test]
fn a_hot_plugged_interface_takes_the_mtu_of_the_pods_network_configuration() {
    let Some(mut node) = Node::running_for_test(
        "a_hot_plugged_interface_takes_the_mtu_of_the_pods_network_configuration",
        1500,
    ) else {
        return;
    };
    let pod = TestNetns::new("rcm-");
    // Subnet lan4's own mtu (1500) wins for the runtime's interface.
    let (ok, out) = run_cni(
        &node.agent.socket(),
        "ADD",
        "flat4",
        "c1",
        Some(&pod.path()),
        json!({"mtu": 1400}),
    );
    assert!(ok, "the runtime's ADD: {out}");
    assert_eq!(mtu_of(&pod, IFNAME), 1500);

    // `run_cni` names the pod default/pod-c1; lan4b sets no mtu.
    node.write_state_with(
        1500,
        &format!(
            "{{name: c1-extra, netns: {}, pod: default/pod-c1, attachments: [{{network: extra, ifname: net1}}]}}",
            pod.path().display()
        ),
    );
    wait_until("net1 hot-plugged", || has_link(&pod, "net1"));
    assert_eq!(
        mtu_of(&pod, "net1"),
        1400,
        "the pod's network configuration's"
    );

    node.write_state(1500);
    wait_until("net1 removed", || !has_link(&pod, "net1"));
    let (ok, out) = node.cni("DEL", "c1", &pod);
    assert!(ok, "DEL: {out}");
    node.agent.stop();
}

/// ipvlan and VLAN interfaces are hot-plugged and removed like macvlan
/// ones: an ipvlan L2 interface on a second master (one interface cannot
/// carry both kinds) and a macvlan on VLAN 200 of the first (the VLAN made
/// for it, and removed with it), each reached by the LAN host (the VLAN's
/// over tagged frames).
#[test]
fn ipvlan_and_vlan_interfaces_are_hot_plugged_reachable_and_removed() {
    const TEST: &str = "ipvlan_and_vlan_interfaces_are_hot_plugged_reachable_and_removed";
    if !privileged(TEST)
        || !vlans_supported(TEST)
        || !kernel_has(
            TEST,
            "ipvlan",
            &["link", "v0", "name", "ipv0", "type", "ipvlan"],
        )
    {
        return;
    }
    let Some(mut node) = Node::running_for_test(TEST, 1500) else {
        return;
    };
    let pod = TestNetns::new("rch-");
    let vlan = format!("{}.200", node.master);
    let ipvlan_master = format!("{}i", node.master);
    veth_pair(&node.node, &ipvlan_master, &node.lan, "lan1");
    node.node.ip(&["link", "set", &ipvlan_master, "up"]);
    node.lan.ip(&["link", "set", "lan1", "up"]);
    node.lan.add_address("lan1", "198.51.100.1/24");
    let state = |hotplug: &str| {
        format!(
            r"
subnets:
  - name: lan4
    spec: {{flatMode: macvlan, master: {master}, cidr: 192.0.2.0/24, ranges: [{{from: 192.0.2.10, to: 192.0.2.20}}]}}
  - name: lan4i
    spec: {{flatMode: ipvlan, mode: l2, master: {master}i, cidr: 198.51.100.0/24, ranges: [{{from: 198.51.100.50, to: 198.51.100.60}}]}}
  - name: lan4v
    spec: {{flatMode: macvlan, master: {master}, vlan: 200, cidr: 10.200.0.0/24, ranges: [{{from: 10.200.0.10, to: 10.200.0.20}}]}}
networks:
  - {{name: flat4, subnets: [lan4]}}
  - {{name: ipv, subnets: [lan4i]}}
  - {{name: tagged, subnets: [lan4v]}}
hotplug: [{hotplug}]
",
            master = node.master
        )
    };
    node.agent.write_state(&state(&format!(
        "{{name: both, netns: {}, pod: shop/web, attachments: [{{network: ipv, ifname: net1}}, {{network: tagged, ifname: net2}}]}}",
        pod.path().display()
    )));
    wait_until("net1 and net2 hot-plugged", || {
        has_link(&pod, "net1") && has_link(&pod, "net2")
    });
    let net1 = link_details(&pod, "net1").unwrap();
    assert_eq!(net1["linkinfo"]["info_kind"], "ipvlan", "{net1}");
    let net2 = link_details(&pod, "net2").unwrap();
    assert_eq!(net2["linkinfo"]["info_kind"], "macvlan", "{net2}");
    let made = link_details(&node.node, &vlan).expect("the VLAN made for net2");
    assert_eq!(made["linkinfo"]["info_data"]["id"], 200);
    ping(&node.lan, "198.51.100.50");
    node.lan.ip(&[
        "link", "add", "link", "lan0", "name", "lan0.200", "type", "vlan", "id", "200",
    ]);
    node.lan.add_address("lan0.200", "10.200.0.1/24");
    node.lan.ip(&["link", "set", "lan0.200", "up"]);
    ping(&node.lan, "10.200.0.10");
    assert_eq!(node.agent.records(), 2);

    node.agent.write_state(&state(""));
    wait_until("both removed, and the VLAN made for them", || {
        !has_link(&pod, "net1") && !has_link(&pod, "net2") && !has_link(&node.node, &vlan)
    });
    wait_until("their records removed", || node.agent.records() == 0);
    node.agent.stop();
}

#[test]
fn an_agent_killed_while_hot_plugging_converges_after_restart() {
    let Some(mut node) = Node::running_for_test(
        "an_agent_killed_while_hot_plugging_converges_after_restart",
        1500,
    ) else {
        return;
    };
    let pod = TestNetns::new("rcp-");
    node.agent.stop();
    // Dies once the interface exists, before its record is ready.
    node.start(Some("add-attached"));
    node.write_state_with(1500, &extra_net1(&pod));
    let status = node.agent.wait_for_exit();
    assert!(!status.success(), "the agent died at the crash point");

    node.start(None);
    wait_until("hot-plugged after the restart", || {
        has_link(&pod, "net1") && node.agent.records() == 1
    });
    ping(&node.lan, "192.0.2.30");
    node.write_state(1500);
    wait_until("removed", || {
        !has_link(&pod, "net1") && node.agent.records() == 0
    });
    node.agent.stop();
}

/// The node's address on the veth to a pod's primary interface.
const NODE_VETH_V4: &str = "10.99.0.1";
/// The node's end of that veth.
const NODE_VETH: &str = "rcveth0";

/// A running pod whose `eth0` is a veth to the node (as a cluster
/// network makes it), both ends at MTU 1500 and addressed.
fn pod_with_primary_veth(node: &Node) -> TestNetns {
    let pod = TestNetns::new("rcp-");
    veth_pair(&node.node, NODE_VETH, &pod, "eth0");
    node.node
        .add_address(NODE_VETH, &format!("{NODE_VETH_V4}/30"));
    pod.add_address("eth0", "10.99.0.2/30");
    node.node.ip(&["link", "set", NODE_VETH, "up"]);
    pod.ip(&["link", "set", "eth0", "up"]);
    pod
}

/// MTU of `ifname` in `ns`.
fn mtu_of(ns: &TestNetns, ifname: &str) -> u32 {
    let out: Value = serde_json::from_str(&ns.ip(&["-j", "link", "show", "dev", ifname])).unwrap();
    u32::try_from(out[0]["mtu"].as_u64().unwrap()).unwrap()
}

/// MTUs of the pod's `eth0` and of the node's end of its veth.
fn primary_mtus(node: &Node, pod: &TestNetns) -> (u32, u32) {
    (mtu_of(pod, "eth0"), mtu_of(&node.node, NODE_VETH))
}

/// A hot-plug entry asking `pod`'s primary interface for `mtu`.
fn primary_entry(pod: &TestNetns, mtu: u32) -> String {
    format!(
        "{{name: web-primary, netns: {}, pod: shop/web, primary: {{mtu: {mtu}}}}}",
        pod.path().display()
    )
}

/// What the agent remembers of the pods' primary interfaces.
fn ledger(node: &Node) -> flatnet_agent::cni_service::Ledger {
    flatnet_agent::cni_service::read_ledger(
        &node
            .agent
            .path("leases")
            .join(flatnet_agent::cni_service::LEDGER_FILE),
    )
    .unwrap()
}

#[test]
fn a_primary_mtu_is_set_on_the_running_pod_and_its_peer_and_set_back() {
    let Some(mut node) = Node::running_for_test(
        "a_primary_mtu_is_set_on_the_running_pod_and_its_peer_and_set_back",
        1500,
    ) else {
        return;
    };
    let pod = pod_with_primary_veth(&node);
    let index = pod.ip(&["-j", "link", "show", "dev", "eth0"]);
    assert_carries_to(&pod, NODE_VETH_V4, 1500, "before");

    node.write_state_with(1500, &primary_entry(&pod, 1400));
    wait_until("eth0 and its peer at 1400", || {
        primary_mtus(&node, &pod) == (1400, 1400)
    });
    assert_carries_to(&pod, NODE_VETH_V4, 1400, "lowered");
    assert_carries_to(&node.node, "10.99.0.2", 1400, "lowered, from the node");
    let remembered = &ledger(&node)["web-primary"];
    assert_eq!(remembered.original.mtu, 1500, "{remembered:?}");
    assert_eq!(
        remembered
            .original
            .peer
            .as_ref()
            .map(|p| (p.name.as_str(), p.mtu)),
        Some((NODE_VETH, 1500))
    );

    // A restarted agent keeps what is in force and still knows the
    // original: the entry removed while it was down is set back.
    node.agent.stop();
    node.write_state(1500);
    node.start(None);
    // Set back first, then forgotten (a crash in between sets it back
    // again): wait for both.
    wait_until("set back to 1500 after the restart and forgotten", || {
        primary_mtus(&node, &pod) == (1500, 1500) && ledger(&node).is_empty()
    });
    assert_carries_to(&pod, NODE_VETH_V4, 1500, "set back");
    let same = pod.ip(&["-j", "link", "show", "dev", "eth0"]);
    assert_eq!(
        serde_json::from_str::<Value>(&same).unwrap()[0]["ifindex"],
        serde_json::from_str::<Value>(&index).unwrap()[0]["ifindex"],
        "the same interface throughout"
    );

    // A pod without eth0 is reported with the reason and nothing is
    // remembered for it.
    let bare = TestNetns::new("rcp-");
    node.write_state_with(1500, &primary_entry(&bare, 1400));
    let log = node.agent.log_file();
    wait_until("the failure is logged", || {
        let log = std::fs::read_to_string(&log).unwrap();
        log.contains("primary MTU of pod shop/web") && log.contains("eth0")
    });
    assert!(ledger(&node).is_empty());
    assert_eq!(primary_mtus(&node, &pod), (1500, 1500));
    node.agent.stop();
}

#[test]
fn an_agent_killed_while_setting_a_primary_mtu_converges_after_restart() {
    let Some(mut node) = Node::running_for_test(
        "an_agent_killed_while_setting_a_primary_mtu_converges_after_restart",
        1500,
    ) else {
        return;
    };
    let pod = pod_with_primary_veth(&node);
    node.agent.stop();
    // Dies once the pod's end is set, before its peer is.
    node.start(Some("primary-mtu-pod-set"));
    node.write_state_with(1500, &primary_entry(&pod, 1300));
    let status = node.agent.wait_for_exit();
    assert!(!status.success(), "the agent died at the crash point");
    assert_eq!(primary_mtus(&node, &pod), (1300, 1500), "half done");

    node.start(None);
    wait_until("both ends at 1300 after the restart", || {
        primary_mtus(&node, &pod) == (1300, 1300)
    });
    assert_carries_to(&pod, NODE_VETH_V4, 1300, "after the restart");
    // The original was remembered before the crash.
    node.write_state(1500);
    wait_until("set back to the original", || {
        primary_mtus(&node, &pod) == (1500, 1500)
    });
    node.agent.stop();
}

/// `ip -d -j link show dev <ifname>` in `ns`, `None` when there is none.
fn link_details(ns: &TestNetns, ifname: &str) -> Option<Value> {
    if !has_link(ns, ifname) {
        return None;
    }
    let out: Value =
        serde_json::from_str(&ns.ip(&["-d", "-j", "link", "show", "dev", ifname])).unwrap();
    Some(out[0].clone())
}

/// The bridge (or bond) `ifname` is a port of.
fn master_of(ns: &TestNetns, ifname: &str) -> Option<String> {
    link_details(ns, ifname)?["master"]
        .as_str()
        .map(str::to_owned)
}

/// Whether the kernel makes 802.1Q VLAN interfaces (tried in a scratch
/// namespace); prints the skip, or fails under
/// `FLATNET_REQUIRE_KERNEL_FEATURES`, when it does not.
fn vlans_supported(test: &str) -> bool {
    kernel_has(
        test,
        "802.1Q VLAN",
        &["link", "v0", "name", "v0.9", "type", "vlan", "id", "9"],
    )
}

/// Whether the kernel makes a link of `kind_args` (after `ip link add`) on
/// a scratch veth `v0`; else the skip reported.
fn kernel_has(test: &str, feature: &str, kind_args: &[&str]) -> bool {
    let scratch = TestNetns::new("rcv-");
    scratch.ip(&["link", "add", "v0", "type", "veth", "peer", "name", "v1"]);
    let made = std::process::Command::new("ip")
        .args(["-n", &scratch.name, "link", "add"])
        .args(kind_args)
        .output()
        .unwrap();
    if made.status.success() {
        return true;
    }
    let stderr = String::from_utf8_lossy(&made.stderr);
    assert!(stderr.contains("Unknown device type"), "{stderr}");
    support::skip_for_missing_kernel_feature(test, feature);
    false
}

#[test]
fn node_bridges_are_made_and_only_what_flatnet_made_is_removed() {
    let Some(mut node) = Node::running_for_test(
        "node_bridges_are_made_and_only_what_flatnet_made_is_removed",
        1500,
    ) else {
        return;
    };
    // The node's own: a port and a bridge made by hand.
    node.node.ip(&[
        "link", "add", "rcport0", "type", "veth", "peer", "name", "rcport0p",
    ]);
    node.node.ip(&["link", "add", "rcbrhand", "type", "bridge"]);
    let asked = "bridges:
  - {name: rcbr0, ports: [rcport0]}
  - {name: rcbrhand, ports: []}";
    node.write_state_full(1500, "", asked);
    wait_until("the bridge made with its port", || {
        master_of(&node.node, "rcport0").as_deref() == Some("rcbr0")
    });
    let bridge = link_details(&node.node, "rcbr0").unwrap();
    assert_eq!(bridge["linkinfo"]["info_kind"], "bridge");
    assert_eq!(bridge["ifalias"], "flatnet:node-config");
    assert!(
        bridge["flags"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f == "UP"),
        "{bridge}"
    );
    assert!(link_details(&node.node, "rcbrhand").unwrap()["ifalias"].is_null());

    // A port that does not exist is reported with the node named.
    node.write_state_full(1500, "", &asked.replace("[rcport0]", "[rcport0, nope0]"));
    let log = node.agent.log_file();
    wait_until("the missing port reported", || {
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("port nope0 of bridge rcbr0 does not exist on node")
    });
    assert_eq!(master_of(&node.node, "rcport0").as_deref(), Some("rcbr0"));

    // Nothing asked: flatnet's bridge goes, the node's own stay.
    node.write_state(1500);
    wait_until("flatnet's bridge removed", || {
        !has_link(&node.node, "rcbr0")
    });
    assert!(has_link(&node.node, "rcport0"), "the hand-made port stays");
    assert_eq!(master_of(&node.node, "rcport0"), None);
    assert!(
        has_link(&node.node, "rcbrhand"),
        "the hand-made bridge stays"
    );

    // A port put into a bridge the node had is taken out again, the
    // bridge left; restarts in between change nothing.
    node.write_state_full(1500, "", "bridges: [{name: rcbrhand, ports: [rcport0]}]");
    wait_until("the port in the node's bridge", || {
        master_of(&node.node, "rcport0").as_deref() == Some("rcbrhand")
    });
    node.agent.stop();
    node.write_state(1500);
    node.start(None);
    wait_until("the port out again after the restart", || {
        master_of(&node.node, "rcport0").is_none()
    });
    assert!(has_link(&node.node, "rcbrhand"));
    node.agent.stop();
}

#[test]
fn node_vlans_are_made_carry_tagged_traffic_and_only_flatnets_are_removed() {
    const TEST: &str = "node_vlans_are_made_carry_tagged_traffic_and_only_flatnets_are_removed";
    if !privileged(TEST) || !vlans_supported(TEST) {
        return;
    }
    let Some(mut node) = Node::running_for_test(TEST, 1500) else {
        return;
    };
    let vlan = format!("{}.200", node.master);
    let hand_vlan = format!("{}.201", node.master);
    node.node.ip(&[
        "link",
        "add",
        "link",
        &node.master,
        "name",
        &hand_vlan,
        "type",
        "vlan",
        "id",
        "201",
    ]);
    let asked = format!(
        "vlans: [{{master: {m}, id: 200}}, {{master: {m}, id: 201}}]
bridges: [{{name: rcbr0, ports: [{vlan}]}}]",
        m = node.master
    );
    node.write_state_full(1500, "", &asked);
    wait_until("the VLAN made, a port of the bridge", || {
        master_of(&node.node, &vlan).as_deref() == Some("rcbr0")
    });
    let made = link_details(&node.node, &vlan).unwrap();
    assert_eq!(made["linkinfo"]["info_kind"], "vlan");
    assert_eq!(made["linkinfo"]["info_data"]["id"], 200);
    assert_eq!(made["link"], node.master.as_str());
    assert_eq!(made["ifalias"], "flatnet:node-config");
    assert!(link_details(&node.node, &hand_vlan).unwrap()["ifalias"].is_null());

    // Tagged traffic crosses the bridge and the VLAN to the LAN host.
    node.lan.ip(&[
        "link", "add", "link", "lan0", "name", "lan0.200", "type", "vlan", "id", "200",
    ]);
    node.lan.add_address("lan0.200", "10.200.0.1/24");
    node.lan.ip(&["link", "set", "lan0.200", "up"]);
    node.node.add_address("rcbr0", "10.200.0.2/24");
    ping(&node.node, "10.200.0.1");

    // A master that does not exist is reported with the node named.
    node.write_state_full(
        1500,
        "",
        &asked.replace("id: 201}]", "id: 201}, {master: nope0, id: 300}]"),
    );
    let log = node.agent.log_file();
    wait_until("the missing master reported", || {
        std::fs::read_to_string(&log)
            .unwrap()
            .contains("master nope0 of VLAN nope0.300 does not exist on node")
    });

    // Nothing asked: flatnet's go, the hand-made VLAN stays.
    node.write_state(1500);
    wait_until("flatnet's VLAN and bridge removed", || {
        !has_link(&node.node, &vlan) && !has_link(&node.node, "rcbr0")
    });
    assert!(has_link(&node.node, &hand_vlan), "the hand-made VLAN stays");
    node.agent.stop();
}

/// The state file with network `flat4v` on VLAN 200 of the master (and
/// `flat4`, whose STATUS tells the agent is up) and, with `asked`, the
/// node configuration asking for that VLAN.
fn write_vlan_state(node: &Node, asked: bool) {
    // The bridge shows when a pass has run: VLANs come before bridges.
    let vlans = if asked {
        format!(
            "vlans: [{{master: {}, id: 200}}]\nbridges: [{{name: rcbrv, ports: []}}]",
            node.master
        )
    } else {
        String::new()
    };
    node.agent.write_state(&format!(
        r"
subnets:
  - name: lan4
    spec:
      flatMode: macvlan
      master: {master}
      cidr: 192.0.2.0/24
      ranges: [{{from: 192.0.2.10, to: 192.0.2.20}}]
  - name: lan4v
    spec:
      flatMode: macvlan
      master: {master}
      vlan: 200
      cidr: 192.0.2.0/24
      ranges: [{{from: 192.0.2.30, to: 192.0.2.40}}]
networks:
  - {{name: flat4, subnets: [lan4]}}
  - {{name: flat4v, subnets: [lan4v]}}
{vlans}
",
        master = node.master
    ));
}

#[test]
fn a_vlan_the_node_config_asks_for_outlives_the_last_pod_on_it() {
    const TEST: &str = "a_vlan_the_node_config_asks_for_outlives_the_last_pod_on_it";
    if !privileged(TEST) || !vlans_supported(TEST) {
        return;
    }
    let Some(mut node) = Node::running_for_test(TEST, 1500) else {
        return;
    };
    let vlan = format!("{}.200", node.master);
    node.agent.stop();
    write_vlan_state(&node, false);
    node.start(None);
    // A pod's attachment makes the VLAN.
    let pod = TestNetns::new("rcp-");
    let (ok, out) = run_cni(
        &node.agent.socket(),
        "ADD",
        "flat4v",
        "ctr-v",
        Some(&pod.path()),
        json!({}),
    );
    assert!(ok, "{out}");
    assert_eq!(
        link_details(&node.node, &vlan).expect("made by the ADD")["ifalias"],
        "flatnet:vlan"
    );
    // The node configuration asks for it too: it holds it from now on.
    write_vlan_state(&node, true);
    let node_lease = node.agent.path("leases").join(&vlan).join("node-config");
    wait_until("the node configuration applied", || {
        has_link(&node.node, "rcbrv")
    });
    // The last pod on it leaves: the VLAN stays, as asked.
    let (ok, out) = run_cni(
        &node.agent.socket(),
        "DEL",
        "flat4v",
        "ctr-v",
        Some(&pod.path()),
        json!({}),
    );
    assert!(ok, "{out}");
    assert!(
        has_link(&node.node, &vlan),
        "still asked for by the node configuration"
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert!(has_link(&node.node, &vlan), "and not removed later either");
    assert!(
        node_lease.exists(),
        "held by the node configuration's lease"
    );

    // No longer asked for, and no pod on it: it goes.
    write_vlan_state(&node, false);
    wait_until("the VLAN removed once nothing holds it", || {
        !has_link(&node.node, &vlan) && !has_link(&node.node, "rcbrv")
    });
    assert!(!node_lease.exists());
    node.agent.stop();
}

#[test]
fn an_agent_killed_while_making_a_node_interface_converges_after_restart() {
    let Some(mut node) = Node::running_for_test(
        "an_agent_killed_while_making_a_node_interface_converges_after_restart",
        1500,
    ) else {
        return;
    };
    let asked = "bridges: [{name: rcbr0, ports: []}]";
    node.agent.stop();
    // Dies once the bridge exists, before it is marked as flatnet's.
    node.start(Some("node-link-created"));
    node.write_state_full(1500, "", asked);
    let status = node.agent.wait_for_exit();
    assert!(!status.success(), "the agent died at the crash point");
    let half = link_details(&node.node, "rcbr0").expect("created before the crash");
    assert!(half["ifalias"].is_null(), "not marked yet: {half}");

    node.start(None);
    wait_until("marked and up after the restart", || {
        link_details(&node.node, "rcbr0").is_some_and(|l| {
            l["ifalias"] == "flatnet:node-config"
                && l["flags"].as_array().unwrap().iter().any(|f| f == "UP")
        })
    });
    node.write_state(1500);
    wait_until("removed", || !has_link(&node.node, "rcbr0"));
    node.agent.stop();
}

/// A hot-plug entry asking `pod`'s primary interface for `mtu` with TCP
/// MSS clamping.
fn clamped_primary_entry(pod: &TestNetns, mtu: u32) -> String {
    format!(
        "{{name: web-primary, netns: {}, pod: shop/web, primary: {{mtu: {mtu}, tcpMssClamp: true}}}}",
        pod.path().display()
    )
}

/// A TCP connection from the pod to a listener of the node on the veth:
/// (the pod's end, the node's end).
fn connect_pod_to_node(node: &Node, pod: &TestNetns) -> (TcpStream, TcpStream) {
    let listener = run_in_netns(&node.node.path(), || {
        TcpListener::bind((NODE_VETH_V4, 0)).expect("listen on the node")
    })
    .expect("enter the node");
    let port = listener.local_addr().unwrap().port();
    let client = run_in_netns(&pod.path(), || {
        TcpStream::connect((NODE_VETH_V4, port)).expect("connect from the pod")
    })
    .expect("enter the pod");
    let (server, _) = listener.accept().expect("accept");
    for stream in [&client, &server] {
        stream
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        stream
            .set_write_timeout(Some(Duration::from_secs(20)))
            .unwrap();
    }
    (client, server)
}

/// The MSS the socket sends with now (`TCP_MAXSEG`: what the peer
/// announced and the route allow, less the timestamp option's 12 bytes).
fn max_segment(stream: &TcpStream) -> u32 {
    nix::sys::socket::getsockopt(stream, nix::sys::socket::sockopt::TcpMaxSeg).unwrap()
}

/// Sends `len` bytes each way over the connection at once and checks
/// they arrive, in order.
fn transfer_both_ways(a: &TcpStream, b: &TcpStream, len: usize, context: &str) {
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    std::thread::scope(|scope| {
        for (from, to) in [(a, b), (b, a)] {
            let data = &data;
            scope.spawn(move || {
                (&*from).write_all(data).expect("send");
            });
            scope.spawn(move || {
                let mut got = vec![0; data.len()];
                (&*to)
                    .read_exact(&mut got)
                    .unwrap_or_else(|e| panic!("{context}: receive: {e}"));
                assert!(got == *data, "{context}: the bytes arrive unchanged");
            });
        }
    });
}

#[test]
fn tcp_mss_clamping_on_the_primary_interface_clamps_new_flows_and_open_flows_go_on() {
    let Some(mut node) = Node::running_for_test(
        "tcp_mss_clamping_on_the_primary_interface_clamps_new_flows_and_open_flows_go_on",
        1500,
    ) else {
        return;
    };
    let pod = pod_with_primary_veth(&node);
    let (open_pod, open_node) = connect_pod_to_node(&node, &pod);
    transfer_both_ways(&open_pod, &open_node, 1 << 20, "before");
    assert_eq!(max_segment(&open_pod), 1448, "MTU 1500, with timestamps");

    node.write_state_with(1500, &clamped_primary_entry(&pod, 1400));
    wait_until("eth0 and its peer at 1400", || {
        primary_mtus(&node, &pod) == (1400, 1400)
    });
    wait_until("the clamping programs on eth0", || {
        primary_programs(&pod) == CLAMP_PROGRAMS
    });
    assert!(ledger(&node)["web-primary"].mss_clamp);
    // A flow opened before the MTU was lowered goes on both ways: each
    // side's TCP takes the new MTU of its own interface at the next send.
    transfer_both_ways(&open_pod, &open_node, 4 << 20, "open flow, lowered");
    assert_eq!(max_segment(&open_pod), 1348, "the pod adapted by itself");
    assert_eq!(max_segment(&open_node), 1348, "the node adapted by itself");

    // Routes whose MTU is locked at 1500 on both sides (as some cluster
    // networks write route MTUs): without clamping, both ends of a new
    // connection would announce and send 1460-byte segments through a
    // 1400-byte interface.
    pod.ip(&[
        "route",
        "replace",
        "10.99.0.0/30",
        "dev",
        "eth0",
        "mtu",
        "lock",
        "1500",
    ]);
    node.node.ip(&[
        "route",
        "replace",
        "10.99.0.0/30",
        "dev",
        NODE_VETH,
        "mtu",
        "lock",
        "1500",
    ]);
    let (new_pod, new_node) = connect_pod_to_node(&node, &pod);
    assert_eq!(
        max_segment(&new_pod),
        1348,
        "the node's SYN-ACK clamped into the pod"
    );
    assert_eq!(
        max_segment(&new_node),
        1348,
        "the pod's SYN clamped out of it"
    );
    transfer_both_ways(&new_pod, &new_node, 4 << 20, "new flow, clamped");

    // The programs stay attached while the agent is down and after it
    // restarts.
    node.agent.stop();
    assert_eq!(
        primary_programs(&pod),
        CLAMP_PROGRAMS,
        "while the agent is down"
    );
    let (down_pod, _down_node) = connect_pod_to_node(&node, &pod);
    assert_eq!(
        max_segment(&down_pod),
        1348,
        "clamped while the agent is down"
    );
    node.start(None);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(primary_programs(&pod), CLAMP_PROGRAMS, "after the restart");

    // The MTU alone: the programs go, and a new connection announces
    // what its route says (the control: without the programs nothing
    // clamps).
    node.write_state_with(1500, &primary_entry(&pod, 1400));
    // The agent takes the programs off before it records that they are
    // off (so a crash in between still removes them): wait for both.
    wait_until("the clamping programs off eth0 and recorded off", || {
        primary_programs(&pod).is_empty() && !ledger(&node)["web-primary"].mss_clamp
    });
    let (unclamped_pod, unclamped_node) = connect_pod_to_node(&node, &pod);
    assert_eq!(max_segment(&unclamped_pod), 1448, "not clamped");
    assert_eq!(max_segment(&unclamped_node), 1448, "not clamped");
    drop((unclamped_pod, unclamped_node));

    // Asked again, then the entry removed while the agent is down: the
    // restarted agent takes the programs off and sets the MTU back.
    node.write_state_with(1500, &clamped_primary_entry(&pod, 1400));
    wait_until("the clamping programs back on eth0", || {
        primary_programs(&pod) == CLAMP_PROGRAMS
    });
    node.agent.stop();
    node.write_state(1500);
    node.start(None);
    wait_until("set back, the programs off and the ledger emptied", || {
        primary_mtus(&node, &pod) == (1500, 1500)
            && primary_programs(&pod).is_empty()
            && ledger(&node).is_empty()
    });
    transfer_both_ways(&open_pod, &open_node, 1 << 20, "open flow, set back");
    node.agent.stop();
}
