//! Reviews the FlatNetworkConfig (create, update): only the one object
//! named `cluster`, a valid MAC pool range, settings in range. A range
//! that is not locally administered, or that overlaps MACs other software
//! is known to use ([`WELL_KNOWN_MACS`]), is admitted with a warning.

use flatnet_k8s::{
    api::{CONFIG_NAME, FlatNetworkConfig, FlatNetworkConfigSpec},
    ipam::MacRange,
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

/// MAC ranges other software hands out on hosts and LANs flatnet shares:
/// a pool overlapping one may give a pod a MAC such a host or interface
/// already has. (first, last, who uses it)
pub const WELL_KNOWN_MACS: &[(&str, &str, &str)] = &[
    (
        "02:42:00:00:00:00",
        "02:42:ff:ff:ff:ff",
        "Docker bridge networks (02:42 and the container's IPv4 address)",
    ),
    (
        "0a:58:00:00:00:00",
        "0a:58:ff:ff:ff:ff",
        "OVN-Kubernetes pod interfaces (0a:58 and the pod's IPv4 address)",
    ),
    (
        "52:54:00:00:00:00",
        "52:54:00:ff:ff:ff",
        "QEMU/KVM and libvirt guests",
    ),
    (
        "ee:ee:ee:ee:ee:ee",
        "ee:ee:ee:ee:ee:ee",
        "Calico's host-side veth interfaces",
    ),
    (
        "00:00:5e:00:01:00",
        "00:00:5e:00:02:ff",
        "VRRP virtual routers (keepalived and routers' first-hop redundancy)",
    ),
];

/// Warnings for an admitted spec.
#[must_use]
pub fn spec_warnings(spec: &FlatNetworkConfigSpec) -> Vec<String> {
    let Ok(Some(range)) = spec.mac_pool.range() else {
        return Vec::new();
    };
    let mut warnings = Vec::new();
    if !range.is_locally_administered() {
        warnings.push(format!(
            "spec.macPool range {range} is not locally administered (second-lowest bit of the first byte clear): its MACs may belong to a vendor's hardware on the LAN; prefer a range starting with 02"
        ));
    }
    for (first, last, user) in WELL_KNOWN_MACS {
        // Each parses (tested).
        if let Ok(known) = MacRange::parse(first, last)
            && range.overlaps(&known)
        {
            warnings.push(format!(
                "spec.macPool range {range} overlaps {known}, used by {user}: pods may get a MAC such an interface already has on the LAN; choose a range outside it"
            ));
        }
    }
    warnings
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

    #[test]
    fn a_range_over_macs_other_software_uses_is_admitted_with_a_warning_naming_it() {
        let docker = spec_warnings(&spec(Some("02:40:00:00:00:00"), Some("02:43:00:00:00:00")));
        assert_eq!(docker.len(), 1, "{docker:?}");
        assert!(
            docker[0].contains("02:42:00:00:00:00-02:42:ff:ff:ff:ff")
                && docker[0].contains("Docker"),
            "{docker:?}"
        );
        let qemu = spec_warnings(&spec(Some("52:54:00:12:00:00"), Some("52:54:00:12:00:ff")));
        assert!(qemu[0].contains("QEMU"), "{qemu:?}");
        let vrrp = spec_warnings(&spec(Some("00:00:5e:00:00:00"), Some("00:00:5e:00:ff:ff")));
        assert_eq!(
            vrrp.len(),
            2,
            "not locally administered, and VRRP: {vrrp:?}"
        );
        assert!(vrrp[1].contains("VRRP"), "{vrrp:?}");
        // Just beside a known range: no warning.
        assert!(
            spec_warnings(&spec(Some("02:41:00:00:00:00"), Some("02:41:ff:ff:ff:ff"))).is_empty()
        );
        for (first, last, _) in WELL_KNOWN_MACS {
            assert!(MacRange::parse(first, last).is_ok(), "{first}-{last}");
        }
    }
}
