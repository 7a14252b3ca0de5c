//! Certificate upkeep against a mocked API server, and hot reload seen by a
//! real TLS client.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Secret;
use rustls::{
    ClientConfig, RootCertStore,
    pki_types::{CertificateDer, ServerName, pem::PemObject},
};
use serde_json::{Value, json};
use time::OffsetDateTime;
use tokio::{net::TcpListener, sync::Notify};
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

use super::*;
use crate::{
    config::WebhookSettings,
    fixtures::{applied, list, mock_client, not_found, ok, to_json},
};

const SECRET_PATH: &str = "/api/v1/namespaces/cattle-flat-network/secrets";
const VWC_PATH: &str =
    "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/flatnet-test";

fn settings() -> WebhookSettings {
    WebhookSettings {
        enabled: true,
        listen: "127.0.0.1:0".parse().unwrap(),
        namespace: "cattle-flat-network".into(),
        service: "webhook-svc".into(),
        secret: "webhook-certs".into(),
        configuration: "flatnet-test".into(),
        url: None,
    }
}

fn hosts() -> Vec<String> {
    cert::hosts("webhook-svc", "cattle-flat-network", Some("127.0.0.1"))
}

fn now() -> OffsetDateTime {
    OffsetDateTime::now_utc()
}

fn fresh() -> Material {
    cert::renew(None, &Renewal::Ca("test"), &hosts(), now()).unwrap()
}

fn stored(material: &Material) -> Secret {
    let mut secret = secret_with(None, &settings(), material);
    secret.metadata.resource_version = Some("3".into());
    secret
}

/// `data` of a Secret body, decoded.
fn decoded(body: &Value, key: &str) -> String {
    let secret: Secret = serde_json::from_value(body.clone()).unwrap();
    String::from_utf8(secret.data.unwrap()[key].0.clone()).unwrap()
}

