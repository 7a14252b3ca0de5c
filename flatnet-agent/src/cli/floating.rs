//! `flatnet-agent floating`: serve the floating addresses of the standalone
//! state file's `floating` section (heartbeats with the peers, election,
//! leased responder entries, announcements) until killed. Killing it is
//! safe at any moment: the leases run out and a peer takes over.

use std::{path::PathBuf, sync::atomic::AtomicBool};

use anyhow::Context;
use clap::Args;
use flatnet_agent::{desired::standalone::StateFile, floating::owner};

use super::datapath::PinArgs;

#[derive(Args, Debug)]
pub struct FloatingArgs {
    /// The standalone state file holding the `floating` section.
    #[arg(long, env = "FLATNET_STATE_FILE")]
    state_file: PathBuf,
    /// This node's name in heartbeats when the section names none.
    #[arg(long, env = "NODE_NAME")]
    node_name: Option<String>,
    #[command(flatten)]
    pins: PinArgs,
    /// Where to keep the status `flatnet-agent inspect floating` shows.
    #[arg(long, env = "FLATNET_FLOATING_STATUS_FILE", default_value = owner::DEFAULT_STATUS_FILE)]
    status_file: PathBuf,
}

impl FloatingArgs {
    pub fn run(self) -> anyhow::Result<()> {
        let state = StateFile::read(&self.state_file)?;
        let section = state.floating.with_context(|| {
            format!(
                "{} has no `floating` section: add interface, addresses, listen and peers",
                self.state_file.display()
            )
        })?;
        let problems = section.problems();
        anyhow::ensure!(
            problems.is_empty(),
            "{}: {}",
            self.state_file.display(),
            problems.join("; ")
        );
        let node = match self.node_name {
            Some(name) => name,
            None => std::fs::read_to_string("/proc/sys/kernel/hostname")
                .context("read the hostname (set NODE_NAME)")?
                .trim()
                .to_owned(),
        };
        let (mut settings, assignment) = section.settings(&node, self.pins.pin_root);
        settings.status_file = Some(self.status_file);
        tracing::info!(node = %settings.node, interface = %section.interface, addresses = ?section.addresses, "serving floating addresses");
        let stop = AtomicBool::new(false);
        // The sender stays alive for the whole run: the assignment is fixed.
        let (_fixed, assignment) = tokio::sync::watch::channel(assignment);
        owner::run(&settings, &assignment, &stop, |event| {
            tracing::info!(?event, "floating");
        })?;
        Ok(())
    }
}
