//! The FlatNetworkConfig `cluster`, the operator's side: the leader
//! watches it and applies it at run time (no rollout), and keeps its status
//! (the MAC range in use, `observedGeneration`).
//!
//! Precedence, for every setting: a field set in the FlatNetworkConfig
//! wins over the environment variable (or flag) of the same setting, which
//! wins over the built-in default. The MAC pool exists only in the
//! FlatNetworkConfig. What applies is logged at start and at every change.
//! The MAC pool goes to allocation, `defaultMtu` and `arpPolicy` into
//! every NetworkAttachmentDefinition (re-applied on change).
//!
//! When `spec.macPool` names no range, a random locally administered range
//! (`02:XX:XX:00:00:00`-`02:XX:XX:FF:FF:FF`) is chosen once and recorded in
//! `status.macPool` with the resourceVersion that was read, so two
//! replicas can never record two ranges, and later leaders keep it. A
//! drawn range holding a MAC the node agents saw on the LAN within the
//! operator's wire window (`FLATNET_WIRE_WINDOW`; another flatnet cluster,
//! or hosts, using it) is drawn again ([`range_avoiding`]).

use std::{
    collections::BTreeMap,
    hash::{BuildHasher, Hasher},
    time::Duration,
};

use flatnet_k8s::{
    api::{CONFIG_NAME, FlatNetworkConfig, FlatNetworkWireClaims, MacPoolMode, MacPoolStatus},
    ipam::{
        LiveClaim, Mac, MacRange,
        foreign_macs::{foreign_macs, inside, overlap_warning},
    },
    keys::SUBNET_NAMESPACE,
};
use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::{
    Api, Client, ResourceExt,
    api::{ListParams, PostParams},
    runtime::{WatchStreamExt, watcher},
};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    allocation::mac_pool::{ActivePool, MacPoolView},
    cidr::Cidr,
    config::CniSettings,
    controller::{is_conflict, is_not_found},
    nad,
};

/// Where the applied configuration goes, and the environment's settings it
/// takes precedence over.
#[derive(Clone)]
pub struct Applied {
    /// The MAC pool allocation reads.
    pub mac_pool: MacPoolView,
    /// The CNI config every NetworkAttachmentDefinition carries.
    pub cni: nad::CniConfig,
    /// The CNI settings from the environment (flags).
    pub env: CniSettings,
    /// The attachment name.
    pub attachment: String,
    /// Cluster CIDRs written into the attachment.
    pub cluster_cidrs: Vec<Cidr>,
    /// Service CIDRs written into the attachment.
    pub service_cidrs: Vec<Cidr>,
    /// The wire window (`FLATNET_WIRE_WINDOW`): how recently a MAC must
    /// have been seen on the LAN to keep a random range from being chosen.
    pub wire_window: Duration,
}

#[cfg(test)]
impl Applied {
    /// The operator's defaults: no MAC pool or CNI config yet, the
    /// environment's `arp_notify`, the attachment `rancher-flat-network`.
    pub(crate) fn defaults() -> Self {
        Self {
            mac_pool: MacPoolView::default(),
            cni: String::new().into(),
            env: CniSettings {
                arp_policy: crate::config::ArpPolicy::ArpNotify,
                proxy_arp: false,
                mtu: None,
            },
            attachment: "rancher-flat-network".into(),
            cluster_cidrs: Vec::new(),
            service_cidrs: Vec::new(),
            wire_window: flatnet_k8s::ipam::DEFAULT_WIRE_WINDOW,
        }
    }
}

/// The CNI settings in force: each field the FlatNetworkConfig sets wins
/// over the environment's.
#[must_use]
pub fn effective_cni(config: Option<&FlatNetworkConfig>, env: &CniSettings) -> CniSettings {
    let Some(spec) = config.map(|c| &c.spec) else {
        return env.clone();
    };
    let arp_policy = spec.arp_policy().unwrap_or(env.arp_policy);
    let mtu = match spec.default_mtu {
        Some(0) => None,
        Some(mtu) => u16::try_from(mtu).ok().or(env.mtu),
        None => env.mtu,
    };
    CniSettings {
        arp_policy,
        mtu,
        proxy_arp: env.proxy_arp,
    }
}

/// A random locally administered 16M-MAC range.
#[must_use]
pub fn random_range() -> MacRange {
    // A randomly keyed hash: fresh random bits per call.
    let bits = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    MacRange::locally_administered(u16::try_from(bits & 0xffff).unwrap_or_default())
}

