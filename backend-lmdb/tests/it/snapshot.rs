//! Read transactions opened one after another never go back in time, even when LMDB's
//! read-begin race (a reader preempted between reading the last transaction id and copying
//! its meta page) is hit: each snapshot is exactly the commit its id names.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use keel_backend_lmdb::{LmdbBackend, LmdbOptions};
use keel_mvcc::{Backend, Bucket, ReadTxn, WriteBatch};

const LEFT: Bucket = Bucket::new("left");
const RIGHT: Bucket = Bucket::new("right");

fn epoch_of(txn: &keel_backend_lmdb::LmdbReadTxn) -> u64 {
    let v = txn.get(&RIGHT, b"epoch").unwrap().expect("epoch key");
    u64::from_be_bytes(v.try_into().expect("8 bytes"))
}

#[test]
fn successive_read_transactions_are_monotonic() {
    // With fsync on, the new meta page is visible for the whole flush of its write before
    // the transaction id is published: the window in which the race shows.
    let options = LmdbOptions::default();
    for round in 0..4 {
        let dir = tempfile::tempdir().unwrap();
        let backend = Arc::new(LmdbBackend::open(&dir.path().join("s"), &options).unwrap());
        let mut batch = WriteBatch::new();
        for i in 0..50u32 {
            batch.put(&LEFT, format!("key-{i:06}"), 0u64.to_be_bytes());
        }
        batch.put(&RIGHT, "epoch", 0u64.to_be_bytes());
        backend.commit(&batch).unwrap();
        let base = backend.read_txn().unwrap().commit_id();
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..3)
            .map(|r| {
                let (backend, stop) = (Arc::clone(&backend), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let (mut last, mut checks) = (0u64, 0u64);
                    while !stop.load(Ordering::Relaxed) {
                        let txn = backend.read_txn().unwrap();
                        let rows = txn.range(&LEFT, b"", None).unwrap().count();
                        let epoch = epoch_of(&txn);
                        assert_eq!(rows, 50, "round {round} reader {r}");
                        assert!(
                            epoch >= last,
                            "round {round} reader {r}: epoch {epoch} after {last}"
                        );
                        assert_eq!(
                            txn.commit_id() - base,
                            epoch as usize,
                            "round {round} reader {r}: snapshot is not its commit"
                        );
                        last = epoch;
                        checks += 1;
                    }
                    checks
                })
            })
            .collect();
        for epoch in 1..=500u64 {
            let mut batch = WriteBatch::new();
            batch.put(&LEFT, format!("key-{:06}", epoch % 50), epoch.to_be_bytes());
            batch.put(&RIGHT, "epoch", epoch.to_be_bytes());
            backend.commit(&batch).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            assert!(r.join().expect("reader panicked") > 0);
        }
    }
}
