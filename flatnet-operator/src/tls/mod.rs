//! Managed TLS for the admission webhook.
//!
//! The leader keeps a CA and a serving certificate in a Secret (creating it,
//! or adopting one made by another tool), renews them before they expire
//! and writes the CA bundle into the chart's ValidatingWebhookConfiguration
//! (only that field: the chart owns the rest). Every
//! replica watches the Secret and swaps the certificate it serves without a
//! restart. See `docs/webhook.md`.

pub mod cert;
pub mod resolver;

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use futures::StreamExt;
use k8s_openapi::{ByteString, api::core::v1::Secret};
use kube::{
    Api, Client,
    api::{ObjectMeta, PostParams},
    runtime::{WatchStreamExt, watcher},
};
use time::OffsetDateTime;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use self::{
    cert::{CertError, Material, Renewal},
    resolver::ReloadingResolver,
};
use crate::{config::WebhookSettings, metrics::Metrics, webhook::registration};
use flatnet_k8s::keys::label;

/// Secret key of the serving certificate.
pub const TLS_CRT: &str = "tls.crt";
/// Secret key of the serving key.
pub const TLS_KEY: &str = "tls.key";
/// Secret key of the trusted CA bundle.
pub const CA_CRT: &str = "ca.crt";
/// Secret key of the CA's private key.
pub const CA_KEY: &str = "ca.key";

/// Longest wait between two checks of the certificates by the leader.
const CHECK_PERIOD: Duration = Duration::from_secs(600);
/// Wait after a failed check.
const RETRY: Duration = Duration::from_secs(15);

/// A failure of the leader's certificate upkeep.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Generation failed.
    #[error(transparent)]
    Cert(#[from] CertError),
    /// The Secret could not be read or written.
    #[error(
        "{op} Secret {namespace}/{name}: {source}{}",
        crate::controller::forbidden_hint(.source, .op, Some(.namespace.as_str()))
    )]
    Secret {
        /// What was attempted.
        op: &'static str,
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// The API error.
        #[source]
        source: Box<kube::Error>,
    },
    /// The CA bundle could not be registered.
    #[error(transparent)]
    Registration(#[from] registration::RegistrationError),
}

/// The certificates held by a Secret; `None` when it holds none of them.
#[must_use]
pub fn material_of(secret: &Secret) -> Option<Material> {
    let data = secret.data.as_ref()?;
    let text = |key: &str| {
        data.get(key)
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
            .unwrap_or_default()
    };
    let material = Material {
        ca_bundle: text(CA_CRT),
        ca_key: text(CA_KEY),
        cert: text(TLS_CRT),
        key: text(TLS_KEY),
    };
    (!material.cert.is_empty() || !material.ca_bundle.is_empty()).then_some(material)
}

/// `base` (the stored Secret, if any) with `material` as its data.
fn secret_with(base: Option<Secret>, settings: &WebhookSettings, material: &Material) -> Secret {
    let mut secret = base.unwrap_or_else(|| Secret {
        metadata: ObjectMeta {
            name: Some(settings.secret.clone()),
            namespace: Some(settings.namespace.clone()),
            ..ObjectMeta::default()
        },
        ..Secret::default()
    });
    secret
        .metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(label::MANAGED_BY.into(), label::MANAGED_BY_FLATNET.into());
    secret.type_ = Some("kubernetes.io/tls".into());
    let bytes = |text: &str| ByteString(text.as_bytes().to_vec());
    secret.data = Some(BTreeMap::from([
        (TLS_CRT.into(), bytes(&material.cert)),
        (TLS_KEY.into(), bytes(&material.key)),
        (CA_CRT.into(), bytes(&material.ca_bundle)),
        (CA_KEY.into(), bytes(&material.ca_key)),
    ]));
    secret.string_data = None;
    secret
}

