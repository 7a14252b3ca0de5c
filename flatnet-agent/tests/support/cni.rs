//! Running the real flatnet-cni binary against an agent's socket, as a
//! container runtime does.

use std::{
    io::Write,
    path::Path,
    process::{Command, Stdio},
};

use serde_json::{Value, json};

/// Every pod's flat interface.
pub const IFNAME: &str = "eth1";

/// Runs flatnet-cni against the agent on `socket` (for the pod's `eth1`
/// when `container` is given, in namespace `netns`); returns (success,
/// stdout JSON).
pub fn run_cni(
    socket: &Path,
    command: &str,
    network: &str,
    container: &str,
    netns: Option<&Path>,
    extra: Value,
) -> (bool, Value) {
    let mut config = json!({
        "cniVersion": "1.1.0",
        "name": network,
        "type": "flatnet-cni",
        "agentTimeoutSeconds": 30,
    });
    for (k, v) in extra.as_object().unwrap() {
        config[k] = v.clone();
    }
    let mut cmd = Command::new(super::agent::package_binary(option_env!(
        "CARGO_BIN_EXE_flatnet-cni"
    )));
    cmd.env_clear()
        .env("CNI_COMMAND", command)
        .env("FLATNET_AGENT_SOCKET", socket)
        .env(
            "CNI_ARGS",
            format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=pod-{container}"),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    if !container.is_empty() {
        cmd.env("CNI_CONTAINERID", container)
            .env("CNI_IFNAME", IFNAME);
    }
    if let Some(netns) = netns {
        cmd.env("CNI_NETNS", netns);
    }
    let mut child = cmd.spawn().unwrap();
    // flatnet-cni may answer (e.g. "agent not running") and exit before
    // reading its input; its output says what happened, so a broken
    // pipe here is not an error.
    let written = child
        .stdin
        .take()
        .unwrap()
        .write_all(config.to_string().as_bytes());
    if let Err(e) = written {
        assert_eq!(
            e.kind(),
            std::io::ErrorKind::BrokenPipe,
            "write CNI config: {e}"
        );
    }
    let out = child.wait_with_output().unwrap();
    let stdout: Value = if out.stdout.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{command}: stdout is not JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        })
    };
    (out.status.success(), stdout)
}
