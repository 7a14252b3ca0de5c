//! The CNI error object and its codes: the specification's well-known codes
//! (0-99) and flatnet's own codes (100 and up).

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::version::CniVersion;

/// A CNI error code.
///
/// Codes below 100 are defined by the CNI specification; codes from 100 are
/// flatnet's. Unknown codes received from a newer agent are kept as
/// [`ErrorCode::Other`] so they reach the runtime unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// 1: the configuration's `cniVersion` is not supported, or the command
    /// does not exist in that version (CHECK before 0.4.0, STATUS/GC before 1.1.0).
    IncompatibleVersion,
    /// 2: a configuration field has a value flatnet does not support.
    UnsupportedField,
    /// 3: the container is unknown or does not exist.
    UnknownContainer,
    /// 4: a `CNI_*` environment variable is missing or malformed.
    InvalidEnvironment,
    /// 5: reading stdin, the socket or another file failed.
    Io,
    /// 6: stdin or a message could not be decoded (not JSON, wrong shape).
    Decode,
    /// 7: the network configuration is invalid.
    InvalidNetworkConfig,
    /// 11: a transient condition; the runtime should retry later.
    TryAgainLater,
    /// 50 (STATUS): the plugin cannot serve ADD requests.
    PluginNotAvailable,
    /// 51 (STATUS): as 50, and existing containers may have limited connectivity.
    PluginNotAvailableLimitedConnectivity,
    /// 100: unexpected failure inside the agent.
    AgentInternal,
    /// 101: the agent and flatnet-cni do not understand each other
    /// (different protocol versions or a malformed frame).
    AgentProtocol,
    /// 102: the agent did not answer in time.
    AgentTimeout,
    /// 103: no address is allocated to the pod yet.
    AddressNotAllocated,
    /// 104: the subnet the pod asks for does not exist.
    SubnetNotFound,
    /// 105: creating or configuring the pod interface failed.
    InterfaceSetup,
    /// 106: another host already answers for the pod's address.
    AddressConflict,
    /// Any other code, kept verbatim.
    Other(u32),
}

impl ErrorCode {
    /// The numeric code written in the error JSON.
    pub fn code(self) -> u32 {
        match self {
            ErrorCode::IncompatibleVersion => 1,
            ErrorCode::UnsupportedField => 2,
            ErrorCode::UnknownContainer => 3,
            ErrorCode::InvalidEnvironment => 4,
            ErrorCode::Io => 5,
            ErrorCode::Decode => 6,
            ErrorCode::InvalidNetworkConfig => 7,
            ErrorCode::TryAgainLater => 11,
            ErrorCode::PluginNotAvailable => 50,
            ErrorCode::PluginNotAvailableLimitedConnectivity => 51,
            ErrorCode::AgentInternal => 100,
            ErrorCode::AgentProtocol => 101,
            ErrorCode::AgentTimeout => 102,
            ErrorCode::AddressNotAllocated => 103,
            ErrorCode::SubnetNotFound => 104,
            ErrorCode::InterfaceSetup => 105,
            ErrorCode::AddressConflict => 106,
            ErrorCode::Other(code) => code,
        }
    }

    /// The code for a number; the inverse of [`ErrorCode::code`].
    pub fn from_code(code: u32) -> Self {
        const NAMED: [ErrorCode; 17] = [
            ErrorCode::IncompatibleVersion,
            ErrorCode::UnsupportedField,
            ErrorCode::UnknownContainer,
            ErrorCode::InvalidEnvironment,
            ErrorCode::Io,
            ErrorCode::Decode,
            ErrorCode::InvalidNetworkConfig,
            ErrorCode::TryAgainLater,
            ErrorCode::PluginNotAvailable,
            ErrorCode::PluginNotAvailableLimitedConnectivity,
            ErrorCode::AgentInternal,
            ErrorCode::AgentProtocol,
            ErrorCode::AgentTimeout,
            ErrorCode::AddressNotAllocated,
            ErrorCode::SubnetNotFound,
            ErrorCode::InterfaceSetup,
            ErrorCode::AddressConflict,
        ];
        NAMED
            .into_iter()
            .find(|named| named.code() == code)
            .unwrap_or(ErrorCode::Other(code))
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u32(self.code())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        u32::deserialize(deserializer).map(ErrorCode::from_code)
    }
}

/// A CNI error: what the plugin prints on stdout when it exits non-zero,
/// and what the agent returns over the socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniError {
    /// The error code.
    pub code: ErrorCode,
    /// A short message; kubelet shows it in `FailedCreatePodSandBox` events,
    /// so it names the object and the fix.
    pub msg: String,
    /// Longer detail (the underlying cause), if any.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub details: String,
}

impl CniError {
    /// An error without details.
    pub fn new(code: ErrorCode, msg: impl Into<String>) -> Self {
        CniError {
            code,
            msg: msg.into(),
            details: String::new(),
        }
    }

    /// Adds the underlying cause as `details`.
    pub fn with_details(mut self, details: impl fmt::Display) -> Self {
        self.details = details.to_string();
        self
    }

    /// The error JSON printed on stdout, written in `version`.
    pub fn to_json(&self, version: CniVersion) -> serde_json::Value {
        let mut value = serde_json::json!({
            "cniVersion": version,
            "code": self.code,
            "msg": self.msg,
        });
        if !self.details.is_empty() {
            value["details"] = serde_json::Value::String(self.details.clone());
        }
        value
    }
}

impl fmt::Display for CniError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CNI error {}: {}", self.code.code(), self.msg)?;
        if !self.details.is_empty() {
            write!(f, " ({})", self.details)?;
        }
        Ok(())
    }
}

impl std::error::Error for CniError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_code_round_trips_through_its_number() {
        for number in (0..=120).chain([255, 1000]) {
            assert_eq!(ErrorCode::from_code(number).code(), number);
        }
        assert_eq!(ErrorCode::from_code(11), ErrorCode::TryAgainLater);
        assert_eq!(
            ErrorCode::from_code(51),
            ErrorCode::PluginNotAvailableLimitedConnectivity
        );
        assert_eq!(ErrorCode::from_code(106), ErrorCode::AddressConflict);
        assert_eq!(ErrorCode::from_code(8), ErrorCode::Other(8));
    }

    #[test]
    fn error_json_has_the_spec_shape() {
        let error = CniError::new(ErrorCode::Decode, "bad stdin").with_details("line 1");
        assert_eq!(
            error.to_json(CniVersion::V1_0_0),
            serde_json::json!({
                "cniVersion": "1.0.0", "code": 6, "msg": "bad stdin", "details": "line 1"
            })
        );
        let bare = CniError::new(ErrorCode::TryAgainLater, "later");
        assert_eq!(
            bare.to_json(CniVersion::V1_1_0),
            serde_json::json!({"cniVersion": "1.1.0", "code": 11, "msg": "later"})
        );
    }

    #[test]
    fn wire_form_keeps_unknown_codes() {
        let decoded: CniError = serde_json::from_str(r#"{"code": 142, "msg": "future"}"#).unwrap();
        assert_eq!(decoded.code, ErrorCode::Other(142));
        assert_eq!(serde_json::to_value(&decoded).unwrap()["code"], 142);
    }
}
