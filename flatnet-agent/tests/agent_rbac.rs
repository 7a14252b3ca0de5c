//! The chart's RBAC for the agent against what the agent asks for: every
//! test of this package that runs the real agent in Kubernetes mode serves
//! it through the chart's rules for its ServiceAccount (a refused request
//! fails that test, as on a real server) and leaves the kinds of request it
//! sent in `target/tmp/agent-accesses`. Read after the whole suite (`cargo
//! xtask test` runs this test last), every grant must have been used, or be
//! listed in [`NOT_EXERCISED`] with the code that needs it and why no test
//! here asks for it: a grant nothing uses is one to remove.

mod support;

use std::collections::BTreeSet;

use flatnet_operator::allocation::fake_api::{Access, rbac::Rbac};
use support::agent::agent_accesses_dir;

/// Grants no recorded test exercises: (API group, resource, verb, the code
/// that needs it and why no test here asks for it).
const NOT_EXERCISED: &[(&str, &str, &str, &str)] = &[
    (
        "events.k8s.io",
        "events",
        "patch",
        "flatnet_k8s::events: kube's Recorder patches an Event's series when the same note \
         recurs within six minutes; each test here raises each note once",
    ),
    (
        "flatnetwork.pandaria.io",
        "flatnetworksubnets",
        "get",
        "desired::kubernetes subnet_and_address and capacity read a subnet the agent's watch \
         has not brought (before its first list, or named by a network configuration's \
         `subnet`); the agents here have listed every subnet before their first ADD",
    ),
    (
        "flatnetwork.pandaria.io",
        "flatnetworkwireclaims",
        "update",
        "wire_report: a node's report is replaced when what it saw changes; the agents here \
         report once (the replacement is tested in-process by tests/wire_report.rs)",
    ),
];

/// The kinds of request the agent sent in the recorded tests, and how many
/// tests recorded.
fn recorded() -> (BTreeSet<Access>, usize) {
    let dir = agent_accesses_dir();
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}; run the package's tests first", dir.display()))
        .map(|entry| entry.unwrap().path())
        .collect();
    let mut accesses = BTreeSet::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for line in text.lines().filter(|l| !l.is_empty()) {
            accesses.insert(
                Access::from_line(line)
                    .unwrap_or_else(|| panic!("{}: unreadable line {line:?}", file.display())),
            );
        }
    }
    (accesses, files.len())
}

#[test]
#[ignore = "reads what the package's other tests recorded: `cargo xtask test` runs it after them"]
fn the_agents_tests_use_every_grant_the_chart_gives_it() {
    let (accesses, tests) = recorded();
    assert!(
        tests >= 10 && !accesses.is_empty(),
        "only {tests} tests recorded what the agent asked for"
    );
    let grants = Rbac::from_chart("flatnet-agent").grants();
    assert!(!grants.is_empty(), "no flatnet-agent role in the render");
    let listed = |group: &str, resource: &str, verb: &str| {
        NOT_EXERCISED
            .iter()
            .any(|(g, r, v, _)| *g == group && *r == resource && *v == verb)
    };
    let unused: Vec<String> = grants
        .iter()
        .filter(|g| !accesses.iter().any(|a| g.covers(a)))
        .filter(|g| !listed(&g.group, &g.resource, &g.verb))
        .map(|g| format!("{} {}.{}", g.verb, g.resource, g.group))
        .collect();
    assert!(
        unused.is_empty(),
        "granted to the agent by charts/flatnet/templates/agent-rbac.yaml, used by no test \
         and not listed in NOT_EXERCISED: {unused:#?}"
    );
    let stale: Vec<_> = NOT_EXERCISED
        .iter()
        .filter(|(group, resource, verb, _)| {
            let matching: Vec<_> = grants
                .iter()
                .filter(|g| g.group == *group && g.resource == *resource && g.verb == *verb)
                .collect();
            matching.is_empty()
                || matching
                    .iter()
                    .any(|g| accesses.iter().any(|a| g.covers(a)))
        })
        .collect();
    assert!(
        stale.is_empty(),
        "listed in NOT_EXERCISED but not granted, or used after all: {stale:?}"
    );
}
