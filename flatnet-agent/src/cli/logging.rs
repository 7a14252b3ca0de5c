//! Log set-up shared by every subcommand.

use clap::{Args, ValueEnum};
use flatnet_agent::phases::PhaseTimings;
use tracing_subscriber::{EnvFilter, Layer, layer::SubscriberExt, util::SubscriberInitExt};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Args, Debug)]
pub struct LoggingArgs {
    /// Log filter (`info`, `debug`, `flatnet_agent=trace`, ...).
    #[arg(long, env = "FLATNET_LOG", default_value = "info", global = true)]
    log_level: String,
    /// Log line format.
    #[arg(
        long,
        env = "FLATNET_LOG_FORMAT",
        value_enum,
        default_value = "text",
        global = true
    )]
    log_format: LogFormat,
}

impl LoggingArgs {
    /// Installs the global subscriber; logs go to stderr so command output
    /// on stdout stays machine-readable.
    pub fn init(&self) {
        let filter = EnvFilter::try_new(&self.log_level).unwrap_or_else(|e| {
            eprintln!(
                "invalid --log-level {:?} ({e}); using \"info\"",
                self.log_level
            );
            EnvFilter::new("info")
        });
        // The log filter applies to the log layer only: CNI phase timings
        // are recorded whatever the log level.
        let log = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
        let log = match self.log_format {
            LogFormat::Text => log.with_filter(filter).boxed(),
            LogFormat::Json => log.json().with_filter(filter).boxed(),
        };
        tracing_subscriber::registry()
            .with(log)
            .with(PhaseTimings)
            .init();
    }
}
