//! HTTPS serving of the webhook routes.
//!
//! Each connection is handled in its own task: a slow or stalled TLS
//! handshake never holds up the others, and is dropped after a timeout.

use std::{sync::Arc, time::Duration};

use axum::Router;
use hyper_util::{rt::TokioIo, service::TowerToHyperService};
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::debug;

/// Longest a client may take to finish the TLS handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `router` over TLS on `listener` until `stop` is cancelled.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    router: Router,
    stop: CancellationToken,
) {
    let acceptor = TlsAcceptor::from(tls);
    loop {
        let (tcp, peer) = tokio::select! {
            () = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors and the like: back off briefly.
                    debug!(%error, "webhook accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(router.clone());
        let stop = stop.clone();
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(error)) => {
                    debug!(%peer, %error, "webhook TLS handshake failed");
                    return;
                }
                Err(_) => {
                    debug!(%peer, "webhook TLS handshake timed out");
                    return;
                }
            };
            let connection = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tls), service);
            tokio::pin!(connection);
            tokio::select! {
                result = connection.as_mut() => if let Err(error) = result {
                    debug!(%peer, %error, "webhook connection ended with an error");
                },
                () = stop.cancelled() => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
        });
    }
}
