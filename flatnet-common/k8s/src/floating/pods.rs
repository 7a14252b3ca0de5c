//! Floating addresses of pods, the pure part: what a pod asks for (its
//! annotations), the addresses the operator gave it, and which pod of an
//! active/standby set holds them.
//!
//! A pod asks with `flatnetwork.pandaria.io/floating-ip-pool` (an address
//! of every family the pool has) or `flatnetwork.pandaria.io/floating-ip`
//! (fixed addresses). Pods of one namespace with the same
//! `flatnetwork.pandaria.io/floating-ip-set` share the addresses; the
//! operator writes them to every member's
//! `flatnetwork.pandaria.io/floating-ip-assigned`. Of the pods listing an
//! address, the [`active_pod`] holds it: the one ready the longest, so a
//! standby that becomes ready never takes the address from a ready active
//! pod, and the old active pod, ready again, stays the standby.

use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::{api::core::v1::Pod, jiff::Timestamp};

use super::{RequestError, annotation};

/// Label the operator puts (`"true"`) on every pod it gave floating
/// addresses to, beside [`annotation::ASSIGNED`], and removes with it: the
/// agents watch only the pods selected by [`ASSIGNED_SELECTOR`].
pub const ASSIGNED_LABEL: &str = annotation::ASSIGNED;

/// The label selector of the pods given floating addresses.
pub const ASSIGNED_SELECTOR: &str = "flatnetwork.pandaria.io/floating-ip-assigned=true";

/// Whether `pod` carries [`ASSIGNED_LABEL`].
pub fn is_labelled_assigned(pod: &Pod) -> bool {
    pod.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(ASSIGNED_LABEL))
        .is_some_and(|v| v == "true")
}

/// What a pod asks of the floating addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFloatingRequest {
    /// The pool named by annotation.
    pub pool: Option<String>,
    /// Fixed addresses.
    pub fixed: Vec<IpAddr>,
    /// The active/standby set, when the pod is in one.
    pub set: Option<String>,
}

/// The trimmed, non-empty value of `key` in `annotations`.
fn annotation_in<'a>(
    annotations: Option<&'a BTreeMap<String, String>>,
    key: &str,
) -> Option<&'a str> {
    annotations?
        .get(key)
        .map(|v| v.trim())
        .filter(|v| !v.is_empty())
}

/// The trimmed, non-empty value of `key` on `pod`.
fn annotation_of<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    annotation_in(pod.metadata.annotations.as_ref(), key)
}

/// A comma-separated list of addresses.
fn parse_list(value: &str) -> Option<Vec<IpAddr>> {
    value.split(',').map(|a| a.trim().parse().ok()).collect()
}

/// What `pod` asks for; `None` when it asks for no floating address.
///
/// # Errors
/// A fixed address that does not parse.
pub fn pod_request_of(pod: &Pod) -> Result<Option<PodFloatingRequest>, RequestError> {
    request_in(pod.metadata.annotations.as_ref())
}

/// What a pod with `annotations` asks for (a pod's, or a workload's pod
/// template's); `None` when it asks for no floating address.
///
/// # Errors
/// A fixed address that does not parse.
pub fn request_in(
    annotations: Option<&BTreeMap<String, String>>,
) -> Result<Option<PodFloatingRequest>, RequestError> {
    let pool = annotation_in(annotations, annotation::POOL).map(str::to_owned);
    let fixed = match annotation_in(annotations, annotation::ADDRESSES) {
        None => Vec::new(),
        Some(value) => parse_list(value).ok_or_else(|| RequestError::BadAddress {
            source_field: annotation::ADDRESSES,
            value: value.to_owned(),
        })?,
    };
    if pool.is_none() && fixed.is_empty() {
        return Ok(None);
    }
    Ok(Some(PodFloatingRequest {
        pool,
        fixed,
        set: annotation_in(annotations, annotation::SET).map(str::to_owned),
    }))
}

