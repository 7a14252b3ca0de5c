//! Who may serve which floating address, from API objects.

use serde_json::{Value, json};

use super::*;

fn node(name: &str, zone: &str, ip: &str) -> Arc<Node> {
    Arc::new(
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"zone": zone}},
            "status": {"addresses": [
                {"type": "Hostname", "address": name},
                {"type": "InternalIP", "address": ip}
            ]}
        }))
        .unwrap(),
    )
}

fn pool(name: &str, cidr: &str, interface: &str, zone: Option<&str>) -> Arc<FloatingIPPool> {
    let mut pool = json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPPool",
        "metadata": {"name": name},
        "spec": {"cidrs": [cidr], "targetNetworkInterface": interface}
    });
    if let Some(zone) = zone {
        pool["spec"]["nodeSelector"] = json!({"matchLabels": {"zone": zone}});
    }
    Arc::new(serde_json::from_value(pool).unwrap())
}

fn service(name: &str, class: Option<&str>, policy: &str, ingress: &[&str]) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}")},
        "spec": {"type": "LoadBalancer", "loadBalancerClass": class,
                 "externalTrafficPolicy": policy},
        "status": {"loadBalancer": {"ingress":
            ingress.iter().map(|ip| json!({"ip": ip})).collect::<Vec<_>>()}}
    })
}

fn typed(value: Value) -> Arc<Service> {
    Arc::new(serde_json::from_value(value).unwrap())
}

const CLASS: Option<&str> = Some(flatnet_k8s::floating::LOAD_BALANCER_CLASS);

fn slice(service: &str, node: &str, ready: Option<bool>) -> Arc<EndpointSlice> {
    Arc::new(
        serde_json::from_value(json!({
            "metadata": {"name": format!("{service}-x"), "namespace": "shop",
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.1.0.5"], "nodeName": node,
                           "conditions": {"ready": ready}}]
        }))
        .unwrap(),
    )
}

fn view(
    me: &str,
    pools: &[Arc<FloatingIPPool>],
    services: &[Arc<Service>],
    slices: &[Arc<EndpointSlice>],
    classless: bool,
) -> View {
    view_with_pods(me, pools, services, slices, classless, &BTreeSet::new())
}

fn view_with_pods(
    me: &str,
    pools: &[Arc<FloatingIPPool>],
    services: &[Arc<Service>],
    slices: &[Arc<EndpointSlice>],
    classless: bool,
    pod_nodes: &BTreeSet<String>,
) -> View {
    let nodes = [
        node("a", "east", "10.0.0.1"),
        node("b", "east", "10.0.0.2"),
        node("c", "west", "10.0.0.3"),
    ];
    view_of(&Objects {
        node: me,
        nodes: &nodes,
        pools,
        services,
        slices,
        classless,
        port: 7946,
        pod_nodes,
    })
}

fn addr(text: &str) -> IpAddr {
    text.parse().unwrap()
}

#[test]
fn an_allocated_address_is_served_on_its_pools_interface_with_the_pools_nodes_as_peers() {
    let pools = [pool("lan", "192.168.50.0/24", "eth0.50", Some("east"))];
    let services = [typed(service("web", CLASS, "Cluster", &["192.168.50.10"]))];
    let a = view("a", &pools, &services, &[], false);
    assert_eq!(
        a.assignment.addresses,
        [(addr("192.168.50.10"), "eth0.50".to_owned())].into()
    );
    // c is outside the pool's nodeSelector: never told, never a candidate.
    assert_eq!(
        a.assignment.peers,
        vec![SocketAddr::new(addr("10.0.0.2"), 7946)]
    );
    assert_eq!(
        a.holders[&addr("192.168.50.10")][0].name.as_deref(),
        Some("web")
    );
    let c = view("c", &pools, &services, &[], false);
    assert!(c.assignment.addresses.is_empty(), "{c:?}");
    assert_eq!(c.holders.len(), 1, "c still knows who holds the address");
    assert!(
        view("unknown-node", &pools, &services, &[], false)
            .assignment
            .addresses
            .is_empty()
    );
}

