//! `flatnet-agent datapath ...`: manual control of the eBPF programs.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand};
use flatnet_agent::{
    datapath::{
        BPFFS_MOUNT_POINT, Datapath, DatapathConfig, TcAttach, detach_uplink, mount_bpffs,
        mount_bpffs_on_host,
    },
    netns::run_in_netns,
};
use flatnet_common::pin::PIN_ROOT;

#[derive(Args, Debug)]
pub struct PinArgs {
    /// Directory on the BPF filesystem for pinned maps.
    #[arg(long, env = "FLATNET_BPF_PIN_ROOT", default_value = PIN_ROOT)]
    pub pin_root: PathBuf,
}

impl PinArgs {
    /// The datapath configuration: these pins, programs attached as `attach` says.
    pub fn config(&self, attach: &AttachArgs) -> DatapathConfig {
        DatapathConfig {
            pin_root: self.pin_root.clone(),
            tc_attach: attach.tc_attach,
        }
    }
}

#[derive(Args, Debug)]
pub struct AttachArgs {
    /// How programs are attached: `tcx` (Linux 6.6+), `netlink` (clsact
    /// filters, any kernel) or `auto` (TCX where the kernel has it).
    #[arg(long, env = "FLATNET_TC_ATTACH", default_value = "auto")]
    pub tc_attach: TcAttach,
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
        #[command(flatten)]
        attach: AttachArgs,
    },
    /// Detach the uplink program from an interface (pinned maps are kept).
    Detach {
        #[command(flatten)]
        target: TargetArgs,
        #[command(flatten)]
        pin: PinArgs,
    },
    /// Mount the BPF filesystem on /sys/fs/bpf unless it is mounted (the
    /// chart's init container runs this).
    MountBpffs {
        /// The host's procfs: mount in the mount namespace of its PID 1 (the
        /// host's) and make the mount shared, instead of in this process's.
        #[arg(long)]
        host_proc: Option<PathBuf>,
    },
    /// Network policy on pod interfaces: attach, apply, show.
    #[command(subcommand)]
    Policy(super::policy::PolicyCommand),
}

impl DatapathCommand {
    pub fn run(self) -> anyhow::Result<()> {
        match self {
            DatapathCommand::Attach {
                target,
                pin,
                attach,
            } => {
                let mut datapath = Datapath::load(&pin.config(&attach))?;
                let interface = &target.interface;
                target
                    .run(|ifname| datapath.attach_uplink(ifname))?
                    .with_context(|| format!("attach uplink program to {interface}"))?;
                println!(
                    "uplink program attached to {interface} ({}); maps pinned under {}",
                    datapath.attach_mechanism(),
                    datapath.pin_root().display()
                );
            }
            DatapathCommand::Detach { target, pin } => {
                let interface = &target.interface;
                if target.run(|ifname| detach_uplink(&pin.pin_root, ifname))?? {
                    println!("uplink program detached from {interface}");
                } else {
                    println!("no flatnet uplink program was attached to {interface}");
                }
            }
            DatapathCommand::Policy(command) => command.run()?,
            DatapathCommand::MountBpffs { host_proc } => {
                let mounted = match host_proc {
                    Some(host_proc) => mount_bpffs_on_host(&host_proc)?,
                    None => mount_bpffs()?,
                };
                if mounted {
                    println!("mounted bpffs on {BPFFS_MOUNT_POINT}");
                } else {
                    println!("bpffs already mounted on {BPFFS_MOUNT_POINT}");
                }
            }
        }
        Ok(())
    }
}
