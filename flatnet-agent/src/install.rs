//! Installing the CNI plugin on the node: the `flatnet-cni` executable into
//! the runtime's plugin directory (also as `rancher-flat-network-cni`, the
//! original's name, which NADs written for it still use) and, optionally, a
//! network configuration list. Both are replaced atomically, so a runtime never executes a
//! half-copied binary or reads a half-written file.

use std::{
    io,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use flatnet_k8s::keys;
use serde_json::json;

use crate::atomic_file::{create_private_dir, write_atomic};

/// Name of the plugin executable.
pub const CNI_BINARY: &str = keys::CNI_PLUGIN;

/// Every name the plugin is installed under: its own, then the original's.
pub const CNI_BINARY_NAMES: [&str; 2] = [CNI_BINARY, keys::CNI_PLUGIN_ORIGINAL];

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

/// Copies `source` to `<bin_dir>/<name>` (mode 0755) for every name of
/// [`CNI_BINARY_NAMES`], each through a temporary file and a rename.
/// Returns the installed paths, `flatnet-cni` first.
pub fn install_binary(source: &Path, bin_dir: &Path) -> Result<Vec<PathBuf>, InstallError> {
    let bytes = std::fs::read(source).map_err(|e| InstallError {
        what: "the CNI plugin (reading the source)",
        path: source.to_owned(),
        source: e,
    })?;
    CNI_BINARY_NAMES
        .iter()
        .map(|name| install_executable(&bytes, bin_dir, name))
        .collect()
}

fn install_executable(bytes: &[u8], bin_dir: &Path, name: &str) -> Result<PathBuf, InstallError> {
    let target = bin_dir.join(name);
    let error = |source| InstallError {
        what: "the CNI plugin",
        path: target.clone(),
        source,
    };
    if !bin_dir.is_dir() {
        std::fs::create_dir_all(bin_dir).map_err(error)?;
    }
    // Staged beside the target and renamed over it: a runtime executing the
    // plugin meanwhile runs the old or the new binary, never a partial one.
    let staging = bin_dir.join(format!(".{name}.new"));
    std::fs::write(&staging, bytes).map_err(error)?;
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
/// Versions as in [`keys::CNI_CONFIG_VERSION`] and [`keys::CNI_CONFIG_VERSIONS`].
pub fn conflist(name: &str, agent_socket: &Path) -> serde_json::Value {
    json!({
        "cniVersion": keys::CNI_CONFIG_VERSION,
        "cniVersions": keys::CNI_CONFIG_VERSIONS,
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
        let bin = dir.path().join("bin");
        let installed = install_binary(&source, &bin).unwrap();
        assert_eq!(
            installed,
            [
                bin.join("flatnet-cni"),
                bin.join("rancher-flat-network-cni")
            ]
        );
        for path in &installed {
            assert_eq!(std::fs::read(path).unwrap(), b"#!/bin/sh\n");
            let mode = std::fs::metadata(path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o755);
        }
        // Re-installing replaces the files in place.
        install_binary(&source, &bin).unwrap();
        assert_eq!(std::fs::read_dir(&bin).unwrap().count(), 2);

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
