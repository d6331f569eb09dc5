//! Backend generations: which backend directory is the member's current one.
//!
//! The backend of generation `n` lives in `<dir>/backend-<n>` (generation 0, the one a member
//! starts with, in `<dir>/backend`). A snapshot is restored into the next generation's
//! directory, synced, and switched to by atomically replacing the `CURRENT` pointer file:
//!
//! 1. write `<dir>/CURRENT.tmp`, 2. fsync it, 3. rename it to `<dir>/CURRENT`,
//! 4. fsync `<dir>`, 5. remove the previous generation's directory.
//!
//! The rename is the commit point: a crash before it leaves the old generation current, a
//! crash after it the new one, and the backend opened for the new generation while it was
//! restored is the very one that is swapped in (nothing is closed and reopened). Opening
//! (`repair`) removes every backend directory but the current one and a leftover
//! `CURRENT.tmp`, so a crash at any step leaves exactly one whole generation. Without a
//! `CURRENT` file the current generation is 0.
//!
//! `CURRENT`, 17 bytes, little-endian:
//!
//! ```text
//! magic "KLGN" (4 bytes) | version:u8 (= 1) | generation:u64 | crc32:u32 (IEEE, of the 13 bytes before)
//! ```

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::NodeError;

/// The pointer file naming the current generation.
pub(crate) const CURRENT: &str = "CURRENT";
const CURRENT_TMP: &str = "CURRENT.tmp";
const MAGIC: &[u8; 4] = b"KLGN";
const VERSION: u8 = 1;
const LEN: usize = 17;
/// Directory of generation 0 (and the prefix of every other generation's directory).
const BASE: &str = "backend";

/// The backend directory of generation `generation` under `dir`.
pub(crate) fn backend_dir(dir: &Path, generation: u64) -> PathBuf {
    if generation == 0 {
        dir.join(BASE)
    } else {
        dir.join(format!("{BASE}-{generation}"))
    }
}

/// The generation a directory entry name belongs to, if it is a backend directory.
fn generation_of(name: &str) -> Option<u64> {
    if name == BASE {
        return Some(0);
    }
    let n = name.strip_prefix(BASE)?.strip_prefix('-')?;
    if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) || n.starts_with('0') {
        return None;
    }
    n.parse().ok()
}

fn encode(generation: u64) -> [u8; LEN] {
    let mut b = [0u8; LEN];
    b[..4].copy_from_slice(MAGIC);
    b[4] = VERSION;
    b[5..13].copy_from_slice(&generation.to_le_bytes());
    let crc = crc32fast::hash(&b[..13]);
    b[13..].copy_from_slice(&crc.to_le_bytes());
    b
}

fn decode(b: &[u8]) -> Result<u64, NodeError> {
    let err = |off: usize, r: &str| NodeError::decode("CURRENT generation file", off, r.to_owned());
    if b.len() != LEN {
        return Err(err(0, "expected 17 bytes"));
    }
    if &b[..4] != MAGIC {
        return Err(err(0, "bad magic"));
    }
    if b[4] != VERSION {
        return Err(err(4, "unknown version"));
    }
    let mut crc = [0u8; 4];
    crc.copy_from_slice(&b[13..]);
    if crc32fast::hash(&b[..13]) != u32::from_le_bytes(crc) {
        return Err(err(13, "checksum mismatch"));
    }
    let mut g = [0u8; 8];
    g.copy_from_slice(&b[5..13]);
    Ok(u64::from_le_bytes(g))
}

fn fsync_dir(dir: &Path) -> Result<(), NodeError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| NodeError::io(dir, "fsync directory", e))
}

/// The current generation recorded under `dir` (0 without a `CURRENT` file).
pub(crate) fn current(dir: &Path) -> Result<u64, NodeError> {
    let path = dir.join(CURRENT);
    match fs::read(&path) {
        Ok(b) => decode(&b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(NodeError::io(&path, "read", e)),
    }
}

/// Every backend directory under `dir` with its generation.
fn backend_dirs(dir: &Path) -> Result<Vec<(u64, PathBuf)>, NodeError> {
    let entries = fs::read_dir(dir).map_err(|e| NodeError::io(dir, "read directory", e))?;
    Ok(entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            generation_of(name.to_str()?).map(|g| (g, e.path()))
        })
        .collect())
}

/// Removes every backend directory under `dir` except generation `keep`'s.
fn remove_others(dir: &Path, keep: u64) -> Result<(), NodeError> {
    for (g, path) in backend_dirs(dir)? {
        if g != keep {
            fs::remove_dir_all(&path).map_err(|e| NodeError::io(&path, "remove", e))?;
        }
    }
    Ok(())
}

/// Brings `dir` back to one whole generation after a crash at any step of [`switch`]:
/// removes a leftover `CURRENT.tmp` and every backend directory but the current one.
/// Returns the current generation.
pub(crate) fn repair(dir: &Path) -> Result<u64, NodeError> {
    let tmp = dir.join(CURRENT_TMP);
    if tmp.exists() {
        fs::remove_file(&tmp).map_err(|e| NodeError::io(&tmp, "remove", e))?;
    }
    let g = current(dir)?;
    remove_others(dir, g)?;
    Ok(g)
}

/// Prepares the directory of a new generation to restore into: removes every backend
/// directory past the current one (leftovers of abandoned restores) and returns the next
/// generation, whose directory does not exist.
///
/// Generations before the current one are left alone: the one a switch replaced is removed
/// once its store is closed (and the switch durable), and a switch whose directory sync
/// failed may be undone by a crash, bringing that generation back as the current one.
/// [`repair`], at open, removes whatever is left.
pub(crate) fn next(dir: &Path) -> Result<u64, NodeError> {
    let g = current(dir)?;
    for (other, path) in backend_dirs(dir)? {
        if other > g {
            fs::remove_dir_all(&path).map_err(|e| NodeError::io(&path, "remove", e))?;
        }
    }
    Ok(g + 1)
}

