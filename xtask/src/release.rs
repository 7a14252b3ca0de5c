//! `cargo xtask release`: everything a user installs flatnet from, in
//! `target/flatnet-<version>/`: the two charts packaged by Helm, the two
//! image archives, release notes assembled from the docs, and a
//! `SHA256SUMS` file over all of them.
//!
//! The charts are checked against the binaries the images carry before
//! anything is packaged, so a release whose chart runs a flag the binaries
//! do not accept cannot be made.

use std::{
    fmt::Write as _,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, ensure};
use clap::Args;

use crate::{
    charts,
    images::{self, ChartImages, Component, ImagesArgs, oci},
    workspace,
};

/// Options of `cargo xtask release`.
#[derive(Args, Default, Clone)]
pub struct ReleaseArgs {
    /// Use the image archives already in target/images (from `cargo xtask
    /// images`) instead of building them again.
    #[arg(long)]
    pub skip_images: bool,
}

/// Where the packaging script lives.
const PACKAGE_SCRIPT: &str = "xtask/charts/package.py";
/// Docs whose marked sections make the release notes, in order.
const NOTES_SOURCES: &[&str] = &["docs/installation.md", "docs/images.md"];
const NOTES_START: &str = "<!-- release-notes:start -->";
const NOTES_END: &str = "<!-- release-notes:end -->";

/// Builds the release; returns its directory.
pub fn run(args: &ReleaseArgs) -> anyhow::Result<PathBuf> {
    let root = workspace::root();
    let chart = ChartImages::read(&root)?;
    if !args.skip_images {
        images::run(&ImagesArgs {
            no_load: true,
            ..ImagesArgs::default()
        })?;
    }
    charts::check(&images::binary_dir(&root))?;

    let dir = root.join(format!("target/flatnet-{}", chart.app_version));
    if dir.exists() {
        fs::remove_dir_all(&dir).with_context(|| format!("remove {}", dir.display()))?;
    }
    fs::create_dir_all(&dir)?;
    workspace::run(
        "package the charts",
        Command::new(charts::python()?)
            .arg(root.join(PACKAGE_SCRIPT))
            .arg("--root")
            .arg(&root)
            .arg("--destination")
            .arg(&dir),
    )?;
    let revision = git(&root, &["rev-parse", "HEAD"])?;
    let mut images = Vec::new();
    for component in Component::ALL {
        let archive = chart.archive(&root, component);
        let bytes = fs::read(&archive).with_context(|| {
            format!(
                "read {} (run `cargo xtask images` first)",
                archive.display()
            )
        })?;
        let (digest, labels) = oci::describe(&bytes)?;
        let built_from = labels.get(images::REVISION_LABEL).map(String::as_str);
        ensure!(
            built_from == Some(revision.as_str()),
            "{} was built from commit {}, HEAD is {revision}: run `cargo xtask images` again",
            archive.display(),
            built_from.unwrap_or("(unknown)")
        );
        let name = archive.file_name().expect("a file name");
        fs::write(dir.join(name), &bytes)?;
        images.push((chart.reference(component), digest, bytes.len() as u64));
    }
    fs::write(
        dir.join("RELEASE-NOTES.md"),
        notes(&root, &chart.app_version, &revision, &images)?,
    )?;
    let sums = checksums(&dir)?;
    fs::write(dir.join("SHA256SUMS"), &sums)?;
    workspace::run(
        "verify the checksums",
        Command::new("sha256sum")
            .args(["--check", "--strict", "SHA256SUMS"])
            .current_dir(&dir),
    )?;
    println!(
        "release {} in {}:\n{sums}",
        chart.app_version,
        dir.display()
    );
    Ok(dir)
}

fn git(root: &Path, args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new("git").args(args).current_dir(root).output()?;
    ensure!(output.status.success(), "git {args:?} failed");
    Ok(String::from_utf8(output.stdout)?.trim().to_owned())
}

/// `sha256sum` lines for every file of `dir`, sorted by name.
fn checksums(dir: &Path) -> anyhow::Result<String> {
    let mut names: Vec<String> = fs::read_dir(dir)?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<anyhow::Result<_>>()?;
    names.sort();
    let mut out = String::new();
    for name in names.iter().filter(|n| *n != "SHA256SUMS") {
        let digest = oci::sha256(&fs::read(dir.join(name))?);
        writeln!(out, "{}  {name}", digest.trim_start_matches("sha256:"))?;
    }
    Ok(out)
}

/// Release notes: version, commit and images, then the marked sections of
/// [`NOTES_SOURCES`].
fn notes(
    root: &Path,
    version: &str,
    revision: &str,
    images: &[(String, String, u64)],
) -> anyhow::Result<String> {
    let mut out = format!("# flatnet {version}\n\nBuilt from commit `{revision}`.\n\n");
    out.push_str("## Images\n\n| image | manifest digest | archive |\n| --- | --- | --- |\n");
    for (reference, digest, size) in images {
        writeln!(
            out,
            "| `{reference}` | `{digest}` | {:.1} MB |",
            *size as f64 / 1e6
        )?;
    }
    for source in NOTES_SOURCES {
        let text = fs::read_to_string(root.join(source))?;
        out.push('\n');
        out.push_str(
            marked_section(&text).with_context(|| {
                format!("{source} has no {NOTES_START} ... {NOTES_END} section")
            })?,
        );
        out.push('\n');
    }
    Ok(out)
}

/// The text between the release-notes markers.
fn marked_section(text: &str) -> Option<&str> {
    let start = text.find(NOTES_START)? + NOTES_START.len();
    let end = start + text[start..].find(NOTES_END)?;
    Some(text[start..end].trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_docs_the_notes_are_made_of_have_their_sections() {
        for source in NOTES_SOURCES {
            let text = fs::read_to_string(workspace::root().join(source)).unwrap();
            let section = marked_section(&text).unwrap_or_default();
            assert!(!section.is_empty(), "{source} has no release-notes section");
        }
    }

    #[test]
    fn a_marked_section_is_the_text_between_the_markers() {
        let text = format!("a\n{NOTES_START}\n## Install\nx\n{NOTES_END}\nb");
        assert_eq!(marked_section(&text), Some("## Install\nx"));
        assert_eq!(marked_section("no markers"), None);
    }
}
