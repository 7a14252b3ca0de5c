//! `cargo xtask vm-test --prepare`: provisioning a machine (such as a fresh CI
//! machine) for VM tests. Each step skips what is already present.

use std::path::Path;

use anyhow::Result;

use super::kernel::{self, KernelSpec};
use super::{apt, initramfs, qemu, timed};

/// Installs qemu and the host tools, fetches the kernel and busybox and
/// builds the initramfs, printing each step with its duration.
pub fn provision(cache: &Path, kernel_spec: &KernelSpec) -> Result<()> {
    timed("install qemu-system-x86", install_qemu)?;
    timed("install iproute2 and bpftool", install_host_tools)?;
    let kernel = timed("fetch the kernel", || kernel::fetch(cache, kernel_spec))?;
    let busybox = timed("fetch busybox", || initramfs::fetch_busybox(cache))?;
    timed("build the initramfs", || {
        initramfs::build(cache, &kernel, &busybox)
    })?;
    Ok(())
}

/// Debian 12's own qemu-system-x86 conflicts with the machines' qemu-utils
/// from backports, so qemu comes from backports too.
fn install_qemu() -> Result<()> {
    if qemu::check_installed().is_ok() {
        eprintln!("vm-test: qemu is already installed");
        return Ok(());
    }
    apt::enable_backports()?;
    apt::install(&["qemu-system-x86"], Some(apt::BACKPORTS))
}

fn install_host_tools() -> Result<()> {
    let mut missing: Vec<&str> = initramfs::HOST_TOOLS
        .iter()
        .filter(|(tool, _)| initramfs::find_host_tool(tool).is_err())
        .map(|&(_, package)| package)
        .collect();
    missing.dedup();
    if missing.is_empty() {
        eprintln!("vm-test: iproute2 and bpftool are already installed");
        return Ok(());
    }
    apt::install(&missing, None)
}
