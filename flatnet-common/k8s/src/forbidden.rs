//! What a 403 from the API server refused, read from its message.
//!
//! The authorization filter names the user, verb, resource, API group and
//! namespace: `leases.coordination.k8s.io "x" is forbidden: User "u" cannot
//! patch resource "leases" in API group "coordination.k8s.io" in the
//! namespace "ns"`. A server-side apply of an object that does not exist is
//! authorized a second time, for `create`, by the patch handler, whose
//! refusal carries only the authorizer's reason, empty with RBAC:
//! `leases.coordination.k8s.io "x" is forbidden: `. [`Refusal::of`] reads
//! both, so a log names the verb actually refused and not the one the
//! request was sent with.

use std::fmt;

/// One refused request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The verb refused (`create` for an apply's create).
    pub verb: String,
    /// Resource (plural).
    pub resource: String,
    /// API group (empty for the core group).
    pub group: String,
    /// Namespace, for a namespaced request.
    pub namespace: Option<String>,
    /// Whether the refused `create` is that of a server-side apply.
    pub apply_create: bool,
}

impl Refusal {
    /// What a 403 in `error` refused. `applying` says the request was a
    /// server-side apply, `namespace` where it was sent (the apply's
    /// refusal does not say). None for another error.
    #[must_use]
    pub fn of(error: &kube::Error, applying: bool, namespace: Option<&str>) -> Option<Self> {
        let kube::Error::Api(status) = error else {
            return None;
        };
        if status.code != 403 {
            return None;
        }
        let (subject, reason) = status.message.split_once(" is forbidden: ")?;
        let group_resource = subject.split_once(' ').map_or(subject, |(gr, _)| gr);
        let (resource, group) = group_resource
            .split_once('.')
            .unwrap_or((group_resource, ""));
        let filtered = reason
            .split_once(" cannot ")
            .and_then(|(_, rest)| rest.split_once(' '))
            .map(|(verb, _)| verb.to_owned());
        let stated_namespace = reason
            .split_once(" in the namespace \"")
            .and_then(|(_, rest)| rest.split_once('"'))
            .map(|(ns, _)| ns.to_owned());
        let (verb, apply_create) = match filtered {
            Some(verb) => (verb, false),
            // Only the create check of an apply answers without naming it.
            None if applying => ("create".to_owned(), true),
            None => return None,
        };
        Some(Self {
            verb,
            resource: resource.to_owned(),
            group: group.to_owned(),
            namespace: stated_namespace.or_else(|| namespace.map(str::to_owned)),
            apply_create,
        })
    }
}

/// `; <what was refused>: <grant>` when `error` is a 403 (of an apply when
/// `applying`, sent to `namespace`), else nothing: appended to a logged
/// error, `grant` saying where the missing right is granted.
#[must_use]
pub fn hint(error: &kube::Error, applying: bool, namespace: Option<&str>, grant: &str) -> String {
    Refusal::of(error, applying, namespace)
        .map(|refusal| format!("; {refusal}: {grant}"))
        .unwrap_or_default()
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the API server refused to {} {} in API group {:?}",
            self.verb, self.resource, self.group
        )?;
        match &self.namespace {
            Some(ns) => write!(f, " in the namespace {ns:?}")?,
            None => write!(f, " at the cluster scope")?,
        }
        if self.apply_create {
            write!(
                f,
                " (a server-side apply of an object that does not exist creates it, and needs create as well as patch)"
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forbidden(message: &str) -> kube::Error {
        kube::Error::Api(
            kube::core::Status::failure(message, "Forbidden")
                .with_code(403)
                .boxed(),
        )
    }

    #[test]
    fn the_filters_refusal_names_its_verb_and_namespace() {
        let error = forbidden(
            "leases.coordination.k8s.io \"l\" is forbidden: User \"system:serviceaccount:a:b\" \
             cannot patch resource \"leases\" in API group \"coordination.k8s.io\" in the namespace \"ns\"",
        );
        let refusal = Refusal::of(&error, true, Some("other")).unwrap();
        assert_eq!(
            refusal.to_string(),
            "the API server refused to patch leases in API group \"coordination.k8s.io\" in the namespace \"ns\""
        );
    }

    #[test]
    fn an_applys_empty_refusal_is_its_create() {
        let error = forbidden("endpointslices.discovery.k8s.io \"web-x\" is forbidden: ");
        let refusal = Refusal::of(&error, true, Some("ns")).unwrap();
        assert_eq!(refusal.verb, "create");
        assert_eq!(refusal.resource, "endpointslices");
        assert_eq!(refusal.group, "discovery.k8s.io");
        assert_eq!(refusal.namespace.as_deref(), Some("ns"));
        assert!(
            refusal
                .to_string()
                .contains("needs create as well as patch")
        );
        // The core group, cluster scope.
        let core = forbidden("services \"s\" is forbidden: ");
        let refusal = Refusal::of(&core, true, None).unwrap();
        assert_eq!(
            (refusal.resource.as_str(), refusal.group.as_str()),
            ("services", "")
        );
        assert!(refusal.to_string().contains("at the cluster scope"));
        // Not an apply, not a 403: nothing to say.
        assert_eq!(Refusal::of(&core, false, None), None);
        let conflict = kube::Error::Api(
            kube::core::Status::failure("x", "Conflict")
                .with_code(409)
                .boxed(),
        );
        assert_eq!(Refusal::of(&conflict, true, None), None);
    }
}
