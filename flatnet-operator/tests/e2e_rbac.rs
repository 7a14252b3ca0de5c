//! flatnet's RBAC on a real API server: a step of `cargo xtask e2e`, run
//! after the release suite and `helm upgrade`, while the release is
//! installed.
//!
//! The cluster's API server audits every request a ServiceAccount outside
//! kube-system makes (`FLATNET_E2E_AUDIT_LOG`, one JSON event per line).
//! For each ServiceAccount of the release namespace:
//!
//! - no request was refused (a grant the chart lacks shows up here first);
//! - every grant of its bound roles that no request used is listed: a grant
//!   worth questioning (some serve paths this run does not take).

mod e2e_support;

use std::{
    collections::{BTreeMap, BTreeSet},
    path::PathBuf,
};

use e2e_support::cluster_configured;
use k8s_openapi::api::rbac::v1::{
    ClusterRole, ClusterRoleBinding, PolicyRule, Role, RoleBinding, Subject,
};
use kube::{Api, Client, ResourceExt, api::ListParams};
use serde::Deserialize;

const RELEASE_NAMESPACE: &str = "cattle-flat-network";

/// What the audit log says of one request (`audit.k8s.io/v1` Event).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Event {
    stage: String,
    verb: String,
    user: User,
    #[serde(default)]
    object_ref: Option<ObjectRef>,
    #[serde(default)]
    response_status: Option<ResponseStatus>,
    #[serde(default, rename = "requestURI")]
    request_uri: String,
    #[serde(default)]
    annotations: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize)]
struct User {
    username: String,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectRef {
    #[serde(default)]
    resource: String,
    #[serde(default)]
    subresource: String,
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    name: String,
    #[serde(default)]
    api_group: String,
}

#[derive(Debug, Deserialize)]
struct ResponseStatus {
    #[serde(default)]
    code: u16,
}

/// One request, as RBAC sees it.
#[derive(Debug, Clone)]
struct Access {
    verb: String,
    group: String,
    /// `pods` or `pods/status`.
    resource: String,
    namespace: String,
    name: String,
}

/// A rule of a role bound to the ServiceAccount, and where it applies.
struct Grant {
    /// `ClusterRole x (ClusterRoleBinding y)`.
    from: String,
    /// `None`: every namespace and cluster-scoped objects.
    namespace: Option<String>,
    rule: PolicyRule,
}

impl Grant {
    /// Whether `access` was allowed by this grant's (verb, group, resource)
    /// `triple`, as the RBAC authorizer matches: the namespace the binding
    /// applies to, wildcards, and the rule's resource names.
    fn used_by(&self, (verb, group, resource): &(String, String, String), access: &Access) -> bool {
        let names = self.rule.resource_names.as_deref().unwrap_or_default();
        let matches = |granted: &String, asked: &str| granted == "*" || granted == asked;
        matches(verb, &access.verb)
            && matches(group, &access.group)
            && matches(resource, &access.resource)
            && self
                .namespace
                .as_deref()
                .is_none_or(|ns| ns == access.namespace)
            && (names.is_empty() || names.contains(&access.name))
    }

    /// Every (verb, group, resource) this grant spells out.
    fn triples(&self) -> Vec<(String, String, String)> {
        let rule = &self.rule;
        let mut out = Vec::new();
        for verb in &rule.verbs {
            for group in rule.api_groups.iter().flatten() {
                for resource in rule.resources.iter().flatten() {
                    out.push((verb.clone(), group.clone(), resource.clone()));
                }
            }
        }
        out
    }

