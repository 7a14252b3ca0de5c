//! ADD: claim → pending record → conflict probe → attach → policy
//! programs, alongside activate → ready record → tables → policy wait →
//! answer; a failure undoes what was made ([`Inner::teardown`]).

use std::sync::Arc;

use flatnet_k8s::validation::ValidSubnet;
use tracing::Instrument;

use super::{
    Inner, conflict_check::ConflictCheck, internal, join_ips, key_of, link_error, pod_of, spec,
    tables::PolicyAttach, task_failed,
};
use crate::{
    cni::{AttachRequest, CniError, CniResult, ErrorCode, NetworkConfig},
    desired::{AttachmentKey, ClaimRequest, DesiredState, PodRef},
    link::{LinkError, LinkMode, format_mac, parse_mac},
    netns::open_netns,
    packet::MacAddr,
    phases::{self, timed},
    probe::ForeignClaim,
    records::{AttachmentRecord, RecordPhase, UplinkRecord},
};

/// What a successful ADD answers, and what follows the answer.
pub(super) struct Added {
    /// The CNI result.
    pub result: CniResult,
    /// Whether the policy programs are to move from filters into TCX links
    /// after the answer ([`Inner::upgrade_policy_later`]).
    pub upgrade_policy: bool,
}

/// A failed step after the claim, by what undoing it must remove.
enum SetUpError {
    /// Nothing on the pod side is flatnet's (failed before the interface
    /// was made, or the pod's existing interface is not ours): teardown
    /// leaves the pod's interfaces alone.
    NothingMade(CniError),
    /// The pod interface may be flatnet's: teardown deletes it.
    InterfaceMade(CniError),
}

impl<S: DesiredState> Inner<S> {
    /// ADD.
    pub(super) async fn add(self: &Arc<Self>, request: AttachRequest) -> Result<Added, CniError> {
        // Before anything is claimed: a pending record with a namespace
        // nothing can enter would outlive every later request.
        open_netns(&request.netns)
            .map_err(|e| CniError::new(ErrorCode::InvalidEnvironment, e.to_string()))?;
        let key = key_of(&request.attachment);
        let _guard = self
            .locks
            .lock(&key)
            .instrument(phases::phase("lock"))
            .await;
        let config = &request.config;
        let earlier = timed("record_load", || self.records.load(&key)).map_err(internal)?;
        if let Some(record) = earlier {
            if record.network != config.name {
                return Err(CniError::new(
                    ErrorCode::InvalidEnvironment,
                    format!(
                        "CNI_IFNAME {} of container {} is already attached to network {:?} ({}); \
                         DEL it from that network first, or give network {:?} another interface name",
                        key.ifname,
                        key.container_id,
                        record.network,
                        join_ips(&record.ips()),
                        config.name
                    ),
                ));
            }
            if record.phase == RecordPhase::Ready && record.netns == request.netns {
                // A repeated ADD: the same answer.
                let subnets = spec::valid_subnets(&record)?;
                let attachment = spec::attachment_spec(
                    &record,
                    &subnets,
                    &self.config.spec,
                    self.announcement(config),
                )?;
                return Ok(Added {
                    result: spec::cni_result(&attachment, record.mac.as_deref(), &config.dns),
                    upgrade_policy: false,
                });
            }
            tracing::info!(key = %key, "replacing an earlier or unfinished attachment of the same network");
            self.teardown(&record, true).await?;
        }

        let claim_request = claim_request(&request, key.clone())?;
        let claim = self
            .desired
            .claim(&claim_request)
            .instrument(phases::phase("claim"))
            .await
            .map_err(|e| e.to_cni())?;
        let mut record = AttachmentRecord {
            key: key.clone(),
            network: config.name.clone(),
            netns: request.netns.clone(),
            pod: claim_request.pod.clone(),
            phase: RecordPhase::Pending,
            subnets: claim.subnets.clone(),
            addresses: claim.addresses.clone(),
            requested_mac: claim.mac.map(format_mac),
            mac: None,
            mtu: config.mtu,
            uplink: None,
            host_route: None,
            primary_defaults: None,
            parent: None,
            unreported_mtu: None,
        };
        // Validated once; the parent link goes into the record for teardown.
        let subnets = match spec::valid_subnets(&record) {
            Ok(subnets) => subnets,
            Err(error) => {
                self.release_quietly(&record).await;
                return Err(error);
            }
        };
        record.parent = subnets.first().map(|s| s.parent.clone());
        // Sent as soon as the addresses are known: the LAN's answers come
        // while the record is written and the interface made.
        let check = self.start_conflict_check(&subnets, &record);
        if let Err(error) = self
            .read_primary_network(&mut record)
            .instrument(phases::phase("primary_network"))
            .await
        {
            self.release_quietly(&record).await;
            return Err(link_error(&error));
        }
        if let Err(error) = timed("record_pending", || self.records.save_unsynced(&record)) {
            self.release_quietly(&record).await;
            return Err(internal(error));
        }
        match self.set_up(&mut record, &subnets, config, check).await {
            Ok(added) => Ok(added),
            Err(failure) => {
                let (error, interface_made) = match failure {
                    SetUpError::NothingMade(error) => (error, false),
                    SetUpError::InterfaceMade(error) => (error, true),
                };
                if let Err(undo) = self.teardown(&record, interface_made).await {
                    tracing::error!(key = %key, error = %undo, "cannot undo a failed ADD; DEL or GC will retry");
                }
                Err(error)
            }
        }
    }

