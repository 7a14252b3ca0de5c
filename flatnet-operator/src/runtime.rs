//! Wiring of the operator process: client, admin server, election, controllers.

use std::sync::Arc;

use tokio::{net::TcpListener, sync::Notify, task::JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::{
    admin::{self, AdminState, Health},
    allocation, cluster_config, cluster_health,
    config::{Config, Election},
    flat_services, floating,
    leader::{self, Outcome},
    metrics::Metrics,
    nad, runtime_config,
    tls::{self, resolver::ReloadingResolver},
    webhook, workloads,
};

/// Failure to start the operator.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No usable kubeconfig or in-cluster environment.
    #[error(
        "cannot configure the Kubernetes client ({0}); set KUBECONFIG or --kubeconfig, or run in a pod"
    )]
    Kubeconfig(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// `--master` is not a URL.
    #[error("--master {0:?} is not a URL such as https://10.0.0.1:6443")]
    Master(String),
    /// The client could not be built.
    #[error("cannot build the Kubernetes client: {0}")]
    Client(#[source] kube::Error),
    /// The admin address is taken or not allowed.
    #[error("cannot listen on {addr} for /healthz and /metrics (--admin-address): {source}")]
    Listen {
        /// Address.
        addr: std::net::SocketAddr,
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The webhook address is taken or not allowed.
    #[error(
        "cannot listen on {addr} for the admission webhook (--bind-address, --port): {source}; choose a free port, or allow binding below 1024 (NET_BIND_SERVICE)"
    )]
    WebhookListen {
        /// Address.
        addr: std::net::SocketAddr,
        /// I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The Lease could not be set up (logged, then retried).
    #[error(
        "cannot use Lease {namespace}/{name} for leader election ({source}); check the namespace exists and the operator may get, create and patch leases there"
    )]
    Lease {
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        name: String,
        /// Error.
        #[source]
        source: kube_lease_manager::LeaseManagerError,
    },
}

/// Builds the client from `--kubeconfig`/`KUBECONFIG`, else in-cluster or
/// `~/.kube/config`, with `--master` applied.
///
/// # Errors
/// [`StartError`] naming what is missing.
pub async fn client(config: &Config) -> Result<kube::Client, StartError> {
    let mut kube_config = match &config.kubeconfig {
        Some(path) => {
            let kubeconfig = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| StartError::Kubeconfig(Box::new(e)))?;
            kube::Config::from_custom_kubeconfig(
                kubeconfig,
                &kube::config::KubeConfigOptions::default(),
            )
            .await
            .map_err(|e| StartError::Kubeconfig(Box::new(e)))?
        }
        // In cluster, else ~/.kube/config.
        None => kube::Config::infer()
            .await
            .map_err(|e| StartError::Kubeconfig(Box::new(e)))?,
    };
    if let Some(master) = &config.master {
        kube_config.cluster_url = master
            .parse()
            .map_err(|_| StartError::Master(master.clone()))?;
    }
    kube::Client::try_from(kube_config).map_err(StartError::Client)
}

