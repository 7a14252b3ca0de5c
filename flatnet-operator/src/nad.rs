//! The NetworkAttachmentDefinition controller.
//!
//! Multus finds the flat network through a `k8s.cni.cncf.io/v1`
//! NetworkAttachmentDefinition named `rancher-flat-network` (the
//! `--network-attachment` name) in the pod's namespace. The leader keeps one
//! in every namespace, pointing at `flatnet-cni` with the operator's settings,
//! and restores it when it is deleted or edited.
//!
//! Each attachment is owned by the webhook's ValidatingWebhookConfiguration,
//! a cluster-scoped object of the installation (the chart's, or the
//! operator's own out of a cluster): `helm uninstall` removes it, and the
//! garbage collector then removes every attachment. The namespace is not an
//! owner: the collector keeps an object while any owner remains, and an
//! attachment goes with its namespace anyway. Without a webhook
//! (`--webhook-server=false`) the namespace is the owner.

use std::{sync::Arc, time::Duration};

use futures::StreamExt;
use k8s_openapi::{
    api::{admissionregistration::v1::ValidatingWebhookConfiguration, core::v1::Namespace},
    apimachinery::pkg::apis::meta::v1::OwnerReference,
};
use kube::{
    Api, Client, CustomResource, Resource, ResourceExt,
    api::{ObjectMeta, Patch, PatchParams},
    runtime::{
        controller::{self, Action},
        reflector::ObjectRef,
        watcher,
    },
};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, instrument, warn};

use flatnet_k8s::keys;

use crate::{
    cache::cached_controller, cidr::Cidr, config::CniSettings, flat_services::FIELD_MANAGER,
    metrics::Metrics,
};

/// Name of this controller in logs and metrics.
pub const CONTROLLER: &str = "nad";

/// Retry delay after an API error.
const RETRY_TRANSIENT: Duration = Duration::from_secs(10);

/// Spec of a Multus NetworkAttachmentDefinition: the CNI config as a JSON string.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "k8s.cni.cncf.io",
    version = "v1",
    kind = "NetworkAttachmentDefinition",
    plural = "network-attachment-definitions",
    namespaced,
    schema = "disabled"
)]
pub struct NetworkAttachmentDefinitionSpec {
    /// CNI network configuration (JSON text).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub config: String,
}

/// What the reconciler needs.
pub struct Context {
    /// API client.
    pub client: Client,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Attachment name (`--network-attachment`).
    pub name: String,
    /// The CNI config every attachment carries, re-rendered when the
    /// FlatNetworkConfig changes a setting it holds.
    pub config: CniConfig,
    /// Period of the full re-reconcile.
    pub resync: Duration,
    /// The ValidatingWebhookConfiguration that owns every attachment;
    /// `None` (no webhook): each namespace owns its own.
    pub owner: Option<String>,
}

/// The CNI config text every attachment carries, replaceable at run time:
/// a replacement re-applies every attachment.
#[derive(Clone, Debug)]
pub struct CniConfig(Arc<tokio::sync::watch::Sender<String>>);

impl CniConfig {
    /// The config text now.
    #[must_use]
    pub fn current(&self) -> String {
        self.0.borrow().clone()
    }

    /// Replaces the text; returns whether it changed.
    pub fn set(&self, text: String) -> bool {
        self.0.send_if_modified(|current| {
            let changed = *current != text;
            *current = text;
            changed
        })
    }

    /// Yields once per replacement.
    fn changes(&self) -> impl futures::Stream<Item = ()> + Send + 'static {
        futures::stream::unfold(self.0.subscribe(), |mut receiver| async move {
            receiver.changed().await.ok()?;
            Some(((), receiver))
        })
    }
}

impl From<String> for CniConfig {
    fn from(text: String) -> Self {
        Self(Arc::new(tokio::sync::watch::channel(text).0))
    }
}

impl From<&str> for CniConfig {
    fn from(text: &str) -> Self {
        text.to_owned().into()
    }
}

