//! Writing OCI image archives deterministically: the same files give the
//! same layer, config and manifest digests, byte for byte.
//!
//! Every tar entry (layers and the archive itself) is sorted by path, owned
//! by 0:0 with no user or group names, and stamped with one fixed time; the
//! gzip header carries no time or file name. The result is an `oci-archive`
//! (a tar of an OCI image layout) that `podman load` and `skopeo` read.

use std::{collections::BTreeMap, io::Write};

use flate2::{Compression, GzBuilder};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG_TYPE: &str = "application/vnd.oci.image.config.v1+json";
const LAYER_TYPE: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
/// The annotation `podman load` names the image by.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// What one path in a layer is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// A directory with its mode.
    Dir(u32),
    /// A regular file: mode and contents.
    File(u32, Vec<u8>),
    /// A symbolic link to the path given (one copy of a multi-call binary
    /// serves many command names).
    Symlink(String),
}

/// One layer: paths relative to `/` (no leading slash) and what they are.
/// Parent directories are added (mode 0755) when not given.
#[derive(Debug, Clone, Default)]
pub struct Layer {
    /// Why the layer exists, kept in the image history.
    pub comment: String,
    /// Sorted by path, which also fixes the tar order.
    pub nodes: BTreeMap<String, Node>,
}

impl Layer {
    /// An empty layer with its history comment.
    pub fn new(comment: &str) -> Self {
        Self {
            comment: comment.to_owned(),
            nodes: BTreeMap::new(),
        }
    }

    /// Adds `node` at `path` and any missing parent directory.
    pub fn add(&mut self, path: &str, node: Node) {
        let path = path.trim_start_matches('/');
        let mut parent = std::path::Path::new(path).parent();
        while let Some(dir) = parent.filter(|d| !d.as_os_str().is_empty()) {
            self.nodes
                .entry(dir.to_string_lossy().into_owned())
                .or_insert(Node::Dir(0o755));
            parent = dir.parent();
        }
        self.nodes.insert(path.to_owned(), node);
    }
}

/// What runs and how: the parts of the OCI image config flatnet sets.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// `uid:gid` the container runs as.
    pub user: String,
    /// `KEY=value` pairs.
    pub env: Vec<String>,
    /// Command run when the container is given none.
    pub cmd: Vec<String>,
    /// Image labels (the OCI annotation keys).
    pub labels: BTreeMap<String, String>,
}

/// A complete image.
#[derive(Debug, Clone)]
pub struct Image {
    /// Full reference, `docker.io/flatnet/flatnet-agent:0.1.0`.
    pub reference: String,
    /// RFC 3339 time stamped on the config, the history and every file.
    pub created: Timestamp,
    /// How it runs.
    pub config: RunConfig,
    /// Layers, lowest first.
    pub layers: Vec<Layer>,
}

/// A fixed point in time: seconds since the epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// RFC 3339 in UTC, as the OCI config wants it.
    pub fn rfc3339(self) -> String {
        let secs = i64::try_from(self.0).expect("a time before year 292277026596");
        time::OffsetDateTime::from_unix_timestamp(secs)
            .ok()
            .and_then(|t| {
                t.format(&time::format_description::well_known::Rfc3339)
                    .ok()
            })
            .expect("a time within years 1970-9999")
    }
}

/// A content-addressed blob of the layout.
struct Blob {
    digest: String,
    bytes: Vec<u8>,
}

impl Blob {
    fn new(bytes: Vec<u8>) -> Self {
        Self {
            digest: sha256(&bytes),
            bytes,
        }
    }

    fn descriptor(&self, media_type: &str) -> Value {
        json!({"mediaType": media_type, "digest": self.digest, "size": self.bytes.len()})
    }
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(bytes))
}

/// What writing an image produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The `oci-archive` bytes.
    pub archive: Vec<u8>,
    /// Digest of the manifest (what a registry would report).
    pub manifest_digest: String,
    /// Digest of the config (podman's image ID).
    pub config_digest: String,
    /// Sum of the uncompressed layer sizes.
    pub unpacked_size: u64,
}

