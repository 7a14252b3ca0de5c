//! Kubernetes-mode ADD through the real agent (root), against the
//! operator's in-memory API server: ADD answers without waiting for the
//! pod's FlatNetworkIP to be marked `Active` (a round trip to the API
//! server); the status follows, is told again until the API server takes
//! it, and is told by the next agent when the one that owed it died.

mod support;

use flatnet_operator::allocation::fake_api::faults::{Fault, Plan};
use support::{
    TestNetns,
    cni::IFNAME,
    kubernetes_node::{KubernetesNode, NODE, POD},
    wait_until,
};

/// The pod's flat interface's MAC.
fn interface_mac(pod: &TestNetns) -> String {
    let link = pod.ip(&["-o", "link", "show", "dev", IFNAME]);
    link.split("link/ether ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the interface's MAC")
        .to_owned()
}

/// Whether the pod's FlatNetworkIP says `Active` on this node with `mac`.
fn active_with(cluster: &KubernetesNode, mac: &str) -> bool {
    cluster
        .record()
        .and_then(|r| r.status)
        .is_some_and(|s| s.phase == "Active" && s.node == NODE && s.mac == mac)
}

#[test]
fn the_active_status_follows_the_answer_and_is_told_again_until_taken() {
    let Some(mut cluster) = KubernetesNode::running_for_test(
        "the_active_status_follows_the_answer_and_is_told_again_until_taken",
        "ak",
        |_| {},
        &["--conflict-probe-ms", "0"],
    ) else {
        return;
    };
    // The API server refuses the first two writes of the status.
    for _ in 0..2 {
        cluster.server.script_fault(
            "flatnetworkips/status",
            POD,
            Plan::Before(Fault::ServerError),
        );
    }
    let pod = TestNetns::new("akp-");
    let (ok, out) = cluster.cni("ADD", &pod);
    assert!(ok, "ADD answers without the status: {out}");
    let mac = interface_mac(&pod);
    // Told again only after a pause of 200 ms, then 400 ms.
    assert!(!active_with(&cluster, &mac), "{:?}", cluster.record());
    wait_until("the LAN host reaches the pod", || cluster.ping_answered());
    wait_until("the status Active, told again", || {
        active_with(&cluster, &mac)
    });
    let refusals = std::fs::read_to_string(cluster.agent.log_file())
        .unwrap()
        .matches("cannot tell the attachment's Active status")
        .count();
    assert_eq!(refusals, 2, "one warning per refused write");
    let (ok, out) = cluster.cni("DEL", &pod);
    assert!(ok, "DEL: {out}");
    cluster.stop();
}

#[test]
fn an_active_status_owed_by_an_agent_that_died_is_told_by_the_next() {
    let Some(mut cluster) = KubernetesNode::running_for_test(
        "an_active_status_owed_by_an_agent_that_died_is_told_by_the_next",
        "ar",
        |_| {},
        &["--conflict-probe-ms", "0"],
    ) else {
        return;
    };
    cluster.agent.stop();
    // Dies with the record ready, before telling the status.
    cluster
        .agent
        .start_until_status("flat4", Some("active-unreported"));
    let pod = TestNetns::new("arp-");
    let (ok, out) = cluster.cni("ADD", &pod);
    assert!(!ok, "the agent died before answering: {out}");
    assert!(!cluster.agent.wait_for_exit().success());
    let mac = interface_mac(&pod);
    assert!(!active_with(&cluster, &mac), "{:?}", cluster.record());

    cluster.agent.start_until_status("flat4", None);
    wait_until("the restarted agent tells the status", || {
        active_with(&cluster, &mac)
    });
    let (ok, out) = cluster.cni("DEL", &pod);
    assert!(ok, "DEL: {out}");
    cluster.stop();
}
