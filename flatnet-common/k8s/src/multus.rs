//! The Multus annotations flatnet reads: the network selection
//! (`k8s.v1.cni.cncf.io/networks`), which the migrator rewrites, and the
//! network status (`k8s.v1.cni.cncf.io/network-status`), which the Service
//! controller reads a pod's flat addresses from and the PodNetworkConfig
//! controller adds hot-plugged interfaces to. Both are written by tenants
//! or other components, so every reading is total: bad text gives `None`
//! or a reason, never a panic.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use serde::Deserialize;
use serde_json::Value;

use crate::{
    annotations::AnnotationError,
    ipam::Mac,
    keys::{PREFIX, annotation, label},
};

/// True when a selection entry's `[namespace/]name` names `attachment`.
fn names(entry: &str, attachment: &str) -> bool {
    entry.rsplit('/').next() == Some(attachment)
}

/// Points the references to the attachment `from` in a Multus network
/// selection at `to`, in either the JSON list form or the
/// `[namespace/]name[@interface]` list form. `None` when `from` is not
/// referenced.
///
/// A JSON entry loses its `namespace`: `to` is looked up in the pod's own
/// namespace.
#[must_use]
pub fn rename_attachment(selection: &str, from: &str, to: &str) -> Option<String> {
    // Multus reads a value with any of `[{"` as JSON and nothing else; one
    // that does not parse is broken for Multus and stays as it is (read as
    // a list, a rewrite could turn it into valid JSON of another meaning).
    if selection.contains(['[', '{', '"']) {
        let Ok(Value::Array(mut entries)) = serde_json::from_str::<Value>(selection) else {
            return None;
        };
        let mut changed = false;
        for entry in &mut entries {
            if let Some(obj) = entry.as_object_mut()
                && obj
                    .get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|name| names(name, from))
            {
                obj.insert("name".into(), Value::String(to.into()));
                obj.remove("namespace");
                changed = true;
            }
        }
        return changed.then(|| Value::Array(entries).to_string());
    }
    let mut changed = false;
    let entries: Vec<String> = selection
        .split(',')
        .map(|entry| {
            let entry = entry.trim();
            let (name, iface) = match entry.split_once('@') {
                Some((name, iface)) => (name, Some(iface)),
                None => (entry, None),
            };
            if names(name, from) {
                changed = true;
                match iface {
                    Some(iface) => format!("{to}@{iface}"),
                    None => to.to_owned(),
                }
            } else {
                entry.to_owned()
            }
        })
        .collect();
    changed.then(|| entries.join(","))
}

/// The MAC a Multus network selection (`k8s.v1.cni.cncf.io/networks`, JSON
/// list form) asks for on `attachment`: the element's `mac`, which Multus
/// passes to the CNI as `runtimeConfig.mac`. `Ok(None)` when the selection
/// is the short list form, does not name the attachment, or gives no MAC.
///
/// # Errors
/// The `mac` of the attachment's element is no usable MAC; the text names
/// it and the fix.
pub fn requested_mac(selection: &str, attachment: &str) -> Result<Option<Mac>, AnnotationError> {
    if !selection.contains(['[', '{', '"']) {
        return Ok(None);
    }
    let Ok(Value::Array(entries)) = serde_json::from_str::<Value>(selection) else {
        return Ok(None);
    };
    let Some(text) = entries
        .iter()
        .filter(|e| {
            e.get("name")
                .and_then(Value::as_str)
                .is_some_and(|n| names(n, attachment))
        })
        .find_map(|e| e.get("mac").and_then(Value::as_str))
    else {
        return Ok(None);
    };
    Mac::parse(text)
        .map(Some)
        .map_err(|source| AnnotationError::MultusMac {
            attachment: attachment.to_owned(),
            source,
        })
}

/// One entry of the Multus `network-status` annotation (only the fields used).
#[derive(Debug, Deserialize)]
struct NetworkStatusEntry {
    name: String,
    #[serde(default)]
    ips: Vec<String>,
}