/// Writes `image` as an `oci-archive`.
pub fn write(image: &Image) -> std::io::Result<Written> {
    let mtime = image.created.0;
    let mut layers = Vec::new();
    let mut diff_ids = Vec::new();
    let mut unpacked_size = 0;
    for layer in &image.layers {
        let tar = layer_tar(layer, mtime)?;
        unpacked_size += tar.len() as u64;
        diff_ids.push(sha256(&tar));
        layers.push(Blob::new(gzip(&tar)?));
    }
    let created = image.created.rfc3339();
    let config = json!({
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "User": image.config.user,
            "Env": image.config.env,
            "Cmd": image.config.cmd,
            "WorkingDir": "/",
            "Labels": image.config.labels,
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": image.layers.iter().map(|l| json!({
            "created": created,
            "created_by": "cargo xtask images",
            "comment": l.comment,
        })).collect::<Vec<_>>(),
    });
    let config = Blob::new(serde_json::to_vec(&config).expect("JSON"));
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": config.descriptor(CONFIG_TYPE),
        "layers": layers.iter().map(|l| l.descriptor(LAYER_TYPE)).collect::<Vec<_>>(),
        "annotations": image.config.labels,
    });
    let manifest = Blob::new(serde_json::to_vec(&manifest).expect("JSON"));
    let mut descriptor = manifest.descriptor(MANIFEST_TYPE);
    descriptor["annotations"] = json!({ REF_NAME: image.reference });
    let index = json!({"schemaVersion": 2, "manifests": [descriptor]});

    let mut files = BTreeMap::new();
    files.insert("blobs".to_owned(), Node::Dir(0o755));
    files.insert("blobs/sha256".to_owned(), Node::Dir(0o755));
    for blob in layers.iter().chain([&config, &manifest]) {
        let hex = blob.digest.trim_start_matches("sha256:");
        files.insert(
            format!("blobs/sha256/{hex}"),
            Node::File(0o644, blob.bytes.clone()),
        );
    }
    files.insert(
        "index.json".to_owned(),
        Node::File(0o644, serde_json::to_vec(&index).expect("JSON")),
    );
    files.insert(
        "oci-layout".to_owned(),
        Node::File(0o644, br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec()),
    );
    Ok(Written {
        archive: tar_of(&files, mtime)?,
        manifest_digest: manifest.digest,
        config_digest: config.digest,
        unpacked_size,
    })
}

/// What an `oci-archive` says about its image: the manifest digest its
/// index names and the manifest's annotations (the image labels).
pub fn describe(archive: &[u8]) -> std::io::Result<(String, BTreeMap<String, String>)> {
    let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidData, why);
    let mut files = BTreeMap::new();
    for entry in tar::Archive::new(archive).entries()? {
        let mut entry = entry?;
        let path = entry.path()?.display().to_string();
        let mut bytes = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut bytes)?;
        files.insert(path, bytes);
    }
    let json = |path: &str| -> std::io::Result<Value> {
        let bytes = files
            .get(path)
            .ok_or_else(|| invalid(format!("no {path} in the archive")))?;
        Ok(serde_json::from_slice(bytes)?)
    };
    let index = json("index.json")?;
    let digest = index["manifests"][0]["digest"]
        .as_str()
        .ok_or_else(|| invalid("index.json names no manifest".into()))?
        .to_owned();
    let manifest = json(&format!(
        "blobs/sha256/{}",
        digest.trim_start_matches("sha256:")
    ))?;
    let annotations = serde_json::from_value(manifest["annotations"].clone()).unwrap_or_default();
    Ok((digest, annotations))
}

fn layer_tar(layer: &Layer, mtime: u64) -> std::io::Result<Vec<u8>> {
    tar_of(&layer.nodes, mtime)
}

/// A tar of `nodes` in path order, every entry owned by 0:0 at `mtime`.
fn tar_of(nodes: &BTreeMap<String, Node>, mtime: u64) -> std::io::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    for (path, node) in nodes {
        let mut header = tar::Header::new_ustar();
        header.set_mtime(mtime);
        header.set_uid(0);
        header.set_gid(0);
        match node {
            Node::Dir(mode) => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(*mode);
                header.set_size(0);
                builder.append_data(&mut header, format!("{path}/"), std::io::empty())?;
            }
            Node::File(mode, bytes) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(*mode);
                header.set_size(bytes.len() as u64);
                builder.append_data(&mut header, path, bytes.as_slice())?;
            }
            Node::Symlink(target) => {
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_mode(0o777);
                header.set_size(0);
                builder.append_link(&mut header, path, target)?;
            }
        }
    }
    builder.into_inner()
}

