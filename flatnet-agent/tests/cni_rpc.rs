//! End-to-end tests of the CNI path: the real `flatnet-cni` binary talks to a
//! real [`AgentServer`] on a temporary socket, served by a recording handler.

mod support;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use flatnet_agent::cni::{
    AttachRequest, CniError, CniResult, DetachRequest, ErrorCode, GcRequest, StatusRequest,
    ValidAttachment,
};
use flatnet_agent::rpc::frame::{read_frame, write_frame};
use flatnet_agent::rpc::{AgentResponse, AgentServer, CniHandler, ServerConfig, ServerError};
use proptest::prelude::*;
use serde_json::{Value, json};
use tokio::sync::oneshot;

/// What the test handler does when called.
#[derive(Clone)]
enum Behaviour {
    Succeed,
    Fail(CniError),
    Hang,
    Panic,
}

/// One call the handler received.
#[derive(Debug, Clone, PartialEq)]
struct Call {
    command: &'static str,
    container_id: Option<String>,
    pod: Option<String>,
    netns: Option<PathBuf>,
    valid: Vec<ValidAttachment>,
}

#[derive(Clone)]
struct RecordingHandler {
    behaviour: Behaviour,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl RecordingHandler {
    async fn answer<T>(&self, call: Call, value: T) -> Result<T, CniError> {
        self.calls.lock().unwrap().push(call);
        match &self.behaviour {
            Behaviour::Succeed => Ok(value),
            Behaviour::Fail(error) => Err(error.clone()),
            Behaviour::Hang => std::future::pending().await,
            Behaviour::Panic => panic!("handler failure requested by the test"),
        }
    }

    fn attach_call(command: &'static str, request: &AttachRequest) -> Call {
        Call {
            command,
            container_id: Some(request.attachment.container_id.clone()),
            pod: request.attachment.args.pod_name.clone(),
            netns: Some(request.netns.clone()),
            valid: Vec::new(),
        }
    }
}

fn add_result(netns: &Path) -> CniResult {
    serde_json::from_value(json!({
        "interfaces": [{"name": "eth1", "mac": "0a:58:0a:01:02:03", "sandbox": netns}],
        "ips": [{"address": "10.1.2.3/24", "gateway": "10.1.2.1", "interface": 0}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.2.1"}]
    }))
    .unwrap()
}

impl CniHandler for RecordingHandler {
    async fn add(&self, request: AttachRequest) -> Result<CniResult, CniError> {
        let result = add_result(&request.netns);
        self.answer(Self::attach_call("ADD", &request), result)
            .await
    }

    async fn check(&self, request: AttachRequest) -> Result<(), CniError> {
        assert!(
            request.config.prev_result.is_some(),
            "CHECK always carries prevResult"
        );
        self.answer(Self::attach_call("CHECK", &request), ()).await
    }

    async fn del(&self, request: DetachRequest) -> Result<(), CniError> {
        let call = Call {
            command: "DEL",
            container_id: Some(request.attachment.container_id.clone()),
            pod: request.attachment.args.pod_name.clone(),
            netns: request.netns.clone(),
            valid: Vec::new(),
        };
        self.answer(call, ()).await
    }

    async fn status(&self, _request: StatusRequest) -> Result<(), CniError> {
        let call = Call {
            command: "STATUS",
            container_id: None,
            pod: None,
            netns: None,
            valid: Vec::new(),
        };
        self.answer(call, ()).await
    }

    async fn gc(&self, request: GcRequest) -> Result<(), CniError> {
        let call = Call {
            command: "GC",
            container_id: None,
            pod: None,
            netns: None,
            valid: request.valid_attachments,
        };
        self.answer(call, ()).await
    }
}

/// A running agent server on a socket in a temporary directory.
struct TestAgent {
    dir: tempfile::TempDir,
    socket: PathBuf,
    calls: Arc<Mutex<Vec<Call>>>,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl TestAgent {
    fn start(behaviour: Behaviour) -> TestAgent {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("run/flatnet/agent.sock");
        let (agent, bound) = Self::start_at(dir, socket, behaviour);
        bound.unwrap();
        agent
    }

    /// Starts a server at `socket`; the second value is the outcome of `bind`.
    fn start_at(
        dir: tempfile::TempDir,
        socket: PathBuf,
        behaviour: Behaviour,
    ) -> (TestAgent, Result<(), ServerError>) {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let handler = RecordingHandler {
            behaviour,
            calls: Arc::clone(&calls),
        };
        let config = ServerConfig {
            socket_path: socket.clone(),
            ..ServerConfig::default()
        };
        let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                match AgentServer::bind(config, handler) {
                    Ok(server) => {
                        bound_tx.send(Ok(())).unwrap();
                        server
                            .serve(async {
                                let _ = shutdown_rx.await;
                            })
                            .await;
                    }
                    Err(error) => bound_tx.send(Err(error)).unwrap(),
                }
            });
        });
        let bound = bound_rx.recv().unwrap();
        let agent = TestAgent {
            dir,
            socket,
            calls,
            shutdown: Some(shutdown_tx),
            thread: Some(thread),
        };
        (agent, bound)
    }

    fn calls(&self) -> Vec<Call> {
        self.calls.lock().unwrap().clone()
    }

    /// Stops the server and waits for it to finish.
    fn stop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            thread.join().unwrap();
        }
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Output of one run of the binary.
struct Run {
    exit_ok: bool,
    stdout: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout {:?} is not JSON: {e}", self.stdout))
    }

    /// Asserts a failed run printed a spec error with `code`; returns the message.
    fn expect_error(&self, code: u32) -> String {
        assert!(!self.exit_ok, "expected a failure, stdout: {}", self.stdout);
        let error = self.json();
        assert_eq!(error["code"], code, "{error}");
        assert!(error["cniVersion"].is_string(), "{error}");
        error["msg"].as_str().unwrap().to_owned()
    }
}

