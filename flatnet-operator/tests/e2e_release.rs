//! The release on a real node: flatnet installed from `cargo xtask release`
//! with the chart's default values onto the single-node cluster of
//! `cargo xtask cluster up` (kube-apiserver, controller manager, scheduler,
//! kubelet, containerd, Multus thin), and used as a user would. The flat
//! network's master is a Linux bridge with LAN hosts in network namespaces.
//!
//! `cargo xtask e2e` installs the release, sets `FLATNET_E2E_RELEASE=1` and
//! the `FLATNET_E2E_*` variables below, and runs this suite; without them
//! every test says it is skipped. The tests share the cluster and run in
//! parallel, each in a namespace of its own with a subnet of its own.

mod e2e_support;

use std::{
    net::IpAddr,
    process::Command,
    time::{Duration, Instant},
};

use e2e_support::Converge;
use flatnet_k8s::{
    api::{CONFIG_NAME, FlatNetworkConfig, FlatNetworkIP, FlatNetworkSubnet},
    keys::SUBNET_NAMESPACE,
};
use flatnet_operator::nad::NetworkAttachmentDefinition;
use ipnet::IpNet;
use k8s_openapi::api::{
    apps::v1::{DaemonSet, Deployment, StatefulSet},
    coordination::v1::Lease,
    core::v1::{Namespace, Pod, Service},
    discovery::v1::EndpointSlice,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};

/// How long a step may take on a 2-core machine before the test fails.
const CONVERGE: Converge = Converge {
    within: Duration::from_secs(180),
    poll: Duration::from_millis(500),
};
/// The release's namespace (docs/installation.md).
const RELEASE_NAMESPACE: &str = "cattle-flat-network";
const NETWORKS: &str = "k8s.v1.cni.cncf.io/networks";
/// The agent's admin port (`/metrics`), the chart's `agent.adminPort`.
const AGENT_ADMIN_PORT: u16 = 9765;
/// ADDs whose conflict verdict was probed ahead of them, and by them.
const AHEAD_VERDICTS: &str = "flatnet_agent_conflict_probe_add_verdicts_total{source=\"ahead\"}";
const AT_ADD_VERDICTS: &str = "flatnet_agent_conflict_probe_add_verdicts_total{source=\"at_add\"}";
const FLAT_ATTACHMENT: &str = r#"[{"name":"rancher-flat-network","interface":"eth1"}]"#;

/// What `cargo xtask e2e` tells the suite about the cluster it made.
struct E2e {
    client: Client,
    /// The LAN host's network namespace.
    lan_netns: String,
    /// The flat network's master on the node (a Linux bridge).
    master: String,
    /// The LAN host's addresses, with the LAN's prefixes.
    lan_v4: IpNet,
    lan_v6: IpNet,
    /// The image the test pods run (busybox: sh, sleep, ping, nc, httpd).
    image: String,
}

impl E2e {
    /// The cluster, or `None` (the skip said) when the suite was not started
    /// by `cargo xtask e2e`.
    async fn from_env(test: &str) -> Option<Self> {
        if std::env::var("FLATNET_E2E_RELEASE").is_err() {
            e2e_support::report_skip(
                test,
                "no release installed on a cluster (`cargo xtask e2e` runs it)",
            );
            return None;
        }
        let var = |name: &str| {
            std::env::var(name).unwrap_or_else(|_| panic!("cargo xtask e2e sets {name}"))
        };
        Some(Self {
            client: Client::try_default().await.expect("client from KUBECONFIG"),
            lan_netns: var("FLATNET_E2E_LAN_NETNS"),
            master: var("FLATNET_E2E_MASTER"),
            lan_v4: var("FLATNET_E2E_LAN_V4")
                .parse()
                .expect("FLATNET_E2E_LAN_V4"),
            lan_v6: var("FLATNET_E2E_LAN_V6")
                .parse()
                .expect("FLATNET_E2E_LAN_V6"),
            image: var("FLATNET_E2E_IMAGE"),
        })
    }

    /// A fresh namespace for one test, deleted by [`Scope::finish`].
    async fn scope(&self, name: &str) -> Scope {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let _ = namespaces.delete(name, &DeleteParams::default()).await;
        CONVERGE
            .eventually("an earlier namespace of the same name to go", || async {
                namespaces.get_opt(name).await.ok()?.is_none().then_some(())
            })
            .await;
        let namespace: Namespace =
            serde_json::from_value(json!({"metadata": {"name": name}})).unwrap();
        namespaces
            .create(&PostParams::default(), &namespace)
            .await
            .expect("create namespace");
        // Pods cannot be created before the namespace's ServiceAccount exists.
        let accounts: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(self.client.clone(), name);
        CONVERGE
            .eventually("the namespace's default ServiceAccount", || async {
                accounts.get_opt("default").await.ok()?.map(|_| ())
            })
            .await;
        Scope {
            client: self.client.clone(),
            name: name.to_owned(),
            subnets: Vec::new(),
        }
    }

    /// An IPv4 macvlan subnet on the master: addresses `first..=last` of
    /// the LAN (host parts), the LAN host as gateway.
    fn subnet_v4(&self, name: &str, first: u8, last: u8) -> Value {
        let host = self.lan_v4.addr();
        let at = |n: u8| self.lan_v4_host(n);
        json!({
            "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
            "metadata": {"name": name, "namespace": SUBNET_NAMESPACE},
            "spec": {"flatMode": "macvlan", "master": self.master, "mode": "bridge",
                     "cidr": self.lan_v4.trunc().to_string(), "gateway": host.to_string(),
                     "ranges": [{"from": at(first), "to": at(last)}]}
        })
    }

    /// The LAN's IPv4 address whose last byte is `n`.
    fn lan_v4_host(&self, n: u8) -> String {
        let IpAddr::V4(host) = self.lan_v4.addr() else {
            panic!("FLATNET_E2E_LAN_V4 is no IPv4 address")
        };
        let mut octets = host.octets();
        octets[3] = n;
        std::net::Ipv4Addr::from(octets).to_string()
    }

    /// The IPv6 twin of [`E2e::subnet_v4`].
    fn subnet_v6(&self, name: &str, first: u16, last: u16) -> Value {
        let IpAddr::V6(host) = self.lan_v6.addr() else {
            panic!("FLATNET_E2E_LAN_V6 is no IPv6 address")
        };
        let at = |n: u16| {
            let mut segments = host.segments();
            segments[7] = n;
            std::net::Ipv6Addr::from(segments).to_string()
        };
        json!({
            "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
            "metadata": {"name": name, "namespace": SUBNET_NAMESPACE},
            "spec": {"flatMode": "macvlan", "master": self.master, "mode": "bridge",
                     "cidr": self.lan_v6.trunc().to_string(), "gateway": host.to_string(),
                     "ranges": [{"from": at(first), "to": at(last)}]}
        })
    }

    /// A pod template with a flat attachment on `subnets` (comma-separated).
    fn flat_template(&self, app: &str, subnets: &str, ip: &str) -> Value {
        json!({
            "metadata": {
                "labels": {"app": app},
                "annotations": {
                    NETWORKS: FLAT_ATTACHMENT,
                    "flatnetwork.pandaria.io/subnet": subnets,
                    "flatnetwork.pandaria.io/ip": ip,
                }
            },
            "spec": self.pod_spec(),
        })
    }

