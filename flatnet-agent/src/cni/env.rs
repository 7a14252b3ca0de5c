//! The `CNI_*` environment variables and the command they select.

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::error::{CniError, ErrorCode};
use super::names::{check_container_id, check_ifname};

/// A CNI command (`CNI_COMMAND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum CniCommand {
    /// Attach the container to the network.
    Add,
    /// Detach the container and release its resources.
    Del,
    /// Verify an attachment still matches `prevResult`.
    Check,
    /// Report whether the plugin can serve ADD (1.1.0).
    Status,
    /// Release resources of attachments the runtime no longer knows (1.1.0).
    Gc,
    /// Report supported specification versions.
    Version,
}

impl CniCommand {
    /// Every command, in the order they are documented.
    pub const ALL: [CniCommand; 6] = [
        CniCommand::Add,
        CniCommand::Del,
        CniCommand::Check,
        CniCommand::Status,
        CniCommand::Gc,
        CniCommand::Version,
    ];

    /// The name as written in `CNI_COMMAND`.
    pub fn as_str(self) -> &'static str {
        match self {
            CniCommand::Add => "ADD",
            CniCommand::Del => "DEL",
            CniCommand::Check => "CHECK",
            CniCommand::Status => "STATUS",
            CniCommand::Gc => "GC",
            CniCommand::Version => "VERSION",
        }
    }

    /// The variables the specification requires for this command besides
    /// `CNI_COMMAND`. `CNI_PATH` is never required: flatnet-cni execs nothing.
    pub fn required_variables(self) -> &'static [&'static str] {
        match self {
            CniCommand::Add | CniCommand::Check => &[CONTAINER_ID, NETNS, IFNAME],
            // DEL must succeed without a netns: the container may be gone.
            CniCommand::Del => &[CONTAINER_ID, IFNAME],
            CniCommand::Status | CniCommand::Gc | CniCommand::Version => &[],
        }
    }
}

impl fmt::Display for CniCommand {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CniCommand {
    type Err = CniError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.iter().map(|c| c.as_str()).collect();
                CniError::new(
                    ErrorCode::InvalidEnvironment,
                    format!(
                        "CNI_COMMAND {s:?} is not a CNI command; expected one of {}",
                        names.join(", ")
                    ),
                )
            })
    }
}

const COMMAND: &str = "CNI_COMMAND";
const CONTAINER_ID: &str = "CNI_CONTAINERID";
const NETNS: &str = "CNI_NETNS";
const IFNAME: &str = "CNI_IFNAME";
const ARGS: &str = "CNI_ARGS";
const PATH: &str = "CNI_PATH";

/// The `CNI_*` variables, read and checked for the selected command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CniEnv {
    /// `CNI_COMMAND`.
    pub command: CniCommand,
    /// `CNI_CONTAINERID`, present for ADD, CHECK and DEL.
    pub container_id: Option<String>,
    /// `CNI_NETNS`, present for ADD and CHECK, optional for DEL.
    pub netns: Option<PathBuf>,
    /// `CNI_IFNAME`, present for ADD, CHECK and DEL.
    pub ifname: Option<String>,
    /// `CNI_ARGS`, unparsed (see [`super::args::CniArgs`]).
    pub args: String,
    /// `CNI_PATH`, split on `:`.
    pub path: Vec<PathBuf>,
}

impl CniEnv {
    /// Reads the variables through `lookup` (the process environment in the
    /// binary, a map in tests). An empty variable counts as unset.
    ///
    /// Errors (all code 4): `CNI_COMMAND` missing or unknown, a variable the
    /// command requires missing (all missing ones are listed), a variable that
    /// is not UTF-8, or a container ID / interface name the specification
    /// forbids (except for DEL, see [`super::request::Invocation::parse`]).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<OsString>) -> Result<CniEnv, CniError> {
        let read = |name: &str| -> Result<Option<String>, CniError> {
            match lookup(name) {
                None => Ok(None),
                Some(value) if value.is_empty() => Ok(None),
                Some(value) => value.into_string().map(Some).map_err(|raw| {
                    CniError::new(
                        ErrorCode::InvalidEnvironment,
                        format!("{name} is not valid UTF-8: {raw:?}"),
                    )
                }),
            }
        };

        let command: CniCommand = read(COMMAND)?
            .ok_or_else(|| {
                CniError::new(
                    ErrorCode::InvalidEnvironment,
                    "CNI_COMMAND is not set; flatnet-cni is a CNI plugin and must be run by a container runtime or Multus",
                )
            })?
            .parse()?;

        let missing: Vec<&str> = command
            .required_variables()
            .iter()
            .copied()
            .filter(|name| !matches!(read(name), Ok(Some(_))))
            .collect();
        if !missing.is_empty() {
            return Err(CniError::new(
                ErrorCode::InvalidEnvironment,
                format!(
                    "{command} needs the environment variables {} but they are not set",
                    missing.join(", ")
                ),
            ));
        }

