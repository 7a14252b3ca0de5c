//! Building the eBPF crate with the pinned nightly toolchain.

use std::{
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use anyhow::{Context, anyhow, ensure};

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
    build_in(&workspace::root(), "build eBPF object")
}

/// The target directory of every eBPF build, whatever the checkout: the
/// order LLVM writes BTF types in follows the paths of the linker's inputs
/// (two checkouts with their own target directories built objects whose
/// BTF differed), so every checkout builds at this one path and copies the
/// object into its own `target/`.
const SHARED_TARGET_DIR: &str = "/var/tmp/flatnet-ebpf-target";

/// [`SHARED_TARGET_DIR`], made if missing; fails if another user owns it
/// (cargo could not write there).
fn shared_target_dir() -> anyhow::Result<&'static Path> {
    let dir = Path::new(SHARED_TARGET_DIR);
    fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    let owner = fs::metadata(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .uid();
    let me = nix::unistd::geteuid().as_raw();
    ensure!(
        owner == me,
        "{} belongs to user {owner}, not to this user ({me}): the eBPF build writes there; \
         remove it, or build as user {owner}",
        dir.display()
    );
    Ok(dir)
}

/// Where the object is inside a target directory.
const OBJECT_IN_TARGET: &str = "bpfel-unknown-none/release/flatnet-ebpf";

/// The object [`build`] leaves in the checkout at `checkout`.
fn object_of(checkout: &Path) -> PathBuf {
    checkout.join("target").join(OBJECT_IN_TARGET)
}

/// [`build`] in the checkout at `checkout`, as step `step`.
fn build_in(checkout: &Path, step: &str) -> anyhow::Result<()> {
    let toolchain = toolchain()?;
    let target_dir = shared_target_dir()?;
    // Held until the object is copied: a build from another checkout
    // between cargo and the copy would hand this checkout its object.
    let lock_path = target_dir.join("xtask.lock");
    let lock_file =
        fs::File::create(&lock_path).with_context(|| format!("create {}", lock_path.display()))?;
    let _lock = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| e)
        .with_context(|| format!("lock {}", lock_path.display()))?;
    let mut cargo = workspace::cargo(Some(&toolchain));
    cargo
        .current_dir(checkout.join("flatnet-ebpf"))
        .args(["build", "--release"])
        .env("CARGO_TARGET_DIR", target_dir)
        // Added to the config file's flags for the target, not instead.
        .env(
            "CARGO_TARGET_BPFEL_UNKNOWN_NONE_RUSTFLAGS",
            workspace::remap_path_flags_of(checkout)?,
        );
    workspace::run(step, &mut cargo).map_err(|e| {
        e.context(format!(
            "the eBPF build needs `rustup toolchain install {toolchain} --component rust-src` \
             and bpf-linker (`bash .ci/provision` installs both)"
        ))
    })?;
    let built = target_dir.join(OBJECT_IN_TARGET);
    let object = object_of(checkout);
    let bytes = fs::read(&built).with_context(|| format!("read {}", built.display()))?;
    // The same bytes keep their time, so the agent (built from the object) is not rebuilt.
    if fs::read(&object).is_ok_and(|old| old == bytes) {
        return Ok(());
    }
    fs::create_dir_all(object.parent().expect("the object path has folders"))
        .with_context(|| format!("create the folder of {}", object.display()))?;
    // Through a temporary name: the agent's build never reads half an object.
    let partial = object.with_extension("partial");
    fs::write(&partial, &bytes).with_context(|| format!("write {}", partial.display()))?;
    fs::rename(&partial, &object)
        .with_context(|| format!("rename {} to {}", partial.display(), object.display()))
}

/// Builds the eBPF object again from a second checkout of `HEAD` in
/// another folder, and fails unless it is
/// byte for byte the object [`build`] made here: a build path that reaches
/// the object makes the agent's image differ between checkouts. Needs the
/// object built here from a clean tree (a change not committed is not in
/// the second checkout: then it says so and compares nothing).
pub fn same_from_another_checkout() -> anyhow::Result<()> {
    let root = workspace::root();
    let git = |args: &[&str]| -> anyhow::Result<String> {
        let output = std::process::Command::new("git")
            .args(args)
            .current_dir(&root)
            .output()
            .context("cannot run git")?;
        ensure!(output.status.success(), "git {args:?} failed: {output:?}");
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    };
    let changed = git(&[
        "status",
        "--porcelain",
        "--",
        "flatnet-ebpf",
        "flatnet-common",
    ])?;
    if !changed.trim().is_empty() {
        println!(
            "eBPF object from another checkout: not compared, the eBPF sources have changes not committed:\n{changed}"
        );
        return Ok(());
    }
    let second = root.join("target/tmp/second-checkout");
    let second_text = second.display().to_string();
    // A worktree left by a killed run goes first.
    let _ = git(&["worktree", "remove", "--force", &second_text]);
    let _ = fs::remove_dir_all(&second);
    git(&["worktree", "prune"])?;
    git(&["worktree", "add", "--detach", &second_text, "HEAD"])?;
    let built = build_in(&second, "build eBPF object from a second checkout");
    let compared = built.and_then(|()| {
        let here = fs::read(object_of(&root)).context("read the eBPF object")?;
        let there =
            fs::read(object_of(&second)).context("read the second checkout's eBPF object")?;
        ensure!(
            here == there,
            "the eBPF object built in {} ({} bytes) differs from the one built in {} ({} bytes): \
             a path of the build reaches it (workspace::remap_path_flags)",
            second.display(),
            there.len(),
            root.display(),
            here.len()
        );
        println!(
            "eBPF object from another checkout: the same {} bytes",
            here.len()
        );
        Ok(())
    });
    git(&["worktree", "remove", "--force", &second_text])?;
    compared
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
