//! Pure V1 → V2 conversions: subnets, annotations, labels and services.
//!
//! Nothing here talks to the API server. Every V1 value that has no exact V2
//! counterpart produces an [`Issue`]: it is either carried in another form
//! (the issue says which) or not carried at all, never dropped silently.

use std::{collections::BTreeMap, fmt, net::IpAddr};

use flatnet_k8s::{
    api::{
        FlatNetworkSubnet, FlatNetworkSubnetSpec, IpRange, Route, RouteSettings,
        V1_RESERVATION_KIND,
    },
    keys::{self, annotation},
    multus,
};
use k8s_openapi::{
    api::core::v1::{Service, ServicePort, ServiceSpec},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde_json::Value;

use super::v1::{MacvlanIP, MacvlanRoute, MacvlanSubnet};

/// Prefixes of V1 annotation and label keys.
pub const V1_PREFIXES: [&str; 2] = ["macvlan.pandaria.cattle.io/", "macvlan.panda.io/"];
/// The V1 NetworkAttachmentDefinition.
pub const V1_ATTACHMENT: &str = "static-macvlan-cni-attach";
/// Suffix of the services V1 created for each macvlan service.
pub const V1_SERVICE_SUFFIX: &str = "-macvlan";
/// Interface V1 routes without `iface` were added on (the macvlan
/// interface of a multi-NIC pod).
pub const V1_DEFAULT_ROUTE_DEV: &str = "eth1";
/// Annotation kubectl keeps of the last applied V1 manifest; copying it
/// would make `kubectl apply` diff the V2 object against a V1 one.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// V1 annotation key → V2 key; `None`: the key has no V2 meaning.
const ANNOTATION_KEYS: [(&str, Option<&str>); 7] = [
    ("macvlan.pandaria.cattle.io/ip", Some(annotation::IP)),
    (
        "macvlan.pandaria.cattle.io/subnet",
        Some(annotation::SUBNET),
    ),
    ("macvlan.pandaria.cattle.io/mac", Some(annotation::MAC)),
    ("macvlan.panda.io/ingress", Some(annotation::INGRESS)),
    (
        "macvlan.panda.io/macvlanService",
        Some(annotation::FLAT_NETWORK_SERVICE),
    ),
    ("macvlan.panda.io/ipv6to4", Some(annotation::IPV6_TO_4)),
    // Bookkeeping of V1's delayed address reuse, which flatnet replaces.
    ("macvlan.panda.io/ipDelayReuseTimestamp", None),
];

/// A V1 value that has no exact V2 counterpart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issue {
    /// The object, e.g. `MacvlanSubnet kube-system/vlan10`.
    pub object: String,
    /// The field or key.
    pub field: String,
    /// The V1 value.
    pub value: String,
    /// What happens to it, and what to do.
    pub outcome: String,
}

impl fmt::Display for Issue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} = {:?}: {}",
            self.object, self.field, self.value, self.outcome
        )
    }
}

/// Whether a key carries a V1 prefix.
pub fn is_v1_key(key: &str) -> bool {
    V1_PREFIXES.iter().any(|p| key.starts_with(p))
}

/// Converts a V1 subnet into the V2 subnet of the same name in
/// `cattle-flat-network`, with an [`Issue`] for every inexact value.
pub fn subnet(v1: &MacvlanSubnet) -> (FlatNetworkSubnet, Vec<Issue>) {
    let name = v1.metadata.name.clone().unwrap_or_default();
    let object = format!(
        "MacvlanSubnet {}/{name}",
        v1.metadata.namespace.as_deref().unwrap_or_default()
    );
    let mut issues = Vec::new();
    let mut issue = |field: &str, value: &str, outcome: &str| {
        issues.push(Issue {
            object: object.clone(),
            field: field.into(),
            value: value.into(),
            outcome: outcome.into(),
        });
    };
    let spec = &v1.spec;

    let gateway = match parse_ip(&spec.gateway) {
        Ok(ip) => ip,
        Err(()) => {
            issue(
                "spec.gateway",
                &spec.gateway,
                "not an address; the V2 subnet has no gateway: set spec.gateway by hand",
            );
            None
        }
    };

    let mut ranges = Vec::new();
    for (i, range) in spec.ranges.iter().enumerate() {
        match (parse_ip(&range.range_start), parse_ip(&range.range_end)) {
            (Ok(Some(from)), Ok(Some(to))) => ranges.push(IpRange::new(from, to)),
            _ => issue(
                &format!("spec.ranges[{i}]"),
                &format!("{}-{}", range.range_start, range.range_end),
                "not two addresses; range not carried: add it to spec.ranges by hand",
            ),
        }
    }

    let mut routes = Vec::new();
    for (i, route) in spec.routes.iter().enumerate() {
        if let Some(route) = self::route(route, &format!("spec.routes[{i}]"), &mut issue) {
            routes.push(route);
        }
    }

    let gw = &spec.pod_default_gateway;
    let mut route_settings = RouteSettings {
        flat_network_default_gateway: gw.enable,
        ..RouteSettings::default()
    };
    if !gw.service_cidr.is_empty() {
        route_settings.add_service_cidr = true;
        issue(
            "spec.podDefaultGateway.serviceCidr",
            &gw.service_cidr,
            "carried as routeSettings.addServiceCIDR: true; the CIDR itself now comes from the cluster-wide FLAT_NETWORK_SERVICE_CIDR (chart value serviceCIDR)",
        );
    }
    if spec.ip_delay_reuse != 0 {
        issue(
            "spec.ipDelayReuse",
            &spec.ip_delay_reuse.to_string(),
            "not carried: flatnet frees an address with its pod (StatefulSet pods keep theirs, see docs/ipam.md)",
        );
    }

    let metadata = ObjectMeta {
        name: Some(name.clone()),
        namespace: Some(keys::SUBNET_NAMESPACE.into()),
        labels: v1.metadata.labels.clone().filter(|l| !l.is_empty()),
        annotations: v1
            .metadata
            .annotations
            .clone()
            .map(|mut a| {
                a.remove(LAST_APPLIED);
                a
            })
            .filter(|a| !a.is_empty()),
        ..ObjectMeta::default()
    };
    let v2 = FlatNetworkSubnet {
        metadata,
        spec: FlatNetworkSubnetSpec {
            flat_mode: "macvlan".into(),
            master: spec.master.clone(),
            vlan: spec.vlan,
            cidr: spec.cidr.clone(),
            mode: spec.mode.clone(),
            ipvlan_flag: String::new(),
            gateway,
            ranges,
            routes,
            route_settings,
            // V1 had one cluster-wide MTU, kept in the network configuration.
            mtu: None,
            // V1 had no runtime configuration: every namespace, as before.
            namespace_selector: None,
        },
        status: None,
    };
    (v2, issues)
}