/// A reconcile failure.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The attachment could not be applied.
    #[error(
        "apply NetworkAttachmentDefinition {namespace}/{name}: {source}{}",
        match crate::controller::forbidden_hint(.source, "apply", Some(.namespace.as_str())) {
            hint if hint.is_empty() => "; check the k8s.cni.cncf.io CRD is installed (Multus)".to_owned(),
            hint => hint,
        }
    )]
    Apply {
        /// Namespace.
        namespace: String,
        /// Attachment name.
        name: String,
        /// The API error.
        #[source]
        source: Box<kube::Error>,
    },
    /// The owning webhook configuration could not be read.
    #[error(
        "get ValidatingWebhookConfiguration {name}, the owner of every NetworkAttachmentDefinition: {source}{}",
        crate::controller::forbidden_hint(.source, "get", None)
    )]
    Owner {
        /// Configuration name.
        name: String,
        /// The API error.
        #[source]
        source: Box<kube::Error>,
    },
    /// The owning webhook configuration does not exist (yet).
    #[error(
        "ValidatingWebhookConfiguration {name}, the owner of every NetworkAttachmentDefinition, does not exist: the chart creates it (out of a cluster, the operator registers it first)"
    )]
    OwnerMissing {
        /// Configuration name.
        name: String,
    },
}

/// The CNI config of the flat network: a configuration list with one
/// `flatnet-cni` plugin.
///
/// A list, not a single plugin config, because only a list carries
/// `cniVersions`: a runtime on libcni 1.2 or later (Multus 4.1+) then
/// speaks 1.1.0 and sends STATUS and GC, older ones read `cniVersion`.
/// `mtu` is a field of flatnet-cni's own config. The `flatNetwork` object is
/// the original's block, kept so its readers keep working; flatnet-cni
/// forwards it to the agent unchanged.
#[must_use]
pub fn cni_config(
    name: &str,
    settings: &CniSettings,
    cluster_cidrs: &[Cidr],
    service_cidrs: &[Cidr],
) -> String {
    let join = |cidrs: &[Cidr]| {
        cidrs
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut flat_network = json!({
        "clusterCIDR": join(cluster_cidrs),
        "serviceCIDR": join(service_cidrs),
        "arpPolicy": settings.arp_policy.as_str(),
        "proxyARP": settings.proxy_arp,
    });
    let mut plugin = json!({ "type": keys::CNI_PLUGIN });
    if let Some(mtu) = settings.mtu {
        plugin["mtu"] = json!(mtu);
        flat_network["mtu"] = json!(mtu);
    }
    plugin["flatNetwork"] = flat_network;
    json!({
        "cniVersion": keys::CNI_CONFIG_VERSION,
        "cniVersions": keys::CNI_CONFIG_VERSIONS,
        "name": name,
        "plugins": [plugin],
    })
    .to_string()
}

/// The attachment wanted in `namespace`, owned by `owner`.
#[must_use]
pub fn desired(
    namespace: &Namespace,
    owner: OwnerReference,
    name: &str,
    config: &str,
) -> NetworkAttachmentDefinition {
    NetworkAttachmentDefinition {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.name_any()),
            owner_references: Some(vec![owner]),
            ..ObjectMeta::default()
        },
        spec: NetworkAttachmentDefinitionSpec {
            config: config.to_owned(),
        },
    }
}

/// The owner of the attachment in `namespace`: the webhook configuration
/// when there is one, else the namespace; `None` while it has no uid.
async fn owner_of(namespace: &Namespace, ctx: &Context) -> Result<Option<OwnerReference>, Error> {
    let owner = match &ctx.owner {
        None => namespace.controller_owner_ref(&()),
        Some(name) => {
            let configurations: Api<ValidatingWebhookConfiguration> = Api::all(ctx.client.clone());
            configurations
                .get_opt(name)
                .await
                .map_err(|source| Error::Owner {
                    name: name.clone(),
                    source: Box::new(source),
                })?
                .ok_or_else(|| Error::OwnerMissing { name: name.clone() })?
                .controller_owner_ref(&())
        }
    };
    // No blockOwnerDeletion: it would need the update grant on the owner's
    // finalizers, and nothing waits for attachments to go.
    Ok(owner.map(|owner| OwnerReference {
        controller: Some(true),
        block_owner_deletion: None,
        ..owner
    }))
}

