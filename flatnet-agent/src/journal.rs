//! A durable key-value map in one append-only journal file, for state
//! that must be on disk before the agent answers (attachment records).
//!
//! Replacing a file atomically costs two journal commits of the file
//! system (`fsync` of the new file, then of its directory): about 5 ms on
//! a virtual disk, paid several times per CNI ADD. Here a change is one
//! entry written into space that was written (zeroed) and synced before,
//! then `fdatasync`: the file's size and blocks do not change, so only the
//! data goes to the disk, no file-system commit (about 0.1 ms).
//!
//! Layout: entries from offset 0, each `magic | length | checksum | JSON
//! (key, value or null for a removal)`, then zeros up to the file's size.
//! Replay stops at the first entry that is not whole: a change is
//! acknowledged only after a sync that covers it and every entry before
//! it, so whatever follows a torn entry was never acknowledged either. Opening rewrites the file
//! with one entry per live key (atomically, through a temporary file); so
//! does an append that no longer fits, into a file twice the live size.

use std::{
    collections::BTreeMap,
    fs::{self, File},
    io::{self, Read},
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
};

use serde::{Serialize, de::DeserializeOwned};

use crate::atomic_file::{create_private_dir, private_file};

/// Marks the start of an entry.
const MAGIC: [u8; 4] = *b"FNJ1";
/// Magic, length (u32) and checksum (u64), little-endian.
const HEADER_LEN: usize = 16;
/// The smallest file: room for about a thousand small entries.
const MIN_SIZE: u64 = 1 << 20;

/// A journal could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("journal {path}: {reason}")]
pub struct JournalError {
    /// The journal file.
    pub path: PathBuf,
    /// What failed.
    pub reason: String,
}

/// The map and the file that makes it durable. Shared by reference:
/// concurrent changes are written one after another, and one `fdatasync`
/// makes every change written before it durable (group commit), so
/// concurrent callers do not queue for one sync each.
#[derive(Debug)]
pub struct Journal<K, V> {
    path: PathBuf,
    state: Mutex<State<K, V>>,
    /// Held by the one caller syncing; the others wait, then find their
    /// change durable.
    sync_turn: Mutex<()>,
}

#[derive(Debug)]
struct State<K, V> {
    file: Arc<File>,
    /// Where the next entry goes.
    tail: u64,
    /// The file's size (all of it written).
    size: u64,
    /// Entries up to here are durable.
    durable: u64,
    /// Counts the file's rewrites: a rewrite makes what it holds durable.
    generation: u64,
    /// Set when a sync failed: the kernel may have dropped the pages, so
    /// nothing written is trusted to be durable until the agent restarts
    /// (and replays what the disk holds).
    failed: Option<String>,
    map: BTreeMap<K, V>,
}

/// A change written, not yet known to be durable.
#[derive(Clone, Copy, Debug)]
struct Written {
    generation: u64,
    end: u64,
}

