//! `cargo xtask vm-test`: run privileged test binaries inside a VM booted from
//! Debian's 6.1 kernel.
//!
//! The build machines' kernel lacks ipvlan, 802.1Q VLAN and dummy interfaces,
//! so tests of those features run here instead. The VM is qemu (KVM when it
//! really works, TCG otherwise) booting Debian's `linux-image-6.1.0-*-amd64`
//! with a small initramfs (busybox, iproute2, bpftool, the host's glibc and the
//! kernel modules the tests need). Its `/init` runs the programs from a 9p
//! share, records each exit status there and powers off.
//!
//! Everything downloaded or built is cached under `<target>/vm/`:
//!
//! | path | what |
//! | --- | --- |
//! | `debs/` | the `.deb` packages fetched with `apt-get download` |
//! | `kernel/<version>/` | vmlinuz, the extracted vmlinux and the chosen modules |
//! | `busybox` | the static busybox from Debian's `busybox-static` |
//! | `initramfs-<version>.cpio` | the initramfs, rebuilt when its inputs change |
//! | `run-<pid>/` | one run's share: program copies, libraries, plan and results |

mod apt;
mod bzimage;
mod cpio;
mod initramfs;
mod kernel;
pub(crate) mod ldd;
mod modules;
mod plan;
mod prepare;
mod qemu;
mod workspace;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use self::kernel::KernelSpec;
use self::qemu::KvmMode;

/// Options of `cargo xtask vm-test`.
#[derive(clap::Args, Debug)]
#[command(after_help = "\
Examples:
  cargo xtask vm-test --prepare
  cargo xtask vm-test --cargo-test flatnet-agent:vm_kernel_features
  cargo xtask vm-test --cargo-test flatnet-agent:vm_ipvlan --test-args '--test-threads=1 l3'
  cargo xtask vm-test -- target/debug/deps/foo-0123 --exact a::b , target/debug/deps/bar-4567

The programs run as root in the VM with their working directory in the
workspace, which is shared with the VM at the same path. The command exits
non-zero if any program failed, the VM crashed or the timeout passed.")]
pub struct VmTestArgs {
    /// Kernel to boot: `auto` (the newest cached one, else the 6.1 version that
    /// Debian's linux-image-amd64 depends on), a Debian ABI version such as
    /// `6.1.0-56`, or the path of a linux-image-*.deb.
    #[arg(long, default_value = "auto", value_name = "auto|VERSION|PATH")]
    kernel: KernelSpec,

    /// Memory of the VM in MiB.
    #[arg(long, default_value_t = 512, value_name = "MiB")]
    memory: u32,

    /// Virtual CPUs of the VM. One boots fastest under TCG; more help only
    /// programs that keep several threads busy.
    #[arg(long, default_value_t = 1)]
    cpus: u32,

    /// Seconds the whole VM run may take before it is stopped and counted as failed.
    #[arg(long, default_value_t = 600, value_name = "SECS")]
    timeout: u64,

    /// Hardware acceleration: `auto` uses KVM only if a probe boot succeeds.
    #[arg(long, value_enum, default_value_t = KvmMode::Auto)]
    kvm: KvmMode,

    /// Build the integration test TEST of cargo package PACKAGE and run it in
    /// the VM (repeatable).
    #[arg(long, value_name = "PACKAGE:TEST")]
    cargo_test: Vec<String>,

    /// Arguments for every --cargo-test program, split at whitespace
    /// (for example '--test-threads=1 ipvlan').
    #[arg(long, value_name = "ARGS", allow_hyphen_values = true)]
    test_args: Option<String>,

    /// Environment variable for the programs in the VM (repeatable).
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,

    /// Provision this machine first: install qemu-system-x86 (from
    /// bookworm-backports), iproute2 and bpftool if missing, fetch the kernel
    /// and busybox and build the initramfs. Runs programs only if some are given.
    #[arg(long)]
    prepare: bool,

    /// Programs to run in order: `PROGRAM [ARGS...]`, several separated by a lone `,`.
    #[arg(last = true, value_name = "PROGRAM [ARGS...] [, PROGRAM [ARGS...]]...")]
    programs: Vec<String>,
}

