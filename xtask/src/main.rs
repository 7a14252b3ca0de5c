//! flatnet's developer commands (`cargo xtask <command>`).

mod vm;

use clap::{Parser, Subcommand};

/// flatnet's developer commands.
#[derive(Parser)]
#[command(name = "xtask")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run privileged test binaries inside a VM booted from Debian's 6.1 kernel.
    VmTest(vm::VmTestArgs),
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::VmTest(args) => vm::run(args),
    }
}
