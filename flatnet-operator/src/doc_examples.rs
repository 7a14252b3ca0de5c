//! The manifests under `docs/<example>/` are applied, in file-name order,
//! through the real admission webhook (`webhook::Validator`) against an
//! in-memory API server, so an example that the cluster would refuse fails
//! here with the webhook's own message.
//!
//! Per example directory:
//! - every `FlatNetworkSubnet` is reviewed (spec validation, namespace,
//!   conflicts with the subnets applied before it) and then stored;
//! - every Pod and workload is reviewed (annotation syntax, subnets exist
//!   and fit, addresses allocatable, fixed MACs only on macvlan), asks for
//!   the flat network through a Multus annotation that names an existing
//!   attachment, and lists enough fixed candidates for its replicas;
//! - FloatingIPPools, quotas and Services are reviewed and stored (the
//!   addresses the controller gives the floating-IP example are checked by
//!   `floating::tests`);
//! - `FlatNetworkIP`s shown in the README (what the operator writes) match
//!   the API and the example's subnets;
//! - fields the API types do not know are reported (a typo would otherwise
//!   be dropped silently by the API server's pruning).
//!
//! MultiNetworkPolicies, NetworkAttachmentDefinition configs and standalone
//! state files are checked by `flatnet-agent`'s `doc_examples` test, which
//! owns their parsers.

mod markdown;

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    sync::Arc,
};

use flatnet_k8s::{
    annotations::parse_pod_request,
    api::{FlatNetworkIP, FlatNetworkSubnet, FloatingIPPool, FloatingIPProjectQuota},
    ipam::Pool,
    keys::{NAD_NAME, annotation},
    validation::validate_subnet,
};
use k8s_openapi::api::core::v1::{Namespace, Service};
use kube::core::{
    DynamicObject,
    admission::{AdmissionRequest, AdmissionReview},
};
use serde_json::{Value, json};

use crate::{
    allocation::fake_api::FakeApiServer, metrics::Metrics, webhook::Validator,
    webhook::workload::annotations_pointer,
};

/// Kinds whose checks live in `flatnet-agent/tests/doc_examples.rs`.
const CHECKED_BY_AGENT: [&str; 2] = ["MultiNetworkPolicy", "NetworkAttachmentDefinition"];

fn docs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs")
}

/// Every directory under `docs/` that holds YAML manifests: the examples.
fn example_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = fs::read_dir(docs_dir())
        .expect("read docs/")
        .map(|entry| entry.expect("docs/ entry").path())
        .filter(|path| path.is_dir() && !yaml_files(path).is_empty())
        .collect();
    dirs.sort();
    dirs
}

fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .expect("read example directory")
        .map(|entry| entry.expect("directory entry").path())
        .filter(|path| path.extension().is_some_and(|e| e == "yaml" || e == "yml"))
        .collect();
    files.sort();
    files
}

/// The YAML documents of `text` as JSON values, skipping empty ones.
pub(crate) fn documents(text: &str, origin: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|document| {
            let value: Value = serde::Deserialize::deserialize(document)
                .unwrap_or_else(|e| panic!("{origin}: not valid YAML: {e}"));
            value
        })
        .filter(|value| !value.is_null())
        .collect()
}

/// Paths of fields present in `written` but absent after a round trip
/// through the typed API object (`typed`): fields the API does not know.
fn unknown_fields(written: &Value, typed: &Value, path: &str, out: &mut Vec<String>) {
    match (written, typed) {
        (Value::Object(written), Value::Object(typed)) => {
            for (key, value) in written {
                let here = format!("{path}.{key}");
                match typed.get(key) {
                    Some(typed_value) => unknown_fields(value, typed_value, &here, out),
                    None => out.push(here),
                }
            }
        }
        (Value::Array(written), Value::Array(typed)) => {
            for (index, (value, typed_value)) in written.iter().zip(typed).enumerate() {
                unknown_fields(value, typed_value, &format!("{path}[{index}]"), out);
            }
        }
        _ => {}
    }
}

/// Deserializes `value` as `K` and fails on fields `K` drops.
fn typed<K>(value: &Value, origin: &str) -> K
where
    K: serde::de::DeserializeOwned + serde::Serialize,
{
    let object: K = serde_json::from_value(value.clone())
        .unwrap_or_else(|e| panic!("{origin}: does not match the API type: {e}"));
    let mut unknown = Vec::new();
    let round_trip = serde_json::to_value(&object).expect("typed object serializes");
    unknown_fields(value, &round_trip, "", &mut unknown);
    assert!(
        unknown.is_empty(),
        "{origin}: fields unknown to the API (typo?): {unknown:?}"
    );
    object
}

fn review_of(object: &Value) -> AdmissionRequest<DynamicObject> {
    let kind = object["kind"].as_str().expect("kind");
    let api_version = object["apiVersion"].as_str().expect("apiVersion");
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let resource = format!("{}s", kind.to_lowercase());
    let review: AdmissionReview<DynamicObject> = serde_json::from_value(json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "doc-example",
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "name": object["metadata"]["name"],
            "namespace": object["metadata"]["namespace"],
            "operation": "CREATE",
            "userInfo": {"username": "admin"},
            "object": object,
            "dryRun": false,
        }
    }))
    .expect("an AdmissionReview");
    review.try_into().expect("a review with a request")
}

