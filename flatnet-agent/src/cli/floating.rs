//! `flatnet-agent floating`: serve the floating addresses of the standalone
//! state file's `floating` section (heartbeats with the peers, election,
//! leased responder entries, announcements, the backend pods' addresses)
//! until stopped. SIGTERM or SIGINT removes the addresses from the backend
//! pods first; killing it is safe too: the leases run out, a peer takes
//! over, and the next start removes what the pods still hold.

use std::{
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use anyhow::Context;
use clap::Args;
use flatnet_agent::{
    desired::standalone::StateFile,
    floating::{
        backends::{self, PodBackends},
        owner,
    },
    records::DEFAULT_RECORD_DIR,
};

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
    /// The agent's attachment records, where the backends' pods are found.
    #[arg(long, env = "FLATNET_RECORD_DIR", default_value = DEFAULT_RECORD_DIR)]
    record_dir: PathBuf,
    /// Where the floating addresses put on pods are recorded.
    #[arg(long, env = "FLATNET_STATE_DIR", default_value = "/var/lib/flatnet")]
    state_dir: PathBuf,
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
        std::fs::create_dir_all(&self.state_dir)
            .with_context(|| format!("create {}", self.state_dir.display()))?;
        let pods = PodBackends::open(
            &section,
            &self.record_dir,
            &self.state_dir,
            backends::settle_time(&settings),
        )?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .context("start the runtime")?;
        let stop = Arc::new(AtomicBool::new(false));
        runtime.spawn({
            let stop = Arc::clone(&stop);
            async move {
                use tokio::signal::unix::{SignalKind, signal};
                let (Ok(mut term), Ok(mut int)) = (
                    signal(SignalKind::terminate()),
                    signal(SignalKind::interrupt()),
                ) else {
                    tracing::warn!("cannot catch SIGTERM/SIGINT: stopping leaves the pods' addresses to the next start");
                    return;
                };
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
                tracing::info!("stopping: removing the floating addresses from the backend pods");
                stop.store(true, Ordering::Relaxed);
            }
        });
        tracing::info!(node = %settings.node, interface = %section.interface, addresses = ?section.addresses, backends = ?section.backends, "serving floating addresses");
        backends::serve(
            runtime.handle(),
            &settings,
            assignment,
            pods,
            &stop,
            |event| tracing::info!(?event, "floating"),
        )?;
        Ok(())
    }
}
