//! Removing the cluster: processes (by pid file and by command line),
//! containers and shims, mounts, namespaces, links, iptables chains, CNI
//! files, the runtime's and kubelet's state and the pods' cgroups. Works
//! on whatever an earlier, killed `up` or test run left; never fails, and
//! [`leftovers`] says what could not be removed.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::{Duration, Instant},
};

use super::{
    CONTAINERD_SOCKET, LAN_BRIDGE, LAN_HOSTS, NODE_BRIDGE,
    components::Component,
    network::{
        CLUSTER_CONFLIST, CNI_BIN_DIR, CNI_CONF_DIR, MULTUS_CONFLIST, MULTUS_DIR, MULTUS_PLUGIN,
        REFERENCE_PLUGINS, SERVICE_CHAIN, root_links,
    },
    state_dir,
};

/// Directories whose mounts belong to the node: the kubelet's volumes and
/// the runtime's root filesystems and sandboxes.
const MOUNT_ROOTS: &[&str] = &[
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/run/containerd",
    "/run/flatnet",
];

/// What the runtime, the kubelet, CNI plugins and flatnet's agent keep on
/// the node; all of it goes with the cluster.
const NODE_STATE: &[&str] = &[
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/run/containerd",
    "/var/lib/cni",
    "/var/log/pods",
    "/var/log/containers",
    "/run/flatnet",
    "/var/lib/flatnet",
    "/sys/fs/bpf/flatnet",
];

/// Files of the state directory that describe a running cluster (the
/// decompressed binaries and the logs stay, for the next run and for
/// reading after a failure).
const STATE_FILES: &[&str] = &[
    "etcd",
    "run",
    "pki",
    "images",
    "kubeconfig",
    "controller-manager.kubeconfig",
    "scheduler.kubeconfig",
    "kubelet.kubeconfig",
    "containerd.toml",
    "kubelet.yaml",
];

/// Prefix of the network namespaces containerd makes for pods.
const POD_NETNS_PREFIX: &str = "cni-";
/// The cgroup the kubelet (cgroupfs driver) puts every pod under.
const PODS_CGROUP: &str = "kubepods";

/// Removes everything; see the module documentation.
pub fn remove_everything() {
    kill_processes();
    unmount_all();
    remove_namespaces();
    remove_links();
    remove_iptables();
    remove_cni_files();
    for path in NODE_STATE {
        remove_path(Path::new(path));
    }
    let state = state_dir();
    for name in STATE_FILES {
        remove_path(&state.join(name));
    }
    remove_cgroups();
}

fn remove_path(path: &Path) {
    if path.is_dir() {
        let _ = fs::remove_dir_all(path);
    } else {
        let _ = fs::remove_file(path);
    }
}

/// What of the cluster is still on this machine, one line per object.
pub fn leftovers() -> Vec<String> {
    let mut found = Vec::new();
    found.extend(
        cluster_processes()
            .into_iter()
            .map(|pid| format!("process {pid}: {}", cmdline(pid).join(" "))),
    );
    found.extend(
        node_mounts()
            .into_iter()
            .map(|m| format!("mount {}", m.display())),
    );
    found.extend(
        namespaces()
            .into_iter()
            .map(|n| format!("network namespace {n}")),
    );
    found.extend(links().into_iter().map(|l| format!("link {l}")));
    found.extend(
        iptables_chains()
            .into_iter()
            .map(|(tool, table, chain)| format!("{tool} -t {table} chain {chain}")),
    );
    for path in cni_files()
        .into_iter()
        .chain(NODE_STATE.iter().map(PathBuf::from))
        .chain(STATE_FILES.iter().map(|name| state_dir().join(name)))
    {
        if path.exists() {
            found.push(format!("path {}", path.display()));
        }
    }
    found.extend(
        pod_cgroups()
            .into_iter()
            .map(|c| format!("cgroup {}", c.display())),
    );
    found
}

