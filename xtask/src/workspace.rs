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
