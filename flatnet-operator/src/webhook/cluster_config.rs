//! Reviews the FlatNetworkConfig (create, update): only the one object
//! named `cluster`, and a spec without
//! [`problems`](flatnet_k8s::api::FlatNetworkConfigSpec::problems) (a
//! valid MAC pool range, settings in range). A range that is not locally
//! administered is admitted with a warning, as is a range the node agents
//! saw foreign MACs in on the LAN ([`wire_warnings`]).

use std::collections::BTreeSet;

use flatnet_k8s::{
    api::{CONFIG_NAME, FlatNetworkConfig},
    ipam::{
        DEFAULT_WIRE_WINDOW, Mac,
        foreign_macs::{foreign_macs, inside, overlap_warning},
    },
};
use k8s_openapi::jiff::Timestamp;
use kube::{
    ResourceExt,
    core::{
        DynamicObject,
        admission::{AdmissionRequest, Operation},
    },
};

use super::{Denial, lookup::Lookup};

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

/// The warning of an admitted create, or an update that changes
/// `spec.macPool`'s range: the MACs inside the new range that the node
/// agents saw on the LAN within the default wire window and that no
/// FlatNetworkIP holds. The FlatNetworkIPs are listed only when there are
/// such MACs. A failed lookup gives no warning: the review itself has
/// passed.
pub async fn wire_warnings(
    lookup: &Lookup,
    request: &AdmissionRequest<DynamicObject>,
) -> Vec<String> {
    let Ok(Some(config)) = parse(request) else {
        return Vec::new();
    };
    let Ok(Some(range)) = config.spec.mac_pool.range() else {
        return Vec::new();
    };
    let old_range = request
        .old_object
        .as_ref()
        .and_then(|old| old.clone().try_parse::<FlatNetworkConfig>().ok())
        .and_then(|old| old.spec.mac_pool.range().ok().flatten());
    if old_range == Some(range) {
        return Vec::new();
    }
    let Ok(reports) = lookup.wire_claims().await else {
        return Vec::new();
    };
    let mut seen = inside(
        &range,
        &foreign_macs(&reports, Timestamp::now(), DEFAULT_WIRE_WINDOW),
    );
    if seen.is_empty() {
        return Vec::new();
    }
    // A report may predate the pod that now holds the MAC.
    if let Ok(ips) = lookup.ips().await {
        let held: BTreeSet<Mac> = ips
            .iter()
            .filter_map(|ip| Mac::parse(&ip.status.as_ref()?.mac).ok())
            .collect();
        seen.retain(|claim| Mac::parse(&claim.mac).is_ok_and(|mac| !held.contains(&mac)));
    }
    overlap_warning("spec.macPool range", &range, &seen)
        .into_iter()
        .collect()
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
