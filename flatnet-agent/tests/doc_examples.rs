//! The parts of the examples under `docs/<example>/` the node agent reads,
//! checked with the agent's own parsers:
//! - every NetworkAttachmentDefinition's `spec.config` is a configuration
//!   flatnet-cni accepts (`NetworkConfig::decode`);
//! - every standalone state file (a document with `subnets` and `networks`)
//!   passes `StateFile::validate`;
//! - every MultiNetworkPolicy parses as the agent's API type, applies to the
//!   flat network (`policy-for`), and compiles without diagnostics against
//!   the example's own pods; for `docs/policy` the traffic its README
//!   promises is allowed and the rest is denied.
//!
//! The examples of `docs/runtime-config.md` are checked the same way
//! (state files, PodNetworkConfigs, the other kinds parsed).
//!
//! Subnets and workloads are checked through the admission webhook by
//! `flatnet-operator`'s `doc_examples` test.

#[path = "../../flatnet-operator/src/doc_examples/markdown.rs"]
mod markdown;

use std::{
    collections::BTreeMap,
    fs,
    net::IpAddr,
    path::{Path, PathBuf},
};

use flatnet_agent::{
    cni::config::NetworkConfig,
    desired::standalone::StateFile,
    policy_compiler::{FlatPod, MultiNetworkPolicy, NetworkNames, PolicyInputs, compile},
};
use flatnet_common::policy::{Direction, proto};
use flatnet_k8s::{
    api::FlatNetworkSubnet, ipam::Pool, keys::annotation, validation::validate_subnet,
};
use serde_json::Value;

fn docs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs")
}

/// Every `docs/` subdirectory with YAML files and its documents, each with
/// the file it came from.
fn examples() -> Vec<(String, Vec<(String, Value)>)> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(docs_dir())
        .expect("read docs/")
        .map(|entry| entry.expect("docs/ entry").path())
        .filter(|path| path.is_dir())
        .collect();
    dirs.sort();
    dirs.into_iter()
        .filter_map(|dir| {
            let mut files: Vec<PathBuf> = fs::read_dir(&dir)
                .expect("read example")
                .map(|entry| entry.expect("entry").path())
                .filter(|p| p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
                .collect();
            files.sort();
            let documents: Vec<(String, Value)> = files
                .iter()
                .flat_map(|file| {
                    let text = fs::read_to_string(file).expect("read manifest");
                    let origin = file.display().to_string();
                    serde_yaml::Deserializer::from_str(&text)
                        .map(|document| {
                            let value: Value = serde::Deserialize::deserialize(document)
                                .unwrap_or_else(|e| panic!("{origin}: not valid YAML: {e}"));
                            (origin.clone(), value)
                        })
                        .filter(|(_, value)| !value.is_null())
                        .collect::<Vec<_>>()
                })
                .collect();
            let name = dir.file_name()?.to_string_lossy().into_owned();
            (!documents.is_empty()).then_some((name, documents))
        })
        .collect()
}

fn check_attachment(origin: &str, object: &Value) {
    let config = object["spec"]["config"]
        .as_str()
        .unwrap_or_else(|| panic!("{origin}: spec.config must be a JSON string"));
    let config = NetworkConfig::decode(config.as_bytes())
        .unwrap_or_else(|e| panic!("{origin}: flatnet-cni refuses the config: {e:?}"));
    assert_eq!(
        config.plugin_type, "flatnet-cni",
        "{origin}: type must be flatnet-cni"
    );
}

fn check_state_file(origin: &str, document: &Value) {
    let state: StateFile = serde_json::from_value(document.clone())
        .unwrap_or_else(|e| panic!("{origin}: not a state file: {e}"));
    if let Err(problems) = state.validate() {
        panic!("{origin}: the agent refuses the state file: {problems:?}");
    }
}

