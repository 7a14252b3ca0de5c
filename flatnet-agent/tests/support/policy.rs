//! MultiNetworkPolicies compiled for test pods exactly as the agent does.

use std::collections::BTreeMap;

use flatnet_agent::policy_compiler::{
    CompiledPolicy, FlatPod, MultiNetworkPolicy, NetworkNames, PolicyInputs, compile,
};

/// A pod of namespace `a` labelled `app=<app>`; `local` when it runs on
/// this node.
pub fn app_pod(name: &str, app: &str, ips: &[&str], local: bool) -> FlatPod {
    FlatPod {
        namespace: "a".into(),
        name: name.into(),
        labels: BTreeMap::from([("app".to_owned(), app.to_owned())]),
        ips: ips.iter().map(|ip| ip.parse().unwrap()).collect(),
        local,
    }
}

/// Compiles `policies` for `pods` (default network names, no namespace
/// labels) and asserts that the compiler had nothing to report.
pub fn compile_cleanly(policies: &[MultiNetworkPolicy], pods: &[FlatPod]) -> CompiledPolicy {
    let compiled = compile(PolicyInputs {
        policies,
        networks: &NetworkNames::default(),
        namespaces: &BTreeMap::new(),
        pods,
    });
    assert!(
        compiled.diagnostics.is_empty(),
        "{:?}",
        compiled.diagnostics
    );
    compiled
}
