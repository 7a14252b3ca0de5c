//! `migrate backup` and `migrate restore`.
//!
//! A backup is a directory with one JSON file per object,
//! `<kind>/<namespace>.<name>.json` (`<kind>/<name>.json` when
//! cluster-scoped). Each file is the complete object as the API server
//! returned it, `apiVersion`, `kind`, `spec` and `status` included, less the
//! fields the server assigns (uid, resourceVersion, creationTimestamp,
//! generation, managedFields), so it can be created again as is.

use std::{
    fs,
    path::{Path, PathBuf},
};

use kube::{
    Api, Client,
    api::{DynamicObject, ListParams, Patch, PatchParams, PostParams},
};
use serde::Deserialize as _;
use serde_json::{Value, json};

use super::{
    MigrateError, convert,
    kinds::{self, Kind},
    v1,
};
use flatnet_k8s::keys;

/// Metadata fields the API server assigns; never written to a backup.
const SERVER_FIELDS: [&str; 6] = [
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "generation",
    "managedFields",
    "selfLink",
];

/// CRDs saved with the objects.
const CRD_NAMES: [&str; 4] = [
    v1::SUBNET_CRD,
    v1::IP_CRD,
    "flatnetworksubnets.flatnetwork.pandaria.io",
    "flatnetworkips.flatnetwork.pandaria.io",
];

/// Saves the V1 objects, the V1 services, the workloads still carrying V1
/// annotations and the V2 subnets into `dir`. Returns the number of objects.
pub async fn backup(client: &Client, dir: &Path, dry_run: bool) -> Result<usize, MigrateError> {
    if fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(MigrateError::BackupExists(dir.to_path_buf()));
    }
    let objects = collect(client).await?;
    for (kind, object) in &objects {
        let path = dir.join(file_name(kind, object));
        if dry_run {
            println!("would write {}", path.display());
            continue;
        }
        let parent = path.parent().unwrap_or(dir);
        fs::create_dir_all(parent).map_err(|source| MigrateError::Io {
            path: parent.to_path_buf(),
            source,
        })?;
        let text = serde_json::to_string_pretty(object).expect("a JSON value serializes");
        fs::write(&path, text + "\n").map_err(|source| MigrateError::Io {
            path: path.clone(),
            source,
        })?;
        println!("wrote {}", path.display());
    }
    Ok(objects.len())
}

/// Everything a backup holds, in restore order.
pub async fn collect(client: &Client) -> Result<Vec<(Kind, Value)>, MigrateError> {
    let mut objects = Vec::new();
    for name in CRD_NAMES {
        if let Some(crd) = get(client, &kinds::CRD, None, name).await? {
            objects.push((kinds::CRD, crd));
        }
    }
    if let Some(ns) = get(client, &kinds::NAMESPACE, None, keys::SUBNET_NAMESPACE).await? {
        objects.push((kinds::NAMESPACE, ns));
    }
    for kind in [
        kinds::MACVLAN_SUBNET,
        kinds::MACVLAN_IP,
        kinds::FLAT_NETWORK_SUBNET,
    ] {
        for object in list(client, &kind).await? {
            objects.push((kind, object));
        }
    }
    for svc in list(client, &kinds::SERVICE).await? {
        let typed: k8s_openapi::api::core::v1::Service = serde_json::from_value(svc.clone())
            .map_err(|source| MigrateError::Decode {
                what: describe(&kinds::SERVICE, &svc),
                source,
            })?;
        if convert::is_v1_service(&typed) {
            objects.push((kinds::SERVICE, svc));
        }
    }
    for kind in kinds::WORKLOADS {
        for workload in list(client, &kind).await? {
            if super::migration::template_annotations(&kind, &workload)
                .keys()
                .any(|k| convert::is_v1_key(k))
            {
                objects.push((kind, workload));
            }
        }
    }
    Ok(objects.into_iter().map(|(k, o)| (k, strip(o))).collect())
}

/// Lists every object of `kind`; a kind the server does not serve (its CRD
/// is not installed) has none.
pub async fn list(client: &Client, kind: &Kind) -> Result<Vec<Value>, MigrateError> {
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &kind.api_resource());
    match api.list(&ListParams::default()).await {
        Ok(list) => Ok(list.items.into_iter().map(|o| with_type(kind, o)).collect()),
        Err(kube::Error::Api(status)) if status.code == 404 => Ok(Vec::new()),
        Err(source) => Err(MigrateError::Kube {
            action: format!("list {}", kind.plural),
            source,
        }),
    }
}

