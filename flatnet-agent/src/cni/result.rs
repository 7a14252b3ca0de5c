//! The CNI success result (`ADD` output and `prevResult`) and its encoding in
//! each supported specification version.
//!
//! One type holds the newest (1.1.0) shape. Older versions are produced on
//! output by adding `ips[].version` (before 1.0.0) and dropping the fields
//! 1.1.0 introduced, so a 0.3.1 runtime never sees a field it cannot know.
//! Decoding accepts every supported shape, which is what `prevResult` needs.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::config::Dns;
use super::version::CniVersion;

/// An address with its prefix length, as CNI writes it (`10.1.2.3/24`).
/// Host bits may be set: it is an interface address, not a network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpWithPrefix {
    /// The address.
    pub addr: IpAddr,
    /// The prefix length (at most 32 for IPv4, 128 for IPv6).
    pub prefix_len: u8,
}

/// The text is not `address/prefix` with a valid prefix length.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an address in CIDR notation such as 10.1.2.3/24 or fd00::5/64")]
pub struct InvalidCidr(pub String);

impl IpWithPrefix {
    /// The maximum prefix length of the address family.
    fn max_prefix_len(addr: IpAddr) -> u8 {
        if addr.is_ipv4() { 32 } else { 128 }
    }
}

impl FromStr for IpWithPrefix {
    type Err = InvalidCidr;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = || InvalidCidr(s.to_owned());
        let (addr, prefix) = s.split_once('/').ok_or_else(invalid)?;
        let addr: IpAddr = addr.parse().map_err(|_| invalid())?;
        // `u8::from_str` accepts a leading '+'; CIDR notation does not.
        if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_digit()) {
            return Err(invalid());
        }
        let prefix_len: u8 = prefix.parse().map_err(|_| invalid())?;
        if prefix_len > Self::max_prefix_len(addr) {
            return Err(invalid());
        }
        Ok(IpWithPrefix { addr, prefix_len })
    }
}

impl fmt::Display for IpWithPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

impl Serialize for IpWithPrefix {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for IpWithPrefix {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let raw = String::deserialize(deserializer)?;
        raw.parse().map_err(serde::de::Error::custom)
    }
}

/// An interface the plugin created.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Interface {
    /// Interface name (inside the sandbox for pod interfaces).
    pub name: String,
    /// Hardware address, `aa:bb:cc:dd:ee:ff`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    /// MTU (1.1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// Network namespace path for sandbox interfaces; absent for host interfaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<String>,
    /// Path of a vhost-user or similar socket (1.1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub socket_path: Option<String>,
    /// PCI address of the device (1.1.0).
    #[serde(default, rename = "pciID", skip_serializing_if = "Option::is_none")]
    pub pci_id: Option<String>,
}

/// An address assigned to an interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IpConfig {
    /// The address and prefix length.
    pub address: IpWithPrefix,
    /// The gateway of the address's subnet, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<IpAddr>,
    /// Index into [`CniResult::interfaces`] of the interface holding the address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<usize>,
}

/// A route the plugin installed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Route {
    /// Destination network.
    pub dst: IpWithPrefix,
    /// Next hop; absent means the plugin's default gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gw: Option<IpAddr>,
    /// Route MTU (1.1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtu: Option<u32>,
    /// Advertised MSS (1.1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub advmss: Option<u32>,
    /// Route priority / metric (1.1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u32>,
    /// Routing table (1.1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub table: Option<u32>,
    /// Route scope, as the kernel numbers it (1.1.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<u8>,
}

/// The result of a successful ADD.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CniResult {
    /// Interfaces created by the plugin.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub interfaces: Vec<Interface>,
    /// Addresses assigned, each pointing at its interface.
    #[serde(default)]
    pub ips: Vec<IpConfig>,
    /// Routes installed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routes: Vec<Route>,
    /// DNS settings for the pod.
    #[serde(default, skip_serializing_if = "Dns::is_empty")]
    pub dns: Dns,
}

/// Interface fields that only exist from 1.1.0 on.
const INTERFACE_FIELDS_1_1: [&str; 3] = ["mtu", "socketPath", "pciID"];
/// Route fields that only exist from 1.1.0 on.
const ROUTE_FIELDS_1_1: [&str; 5] = ["mtu", "advmss", "priority", "table", "scope"];

impl CniResult {
    /// The result JSON printed on stdout, written in `version`.
    pub fn to_json(&self, version: CniVersion) -> serde_json::Value {
        let mut value = match serde_json::to_value(self) {
            Ok(serde_json::Value::Object(map)) => map,
            // A struct of strings, numbers and addresses always serializes to an object.
            _ => unreachable!("CniResult serializes to a JSON object"),
        };
        if version.has_ip_version_field() {
            for (ip, json) in self.ips.iter().zip(array_items(&mut value, "ips")) {
                let family = if ip.address.addr.is_ipv4() { "4" } else { "6" };
                json.insert("version".into(), family.into());
            }
        }
        if !version.has_extended_result_fields() {
            for json in array_items(&mut value, "interfaces") {
                INTERFACE_FIELDS_1_1
                    .iter()
                    .for_each(|f| _ = json.remove(*f));
            }
            for json in array_items(&mut value, "routes") {
                ROUTE_FIELDS_1_1.iter().for_each(|f| _ = json.remove(*f));
            }
        }
        let mut out = serde_json::Map::new();
        out.insert("cniVersion".into(), version.as_str().into());
        out.extend(value);
        serde_json::Value::Object(out)
    }
}

