//! Booting the VM with qemu: choosing the accelerator, streaming the serial
//! console and enforcing the timeout.

use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::initramfs::{
    INIT_STARTED_MARKER, READY_MARKER, RUN_TAG, WORKSPACE_PARAM, WORKSPACE_TAG,
    check_workspace_path,
};
use super::kernel::Kernel;

const QEMU: &str = "qemu-system-x86_64";
/// A working KVM reaches the kernel's "no root file system" panic in a few
/// seconds; a broken one fails at once or hangs.
const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(20);
/// Printed by the kernel on a panic; with `panic=-1` and `-no-reboot` qemu then exits.
const PANIC_MARKER: &str = "Kernel panic";

/// `--kvm`: whether to use KVM.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvmMode {
    /// Use KVM if a probe boot under KVM succeeds, TCG otherwise.
    Auto,
    /// Always KVM.
    On,
    /// Always TCG (software emulation).
    Off,
}

/// qemu's accelerator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
}

impl fmt::Display for Accel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Kvm => "KVM",
            Self::Tcg => "TCG",
        })
    }
}

impl Accel {
    fn qemu_args(self) -> &'static [&'static str] {
        match self {
            Self::Kvm => &["-accel", "kvm", "-cpu", "host"],
            // qemu's default CPU model: with `-cpu max` the kernel boots about
            // 40% slower under TCG, emulating features nothing here needs.
            Self::Tcg => &["-accel", "tcg"],
        }
    }
}

/// Fails with the provisioning hint when qemu is not installed.
pub fn check_installed() -> Result<()> {
    match Command::new(QEMU).arg("--version").output() {
        Ok(output) if output.status.success() => Ok(()),
        _ => bail!(
            "{QEMU} is not installed: run `cargo xtask vm-test --prepare` \
             (installs qemu-system-x86 from bookworm-backports)"
        ),
    }
}

/// Picks the accelerator for `--kvm`.
///
/// `/dev/kvm` existing is not enough: on some machines KVM cannot run a stock
/// kernel, so `auto` boots the kernel under KVM once and uses KVM only if the
/// kernel gets as far as looking for its root file system.
pub fn choose_accel(mode: KvmMode, kernel: &Kernel) -> Result<Accel> {
    check_installed()?;
    match mode {
        KvmMode::On => Ok(Accel::Kvm),
        KvmMode::Off => Ok(Accel::Tcg),
        KvmMode::Auto if !Path::new("/dev/kvm").exists() => {
            eprintln!("vm-test: no /dev/kvm: using TCG");
            Ok(Accel::Tcg)
        }
        KvmMode::Auto => {
            let started = Instant::now();
            let works = kvm_boots(kernel)?;
            eprintln!(
                "vm-test: KVM probe ({:.1} s): {}",
                started.elapsed().as_secs_f64(),
                if works {
                    "KVM boots the kernel, using KVM"
                } else {
                    "KVM cannot boot the kernel here, using TCG"
                }
            );
            Ok(if works { Accel::Kvm } else { Accel::Tcg })
        }
    }
}

/// Boots the kernel without an initramfs under KVM and reports whether it
/// reached the panic about its missing root file system.
fn kvm_boots(kernel: &Kernel) -> Result<bool> {
    let mut command = Command::new(QEMU);
    command
        .args(Accel::Kvm.qemu_args())
        .args(["-m", "256"])
        .args(COMMON_ARGS)
        .arg("-kernel")
        .arg(kernel.boot_image())
        .args(["-append", "console=ttyS0 panic=-1 loglevel=1"])
        .args(CONSOLE_ARGS)
        .stderr(Stdio::null());
    let ended = supervise(&mut command, KVM_PROBE_TIMEOUT, |line| {
        if line.contains(PANIC_MARKER) {
            Flow::Stop
        } else {
            Flow::Continue
        }
    })?;
    Ok(matches!(ended, Ended::Stopped))
}

/// Machine options every boot uses: no default devices, no reboot (a panic or
/// a power-off ends qemu), no display.
const COMMON_ARGS: &[&str] = &[
    "-machine",
    "pc",
    "-nodefaults",
    "-no-user-config",
    "-no-reboot",
    "-display",
    "none",
];
/// The serial console on qemu's stdout, where the host reads it.
const CONSOLE_ARGS: &[&str] = &[
    "-chardev",
    "stdio,id=console,signal=off",
    "-serial",
    "chardev:console",
];

/// One boot of the test VM.
pub struct Vm<'a> {
    pub accel: Accel,
    pub memory_mib: u32,
    pub cpus: u32,
    pub kernel: &'a Kernel,
    pub initramfs: &'a Path,
    /// Host directory mounted at `GUEST_RUN_DIR`.
    pub run_share: &'a Path,
    /// The workspace, mounted at the same path in the VM.
    pub workspace_share: &'a Path,
    pub timeout: Duration,
}

