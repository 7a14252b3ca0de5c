//! The agents' settings in the FlatNetworkConfig `cluster`, applied live,
//! on the real kernel (root): the operator's in-memory API server (over
//! HTTP, with the allocation controllers), the real `flatnet-agent run` in
//! Kubernetes mode and the real `flatnet-cni`, on a simulated LAN.
//!
//! - The conflict probe: the LAN host already uses the pod's address. The
//!   agent's environment turns the probe on; the object turns it off, so
//!   ADD succeeds; an edit turns it back on, and the next ADD of the same
//!   pod, with no restart in between, is refused naming the LAN host's MAC.
//! - Policy enforcement: a MultiNetworkPolicy denies the pod every
//!   ingress; the LAN host's ping goes unanswered, is answered once the
//!   object turns enforcement off, and unanswered again once it turns it
//!   back on.
//! - The ARP policy: the object's `spec.arpPolicy` over the agent's
//!   environment decides whether the kernel announces a new pod's address
//!   (`arp_notify`), edited live; a network's own `flatNetwork` block (the
//!   NetworkAttachmentDefinition's) wins over both, and sets `proxy_arp`.

mod support;

use flatnet_agent::policy_compiler::MultiNetworkPolicy;
use flatnet_k8s::api::{
    AgentsSpec, CONFIG_NAME, ConflictProbeSpec, FlatNetworkConfig, FlatNetworkConfigSpec,
};
use serde_json::json;
use support::{
    TestNetns,
    cni::IFNAME,
    kubernetes_node::{KubernetesNode, POD_ADDRESS},
    wait_until,
};

fn cluster_config(spec: FlatNetworkConfigSpec) -> FlatNetworkConfig {
    FlatNetworkConfig::new(CONFIG_NAME, spec)
}

/// Edits the FlatNetworkConfig while the agent runs and waits until the
/// agent logs that it applied `settings`.
fn edit(cluster: &KubernetesNode, spec: FlatNetworkConfigSpec, settings: &str) {
    cluster.server.insert(&cluster_config(spec));
    wait_applied(cluster, settings);
}

/// Waits until the agent logs that it applied `settings`.
fn wait_applied(cluster: &KubernetesNode, settings: &str) {
    wait_until(&format!("the agent applies {settings}"), || {
        cluster.agent_logged(|l| l.contains("agent settings applied") && l.contains(settings))
    });
}

/// The node with the FlatNetworkConfig's `spec` and the agent's flags
/// `args`; `None` when the test cannot run.
fn running_for_test(
    test: &str,
    spec: FlatNetworkConfigSpec,
    args: &[&str],
) -> Option<KubernetesNode> {
    KubernetesNode::running_for_test(
        test,
        "cs",
        |server| server.insert(&cluster_config(spec)),
        args,
    )
}

fn with_agents(agents: AgentsSpec) -> FlatNetworkConfigSpec {
    FlatNetworkConfigSpec {
        agents,
        ..FlatNetworkConfigSpec::default()
    }
}

fn probe(enabled: bool, wait_milliseconds: Option<u32>) -> FlatNetworkConfigSpec {
    with_agents(AgentsSpec {
        conflict_probe: ConflictProbeSpec {
            enabled: Some(enabled),
            wait_milliseconds,
        },
        policy_enforcement: None,
    })
}

fn enforcement(on: bool) -> FlatNetworkConfigSpec {
    with_agents(AgentsSpec {
        policy_enforcement: Some(on),
        ..AgentsSpec::default()
    })
}

fn arp_policy(policy: &str) -> FlatNetworkConfigSpec {
    FlatNetworkConfigSpec {
        arp_policy: Some(policy.into()),
        ..FlatNetworkConfigSpec::default()
    }
}

/// A sysctl of the pod's flat interface (`arp_notify`, `proxy_arp`).
fn interface_sysctl(pod: &TestNetns, key: &str) -> String {
    pod.exec("sysctl", &["-n", &format!("net.ipv4.conf.{IFNAME}.{key}")])
        .trim()
        .to_owned()
}

