//! End-to-end test of the allocation controllers against a real API server
//! (`FLATNET_E2E=1` and `KUBECONFIG`; the cluster's controller manager must
//! run, for garbage collection and the StatefulSet).
//!
//! No kubelet or scheduler is needed: pods name a scheduler that does not
//! exist and stay unbound. The controllers run in this process; the test
//! installs the CRDs when they are missing.

mod e2e_support;

use e2e_support::{Converge, cluster_configured};

use std::{collections::BTreeSet, net::IpAddr, sync::Arc, time::Duration};

use flatnet_k8s::{
    api::{FlatNetworkIP, FlatNetworkSubnet},
    ipam::used_ranges,
    keys::SUBNET_NAMESPACE,
};
use flatnet_operator::{admin::Health, allocation, metrics::Metrics};
use k8s_openapi::{
    api::{
        apps::v1::StatefulSet,
        core::v1::{Namespace, Pod},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, CustomResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// How long the test waits for the controllers to converge before failing.
const CONVERGE: Converge = Converge {
    within: Duration::from_secs(180),
    poll: Duration::from_secs(1),
};
const PODS: usize = 200;

async fn ensure_namespace(client: &Client, name: &str) {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
    match namespaces.create(&PostParams::default(), &ns).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(error) => panic!("create namespace {name}: {error}"),
    }
}

async fn install_crds(client: &Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let apply = PatchParams::apply("flatnet-e2e").force();
    for crd in [FlatNetworkSubnet::crd(), FlatNetworkIP::crd()] {
        let name = crd.metadata.name.clone().unwrap();
        crds.patch(&name, &apply, &Patch::Apply(&crd))
            .await
            .expect("apply CRD");
    }
    // The API serves the kinds a moment after the CRDs are accepted.
    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(client.clone(), SUBNET_NAMESPACE);
    CONVERGE
        .eventually("the CRDs to be served", || async {
            subnets.list(&ListParams::default()).await.ok().map(|_| ())
        })
        .await;
}

fn pod_template(subnet: &str) -> serde_json::Value {
    json!({
        "annotations": {
            "flatnetwork.pandaria.io/ip": "auto",
            "flatnetwork.pandaria.io/subnet": subnet,
            "k8s.v1.cni.cncf.io/networks": "[{\"name\":\"rancher-flat-network\",\"interface\":\"eth1\"}]"
        },
    })
}

fn pod_spec() -> serde_json::Value {
    json!({
        "schedulerName": "flatnet-e2e-no-scheduler",
        "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.9"}]
    })
}

async fn addresses(records: &Api<FlatNetworkIP>) -> Vec<(String, IpAddr)> {
    records
        .list(&ListParams::default())
        .await
        .expect("list FlatNetworkIPs")
        .items
        .into_iter()
        .filter_map(|r| Some((r.metadata.name.clone()?, r.status?.addr?)))
        .collect()
}

/// One test at a time: each runs the allocation controllers of a whole
/// cluster, and two sets at once would be two operators without an election.
static ONE_OPERATOR: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A namespace, a subnet and the controllers running in this process.
struct Setup {
    client: Client,
    ns: String,
    subnet_name: String,
    subnets: Api<FlatNetworkSubnet>,
    pods: Api<Pod>,
    records: Api<FlatNetworkIP>,
    stop: CancellationToken,
    controllers: tokio::task::JoinHandle<()>,
    _only_operator: tokio::sync::MutexGuard<'static, ()>,
}

/// Installs what is missing, creates namespace `ns-<suite>-<pid>` and an
/// Active subnet of `cidr` with gateway `gateway`, and starts the
/// controllers; `None` without a cluster.
async fn setup(suite: &str, cidr: &str, gateway: &str) -> Option<Setup> {
    if !cluster_configured() {
        return None;
    }
    let only_operator = ONE_OPERATOR.lock().await;
    let client = Client::try_default().await.expect("client from KUBECONFIG");
    install_crds(&client).await;
    ensure_namespace(&client, SUBNET_NAMESPACE).await;
    let ns = format!("flatnet-e2e-{suite}-{}", std::process::id());
    ensure_namespace(&client, &ns).await;
    let subnet_name = format!("e2e-{suite}-{}", std::process::id());
    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(client.clone(), SUBNET_NAMESPACE);
    let subnet: FlatNetworkSubnet = serde_json::from_value(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
        "metadata": {"name": subnet_name},
        "spec": {"flatMode": "macvlan", "master": "eth9", "vlan": 3999,
                 "cidr": cidr, "gateway": gateway}
    }))
    .unwrap();
    subnets
        .create(&PostParams::default(), &subnet)
        .await
        .expect("create subnet");

    let stop = CancellationToken::new();
    let controllers = tokio::spawn(allocation::run(
        client.clone(),
        Arc::new(Metrics::new()),
        allocation::Settings::default(),
        5,
        allocation::mac_pool::MacPoolView::default(),
        Arc::new(Health::default()),
        stop.clone(),
    ));

    let active = CONVERGE
        .eventually("the subnet to be Active", || async {
            let s = subnets.get(&subnet_name).await.ok()?;
            (s.status.as_ref()?.phase == "Active").then_some(s)
        })
        .await;
    assert_eq!(active.metadata.labels.unwrap()["master"], "eth9");
    Some(Setup {
        pods: Api::namespaced(client.clone(), &ns),
        records: Api::namespaced(client.clone(), &ns),
        client,
        ns,
        subnet_name,
        subnets,
        stop,
        controllers,
        _only_operator: only_operator,
    })
}

