//! `flatnet-cni`: the CNI plugin executable run by the container runtime or
//! Multus. It validates the request, answers VERSION itself, forwards every
//! other command to flatnet-agent over its unix socket and prints the
//! result or error JSON on stdout. It never logs to stdout: with `logFile`
//! in the network configuration it appends its log there, otherwise it
//! writes no log at all.

use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::Mutex;

use flatnet_agent::cni::plugin::{self, LogSettings, PluginOutput};
use flatnet_agent::cni::{CniError, CniVersion, ErrorCode};
use flatnet_agent::rpc::SocketAgent;

fn main() -> ExitCode {
    let mut stdin = Vec::new();
    let output = match std::io::stdin().read_to_end(&mut stdin) {
        Ok(_) => {
            init_logging(&stdin);
            plugin::run(|name| std::env::var_os(name), &stdin, &SocketAgent)
        }
        Err(error) => PluginOutput {
            stdout: CniError::new(ErrorCode::Io, "cannot read the network config from stdin")
                .with_details(error)
                .to_json(CniVersion::LATEST)
                .to_string(),
            exit_code: 1,
        },
    };
    let mut stdout = std::io::stdout().lock();
    // If stdout is gone the runtime cannot read anything anyway; the exit
    // code still tells it the outcome.
    let _ = stdout
        .write_all(output.stdout.as_bytes())
        .and_then(|()| stdout.flush());
    ExitCode::from(u8::try_from(output.exit_code).unwrap_or(1))
}

/// Sends tracing output to `logFile` when the configuration names one.
/// Logging problems never fail the CNI call: they are reported on stderr,
/// which runtimes keep apart from the result.
fn init_logging(stdin: &[u8]) {
    let Some(settings) = LogSettings::peek(stdin) else {
        return;
    };
    let level = tracing::Level::from_str(&settings.log_level).unwrap_or(tracing::Level::INFO);
    if let Some(dir) = settings.log_file.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    match OpenOptions::new()
        .create(true)
        .append(true)
        .open(&settings.log_file)
    {
        Ok(file) => {
            let _ = tracing_subscriber::fmt()
                .with_writer(Mutex::new(file))
                .with_ansi(false)
                .with_max_level(level)
                .try_init();
        }
        Err(error) => eprintln!(
            "flatnet-cni: cannot open log file {}: {error}",
            settings.log_file.display()
        ),
    }
}
