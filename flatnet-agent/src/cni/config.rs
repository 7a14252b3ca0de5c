//! The network configuration flatnet-cni reads on stdin: the standard CNI
//! fields, what runtimes and Multus add (`runtimeConfig`, `args`,
//! `prevResult`, `cni.dev/valid-attachments`), and flatnet's own fields.
//!
//! Unknown fields are accepted and kept in [`NetworkConfig::extra`] so the
//! agent sees them (an upstream `ipam` block, for example), but flatnet-cni
//! itself gives them no meaning. The original's `flatNetwork` block is
//! read: its `arpPolicy` and `proxyARP` say how the network's new
//! interfaces are announced.

use std::collections::BTreeMap;
use std::path::PathBuf;

use flatnet_k8s::{env::ArpPolicy, ipam::Mac};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::error::{CniError, ErrorCode};
use super::names::is_cni_identifier;
use super::result::{CniResult, IpWithPrefix};
use super::version::CniVersion;

/// Smallest MTU Linux accepts on an IPv4 interface.
const MIN_MTU: u32 = 68;
/// Largest MTU a netlink link can carry.
const MAX_MTU: u32 = 65535;
/// Levels accepted in `logLevel`.
pub const LOG_LEVELS: [&str; 5] = ["trace", "debug", "info", "warn", "error"];

/// DNS settings (network configuration `dns` and result `dns`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dns {
    /// Name servers, in priority order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nameservers: Vec<String>,
    /// Local domain for short names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<String>,
    /// Search domains, in priority order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub search: Vec<String>,
    /// Resolver options.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub options: Vec<String>,
}

impl Dns {
    /// True when no field is set (the `dns` key is then omitted).
    pub fn is_empty(&self) -> bool {
        self.nameservers.is_empty()
            && self.domain.is_none()
            && self.search.is_empty()
            && self.options.is_empty()
    }
}

/// `runtimeConfig`: capability arguments from the runtime or Multus.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeConfig {
    /// Requested MAC (`mac` capability, e.g. the Multus networks annotation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// Requested addresses (`ips` capability).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ips: Vec<IpWithPrefix>,
    /// Other capabilities (`portMappings`, `bandwidth`, ...), passed through.
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

impl RuntimeConfig {
    /// The MAC asked for, parsed by the project's one MAC parser; error 7
    /// when it is not a usable unicast MAC.
    pub fn requested_mac(&self) -> Result<Option<Mac>, CniError> {
        self.mac
            .as_deref()
            .map(|text| {
                Mac::parse(text).map_err(|reason| {
                    CniError::new(
                        ErrorCode::InvalidNetworkConfig,
                        format!("runtimeConfig.mac: {reason}"),
                    )
                })
            })
            .transpose()
    }
}

/// One entry of `cni.dev/valid-attachments` (GC): an attachment that is
/// still in use and whose resources must be kept.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ValidAttachment {
    /// Container ID of the attachment.
    #[serde(rename = "containerID")]
    pub container_id: String,
    /// Interface name of the attachment.
    pub ifname: String,
}

