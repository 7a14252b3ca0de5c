//! The policy compiler: MultiNetworkPolicies, pods and namespaces in, the
//! per-pod-address tables the kernel enforces out. Pure; no I/O.
//!
//! Semantics are those of Kubernetes NetworkPolicy: a pod is isolated in a
//! direction when some policy selecting it lists that policy type; then a
//! packet passes when any rule of any such policy allows it (union).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::IpAddr,
};

use flatnet_common::policy::{Direction, MAX_PORT_MATCHES, proto};
use ipnet::IpNet;
use k8s_openapi::{
    api::networking::v1::{NetworkPolicyPeer, NetworkPolicyPort},
    apimachinery::pkg::{apis::meta::v1::LabelSelector, util::intstr::IntOrString},
};

use super::{
    api::{MultiNetworkPolicy, NetworkNames},
    selector::{self, Labels},
    tables::{
        CompiledPolicy, Diagnostic, DirectionTable, PortSpec, ProtocolMatch, RuleRef, SubjectTables,
    },
};

/// A pod on the flat network, anywhere in the cluster.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct FlatPod {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Labels.
    #[serde(default)]
    pub labels: Labels,
    /// Its flat-network addresses.
    pub ips: Vec<IpAddr>,
    /// Whether it runs on this node (and so gets tables).
    #[serde(default)]
    pub local: bool,
}

/// What the compiler needs to know about the cluster.
#[derive(Clone, Copy, Debug)]
pub struct PolicyInputs<'a> {
    /// Every MultiNetworkPolicy; those not for the flat network are ignored.
    pub policies: &'a [MultiNetworkPolicy],
    /// The names the `policy-for` annotation must mention.
    pub networks: &'a NetworkNames,
    /// Namespace name → labels (for namespace selectors).
    pub namespaces: &'a BTreeMap<String, Labels>,
    /// Every flat pod (peers), local ones included.
    pub pods: &'a [FlatPod],
}

/// One peer of one rule, resolved to prefixes: `net` minus `except`,
/// allowing `ports`.
struct PeerEntry<'p> {
    net: IpNet,
    except: Vec<IpNet>,
    ports: &'p [PortSpec],
}

/// A policy rule with its peers resolved, shared by every pod it applies to.
struct CompiledRule {
    /// `None`: every address (no `from`/`to`).
    peers: Option<Vec<(IpNet, Vec<IpNet>)>>,
    ports: Vec<PortSpec>,
}

/// Compiles the policies for the local pods.
pub fn compile(inputs: PolicyInputs<'_>) -> CompiledPolicy {
    let mut out = CompiledPolicy::default();
    // (policy index, direction) → compiled rules, computed once per policy.
    let mut rules_by_policy: Vec<[Vec<CompiledRule>; 2]> = Vec::new();
    let mut applies: Vec<Option<(&MultiNetworkPolicy, [bool; 2])>> = Vec::new();
    for policy in inputs.policies {
        let namespace = policy.metadata.namespace.as_deref().unwrap_or("default");
        if !inputs
            .networks
            .selects(namespace, policy.metadata.annotations.as_ref())
        {
            applies.push(None);
            rules_by_policy.push([Vec::new(), Vec::new()]);
            continue;
        }
        let types = policy_types(policy, &mut out.diagnostics);
        applies.push(Some((policy, types)));
        let ingress = compile_rules(policy, Direction::Ingress, &inputs, &mut out);
        let egress = compile_rules(policy, Direction::Egress, &inputs, &mut out);
        rules_by_policy.push([ingress, egress]);
    }

    for pod in inputs.pods.iter().filter(|p| p.local) {
        let mut selected_by: Vec<usize> = Vec::new();
        for (i, entry) in applies.iter().enumerate() {
            let Some((policy, _)) = entry else { continue };
            if policy.metadata.namespace.as_deref().unwrap_or("default") != pod.namespace {
                continue;
            }
            let selector = policy.spec.pod_selector.clone().unwrap_or_default();
            match selector::matches(&selector, &pod.labels) {
                Ok(true) => selected_by.push(i),
                Ok(false) => {}
                Err(e) => out.diagnostics.push(Diagnostic {
                    object: object_name(policy),
                    policy: Some(policy_key(policy)),
                    message: format!("podSelector: {e}; the policy selects no pod"),
                }),
            }
        }
        for &ip in &pod.ips {
            let mut tables = SubjectTables {
                pod: format!("{}/{}", pod.namespace, pod.name),
                ..SubjectTables::default()
            };
            for direction in [Direction::Ingress, Direction::Egress] {
                let isolating: Vec<usize> = selected_by
                    .iter()
                    .copied()
                    .filter(|&i| applies[i].is_some_and(|(_, t)| t[direction as usize]))
                    .collect();
                if isolating.is_empty() {
                    continue;
                }
                let rules = isolating
                    .iter()
                    .flat_map(|&i| rules_by_policy[i][direction as usize].iter());
                let table = build_table(ip, rules, &tables.pod, &mut out.diagnostics);
                match direction {
                    Direction::Ingress => tables.ingress = Some(table),
                    Direction::Egress => tables.egress = Some(table),
                }
            }
            out.subjects.insert(ip, tables);
        }
    }
    out
}

