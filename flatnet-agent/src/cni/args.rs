//! `CNI_ARGS`: `KEY=VALUE` pairs separated by `;`, set by the runtime
//! (kubelet's CRI runtime adds the pod's namespace, name, UID and sandbox ID).
//!
//! A key may appear more than once: Multus 4 passes its own `IgnoreUnknown`
//! and `K8S_POD_*` pairs to its delegates and then appends the runtime's.
//! As libcni's `types.LoadArgs` (which every reference plugin uses) does,
//! the last occurrence of a key wins.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::{CniError, ErrorCode};

/// Keys flatnet understands; any other key is an error unless
/// `IgnoreUnknown` is true, as with the reference plugins.
const KNOWN_KEYS: [&str; 5] = [
    "IgnoreUnknown",
    "K8S_POD_NAMESPACE",
    "K8S_POD_NAME",
    "K8S_POD_UID",
    "K8S_POD_INFRA_CONTAINER_ID",
];

/// Parsed `CNI_ARGS`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CniArgs {
    /// `IgnoreUnknown`: unknown keys are tolerated (and kept in `other`).
    #[serde(default)]
    pub ignore_unknown: bool,
    /// `K8S_POD_NAMESPACE`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    /// `K8S_POD_NAME`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    /// `K8S_POD_UID`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// `K8S_POD_INFRA_CONTAINER_ID` (the sandbox container).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_infra_container_id: Option<String>,
    /// Every other pair, kept for the agent when `IgnoreUnknown` allows it.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub other: BTreeMap<String, String>,
}

impl CniArgs {
    /// Parses `CNI_ARGS`. Empty segments (`A=1;;B=2`, a trailing `;`) are
    /// skipped and a repeated key takes its last value; a segment without
    /// `=`, an empty key, a bad `IgnoreUnknown` value or an unknown key
    /// without `IgnoreUnknown` is error 4, because `CNI_ARGS` is an
    /// environment variable.
    pub fn parse(raw: &str) -> Result<CniArgs, CniError> {
        let mut pairs = BTreeMap::new();
        for segment in raw.split(';').filter(|s| !s.is_empty()) {
            let Some((key, value)) = segment.split_once('=') else {
                return Err(invalid(format!(
                    "pair {segment:?} has no '='; expected KEY=VALUE"
                )));
            };
            if key.is_empty() {
                return Err(invalid(format!("pair {segment:?} has an empty key")));
            }
            pairs.insert(key.to_owned(), value.to_owned());
        }

        let mut args = CniArgs::default();
        if let Some(value) = pairs.remove("IgnoreUnknown") {
            args.ignore_unknown = parse_bool(&value).ok_or_else(|| {
                invalid(format!(
                    "IgnoreUnknown={value:?} is not a boolean (use 1/true or 0/false)"
                ))
            })?;
        }
        args.pod_namespace = pairs.remove("K8S_POD_NAMESPACE");
        args.pod_name = pairs.remove("K8S_POD_NAME");
        args.pod_uid = pairs.remove("K8S_POD_UID");
        args.pod_infra_container_id = pairs.remove("K8S_POD_INFRA_CONTAINER_ID");
        debug_assert!(pairs.keys().all(|k| !KNOWN_KEYS.contains(&k.as_str())));

        if !args.ignore_unknown && !pairs.is_empty() {
            let unknown: Vec<&str> = pairs.keys().map(String::as_str).collect();
            return Err(invalid(format!(
                "unknown keys {unknown:?}; flatnet-cni understands {KNOWN_KEYS:?} (add IgnoreUnknown=1 to pass others)"
            )));
        }
        args.other = pairs;
        Ok(args)
    }
}

/// The boolean spellings Go's `strconv.ParseBool` accepts, which is what
/// runtimes written in Go produce.
fn parse_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "true" | "TRUE" | "True" => Some(true),
        "0" | "f" | "F" | "false" | "FALSE" | "False" => Some(false),
        _ => None,
    }
}

