//! flatnet's developer commands: `cargo xtask <command>`.

mod bench;
mod chaos;
mod charts;
mod cluster;
mod crds;
mod e2e;
mod ebpf;
mod fuzz;
mod images;
mod lab;
mod release;
mod tasks;
mod test_report;
mod vm;
mod workspace;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "flatnet developer commands")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Render the CRDs into charts/flatnet-crd/templates/crds.yaml.
    Crds {
        /// Fail if the committed file differs instead of writing it.
        #[arg(long)]
        check: bool,
    },
    /// Lint, render and validate the Helm charts (Helm library, Kubernetes 1.28 schemas)
    /// and check their command lines against the built binaries.
    Charts,
    /// Build the eBPF object (release, with BTF) that the agent embeds.
    BuildEbpf {
        /// Then build it again from a second checkout of HEAD in another
        /// folder and fail unless the two are the same bytes (`cargo xtask
        /// images` does this).
        #[arg(long)]
        compare_checkouts: bool,
    },
    /// Build the operator and agent images into target/images/ and load them into podman.
    Images(images::ImagesArgs),
    /// Benchmarks: cni, throughput, policy, conflicts, hotplug, failover (root) and allocation; each updates docs/benchmarks.md.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Same as `bench policy`.
    #[command(hide = true)]
    BenchPolicy,
    /// Run two operator replicas through random operations, kills and API faults.
    Chaos(chaos::ChaosArgs),
    /// A real single-node Kubernetes (v1.28, Multus thin) on this machine for the
    /// end-to-end tier: up, down, status (root).
    #[command(subcommand)]
    Cluster(cluster::ClusterCommand),
    /// The real-cluster tier: the release installed on `cluster up` and tested there.
    E2e(e2e::E2eArgs),
    /// Run clippy with `-D warnings` on user space and on the eBPF crate.
    Clippy,
    /// Check licenses, duplicate crates and sources against .cargo/deny.toml (offline).
    Deny,
    /// Build the fuzz targets (xtask/fuzz) and run each from its seeds.
    Fuzz(fuzz::FuzzArgs),
    /// Run the lab: a simulated LAN in network namespaces with the real agent.
    Lab(lab::LabArgs),
    /// Package a release into target/flatnet-<version>/: charts, images, checksums, notes.
    Release(release::ReleaseArgs),
    /// Everything CI checks: formatting, eBPF build, clippy, all tests.
    Test(tasks::TestArgs),
    /// Run privileged test binaries inside a VM booted from Debian's 6.1 kernel.
    VmTest(vm::VmTestArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds { check } => crds::run(check),
        Command::Charts => charts::check(&charts::binaries()?),
        Command::BuildEbpf { compare_checkouts } => {
            ebpf::build()?;
            if compare_checkouts {
                ebpf::same_from_another_checkout()?;
            }
            Ok(())
        }
        Command::Images(args) => images::run(&args),
        Command::Bench(command) => bench::run(command),
        Command::BenchPolicy => bench::run(bench::BenchCommand::Policy),
        Command::Chaos(args) => chaos::run(&args),
        Command::Cluster(command) => cluster::run(command),
        Command::E2e(args) => {
            let mut totals = test_report::Totals::default();
            let outcome = e2e::run(&args, &mut totals);
            print!("{}", totals.skip_list());
            println!("{}", totals.summary());
            outcome
        }
        Command::Clippy => tasks::clippy(),
        Command::Deny => tasks::deny(),
        Command::Fuzz(args) => fuzz::run(&args),
        Command::Lab(args) => lab::run(&args),
        Command::Release(args) => release::run(&args).map(drop),
        Command::Test(args) => tasks::test(&args),
        Command::VmTest(args) => vm::run(args),
    }
}
