//! The agent's settings an administrator changes at run time: the
//! conflict probe and policy enforcement (`spec.agents`) and the ARP policy
//! (`spec.arpPolicy`) of the FlatNetworkConfig `cluster`, over the agent's
//! environment; and proxy ARP, the environment's alone.
//!
//! Precedence, for every setting: a field set in the FlatNetworkConfig
//! wins over the environment variable (or flag) of the same setting, which
//! wins over the built-in default. What applies is logged at start and at
//! every change. In Kubernetes mode [`follow`] reads the object from the
//! agent's one watch of it ([`crate::cluster_config`]) and hands each change to the running agent through a [`SettingsView`] (no
//! restart); standalone agents keep their environment's.

use std::time::Duration;

use flatnet_k8s::{
    api::{FlatNetworkConfigSpec, setting_source},
    env::ArpPolicy,
};
use tokio::sync::watch;

use crate::cluster_config::ClusterConfigView;

/// The probe's wait when it is turned on without one.
pub const DEFAULT_PROBE_WAIT: Duration = Duration::from_millis(500);

/// The settings of the agent's environment (flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EnvSettings {
    /// `FLATNET_CONFLICT_PROBE_MS`: zero turns the probe off.
    pub probe_wait: Duration,
    /// `FLATNET_POLICY_ENFORCEMENT`.
    pub policy_enforcement: bool,
    /// `FLAT_NETWORK_CNI_ARP_POLICY`.
    pub arp_policy: ArpPolicy,
    /// `FLAT_NETWORK_CNI_PROXY_ARP`.
    pub proxy_arp: bool,
}

/// The settings in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentSettings {
    /// How long ADD's conflict probe listens; zero: no probe.
    pub probe_wait: Duration,
    /// Whether MultiNetworkPolicies are enforced.
    pub policy_enforcement: bool,
    /// How a new attachment's addresses are announced, unless its network
    /// configuration says (`flatNetwork.arpPolicy`).
    pub arp_policy: ArpPolicy,
    /// `proxy_arp` on a new flat interface, unless its network
    /// configuration says (`flatNetwork.proxyARP`).
    pub proxy_arp: bool,
}

impl From<EnvSettings> for AgentSettings {
    fn from(env: EnvSettings) -> Self {
        Self {
            probe_wait: env.probe_wait,
            policy_enforcement: env.policy_enforcement,
            arp_policy: env.arp_policy,
            proxy_arp: env.proxy_arp,
        }
    }
}

/// The settings in force under `config` (the FlatNetworkConfig's spec,
/// `None` without the object): each field it sets wins over the
/// environment's.
#[must_use]
pub fn effective(config: Option<&FlatNetworkConfigSpec>, env: EnvSettings) -> AgentSettings {
    let Some(config) = config else {
        return env.into();
    };
    let spec = &config.agents;
    let probe = &spec.conflict_probe;
    let enabled = probe.enabled.unwrap_or(!env.probe_wait.is_zero());
    let wait = match probe.wait_milliseconds {
        // The webhook refuses 0; an object stored before keeps the environment's.
        Some(ms) if ms > 0 => Duration::from_millis(u64::from(ms)),
        _ if env.probe_wait.is_zero() => DEFAULT_PROBE_WAIT,
        _ => env.probe_wait,
    };
    AgentSettings {
        probe_wait: if enabled { wait } else { Duration::ZERO },
        policy_enforcement: spec.policy_enforcement.unwrap_or(env.policy_enforcement),
        arp_policy: config.arp_policy().unwrap_or(env.arp_policy),
        proxy_arp: env.proxy_arp,
    }
}

/// The settings in force, each with where it came from, for the log.
#[must_use]
pub fn describe(config: Option<&FlatNetworkConfigSpec>, env: EnvSettings) -> String {
    let source = setting_source;
    let applied = effective(config, env);
    let spec = config.map(|c| &c.agents);
    let probe = spec.map(|s| &s.conflict_probe);
    let enabled_from = source(probe.and_then(|p| p.enabled).is_some());
    let probe_text = if applied.probe_wait.is_zero() {
        format!("conflictProbe off (enabled from {enabled_from})")
    } else {
        format!(
            "conflictProbe on, {} ms (enabled from {enabled_from}, waitMilliseconds from {})",
            applied.probe_wait.as_millis(),
            source(probe.and_then(|p| p.wait_milliseconds).is_some())
        )
    };
    let on_off = |on: bool| if on { "on" } else { "off" };
    format!(
        "{probe_text}; policyEnforcement {} from {}; arpPolicy {} from {}; proxyARP {} from environment",
        on_off(applied.policy_enforcement),
        source(spec.and_then(|s| s.policy_enforcement).is_some()),
        applied.arp_policy,
        source(config.and_then(FlatNetworkConfigSpec::arp_policy).is_some()),
        on_off(applied.proxy_arp),
    )
}

