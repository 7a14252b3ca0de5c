//! Choosing kernel modules and their load order.
//!
//! Debian's kernel package ships no `modules.dep` (depmod writes it when the
//! package is installed, which we never do), so dependencies come from each
//! module's own `.modinfo` section, the data depmod reads too.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

/// Modules the VM loads at boot; their dependencies are added automatically.
/// Those built into the kernel are skipped.
pub const WANTED: &[&str] = &[
    // The 9p share that carries programs in and results out.
    "virtio_pci",
    "9pnet_virtio",
    "9p",
    // Interfaces the tests create.
    "veth",
    "macvlan",
    "ipvlan",
    "8021q",
    "bridge",
    "dummy",
    "vxlan",
    // TC hooks and BPF classifiers/actions of the data plane.
    "sch_ingress",
    "cls_bpf",
    "act_bpf",
];

/// A module file found in the kernel package.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// Module name with `_` for `-`, as the kernel spells it.
    pub name: String,
    /// The `.ko` (possibly `.ko.xz`/`.ko.zst`) in the unpacked package.
    pub path: PathBuf,
}

/// Module names are spelled with `-` or `_` interchangeably; the kernel uses `_`.
fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

/// The module name of a file such as `virtio-rng.ko.xz`.
fn module_name(file_name: &str) -> Option<String> {
    let stem = [".ko", ".ko.xz", ".ko.zst", ".ko.gz"]
        .iter()
        .find_map(|suffix| file_name.strip_suffix(suffix))?;
    Some(normalize(stem))
}

/// All module files under `dir` (a `lib/modules/<version>` tree), by name.
pub fn index(dir: &Path) -> Result<BTreeMap<String, PathBuf>> {
    let mut found = BTreeMap::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))?
        {
            let entry = entry?;
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                pending.push(path);
            } else if let Some(name) = module_name(&entry.file_name().to_string_lossy()) {
                found.insert(name, path);
            }
        }
    }
    Ok(found)
}

/// Names of the modules built into the kernel, from `modules.builtin`.
pub fn builtin(modules_builtin: &str) -> HashSet<String> {
    modules_builtin
        .lines()
        .filter_map(|line| line.rsplit('/').next())
        .filter_map(module_name)
        .collect()
}

/// The modules to load for `wanted`, dependencies first.
///
/// `depends` gives a module's direct dependencies; modules in `builtin` need
/// no loading. A wanted module that is neither available nor built in is an error.
pub fn load_order(
    wanted: &[&str],
    available: &BTreeMap<String, PathBuf>,
    builtin: &HashSet<String>,
    mut depends: impl FnMut(&Path) -> Result<Vec<String>>,
) -> Result<Vec<Module>> {
    let mut order = Vec::new();
    let mut visited = HashSet::new();
    // Depth-first, emitting a module after all its dependencies.
    fn visit(
        name: &str,
        required_by: Option<&str>,
        available: &BTreeMap<String, PathBuf>,
        builtin: &HashSet<String>,
        depends: &mut dyn FnMut(&Path) -> Result<Vec<String>>,
        visited: &mut HashSet<String>,
        order: &mut Vec<Module>,
    ) -> Result<()> {
        let name = normalize(name);
        if builtin.contains(&name) || !visited.insert(name.clone()) {
            return Ok(());
        }
        let Some(path) = available.get(&name) else {
            match required_by {
                Some(parent) => {
                    bail!("module {name}, needed by {parent}, is not in the kernel package")
                }
                None => bail!(
                    "module {name} is neither built into this kernel nor in its package; \
                     pick another kernel or drop it from vm::modules::WANTED"
                ),
            }
        };
        for dependency in depends(path)? {
            visit(
                &dependency,
                Some(&name),
                available,
                builtin,
                depends,
                visited,
                order,
            )?;
        }
        order.push(Module {
            name,
            path: path.clone(),
        });
        Ok(())
    }
    for name in wanted {
        visit(
            name,
            None,
            available,
            builtin,
            &mut depends,
            &mut visited,
            &mut order,
        )?;
    }
    Ok(order)
}

