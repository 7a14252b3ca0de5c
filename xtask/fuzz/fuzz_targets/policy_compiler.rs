//! The policy compiler's input: MultiNetworkPolicies, namespace labels and
//! flat pods, as JSON. Property: where the compiler reports no diagnostic
//! (nothing enforced differently from what the policies say), its tables
//! decide every probe packet as the reference evaluator does.
#![no_main]

use std::{collections::BTreeMap, net::IpAddr};

use flatnet_agent::policy_compiler::{
    FlatPod, MultiNetworkPolicy, NetworkNames, PolicyInputs, compile, reference, selector::Labels,
};
use flatnet_common::policy::{Direction, proto};
use libfuzzer_sys::fuzz_target;

#[derive(serde::Deserialize)]
struct Input {
    #[serde(default)]
    policies: Vec<MultiNetworkPolicy>,
    #[serde(default)]
    namespaces: BTreeMap<String, Labels>,
    #[serde(default)]
    pods: Vec<FlatPod>,
}

/// Probe packets per (subject, remote) pair: the protocols with and
/// without ports and a spread of ports.
const PROTOCOLS: [u8; 5] = [
    proto::TCP,
    proto::UDP,
    proto::SCTP,
    proto::ICMP,
    proto::ICMPV6,
];
const PORTS: [u16; 6] = [0, 53, 80, 443, 8080, 65535];
/// Bounds the work per input, so the fuzzer explores instead of grinding.
const MAX_ADDRESSES: usize = 12;

fuzz_target!(|data: &[u8]| {
    let Ok(input) = serde_json::from_slice::<Input>(data) else {
        return;
    };
    let networks = NetworkNames::default();
    let inputs = PolicyInputs {
        policies: &input.policies,
        networks: &networks,
        namespaces: &input.namespaces,
        pods: &input.pods,
    };
    let compiled = compile(inputs);
    assert_eq!(compile(inputs), compiled, "compiling is deterministic");
    if !compiled.diagnostics.is_empty() {
        return;
    }
    let addresses: Vec<IpAddr> = input
        .pods
        .iter()
        .flat_map(|p| p.ips.iter().copied())
        .collect();
    if addresses.len() > MAX_ADDRESSES {
        return;
    }
    let remotes = addresses
        .iter()
        .copied()
        .chain(["192.0.2.1", "2001:db8::1"].map(|a| a.parse::<IpAddr>().expect("literal")));
    let subjects = input
        .pods
        .iter()
        .filter(|p| p.local)
        .flat_map(|p| p.ips.iter().copied());
    for subject in subjects {
        for remote in remotes.clone() {
            for direction in [Direction::Ingress, Direction::Egress] {
                for protocol in PROTOCOLS {
                    let ports: &[u16] = if matches!(protocol, proto::ICMP | proto::ICMPV6) {
                        &[]
                    } else {
                        &PORTS
                    };
                    let probes = ports
                        .iter()
                        .map(|&p| Some(p))
                        .chain(ports.is_empty().then_some(None));
                    for port in probes {
                        let expected =
                            reference::allowed(&inputs, direction, subject, remote, protocol, port);
                        let got = compiled.allows(direction, subject, remote, protocol, port);
                        assert_eq!(
                            got, expected,
                            "{direction:?} subject {subject} remote {remote} protocol {protocol} port {port:?}"
                        );
                    }
                }
            }
        }
    }
});