async fn get(
    client: &Client,
    kind: &Kind,
    namespace: Option<&str>,
    name: &str,
) -> Result<Option<Value>, MigrateError> {
    let api = api(client, kind, namespace);
    api.get_opt(name)
        .await
        .map(|o| o.map(|o| with_type(kind, o)))
        .map_err(|source| MigrateError::Kube {
            action: format!("get {} {name}", kind.kind),
            source,
        })
}

/// Lists fill in `apiVersion`/`kind` on the list, not always on the items;
/// a backup must carry them (the original's did not, and restore skipped
/// such objects).
fn with_type(kind: &Kind, object: DynamicObject) -> Value {
    let mut value = serde_json::to_value(object).expect("a DynamicObject serializes");
    value["apiVersion"] = json!(kind.api_version);
    value["kind"] = json!(kind.kind);
    value
}

fn strip(mut object: Value) -> Value {
    if let Some(metadata) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        for field in SERVER_FIELDS {
            metadata.remove(field);
        }
    }
    object
}

fn api(client: &Client, kind: &Kind, namespace: Option<&str>) -> Api<DynamicObject> {
    match namespace {
        Some(ns) if kind.namespaced => {
            Api::namespaced_with(client.clone(), ns, &kind.api_resource())
        }
        _ => Api::all_with(client.clone(), &kind.api_resource()),
    }
}

fn name_of(object: &Value) -> (Option<&str>, &str) {
    let metadata = &object["metadata"];
    (
        metadata["namespace"].as_str(),
        metadata["name"].as_str().unwrap_or_default(),
    )
}

/// `Kind namespace/name` for messages.
pub fn describe(kind: &Kind, object: &Value) -> String {
    match name_of(object) {
        (Some(ns), name) => format!("{} {ns}/{name}", kind.kind),
        (None, name) => format!("{} {name}", kind.kind),
    }
}

fn file_name(kind: &Kind, object: &Value) -> PathBuf {
    let (namespace, name) = name_of(object);
    let file = match namespace {
        Some(ns) => format!("{ns}.{name}.json"),
        None => format!("{name}.json"),
    };
    Path::new(&kind.kind.to_lowercase()).join(file)
}

/// Reads every object of a backup, in restore order. Fails on the first
/// file that is not a complete object of a known kind, before anything is
/// written to the cluster.
pub fn read_backup(dir: &Path) -> Result<Vec<(Kind, Value)>, MigrateError> {
    let mut objects = Vec::new();
    if dir.is_file() {
        for (index, object) in read_upstream_file(dir)?.into_iter().enumerate() {
            let path = PathBuf::from(format!("{}#{}", dir.display(), index + 1));
            objects.push((kind_of(&path, &object)?, object));
        }
    } else {
        let mut files = Vec::new();
        collect_files(dir, &mut files)?;
        for path in files {
            let text = fs::read_to_string(&path).map_err(|source| MigrateError::Io {
                path: path.clone(),
                source,
            })?;
            let object: Value =
                serde_json::from_str(&text).map_err(|source| MigrateError::Decode {
                    what: path.display().to_string(),
                    source,
                })?;
            objects.push((kind_of(&path, &object)?, object));
        }
    }
    objects.sort_by_key(|(kind, object)| {
        (
            kind.order(),
            name_of(object).0.map(str::to_owned),
            name_of(object).1.to_owned(),
        )
    });
    Ok(objects)
}

fn kind_of(path: &Path, object: &Value) -> Result<Kind, MigrateError> {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let kind_name = object["kind"].as_str().unwrap_or_default();
    Kind::find(api_version, kind_name)
        .copied()
        .ok_or_else(|| MigrateError::UnknownKind {
            path: path.to_owned(),
            api_version: api_version.into(),
            kind: kind_name.into(),
        })
}

