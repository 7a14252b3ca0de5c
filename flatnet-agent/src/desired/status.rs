//! What CNI STATUS reports beyond "the agent answers": whether the subnets
//! a network allocates from can serve an ADD on this node. A subnet cannot
//! when its master link is missing here or its pool has no free address.

use super::NamedSubnet;
use crate::cni::{CniError, ErrorCode};

/// One subnet as STATUS sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubnetCapacity {
    /// The subnet.
    pub name: String,
    /// Its master link on the host (`spec.master`).
    pub master: String,
    /// Free addresses left, `None` when the source does not know yet (a
    /// subnet the operator has not counted).
    pub free: Option<u128>,
}

impl SubnetCapacity {
    /// The capacity of `subnet` with `free` addresses left.
    pub fn of(subnet: &NamedSubnet, free: Option<u128>) -> Self {
        SubnetCapacity {
            name: subnet.name.clone(),
            master: subnet.spec.master.clone(),
            free,
        }
    }

    /// Why this subnet cannot serve an ADD here, if it cannot.
    fn problem(&self, has_link: &impl Fn(&str) -> bool) -> Option<String> {
        if !has_link(&self.master) {
            return Some(format!(
                "subnet {:?}: master link {:?} does not exist on this node",
                self.name, self.master
            ));
        }
        (self.free == Some(0)).then(|| {
            format!(
                "subnet {:?}: no free address left (pool exhausted)",
                self.name
            )
        })
    }
}

/// The STATUS answer for `network`.
///
/// A configuration that names its subnets (`subnet`) needs every one of them;
/// otherwise pods choose among all subnets, so the network is unavailable
/// only when none of them can serve (a network without any subnet yet is
/// available: nothing asks it for an address). The error is code 50 and
/// lists every problem found.
pub fn evaluate(
    network: &str,
    named_in_config: bool,
    subnets: &[SubnetCapacity],
    has_link: impl Fn(&str) -> bool,
) -> Result<(), CniError> {
    let problems: Vec<String> = subnets
        .iter()
        .filter_map(|s| s.problem(&has_link))
        .collect();
    let unavailable = if named_in_config {
        !problems.is_empty()
    } else {
        !subnets.is_empty() && problems.len() == subnets.len()
    };
    if unavailable {
        return Err(CniError::new(
            ErrorCode::PluginNotAvailable,
            format!(
                "network {network:?} cannot serve ADD on this node: {}",
                problems.join("; ")
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subnet(name: &str, master: &str, free: Option<u128>) -> SubnetCapacity {
        SubnetCapacity {
            name: name.into(),
            master: master.into(),
            free,
        }
    }

    fn links(name: &str) -> bool {
        name == "eth0"
    }

    #[test]
    fn a_named_subnet_without_its_master_link_is_code_50_naming_it() {
        let error = evaluate("flat", true, &[subnet("a", "eth9", Some(5))], links).unwrap_err();
        assert_eq!(error.code, ErrorCode::PluginNotAvailable);
        assert!(
            error.msg.contains("\"eth9\" does not exist"),
            "{}",
            error.msg
        );
    }

    #[test]
    fn a_named_exhausted_subnet_is_code_50() {
        let error = evaluate(
            "flat",
            true,
            &[subnet("a", "eth0", Some(3)), subnet("b", "eth0", Some(0))],
            links,
        )
        .unwrap_err();
        assert_eq!(error.code, ErrorCode::PluginNotAvailable);
        assert!(error.msg.contains("subnet \"b\""), "{}", error.msg);
        assert!(error.msg.contains("exhausted"), "{}", error.msg);
        assert!(!error.msg.contains("subnet \"a\""), "{}", error.msg);
    }

    #[test]
    fn unnamed_subnets_fail_only_when_none_can_serve() {
        let one_good = [subnet("a", "eth9", Some(5)), subnet("b", "eth0", None)];
        assert!(evaluate("flat", false, &one_good, links).is_ok());
        let none_good = [subnet("a", "eth9", Some(5)), subnet("b", "eth0", Some(0))];
        let error = evaluate("flat", false, &none_good, links).unwrap_err();
        assert!(
            error.msg.contains("\"a\"") && error.msg.contains("\"b\""),
            "{}",
            error.msg
        );
        assert!(evaluate("flat", false, &[], links).is_ok());
    }
}
