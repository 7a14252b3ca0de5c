//! What a flat pod's FlatNetworkIP records and pod labels should look like.
//!
//! Pure functions: the pod controller compares their result with what is
//! stored and writes the difference.
//!
//! # Record names
//!
//! A pod's record has the pod's name and namespace, as in the original, so
//! tools that read `<namespace>/<pod>` keep working. A dual-stack pod
//! (`subnet: v4net,v6net`) has a second record, `<pod>.ipv6`, for its IPv6
//! address: every record stays a plain single-address FlatNetworkIP of one
//! subnet, which is the original wire format.

use std::{collections::BTreeMap, net::IpAddr};

use flatnet_k8s::{
    annotations::{PodRequest, SubnetRequest},
    api::{FlatNetworkIP, FlatNetworkIPSpec, FlatNetworkSubnet},
    ipam::{PodController, StatefulSetAddressPolicy, fate_on_pod_deletion},
    keys::{annotation, label},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::ResourceExt;

use super::CachedPod;

/// Finalizer flatnet puts on every record: the address goes back to the
/// subnet the moment the record is deleted, not after a repair delay.
pub const FINALIZER: &str = "flatnetwork.pandaria.io/release-address";

/// The original operator's finalizer on records it created. flatnet
/// releases the address and removes it too, so migrated records can go.
pub const LEGACY_FINALIZER: &str = "wrangler.cattle.io/rancher-flat-network-ip-remove";

/// Suffix of a dual-stack pod's second (IPv6) record.
pub use flatnet_k8s::keys::SECONDARY_RECORD_SUFFIX as SECONDARY_SUFFIX;

/// Longest object name Kubernetes accepts.
const MAX_NAME_LEN: usize = 253;

/// Name of the record holding the `index`-th subnet request of `pod_name`.
pub fn record_name(pod_name: &str, index: usize) -> String {
    match index {
        0 => pod_name.to_owned(),
        _ => format!("{pod_name}{SECONDARY_SUFFIX}"),
    }
}

/// Whether the record names fit: the second record of a dual-stack pod
/// needs [`SECONDARY_SUFFIX`] more characters than the pod name.
pub fn names_fit(pod_name: &str, subnets: usize) -> bool {
    subnets < 2 || pod_name.len() + SECONDARY_SUFFIX.len() <= MAX_NAME_LEN
}

/// The controller owning `pod`, as far as address stickiness goes.
pub fn pod_controller(pod: &CachedPod) -> PodController {
    match pod
        .owner_references()
        .iter()
        .find(|o| o.controller == Some(true))
    {
        Some(owner) if owner.kind == "StatefulSet" && owner.api_version == "apps/v1" => {
            PodController::StatefulSet
        }
        _ => PodController::Other,
    }
}

/// The owner reference of a pod's record: the StatefulSet (`apps/v1`) when
/// the policy keeps StatefulSet addresses, else the pod, so the record is
/// garbage-collected with whichever should take the address away.
pub fn record_owner(pod: &CachedPod, policy: StatefulSetAddressPolicy) -> OwnerReference {
    let keep =
        fate_on_pod_deletion(pod_controller(pod), policy) == flatnet_k8s::ipam::RecordFate::Keep;
    if keep
        && let Some(set) = pod
            .owner_references()
            .iter()
            .find(|o| o.controller == Some(true))
    {
        return OwnerReference {
            api_version: "apps/v1".into(),
            kind: "StatefulSet".into(),
            name: set.name.clone(),
            uid: set.uid.clone(),
            controller: Some(true),
            block_owner_deletion: None,
        };
    }
    pod_owner(pod)
}

/// `pod` as the controlling owner of a record: the record goes with it.
pub fn pod_owner<K: kube::Resource>(pod: &K) -> OwnerReference {
    OwnerReference {
        api_version: "v1".into(),
        kind: "Pod".into(),
        name: pod.name_any(),
        uid: pod.uid().unwrap_or_default(),
        controller: Some(true),
        block_owner_deletion: None,
    }
}

/// The Job controlling `pod`, if any.
pub fn controlling_job(pod: &CachedPod) -> Option<&OwnerReference> {
    pod.owner_references()
        .iter()
        .find(|o| o.controller == Some(true) && o.kind == "Job")
}

/// Whether the pod controller must look up the CronJob of `pod`'s Job for
/// its workload selector: a Job's pod without the selector label.
pub fn needs_cronjob(pod: &CachedPod) -> bool {
    !pod.labels().contains_key(label::RANCHER_WORKLOAD_SELECTOR) && controlling_job(pod).is_some()
}

/// The Rancher workload selector of a record: the pod's label, or for a
/// Job's pod `cronjob-<namespace>-<cronjob>` when `cronjob` owns the Job,
/// else `job-<namespace>-<job>`, as the original wrote it.
fn workload_selector(pod: &CachedPod, cronjob: Option<&str>) -> Option<String> {
    if let Some(selector) = pod.labels().get(label::RANCHER_WORKLOAD_SELECTOR) {
        return Some(selector.clone());
    }
    let job = controlling_job(pod)?;
    let namespace = pod.namespace().unwrap_or_default();
    Some(match cronjob {
        Some(cronjob) => format!("cronjob-{namespace}-{cronjob}"),
        None => format!("job-{namespace}-{}", job.name),
    })
}

/// Inputs of [`desired_record`] besides the pod.
pub struct RecordContext<'a> {
    /// The parsed annotations.
    pub request: &'a PodRequest,
    /// Which subnet request (0, or 1 for the IPv6 half of dual stack).
    pub index: usize,
    /// The subnet, when it exists (for its `ipv6to4` annotation).
    pub subnet: Option<&'a FlatNetworkSubnet>,
    /// The namespace's Rancher project label, if any.
    pub project: Option<&'a str>,
    /// StatefulSet policy.
    pub policy: StatefulSetAddressPolicy,
    /// The CronJob owning the pod's Job, if any (see [`needs_cronjob`]).
    pub cronjob: Option<&'a str>,
}

