//! How an ADD learns whether another host uses its addresses: a conflict
//! probe it sends itself, or the verdict of one the agent sent ahead of it
//! ([`crate::probe::ahead`]), checked against what the wire inventory saw
//! since; and the loop that probes upcoming addresses ahead.

use std::{collections::BTreeMap, net::IpAddr, sync::Arc, time::Duration};

use flatnet_common::{conflict::ClaimKind, wire::WireKind};
use flatnet_k8s::validation::ValidSubnet;

use super::{AgentService, Inner};
use crate::{
    datapath::{Conflict, WireClaimEntry, monotonic_ns},
    desired::DesiredState,
    link::parse_mac,
    packet::MacAddr,
    probe::{
        ForeignClaim,
        ahead::{AheadProbe, FRESH_FOR},
        run::{ProbeContext, ProbePlan, Probing, send_probes},
    },
    records::AttachmentRecord,
};

/// How recent a claim the wire inventory holds makes a probe wait the
/// whole window instead of the LAN's reply time: the host that made it
/// may answer slowly, or be about to come back.
const SUSPECT_HORIZON: Duration = Duration::from_secs(600);

/// How long the loop that probes ahead lets changes gather before a pass.
const COALESCE: Duration = Duration::from_millis(10);

/// The conflict check of one ADD.
pub(super) struct ConflictCheck {
    how: How,
    /// What a probe sent now asks (also when one made ahead is unusable).
    plan: ProbePlan,
    /// Since when (monotonic ns) the LAN has been asked: claims the wire
    /// inventory saw since then are answers to the check.
    pub(super) since_ns: u64,
}

enum How {
    /// The ADD sent the probe.
    AtAdd(Probing),
    /// Probed ahead of the ADD, one probe per address.
    Ahead(Vec<AheadProbe>),
}

impl<S: DesiredState> Inner<S> {
    /// Starts the conflict check of `record`'s addresses out of its
    /// subnets' uplink: the fresh verdicts of probes made ahead of this ADD
    /// when every address has one (the probes are sent once more, not
    /// waited for), else a probe now. `None` when the probe is off.
    pub(super) fn start_conflict_check(
        self: &Arc<Self>,
        subnets: &[ValidSubnet],
        record: &AttachmentRecord,
    ) -> Option<ConflictCheck> {
        let window = self.config.settings.current().probe_wait;
        if window.is_zero() {
            return None;
        }
        let plan = ProbePlan {
            uplink: subnets.first()?.parent.ifname(),
            addrs: record.ips(),
            reference: subnets.iter().find_map(|s| s.gateway),
            window,
        };
        if let Some(probes) = self.ahead.fresh(&plan.uplink, &plan.addrs) {
            let (host, uplink, addrs) = (
                self.config.attachments.host_netns.clone(),
                plan.uplink.clone(),
                plan.addrs.clone(),
            );
            tokio::task::spawn_blocking(move || {
                if let Err(error) = send_probes(host, &uplink, &addrs) {
                    tracing::debug!(%error, %uplink, "cannot send the conflict probe again at ADD");
                }
            });
            let since_ns = probes.iter().map(|p| p.sent_ns).min().unwrap_or_default();
            return Some(ConflictCheck {
                how: How::Ahead(probes),
                plan,
                since_ns,
            });
        }
        let since_ns = monotonic_ns();
        Some(ConflictCheck {
            how: How::AtAdd(Probing::start(plan.clone(), self.probe_context())),
            plan,
            since_ns,
        })
    }

    /// Where probes get their reply times and suspicions, and count waits.
    fn probe_context(self: &Arc<Self>) -> ProbeContext {
        let inventory = Arc::clone(self);
        ProbeContext {
            host: self.config.attachments.host_netns.clone(),
            reply_times: Arc::clone(&self.reply_times),
            seen_on_wire: Box::new(move |ifindex, addr| inventory.seen_on_wire(ifindex, addr)),
            metrics: self.metrics.probe.clone(),
        }
    }

