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
            yielded: std::collections::BTreeSet::new(),
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
}
