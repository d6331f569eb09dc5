//! One LMDB database per bucket: buckets created while readers open transactions are seen by
//! every reader that began after the commit creating them, the bucket limit refuses a batch
//! whole, and a revision-like bucket followed by other buckets keeps its pages full.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use keel_backend_lmdb::{LmdbError, LmdbOptions};
use keel_mvcc::{Backend, BackendError, Bucket, ReadTxn, WriteBatch};

use crate::common::{dump_backend, open};

fn bucket(i: u64) -> Bucket {
    Bucket::from_name(format!("b{i:04}")).unwrap()
}

#[test]
fn readers_opened_after_a_bucket_commit_see_the_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let options = LmdbOptions {
        sync_on_commit: false,
        max_buckets: 512,
        ..LmdbOptions::default()
    };
    let backend = Arc::new(open(&dir.path().join("s"), &options));
    // Number of buckets whose creating commit has returned.
    let created = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (backend, created, stop) = (backend.clone(), created.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut checks = 0u64;
                while !stop.load(Ordering::Acquire) {
                    let acknowledged = created.load(Ordering::Acquire);
                    let txn = backend.read_txn().expect("read txn");
                    let listed = txn.buckets().expect("buckets");
                    assert!(
                        listed.len() as u64 >= acknowledged,
                        "a reader lists {} buckets, {acknowledged} were committed before it began",
                        listed.len()
                    );
                    for i in 0..acknowledged {
                        assert_eq!(
                            txn.get(&bucket(i), b"k").expect("get").map(<[u8]>::to_vec),
                            Some(i.to_be_bytes().to_vec()),
                            "bucket {i}, committed before the reader began, is missing"
                        );
                    }
                    checks += 1;
                }
                checks
            })
        })
        .collect();
    for i in 0..300u64 {
        let mut batch = WriteBatch::new();
        batch.put(&bucket(i), "k", i.to_be_bytes().to_vec());
        batch.put(&Bucket::new("other"), i.to_be_bytes().to_vec(), "v");
        backend.commit(&batch).expect("commit");
        created.store(i + 1, Ordering::Release);
    }
    stop.store(true, Ordering::Release);
    let checks: u64 = readers.into_iter().map(|r| r.join().expect("reader")).sum();
    assert!(checks > 0, "the readers checked nothing");
    let all = dump_backend(&backend);
    assert_eq!(all.len(), 301);
    drop(backend);
    let reopened = open(&dir.path().join("s"), &options);
    assert_eq!(dump_backend(&reopened), all, "reopen lost buckets");
}

#[test]
fn bucket_limit_refuses_the_whole_batch() {
    let dir = tempfile::tempdir().unwrap();
    let options = LmdbOptions {
        max_buckets: 3,
        ..LmdbOptions::default()
    };
    let backend = open(&dir.path().join("s"), &options);
    let mut batch = WriteBatch::new();
    for i in 0..3 {
        batch.put(&bucket(i), "k", "v");
    }
    backend.commit(&batch).expect("three buckets fit");
    let before = dump_backend(&backend);
    let mut batch = WriteBatch::new();
    batch.put(&bucket(0), "k", "changed");
    batch.put(&bucket(3), "k", "v");
    match backend.commit(&batch) {
        Err(BackendError::Other(e)) => match e.downcast_ref::<LmdbError>() {
            Some(LmdbError::TooManyBuckets {
                bucket,
                max_buckets,
                ..
            }) => {
                assert_eq!((bucket.as_str(), *max_buckets), ("b0003", 3));
            }
            other => panic!("a fourth bucket returned {other:?}"),
        },
        other => panic!("a fourth bucket returned {other:?}"),
    }
    assert_eq!(
        dump_backend(&backend),
        before,
        "a refused batch left changes"
    );
    // The backend is not poisoned: the existing buckets still take writes.
    let mut batch = WriteBatch::new();
    batch.put(&bucket(1), "k2", "v2");
    backend
        .commit(&batch)
        .expect("commit to an existing bucket");
}

#[test]
fn ascending_keys_before_other_buckets_fill_their_pages() {
    let dir = tempfile::tempdir().unwrap();
    let options = LmdbOptions {
        sync_on_commit: false,
        ..LmdbOptions::default()
    };
    let backend = open(&dir.path().join("s"), &options);
    // "key" sorts before "meta": in one shared tree, the revision-like keys would be inserted
    // just before the meta key and every page split would happen in the middle.
    let mut batch = WriteBatch::new();
    batch.put(&Bucket::new("meta"), "format", "1");
    backend.commit(&batch).expect("commit");
    let (pairs, value) = (20_000u64, [7u8; 150]);
    for chunk in 0..20u64 {
        let mut batch = WriteBatch::new();
        for i in chunk * 1_000..(chunk + 1) * 1_000 {
            batch.put(
                &Bucket::new("key"),
                i.to_be_bytes().to_vec(),
                value.to_vec(),
            );
        }
        backend.commit(&batch).expect("commit");
    }
    let in_use = backend.size().expect("size").in_use;
    let payload = pairs * (8 + 1 + 150 + 8 + 2);
    assert!(
        in_use < payload * 13 / 10,
        "{in_use} bytes of pages for {payload} bytes of nodes: pages are not kept full"
    );
}
