//! `flatnet-agent`: the flatnet node daemon and its operator commands.

mod cli;

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let cli = cli::Cli::parse();
    cli.logging.init();
    cli.command.run()
}
