//! Which compiler diagnostics are news: a diagnostic is logged (and, in
//! Kubernetes mode, published as an Event on its MultiNetworkPolicy) when
//! the policy's set of diagnostics or the policy itself changed, never
//! again for an unchanged policy.

use std::collections::{BTreeMap, BTreeSet};

use crate::policy_compiler::{Diagnostic, MultiNetworkPolicy, compile::policy_key};

/// At most this many policies get Events per round, so a cluster-wide
/// change cannot flood the API server.
pub const MAX_EVENTS_PER_ROUND: usize = 10;

/// Where diagnostics about a policy are published.
pub trait DiagnosticEvents: Send {
    /// Publishes `messages` (new diagnostics) about `policy`.
    fn publish(
        &mut self,
        policy: &MultiNetworkPolicy,
        messages: &[String],
    ) -> impl Future<Output = ()> + Send;
}

/// Publishes nothing (standalone mode: the log is the report).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoEvents;

impl DiagnosticEvents for NoEvents {
    async fn publish(&mut self, _policy: &MultiNetworkPolicy, _messages: &[String]) {}
}

/// Diagnostics to report for one object.
#[derive(Clone, Debug, PartialEq)]
pub struct News {
    /// What the diagnostics name (a policy, a rule or a pod).
    pub object: String,
    /// The policy concerned, when there is one (Events go there).
    pub policy: Option<MultiNetworkPolicy>,
    /// The diagnostics.
    pub messages: Vec<String>,
}

type PolicyKey = (String, String);

/// What was reported last, per policy.
#[derive(Debug, Default)]
pub struct DiagnosticLog {
    /// Policy → (its spec and annotations when reported, the messages).
    policies: BTreeMap<PolicyKey, (String, BTreeSet<String>)>,
    /// Diagnostics not tied to one policy (pods), as last reported.
    others: BTreeSet<String>,
}

impl DiagnosticLog {
    /// The diagnostics of this round not reported before for an unchanged
    /// policy; remembers them. Events are limited to
    /// [`MAX_EVENTS_PER_ROUND`] policies (all are still logged).
    pub fn news(
        &mut self,
        policies: &[MultiNetworkPolicy],
        diagnostics: &[Diagnostic],
    ) -> Vec<News> {
        let mut by_policy: BTreeMap<PolicyKey, (String, BTreeSet<String>)> = BTreeMap::new();
        let mut others = BTreeSet::new();
        for d in diagnostics {
            match &d.policy {
                Some(key) => {
                    by_policy
                        .entry(key.clone())
                        .or_insert_with(|| (d.object.clone(), BTreeSet::new()))
                        .1
                        .insert(d.to_string());
                }
                None => {
                    others.insert(d.to_string());
                }
            }
        }
        let mut out = Vec::new();
        let mut current = BTreeMap::new();
        let mut events = 0;
        for (key, (object, messages)) in by_policy {
            let policy = policies.iter().find(|p| policy_key(p) == key);
            let fingerprint = policy.map(fingerprint).unwrap_or_default();
            let unchanged = self
                .policies
                .get(&key)
                .is_some_and(|(f, m)| *f == fingerprint && *m == messages);
            if !unchanged {
                let with_event = events < MAX_EVENTS_PER_ROUND;
                if with_event && policy.is_some() {
                    events += 1;
                }
                out.push(News {
                    object,
                    policy: policy.filter(|_| with_event).cloned(),
                    messages: messages.iter().cloned().collect(),
                });
            }
            current.insert(key, (fingerprint, messages));
        }
        let fresh: Vec<String> = others.difference(&self.others).cloned().collect();
        if !fresh.is_empty() {
            out.push(News {
                object: "pods".into(),
                policy: None,
                messages: fresh,
            });
        }
        self.policies = current;
        self.others = others;
        out
    }
}

/// What makes a policy "changed" for reporting: its spec and annotations.
fn fingerprint(policy: &MultiNetworkPolicy) -> String {
    serde_json::to_string(&(&policy.spec, &policy.metadata.annotations)).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(name: &str, port: &str) -> MultiNetworkPolicy {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "k8s.cni.cncf.io/v1beta1", "kind": "MultiNetworkPolicy",
            "metadata": {"name": name, "namespace": "a"},
            "spec": {"ingress": [{"ports": [{"port": port}]}]}
        }))
        .unwrap()
    }

    fn diagnostic(name: &str, message: &str) -> Diagnostic {
        Diagnostic {
            object: format!("a/{name} ingress[0]"),
            policy: Some(("a".into(), name.into())),
            message: message.into(),
        }
    }

    #[test]
    fn an_unchanged_policy_is_reported_once() {
        let mut log = DiagnosticLog::default();
        let policies = [policy("web", "http")];
        let diagnostics = [diagnostic("web", "named port")];
        let first = log.news(&policies, &diagnostics);
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].policy.as_ref(), Some(&policies[0]));
        assert!(log.news(&policies, &diagnostics).is_empty(), "not repeated");

        // The policy changed but keeps the problem: reported again.
        let edited = [policy("web", "https")];
        assert_eq!(log.news(&edited, &diagnostics).len(), 1);
        // Fixed, then broken again: reported again.
        assert!(log.news(&edited, &[]).is_empty());
        assert_eq!(log.news(&edited, &diagnostics).len(), 1);
    }

    #[test]
    fn events_per_round_are_limited_but_everything_is_logged() {
        let mut log = DiagnosticLog::default();
        let names: Vec<String> = (0..MAX_EVENTS_PER_ROUND + 5)
            .map(|i| format!("p{i:02}"))
            .collect();
        let policies: Vec<_> = names.iter().map(|n| policy(n, "http")).collect();
        let diagnostics: Vec<_> = names.iter().map(|n| diagnostic(n, "named port")).collect();
        let news = log.news(&policies, &diagnostics);
        assert_eq!(news.len(), names.len());
        assert_eq!(
            news.iter().filter(|n| n.policy.is_some()).count(),
            MAX_EVENTS_PER_ROUND
        );
    }

    #[test]
    fn pod_diagnostics_are_reported_when_new() {
        let mut log = DiagnosticLog::default();
        let d = Diagnostic {
            object: "a/web".into(),
            policy: None,
            message: "too many ranges".into(),
        };
        assert_eq!(log.news(&[], std::slice::from_ref(&d)).len(), 1);
        assert!(log.news(&[], &[d]).is_empty());
    }
}
