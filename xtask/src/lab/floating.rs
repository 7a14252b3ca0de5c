//! The floating steps: both nodes run `flatnet-agent floating` from a
//! state file's `floating` section. In `floating` the nodes answer for an
//! address themselves and the owner dies (SIGKILL, uplink down); in
//! `floating-pods` the address is held by pod-a while node1 owns it and
//! moves to pod-b when node1's agent stops (SIGTERM). Each measures the
//! time to the LAN host's first TCP connection after the failover.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};

use super::{
    Lab, POD_A, POD_B,
    netns::{self, EchoServer},
    node::Node,
    policy::ALLOWED_PORT,
    process,
    topology::{self, LAN_HOST},
};

/// The floating address of the floating step (outside the pods' ranges).
const FLOATING_V4: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 240);
/// Where the pod step's floating address is taken from: the first one
/// node1 owns when both nodes offer it (outside the pods' ranges).
const POD_FLOATING_CANDIDATES: std::ops::RangeInclusive<u8> = 230..=239;
/// The nodes' uplink addresses the heartbeats travel between.
const FLOATING_NODE_ADDRESSES: [&str; 2] = ["192.0.2.251", "192.0.2.252"];
/// The echo port on the node-answered floating address.
const FLOATING_PORT: u16 = 7070;
/// The pods' flat interface (`CNI_IFNAME` of the lab's ADDs).
const POD_IFNAME: &str = "eth1";

/// A `flatnet-agent floating` process (until it is reaped), SIGKILLed
/// when dropped.
pub(super) struct FloatingLoop(Option<std::process::Child>);

impl FloatingLoop {
    /// Starts `flatnet-agent floating` on `node` (index `index`) for
    /// `addresses`, heartbeating with the other node; `backends` is the
    /// section's `backends` list (YAML), empty for none.
    fn start(
        agent: &Path,
        node: &Node,
        index: usize,
        addresses: &[IpAddr],
        backends: &str,
    ) -> anyhow::Result<Self> {
        let address = FLOATING_NODE_ADDRESSES[index];
        let peer = FLOATING_NODE_ADDRESSES[1 - index];
        let state = node.dir.join("floating.yaml");
        let listed: Vec<String> = addresses.iter().map(|a| format!("\"{a}\"")).collect();
        std::fs::write(
            &state,
            format!(
                "floating:\n  interface: {}\n  addresses: [{}]\n  listen: \"{address}:7946\"\n  peers: [\"{peer}:7946\"]\n{backends}",
                topology::UPLINK,
                listed.join(", "),
            ),
        )?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(node.dir.join("floating.log"))?;
        // nsenter, not `ip netns exec`: that mounts a /sys without the
        // BPF filesystem, where the pinned maps are.
        let child = std::process::Command::new("nsenter")
            .arg(format!("--net=/run/netns/{}", node.netns))
            .arg(agent)
            .args(["floating", "--node-name", node.netns])
            .arg("--state-file")
            .arg(&state)
            .arg("--pin-root")
            .arg(&node.pin_root)
            .arg("--status-file")
            .arg(node.dir.join("floating.json"))
            .arg("--record-dir")
            .arg(node.dir.join("records"))
            .arg("--state-dir")
            .arg(node.dir.join("state"))
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("start flatnet-agent floating")?;
        Ok(Self(Some(child)))
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM: the agent removes the addresses its pods hold, then exits.
    fn stop(&mut self) -> anyhow::Result<()> {
        let Some(mut child) = self.0.take() else {
            return Ok(());
        };
        let pid = i32::try_from(child.id()).context("pid")?;
        // SAFETY: kill has no memory preconditions; the child is ours and not yet reaped.
        if unsafe { libc::kill(pid, libc::SIGTERM) } != 0 {
            let error = std::io::Error::last_os_error();
            self.0 = Some(child);
            bail!("SIGTERM to flatnet-agent floating: {error}");
        }
        let status = child.wait()?;
        if !status.success() {
            bail!("flatnet-agent floating exited with {status} on SIGTERM");
        }
        Ok(())
    }
}

impl Drop for FloatingLoop {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether the LAN host completes a TCP connection to `target` within 200 ms.
fn connects(target: SocketAddr) -> anyhow::Result<bool> {
    process::check_interrupt()?;
    netns::in_netns(LAN_HOST, || {
        std::net::TcpStream::connect_timeout(&target, Duration::from_millis(200)).is_ok()
    })
}

/// Waits until the LAN host connects to `target` (a bound on waiting, not
/// a measurement); returns how long it took.
fn wait_connecting(target: SocketAddr, what: &str) -> anyhow::Result<Duration> {
    let started = Instant::now();
    let deadline = started + Duration::from_secs(30);
    while !connects(target)? {
        if Instant::now() > deadline {
            bail!("the LAN host never reached {target} {what}");
        }
        process::sleep(Duration::from_millis(20))?;
    }
    Ok(started.elapsed())
}

/// The MAC the LAN host resolves `addr` to.
fn resolved_mac(addr: IpAddr) -> anyhow::Result<String> {
    let out = process::ip(LAN_HOST, &["-j", "neigh", "show", &addr.to_string()])?;
    let json: serde_json::Value = serde_json::from_str(&out)?;
    Ok(json[0]["lladdr"].as_str().unwrap_or_default().to_owned())
}

/// The MAC of `ifname` in `netns`.
fn mac_of(netns: &str, ifname: &str) -> anyhow::Result<String> {
    let out = process::ip(netns, &["-j", "link", "show", "dev", ifname])?;
    let json: serde_json::Value = serde_json::from_str(&out)?;
    Ok(json[0]["address"].as_str().unwrap_or_default().to_owned())
}

/// Whether pod `netns` carries `addr` on its flat interface.
fn pod_holds(netns: &str, addr: IpAddr) -> anyhow::Result<bool> {
    let out = process::ip(netns, &["-o", "addr", "show", "dev", POD_IFNAME])?;
    Ok(out.contains(&format!(" {addr}/")))
}

impl Lab {
    /// Gives each node its heartbeat address on the uplink.
    fn add_heartbeat_addresses(&self) -> anyhow::Result<()> {
        for (node, address) in self.nodes.iter().zip(FLOATING_NODE_ADDRESSES) {
            process::ip(
                node.netns,
                &[
                    "addr",
                    "add",
                    &format!("{address}/24"),
                    "dev",
                    topology::UPLINK,
                ],
            )?;
        }
        Ok(())
    }

