//! Locates the eBPF object built by `cargo xtask build-ebpf` and refuses to
//! build the agent against a missing or stale one.
//!
//! Not `aya-build`: it would build the eBPF crate from inside this script
//! (a nested cargo on the pinned nightly with rust-src and bpf-linker for
//! every agent build, check and clippy run), so the explicit
//! `cargo xtask build-ebpf` step, `FLATNET_EBPF_OBJECT` and the stale-object
//! error would go.

use std::{
    env, fs,
    path::{Path, PathBuf},
    time::SystemTime,
};

const HOW_TO_BUILD: &str =
    "run `cargo xtask build-ebpf` (or set FLATNET_EBPF_OBJECT to a built object)";

fn main() {
    println!("cargo:rerun-if-env-changed=FLATNET_EBPF_OBJECT");
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");

    let manifest_dir = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let workspace = manifest_dir
        .parent()
        .expect("agent lives in the workspace")
        .to_path_buf();

    if let Some(explicit) = env::var_os("FLATNET_EBPF_OBJECT") {
        let object = PathBuf::from(explicit);
        assert!(
            object.is_file(),
            "FLATNET_EBPF_OBJECT={} does not exist; {HOW_TO_BUILD}",
            object.display()
        );
        emit(&object);
        return;
    }

    let target_dir = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace.join("target"));
    let object = target_dir.join("bpfel-unknown-none/release/flatnet-ebpf");

    // Everything that feeds the kernel object. The crates nested in
    // flatnet-common/ (flatnet-k8s, flatnet-packet-socket) are user space
    // only and lie outside these paths.
    let sources = [
        workspace.join("flatnet-ebpf/src"),
        workspace.join("flatnet-ebpf/Cargo.toml"),
        workspace.join("flatnet-ebpf/rust-toolchain.toml"),
        workspace.join("flatnet-ebpf/.cargo/config.toml"),
        workspace.join("flatnet-common/src"),
        workspace.join("flatnet-common/Cargo.toml"),
    ];
    for source in &sources {
        println!("cargo:rerun-if-changed={}", source.display());
    }
    println!("cargo:rerun-if-changed={}", object.display());

    let built = match fs::metadata(&object).and_then(|m| m.modified()) {
        Ok(time) => time,
        Err(_) => panic!(
            "eBPF object {} is missing; {HOW_TO_BUILD}",
            object.display()
        ),
    };
    if let Some((newest, path)) = newest_source(&sources)
        && newest > built
    {
        panic!(
            "eBPF object {} is older than {}; {HOW_TO_BUILD}",
            object.display(),
            path.display()
        );
    }
    emit(&object);
}

fn emit(object: &Path) {
    println!("cargo:rustc-env=FLATNET_EBPF_OBJECT={}", object.display());
}

/// The most recently modified file among `roots` (recursively).
fn newest_source(roots: &[PathBuf]) -> Option<(SystemTime, PathBuf)> {
    let mut newest: Option<(SystemTime, PathBuf)> = None;
    let mut pending: Vec<PathBuf> = roots.to_vec();
    while let Some(path) = pending.pop() {
        let Ok(meta) = fs::metadata(&path) else {
            continue;
        };
        if meta.is_dir() {
            if let Ok(entries) = fs::read_dir(&path) {
                pending.extend(entries.flatten().map(|e| e.path()));
            }
        } else if let Ok(modified) = meta.modified()
            && newest.as_ref().is_none_or(|(t, _)| modified > *t)
        {
            newest = Some((modified, path));
        }
    }
    newest
}
