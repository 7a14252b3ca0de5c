//! PodNetworkConfig end to end in Kubernetes mode, on the real kernel:
//! the operator's in-memory API server (served over HTTP in this process)
//! with the operator's allocation controllers and PodNetworkConfig
//! controller running against it, and the real `flatnet-agent run` in
//! Kubernetes mode (its kubeconfig names that server) with the real
//! `flatnet-cni`, on a simulated LAN, with a container runtime's CRI
//! socket (a fake answering as containerd does). A configuration written
//! to the API server reaches a pod that is already running, whether the
//! agent attached it or only the runtime knows its namespace; removing it
//! takes the interfaces away; an agent killed midway converges after its
//! restart.

mod support;

use std::{net::IpAddr, time::Duration};

use flatnet_k8s::{
    api::{
        FlatNetworkIP, FlatNetworkNodeConfig, FlatNetworkSubnet, PodNetworkConfig,
        PodNetworkConfigStatus,
    },
    keys::SUBNET_NAMESPACE,
};
use flatnet_operator::{allocation::fake_api::FakeApiServer, runtime_config::controller};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde_json::{Value, json};
use support::{
    TestNetns,
    agent::{StandaloneAgent, assert_agent_authorized, insert_node, serve_with_allocation},
    cni::run_cni,
    cri::{FakeCri, Sandbox},
    has_link,
    lan::SimulatedLan,
    ping, privileged,
    tc_hooks::{CLAMP_PROGRAMS, primary_programs},
    veth_pair, wait_until,
};
use tokio_util::sync::CancellationToken;

const NODE: &str = "node-1";
/// `run_cni` names the pod of container `c1` `default/pod-c1`.
const POD: &str = "pod-c1";
const RECORD: &str = "pod-c1.if-net2";
/// A running pod on the node that the agent never attached: the
/// container runtime knows its namespace.
const OTHER_POD: &str = "pod-other";
const OTHER_RECORD: &str = "pod-other.if-net2";
/// A running pod the agent never attached and the runtime does not know.
const UNKNOWN_POD: &str = "pod-unknown";

/// The API server with the operator's controllers, the LAN, the node and
/// its agent.
struct Cluster {
    /// First field: the agent stops before the namespaces go.
    agent: StandaloneAgent,
    server: FakeApiServer,
    /// Runs the API server and the operator's controllers.
    _runtime: tokio::runtime::Runtime,
    stop: CancellationToken,
    /// `pod-other`'s namespace, which only the container runtime names.
    other: TestNetns,
    node: TestNetns,
    lan: TestNetns,
    _dir: tempfile::TempDir,
}

impl Cluster {
    /// Stops the agent; fails naming any request of it the chart's RBAC
    /// refused during the test.
    fn stop(&mut self) {
        self.agent.stop();
        assert_agent_authorized(&self.server);
    }

    fn running_for_test(test: &str) -> Option<Self> {
        if !privileged(test) {
            return None;
        }
        let SimulatedLan { node, lan, master } = SimulatedLan::new("rk", &["192.0.2.1/24"]);
        let dir = tempfile::tempdir().unwrap();
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let server = FakeApiServer::new();
        server.insert(&subnet(&master));
        server.insert(&running_pod());
        for name in [OTHER_POD, UNKNOWN_POD] {
            let mut pod = running_pod();
            pod.metadata.name = Some(name.into());
            pod.metadata.annotations = None;
            server.insert(&pod);
        }
        let other = TestNetns::new("rko-");
        let cri = FakeCri::default();
        // As the kubelet labels it: with the pod's UID.
        let uid = server
            .list::<Pod>()
            .into_iter()
            .find(|p| p.name_any() == OTHER_POD)
            .and_then(|p| p.metadata.uid)
            .expect("the API server gives every pod a UID");
        cri.add(Sandbox {
            uid,
            ..Sandbox::ready("default", OTHER_POD, &other.path())
        });
        let cri_socket = dir.path().join("cri.sock");
        insert_node(&server, NODE);
        let kubeconfig = dir.path().join("kubeconfig");
        serve_with_allocation(&runtime, &server, None, &kubeconfig);
        let stop = CancellationToken::new();
        runtime.block_on(async {
            let settings = controller::Settings {
                debounce: Duration::from_millis(20),
                resync: Duration::from_secs(2),
            };
            tokio::spawn(controller::run(server.client(), settings, stop.clone()));
            cri.serve(&cri_socket);
        });
        let cni_bin_dir = dir.path().join("bin").display().to_string();
        let agent = StandaloneAgent::new(
            dir.path(),
            &node,
            &[
                "--cni-bin-dir",
                &cni_bin_dir,
                "--conflict-probe-ms",
                "0",
                "--cri-socket",
                &cri_socket.display().to_string(),
            ],
        )
        .in_kubernetes(&kubeconfig, NODE);
        let mut this = Self {
            agent,
            server,
            _runtime: runtime,
            stop,
            other,
            node,
            lan,
            _dir: dir,
        };
        this.start(None);
        Some(this)
    }

