//! flatnet's developer commands: `cargo xtask <command>`.

mod crds;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "flatnet developer commands")]
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
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crds { check } => crds::run(check),
    }
}
