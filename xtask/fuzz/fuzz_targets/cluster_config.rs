//! A FlatNetworkConfig spec as JSON, through the checks the webhook makes
//! (`FlatNetworkConfigSpec::problems` and `warnings`). Properties: every
//! problem names its field (`spec.`…); an admitted spec re-serialised
//! decodes to the same spec, again without problems and with the same
//! warnings; its MAC range, recorded in the status as the operator records
//! it, reads back as the same range; its MTU fits the attachment's field.
#![no_main]

use flatnet_fuzz::assert_problems_name_fields;
use flatnet_k8s::api::{
    CONFIG_NAME, FlatNetworkConfig, FlatNetworkConfigSpec, FlatNetworkConfigStatus, MacPoolStatus,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(spec) = serde_json::from_slice::<FlatNetworkConfigSpec>(data) else {
        return;
    };
    let problems = spec.problems();
    assert_problems_name_fields(&problems);
    if !problems.is_empty() {
        return;
    }
    let warnings = spec.warnings();
    let text = serde_json::to_vec(&spec).expect("a spec serialises");
    let again: FlatNetworkConfigSpec = serde_json::from_slice(&text).expect("a spec decodes");
    assert_eq!(again, spec);
    assert_eq!(again.problems(), Vec::<String>::new());
    assert_eq!(again.warnings(), warnings);
    if let Some(mtu) = spec.default_mtu {
        assert!(u16::try_from(mtu).is_ok(), "admitted MTU {mtu} overflows");
    }
    let Ok(Some(range)) = spec.mac_pool.range() else {
        return;
    };
    assert!(!range.is_empty() && range.start() <= range.end());
    let recorded = MacPoolStatus {
        range_start: range.start().to_string(),
        range_end: range.end().to_string(),
        generated: false,
    };
    assert_eq!(recorded.range(), Some(range));
    let mut config = FlatNetworkConfig::new(CONFIG_NAME, spec);
    config.status = Some(FlatNetworkConfigStatus {
        mac_pool: Some(recorded),
        ..FlatNetworkConfigStatus::default()
    });
    assert_eq!(config.mac_range(), Some(range));
});
