//! End to end: the real `flatnet-cni` binary against a real
//! `flatnet-agent run --standalone` process, on a simulated LAN (a node
//! namespace whose master is a veth to a LAN-host namespace) with pods in
//! fresh namespaces. Each test runs its own agent with a private socket,
//! pin root, record and state directories.

mod support;

use std::{path::Path, process::Command, time::Duration};

use aya::programs::TcAttachType;
use etherparse::ArpOperation;
use flatnet_agent::crash_point::CRASH_AT_ENV;
use flatnet_agent::datapath::{AttachMechanism, PinnedMaps, kernel_has_tcx};
use flatnet_agent::{
    netns::run_in_netns,
    packet::{BROADCAST, RawSocket, arp_frame},
};
use serde_json::{Value, json};
use support::{
    TestNetns,
    agent::StandaloneAgent,
    cni::{IFNAME, run_cni},
    has_link,
    lan::AgentOnLan,
    ping, privileged,
    tc_hooks::{attached_programs, link_pins},
    unique_name, veth_pair, wait_until,
};

const LAN_V4: &str = "192.0.2.1";
const LAN_V6: &str = "2001:db8::1";
/// Route settings of the `routed4`/`routed6` subnets.
const ROUTE_SETTINGS: &str = "{addPodIPToHost: true, addNodeCIDR: true, addClusterCIDR: true, \
                              addServiceCIDR: true, flatNetworkDefaultGateway: true}";

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
    fn new() -> Self {
        let AgentOnLan {
            agent,
            node,
            lan,
            master,
            dir,
        } = AgentOnLan::new(
            "fa",
            &[&format!("{LAN_V4}/24"), &format!("{LAN_V6}/64")],
            &["--arp-policy", "arping", "--conflict-probe-ms", "500"],
        );
        agent.write_state(&format!(
            r#"
subnets:
  - name: lan4
    spec:
      flatMode: macvlan
      master: {master}
      cidr: 192.0.2.0/24
      gateway: {LAN_V4}
      ranges: [{{from: 192.0.2.10, to: 192.0.2.20}}]
      routeSettings: {{flatNetworkDefaultGateway: true}}
  - name: lan6
    spec:
      flatMode: macvlan
      master: {master}
      cidr: "2001:db8::/64"
      gateway: "{LAN_V6}"
      ranges: [{{from: "2001:db8::10", to: "2001:db8::20"}}]
      routeSettings: {{flatNetworkDefaultGateway: true}}
  # Every route setting, and routes through the primary interface.
  - name: routed4
    spec:
      flatMode: macvlan
      master: {master}
      cidr: 192.0.2.0/24
      gateway: {LAN_V4}
      ranges: [{{from: 192.0.2.30, to: 192.0.2.40}}]
      routes: [{{dev: eth0, dst: 198.18.0.0/15}}]
      routeSettings: {ROUTE_SETTINGS}
  - name: routed6
    spec:
      flatMode: macvlan
      master: {master}
      cidr: "2001:db8::/64"
      gateway: "{LAN_V6}"
      ranges: [{{from: "2001:db8::30", to: "2001:db8::40"}}]
      routes: [{{dev: eth0, dst: "2001:db8:99::/48"}}]
      routeSettings: {ROUTE_SETTINGS}
  - name: badroute
    spec:
      flatMode: macvlan
      master: {master}
      cidr: 192.0.2.0/24
      ranges: [{{from: 192.0.2.50, to: 192.0.2.60}}]
      routes: [{{dev: eth7, dst: 198.18.0.0/15}}]
  - name: ghost
    spec: {{flatMode: macvlan, master: nosuch0, cidr: 198.51.100.0/24}}
  # ipvlan and VLAN subnets: their masters are made by the test that uses them.
  - name: ipl2
    spec:
      flatMode: ipvlan
      mode: l2
      ipvlanFlag: bridge
      master: {master}a
      cidr: 198.51.100.0/25
      ranges: [{{from: 198.51.100.10, to: 198.51.100.20}}]
  - name: ipl3
    spec:
      flatMode: ipvlan
      mode: l3
      master: {master}b
      cidr: 198.51.100.128/25
      ranges: [{{from: 198.51.100.140, to: 198.51.100.150}}]
  - name: vlan100
    spec:
      flatMode: macvlan
      master: {master}
      vlan: 100
      cidr: 203.0.113.0/24
      ranges: [{{from: 203.0.113.10, to: 203.0.113.20}}]
networks:
  - {{name: flat4, subnets: [lan4]}}
  - {{name: flat6, subnets: [lan6]}}
  - {{name: dual, subnets: [lan4, lan6]}}
  - {{name: nomaster, subnets: [ghost]}}
  - {{name: routed, subnets: [routed4, routed6]}}
  - {{name: badroute, subnets: [badroute]}}
  - {{name: ipvlan-l2, subnets: [ipl2]}}
  - {{name: ipvlan-l3, subnets: [ipl3]}}
  - {{name: vlan, subnets: [vlan100]}}
"#
        ));
        Self {
            agent,
            node,
            lan,
            master,
            _dir: dir,
        }
    }

    /// The node for `test`, or `None` (the skip printed) without the
    /// privileges it needs.
    fn for_test(test: &str) -> Option<Self> {
        privileged(test).then(Self::new)
    }

    /// [`Node::for_test`] with its agent started.
    fn running_for_test(test: &str) -> Option<Self> {
        let mut node = Self::for_test(test)?;
        node.start();
        Some(node)
    }

    fn socket(&self) -> std::path::PathBuf {
        self.agent.socket()
    }

    fn allocations(&self) -> Value {
        self.agent.allocations()
    }

    fn allocated(&self) -> Vec<String> {
        let mut out: Vec<String> = self.allocations()["allocations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["address"].as_str().unwrap().to_owned())
            .collect();
        out.sort();
        out
    }

    fn records(&self) -> usize {
        self.agent.records()
    }

    /// Starts the agent and waits until its socket answers STATUS.
    fn start(&mut self) {
        self.start_crashing_at(None);
    }

    /// Starts the agent; with `crash_at`, it aborts at that test crash point.
    fn start_crashing_at(&mut self, crash_at: Option<&str>) {
        self.agent
            .start(crash_at.map(|step| (CRASH_AT_ENV, step)), |agent| {
                run_cni(&agent.socket(), "STATUS", "flat4", "", None, json!({})).0
            });
    }

    /// Stops the agent with SIGTERM and waits for it.
    fn stop(&mut self) {
        self.agent.stop();
    }

    /// Runs flatnet-cni for the pod's `eth1`; returns (success, stdout JSON).
    fn cni(
        &self,
        command: &str,
        network: &str,
        container: &str,
        pod: Option<&TestNetns>,
    ) -> (bool, Value) {
        let netns = pod.map(TestNetns::path);
        self.cni_in(command, network, container, netns.as_deref())
    }

    /// [`Node::cni`] with any `CNI_NETNS`.
    fn cni_in(
        &self,
        command: &str,
        network: &str,
        container: &str,
        netns: Option<&Path>,
    ) -> (bool, Value) {
        run_cni(
            &self.socket(),
            command,
            network,
            container,
            netns,
            json!({}),
        )
    }

    fn add(&self, network: &str, container: &str, pod: &TestNetns) -> Value {
        let (ok, out) = self.cni("ADD", network, container, Some(pod));
        assert!(ok, "ADD {network} {container} failed: {out}");
        out
    }

    /// CHECK of an attachment against the result its ADD returned.
    fn check(&self, network: &str, container: &str, pod: &TestNetns, result: &Value) {
        let prev = json!({"prevResult": result});
        let netns = pod.path();
        let (ok, out) = run_cni(
            &self.socket(),
            "CHECK",
            network,
            container,
            Some(&netns),
            prev,
        );
        assert!(ok, "CHECK {network} {container}: {out}");
    }

    /// DEL, then waits for the work that follows its answer.
    fn del(&self, network: &str, container: &str, pod: Option<&TestNetns>) {
        let netns = pod.map(TestNetns::path);
        self.del_at(network, container, pod, netns.as_deref());
    }

    /// [`Node::del`] with `CNI_NETNS` set to `netns`, a path of `pod`'s namespace.
    fn del_at(
        &self,
        network: &str,
        container: &str,
        pod: Option<&TestNetns>,
        netns: Option<&Path>,
    ) {
        let had_record = self.agent.has_record(container);
        let (ok, out) = self.cni_in("DEL", network, container, netns);
        assert!(ok, "DEL {network} {container} failed: {out}");
        wait_until(&format!("DEL {network} {container} never finished"), || {
            !self.agent.has_record(container)
                && pod.is_none_or(|pod| !had_record || !has_link(pod, IFNAME))
        });
    }

    fn gc(&self, network: &str, valid: &[&str]) -> (bool, Value) {
        let valid: Vec<Value> = valid
            .iter()
            .map(|c| json!({"containerID": c, "ifname": IFNAME}))
            .collect();
        let extra = json!({"cni.dev/valid-attachments": valid});
        run_cni(&self.socket(), "GC", network, "", None, extra)
    }

    /// Asserts that `pod` has no flat interface and the agent neither an
    /// address nor a record left; `context` names the case.
    fn assert_nothing_left(&self, pod: &TestNetns, context: &str) {
        assert!(!has_link(pod, IFNAME), "{context}: interface left behind");
        assert!(
            self.allocated().is_empty(),
            "{context}: {:?}",
            self.allocated()
        );
        assert_eq!(self.records(), 0, "{context}: records left behind");
    }
}

