//! `cargo xtask crds`: keeps the CRD chart in sync with the Rust API types.

use std::{fs, path::PathBuf};

use anyhow::{Context, bail};

/// The committed CRD manifest, relative to the workspace root.
const CRDS_PATH: &str = "charts/flatnet-crd/templates/crds.yaml";

/// Writes the generated CRDs, or with `check` fails when the committed file
/// is stale.
pub fn run(check: bool) -> anyhow::Result<()> {
    let path = workspace_root().join(CRDS_PATH);
    let generated = flatnet_k8s::crd_yaml();
    if check {
        let committed =
            fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
        if committed != generated {
            bail!(
                "{} is out of date: run `cargo xtask crds` and commit the result",
                path.display()
            );
        }
        println!("{} is up to date", path.display());
    } else {
        fs::write(&path, generated).with_context(|| format!("write {}", path.display()))?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn workspace_root() -> PathBuf {
    // xtask lives one level below the workspace root.
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask has a parent directory")
        .to_path_buf()
}
