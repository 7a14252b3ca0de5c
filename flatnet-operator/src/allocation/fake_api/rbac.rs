//! Authorization, as a real API server's RBAC authorizer decides it, for
//! the clients of [`super::FakeApiServer::with_rbac`].
//!
//! A request is checked for its verb (`get`, `list`, `watch`, `create`,
//! `update`, `patch`, `delete`) on its resource (with its subresource), API
//! group, namespace and name (a list or watch selecting one name with a
//! `metadata.name` field selector is checked for that name, as the real
//! server's request info makes it). A refusal is the real server's 403:
//! `<resource>.<group> "<name>" is forbidden: User "<user>" cannot <verb>
//! resource "<resource>" in API group "<group>" in the namespace "<ns>"`.
//!
//! A server-side apply of an object that does not exist is checked a second
//! time, for `create`, once the server knows it creates (the patch handler's
//! `withAuthorization` around its create validation). The real server
//! refuses it with the authorizer's reason, which RBAC leaves empty: the
//! message ends in `is forbidden: ` and names neither the user nor the
//! verb. Other patches never create (they answer 404 for a missing object),
//! so only an apply asks for `create` this way.
//!
//! The rules are read from the chart as `cargo xtask charts` renders it
//! ([`Rbac::from_chart`]): the Roles and ClusterRoles bound to a
//! ServiceAccount by the render's bindings.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use serde_json::{Value, json};

use super::Access;

/// One grant of a rule: a verb on a resource (`plural` or `plural/sub`) of
/// an API group, in every namespace (a ClusterRole's) or in one (a Role's).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord, Clone)]
pub struct Grant {
    /// API group (`""` for the core group).
    pub group: String,
    /// `plural` or `plural/sub`.
    pub resource: String,
    /// The verb.
    pub verb: String,
    /// A ClusterRole's: granted in every namespace and cluster-wide.
    pub cluster: bool,
}

impl Grant {
    /// Whether the grant covers requests of kind `access`.
    #[must_use]
    pub fn covers(&self, access: &Access) -> bool {
        let resource = match &access.subresource {
            Some(sub) => format!("{}/{sub}", access.resource),
            None => access.resource.clone(),
        };
        self.group == access.group
            && self.resource == resource
            && self.verb == access.verb
            && (self.cluster || access.namespaced)
    }
}

/// One rule of a Role (in `namespace`) or a ClusterRole (`namespace` None).
#[derive(Clone, Debug)]
pub struct Rule {
    /// API groups (`""` for the core group).
    pub groups: Vec<String>,
    /// Resources, `plural` or `plural/sub`.
    pub resources: Vec<String>,
    /// Verbs.
    pub verbs: Vec<String>,
    /// Names it is limited to (empty: every name).
    pub names: Vec<String>,
    /// The namespace of a Role's rule; None for a ClusterRole's.
    pub namespace: Option<String>,
}

/// What one request asks of the authorizer.
#[derive(Clone, Debug)]
pub struct Attributes<'a> {
    /// The verb.
    pub verb: &'a str,
    /// API group.
    pub group: &'a str,
    /// Resource (plural).
    pub resource: &'a str,
    /// Subresource, such as `status`.
    pub subresource: Option<&'a str>,
    /// Namespace of a namespaced request.
    pub namespace: Option<&'a str>,
    /// Name, when the request names one.
    pub name: Option<&'a str>,
}

impl Attributes<'_> {
    /// `plural` or `plural/sub`, as rules name it.
    fn full_resource(&self) -> String {
        match self.subresource {
            Some(sub) => format!("{}/{sub}", self.resource),
            None => self.resource.to_owned(),
        }
    }

    /// `resource.group` (`resource` for the core group).
    fn group_resource(&self) -> String {
        if self.group.is_empty() {
            self.resource.to_owned()
        } else {
            format!("{}.{}", self.resource, self.group)
        }
    }

    /// The 403 Status the real server answers with, its message ending in
    /// `reason`.
    fn forbidden(&self, reason: &str) -> Value {
        let subject = match self.name {
            Some(name) => format!("{} {name:?}", self.group_resource()),
            None => self.group_resource(),
        };
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": format!("{subject} is forbidden: {reason}"),
               "reason": "Forbidden",
               "details": {"name": self.name.unwrap_or_default(), "group": self.group,
                           "kind": self.resource},
               "code": 403})
    }
}

/// The rules of one user.
#[derive(Clone, Debug)]
pub struct Rbac {
    /// The user's name (`system:serviceaccount:<ns>:<name>`).
    pub user: String,
    /// Every rule bound to it.
    pub rules: Vec<Rule>,
}