/// The example's flat pods: one per replica of each workload, with the pod
/// template's labels and an address allocated from the named subnet the
/// way the operator does (candidates first, else the lowest free).
fn flat_pods(documents: &[(String, Value)]) -> Vec<FlatPod> {
    let mut pools: BTreeMap<String, Pool> = documents
        .iter()
        .filter(|(_, d)| d["kind"] == "FlatNetworkSubnet")
        .map(|(origin, d)| {
            let subnet: FlatNetworkSubnet = serde_json::from_value(d.clone()).expect(origin);
            let name = subnet.metadata.name.clone().expect("subnet name");
            let valid = validate_subnet(&name, &subnet.spec).expect(origin);
            (name, Pool::new(&valid))
        })
        .collect();
    let mut pods = Vec::new();
    for (origin, document) in documents {
        let (template, replicas) = match document["kind"].as_str() {
            Some("Pod") => (document.clone(), 1),
            Some("Deployment" | "StatefulSet") => (
                document["spec"]["template"].clone(),
                document["spec"]["replicas"].as_u64().unwrap_or(1),
            ),
            _ => continue,
        };
        let annotations = &template["metadata"]["annotations"];
        let Some(subnet) = annotations[annotation::SUBNET].as_str() else {
            continue;
        };
        let labels: BTreeMap<String, String> =
            serde_json::from_value(template["metadata"]["labels"].clone()).unwrap_or_default();
        let namespace = document["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default");
        let name = document["metadata"]["name"].as_str().expect("name");
        for replica in 0..replicas {
            let pool = pools
                .get_mut(subnet)
                .unwrap_or_else(|| panic!("{origin}: subnet {subnet} is not in the example"));
            let ip = pool.allocate_auto().expect("the example's pool has room");
            pods.push(FlatPod {
                namespace: namespace.into(),
                name: format!("{name}-{replica}"),
                labels: labels.clone(),
                ips: vec![ip],
                local: true,
            });
        }
    }
    pods
}

fn check_policies(example: &str, documents: &[(String, Value)]) -> Option<CheckedPolicy> {
    let policies: Vec<MultiNetworkPolicy> = documents
        .iter()
        .filter(|(_, d)| d["kind"] == "MultiNetworkPolicy")
        .map(|(origin, d)| {
            let policy: MultiNetworkPolicy = serde_json::from_value(d.clone())
                .unwrap_or_else(|e| panic!("{origin}: not a MultiNetworkPolicy: {e}"));
            let namespace = policy.metadata.namespace.as_deref().unwrap_or("default");
            assert!(
                NetworkNames::default().selects(namespace, policy.metadata.annotations.as_ref()),
                "{origin}: k8s.v1.cni.cncf.io/policy-for does not name the flat network, so the policy is ignored"
            );
            policy
        })
        .collect();
    if policies.is_empty() {
        return None;
    }
    let pods = flat_pods(documents);
    let networks = NetworkNames::default();
    let compiled = compile(PolicyInputs {
        policies: &policies,
        networks: &networks,
        namespaces: &BTreeMap::new(),
        pods: &pods,
    });
    assert!(
        compiled.diagnostics.is_empty(),
        "docs/{example}: policies not enforceable as written: {:?}",
        compiled.diagnostics
    );
    assert!(
        !compiled.subjects.is_empty(),
        "docs/{example}: the policies isolate no pod of the example"
    );
    Some(CheckedPolicy { pods, compiled })
}

#[derive(Debug)]
struct CheckedPolicy {
    pods: Vec<FlatPod>,
    compiled: flatnet_agent::policy_compiler::CompiledPolicy,
}

impl CheckedPolicy {
    fn address_of(&self, label: (&str, &str)) -> IpAddr {
        self.pods
            .iter()
            .find(|p| p.labels.get(label.0).map(String::as_str) == Some(label.1))
            .unwrap_or_else(|| panic!("no pod labelled {label:?}"))
            .ips[0]
    }

    fn web_accepts(&self, from: IpAddr, port: u16) -> bool {
        let web = self.address_of(("app", "web"));
        self.compiled
            .allows(Direction::Ingress, web, from, proto::TCP, Some(port))
    }
}

/// What `docs/policy/README.md` promises about `04-policy.yaml`.
fn check_policy_readme_promises(checked: &CheckedPolicy) {
    let frontend = checked.address_of(("role", "frontend"));
    let other = checked.address_of(("app", "other"));
    let monitoring: IpAddr = "192.168.40.250".parse().unwrap();
    let lan_host: IpAddr = "192.168.40.251".parse().unwrap();
    assert!(checked.web_accepts(frontend, 80), "frontend -> web:80");
    assert!(checked.web_accepts(monitoring, 80), "monitoring -> web:80");
    assert!(!checked.web_accepts(other, 80), "other -> web:80");
    assert!(!checked.web_accepts(lan_host, 80), "LAN host -> web:80");
    assert!(!checked.web_accepts(frontend, 22), "frontend -> web:22");
    let web = checked.address_of(("app", "web"));
    assert!(
        checked
            .compiled
            .allows(Direction::Egress, web, other, proto::TCP, Some(80)),
        "web's egress is not isolated"
    );
}

