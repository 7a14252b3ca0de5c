//! Finding the shared libraries a host binary needs.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Absolute paths of the shared libraries `binary` loads, including the
/// dynamic loader; empty for a static binary.
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let output = Command::new("ldd")
        .arg(binary)
        .output()
        .context("cannot run ldd")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    if stdout.contains("not a dynamic executable") || stderr.contains("not a dynamic executable") {
        return Ok(Vec::new());
    }
    if !output.status.success() {
        bail!("ldd {} failed: {stderr}", binary.display());
    }
    parse_ldd(&stdout).with_context(|| format!("ldd {}", binary.display()))
}

/// Parses ldd's lines: `libc.so.6 => /lib/.../libc.so.6 (0x...)`,
/// `/lib64/ld-linux-x86-64.so.2 (0x...)` and `linux-vdso.so.1 (0x...)`.
fn parse_ldd(output: &str) -> Result<Vec<PathBuf>> {
    let mut libraries = Vec::new();
    for line in output.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let path = match line.split_once("=>") {
            Some((name, target)) => {
                let target = target.trim();
                if target.starts_with("not found") {
                    bail!("library {} not found", name.trim());
                }
                target.split_whitespace().next().unwrap_or_default()
            }
            None => line.split_whitespace().next().unwrap_or_default(),
        };
        // The vDSO lives in the kernel, not in a file.
        if path.starts_with('/') {
            libraries.push(PathBuf::from(path));
        }
    }
    Ok(libraries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_library_paths_and_loader() {
        let output = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                      \tlibgcc_s.so.1 => /lib/x86_64-linux-gnu/libgcc_s.so.1 (0x00007f1)\n\
                      \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f2)\n\
                      \t/lib64/ld-linux-x86-64.so.2 (0x00007f3)\n";
        assert_eq!(
            parse_ldd(output).unwrap(),
            [
                PathBuf::from("/lib/x86_64-linux-gnu/libgcc_s.so.1"),
                PathBuf::from("/lib/x86_64-linux-gnu/libc.so.6"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2"),
            ]
        );
    }

    #[test]
    fn a_missing_library_is_an_error() {
        let error = parse_ldd("\tlibmissing.so.1 => not found\n").unwrap_err();
        assert!(error.to_string().contains("libmissing.so.1"), "{error}");
    }
}
