//! The operator's code a chaos run does not exercise, driven against
//! recording fake API servers: the flat-Service, NetworkAttachmentDefinition,
//! workload, floating-address, MTU-count, cluster-configuration,
//! cluster-conditions and PodNetworkConfig controllers, the webhook certificate upkeep and its
//! reviews, and the allocation's rarer paths
//! (pod labels, collection of records of vanished pods, finalizers of
//! deleted records, a record read again after a conflict, a repeated
//! Event). Each drive gives
//! its controller objects that make it send every kind of request it can,
//! checks that it got there, and returns what its client asked for.

use std::{collections::BTreeSet, future::Future, sync::Arc, time::Duration};

use flatnet_k8s::{
    api::{FlatNetworkIP, FlatNetworkSubnet, phase},
    keys::SUBNET_NAMESPACE,
};
use k8s_openapi::{
    api::{
        admissionregistration::v1::ValidatingWebhookConfiguration,
        apps::v1::{DaemonSet, Deployment, StatefulSet},
        batch::v1::{CronJob, Job},
        core::v1::{ConfigMap, Endpoints, Namespace, Pod, Secret, Service},
        discovery::v1::EndpointSlice,
    },
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    ResourceExt,
    core::{DynamicObject, admission::AdmissionReview},
};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::{
    admin::Health,
    allocation::{
        Settings,
        fake_api::{Access, FakeApiServer, rbac::Rbac},
        fake_cluster::{FakeCluster, POD_NAMESPACE, pod, subnet},
    },
    config::WebhookSettings,
    fixtures::{NS, PodExt, admission_review},
    metrics::Metrics,
    tls,
    webhook::Validator,
};

/// How long a drive may take to reach what it checks.
const WITHIN: Duration = Duration::from_secs(30);

/// What every drive asked for.
pub(super) async fn every_other_controller() -> BTreeSet<Access> {
    let mut accesses = BTreeSet::new();
    accesses.extend(flat_services().await);
    accesses.extend(attachments().await);
    accesses.extend(workloads().await);
    accesses.extend(floating().await);
    accesses.extend(certificates().await);
    accesses.extend(reviews().await);
    accesses.extend(mtu_counts().await);
    accesses.extend(cluster_configuration().await);
    accesses.extend(cluster_conditions().await);
    accesses.extend(pod_network_configs().await);
    accesses.extend(allocation_corners().await);
    accesses
}

/// The operator's ServiceAccount in the chart.
pub(super) const OPERATOR: &str = "flatnet-operator";

/// The recording clients of the drives so far, whose refused requests a
/// drive that does not reach its step names.
static RECORDERS: std::sync::Mutex<Vec<FakeApiServer>> = std::sync::Mutex::new(Vec::new());

/// A fake whose objects are seeded through the first, and whose requests
/// through the second (a recording client, authorized by the chart's rules
/// for the operator) are the ones counted.
fn recording() -> (FakeApiServer, FakeApiServer) {
    let server = FakeApiServer::new();
    let recorded = server.for_client(1).with_rbac(Rbac::from_chart(OPERATOR));
    RECORDERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(recorded.clone());
    (server, recorded)
}

/// The requests the chart's rules refused so far, with their counts.
fn refused() -> Vec<String> {
    RECORDERS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .flat_map(|r| r.requests_by_kind())
        .filter(|(kind, _)| kind.ends_with(" 403"))
        .map(|(kind, count)| format!("{kind} ×{count}"))
        .collect()
}

