//! Input formats shared by the fuzz targets: readable text seeds that
//! libFuzzer mutates well (`KEY=VALUE` lines, line-separated fields); and
//! the properties several targets check.

use std::{collections::BTreeMap, ffi::OsString};

/// Splits `KEY=VALUE` lines, up to the first empty line, from the bytes
/// after it: the CNI environment and stdin of one plugin run. Lines without
/// `=` are ignored; values are raw bytes, so non-UTF-8 variables are reached.
pub fn env_and_stdin(data: &[u8]) -> (BTreeMap<String, OsString>, &[u8]) {
    use std::os::unix::ffi::OsStringExt;
    let (head, stdin) = match data.windows(2).position(|w| w == b"\n\n") {
        Some(at) => (&data[..at], &data[at + 2..]),
        None => (data, &[][..]),
    };
    let env = head
        .split(|&b| b == b'\n')
        .filter_map(|line| {
            let eq = line.iter().position(|&b| b == b'=')?;
            let key = String::from_utf8(line[..eq].to_vec()).ok()?;
            Some((key, OsString::from_vec(line[eq + 1..].to_vec())))
        })
        .collect();
    (env, stdin)
}

/// The first `N` lines of `data` (missing ones empty), when it is UTF-8.
pub fn lines<const N: usize>(data: &[u8]) -> Option<[&str; N]> {
    let text = std::str::from_utf8(data).ok()?;
    let mut parts = text.splitn(N, '\n');
    Some(std::array::from_fn(|_| parts.next().unwrap_or("")))
}

/// Panics unless every problem a spec check gave names its field
/// (`spec.`…) and says more than that.
pub fn assert_problems_name_fields(problems: &[String]) {
    for problem in problems {
        assert!(
            problem.starts_with("spec.") && problem.len() > 20,
            "a problem that names no field: {problem:?}"
        );
    }
}

/// Whether `selector` can be evaluated: on an object carrying its own
/// `matchLabels`, so that every expression is reached.
pub fn selector_evaluates(
    selector: &k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector,
) -> Result<(), flatnet_k8s::selector::SelectorError> {
    let labels: flatnet_k8s::selector::Labels = selector.match_labels.clone().unwrap_or_default();
    flatnet_k8s::selector::matches(selector, &labels).map(|_| ())
}
