//! The lab's steps, their progress lines and the closing report table.

use std::{
    fmt,
    time::{Duration, Instant},
};

/// What became of one step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every check of the step held.
    Passed,
    /// A check did not hold, or the step could not be done.
    Failed(String),
    /// Not run on this machine, for the reason given.
    Skipped(String),
    /// Stopped by SIGINT/SIGTERM.
    Interrupted,
    /// An earlier step failed or the lab was interrupted first.
    NotRun,
}

impl Outcome {
    fn label(&self) -> &'static str {
        match self {
            Outcome::Passed => "ok",
            Outcome::Failed(_) => "FAILED",
            Outcome::Skipped(_) => "skipped",
            Outcome::Interrupted => "interrupted",
            Outcome::NotRun => "not run",
        }
    }

    fn detail(&self) -> Option<&str> {
        match self {
            Outcome::Failed(why) | Outcome::Skipped(why) => Some(why),
            _ => None,
        }
    }
}

/// One line of the report.
#[derive(Clone, Debug)]
pub struct StepRecord {
    /// Short step name (the `--interrupt-after` value).
    pub name: &'static str,
    /// What the step checks.
    pub checks: &'static str,
    /// Its outcome.
    pub outcome: Outcome,
    /// How long it took (zero when not run).
    pub took: Duration,
}

/// Progress and results of one lab run.
#[derive(Debug)]
pub struct Report {
    started: Instant,
    steps: Vec<StepRecord>,
    /// Times steps measured, with what each measures, listed under the table.
    timings: Vec<(String, Duration)>,
}

impl Default for Report {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            steps: Vec::new(),
            timings: Vec::new(),
        }
    }
}

impl Report {
    /// Prints the progress line that opens a step.
    #[expect(
        clippy::unused_self,
        reason = "the report owns every line the lab prints, this one needs no state"
    )]
    pub fn begin(&self, number: usize, total: usize, name: &str, checks: &str) {
        println!("[lab] {number:>2}/{total} {name}: {checks}");
    }

    /// Records a finished step and prints its outcome line.
    pub fn finish(&mut self, record: StepRecord) {
        let detail = record
            .outcome
            .detail()
            .map(|d| format!(": {d}"))
            .unwrap_or_default();
        println!(
            "[lab]       {} {} ({:.1}s){detail}",
            record.name,
            record.outcome.label(),
            record.took.as_secs_f64()
        );
        self.steps.push(record);
    }

    /// Records a step that never started.
    pub fn not_run(&mut self, name: &'static str, checks: &'static str) {
        self.steps.push(StepRecord {
            name,
            checks,
            outcome: Outcome::NotRun,
            took: Duration::ZERO,
        });
    }

    /// Records a time a step measured, listed under the table with what
    /// it measures.
    pub fn timing(&mut self, what: impl Into<String>, took: Duration) {
        self.timings.push((what.into(), took));
    }

    /// Steps that failed.
    pub fn failures(&self) -> Vec<&StepRecord> {
        self.steps
            .iter()
            .filter(|s| matches!(s.outcome, Outcome::Failed(_)))
            .collect()
    }

    /// Total time since the lab started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

impl fmt::Display for Report {
    /// The closing table: step, result, time, what was checked.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name_width = self.steps.iter().map(|s| s.name.len()).max().unwrap_or(4);
        writeln!(f, "lab report")?;
        writeln!(
            f,
            "  {:<name_width$}  {:<11}  {:>7}  checked",
            "step", "result", "time"
        )?;
        for step in &self.steps {
            writeln!(
                f,
                "  {:<name_width$}  {:<11}  {:>6.1}s  {}",
                step.name,
                step.outcome.label(),
                step.took.as_secs_f64(),
                step.checks
            )?;
            if let Some(detail) = step.outcome.detail() {
                writeln!(f, "  {:<name_width$}  {:<11}           -> {detail}", "", "")?;
            }
        }
        let failed = self.failures().len();
        let passed = self
            .steps
            .iter()
            .filter(|s| s.outcome == Outcome::Passed)
            .count();
        let skipped = self
            .steps
            .iter()
            .filter(|s| matches!(s.outcome, Outcome::Skipped(_)))
            .count();
        write!(
            f,
            "  {passed} passed, {failed} failed, {skipped} skipped in {:.1}s",
            self.elapsed().as_secs_f64()
        )?;
        if !self.timings.is_empty() {
            write!(f, "\ntimings")?;
            for (what, took) in &self.timings {
                write!(f, "\n  {:>8.1} ms  {what}", took.as_secs_f64() * 1e3)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &'static str, outcome: Outcome) -> StepRecord {
        StepRecord {
            name,
            checks: "something",
            outcome,
            took: Duration::from_millis(1500),
        }
    }

    #[test]
    fn the_table_lists_every_step_with_its_result_and_reason() {
        let mut report = Report::default();
        report.finish(record("topology", Outcome::Passed));
        report.finish(record("ipvlan", Outcome::Skipped("no ipvlan".into())));
        report.finish(record("policy", Outcome::Failed("port 9090 open".into())));
        report.not_run("conflict", "rogue host");
        let table = report.to_string();
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[2].starts_with("  topology  ok "), "{table}");
        assert!(lines[2].contains("1.5s"), "{table}");
        assert!(lines[3].contains("skipped"), "{table}");
        assert!(lines[4].ends_with("-> no ipvlan"), "{table}");
        assert!(lines[5].contains("FAILED"), "{table}");
        assert!(lines[6].ends_with("-> port 9090 open"), "{table}");
        assert!(lines[7].contains("not run"), "{table}");
        assert!(
            lines[8].contains("1 passed, 1 failed, 1 skipped"),
            "{table}"
        );
        assert_eq!(report.failures().len(), 1);
        assert_eq!(
            lines.len(),
            9,
            "no timings section without timings: {table}"
        );
    }

    #[test]
    fn measured_timings_follow_the_table() {
        let mut report = Report::default();
        report.finish(record("runtime", Outcome::Passed));
        report.timing(
            "hot-plug: write -> reachable",
            Duration::from_micros(41_500),
        );
        let table = report.to_string();
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[4], "timings", "{table}");
        assert_eq!(
            lines[5], "      41.5 ms  hot-plug: write -> reachable",
            "{table}"
        );
    }
}