/// Polls `done` until it holds; panics naming `what` (and the requests the
/// chart refused) after [`WITHIN`].
async fn reach(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + WITHIN;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the drive did not reach: {what}; refused by the chart's RBAC: {:?}",
            refused()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The object of `kind` in the chart's default render.
fn rendered(kind: &str) -> Value {
    let path = crate::allocation::fake_api::rbac::chart_render();
    let text = std::fs::read_to_string(&path).expect("the chart's render");
    let objects: Vec<Value> = serde_json::from_str(&text).expect("a JSON list");
    objects
        .into_iter()
        .find(|o| o["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in the render"))
}

/// The operator's webhook settings as the chart's Deployment sets them.
fn chart_webhook_settings() -> WebhookSettings {
    let deployment = rendered("Deployment");
    let env = |name: &str| {
        deployment["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
            .unwrap_or_else(|| panic!("the chart's operator sets no {name}"))
            .to_owned()
    };
    WebhookSettings {
        enabled: true,
        listen: "127.0.0.1:0".parse().expect("address"),
        namespace: deployment["metadata"]["namespace"]
            .as_str()
            .expect("a namespace")
            .to_owned(),
        service: env("FLATNET_WEBHOOK_SERVICE"),
        secret: env("FLATNET_WEBHOOK_SECRET"),
        configuration: env("FLATNET_WEBHOOK_CONFIG"),
        url: None,
    }
}

/// Whether `recorded` has seen a watch of each of `resources`. A
/// reflector lists before it watches, so a step can be reached on what the
/// list brought, and a drive stopped right then would miss the watch.
fn watching(recorded: &FakeApiServer, resources: &[&str]) -> bool {
    let accesses = recorded.accesses();
    resources.iter().all(|resource| {
        accesses
            .iter()
            .any(|a| a.verb == "watch" && a.resource == *resource)
    })
}

/// Runs `controller` (given a stop token) while `steps` drive it, then
/// stops it.
async fn running<C, S>(controller: impl FnOnce(CancellationToken) -> C, steps: S)
where
    C: Future<Output = ()> + Send + 'static,
    S: Future<Output = ()>,
{
    let stop = CancellationToken::new();
    let task = tokio::spawn(controller(stop.clone()));
    steps.await;
    stop.cancel();
    let _ = tokio::time::timeout(WITHIN, task).await;
}

fn named<K: kube::Resource<DynamicType = ()> + DeserializeOwned>(
    server: &FakeApiServer,
    name: &str,
) -> Option<K> {
    server
        .list::<K>()
        .into_iter()
        .find(|o| o.meta().name.as_deref() == Some(name))
}

fn object<K: DeserializeOwned>(value: Value) -> K {
    serde_json::from_value(value).expect("a valid object literal")
}

/// Flat Services: created, their EndpointSlices and Endpoints applied, a
/// stale slice deleted, and the flat Service deleted when its parent stops
/// selecting flat pods.
async fn flat_services() -> BTreeSet<Access> {
    let (server, recorded) = recording();
    server.insert(&crate::fixtures::service("web"));
    server.insert(
        &crate::fixtures::pod("web-1")
            .flat()
            .with_flat_ips(&["10.0.0.5"]),
    );
    server.insert(&object::<EndpointSlice>(json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": "web-flat-network-stale", "namespace": NS, "labels": {
            "kubernetes.io/service-name": "web-flat-network",
            "endpointslice.kubernetes.io/managed-by": "flatnet.pandaria.io"}},
        "addressType": "IPv6", "endpoints": []
    })));
    let ctx = Arc::new(crate::flat_services::Context {
        client: recorded.client(),
        metrics: Arc::new(Metrics::new()),
        attachment: "rancher-flat-network".into(),
        resync: Duration::from_secs(600),
    });
    running(
        |stop| crate::flat_services::run(ctx, 1, Arc::new(Health::default()), stop),
        async {
            reach("flat Service, its slices and Endpoints", || {
                named::<Service>(&server, "web-flat-network").is_some()
                    && named::<EndpointSlice>(&server, "web-flat-network-stale").is_none()
                    && !server.list::<EndpointSlice>().is_empty()
                    && named::<Endpoints>(&server, "web-flat-network").is_some()
            })
            .await;
            let mut parent: Service = named(&server, "web").expect("parent");
            parent.spec.as_mut().expect("spec").selector = None;
            server.insert(&parent);
            reach("the flat Service deleted", || {
                named::<Service>(&server, "web-flat-network").is_none()
            })
            .await;
        },
    )
    .await;
    recorded.accesses()
}

