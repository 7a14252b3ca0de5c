//! A validated plugin invocation: environment, `CNI_ARGS` and network
//! configuration combined into one request per command. This is what the
//! agent receives; VERSION never leaves flatnet-cni.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::args::CniArgs;
use super::config::{NetworkConfig, ValidAttachment};
use super::env::{CniCommand, CniEnv};
use super::error::{CniError, ErrorCode};
use super::names::check_attachment;
use super::version::CniVersion;

/// Identity of one attachment: a container's interface on a network.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Attachment {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// Parsed `CNI_ARGS` (pod namespace, name, UID).
    pub args: CniArgs,
    /// `CNI_PATH` (unused by flatnet, passed on for completeness).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cni_path: Vec<PathBuf>,
}

/// ADD or CHECK: the container's network namespace is known.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AttachRequest {
    /// The attachment.
    pub attachment: Attachment,
    /// `CNI_NETNS`.
    pub netns: PathBuf,
    /// The network configuration. For CHECK, `prev_result` is always set.
    pub config: NetworkConfig,
}

/// DEL: the namespace may already be gone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DetachRequest {
    /// The attachment.
    pub attachment: Attachment,
    /// `CNI_NETNS`, when the runtime still has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<PathBuf>,
    /// The network configuration (`prev_result` when the runtime cached it).
    pub config: NetworkConfig,
}

/// STATUS.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusRequest {
    /// The network configuration.
    pub config: NetworkConfig,
}

/// GC.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GcRequest {
    /// The network configuration.
    pub config: NetworkConfig,
    /// Attachments still in use on this network; everything else flatnet
    /// created for this network on this node may be released.
    pub valid_attachments: Vec<ValidAttachment>,
}

/// A request for the agent (every command but VERSION).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "command")]
pub enum CniRequest {
    /// ADD.
    #[serde(rename = "ADD")]
    Add(AttachRequest),
    /// CHECK.
    #[serde(rename = "CHECK")]
    Check(AttachRequest),
    /// DEL.
    #[serde(rename = "DEL")]
    Del(DetachRequest),
    /// STATUS.
    #[serde(rename = "STATUS")]
    Status(StatusRequest),
    /// GC.
    #[serde(rename = "GC")]
    Gc(GcRequest),
}

impl CniRequest {
    /// The command.
    pub fn command(&self) -> CniCommand {
        match self {
            CniRequest::Add(_) => CniCommand::Add,
            CniRequest::Check(_) => CniCommand::Check,
            CniRequest::Del(_) => CniCommand::Del,
            CniRequest::Status(_) => CniCommand::Status,
            CniRequest::Gc(_) => CniCommand::Gc,
        }
    }

    /// The network configuration.
    pub fn config(&self) -> &NetworkConfig {
        match self {
            CniRequest::Add(r) | CniRequest::Check(r) => &r.config,
            CniRequest::Del(r) => &r.config,
            CniRequest::Status(r) => &r.config,
            CniRequest::Gc(r) => &r.config,
        }
    }

    /// A short description for logs and error messages.
    pub fn describe(&self) -> String {
        let network = &self.config().name;
        match self {
            CniRequest::Add(r) | CniRequest::Check(r) => format!(
                "{} of container {} ({}) on network {network:?}",
                self.command(),
                r.attachment.container_id,
                r.attachment.ifname
            ),
            CniRequest::Del(r) => format!(
                "DEL of container {} ({}) on network {network:?}",
                r.attachment.container_id, r.attachment.ifname
            ),
            CniRequest::Status(_) | CniRequest::Gc(_) => {
                format!("{} of network {network:?}", self.command())
            }
        }
    }
}

/// What one execution of flatnet-cni must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Invocation {
    /// VERSION, answered locally; `requested` is the `cniVersion` on stdin, if any.
    Version {
        /// The version the runtime asked the answer to be written in.
        requested: Option<String>,
    },
    /// Anything else, forwarded to the agent (boxed: it is large and
    /// VERSION is not).
    Request(Box<CniRequest>),
    /// DEL of a container ID or interface name that no ADD accepts: nothing
    /// can exist, so DEL succeeds without asking the agent (a runtime
    /// retries a failed DEL forever). The error says why, for the log.
    NothingToDelete(CniError),
}

