//! The node's readiness heartbeat written by the real `flatnet-agent run`
//! in Kubernetes mode, against the operator's in-memory API server served
//! over HTTP: `Ready` once it serves, `Stopping` on SIGTERM, and
//! `ProgramsNotLoaded` with the error when its eBPF programs cannot be
//! loaded (a pin root off the BPF filesystem), written before it exits.
//! The agent's requests are authorized by the chart's rules for its
//! ServiceAccount, as a real API server does: none may be refused.

mod support;

use std::path::Path;

use flatnet_k8s::agent_heartbeat::{
    self, Heartbeat, REASON_PROGRAMS_NOT_LOADED, REASON_READY, REASON_STOPPING,
};
use flatnet_operator::allocation::{fake_api::FakeApiServer, fake_api_http};
use k8s_openapi::{api::coordination::v1::Lease, jiff::Timestamp};
use support::{
    TestNetns,
    agent::{StandaloneAgent, as_agent, assert_agent_authorized, write_kubeconfig},
    privileged,
};

const NODE: &str = "node-hb";
const NAMESPACE: &str = "flatnet";

/// The API server over HTTP, on its own runtime.
struct Api {
    server: FakeApiServer,
    _runtime: tokio::runtime::Runtime,
    kubeconfig: std::path::PathBuf,
}

impl Api {
    fn start(dir: &Path) -> Self {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let server = FakeApiServer::new();
        // The chart installed in NAMESPACE, the agent's ServiceAccount.
        let agent = as_agent(&server, NAMESPACE);
        let address = runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let address = listener.local_addr().unwrap();
            tokio::spawn(fake_api_http::serve(agent, listener));
            address
        });
        let kubeconfig = dir.join("kubeconfig");
        write_kubeconfig(&kubeconfig, &format!("http://{address}"));
        Self {
            server,
            _runtime: runtime,
            kubeconfig,
        }
    }

    /// The node's heartbeat, if written, and the Lease it is in.
    fn heartbeat(&self) -> Option<(Heartbeat, Lease)> {
        self.server.list::<Lease>().into_iter().find_map(|lease| {
            (lease.metadata.name.as_deref() == Some(&agent_heartbeat::lease_name(NODE))
                && lease.metadata.namespace.as_deref() == Some(NAMESPACE))
            .then(|| agent_heartbeat::read(&lease).map(|h| (h, lease)))?
        })
    }

    /// Fails naming every request the chart's rules refused the agent.
    fn assert_nothing_refused(&self) {
        assert_agent_authorized(&self.server);
    }

    fn says(&self, reason: &str) -> bool {
        self.heartbeat()
            .is_some_and(|(h, _)| h.readiness.reason == reason)
    }
}

fn agent(dir: &Path, node: &TestNetns, api: &Api) -> StandaloneAgent {
    let cni_bin_dir = dir.join("bin").display().to_string();
    // No container runtime here: looked up only for hot-plugging.
    let cri_socket = dir.join("cri.sock").display().to_string();
    StandaloneAgent::new(
        dir,
        node,
        &[
            "--cni-bin-dir",
            &cni_bin_dir,
            "--floating-ip",
            "false",
            "--cri-socket",
            &cri_socket,
        ],
    )
    .in_kubernetes(&api.kubeconfig, NODE)
}

#[test]
fn a_serving_agent_says_ready_and_stopping() {
    if !privileged("a_serving_agent_says_ready_and_stopping") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let api = Api::start(dir.path());
    let node = TestNetns::new("hb-");
    let mut agent = agent(dir.path(), &node, &api);
    agent.start(Some(("POD_NAMESPACE", NAMESPACE)), |_| {
        api.says(REASON_READY)
    });
    let (ready, _) = api.heartbeat().unwrap();
    assert!(ready.readiness.ready, "{ready:?}");
    assert!(ready.is_fresh(Timestamp::now()), "{ready:?}");
    assert_eq!(ready.node, NODE);

    agent.stop();
    let (stopping, _) = api.heartbeat().unwrap();
    assert_eq!(
        (stopping.readiness.ready, stopping.readiness.reason.as_str()),
        (false, REASON_STOPPING),
        "the last word of an agent shut down: {stopping:?}"
    );
    api.assert_nothing_refused();
}

#[test]
fn an_agent_that_cannot_load_its_programs_says_why_before_exiting() {
    if !privileged("an_agent_that_cannot_load_its_programs_says_why_before_exiting") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let api = Api::start(dir.path());
    let node = TestNetns::new("hbf-");
    let mut agent = agent(dir.path(), &node, &api);
    // Pins can only live on the BPF filesystem: loading fails.
    let off_bpffs = dir.path().join("not-bpffs");
    std::fs::create_dir_all(&off_bpffs).unwrap();
    agent.pin.path = off_bpffs;
    agent.start(Some(("POD_NAMESPACE", NAMESPACE)), |_| {
        api.says(REASON_PROGRAMS_NOT_LOADED)
    });
    let status = agent.wait_for_exit();
    assert!(!status.success(), "the agent exits: {status}");
    let (failed, lease) = api.heartbeat().unwrap();
    assert!(!failed.readiness.ready);
    assert!(
        failed.readiness.message.contains("eBPF programs")
            && failed.readiness.message.contains("bpf filesystem"),
        "{failed:?}"
    );
    assert_eq!(
        lease.metadata.labels.unwrap()[agent_heartbeat::LABEL],
        "true"
    );
    api.assert_nothing_refused();
}
