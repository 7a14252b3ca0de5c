//! The reflector caches of the controllers, and two of kube's behaviours
//! around them that the operator must not inherit.
//!
//! - kube's `Store::wait_until_ready` sits on a oneshot channel that keeps
//!   the waker of the last task to poll it only: with several tasks waiting
//!   on one store (and every kube `Controller` waits on its own), the others
//!   are never woken, and an operator that waited so stayed unready
//!   forever. Waiting here ([`synced`]) polls instead, which wakes every
//!   waiter.
//! - After a watch falls behind (410 Gone) kube's watcher lists again, and
//!   a `Controller` made with `Controller::new` is asked to reconcile each
//!   listed object as the list pages arrive, while the cache still holds
//!   the old list (it swaps the new one in at the end). An object created
//!   while the watch was behind is then not found in the cache, its
//!   reconcile is dropped, and nothing asks again until it changes: on a
//!   busy cluster, pods created during a relist never got an address.
//!   [`cached_controller`] asks for the listed objects once the whole list
//!   is in the cache.

use std::{fmt::Debug, hash::Hash, time::Duration};

use futures::{FutureExt, Stream, StreamExt, stream};
use kube::{
    Api, Resource,
    runtime::{
        Controller, WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use serde::de::DeserializeOwned;

/// How often [`synced`] looks again: short next to a first list.
const POLL: Duration = Duration::from_millis(50);

/// Whether `store` has had its first complete list, now.
pub fn listed<K: kube::Resource + Clone>(store: &Store<K>) -> bool
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    store
        .wait_until_ready()
        .now_or_never()
        .is_some_and(|ready| ready.is_ok())
}

/// Waits until `store` has had its first complete list: true then, false
/// when its reflector went away first.
pub async fn synced<K: kube::Resource + Clone>(store: &Store<K>) -> bool
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    loop {
        match store.wait_until_ready().now_or_never() {
            Some(ready) => return ready.is_ok(),
            None => tokio::time::sleep(POLL).await,
        }
    }
}

/// A controller of every `K` that `config` selects, whose cache holds the
/// objects as `slim` leaves them (`|_| {}` keeps them whole), and which is
/// asked to reconcile an object only once the cache holds it (see the
/// module's notes on relists).
pub fn cached_controller<K>(
    api: Api<K>,
    config: watcher::Config,
    slim: impl FnMut(&mut K) + Send + 'static,
) -> Controller<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Unpin,
{
    let (reader, writer) = reflector::store();
    let events = reflector::reflector(writer, watcher(api, config).modify(slim));
    Controller::for_stream(applied_once_cached(events, reader.clone()), reader)
}

