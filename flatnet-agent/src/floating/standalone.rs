//! The `floating` section of the standalone state file: this node's
//! floating addresses and its peers, for `flatnet-agent floating`.

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use serde::{Deserialize, Serialize};

use super::owner::{Assignment, Settings};
use flatnet_k8s::validation::check_ifname;

/// Floating addresses served without Kubernetes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FloatingSection {
    /// This node's name in heartbeats (default: the hostname).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The uplink the addresses are answered and announced on; the uplink
    /// program must be attached to it (the agent, or `datapath attach`).
    pub interface: String,
    /// The floating addresses this node can serve.
    pub addresses: Vec<IpAddr>,
    /// Where this node receives heartbeats: its address on the flat link
    /// and a port (7946 by convention).
    pub listen: SocketAddr,
    /// The other nodes' `listen` addresses.
    pub peers: Vec<SocketAddr>,
    /// Local pods that hold addresses while this node owns them (the
    /// node answers for the others itself).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub backends: Vec<FloatingBackend>,
}

/// A pod on this node that holds a floating address while the node owns
/// it: the address is added to the pod's interface of a CNI attachment
/// the agent made, and answered and announced with that interface's MAC.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FloatingBackend {
    /// One of the section's `addresses`.
    pub address: IpAddr,
    /// The attachment's `CNI_CONTAINERID`, as the runtime passed it to
    /// the CNI ADD that made the pod's flat interface.
    pub container_id: String,
    /// The attachment's `CNI_IFNAME`: the pod interface on the flat
    /// network of `interface`.
    pub ifname: String,
}

impl FloatingSection {
    /// Every problem of the section, each naming the field and the fix.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Err(error) = check_ifname(&self.interface) {
            problems.push(format!("floating.interface: {error}"));
        }
        if self.addresses.is_empty() {
            problems
                .push("floating.addresses is empty: list the addresses this node can serve".into());
        }
        if self.peers.contains(&self.listen) {
            problems.push(format!(
                "floating.peers lists this node's own listen address {}: list only the other nodes",
                self.listen
            ));
        }
        let mut backed = std::collections::BTreeSet::new();
        for (index, backend) in self.backends.iter().enumerate() {
            let field = format!("floating.backends[{index}]");
            if !self.addresses.contains(&backend.address) {
                problems.push(format!(
                    "{field}: address {} is not in floating.addresses: add it there or remove the backend",
                    backend.address
                ));
            }
            if !backed.insert(backend.address) {
                problems.push(format!(
                    "{field}: address {} has a backend already: one pod per node holds an address; keep one",
                    backend.address
                ));
            }
            if backend.container_id.trim().is_empty() {
                problems.push(format!(
                    "{field}: containerId is empty: give the CNI_CONTAINERID of the pod's attachment"
                ));
            }
            if let Err(error) = check_ifname(&backend.ifname) {
                problems.push(format!("{field}.ifname: {error}"));
            }
        }
        problems
    }

    /// The loop's settings for node `default_node`, and what it serves.
    pub fn settings(&self, default_node: &str, pin_root: PathBuf) -> (Settings, Assignment) {
        let node = self.node.clone().unwrap_or_else(|| default_node.to_owned());
        let mut settings = Settings::new(node, pin_root);
        settings.bind = self.listen;
        let assignment = Assignment {
            addresses: self
                .addresses
                .iter()
                .map(|addr| (*addr, self.interface.clone()))
                .collect(),
            peers: self.peers.clone(),
            ..Assignment::default()
        };
        (settings, assignment)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(text: &str) -> Result<FloatingSection, serde_yaml::Error> {
        serde_yaml::from_str(text)
    }

    #[test]
    fn a_good_section_gives_the_loop_its_settings() {
        let good = section(
            "interface: eth0.50\naddresses: [192.168.50.10]\nlisten: 192.168.50.2:7946\npeers: [192.168.50.3:7946]\n",
        )
        .unwrap();
        assert!(good.problems().is_empty());
        let (settings, assignment) = good.settings("node-a", "/sys/fs/bpf/x".into());
        assert_eq!(settings.node, "node-a");
        assert_eq!(
            assignment.addresses,
            [(
                "192.168.50.10".parse::<IpAddr>().unwrap(),
                "eth0.50".to_owned()
            )]
            .into()
        );
        assert_eq!(assignment.peers.len(), 1);
        assert!(settings.lease < settings.interval * super::super::election::MISSED_HEARTBEATS);
    }

    #[test]
    fn bad_sections_name_the_field() {
        let bad = section(
            "interface: a-very-long-interface\naddresses: []\nlisten: 10.0.0.1:7946\npeers: [10.0.0.1:7946]\n",
        )
        .unwrap();
        let problems = bad.problems().join("\n");
        for field in ["floating.interface", "floating.addresses", "floating.peers"] {
            assert!(problems.contains(field), "{field} missing in {problems}");
        }
        let typo =
            section("interface: eth0\naddresses: []\nlisten: 10.0.0.1:7946\npeers: []\npeer: []\n");
        assert!(typo.unwrap_err().to_string().contains("peer"));
        assert!(
            section("interface: eth0\naddresses: [10.0.0.300]\nlisten: x\npeers: []\n").is_err()
        );
    }

    const WITH_BACKENDS: &str = "interface: eth0\naddresses: [10.0.0.10, fd00::10]\nlisten: 10.0.0.1:7946\npeers: [10.0.0.2:7946]\nbackends:\n";

    #[test]
    fn backends_name_a_listed_address_and_an_attachment() {
        let good = section(&format!(
            "{WITH_BACKENDS}  - {{address: 10.0.0.10, containerId: web-0, ifname: eth1}}\n  - {{address: fd00::10, containerId: web-0, ifname: eth1}}\n"
        ))
        .unwrap();
        assert_eq!(good.problems(), Vec::<String>::new());
        assert_eq!(good.backends[1].container_id, "web-0");
        let bad = section(&format!(
            "{WITH_BACKENDS}  - {{address: 10.0.0.11, containerId: web-0, ifname: eth1}}\n  - {{address: 10.0.0.10, containerId: web-0, ifname: eth1}}\n  - {{address: 10.0.0.10, containerId: ' ', ifname: a/b}}\n"
        ))
        .unwrap();
        let problems = bad.problems().join("\n");
        for needle in [
            "floating.backends[0]: address 10.0.0.11 is not in floating.addresses",
            "floating.backends[2]: address 10.0.0.10 has a backend already",
            "floating.backends[2]: containerId is empty",
            "floating.backends[2].ifname",
        ] {
            assert!(problems.contains(needle), "{needle:?} not in {problems}");
        }
        assert!(!problems.contains("backends[1]"), "{problems}");
        let typo = section(&format!(
            "{WITH_BACKENDS}  - {{address: 10.0.0.10, containerID: web-0, ifname: eth1}}\n"
        ));
        assert!(typo.unwrap_err().to_string().contains("containerID"));
    }
}
