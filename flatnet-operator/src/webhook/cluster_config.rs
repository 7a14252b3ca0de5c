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
