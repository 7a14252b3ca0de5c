//! Crash-safe file replacement: readers see the old or the new content,
//! never a torn file, even if the agent dies mid-write.

use std::{
    fs::{self, File},
    io::{self, Write},
    path::Path,
};

/// Runs `io` (a file write or sync that may wait for the disk) without
/// stalling the async runtime it is called on: on the multi-threaded
/// runtime the thread's other tasks move to another thread meanwhile
/// (`block_in_place`), so concurrent CNI commands go on while one waits
/// for the disk. Outside it (a current-thread runtime, no runtime) it
/// simply runs.
pub(crate) fn off_runtime<T>(io: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(io)
        }
        _ => io(),
    }
}

/// Writes `bytes` to `path` (mode 0600) through a temporary file in the same
/// directory, `fsync`, `rename` and an `fsync` of the directory, creating
/// the directory (mode 0700) when missing.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> io::Result<()> {
    replace(path, bytes, true)
}

/// [`write_atomic`] without the two `fsync`s (two file-system commits,
/// about 5 ms): readers still see the old or the new content, but a crash
/// may bring the old one back. For files rebuilt from durable state.
pub fn write_atomic_unsynced(path: &Path, bytes: &[u8]) -> io::Result<()> {
    replace(path, bytes, false)
}

fn replace(path: &Path, bytes: &[u8], durable: bool) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    create_private_dir(dir)?;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    {
        // Root-only, whatever the umask: the agent's state is nobody else's.
        let mut file = private_file(&tmp, true)?;
        file.write_all(bytes)?;
        if durable {
            file.sync_all()?;
        }
    }
    fs::rename(&tmp, path)?;
    if durable {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Opens `path` for writing, creating it with mode 0600 when missing;
/// `truncate` empties an existing file.
pub fn private_file(path: &Path, truncate: bool) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    File::options()
        .create(true)
        .write(true)
        .truncate(truncate)
        .mode(0o600)
        .open(path)
}

/// Creates `dir` and its parents with mode 0700 when missing.
pub fn create_private_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    if dir.is_dir() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Removes `path`; a missing file is not an error.
pub fn remove_if_exists(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Reads the JSON file at `path` as `T`; a missing file is `T::default()`.
/// Errors name the file.
pub(crate) fn read_json_or_default<T>(path: &Path) -> Result<T, String>
where
    T: serde::de::DeserializeOwned + Default,
{
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|e| format!("{} is not a valid ledger: {e}", path.display())),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(T::default()),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// Replaces the JSON file at `path` with `value` atomically, creating its
/// directory (mode 0700) when missing. Errors name the file.
pub(crate) fn write_json<T: serde::Serialize>(path: &Path, value: &T) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        create_private_dir(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| e.to_string())?;
    write_atomic(path, &bytes).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_content_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub/state.json");
        write_atomic(&path, b"one").unwrap();
        write_atomic(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["state.json"]);
        remove_if_exists(&path).unwrap();
        remove_if_exists(&path).unwrap();
        assert!(!path.exists());
    }
}
