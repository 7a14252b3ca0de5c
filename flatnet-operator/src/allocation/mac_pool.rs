//! The MAC pool as allocation sees it: the range and mode the
//! FlatNetworkConfig sets (kept current by its watch, see
//! [`cluster_config`](crate::cluster_config)), and which records take a
//! MAC from it. The allocation itself is `flatnet_k8s::ipam::mac_pool`'s,
//! claimed in the parent link's MAC ledger ([`mac_ledger`](super::mac_ledger))
//! many at a time ([`mac_ahead`](super::mac_ahead)).

use std::{
    collections::BTreeMap,
    sync::{Arc, RwLock},
};

use flatnet_k8s::{
    api::{FlatNetworkIP, MacPoolMode},
    ipam::MacRange,
    keys::{SECONDARY_RECORD_SUFFIX, label},
};
use k8s_openapi::api::core::v1::Namespace;

use super::mac_ahead::MacAhead;
use kube::{
    ResourceExt,
    runtime::reflector::{ObjectRef, Store},
};

/// The pool allocation uses now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivePool {
    /// The range MACs come from.
    pub range: MacRange,
    /// Which namespaces take part.
    pub mode: MacPoolMode,
}

/// The current pool, shared by the allocation workers and replaced at run
/// time by the FlatNetworkConfig watch (`None`: no pool: no config object
/// yet, or no range recorded yet), and the MACs claimed from it ahead.
#[derive(Clone, Default)]
pub struct MacPoolView {
    pool: Arc<RwLock<Option<ActivePool>>>,
    /// Pool MACs claimed and not handed out yet, per parent link.
    pub ahead: Arc<MacAhead>,
}

impl std::fmt::Debug for MacPoolView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("MacPoolView").field(&self.get()).finish()
    }
}

impl MacPoolView {
    /// A view of `pool`.
    #[must_use]
    pub fn new(pool: Option<ActivePool>) -> Self {
        Self {
            pool: Arc::new(RwLock::new(pool)),
            ahead: Arc::default(),
        }
    }

    /// The pool now.
    #[must_use]
    pub fn get(&self) -> Option<ActivePool> {
        *self.pool.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Replaces the pool; returns whether it changed.
    pub fn set(&self, pool: Option<ActivePool>) -> bool {
        let mut current = self.pool.write().unwrap_or_else(|e| e.into_inner());
        let changed = *current != pool;
        *current = pool;
        changed
    }

    /// The range `record` takes its MAC from, `None` when it takes none
    /// from the pool: it asks for fixed MACs, it is the second record of a
    /// dual-stack pod (whose one interface has the first record's MAC), or
    /// its namespace does not take part.
    #[must_use]
    pub fn range_for(
        &self,
        record: &FlatNetworkIP,
        namespaces: &Store<Namespace>,
    ) -> Option<MacRange> {
        let pool = self.get()?;
        if !record.spec.macs.is_empty() || record.name_any().ends_with(SECONDARY_RECORD_SUFFIX) {
            return None;
        }
        let namespace = record.namespace().unwrap_or_default();
        let labels = namespaces
            .get(&ObjectRef::new(&namespace))
            .map(|ns| ns.labels().clone())
            .unwrap_or_default();
        takes_part(pool.mode, &labels).then_some(pool.range)
    }
}

/// Whether a namespace with `labels` takes MACs from the pool in `mode`.
#[must_use]
pub fn takes_part(mode: MacPoolMode, labels: &BTreeMap<String, String>) -> bool {
    let value = labels.get(label::MAC_POOL).map(String::as_str);
    match mode {
        MacPoolMode::OptOut => value != Some(label::MAC_POOL_DISABLED),
        MacPoolMode::OptIn => value == Some(label::MAC_POOL_ENABLED),
        MacPoolMode::Disabled => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_opt_in_and_out_by_label() {
        let labelled = |v: &str| BTreeMap::from([(label::MAC_POOL.to_owned(), v.to_owned())]);
        let none = BTreeMap::new();
        assert!(takes_part(MacPoolMode::OptOut, &none));
        assert!(takes_part(MacPoolMode::OptOut, &labelled("enabled")));
        assert!(!takes_part(MacPoolMode::OptOut, &labelled("disabled")));
        assert!(!takes_part(MacPoolMode::OptIn, &none));
        assert!(takes_part(MacPoolMode::OptIn, &labelled("enabled")));
        assert!(!takes_part(MacPoolMode::OptIn, &labelled("yes")));
        assert!(!takes_part(MacPoolMode::Disabled, &labelled("enabled")));
    }
}
