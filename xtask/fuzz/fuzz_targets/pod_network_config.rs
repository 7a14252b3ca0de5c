//! A PodNetworkConfig spec as JSON, through the checks the webhook makes
//! without lookups (`PodNetworkConfigSpec::problems`). Properties: every
//! problem names its field (`spec.`…); an admitted spec re-serialised
//! decodes to the same spec, again without problems; what the controller
//! makes of an admitted spec works: its pod selector can be evaluated,
//! every attachment gets a FlatNetworkIP name of its own and its MAC
//! parses, every VLAN link name is one the kernel takes.
#![no_main]

use std::collections::BTreeSet;

use flatnet_fuzz::{assert_problems_name_fields, selector_evaluates};
use flatnet_k8s::{
    api::PodNetworkConfigSpec, ipam::Mac, keys::hotplug_record_name, validation::check_ifname,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(spec) = serde_json::from_slice::<PodNetworkConfigSpec>(data) else {
        return;
    };
    let problems = spec.problems();
    assert_problems_name_fields(&problems);
    if !problems.is_empty() {
        return;
    }
    let text = serde_json::to_vec(&spec).expect("a spec serialises");
    let again: PodNetworkConfigSpec = serde_json::from_slice(&text).expect("a spec decodes");
    assert_eq!(again, spec);
    assert_eq!(again.problems(), Vec::<String>::new());

    if let Err(error) = selector_evaluates(&spec.pod_selector) {
        panic!("an admitted podSelector cannot be evaluated: {error}");
    }
    let mut records = BTreeSet::new();
    for attachment in &spec.attachments {
        let name = hotplug_record_name("web-0", &attachment.interface)
            .unwrap_or_else(|e| panic!("admitted interface without a record name: {e}"));
        assert!(records.insert(name), "two attachments share a record");
        assert!(attachment.mac.is_empty() || Mac::parse(&attachment.mac).is_ok());
    }
    for vlan in &spec.vlans {
        assert!((1..=4094).contains(&vlan.id), "VLAN id {}", vlan.id);
        assert!(check_ifname(&format!("{}.{}", vlan.master, vlan.id)).is_ok());
    }
});
