//! LMDB on both sides of a comparison: keel's LMDB backend and raw LMDB through heed
//! ([`RawLmdb`]), opened with the same map size and sync mode.

use std::path::Path;

use keel_backend_lmdb::{LmdbBackend, LmdbOptions, RawLmdb};

/// Backend options with `map_size` bytes of map and `sync` deciding `fdatasync` per commit.
pub fn options(map_size: u64, sync: bool) -> LmdbOptions {
    LmdbOptions {
        map_size,
        sync_on_commit: sync,
        ..LmdbOptions::default()
    }
}

/// keel's LMDB backend in `dir`.
pub fn backend(dir: &Path, map_size: u64, sync: bool) -> LmdbBackend {
    use keel_mvcc::Backend as _;
    LmdbBackend::open(dir, &options(map_size, sync)).expect("open LMDB backend")
}

/// Raw LMDB in `dir`, configured as [`backend`] configures the backend.
pub fn raw(dir: &Path, map_size: u64, sync: bool) -> RawLmdb {
    RawLmdb::open(dir, &options(map_size, sync)).expect("open raw LMDB")
}
