//! A direct, unoptimised reading of the NetworkPolicy semantics, used to
//! check the compiler: it looks at the policies for every packet.

use std::net::IpAddr;

use flatnet_common::policy::{Direction, proto};
use ipnet::IpNet;
use k8s_openapi::{
    api::networking::v1::{NetworkPolicyPeer, NetworkPolicyPort},
    apimachinery::pkg::util::intstr::IntOrString,
};

use super::{
    compile::{FlatPod, PolicyInputs},
    selector::{Labels, matches},
};

/// Peers and ports of one rule.
type Rule = (
    Option<Vec<NetworkPolicyPeer>>,
    Option<Vec<NetworkPolicyPort>>,
);

/// Whether a packet of `protocol` to port `port` between the local pod
/// address `subject` and `remote` is allowed in `direction`.
pub fn allowed(
    inputs: &PolicyInputs<'_>,
    direction: Direction,
    subject: IpAddr,
    remote: IpAddr,
    protocol: u8,
    port: Option<u16>,
) -> bool {
    let pod = inputs
        .pods
        .iter()
        .find(|p| p.local && p.ips.contains(&subject))
        .expect("subject is a local pod address");
    let mut isolated = false;
    for policy in inputs.policies {
        let ns = policy.metadata.namespace.as_deref().unwrap_or("default");
        if !inputs
            .networks
            .selects(ns, policy.metadata.annotations.as_ref())
            || ns != pod.namespace
        {
            continue;
        }
        let selector = policy.spec.pod_selector.clone().unwrap_or_default();
        if !matches(&selector, &pod.labels).unwrap_or(false) {
            continue;
        }
        let types = policy.spec.policy_types.clone().filter(|t| !t.is_empty());
        let has_type = match (&types, direction) {
            (Some(t), Direction::Ingress) => t.iter().any(|t| t == "Ingress"),
            (Some(t), Direction::Egress) => t.iter().any(|t| t == "Egress"),
            (None, Direction::Ingress) => true,
            (None, Direction::Egress) => policy.spec.egress.as_ref().is_some_and(|e| !e.is_empty()),
        };
        if !has_type {
            continue;
        }
        isolated = true;
        let rules: Vec<Rule> = match direction {
            Direction::Ingress => policy
                .spec
                .ingress
                .iter()
                .flatten()
                .map(|r| (r.from.clone(), r.ports.clone()))
                .collect(),
            Direction::Egress => policy
                .spec
                .egress
                .iter()
                .flatten()
                .map(|r| (r.to.clone(), r.ports.clone()))
                .collect(),
        };
        for (peers, ports) in rules {
            let peer_ok = match peers.filter(|p| !p.is_empty()) {
                None => true,
                Some(peers) => peers.iter().any(|p| peer_matches(inputs, ns, p, remote)),
            };
            let port_ok = match ports.filter(|p| !p.is_empty()) {
                None => true,
                Some(ports) => ports.iter().any(|p| port_matches(p, protocol, port)),
            };
            if peer_ok && port_ok {
                return true;
            }
        }
    }
    !isolated
}

fn peer_matches(
    inputs: &PolicyInputs<'_>,
    ns: &str,
    peer: &NetworkPolicyPeer,
    remote: IpAddr,
) -> bool {
    let has_selector = peer.pod_selector.is_some() || peer.namespace_selector.is_some();
    if let Some(block) = &peer.ip_block {
        if has_selector {
            return false;
        }
        let Ok(net) = block.cidr.parse::<IpNet>() else {
            return false;
        };
        let mut excepts = Vec::new();
        for e in block.except.iter().flatten() {
            let Ok(e) = e.parse::<IpNet>() else {
                return false;
            };
            excepts.push(e);
        }
        return net.contains(&remote) && !excepts.iter().any(|e| e.contains(&remote));
    }
    if !has_selector {
        return false;
    }
    inputs.pods.iter().any(|pod: &FlatPod| {
        let ns_ok = match &peer.namespace_selector {
            None => pod.namespace == ns,
            Some(sel) => matches(
                sel,
                inputs
                    .namespaces
                    .get(&pod.namespace)
                    .unwrap_or(&Labels::new()),
            )
            .unwrap_or(false),
        };
        let pod_ok =
            matches(&peer.pod_selector.clone().unwrap_or_default(), &pod.labels).unwrap_or(false);
        ns_ok && pod_ok && pod.ips.contains(&remote)
    })
}

fn port_matches(entry: &NetworkPolicyPort, protocol: u8, port: Option<u16>) -> bool {
    let wanted = match entry.protocol.as_deref().unwrap_or("TCP") {
        "TCP" => proto::TCP,
        "UDP" => proto::UDP,
        "SCTP" => proto::SCTP,
        _ => return false,
    };
    if wanted != protocol {
        return false;
    }
    match &entry.port {
        None => true,
        Some(IntOrString::String(_)) => false,
        Some(IntOrString::Int(first)) => {
            let Some(port) = port else { return false };
            let last = entry.end_port.unwrap_or(*first);
            *first >= 1
                && last >= *first
                && last <= 65535
                && (*first..=last).contains(&i32::from(port))
        }
    }
}
