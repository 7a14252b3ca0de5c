//! `cargo xtask images`: the operator and agent container images, built
//! offline from this repository alone.
//!
//! The binaries are built once, statically linked for musl (release, paths
//! remapped so the checkout's location does not leak into them), and put on
//! an empty base by [`oci`], which writes deterministic `oci-archive`s under
//! `target/images/`. Images are tagged with the chart's `appVersion` under
//! the repositories its values name, then loaded into podman's store.

pub mod oci;
pub mod podman;
pub mod verify;

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, bail, ensure};
use clap::Args;

use crate::{ebpf, vm::ldd, workspace};
use oci::{Image, Layer, Node, RunConfig, Timestamp};

/// The target the image binaries are built for: static, no libc needed.
pub const MUSL_TARGET: &str = "x86_64-unknown-linux-musl";
/// Where the archives are written, relative to the workspace.
pub const IMAGE_DIR: &str = "target/images";
/// The chart whose `appVersion` and image repositories the images follow.
pub const CHART: &str = "charts/flatnet";
/// The image label naming the commit the image was built from.
pub const REVISION_LABEL: &str = "org.opencontainers.image.revision";
/// The operator's user: the chart's `runAsUser`/`runAsGroup`.
const OPERATOR_USER: &str = "65532:65532";
/// Debugging tools carried by the agent image, with the libraries they load.
const AGENT_TOOLS: &[&str] = &["/usr/sbin/bpftool", "/usr/bin/ip"];
/// The CA bundle of Debian's ca-certificates: the Kubernetes client (rustls
/// with the system's roots) refuses to start without one, even when the
/// cluster's own CA is given.
const CA_BUNDLE: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Options of `cargo xtask images`.
#[derive(Args, Default, Clone)]
pub struct ImagesArgs {
    /// Use the release binaries already built instead of building them.
    #[arg(long)]
    pub skip_build: bool,
    /// Only write the archives; do not load them into podman.
    #[arg(long)]
    pub no_load: bool,
    /// Then run the chart's agent and operator containers from the images
    /// under podman and check they work (root; runs the chart check first).
    #[arg(long, conflicts_with = "no_load")]
    pub verify: bool,
}

/// The flatnet components shipped as images.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    /// The cluster operator (Deployment).
    Operator,
    /// The node agent and flatnet-cni (DaemonSet).
    Agent,
}

impl Component {
    /// Both, in the order they are built.
    pub const ALL: [Component; 2] = [Component::Operator, Component::Agent];

    /// Name of the component in the chart's values (`operator`, `agent`).
    pub fn key(self) -> &'static str {
        match self {
            Component::Operator => "operator",
            Component::Agent => "agent",
        }
    }

    /// What the image runs when given no command: what the chart runs.
    pub fn default_command(self) -> &'static [&'static str] {
        match self {
            Component::Operator => &["flatnet-operator"],
            Component::Agent => &["flatnet-agent", "run"],
        }
    }

    /// The executables the image carries, in `/usr/local/bin`.
    pub fn binaries(self) -> &'static [&'static str] {
        match self {
            Component::Operator => &["flatnet-operator"],
            Component::Agent => &["flatnet-agent", "flatnet-cni"],
        }
    }
}

/// What the chart says about the images: their version and repositories.
#[derive(Debug, Clone)]
pub struct ChartImages {
    /// The chart's `appVersion`: the images' tag.
    pub app_version: String,
    repositories: BTreeMap<&'static str, String>,
}