    /// Stops the floating agents (the pods' addresses removed) and takes
    /// the heartbeat addresses away again.
    fn undo_floating(&mut self) {
        for mut agent in self.floating_loops.drain(..) {
            if let Err(error) = agent.stop() {
                println!("[lab]       {error:#}");
            }
        }
        for (node, address) in self.nodes.iter().zip(FLOATING_NODE_ADDRESSES) {
            let _ = process::ip(node.netns, &["link", "set", topology::UPLINK, "up"]);
            let _ = process::ip(
                node.netns,
                &[
                    "addr",
                    "del",
                    &format!("{address}/24"),
                    "dev",
                    topology::UPLINK,
                ],
            );
        }
    }

    /// Both nodes run `flatnet-agent floating` for one address (on `lo`
    /// behind an echo server, `arp_ignore=1` so only the uplink program
    /// answers ARP for it); the owner's loop is SIGKILLed and its uplink
    /// taken down; the LAN host must reach the address through the other
    /// node. Everything is undone afterwards.
    pub(super) fn floating(&mut self) -> anyhow::Result<()> {
        let target = SocketAddr::from((FLOATING_V4, FLOATING_PORT));
        let result = self.floating_failover(target);
        self.undo_floating();
        for node in &self.nodes {
            let _ = process::ip(
                node.netns,
                &["addr", "del", &format!("{FLOATING_V4}/32"), "dev", "lo"],
            );
            let _ = process::exec_in(
                node.netns,
                "sysctl",
                &["-qw", "net.ipv4.conf.all.arp_ignore=0"],
            );
        }
        let (from, to, took) = result?;
        println!(
            "[lab]       floating {FLOATING_V4}: {from} -> {to} in {} ms",
            took.as_millis()
        );
        self.report.timing(
            format!("floating {FLOATING_V4}: {from} -> {to}, SIGKILL + uplink down -> the LAN host's first TCP connect"),
            took,
        );
        Ok(())
    }

    /// Starts the loops and kills the owner's; returns (owner, survivor,
    /// time to the first connection through the survivor).
    fn floating_failover(
        &mut self,
        target: SocketAddr,
    ) -> anyhow::Result<(&'static str, &'static str, Duration)> {
        let agent = self.bins().agent.clone();
        self.add_heartbeat_addresses()?;
        for (index, node) in self.nodes.iter().enumerate() {
            process::ip(
                node.netns,
                &["addr", "add", &format!("{FLOATING_V4}/32"), "dev", "lo"],
            )?;
            process::exec_in(
                node.netns,
                "sysctl",
                &["-qw", "net.ipv4.conf.all.arp_ignore=1"],
            )?;
            self.servers
                .push(EchoServer::start(node.netns, FLOATING_PORT)?);
            let started = FloatingLoop::start(&agent, node, index, &[FLOATING_V4.into()], "")?;
            self.floating_loops.push(started);
        }
        wait_connecting(target, "before the failover")?;
        let owner = self.floating_answerer()?;
        let survivor = 1 - owner;
        let killed = Instant::now();
        self.floating_loops[owner].kill();
        process::ip(
            self.nodes[owner].netns,
            &["link", "set", topology::UPLINK, "down"],
        )?;
        wait_connecting(target, "through the survivor after the owner died")?;
        let took = killed.elapsed();
        let now = self.floating_answerer()?;
        if now != survivor {
            bail!(
                "after the failover the LAN host resolves {FLOATING_V4} to {} instead of {}",
                self.nodes[now].netns,
                self.nodes[survivor].netns
            );
        }
        Ok((self.nodes[owner].netns, self.nodes[survivor].netns, took))
    }

