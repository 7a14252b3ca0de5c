//! Whether a reflector cache has had its first complete list.
//!
//! kube's `Store::wait_until_ready` sits on a oneshot channel that keeps
//! the waker of the last task to poll it only: with several tasks waiting
//! on one store (and every kube `Controller` waits on its own), the others
//! are never woken, and an operator that waited so stayed unready forever.
//! Waiting here polls instead, which wakes every waiter.

use std::time::Duration;

use futures::FutureExt;
use kube::runtime::reflector::Store;

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

    #[tokio::test]
    async fn a_store_whose_reflector_went_away_is_never_synced() {
        let (store, writer) = reflector::store::<ConfigMap>();
        drop(writer);
        assert!(!synced(&store).await);
        assert!(!listed(&store));
    }
}