/// One example directory being applied.
struct Example {
    name: String,
    api: FakeApiServer,
    validator: Validator,
    subnets: BTreeMap<String, FlatNetworkSubnet>,
    /// NetworkAttachmentDefinitions of the example, by namespace and name.
    attachments: Vec<(String, String)>,
}

impl Example {
    fn new(name: String) -> Self {
        let api = FakeApiServer::new();
        let validator = Validator::new(api.client(), Arc::new(Metrics::new()));
        Self {
            name,
            api,
            validator,
            subnets: BTreeMap::new(),
            attachments: Vec::new(),
        }
    }

    async fn admit(&self, object: &Value, origin: &str) {
        let response = self.validator.review(&review_of(object)).await;
        assert!(
            response.allowed,
            "{origin}: the webhook refuses it: {}",
            response.result.message
        );
    }

    async fn apply(&mut self, object: &Value, origin: &str) {
        let kind = object["kind"].as_str().unwrap_or_default();
        match kind {
            "FlatNetworkSubnet" => {
                let subnet: FlatNetworkSubnet = typed(object, origin);
                self.admit(object, origin).await;
                let name = subnet.metadata.name.clone().expect("subnet name");
                self.api.insert(&subnet);
                self.subnets.insert(name, subnet);
            }
            "FlatNetworkIP" => panic!(
                "{origin}: examples never create FlatNetworkIPs, the operator does; show them in the README instead"
            ),
            "Service" => {
                let service: Service = typed(object, origin);
                self.admit(object, origin).await;
                self.api.insert(&service);
            }
            "FloatingIPPool" => {
                let pool: FloatingIPPool = typed(object, origin);
                self.admit(object, origin).await;
                self.api.insert(&pool);
            }
            "FloatingIPProjectQuota" => {
                let quota: FloatingIPProjectQuota = typed(object, origin);
                self.admit(object, origin).await;
                self.api.insert(&quota);
            }
            "Namespace" => {
                let namespace: Namespace = typed(object, origin);
                self.api.insert(&namespace);
            }
            kind if CHECKED_BY_AGENT.contains(&kind) => {
                if kind == "NetworkAttachmentDefinition" {
                    let meta = &object["metadata"];
                    let namespace = meta["namespace"].as_str().unwrap_or("default");
                    let name = meta["name"].as_str().expect("attachment name");
                    self.attachments.push((namespace.into(), name.into()));
                }
            }
            kind if annotations_pointer(kind).is_some() => {
                self.admit(object, origin).await;
                check_pod_template(kind, object, &self.attachments, origin);
            }
            "" => assert!(
                object.get("subnets").is_some() && object.get("networks").is_some(),
                "{origin}: a document without kind must be a standalone state file (subnets, networks)"
            ),
            other => panic!("{origin}: no check for kind {other}; add one to this test"),
        }
    }

    /// FlatNetworkIPs shown in the README: valid objects of this example's subnets.
    fn check_readme(&self, dir: &Path) {
        let path = dir.join("README.md");
        let readme = fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("example {} needs a README.md: {e}", self.name));
        for (index, block) in markdown::yaml_blocks(&readme).iter().enumerate() {
            let origin = format!("{} yaml block {}", path.display(), index + 1);
            for document in documents(block, &origin) {
                if document["kind"] != "FlatNetworkIP" {
                    continue;
                }
                let ip: FlatNetworkIP = typed(&document, &origin);
                let subnet = self.subnets.get(&ip.spec.subnet).unwrap_or_else(|| {
                    panic!("{origin}: subnet {} is not in the example", ip.spec.subnet)
                });
                let valid = validate_subnet(&ip.spec.subnet, &subnet.spec)
                    .unwrap_or_else(|e| panic!("{origin}: {e}"));
                let addr = ip
                    .status
                    .as_ref()
                    .and_then(|s| s.addr)
                    .unwrap_or_else(|| panic!("{origin}: show status.addr"));
                assert!(
                    Pool::new(&valid).is_allocatable(addr),
                    "{origin}: {addr} is not allocatable in {}",
                    ip.spec.subnet
                );
                assert!(
                    ip.spec.addrs.is_empty() || ip.spec.addrs.contains(&addr),
                    "{origin}: {addr} is not one of spec.addrs"
                );
            }
        }
    }
}

/// The pod template (or pod) of `object`: its annotations and how many
/// pods it makes at once.
fn pod_template(kind: &str, object: &Value) -> (BTreeMap<String, String>, u64) {
    let pointer = annotations_pointer(kind).expect("reviewed kind");
    let annotations = object
        .pointer(pointer)
        .map(|a| serde_json::from_value(a.clone()).expect("annotations are strings"))
        .unwrap_or_default();
    let replicas = match kind {
        "Deployment" | "ReplicaSet" | "StatefulSet" => object
            .pointer("/spec/replicas")
            .and_then(Value::as_u64)
            .unwrap_or(1),
        "Job" => object
            .pointer("/spec/parallelism")
            .and_then(Value::as_u64)
            .unwrap_or(1),
        _ => 1,
    };
    (annotations, replicas)
}