/// Asserts that `family`'s routes in `ns` include every one of `expected`.
fn assert_routes(ns: &TestNetns, family: &str, expected: &[&str]) {
    let routes = ns.ip(&[family, "route", "show"]);
    for expected in expected {
        assert!(
            routes.contains(expected),
            "{} lacks {expected:?}:\n{routes}",
            ns.name
        );
    }
}

fn addresses(result: &Value) -> Vec<String> {
    result["ips"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ip| ip["address"].as_str().unwrap().to_owned())
        .collect()
}

/// Asserts that a flatnet-cni call failed with CNI error code `expected`
/// (`context` names the call); returns the error.
fn assert_error((ok, out): (bool, Value), expected: u64, context: &str) -> Value {
    assert!(!ok, "{context}: succeeded: {out}");
    let code = out["code"]
        .as_u64()
        .unwrap_or_else(|| panic!("{context}: not an error: {out}"));
    assert_eq!(code, expected, "{context}: {out}");
    out
}

#[test]
fn add_check_del_for_ipv4_ipv6_and_dual_stack() {
    let Some(mut node) = Node::running_for_test("add_check_del_for_ipv4_ipv6_and_dual_stack")
    else {
        return;
    };
    for (network, expected, targets) in [
        ("flat4", vec!["192.0.2.10/24"], vec![LAN_V4]),
        ("flat6", vec!["2001:db8::10/64"], vec![LAN_V6]),
        (
            "dual",
            vec!["192.0.2.10/24", "2001:db8::10/64"],
            vec![LAN_V4, LAN_V6],
        ),
    ] {
        let pod = TestNetns::new("fap-");
        let container = unique_name("c");
        let result = node.add(network, &container, &pod);
        assert_eq!(addresses(&result), expected, "{network}: {result}");
        assert_eq!(result["interfaces"][0]["name"], "eth1");
        assert!(has_link(&pod, IFNAME));
        for target in targets {
            ping(&pod, target);
        }
        // A repeated ADD returns the same result.
        assert_eq!(node.add(network, &container, &pod), result);

        node.check(network, &container, &pod, &result);

        node.del(network, &container, Some(&pod));
        node.assert_nothing_left(&pod, network);
        node.del(network, &container, Some(&pod));
        node.del(network, &container, None);
    }
    node.stop();
}

/// containerd and CRI-O name pod namespaces `/var/run/netns/...`; the
/// agent's image has no `/var/run` and mounts the host's `/run/netns`. Such
/// a pod is attached, checked and removed all the same.
#[test]
fn a_var_run_netns_path_works_for_an_agent_without_var_run() {
    let test = "a_var_run_netns_path_works_for_an_agent_without_var_run";
    let Some(mut node) = Node::for_test(test) else {
        return;
    };
    node.agent.without_var_run();
    node.start();
    let pod = TestNetns::new("fav-");
    let container = unique_name("c");
    let netns = Path::new("/var/run/netns").join(&pod.name);
    let (ok, result) = node.cni_in("ADD", "flat4", &container, Some(&netns));
    assert!(ok, "ADD with CNI_NETNS={}: {result}", netns.display());
    assert_eq!(addresses(&result), ["192.0.2.10/24"], "{result}");
    assert!(has_link(&pod, IFNAME));
    ping(&pod, LAN_V4);
    node.del_at("flat4", &container, Some(&pod), Some(&netns));
    node.assert_nothing_left(&pod, "flat4");
    node.stop();
}

