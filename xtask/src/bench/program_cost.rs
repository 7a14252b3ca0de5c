//! What attached eBPF programs cost on real traffic, from the kernel's own
//! run-time accounting (`kernel.bpf_stats_enabled`): per program, how often
//! it ran and for how long, cold caches and all, which BPF_PROG_TEST_RUN
//! on one frame in a loop cannot show.

use std::{
    os::unix::fs::MetadataExt,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::Context;
use serde_json::Value;

use super::{Netns, sh};
use flatnet_common::pin::LINKS_DIR;

const STATS_SYSCTL: &str = "/proc/sys/kernel/bpf_stats_enabled";

/// A program attached with tc to a device.
pub struct AttachedProgram {
    /// Where it runs, for example `eth0 (pod a) egress`.
    pub hook: String,
    /// The program's name.
    pub name: String,
    id: u64,
}

/// The programs on `device` in `netns`: netlink filters as `bpftool net
/// show` lists them, TCX links through flatnet's pins under `pin_root`
/// (Debian's bpftool 7.1 predates TCX in `net show`). `label` names the
/// device in [`AttachedProgram::hook`].
pub fn attached(
    netns: &Netns,
    device: &str,
    label: &str,
    pin_root: &Path,
) -> anyhow::Result<Vec<AttachedProgram>> {
    let out = netns
        .command("bpftool")
        .args(["--json", "net", "show", "dev", device])
        .output()
        .context("run bpftool net show")?;
    let shown: Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("bpftool net show: {}", String::from_utf8_lossy(&out.stderr)))?;
    let mut programs = tc_programs(&shown, label)?;
    programs.extend(tcx_links(netns, device, label, pin_root)?);
    Ok(programs)
}

/// The TCX links the agent pinned for `device`.
fn tcx_links(
    netns: &Netns,
    device: &str,
    label: &str,
    pin_root: &Path,
) -> anyhow::Result<Vec<AttachedProgram>> {
    let dir = pin_root.join(LINKS_DIR);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("read {}", dir.display())),
    };
    let netns_inode = std::fs::metadata(netns.path())?.ino();
    let shown: Value = serde_json::from_str(&netns.ip(&["-j", "link", "show", "dev", device])?)
        .context("ip -j link show")?;
    let ifindex = shown[0]["ifindex"]
        .as_u64()
        .context("ip -j link show without ifindex")?;
    let mut programs = Vec::new();
    for entry in entries {
        let name = entry?.file_name().to_string_lossy().into_owned();
        let Some(program) = linked_program(&name, netns_inode, ifindex) else {
            continue;
        };
        let link: Value = serde_json::from_str(&sh(
            "bpftool",
            &[
                "--json",
                "link",
                "show",
                "pinned",
                &dir.join(&name).display().to_string(),
            ],
        )?)
        .context("bpftool link show")?;
        programs.push(AttachedProgram {
            // flatnet's programs are named after their hook.
            hook: format!("{label} {}", program.rsplit('_').next().unwrap_or("?")),
            name: program.to_owned(),
            id: link["prog_id"]
                .as_u64()
                .context("bpftool link show without a program id")?,
        });
    }
    Ok(programs)
}

/// The program of a link pin named `<netns inode>-<ifindex>-<program>`,
/// when it is for that namespace and interface.
fn linked_program(pin: &str, netns_inode: u64, ifindex: u64) -> Option<&str> {
    pin.strip_prefix(&format!("{netns_inode}-{ifindex}-"))
}

/// The tc programs in `bpftool --json net show` output.
fn tc_programs(shown: &Value, label: &str) -> anyhow::Result<Vec<AttachedProgram>> {
    let mut programs = Vec::new();
    for entry in shown.as_array().into_iter().flatten() {
        for filter in entry["tc"].as_array().into_iter().flatten() {
            let direction = filter["kind"]
                .as_str()
                .and_then(|kind| kind.strip_prefix("clsact/"))
                .unwrap_or("?");
            programs.push(AttachedProgram {
                hook: format!("{label} {direction}"),
                name: filter["name"].as_str().unwrap_or("?").to_owned(),
                id: filter["id"]
                    .as_u64()
                    .context("bpftool net show without a program id")?,
            });
        }
    }
    Ok(programs)
}

/// One program's share of a measured stretch of traffic.
pub struct ProgramCost<'a> {
    pub program: &'a AttachedProgram,
    pub runs: u64,
    pub run_time: Duration,
    pub wall: Duration,
}

impl ProgramCost<'_> {
    pub fn runs_per_second(&self) -> f64 {
        self.runs as f64 / self.wall.as_secs_f64()
    }

    pub fn ns_per_run(&self) -> f64 {
        self.run_time.as_nanos() as f64 / self.runs.max(1) as f64
    }

    /// Run time as a share of one CPU over the stretch (0..=1 per CPU).
    pub fn cpu_share(&self) -> f64 {
        self.run_time.as_secs_f64() / self.wall.as_secs_f64()
    }
}

