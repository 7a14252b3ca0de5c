//! The cluster's images, built offline from Debian's busybox-static with
//! the image builder of `cargo xtask images`, imported into containerd.

use std::{collections::BTreeMap, fs, path::Path, process::Command};

use anyhow::{Context, bail};

use super::CONTAINERD_SOCKET;
use crate::images::oci::{self, Image, Layer, Node, RunConfig, Timestamp};

/// The sandbox ("pause") image: containerd's `sandbox_image`.
pub const PAUSE_IMAGE: &str = "localhost/flatnet-cluster/pause:1";
/// The test image: busybox with `sh`, `ping`, `nc`, `ip`, `arping`,
/// `httpd`, `sleep` and the rest of its applets; runs `sleep` forever by
/// default. Pods use it with `imagePullPolicy: IfNotPresent` or `Never`.
pub const TEST_IMAGE: &str = "localhost/flatnet-cluster/test:1";

/// Debian's busybox-static.
const BUSYBOX: &str = "/bin/busybox";
/// A fixed time: the same busybox gives the same image digests.
const CREATED: Timestamp = Timestamp(1_700_000_000);
/// The containerd namespace the kubelet's images live in.
const K8S_NAMESPACE: &str = "k8s.io";

/// The applets the test image links, as its users name them.
const TEST_APPLETS: &[&str] = &[
    "sh",
    "ash",
    "ping",
    "ping6",
    "nc",
    "ip",
    "arping",
    "httpd",
    "sleep",
    "cat",
    "echo",
    "ls",
    "ps",
    "kill",
    "wget",
    "ifconfig",
    "route",
    "hostname",
    "sysctl",
    "tc",
    "true",
    "false",
    "timeout",
    "grep",
    "sed",
    "awk",
    "head",
    "tail",
    "wc",
    "env",
    "id",
    "mkdir",
    "rm",
    "date",
    "uname",
    "traceroute",
    "nslookup",
    "netstat",
    "ipneigh",
];

/// Waits for SIGTERM (kubelet stopping the sandbox) as PID 1 of the pod,
/// which ignores signals it has no handler for; `wait` returns at once
/// when the trapped signal comes.
const PAUSE_SCRIPT: &str = "trap 'exit 0' TERM INT; while :; do sleep 86400 & wait $!; done";

/// Fails unless the static busybox the images need is there.
pub fn check_busybox() -> anyhow::Result<()> {
    let output = Command::new("file").arg("-L").arg(BUSYBOX).output();
    let is_static = match output {
        Ok(out) => String::from_utf8_lossy(&out.stdout).contains("statically linked"),
        // No `file`: the package check below decides.
        Err(_) => true,
    };
    if !Path::new(BUSYBOX).is_file() || !is_static {
        bail!("{BUSYBOX} is not a static busybox: install busybox-static (`bash .ci/provision`)");
    }
    Ok(())
}

fn busybox_layer(applets: &[&str]) -> anyhow::Result<Layer> {
    let busybox = fs::read(BUSYBOX).with_context(|| format!("read {BUSYBOX}"))?;
    let mut layer = Layer::new("busybox (Debian busybox-static)");
    layer.add("bin/busybox", Node::File(0o755, busybox));
    for applet in applets {
        layer.add(&format!("bin/{applet}"), Node::Symlink("busybox".into()));
    }
    layer.add("tmp", Node::Dir(0o1777));
    layer.add("var/www", Node::Dir(0o755));
    Ok(layer)
}

fn image(reference: &str, layer: Layer, cmd: &[&str]) -> Image {
    Image {
        reference: reference.to_owned(),
        created: CREATED,
        config: RunConfig {
            user: "0:0".into(),
            env: vec!["PATH=/bin".into()],
            cmd: cmd.iter().map(|s| (*s).to_owned()).collect(),
            labels: BTreeMap::from([(
                "org.opencontainers.image.title".into(),
                reference.to_owned(),
            )]),
        },
        layers: vec![layer],
    }
}

/// The pause and test images.
pub fn images() -> anyhow::Result<Vec<Image>> {
    Ok(vec![
        image(
            PAUSE_IMAGE,
            busybox_layer(&["sh", "sleep"])?,
            &["/bin/sh", "-c", PAUSE_SCRIPT],
        ),
        image(
            TEST_IMAGE,
            busybox_layer(TEST_APPLETS)?,
            &["/bin/sleep", "2147483647"],
        ),
    ])
}

/// Imports the OCI archive `file` into the cluster's containerd (the
/// namespace the kubelet uses) and checks it now lists `reference`.
pub fn import(file: &Path, reference: &str) -> anyhow::Result<()> {
    let file_arg = file.display().to_string();
    let ctr = |args: &[&str]| {
        let mut full = vec!["--address", CONTAINERD_SOCKET, "--namespace", K8S_NAMESPACE];
        full.extend_from_slice(args);
        crate::lab::process::run("ctr", &full)
    };
    ctr(&["images", "import", &file_arg])?;
    let listed = ctr(&["images", "list", "--quiet"])?;
    if !listed.lines().any(|line| line == reference) {
        bail!(
            "ctr imported {} but lists no {reference}: {listed}",
            file.display()
        );
    }
    Ok(())
}

/// Writes each image's archive into `dir` and imports it (one archive per
/// `ctr import`, as ctr 1.6 takes them).
pub fn build_and_import(dir: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(dir)?;
    for image in images()? {
        let written = oci::write(&image)?;
        let file = dir.join(format!(
            "{}.oci.tar",
            image
                .reference
                .rsplit('/')
                .next()
                .unwrap_or("image")
                .replace(':', "-")
        ));
        fs::write(&file, &written.archive)?;
        import(&file, &image.reference)?;
        println!("    {} {}", image.reference, written.manifest_digest);
    }
    Ok(())
}
