//! The agent's settings an administrator changes at run time: the
//! conflict probe and policy enforcement, from `spec.agents` of the
//! FlatNetworkConfig `cluster` over the agent's environment.
//!
//! Precedence, for every setting: a field set in the FlatNetworkConfig
//! wins over the environment variable (or flag) of the same setting, which
//! wins over the built-in default. What applies is logged at start and at
//! every change. In Kubernetes mode [`follow`] reads the object from the
//! agent's one watch of it ([`crate::cluster_config`]) and hands each change to the running agent through a [`SettingsView`] (no
//! restart); standalone agents keep their environment's.

use std::time::Duration;

use flatnet_k8s::api::{AgentsSpec, setting_source};
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
}

/// The settings in force.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentSettings {
    /// How long ADD's conflict probe listens; zero: no probe.
    pub probe_wait: Duration,
    /// Whether MultiNetworkPolicies are enforced.
    pub policy_enforcement: bool,
}

impl From<EnvSettings> for AgentSettings {
    fn from(env: EnvSettings) -> Self {
        Self {
            probe_wait: env.probe_wait,
            policy_enforcement: env.policy_enforcement,
        }
    }
}

/// The settings in force under `spec` (the FlatNetworkConfig's
/// `spec.agents`, `None` without the object): each field it sets wins
/// over the environment's.
#[must_use]
pub fn effective(spec: Option<&AgentsSpec>, env: EnvSettings) -> AgentSettings {
    let Some(spec) = spec else {
        return env.into();
    };
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
    }
}

/// The settings in force, each with where it came from, for the log.
#[must_use]
pub fn describe(spec: Option<&AgentsSpec>, env: EnvSettings) -> String {
    let source = setting_source;
    let applied = effective(spec, env);
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
    format!(
        "{probe_text}; policyEnforcement {} from {}",
        if applied.policy_enforcement {
            "on"
        } else {
            "off"
        },
        source(spec.and_then(|s| s.policy_enforcement).is_some())
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
fn log_applied(spec: Option<&AgentsSpec>, env: EnvSettings, logged: &mut Option<String>) {
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
/// `cluster` is read, then its `spec.agents` over them, followed for the
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
                .map(|config| config.spec.agents.clone());
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
    use flatnet_k8s::api::ConflictProbeSpec;

    use super::*;

    const ENV: EnvSettings = EnvSettings {
        probe_wait: Duration::from_millis(500),
        policy_enforcement: true,
    };

    fn agents(enabled: Option<bool>, wait: Option<u32>, policy: Option<bool>) -> AgentsSpec {
        AgentsSpec {
            conflict_probe: ConflictProbeSpec {
                enabled,
                wait_milliseconds: wait,
            },
            policy_enforcement: policy,
        }
    }

    #[test]
    fn without_the_object_or_its_fields_the_environment_applies() {
        assert_eq!(effective(None, ENV), ENV.into());
        assert_eq!(effective(Some(&agents(None, None, None)), ENV), ENV.into());
        let off = EnvSettings {
            probe_wait: Duration::ZERO,
            policy_enforcement: false,
        };
        assert_eq!(effective(Some(&AgentsSpec::default()), off), off.into());
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
    fn the_log_names_where_each_setting_comes_from() {
        assert_eq!(
            describe(None, ENV),
            "conflictProbe on, 500 ms (enabled from environment, waitMilliseconds from environment); policyEnforcement on from environment"
        );
        assert_eq!(
            describe(Some(&agents(Some(false), None, Some(false))), ENV),
            "conflictProbe off (enabled from FlatNetworkConfig); policyEnforcement off from FlatNetworkConfig"
        );
        assert_eq!(
            describe(Some(&agents(None, Some(300), None)), ENV),
            "conflictProbe on, 300 ms (enabled from environment, waitMilliseconds from FlatNetworkConfig); policyEnforcement on from environment"
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
