//! Running a container of the rendered chart under podman as a kubelet
//! would: the same image, command, environment, user, capabilities,
//! read-only root, host network and host paths, read from the chart's
//! default render rather than restated here.

use std::{collections::BTreeMap, fs, path::Path};

use anyhow::{Context, bail};
use serde_json::Value;

/// Host paths of the chart that stay the host's own when its containers are
/// run here, as on a node: the runtime's named network namespaces, the
/// BPF filesystem and the host's procfs (the bpffs init container enters
/// the host's mount namespace through it). The others are mapped to
/// scratch directories.
const SHARED_HOST_PATHS: &[&str] = &["/run/netns", "/sys/fs/bpf", "/proc"];

/// Where a chart host path lies here: itself when shared (see
/// [`SHARED_HOST_PATHS`]), else the same path below `scratch`.
pub fn host_path_below(scratch: &Path) -> impl Fn(&str) -> String + Copy + '_ {
    move |path: &str| {
        if SHARED_HOST_PATHS.contains(&path) {
            path.to_owned()
        } else {
            scratch
                .join(path.trim_start_matches('/'))
                .display()
                .to_string()
        }
    }
}

/// Namespace the checks and the lab give the chart's pods.
pub const POD_NAMESPACE: &str = "cattle-flat-network";

/// What the kubelet fills into the agent's environment from the pod of
/// node `node` (the chart's `fieldRef`s).
pub fn agent_pod_env(node: &str) -> BTreeMap<&'static str, String> {
    BTreeMap::from([
        ("NODE_NAME", node.to_owned()),
        ("POD_NAMESPACE", POD_NAMESPACE.to_owned()),
        ("POD_NAME", format!("flatnet-agent-{node}")),
        // Any UID: only an owner reference in a cluster reads it.
        ("POD_UID", format!("flatnet-agent-{node}-uid")),
    ])
}

/// One container of a rendered workload, with what its pod adds.
#[derive(Debug, Clone)]
pub struct ChartContainer {
    /// Image reference as the chart renders it.
    pub image: String,
    /// `command` + `args` (empty: the image's own).
    pub command: Vec<String>,
    /// Literal environment variables, in the chart's order.
    pub env: Vec<(String, String)>,
    /// Variables the kubelet fills in (`valueFrom`); the runner supplies them.
    pub env_from_pod: Vec<String>,
    /// `uid:gid`, from the container's or the pod's security context.
    pub user: Option<String>,
    /// `readOnlyRootFilesystem`.
    pub read_only: bool,
    /// `allowPrivilegeEscalation: false`.
    pub no_new_privileges: bool,
    /// `privileged: true`.
    pub privileged: bool,
    /// Capabilities dropped and added.
    pub cap_drop: Vec<String>,
    pub cap_add: Vec<String>,
    /// `hostNetwork` of the pod.
    pub host_network: bool,
    /// Volume mounts: container path and where it comes from.
    pub mounts: Vec<Mount>,
}

/// A volume mount of the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Path in the container.
    pub path: String,
    /// What is mounted there.
    pub source: MountSource,
    /// The `mountPropagation` as podman's bind option: `rslave` for
    /// `HostToContainer`, `rshared` for `Bidirectional`, none otherwise.
    pub propagation: Option<&'static str>,
}

/// Where a mount comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountSource {
    /// A `hostPath` volume: the host path.
    Host(String),
    /// An `emptyDir`: scratch space (a tmpfs here).
    Scratch,
}

impl ChartContainer {
    /// The container `name` of the `kind` workload of `component` in the
    /// rendered objects at `rendered` (written by the chart check).
    pub fn read(rendered: &Path, kind: &str, component: &str, name: &str) -> anyhow::Result<Self> {
        let text = fs::read_to_string(rendered).with_context(|| {
            format!(
                "read {} (written by `cargo xtask charts`)",
                rendered.display()
            )
        })?;
        let objects: Vec<Value> = serde_json::from_str(&text)?;
        let workload = objects
            .iter()
            .find(|o| {
                o["kind"] == kind
                    && o["metadata"]["labels"]["app.kubernetes.io/component"] == component
            })
            .with_context(|| format!("no {kind} of the {component} in the render"))?;
        Self::of(&workload["spec"]["template"]["spec"], name)
    }

