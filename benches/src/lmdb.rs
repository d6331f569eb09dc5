//! LMDB on both sides of a comparison: keel's LMDB backend and raw LMDB through heed
//! ([`RawLmdb`]), opened with the same map size, sync mode and environment flags.

use std::path::Path;

use keel_backend_lmdb::{LmdbBackend, LmdbOptions, RawLmdb};

/// Backend options with `map_size` bytes of map and `sync` deciding `fdatasync` per commit,
/// the other fields at their defaults (so `write_map` off, as a store opens by default).
pub fn options(map_size: u64, sync: bool) -> LmdbOptions {
    LmdbOptions {
        map_size,
        sync_on_commit: sync,
        ..LmdbOptions::default()
    }
}

/// [`options`] with `write_map` set.
pub fn options_with_write_map(map_size: u64, sync: bool, write_map: bool) -> LmdbOptions {
    LmdbOptions {
        write_map,
        ..options(map_size, sync)
    }
}

/// keel's LMDB backend in `dir`.
pub fn backend(dir: &Path, map_size: u64, sync: bool) -> LmdbBackend {
    backend_with(dir, &options(map_size, sync))
}

/// keel's LMDB backend in `dir` opened with `options`.
pub fn backend_with(dir: &Path, options: &LmdbOptions) -> LmdbBackend {
    use keel_mvcc::Backend as _;
    LmdbBackend::open(dir, options).expect("open LMDB backend")
}

/// Raw LMDB in `dir`, configured as [`backend`] configures the backend.
pub fn raw(dir: &Path, map_size: u64, sync: bool) -> RawLmdb {
    raw_with(dir, &options(map_size, sync))
}

/// Raw LMDB in `dir` opened with the environment settings of `options`.
pub fn raw_with(dir: &Path, options: &LmdbOptions) -> RawLmdb {
    RawLmdb::open(dir, options).expect("open raw LMDB")
}