        let container_id = read(CONTAINER_ID)?;
        let ifname = read(IFNAME)?;
        // DEL of names no ADD could have used succeeds (nothing to delete),
        // so it is left to [`super::request::Invocation::parse`].
        if command != CniCommand::Del {
            if let Some(id) = &container_id {
                check_container_id(id)?;
            }
            if let Some(name) = &ifname {
                check_ifname(name)?;
            }
        }
        Ok(CniEnv {
            command,
            container_id,
            netns: read(NETNS)?.map(PathBuf::from),
            ifname,
            args: read(ARGS)?.unwrap_or_default(),
            path: read(PATH)?
                .map(|p| {
                    p.split(':')
                        .filter(|d| !d.is_empty())
                        .map(PathBuf::from)
                        .collect()
                })
                .unwrap_or_default(),
        })
    }

    /// Reads the process environment.
    pub fn from_process() -> Result<CniEnv, CniError> {
        Self::from_lookup(|name| std::env::var_os(name))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Result<CniEnv, CniError> {
        let map: HashMap<String, OsString> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), OsString::from(v)))
            .collect();
        CniEnv::from_lookup(|name| map.get(name).cloned())
    }

    const FULL: [(&str, &str); 6] = [
        ("CNI_COMMAND", "ADD"),
        ("CNI_CONTAINERID", "abc123"),
        ("CNI_NETNS", "/var/run/netns/p"),
        ("CNI_IFNAME", "eth1"),
        ("CNI_ARGS", "K8S_POD_NAME=p"),
        ("CNI_PATH", "/opt/cni/bin::/usr/lib/cni"),
    ];

    #[test]
    fn reads_a_full_add() {
        let parsed = env(&FULL).unwrap();
        assert_eq!(parsed.command, CniCommand::Add);
        assert_eq!(parsed.container_id.as_deref(), Some("abc123"));
        assert_eq!(parsed.netns, Some(PathBuf::from("/var/run/netns/p")));
        assert_eq!(
            parsed.path,
            [PathBuf::from("/opt/cni/bin"), PathBuf::from("/usr/lib/cni")]
        );
        assert_eq!(parsed.args, "K8S_POD_NAME=p");
    }

    #[test]
    fn missing_or_unknown_command_is_code_4() {
        assert_eq!(env(&[]).unwrap_err().code, ErrorCode::InvalidEnvironment);
        assert_eq!(
            env(&[("CNI_COMMAND", "")]).unwrap_err().code,
            ErrorCode::InvalidEnvironment
        );
        let error = env(&[("CNI_COMMAND", "add")]).unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidEnvironment);
        assert!(error.msg.contains("ADD, DEL"), "{}", error.msg);
    }

    #[test]
    fn lists_every_missing_variable() {
        let error = env(&[("CNI_COMMAND", "CHECK"), ("CNI_CONTAINERID", "c")]).unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidEnvironment);
        assert!(error.msg.contains("CNI_NETNS, CNI_IFNAME"), "{}", error.msg);
    }

    #[test]
    fn del_does_not_need_a_netns() {
        let parsed = env(&[
            ("CNI_COMMAND", "DEL"),
            ("CNI_CONTAINERID", "c"),
            ("CNI_IFNAME", "eth1"),
            ("CNI_NETNS", ""),
        ])
        .unwrap();
        assert_eq!(parsed.netns, None);
    }

    #[test]
    fn status_gc_and_version_need_only_the_command() {
        for command in ["STATUS", "GC", "VERSION"] {
            assert!(env(&[("CNI_COMMAND", command)]).is_ok(), "{command}");
        }
    }

    #[test]
    fn rejects_bad_container_ids_and_interface_names() {
        for (key, value) in [
            ("CNI_CONTAINERID", "-x"),
            ("CNI_CONTAINERID", "a/b"),
            ("CNI_IFNAME", "a-very-long-ifname"),
            ("CNI_IFNAME", ".."),
            ("CNI_IFNAME", "eth 1"),
            ("CNI_IFNAME", "eth:1"),
        ] {
            let mut pairs = FULL.to_vec();
            pairs.retain(|(k, _)| *k != key);
            pairs.push((key, value));
            assert_eq!(
                env(&pairs).unwrap_err().code,
                ErrorCode::InvalidEnvironment,
                "{key}={value}"
            );
        }
    }

    #[test]
    fn non_utf8_is_code_4() {
        use std::os::unix::ffi::OsStringExt;
        let error = CniEnv::from_lookup(|name| match name {
            "CNI_COMMAND" => Some("VERSION".into()),
            "CNI_PATH" => Some(OsString::from_vec(vec![0xff])),
            _ => None,
        })
        .unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidEnvironment);
    }
}
