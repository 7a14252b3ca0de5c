//! The webhook's certificates: a private CA and a serving certificate it
//! signs, when to renew them, and how.
//!
//! The CA lives ten years and the serving certificate one; each is renewed
//! once two thirds of its lifetime have passed, so there is always a third
//! left to roll the new one out. When the CA is renewed the previous one stays
//! in the trust bundle (`ca.crt`) until it expires, so API servers that still
//! hold the old bundle and replicas still serving the old certificate keep
//! working during the switch.

use std::collections::BTreeSet;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use time::{Duration, OffsetDateTime};
use x509_parser::{
    certificate::X509Certificate, extensions::GeneralName, pem::Pem, prelude::FromDer,
};

/// Lifetime of the CA.
pub const CA_LIFETIME: Duration = Duration::days(3650);
/// Lifetime of the serving certificate.
pub const SERVING_LIFETIME: Duration = Duration::days(365);
/// Certificates start a little in the past so nodes with a slow clock accept them.
const BACKDATE: Duration = Duration::hours(1);

/// Common name of the CA.
const CA_NAME: &str = "flatnet-webhook-ca";

/// Everything the webhook Secret holds, PEM encoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Material {
    /// `ca.crt`: the current CA first, then older CAs that have not expired.
    pub ca_bundle: String,
    /// `ca.key`: the current CA's private key.
    pub ca_key: String,
    /// `tls.crt`: the serving certificate.
    pub cert: String,
    /// `tls.key`: its private key.
    pub key: String,
}

/// Why certificates could not be made or read.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    /// rcgen failed to build or sign.
    #[error("cannot generate the webhook certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// A PEM block is not a certificate.
    #[error("{what} is not a PEM certificate")]
    Parse {
        /// Which field.
        what: &'static str,
    },
}

/// What must happen to the stored certificates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Renewal {
    /// Nothing until `renew_at`.
    UpToDate {
        /// When the next renewal is due.
        renew_at: OffsetDateTime,
    },
    /// A new serving certificate from the current CA.
    Serving(&'static str),
    /// A new CA and serving certificate.
    Ca(&'static str),
}

/// The names the serving certificate must carry: the Service's DNS names,
/// and the host of a development URL.
#[must_use]
pub fn hosts(service: &str, namespace: &str, url_host: Option<&str>) -> Vec<String> {
    let mut hosts = vec![
        service.to_owned(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ];
    hosts.extend(url_host.map(str::to_owned));
    hosts
}

/// The facts of one certificate the renewal decision needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertInfo {
    /// Start of validity.
    pub not_before: OffsetDateTime,
    /// End of validity.
    pub not_after: OffsetDateTime,
    /// Subject alternative names (DNS names and IP addresses as text).
    pub names: BTreeSet<String>,
    /// Whether it is a CA.
    pub is_ca: bool,
}

impl CertInfo {
    /// Two thirds into the validity period.
    #[must_use]
    pub fn renew_at(&self) -> OffsetDateTime {
        self.not_before + (self.not_after - self.not_before) * 2 / 3
    }
}

/// The DER of every certificate in `pem`, in order.
#[must_use]
pub fn pem_certificates(pem: &str) -> Vec<Vec<u8>> {
    Pem::iter_from_buffer(pem.as_bytes())
        .filter_map(Result::ok)
        .filter(|block| block.label == "CERTIFICATE")
        .map(|block| block.contents)
        .collect()
}

/// Whether one of the certificates of the PEM `ca_bundle` signed the DER
/// certificate `served`, as the API server checks before it calls the
/// webhook; `Err` says why not.
///
/// # Errors
/// The text naming what fails: no bundle, no certificate in it, an
/// unreadable served certificate, or no CA of the bundle that signed it.
pub fn trusts(ca_bundle: &str, served: &[u8]) -> Result<(), String> {
    let Ok((_, leaf)) = X509Certificate::from_der(served) else {
        return Err("the served certificate does not parse".to_owned());
    };
    if ca_bundle.trim().is_empty() {
        return Err("caBundle is empty".to_owned());
    }
    let cas = pem_certificates(ca_bundle);
    if cas.is_empty() {
        return Err("caBundle holds no PEM certificate".to_owned());
    }
    let signed = cas.iter().any(|der| {
        X509Certificate::from_der(der)
            .is_ok_and(|(_, ca)| leaf.verify_signature(Some(ca.public_key())).is_ok())
    });
    if signed {
        Ok(())
    } else {
        Err(format!(
            "none of its {} CA certificates signed the served certificate (issuer {})",
            cas.len(),
            leaf.issuer()
        ))
    }
}

/// Reads the facts of a DER certificate.
///
/// # Errors
/// [`CertError::Parse`] naming `what`.
pub fn inspect(der: &[u8], what: &'static str) -> Result<CertInfo, CertError> {
    let (_, cert) = X509Certificate::from_der(der).map_err(|_| CertError::Parse { what })?;
    let time = |t: x509_parser::time::ASN1Time| {
        OffsetDateTime::from_unix_timestamp(t.timestamp()).map_err(|_| CertError::Parse { what })
    };
    let names = match cert.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|name| match name {
                GeneralName::DNSName(dns) => Some((*dns).to_owned()),
                GeneralName::IPAddress(bytes) => ip_text(bytes),
                _ => None,
            })
            .collect(),
        _ => BTreeSet::new(),
    };
    Ok(CertInfo {
        not_before: time(cert.validity().not_before)?,
        not_after: time(cert.validity().not_after)?,
        names,
        is_ca: cert.is_ca(),
    })
}

