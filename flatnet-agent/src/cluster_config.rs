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
    Api,
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