    /// A container that serves HTTP on port 8080 and lives until deleted.
    fn pod_spec(&self) -> Value {
        json!({
            "terminationGracePeriodSeconds": 1,
            "containers": [{
                "name": "c", "image": self.image, "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", "echo ok > /index.html && exec httpd -f -p 8080 -h /"],
                "securityContext": {"capabilities": {"add": ["NET_RAW"]}}
            }]
        })
    }

    /// Runs `command` in the LAN host's namespace; whether it succeeded.
    fn on_lan_host(&self, command: &[&str]) -> bool {
        in_netns(&self.lan_netns, command)
    }
}

/// One test's namespace and subnets, removed at the end.
struct Scope {
    client: Client,
    name: String,
    subnets: Vec<String>,
}

impl Scope {
    fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// Creates (or takes over) a subnet and waits until it is Active.
    async fn subnet(&mut self, subnet: Value) -> FlatNetworkSubnet {
        let subnets: Api<FlatNetworkSubnet> =
            Api::namespaced(self.client.clone(), SUBNET_NAMESPACE);
        let name = subnet["metadata"]["name"].as_str().unwrap().to_owned();
        subnets
            .patch(
                &name,
                &PatchParams::apply("flatnet-e2e").force(),
                &Patch::Apply(&subnet),
            )
            .await
            .unwrap_or_else(|e| panic!("apply subnet {name}: {e}"));
        self.subnets.push(name.clone());
        CONVERGE
            .eventually(&format!("subnet {name} to be Active"), || async {
                let s = subnets.get(&name).await.ok()?;
                (s.status.as_ref()?.phase == "Active").then_some(s)
            })
            .await
    }

    async fn create<K>(&self, object: Value) -> K
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::Serialize
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
        K::DynamicType: Default,
    {
        let object: K = serde_json::from_value(object).expect("a valid object");
        self.api::<K>()
            .create(&PostParams::default(), &object)
            .await
            .unwrap_or_else(|e| panic!("create {}: {e}", object.name_any()))
    }

    /// Waits for `n` running pods labelled `app` with every flat record
    /// holding an address; returns the pods' flat addresses by pod name.
    async fn running_flat_pods(
        &self,
        app: &str,
        n: usize,
        families: usize,
    ) -> Vec<(String, Vec<IpAddr>)> {
        let pods: Api<Pod> = self.api();
        let records: Api<FlatNetworkIP> = self.api();
        let selector = ListParams::default().labels(&format!("app={app}"));
        CONVERGE
            .eventually(
                &format!("{n} running pods of {app} with flat addresses"),
                || async {
                    let running: Vec<Pod> = pods
                        .list(&selector)
                        .await
                        .ok()?
                        .items
                        .into_iter()
                        .filter(|p| {
                            p.metadata.deletion_timestamp.is_none()
                                && p.status.as_ref().and_then(|s| s.phase.as_deref())
                                    == Some("Running")
                        })
                        .collect();
                    if running.len() != n {
                        return None;
                    }
                    let all = records.list(&ListParams::default()).await.ok()?.items;
                    let mut out = Vec::new();
                    for pod in running {
                        let name = pod.name_any();
                        let addresses: Vec<IpAddr> = all
                            .iter()
                            .filter(|r| record_of(r, &name))
                            .filter(|r| r.status.as_ref().is_some_and(|s| s.phase == "Active"))
                            .filter_map(|r| r.status.as_ref()?.addr)
                            .collect();
                        if addresses.len() != families {
                            return None;
                        }
                        out.push((name, addresses));
                    }
                    Some(out)
                },
            )
            .await
    }

    /// Deletes the namespace, waits until it is gone, then deletes the
    /// subnets, which the operator frees once no record holds them.
    async fn finish(self) {
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let _ = namespaces
            .delete(&self.name, &DeleteParams::default())
            .await;
        CONVERGE
            .eventually(&format!("namespace {} to go", self.name), || async {
                namespaces
                    .get_opt(&self.name)
                    .await
                    .ok()?
                    .is_none()
                    .then_some(())
            })
            .await;
        let subnets: Api<FlatNetworkSubnet> =
            Api::namespaced(self.client.clone(), SUBNET_NAMESPACE);
        for name in &self.subnets {
            let _ = subnets.delete(name, &DeleteParams::default()).await;
            CONVERGE
                .eventually(&format!("subnet {name} to go"), || async {
                    subnets.get_opt(name).await.ok()?.is_none().then_some(())
                })
                .await;
        }
    }
}

/// Whether FlatNetworkIP `record` is the pod's (named like the pod, an
/// IPv6 record with a `.ipv6`-style suffix).
fn record_of(record: &FlatNetworkIP, pod: &str) -> bool {
    let name = record.name_any();
    name == pod
        || name
            .strip_prefix(pod)
            .is_some_and(|rest| rest.starts_with('.'))
}