/// Under `arp_notify` in a container whose `/proc/sys` is
/// read-only, as the chart runs the agent, the kernel still announces a
/// pod's IPv4 address (`arp_notify` is set over netlink); its IPv6 address
/// (`ndisc_notify` has no netlink setting) is announced with frames.
#[test]
fn arp_notify_reaches_the_kernel_through_a_read_only_proc_sys() {
    let test = "arp_notify_reaches_the_kernel_through_a_read_only_proc_sys";
    let Some(mut node) = Node::for_test(test) else {
        return;
    };
    node.agent.with_read_only_proc_sys();
    node.start();
    let pod = TestNetns::new("fro-");
    // This node's agent runs with arping; the network asks for arp_notify.
    let (ok, out) = run_cni(
        &node.socket(),
        "ADD",
        "dual",
        "c1",
        Some(&pod.path()),
        json!({"flatNetwork": {"arpPolicy": "arp_notify"}}),
    );
    assert!(ok, "ADD: {out}");
    let sysctl = |key: &str| pod.exec("sysctl", &["-n", key]).trim().to_owned();
    assert_eq!(sysctl(&format!("net.ipv4.conf.{IFNAME}.arp_notify")), "1");
    assert_eq!(sysctl(&format!("net.ipv6.conf.{IFNAME}.ndisc_notify")), "0");
    let log = std::fs::read_to_string(node.agent.log_file()).unwrap();
    assert!(
        log.contains("announcing IPv6 addresses with frames instead"),
        "{log}"
    );
    node.del("dual", "c1", Some(&pod));
    node.stop();
}

#[test]
fn two_pods_reach_each_other_and_the_lan() {
    let Some(mut node) = Node::running_for_test("two_pods_reach_each_other_and_the_lan") else {
        return;
    };
    let (a, b) = (TestNetns::new("fap-"), TestNetns::new("fap-"));
    let ra = node.add("flat4", "ca", &a);
    let rb = node.add("flat4", "cb", &b);
    assert_eq!(addresses(&ra), ["192.0.2.10/24"]);
    assert_eq!(addresses(&rb), ["192.0.2.11/24"]);
    ping(&a, "192.0.2.11");
    ping(&b, "192.0.2.10");
    ping(&a, LAN_V4);
    // The pod addresses are watched for conflicts on the master.
    let maps = flatnet_agent::datapath::PinnedMaps::open(&node.agent.pin.path);
    let mut maps = maps.expect("pinned maps");
    let watched: Vec<String> = maps
        .managed_addrs()
        .unwrap()
        .entries()
        .unwrap()
        .into_iter()
        .map(|(_, addr, _)| addr.to_string())
        .collect();
    assert_eq!(watched, ["192.0.2.10", "192.0.2.11"]);
    node.del("flat4", "ca", Some(&a));
    node.del("flat4", "cb", Some(&b));
    assert!(maps.managed_addrs().unwrap().entries().unwrap().is_empty());
    node.stop();
}

#[test]
fn gc_removes_attachments_not_listed() {
    let Some(mut node) = Node::running_for_test("gc_removes_attachments_not_listed") else {
        return;
    };
    let (a, b) = (TestNetns::new("fap-"), TestNetns::new("fap-"));
    node.add("flat4", "keep", &a);
    node.add("flat4", "stale", &b);
    let (ok, out) = node.gc("flat4", &["keep"]);
    assert!(ok, "GC: {out}");
    assert!(has_link(&a, IFNAME));
    assert!(!has_link(&b, IFNAME), "GC left the stale interface");
    assert_eq!(node.allocated(), ["192.0.2.10"]);
    assert_eq!(node.records(), 1);
    // GC of another network touches nothing of this one.
    let (ok, _) = node.gc("flat6", &[]);
    assert!(ok);
    assert_eq!(node.allocated(), ["192.0.2.10"]);
    node.del("flat4", "keep", Some(&a));
    node.stop();
}

#[test]
fn bad_requests_give_clear_errors_and_leave_nothing() {
    let Some(mut node) = Node::running_for_test("bad_requests_give_clear_errors_and_leave_nothing")
    else {
        return;
    };
    let pod = TestNetns::new("fap-");

    let out = assert_error(
        node.cni("ADD", "nope", "c1", Some(&pod)),
        104,
        "unknown network",
    );
    assert!(out["msg"].as_str().unwrap().contains("\"nope\""), "{out}");

    let out = assert_error(
        node.cni("ADD", "nomaster", "c2", Some(&pod)),
        105,
        "no master",
    );
    assert!(out["msg"].as_str().unwrap().contains("nosuch0"), "{out}");

    let missing_subnet = json!({"subnet": "missing"});
    let outcome = run_cni(
        &node.socket(),
        "ADD",
        "flat4",
        "c3",
        Some(&pod.path()),
        missing_subnet,
    );
    assert_error(outcome, 104, "unknown subnet");

    node.assert_nothing_left(&pod, "after bad requests");
    node.stop();
}

#[test]
fn a_netns_that_is_no_network_namespace_is_refused_and_del_and_gc_succeed() {
    let Some(mut node) =
        Node::for_test("a_netns_that_is_no_network_namespace_is_refused_and_del_and_gc_succeed")
    else {
        return;
    };
    let file = node.agent.path("not-a-netns");
    std::fs::write(&file, b"").unwrap();
    let dir = node.agent.path("a-directory");
    std::fs::create_dir(&dir).unwrap();

    // An ADD an earlier version left pending with such a namespace: the
    // restart undoes it instead of failing on it forever.
    let records = flatnet_agent::records::Records::open(&node.agent.path("records")).unwrap();
    records.save(&pending_record("old", &file)).unwrap();
    node.start();
    wait_until("the interrupted ADD is undone at start", || {
        node.records() == 0
    });

    let pod = TestNetns::new("fap-");
    for netns in [file.as_path(), dir.as_path(), Path::new("/dev/null")] {
        let context = netns.display().to_string();
        for _ in 0..2 {
            let out = assert_error(node.cni_in("ADD", "flat4", "c1", Some(netns)), 4, &context);
            let msg = out["msg"].as_str().unwrap();
            assert!(msg.contains("is not a network namespace"), "{msg}");
            assert!(msg.contains(&context), "{msg}");
            node.assert_nothing_left(&pod, &context);
        }
        let (ok, out) = node.cni_in("DEL", "flat4", "c1", Some(netns));
        assert!(ok, "DEL in {context}: {out}");
        let (ok, out) = node.gc("flat4", &[]);
        assert!(ok, "GC: {out}");
    }
    // The container still gets its interface once the runtime gets it right.
    node.add("flat4", "c1", &pod);
    assert_eq!(node.allocated(), ["192.0.2.10"]);
    node.del("flat4", "c1", Some(&pod));
    node.assert_nothing_left(&pod, "after the real ADD");
    node.stop();
}

