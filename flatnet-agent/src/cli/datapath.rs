//! `flatnet-agent datapath ...`: manual control of the eBPF programs.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use flatnet_agent::{
    datapath::{BPFFS_MOUNT_POINT, Datapath, DatapathConfig, detach_uplink, mount_bpffs},
    netns::run_in_netns,
};
use flatnet_common::pin::PIN_ROOT;

#[derive(Args, Debug)]
pub struct PinArgs {
    /// Directory on the BPF filesystem for pinned maps.
    #[arg(long, env = "FLATNET_BPF_PIN_ROOT", default_value = PIN_ROOT)]
    pub pin_root: PathBuf,
}

#[derive(Args, Debug)]
pub struct TargetArgs {
    /// Uplink (master or VLAN) interface.
    #[arg(long, short)]
    pub(super) interface: String,
    /// Network namespace file the interface lives in (default: the agent's own).
    #[arg(long)]
    netns: Option<PathBuf>,
}

impl TargetArgs {
    /// Runs `work` with the interface name, inside `--netns` when given.
    pub(super) fn run<T: Send>(&self, work: impl FnOnce(&str) -> T + Send) -> anyhow::Result<T> {
        match &self.netns {
            Some(netns) => Ok(run_in_netns(netns, || work(&self.interface))?),
            None => Ok(work(&self.interface)),
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum DatapathCommand {
    /// Load the programs, pin their maps and attach the uplink program to an interface.
    Attach {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        pin: PinArgs,
    },
    /// Detach the uplink program from an interface (pinned maps are kept).
    Detach {
        #[command(flatten)]
        target: TargetArgs,
    },
    /// Mount the BPF filesystem on /sys/fs/bpf unless it is mounted (the
    /// chart's init container runs this).
    MountBpffs,
    /// Network policy on pod interfaces: attach, apply, show.
    #[command(subcommand)]
    Policy(super::policy::PolicyCommand),
}

impl DatapathCommand {
    pub fn run(self) -> anyhow::Result<()> {
        match self {
            DatapathCommand::Attach { target, pin } => {
                let mut datapath = Datapath::load(&DatapathConfig {
                    pin_root: pin.pin_root,
                })?;
                let interface = &target.interface;
                target
                    .run(|ifname| datapath.attach_uplink(ifname))?
                    .with_context(|| format!("attach uplink program to {interface}"))?;
                println!(
                    "uplink program attached to {interface}; maps pinned under {}",
                    datapath.pin_root().display()
                );
            }
            DatapathCommand::Detach { target } => {
                let interface = &target.interface;
                if target.run(detach_uplink)?? {
                    println!("uplink program detached from {interface}");
                } else {
                    println!("no flatnet uplink program was attached to {interface}");
                }
            }
            DatapathCommand::Policy(command) => command.run()?,
            DatapathCommand::MountBpffs => {
                if mount_bpffs()? {
                    println!("mounted bpffs on {BPFFS_MOUNT_POINT}");
                } else {
                    println!("bpffs already mounted on {BPFFS_MOUNT_POINT}");
                }
            }
        }
        Ok(())
    }
}
