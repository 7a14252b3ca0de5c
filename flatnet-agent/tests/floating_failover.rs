//! Floating-address failover on the real kernel (root): two "nodes" and a
//! LAN client in their own network namespaces on one bridge. Each node has
//! the uplink program attached (its own pin root), the floating address on
//! `lo` behind a TCP server (the kernel never answers ARP for it on the
//! uplink: `arp_ignore=1`), and runs the floating-address loop. The client
//! keeps connecting to the floating address; the owner's loop is stopped
//! without any cleanup (as a SIGKILL leaves it) and its uplink taken down;
//! the client must reach the other node, which must start answering only
//! once the dead owner's lease has run out.
//!
//! The same with only the agent dead (its loop stopped, its link, program
//! and servers left up): the dead node's program falls silent when its
//! lease runs out, so once the survivor answers, every fresh resolution of
//! the address by the client finds the survivor.
//!
//! The time from the kill to the first successful connection through the
//! survivor is printed (`failover_ms=`; `cargo xtask bench failover`
//! measures it over many runs) and guarded against large regressions: the
//! slowest failover of a test must stay within twice the budget the
//! configuration gives it (the peer timeout, 3 heartbeats of 100 ms, plus
//! the client's 200 ms connect timeout, plus the announcement rounds'
//! last before the neighbour `locktime` when the dead node's link stays
//! up). The same run with keepalived (VRRP, as commonly configured:
//! advertisements every second) in place of the loop is the benchmark's
//! baseline (`keepalived_baseline`, ignored unless asked for: it needs
//! keepalived installed).

mod support;

use std::{
    net::SocketAddr,
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use flatnet_agent::floating::owner::Event;
use support::{
    TestNetns,
    floating::{
        IPV4, IPV4_VLAN, IPV6, IPV6_VLAN, Node, PORT, Plan, has_vlan_links, kill, kill_agent,
        lan_and_client_of, node, plug, serve_name, start,
    },
    privileged, wait_until,
};

/// The node that answers a TCP connection to the floating address from
/// the client, if any within 200 ms.
fn answering(client: &TestNetns, floating: &str) -> Option<String> {
    support::floating::answering(client, SocketAddr::new(floating.parse().unwrap(), PORT))
}

fn acquired_at(node: &Node) -> Option<u64> {
    node.events.lock().unwrap().iter().find_map(|e| match e {
        Event::Acquired { at_ns, .. } => Some(*at_ns),
        _ => None,
    })
}

fn last_lease(node: &Node) -> u64 {
    node.events
        .lock()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            Event::Renewed { until_ns }
            | Event::Acquired {
                at_ns: until_ns, ..
            } => Some(*until_ns),
            _ => None,
        })
        .max()
        .unwrap_or_default()
}

/// What dies of the owner.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Death {
    /// Its agent, then its link.
    Node,
    /// Only its agent: link, program and servers stay up.
    Agent,
}

/// The failover time the configuration promises after `death`: the peer
/// timeout, the client's connect timeout (an attempt started just before
/// the takeover runs out first) and, with the dead node's link up, the
/// announcement rounds up to the client's neighbour `locktime` (1 s),
/// within which it keeps the dead node's MAC.
fn budget(death: Death) -> Duration {
    let peer_timeout = flatnet_agent::floating::heartbeat::HEARTBEAT_INTERVAL
        * flatnet_agent::floating::election::MISSED_HEARTBEATS;
    let connect_timeout = Duration::from_millis(200);
    let locktime = match death {
        Death::Node => Duration::ZERO,
        Death::Agent => Duration::from_secs(1),
    };
    peer_timeout + connect_timeout + locktime
}

/// Fails when the slowest of `failovers` after `death` took more than
/// twice the [`budget`].
fn assert_within_budget(failovers: &[Duration], death: Death) {
    let slowest = failovers.iter().max().copied().unwrap_or_default();
    let limit = budget(death) * 2;
    assert!(
        slowest <= limit,
        "the slowest failover took {} ms, over twice the budget ({} ms): {:?}",
        slowest.as_millis(),
        limit.as_millis(),
        failovers
    );
}

