//! Kubernetes label selectors, evaluated the way the API server does: one
//! implementation for network policy (agent), runtime configuration
//! (operator, webhook) and floating-IP pool eligibility.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

/// Labels of a pod or namespace.
pub type Labels = BTreeMap<String, String>;

/// Why a selector cannot be evaluated.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    /// An operator other than `In`, `NotIn`, `Exists`, `DoesNotExist`.
    #[error(
        "unknown label selector operator {operator:?} on key {key:?}; use In, NotIn, Exists or DoesNotExist"
    )]
    UnknownOperator {
        /// The label key.
        key: String,
        /// The operator.
        operator: String,
    },
}

/// The label selector operators there are.
const OPERATORS: [&str; 4] = ["In", "NotIn", "Exists", "DoesNotExist"];

/// Whether `selector` can be evaluated: every operator is one there is.
/// [`matches`] stops at the first pair that fails, so it does not tell;
/// this is the check at admission.
///
/// # Errors
/// The first expression with an unknown operator.
pub fn check(selector: &LabelSelector) -> Result<(), SelectorError> {
    match selector
        .match_expressions
        .iter()
        .flatten()
        .find(|r| !OPERATORS.contains(&r.operator.as_str()))
    {
        Some(requirement) => Err(SelectorError::UnknownOperator {
            key: requirement.key.clone(),
            operator: requirement.operator.clone(),
        }),
        None => Ok(()),
    }
}

/// Whether `labels` satisfy `selector` (Kubernetes semantics: every
/// `matchLabels` pair and every expression must hold; an empty selector
/// matches everything).
pub fn matches(selector: &LabelSelector, labels: &Labels) -> Result<bool, SelectorError> {
    if let Some(match_labels) = &selector.match_labels
        && !match_labels.iter().all(|(k, v)| labels.get(k) == Some(v))
    {
        return Ok(false);
    }
    for requirement in selector.match_expressions.iter().flatten() {
        let value = labels.get(&requirement.key);
        let values = requirement.values.as_deref().unwrap_or_default();
        let holds = match requirement.operator.as_str() {
            "In" => value.is_some_and(|v| values.contains(v)),
            "NotIn" => value.is_none_or(|v| !values.contains(v)),
            "Exists" => value.is_some(),
            "DoesNotExist" => value.is_none(),
            other => {
                return Err(SelectorError::UnknownOperator {
                    key: requirement.key.clone(),
                    operator: other.to_owned(),
                });
            }
        };
        if !holds {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelectorRequirement;

    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> Labels {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn expr(key: &str, operator: &str, values: &[&str]) -> LabelSelectorRequirement {
        LabelSelectorRequirement {
            key: key.into(),
            operator: operator.into(),
            values: Some(values.iter().map(|v| (*v).to_owned()).collect()),
        }
    }

    #[test]
    fn selector_semantics() {
        let web = labels(&[("app", "web"), ("env", "prod")]);
        assert!(matches(&LabelSelector::default(), &web).unwrap());
        let by_label = LabelSelector {
            match_labels: Some(labels(&[("app", "web")])),
            ..Default::default()
        };
        assert!(matches(&by_label, &web).unwrap());
        assert!(!matches(&by_label, &labels(&[("app", "db")])).unwrap());
        let with = |e| LabelSelector {
            match_expressions: Some(vec![e]),
            ..Default::default()
        };
        assert!(matches(&with(expr("env", "In", &["prod", "dev"])), &web).unwrap());
        assert!(!matches(&with(expr("env", "NotIn", &["prod"])), &web).unwrap());
        assert!(matches(&with(expr("tier", "NotIn", &["x"])), &web).unwrap());
        assert!(matches(&with(expr("app", "Exists", &[])), &web).unwrap());
        assert!(!matches(&with(expr("app", "DoesNotExist", &[])), &web).unwrap());
        assert!(matches(&with(expr("app", "Gt", &[])), &web).is_err());
    }
}
