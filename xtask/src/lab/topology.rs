//! The simulated LAN: namespaces, the bridge that acts as the switch, the
//! cables (veth pairs) to it, and the removal of all of it.
//!
//! Every object the lab creates carries the fixed prefix `fnlab`, so a run
//! killed without cleaning up is cleaned by the next one.

use std::{
    fs,
    path::Path,
    process::Command,
    thread,
    time::{Duration, Instant},
};

use super::process::{self, ip};

/// Prefix of every namespace (and every other name) the lab creates.
pub const PREFIX: &str = "fnlab-";
/// Sockets, state files, records and logs of the lab's agents.
pub const WORK_DIR: &str = "/run/fnlab";
/// The agents' pin roots live below this directory on the BPF filesystem.
pub const PIN_DIR: &str = "/sys/fs/bpf/fnlab";

/// The switch: a namespace holding the bridge `br0`.
pub const SWITCH: &str = "fnlab-switch";
/// A host of the LAN: the gateway address of the flat subnets.
pub const LAN_HOST: &str = "fnlab-lanhost";
/// A host that claims an address it does not own.
pub const ROGUE: &str = "fnlab-rogue";
/// The two Kubernetes-less nodes.
pub const NODE1: &str = "fnlab-node1";
pub const NODE2: &str = "fnlab-node2";

pub const LAN_HOST_V4: &str = "192.0.2.1";
pub const LAN_HOST_V6: &str = "2001:db8::1";
/// The LAN host's address in the ipvlan subnet.
pub const LAN_HOST_IPVLAN_V4: &str = "198.51.100.1";

/// The node's uplink, master of the macvlan subnets.
pub const UPLINK: &str = "eth0";
/// node1's second uplink, master of the ipvlan subnet (a link is either a
/// macvlan or an ipvlan master, never both). Not `eth1`: that is the pods'
/// interface name, and Linux 6.1 checks the name of a new macvlan/ipvlan in
/// the node's namespace too, even when it is created in the pod's.
pub const IPVLAN_UPLINK: &str = "eth2";

/// (namespace, interface there, its switch port) for every cable.
const CABLES: &[(&str, &str, &str)] = &[
    (LAN_HOST, "eth0", "fnlab-p-lan"),
    (ROGUE, "eth0", "fnlab-p-rogue"),
    (NODE1, UPLINK, "fnlab-p-n1e0"),
    (NODE1, IPVLAN_UPLINK, "fnlab-p-n1e2"),
    (NODE2, UPLINK, "fnlab-p-n2e0"),
];

/// Creates the namespaces, the switch and the cables; addresses the LAN host.
pub fn build() -> anyhow::Result<()> {
    for netns in [SWITCH, LAN_HOST, ROGUE, NODE1, NODE2] {
        create_netns(netns)?;
    }
    ip(SWITCH, &["link", "add", "br0", "type", "bridge"])?;
    ip(SWITCH, &["link", "set", "br0", "up"])?;
    for (netns, ifname, port) in CABLES {
        process::run(
            "ip",
            &[
                "link", "add", ifname, "netns", netns, "type", "veth", "peer", "name", port,
                "netns", SWITCH,
            ],
        )?;
        ip(SWITCH, &["link", "set", port, "master", "br0", "up"])?;
        ip(netns, &["link", "set", ifname, "up"])?;
    }
    for address in [
        format!("{LAN_HOST_V4}/24"),
        format!("{LAN_HOST_IPVLAN_V4}/24"),
    ] {
        ip(LAN_HOST, &["addr", "add", &address, "dev", "eth0"])?;
    }
    let v6 = format!("{LAN_HOST_V6}/64");
    ip(LAN_HOST, &["addr", "add", &v6, "dev", "eth0", "nodad"])?;
    Ok(())
}

/// `ip netns add` and loopback up.
pub fn create_netns(name: &str) -> anyhow::Result<()> {
    process::run("ip", &["netns", "add", name])?;
    ip(name, &["link", "set", "lo", "up"])?;
    Ok(())
}

/// Removes everything a lab run may have left: agent processes (found by
/// their lab paths, killed by pid), namespaces with the lab prefix (and with
/// them every link and pod interface), pins and the work directory.
/// Never fails; what it could not remove shows up in [`leftovers`].
pub fn remove_everything() {
    // Agents run from their image (`--images`) live in podman containers.
    super::node::remove_containers(&[NODE1, NODE2]);
    let agents = lab_processes();
    for &pid in &agents {
        // SAFETY: kill(2) on a pid whose command line names the lab's paths.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    // A killed child of this process stays a zombie until reaped, with an
    // empty command line: it no longer counts.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !lab_processes().is_empty() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(20));
    }
    for netns in lab_namespaces() {
        let _ = Command::new("ip").args(["netns", "del", &netns]).status();
    }
    for link in lab_root_links() {
        let _ = Command::new("ip").args(["link", "del", &link]).status();
    }
    let _ = fs::remove_dir_all(PIN_DIR);
    let _ = fs::remove_dir_all(WORK_DIR);
}

/// What of the lab still exists on this machine, one line per object.
pub fn leftovers() -> Vec<String> {
    let mut found = Vec::new();
    found.extend(
        lab_namespaces()
            .into_iter()
            .map(|n| format!("namespace {n}")),
    );
    found.extend(lab_root_links().into_iter().map(|l| format!("link {l}")));
    found.extend(lab_processes().into_iter().map(|p| format!("process {p}")));
    for dir in [PIN_DIR, WORK_DIR] {
        if Path::new(dir).exists() {
            found.push(format!("directory {dir}"));
        }
    }
    found
}

fn lab_namespaces() -> Vec<String> {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .filter(|name| name.starts_with(PREFIX))
        .map(str::to_owned)
        .collect()
}

/// Links in this (the root) namespace named like the lab's: the lab
/// creates none there, so any is a leftover of a half-made cable.
fn lab_root_links() -> Vec<String> {
    let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap_or(name))
        .filter(|name| name.starts_with(PREFIX))
        .map(str::to_owned)
        .collect()
}

/// Processes (other than this one) whose command line names the lab's work
/// directory: the lab's agents.
fn lab_processes() -> Vec<i32> {
    let own = std::process::id().cast_signed();
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|&pid| pid != own)
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| {
                cmdline
                    .split(|&b| b == 0)
                    .any(|arg| arg.starts_with(WORK_DIR.as_bytes()))
            })
        })
        .collect()
}