/// Runs `command` inside network namespace `netns`; whether it succeeded.
fn in_netns(netns: &str, command: &[&str]) -> bool {
    let output = Command::new("ip")
        .args(["netns", "exec", netns])
        .args(command)
        .output()
        .expect("run ip netns exec");
    if !output.status.success() {
        eprintln!(
            "in {netns}: {} failed: {}{}",
            command.join(" "),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    output.status.success()
}

fn host_output(program: &str, args: &[&str]) -> String {
    let output = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The network namespace (containerd's `cni-...`) holding `address`.
fn netns_with(address: IpAddr) -> String {
    let wanted = format!(" {address}/");
    host_output("ip", &["netns", "list"])
        .lines()
        .filter_map(|line| line.split_whitespace().next())
        .find(|name| host_output("ip", &["-n", name, "-o", "addr", "show"]).contains(&wanted))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no network namespace holds {address}"))
}

fn ping_args(address: IpAddr) -> Vec<String> {
    vec![
        "ping".into(),
        if address.is_ipv6() { "-6" } else { "-4" }.into(),
        "-c".into(),
        "2".into(),
        "-W".into(),
        "2".into(),
        address.to_string(),
    ]
}

/// Pings `to` from `netns` until it answers (a new address may need a
/// moment for the LAN's neighbour caches); fails after the convergence bound.
async fn reachable(netns: &str, to: IpAddr) {
    let args = ping_args(to);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    CONVERGE
        .eventually(&format!("{to} to answer pings from {netns}"), || async {
            in_netns(netns, &args).then_some(())
        })
        .await;
}

/// Flat pods over IPv4, IPv6 and dual stack, attached by Multus through
/// flatnet-cni: each reaches the other pods and the LAN host, the LAN host
/// reaches each, and HTTP to a pod's flat address works from the LAN.
#[tokio::test]
async fn flat_pods_reach_each_other_and_the_lan_over_ipv4_ipv6_and_dual_stack() {
    let test = "flat_pods_reach_each_other_and_the_lan_over_ipv4_ipv6_and_dual_stack";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let mut scope = e2e.scope("e2e-traffic").await;
    let (ahead, at_add) = (AHEAD_VERDICTS, AT_ADD_VERDICTS);
    let before = (
        agent_counter(&e2e, ahead).await,
        agent_counter(&e2e, at_add).await,
    );
    scope.subnet(e2e.subnet_v4("e2e-traffic-v4", 20, 29)).await;
    scope
        .subnet(e2e.subnet_v6("e2e-traffic-v6", 0x20, 0x29))
        .await;
    for (app, subnets, families) in [
        ("v4", "e2e-traffic-v4", 1),
        ("v6", "e2e-traffic-v6", 1),
        ("dual", "e2e-traffic-v4,e2e-traffic-v6", 2),
    ] {
        scope
            .create::<Deployment>(json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": app},
                "spec": {"replicas": 2, "selector": {"matchLabels": {"app": app}},
                         "template": e2e.flat_template(app, subnets, "auto")}
            }))
            .await;
        let pods = scope.running_flat_pods(app, 2, families).await;
        for (_, addresses) in &pods {
            for address in addresses {
                reachable(&e2e.lan_netns, *address).await;
                let url = match address {
                    IpAddr::V4(a) => format!("http://{a}:8080/"),
                    IpAddr::V6(a) => format!("http://[{a}]:8080/"),
                };
                assert!(
                    e2e.on_lan_host(&["busybox", "wget", "-q", "-O", "/dev/null", &url]),
                    "HTTP to {url} from the LAN host"
                );
            }
        }
        // Pod to pod and pod to LAN host, from inside the first pod.
        let first = netns_with(pods[0].1[0]);
        for address in &pods[1].1 {
            reachable(&first, *address).await;
        }
        for host in [e2e.lan_v4.addr(), e2e.lan_v6.addr()] {
            if pods[0].1.iter().any(|a| a.is_ipv6() == host.is_ipv6()) {
                reachable(&first, host).await;
            }
        }
    }
    // The chart's conflict probe ran for these ADDs, ahead of them: the
    // agent saw each pod Pending with its address before kubelet's ADD.
    let (took_ahead, probed_at_add) = (
        agent_counter(&e2e, ahead).await - before.0,
        agent_counter(&e2e, at_add).await - before.1,
    );
    println!("ADD verdicts of the 6 pods: {took_ahead} probed ahead, {probed_at_add} at ADD");
    assert!(
        took_ahead >= 1,
        "no ADD took a verdict probed ahead ({probed_at_add} probed at ADD)"
    );
    scope.finish().await;
}

/// A Service selecting flat pods gets its `<name>-flat-network` headless
/// twin whose EndpointSlices list the pods' flat addresses.
#[tokio::test]
async fn a_service_gets_a_headless_twin_with_the_flat_addresses() {
    let test = "a_service_gets_a_headless_twin_with_the_flat_addresses";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let mut scope = e2e.scope("e2e-services").await;
    scope.subnet(e2e.subnet_v4("e2e-services-v4", 30, 39)).await;
    scope
        .create::<Deployment>(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "web"}},
                     "template": e2e.flat_template("web", "e2e-services-v4", "auto")}
        }))
        .await;
    scope
        .create::<Service>(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
        }))
        .await;
    let pods = scope.running_flat_pods("web", 2, 1).await;
    let mut want: Vec<String> = pods.iter().map(|(_, a)| a[0].to_string()).collect();
    want.sort();
    let services: Api<Service> = scope.api();
    let twin = CONVERGE
        .eventually("the web-flat-network Service", || async {
            services.get_opt("web-flat-network").await.ok()?
        })
        .await;
    assert_eq!(
        twin.spec.as_ref().and_then(|s| s.cluster_ip.as_deref()),
        Some("None"),
        "the twin is headless"
    );
    let slices: Api<EndpointSlice> = scope.api();
    let by_service = ListParams::default().labels("kubernetes.io/service-name=web-flat-network");
    CONVERGE
        .eventually(
            "EndpointSlices naming both pods' flat addresses",
            || async {
                let mut got: Vec<String> = slices
                    .list(&by_service)
                    .await
                    .ok()?
                    .items
                    .into_iter()
                    .flat_map(|s| s.endpoints)
                    .flat_map(|e| e.addresses)
                    .collect();
                got.sort();
                (got == want).then_some(())
            },
        )
        .await;
    scope.finish().await;
}

/// Scaling a Deployment to zero gives back every address and pool MAC its
/// pods held; a StatefulSet's pods keep their addresses when recreated and
/// give them back when the StatefulSet goes.
#[tokio::test]
async fn scale_to_zero_frees_everything_and_a_statefulset_keeps_its_addresses() {
    let test = "scale_to_zero_frees_everything_and_a_statefulset_keeps_its_addresses";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let mut scope = e2e.scope("e2e-lifecycle").await;
    scope
        .subnet(e2e.subnet_v4("e2e-lifecycle-v4", 40, 49))
        .await;
    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(e2e.client.clone(), SUBNET_NAMESPACE);
    let records: Api<FlatNetworkIP> = scope.api();
    let held = |addresses: Vec<IpAddr>| {
        let subnets = subnets.clone();
        async move {
            let status = subnets.get("e2e-lifecycle-v4").await.ok()?.status?;
            Some(
                addresses
                    .into_iter()
                    .filter(|a| {
                        status
                            .used_ip
                            .iter()
                            .any(|r| r.bounds().is_some_and(|(from, to)| from <= *a && *a <= to))
                    })
                    .count(),
            )
        }
    };

    scope
        .create::<Deployment>(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {"replicas": 3, "selector": {"matchLabels": {"app": "web"}},
                     "template": e2e.flat_template("web", "e2e-lifecycle-v4", "auto")}
        }))
        .await;
    let pods = scope.running_flat_pods("web", 3, 1).await;
    let addresses: Vec<IpAddr> = pods.iter().map(|(_, a)| a[0]).collect();
    let macs: Vec<String> = records
        .list(&ListParams::default())
        .await
        .expect("list records")
        .items
        .iter()
        .filter_map(|r| r.status.as_ref())
        .filter(|s| s.mac_from_pool)
        .map(|s| s.mac.clone())
        .collect();
    assert_eq!(
        held(addresses.clone()).await,
        Some(3),
        "the ledger holds the pods' addresses"
    );
    let deployments: Api<Deployment> = scope.api();
    deployments
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 0}})),
        )
        .await
        .expect("scale to 0");
    CONVERGE
        .eventually(
            "every record gone and every address given back after scaling to 0",
            || async {
                let left = records.list(&ListParams::default()).await.ok()?.items.len();
                (left == 0 && held(addresses.clone()).await? == 0).then_some(())
            },
        )
        .await;
    CONVERGE
        .eventually("the pods' pool MACs no longer claimed", || async {
            let claimed = claimed_pool_macs(&e2e).await?;
            macs.iter()
                .all(|mac| !claimed.contains(&mac.to_lowercase()))
                .then_some(())
        })
        .await;

    scope
        .create::<StatefulSet>(json!({
            "apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": "db"},
            "spec": {"serviceName": "db", "replicas": 2, "selector": {"matchLabels": {"app": "db"}},
                     "template": e2e.flat_template("db", "e2e-lifecycle-v4", "auto")}
        }))
        .await;
    let mut first = scope.running_flat_pods("db", 2, 1).await;
    first.sort();
    // Every pod recreated: each comes back with its address.
    let pods: Api<Pod> = scope.api();
    let by_app = ListParams::default().labels("app=db");
    let old_uids: Vec<String> = pods
        .list(&by_app)
        .await
        .expect("list the StatefulSet's pods")
        .items
        .iter()
        .map(|p| p.uid().unwrap_or_default())
        .collect();
    pods.delete_collection(&DeleteParams::default(), &by_app)
        .await
        .expect("delete the StatefulSet's pods");
    CONVERGE
        .eventually("the StatefulSet's pods to be recreated", || async {
            let list = pods.list(&by_app).await.ok()?.items;
            let recreated = list.len() == 2
                && list
                    .iter()
                    .all(|p| !old_uids.contains(&p.uid().unwrap_or_default()));
            recreated.then_some(())
        })
        .await;
    let mut second = scope.running_flat_pods("db", 2, 1).await;
    second.sort();
    assert_eq!(first, second, "StatefulSet pods keep their addresses");
    let statefulsets: Api<StatefulSet> = scope.api();
    statefulsets
        .delete("db", &DeleteParams::default())
        .await
        .expect("delete the StatefulSet");
    let kept: Vec<IpAddr> = first.iter().map(|(_, a)| a[0]).collect();
    CONVERGE
        .eventually(
            "the StatefulSet's addresses given back once it is gone",
            || async {
                let left = records.list(&ListParams::default()).await.ok()?.items.len();
                (left == 0 && held(kept.clone()).await? == 0).then_some(())
            },
        )
        .await;
    scope.finish().await;
}