/// A plugin network configuration, as received on stdin.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkConfig {
    /// The specification version this configuration (and our output) uses.
    pub cni_version: CniVersion,
    /// Every version the configuration is valid for (1.1.0 conflists).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cni_versions: Vec<String>,
    /// Network name (the NetworkAttachmentDefinition name under Multus).
    pub name: String,
    /// Plugin type, i.e. the executable name (`flatnet-cni`).
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// Capabilities the configuration enables.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub capabilities: BTreeMap<String, bool>,
    /// Capability arguments filled in by the runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_config: Option<RuntimeConfig>,
    /// Free-form arguments (`args.cni.*` by convention); never rejected.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub args: Map<String, Value>,
    /// Result of the previous ADD (CHECK and DEL) or previous plugin (chains).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prev_result: Option<CniResult>,
    /// DNS settings to report in the result.
    #[serde(default, skip_serializing_if = "Dns::is_empty")]
    pub dns: Dns,
    /// GC: attachments still in use. Read it through [`NetworkConfig::valid_attachments`].
    #[serde(
        default,
        rename = "cni.dev/valid-attachments",
        skip_serializing_if = "Option::is_none"
    )]
    valid_attachments: Option<Vec<ValidAttachment>>,
    /// GC: the same list under the key early 1.1.0 runtimes send (libcni
    /// sends both keys, so both must be accepted).
    #[serde(
        default,
        rename = "cni.dev/attachments",
        skip_serializing_if = "Option::is_none"
    )]
    attachments_alias: Option<Vec<ValidAttachment>>,

    /// Agent socket path; the `FLATNET_AGENT_SOCKET` variable overrides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_socket: Option<PathBuf>,
    /// How long flatnet-cni waits for the agent, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_timeout_seconds: Option<u64>,
    /// FlatNetworkSubnet to allocate from, overriding the pod annotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subnet: Option<String>,
    /// MTU of the pod interface; the subnet's or the parent's when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// Log level of flatnet-cni's log file (one of [`LOG_LEVELS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_level: Option<String>,
    /// File flatnet-cni appends its log to; no log is written without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_file: Option<PathBuf>,
    /// The original's block, in the NetworkAttachmentDefinitions both its
    /// operator and flatnet's write.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flat_network: Option<FlatNetworkBlock>,

    /// Every other field, kept for the agent and otherwise ignored.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The `flatNetwork` block of a network configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FlatNetworkBlock {
    /// How the network's new interfaces announce their addresses; read
    /// through [`FlatNetworkBlock::arp_policy`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    arp_policy: Option<String>,
    /// `proxy_arp` on the network's new interfaces.
    #[serde(default, rename = "proxyARP", skip_serializing_if = "Option::is_none")]
    pub proxy_arp: Option<bool>,
    /// Every other field (`clusterCIDR`, `serviceCIDR`, `mtu`), kept and
    /// otherwise ignored.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl FlatNetworkBlock {
    /// The block with `arpPolicy` set to `policy`.
    #[must_use]
    pub fn with_arp_policy(mut self, policy: ArpPolicy) -> Self {
        self.arp_policy = Some(policy.as_str().to_owned());
        self
    }

    /// `arpPolicy`, when set ([`NetworkConfig::validate`] refuses a value
    /// that names no policy).
    #[must_use]
    pub fn arp_policy(&self) -> Option<ArpPolicy> {
        self.arp_policy.as_deref().and_then(ArpPolicy::parse)
    }
}

impl NetworkConfig {
    /// Decodes and validates a configuration read on stdin.
    ///
    /// Errors: 6 when it is not a JSON object, 1 when no supported version
    /// can be chosen, 7 when a field has the wrong type or the name is
    /// invalid, 2 when a flatnet field has an unsupported value.
    pub fn decode(stdin: &[u8]) -> Result<NetworkConfig, CniError> {
        let value: Value = serde_json::from_slice(stdin).map_err(|e| {
            CniError::new(
                ErrorCode::Decode,
                "network config on stdin is not valid JSON; the runtime or Multus must pass the NetworkAttachmentDefinition config",
            )
            .with_details(e)
        })?;
        let Value::Object(mut object) = value else {
            return Err(CniError::new(
                ErrorCode::Decode,
                "network config on stdin must be a JSON object",
            ));
        };
        let version = select_version(&object)?;
        object.insert("cniVersion".into(), version.as_str().into());
        let object = Value::Object(object);
        let config =
            NetworkConfig::deserialize(&object).map_err(|e| field_error(&object, version, e))?;
        config.validate()?;
        Ok(config)
    }

    /// The attachments GC must keep, from either key.
    pub fn valid_attachments(&self) -> Vec<ValidAttachment> {
        let mut all: Vec<ValidAttachment> = self
            .valid_attachments
            .iter()
            .chain(&self.attachments_alias)
            .flatten()
            .cloned()
            .collect();
        all.sort();
        all.dedup();
        all
    }

    /// True when the runtime sent a valid-attachments list (under either key).
    pub fn has_valid_attachments(&self) -> bool {
        self.valid_attachments.is_some() || self.attachments_alias.is_some()
    }