/// `[ingress, egress]` isolation of a policy, with Kubernetes defaulting.
fn policy_types(policy: &MultiNetworkPolicy, diagnostics: &mut Vec<Diagnostic>) -> [bool; 2] {
    match policy.spec.policy_types.as_deref() {
        Some(types) if !types.is_empty() => {
            let mut out = [false; 2];
            for t in types {
                match t.as_str() {
                    "Ingress" => out[0] = true,
                    "Egress" => out[1] = true,
                    other => diagnostics.push(Diagnostic {
                        object: object_name(policy),
                        policy: Some(policy_key(policy)),
                        message: format!(
                            "unknown policyType {other:?} ignored; use Ingress or Egress"
                        ),
                    }),
                }
            }
            out
        }
        _ => [
            true,
            policy.spec.egress.as_ref().is_some_and(|e| !e.is_empty()),
        ],
    }
}

fn compile_rules(
    policy: &MultiNetworkPolicy,
    direction: Direction,
    inputs: &PolicyInputs<'_>,
    out: &mut CompiledPolicy,
) -> Vec<CompiledRule> {
    let rules = rule_parts(policy, direction);
    let namespace = policy.metadata.namespace.as_deref().unwrap_or("default");
    let mut compiled = Vec::with_capacity(rules.len());
    for (index, (peers, ports)) in rules.into_iter().enumerate() {
        let rule = out.rules.len();
        let rule_ref = RuleRef {
            namespace: namespace.to_owned(),
            policy: policy.metadata.name.clone().unwrap_or_default(),
            direction,
            index,
        };
        let ports = compile_ports(ports.map(Vec::as_slice), rule, &rule_ref, out);
        let peers = match peers {
            None => None,
            Some(peers) if peers.is_empty() => None,
            Some(peers) => Some(
                peers
                    .iter()
                    .flat_map(|peer| resolve_peer(peer, namespace, inputs, &rule_ref, out))
                    .collect(),
            ),
        };
        out.rules.push(rule_ref);
        compiled.push(CompiledRule { peers, ports });
    }
    compiled
}

/// Peers and ports of one rule, as written.
type RuleParts<'a> = (
    Option<&'a Vec<NetworkPolicyPeer>>,
    Option<&'a Vec<NetworkPolicyPort>>,
);

/// The rules of `direction`, in order.
fn rule_parts(policy: &MultiNetworkPolicy, direction: Direction) -> Vec<RuleParts<'_>> {
    match direction {
        Direction::Ingress => policy
            .spec
            .ingress
            .iter()
            .flatten()
            .map(|r| (r.from.as_ref(), r.ports.as_ref()))
            .collect(),
        Direction::Egress => policy
            .spec
            .egress
            .iter()
            .flatten()
            .map(|r| (r.to.as_ref(), r.ports.as_ref()))
            .collect(),
    }
}

fn compile_ports(
    ports: Option<&[NetworkPolicyPort]>,
    rule: usize,
    rule_ref: &RuleRef,
    out: &mut CompiledPolicy,
) -> Vec<PortSpec> {
    let Some(ports) = ports.filter(|p| !p.is_empty()) else {
        return vec![PortSpec::any(rule)];
    };
    let mut specs = Vec::new();
    for port in ports {
        match compile_port(port) {
            Ok(spec) => specs.push(PortSpec { rule, ..spec }),
            Err(why) => out.diagnostics.push(Diagnostic {
                object: rule_ref.to_string(),
                policy: Some(rule_ref.policy_key()),
                message: format!("{why}; this port entry matches no traffic"),
            }),
        }
    }
    specs
}

