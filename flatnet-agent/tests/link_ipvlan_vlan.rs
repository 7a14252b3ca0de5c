//! ipvlan pod interfaces and 802.1Q VLAN parents on the real kernel (root
//! only). Kernels without ipvlan or 802.1Q support make these tests print
//! why they skip; whether support exists is found by trying.

mod link_common;
mod support;

use flatnet_agent::link::{
    DetachSpec, IpvlanFlag, IpvlanMode, LinkError, LinkMode, VLAN_ALIAS, parse_mac,
};
use link_common::{LAN_V4, Lan, has_link, ping};
use support::{TestNetns, privileged};

/// Whether `err` says the kernel lacks the feature; prints the skip line.
fn skipped_for_lack(test: &str, err: &LinkError, feature: &str) -> bool {
    if let LinkError::Unsupported { .. } = err {
        support::skip_for_missing_kernel_feature(test, feature);
        return true;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipvlan_modes_and_flags_attach_check_detach() {
    const TEST: &str = "ipvlan_modes_and_flags_attach_check_detach";
    if !privileged(TEST) {
        return;
    }
    let lan = Lan::new();
    let attachments = lan.attachments();
    let cases = [
        (IpvlanMode::L2, IpvlanFlag::Bridge),
        (IpvlanMode::L2, IpvlanFlag::Private),
        (IpvlanMode::L3, IpvlanFlag::Bridge),
        (IpvlanMode::L3s, IpvlanFlag::Vepa),
    ];
    for (i, (mode, flag)) in cases.into_iter().enumerate() {
        let pod = TestNetns::new("flp-");
        let mut spec = lan.spec(&pod, &[&format!("192.0.2.{}/24", 80 + i)]);
        spec.kind = LinkMode::Ipvlan(mode, flag);
        let attachment = match attachments.attach(&spec).await {
            Ok(attachment) => attachment,
            Err(err) if skipped_for_lack(TEST, &err, "ipvlan") => {
                assert!(!has_link(&pod, "eth1"), "nothing left behind");
                return;
            }
            Err(err) => panic!("attach {mode} {flag}: {err}"),
        };
        // ipvlan children share the parent's MAC.
        let master = lan.node.ip(&["link", "show", "dev", &lan.master]);
        let mac = flatnet_agent::link::format_mac(attachment.mac);
        assert!(master.contains(&mac), "{mac} not the master's: {master}");
        let details = pod.ip(&["-d", "link", "show", "dev", "eth1"]);
        assert!(
            details.contains(&format!("ipvlan  mode {mode}"))
                || details.contains(&format!("ipvlan mode {mode}")),
            "{details}"
        );
        attachments.check(&spec).await.unwrap();

        // CHECK tells a wrong flag apart.
        let mut other = spec.clone();
        let other_flag = if flag == IpvlanFlag::Bridge {
            IpvlanFlag::Private
        } else {
            IpvlanFlag::Bridge
        };
        other.kind = LinkMode::Ipvlan(mode, other_flag);
        let err = attachments.check(&other).await.unwrap_err();
        assert!(err.to_string().contains("ipvlan flag"), "{err}");

        if mode == IpvlanMode::L2 {
            ping(&pod, LAN_V4);
        }
        let detach = DetachSpec::from(&spec);
        attachments.detach(&detach).await.unwrap();
        assert!(!has_link(&pod, "eth1"));
        attachments.detach(&detach).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipvlan_with_a_mac_is_refused_before_any_change() {
    if !privileged("ipvlan_with_a_mac_is_refused_before_any_change") {
        return;
    }
    let lan = Lan::new();
    let pod = TestNetns::new("flp-");
    let mut spec = lan.spec(&pod, &["192.0.2.90/24"]);
    spec.kind = LinkMode::Ipvlan(IpvlanMode::L2, IpvlanFlag::Bridge);
    spec.mac = parse_mac("02:00:5e:10:00:90");
    let err = lan.attachments().attach(&spec).await.unwrap_err();
    assert!(
        matches!(err, LinkError::InvalidSpec { field: "mac", .. }),
        "{err}"
    );
    assert!(!has_link(&pod, "eth1"));
}

/// The LAN host side of VLAN `id`: `lan0.<id>` carrying the gateway address.
fn lan_vlan(lan: &Lan, id: u16) {
    let name = format!("lan0.{id}");
    lan.lan.ip(&["addr", "flush", "dev", "lan0"]);
    lan.lan.ip(&[
        "link",
        "add",
        "link",
        "lan0",
        "name",
        &name,
        "type",
        "vlan",
        "id",
        &id.to_string(),
    ]);
    lan.lan.ip(&["link", "set", &name, "up"]);
    lan.lan
        .ip(&["addr", "add", &format!("{LAN_V4}/24"), "dev", &name]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vlan_interface_is_created_shared_and_removed_with_its_last_pod() {
    const TEST: &str = "vlan_interface_is_created_shared_and_removed_with_its_last_pod";
    if !privileged(TEST) {
        return;
    }
    let lan = Lan::new();
    let attachments = lan.attachments();
    let vlan_name = format!("{}.100", lan.master);
    let a = TestNetns::new("flp-");
    let b = TestNetns::new("flp-");
    let mut spec_a = lan.spec(&a, &["192.0.2.100/24"]);
    spec_a.parent.vlan = 100;
    let mut spec_b = lan.spec(&b, &["192.0.2.101/24"]);
    spec_b.parent.vlan = 100;

    let attachment = match attachments.attach(&spec_a).await {
        Ok(attachment) => attachment,
        Err(err) if skipped_for_lack(TEST, &err, "802.1Q VLAN") => {
            assert!(!has_link(&lan.node, &vlan_name), "nothing left behind");
            return;
        }
        Err(err) => panic!("attach on VLAN: {err}"),
    };
    assert_eq!(attachment.parent, vlan_name);
    let details = lan.node.ip(&["-d", "link", "show", "dev", &vlan_name]);
    assert!(details.contains("vlan protocol 802.1Q id 100"), "{details}");
    assert!(
        details.contains(&format!("alias {VLAN_ALIAS}")),
        "{details}"
    );
    assert!(details.contains(",UP"), "{details}");
    attachments.attach(&spec_b).await.unwrap();
    attachments.check(&spec_a).await.unwrap();

    lan_vlan(&lan, 100);
    ping(&a, LAN_V4);
    ping(&b, "192.0.2.100");

    attachments
        .detach(&DetachSpec::from(&spec_a))
        .await
        .unwrap();
    assert!(
        has_link(&lan.node, &vlan_name),
        "still used by the second pod"
    );
    attachments
        .detach(&DetachSpec::from(&spec_b))
        .await
        .unwrap();
    assert!(
        !has_link(&lan.node, &vlan_name),
        "removed with its last pod"
    );
    attachments
        .detach(&DetachSpec::from(&spec_b))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vlan_interface_made_by_the_admin_is_kept() {
    const TEST: &str = "vlan_interface_made_by_the_admin_is_kept";
    if !privileged(TEST) {
        return;
    }
    let lan = Lan::new();
    let vlan_name = format!("{}.200", lan.master);
    let made = std::process::Command::new("ip")
        .args([
            "-n",
            &lan.node.name,
            "link",
            "add",
            "link",
            &lan.master,
            "name",
            &vlan_name,
        ])
        .args(["type", "vlan", "id", "200"])
        .output()
        .unwrap();
    if !made.status.success() {
        let stderr = String::from_utf8_lossy(&made.stderr);
        assert!(
            stderr.contains("Unknown device type"),
            "ip link add vlan failed: {stderr}"
        );
        support::skip_for_missing_kernel_feature(TEST, "802.1Q VLAN");
        return;
    }
    let attachments = lan.attachments();
    let pod = TestNetns::new("flp-");
    let mut spec = lan.spec(&pod, &["192.0.2.110/24"]);
    spec.parent.vlan = 200;
    attachments.attach(&spec).await.unwrap();
    let details = lan.node.ip(&["-d", "link", "show", "dev", &vlan_name]);
    assert!(details.contains(",UP"), "set up for the pod: {details}");
    assert!(!details.contains(VLAN_ALIAS), "not claimed: {details}");
    attachments.detach(&DetachSpec::from(&spec)).await.unwrap();
    assert!(has_link(&lan.node, &vlan_name), "the admin's VLAN stays");
}