    /// What removing the attachment must know of the pod's primary network,
    /// read before anything is made: the node routes to the pod
    /// (`addPodIPToHost`) and the default gateways the flat interface takes
    /// over (`flatNetworkDefaultGateway`).
    async fn read_primary_network(&self, record: &mut AttachmentRecord) -> Result<(), LinkError> {
        let attachments = &self.config.attachments;
        if spec::wants_host_route(record) {
            record.host_route = Some(
                attachments
                    .resolve_host_route(&record.netns, spec::PRIMARY_IFNAME)
                    .await?,
            );
        }
        if spec::moves_default_route(record) {
            record.primary_defaults = Some(
                attachments
                    .primary_defaults(&record.netns, spec::PRIMARY_IFNAME)
                    .await?,
            );
        }
        Ok(())
    }

    /// The steps after the claim.
    async fn set_up(
        self: &Arc<Self>,
        record: &mut AttachmentRecord,
        subnets: &[ValidSubnet],
        config: &NetworkConfig,
        check: Option<ConflictCheck>,
    ) -> Result<Added, SetUpError> {
        let attachment = spec::attachment_spec(
            record,
            subnets,
            &self.config.spec,
            self.announcement(config),
        )
        .map_err(SetUpError::NothingMade)?;
        let valid = attachment.validate().map_err(|e| {
            SetUpError::NothingMade(CniError::new(
                ErrorCode::InvalidNetworkConfig,
                e.to_string(),
            ))
        })?;
        // The probe runs while the interface is made; the interface comes
        // up (and its addresses are announced) only on a clear verdict.
        let attachments = &self.config.attachments;
        let mut refused = None;
        let since_ns = check.as_ref().map(|check| check.since_ns);
        let attached = match check {
            Some(check) => {
                let pod = record.pod.clone();
                let uplink = attachment.parent.ifname();
                let own_mac = claim_mac(record);
                let refused = &mut refused;
                let verdict = async move {
                    let verdict = self.conflict_verdict(&check, own_mac).await;
                    match refusal(verdict, &pod, &uplink) {
                        Ok(()) => true,
                        Err(error) => {
                            *refused = Some(error);
                            false
                        }
                    }
                };
                attachments
                    .attach_valid_gated(
                        &valid,
                        // The phase's span is made when the attach awaits
                        // the verdict, so it times only what is left of it.
                        Box::pin(async move {
                            verdict
                                .instrument(phases::phase("attach.probe_verdict"))
                                .await
                        }),
                    )
                    .instrument(phases::phase("link_attach"))
                    .await
            }
            None => {
                attachments
                    .attach_valid(&valid)
                    .instrument(phases::phase("link_attach"))
                    .await
            }
        };
        let made = match attached {
            Ok(made) => made,
            // Refused by the probe: the attach removed what it made.
            Err(LinkError::StoppedBeforeUp { .. }) if refused.is_some() => {
                return Err(SetUpError::NothingMade(
                    refused.expect("checked by the guard"),
                ));
            }
            // The pod's existing interface is not ours: leave it alone.
            Err(error @ LinkError::AlreadyExists { .. }) => {
                return Err(SetUpError::NothingMade(link_error(&error)));
            }
            Err(error) => return Err(SetUpError::InterfaceMade(link_error(&error))),
        };
        // The interface, its addresses and node routes exist; the record
        // still says pending.
        crate::crash_point::crash_point("add-attached");
        let mac = made.mac;
        let owner_mac = match attachment.kind {
            LinkMode::Macvlan(_) => Some(mac),
            // ipvlan children share the parent's MAC; the parent's is read below.
            LinkMode::Ipvlan(..) => None,
        };
        let uplink = Self::uplink_record(&made, owner_mac, !attachment.kind.announces());
        record.mac = Some(format_mac(mac));
        record.uplink = Some(uplink.clone());
        // The policy programs go on while the allocation is activated and
        // the ready record waits for the disk: the answer waits for both,
        // and an agent restarting after the ready record attaches them
        // again (recovery of a ready record).
        let policy = {
            let inner = Arc::clone(self);
            let record = record.clone();
            tokio::spawn(
                async move { inner.attach_policy(&record, PolicyAttach::AtOnce).await }
                    .instrument(phases::phase("policy_attach")),
            )
        };
        let ready = async {
            self.desired
                .activate()
                .instrument(phases::phase("activate"))
                .await
                .map_err(|e| e.to_cni())?;
            record.phase = RecordPhase::Ready;
            record.unreported_mtu = S::REPORTS_ACTIVE.then_some(made.mtu);
            timed("record_ready", || self.records.save(record)).map_err(internal)
        }
        .await;
        // Both finish before a failure is undone: teardown must not race
        // the attach.
        let upgrade_policy = policy
            .await
            .unwrap_or_else(|error| Err(task_failed(&error)))
            .map_err(SetUpError::InterfaceMade)?;
        ready.map_err(SetUpError::InterfaceMade)?;
        // The table entries follow the ready record, which lists them: a
        // restart before they are in place puts them there (recovery of a
        // ready record), and a pending record never has any to remove.
        self.program_tables(record, &uplink)
            .instrument(phases::phase("tables"))
            .await
            .map_err(SetUpError::InterfaceMade)?;
        if let Some(since_ns) = since_ns {
            self.raise_claims_since(record, since_ns);
        }
        tracing::info!(key = %record.key, pod = %record.pod, addresses = ?record.ips(), mac = %format_mac(mac), "pod attached");
        self.report_active_later(record);
        self.policy_in_force_for(record)
            .instrument(phases::phase("policy_wait"))
            .await;
        Ok(Added {
            result: spec::cni_result(&attachment, record.mac.as_deref(), &config.dns),
            upgrade_policy,
        })
    }

