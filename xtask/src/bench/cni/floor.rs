//! The floor under any plugin's ADD, measured in the same run: starting a
//! static binary that does nothing but exit (what every CNI command pays
//! before its work), and one netlink round trip (the unit of the work).

use std::{
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

/// A static (musl) binary whose `main` is empty, built into `dir`.
pub fn empty_binary(dir: &Path) -> anyhow::Result<PathBuf> {
    let source = dir.join("floor.rs");
    let binary = dir.join("floor");
    std::fs::write(&source, "fn main() {}\n")?;
    let status = Command::new("rustc")
        .args([
            "--edition",
            "2024",
            "--target",
            "x86_64-unknown-linux-musl",
            "-C",
            "opt-level=3",
            "-C",
            "panic=abort",
            "-C",
            "strip=symbols",
            "-o",
        ])
        .arg(&binary)
        .arg(&source)
        .status()
        .context("run rustc for the floor binary")?;
    if !status.success() {
        bail!("rustc could not build the floor binary ({status})");
    }
    Ok(binary)
}

/// One start of `binary`, from spawn to exit, as a runtime starts a plugin.
pub fn exec(binary: &Path) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let status = Command::new(binary)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("run {}", binary.display()))?;
    let took = started.elapsed();
    if !status.success() {
        bail!("{} failed ({status})", binary.display());
    }
    Ok(took)
}

/// `samples` netlink round trips (`RTM_GETLINK` of the loopback
/// interface on one socket), each timed, sorted.
pub fn netlink_round_trips(samples: usize) -> anyhow::Result<Vec<Duration>> {
    // SAFETY: plain socket(2); the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error()).context("open a netlink socket");
    }
    // SAFETY: `fd` is a new socket nothing else owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut out = Vec::with_capacity(samples);
    let mut reply = [0u8; 4096];
    for seq in 0..samples {
        let request = getlink_request(u32::try_from(seq).unwrap_or(u32::MAX), 1);
        let started = Instant::now();
        // SAFETY: `request` is valid for its length; the kernel is the peer
        // of an unbound netlink socket.
        let sent = unsafe {
            libc::send(
                socket.as_raw_fd(),
                request.as_ptr().cast(),
                request.len(),
                0,
            )
        };
        if sent < 0 {
            return Err(std::io::Error::last_os_error()).context("send RTM_GETLINK");
        }
        // SAFETY: `reply` is valid for its length.
        let received = unsafe {
            libc::recv(
                socket.as_raw_fd(),
                reply.as_mut_ptr().cast(),
                reply.len(),
                0,
            )
        };
        if received < 0 {
            return Err(std::io::Error::last_os_error()).context("receive RTM_NEWLINK");
        }
        out.push(started.elapsed());
    }
    out.sort();
    Ok(out)
}

/// `RTM_GETLINK` of interface `index`: a netlink header and an `ifinfomsg`.
fn getlink_request(seq: u32, index: i32) -> Vec<u8> {
    const HEADER: usize = 16;
    const IFINFO: usize = 16;
    let mut message = Vec::with_capacity(HEADER + IFINFO);
    message.extend_from_slice(&u32::try_from(HEADER + IFINFO).unwrap_or(0).to_ne_bytes());
    message.extend_from_slice(&libc::RTM_GETLINK.to_ne_bytes());
    message.extend_from_slice(
        &u16::try_from(libc::NLM_F_REQUEST)
            .unwrap_or(1)
            .to_ne_bytes(),
    );
    message.extend_from_slice(&seq.to_ne_bytes());
    message.extend_from_slice(&0u32.to_ne_bytes());
    // ifinfomsg: family, padding, type, index, flags, change.
    message.extend_from_slice(&[libc::AF_UNSPEC as u8, 0]);
    message.extend_from_slice(&0u16.to_ne_bytes());
    message.extend_from_slice(&index.to_ne_bytes());
    message.extend_from_slice(&0u32.to_ne_bytes());
    message.extend_from_slice(&0u32.to_ne_bytes());
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_is_a_header_and_an_ifinfomsg() {
        let request = getlink_request(7, 1);
        assert_eq!(request.len(), 32);
        assert_eq!(u32::from_ne_bytes(request[0..4].try_into().unwrap()), 32);
        assert_eq!(
            u16::from_ne_bytes(request[4..6].try_into().unwrap()),
            libc::RTM_GETLINK
        );
        assert_eq!(u32::from_ne_bytes(request[8..12].try_into().unwrap()), 7);
        assert_eq!(i32::from_ne_bytes(request[20..24].try_into().unwrap()), 1);
    }

    #[test]
    fn a_round_trip_to_the_kernel_is_answered() {
        let trips = netlink_round_trips(3).unwrap();
        assert_eq!(trips.len(), 3);
        assert!(trips.windows(2).all(|w| w[0] <= w[1]), "sorted");
    }
}
