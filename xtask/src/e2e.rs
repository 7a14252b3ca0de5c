//! `cargo xtask e2e`: the real-cluster tier. Starts the single-node cluster
//! of `cargo xtask cluster up`, installs flatnet's release on it exactly as
//! docs/installation.md tells a user (the image archives imported into
//! containerd, both charts installed by the Helm library with their
//! default values), and runs the suites that need a real API server,
//! kubelet, containerd and Multus:
//!
//! 1. `the_release_becomes_available` (`kubectl wait … --for
//!    condition=Available`, with the agent and both operator replicas ready);
//! 2. the release suite, `flatnet-operator/tests/e2e_release.rs`: flat pods
//!    through Multus, traffic, services, StatefulSets, webhook, MTU,
//!    agent restart, leader failover;
//! 3. `helm upgrade` with a changed value, Available again; then
//!    `tests/e2e_rbac.rs` reads the API server's audit log: no request of
//!    flatnet's ServiceAccounts was refused, and the grants none used are
//!    listed;
//! 4. `helm uninstall` of both charts, then `nothing_is_left_after_uninstall`;
//! 5. the suites that run the operator in their own process
//!    (`tests/e2e_*.rs` of the operator) against the same API server.
//!
//! The cluster is torn down at the end, whatever happened (`--keep` leaves
//! it up for a look).

use std::{path::PathBuf, process::Command};

use anyhow::{Context, bail};
use clap::Args;

use crate::{
    charts, cluster,
    images::{ChartImages, Component},
    release,
    test_report::{Totals, run_tests},
    workspace,
};

/// The namespace docs/installation.md installs into.
const NAMESPACE: &str = "cattle-flat-network";
const HELM_SCRIPT: &str = "xtask/charts/release.py";
/// The operator's suites that run the controllers in their own process.
const IN_PROCESS_SUITES: &[&str] = &[
    "e2e_allocation",
    "e2e_services",
    "e2e_webhook",
    "e2e_migrate",
];

/// Options of `cargo xtask e2e`.
#[derive(Args, Default)]
pub struct E2eArgs {
    /// Use the release already in target/flatnet-<version> instead of
    /// building it.
    #[arg(long)]
    pub skip_release: bool,
    /// Leave the cluster running at the end.
    #[arg(long)]
    pub keep: bool,
}

/// Runs the tier; counts its suites into `totals`.
pub fn run(args: &E2eArgs, totals: &mut Totals) -> anyhow::Result<()> {
    let (release_dir, version) = release_dir(args.skip_release)?;
    let cluster = cluster::up(&cluster::Options::default())?;
    let outcome = on_cluster(&cluster, &release_dir, &version, totals);
    if args.keep {
        println!(
            "the cluster stays up: KUBECONFIG={} (cargo xtask cluster down removes it)",
            cluster.kubeconfig.display()
        );
    } else {
        cluster::down()?;
    }
    outcome
}

/// The release in `release_dir` (built by `cargo xtask release`, or by
/// this when `skip_release` is false), and the chart's version.
pub fn release_dir(skip_release: bool) -> anyhow::Result<(PathBuf, String)> {
    let root = workspace::root();
    let chart = ChartImages::read(&root)?;
    let dir = if skip_release {
        root.join(format!("target/flatnet-{}", chart.app_version))
    } else {
        release::run(&release::ReleaseArgs::default())?
    };
    Ok((dir, chart.app_version))
}

/// Imports the release's images into the cluster's containerd and installs
/// its two charts with their default values, as a user does.
pub fn install(
    cluster: &cluster::Cluster,
    release_dir: &std::path::Path,
    version: &str,
) -> anyhow::Result<()> {
    let chart = ChartImages::read(&workspace::root())?;
    for component in Component::ALL {
        let archive = release_dir.join(format!("flatnet-{}-{version}.oci.tar", component.key()));
        cluster::import_image(&archive, &chart.qualified_reference(component))?;
    }
    let helm = Helm {
        kubeconfig: cluster.kubeconfig.clone(),
    };
    let crd_chart = release_dir.join(format!("flatnet-crd-{version}.tgz"));
    let chart = release_dir.join(format!("flatnet-{version}.tgz"));
    helm.run(&["install", path(&crd_chart)?, "flatnet-crd", NAMESPACE])?;
    helm.run(&["install", path(&chart)?, "flatnet", NAMESPACE])
}

