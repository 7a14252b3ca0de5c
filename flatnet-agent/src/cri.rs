//! Finding the network namespace of a pod this agent did not attach,
//! through the container runtime's CRI API (containerd, CRI-O) on its unix
//! socket, as the kubelet does: the pod's ready sandbox by its Kubernetes
//! labels, then the sandbox's verbose status, whose `info` names the
//! namespace (`runtimeSpec.linux.namespaces`, else the sandbox's `pid`).
//!
//! Everything the runtime answers is checked before use: the sandbox must
//! be the pod's (name, namespace and, when known, UID), must not share the
//! node's namespace, and the path must be absolute without `..`.

use std::{
    collections::HashMap,
    path::{Component, Path, PathBuf},
    time::Duration,
};

use hyper_util::rt::TokioIo;
use k8s_cri::v1::{
    ListPodSandboxRequest, NamespaceMode, PodSandboxFilter, PodSandboxState, PodSandboxStateValue,
    PodSandboxStatusRequest, runtime_service_client::RuntimeServiceClient,
};
use tonic::transport::{Channel, Endpoint, Uri};

use crate::desired::PodRef;

/// The socket of containerd, the most common runtime; CRI-O's is
/// `/run/crio/crio.sock`.
pub const DEFAULT_CRI_SOCKET: &str = "/run/containerd/containerd.sock";

/// How long one CRI call may take: the hot-plug pass waits for it.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// The labels the kubelet puts on every pod sandbox.
const LABEL_POD_NAME: &str = "io.kubernetes.pod.name";
const LABEL_POD_NAMESPACE: &str = "io.kubernetes.pod.namespace";
const LABEL_POD_UID: &str = "io.kubernetes.pod.uid";

/// Why a pod's network namespace was not found.
#[derive(Debug, thiserror::Error)]
pub enum CriError {
    /// The pod has no name or namespace to look it up by.
    #[error("{0} has no name and namespace to find its sandbox by")]
    Unnamed(PodRef),
    /// The runtime did not answer.
    #[error(
        "the container runtime at {socket} did not answer {call}: {status} (set the agent's --cri-socket to the runtime's socket)"
    )]
    Call {
        /// The socket asked.
        socket: PathBuf,
        /// The CRI call.
        call: &'static str,
        /// What the runtime or the transport said.
        status: Box<tonic::Status>,
    },
    /// No ready sandbox of the pod on this node.
    #[error("the container runtime at {socket} has no ready sandbox of {pod}")]
    NoSandbox {
        /// The socket asked.
        socket: PathBuf,
        /// The pod.
        pod: PodRef,
    },
    /// The pod uses the node's network namespace.
    #[error(
        "{0} uses the node's network namespace (hostNetwork): no interface is hot-plugged into it"
    )]
    HostNetwork(PodRef),
    /// The sandbox status names no usable namespace.
    #[error(
        "the container runtime's status of {pod}'s sandbox {sandbox} names no network namespace: {why}"
    )]
    NoNamespace {
        /// The pod.
        pod: PodRef,
        /// Its sandbox.
        sandbox: String,
        /// What was wrong with the status.
        why: String,
    },
}

/// The container runtime's pod sandboxes, through its CRI socket. The
/// connection is made at the first call and again after a failure.
#[derive(Clone, Debug)]
pub struct PodSandboxes {
    socket: PathBuf,
    client: RuntimeServiceClient<Channel>,
}

impl PodSandboxes {
    /// The runtime at `socket`; nothing is connected yet.
    #[must_use]
    pub fn new(socket: &Path) -> Self {
        let path = socket.to_owned();
        // The URI is required by the transport and never used: the
        // connector dials the socket.
        let channel = Endpoint::from_static("http://cri.invalid")
            .timeout(CALL_TIMEOUT)
            .connect_timeout(CALL_TIMEOUT)
            .connect_with_connector_lazy(tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(TokioIo::new(stream))
                }
            }));
        Self {
            socket: socket.to_owned(),
            client: RuntimeServiceClient::new(channel),
        }
    }

    /// The socket asked.
    #[must_use]
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The network namespace of `pod`'s ready sandbox (the newest, should
    /// the runtime list several).
    pub async fn network_namespace(&self, pod: &PodRef) -> Result<PathBuf, CriError> {
        let (Some(namespace), Some(name)) = (&pod.namespace, &pod.name) else {
            return Err(CriError::Unnamed(pod.clone()));
        };
        let mut labels = HashMap::from([
            (LABEL_POD_NAMESPACE.to_owned(), namespace.clone()),
            (LABEL_POD_NAME.to_owned(), name.clone()),
        ]);
        if let Some(uid) = &pod.uid {
            labels.insert(LABEL_POD_UID.to_owned(), uid.clone());
        }
        let mut client = self.client.clone();
        let listed = client
            .list_pod_sandbox(ListPodSandboxRequest {
                filter: Some(PodSandboxFilter {
                    id: String::new(),
                    state: Some(PodSandboxStateValue {
                        state: PodSandboxState::SandboxReady.into(),
                    }),
                    label_selector: labels,
                }),
            })
            .await
            .map_err(|status| self.call_error("ListPodSandbox", status))?
            .into_inner();
        // The filter is the runtime's to apply: checked again here.
        let sandbox = listed
            .items
            .into_iter()
            .filter(|s| {
                s.state == i32::from(PodSandboxState::SandboxReady)
                    && s.metadata.as_ref().is_some_and(|m| {
                        &m.namespace == namespace
                            && &m.name == name
                            && pod.uid.as_ref().is_none_or(|uid| &m.uid == uid)
                    })
            })
            .max_by_key(|s| (s.metadata.as_ref().map(|m| m.attempt), s.created_at))
            .ok_or_else(|| CriError::NoSandbox {
                socket: self.socket.clone(),
                pod: pod.clone(),
            })?;
        let status = client
            .pod_sandbox_status(PodSandboxStatusRequest {
                pod_sandbox_id: sandbox.id.clone(),
                verbose: true,
            })
            .await
            .map_err(|status| self.call_error("PodSandboxStatus", status))?
            .into_inner();
        let host_network = status
            .status
            .as_ref()
            .and_then(|s| s.linux.as_ref())
            .and_then(|l| l.namespaces.as_ref())
            .and_then(|n| n.options.as_ref())
            .is_some_and(|o| o.network == i32::from(NamespaceMode::Node));
        if host_network {
            return Err(CriError::HostNetwork(pod.clone()));
        }
        netns_from_info(&status.info).map_err(|why| CriError::NoNamespace {
            pod: pod.clone(),
            sandbox: sandbox.id,
            why,
        })
    }

    fn call_error(&self, call: &'static str, status: tonic::Status) -> CriError {
        CriError::Call {
            socket: self.socket.clone(),
            call,
            status: Box::new(status),
        }
    }
}