/// The NetworkAttachmentDefinition of every namespace, owned by the chart's
/// webhook configuration.
async fn attachments() -> BTreeSet<Access> {
    let (server, recorded) = recording();
    server.insert(&object::<Namespace>(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}),
    ));
    let chart: ValidatingWebhookConfiguration = object(rendered("ValidatingWebhookConfiguration"));
    server.insert(&chart);
    let owner = chart_webhook_settings().configuration;
    let ctx = Arc::new(crate::nad::Context {
        client: recorded.client(),
        metrics: Arc::new(Metrics::new()),
        name: "rancher-flat-network".into(),
        config: "{\"cniVersion\": \"1.0.0\"}".into(),
        resync: Duration::from_secs(600),
        owner: Some(owner.clone()),
    });
    running(|stop| crate::nad::run(ctx, 1, stop), async {
        reach("the attachment applied, owned by the configuration", || {
            server.count::<DynamicNad>(|v| {
                v["metadata"]["name"] == "rancher-flat-network"
                    && v["metadata"]["ownerReferences"][0]["name"] == owner.as_str()
            }) > 0
        })
        .await;
    })
    .await;
    recorded.accesses()
}

/// `k8s.cni.cncf.io/v1` NetworkAttachmentDefinition, for counting.
type DynamicNad = crate::nad::NetworkAttachmentDefinition;

/// The workload controller: labels on every kind and `reservedIP`.
async fn workloads() -> BTreeSet<Access> {
    let (server, recorded) = recording();
    server.insert(&subnet("lan", "10.0.0.0/24", None, &[]));
    let template = json!({"metadata": {"annotations": {
        "flatnetwork.pandaria.io/subnet": "lan", "flatnetwork.pandaria.io/ip": "10.0.0.5"}},
        "spec": {"containers": [{"name": "c", "image": "i"}]}});
    for (api_version, kind, spec) in [
        (
            "apps/v1",
            "Deployment",
            json!({"selector": {}, "template": template}),
        ),
        (
            "apps/v1",
            "StatefulSet",
            json!({"selector": {}, "serviceName": "s", "template": template}),
        ),
        (
            "apps/v1",
            "DaemonSet",
            json!({"selector": {}, "template": template}),
        ),
        ("batch/v1", "Job", json!({"template": template})),
        (
            "batch/v1",
            "CronJob",
            json!({"schedule": "* * * * *", "jobTemplate": {"spec": {"template": template}}}),
        ),
    ] {
        let value = json!({"apiVersion": api_version, "kind": kind,
                           "metadata": {"name": kind.to_lowercase(), "namespace": NS}, "spec": spec});
        match kind {
            "Deployment" => server.insert(&object::<Deployment>(value)),
            "StatefulSet" => server.insert(&object::<StatefulSet>(value)),
            "DaemonSet" => server.insert(&object::<DaemonSet>(value)),
            "Job" => server.insert(&object::<Job>(value)),
            _ => server.insert(&object::<CronJob>(value)),
        };
    }
    let client = recorded.client();
    running(
        |stop| {
            crate::workloads::run(
                client,
                Arc::new(Metrics::new()),
                Duration::from_secs(600),
                1,
                stop,
            )
        },
        async {
            reach("five reservations and five labelled workloads", || {
                let reserved = server.list::<FlatNetworkSubnet>()[0]
                    .status
                    .as_ref()
                    .map_or(0, |s| s.reserved_ip.len());
                let labelled = server.count::<Deployment>(labelled)
                    + server.count::<StatefulSet>(labelled)
                    + server.count::<DaemonSet>(labelled)
                    + server.count::<Job>(labelled)
                    + server.count::<CronJob>(labelled);
                reserved == 5 && labelled == 5
            })
            .await;
        },
    )
    .await;
    recorded.accesses()
}

fn labelled(value: &Value) -> bool {
    value["metadata"]["labels"]["flatnetwork.pandaria.io/subnet"] == "lan"
}

