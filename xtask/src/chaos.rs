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
}

/// Runs the chaos harness; fails when an invariant breaks.
pub fn run(args: &ChaosArgs) -> anyhow::Result<()> {
    let mut cargo = workspace::cargo(None);
    cargo
        .args([
            "test",
            "-p",
            "flatnet-operator",
            "--lib",
            "chaos::tests::chaos",
        ])
        .args(["--", "--ignored", "--exact", "--nocapture"])
        .env("FLATNET_CHAOS_OPS", args.ops.to_string());
    if let Some(seed) = args.seed {
        cargo.env("FLATNET_CHAOS_SEED", seed.to_string());
    }
    workspace::run(&format!("chaos ({} operations)", args.ops), &mut cargo)
}
