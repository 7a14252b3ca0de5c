//! `cargo xtask bench pod-start`: on the real node of `cargo xtask cluster`
//! with the release installed from its charts' default values, the time
//! from a pod's creation to Ready with a flat attachment (Multus and
//! flatnet-cni) against the same pod without one
//! (`flatnet-operator/tests/e2e_release.rs`
//! `pod_start_with_and_without_a_flat_attachment`). Writes the "pod-start"
//! section of docs/benchmarks.md.

use anyhow::Context;
use clap::Args;

use super::{machine, report};
use crate::{cluster, e2e, workspace};

/// Options of `cargo xtask bench pod-start`.
#[derive(Args)]
pub struct PodStartArgs {
    /// Use the release already in target/flatnet-<version>.
    #[arg(long)]
    skip_release: bool,
    /// Print the table only; leave docs/benchmarks.md alone.
    #[arg(long)]
    no_write: bool,
}

/// Brings the cluster up, installs the release, measures, takes it down.
pub fn run(args: &PodStartArgs) -> anyhow::Result<()> {
    let (release_dir, version) = e2e::release_dir(args.skip_release)?;
    let cluster = cluster::up(&cluster::Options::default())?;
    let measured = measure(&cluster, &release_dir, &version);
    cluster::down()?;
    let table = measured?;
    print!("{table}");
    if args.no_write {
        return Ok(());
    }
    let section = format!(
        "## Pod start on a real node: with and without a flat attachment\n\n\
         Command: `cargo xtask bench pod-start` (root). {}.\n\n\
         The release installed with its charts' default values on the\n\
         single-node cluster of `cargo xtask cluster` (Kubernetes v1.28.15,\n\
         containerd, Multus thin), the LAN a Linux bridge. Pods (busybox\n\
         `httpd`, image already on the node, no readiness probe) are\n\
         created one at a time, alternating a pod with a flat attachment on\n\
         an IPv4 subnet (the NetworkAttachmentDefinition\n\
         `rancher-flat-network`, an automatic address) and the same pod\n\
         without one; each is timed from the create request to the watch\n\
         event that shows it Ready, as the test client sees them, then\n\
         deleted.\n\n{table}",
        machine()
    );
    report::write_section("pod-start", &section)
}

fn measure(
    cluster: &cluster::Cluster,
    release_dir: &std::path::Path,
    version: &str,
) -> anyhow::Result<String> {
    e2e::install(cluster, release_dir, version)?;
    let out = workspace::root().join("target/tmp/pod-start.md");
    std::fs::create_dir_all(out.parent().expect("a folder"))?;
    let _ = std::fs::remove_file(&out);
    let mut cargo = workspace::cargo(None);
    cargo
        .args([
            "test",
            "-p",
            "flatnet-operator",
            "--test",
            "e2e_release",
            "--",
        ])
        .args([
            "--ignored",
            "--exact",
            "pod_start_with_and_without_a_flat_attachment",
            "--nocapture",
        ])
        .envs(e2e::test_env(cluster))
        .env("FLATNET_E2E_POD_START_OUT", &out);
    workspace::run("measure pod start", &mut cargo)?;
    std::fs::read_to_string(&out).with_context(|| format!("read {}", out.display()))
}