/// Floating addresses: a LoadBalancer Service of flatnet's class gets its
/// address (finalizer, status, pool ledger, interface mappings), a project
/// quota gets its status, and the address goes back when the Service stops
/// being a LoadBalancer.
async fn floating() -> BTreeSet<Access> {
    use flatnet_k8s::{
        api::{
            FloatingIPPool, FloatingIPPoolSpec, FloatingIPProjectQuota, FloatingIPProjectQuotaSpec,
            IpRange,
        },
        floating::{INTERFACE_MAPPINGS, LOAD_BALANCER_CLASS},
    };
    let (server, recorded) = recording();
    server.insert(&object::<Namespace>(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": NS, "labels": {"field.cattle.io/projectId": "c-1:p-shop"}}
    })));
    server.insert(&FloatingIPPool::new(
        "public",
        FloatingIPPoolSpec {
            cidrs: vec!["192.0.2.0/24".into()],
            ranges: vec![IpRange::new(
                "192.0.2.10".parse().expect("address"),
                "192.0.2.20".parse().expect("address"),
            )],
            target_network_interface: "eth0.100".into(),
            ..FloatingIPPoolSpec::default()
        },
    ));
    server.insert(&FloatingIPProjectQuota::new(
        "shop",
        FloatingIPProjectQuotaSpec {
            project: "c-1:p-shop".into(),
            limits: [("public".to_owned(), 2)].into(),
            ..FloatingIPProjectQuotaSpec::default()
        },
    ));
    let mut lb = crate::fixtures::service("lb");
    lb.metadata.resource_version = None;
    let spec = lb.spec.as_mut().expect("spec");
    spec.type_ = Some("LoadBalancer".into());
    spec.load_balancer_class = Some(LOAD_BALANCER_CLASS.into());
    server.insert(&lb);
    let client = recorded.client();
    let ingress = |server: &FakeApiServer| {
        named::<Service>(server, "lb")
            .and_then(|s| s.status?.load_balancer?.ingress)
            .is_some_and(|i| !i.is_empty())
    };
    running(
        |stop| {
            crate::floating::run(
                client,
                Arc::new(Metrics::new()),
                crate::floating::Settings::default(),
                1,
                stop,
            )
        },
        async {
            reach("the interface mappings", || {
                named::<ConfigMap>(&server, INTERFACE_MAPPINGS).is_some()
            })
            .await;
            reach("a floating address", || ingress(&server)).await;
            reach("the quota's status", || {
                server.list::<FloatingIPProjectQuota>()[0].status.is_some()
            })
            .await;
            let mut plain: Service = named(&server, "lb").expect("lb");
            plain.spec.as_mut().expect("spec").type_ = Some("ClusterIP".into());
            server.insert(&plain);
            reach("the address given back", || !ingress(&server)).await;
        },
    )
    .await;
    recorded.accesses()
}

/// The webhook certificate, with the chart's names: a Secret without
/// certificates is filled in, the CA bundle written into the chart's
/// configuration (left in place, Helm's labels kept), and every replica
/// follows the Secret.
async fn certificates() -> BTreeSet<Access> {
    let (server, recorded) = recording();
    let settings = chart_webhook_settings();
    // As Helm created it.
    let chart: ValidatingWebhookConfiguration = object(rendered("ValidatingWebhookConfiguration"));
    server.insert(&chart);
    let uid = named::<ValidatingWebhookConfiguration>(&server, &settings.configuration)
        .and_then(|c| c.metadata.uid)
        .expect("a uid");
    server.insert(&object::<Secret>(json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": settings.secret, "namespace": settings.namespace}, "data": {}
    })));
    let hosts = tls::cert::hosts(&settings.service, &settings.namespace, None);
    let changed = Arc::new(Notify::new());
    let resolver = Arc::new(tls::resolver::ReloadingResolver::default());
    let follower = {
        let stop = CancellationToken::new();
        let task = tokio::spawn(tls::follow(
            recorded.client(),
            settings.clone(),
            Arc::clone(&resolver),
            Arc::new(Metrics::new()),
            Arc::clone(&changed),
            stop.clone(),
        ));
        (stop, task)
    };
    let client = recorded.client();
    let (secret, configuration) = (settings.secret.clone(), settings.configuration.clone());
    running(
        |stop| tls::manage(client, settings, hosts, changed, stop),
        async {
            reach("the CA bundle injected and the Secret filled", || {
                named::<ValidatingWebhookConfiguration>(&server, &configuration).is_some_and(|c| {
                    c.webhooks
                        .iter()
                        .flatten()
                        .all(|w| w.client_config.ca_bundle.is_some())
                }) && named::<Secret>(&server, &secret)
                    .and_then(|s| s.data)
                    .is_some_and(|d| !d.is_empty())
            })
            .await;
            let kept: ValidatingWebhookConfiguration =
                named(&server, &configuration).expect("the configuration");
            assert_eq!(
                kept.metadata.uid,
                Some(uid),
                "the chart's configuration replaced"
            );
            assert_eq!(kept.labels(), chart.labels(), "the chart's labels changed");
            // A deleted Secret is made again.
            server.delete::<Secret>(&chart_webhook_settings().namespace, &secret);
            reach("the Secret created again", || {
                named::<Secret>(&server, &secret).is_some()
            })
            .await;
        },
    )
    .await;
    follower.0.cancel();
    let _ = tokio::time::timeout(WITHIN, follower.1).await;
    recorded.accesses()
}

