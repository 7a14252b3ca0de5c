//! flatnet-operator: IPAM, services and admission for flat-network pods.

use clap::Parser;

/// Command-line interface of the operator.
#[derive(Parser, Debug)]
#[command(name = "flatnet-operator", version, about)]
struct Cli {}

fn main() {
    let _cli = Cli::parse();
    eprintln!("flatnet-operator: controllers are not part of this build yet");
    std::process::exit(2);
}
