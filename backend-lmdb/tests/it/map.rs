//! The map size: a full map is a clear error that changes nothing, and `grow_map` lets the
//! same batch commit, in place or by copy while readers hold the old map; key size limits and
//! reader slots give typed errors.

use keel_backend_lmdb::{LmdbBackend, LmdbError, LmdbOptions};
use keel_mvcc::{Backend, BackendError, Bucket, ReadTxn, WriteBatch};

use crate::common::{dump, dump_backend, generations, open};

const KV: Bucket = Bucket::new("kv");

fn small() -> LmdbOptions {
    LmdbOptions {
        map_size: 1 << 20,
        ..LmdbOptions::default()
    }
}

/// Commits 32 KiB values until the map is full; returns the batch that did not fit.
fn fill(backend: &LmdbBackend) -> (WriteBatch, u32) {
    for i in 0..1000u32 {
        let mut batch = WriteBatch::new();
        for j in 0..4u32 {
            batch.put(&KV, format!("k{i:05}-{j}"), vec![i as u8; 32 << 10]);
        }
        match backend.commit(&batch) {
            Ok(()) => {}
            Err(BackendError::Full { used, limit }) => {
                assert_eq!(limit, 1 << 20, "Full reports the wrong limit");
                assert!(
                    used <= limit && used > limit / 2,
                    "Full reports used={used}"
                );
                let err = BackendError::Full { used, limit };
                let text = err.to_string();
                assert!(
                    text.contains("full") && text.contains(&limit.to_string()),
                    "unreadable message: {text}"
                );
                return (batch, i);
            }
            Err(other) => panic!("commit {i} failed with {other:?} instead of Full"),
        }
    }
    panic!("a 1 MiB map never filled up");
}

#[test]
fn full_map_is_reported_and_grown_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let backend = open(&path, &small());
    let before_fill = dump_backend(&backend);
    assert!(before_fill.is_empty());
    let (batch, fitted) = fill(&backend);
    assert!(fitted > 0, "not even one batch fitted");
    let before = dump_backend(&backend);
    // Full again: the failed batch changed nothing and did not poison the backend.
    assert!(matches!(
        backend.commit(&batch),
        Err(BackendError::Full { .. })
    ));
    assert_eq!(
        dump_backend(&backend),
        before,
        "a batch that did not fit left changes"
    );
    let mut tiny = WriteBatch::new();
    tiny.delete(&KV, "k00000-0");
    backend
        .commit(&tiny)
        .expect("a full map still accepts a delete");

    backend.grow_map(8 << 20).expect("grow in place");
    assert_eq!(backend.map_size(), 8 << 20);
    assert_eq!(
        generations(&path).len(),
        1,
        "growing with no reader should not copy"
    );
    backend
        .commit(&batch)
        .expect("the batch fits after growing");
    let after = dump_backend(&backend);
    assert_eq!(after["kv"].len(), before["kv"].len() - 1 + 4);
    drop(backend);

    // Reopened with the larger map, everything is there.
    let big = LmdbOptions {
        map_size: 8 << 20,
        ..LmdbOptions::default()
    };
    let backend = open(&path, &big);
    assert_eq!(dump_backend(&backend), after);
}

#[test]
fn grow_map_with_readers_copies_and_keeps_their_view() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let backend = open(&path, &small());
    let (batch, _) = fill(&backend);
    let reader = backend.read_txn().unwrap();
    let view = dump(&reader);
    let moved = std::thread::spawn({
        let txn = backend.read_txn().unwrap();
        move || txn
    })
    .join()
    .unwrap();

    backend.grow_map(4 << 20).expect("grow with readers open");
    assert_eq!(backend.map_size(), 4 << 20);
    assert_eq!(
        generations(&path),
        vec!["gen-0000000000000001", "gen-0000000000000002"],
        "the old generation must stay while its readers live"
    );
    backend
        .commit(&batch)
        .expect("the batch fits after growing");
    assert_eq!(dump(&reader), view, "an old reader's view changed");
    assert_eq!(dump(&moved), view);
    drop(reader);
    drop(moved);
    assert_eq!(
        generations(&path),
        vec!["gen-0000000000000002"],
        "the old generation outlived its last reader"
    );
    let mut expect = view;
    for op in batch.ops() {
        if let keel_mvcc::BatchOp::Put { key, value, .. } = op {
            expect
                .get_mut("kv")
                .unwrap()
                .insert(key.clone(), value.clone());
        }
    }
    assert_eq!(dump_backend(&backend), expect);
}

#[test]
fn grow_map_refuses_to_shrink() {
    let dir = tempfile::tempdir().unwrap();
    let options = LmdbOptions {
        map_size: 2 << 20,
        ..LmdbOptions::default()
    };
    let backend = open(&dir.path().join("s"), &options);
    match backend.grow_map(1 << 20) {
        Err(BackendError::InvalidOption(msg)) => assert!(msg.contains("grow"), "{msg}"),
        other => panic!("shrinking returned {other:?}"),
    }
    backend.grow_map(2 << 20).expect("same size is a no-op");
    assert_eq!(backend.map_size(), 2 << 20);
}

#[test]
fn options_are_validated() {
    assert_eq!(LmdbOptions::default().map_size, 8 << 30);
    assert_eq!(LmdbOptions::default().max_readers, 1024);
    assert!(LmdbOptions::default().sync_on_commit);
    LmdbOptions::default().validate().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for bad in [
        LmdbOptions {
            map_size: 0,
            ..LmdbOptions::default()
        },
        LmdbOptions {
            max_readers: 0,
            ..LmdbOptions::default()
        },
        LmdbOptions {
            map_size: u64::MAX,
            ..LmdbOptions::default()
        },
    ] {
        match LmdbBackend::open(&dir.path().join("s"), &bad) {
            Err(BackendError::InvalidOption(msg)) => assert!(!msg.is_empty()),
            other => panic!("{bad:?} opened: {other:?}"),
        }
    }
}