fn compile_port(port: &NetworkPolicyPort) -> Result<PortSpec, String> {
    let protocol = match port.protocol.as_deref().unwrap_or("TCP") {
        "TCP" => proto::TCP,
        "UDP" => proto::UDP,
        "SCTP" => proto::SCTP,
        other => return Err(format!("protocol {other:?} is not TCP, UDP or SCTP")),
    };
    let (port_min, port_max) = match &port.port {
        None => (0, u16::MAX),
        Some(IntOrString::String(name)) => {
            return Err(format!(
                "named port {name:?} is not supported; use the numeric port (and endPort for a range)"
            ));
        }
        Some(IntOrString::Int(p)) => {
            let first = u16::try_from(*p)
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| format!("port {p} is not in 1..=65535"))?;
            let last = match port.end_port {
                None => first,
                Some(e) => u16::try_from(e)
                    .ok()
                    .filter(|&e| e >= first)
                    .ok_or_else(|| format!("endPort {e} is not in {first}..=65535"))?,
            };
            (first, last)
        }
    };
    Ok(PortSpec {
        protocol: ProtocolMatch::Ip(protocol),
        port_min,
        port_max,
        rule: 0,
    })
}

/// The prefixes (with exceptions) a peer stands for.
fn resolve_peer(
    peer: &NetworkPolicyPeer,
    namespace: &str,
    inputs: &PolicyInputs<'_>,
    rule_ref: &RuleRef,
    out: &mut CompiledPolicy,
) -> Vec<(IpNet, Vec<IpNet>)> {
    let mut diagnose = |message: String| {
        out.diagnostics.push(Diagnostic {
            object: rule_ref.to_string(),
            policy: Some(rule_ref.policy_key()),
            message,
        });
    };
    let has_selector = peer.pod_selector.is_some() || peer.namespace_selector.is_some();
    if let Some(block) = &peer.ip_block {
        if has_selector {
            diagnose("a peer has both ipBlock and a selector, which Kubernetes forbids; it matches nothing".into());
            return Vec::new();
        }
        let Ok(net) = block.cidr.parse::<IpNet>() else {
            diagnose(format!(
                "ipBlock cidr {:?} is not a CIDR; the peer matches nothing",
                block.cidr
            ));
            return Vec::new();
        };
        let mut except = Vec::new();
        for e in block.except.iter().flatten() {
            match e.parse::<IpNet>() {
                Ok(e) => except.push(e.trunc()),
                Err(_) => {
                    // Ignoring an exception would allow more than written.
                    diagnose(format!(
                        "ipBlock except {e:?} is not a CIDR; the peer matches nothing"
                    ));
                    return Vec::new();
                }
            }
        }
        return vec![(net.trunc(), except)];
    }
    if !has_selector {
        diagnose("a peer has neither ipBlock nor a selector; it matches nothing".into());
        return Vec::new();
    }
    let pod_selector = peer.pod_selector.clone().unwrap_or_default();
    let mut nets = Vec::new();
    for pod in inputs.pods {
        let namespace_ok = match &peer.namespace_selector {
            None => pod.namespace == namespace,
            Some(ns_selector) => {
                let labels = inputs.namespaces.get(&pod.namespace);
                match selector::matches(ns_selector, labels.unwrap_or(&Labels::new())) {
                    Ok(ok) => ok,
                    Err(e) => {
                        diagnose(format!("namespaceSelector: {e}; the peer matches nothing"));
                        return Vec::new();
                    }
                }
            }
        };
        if !namespace_ok {
            continue;
        }
        match selector::matches(&pod_selector, &pod.labels) {
            Ok(true) => nets.extend(pod.ips.iter().map(|&ip| (IpNet::from(ip), Vec::new()))),
            Ok(false) => {}
            Err(e) => {
                diagnose(format!("podSelector: {e}; the peer matches nothing"));
                return Vec::new();
            }
        }
    }
    nets
}

