//! `flatnet-agent inspect ...`: read-only views of the pinned data-plane
//! state, usable while the agent runs.

use std::net::IpAddr;

use anyhow::Context;
use clap::{Subcommand, ValueEnum};
use flatnet_agent::datapath::{PinnedMaps, format_mac};
use serde::Serialize;

use super::datapath::PinArgs;

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
            InspectCommand::Addresses { pin, output } => {
                let mut maps = open(&pin)?;
                let mut rows = Vec::new();
                for (ifindex, address, mac) in maps.responders()?.entries()? {
                    rows.push(row("responder", ifindex, address, mac));
                }
                for (ifindex, address, mac) in maps.managed_addrs()?.entries()? {
                    rows.push(row("conflict-watch", ifindex, address, mac));
                }
                match output {
                    Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
                    Output::Table => {
                        println!("{:<16} {:<16} {:<40} MAC", "TABLE", "INTERFACE", "ADDRESS");
                        for r in &rows {
                            println!(
                                "{:<16} {:<16} {:<40} {}",
                                r.table, r.interface, r.address, r.mac
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }
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
    // Interface names are resolved in the caller's namespace, which is the
    // agent's (host network) in a DaemonSet pod.
    let interface = nix::net::if_::if_indextoname(ifindex)
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("#{ifindex}"));
    AddressRow {
        table,
        interface,
        ifindex,
        address,
        mac: format_mac(mac),
    }
}
