//! End-to-end test of the admission webhook through a real API server
//! (`FLATNET_E2E=1` and `KUBECONFIG`).
//!
//! The operator runs in this process in dev mode with `--webhook-url`, so the
//! API server must reach this machine at that URL:
//! `FLATNET_E2E_WEBHOOK_URL`, default `https://127.0.0.1:8443/validate` (an
//! API server on the same host). The operator creates its CA, registers the
//! webhook with that URL and the CA bundle, and the test sends bad objects
//! through the API server and reads the denials. No kubelet or scheduler is
//! needed. Everything created is removed at the end.

mod e2e_support;

use e2e_support::cluster_configured;

use std::time::Duration;

use flatnet_k8s::api::{FlatNetworkIP, FlatNetworkSubnet};
use flatnet_operator::{config::Cli, runtime};
use k8s_openapi::{
    api::{
        admissionregistration::v1::ValidatingWebhookConfiguration,
        apps::v1::Deployment,
        batch::v1::CronJob,
        core::v1::{Namespace, Pod, Secret},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, CustomResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde::{Serialize, de::DeserializeOwned};
use serde_json::{Value, json};

/// How long the test waits for the webhook to come up before failing.
const READY_WITHIN: Duration = Duration::from_secs(90);
const SUBNET_NS: &str = "cattle-flat-network";

fn webhook_url() -> String {
    std::env::var("FLATNET_E2E_WEBHOOK_URL")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "https://127.0.0.1:8443/validate".into())
}

fn port_of(url: &str) -> String {
    url.trim_start_matches("https://")
        .split('/')
        .next()
        .and_then(|authority| authority.rsplit_once(':'))
        .map_or_else(|| "443".into(), |(_, port)| port.to_owned())
}

/// Creates `value` as a `K`; returns the API server's error message when refused.
async fn try_create<K>(api: &Api<K>, value: Value) -> Result<(), String>
where
    K: kube::Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    let object: K = serde_json::from_value(value).expect("manifest");
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(status)) => Err(status.message),
        Err(other) => panic!("create failed without an API status: {other}"),
    }
}

async fn expect_denied<K>(api: &Api<K>, value: Value, fragment: &str)
where
    K: kube::Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    let name = value["metadata"]["name"].clone();
    let message = try_create(api, value)
        .await
        .expect_err(&format!("{name} must be denied"));
    assert!(message.contains("denied the request"), "{name}: {message}");
    assert!(
        message.contains(fragment),
        "{name}: {message:?} lacks {fragment:?}"
    );
}

fn subnet(name: &str, spec: Value) -> Value {
    json!({"apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
           "metadata": {"name": name, "namespace": SUBNET_NS}, "spec": spec})
}

fn flat_pod(name: &str, subnet: &str, ip: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "annotations": {
               "flatnetwork.pandaria.io/subnet": subnet, "flatnetwork.pandaria.io/ip": ip}},
           "spec": {"schedulerName": "flatnet-e2e-no-scheduler",
                    "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.9"}]}})
}