/// A pending record of `container` on `flat4` (subnet `lan4`) in `netns`,
/// as an ADD leaves it before the interface is made.
fn pending_record(container: &str, netns: &Path) -> flatnet_agent::records::AttachmentRecord {
    serde_json::from_value(json!({
        "containerId": container,
        "ifname": IFNAME,
        "network": "flat4",
        "netns": netns,
        "phase": "pending",
        "subnets": [{"name": "lan4", "spec": {"flatMode": "macvlan", "master": "eth9", "cidr": "192.0.2.0/24"}}],
        "addresses": ["192.0.2.10/24"],
    }))
    .unwrap()
}

#[test]
fn an_add_on_another_network_does_not_replace_the_attachment() {
    let Some(mut node) =
        Node::running_for_test("an_add_on_another_network_does_not_replace_the_attachment")
    else {
        return;
    };
    let pod = TestNetns::new("fap-");
    let result = node.add("dual", "c1", &pod);
    let before = node.allocated();
    assert_eq!(before, ["192.0.2.10", "2001:db8::10"]);

    let out = assert_error(
        node.cni("ADD", "flat4", "c1", Some(&pod)),
        4,
        "ADD on another network",
    );
    let msg = out["msg"].as_str().unwrap();
    assert!(
        msg.contains("already attached to network \"dual\""),
        "{msg}"
    );
    assert_eq!(node.allocated(), before, "allocations kept");
    assert_eq!(node.records(), 1);
    node.check("dual", "c1", &pod, &result);
    ping(&pod, LAN_V6);

    // DEL of the refused network leaves the attachment alone too (it
    // answers after its own work: there is nothing to wait for).
    let (ok, out) = node.cni("DEL", "flat4", "c1", Some(&pod));
    assert!(ok, "DEL of the refused network failed: {out}");
    assert_eq!(node.allocated(), before);
    assert_eq!(node.records(), 1);
    node.del("dual", "c1", Some(&pod));
    node.assert_nothing_left(&pod, "after DEL");
    node.stop();
}

#[test]
fn state_file_edits_apply_at_the_next_add_and_a_rejected_one_does_not_stop_a_restart() {
    let Some(mut node) = Node::running_for_test(
        "state_file_edits_apply_at_the_next_add_and_a_rejected_one_does_not_stop_a_restart",
    ) else {
        return;
    };
    let pod = TestNetns::new("fap-");
    assert_error(
        node.cni("ADD", "late", "c1", Some(&pod)),
        104,
        "network not mapped yet",
    );
    let state = std::fs::read_to_string(node.agent.state_file()).unwrap();
    let mapped = state.replace(
        "networks:\n",
        "networks:\n  - {name: late, subnets: [lan4]}\n",
    );
    assert_ne!(mapped, state);
    node.agent.write_state(&mapped);
    let result = node.add("late", "c1", &pod);
    assert_eq!(addresses(&result), ["192.0.2.10/24"]);

    // A broken edit is rejected: what is in force stays, and a restart
    // starts from the last good version instead of refusing to start.
    node.agent.write_state("subnets: [this is not a subnet");
    let other = TestNetns::new("fap-");
    let second = node.add("late", "c2", &other);
    assert_eq!(addresses(&second), ["192.0.2.11/24"]);
    node.del("late", "c2", Some(&other));
    node.stop();
    node.start();
    let log = std::fs::read_to_string(node.agent.log_file()).unwrap();
    assert!(log.contains("starting from its last good copy"), "{log}");
    assert_eq!(node.add("late", "c1", &pod), result, "ADD after restart");
    node.del("late", "c1", Some(&pod));
    node.assert_nothing_left(&pod, "after DEL");
    node.stop();
}

#[test]
fn an_address_already_on_the_lan_is_refused() {
    let Some(mut node) = Node::running_for_test("an_address_already_on_the_lan_is_refused") else {
        return;
    };
    // The LAN host already uses the first address of each range.
    node.lan.add_address("lan0", "192.0.2.10/24");
    node.lan.add_address("lan0", "2001:db8::10/64");
    for network in ["flat4", "flat6"] {
        let pod = TestNetns::new("fap-");
        let out = assert_error(node.cni("ADD", network, "c1", Some(&pod)), 106, network);
        let msg = out["msg"].as_str().unwrap();
        assert!(msg.contains("2.10") || msg.contains("db8::10"), "{msg}");
        node.assert_nothing_left(&pod, network);
    }
    node.stop();
}

/// A host nobody declared that only asks (ARP requests for the gateway)
/// from an address and never answers for it; the lab's `wire-ipam` step on
/// a single node, here run on Linux 6.1 in the VM too.
#[test]
fn an_address_a_silent_foreign_host_used_is_skipped_by_the_next_add() {
    let Some(mut node) =
        Node::running_for_test("an_address_a_silent_foreign_host_used_is_skipped_by_the_next_add")
    else {
        return;
    };
    let first = TestNetns::new("faw-");
    assert_eq!(
        addresses(&node.add("flat4", "w1", &first)),
        ["192.0.2.10/24"]
    );
    let foreign: std::net::Ipv4Addr = "192.0.2.11".parse().unwrap();
    let foreign_mac = [0x02, 0x00, 0x5e, 0x00, 0x00, 0xee];
    let request = arp_frame(
        foreign_mac,
        BROADCAST,
        ArpOperation::REQUEST,
        (foreign_mac, foreign),
        ([0; 6], LAN_V4.parse().unwrap()),
    )
    .unwrap();
    run_in_netns(&node.lan.path(), || {
        let socket = RawSocket::open("lan0").unwrap();
        for _ in 0..2 {
            socket.send(&request).unwrap();
        }
    })
    .unwrap();
    // Read as allocation reads it: the pinned maps of the agent's pin root.
    wait_until("the foreign host's claim in the wire inventory", || {
        PinnedMaps::open(&node.agent.pin.path)
            .and_then(|maps| maps.wire_claims())
            .unwrap()
            .iter()
            .any(|c| c.addr == std::net::IpAddr::V4(foreign) && c.mac == foreign_mac)
    });
    let second = TestNetns::new("faw-");
    assert_eq!(
        addresses(&node.add("flat4", "w2", &second)),
        ["192.0.2.12/24"],
        "192.0.2.11 is live on the wire"
    );
    node.del("flat4", "w1", Some(&first));
    node.del("flat4", "w2", Some(&second));
    node.assert_nothing_left(&second, "after DEL");
    node.stop();
}

