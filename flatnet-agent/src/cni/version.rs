//! CNI specification versions: which ones flatnet-cni speaks, how a version
//! is chosen from a network configuration, and the `VERSION` command output.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A CNI specification version that flatnet-cni supports.
///
/// 0.1.0 and 0.2.0 are not supported: their result format (`ip4`/`ip6`
/// objects) predates chaining, and no supported Kubernetes runtime or Multus
/// release needs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CniVersion {
    /// 0.3.0: rich results (`interfaces`, `ips` with `version`).
    V0_3_0,
    /// 0.3.1: same format as 0.3.0.
    V0_3_1,
    /// 0.4.0: adds CHECK and `prevResult` on DEL.
    V0_4_0,
    /// 1.0.0: drops `version` from `ips`.
    V1_0_0,
    /// 1.1.0: adds STATUS, GC, `cniVersions` and new result fields.
    V1_1_0,
}

impl CniVersion {
    /// Every supported version, oldest first (the order of `supportedVersions`).
    pub const SUPPORTED: [CniVersion; 5] = [
        CniVersion::V0_3_0,
        CniVersion::V0_3_1,
        CniVersion::V0_4_0,
        CniVersion::V1_0_0,
        CniVersion::V1_1_0,
    ];

    /// The newest supported version; used when the caller's version is unknown.
    pub const LATEST: CniVersion = CniVersion::V1_1_0;

    /// The version string as written in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            CniVersion::V0_3_0 => "0.3.0",
            CniVersion::V0_3_1 => "0.3.1",
            CniVersion::V0_4_0 => "0.4.0",
            CniVersion::V1_0_0 => "1.0.0",
            CniVersion::V1_1_0 => "1.1.0",
        }
    }

    /// CHECK exists since 0.4.0.
    pub fn has_check(self) -> bool {
        self >= CniVersion::V0_4_0
    }

    /// STATUS and GC exist since 1.1.0.
    pub fn has_status_and_gc(self) -> bool {
        self >= CniVersion::V1_1_0
    }

    /// Results carry `ips[].version` before 1.0.0.
    pub fn has_ip_version_field(self) -> bool {
        self < CniVersion::V1_0_0
    }

    /// Interface `mtu`/`socketPath`/`pciID` and route attributes exist since 1.1.0.
    pub fn has_extended_result_fields(self) -> bool {
        self >= CniVersion::V1_1_0
    }

    /// The highest version in `candidates` that flatnet-cni supports.
    ///
    /// This is the `cniVersions` rule of the 1.1.0 specification: a
    /// configuration lists every version it is valid for and the newest
    /// mutually supported one wins. Unknown strings are skipped, not errors,
    /// so a configuration written for a future version still works.
    pub fn negotiate<'a>(candidates: impl IntoIterator<Item = &'a str>) -> Option<CniVersion> {
        candidates
            .into_iter()
            .filter_map(|candidate| candidate.parse().ok())
            .max()
    }

    /// `supportedVersions` as strings, oldest first.
    pub fn supported_strings() -> Vec<&'static str> {
        Self::SUPPORTED.iter().map(|v| v.as_str()).collect()
    }
}

impl fmt::Display for CniVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The string is not one of [`CniVersion::SUPPORTED`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CNI version {0:?} is not supported (supported: {supported})", supported = CniVersion::supported_strings().join(", "))]
pub struct UnsupportedVersion(pub String);

impl FromStr for CniVersion {
    type Err = UnsupportedVersion;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::SUPPORTED
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| UnsupportedVersion(s.to_owned()))
    }
}

impl Serialize for CniVersion {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for CniVersion {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        raw.parse().map_err(serde::de::Error::custom)
    }
}

/// Output of the `VERSION` command.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VersionInfo {
    /// The version this output is written in.
    pub cni_version: CniVersion,
    /// Every version flatnet-cni accepts in a network configuration.
    pub supported_versions: Vec<String>,
}

impl VersionInfo {
    /// The answer to `VERSION`, written in `requested` when that version is
    /// supported and in [`CniVersion::LATEST`] otherwise (the runtime only
    /// reads `supportedVersions` to decide compatibility).
    pub fn new(requested: Option<&str>) -> Self {
        let cni_version = requested
            .and_then(|v| v.parse().ok())
            .unwrap_or(CniVersion::LATEST);
        VersionInfo {
            cni_version,
            supported_versions: CniVersion::supported_strings()
                .into_iter()
                .map(str::to_owned)
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_supported_version_and_round_trips() {
        for version in CniVersion::SUPPORTED {
            assert_eq!(version.as_str().parse::<CniVersion>(), Ok(version));
        }
    }

    #[test]
    fn rejects_pre_chaining_and_unknown_versions() {
        for raw in ["0.1.0", "0.2.0", "1.2.0", "", "1.0", "v1.0.0"] {
            assert!(raw.parse::<CniVersion>().is_err(), "{raw} must be rejected");
        }
    }

    #[test]
    fn negotiation_picks_the_highest_supported() {
        assert_eq!(
            CniVersion::negotiate(["0.4.0", "1.1.0", "1.0.0"]),
            Some(CniVersion::V1_1_0)
        );
        assert_eq!(
            CniVersion::negotiate(["1.0.0", "9.9.9"]),
            Some(CniVersion::V1_0_0)
        );
        assert_eq!(CniVersion::negotiate(["0.2.0", "2.0.0"]), None);
        assert_eq!(CniVersion::negotiate([]), None);
    }

    #[test]
    fn command_gates_follow_the_spec_history() {
        assert!(!CniVersion::V0_3_1.has_check());
        assert!(CniVersion::V0_4_0.has_check());
        assert!(!CniVersion::V1_0_0.has_status_and_gc());
        assert!(CniVersion::V1_1_0.has_status_and_gc());
        assert!(CniVersion::V0_4_0.has_ip_version_field());
        assert!(!CniVersion::V1_0_0.has_ip_version_field());
    }

    #[test]
    fn version_info_echoes_a_supported_request_and_lists_all() {
        let info = VersionInfo::new(Some("0.4.0"));
        assert_eq!(info.cni_version, CniVersion::V0_4_0);
        assert_eq!(
            serde_json::to_value(&info).unwrap(),
            serde_json::json!({
                "cniVersion": "0.4.0",
                "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
            })
        );
        assert_eq!(
            VersionInfo::new(Some("0.1.0")).cni_version,
            CniVersion::LATEST
        );
        assert_eq!(VersionInfo::new(None).cni_version, CniVersion::LATEST);
    }
}
