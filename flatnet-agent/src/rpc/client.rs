//! The blocking client used by flatnet-cni: connect, send one request,
//! read one response, all within the configured timeout.

use std::io::{self, ErrorKind};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use super::frame::{FrameError, MAX_FRAME_LEN, read_frame, write_frame};
use super::protocol::{AgentRequest, AgentResponse, PROTOCOL_VERSION};
use crate::cni::plugin::{AgentConnection, AgentEndpoint};
use crate::cni::{CniError, CniRequest, CniResult, ErrorCode};

/// Extra time the client waits beyond the request timeout, so the agent's
/// own deadline error (102) arrives before the client gives up.
const ANSWER_GRACE: Duration = Duration::from_secs(2);

/// Talks to the agent over its unix socket.
#[derive(Debug, Clone, Copy, Default)]
pub struct SocketAgent;

impl AgentConnection for SocketAgent {
    fn send(
        &self,
        endpoint: &AgentEndpoint,
        request: &CniRequest,
    ) -> Result<Option<CniResult>, CniError> {
        let message = AgentRequest {
            protocol: PROTOCOL_VERSION,
            timeout_ms: u64::try_from(endpoint.timeout.as_millis()).unwrap_or(u64::MAX),
            request: request.clone(),
        };
        let body = serde_json::to_vec(&message).map_err(|e| {
            CniError::new(
                ErrorCode::AgentInternal,
                "cannot encode the request for the agent",
            )
            .with_details(e)
        })?;
        if body.len() > MAX_FRAME_LEN {
            return Err(CniError::new(
                ErrorCode::InvalidNetworkConfig,
                format!(
                    "network {:?} is {} bytes once encoded, more than the {MAX_FRAME_LEN}-byte limit of the agent socket",
                    request.config().name,
                    body.len()
                ),
            ));
        }
        let deadline = Instant::now() + endpoint.timeout + ANSWER_GRACE;

        let mut stream = UnixStream::connect(&endpoint.socket)
            .map_err(|e| connect_error(&endpoint.socket, e))?;
        let exchange = |stream: &mut UnixStream| -> Result<Vec<u8>, FrameError> {
            stream.set_write_timeout(Some(remaining(deadline)?))?;
            let sent = write_frame(stream, &body);
            stream.set_read_timeout(Some(remaining(deadline)?))?;
            // The agent may answer a connection it refuses (another uid)
            // before reading the request, then close it: the write then
            // fails, but the refusal is waiting to be read.
            match (sent, read_frame(stream)) {
                (_, Ok(answer)) => Ok(answer),
                (Err(write_error), Err(_)) => Err(write_error),
                (Ok(()), Err(read_error)) => Err(read_error),
            }
        };
        let answer = exchange(&mut stream).map_err(|e| exchange_error(endpoint, request, e))?;
        let response: AgentResponse = serde_json::from_slice(&answer).map_err(|e| {
            CniError::new(
                ErrorCode::AgentProtocol,
                "the agent's answer is not understood; make sure flatnet-cni and flatnet-agent on this node come from the same release",
            )
            .with_details(e)
        })?;
        response.into_outcome()
    }
}

/// Time left until `deadline`, or a timeout error when none is.
fn remaining(deadline: Instant) -> io::Result<Duration> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(io::Error::from(ErrorKind::TimedOut))
    } else {
        Ok(left)
    }
}

/// A connection failure. A missing socket or a refused connection means the
/// agent is not running (yet): code 11, so the runtime retries.
fn connect_error(socket: &Path, error: io::Error) -> CniError {
    let socket = socket.display();
    match error.kind() {
        ErrorKind::NotFound | ErrorKind::ConnectionRefused => CniError::new(
            ErrorCode::TryAgainLater,
            format!(
                "flatnet-agent is not reachable at {socket}; check that the flatnet-agent DaemonSet pod on this node is running and ready"
            ),
        ),
        ErrorKind::PermissionDenied => CniError::new(
            ErrorCode::Io,
            format!("permission denied on the agent socket {socket}; flatnet-cni must run as root, like the container runtime"),
        ),
        _ => CniError::new(ErrorCode::Io, format!("cannot connect to the agent socket {socket}")),
    }
    .with_details(error)
}

/// A failure after connecting.
fn exchange_error(endpoint: &AgentEndpoint, request: &CniRequest, error: FrameError) -> CniError {
    let what = request.describe();
    match &error {
        FrameError::Io(io) if matches!(io.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => CniError::new(
            ErrorCode::AgentTimeout,
            format!(
                "flatnet-agent did not answer {what} within {}s; see the flatnet-agent log on this node (raise agentTimeoutSeconds if the node is slow)",
                endpoint.timeout.as_secs()
            ),
        ),
        // The agent went away mid-request, e.g. during a rollout: retry.
        FrameError::Closed | FrameError::Io(_) => CniError::new(
            ErrorCode::TryAgainLater,
            format!(
                "flatnet-agent closed the connection during {what}; check that the flatnet-agent DaemonSet pod on this node is running and ready"
            ),
        ),
        FrameError::TooLarge { .. } => CniError::new(
            ErrorCode::AgentProtocol,
            format!("the agent's answer to {what} is not understood"),
        ),
    }
    .with_details(error)
}
