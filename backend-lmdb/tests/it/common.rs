//! Helpers shared by the LMDB test modules.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keel_backend_lmdb::{LmdbBackend, LmdbOptions};
use keel_mvcc::{Backend, ReadTxn};

/// Everything a backend holds: bucket → key → value.
pub type Dump = BTreeMap<String, BTreeMap<Vec<u8>, Vec<u8>>>;

pub fn dump<T: ReadTxn>(txn: &T) -> Dump {
    let mut out = Dump::new();
    for bucket in txn.buckets().expect("buckets") {
        let pairs = txn
            .range(&bucket, b"", None)
            .expect("range")
            .map(|item| {
                let (k, v) = item.expect("range item");
                (k.to_vec(), v.to_vec())
            })
            .collect();
        out.insert(bucket.name().to_owned(), pairs);
    }
    out
}

pub fn dump_backend(backend: &LmdbBackend) -> Dump {
    dump(&backend.read_txn().expect("read txn"))
}

pub fn open(path: &Path, options: &LmdbOptions) -> LmdbBackend {
    LmdbBackend::open(path, options).unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

/// Names of the generation directories (complete and temporary) in a store.
pub fn generations(path: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(path)
        .expect("read store dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("gen-"))
        .collect();
    names.sort();
    names
}

/// Path of the live generation's data file.
pub fn data_file(path: &Path) -> PathBuf {
    let gens = generations(path);
    let live = gens.last().expect("a generation");
    path.join(live).join("data.mdb")
}
