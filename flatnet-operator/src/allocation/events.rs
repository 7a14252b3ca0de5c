//! Kubernetes Events about pods and subnets (`kubectl describe` shows them).

use flatnet_k8s::events::EventRecorder;
use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client, Resource,
    runtime::events::{Event, EventType, Reporter},
};
use tracing::warn;

/// Name of the reporting controller in Events.
pub const REPORTER: &str = "flatnet-operator";

/// The original's Event reason for every allocation problem of a pod.
pub const ALLOCATION_ERROR_REASON: &str = "FlatNetworkIPError";

/// Publishes Events; a failure to publish is logged, never fatal.
#[derive(Clone)]
pub struct Events {
    recorder: EventRecorder,
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
            recorder: EventRecorder::new(client, reporter),
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

#[cfg(test)]
mod tests {
    use k8s_openapi::api::{core::v1::Pod, events::v1::Event as StoredEvent};
    use kube::api::ObjectMeta;

    use super::Events;
    use crate::allocation::fake_api::FakeApiServer;

    fn pod() -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("web-1".into()),
                namespace: Some("shop".into()),
                uid: Some("uid-web-1".into()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    /// (note, count of the series) of every stored Event, by note.
    fn stored(server: &FakeApiServer) -> Vec<(String, i32)> {
        let mut notes: Vec<_> = server
            .list::<StoredEvent>()
            .into_iter()
            .map(|e| (e.note.unwrap_or_default(), e.series.map_or(1, |s| s.count)))
            .collect();
        notes.sort();
        notes
    }

    #[tokio::test]
    async fn a_new_note_about_an_object_is_an_event_of_its_own_and_a_repeat_counts() {
        let server = FakeApiServer::new();
        let events = Events::new(server.client());
        let pod = pod();
        for note in [
            "MAC a claims 10.0.0.5",
            "MAC b claims 10.0.0.5",
            "MAC a claims 10.0.0.5",
        ] {
            events
                .warn(&pod, "IPConflict", "WatchAddress", note.into())
                .await;
        }
        assert_eq!(
            stored(&server),
            [
                ("MAC a claims 10.0.0.5".to_owned(), 2),
                ("MAC b claims 10.0.0.5".to_owned(), 1)
            ],
            "the second note is not folded into the first Event's series"
        );
    }
}
