//! A FlatNetworkSubnet spec as JSON, through `validate_subnet` (the check
//! the webhook, the operator and the standalone agent share). Properties:
//! a valid spec, re-serialised, validates to the same subnet; its pools lie
//! inside its CIDR, in order, and its gateway inside the CIDR.
#![no_main]

use flatnet_k8s::{api::FlatNetworkSubnetSpec, validation::validate_subnet};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(spec) = serde_json::from_slice::<FlatNetworkSubnetSpec>(data) else {
        return;
    };
    let Ok(valid) = validate_subnet("fuzz", &spec) else {
        return;
    };
    let text = serde_json::to_vec(&spec).expect("a spec serialises");
    let again: FlatNetworkSubnetSpec = serde_json::from_slice(&text).expect("a spec decodes");
    assert_eq!(validate_subnet("fuzz", &again).ok(), Some(valid.clone()));
    for (first, last) in valid.pool_intervals() {
        assert!(first <= last, "pool {first}..{last} is reversed");
        assert!(
            valid.cidr.first() <= first && last <= valid.cidr.last(),
            "pool {first}..{last} leaves {}",
            valid.cidr
        );
    }
    if let Some(gateway) = valid.gateway {
        assert!(
            valid.cidr.contains(gateway),
            "gateway {gateway} outside {}",
            valid.cidr
        );
    }
});
