//! Agent faults on the real kernel (root): the agent SIGKILLed at random
//! points of a stream of CNI calls from parallel clients and restarted; an
//! established TCP flow through the policy programs across a SIGKILL; a
//! full and a read-only state directory. Each test runs its own agent with
//! a private socket, pin root, record and state directories.
//!
//! `FLATNET_FAULT_CALLS` sets the number of CNI calls of the kill run
//! (default 500) and `FLATNET_FAULT_SEED` its seed (printed).

mod support;

use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    sync::{Mutex, RwLock},
    time::Duration,
};

use flatnet_agent::crash_point::CRASH_AT_ENV;
use flatnet_common::pin::{
    MAP_ARP_RESPONDER, MAP_MANAGED_ADDRS, MAP_NDP_RESPONDER, MAP_POLICY_SUBJECTS,
    PROG_UPLINK_INGRESS,
};
use serde_json::{Value, json};
use support::{
    TestNetns,
    agent::StandaloneAgent,
    cni::{IFNAME, run_cni},
    has_link,
    lan::AgentOnLan,
    privileged, run,
    tc_hooks::link_pins,
    wait_until,
};

/// The port the policy allows into every pod.
const ALLOWED_PORT: u16 = 5000;
/// A port it does not allow.
const DENIED_PORT: u16 = 5001;

/// The CNI error codes a call may fail with: the specification's and
/// flatnet's (docs/cni.md#error-codes).
const ERROR_CODES: [u64; 15] = [1, 2, 3, 4, 5, 6, 7, 11, 100, 101, 102, 103, 104, 105, 106];

/// Maps that hold one entry per pod address or pod.
const PER_POD_MAPS: [&str; 4] = [
    MAP_ARP_RESPONDER,
    MAP_NDP_RESPONDER,
    MAP_MANAGED_ADDRS,
    MAP_POLICY_SUBJECTS,
];

/// The LAN, the node and its agent, serving network `dual` (an IPv4 and an
/// IPv6 subnet) under a policy that isolates every
/// pod and lets in [`ALLOWED_PORT`].
struct Node {
    /// First field: the agent stops before the namespaces go.
    agent: StandaloneAgent,
    node: TestNetns,
    _lan: TestNetns,
    dir: tempfile::TempDir,
}

impl Node {
    fn for_test(test: &str) -> Option<Self> {
        if !privileged(test) {
            return None;
        }
        let AgentOnLan {
            agent,
            node,
            lan,
            master,
            dir,
        } = AgentOnLan::new(
            "ff",
            &["192.0.2.1/24", "2001:db8::1/64"],
            &["--conflict-probe-ms", "100"],
        );
        agent.write_state(&format!(
            r#"
subnets:
  - name: lan4
    spec:
      flatMode: macvlan
      master: {master}
      cidr: 192.0.2.0/24
      ranges: [{{from: 192.0.2.10, to: 192.0.2.250}}]
  - name: lan6
    spec:
      flatMode: macvlan
      master: {master}
      cidr: "2001:db8::/64"
      ranges: [{{from: "2001:db8::10", to: "2001:db8::ff0"}}]
networks:
  - {{name: dual, subnets: [lan4, lan6]}}
policies:
  - apiVersion: k8s.cni.cncf.io/v1beta1
    kind: MultiNetworkPolicy
    metadata: {{name: allow-one-port, namespace: default}}
    spec:
      podSelector: {{}}
      policyTypes: [Ingress]
      ingress: [{{ports: [{{port: {ALLOWED_PORT}}}]}}]
"#
        ));
        Some(Self {
            agent,
            node,
            _lan: lan,
            dir,
        })
    }

    fn start(&mut self) {
        self.agent.start(None, |agent| {
            run_cni(&agent.socket(), "STATUS", "dual", "", None, json!({})).0
        });
    }

    fn cni(&self, command: &str, container: &str, pod: Option<&TestNetns>) -> (bool, Value) {
        let netns = pod.map(TestNetns::path);
        run_cni(
            &self.agent.socket(),
            command,
            "dual",
            container,
            netns.as_deref(),
            json!({}),
        )
    }

    fn add(&self, container: &str, pod: &TestNetns) -> Value {
        let (ok, out) = self.cni("ADD", container, Some(pod));
        assert!(ok, "ADD {container}: {out}");
        out
    }