fn ca_bundle_of(vwc: &Value) -> Vec<String> {
    vwc["webhooks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["clientConfig"]["caBundle"].as_str().unwrap().to_owned())
        .collect()
}

/// The chart's configuration, as Helm created it: the operator's webhooks
/// without a CA bundle, labelled as Helm's.
fn charts_configuration() -> Value {
    let mut configuration = to_json(&registration::desired(&settings(), ""));
    configuration["metadata"]["labels"] = json!({label::MANAGED_BY: "Helm"});
    for webhook in configuration["webhooks"].as_array_mut().unwrap() {
        webhook["clientConfig"]
            .as_object_mut()
            .unwrap()
            .remove("caBundle");
    }
    configuration
}

/// The operator's apply holds each webhook's name and CA bundle, nothing
/// else: the chart owns the rest.
fn assert_only_ca_bundles(applied: &Value) {
    assert_eq!(applied["metadata"], json!({"name": "flatnet-test"}));
    let webhooks = applied["webhooks"].as_array().unwrap();
    assert_eq!(webhooks.len(), 3);
    for webhook in webhooks {
        let fields: Vec<&String> = webhook.as_object().unwrap().keys().collect();
        assert_eq!(fields, ["clientConfig", "name"]);
        let client: Vec<&String> = webhook["clientConfig"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(client, ["caBundle"]);
    }
}

#[tokio::test]
async fn first_run_registers_the_new_ca_then_creates_the_secret() {
    let (client, mut server) = mock_client();
    let task = tokio::spawn(async move { ensure(&client, &settings(), &hosts(), now()).await });
    server
        .expect("GET", &format!("{SECRET_PATH}/webhook-certs"), not_found())
        .await;
    server
        .expect("GET", VWC_PATH, ok(charts_configuration()))
        .await;
    let patch = server
        .expect(
            "PATCH",
            &format!("{VWC_PATH}?&force=true&fieldManager=flatnet-operator-ca-bundle"),
            applied("vwc-uid"),
        )
        .await;
    let create = server
        .expect("POST", &format!("{SECRET_PATH}?"), applied("secret-uid"))
        .await;
    let renew_at = task.await.unwrap().unwrap();
    assert!(renew_at > now() + time::Duration::days(200));

    // Every webhook trusts exactly the bundle stored in the Secret.
    assert_only_ca_bundles(&patch.body);
    let bundle = create.body["data"][CA_CRT].as_str().unwrap().to_owned();
    assert_eq!(
        ca_bundle_of(&patch.body),
        [bundle.clone(), bundle.clone(), bundle]
    );
    assert_eq!(create.body["type"], "kubernetes.io/tls");
    assert_eq!(
        create.body["metadata"]["labels"][label::MANAGED_BY],
        label::MANAGED_BY_FLATNET
    );
    let material = material_of(&serde_json::from_value(create.body.clone()).unwrap()).unwrap();
    assert!(matches!(
        cert::renewal(Some(&material), &hosts(), now()),
        Renewal::UpToDate { .. }
    ));
    server.expect_no_more().await;
}

#[tokio::test]
async fn an_up_to_date_secret_is_only_registered() {
    let material = fresh();
    let secret = stored(&material);
    let (client, mut server) = mock_client();
    let task = tokio::spawn(async move { ensure(&client, &settings(), &hosts(), now()).await });
    server
        .expect(
            "GET",
            &format!("{SECRET_PATH}/webhook-certs"),
            ok(to_json(&secret)),
        )
        .await;
    // The chart's configuration (Helm's) is kept: only its CA bundles are
    // written, nothing deleted.
    server
        .expect("GET", VWC_PATH, ok(charts_configuration()))
        .await;
    let patch = server
        .expect("PATCH", &format!("{VWC_PATH}?*"), applied("vwc-uid"))
        .await;
    task.await.unwrap().unwrap();
    assert_only_ca_bundles(&patch.body);
    let expected = to_json(&secret)["data"][CA_CRT]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(ca_bundle_of(&patch.body).iter().all(|b| *b == expected));
    server.expect_no_more().await;
}

#[tokio::test]
async fn a_missing_configuration_is_reported_not_created() {
    let material = fresh();
    let secret = stored(&material);
    let (client, mut server) = mock_client();
    let task = tokio::spawn(async move { ensure(&client, &settings(), &hosts(), now()).await });
    server
        .expect(
            "GET",
            &format!("{SECRET_PATH}/webhook-certs"),
            ok(to_json(&secret)),
        )
        .await;
    server.expect("GET", VWC_PATH, not_found()).await;
    let error = task.await.unwrap().unwrap_err().to_string();
    assert!(
        error.contains("flatnet-test does not exist") && error.contains("helm upgrade"),
        "{error}"
    );
    server.expect_no_more().await;
}

#[tokio::test]
async fn a_foreign_secret_is_adopted_with_a_new_ca() {
    // As written by the original's deploy job: a certificate without a CA key.
    let foreign = fresh();
    let mut secret = stored(&Material {
        ca_key: String::new(),
        ..foreign.clone()
    });
    secret.metadata.labels = None;
    let (client, mut server) = mock_client();
    let task = tokio::spawn(async move { ensure(&client, &settings(), &hosts(), now()).await });
    server
        .expect(
            "GET",
            &format!("{SECRET_PATH}/webhook-certs"),
            ok(to_json(&secret)),
        )
        .await;
    server
        .expect("GET", VWC_PATH, ok(charts_configuration()))
        .await;
    let patch = server
        .expect("PATCH", &format!("{VWC_PATH}?*"), applied("vwc-uid"))
        .await;
    let replace = server
        .expect_accepted("PUT", &format!("{SECRET_PATH}/webhook-certs?"))
        .await;
    task.await.unwrap().unwrap();
    assert_eq!(replace.body["metadata"]["resourceVersion"], "3");
    let bundle = decoded(&replace.body, CA_CRT);
    assert_ne!(
        cert::certificate_blocks(&bundle)[0],
        cert::certificate_blocks(&foreign.ca_bundle)[0]
    );
    // The adopted CA is still valid, so it stays trusted during the switch.
    assert_eq!(cert::certificate_blocks(&bundle).len(), 2);
    assert!(
        ca_bundle_of(&patch.body)
            .iter()
            .all(|b| *b == replace.body["data"][CA_CRT])
    );
    server.expect_no_more().await;
}

/// The webhook server serving `app` with `resolver`'s certificate until
/// `stop`; its address.
async fn serving(
    resolver: &Arc<resolver::ReloadingResolver>,
    app: axum::Router,
    stop: &CancellationToken,
) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(crate::webhook::server::serve(
        listener,
        resolver::server_config(Arc::clone(resolver)),
        app,
        stop.clone(),
    ));
    addr
}

/// A TLS connection to `addr` for the webhook's name, trusting `roots`.
async fn connect(
    addr: std::net::SocketAddr,
    roots: Arc<RootCertStore>,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let config =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    TlsConnector::from(Arc::new(config))
        .connect(
            ServerName::try_from("webhook-svc.cattle-flat-network.svc").unwrap(),
            tcp,
        )
        .await
        .map_err(|e| format!("handshake: {e}"))
}

/// The leaf certificate a TLS client trusting `ca_bundle` is served at `addr`.
async fn served_certificate(addr: std::net::SocketAddr, ca_bundle: &str) -> Vec<u8> {
    let mut roots = RootCertStore::empty();
    for der in CertificateDer::pem_slice_iter(ca_bundle.as_bytes()) {
        roots.add(der.unwrap()).unwrap();
    }
    let tls = connect(addr, Arc::new(roots))
        .await
        .expect("the handshake succeeds with the CA of the Secret");
    let (_, session) = tls.get_ref();
    session.peer_certificates().unwrap()[0].to_vec()
}

#[tokio::test]
async fn a_changed_secret_is_served_without_restart() {
    let first = fresh();
    let second = fresh();
    let resolver = Arc::new(resolver::ReloadingResolver::default());
    let metrics = Arc::new(Metrics::new());
    let stop = CancellationToken::new();
    let addr = serving(&resolver, axum::Router::new(), &stop).await;

    // The replica follows the Secret through a watch.
    let (client, mut server) = mock_client();
    let changed = Arc::new(Notify::new());
    let follower = tokio::spawn(follow(
        client,
        settings(),
        Arc::clone(&resolver),
        Arc::clone(&metrics),
        Arc::clone(&changed),
        stop.clone(),
    ));
    server
        .expect(
            "GET",
            &format!("{SECRET_PATH}?*"),
            ok(list("SecretList", "v1", vec![to_json(&stored(&first))])),
        )
        .await;
    changed.notified().await;
    assert!(resolver.is_loaded());
    let leaf = |m: &Material| cert::pem_certificates(&m.cert).remove(0);
    assert_eq!(
        served_certificate(addr, &first.ca_bundle).await,
        leaf(&first)
    );

    let mut updated = stored(&second);
    updated.metadata.resource_version = Some("4".into());
    let watch = server
        .expect(
            "GET",
            &format!("{SECRET_PATH}?*"),
            ok(json!({"type": "MODIFIED", "object": to_json(&updated)})),
        )
        .await;
    assert!(watch.uri.contains("watch=true"), "{}", watch.uri);
    assert!(
        watch
            .uri
            .contains("fieldSelector=metadata.name%3Dwebhook-certs"),
        "{}",
        watch.uri
    );
    changed.notified().await;
    assert_eq!(
        served_certificate(addr, &second.ca_bundle).await,
        leaf(&second)
    );
    let expiry = cert::inspect(&leaf(&second), "tls.crt")
        .unwrap()
        .not_after
        .unix_timestamp();
    assert!(metrics.render().contains(&format!(
        "flatnet_operator_webhook_certificate_expiry_timestamp_seconds {expiry}"
    )));

    stop.cancel();
    follower.await.unwrap();
}

#[test]
fn a_secret_without_certificates_holds_no_material() {
    assert_eq!(material_of(&Secret::default()), None);
    let material = fresh();
    assert_eq!(material_of(&stored(&material)), Some(material));
}

/// One admission review over a new TLS connection to `addr`, trusting
/// `roots`: the certificate served and the HTTP status line with the body.
async fn review_over_tls(
    addr: std::net::SocketAddr,
    roots: Arc<RootCertStore>,
    uid: &str,
) -> Result<(Vec<u8>, String, Value), String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tls = connect(addr, roots).await?;
    let served = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    let body = json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE", "namespace": "default", "name": "p",
            "userInfo": {},
            "object": {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": "p", "namespace": "default"},
                       "spec": {"containers": [{"name": "c", "image": "pause"}]}}
        }
    })
    .to_string();
    let request = format!(
        "POST /validate HTTP/1.1\r\nhost: webhook\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(request.as_bytes())
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut reply = Vec::new();
    tls.read_to_end(&mut reply)
        .await
        .map_err(|e| format!("read: {e}"))?;
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let (head, body) = reply.split_once("\r\n\r\n").unwrap_or((&reply, ""));
    let status = head.lines().next().unwrap_or_default().to_owned();
    let review: Value = serde_json::from_str(body.trim()).unwrap_or(Value::Null);
    Ok((served, status, review))
}