impl Setup {
    /// Creates pods `p<i>` for every `i` of `range`.
    async fn create_pods(&self, range: std::ops::Range<usize>) {
        for i in range {
            let pod: Pod = serde_json::from_value(json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": format!("p{i}"), "annotations": pod_template(&self.subnet_name)["annotations"]},
                "spec": pod_spec(),
            }))
            .unwrap();
            self.pods
                .create(&PostParams::default(), &pod)
                .await
                .expect("create pod");
        }
    }

    /// Deletes pods `p<i>` for every `i` of `range`.
    async fn delete_pods(&self, range: std::ops::Range<usize>) {
        for i in range {
            self.pods
                .delete(&format!("p{i}"), &DeleteParams::default().grace_period(0))
                .await
                .expect("delete pod");
        }
    }

    /// Waits until `n` records hold an address and the ledger names
    /// exactly theirs and the gateway.
    async fn all_addressed(&self, n: usize, gateway: IpAddr) {
        CONVERGE
            .eventually("every pod to hold an address", || async {
                (addresses(&self.records).await.len() == n).then_some(())
            })
            .await;
        CONVERGE
            .eventually("usedIP to name exactly the live pods' addresses", || {
                ledger_matches(self, gateway)
            })
            .await;
    }

    /// Stops the controllers and deletes the namespace and the subnet.
    async fn teardown(self) {
        let Self {
            client,
            ns,
            subnet_name,
            subnets,
            stop,
            controllers,
            ..
        } = self;
        stop.cancel();
        controllers.await.expect("controllers");
        let namespaces: Api<Namespace> = Api::all(client.clone());
        namespaces
            .delete(&ns, &DeleteParams::default())
            .await
            .expect("delete namespace");
        CONVERGE
            .eventually(
                "the subnet to be deletable once its records are gone",
                || async {
                    // The controllers are stopped: release what is left by hand.
                    for record in Api::<FlatNetworkIP>::all(client.clone())
                        .list(&ListParams::default())
                        .await
                        .ok()?
                        .items
                        .into_iter()
                        .filter(|r| r.spec.subnet == subnet_name)
                    {
                        let api: Api<FlatNetworkIP> =
                            Api::namespaced(client.clone(), &record.metadata.namespace.clone()?);
                        let _ = api
                            .patch(
                                record.metadata.name.as_deref()?,
                                &PatchParams::default(),
                                &Patch::Merge(json!({"metadata": {"finalizers": null}})),
                            )
                            .await;
                    }
                    Some(())
                },
            )
            .await;
        let _ = subnets
            .patch(
                &subnet_name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"finalizers": null}})),
            )
            .await;
        let _ = subnets.delete(&subnet_name, &DeleteParams::default()).await;
    }
}

