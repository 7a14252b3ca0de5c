//! Running test binaries while tallying their results, so `cargo xtask
//! test` can end with one summary line over every suite.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
};

use anyhow::Context;

use crate::workspace;

/// Totals over `test result:` lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
}

impl Totals {
    /// Adds the counts of one libtest summary line, e.g.
    /// `test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; ...`.
    /// Returns whether the line was such a summary.
    pub fn add_line(&mut self, line: &str) -> bool {
        let Some(rest) = line.trim().strip_prefix("test result: ") else {
            return false;
        };
        for part in rest.split(';') {
            let mut words = part.split_whitespace().rev();
            let (Some(label), Some(count)) = (words.next(), words.next()) else {
                continue;
            };
            let Ok(count) = count.parse::<u64>() else {
                continue;
            };
            match label {
                "passed" => self.passed += count,
                "failed" => self.failed += count,
                "ignored" => self.ignored += count,
                _ => {}
            }
        }
        true
    }

    /// The closing line: `tests: N passed, N failed, N skipped`.
    pub fn summary(&self) -> String {
        format!(
            "tests: {} passed, {} failed, {} skipped",
            self.passed, self.failed, self.ignored
        )
    }
}

/// Runs a libtest-driven command, echoing its stdout and adding its result
/// lines to `totals`; fails when the command fails.
pub fn run_tests(step: &str, command: &mut Command, totals: &mut Totals) -> anyhow::Result<()> {
    workspace::run_step(step, command, |command| {
        let mut child = command.stdout(Stdio::piped()).spawn()?;
        let stdout = child.stdout.take().expect("stdout is piped");
        for output in BufReader::new(stdout).lines() {
            let output = output.context("read test output")?;
            totals.add_line(&output);
            println!("{output}");
        }
        Ok(child.wait()?)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adds_libtest_summaries() {
        let mut totals = Totals::default();
        assert!(totals.add_line(
            "test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.00s"
        ));
        assert!(totals.add_line(
            "test result: FAILED. 2 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in 3.1s"
        ));
        assert!(!totals.add_line("running 3 tests"));
        assert_eq!(
            totals,
            Totals {
                passed: 5,
                failed: 1,
                ignored: 1
            }
        );
        assert_eq!(totals.summary(), "tests: 5 passed, 1 failed, 1 skipped");
    }
}
