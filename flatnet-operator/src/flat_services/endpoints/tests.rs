use k8s_openapi::api::core::v1::Service;
use kube::Resource;
use proptest::prelude::*;

use super::*;
use crate::fixtures::{PodExt, pod, service};
use flatnet_k8s::multus::decode_selected_ip;

const NAD: &str = "rancher-flat-network";

fn owner() -> OwnerReference {
    let flat = service("web-flat-network");
    flat.controller_owner_ref(&()).unwrap()
}

fn slices_of(svc: &Service, pods: &[Pod]) -> DesiredSlices {
    desired_slices(svc, "web-flat-network", &owner(), pods, NAD)
}

fn addresses(slice: &EndpointSlice) -> Vec<String> {
    slice
        .endpoints
        .iter()
        .map(|e| e.addresses[0].clone())
        .collect()
}

#[test]
fn flat_pod_needs_both_annotations_non_empty() {
    assert!(is_flat_pod(&pod("a").flat()));
    assert!(!is_flat_pod(&pod("a")));
    assert!(!is_flat_pod(&pod("a").annotated(annotation::IP, "auto")));
    assert!(!is_flat_pod(
        &pod("a")
            .annotated(annotation::IP, "auto")
            .annotated(annotation::SUBNET, " ")
    ));
}

#[test]
fn network_status_entry_is_found_by_attachment_name_in_any_namespace() {
    let p = pod("a").with_flat_ips(&["192.168.1.10"]);
    assert_eq!(
        flat_addresses(&p, NAD),
        FlatAddresses::Found(vec!["192.168.1.10".parse().unwrap()])
    );
    let bare = pod("a").annotated(
        annotation::MULTUS_NETWORK_STATUS,
        r#"[{"name":"rancher-flat-network","ips":["fd00::5"]}]"#,
    );
    assert_eq!(
        flat_addresses(&bare, NAD),
        FlatAddresses::Found(vec!["fd00::5".parse().unwrap()])
    );
    let other_ns = pod("a").annotated(
        annotation::MULTUS_NETWORK_STATUS,
        r#"[{"name":"kube-system/rancher-flat-network","ips":["192.168.1.11"]}]"#,
    );
    assert!(matches!(
        flat_addresses(&other_ns, NAD),
        FlatAddresses::Found(_)
    ));
}

#[test]
fn network_status_without_the_attachment_is_not_yet() {
    let p = pod("a").annotated(
        annotation::MULTUS_NETWORK_STATUS,
        r#"[{"name":"cbr0","ips":["10.42.0.7"],"default":true}]"#,
    );
    assert_eq!(flat_addresses(&p, NAD), FlatAddresses::NotYet);
    let no_ips = pod("a").annotated(
        annotation::MULTUS_NETWORK_STATUS,
        r#"[{"name":"shop/rancher-flat-network"}]"#,
    );
    assert_eq!(flat_addresses(&no_ips, NAD), FlatAddresses::NotYet);
    // A similar but different name is another attachment.
    let similar = pod("a").annotated(
        annotation::MULTUS_NETWORK_STATUS,
        r#"[{"name":"shop/rancher-flat-network2","ips":["1.2.3.4"]}]"#,
    );
    assert_eq!(flat_addresses(&similar, NAD), FlatAddresses::NotYet);
}

#[test]
fn malformed_network_status_is_invalid_not_an_error() {
    for bad in ["", "{", r#"{"name":"x"}"#, r#"[{"ips":["1.2.3.4"]}]"#] {
        let p = pod("a").annotated(annotation::MULTUS_NETWORK_STATUS, bad);
        assert!(
            matches!(flat_addresses(&p, NAD), FlatAddresses::Invalid(_)),
            "{bad:?}"
        );
    }
    let bad_ip = pod("a").annotated(
        annotation::MULTUS_NETWORK_STATUS,
        r#"[{"name":"rancher-flat-network","ips":["10.0.0.300"]}]"#,
    );
    let FlatAddresses::Invalid(reason) = flat_addresses(&bad_ip, NAD) else {
        panic!("an unparsable address must be reported");
    };
    assert!(reason.contains("10.0.0.300"), "{reason}");
}

