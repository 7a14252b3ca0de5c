//! Fetching Debian's 6.1 kernel and preparing it for booting.

use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{Context, Result, bail};

use super::{apt, bzimage, modules};

/// Debian's metapackage that depends on the current 6.1 kernel of bookworm.
const METAPACKAGE: &str = "linux-image-amd64";
const PACKAGE_PREFIX: &str = "linux-image-";
/// Only 6.1 kernels are what the VM tier promises to test on.
const SERIES_PREFIX: &str = "linux-image-6.1.0-";

/// Which kernel `--kernel` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelSpec {
    /// The newest cached kernel, else the one Debian's metapackage points at.
    Auto,
    /// A Debian kernel ABI version such as `6.1.0-56`.
    Version(String),
    /// A `linux-image-*.deb` file.
    Deb(PathBuf),
}

impl FromStr for KernelSpec {
    type Err = String;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        if spec == "auto" {
            return Ok(Self::Auto);
        }
        if spec.ends_with(".deb") || spec.contains('/') {
            return Ok(Self::Deb(PathBuf::from(spec)));
        }
        let version = spec.strip_prefix(PACKAGE_PREFIX).unwrap_or(spec);
        let version = version.strip_suffix("-amd64").unwrap_or(version);
        if version.is_empty() || !version.starts_with(|c: char| c.is_ascii_digit()) {
            return Err(format!(
                "`{spec}` is no kernel: give `auto`, a version such as 6.1.0-56, or a .deb path"
            ));
        }
        Ok(Self::Version(format!("{version}-amd64")))
    }
}

/// A kernel unpacked into the cache, ready to boot.
pub struct Kernel {
    /// The kernel release, e.g. `6.1.0-56-amd64`.
    pub version: String,
    /// The bzImage from the package.
    pub bzimage: PathBuf,
    /// The uncompressed ELF kernel, when it could be extracted.
    pub vmlinux: Option<PathBuf>,
    /// Modules to load at boot, dependencies first.
    pub modules: Vec<PathBuf>,
}

impl Kernel {
    /// The image qemu boots: vmlinux when available (twice as fast under TCG).
    pub fn boot_image(&self) -> &Path {
        self.vmlinux.as_deref().unwrap_or(&self.bzimage)
    }

    /// What `boot_image` is, for messages.
    pub fn boot_image_kind(&self) -> &'static str {
        if self.vmlinux.is_some() {
            "vmlinux via PVH"
        } else {
            "bzImage"
        }
    }
}

/// Files of a prepared kernel directory `<cache>/vm/kernel/<version>/`.
const BZIMAGE: &str = "vmlinuz";
const VMLINUX: &str = "vmlinux";
const MODULES_DIR: &str = "modules";
/// Module names in load order.
const LOAD_ORDER: &str = "modules.load";
/// The `modules::WANTED` list the directory was made for; written last, so
/// its presence also marks the directory complete.
const WANTED_STAMP: &str = "modules.wanted";

/// Returns the kernel `spec` names, downloading and unpacking it if it is not cached.
pub fn fetch(cache: &Path, spec: &KernelSpec) -> Result<Kernel> {
    let kernels = cache.join("kernel");
    let debs = cache.join("debs");
    let cached = match spec {
        KernelSpec::Deb(deb) => return prepare(&kernels, deb),
        KernelSpec::Version(version) => Some(version.clone()),
        KernelSpec::Auto => newest_cached(&kernels)?,
    };
    if let Some(kernel) = cached
        .map(|v| load(&kernels.join(v)))
        .transpose()?
        .flatten()
    {
        return Ok(kernel);
    }
    // Resolve and download together, so stale package lists are refreshed
    // before both are retried.
    let deb = apt::with_fresh_lists(|| {
        let package = match spec {
            KernelSpec::Version(version) => format!("{PACKAGE_PREFIX}{version}"),
            _ => apt::dependency_with_prefix(METAPACKAGE, SERIES_PREFIX)?,
        };
        apt::download(&package, &debs)
    })?;
    prepare(&kernels, &deb)
}

/// The newest kernel version with a prepared directory in `kernels`.
fn newest_cached(kernels: &Path) -> Result<Option<String>> {
    if !kernels.exists() {
        return Ok(None);
    }
    let mut versions = Vec::new();
    for entry in std::fs::read_dir(kernels)? {
        let entry = entry?;
        if entry.path().join(WANTED_STAMP).exists() {
            versions.push(entry.file_name().to_string_lossy().into_owned());
        }
    }
    Ok(versions.into_iter().max_by_key(|v| version_key(v)))
}

/// Orders versions such as `6.1.0-9-amd64` < `6.1.0-56-amd64` numerically.
fn version_key(version: &str) -> Vec<u64> {
    version
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|part| part.parse().ok())
        .collect()
}