/// Runs the failover of `plan` after `death` of the owner; returns the
/// time from the kill to the first connection through the survivor.
fn failover(plan: &Plan, death: Death) -> Duration {
    let (lan, client) = lan_and_client_of(plan);
    let a = node("a", &lan, plan.node_a, plan);
    let b = node("b", &lan, plan.node_b, plan);
    start(&a, b.address);
    start(&b, a.address);

    wait_until("an owner answers", || {
        answering(&client, plan.floating).is_some()
    });
    let owner_name = answering(&client, plan.floating).unwrap();
    let (owner, survivor) = if owner_name == "a" {
        (&a, &b)
    } else {
        (&b, &a)
    };
    assert!(acquired_at(owner).is_some() && acquired_at(survivor).is_none());
    // Stable: the same node answers every time while both live.
    for _ in 0..10 {
        assert_eq!(
            answering(&client, plan.floating).as_deref(),
            Some(owner.name)
        );
    }

    // SIGKILL as the loop sees it: it stops with no cleanup; then, for a
    // dead node, its link goes down.
    let killed = Instant::now();
    match death {
        Death::Node => kill(owner),
        Death::Agent => kill_agent(owner),
    }
    wait_until("the survivor answers", || {
        answering(&client, plan.floating).as_deref() == Some(survivor.name)
    });
    let failover = killed.elapsed();

    let taken_at = acquired_at(survivor).expect("the survivor acquired the address");
    let dead_until = last_lease(owner);
    assert!(
        taken_at >= dead_until,
        "the survivor answered {} ms before the dead owner's lease ran out",
        (dead_until - taken_at) / 1_000_000
    );
    if death == Death::Agent {
        // The dead agent's program still listens on a live link: once its
        // lease ran out it answers no resolution, so each fresh one finds
        // the survivor (its servers would still answer a connection).
        for _ in 0..5 {
            client.ip(&["neigh", "flush", "all"]);
            assert_eq!(
                answering(&client, plan.floating).as_deref(),
                Some(survivor.name),
                "a fresh resolution of {} found the dead agent's node",
                plan.floating
            );
        }
    }
    println!(
        "failover_ms={} family={} death={} (takeover {} ms after the dead owner's lease ran out)",
        failover.as_millis(),
        if plan.prefix == 64 { "ipv6" } else { "ipv4" },
        match death {
            Death::Node => "node",
            Death::Agent => "agent",
        },
        (taken_at - dead_until) / 1_000_000
    );
    survivor.stop.store(true, Ordering::Relaxed);
    failover
}

