//! `flatnet-agent datapath policy ...`: network policy on pod interfaces by hand.

use std::{collections::BTreeMap, fs, path::PathBuf};

use anyhow::Context;
use clap::Subcommand;
use flatnet_agent::{
    datapath::{
        Datapath, DatapathConfig, InstalledPolicy, PolicyDrops, PolicyMaps, PolicyRuleIds,
        PolicyStats, detach_policy,
    },
    policy_compiler::{
        FlatPod, MultiNetworkPolicy, NetworkNames, PolicyInputs, compile, selector::Labels,
    },
};
use serde::Deserialize;

use super::{
    datapath::{AttachArgs, PinArgs, TargetArgs},
    inspect::Output,
};

#[derive(Subcommand, Debug)]
pub enum PolicyCommand {
    /// Attach the policy programs (ingress and egress) to a pod interface.
    Attach {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        pin: PinArgs,
        #[command(flatten)]
        attach: AttachArgs,
    },
    /// Detach the policy programs from a pod interface (tables are kept).
    Detach {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        pin: PinArgs,
    },
    /// Compile MultiNetworkPolicies and install the tables in the pinned maps.
    Apply {
        /// JSON file: a MultiNetworkPolicy, a list of them, or a Kubernetes List.
        #[arg(long)]
        policies: PathBuf,
        /// JSON file: list of flat pods `{namespace, name, labels, ips, local}`.
        #[arg(long)]
        pods: PathBuf,
        /// JSON file: namespace name -> labels (for namespace selectors).
        #[arg(long)]
        namespaces: Option<PathBuf>,
        /// Network names `policy-for` must mention (`name` or `namespace/name`).
        #[arg(long = "network", env = "FLATNET_POLICY_NETWORKS", value_delimiter = ',',
              default_value = flatnet_agent::policy_compiler::api::DEFAULT_NETWORK_NAME)]
        networks: Vec<String>,
        #[command(flatten)]
        pin: PinArgs,
    },
    /// Show the installed tables with per-rule counters and verdict counters.
    Show {
        #[command(flatten)]
        pin: PinArgs,
        /// Output format.
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
    },
    /// Print the drop events waiting in the ring buffer.
    Drops {
        #[command(flatten)]
        pin: PinArgs,
    },
}

/// The accepted shapes of the policies file.
#[derive(Deserialize)]
#[serde(untagged)]
enum PolicyFile {
    List { items: Vec<MultiNetworkPolicy> },
    Many(Vec<MultiNetworkPolicy>),
    One(Box<MultiNetworkPolicy>),
}

impl PolicyCommand {
    pub fn run(self) -> anyhow::Result<()> {
        match self {
            PolicyCommand::Attach {
                target,
                pin,
                attach,
            } => {
                let mut datapath = Datapath::load(&pin.config(&attach))?;
                let interface = target.interface.clone();
                target
                    .run(|ifname| datapath.attach_policy(ifname))?
                    .with_context(|| format!("attach policy programs to {interface}"))?;
                println!(
                    "policy programs attached to {interface} ({})",
                    datapath.attach_mechanism()
                );
            }
            PolicyCommand::Detach { target, pin } => {
                let interface = target.interface.clone();
                if target.run(|ifname| detach_policy(&pin.pin_root, ifname))?? {
                    println!("policy programs detached from {interface}");
                } else {
                    println!("no flatnet policy program was attached to {interface}");
                }
            }
            PolicyCommand::Apply {
                policies,
                pods,
                namespaces,
                networks,
                pin,
            } => {
                let policies = match read_json::<PolicyFile>(&policies)? {
                    PolicyFile::List { items } | PolicyFile::Many(items) => items,
                    PolicyFile::One(one) => vec![*one],
                };
                let pods: Vec<FlatPod> = read_json(&pods)?;
                let namespaces: BTreeMap<String, Labels> = match namespaces {
                    Some(path) => read_json(&path)?,
                    None => BTreeMap::new(),
                };
                let networks = NetworkNames::new(networks);
                let compiled = compile(PolicyInputs {
                    policies: &policies,
                    networks: &networks,
                    namespaces: &namespaces,
                    pods: &pods,
                });
                for diagnostic in &compiled.diagnostics {
                    tracing::warn!("{diagnostic}");
                }
                // Loading the object creates (or adopts) the pinned maps.
                let _datapath = Datapath::load(&DatapathConfig::pinned_at(&pin.pin_root))?;
                let mut maps = PolicyMaps::open(&pin.pin_root)?;
                // A one-shot command has no earlier ids: rules get ids no entry uses.
                let report = maps.apply(&compiled, &mut PolicyRuleIds::default())?;
                println!(
                    "policy applied: {} entries written, {} removed, {} isolated pod addresses \
                     ({} with a changed policy: their tracked flows are judged again)",
                    report.entries_written,
                    report.entries_removed,
                    report.subjects,
                    report.subjects_rejudged
                );
            }
            PolicyCommand::Show { pin, output } => {
                let maps = PolicyMaps::open(&pin.pin_root).with_context(|| {
                    format!(
                        "open policy maps pinned under {} (has the datapath been loaded?)",
                        pin.pin_root.display()
                    )
                })?;
                print_installed(&maps.installed()?, &maps.stats()?, output)?;
            }
            PolicyCommand::Drops { pin } => {
                let mut drops = PolicyDrops::open(&pin.pin_root)?;
                while let Some(drop) = drops.try_next() {
                    println!("{drop}");
                }
            }
        }
        Ok(())
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &PathBuf) -> anyhow::Result<T> {
    let text = fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parse {} as JSON", path.display()))
}

pub(super) fn print_installed(
    installed: &InstalledPolicy,
    stats: &PolicyStats,
    output: Output,
) -> anyhow::Result<()> {
    if let Output::Json = output {
        let value = serde_json::json!({ "tables": installed, "stats": stats });
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(());
    }
    println!("{:<40} {:<16} POLICY DIGEST", "POD ADDRESS", "ISOLATED");
    for s in &installed.subjects {
        println!(
            "{:<40} {:<16} {}",
            s.addr.to_string(),
            s.isolated.join(","),
            s.policy_digest
        );
    }
    println!();
    println!(
        "{:<26} {:<8} {:<44} {:<6} {:<12} {:>6} {:>10} {:>12}",
        "POD ADDRESS", "DIR", "REMOTE", "PROTO", "PORTS", "RULE", "PACKETS", "BYTES"
    );
    for e in &installed.entries {
        if e.matches.is_empty() {
            println!(
                "{:<26} {:<8} {:<44} {:<6}",
                e.subject.to_string(),
                e.direction,
                e.remote.to_string(),
                "(none)"
            );
        }
        for m in &e.matches {
            println!(
                "{:<26} {:<8} {:<44} {:<6} {:<12} {:>6} {:>10} {:>12}",
                e.subject.to_string(),
                e.direction,
                e.remote.to_string(),
                m.protocol,
                m.ports,
                m.rule_id,
                m.counter.packets,
                m.counter.bytes
            );
        }
    }
    println!();
    for (name, value) in &stats.0 {
        println!("{name:<24} {value:>12}");
    }
    Ok(())
}