    /// Starts the agent (with `crash_at`, to abort at that test crash
    /// point) and waits until it answers STATUS (it has reached the API).
    fn start(&mut self, crash_at: Option<&str>) {
        self.agent.start_until_status("flat4", crash_at);
    }

    fn cni(&self, command: &str, pod: &TestNetns) -> (bool, Value) {
        run_cni(
            &self.agent.socket(),
            command,
            "flat4",
            "c1",
            Some(&pod.path()),
            json!({}),
        )
    }

    fn record(&self, name: &str) -> Option<FlatNetworkIP> {
        self.server
            .list::<FlatNetworkIP>()
            .into_iter()
            .find(|r| r.name_any() == name)
    }

    /// The address of the hot-plugged interface of record `name`, once allocated.
    fn address(&self, name: &str) -> Option<IpAddr> {
        self.record(name)?.status?.addr
    }

    fn status(&self) -> PodNetworkConfigStatus {
        self.server
            .list::<PodNetworkConfig>()
            .into_iter()
            .find_map(|c| c.status)
            .unwrap_or_default()
    }

    /// Pod `name`'s Multus `network-status` annotation.
    fn network_status(&self, name: &str) -> String {
        self.server
            .list::<Pod>()
            .into_iter()
            .filter(|p| p.name_any() == name)
            .find_map(|p| {
                p.annotations()
                    .get("k8s.v1.cni.cncf.io/network-status")
                    .cloned()
            })
            .unwrap_or_default()
    }

    fn add_config(&self) {
        self.server.insert(&config());
    }

    fn remove_config(&self) {
        self.server.delete::<PodNetworkConfig>("default", "storage");
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn subnet(master: &str) -> FlatNetworkSubnet {
    serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
        "metadata": {"name": "lan4", "namespace": SUBNET_NAMESPACE},
        "spec": {"flatMode": "macvlan", "master": master, "cidr": "192.0.2.0/24",
                 "ranges": [{"from": "192.0.2.10", "to": "192.0.2.20"}]}
    }))
    .unwrap()
}

/// The running pod the runtime attaches (`eth1` on `lan4`).
fn running_pod() -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": POD, "namespace": "default", "labels": {"app": "web"},
                     "annotations": {"flatnetwork.pandaria.io/ip": "auto",
                                     "flatnetwork.pandaria.io/subnet": "lan4",
                                     // As Multus wrote it at the pod's creation.
                                     "k8s.v1.cni.cncf.io/network-status":
                                         r#"[{"name":"k8s-pod-network","interface":"eth0","ips":["10.42.0.5"]}]"#}},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "image": "pause"}]},
        "status": {"phase": "Running"}
    }))
    .unwrap()
}

/// Interface `net2` on `lan4` for the pods labelled `app: web`.
fn config() -> PodNetworkConfig {
    serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "PodNetworkConfig",
        "metadata": {"name": "storage", "namespace": "default"},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                 "attachments": [{"subnet": "lan4", "interface": "net2"}]}
    }))
    .unwrap()
}