/// The floating addresses the operator gave `pod` (none when the
/// annotation is missing or does not parse: the operator rewrites it).
pub fn assigned_ips(pod: &Pod) -> Vec<IpAddr> {
    annotation_of(pod, annotation::ASSIGNED)
        .and_then(parse_list)
        .unwrap_or_default()
}

/// The annotation value listing `addrs`.
pub fn assigned_value(addrs: &[IpAddr]) -> String {
    addrs
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Since when `pod` is ready to hold its addresses: running on a node, not
/// being deleted, its `Ready` condition true (since its last transition).
pub fn ready_since(pod: &Pod) -> Option<Timestamp> {
    if pod.metadata.deletion_timestamp.is_some()
        || pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_ref())
            .is_none()
    {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Running") {
        return None;
    }
    let ready = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "Ready" && c.status == "True")?;
    Some(
        ready
            .last_transition_time
            .as_ref()
            .map_or(Timestamp::MAX, |t| t.0),
    )
}

/// What an observer knows of the agent on a pod's node, from the agents'
/// heartbeats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeAgent {
    /// Not known (not heard yet, or no heartbeats at all): the pod's
    /// readiness alone counts.
    Unknown,
    /// Heard, running since `since` (its incarnation): the node's pods
    /// count as ready from then at the earliest, so a pod whose agent
    /// restarted does not take an address back from the pod that took
    /// it over meanwhile.
    Alive {
        /// When the agent started.
        since: Timestamp,
    },
    /// Listed as a peer and silent past the heartbeat timeout: the node
    /// (or its agent) is gone, and its pods hold nothing, though the API
    /// still shows them ready.
    Dead,
}

/// The pod that holds an address among the pods listing it: the ready one
/// ready the longest, ties broken by namespace and name. The same for
/// every observer of the same pods, whatever their order.
pub fn active_pod<'a>(members: impl IntoIterator<Item = &'a Pod>) -> Option<&'a Pod> {
    active_pod_given(members, |_| NodeAgent::Unknown)
}