    /// The check's verdict: the claim of another host that answered in
    /// time, or that the wire inventory saw since a probe made ahead was
    /// sent; `None` when there is none. A probe made ahead that cannot
    /// vouch for every address (it stopped at another address's answer, or
    /// failed) is replaced by a probe now.
    ///
    /// # Errors
    /// The probe could not run (the message says why).
    pub(super) async fn conflict_verdict(
        self: &Arc<Self>,
        check: &ConflictCheck,
        own_mac: Option<MacAddr>,
    ) -> Result<Option<ForeignClaim>, String> {
        let source = |name: &'static str| {
            self.metrics
                .probe
                .add_verdicts
                .get_or_create(&[("source", name)])
                .inc();
        };
        let probes = match &check.how {
            How::AtAdd(probing) => {
                source("at_add");
                return probing.verdict().await;
            }
            How::Ahead(probes) => probes,
        };
        for probe in probes {
            match probe.probing.verdict().await {
                Ok(None) => {}
                Ok(Some(claim)) if check.plan.addrs.contains(&claim.addr) => {
                    source("ahead");
                    return Ok(Some(claim));
                }
                _ => {
                    source("at_add");
                    let probing = Probing::start(check.plan.clone(), self.probe_context());
                    return probing.verdict().await;
                }
            }
        }
        source("ahead");
        let Some(ifindex) = probes.iter().find_map(|p| p.probing.uplink_index()) else {
            return Ok(None);
        };
        let own: Vec<MacAddr> = own_mac.into_iter().collect();
        Ok(self
            .claims_since(ifindex, &check.plan.addrs, check.since_ns, &own)
            .into_iter()
            .next()
            .map(|(claim, _)| ForeignClaim {
                addr: claim.addr,
                mac: claim.mac,
            }))
    }

    /// Whether the inventory saw another host claim `addr` on uplink
    /// `ifindex` within [`SUSPECT_HORIZON`].
    fn seen_on_wire(&self, ifindex: u32, addr: IpAddr) -> bool {
        let mut maps = self.maps.lock().expect("table maps lock poisoned");
        let seen = maps
            .wire_claims_mut()
            .and_then(|wire| wire.seen(ifindex, addr));
        match seen {
            Ok(Some(claim)) => claim.age(monotonic_ns()) < SUSPECT_HORIZON,
            Ok(None) => false,
            Err(error) => {
                tracing::debug!(%error, "cannot read the wire inventory; the probe waits as the LAN answers");
                false
            }
        }
    }

    /// The claims of `addrs` on uplink `ifindex` by MACs other than `own`
    /// that the wire inventory saw since `since_ns` (monotonic), with what
    /// they claimed by; frames that only ask (probes, DAD) claim nothing.
    fn claims_since(
        &self,
        ifindex: u32,
        addrs: &[IpAddr],
        since_ns: u64,
        own: &[MacAddr],
    ) -> Vec<(WireClaimEntry, ClaimKind)> {
        let mut maps = self.maps.lock().expect("table maps lock poisoned");
        let Ok(wire) = maps.wire_claims_mut() else {
            return Vec::new();
        };
        addrs
            .iter()
            .filter_map(|addr| wire.seen(ifindex, *addr).ok().flatten())
            .filter(|claim| claim.last_seen_ns >= since_ns && !own.contains(&claim.mac))
            .filter_map(|claim| {
                let kind = match claim.kind? {
                    WireKind::ArpRequest | WireKind::ArpReply => ClaimKind::ArpReply,
                    WireKind::GratuitousArp => ClaimKind::GratuitousArp,
                    WireKind::NeighborSolicitation | WireKind::NeighborAdvertisement => {
                        ClaimKind::NeighborAdvertisement
                    }
                    _ => return None,
                };
                Some((claim, kind))
            })
            .collect()
    }

    /// Claims of the pod's addresses by other MACs that the wire inventory
    /// saw since `since_ns` (monotonic): answers to the probe that came
    /// after its verdict and before the uplink program watched the
    /// addresses (the tables, just written). Each is raised as a conflict
    /// of the pod.
    pub(super) fn raise_claims_since(self: &Arc<Self>, record: &AttachmentRecord, since_ns: u64) {
        let Some(uplink) = &record.uplink else {
            return;
        };
        let own: Vec<MacAddr> = [record.mac.as_deref(), Some(uplink.owner_mac.as_str())]
            .into_iter()
            .flatten()
            .filter_map(parse_mac)
            .collect();
        for (claim, kind) in self.claims_since(uplink.ifindex, &record.ips(), since_ns, &own) {
            Arc::clone(self).on_conflict(Conflict {
                ifindex: uplink.ifindex,
                addr: claim.addr,
                kind,
                foreign_mac: claim.mac,
                owner_mac: own.first().copied().unwrap_or_default(),
                monotonic_ns: claim.last_seen_ns,
            });
        }
    }

    /// The probes the addresses allocated to pods on this node whose ADD
    /// has not come need, those without a fresh probe: one per uplink, with
    /// its subnets' first gateway as the reference. None when probing is
    /// off.
    fn upcoming_probes(&self) -> Vec<ProbePlan> {
        let window = self.config.settings.current().probe_wait;
        if window.is_zero() {
            self.ahead.clear();
            return Vec::new();
        }
        let Some(upcoming) = self.desired.upcoming_addresses() else {
            return Vec::new();
        };
        let wanted: Vec<(String, IpAddr)> = upcoming
            .iter()
            .map(|u| (u.subnet.parent.ifname(), u.addr))
            .collect();
        let mut plans: BTreeMap<String, ProbePlan> = BTreeMap::new();
        for (uplink, addr) in self.ahead.keep_only(&wanted) {
            plans
                .entry(uplink.clone())
                .or_insert_with(|| ProbePlan {
                    reference: wanted
                        .iter()
                        .zip(&upcoming)
                        .filter(|((on, _), _)| *on == uplink)
                        .find_map(|(_, u)| u.subnet.gateway),
                    uplink,
                    addrs: Vec::new(),
                    window,
                })
                .addrs
                .push(addr);
        }
        plans.into_values().collect()
    }
}

