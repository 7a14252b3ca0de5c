//! The operator's RBAC in the chart against what its code asks for: every
//! kind of request the replicas of a chaos run send to the fake API server
//! (allocation controllers and leader election), and those of the other
//! controllers, the webhook and its certificate upkeep driven against
//! recording fakes that authorize them by the chart's rules as a real API
//! server does ([`drive`]; a server-side apply that creates its object
//! needs `create` too), must be granted by the rendered chart, and every
//! grant must be used by such a run or be listed in [`NOT_EXERCISED`] with
//! the code that needs it and why no run can ask for it.
//!
//! The chart is read as `cargo xtask charts` renders it (with its default
//! values) to `target/images/chart-default-render.json`.

use std::collections::BTreeSet;

use super::Options;
use crate::allocation::fake_api::{
    Access,
    faults::FaultRates,
    rbac::{Grant, Rbac},
};

mod drive;

/// Grants no recorded run exercises, each with the code that needs it and
/// why the fake cannot make it ask: (API group, resource, verb, why).
const NOT_EXERCISED: &[(&str, &str, &str, &str)] = &[];

/// The operator's grants in the rendered chart.
fn operator_grants() -> BTreeSet<Grant> {
    let grants = Rbac::from_chart(drive::OPERATOR).grants();
    assert!(!grants.is_empty(), "no flatnet-operator role in the render");
    grants
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chart_grants_what_the_operator_asks_for_and_nothing_more() {
    let mut options = Options::new(0x5bac, 300);
    options.rates = FaultRates::none();
    options.quiet_every = 300;
    options.keep_going = true;
    options.settle = std::time::Duration::from_secs(10);
    // The invariants are the chaos run's business; here only the requests
    // count.
    let (report, _) = super::drive(&options).await;
    assert!(
        report.ops.values().sum::<u64>() > 200,
        "the run did its operations"
    );
    let mut accesses = report.accesses.clone();
    accesses.extend(drive::every_other_controller().await);
    let grants = operator_grants();

    let missing: Vec<&Access> = accesses
        .iter()
        .filter(|a| !grants.iter().any(|g| g.covers(a)))
        .collect();
    assert!(
        missing.is_empty(),
        "the operator sends requests its RBAC does not grant: {missing:#?}"
    );

    let unused: Vec<&Grant> = grants
        .iter()
        .filter(|g| !accesses.iter().any(|a| g.covers(a)))
        .filter(|g| {
            !NOT_EXERCISED.iter().any(|(group, resource, verb, _)| {
                g.group == *group && g.resource == *resource && g.verb == *verb
            })
        })
        .collect();
    assert!(
        unused.is_empty(),
        "granted, never used, and not listed in NOT_EXERCISED: {unused:?}"
    );
    let stale: Vec<_> = NOT_EXERCISED
        .iter()
        .filter(|(group, resource, verb, _)| {
            let listed =
                |g: &Grant| g.group == *group && g.resource == *resource && g.verb == *verb;
            !grants.iter().any(listed)
                || grants
                    .iter()
                    .filter(|g| listed(g))
                    .any(|g| accesses.iter().any(|a| g.covers(a)))
        })
        .collect();
    assert!(
        stale.is_empty(),
        "listed in NOT_EXERCISED but not granted, or used after all: {stale:?}"
    );
}