#[cfg(test)]
impl<'a> RecordContext<'a> {
    /// The first subnet request of `request`, no subnet, project or
    /// CronJob, sticky StatefulSet addresses: what most tests vary from.
    pub(crate) fn plain(request: &'a PodRequest) -> Self {
        Self {
            request,
            index: 0,
            subnet: None,
            project: None,
            policy: StatefulSetAddressPolicy::Sticky,
            cronjob: None,
        }
    }
}

/// The record for one subnet request of `pod`: metadata (labels, owner,
/// finalizer) and spec. Status is the IP controller's business.
pub fn desired_record(pod: &CachedPod, ctx: &RecordContext<'_>) -> FlatNetworkIP {
    let wanted: &SubnetRequest = &ctx.request.subnets[ctx.index];
    let mut labels = BTreeMap::from([
        (label::IP_SUBNET.to_owned(), wanted.subnet.clone()),
        (label::IP_TYPE.to_owned(), ip_type(ctx.request).to_owned()),
    ]);
    if let Some(project) = ctx.project {
        labels.insert(label::RANCHER_PROJECT_ID.to_owned(), project.to_owned());
    }
    if let Some(selector) = workload_selector(pod, ctx.cronjob) {
        labels.insert(label::RANCHER_WORKLOAD_SELECTOR.to_owned(), selector);
    }
    if let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.as_ref()) {
        labels.insert(label::NODE.to_owned(), node.clone());
    }
    let annotations = ctx
        .subnet
        .filter(|s| {
            s.annotations()
                .get(annotation::IPV6_TO_4)
                .is_some_and(|v| !v.is_empty())
        })
        .map(|_| BTreeMap::from([(annotation::IPV6_TO_4.to_owned(), "true".to_owned())]));
    FlatNetworkIP {
        metadata: ObjectMeta {
            name: Some(record_name(&pod.name_any(), ctx.index)),
            namespace: pod.namespace(),
            labels: Some(labels),
            annotations,
            owner_references: Some(vec![record_owner(pod, ctx.policy)]),
            finalizers: Some(vec![FINALIZER.to_owned()]),
            ..ObjectMeta::default()
        },
        spec: FlatNetworkIPSpec {
            subnet: wanted.subnet.clone(),
            addrs: wanted.candidates.clone(),
            macs: ctx.request.macs.iter().map(ToString::to_string).collect(),
            pod_id: pod.uid().unwrap_or_default(),
        },
        status: None,
    }
}

/// `auto` when every address is automatic, else `specific`.
pub fn ip_type(request: &PodRequest) -> &'static str {
    if request.is_auto() {
        label::IP_TYPE_AUTO
    } else {
        label::IP_TYPE_SPECIFIC
    }
}

/// Whether `existing` already carries what `desired` asks for: the spec,
/// owner references, flatnet's labels and annotations, the finalizer.
/// Labels others added (the agent's node label on an older pod version)
/// are compared only for the keys flatnet writes.
pub fn record_matches(existing: &FlatNetworkIP, desired: &FlatNetworkIP) -> bool {
    let contains_all = |have: &BTreeMap<String, String>,
                        want: &Option<BTreeMap<String, String>>| {
        want.iter().flatten().all(|(k, v)| have.get(k) == Some(v))
    };
    existing.spec == desired.spec
        && existing.owner_references() == desired.owner_references()
        && contains_all(existing.labels(), &desired.metadata.labels)
        && contains_all(existing.annotations(), &desired.metadata.annotations)
        && existing.finalizers().iter().any(|f| f == FINALIZER)
}