#[test]
fn selected_ip_label_is_the_fallback_only_without_network_status() {
    let mut p = pod("a");
    p.metadata
        .labels
        .as_mut()
        .unwrap()
        .insert(label::SELECTED_IP.into(), "fd00.1..5".into());
    assert_eq!(
        flat_addresses(&p, NAD),
        FlatAddresses::Found(vec!["fd00:1::5".parse().unwrap()])
    );
    let with_status = p.annotated(annotation::MULTUS_NETWORK_STATUS, "[]");
    assert_eq!(flat_addresses(&with_status, NAD), FlatAddresses::NotYet);
    assert_eq!(
        decode_selected_ip("192.168.1.4"),
        Some("192.168.1.4".parse().unwrap())
    );
    assert_eq!(decode_selected_ip("not-an-ip"), None);
}

#[test]
fn conditions_follow_readiness_and_termination() {
    let c = conditions(&pod("a"), false);
    assert_eq!(
        (c.ready, c.serving, c.terminating),
        (Some(true), Some(true), Some(false))
    );
    let c = conditions(&pod("a").not_ready(), false);
    assert_eq!(
        (c.ready, c.serving, c.terminating),
        (Some(false), Some(false), Some(false))
    );
    let c = conditions(&pod("a").terminating(), false);
    assert_eq!(
        (c.ready, c.serving, c.terminating),
        (Some(false), Some(true), Some(true))
    );
    let c = conditions(&pod("a").not_ready().terminating(), false);
    assert_eq!(
        (c.ready, c.serving, c.terminating),
        (Some(false), Some(false), Some(true))
    );
    let c = conditions(&pod("a").not_ready(), true);
    assert_eq!(
        (c.ready, c.serving, c.terminating),
        (Some(true), Some(true), Some(false))
    );
}

#[test]
fn target_ports_resolve_by_number_or_container_port_name() {
    let svc = service("web");
    let ports = svc.spec.as_ref().unwrap().ports.as_ref().unwrap();
    assert_eq!(resolve_target_port(&pod("a"), &ports[0]), Some(8080));
    assert_eq!(resolve_target_port(&pod("a"), &ports[1]), Some(9100));
    let mut udp = ports[0].clone();
    udp.protocol = Some("UDP".into());
    assert_eq!(resolve_target_port(&pod("a"), &udp), None);
    let mut unset = ports[0].clone();
    unset.target_port = None;
    assert_eq!(resolve_target_port(&pod("a"), &unset), Some(80));
}

#[test]
fn one_slice_per_family_with_the_flat_addresses() {
    let pods = [
        pod("b").flat().with_flat_ips(&["192.168.1.11"]),
        pod("a")
            .flat()
            .with_flat_ips(&["192.168.1.10", "2002:c0a8:10a::"]),
        pod("c").flat().with_flat_ips(&["fd00::c"]),
    ];
    let desired = slices_of(&service("web"), &pods);
    assert!(desired.skipped.is_empty());
    let [v4, v6] = desired.slices.as_slice() else {
        panic!("expected two slices, got {:?}", desired.slices);
    };
    assert_eq!(v4.address_type, "IPv4");
    assert_eq!(addresses(v4), ["192.168.1.10", "192.168.1.11"]);
    assert_eq!(v6.address_type, "IPv6");
    assert_eq!(addresses(v6), ["2002:c0a8:10a::", "fd00::c"]);
    let name = v4.metadata.name.as_deref().unwrap();
    assert!(name.starts_with("web-flat-network-ipv4-"), "{name}");
    let labels = v4.metadata.labels.as_ref().unwrap();
    assert_eq!(
        labels[label::ENDPOINTSLICE_SERVICE_NAME],
        "web-flat-network"
    );
    assert_eq!(
        labels[label::ENDPOINTSLICE_MANAGED_BY],
        "flatnet.pandaria.io"
    );
    assert_eq!(
        v4.metadata.owner_references.as_ref().unwrap()[0].name,
        "web-flat-network"
    );
    let ports = v4.ports.as_ref().unwrap();
    assert_eq!(
        ports
            .iter()
            .map(|p| (p.name.as_deref().unwrap(), p.port.unwrap()))
            .collect::<Vec<_>>(),
        [("http", 8080), ("metrics", 9100)]
    );
    let ep = &v4.endpoints[0];
    assert_eq!(ep.node_name.as_deref(), Some("node-1"));
    let target = ep.target_ref.as_ref().unwrap();
    assert_eq!(
        (
            target.kind.as_deref(),
            target.name.as_deref(),
            target.uid.as_deref()
        ),
        (Some("Pod"), Some("a"), Some("uid-a"))
    );
}

