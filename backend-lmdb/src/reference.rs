//! Raw LMDB opened the way [`LmdbBackend`](crate::LmdbBackend) opens it, for benchmarks that
//! compare keel with the engine under it in the same run.
//!
//! The environment lives in `dir/raw/` under the same exclusive directory lock and the same
//! open path (`MDB_NOTLS`, `MDB_NOSYNC` exactly when `sync_on_commit` is off, `MDB_WRITEMAP`
//! exactly when `write_map` is on) as the
//! backend, with only LMDB's unnamed database (the backend has one named database per
//! bucket), so the two differ only in what keel adds on top.

use std::path::Path;

use heed::types::Bytes;
use heed::{Database, Env, WithoutTls};
use keel_mvcc::BackendError;

use crate::LmdbOptions;
use crate::env::{DirLock, open_env};
use crate::error::from_heed;

/// A raw LMDB environment and its unnamed database, holding the directory's lock.
pub struct RawLmdb {
    /// The environment.
    pub env: Env<WithoutTls>,
    /// Its one unnamed database.
    pub db: Database<Bytes, Bytes>,
    _lock: DirLock,
}

impl RawLmdb {
    /// Opens (creating if absent) a raw LMDB environment in `dir` with the map size, reader
    /// limit, sync mode and write mode (`write_map`) of `options`.
    ///
    /// Fails with [`BackendError::Locked`] while another handle (raw or backend) holds `dir`.
    pub fn open(dir: &Path, options: &LmdbOptions) -> Result<RawLmdb, BackendError> {
        options.validate()?;
        let lock = DirLock::acquire(dir)?;
        let raw = dir.join("raw");
        std::fs::create_dir_all(&raw).map_err(|e| BackendError::io(&raw, "create directory", e))?;
        let map_size = options.rounded_map_size();
        // SAFETY: `open_env`'s contract holds: `lock` is the exclusive lock of `dir` and `raw`
        // lies inside it, so no other handle in any process opens this environment while the
        // returned one lives (`RawLmdb` owns the lock for as long as it owns the environment);
        // `dir` is where the caller keeps keel stores, which `LmdbBackend` requires to be on a
        // local file system; only LMDB writes the files.
        let env = unsafe { open_env(&raw, map_size, options, false) }?;
        let mut wtxn = env
            .write_txn()
            .map_err(|e| from_heed(&raw, "begin write transaction", e))?;
        let db = env
            .create_database(&mut wtxn, None)
            .map_err(|e| from_heed(&raw, "open database", e))?;
        wtxn.commit().map_err(|e| from_heed(&raw, "commit", e))?;
        Ok(RawLmdb {
            env,
            db,
            _lock: lock,
        })
    }
}