/// Admission reviews that make the webhook read everything it can: the
/// owners of a pod (ReplicaSet, Job), the pod holding a requested address,
/// a namespace's labels, the subnets, records and wire claims, and the
/// floating pools, Services, namespaces and quotas.
async fn reviews() -> BTreeSet<Access> {
    let (server, recorded) = recording();
    server.insert(&subnet("net1", "10.0.0.0/24", Some("10.0.0.1"), &[]));
    server.insert(&object::<Namespace>(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}),
    ));
    // 10.0.0.7 is held by a bare pod's record.
    let holder = crate::fixtures::pod("holder")
        .annotated("flatnetwork.pandaria.io/subnet", "net1")
        .annotated("flatnetwork.pandaria.io/ip", "10.0.0.7");
    server.insert(&holder);
    server.insert(&object::<FlatNetworkIP>(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkIP",
        "metadata": {"name": "holder", "namespace": NS},
        "spec": {"subnet": "net1", "addrs": ["10.0.0.7"], "macs": [], "podId": "uid-holder"},
        "status": {"phase": "Active", "addr": "10.0.0.7"}
    })));
    let owned = |kind: &str, name: &str| {
        json!([{"apiVersion": if kind == "Job" {"batch/v1"} else {"apps/v1"},
                "kind": kind, "name": name, "uid": format!("uid-{name}"), "controller": true}])
    };
    let fixed_pod = |name: &str, owners: Value| {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": NS, "ownerReferences": owners,
                            "annotations": {"flatnetwork.pandaria.io/subnet": "net1",
                                            "flatnetwork.pandaria.io/ip": "10.0.0.7"}},
               "spec": {"containers": [{"name": "c", "image": "i"}]}})
    };
    let objects = [
        fixed_pod("web-1", owned("ReplicaSet", "web-rs")),
        fixed_pod("batch-1", owned("Job", "nightly-1")),
        json!({"apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
               "metadata": {"name": "net2", "namespace": SUBNET_NAMESPACE},
               "spec": {"flatMode": "macvlan", "master": "eth1", "cidr": "10.1.0.0/24"}}),
        json!({"apiVersion": "flatnetwork.pandaria.io/v1", "kind": "PodNetworkConfig",
               "metadata": {"name": "extra", "namespace": NS},
               "spec": {"attachments": [{"subnet": "net1", "interface": "net2"}]}}),
        json!({"apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPPool",
               "metadata": {"name": "public"},
               "spec": {"cidrs": ["192.0.2.0/24"], "targetNetworkInterface": "eth0"}}),
        json!({"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "lb", "namespace": NS},
               "spec": {"type": "LoadBalancer",
                        "loadBalancerClass": flatnet_k8s::floating::LOAD_BALANCER_CLASS,
                        "ports": [{"port": 80, "protocol": "TCP"}]}}),
    ];
    let validator = Validator::new(recorded.client(), Arc::new(Metrics::new()));
    for object in &objects {
        let review: AdmissionReview<DynamicObject> =
            serde_json::from_value(admission_review("uid-rbac", "CREATE", Some(object), None))
                .expect("a review");
        let request = review.try_into().expect("a request");
        // Allowed or denied, the lookups were made.
        let _ = validator.review(&request).await;
    }
    recorded.accesses()
}

