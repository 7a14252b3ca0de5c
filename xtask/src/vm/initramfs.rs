//! Building the VM's initramfs: busybox, iproute2, bpftool, their libraries,
//! the kernel modules and the `/init` that runs the programs.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use super::cpio::CpioWriter;
use super::kernel::Kernel;
use super::{apt, ldd};

/// Host programs the tests and `/init` call, with the Debian package of each.
pub const HOST_TOOLS: &[(&str, &str)] = &[
    ("ip", "iproute2"),
    ("tc", "iproute2"),
    ("bridge", "iproute2"),
    ("bpftool", "bpftool"),
];

/// Where the run share (programs, plan, results) is mounted in the VM.
pub const GUEST_RUN_DIR: &str = "/run/flatnet";
/// 9p mount tags of the run share and of the workspace share.
pub const RUN_TAG: &str = "flatnet_run";
pub const WORKSPACE_TAG: &str = "flatnet_ws";
/// Kernel command-line parameter (passed to `/init` as an environment
/// variable) giving the workspace path, mounted at the same path in the VM.
pub const WORKSPACE_PARAM: &str = "flatnet_workspace";
/// Console lines `/init` prints, which the host times the boot by.
pub const INIT_STARTED_MARKER: &str = "flatnet-vm: init started";
pub const READY_MARKER: &str = "flatnet-vm: running programs";
/// The script in the run share that `/init` runs.
pub const PLAN_FILE: &str = "plan.sh";

/// What an archive path holds.
enum Source {
    Dir,
    HostFile(PathBuf),
    Bytes { mode: u32, data: Vec<u8> },
    Symlink(String),
    CharDevice(u32, u32),
}

/// The static busybox of Debian's busybox-static, fetched once into the cache.
pub fn fetch_busybox(cache: &Path) -> Result<PathBuf> {
    let busybox = cache.join("busybox");
    if busybox.exists() {
        return Ok(busybox);
    }
    let deb = apt::with_fresh_lists(|| apt::download("busybox-static", &cache.join("debs")))?;
    // Scratch names carry the process id so concurrent runs do not collide.
    let pid = std::process::id();
    let unpacked = cache.join(format!(".busybox-unpacked-{pid}"));
    let partial = cache.join(format!("busybox.partial-{pid}"));
    apt::unpack(&deb, &unpacked)?;
    std::fs::copy(unpacked.join("bin/busybox"), &partial)
        .with_context(|| format!("{} holds no bin/busybox", deb.display()))?;
    std::fs::remove_dir_all(&unpacked)?;
    std::fs::rename(&partial, &busybox)?;
    Ok(busybox)
}

/// Returns the initramfs for `kernel`, rebuilding it when any input changed.
pub fn build(cache: &Path, kernel: &Kernel, busybox: &Path) -> Result<PathBuf> {
    let entries = entries(kernel, busybox)?;
    let inputs = describe(&entries)?;
    let archive = cache.join(format!("initramfs-{}.cpio", kernel.version));
    let inputs_file = archive.with_extension("inputs");
    if archive.exists() && std::fs::read_to_string(&inputs_file).ok() == Some(inputs.clone()) {
        return Ok(archive);
    }
    let partial = archive.with_extension(format!("partial-{}", std::process::id()));
    write_archive(&entries, &partial)?;
    std::fs::rename(&partial, &archive)?;
    std::fs::write(&inputs_file, inputs)?;
    Ok(archive)
}

/// Everything the initramfs holds, by path; parents sort before children.
fn entries(kernel: &Kernel, busybox: &Path) -> Result<BTreeMap<String, Source>> {
    let mut entries = BTreeMap::new();
    let mut add = |path: &str, source: Source| {
        let mut parent = Path::new(path).parent();
        while let Some(dir) = parent.filter(|d| !d.as_os_str().is_empty()) {
            entries
                .entry(dir.to_string_lossy().into_owned())
                .or_insert(Source::Dir);
            parent = dir.parent();
        }
        entries.insert(path.to_string(), source);
    };

    for dir in ["proc", "sys", "dev", "tmp", "run", "root", "etc"] {
        add(dir, Source::Dir);
    }
    add("dev/console", Source::CharDevice(5, 1));
    add("bin/busybox", Source::HostFile(busybox.to_path_buf()));
    add("bin/sh", Source::Symlink("busybox".into()));
    add(
        "init",
        Source::Bytes {
            mode: 0o755,
            data: init_script().into_bytes(),
        },
    );

    let mut libraries = Vec::new();
    for (tool, _) in HOST_TOOLS {
        let path = find_host_tool(tool)?;
        libraries.extend(ldd::shared_libraries(&path)?);
        add(&format!("usr/sbin/{tool}"), Source::HostFile(path));
    }
    for library in libraries {
        let inside = library
            .to_string_lossy()
            .trim_start_matches('/')
            .to_string();
        add(&inside, Source::HostFile(library));
    }

    let mut load_order = String::new();
    for module in &kernel.modules {
        let name = module.file_name().context("module without file name")?;
        let name = name.to_string_lossy();
        add(
            &format!("lib/modules/{name}"),
            Source::HostFile(module.clone()),
        );
        load_order.push_str(name.trim_end_matches(".ko"));
        load_order.push('\n');
    }
    add(
        "etc/flatnet/modules",
        Source::Bytes {
            mode: 0o644,
            data: load_order.into_bytes(),
        },
    );
    Ok(entries)
}

