//! Unit and property tests of the floating-address logic.

use std::{collections::BTreeSet, net::IpAddr};

use k8s_openapi::api::core::v1::{Service, ServicePort as K8sPort, ServiceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use proptest::prelude::*;

use super::*;
use crate::api::IpRange;

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn pool_spec(cidrs: &[&str], interface: &str) -> FloatingIPPoolSpec {
    FloatingIPPoolSpec {
        cidrs: cidrs.iter().map(|c| (*c).to_owned()).collect(),
        target_network_interface: interface.into(),
        ..FloatingIPPoolSpec::default()
    }
}

#[test]
fn a_dual_stack_pool_on_a_vlan_validates_into_one_network_per_family() {
    let mut spec = pool_spec(&["fd00:10::/120", "192.168.10.0/24"], "eth0.100");
    spec.ranges = vec![IpRange::new(ip("192.168.10.200"), ip("192.168.10.210"))];
    let valid = validate_pool("lan", &spec).unwrap();
    assert_eq!(
        valid.parent,
        ParentLink {
            master: "eth0".into(),
            vlan: 100
        }
    );
    assert_eq!(valid.networks[0].cidr.family(), Family::V4, "IPv4 first");
    assert_eq!(valid.pool(Family::V4).unwrap().total(), 11);
    // /120 without ranges: the network address is never handed out.
    assert_eq!(valid.pool(Family::V6).unwrap().total(), 255);
    assert_eq!(
        valid.network_of(ip("192.168.10.7")).unwrap().cidr.family(),
        Family::V4
    );
}

#[test]
fn bad_pools_report_every_problem_with_the_field() {
    let mut spec = pool_spec(&["10.0.0.0/24", "10.1.0.0/24"], "eth0.5000");
    spec.ranges = vec![IpRange::new(ip("fd00::1"), ip("fd00::2"))];
    let error = validate_pool("bad", &spec).unwrap_err();
    let text = error.to_string();
    assert!(text.starts_with("FloatingIPPool bad is invalid"), "{text}");
    assert!(
        text.contains("spec.targetNetworkInterface \"eth0.5000\""),
        "{text}"
    );
    assert!(text.contains("spec.cidrs"), "{text}");
    assert!(text.contains("spec.ranges[0]"), "{text}");
    let outside = FloatingIPPoolSpec {
        ranges: vec![IpRange::new(ip("10.9.0.1"), ip("10.9.0.2"))],
        ..pool_spec(&["10.0.0.0/24"], "eth0")
    };
    let text = validate_pool("outside", &outside).unwrap_err().to_string();
    assert!(text.contains("10.0.0.0/24: spec.ranges[0]"), "{text}");
    assert!(validate_pool("none", &pool_spec(&[], "eth0")).is_err());
    assert!(validate_pool("garbage", &pool_spec(&["10.0.0.0/33"], "eth0")).is_err());
}

#[test]
fn selectors_that_cannot_be_evaluated_are_refused() {
    // Found by the floating_pool fuzz target: admitted, then no node could
    // own the pool's addresses and no namespace could use it.
    let selector = |operator: &str| {
        serde_json::from_value(serde_json::json!({
            "matchLabels": {"edge": "true"},
            "matchExpressions": [{"key": "team", "operator": operator, "values": ["shop"]}]
        }))
        .unwrap()
    };
    let mut spec = pool_spec(&["192.0.2.0/24"], "eth0.100");
    spec.node_selector = Some(selector("Within"));
    spec.namespace_selector = Some(selector(""));
    let text = validate_pool("edge", &spec).unwrap_err().to_string();
    assert!(
        text.contains(
            "spec.nodeSelector: unknown label selector operator \"Within\" on key \"team\""
        ),
        "{text}"
    );
    assert!(
        text.contains("spec.namespaceSelector: unknown label selector operator \"\""),
        "{text}"
    );
    spec.node_selector = Some(selector("In"));
    spec.namespace_selector = Some(selector("NotIn"));
    assert!(validate_pool("edge", &spec).is_ok());
}

#[test]
fn interface_names_follow_the_parent_link_rules() {
    assert_eq!(parse_interface("bond0").unwrap().vlan, 0);
    assert_eq!(parse_interface("eth1.4094").unwrap().vlan, 4094);
    for bad in ["", "eth0.0", "eth0.x", "a-very-long-interface.1", "eth0/1"] {
        assert!(parse_interface(bad).is_err(), "{bad:?} accepted");
    }
}

#[test]
fn overlapping_pools_are_detected() {
    let a = validate_pool("a", &pool_spec(&["10.0.0.0/24"], "eth0")).unwrap();
    let b = validate_pool("b", &pool_spec(&["10.0.0.128/25"], "eth1")).unwrap();
    let c = validate_pool("c", &pool_spec(&["10.0.1.0/24", "fd00::/64"], "eth0")).unwrap();
    assert!(a.overlaps(&b) && b.overlaps(&a));
    assert!(!a.overlaps(&c));
}

#[test]
fn quota_scope_needs_exactly_one_target() {
    let spec = |project: &str, namespace: &str| FloatingIPProjectQuotaSpec {
        project: project.into(),
        namespace: namespace.into(),
        ..FloatingIPProjectQuotaSpec::default()
    };
    assert_eq!(
        quota_scope("q", &spec("p-1", "")),
        Ok(QuotaScope::Project("p-1".into()))
    );
    assert_eq!(
        quota_scope("q", &spec("", "team")),
        Ok(QuotaScope::Namespace("team".into()))
    );
    assert!(quota_scope("q", &spec("p-1", "team")).is_err());
    assert!(quota_scope("q", &spec("", " ")).is_err());
}

fn service(annotations: &[(&str, &str)], spec: ServiceSpec) -> Service {
    Service {
        metadata: ObjectMeta {
            name: Some("web".into()),
            namespace: Some("team".into()),
            annotations: Some(
                annotations
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    }
}

fn lb(class: Option<&str>) -> ServiceSpec {
    ServiceSpec {
        type_: Some("LoadBalancer".into()),
        load_balancer_class: class.map(Into::into),
        ports: Some(vec![K8sPort {
            port: 80,
            ..K8sPort::default()
        }]),
        ..ServiceSpec::default()
    }
}

#[test]
fn class_filter_takes_flatnets_class_and_classless_only_when_opted_in() {
    assert!(wants_floating(
        &service(&[], lb(Some(LOAD_BALANCER_CLASS))),
        false
    ));
    assert!(!wants_floating(&service(&[], lb(Some("metallb"))), true));
    assert!(!wants_floating(&service(&[], lb(None)), false));
    assert!(wants_floating(&service(&[], lb(None)), true));
    let cluster_ip = ServiceSpec {
        type_: Some("ClusterIP".into()),
        ..lb(Some(LOAD_BALANCER_CLASS))
    };
    assert!(!wants_floating(&service(&[], cluster_ip), true));
}

#[test]
fn requests_read_pool_fixed_addresses_families_and_sharing() {
    let mut spec = lb(Some(LOAD_BALANCER_CLASS));
    spec.ip_families = Some(vec!["IPv6".into(), "IPv4".into()]);
    spec.load_balancer_ip = Some("192.168.10.9".into());
    let request = request_of(&service(
        &[(annotation::POOL, "lan"), (annotation::SHARING_KEY, "web")],
        spec.clone(),
    ))
    .unwrap();
    assert_eq!(request.pool.as_deref(), Some("lan"));
    assert_eq!(request.fixed, vec![ip("192.168.10.9")]);
    assert_eq!(request.families, vec![Family::V6, Family::V4]);
    assert_eq!(request.sharing_key.as_deref(), Some("web"));
    assert_eq!(
        request.ports,
        vec![ServicePort {
            protocol: "TCP".into(),
            port: 80
        }]
    );
    // The annotation wins over the field and may name both families.
    let both = request_of(&service(
        &[(annotation::ADDRESSES, "10.0.0.1, fd00::1")],
        spec,
    ))
    .unwrap();
    assert_eq!(both.fixed, vec![ip("10.0.0.1"), ip("fd00::1")]);
    let bad = request_of(&service(&[(annotation::ADDRESSES, "10.0.0.300")], lb(None)));
    assert!(bad.unwrap_err().to_string().contains(annotation::ADDRESSES));
    // No ipFamilies and a fixed IPv6 address: the address's family.
    let mut v6 = lb(None);
    v6.load_balancer_ip = Some("fd00::7".into());
    assert_eq!(
        request_of(&service(&[], v6)).unwrap().families,
        vec![Family::V6]
    );
}

#[test]
fn ports_clash_on_the_same_protocol_and_number_only() {
    let port = |protocol: &str, port| ServicePort {
        protocol: protocol.into(),
        port,
    };
    let web = [port("TCP", 80), port("TCP", 443)];
    assert_eq!(clashing_port(&web, &[port("UDP", 443)]), None);
    assert_eq!(
        clashing_port(&web, &[port("TCP", 443)]),
        Some(&port("TCP", 443))
    );
}

#[test]
fn quota_usage_counts_shared_addresses_once_per_pool_in_scope() {
    let shared = [ip("10.0.0.1")];
    let two = [ip("10.0.0.1"), ip("10.0.0.2")];
    let other = [ip("10.0.0.3")];
    let holders: Vec<(&str, Option<&str>, &[IpAddr])> = vec![
        ("a", Some("c-1:p-1"), &shared),
        ("b", Some("p-1"), &two),
        ("c", Some("p-2"), &other),
    ];
    let pool_of = |_: IpAddr| Some("lan".to_owned());
    let used = quota_usage(&QuotaScope::Project("p-1".into()), holders.clone(), pool_of);
    assert_eq!(used.get("lan"), Some(&2));
    let used = quota_usage(&QuotaScope::Namespace("c".into()), holders, pool_of);
    assert_eq!(used.get("lan"), Some(&1));
}

proptest! {
    /// Every agent computes the same owner whatever order it lists the
    /// candidates in, and removing a node that does not own an address
    /// never moves it.
    #[test]
    fn owner_choice_is_order_free_and_stable(
        addr in any::<u32>(),
        nodes in prop::collection::btree_set("[a-z]{1,8}", 1..8),
        removed in any::<prop::sample::Index>(),
    ) {
        let addr = IpAddr::from(addr.to_be_bytes());
        let forward: Vec<&str> = nodes.iter().map(String::as_str).collect();
        let backward: Vec<&str> = forward.iter().rev().copied().collect();
        let owner = choose_owner(addr, forward.iter().copied()).unwrap();
        prop_assert_eq!(Some(owner), choose_owner(addr, backward.iter().copied()));
        let gone = forward[removed.index(forward.len())];
        let rest: Vec<&str> = forward.iter().copied().filter(|n| *n != gone).collect();
        let after = choose_owner(addr, rest.iter().copied());
        if gone == owner {
            prop_assert!(after != Some(owner));
        } else {
            prop_assert_eq!(after, Some(owner));
        }
    }
}

#[test]
fn owners_spread_over_nodes() {
    let nodes = ["node-a", "node-b", "node-c"];
    let owners: BTreeSet<&str> = (1..=60u8)
        .filter_map(|i| choose_owner(IpAddr::from([10, 0, 0, i]), nodes))
        .collect();
    assert_eq!(owners.len(), 3, "60 addresses all land on {owners:?}");
}