/// `status.podsAtMTU`: a subnet with an MTU and an Active record at it.
async fn mtu_counts() -> BTreeSet<Access> {
    let (server, recorded) = recording();
    let mut lan = subnet("lan", "10.0.0.0/24", None, &[]);
    lan.spec.mtu = Some(1400);
    server.insert(&lan);
    server.insert(&object::<FlatNetworkIP>(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkIP",
        "metadata": {"name": "p", "namespace": NS},
        "spec": {"subnet": "lan", "addrs": [], "macs": [], "podId": "uid-p"},
        "status": {"phase": "Active", "addr": "10.0.0.5", "mtu": 1400}
    })));
    let client = recorded.client();
    running(
        |stop| crate::runtime_config::mtu_status::run(client, Duration::from_millis(50), stop),
        async {
            reach("podsAtMTU written", || {
                server.list::<FlatNetworkSubnet>()[0]
                    .status
                    .as_ref()
                    .and_then(|s| s.pods_at_mtu)
                    == Some(1)
            })
            .await;
        },
    )
    .await;
    recorded.accesses()
}

/// The FlatNetworkConfig `cluster` without a MAC range: a random range is
/// recorded in its status and handed to allocation.
async fn cluster_configuration() -> BTreeSet<Access> {
    use flatnet_k8s::api::{CONFIG_NAME, FlatNetworkConfig, FlatNetworkConfigSpec};
    let (server, recorded) = recording();
    let mut config = FlatNetworkConfig::new(CONFIG_NAME, FlatNetworkConfigSpec::default());
    config.metadata.generation = Some(1);
    server.insert(&config);
    let applied = crate::cluster_config::Applied::defaults();
    let pool = applied.mac_pool.clone();
    let client = recorded.client();
    running(
        |stop| crate::cluster_config::run(client, applied, stop),
        async {
            reach("a random MAC range recorded and applied", || {
                named::<FlatNetworkConfig>(&server, CONFIG_NAME)
                    .and_then(|c| c.status?.mac_pool)
                    .is_some_and(|p| p.generated)
                    && pool.get().is_some()
            })
            .await;
        },
    )
    .await;
    recorded.accesses()
}

/// The FlatNetworkConfig's conditions: the agent DaemonSet and the agents'
/// heartbeat Leases followed, the conditions written.
async fn cluster_conditions() -> BTreeSet<Access> {
    use flatnet_k8s::{
        agent_heartbeat::{self, AgentReadiness},
        api::{CONDITION_AVAILABLE, CONFIG_NAME, FlatNetworkConfig, FlatNetworkConfigSpec},
    };
    let namespace = "cattle-flat-network";
    let (server, recorded) = recording();
    server.insert(&FlatNetworkConfig::new(
        CONFIG_NAME,
        FlatNetworkConfigSpec::default(),
    ));
    server.insert(&object::<DaemonSet>(json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "flatnet-agent", "namespace": namespace},
        "spec": {"selector": {}, "template": {}},
        "status": {"desiredNumberScheduled": 1, "updatedNumberScheduled": 1, "numberReady": 1,
                   "numberAvailable": 1, "currentNumberScheduled": 1, "numberMisscheduled": 0}
    })));
    server.insert(&agent_heartbeat::lease(
        namespace,
        "node-1",
        &AgentReadiness::ready(),
        Timestamp::now(),
        Duration::from_secs(40),
        None,
    ));
    let health = Arc::new(Health::default());
    health.set_ready(true);
    let client = recorded.client();
    let settings = crate::cluster_health::Settings {
        namespace: namespace.into(),
        daemonset: "flatnet-agent".into(),
        leader: "flatnet-operator-0".into(),
        interval: Duration::from_millis(50),
        ca_bundle_interval: Duration::from_millis(50),
        wire_window: flatnet_k8s::ipam::DEFAULT_WIRE_WINDOW,
    };
    // The webhook: its Service's endpoints and its registration's caBundle.
    let material = tls::cert::renew(
        None,
        &tls::cert::Renewal::Ca("test"),
        &tls::cert::hosts("webhook-svc", namespace, None),
        time::OffsetDateTime::now_utc(),
    )
    .expect("certificates");
    let resolver = Arc::new(tls::resolver::ReloadingResolver::default());
    resolver
        .load(&material.cert, &material.key)
        .expect("a certificate");
    let configuration = chart_webhook_settings().configuration;
    server.insert(&crate::fixtures::webhook_configuration(
        &configuration,
        &material.ca_bundle,
    ));
    server.insert(&crate::fixtures::endpoint_slice(
        namespace,
        "webhook-svc",
        true,
    ));
    let webhook = crate::cluster_health::WebhookProbe::Enabled {
        resolver,
        service: Some("webhook-svc".into()),
        configuration,
    };
    running(
        |stop| crate::cluster_health::run(client, settings, health, webhook, stop),
        async {
            reach("Available written", || {
                named::<FlatNetworkConfig>(&server, CONFIG_NAME)
                    .and_then(|c| c.status)
                    .is_some_and(|s| {
                        s.conditions
                            .iter()
                            .any(|c| c.type_ == CONDITION_AVAILABLE && c.status == "True")
                    })
            })
            .await;
            reach("every cache watching", || {
                watching(
                    &recorded,
                    &[
                        "flatnetworkconfigs",
                        "daemonsets",
                        "leases",
                        "endpointslices",
                        "flatnetworkwireclaims",
                    ],
                )
            })
            .await;
        },
    )
    .await;
    recorded.accesses()
}

