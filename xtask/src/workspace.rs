//! Locating the workspace and running commands with visible progress.

use std::{
    path::{Path, PathBuf},
    process::{Command, ExitStatus},
    time::Instant,
};

use anyhow::{Context, bail};

/// The workspace root (the parent of this crate's directory).
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives inside the workspace")
        .to_path_buf()
}

/// The folders of this machine whose paths a build could write into what
/// it makes (the checkout, cargo's and rustup's homes), each with the
/// fixed name [`remap_path_flags`] writes instead.
pub fn machine_paths() -> anyhow::Result<Vec<(PathBuf, &'static str)>> {
    machine_paths_of(&root())
}

/// [`machine_paths`] of a checkout at `checkout`.
pub fn machine_paths_of(checkout: &Path) -> anyhow::Result<Vec<(PathBuf, &'static str)>> {
    let home = std::env::var_os("HOME").map(PathBuf::from);
    let dir = |var: &str, default: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(default)))
            .with_context(|| format!("neither {var} nor HOME is set"))
    };
    Ok(vec![
        (checkout.to_path_buf(), "/flatnet"),
        (dir("CARGO_HOME", ".cargo")?, "/cargo"),
        (dir("RUSTUP_HOME", ".rustup")?, "/rustup"),
    ])
}

/// `rustc` flags that write [`machine_paths`] as fixed names in everything
/// built (debug info, BTF, panic messages): two checkouts of one commit, in
/// any folder on any machine, then build the same bytes.
pub fn remap_path_flags() -> anyhow::Result<String> {
    remap_path_flags_of(&root())
}

/// [`remap_path_flags`] of a checkout at `checkout`.
pub fn remap_path_flags_of(checkout: &Path) -> anyhow::Result<String> {
    Ok(machine_paths_of(checkout)?
        .iter()
        .map(|(from, to)| format!("--remap-path-prefix={}={to}", from.display()))
        .collect::<Vec<_>>()
        .join(" "))
}

/// Runs `command` to completion, printing it first and its duration after;
/// fails with the command line when it exits non-zero.
pub fn run(step: &str, command: &mut Command) -> anyhow::Result<()> {
    run_step(step, command, |command| Ok(command.status()?))
}

/// Prints the step and the command, runs `execute`, then prints the outcome
/// and duration; fails naming the command when it exits non-zero.
pub fn run_step(
    step: &str,
    command: &mut Command,
    execute: impl FnOnce(&mut Command) -> anyhow::Result<ExitStatus>,
) -> anyhow::Result<()> {
    let line = format!("{command:?}");
    println!("==> {step}: {line}");
    let started = Instant::now();
    let status = execute(command).with_context(|| format!("cannot run {line}"))?;
    println!(
        "<== {step}: {} in {:.1}s",
        if status.success() { "ok" } else { "FAILED" },
        started.elapsed().as_secs_f64()
    );
    if !status.success() {
        bail!("{step} failed ({status}): {line}");
    }
    Ok(())
}

/// A `cargo` command that does not inherit the toolchain selection of the
/// `cargo xtask` invocation, so `+toolchain` and rust-toolchain.toml apply.
pub fn cargo(toolchain: Option<&str>) -> Command {
    let mut command = Command::new("cargo");
    if let Some(toolchain) = toolchain {
        command.arg(format!("+{toolchain}"));
    }
    for var in [
        "RUSTUP_TOOLCHAIN",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
    ] {
        command.env_remove(var);
    }
    command.current_dir(root());
    command
}
