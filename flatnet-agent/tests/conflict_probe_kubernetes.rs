//! The conflict probe ahead of ADD, in Kubernetes mode on the real kernel
//! (root): the operator's in-memory API server (over HTTP, with the
//! allocation controllers), the real `flatnet-agent run` and the real
//! `flatnet-cni`, on a simulated LAN. Pods are bound to the node and
//! Pending, as kubelet sees them before it makes their sandboxes.
//!
//! - The agent probes a pod's allocated address before its ADD comes, and
//!   the ADD takes that verdict (`source="ahead"`), without a probe of
//!   its own to wait for.
//! - A LAN host that claims the address after the probe went out (a
//!   gratuitous ARP) is in the wire inventory: the ADD is refused, naming
//!   the address and the host's MAC.
//! - A host silent until the ADD's own probes (sent again at ADD, not
//!   waited for) answers them late: the pod is attached, and its address
//!   reported as a conflict.

mod support;

use std::{net::Ipv4Addr, time::Duration};

use flatnet_k8s::api::FlatNetworkIP;
use flatnet_operator::allocation::fake_api::FakeApiServer;
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::json;
use support::{
    TestNetns,
    agent::{counted, free_local_address},
    cni::run_cni,
    kubernetes_node::{KubernetesNode, POD, POD_ADDRESS},
    lan::{SlowHost, send_arp_requests},
    wait_until,
};

/// The probe's window: the first probe on the uplink (the subnet names no
/// gateway to learn the LAN's reply time from) waits all of it.
const WINDOW_MS: &str = "300";
const FOREIGN_MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x00, 0x00, 0x78];
const FOREIGN: &str = "02:00:5e:00:00:78";

/// Pod `name` of namespace `default`, bound to the node, Pending, with a
/// flat interface on `lan4`.
fn pending_pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "default",
                     "annotations": {"flatnetwork.pandaria.io/ip": "auto",
                                     "flatnetwork.pandaria.io/subnet": "lan4"}},
        "spec": {"nodeName": support::kubernetes_node::NODE,
                 "containers": [{"name": "c", "image": "pause"}]},
        "status": {"phase": "Pending"}
    }))
    .unwrap()
}

/// The address allocated to pod `name`, once allocated.
fn allocated(server: &FakeApiServer, name: &str) -> String {
    let mut address = None;
    wait_until(&format!("an address allocated to {name}"), || {
        address = server
            .list::<FlatNetworkIP>()
            .into_iter()
            .find(|r| r.name_any() == name)
            .and_then(|r| r.status.and_then(|s| s.addr));
        address.is_some()
    });
    address.unwrap().to_string()
}

struct Node {
    node: KubernetesNode,
    admin: String,
}

impl Node {
    fn probes(&self) -> u64 {
        counted(
            &self.admin,
            "flatnet_agent_conflict_probe_waits_total{basis=\"no_reply_time\"}",
        )
    }

    fn verdicts(&self, source: &str) -> u64 {
        counted(
            &self.admin,
            &format!("flatnet_agent_conflict_probe_add_verdicts_total{{source=\"{source}\"}}"),
        )
    }

    /// Waits until `n` probes were made, and their windows passed.
    fn probed(&self, n: u64) {
        wait_until(&format!("{n} probes ahead of their ADDs"), || {
            self.probes() >= n
        });
        std::thread::sleep(Duration::from_millis(WINDOW_MS.parse().unwrap()));
    }

    /// ADD of container `container` (pod `pod-<container>`) in `netns`.
    fn add(&self, container: &str, netns: &TestNetns) -> (bool, serde_json::Value) {
        run_cni(
            &self.node.agent.socket(),
            "ADD",
            "flat4",
            container,
            Some(&netns.path()),
            json!({}),
        )
    }
}

#[test]
fn adds_take_the_verdict_probed_ahead_and_claims_seen_since_refuse_them() {
    let admin = free_local_address();
    let Some(node) = KubernetesNode::running_for_test(
        "adds_take_the_verdict_probed_ahead_and_claims_seen_since_refuse_them",
        "cpk",
        |server| server.insert(&pending_pod(POD)),
        &["--conflict-probe-ms", WINDOW_MS, "--admin-address", &admin],
    ) else {
        return;
    };
    let mut node = Node { node, admin };

    // Probed ahead: the ADD's verdict is made when it comes.
    node.probed(1);
    let first = TestNetns::new("cpk-");
    let (ok, out) = node.add("c1", &first);
    assert!(ok, "ADD of {POD} ({POD_ADDRESS}): {out}");
    assert_eq!(
        node.verdicts("ahead"),
        1,
        "the ADD took the verdict made ahead"
    );
    assert_eq!(node.verdicts("at_add"), 0, "no ADD probed itself");
    assert_eq!(node.probes(), 1, "the ADD sent no probe to wait for");

    // A LAN host claims the next pod's address after its probe went out.
    node.node.server.insert(&pending_pod("pod-c2"));
    let claimed: Ipv4Addr = allocated(&node.node.server, "pod-c2").parse().unwrap();
    node.probed(2);
    send_arp_requests(&node.node.lan, "lan0", FOREIGN_MAC, claimed, claimed);
    let second = TestNetns::new("cpk-");
    let (ok, out) = node.add("c2", &second);
    assert!(!ok, "a claim seen since the probe refuses the ADD: {out}");
    let message = out.to_string();
    for part in [
        &format!("address {claimed}"),
        "already in use on the LAN",
        FOREIGN,
    ] {
        assert!(message.contains(part), "{part} missing in {message}");
    }
    assert_eq!(out["code"], 106, "error 106: {out}");
    assert_eq!(node.verdicts("ahead"), 2);

    // A host silent until the ADD's own probes answers them late: the pod
    // is attached, then its address is reported as a conflict.
    node.node.server.insert(&pending_pod("pod-c3"));
    let late: Ipv4Addr = allocated(&node.node.server, "pod-c3").parse().unwrap();
    node.probed(3);
    let slow = SlowHost::answering(&node.node.lan, late, Duration::from_secs(1), FOREIGN_MAC);
    let conflicts = counted(&node.admin, "flatnet_agent_ip_conflicts_total");
    let third = TestNetns::new("cpk-");
    let (ok, out) = node.add("c3", &third);
    assert!(ok, "ADD of pod-c3 ({late}): {out}");
    assert_eq!(node.verdicts("ahead"), 3);
    wait_until("the late answer raised as a conflict", || {
        counted(&node.admin, "flatnet_agent_ip_conflicts_total") > conflicts
    });
    assert!(slow.finish() >= 1, "the host answered the ADD's probe");
    node.node.stop();
}