fn cmdline(pid: i32) -> Vec<String> {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|bytes| {
            bytes
                .split(|&b| b == 0)
                .filter(|arg| !arg.is_empty())
                .map(|arg| String::from_utf8_lossy(arg).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn pids() -> Vec<i32> {
    let own = std::process::id().cast_signed();
    fs::read_dir("/proc")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
                .filter(|&pid| pid != own)
                .collect()
        })
        .unwrap_or_default()
}

/// The cluster's processes: its components (named by a pid file and
/// running the component's program, or with the state directory on their
/// command line), containerd's shims on the cluster's socket, and every
/// process of a pod (in the pods' cgroup).
pub fn cluster_processes() -> Vec<i32> {
    let state = state_dir().display().to_string();
    let from_pid_files: Vec<i32> = Component::ALL
        .iter()
        .filter_map(|component| {
            let pid = fs::read_to_string(component.pid_file())
                .ok()?
                .trim()
                .parse::<i32>()
                .ok()?;
            let program = cmdline(pid).into_iter().next()?;
            program.ends_with(component.name()).then_some(pid)
        })
        .collect();
    pids()
        .into_iter()
        .filter(|&pid| {
            let args = cmdline(pid);
            from_pid_files.contains(&pid)
                || args.iter().any(|arg| arg.contains(&state))
                || (args
                    .first()
                    .is_some_and(|program| program.contains("containerd-shim"))
                    && args.iter().any(|arg| arg == CONTAINERD_SOCKET))
                || in_pod_cgroup(pid)
        })
        .collect()
}

/// containerd daemons that are not the cluster's (a service the package
/// started): `up` refuses to start next to one.
pub fn foreign_containerd() -> Vec<i32> {
    let ours = cluster_processes();
    pids()
        .into_iter()
        .filter(|pid| !ours.contains(pid))
        .filter(|&pid| {
            cmdline(pid).first().is_some_and(|program| {
                Path::new(program).file_name() == Some("containerd".as_ref())
            })
        })
        .collect()
}

fn in_pod_cgroup(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/cgroup")).is_ok_and(|text| {
        text.lines().any(|line| {
            line.rsplit(':')
                .next()
                .is_some_and(|path| path.starts_with(&format!("/{PODS_CGROUP}")))
        })
    })
}

/// SIGKILL to every process of the cluster until none is left (5 s).
fn kill_processes() {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let found = cluster_processes();
        if found.is_empty() || Instant::now() > deadline {
            return;
        }
        for pid in found {
            // SAFETY: kill(2) on a pid found just now as the cluster's.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        thread::sleep(Duration::from_millis(50));
    }
}

/// Mount points below [`MOUNT_ROOTS`] and the pods' namespace files,
/// deepest first.
fn node_mounts() -> Vec<PathBuf> {
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut mounts: Vec<PathBuf> = text
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|point| PathBuf::from(point.replace("\\040", " ")))
        .filter(|point| {
            MOUNT_ROOTS.iter().any(|root| point.starts_with(root)) || is_pod_netns(point)
        })
        .collect();
    mounts.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    mounts.dedup();
    mounts
}

fn is_pod_netns(path: &Path) -> bool {
    path.parent() == Some(Path::new("/run/netns"))
        && path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(POD_NETNS_PREFIX))
}

fn unmount_all() {
    // Stacked mounts need a pass each.
    for _ in 0..5 {
        let mounts = node_mounts();
        if mounts.is_empty() {
            return;
        }
        for point in mounts {
            let _ = nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// The pods' namespace files and the LAN hosts' namespaces.
fn namespaces() -> Vec<String> {
    let mut found: Vec<String> = fs::read_dir("/run/netns")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .filter(|name| name.starts_with(POD_NETNS_PREFIX))
                .collect()
        })
        .unwrap_or_default();
    found.extend(
        LAN_HOSTS
            .iter()
            .filter(|host| Path::new("/run/netns").join(host.netns).exists())
            .map(|host| host.netns.to_owned()),
    );
    found
}

fn remove_namespaces() {
    for name in namespaces() {
        let path = Path::new("/run/netns").join(&name);
        let _ = nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH);
        let _ = fs::remove_file(&path);
    }
}

/// The bridges, the LAN hosts' cables and the pods' host-side veths left
/// on the node bridge.
fn links() -> Vec<String> {
    let ours: Vec<&str> = [NODE_BRIDGE, LAN_BRIDGE]
        .into_iter()
        .chain(LAN_HOSTS.iter().map(|h| h.port))
        .collect();
    let mut found: Vec<String> = root_links()
        .into_iter()
        .filter(|l| ours.contains(&l.as_str()))
        .collect();
    for bridge in [NODE_BRIDGE, LAN_BRIDGE] {
        for port in bridge_ports(bridge) {
            if !found.contains(&port) {
                found.push(port);
            }
        }
    }
    found
}

fn bridge_ports(bridge: &str) -> Vec<String> {
    fs::read_dir(format!("/sys/class/net/{bridge}/brif"))
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn remove_links() {
    // Ports first: a pod's veth whose namespace is gone went with it.
    let mut all = links();
    all.sort_by_key(|l| [NODE_BRIDGE, LAN_BRIDGE].contains(&l.as_str()));
    for link in all {
        let _ = Command::new("ip").args(["link", "del", &link]).output();
    }
}

/// (tool, table, chain) of the cluster's chain and any the kubelet made.
fn iptables_chains() -> Vec<(&'static str, &'static str, String)> {
    let mut found = Vec::new();
    for tool in ["iptables", "ip6tables"] {
        for table in ["nat", "filter", "mangle"] {
            let Ok(out) = Command::new(tool).args(["-w", "-t", table, "-S"]).output() else {
                continue;
            };
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                if let Some(chain) = line.strip_prefix("-N ")
                    && is_cluster_chain(chain)
                {
                    found.push((tool, table, chain.to_owned()));
                }
            }
        }
    }
    found
}