/// [`active_pod`] where `agent_of` tells what is known of the agent on a
/// node: a pod on a [`NodeAgent::Dead`] node is never active, and one on
/// an [`NodeAgent::Alive`] node counts as ready from the later of its
/// `Ready` transition and its agent's start. Observers that know the same
/// pods and agents pick the same pod.
pub fn active_pod_given<'a>(
    members: impl IntoIterator<Item = &'a Pod>,
    agent_of: impl Fn(&str) -> NodeAgent,
) -> Option<&'a Pod> {
    members
        .into_iter()
        .filter_map(|pod| {
            let ready = ready_since(pod)?;
            let node = pod.spec.as_ref()?.node_name.as_deref()?;
            let rank = match agent_of(node) {
                NodeAgent::Unknown => ready,
                NodeAgent::Alive { since } => ready.max(since),
                NodeAgent::Dead => return None,
            };
            Some((rank, pod))
        })
        .min_by(|(a, p), (b, q)| {
            (a, &p.metadata.namespace, &p.metadata.name).cmp(&(
                b,
                &q.metadata.namespace,
                &q.metadata.name,
            ))
        })
        .map(|(_, pod)| pod)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::{
        api::core::v1::{PodCondition, PodSpec, PodStatus},
        apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    };
    use proptest::prelude::*;

    use super::*;

    fn pod(name: &str, annotations: &[(&str, &str)]) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("telco".into()),
                annotations: Some(
                    annotations
                        .iter()
                        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                        .collect::<BTreeMap<_, _>>(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-a".into()),
                ..PodSpec::default()
            }),
            ..Pod::default()
        }
    }

    /// A running pod, ready since `since` seconds after the epoch, or not
    /// ready.
    fn running(name: &str, ready_since: Option<i64>) -> Pod {
        let mut p = pod(name, &[]);
        p.status = Some(PodStatus {
            phase: Some("Running".into()),
            conditions: Some(vec![PodCondition {
                type_: "Ready".into(),
                status: if ready_since.is_some() {
                    "True"
                } else {
                    "False"
                }
                .into(),
                last_transition_time: ready_since.map(|s| Time(Timestamp::from_second(s).unwrap())),
                ..PodCondition::default()
            }]),
            ..PodStatus::default()
        });
        p
    }

    #[test]
    fn a_pool_or_fixed_addresses_ask_and_nothing_else_does() {
        assert_eq!(pod_request_of(&pod("a", &[])).unwrap(), None);
        assert_eq!(
            pod_request_of(&pod("a", &[(annotation::SET, "pair")])).unwrap(),
            None
        );
        let asked = pod(
            "a",
            &[
                (annotation::POOL, " lan "),
                (annotation::SET, "pair"),
                (annotation::ADDRESSES, "10.0.0.5, fd00::5"),
            ],
        );
        assert_eq!(
            pod_request_of(&asked).unwrap(),
            Some(PodFloatingRequest {
                pool: Some("lan".into()),
                fixed: vec!["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()],
                set: Some("pair".into()),
            })
        );
    }

    #[test]
    fn the_selector_selects_the_label() {
        assert_eq!(ASSIGNED_SELECTOR, format!("{ASSIGNED_LABEL}=true"));
        let mut p = pod("a", &[]);
        assert!(!is_labelled_assigned(&p));
        p.metadata.labels = Some([(ASSIGNED_LABEL.to_owned(), "true".to_owned())].into());
        assert!(is_labelled_assigned(&p));
    }

    #[test]
    fn a_bad_fixed_address_is_named() {
        let error = pod_request_of(&pod("a", &[(annotation::ADDRESSES, "10.0.0.300")]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("flatnetwork.pandaria.io/floating-ip holds \"10.0.0.300\""));
    }

    #[test]
    fn assigned_addresses_round_trip_and_garbage_reads_as_none() {
        let addrs: Vec<IpAddr> = vec!["10.0.0.5".parse().unwrap(), "fd00::5".parse().unwrap()];
        let value = assigned_value(&addrs);
        assert_eq!(
            assigned_ips(&pod("a", &[(annotation::ASSIGNED, &value)])),
            addrs
        );
        assert!(assigned_ips(&pod("a", &[(annotation::ASSIGNED, "x")])).is_empty());
    }

    #[test]
    fn the_pod_ready_longest_is_active_and_unready_or_leaving_pods_never_are() {
        let active = running("b", Some(100));
        let standby = running("a", Some(200));
        let unready = running("c", None);
        assert_eq!(
            active_pod([&standby, &unready, &active]).and_then(|p| p.metadata.name.clone()),
            Some("b".into())
        );
        let mut leaving = active.clone();
        leaving.metadata.deletion_timestamp = Some(Time(Timestamp::from_second(300).unwrap()));
        assert_eq!(
            active_pod([&leaving, &standby]).and_then(|p| p.metadata.name.clone()),
            Some("a".into())
        );
        let mut pending = running("d", Some(1));
        pending.status.as_mut().unwrap().phase = Some("Pending".into());
        let mut unscheduled = running("e", Some(1));
        unscheduled.spec.as_mut().unwrap().node_name = None;
        assert_eq!(active_pod([&unready, &pending, &unscheduled]), None);
    }

    #[test]
    fn an_old_active_pod_ready_again_stays_the_standby() {
        // b was active, went unready at 300 and is ready again from 400;
        // a took over at 300 (ready since 200).
        let a = running("a", Some(200));
        let b = running("b", Some(400));
        assert_eq!(
            active_pod([&b, &a]).and_then(|p| p.metadata.name.clone()),
            Some("a".into())
        );
    }

    fn on_node(name: &str, node: &str, ready_since: Option<i64>) -> Pod {
        let mut p = running(name, ready_since);
        p.spec.as_mut().unwrap().node_name = Some(node.into());
        p
    }

    fn name_of(pod: Option<&Pod>) -> Option<String> {
        pod.and_then(|p| p.metadata.name.clone())
    }

    #[test]
    fn a_pod_on_a_dead_node_never_holds_and_a_restarted_agent_does_not_take_back() {
        let active = on_node("a", "n1", Some(100));
        let standby = on_node("b", "n2", Some(200));
        let n1 = |state: NodeAgent| {
            move |node: &str| {
                if node == "n1" {
                    state
                } else {
                    NodeAgent::Alive {
                        since: Timestamp::from_second(10).unwrap(),
                    }
                }
            }
        };
        // Heard, or not known: readiness decides.
        for state in [
            NodeAgent::Unknown,
            NodeAgent::Alive {
                since: Timestamp::from_second(50).unwrap(),
            },
        ] {
            assert_eq!(
                name_of(active_pod_given([&standby, &active], n1(state))),
                Some("a".into())
            );
        }
        // n1 silent: its pod, still Ready in the API, holds nothing.
        assert_eq!(
            name_of(active_pod_given([&active, &standby], n1(NodeAgent::Dead))),
            Some("b".into())
        );
        assert_eq!(active_pod_given([&active], n1(NodeAgent::Dead)), None);
        // n1's agent is back (started at 300, after b became ready): b
        // keeps the address.
        let back = NodeAgent::Alive {
            since: Timestamp::from_second(300).unwrap(),
        };
        assert_eq!(
            name_of(active_pod_given([&active, &standby], n1(back))),
            Some("b".into())
        );
    }

    proptest! {
        #[test]
        fn observers_knowing_the_same_agents_pick_the_same_pod_and_never_one_on_a_dead_node(
            pods in proptest::collection::vec((proptest::option::of(0i64..5), 0usize..3), 1..6),
            agents in proptest::collection::vec(0u8..3, 3),
            rotation in 0usize..6,
        ) {
            let pods: Vec<Pod> = pods
                .iter()
                .enumerate()
                .map(|(i, (r, node))| on_node(&format!("p{i}"), &format!("n{node}"), *r))
                .collect();
            let agent_of = |node: &str| {
                let index: usize = node[1..].parse().unwrap();
                match agents[index] {
                    0 => NodeAgent::Unknown,
                    1 => NodeAgent::Dead,
                    _ => NodeAgent::Alive { since: Timestamp::from_second(i64::try_from(index).unwrap() + 2).unwrap() },
                }
            };
            let mut seen: Vec<&Pod> = pods.iter().collect();
            let first = active_pod_given(seen.iter().copied(), agent_of).cloned();
            seen.rotate_left(rotation % pods.len());
            seen.reverse();
            let second = active_pod_given(seen.iter().copied(), agent_of).cloned();
            prop_assert_eq!(&first, &second);
            let holdable = |p: &Pod| {
                ready_since(p).is_some()
                    && agent_of(p.spec.as_ref().unwrap().node_name.as_deref().unwrap()) != NodeAgent::Dead
            };
            prop_assert_eq!(first.is_some(), pods.iter().any(holdable));
            if let Some(active) = first {
                prop_assert!(holdable(&active));
            }
        }

        #[test]
        fn every_observer_picks_the_same_active_pod(
            readiness in proptest::collection::vec(proptest::option::of(0i64..5), 1..6),
            rotation in 0usize..6,
        ) {
            let pods: Vec<Pod> = readiness
                .iter()
                .enumerate()
                .map(|(i, r)| running(&format!("p{i}"), *r))
                .collect();
            let mut seen: Vec<&Pod> = pods.iter().collect();
            let first = active_pod(seen.iter().copied()).cloned();
            seen.rotate_left(rotation % pods.len());
            seen.reverse();
            let second = active_pod(seen.iter().copied()).cloned();
            prop_assert_eq!(&first, &second);
            // Some pod is active exactly when some pod is ready.
            prop_assert_eq!(first.is_some(), readiness.iter().any(Option::is_some));
            if let Some(active) = first {
                let since = ready_since(&active).unwrap();
                prop_assert!(pods.iter().filter_map(ready_since).all(|s| since <= s));
            }
        }
    }
}