#[test]
fn pods_without_address_finished_or_not_flat_are_left_out() {
    let mut done = pod("done").flat().with_flat_ips(&["192.168.1.12"]);
    done.status.as_mut().unwrap().phase = Some("Succeeded".into());
    let pods = [
        pod("pending").flat(),
        pod("plain").with_flat_ips(&["192.168.1.13"]),
        done,
        pod("broken")
            .flat()
            .annotated(annotation::MULTUS_NETWORK_STATUS, "{oops"),
        pod("ok").flat().with_flat_ips(&["192.168.1.10"]),
    ];
    let desired = slices_of(&service("web"), &pods);
    assert_eq!(desired.slices.len(), 1);
    assert_eq!(addresses(&desired.slices[0]), ["192.168.1.10"]);
    assert_eq!(desired.skipped.len(), 1);
    assert_eq!(desired.skipped[0].pod, "broken");
}

#[test]
fn no_flat_addresses_means_no_slices() {
    let desired = slices_of(&service("web"), &[pod("pending").flat()]);
    assert!(desired.slices.is_empty());
}

#[test]
fn hostname_is_set_for_pods_whose_subdomain_is_the_service() {
    let mut sts = pod("db-0").flat().with_flat_ips(&["192.168.1.20"]);
    let spec = sts.spec.as_mut().unwrap();
    spec.hostname = Some("db-0".into());
    spec.subdomain = Some("web".into());
    let mut other = pod("db-1").flat().with_flat_ips(&["192.168.1.21"]);
    let spec = other.spec.as_mut().unwrap();
    spec.hostname = Some("db-1".into());
    spec.subdomain = Some("elsewhere".into());
    let desired = slices_of(&service("web"), &[sts, other]);
    let eps = &desired.slices[0].endpoints;
    assert_eq!(eps[0].hostname.as_deref(), Some("db-0"));
    assert_eq!(eps[1].hostname, None);
}

#[test]
fn pods_resolving_different_ports_get_separate_slices() {
    let mut renamed = pod("b").flat().with_flat_ips(&["192.168.1.11"]);
    renamed.spec.as_mut().unwrap().containers[0]
        .ports
        .as_mut()
        .unwrap()[0]
        .container_port = 8081;
    let pods = [pod("a").flat().with_flat_ips(&["192.168.1.10"]), renamed];
    let desired = slices_of(&service("web"), &pods);
    assert_eq!(desired.slices.len(), 2);
    assert!(
        desired
            .slices
            .iter()
            .all(|s| s.endpoints.len() == 1 && s.address_type == "IPv4")
    );
}

#[test]
fn large_services_are_split_at_the_slice_limit() {
    let pods: Vec<Pod> = (0..=MAX_ENDPOINTS_PER_SLICE)
        .map(|i| {
            let ip = format!("10.1.{}.{}", i / 250, i % 250 + 1);
            pod(&format!("p{i:04}"))
                .flat()
                .with_flat_ips(&[ip.as_str()])
        })
        .collect();
    let desired = slices_of(&service("web"), &pods);
    assert_eq!(desired.slices.len(), 2);
    assert_eq!(desired.slices[0].endpoints.len(), MAX_ENDPOINTS_PER_SLICE);
    assert_eq!(desired.slices[1].endpoints.len(), 1);
    let first = desired.slices[0].metadata.name.clone().unwrap();
    assert_eq!(
        desired.slices[1].metadata.name.clone().unwrap(),
        format!("{first}-1")
    );
}

proptest! {
    #[test]
    fn every_flat_address_lands_in_the_slice_of_its_family(ips in proptest::collection::vec(any::<IpAddr>(), 1..20)) {
        let pods: Vec<Pod> = ips
            .iter()
            .enumerate()
            .map(|(i, ip)| pod(&format!("p{i}")).flat().with_flat_ips(&[ip.to_string().as_str()]))
            .collect();
        let desired = slices_of(&service("web"), &pods);
        let mut seen = 0;
        for slice in &desired.slices {
            for ep in &slice.endpoints {
                let addr: IpAddr = ep.addresses[0].parse().unwrap();
                prop_assert_eq!(Family::of(addr).address_type(), slice.address_type.as_str());
                seen += 1;
            }
        }
        prop_assert_eq!(seen, ips.len());
    }

    #[test]
    fn arbitrary_network_status_text_never_panics(text in ".*") {
        let p = pod("a").annotated(annotation::MULTUS_NETWORK_STATUS, &text);
        let _ = flat_addresses(&p, NAD);
    }
}