/// The pool MACs the MAC ledgers of the release claim (lower case).
async fn claimed_pool_macs(e2e: &E2e) -> Option<Vec<String>> {
    let maps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(e2e.client.clone(), RELEASE_NAMESPACE);
    let parse = |mac: &str| u64::from_str_radix(&mac.replace([':', '-'], ""), 16).ok();
    let mut claimed = Vec::new();
    for map in maps.list(&ListParams::default()).await.ok()?.items {
        if !map.name_any().starts_with("flatnet-macs-") {
            continue;
        }
        let Some(value) = map.data.as_ref().and_then(|d| d.get("pool.claimed")) else {
            continue;
        };
        for range in value.split_whitespace() {
            let (from, to) = range.split_once('-').unwrap_or((range, range));
            let (from, to) = (parse(from)?, parse(to)?);
            claimed.extend((from..=to).map(|m| {
                let bytes = m.to_be_bytes();
                bytes[2..]
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<Vec<_>>()
                    .join(":")
            }));
        }
    }
    Some(claimed)
}

/// The admission webhook answers through the API server: a subnet with a
/// bad CIDR is refused with the webhook's reason.
#[tokio::test]
async fn the_webhook_refuses_a_bad_subnet() {
    let test = "the_webhook_refuses_a_bad_subnet";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(e2e.client.clone(), SUBNET_NAMESPACE);
    let mut bad = e2e.subnet_v4("e2e-bad", 50, 59);
    bad["spec"]["cidr"] = json!("192.168.150.0/33");
    let bad: FlatNetworkSubnet = serde_json::from_value(bad).unwrap();
    let error = subnets
        .create(&PostParams::default(), &bad)
        .await
        .expect_err("a /33 subnet is refused");
    let kube::Error::Api(status) = error else {
        panic!("expected a refusal from the API server, got {error}")
    };
    assert!(
        status.message.contains("denied the request") && status.message.contains("cidr"),
        "refused by the webhook, naming the field: {}",
        status.message
    );
}

/// Changing a subnet's MTU reaches the flat interfaces of running pods.
#[tokio::test]
async fn a_subnet_mtu_change_reaches_running_pods() {
    let test = "a_subnet_mtu_change_reaches_running_pods";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let mut scope = e2e.scope("e2e-mtu").await;
    scope.subnet(e2e.subnet_v4("e2e-mtu-v4", 60, 69)).await;
    scope
        .create::<Deployment>(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "mtu"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "mtu"}},
                     "template": e2e.flat_template("mtu", "e2e-mtu-v4", "auto")}
        }))
        .await;
    let pods = scope.running_flat_pods("mtu", 1, 1).await;
    let netns = netns_with(pods[0].1[0]);
    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(e2e.client.clone(), SUBNET_NAMESPACE);
    subnets
        .patch(
            "e2e-mtu-v4",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"mtu": 1400}})),
        )
        .await
        .expect("set the subnet's MTU");
    CONVERGE
        .eventually("eth1 of the running pod at MTU 1400", || async {
            host_output("ip", &["-n", &netns, "-o", "link", "show", "eth1"])
                .contains("mtu 1400 ")
                .then_some(())
        })
        .await;
    scope.finish().await;
}

/// The FlatNetworkConfig's `spec.arpPolicy`, edited while everything
/// runs, decides how the next pod's address is announced: the operator
/// re-applies the namespace's NetworkAttachmentDefinition, Multus hands its
/// `flatNetwork` block to flatnet-cni, and the agent sets the pod's
/// interface up by it (`arping`: flatnet announces, `arp_notify` off;
/// the chart's `arp_notify`: the kernel announces).
#[tokio::test]
async fn the_cluster_arp_policy_reaches_the_next_pod() {
    let test = "the_cluster_arp_policy_reaches_the_next_pod";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let mut scope = e2e.scope("e2e-arp").await;
    scope.subnet(e2e.subnet_v4("e2e-arp-v4", 90, 99)).await;
    let configs: Api<FlatNetworkConfig> = Api::all(e2e.client.clone());
    let nads: Api<NetworkAttachmentDefinition> = scope.api();
    let deployments: Api<Deployment> = scope.api();
    // The pod of a new Deployment `app`, once the namespace's attachment
    // names `policy`: its flat interface's `arp_notify` sysctl.
    let arp_notify_of_a_new_pod = |app: &'static str, policy: Option<&'static str>| {
        let (configs, nads, deployments, scope, e2e) =
            (&configs, &nads, &deployments, &scope, &e2e);
        async move {
            configs
                .patch(
                    CONFIG_NAME,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"arpPolicy": policy}})),
                )
                .await
                .expect("set spec.arpPolicy");
            let wanted = format!("\"arpPolicy\":\"{}\"", policy.unwrap_or("arp_notify"));
            CONVERGE
                .eventually(
                    &format!("the attachment of e2e-arp to carry {wanted}"),
                    || async {
                        let nad = nads.get_opt("rancher-flat-network").await.ok()??;
                        let config = nad.spec.config.replace(' ', "");
                        config.contains(&wanted).then_some(())
                    },
                )
                .await;
            deployments
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "apiVersion": "apps/v1", "kind": "Deployment",
                        "metadata": {"name": app},
                        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": app}},
                                 "template": e2e.flat_template(app, "e2e-arp-v4", "auto")}
                    }))
                    .unwrap(),
                )
                .await
                .expect("create the Deployment");
            let pods = scope.running_flat_pods(app, 1, 1).await;
            let netns = netns_with(pods[0].1[0]);
            host_output(
                "ip",
                &[
                    "netns",
                    "exec",
                    &netns,
                    "sysctl",
                    "-n",
                    "net.ipv4.conf.eth1.arp_notify",
                ],
            )
            .trim()
            .to_owned()
        }
    };
    let arping = arp_notify_of_a_new_pod("arping", Some("arping")).await;
    // Back to the chart's setting (the environment's arp_notify) before
    // asserting, so a failure leaves the cluster as it was.
    let chart_default = arp_notify_of_a_new_pod("notify", None).await;
    assert_eq!(
        arping, "0",
        "spec.arpPolicy arping: the kernel does not announce"
    );
    assert_eq!(
        chart_default, "1",
        "the chart's arp_notify: the kernel announces"
    );
    scope.finish().await;
}