impl<K, V> Journal<K, V>
where
    K: Ord + Clone + Serialize + DeserializeOwned,
    V: Clone + Serialize + DeserializeOwned,
{
    /// Opens the journal at `path` (creating it and its directory, mode
    /// 0700, when missing), with `adopt` added to what it holds (entries
    /// moved over from an older format; durable once this returns).
    pub fn open(path: &Path, adopt: Vec<(K, V)>) -> Result<Self, JournalError> {
        let error = |e: io::Error| JournalError {
            path: path.to_owned(),
            reason: e.to_string(),
        };
        if let Some(dir) = path.parent() {
            create_private_dir(dir).map_err(error)?;
        }
        let mut map = read_entries(path).map_err(error)?;
        map.extend(adopt);
        let (file, tail, size) = rewrite(path, &map).map_err(error)?;
        Ok(Self {
            path: path.to_owned(),
            state: Mutex::new(State {
                file: Arc::new(file),
                tail,
                size,
                durable: tail,
                generation: 0,
                failed: None,
                map,
            }),
            sync_turn: Mutex::new(()),
        })
    }

    /// What the journal at `path` holds, read without changing it (for
    /// tools and tests next to a running agent). Missing: empty.
    pub fn read(path: &Path) -> Result<BTreeMap<K, V>, JournalError> {
        read_entries(path).map_err(|e| JournalError {
            path: path.to_owned(),
            reason: e.to_string(),
        })
    }

    fn state(&self) -> MutexGuard<'_, State<K, V>> {
        self.state.lock().expect("journal lock poisoned")
    }

    fn error(&self, reason: impl std::fmt::Display) -> JournalError {
        JournalError {
            path: self.path.clone(),
            reason: reason.to_string(),
        }
    }

    /// The value of `key`.
    pub fn get(&self, key: &K) -> Option<V> {
        self.state().map.get(key).cloned()
    }

    /// Every entry, in key order.
    pub fn entries(&self) -> BTreeMap<K, V> {
        self.state().map.clone()
    }

    /// Sets `key` to `value`, on disk before this returns.
    pub fn put(&self, key: K, value: V) -> Result<(), JournalError> {
        let written = self.write(key, Some(value))?;
        self.make_durable(written)
    }

    /// Sets `key` to `value` in the file without waiting for the disk: the
    /// change survives the process (the kernel holds the written pages)
    /// and becomes durable with the next change that is made durable
    /// ([`Self::put`], [`Self::remove`]), this caller's or a concurrent
    /// one's, since a sync covers everything written before it. Only for
    /// values whose loss in a power cut loses nothing, e.g. one that
    /// describes kernel state a reboot removes anyway.
    pub fn put_unsynced(&self, key: K, value: V) -> Result<(), JournalError> {
        self.write(key, Some(value)).map(drop)
    }

    /// Removes `key` (absent: nothing to do), on disk before this returns.
    pub fn remove(&self, key: &K) -> Result<(), JournalError> {
        if !self.state().map.contains_key(key) {
            return Ok(());
        }
        let written = self.write(key.clone(), None)?;
        self.make_durable(written)
    }

    /// Writes the change into the file and the map (a later rewrite then
    /// includes it), without waiting for the disk.
    fn write(&self, key: K, value: Option<V>) -> Result<Written, JournalError> {
        let mut state = self.state();
        if let Some(reason) = &state.failed {
            return Err(self.error(format!(
                "an earlier write failed ({reason}); restart the agent to replay the journal"
            )));
        }
        let entry = encode(&key, value.as_ref()).map_err(|e| self.error(e))?;
        match value {
            Some(value) => state.map.insert(key, value),
            None => state.map.remove(&key),
        };
        if state.tail + entry.len() as u64 > state.size {
            // Full: the live entries (with this change) into a new file,
            // durable when it replaces the old one.
            let (file, tail, size) = rewrite(&self.path, &state.map).map_err(|e| self.error(e))?;
            state.file = Arc::new(file);
            (state.tail, state.size, state.durable) = (tail, size, tail);
            state.generation += 1;
        } else {
            state
                .file
                .write_all_at(&entry, state.tail)
                .map_err(|e| self.error(e))?;
            state.tail += entry.len() as u64;
        }
        Ok(Written {
            generation: state.generation,
            end: state.tail,
        })
    }

    /// Returns once `written` is durable: after a sync that started after
    /// it was written, this caller's or another's.
    fn make_durable(&self, written: Written) -> Result<(), JournalError> {
        crate::atomic_file::off_runtime(|| self.sync_covering(written))
    }

    fn sync_covering(&self, written: Written) -> Result<(), JournalError> {
        let _turn = self.sync_turn.lock().expect("journal sync lock poisoned");
        let (file, generation, end) = {
            let state = self.state();
            if let Some(reason) = &state.failed {
                return Err(self.error(format!("cannot make a change durable: {reason}")));
            }
            if state.generation != written.generation || state.durable >= written.end {
                return Ok(());
            }
            (Arc::clone(&state.file), state.generation, state.tail)
        };
        let synced = file.sync_data();
        let mut state = self.state();
        match synced {
            Ok(()) => {
                if state.generation == generation {
                    state.durable = state.durable.max(end);
                }
                Ok(())
            }
            Err(e) => {
                state.failed = Some(e.to_string());
                Err(self.error(e))
            }
        }
    }
}

