//! Building the eBPF crate with the pinned nightly toolchain.

use std::fs;

use anyhow::{Context, anyhow};

use crate::workspace;

/// The nightly channel pinned in `flatnet-ebpf/rust-toolchain.toml`.
pub fn toolchain() -> anyhow::Result<String> {
    let path = workspace::root().join("flatnet-ebpf/rust-toolchain.toml");
    let text = fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    text.lines()
        .filter_map(|line| line.trim().strip_prefix("channel"))
        .filter_map(|rest| rest.trim().strip_prefix('='))
        .map(|value| value.trim().trim_matches('"').to_owned())
        .next()
        .ok_or_else(|| anyhow!("no `channel = \"...\"` in {}", path.display()))
}

/// `cargo build --release` inside flatnet-ebpf/, whose `.cargo/config.toml`
/// selects the bpfel target, build-std and BTF. The object lands in
/// `target/bpfel-unknown-none/release/flatnet-ebpf`; its BTF and debug
/// info name source files by remapped paths, not this machine's.
pub fn build() -> anyhow::Result<()> {
    let toolchain = toolchain()?;
    let mut cargo = workspace::cargo(Some(&toolchain));
    cargo
        .current_dir(workspace::root().join("flatnet-ebpf"))
        .args(["build", "--release"])
        // Added to the config file's flags for the target, not instead.
        .env(
            "CARGO_TARGET_BPFEL_UNKNOWN_NONE_RUSTFLAGS",
            workspace::remap_path_flags()?,
        );
    workspace::run("build eBPF object", &mut cargo).map_err(|e| {
        e.context(format!(
            "the eBPF build needs `rustup toolchain install {toolchain} --component rust-src` \
             and bpf-linker (`bash .ci/provision` installs both)"
        ))
    })
}

/// Clippy on the eBPF crate for its real target.
pub fn clippy() -> anyhow::Result<()> {
    let toolchain = toolchain()?;
    let mut cargo = workspace::cargo(Some(&toolchain));
    cargo
        .current_dir(workspace::root().join("flatnet-ebpf"))
        .args(["clippy", "--release", "--", "-D", "warnings"]);
    workspace::run("clippy (eBPF)", &mut cargo)
}
