//! `cargo xtask bench hotplug`: how long a running pod waits for an extra
//! flat interface. A release `flatnet-agent run --standalone` (as in
//! `bench cni`) follows its state file; each run writes a `hotplug` entry
//! for a running pod's namespace and times from that write until the LAN
//! host gets an answer from the new interface's address. The entry is then
//! removed and its interface awaited gone before the next run.

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use super::{
    Netns, PinRoot, build_release_binaries,
    cni::{Agent, PREFIX_LEN, bench_state, node_and_lan, tempfile_dir},
    machine, percentile, report,
};

/// Measured runs.
const RUNS: usize = 50;
/// Unmeasured runs first.
const WARM_UP: usize = 3;
/// Bound on one run (not a timing assertion: a stuck agent ends the bench).
const RUN_LIMIT: Duration = Duration::from_secs(30);

/// Runs the benchmark, prints `hotplug: p50=<ms> p99=<ms>` and writes its
/// section of docs/benchmarks.md.
pub fn run() -> anyhow::Result<()> {
    let binaries = build_release_binaries()?;
    let machine = machine();
    let (node, lan) = node_and_lan("fh")?;
    let pod = Netns::new(format!("fhpod-{}", std::process::id() % 100_000))?;
    lan.ip(&[
        "addr",
        "add",
        &format!("198.18.0.1/{PREFIX_LEN}"),
        "dev",
        "lan0",
    ])?;
    let dir = tempfile_dir("flatnet-bench-hotplug")?;
    let pin = PinRoot::new("bench-hotplug");
    let _agent = Agent::start(&binaries, &dir, &node, &pin)?;
    let state = dir.join("state.yaml");
    let entry = format!(
        "hotplug:\n  - {{name: bench, netns: {}, attachments: [{{network: flatnet-bench, ifname: net1}}]}}\n",
        pod.path().display()
    );
    println!("==> bench hotplug: {RUNS} runs (state file written → LAN host reaches net1)");
    let mut samples = Vec::with_capacity(RUNS);
    for i in 0..WARM_UP + RUNS {
        // The agent looks every 50 ms; a run starting right after the
        // previous removal would always meet the same phase of that tick.
        std::thread::sleep(Duration::from_millis(
            u64::try_from(i * 37 % 50).unwrap_or(0),
        ));
        let started = Instant::now();
        write(&state, &bench_state(&entry))?;
        let address = loop {
            if let Some(address) = address_of(&pod, "net1")?
                && answers(&lan, &address)
            {
                break address;
            }
            if started.elapsed() > RUN_LIMIT {
                bail!(
                    "net1 was not reachable {RUN_LIMIT:?} after the state file named it; see {}",
                    dir.join("agent.log").display()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        let took = started.elapsed();
        if i >= WARM_UP {
            samples.push(took);
        }
        write(&state, &bench_state(""))?;
        let removing = Instant::now();
        while address_of(&pod, "net1")?.is_some() {
            if removing.elapsed() > RUN_LIMIT {
                bail!("net1 ({address}) was not removed {RUN_LIMIT:?} after its entry went");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let (p50, p99) = (
        ms(percentile(&samples, 0.5)),
        ms(percentile(&samples, 0.99)),
    );
    let line = format!("hotplug: p50={p50:.1} p99={p99:.1}");
    report::write_section(
        "hotplug",
        &format!(
            "## Hot-plugging an interface into a running pod\n\n\
             `cargo xtask bench hotplug` (root): a release standalone agent; each of {RUNS} runs \
             (after {WARM_UP} unmeasured) writes a `hotplug` entry for a running pod into the state \
             file and times until the LAN host's ping of the new `net1` address is answered (one \
             `ping -c1` per poll, which the figure includes). The agent looks at the desired \
             interfaces every 50 ms; runs start at staggered phases of that tick, so on average \
             25 ms of a run is waiting for it.\n\n\
             Machine: {machine}.\n\n\
             | runs | p50 (ms) | p99 (ms) |\n|---|---|---|\n| {RUNS} | {p50:.1} | {p99:.1} |\n\n\
             `{line}`\n"
        ),
    )?;
    println!("{line}");
    Ok(())
}

fn write(path: &Path, text: &str) -> anyhow::Result<()> {
    std::fs::write(path, text).with_context(|| format!("write {}", path.display()))
}

/// The IPv4 address of `ifname` in `pod`, once it has one.
fn address_of(pod: &Netns, ifname: &str) -> anyhow::Result<Option<String>> {
    let out = Command::new("ip")
        .args(["-n", &pod.name, "-j", "-4", "addr", "show", "dev", ifname])
        .output()
        .context("run ip")?;
    if !out.status.success() {
        return Ok(None);
    }
    let shown: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_default();
    Ok(shown[0]["addr_info"][0]["local"]
        .as_str()
        .map(str::to_owned))
}

/// Whether `address` answers one ping from the LAN host.
fn answers(lan: &Netns, address: &str) -> bool {
    lan.command("ping")
        .args(["-c", "1", "-W", "1", "-i", "0.01", address])
        .output()
        .is_ok_and(|o| o.status.success())
}