async fn ensure_crds(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in [FlatNetworkSubnet::crd(), FlatNetworkIP::crd()] {
        let name = crd.metadata.name.clone().unwrap_or_default();
        crds.patch(
            &name,
            &PatchParams::apply("flatnet-e2e").force(),
            &Patch::Apply(&crd),
        )
        .await
        .expect("apply CRD");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
}

#[tokio::test]
async fn the_webhook_denies_bad_objects_through_the_api_server() {
    if !cluster_configured() {
        return;
    }
    let client = Client::try_default().await.expect("client from KUBECONFIG");
    ensure_crds(&client).await;
    let id = std::process::id();
    let ns_name = format!("flatnet-e2e-webhook-{id}");
    let namespaces: Api<Namespace> = Api::all(client.clone());
    for name in [ns_name.as_str(), SUBNET_NS] {
        if namespaces
            .get_opt(name)
            .await
            .expect("read namespace")
            .is_none()
        {
            try_create(&namespaces, json!({"metadata": {"name": name}}))
                .await
                .expect("create namespace");
        }
    }

    // A configuration left by an interrupted run points at the same URL with
    // another CA: every call through it would fail certificate verification.
    let configurations: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    for stale in configurations
        .list(&Default::default())
        .await
        .expect("list webhook configurations")
    {
        let name = stale.metadata.name.unwrap_or_default();
        if name.starts_with("flatnet-e2e-") {
            configurations
                .delete(&name, &DeleteParams::default())
                .await
                .expect("delete a stale webhook configuration");
        }
    }

    // The operator, without leader election, serving and registering its webhook.
    let url = webhook_url();
    let configuration = format!("flatnet-e2e-{id}");
    let secret = format!("flatnet-e2e-certs-{id}");
    let cli = <Cli as clap::Parser>::try_parse_from([
        "flatnet-operator",
        "--leader-election=false",
        "--admin-address=127.0.0.1:0",
        "--bind-address=0.0.0.0",
        &format!("--port={}", port_of(&url)),
        &format!("--webhook-url={url}"),
        &format!("--webhook-config={configuration}"),
        &format!("--webhook-secret={secret}"),
        &format!("--lease-namespace={ns_name}"),
    ])
    .expect("operator arguments");
    let operator = tokio::spawn(runtime::run(cli.into_config().expect("configuration")));

    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(client.clone(), SUBNET_NS);
    let net = format!("e2e-{id}");
    let base = json!({"flatMode": "macvlan", "master": "eth0", "vlan": 3001, "cidr": "192.0.2.0/24",
                      "gateway": "192.0.2.1", "ranges": [{"from": "192.0.2.100", "to": "192.0.2.150"}]});

    // Wait until the API server reaches the webhook: a bad subnet is denied by it.
    let deadline = tokio::time::Instant::now() + READY_WITHIN;
    loop {
        let bad = subnet(
            &format!("{net}-gw"),
            json!({"flatMode": "macvlan", "master": "eth0", "vlan": 3001,
                                                       "cidr": "192.0.2.0/24", "gateway": "198.51.100.1"}),
        );
        match try_create(&subnets, bad).await {
            Err(message) if message.contains("denied the request") => break,
            Ok(()) => {
                let _ = subnets
                    .delete(&format!("{net}-gw"), &DeleteParams::default())
                    .await;
            }
            Err(_) => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the webhook never answered at {url}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    try_create(&subnets, subnet(&net, base.clone()))
        .await
        .expect("a valid subnet is admitted");
    expect_denied(
        &subnets,
        subnet(
            &format!("{net}-flag"),
            json!({"flatMode": "macvlan", "master": "eth0",
        "cidr": "198.51.100.0/24", "ipvlanFlag": "private"}),
        ),
        "spec.ipvlanFlag",
    )
    .await;
    expect_denied(
        &subnets,
        subnet(
            &format!("{net}-overlap"),
            json!({"flatMode": "macvlan", "master": "eth0",
        "vlan": 3001, "cidr": "192.0.2.0/25"}),
        ),
        &format!("overlaps subnet {net}"),
    )
    .await;
    expect_denied(
        &subnets,
        subnet(
            &format!("{net}-mixed"),
            json!({"flatMode": "ipvlan", "master": "eth0",
        "vlan": 3001, "cidr": "198.51.100.0/24"}),
        ),
        "cannot mix macvlan and ipvlan",
    )
    .await;

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns_name);
    expect_denied(
        &pods,
        flat_pod("outside", &net, "192.0.2.20"),
        "outside spec.ranges",
    )
    .await;
    expect_denied(
        &pods,
        flat_pod("unknown", "no-such-subnet", "auto"),
        "does not exist",
    )
    .await;
    expect_denied(
        &pods,
        flat_pod("syntax", &net, "192.0.2.300"),
        "is not an IP address",
    )
    .await;
    try_create(&pods, flat_pod("fine", &net, "192.0.2.101"))
        .await
        .expect("a good pod is admitted");

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns_name);
    expect_denied(
        &deployments,
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
        "spec": {"selector": {"matchLabels": {"app": "web"}}, "template": {
            "metadata": {"labels": {"app": "web"}, "annotations": {
                "flatnetwork.pandaria.io/subnet": net, "flatnetwork.pandaria.io/ip": "192.0.2.1"}},
            "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.9"}]}}}}),
        "the gateway",
    )
    .await;
    let cronjobs: Api<CronJob> = Api::namespaced(client.clone(), &ns_name);
    expect_denied(&cronjobs, json!({"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": "nightly"},
        "spec": {"schedule": "@daily", "jobTemplate": {"spec": {"template": {
            "metadata": {"annotations": {"flatnetwork.pandaria.io/subnet": net, "flatnetwork.pandaria.io/ip": "auto",
                                         "flatnetwork.pandaria.io/mac": "aa-bb-cc-dd-ee-ff"}},
            "spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.9"}]}}}}}}),
        "flatnetwork.pandaria.io/mac").await;

    // A subnet in use cannot be deleted: the operator records the admitted
    // pod's address, and that record holds the subnet.
    let records: Api<FlatNetworkIP> = Api::namespaced(client.clone(), &ns_name);
    let deadline = tokio::time::Instant::now() + READY_WITHIN;
    while records
        .get_opt("fine")
        .await
        .expect("read record")
        .is_none()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the operator never recorded pod fine's address"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let message = match subnets.delete(&net, &DeleteParams::default()).await {
        Err(kube::Error::Api(status)) => status.message,
        other => panic!("deleting a subnet in use must be denied, got {other:?}"),
    };
    assert!(
        message.contains("is still used by 1 FlatNetworkIP"),
        "{message}"
    );

    // Clean up: the pod first, so its record and then the subnet may go.
    pods.delete("fine", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete pod");
    let deadline = tokio::time::Instant::now() + READY_WITHIN;
    while records
        .get_opt("fine")
        .await
        .expect("read record")
        .is_some()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "pod fine's record outlived the pod"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    subnets
        .delete(&net, &DeleteParams::default())
        .await
        .expect("delete subnet");
    operator.abort();
    configurations
        .delete(&configuration, &DeleteParams::default())
        .await
        .expect("delete webhook configuration");
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns_name);
    let _ = secrets.delete(&secret, &DeleteParams::default()).await;
    namespaces
        .delete(&ns_name, &DeleteParams::default())
        .await
        .expect("delete namespace");
}
