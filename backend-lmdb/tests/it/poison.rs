//! A commit that fails at its durability point poisons the backend: later commits, and every
//! other call that writes, are refused with `Poisoned`, committed data stays readable, and a
//! reopen recovers. Without fsync on commit, `sync` flushes.

use keel_backend_lmdb::LmdbOptions;
use keel_mvcc::{Backend, BackendError, Bucket, WriteBatch};

use crate::common::{dump_backend, generations, open};

#[test]
fn failed_commit_poisons_until_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let kv = Bucket::new("kv");
    let backend = open(&path, &LmdbOptions::default());
    let mut batch = WriteBatch::new();
    batch.put(&kv, "a", "1");
    backend.commit(&batch).unwrap();
    let before = dump_backend(&backend);

    backend.fail_next_commit();
    let mut failing = WriteBatch::new();
    failing.put(&kv, "b", "2");
    match backend.commit(&failing) {
        Err(BackendError::Io { op, .. }) => assert_eq!(op, "commit"),
        other => panic!("the injected failure returned {other:?}"),
    }
    for attempt in 0..2 {
        match backend.commit(&failing) {
            Err(e @ BackendError::Poisoned { .. }) => {
                let text = e.to_string();
                assert!(
                    text.contains("poisoned") && text.contains("injected"),
                    "attempt {attempt}: {text}"
                );
            }
            other => panic!("a commit after the failure returned {other:?}"),
        }
    }
    assert!(matches!(
        backend.defragment(),
        Err(BackendError::Poisoned { .. })
    ));
    assert!(matches!(backend.sync(), Err(BackendError::Poisoned { .. })));
    assert_eq!(
        dump_backend(&backend),
        before,
        "committed data unreadable or changed"
    );
    drop(backend);

    let backend = open(&path, &LmdbOptions::default());
    assert_eq!(dump_backend(&backend), before);
    backend
        .commit(&failing)
        .expect("a reopened backend commits");
    assert_eq!(dump_backend(&backend)["kv"].len(), 2);
}

#[test]
fn unsynced_commits_are_flushed_by_sync() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let options = LmdbOptions {
        sync_on_commit: false,
        ..LmdbOptions::default()
    };
    let kv = Bucket::new("kv");
    let backend = open(&path, &options);
    for i in 0..100u32 {
        let mut batch = WriteBatch::new();
        batch.put(&kv, i.to_be_bytes(), i.to_le_bytes());
        backend.commit(&batch).unwrap();
    }
    backend.sync().expect("sync");
    let before = dump_backend(&backend);
    assert_eq!(before["kv"].len(), 100);
    drop(backend);
    let backend = open(&path, &LmdbOptions::default());
    assert_eq!(dump_backend(&backend), before);
}

/// Once poisoned, the backend refuses every call that writes, map growth included (in
/// place with no reader open, by copy with one open, to the same size, and to a smaller one),
/// and none of them changes the map, the generations or the data. A store whose last commit
/// failed is in an unknown state on disk: only a reopen recovers it.
#[test]
fn a_poisoned_backend_refuses_every_write() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let options = LmdbOptions {
        map_size: 1 << 20,
        ..LmdbOptions::default()
    };
    let kv = Bucket::new("kv");
    let backend = open(&path, &options);
    let mut batch = WriteBatch::new();
    batch.put(&kv, "a", "1");
    backend.commit(&batch).unwrap();
    let mut stream = Vec::new();
    backend.snapshot(&mut stream).unwrap();
    backend.fail_next_commit();
    let mut failing = WriteBatch::new();
    failing.put(&kv, "b", "2");
    assert!(matches!(
        backend.commit(&failing),
        Err(BackendError::Io { .. })
    ));
    let before = dump_backend(&backend);
    let gens = generations(&path);
    let map = backend.map_size();

    let poisoned = |what: &str, result: Result<(), BackendError>| match result {
        Err(BackendError::Poisoned { reason }) => {
            assert!(reason.contains("injected"), "{what}: {reason}");
        }
        other => panic!("{what} on a poisoned backend returned {other:?}"),
    };
    poisoned("grow_map in place", backend.grow_map(2 << 20));
    assert_eq!(backend.map_size(), map, "the map grew");
    let reader = backend.read_txn().unwrap();
    poisoned("grow_map by copy", backend.grow_map(4 << 20));
    assert_eq!(generations(&path), gens, "a new generation was written");
    drop(reader);
    poisoned("grow_map to the same size", backend.grow_map(map));
    poisoned("grow_map to a smaller size", backend.grow_map(map / 2));
    poisoned("commit", backend.commit(&failing));
    poisoned("commit_from", backend.commit_from(&failing));
    poisoned("sync", backend.sync());
    poisoned("defragment", backend.defragment());
    poisoned("restore", backend.restore(&mut &stream[..]).map(drop));
    poisoned(
        "restore_observed",
        backend
            .restore_observed(&mut &stream[..], &mut |_, _, _| {})
            .map(drop),
    );
    assert_eq!(backend.map_size(), map, "the map changed");
    assert_eq!(generations(&path), gens, "the generations changed");
    assert_eq!(dump_backend(&backend), before, "the data changed");
}
