//! The serving certificate of the webhook, swappable while serving.
//!
//! rustls asks the resolver for a certificate on every handshake, so loading
//! a new one takes effect for the next connection without a restart.

use std::sync::{Arc, RwLock};

use rustls::{
    ServerConfig,
    crypto::ring::{default_provider, sign::any_supported_type},
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    server::{ClientHello, ResolvesServerCert},
    sign::CertifiedKey,
};

/// Why a certificate and key could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// `tls.crt` holds no certificate.
    #[error("tls.crt holds no PEM certificate")]
    NoCertificate,
    /// `tls.key` holds no usable key.
    #[error("tls.key holds no usable PEM private key: {0}")]
    Key(String),
}

/// Hands rustls the certificate loaded last; none before the first load, so
/// handshakes fail until the Secret has been read.
#[derive(Debug, Default)]
pub struct ReloadingResolver {
    current: RwLock<Option<Arc<CertifiedKey>>>,
}

impl ReloadingResolver {
    /// Replaces the certificate with the PEM chain `cert` and key `key`.
    ///
    /// # Errors
    /// [`LoadError`] when either does not parse; the previous one stays.
    pub fn load(&self, cert: &str, key: &str) -> Result<(), LoadError> {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert.as_bytes())
            .filter_map(Result::ok)
            .collect();
        if chain.is_empty() {
            return Err(LoadError::NoCertificate);
        }
        let key = PrivateKeyDer::from_pem_slice(key.as_bytes())
            .map_err(|e| LoadError::Key(e.to_string()))?;
        let signing_key = any_supported_type(&key).map_err(|e| LoadError::Key(e.to_string()))?;
        let certified = Arc::new(CertifiedKey::new(chain, signing_key));
        // A poisoned lock only means a reader panicked; the value is still whole.
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(certified);
        Ok(())
    }

    /// The DER of the certificate served (the chain's first), `None`
    /// before the first load.
    #[must_use]
    pub fn served_certificate(&self) -> Option<Vec<u8>> {
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        Some(current.as_ref()?.cert.first()?.as_ref().to_vec())
    }

    /// Whether a certificate has been loaded.
    #[must_use]
    pub fn is_loaded(&self) -> bool {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }
}

impl ResolvesServerCert for ReloadingResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// TLS 1.2+ server configuration that takes its certificate from `resolver`.
///
/// # Panics
/// Never in practice: ring's provider supports the default protocol versions.
#[must_use]
pub fn server_config(resolver: Arc<ReloadingResolver>) -> Arc<ServerConfig> {
    let mut config = ServerConfig::builder_with_provider(Arc::new(default_provider()))
        .with_safe_default_protocol_versions()
        .expect("ring supports TLS 1.2 and 1.3")
        .with_no_client_auth()
        .with_cert_resolver(resolver);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(config)
}
