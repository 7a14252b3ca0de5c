//! A small blocking HTTPS client for the cluster's API server: rustls over
//! a TCP stream, one HTTP/1.1 request per connection. Enough for what the
//! launcher and a test harness do (readiness, bootstrap objects,
//! server-side apply); no watches, exec or port-forward.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    sync::Arc,
    time::Duration,
};

use anyhow::{Context, bail};
use rustls::{
    ClientConfig, ClientConnection, RootCertStore, StreamOwned,
    pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject},
};
use serde_json::Value;

use super::{API_PORT, NODE_IP, pki};

/// The field manager of everything the launcher applies.
pub const FIELD_MANAGER: &str = "flatnet-cluster";

/// An API client authenticated by a client certificate of the cluster's PKI.
#[derive(Clone)]
pub struct Client {
    config: Arc<ClientConfig>,
    address: SocketAddr,
}

/// An HTTP answer.
#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Response {
    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn json(&self) -> anyhow::Result<Value> {
        serde_json::from_slice(&self.body).with_context(|| format!("not JSON: {}", self.text()))
    }
}

impl Client {
    /// The admin (`O=system:masters`) of the cluster whose state is in `state`.
    pub fn admin(state: &Path) -> anyhow::Result<Self> {
        Self::with_certificate(&state.join("pki"), pki::ADMIN)
    }