#[test]
fn the_conflict_probe_follows_the_cluster_configuration_without_a_restart() {
    // The environment turns the probe on, the object off.
    let Some(mut cluster) = running_for_test(
        "the_conflict_probe_follows_the_cluster_configuration_without_a_restart",
        probe(false, None),
        &["--conflict-probe-ms", "500"],
    ) else {
        return;
    };
    // A LAN host already uses the address (after the allocation, which
    // would skip an address seen on the wire).
    cluster
        .lan
        .add_address("lan0", &format!("{POD_ADDRESS}/24"));
    wait_applied(
        &cluster,
        "conflictProbe off (enabled from FlatNetworkConfig)",
    );
    let pod = TestNetns::new("csp-");
    let (ok, out) = cluster.cni("ADD", &pod);
    assert!(ok, "no probe: ADD does not ask the LAN: {out}");
    let (ok, out) = cluster.cni("DEL", &pod);
    assert!(ok, "DEL: {out}");

    edit(
        &cluster,
        probe(true, Some(300)),
        "conflictProbe on, 300 ms (enabled from FlatNetworkConfig, waitMilliseconds from FlatNetworkConfig)",
    );
    let lan_mac = cluster.lan.ip(&["-o", "link", "show", "dev", "lan0"]);
    let lan_mac = lan_mac
        .split("link/ether ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the LAN host's MAC")
        .to_owned();
    let pod = TestNetns::new("csp-");
    let (ok, out) = cluster.cni("ADD", &pod);
    assert!(!ok, "the probe is on again: ADD refused: {out}");
    let message = out.to_string();
    for part in [
        &format!("address {POD_ADDRESS}"),
        "already in use on the LAN",
        &lan_mac,
    ] {
        assert!(message.contains(part), "{part} missing in {message}");
    }
    cluster.stop();
}

#[test]
fn policy_enforcement_follows_the_cluster_configuration_without_a_restart() {
    let Some(mut cluster) = running_for_test(
        "policy_enforcement_follows_the_cluster_configuration_without_a_restart",
        enforcement(true),
        &["--conflict-probe-ms", "0"],
    ) else {
        return;
    };
    let pod = TestNetns::new("csq-");
    let (ok, out) = cluster.cni("ADD", &pod);
    assert!(ok, "ADD: {out}");
    wait_until("the LAN host reaches the pod", || cluster.ping_answered());

    // Every ingress to the pods of `default` denied.
    let deny: MultiNetworkPolicy = serde_json::from_value(json!({
        "apiVersion": "k8s.cni.cncf.io/v1beta1", "kind": "MultiNetworkPolicy",
        "metadata": {"name": "deny-ingress", "namespace": "default",
                     "annotations": {"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}
    }))
    .unwrap();
    cluster.server.insert(&deny);
    wait_until("the policy drops the ping", || !cluster.ping_answered());

    edit(
        &cluster,
        enforcement(false),
        "policyEnforcement off from FlatNetworkConfig",
    );
    wait_until("not enforced: the ping answered", || {
        cluster.ping_answered()
    });

    edit(
        &cluster,
        enforcement(true),
        "policyEnforcement on from FlatNetworkConfig",
    );
    wait_until("enforced again: the ping dropped", || {
        !cluster.ping_answered()
    });
    let (ok, out) = cluster.cni("DEL", &pod);
    assert!(ok, "DEL: {out}");
    cluster.stop();
}

#[test]
fn the_arp_policy_follows_the_cluster_configuration_without_a_restart() {
    // The environment's policy is arp_notify (the default), the object's arping.
    let Some(mut cluster) = running_for_test(
        "the_arp_policy_follows_the_cluster_configuration_without_a_restart",
        arp_policy("arping"),
        &["--conflict-probe-ms", "0"],
    ) else {
        return;
    };
    wait_applied(&cluster, "arpPolicy arping from FlatNetworkConfig");
    let attached = |extra: serde_json::Value, what: &str| {
        let pod = TestNetns::new("csa-");
        let (ok, out) = cluster.cni_with("ADD", &pod, extra);
        assert!(ok, "ADD ({what}): {out}");
        let sysctls = (
            interface_sysctl(&pod, "arp_notify"),
            interface_sysctl(&pod, "proxy_arp"),
        );
        let (ok, out) = cluster.cni("DEL", &pod);
        assert!(ok, "DEL ({what}): {out}");
        sysctls
    };
    assert_eq!(
        attached(json!({}), "the object's arping"),
        ("0".into(), "0".into()),
        "arping: flatnet announces, the kernel does not"
    );

    edit(
        &cluster,
        arp_policy("arp_notify"),
        "arpPolicy arp_notify from FlatNetworkConfig",
    );
    assert_eq!(
        attached(json!({}), "the object's arp_notify"),
        ("1".into(), "0".into()),
        "arp_notify: the kernel announces"
    );

    // The network's own block (as the operator writes it into each
    // NetworkAttachmentDefinition) wins, field by field.
    assert_eq!(
        attached(
            json!({"flatNetwork": {"arpPolicy": "arping", "proxyARP": true}}),
            "the network's arping and proxyARP"
        ),
        ("0".into(), "1".into())
    );
    let pod = TestNetns::new("csa-");
    let (ok, out) = cluster.cni_with("ADD", &pod, json!({"flatNetwork": {"arpPolicy": "garp"}}));
    assert!(!ok, "a policy that is none is refused: {out}");
    assert_eq!(out["code"], 2, "{out}");
    assert!(
        out["msg"]
            .as_str()
            .is_some_and(|m| m.contains("flatNetwork.arpPolicy")),
        "{out}"
    );
    cluster.stop();
}
