//! Standard `metav1.Condition` handling shared by both kinds.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Condition type meaning "the object is fully reconciled and usable".
pub const CONDITION_READY: &str = "Ready";

/// On the FlatNetworkIP of an interface hot-plugged into a running pod:
/// whether the node's agent made it (`True`) or why it could not
/// (`False`, with the reason in the message).
pub const CONDITION_ATTACHED: &str = "Attached";

/// On a FlatNetworkIP holding a flatnet MAC (pool or fixed): `True` while
/// a node's agent sees another host on the LAN use that MAC (flatnet
/// addition, ignored by rancher-flat-network), with what it saw in the
/// message; `False` once that node has not seen it for a while.
pub const CONDITION_MAC_CONFLICT: &str = "MACConflict";

/// Inserts or replaces the condition of `new.type_`.
///
/// `lastTransitionTime` only moves when the status value changes, as the
/// Kubernetes API conventions require; `new`'s time is used otherwise.
/// Returns whether anything changed, so callers can skip no-op writes.
pub fn set_condition(conditions: &mut Vec<Condition>, new: Condition) -> bool {
    match conditions.iter_mut().find(|c| c.type_ == new.type_) {
        None => {
            conditions.push(new);
            true
        }
        Some(old) => {
            let transition: Time = if old.status == new.status {
                old.last_transition_time.clone()
            } else {
                new.last_transition_time.clone()
            };
            let updated = Condition {
                last_transition_time: transition,
                ..new
            };
            let changed = *old != updated;
            *old = updated;
            changed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cond(status: &str, reason: &str, secs: i64) -> Condition {
        Condition {
            type_: CONDITION_READY.into(),
            status: status.into(),
            reason: reason.into(),
            message: String::new(),
            observed_generation: Some(1),
            last_transition_time: Time(k8s_openapi::jiff::Timestamp::from_second(secs).unwrap()),
        }
    }

    #[test]
    fn transition_time_moves_only_on_status_change() {
        let mut conditions = Vec::new();
        assert!(set_condition(&mut conditions, cond("False", "Pending", 10)));
        assert!(set_condition(
            &mut conditions,
            cond("False", "Validating", 20)
        ));
        assert_eq!(conditions.len(), 1);
        assert_eq!(conditions[0].reason, "Validating");
        assert_eq!(
            conditions[0].last_transition_time,
            cond("", "", 10).last_transition_time
        );
        assert!(!set_condition(
            &mut conditions,
            cond("False", "Validating", 30)
        ));
        assert!(set_condition(&mut conditions, cond("True", "Ready", 40)));
        assert_eq!(
            conditions[0].last_transition_time,
            cond("", "", 40).last_transition_time
        );
    }
}
