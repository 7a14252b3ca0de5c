//! Input formats shared by the fuzz targets: readable text seeds that
//! libFuzzer mutates well (`KEY=VALUE` lines, line-separated fields).

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
