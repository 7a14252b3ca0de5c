//! A container runtime's CRI API on a unix socket, for tests: pod sandboxes
//! listed and reported as containerd does (the filter applied, the
//! verbose `info` naming the network namespace); every other call is
//! refused as unimplemented.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use k8s_cri::v1::{
    runtime_service_server::{RuntimeService, RuntimeServiceServer},
    *,
};
use tonic::{Request, Response, Status};

/// One pod sandbox the fake runtime knows.
#[derive(Clone, Debug)]
pub struct Sandbox {
    pub id: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub attempt: u32,
    pub ready: bool,
    /// The node's namespace (hostNetwork) instead of its own.
    pub host_network: bool,
    /// The network namespace its verbose status names.
    pub netns: PathBuf,
}

impl Sandbox {
    /// A ready sandbox of `namespace/name` in `netns`.
    pub fn ready(namespace: &str, name: &str, netns: &Path) -> Self {
        Self {
            id: format!("sandbox-{namespace}-{name}"),
            namespace: namespace.into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            attempt: 0,
            ready: true,
            host_network: false,
            netns: netns.to_owned(),
        }
    }

    fn state(&self) -> i32 {
        if self.ready {
            PodSandboxState::SandboxReady.into()
        } else {
            PodSandboxState::SandboxNotready.into()
        }
    }

    fn labels(&self) -> HashMap<String, String> {
        HashMap::from([
            ("io.kubernetes.pod.namespace".into(), self.namespace.clone()),
            ("io.kubernetes.pod.name".into(), self.name.clone()),
            ("io.kubernetes.pod.uid".into(), self.uid.clone()),
        ])
    }

    fn metadata(&self) -> PodSandboxMetadata {
        PodSandboxMetadata {
            name: self.name.clone(),
            uid: self.uid.clone(),
            namespace: self.namespace.clone(),
            attempt: self.attempt,
        }
    }
}

/// The fake runtime's state, shared with the test.
#[derive(Clone, Debug, Default)]
pub struct FakeCri {
    pub sandboxes: Arc<Mutex<Vec<Sandbox>>>,
    /// Lists every sandbox whatever the filter (a runtime the agent must
    /// not trust to filter).
    pub ignore_filters: bool,
}