/// Runs `cargo xtask vm-test`.
pub fn run(args: VmTestArgs) -> Result<()> {
    let started = Instant::now();
    let workspace = workspace::Workspace::locate()?;
    let cache = workspace.target_dir.join("vm");
    std::fs::create_dir_all(&cache)
        .with_context(|| format!("cannot create the cache directory {}", cache.display()))?;

    if args.prepare {
        prepare::provision(&cache, &args.kernel)?;
        if args.cargo_test.is_empty() && args.programs.is_empty() {
            eprintln!("vm-test: prepared in {}", secs(started.elapsed()));
            return Ok(());
        }
    }

    // Check the command line before the slow steps.
    let env = plan::parse_env(&args.env)?;
    let listed = plan::parse_programs(&args.programs, &workspace)?;
    if args.cargo_test.is_empty() && listed.is_empty() {
        bail!(
            "nothing to run: give --cargo-test PACKAGE:TEST or `-- PROGRAM [ARGS...]` \
             (see `cargo xtask vm-test --help`)"
        );
    }
    let mut programs = Vec::new();
    if !args.cargo_test.is_empty() {
        programs = timed("build the --cargo-test programs", || {
            plan::build_cargo_tests(&args.cargo_test, args.test_args.as_deref(), &workspace)
        })?;
    }
    programs.extend(listed);

    let kernel = timed("fetch the kernel", || kernel::fetch(&cache, &args.kernel))?;
    let busybox = timed("fetch busybox", || initramfs::fetch_busybox(&cache))?;
    let initramfs = timed("build the initramfs", || {
        initramfs::build(&cache, &kernel, &busybox)
    })?;
    let run_dir = timed("stage the programs", || {
        plan::stage(&cache, &programs, &env)
    })?;
    let accel = qemu::choose_accel(args.kvm, &kernel)?;

    let vm = qemu::Vm {
        accel,
        memory_mib: args.memory,
        cpus: args.cpus,
        kernel: &kernel,
        initramfs: &initramfs,
        run_share: &run_dir,
        workspace_share: &workspace.root,
        timeout: Duration::from_secs(args.timeout),
    };
    eprintln!(
        "vm-test: booting {} ({}, {}) with {} program(s)",
        kernel.version,
        kernel.boot_image_kind(),
        accel,
        programs.len()
    );
    let outcome = vm.run()?;
    let statuses = plan::read_statuses(&run_dir, programs.len())?;
    let failed = report(&programs, &statuses);
    eprintln!(
        "vm-test: timings: boot to /init {}, to programs {}, VM total {}, overall {}",
        outcome.init_started.map_or("-".into(), secs),
        outcome.ready.map_or("-".into(), secs),
        secs(outcome.total),
        secs(started.elapsed()),
    );

    if let Some(problem) = outcome.problem {
        bail!("{problem}; the run's files are in {}", run_dir.display());
    }
    if failed > 0 {
        bail!(
            "{failed} of {} program(s) failed in the VM; the run's files are in {}",
            programs.len(),
            run_dir.display()
        );
    }
    // Only a failed run's share is worth keeping, for inspection.
    std::fs::remove_dir_all(&run_dir)
        .with_context(|| format!("cannot remove {}", run_dir.display()))
}

/// Prints a PASS/FAIL line per program and returns how many failed.
fn report(programs: &[plan::Program], statuses: &[Option<i32>]) -> usize {
    let mut failed = 0;
    for (program, status) in programs.iter().zip(statuses) {
        let verdict = match status {
            Some(0) => "PASS".to_string(),
            Some(code) => format!("FAIL (exit status {code})"),
            None => "FAIL (did not finish)".to_string(),
        };
        if *status != Some(0) {
            failed += 1;
        }
        eprintln!("vm-test: {verdict} {}", program.label);
    }
    failed
}

/// Runs one step, printing what it does and how long it took.
fn timed<T>(what: &str, step: impl FnOnce() -> Result<T>) -> Result<T> {
    let started = Instant::now();
    eprintln!("vm-test: {what}...");
    let value = step().with_context(|| format!("cannot {what}"))?;
    eprintln!("vm-test: {what}: done in {}", secs(started.elapsed()));
    Ok(value)
}

/// Formats a duration as seconds with one decimal, the precision timings need here.
fn secs(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}