    /// The checks [`NetworkConfig::decode`] makes, for a configuration
    /// that arrived another way (the agent socket).
    pub fn validate(&self) -> Result<(), CniError> {
        if !is_valid_network_name(&self.name) {
            return Err(CniError::new(
                ErrorCode::InvalidNetworkConfig,
                format!(
                    "network name {:?} is invalid: it must start with a letter or digit and contain only letters, digits, '_', '.' and '-'",
                    self.name
                ),
            ));
        }
        if self.plugin_type.is_empty() {
            return Err(CniError::new(
                ErrorCode::InvalidNetworkConfig,
                format!(
                    "network {:?}: field \"type\" must name the plugin executable",
                    self.name
                ),
            ));
        }
        if let Some(mtu) = self.mtu
            && !(MIN_MTU..=MAX_MTU).contains(&mtu)
        {
            return Err(unsupported(
                &self.name,
                "mtu",
                mtu,
                &format!("{MIN_MTU}..={MAX_MTU}"),
            ));
        }
        if self.agent_timeout_seconds == Some(0) {
            return Err(unsupported(
                &self.name,
                "agentTimeoutSeconds",
                0,
                "at least 1",
            ));
        }
        if let Some(level) = &self.log_level
            && !LOG_LEVELS.contains(&level.as_str())
        {
            return Err(unsupported(
                &self.name,
                "logLevel",
                level,
                &LOG_LEVELS.join(", "),
            ));
        }
        if let Some(runtime) = &self.runtime_config {
            runtime.requested_mac()?;
        }
        check_ipam(&self.name, self.extra.get("ipam"))?;
        if let Some(policy) = self
            .flat_network
            .as_ref()
            .and_then(|block| block.arp_policy.as_deref())
            && ArpPolicy::parse(policy).is_none()
        {
            return Err(unsupported(
                &self.name,
                "flatNetwork.arpPolicy",
                format!("{policy:?}"),
                &ArpPolicy::choices(),
            ));
        }
        if let Some(subnet) = &self.subnet
            && subnet.is_empty()
        {
            return Err(unsupported(
                &self.name,
                "subnet",
                "\"\"",
                "a FlatNetworkSubnet name",
            ));
        }
        Ok(())
    }
}

/// The only `ipam` plugin a flat network may name: the original's NADs say
/// `static-ipam`, which it fed with the operator's allocation. flatnet
/// allocates through the FlatNetworkSubnet the same way, so that block is
/// accepted and means nothing more.
pub const ORIGINAL_IPAM: &str = "static-ipam";

/// `ipam` is absent or names [`ORIGINAL_IPAM`]; any other plugin (host-local,
/// whereabouts, ...) would be silently ignored, so it is refused (code 2).
fn check_ipam(network: &str, ipam: Option<&Value>) -> Result<(), CniError> {
    let Some(ipam) = ipam else {
        return Ok(());
    };
    let plugin = ipam.get("type").and_then(Value::as_str);
    if plugin == Some(ORIGINAL_IPAM) {
        return Ok(());
    }
    Err(CniError::new(
        ErrorCode::UnsupportedField,
        format!(
            "network {network:?}: field \"ipam\" has unsupported value {ipam}; flatnet allocates addresses from the FlatNetworkSubnet itself, so remove \"ipam\" or leave it {{\"type\": \"{ORIGINAL_IPAM}\"}} as written for rancher-flat-network"
        ),
    ))
}

/// Code 2 for a flatnet field whose value is well typed but not supported.
/// The specification asks for the key and the value in the message.
fn unsupported(
    network: &str,
    key: &str,
    value: impl std::fmt::Display,
    expected: &str,
) -> CniError {
    CniError::new(
        ErrorCode::UnsupportedField,
        format!(
            "network {network:?}: field {key:?} has unsupported value {value}; expected {expected}"
        ),
    )
}