fn route(
    v1: &MacvlanRoute,
    field: &str,
    issue: &mut impl FnMut(&str, &str, &str),
) -> Option<Route> {
    // V1 stored a destination address; V2 wants a network.
    let dst = match parse_ip(&v1.dst) {
        Ok(Some(ip)) => format!("{ip}/{}", if ip.is_ipv4() { 32 } else { 128 }),
        _ if is_cidr(&v1.dst) => v1.dst.trim().to_owned(),
        _ => {
            issue(
                &format!("{field}.dst"),
                &v1.dst,
                "not an address or network; route not carried: add it to spec.routes by hand",
            );
            return None;
        }
    };
    let via = match parse_ip(&v1.gw) {
        Ok(via) => via,
        Err(()) => {
            issue(
                &format!("{field}.gw"),
                &v1.gw,
                "not an address; route not carried: add it to spec.routes by hand",
            );
            return None;
        }
    };
    let dev = if v1.iface.is_empty() {
        issue(
            &format!("{field}.iface"),
            "",
            "V2 routes name their interface; set to eth1, the flat interface of a multi-NIC pod (change it for single-NIC pods)",
        );
        V1_DEFAULT_ROUTE_DEV.to_owned()
    } else {
        v1.iface.clone()
    };
    Some(Route {
        dev,
        dst,
        src: None,
        via,
        priority: 0,
    })
}

/// `Ok(None)` for an empty value, `Err` for text that is not an address.
fn parse_ip(text: &str) -> Result<Option<IpAddr>, ()> {
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    text.parse().map(Some).map_err(|_| ())
}

fn is_cidr(text: &str) -> bool {
    text.trim()
        .split_once('/')
        .is_some_and(|(ip, len)| ip.parse::<IpAddr>().is_ok() && len.parse::<u8>().is_ok())
}

/// The result of rewriting one annotation map.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Rewrite {
    /// Keys to set, with their new values.
    pub set: BTreeMap<String, String>,
    /// Keys to remove.
    pub remove: Vec<String>,
    /// Values not carried.
    pub issues: Vec<Issue>,
}

impl Rewrite {
    /// Whether nothing changes.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty() && self.remove.is_empty()
    }

    /// The annotations after the rewrite.
    pub fn apply(&self, annotations: &BTreeMap<String, String>) -> BTreeMap<String, String> {
        let mut out = annotations.clone();
        for key in &self.remove {
            out.remove(key);
        }
        out.extend(self.set.clone());
        out
    }

    /// A JSON merge patch of the annotation map: new values, `null` for removals.
    pub fn merge_patch(&self) -> Value {
        let mut patch = serde_json::Map::new();
        for key in &self.remove {
            patch.insert(key.clone(), Value::Null);
        }
        for (key, value) in &self.set {
            patch.insert(key.clone(), Value::String(value.clone()));
        }
        Value::Object(patch)
    }
}