/// Applies the attachment of one namespace.
///
/// # Errors
/// The apply failed.
#[instrument(skip_all, fields(namespace = %namespace.name_any()))]
pub async fn reconcile(namespace: Arc<Namespace>, ctx: Arc<Context>) -> Result<Action, Error> {
    let _timer = ctx.metrics.reconcile_started(CONTROLLER);
    let terminating = namespace.meta().deletion_timestamp.is_some()
        || namespace.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Terminating");
    if terminating {
        return Ok(Action::await_change());
    }
    let Some(owner) = owner_of(&namespace, &ctx).await? else {
        return Ok(Action::await_change());
    };
    let nad = desired(&namespace, owner, &ctx.name, &ctx.config.current());
    let ns = namespace.name_any();
    let api: Api<NetworkAttachmentDefinition> = Api::namespaced(ctx.client.clone(), &ns);
    // Forced apply: fields another manager changed (the config) come back.
    api.patch(
        &ctx.name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&nad),
    )
    .await
    .map_err(|source| Error::Apply {
        namespace: ns,
        name: ctx.name.clone(),
        source: Box::new(source),
    })?;
    debug!("network attachment applied");
    Ok(Action::requeue(ctx.resync))
}

/// Logs the failure, counts it, and retries later.
pub fn error_policy(namespace: Arc<Namespace>, error: &Error, ctx: Arc<Context>) -> Action {
    warn!(namespace = %namespace.name_any(), %error, "reconcile failed");
    ctx.metrics.reconcile_failed(CONTROLLER, "kube_api");
    Action::requeue(RETRY_TRANSIENT)
}

