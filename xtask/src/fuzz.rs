//! `cargo xtask fuzz`: builds the cargo-fuzz targets of `xtask/fuzz` with the
//! pinned nightly and runs each for a while from its committed seeds.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Stdio,
    time::Instant,
};

use anyhow::{Context, bail};
use clap::Args;
use serde::Deserialize;

use crate::{ebpf, workspace};

/// Options of `cargo xtask fuzz`.
#[derive(Args)]
pub struct FuzzArgs {
    /// How long each target runs, in seconds.
    #[arg(long, default_value_t = 60)]
    pub seconds: u64,
    /// Run only these targets (repeat the option); all by default.
    #[arg(long = "target")]
    pub targets: Vec<String>,
}

impl FuzzArgs {
    /// The short run of `cargo xtask test`: every target for 10 s.
    pub fn ci() -> Self {
        Self {
            seconds: 10,
            targets: Vec::new(),
        }
    }
}

/// The fuzz crate, relative to the workspace root.
const FUZZ_DIR: &str = "xtask/fuzz";

/// Build options shared by `cargo fuzz build` and `cargo fuzz run`, so the
/// run reuses the build: no sanitizer (the fuzzed code is safe Rust, and
/// the instrumentation would slow every execution), 16 codegen units (the
/// build fits CI's budget), artifacts under `target/fuzz`.
const BUILD_OPTIONS: [&str; 8] = [
    "--fuzz-dir",
    FUZZ_DIR,
    "--sanitizer",
    "none",
    "--codegen-units",
    "16",
    "--target-dir",
    "target/fuzz",
];

/// What one target did.
struct Outcome {
    target: String,
    executions: u64,
    seconds: f64,
    crashed: bool,
}

/// `cargo xtask fuzz`.
pub fn run(args: &FuzzArgs) -> anyhow::Result<()> {
    check_lock_agrees()?;
    let toolchain = ebpf::toolchain()?;
    let mut build = workspace::cargo(Some(&toolchain));
    build.args(["fuzz", "build"]).args(BUILD_OPTIONS);
    workspace::run("build fuzz targets", &mut build).map_err(|e| {
        e.context(format!(
            "fuzzing needs cargo-fuzz and the {toolchain} toolchain (`bash .ci/provision` installs both)"
        ))
    })?;
    let targets = if args.targets.is_empty() {
        list(&toolchain)?
    } else {
        args.targets.clone()
    };
    let mut outcomes = Vec::new();
    for target in &targets {
        outcomes.push(run_target(&toolchain, target, args.seconds)?);
    }
    println!("fuzz summary ({}s per target):", args.seconds);
    for o in &outcomes {
        println!(
            "  {:<18} {:>12} executions  {:>9.0}/s  {}",
            o.target,
            o.executions,
            o.executions as f64 / o.seconds.max(1e-3),
            if o.crashed { "CRASHED" } else { "ok" }
        );
    }
    let total: u64 = outcomes.iter().map(|o| o.executions).sum();
    println!("  total {total} executions");
    let crashed: Vec<&str> = outcomes
        .iter()
        .filter(|o| o.crashed)
        .map(|o| o.target.as_str())
        .collect();
    if !crashed.is_empty() {
        bail!(
            "fuzz targets failed: {}; the inputs are in {FUZZ_DIR}/artifacts/<target>/, \
             reproduce one with `cargo +{toolchain} fuzz run --fuzz-dir {FUZZ_DIR} -s none <target> <file>`",
            crashed.join(", ")
        );
    }
    Ok(())
}

/// The package versions a `Cargo.lock` holds.
#[derive(Deserialize)]
struct Lock {
    #[serde(default)]
    package: Vec<LockedPackage>,
}

/// One `[[package]]` of a `Cargo.lock`.
#[derive(Deserialize)]
struct LockedPackage {
    name: String,
    version: String,
}

/// Each package name's locked versions.
fn locked_versions(text: &str) -> anyhow::Result<BTreeMap<String, BTreeSet<String>>> {
    let lock: Lock = toml::from_str(text)?;
    let mut versions: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for p in lock.package {
        versions.entry(p.name).or_default().insert(p.version);
    }
    Ok(versions)
}

/// The packages the fuzz lock holds at a version the workspace lock does
/// not, although the workspace locks that package too: `name fuzz-version
/// (workspace: versions)`.
fn lock_differences(workspace: &str, fuzz: &str) -> anyhow::Result<Vec<String>> {
    let workspace = locked_versions(workspace).context("workspace Cargo.lock")?;
    let fuzz = locked_versions(fuzz).context("fuzz Cargo.lock")?;
    let mut differences = Vec::new();
    for (name, versions) in &fuzz {
        let Some(workspace_versions) = workspace.get(name) else {
            continue;
        };
        for version in versions.difference(workspace_versions) {
            let listed: Vec<&str> = workspace_versions.iter().map(String::as_str).collect();
            differences.push(format!(
                "{name} {version} (workspace: {})",
                listed.join(", ")
            ));
        }
    }
    Ok(differences)
}

