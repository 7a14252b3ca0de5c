//! Where the cargo workspace and its target directory are.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The cargo workspace `cargo xtask` runs in.
pub struct Workspace {
    /// The workspace root, shared with the VM at the same path.
    pub root: PathBuf,
    /// cargo's target directory (honours `CARGO_TARGET_DIR`).
    pub target_dir: PathBuf,
}

impl Workspace {
    /// Asks `cargo metadata` for the workspace root and target directory.
    pub fn locate() -> Result<Self> {
        let output = Command::new(cargo())
            .args(["metadata", "--format-version", "1", "--no-deps"])
            .output()
            .context("cannot run `cargo metadata`")?;
        if !output.status.success() {
            bail!(
                "`cargo metadata` failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let metadata: serde_json::Value =
            serde_json::from_slice(&output.stdout).context("`cargo metadata` printed no JSON")?;
        let path = |key: &str| {
            metadata[key]
                .as_str()
                .map(PathBuf::from)
                .with_context(|| format!("`cargo metadata` gave no {key}"))
        };
        Ok(Self {
            root: path("workspace_root")?,
            target_dir: path("target_directory")?,
        })
    }
}

/// The cargo that runs xtask, so nested builds use the same toolchain.
pub fn cargo() -> String {
    std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string())
}
