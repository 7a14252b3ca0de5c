//! `FlatNetworkConfig`: the one cluster-wide configuration object (named
//! `cluster`), holding what an administrator changes at run time without
//! a rollout: the MAC pool and the cluster-wide runtime settings. Its
//! status says whether flatnet as a whole is `Available`, `Progressing` or
//! `Degraded`.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::wire;
use crate::{
    env::ArpPolicy,
    ipam::{MacRange, MacRangeError},
    validation::{MAX_MTU, MIN_MTU_IPV4},
};

/// The only accepted name of the FlatNetworkConfig.
pub const CONFIG_NAME: &str = "cluster";

/// Condition: every part of flatnet is serving.
pub const CONDITION_AVAILABLE: &str = "Available";
/// Condition: a change is being rolled out (agents updating, a new
/// generation of the config not applied yet).
pub const CONDITION_PROGRESSING: &str = "Progressing";
/// Condition: a part of flatnet is not working; the message names it.
pub const CONDITION_DEGRADED: &str = "Degraded";
/// Condition: MACs of the MAC pool's range were seen on the LAN that no
/// FlatNetworkIP of this cluster holds (another cluster or hosts use the
/// range); the message names them.
pub const CONDITION_MAC_RANGE_SHARED: &str = "MacRangeShared";

/// Cluster-wide flatnet settings. Each field left out keeps the
/// environment variable of the operator (or, under `agents`, of the
/// agents) or its default.
#[allow(
    clippy::duplicated_attributes,
    reason = "kube's printcolumn(...) attributes repeat the same keys by design"
)]
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "flatnetwork.pandaria.io",
    version = "v1",
    kind = "FlatNetworkConfig",
    status = "FlatNetworkConfigStatus",
    derive = "PartialEq",
    derive = "Default",
    shortname = "flconfig",
    annotation("helm.sh/resource-policy", "keep"),
    doc = "Cluster-wide flatnet settings (one object, named cluster) and flatnet's overall health.",
    printcolumn(
        name = "MAC pool",
        type_ = "string",
        json_path = ".status.macPool.rangeStart"
    ),
    printcolumn(
        name = "Available",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Available\")].status"
    ),
    printcolumn(
        name = "Degraded",
        type_ = "string",
        json_path = ".status.conditions[?(@.type==\"Degraded\")].status"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct FlatNetworkConfigSpec {
    /// The MAC pool flat interfaces that name no MAC get theirs from.
    #[serde(default)]
    pub mac_pool: MacPoolSpec,

    /// MTU of the pod interfaces written into the attachment (0: the
    /// parent link's). Overrides `FLATNET_CNI_MTU`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = 65535))]
    pub default_mtu: Option<u32>,

    /// How a new address is announced: `arp_notify` or `arping`. Overrides
    /// `FLAT_NETWORK_CNI_ARP_POLICY`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("enum" = ["arp_notify", "arping"]))]
    pub arp_policy: Option<String>,

    /// The node agents' settings, applied by every agent as it reads
    /// them (no rollout).
    #[serde(default)]
    pub agents: AgentsSpec,

    /// How long the agent DaemonSet's rollout, or agents starting, may make
    /// no progress before the configuration turns `Degraded`
    /// (`ProgressDeadlineExceeded`); 600 when left out, like a
    /// Deployment's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub progress_deadline_seconds: Option<u32>,
}

impl FlatNetworkConfigSpec {
    /// `arpPolicy` when it names a policy. The webhook refuses any other
    /// value; an object stored before it ran keeps the environment's.
    #[must_use]
    pub fn arp_policy(&self) -> Option<ArpPolicy> {
        self.arp_policy.as_deref().and_then(ArpPolicy::parse)
    }
}

/// Where a setting in force comes from, as the operator's and the agents'
/// logs name it: the FlatNetworkConfig when it sets the field, else the
/// environment (a variable, a flag, or the built-in default).
#[must_use]
pub fn setting_source(set_in_config: bool) -> &'static str {
    if set_in_config {
        "FlatNetworkConfig"
    } else {
        "environment"
    }
}

