//! Kubernetes label selectors: the one evaluator lives in `flatnet-k8s`.

pub use flatnet_k8s::selector::{Labels, SelectorError, matches};
