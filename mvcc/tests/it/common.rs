//! Helpers shared by the integration tests: stores over `MemBackend` in fresh directories.

use std::path::{Path, PathBuf};

use keel_mvcc::testing::{MemBackend, MemOptions};
use keel_mvcc::{Backend, Store, StoreOptions};

/// A unique path for a `MemBackend` (nothing is written to it).
pub fn fresh_path() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("mem");
    (dir, path)
}

pub fn open_at(path: &Path, options: StoreOptions) -> Store<MemBackend> {
    let backend = MemBackend::open(path, &MemOptions::default()).expect("open backend");
    Store::open(backend, options).expect("open store")
}

/// A store over a fresh in-memory backend; keep the guard alive as long as the store.
pub fn store() -> (tempfile::TempDir, PathBuf, Store<MemBackend>) {
    let (dir, path) = fresh_path();
    let s = open_at(&path, StoreOptions::default());
    (dir, path, s)
}

pub fn get(store: &Store<MemBackend>, key: &[u8]) -> Option<Vec<u8>> {
    let resp = store
        .range(&keel_mvcc::RangeRequest::key(key.to_vec()))
        .expect("range");
    resp.kvs.into_iter().next().map(|kv| kv.value().to_vec())
}