/// Runs `work` with the accounting on and returns its result with what
/// each of `programs` cost meanwhile. The accounting adds two clock reads
/// to every program run, so it is on only for `work`, and set back to what
/// it was afterwards.
pub fn measure<'a, T>(
    programs: &'a [AttachedProgram],
    work: impl FnOnce() -> anyhow::Result<T>,
) -> anyhow::Result<(T, Vec<ProgramCost<'a>>)> {
    let _accounting = Accounting::enable()?;
    let before = programs
        .iter()
        .map(|p| run_totals(p.id))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let start = Instant::now();
    let result = work()?;
    let wall = start.elapsed();
    let mut costs = Vec::new();
    for (program, (runs_before, time_before)) in programs.iter().zip(before) {
        let (runs, time) = run_totals(program.id)?;
        costs.push(ProgramCost {
            program,
            runs: runs - runs_before,
            run_time: Duration::from_nanos(time - time_before),
            wall,
        });
    }
    Ok((result, costs))
}

/// A program's run count and total run time in nanoseconds so far (both
/// absent from `bpftool prog show` until it first ran with accounting on).
fn run_totals(id: u64) -> anyhow::Result<(u64, u64)> {
    let shown: Value = serde_json::from_str(&sh(
        "bpftool",
        &["--json", "prog", "show", "id", &id.to_string()],
    )?)
    .context("bpftool prog show output")?;
    Ok((
        shown["run_cnt"].as_u64().unwrap_or(0),
        shown["run_time_ns"].as_u64().unwrap_or(0),
    ))
}

/// `kernel.bpf_stats_enabled` on while alive, the previous value after.
struct Accounting {
    previous: String,
}

impl Accounting {
    fn enable() -> anyhow::Result<Self> {
        let previous = std::fs::read_to_string(STATS_SYSCTL)
            .with_context(|| format!("read {STATS_SYSCTL}"))?;
        std::fs::write(STATS_SYSCTL, "1").with_context(|| format!("write {STATS_SYSCTL}"))?;
        Ok(Self {
            previous: previous.trim().to_owned(),
        })
    }
}

impl Drop for Accounting {
    fn drop(&mut self) {
        let _ = std::fs::write(STATS_SYSCTL, &self.previous);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tc_programs_are_read_from_bpftool_net_show() {
        // As printed by Debian's bpftool 7.1 for a pod interface.
        let shown: Value = serde_json::from_str(
            r#"[{"xdp":[],"tc":[
                {"devname":"eth0","ifindex":3,"kind":"clsact/ingress","name":"policy_ingress","id":5117},
                {"devname":"eth0","ifindex":3,"kind":"clsact/egress","name":"policy_egress","id":5118}
            ],"flow_dissector":[]}]"#,
        )
        .unwrap();
        let programs = tc_programs(&shown, "eth0 of pod a").unwrap();
        let read: Vec<_> = programs
            .iter()
            .map(|p| (p.hook.as_str(), p.name.as_str(), p.id))
            .collect();
        assert_eq!(
            read,
            [
                ("eth0 of pod a ingress", "policy_ingress", 5117),
                ("eth0 of pod a egress", "policy_egress", 5118),
            ]
        );
    }

    #[test]
    fn link_pins_name_namespace_interface_and_program() {
        assert_eq!(
            linked_program("4026532177-2-policy_egress", 4026532177, 2),
            Some("policy_egress")
        );
        assert_eq!(
            linked_program("4026532177-12-policy_egress", 4026532177, 2),
            None
        );
        assert_eq!(
            linked_program("4026532178-2-policy_egress", 4026532177, 2),
            None
        );
    }

    #[test]
    fn a_filter_without_program_id_is_an_error() {
        let shown: Value =
            serde_json::from_str(r#"[{"tc":[{"kind":"clsact/ingress","name":"x"}]}]"#).unwrap();
        assert!(tc_programs(&shown, "eth0").is_err());
    }

    #[test]
    fn cost_figures_follow_from_runs_and_time() {
        let program = AttachedProgram {
            hook: "master ingress".into(),
            name: "uplink_ingress".into(),
            id: 1,
        };
        let cost = ProgramCost {
            program: &program,
            runs: 20_000,
            run_time: Duration::from_millis(10),
            wall: Duration::from_secs(2),
        };
        assert_eq!(cost.runs_per_second(), 10_000.0);
        assert_eq!(cost.ns_per_run(), 500.0);
        assert_eq!(cost.cpu_share(), 0.005);
    }
}
