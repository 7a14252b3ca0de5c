//! Floating addresses held by backend pods without Kubernetes, on the real
//! kernel (root): two nodes and a LAN client in their own network
//! namespaces on one bridge; on each node a pod with a macvlan interface on
//! the node's uplink, recorded as the CNI service records it. Each node
//! runs `flatnet-agent floating` (the binary, in the node's namespace)
//! from a state file whose `floating` section names its pod as the
//! backend of an IPv4 and an IPv6 address.
//!
//! - Each address is on exactly one pod, that of the node owning it, and
//!   the LAN client's TCP connections reach that pod.
//! - The owner of the IPv4 address dies (its agent is killed with
//!   SIGKILL, its uplink goes down): the other node's pod takes both addresses,
//!   announced with its MAC, and the client connects to it again (the
//!   time is printed).
//! - The dead node comes back and its agent starts again: it removes what
//!   its pod still held unless it owns it again, so every address is on
//!   exactly one pod again, held by the node both agents see owning it.
//! - The node holding the IPv4 address stops its agent (SIGTERM): its pod
//!   gives both addresses up at once and the other node's pod takes them.

mod support;

use std::{
    net::{IpAddr, SocketAddr},
    process::{Child, Command},
    time::Instant,
};

use flatnet_agent::{
    desired::standalone::StateFile,
    floating::{backends::POD_ADDRESS_RECORD, owner::Status},
    netns::run_in_netns,
};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use support::{
    TestNetns,
    floating::{PORT, PodNode, answering, lan_and_client, pod_node},
    privileged, wait_until,
};

const FLOATING_V4: &str = "10.81.0.50";
const FLOATING_V6: &str = "fd00:81::50";

/// One node with one pod, and its `flatnet-agent floating` when running.
struct Node {
    name: &'static str,
    address: &'static str,
    peer: &'static str,
    pod: &'static str,
    node: PodNode,
    state_dir: tempfile::TempDir,
    _datapath: flatnet_agent::datapath::Datapath,
    agent: Option<Child>,
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Some(mut agent) = self.agent.take() {
            let _ = agent.kill();
            let _ = agent.wait();
        }
    }
}

impl std::ops::Deref for Node {
    type Target = PodNode;

    fn deref(&self) -> &PodNode {
        &self.node
    }
}

impl Node {
    /// The node's state file: both addresses, its pod as their backend.
    fn state_file(&self) -> String {
        format!(
            r#"
subnets: []
networks: []
floating:
  node: {name}
  interface: up0
  addresses: ["{FLOATING_V4}", "{FLOATING_V6}"]
  listen: "{address}:7946"
  peers: ["{peer}:7946"]
  backends:
    - {{address: "{FLOATING_V4}", containerId: c-{pod}, ifname: net1}}
    - {{address: "{FLOATING_V6}", containerId: c-{pod}, ifname: net1}}
"#,
            name = self.name,
            address = self.address,
            peer = self.peer,
            pod = self.pod,
        )
    }

    /// Starts `flatnet-agent floating` in the node's namespace.
    fn start(&mut self) {
        let dir = self.state_dir.path();
        let state = dir.join("state.yaml");
        std::fs::write(&state, self.state_file()).unwrap();
        let section = StateFile::read(&state).unwrap().floating.unwrap();
        assert_eq!(section.problems(), Vec::<String>::new());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("agent.log"))
            .unwrap();
        // nsenter, not `ip netns exec`: that mounts a /sys without the BPF
        // file system, where the pinned maps are.
        let child = Command::new("nsenter")
            .arg(format!("--net={}", self.node.ns.path().display()))
            .arg(env!("CARGO_BIN_EXE_flatnet-agent"))
            .arg("floating")
            .arg("--state-file")
            .arg(&state)
            .arg("--pin-root")
            .arg(&self.node.pin.path)
            .arg("--record-dir")
            .arg(self.node.records_dir.path())
            .arg("--state-dir")
            .arg(dir)
            .arg("--status-file")
            .arg(dir.join("floating.json"))
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.agent = Some(child);
    }

    /// The node dies: its agent is killed (SIGKILL: nothing cleaned up)
    /// and its uplink goes down, taking the pod's macvlan with it.
    fn kill(&mut self) {
        let mut agent = self.agent.take().unwrap();
        agent.kill().unwrap();
        agent.wait().unwrap();
        self.node.ns.ip(&["link", "set", "up0", "down"]);
    }

    /// Stops the agent with SIGTERM, and waits for it.
    fn stop(&mut self) {
        let mut agent = self.agent.take().unwrap();
        let pid = Pid::from_raw(i32::try_from(agent.id()).unwrap());
        kill(pid, Signal::SIGTERM).unwrap();
        let status = tokio::task::block_in_place(|| agent.wait().unwrap());
        assert!(status.success(), "{status}: {}", self.log());
    }

    /// The node the agent sees owning `addr`.
    fn owner_seen(&self, addr: &str) -> Option<String> {
        let text = std::fs::read(self.state_dir.path().join("floating.json")).ok()?;
        let status: Status = serde_json::from_slice(&text).ok()?;
        let addr: IpAddr = addr.parse().unwrap();
        status
            .addresses
            .into_iter()
            .find(|row| row.address == addr)?
            .owner
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.state_dir.path().join("agent.log")).unwrap_or_default()
    }

    fn holds(&self, addr: &str) -> bool {
        self.pod_addresses().contains(&format!("{addr}/"))
    }
}

/// The pod answering a TCP connection to the floating `addr`.
fn answering_at(client: &TestNetns, addr: &str) -> Option<String> {
    answering(client, SocketAddr::new(addr.parse().unwrap(), PORT))
}

