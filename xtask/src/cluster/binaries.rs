//! The Kubernetes and Multus binaries: found in the directory of
//! xz-compressed files, decompressed once into `target/cluster/bin`.

use std::{
    collections::BTreeMap,
    fs,
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{Context, bail};
use sha2::{Digest, Sha256};

use crate::workspace;

/// The variable naming the directory of the compressed binaries.
pub const KUBE_DIR_VAR: &str = "FLATNET_KUBE_DIR";

/// The binaries the cluster runs, as named in the directory (plus `.xz`).
pub const BINARIES: &[&str] = &[
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "multus",
];

/// The NetworkAttachmentDefinition CRD, next to the binaries.
pub const NAD_CRD: &str = "multus-nad-crd.yaml";

/// The directory the binaries are looked for in: `$FLATNET_KUBE_DIR`, else
/// `<workspace>/../shared/kube`.
pub fn kube_dir(given: Option<&Path>) -> PathBuf {
    given
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os(KUBE_DIR_VAR).map(PathBuf::from))
        .unwrap_or_else(|| workspace::root().join("../shared/kube"))
}

/// The directory of the compressed binaries when it holds them all, for
/// callers that skip the real-cluster tier where it is missing.
pub fn binaries_found() -> Option<PathBuf> {
    let dir = kube_dir(None);
    complete(&dir).then_some(dir)
}

fn complete(dir: &Path) -> bool {
    dir.join("SHA256SUMS").is_file()
        && dir.join(NAD_CRD).is_file()
        && BINARIES
            .iter()
            .all(|b| dir.join(format!("{b}.xz")).is_file())
}

/// Decompresses what is missing or differs from SHA256SUMS into `bin`;
/// returns the source directory.
pub fn install(given: Option<&Path>, bin: &Path) -> anyhow::Result<PathBuf> {
    let dir = kube_dir(given);
    if !complete(&dir) {
        bail!(
            "the Kubernetes binaries are not in {}: it must hold SHA256SUMS, {NAD_CRD} and {}. \
             Set {KUBE_DIR_VAR} (or --kube-dir) to the directory that has them",
            dir.display(),
            BINARIES
                .iter()
                .map(|b| format!("{b}.xz"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let sums_path = dir.join("SHA256SUMS");
    let sums = parse_sums(
        &fs::read_to_string(&sums_path).with_context(|| format!("read {}", sums_path.display()))?,
    );
    fs::create_dir_all(bin)?;
    for name in BINARIES {
        let expected = sums
            .get(*name)
            .with_context(|| format!("{} lists no {name}", sums_path.display()))?;
        let target = bin.join(name);
        if target.is_file() && sha256_file(&target)? == *expected {
            continue;
        }
        let source = dir.join(format!("{name}.xz"));
        let partial = bin.join(format!("{name}.partial"));
        let output = fs::File::create(&partial)?;
        let status = Command::new("xz")
            .arg("-dc")
            .arg(&source)
            .stdout(output)
            .stderr(Stdio::inherit())
            .status()
            .context("cannot run xz (`bash .ci/provision` installs xz-utils)")?;
        if !status.success() {
            bail!("xz -dc {} failed ({status})", source.display());
        }
        let got = sha256_file(&partial)?;
        if got != *expected {
            let _ = fs::remove_file(&partial);
            bail!(
                "{} decompresses to sha256 {got}, but SHA256SUMS says {expected}",
                source.display()
            );
        }
        fs::set_permissions(&partial, fs::Permissions::from_mode(0o755))?;
        fs::rename(&partial, &target)?;
        println!("    decompressed {}", target.display());
    }
    Ok(dir)
}

/// `sha256sum` output: `<hex>  <name>` (`*<name>` in binary mode).
fn parse_sums(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|line| {
            let (hex, name) = line.trim().split_once(char::is_whitespace)?;
            let name = name.trim().trim_start_matches('*');
            let name = name.rsplit('/').next().unwrap_or(name);
            Some((name.to_owned(), hex.to_lowercase()))
        })
        .collect()
}

fn sha256_file(path: &Path) -> anyhow::Result<String> {
    let mut file = fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut file, &mut hasher)?;
    Ok(format!("{:x}", hasher.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_read_in_text_and_binary_mode_and_by_file_name() {
        let sums = parse_sums("ABC  kubelet\ndef *multus\n012  ./dir/kube-apiserver\n\n");
        assert_eq!(sums["kubelet"], "abc");
        assert_eq!(sums["multus"], "def");
        assert_eq!(sums["kube-apiserver"], "012");
        assert_eq!(sums.len(), 3);
    }

    #[test]
    fn a_missing_directory_names_it_and_the_variable() {
        let dir = tempfile_dir();
        let error = install(Some(&dir.join("nowhere")), &dir.join("bin")).unwrap_err();
        let message = format!("{error:#}");
        assert!(message.contains("nowhere"), "{message}");
        assert!(message.contains(KUBE_DIR_VAR), "{message}");
    }

    #[test]
    fn binaries_are_decompressed_checked_and_kept_when_unchanged() {
        let dir = tempfile_dir();
        let source = dir.join("kube");
        let bin = dir.join("bin");
        fs::create_dir_all(&source).unwrap();
        let mut sums = String::new();
        for name in BINARIES {
            let content = format!("#!/bin/sh\necho {name}\n");
            fs::write(source.join(name), &content).unwrap();
            assert!(
                Command::new("xz")
                    .arg(source.join(name))
                    .status()
                    .unwrap()
                    .success()
            );
            sums.push_str(&format!(
                "{:x}  {name}\n",
                Sha256::digest(content.as_bytes())
            ));
        }
        fs::write(source.join(NAD_CRD), "").unwrap();
        fs::write(source.join("SHA256SUMS"), &sums).unwrap();
        install(Some(&source), &bin).unwrap();
        let kubelet = bin.join("kubelet");
        assert_eq!(
            fs::read_to_string(&kubelet).unwrap(),
            "#!/bin/sh\necho kubelet\n"
        );
        assert_eq!(
            fs::metadata(&kubelet).unwrap().permissions().mode() & 0o777,
            0o755
        );
        // A binary changed by hand is replaced; a wrong sum is refused.
        fs::write(&kubelet, "changed").unwrap();
        install(Some(&source), &bin).unwrap();
        assert!(fs::read_to_string(&kubelet).unwrap().contains("kubelet"));
        fs::write(
            source.join("SHA256SUMS"),
            sums.replace("  kubelet", "0  kubelet"),
        )
        .unwrap();
        fs::remove_file(&kubelet).unwrap();
        let error = install(Some(&source), &bin).unwrap_err();
        assert!(
            format!("{error:#}").contains("SHA256SUMS says"),
            "{error:#}"
        );
        assert!(!kubelet.exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "xtask-cluster-binaries-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }
}