/// Fails when the fuzz crate's own lock drifted from the workspace's: the
/// targets must fuzz the code as the product builds it, dependencies included.
fn check_lock_agrees() -> anyhow::Result<()> {
    let root = workspace::root();
    let read = |path: PathBuf| {
        fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))
    };
    let differences = lock_differences(
        &read(root.join("Cargo.lock"))?,
        &read(root.join(FUZZ_DIR).join("Cargo.lock"))?,
    )?;
    if !differences.is_empty() {
        bail!(
            "{FUZZ_DIR}/Cargo.lock locks shared packages at other versions than Cargo.lock: {}; \
             copy Cargo.lock over it and run `cargo metadata --offline` in {FUZZ_DIR} to prune it",
            differences.join("; ")
        );
    }
    Ok(())
}

/// The targets `cargo fuzz list` names (the `[[bin]]`s of the fuzz crate).
fn list(toolchain: &str) -> anyhow::Result<Vec<String>> {
    let output = workspace::cargo(Some(toolchain))
        .args(["fuzz", "list", "--fuzz-dir", FUZZ_DIR])
        .stderr(Stdio::inherit())
        .output()
        .context("cannot run cargo fuzz list")?;
    if !output.status.success() {
        bail!("cargo fuzz list failed ({})", output.status);
    }
    Ok(String::from_utf8(output.stdout)
        .context("cargo fuzz list printed non-UTF-8")?
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect())
}

/// Runs `target` for `seconds` from the seeds plus the corpus earlier runs
/// kept in `target/fuzz/corpus/<target>` (libFuzzer adds new inputs to the
/// first directory only, so the committed seeds stay as they are).
fn run_target(toolchain: &str, target: &str, seconds: u64) -> anyhow::Result<Outcome> {
    let root = workspace::root();
    let corpus = root.join("target/fuzz/corpus").join(target);
    fs::create_dir_all(&corpus).with_context(|| format!("create {}", corpus.display()))?;
    let seeds: PathBuf = Path::new(FUZZ_DIR).join("seeds").join(target);
    let mut command = workspace::cargo(Some(toolchain));
    command
        .args(["fuzz", "run"])
        .args(BUILD_OPTIONS)
        .arg(target)
        .arg(&corpus)
        .arg(&seeds)
        .args([
            "--",
            &format!("-max_total_time={seconds}"),
            "-print_final_stats=1",
            // A slow input is a finding too, but not a hang of CI.
            "-timeout=10",
            "-rss_limit_mb=2048",
        ])
        .stderr(Stdio::piped());
    println!("==> fuzz {target} for {seconds}s: {command:?}");
    let started = Instant::now();
    let output = command
        .output()
        .with_context(|| format!("cannot run cargo fuzz run {target}"))?;
    let elapsed = started.elapsed().as_secs_f64();
    let log = String::from_utf8_lossy(&output.stderr);
    let executions = log
        .lines()
        .filter_map(|l| l.strip_prefix("stat::number_of_executed_units:"))
        .filter_map(|v| v.trim().parse().ok())
        .next_back()
        .unwrap_or(0);
    let crashed = !output.status.success();
    if crashed {
        // The report of the failing input: the panic and libFuzzer's lines.
        eprintln!("{log}");
    }
    println!(
        "<== fuzz {target}: {executions} executions in {elapsed:.0}s, {}",
        if crashed { "FAILED" } else { "ok" }
    );
    Ok(Outcome {
        target: target.to_owned(),
        executions,
        seconds: elapsed,
        crashed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const WORKSPACE: &str = r#"
version = 4

[[package]]
name = "serde"
version = "1.0.229"

[[package]]
name = "syn"
version = "1.0.109"

[[package]]
name = "syn"
version = "2.0.111"
"#;

    #[test]
    fn a_fuzz_lock_at_the_workspace_versions_agrees() {
        let fuzz = r#"
version = 4

[[package]]
name = "syn"
version = "2.0.111"

[[package]]
name = "libfuzzer-sys"
version = "0.4.13"
"#;
        assert_eq!(
            lock_differences(WORKSPACE, fuzz).unwrap(),
            Vec::<String>::new()
        );
    }

    #[test]
    fn a_shared_package_at_another_version_is_named() {
        let fuzz = r#"
[[package]]
name = "serde"
version = "1.0.230"
"#;
        assert_eq!(
            lock_differences(WORKSPACE, fuzz).unwrap(),
            ["serde 1.0.230 (workspace: 1.0.229)"]
        );
    }

    #[test]
    fn the_committed_fuzz_lock_agrees_with_the_workspace_lock() {
        check_lock_agrees().unwrap();
    }
}