/// Runs the operator until a signal or the loss of the lease.
///
/// # Errors
/// [`StartError`] when the process cannot start.
pub async fn run(config: Config) -> Result<Outcome, StartError> {
    let client = client(&config).await?;
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));

    let listener = TcpListener::bind(config.admin_address)
        .await
        .map_err(|source| StartError::Listen {
            addr: config.admin_address,
            source,
        })?;
    let admin_state = AdminState {
        health: Arc::clone(&health),
        metrics: Arc::clone(&metrics),
    };
    let admin_shutdown = shutdown.clone();
    tokio::spawn(async move {
        if let Err(error) =
            admin::serve(listener, admin_state, admin_shutdown.cancelled_owned()).await
        {
            warn!(%error, "admin server stopped");
        }
    });
    info!(address = %config.admin_address, "serving /healthz, /readyz and /metrics");

    // Every replica serves the webhook and follows the certificate Secret;
    // the leader alone keeps the certificates and the registration up to date.
    let cert_changed = Arc::new(Notify::new());
    let mut webhook_probe = cluster_health::WebhookProbe::Disabled;
    if config.webhook.enabled {
        let resolver = Arc::new(ReloadingResolver::default());
        webhook_probe = cluster_health::WebhookProbe::Enabled {
            resolver: Arc::clone(&resolver),
            // A registered URL bypasses the Service.
            service: config
                .webhook
                .url
                .is_none()
                .then(|| config.webhook.service.clone()),
            configuration: config.webhook.configuration.clone(),
        };
        let listener = TcpListener::bind(config.webhook.listen)
            .await
            .map_err(|source| StartError::WebhookListen {
                addr: config.webhook.listen,
                source,
            })?;
        let validator = Arc::new(webhook::Validator::new(
            client.clone(),
            Arc::clone(&metrics),
        ));
        tokio::spawn(webhook::server::serve(
            listener,
            tls::resolver::server_config(Arc::clone(&resolver)),
            webhook::router(validator),
            shutdown.clone(),
        ));
        tokio::spawn(tls::follow(
            client.clone(),
            config.webhook.clone(),
            resolver,
            Arc::clone(&metrics),
            Arc::clone(&cert_changed),
            shutdown.clone(),
        ));
        info!(address = %config.webhook.listen, "serving the admission webhook");
    }
    let upkeep = config.webhook.enabled.then(|| {
        let settings = config.webhook.clone();
        let hosts = tls::cert::hosts(
            &settings.service,
            &settings.namespace,
            settings.url.as_ref().map(|u| u.host.as_str()),
        );
        (client.clone(), settings, hosts, cert_changed)
    });
    let nad_ctx = Arc::new(nad::Context {
        client: client.clone(),
        metrics: Arc::clone(&metrics),
        name: config.network_attachment.clone(),
        config: nad::cni_config(
            &config.network_attachment,
            &config.cni,
            &config.cluster_cidrs,
            &config.service_cidrs,
        )
        .into(),
        resync: config.resync,
        owner: config
            .webhook
            .enabled
            .then(|| config.webhook.configuration.clone()),
    });

    let ctx = Arc::new(flat_services::Context {
        client: client.clone(),
        metrics: Arc::clone(&metrics),
        attachment: config.network_attachment.clone(),
        resync: config.resync,
    });
    let mac_pool = allocation::mac_pool::MacPoolView::default();
    let controllers = {
        let health = Arc::clone(&health);
        let client = client.clone();
        let metrics = Arc::clone(&metrics);
        let settings = config.allocation.clone();
        let floating_settings = config.floating.clone();
        let resync = config.resync;
        let applied = cluster_config::Applied {
            mac_pool: mac_pool.clone(),
            cni: nad_ctx.config.clone(),
            env: config.cni.clone(),
            attachment: config.network_attachment.clone(),
            cluster_cidrs: config.cluster_cidrs.clone(),
            service_cidrs: config.service_cidrs.clone(),
            wire_window: config.allocation.wire_window,
        };
        let health_settings = config.cluster_health.clone();
        move |stop: CancellationToken| {
            let workload_client = client.clone();
            let conditions = cancel_when_done(
                cluster_health::run(
                    client.clone(),
                    health_settings,
                    Arc::clone(&health),
                    webhook_probe,
                    stop.clone(),
                ),
                stop.clone(),
            );
            let cluster_config = cancel_when_done(
                cluster_config::run(client.clone(), applied.clone(), stop.clone()),
                stop.clone(),
            );
            let mtu_client = client.clone();
            let pnc_client = client.clone();
            let workload_metrics = Arc::clone(&metrics);
            // Until all caches sync, a new leader is not ready.
            health.set_ready(false);
            let workers = config.workers;
            let service_health = Arc::new(Health::default());
            let allocation_health = Arc::new(Health::default());
            let ready = {
                let (a, b) = (Arc::clone(&service_health), Arc::clone(&allocation_health));
                let health = Arc::clone(&health);
                async move {
                    while !(a.is_ready() && b.is_ready()) {
                        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                    }
                    health.set_ready(true);
                }
            };
            // When one controller ends, the others are stopped too: one
            // ending on its own ends the leadership term (the process restarts).
            let services = cancel_when_done(
                flat_services::run(ctx, workers, service_health, stop.clone()),
                stop.clone(),
            );
            let allocation = cancel_when_done(
                allocation::run(
                    client,
                    metrics,
                    settings,
                    workers,
                    mac_pool.clone(),
                    allocation_health,
                    stop.clone(),
                ),
                stop.clone(),
            );
            let floating = cancel_when_done(
                floating::run(
                    workload_client.clone(),
                    Arc::clone(&workload_metrics),
                    floating_settings,
                    workers,
                    stop.clone(),
                ),
                stop.clone(),
            );
            let nads = cancel_when_done(nad::run(nad_ctx, workers, stop.clone()), stop.clone());
            let mtu_status = cancel_when_done(
                runtime_config::mtu_status::run(
                    mtu_client,
                    runtime_config::mtu_status::DEFAULT_INTERVAL,
                    stop.clone(),
                ),
                stop.clone(),
            );
            let pod_network_configs = cancel_when_done(
                runtime_config::controller::run(
                    pnc_client,
                    runtime_config::controller::Settings::default(),
                    stop.clone(),
                ),
                stop.clone(),
            );
            let workloads = cancel_when_done(
                workloads::run(
                    workload_client,
                    workload_metrics,
                    resync,
                    workers,
                    stop.clone(),
                ),
                stop.clone(),
            );
            let certificates = cancel_when_done(
                {
                    let stop = stop.clone();
                    async move {
                        match upkeep {
                            Some((client, settings, hosts, changed)) => {
                                tls::manage(client, settings, hosts, changed, stop).await;
                            }
                            None => stop.cancelled().await,
                        }
                    }
                },
                stop.clone(),
            );
            async move {
                // Each controller is its own task: they run in parallel on the
                // runtime's workers, and dropping the set (the process or the
                // test that runs it ending) aborts every one of them.
                let mut readiness = JoinSet::new();
                readiness.spawn(ready);
                let mut tasks = JoinSet::new();
                tasks.spawn(services);
                tasks.spawn(allocation);
                tasks.spawn(floating);
                tasks.spawn(nads);
                tasks.spawn(workloads);
                tasks.spawn(certificates);
                tasks.spawn(mtu_status);
                tasks.spawn(cluster_config);
                tasks.spawn(conditions);
                tasks.spawn(pod_network_configs);
                while let Some(ended) = tasks.join_next().await {
                    if let Err(error) = ended {
                        // A panicked controller ends the term like one that returned.
                        error!(%error, "a controller task failed, stopping the others");
                        stop.cancel();
                    }
                }
            }
        }
    };

    match &config.election {
        Election::Disabled => {
            warn!("--leader-election=false: this process always leads, run a single replica");
            metrics.set_leader(true);
            controllers(shutdown.child_token()).await;
            Ok(if shutdown.is_cancelled() {
                Outcome::Shutdown
            } else {
                Outcome::ControllersEnded
            })
        }
        Election::Lease {
            name,
            namespace,
            identity,
            timing,
        } => {
            // A replica that does not lead is ready as soon as it serves.
            health.set_ready(true);
            // As client-go's elector: a Lease that cannot be read or created
            // yet (API server starting, RBAC not applied) is retried every
            // CATTLE_ELECTION_RETRY_PERIOD instead of ending the process.
            let started = leader::retry_every(timing.retry_period, &shutdown, || async {
                leader::campaign(client.clone(), name, namespace, identity, timing)
                    .await
                    .map_err(|source| StartError::Lease {
                        namespace: namespace.clone(),
                        name: name.clone(),
                        source,
                    })
            })
            .await;
            let Some((claims, task)) = started else {
                return Ok(Outcome::Shutdown);
            };
            info!(lease = %format!("{namespace}/{name}"), %identity, "campaigning for leadership");
            let outcome = leader::run_while_leader(
                claims,
                shutdown,
                |lead| metrics.set_leader(lead),
                controllers,
            )
            .await;
            if outcome == Outcome::Shutdown {
                // The receiver is gone: the election task releases the lease
                // so another replica takes over without waiting for expiry.
                match task.await {
                    Ok(Ok(())) => info!("leader lease released"),
                    Ok(Err(error)) => warn!(%error, "could not release the leader lease"),
                    Err(error) => warn!(%error, "leader election task failed"),
                }
            }
            Ok(outcome)
        }
    }
}

/// Runs `task`, then cancels `stop` so the tasks sharing it end as well.
async fn cancel_when_done(task: impl std::future::Future<Output = ()>, stop: CancellationToken) {
    task.await;
    stop.cancel();
}

/// Cancels `token` on the first SIGTERM or SIGINT.
async fn cancel_on_signal(token: CancellationToken) {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(error) => {
            warn!(%error, "cannot listen for SIGTERM; only SIGINT stops the operator");
            let _ = tokio::signal::ctrl_c().await;
            token.cancel();
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM received, shutting down"),
        _ = tokio::signal::ctrl_c() => info!("SIGINT received, shutting down"),
    }
    token.cancel();
}