impl FakeCri {
    /// Serves the runtime on a new socket at `socket` (on the current
    /// tokio runtime) until the runtime ends.
    pub fn serve(&self, socket: &Path) {
        let listener = tokio::net::UnixListener::bind(socket).unwrap();
        let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
        let service = RuntimeServiceServer::new(self.clone());
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await
                .unwrap();
        });
    }

    pub fn add(&self, sandbox: Sandbox) {
        self.sandboxes.lock().unwrap().push(sandbox);
    }

    fn matches(&self, sandbox: &Sandbox, filter: Option<&PodSandboxFilter>) -> bool {
        let Some(filter) = filter.filter(|_| !self.ignore_filters) else {
            return true;
        };
        let labels = sandbox.labels();
        (filter.id.is_empty() || filter.id == sandbox.id)
            && filter
                .state
                .as_ref()
                .is_none_or(|s| s.state == sandbox.state())
            && filter
                .label_selector
                .iter()
                .all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// Every call but the two the agent makes answers "unimplemented". Spelled
/// as `async_trait` expands an `async fn`, which it cannot see inside a
/// macro.
macro_rules! refused {
    ($($method:ident: $request:ty => $response:ty),* $(,)?) => {
        $(
            fn $method<'life0, 'async_trait>(
                &'life0 self,
                _: Request<$request>,
            ) -> std::pin::Pin<
                Box<dyn Future<Output = Result<Response<$response>, Status>> + Send + 'async_trait>,
            >
            where
                'life0: 'async_trait,
                Self: 'async_trait,
            {
                Box::pin(async { Err(Status::unimplemented(stringify!($method))) })
            }
        )*
    };
}

#[tonic::async_trait]
impl RuntimeService for FakeCri {
    type GetContainerEventsStream = futures::stream::Empty<Result<ContainerEventResponse, Status>>;

    async fn list_pod_sandbox(
        &self,
        request: Request<ListPodSandboxRequest>,
    ) -> Result<Response<ListPodSandboxResponse>, Status> {
        let filter = request.into_inner().filter;
        let items = self
            .sandboxes
            .lock()
            .unwrap()
            .iter()
            .filter(|s| self.matches(s, filter.as_ref()))
            .map(|s| PodSandbox {
                id: s.id.clone(),
                metadata: Some(s.metadata()),
                state: s.state(),
                created_at: i64::from(s.attempt),
                labels: s.labels(),
                ..PodSandbox::default()
            })
            .collect();
        Ok(Response::new(ListPodSandboxResponse { items }))
    }

    async fn pod_sandbox_status(
        &self,
        request: Request<PodSandboxStatusRequest>,
    ) -> Result<Response<PodSandboxStatusResponse>, Status> {
        let request = request.into_inner();
        let sandboxes = self.sandboxes.lock().unwrap();
        let sandbox = sandboxes
            .iter()
            .find(|s| s.id == request.pod_sandbox_id)
            .ok_or_else(|| Status::not_found(request.pod_sandbox_id.clone()))?;
        let network = if sandbox.host_network {
            NamespaceMode::Node
        } else {
            NamespaceMode::Pod
        };
        // As containerd: the runtime spec only in the verbose answer.
        let info = if request.verbose {
            let spec = serde_json::json!({
                "pid": 4242,
                "runtimeSpec": {"linux": {"namespaces": [
                    {"type": "pid"},
                    {"type": "network", "path": sandbox.netns},
                ]}},
            });
            HashMap::from([("info".to_owned(), spec.to_string())])
        } else {
            HashMap::new()
        };
        Ok(Response::new(PodSandboxStatusResponse {
            status: Some(PodSandboxStatus {
                id: sandbox.id.clone(),
                metadata: Some(sandbox.metadata()),
                state: sandbox.state(),
                linux: Some(LinuxPodSandboxStatus {
                    namespaces: Some(Namespace {
                        options: Some(NamespaceOption {
                            network: network.into(),
                            ..NamespaceOption::default()
                        }),
                    }),
                }),
                ..PodSandboxStatus::default()
            }),
            info,
            ..PodSandboxStatusResponse::default()
        }))
    }

    refused! {
        version: VersionRequest => VersionResponse,
        run_pod_sandbox: RunPodSandboxRequest => RunPodSandboxResponse,
        stop_pod_sandbox: StopPodSandboxRequest => StopPodSandboxResponse,
        remove_pod_sandbox: RemovePodSandboxRequest => RemovePodSandboxResponse,
        create_container: CreateContainerRequest => CreateContainerResponse,
        start_container: StartContainerRequest => StartContainerResponse,
        stop_container: StopContainerRequest => StopContainerResponse,
        remove_container: RemoveContainerRequest => RemoveContainerResponse,
        list_containers: ListContainersRequest => ListContainersResponse,
        container_status: ContainerStatusRequest => ContainerStatusResponse,
        update_container_resources: UpdateContainerResourcesRequest => UpdateContainerResourcesResponse,
        reopen_container_log: ReopenContainerLogRequest => ReopenContainerLogResponse,
        exec_sync: ExecSyncRequest => ExecSyncResponse,
        exec: ExecRequest => ExecResponse,
        attach: AttachRequest => AttachResponse,
        port_forward: PortForwardRequest => PortForwardResponse,
        container_stats: ContainerStatsRequest => ContainerStatsResponse,
        list_container_stats: ListContainerStatsRequest => ListContainerStatsResponse,
        pod_sandbox_stats: PodSandboxStatsRequest => PodSandboxStatsResponse,
        list_pod_sandbox_stats: ListPodSandboxStatsRequest => ListPodSandboxStatsResponse,
        update_runtime_config: UpdateRuntimeConfigRequest => UpdateRuntimeConfigResponse,
        status: StatusRequest => StatusResponse,
        checkpoint_container: CheckpointContainerRequest => CheckpointContainerResponse,
        get_container_events: GetEventsRequest => Self::GetContainerEventsStream,
        list_metric_descriptors: ListMetricDescriptorsRequest => ListMetricDescriptorsResponse,
        list_pod_sandbox_metrics: ListPodSandboxMetricsRequest => ListPodSandboxMetricsResponse,
        runtime_config: RuntimeConfigRequest => RuntimeConfigResponse,
    }
}
