//! The cluster's certificates: one CA, the API server's and the kubelet's
//! serving certificates, a client certificate per component, the
//! service-account key pair, and the kubeconfigs that carry them.

use std::{fs, os::unix::fs::PermissionsExt, path::Path};

use anyhow::Context;
use base64::Engine;
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde_json::json;

use super::{KUBERNETES_SERVICE_IP, NODE_IP, NODE_NAME};

/// A client or serving certificate the cluster uses: its file stem under
/// `pki/`, subject and role.
struct Leaf {
    stem: &'static str,
    common_name: String,
    organization: Option<&'static str>,
    /// Names and addresses of a serving certificate; empty for a client.
    hosts: Vec<String>,
}

/// The file stems of the client certificates, by who presents them.
pub const ADMIN: &str = "admin";
pub const CONTROLLER_MANAGER: &str = "controller-manager";
pub const SCHEDULER: &str = "scheduler";
pub const KUBELET: &str = "kubelet";
pub const APISERVER_KUBELET_CLIENT: &str = "apiserver-kubelet-client";
pub const APISERVER: &str = "apiserver";
pub const KUBELET_SERVING: &str = "kubelet-serving";
/// The service-account signing key (`sa.key`, `sa.pub`).
pub const SERVICE_ACCOUNT: &str = "sa";

fn leaves() -> Vec<Leaf> {
    let client = |stem, cn: &str, organization| Leaf {
        stem,
        common_name: cn.to_owned(),
        organization,
        hosts: Vec::new(),
    };
    vec![
        client(ADMIN, "flatnet-admin", Some("system:masters")),
        client(CONTROLLER_MANAGER, "system:kube-controller-manager", None),
        client(SCHEDULER, "system:kube-scheduler", None),
        client(
            KUBELET,
            &format!("system:node:{NODE_NAME}"),
            Some("system:nodes"),
        ),
        client(
            APISERVER_KUBELET_CLIENT,
            "kube-apiserver-kubelet-client",
            Some("system:masters"),
        ),
        Leaf {
            stem: APISERVER,
            common_name: "kube-apiserver".into(),
            organization: None,
            hosts: apiserver_hosts(),
        },
        Leaf {
            stem: KUBELET_SERVING,
            common_name: NODE_NAME.into(),
            organization: None,
            hosts: vec![NODE_NAME.into(), NODE_IP.into(), "127.0.0.1".into()],
        },
    ]
}

