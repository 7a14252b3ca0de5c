//! The agents' settings in the FlatNetworkConfig `cluster`, applied live,
//! on the real kernel (root): the operator's in-memory API server (over
//! HTTP, with the allocation controllers), the real `flatnet-agent run` in
//! Kubernetes mode and the real `flatnet-cni`, on a simulated LAN whose
//! host already uses the pod's address. The agent's environment turns the
//! conflict probe on; the object turns it off, so ADD succeeds; an edit
//! turns it back on, and the next ADD of the same pod, with no restart in
//! between, is refused naming the LAN host's MAC.

mod support;

use flatnet_k8s::api::{
    AgentsSpec, CONFIG_NAME, ConflictProbeSpec, FlatNetworkConfig, FlatNetworkConfigSpec,
    FlatNetworkIP,
};
use flatnet_operator::allocation::fake_api::FakeApiServer;
use kube::ResourceExt;
use serde_json::json;
use support::{
    TestNetns,
    agent::{StandaloneAgent, insert_flat_pod, serve_with_allocation},
    cni::run_cni,
    lan::SimulatedLan,
    privileged, wait_until,
};

const NODE: &str = "node-1";
/// `run_cni` names the pod of container `c1` `default/pod-c1`.
const POD: &str = "pod-c1";
const POD_ADDRESS: &str = "192.0.2.10";

fn cluster_config(probe: ConflictProbeSpec) -> FlatNetworkConfig {
    FlatNetworkConfig::new(
        CONFIG_NAME,
        FlatNetworkConfigSpec {
            agents: AgentsSpec {
                conflict_probe: probe,
                policy_enforcement: None,
            },
            ..FlatNetworkConfigSpec::default()
        },
    )
}

/// Whether the agent's log says it applied `settings`.
fn applied(agent: &StandaloneAgent, settings: &str) -> bool {
    std::fs::read_to_string(agent.log_file())
        .unwrap_or_default()
        .lines()
        .any(|l| l.contains("agent settings applied") && l.contains(settings))
}

#[test]
fn the_conflict_probe_follows_the_cluster_configuration_without_a_restart() {
    const TEST: &str = "the_conflict_probe_follows_the_cluster_configuration_without_a_restart";
    if !privileged(TEST) {
        return;
    }
    let SimulatedLan { node, lan, master } = SimulatedLan::new("cs", &["192.0.2.1/24"]);
    lan.sysctl("net.ipv6.conf.all.disable_ipv6", "1");
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let server = FakeApiServer::new();
    insert_flat_pod(&server, (&master, "bridge"), NODE, POD);
    server.insert(&cluster_config(ConflictProbeSpec {
        enabled: Some(false),
        wait_milliseconds: None,
    }));
    let kubeconfig = dir.path().join("kubeconfig");
    serve_with_allocation(&runtime, &server, None, &kubeconfig);
    let cni_bin_dir = dir.path().join("bin").display().to_string();
    // The environment turns the probe on.
    let mut agent = StandaloneAgent::new(
        dir.path(),
        &node,
        &[
            "--cni-bin-dir",
            &cni_bin_dir,
            "--conflict-probe-ms",
            "500",
            "--floating-ip",
            "false",
        ],
    )
    .in_kubernetes(&kubeconfig, NODE);
    agent.start_until_status("flat4", None);
    wait_until("the pod's address allocated", || {
        server
            .list::<FlatNetworkIP>()
            .iter()
            .any(|r| r.name_any() == POD && r.status.as_ref().is_some_and(|s| s.addr.is_some()))
    });
    // A LAN host already uses it (after the allocation, which would skip
    // an address seen on the wire).
    lan.add_address("lan0", &format!("{POD_ADDRESS}/24"));
    let add = |pod: &TestNetns| {
        run_cni(
            &agent.socket(),
            "ADD",
            "flat4",
            "c1",
            Some(&pod.path()),
            json!({}),
        )
    };

    wait_until(
        "the object's setting applied over the environment's",
        || applied(&agent, "conflictProbe off (enabled from FlatNetworkConfig)"),
    );
    let pod = TestNetns::new("csp-");
    let (ok, out) = add(&pod);
    assert!(ok, "no probe: ADD does not ask the LAN: {out}");
    let (ok, out) = run_cni(
        &agent.socket(),
        "DEL",
        "flat4",
        "c1",
        Some(&pod.path()),
        json!({}),
    );
    assert!(ok, "DEL: {out}");

    // Edited while the agent runs.
    server.insert(&cluster_config(ConflictProbeSpec {
        enabled: Some(true),
        wait_milliseconds: Some(300),
    }));
    wait_until("the edit applied", || {
        applied(
            &agent,
            "conflictProbe on, 300 ms (enabled from FlatNetworkConfig, waitMilliseconds from FlatNetworkConfig)",
        )
    });
    let lan_mac = lan.ip(&["-o", "link", "show", "dev", "lan0"]);
    let lan_mac = lan_mac
        .split("link/ether ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the LAN host's MAC")
        .to_owned();
    let pod = TestNetns::new("csp-");
    let (ok, out) = add(&pod);
    assert!(!ok, "the probe is on again: ADD refused: {out}");
    let message = out.to_string();
    for part in [
        &format!("address {POD_ADDRESS}"),
        "already in use on the LAN",
        &lan_mac,
    ] {
        assert!(message.contains(part), "{part} missing in {message}");
    }
    agent.stop();
}