fn ip_text(bytes: &[u8]) -> Option<String> {
    let ip: std::net::IpAddr = match bytes.len() {
        4 => <[u8; 4]>::try_from(bytes).ok()?.into(),
        16 => <[u8; 16]>::try_from(bytes).ok()?.into(),
        _ => return None,
    };
    Some(ip.to_string())
}

/// Decides what the stored `material` needs for a server known as `hosts`
/// at time `now`.
#[must_use]
pub fn renewal(material: Option<&Material>, hosts: &[String], now: OffsetDateTime) -> Renewal {
    let Some(material) = material else {
        return Renewal::Ca("no certificate is stored yet");
    };
    let Some(ca_der) = pem_certificates(&material.ca_bundle).into_iter().next() else {
        return Renewal::Ca("ca.crt holds no certificate");
    };
    let Ok(ca) = inspect(&ca_der, "ca.crt") else {
        return Renewal::Ca("ca.crt does not parse");
    };
    if !ca.is_ca || !key_matches(&material.ca_key, &ca_der) {
        return Renewal::Ca("ca.key is missing or does not belong to ca.crt");
    }
    if now >= ca.renew_at() {
        return Renewal::Ca("the CA is two thirds through its lifetime");
    }
    let Some(cert_der) = pem_certificates(&material.cert).into_iter().next() else {
        return Renewal::Serving("tls.crt holds no certificate");
    };
    let Ok(cert) = inspect(&cert_der, "tls.crt") else {
        return Renewal::Serving("tls.crt does not parse");
    };
    if !key_matches(&material.key, &cert_der) {
        return Renewal::Serving("tls.key does not belong to tls.crt");
    }
    if !signed_by(&cert_der, &ca_der) {
        return Renewal::Serving("tls.crt is not signed by the current CA");
    }
    if cert.names != hosts.iter().cloned().collect::<BTreeSet<_>>() {
        return Renewal::Serving("the webhook's DNS names changed");
    }
    if now >= cert.renew_at() {
        return Renewal::Serving("the serving certificate is two thirds through its lifetime");
    }
    Renewal::UpToDate {
        renew_at: cert.renew_at().min(ca.renew_at()),
    }
}

/// Whether the PEM private key `key` belongs to the DER certificate `der`.
fn key_matches(key: &str, der: &[u8]) -> bool {
    let Ok(key) = KeyPair::from_pem(key) else {
        return false;
    };
    X509Certificate::from_der(der)
        .is_ok_and(|(_, cert)| cert.public_key().subject_public_key.data == key.public_key_raw())
}

fn signed_by(cert: &[u8], ca: &[u8]) -> bool {
    let (Ok((_, cert)), Ok((_, ca))) = (
        X509Certificate::from_der(cert),
        X509Certificate::from_der(ca),
    ) else {
        return false;
    };
    cert.verify_signature(Some(ca.public_key())).is_ok()
}

