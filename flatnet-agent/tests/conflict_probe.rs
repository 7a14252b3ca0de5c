//! The conflict probe off ADD's critical path, on a simulated LAN with the
//! real `flatnet-agent run --standalone` and `flatnet-cni`: the first ADD
//! on an uplink waits the whole configured window and learns the LAN's
//! reply time from the gateway's answer; the next ADDs wait only as long
//! as the LAN takes to answer; a host that answers after that is raised as
//! a conflict of the pod once it is attached. The probe itself
//! ([`Probing`]) on a veth pair: an address the wire inventory saw in use
//! waits the whole window, so the same slow host is caught in time; a
//! fresh one goes on, and is asked again halfway through the window.

mod support;

use std::{
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
    time::Duration,
};

use flatnet_agent::probe::{
    ForeignClaim,
    run::{ProbeContext, ProbeMetrics, ProbePlan, Probing},
    wait::ReplyTimes,
};
use serde_json::{Value, json};
use support::{
    TestNetns,
    agent::{counted, free_local_address},
    cni::run_cni,
    lan::{AgentOnLan, SlowHost},
    privileged, veth_pair, wait_until,
};

const GATEWAY: &str = "192.0.2.1";
/// The probe's window: long, so that the ADD answering before the slow
/// host does is a matter of reply time, not of the machine's load.
const WINDOW_MS: &str = "3000";
/// How long the slow host takes to answer: far beyond the LAN's reply
/// time, well within the window.
const SLOW_ANSWER: Duration = Duration::from_millis(1000);
const FOREIGN_MAC: [u8; 6] = [0x02, 0x00, 0x5e, 0x00, 0x00, 0x77];

struct Lan {
    on_lan: AgentOnLan,
    admin: String,
}

impl Lan {
    fn running_for_test(test: &str) -> Option<Self> {
        if !privileged(test) {
            return None;
        }
        let admin = free_local_address();
        let mut on_lan = AgentOnLan::new(
            "cp",
            &[&format!("{GATEWAY}/24")],
            &["--conflict-probe-ms", WINDOW_MS, "--admin-address", &admin],
        );
        on_lan.agent.write_state(&format!(
            r"
subnets:
  - name: lan4
    spec:
      flatMode: macvlan
      master: {master}
      cidr: 192.0.2.0/24
      gateway: {GATEWAY}
      ranges: [{{from: 192.0.2.10, to: 192.0.2.20}}]
networks:
  - {{name: flat4, subnets: [lan4]}}
",
            master = on_lan.master
        ));
        on_lan.agent.start(None, |agent| {
            run_cni(&agent.socket(), "STATUS", "flat4", "", None, json!({})).0
        });
        Some(Self { on_lan, admin })
    }

    fn add(&self, container: &str, pod: &TestNetns) -> Value {
        let (ok, out) = run_cni(
            &self.on_lan.agent.socket(),
            "ADD",
            "flat4",
            container,
            Some(&pod.path()),
            json!({}),
        );
        assert!(ok, "ADD {container}: {out}");
        out
    }

    fn counted(&self, name: &str) -> u64 {
        counted(&self.admin, name)
    }

    fn waits(&self, basis: &str) -> u64 {
        self.counted(&format!(
            "flatnet_agent_conflict_probe_waits_total{{basis=\"{basis}\"}}"
        ))
    }
}

fn address_of(result: &Value) -> String {
    result["ips"][0]["address"].as_str().unwrap().to_owned()
}

