//! Which pod holds each floating address, as every agent computes it.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc};

use flatnet_k8s::{
    api::{FloatingIPPool, FloatingIPPoolSpec},
    floating::annotation,
};
use k8s_openapi::{
    api::core::v1::{Pod, PodCondition, PodSpec, PodStatus},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    jiff::Timestamp,
};

use super::*;

fn ip(text: &str) -> IpAddr {
    text.parse().unwrap()
}

fn pool(name: &str, cidrs: &[&str], interface: &str) -> Arc<FloatingIPPool> {
    Arc::new(FloatingIPPool::new(
        name,
        FloatingIPPoolSpec {
            cidrs: cidrs.iter().map(|c| (*c).to_owned()).collect(),
            target_network_interface: interface.into(),
            ..FloatingIPPoolSpec::default()
        },
    ))
}

/// Pod `name` on `node` listing `assigned`, ready since `ready_since`
/// seconds after the epoch (or not ready).
fn pod(name: &str, node: &str, assigned: &str, ready_since: Option<i64>) -> Arc<Pod> {
    Arc::new(Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("telco".into()),
            uid: Some(format!("uid-{name}")),
            annotations: Some(BTreeMap::from([(
                annotation::ASSIGNED.to_owned(),
                assigned.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            ..PodSpec::default()
        }),
        status: Some(PodStatus {
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
        }),
    })
}

#[test]
fn the_active_pod_of_each_address_holds_it_on_the_pools_interface() {
    let pools = [
        pool("lan", &["10.9.0.0/24", "fd00:9::/64"], "eth0"),
        pool("broken", &["10.8.0.0/24"], "not an interface!"),
    ];
    let pods = [
        pod("active", "node-a", "10.9.0.5,fd00:9::5", Some(100)),
        pod("standby", "node-b", "10.9.0.5,fd00:9::5", Some(200)),
        pod("alone-unready", "node-b", "10.9.0.6", None),
        pod("invalid-pool", "node-a", "10.8.0.5", Some(1)),
        pod("no-pool", "node-a", "10.7.0.5", Some(1)),
    ];
    let view = view_of(&pods, &pools, |_| NodeAgent::Unknown);
    assert_eq!(
        view.holders.keys().copied().collect::<Vec<_>>(),
        [ip("10.9.0.5"), ip("10.9.0.6"), ip("fd00:9::5")]
    );
    let holder = view.holders[&ip("10.9.0.5")].clone().unwrap();
    assert_eq!(holder.pod_key(), "telco/active");
    assert_eq!(holder.pod.uid.as_deref(), Some("uid-active"));
    assert_eq!(holder.node, "node-a");
    assert_eq!(holder.interface, "eth0");
    assert_eq!(holder.prefix_len, 24);
    assert_eq!(
        view.holders[&ip("fd00:9::5")].as_ref().unwrap().prefix_len,
        64
    );
    assert_eq!(view.holders[&ip("10.9.0.6")], None);
    assert_eq!(
        view.listed.iter().map(String::as_str).collect::<Vec<_>>(),
        ["telco/active", "telco/alone-unready", "telco/standby"]
    );
}

#[test]
fn the_standby_takes_over_when_the_active_pod_is_not_ready_and_keeps_it() {
    let pools = [pool("lan", &["10.9.0.0/24"], "eth0")];
    let holder_of = |pods: &[Arc<Pod>]| {
        view_of(pods, &pools, |_| NodeAgent::Unknown).holders[&ip("10.9.0.5")]
            .as_ref()
            .map(Holder::pod_key)
    };
    let standby = pod("b", "node-b", "10.9.0.5", Some(200));
    assert_eq!(
        holder_of(&[pod("a", "node-a", "10.9.0.5", Some(100)), standby.clone()]),
        Some("telco/a".into())
    );
    assert_eq!(
        holder_of(&[pod("a", "node-a", "10.9.0.5", None), standby.clone()]),
        Some("telco/b".into())
    );
    // a is ready again, since later than b: b keeps the address.
    assert_eq!(
        holder_of(&[pod("a", "node-a", "10.9.0.5", Some(300)), standby]),
        Some("telco/b".into())
    );
}
