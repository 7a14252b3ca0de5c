//! The condition rule over a table of leader, webhook, DaemonSet and agent
//! states, and the controller against the fake API server while agents'
//! heartbeats appear, fail, go stale and recover.

use std::time::Duration;

use flatnet_k8s::{
    agent_heartbeat::{
        self, AgentReadiness, REASON_CNI_SOCKET_NOT_SERVING, REASON_PROGRAMS_NOT_LOADED,
        REASON_STARTING, REASON_STOPPING,
    },
    api::FlatNetworkConfigSpec,
};
use serde_json::json;

use super::*;
use crate::allocation::fake_api::FakeApiServer;

const NS: &str = "flatnet";
const DS: &str = "flatnet-agent";

fn at(second: i64) -> Timestamp {
    Timestamp::from_second(second).expect("a time")
}

/// Now, in the table: heartbeats are valid for 40 s.
const NOW: i64 = 10_000;

fn heartbeat(node: &str, readiness: AgentReadiness, renewed: i64) -> Heartbeat {
    Heartbeat {
        node: node.into(),
        readiness,
        renewed: Some(at(renewed)),
        valid_for: SignedDuration::from_secs(40),
    }
}

fn ready(node: &str) -> Heartbeat {
    heartbeat(node, AgentReadiness::ready(), NOW - 5)
}

fn rollout(desired: i32, updated: i32, available: i32) -> Rollout {
    Rollout {
        name: format!("{NS}/{DS}"),
        generation: Some(2),
        observed_generation: Some(2),
        desired,
        updated,
        ready: available,
        available,
    }
}

fn healthy() -> Observed {
    Observed {
        operator: Operator {
            leader: "flatnet-operator-abc".into(),
            controllers_ready: true,
        },
        webhook: Webhook::Serving,
        rollout: Some(rollout(2, 2, 2)),
        daemonset: format!("{NS}/{DS}"),
        heartbeats: vec![ready("node-1"), ready("node-2")],
        webhook_route: Some(WebhookRoute {
            service: Some((format!("{NS}/{WEBHOOK_SERVICE}"), 2)),
            ca_bundle: CaBundle::Trusted,
        }),
        progress_since: None,
        progress_deadline: SignedDuration::from_secs(600),
    }
}

const WEBHOOK_SERVICE: &str = "flatnet-webhook";

/// (Available, Progressing, Degraded) as (status, reason) each, and the
/// messages.
fn judge(observed: &Observed) -> ([(String, String); 3], [String; 3]) {
    let conditions = conditions(observed, Some(7), at(NOW));
    for c in &conditions {
        assert_eq!(c.observed_generation, Some(7), "{c:?}");
        assert_eq!(c.last_transition_time, Time(at(NOW)));
    }
    assert_eq!(
        conditions.each_ref().map(|c| c.type_.as_str()),
        [
            CONDITION_AVAILABLE,
            CONDITION_PROGRESSING,
            CONDITION_DEGRADED
        ]
    );
    (
        conditions
            .each_ref()
            .map(|c| (c.status.clone(), c.reason.clone())),
        conditions.map(|c| c.message),
    )
}

fn pair(status: &str, reason: &str) -> (String, String) {
    (status.to_owned(), reason.to_owned())
}

