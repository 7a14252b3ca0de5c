//! Running commands for the lab, promptly stopped when the lab is
//! interrupted, and the SIGINT/SIGTERM handling itself.

use std::{
    io::{Read, Write},
    process::{Child, Command, Output, Stdio},
    sync::atomic::{AtomicBool, Ordering},
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

/// Set by the signal handler; every wait in the lab polls it.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// How often waits look at the interrupt flag and their child.
pub const POLL: Duration = Duration::from_millis(25);

/// Installs the SIGINT/SIGTERM/SIGHUP handler. The first signal sets the
/// flag: the running step stops at its next poll and the lab cleans up and
/// reports. A second signal runs `emergency_cleanup` and exits at once.
/// Installed once per process: later calls (`cargo xtask test` runs several
/// labs in one process) keep the first handler.
pub fn install_handler(emergency_cleanup: fn()) -> anyhow::Result<()> {
    static INSTALLED: AtomicBool = AtomicBool::new(false);
    if INSTALLED.swap(true, Ordering::SeqCst) {
        return Ok(());
    }
    ctrlc::set_handler(move || {
        if INTERRUPTED.swap(true, Ordering::SeqCst) {
            eprintln!("\n[lab] interrupted again: cleaning up and exiting");
            emergency_cleanup();
            std::process::exit(130);
        }
        eprintln!("\n[lab] interrupted: stopping the current step, then cleaning up");
    })
    .context("install the SIGINT/SIGTERM handler")
}

/// Whether the lab was interrupted.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// Fails when the lab was interrupted; called between units of work.
pub fn check_interrupt() -> anyhow::Result<()> {
    if interrupted() {
        bail!(Interrupted);
    }
    Ok(())
}

/// The error a step returns when the lab was interrupted.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// Sends SIGINT to this process, as Ctrl-C would, and waits until the
/// handler has seen it (`--interrupt-after`).
pub fn interrupt_self() {
    // SAFETY: kill(2) on our own pid with a valid signal number.
    unsafe { libc::kill(libc::getpid(), libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(5);
    while !interrupted() && Instant::now() < deadline {
        thread::sleep(POLL);
    }
}

/// Sleeps `duration` in small slices, failing early on interrupt.
pub fn sleep(duration: Duration) -> anyhow::Result<()> {
    let until = Instant::now() + duration;
    while Instant::now() < until {
        check_interrupt()?;
        thread::sleep(POLL.min(until.saturating_duration_since(Instant::now())));
    }
    Ok(())
}

/// Runs `command` with `stdin` as its input and returns its output,
/// whatever its exit status. The child is killed if the lab is interrupted.
pub fn output(command: &mut Command, stdin: &[u8]) -> anyhow::Result<Output> {
    check_interrupt()?;
    let line = describe(command);
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot run {line}"))?;
    // A program may exit before reading its input; its output says why.
    let _ = child.stdin.take().expect("piped").write_all(stdin);
    // Drained on threads so a chatty child never blocks on a full pipe.
    let stdout = drain(child.stdout.take().expect("piped"));
    let stderr = drain(child.stderr.take().expect("piped"));
    wait_polling(&mut child).with_context(|| format!("waiting for {line}"))?;
    Ok(Output {
        status: child.wait()?,
        stdout: stdout.join().unwrap_or_default(),
        stderr: stderr.join().unwrap_or_default(),
    })
}

fn drain(mut pipe: impl Read + Send + 'static) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut bytes = Vec::new();
        let _ = pipe.read_to_end(&mut bytes);
        bytes
    })
}

/// Runs `program args...` and returns its stdout; fails with its stderr.
pub fn run(program: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut command = Command::new(program);
    command.args(args);
    let out = output(&mut command, &[])?;
    if !out.status.success() {
        bail!(
            "{program} {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ip -n <netns> args...`.
pub fn ip(netns: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut full = vec!["-n", netns];
    full.extend_from_slice(args);
    run("ip", &full)
}

/// `ip netns exec <netns> program args...`.
pub fn exec_in(netns: &str, program: &str, args: &[&str]) -> anyhow::Result<String> {
    let mut full = vec!["netns", "exec", netns, program];
    full.extend_from_slice(args);
    run("ip", &full)
}

/// Waits for `child` to exit, killing it when the lab is interrupted.
fn wait_polling(child: &mut Child) -> anyhow::Result<()> {
    loop {
        if child.try_wait()?.is_some() {
            return Ok(());
        }
        if interrupted() {
            let _ = child.kill();
            let _ = child.wait();
            bail!(Interrupted);
        }
        thread::sleep(POLL);
    }
}

fn describe(command: &Command) -> String {
    let mut line = command.get_program().to_string_lossy().into_owned();
    for arg in command.get_args() {
        line.push(' ');
        line.push_str(&arg.to_string_lossy());
    }
    line
}
