//! Helpers shared by the test modules.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use keel_backend_file::{FileBackend, FileOptions};
use keel_mvcc::{Backend, Bucket, ReadTxn, WriteBatch};

/// Every pair of every bucket, read through one read transaction.
pub type Dump = BTreeMap<String, BTreeMap<Vec<u8>, Vec<u8>>>;

pub fn dump(b: &FileBackend) -> Dump {
    let txn = b.read_txn().expect("read txn");
    let mut out = Dump::new();
    for bucket in txn.buckets().expect("buckets") {
        let mut m = BTreeMap::new();
        for item in txn.range(&bucket, &[], None).expect("range") {
            let (k, v) = item.expect("item");
            m.insert(k.to_vec(), v.to_vec());
        }
        out.insert(bucket.name().to_owned(), m);
    }
    out
}

/// Options with small segments and no background thread, for deterministic tests.
pub fn small() -> FileOptions {
    FileOptions {
        segment_size: 64 << 10,
        background_reclaim: false,
        prepare_ahead: false,
        reclaim_min_garbage: 0,
        ..FileOptions::default()
    }
}

pub fn open(dir: &Path, options: &FileOptions) -> FileBackend {
    FileBackend::open(dir, options).expect("open")
}

pub const B: Bucket = Bucket::new("key");
pub const META_B: Bucket = Bucket::new("meta");

/// A short description of a dump for failure messages: keys per bucket and the `meta/n` value.
pub fn summary(d: &Dump) -> String {
    let counts: Vec<String> = d
        .iter()
        .map(|(b, m)| format!("{b}: {} keys", m.len()))
        .collect();
    let n = d.get("meta").and_then(|m| m.get(&b"n"[..])).cloned();
    format!("[{}] n={n:?}", counts.join(", "))
}

/// The segment files (`*.seg`) in `dir`, in name order (which is segment order).
pub fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "seg"))
        .collect();
    v.sort();
    v
}

/// A snapshot stream of a store holding `pairs` pairs of `value_len`-byte values in [`B`]
/// (keys `k` and the number in 8 digits, values starting with the number, big-endian), and
/// their count in [`META_B`].
pub fn stream(pairs: u32, value_len: usize) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), &FileOptions::default()).unwrap();
    let mut batch = WriteBatch::new();
    for i in 0..pairs {
        let mut v = i.to_be_bytes().to_vec();
        v.resize(value_len, (i % 251) as u8);
        batch.put(&B, format!("k{i:08}").into_bytes(), v);
    }
    batch.put(&META_B, b"pairs".to_vec(), pairs.to_be_bytes().to_vec());
    b.commit(&batch).unwrap();
    let mut out = Vec::new();
    b.snapshot(&mut out).unwrap();
    out
}
