//! The fake API server over HTTP on a TCP socket, so that it can run in a
//! process of its own and the operator's footprint be measured apart from
//! it (`benches/allocation_scale.rs`).
//!
//! Every Kubernetes path goes to [`FakeApiServer`] unchanged (watches
//! stream). A few paths under `/fake/` drive the harness inside the
//! server's process, so the measured process never holds the objects:
//!
//! - `POST /fake/pods?subnet=S&from=A&to=B`: pods `pod-A` .. `pod-(B-1)`
//!   asking for an address in `S`;
//! - `DELETE /fake/pods?from=A&to=B`: deletes them;
//! - `GET /fake/progress?from=A&to=B`: `{"records": n, "addressed": m}`, the
//!   records stored and the live records of those pods holding an address;
//! - `GET /fake/requests`: the requests served per verb;
//! - `GET /fake/requests/kinds`: the requests served per verb, resource
//!   and reply code ([`FakeApiServer::requests_by_kind`]);
//! - `GET /fake/subnet?name=S`: `{"active": bool, "check": null | "why"}`,
//!   the invariants of [`View::check`].
//!
//! These are not counted as API requests.

use std::{collections::HashMap, ops::Range};

use axum::{
    Json, Router,
    body::Body,
    extract::{Request, State},
    http::{StatusCode, Uri},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use flatnet_k8s::api::{FlatNetworkIP, FlatNetworkSubnet, phase};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tower::ServiceExt;

use super::{
    fake_api::FakeApiServer,
    fake_cluster::{POD_NAMESPACE, View, pod},
};

/// Serves `server` on `listener` until the process ends.
///
/// # Errors
/// The listener failing.
pub async fn serve(server: FakeApiServer, listener: TcpListener) -> std::io::Result<()> {
    let router = Router::new()
        .route("/fake/pods", post(create_pods).delete(delete_pods))
        .route("/fake/progress", get(progress))
        .route("/fake/requests", get(requests))
        .route("/fake/requests/kinds", get(requests_by_kind))
        .route("/fake/subnet", get(subnet_state))
        .fallback(forward)
        .with_state(server);
    axum::serve(listener, router).await
}

/// The query parameters of `uri`.
fn query(uri: &Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or_default()
        .split('&')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// The pod indices `from..to` of the query.
fn indices(uri: &Uri) -> Range<usize> {
    let query = query(uri);
    let number = |k: &str| query.get(k).and_then(|v| v.parse().ok()).unwrap_or(0);
    number("from")..number("to")
}

/// The index `i` of a record named `pod-<i>`.
fn index(record: &Value) -> Option<usize> {
    record["metadata"]["name"]
        .as_str()?
        .strip_prefix("pod-")?
        .parse()
        .ok()
}

async fn create_pods(State(server): State<FakeApiServer>, uri: Uri) -> StatusCode {
    let subnet = query(&uri).remove("subnet").unwrap_or_default();
    for i in indices(&uri) {
        server.insert(&pod(&format!("pod-{i}"), &subnet));
    }
    StatusCode::NO_CONTENT
}

async fn delete_pods(State(server): State<FakeApiServer>, uri: Uri) -> StatusCode {
    for i in indices(&uri) {
        server.delete::<Pod>(POD_NAMESPACE, &format!("pod-{i}"));
    }
    StatusCode::NO_CONTENT
}

async fn progress(State(server): State<FakeApiServer>, uri: Uri) -> Json<Value> {
    let live = indices(&uri);
    let records = server.count::<FlatNetworkIP>(|_| true);
    let addressed = server.count::<FlatNetworkIP>(|v| {
        v["metadata"]["deletionTimestamp"].is_null()
            && v["status"]["addr"].is_string()
            && index(v).is_some_and(|i| live.contains(&i))
    });
    Json(json!({"records": records, "addressed": addressed}))
}

async fn requests(State(server): State<FakeApiServer>) -> Json<Value> {
    Json(json!(server.requests_by_verb()))
}

async fn requests_by_kind(State(server): State<FakeApiServer>) -> Json<Value> {
    Json(json!(server.requests_by_kind()))
}

async fn subnet_state(State(server): State<FakeApiServer>, uri: Uri) -> Json<Value> {
    let name = query(&uri).remove("name").unwrap_or_default();
    let active = server.list::<FlatNetworkSubnet>().iter().any(|s| {
        s.metadata.name.as_deref() == Some(name.as_str())
            && s.status
                .as_ref()
                .is_some_and(|st| st.phase == phase::ACTIVE)
    });
    let check = active.then(|| View::read(&server, &name).check().err());
    Json(json!({"active": active, "check": check.flatten()}))
}

/// A Kubernetes request, handed to the fake server as the client sent it.
async fn forward(State(server): State<FakeApiServer>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, usize::MAX).await else {
        return (StatusCode::BAD_REQUEST, "unreadable body").into_response();
    };
    let request = axum::http::Request::from_parts(parts, kube::client::Body::from(bytes));
    let Ok(reply) = server.oneshot(request).await;
    let (parts, body) = reply.into_parts();
    Response::from_parts(parts, Body::new(body))
}