#[test]
fn the_nodes_of_pods_holding_floating_addresses_are_peers_too() {
    let pools = [pool("lan", "192.168.50.0/24", "eth0", Some("east"))];
    let services = [typed(service("web", CLASS, "Cluster", &["192.168.50.10"]))];
    let pod_nodes: BTreeSet<String> = ["c".to_owned(), "a".to_owned()].into();
    // c runs a pod with a floating address: heard though outside the
    // Service pool's nodeSelector; never a candidate for the Service's.
    let a = view_with_pods("a", &pools, &services, &[], false, &pod_nodes);
    assert_eq!(
        a.assignment.peers,
        vec![
            SocketAddr::new(addr("10.0.0.2"), 7946),
            SocketAddr::new(addr("10.0.0.3"), 7946)
        ]
    );
    let c = view_with_pods("c", &pools, &[], &[], false, &pod_nodes);
    assert!(c.assignment.addresses.is_empty());
    assert_eq!(
        c.assignment.peers,
        vec![SocketAddr::new(addr("10.0.0.1"), 7946)]
    );
}

#[test]
fn local_policy_needs_a_ready_endpoint_on_the_node() {
    let pools = [pool("lan", "192.168.50.0/24", "eth0", None)];
    let services = [typed(service("web", CLASS, "Local", &["192.168.50.10"]))];
    let on_b = [slice("web", "b", None)];
    assert!(
        view("a", &pools, &services, &on_b, false)
            .assignment
            .addresses
            .is_empty()
    );
    assert_eq!(
        view("b", &pools, &services, &on_b, false)
            .assignment
            .addresses
            .len(),
        1
    );
    let not_ready = [slice("web", "b", Some(false))];
    assert!(
        view("b", &pools, &services, &not_ready, false)
            .assignment
            .addresses
            .is_empty()
    );
    let other_service = [slice("api", "b", Some(true))];
    assert!(
        view("b", &pools, &services, &other_service, false)
            .assignment
            .addresses
            .is_empty()
    );
}

#[test]
fn a_shared_address_needs_every_holder_servable() {
    let pools = [pool("lan", "192.168.50.0/24", "eth0", None)];
    let services = [
        typed(service("web", CLASS, "Cluster", &["192.168.50.10"])),
        typed(service("api", CLASS, "Local", &["192.168.50.10"])),
    ];
    let on_b = [slice("api", "b", None)];
    assert!(
        view("a", &pools, &services, &on_b, false)
            .assignment
            .addresses
            .is_empty()
    );
    let b = view("b", &pools, &services, &on_b, false);
    assert_eq!(b.assignment.addresses.len(), 1);
    assert_eq!(b.holders[&addr("192.168.50.10")].len(), 2);
}

#[test]
fn other_classes_addresses_outside_pools_and_invalid_pools_are_ignored() {
    let pools = [
        pool("lan", "192.168.50.0/24", "eth0", None),
        pool("broken", "192.168.60.0/24", "not an interface!", None),
    ];
    let services = [
        typed(service(
            "other",
            Some("example.com/lb"),
            "Cluster",
            &["192.168.50.11"],
        )),
        typed(service("classless", None, "Cluster", &["192.168.50.12"])),
        typed(service("outside", CLASS, "Cluster", &["10.9.9.9"])),
        typed(service("broken", CLASS, "Cluster", &["192.168.60.5"])),
    ];
    let strict = view("a", &pools, &services, &[], false);
    assert!(strict.assignment.addresses.is_empty(), "{strict:?}");
    assert!(
        strict.assignment.peers.is_empty(),
        "no pool in use: nobody to tell"
    );
    let classless = view("a", &pools, &services, &[], true);
    assert_eq!(
        classless
            .assignment
            .addresses
            .keys()
            .copied()
            .collect::<Vec<_>>(),
        vec![addr("192.168.50.12")]
    );
}

#[test]
fn a_deleting_service_is_not_served() {
    let pools = [pool("lan", "192.168.50.0/24", "eth0", None)];
    let mut deleting = service("web", CLASS, "Cluster", &["192.168.50.10"]);
    deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    let v = view("a", &pools, &[typed(deleting)], &[], false);
    assert!(v.assignment.addresses.is_empty());
}