/// The MultiNetworkPolicy CRD (`k8s.cni.cncf.io/v1beta1`), as the
/// multi-networkpolicy project defines it; the chart does not install it.
fn multi_network_policy_crd() -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "multi-networkpolicies.k8s.cni.cncf.io"},
        "spec": {
            "group": "k8s.cni.cncf.io", "scope": "Namespaced",
            "names": {"plural": "multi-networkpolicies", "singular": "multi-networkpolicy",
                      "kind": "MultiNetworkPolicy", "shortNames": ["multi-policy"]},
            "versions": [{"name": "v1beta1", "served": true, "storage": true,
                          "schema": {"openAPIV3Schema": {"type": "object",
                              "properties": {"spec": {"type": "object",
                                  "x-kubernetes-preserve-unknown-fields": true}}}}}]
        }
    })
}

/// MultiNetworkPolicies on a real node: the CRD installed while the agents
/// run (they pick it up), a policy denying every ingress to the pods of a
/// namespace stops the LAN host's HTTP to a flat pod; the
/// FlatNetworkConfig's `spec.agents.policyEnforcement: false` lets it
/// through again on every agent, without a restart, and unset (the chart's
/// `true`) stops it again.
#[tokio::test]
async fn a_network_policy_is_enforced_and_the_cluster_setting_turns_it_off() {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;

    let test = "a_network_policy_is_enforced_and_the_cluster_setting_turns_it_off";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let crds: Api<CustomResourceDefinition> = Api::all(e2e.client.clone());
    let crd: CustomResourceDefinition = serde_json::from_value(multi_network_policy_crd()).unwrap();
    match crds.create(&PostParams::default(), &crd).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(error) => panic!("create the MultiNetworkPolicy CRD: {error}"),
    }
    let mut scope = e2e.scope("e2e-policy").await;
    scope.subnet(e2e.subnet_v4("e2e-policy-v4", 100, 109)).await;
    scope
        .create::<Deployment>(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "web"}},
                     "template": e2e.flat_template("web", "e2e-policy-v4", "auto")}
        }))
        .await;
    let pods = scope.running_flat_pods("web", 1, 1).await;
    let url = format!("http://{}:8080/", pods[0].1[0]);
    let served = || async {
        // A dropped SYN would hang wget (busybox's has no timeout flag).
        e2e.on_lan_host(&[
            "timeout",
            "3",
            "busybox",
            "wget",
            "-q",
            "-O",
            "/dev/null",
            &url,
        ])
    };
    CONVERGE
        .eventually("HTTP from the LAN host before any policy", || async {
            served().await.then_some(())
        })
        .await;

    let policies: Api<kube::api::DynamicObject> = Api::namespaced_with(
        e2e.client.clone(),
        "e2e-policy",
        &kube::api::ApiResource {
            group: "k8s.cni.cncf.io".into(),
            version: "v1beta1".into(),
            api_version: "k8s.cni.cncf.io/v1beta1".into(),
            kind: "MultiNetworkPolicy".into(),
            plural: "multi-networkpolicies".into(),
        },
    );
    let deny: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "k8s.cni.cncf.io/v1beta1", "kind": "MultiNetworkPolicy",
        "metadata": {"name": "deny-ingress",
                     "annotations": {"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}
    }))
    .unwrap();
    // The API is served once the CRD is established.
    CONVERGE
        .eventually("the deny policy created", || async {
            policies.create(&PostParams::default(), &deny).await.ok()
        })
        .await;
    CONVERGE
        .eventually("the policy to stop HTTP from the LAN host", || async {
            (!served().await).then_some(())
        })
        .await;

    let configs: Api<FlatNetworkConfig> = Api::all(e2e.client.clone());
    let enforce = |on: Option<bool>| {
        let configs = &configs;
        async move {
            configs
                .patch(
                    CONFIG_NAME,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"agents": {"policyEnforcement": on}}})),
                )
                .await
                .expect("set spec.agents.policyEnforcement");
        }
    };
    enforce(Some(false)).await;
    let opened = CONVERGE.holds(&served).await;
    // Back to the chart's setting before asserting, so a failure leaves
    // the cluster as it was.
    enforce(None).await;
    let closed = CONVERGE.holds(|| async { !served().await }).await;
    assert!(opened, "policyEnforcement false: HTTP goes through");
    assert!(closed, "policyEnforcement unset (true): HTTP stopped again");
    scope.finish().await;
}

/// Whether the agent's log, since `since`, has a line containing `text`
/// (its settings line says what it applies, and where each value is from).
async fn agent_logged(e2e: &E2e, since: Instant, text: &str) -> bool {
    let agents: Api<Pod> = Api::namespaced(e2e.client.clone(), RELEASE_NAMESPACE);
    let by_app = ListParams::default().labels("app.kubernetes.io/component=agent");
    let Ok(list) = agents.list(&by_app).await else {
        return false;
    };
    let params = kube::api::LogParams {
        container: Some("agent".into()),
        // Whole seconds, rounded up: never misses a line written after `since`.
        since_seconds: Some(i64::try_from(since.elapsed().as_secs()).unwrap_or(i64::MAX) + 1),
        ..kube::api::LogParams::default()
    };
    for pod in list.items {
        if let Ok(log) = agents.logs(&pod.name_any(), &params).await
            && log.contains(text)
        {
            return true;
        }
    }
    false
}

/// The sum of the agents' counter `series` (name and labels, as
/// `/metrics` prints it), read through the API server's proxy to each
/// agent pod's admin port (the chart's `agent.adminPort`).
async fn agent_counter(e2e: &E2e, series: &str) -> u64 {
    let agents: Api<Pod> = Api::namespaced(e2e.client.clone(), RELEASE_NAMESPACE);
    let by_app = ListParams::default().labels("app.kubernetes.io/component=agent");
    let list = agents.list(&by_app).await.expect("list the agent pods");
    let mut sum = 0;
    for pod in list.items {
        let path = format!(
            "/api/v1/namespaces/{RELEASE_NAMESPACE}/pods/{}:{AGENT_ADMIN_PORT}/proxy/metrics",
            pod.name_any()
        );
        let request = http::Request::get(path).body(Vec::new()).unwrap();
        let text = e2e
            .client
            .request_text(request)
            .await
            .expect("the agent's /metrics through the API server");
        let prefix = format!("{series} ");
        sum += text
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .map_or(0, |n| n.trim().parse::<u64>().expect("a counter"));
    }
    sum
}

/// The address of a LAN host's interface that holds `address`, removed
/// when dropped: a host on the LAN that uses the address without saying
/// so, until something asks.
struct SilentLanAddress {
    netns: String,
    interface: String,
    address: String,
    /// The interface's MAC, as the agent writes MACs.
    mac: String,
}

impl SilentLanAddress {
    /// Adds `address` (/32) to the interface of `netns` that holds `beside`.
    fn add(netns: &str, beside: IpAddr, address: &str) -> Self {
        let wanted = format!(" {beside}/");
        let addresses = host_output("ip", &["-n", netns, "-o", "addr", "show"]);
        let interface = addresses
            .lines()
            .find(|line| line.contains(&wanted))
            .and_then(|line| line.split_whitespace().nth(1))
            .unwrap_or_else(|| panic!("no interface of {netns} holds {beside}: {addresses}"))
            .to_owned();
        let link = host_output(
            "ip",
            &["-n", netns, "-o", "link", "show", "dev", &interface],
        );
        let mac = link
            .split_whitespace()
            .skip_while(|word| *word != "link/ether")
            .nth(1)
            .unwrap_or_else(|| panic!("no MAC in {link}"))
            .to_owned();
        let cidr = format!("{address}/32");
        assert!(
            in_netns(netns, &["ip", "addr", "add", &cidr, "dev", &interface]),
            "add {cidr} to the LAN host"
        );
        Self {
            netns: netns.to_owned(),
            interface,
            address: cidr,
            mac,
        }
    }
}