#[test]
fn agent_down_and_restarted_between_add_and_del() {
    let Some(mut node) = Node::for_test("agent_down_and_restarted_between_add_and_del") else {
        return;
    };
    let pod = TestNetns::new("fap-");
    assert_error(node.cni("ADD", "flat4", "c1", Some(&pod)), 11, "agent down");

    node.start();
    let result = node.add("dual", "c1", &pod);
    let before = node.allocations();
    node.stop();
    assert!(!node.socket().exists(), "socket removed on shutdown");
    assert!(has_link(&pod, IFNAME), "the pod keeps its interface");
    node.start();
    assert_eq!(node.allocations(), before, "allocation file intact");
    assert_eq!(node.add("dual", "c1", &pod), result, "ADD after restart");
    node.del("dual", "c1", Some(&pod));
    assert!(!has_link(&pod, IFNAME));
    assert!(node.allocated().is_empty());
    node.stop();
}

#[test]
fn status_reports_ready() {
    let Some(mut node) = Node::running_for_test("status_reports_ready") else {
        return;
    };
    let (ok, out) = node.cni("STATUS", "flat4", "", None);
    assert!(ok, "{out}");
    let out = assert_error(
        node.cni("STATUS", "nomaster", "", None),
        50,
        "STATUS, the subnet's master link is missing",
    );
    assert!(
        out["msg"]
            .as_str()
            .unwrap()
            .contains("\"nosuch0\" does not exist"),
        "{out}"
    );
    assert!(
        node.agent.path("bin/flatnet-cni").exists(),
        "flatnet-cni installed"
    );
    node.stop();
    assert_error(
        node.cni("STATUS", "flat4", "", None),
        11,
        "STATUS, agent stopped",
    );
    let _ = &node.master;
}

/// The names of the BPF programs process `pid` holds open.
fn programs_held(pid: u32) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return names;
    };
    for fd in fds.flatten() {
        let is_program = std::fs::read_link(fd.path())
            .is_ok_and(|target| target.to_string_lossy() == "anon_inode:bpf-prog");
        let info = std::fs::read_to_string(format!(
            "/proc/{pid}/fdinfo/{}",
            fd.file_name().to_string_lossy()
        ))
        .unwrap_or_default();
        let Some(id) = info.lines().find_map(|l| l.strip_prefix("prog_id:")) else {
            continue;
        };
        if !is_program {
            continue;
        }
        let shown = Command::new("bpftool")
            .args(["-j", "prog", "show", "id", id.trim()])
            .output()
            .expect("bpftool");
        let program: Value = serde_json::from_slice(&shown.stdout).unwrap_or_default();
        if let Some(name) = program["name"].as_str() {
            names.insert(name.to_owned());
        }
    }
    names
}

/// The kernel verifies every program an ADD attaches while the agent
/// starts, so that no pod's ADD waits for the verifier (hundreds of
/// milliseconds a program).
#[test]
fn every_program_is_loaded_before_the_first_add() {
    let Some(mut node) = Node::running_for_test("every_program_is_loaded_before_the_first_add")
    else {
        return;
    };
    let pid = node.agent.pid().expect("the agent runs");
    let all: std::collections::BTreeSet<String> = flatnet_agent::datapath::Datapath::ADD_PROGRAMS
        .iter()
        .map(|name| (*name).to_owned())
        .collect();
    wait_until("the agent holds every program, with no ADD yet", || {
        programs_held(pid) == all
    });
    assert_eq!(node.agent.records(), 0, "no ADD came");
    node.stop();
}

/// Whether `ip -n <ns> link add ...` works; `false` (with a printed skip or,
/// where the kernel must have it, a failure) when the link type is unknown.
fn kernel_has(test: &str, ns: &TestNetns, feature: &str, args: &[&str]) -> bool {
    let out = Command::new("ip")
        .args(["-n", &ns.name, "link", "add"])
        .args(args)
        .output()
        .unwrap();
    if out.status.success() {
        return true;
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Unknown device type"),
        "ip link add {}: {stderr}",
        args.join(" ")
    );
    support::skip_for_missing_kernel_feature(test, feature);
    false
}

