//! Property tests: the compiled tables agree with the reference evaluator
//! on random policies, pods and packets.

use std::{collections::BTreeMap, net::IpAddr};

use flatnet_common::policy::{Direction, proto};
use k8s_openapi::{
    api::networking::v1::{
        IPBlock, NetworkPolicyEgressRule, NetworkPolicyIngressRule, NetworkPolicyPeer,
        NetworkPolicyPort,
    },
    apimachinery::pkg::{
        apis::meta::v1::{LabelSelector, LabelSelectorRequirement, ObjectMeta},
        util::intstr::IntOrString,
    },
};
use proptest::prelude::*;

use super::{
    api::{MultiNetworkPolicy, MultiNetworkPolicySpec, NetworkNames, POLICY_FOR_ANNOTATION},
    compile::{FlatPod, PolicyInputs, compile},
    reference,
    selector::Labels,
};

const NAMESPACES: [&str; 2] = ["a", "b"];
const V4: [&str; 6] = [
    "10.0.0.1",
    "10.0.0.2",
    "10.0.0.3",
    "10.0.1.7",
    "192.168.1.1",
    "10.0.0.130",
];
const V6: [&str; 4] = ["fd00::1", "fd00::2", "fd00:0:0:1::9", "2001:db8::1"];
const CIDRS: [&str; 10] = [
    "10.0.0.0/8",
    "10.0.0.0/24",
    "10.0.0.0/25",
    "10.0.0.2/32",
    "0.0.0.0/0",
    "192.168.0.0/16",
    "fd00::/16",
    "fd00::/64",
    "::/0",
    "fd00::2/128",
];

fn labels(app: u8, env: u8) -> Labels {
    let mut l = Labels::new();
    if app > 0 {
        l.insert("app".into(), ["", "web", "db"][app as usize].into());
    }
    if env > 0 {
        l.insert("env".into(), ["", "prod", "dev"][env as usize].into());
    }
    l
}

fn selector() -> impl Strategy<Value = LabelSelector> {
    prop_oneof![
        Just(LabelSelector::default()),
        (0u8..3, 0u8..3).prop_map(|(a, e)| LabelSelector {
            match_labels: Some(labels(a, e)),
            ..Default::default()
        }),
        (
            prop::sample::select(vec!["In", "NotIn", "Exists", "DoesNotExist"]),
            0u8..3
        )
            .prop_map(|(op, v)| LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: "app".into(),
                    operator: op.into(),
                    values: Some(vec![["web", "db", "x"][v as usize].into()]),
                }]),
                ..Default::default()
            }),
    ]
}

fn peer() -> impl Strategy<Value = NetworkPolicyPeer> {
    prop_oneof![
        (0..CIDRS.len(), prop::collection::vec(0..CIDRS.len(), 0..3)).prop_map(|(c, ex)| {
            NetworkPolicyPeer {
                ip_block: Some(IPBlock {
                    cidr: CIDRS[c].into(),
                    except: Some(ex.into_iter().map(|e| CIDRS[e].to_owned()).collect()),
                }),
                ..Default::default()
            }
        }),
        selector().prop_map(|s| NetworkPolicyPeer {
            pod_selector: Some(s),
            ..Default::default()
        }),
        selector().prop_map(|s| NetworkPolicyPeer {
            namespace_selector: Some(s),
            ..Default::default()
        }),
        (selector(), selector()).prop_map(|(p, n)| NetworkPolicyPeer {
            pod_selector: Some(p),
            namespace_selector: Some(n),
            ..Default::default()
        }),
    ]
}

fn port() -> impl Strategy<Value = NetworkPolicyPort> {
    let protocol = prop::sample::select(vec![None, Some("TCP"), Some("UDP"), Some("SCTP")]);
    let number = prop_oneof![
        Just(None),
        (
            prop::sample::select(vec![53, 80, 85, 443]),
            prop::option::of(prop::sample::select(vec![80, 90, 100]))
        )
            .prop_map(|(p, e)| Some((IntOrString::Int(p), e))),
        Just(Some((IntOrString::String("http".into()), None))),
    ];
    (protocol, number).prop_map(|(protocol, number)| {
        let (port, end_port) = match number {
            None => (None, None),
            Some((p, e)) => (Some(p), e),
        };
        NetworkPolicyPort {
            protocol: protocol.map(Into::into),
            port,
            end_port,
        }
    })
}

type Rule = (
    Option<Vec<NetworkPolicyPeer>>,
    Option<Vec<NetworkPolicyPort>>,
);