    /// A client presenting `pki/<stem>.crt`, trusting `pki/ca.crt`.
    pub fn with_certificate(pki_dir: &Path, stem: &str) -> anyhow::Result<Self> {
        let read = |name: String| -> anyhow::Result<Vec<u8>> {
            let path = pki_dir.join(&name);
            std::fs::read(&path).with_context(|| {
                format!(
                    "read {} (is the cluster up? `cargo xtask cluster up`)",
                    path.display()
                )
            })
        };
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&read("ca.crt".into())?) {
            roots.add(cert?)?;
        }
        let chain = CertificateDer::pem_slice_iter(&read(format!("{stem}.crt"))?)
            .collect::<Result<Vec<_>, _>>()?;
        let key = PrivateKeyDer::from_pem_slice(&read(format!("{stem}.key"))?)?;
        let config =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots)
                .with_client_auth_cert(chain, key)?;
        Ok(Self {
            config: Arc::new(config),
            address: SocketAddr::new(NODE_IP.parse()?, API_PORT),
        })
    }

    /// One request; any status is returned.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        content_type: Option<&str>,
        body: &[u8],
    ) -> anyhow::Result<Response> {
        let what = || format!("{method} {path}");
        let tcp = TcpStream::connect_timeout(&self.address, Duration::from_secs(3))
            .with_context(|| format!("{}: connect to {}", what(), self.address))?;
        tcp.set_read_timeout(Some(Duration::from_secs(30)))?;
        let name = ServerName::IpAddress(self.address.ip().into());
        let connection = ClientConnection::new(self.config.clone(), name)?;
        let mut stream = StreamOwned::new(connection, tcp);
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAccept: application/json\r\n\
             User-Agent: flatnet-xtask\r\nConnection: close\r\nContent-Length: {}\r\n",
            self.address,
            body.len()
        );
        if let Some(content_type) = content_type {
            head.push_str(&format!("Content-Type: {content_type}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        stream.flush()?;
        let mut raw = Vec::new();
        match stream.read_to_end(&mut raw) {
            Ok(_) => {}
            // A peer closing without close_notify: the answer is complete
            // when its length says so (checked by `parse_response`).
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
            Err(e) => return Err(e).with_context(what),
        }
        parse_response(&raw).with_context(what)
    }

    /// GET `path`: its JSON, `None` on 404; other statuses fail.
    pub fn get(&self, path: &str) -> anyhow::Result<Option<Value>> {
        let response = self.request("GET", path, None, &[])?;
        match response.status {
            200 => Ok(Some(response.json()?)),
            404 => Ok(None),
            status => bail!("GET {path}: {status} {}", response.text()),
        }
    }

    /// GET `path` that must answer 200; its body as text.
    pub fn get_text(&self, path: &str) -> anyhow::Result<String> {
        let response = self.request("GET", path, None, &[])?;
        if response.status != 200 {
            bail!("GET {path}: {} {}", response.status, response.text());
        }
        Ok(response.text())
    }

    /// `cargo xtask cluster api`: `method path` with a JSON or YAML body
    /// (PATCH as a merge patch); the answer's body, failing on a non-2xx.
    pub fn call(&self, method: &str, path: &str, body: Option<&str>) -> anyhow::Result<String> {
        let method = method.to_uppercase();
        let body = match body {
            Some(text) => serde_json::to_vec(&serde_yaml::from_str::<Value>(text)?)?,
            None => Vec::new(),
        };
        let content_type = match (body.is_empty(), method.as_str()) {
            (true, _) => None,
            (false, "PATCH") => Some("application/merge-patch+json"),
            (false, _) => Some("application/json"),
        };
        let response = self.request(&method, path, content_type, &body)?;
        if !(200..300).contains(&response.status) {
            bail!("{method} {path}: {} {}", response.status, response.text());
        }
        Ok(response.text())
    }

    /// Server-side apply of every document of `yaml`; one line per object.
    pub fn apply_yaml(&self, yaml: &str) -> anyhow::Result<Vec<String>> {
        let mut applied = Vec::new();
        for document in serde_yaml::Deserializer::from_str(yaml) {
            let object = Value::deserialize(document)?;
            if object.is_null() {
                continue;
            }
            applied.push(self.apply(&object)?);
        }
        Ok(applied)
    }

    /// Server-side apply of one object (its kind found by discovery);
    /// namespaced objects without a namespace go to `default`.
    pub fn apply(&self, object: &Value) -> anyhow::Result<String> {
        let api_version = object["apiVersion"]
            .as_str()
            .context("an object without apiVersion")?;
        let kind = object["kind"].as_str().context("an object without kind")?;
        let name = object["metadata"]["name"]
            .as_str()
            .with_context(|| format!("a {kind} without metadata.name"))?;
        let (resource, namespaced) = self.resource_of(api_version, kind)?;
        let base = if api_version.contains('/') {
            format!("/apis/{api_version}")
        } else {
            format!("/api/{api_version}")
        };
        let namespace = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("default");
        let path = if namespaced {
            format!("{base}/namespaces/{namespace}/{resource}/{name}")
        } else {
            format!("{base}/{resource}/{name}")
        };
        let query = format!("{path}?fieldManager={FIELD_MANAGER}&force=true");
        let response = self.request(
            "PATCH",
            &query,
            Some("application/apply-patch+yaml"),
            &serde_json::to_vec(object)?,
        )?;
        if !(200..300).contains(&response.status) {
            bail!(
                "apply {kind} {name}: {} {}",
                response.status,
                response.text()
            );
        }
        Ok(format!("{kind} {name} applied"))
    }

    /// The plural resource name of `kind` in `api_version`, and whether it
    /// is namespaced.
    fn resource_of(&self, api_version: &str, kind: &str) -> anyhow::Result<(String, bool)> {
        let path = if api_version.contains('/') {
            format!("/apis/{api_version}")
        } else {
            format!("/api/{api_version}")
        };
        let list = self
            .get(&path)?
            .with_context(|| format!("the API server serves no {api_version}"))?;
        list["resources"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["kind"] == kind && !r["name"].as_str().unwrap_or("/").contains('/'))
            .map(|r| {
                (
                    r["name"].as_str().unwrap_or_default().to_owned(),
                    r["namespaced"].as_bool().unwrap_or(true),
                )
            })
            .with_context(|| format!("{api_version} has no kind {kind}"))
    }

    /// Whether the node's `Ready` condition is `True`.
    pub fn node_ready(&self, node: &str) -> anyhow::Result<bool> {
        let Some(node) = self.get(&format!("/api/v1/nodes/{node}"))? else {
            return Ok(false);
        };
        Ok(node["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True"))
    }
}

use serde::Deserialize as _;

/// Status and body of a raw HTTP/1.1 answer (Content-Length, chunked, or
/// up to the end of the connection).
fn parse_response(raw: &[u8]) -> anyhow::Result<Response> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("an answer without a header end")?;
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.lines();
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("bad status line {status_line:?}"))?;
    let header = |name: &str| {
        head.lines().skip(1).find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim()
                .eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
    };
    let rest = &raw[end + 4..];
    let body = if header("Transfer-Encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        dechunk(rest)?
    } else if let Some(length) = header("Content-Length") {
        let length: usize = length.parse()?;
        if rest.len() < length {
            bail!("the answer ended after {} of {length} bytes", rest.len());
        }
        rest[..length].to_vec()
    } else {
        rest.to_vec()
    };
    Ok(Response { status, body })
}

fn dechunk(mut rest: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .context("a chunk without its size line")?;
        let size_text = String::from_utf8_lossy(&rest[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
            .with_context(|| format!("bad chunk size {size_text:?}"))?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Ok(body);
        }
        if rest.len() < size + 2 {
            bail!("a chunk cut short");
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_read_by_length_by_chunks_and_to_the_end() {
        let sized = parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nokEXTRA").unwrap();
        assert_eq!((sized.status, sized.text().as_str()), (200, "ok"));
        let chunked = parse_response(
            b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!((chunked.status, chunked.text().as_str()), (404, "abcde"));
        let closed = parse_response(b"HTTP/1.0 201 Created\r\n\r\nall of it").unwrap();
        assert_eq!(closed.text(), "all of it");
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nshort").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
    }
}
