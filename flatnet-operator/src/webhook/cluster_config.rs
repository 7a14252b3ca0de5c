//! Reviews the FlatNetworkConfig (create, update): only the one object
//! named `cluster`, and a spec without
//! [`problems`](flatnet_k8s::api::FlatNetworkConfigSpec::problems) (a
//! valid MAC pool range, settings in range). A range that is not locally
//! administered is admitted with a warning.

use flatnet_k8s::api::{CONFIG_NAME, FlatNetworkConfig};
use kube::{
    ResourceExt,
    core::{
        DynamicObject,
        admission::{AdmissionRequest, Operation},
    },
};

use super::Denial;

fn parse(request: &AdmissionRequest<DynamicObject>) -> Result<Option<FlatNetworkConfig>, Denial> {
    if matches!(request.operation, Operation::Delete) {
        return Ok(None);
    }
    let Some(object) = request.object.as_ref() else {
        return Ok(None);
    };
    object.clone().try_parse().map(Some).map_err(|error| {
        Denial::new(
            "bad_request",
            format!(
                "the FlatNetworkConfig does not match its schema ({error}): fix the field named"
            ),
        )
    })
}

/// Reviews one FlatNetworkConfig request.
///
/// # Errors
/// The [`Denial`] the user sees.
pub fn review(request: &AdmissionRequest<DynamicObject>) -> Result<(), Denial> {
    let Some(config) = parse(request)? else {
        return Ok(());
    };
    let name = config.name_any();
    if name != CONFIG_NAME {
        return Err(Denial::new(
            "wrong_name",
            format!(
                "FlatNetworkConfig {name:?} is refused: the cluster has one FlatNetworkConfig, named {CONFIG_NAME:?}; edit that one"
            ),
        ));
    }
    let problems = config.spec.problems();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(Denial::new(
            "invalid_config",
            format!(
                "FlatNetworkConfig {name} is invalid: {}",
                problems.join("; ")
            ),
        ))
    }
}

/// The warnings of an admitted request.
#[must_use]
pub fn warnings(request: &AdmissionRequest<DynamicObject>) -> Vec<String> {
    parse(request)
        .ok()
        .flatten()
        .map(|c| c.spec.warnings())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use kube::core::admission::AdmissionReview;
    use serde_json::json;

    use super::*;
    use crate::fixtures::admission_review;

    fn request(spec: serde_json::Value) -> AdmissionRequest<DynamicObject> {
        let object = json!({
            "apiVersion": "flatnetwork.pandaria.io/v1", "kind": "FlatNetworkConfig",
            "metadata": {"name": CONFIG_NAME}, "spec": spec
        });
        let review: AdmissionReview<DynamicObject> =
            serde_json::from_value(admission_review("u1", "UPDATE", Some(&object), None))
                .expect("a review");
        review.try_into().expect("a request")
    }

    #[test]
    fn the_agents_settings_and_the_progress_deadline_are_reviewed() {
        let admitted = request(json!({
            "agents": {"conflictProbe": {"enabled": true, "waitMilliseconds": 300},
                       "policyEnforcement": false},
            "progressDeadlineSeconds": 900
        }));
        assert!(review(&admitted).is_ok());

        let refused = review(&request(json!({
            "agents": {"conflictProbe": {"waitMilliseconds": 60000}},
            "progressDeadlineSeconds": 0
        })))
        .expect_err("out of range");
        assert_eq!(refused.reason, "invalid_config");
        assert!(
            refused
                .message
                .contains("spec.agents.conflictProbe.waitMilliseconds 60000 is out of range")
                && refused.message.contains("spec.progressDeadlineSeconds 0"),
            "{}",
            refused.message
        );
        let mistyped = review(&request(json!({"agents": {"policyEnforcement": "off"}})))
            .expect_err("not a boolean");
        assert_eq!(mistyped.reason, "bad_request");
        assert!(
            mistyped.message.contains("does not match its schema"),
            "{}",
            mistyped.message
        );
    }
}