fn run_cni(env: &[(&str, &str)], stdin: &[u8]) -> Run {
    let mut child = Command::new(env!("CARGO_BIN_EXE_flatnet-cni"))
        .env_clear()
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let output = child.wait_with_output().unwrap();
    Run {
        exit_ok: output.status.success(),
        stdout: String::from_utf8(output.stdout).unwrap(),
    }
}

const NETNS: &str = "/var/run/netns/pod1";

/// Environment for `command` on container `ctr1`, pointed at `socket`.
fn cni_env<'a>(command: &'a str, socket: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("CNI_COMMAND", command),
        ("CNI_CONTAINERID", "ctr1"),
        ("CNI_NETNS", NETNS),
        ("CNI_IFNAME", "eth1"),
        (
            "CNI_ARGS",
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_UID=u1",
        ),
        ("CNI_PATH", "/opt/cni/bin"),
        ("FLATNET_AGENT_SOCKET", socket),
    ]
}

fn config(version: &str) -> Value {
    json!({"cniVersion": version, "name": "flat-net", "type": "flatnet-cni", "subnet": "vlan10"})
}

fn socket_str(agent: &TestAgent) -> &str {
    agent.socket.to_str().unwrap()
}

#[test]
fn add_check_del_round_trip() {
    let agent = TestAgent::start(Behaviour::Succeed);
    let socket = socket_str(&agent);

    let add = run_cni(
        &cni_env("ADD", socket),
        config("1.0.0").to_string().as_bytes(),
    );
    assert!(add.exit_ok, "{}", add.stdout);
    let result = add.json();
    assert_eq!(result["cniVersion"], "1.0.0");
    assert_eq!(
        result["ips"][0],
        json!({"address": "10.1.2.3/24", "gateway": "10.1.2.1", "interface": 0})
    );
    assert_eq!(result["interfaces"][0]["sandbox"], NETNS);

    let mut check_config = config("1.0.0");
    check_config["prevResult"] = result;
    let check = run_cni(
        &cni_env("CHECK", socket),
        check_config.to_string().as_bytes(),
    );
    assert!(check.exit_ok && check.stdout.is_empty(), "{}", check.stdout);

    let del = run_cni(&cni_env("DEL", socket), check_config.to_string().as_bytes());
    assert!(del.exit_ok && del.stdout.is_empty(), "{}", del.stdout);

    let commands: Vec<_> = agent.calls().iter().map(|c| c.command).collect();
    assert_eq!(commands, ["ADD", "CHECK", "DEL"]);
    let add_call = &agent.calls()[0];
    assert_eq!(add_call.container_id.as_deref(), Some("ctr1"));
    assert_eq!(add_call.pod.as_deref(), Some("web-0"));
}

