//! The node's network: the cluster network's bridge and CNI configuration,
//! the `kubernetes` Service made reachable by one DNAT, the flat LAN, and
//! Multus thin with its own credentials.

use std::{fs, os::unix::fs::PermissionsExt, path::Path, process::Command};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::{
    API_PORT, CLUSTER_NETWORK, KUBERNETES_SERVICE_IP, LAN_BRIDGE, LAN_HOSTS, NODE_BRIDGE, NODE_IP,
    POD_SUBNET, api::Client, binaries::NAD_CRD, pki, server_url,
};
use crate::lab::{process, topology::create_netns};

/// Where containerd looks for CNI plugins and configurations.
pub const CNI_BIN_DIR: &str = "/opt/cni/bin";
pub const CNI_CONF_DIR: &str = "/etc/cni/net.d";
/// Debian's reference plugins.
pub const REFERENCE_PLUGIN_DIR: &str = "/usr/lib/cni";
/// The reference plugins copied into [`CNI_BIN_DIR`]: the cluster network
/// (bridge, host-local, loopback) and flat networks of tests (macvlan
/// with static or host-local IPAM).
pub const REFERENCE_PLUGINS: &[&str] = &["bridge", "host-local", "loopback", "macvlan", "static"];
/// The Multus thin binary, from the Kubernetes binaries.
pub const MULTUS_PLUGIN: &str = "multus";
/// The CNI configuration files the cluster writes into [`CNI_CONF_DIR`].
pub const MULTUS_CONFLIST: &str = "00-multus.conflist";
pub const CLUSTER_CONFLIST: &str = "10-flatnet-cluster.conflist";
/// Multus's kubeconfig directory in [`CNI_CONF_DIR`].
pub const MULTUS_DIR: &str = "multus.d";
/// The iptables chain (nat table) of the `kubernetes` Service's DNAT.
pub const SERVICE_CHAIN: &str = "FLATNET-CLUSTER";
/// Multus's ServiceAccount (namespace kube-system) and ClusterRole.
pub const MULTUS_ACCOUNT: &str = "multus";

/// Commands `up` runs, with the package that provides each.
const HOST_TOOLS: &[(&str, &str)] = &[
    ("etcd", "etcd-server"),
    ("containerd", "containerd"),
    ("containerd-shim-runc-v2", "containerd"),
    ("ctr", "containerd"),
    ("runc", "runc"),
    ("iptables", "iptables"),
    ("xz", "xz-utils"),
    ("ip", "iproute2"),
    ("mount", "mount"),
];

/// Fails naming the package of the first missing tool.
pub fn check_host_tools() -> anyhow::Result<()> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for (tool, package) in HOST_TOOLS {
        if !std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()) {
            bail!("{tool} is missing: install the Debian package {package} (`bash .ci/provision`)");
        }
    }
    for plugin in REFERENCE_PLUGINS {
        let path = Path::new(REFERENCE_PLUGIN_DIR).join(plugin);
        if !path.is_file() {
            bail!(
                "{} is missing: install the Debian package containernetworking-plugins \
                 (`bash .ci/provision`)",
                path.display()
            );
        }
    }
    super::images::check_busybox()?;
    Ok(())
}

/// Shared mounts, the node bridge and Service DNAT, the flat LAN, the CNI
/// plugins and the cluster network's configuration.
pub fn build(bin: &Path) -> anyhow::Result<()> {
    // containerd refuses Bidirectional/HostToContainer mounts on private
    // mounts; systemd makes / shared at boot, these machines have none.
    process::run("mount", &["--make-rshared", "/"])?;
    process::run("ip", &["link", "add", NODE_BRIDGE, "type", "bridge"])?;
    process::run(
        "ip",
        &["addr", "add", &format!("{NODE_IP}/24"), "dev", NODE_BRIDGE],
    )?;
    process::run("ip", &["link", "set", NODE_BRIDGE, "up"])?;
    service_dnat()?;
    build_lan()?;
    fs::create_dir_all(CNI_BIN_DIR)?;
    for plugin in REFERENCE_PLUGINS {
        install_file(&Path::new(REFERENCE_PLUGIN_DIR).join(plugin), plugin)?;
    }
    install_file(&bin.join(MULTUS_PLUGIN), MULTUS_PLUGIN)?;
    fs::create_dir_all(CNI_CONF_DIR)?;
    fs::write(
        Path::new(CNI_CONF_DIR).join(CLUSTER_CONFLIST),
        serde_json::to_string_pretty(&cluster_network())?,
    )?;
    Ok(())
}