impl ChartImages {
    /// Reads `charts/flatnet`'s Chart.yaml and values.yaml.
    pub fn read(root: &Path) -> anyhow::Result<Self> {
        let yaml = |file: &str| -> anyhow::Result<serde_yaml::Value> {
            let path = root.join(CHART).join(file);
            let text =
                fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
            serde_yaml::from_str(&text).with_context(|| format!("parse {}", path.display()))
        };
        let chart = yaml("Chart.yaml")?;
        let values = yaml("values.yaml")?;
        let app_version = chart["appVersion"]
            .as_str()
            .context("Chart.yaml has no appVersion")?
            .to_owned();
        let mut repositories = BTreeMap::new();
        for component in Component::ALL {
            let repository = values[component.key()]["image"]["repository"]
                .as_str()
                .with_context(|| {
                    format!("values.yaml has no {}.image.repository", component.key())
                })?;
            repositories.insert(component.key(), repository.to_owned());
        }
        Ok(Self {
            app_version,
            repositories,
        })
    }

    /// `flatnet/flatnet-agent:0.1.0`, as the chart's default values render it.
    pub fn reference(&self, component: Component) -> String {
        format!(
            "{}:{}",
            self.repositories[component.key()],
            self.app_version
        )
    }

    /// The fully qualified name podman and containerd store the image under.
    pub fn qualified_reference(&self, component: Component) -> String {
        qualify(&self.reference(component))
    }

    /// `target/images/flatnet-agent-0.1.0.oci.tar`.
    pub fn archive(&self, root: &Path, component: Component) -> PathBuf {
        root.join(IMAGE_DIR).join(format!(
            "flatnet-{}-{}.oci.tar",
            component.key(),
            self.app_version
        ))
    }
}

/// Docker Hub's canonical form of a short reference: what a kubelet pulls
/// for `flatnet/flatnet-agent:0.1.0`.
pub fn qualify(reference: &str) -> String {
    let first = reference.split('/').next().unwrap_or_default();
    let has_registry = reference.contains('/')
        && (first.contains('.') || first.contains(':') || first == "localhost");
    match (has_registry, reference.contains('/')) {
        (true, _) => reference.to_owned(),
        (false, true) => format!("docker.io/{reference}"),
        (false, false) => format!("docker.io/library/{reference}"),
    }
}

/// Builds both images, writes their archives and loads them into podman.
pub fn run(args: &ImagesArgs) -> anyhow::Result<()> {
    let root = workspace::root();
    let chart = ChartImages::read(&root)?;
    let crate_version = env!("CARGO_PKG_VERSION");
    ensure!(
        chart.app_version == crate_version,
        "{CHART}/Chart.yaml appVersion {} differs from the workspace version {crate_version}: \
         the image tag must be the version the binaries report",
        chart.app_version
    );
    if !args.skip_build {
        build_binaries()?;
        ebpf::same_from_another_checkout()?;
    }
    no_machine_paths(&binary_dir(&root))?;
    let source = Source::of(&root)?;
    fs::create_dir_all(root.join(IMAGE_DIR))?;
    let mut built = Vec::new();
    for component in Component::ALL {
        let image = image(&root, &chart, component, &source)?;
        let written = oci::write(&image)?;
        let archive = chart.archive(&root, component);
        fs::write(&archive, &written.archive)
            .with_context(|| format!("write {}", archive.display()))?;
        println!(
            "{}: {} ({} MB, {} MB unpacked) {}",
            image.reference,
            written.manifest_digest,
            mb(written.archive.len() as u64),
            mb(written.unpacked_size),
            archive.display()
        );
        built.push((archive, image.reference));
    }
    if !args.no_load {
        for (archive, reference) in &built {
            load(archive, reference)?;
        }
    }
    if args.verify {
        crate::charts::check(&binary_dir(&root))?;
        verify::run()?;
    }
    Ok(())
}

fn mb(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / 1_000_000.0)
}

/// Release binaries for [`MUSL_TARGET`], with the eBPF object they embed.
pub fn build_binaries() -> anyhow::Result<()> {
    ebpf::build()?;
    let rustflags = workspace::remap_path_flags()?;
    let mut cargo = workspace::cargo(None);
    cargo
        .args(["build", "--release", "--locked", "--target", MUSL_TARGET])
        .args(["-p", "flatnet-agent", "-p", "flatnet-operator", "--bins"])
        .env(
            "CARGO_TARGET_X86_64_UNKNOWN_LINUX_MUSL_RUSTFLAGS",
            rustflags,
        );
    workspace::run("release binaries (musl, static)", &mut cargo).map_err(|e| {
        e.context(format!(
            "the images need `rustup target add {MUSL_TARGET}` (`bash .ci/provision` adds it)"
        ))
    })
}