/// Runs the controller until `stop` is cancelled.
pub async fn run(ctx: Arc<Context>, workers: u16, stop: CancellationToken) {
    let client = ctx.client.clone();
    let attachments = watcher::Config::default().fields(&format!("metadata.name={}", ctx.name));
    let config_changes = ctx.config.changes();
    cached_controller(
        Api::<Namespace>::all(client.clone()),
        watcher::Config::default(),
        |_| {},
    )
    // A deleted or edited attachment maps back to its namespace.
    .watches(
        Api::<NetworkAttachmentDefinition>::all(client),
        attachments,
        |nad| nad.namespace().map(|ns| ObjectRef::<Namespace>::new(&ns)),
    )
    // A changed setting (FlatNetworkConfig): every attachment again.
    .reconcile_all_on(config_changes)
    .with_config(controller::Config::default().concurrency(workers))
    .graceful_shutdown_on(async move { stop.cancelled().await })
    .run(reconcile, error_policy, ctx)
    .for_each(|result| async move {
        if let Err(error) = result {
            debug!(%error, "network attachment controller event");
        }
    })
    .await;
    info!("network attachment controller stopped");
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;
    use crate::{
        config::ArpPolicy,
        fixtures::{applied, mock_client, not_found, ok},
    };

    fn settings(mtu: Option<u16>) -> CniSettings {
        CniSettings {
            arp_policy: ArpPolicy::Arping,
            proxy_arp: true,
            mtu,
        }
    }

    fn cidrs(list: &[&str]) -> Vec<Cidr> {
        list.iter().map(|c| c.parse().unwrap()).collect()
    }

    #[test]
    fn config_carries_the_operator_settings() {
        let text = cni_config(
            "rancher-flat-network",
            &settings(Some(9000)),
            &cidrs(&["10.42.0.0/16", "fd42::/56"]),
            &cidrs(&["10.43.0.0/16"]),
        );
        let config: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(
            config,
            json!({
                "cniVersion": "1.0.0",
                "cniVersions": ["1.0.0", "1.1.0"],
                "name": "rancher-flat-network",
                "plugins": [{
                    "type": "flatnet-cni",
                    "mtu": 9000,
                    "flatNetwork": {
                        "mtu": 9000,
                        "clusterCIDR": "10.42.0.0/16,fd42::/56",
                        "serviceCIDR": "10.43.0.0/16",
                        "arpPolicy": "arping",
                        "proxyARP": true,
                    },
                }],
            })
        );
    }

    #[test]
    fn config_without_mtu_leaves_it_to_the_parent() {
        let config: Value = serde_json::from_str(&cni_config(
            "n",
            &settings(None),
            &cidrs(&["10.42.0.0/16"]),
            &cidrs(&["10.43.0.0/16"]),
        ))
        .unwrap();
        let plugin = &config["plugins"][0];
        assert!(plugin.get("mtu").is_none());
        assert!(plugin["flatNetwork"].get("mtu").is_none());
    }

    fn namespace(name: &str) -> Namespace {
        Namespace {
            metadata: ObjectMeta {
                name: Some(name.into()),
                uid: Some(format!("uid-{name}")),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        }
    }

    fn context(client: kube::Client, owner: Option<&str>) -> Arc<Context> {
        Arc::new(Context {
            client,
            metrics: Arc::new(Metrics::new()),
            name: "rancher-flat-network".into(),
            config: "{\"type\":\"flatnet-cni\"}".into(),
            resync: Duration::from_secs(600),
            owner: owner.map(str::to_owned),
        })
    }

    const ATTACHMENT: &str = "/apis/k8s.cni.cncf.io/v1/namespaces/shop/network-attachment-definitions/rancher-flat-network?&force=true&fieldManager=flatnet-operator";
    const CONFIGURATION: &str =
        "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/flatnet-webhook";

    #[tokio::test]
    async fn the_webhook_configuration_owns_the_attachment() {
        let (client, mut server) = mock_client();
        let ctx = context(client, Some("flatnet-webhook"));
        let task = tokio::spawn(reconcile(Arc::new(namespace("shop")), Arc::clone(&ctx)));
        server
            .expect(
                "GET",
                CONFIGURATION,
                ok(json!({"apiVersion": "admissionregistration.k8s.io/v1",
                    "kind": "ValidatingWebhookConfiguration",
                    "metadata": {"name": "flatnet-webhook", "uid": "vwc-uid"}})),
            )
            .await;
        let seen = server.expect("PATCH", ATTACHMENT, applied("nad-uid")).await;
        assert_eq!(seen.body["spec"]["config"], "{\"type\":\"flatnet-cni\"}");
        // The only owner: the collector keeps an object while any owner remains.
        assert_eq!(
            seen.body["metadata"]["ownerReferences"],
            json!([{"apiVersion": "admissionregistration.k8s.io/v1",
                    "kind": "ValidatingWebhookConfiguration",
                    "name": "flatnet-webhook", "uid": "vwc-uid", "controller": true}])
        );
        let action = task.await.unwrap().unwrap();
        assert_eq!(action, Action::requeue(Duration::from_secs(600)));
        drop(ctx);
        server.expect_no_more().await;
    }

    #[tokio::test]
    async fn without_the_webhook_configuration_nothing_is_applied() {
        let (client, mut server) = mock_client();
        let ctx = context(client, Some("flatnet-webhook"));
        let task = tokio::spawn(reconcile(Arc::new(namespace("shop")), Arc::clone(&ctx)));
        server.expect("GET", CONFIGURATION, not_found()).await;
        let error = task.await.unwrap().unwrap_err();
        assert!(
            error
                .to_string()
                .contains("ValidatingWebhookConfiguration flatnet-webhook, the owner of every NetworkAttachmentDefinition, does not exist"),
            "{error}"
        );
        drop(ctx);
        server.expect_no_more().await;
    }

    #[tokio::test]
    async fn without_a_webhook_the_namespace_owns_the_attachment() {
        let (client, mut server) = mock_client();
        let ctx = context(client, None);
        let task = tokio::spawn(reconcile(Arc::new(namespace("shop")), Arc::clone(&ctx)));
        let seen = server.expect("PATCH", ATTACHMENT, applied("nad-uid")).await;
        assert_eq!(
            seen.body["metadata"]["ownerReferences"],
            json!([{"apiVersion": "v1", "kind": "Namespace", "name": "shop",
                    "uid": "uid-shop", "controller": true}])
        );
        task.await.unwrap().unwrap();
        drop(ctx);
        server.expect_no_more().await;
    }

    #[tokio::test]
    async fn leaves_terminating_namespaces_alone() {
        let (client, server) = mock_client();
        let ctx = context(client, Some("flatnet-webhook"));
        let mut ns = namespace("old");
        ns.status = Some(k8s_openapi::api::core::v1::NamespaceStatus {
            phase: Some("Terminating".into()),
            ..Default::default()
        });
        let action = reconcile(Arc::new(ns), Arc::clone(&ctx)).await.unwrap();
        assert_eq!(action, Action::await_change());
        drop(ctx);
        server.expect_no_more().await;
    }
}