/// The steps of [`switch`], in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Step {
    /// `CURRENT.tmp` written.
    WriteTmp,
    /// `CURRENT.tmp` synced.
    SyncTmp,
    /// `CURRENT.tmp` renamed to `CURRENT` (the commit point); the directory sync follows.
    Rename,
}

/// Makes `generation` (whose directory must hold a whole, synced backend) the current one.
/// `stop_after` ends early after that step, to test what a crash there leaves.
pub(crate) fn switch(
    dir: &Path,
    generation: u64,
    stop_after: Option<Step>,
) -> Result<(), NodeError> {
    let tmp = dir.join(CURRENT_TMP);
    let cur = dir.join(CURRENT);
    let mut f = File::create(&tmp).map_err(|e| NodeError::io(&tmp, "create", e))?;
    f.write_all(&encode(generation))
        .map_err(|e| NodeError::io(&tmp, "write", e))?;
    if stop_after == Some(Step::WriteTmp) {
        return Ok(());
    }
    f.sync_all().map_err(|e| NodeError::io(&tmp, "fsync", e))?;
    drop(f);
    if stop_after == Some(Step::SyncTmp) {
        return Ok(());
    }
    fs::rename(&tmp, &cur).map_err(|e| NodeError::io(&tmp, "rename", e))?;
    if stop_after == Some(Step::Rename) {
        return Ok(());
    }
    fsync_dir(dir)
}

/// Removes the directory of a generation that is not current: one replaced by a newer
/// generation, or an abandoned restore's.
pub(crate) fn remove(dir: &Path, generation: u64) {
    let path = backend_dir(dir, generation);
    if path.exists()
        && let Err(e) = fs::remove_dir_all(&path)
    {
        tracing::warn!(path = %path.display(), error = %e, "cannot remove a backend that is no longer used");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_round_trips_and_damage_is_detected() {
        for g in [0, 1, 7, u64::MAX] {
            assert_eq!(decode(&encode(g)).ok(), Some(g));
        }
        let b = encode(42);
        for i in 0..b.len() {
            let mut d = b;
            d[i] ^= 0x04;
            assert!(decode(&d).is_err(), "flip at {i}");
        }
        assert!(decode(&b[..16]).is_err());
    }

    #[test]
    fn directory_names_map_to_generations() {
        let d = Path::new("/x");
        for g in [0, 1, 12, 1 << 40] {
            let p = backend_dir(d, g);
            let name = p.file_name().and_then(|n| n.to_str()).expect("name");
            assert_eq!(generation_of(name), Some(g));
        }
        for bad in [
            "backend-",
            "backend-01",
            "backend-x",
            "backend.new",
            "backends",
            "wal",
        ] {
            assert_eq!(generation_of(bad), None, "{bad}");
        }
    }

    /// A crash after any step of a switch leaves one whole generation, old before the
    /// rename and new from it on; `next` and `repair` clear every other directory.
    #[test]
    fn a_crash_at_each_step_leaves_the_old_or_the_new_generation() {
        // (ran the switch, stopped after) — `(true, None)` is a whole switch.
        let steps = [
            (false, None),
            (true, Some(Step::WriteTmp)),
            (true, Some(Step::SyncTmp)),
            (true, Some(Step::Rename)),
            (true, None),
        ];
        for (run, stop) in steps {
            let root = tempfile::tempdir().expect("tempdir");
            let dir = root.path();
            let old = backend_dir(dir, 0);
            fs::create_dir_all(&old).expect("mkdir");
            fs::write(old.join("data"), b"old").expect("write");
            let g = next(dir).expect("next");
            assert_eq!(g, 1);
            let new = backend_dir(dir, g);
            fs::create_dir_all(&new).expect("mkdir");
            fs::write(new.join("data"), b"new").expect("write");
            if run {
                switch(dir, g, stop).expect("switch");
            }
            // "Crash": nothing after the step runs; open repairs.
            let cur = repair(dir).expect("repair");
            let dirs = backend_dirs(dir).expect("list");
            assert_eq!(
                dirs.len(),
                1,
                "step {stop:?}: one generation left: {dirs:?}"
            );
            let data = fs::read(backend_dir(dir, cur).join("data")).expect("read");
            let committed = run && stop.is_none_or(|s| s >= Step::Rename);
            let want: &[u8] = if committed { b"new" } else { b"old" };
            assert_eq!(data, want, "step {stop:?}");
            assert!(!dir.join(CURRENT_TMP).exists());
            // The next restore goes to a fresh directory past the current one.
            let n = next(dir).expect("next");
            assert_eq!(n, cur + 1);
            assert!(!backend_dir(dir, n).exists());
        }
    }

    /// `next` clears what abandoned restores left past the current generation, and never a
    /// generation before it: a switch whose directory sync failed may still be undone by a
    /// crash, and that generation would then be the current one again.
    #[test]
    fn next_keeps_generations_before_the_current_one() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path();
        for g in [1, 2, 3, 4] {
            fs::create_dir_all(backend_dir(dir, g)).expect("mkdir");
        }
        switch(dir, 2, None).expect("switch");
        assert_eq!(next(dir).expect("next"), 3);
        let mut left: Vec<u64> = backend_dirs(dir)
            .expect("list")
            .into_iter()
            .map(|(g, _)| g)
            .collect();
        left.sort_unstable();
        assert_eq!(left, [1, 2]);
    }
}
