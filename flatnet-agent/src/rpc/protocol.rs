//! Messages on the agent socket.

use serde::{Deserialize, Serialize};

use crate::cni::{CniError, CniRequest, CniResult, ErrorCode};

/// Version of this protocol. The agent refuses other versions with error
/// 101 so a node with mismatched flatnet-cni and agent fails loudly.
pub const PROTOCOL_VERSION: u32 = 1;

/// What flatnet-cni sends: one per connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AgentRequest {
    /// [`PROTOCOL_VERSION`] of the sender.
    pub protocol: u32,
    /// How long the sender waits for the answer; the agent stops working on
    /// the request by then so its error reaches the sender.
    pub timeout_ms: u64,
    /// The validated CNI request.
    pub request: CniRequest,
}

/// Only the protocol version: read first so a request from another
/// version is refused with a clear message even if its shape changed.
#[derive(Debug, Deserialize)]
struct ProtocolProbe {
    protocol: u32,
}

impl AgentRequest {
    /// Decodes the body of a request frame. A body of another protocol
    /// version, or one that does not parse, is error 101 (the peers come
    /// from different releases).
    pub fn decode(body: &[u8]) -> Result<AgentRequest, CniError> {
        let skew = |detail: String| {
            CniError::new(
                ErrorCode::AgentProtocol,
                format!(
                    "flatnet-agent cannot read the request: {detail}; make sure flatnet-cni and flatnet-agent on this node come from the same release"
                ),
            )
        };
        match serde_json::from_slice::<ProtocolProbe>(body) {
            Ok(probe) if probe.protocol == PROTOCOL_VERSION => {}
            Ok(probe) => {
                return Err(skew(format!(
                    "it uses protocol {} and the agent speaks {PROTOCOL_VERSION}",
                    probe.protocol
                )));
            }
            Err(error) => return Err(skew(error.to_string())),
        }
        serde_json::from_slice(body).map_err(|error| skew(error.to_string()))
    }
}

/// What the agent answers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "lowercase")]
pub enum AgentResponse {
    /// The command succeeded; ADD carries its result.
    Success {
        /// The ADD result; absent for other commands.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<CniResult>,
    },
    /// The command failed with a CNI error.
    Failure {
        /// The error, printed by flatnet-cni as is.
        error: CniError,
    },
}

impl AgentResponse {
    /// The response for a handler outcome.
    pub fn from_outcome(outcome: Result<Option<CniResult>, CniError>) -> Self {
        match outcome {
            Ok(result) => AgentResponse::Success { result },
            Err(error) => AgentResponse::Failure { error },
        }
    }

    /// Back to a handler outcome (client side).
    pub fn into_outcome(self) -> Result<Option<CniResult>, CniError> {
        match self {
            AgentResponse::Success { result } => Ok(result),
            AgentResponse::Failure { error } => Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn responses_have_a_stable_wire_form() {
        let failure = AgentResponse::Failure {
            error: CniError::new(ErrorCode::AddressNotAllocated, "no address yet"),
        };
        assert_eq!(
            serde_json::to_value(&failure).unwrap(),
            json!({"outcome": "failure", "error": {"code": 103, "msg": "no address yet"}})
        );
        let success = AgentResponse::Success { result: None };
        assert_eq!(
            serde_json::to_value(&success).unwrap(),
            json!({"outcome": "success"})
        );
        let back: AgentResponse = serde_json::from_value(json!({"outcome": "success"})).unwrap();
        assert_eq!(back.into_outcome(), Ok(None));
    }
}
