//! Opening a store: leftovers of an interrupted defragment are removed, and a damaged data
//! file is a typed error (never an empty store in its place, never a fault).

use std::fs;

use keel_backend_lmdb::LmdbOptions;
use keel_mvcc::{Backend, BackendError, Bucket, WriteBatch};

use crate::common::{data_file, dump_backend, generations, open};

fn populated(path: &std::path::Path) -> crate::common::Dump {
    let backend = open(path, &LmdbOptions::default());
    let mut batch = WriteBatch::new();
    for i in 0..300u32 {
        batch.put(&Bucket::new("kv"), format!("k{i:04}"), vec![i as u8; 3000]);
    }
    backend.commit(&batch).unwrap();
    dump_backend(&backend)
}

#[test]
fn leftover_generations_are_removed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let expected = populated(&path);
    // An unfinished copy: deleted on open, the live generation untouched.
    let tmp = path.join("gen-0000000000000002.tmp");
    fs::create_dir(&tmp).unwrap();
    fs::write(tmp.join("data.mdb"), b"half a copy").unwrap();
    let backend = open(&path, &LmdbOptions::default());
    assert_eq!(generations(&path), vec!["gen-0000000000000001"]);
    assert_eq!(dump_backend(&backend), expected);
    backend.defragment().unwrap();
    assert_eq!(generations(&path), vec!["gen-0000000000000002"]);
    drop(backend);

    // A crash right after a swap leaves the superseded generation: the newer one wins.
    let stale = path.join("gen-0000000000000001");
    fs::create_dir(&stale).unwrap();
    fs::write(stale.join("data.mdb"), vec![0u8; 8192]).unwrap();
    let backend = open(&path, &LmdbOptions::default());
    assert_eq!(generations(&path), vec!["gen-0000000000000002"]);
    assert_eq!(dump_backend(&backend), expected);
}

#[test]
fn missing_or_empty_data_file_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    populated(&path);
    let data = data_file(&path);
    fs::write(&data, b"").unwrap();
    match keel_backend_lmdb::LmdbBackend::open(&path, &LmdbOptions::default()) {
        Err(BackendError::Corrupt { path: p, .. }) => assert_eq!(p, data),
        other => panic!("an empty data file opened as {other:?}"),
    }
    fs::remove_file(&data).unwrap();
    assert!(matches!(
        keel_backend_lmdb::LmdbBackend::open(&path, &LmdbOptions::default()),
        Err(BackendError::Corrupt { .. })
    ));
}

#[test]
fn truncated_data_file_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    populated(&path);
    let data = data_file(&path);
    let len = fs::metadata(&data).unwrap().len();
    for cut in [len - 4096, len / 2, 3 * 4096] {
        let file = fs::OpenOptions::new().write(true).open(&data).unwrap();
        file.set_len(cut).unwrap();
        drop(file);
        match keel_backend_lmdb::LmdbBackend::open(&path, &LmdbOptions::default()) {
            Err(e @ BackendError::Corrupt { .. }) => {
                assert!(e.to_string().contains("truncated"), "{e}")
            }
            other => panic!("a data file cut to {cut} of {len} bytes opened as {other:?}"),
        }
    }
}

#[test]
fn garbage_header_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    populated(&path);
    let data = data_file(&path);
    let mut bytes = fs::read(&data).unwrap();
    for b in &mut bytes[..8192] {
        *b = 0xA5;
    }
    fs::write(&data, &bytes).unwrap();
    match keel_backend_lmdb::LmdbBackend::open(&path, &LmdbOptions::default()) {
        Err(BackendError::Corrupt { reason, .. }) => assert!(!reason.is_empty()),
        other => panic!("a data file with garbage meta pages opened as {other:?}"),
    }
}