/// The binaries of `dir` the images carry name none of this machine's
/// folders ([`workspace::machine_paths`]): such a path would make the
/// images of two checkouts of one commit differ.
fn no_machine_paths(dir: &Path) -> anyhow::Result<()> {
    let folders = workspace::machine_paths()?;
    let binaries = Component::ALL.iter().flat_map(|c| c.binaries());
    for binary in binaries {
        let path = dir.join(binary);
        let bytes = fs::read(&path).with_context(|| format!("read {}", path.display()))?;
        for (folder, _) in &folders {
            let needle = folder.as_os_str().as_encoded_bytes();
            let found = bytes.windows(needle.len()).filter(|w| *w == needle).count();
            ensure!(
                found == 0,
                "{} names {} {found} times: a build path was not remapped \
                 (workspace::remap_path_flags), so another checkout would build other bytes",
                path.display(),
                folder.display()
            );
        }
    }
    Ok(())
}

/// Directory of the release binaries the images carry.
pub fn binary_dir(root: &Path) -> PathBuf {
    root.join("target").join(MUSL_TARGET).join("release")
}

/// The commit the images are built from.
struct Source {
    revision: String,
    time: Timestamp,
}

impl Source {
    fn of(root: &Path) -> anyhow::Result<Self> {
        let output = Command::new("git")
            .args(["log", "-1", "--format=%H %ct"])
            .current_dir(root)
            .output()
            .context("cannot run git")?;
        ensure!(output.status.success(), "git log failed: {output:?}");
        let text = String::from_utf8(output.stdout)?;
        let (revision, time) = text
            .trim()
            .split_once(' ')
            .with_context(|| format!("unexpected git log output {text:?}"))?;
        Ok(Self {
            revision: revision.to_owned(),
            time: Timestamp(time.parse()?),
        })
    }
}

/// The image of `component`: its binaries on an empty base.
fn image(
    root: &Path,
    chart: &ChartImages,
    component: Component,
    source: &Source,
) -> anyhow::Result<Image> {
    let mut base = Layer::new("CA certificates (Debian ca-certificates)");
    let bundle = fs::read(CA_BUNDLE).with_context(|| {
        format!("read {CA_BUNDLE} (`bash .ci/provision` installs ca-certificates)")
    })?;
    base.add(CA_BUNDLE, Node::File(0o644, bundle));
    let mut layers = vec![base];
    if component == Component::Agent {
        layers.push(tools_layer()?);
    }
    let mut flatnet = Layer::new("flatnet binaries");
    flatnet.add("tmp", Node::Dir(0o1777));
    let bin_dir = binary_dir(root);
    for binary in component.binaries() {
        let path = bin_dir.join(binary);
        ensure!(
            path.is_file(),
            "{} is missing (build it with `cargo xtask images`)",
            path.display()
        );
        ensure!(
            ldd::shared_libraries(&path)?.is_empty(),
            "{} is dynamically linked; the images need static binaries",
            path.display()
        );
        flatnet.add(
            &format!("usr/local/bin/{binary}"),
            Node::File(0o755, stripped(root, &path)?),
        );
    }
    layers.push(flatnet);
    let (user, path) = match component {
        Component::Operator => (OPERATOR_USER, "/usr/local/bin"),
        Component::Agent => ("0:0", "/usr/local/bin:/usr/sbin:/usr/bin"),
    };
    let title = format!("flatnet-{}", component.key());
    let labels = BTreeMap::from([
        ("org.opencontainers.image.title".into(), title.clone()),
        (
            "org.opencontainers.image.version".into(),
            chart.app_version.clone(),
        ),
        (REVISION_LABEL.into(), source.revision.clone()),
        (
            "org.opencontainers.image.source".into(),
            env!("CARGO_PKG_REPOSITORY").into(),
        ),
        (
            "org.opencontainers.image.licenses".into(),
            env!("CARGO_PKG_LICENSE").into(),
        ),
    ]);
    Ok(Image {
        reference: chart.qualified_reference(component),
        created: source.time,
        config: RunConfig {
            user: user.into(),
            env: vec![format!("PATH={path}")],
            cmd: component
                .default_command()
                .iter()
                .map(|w| (*w).to_owned())
                .collect(),
            labels,
        },
        layers,
    })
}