    /// The container `name` of a pod spec.
    pub fn of(pod: &Value, name: &str) -> anyhow::Result<Self> {
        let container = pod["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .chain(pod["initContainers"].as_array().into_iter().flatten())
            .find(|c| c["name"] == name)
            .with_context(|| format!("no container {name} in the pod"))?;
        let strings = |v: &Value| -> Vec<String> {
            v.as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        };
        let mut env = Vec::new();
        let mut env_from_pod = Vec::new();
        for var in container["env"].as_array().into_iter().flatten() {
            let name = var["name"]
                .as_str()
                .context("env without a name")?
                .to_owned();
            match var["value"].as_str() {
                Some(value) => env.push((name, value.to_owned())),
                None if var.get("valueFrom").is_some() => env_from_pod.push(name),
                None => env.push((name, String::new())),
            }
        }
        let ctx = &container["securityContext"];
        let pod_ctx = &pod["securityContext"];
        let id = |key: &str| ctx[key].as_u64().or_else(|| pod_ctx[key].as_u64());
        let user = match (id("runAsUser"), id("runAsGroup")) {
            (Some(uid), Some(gid)) => Some(format!("{uid}:{gid}")),
            (Some(uid), None) => Some(uid.to_string()),
            _ => None,
        };
        let volumes: BTreeMap<&str, &Value> = pod["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| Some((v["name"].as_str()?, v)))
            .collect();
        let mut mounts = Vec::new();
        for mount in container["volumeMounts"].as_array().into_iter().flatten() {
            let volume = mount["name"].as_str().unwrap_or_default();
            let Some(spec) = volumes.get(volume) else {
                bail!("mount of the undefined volume {volume}");
            };
            let source = if let Some(path) = spec["hostPath"]["path"].as_str() {
                MountSource::Host(path.to_owned())
            } else if spec.get("emptyDir").is_some() {
                MountSource::Scratch
            } else {
                bail!("volume {volume} is neither a hostPath nor an emptyDir");
            };
            mounts.push(Mount {
                path: mount["mountPath"].as_str().unwrap_or_default().to_owned(),
                source,
                propagation: match mount["mountPropagation"].as_str() {
                    Some("HostToContainer") => Some("rslave"),
                    Some("Bidirectional") => Some("rshared"),
                    _ => None,
                },
            });
        }
        Ok(Self {
            image: container["image"].as_str().unwrap_or_default().to_owned(),
            command: [strings(&container["command"]), strings(&container["args"])].concat(),
            env,
            env_from_pod,
            user,
            read_only: ctx["readOnlyRootFilesystem"] == true,
            no_new_privileges: ctx["allowPrivilegeEscalation"] == false,
            privileged: ctx["privileged"] == true,
            cap_drop: strings(&ctx["capabilities"]["drop"]),
            cap_add: strings(&ctx["capabilities"]["add"]),
            host_network: pod["hostNetwork"] == true,
            mounts,
        })
    }

    /// Creates the host directory of every `hostPath` mount, as the
    /// kubelet does for the chart's `DirectoryOrCreate` volumes.
    pub fn create_host_dirs(&self, host_path: impl Fn(&str) -> String) -> std::io::Result<()> {
        for mount in &self.mounts {
            if let MountSource::Host(path) = &mount.source {
                fs::create_dir_all(host_path(path))?;
            }
        }
        Ok(())
    }

    /// `podman run` options (the image and command follow) for a
    /// container named `name`. `host_path` maps each hostPath to the
    /// directory used for it here; `pod_env` gives the `valueFrom`
    /// variables; `overrides` replace literal variables of the chart.
    pub fn podman_args(
        &self,
        name: &str,
        host_path: impl Fn(&str) -> String,
        pod_env: &BTreeMap<&str, String>,
        overrides: &BTreeMap<&str, String>,
    ) -> anyhow::Result<Vec<String>> {
        let mut args: Vec<String> = ["run", "--detach", "--name", name]
            .map(str::to_owned)
            .to_vec();
        // These machines' default limits are higher than runc accepts.
        args.extend(
            [
                "--ulimit",
                "nofile=1024:1024",
                "--ulimit",
                "nproc=1024:1024",
            ]
            .map(str::to_owned),
        );
        if self.host_network {
            args.extend(["--network".into(), "host".into()]);
        }
        if let Some(user) = &self.user {
            args.extend(["--user".into(), user.clone()]);
        }
        if self.privileged {
            args.push("--privileged".into());
        }
        if self.read_only {
            args.push("--read-only".into());
        }
        if self.no_new_privileges {
            args.extend(["--security-opt".into(), "no-new-privileges".into()]);
        }
        for cap in &self.cap_drop {
            args.extend(["--cap-drop".into(), cap.clone()]);
        }
        for cap in &self.cap_add {
            args.extend(["--cap-add".into(), cap.clone()]);
        }
        for mount in &self.mounts {
            match &mount.source {
                MountSource::Host(path) => {
                    let propagation = mount
                        .propagation
                        .map(|p| format!(":{p}"))
                        .unwrap_or_default();
                    args.extend([
                        "--volume".into(),
                        format!("{}:{}{propagation}", host_path(path), mount.path),
                    ]);
                }
                MountSource::Scratch => args.extend(["--tmpfs".into(), mount.path.clone()]),
            }
        }
        for (name, value) in &self.env {
            let value = overrides.get(name.as_str()).unwrap_or(value);
            args.extend(["--env".into(), format!("{name}={value}")]);
        }
        for name in &self.env_from_pod {
            let value = pod_env
                .get(name.as_str())
                .with_context(|| format!("the kubelet would fill in {name}; give its value"))?;
            args.extend(["--env".into(), format!("{name}={value}")]);
        }
        Ok(args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Value {
        json!({
            "hostNetwork": true,
            "securityContext": {"runAsUser": 65532, "runAsGroup": 65532},
            "containers": [{
                "name": "agent",
                "image": "flatnet/flatnet-agent:0.1.0",
                "command": ["flatnet-agent", "run"],
                "env": [
                    {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {"name": "FLATNET_LOG", "value": "info"},
                    {"name": "FLATNET_BPF_PIN_ROOT", "value": "/sys/fs/bpf/flatnet"},
                ],
                "securityContext": {
                    "runAsUser": 0, "runAsGroup": 0,
                    "readOnlyRootFilesystem": true,
                    "allowPrivilegeEscalation": false,
                    "capabilities": {"drop": ["ALL"], "add": ["NET_ADMIN", "BPF"]},
                },
                "volumeMounts": [
                    {"name": "netns", "mountPath": "/run/netns", "mountPropagation": "HostToContainer"},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }],
            "volumes": [
                {"name": "netns", "hostPath": {"path": "/run/netns", "type": "DirectoryOrCreate"}},
                {"name": "tmp", "emptyDir": {}},
            ],
        })
    }

    #[test]
    fn a_rendered_container_becomes_the_equivalent_podman_run() {
        let container = ChartContainer::of(&pod(), "agent").unwrap();
        let args = container
            .podman_args(
                "x",
                |path| format!("/srv{path}"),
                &BTreeMap::from([("NODE_NAME", "node1".to_owned())]),
                &BTreeMap::from([("FLATNET_BPF_PIN_ROOT", "/sys/fs/bpf/t".to_owned())]),
            )
            .unwrap();
        let line = args.join(" ");
        for part in [
            "--network host",
            // The container's context wins over the pod's.
            "--user 0:0",
            "--read-only",
            "--security-opt no-new-privileges",
            "--cap-drop ALL --cap-add NET_ADMIN --cap-add BPF",
            "--volume /srv/run/netns:/run/netns:rslave",
            "--tmpfs /tmp",
            "--env FLATNET_LOG=info",
            "--env FLATNET_BPF_PIN_ROOT=/sys/fs/bpf/t",
            "--env NODE_NAME=node1",
        ] {
            assert!(line.contains(part), "{part} missing in {line}");
        }
        assert_eq!(container.image, "flatnet/flatnet-agent:0.1.0");
        assert_eq!(container.command, ["flatnet-agent", "run"]);
    }

    #[test]
    fn shared_host_paths_stay_and_others_move_below_the_scratch_directory() {
        let host = host_path_below(Path::new("/run/x"));
        assert_eq!(host("/run/netns"), "/run/netns");
        assert_eq!(host("/sys/fs/bpf"), "/sys/fs/bpf");
        assert_eq!(host("/opt/cni/bin"), "/run/x/opt/cni/bin");
    }

    #[test]
    fn a_variable_the_kubelet_fills_in_must_be_given() {
        let container = ChartContainer::of(&pod(), "agent").unwrap();
        let error = container
            .podman_args("x", str::to_owned, &BTreeMap::new(), &BTreeMap::new())
            .unwrap_err();
        assert!(error.to_string().contains("NODE_NAME"), "{error}");
    }
}
