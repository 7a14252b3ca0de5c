//! The Multus annotations flatnet reads: the network selection
//! (`k8s.v1.cni.cncf.io/networks`, JSON list or `[namespace/]name[@if]`
//! list) that the migrator rewrites, on the first line; the network status
//! (`k8s.v1.cni.cncf.io/network-status`) the Service controller reads the
//! pod's flat addresses from, after it. Properties: a rewritten selection
//! references the V1 attachment no more, keeps its form (a JSON list stays
//! a JSON list of as many entries); addresses read from a status are
//! never empty.
#![no_main]

use std::collections::BTreeMap;

use flatnet_k8s::{
    keys::annotation,
    multus::{FlatAddresses, flat_addresses, rename_attachment},
};
use k8s_openapi::api::core::v1::Pod;
use libfuzzer_sys::fuzz_target;

/// The attachment the migrator replaces (the original's).
const V1_ATTACHMENT: &str = "static-macvlan-cni-attach";
/// The attachment the migrator points selections at.
const ATTACHMENT: &str = "flatnet-attach";

fn json_entries(value: &str) -> Option<usize> {
    match serde_json::from_str::<serde_json::Value>(value).ok()? {
        serde_json::Value::Array(entries) => Some(entries.len()),
        _ => None,
    }
}

fuzz_target!(|data: &[u8]| {
    let Some([selection, status]) = flatnet_fuzz::lines::<2>(data) else {
        return;
    };
    if let Some(rewritten) = rename_attachment(selection, V1_ATTACHMENT, ATTACHMENT) {
        assert_eq!(
            rename_attachment(&rewritten, V1_ATTACHMENT, ATTACHMENT),
            None,
            "{rewritten:?} still references the V1 attachment"
        );
        assert_eq!(
            json_entries(&rewritten),
            json_entries(selection),
            "{rewritten:?}"
        );
    }
    let mut pod = Pod::default();
    pod.metadata.annotations = Some(BTreeMap::from([(
        annotation::MULTUS_NETWORK_STATUS.to_owned(),
        status.to_owned(),
    )]));
    if let FlatAddresses::Found(addresses) = flat_addresses(&pod, ATTACHMENT) {
        assert!(!addresses.is_empty(), "found no address");
    }
});