/// How long a rollout may make no progress, when the spec does not say.
pub const DEFAULT_PROGRESS_DEADLINE_SECONDS: u32 = 600;

/// The longest conflict probe: it delays every ADD by its wait.
pub const MAX_CONFLICT_PROBE_MILLISECONDS: u32 = 10_000;

/// The node agents' settings. Each field left out keeps the agent's
/// environment variable (or flag), or its default.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct AgentsSpec {
    /// The ADD-time conflict probe: before a pod gets an address, the
    /// node asks the LAN whether another host uses it.
    #[serde(default)]
    pub conflict_probe: ConflictProbeSpec,

    /// Whether the agents enforce MultiNetworkPolicies for the flat
    /// network (false: every pod sends and receives unfiltered). Overrides
    /// `FLATNET_POLICY_ENFORCEMENT`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_enforcement: Option<bool>,
}

/// The conflict probe's settings.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct ConflictProbeSpec {
    /// Probe at all. Overrides `FLATNET_CONFLICT_PROBE_MS=0` (off) or
    /// another value (on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// How long ADD listens for an answer (1..10000 ms). Overrides the
    /// value of `FLATNET_CONFLICT_PROBE_MS`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 10000))]
    pub wait_milliseconds: Option<u32>,
}

/// Which namespaces' pods get MACs from the pool.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum MacPoolMode {
    /// Every namespace, except those labelled
    /// `flatnetwork.pandaria.io/mac-pool=disabled`.
    #[default]
    OptOut,
    /// Only namespaces labelled `flatnetwork.pandaria.io/mac-pool=enabled`.
    OptIn,
    /// No pod gets a MAC from the pool (the kernel chooses one).
    Disabled,
}

/// The MAC pool's settings.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct MacPoolSpec {
    /// First MAC of the pool; with `rangeEnd`, or neither (a random locally
    /// administered range is chosen once and kept in the status).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range_start: Option<String>,
    /// Last MAC of the pool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range_end: Option<String>,
    /// `OptOut` (default), `OptIn` or `Disabled`.
    #[serde(default)]
    pub mode: MacPoolMode,
}

impl MacPoolSpec {
    /// The configured range, `None` when neither end is set.
    ///
    /// # Errors
    /// Only one end set, or an invalid range.
    pub fn range(&self) -> Result<Option<MacRange>, MacRangeError> {
        match (&self.range_start, &self.range_end) {
            (None, None) => Ok(None),
            (Some(start), Some(end)) => MacRange::parse(start, end).map(Some),
            _ => Err(MacRangeError::HalfOpen),
        }
    }
}