/// `existing` with the metadata and spec of `desired` merged in: foreign
/// labels, annotations and finalizers are kept, flatnet's are set.
pub fn merge_record(existing: &FlatNetworkIP, desired: &FlatNetworkIP) -> FlatNetworkIP {
    let mut merged = existing.clone();
    merged
        .labels_mut()
        .extend(desired.labels().iter().map(|(k, v)| (k.clone(), v.clone())));
    merged.annotations_mut().extend(
        desired
            .annotations()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone())),
    );
    merged.metadata.owner_references = desired.metadata.owner_references.clone();
    if !merged.finalizers().iter().any(|f| f == FINALIZER) {
        merged.finalizers_mut().push(FINALIZER.to_owned());
    }
    merged.spec = desired.spec.clone();
    merged
}

/// The `selectedIP` label value of an address.
///
/// The original replaced `:` with `.`, which is kept whenever the result is
/// a valid label value (`fd00..5`), so existing selectors keep matching. An
/// IPv6 address starting or ending with `::` would give a value starting or
/// ending with `.`, which Kubernetes rejects; those are written with every
/// group spelled out instead (`0.0.0.0.0.0.0.1`).
pub fn selected_ip_label(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => {
            let short = v6.to_string().replace(':', ".");
            if short.starts_with('.') || short.ends_with('.') {
                v6.segments()
                    .iter()
                    .map(|g| format!("{g:x}"))
                    .collect::<Vec<_>>()
                    .join(".")
            } else {
                short
            }
        }
    }
}