/// A module's file contents, decompressed on the host because busybox's
/// `insmod` only takes plain ELF modules.
pub fn read_uncompressed(path: &Path) -> Result<Vec<u8>> {
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        Some("xz")
    } else if name.ends_with(".zst") {
        Some("zstd")
    } else if name.ends_with(".gz") {
        Some("gzip")
    } else {
        None
    };
    match tool {
        Some(tool) => {
            let output = Command::new(tool).arg("-dc").arg(path).output();
            let output = output.with_context(|| format!("cannot run {tool} on {name}"))?;
            ensure!(output.status.success(), "{tool} cannot decompress {name}");
            Ok(output.stdout)
        }
        None => std::fs::read(path).with_context(|| format!("cannot read {name}")),
    }
}

/// A module's direct dependencies, from the `depends=` entry of its `.modinfo`.
pub fn depends_of(path: &Path) -> Result<Vec<String>> {
    depends_in(&read_uncompressed(path)?)
        .with_context(|| format!("cannot read the .modinfo of {}", path.display()))
}

/// The `depends=` list in the `.modinfo` section of a module's ELF image.
fn depends_in(module: &[u8]) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for entry in elf_section(module, ".modinfo")?.split(|&byte| byte == 0) {
        if let Some(list) = entry.strip_prefix(b"depends=") {
            let list = String::from_utf8_lossy(list);
            names.extend(
                list.split(',')
                    .filter(|n| !n.is_empty())
                    .map(str::to_string),
            );
        }
    }
    Ok(names)
}

