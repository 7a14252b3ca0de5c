//! `flatnet-agent inspect ...`: read-only views of the pinned data-plane
//! state, usable while the agent runs and without it (only the pinned maps
//! are read).

use std::net::IpAddr;

use anyhow::Context;
use clap::{Subcommand, ValueEnum};
use flatnet_agent::datapath::{
    PinnedMaps, PolicyMaps, RecentConflictEntry, WireClaimEntry, format_mac, monotonic_ns,
};
use flatnet_agent::floating::owner;
use flatnet_common::conflict::ClaimKind;
use serde::Serialize;

use super::{datapath::PinArgs, policy::print_installed};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum Output {
    Table,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum InspectCommand {
    /// ARP/NDP frames seen on uplinks, per kind, and answers sent.
    Counters {
        #[command(flatten)]
        pin: PinArgs,
        /// Output format.
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
    },
    /// Addresses answered for (ARP/NDP responder) and watched for conflicts.
    Addresses {
        #[command(flatten)]
        pin: PinArgs,
        /// Output format.
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
    },
    /// The latest conflict on each managed address (foreign MAC, VLAN,
    /// first and last seen, claim frames counted), latest first.
    Conflicts {
        #[command(flatten)]
        pin: PinArgs,
        /// Output format.
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
    },
    /// The wire inventory: the MAC last seen claiming each address on the
    /// LAN (uplink, VLAN, frame kind, seconds since).
    Wire {
        #[command(flatten)]
        pin: PinArgs,
        /// Output format.
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
    },
    /// The floating addresses this node offers: interface, the node
    /// answering for each as this node sees it, since when, and when this
    /// node last announced it and to how many LAN hosts by unicast (from
    /// the running loop's status file).
    Floating {
        /// The status file of the agent's floating-address loop.
        #[arg(long, env = "FLATNET_FLOATING_STATUS_FILE", default_value = owner::DEFAULT_STATUS_FILE)]
        status_file: std::path::PathBuf,
        /// Output format.
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
    },
    /// Managed addresses, network policy with its counters and recent
    /// conflicts in one view.
    All {
        #[command(flatten)]
        pin: PinArgs,
        /// Output format.
        #[arg(long, short, value_enum, default_value = "table")]
        output: Output,
    },
}

/// One row of `inspect conflicts`.
#[derive(Serialize)]
struct ConflictRow {
    interface: String,
    #[serde(flatten)]
    conflict: RecentConflictEntry,
    /// Seconds since the latest claim (kernel monotonic clock).
    last_seen_seconds_ago: f64,
}

/// One row of `inspect wire`.
#[derive(Serialize)]
struct WireRow {
    address: IpAddr,
    interface: String,
    vlan: u16,
    mac: String,
    kind: &'static str,
    /// Seconds since the latest claim (kernel monotonic clock).
    last_seen_seconds_ago: f64,
}

impl WireRow {
    fn new(entry: &WireClaimEntry, now_ns: u64) -> Self {
        Self {
            address: entry.addr,
            interface: interface_name(entry.ifindex),
            vlan: entry.vlan,
            mac: format_mac(entry.mac),
            kind: entry.kind.map_or("unknown", |k| k.name()),
            last_seen_seconds_ago: entry.age(now_ns).as_secs_f64(),
        }
    }
}

/// One row of `inspect addresses`.
#[derive(Serialize)]
struct AddressRow {
    table: &'static str,
    interface: String,
    ifindex: u32,
    address: IpAddr,
    mac: String,
}

impl InspectCommand {
    pub fn run(self) -> anyhow::Result<()> {
        match self {
            InspectCommand::Counters { pin, output } => {
                let maps = open(&pin)?;
                let counters = maps.frame_counters()?;
                let answers = maps.responder_stats()?;
                match output {
                    Output::Json => println!(
                        "{}",
                        serde_json::to_string_pretty(&serde_json::json!({
                            "frames": counters,
                            "answers": answers,
                        }))?
                    ),
                    Output::Table => {
                        println!("{:<28} {:>12} {:>14}", "KIND", "PACKETS", "BYTES");
                        for (kind, c) in counters.iter() {
                            println!("{:<28} {:>12} {:>14}", kind.name(), c.packets, c.bytes);
                        }
                        println!();
                        println!("{:<28} {:>12}", "ANSWERS SENT", "PACKETS");
                        println!("{:<28} {:>12}", "arp_reply", answers.arp_replies);
                        println!(
                            "{:<28} {:>12}",
                            "neighbor_advertisement", answers.neighbor_advertisements
                        );
                    }
                }
            }
            InspectCommand::Floating {
                status_file,
                output,
            } => {
                let text = std::fs::read(&status_file).with_context(|| {
                    format!(
                        "read {}: does an agent serve floating addresses on this node (FLATNET_FLOATING_IP, or `flatnet-agent floating`)?",
                        status_file.display()
                    )
                })?;
                let status: owner::Status = serde_json::from_slice(&text).with_context(|| {
                    format!("{} is not a floating status", status_file.display())
                })?;
                match output {
                    Output::Json => println!("{}", serde_json::to_string_pretty(&status)?),
                    Output::Table => print_floating(&status),
                }
            }
            InspectCommand::Addresses { pin, output } => {
                let rows = address_rows(&mut open(&pin)?)?;
                match output {
                    Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
                    Output::Table => print_addresses(&rows),
                }
            }
            InspectCommand::Conflicts { pin, output } => {
                let rows = conflict_rows(&open(&pin)?)?;
                match output {
                    Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
                    Output::Table => print_conflicts(&rows),
                }
            }
            InspectCommand::Wire { pin, output } => {
                let now = monotonic_ns();
                let rows: Vec<WireRow> = open(&pin)?
                    .wire_claims()?
                    .iter()
                    .map(|e| WireRow::new(e, now))
                    .collect();
                match output {
                    Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
                    Output::Table => {
                        println!(
                            "{:<40} {:<16} {:>4} {:<17} {:<28} {:>12}",
                            "ADDRESS", "INTERFACE", "VLAN", "MAC", "LAST CLAIM", "LAST (s ago)"
                        );
                        for r in &rows {
                            println!(
                                "{:<40} {:<16} {:>4} {:<17} {:<28} {:>12.1}",
                                r.address.to_string(),
                                r.interface,
                                r.vlan,
                                r.mac,
                                r.kind,
                                r.last_seen_seconds_ago
                            );
                        }
                    }
                }
            }
            InspectCommand::All { pin, output } => {
                let mut maps = open(&pin)?;
                let addresses = address_rows(&mut maps)?;
                let conflicts = conflict_rows(&maps)?;
                let policy = PolicyMaps::open(&pin.pin_root).context("open the policy maps")?;
                let (installed, stats) = (policy.installed()?, policy.stats()?);
                match output {
                    Output::Json => println!(
                        "{}",
                        serde_json::to_string_pretty(&serde_json::json!({
                            "addresses": addresses,
                            "policy": {"tables": installed, "stats": stats},
                            "conflicts": conflicts,
                        }))?
                    ),
                    Output::Table => {
                        println!("== addresses");
                        print_addresses(&addresses);
                        println!("\n== network policy");
                        print_installed(&installed, &stats, Output::Table)?;
                        println!("\n== recent conflicts");
                        print_conflicts(&conflicts);
                    }
                }
            }
        }
        Ok(())
    }
}

fn address_rows(maps: &mut PinnedMaps) -> anyhow::Result<Vec<AddressRow>> {
    let mut rows = Vec::new();
    for (ifindex, address, mac) in maps.responders()?.entries()? {
        rows.push(row("responder", ifindex, address, mac));
    }
    for (ifindex, address, mac) in maps.managed_addrs()?.entries()? {
        rows.push(row("conflict-watch", ifindex, address, mac));
    }
    Ok(rows)
}

fn print_addresses(rows: &[AddressRow]) {
    println!("{:<16} {:<16} {:<40} MAC", "TABLE", "INTERFACE", "ADDRESS");
    for r in rows {
        println!(
            "{:<16} {:<16} {:<40} {}",
            r.table, r.interface, r.address, r.mac
        );
    }
}

fn conflict_rows(maps: &PinnedMaps) -> anyhow::Result<Vec<ConflictRow>> {
    let now = monotonic_ns();
    Ok(maps
        .recent_conflicts()?
        .into_iter()
        .map(|conflict| ConflictRow {
            interface: interface_name(conflict.ifindex),
            last_seen_seconds_ago: now.saturating_sub(conflict.last_seen_ns) as f64 / 1e9,
            conflict,
        })
        .collect())
}

fn print_conflicts(rows: &[ConflictRow]) {
    println!(
        "{:<40} {:<16} {:>4} {:<17} {:<28} {:>8} {:>12} {:>12}",
        "ADDRESS",
        "INTERFACE",
        "VLAN",
        "FOREIGN MAC",
        "LAST CLAIM",
        "COUNT",
        "FIRST (s ago)",
        "LAST (s ago)"
    );
    let now = monotonic_ns();
    for r in rows {
        let c = &r.conflict;
        println!(
            "{:<40} {:<16} {:>4} {:<17} {:<28} {:>8} {:>12.1} {:>12.1}",
            c.addr.to_string(),
            r.interface,
            c.vlan,
            format_mac(c.foreign_mac),
            c.kind.map_or("unknown", ClaimKind::name),
            c.count,
            now.saturating_sub(c.first_seen_ns) as f64 / 1e9,
            r.last_seen_seconds_ago
        );
    }
}

fn interface_name(ifindex: u32) -> String {
    // Interface names are resolved in the caller's namespace, which is the
    // agent's (host network) in a DaemonSet pod.
    nix::net::if_::if_indextoname(ifindex)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("#{ifindex}"))
}