#[test]
fn the_conditions_follow_the_leader_webhook_rollout_and_agents() {
    type Case = (
        &'static str,
        fn(&mut Observed),
        [(&'static str, &'static str); 3],
    );
    let cases: &[Case] = &[
        (
            "everything serves",
            |_| {},
            [
                ("True", REASON_ALL_SERVING),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "the webhook Service has no ready endpoint",
            |o| {
                o.webhook_route = Some(WebhookRoute {
                    service: Some((format!("{NS}/{WEBHOOK_SERVICE}"), 0)),
                    ca_bundle: CaBundle::Trusted,
                });
            },
            [
                ("False", REASON_WEBHOOK_ENDPOINTS_NOT_READY),
                ("True", REASON_WEBHOOK_ENDPOINTS_NOT_READY),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "a URL is registered: no Service to look at",
            |o| {
                o.webhook_route = Some(WebhookRoute {
                    service: None,
                    ca_bundle: CaBundle::Trusted,
                });
            },
            [
                ("True", REASON_ALL_SERVING),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "the caBundle does not trust the served certificate",
            |o| {
                o.webhook_route = Some(WebhookRoute {
                    service: Some((format!("{NS}/{WEBHOOK_SERVICE}"), 2)),
                    ca_bundle: CaBundle::Mismatch("signed by another CA".into()),
                });
            },
            [
                ("False", REASON_WEBHOOK_CA_BUNDLE_MISMATCH),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("True", REASON_WEBHOOK_CA_BUNDLE_MISMATCH),
            ],
        ),
        (
            "the caBundle not read yet is no failure",
            |o| {
                o.webhook_route = Some(WebhookRoute {
                    service: Some((format!("{NS}/{WEBHOOK_SERVICE}"), 2)),
                    ca_bundle: CaBundle::Unchecked,
                });
            },
            [
                ("True", REASON_ALL_SERVING),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "a rollout within its deadline",
            |o| {
                o.rollout = Some(rollout(2, 1, 1));
                o.progress_since = Some(at(NOW - 599));
            },
            [
                ("True", REASON_ALL_SERVING),
                ("True", REASON_ROLLING_OUT),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "a rollout past its deadline",
            |o| {
                o.rollout = Some(rollout(2, 1, 1));
                o.progress_since = Some(at(NOW - 600));
            },
            [
                ("True", REASON_ALL_SERVING),
                ("False", REASON_PROGRESS_DEADLINE_EXCEEDED),
                ("True", REASON_PROGRESS_DEADLINE_EXCEEDED),
            ],
        ),
        (
            "an agent starting past the deadline",
            |o| {
                o.heartbeats[1] = heartbeat(
                    "node-2",
                    AgentReadiness::not_ready(REASON_STARTING, "opening the CNI socket"),
                    NOW,
                );
                o.progress_since = Some(at(NOW - 601));
            },
            [
                ("False", REASON_AGENTS_NOT_READY),
                ("False", REASON_PROGRESS_DEADLINE_EXCEEDED),
                ("True", REASON_PROGRESS_DEADLINE_EXCEEDED),
            ],
        ),
        (
            "a deadline with nothing progressing is no failure",
            |o| o.progress_since = Some(at(0)),
            [
                ("True", REASON_ALL_SERVING),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "webhook turned off is no failure",
            |o| o.webhook = Webhook::Disabled,
            [
                ("True", REASON_ALL_SERVING),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "a new leader syncing its caches",
            |o| o.operator.controllers_ready = false,
            [
                ("False", REASON_OPERATOR_STARTING),
                ("True", REASON_OPERATOR_STARTING),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "the webhook without a certificate",
            |o| o.webhook = Webhook::NotServing("no certificate".into()),
            [
                ("False", REASON_WEBHOOK_NOT_SERVING),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("True", REASON_WEBHOOK_NOT_SERVING),
            ],
        ),
        (
            "no agent DaemonSet",
            |o| o.rollout = None,
            [
                ("False", REASON_DAEMONSET_NOT_FOUND),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("True", REASON_DAEMONSET_NOT_FOUND),
            ],
        ),
        (
            "no node runs an agent",
            |o| {
                o.rollout = Some(rollout(0, 0, 0));
                o.heartbeats.clear();
            },
            [
                ("False", REASON_NO_AGENTS),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "a rollout: one agent updated, the other restarting",
            |o| {
                o.rollout = Some(rollout(2, 1, 1));
                o.heartbeats[1].readiness = AgentReadiness::not_ready(REASON_STOPPING, "SIGTERM");
            },
            [
                ("False", REASON_AGENTS_NOT_READY),
                ("True", REASON_ROLLING_OUT),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "a spec the DaemonSet controller has not seen",
            |o| o.rollout.as_mut().unwrap().generation = Some(3),
            [
                ("True", REASON_ALL_SERVING),
                ("True", REASON_ROLLING_OUT),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "an agent starting after a restart",
            |o| o.heartbeats[0].readiness = AgentReadiness::not_ready(REASON_STARTING, "loading"),
            [
                ("False", REASON_AGENTS_NOT_READY),
                ("True", REASON_AGENTS_STARTING),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
        (
            "an agent that cannot load its programs",
            |o| {
                o.heartbeats[1].readiness = AgentReadiness::not_ready(
                    REASON_PROGRAMS_NOT_LOADED,
                    "/sys/fs/bpf is not on a bpf filesystem",
                );
            },
            [
                ("False", REASON_AGENTS_NOT_READY),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("True", REASON_AGENTS_FAILING),
            ],
        ),
        (
            "a dead agent: its heartbeat went stale",
            |o| o.heartbeats[0].renewed = Some(at(NOW - 90)),
            [
                ("False", REASON_AGENTS_NOT_READY),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("True", REASON_HEARTBEATS_STALE),
            ],
        ),
        (
            "pods available but no heartbeat written",
            |o| o.heartbeats.truncate(1),
            [
                ("False", REASON_AGENTS_NOT_READY),
                ("False", REASON_ROLLOUT_COMPLETE),
                ("True", REASON_HEARTBEATS_MISSING),
            ],
        ),
        (
            "a pod still coming up has not written yet",
            |o| {
                o.rollout = Some(rollout(2, 2, 1));
                o.heartbeats.truncate(1);
            },
            [
                ("False", REASON_AGENTS_NOT_READY),
                ("True", REASON_ROLLING_OUT),
                ("False", REASON_AS_EXPECTED),
            ],
        ),
    ];
    for (name, change, expected) in cases {
        let mut observed = healthy();
        change(&mut observed);
        let (got, messages) = judge(&observed);
        assert_eq!(
            got,
            expected.map(|(s, r)| pair(s, r)),
            "{name}: {messages:?}"
        );
    }
}

#[test]
fn messages_name_the_nodes_and_their_reasons() {
    let mut observed = healthy();
    observed.heartbeats[1].readiness = AgentReadiness::not_ready(
        REASON_PROGRAMS_NOT_LOADED,
        "load the flatnet eBPF programs: /x is not on a bpf filesystem",
    );
    observed.heartbeats[0].renewed = Some(at(NOW - 90));
    let (_, [available, _, degraded]) = judge(&observed);
    assert_eq!(available, "0 of 2 agents ready");
    assert!(
        degraded.contains("node-2: ProgramsNotLoaded: load the flatnet eBPF programs")
            && degraded.contains("node-1: no heartbeat for 90s (last said Ready"),
        "{degraded}"
    );

    let (_, [available, progressing, _]) = judge(&healthy());
    assert!(
        available.contains("flatnet-operator-abc") && available.contains("2 of 2 agents ready"),
        "{available}"
    );
    assert!(
        progressing.contains("2 of 2 agents updated, 2 ready, 2 available"),
        "{progressing}"
    );

    // Many failing nodes: five named, the rest counted.
    let mut many = healthy();
    many.rollout = Some(rollout(8, 8, 8));
    many.heartbeats = (0..8)
        .map(|i| {
            heartbeat(
                &format!("n{i}"),
                AgentReadiness::not_ready(REASON_CNI_SOCKET_NOT_SERVING, "refused"),
                NOW,
            )
        })
        .collect();
    let (_, [_, _, degraded]) = judge(&many);
    assert!(
        degraded.contains("n4: ") && !degraded.contains("n5: "),
        "{degraded}"
    );
    assert!(degraded.ends_with("and 3 more"), "{degraded}");
}

#[test]
fn a_stalled_rollout_names_what_is_stuck_and_for_how_long() {
    let mut observed = healthy();
    observed.rollout = Some(rollout(3, 1, 1));
    observed.heartbeats.push(heartbeat(
        "node-3",
        AgentReadiness::not_ready(REASON_STARTING, "loading the eBPF programs"),
        NOW,
    ));
    observed.progress_deadline = SignedDuration::from_secs(120);
    observed.progress_since = Some(at(NOW - 130));
    let (_, [_, progressing, degraded]) = judge(&observed);
    assert_eq!(progressing, degraded);
    assert!(
        degraded.starts_with("no progress for 130s (progressDeadlineSeconds 120): ")
            && degraded.contains("DaemonSet flatnet/flatnet-agent: 1 of 3 agents updated")
            && degraded.contains("node-3 (Starting)"),
        "{degraded}"
    );
}

#[test]
fn the_progress_key_moves_with_any_progress_and_only_then() {
    let mut observed = healthy();
    assert_eq!(progress_key(&observed, at(NOW)), None, "nothing progresses");
    observed.rollout = Some(rollout(3, 1, 1));
    let stuck = progress_key(&observed, at(NOW)).expect("a rollout");
    assert_eq!(
        progress_key(&observed, at(NOW + 30)),
        Some(stuck.clone()),
        "time alone is no progress"
    );
    observed.rollout = Some(rollout(3, 2, 1));
    let updated = progress_key(&observed, at(NOW)).expect("still rolling out");
    assert_ne!(updated, stuck, "one more agent updated is progress");
    observed.rollout = Some(rollout(3, 2, 2));
    assert_ne!(
        progress_key(&observed, at(NOW)),
        Some(updated),
        "one more available is progress"
    );
}

#[test]
fn merging_keeps_the_transition_time_while_a_status_stays() {
    let first = conditions(&healthy(), Some(1), at(NOW));
    let written = merged(&[], first.clone()).expect("new conditions are a change");
    assert_eq!(
        merged(&written, conditions(&healthy(), Some(1), at(NOW + 20))),
        None
    );

    let mut failing = healthy();
    failing.heartbeats[0].readiness =
        AgentReadiness::not_ready(REASON_CNI_SOCKET_NOT_SERVING, "connection refused");
    let after = merged(&written, conditions(&failing, Some(1), at(NOW + 20))).expect("a change");
    let time = |list: &[Condition], type_: &str| {
        list.iter()
            .find(|c| c.type_ == type_)
            .map(|c| c.last_transition_time.clone())
    };
    assert_eq!(time(&after, CONDITION_AVAILABLE), Some(Time(at(NOW + 20))));
    assert_eq!(time(&after, CONDITION_DEGRADED), Some(Time(at(NOW + 20))));
    assert_eq!(
        time(&after, CONDITION_PROGRESSING),
        Some(Time(at(NOW))),
        "Progressing stayed False"
    );
}

fn lease_of(node: &str, readiness: &AgentReadiness, renewed: Timestamp) -> Lease {
    agent_heartbeat::lease(NS, node, readiness, renewed, Duration::from_secs(40), None)
}

fn daemonset(desired: i32, updated: i32, available: i32) -> DaemonSet {
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": DS, "namespace": NS, "generation": 1},
        "spec": {"selector": {}, "template": {}},
        "status": {"observedGeneration": 1, "desiredNumberScheduled": desired,
                   "updatedNumberScheduled": updated, "numberReady": available,
                   "numberAvailable": available, "currentNumberScheduled": desired,
                   "numberMisscheduled": 0}
    }))
    .expect("a DaemonSet")
}

fn stored(server: &FakeApiServer) -> Vec<Condition> {
    server
        .list::<FlatNetworkConfig>()
        .into_iter()
        .next()
        .and_then(|c| c.status)
        .map(|s| s.conditions)
        .unwrap_or_default()
}

fn status_of(conditions: &[Condition], type_: &str) -> Option<(String, String, String)> {
    conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

async fn reach(what: &str, server: &FakeApiServer, done: impl Fn(&[Condition]) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let conditions = stored(server);
        if done(&conditions) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never reached: {what}; conditions: {conditions:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn is(conditions: &[Condition], type_: &str, status: &str, reason: &str) -> bool {
    status_of(conditions, type_).is_some_and(|(s, r, _)| s == status && r == reason)
}

#[tokio::test]
async fn the_conditions_follow_heartbeats_that_appear_fail_go_stale_and_recover() {
    let server = FakeApiServer::new();
    // Stored as created: generation 1.
    server.insert(&FlatNetworkConfig::new(
        CONFIG_NAME,
        FlatNetworkConfigSpec::default(),
    ));
    server.insert(&daemonset(2, 2, 2));
    let health = Arc::new(Health::default());
    health.set_ready(true);
    let stop = CancellationToken::new();
    let task = tokio::spawn(run(
        server.client(),
        Settings {
            namespace: NS.into(),
            daemonset: DS.into(),
            leader: "flatnet-operator-0".into(),
            interval: Duration::from_millis(20),
            ca_bundle_interval: DEFAULT_CA_BUNDLE_INTERVAL,
            wire_window: flatnet_k8s::ipam::DEFAULT_WIRE_WINDOW,
        },
        Arc::clone(&health),
        WebhookProbe::Disabled,
        stop.clone(),
    ));

    // The pods run, no heartbeat yet: not available, missing heartbeats.
    reach("heartbeats missing", &server, |c| {
        is(c, CONDITION_AVAILABLE, "False", REASON_AGENTS_NOT_READY)
            && is(c, CONDITION_DEGRADED, "True", REASON_HEARTBEATS_MISSING)
    })
    .await;
    assert!(
        stored(&server)
            .iter()
            .all(|c| c.observed_generation == Some(1))
    );

    // Both agents report ready.
    for node in ["node-1", "node-2"] {
        server.insert(&lease_of(node, &AgentReadiness::ready(), Timestamp::now()));
    }
    reach("available", &server, |c| {
        is(c, CONDITION_AVAILABLE, "True", REASON_ALL_SERVING)
            && is(c, CONDITION_DEGRADED, "False", REASON_AS_EXPECTED)
            && is(c, CONDITION_PROGRESSING, "False", REASON_ROLLOUT_COMPLETE)
    })
    .await;
    let settled = stored(&server);

    // Renewals that change nothing write nothing.
    let writes = || {
        server
            .requests_by_kind()
            .iter()
            .filter(|(k, _)| k.starts_with("update flatnetworkconfigs/status"))
            .map(|(_, n)| *n)
            .sum::<u64>()
    };
    let before = writes();
    for _ in 0..5 {
        for node in ["node-1", "node-2"] {
            server.insert(&lease_of(node, &AgentReadiness::ready(), Timestamp::now()));
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert_eq!(writes(), before, "unchanged conditions are not written");
    assert_eq!(stored(&server), settled);

    // node-2's agent cannot load its programs.
    server.insert(&lease_of(
        "node-2",
        &AgentReadiness::not_ready(
            REASON_PROGRAMS_NOT_LOADED,
            "load the flatnet eBPF programs: /sys/fs/bpf/flatnet is not on a bpf filesystem",
        ),
        Timestamp::now(),
    ));
    reach("degraded naming node-2", &server, |c| {
        is(c, CONDITION_DEGRADED, "True", REASON_AGENTS_FAILING)
            && status_of(c, CONDITION_DEGRADED).is_some_and(|(_, _, m)| {
                m.contains("node-2: ProgramsNotLoaded: load the flatnet eBPF programs")
            })
            && is(c, CONDITION_AVAILABLE, "False", REASON_AGENTS_NOT_READY)
    })
    .await;
    let progressing_since = |c: &[Condition]| {
        c.iter()
            .find(|c| c.type_ == CONDITION_PROGRESSING)
            .map(|c| c.last_transition_time.clone())
    };
    assert_eq!(
        progressing_since(&stored(&server)),
        progressing_since(&settled),
        "Progressing stayed False: its transition time stays"
    );

    // node-2 recovers; node-1's agent dies: its heartbeat ages out with
    // no event at all.
    server.insert(&lease_of(
        "node-2",
        &AgentReadiness::ready(),
        Timestamp::now(),
    ));
    let long_ago = Timestamp::now() - SignedDuration::from_secs(41);
    server.insert(&lease_of("node-1", &AgentReadiness::ready(), long_ago));
    reach("node-1 stale", &server, |c| {
        is(c, CONDITION_DEGRADED, "True", REASON_HEARTBEATS_STALE)
            && status_of(c, CONDITION_DEGRADED)
                .is_some_and(|(_, _, m)| m.contains("node-1: no heartbeat for"))
    })
    .await;

    // A rollout: node-1's new agent is starting.
    server.insert(&daemonset(2, 1, 1));
    server.insert(&lease_of(
        "node-1",
        &AgentReadiness::not_ready(REASON_STARTING, "loading the eBPF programs"),
        Timestamp::now(),
    ));
    reach("progressing", &server, |c| {
        is(c, CONDITION_PROGRESSING, "True", REASON_ROLLING_OUT)
            && is(c, CONDITION_DEGRADED, "False", REASON_AS_EXPECTED)
    })
    .await;
    server.insert(&daemonset(2, 2, 2));
    server.insert(&lease_of(
        "node-1",
        &AgentReadiness::ready(),
        Timestamp::now(),
    ));
    reach("available again", &server, |c| {
        is(c, CONDITION_AVAILABLE, "True", REASON_ALL_SERVING)
            && is(c, CONDITION_PROGRESSING, "False", REASON_ROLLOUT_COMPLETE)
    })
    .await;

    // A new leader that has not synced yet: not available, progressing.
    health.set_ready(false);
    reach("operator starting", &server, |c| {
        is(c, CONDITION_AVAILABLE, "False", REASON_OPERATOR_STARTING)
            && is(c, CONDITION_PROGRESSING, "True", REASON_OPERATOR_STARTING)
    })
    .await;
    stop.cancel();
    task.await.expect("the controller ends on stop");
}

/// The controller over a cluster whose agents all report ready, with
/// `probe` for the webhook and `spec`'s progress deadline.
fn spawn_controller(
    server: &FakeApiServer,
    spec: FlatNetworkConfigSpec,
    probe: WebhookProbe,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let config = FlatNetworkConfig::new(CONFIG_NAME, spec);
    spawn_controller_over(
        server,
        &config,
        probe,
        flatnet_k8s::ipam::DEFAULT_WIRE_WINDOW,
    )
}

/// [`spawn_controller`] over `config` as stored, with `wire_window`.
fn spawn_controller_over(
    server: &FakeApiServer,
    config: &FlatNetworkConfig,
    probe: WebhookProbe,
    wire_window: Duration,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    server.insert(config);
    for node in ["node-1", "node-2"] {
        server.insert(&lease_of(node, &AgentReadiness::ready(), Timestamp::now()));
    }
    let health = Arc::new(Health::default());
    health.set_ready(true);
    let stop = CancellationToken::new();
    let task = tokio::spawn(run(
        server.client(),
        Settings {
            namespace: NS.into(),
            daemonset: DS.into(),
            leader: "flatnet-operator-0".into(),
            interval: Duration::from_millis(20),
            ca_bundle_interval: Duration::from_millis(20),
            wire_window,
        },
        health,
        probe,
        stop.clone(),
    ));
    (stop, task)
}

#[tokio::test]
async fn a_rollout_stuck_past_its_deadline_turns_degraded_until_it_moves() {
    let server = FakeApiServer::new();
    // One agent updated of two, and it stays so.
    server.insert(&daemonset(2, 1, 1));
    let spec = FlatNetworkConfigSpec {
        progress_deadline_seconds: Some(1),
        ..FlatNetworkConfigSpec::default()
    };
    let (stop, task) = spawn_controller(&server, spec, WebhookProbe::Disabled);
    reach("rolling out", &server, |c| {
        is(c, CONDITION_PROGRESSING, "True", REASON_ROLLING_OUT)
            && is(c, CONDITION_DEGRADED, "False", REASON_AS_EXPECTED)
    })
    .await;
    reach("past the deadline", &server, |c| {
        is(c, CONDITION_PROGRESSING, "False", REASON_PROGRESS_DEADLINE_EXCEEDED)
            && is(c, CONDITION_DEGRADED, "True", REASON_PROGRESS_DEADLINE_EXCEEDED)
            && status_of(c, CONDITION_DEGRADED).is_some_and(|(_, _, m)| {
                m.contains("(progressDeadlineSeconds 1): DaemonSet flatnet/flatnet-agent: 1 of 2 agents updated")
            })
    })
    .await;

    // The rollout moves: progressing again, within a new deadline
    // (raised, so the next look cannot be past it).
    let mut config = server.list::<FlatNetworkConfig>().remove(0);
    config.spec.progress_deadline_seconds = Some(3600);
    server.insert(&config);
    server.insert(&daemonset(3, 2, 2));
    reach("progressing again", &server, |c| {
        is(c, CONDITION_PROGRESSING, "True", REASON_ROLLING_OUT)
            && is(c, CONDITION_DEGRADED, "False", REASON_AS_EXPECTED)
    })
    .await;
    server.insert(&daemonset(2, 2, 2));
    reach("complete", &server, |c| {
        is(c, CONDITION_PROGRESSING, "False", REASON_ROLLOUT_COMPLETE)
            && is(c, CONDITION_AVAILABLE, "True", REASON_ALL_SERVING)
    })
    .await;
    stop.cancel();
    task.await.expect("the controller ends on stop");
}

#[tokio::test]
async fn available_needs_webhook_endpoints_and_a_ca_bundle_trusting_the_served_certificate() {
    use crate::{
        fixtures::{endpoint_slice, webhook_configuration},
        tls::cert::{self, Renewal},
    };
    let hosts = cert::hosts(WEBHOOK_SERVICE, NS, None);
    let now = time::OffsetDateTime::now_utc();
    let served = cert::renew(None, &Renewal::Ca("test"), &hosts, now).expect("certificates");
    let other = cert::renew(None, &Renewal::Ca("test"), &hosts, now).expect("certificates");
    let resolver = Arc::new(ReloadingResolver::default());
    resolver.load(&served.cert, &served.key).expect("loads");

    let server = FakeApiServer::new();
    server.insert(&daemonset(2, 2, 2));
    // Registered with another CA; the Service's one endpoint not ready.
    server.insert(&webhook_configuration("flatnet-webhook", &other.ca_bundle));
    server.insert(&endpoint_slice(NS, WEBHOOK_SERVICE, false));
    let probe = WebhookProbe::Enabled {
        resolver,
        service: Some(WEBHOOK_SERVICE.into()),
        configuration: "flatnet-webhook".into(),
    };
    let (stop, task) = spawn_controller(&server, FlatNetworkConfigSpec::default(), probe);
    reach("the caBundle mismatch", &server, |c| {
        is(
            c,
            CONDITION_AVAILABLE,
            "False",
            REASON_WEBHOOK_CA_BUNDLE_MISMATCH,
        ) && is(
            c,
            CONDITION_DEGRADED,
            "True",
            REASON_WEBHOOK_CA_BUNDLE_MISMATCH,
        ) && status_of(c, CONDITION_DEGRADED).is_some_and(|(_, _, m)| {
            m.contains("ValidatingWebhookConfiguration flatnet-webhook")
                && m.contains(
                    "subnets.flatnetwork.pandaria.io: none of its 1 CA certificates signed",
                )
        }) && is(
            c,
            CONDITION_PROGRESSING,
            "True",
            REASON_WEBHOOK_ENDPOINTS_NOT_READY,
        )
    })
    .await;

    // The bundle repaired: no endpoint ready yet.
    server.insert(&webhook_configuration("flatnet-webhook", &served.ca_bundle));
    reach("no ready endpoint", &server, |c| {
        is(
            c,
            CONDITION_AVAILABLE,
            "False",
            REASON_WEBHOOK_ENDPOINTS_NOT_READY,
        ) && is(c, CONDITION_DEGRADED, "False", REASON_AS_EXPECTED)
            && status_of(c, CONDITION_AVAILABLE).is_some_and(|(_, _, m)| {
                m.contains(&format!(
                    "the webhook Service {NS}/{WEBHOOK_SERVICE} has no ready endpoint"
                ))
            })
    })
    .await;

    server.insert(&endpoint_slice(NS, WEBHOOK_SERVICE, true));
    reach("available", &server, |c| {
        is(c, CONDITION_AVAILABLE, "True", REASON_ALL_SERVING)
            && is(c, CONDITION_PROGRESSING, "False", REASON_ROLLOUT_COMPLETE)
            && is(c, CONDITION_DEGRADED, "False", REASON_AS_EXPECTED)
    })
    .await;
    stop.cancel();
    task.await.expect("the controller ends on stop");
}

/// A report of `node` in subnet `lan`: each MAC of `claims` claimed an
/// address, seen at its time.
fn wire_report(node: &str, claims: &[(&str, Timestamp)]) -> FlatNetworkWireClaims {
    use flatnet_k8s::api::{FlatNetworkWireClaimsSpec, ForeignClaim};
    let mut report = FlatNetworkWireClaims::new(
        &FlatNetworkWireClaims::object_name("lan", node),
        FlatNetworkWireClaimsSpec {
            subnet: "lan".into(),
            node: node.into(),
            observed_at: Some(Time(Timestamp::now())),
            claims: claims
                .iter()
                .enumerate()
                .map(|(i, (mac, seen))| ForeignClaim {
                    ip: format!("192.0.2.{}", i + 9).parse().expect("an address"),
                    mac: (*mac).into(),
                    last_seen: Time(*seen),
                    kind: "arp_reply".into(),
                })
                .collect(),
        },
    );
    report.metadata.namespace = Some(SUBNET_NAMESPACE.into());
    report
}

#[test]
fn mac_range_shared_names_three_macs_with_node_and_time() {
    let range = MacRange::parse("02:aa:00:00:00:00", "02:aa:00:ff:ff:ff").expect("a range");
    let window = Duration::from_secs(3600);
    let none = mac_range_condition(None, &[], window, Some(4), at(NOW));
    assert_eq!(
        (none.status.as_str(), none.reason.as_str()),
        ("False", REASON_NO_MAC_RANGE)
    );
    let clear = mac_range_condition(Some(&range), &[], window, Some(4), at(NOW));
    assert_eq!(
        (clear.status.as_str(), clear.reason.as_str()),
        ("False", REASON_NO_FOREIGN_MACS)
    );
    assert!(clear.message.contains("3600s"), "{}", clear.message);
    let seen: Vec<LiveClaim> = (1..=5)
        .map(|i| LiveClaim {
            mac: format!("02:aa:00:00:00:0{i}"),
            last_seen: at(NOW - i),
            node: format!("node-{i}"),
        })
        .collect();
    let shared = mac_range_condition(Some(&range), &seen, window, Some(4), at(NOW));
    assert_eq!(
        (shared.status.as_str(), shared.reason.as_str()),
        ("True", REASON_FOREIGN_MACS_IN_RANGE)
    );
    assert_eq!(shared.observed_generation, Some(4));
    assert_eq!(shared.last_transition_time, Time(at(NOW)));
    for part in [
        "02:aa:00:00:00:01 (seen by node node-1 at ",
        "02:aa:00:00:00:03 (seen by node node-3 at ",
        &at(NOW - 2).to_string(),
        "and 2 more",
        "choose another range",
    ] {
        assert!(shared.message.contains(part), "{part}: {}", shared.message);
    }
    assert!(!shared.message.contains("02:aa:00:00:00:04"));
}

/// Whether `MacRangeShared` has `status` and `reason`.
fn range_shared(conditions: &[Condition], status: &str, reason: &str) -> bool {
    is(conditions, CONDITION_MAC_RANGE_SHARED, status, reason)
}

/// MACs of the recorded range that agents see on the LAN after it was
/// written turn `MacRangeShared` True, naming them with node and time,
/// and leave `Degraded` False; the condition clears by itself once the
/// sightings are older than the wire window.
#[tokio::test]
async fn foreign_macs_appearing_in_the_range_are_named_until_they_age_out() {
    let server = FakeApiServer::new();
    let mut config = FlatNetworkConfig::new(CONFIG_NAME, FlatNetworkConfigSpec::default());
    config.status = Some(flatnet_k8s::api::FlatNetworkConfigStatus {
        mac_pool: Some(MacPoolStatus {
            range_start: "02:aa:00:00:00:00".into(),
            range_end: "02:aa:00:ff:ff:ff".into(),
            generated: true,
        }),
        ..Default::default()
    });
    server.insert(&daemonset(2, 2, 2));
    // Short, so the sighting below leaves it during the test.
    let window = Duration::from_secs(3);
    let (stop, task) = spawn_controller_over(&server, &config, WebhookProbe::Disabled, window);
    let generation = server.list::<FlatNetworkConfig>()[0].metadata.generation;
    reach("the range clear", &server, |c| {
        range_shared(c, "False", REASON_NO_FOREIGN_MACS)
            && is(c, CONDITION_AVAILABLE, "True", REASON_ALL_SERVING)
    })
    .await;

    // A MAC of the range, and one outside it, seen now by node-2 (to
    // the second, as stored).
    let seen = Timestamp::from_second(Timestamp::now().as_second()).expect("a time");
    server.insert(&wire_report(
        "node-2",
        &[("02:aa:00:00:00:07", seen), ("02:bb:00:00:00:01", seen)],
    ));
    reach("the range shared", &server, |c| {
        range_shared(c, "True", REASON_FOREIGN_MACS_IN_RANGE)
            && is(c, CONDITION_DEGRADED, "False", REASON_AS_EXPECTED)
    })
    .await;
    let conditions = stored(&server);
    let shared = conditions
        .iter()
        .find(|c| c.type_ == CONDITION_MAC_RANGE_SHARED)
        .expect("the condition");
    assert_eq!(shared.observed_generation, generation);
    let named = format!("02:aa:00:00:00:07 (seen by node node-2 at {seen})");
    assert!(shared.message.contains(&named), "{}", shared.message);
    assert!(shared.message.contains("1 MAC(s)"), "{}", shared.message);
    assert!(
        !shared.message.contains("02:bb:00:00:00:01"),
        "{}",
        shared.message
    );

    // No further report: the sighting ages out of the window.
    reach("aged out", &server, |c| {
        range_shared(c, "False", REASON_NO_FOREIGN_MACS)
    })
    .await;
    stop.cancel();
    task.await.expect("the controller ends on stop");
}
