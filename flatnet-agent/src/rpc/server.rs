//! The agent side of the socket: a tokio server that owns the socket file,
//! serves one request per connection through a [`CniHandler`], enforces
//! deadlines and shuts down gracefully.

use std::future::Future;
use std::io::{self, ErrorKind};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;

use super::frame::{read_frame_async, write_frame_async};
use super::handler::CniHandler;
use super::protocol::{AgentRequest, AgentResponse};
use crate::cni::plugin::DEFAULT_AGENT_SOCKET;
use crate::cni::{Admission, CniError, CniRequest, ErrorCode};

/// Mode of the socket file: only root (the runtime's user) may connect.
pub const SOCKET_MODE: u32 = 0o600;
/// Mode of directories the server creates for the socket.
pub const SOCKET_DIR_MODE: u32 = 0o700;

/// Server settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Socket path.
    pub socket_path: PathBuf,
    /// Upper bound on one request, whatever the client asks for.
    pub max_request_time: Duration,
    /// How long a client may take to send its request.
    pub read_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            socket_path: PathBuf::from(DEFAULT_AGENT_SOCKET),
            max_request_time: Duration::from_secs(120),
            read_timeout: Duration::from_secs(10),
        }
    }
}

/// Setting up the socket failed.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket's directory could not be created.
    #[error("cannot create the agent socket directory {path}: {source}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// Something that is not a socket exists at the socket path.
    #[error("{path} exists and is not a socket; remove it or set another agent socket path")]
    NotASocket {
        /// The path.
        path: PathBuf,
    },
    /// Another process already serves the socket.
    #[error(
        "another flatnet-agent already serves {path}; stop it first (only one agent may run per node)"
    )]
    AlreadyServing {
        /// The path.
        path: PathBuf,
    },
    /// A stale socket could not be removed.
    #[error("cannot remove the stale agent socket {path}: {source}")]
    RemoveStale {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
    /// Binding or restricting the socket failed.
    #[error("cannot listen on the agent socket {path}: {source}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: io::Error,
    },
}

/// The CNI service of the agent.
pub struct AgentServer<H> {
    listener: UnixListener,
    config: ServerConfig,
    handler: Arc<H>,
}

impl<H: CniHandler> AgentServer<H> {
    /// Creates the socket: missing directories are created with mode 0700, a
    /// stale socket left by a crashed agent is removed, and the new socket
    /// gets mode 0600. Must be called inside a tokio runtime.
    ///
    /// The socket exists for a moment with the umask's mode before the chmod;
    /// the 0700 directory is what keeps other users out in that window.
    pub fn bind(config: ServerConfig, handler: H) -> Result<Self, ServerError> {
        let path = &config.socket_path;
        if let Some(dir) = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty() && !d.exists())
        {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(SOCKET_DIR_MODE)
                .create(dir)
                .map_err(|source| ServerError::CreateDir {
                    path: dir.to_owned(),
                    source,
                })?;
        }
        remove_stale_socket(path)?;
        let bind_error = |source| ServerError::Bind {
            path: path.clone(),
            source,
        };
        let listener = UnixListener::bind(path).map_err(bind_error)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(SOCKET_MODE))
            .map_err(bind_error)?;
        tracing::info!(socket = %path.display(), "CNI service listening");
        Ok(AgentServer {
            listener,
            config,
            handler: Arc::new(handler),
        })
    }

    /// The socket path.
    pub fn socket_path(&self) -> &Path {
        &self.config.socket_path
    }

    /// Serves until `shutdown` completes, then stops accepting, removes the
    /// socket file and waits for the requests in flight (each is bounded by
    /// its deadline).
    pub async fn serve(self, shutdown: impl Future<Output = ()>) {
        let AgentServer {
            listener,
            config,
            handler,
        } = self;
        let config = Arc::new(config);
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        connections.spawn(serve_connection(stream, Arc::clone(&handler), Arc::clone(&config)));
                    }
                    Err(error) => {
                        // Usually EMFILE; pausing avoids a hot loop until descriptors free up.
                        tracing::warn!(%error, "accepting a CNI connection failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                Some(finished) = connections.join_next(), if !connections.is_empty() => log_join(finished),
            }
        }
        drop(listener);
        if let Err(error) = std::fs::remove_file(&config.socket_path)
            && error.kind() != ErrorKind::NotFound
        {
            tracing::warn!(%error, socket = %config.socket_path.display(), "cannot remove the agent socket");
        }
        tracing::info!(in_flight = connections.len(), "CNI service stopping");
        while let Some(finished) = connections.join_next().await {
            log_join(finished);
        }
    }
}

fn log_join(finished: Result<(), tokio::task::JoinError>) {
    if let Err(error) = finished {
        tracing::error!(%error, "a CNI connection task failed");
    }
}

/// Removes a socket left by a previous agent, refusing to touch a live
/// socket or a file that is not a socket.
fn remove_stale_socket(path: &Path) -> Result<(), ServerError> {
    let metadata = match std::fs::symlink_metadata(path) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(ServerError::RemoveStale {
                path: path.to_owned(),
                source,
            });
        }
    };
    if !metadata.file_type().is_socket() {
        return Err(ServerError::NotASocket {
            path: path.to_owned(),
        });
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(ServerError::AlreadyServing {
            path: path.to_owned(),
        });
    }
    tracing::info!(socket = %path.display(), "removing the stale agent socket");
    std::fs::remove_file(path).map_err(|source| ServerError::RemoveStale {
        path: path.to_owned(),
        source,
    })
}