/// Chooses the version: `cniVersion` when present (the runtime already
/// negotiated it), else the highest supported entry of `cniVersions`.
/// A configuration with neither is a 0.1.0 configuration, which is not supported.
fn select_version(object: &Map<String, Value>) -> Result<CniVersion, CniError> {
    let supported = CniVersion::supported_strings().join(", ");
    match object.get("cniVersion") {
        Some(Value::String(declared)) => declared.parse().map_err(|_| {
            CniError::new(
                ErrorCode::IncompatibleVersion,
                format!("cniVersion {declared:?} is not supported by flatnet-cni; use one of {supported}"),
            )
        }),
        Some(other) => Err(CniError::new(
            ErrorCode::InvalidNetworkConfig,
            format!("field \"cniVersion\" must be a string such as \"1.0.0\", not {other}"),
        )),
        None => {
            let listed = match object.get("cniVersions") {
                None => Vec::new(),
                Some(Value::Array(items)) => items.iter().filter_map(Value::as_str).collect(),
                Some(other) => {
                    return Err(CniError::new(
                        ErrorCode::InvalidNetworkConfig,
                        format!("field \"cniVersions\" must be a list of version strings, not {other}"),
                    ));
                }
            };
            CniVersion::negotiate(listed).ok_or_else(|| {
                CniError::new(
                    ErrorCode::IncompatibleVersion,
                    format!(
                        "network config sets no supported cniVersion (without one it means 0.1.0); set cniVersion to one of {supported}"
                    ),
                )
            })
        }
    }
}

/// Code 7 naming the first field that does not decode.
///
/// serde reports the type mismatch but not where it is, so each top-level
/// field is decoded alone (with the required fields filled in) until one
/// fails. This runs only on the error path.
fn field_error(object: &Value, version: CniVersion, error: serde_json::Error) -> CniError {
    let name = object
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("<unnamed>");
    let failing = object
        .as_object()
        .into_iter()
        .flatten()
        .find(|(key, value)| {
            let mut probe = Map::new();
            probe.insert("cniVersion".into(), version.as_str().into());
            probe.insert("name".into(), "probe".into());
            probe.insert("type".into(), "probe".into());
            probe.insert((*key).clone(), (*value).clone());
            serde_json::from_value::<NetworkConfig>(Value::Object(probe)).is_err()
        });
    let msg = match failing {
        Some((key, _)) => format!("network {name:?}: field {key:?} is invalid: {error}"),
        None => format!("network {name:?} is invalid: {error}"),
    };
    CniError::new(ErrorCode::InvalidNetworkConfig, msg)
}