/// A PodNetworkConfig: the matching running pod gets its hot-plugged
/// interface's record; once the node reports the interface, the
/// configuration's status, the pod's network-status and an Event follow;
/// its primary MTU goes to the node's FlatNetworkNodeConfig; the
/// configuration deleted, the record and the node's object go.
async fn pod_network_configs() -> BTreeSet<Access> {
    use flatnet_k8s::{
        api::{PodNetworkConfig, phase},
        keys::annotation,
    };
    let (server, recorded) = recording();
    server.insert(&subnet("lan", "10.0.0.0/24", None, &[]));
    server.insert(&object::<Namespace>(
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}),
    ));
    server.insert(&object::<Pod>(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": NS, "uid": "uid-web-0",
                     "labels": {"app": "web"},
                     "annotations": {annotation::MULTUS_NETWORK_STATUS:
                         r#"[{"name":"k8s-pod-network","interface":"eth0","ips":["10.42.0.5"]}]"#}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c", "image": "i"}]},
        "status": {"phase": "Running"}
    })));
    server.insert(&object::<PodNetworkConfig>(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "PodNetworkConfig",
        "metadata": {"name": "storage", "namespace": NS, "generation": 1},
        "spec": {"podSelector": {"matchLabels": {"app": "web"}},
                 "primary": {"mtu": 1400},
                 "attachments": [{"subnet": "lan", "interface": "net2"}]}
    })));
    let node_config = |server: &FakeApiServer| {
        server
            .list::<flatnet_k8s::api::FlatNetworkNodeConfig>()
            .into_iter()
            .find(|c| c.name_any() == "node-1")
    };
    let record = |server: &FakeApiServer| named::<FlatNetworkIP>(server, "web-0.if-net2");
    let status = |server: &FakeApiServer| {
        named::<PodNetworkConfig>(server, "storage")
            .and_then(|c| c.status)
            .unwrap_or_default()
    };
    let client = recorded.client();
    running(
        |stop| {
            crate::runtime_config::controller::run(
                client,
                crate::runtime_config::controller::Settings {
                    debounce: Duration::from_millis(10),
                    resync: Duration::from_secs(1),
                },
                stop,
            )
        },
        async {
            reach("the record created and the pod matched", || {
                record(&server).is_some() && status(&server).matched == 1
            })
            .await;
            reach("the node asked for the pod's MTU", || {
                node_config(&server).is_some()
            })
            .await;
            // The node's agent: the MTU is set.
            let mut reported = node_config(&server).expect("node config");
            reported.status = Some(flatnet_k8s::api::FlatNetworkNodeConfigStatus {
                pod_count: 1,
                pods: vec![flatnet_k8s::api::PrimaryMtuResult {
                    uid: "uid-web-0".into(),
                    mtu: 1400,
                    ..Default::default()
                }],
                ..Default::default()
            });
            server.insert(&reported);
            // Allocation and the node's agent: the interface is in the pod.
            let mut active = record(&server).expect("record");
            let record_status = active.status.get_or_insert_with(Default::default);
            record_status.phase = phase::ACTIVE.into();
            record_status.node = "node-1".into();
            record_status.addr = Some("10.0.0.5".parse().expect("address"));
            server.insert(&active);
            reach("applied, in the network-status, announced", || {
                status(&server).applied == 1
                    && named::<Pod>(&server, "web-0").is_some_and(|p| {
                        p.annotations()
                            .get(annotation::MULTUS_NETWORK_STATUS)
                            .is_some_and(|s| s.contains("net2"))
                    })
                    && !server
                        .list::<k8s_openapi::api::events::v1::Event>()
                        .is_empty()
            })
            .await;
            server.delete::<PodNetworkConfig>(NS, "storage");
            reach("the record and the node's object deleted", || {
                record(&server).is_none_or(|r| r.metadata.deletion_timestamp.is_some())
                    && node_config(&server).is_none()
            })
            .await;
        },
    )
    .await;
    recorded.accesses()
}