fn invalid(msg: String) -> CniError {
    CniError::new(ErrorCode::InvalidEnvironment, format!("CNI_ARGS: {msg}"))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn parses_the_kubelet_arguments() {
        let args = CniArgs::parse(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=1234-5",
        )
        .unwrap();
        assert!(args.ignore_unknown);
        assert_eq!(args.pod_namespace.as_deref(), Some("default"));
        assert_eq!(args.pod_name.as_deref(), Some("web-0"));
        assert_eq!(args.pod_uid.as_deref(), Some("1234-5"));
        assert_eq!(args.pod_infra_container_id.as_deref(), Some("abc"));
        assert!(args.other.is_empty());
    }

    /// What Multus 4.2 puts in `CNI_ARGS` when it calls a delegate: its own
    /// pairs, then the runtime's (taken from Multus's own test data).
    #[test]
    fn accepts_the_repeated_keys_multus_passes_to_its_delegates() {
        let args = CniArgs::parse(
            "IgnoreUnknown=true;K8S_POD_NAMESPACE=default;K8S_POD_NAME=macvlan;\
             K8S_POD_INFRA_CONTAINER_ID=3f6940ab5ab4;K8S_POD_UID=f0bfbd5b-096d;\
             IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=macvlan;\
             K8S_POD_INFRA_CONTAINER_ID=3f6940ab5ab4;K8S_POD_UID=f0bfbd5b-096d",
        )
        .unwrap();
        assert!(args.ignore_unknown);
        assert_eq!(args.pod_namespace.as_deref(), Some("default"));
        assert_eq!(args.pod_name.as_deref(), Some("macvlan"));
        assert_eq!(args.pod_infra_container_id.as_deref(), Some("3f6940ab5ab4"));
        assert_eq!(args.pod_uid.as_deref(), Some("f0bfbd5b-096d"));
        assert!(args.other.is_empty());
    }

    #[test]
    fn a_repeated_key_takes_its_last_value_as_in_libcni() {
        // Multus leaves the sandbox ID empty when it has none and the
        // runtime's pair after it fills it in.
        let args = CniArgs::parse(
            "IgnoreUnknown=true;K8S_POD_INFRA_CONTAINER_ID=;K8S_POD_INFRA_CONTAINER_ID=abc;X=1;X=2",
        )
        .unwrap();
        assert_eq!(args.pod_infra_container_id.as_deref(), Some("abc"));
        assert_eq!(args.other["X"], "2");
        // The final IgnoreUnknown decides, as in LoadArgs.
        assert!(CniArgs::parse("IgnoreUnknown=1;IgnoreUnknown=0;X=1").is_err());
        assert!(CniArgs::parse("IgnoreUnknown=0;IgnoreUnknown=1;X=1").is_ok());
    }

    #[test]
    fn empty_input_and_empty_segments_are_fine() {
        assert_eq!(CniArgs::parse("").unwrap(), CniArgs::default());
        let args = CniArgs::parse(";K8S_POD_NAME=a;;").unwrap();
        assert_eq!(args.pod_name.as_deref(), Some("a"));
    }

    #[test]
    fn values_may_contain_equals_signs() {
        let args = CniArgs::parse("IgnoreUnknown=true;LABEL=a=b").unwrap();
        assert_eq!(args.other["LABEL"], "a=b");
    }

    #[test]
    fn unknown_keys_need_ignore_unknown() {
        let error = CniArgs::parse("K8S_POD_NAME=a;MAC=aa:bb").unwrap_err();
        assert_eq!(error.code, ErrorCode::InvalidEnvironment);
        assert!(error.msg.contains("MAC"), "{}", error.msg);
        assert!(CniArgs::parse("IgnoreUnknown=0;FOO=1").is_err());
        assert_eq!(
            CniArgs::parse("IgnoreUnknown=T;FOO=1").unwrap().other["FOO"],
            "1"
        );
    }

    #[test]
    fn malformed_pairs_are_code_4() {
        for raw in ["NOEQUALS", "=value", "IgnoreUnknown=yes"] {
            assert_eq!(
                CniArgs::parse(raw).unwrap_err().code,
                ErrorCode::InvalidEnvironment,
                "{raw}"
            );
        }
    }

    proptest! {
        /// Any text either parses or is a code-4 error; it never panics.
        #[test]
        fn never_panics(raw in ".*") {
            if let Err(error) = CniArgs::parse(&raw) {
                prop_assert_eq!(error.code, ErrorCode::InvalidEnvironment);
            }
        }

        /// Well-formed pairs with IgnoreUnknown all come back.
        #[test]
        fn keeps_every_pair(pairs in proptest::collection::btree_map("[A-Z][A-Z0-9_]{0,8}", "[a-z0-9=.-]{0,8}", 0..6)) {
            let pairs: BTreeMap<String, String> = pairs
                .into_iter()
                .filter(|(k, _)| !KNOWN_KEYS.contains(&k.as_str()))
                .collect();
            let raw: Vec<String> = pairs.iter().map(|(k, v)| format!("{k}={v}")).collect();
            let args = CniArgs::parse(&format!("IgnoreUnknown=1;{}", raw.join(";"))).unwrap();
            prop_assert_eq!(args.other, pairs);
        }
    }
}