/// What the agent does with a request read from its socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Serve it.
    Serve,
    /// A DEL of names no ADD accepts: answer success without work; the
    /// error says why, for the log.
    NothingToDelete(CniError),
}

impl CniRequest {
    /// The agent's checks of a request from its socket, the same flatnet-cni
    /// made (a peer may not be flatnet-cni): the container ID and interface
    /// name of ADD, CHECK and DEL (they become file names) and the network
    /// configuration. Errors carry the codes flatnet-cni would give.
    pub fn admit(&self) -> Result<Admission, CniError> {
        self.config().validate()?;
        match self {
            CniRequest::Add(r) | CniRequest::Check(r) => {
                check_attachment(&r.attachment.container_id, &r.attachment.ifname)?;
            }
            CniRequest::Del(r) => {
                if let Err(reason) =
                    check_attachment(&r.attachment.container_id, &r.attachment.ifname)
                {
                    return Ok(Admission::NothingToDelete(reason));
                }
            }
            CniRequest::Status(_) | CniRequest::Gc(_) => {}
        }
        Ok(Admission::Serve)
    }
}

impl Invocation {
    /// Combines the environment and stdin into a request, checking what the
    /// specification requires per command:
    /// - CHECK needs cniVersion 0.4.0 or later and a `prevResult` (code 1 / 7);
    /// - STATUS and GC need 1.1.0 (code 1); GC needs `cni.dev/valid-attachments`
    ///   (code 7), because an absent list must never mean "nothing is in use".
    pub fn parse(env: &CniEnv, stdin: &[u8]) -> Result<Invocation, CniError> {
        if env.command == CniCommand::Version {
            return Ok(Invocation::Version {
                requested: declared_version(stdin),
            });
        }
        let args = CniArgs::parse(&env.args)?;
        let config = NetworkConfig::decode(stdin)?;
        let version = config.cni_version;
        let too_old = |since: CniVersion| {
            CniError::new(
                ErrorCode::IncompatibleVersion,
                format!(
                    "{} needs cniVersion {since} or later but network {:?} uses {version}",
                    env.command, config.name
                ),
            )
        };
        let attachment = || Attachment {
            // from_lookup guarantees these for ADD, CHECK and DEL.
            container_id: env.container_id.clone().unwrap_or_default(),
            ifname: env.ifname.clone().unwrap_or_default(),
            args: args.clone(),
            cni_path: env.path.clone(),
        };
        let request = match env.command {
            CniCommand::Version => unreachable!("VERSION returned above"),
            CniCommand::Add => CniRequest::Add(AttachRequest {
                attachment: attachment(),
                netns: env.netns.clone().unwrap_or_default(),
                config,
            }),
            CniCommand::Check => {
                if !version.has_check() {
                    return Err(too_old(CniVersion::V0_4_0));
                }
                if config.prev_result.is_none() {
                    return Err(CniError::new(
                        ErrorCode::InvalidNetworkConfig,
                        format!(
                            "CHECK of network {:?} needs prevResult, the result of the previous ADD",
                            config.name
                        ),
                    ));
                }
                CniRequest::Check(AttachRequest {
                    attachment: attachment(),
                    netns: env.netns.clone().unwrap_or_default(),
                    config,
                })
            }
            CniCommand::Del => {
                let attachment = attachment();
                if let Err(reason) = check_attachment(&attachment.container_id, &attachment.ifname)
                {
                    return Ok(Invocation::NothingToDelete(reason));
                }
                CniRequest::Del(DetachRequest {
                    attachment,
                    netns: env.netns.clone(),
                    config,
                })
            }
            CniCommand::Status => {
                if !version.has_status_and_gc() {
                    return Err(too_old(CniVersion::V1_1_0));
                }
                CniRequest::Status(StatusRequest { config })
            }
            CniCommand::Gc => {
                if !version.has_status_and_gc() {
                    return Err(too_old(CniVersion::V1_1_0));
                }
                if !config.has_valid_attachments() {
                    return Err(CniError::new(
                        ErrorCode::InvalidNetworkConfig,
                        format!(
                            "GC of network {:?} needs cni.dev/valid-attachments; refusing to treat every attachment as stale",
                            config.name
                        ),
                    ));
                }
                CniRequest::Gc(GcRequest {
                    valid_attachments: config.valid_attachments(),
                    config,
                })
            }
        };
        Ok(Invocation::Request(Box::new(request)))
    }
}