#[test]
fn del_without_netns_reaches_the_agent() {
    let agent = TestAgent::start(Behaviour::Succeed);
    let env: Vec<_> = cni_env("DEL", socket_str(&agent))
        .into_iter()
        .filter(|(k, _)| *k != "CNI_NETNS")
        .collect();
    let del = run_cni(&env, config("0.4.0").to_string().as_bytes());
    assert!(del.exit_ok, "{}", del.stdout);
    assert_eq!(agent.calls()[0].netns, None);
}

#[test]
fn add_result_is_converted_to_older_versions() {
    let agent = TestAgent::start(Behaviour::Succeed);
    for version in ["0.3.0", "0.3.1", "0.4.0"] {
        let add = run_cni(
            &cni_env("ADD", socket_str(&agent)),
            config(version).to_string().as_bytes(),
        );
        let result = add.json();
        assert_eq!(result["cniVersion"], version);
        assert_eq!(result["ips"][0]["version"], "4", "{result}");
    }
}

#[test]
fn version_is_answered_without_an_agent() {
    let run = run_cni(&[("CNI_COMMAND", "VERSION")], br#"{"cniVersion":"1.0.0"}"#);
    assert!(run.exit_ok);
    assert_eq!(
        run.json(),
        json!({"cniVersion": "1.0.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]})
    );
}

#[test]
fn status_reports_ready_and_not_ready() {
    let ready = TestAgent::start(Behaviour::Succeed);
    let status = run_cni(
        &[
            ("CNI_COMMAND", "STATUS"),
            ("FLATNET_AGENT_SOCKET", socket_str(&ready)),
        ],
        config("1.1.0").to_string().as_bytes(),
    );
    assert!(
        status.exit_ok && status.stdout.is_empty(),
        "{}",
        status.stdout
    );

    let not_ready = TestAgent::start(Behaviour::Fail(CniError::new(
        ErrorCode::PluginNotAvailable,
        "no subnets synced yet",
    )));
    let status = run_cni(
        &[
            ("CNI_COMMAND", "STATUS"),
            ("FLATNET_AGENT_SOCKET", socket_str(&not_ready)),
        ],
        config("1.1.0").to_string().as_bytes(),
    );
    assert_eq!(status.expect_error(50), "no subnets synced yet");
}

#[test]
fn gc_forwards_the_valid_attachments() {
    let agent = TestAgent::start(Behaviour::Succeed);
    let mut gc_config = config("1.1.0");
    gc_config["cni.dev/valid-attachments"] = json!([{"containerID": "ctr2", "ifname": "eth1"}]);
    let gc = run_cni(
        &[
            ("CNI_COMMAND", "GC"),
            ("FLATNET_AGENT_SOCKET", socket_str(&agent)),
        ],
        gc_config.to_string().as_bytes(),
    );
    assert!(gc.exit_ok, "{}", gc.stdout);
    assert_eq!(
        agent.calls()[0].valid,
        [ValidAttachment {
            container_id: "ctr2".into(),
            ifname: "eth1".into()
        }]
    );
}

#[test]
fn agent_down_is_try_again_later() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("agent.sock");
    let run = run_cni(
        &cni_env("ADD", missing.to_str().unwrap()),
        config("1.0.0").to_string().as_bytes(),
    );
    let msg = run.expect_error(11);
    assert!(msg.contains("DaemonSet"), "{msg}");

    // A socket file nobody listens on (an agent that crashed): refused, also 11.
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let run = run_cni(
        &cni_env("DEL", stale.to_str().unwrap()),
        config("1.0.0").to_string().as_bytes(),
    );
    run.expect_error(11);
}

#[test]
fn input_errors_have_their_spec_codes() {
    let agent = TestAgent::start(Behaviour::Succeed);
    let socket = socket_str(&agent);
    run_cni(&cni_env("ADD", socket), b"{not json").expect_error(6);
    run_cni(
        &cni_env("ADD", socket),
        config("0.2.0").to_string().as_bytes(),
    )
    .expect_error(1);
    run_cni(
        &cni_env("CHECK", socket),
        config("0.3.1").to_string().as_bytes(),
    )
    .expect_error(1);
    run_cni(
        &cni_env("STATUS", socket),
        config("1.0.0").to_string().as_bytes(),
    )
    .expect_error(1);
    let mut bad_mtu = config("1.0.0");
    bad_mtu["mtu"] = json!("large");
    run_cni(&cni_env("ADD", socket), bad_mtu.to_string().as_bytes()).expect_error(7);
    bad_mtu["mtu"] = json!(9);
    run_cni(&cni_env("ADD", socket), bad_mtu.to_string().as_bytes()).expect_error(2);

    let no_netns: Vec<_> = cni_env("ADD", socket)
        .into_iter()
        .filter(|(k, _)| *k != "CNI_NETNS")
        .collect();
    let msg = run_cni(&no_netns, config("1.0.0").to_string().as_bytes()).expect_error(4);
    assert!(msg.contains("CNI_NETNS"), "{msg}");
    run_cni(&[], config("1.0.0").to_string().as_bytes()).expect_error(4);
    let strict_args: Vec<_> = cni_env("ADD", socket)
        .into_iter()
        .map(|(k, v)| {
            if k == "CNI_ARGS" {
                (k, "K8S_POD_NAME=a;FOO=1")
            } else {
                (k, v)
            }
        })
        .collect();
    run_cni(&strict_args, config("1.0.0").to_string().as_bytes()).expect_error(4);

    assert!(
        agent.calls().is_empty(),
        "invalid requests must not reach the agent"
    );
}

/// `env` with `key` set to `value`.
fn with_var<'a>(
    env: Vec<(&'a str, &'a str)>,
    key: &'a str,
    value: &'a str,
) -> Vec<(&'a str, &'a str)> {
    env.into_iter()
        .map(|(k, v)| if k == key { (k, value) } else { (k, v) })
        .collect()
}

#[test]
fn names_no_add_accepts_are_refused_and_their_del_succeeds_without_the_agent() {
    let agent = TestAgent::start(Behaviour::Succeed);
    let socket = socket_str(&agent);
    let stdin = config("1.0.0").to_string();
    let long_id = "c".repeat(300);
    for (key, value) in [
        ("CNI_CONTAINERID", long_id.as_str()),
        ("CNI_CONTAINERID", "../../x"),
        ("CNI_IFNAME", "a/b"),
    ] {
        for command in ["ADD", "CHECK"] {
            let mut stdin = config("1.0.0");
            stdin["prevResult"] = json!({"cniVersion": "1.0.0"});
            let env = with_var(cni_env(command, socket), key, value);
            let msg = run_cni(&env, stdin.to_string().as_bytes()).expect_error(4);
            assert!(msg.contains(key), "{msg}");
        }
        let run = run_cni(
            &with_var(cni_env("DEL", socket), key, value),
            stdin.as_bytes(),
        );
        assert!(run.exit_ok, "DEL {key}={value}: {}", run.stdout);
        assert_eq!(run.stdout, "", "DEL prints nothing on success");
    }
    assert!(agent.calls().is_empty(), "{:?}", agent.calls());
}

/// Sends `request` (the JSON of a CNI request) straight to the agent socket,
/// as a peer other than flatnet-cni could.
fn send_raw(agent: &TestAgent, request: Value) -> AgentResponse {
    let mut stream = UnixStream::connect(&agent.socket).unwrap();
    let body = json!({"protocol": 1, "timeoutMs": 5000, "request": request});
    write_frame(&mut stream, body.to_string().as_bytes()).unwrap();
    serde_json::from_slice(&read_frame(&mut stream).unwrap()).unwrap()
}

#[test]
fn the_agent_refuses_names_that_would_leave_its_record_directory() {
    let agent = TestAgent::start(Behaviour::Succeed);
    let request = |command: &str, container_id: &str, ifname: &str, mac: &str| {
        json!({
            "command": command,
            "attachment": {"containerId": container_id, "ifname": ifname, "args": {}},
            "netns": NETNS,
            "config": {"cniVersion": "1.0.0", "name": "flat-net", "type": "flatnet-cni",
                       "runtimeConfig": {"mac": mac}},
        })
    };
    let long_id = "c".repeat(300);
    let good_mac = "0a:00:00:00:00:09";
    for (container_id, ifname, mac, code) in [
        ("../../x", "eth1", good_mac, 4),
        ("ctr1", "a/b", good_mac, 4),
        ("ctr1", "..", good_mac, 4),
        (long_id.as_str(), "eth1", good_mac, 4),
        ("ctr1", "eth1", "zz", 7),
    ] {
        let response = send_raw(&agent, request("ADD", container_id, ifname, mac));
        let AgentResponse::Failure { error } = response else {
            panic!("ADD {container_id} {ifname} {mac}: {response:?}");
        };
        assert_eq!(error.code.code(), code, "{error}");
        if code == 4 {
            let response = send_raw(&agent, request("DEL", container_id, ifname, good_mac));
            assert_eq!(response, AgentResponse::Success { result: None });
        }
    }
    assert!(agent.calls().is_empty(), "{:?}", agent.calls());
    let response = send_raw(&agent, request("ADD", "ctr1", "eth1", good_mac));
    assert!(
        matches!(response, AgentResponse::Success { .. }),
        "{response:?}"
    );
}

#[test]
fn a_runtime_mac_that_does_not_parse_is_error_7() {
    let agent = TestAgent::start(Behaviour::Succeed);
    let socket = socket_str(&agent);
    for bad in [
        "zz",
        "0a:00:00:00:00",
        "01:00:5e:00:00:01",
        "00:00:00:00:00:00",
    ] {
        let mut stdin = config("1.0.0");
        stdin["runtimeConfig"] = json!({"mac": bad});
        let msg = run_cni(&cni_env("ADD", socket), stdin.to_string().as_bytes()).expect_error(7);
        assert!(msg.contains("runtimeConfig.mac"), "{msg}");
    }
    assert!(agent.calls().is_empty(), "{:?}", agent.calls());
}

#[test]
fn handler_errors_pass_through_unchanged() {
    let error = CniError::new(
        ErrorCode::AddressNotAllocated,
        "no address allocated to default/web-0 yet",
    )
    .with_details("FlatNetworkIP default/web-0 has no status.addr");
    let agent = TestAgent::start(Behaviour::Fail(error));
    let run = run_cni(
        &cni_env("ADD", socket_str(&agent)),
        config("1.0.0").to_string().as_bytes(),
    );
    assert_eq!(
        run.expect_error(103),
        "no address allocated to default/web-0 yet"
    );
    assert_eq!(
        run.json()["details"],
        "FlatNetworkIP default/web-0 has no status.addr"
    );
}

#[test]
fn a_hanging_handler_is_cut_off_at_the_deadline() {
    let agent = TestAgent::start(Behaviour::Hang);
    let mut short = config("1.0.0");
    short["agentTimeoutSeconds"] = json!(1);
    let run = run_cni(
        &cni_env("ADD", socket_str(&agent)),
        short.to_string().as_bytes(),
    );
    run.expect_error(102);
}

#[test]
fn a_panicking_handler_is_an_internal_error() {
    let agent = TestAgent::start(Behaviour::Panic);
    let run = run_cni(
        &cni_env("ADD", socket_str(&agent)),
        config("1.0.0").to_string().as_bytes(),
    );
    run.expect_error(100);
    // The server survives the panic and keeps serving.
    run_cni(
        &cni_env("DEL", socket_str(&agent)),
        config("1.0.0").to_string().as_bytes(),
    )
    .expect_error(100);
}

#[test]
fn socket_is_root_only() {
    let agent = TestAgent::start(Behaviour::Succeed);
    let socket_mode = std::fs::metadata(&agent.socket)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(socket_mode, 0o600);
    let dir_mode = std::fs::metadata(agent.socket.parent().unwrap())
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(dir_mode, 0o700);
}

#[test]
fn another_uid_is_refused_even_through_an_opened_socket_mode() {
    if !support::privileged("another_uid_is_refused_even_through_an_opened_socket_mode") {
        return;
    }
    use std::os::unix::process::CommandExt;
    const NOBODY: u32 = 65534;
    let agent = TestAgent::start(Behaviour::Succeed);
    // Every obstacle but the peer check removed: the path is reachable and
    // the socket writable by anyone.
    let mut dir = agent.socket.parent();
    while let Some(d) = dir.filter(|d| d.starts_with(agent.dir.path())) {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir = d.parent();
    }
    std::fs::set_permissions(&agent.socket, std::fs::Permissions::from_mode(0o777)).unwrap();
    // The plugin binary where the other uid can run it.
    let binary = agent.dir.path().join("flatnet-cni");
    std::fs::copy(env!("CARGO_BIN_EXE_flatnet-cni"), &binary).unwrap();

    let mut child = Command::new(&binary)
        .env_clear()
        .envs(cni_env("ADD", socket_str(&agent)))
        .uid(NOBODY)
        .gid(NOBODY)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(config("1.0.0").to_string().as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    let run = Run {
        exit_ok: output.status.success(),
        stdout: String::from_utf8(output.stdout).unwrap(),
    };
    let msg = run.expect_error(5);
    assert!(msg.contains("serves only uid 0"), "{msg}");
    assert!(agent.calls().is_empty(), "{:?}", agent.calls());
    // The same request from root is served.
    let run = run_cni(
        &cni_env("ADD", socket_str(&agent)),
        config("1.0.0").to_string().as_bytes(),
    );
    assert!(run.exit_ok, "{}", run.stdout);
}

#[test]
fn startup_replaces_a_stale_socket_but_not_a_live_one_or_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let (mut first, bound) = TestAgent::start_at(dir, socket.clone(), Behaviour::Succeed);
    bound.expect("a stale socket is replaced");

    let (_second, bound) = TestAgent::start_at(
        tempfile::tempdir().unwrap(),
        socket.clone(),
        Behaviour::Succeed,
    );
    assert!(
        matches!(bound, Err(ServerError::AlreadyServing { .. })),
        "{bound:?}"
    );

    // Shutdown removes the socket file.
    first.stop();
    assert!(!socket.exists());

    std::fs::write(&socket, b"not a socket").unwrap();
    let (_third, bound) = TestAgent::start_at(
        tempfile::tempdir().unwrap(),
        socket.clone(),
        Behaviour::Succeed,
    );
    assert!(
        matches!(bound, Err(ServerError::NotASocket { .. })),
        "{bound:?}"
    );
    assert_eq!(std::fs::read(&socket).unwrap(), b"not a socket");
    drop(first);
}

#[test]
fn another_protocol_version_is_refused_with_101() {
    let agent = TestAgent::start(Behaviour::Succeed);
    let mut stream = UnixStream::connect(&agent.socket).unwrap();
    write_frame(
        &mut stream,
        br#"{"protocol": 99, "timeoutMs": 1000, "request": {}}"#,
    )
    .unwrap();
    let response: AgentResponse =
        serde_json::from_slice(&read_frame(&mut stream).unwrap()).unwrap();
    let AgentResponse::Failure { error } = response else {
        panic!("expected a failure, got {response:?}");
    };
    assert_eq!(error.code, ErrorCode::AgentProtocol);
    assert!(error.msg.contains("protocol 99"), "{}", error.msg);
}

#[test]
fn log_file_gets_the_log_and_stdout_stays_pure() {
    let agent = TestAgent::start(Behaviour::Succeed);
    let log = agent.dir.path().join("log/cni.log");
    let mut logged = config("1.0.0");
    logged["logFile"] = json!(log);
    logged["logLevel"] = json!("debug");
    let run = run_cni(
        &cni_env("ADD", socket_str(&agent)),
        logged.to_string().as_bytes(),
    );
    assert_eq!(run.json()["cniVersion"], "1.0.0");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.contains("forwarding to the agent"), "{text}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// The real binary answers arbitrary stdin with an error object (the
    /// agent is absent, so even a valid config ends in code 11).
    #[test]
    fn binary_answers_random_stdin_with_an_error_object(stdin in proptest::collection::vec(any::<u8>(), 0..256)) {
        let run = run_cni(&cni_env("ADD", "/nonexistent/flatnet/agent.sock"), &stdin);
        prop_assert!(!run.exit_ok);
        let error: Value = serde_json::from_str(&run.stdout).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert!(error["code"].as_u64().is_some_and(|c| [1, 2, 6, 7, 11].contains(&c)), "{}", error);
        prop_assert!(error["msg"].is_string());
        prop_assert!(error["cniVersion"].is_string());
    }
}