/// The objects of a backup file the original migrator wrote
/// (`rancher-flat-network-migrator backup -o FILE`): YAML documents
/// separated by `---`. Empty documents are skipped. The original could
/// write the `cattle-flat-network` Namespace, the V2 CRD and V2 subnets
/// without `apiVersion` and `kind`, and then skipped them on restore; here
/// they are recognised by name (the Namespace, the CRD) or by their
/// namespace and `spec.flatMode` (a V2 subnet) and restored.
pub fn read_upstream_file(path: &Path) -> Result<Vec<Value>, MigrateError> {
    let text = fs::read_to_string(path).map_err(|source| MigrateError::Io {
        path: path.to_owned(),
        source,
    })?;
    let mut objects = Vec::new();
    for (index, document) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let yaml = serde_yaml::Value::deserialize(document).map_err(|e| MigrateError::Decode {
            what: format!("{} document {}", path.display(), index + 1),
            source: serde::de::Error::custom(e),
        })?;
        let mut object: Value =
            serde_json::to_value(yaml).map_err(|source| MigrateError::Decode {
                what: format!("{} document {}", path.display(), index + 1),
                source,
            })?;
        if object.is_null() || object.as_object().is_some_and(serde_json::Map::is_empty) {
            continue;
        }
        if object
            .get("kind")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
            && let Some(kind) = untyped_kind(&object)
        {
            object["apiVersion"] = kind.api_version.into();
            object["kind"] = kind.kind.into();
        }
        // The original blanked kubectl's last-applied record instead of removing it.
        if let Some(annotations) = object
            .pointer_mut("/metadata/annotations")
            .and_then(Value::as_object_mut)
        {
            annotations.remove("kubectl.kubernetes.io/last-applied-configuration");
        }
        objects.push(object);
    }
    Ok(objects)
}

/// The kind of an object the original wrote without one.
fn untyped_kind(object: &Value) -> Option<Kind> {
    let name = object.pointer("/metadata/name").and_then(Value::as_str)?;
    let namespace = object
        .pointer("/metadata/namespace")
        .and_then(Value::as_str);
    if name == keys::SUBNET_NAMESPACE
        && namespace.is_none()
        && object
            .get("spec")
            .is_none_or(|s| s.get("flatMode").is_none())
    {
        return Some(kinds::NAMESPACE);
    }
    if name == "flatnetworksubnets.flatnetwork.pandaria.io" {
        return Some(kinds::CRD);
    }
    (namespace == Some(keys::SUBNET_NAMESPACE) && object.pointer("/spec/flatMode").is_some())
        .then_some(kinds::FLAT_NETWORK_SUBNET)
}

fn collect_files(dir: &Path, files: &mut Vec<PathBuf>) -> Result<(), MigrateError> {
    let io = |source| MigrateError::Io {
        path: dir.to_path_buf(),
        source,
    };
    for entry in fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        if path.is_dir() {
            collect_files(&path, files)?;
        } else if path.extension().is_some_and(|e| e == "json") {
            files.push(path);
        }
    }
    Ok(())
}

/// Creates every object of the backup in `dir` that does not exist yet;
/// existing objects are left as they are, so restoring twice is harmless.
/// Returns how many objects were created.
pub async fn restore(client: &Client, dir: &Path, dry_run: bool) -> Result<usize, MigrateError> {
    let objects = read_backup(dir)?;
    let mut created = 0;
    for (kind, object) in objects {
        let what = describe(&kind, &object);
        if dry_run {
            println!("would create {what} (unless it exists)");
            continue;
        }
        let (namespace, name) = name_of(&object);
        let api = api(client, &kind, namespace);
        let mut body = object.clone();
        let status = body.as_object_mut().and_then(|o| o.remove("status"));
        let body: DynamicObject =
            serde_json::from_value(body).map_err(|source| MigrateError::Decode {
                what: what.clone(),
                source,
            })?;
        match api.create(&PostParams::default(), &body).await {
            Ok(_) => {
                created += 1;
                println!("created {what}");
                if let Some(status) = status.filter(|_| kind.status_subresource) {
                    api.patch_status(
                        name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({ "status": status })),
                    )
                    .await
                    .map_err(|source| MigrateError::Kube {
                        action: format!("restore the status of {what}"),
                        source,
                    })?;
                }
            }
            Err(kube::Error::Api(status)) if status.code == 409 => {
                println!("{what} exists, left as it is");
            }
            Err(source) => {
                return Err(MigrateError::Kube {
                    action: format!("create {what}"),
                    source,
                });
            }
        }
    }
    Ok(created)
}
