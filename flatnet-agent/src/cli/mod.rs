//! Command-line interface of `flatnet-agent`.

mod datapath;
mod floating;
mod inspect;
mod logging;
mod policy;
mod run;

use clap::{Parser, Subcommand};

/// flatnet node agent: pod interfaces on flat L2 networks, CNI service and
/// eBPF data plane.
#[derive(Parser, Debug)]
#[command(name = "flatnet-agent", version, about)]
pub struct Cli {
    #[command(flatten)]
    pub logging: logging::LoggingArgs,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Load, attach, detach and inspect the eBPF programs by hand.
    #[command(subcommand)]
    Datapath(datapath::DatapathCommand),
    /// Serve the floating addresses of the standalone state file's
    /// `floating` section with the peers listed there, until killed.
    Floating(floating::FloatingArgs),
    /// Show the pinned data-plane state: counters, answered and watched addresses.
    #[command(subcommand)]
    Inspect(inspect::InspectCommand),
    /// Run the node daemon: install flatnet-cni, load the data plane and
    /// serve CNI requests until SIGTERM/SIGINT.
    Run(Box<run::RunArgs>),
}

impl Command {
    pub fn run(self) -> anyhow::Result<()> {
        match self {
            Command::Datapath(cmd) => cmd.run(),
            Command::Floating(args) => args.run(),
            Command::Inspect(cmd) => cmd.run(),
            Command::Run(args) => args.run(),
        }
    }
}
