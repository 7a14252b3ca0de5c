//! Work inside the lab's network namespaces from this process: sockets are
//! created on a thread that joined the namespace (a socket stays in the
//! namespace it was created in), so the lab itself never changes namespace.

use std::{
    fs::File,
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::{Context, anyhow, bail};

use super::process::{self, POLL};

/// How long a TCP connection or reply is waited for before the exchange
/// counts as failed (a dropped SYN is never answered).
const GIVE_UP: Duration = Duration::from_millis(1500);

/// Runs `work` on a thread that joined the named network namespace.
pub fn in_netns<T: Send>(netns: &str, work: impl FnOnce() -> T + Send) -> anyhow::Result<T> {
    let path = format!("/run/netns/{netns}");
    let file = File::open(&path).with_context(|| format!("open network namespace {path}"))?;
    thread::scope(|scope| {
        scope
            .spawn(|| {
                // SAFETY: setns(2) on an open namespace file; it changes only
                // this short-lived thread's namespace.
                if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                    return Err(anyhow!(
                        "enter network namespace {path}: {}",
                        std::io::Error::last_os_error()
                    ));
                }
                Ok(work())
            })
            .join()
            .map_err(|_| anyhow!("work inside network namespace {netns} panicked"))?
    })
}

/// `GET path` on `address` over HTTP/1.0 from the calling thread's
/// namespace; the body of a 200 answer.
pub fn http_get(address: SocketAddr, path: &str) -> anyhow::Result<String> {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(2))?;
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n")?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("HTTP response without a header end")?;
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        bail!("GET {path}: {}", head.lines().next().unwrap_or_default());
    }
    Ok(body.to_owned())
}

/// A TCP echo server (one byte per connection) inside a namespace, on every
/// address of the namespace, IPv4 and IPv6; stopped when dropped.
pub struct EchoServer {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl EchoServer {
    /// Listens on `[::]:port` in `netns`.
    pub fn start(netns: &str, port: u16) -> anyhow::Result<Self> {
        let listener = in_netns(netns, || TcpListener::bind(("::", port)))?
            .with_context(|| format!("listen on TCP port {port} in {netns}"))?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::spawn({
            let stop = stop.clone();
            move || {
                while !stop.load(Ordering::SeqCst) {
                    match listener.accept() {
                        Ok((mut stream, _)) => {
                            let _ = stream.set_nonblocking(false);
                            let _ = stream.set_read_timeout(Some(GIVE_UP));
                            let mut byte = [0u8; 1];
                            if stream.read_exact(&mut byte).is_ok() {
                                let _ = stream.write_all(&byte);
                            }
                        }
                        Err(_) => thread::sleep(POLL),
                    }
                }
            }
        });
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Connects from `netns` to `target`, sends a byte and reads it back.
/// `Ok(false)` when the connection or the reply does not come (dropped or
/// refused).
pub fn tcp_exchange(netns: &str, target: SocketAddr) -> anyhow::Result<bool> {
    process::check_interrupt()?;
    in_netns(netns, || {
        let Ok(mut stream) = TcpStream::connect_timeout(&target, GIVE_UP) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(GIVE_UP));
        let mut byte = [0u8; 1];
        stream.write_all(b"f").is_ok() && stream.read_exact(&mut byte).is_ok() && &byte == b"f"
    })
}

/// A TCP exchange that must succeed.
pub fn expect_tcp(netns: &str, target: SocketAddr) -> anyhow::Result<()> {
    if !tcp_exchange(netns, target)? {
        bail!("TCP exchange {netns} -> {target} failed");
    }
    Ok(())
}

/// One ICMP echo from `netns` to `target` (IPv4 or IPv6) that must be answered.
pub fn ping(netns: &str, target: &str) -> anyhow::Result<()> {
    let family = if target.contains(':') { "-6" } else { "-4" };
    process::exec_in(netns, "ping", &[family, "-c", "1", "-W", "3", target])
        .map(drop)
        .with_context(|| format!("ping {netns} -> {target}"))
}