/// The flat addresses of a pod, or why there are none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FlatAddresses {
    /// Addresses of the flat attachment (several when a 6to4 address is added).
    Found(Vec<IpAddr>),
    /// Nothing yet: the CNI has not reported the attachment. The pod's own
    /// update will trigger its readers again, so there is nothing to retry.
    NotYet,
    /// The annotation cannot be read; the text says what is wrong.
    Invalid(String),
}

/// Reads the pod's flat addresses.
///
/// Source, in order:
/// 1. the `k8s.v1.cni.cncf.io/network-status` entry whose name is the
///    attachment (`<namespace>/<attachment>` or a bare `<attachment>`, in any
///    namespace, since the NetworkAttachmentDefinition may live elsewhere);
/// 2. when Multus wrote no status at all, the `flatnetwork.pandaria.io/selectedIP`
///    label the IPAM side puts on the pod once the address is active.
///
/// A status that exists but lacks the attachment means the flat interface is
/// not there, so the label is not used then.
#[must_use]
pub fn flat_addresses(pod: &Pod, attachment: &str) -> FlatAddresses {
    let Some(status) = pod.annotations().get(annotation::MULTUS_NETWORK_STATUS) else {
        return pod
            .labels()
            .get(label::SELECTED_IP)
            .and_then(|label| decode_selected_ip(label))
            .map_or(FlatAddresses::NotYet, |ip| FlatAddresses::Found(vec![ip]));
    };
    let entries: Vec<NetworkStatusEntry> = match serde_json::from_str(status) {
        Ok(entries) => entries,
        Err(e) => {
            return FlatAddresses::Invalid(format!(
                "{} is not valid JSON: {e}",
                annotation::MULTUS_NETWORK_STATUS
            ));
        }
    };
    let Some(entry) = entries.iter().find(|e| names(&e.name, attachment)) else {
        return FlatAddresses::NotYet;
    };
    let mut addrs = Vec::with_capacity(entry.ips.len());
    for ip in &entry.ips {
        match ip.parse::<IpAddr>() {
            Ok(addr) => addrs.push(addr),
            Err(_) => {
                return FlatAddresses::Invalid(format!(
                    "{} entry {:?} has the address {ip:?}",
                    annotation::MULTUS_NETWORK_STATUS,
                    entry.name
                ));
            }
        }
    }
    if addrs.is_empty() {
        FlatAddresses::NotYet
    } else {
        FlatAddresses::Found(addrs)
    }
}

/// An interface hot-plugged into a running pod, as the pod's
/// `network-status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HotplugStatus {
    /// The PodNetworkConfig asking for it.
    pub config: String,
    /// The interface name in the pod.
    pub interface: String,
    /// Its addresses.
    pub ips: Vec<IpAddr>,
    /// Its MAC, when known.
    pub mac: String,
}

impl HotplugStatus {
    /// The entry's `name`: `flatnetwork.pandaria.io/<config>.<interface>`.
    /// The prefix tells flatnet's entries from Multus's; the interface
    /// suffix keeps the last segment from ever naming a network
    /// attachment, which is how readers match entries.
    #[must_use]
    pub fn name(&self) -> String {
        format!("{PREFIX}{}.{}", self.config, self.interface)
    }

    fn entry(&self) -> Value {
        serde_json::json!({
            "name": self.name(),
            "interface": self.interface,
            "ips": self.ips.iter().map(ToString::to_string).collect::<Vec<_>>(),
            "mac": self.mac,
            "dns": {},
        })
    }
}