impl Drop for SilentLanAddress {
    fn drop(&mut self) {
        in_netns(
            &self.netns,
            &["ip", "addr", "del", &self.address, "dev", &self.interface],
        );
    }
}

/// The conflict probe on a real node: a LAN host uses an address without
/// ever sending from it, so nothing flatnet saw on the wire excludes it.
/// With the FlatNetworkConfig's `spec.agents.conflictProbe.enabled: false`
/// a pod asking for that address gets it; unset (the chart's probe, on,
/// 500 ms), the next pod asking for it is refused: the LAN host answers
/// the probe, and the pod's Event names the address and the host's MAC.
#[tokio::test]
async fn the_conflict_probe_refuses_an_address_a_lan_host_answers_for() {
    use k8s_openapi::api::core::v1::Event;

    let test = "the_conflict_probe_refuses_an_address_a_lan_host_answers_for";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let mut scope = e2e.scope("e2e-probe").await;
    scope.subnet(e2e.subnet_v4("e2e-probe-v4", 110, 119)).await;
    let taken = e2e.lan_v4_host(115);
    let lan_host = SilentLanAddress::add(&e2e.lan_netns, e2e.lan_v4.addr(), &taken);
    let configs: Api<FlatNetworkConfig> = Api::all(e2e.client.clone());
    // Sets `enabled` and waits until the agent logs the probe it applies.
    let probe = |enabled: Option<bool>, applied: &'static str| {
        let (configs, e2e) = (&configs, &e2e);
        async move {
            let since = Instant::now();
            configs
                .patch(
                    CONFIG_NAME,
                    &PatchParams::default(),
                    &Patch::Merge(
                        json!({"spec": {"agents": {"conflictProbe": {"enabled": enabled}}}}),
                    ),
                )
                .await
                .expect("set spec.agents.conflictProbe.enabled");
            CONVERGE.holds(|| agent_logged(e2e, since, applied)).await
        }
    };
    let pod_asking_for = |name: &str| {
        let mut pod = e2e.flat_template(name, "e2e-probe-v4", &taken);
        pod["apiVersion"] = json!("v1");
        pod["kind"] = json!("Pod");
        pod["metadata"]["name"] = json!(name);
        pod
    };
    let pods: Api<Pod> = scope.api();
    let records: Api<FlatNetworkIP> = scope.api();

    let off_applied = probe(
        Some(false),
        "conflictProbe off (enabled from FlatNetworkConfig)",
    )
    .await;
    scope.create::<Pod>(pod_asking_for("unprobed")).await;
    let unprobed_got_it = CONVERGE
        .holds(|| async {
            let pod = pods.get("unprobed").await.ok();
            let running = pod
                .and_then(|p| p.status?.phase)
                .is_some_and(|phase| phase == "Running");
            let record = records.get_opt("unprobed").await.ok().flatten();
            let addr = record.and_then(|r| r.status?.addr);
            running && addr.is_some_and(|a| a.to_string() == taken)
        })
        .await;
    let _ = pods.delete("unprobed", &DeleteParams::default()).await;
    CONVERGE
        .eventually("the unprobed pod and its record to go", || async {
            let pod_gone = pods.get_opt("unprobed").await.ok()?.is_none();
            let record_gone = records.get_opt("unprobed").await.ok()?.is_none();
            (pod_gone && record_gone).then_some(())
        })
        .await;

    // Back to the chart's setting; the rest of the test runs under it.
    let on_applied = probe(None, "conflictProbe on, 500 ms (enabled from environment").await;
    scope.create::<Pod>(pod_asking_for("probed")).await;
    let events: Api<Event> = scope.api();
    let wanted = [
        format!("address {taken} of pod e2e-probe/probed"),
        "is already in use on the LAN".to_owned(),
        format!("by MAC {}", lan_host.mac),
    ];
    let messages = || async {
        let on_the_pod = ListParams::default().fields("involvedObject.name=probed");
        let list = events.list(&on_the_pod).await.map(|l| l.items);
        list.unwrap_or_default()
            .into_iter()
            .filter_map(|event| event.message)
            .collect::<Vec<_>>()
    };
    let refused = CONVERGE
        .holds(|| async {
            messages()
                .await
                .iter()
                .any(|m| wanted.iter().all(|part| m.contains(part.as_str())))
        })
        .await;
    let probed = pods.get("probed").await.expect("read the probed pod");
    let probed_phase = probed.status.and_then(|s| s.phase);
    drop(lan_host);
    assert!(
        off_applied,
        "the agent logs conflictProbe off from the FlatNetworkConfig"
    );
    assert!(unprobed_got_it, "probe off: the pod runs with {taken}");
    assert!(
        on_applied,
        "the agent logs the chart's probe again once unset"
    );
    assert!(
        refused,
        "probe on: an Event on the pod says {wanted:?}; its Events: {:?}",
        messages().await
    );
    assert_ne!(
        probed_phase.as_deref(),
        Some("Running"),
        "the refused pod does not run"
    );
    scope.finish().await;
}

/// Restarting the agent (its pod deleted, the DaemonSet starting another)
/// does not interrupt traffic to a running flat pod.
#[tokio::test]
async fn an_agent_restart_under_traffic_drops_nothing() {
    let test = "an_agent_restart_under_traffic_drops_nothing";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let mut scope = e2e.scope("e2e-agent-restart").await;
    scope.subnet(e2e.subnet_v4("e2e-restart-v4", 70, 79)).await;
    scope
        .create::<Deployment>(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "steady"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "steady"}},
                     "template": e2e.flat_template("steady", "e2e-restart-v4", "auto")}
        }))
        .await;
    let pods = scope.running_flat_pods("steady", 1, 1).await;
    let address = pods[0].1[0];
    reachable(&e2e.lan_netns, address).await;

    // 20 s of pings at 20 per second while the agent is replaced.
    let ping = std::thread::spawn({
        let lan = e2e.lan_netns.clone();
        move || {
            Command::new("ip")
                .args([
                    "netns", "exec", &lan, "ping", "-4", "-i", "0.05", "-c", "400", "-W", "1",
                ])
                .arg(address.to_string())
                .output()
                .expect("run ping")
        }
    });
    let agents: Api<Pod> = Api::namespaced(e2e.client.clone(), RELEASE_NAMESPACE);
    let by_app = ListParams::default().labels("app.kubernetes.io/component=agent");
    let old = agents.list(&by_app).await.expect("list agents").items;
    assert_eq!(old.len(), 1, "one agent on the one node");
    tokio::time::sleep(Duration::from_secs(2)).await;
    agents
        .delete(&old[0].name_any(), &DeleteParams::default())
        .await
        .expect("delete the agent's pod");
    let daemonsets: Api<DaemonSet> = Api::namespaced(e2e.client.clone(), RELEASE_NAMESPACE);
    CONVERGE
        .eventually("a new agent ready", || async {
            let list = agents.list(&by_app).await.ok()?.items;
            let fresh = list.iter().any(|p| p.uid() != old[0].uid());
            let ds = daemonsets.get("flatnet-agent").await.ok()?;
            let ready = ds.status.as_ref()?.number_ready == 1;
            (fresh && ready).then_some(())
        })
        .await;
    let output = ping.join().expect("ping thread");
    let summary = String::from_utf8_lossy(&output.stdout);
    assert!(
        summary.contains("400 packets transmitted, 400 received"),
        "every ping answered while the agent restarted: {summary}"
    );
    scope.finish().await;
}