fn install_file(source: &Path, name: &str) -> anyhow::Result<()> {
    let target = Path::new(CNI_BIN_DIR).join(name);
    fs::copy(source, &target)
        .with_context(|| format!("copy {} to {}", source.display(), target.display()))?;
    fs::set_permissions(&target, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// The cluster network: pods on [`NODE_BRIDGE`] with addresses of
/// [`POD_SUBNET`], routed through the node. No IP masquerade and no
/// `isGateway` (which would turn on IP forwarding): pods only talk to the
/// node, the API server and each other on this network.
pub fn cluster_network() -> Value {
    json!({
        "cniVersion": "0.4.0",
        "name": CLUSTER_NETWORK,
        "plugins": [
            {
                "type": "bridge",
                "bridge": NODE_BRIDGE,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET, "rangeStart": "10.42.0.10", "gateway": NODE_IP}]],
                    "routes": [{"dst": "0.0.0.0/0", "gw": NODE_IP}],
                },
            },
            {"type": "loopback"},
        ],
    })
}

/// `kubernetes` (ClusterIP:443) -> the API server, for pods (PREROUTING)
/// and for the node and host-network pods (OUTPUT).
fn service_dnat() -> anyhow::Result<()> {
    let iptables = |args: &[&str]| process::run("iptables", args).map(drop);
    iptables(&["-w", "-t", "nat", "-N", SERVICE_CHAIN])?;
    iptables(&[
        "-w",
        "-t",
        "nat",
        "-A",
        SERVICE_CHAIN,
        "-d",
        &format!("{KUBERNETES_SERVICE_IP}/32"),
        "-p",
        "tcp",
        "--dport",
        "443",
        "-j",
        "DNAT",
        "--to-destination",
        &format!("{NODE_IP}:{API_PORT}"),
    ])?;
    for hook in ["PREROUTING", "OUTPUT"] {
        iptables(&["-w", "-t", "nat", "-I", hook, "-j", SERVICE_CHAIN])?;
    }
    Ok(())
}

/// The LAN bridge (no address) and each LAN host's namespace and cable.
fn build_lan() -> anyhow::Result<()> {
    process::run("ip", &["link", "add", LAN_BRIDGE, "type", "bridge"])?;
    process::run("ip", &["link", "set", LAN_BRIDGE, "up"])?;
    for host in LAN_HOSTS {
        create_netns(host.netns)?;
        process::run(
            "ip",
            &[
                "link",
                "add",
                host.ifname,
                "netns",
                host.netns,
                "type",
                "veth",
                "peer",
                "name",
                host.port,
            ],
        )?;
        process::run(
            "ip",
            &["link", "set", host.port, "master", LAN_BRIDGE, "up"],
        )?;
        process::ip(host.netns, &["link", "set", host.ifname, "up"])?;
        let v4 = format!("{}/{}", host.ipv4, prefix_len(super::LAN_SUBNET_V4));
        let v6 = format!("{}/{}", host.ipv6, prefix_len(super::LAN_SUBNET_V6));
        process::ip(host.netns, &["addr", "add", &v4, "dev", host.ifname])?;
        process::ip(
            host.netns,
            &["addr", "add", &v6, "dev", host.ifname, "nodad"],
        )?;
    }
    Ok(())
}

fn prefix_len(subnet: &str) -> &str {
    subnet.rsplit('/').next().unwrap_or_default()
}

/// What Multus thin does with its credentials: read the pod and its
/// NetworkAttachmentDefinitions, write the pod's network-status
/// annotation (`pods/status`), and record events.
fn multus_rbac() -> Vec<Value> {
    vec![
        json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": MULTUS_ACCOUNT, "namespace": "kube-system"},
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": MULTUS_ACCOUNT},
            "rules": [
                {"apiGroups": ["k8s.cni.cncf.io"], "resources": ["network-attachment-definitions"], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
                {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["get", "update"]},
                {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch", "update"]},
            ],
        }),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": MULTUS_ACCOUNT},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": MULTUS_ACCOUNT},
            "subjects": [{"kind": "ServiceAccount", "name": MULTUS_ACCOUNT, "namespace": "kube-system"}],
        }),
    ]
}

