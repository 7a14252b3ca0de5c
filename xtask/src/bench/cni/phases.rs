//! The agent's per-phase timings of CNI commands, read from its
//! `flatnet_agent_cni_phase_seconds` histograms on `/metrics` before and
//! after a measured stretch, as a table of mean wall time per phase.

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{Context, bail};

use super::{Measured, ms, percentile};

const METRIC: &str = "flatnet_agent_cni_phase_seconds";
/// ADDs by where their conflict verdict came from (label `source`).
const VERDICTS: &str = "flatnet_agent_conflict_probe_add_verdicts_total{source=\"";
/// The command key the verdict counts are kept under in [`Totals`].
const VERDICT_KEY: &str = "add_verdict";

/// (command, phase) → (sum of seconds, count).
pub type Totals = BTreeMap<(String, String), (f64, u64)>;

/// Reads the phase histograms from the agent's admin server.
pub fn scrape(admin: SocketAddr) -> anyhow::Result<Totals> {
    let mut stream = TcpStream::connect_timeout(&admin, Duration::from_secs(5))
        .with_context(|| format!("connect to the agent's admin server {admin}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        stream,
        "GET /metrics HTTP/1.0\r\nHost: {admin}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let Some((head, body)) = response.split_once("\r\n\r\n") else {
        bail!("the agent's /metrics answer has no body: {response:?}");
    };
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        bail!("the agent's /metrics answered {head:?}");
    }
    Ok(parse(body))
}