impl FlatNetworkConfigSpec {
    /// Every problem of the spec, each naming its field: what the webhook
    /// refuses.
    #[must_use]
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if let Err(error) = self.mac_pool.range() {
            problems.push(format!("spec.{error}"));
        }
        if let Some(mtu) = self.default_mtu
            && mtu != 0
            && !(MIN_MTU_IPV4..=MAX_MTU).contains(&mtu)
        {
            problems.push(format!(
                "spec.defaultMtu {mtu} is out of range: use {MIN_MTU_IPV4}..{MAX_MTU}, or 0 for the parent link's"
            ));
        }
        if let Some(policy) = &self.arp_policy
            && ArpPolicy::parse(policy).is_none()
        {
            problems.push(format!(
                "spec.arpPolicy {policy:?} is not a policy: use {}",
                ArpPolicy::choices()
            ));
        }
        if let Some(wait) = self.agents.conflict_probe.wait_milliseconds
            && !(1..=MAX_CONFLICT_PROBE_MILLISECONDS).contains(&wait)
        {
            problems.push(format!(
                "spec.agents.conflictProbe.waitMilliseconds {wait} is out of range: use 1..{MAX_CONFLICT_PROBE_MILLISECONDS} (every ADD waits that long), or enabled: false to turn the probe off"
            ));
        }
        if self.progress_deadline_seconds == Some(0) {
            problems.push(
                "spec.progressDeadlineSeconds 0 is out of range: use 1 or more (600 when left out)"
                    .to_owned(),
            );
        }
        problems
    }

    /// Warnings for a spec without [`problems`](Self::problems): what the
    /// webhook admits but the user should hear about (a range that is not
    /// locally administered, or overlaps [`WELL_KNOWN_MACS`]).
    #[must_use]
    pub fn warnings(&self) -> Vec<String> {
        let Ok(Some(range)) = self.mac_pool.range() else {
            return Vec::new();
        };
        let mut warnings = Vec::new();
        if !range.is_locally_administered() {
            warnings.push(format!(
                "spec.macPool range {range} is not locally administered (second-lowest bit of the first byte clear): its MACs may belong to a vendor's hardware on the LAN; prefer a range starting with 02"
            ));
        }
        for (first, last, user) in WELL_KNOWN_MACS {
            // Each parses (tested).
            if let Ok(known) = MacRange::parse(first, last)
                && range.overlaps(&known)
            {
                warnings.push(format!(
                    "spec.macPool range {range} overlaps {known}, used by {user}: pods may get a MAC such an interface already has on the LAN; choose a range outside it"
                ));
            }
        }
        warnings
    }
}

/// MAC ranges other software hands out on hosts and LANs flatnet shares:
/// a pool overlapping one may give a pod a MAC such a host or interface
/// already has. (first, last, who uses it)
pub const WELL_KNOWN_MACS: &[(&str, &str, &str)] = &[
    (
        "02:42:00:00:00:00",
        "02:42:ff:ff:ff:ff",
        "Docker bridge networks (02:42 and the container's IPv4 address)",
    ),
    (
        "0a:58:00:00:00:00",
        "0a:58:ff:ff:ff:ff",
        "OVN-Kubernetes pod interfaces (0a:58 and the pod's IPv4 address)",
    ),
    (
        "52:54:00:00:00:00",
        "52:54:00:ff:ff:ff",
        "QEMU/KVM and libvirt guests",
    ),
    (
        "ee:ee:ee:ee:ee:ee",
        "ee:ee:ee:ee:ee:ee",
        "Calico's host-side veth interfaces",
    ),
    (
        "00:00:5e:00:01:00",
        "00:00:5e:00:02:ff",
        "VRRP virtual routers (keepalived and routers' first-hop redundancy)",
    ),
];

/// The MAC range in use, as the status records it.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct MacPoolStatus {
    /// First MAC.
    pub range_start: String,
    /// Last MAC.
    pub range_end: String,
    /// Whether the range was chosen at random (no range in the spec).
    #[serde(default)]
    pub generated: bool,
}

impl MacPoolStatus {
    /// The recorded range, `None` when it does not parse.
    #[must_use]
    pub fn range(&self) -> Option<MacRange> {
        MacRange::parse(&self.range_start, &self.range_end).ok()
    }
}

/// Observed state of the FlatNetworkConfig, written by the operator.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[schemars(transform = wire::without_defaults)]
#[serde(rename_all = "camelCase")]
pub struct FlatNetworkConfigStatus {
    /// The MAC range in use: the spec's, or the random one chosen once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac_pool: Option<MacPoolStatus>,

