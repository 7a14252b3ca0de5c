//! Sections of docs/benchmarks.md owned by the benchmarks, between
//! `<!-- bench-NAME:begin -->` and `<!-- bench-NAME:end -->` markers, so a
//! re-run replaces its own section and nothing else.

use std::fs;

use anyhow::Context;

use crate::workspace;

/// Replaces (or appends) the section `name` of docs/benchmarks.md with
/// `body` (Markdown, starting with its heading).
pub fn write_section(name: &str, body: &str) -> anyhow::Result<()> {
    let path = workspace::root().join("docs/benchmarks.md");
    let old = fs::read_to_string(&path).unwrap_or_else(|_| "# Benchmarks\n".into());
    fs::write(&path, replace_section(&old, name, body))
        .with_context(|| format!("write {}", path.display()))?;
    println!("<== bench {name}: wrote {}", path.display());
    Ok(())
}

fn replace_section(old: &str, name: &str, body: &str) -> String {
    let begin = format!("<!-- bench-{name}:begin -->");
    let end = format!("<!-- bench-{name}:end -->");
    let section = format!("{begin}\n{}\n{end}\n", body.trim_end());
    match (old.find(&begin), old.find(&end)) {
        (Some(start), Some(stop)) if stop > start => format!(
            "{}{section}{}",
            &old[..start],
            old[stop + end.len()..].trim_start_matches('\n')
        ),
        _ => format!("{}\n\n{section}", old.trim_end()),
    }
}

#[cfg(test)]
mod tests {
    use super::replace_section;

    #[test]
    fn replaces_only_its_own_section() {
        let old = "# B\n\nintro\n<!-- bench-a:begin -->\nold a\n<!-- bench-a:end -->\n## tail\n";
        let new = replace_section(old, "a", "## A\nnew a\n");
        assert_eq!(
            new,
            "# B\n\nintro\n<!-- bench-a:begin -->\n## A\nnew a\n<!-- bench-a:end -->\n## tail\n"
        );
        // Re-running gives the same file.
        assert_eq!(replace_section(&new, "a", "## A\nnew a\n"), new);
    }

    #[test]
    fn appends_a_missing_section() {
        let new = replace_section("# B\n\nintro\n", "b", "## Bee");
        assert_eq!(
            new,
            "# B\n\nintro\n\n<!-- bench-b:begin -->\n## Bee\n<!-- bench-b:end -->\n"
        );
    }
}
