//! Review of FlatNetworkSubnets.
//!
//! - create and update: the spec is valid (`validate_subnet`), the subnet is
//!   in `cattle-flat-network`, it does not conflict with the subnets on the
//!   same master and VLAN (`check_siblings`);
//! - update while pods hold addresses: master, VLAN and flatMode stay, and
//!   every held address stays allocatable under the new CIDR, ranges and
//!   gateway;
//! - delete: refused while any FlatNetworkIP still uses the subnet;
//! - create and update allowed: a warning when the pool (or, on update,
//!   what the update adds to it) covers addresses the node agents saw live
//!   on the LAN ([`wire_warnings`]).
//!
//! An update that leaves the spec as it is (labels, finalizers) is allowed,
//! as is any update of a subnet being deleted, so the controller's own
//! writes never depend on the webhook.

use flatnet_k8s::{
    api::{FlatNetworkIP, FlatNetworkSubnet},
    ipam::{DEFAULT_WIRE_WINDOW, LiveAddresses, Pool, PoolError},
    keys::SUBNET_NAMESPACE,
    validation::{ValidSubnet, check_siblings, validate_subnet},
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

/// How many holders a message lists before "and N more".
const LISTED: usize = 3;

fn parse(object: &DynamicObject) -> Result<FlatNetworkSubnet, Denial> {
    object.clone().try_parse().map_err(|error| {
        Denial::new(
            "bad_request",
            format!(
                "the FlatNetworkSubnet does not match its schema ({error}): fix the field named"
            ),
        )
    })
}

/// Reviews one FlatNetworkSubnet request.
///
/// # Errors
/// The [`Denial`] the user sees.
pub async fn review(
    lookup: &Lookup,
    request: &AdmissionRequest<DynamicObject>,
) -> Result<(), Denial> {
    match request.operation {
        Operation::Delete => {
            let name = &request.name;
            let users = users_of(&lookup.ips().await?, name);
            if users.is_empty() {
                return Ok(());
            }
            Err(Denial::new(
                "subnet_in_use",
                format!(
                    "FlatNetworkSubnet {name} is still used by {} FlatNetworkIP(s) ({}): delete the pods and StatefulSets using it first",
                    users.len(),
                    list(&users)
                ),
            ))
        }
        Operation::Create | Operation::Update => {
            let Some(object) = &request.object else {
                return Ok(());
            };
            let subnet = parse(object)?;
            let old = request.old_object.as_ref().map(parse).transpose()?;
            if let Some(old) = &old
                && (old.spec == subnet.spec || subnet.metadata.deletion_timestamp.is_some())
            {
                return Ok(());
            }
            review_spec(lookup, &subnet, old.as_ref()).await
        }
        Operation::Connect => Ok(()),
    }
}

async fn review_spec(
    lookup: &Lookup,
    subnet: &FlatNetworkSubnet,
    old: Option<&FlatNetworkSubnet>,
) -> Result<(), Denial> {
    let name = subnet.name_any();
    let namespace = subnet.namespace().unwrap_or_default();
    if namespace != SUBNET_NAMESPACE {
        return Err(Denial::new(
            "wrong_namespace",
            format!(
                "FlatNetworkSubnet {name} is in namespace {namespace}: create subnets in namespace {SUBNET_NAMESPACE}, where pods and the operator look for them"
            ),
        ));
    }
    let valid = validate_subnet(&name, &subnet.spec)
        .map_err(|invalid| Denial::new("invalid_subnet", invalid.to_string()))?;

    let siblings: Vec<ValidSubnet> = lookup
        .subnets()
        .await?
        .iter()
        .filter_map(|s| validate_subnet(&s.name_any(), &s.spec).ok())
        .collect();
    check_siblings(&valid, &siblings)
        .map_err(|conflicts| Denial::new("subnet_conflict", conflicts.to_string()))?;

    if let Some(old) = old {
        check_held_addresses(lookup, &valid, old).await?;
    }
    Ok(())
}

/// On update: the pods holding addresses must keep working with the new spec.
async fn check_held_addresses(
    lookup: &Lookup,
    valid: &ValidSubnet,
    old: &FlatNetworkSubnet,
) -> Result<(), Denial> {
    let ips = lookup.ips().await?;
    let users = users_of(&ips, &valid.name);
    if users.is_empty() {
        return Ok(());
    }
    let link_fields = [
        ("spec.master", old.spec.master != valid.parent.master),
        ("spec.vlan", old.spec.vlan != i64::from(valid.parent.vlan)),
        (
            "spec.flatMode",
            old.spec.flat_mode.trim() != valid.link_mode.flat_mode().to_string(),
        ),
    ];
    if let Some((field, _)) = link_fields.iter().find(|(_, changed)| *changed) {
        return Err(Denial::new(
            "subnet_in_use",
            format!(
                "{field} of FlatNetworkSubnet {} cannot change while {} FlatNetworkIP(s) use it ({}): their interfaces hang off the current link; delete those pods first, or create a new subnet",
                valid.name,
                users.len(),
                list(&users)
            ),
        ));
    }
    let pool = Pool::new(valid);
    for record in ips.iter().filter(|ip| ip.spec.subnet == valid.name) {
        let Some(addr) = record.status.as_ref().and_then(|s| s.addr) else {
            continue;
        };
        if pool.is_allocatable(addr) {
            continue;
        }
        let why = match pool.clone().allocate_requested(&[addr]) {
            Err(PoolError::OutsideSubnet { cidr, .. }) => format!("outside spec.cidr {cidr}"),
            Err(PoolError::NotAllocatable { reason, .. }) => reason.to_owned(),
            _ => "not allocatable".to_owned(),
        };
        return Err(Denial::new(
            "subnet_in_use",
            format!(
                "the new spec of FlatNetworkSubnet {} leaves {addr}, held by FlatNetworkIP {}/{}, {why}: keep addresses in use inside spec.cidr and spec.ranges and off spec.gateway, or delete that pod first",
                valid.name,
                record.namespace().unwrap_or_default(),
                record.name_any()
            ),
        ));
    }
    Ok(())
}

/// `namespace/name` of every FlatNetworkIP of subnet `name`.
fn users_of(ips: &[FlatNetworkIP], name: &str) -> Vec<String> {
    ips.iter()
        .filter(|ip| ip.spec.subnet == name)
        .map(|ip| format!("{}/{}", ip.namespace().unwrap_or_default(), ip.name_any()))
        .collect()
}

fn list(items: &[String]) -> String {
    let shown = items
        .iter()
        .take(LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    match items.len().saturating_sub(LISTED) {
        0 => shown,
        more => format!("{shown} and {more} more"),
    }
}

/// The admission warnings of an allowed create or update: the addresses
/// the new pool (on update: only those the old one did not have) covers
/// that a host outside flatnet claimed on the LAN within the default wire
/// window, as any node reported them. Allocation skips them; the warning
/// tells whoever wrote the range before a pod waits for an address. Only
/// addresses inside an existing subnet's CIDR are reported by the nodes,
/// so a subnet on a CIDR no other subnet covers gets no warning. A failed
/// lookup gives no warning: the review itself has passed.
pub async fn wire_warnings(
    lookup: &Lookup,
    request: &AdmissionRequest<DynamicObject>,
) -> Vec<String> {
    let Some(subnet) = request.object.as_ref().and_then(|o| parse(o).ok()) else {
        return Vec::new();
    };
    let Ok(valid) = validate_subnet(&subnet.name_any(), &subnet.spec) else {
        return Vec::new();
    };
    let old_pool = request
        .old_object
        .as_ref()
        .and_then(|o| parse(o).ok())
        .and_then(|old| validate_subnet(&old.name_any(), &old.spec).ok())
        .map(|old| Pool::new(&old));
    let Ok(reports) = lookup.wire_claims().await else {
        return Vec::new();
    };
    let live = LiveAddresses::from_reports(&reports, Timestamp::now(), DEFAULT_WIRE_WINDOW);
    let pool = Pool::new(&valid);
    let covered: Vec<String> = live
        .addresses()
        .filter(|&ip| pool.is_free(ip) && !old_pool.as_ref().is_some_and(|old| old.is_free(ip)))
        .filter_map(|ip| {
            let claim = live.get(ip)?;
            Some(format!(
                "{ip} (MAC {}, seen {})",
                claim.mac, claim.last_seen
            ))
        })
        .collect();
    if covered.is_empty() {
        return Vec::new();
    }
    let shown = covered
        .iter()
        .take(LISTED)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    let more = covered.len().saturating_sub(LISTED);
    let more = if more > 0 {
        format!(" and {more} more")
    } else {
        String::new()
    };
    vec![format!(
        "FlatNetworkSubnet {}: {} address(es) of the pool are in use on the LAN by hosts outside flatnet: {shown}{more}; they are not allocated while they stay live",
        valid.name,
        covered.len()
    )]
}
