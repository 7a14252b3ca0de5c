//! Which pods keep their address, and when a recorded address is reused.
//!
//! # StatefulSet policy
//!
//! A pod's allocation record is the FlatNetworkIP named after the pod. A
//! StatefulSet pod has a stable name (`web-0`), so its record can outlive the
//! pod and give the next `web-0` the same address:
//!
//! - With [`StatefulSetAddressPolicy::Sticky`] (the default) the record of a
//!   StatefulSet pod is kept when the pod is deleted — restart, eviction,
//!   node drain or scale-down — and owned by the StatefulSet, so it is
//!   garbage-collected with the StatefulSet. Scaling down and up again, or a
//!   rolling update, gives every ordinal its old address back.
//! - With [`StatefulSetAddressPolicy::Release`] the record goes with the pod,
//!   like any other pod's; the next pod of that name gets the first free
//!   address (often, not always, the same one).
//!
//! Pods of other owners always lose their record with the pod: their names
//! are not stable, so nothing could claim the address again.
//!
//! When a pod finds an existing record of its name, [`reuse_recorded`]
//! decides: keep the address if it still satisfies the pod's request (same
//! subnet, allocatable in the subnet as it is now, and one of the requested
//! addresses when the pod asks for specific ones); otherwise release it and
//! allocate anew.

use std::net::IpAddr;

use super::pool::Pool;

/// What happens to a StatefulSet pod's address when the pod goes away.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StatefulSetAddressPolicy {
    /// Keep the record (and the address) until the StatefulSet is deleted.
    #[default]
    Sticky,
    /// Release the address with the pod.
    Release,
}

/// Who controls a pod, as far as address stickiness is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodController {
    /// An `apps/v1` StatefulSet: stable pod names.
    StatefulSet,
    /// Anything else (ReplicaSet, DaemonSet, Job, none).
    Other,
}

/// The fate of a pod's allocation record when the pod is deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordFate {
    /// Keep the record: the next pod of this name reuses its address.
    Keep,
    /// Delete the record and release the address.
    Delete,
}

/// Decides what happens to a deleted pod's record (see the module docs).
pub fn fate_on_pod_deletion(
    controller: PodController,
    policy: StatefulSetAddressPolicy,
) -> RecordFate {
    match (controller, policy) {
        (PodController::StatefulSet, StatefulSetAddressPolicy::Sticky) => RecordFate::Keep,
        _ => RecordFate::Delete,
    }
}

/// An existing allocation record of the pod's name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recorded<'a> {
    /// The record's subnet (`spec.subnet`).
    pub subnet: &'a str,
    /// The recorded address (`status.addr`), if one was allocated.
    pub addr: Option<IpAddr>,
}

/// What the (new) pod asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request<'a> {
    /// The subnet named by the pod annotation.
    pub subnet: &'a str,
    /// Requested addresses; empty for `auto`.
    pub candidates: &'a [IpAddr],
}

/// Whether a recorded address is reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reuse {
    /// Keep the address; update the record (pod UID, spec) in place.
    Keep(IpAddr),
    /// Allocate anew; first release `release` from the record's subnet.
    Reallocate {
        /// The recorded address to free, if any.
        release: Option<IpAddr>,
    },
}

/// Decides whether a pod reuses the address recorded under its name.
///
/// `pool` is the pool of the requested subnet. The recorded address counts
/// as used in it (it is held by this very record), so only whether the
/// address is still *allocatable* matters, not whether it is free.
pub fn reuse_recorded(recorded: Recorded<'_>, request: Request<'_>, pool: &Pool) -> Reuse {
    let Some(addr) = recorded.addr else {
        return Reuse::Reallocate { release: None };
    };
    let same_subnet = recorded.subnet == request.subnet;
    let still_valid = pool.is_allocatable(addr);
    let requested = request.candidates.is_empty() || request.candidates.contains(&addr);
    if same_subnet && still_valid && requested {
        Reuse::Keep(addr)
    } else {
        Reuse::Reallocate {
            release: Some(addr),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        api::{FlatNetworkSubnetSpec, IpRange},
        validation::validate_subnet,
    };

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    fn pool() -> Pool {
        let spec = FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: "eth0".into(),
            cidr: "10.0.0.0/24".into(),
            gateway: Some(ip("10.0.0.1")),
            ranges: vec![IpRange::new(ip("10.0.0.10"), ip("10.0.0.20"))],
            ..Default::default()
        };
        Pool::with_used(&validate_subnet("net", &spec).unwrap(), [ip("10.0.0.10")]).unwrap()
    }

    #[test]
    fn only_statefulset_records_survive_their_pod_by_default() {
        use PodController::*;
        use StatefulSetAddressPolicy::*;
        assert_eq!(fate_on_pod_deletion(StatefulSet, Sticky), RecordFate::Keep);
        assert_eq!(
            fate_on_pod_deletion(StatefulSet, Release),
            RecordFate::Delete
        );
        assert_eq!(fate_on_pod_deletion(Other, Sticky), RecordFate::Delete);
        assert_eq!(StatefulSetAddressPolicy::default(), Sticky);
    }

    #[test]
    fn recreated_pod_keeps_a_still_valid_address() {
        let recorded = Recorded {
            subnet: "net",
            addr: Some(ip("10.0.0.10")),
        };
        let auto = Request {
            subnet: "net",
            candidates: &[],
        };
        assert_eq!(
            reuse_recorded(recorded, auto, &pool()),
            Reuse::Keep(ip("10.0.0.10"))
        );
        let listed = [ip("10.0.0.11"), ip("10.0.0.10")];
        let specific = Request {
            subnet: "net",
            candidates: &listed,
        };
        assert_eq!(
            reuse_recorded(recorded, specific, &pool()),
            Reuse::Keep(ip("10.0.0.10"))
        );
    }

    #[test]
    fn changed_requests_release_the_old_address() {
        let recorded = Recorded {
            subnet: "net",
            addr: Some(ip("10.0.0.10")),
        };
        let release = Reuse::Reallocate {
            release: Some(ip("10.0.0.10")),
        };
        let other_subnet = Request {
            subnet: "other",
            candidates: &[],
        };
        assert_eq!(reuse_recorded(recorded, other_subnet, &pool()), release);
        let listed = [ip("10.0.0.11")];
        let not_listed = Request {
            subnet: "net",
            candidates: &listed,
        };
        assert_eq!(reuse_recorded(recorded, not_listed, &pool()), release);
        // The subnet's ranges changed under the record.
        let outside = Recorded {
            subnet: "net",
            addr: Some(ip("10.0.0.30")),
        };
        let auto = Request {
            subnet: "net",
            candidates: &[],
        };
        assert_eq!(
            reuse_recorded(outside, auto, &pool()),
            Reuse::Reallocate {
                release: Some(ip("10.0.0.30"))
            }
        );
        let never_allocated = Recorded {
            subnet: "net",
            addr: None,
        };
        assert_eq!(
            reuse_recorded(never_allocated, auto, &pool()),
            Reuse::Reallocate { release: None }
        );
    }
}
