//! Kubernetes Events that keep what each one says (feature `events`; the
//! one part of this crate that talks to an API server).
//!
//! kube's `Recorder` folds every Event about one object with the same type,
//! reason and action, within six minutes, into the series of the first one
//! and keeps the first one's note. A second, different problem (another MAC
//! claiming a record's address, a policy edited into a new mistake) would
//! then only raise a counter under the old message. [`EventRecorder`] keeps
//! one `Recorder` per distinct note: repeats of one note still become a
//! series, a new note becomes an Event of its own.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{
    Client,
    runtime::events::{Event, Recorder, Reporter},
};

/// How long a note's series stays open: kube's own cache time, after which
/// it starts a new Event anyway.
const SERIES_WINDOW: Duration = Duration::from_secs(6 * 60);

/// Most distinct notes kept at once; beyond it the oldest goes (its next
/// repeat starts a new Event instead of counting in the old series).
const MOST_NOTES: usize = 4096;

/// Which series an Event belongs to.
#[derive(Clone, PartialEq, Eq, Hash)]
struct SeriesKey {
    /// The object's UID, or its namespace/name when it has none.
    object: String,
    reason: String,
    action: String,
    note: Option<String>,
}

/// Publishes Events; the same note about the same object within
/// [`SERIES_WINDOW`] counts in one series, another note is a new Event.
/// Clones share their series.
#[derive(Clone)]
pub struct EventRecorder {
    client: Client,
    reporter: Reporter,
    series: Arc<Mutex<HashMap<SeriesKey, (Recorder, Instant)>>>,
}

impl EventRecorder {
    /// A publisher through `client`, naming `reporter` in its Events.
    #[must_use]
    pub fn new(client: Client, reporter: Reporter) -> Self {
        Self {
            client,
            reporter,
            series: Arc::default(),
        }
    }

    /// Publishes `event` about the object `regarding`.
    ///
    /// # Errors
    /// When the API server refuses the Event or cannot be reached.
    pub async fn publish(
        &self,
        event: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let key = SeriesKey {
            object: regarding.uid.clone().unwrap_or_else(|| {
                format!(
                    "{}/{}",
                    regarding.namespace.as_deref().unwrap_or_default(),
                    regarding.name.as_deref().unwrap_or_default()
                )
            }),
            reason: event.reason.clone(),
            action: event.action.clone(),
            note: event.note.clone(),
        };
        let recorder = self.recorder_for(key, Instant::now());
        recorder.publish(event, regarding).await
    }

    /// The recorder of `key`'s series, new when the series is not open.
    fn recorder_for(&self, key: SeriesKey, now: Instant) -> Recorder {
        let mut series = self
            .series
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        series.retain(|_, (_, last)| now.duration_since(*last) < SERIES_WINDOW);
        if series.len() >= MOST_NOTES && !series.contains_key(&key) {
            let oldest = series
                .iter()
                .min_by_key(|(_, (_, last))| *last)
                .map(|(key, _)| key.clone());
            if let Some(oldest) = oldest {
                series.remove(&oldest);
            }
        }
        let entry = series.entry(key).or_insert_with(|| {
            (
                Recorder::new(self.client.clone(), self.reporter.clone()),
                now,
            )
        });
        entry.1 = now;
        entry.0.clone()
    }
}