/// Pods started one at a time by `pod_start_with_and_without_a_flat_attachment`.
const POD_START_PODS: usize = 50;

/// From the create request to the watch showing the pod Ready, seen by
/// this client, for each of [`POD_START_PODS`] pods with a flat attachment
/// through Multus and as many without, alternating, one at a time; each
/// pod is deleted (grace 0) once Ready. Writes a Markdown table to the
/// file `FLATNET_E2E_POD_START_OUT` names (`cargo xtask bench pod-start`).
#[tokio::test]
#[ignore = "the measurement of `cargo xtask bench pod-start`"]
async fn pod_start_with_and_without_a_flat_attachment() {
    use futures::{StreamExt as _, TryStreamExt as _};
    use kube::runtime::{WatchStreamExt as _, watcher};

    let test = "pod_start_with_and_without_a_flat_attachment";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let out = std::env::var("FLATNET_E2E_POD_START_OUT")
        .expect("cargo xtask bench pod-start sets FLATNET_E2E_POD_START_OUT");
    let mut scope = e2e.scope("e2e-pod-start").await;
    scope
        .subnet(e2e.subnet_v4("e2e-pod-start-v4", 120, 199))
        .await;
    let pods: Api<Pod> = scope.api();
    let verdicts = [AHEAD_VERDICTS, AT_ADD_VERDICTS];
    let verdicts_before = [
        agent_counter(&e2e, verdicts[0]).await,
        agent_counter(&e2e, verdicts[1]).await,
    ];
    let ready = |pod: &Pod| {
        pod.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
    };
    let mut times: [Vec<Duration>; 2] = Default::default();
    for i in 0..2 * POD_START_PODS {
        let flat = i % 2 == 0;
        let name = format!("start-{i}");
        let mut pod = if flat {
            e2e.flat_template("start", "e2e-pod-start-v4", "auto")
        } else {
            json!({"metadata": {"labels": {"app": "start"}}, "spec": e2e.pod_spec()})
        };
        pod["apiVersion"] = json!("v1");
        pod["kind"] = json!("Pod");
        pod["metadata"]["name"] = json!(name);
        let pod: Pod = serde_json::from_value(pod).unwrap();
        // Watching before the create: the Ready update cannot be missed.
        let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
        let mut updates = watcher(pods.clone(), config).applied_objects().boxed();
        let started = Instant::now();
        pods.create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("create {name}: {e}"));
        let took = tokio::time::timeout(CONVERGE.within, async {
            while let Some(pod) = updates.try_next().await.expect("watch the pod") {
                if ready(&pod) {
                    return started.elapsed();
                }
            }
            panic!("the watch of {name} ended")
        })
        .await
        .unwrap_or_else(|_| panic!("{name} not Ready within {:?}", CONVERGE.within));
        times[usize::from(!flat)].push(took);
        pods.delete(&name, &DeleteParams::default().grace_period(0))
            .await
            .unwrap_or_else(|e| panic!("delete {name}: {e}"));
    }
    for samples in &mut times {
        samples.sort();
    }
    // Nearest rank, in milliseconds.
    let at = |samples: &[Duration], percent: usize| {
        let rank = (samples.len() * percent)
            .div_ceil(100)
            .clamp(1, samples.len());
        samples[rank - 1].as_secs_f64() * 1000.0
    };
    let [flat, plain] = &times;
    let (ahead, at_add) = (
        agent_counter(&e2e, verdicts[0]).await - verdicts_before[0],
        agent_counter(&e2e, verdicts[1]).await - verdicts_before[1],
    );
    let table = format!(
        "| pod | pods | creation to Ready p50 | p99 |\n| --- | ---: | ---: | ---: |\n\
         | with a flat attachment (Multus, flatnet-cni) | {} | {:.0} ms | {:.0} ms |\n\
         | without (the primary network only) | {} | {:.0} ms | {:.0} ms |\n\n\
         The flat attachment adds {:.0} ms at p50 and {:.0} ms at p99. \
         Conflict verdicts of the flat pods' ADDs (the chart's probe): {ahead} \
         probed ahead of the ADD, {at_add} probed by the ADD.\n",
        flat.len(),
        at(flat, 50),
        at(flat, 99),
        plain.len(),
        at(plain, 50),
        at(plain, 99),
        at(flat, 50) - at(plain, 50),
        at(flat, 99) - at(plain, 99),
    );
    print!("{table}");
    std::fs::write(&out, table).unwrap_or_else(|e| panic!("write {out}: {e}"));
    scope.finish().await;
}

/// Two operator replicas (the chart's default): the leader's pod killed,
/// the other takes the Lease and serves the next pod.
#[tokio::test]
async fn the_next_operator_replica_takes_over_from_a_killed_leader() {
    let test = "the_next_operator_replica_takes_over_from_a_killed_leader";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let leases: Api<Lease> = Api::namespaced(e2e.client.clone(), RELEASE_NAMESPACE);
    let holder = |lease: &Lease| lease.spec.as_ref()?.holder_identity.clone();
    let lease_name = leases
        .list(&ListParams::default())
        .await
        .expect("list leases")
        .items
        .into_iter()
        .find(|l| l.name_any().contains("operator") && holder(l).is_some())
        .map(|l| l.name_any())
        .expect("the operator's leader Lease");
    let leader = holder(&leases.get(&lease_name).await.unwrap()).expect("a holder");
    let operators: Api<Pod> = Api::namespaced(e2e.client.clone(), RELEASE_NAMESPACE);
    let started = Instant::now();
    operators
        .delete(&leader, &DeleteParams::default().grace_period(0))
        .await
        .unwrap_or_else(|e| panic!("kill the leader {leader}: {e}"));
    let next = CONVERGE
        .eventually("another replica holding the Lease", || async {
            let now = holder(&leases.get(&lease_name).await.ok()?)?;
            (now != leader).then_some(now)
        })
        .await;
    println!(
        "leader {leader} killed; {next} took over after {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // The new leader does the work: a new flat pod gets its address.
    let mut scope = e2e.scope("e2e-failover").await;
    scope.subnet(e2e.subnet_v4("e2e-failover-v4", 80, 89)).await;
    scope
        .create::<Deployment>(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "after"},
            "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "after"}},
                     "template": e2e.flat_template("after", "e2e-failover-v4", "auto")}
        }))
        .await;
    let pods = scope.running_flat_pods("after", 1, 1).await;
    reachable(&e2e.lan_netns, pods[0].1[0]).await;
    scope.finish().await;
}