/// The binary without its symbol table (a fifth of its size), as `strip`
/// writes it; the build's own copy keeps its symbols.
fn stripped(root: &Path, binary: &Path) -> anyhow::Result<Vec<u8>> {
    let dir = root.join(IMAGE_DIR).join("stripped");
    fs::create_dir_all(&dir)?;
    let out = dir.join(binary.file_name().context("a binary has a name")?);
    workspace::run(
        "strip",
        Command::new("strip")
            .arg("--strip-all")
            .arg("-o")
            .arg(&out)
            .arg(binary),
    )?;
    fs::read(&out).with_context(|| format!("read {}", out.display()))
}

/// `bpftool` and `ip` with the shared libraries they load, at the paths
/// the dynamic loader looks in.
fn tools_layer() -> anyhow::Result<Layer> {
    let mut layer = Layer::new("debugging tools: bpftool, ip and their libraries");
    for tool in AGENT_TOOLS {
        let tool = Path::new(tool);
        let mut files = vec![tool.to_path_buf()];
        files.extend(ldd::shared_libraries(tool)?);
        for file in files {
            // Read through symlinks (the loader is one): the file itself lands at the path.
            let bytes = fs::read(&file).with_context(|| {
                format!(
                    "read {} (`bash .ci/provision` installs bpftool and iproute2)",
                    file.display()
                )
            })?;
            layer.add(&file.to_string_lossy(), Node::File(0o755, bytes));
        }
    }
    Ok(layer)
}

/// `podman load` of the archive, checked to give the expected name.
fn load(archive: &Path, reference: &str) -> anyhow::Result<()> {
    let output = Command::new("podman")
        .arg("load")
        .arg("--input")
        .arg(archive)
        .output()
        .context("cannot run podman (`bash .ci/provision` installs it)")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    if !output.status.success() {
        bail!(
            "podman load {} failed: {stdout}{}",
            archive.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    ensure!(
        stdout.contains(reference),
        "podman load {} did not load {reference}: {stdout}",
        archive.display(),
    );
    println!("loaded {reference} into podman");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_references_are_qualified_like_a_kubelet_does() {
        assert_eq!(
            qualify("flatnet/flatnet-agent:0.1.0"),
            "docker.io/flatnet/flatnet-agent:0.1.0"
        );
        assert_eq!(qualify("busybox:1"), "docker.io/library/busybox:1");
        assert_eq!(
            qualify("registry.example.com/flatnet/flatnet-agent:0.1.0"),
            "registry.example.com/flatnet/flatnet-agent:0.1.0"
        );
        assert_eq!(qualify("localhost/x:1"), "localhost/x:1");
    }

    #[test]
    fn the_chart_names_both_images_and_the_workspace_version() {
        let chart = ChartImages::read(&workspace::root()).unwrap();
        assert_eq!(chart.app_version, env!("CARGO_PKG_VERSION"));
        assert_eq!(
            chart.reference(Component::Agent),
            format!("flatnet/flatnet-agent:{}", chart.app_version)
        );
        assert_eq!(
            chart.reference(Component::Operator),
            format!("flatnet/flatnet-operator:{}", chart.app_version)
        );
    }
}