/// Rewrites V1 annotations into V2 ones: V1 keys are renamed (or dropped
/// when they have no V2 meaning) and Multus references to the V1 attachment
/// point at `attachment`. `object` names the owner for issues.
pub fn annotations(
    object: &str,
    annotations: &BTreeMap<String, String>,
    attachment: &str,
) -> Rewrite {
    let mut rewrite = Rewrite::default();
    for (key, value) in annotations {
        if is_v1_key(key) {
            rewrite.remove.push(key.clone());
            match ANNOTATION_KEYS.iter().find(|(v1, _)| v1 == key) {
                Some((_, Some(v2))) => {
                    if annotations
                        .get(*v2)
                        .is_some_and(|existing| existing != value)
                    {
                        rewrite.issues.push(Issue {
                            object: object.into(),
                            field: key.clone(),
                            value: value.clone(),
                            outcome: format!("not carried: {v2} is already set to a different value, which is kept"),
                        });
                    } else {
                        rewrite.set.insert((*v2).to_owned(), value.clone());
                    }
                }
                Some((_, None)) => {}
                None => rewrite.issues.push(Issue {
                    object: object.into(),
                    field: key.clone(),
                    value: value.clone(),
                    outcome: "unknown V1 key; not carried".into(),
                }),
            }
        } else if (key == annotation::MULTUS_NETWORKS || key == annotation::MULTUS_DEFAULT_NETWORK)
            && let Some(new) = multus_networks(value, attachment)
        {
            rewrite.set.insert(key.clone(), new);
        }
    }
    rewrite
}

/// Points the references to the V1 attachment in a Multus network selection
/// at `attachment`. `None` when the selection does not reference it.
pub fn multus_networks(value: &str, attachment: &str) -> Option<String> {
    multus::rename_attachment(value, V1_ATTACHMENT, attachment)
}

/// Labels with a V1 prefix, which the V1 operator wrote and flatnet replaces.
pub fn v1_labels(labels: &BTreeMap<String, String>) -> Vec<String> {
    labels.keys().filter(|k| is_v1_key(k)).cloned().collect()
}

/// Whether a Service is one V1 created for a macvlan workload:
/// `<name>-macvlan`, attached to the V1 network.
pub fn is_v1_service(svc: &Service) -> bool {
    let name_matches = svc
        .metadata
        .name
        .as_deref()
        .is_some_and(|n| n.ends_with(V1_SERVICE_SUFFIX));
    let attached = svc
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(annotation::MULTUS_NETWORKS))
        .is_some_and(|v| multus_networks(v, "").is_some() || v.trim() == V1_ATTACHMENT);
    name_matches && attached
}

/// The V2 flat-network Service for a V1 macvlan Service: `<base>-flat-network`,
/// headless, same selector, ports and owners, attached to `attachment`.
pub fn flat_service(v1: &Service, attachment: &str) -> Service {
    let name = v1.metadata.name.as_deref().unwrap_or_default();
    let base = name.strip_suffix(V1_SERVICE_SUFFIX).unwrap_or(name);
    let spec = v1.spec.clone().unwrap_or_default();
    let ports = spec.ports.map(|ports| {
        ports
            .into_iter()
            .map(|port| ServicePort {
                // A headless Service has no node ports.
                node_port: None,
                ..port
            })
            .collect()
    });
    Service {
        metadata: ObjectMeta {
            name: Some(format!("{base}{}", keys::FLAT_NETWORK_SERVICE_SUFFIX)),
            namespace: v1.metadata.namespace.clone(),
            owner_references: v1.metadata.owner_references.clone(),
            annotations: Some(BTreeMap::from([(
                annotation::MULTUS_NETWORKS.to_owned(),
                attachment.to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            type_: Some("ClusterIP".into()),
            selector: spec.selector,
            ports,
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// Reservations of the V2 subnets for the addresses V1 pods hold: per
/// subnet name (the V2 subnet has the V1 subnet's name), the key
/// `MacvlanIP/<namespace>/<name>` and the one address of that record.
/// Records without an address (not allocated yet) hold nothing; one whose
/// address does not parse is reported.
pub fn v1_reservations(
    ips: &[MacvlanIP],
    issues: &mut Vec<Issue>,
) -> BTreeMap<String, BTreeMap<String, Vec<IpRange>>> {
    let mut by_subnet: BTreeMap<String, BTreeMap<String, Vec<IpRange>>> = BTreeMap::new();
    for ip in ips {
        let namespace = ip.metadata.namespace.as_deref().unwrap_or_default();
        let name = ip.metadata.name.as_deref().unwrap_or_default();
        let text = ip.status.as_ref().map_or("", |s| s.ip.as_str()).trim();
        if text.is_empty() {
            continue;
        }
        // V1 wrote the address with or without its prefix length.
        let address = text.split('/').next().unwrap_or_default();
        match address.parse::<IpAddr>() {
            Ok(addr) => {
                by_subnet.entry(ip.spec.subnet.clone()).or_default().insert(
                    format!("{V1_RESERVATION_KIND}/{namespace}/{name}"),
                    vec![IpRange::new(addr, addr)],
                );
            }
            Err(_) => issues.push(Issue {
                object: format!("MacvlanIP {namespace}/{name}"),
                field: "status.ip".into(),
                value: text.into(),
                outcome: "not an address: not reserved in the V2 subnet, so a rolled pod may be given it; check the V1 pod".into(),
            }),
        }
    }
    by_subnet
}
