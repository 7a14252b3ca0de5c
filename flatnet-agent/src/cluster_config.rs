//! The FlatNetworkConfig `cluster`, watched once for the whole agent.
//!
//! Two consumers read it: the agent-settings follower
//! ([`crate::cluster_settings::follow`], `spec.agents`) and the wire
//! report ([`crate::wire_report::run`], the MAC pool's range). One list and
//! watch of that one object (a `metadata.name` field selector) feeds both
//! through a [`ClusterConfigView`].

use flatnet_k8s::api::{CONFIG_NAME, FlatNetworkConfig};
use futures::StreamExt;
use kube::{
    Api, ResourceExt,
    runtime::{WatchStreamExt, watcher},
};
use tokio::sync::watch;

/// The latest FlatNetworkConfig `cluster`: `None` before the first list,
/// when the object does not exist, and after it is deleted. Cheap to clone.
pub type ClusterConfigView = watch::Receiver<Option<FlatNetworkConfig>>;

/// Starts the one watch of the FlatNetworkConfig `cluster`, followed for
/// the agent's life; a failing watch keeps the last object and retries
/// with backoff.
#[must_use]
pub fn watch(client: kube::Client) -> ClusterConfigView {
    let (sender, view) = watch::channel(None);
    let api: Api<FlatNetworkConfig> = Api::all(client);
    let config = watcher::Config::default().fields(&format!("metadata.name={CONFIG_NAME}"));
    tokio::spawn(async move {
        let mut events = watcher(api, config).default_backoff().boxed();
        // Whether the current (re)list brought the object.
        let mut listed = false;
        while let Some(event) = events.next().await {
            let latest = match event {
                // The selector already keeps other objects out; a server
                // that ignores it must not make one of them the cluster's.
                Ok(
                    watcher::Event::Apply(ref config)
                    | watcher::Event::InitApply(ref config)
                    | watcher::Event::Delete(ref config),
                ) if config.name_any() != CONFIG_NAME => continue,
                Ok(watcher::Event::Apply(config)) => Some(config),
                Ok(watcher::Event::InitApply(config)) => {
                    listed = true;
                    Some(config)
                }
                Ok(watcher::Event::Init) => {
                    listed = false;
                    continue;
                }
                Ok(watcher::Event::InitDone) if !listed => None,
                Ok(watcher::Event::InitDone) => continue,
                Ok(watcher::Event::Delete(_)) => None,
                Err(error) => {
                    tracing::warn!(%error, "FlatNetworkConfig watch failed; the last object read stays in force; retrying");
                    continue;
                }
            };
            sender.send_if_modified(|current| {
                let changed = *current != latest;
                *current = latest;
                changed
            });
        }
    });
    view
}

#[cfg(test)]
mod tests {
    use flatnet_k8s::api::{FlatNetworkConfigSpec, MacPoolSpec};
    use flatnet_operator::allocation::fake_api::FakeApiServer;

    use super::*;

    fn config(name: &str, start: &str, end: &str) -> FlatNetworkConfig {
        FlatNetworkConfig::new(
            name,
            FlatNetworkConfigSpec {
                mac_pool: MacPoolSpec {
                    range_start: Some(start.into()),
                    range_end: Some(end.into()),
                    ..MacPoolSpec::default()
                },
                ..FlatNetworkConfigSpec::default()
            },
        )
    }

    /// The range the view holds once it changes.
    async fn next_range(view: &mut ClusterConfigView) -> Option<String> {
        view.changed().await.expect("the watch runs");
        view.borrow_and_update()
            .as_ref()
            .map(|config| config.mac_range().expect("a valid range").to_string())
    }

    #[tokio::test]
    async fn every_reader_sees_the_cluster_object_its_edits_and_its_deletion() {
        let server = FakeApiServer::new();
        // Another object of the kind is never the cluster's.
        server.insert(&config("other", "02:bb:00:00:00:00", "02:bb:00:00:00:ff"));
        server.insert(&config(
            CONFIG_NAME,
            "02:aa:00:00:00:00",
            "02:aa:00:00:00:ff",
        ));
        let mut view = watch(server.client());
        let mut second = view.clone();
        assert!(view.borrow().is_none(), "nothing before the first list");
        let listed = next_range(&mut view).await;
        assert_eq!(
            listed.as_deref(),
            Some("02:aa:00:00:00:00-02:aa:00:00:00:ff")
        );
        assert_eq!(
            next_range(&mut second).await,
            listed,
            "the same object for both"
        );

        server.insert(&config(
            CONFIG_NAME,
            "02:cc:00:00:00:00",
            "02:cc:00:00:00:ff",
        ));
        assert_eq!(
            next_range(&mut view).await.as_deref(),
            Some("02:cc:00:00:00:00-02:cc:00:00:00:ff")
        );
        assert!(server.delete::<FlatNetworkConfig>("", CONFIG_NAME));
        assert_eq!(next_range(&mut view).await, None);
    }
}