/// How many random ranges are drawn before one holding foreign MACs is
/// taken anyway: with 65536 ranges, only a LAN full of other clusters'
/// ranges gets that far.
pub const RANGE_DRAWS: usize = 32;

/// The first of up to [`RANGE_DRAWS`] ranges from `draw` that holds none
/// of the `foreign` MACs seen on the LAN; when every draw holds some, the
/// one holding fewest, with the warning to log.
pub fn range_avoiding(
    foreign: &BTreeMap<Mac, LiveClaim>,
    mut draw: impl FnMut() -> MacRange,
) -> (MacRange, Option<String>) {
    let mut best: Option<(MacRange, Vec<LiveClaim>)> = None;
    for _ in 0..RANGE_DRAWS {
        let range = draw();
        let seen = inside(&range, foreign);
        if seen.is_empty() {
            return (range, None);
        }
        if best
            .as_ref()
            .is_none_or(|(_, fewest)| seen.len() < fewest.len())
        {
            best = Some((range, seen));
        }
    }
    let (range, seen) = best.expect("RANGE_DRAWS > 0");
    let warning = overlap_warning("the randomly chosen macPool range", &range, &seen);
    (range, warning)
}

/// Whether `config` needs a random range drawn: its spec names no range
/// and its status records no random one yet.
fn needs_random_range(config: &FlatNetworkConfig) -> bool {
    matches!(config.spec.mac_pool.range(), Ok(None))
        && !config
            .status
            .as_ref()
            .and_then(|s| s.mac_pool.as_ref())
            .is_some_and(|p| p.generated && p.range().is_some())
}

/// A random range holding no MAC the node agents saw on the LAN within
/// `wire_window`. Without
/// their reports (a failed list) any random range is taken: the allocator
/// still skips the MACs they report later.
async fn fresh_range(client: &Client, wire_window: Duration) -> MacRange {
    let api: Api<FlatNetworkWireClaims> = Api::namespaced(client.clone(), SUBNET_NAMESPACE);
    let reports = match api.list(&ListParams::default().match_any()).await {
        Ok(list) => list.items,
        Err(error) => {
            warn!(%error, "cannot list FlatNetworkWireClaims; choosing the MAC range without them");
            Vec::new()
        }
    };
    let foreign = foreign_macs(&reports, Timestamp::now(), wire_window);
    let (range, warning) = range_avoiding(&foreign, random_range);
    if let Some(warning) = warning {
        warn!("{warning}");
    }
    range
}

/// The `status.macPool` `config` should have: the spec's range, else the
/// random range recorded before, else `fresh`. `None` when the spec's range
/// is invalid (the webhook refuses it; an object stored before keeps no
/// pool until it is fixed).
#[must_use]
pub fn wanted_pool_status(config: &FlatNetworkConfig, fresh: MacRange) -> Option<MacPoolStatus> {
    let status = |range: MacRange, generated| MacPoolStatus {
        range_start: range.start().to_string(),
        range_end: range.end().to_string(),
        generated,
    };
    match config.spec.mac_pool.range() {
        Ok(Some(range)) => Some(status(range, false)),
        Err(_) => None,
        Ok(None) => {
            let recorded = config
                .status
                .as_ref()
                .and_then(|s| s.mac_pool.as_ref())
                .filter(|p| p.generated)
                .and_then(MacPoolStatus::range);
            Some(status(recorded.unwrap_or(fresh), true))
        }
    }
}

/// The pool allocation should use under `config` (as its status records it).
#[must_use]
pub fn active_pool(config: Option<&FlatNetworkConfig>) -> Option<ActivePool> {
    let config = config?;
    let mode = config.spec.mac_pool.mode;
    if mode == MacPoolMode::Disabled {
        return None;
    }
    Some(ActivePool {
        range: config.mac_range()?,
        mode,
    })
}

/// The settings in force, each with where it came from, for the log.
#[must_use]
pub fn describe(config: Option<&FlatNetworkConfig>, env: &CniSettings) -> String {
    let spec = config.map(|c| &c.spec);
    let source = flatnet_k8s::api::setting_source;
    let effective = effective_cni(config, env);
    let pool = match active_pool(config) {
        Some(pool) => format!("{} ({:?})", pool.range, pool.mode),
        None if config.is_none() => "off (no FlatNetworkConfig cluster)".to_owned(),
        None => "off".to_owned(),
    };
    format!(
        "macPool {pool}; defaultMtu {} from {}; arpPolicy {} from {}",
        effective
            .mtu
            .map_or("parent link's".to_owned(), |m| m.to_string()),
        source(spec.and_then(|s| s.default_mtu).is_some()),
        effective.arp_policy.as_str(),
        source(spec.and_then(|s| s.arp_policy.as_ref()).is_some()),
    )
}

