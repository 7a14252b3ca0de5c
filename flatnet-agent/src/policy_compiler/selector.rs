//! Kubernetes label selectors: flatnet-k8s's one implementation
//! ([`flatnet_k8s::selector`]), shared with the operator.

pub use flatnet_k8s::selector::{Labels, SelectorError, matches};