fn on_cluster(
    cluster: &cluster::Cluster,
    release_dir: &std::path::Path,
    version: &str,
    totals: &mut Totals,
) -> anyhow::Result<()> {
    install(cluster, release_dir, version)?;
    let helm = Helm {
        kubeconfig: cluster.kubeconfig.clone(),
    };
    let chart = release_dir.join(format!("flatnet-{version}.tgz"));

    let test_file = |file: &str, filter: &[&str]| {
        let mut cargo = workspace::cargo(None);
        cargo
            .args(["test", "-p", "flatnet-operator", "--test", file, "--"])
            .args(filter)
            .envs(test_env(cluster));
        cargo
    };
    let suite = |filter: &[&str]| test_file("e2e_release", filter);
    run_tests(
        "real cluster: the release becomes Available",
        &mut suite(&["--ignored", "--exact", "the_release_becomes_available"]),
        totals,
    )?;
    run_tests("real cluster: the release suite", &mut suite(&[]), totals)?;

    // A changed value rolls out without a conflict between Helm and the
    // operator over any field.
    helm.run(&[
        "upgrade",
        path(&chart)?,
        "flatnet",
        NAMESPACE,
        "--set",
        "agent.logLevel=debug",
    ])?;
    run_tests(
        "real cluster: Available after helm upgrade",
        &mut suite(&["--ignored", "--exact", "the_release_becomes_available"]),
        totals,
    )?;
    // Everything above ran with the chart's ServiceAccounts: none was
    // refused a request, and what they never used is listed.
    run_tests(
        "real cluster: the RBAC flatnet's ServiceAccounts used",
        &mut test_file("e2e_rbac", &["--ignored", "--nocapture"]),
        totals,
    )?;

    helm.run(&["uninstall", "flatnet", NAMESPACE])?;
    helm.run(&["uninstall", "flatnet-crd", NAMESPACE])?;
    run_tests(
        "real cluster: nothing left after helm uninstall",
        &mut suite(&["--ignored", "--exact", "nothing_is_left_after_uninstall"]),
        totals,
    )?;

    for name in IN_PROCESS_SUITES {
        let mut cargo = workspace::cargo(None);
        cargo
            .args(["test", "-p", "flatnet-operator", "--test", name])
            .envs(test_env(cluster));
        run_tests(&format!("real cluster: {name}"), &mut cargo, totals)?;
    }
    Ok(())
}

/// What the suites need to know of the cluster.
pub fn test_env(cluster: &cluster::Cluster) -> Vec<(&'static str, String)> {
    let lan = &cluster.lan_hosts[0];
    let prefix = |subnet: &str| {
        subnet
            .split_once('/')
            .map(|(_, p)| p.to_owned())
            .unwrap_or_default()
    };
    vec![
        ("KUBECONFIG", cluster.kubeconfig.display().to_string()),
        ("FLATNET_E2E", "1".into()),
        ("FLATNET_E2E_RELEASE", "1".into()),
        ("FLATNET_E2E_LAN_NETNS", lan.netns.into()),
        ("FLATNET_E2E_MASTER", cluster.lan_bridge.into()),
        (
            "FLATNET_E2E_LAN_V4",
            format!("{}/{}", lan.ipv4, prefix(cluster::LAN_SUBNET_V4)),
        ),
        (
            "FLATNET_E2E_LAN_V6",
            format!("{}/{}", lan.ipv6, prefix(cluster::LAN_SUBNET_V6)),
        ),
        ("FLATNET_E2E_IMAGE", cluster::TEST_IMAGE.into()),
        (
            "FLATNET_E2E_AUDIT_LOG",
            cluster::audit_log().display().to_string(),
        ),
    ]
}

fn path(path: &std::path::Path) -> anyhow::Result<&str> {
    path.to_str()
        .with_context(|| format!("{} is not UTF-8", path.display()))
}

/// The Helm library (`xtask/charts/release.py`) against the cluster.
struct Helm {
    kubeconfig: PathBuf,
}

impl Helm {
    fn run(&self, args: &[&str]) -> anyhow::Result<()> {
        let root = workspace::root();
        let mut command = Command::new(charts::python()?);
        command
            .arg(root.join(HELM_SCRIPT))
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(args);
        let step = format!("helm {}", args.first().copied().unwrap_or_default());
        workspace::run(&step, &mut command)
    }
}

/// Whether the tier can run here: the Kubernetes binaries are found.
/// Prints why not.
pub fn available() -> bool {
    let found = cluster::binaries_found().is_some();
    if !found {
        println!("skipped: the real-cluster tier: {}", missing());
    }
    found
}

/// Fails when the tier is required and cannot run.
pub fn require() -> anyhow::Result<()> {
    if cluster::binaries_found().is_none() {
        bail!(
            "the real-cluster tier is required here and cannot run: {}",
            missing()
        );
    }
    Ok(())
}

fn missing() -> String {
    format!(
        "no Kubernetes binaries in {} (set {} to their directory)",
        cluster::kube_dir(None).display(),
        cluster::KUBE_DIR_VAR
    )
}