/// Where `cargo xtask charts` writes the default render of the chart.
#[must_use]
pub fn chart_render() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/images/chart-default-render.json")
}

fn strings(value: &Value) -> Vec<String> {
    value
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

impl Rbac {
    /// The rules the chart's default render binds to the ServiceAccount
    /// `account` (its RoleBindings and ClusterRoleBindings).
    ///
    /// # Panics
    /// When the render is missing (`cargo xtask charts` writes it) or
    /// binds nothing to `account`.
    #[must_use]
    pub fn from_chart(account: &str) -> Self {
        let path = chart_render();
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; `cargo xtask charts` renders it", path.display()));
        let objects: Vec<Value> = serde_json::from_str(&text).expect("the render is a JSON list");
        Self::from_objects(&objects, account)
    }

    /// The rules `objects` (a render) bind to the ServiceAccount `account`.
    ///
    /// # Panics
    /// When they bind nothing to it.
    #[must_use]
    pub fn from_objects(objects: &[Value], account: &str) -> Self {
        let mut user = None;
        let mut rules = Vec::new();
        for binding in objects {
            let kind = binding["kind"].as_str().unwrap_or_default();
            if !matches!(kind, "RoleBinding" | "ClusterRoleBinding") {
                continue;
            }
            let Some(subject) = binding["subjects"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|s| s["kind"] == "ServiceAccount" && s["name"].as_str() == Some(account))
            else {
                continue;
            };
            let subject_namespace = subject["namespace"].as_str().unwrap_or_default();
            user = Some(format!(
                "system:serviceaccount:{subject_namespace}:{account}"
            ));
            // A RoleBinding grants in its namespace, even a ClusterRole's rules.
            let namespace = (kind == "RoleBinding").then(|| {
                binding["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            });
            let role_kind = binding["roleRef"]["kind"].as_str().unwrap_or_default();
            let role_name = binding["roleRef"]["name"].as_str().unwrap_or_default();
            let role = objects.iter().find(|o| {
                o["kind"].as_str() == Some(role_kind)
                    && o["metadata"]["name"].as_str() == Some(role_name)
                    && (role_kind == "ClusterRole"
                        || o["metadata"]["namespace"] == binding["metadata"]["namespace"])
            });
            let Some(role) = role else {
                let binding = binding["metadata"]["name"].as_str().unwrap_or_default();
                panic!("{kind} {binding} binds {role_kind} {role_name}, which the render lacks")
            };
            for rule in role["rules"].as_array().into_iter().flatten() {
                rules.push(Rule {
                    groups: strings(&rule["apiGroups"]),
                    resources: strings(&rule["resources"]),
                    verbs: strings(&rule["verbs"]),
                    names: strings(&rule["resourceNames"]),
                    namespace: namespace.clone(),
                });
            }
        }
        let user = user.unwrap_or_else(|| panic!("the render binds nothing to {account}"));
        Self { user, rules }
    }

    /// The same rules with the chart installed in `namespace` (its Roles
    /// and the ServiceAccount there).
    #[must_use]
    pub fn in_release_namespace(mut self, namespace: &str) -> Self {
        for rule in &mut self.rules {
            if rule.namespace.is_some() {
                rule.namespace = Some(namespace.to_owned());
            }
        }
        let account = self.user.rsplit(':').next().unwrap_or_default().to_owned();
        self.user = format!("system:serviceaccount:{namespace}:{account}");
        self
    }

    /// Every grant of the rules, one per group, resource and verb.
    #[must_use]
    pub fn grants(&self) -> BTreeSet<Grant> {
        let mut grants = BTreeSet::new();
        for rule in &self.rules {
            for group in &rule.groups {
                for resource in &rule.resources {
                    for verb in &rule.verbs {
                        grants.insert(Grant {
                            group: group.clone(),
                            resource: resource.clone(),
                            verb: verb.clone(),
                            cluster: rule.namespace.is_none(),
                        });
                    }
                }
            }
        }
        grants
    }

    /// Whether a rule allows `request`.
    #[must_use]
    pub fn allows(&self, request: &Attributes<'_>) -> bool {
        let resource = request.full_resource();
        self.rules.iter().any(|rule| {
            let any = |list: &[String], item: &str| list.iter().any(|x| x == "*" || x == item);
            any(&rule.verbs, request.verb)
                && any(&rule.groups, request.group)
                && any(&rule.resources, &resource)
                && (rule.names.is_empty()
                    || request
                        .name
                        .is_some_and(|n| rule.names.iter().any(|x| x == n)))
                && rule
                    .namespace
                    .as_ref()
                    .is_none_or(|ns| request.namespace == Some(ns.as_str()))
        })
    }

    /// The 403 of the authorization filter for a request it refuses.
    #[must_use]
    pub fn refuse(&self, request: &Attributes<'_>) -> Value {
        let scope = match request.namespace {
            Some(ns) => format!("in the namespace {ns:?}"),
            None => "at the cluster scope".to_owned(),
        };
        request.forbidden(&format!(
            "User {:?} cannot {} resource {:?} in API group {:?} {scope}",
            self.user,
            request.verb,
            request.full_resource(),
            request.group
        ))
    }

    /// The 403 of the patch handler refusing the `create` of an apply: the
    /// authorizer's reason, which RBAC leaves empty.
    #[must_use]
    pub fn refuse_apply_create(request: &Attributes<'_>) -> Value {
        request.forbidden("")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render() -> Vec<Value> {
        serde_json::from_value(json!([
            {"kind": "ClusterRole", "metadata": {"name": "op"}, "rules": [
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["patch"]},
                {"apiGroups": ["admissionregistration.k8s.io"],
                 "resources": ["validatingwebhookconfigurations"],
                 "resourceNames": ["hooks"], "verbs": ["get"]}]},
            {"kind": "ClusterRoleBinding", "metadata": {"name": "op"},
             "roleRef": {"kind": "ClusterRole", "name": "op"},
             "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "sys"}]},
            {"kind": "Role", "metadata": {"name": "op", "namespace": "sys"}, "rules": [
                {"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"],
                 "resourceNames": ["tls"]}]},
            {"kind": "RoleBinding", "metadata": {"name": "op", "namespace": "sys"},
             "roleRef": {"kind": "Role", "name": "op"},
             "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "sys"}]}
        ]))
        .unwrap()
    }

    fn request<'a>(
        verb: &'a str,
        group: &'a str,
        resource: &'a str,
        namespace: Option<&'a str>,
        name: Option<&'a str>,
    ) -> Attributes<'a> {
        Attributes {
            verb,
            group,
            resource,
            subresource: None,
            namespace,
            name,
        }
    }

    #[test]
    fn bound_rules_decide_by_verb_group_resource_namespace_and_name() {
        let rbac = Rbac::from_objects(&render(), "op");
        assert_eq!(rbac.user, "system:serviceaccount:sys:op");
        let slices = |verb| request(verb, "discovery.k8s.io", "endpointslices", Some("a"), None);
        assert!(rbac.allows(&slices("patch")));
        assert!(!rbac.allows(&slices("create")));
        let hooks = |name| {
            request(
                "get",
                "admissionregistration.k8s.io",
                "validatingwebhookconfigurations",
                None,
                name,
            )
        };
        assert!(rbac.allows(&hooks(Some("hooks"))));
        assert!(!rbac.allows(&hooks(Some("other"))));
        assert!(!rbac.allows(&hooks(None)));
        // The Role grants in its namespace only.
        assert!(rbac.allows(&request("list", "", "secrets", Some("sys"), Some("tls"))));
        assert!(!rbac.allows(&request("list", "", "secrets", Some("b"), Some("tls"))));
    }

    #[test]
    fn refusals_read_as_the_real_servers() {
        let rbac = Rbac::from_objects(&render(), "op");
        let refused = rbac.refuse(&request(
            "create",
            "discovery.k8s.io",
            "endpointslices",
            Some("a"),
            None,
        ));
        assert_eq!(
            refused["message"],
            "endpointslices.discovery.k8s.io is forbidden: User \"system:serviceaccount:sys:op\" \
             cannot create resource \"endpointslices\" in API group \"discovery.k8s.io\" in the \
             namespace \"a\""
        );
        assert_eq!(refused["reason"], "Forbidden");
        assert_eq!(refused["code"], 403);
        assert_eq!(refused["details"]["group"], "discovery.k8s.io");
        assert_eq!(refused["details"]["kind"], "endpointslices");
        let cluster = rbac.refuse(&request("delete", "", "namespaces", None, Some("x")));
        assert_eq!(
            cluster["message"],
            "namespaces \"x\" is forbidden: User \"system:serviceaccount:sys:op\" cannot delete \
             resource \"namespaces\" in API group \"\" at the cluster scope"
        );
        let create = Rbac::refuse_apply_create(&request(
            "create",
            "coordination.k8s.io",
            "leases",
            Some("sys"),
            Some("l"),
        ));
        assert_eq!(
            create["message"],
            "leases.coordination.k8s.io \"l\" is forbidden: "
        );
        assert_eq!(create["details"]["name"], "l");
    }
}