/// The settings in force now, and their changes. Cheap to clone.
#[derive(Clone, Debug)]
pub struct SettingsView(watch::Receiver<AgentSettings>);

impl SettingsView {
    /// Settings that never change (standalone agents, tests, benchmarks).
    #[must_use]
    pub fn fixed(settings: AgentSettings) -> Self {
        // A closed channel still reads its last value; `changed` says
        // that no change can come.
        let (_, view) = Self::channel(settings);
        view
    }

    /// A view and the sender its changes come from.
    #[must_use]
    pub fn channel(settings: AgentSettings) -> (watch::Sender<AgentSettings>, Self) {
        let (sender, receiver) = watch::channel(settings);
        (sender, Self(receiver))
    }

    /// The settings in force.
    #[must_use]
    pub fn current(&self) -> AgentSettings {
        *self.0.borrow()
    }

    /// Waits for the next change; `None` once no change can come.
    pub async fn changed(&mut self) -> Option<AgentSettings> {
        self.0.changed().await.ok()?;
        Some(*self.0.borrow_and_update())
    }
}

/// Logs the settings in force when they differ from `logged`.
fn log_applied(
    spec: Option<&FlatNetworkConfigSpec>,
    env: EnvSettings,
    logged: &mut Option<String>,
) {
    let text = describe(spec, env);
    if logged.as_ref() != Some(&text) {
        tracing::info!(settings = %text, "agent settings applied (FlatNetworkConfig over environment)");
        *logged = Some(text);
    }
}

/// Standalone: the environment's settings, logged once.
#[must_use]
pub fn from_environment(env: EnvSettings) -> SettingsView {
    log_applied(None, env, &mut None);
    SettingsView::fixed(env.into())
}

/// Kubernetes: the environment's settings until the FlatNetworkConfig
/// `cluster` is read, then its settings over them, followed for the
/// agent's life through `cluster` (the agent's one watch of that object).
#[must_use]
pub fn follow(mut cluster: ClusterConfigView, env: EnvSettings) -> SettingsView {
    let mut logged = None;
    log_applied(None, env, &mut logged);
    let (sender, view) = SettingsView::channel(env.into());
    tokio::spawn(async move {
        loop {
            let spec = cluster
                .borrow_and_update()
                .as_ref()
                .map(|config| config.spec.clone());
            log_applied(spec.as_ref(), env, &mut logged);
            sender.send_if_modified(|current| {
                let applied = effective(spec.as_ref(), env);
                let changed = *current != applied;
                *current = applied;
                changed
            });
            // The watch ended: the settings in force stay.
            if cluster.changed().await.is_err() {
                break;
            }
        }
    });
    view
}

#[cfg(test)]
mod tests {
    use flatnet_k8s::api::{AgentsSpec, ConflictProbeSpec};

    use super::*;

    const ENV: EnvSettings = EnvSettings {
        probe_wait: Duration::from_millis(500),
        policy_enforcement: true,
        arp_policy: ArpPolicy::ArpNotify,
        proxy_arp: false,
    };

    fn agents(
        enabled: Option<bool>,
        wait: Option<u32>,
        policy: Option<bool>,
    ) -> FlatNetworkConfigSpec {
        FlatNetworkConfigSpec {
            agents: AgentsSpec {
                conflict_probe: ConflictProbeSpec {
                    enabled,
                    wait_milliseconds: wait,
                },
                policy_enforcement: policy,
            },
            ..FlatNetworkConfigSpec::default()
        }
    }

    fn arp_policy(policy: &str) -> FlatNetworkConfigSpec {
        FlatNetworkConfigSpec {
            arp_policy: Some(policy.into()),
            ..FlatNetworkConfigSpec::default()
        }
    }