/// The certificate rotates while clients keep sending admission reviews,
/// each over a new connection (as the API server's webhook client does
/// after a connection drops): no review fails, and once the rotation is
/// done every connection gets the new certificate. Clients trust both CAs,
/// as the API server does while the caBundle holds the old and the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotating_the_certificate_under_load_fails_no_review() {
    const CLIENTS: usize = 4;
    let first = fresh();
    let second = fresh();
    let resolver = Arc::new(resolver::ReloadingResolver::default());
    resolver.load(&first.cert, &first.key).unwrap();
    let validator = Arc::new(crate::webhook::Validator::new(
        crate::allocation::fake_api::FakeApiServer::new().client(),
        Arc::new(Metrics::new()),
    ));
    let stop = CancellationToken::new();
    let addr = serving(&resolver, crate::webhook::router(validator), &stop).await;
    let mut roots = RootCertStore::empty();
    for bundle in [&first.ca_bundle, &second.ca_bundle] {
        for der in CertificateDer::pem_slice_iter(bundle.as_bytes()) {
            roots.add(der.unwrap()).unwrap();
        }
    }
    let roots = Arc::new(roots);
    let leaf = |m: &Material| cert::pem_certificates(&m.cert).remove(0);
    let (old_leaf, new_leaf) = (leaf(&first), leaf(&second));

    let rotated = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let done = CancellationToken::new();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let (roots, rotated, done) = (Arc::clone(&roots), Arc::clone(&rotated), done.clone());
            let (old_leaf, new_leaf) = (old_leaf.clone(), new_leaf.clone());
            tokio::spawn(async move {
                let (mut sent, mut failures, mut old_after) = (0_u32, Vec::new(), 0_u32);
                let mut served_new = 0_u32;
                while !done.is_cancelled() {
                    // Read before the request: a request that starts after
                    // the rotation must get the new certificate.
                    let after = rotated.load(std::sync::atomic::Ordering::SeqCst);
                    let uid = format!("c{client}-{sent}");
                    sent += 1;
                    match review_over_tls(addr, Arc::clone(&roots), &uid).await {
                        Ok((served, status, review))
                            if status.starts_with("HTTP/1.1 200")
                                && review["response"]["uid"] == uid.as_str()
                                && review["response"]["allowed"].is_boolean() =>
                        {
                            if served == new_leaf {
                                served_new += 1;
                            } else if served == old_leaf && after {
                                old_after += 1;
                            }
                        }
                        Ok((_, status, review)) => failures.push(format!("{status} {review}")),
                        Err(error) => failures.push(error),
                    }
                }
                (sent, failures, old_after, served_new)
            })
        })
        .collect();

    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    resolver.load(&second.cert, &second.key).unwrap();
    rotated.store(true, std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    done.cancel();

    let (mut sent, mut served_new) = (0, 0);
    for client in clients {
        let (n, failures, old_after, new) = client.await.unwrap();
        assert!(failures.is_empty(), "reviews failed: {failures:?}");
        assert_eq!(old_after, 0, "the old certificate served after rotation");
        sent += n;
        served_new += new;
    }
    assert!(
        sent > u32::try_from(2 * CLIENTS).unwrap(),
        "the clients kept sending ({sent} reviews)"
    );
    assert!(served_new > 0, "the new certificate was served");
    stop.cancel();
}