/// Waits until each address is on exactly one pod, that pod answers the
/// client at it, and the client's neighbour entry names that pod's MAC;
/// returns the holder's name per address.
fn wait_settled(client: &TestNetns, nodes: [&Node; 2]) -> [&'static str; 2] {
    [FLOATING_V4, FLOATING_V6].map(|addr| {
        let mut holder = "";
        tokio::task::block_in_place(|| {
            wait_until(&format!("one pod holds and serves {addr}"), || {
                let holding: Vec<&&Node> = nodes.iter().filter(|n| n.holds(addr)).collect();
                let [node] = holding[..] else { return false };
                holder = node.pod;
                answering_at(client, addr).as_deref() == Some(node.pod)
                    && client
                        .ip(&["neigh", "show", addr])
                        .contains(&node.pod_mac())
            });
        });
        holder
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_pods_hold_the_floating_addresses_of_the_owner_and_fail_over() {
    if !privileged("backend_pods_hold_the_floating_addresses_of_the_owner_and_fail_over") {
        return;
    }
    let (lan, client) = lan_and_client("10.81.0.100/24");
    client.add_address("eth0", "fd00:81::100/64");
    let make = |name: &'static str, address, peer, pod, v4, v6| {
        let (node, mut datapath) = pod_node(name, address, pod, &lan, v4, v6);
        run_in_netns(&node.ns.path(), || datapath.attach_uplink("up0"))
            .unwrap()
            .expect("attach the uplink program");
        Node {
            name,
            address,
            peer,
            pod,
            node,
            state_dir: tempfile::tempdir().unwrap(),
            _datapath: datapath,
            agent: None,
        }
    };
    let mut a = make(
        "node-a",
        "10.81.0.1",
        "10.81.0.2",
        "pod-a",
        "10.81.0.11",
        "fd00:81::11",
    );
    let mut b = make(
        "node-b",
        "10.81.0.2",
        "10.81.0.1",
        "pod-b",
        "10.81.0.12",
        "fd00:81::12",
    );
    a.start();
    b.start();
    let holders = wait_settled(&client, [&a, &b]);
    // Each holder's pod carries the address with its own subnet's prefix.
    for (addr, prefix, holder) in [(FLOATING_V4, 24, holders[0]), (FLOATING_V6, 64, holders[1])] {
        let node = if holder == a.pod { &a } else { &b };
        assert!(
            node.pod_addresses().contains(&format!("{addr}/{prefix}")),
            "{}",
            node.pod_addresses()
        );
    }

    // The owner of the IPv4 address dies.
    let (mut owner, mut survivor) = if holders[0] == a.pod { (a, b) } else { (b, a) };
    let killed = Instant::now();
    owner.kill();
    tokio::task::block_in_place(|| {
        wait_until("the survivor's pod serves the client", || {
            answering_at(&client, FLOATING_V4).as_deref() == Some(survivor.pod)
        });
    });
    println!(
        "pod failover: the client connected to {} {} ms after {} died",
        survivor.pod,
        killed.elapsed().as_millis(),
        owner.name
    );
    tokio::task::block_in_place(|| {
        wait_until("the survivor's pod serves both addresses", || {
            [FLOATING_V4, FLOATING_V6].iter().all(|addr| {
                survivor.holds(addr) && answering_at(&client, addr).as_deref() == Some(survivor.pod)
            })
        });
    });
    assert!(
        client
            .ip(&["neigh", "show", FLOATING_V4])
            .contains(&survivor.pod_mac())
    );
    let record = std::fs::read_to_string(owner.state_dir.path().join(POD_ADDRESS_RECORD)).unwrap();
    assert!(
        record.contains(FLOATING_V4),
        "the dead node recorded what its pod holds: {record}"
    );

    // The dead node comes back: every address is on one pod again, the
    // dead node's pod keeps only what its node owns.
    owner.node.ns.ip(&["link", "set", "up0", "up"]);
    owner.start();
    let holders = wait_settled(&client, [&owner, &survivor]);
    for (addr, holder) in [FLOATING_V4, FLOATING_V6].into_iter().zip(holders) {
        let node = if holder == owner.pod {
            &owner
        } else {
            &survivor
        };
        // The restarted agent writes its status a moment after its pod
        // settled (with IPv4 forwarding on, as on every Kubernetes node,
        // about 250 ms later).
        for seen_by in [&owner, &survivor] {
            tokio::task::block_in_place(|| {
                wait_until(
                    &format!("{} sees {} owning {addr}", seen_by.name, node.name),
                    || seen_by.owner_seen(addr).as_deref() == Some(node.name),
                );
            });
        }
    }

    // The node holding the IPv4 address stops (SIGTERM): its pod gives
    // both addresses up at once, the other node's pod takes them.
    let (stopping, other) = if holders[0] == owner.pod {
        (&mut owner, &survivor)
    } else {
        (&mut survivor, &owner)
    };
    stopping.stop();
    assert!(
        !stopping.holds(FLOATING_V4) && !stopping.holds(FLOATING_V6),
        "a stopped agent leaves nothing on its pod: {}",
        stopping.pod_addresses()
    );
    let record = stopping.state_dir.path().join(POD_ADDRESS_RECORD);
    assert!(
        !std::fs::read_to_string(record)
            .unwrap()
            .contains(FLOATING_V4)
    );
    tokio::task::block_in_place(|| {
        wait_until("the other pod serves both addresses", || {
            [FLOATING_V4, FLOATING_V6].iter().all(|addr| {
                other.holds(addr) && answering_at(&client, addr).as_deref() == Some(other.pod)
            })
        });
    });
    drop(lan);
}
