//! A lab node: its own `flatnet-agent run --standalone` process with
//! private paths (state file, allocation file, socket, records, pin root,
//! admin address), and pods attached through the real `flatnet-cni`.

use std::{
    collections::BTreeMap,
    fs,
    net::{IpAddr, SocketAddr, TcpListener},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use super::{
    netns,
    process::{self, POLL},
    topology::{
        IPVLAN_UPLINK, LAN_HOST_IPVLAN_V4, LAN_HOST_V4, LAN_HOST_V6, PIN_DIR, UPLINK, WORK_DIR,
    },
};
use crate::images::podman::{ChartContainer, agent_pod_env, host_path_below};

/// The dual-stack macvlan network of every node.
pub const DUAL_NETWORK: &str = "lab-dual";
/// node1's ipvlan L2 network.
pub const IPVLAN_NETWORK: &str = "lab-ipvlan";
/// The network of the interface the runtime step hot-plugs.
pub const EXTRA_NETWORK: &str = "lab-extra";

/// The built binaries the lab runs.
#[derive(Clone)]
pub struct Binaries {
    pub agent: PathBuf,
    pub cni: PathBuf,
    /// Run the agent from its image instead (`cargo xtask lab --images`).
    pub image: Option<AgentImage>,
}

/// The agent image and the chart's agent container it is run as.
#[derive(Clone)]
pub struct AgentImage {
    /// The reference loaded into podman.
    pub reference: String,
    /// The chart's container: user, capabilities, read-only root, mounts.
    pub chart: ChartContainer,
}

impl AgentImage {
    /// `podman run` of the image on `node`'s network, as the chart runs it,
    /// with the lab's work and pin directories mounted where the agent's
    /// flags point.
    fn command(&self, node: &Node, args: &[String]) -> anyhow::Result<Command> {
        let scratch = node.dir.join("host");
        let host_dir = host_path_below(&scratch);
        self.chart.create_host_dirs(host_dir)?;
        let mut options = self.chart.podman_args(
            &container_name(node.netns),
            host_dir,
            &agent_pod_env(node.netns),
            &BTreeMap::new(),
        )?;
        // Attached (podman relays SIGTERM and the logs) and removed on exit.
        options.retain(|arg| arg != "--detach");
        options.push("--rm".into());
        for dir in [WORK_DIR, PIN_DIR] {
            options.extend(["--volume".into(), format!("{dir}:{dir}")]);
        }
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--net=/run/netns/{}", node.netns))
            .args(["podman", "--runtime", "runc"])
            .args(options)
            .arg(&self.reference)
            .arg("flatnet-agent")
            .args(args);
        Ok(command)
    }
}

/// The podman container of a node's agent.
fn container_name(netns: &str) -> String {
    format!("{netns}-agent")
}

/// Removes the agent containers of the lab's nodes (after a killed run).
pub fn remove_containers(nodes: &[&str]) {
    for netns in nodes {
        let _ = Command::new("podman")
            .args(["--runtime", "runc", "rm", "--force", "--time", "0"])
            .arg(container_name(netns))
            .output();
    }
}

/// One node's agent and the paths it owns.
pub struct Node {
    /// Node name and namespace name.
    pub netns: &'static str,
    /// Host part of this node's pod addresses: pods get `.{base}`, `.{base+1}`...
    pub base: u8,
    /// The agent's files (state, records, socket, logs).
    pub dir: PathBuf,
    pub pin_root: PathBuf,
    admin: SocketAddr,
    agent: Option<Child>,
    /// The agent's podman container, when run from the image.
    container: Option<String>,
}

impl Node {
    /// A node whose pods get addresses from `192.0.2.{base}` and
    /// `2001:db8::{base}` on (ranges of ten, disjoint between nodes).
    pub fn new(netns: &'static str, base: u8) -> anyhow::Result<Self> {
        let short = netns.trim_start_matches(super::topology::PREFIX);
        let node = Self {
            netns,
            base,
            dir: Path::new(WORK_DIR).join(short),
            pin_root: Path::new(PIN_DIR).join(short),
            admin: free_local_port()?,
            agent: None,
            container: None,
        };
        fs::create_dir_all(&node.dir)?;
        fs::create_dir_all(&node.pin_root)?;
        Ok(node)
    }

    /// This node's n-th pod address (IPv4, IPv6).
    pub fn pod_address(&self, n: u8) -> (String, String) {
        let host = self.base + n;
        (format!("192.0.2.{host}"), format!("2001:db8::{host}"))
    }

    fn state_file(&self) -> String {
        self.state_file_with(None, None)
    }

    /// The state file with `mtu` as `spec.mtu` of `lan4` and `lan6` (unset
    /// when `None`) and, with `hotplug` (a YAML entry of the `hotplug`
    /// section), subnet `extra4` (this node's addresses `.{base+100}` to
    /// `.{base+109}` of 192.0.2.0/24 on the same uplink) on network
    /// [`EXTRA_NETWORK`] for that entry to use.
    pub fn state_file_with(&self, mtu: Option<u32>, hotplug: Option<&str>) -> String {
        let (first4, first6) = self.pod_address(0);
        let (last4, last6) = self.pod_address(9);
        let ipvlan = (
            format!("198.51.100.{}", self.base),
            format!("198.51.100.{}", self.base + 9),
        );
        format!(
            r#"# flatnet-agent standalone state of lab node {netns}
subnets:
  - name: lan4
    spec:
      flatMode: macvlan
      mode: bridge
      master: {UPLINK}
      cidr: 192.0.2.0/24
      gateway: {LAN_HOST_V4}
      ranges: [{{from: {first4}, to: {last4}}}]{mtu}
  - name: lan6
    spec:
      flatMode: macvlan
      mode: bridge
      master: {UPLINK}
      cidr: "2001:db8::/64"
      gateway: "{LAN_HOST_V6}"
      ranges: [{{from: "{first6}", to: "{last6}"}}]{mtu}
  - name: ipvlan4
    spec:
      flatMode: ipvlan
      mode: l2
      master: {IPVLAN_UPLINK}
      cidr: 198.51.100.0/24
      gateway: {LAN_HOST_IPVLAN_V4}
      ranges: [{{from: {}, to: {}}}]{extra_subnet}
networks:
  - {{name: {DUAL_NETWORK}, subnets: [lan4, lan6]}}
  - {{name: {IPVLAN_NETWORK}, subnets: [ipvlan4]}}{extra_network}
"#,
            ipvlan.0,
            ipvlan.1,
            netns = self.netns,
            mtu = mtu.map(|m| format!("\n      mtu: {m}")).unwrap_or_default(),
            extra_subnet = hotplug
                .map(|_| format!(
                    "\n  - name: extra4\n    spec:\n      flatMode: macvlan\n      mode: bridge\n      \
                     master: {UPLINK}\n      cidr: 192.0.2.0/24\n      \
                     ranges: [{{from: 192.0.2.{}, to: 192.0.2.{}}}]",
                    self.base + 100,
                    self.base + 109
                ))
                .unwrap_or_default(),
            extra_network = hotplug
                .map(|entry| format!(
                    "\n  - {{name: {EXTRA_NETWORK}, subnets: [extra4]}}\nhotplug:\n  - {entry}"
                ))
                .unwrap_or_default(),
        )
    }

    /// The agent's state file; the agent reloads it when it changes.
    pub fn state_file_path(&self) -> PathBuf {
        self.dir.join("state.yaml")
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// Starts the agent; [`Node::wait_ready`] waits for it.
    pub fn start(&mut self, bins: &Binaries) -> anyhow::Result<()> {
        fs::write(self.state_file_path(), self.state_file())?;
        let log = fs::File::create(self.dir.join("agent.log"))?;
        let mut args: Vec<String> = ["--log-level", "info", "run", "--standalone"]
            .map(str::to_owned)
            .to_vec();
        let mut flag = |name: &str, value: String| args.extend([name.to_owned(), value]);
        flag("--node-name", self.netns.to_owned());
        flag("--state-file", self.state_file_path().display().to_string());
        flag("--state-dir", self.path("state"));
        flag("--record-dir", self.path("records"));
        flag("--lease-dir", self.path("leases"));
        flag("--socket", self.path("agent.sock"));
        flag("--cni-bin-dir", self.path("bin"));
        flag("--pin-root", self.pin_root.display().to_string());
        flag("--admin-address", self.admin.to_string());
        flag("--arp-policy", "arping".to_owned());
        let mut command = match &bins.image {
            // The image installs its own flatnet-cni; the container is on
            // the node's network already.
            Some(image) => image.command(self, &args)?,
            None => {
                let mut command = Command::new(&bins.agent);
                command
                    .args(&args)
                    .arg("--cni-binary")
                    .arg(&bins.cni)
                    .args(["--host-netns", &format!("/run/netns/{}", self.netns)]);
                command
            }
        };
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {:?}", command.get_program()))?;
        self.agent = Some(child);
        self.container = bins.image.as_ref().map(|_| container_name(self.netns));
        Ok(())
    }

    /// Waits until the agent answers CNI STATUS and `/readyz`.
    pub fn wait_ready(&mut self, bins: &Binaries) -> anyhow::Result<()> {
        // A bound on waiting for start-up, not a measurement.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.agent.as_mut().expect("started").try_wait()? {
                bail!(
                    "flatnet-agent on {} exited during start-up ({status}):\n{}",
                    self.netns,
                    self.log_tail()
                );
            }
            let status = self.cni(bins, "STATUS", DUAL_NETWORK, None, json!({}));
            if status.is_ok() && self.http_get("/readyz").is_ok_and(|b| b.contains("ready")) {
                if let Some(container) = &self.container {
                    // What answered is the agent in its podman container.
                    let running = process::run(
                        "podman",
                        &["inspect", "--format", "{{.State.Running}}", container],
                    )?;
                    if running.trim() != "true" {
                        bail!("{container} is not running, yet something answered");
                    }
                    println!(
                        "[lab]       {}: agent in podman container {container}",
                        self.netns
                    );
                }
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "flatnet-agent on {} is not ready:\n{}",
                    self.netns,
                    self.log_tail()
                );
            }
            process::sleep(Duration::from_millis(100))?;
        }
    }

    /// Runs `flatnet-cni` with `command` for the container `pod` (the
    /// namespace name doubles as container ID) and the network config on
    /// stdin; returns its stdout JSON, or fails with the CNI error.
    pub fn cni(
        &self,
        bins: &Binaries,
        command: &str,
        network: &str,
        pod: Option<&str>,
        extra: Value,
    ) -> anyhow::Result<Value> {
        let mut config = json!({
            "cniVersion": "1.1.0",
            "name": network,
            "type": "flatnet-cni",
            "agentTimeoutSeconds": 30,
        });
        for (key, value) in extra.as_object().into_iter().flatten() {
            config[key] = value.clone();
        }
        // From the image, the agent installs its own flatnet-cni.
        let mut cni = match bins.image {
            Some(_) => Command::new(self.dir.join("bin/flatnet-cni")),
            None => Command::new(&bins.cni),
        };
        cni.env_clear()
            .env("CNI_COMMAND", command)
            .env("FLATNET_AGENT_SOCKET", self.path("agent.sock"))
            .env("CNI_PATH", self.path("bin"));
        if let Some(pod) = pod {
            cni.env("CNI_CONTAINERID", pod)
                .env("CNI_IFNAME", "eth1")
                .env("CNI_NETNS", format!("/run/netns/{pod}"))
                .env(
                    "CNI_ARGS",
                    format!("IgnoreUnknown=1;K8S_POD_NAMESPACE=lab;K8S_POD_NAME={pod}"),
                );
        }
        let out = process::output(&mut cni, config.to_string().as_bytes())?;
        let stdout: Value = if out.stdout.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&out.stdout).with_context(|| {
                format!(
                    "flatnet-cni {command} printed no JSON: {}",
                    String::from_utf8_lossy(&out.stdout)
                )
            })?
        };
        if !out.status.success() {
            bail!(
                "flatnet-cni {command} {network} on {}: {stdout}",
                self.netns
            );
        }
        Ok(stdout)
    }

    /// `GET path` on the agent's admin address; the body.
    pub fn http_get(&self, path: &str) -> anyhow::Result<String> {
        match self.container {
            // From the image, the agent listens on the node's network.
            Some(_) => netns::in_netns(self.netns, || netns::http_get(self.admin, path))?,
            None => netns::http_get(self.admin, path),
        }
    }

    /// The value of a counter in the agent's `/metrics`.
    pub fn metric(&self, name: &str) -> anyhow::Result<u64> {
        let body = self.http_get("/metrics")?;
        body.lines()
            .filter_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
            .find_map(|value| value.trim().parse::<f64>().ok())
            .map(metric_count)
            .with_context(|| format!("no {name} in the /metrics of {}", self.netns))
    }

    /// The agent's wire inventory as `flatnet-agent inspect wire` reads it
    /// (the way allocation reads it): each address with the MAC last seen
    /// claiming it.
    pub fn wire_claims(&self, bins: &Binaries) -> anyhow::Result<Vec<(IpAddr, [u8; 6])>> {
        let shown: Value = serde_json::from_str(&self.inspect_wire(bins)?)
            .context("parse `inspect wire -o json`")?;
        Ok(shown
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|row| {
                let addr = row["address"].as_str()?.parse().ok()?;
                Some((addr, super::parse_mac(row["mac"].as_str()?)?))
            })
            .collect())
    }

    /// The wire inventory as text for a failure message (or why it is unreadable).
    pub fn wire_inventory(&self, bins: &Binaries) -> String {
        self.inspect_wire(bins)
            .unwrap_or_else(|e| format!("unreadable: {e:#}"))
    }

    fn inspect_wire(&self, bins: &Binaries) -> anyhow::Result<String> {
        let pin_root = self.pin_root.display().to_string();
        process::run(
            &bins.agent.display().to_string(),
            &["inspect", "wire", "-o", "json", "--pin-root", &pin_root],
        )
    }

    /// The allocations in the agent's allocation file.
    pub fn allocations(&self) -> anyhow::Result<Vec<String>> {
        let path = self.dir.join("state/allocations.json");
        let file: Value = match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e).context(format!("read {}", path.display())),
        };
        Ok(file["allocations"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a["address"].as_str().map(str::to_owned))
            .collect())
    }

    /// Stops the agent with SIGTERM, as a service manager would, and checks
    /// it exits successfully.
    pub fn stop(&mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.agent.take() else {
            return Ok(());
        };
        // SAFETY: kill(2) on our own child, not yet reaped.
        unsafe { libc::kill(child.id().cast_signed(), libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("flatnet-agent on {} ignored SIGTERM", self.netns);
            }
            std::thread::sleep(POLL);
        };
        if status.success() {
            // podman removed the container (--rm) as the agent exited.
            self.container = None;
        } else {
            bail!(
                "flatnet-agent on {} exited with {status}:\n{}",
                self.netns,
                self.log_tail()
            );
        }
        Ok(())
    }

    /// Kills the agent (cleanup after failure or interrupt).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.agent.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if self.container.take().is_some() {
            remove_containers(&[self.netns]);
        }
    }

    /// The last lines of the agent's log.
    pub fn log_tail(&self) -> String {
        let log = fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Whether one line of the agent's log contains every one of `parts`.
    pub fn log_has_line(&self, parts: &[&str]) -> bool {
        fs::read_to_string(self.dir.join("agent.log")).is_ok_and(|log| {
            log.lines()
                .any(|line| parts.iter().all(|part| line.contains(part)))
        })
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A free TCP port on 127.0.0.1 for an agent's admin endpoints.
fn free_local_port() -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").context("find a free local port")?;
    Ok(listener.local_addr()?)
}

/// A Prometheus counter or gauge value as a count.
#[expect(
    clippy::cast_sign_loss,
    reason = "the lab reads counters and sizes, which are never negative"
)]
fn metric_count(value: f64) -> u64 {
    value as u64
}