/// The network namespace a sandbox's verbose status `info` names: the
/// `network` entry of `runtimeSpec.linux.namespaces` (containerd, CRI-O),
/// else `/proc/<pid>/ns/net` of the sandbox's `pid`.
pub fn netns_from_info(info: &HashMap<String, String>) -> Result<PathBuf, String> {
    let text = info
        .get("info")
        .ok_or("the verbose status has no \"info\" entry")?;
    let info: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("its \"info\" is not JSON: {e}"))?;
    let from_spec = info
        .pointer("/runtimeSpec/linux/namespaces")
        .and_then(serde_json::Value::as_array)
        .into_iter()
        .flatten()
        .find(|ns| ns["type"] == "network")
        .and_then(|ns| ns["path"].as_str())
        .filter(|path| !path.is_empty());
    if let Some(path) = from_spec {
        let path = Path::new(path);
        let plain = path.is_absolute()
            && path
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
        return if plain {
            Ok(path.to_owned())
        } else {
            Err(format!(
                "the network namespace path {} is not a plain absolute path",
                path.display()
            ))
        };
    }
    match info.get("pid").and_then(serde_json::Value::as_u64) {
        Some(pid) if pid > 0 && u32::try_from(pid).is_ok() => {
            Ok(PathBuf::from(format!("/proc/{pid}/ns/net")))
        }
        Some(pid) => Err(format!("the sandbox's pid {pid} is not a process")),
        None => Err("neither a network namespace path nor the sandbox's pid".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(json: &str) -> HashMap<String, String> {
        HashMap::from([("info".to_owned(), json.to_owned())])
    }

    #[test]
    fn the_runtime_spec_names_the_namespace() {
        // As containerd answers (abridged); CRI-O's `runtimeSpec` is alike.
        let containerd = info(
            r#"{"pid": 4242, "runtimeSpec": {"linux": {"namespaces": [
                {"type": "pid"}, {"type": "ipc"},
                {"type": "network", "path": "/var/run/netns/cni-5d1e1f7a-0b0e-4f3c"}]}}}"#,
        );
        assert_eq!(
            netns_from_info(&containerd).unwrap(),
            Path::new("/var/run/netns/cni-5d1e1f7a-0b0e-4f3c")
        );
    }

    #[test]
    fn without_a_path_the_sandbox_pid_names_it() {
        let pid_only = info(
            r#"{"pid": 4242, "runtimeSpec": {"linux": {"namespaces": [{"type": "network"}]}}}"#,
        );
        assert_eq!(
            netns_from_info(&pid_only).unwrap(),
            Path::new("/proc/4242/ns/net")
        );
    }

    #[test]
    fn hostile_or_empty_answers_are_errors_that_say_why() {
        for (answer, why) in [
            (HashMap::new(), "no \"info\""),
            (info("not json"), "not JSON"),
            (info("{}"), "neither"),
            (info(r#"{"pid": 0}"#), "not a process"),
            (info(r#"{"pid": 99999999999}"#), "not a process"),
            (
                info(
                    r#"{"runtimeSpec": {"linux": {"namespaces": [{"type": "network", "path": "netns/x"}]}}}"#,
                ),
                "not a plain absolute path",
            ),
            (
                info(
                    r#"{"runtimeSpec": {"linux": {"namespaces": [{"type": "network", "path": "/var/run/netns/../../etc"}]}}}"#,
                ),
                "not a plain absolute path",
            ),
        ] {
            let error = netns_from_info(&answer).unwrap_err();
            assert!(error.contains(why), "{error} should say {why}");
        }
    }
}