/// One entry: header and payload.
fn encode<K: Serialize, V: Serialize>(key: &K, value: Option<&V>) -> io::Result<Vec<u8>> {
    let payload = serde_json::to_vec(&(key, value)).map_err(io::Error::other)?;
    let len =
        u32::try_from(payload.len()).map_err(|_| io::Error::other("entry larger than 4 GiB"))?;
    let mut entry = Vec::with_capacity(HEADER_LEN + payload.len());
    entry.extend_from_slice(&MAGIC);
    entry.extend_from_slice(&len.to_le_bytes());
    entry.extend_from_slice(&checksum(&payload).to_le_bytes());
    entry.extend_from_slice(&payload);
    Ok(entry)
}

/// The live entries of the file at `path` (none when it is missing).
fn read_entries<K, V>(path: &Path) -> io::Result<BTreeMap<K, V>>
where
    K: Ord + DeserializeOwned,
    V: DeserializeOwned,
{
    let mut bytes = Vec::new();
    match File::open(path) {
        Ok(mut file) => file.read_to_end(&mut bytes)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(e),
    };
    let mut map = BTreeMap::new();
    let mut at = 0;
    while let Some(header) = bytes.get(at..at + HEADER_LEN) {
        if header[..4] != MAGIC {
            break;
        }
        let len = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes")) as usize;
        let sum = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
        let Some(payload) = bytes.get(at + HEADER_LEN..at + HEADER_LEN + len) else {
            break;
        };
        if checksum(payload) != sum {
            break;
        }
        match serde_json::from_slice::<(K, Option<V>)>(payload) {
            Ok((key, Some(value))) => {
                map.insert(key, value);
            }
            Ok((key, None)) => {
                map.remove(&key);
            }
            // Whole but not understood: a newer agent's entry, say.
            Err(e) => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("entry at offset {at}: {e}"),
                ));
            }
        }
        at += HEADER_LEN + len;
    }
    Ok(map)
}

