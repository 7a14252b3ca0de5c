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
use crate::ipam::{MacRange, MacRangeError};

/// The only accepted name of the FlatNetworkConfig.
pub const CONFIG_NAME: &str = "cluster";

/// Condition: every part of flatnet is serving.
pub const CONDITION_AVAILABLE: &str = "Available";
/// Condition: a change is being rolled out (agents updating, a new
/// generation of the config not applied yet).
pub const CONDITION_PROGRESSING: &str = "Progressing";
/// Condition: a part of flatnet is not working; the message names it.
pub const CONDITION_DEGRADED: &str = "Degraded";

/// Cluster-wide flatnet settings. Each field left out keeps the operator's
/// environment variable or its default.
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
}
