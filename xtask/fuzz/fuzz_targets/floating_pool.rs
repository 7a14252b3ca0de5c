//! A FloatingIPPool spec as JSON, through `validate_pool` (the check the
//! webhook and the floating-address controllers share). Properties: a
//! refusal says what is wrong; an admitted spec re-serialised validates to
//! the same pool; the pool has one network per family, IPv4 first, each
//! one of `spec.cidrs`, its allocation pools inside it, and the first
//! address handed out lies in its network; its node and namespace selectors
//! can be evaluated.
#![no_main]

use flatnet_fuzz::selector_evaluates;
use flatnet_k8s::{
    api::FloatingIPPoolSpec,
    floating::validate_pool,
    ipam::{Cidr, Family},
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(spec) = serde_json::from_slice::<FloatingIPPoolSpec>(data) else {
        return;
    };
    let valid = match validate_pool("fuzz", &spec) {
        Ok(valid) => valid,
        Err(invalid) => {
            assert!(!invalid.errors.is_empty(), "a refusal without a problem");
            for error in &invalid.errors {
                assert!(
                    error.to_string().len() > 10,
                    "a problem that says nothing: {error:?}"
                );
            }
            assert!(
                invalid
                    .to_string()
                    .starts_with("FloatingIPPool fuzz is invalid: ")
            );
            return;
        }
    };
    let text = serde_json::to_vec(&spec).expect("a spec serialises");
    let again: FloatingIPPoolSpec = serde_json::from_slice(&text).expect("a spec decodes");
    assert_eq!(validate_pool("fuzz", &again).as_ref(), Ok(&valid));

    assert!(
        matches!(valid.networks.len(), 1 | 2),
        "{} networks",
        valid.networks.len()
    );
    assert_eq!(
        valid.networks[0].cidr.family() == Family::V4,
        valid.network(Family::V4).is_some()
    );
    if valid.networks.len() == 2 {
        assert_ne!(
            valid.networks[0].cidr.family(),
            valid.networks[1].cidr.family()
        );
    }
    assert!(valid.parent.vlan <= 4094);
    assert!(valid.overlaps(&valid));
    for network in &valid.networks {
        assert!(
            spec.cidrs
                .iter()
                .filter_map(|c| Cidr::parse(c.trim()).ok())
                .any(|c| c == network.cidr),
            "network {} is none of spec.cidrs",
            network.cidr
        );
        for (first, last) in network.pool_intervals() {
            assert!(first <= last && network.cidr.first() <= first && last <= network.cidr.last());
        }
        let mut pool = valid
            .pool(network.cidr.family())
            .expect("the family's pool");
        if let Ok(addr) = pool.allocate_auto() {
            assert_eq!(valid.network_of(addr).map(|n| n.cidr), Some(network.cidr));
        }
    }
    for (field, selector) in [
        ("nodeSelector", &spec.node_selector),
        ("namespaceSelector", &spec.namespace_selector),
    ] {
        if let Some(Err(error)) = selector.as_ref().map(selector_evaluates) {
            panic!("an admitted spec.{field} cannot be evaluated: {error}");
        }
    }
});