/// One connection: check the peer, read the request, run it, answer.
async fn serve_connection<H: CniHandler>(
    mut stream: UnixStream,
    handler: Arc<H>,
    config: Arc<ServerConfig>,
) {
    let response = match read_request(&mut stream, &config).await {
        Ok(request) => match request.request.admit() {
            Ok(Admission::Serve) => run_request(handler, request, config.max_request_time).await,
            Ok(Admission::NothingToDelete(reason)) => {
                tracing::info!(request = %request.request.describe(), reason = %reason.msg, "DEL of an attachment that cannot exist: nothing to do");
                AgentResponse::Success { result: None }
            }
            Err(error) => {
                tracing::warn!(request = %request.request.describe(), code = error.code.code(), msg = %error.msg, "refused an invalid CNI request");
                AgentResponse::Failure { error }
            }
        },
        Err(None) => return,
        Err(Some(response)) => response,
    };
    let body = match serde_json::to_vec(&response) {
        Ok(body) => body,
        Err(error) => {
            tracing::error!(%error, "cannot encode a CNI response");
            return;
        }
    };
    if let Err(error) = write_frame_async(&mut stream, &body).await {
        // flatnet-cni gave up (its own timeout) or was killed by the runtime.
        tracing::warn!(%error, "cannot send the CNI response");
    }
}

/// Reads and decodes the request. `Err(Some(_))` is an answer to send back,
/// `Err(None)` means the peer is gone and there is no one to answer.
async fn read_request(
    stream: &mut UnixStream,
    config: &ServerConfig,
) -> Result<AgentRequest, Option<AgentResponse>> {
    let own_uid = nix::unistd::geteuid().as_raw();
    match stream.peer_cred() {
        Ok(cred) if cred.uid() == own_uid => {}
        Ok(cred) => {
            tracing::warn!(
                peer_uid = cred.uid(),
                "refused a CNI connection from another user"
            );
            return Err(Some(AgentResponse::Failure {
                error: CniError::new(
                    ErrorCode::Io,
                    format!(
                        "flatnet-agent serves only uid {own_uid}; run flatnet-cni as that user (root)"
                    ),
                ),
            }));
        }
        Err(error) => {
            tracing::warn!(%error, "cannot read the peer credentials of a CNI connection");
            return Err(None);
        }
    }

    let body = match tokio::time::timeout(config.read_timeout, read_frame_async(stream)).await {
        Ok(Ok(body)) => body,
        // A connection closed before sending anything: the heartbeat's
        // check that the socket accepts connections.
        Ok(Err(error @ super::frame::FrameError::Closed)) => {
            tracing::debug!(%error, "a CNI client closed without a request");
            return Err(None);
        }
        Ok(Err(error)) => {
            tracing::warn!(%error, "cannot read a CNI request");
            return Err(None);
        }
        Err(_) => {
            tracing::warn!(timeout = ?config.read_timeout, "a CNI client sent no request in time");
            return Err(None);
        }
    };
    AgentRequest::decode(&body).map_err(|error| Some(AgentResponse::Failure { error }))
}

/// Runs the handler in its own task, so a panic becomes error 100 instead of
/// a silent disconnect, and aborts it at the deadline (error 102).
async fn run_request<H: CniHandler>(
    handler: Arc<H>,
    request: AgentRequest,
    max_time: Duration,
) -> AgentResponse {
    let deadline = Duration::from_millis(request.timeout_ms).min(max_time);
    let what = request.request.describe();
    let started = Instant::now();
    let task = tokio::spawn(dispatch(handler, request.request));
    let abort = task.abort_handle();
    let response = match tokio::time::timeout(deadline, task).await {
        Ok(Ok(response)) => response,
        Ok(Err(error)) => {
            tracing::error!(request = %what, %error, "the CNI handler panicked");
            AgentResponse::Failure {
                error: CniError::new(
                    ErrorCode::AgentInternal,
                    format!(
                        "flatnet-agent failed internally during {what}; see the flatnet-agent log on this node"
                    ),
                ),
            }
        }
        Err(_) => {
            abort.abort();
            AgentResponse::Failure {
                error: CniError::new(
                    ErrorCode::AgentTimeout,
                    format!(
                        "flatnet-agent did not finish {what} within {}s; see the flatnet-agent log on this node",
                        deadline.as_secs_f32()
                    ),
                ),
            }
        }
    };
    match &response {
        AgentResponse::Success { .. } => {
            tracing::info!(request = %what, elapsed = ?started.elapsed(), "CNI request done");
        }
        AgentResponse::Failure { error } => {
            tracing::warn!(request = %what, elapsed = ?started.elapsed(), code = error.code.code(), msg = %error.msg, "CNI request failed");
        }
    }
    response
}

async fn dispatch<H: CniHandler>(handler: Arc<H>, request: CniRequest) -> AgentResponse {
    let outcome = match request {
        CniRequest::Add(request) => handler.add(request).await.map(Some),
        CniRequest::Check(request) => handler.check(request).await.map(|()| None),
        CniRequest::Del(request) => handler.del(request).await.map(|()| None),
        CniRequest::Status(request) => handler.status(request).await.map(|()| None),
        CniRequest::Gc(request) => handler.gc(request).await.map(|()| None),
    };
    AgentResponse::from_outcome(outcome)
}