    /// Which node's uplink MAC the LAN host resolves the floating address to.
    fn floating_answerer(&self) -> anyhow::Result<usize> {
        let resolved = resolved_mac(FLOATING_V4.into())?;
        for (index, node) in self.nodes.iter().enumerate() {
            if mac_of(node.netns, topology::UPLINK)? == resolved {
                return Ok(index);
            }
        }
        bail!("the LAN host resolves {FLOATING_V4} to {resolved:?}, no node's uplink")
    }

    /// A floating address whose backends are pod-a (node1) and pod-b
    /// (node2), one the election gives node1: pod-a holds it and the LAN
    /// host reaches pod-a's echo server on it; node1's agent is stopped
    /// (SIGTERM), pod-a gives it up and pod-b takes it over. Everything is
    /// undone afterwards.
    pub(super) fn floating_pods(&mut self) -> anyhow::Result<()> {
        let result = self.floating_pod_failover();
        self.undo_floating();
        let (addr, took) = result?;
        println!(
            "[lab]       floating {addr}: {POD_A} on {} -> {POD_B} on {} in {} ms",
            self.nodes[0].netns,
            self.nodes[1].netns,
            took.as_millis()
        );
        self.report.timing(
            format!("floating {addr}: {POD_A} -> {POD_B}, SIGTERM of node1's agent -> the LAN host's first TCP connect"),
            took,
        );
        Ok(())
    }

    /// The pod step's checks; returns the address and the time from the
    /// SIGTERM to the LAN host's first connection to pod-b.
    fn floating_pod_failover(&mut self) -> anyhow::Result<(IpAddr, Duration)> {
        let agent = self.bins().agent.clone();
        let names = [self.nodes[0].netns, self.nodes[1].netns];
        let addr: IpAddr = POD_FLOATING_CANDIDATES
            .map(|host| IpAddr::from(Ipv4Addr::new(192, 0, 2, host)))
            .find(|addr| flatnet_k8s::floating::choose_owner(*addr, names) == Some(names[0]))
            .context("no candidate address the election gives node1")?;
        // pod-b serves the allowed port already (since the pods step).
        self.servers.push(EchoServer::start(POD_A, ALLOWED_PORT)?);
        self.add_heartbeat_addresses()?;
        for (index, pod) in [POD_A, POD_B].into_iter().enumerate() {
            let backends = format!(
                "  backends:\n    - {{address: \"{addr}\", containerId: {pod}, ifname: {POD_IFNAME}}}\n"
            );
            let started =
                FloatingLoop::start(&agent, &self.nodes[index], index, &[addr], &backends)?;
            self.floating_loops.push(started);
        }
        let target = SocketAddr::new(addr, ALLOWED_PORT);
        wait_connecting(target, "on pod-a")?;
        let (mac_a, mac_b) = (mac_of(POD_A, POD_IFNAME)?, mac_of(POD_B, POD_IFNAME)?);
        let (resolved, on_a, on_b) = (
            resolved_mac(addr)?,
            pod_holds(POD_A, addr)?,
            pod_holds(POD_B, addr)?,
        );
        if resolved != mac_a || !on_a || on_b {
            bail!(
                "before the failover: the LAN host resolves {addr} to {resolved} (pod-a {mac_a}, pod-b {mac_b}); pod-a holds it: {on_a}, pod-b: {on_b}"
            );
        }
        let stopped = Instant::now();
        self.floating_loops[0].stop()?;
        if pod_holds(POD_A, addr)? {
            bail!("node1's agent stopped but pod-a still holds {addr}");
        }
        wait_connecting(target, "on pod-b after node1's agent stopped")?;
        let took = stopped.elapsed();
        let (resolved, on_b) = (resolved_mac(addr)?, pod_holds(POD_B, addr)?);
        if resolved != mac_b || !on_b {
            bail!(
                "after the failover: the LAN host resolves {addr} to {resolved} (pod-b {mac_b}); pod-b holds it: {on_b}"
            );
        }
        Ok((addr, took))
    }
}