fn open(pin: &PinArgs) -> anyhow::Result<PinnedMaps> {
    PinnedMaps::open(&pin.pin_root).with_context(|| {
        format!(
            "open the maps pinned under {} (is the agent running, or has `datapath attach` run?)",
            pin.pin_root.display()
        )
    })
}

fn row(table: &'static str, ifindex: u32, address: IpAddr, mac: [u8; 6]) -> AddressRow {
    AddressRow {
        table,
        interface: interface_name(ifindex),
        ifindex,
        address,
        mac: format_mac(mac),
    }
}

/// The `inspect floating` table; times as seconds ago.
fn print_floating(status: &owner::Status) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let ago = |at: u64| format!("{}s ago", now.saturating_sub(at));
    println!("node {}", status.node);
    println!(
        "{:<40} {:<16} {:<24} {:<12} {:<14} HOSTS TOLD",
        "ADDRESS", "INTERFACE", "OWNER", "SINCE", "LAST ANNOUNCE"
    );
    for row in &status.addresses {
        println!(
            "{:<40} {:<16} {:<24} {:<12} {:<14} {}",
            row.address,
            row.interface,
            row.owner.as_deref().unwrap_or("(claiming)"),
            ago(row.since),
            row.last_announced.map_or_else(|| "-".to_owned(), ago),
            row.last_told
                .map_or_else(|| "-".to_owned(), |n| n.to_string()),
        );
    }
}