/// Carries out `renewal` (anything but [`Renewal::UpToDate`]) on `current`.
///
/// # Errors
/// Generation failed, or the current CA cannot be read for a serving renewal.
pub fn renew(
    current: Option<&Material>,
    renewal: &Renewal,
    hosts: &[String],
    now: OffsetDateTime,
) -> Result<Material, CertError> {
    let (ca_pem, ca_key, previous) = match (renewal, current) {
        (Renewal::Serving(_), Some(current)) => {
            let mut blocks = certificate_blocks(&current.ca_bundle).into_iter();
            let ca_pem = blocks.next().ok_or(CertError::Parse { what: "ca.crt" })?;
            (ca_pem, current.ca_key.clone(), blocks.collect())
        }
        _ => {
            let (ca_pem, ca_key) = new_ca(now)?;
            // Keep trusting the CA being replaced until it expires.
            let previous = current
                .map(|c| certificate_blocks(&c.ca_bundle))
                .unwrap_or_default();
            (ca_pem, ca_key, previous)
        }
    };
    let mut ca_bundle = ca_pem.clone();
    for block in previous {
        let still_valid = pem_certificates(&block)
            .first()
            .and_then(|der| inspect(der, "ca.crt").ok())
            .is_some_and(|i| i.is_ca && i.not_after > now);
        if still_valid && block != ca_pem {
            ca_bundle.push_str(&block);
        }
    }
    let (cert, key) = new_serving(&ca_pem, &ca_key, hosts, now)?;
    Ok(Material {
        ca_bundle,
        ca_key,
        cert,
        key,
    })
}

/// The certificate blocks of a PEM text, each from its BEGIN line to its END line.
#[must_use]
pub fn certificate_blocks(pem: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<String> = None;
    for line in pem.lines().map(str::trim) {
        if line == "-----BEGIN CERTIFICATE-----" {
            current = Some(String::new());
        }
        if let Some(block) = current.as_mut() {
            block.push_str(line);
            block.push('\n');
        }
        if line == "-----END CERTIFICATE-----" {
            blocks.extend(current.take());
        }
    }
    blocks
}

fn new_ca(now: OffsetDateTime) -> Result<(String, String), CertError> {
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(Vec::<String>::new())?;
    params.distinguished_name.push(DnType::CommonName, CA_NAME);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params.not_before = now - BACKDATE;
    params.not_after = now + CA_LIFETIME;
    let cert = params.self_signed(&key)?;
    // One line-ending convention, so bundles compare block by block.
    let pem = certificate_blocks(&cert.pem()).concat();
    Ok((pem, key.serialize_pem()))
}