#[test]
fn the_served_certificate_is_trusted_only_by_a_bundle_holding_its_ca() {
    let material = fresh();
    let resolver = resolver::ReloadingResolver::default();
    assert_eq!(resolver.served_certificate(), None);
    resolver.load(&material.cert, &material.key).unwrap();
    let served = resolver.served_certificate().expect("loaded");
    assert_eq!(
        served,
        cert::pem_certificates(&material.cert)[0],
        "the chain's first"
    );
    assert_eq!(cert::trusts(&material.ca_bundle, &served), Ok(()));

    // Another cluster's CA (or one replaced long ago): refused, saying so.
    let other = fresh();
    let refused = cert::trusts(&other.ca_bundle, &served).unwrap_err();
    assert!(
        refused.contains("none of its 1 CA certificates signed"),
        "{refused}"
    );
    // During a rotation the bundle holds both: trusted.
    let both = format!("{}{}", other.ca_bundle, material.ca_bundle);
    assert_eq!(cert::trusts(&both, &served), Ok(()));
    assert_eq!(
        cert::trusts("", &served).unwrap_err(),
        "caBundle is empty".to_owned()
    );
    assert!(
        cert::trusts("not pem", &served)
            .unwrap_err()
            .contains("no PEM")
    );
    // The serving certificate is not a CA: it trusts nothing it did not sign.
    assert!(cert::trusts(&material.cert, &served).is_err());
}
