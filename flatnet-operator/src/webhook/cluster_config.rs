//! Reviews the FlatNetworkConfig (create, update): only the one object
//! named `cluster`, a valid MAC pool range, settings in range. A range
//! that is not locally administered is admitted with a warning.

use flatnet_k8s::{
    api::{CONFIG_NAME, FlatNetworkConfig, FlatNetworkConfigSpec},
    validation::{MAX_MTU, MIN_MTU_IPV4},
};
use kube::{
    ResourceExt,
    core::{
        DynamicObject,
        admission::{AdmissionRequest, Operation},
    },
};

use super::Denial;

/// Every problem of `spec`, each naming its field.
#[must_use]
pub fn spec_problems(spec: &FlatNetworkConfigSpec) -> Vec<String> {
    let mut problems = Vec::new();
    if let Err(error) = spec.mac_pool.range() {
        problems.push(format!("spec.{error}"));
    }
    if let Some(mtu) = spec.default_mtu
        && mtu != 0
        && !(MIN_MTU_IPV4..=MAX_MTU).contains(&mtu)
    {
        problems.push(format!(
            "spec.defaultMtu {mtu} is out of range: use {MIN_MTU_IPV4}..{MAX_MTU}, or 0 for the parent link's"
        ));
    }
    if let Some(policy) = &spec.arp_policy
        && !["arp_notify", "arping"].contains(&policy.as_str())
    {
        problems.push(format!(
            "spec.arpPolicy {policy:?} is not a policy: use arp_notify or arping"
        ));
    }
    problems
}

/// Warnings for an admitted spec.
#[must_use]
pub fn spec_warnings(spec: &FlatNetworkConfigSpec) -> Vec<String> {
    match spec.mac_pool.range() {
        Ok(Some(range)) if !range.is_locally_administered() => vec![format!(
            "spec.macPool range {range} is not locally administered (second-lowest bit of the first byte clear): its MACs may belong to a vendor's hardware on the LAN; prefer a range starting with 02"
        )],
        _ => Vec::new(),
    }
}

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
    let problems = spec_problems(&config.spec);
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
        .map(|c| spec_warnings(&c.spec))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use flatnet_k8s::api::MacPoolSpec;

    fn spec(start: Option<&str>, end: Option<&str>) -> FlatNetworkConfigSpec {
        FlatNetworkConfigSpec {
            mac_pool: MacPoolSpec {
                range_start: start.map(Into::into),
                range_end: end.map(Into::into),
                ..MacPoolSpec::default()
            },
            ..FlatNetworkConfigSpec::default()
        }
    }

    #[test]
    fn bad_ranges_and_settings_are_refused_naming_the_field() {
        assert!(spec_problems(&spec(None, None)).is_empty());
        assert!(
            spec_problems(&spec(Some("02:00:00:00:00:00"), Some("02:00:00:ff:ff:ff"))).is_empty()
        );
        let half = spec_problems(&spec(Some("02:00:00:00:00:00"), None));
        assert!(half[0].contains("both rangeStart and rangeEnd"), "{half:?}");
        let reversed = spec_problems(&spec(Some("02:00:00:00:00:09"), Some("02:00:00:00:00:01")));
        assert!(reversed[0].contains("must not be after"), "{reversed:?}");
        let multicast = spec_problems(&spec(Some("01:00:00:00:00:00"), Some("01:00:00:00:00:09")));
        assert!(multicast[0].contains("macPool.rangeStart"), "{multicast:?}");
        let mut bad = spec(None, None);
        bad.default_mtu = Some(50);
        bad.arp_policy = Some("loud".into());
        let problems = spec_problems(&bad);
        assert!(
            problems[0].starts_with("spec.defaultMtu 50"),
            "{problems:?}"
        );
        assert!(problems[1].starts_with("spec.arpPolicy"), "{problems:?}");
    }

    #[test]
    fn a_globally_administered_range_is_admitted_with_a_warning() {
        let warnings = spec_warnings(&spec(Some("00:50:56:00:00:00"), Some("00:50:56:00:ff:ff")));
        assert!(
            warnings[0].contains("not locally administered"),
            "{warnings:?}"
        );
        assert!(
            spec_warnings(&spec(Some("02:50:56:00:00:00"), Some("02:50:56:00:ff:ff"))).is_empty()
        );
    }
}