/// Replaces the file at `path` with one entry per item of `map` and zeros
/// up to at least twice their size, atomically and durably; returns the
/// file open for writing, the tail and the size.
fn rewrite<K: Serialize, V: Serialize>(
    path: &Path,
    map: &BTreeMap<K, V>,
) -> io::Result<(File, u64, u64)> {
    let mut bytes = Vec::new();
    for (key, value) in map {
        bytes.extend(encode(key, Some(value))?);
    }
    let tail = bytes.len() as u64;
    let size = (2 * tail).max(MIN_SIZE);
    bytes.resize(usize::try_from(size).map_err(io::Error::other)?, 0);
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let tmp = path.with_file_name(format!(".{}.tmp", name.to_string_lossy()));
    {
        let file = private_file(&tmp, true)?;
        file.write_all_at(&bytes, 0)?;
        file.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    File::open(dir)?.sync_all()?;
    let file = File::options().read(true).write(true).open(path)?;
    Ok((file, tail, size))
}

/// FNV-1a, 64 bits: catches a torn entry (not an adversary).
fn checksum(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    type Map = Journal<String, u32>;

    #[test]
    fn changes_survive_reopening_and_removals_stay_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/j");
        let journal = Map::open(&path, Vec::new()).unwrap();
        journal.put("a".into(), 1).unwrap();
        journal.put("b".into(), 2).unwrap();
        journal.put("a".into(), 3).unwrap();
        journal.remove(&"b".into()).unwrap();
        journal.remove(&"never".into()).unwrap();
        let expected = BTreeMap::from([("a".to_owned(), 3)]);
        assert_eq!(journal.entries(), expected);
        assert_eq!(Map::read(&path).unwrap(), expected, "read while open");
        drop(journal);
        let reopened = Map::open(&path, vec![("c".into(), 4)]).unwrap();
        assert_eq!(reopened.get(&"a".into()), Some(3));
        assert_eq!(reopened.get(&"c".into()), Some(4), "adopted");
        assert_eq!(Map::read(&path).unwrap().len(), 2, "adoption is durable");
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["j"], "no temporary file left");
    }

    #[test]
    fn an_unsynced_change_is_read_back_and_made_durable_by_the_next_sync() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let journal = Map::open(&path, Vec::new()).unwrap();
        journal.put_unsynced("staged".into(), 1).unwrap();
        assert_eq!(journal.get(&"staged".into()), Some(1));
        assert_eq!(
            Map::read(&path).unwrap(),
            BTreeMap::from([("staged".to_owned(), 1)]),
            "in the file (a process crash keeps it)"
        );
        let durable_before = journal.state().durable;
        journal.put("synced".into(), 2).unwrap();
        let state = journal.state();
        assert_eq!(
            state.durable, state.tail,
            "the sync covers the staged entry"
        );
        assert!(state.durable > durable_before);
    }

    #[test]
    fn a_torn_last_entry_is_ignored_and_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let journal = Map::open(&path, Vec::new()).unwrap();
        journal.put("kept".into(), 1).unwrap();
        let torn_at = journal.state().tail;
        journal.put("torn".into(), 2).unwrap();
        drop(journal);
        // The last entry loses its final byte: as if the write never ended.
        let file = File::options().write(true).open(&path).unwrap();
        let last = encode(&"torn".to_owned(), Some(&2)).unwrap();
        file.write_all_at(&[0], torn_at + last.len() as u64 - 1)
            .unwrap();
        assert_eq!(
            Map::read(&path).unwrap(),
            BTreeMap::from([("kept".to_owned(), 1)])
        );
        let journal = Map::open(&path, Vec::new()).unwrap();
        journal.put("next".into(), 3).unwrap();
        assert_eq!(
            Map::read(&path).unwrap(),
            BTreeMap::from([("kept".to_owned(), 1), ("next".to_owned(), 3)])
        );
    }

    #[test]
    fn a_full_file_is_rewritten_with_the_live_entries() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let journal = Map::open(&path, Vec::new()).unwrap();
        let value = 7;
        // Long keys: fewer changes fill the file.
        let key = |i: u64| format!("{:0>2000}", i % 10);
        let entry = encode(&key(0), Some(&value)).unwrap().len() as u64;
        // Enough changes of a few keys to fill the file several times.
        let changes = 3 * MIN_SIZE / entry;
        for i in 0..changes {
            journal.put(key(i), value).unwrap();
        }
        let (tail, size) = {
            let state = journal.state();
            (state.tail, state.size)
        };
        assert!(size >= MIN_SIZE);
        assert!(tail < size);
        assert_eq!(fs::metadata(&path).unwrap().len(), size);
        let read = Map::read(&path).unwrap();
        assert_eq!(read.len(), 10);
        assert!(read.values().all(|v| *v == value));
    }

    #[test]
    fn concurrent_changes_are_all_durable_through_rewrites() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let journal = Map::open(&path, Vec::new()).unwrap();
        // Long keys: the file fills and is rewritten while others write.
        let key = |thread: u32, i: u32| format!("{thread}-{:0>4000}", i % 40);
        std::thread::scope(|scope| {
            for thread in 0..4 {
                let journal = &journal;
                scope.spawn(move || {
                    for i in 0..400 {
                        journal.put(key(thread, i), i).unwrap();
                    }
                });
            }
        });
        let expected: BTreeMap<String, u32> = (0..4)
            .flat_map(|thread| (360..400).map(move |i| (key(thread, i), i)))
            .collect();
        assert_eq!(journal.entries(), expected);
        assert_eq!(Map::read(&path).unwrap(), expected, "on disk");
        assert!(journal.state().generation > 0, "the file was rewritten");
    }
}
