//! `cargo xtask charts`: lints, renders and validates the Helm charts with
//! the real Helm library (PyPI `helm-python-sdk`) and the Kubernetes 1.28
//! schemas (PyPI `kubernetes-validate`), through `xtask/charts/check.py`.
//!
//! The Python packages, pinned in `xtask/charts/requirements.txt`, go into a
//! virtualenv under `target/`, created on first use and refreshed whenever
//! the requirements change; only `python3` (with `venv`) must be installed.

use std::{fs, path::Path, process::Command};

use anyhow::Context;

use crate::workspace;

const REQUIREMENTS: &str = "xtask/charts/requirements.txt";
const SCRIPT: &str = "xtask/charts/check.py";
const VENV: &str = "target/chart-check-venv";
/// Copy of the requirements the virtualenv was built from.
const STAMP: &str = "flatnet-requirements.txt";

/// Checks every chart under `charts/`; fails on any problem.
pub fn check() -> anyhow::Result<()> {
    let root = workspace::root();
    let venv = root.join(VENV);
    ensure_venv(&root, &venv)?;
    workspace::run(
        "chart checks",
        Command::new(venv.join("bin/python"))
            .arg(root.join(SCRIPT))
            .arg("--root")
            .arg(&root),
    )
}

fn ensure_venv(root: &Path, venv: &Path) -> anyhow::Result<()> {
    let requirements_path = root.join(REQUIREMENTS);
    let requirements = fs::read_to_string(&requirements_path)
        .with_context(|| format!("read {}", requirements_path.display()))?;
    let stamp = venv.join(STAMP);
    if fs::read_to_string(&stamp).is_ok_and(|built| built == requirements) {
        println!(
            "chart check packages already installed in {}",
            venv.display()
        );
        return Ok(());
    }
    workspace::run(
        "chart check virtualenv",
        Command::new("python3")
            .args(["-m", "venv", "--clear"])
            .arg(venv),
    )
    .context("python3 with the venv module is required (Debian: python3-venv)")?;
    workspace::run(
        "chart check packages",
        Command::new(venv.join("bin/pip"))
            .args(["install", "--disable-pip-version-check", "--quiet", "-r"])
            .arg(&requirements_path),
    )?;
    fs::write(&stamp, requirements).with_context(|| format!("write {}", stamp.display()))
}