/// A year: the token outlives any test run.
const MULTUS_TOKEN_SECONDS: u64 = 365 * 24 * 3600;

/// The NAD CRD, Multus's account and token, its kubeconfig and the
/// `00-multus.conflist` delegating to the cluster network.
pub fn install_multus(client: &Client, kube_dir: &Path, pki_dir: &Path) -> anyhow::Result<()> {
    let crd_path = kube_dir.join(NAD_CRD);
    let crd =
        fs::read_to_string(&crd_path).with_context(|| format!("read {}", crd_path.display()))?;
    client.apply_yaml(&crd)?;
    for object in multus_rbac() {
        client.apply(&object)?;
    }
    let request = json!({
        "apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
        "spec": {"expirationSeconds": MULTUS_TOKEN_SECONDS},
    });
    let response = client.request(
        "POST",
        &format!("/api/v1/namespaces/kube-system/serviceaccounts/{MULTUS_ACCOUNT}/token"),
        Some("application/json"),
        &serde_json::to_vec(&request)?,
    )?;
    if response.status != 201 && response.status != 200 {
        bail!(
            "a token for ServiceAccount kube-system/{MULTUS_ACCOUNT}: {} {}",
            response.status,
            response.text()
        );
    }
    let answer: Value = serde_json::from_slice(&response.body)?;
    let token = answer["status"]["token"]
        .as_str()
        .context("a TokenRequest answer without status.token")?;
    let dir = Path::new(CNI_CONF_DIR).join(MULTUS_DIR);
    fs::create_dir_all(&dir)?;
    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))?;
    let kubeconfig_path = dir.join("multus.kubeconfig");
    fs::write(
        &kubeconfig_path,
        pki::kubeconfig(
            pki_dir,
            &server_url(),
            MULTUS_ACCOUNT,
            &pki::Credentials::Token(token),
        )?,
    )?;
    fs::set_permissions(&kubeconfig_path, fs::Permissions::from_mode(0o600))?;
    let config = multus_config(&kubeconfig_path.display().to_string());
    fs::write(
        Path::new(CNI_CONF_DIR).join(MULTUS_CONFLIST),
        serde_json::to_string_pretty(&config)?,
    )?;
    Ok(())
}

/// Multus thin's configuration: the cluster network as its delegate.
fn multus_config(kubeconfig: &str) -> Value {
    json!({
        "cniVersion": "0.4.0",
        "name": "multus-cni-network",
        "plugins": [{
            "type": MULTUS_PLUGIN,
            "kubeconfig": kubeconfig,
            "delegates": [cluster_network()],
        }],
    })
}

/// Names of links in this namespace.
pub fn root_links() -> Vec<String> {
    let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() else {
        return Vec::new();
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| line.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap_or(name).to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multus_delegates_to_the_cluster_network_with_its_own_kubeconfig() {
        let config = multus_config("/etc/cni/net.d/multus.d/multus.kubeconfig");
        let plugin = &config["plugins"][0];
        assert_eq!(plugin["type"], "multus");
        assert_eq!(plugin["delegates"][0]["name"], CLUSTER_NETWORK);
        assert_eq!(plugin["delegates"][0]["plugins"][0]["bridge"], NODE_BRIDGE);
        assert!(
            MULTUS_CONFLIST < CLUSTER_CONFLIST,
            "the runtime takes the first file by name: Multus's"
        );
    }

    #[test]
    fn multus_may_write_pod_status_but_not_pods() {
        let role = &multus_rbac()[1];
        let verbs = |resource: &str| -> Vec<String> {
            role["rules"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|r| {
                    r["resources"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|x| x == resource)
                })
                .flat_map(|r| r["verbs"].as_array().unwrap().iter())
                .map(|v| v.as_str().unwrap().to_owned())
                .collect()
        };
        assert_eq!(verbs("pods"), ["get"]);
        assert_eq!(verbs("pods/status"), ["get", "update"]);
        assert_eq!(verbs("network-attachment-definitions"), ["get"]);
    }
}
