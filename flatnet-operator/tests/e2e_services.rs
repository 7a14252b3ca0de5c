//! End-to-end test of the flat-network Service controller against a real
//! API server (`FLATNET_E2E=1` and `KUBECONFIG`).
//!
//! No kubelet or scheduler is needed: pods use a scheduler that does not
//! exist, so they stay unbound, and the test writes their Multus
//! network-status annotation and Ready status itself, as the CNI and the
//! kubelet would. The controller runs in this process.

mod e2e_support;

use e2e_support::{Converge, cluster_configured};

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use flatnet_operator::{admin::Health, flat_services, metrics::Metrics};
use k8s_openapi::api::{
    core::v1::{Namespace, Pod, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// How long the test waits for the controller to converge before failing.
const CONVERGE: Converge = Converge {
    within: Duration::from_secs(60),
    poll: Duration::from_millis(500),
};

fn pod_manifest(name: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"app": "web"},
            "annotations": {
                "flatnetwork.pandaria.io/ip": "auto",
                "flatnetwork.pandaria.io/subnet": "e2e-net",
                "k8s.v1.cni.cncf.io/networks": "[{\"name\":\"rancher-flat-network\",\"interface\":\"eth1\"}]"
            }
        },
        "spec": {
            "schedulerName": "flatnet-e2e-no-scheduler",
            "containers": [{
                "name": "web",
                "image": "registry.k8s.io/pause:3.9",
                "ports": [{"name": "web", "containerPort": 8080}]
            }]
        }
    }))
    .expect("pod manifest")
}

/// Writes what Multus and the kubelet would: the flat address and readiness.
async fn attach(pods: &Api<Pod>, name: &str, ns: &str, ip: &str) {
    let status =
        json!([{"name": format!("{ns}/rancher-flat-network"), "interface": "eth1", "ips": [ip]}]);
    let patch = json!({"metadata": {"annotations": {"k8s.v1.cni.cncf.io/network-status": status.to_string()}}});
    pods.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("annotate pod");
    let status = json!({"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("set pod status");
}

async fn flat_addresses(slices: &Api<EndpointSlice>) -> Vec<String> {
    let list = slices
        .list(&ListParams::default().labels("kubernetes.io/service-name=web-flat-network"))
        .await
        .expect("list slices");
    let mut addrs: Vec<String> = list
        .items
        .iter()
        .flat_map(|s| s.endpoints.iter().map(|e| e.addresses[0].clone()))
        .collect();
    addrs.sort();
    addrs
}

#[tokio::test]
async fn flat_service_and_slices_follow_the_pods() {
    if !cluster_configured() {
        return;
    }
    let client = Client::try_default().await.expect("client from KUBECONFIG");
    let ns_name = format!("flatnet-e2e-{}", std::process::id());
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let namespace: Namespace =
        serde_json::from_value(json!({"metadata": {"name": ns_name}})).unwrap();
    namespaces
        .create(&PostParams::default(), &namespace)
        .await
        .expect("create namespace");

    let stop = CancellationToken::new();
    let ctx = Arc::new(flat_services::Context {
        client: client.clone(),
        metrics: Arc::new(Metrics::new()),
        attachment: "rancher-flat-network".into(),
        resync: Duration::from_secs(600),
    });
    let controller = tokio::spawn(flat_services::run(
        ctx,
        2,
        Arc::new(Health::default()),
        stop.clone(),
    ));

    let svcs: Api<Service> = Api::namespaced(client.clone(), &ns_name);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns_name);
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), &ns_name);
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "web"}]}
    }))
    .unwrap();
    svcs.create(&PostParams::default(), &service)
        .await
        .expect("create service");
    for name in ["web-0", "web-1"] {
        pods.create(&PostParams::default(), &pod_manifest(name))
            .await
            .expect("create pod");
    }

    // Flat pods without addresses yet: the flat Service appears, headless and selector-less.
    let flat = CONVERGE
        .eventually("the flat Service", || async {
            svcs.get_opt("web-flat-network").await.unwrap()
        })
        .await;
    let spec = flat.spec.expect("spec");
    assert_eq!(spec.cluster_ip.as_deref(), Some("None"));
    assert_eq!(spec.selector.unwrap_or_default(), BTreeMap::new());

    attach(&pods, "web-0", &ns_name, "192.0.2.10").await;
    attach(&pods, "web-1", &ns_name, "192.0.2.11").await;
    CONVERGE
        .eventually("both flat addresses in the slices", || async {
            (flat_addresses(&slices).await == ["192.0.2.10", "192.0.2.11"]).then_some(())
        })
        .await;

    pods.delete("web-1", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete pod");
    CONVERGE
        .eventually("the deleted pod to leave the slices", || async {
            (flat_addresses(&slices).await == ["192.0.2.10"]).then_some(())
        })
        .await;

    let opt_out = json!({"metadata": {"annotations": {"flatnetwork.pandaria.io/flatNetworkService": "disabled"}}});
    pods.patch("web-0", &PatchParams::default(), &Patch::Merge(&opt_out))
        .await
        .expect("opt out");
    CONVERGE
        .eventually("the flat Service to be deleted", || async {
            svcs.get_opt("web-flat-network")
                .await
                .unwrap()
                .is_none()
                .then_some(())
        })
        .await;

    stop.cancel();
    controller.await.expect("controller task");
    namespaces
        .delete(&ns_name, &DeleteParams::default())
        .await
        .expect("delete namespace");
}