#[tokio::test]
async fn pods_get_unique_addresses_released_on_delete_and_statefulsets_keep_theirs() {
    let Some(setup) = setup("alloc", "198.18.0.0/23", "198.18.0.1").await else {
        return;
    };
    let (client, ns, subnet_name, subnets, pods, records) = (
        setup.client.clone(),
        setup.ns.clone(),
        setup.subnet_name.clone(),
        setup.subnets.clone(),
        setup.pods.clone(),
        setup.records.clone(),
    );
    setup.create_pods(0..PODS).await;
    let held = CONVERGE
        .eventually("every pod's FlatNetworkIP to hold an address", || async {
            let held = addresses(&records).await;
            (held.len() == PODS).then_some(held)
        })
        .await;
    let unique: BTreeSet<IpAddr> = held.iter().map(|(_, a)| *a).collect();
    assert_eq!(unique.len(), PODS, "an address was handed out twice");
    assert!(
        !unique.contains(&"198.18.0.1".parse::<IpAddr>().unwrap()),
        "the gateway was allocated"
    );
    // Addresses reserved ahead for records still to come go back shortly
    // after the burst: the ledger then holds the pods' and the gateway.
    CONVERGE
        .eventually("usedIPCount to count the pods and the gateway", || async {
            let used = subnets.get(&subnet_name).await.ok()?.status?;
            (used.used_ip_count == i64::try_from(PODS).unwrap() + 1).then_some(())
        })
        .await;

    // Deleting pods releases their addresses.
    setup.delete_pods(0..50).await;
    CONVERGE
        .eventually(
            "the records of deleted pods to go and the ledger to shrink",
            || async {
                let left = addresses(&records).await.len();
                let used = subnets.get(&subnet_name).await.ok()?.status?.used_ip_count;
                (left == PODS - 50 && used == i64::try_from(PODS - 50).unwrap() + 1).then_some(())
            },
        )
        .await;

    // A StatefulSet pod keeps its address when it is replaced.
    let sets: Api<StatefulSet> = Api::namespaced(client.clone(), &ns);
    let set: StatefulSet = serde_json::from_value(json!({
        "metadata": {"name": "web"},
        "spec": {"serviceName": "web", "replicas": 2,
                 "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}, "annotations": pod_template(&subnet_name)["annotations"]},
                              "spec": pod_spec()}}
    }))
    .unwrap();
    sets.create(&PostParams::default(), &set)
        .await
        .expect("create StatefulSet");
    let first = CONVERGE
        .eventually("web-0 to get an address", || async {
            let r = records.get_opt("web-0").await.ok()??;
            r.status?.addr
        })
        .await;
    let old_uid = pods.get("web-0").await.unwrap().metadata.uid;
    pods.delete("web-0", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete web-0");
    let second = CONVERGE
        .eventually("the new web-0 to be recorded", || async {
            let pod = pods.get_opt("web-0").await.ok()??;
            if pod.metadata.uid == old_uid {
                return None;
            }
            let r = records.get_opt("web-0").await.ok()??;
            (Some(r.spec.pod_id.clone()) == pod.metadata.uid).then_some(r.status?.addr?)
        })
        .await;
    assert_eq!(first, second, "the StatefulSet pod lost its address");

    setup.teardown().await;
}

/// How soon the ledger must follow deleted pods: seconds (the leak this
/// guards against lasted the 10-minute orphan grace).
const RELEASE: Converge = Converge {
    within: Duration::from_secs(5),
    poll: Duration::from_millis(250),
};

/// `usedIP` and `usedIPCount` are exactly the live records' addresses plus
/// the gateway.
async fn ledger_matches(setup: &Setup, gateway: IpAddr) -> Option<()> {
    let live: BTreeSet<IpAddr> = setup
        .records
        .list(&ListParams::default())
        .await
        .ok()?
        .items
        .into_iter()
        .filter(|r| r.metadata.deletion_timestamp.is_none())
        .filter_map(|r| r.status?.addr)
        .collect();
    let status = setup.subnets.get(&setup.subnet_name).await.ok()?.status?;
    let mut want = live.clone();
    want.insert(gateway);
    let exact = status.used_ranges() == used_ranges::compress(want.iter().copied())
        && status.used_ip_count == i64::try_from(want.len()).ok()?;
    exact.then_some(())
}

/// The reported scenario: N pods, half deleted, the ledger exact within a
/// few seconds, then the other half created into the freed addresses.
#[tokio::test]
async fn deleting_half_the_pods_frees_their_addresses_within_seconds() {
    // A /24 with 241 allocatable addresses, as reported.
    let Some(setup) = setup("churn", "198.18.4.0/24", "198.18.4.1").await else {
        return;
    };
    let gateway: IpAddr = "198.18.4.1".parse().unwrap();
    let n: usize = std::env::var("FLATNET_E2E_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    setup.create_pods(0..n).await;
    setup.all_addressed(n, gateway).await;
    setup.delete_pods(0..n / 2).await;
    RELEASE
        .eventually(
            "usedIP/usedIPCount to drop the deleted pods' addresses",
            || ledger_matches(&setup, gateway),
        )
        .await;
    setup.create_pods(n..n + n / 2).await;
    setup.all_addressed(n, gateway).await;
    setup.teardown().await;
}