    #[test]
    fn without_the_object_or_its_fields_the_environment_applies() {
        assert_eq!(effective(None, ENV), ENV.into());
        assert_eq!(effective(Some(&agents(None, None, None)), ENV), ENV.into());
        let off = EnvSettings {
            probe_wait: Duration::ZERO,
            policy_enforcement: false,
            arp_policy: ArpPolicy::Arping,
            proxy_arp: true,
        };
        assert_eq!(
            effective(Some(&FlatNetworkConfigSpec::default()), off),
            off.into()
        );
    }

    #[test]
    fn each_field_set_wins_over_the_environment() {
        let applied = effective(Some(&agents(Some(false), None, Some(false))), ENV);
        assert_eq!(applied.probe_wait, Duration::ZERO, "probe turned off");
        assert!(!applied.policy_enforcement);
        let applied = effective(Some(&agents(None, Some(250), None)), ENV);
        assert_eq!(applied.probe_wait, Duration::from_millis(250));
        assert!(applied.policy_enforcement, "the environment's");
        // The environment turned the probe off: a wait alone keeps it off,
        // `enabled` turns it on (with the default wait when none is set).
        let env_off = EnvSettings {
            probe_wait: Duration::ZERO,
            ..ENV
        };
        assert_eq!(
            effective(Some(&agents(None, Some(250), None)), env_off).probe_wait,
            Duration::ZERO
        );
        assert_eq!(
            effective(Some(&agents(Some(true), None, None)), env_off).probe_wait,
            DEFAULT_PROBE_WAIT
        );
        assert_eq!(
            effective(Some(&agents(Some(true), Some(40), None)), env_off).probe_wait,
            Duration::from_millis(40)
        );
        // A zero stored past the webhook: the environment's wait.
        assert_eq!(
            effective(Some(&agents(Some(true), Some(0), None)), ENV).probe_wait,
            ENV.probe_wait
        );
    }

    #[test]
    fn the_arp_policy_of_the_object_wins_over_the_environment() {
        assert_eq!(
            effective(Some(&arp_policy("arping")), ENV).arp_policy,
            ArpPolicy::Arping
        );
        let env_arping = EnvSettings {
            arp_policy: ArpPolicy::Arping,
            ..ENV
        };
        assert_eq!(
            effective(Some(&arp_policy("arp_notify")), env_arping).arp_policy,
            ArpPolicy::ArpNotify
        );
        // A value stored past the webhook: the environment's.
        assert_eq!(
            effective(Some(&arp_policy("loud")), env_arping).arp_policy,
            ArpPolicy::Arping
        );
    }

    #[test]
    fn the_log_names_where_each_setting_comes_from() {
        assert_eq!(
            describe(None, ENV),
            "conflictProbe on, 500 ms (enabled from environment, waitMilliseconds from environment); policyEnforcement on from environment; arpPolicy arp_notify from environment; proxyARP off from environment"
        );
        assert_eq!(
            describe(Some(&agents(Some(false), None, Some(false))), ENV),
            "conflictProbe off (enabled from FlatNetworkConfig); policyEnforcement off from FlatNetworkConfig; arpPolicy arp_notify from environment; proxyARP off from environment"
        );
        assert_eq!(
            describe(Some(&agents(None, Some(300), None)), ENV),
            "conflictProbe on, 300 ms (enabled from environment, waitMilliseconds from FlatNetworkConfig); policyEnforcement on from environment; arpPolicy arp_notify from environment; proxyARP off from environment"
        );
        assert!(
            describe(Some(&arp_policy("arping")), ENV).ends_with(
                "arpPolicy arping from FlatNetworkConfig; proxyARP off from environment"
            )
        );
    }

    #[tokio::test]
    async fn a_view_reads_the_settings_in_force_and_each_change() {
        let (sender, mut view) = SettingsView::channel(ENV.into());
        assert_eq!(view.current(), ENV.into());
        let off = effective(Some(&agents(Some(false), None, Some(false))), ENV);
        sender.send(off).unwrap();
        assert_eq!(view.changed().await, Some(off));
        assert_eq!(view.current(), off);
        drop(sender);
        assert_eq!(view.changed().await, None);
        let mut fixed = SettingsView::fixed(ENV.into());
        assert_eq!(fixed.current(), ENV.into());
        assert_eq!(fixed.changed().await, None);
    }
}