/// Failovers per family: `FLATNET_FAILOVER_RUNS` (the benchmark), else one.
fn runs() -> usize {
    std::env::var("FLATNET_FAILOVER_RUNS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
}

#[test]
fn a_killed_owner_is_replaced_and_never_answers_alongside() {
    if !privileged("a_killed_owner_is_replaced_and_never_answers_alongside") {
        return;
    }
    let failovers: Vec<Duration> = [&IPV4, &IPV6]
        .into_iter()
        .flat_map(|plan| (0..runs()).map(|_| failover(plan, Death::Node)))
        .collect();
    assert_within_budget(&failovers, Death::Node);
}

/// Only the owner's agent dies; its link, its uplink program (pinned,
/// attached) and the servers behind the address stay up.
#[test]
fn an_owner_whose_agent_dies_on_a_live_link_is_replaced_and_falls_silent() {
    if !privileged("an_owner_whose_agent_dies_on_a_live_link_is_replaced_and_falls_silent") {
        return;
    }
    let failovers: Vec<Duration> = [&IPV4, &IPV6]
        .into_iter()
        .flat_map(|plan| (0..runs()).map(|_| failover(plan, Death::Agent)))
        .collect();
    assert_within_budget(&failovers, Death::Agent);
}

/// The same with the pool's `targetNetworkInterface` a VLAN link
/// (`up0.50` of the nodes' trunk `up0`, the client on `eth0.50`, tagged
/// frames across the bridge): the uplink program on the VLAN link answers
/// and the kill takes the trunk down under it. Needs 802.1Q links (the
/// VM stage of `cargo xtask test`).
#[test]
fn a_killed_owner_on_a_vlan_is_replaced_and_never_answers_alongside() {
    const TEST: &str = "a_killed_owner_on_a_vlan_is_replaced_and_never_answers_alongside";
    if !privileged(TEST) || !has_vlan_links(TEST) {
        return;
    }
    let failovers: Vec<Duration> = [&IPV4_VLAN, &IPV6_VLAN]
        .into_iter()
        .flat_map(|plan| (0..runs()).map(|_| failover(plan, Death::Node)))
        .collect();
    assert_within_budget(&failovers, Death::Node);
}

/// A keepalived node: its namespace on the LAN at `address`, a TCP server
/// on every address answering with its name, and keepalived holding the
/// floating address as a VRRP virtual address of its uplink.
struct KeepalivedNode {
    name: &'static str,
    ns: TestNetns,
    keepalived: std::process::Child,
    _dir: tempfile::TempDir,
}

impl Drop for KeepalivedNode {
    fn drop(&mut self) {
        kill_group(&self.keepalived);
        let _ = self.keepalived.wait();
    }
}

/// SIGKILL to keepalived and its children (one process group).
fn kill_group(child: &std::process::Child) {
    let group = nix::unistd::Pid::from_raw(child.id().cast_signed());
    let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
}

fn keepalived_node(
    name: &'static str,
    lan: &TestNetns,
    address: &str,
    priority: u8,
    plan: &Plan,
) -> KeepalivedNode {
    use std::os::unix::process::CommandExt;

    let ns = TestNetns::new(&format!("kad{name}"));
    // keepalived's IPv6 advertisements need a link-local address at once.
    ns.sysctl("net.ipv6.conf.all.accept_dad", "0");
    ns.sysctl("net.ipv6.conf.default.accept_dad", "0");
    plug(&ns, lan);
    ns.add_address("up0", &format!("{address}/{}", plan.prefix));
    serve_name(
        &ns,
        SocketAddr::from((std::net::Ipv6Addr::UNSPECIFIED, PORT)),
        name,
    );
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("keepalived.conf");
    std::fs::write(
        &config,
        format!(
            "global_defs {{\n  router_id {name}\n}}\n\
             vrrp_instance floating {{\n  state BACKUP\n  interface up0\n  \
             virtual_router_id 77\n  priority {priority}\n  advert_int 1\n  \
             virtual_ipaddress {{\n    {}/{}\n  }}\n}}\n",
            plan.floating, plan.prefix
        ),
    )
    .unwrap();
    let arg = |file: &str| dir.path().join(file).display().to_string();
    let keepalived = std::process::Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.name,
            "keepalived",
            "--dont-fork",
            "--log-console",
        ])
        .args(["--use-file", &config.display().to_string()])
        .args([
            "--pid",
            &arg("keepalived.pid"),
            "--vrrp_pid",
            &arg("vrrp.pid"),
        ])
        .args(["--vrrp", "--no-syslog"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0)
        .spawn()
        .expect("start keepalived (apt-get install keepalived)");
    KeepalivedNode {
        name,
        ns,
        keepalived,
        _dir: dir,
    }
}

/// The failover of `plan` with keepalived; returns the time from the
/// master's death to the first connection through the backup.
fn keepalived_failover(plan: &Plan) -> Duration {
    let (lan, client) = lan_and_client_of(plan);
    let a = keepalived_node("a", &lan, plan.node_a, 150, plan);
    let b = keepalived_node("b", &lan, plan.node_b, 100, plan);
    wait_until("keepalived's master answers", || {
        answering(&client, plan.floating).as_deref() == Some(a.name)
    });
    // The node dies: its link goes down (keepalived cannot say goodbye),
    // then keepalived is killed.
    let killed = Instant::now();
    a.ns.ip(&["link", "set", "up0", "down"]);
    kill_group(&a.keepalived);
    wait_until("keepalived's backup answers", || {
        answering(&client, plan.floating).as_deref() == Some(b.name)
    });
    let failover = killed.elapsed();
    println!(
        "keepalived_failover_ms={} family={}",
        failover.as_millis(),
        if plan.prefix == 64 { "ipv6" } else { "ipv4" },
    );
    failover
}

#[test]
#[ignore = "the baseline of `cargo xtask bench failover`; needs keepalived (apt-get install keepalived)"]
fn keepalived_baseline() {
    if !privileged("keepalived_baseline") {
        return;
    }
    assert!(
        std::process::Command::new("keepalived")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "keepalived is not installed: apt-get install keepalived"
    );
    for plan in [&IPV4, &IPV6] {
        for _ in 0..runs() {
            keepalived_failover(plan);
        }
    }
}
