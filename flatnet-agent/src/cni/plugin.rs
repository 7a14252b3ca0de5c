//! What one run of the `flatnet-cni` binary does, independent of the
//! process: environment and stdin in, stdout text and exit code out.
//! VERSION is answered here; every other command goes to the agent.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::config::NetworkConfig;
use super::env::{CniCommand, CniEnv};
use super::error::{CniError, ErrorCode};
use super::request::{CniRequest, Invocation, declared_version};
use super::result::CniResult;
use super::version::{CniVersion, VersionInfo};

/// Environment variable that overrides the agent socket path.
pub const AGENT_SOCKET_ENV: &str = "FLATNET_AGENT_SOCKET";
/// Where the agent listens unless configured otherwise.
pub const DEFAULT_AGENT_SOCKET: &str = "/run/flatnet/agent.sock";
/// How long flatnet-cni waits for the agent unless `agentTimeoutSeconds` says otherwise.
/// ADD may wait for the operator to allocate an address, so this is generous.
pub const DEFAULT_AGENT_TIMEOUT: Duration = Duration::from_secs(60);

/// Where and how long to talk to the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentEndpoint {
    /// The agent's unix socket.
    pub socket: PathBuf,
    /// The whole exchange must finish within this time.
    pub timeout: Duration,
}

impl AgentEndpoint {
    /// The socket is `$FLATNET_AGENT_SOCKET`, else `agentSocket`, else the
    /// default: the variable wins so an operator can point a hand-run
    /// plugin (cnitool) at a test agent without editing the network.
    pub fn resolve(config: &NetworkConfig, socket_override: Option<OsString>) -> AgentEndpoint {
        let socket = socket_override
            .filter(|s| !s.is_empty())
            .map(PathBuf::from)
            .or_else(|| config.agent_socket.clone())
            .unwrap_or_else(|| PathBuf::from(DEFAULT_AGENT_SOCKET));
        let timeout = config
            .agent_timeout_seconds
            .map(Duration::from_secs)
            .unwrap_or(DEFAULT_AGENT_TIMEOUT);
        AgentEndpoint { socket, timeout }
    }
}

/// A way to deliver a request to the agent (the unix socket client in the
/// binary, a fake in tests).
pub trait AgentConnection {
    /// Sends `request` and returns the agent's result (ADD) or nothing.
    fn send(
        &self,
        endpoint: &AgentEndpoint,
        request: &CniRequest,
    ) -> Result<Option<CniResult>, CniError>;
}

/// What the binary prints and how it exits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginOutput {
    /// Text for stdout: a result, version info, an error, or nothing.
    pub stdout: String,
    /// 0 on success, 1 on error (stdout then holds the error JSON).
    pub exit_code: i32,
}

/// Runs one CNI invocation.
pub fn run(
    lookup: impl Fn(&str) -> Option<OsString>,
    stdin: &[u8],
    agent: &dyn AgentConnection,
) -> PluginOutput {
    match execute(&lookup, stdin, agent) {
        Ok(Some(json)) => PluginOutput {
            stdout: json.to_string(),
            exit_code: 0,
        },
        Ok(None) => PluginOutput {
            stdout: String::new(),
            exit_code: 0,
        },
        Err(error) => {
            // Errors are written in the caller's version when it is one we
            // speak; otherwise (including code 1) in the newest.
            let version = declared_version(stdin)
                .and_then(|v| v.parse().ok())
                .unwrap_or(CniVersion::LATEST);
            tracing::warn!(code = error.code.code(), msg = %error.msg, details = %error.details, "CNI request failed");
            PluginOutput {
                stdout: error.to_json(version).to_string(),
                exit_code: 1,
            }
        }
    }
}

fn execute(
    lookup: &impl Fn(&str) -> Option<OsString>,
    stdin: &[u8],
    agent: &dyn AgentConnection,
) -> Result<Option<serde_json::Value>, CniError> {
    let env = CniEnv::from_lookup(lookup)?;
    let request = match Invocation::parse(&env, stdin)? {
        Invocation::Version { requested } => {
            let info = VersionInfo::new(requested.as_deref());
            return Ok(Some(serde_json::json!(info)));
        }
        Invocation::Request(request) => request,
        Invocation::NothingToDelete(reason) => {
            tracing::info!(reason = %reason.msg, "DEL of an attachment that cannot exist: nothing to do");
            return Ok(None);
        }
    };
    let endpoint = AgentEndpoint::resolve(request.config(), lookup(AGENT_SOCKET_ENV));
    tracing::info!(request = %request.describe(), socket = %endpoint.socket.display(), "forwarding to the agent");
    let result = agent.send(&endpoint, &request)?;
    match (request.command(), result) {
        (CniCommand::Add, Some(result)) => Ok(Some(result.to_json(request.config().cni_version))),
        (CniCommand::Add, None) => Err(CniError::new(
            ErrorCode::AgentProtocol,
            format!(
                "the agent answered {} without a result; flatnet-cni and flatnet-agent versions differ",
                request.describe()
            ),
        )),
        // CHECK, DEL, STATUS and GC print nothing on success.
        _ => Ok(None),
    }
}