#[test]
fn ipvlan_l2_l3_and_vlan_through_the_cni() {
    const TEST: &str = "ipvlan_l2_l3_and_vlan_through_the_cni";
    let Some(mut node) = Node::for_test(TEST) else {
        return;
    };
    // Masters of the ipvlan subnets, each a veth to the LAN host.
    let (l2_master, l3_master) = (format!("{}a", node.master), format!("{}b", node.master));
    for (master, lan_if, lan_addr) in [
        (&l2_master, "lan1", "198.51.100.1/25"),
        (&l3_master, "lan2", "198.51.100.129/25"),
    ] {
        veth_pair(&node.node, master, &node.lan, lan_if);
        node.node.ip(&["link", "set", master, "up"]);
        node.lan.ip(&["link", "set", lan_if, "up"]);
        node.lan.add_address(lan_if, lan_addr);
    }
    let probe = ["ipvprobe", "link", "lan1", "type", "ipvlan"];
    if !kernel_has(TEST, &node.lan, "ipvlan", &probe) {
        return;
    }
    node.lan.ip(&["link", "del", "ipvprobe"]);
    let lan_vlan = [
        "link", "lan0", "name", "lan0.100", "type", "vlan", "id", "100",
    ];
    if !kernel_has(TEST, &node.lan, "802.1Q VLAN", &lan_vlan) {
        return;
    }
    node.lan.ip(&["link", "set", "lan0.100", "up"]);
    node.lan.add_address("lan0.100", "203.0.113.1/24");
    node.start();

    // ipvlan L2: the pod resolves the LAN host itself.
    let pod = TestNetns::new("fap-");
    let container = unique_name("c");
    let result = node.add("ipvlan-l2", &container, &pod);
    assert_eq!(addresses(&result), vec!["198.51.100.10/25"], "{result}");
    ping(&pod, "198.51.100.1");
    node.check("ipvlan-l2", &container, &pod, &result);
    node.del("ipvlan-l2", &container, Some(&pod));
    assert!(!has_link(&pod, IFNAME));

    // ipvlan L3: the pod does no ARP; the LAN host's ARP for the pod's
    // address is answered by the uplink program on the master.
    let pod = TestNetns::new("fap-");
    let container = unique_name("c");
    let result = node.add("ipvlan-l3", &container, &pod);
    assert_eq!(addresses(&result), vec!["198.51.100.140/25"], "{result}");
    ping(&pod, "198.51.100.129");
    let neigh = node.lan.ip(&["neigh", "show", "198.51.100.140"]);
    let master_mac = node
        .node
        .exec("cat", &[&format!("/sys/class/net/{l3_master}/address")]);
    assert!(
        neigh.contains(master_mac.trim()),
        "LAN host's entry {neigh} should hold the master's MAC {master_mac}"
    );
    node.check("ipvlan-l3", &container, &pod, &result);
    node.del("ipvlan-l3", &container, Some(&pod));

    // macvlan on a VLAN: flatnet creates <master>.100, shares it, and
    // removes it with its last pod.
    let vlan_if = format!("{}.100", node.master);
    let first = TestNetns::new("fap-");
    let second = TestNetns::new("fap-");
    let (c1, c2) = (unique_name("c"), unique_name("c"));
    node.add("vlan", &c1, &first);
    node.add("vlan", &c2, &second);
    assert!(has_link(&node.node, &vlan_if), "{vlan_if} created");
    ping(&first, "203.0.113.1");
    ping(&second, "203.0.113.1");
    node.del("vlan", &c1, Some(&first));
    assert!(
        has_link(&node.node, &vlan_if),
        "{vlan_if} still used by the second pod"
    );
    node.del("vlan", &c2, Some(&second));
    assert!(
        !has_link(&node.node, &vlan_if),
        "{vlan_if} removed with its last pod"
    );
    assert!(
        node.allocated().is_empty(),
        "every address released: {:?}",
        node.allocated()
    );
}

/// Gives the node an address of each family on the master with its default
/// routes there, and the pod a primary `eth0` (a veth to the node, like a
/// cluster network's) with default routes through the node. Returns the
/// node's end of that veth.
fn with_primary(node: &Node, pod: &TestNetns) -> String {
    let n = &node.node;
    n.add_address(&node.master, "192.0.2.2/24");
    n.add_address(&node.master, "2001:db8::2/64");
    n.ip(&["route", "add", "default", "via", LAN_V4]);
    n.ip(&["-6", "route", "add", "default", "via", LAN_V6]);
    let node_end = unique_name("pv");
    veth_pair(pod, "eth0", n, &node_end);
    for (ns, ifname, v4, v6) in [
        (pod, "eth0", "10.99.0.2/24", "fd99::2/64"),
        (n, node_end.as_str(), "10.99.0.1/24", "fd99::1/64"),
    ] {
        ns.add_address(ifname, v4);
        ns.add_address(ifname, v6);
        ns.ip(&["link", "set", ifname, "up"]);
    }
    pod.ip(&["route", "add", "default", "via", "10.99.0.1"]);
    pod.ip(&["-6", "route", "add", "default", "via", "fd99::1"]);
    node_end
}

/// flatnet's node routes (protocol 241) of one family, one per line.
fn node_routes(node: &Node, family: &str) -> String {
    node.node.ip(&[family, "route", "show", "proto", "241"])
}

/// Asserts that the node has no flatnet route of either family left.
fn assert_no_node_routes(node: &Node) {
    for (family, name) in [("-4", "IPv4"), ("-6", "IPv6")] {
        assert_eq!(
            node_routes(node, family).trim(),
            "",
            "{name} node route removed"
        );
    }
}

#[test]
fn route_settings_reach_the_pod_from_its_node_in_both_families() {
    let Some(mut node) =
        Node::for_test("route_settings_reach_the_pod_from_its_node_in_both_families")
    else {
        return;
    };
    let pod = TestNetns::new("fap-");
    let node_end = with_primary(&node, &pod);
    node.start();
    let result = node.add("routed", "c-routes", &pod);
    assert_eq!(
        addresses(&result),
        ["192.0.2.30/24", "2001:db8::30/64"],
        "{result}"
    );

    assert_routes(
        &pod,
        "-4",
        &[
            "default via 192.0.2.1 dev eth1",
            // addClusterCIDR / addServiceCIDR (the agent's defaults).
            "10.42.0.0/16 via 10.99.0.1 dev eth0",
            "10.43.0.0/16 via 10.99.0.1 dev eth0",
            // addNodeCIDR: the node's network is the flat subnet itself, so
            // only the node's address goes through the primary network.
            "192.0.2.2 via 10.99.0.1 dev eth0",
            // A subnet route through the primary interface.
            "198.18.0.0/15 dev eth0",
            // The flat subnet stays on the flat interface.
            "192.0.2.0/24 dev eth1",
        ],
    );
    assert_routes(
        &pod,
        "-6",
        &[
            "default via 2001:db8::1 dev eth1",
            "2001:db8::2 via fd99::1 dev eth0",
            "2001:db8:99::/48 dev eth0",
        ],
    );

    // addPodIPToHost: node routes through the pod's primary network.
    assert_eq!(
        node_routes(&node, "-4").trim(),
        format!("192.0.2.30 via 10.99.0.2 dev {node_end} src 192.0.2.2")
    );
    assert_eq!(
        node_routes(&node, "-6").trim(),
        format!("2001:db8::30 via fd99::2 dev {node_end} src 2001:db8::2 metric 1024 pref medium")
    );
    // The node reaches its pod although macvlan children cannot talk to
    // their parent: out through the veth, back through eth0.
    ping(&node.node, "192.0.2.30");
    ping(&node.node, "2001:db8::30");

    node.check("routed", "c-routes", &pod, &result);

    node.del("routed", "c-routes", Some(&pod));
    assert!(!has_link(&pod, IFNAME));
    assert_no_node_routes(&node);
    assert!(node.allocated().is_empty(), "{:?}", node.allocated());
    node.stop();
}