/// The kernel in `dir` if it is complete and was made for the current module list.
fn load(dir: &Path) -> Result<Option<Kernel>> {
    let Ok(stamp) = std::fs::read_to_string(dir.join(WANTED_STAMP)) else {
        return Ok(None);
    };
    if stamp != wanted_stamp() {
        return Ok(None);
    }
    let order = std::fs::read_to_string(dir.join(LOAD_ORDER))?;
    let vmlinux = dir.join(VMLINUX);
    Ok(Some(Kernel {
        version: dir
            .file_name()
            .context("kernel directory has no name")?
            .to_string_lossy()
            .into_owned(),
        bzimage: dir.join(BZIMAGE),
        vmlinux: vmlinux.exists().then_some(vmlinux),
        modules: order
            .lines()
            .map(|name| dir.join(MODULES_DIR).join(format!("{name}.ko")))
            .collect(),
    }))
}

fn wanted_stamp() -> String {
    modules::WANTED.join("\n")
}

/// Unpacks a kernel package and keeps only what booting needs: the bzImage,
/// the extracted vmlinux and the wanted modules.
fn prepare(kernels: &Path, deb: &Path) -> Result<Kernel> {
    // Scratch names carry the process id so concurrent runs do not collide.
    let pid = std::process::id();
    let unpacked = kernels.join(format!(".unpacked-{pid}"));
    remove_if_present(&unpacked)?;
    std::fs::create_dir_all(kernels)?;
    apt::unpack(deb, &unpacked)?;
    let version = release_in(&unpacked.join("boot"))
        .with_context(|| format!("{} holds no boot/vmlinuz-*", deb.display()))?;
    let partial = kernels.join(format!("{version}.partial-{pid}"));
    remove_if_present(&partial)?;
    std::fs::create_dir_all(partial.join(MODULES_DIR))?;

    let boot = unpacked.join("boot");
    let bzimage = std::fs::read(boot.join(format!("vmlinuz-{version}")))?;
    std::fs::write(partial.join(BZIMAGE), &bzimage)?;
    let config =
        std::fs::read_to_string(boot.join(format!("config-{version}"))).unwrap_or_default();
    if config.lines().any(|line| line == "CONFIG_PVH=y") {
        match bzimage::extract_vmlinux(&bzimage) {
            Ok(vmlinux) => std::fs::write(partial.join(VMLINUX), vmlinux)?,
            Err(error) => eprintln!("vm-test: booting the bzImage: no vmlinux ({error:#})"),
        }
    } else {
        eprintln!("vm-test: booting the bzImage: kernel {version} has no PVH entry point");
    }

    let tree = unpacked.join("lib/modules").join(&version);
    let builtin = std::fs::read_to_string(tree.join("modules.builtin")).unwrap_or_default();
    let order = modules::load_order(
        modules::WANTED,
        &modules::index(&tree)?,
        &modules::builtin(&builtin),
        modules::depends_of,
    )?;
    for module in &order {
        let target = partial
            .join(MODULES_DIR)
            .join(format!("{}.ko", module.name));
        std::fs::write(target, modules::read_uncompressed(&module.path)?)?;
    }
    let names: Vec<&str> = order.iter().map(|m| m.name.as_str()).collect();
    std::fs::write(partial.join(LOAD_ORDER), names.join("\n") + "\n")?;
    std::fs::write(partial.join(WANTED_STAMP), wanted_stamp())?;

    remove_if_present(&unpacked)?;
    let dir = kernels.join(&version);
    remove_if_present(&dir)?;
    if let Err(error) = std::fs::rename(&partial, &dir) {
        // A concurrent run may have put the same kernel there first.
        remove_if_present(&partial)?;
        return load(&dir)?
            .with_context(|| format!("cannot move the kernel into {}: {error}", dir.display()));
    }
    load(&dir)?.context("the kernel directory just written is incomplete")
}

/// The kernel release named by the single `vmlinuz-<release>` in `boot`.
fn release_in(boot: &Path) -> Result<String> {
    for entry in std::fs::read_dir(boot)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if let Some(release) = name.strip_prefix("vmlinuz-") {
            return Ok(release.to_string());
        }
    }
    bail!("no vmlinuz-* in {}", boot.display())
}

fn remove_if_present(dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
            Err(error).with_context(|| format!("cannot remove {}", dir.display()))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_specs_parse() {
        assert_eq!("auto".parse(), Ok(KernelSpec::Auto));
        let v = KernelSpec::Version("6.1.0-56-amd64".into());
        assert_eq!("6.1.0-56".parse(), Ok(v.clone()));
        assert_eq!("6.1.0-56-amd64".parse(), Ok(v.clone()));
        assert_eq!("linux-image-6.1.0-56-amd64".parse(), Ok(v));
        assert_eq!(
            "debs/linux-image-6.1.0-56-amd64_6.1.192-2_amd64.deb".parse(),
            Ok(KernelSpec::Deb(
                "debs/linux-image-6.1.0-56-amd64_6.1.192-2_amd64.deb".into()
            ))
        );
        assert!("newest".parse::<KernelSpec>().is_err());
    }

    #[test]
    fn versions_order_numerically() {
        let newest = ["6.1.0-9-amd64", "6.1.0-56-amd64", "6.1.0-10-amd64"]
            .into_iter()
            .max_by_key(|v| version_key(v));
        assert_eq!(newest, Some("6.1.0-56-amd64"));
    }
}