    fn del(&self, container: &str, pod: &TestNetns) {
        let (ok, out) = self.cni("DEL", container, Some(pod));
        assert!(ok, "DEL {container}: {out}");
        wait_until(&format!("DEL {container} never finished"), || {
            !self.agent.has_record(container) && !has_link(pod, IFNAME)
        });
    }

    fn allocated(&self) -> Vec<String> {
        let mut out: Vec<String> = self.agent.allocations()["allocations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a["address"].as_str().unwrap().to_owned())
            .collect();
        out.sort();
        out
    }

    /// Entries of a pinned map of this agent (bpftool's dump).
    fn map_entries(&self, map: &str) -> usize {
        let path = self.agent.pin.path.join(map);
        let dump = run(
            "bpftool",
            &["-j", "map", "dump", "pinned", &path.display().to_string()],
        );
        serde_json::from_str::<Vec<Value>>(&dump)
            .unwrap_or_else(|e| panic!("bpftool dump of {map}: {e}: {dump}"))
            .len()
    }

    /// flatnet's node routes (protocol 241) of both families.
    fn node_routes(&self) -> String {
        let v4 = self.node.ip(&["-4", "route", "show", "proto", "241"]);
        let v6 = self.node.ip(&["-6", "route", "show", "proto", "241"]);
        format!("{v4}{v6}").trim().to_owned()
    }

    /// Links in the node namespace besides loopback and the master: a
    /// macvlan half-made in the node before it moved into its pod.
    fn extra_node_links(&self) -> Vec<String> {
        self.node
            .ip(&["-o", "link", "show", "type", "macvlan"])
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Asserts that nothing of any pod is left: interfaces, addresses,
    /// records, node routes, per-pod map entries, pod link pins.
    fn assert_nothing_left(&self, pods: &[TestNetns], context: &str) {
        // DEL answers once the pod is out of the address tables; the rest
        // of the removal (interface, allocation, record) and the policy
        // controller's pass follow. Give them time, then check each part.
        let settled = || {
            self.agent.records() == 0
                && self.allocated().is_empty()
                && PER_POD_MAPS.iter().all(|map| self.map_entries(map) == 0)
        };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !settled() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        for pod in pods {
            assert!(!has_link(pod, IFNAME), "{context}: {} kept eth1", pod.name);
        }
        assert_eq!(
            self.allocated(),
            Vec::<String>::new(),
            "{context}: allocations"
        );
        assert_eq!(self.agent.records(), 0, "{context}: records");
        assert_eq!(self.node_routes(), "", "{context}: node routes");
        assert_eq!(
            self.extra_node_links(),
            Vec::<String>::new(),
            "{context}: node links"
        );
        for map in PER_POD_MAPS {
            assert_eq!(self.map_entries(map), 0, "{context}: entries of {map}");
        }
        let pod_pins: Vec<String> = link_pins(&self.agent.pin.path)
            .into_iter()
            .filter(|pin| !pin.ends_with(PROG_UPLINK_INGRESS))
            .collect();
        assert_eq!(pod_pins, Vec::<String>::new(), "{context}: pod link pins");
    }
}

/// SplitMix64: a seeded generator, so a failing run can be repeated.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What the runtime believes of one pod's attachment.
#[derive(Clone, Debug, PartialEq)]
enum Believed {
    /// Never added, or deleted successfully.
    Detached,
    /// ADD succeeded with this result.
    Attached(Value),
    /// ADD failed or DEL failed: the runtime must DEL (again).
    MustDelete,
}

/// The outcome of one CNI call: success, or a well-formed CNI error whose
/// code is one of [`ERROR_CODES`] (anything else fails the test).
fn checked(command: &str, container: &str, (ok, out): (bool, Value)) -> Result<Value, u64> {
    if ok {
        return Ok(out);
    }
    let code = out["code"]
        .as_u64()
        .unwrap_or_else(|| panic!("{command} {container}: not a CNI error object: {out}"));
    assert!(
        out["msg"].as_str().is_some_and(|m| !m.is_empty()),
        "{command} {container}: error without a message: {out}"
    );
    assert!(
        ERROR_CODES.contains(&code),
        "{command} {container}: code {code} is no CNI error code: {out}"
    );
    Err(code)
}

/// The addresses of an ADD result.
fn addresses(result: &Value) -> Vec<String> {
    result["ips"]
        .as_array()
        .unwrap()
        .iter()
        .map(|ip| ip["address"].as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn sigkill_under_parallel_cni_calls_leaves_nothing_and_every_call_is_answered() {
    const TEST: &str = "sigkill_under_parallel_cni_calls_leaves_nothing_and_every_call_is_answered";
    const CLIENTS: usize = 4;
    const PODS_PER_CLIENT: usize = 6;
    let Some(mut node) = Node::for_test(TEST) else {
        return;
    };
    let calls: usize = env_or("FLATNET_FAULT_CALLS", 500);
    let seed: u64 = env_or(
        "FLATNET_FAULT_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    );
    println!("{TEST}: {calls} calls, FLATNET_FAULT_SEED={seed}");
    node.start();

    let pods: Vec<TestNetns> = (0..CLIENTS * PODS_PER_CLIENT)
        .map(|_| TestNetns::new("ffp-"))
        .collect();
    let container = |i: usize| format!("fault-{i}");
    let believed: Vec<Mutex<Believed>> = pods
        .iter()
        .map(|_| Mutex::new(Believed::Detached))
        .collect();
    // GC lists every attachment the runtime believes in; it runs alone so
    // no ADD is in flight while it decides what is stale.
    let gc_lock = RwLock::new(());
    let codes: Mutex<BTreeMap<(String, u64), usize>> = Mutex::new(BTreeMap::new());
    let done = std::sync::atomic::AtomicUsize::new(0);
    let (mut kills, mut successes) = (0usize, 0usize);
    let mut restart_time = Duration::ZERO;
    let socket = node.agent.socket();

    std::thread::scope(|scope| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|client| {
                let (pods, believed, gc_lock, codes, done, socket) =
                    (&pods, &believed, &gc_lock, &codes, &done, &socket);
                scope.spawn(move || {
                    let mut rng = Rng(seed ^ (client as u64 + 1));
                    let mut ok = 0usize;
                    for _ in 0..calls / CLIENTS {
                        let call = |command: &str, i: usize| {
                            let netns = pods[i].path();
                            run_cni(
                                socket,
                                command,
                                "dual",
                                &container(i),
                                Some(&netns),
                                json!({}),
                            )
                        };
                        let outcome = if rng.below(25) == 0 {
                            let _alone = gc_lock.write().unwrap();
                            let valid: Vec<Value> = believed
                                .iter()
                                .enumerate()
                                .filter(|(_, b)| {
                                    matches!(*b.lock().unwrap(), Believed::Attached(_))
                                })
                                .map(
                                    |(i, _)| json!({"containerID": container(i), "ifname": IFNAME}),
                                )
                                .collect();
                            let out = run_cni(
                                socket,
                                "GC",
                                "dual",
                                "",
                                None,
                                json!({"cni.dev/valid-attachments": valid}),
                            );
                            checked("GC", "", out).map(drop).map_err(|c| ("GC", c))
                        } else {
                            let _shared = gc_lock.read().unwrap();
                            let i = client * PODS_PER_CLIENT
                                + usize::try_from(rng.below(PODS_PER_CLIENT as u64)).unwrap();
                            let mut state = believed[i].lock().unwrap();
                            match &*state {
                                Believed::Detached => {
                                    match checked("ADD", &container(i), call("ADD", i)) {
                                        Ok(result) => {
                                            assert_eq!(addresses(&result).len(), 2, "{result}");
                                            *state = Believed::Attached(result);
                                            Ok(())
                                        }
                                        Err(code) => {
                                            *state = Believed::MustDelete;
                                            Err(("ADD", code))
                                        }
                                    }
                                }
                                Believed::Attached(_) | Believed::MustDelete => {
                                    match checked("DEL", &container(i), call("DEL", i)) {
                                        Ok(_) => {
                                            *state = Believed::Detached;
                                            Ok(())
                                        }
                                        Err(code) => {
                                            *state = Believed::MustDelete;
                                            Err(("DEL", code))
                                        }
                                    }
                                }
                            }
                        };
                        match outcome {
                            Ok(()) => ok += 1,
                            Err((command, code)) => {
                                if code == 11 {
                                    // The agent is down: back off as a runtime does.
                                    std::thread::sleep(Duration::from_millis(300));
                                }
                                *codes
                                    .lock()
                                    .unwrap()
                                    .entry((command.to_owned(), code))
                                    .or_default() += 1;
                            }
                        }
                    }
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    ok
                })
            })
            .collect();
        // This thread kills the agent at random moments and restarts it.
        let mut rng = Rng(seed);
        while done.load(std::sync::atomic::Ordering::SeqCst) < CLIENTS {
            std::thread::sleep(Duration::from_millis(500 + rng.below(2500)));
            if done.load(std::sync::atomic::Ordering::SeqCst) == CLIENTS {
                break;
            }
            node.agent.kill();
            kills += 1;
            let restarting = std::time::Instant::now();
            node.start();
            restart_time += restarting.elapsed();
        }
        successes = clients.into_iter().map(|c| c.join().unwrap()).sum();
    });
    let codes = codes.into_inner().unwrap();
    // ADDs and DELs the kills cut short, which a restart finished.
    let log = std::fs::read_to_string(node.agent.log_file()).unwrap();
    let adds = log.matches("undoing an ADD interrupted").count();
    let dels = log.matches("finishing a DEL interrupted").count();
    println!(
        "{TEST}: {kills} kills ({restart_time:?} restarting), {adds} ADDs undone and {dels} \
         DELs finished at restart, {successes} calls succeeded, failures by command and code: \
         {codes:?}"
    );
    let failures: usize = codes.values().sum();
    assert_eq!(
        successes + failures,
        calls / CLIENTS * CLIENTS,
        "every call was answered"
    );
    assert!(kills > 0, "the agent was killed");
    assert!(successes > 0, "calls succeeded");

    // One more kill at rest, then the runtime finishes what it must (a DEL
    // for every failed ADD or DEL).
    node.agent.kill();
    node.start();
    let believed: Vec<Believed> = believed
        .into_iter()
        .map(|b| b.into_inner().unwrap())
        .collect();
    for (i, state) in believed.iter().enumerate() {
        if *state == Believed::MustDelete {
            node.del(&container(i), &pods[i]);
        }
    }
    // Every ADD that succeeded is attached, with its addresses, and CHECK
    // agrees; no address is given twice.
    let mut attached_addresses = Vec::new();
    for (i, state) in believed.iter().enumerate() {
        match state {
            Believed::Attached(result) => {
                assert!(has_link(&pods[i], IFNAME), "{} lost eth1", container(i));
                let shown = pods[i].ip(&["-o", "addr", "show", "dev", IFNAME]);
                for address in addresses(result) {
                    assert!(
                        shown.contains(&address),
                        "{}: {address} missing: {shown}",
                        container(i)
                    );
                    attached_addresses.push(address.split('/').next().unwrap().to_owned());
                }
                let netns = pods[i].path();
                let out = run_cni(
                    &node.agent.socket(),
                    "CHECK",
                    "dual",
                    &container(i),
                    Some(&netns),
                    json!({"prevResult": result}),
                );
                assert!(out.0, "CHECK {}: {}", container(i), out.1);
            }
            Believed::Detached | Believed::MustDelete => {
                assert!(!has_link(&pods[i], IFNAME), "{} kept eth1", container(i));
            }
        }
    }
    attached_addresses.sort();
    assert_eq!(
        node.allocated(),
        attached_addresses,
        "allocations are the attached addresses: {:#}\nbelieved: {believed:?}",
        node.agent.allocations()
    );
    let attached = believed
        .iter()
        .filter(|b| matches!(b, Believed::Attached(_)))
        .count();
    assert_eq!(node.agent.records(), attached, "one record per attachment");
    assert!(
        node.extra_node_links().is_empty(),
        "no half-made interface in the node"
    );

    for (i, state) in believed.iter().enumerate() {
        if matches!(state, Believed::Attached(_)) {
            node.del(&container(i), &pods[i]);
        }
    }
    node.assert_nothing_left(&pods, "after the last DEL");
    node.agent.stop();
}

#[test]
fn a_del_killed_after_its_answer_is_finished_at_restart() {
    let Some(mut node) = Node::for_test("a_del_killed_after_its_answer_is_finished_at_restart")
    else {
        return;
    };
    node.agent
        .start(Some((CRASH_AT_ENV, "del-answered")), |agent| {
            run_cni(&agent.socket(), "STATUS", "dual", "", None, json!({})).0
        });
    let pod = TestNetns::new("ffx-");
    node.add("c-del", &pod);
    // The agent dies right after handing over its answer, which may or
    // may not reach flatnet-cni first (11 then). Either way the test does
    // not repeat the DEL, as a runtime that saw it succeed would not: the
    // restart alone must finish it.
    let outcome = checked("DEL", "c-del", node.cni("DEL", "c-del", Some(&pod)));
    assert!(matches!(outcome, Ok(_) | Err(11)), "{outcome:?}");
    assert!(
        !node.agent.wait_for_exit().success(),
        "the agent died after answering"
    );
    assert!(node.agent.has_record("c-del"), "the removal was cut short");

    node.start();
    wait_until("the interrupted DEL was never finished", || {
        !node.agent.has_record("c-del")
    });
    node.assert_nothing_left(&[pod], "after the restart");
    node.agent.stop();
}

/// Echoes what it reads on every accepted connection.
fn echo_server(ns: &TestNetns, addr: &str, port: u16) {
    let target: SocketAddr = format!("{addr}:{port}").parse().unwrap();
    let listener = flatnet_agent::netns::run_in_netns(&ns.path(), || TcpListener::bind(target))
        .unwrap()
        .unwrap();
    std::thread::spawn(move || {
        for mut stream in listener.incoming().flatten() {
            std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 || stream.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
}

/// Sends `text` on `stream` and reads it back.
fn round_trip(stream: &mut TcpStream, text: &str) -> std::io::Result<()> {
    stream.write_all(text.as_bytes())?;
    let mut back = vec![0u8; text.len()];
    stream.read_exact(&mut back)?;
    assert_eq!(back, text.as_bytes());
    Ok(())
}

/// A TCP connection from `ns` to `addr:port`; `None` when the SYN is dropped.
fn connect(ns: &TestNetns, addr: &str, port: u16) -> Option<TcpStream> {
    let target: SocketAddr = format!("{addr}:{port}").parse().unwrap();
    flatnet_agent::netns::run_in_netns(&ns.path(), || {
        TcpStream::connect_timeout(&target, Duration::from_secs(2)).ok()
    })
    .unwrap()
}

#[test]
fn an_established_flow_through_the_policy_survives_a_sigkill_and_restart() {
    let Some(mut node) =
        Node::for_test("an_established_flow_through_the_policy_survives_a_sigkill_and_restart")
    else {
        return;
    };
    node.start();
    let (web, client) = (TestNetns::new("ffw-"), TestNetns::new("ffc-"));
    let result = node.add("web", &web);
    node.add("client", &client);
    let web_addr = addresses(&result)[0].split('/').next().unwrap().to_owned();
    echo_server(&web, &web_addr, ALLOWED_PORT);
    echo_server(&web, &web_addr, DENIED_PORT);
    let log = node.agent.log_file();
    let applied = || {
        std::fs::read_to_string(&log)
            .unwrap()
            .matches("network policy applied")
            .count()
    };
    wait_until("the policy was never applied", || applied() > 0);
    assert!(
        connect(&client, &web_addr, DENIED_PORT).is_none(),
        "the policy is enforced"
    );
    let mut flow = connect(&client, &web_addr, ALLOWED_PORT).expect("the allowed port connects");
    flow.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    round_trip(&mut flow, "before").unwrap();

    node.agent.kill();
    round_trip(&mut flow, "while the agent is down").expect("the flow passes without the agent");
    let before_restart = applied();
    node.start();
    wait_until("the restarted agent applied no policy", || {
        applied() > before_restart
    });
    round_trip(&mut flow, "after the restart").expect("the flow survives the restart");
    assert!(
        connect(&client, &web_addr, DENIED_PORT).is_none(),
        "the restarted agent still enforces the policy"
    );
    drop(flow);
    node.del("web", &web);
    node.del("client", &client);
    node.agent.stop();
}

/// A small tmpfs mounted on a directory, unmounted on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let dir_text = dir.display().to_string();
        run(
            "mount",
            &[
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0700"),
                "tmpfs",
                &dir_text,
            ],
        );
        Self(dir.to_path_buf())
    }

    /// Fills the file system with a filler file until it is full.
    fn fill(&self) {
        let mut filler = std::fs::File::create(self.0.join("filler")).unwrap();
        let block = [0u8; 4096];
        loop {
            match filler.write_all(&block) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("fill {}: {e}", self.0.display()),
            }
        }
        // Metadata of new files may still fit in a few free inodes: that is fine,
        // their data does not.
    }

    fn free(&self) {
        std::fs::remove_file(self.0.join("filler")).unwrap();
    }

    /// Makes the directory read-only for new opens: a read-only bind
    /// mount over it (a remount of the tmpfs itself is refused while the
    /// agent holds its journal open for writing).
    fn read_only(&self) {
        let dir = self.0.display().to_string();
        run("mount", &["--bind", &dir, &dir]);
        run("mount", &["-o", "remount,bind,ro", &dir]);
    }

    fn writable(&self) {
        run("umount", &[&self.0.display().to_string()]);
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// Asserts that a CNI call failed with a well-formed error naming the
/// problem (one of `words`) and returns its code.
fn assert_clear_error(out: (bool, Value), context: &str, words: &[&str]) -> u64 {
    let text = out.1.to_string();
    let code = checked(context, "", out).expect_err(context);
    assert!(
        words.iter().any(|w| text.contains(w)),
        "{context}: the error does not say why ({words:?}): {text}"
    );
    code
}

#[test]
fn a_full_or_read_only_state_directory_gives_clear_errors_and_loses_nothing() {
    let Some(mut node) =
        Node::for_test("a_full_or_read_only_state_directory_gives_clear_errors_and_loses_nothing")
    else {
        return;
    };
    let storage: Vec<Tmpfs> = ["state", "records"]
        .iter()
        // Room for the record journal, which preallocates 1 MiB and
        // rewrites itself through a temporary copy at start.
        .map(|d| Tmpfs::mount(&node.dir.path().join(d), "4m"))
        .collect();
    node.start();
    let kept = TestNetns::new("ffk-");
    let kept_result = node.add("kept", &kept);
    let kept_addresses = node.allocated();
    assert_eq!(kept_addresses.len(), 2);

    for (case, words) in [
        ("full", &["No space left", "ENOSPC"][..]),
        ("read-only", &["Read-only", "EROFS"][..]),
    ] {
        for fs in &storage {
            match case {
                "full" => fs.fill(),
                _ => fs.read_only(),
            }
        }
        let pod = TestNetns::new("ffd-");
        let out = node.cni("ADD", "refused", Some(&pod));
        let error = out.1.clone();
        assert_clear_error(out, &format!("ADD with a {case} state directory"), words);
        println!("ADD with a {case} state directory: {error}");
        // The runtime's DEL after the failed ADD: it cleans up what it can,
        // and says so if it cannot record it.
        let _ = checked("DEL", "refused", node.cni("DEL", "refused", Some(&pod)));
        assert!(
            !has_link(&pod, IFNAME),
            "{case}: the refused pod has no interface"
        );
        // Nothing of the existing attachment is lost.
        assert_eq!(node.allocated(), kept_addresses, "{case}: allocations kept");
        assert!(node.agent.has_record("kept"), "{case}: record kept");
        assert!(has_link(&kept, IFNAME), "{case}: interface kept");
        let netns = kept.path();
        let check = run_cni(
            &node.agent.socket(),
            "CHECK",
            "dual",
            "kept",
            Some(&netns),
            json!({"prevResult": kept_result}),
        );
        assert!(check.0, "{case}: CHECK of the kept pod: {}", check.1);

        for fs in &storage {
            match case {
                "full" => fs.free(),
                _ => fs.writable(),
            }
        }
        // With room again, the runtime's retries succeed and leave nothing.
        node.del("refused", &pod);
        let result = node.add("refused", &pod);
        assert_eq!(addresses(&result).len(), 2, "{case}: {result}");
        node.del("refused", &pod);
        assert_eq!(
            node.allocated(),
            kept_addresses,
            "{case}: only the kept pod's addresses"
        );
    }
    // The agent restarts from what is on disk: the kept pod is still known.
    node.agent.kill();
    node.start();
    assert!(node.agent.has_record("kept"));
    node.del("kept", &kept);
    assert!(node.allocated().is_empty());
    node.agent.stop();
    drop(storage);
}