    /// The uplink of `made` as the tables list it (index and MAC as the
    /// attach read them, no further look-up).
    fn uplink_record(
        made: &crate::link::Attachment,
        owner_mac: Option<[u8; 6]>,
        responder: bool,
    ) -> UplinkRecord {
        UplinkRecord {
            ifname: made.parent.clone(),
            ifindex: made.parent_index,
            owner_mac: format_mac(owner_mac.unwrap_or(made.parent_mac)),
            responder,
        }
    }
}

/// The MAC the pod asked for, if any: its own frames claim nothing.
fn claim_mac(record: &AttachmentRecord) -> Option<MacAddr> {
    record.requested_mac.as_deref().and_then(parse_mac)
}

/// The conflict check's verdict as ADD answers it: refused when another
/// host claims an address; a probe that could not run is logged and does
/// not stop ADD.
fn refusal(
    verdict: Result<Option<ForeignClaim>, String>,
    pod: &PodRef,
    uplink: &str,
) -> Result<(), CniError> {
    match verdict {
        Ok(None) => Ok(()),
        Ok(Some(claim)) => Err(CniError::new(
            ErrorCode::AddressConflict,
            format!(
                "address {} of {pod} is already in use on the LAN by MAC {} (answered on {uplink}); \
                 free it on that host or give the pod another address",
                claim.addr,
                format_mac(claim.mac)
            ),
        )),
        Err(error) => {
            tracing::warn!(%error, %uplink, "conflict probe failed; continuing without it");
            Ok(())
        }
    }
}

/// What ADD asks the desired state for.
fn claim_request(request: &AttachRequest, key: AttachmentKey) -> Result<ClaimRequest, CniError> {
    let config: &NetworkConfig = &request.config;
    let runtime = config.runtime_config.as_ref();
    let requested_mac = match runtime {
        Some(runtime) => runtime.requested_mac()?.map(|mac| mac.0),
        None => None,
    };
    Ok(ClaimRequest {
        network: config.name.clone(),
        subnet: config.subnet.clone(),
        key,
        pod: pod_of(&request.attachment),
        requested_ips: runtime
            .map(|r| r.ips.iter().map(|ip| ip.addr).collect())
            .unwrap_or_default(),
        requested_mac,
    })
}
