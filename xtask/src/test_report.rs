//! Running test binaries while tallying their results, so `cargo xtask
//! test` can end with one summary line over every suite.

use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
};

use anyhow::Context;

use crate::workspace;

/// The prefix of the line a test writes, uncaptured, when it skips at run
/// time (no root, a kernel feature missing): libtest counts it as passed.
const SKIP_PREFIX: &str = "skipped: ";

/// Totals over `test result:` lines, and the tests that skipped at run time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub passed: u64,
    pub failed: u64,
    pub ignored: u64,
    /// `<test>: <why>` of each run-time skip.
    pub skips: Vec<String>,
}

impl Totals {
    /// Adds the counts of one libtest summary line, e.g.
    /// `test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; ...`,
    /// or the skip a `skipped: <test>: <why>` line reports.
    /// Returns whether the line was either.
    pub fn add_line(&mut self, line: &str) -> bool {
        if let Some(why) = line.trim().strip_prefix(SKIP_PREFIX) {
            self.skips.push(why.to_owned());
            return true;
        }
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

    /// The run-time skips, one per line with its reason (empty without any).
    pub fn skip_list(&self) -> String {
        let mut list = String::new();
        if !self.skips.is_empty() {
            list.push_str(&format!("skipped at run time ({}):\n", self.skips.len()));
            for skip in &self.skips {
                list.push_str(&format!("  {skip}\n"));
            }
        }
        list
    }

    /// The closing line: `tests: N passed, N failed, N skipped`; a test
    /// that skipped at run time counts as skipped, not passed.
    pub fn summary(&self) -> String {
        let skipped = self.skips.len() as u64;
        format!(
            "tests: {} passed, {} failed, {} skipped",
            self.passed.saturating_sub(skipped),
            self.failed,
            self.ignored + skipped
        )
    }
}

/// Runs a libtest-driven command, echoing its output and adding its result
/// and skip lines (on either stream) to `totals`; fails when the command
/// fails.
pub fn run_tests(step: &str, command: &mut Command, totals: &mut Totals) -> anyhow::Result<()> {
    workspace::run_step(step, command, |command| {
        let mut child = command
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().expect("stdout is piped");
        let stderr = child.stderr.take().expect("stderr is piped");
        // Skip lines are written to stderr, past libtest's capture.
        let skips = std::thread::spawn(move || {
            let mut lines = Vec::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("{line}");
                if line.trim().starts_with(SKIP_PREFIX) {
                    lines.push(line);
                }
            }
            lines
        });
        for output in BufReader::new(stdout).lines() {
            let output = output.context("read test output")?;
            totals.add_line(&output);
            println!("{output}");
        }
        let status = child.wait()?;
        for line in skips.join().expect("the stderr reader does not panic") {
            totals.add_line(&line);
        }
        Ok(status)
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
        assert_eq!((totals.passed, totals.failed, totals.ignored), (5, 1, 1));
        assert_eq!(totals.summary(), "tests: 5 passed, 1 failed, 1 skipped");
    }

    #[test]
    fn a_run_time_skip_counts_as_skipped_with_its_reason() {
        let mut totals = Totals::default();
        assert!(totals.add_line("skipped: link_test: kernel lacks ipvlan"));
        assert!(totals.add_line(
            "test result: ok. 4 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.00s"
        ));
        assert_eq!(totals.summary(), "tests: 3 passed, 0 failed, 2 skipped");
        assert_eq!(
            totals.skip_list(),
            "skipped at run time (1):\n  link_test: kernel lacks ipvlan\n"
        );
    }
}
