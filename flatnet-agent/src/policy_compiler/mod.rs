//! Network policy for flat-network pods: the MultiNetworkPolicy API and the
//! compiler that turns policies into the tables the pod-interface programs
//! enforce (see `docs/policy.md`).

pub mod api;
pub mod compile;
pub mod selector;
pub mod tables;

#[cfg(test)]
mod proptests;
// The reference evaluator also checks the compiler in the fuzz target
// `policy_compiler` (xtask/fuzz), which builds the agent with `fuzzing`.
#[cfg(any(test, feature = "fuzzing"))]
pub mod reference;

pub use api::{MultiNetworkPolicy, MultiNetworkPolicySpec, NetworkNames};
pub use compile::{FlatPod, PolicyInputs, compile};
pub use tables::{CompiledPolicy, Diagnostic, DirectionTable, PortSpec, RuleRef, SubjectTables};