/// The `cniVersion` string on stdin, if stdin is a JSON object that has one.
/// Used for VERSION and to write errors in the caller's version; never fails.
pub fn declared_version(stdin: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    struct Declared {
        #[serde(rename = "cniVersion")]
        cni_version: Option<String>,
    }
    serde_json::from_slice::<Declared>(stdin).ok()?.cni_version
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::ffi::OsString;

    use serde_json::json;

    use super::*;

    fn env(command: &str) -> CniEnv {
        let map: HashMap<&str, &str> = HashMap::from([
            ("CNI_COMMAND", command),
            ("CNI_CONTAINERID", "ctr1"),
            ("CNI_NETNS", "/var/run/netns/p"),
            ("CNI_IFNAME", "eth1"),
            (
                "CNI_ARGS",
                "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod",
            ),
        ]);
        CniEnv::from_lookup(|k| map.get(k).map(OsString::from)).unwrap()
    }

    fn parse(command: &str, config: serde_json::Value) -> Result<Invocation, CniError> {
        Invocation::parse(&env(command), config.to_string().as_bytes())
    }

    fn request(command: &str, config: serde_json::Value) -> CniRequest {
        match parse(command, config).unwrap() {
            Invocation::Request(request) => *request,
            other => panic!("expected a request, got {other:?}"),
        }
    }

    #[test]
    fn add_carries_env_args_and_config() {
        let CniRequest::Add(add) = request(
            "ADD",
            json!({"cniVersion": "1.0.0", "name": "n", "type": "flatnet-cni"}),
        ) else {
            panic!("not an ADD");
        };
        assert_eq!(add.attachment.container_id, "ctr1");
        assert_eq!(add.attachment.ifname, "eth1");
        assert_eq!(add.attachment.args.pod_name.as_deref(), Some("pod"));
        assert_eq!(add.netns, PathBuf::from("/var/run/netns/p"));
    }

    #[test]
    fn version_ignores_unreadable_stdin() {
        assert_eq!(
            Invocation::parse(&env("VERSION"), b"not json").unwrap(),
            Invocation::Version { requested: None }
        );
        assert_eq!(
            Invocation::parse(&env("VERSION"), br#"{"cniVersion":"0.4.0"}"#).unwrap(),
            Invocation::Version {
                requested: Some("0.4.0".into())
            }
        );
    }

    #[test]
    fn check_needs_0_4_0_and_prev_result() {
        let error = parse(
            "CHECK",
            json!({"cniVersion": "0.3.1", "name": "n", "type": "t", "prevResult": {}}),
        )
        .unwrap_err();
        assert_eq!(error.code, ErrorCode::IncompatibleVersion);
        let error = parse(
            "CHECK",
            json!({"cniVersion": "1.0.0", "name": "n", "type": "t"}),
        )
        .unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidNetworkConfig);
        let prev = json!({"cniVersion": "1.0.0", "ips": [{"address": "10.0.0.2/24", "interface": 0}],
                          "interfaces": [{"name": "eth1", "sandbox": "/var/run/netns/p"}]});
        let CniRequest::Check(check) = request(
            "CHECK",
            json!({"cniVersion": "1.0.0", "name": "n", "type": "t", "prevResult": prev}),
        ) else {
            panic!("not a CHECK");
        };
        assert_eq!(check.config.prev_result.unwrap().ips.len(), 1);
    }

    #[test]
    fn status_and_gc_need_1_1_0() {
        for command in ["STATUS", "GC"] {
            let error = parse(
                command,
                json!({"cniVersion": "1.0.0", "name": "n", "type": "t",
                "cni.dev/valid-attachments": []}),
            )
            .unwrap_err();
            assert_eq!(error.code, ErrorCode::IncompatibleVersion, "{command}");
        }
        assert_eq!(
            request(
                "STATUS",
                json!({"cniVersion": "1.1.0", "name": "n", "type": "t"})
            )
            .command(),
            CniCommand::Status
        );
    }

    #[test]
    fn gc_without_valid_attachments_is_refused() {
        let error = parse(
            "GC",
            json!({"cniVersion": "1.1.0", "name": "n", "type": "t"}),
        )
        .unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidNetworkConfig);
        let CniRequest::Gc(gc) = request(
            "GC",
            json!({"cniVersion": "1.1.0", "name": "n", "type": "t",
            "cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth1"}]}),
        ) else {
            panic!("not a GC");
        };
        assert_eq!(
            gc.valid_attachments,
            [ValidAttachment {
                container_id: "a".into(),
                ifname: "eth1".into()
            }]
        );
    }

    #[test]
    fn del_of_names_no_add_accepts_has_nothing_to_delete() {
        let long = "c".repeat(300);
        for (id, ifname) in [
            (long.as_str(), "eth1"),
            ("ctr1", "a/b"),
            ("../../x", "eth1"),
        ] {
            let map: HashMap<&str, &str> = HashMap::from([
                ("CNI_COMMAND", "DEL"),
                ("CNI_CONTAINERID", id),
                ("CNI_IFNAME", ifname),
            ]);
            let env = CniEnv::from_lookup(|k| map.get(k).map(OsString::from)).unwrap();
            let config = json!({"cniVersion": "1.0.0", "name": "n", "type": "t"});
            let parsed = Invocation::parse(&env, config.to_string().as_bytes()).unwrap();
            let Invocation::NothingToDelete(reason) = parsed else {
                panic!("{id} {ifname}: {parsed:?}");
            };
            assert_eq!(reason.code, ErrorCode::InvalidEnvironment);
        }
    }

    #[test]
    fn the_agent_admits_only_what_flatnet_cni_would_send() {
        let mut add = request(
            "ADD",
            json!({"cniVersion": "1.0.0", "name": "n", "type": "t"}),
        );
        assert_eq!(add.admit(), Ok(Admission::Serve));
        let CniRequest::Add(inner) = &mut add else {
            panic!("not an ADD")
        };
        inner.attachment.container_id = "../../x".into();
        assert_eq!(add.admit().unwrap_err().code, ErrorCode::InvalidEnvironment);
        let CniRequest::Add(inner) = &mut add else {
            panic!("not an ADD")
        };
        inner.attachment.container_id = "ctr1".into();
        inner.attachment.ifname = "a/b".into();
        assert_eq!(add.admit().unwrap_err().code, ErrorCode::InvalidEnvironment);

        let mut del = request(
            "DEL",
            json!({"cniVersion": "1.0.0", "name": "n", "type": "t"}),
        );
        let CniRequest::Del(inner) = &mut del else {
            panic!("not a DEL")
        };
        inner.attachment.container_id = "c".repeat(300);
        assert!(matches!(del.admit(), Ok(Admission::NothingToDelete(_))));

        let bad_mac = request(
            "ADD",
            json!({"cniVersion": "1.0.0", "name": "n", "type": "t",
                   "runtimeConfig": {"mac": "0a:00:00:00:00:09"}}),
        );
        assert_eq!(bad_mac.admit(), Ok(Admission::Serve));
        let CniRequest::Add(mut inner) = bad_mac else {
            panic!("not an ADD")
        };
        inner.config.runtime_config.as_mut().unwrap().mac = Some("zz".into());
        let error = CniRequest::Add(inner).admit().unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidNetworkConfig, "{error}");
    }

    #[test]
    fn request_wire_form_is_tagged_by_command() {
        let request = request(
            "DEL",
            json!({"cniVersion": "0.4.0", "name": "n", "type": "t"}),
        );
        let wire = serde_json::to_value(&request).unwrap();
        assert_eq!(wire["command"], "DEL");
        assert_eq!(wire["attachment"]["containerId"], "ctr1");
        let back: CniRequest = serde_json::from_value(wire).unwrap();
        assert_eq!(back, request);
    }
}