fn rule() -> impl Strategy<Value = Rule> {
    (
        prop::option::of(prop::collection::vec(peer(), 0..3)),
        prop::option::of(prop::collection::vec(port(), 0..3)),
    )
}

fn policy() -> impl Strategy<Value = MultiNetworkPolicy> {
    (
        0..NAMESPACES.len(),
        prop::sample::select(vec![
            "rancher-flat-network",
            "other",
            "b/rancher-flat-network",
        ]),
        prop::option::of(selector()),
        prop::sample::select(vec![0u8, 1, 2, 3, 4]),
        prop::option::of(prop::collection::vec(rule(), 0..3)),
        prop::option::of(prop::collection::vec(rule(), 0..3)),
    )
        .prop_map(|(ns, network, pod_selector, types, ingress, egress)| {
            let policy_types = match types {
                0 => None,
                1 => Some(vec![]),
                2 => Some(vec!["Ingress".to_owned()]),
                3 => Some(vec!["Egress".to_owned()]),
                _ => Some(vec!["Ingress".to_owned(), "Egress".to_owned()]),
            };
            let spec = MultiNetworkPolicySpec {
                pod_selector,
                policy_types,
                ingress: ingress.map(|rules| {
                    rules
                        .into_iter()
                        .map(|(from, ports)| NetworkPolicyIngressRule { from, ports })
                        .collect()
                }),
                egress: egress.map(|rules| {
                    rules
                        .into_iter()
                        .map(|(to, ports)| NetworkPolicyEgressRule { to, ports })
                        .collect()
                }),
            };
            let mut policy = MultiNetworkPolicy::new("p", spec);
            policy.metadata = ObjectMeta {
                name: Some("p".into()),
                namespace: Some(NAMESPACES[ns].into()),
                annotations: Some(BTreeMap::from([(
                    POLICY_FOR_ANNOTATION.to_owned(),
                    network.to_owned(),
                )])),
                ..Default::default()
            };
            policy
        })
}

/// Pods: the first two are local; every pod gets one IPv4 and one IPv6 address.
fn pods() -> impl Strategy<Value = Vec<FlatPod>> {
    prop::collection::vec((0..NAMESPACES.len(), 0u8..3, 0u8..3), 4).prop_map(|specs| {
        specs
            .into_iter()
            .enumerate()
            .map(|(i, (ns, app, env))| FlatPod {
                namespace: NAMESPACES[ns].into(),
                name: format!("pod{i}"),
                labels: labels(app, env),
                ips: vec![V4[i].parse().unwrap(), V6[i].parse().unwrap()],
                local: i < 2,
            })
            .collect()
    })
}

#[derive(Clone, Debug)]
struct Packet {
    direction: Direction,
    local_pod: usize,
    v6: bool,
    remote: usize,
    protocol: u8,
    port: u16,
}

fn packet() -> impl Strategy<Value = Packet> {
    (
        prop::sample::select(vec![Direction::Ingress, Direction::Egress]),
        0usize..2,
        any::<bool>(),
        0usize..6,
        prop::sample::select(vec![proto::TCP, proto::UDP, proto::SCTP, proto::ICMP]),
        prop::sample::select(vec![53u16, 79, 80, 85, 90, 91, 100, 443]),
    )
        .prop_map(
            |(direction, local_pod, v6, remote, protocol, port)| Packet {
                direction,
                local_pod,
                v6,
                remote,
                protocol,
                port,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn compiled_tables_agree_with_the_reference(
        policies in prop::collection::vec(policy(), 0..4),
        pods in pods(),
        ns_env in (0u8..3, 0u8..3),
        packets in prop::collection::vec(packet(), 1..24),
    ) {
        let namespaces = BTreeMap::from([
            ("a".to_owned(), labels(0, ns_env.0)),
            ("b".to_owned(), labels(0, ns_env.1)),
        ]);
        let networks = NetworkNames::default();
        let inputs = PolicyInputs { policies: &policies, networks: &networks, namespaces: &namespaces, pods: &pods };
        let compiled = compile(inputs);
        for p in packets {
            let subject = pods[p.local_pod].ips[usize::from(p.v6)];
            let remote: IpAddr = if p.v6 { V6[p.remote % V6.len()] } else { V4[p.remote] }.parse().unwrap();
            let port = if p.protocol == proto::ICMP { None } else { Some(p.port) };
            let expected = reference::allowed(&inputs, p.direction, subject, remote, p.protocol, port);
            let got = compiled.allows(p.direction, subject, remote, p.protocol, port);
            prop_assert_eq!(got, expected, "{:?} subject {} remote {}", p, subject, remote);
        }
    }
}