/// How a boot went.
pub struct Outcome {
    /// Time from starting qemu until `/init` printed its first line.
    pub init_started: Option<Duration>,
    /// Time until modules and shares were ready and the programs started.
    pub ready: Option<Duration>,
    /// Time qemu ran.
    pub total: Duration,
    /// Why the VM did not end cleanly, if it did not.
    pub problem: Option<String>,
}

impl Vm<'_> {
    /// Boots the VM, streams its console to stdout and waits for it to power off.
    pub fn run(&self) -> Result<Outcome> {
        let workspace = check_workspace_path(self.workspace_share)?;
        // mitigations=off: the VM is disposable and runs only our programs, and
        // the mitigations cost boot and run time under emulation.
        // dummy.numdummies=0: tests create their own dummy links, no dummy0.
        let cmdline = format!(
            "console=ttyS0 quiet panic=-1 mitigations=off dummy.numdummies=0 \
             {WORKSPACE_PARAM}={workspace}"
        );
        let mut command = Command::new(QEMU);
        command
            .args(self.accel.qemu_args())
            .args(["-m", &self.memory_mib.to_string()])
            .args(["-smp", &self.cpus.to_string()])
            .args(COMMON_ARGS)
            .arg("-kernel")
            .arg(self.kernel.boot_image())
            .arg("-initrd")
            .arg(self.initramfs)
            .args(["-append", &cmdline])
            .args(CONSOLE_ARGS)
            .args(["-virtfs", &share(self.run_share, RUN_TAG)?])
            .args(["-virtfs", &share(self.workspace_share, WORKSPACE_TAG)?]);

        let started = Instant::now();
        let (mut init_started, mut ready, mut panicked) = (None, None, false);
        let stdout = std::io::stdout();
        let ended = supervise(&mut command, self.timeout, |line| {
            // A console that cannot be written (closed pipe) must not stop the VM.
            let _ = writeln!(stdout.lock(), "{line}");
            if line.contains(INIT_STARTED_MARKER) {
                init_started.get_or_insert(started.elapsed());
            } else if line.contains(READY_MARKER) {
                ready.get_or_insert(started.elapsed());
            } else if line.contains(PANIC_MARKER) {
                panicked = true;
            }
            Flow::Continue
        })?;
        let total = started.elapsed();

        let problem = match ended {
            Ended::TimedOut => Some(format!(
                "the VM did not finish within {} s (raise --timeout?)",
                self.timeout.as_secs()
            )),
            _ if panicked => Some("the VM's kernel panicked (see the console above)".into()),
            Ended::Exited(status) if !status.success() => Some(format!("qemu failed: {status}")),
            _ if ready.is_none() => {
                Some("the VM stopped before running the programs (see the console above)".into())
            }
            _ => None,
        };
        Ok(Outcome {
            init_started,
            ready,
            total,
            problem,
        })
    }
}

/// The `-virtfs` option sharing `dir` under `tag`. `security_model=none`
/// keeps the host's ownership, so root in the VM writes files as root.
fn share(dir: &Path, tag: &str) -> Result<String> {
    let path = dir.to_str().context("a shared path is not UTF-8")?;
    if path.contains(',') {
        bail!("qemu cannot share `{path}`: its path contains a comma");
    }
    Ok(format!(
        "local,path={path},mount_tag={tag},security_model=none"
    ))
}

/// What the console callback wants next.
enum Flow {
    Continue,
    Stop,
}

/// How a supervised qemu ended.
enum Ended {
    Exited(ExitStatus),
    /// The callback asked to stop it, so it was killed.
    Stopped,
    TimedOut,
}

/// Runs `command`, handing each console line to `on_line`, and kills it when
/// `on_line` says stop or `timeout` passes.
fn supervise(
    command: &mut Command,
    timeout: Duration,
    mut on_line: impl FnMut(&str) -> Flow,
) -> Result<Ended> {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start {QEMU}"))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let (lines, received) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut stdout = BufReader::new(stdout);
        let mut line = Vec::new();
        while matches!(stdout.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            let text = String::from_utf8_lossy(&line);
            if lines
                .send(text.trim_end_matches(['\r', '\n']).to_string())
                .is_err()
            {
                break;
            }
            line.clear();
        }
    });

    let deadline = Instant::now() + timeout;
    let ended = loop {
        match received.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => {
                if let Flow::Stop = on_line(&line) {
                    break Some(Ended::Stopped);
                }
            }
            Err(RecvTimeoutError::Timeout) => break Some(Ended::TimedOut),
            // qemu closed its console: it has exited or is about to.
            Err(RecvTimeoutError::Disconnected) => break None,
        }
    };
    if ended.is_some() {
        // Ignore the error of a child that exited just now by itself.
        let _ = child.kill();
    }
    let status = child
        .wait()
        .with_context(|| format!("cannot wait for {QEMU}"))?;
    let _ = reader.join();
    Ok(ended.unwrap_or(Ended::Exited(status)))
}