#[test]
fn oversized_keys_are_refused_and_long_bounds_work() {
    let dir = tempfile::tempdir().unwrap();
    let backend = open(&dir.path().join("s"), &LmdbOptions::default());
    let mut batch = WriteBatch::new();
    batch.put(&KV, vec![b'a'; 510], "longest");
    batch.put(&KV, "b", "short");
    backend.commit(&batch).expect("a 510-byte key fits");
    let before = dump_backend(&backend);

    let mut batch = WriteBatch::new();
    batch.put(&KV, "c", "new");
    batch.put(&KV, vec![b'a'; 511], "too long");
    match backend.commit(&batch) {
        Err(BackendError::TooLarge { what, len, limit }) => {
            assert_eq!((what, len, limit), ("key", 511, 510));
        }
        other => panic!("an oversized key returned {other:?}"),
    }
    assert_eq!(
        dump_backend(&backend),
        before,
        "a refused batch left changes"
    );

    let txn = backend.read_txn().unwrap();
    assert_eq!(txn.get(&KV, &[b'a'; 600]).unwrap(), None);
    let long_start: Vec<(Vec<u8>, Vec<u8>)> = txn
        .range(&KV, &[b'a'; 600], None)
        .unwrap()
        .map(|i| i.map(|(k, v)| (k.to_vec(), v.to_vec())).unwrap())
        .collect();
    assert_eq!(long_start, vec![(b"b".to_vec(), b"short".to_vec())]);
    let long_end = txn
        .range(&KV, b"", Some(&[b'a'; 600]))
        .unwrap()
        .map(|i| i.unwrap().0.len())
        .collect::<Vec<_>>();
    assert_eq!(long_end, vec![510]);
    drop(txn);

    let mut batch = WriteBatch::new();
    batch.delete(&KV, vec![b'a'; 600]);
    batch.delete_range(&KV, vec![b'a'; 508], Some(vec![b'a'; 700]));
    backend.commit(&batch).unwrap();
    let txn = backend.read_txn().unwrap();
    assert_eq!(txn.get(&KV, &[b'a'; 508]).unwrap(), None);
    assert_eq!(txn.get(&KV, b"b").unwrap(), Some(&b"short"[..]));
}

#[test]
fn reader_slots_running_out_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    let options = LmdbOptions {
        max_readers: 4,
        ..LmdbOptions::default()
    };
    let backend = open(&dir.path().join("s"), &options);
    let mut held = Vec::new();
    let err = loop {
        match backend.read_txn() {
            Ok(txn) => held.push(txn),
            Err(e) => break e,
        }
        assert!(held.len() <= 4, "more read transactions than reader slots");
    };
    assert_eq!(held.len(), 4);
    match &err {
        BackendError::Other(inner) => {
            let inner = inner
                .downcast_ref::<LmdbError>()
                .expect("an LmdbError inside");
            assert!(matches!(
                inner,
                LmdbError::ReadersFull { max_readers: 4, .. }
            ));
            assert!(err.to_string().contains("reader slots"), "{err}");
        }
        other => panic!("running out of reader slots returned {other:?}"),
    }
    // Commits still work with every slot taken; a slot frees when a transaction drops.
    let mut batch = WriteBatch::new();
    batch.put(&KV, "k", "v");
    backend.commit(&batch).unwrap();
    held.pop();
    let txn = backend.read_txn().expect("a freed slot is reused");
    assert_eq!(txn.get(&KV, b"k").unwrap(), Some(&b"v"[..]));
}

/// Reopened with a map smaller than its data, a store runs on the larger map LMDB keeps (it
/// never maps less than the data): the backend reports that map, a full map reports figures
/// that agree (used within the limit), and growing past it lets the next batch commit.
#[test]
fn reopening_with_a_map_smaller_than_the_data_reports_the_map_in_use() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let big = LmdbOptions {
        map_size: 4 << 20,
        ..LmdbOptions::default()
    };
    let backend = open(&path, &big);
    for i in 0..20u32 {
        let mut batch = WriteBatch::new();
        for j in 0..4u32 {
            batch.put(&KV, format!("k{i:05}-{j}"), vec![i as u8; 32 << 10]);
        }
        backend.commit(&batch).unwrap();
    }
    drop(backend);
    let data = std::fs::metadata(crate::common::data_file(&path))
        .unwrap()
        .len();
    assert!(data > 2 << 20, "only {data} bytes of data");

    let backend = open(&path, &small());
    assert!(
        backend.map_size() >= data,
        "the backend reports a map of {} bytes over {data} bytes of data",
        backend.map_size()
    );
    let mut batch = WriteBatch::new();
    for j in 0..64u32 {
        batch.put(&KV, format!("more-{j}"), vec![7u8; 32 << 10]);
    }
    match backend.commit(&batch) {
        Err(BackendError::Full { used, limit }) => {
            assert!(used <= limit, "Full reports {used} bytes used of {limit}");
            assert_eq!(limit, backend.map_size());
        }
        other => panic!("a batch larger than the map returned {other:?}"),
    }
    backend
        .grow_map(backend.map_size() + (4 << 20))
        .expect("grow");
    backend
        .commit(&batch)
        .expect("the batch fits after growing");
}
