//! `cargo xtask chaos`: the allocation controllers of two operator replicas
//! under random operations, replica kills and API faults
//! (`flatnet_operator::chaos`), run as its test binary.

use clap::Args;

use crate::workspace;

/// Options of `cargo xtask chaos`.
#[derive(Args)]
pub struct ChaosArgs {
    /// Seed of the operations, kills and faults (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Operations to run.
    #[arg(long, default_value_t = 10_000)]
    ops: u64,
    /// Run from the test build of the workspace's default members (the one
    /// `cargo test --all-targets` made), not one of the operator alone,
    /// whose other feature set would build the dependencies again.
    #[arg(skip)]
    reuse_workspace_build: bool,
}

impl ChaosArgs {
    /// The short run of `cargo xtask test`: a fixed seed, every fault, two
    /// quiet points (after 1,000 operations and at the end). 21 s on the
    /// 2-core development machine (load 3 to 5).
    pub fn ci() -> Self {
        Self {
            seed: Some(2),
            ops: 2_000,
            reuse_workspace_build: true,
        }
    }
}

/// Runs the chaos harness; fails when an invariant breaks.
pub fn run(args: &ChaosArgs) -> anyhow::Result<()> {
    let mut cargo = workspace::cargo(None);
    cargo.arg("test");
    if !args.reuse_workspace_build {
        cargo.args(["-p", "flatnet-operator"]);
    }
    cargo
        .args(["--lib", "chaos::tests::chaos"])
        .args(["--", "--ignored", "--exact", "--nocapture"])
        .env("FLATNET_CHAOS_OPS", args.ops.to_string());
    if let Some(seed) = args.seed {
        cargo.env("FLATNET_CHAOS_SEED", seed.to_string());
    }
    workspace::run(&format!("chaos ({} operations)", args.ops), &mut cargo)
}