#[test]
fn adds_wait_for_the_lans_reply_time_and_a_late_answer_is_a_conflict() {
    let Some(lan) =
        Lan::running_for_test("adds_wait_for_the_lans_reply_time_and_a_late_answer_is_a_conflict")
    else {
        return;
    };
    // No reply seen on the uplink yet: the whole window; the gateway's
    // answer to the reference probe is the first sample.
    let first = TestNetns::new("cpa-");
    assert_eq!(address_of(&lan.add("c1", &first)), "192.0.2.10/24");
    assert_eq!(lan.waits("no_reply_time"), 1, "the first ADD");
    assert_eq!(lan.waits("reply_time"), 0, "the first ADD");

    let second = TestNetns::new("cpb-");
    assert_eq!(address_of(&lan.add("c2", &second)), "192.0.2.11/24");
    assert_eq!(
        lan.waits("reply_time"),
        1,
        "the second ADD waits the reply time"
    );
    assert_eq!(lan.waits("no_reply_time"), 1);

    // A host answering for the next address, slower than the LAN's reply
    // time: the ADD has answered by then, and the answer is a conflict.
    let target: Ipv4Addr = "192.0.2.12".parse().unwrap();
    let slow = SlowHost::answering(&lan.on_lan.lan, target, SLOW_ANSWER, FOREIGN_MAC);
    let conflicts_before = lan.counted("flatnet_agent_ip_conflicts_total");
    let third = TestNetns::new("cpc-");
    assert_eq!(address_of(&lan.add("c3", &third)), "192.0.2.12/24");
    wait_until("the late answer raised as a conflict", || {
        lan.counted("flatnet_agent_ip_conflicts_total") > conflicts_before
    });
    let log = std::fs::read_to_string(lan.on_lan.agent.log_file()).unwrap();
    let foreign = "02:00:5e:00:00:77";
    assert!(
        log.lines().any(|l| l.contains("IP conflict")
            && l.contains(&IpAddr::V4(target).to_string())
            && l.contains(foreign)),
        "the agent logs the conflict of 192.0.2.12 with {foreign}"
    );
    assert!(slow.finish() >= 1, "the slow host answered the probe");
}

/// Probes 192.0.2.12 out of `uplink0` of a node namespace whose peer is a
/// LAN namespace with a host answering 200 ms after each probe, a fast
/// reply time already known on the uplink and the inventory saying
/// `seen_on_wire`: the verdict, and how many probes the host answered once
/// the window passed.
async fn probe_with_a_slow_host(seen_on_wire: bool) -> (Option<ForeignClaim>, u32, ProbeMetrics) {
    const WINDOW: Duration = Duration::from_millis(1500);
    let node = TestNetns::new("cpn-");
    let lan = TestNetns::new("cpl-");
    veth_pair(&node, "uplink0", &lan, "lan0");
    node.ip(&["link", "set", "uplink0", "up"]);
    lan.ip(&["link", "set", "lan0", "up"]);
    let target: Ipv4Addr = "192.0.2.12".parse().unwrap();
    let slow = SlowHost::answering(&lan, target, Duration::from_millis(200), FOREIGN_MAC);
    let reply_times = Arc::new(ReplyTimes::default());
    reply_times.record("uplink0", Duration::from_micros(50));
    let metrics = ProbeMetrics::default();
    let probing = Probing::start(
        ProbePlan {
            uplink: "uplink0".into(),
            addrs: vec![IpAddr::V4(target)],
            reference: None,
            window: WINDOW,
        },
        ProbeContext {
            host: Some(node.path()),
            reply_times,
            seen_on_wire: Box::new(move |_, addr| seen_on_wire && addr == IpAddr::V4(target)),
            metrics: metrics.clone(),
        },
    );
    let verdict = probing.verdict().await.unwrap();
    // The window's end, and the answer to the probes sent halfway.
    tokio::time::sleep(WINDOW).await;
    (verdict, slow.finish(), metrics)
}

#[tokio::test]
async fn an_address_seen_in_use_waits_the_window_and_a_fresh_one_is_asked_again() {
    if !privileged("an_address_seen_in_use_waits_the_window_and_a_fresh_one_is_asked_again") {
        return;
    }
    let (verdict, answered, metrics) = probe_with_a_slow_host(true).await;
    assert_eq!(
        verdict.map(|c| (c.addr.to_string(), c.mac)),
        Some(("192.0.2.12".to_owned(), FOREIGN_MAC)),
        "seen on the wire: the whole window, refused"
    );
    assert_eq!(answered, 1, "a refused pod's address is not asked again");
    assert_eq!(
        metrics
            .waits
            .get_or_create(&[("basis", "seen_on_wire")])
            .get(),
        1
    );

    let (verdict, answered, metrics) = probe_with_a_slow_host(false).await;
    assert_eq!(
        verdict, None,
        "the reply time: the ADD goes on before the slow host answers"
    );
    assert_eq!(answered, 2, "asked again halfway through the window");
    assert_eq!(
        metrics
            .waits
            .get_or_create(&[("basis", "reply_time")])
            .get(),
        1
    );
}