/// Brings the status of `config` in line (MAC range, avoiding the MACs
/// seen on the LAN within `wire_window`; observedGeneration) and returns the object as stored; a conflicting write returns `None`
/// (the watch brings the newer object).
///
/// # Errors
/// The API failing.
pub async fn reconcile(
    client: &Client,
    config: &FlatNetworkConfig,
    wire_window: Duration,
) -> Result<Option<FlatNetworkConfig>, kube::Error> {
    let mut status = config.status.clone().unwrap_or_default();
    let fresh = if needs_random_range(config) {
        fresh_range(client, wire_window).await
    } else {
        random_range()
    };
    let pool = wanted_pool_status(config, fresh);
    let generation = config.metadata.generation;
    let pool_changed = pool.is_some() && status.mac_pool != pool;
    if !pool_changed && status.observed_generation == generation {
        return Ok(Some(config.clone()));
    }
    if pool_changed {
        status.mac_pool = pool;
    }
    status.observed_generation = generation;
    let mut updated = config.clone();
    updated.status = Some(status);
    let api: Api<FlatNetworkConfig> = Api::all(client.clone());
    match api
        .replace_status(&config.name_any(), &PostParams::default(), &updated)
        .await
    {
        Ok(stored) => Ok(Some(stored)),
        Err(error) if is_conflict(&error) || is_not_found(&error) => Ok(None),
        Err(error) => Err(error),
    }
}