#[test]
fn a_route_through_a_missing_pod_interface_is_refused_by_name() {
    let Some(mut node) =
        Node::for_test("a_route_through_a_missing_pod_interface_is_refused_by_name")
    else {
        return;
    };
    let pod = TestNetns::new("fap-");
    node.start();
    let out = assert_error(
        node.cni("ADD", "badroute", "c-bad", Some(&pod)),
        105,
        "bad route",
    );
    let msg = out["msg"].as_str().unwrap();
    assert!(
        msg.contains("dev eth7") && msg.contains("badroute") && msg.contains("spec.routes"),
        "{msg}"
    );
    node.assert_nothing_left(&pod, "refused ADD");
    node.stop();
}

#[test]
fn an_add_killed_midway_is_undone_at_restart_and_then_succeeds() {
    let Some(mut node) =
        Node::for_test("an_add_killed_midway_is_undone_at_restart_and_then_succeeds")
    else {
        return;
    };
    let pod = TestNetns::new("fap-");
    with_primary(&node, &pod);
    node.start_crashing_at(Some("add-attached"));
    let outcome = node.cni("ADD", "routed", "c-crash", Some(&pod));
    assert_error(outcome, 11, "the runtime is told to retry");
    let status = node.agent.wait_for_exit();
    assert!(
        !status.success(),
        "the agent died at the crash point: {status}"
    );
    // What the dead agent left: the interface, node routes, a pending
    // record and the allocation.
    assert!(has_link(&pod, IFNAME));
    assert_ne!(node_routes(&node, "-4").trim(), "");
    assert_eq!(node.records(), 1);
    assert_eq!(node.allocated().len(), 2);

    node.start();
    // The half-made interface, the pending record and the allocation are removed.
    node.assert_nothing_left(&pod, "undone at restart");
    assert_no_node_routes(&node);
    // The primary default routes are restored.
    assert_routes(&pod, "-4", &["default via 10.99.0.1 dev eth0"]);
    assert_routes(&pod, "-6", &["default via fd99::1 dev eth0"]);

    // The runtime's retry of the same ADD succeeds.
    let result = node.add("routed", "c-crash", &pod);
    assert_eq!(
        addresses(&result),
        ["192.0.2.30/24", "2001:db8::30/64"],
        "{result}"
    );
    ping(&node.node, "192.0.2.30");
    node.del("routed", "c-crash", Some(&pod));
    assert!(!has_link(&pod, IFNAME));
    assert!(node.allocated().is_empty());
    node.stop();
}

/// State-file policy for pod `default/pod-web`: TCP `ports` from anywhere.
fn web_policy(ports: &[u16]) -> String {
    let ports: Vec<String> = ports.iter().map(|p| format!("{{port: {p}}}")).collect();
    format!(
        r#"
policies:
  - apiVersion: k8s.cni.cncf.io/v1beta1
    kind: MultiNetworkPolicy
    metadata: {{name: web, namespace: default}}
    spec:
      podSelector: {{matchLabels: {{app: web}}}}
      policyTypes: [Ingress]
      ingress: [{{ports: [{}]}}]
pods:
  default/pod-web: {{app: web}}
"#,
        ports.join(", ")
    )
}

/// Accepts (and closes) TCP connections on `addr:port` inside `ns`.
fn tcp_server(ns: &TestNetns, addr: &str, port: u16) {
    let target: std::net::SocketAddr = format!("{addr}:{port}").parse().unwrap();
    let listener =
        flatnet_agent::netns::run_in_netns(&ns.path(), || std::net::TcpListener::bind(target))
            .unwrap()
            .unwrap();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            drop(stream);
        }
    });
}

/// Whether a TCP connection from `ns` to `addr:port` is established. A
/// dropped SYN is given up on after a while (not a timing assertion).
fn tcp_works(ns: &TestNetns, addr: &str, port: u16) -> bool {
    let target: std::net::SocketAddr = format!("{addr}:{port}").parse().unwrap();
    flatnet_agent::netns::run_in_netns(&ns.path(), || {
        std::net::TcpStream::connect_timeout(&target, Duration::from_millis(1500)).is_ok()
    })
    .unwrap()
}

/// Waits until the installed policy satisfies `done` (a bound on waiting
/// for the agent's round, not a timing check).
fn wait_for_policy(
    node: &Node,
    what: &str,
    done: impl Fn(&flatnet_agent::datapath::InstalledPolicy) -> bool,
) {
    let maps =
        flatnet_agent::datapath::PolicyMaps::open(&node.agent.pin.path).expect("policy maps");
    wait_until(&format!("the agent never installed {what}"), || {
        done(&maps.installed().unwrap())
    });
}

fn denied(node: &Node) -> u64 {
    let maps = flatnet_agent::datapath::PolicyMaps::open(&node.agent.pin.path).unwrap();
    maps.stats().unwrap().0["denied_no_rule"]
}

fn allows_port(installed: &flatnet_agent::datapath::InstalledPolicy, port: u16) -> bool {
    let ports = format!("{port}-{port}");
    installed
        .entries
        .iter()
        .any(|e| e.matches.iter().any(|m| m.ports == ports))
}

