//! The validating admission webhook, served by every replica.
//!
//! It reviews FlatNetworkSubnets (create, update, delete),
//! PodNetworkConfigs (create, update), the pod templates of Pods and
//! workloads (create, update; their flat-network and floating requests),
//! the floating addresses' pools, quotas and LoadBalancer Services
//! (`floating`), and the FlatNetworkConfig
//! (`cluster_config`). Every denial names the
//! field and the fix. See `docs/webhook.md`.

pub mod cluster_config;
pub mod floating;
pub mod lookup;
pub mod pod_network_config;
pub mod pods;
pub mod registration;
pub mod server;
pub mod subnet;
pub mod workload;

use std::sync::Arc;

use axum::{
    Json, Router,
    extract::State,
    routing::{get, post},
};
use kube::{
    Client,
    core::{
        DynamicObject,
        admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation},
    },
};
use tracing::{debug, info};

use self::lookup::{Lookup, LookupError};
use crate::metrics::Metrics;

/// Why a review is denied: a short reason for the metrics and the message
/// the user sees.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Denial {
    /// Metric label, e.g. `address_in_use`.
    pub reason: &'static str,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl Denial {
    /// A denial with `reason` and `message`.
    pub fn new(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
        }
    }
}

impl From<LookupError> for Denial {
    fn from(error: LookupError) -> Self {
        Self::new(
            "lookup_failed",
            format!("flatnet could not check this request: {error}"),
        )
    }
}

/// Answers admission reviews.
#[derive(Clone)]
pub struct Validator {
    lookup: Lookup,
    metrics: Arc<Metrics>,
}

impl Validator {
    /// A validator reading the cluster through `client`.
    #[must_use]
    pub fn new(client: Client, metrics: Arc<Metrics>) -> Self {
        Self {
            lookup: Lookup::new(client),
            metrics,
        }
    }

    /// Reviews one request.
    pub async fn review(&self, request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
        let kind = request.kind.kind.as_str();
        let operation = operation_name(&request.operation);
        self.metrics.admission_reviewed(kind, operation);
        let verdict = match kind {
            "FlatNetworkSubnet" => subnet::review(&self.lookup, request).await,
            "PodNetworkConfig" => pod_network_config::review(&self.lookup, request).await,
            "FlatNetworkConfig" => cluster_config::review(request),
            kind if floating::KINDS.contains(&kind) => {
                floating::review(&self.lookup, request).await
            }
            // A pod's (template's) flat-network request, then its floating
            // addresses (both webhooks post here; each review ignores what
            // is not its).
            kind if workload::KINDS.contains(&kind) => {
                match pods::review(&self.lookup, request).await {
                    Ok(()) => floating::review_request(&self.lookup, request).await,
                    denied => denied,
                }
            }
            _ => Ok(()),
        };
        let mut response = AdmissionResponse::from(request);
        match verdict {
            Ok(()) => {
                debug!(kind, operation, name = %request.name, "allowed");
                if kind == "FlatNetworkConfig" {
                    let mut warnings = cluster_config::warnings(request);
                    warnings.extend(cluster_config::wire_warnings(&self.lookup, request).await);
                    if !warnings.is_empty() {
                        response.warnings = Some(warnings);
                    }
                }
                if kind != "Pod" && workload::KINDS.contains(&kind) {
                    let warnings = floating::template_warnings(request);
                    if !warnings.is_empty() {
                        response.warnings = Some(warnings);
                    }
                }
                if kind == "FlatNetworkSubnet" {
                    let warnings = subnet::wire_warnings(&self.lookup, request).await;
                    if !warnings.is_empty() {
                        response.warnings = Some(warnings);
                    }
                }
                response
            }
            Err(denial) => {
                info!(kind, operation, name = %request.name, namespace = request.namespace.as_deref().unwrap_or_default(), reason = denial.reason, message = %denial.message, "denied");
                self.metrics.admission_denied(kind, denial.reason);
                response.deny(denial.message)
            }
        }
    }
}

fn operation_name(operation: &Operation) -> &'static str {
    match operation {
        Operation::Create => "CREATE",
        Operation::Update => "UPDATE",
        Operation::Delete => "DELETE",
        Operation::Connect => "CONNECT",
    }
}

/// `POST /validate`: an AdmissionReview in, the same review with a response out.
async fn validate(
    State(validator): State<Arc<Validator>>,
    Json(review): Json<AdmissionReview<DynamicObject>>,
) -> Json<AdmissionReview<DynamicObject>> {
    let request: AdmissionRequest<DynamicObject> = match review.try_into() {
        Ok(request) => request,
        Err(error) => {
            return Json(
                AdmissionResponse::invalid(format!("not an AdmissionReview request: {error}"))
                    .into_review(),
            );
        }
    };
    Json(validator.review(&request).await.into_review())
}

/// The webhook routes: `POST /validate`, and `GET /ping` (`pong`, the
/// original's probe path).
pub fn router(validator: Arc<Validator>) -> Router {
    Router::new()
        .route("/validate", post(validate))
        .route("/ping", get(|| async { "pong\n" }))
        .with_state(validator)
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod wire_tests;