/// The `network-status` annotation `current` with flatnet's entries of
/// hot-plugged interfaces replaced by `hotplugged` (every other entry kept
/// as it is, in order; flatnet's after them, in the given order). `Ok(None)`
/// when that changes nothing; an error when `current` is not a JSON list
/// (then it is left alone).
///
/// # Errors
/// `current` is not a JSON list.
pub fn with_hotplug_entries(
    current: &str,
    hotplugged: &[HotplugStatus],
) -> Result<Option<String>, String> {
    let Ok(Value::Array(entries)) = serde_json::from_str::<Value>(current) else {
        return Err(format!(
            "{} is not a JSON list; flatnet adds no hot-plugged interfaces to it",
            annotation::MULTUS_NETWORK_STATUS
        ));
    };
    let ours = |entry: &Value| {
        entry
            .get("name")
            .and_then(Value::as_str)
            .is_some_and(|name| name.starts_with(PREFIX))
    };
    let mut updated: Vec<Value> = entries.iter().filter(|e| !ours(e)).cloned().collect();
    updated.extend(hotplugged.iter().map(HotplugStatus::entry));
    Ok((updated != entries).then(|| Value::Array(updated).to_string()))
}

/// Decodes the `selectedIP` label: IPv4 as is, IPv6 with `.` in place of `:`.
#[must_use]
pub fn decode_selected_ip(label: &str) -> Option<IpAddr> {
    label
        .parse()
        .ok()
        .or_else(|| label.replace('.', ":").parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_multus_mac_of_the_flat_attachment_is_read() {
        let selection = r#"[{"name":"other","mac":"02:00:00:00:00:09"},
            {"name":"rancher-flat-network","namespace":"shop","mac":"02:00:00:00:00:05"}]"#;
        let flat = "rancher-flat-network";
        assert_eq!(
            requested_mac(selection, flat),
            Ok(Some(Mac([2, 0, 0, 0, 0, 5])))
        );
        assert_eq!(requested_mac("rancher-flat-network@eth1", flat), Ok(None));
        assert_eq!(
            requested_mac(r#"[{"name":"rancher-flat-network"}]"#, flat),
            Ok(None)
        );
        let bad = requested_mac(
            r#"[{"name":"rancher-flat-network","mac":"01:00:00:00:00:01"}]"#,
            flat,
        );
        assert!(bad.unwrap_err().to_string().contains("multicast"));
    }

    fn pod_with_status(status: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web-0", "annotations": {annotation::MULTUS_NETWORK_STATUS: status}}
        }))
        .unwrap()
    }

    #[test]
    fn hotplugged_entries_replace_flatnets_own_and_never_shadow_the_flat_attachment() {
        let multus = r#"[{"name":"k8s-pod-network","interface":"eth0","ips":["10.42.0.5"]},{"name":"default/rancher-flat-network","interface":"eth1","ips":["192.0.2.10"]}]"#;
        let net2 = HotplugStatus {
            config: "rancher-flat-network".into(),
            interface: "net2".into(),
            ips: vec!["192.0.2.11".parse().unwrap()],
            mac: "02:00:00:00:00:02".into(),
        };
        let added = with_hotplug_entries(multus, std::slice::from_ref(&net2))
            .unwrap()
            .unwrap();
        let entries: Vec<Value> = serde_json::from_str(&added).unwrap();
        assert_eq!(entries.len(), 3);
        assert_eq!(
            entries[2]["name"],
            "flatnetwork.pandaria.io/rancher-flat-network.net2"
        );
        assert_eq!(entries[2]["interface"], "net2");
        assert_eq!(entries[2]["ips"][0], "192.0.2.11");
        // The flat attachment's reader still finds eth1's address, even
        // with a configuration named like the attachment.
        assert_eq!(
            flat_addresses(&pod_with_status(&added), "rancher-flat-network"),
            FlatAddresses::Found(vec!["192.0.2.10".parse().unwrap()])
        );
        // Same again: nothing to write.
        assert_eq!(with_hotplug_entries(&added, &[net2]).unwrap(), None);
        // None left: back to what Multus wrote.
        let removed = with_hotplug_entries(&added, &[]).unwrap().unwrap();
        assert_eq!(
            serde_json::from_str::<Value>(&removed).unwrap(),
            serde_json::from_str::<Value>(multus).unwrap()
        );
        assert!(
            with_hotplug_entries("{", &[])
                .unwrap_err()
                .contains("not a JSON list")
        );
    }
}
