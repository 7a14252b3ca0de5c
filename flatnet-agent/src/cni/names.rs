//! The names a request carries into file names and netlink: the container
//! ID and the interface name. One rule each, checked by flatnet-cni on the
//! environment and by the agent on every request it reads from its socket.

use super::error::{CniError, ErrorCode};

/// Longest accepted container ID: an attachment key must fit a file name
/// (255 bytes) as `.<id>@<ifname>.json.tmp` with the longest interface name,
/// as the record files of earlier agents (migrated into the journal) were
/// named, and hostile input stays small.
pub const MAX_CONTAINER_ID_LEN: usize =
    255 - flatnet_k8s::validation::MAX_IFNAME_LEN - ".@.json.tmp".len();

/// The specification's rule for container IDs and network names: a letter
/// or digit, then letters, digits, `_`, `.` and `-`.
pub fn is_cni_identifier(text: &str) -> bool {
    let mut chars = text.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

/// Checks `CNI_CONTAINERID`: the specification's rule, at most
/// [`MAX_CONTAINER_ID_LEN`] bytes. Error 4.
pub fn check_container_id(id: &str) -> Result<(), CniError> {
    let problem = if !is_cni_identifier(id) {
        "it must start with a letter or digit and contain only letters, digits, '_', '.' and '-'"
            .to_owned()
    } else if id.len() > MAX_CONTAINER_ID_LEN {
        format!(
            "it is {} bytes long; flatnet accepts at most {MAX_CONTAINER_ID_LEN}",
            id.len()
        )
    } else {
        return Ok(());
    };
    Err(CniError::new(
        ErrorCode::InvalidEnvironment,
        format!("CNI_CONTAINERID {:?} is invalid: {problem}", shorten(id)),
    ))
}

/// Checks `CNI_IFNAME` by the kernel's rule. Error 4.
pub fn check_ifname(name: &str) -> Result<(), CniError> {
    flatnet_k8s::validation::check_ifname(name).map_err(|reason| {
        CniError::new(
            ErrorCode::InvalidEnvironment,
            format!(
                "CNI_IFNAME {reason}; set the interface name in the pod's networks annotation to a valid Linux name"
            ),
        )
    })
}

/// Checks the container ID and the interface name of an attachment.
pub fn check_attachment(container_id: &str, ifname: &str) -> Result<(), CniError> {
    check_container_id(container_id)?;
    check_ifname(ifname)
}

/// The first 64 characters of a hostile value, for messages.
fn shorten(text: &str) -> String {
    match text.char_indices().nth(64) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn container_ids_follow_the_specification_and_fit_a_file_name() {
        for good in ["a", "9abc_d.e-f", &"c".repeat(MAX_CONTAINER_ID_LEN)] {
            assert_eq!(check_container_id(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "_a",
            "a b",
            "é",
            "../../x",
            "a/b",
            &"c".repeat(MAX_CONTAINER_ID_LEN + 1),
            &"c".repeat(300),
        ] {
            let error = check_container_id(bad).unwrap_err();
            assert_eq!(error.code, ErrorCode::InvalidEnvironment, "{bad}");
            assert!(error.msg.contains("CNI_CONTAINERID"), "{}", error.msg);
            assert!(error.msg.len() < 300, "the message stays short");
        }
    }

    #[test]
    fn interface_names_follow_the_kernel() {
        for bad in ["", "a/b", "..", "eth 1", "eth:1", "a-very-long-ifname"] {
            let error = check_ifname(bad).unwrap_err();
            assert_eq!(error.code, ErrorCode::InvalidEnvironment, "{bad:?}");
            assert!(error.msg.starts_with("CNI_IFNAME"), "{}", error.msg);
        }
        check_ifname("eth1").unwrap();
    }

    proptest! {
        /// Every accepted attachment has a record file name of one path
        /// component that fits the file-name limit.
        #[test]
        fn accepted_names_make_one_short_file_name(
            id in "[a-zA-Z0-9][a-zA-Z0-9_.-]{0,300}", ifname in "[^/]{0,20}"
        ) {
            if check_attachment(&id, &ifname).is_ok() {
                let tmp = format!(".{id}@{ifname}.json.tmp");
                prop_assert!(tmp.len() <= 255, "{}", tmp.len());
                prop_assert!(!tmp.contains('/'));
                prop_assert!(!id.starts_with('.'));
            }
        }
    }
}