/// gzip without a time or name in its header, so equal input gives equal output.
fn gzip(bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut encoder = GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), Compression::best());
    encoder.write_all(bytes)?;
    encoder.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(binary: &[u8]) -> Image {
        let mut layer = Layer::new("binaries");
        layer.add("usr/local/bin/tool", Node::File(0o755, binary.to_vec()));
        layer.add("tmp", Node::Dir(0o1777));
        layer.add("usr/bin/other", Node::File(0o755, b"other".to_vec()));
        layer.add("usr/bin/alias", Node::Symlink("other".into()));
        Image {
            reference: "docker.io/flatnet/test:0.1.0".into(),
            created: Timestamp(1_700_000_000),
            config: RunConfig {
                user: "65532:65532".into(),
                env: vec!["PATH=/usr/local/bin".into()],
                cmd: vec!["tool".into()],
                labels: BTreeMap::from([("a".into(), "b".into())]),
            },
            layers: vec![layer],
        }
    }

    fn entries(tar: &[u8]) -> Vec<(String, u64, u64)> {
        tar::Archive::new(tar)
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let h = e.header();
                (
                    e.path().unwrap().display().to_string(),
                    h.mtime().unwrap(),
                    h.uid().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn the_same_files_give_the_same_digests_and_bytes() {
        let a = write(&image(b"one")).unwrap();
        let b = write(&image(b"one")).unwrap();
        assert_eq!(a, b);
        let c = write(&image(b"two")).unwrap();
        assert_ne!(a.manifest_digest, c.manifest_digest);
        assert_ne!(a.config_digest, c.config_digest);
    }

    #[test]
    fn layers_hold_sorted_entries_with_parents_at_the_fixed_time() {
        let layer = layer_tar(&image(b"x").layers[0], 42).unwrap();
        let listed = entries(&layer);
        let paths: Vec<&str> = listed.iter().map(|(p, _, _)| p.as_str()).collect();
        assert_eq!(
            paths,
            [
                "tmp/",
                "usr/",
                "usr/bin/",
                "usr/bin/alias",
                "usr/bin/other",
                "usr/local/",
                "usr/local/bin/",
                "usr/local/bin/tool"
            ]
        );
        assert!(
            listed
                .iter()
                .all(|(_, mtime, uid)| *mtime == 42 && *uid == 0)
        );
        let mut archive = tar::Archive::new(layer.as_slice());
        let link = archive
            .entries()
            .unwrap()
            .map(Result::unwrap)
            .find(|e| e.path().unwrap().ends_with("alias"))
            .unwrap();
        assert_eq!(link.header().entry_type(), tar::EntryType::Symlink);
        assert_eq!(
            link.link_name().unwrap().unwrap().to_str(),
            Some("other"),
            "a symlink names its target"
        );
    }

    #[test]
    fn the_archive_is_an_oci_layout_whose_blobs_match_their_digests() {
        let written = write(&image(b"bin")).unwrap();
        let mut archive = tar::Archive::new(written.archive.as_slice());
        let mut files = BTreeMap::new();
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            let path = entry.path().unwrap().display().to_string();
            let mut bytes = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut bytes).unwrap();
            files.insert(path, bytes);
        }
        for (path, bytes) in &files {
            if let Some(hex) = path.strip_prefix("blobs/sha256/").filter(|h| !h.is_empty()) {
                assert_eq!(sha256(bytes), format!("sha256:{hex}"), "{path}");
            }
        }
        let index: Value = serde_json::from_slice(&files["index.json"]).unwrap();
        let manifest = &index["manifests"][0];
        assert_eq!(manifest["digest"], written.manifest_digest);
        let (digest, annotations) = describe(&written.archive).unwrap();
        assert_eq!(digest, written.manifest_digest);
        assert_eq!(annotations["a"], "b");
        assert_eq!(
            manifest["annotations"][REF_NAME],
            "docker.io/flatnet/test:0.1.0"
        );
        let hex = written.manifest_digest.trim_start_matches("sha256:");
        let manifest: Value =
            serde_json::from_slice(&files[&format!("blobs/sha256/{hex}")]).unwrap();
        assert_eq!(manifest["config"]["digest"], written.config_digest);
        let hex = written.config_digest.trim_start_matches("sha256:");
        let config: Value = serde_json::from_slice(&files[&format!("blobs/sha256/{hex}")]).unwrap();
        assert_eq!(config["config"]["User"], "65532:65532");
        assert_eq!(config["created"], "2023-11-14T22:13:20Z");
        assert_eq!(config["rootfs"]["diff_ids"].as_array().unwrap().len(), 1);
    }

    #[test]
    fn rfc3339_of_known_instants() {
        assert_eq!(Timestamp(0).rfc3339(), "1970-01-01T00:00:00Z");
        assert_eq!(Timestamp(951_782_400).rfc3339(), "2000-02-29T00:00:00Z");
        assert_eq!(Timestamp(1_700_000_000).rfc3339(), "2023-11-14T22:13:20Z");
    }
}
