//! Composite developer tasks: lint, dependency checks and test.

use clap::Args;

use crate::{
    bench, chaos, e2e, ebpf, fuzz, images, lab, release,
    test_report::{Totals, run_tests},
    workspace,
};

/// Options of `cargo xtask test`.
#[derive(Args)]
pub struct TestArgs {
    /// Fail, instead of skipping, tests that need root. Implied when the
    /// `CI` environment variable is true.
    #[arg(long)]
    require_privileged: bool,
}

impl TestArgs {
    fn require_privileged(&self) -> bool {
        self.require_privileged || in_ci()
    }
}

/// Whether the `CI` environment variable is true (`.ci/run` sets it).
fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| matches!(v.as_str(), "true" | "1" | "yes"))
}

/// The real-cluster tier (`cargo xtask e2e`) on the release built above,
/// when the Kubernetes binaries are found; required in CI.
fn real_cluster(totals: &mut Totals) -> anyhow::Result<()> {
    if in_ci() {
        e2e::require()?;
    } else if !e2e::available() {
        return Ok(());
    }
    e2e::run(
        &e2e::E2eArgs {
            skip_release: true,
            keep: false,
        },
        totals,
    )
}

/// Clippy with `-D warnings`: user-space crates, then the eBPF crate.
pub fn clippy() -> anyhow::Result<()> {
    let mut cargo = workspace::cargo(None);
    cargo.args(["clippy", "--all-targets", "--", "-D", "warnings"]);
    workspace::run("clippy (user space)", &mut cargo)?;
    ebpf::clippy()
}

/// The checks of `.cargo/deny.toml` that need no network: licenses, banned and
/// duplicate crates, sources. Advisories need the RustSec database, fetched
/// from GitHub, so they are left to `cargo deny check advisories` where it
/// can be reached.
pub fn deny() -> anyhow::Result<()> {
    let mut cargo = workspace::cargo(None);
    cargo.args([
        "deny",
        "--config",
        ".cargo/deny.toml",
        "check",
        "licenses",
        "bans",
        "sources",
    ]);
    workspace::run("cargo deny (licenses, bans, sources)", &mut cargo)
        .map_err(|e| e.context("cargo-deny is installed by `bash .ci/provision`"))
}

/// Privileged tests that need kernel features this host may lack (ipvlan,
/// 802.1Q) or must prove the programs load on Linux 6.1: run inside the VM.
/// Each entry is a `--cargo-test` target and its libtest filters.
const VM_TESTS: &[(&str, &str)] = &[
    ("flatnet-agent:vm_kernel_features", ""),
    ("flatnet-agent:link_ipvlan_vlan", ""),
    // Linux 6.1 checks new link names in the node's namespace as well.
    (
        "flatnet-agent:link_macvlan",
        "pod_interface_named_like_a_node_interface existing_interface_name",
    ),
    // ipvlan L2/L3 and macvlan on a VLAN through the real flatnet-cni and
    // agent; standalone allocation skipping what the wire inventory shows live.
    (
        "flatnet-agent:agent_standalone",
        "ipvlan_l2_l3_and_vlan an_address_a_silent_foreign_host_used_is_skipped_by_the_next_add",
    ),
    // The tools-free uplink tests (raw sockets and BPF_PROG_TEST_RUN).
    (
        "flatnet-agent:uplink_program",
        "test_run counts_injected reloading",
    ),
    // The policy programs on crafted frames (BPF_PROG_TEST_RUN).
    ("flatnet-agent:policy_program", ""),
    // Unicast replies to hosts resolving a floating address on a VLAN.
    ("flatnet-agent:floating_resolvers", "on_a_vlan"),
    // Failover with the pool's interface a VLAN link of the master.
    ("flatnet-agent:floating_failover", "on_a_vlan"),
    // Node VLANs a PodNetworkConfig asks for, carrying tagged traffic and
    // outliving the last pod on them; ipvlan and VLAN interfaces
    // hot-plugged; MSS clamping on Linux 6.1 (netlink).
    (
        "flatnet-agent:runtime_config",
        "node_vlans a_vlan_the_node_config_asks_for ipvlan_and_vlan_interfaces tcp_mss_clamping",
    ),
    // The MSS clamping programs on crafted frames (BPF_PROG_TEST_RUN).
    ("flatnet-agent:mss_clamp_program", ""),
];

fn vm_tests(totals: &mut Totals) -> anyhow::Result<()> {
    for (target, filters) in VM_TESTS {
        let mut vm = workspace::cargo(None);
        vm.args(["xtask", "vm-test", "--cargo-test", target])
            .args(["--env", "FLATNET_REQUIRE_PRIVILEGED=1"])
            .args(["--env", "FLATNET_REQUIRE_KERNEL_FEATURES=1"]);
        if !filters.is_empty() {
            vm.args(["--test-args", filters]);
        }
        run_tests(&format!("VM tests (Linux 6.1): {target}"), &mut vm, totals)?;
    }
    Ok(())
}