#[test]
fn the_examples_parse_with_the_agents_parsers() {
    let examples = examples();
    let mut checked = BTreeMap::<&str, usize>::new();
    for (example, documents) in &examples {
        for (origin, document) in documents {
            match document["kind"].as_str() {
                Some("NetworkAttachmentDefinition") => {
                    check_attachment(origin, document);
                    *checked.entry("NetworkAttachmentDefinition").or_default() += 1;
                }
                None if document.get("networks").is_some() => {
                    check_state_file(origin, document);
                    *checked.entry("state file").or_default() += 1;
                }
                _ => {}
            }
        }
        if let Some(policy) = check_policies(example, documents) {
            *checked.entry("MultiNetworkPolicy").or_default() += 1;
            if example == "policy" {
                check_policy_readme_promises(&policy);
            }
        }
    }
    println!("checked: {checked:?}");
    for kind in [
        "NetworkAttachmentDefinition",
        "state file",
        "MultiNetworkPolicy",
    ] {
        assert!(
            checked.contains_key(kind),
            "no example has a {kind}: the docs lost it, or this test no longer finds it"
        );
    }
}

#[test]
fn a_broken_policy_example_is_reported() {
    let policy: Value = serde_json::json!({
        "apiVersion": "k8s.cni.cncf.io/v1beta1", "kind": "MultiNetworkPolicy",
        "metadata": {"name": "p", "namespace": "default",
                     "annotations": {"k8s.v1.cni.cncf.io/policy-for": "rancher-flat-network"}},
        "spec": {"podSelector": {}, "ingress": [{"ports": [{"port": "http"}]}]},
    });
    let subnet: Value = serde_json::json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
        "metadata": {"name": "lan", "namespace": "cattle-flat-network"},
        "spec": {"flatMode": "macvlan", "master": "eth0", "cidr": "10.0.0.0/24"},
    });
    let pod: Value = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web", "namespace": "default",
                     "annotations": {annotation::SUBNET: "lan", annotation::IP: "auto"}},
    });
    let documents = vec![
        ("subnet".to_owned(), subnet),
        ("pod".to_owned(), pod),
        ("policy".to_owned(), policy),
    ];
    let failure = std::panic::catch_unwind(|| check_policies("broken", &documents))
        .expect_err("a named port must fail the example");
    let message = failure.downcast_ref::<String>().expect("a message");
    assert!(message.contains("not enforceable"), "{message}");

    let bad_config = serde_json::json!({"spec": {"config": r#"{"cniVersion": "1.0.0", "name": "x", "type": "flatnet-cni", "mtu": 10}"#}});
    std::panic::catch_unwind(|| check_attachment("nad", &bad_config))
        .expect_err("an MTU of 10 must fail the example");
}

/// The ```yaml blocks of `docs/runtime-config.md`: every standalone state
/// file validates, every PodNetworkConfig passes the webhook's own checks,
/// every other object parses as its kind.
#[test]
fn runtime_config_examples_are_what_the_agent_and_the_webhook_accept() {
    let text = fs::read_to_string(docs_dir().join("runtime-config.md")).expect("read the page");
    let blocks = markdown::yaml_blocks(&text);
    let mut state_files = 0;
    for (index, block) in blocks.iter().enumerate() {
        let origin = format!("docs/runtime-config.md yaml block {index}");
        let value: Value =
            serde_yaml::from_str(block).unwrap_or_else(|e| panic!("{origin}: not YAML: {e}"));
        match value["kind"].as_str() {
            None if value.get("subnets").is_some() => {
                check_state_file(&origin, &value);
                state_files += 1;
            }
            Some("PodNetworkConfig") => {
                let config: flatnet_k8s::api::PodNetworkConfig = serde_json::from_value(value)
                    .unwrap_or_else(|e| panic!("{origin}: not a PodNetworkConfig: {e}"));
                assert_eq!(config.spec.problems(), Vec::<String>::new(), "{origin}");
            }
            Some("FlatNetworkNodeConfig") => {
                serde_json::from_value::<flatnet_k8s::api::FlatNetworkNodeConfig>(value)
                    .unwrap_or_else(|e| panic!("{origin}: not a FlatNetworkNodeConfig: {e}"));
            }
            Some("FlatNetworkSubnet") => {
                serde_json::from_value::<FlatNetworkSubnet>(value)
                    .unwrap_or_else(|e| panic!("{origin}: not a FlatNetworkSubnet: {e}"));
            }
            other => panic!("{origin}: an example of no known kind ({other:?})"),
        }
    }
    assert!(state_files >= 3, "the page's state files were not found");
}