/// Follows the FlatNetworkConfig `cluster` until `stop`: records its MAC
/// range, hands the pool to allocation and the CNI settings to the
/// attachments (`applied`).
pub async fn run(client: Client, applied: Applied, stop: CancellationToken) {
    let api: Api<FlatNetworkConfig> = Api::all(client.clone());
    let config = watcher::Config::default().fields(&format!("metadata.name={CONFIG_NAME}"));
    let events = watcher(api, config).default_backoff();
    tokio::pin!(events);
    let mut logged = None;
    loop {
        let event = tokio::select! {
            () = stop.cancelled() => return,
            event = events.next() => event,
        };
        let current = match event {
            None => return,
            Some(Err(error)) => {
                warn!(%error, "FlatNetworkConfig watch failed; retrying");
                continue;
            }
            Some(Ok(watcher::Event::Apply(config) | watcher::Event::InitApply(config))) => {
                match reconcile(&client, &config, applied.wire_window).await {
                    Ok(Some(stored)) => Some(stored),
                    Ok(None) => continue,
                    Err(error) => {
                        warn!(%error, "cannot record the FlatNetworkConfig status; the watch retries");
                        Some(config)
                    }
                }
            }
            Some(Ok(watcher::Event::Delete(_))) => None,
            // Nothing listed: no object (yet).
            Some(Ok(watcher::Event::InitDone)) if logged.is_none() => None,
            Some(Ok(_)) => continue,
        };
        applied.mac_pool.set(active_pool(current.as_ref()));
        applied.cni.set(nad::cni_config(
            &applied.attachment,
            &effective_cni(current.as_ref(), &applied.env),
            &applied.cluster_cidrs,
            &applied.service_cidrs,
        ));
        let text = describe(current.as_ref(), &applied.env);
        if logged.as_ref() != Some(&text) {
            info!(settings = %text, "cluster configuration applied (FlatNetworkConfig over environment)");
            logged = Some(text);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::allocation::fake_api::FakeApiServer;
    use flatnet_k8s::{
        api::{FlatNetworkConfigSpec, MacPoolSpec},
        ipam::DEFAULT_WIRE_WINDOW,
    };

    fn config(range: Option<(&str, &str)>) -> FlatNetworkConfig {
        let mut config = FlatNetworkConfig::new(
            CONFIG_NAME,
            FlatNetworkConfigSpec {
                mac_pool: MacPoolSpec {
                    range_start: range.map(|r| r.0.into()),
                    range_end: range.map(|r| r.1.into()),
                    ..MacPoolSpec::default()
                },
                ..FlatNetworkConfigSpec::default()
            },
        );
        config.metadata.generation = Some(1);
        config
    }

    #[tokio::test]
    async fn a_random_range_is_chosen_once_and_kept() {
        let server = FakeApiServer::new();
        server.insert(&config(None));
        let client = server.client();
        let stored = server.list::<FlatNetworkConfig>().remove(0);
        let first = reconcile(&client, &stored, DEFAULT_WIRE_WINDOW)
            .await
            .unwrap()
            .unwrap();
        let recorded = first.status.clone().unwrap();
        assert_eq!(recorded.observed_generation, Some(1));
        let pool = recorded.mac_pool.clone().unwrap();
        assert!(pool.generated);
        let range = pool.range().unwrap();
        assert!(
            range.is_locally_administered() && range.len() == 1 << 24,
            "{range}"
        );
        assert!(pool.range_start.ends_with(":00:00:00"), "{pool:?}");
        // Later passes (a new leader) keep it.
        let again = reconcile(&client, &first, DEFAULT_WIRE_WINDOW)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(again.status.unwrap().mac_pool, Some(pool));
        assert_eq!(active_pool(Some(&first)).map(|p| p.range), Some(range));

        // A second writer that read the object before the first wrote
        // loses: only one range is ever recorded.
        assert_eq!(
            reconcile(&client, &stored, DEFAULT_WIRE_WINDOW)
                .await
                .unwrap(),
            None
        );
        let stored = server.list::<FlatNetworkConfig>().remove(0);
        assert_eq!(
            stored.status.unwrap().mac_pool.unwrap().range(),
            Some(range)
        );
    }

    #[tokio::test]
    async fn the_spec_range_wins_and_an_invalid_one_disables_the_pool() {
        let server = FakeApiServer::new();
        server.insert(&config(Some(("02:10:00:00:00:00", "02:10:00:00:ff:ff"))));
        let client = server.client();
        let stored = server.list::<FlatNetworkConfig>().remove(0);
        let applied = reconcile(&client, &stored, DEFAULT_WIRE_WINDOW)
            .await
            .unwrap()
            .unwrap();
        let pool = applied.status.clone().unwrap().mac_pool.unwrap();
        assert_eq!(
            (
                pool.range_start.as_str(),
                pool.range_end.as_str(),
                pool.generated
            ),
            ("02:10:00:00:00:00", "02:10:00:00:ff:ff", false)
        );
        assert_eq!(
            active_pool(Some(&applied)).map(|p| p.range.len()),
            Some(65536)
        );

        let mut invalid = applied.clone();
        invalid.spec.mac_pool.range_end = Some("02:0f:00:00:00:00".into());
        assert_eq!(active_pool(Some(&invalid)), None);
        let mut disabled = applied;
        disabled.spec.mac_pool.mode = MacPoolMode::Disabled;
        assert_eq!(active_pool(Some(&disabled)), None);
        assert_eq!(active_pool(None), None);
    }

    #[test]
    fn the_log_names_where_each_setting_comes_from() {
        let env = CniSettings {
            arp_policy: crate::config::ArpPolicy::ArpNotify,
            proxy_arp: false,
            mtu: Some(1500),
        };
        let mut cfg = config(Some(("02:10:00:00:00:00", "02:10:00:00:ff:ff")));
        cfg.spec.default_mtu = Some(9000);
        let text = describe(Some(&cfg), &env);
        assert!(
            text.contains("defaultMtu 9000 from FlatNetworkConfig"),
            "{text}"
        );
        assert!(
            text.contains("arpPolicy arp_notify from environment"),
            "{text}"
        );
        assert!(
            text.contains("macPool 02:10:00:00:00:00-02:10:00:00:ff:ff (OptOut)"),
            "{text}"
        );
        assert!(describe(None, &env).contains("off (no FlatNetworkConfig cluster)"));
        cfg.spec.arp_policy = Some("arping".into());
        let applied = effective_cni(Some(&cfg), &env);
        assert_eq!(
            (applied.mtu, applied.arp_policy),
            (Some(9000), crate::config::ArpPolicy::Arping)
        );
        cfg.spec.default_mtu = Some(0);
        assert_eq!(
            effective_cni(Some(&cfg), &env).mtu,
            None,
            "0: the parent link's"
        );
        assert_eq!(effective_cni(None, &env), env);
    }

    fn seen(macs: &[&str]) -> BTreeMap<Mac, LiveClaim> {
        macs.iter()
            .map(|m| {
                let mac = Mac::parse(m).unwrap();
                let claim = LiveClaim {
                    mac: mac.to_string(),
                    last_seen: Timestamp::UNIX_EPOCH,
                    node: "node-1".into(),
                };
                (mac, claim)
            })
            .collect()
    }

    #[test]
    fn a_random_range_holding_macs_seen_on_the_lan_is_drawn_again() {
        let foreign = seen(&[
            "02:00:01:00:00:05",
            "02:00:02:00:00:01",
            "02:00:02:00:00:02",
        ]);
        let mut seeds = [1u16, 2, 3].into_iter().cycle();
        let mut draw = || MacRange::locally_administered(seeds.next().unwrap());
        assert_eq!(
            range_avoiding(&foreign, &mut draw),
            (MacRange::locally_administered(3), None),
            "the first draw with none of them"
        );

        // Every draw crowded: the one holding fewest, with the warning.
        let mut seeds = [2u16, 1].into_iter().cycle();
        let (range, warning) = range_avoiding(&foreign, || {
            MacRange::locally_administered(seeds.next().unwrap())
        });
        assert_eq!(range, MacRange::locally_administered(1));
        let warning = warning.expect("a warning");
        assert!(
            warning.contains("1 MAC(s)") && warning.contains("02:00:01:00:00:05"),
            "{warning}"
        );
    }

    #[test]
    fn a_range_is_drawn_only_while_none_is_named_or_recorded() {
        assert!(needs_random_range(&config(None)));
        assert!(!needs_random_range(&config(Some((
            "02:10:00:00:00:00",
            "02:10:00:00:ff:ff"
        )))));
        let mut recorded = config(None);
        recorded.status = Some(flatnet_k8s::api::FlatNetworkConfigStatus {
            mac_pool: wanted_pool_status(&recorded, MacRange::locally_administered(9)),
            ..Default::default()
        });
        assert!(!needs_random_range(&recorded));
    }

    /// An edit of the object reaches every namespace's
    /// NetworkAttachmentDefinition, without a restart: its `defaultMtu`
    /// and `arpPolicy` over the environment's, and back when unset.
    #[tokio::test]
    async fn an_edit_re_applies_every_attachment() {
        use k8s_openapi::api::core::v1::Namespace;

        use std::sync::Arc;

        use crate::{metrics::Metrics, nad};

        let server = FakeApiServer::new();
        server.insert(&config(None));
        for name in ["shop", "lab"] {
            server.insert(
                &serde_json::from_value::<Namespace>(serde_json::json!({
                    "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
                }))
                .unwrap(),
            );
        }
        let applied = Applied::defaults();
        let nads = Arc::new(nad::Context {
            client: server.client(),
            metrics: Arc::new(Metrics::new()),
            name: "rancher-flat-network".into(),
            config: applied.cni.clone(),
            resync: Duration::from_secs(600),
            owner: None,
        });
        let stop = CancellationToken::new();
        let config_task = tokio::spawn(run(server.client(), applied, stop.clone()));
        let nad_task = tokio::spawn(nad::run(nads, 1, stop.clone()));
        // Every namespace's attachment carries `wanted` (spaces dropped).
        let every_attachment = |wanted: &'static [&'static str]| {
            let server = server.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(20), async {
                    loop {
                        let texts: Vec<String> = server
                            .list::<nad::NetworkAttachmentDefinition>()
                            .iter()
                            .map(|n| n.spec.config.replace(' ', ""))
                            .collect();
                        if texts.len() == 2
                            && texts.iter().all(|t| wanted.iter().all(|w| t.contains(w)))
                        {
                            return texts;
                        }
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                })
                .await
                .unwrap_or_else(|_| panic!("no attachment carries {wanted:?}"))
            }
        };
        let first = every_attachment(&["\"arpPolicy\":\"arp_notify\""]).await;
        assert!(!first[0].contains("\"mtu\""), "{first:?}");

        let mut edited = server.list::<FlatNetworkConfig>().remove(0);
        edited.spec.default_mtu = Some(1400);
        edited.spec.arp_policy = Some("arping".into());
        server.insert(&edited);
        every_attachment(&["\"mtu\":1400", "\"arpPolicy\":\"arping\""]).await;

        let mut unset = server.list::<FlatNetworkConfig>().remove(0);
        unset.spec.default_mtu = None;
        unset.spec.arp_policy = None;
        server.insert(&unset);
        let back = every_attachment(&["\"arpPolicy\":\"arp_notify\""]).await;
        assert!(back.iter().all(|t| !t.contains("\"mtu\"")), "{back:?}");
        stop.cancel();
        config_task.await.unwrap();
        nad_task.await.unwrap();
    }
}
