//! Debian packages: download, unpack and install through apt.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Runs a command and fails with its output when it does not succeed.
pub fn run_checked(command: &mut Command) -> Result<String> {
    let output = command
        .output()
        .with_context(|| format!("cannot start {command:?}"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Runs `apt-get update`, needed once on a fresh machine and after adding a source.
pub fn update() -> Result<()> {
    eprintln!("vm-test: apt-get update");
    run_checked(Command::new("apt-get").args(["update", "-q"]))?;
    Ok(())
}

/// Runs `query`; when it fails, refreshes apt's package lists and tries once more.
///
/// A fresh machine may have stale lists that name package versions the mirror
/// no longer serves.
pub fn with_fresh_lists<T>(query: impl Fn() -> Result<T>) -> Result<T> {
    query().or_else(|first| {
        eprintln!("vm-test: {first:#}; refreshing apt's package lists");
        update()?;
        query()
    })
}

/// The package that the candidate version of `package` depends on and whose
/// name starts with `prefix` (e.g. linux-image-amd64 -> linux-image-6.1.0-56-amd64).
pub fn dependency_with_prefix(package: &str, prefix: &str) -> Result<String> {
    let out = run_checked(Command::new("apt-cache").args(["depends", package]))?;
    out.lines()
        .filter_map(|line| line.trim().strip_prefix("Depends:"))
        .map(str::trim)
        .find(|dep| dep.starts_with(prefix))
        .map(str::to_string)
        .with_context(|| format!("{package} depends on no {prefix}* package"))
}

/// The cached `.deb` of `package` in `dir`, downloading it with `apt-get download` if missing.
///
/// Callers wrap this in [`with_fresh_lists`] together with the look-up that
/// chose `package`, so a stale list is refreshed before both are retried.
pub fn download(package: &str, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if let Some(deb) = cached_deb(package, dir)? {
        return Ok(deb);
    }
    // apt drops to the _apt user for downloads unless told otherwise, and
    // that user may not write to the cache directory.
    run_checked(
        Command::new("apt-get")
            .args(["download", "-q", "-o", "APT::Sandbox::User=root", package])
            .current_dir(dir),
    )?;
    cached_deb(package, dir)?.with_context(|| {
        format!(
            "apt-get download {package} left no .deb in {}",
            dir.display()
        )
    })
}

/// The `.deb` of `package` already in `dir`, if any (apt names it `<package>_<version>_<arch>.deb`).
fn cached_deb(package: &str, dir: &Path) -> Result<Option<PathBuf>> {
    let prefix = format!("{package}_");
    for entry in std::fs::read_dir(dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with(&prefix) && name.ends_with(".deb") {
            return Ok(Some(path));
        }
    }
    Ok(None)
}

/// Unpacks a `.deb`'s files into `dir` without installing it.
pub fn unpack(deb: &Path, dir: &Path) -> Result<()> {
    run_checked(Command::new("dpkg").arg("-x").arg(deb).arg(dir))?;
    Ok(())
}

/// Installs packages with `apt-get install` (refreshing stale lists if it
/// fails); `release` selects a target release such as bookworm-backports.
pub fn install(packages: &[&str], release: Option<&str>) -> Result<()> {
    with_fresh_lists(|| {
        let mut command = Command::new("apt-get");
        command.env("DEBIAN_FRONTEND", "noninteractive").args([
            "install",
            "-y",
            "-q",
            "--no-install-recommends",
        ]);
        if let Some(release) = release {
            command.args(["-t", release]);
        }
        run_checked(command.args(packages)).map(drop)
    })
}

/// The Debian release the machines run, whose backports provide a qemu that
/// coexists with the machines' qemu-utils.
const RELEASE: &str = "bookworm";
/// Where a new apt source is written.
const BACKPORTS_SOURCE: &str = "/etc/apt/sources.list.d/bookworm-backports.sources";
/// Key of Debian's archive, used when the existing source names none.
const DEBIAN_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// The target release of backports, for [`install`].
pub const BACKPORTS: &str = "bookworm-backports";

/// Adds bookworm-backports to apt's sources unless already there, using the
/// same mirror as the machine's bookworm source, and refreshes the lists.
pub fn enable_backports() -> Result<()> {
    let mut sources = Vec::new();
    for file in ["/etc/apt/sources.list"] {
        if let Ok(text) = std::fs::read_to_string(file) {
            sources.push(text);
        }
    }
    if let Ok(entries) = std::fs::read_dir("/etc/apt/sources.list.d") {
        for entry in entries {
            let path = entry?.path();
            let name = path.to_string_lossy();
            if name.ends_with(".list") || name.ends_with(".sources") {
                sources.push(std::fs::read_to_string(&path)?);
            }
        }
    }
    match backports_source(&sources)? {
        None => eprintln!("vm-test: {BACKPORTS} is already an apt source"),
        Some(stanza) => {
            eprintln!("vm-test: adding {BACKPORTS} as {BACKPORTS_SOURCE}");
            std::fs::write(BACKPORTS_SOURCE, stanza)
                .with_context(|| format!("cannot write {BACKPORTS_SOURCE}"))?;
            update()?;
        }
    }
    Ok(())
}

/// The deb822 source to add for backports, or `None` if a source already
/// names it. `sources` are the contents of apt's source files, one-line
/// (`deb URI SUITE COMPONENTS`) or deb822 format.
fn backports_source(sources: &[String]) -> Result<Option<String>> {
    let active_lines = || {
        sources
            .iter()
            .flat_map(|text| text.lines())
            .map(str::trim)
            .filter(|line| !line.starts_with('#'))
    };
    if active_lines().any(|line| line.split_whitespace().any(|word| word == BACKPORTS)) {
        return Ok(None);
    }
    let mirror = sources
        .iter()
        .find_map(|text| deb822_mirror(text))
        .or_else(|| active_lines().find_map(one_line_mirror))
        .with_context(|| {
            format!("no apt source for {RELEASE} to take the mirror from: add {BACKPORTS} to apt's sources by hand")
        })?;
    let signed_by = mirror.1.unwrap_or_else(|| DEBIAN_KEYRING.to_string());
    Ok(Some(format!(
        "Types: deb\nURIs: {}\nSuites: {BACKPORTS}\nComponents: main\nSigned-By: {signed_by}\n",
        mirror.0
    )))
}

/// URI and key of a deb822 stanza whose suites include the release itself.
fn deb822_mirror(text: &str) -> Option<(String, Option<String>)> {
    text.split("\n\n").find_map(|stanza| {
        let field = |name: &str| {
            stanza.lines().find_map(|line| {
                let (key, value) = line.split_once(':')?;
                (key.trim() == name).then(|| value.trim().to_string())
            })
        };
        let suites = field("Suites")?;
        if !suites.split_whitespace().any(|suite| suite == RELEASE) {
            return None;
        }
        let uri = field("URIs")?.split_whitespace().next()?.to_string();
        Some((uri, field("Signed-By")))
    })
}

/// URI and key of a one-line `deb [options] URI bookworm ...` entry.
fn one_line_mirror(line: &str) -> Option<(String, Option<String>)> {
    let rest = line.strip_prefix("deb ")?.trim();
    let (options, rest) = match rest.strip_prefix('[') {
        Some(bracketed) => bracketed.split_once(']')?,
        None => ("", rest),
    };
    let mut words = rest.split_whitespace();
    let (uri, suite) = (words.next()?, words.next()?);
    if suite != RELEASE {
        return None;
    }
    let signed_by = options
        .split_whitespace()
        .find_map(|option| option.strip_prefix("signed-by="))
        .map(str::to_string);
    Some((uri.to_string(), signed_by))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEB822: &str = "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /k.gpg\n\nTypes: deb\nURIs: http://security.example/debian-security\nSuites: bookworm-security\nComponents: main\n";

    #[test]
    fn backports_reuse_the_mirror_and_key_of_a_deb822_source() {
        let stanza = backports_source(&[DEB822.to_string()]).unwrap().unwrap();
        assert_eq!(
            stanza,
            "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm-backports\nComponents: main\nSigned-By: /k.gpg\n"
        );
    }

    #[test]
    fn backports_reuse_the_mirror_of_a_one_line_source() {
        let list =
            "# comment\ndeb [arch=amd64 signed-by=/a.gpg] http://m.example/debian bookworm main\n";
        let stanza = backports_source(&[list.to_string()]).unwrap().unwrap();
        assert!(
            stanza.contains("URIs: http://m.example/debian\n"),
            "{stanza}"
        );
        assert!(stanza.contains("Signed-By: /a.gpg\n"), "{stanza}");
    }

    #[test]
    fn existing_backports_are_left_alone() {
        let with_backports = DEB822.replace("bookworm-updates", "bookworm-backports");
        assert_eq!(backports_source(&[with_backports]).unwrap(), None);
        // A commented-out entry does not count.
        let commented =
            format!("{DEB822}\n# deb http://m.example/debian bookworm-backports main\n");
        assert!(backports_source(&[commented]).unwrap().is_some());
    }

    #[test]
    fn without_a_bookworm_source_the_error_says_what_to_do() {
        let error = backports_source(&["deb http://m.example/debian trixie main\n".into()])
            .unwrap_err()
            .to_string();
        assert!(error.contains("by hand"), "{error}");
    }
}
