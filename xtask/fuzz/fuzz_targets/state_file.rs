//! The standalone agent's state file (YAML): subnets, network mappings and
//! the policy sections. Properties: a valid file, written back as YAML,
//! parses to the same file and is still valid; the policy sections are
//! checked without panicking whatever the rest says.
#![no_main]

use std::path::Path;

use flatnet_agent::{desired::standalone::StateFile, policy_controller::standalone::PolicySection};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let path = Path::new("state.yaml");
    let Ok(file) = StateFile::parse(path, text) else {
        return;
    };
    let _ = PolicySection::from_state(&file);
    if file.validate().is_err() {
        return;
    }
    let written = serde_yaml::to_string(&file).expect("a state file serialises");
    let again = StateFile::parse(path, &written).expect("a written state file parses");
    assert_eq!(again, file, "written back as:\n{written}");
    assert!(again.validate().is_ok(), "written back as:\n{written}");
});
