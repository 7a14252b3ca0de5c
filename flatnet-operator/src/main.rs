//! flatnet-operator binary: parse the configuration and run until stopped.

use std::process::ExitCode;

use anyhow::Context as _;
use flatnet_operator::{config::Cli, leader::Outcome, runtime, telemetry};

#[tokio::main]
async fn main() -> anyhow::Result<ExitCode> {
    let mut cli = Cli::parse_args();
    if let Some(command) = cli.command.take() {
        flatnet_operator::migrate::run(command, cli.kubeconfig, cli.network_attachment).await?;
        return Ok(ExitCode::SUCCESS);
    }
    let fallbacks = cli.fallbacks();
    let config = cli.into_config().context("invalid configuration")?;
    telemetry::init(config.log_format, config.debug);
    for warning in fallbacks {
        tracing::warn!("{warning}");
    }
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        cluster_cidrs = ?config.cluster_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>(),
        service_cidrs = ?config.service_cidrs.iter().map(ToString::to_string).collect::<Vec<_>>(),
        "starting flatnet-operator"
    );
    match runtime::run(config).await? {
        Outcome::Shutdown => Ok(ExitCode::SUCCESS),
        Outcome::LeaseLost => {
            tracing::error!("exiting after losing the leader lease so the pod restarts fresh");
            Ok(ExitCode::FAILURE)
        }
        Outcome::ControllersEnded => {
            tracing::error!("controllers stopped unexpectedly");
            Ok(ExitCode::FAILURE)
        }
    }
}