/// The labels flatnet sets on an Active pod: subnet (the first one of a
/// dual-stack pair), selected address (of the first record), selected MAC
/// (only when the pod asks for fixed MACs), address type and flat mode.
pub fn desired_pod_labels(
    request: &PodRequest,
    first: &FlatNetworkIP,
    flat_mode: &str,
) -> BTreeMap<String, String> {
    let status = first.status.clone().unwrap_or_default();
    let mac = if request.macs.is_empty() {
        String::new()
    } else {
        status.mac.replace(':', "")
    };
    BTreeMap::from([
        (label::SUBNET.to_owned(), request.subnets[0].subnet.clone()),
        (
            label::SELECTED_IP.to_owned(),
            status.addr.map(selected_ip_label).unwrap_or_default(),
        ),
        (label::SELECTED_MAC.to_owned(), mac),
        (label::IP_TYPE.to_owned(), ip_type(request).to_owned()),
        (label::FLAT_MODE.to_owned(), flat_mode.to_owned()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use flatnet_k8s::annotations::parse_pod_request;
    use proptest::prelude::*;

    use super::super::CachedPodSpec;

    fn pod(owner: Option<(&str, &str)>) -> CachedPod {
        CachedPod {
            metadata: ObjectMeta {
                name: Some("web-0".into()),
                namespace: Some("shop".into()),
                uid: Some("uid-pod".into()),
                owner_references: owner.map(|(api, kind)| {
                    vec![OwnerReference {
                        api_version: api.into(),
                        kind: kind.into(),
                        name: "web".into(),
                        uid: "uid-owner".into(),
                        controller: Some(true),
                        block_owner_deletion: Some(true),
                    }]
                }),
                ..ObjectMeta::default()
            },
            spec: Some(CachedPodSpec {
                node_name: Some("node-1".into()),
            }),
        }
    }

    fn record_for(pod: &CachedPod, request: &PodRequest, index: usize) -> FlatNetworkIP {
        desired_record(
            pod,
            &RecordContext {
                index,
                project: Some("p-1"),
                ..RecordContext::plain(request)
            },
        )
    }

    #[test]
    fn statefulset_pods_are_owned_by_their_statefulset_with_apps_v1() {
        let request = parse_pod_request("net", "auto", "").unwrap();
        let record = record_for(&pod(Some(("apps/v1", "StatefulSet"))), &request, 0);
        let owner = &record.owner_references()[0];
        assert_eq!(
            (
                owner.api_version.as_str(),
                owner.kind.as_str(),
                owner.uid.as_str()
            ),
            ("apps/v1", "StatefulSet", "uid-owner")
        );
        let released = desired_record(
            &pod(Some(("apps/v1", "StatefulSet"))),
            &RecordContext {
                policy: StatefulSetAddressPolicy::Release,
                ..RecordContext::plain(&request)
            },
        );
        assert_eq!(released.owner_references()[0].kind, "Pod");
        let other = record_for(&pod(Some(("apps/v1", "ReplicaSet"))), &request, 0);
        assert_eq!(
            (
                other.owner_references()[0].kind.as_str(),
                other.owner_references()[0].api_version.as_str()
            ),
            ("Pod", "v1")
        );
    }

    #[test]
    fn record_carries_the_original_labels_spec_and_the_finalizer() {
        let request =
            parse_pod_request("v4net,v6net", "10.0.0.5-10.0.0.6,auto", "02:00:00:00:00:01")
                .unwrap();
        let p = pod(Some(("batch/v1", "Job")));
        let v4 = record_for(&p, &request, 0);
        let v6 = record_for(&p, &request, 1);
        assert_eq!(v4.name_any(), "web-0");
        assert_eq!(v6.name_any(), "web-0.ipv6");
        assert_eq!(v4.spec.subnet, "v4net");
        assert_eq!(v6.spec.subnet, "v6net");
        assert_eq!(v4.spec.addrs.len(), 2);
        assert!(v6.spec.addrs.is_empty());
        assert_eq!(v4.spec.macs, ["02:00:00:00:00:01"]);
        assert_eq!(v4.spec.pod_id, "uid-pod");
        let labels = v4.labels();
        assert_eq!(labels["subnet"], "v4net");
        assert_eq!(labels[label::IP_TYPE], "specific");
        assert_eq!(labels[label::RANCHER_PROJECT_ID], "p-1");
        assert_eq!(labels[label::RANCHER_WORKLOAD_SELECTOR], "job-shop-web");
        // A Job of a CronJob: the CronJob's selector.
        let nightly = desired_record(
            &p,
            &RecordContext {
                cronjob: Some("nightly"),
                ..RecordContext::plain(&request)
            },
        );
        assert!(needs_cronjob(&p));
        assert_eq!(
            nightly.labels()[label::RANCHER_WORKLOAD_SELECTOR],
            "cronjob-shop-nightly"
        );
        assert_eq!(labels[label::NODE], "node-1");
        assert_eq!(v4.finalizers(), [FINALIZER]);
        assert_eq!(v6.pod_name(), "web-0");
        assert!(record_matches(&v4, &v4));
        assert!(!record_matches(&v6, &v4));
    }

    #[test]
    fn merge_keeps_foreign_metadata() {
        let request = parse_pod_request("net", "auto", "").unwrap();
        let desired = record_for(&pod(None), &request, 0);
        let mut existing = desired.clone();
        existing.spec.pod_id = "old".into();
        existing.labels_mut().insert("team".into(), "a".into());
        existing.metadata.finalizers = Some(vec![LEGACY_FINALIZER.into()]);
        assert!(!record_matches(&existing, &desired));
        let merged = merge_record(&existing, &desired);
        assert!(record_matches(&merged, &desired));
        assert_eq!(merged.labels()["team"], "a");
        assert_eq!(merged.finalizers(), [LEGACY_FINALIZER, FINALIZER]);
    }

    #[test]
    fn selected_ip_keeps_the_original_form_when_valid() {
        let label = |s: &str| selected_ip_label(s.parse().unwrap());
        assert_eq!(label("10.0.0.5"), "10.0.0.5");
        assert_eq!(label("fd00::5"), "fd00..5");
        assert_eq!(label("::1"), "0.0.0.0.0.0.0.1");
        assert_eq!(label("fd00::"), "fd00.0.0.0.0.0.0.0");
    }

    /// Kubernetes' label value syntax.
    fn valid_label_value(value: &str) -> bool {
        value.len() <= 63
            && (value.is_empty()
                || (value.starts_with(|c: char| c.is_ascii_alphanumeric())
                    && value.ends_with(|c: char| c.is_ascii_alphanumeric())
                    && value
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))))
    }

    proptest! {
        #[test]
        fn selected_ip_is_a_valid_label_for_every_address(bits: u128, v4: u32) {
            let v6 = IpAddr::from(bits.to_be_bytes());
            prop_assert!(valid_label_value(&selected_ip_label(v6)), "{v6}");
            let v4 = IpAddr::from(v4.to_be_bytes());
            prop_assert!(valid_label_value(&selected_ip_label(v4)), "{v4}");
        }

        #[test]
        fn selected_ip_is_a_valid_label_for_sparse_ipv6(groups in proptest::collection::vec(prop_oneof![Just(0u16), any::<u16>()], 8)) {
            let mut segments = [0u16; 8];
            segments.copy_from_slice(&groups);
            let ip = IpAddr::from(std::net::Ipv6Addr::from(segments));
            prop_assert!(valid_label_value(&selected_ip_label(ip)), "{ip}");
        }
    }
}
