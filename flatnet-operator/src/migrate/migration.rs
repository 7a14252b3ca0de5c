//! `migrate migrate` and `migrate clean`.
//!
//! Both first compute everything they would do from what they listed, then
//! print it; without `--dry-run` they carry it out.

use std::collections::BTreeMap;

use flatnet_k8s::{
    api::{FlatNetworkSubnet, FlatNetworkSubnetStatus},
    keys,
};
use k8s_openapi::api::core::v1::Service;
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};

use super::{
    MigrateError,
    backup::{describe, list},
    convert::{self, Issue},
    kinds::{self, Kind},
    v1::{self, MacvlanIP, MacvlanSubnet},
};

/// Options of `migrate migrate`.
#[derive(Debug, Clone)]
pub struct Options {
    /// NetworkAttachmentDefinition of the flat network.
    pub attachment: String,
    /// Workload kinds to rewrite.
    pub workloads: Vec<Kind>,
    /// Create `<name>-flat-network` Services for V1 macvlan Services.
    pub services: bool,
    /// Go on although some V1 values cannot be carried.
    pub accept_losses: bool,
    /// Print, write nothing.
    pub dry_run: bool,
}

/// The annotations of a workload's pod template (empty when it has none).
pub fn template_annotations(kind: &Kind, workload: &Value) -> BTreeMap<String, String> {
    let mut node = workload;
    for key in kinds::template_metadata_path(kind) {
        node = &node[*key];
    }
    serde_json::from_value(node["annotations"].clone()).unwrap_or_default()
}

/// A merge patch setting `annotations` at the pod template of `kind`.
fn template_patch(kind: &Kind, annotations: Value, labels: Option<Value>) -> Value {
    let mut patch = json!({ "annotations": annotations });
    for key in kinds::template_metadata_path(kind).iter().rev() {
        patch = json!({ *key: patch });
    }
    if let Some(labels) = labels {
        patch["metadata"] = json!({ "labels": labels });
    }
    patch
}

/// Whether a controller owns the object (a Deployment's ReplicaSet, a
/// CronJob's Job): its owner is migrated instead.
fn is_owned(object: &Value) -> bool {
    object["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|refs| refs.iter().any(|r| r["controller"] == json!(true)))
}

/// One change to a workload.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadChange {
    /// The workload kind.
    pub kind: Kind,
    /// `Kind namespace/name`.
    pub what: String,
    /// Namespace and name.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Template annotations before and after.
    pub before: BTreeMap<String, String>,
    /// After.
    pub after: BTreeMap<String, String>,
    /// The merge patch.
    pub patch: Value,
}