    fn describe(&self, (verb, group, resource): &(String, String, String)) -> String {
        let names = self
            .rule
            .resource_names
            .as_ref()
            .filter(|n| !n.is_empty())
            .map(|n| format!(" {n:?}"))
            .unwrap_or_default();
        let group = if group.is_empty() { "core" } else { group };
        format!("{verb} {resource} ({group}){names}: {}", self.from)
    }
}

fn binds(subjects: Option<&Vec<Subject>>, account: &str) -> bool {
    subjects.into_iter().flatten().any(|s| {
        s.kind == "ServiceAccount"
            && s.name == account
            && s.namespace.as_deref() == Some(RELEASE_NAMESPACE)
    })
}

/// The rules of every role bound to `account` of the release namespace.
async fn grants_of(client: &Client, account: &str) -> Vec<Grant> {
    let cluster_roles: Api<ClusterRole> = Api::all(client.clone());
    let rules_of_cluster_role = |name: String| {
        let cluster_roles = cluster_roles.clone();
        async move {
            cluster_roles
                .get(&name)
                .await
                .unwrap_or_else(|e| panic!("ClusterRole {name}: {e}"))
                .rules
                .unwrap_or_default()
        }
    };
    let mut grants = Vec::new();
    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    for binding in bindings.list(&ListParams::default()).await.unwrap() {
        if binds(binding.subjects.as_ref(), account) {
            let role = binding.role_ref.name.clone();
            for rule in rules_of_cluster_role(role.clone()).await {
                grants.push(Grant {
                    from: format!(
                        "ClusterRole {role} (ClusterRoleBinding {})",
                        binding.name_any()
                    ),
                    namespace: None,
                    rule,
                });
            }
        }
    }
    let bindings: Api<RoleBinding> = Api::all(client.clone());
    for binding in bindings.list(&ListParams::default()).await.unwrap() {
        if !binds(binding.subjects.as_ref(), account) {
            continue;
        }
        let namespace = binding.namespace().unwrap_or_default();
        let role = binding.role_ref.name.clone();
        let rules = if binding.role_ref.kind == "ClusterRole" {
            rules_of_cluster_role(role.clone()).await
        } else {
            Api::<Role>::namespaced(client.clone(), &namespace)
                .get(&role)
                .await
                .unwrap_or_else(|e| panic!("Role {namespace}/{role}: {e}"))
                .rules
                .unwrap_or_default()
        };
        for rule in rules {
            grants.push(Grant {
                from: format!(
                    "{} {role} (RoleBinding {namespace}/{})",
                    binding.role_ref.kind,
                    binding.name_any()
                ),
                namespace: Some(namespace.clone()),
                rule,
            });
        }
    }
    grants
}

/// What each ServiceAccount of the release namespace asked, by name; and the
/// refused requests, described.
fn read_audit_log(path: &PathBuf) -> (BTreeMap<String, Vec<Access>>, Vec<String>) {
    let prefix = format!("system:serviceaccount:{RELEASE_NAMESPACE}:");
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("read the audit log {}: {e}", path.display()));
    let mut accesses: BTreeMap<String, Vec<Access>> = BTreeMap::new();
    let mut refused = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let event: Event = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("an audit event that is not one ({e}): {line}"));
        let Some(account) = event.user.username.strip_prefix(&prefix) else {
            continue;
        };
        // A watch is logged when it starts and when it ends; the rest once.
        if event.stage != "ResponseComplete" && event.stage != "ResponseStarted" {
            continue;
        }
        let code = event.response_status.as_ref().map_or(0, |s| s.code);
        // RBAC's refusal; a 403 after RBAC allowed is admission's (such as
        // NamespaceTerminating), not a missing grant.
        if event.annotations.get("authorization.k8s.io/decision") == Some(&"forbid".to_owned()) {
            refused.push(format!(
                "{account}: {} {} → {code} {}",
                event.verb,
                event.request_uri,
                event
                    .annotations
                    .get("authorization.k8s.io/reason")
                    .map_or("", String::as_str)
            ));
            continue;
        }
        let Some(object) = event.object_ref else {
            continue; // discovery and other non-resource URLs
        };
        let resource = if object.subresource.is_empty() {
            object.resource
        } else {
            format!("{}/{}", object.resource, object.subresource)
        };
        let access = Access {
            verb: event.verb.clone(),
            group: object.api_group,
            resource,
            namespace: object.namespace,
            name: object.name,
        };
        let list = accesses.entry(account.to_owned()).or_default();
        // A server-side apply that made the object needed `create` too.
        if event.verb == "patch" && code == 201 {
            list.push(Access {
                verb: "create".into(),
                ..access.clone()
            });
        }
        list.push(access);
    }
    (accesses, refused)
}

#[tokio::test]
#[ignore = "a step of `cargo xtask e2e`, run while the release is installed"]
async fn flatnets_service_accounts_were_refused_nothing() {
    if !cluster_configured() {
        return;
    }
    let path: PathBuf = std::env::var_os("FLATNET_E2E_AUDIT_LOG")
        .expect("FLATNET_E2E_AUDIT_LOG: the API server's audit log")
        .into();
    let client = Client::try_default().await.expect("client from KUBECONFIG");
    let (accesses, refused) = read_audit_log(&path);
    for account in ["flatnet-agent", "flatnet-operator"] {
        assert!(
            accesses.get(account).is_some_and(|a| a.len() > 10),
            "the audit log holds (almost) no request of {account}: is it audited?"
        );
    }
    for (account, used) in &accesses {
        let grants = grants_of(&client, account).await;
        assert!(!grants.is_empty(), "{account} is bound to no role");
        let mut unused = BTreeSet::new();
        for grant in &grants {
            for triple in grant.triples() {
                if !used.iter().any(|access| grant.used_by(&triple, access)) {
                    unused.insert(grant.describe(&triple));
                }
            }
        }
        println!(
            "{account}: {} requests, {} grants; never used by this run:",
            used.len(),
            grants.len()
        );
        for line in &unused {
            println!("  {line}");
        }
        if unused.is_empty() {
            println!("  (none)");
        }
    }
    assert!(
        refused.is_empty(),
        "flatnet's ServiceAccounts were refused {} request(s) (a grant the chart lacks):\n  {}",
        refused.len(),
        refused.join("\n  ")
    );
}