    /// The `metadata.generation` the operator applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// `Available`, `Progressing`, `Degraded`.
    #[serde(
        default,
        deserialize_with = "wire::null_as_default",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl FlatNetworkConfig {
    /// How long a rollout may make no progress.
    #[must_use]
    pub fn progress_deadline(&self) -> std::time::Duration {
        std::time::Duration::from_secs(u64::from(
            self.spec
                .progress_deadline_seconds
                .filter(|s| *s > 0)
                .unwrap_or(DEFAULT_PROGRESS_DEADLINE_SECONDS),
        ))
    }

    /// The MAC range allocation uses: the spec's when set and valid, else
    /// the one recorded in the status.
    #[must_use]
    pub fn mac_range(&self) -> Option<MacRange> {
        match self.spec.mac_pool.range() {
            Ok(Some(range)) => Some(range),
            Ok(None) => self.status.as_ref()?.mac_pool.as_ref()?.range(),
            Err(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_minimal_object_and_both_range_forms() {
        let config: FlatNetworkConfig = serde_json::from_value(serde_json::json!({
            "apiVersion": "flatnetwork.pandaria.io/v1",
            "kind": "FlatNetworkConfig",
            "metadata": {"name": "cluster"},
            "spec": {}
        }))
        .unwrap();
        assert_eq!(config.spec.mac_pool.mode, MacPoolMode::OptOut);
        assert_eq!(config.mac_range(), None);

        let mut config = config;
        config.status = Some(FlatNetworkConfigStatus {
            mac_pool: Some(MacPoolStatus {
                range_start: "02:12:34:00:00:00".into(),
                range_end: "02:12:34:ff:ff:ff".into(),
                generated: true,
            }),
            ..FlatNetworkConfigStatus::default()
        });
        assert_eq!(
            config.mac_range(),
            Some(MacRange::locally_administered(0x1234))
        );
        config.spec.mac_pool.range_start = Some("02:00:00:00:00:10".into());
        assert_eq!(config.spec.mac_pool.range(), Err(MacRangeError::HalfOpen));
        config.spec.mac_pool.range_end = Some("02:00:00:00:00:1f".into());
        assert_eq!(config.mac_range().map(|r| r.len()), Some(16));
    }

    fn spec(start: Option<&str>, end: Option<&str>) -> FlatNetworkConfigSpec {
        FlatNetworkConfigSpec {
            mac_pool: MacPoolSpec {
                range_start: start.map(Into::into),
                range_end: end.map(Into::into),
                ..MacPoolSpec::default()
            },
            ..FlatNetworkConfigSpec::default()
        }
    }

    #[test]
    fn bad_ranges_and_settings_are_refused_naming_the_field() {
        assert!(spec(None, None).problems().is_empty());
        assert!(
            spec(Some("02:00:00:00:00:00"), Some("02:00:00:ff:ff:ff"))
                .problems()
                .is_empty()
        );
        let half = spec(Some("02:00:00:00:00:00"), None).problems();
        assert!(half[0].contains("both rangeStart and rangeEnd"), "{half:?}");
        let reversed = spec(Some("02:00:00:00:00:09"), Some("02:00:00:00:00:01")).problems();
        assert!(reversed[0].contains("must not be after"), "{reversed:?}");
        let multicast = spec(Some("01:00:00:00:00:00"), Some("01:00:00:00:00:09")).problems();
        assert!(multicast[0].contains("macPool.rangeStart"), "{multicast:?}");
        let mut bad = spec(None, None);
        bad.default_mtu = Some(50);
        bad.arp_policy = Some("loud".into());
        let problems = bad.problems();
        assert!(
            problems[0].starts_with("spec.defaultMtu 50"),
            "{problems:?}"
        );
        assert!(problems[1].starts_with("spec.arpPolicy"), "{problems:?}");
    }

    #[test]
    fn agent_settings_and_the_progress_deadline_are_checked_naming_the_field() {
        let mut good = spec(None, None);
        good.agents.conflict_probe = ConflictProbeSpec {
            enabled: Some(true),
            wait_milliseconds: Some(MAX_CONFLICT_PROBE_MILLISECONDS),
        };
        good.agents.policy_enforcement = Some(false);
        good.progress_deadline_seconds = Some(1);
        assert!(good.problems().is_empty(), "{:?}", good.problems());
        for wait in [0, MAX_CONFLICT_PROBE_MILLISECONDS + 1] {
            let mut bad = good.clone();
            bad.agents.conflict_probe.wait_milliseconds = Some(wait);
            let problems = bad.problems();
            assert_eq!(problems.len(), 1, "{problems:?}");
            assert!(
                problems[0].starts_with(&format!(
                    "spec.agents.conflictProbe.waitMilliseconds {wait} is out of range"
                )),
                "{problems:?}"
            );
        }
        let mut bad = good;
        bad.progress_deadline_seconds = Some(0);
        assert!(
            bad.problems()[0].starts_with("spec.progressDeadlineSeconds 0"),
            "{:?}",
            bad.problems()
        );
    }

    #[test]
    fn the_progress_deadline_defaults_like_a_deployments() {
        let mut config = FlatNetworkConfig::new(CONFIG_NAME, spec(None, None));
        assert_eq!(config.progress_deadline().as_secs(), 600);
        config.spec.progress_deadline_seconds = Some(30);
        assert_eq!(config.progress_deadline().as_secs(), 30);
    }

    #[test]
    fn agent_settings_read_from_their_wire_form() {
        let spec: FlatNetworkConfigSpec = serde_json::from_value(serde_json::json!({
            "agents": {"conflictProbe": {"enabled": false, "waitMilliseconds": 300},
                       "policyEnforcement": true},
            "progressDeadlineSeconds": 120
        }))
        .unwrap();
        assert_eq!(spec.agents.conflict_probe.enabled, Some(false));
        assert_eq!(spec.agents.conflict_probe.wait_milliseconds, Some(300));
        assert_eq!(spec.agents.policy_enforcement, Some(true));
        assert_eq!(spec.progress_deadline_seconds, Some(120));
        // Left out: nothing is written back.
        let empty = serde_json::to_value(FlatNetworkConfigSpec::default()).unwrap();
        assert_eq!(
            empty["agents"],
            serde_json::json!({"conflictProbe": {}}),
            "{empty}"
        );
    }

    #[test]
    fn a_globally_administered_range_is_admitted_with_a_warning() {
        let warnings = spec(Some("00:50:56:00:00:00"), Some("00:50:56:00:ff:ff")).warnings();
        assert!(
            warnings[0].contains("not locally administered"),
            "{warnings:?}"
        );
        assert!(
            spec(Some("02:50:56:00:00:00"), Some("02:50:56:00:ff:ff"))
                .warnings()
                .is_empty()
        );
    }

    #[test]
    fn a_range_over_macs_other_software_uses_is_admitted_with_a_warning_naming_it() {
        let docker = spec(Some("02:40:00:00:00:00"), Some("02:43:00:00:00:00")).warnings();
        assert_eq!(docker.len(), 1, "{docker:?}");
        assert!(
            docker[0].contains("02:42:00:00:00:00-02:42:ff:ff:ff:ff")
                && docker[0].contains("Docker"),
            "{docker:?}"
        );
        let qemu = spec(Some("52:54:00:12:00:00"), Some("52:54:00:12:00:ff")).warnings();
        assert!(qemu[0].contains("QEMU"), "{qemu:?}");
        let vrrp = spec(Some("00:00:5e:00:00:00"), Some("00:00:5e:00:ff:ff")).warnings();
        assert_eq!(
            vrrp.len(),
            2,
            "not locally administered, and VRRP: {vrrp:?}"
        );
        assert!(vrrp[1].contains("VRRP"), "{vrrp:?}");
        // Just beside a known range: no warning.
        assert!(
            spec(Some("02:41:00:00:00:00"), Some("02:41:ff:ff:ff:ff"))
                .warnings()
                .is_empty()
        );
        for (first, last, _) in WELL_KNOWN_MACS {
            assert!(MacRange::parse(first, last).is_ok(), "{first}-{last}");
        }
    }
}