#[test]
fn state_file_policy_is_enforced_reloaded_and_survives_a_restart() {
    let Some(mut node) =
        Node::for_test("state_file_policy_is_enforced_reloaded_and_survives_a_restart")
    else {
        return;
    };
    let (allowed, later, never) = (7001, 7002, 7003);
    // The node's subnets and networks, followed by `policy`.
    let base = std::fs::read_to_string(node.agent.state_file()).unwrap();
    let with_policy = |policy: &str| format!("{base}{policy}");
    node.agent
        .write_state(&with_policy(&web_policy(&[allowed])));
    node.start();
    let (web, client) = (TestNetns::new("faw-"), TestNetns::new("fac-"));
    let web_addr = "192.0.2.10";
    node.add("flat4", "web", &web);
    // The ADD answers only once the tables judge the new pod: it is
    // isolated from its first packet, with nothing to wait for here.
    let installed = flatnet_agent::datapath::PolicyMaps::open(&node.agent.pin.path)
        .expect("policy maps")
        .installed()
        .unwrap();
    assert!(
        installed
            .subjects
            .iter()
            .any(|s| s.addr.to_string() == web_addr)
            && allows_port(&installed, allowed),
        "web isolated when its ADD answered: {installed:?}"
    );
    node.add("flat4", "client", &client);
    for port in [allowed, later, never] {
        tcp_server(&web, web_addr, port);
    }
    let programs = attached_programs(&web, IFNAME, TcAttachType::Ingress);
    assert!(
        matches!(programs.as_slice(), [one] if one.name == "policy_ingress"),
        "attached on ADD: {programs:?}"
    );
    // ADD attaches filters (no RCU wait); a second later the same program
    // moves into a TCX link where the kernel has them.
    let settled = if kernel_has_tcx() {
        AttachMechanism::Tcx
    } else {
        AttachMechanism::Netlink
    };
    wait_until("the policy program never moved into a TCX link", || {
        matches!(
            attached_programs(&web, IFNAME, TcAttachType::Ingress).as_slice(),
            [one] if one.mechanism == settled && one.id == programs[0].id
        )
    });
    let programs = attached_programs(&web, IFNAME, TcAttachType::Ingress);
    assert!(tcp_works(&client, web_addr, allowed));
    assert!(!tcp_works(&client, web_addr, later), "not allowed yet");

    // Edit the state file: the agent reloads it and allows the port,
    // without re-attaching anything.
    node.agent
        .write_state(&with_policy(&web_policy(&[allowed, later])));
    wait_for_policy(&node, "the edited policy", |p| allows_port(p, later));
    assert!(tcp_works(&client, web_addr, later));
    assert_eq!(
        attached_programs(&web, IFNAME, TcAttachType::Ingress),
        programs,
        "the same program, attached the same way"
    );

    // A bad edit is rejected and the policy stays.
    let log = node.agent.log_file();
    node.agent
        .write_state(&with_policy("policies: [{kind: nonsense}]\n"));
    let logged = |text: &str| std::fs::read_to_string(&log).unwrap().matches(text).count();
    wait_until("the bad edit was not reported", || {
        logged("the edit is rejected") > 0
    });
    assert!(
        tcp_works(&client, web_addr, later),
        "the policy in force stays"
    );
    assert!(!tcp_works(&client, web_addr, never));
    node.agent
        .write_state(&with_policy(&web_policy(&[allowed, later])));

    // Restart the agent under a stream of allowed connections.
    let denied_before = denied(&node);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flow = {
        let stop = std::sync::Arc::clone(&stop);
        let client_path = client.path();
        std::thread::spawn(move || {
            let target: std::net::SocketAddr = format!("{web_addr}:{allowed}").parse().unwrap();
            let (mut ok, mut failed) = (0u64, 0u64);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let connected = flatnet_agent::netns::run_in_netns(&client_path, || {
                    std::net::TcpStream::connect_timeout(&target, Duration::from_secs(2)).is_ok()
                })
                .unwrap();
                if connected { ok += 1 } else { failed += 1 }
            }
            (ok, failed)
        })
    };
    node.stop();
    node.start();
    // The restarted agent's first round rewrites the entries with its own
    // rule ids; wait for it, then stop the flow.
    wait_until("the restarted agent applied nothing", || {
        logged("network policy applied") >= 3
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed) = flow.join().unwrap();
    assert!(ok > 0, "the flow ran");
    assert_eq!(failed, 0, "an allowed connection failed across the restart");
    assert_eq!(denied(&node), denied_before, "nothing was dropped");

    // Still enforced after the restart, by the restarted agent's program
    // in the same place.
    assert!(tcp_works(&client, web_addr, later));
    assert!(!tcp_works(&client, web_addr, never));
    assert!(denied(&node) > denied_before);
    let restarted = attached_programs(&web, IFNAME, TcAttachType::Ingress);
    assert!(
        matches!(restarted.as_slice(), [one] if one.name == "policy_ingress"
            && one.mechanism == programs[0].mechanism
            && one.id != programs[0].id),
        "replaced in place: {programs:?} -> {restarted:?}"
    );
    let pod_links = || -> Vec<String> {
        link_pins(&node.agent.pin.path)
            .into_iter()
            .filter(|name| name.contains("policy_"))
            .collect()
    };
    let pinned = match programs[0].mechanism {
        AttachMechanism::Tcx => 4,
        AttachMechanism::Netlink => 0,
    };
    assert_eq!(pod_links().len(), pinned, "two pods, two links each");
    node.del("flat4", "web", Some(&web));
    node.del("flat4", "client", Some(&client));
    // The pods' interfaces are gone, and so are the pins of their links.
    assert_eq!(pod_links(), Vec::<String>::new());
    node.stop();
}

/// Every directory and file under `root` (walked recursively) is closed to
/// other uids.
fn assert_root_only(root: &Path, what: &str) {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::symlink_metadata(root)
        .unwrap_or_else(|e| panic!("{what} {}: {e}", root.display()))
        .permissions()
        .mode();
    assert_eq!(
        mode & 0o077,
        0,
        "{what} {} has mode {:o}: open to other uids",
        root.display(),
        mode & 0o777
    );
    if root.is_dir() {
        for entry in std::fs::read_dir(root).unwrap() {
            assert_root_only(&entry.unwrap().path(), what);
        }
    }
}

#[test]
fn state_records_socket_and_pinned_maps_are_root_only() {
    let Some(mut node) =
        Node::running_for_test("state_records_socket_and_pinned_maps_are_root_only")
    else {
        return;
    };
    let pod = TestNetns::new("fmo-");
    let container = unique_name("c");
    node.add("flat4", &container, &pod);
    assert!(node.records() > 0, "the ADD left a record to check");
    // What the agent keeps (the VLAN lease directory, made only for VLAN
    // subnets, is made by the same function as the state directory).
    for (dir, what) in [
        ("state", "state directory"),
        ("records", "record directory"),
        ("run", "socket directory"),
    ] {
        assert_root_only(&node.agent.path(dir), what);
    }
    assert_root_only(&node.agent.pin.path, "pinned maps");
    node.del("flat4", &container, Some(&pod));
    node.stop();
}
