//! One lock per attachment, so ADD, DEL and GC of the same container
//! interface never interleave (a DEL sent after ADD's deadline waits for the
//! ADD still finishing in the background, then undoes it).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use crate::desired::AttachmentKey;

/// Per-attachment locks.
#[derive(Default)]
pub struct KeyLocks {
    locks: Mutex<HashMap<AttachmentKey, Arc<AsyncMutex<()>>>>,
}

/// Holds the lock of one attachment; dropping it lets the next waiter in.
pub struct KeyGuard<'a> {
    owner: &'a KeyLocks,
    key: AttachmentKey,
    guard: Option<OwnedMutexGuard<()>>,
}

impl KeyLocks {
    /// Waits for the lock of `key`.
    pub async fn lock(&self, key: &AttachmentKey) -> KeyGuard<'_> {
        let lock = {
            let mut locks = self.locks.lock().expect("lock table poisoned");
            Arc::clone(locks.entry(key.clone()).or_default())
        };
        KeyGuard {
            owner: self,
            key: key.clone(),
            guard: Some(lock.lock_owned().await),
        }
    }

    /// Number of attachments with a lock entry.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.locks.lock().expect("lock table poisoned").len()
    }

    /// Whether no lock entry exists.
    #[cfg(test)]
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for KeyGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        let mut locks = self.owner.locks.lock().expect("lock table poisoned");
        // Only the table holds it now: nobody waits, so forget the entry.
        if locks
            .get(&self.key)
            .is_some_and(|lock| Arc::strong_count(lock) == 1)
        {
            locks.remove(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(id: &str) -> AttachmentKey {
        AttachmentKey {
            container_id: id.into(),
            ifname: "eth1".into(),
        }
    }

    #[tokio::test]
    async fn same_key_waits_other_keys_do_not_and_entries_are_forgotten() {
        let locks = KeyLocks::default();
        let first = locks.lock(&key("a")).await;
        let _other = locks.lock(&key("b")).await;
        let a = key("a");
        let waiting = locks.lock(&a);
        tokio::pin!(waiting);
        assert!(
            futures::poll!(waiting.as_mut()).is_pending(),
            "a second holder of the same key must wait"
        );
        drop(first);
        let second = waiting.await;
        drop(second);
        assert_eq!(locks.len(), 1, "only b is still held");
        drop(_other);
        assert!(locks.is_empty());
    }
}
