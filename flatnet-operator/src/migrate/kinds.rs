//! The kinds the migrator reads and writes, with what the dynamic API needs.
//!
//! A fixed table instead of discovery: backups hold only these kinds, and
//! restore must refuse anything else before it writes a single object.

use kube::api::{ApiResource, GroupVersionKind};

/// One kind the migrator handles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kind {
    /// `group/version`, or `v1` for the core group.
    pub api_version: &'static str,
    /// Kind name.
    pub kind: &'static str,
    /// Resource (plural) name.
    pub plural: &'static str,
    /// Namespaced or cluster-scoped.
    pub namespaced: bool,
    /// Whether `status` is a subresource, restored after the object.
    pub status_subresource: bool,
}

impl Kind {
    const fn new(
        api_version: &'static str,
        kind: &'static str,
        plural: &'static str,
        namespaced: bool,
        status_subresource: bool,
    ) -> Self {
        Self {
            api_version,
            kind,
            plural,
            namespaced,
            status_subresource,
        }
    }

    /// The dynamic API resource.
    pub fn api_resource(&self) -> ApiResource {
        let (group, version) = self
            .api_version
            .split_once('/')
            .unwrap_or(("", self.api_version));
        ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk(group, version, self.kind),
            self.plural,
        )
    }

    /// Looks a kind up by `apiVersion` and `kind`.
    pub fn find(api_version: &str, kind: &str) -> Option<&'static Kind> {
        ALL.iter()
            .find(|k| k.api_version == api_version && k.kind == kind)
    }

    /// Position in the restore order (definitions and namespaces first).
    pub fn order(&self) -> usize {
        ALL.iter().position(|k| k == self).unwrap_or(usize::MAX)
    }
}

/// CustomResourceDefinition.
pub const CRD: Kind = Kind::new(
    "apiextensions.k8s.io/v1",
    "CustomResourceDefinition",
    "customresourcedefinitions",
    false,
    false,
);
/// Namespace.
pub const NAMESPACE: Kind = Kind::new("v1", "Namespace", "namespaces", false, false);
/// V1 subnet.
pub const MACVLAN_SUBNET: Kind = Kind::new(
    "macvlan.cluster.cattle.io/v1",
    "MacvlanSubnet",
    "macvlansubnets",
    true,
    true,
);
/// V1 allocation record.
pub const MACVLAN_IP: Kind = Kind::new(
    "macvlan.cluster.cattle.io/v1",
    "MacvlanIP",
    "macvlanips",
    true,
    false,
);
/// V2 subnet.
pub const FLAT_NETWORK_SUBNET: Kind = Kind::new(
    "flatnetwork.pandaria.io/v1",
    "FlatNetworkSubnet",
    "flatnetworksubnets",
    true,
    true,
);
/// Service.
pub const SERVICE: Kind = Kind::new("v1", "Service", "services", true, false);
/// Deployment.
pub const DEPLOYMENT: Kind = Kind::new("apps/v1", "Deployment", "deployments", true, false);
/// StatefulSet.
pub const STATEFUL_SET: Kind = Kind::new("apps/v1", "StatefulSet", "statefulsets", true, false);
/// DaemonSet.
pub const DAEMON_SET: Kind = Kind::new("apps/v1", "DaemonSet", "daemonsets", true, false);
/// ReplicaSet.
pub const REPLICA_SET: Kind = Kind::new("apps/v1", "ReplicaSet", "replicasets", true, false);
/// Job.
pub const JOB: Kind = Kind::new("batch/v1", "Job", "jobs", true, false);
/// CronJob.
pub const CRON_JOB: Kind = Kind::new("batch/v1", "CronJob", "cronjobs", true, false);

/// Every kind, in restore order.
pub const ALL: [Kind; 12] = [
    CRD,
    NAMESPACE,
    MACVLAN_SUBNET,
    MACVLAN_IP,
    FLAT_NETWORK_SUBNET,
    SERVICE,
    DEPLOYMENT,
    STATEFUL_SET,
    DAEMON_SET,
    REPLICA_SET,
    JOB,
    CRON_JOB,
];

/// Workload kinds whose pod template may carry V1 annotations.
pub const WORKLOADS: [Kind; 6] = [
    DEPLOYMENT,
    STATEFUL_SET,
    DAEMON_SET,
    REPLICA_SET,
    JOB,
    CRON_JOB,
];

/// Path of the pod template's metadata inside a workload object. CronJobs
/// nest it in their job template (the original read the job template's own
/// metadata, so CronJobs were never migrated).
pub fn template_metadata_path(kind: &Kind) -> &'static [&'static str] {
    if *kind == CRON_JOB {
        &["spec", "jobTemplate", "spec", "template", "metadata"]
    } else {
        &["spec", "template", "metadata"]
    }
}