/// One pass of the leader's upkeep: renews what is due, registers the
/// webhook with the current CA bundle, and returns when the next renewal is due.
///
/// A renewed bundle is registered *before* the Secret is written: it still
/// holds the previous CA, so the API server trusts the replicas whichever
/// certificate they serve at that moment.
///
/// # Errors
/// [`TlsError`] naming the failed step.
pub async fn ensure(
    client: &Client,
    settings: &WebhookSettings,
    hosts: &[String],
    now: OffsetDateTime,
) -> Result<OffsetDateTime, TlsError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &settings.namespace);
    let secret_error = |op| {
        let (namespace, name) = (settings.namespace.clone(), settings.secret.clone());
        move |source| TlsError::Secret {
            op,
            namespace,
            name,
            source: Box::new(source),
        }
    };
    let stored = secrets
        .get_opt(&settings.secret)
        .await
        .map_err(secret_error("get"))?;
    let current = stored.as_ref().and_then(material_of);
    let renewal = cert::renewal(current.as_ref(), hosts, now);
    let material = match &renewal {
        Renewal::UpToDate { .. } => current.clone(),
        Renewal::Serving(reason) | Renewal::Ca(reason) => {
            info!(secret = %settings.secret, reason, ca = matches!(renewal, Renewal::Ca(_)), "issuing webhook certificates");
            Some(cert::renew(current.as_ref(), &renewal, hosts, now)?)
        }
    }
    .ok_or(CertError::Parse { what: "ca.crt" })?;

    if settings.url.is_some() {
        // Out of a cluster: no chart made a configuration; the operator's own.
        let configuration = registration::desired(settings, &material.ca_bundle);
        registration::apply_own(client, &configuration).await?;
    } else {
        registration::inject_ca_bundle(client, &settings.configuration, &material.ca_bundle)
            .await?;
    }

    let renew_at = match renewal {
        Renewal::UpToDate { renew_at } => renew_at,
        _ => {
            let exists = stored.is_some();
            let secret = secret_with(stored, settings, &material);
            if exists {
                // Replace carries the resourceVersion: a concurrent writer makes it fail.
                secrets
                    .replace(&settings.secret, &PostParams::default(), &secret)
                    .await
                    .map_err(secret_error("update"))?;
            } else {
                secrets
                    .create(&PostParams::default(), &secret)
                    .await
                    .map_err(secret_error("create"))?;
            }
            match cert::renewal(Some(&material), hosts, now) {
                Renewal::UpToDate { renew_at } => renew_at,
                _ => now,
            }
        }
    };
    Ok(renew_at)
}

/// The leader's upkeep loop: runs [`ensure`] now, when the Secret changes
/// (`changed`), when a renewal falls due, and every ten minutes, until `stop`.
pub async fn manage(
    client: Client,
    settings: WebhookSettings,
    hosts: Vec<String>,
    changed: Arc<Notify>,
    stop: CancellationToken,
) {
    loop {
        let now = OffsetDateTime::now_utc();
        let wait = match ensure(&client, &settings, &hosts, now).await {
            Ok(renew_at) => {
                let until_due = (renew_at - now).try_into().unwrap_or(Duration::ZERO);
                until_due.clamp(Duration::from_secs(1), CHECK_PERIOD)
            }
            Err(error) => {
                warn!(%error, "webhook certificate upkeep failed");
                RETRY
            }
        };
        tokio::select! {
            () = stop.cancelled() => break,
            () = tokio::time::sleep(wait) => {}
            () = changed.notified() => {}
        }
    }
    info!("webhook certificate upkeep stopped");
}

/// Every replica: watches the Secret and loads each new serving certificate
/// into `resolver`, recording its expiry; wakes `changed` on every event so
/// the leader repairs a deleted or edited Secret at once. Runs until `stop`.
pub async fn follow(
    client: Client,
    settings: WebhookSettings,
    resolver: Arc<ReloadingResolver>,
    metrics: Arc<Metrics>,
    changed: Arc<Notify>,
    stop: CancellationToken,
) {
    let secrets: Api<Secret> = Api::namespaced(client, &settings.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={}", settings.secret));
    let events = watcher(secrets, config).default_backoff();
    tokio::pin!(events);
    loop {
        let event = tokio::select! {
            () = stop.cancelled() => break,
            event = events.next() => event,
        };
        let Some(event) = event else { break };
        match event {
            Ok(watcher::Event::Apply(secret) | watcher::Event::InitApply(secret)) => {
                load(&resolver, &metrics, &secret);
                changed.notify_one();
            }
            Ok(watcher::Event::Delete(_)) => changed.notify_one(),
            Ok(_) => {}
            Err(error) => warn!(%error, secret = %settings.secret, "watching the webhook Secret"),
        }
    }
}

/// Loads the serving certificate of `secret` into `resolver`.
pub fn load(resolver: &ReloadingResolver, metrics: &Metrics, secret: &Secret) {
    let Some(material) = material_of(secret) else {
        return;
    };
    match resolver.load(&material.cert, &material.key) {
        Ok(()) => {
            let expiry = cert::pem_certificates(&material.cert)
                .first()
                .and_then(|der| cert::inspect(der, TLS_CRT).ok())
                .map(|info| info.not_after);
            if let Some(expiry) = expiry {
                metrics.set_webhook_cert_expiry(expiry.unix_timestamp());
                info!(expires = %expiry, "serving the webhook certificate from the Secret");
            }
        }
        Err(error) => {
            warn!(%error, "the webhook Secret holds no usable certificate; keeping the previous one");
        }
    }
}

#[cfg(test)]
mod tests;