fn is_cluster_chain(chain: &str) -> bool {
    chain == SERVICE_CHAIN || chain.starts_with("KUBE-")
}

fn remove_iptables() {
    for tool in ["iptables", "ip6tables"] {
        for table in ["nat", "filter", "mangle"] {
            let Ok(out) = Command::new(tool).args(["-w", "-t", table, "-S"]).output() else {
                continue;
            };
            // Jumps into the chains first, then the chains.
            for rule in String::from_utf8_lossy(&out.stdout).lines() {
                let Some(rest) = rule.strip_prefix("-A ") else {
                    continue;
                };
                let jumps_to_ours = rest
                    .split_whitespace()
                    .skip_while(|w| *w != "-j")
                    .nth(1)
                    .is_some_and(is_cluster_chain);
                let in_ours = rest.split_whitespace().next().is_some_and(is_cluster_chain);
                if jumps_to_ours && !in_ours {
                    let mut args = vec!["-w", "-t", table, "-D"];
                    args.extend(rest.split_whitespace().map(|w| w.trim_matches('"')));
                    let _ = Command::new(tool).args(&args).output();
                }
            }
        }
    }
    for (tool, table, chain) in iptables_chains() {
        let _ = Command::new(tool)
            .args(["-w", "-t", table, "-F", &chain])
            .output();
    }
    for (tool, table, chain) in iptables_chains() {
        let _ = Command::new(tool)
            .args(["-w", "-t", table, "-X", &chain])
            .output();
    }
}

/// The CNI files the cluster installed, and flatnet's (its agent installs
/// `flatnet-cni` and its configuration on the node).
fn cni_files() -> Vec<PathBuf> {
    let bin = Path::new(CNI_BIN_DIR);
    let conf = Path::new(CNI_CONF_DIR);
    let mut files: Vec<PathBuf> = REFERENCE_PLUGINS
        .iter()
        .chain([&MULTUS_PLUGIN])
        .map(|name| bin.join(name))
        .chain(
            [MULTUS_CONFLIST, CLUSTER_CONFLIST, MULTUS_DIR]
                .iter()
                .map(|name| conf.join(name)),
        )
        .collect();
    for dir in [bin, conf] {
        if let Ok(entries) = fs::read_dir(dir) {
            files.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("flatnet"))
                    .map(|e| e.path()),
            );
        }
    }
    files
}

fn remove_cni_files() {
    for path in cni_files() {
        remove_path(&path);
    }
    // The directories go too when nothing else is in them.
    for dir in [CNI_BIN_DIR, "/opt/cni", CNI_CONF_DIR, "/etc/cni"] {
        let _ = fs::remove_dir(dir);
    }
}

/// The pods' cgroup trees in every hierarchy.
fn pod_cgroups() -> Vec<PathBuf> {
    let Ok(hierarchies) = fs::read_dir("/sys/fs/cgroup") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    let root = Path::new("/sys/fs/cgroup");
    for candidate in
        std::iter::once(root.to_path_buf()).chain(hierarchies.flatten().map(|e| e.path()))
    {
        let pods = candidate.join(PODS_CGROUP);
        if pods.is_dir() {
            found.push(pods);
        }
    }
    found
}

/// Removes the pods' cgroups, innermost first (a cgroup directory is
/// removed with rmdir once its children and processes are gone).
fn remove_cgroups() {
    fn remove_tree(dir: &Path) {
        if let Ok(entries) = fs::read_dir(dir) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    remove_tree(&entry.path());
                }
            }
        }
        let _ = fs::remove_dir(dir);
    }
    for tree in pod_cgroups() {
        remove_tree(&tree);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_pods_namespace_files_count_as_the_clusters() {
        assert!(is_pod_netns(Path::new("/run/netns/cni-1234-abcd")));
        assert!(!is_pod_netns(Path::new("/run/netns/fnlab-node1")));
        assert!(!is_pod_netns(Path::new("/run/netns/cni-1/x")));
    }

    #[test]
    fn the_chains_removed_are_the_clusters_and_the_kubelets() {
        assert!(is_cluster_chain(SERVICE_CHAIN));
        assert!(is_cluster_chain("KUBE-KUBELET-CANARY"));
        assert!(!is_cluster_chain("CNI-abc"));
        assert!(!is_cluster_chain("INPUT"));
    }
}