impl<S: DesiredState> AgentService<S> {
    /// Probes addresses ahead of their ADD ([`crate::probe::ahead`])
    /// whenever the upcoming ones change, and again before their probes
    /// grow stale, with the uplink program watching the uplink first;
    /// returns at once where none can be known ahead (standalone). Call
    /// inside a Tokio runtime; runs for the agent's life.
    pub async fn probe_ahead(&self) {
        let Some(changed) = self.inner.desired.upcoming_changed() else {
            return;
        };
        loop {
            for plan in self.inner.upcoming_probes() {
                // The uplink program records every claim on the uplink
                // from now on: an ADD checks the verdict against them.
                if let Err(error) = self.attach_uplink(&plan.uplink).await {
                    tracing::debug!(uplink = %plan.uplink, %error, "not probing ahead of ADD: the uplink program cannot watch the uplink");
                    continue;
                }
                tracing::debug!(uplink = %plan.uplink, addrs = ?plan.addrs, "probing addresses ahead of their ADD");
                let (uplink, addrs) = (plan.uplink.clone(), plan.addrs.clone());
                let sent_ns = monotonic_ns();
                let probing = Probing::start(plan, self.inner.probe_context());
                self.inner
                    .ahead
                    .insert(&uplink, &addrs, &AheadProbe::new(probing, sent_ns));
            }
            tokio::select! {
                // A burst of changes (pods created together, each record
                // written several times) makes one pass.
                () = changed.notified() => tokio::time::sleep(COALESCE).await,
                () = tokio::time::sleep(FRESH_FOR / 2) => {}
            }
        }
    }
}