/// CNI network names: a letter or digit, then letters, digits, `_`, `.`, `-`.
pub fn is_valid_network_name(name: &str) -> bool {
    is_cni_identifier(name)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn decode(value: Value) -> Result<NetworkConfig, CniError> {
        NetworkConfig::decode(value.to_string().as_bytes())
    }

    #[test]
    fn decodes_a_multus_config_with_runtime_fields() {
        let config = decode(json!({
            "cniVersion": "1.0.0",
            "name": "flat-net",
            "type": "flatnet-cni",
            "capabilities": {"ips": true, "mac": true},
            "runtimeConfig": {"ips": ["10.1.2.9/24"], "mac": "0a:00:00:00:00:09", "bandwidth": {"ingressRate": 1}},
            "args": {"cni": {"labels": {"a": "b"}}},
            "agentSocket": "/run/flatnet/agent.sock",
            "agentTimeoutSeconds": 30,
            "subnet": "vlan10",
            "mtu": 1450,
            "logLevel": "debug",
            "logFile": "/var/log/flatnet/cni.log",
            "ipam": {"type": "static-ipam"},
            "flatNetwork": {"mtu": 1500}
        }))
        .unwrap();
        assert_eq!(config.cni_version, CniVersion::V1_0_0);
        assert_eq!(config.name, "flat-net");
        let runtime = config.runtime_config.as_ref().unwrap();
        assert_eq!(runtime.ips[0].to_string(), "10.1.2.9/24");
        assert!(runtime.other.contains_key("bandwidth"));
        assert_eq!(config.mtu, Some(1450));
        assert_eq!(config.subnet.as_deref(), Some("vlan10"));
        // Unknown fields are kept for the agent, not rejected.
        assert!(config.extra.contains_key("ipam"));
        let block = config.flat_network.as_ref().unwrap();
        assert_eq!(block.extra["mtu"], 1500);
        assert_eq!((block.arp_policy(), block.proxy_arp), (None, None));
    }

    #[test]
    fn wire_round_trip_keeps_every_field() {
        let config = decode(json!({
            "cniVersion": "1.1.0", "name": "n", "type": "flatnet-cni",
            "cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "eth1"}],
            "somethingNew": [1, 2]
        }))
        .unwrap();
        let again: NetworkConfig =
            serde_json::from_value(serde_json::to_value(&config).unwrap()).unwrap();
        assert_eq!(again, config);
    }

    #[test]
    fn a_number_in_an_unknown_field_reaches_the_agent_unchanged() {
        // Found by the cni_invocation fuzz target: an integer too large for
        // 64 bits is read as the nearest float only with float_roundtrip;
        // without it, one read off by a unit in the last place was written
        // and read again as another number.
        let stdin = format!(
            r#"{{"cniVersion": "1.0.0", "name": "n", "type": "flatnet-cni", "flatNetwork": {{"mtu": 15{}}}}}"#,
            "0".repeat(90)
        );
        let config = NetworkConfig::decode(stdin.as_bytes()).unwrap();
        let block = config.flat_network.as_ref().unwrap();
        assert_eq!(block.extra["mtu"].as_f64(), Some(1.5e91));
        let again = NetworkConfig::decode(&serde_json::to_vec(&config).unwrap()).unwrap();
        assert_eq!(again, config);
    }

    #[test]
    fn not_json_or_not_an_object_is_a_decode_error() {
        for stdin in [&b"{"[..], b"", b"[1,2]", b"\"x\"", b"\xff\xfe"] {
            assert_eq!(
                NetworkConfig::decode(stdin).unwrap_err().code,
                ErrorCode::Decode
            );
        }
    }

    #[test]
    fn unsupported_or_missing_versions_are_code_1() {
        for config in [
            json!({"cniVersion": "0.2.0", "name": "n", "type": "t"}),
            json!({"cniVersion": "2.0.0", "name": "n", "type": "t"}),
            json!({"name": "n", "type": "t"}),
            json!({"cniVersions": ["0.1.0", "3.0.0"], "name": "n", "type": "t"}),
        ] {
            let error = decode(config.clone()).unwrap_err();
            assert_eq!(error.code, ErrorCode::IncompatibleVersion, "{config}");
        }
    }

    #[test]
    fn cni_versions_picks_the_highest_supported_when_cni_version_is_absent() {
        let config =
            decode(json!({"cniVersions": ["0.4.0", "1.1.0", "9.0.0"], "name": "n", "type": "t"}))
                .unwrap();
        assert_eq!(config.cni_version, CniVersion::V1_1_0);
        // An explicit cniVersion is what the runtime negotiated: it wins.
        let config = decode(json!({"cniVersion": "1.0.0", "cniVersions": ["1.0.0", "1.1.0"], "name": "n", "type": "t"})).unwrap();
        assert_eq!(config.cni_version, CniVersion::V1_0_0);
    }

    #[test]
    fn wrong_types_and_bad_names_are_code_7_and_name_the_field() {
        let error = decode(json!({"cniVersion": "1.0.0", "name": "n", "type": "t", "mtu": "big"}))
            .unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidNetworkConfig);
        assert!(error.msg.contains("\"mtu\""), "{}", error.msg);

        let error = decode(json!({"cniVersion": "1.0.0", "type": "t"})).unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidNetworkConfig);
        assert!(error.msg.contains("name"), "{}", error.msg);

        for name in ["", "-lead", "has space", "slash/x"] {
            let error =
                decode(json!({"cniVersion": "1.0.0", "name": name, "type": "t"})).unwrap_err();
            assert_eq!(error.code, ErrorCode::InvalidNetworkConfig, "{name:?}");
        }
        let error = decode(json!({"cniVersion": 1, "name": "n", "type": "t"})).unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidNetworkConfig);
        let error = decode(json!({"cniVersion": "1.0.0", "name": "n", "type": ""})).unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidNetworkConfig);
        let error = decode(json!({"cniVersion": "1.0.0", "name": "n", "type": "t",
            "runtimeConfig": {"ips": ["not-an-ip"]}}))
        .unwrap_err();
        assert!(error.msg.contains("runtimeConfig"), "{}", error.msg);
    }

    #[test]
    fn unsupported_flatnet_values_are_code_2_with_key_and_value() {
        for (key, value) in [
            ("mtu", json!(20)),
            ("mtu", json!(70000)),
            ("agentTimeoutSeconds", json!(0)),
            ("logLevel", json!("chatty")),
            ("subnet", json!("")),
        ] {
            let mut config = json!({"cniVersion": "1.0.0", "name": "n", "type": "t"});
            config[key] = value.clone();
            let error = decode(config).unwrap_err();
            assert_eq!(error.code, ErrorCode::UnsupportedField, "{key}={value}");
            assert!(error.msg.contains(key), "{}", error.msg);
        }
    }

    #[test]
    fn a_flat_network_block_naming_no_arp_policy_or_a_non_boolean_proxy_arp_is_refused() {
        let block = |block: Value| {
            decode(json!({"cniVersion": "1.0.0", "name": "n", "type": "t", "flatNetwork": block}))
        };
        let config = block(json!({"arpPolicy": "arping", "proxyARP": true})).unwrap();
        let parsed = config.flat_network.unwrap();
        assert_eq!(
            (parsed.arp_policy(), parsed.proxy_arp),
            (Some(ArpPolicy::Arping), Some(true))
        );
        let error = block(json!({"arpPolicy": "garp"})).unwrap_err();
        assert_eq!(error.code, ErrorCode::UnsupportedField);
        assert_eq!(
            error.msg,
            "network \"n\": field \"flatNetwork.arpPolicy\" has unsupported value \"garp\"; expected arp_notify or arping"
        );
        let error = block(json!({"proxyARP": "yes"})).unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidNetworkConfig, "{error:?}");
        assert!(error.msg.contains("flatNetwork"), "{}", error.msg);
    }

    #[test]
    fn original_nads_with_static_ipam_are_accepted_other_ipam_is_code_2() {
        // A NAD as written for rancher-flat-network.
        let config = decode(json!({
            "cniVersion": "1.0.0", "name": "rancher-flat-network",
            "type": "rancher-flat-network-cni",
            "ipam": {"type": "static-ipam"},
            "flatNetwork": {"mtu": 1500, "arpPolicy": "arp_notify", "proxyARP": false}
        }))
        .unwrap();
        assert_eq!(config.plugin_type, "rancher-flat-network-cni");
        let block = config.flat_network.as_ref().unwrap();
        assert_eq!(
            (block.arp_policy(), block.proxy_arp),
            (Some(ArpPolicy::ArpNotify), Some(false))
        );
        for ipam in [
            json!({"type": "host-local"}),
            json!({}),
            json!("static-ipam"),
        ] {
            let error =
                decode(json!({"cniVersion": "1.0.0", "name": "n", "type": "t", "ipam": ipam}))
                    .unwrap_err();
            assert_eq!(error.code, ErrorCode::UnsupportedField, "{ipam}");
            assert!(error.msg.contains("\"ipam\""), "{}", error.msg);
            assert!(error.msg.contains("static-ipam"), "{}", error.msg);
        }
    }

    #[test]
    fn pre_chaining_versions_name_the_supported_ones() {
        for old in ["0.1.0", "0.2.0"] {
            let error = decode(json!({"cniVersion": old, "name": "n", "type": "t"})).unwrap_err();
            assert_eq!(error.code, ErrorCode::IncompatibleVersion);
            assert!(error.msg.contains(old), "{}", error.msg);
            assert!(
                error.msg.contains("0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0"),
                "{}",
                error.msg
            );
        }
    }

    #[test]
    fn valid_attachments_merge_both_keys() {
        let config = decode(json!({
            "cniVersion": "1.1.0", "name": "n", "type": "t",
            "cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth1"}],
            "cni.dev/attachments": [{"containerID": "a", "ifname": "eth1"}, {"containerID": "b", "ifname": "net1"}]
        }))
        .unwrap();
        assert!(config.has_valid_attachments());
        let ids: Vec<_> = config
            .valid_attachments()
            .into_iter()
            .map(|a| a.container_id)
            .collect();
        assert_eq!(ids, ["a", "b"]);
    }

    #[test]
    fn identifier_rule() {
        assert!(is_cni_identifier("a"));
        assert!(is_cni_identifier("9abc_d.e-f"));
        assert!(!is_cni_identifier(""));
        assert!(!is_cni_identifier("_a"));
        assert!(!is_cni_identifier("a b"));
        assert!(!is_cni_identifier("é"));
    }
}
