//! One node in Kubernetes mode on a simulated LAN (root): the operator's
//! in-memory API server (over HTTP, with the allocation controllers and
//! the chart's agent RBAC), the real `flatnet-agent run` and the real
//! `flatnet-cni`, and the pod [`POD`] with an address allocated on subnet
//! `lan4` (network `flat4`).

use flatnet_k8s::api::FlatNetworkIP;
use flatnet_operator::allocation::fake_api::FakeApiServer;
use kube::ResourceExt;
use serde_json::{Value, json};

use crate::support::{
    TestNetns,
    agent::{FlatPodCluster, StandaloneAgent, assert_agent_authorized, serve_with_allocation},
    cni::run_cni,
    privileged, wait_until,
};

/// The node's name.
pub const NODE: &str = "node-1";
/// The pod: `run_cni` names the pod of container `c1` `default/pod-c1`.
pub const POD: &str = "pod-c1";
/// The pod's address, the first of `lan4`'s range.
pub const POD_ADDRESS: &str = "192.0.2.10";

/// The API server, the LAN, the node and its agent.
pub struct KubernetesNode {
    /// First field: the agent stops before the namespaces go.
    pub agent: StandaloneAgent,
    pub server: FakeApiServer,
    /// Runs the API server and the operator's controllers.
    _runtime: tokio::runtime::Runtime,
    _node: TestNetns,
    pub lan: TestNetns,
    _dir: tempfile::TempDir,
}

impl KubernetesNode {
    /// Started with namespaces named after `prefix`, the objects `setup`
    /// adds to the API server and the agent's flags `args`, once the pod's
    /// address is allocated; `None` when the test cannot run.
    pub fn running_for_test(
        test: &str,
        prefix: &str,
        setup: impl FnOnce(&FakeApiServer),
        args: &[&str],
    ) -> Option<Self> {
        if !privileged(test) {
            return None;
        }
        let FlatPodCluster {
            node,
            lan,
            dir,
            runtime,
            server,
            ..
        } = FlatPodCluster::new(prefix, "bridge", NODE, POD);
        setup(&server);
        let kubeconfig = dir.path().join("kubeconfig");
        serve_with_allocation(&runtime, &server, None, &kubeconfig);
        let cni_bin_dir = dir.path().join("bin").display().to_string();
        let mut all_args = vec!["--cni-bin-dir", &cni_bin_dir, "--floating-ip", "false"];
        all_args.extend_from_slice(args);
        let mut agent =
            StandaloneAgent::new(dir.path(), &node, &all_args).in_kubernetes(&kubeconfig, NODE);
        agent.start_until_status("flat4", None);
        let node = Self {
            agent,
            server,
            _runtime: runtime,
            _node: node,
            lan,
            _dir: dir,
        };
        wait_until("the pod's address allocated", || {
            node.record()
                .is_some_and(|r| r.status.is_some_and(|s| s.addr.is_some()))
        });
        Some(node)
    }

    /// Stops the agent; fails naming any request of it the chart's RBAC
    /// refused during the test.
    pub fn stop(&mut self) {
        self.agent.stop();
        assert_agent_authorized(&self.server);
    }

    /// The runtime's `command` (ADD, DEL) for the pod in `netns`: whether
    /// it succeeded, and the answer.
    pub fn cni(&self, command: &str, netns: &TestNetns) -> (bool, Value) {
        self.cni_with(command, netns, json!({}))
    }

    /// As [`KubernetesNode::cni`], with `extra` fields in the network
    /// configuration.
    pub fn cni_with(&self, command: &str, netns: &TestNetns, extra: Value) -> (bool, Value) {
        run_cni(
            &self.agent.socket(),
            command,
            "flat4",
            "c1",
            Some(&netns.path()),
            extra,
        )
    }

    /// The pod's FlatNetworkIP, as the API server holds it now.
    pub fn record(&self) -> Option<FlatNetworkIP> {
        self.server
            .list::<FlatNetworkIP>()
            .into_iter()
            .find(|r| r.name_any() == POD)
    }

    /// Whether a line of the agent's log so far satisfies `test`.
    pub fn agent_logged(&self, test: impl Fn(&str) -> bool) -> bool {
        std::fs::read_to_string(self.agent.log_file())
            .unwrap_or_default()
            .lines()
            .any(test)
    }

    /// Whether the LAN host's ping of the pod is answered.
    pub fn ping_answered(&self) -> bool {
        self.lan
            .try_exec("ping", &["-c", "1", "-W", "1", POD_ADDRESS])
    }
}
