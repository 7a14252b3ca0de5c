//! Installing the CNI plugin on the node: the `flatnet-cni` executable into
//! the runtime's plugin directory and, optionally, a network configuration
//! list. Both are replaced atomically, so a runtime never executes a
//! half-copied binary or reads a half-written file.

use std::{
    io,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use serde_json::json;

use crate::atomic_file::{create_private_dir, write_atomic};

/// Name of the plugin executable.
pub const CNI_BINARY: &str = "flatnet-cni";

/// Installation failed.
#[derive(Debug, thiserror::Error)]
#[error("cannot install {what} at {path}: {source}")]
pub struct InstallError {
    /// What was being installed.
    pub what: &'static str,
    /// Where.
    pub path: PathBuf,
    /// The cause.
    pub source: io::Error,
}

/// The `flatnet-cni` next to the running executable.
pub fn default_cni_binary() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    Some(exe.parent()?.join(CNI_BINARY))
}

/// Copies `source` to `<bin_dir>/flatnet-cni` (mode 0755) through a
/// temporary file and a rename. Returns the installed path.
pub fn install_binary(source: &Path, bin_dir: &Path) -> Result<PathBuf, InstallError> {
    let target = bin_dir.join(CNI_BINARY);
    let error = |source| InstallError {
        what: "the CNI plugin",
        path: target.clone(),
        source,
    };
    let bytes = std::fs::read(source).map_err(|e| InstallError {
        what: "the CNI plugin (reading the source)",
        path: source.to_owned(),
        source: e,
    })?;
    if !bin_dir.is_dir() {
        std::fs::create_dir_all(bin_dir).map_err(error)?;
    }
    // Staged beside the target and renamed over it: a runtime executing the
    // plugin meanwhile runs the old or the new binary, never a partial one.
    let staging = bin_dir.join(format!(".{CNI_BINARY}.new"));
    std::fs::write(&staging, &bytes).map_err(error)?;
    std::fs::set_permissions(&staging, std::fs::Permissions::from_mode(0o755)).map_err(error)?;
    std::fs::File::open(&staging)
        .and_then(|f| f.sync_all())
        .map_err(error)?;
    std::fs::rename(&staging, &target).map_err(error)?;
    Ok(target)
}

/// The network configuration list flatnet installs: one network named
/// `name` using flatnet-cni.
///
/// `cniVersion` is 1.0.0 because runtimes built on libcni before 1.2
/// (podman 4, containerd 1.7) pass it through unchanged and cannot parse a
/// 1.1.0 result; newer runtimes pick the highest of `cniVersions` instead.
pub fn conflist(name: &str, agent_socket: &Path) -> serde_json::Value {
    json!({
        "cniVersion": "1.0.0",
        "cniVersions": ["1.0.0", "1.1.0"],
        "name": name,
        "plugins": [{
            "type": CNI_BINARY,
            "agentSocket": agent_socket,
        }]
    })
}

/// Writes `<conf_dir>/<file_name>` with [`conflist`].
pub fn install_conflist(
    conf_dir: &Path,
    file_name: &str,
    name: &str,
    agent_socket: &Path,
) -> Result<PathBuf, InstallError> {
    let path = conf_dir.join(file_name);
    let error = |source| InstallError {
        what: "the CNI network configuration",
        path: path.clone(),
        source,
    };
    if !conf_dir.is_dir() {
        create_private_dir(conf_dir).map_err(error)?;
    }
    let text = serde_json::to_vec_pretty(&conflist(name, agent_socket)).expect("JSON");
    write_atomic(&path, &text).map_err(error)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installs_an_executable_copy_and_a_conflist() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("src-bin");
        std::fs::write(&source, b"#!/bin/sh\n").unwrap();
        let installed = install_binary(&source, &dir.path().join("bin")).unwrap();
        assert_eq!(std::fs::read(&installed).unwrap(), b"#!/bin/sh\n");
        let mode = std::fs::metadata(&installed).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o755);
        // Re-installing replaces the file in place.
        install_binary(&source, &dir.path().join("bin")).unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path().join("bin")).unwrap().count(),
            1
        );

        let path = install_conflist(
            &dir.path().join("net.d"),
            "10-flatnet.conflist",
            "flat",
            Path::new("/run/flatnet/agent.sock"),
        )
        .unwrap();
        let written: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        assert_eq!(written["plugins"][0]["type"], "flatnet-cni");
        assert_eq!(written["name"], "flat");
        // Readable by runtimes that know only `cniVersion`, up to 1.0.0.
        assert_eq!(written["cniVersion"], "1.0.0");
        assert_eq!(
            written["cniVersions"],
            serde_json::json!(["1.0.0", "1.1.0"])
        );
    }
}