/// The `_sum` and `_count` series of the phase histograms in `text`.
fn parse(text: &str) -> Totals {
    let mut totals = Totals::new();
    for line in text.lines() {
        // A counter: kept as a count of its source, with no time.
        if let Some((source, value)) = line
            .strip_prefix(VERDICTS)
            .and_then(|rest| rest.split_once("\"} "))
        {
            let count = value.split_whitespace().next().unwrap_or_default();
            totals.insert(
                (VERDICT_KEY.to_owned(), source.to_owned()),
                (0.0, count.parse().unwrap_or(0)),
            );
            continue;
        }
        let Some(rest) = line.strip_prefix(METRIC) else {
            continue;
        };
        let (is_sum, rest) = match (rest.strip_prefix("_sum{"), rest.strip_prefix("_count{")) {
            (Some(rest), _) => (true, rest),
            (_, Some(rest)) => (false, rest),
            _ => continue,
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let label = |name: &str| {
            labels.split(',').find_map(|pair| {
                pair.strip_prefix(name)
                    .and_then(|v| v.strip_prefix("=\""))
                    .and_then(|v| v.strip_suffix('"'))
                    .map(str::to_owned)
            })
        };
        let (Some(command), Some(phase)) = (label("command"), label("phase")) else {
            continue;
        };
        // A timestamp or exemplar may follow the value.
        let value = value.split_whitespace().next().unwrap_or_default();
        let entry = totals.entry((command, phase)).or_default();
        if is_sum {
            entry.0 = value.parse().unwrap_or(0.0);
        } else {
            entry.1 = value.parse().unwrap_or(0);
        }
    }
    totals
}

/// Mean seconds per phase between two scrapes.
pub struct Breakdown {
    /// (command, phase) → (mean seconds, times run).
    means: BTreeMap<(String, String), (f64, u64)>,
}

impl Breakdown {
    /// What ran between `before` and `after`.
    pub fn between(before: &Totals, after: &Totals) -> Self {
        let means = after
            .iter()
            .filter_map(|(key, (sum, count))| {
                let (sum0, count0) = before.get(key).copied().unwrap_or_default();
                let runs = count.checked_sub(count0).filter(|n| *n > 0)?;
                Some((key.clone(), ((sum - sum0) / runs as f64, runs)))
            })
            .collect();
        Self { means }
    }

    /// How many ADDs took their conflict verdict from `source` (`ahead`:
    /// a probe made before the ADD; `at_add`: one the ADD sent).
    pub fn verdicts(&self, source: &str) -> u64 {
        self.means
            .get(&(VERDICT_KEY.to_owned(), source.to_owned()))
            .map_or(0, |(_, runs)| *runs)
    }

    /// Mean seconds of `phase` of `command`.
    pub fn mean(&self, command: &str, phase: &str) -> Option<f64> {
        self.means
            .get(&(command.to_owned(), phase.to_owned()))
            .map(|(mean, _)| *mean)
    }

    /// The table for ADD and DEL: each phase's mean, slowest first, with
    /// the time outside the agent (plugin exec and RPC) from the client's
    /// sequential samples in `client` (none when the commands overlapped:
    /// then the client's time is not one command's).
    pub fn table(&self, client: Option<&Measured>) -> String {
        let mut out = String::from(
            "| command | phase | mean | runs per command |\n| --- | --- | ---: | ---: |\n",
        );
        for command in ["add", "del"] {
            let Some(total) = self.mean(command, "total") else {
                continue;
            };
            let commands = self.means[&(command.to_owned(), "total".to_owned())].1;
            let mut rows: Vec<(&str, f64, u64)> = self
                .means
                .iter()
                .filter(|((c, p), _)| c == command && p != "total")
                .map(|((_, p), (mean, runs))| (p.as_str(), *mean, *runs))
                .collect();
            rows.sort_by(|a, b| b.1.total_cmp(&a.1));
            let upper = command.to_uppercase();
            if let Some(client) = client {
                let samples = if command == "add" {
                    &client.add
                } else {
                    &client.del
                };
                let client_mean = mean(samples);
                out += &format!(
                    "| {upper} | whole command as the runtime sees it (client mean) | {} | 1 |\n",
                    ms(client_mean)
                );
                // DEL answers before its work ends (see docs/cni.md).
                let answered = self.mean(command, "until_answer").unwrap_or(total);
                out += &format!(
                    "| {upper} | plugin exec + RPC (client mean − agent time to the answer) | {} | 1 |\n",
                    ms(client_mean.saturating_sub(secs(answered)))
                );
            }
            out += &format!(
                "| {upper} | total (agent handler, to the end of its work) | {} | 1 |\n",
                ms(secs(total))
            );
            for (phase, mean, runs) in rows {
                out += &format!(
                    "| {upper} | {phase} | {} | {:.1} |\n",
                    ms(secs(mean)),
                    runs as f64 / commands as f64
                );
            }
        }
        if let Some(client) = client {
            out += &format!(
                "| VERSION | flatnet-cni start-up and exit (p50) | {} | |\n",
                ms(percentile(&client.version, 0.5))
            );
        }
        out += &format!(
            "\nConflict verdicts of these ADDs: {} probed ahead of the ADD, {} probed by the ADD.\n",
            self.verdicts("ahead"),
            self.verdicts("at_add")
        );
        out
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.max(0.0))
}

fn mean(samples: &[Duration]) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.iter().sum::<Duration>() / samples.len() as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_sums_and_counts_and_takes_the_difference() {
        let text = "# HELP x\n\
            flatnet_agent_cni_phase_seconds_sum{command=\"add\",phase=\"claim\"} 0.5\n\
            flatnet_agent_cni_phase_seconds_count{command=\"add\",phase=\"claim\"} 10\n\
            flatnet_agent_cni_phase_seconds_bucket{command=\"add\",phase=\"claim\",le=\"0.1\"} 10\n\
            flatnet_agent_ip_conflicts_total 0\n\
            flatnet_agent_conflict_probe_add_verdicts_total{source=\"ahead\"} 7\n";
        let after = parse(text);
        assert_eq!(after[&("add".into(), "claim".into())], (0.5, 10));
        let mut earlier = Totals::new();
        earlier.insert((VERDICT_KEY.into(), "ahead".into()), (0.0, 3));
        let verdicts = Breakdown::between(&earlier, &after);
        assert_eq!(verdicts.verdicts("ahead"), 4, "ADDs between the scrapes");
        assert_eq!(verdicts.verdicts("at_add"), 0);
        let mut before = Totals::new();
        before.insert(("add".into(), "claim".into()), (0.1, 2));
        let breakdown = Breakdown::between(&before, &after);
        let mean = breakdown.mean("add", "claim").unwrap();
        assert!((mean - 0.05).abs() < 1e-9, "{mean}");
        assert_eq!(
            Breakdown::between(&after, &after).mean("add", "claim"),
            None
        );
    }
}