/// The objects of the array `key` in `map` (none if absent).
fn array_items<'a>(
    map: &'a mut serde_json::Map<String, serde_json::Value>,
    key: &str,
) -> impl Iterator<Item = &'a mut serde_json::Map<String, serde_json::Value>> {
    map.get_mut(key)
        .and_then(serde_json::Value::as_array_mut)
        .into_iter()
        .flatten()
        .filter_map(serde_json::Value::as_object_mut)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    fn sample() -> CniResult {
        CniResult {
            interfaces: vec![Interface {
                name: "eth1".into(),
                mac: Some("0a:58:0a:01:02:03".into()),
                mtu: Some(1500),
                sandbox: Some("/var/run/netns/pod".into()),
                ..Interface::default()
            }],
            ips: vec![
                IpConfig {
                    address: "10.1.2.3/24".parse().unwrap(),
                    gateway: Some("10.1.2.1".parse().unwrap()),
                    interface: Some(0),
                },
                IpConfig {
                    address: "fd00::3/64".parse().unwrap(),
                    gateway: None,
                    interface: Some(0),
                },
            ],
            routes: vec![Route {
                dst: "0.0.0.0/0".parse().unwrap(),
                gw: Some("10.1.2.1".parse().unwrap()),
                mtu: None,
                advmss: None,
                priority: Some(100),
                table: None,
                scope: None,
            }],
            dns: Dns {
                nameservers: vec!["10.1.0.10".into()],
                ..Dns::default()
            },
        }
    }

    #[test]
    fn encodes_1_1_0_with_extended_fields_and_no_ip_version() {
        assert_eq!(
            sample().to_json(CniVersion::V1_1_0),
            json!({
                "cniVersion": "1.1.0",
                "interfaces": [{"name": "eth1", "mac": "0a:58:0a:01:02:03", "mtu": 1500,
                                "sandbox": "/var/run/netns/pod"}],
                "ips": [{"address": "10.1.2.3/24", "gateway": "10.1.2.1", "interface": 0},
                        {"address": "fd00::3/64", "interface": 0}],
                "routes": [{"dst": "0.0.0.0/0", "gw": "10.1.2.1", "priority": 100}],
                "dns": {"nameservers": ["10.1.0.10"]}
            })
        );
    }

    #[test]
    fn encodes_1_0_0_without_1_1_fields() {
        let out = sample().to_json(CniVersion::V1_0_0);
        assert_eq!(out["cniVersion"], "1.0.0");
        assert!(out["interfaces"][0].get("mtu").is_none());
        assert!(out["routes"][0].get("priority").is_none());
        assert!(out["ips"][0].get("version").is_none());
    }

    #[test]
    fn encodes_pre_1_0_with_ip_versions() {
        for version in [CniVersion::V0_3_0, CniVersion::V0_3_1, CniVersion::V0_4_0] {
            let out = sample().to_json(version);
            assert_eq!(out["cniVersion"], version.as_str());
            assert_eq!(out["ips"][0]["version"], "4");
            assert_eq!(out["ips"][1]["version"], "6");
            assert!(out["interfaces"][0].get("mtu").is_none());
        }
    }

    #[test]
    fn decodes_a_0_4_0_prev_result() {
        let decoded: CniResult = serde_json::from_value(json!({
            "cniVersion": "0.4.0",
            "interfaces": [{"name": "eth1", "sandbox": "/proc/1/ns/net"}],
            "ips": [{"version": "4", "address": "192.168.1.10/24", "interface": 0}]
        }))
        .unwrap();
        assert_eq!(decoded.ips[0].address.to_string(), "192.168.1.10/24");
        assert_eq!(decoded.ips[0].interface, Some(0));
    }

    #[test]
    fn cidr_parsing_rejects_malformed_text() {
        for bad in [
            "10.0.0.1",
            "10.0.0.1/33",
            "fd00::1/129",
            "10.0.0.1/+8",
            "x/8",
            "/8",
            "10.0.0.1/",
        ] {
            assert!(
                bad.parse::<IpWithPrefix>().is_err(),
                "{bad} must be rejected"
            );
        }
        assert_eq!(
            "fd00::1/128".parse::<IpWithPrefix>().unwrap().prefix_len,
            128
        );
    }

    fn arb_ip_config() -> impl Strategy<Value = IpConfig> {
        let v4 = (any::<[u8; 4]>(), 0u8..=32).prop_map(|(o, p)| (IpAddr::from(o), p));
        let v6 = (any::<[u8; 16]>(), 0u8..=128).prop_map(|(o, p)| (IpAddr::from(o), p));
        (prop_oneof![v4, v6], proptest::option::of(0usize..4)).prop_map(
            |((addr, prefix_len), interface)| IpConfig {
                address: IpWithPrefix { addr, prefix_len },
                gateway: None,
                interface,
            },
        )
    }

    proptest! {
        /// Whatever version a result is written in, reading it back as
        /// `prevResult` gives the same addresses.
        #[test]
        fn every_version_round_trips_addresses(ips in proptest::collection::vec(arb_ip_config(), 0..6)) {
            let result = CniResult { ips, ..CniResult::default() };
            for version in CniVersion::SUPPORTED {
                let decoded: CniResult = serde_json::from_value(result.to_json(version)).unwrap();
                prop_assert_eq!(&decoded.ips, &result.ips);
            }
        }
    }
}