/// A flat pod template must reach flatnet through Multus, and fixed
/// candidates must cover every replica.
fn check_pod_template(kind: &str, object: &Value, attachments: &[(String, String)], origin: &str) {
    let (annotations, replicas) = pod_template(kind, object);
    let Some(subnet) = annotations.get(annotation::SUBNET) else {
        return;
    };
    let namespace = object["metadata"]["namespace"]
        .as_str()
        .unwrap_or("default");
    let selection = [annotation::MULTUS_NETWORKS, annotation::MULTUS_DEFAULT_NETWORK]
        .iter()
        .find_map(|key| annotations.get(*key))
        .unwrap_or_else(|| {
            panic!(
                "{origin}: a flat pod needs {} or {} naming the attachment, or it never gets its interface",
                annotation::MULTUS_NETWORKS,
                annotation::MULTUS_DEFAULT_NETWORK
            )
        });
    let selection: Vec<Value> = serde_json::from_str(selection)
        .unwrap_or_else(|e| panic!("{origin}: the Multus annotation is not a JSON list: {e}"));
    for entry in &selection {
        let name = entry["name"].as_str().expect("attachment name");
        let known = name == NAD_NAME
            || attachments
                .iter()
                .any(|(ns, n)| n == name && ns == entry["namespace"].as_str().unwrap_or(namespace));
        assert!(
            known,
            "{origin}: attachment {name} is neither {NAD_NAME} nor defined in the example"
        );
    }

    let request = parse_pod_request(
        subnet,
        annotations.get(annotation::IP).map_or("", String::as_str),
        annotations.get(annotation::MAC).map_or("", String::as_str),
    )
    .unwrap_or_else(|e| panic!("{origin}: {e}"));
    for wanted in &request.subnets {
        let candidates = wanted.candidates.len() as u64;
        assert!(
            candidates == 0 || candidates >= replicas,
            "{origin}: {replicas} replicas but only {candidates} candidate addresses in {}",
            wanted.subnet
        );
    }
    let macs = request.macs.len() as u64;
    assert!(
        macs == 0 || macs >= replicas,
        "{origin}: {replicas} replicas but only {macs} candidate MACs"
    );
}

#[tokio::test]
async fn every_documented_example_is_accepted() {
    let dirs = example_dirs();
    let names: Vec<String> = dirs
        .iter()
        .map(|d| d.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    for expected in [
        "macvlan",
        "ipvlan",
        "ipv6",
        "dual-stack",
        "statefulset",
        "policy",
    ] {
        assert!(
            names.iter().any(|n| n == expected),
            "docs/{expected} is missing"
        );
    }
    for dir in dirs {
        let mut example = Example::new(dir.file_name().unwrap().to_string_lossy().into_owned());
        let mut applied = 0;
        for file in yaml_files(&dir) {
            let text = fs::read_to_string(&file).expect("read example");
            for (index, document) in documents(&text, &file.display().to_string())
                .iter()
                .enumerate()
            {
                let origin = format!("{} document {}", file.display(), index + 1);
                example.apply(document, &origin).await;
                applied += 1;
            }
        }
        assert!(applied > 0, "{} has no manifests", dir.display());
        example.check_readme(&dir);
        println!("{}: {applied} documents accepted", example.name);
    }
}

#[tokio::test]
async fn a_broken_example_is_refused() {
    let mut example = Example::new("broken".into());
    let subnet = json!({
        "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkSubnet",
        "metadata": {"name": "lan", "namespace": "cattle-flat-network"},
        "spec": {"flatMode": "macvlan", "master": "eth0", "cidr": "10.0.0.0/24",
                 "ranges": [{"from": "10.0.0.10", "to": "10.0.0.20"}]},
    });
    example.apply(&subnet, "subnet").await;
    let pod = |ip: &str| {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "p", "namespace": "default", "annotations": {
                annotation::MULTUS_NETWORKS: r#"[{"name":"rancher-flat-network","interface":"eth1"}]"#,
                annotation::SUBNET: "lan", annotation::IP: ip}},
            "spec": {"containers": [{"name": "c", "image": "busybox"}]},
        })
    };
    example.apply(&pod("10.0.0.10"), "good pod").await;
    let outside_ranges = tokio::spawn(async move {
        example.apply(&pod("10.0.0.30"), "pod").await;
    })
    .await
    .expect_err("an address outside spec.ranges must fail the example");
    let message = outside_ranges.into_panic();
    let message = message
        .downcast_ref::<String>()
        .expect("a formatted panic message");
    assert!(message.contains("outside spec.ranges"), "{message}");

    let typo = std::panic::catch_unwind(|| {
        let mut misspelled = subnet.clone();
        misspelled["spec"]["gatway"] = json!("10.0.0.1");
        typed::<FlatNetworkSubnet>(&misspelled, "subnet")
    })
    .expect_err("a misspelled field must fail the example");
    let message = typo.downcast_ref::<String>().expect("a formatted message");
    assert!(message.contains(".spec.gatway"), "{message}");
}