/// A LoadBalancer Service of the floating-IP class gets an address of a
/// FloatingIPPool on the flat network, and the node answers ARP for it on
/// the LAN.
#[tokio::test]
async fn a_floating_ip_load_balancer_is_answered_on_the_lan() {
    let test = "a_floating_ip_load_balancer_is_answered_on_the_lan";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let at = |n: u8| e2e.lan_v4_host(n);
    let pools: Api<kube::api::DynamicObject> = Api::all_with(
        e2e.client.clone(),
        &kube::api::ApiResource {
            group: "flatnetwork.pandaria.io".into(),
            version: "v1".into(),
            api_version: "flatnetwork.pandaria.io/v1".into(),
            kind: "FloatingIPPool".into(),
            plural: "floatingippools".into(),
        },
    );
    pools
        .patch(
            "e2e-floating",
            &PatchParams::apply("flatnet-e2e").force(),
            &Patch::Apply(json!({
                "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FloatingIPPool",
                "metadata": {"name": "e2e-floating"},
                "spec": {"cidrs": [e2e.lan_v4.trunc().to_string()],
                         "ranges": [{"from": at(200), "to": at(209)}],
                         "targetNetworkInterface": e2e.master}
            })),
        )
        .await
        .expect("apply the FloatingIPPool");
    let scope = e2e.scope("e2e-floating").await;
    scope
        .create::<Service>(json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "lb"},
            "spec": {"type": "LoadBalancer",
                     "loadBalancerClass": "flatnetwork.pandaria.io/floating-ip",
                     "selector": {"app": "lb"},
                     "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}
        }))
        .await;
    let services: Api<Service> = scope.api();
    let address = CONVERGE
        .eventually("the Service's floating address", || async {
            let service = services.get("lb").await.ok()?;
            service
                .status?
                .load_balancer?
                .ingress?
                .into_iter()
                .find_map(|i| i.ip)
        })
        .await;
    let lan_link = host_output("ip", &["-n", &e2e.lan_netns, "-o", "link", "show"])
        .lines()
        .filter_map(|line| line.split(": ").nth(1))
        .map(|name| name.split('@').next().unwrap_or(name).to_owned())
        .find(|name| name != "lo")
        .expect("the LAN host's interface");
    CONVERGE
        .eventually(
            &format!("an ARP reply for {address} on the LAN"),
            || async {
                e2e.on_lan_host(&["arping", "-c", "2", "-w", "3", "-I", &lan_link, &address])
                    .then_some(())
            },
        )
        .await;
    scope.finish().await;
    let _ = pools.delete("e2e-floating", &DeleteParams::default()).await;
}

/// Right after `helm install` and after `helm upgrade` (a step of
/// `cargo xtask e2e`): the cluster configuration object reports Available,
/// which is what `kubectl wait flatnetworkconfig cluster --for
/// condition=Available` (the chart's notes) waits for, and the agent and
/// the operator are ready.
#[tokio::test]
#[ignore = "a step of `cargo xtask e2e`, run after helm install and upgrade"]
async fn the_release_becomes_available() {
    let test = "the_release_becomes_available";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let configs: Api<FlatNetworkConfig> = Api::all(e2e.client.clone());
    let within = Converge {
        within: Duration::from_secs(300),
        poll: Duration::from_secs(1),
    };
    // Each new set of conditions is printed: a start that stalls says where.
    let last = std::cell::RefCell::new(String::new());
    let started = Instant::now();
    let available = within
        .eventually("FlatNetworkConfig cluster Available=True", || {
            let configs = configs.clone();
            let last = &last;
            async move {
                let config = configs.get_opt("cluster").await.ok()??;
                let conditions = config.status.map(|s| s.conditions).unwrap_or_default();
                let summary: Vec<String> = conditions
                    .iter()
                    .map(|c| format!("{}={} {}: {}", c.type_, c.status, c.reason, c.message))
                    .collect();
                let summary = summary.join("; ");
                if *last.borrow() != summary {
                    println!("{:>5.1} s  {summary}", started.elapsed().as_secs_f64());
                    *last.borrow_mut() = summary;
                }
                conditions
                    .into_iter()
                    .find(|c| c.type_ == "Available" && c.status == "True")
            }
        })
        .await;
    println!("Available: {} ({})", available.reason, available.message);
    let daemonsets: Api<DaemonSet> = Api::namespaced(e2e.client.clone(), RELEASE_NAMESPACE);
    let agent = daemonsets
        .get("flatnet-agent")
        .await
        .expect("the agent DaemonSet");
    assert_eq!(
        agent.status.map(|s| s.number_ready),
        Some(1),
        "the agent is ready"
    );
    let deployments: Api<Deployment> = Api::namespaced(e2e.client.clone(), RELEASE_NAMESPACE);
    let operator = deployments
        .get("flatnet-operator")
        .await
        .expect("the operator Deployment");
    assert_eq!(
        operator.status.and_then(|s| s.ready_replicas),
        Some(2),
        "both operator replicas are ready"
    );
}

/// After `helm uninstall` of both charts (a step of `cargo xtask e2e`):
/// nothing of flatnet is left in the cluster but what docs/installation.md
/// says is kept on purpose, the CRDs (`helm.sh/resource-policy: keep`, so an
/// uninstall never deletes users' subnets and addresses) and the
/// FlatNetworkConfig `cluster`; the operator's NetworkAttachmentDefinitions
/// in every namespace go too.
#[tokio::test]
#[ignore = "a step of `cargo xtask e2e`, run after helm uninstall"]
async fn nothing_is_left_after_uninstall() {
    let test = "nothing_is_left_after_uninstall";
    let Some(e2e) = E2e::from_env(test).await else {
        return;
    };
    let client = e2e.client.clone();
    let mut left = Vec::new();
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client.clone());
    let kept = crds
        .list(&ListParams::default())
        .await
        .expect("list CRDs")
        .items
        .iter()
        .filter(|c| c.name_any().ends_with(".flatnetwork.pandaria.io"))
        .count();
    assert!(kept > 0, "the CRDs are kept, as documented");
    let webhooks: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> =
        Api::all(client.clone());
    for webhook in webhooks.list(&ListParams::default()).await.unwrap().items {
        if webhook.name_any().contains("flatnet") {
            left.push(format!(
                "ValidatingWebhookConfiguration {}",
                webhook.name_any()
            ));
        }
    }
    let roles: Api<k8s_openapi::api::rbac::v1::ClusterRole> = Api::all(client.clone());
    for role in roles.list(&ListParams::default()).await.unwrap().items {
        if role.name_any().contains("flatnet") {
            left.push(format!("ClusterRole {}", role.name_any()));
        }
    }
    let bindings: Api<k8s_openapi::api::rbac::v1::ClusterRoleBinding> = Api::all(client.clone());
    for binding in bindings.list(&ListParams::default()).await.unwrap().items {
        if binding.name_any().contains("flatnet") {
            left.push(format!("ClusterRoleBinding {}", binding.name_any()));
        }
    }
    // The operator's attachments go with the webhook configuration that owns
    // them, by the garbage collector, a moment after the uninstall.
    let nads: Api<NetworkAttachmentDefinition> = Api::all(client.clone());
    CONVERGE
        .eventually(
            "the operator's NetworkAttachmentDefinitions to go",
            || async {
                let left = nads.list(&ListParams::default()).await.ok()?.items;
                left.iter()
                    .all(|nad| nad.name_any() != "rancher-flat-network")
                    .then_some(())
            },
        )
        .await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    CONVERGE
        .eventually("flatnet's pods to go", || async {
            pods.list(&ListParams::default())
                .await
                .ok()?
                .items
                .is_empty()
                .then_some(())
        })
        .await;
    assert!(left.is_empty(), "left after helm uninstall: {left:#?}");
}
