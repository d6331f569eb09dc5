//! A commit that fails at its durability point poisons the backend: later commits are
//! refused with `Poisoned`, committed data stays readable, and a reopen recovers. Without
//! fsync on commit, `sync` flushes.

use keel_backend_lmdb::LmdbOptions;
use keel_mvcc::{Backend, BackendError, Bucket, WriteBatch};

use crate::common::{dump_backend, open};

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