/// The lab inside the VM: Linux 6.1 has ipvlan, so the ipvlan pod, which the
/// host lab skips on kernels without it, runs there. Uses the binaries the
/// host lab built.
fn vm_lab() -> anyhow::Result<()> {
    let mut vm = workspace::cargo(None);
    vm.args(["xtask", "vm-test", "--memory", "1024"])
        .args(["--env", "FLATNET_REQUIRE_KERNEL_FEATURES=1", "--"])
        .args(["target/debug/xtask", "lab", "--skip-build"]);
    workspace::run("the lab on Linux 6.1 (VM)", &mut vm)
}

/// Counts a check that is not a libtest suite as one test.
fn count(totals: &mut Totals, outcome: anyhow::Result<()>) -> anyhow::Result<()> {
    match &outcome {
        Ok(()) => totals.passed += 1,
        Err(_) => totals.failed += 1,
    }
    outcome
}

/// Everything CI checks, in order of increasing cost.
pub fn test(args: &TestArgs) -> anyhow::Result<()> {
    let mut fmt = workspace::cargo(None);
    fmt.args(["fmt", "--all", "--check"]);
    workspace::run("rustfmt", &mut fmt)?;

    ebpf::build()?;
    clippy()?;
    deny()?;
    // One release build serves the images, the chart check against the
    // binaries and the release, so a broken release cannot land.
    images::run(&images::ImagesArgs::default())?;
    release::run(&release::ReleaseArgs { skip_images: true })?;

    let mut tests = workspace::cargo(None);
    tests.args(["test", "--all-targets"]);
    if args.require_privileged() {
        tests.env("FLATNET_REQUIRE_PRIVILEGED", "1");
    }
    // What the agent's tests record for `agent_rbac` is this run's only.
    let accesses = workspace::root().join("target/tmp/agent-accesses");
    if accesses.exists() {
        std::fs::remove_dir_all(&accesses)
            .map_err(|e| anyhow::anyhow!("remove {}: {e}", accesses.display()))?;
    }
    let mut totals = Totals::default();
    let outcome = run_tests(
        "tests (unit, controller, privileged netns)",
        &mut tests,
        &mut totals,
    )
    // The chart's agent RBAC against every request the agent's tests made
    // it send: a grant none used fails (a refused request failed its test).
    .and_then(|()| {
        let mut rbac = workspace::cargo(None);
        rbac.args(["test", "-p", "flatnet-agent", "--test", "agent_rbac", "--", "--ignored"]);
        run_tests("the agent's RBAC, as its tests used it", &mut rbac, &mut totals)
    })
    .and_then(|()| vm_tests(&mut totals))
    // Every fuzz target from its seeds for 10 s (90 s, plus the nightly
    // build of the targets, minutes from nothing): a parser change that
    // breaks a property fails here; the long runs are in docs/reliability.md.
    .and_then(|()| count(&mut totals, fuzz::run(&fuzz::FuzzArgs::ci())))
    // Two operator replicas through 2,000 random operations, replica
    // kills and every API fault (seed 2): 21 s measured, no build (the
    // tests above built it).
    .and_then(|()| count(&mut totals, chaos::run(&chaos::ChaosArgs::ci())))
    // The lab is the smoke test of the whole data plane; an interrupted
    // lab must leave nothing behind.
    .and_then(|()| count(&mut totals, images::verify::run()))
    .and_then(|()| count(&mut totals, lab::run(&lab::LabArgs::default())))
    // The same lab with each node's agent run by podman from its image.
    .and_then(|()| count(&mut totals, lab::run(&lab::LabArgs::with_images())))
    .and_then(|()| count(&mut totals, lab::interrupted_run_leaves_nothing()))
    .and_then(|()| count(&mut totals, vm_lab()))
    // CNI ADD/DEL latency against the reference plugin, same run: fails
    // only on a regression of 2x or more.
    .and_then(|()| count(&mut totals, bench::cni_quick()))
    // Last: the slowest tier, and the one that changes the host most (a
    // node's runtime leaves IPv4 forwarding on, as every Kubernetes node
    // has it; the namespace tests above pass either way).
    .and_then(|()| real_cluster(&mut totals));
    // One closing line over every suite, printed last whatever happened,
    // after the tests that skipped at run time and why.
    print!("{}", totals.skip_list());
    println!("{}", totals.summary());
    outcome
}