/// Builds the table of one subject address and direction from the rules of
/// every policy isolating it: each prefix that starts or ends a peer gets
/// the union of the port specs of every peer covering it.
fn build_table<'r>(
    subject: IpAddr,
    rules: impl Iterator<Item = &'r CompiledRule>,
    pod: &str,
    diagnostics: &mut Vec<Diagnostic>,
) -> DirectionTable {
    let same_family = |net: &IpNet| net.addr().is_ipv4() == subject.is_ipv4();
    let all: [IpNet; 1] = [match subject {
        IpAddr::V4(_) => "0.0.0.0/0".parse().expect("literal"),
        IpAddr::V6(_) => "::/0".parse().expect("literal"),
    }];
    let mut entries: Vec<PeerEntry<'r>> = Vec::new();
    for rule in rules {
        if rule.ports.is_empty() {
            continue;
        }
        match &rule.peers {
            None => entries.push(PeerEntry {
                net: all[0],
                except: Vec::new(),
                ports: &rule.ports,
            }),
            Some(peers) => {
                for (net, except) in peers.iter().filter(|(n, _)| same_family(n)) {
                    entries.push(PeerEntry {
                        net: *net,
                        except: except.iter().filter(|e| same_family(e)).copied().collect(),
                        ports: &rule.ports,
                    });
                }
            }
        }
    }

    // Every prefix where the answer can change.
    let mut prefixes: BTreeSet<IpNet> = BTreeSet::new();
    let mut by_net: HashMap<IpNet, Vec<usize>> = HashMap::new();
    for (i, e) in entries.iter().enumerate() {
        prefixes.insert(e.net);
        prefixes.extend(e.except.iter().filter(|x| e.net.contains(*x)).copied());
        by_net.entry(e.net).or_default().push(i);
    }

    let mut values: BTreeMap<IpNet, Vec<PortSpec>> = BTreeMap::new();
    for &prefix in &prefixes {
        let mut specs: Vec<PortSpec> = Vec::new();
        for len in 0..=prefix.prefix_len() {
            let Ok(supernet) = IpNet::new(prefix.addr(), len).map(|n| n.trunc()) else {
                continue;
            };
            for &i in by_net.get(&supernet).into_iter().flatten() {
                let e = &entries[i];
                if e.except.iter().any(|x| x.contains(&prefix)) {
                    continue;
                }
                specs.extend_from_slice(e.ports);
            }
        }
        values.insert(prefix, normalize(specs, pod, prefix, diagnostics));
    }

    // Drop prefixes that say the same as the closest enclosing one (or
    // nothing, with none enclosing): the longest match is unchanged.
    let mut table = DirectionTable::default();
    for (&prefix, specs) in &values {
        let parent = (0..prefix.prefix_len()).rev().find_map(|len| {
            let net = IpNet::new(prefix.addr(), len).ok()?.trunc();
            values.get(&net)
        });
        let redundant = match parent {
            Some(parent) => parent == specs,
            None => specs.is_empty(),
        };
        if !redundant {
            table.entries.insert(prefix, specs.clone());
        }
    }
    table
}

/// The union of port specs in kernel form: sorted, without duplicates, one
/// entry when everything is allowed, ranges merged when there are too many.
fn normalize(
    mut specs: Vec<PortSpec>,
    pod: &str,
    prefix: IpNet,
    diagnostics: &mut Vec<Diagnostic>,
) -> Vec<PortSpec> {
    if let Some(any) = specs
        .iter()
        .filter(|s| s.protocol == ProtocolMatch::Any)
        .min_by_key(|s| s.rule)
    {
        return vec![*any];
    }
    specs.sort_by_key(|s| (s.protocol, s.port_min, s.port_max, s.rule));
    specs.dedup_by(|b, a| {
        (a.protocol, a.port_min, a.port_max) == (b.protocol, b.port_min, b.port_max)
    });
    if specs.len() <= MAX_PORT_MATCHES {
        return specs;
    }
    // Too many to list: merge overlapping and adjacent ranges (the counter
    // of a merged range goes to the first rule).
    let mut merged: Vec<PortSpec> = Vec::new();
    for s in specs {
        match merged.last_mut() {
            Some(last)
                if last.protocol == s.protocol
                    && u32::from(s.port_min) <= u32::from(last.port_max) + 1 =>
            {
                last.port_max = last.port_max.max(s.port_max);
            }
            _ => merged.push(s),
        }
    }
    if merged.len() > MAX_PORT_MATCHES {
        diagnostics.push(Diagnostic {
            object: pod.to_owned(),
            policy: None,
            message: format!(
                "the rules toward {prefix} allow {} separate port ranges, more than the {MAX_PORT_MATCHES} \
                 one prefix can hold; ranges past the {MAX_PORT_MATCHES}th are denied. Merge port ranges \
                 (endPort) or split the peers",
                merged.len()
            ),
        });
        merged.truncate(MAX_PORT_MATCHES);
    }
    merged
}

/// A policy's (namespace, name), as diagnostics and reports name it.
pub fn policy_key(policy: &MultiNetworkPolicy) -> (String, String) {
    (
        policy
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into()),
        policy.metadata.name.clone().unwrap_or_default(),
    )
}

fn object_name(policy: &MultiNetworkPolicy) -> String {
    format!(
        "MultiNetworkPolicy {}/{}",
        policy.metadata.namespace.as_deref().unwrap_or("default"),
        policy.metadata.name.as_deref().unwrap_or("")
    )
}

/// An empty selector (every pod), for building policies in code.
pub fn select_all() -> LabelSelector {
    LabelSelector::default()
}