/// Log settings read from stdin before anything else, so the binary can open
/// its log file even when the configuration later turns out invalid.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LogSettings {
    /// `logFile`.
    pub log_file: PathBuf,
    /// `logLevel`, `info` when absent.
    #[serde(default = "default_log_level")]
    pub log_level: String,
}

fn default_log_level() -> String {
    "info".into()
}

impl LogSettings {
    /// The settings, when stdin is a JSON object with a string `logFile`.
    pub fn peek(stdin: &[u8]) -> Option<LogSettings> {
        serde_json::from_slice(stdin).ok()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::HashMap;

    use proptest::prelude::*;
    use serde_json::{Value, json};

    use super::*;

    /// Records what it was asked and answers with a fixed reply.
    struct FakeAgent {
        reply: Result<Option<CniResult>, CniError>,
        seen: RefCell<Vec<(AgentEndpoint, CniCommand)>>,
    }

    impl FakeAgent {
        fn answering(reply: Result<Option<CniResult>, CniError>) -> Self {
            FakeAgent {
                reply,
                seen: RefCell::new(Vec::new()),
            }
        }
    }

    impl AgentConnection for FakeAgent {
        fn send(
            &self,
            endpoint: &AgentEndpoint,
            request: &CniRequest,
        ) -> Result<Option<CniResult>, CniError> {
            self.seen
                .borrow_mut()
                .push((endpoint.clone(), request.command()));
            self.reply.clone()
        }
    }

    fn env(pairs: &[(&'static str, &'static str)]) -> impl Fn(&str) -> Option<OsString> {
        let map: HashMap<&str, &str> = pairs.iter().copied().collect();
        move |k| map.get(k).map(OsString::from)
    }

    const ADD_ENV: [(&str, &str); 4] = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "c1"),
        ("CNI_NETNS", "/var/run/netns/p"),
        ("CNI_IFNAME", "eth1"),
    ];

    fn result() -> CniResult {
        serde_json::from_value(json!({"ips": [{"address": "10.0.0.5/24", "interface": 0}],
                                      "interfaces": [{"name": "eth1"}]}))
        .unwrap()
    }

    fn stdout_json(output: &PluginOutput) -> Value {
        serde_json::from_str(&output.stdout).unwrap()
    }

    #[test]
    fn add_prints_the_result_in_the_config_version() {
        let agent = FakeAgent::answering(Ok(Some(result())));
        let output = run(
            env(&ADD_ENV),
            br#"{"cniVersion":"0.4.0","name":"n","type":"t"}"#,
            &agent,
        );
        assert_eq!(output.exit_code, 0);
        let printed = stdout_json(&output);
        assert_eq!(printed["cniVersion"], "0.4.0");
        assert_eq!(printed["ips"][0]["version"], "4");
    }

    #[test]
    fn version_is_answered_without_the_agent() {
        let agent = FakeAgent::answering(Err(CniError::new(
            ErrorCode::AgentInternal,
            "must not be called",
        )));
        let output = run(env(&[("CNI_COMMAND", "VERSION")]), b"", &agent);
        assert_eq!(output.exit_code, 0);
        assert_eq!(stdout_json(&output)["supportedVersions"][4], "1.1.0");
        assert!(agent.seen.borrow().is_empty());
    }

    #[test]
    fn del_prints_nothing_on_success() {
        let agent = FakeAgent::answering(Ok(None));
        let output = run(
            env(&[
                ("CNI_COMMAND", "DEL"),
                ("CNI_CONTAINERID", "c1"),
                ("CNI_IFNAME", "eth1"),
            ]),
            br#"{"cniVersion":"1.0.0","name":"n","type":"t"}"#,
            &agent,
        );
        assert_eq!(
            output,
            PluginOutput {
                stdout: String::new(),
                exit_code: 0
            }
        );
    }

    #[test]
    fn agent_errors_are_printed_in_the_config_version() {
        let agent =
            FakeAgent::answering(Err(CniError::new(ErrorCode::TryAgainLater, "agent down")));
        let output = run(
            env(&ADD_ENV),
            br#"{"cniVersion":"1.0.0","name":"n","type":"t"}"#,
            &agent,
        );
        assert_eq!(output.exit_code, 1);
        assert_eq!(
            stdout_json(&output),
            json!({"cniVersion": "1.0.0", "code": 11, "msg": "agent down"})
        );
    }

    #[test]
    fn add_without_a_result_is_a_protocol_error() {
        let agent = FakeAgent::answering(Ok(None));
        let output = run(
            env(&ADD_ENV),
            br#"{"cniVersion":"1.0.0","name":"n","type":"t"}"#,
            &agent,
        );
        assert_eq!(stdout_json(&output)["code"], 101);
    }

    #[test]
    fn socket_override_order_is_env_then_config_then_default() {
        let agent = FakeAgent::answering(Ok(Some(result())));
        let config = br#"{"cniVersion":"1.0.0","name":"n","type":"t","agentSocket":"/cfg.sock","agentTimeoutSeconds":5}"#;
        run(env(&ADD_ENV), config, &agent);
        let mut with_env = ADD_ENV.to_vec();
        with_env.push((AGENT_SOCKET_ENV, "/env.sock"));
        run(env(&with_env), config, &agent);
        run(
            env(&ADD_ENV),
            br#"{"cniVersion":"1.0.0","name":"n","type":"t"}"#,
            &agent,
        );
        let seen: Vec<_> = agent
            .seen
            .borrow()
            .iter()
            .map(|(e, _)| (e.socket.clone(), e.timeout))
            .collect();
        assert_eq!(
            seen,
            [
                (PathBuf::from("/cfg.sock"), Duration::from_secs(5)),
                (PathBuf::from("/env.sock"), Duration::from_secs(5)),
                (PathBuf::from(DEFAULT_AGENT_SOCKET), DEFAULT_AGENT_TIMEOUT),
            ]
        );
    }

    #[test]
    fn log_settings_are_read_from_any_object_with_log_file() {
        assert_eq!(
            LogSettings::peek(br#"{"logFile":"/var/log/f.log","cniVersion":"9"}"#),
            Some(LogSettings {
                log_file: "/var/log/f.log".into(),
                log_level: "info".into()
            })
        );
        assert_eq!(LogSettings::peek(br#"{"name":"n"}"#), None);
        assert_eq!(LogSettings::peek(b"garbage"), None);
    }

    /// Asserts `output` is a spec-shaped error object.
    fn assert_error_shape(output: &PluginOutput) -> Result<(), TestCaseError> {
        prop_assert_eq!(output.exit_code, 1);
        let printed: Value =
            serde_json::from_str(&output.stdout).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let object = printed
            .as_object()
            .ok_or_else(|| TestCaseError::fail("not an object"))?;
        prop_assert!(
            object["cniVersion"]
                .as_str()
                .is_some_and(|v| v.parse::<CniVersion>().is_ok())
        );
        prop_assert!(object["code"].as_u64().is_some());
        prop_assert!(object["msg"].as_str().is_some_and(|m| !m.is_empty()));
        prop_assert!(
            object
                .keys()
                .all(|k| ["cniVersion", "code", "msg", "details"].contains(&k.as_str()))
        );
        Ok(())
    }

    proptest! {
        /// Any bytes on stdin give a spec-shaped error (or, for the rare
        /// valid config, reach the agent); nothing panics.
        #[test]
        fn random_stdin_yields_an_error_object(stdin in proptest::collection::vec(any::<u8>(), 0..512)) {
            let agent = FakeAgent::answering(Ok(Some(result())));
            let output = run(env(&ADD_ENV), &stdin, &agent);
            if agent.seen.borrow().is_empty() {
                assert_error_shape(&output)?;
            }
        }

        /// Random JSON objects with CNI-looking keys exercise the decoder past
        /// the JSON syntax check.
        #[test]
        fn random_config_objects_yield_an_error_or_a_request(
            version in prop_oneof![Just(json!("1.0.0")), Just(json!("0.2.0")), Just(json!(1)), Just(Value::Null)],
            name in prop_oneof![Just(json!("net")), Just(json!("")), Just(json!(5))],
            mtu in prop_oneof![Just(json!(1500)), Just(json!("x")), Just(json!(-1)), Just(json!(1))],
            command in prop_oneof![Just("ADD"), Just("CHECK"), Just("DEL"), Just("STATUS"), Just("GC")],
        ) {
            let stdin = json!({"cniVersion": version, "name": name, "type": "t", "mtu": mtu}).to_string();
            let agent = FakeAgent::answering(Ok(Some(result())));
            let pairs = [
                ("CNI_COMMAND", command),
                ("CNI_CONTAINERID", "c1"),
                ("CNI_NETNS", "/var/run/netns/p"),
                ("CNI_IFNAME", "eth1"),
            ];
            let output = run(env(&pairs), stdin.as_bytes(), &agent);
            if agent.seen.borrow().is_empty() {
                assert_error_shape(&output)?;
            } else {
                prop_assert_eq!(output.exit_code, 0);
            }
        }
    }
}