/// The names and addresses the API server is reached by.
pub fn apiserver_hosts() -> Vec<String> {
    [
        "127.0.0.1",
        NODE_IP,
        KUBERNETES_SERVICE_IP,
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Writes the CA, every certificate and the service-account keys into
/// `dir` (`<stem>.crt`, `<stem>.key`), replacing what is there.
pub fn write_all(dir: &Path) -> anyhow::Result<()> {
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    let ca_key = KeyPair::generate()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name
        .push(DnType::CommonName, "flatnet-cluster-ca");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_cert = ca.self_signed(&ca_key)?;
    write(dir, "ca.crt", &ca_cert.pem())?;
    write(dir, "ca.key", &ca_key.serialize_pem())?;
    let issuer = Issuer::new(ca, ca_key);
    for leaf in leaves() {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(leaf.hosts.clone())?;
        params
            .distinguished_name
            .push(DnType::CommonName, leaf.common_name.as_str());
        if let Some(organization) = leaf.organization {
            params
                .distinguished_name
                .push(DnType::OrganizationName, organization);
        }
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![if leaf.hosts.is_empty() {
            ExtendedKeyUsagePurpose::ClientAuth
        } else {
            ExtendedKeyUsagePurpose::ServerAuth
        }];
        params.use_authority_key_identifier_extension = true;
        let cert = params.signed_by(&key, &issuer)?;
        write(dir, &format!("{}.crt", leaf.stem), &cert.pem())?;
        write(dir, &format!("{}.key", leaf.stem), &key.serialize_pem())?;
    }
    let sa = KeyPair::generate()?;
    write(dir, &format!("{SERVICE_ACCOUNT}.key"), &sa.serialize_pem())?;
    write(dir, &format!("{SERVICE_ACCOUNT}.pub"), &sa.public_key_pem())?;
    Ok(())
}

fn write(dir: &Path, name: &str, text: &str) -> anyhow::Result<()> {
    let path = dir.join(name);
    fs::write(&path, text).with_context(|| format!("write {}", path.display()))?;
    fs::set_permissions(&path, fs::Permissions::from_mode(0o600))?;
    Ok(())
}

/// How a kubeconfig's user proves who it is.
pub enum Credentials<'a> {
    /// The client certificate `pki/<stem>.crt` and its key.
    Certificate(&'a str),
    /// A bearer token.
    Token(&'a str),
}

/// A kubeconfig for `server` trusting the CA of `pki`, its data inline.
pub fn kubeconfig(
    pki: &Path,
    server: &str,
    user: &str,
    credentials: &Credentials<'_>,
) -> anyhow::Result<String> {
    let b64 = |name: &str| -> anyhow::Result<String> {
        let path = pki.join(name);
        let bytes = fs::read(&path).with_context(|| format!("read {}", path.display()))?;
        Ok(base64::engine::general_purpose::STANDARD.encode(bytes))
    };
    let user_entry = match credentials {
        Credentials::Certificate(stem) => json!({
            "client-certificate-data": b64(&format!("{stem}.crt"))?,
            "client-key-data": b64(&format!("{stem}.key"))?,
        }),
        Credentials::Token(token) => json!({ "token": token }),
    };
    let config = json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "flatnet", "cluster": {
            "server": server,
            "certificate-authority-data": b64("ca.crt")?,
        }}],
        "users": [{"name": user, "user": user_entry}],
        "contexts": [{"name": "flatnet", "context": {"cluster": "flatnet", "user": user}}],
        "current-context": "flatnet",
    });
    Ok(serde_yaml::to_string(&config)?)
}

#[cfg(test)]
mod tests {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

    use super::*;

    fn der(pem: &str) -> Vec<u8> {
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        base64::engine::general_purpose::STANDARD
            .decode(body)
            .unwrap()
    }

    #[test]
    fn certificates_carry_the_subjects_and_names_kubernetes_checks() {
        let dir = std::env::temp_dir().join(format!("xtask-cluster-pki-{}", std::process::id()));
        write_all(&dir).unwrap();
        let read = |name: &str| der(&fs::read_to_string(dir.join(name)).unwrap());
        let ca = read("ca.crt");
        let (_, ca) = X509Certificate::from_der(&ca).unwrap();
        let subject = |stem: &str| {
            let bytes = read(&format!("{stem}.crt"));
            let (_, cert) = X509Certificate::from_der(&bytes).unwrap();
            assert!(
                cert.verify_signature(Some(ca.public_key())).is_ok(),
                "{stem} is signed by the CA"
            );
            cert.subject().to_string()
        };
        assert_eq!(
            subject(KUBELET),
            "CN=system:node:flatnet-node, O=system:nodes"
        );
        assert_eq!(subject(ADMIN), "CN=flatnet-admin, O=system:masters");
        assert_eq!(
            subject(CONTROLLER_MANAGER),
            "CN=system:kube-controller-manager"
        );
        let bytes = read("apiserver.crt");
        let (_, cert) = X509Certificate::from_der(&bytes).unwrap();
        let names: Vec<String> = cert
            .subject_alternative_name()
            .unwrap()
            .unwrap()
            .value
            .general_names
            .iter()
            .map(|name| match name {
                GeneralName::DNSName(dns) => (*dns).to_owned(),
                GeneralName::IPAddress(ip) => {
                    std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*ip).unwrap()).to_string()
                }
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(names, apiserver_hosts());
        let kubeconfig = kubeconfig(&dir, "https://x:1", "u", &Credentials::Token("t")).unwrap();
        assert!(kubeconfig.contains("token: t"), "{kubeconfig}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
