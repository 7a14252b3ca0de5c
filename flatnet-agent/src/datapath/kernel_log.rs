//! Kernel log records (aya-log) as `tracing` events.
//!
//! The programs log their rare paths (answers, conflicts, drops) at debug
//! level under the target [`KERNEL_LOG_TARGET`]. Whether they log at all is
//! fixed when the object is loaded: when this process's subscriber does not
//! want debug events of that target, the level is set to off and the
//! verifier removes the logging code, so the programs pay nothing.

use aya::{Ebpf, EbpfLoader};
use tokio::io::unix::AsyncFd;

use super::DatapathError;

/// The `tracing` target of kernel log records (`FLATNET_LOG=flatnet_ebpf=debug`).
pub const KERNEL_LOG_TARGET: &str = "flatnet_ebpf";

/// aya-log's level value for "log nothing".
static LEVEL_OFF: u8 = 0;
/// aya-log's level value for debug (and everything more severe).
static LEVEL_DEBUG: u8 = 4;

/// Whether the current subscriber wants the programs' debug records.
pub fn kernel_logs_wanted() -> bool {
    tracing::enabled!(target: KERNEL_LOG_TARGET, tracing::Level::DEBUG)
}

/// Sets the programs' log level before loading: debug when `wanted`, else off.
pub(super) fn set_level(loader: &mut EbpfLoader<'_>, wanted: bool) {
    let level = if wanted { &LEVEL_DEBUG } else { &LEVEL_OFF };
    loader.override_global(aya_log::LEVEL, level, true);
}

/// Reads the programs' log records and emits them as `tracing` events
/// (through the `log` bridge the subscriber installs).
pub struct KernelLogs {
    logger: AsyncFd<aya_log::EbpfLogger<&'static dyn log::Log>>,
}

impl KernelLogs {
    /// Takes the log ring buffer of `ebpf`. Must be called inside a tokio runtime.
    pub(super) fn new(ebpf: &mut Ebpf) -> Result<Self, DatapathError> {
        let logger = aya_log::EbpfLogger::init(ebpf)
            .map_err(|e| DatapathError::Io(std::io::Error::other(e)))?;
        // SAFETY: the logger owns its ring buffer fd, which stays open and
        // unchanged until the AsyncFd (and the logger inside it) is dropped.
        let logger =
            unsafe { AsyncFd::register(logger) }.map_err(|e| DatapathError::Io(e.into()))?;
        Ok(Self { logger })
    }

    /// Forwards the records waiting now, without waiting for more.
    pub fn flush(&mut self) {
        self.logger.get_mut().flush();
    }

    /// Forwards records as they arrive (woken by the ring buffer, no
    /// polling interval) until the ring buffer fails.
    pub async fn forward(mut self) {
        loop {
            match self.logger.readable_mut().await {
                Ok(mut guard) => {
                    guard.get_inner_mut().flush();
                    guard.clear_ready();
                }
                Err(error) => {
                    tracing::error!(%error, "kernel log ring buffer failed; kernel logs stop");
                    return;
                }
            }
        }
    }
}