/// The contents of the section `wanted` of a little-endian ELF64 file.
fn elf_section<'a>(elf: &'a [u8], wanted: &str) -> Result<&'a [u8]> {
    ensure!(
        elf.len() >= 64 && elf.starts_with(b"\x7fELF") && elf[4] == 2 && elf[5] == 1,
        "not a little-endian ELF64 file"
    );
    let u16_at = |at: usize| -> Result<usize> {
        let bytes = elf.get(at..at + 2).context("truncated ELF")?;
        Ok(usize::from(u16::from_le_bytes([bytes[0], bytes[1]])))
    };
    let u32_at = |at: usize| -> Result<usize> {
        let bytes = elf.get(at..at + 4).context("truncated ELF")?;
        Ok(u32::from_le_bytes(bytes.try_into().expect("4 bytes")) as usize)
    };
    let u64_at = |at: usize| -> Result<usize> {
        let bytes = elf.get(at..at + 8).context("truncated ELF")?;
        usize::try_from(u64::from_le_bytes(bytes.try_into().expect("8 bytes")))
            .context("ELF offset too large")
    };
    let section_headers = u64_at(0x28)?;
    let header_size = u16_at(0x3a)?;
    let count = u16_at(0x3c)?;
    let names_index = u16_at(0x3e)?;
    // Section header fields: name at 0, offset at 24, size at 32.
    let section = |index: usize| -> Result<(usize, &'a [u8])> {
        let header = section_headers + index * header_size;
        let (offset, size) = (u64_at(header + 24)?, u64_at(header + 32)?);
        let data = elf
            .get(offset..offset + size)
            .context("section outside the file")?;
        Ok((u32_at(header)?, data))
    };
    let (_, names) = section(names_index)?;
    for index in 0..count {
        let (name_offset, data) = section(index)?;
        let name = names
            .get(name_offset..)
            .and_then(|rest| rest.split(|&b| b == 0).next())
            .context("bad section name")?;
        if name == wanted.as_bytes() {
            return Ok(data);
        }
    }
    bail!("no {wanted} section")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn available(names: &[&str]) -> BTreeMap<String, PathBuf> {
        names
            .iter()
            .map(|name| (name.to_string(), PathBuf::from(format!("/m/{name}.ko"))))
            .collect()
    }

    /// Dependencies as a fixed table keyed by file path.
    fn table(edges: &[(&str, &[&str])]) -> impl FnMut(&Path) -> Result<Vec<String>> {
        let edges: BTreeMap<PathBuf, Vec<String>> = edges
            .iter()
            .map(|(name, deps)| {
                let path = PathBuf::from(format!("/m/{name}.ko"));
                (path, deps.iter().map(|d| d.to_string()).collect())
            })
            .collect();
        move |path| Ok(edges.get(path).cloned().unwrap_or_default())
    }

    fn names(order: &[Module]) -> Vec<&str> {
        order.iter().map(|m| m.name.as_str()).collect()
    }

    #[test]
    fn dependencies_load_before_their_users_and_only_once() {
        let deps = table(&[
            ("8021q", &["garp", "mrp"]),
            ("garp", &["stp", "llc"]),
            ("mrp", &[]),
            ("stp", &["llc"]),
            ("bridge", &["stp", "llc"]),
        ]);
        let modules = available(&["8021q", "garp", "mrp", "stp", "llc", "bridge"]);
        let order = load_order(&["8021q", "bridge"], &modules, &HashSet::new(), deps).unwrap();
        assert_eq!(
            names(&order),
            ["llc", "stp", "garp", "mrp", "8021q", "bridge"]
        );
    }

    #[test]
    fn builtin_modules_are_skipped() {
        let builtin = HashSet::from(["virtio".to_string()]);
        let deps = table(&[("virtio_pci", &["virtio", "virtio_ring"])]);
        let modules = available(&["virtio_pci", "virtio_ring"]);
        let order = load_order(&["virtio_pci", "virtio"], &modules, &builtin, deps).unwrap();
        assert_eq!(names(&order), ["virtio_ring", "virtio_pci"]);
    }

    #[test]
    fn dashes_and_underscores_name_the_same_module() {
        let modules = available(&["virtio_rng"]);
        let order = load_order(&["virtio-rng"], &modules, &HashSet::new(), table(&[])).unwrap();
        assert_eq!(names(&order), ["virtio_rng"]);
    }

    #[test]
    fn a_missing_module_is_named_in_the_error() {
        let deps = table(&[("ipvlan", &["missing_dep"])]);
        let error = load_order(&["ipvlan"], &available(&["ipvlan"]), &HashSet::new(), deps)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("missing_dep") && error.contains("ipvlan"),
            "{error}"
        );
    }

    #[test]
    fn file_names_map_to_module_names() {
        assert_eq!(
            module_name("virtio-rng.ko.xz").as_deref(),
            Some("virtio_rng")
        );
        assert_eq!(module_name("8021q.ko").as_deref(), Some("8021q"));
        assert_eq!(module_name("modules.order"), None);
    }

    #[test]
    fn builtin_list_gives_module_names() {
        let listed = builtin("kernel/drivers/virtio/virtio.ko\nkernel/net/ipv6/ipv6.ko\n");
        assert_eq!(
            listed,
            HashSet::from(["virtio".to_string(), "ipv6".to_string()])
        );
    }

    #[test]
    fn modinfo_dependencies_are_read_from_a_real_elf_section() {
        // Assemble a tiny ELF64 with a .shstrtab and a .modinfo section.
        let modinfo = b"license=GPL\0depends=stp,llc\0name=bridge\0";
        let shstrtab = b"\0.shstrtab\0.modinfo\0";
        let mut elf = vec![0u8; 64];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        let modinfo_at = elf.len();
        elf.extend_from_slice(modinfo);
        let shstrtab_at = elf.len();
        elf.extend_from_slice(shstrtab);
        let headers_at = elf.len();
        let header = |name: u32, offset: usize, size: usize| {
            let mut h = vec![0u8; 64];
            h[..4].copy_from_slice(&name.to_le_bytes());
            h[24..32].copy_from_slice(&(offset as u64).to_le_bytes());
            h[32..40].copy_from_slice(&(size as u64).to_le_bytes());
            h
        };
        elf.extend(header(0, 0, 0));
        elf.extend(header(1, shstrtab_at, shstrtab.len()));
        elf.extend(header(11, modinfo_at, modinfo.len()));
        elf[0x28..0x30].copy_from_slice(&(headers_at as u64).to_le_bytes());
        elf[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3c..0x3e].copy_from_slice(&3u16.to_le_bytes());
        elf[0x3e..0x40].copy_from_slice(&1u16.to_le_bytes());

        assert_eq!(depends_in(&elf).unwrap(), ["stp", "llc"]);
    }
}
