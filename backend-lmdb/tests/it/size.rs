//! The sizes a store reports: `size` reads them without a reader slot, so it answers the same
//! with every slot held by open read transactions as with none.

use keel_backend_lmdb::{LmdbError, LmdbOptions};
use keel_mvcc::{Backend, BackendError, Bucket, WriteBatch};

use crate::common::open;

const KV: Bucket = Bucket::new("kv");

/// With all reader slots held, `size` still answers, with the figures it gives with none held
/// (a store with free pages, after deletes, so that the bytes in use are below the bytes on
/// disk); and a read transaction is still refused, so the slots were all taken.
#[test]
fn size_needs_no_reader_slot() {
    let dir = tempfile::tempdir().unwrap();
    let options = LmdbOptions {
        max_readers: 4,
        ..LmdbOptions::default()
    };
    let backend = open(&dir.path().join("s"), &options);
    for chunk in 0..8u32 {
        let mut batch = WriteBatch::new();
        for i in chunk * 500..(chunk + 1) * 500 {
            batch.put(&KV, i.to_be_bytes(), vec![i as u8; 200]);
            batch.put(&Bucket::new("meta"), i.to_be_bytes(), "m");
        }
        backend.commit(&batch).unwrap();
    }
    let mut batch = WriteBatch::new();
    batch.delete_range(
        &KV,
        0u32.to_be_bytes(),
        Some(3000u32.to_be_bytes().to_vec()),
    );
    backend.commit(&batch).unwrap();
    let free = backend.size().expect("size with no reader open");
    assert!(
        free.in_use < free.on_disk && free.in_use > 1000 * 200,
        "in use {} bytes of {} on disk",
        free.in_use,
        free.on_disk
    );

    let mut held = Vec::new();
    let err = loop {
        match backend.read_txn() {
            Ok(txn) => held.push(txn),
            Err(e) => break e,
        }
        assert!(held.len() <= 4, "more read transactions than reader slots");
    };
    match &err {
        BackendError::Other(inner) => assert!(
            matches!(
                inner.downcast_ref::<LmdbError>(),
                Some(LmdbError::ReadersFull { .. })
            ),
            "{err}"
        ),
        other => panic!("running out of reader slots returned {other:?}"),
    }
    let full = backend
        .size()
        .unwrap_or_else(|e| panic!("size with every reader slot held: {e}"));
    assert_eq!(full, free, "size differs with every reader slot held");

    drop(held);
    assert_eq!(backend.size().expect("size after the readers"), free);
}