/// The allocation's paths a chaos run reaches only by timing: a pod's
/// labels once its node set it up, the collection of a record whose pod
/// is gone, the finalizer of a deleted record, and a record read again
/// after a write conflict.
async fn allocation_corners() -> BTreeSet<Access> {
    let (server, recorded) = recording();
    server.insert(&subnet(
        "lan",
        "10.0.0.0/24",
        None,
        &[("10.0.0.10", "10.0.0.20")],
    ));
    // A record of a pod that is gone, created long ago: collected.
    server.insert(&object::<FlatNetworkIP>(json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkIP",
        "metadata": {"name": "gone", "namespace": POD_NAMESPACE,
                     "creationTimestamp": "2020-01-01T00:00:00Z",
                     "finalizers": [crate::allocation::records::FINALIZER]},
        "spec": {"subnet": "lan", "addrs": [], "macs": [], "podId": "uid-gone"}
    })));
    let cluster = FakeCluster::start(recorded.clone(), Settings::default(), 1);
    cluster
        .wait_active("lan", WITHIN)
        .await
        .expect("subnet Active");
    server.insert(&pod("p-0", "lan"));
    reach("p-0 addressed and the vanished pod's record gone", || {
        let records = server.list::<FlatNetworkIP>();
        records.iter().all(|r| r.name_any() != "gone")
            && records.iter().any(|r| {
                r.name_any() == "p-0" && r.status.as_ref().is_some_and(|s| s.addr.is_some())
            })
    })
    .await;
    // The node sets the pod up: the record is Active, the pod gets labels.
    let mut record: FlatNetworkIP = named(&server, "p-0").expect("record");
    let status = record.status.as_mut().expect("status");
    status.phase = phase::ACTIVE.into();
    status.node = "node-1".into();
    server.insert(&record);
    reach("p-0 labelled with its address", || {
        named::<Pod>(&server, "p-0").is_some_and(|p| {
            p.labels()
                .contains_key(flatnet_k8s::keys::label::SELECTED_IP)
        })
    })
    .await;
    cluster.stop().await;

    // The same Event twice: kube's recorder patches the first.
    let events = crate::allocation::events::Events::new(recorded.client());
    let pod: Pod = named(&server, "p-0").expect("pod");
    for _ in 0..2 {
        events
            .warn(&pod, "RbacDrive", "Drive", "the same note".to_owned())
            .await;
    }

    // A write conflict on the record: it is read again.
    let mut stale: FlatNetworkIP = named(&server, "p-0").expect("record");
    stale.metadata.resource_version = Some("1".into());
    stale.status = None;
    let ctx = crate::allocation::tests::context_from(&recorded, Settings::default());
    let _ = crate::allocation::ips::reconcile(Arc::new(stale), Arc::clone(&ctx)).await;
    // Deleted: the finalizer goes.
    let mut deleted: FlatNetworkIP = named(&server, "p-0").expect("record");
    deleted.metadata.deletion_timestamp = Some(Time(Timestamp::now()));
    server.insert(&deleted);
    let deleted: FlatNetworkIP = named(&server, "p-0").expect("record");
    let _ = crate::allocation::ips::reconcile(Arc::new(deleted), ctx).await;
    reach("p-0's record gone", || {
        named::<FlatNetworkIP>(&server, "p-0").is_none()
    })
    .await;
    recorded.accesses()
}