/// The objects `events` applies, each once `store` (which the events feed,
/// before they reach this stream) holds it: a changed object at once, the
/// objects of a list when the list is complete, read from the store then.
fn applied_once_cached<K, S>(
    events: S,
    store: Store<K>,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource + Clone + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone,
    S: Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    let mut listed: Vec<ObjectRef<K>> = Vec::new();
    events.flat_map(move |event| {
        let ready: Vec<ObjectRef<K>> = match event {
            Ok(watcher::Event::Apply(object)) => {
                return stream::iter(vec![Ok(object)]).left_stream();
            }
            Err(error) => return stream::iter(vec![Err(error)]).left_stream(),
            Ok(watcher::Event::Delete(_)) => Vec::new(),
            Ok(watcher::Event::Init) => {
                listed.clear();
                Vec::new()
            }
            Ok(watcher::Event::InitApply(object)) => {
                listed.push(ObjectRef::from_obj(&object));
                Vec::new()
            }
            Ok(watcher::Event::InitDone) => std::mem::take(&mut listed),
        };
        // Read one at a time as the controller takes them, so a relist of
        // many objects holds no second copy of them.
        let store = store.clone();
        stream::iter(ready)
            .filter_map(move |key| {
                let object = store.get(&key).map(|cached| Ok((*cached).clone()));
                async move { object }
            })
            .right_stream()
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::runtime::{reflector, watcher};

    use super::*;

    /// Two tasks wait on one store; both learn of its first list (kube's
    /// own wait wakes only the one that polled last).
    #[tokio::test]
    async fn every_waiter_learns_of_the_first_list() {
        let (store, mut writer) = reflector::store::<ConfigMap>();
        let first = tokio::spawn({
            let store = store.clone();
            async move { synced(&store).await }
        });
        let second = tokio::spawn({
            let store = store.clone();
            async move { synced(&store).await }
        });
        // Both are waiting before the list completes.
        tokio::time::sleep(POLL * 2).await;
        assert!(!listed(&store));
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitDone);
        assert!(listed(&store));
        let within = Duration::from_secs(10);
        assert!(tokio::time::timeout(within, first).await.unwrap().unwrap());
        assert!(tokio::time::timeout(within, second).await.unwrap().unwrap());
    }

    fn map(name: &str) -> ConfigMap {
        ConfigMap {
            metadata: kube::api::ObjectMeta {
                name: Some(name.to_owned()),
                namespace: Some("ns".to_owned()),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    /// Every object the trigger stream yields is in the cache by then; the
    /// objects of a list come when the list is complete, changes at once,
    /// deletions not at all.
    #[tokio::test]
    async fn an_object_is_asked_for_only_once_the_cache_holds_it() {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        let (store, writer) = reflector::store::<ConfigMap>();
        let events = vec![
            Init,
            InitApply(map("a")),
            InitApply(map("b")),
            InitDone,
            Apply(map("c")),
            Delete(map("a")),
            // A relist after 410 Gone: "d" is new, "b" was deleted meanwhile.
            Init,
            InitApply(map("c")),
            InitApply(map("d")),
            InitDone,
        ];
        let fed = reflector::reflector(writer, stream::iter(events.into_iter().map(Ok)));
        let checked = store.clone();
        let yielded: Vec<String> = applied_once_cached(fed, store)
            .map(|object| {
                let object = object.unwrap();
                assert!(
                    checked.get(&ObjectRef::from_obj(&object)).is_some(),
                    "{:?} asked for before the cache holds it",
                    object.metadata.name
                );
                object.metadata.name.unwrap()
            })
            .collect()
            .await;
        assert_eq!(yielded, ["a", "b", "c", "c", "d"]);
    }

    /// The relist of a watch that fell behind (410 Gone), paged as a real
    /// server pages it: every object created while the watch was behind is
    /// reconciled. With `Controller::new`, the reconciles of the first
    /// pages ran while the cache still held the old list, were dropped as
    /// "not found in local store", and those objects were never reconciled.
    #[tokio::test]
    async fn objects_created_while_the_watch_was_behind_are_reconciled() {
        use std::{collections::BTreeSet, sync::Arc};

        use kube::runtime::controller::Action;

        use crate::allocation::fake_api::{FakeApiServer, Realism};

        // The watch delivers late and keeps a short history: a burst of
        // creations outruns it, it gets 410 Gone and lists again (more
        // than one page: kube lists 500 objects a page).
        let server = FakeApiServer::realistic(Realism {
            latency: Duration::from_millis(2),
            watch_delay: Duration::from_millis(300),
            history: 100,
            ..Realism::default()
        });
        let api = Api::<ConfigMap>::namespaced(server.client(), "ns");
        let controller = cached_controller(api, watcher::Config::default(), |_| {});
        let store = controller.store();
        let seen = Arc::new(std::sync::Mutex::new(BTreeSet::<String>::new()));
        let reconcile = |object: Arc<ConfigMap>, seen: Arc<std::sync::Mutex<BTreeSet<String>>>| async move {
            seen.lock()
                .unwrap()
                .insert(object.metadata.name.clone().unwrap());
            Ok::<_, kube::Error>(Action::await_change())
        };
        let run = tokio::spawn(
            controller
                .run(
                    reconcile,
                    |_, _, _| Action::await_change(),
                    Arc::clone(&seen),
                )
                .for_each(|_| async {}),
        );
        assert!(synced(&store).await);
        const MAPS: usize = 1_200;
        for i in 0..MAPS {
            server.insert(&map(&format!("m-{i}")));
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while seen.lock().unwrap().len() < MAPS && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        run.abort();
        assert!(
            server
                .requests_by_kind()
                .get("list configmaps 200")
                .copied()
                .unwrap_or(0)
                > 2,
            "the watch fell behind and the relist took more than one page"
        );
        assert_eq!(
            seen.lock().unwrap().len(),
            MAPS,
            "every object reconciled, the relisted ones too"
        );
    }

    #[tokio::test]
    async fn a_store_whose_reflector_went_away_is_never_synced() {
        let (store, writer) = reflector::store::<ConfigMap>();
        drop(writer);
        assert!(!synced(&store).await);
        assert!(!listed(&store));
    }
}