/// `tool`'s path on the host, looked up like a root shell would.
pub fn find_host_tool(tool: &str) -> Result<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|dir| dir.join(tool))
        .find(|candidate| candidate.is_file())
        .with_context(|| {
            format!(
                "`{tool}` is not installed on this machine: install iproute2 and bpftool \
                 (`cargo xtask vm-test --prepare` does)"
            )
        })
}

/// One line per entry naming its source, size and modification time, so any
/// change of an input (a tool upgrade, a new module, a new /init) shows.
fn describe(entries: &BTreeMap<String, Source>) -> Result<String> {
    let mut text = String::new();
    for (path, source) in entries {
        let line = match source {
            Source::Dir => format!("{path}/"),
            Source::HostFile(host) => {
                let meta = std::fs::metadata(host)
                    .with_context(|| format!("cannot read {}", host.display()))?;
                let mtime = meta
                    .modified()?
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs();
                format!("{path} <- {} {} {mtime}", host.display(), meta.len())
            }
            Source::Bytes { mode, data } => {
                format!("{path} {mode:o}:\n{}", String::from_utf8_lossy(data))
            }
            Source::Symlink(target) => format!("{path} -> {target}"),
            Source::CharDevice(major, minor) => format!("{path} c {major}:{minor}"),
        };
        text.push_str(&line);
        text.push('\n');
    }
    Ok(text)
}

fn write_archive(entries: &BTreeMap<String, Source>, path: &Path) -> Result<()> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut cpio = CpioWriter::new(BufWriter::new(file));
    for (inside, source) in entries {
        match source {
            Source::Dir => cpio.dir(inside)?,
            Source::HostFile(host) => {
                let data = std::fs::read(host)
                    .with_context(|| format!("cannot read {}", host.display()))?;
                let mode = if is_executable(host)? { 0o755 } else { 0o644 };
                cpio.file(inside, mode, &data)?;
            }
            Source::Bytes { mode, data } => cpio.file(inside, *mode, data)?,
            Source::Symlink(target) => cpio.symlink(inside, target)?,
            Source::CharDevice(major, minor) => cpio.char_device(inside, *major, *minor)?,
        }
    }
    let mut out = cpio.finish()?;
    std::io::Write::flush(&mut out)?;
    Ok(())
}

fn is_executable(path: &Path) -> Result<bool> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path)?.permissions().mode();
    Ok(mode & 0o111 != 0)
}

/// The VM's PID 1: mount the pseudo file systems, load the modules, mount the
/// shares, run the plan, power off. Anything that goes wrong before the plan
/// runs powers off at once; the host then finds no exit statuses.
fn init_script() -> String {
    format!(
        r#"#!/bin/sh
# PID 1 of the flatnet test VM, generated by `cargo xtask vm-test`.
/bin/busybox --install -s /bin
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mount -t tmpfs tmpfs /tmp
mount -t bpf bpffs /sys/fs/bpf
mount -t cgroup2 cgroup2 /sys/fs/cgroup
echo "{INIT_STARTED_MARKER}"
stop() {{ echo "flatnet-vm: $*"; poweroff -f; }}
while read -r module; do
    insmod "/lib/modules/$module.ko" || stop "cannot load kernel module $module"
done < /etc/flatnet/modules
ip link set lo up
mkdir -p {GUEST_RUN_DIR} "${WORKSPACE_PARAM}"
share() {{ mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 "$1" "$2"; }}
share {RUN_TAG} {GUEST_RUN_DIR} || stop "cannot mount the run share"
share {WORKSPACE_TAG} "${WORKSPACE_PARAM}" || stop "cannot mount the workspace"
echo "{READY_MARKER}"
sh {GUEST_RUN_DIR}/{PLAN_FILE}
poweroff -f
"#
    )
}

/// Checks that a workspace path can travel on the kernel command line.
pub fn check_workspace_path(path: &Path) -> Result<String> {
    let text = path.to_str().context("the workspace path is not UTF-8")?;
    if text.chars().any(|c| c.is_whitespace() || c == '"') {
        bail!(
            "the workspace path `{text}` has spaces or quotes, which the kernel command line cannot carry: move the workspace"
        );
    }
    Ok(text.to_string())
}
