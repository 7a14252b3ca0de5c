//! End-to-end test of the migrator against a real API server
//! (`FLATNET_E2E=1` and `KUBECONFIG`): backup, migrate and clean of a V1
//! subnet and a V1 Deployment. No kubelet or scheduler is needed.
//!
//! It installs the V1 CRD and flatnet's CRDs, and deletes what it created;
//! run it on a test cluster, since `migrate` and `clean` act cluster-wide.

mod e2e_support;

use e2e_support::cluster_configured;

use std::time::Duration;

use flatnet_k8s::api::{FlatNetworkIP, FlatNetworkSubnet};
use flatnet_operator::migrate::{backup, kinds, migration, v1};
use k8s_openapi::{
    api::{apps::v1::Deployment, core::v1::Namespace},
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, CustomResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::json;

const NS: &str = "flatnet-e2e-migrate";

async fn apply<K>(api: &Api<K>, name: &str, value: serde_json::Value)
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug + serde::Serialize,
{
    api.patch(
        name,
        &PatchParams::apply("flatnet-e2e").force(),
        &Patch::Apply(value),
    )
    .await
    .unwrap_or_else(|e| panic!("apply {name}: {e}"));
}

fn v1_crd() -> serde_json::Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": v1::SUBNET_CRD},
        "spec": {
            "group": v1::GROUP, "scope": "Namespaced",
            "names": {"plural": "macvlansubnets", "singular": "macvlansubnet", "kind": "MacvlanSubnet", "listKind": "MacvlanSubnetList"},
            "versions": [{"name": "v1", "served": true, "storage": true,
                          "subresources": {"status": {}},
                          "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}]
        }
    })
}

#[tokio::test]
async fn backup_migrate_and_clean_a_v1_cluster() {
    if !cluster_configured() {
        return;
    }
    let client = Client::try_default().await.expect("client from KUBECONFIG");
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    apply(&crds, v1::SUBNET_CRD, v1_crd()).await;
    for crd in [FlatNetworkSubnet::crd(), FlatNetworkIP::crd()] {
        let name = crd.metadata.name.clone().unwrap();
        apply(&crds, &name, serde_json::to_value(crd).unwrap()).await;
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for ns in [NS, "cattle-flat-network"] {
        apply(
            &namespaces,
            ns,
            json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}),
        )
        .await;
    }
    // The CRD serves once established.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let v1_subnets: Api<v1::MacvlanSubnet> = Api::namespaced(client.clone(), v1::SUBNET_NAMESPACE);
    let subnet: v1::MacvlanSubnet = serde_json::from_value(json!({
        "apiVersion": "macvlan.cluster.cattle.io/v1", "kind": "MacvlanSubnet",
        "metadata": {"name": "e2e-vlan10", "namespace": "kube-system"},
        "spec": {"master": "eth0", "vlan": 10, "cidr": "10.10.0.0/24", "mode": "bridge", "gateway": "10.10.0.1",
                 "ranges": [{"rangeStart": "10.10.0.100", "rangeEnd": "10.10.0.150"}],
                 "podDefaultGateway": {"enable": true}}
    }))
    .unwrap();
    v1_subnets
        .create(&PostParams::default(), &subnet)
        .await
        .expect("create the V1 subnet");

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NS);
    apply(&deployments, "web", json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}, "annotations": {
                     "macvlan.pandaria.cattle.io/ip": "auto", "macvlan.pandaria.cattle.io/subnet": "e2e-vlan10",
                     "k8s.v1.cni.cncf.io/networks": "[{\"name\":\"static-macvlan-cni-attach\",\"interface\":\"eth1\"}]"}},
                     "spec": {"containers": [{"name": "web", "image": "registry.invalid/web"}]}}}
    }))
    .await;

    let dir = tempfile::tempdir().unwrap();
    let saved = backup::backup(&client, &dir.path().join("b"), false)
        .await
        .expect("backup");
    assert!(
        saved >= 3,
        "CRD, subnet and deployment at least, got {saved}"
    );
    assert!(
        dir.path()
            .join("b/macvlansubnet/kube-system.e2e-vlan10.json")
            .exists()
    );

    let options = migration::Options {
        attachment: "rancher-flat-network".into(),
        workloads: kinds::WORKLOADS.to_vec(),
        services: true,
        accept_losses: true,
        dry_run: false,
    };
    migration::migrate(&client, &options)
        .await
        .expect("migrate");
    let v2: Api<FlatNetworkSubnet> = Api::namespaced(client.clone(), "cattle-flat-network");
    let migrated = v2.get("e2e-vlan10").await.expect("the V2 subnet exists");
    assert_eq!(
        (migrated.spec.master.as_str(), migrated.spec.vlan),
        ("eth0", 10)
    );
    assert!(migrated.spec.route_settings.flat_network_default_gateway);
    let web = deployments.get("web").await.unwrap();
    let annotations = web
        .spec
        .unwrap()
        .template
        .metadata
        .unwrap()
        .annotations
        .unwrap();
    assert_eq!(
        annotations
            .get("flatnetwork.pandaria.io/subnet")
            .map(String::as_str),
        Some("e2e-vlan10")
    );
    assert!(!annotations.keys().any(|k| k.starts_with("macvlan.")));

    migration::clean(&client, false)
        .await
        .expect("clean after a verified migration");
    assert!(
        v1_subnets
            .get_opt("e2e-vlan10")
            .await
            .map(|s| s.is_none())
            .unwrap_or(true)
    );

    let _ = v2.delete("e2e-vlan10", &DeleteParams::default()).await;
    let _ = namespaces.delete(NS, &DeleteParams::default()).await;
}
