//! Kubernetes Events about pods and subnets (`kubectl describe` shows them).

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client, Resource,
    runtime::events::{Event, EventType, Recorder, Reporter},
};
use tracing::warn;

/// Name of the reporting controller in Events.
pub const REPORTER: &str = "flatnet-operator";

/// The original's Event reason for every allocation problem of a pod.
pub const ALLOCATION_ERROR_REASON: &str = "FlatNetworkIPError";

/// Publishes Events; a failure to publish is logged, never fatal.
#[derive(Clone)]
pub struct Events {
    recorder: Recorder,
}

impl Events {
    /// A publisher through `client`.
    #[must_use]
    pub fn new(client: Client) -> Self {
        let reporter = Reporter {
            controller: REPORTER.into(),
            instance: std::env::var("HOSTNAME").ok(),
        };
        Self {
            recorder: Recorder::new(client, reporter),
        }
    }

    /// A Warning on `object`: `reason` in PascalCase, `note` saying what is
    /// wrong and how to fix it.
    pub async fn warn<K>(&self, object: &K, reason: &str, action: &str, note: String)
    where
        K: Resource<DynamicType = ()>,
    {
        self.publish(
            object.object_ref(&()),
            EventType::Warning,
            reason,
            action,
            note,
        )
        .await;
    }

    /// A Warning about a pod's address that only the user can fix: always
    /// with the original's reason [`ALLOCATION_ERROR_REASON`] (alerts written
    /// for it keep firing), its note starting with the finer `reason`, and,
    /// when that differs, a second Warning with the finer reason.
    pub async fn warn_allocation<K>(&self, object: &K, reason: &str, action: &str, note: String)
    where
        K: Resource<DynamicType = ()>,
    {
        if reason != ALLOCATION_ERROR_REASON {
            self.warn(
                object,
                ALLOCATION_ERROR_REASON,
                action,
                format!("{reason}: {note}"),
            )
            .await;
        }
        self.warn(object, reason, action, note).await;
    }

    /// A Normal event on `object`.
    pub async fn normal<K>(&self, object: &K, reason: &str, action: &str, note: String)
    where
        K: Resource<DynamicType = ()>,
    {
        self.publish(
            object.object_ref(&()),
            EventType::Normal,
            reason,
            action,
            note,
        )
        .await;
    }

    async fn publish(
        &self,
        reference: ObjectReference,
        type_: EventType,
        reason: &str,
        action: &str,
        note: String,
    ) {
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(note),
            action: action.into(),
            secondary: None,
        };
        if let Err(error) = self.recorder.publish(&event, &reference).await {
            warn!(%error, reason, "could not publish an Event");
        }
    }
}