fn new_serving(
    ca_pem: &str,
    ca_key: &str,
    hosts: &[String],
    now: OffsetDateTime,
) -> Result<(String, String), CertError> {
    let ca_key = KeyPair::from_pem(ca_key)?;
    let issuer = Issuer::from_ca_cert_pem(ca_pem, ca_key)?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::new(hosts.to_vec())?;
    params.distinguished_name.push(
        DnType::CommonName,
        hosts.first().map_or("flatnet-webhook", String::as_str),
    );
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = now - BACKDATE;
    params.not_after = now + SERVING_LIFETIME;
    let cert = params.signed_by(&key, &issuer)?;
    Ok((cert.pem(), key.serialize_pem()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        hosts(
            "rancher-flat-network-webhook-svc",
            "cattle-flat-network",
            Some("127.0.0.1"),
        )
    }

    fn now() -> OffsetDateTime {
        OffsetDateTime::from_unix_timestamp(1_800_000_000).unwrap()
    }

    fn fresh() -> Material {
        renew(None, &Renewal::Ca("test"), &names(), now()).unwrap()
    }

    #[test]
    fn serving_certificate_names_the_service_and_the_url_host() {
        let material = fresh();
        let der = &pem_certificates(&material.cert)[0];
        let info = inspect(der, "tls.crt").unwrap();
        let expected: BTreeSet<String> = [
            "rancher-flat-network-webhook-svc",
            "rancher-flat-network-webhook-svc.cattle-flat-network",
            "rancher-flat-network-webhook-svc.cattle-flat-network.svc",
            "rancher-flat-network-webhook-svc.cattle-flat-network.svc.cluster.local",
            "127.0.0.1",
        ]
        .into_iter()
        .map(String::from)
        .collect();
        assert_eq!(info.names, expected);
        assert!(!info.is_ca);
        assert_eq!(info.not_after - now(), SERVING_LIFETIME);
        assert_eq!(now() - info.not_before, BACKDATE);
        let ca = inspect(&pem_certificates(&material.ca_bundle)[0], "ca.crt").unwrap();
        assert!(ca.is_ca);
        assert_eq!(ca.not_after - now(), CA_LIFETIME);
        assert!(signed_by(der, &pem_certificates(&material.ca_bundle)[0]));
    }

    #[test]
    fn fresh_material_is_up_to_date_until_two_thirds_of_the_serving_lifetime() {
        let material = fresh();
        let due = now() - BACKDATE + (SERVING_LIFETIME + BACKDATE) * 2 / 3;
        assert_eq!(
            renewal(Some(&material), &names(), now()),
            Renewal::UpToDate { renew_at: due }
        );
        assert_eq!(
            renewal(Some(&material), &names(), due - Duration::seconds(1)),
            Renewal::UpToDate { renew_at: due }
        );
        assert!(matches!(
            renewal(Some(&material), &names(), due),
            Renewal::Serving(_)
        ));
    }

    #[test]
    fn renewal_reasons() {
        let material = fresh();
        assert!(matches!(renewal(None, &names(), now()), Renewal::Ca(_)));
        let other_names = hosts("svc", "ns", None);
        assert_eq!(
            renewal(Some(&material), &other_names, now()),
            Renewal::Serving("the webhook's DNS names changed")
        );
        let foreign_key = Material {
            key: fresh().key,
            ..material.clone()
        };
        assert!(matches!(
            renewal(Some(&foreign_key), &names(), now()),
            Renewal::Serving(_)
        ));
        // A secret made by another tool: a certificate but no CA key.
        let adopted = Material {
            ca_key: String::new(),
            ..material.clone()
        };
        assert!(matches!(
            renewal(Some(&adopted), &names(), now()),
            Renewal::Ca(_)
        ));
        let other_ca = Material {
            ca_bundle: fresh().ca_bundle,
            ca_key: fresh().ca_key,
            ..material.clone()
        };
        assert!(matches!(
            renewal(Some(&other_ca), &names(), now()),
            Renewal::Ca(_) | Renewal::Serving(_)
        ));
        let ca_due = now() + CA_LIFETIME * 2 / 3;
        assert_eq!(
            renewal(Some(&material), &names(), ca_due),
            Renewal::Ca("the CA is two thirds through its lifetime")
        );
    }

    #[test]
    fn serving_renewal_keeps_the_ca() {
        let material = fresh();
        let later = now() + Duration::days(300);
        let renewed = renew(Some(&material), &Renewal::Serving("t"), &names(), later).unwrap();
        assert_eq!(renewed.ca_bundle, material.ca_bundle);
        assert_eq!(renewed.ca_key, material.ca_key);
        assert_ne!(renewed.cert, material.cert);
        assert_eq!(
            renewal(Some(&renewed), &names(), later),
            Renewal::UpToDate {
                renew_at: inspect(&pem_certificates(&renewed.cert)[0], "tls.crt")
                    .unwrap()
                    .renew_at()
            }
        );
    }

    #[test]
    fn ca_renewal_keeps_trusting_the_previous_ca_until_it_expires() {
        let material = fresh();
        let later = now() + CA_LIFETIME * 2 / 3;
        let renewed = renew(Some(&material), &Renewal::Ca("t"), &names(), later).unwrap();
        let bundle = pem_certificates(&renewed.ca_bundle);
        assert_eq!(bundle.len(), 2);
        assert_eq!(bundle[1], pem_certificates(&material.ca_bundle)[0]);
        assert!(signed_by(&pem_certificates(&renewed.cert)[0], &bundle[0]));
        // Once the old CA has expired it leaves the bundle.
        let much_later = now() + CA_LIFETIME + Duration::days(1);
        let again = renew(Some(&renewed), &Renewal::Serving("t"), &names(), much_later).unwrap();
        assert_eq!(pem_certificates(&again.ca_bundle), vec![bundle[0].clone()]);
    }

    #[test]
    fn certificate_blocks_split_a_bundle() {
        let first = fresh().ca_bundle;
        let second = fresh().ca_bundle;
        let blocks = certificate_blocks(&format!("{first}\n{second}"));
        assert_eq!(blocks.len(), 2);
        assert_eq!(pem_certificates(&blocks[1]), pem_certificates(&second));
    }
}