/// Computes the changes to workloads of `kind`, and the workloads that
/// cannot be changed in place (Jobs: their template is immutable).
pub fn plan_workloads(
    kind: &Kind,
    workloads: &[Value],
    attachment: &str,
    issues: &mut Vec<Issue>,
) -> Vec<WorkloadChange> {
    let mut changes = Vec::new();
    for workload in workloads {
        if is_owned(workload) {
            continue;
        }
        let what = describe(kind, workload);
        let before = template_annotations(kind, workload);
        let rewrite = convert::annotations(&what, &before, attachment);
        issues.extend(rewrite.issues.iter().cloned());
        let labels: BTreeMap<String, String> =
            serde_json::from_value(workload["metadata"]["labels"].clone()).unwrap_or_default();
        let stale_labels = convert::v1_labels(&labels);
        if rewrite.is_empty() && stale_labels.is_empty() {
            continue;
        }
        if *kind == kinds::JOB && !rewrite.is_empty() {
            issues.push(Issue {
                object: what.clone(),
                field: "spec.template.metadata.annotations".into(),
                value: format!("{before:?}"),
                outcome:
                    "a Job's pod template cannot change; recreate the Job with these annotations: "
                        .to_owned()
                        + &format!("{:?}", rewrite.apply(&before)),
            });
            continue;
        }
        let label_patch = (!stale_labels.is_empty()).then(|| {
            Value::Object(
                stale_labels
                    .iter()
                    .map(|k| (k.clone(), Value::Null))
                    .collect(),
            )
        });
        changes.push(WorkloadChange {
            kind: *kind,
            what,
            namespace: workload["metadata"]["namespace"]
                .as_str()
                .unwrap_or_default()
                .into(),
            name: workload["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .into(),
            after: rewrite.apply(&before),
            before,
            patch: template_patch(kind, rewrite.merge_patch(), label_patch),
        });
    }
    changes
}

/// Moves the V1 subnets, workload annotations and services to V2.
pub async fn migrate(client: &Client, options: &Options) -> Result<(), MigrateError> {
    let v1_subnets: Api<MacvlanSubnet> = Api::all(client.clone());
    let v1_subnets = list_typed(&v1_subnets, "macvlansubnets").await?;
    let mut issues = Vec::new();
    let converted: Vec<FlatNetworkSubnet> = v1_subnets
        .iter()
        .map(|s| {
            let (v2, found) = convert::subnet(s);
            issues.extend(found);
            v2
        })
        .collect();

    let v1_ips: Api<MacvlanIP> = Api::all(client.clone());
    let held = convert::v1_reservations(&list_typed(&v1_ips, "macvlanips").await?, &mut issues);

    let mut workload_changes = Vec::new();
    for kind in &options.workloads {
        let workloads = list(client, kind).await?;
        workload_changes.extend(plan_workloads(
            kind,
            &workloads,
            &options.attachment,
            &mut issues,
        ));
    }

    let mut services = Vec::new();
    if options.services {
        let all: Api<Service> = Api::all(client.clone());
        for svc in list_typed(&all, "services").await? {
            if convert::is_v1_service(&svc) {
                services.push(convert::flat_service(&svc, &options.attachment));
            }
        }
    }

    for issue in &issues {
        println!("not carried exactly: {issue}");
    }
    if !issues.is_empty() && !options.accept_losses && !options.dry_run {
        return Err(MigrateError::Losses(issues.len()));
    }

    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(client.clone(), keys::SUBNET_NAMESPACE);
    let mut conflicts = 0;
    for subnet in &converted {
        let name = subnet.metadata.name.clone().unwrap_or_default();
        let what = format!("FlatNetworkSubnet {}/{name}", keys::SUBNET_NAMESPACE);
        match get_typed(&subnets, &name).await? {
            Some(existing) if existing.spec == subnet.spec => println!("{what} is up to date"),
            Some(_) => {
                conflicts += 1;
                println!(
                    "{what} exists with a different spec; left as it is (compare it with the V1 subnet, then delete it and run again)"
                );
            }
            None if options.dry_run => println!(
                "would create {what}: {}",
                serde_json::to_string(&subnet.spec).expect("a spec serializes")
            ),
            None => {
                subnets
                    .create(&PostParams::default(), subnet)
                    .await
                    .map_err(|source| MigrateError::Kube {
                        action: format!("create {what}"),
                        source,
                    })?;
                println!("created {what}");
            }
        }
    }

    // Before any pod rolls: what V1 pods hold is reserved in the V2
    // subnets, so no rolled pod is handed an address a V1 pod still uses.
    for (name, reservations) in &held {
        let action = format!("reserve {} V1 address(es) in", reservations.len());
        patch_reservations(
            &subnets,
            name,
            json!(reservations),
            &action,
            options.dry_run,
        )
        .await?;
    }

    for change in &workload_changes {
        println!("{} pod template annotations:", change.what);
        print_diff(&change.before, &change.after);
        if options.dry_run {
            println!("  (dry run: not patched)");
            continue;
        }
        let api: Api<kube::api::DynamicObject> = Api::namespaced_with(
            client.clone(),
            &change.namespace,
            &change.kind.api_resource(),
        );
        api.patch(
            &change.name,
            &PatchParams::default(),
            &Patch::Merge(&change.patch),
        )
        .await
        .map_err(|source| MigrateError::Kube {
            action: format!("patch {}", change.what),
            source,
        })?;
        println!("  patched");
    }

    for svc in &services {
        let namespace = svc.metadata.namespace.clone().unwrap_or_default();
        let name = svc.metadata.name.clone().unwrap_or_default();
        let what = format!("Service {namespace}/{name}");
        let api: Api<Service> = Api::namespaced(client.clone(), &namespace);
        if get_typed(&api, &name).await?.is_some() {
            println!("{what} exists, left as it is");
        } else if options.dry_run {
            println!("would create {what}");
        } else {
            api.create(&PostParams::default(), svc)
                .await
                .map_err(|source| MigrateError::Kube {
                    action: format!("create {what}"),
                    source,
                })?;
            println!("created {what}");
        }
    }
    if conflicts > 0 {
        return Err(MigrateError::Conflicts(conflicts));
    }
    Ok(())
}

/// Deletes the V1 subnets and the V1 CRDs, only once the migration is
/// verified: no MacvlanIP is left (no pod still uses V1), every V1 subnet
/// has its V2 subnet with the converted spec, and no workload template
/// carries a V1 annotation.
pub async fn clean(client: &Client, dry_run: bool) -> Result<(), MigrateError> {
    let mut reasons = Vec::new();
    let ips: Api<MacvlanIP> = Api::all(client.clone());
    for ip in list_typed(&ips, "macvlanips").await?.iter().take(10) {
        reasons.push(format!(
            "MacvlanIP {}/{} exists: its pod still uses V1; restart it after `migrate migrate`",
            ip.metadata.namespace.as_deref().unwrap_or_default(),
            ip.metadata.name.as_deref().unwrap_or_default()
        ));
    }
    let v1_subnets: Api<MacvlanSubnet> = Api::all(client.clone());
    let v1_subnets = list_typed(&v1_subnets, "macvlansubnets").await?;
    let subnets: Api<FlatNetworkSubnet> = Api::namespaced(client.clone(), keys::SUBNET_NAMESPACE);
    // The V1 reservations `migrate` made, released once no V1 pod is left.
    let mut v1_reservations: Vec<(String, serde_json::Map<String, Value>)> = Vec::new();
    for v1 in &v1_subnets {
        let (expected, _) = convert::subnet(v1);
        let name = expected.metadata.name.clone().unwrap_or_default();
        match get_typed(&subnets, &name).await? {
            Some(v2) if v2.spec == expected.spec => {
                let stale: serde_json::Map<String, Value> = v2
                    .status
                    .iter()
                    .flat_map(|s| s.reserved_ip.keys())
                    .filter(|k| FlatNetworkSubnetStatus::is_v1_reservation(k))
                    .map(|k| (k.clone(), Value::Null))
                    .collect();
                if !stale.is_empty() {
                    v1_reservations.push((name.clone(), stale));
                }
            }
            Some(_) => reasons.push(format!(
                "FlatNetworkSubnet {}/{name} differs from the conversion of its V1 subnet",
                keys::SUBNET_NAMESPACE
            )),
            None => reasons.push(format!(
                "MacvlanSubnet {name} has no FlatNetworkSubnet; run `migrate migrate` first"
            )),
        }
    }
    for kind in kinds::WORKLOADS {
        for workload in list(client, &kind).await? {
            if !is_owned(&workload)
                && template_annotations(&kind, &workload)
                    .keys()
                    .any(|k| convert::is_v1_key(k))
            {
                reasons.push(format!(
                    "{} still has V1 annotations",
                    describe(&kind, &workload)
                ));
            }
        }
    }
    if !reasons.is_empty() {
        for reason in &reasons {
            println!("not verified: {reason}");
        }
        return Err(MigrateError::NotVerified(reasons.len()));
    }

    for (name, stale) in &v1_reservations {
        let action = format!("release {} V1 reservation(s) of", stale.len());
        patch_reservations(
            &subnets,
            name,
            Value::Object(stale.clone()),
            &action,
            dry_run,
        )
        .await?;
    }

    let by_namespace = |s: &MacvlanSubnet| {
        Api::<MacvlanSubnet>::namespaced(
            client.clone(),
            s.metadata
                .namespace
                .as_deref()
                .unwrap_or(v1::SUBNET_NAMESPACE),
        )
    };
    for subnet in &v1_subnets {
        let name = subnet.metadata.name.as_deref().unwrap_or_default();
        let what = format!(
            "MacvlanSubnet {}/{name}",
            subnet.metadata.namespace.as_deref().unwrap_or_default()
        );
        if dry_run {
            println!("would delete {what}");
            continue;
        }
        delete_ignoring_missing(&by_namespace(subnet), name, &what).await?;
    }
    let crds: Api<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition> =
        Api::all(client.clone());
    for crd in [v1::IP_CRD, v1::SUBNET_CRD] {
        let what = format!("CustomResourceDefinition {crd}");
        if dry_run {
            println!("would delete {what}");
            continue;
        }
        delete_ignoring_missing(&crds, crd, &what).await?;
    }
    Ok(())
}

/// Merges `entries` into `status.reservedIP` of subnet `name` (a null
/// entry removes its key); `action` says what that means, for the output.
async fn patch_reservations(
    subnets: &Api<FlatNetworkSubnet>,
    name: &str,
    entries: Value,
    action: &str,
    dry_run: bool,
) -> Result<(), MigrateError> {
    let what = format!("FlatNetworkSubnet {}/{name}", keys::SUBNET_NAMESPACE);
    if dry_run {
        println!("would {action} {what}");
        return Ok(());
    }
    subnets
        .patch_status(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": { "reservedIP": entries } })),
        )
        .await
        .map_err(|source| MigrateError::Kube {
            action: format!("{action} {what}"),
            source,
        })?;
    println!("{action} {what}: done");
    Ok(())
}

async fn delete_ignoring_missing<K>(
    api: &Api<K>,
    name: &str,
    what: &str,
) -> Result<(), MigrateError>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => {
            println!("deleted {what}");
            Ok(())
        }
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
        Err(source) => Err(MigrateError::Kube {
            action: format!("delete {what}"),
            source,
        }),
    }
}

async fn list_typed<K>(api: &Api<K>, plural: &str) -> Result<Vec<K>, MigrateError>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.list(&ListParams::default()).await {
        Ok(list) => Ok(list.items),
        // The V1 CRD is gone: nothing of that kind is left.
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(Vec::new()),
        Err(source) => Err(MigrateError::Kube {
            action: format!("list {plural}"),
            source,
        }),
    }
}

async fn get_typed<K>(api: &Api<K>, name: &str) -> Result<Option<K>, MigrateError>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.get_opt(name)
        .await
        .map_err(|source| MigrateError::Kube {
            action: format!("get {name}"),
            source,
        })
}

fn print_diff(before: &BTreeMap<String, String>, after: &BTreeMap<String, String>) {
    for (key, value) in before {
        if after.get(key) != Some(value) {
            println!("  - {key}: {value}");
        }
    }
    for (key, value) in after {
        if before.get(key) != Some(value) {
            println!("  + {key}: {value}");
        }
    }
}