/// The runtime's ADD of the pod, once the operator allocated its address.
fn attach_pod(cluster: &Cluster, pod: &TestNetns) {
    wait_until("the pod's address allocated", || {
        cluster
            .server
            .list::<FlatNetworkIP>()
            .iter()
            .any(|r| r.name_any() == POD && r.status.as_ref().is_some_and(|s| s.addr.is_some()))
    });
    let (ok, out) = cluster.cni("ADD", pod);
    assert!(ok, "the runtime's ADD: {out}");
}

#[test]
fn a_pod_network_config_hot_plugs_into_a_running_pod_and_its_removal_unplugs() {
    let Some(mut cluster) = Cluster::running_for_test(
        "a_pod_network_config_hot_plugs_into_a_running_pod_and_its_removal_unplugs",
    ) else {
        return;
    };
    let pod = TestNetns::new("rkp-");
    attach_pod(&cluster, &pod);

    cluster.add_config();
    wait_until("net2 hot-plugged", || has_link(&pod, "net2"));
    wait_until("its address allocated", || {
        cluster.address(RECORD).is_some()
    });
    let address = cluster.address(RECORD).unwrap().to_string();
    ping(&cluster.lan, &address);
    assert!(
        pod.ip(&["-4", "addr", "show", "dev", "net2"])
            .contains(&address),
        "net2 carries the allocated address"
    );
    // The pod the agent never attached gets it too, in the namespace the
    // container runtime names.
    wait_until(
        "net2 hot-plugged into the pod only the runtime knows",
        || has_link(&cluster.other, "net2") && cluster.address(OTHER_RECORD).is_some(),
    );
    let other_address = cluster.address(OTHER_RECORD).unwrap().to_string();
    assert_ne!(other_address, address);
    ping(&cluster.lan, &other_address);
    // A pod the runtime does not know is reported failed with the reason.
    wait_until("the status says applied and failed", || {
        let status = cluster.status();
        status.matched == 3
            && status.applied == 2
            && status.failed.iter().any(|f| {
                f.pod == UNKNOWN_POD
                    && f.reason.contains("did not attach pod default/pod-unknown")
                    && f.reason.contains("no ready sandbox")
            })
            && status
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "False" && c.reason == "Failed")
    });
    // (Only the pod Multus annotated gets an entry: see the operator.)
    wait_until("net2 in the pod's network-status", || {
        cluster
            .network_status(POD)
            .contains(&format!(r#""interface":"net2","ips":["{address}"]"#))
    });
    let record = cluster.record(RECORD).unwrap();
    let attached = record.status.unwrap().conditions;
    assert!(
        attached
            .iter()
            .any(|c| c.type_ == "Attached" && c.status == "True"),
        "{attached:?}"
    );

    cluster.remove_config();
    wait_until("its records gone", || {
        cluster.record(RECORD).is_none() && cluster.record(OTHER_RECORD).is_none()
    });
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while has_link(&pod, "net2") || has_link(&cluster.other, "net2") {
        assert!(
            std::time::Instant::now() < deadline,
            "net2 not removed; records {:?}",
            cluster
                .server
                .list::<FlatNetworkIP>()
                .iter()
                .map(|r| (
                    r.name_any(),
                    r.metadata.deletion_timestamp.clone(),
                    r.labels().clone()
                ))
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    wait_until("net2 out of the network-status", || {
        let status = cluster.network_status(POD);
        !status.contains("net2") && status.contains("eth0")
    });
    assert!(has_link(&pod, "eth1"), "the runtime's interface stays");
    let (ok, out) = cluster.cni("DEL", &pod);
    assert!(ok, "DEL: {out}");
    cluster.stop();
}

#[test]
fn a_kubernetes_agent_killed_while_hot_plugging_converges_after_restart() {
    let Some(mut cluster) = Cluster::running_for_test(
        "a_kubernetes_agent_killed_while_hot_plugging_converges_after_restart",
    ) else {
        return;
    };
    let pod = TestNetns::new("rkp-");
    attach_pod(&cluster, &pod);
    cluster.stop();
    // Dies once the interface exists, before its record is ready.
    cluster.start(Some("add-attached"));
    cluster.add_config();
    let status = cluster.agent.wait_for_exit();
    assert!(!status.success(), "the agent died at the crash point");

    cluster.start(None);
    wait_until("hot-plugged after the restart", || {
        has_link(&pod, "net2") && has_link(&cluster.other, "net2") && cluster.status().applied == 2
    });
    let address = cluster.address(RECORD).unwrap().to_string();
    ping(&cluster.lan, &address);
    cluster.remove_config();
    wait_until("removed", || {
        !has_link(&pod, "net2") && !has_link(&cluster.other, "net2")
    });
    let (ok, out) = cluster.cni("DEL", &pod);
    assert!(ok, "DEL: {out}");
    cluster.stop();
}

/// MTU of `ifname` in `ns`.
fn mtu_of(ns: &TestNetns, ifname: &str) -> u64 {
    let out: Value = serde_json::from_str(&ns.ip(&["-j", "link", "show", "dev", ifname])).unwrap();
    out[0]["mtu"].as_u64().unwrap()
}

#[test]
fn a_pod_network_config_sets_the_primary_mtu_mss_clamping_and_a_node_bridge_and_its_removal_undoes_them()
 {
    let Some(mut cluster) = Cluster::running_for_test(
        "a_pod_network_config_sets_the_primary_mtu_mss_clamping_and_a_node_bridge_and_its_removal_undoes_them",
    ) else {
        return;
    };
    // pod-other's eth0 is the cluster network's veth to the node; only
    // the container runtime knows its namespace.
    veth_pair(&cluster.node, "rkveth0", &cluster.other, "eth0");
    cluster.node.ip(&["link", "set", "rkveth0", "up"]);
    cluster.other.ip(&["link", "set", "eth0", "up"]);
    let mtus = || {
        (
            mtu_of(&cluster.other, "eth0"),
            mtu_of(&cluster.node, "rkveth0"),
        )
    };
    assert_eq!(mtus(), (1500, 1500));
    // pod-other and pod-unknown (which nobody can find) are selected.
    for name in [OTHER_POD, UNKNOWN_POD] {
        let mut pod = cluster
            .server
            .list::<Pod>()
            .into_iter()
            .find(|p| p.name_any() == name)
            .unwrap();
        pod.labels_mut().insert("mtu".into(), "jumbo".into());
        cluster.server.insert(&pod);
    }
    cluster.server.insert(
        &serde_json::from_value::<PodNetworkConfig>(json!({
            "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "PodNetworkConfig",
            "metadata": {"name": "jumbo", "namespace": "default"},
            "spec": {"podSelector": {"matchLabels": {"mtu": "jumbo"}},
                     "primary": {"mtu": 1400, "tcpMssClamp": true},
                     "bridges": [{"name": "rkbr0"}]}
        }))
        .unwrap(),
    );
    wait_until("eth0 and its peer at 1400", || mtus() == (1400, 1400));
    wait_until("the clamping programs on eth0", || {
        primary_programs(&cluster.other) == CLAMP_PROGRAMS
    });
    wait_until("the node's bridge made", || {
        has_link(&cluster.node, "rkbr0")
    });
    wait_until("pod-other applied, pod-unknown failed with why", || {
        let status = cluster.status();
        status.matched == 2
            && status.applied == 1
            && status.failed.iter().any(|f| {
                f.pod == UNKNOWN_POD
                    && f.reason.starts_with("spec.primary.mtu: node node-1: ")
                    && f.reason.contains("no ready sandbox")
            })
    });
    wait_until("the node's object counts both pods it reports", || {
        cluster
            .server
            .list::<FlatNetworkNodeConfig>()
            .first()
            .and_then(|c| c.status.clone())
            .is_some_and(|s| s.pod_count == 2 && s.pods.len() == 2)
    });
    wait_until("the pods' Events", || {
        has_event(&cluster, OTHER_POD, controller::reason::PRIMARY_MTU_SET, "")
            && has_event(
                &cluster,
                UNKNOWN_POD,
                controller::reason::PRIMARY_MTU_FAILED,
                "",
            )
    });

    // The configuration deleted: set back, the node's object gone.
    cluster
        .server
        .delete::<PodNetworkConfig>("default", "jumbo");
    wait_until("set back to 1500", || mtus() == (1500, 1500));
    wait_until("the clamping programs gone", || {
        primary_programs(&cluster.other).is_empty()
    });
    wait_until("the node's bridge removed", || {
        !has_link(&cluster.node, "rkbr0")
    });
    wait_until("the node's object gone", || {
        cluster.server.list::<FlatNetworkNodeConfig>().is_empty()
    });
    cluster.stop();
}

/// Whether pod `pod` has an Event with `reason` whose note contains `text`.
fn has_event(cluster: &Cluster, pod: &str, reason: &str, text: &str) -> bool {
    cluster
        .server
        .list::<k8s_openapi::api::events::v1::Event>()
        .iter()
        .any(|e| {
            e.reason.as_deref() == Some(reason)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(pod)
                && e.note.as_deref().is_some_and(|n| n.contains(text))
        })
}

#[test]
fn a_node_vlan_that_cannot_be_made_fails_each_matched_pod_naming_the_node_until_fixed() {
    let Some(mut cluster) = Cluster::running_for_test(
        "a_node_vlan_that_cannot_be_made_fails_each_matched_pod_naming_the_node_until_fixed",
    ) else {
        return;
    };
    let links = |spec: Value| {
        serde_json::from_value::<PodNetworkConfig>(json!({
            "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "PodNetworkConfig",
            "metadata": {"name": "links", "namespace": "default"},
            "spec": spec
        }))
        .unwrap()
    };
    // The master does not exist on the node: the agent reports it, and
    // the operator fails every matched pod (all three run on node-1).
    cluster.server.insert(&links(json!({
        "podSelector": {"matchLabels": {"app": "web"}},
        "vlans": [{"master": "rknosuch", "id": 200}]
    })));
    let why = "spec.vlans: node node-1: master rknosuch of VLAN rknosuch.200 does not exist on node node-1";
    wait_until("every matched pod failed with the node's reason", || {
        let status = cluster.status();
        status.matched == 3
            && status.applied == 0
            && status.failed_count == 3
            && status.failed.iter().all(|f| f.reason.starts_with(why))
    });
    let reported = cluster.server.list::<FlatNetworkNodeConfig>();
    let report = reported[0].status.as_ref().expect("the agent's report");
    assert_eq!(report.observed_generation, reported[0].metadata.generation);
    assert_eq!(report.links.len(), 1, "{report:?}");
    assert!(
        report.links[0]
            .failure
            .starts_with("master rknosuch of VLAN"),
        "{report:?}"
    );
    wait_until("a NodeLinksFailed Event on each pod", || {
        [POD, OTHER_POD, UNKNOWN_POD]
            .iter()
            .all(|pod| has_event(&cluster, pod, controller::reason::NODE_LINKS_FAILED, why))
    });
    assert!(!has_link(&cluster.node, "rknosuch.200"));

    // Fixed (a bridge instead, which this node can make): applied, the
    // failures gone, an Event saying so.
    cluster.server.insert(&links(json!({
        "podSelector": {"matchLabels": {"app": "web"}},
        "bridges": [{"name": "rkbr1"}]
    })));
    wait_until("every matched pod applied", || {
        let status = cluster.status();
        status.matched == 3 && status.applied == 3 && status.failed.is_empty()
    });
    assert!(has_link(&cluster.node, "rkbr1"));
    wait_until("a NodeLinksReady Event on each pod", || {
        [POD, OTHER_POD, UNKNOWN_POD].iter().all(|pod| {
            has_event(
                &cluster,
                pod,
                controller::reason::NODE_LINKS_READY,
                "node node-1",
            )
        })
    });

    cluster
        .server
        .delete::<PodNetworkConfig>("default", "links");
    wait_until("the bridge removed and the node's object gone", || {
        !has_link(&cluster.node, "rkbr1")
            && cluster.server.list::<FlatNetworkNodeConfig>().is_empty()
    });
    cluster.stop();
}
