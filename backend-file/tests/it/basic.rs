//! Open, commit, read, reopen: the basic contract on one backend.

use keel_backend_file::FileBackend;
use keel_mvcc::{Backend, BackendError, Bucket, ReadTxn, WriteBatch};

use crate::support::{B, META_B, dump, open, small};

#[test]
fn commit_read_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), &small());
    let mut batch = WriteBatch::new();
    batch.put(&B, b"a".to_vec(), b"1".to_vec());
    batch.put(&B, b"b".to_vec(), b"2".to_vec());
    batch.put(&META_B, b"ci".to_vec(), 7u64.to_be_bytes().to_vec());
    b.commit(&batch).unwrap();
    let txn = b.read_txn().unwrap();
    assert_eq!(txn.get(&B, b"a").unwrap(), Some(&b"1"[..]));
    assert_eq!(txn.get(&B, b"zz").unwrap(), None);
    assert_eq!(txn.get(&Bucket::new("nope"), b"a").unwrap(), None);
    assert_eq!(txn.buckets().unwrap(), vec![B, META_B]);

    let mut batch = WriteBatch::new();
    batch.delete(&B, b"a".to_vec());
    batch.put(&B, b"c".to_vec(), b"3".to_vec());
    b.commit(&batch).unwrap();
    // The old transaction still sees its snapshot.
    assert_eq!(txn.get(&B, b"a").unwrap(), Some(&b"1"[..]));
    assert_eq!(txn.get(&B, b"c").unwrap(), None);
    let before = dump(&b);
    drop(txn);
    drop(b);
    let b = open(dir.path(), &small());
    assert_eq!(dump(&b), before);
    let txn = b.read_txn().unwrap();
    assert_eq!(txn.get(&B, b"a").unwrap(), None);
    assert_eq!(txn.get(&B, b"c").unwrap(), Some(&b"3"[..]));
    b.check_integrity().unwrap();
}

#[test]
fn second_open_is_locked() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), &small());
    match FileBackend::open(dir.path(), &small()) {
        Err(BackendError::Locked { path }) => assert_eq!(path, dir.path()),
        other => panic!("expected Locked, got {:?}", other.map(|_| ())),
    }
    drop(b);
    open(dir.path(), &small());
}

#[test]
fn delete_range_and_ranges() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), &small());
    let mut batch = WriteBatch::new();
    for i in 0..100u32 {
        batch.put(&B, i.to_be_bytes().to_vec(), vec![i as u8; 30]);
    }
    batch.delete_range(
        &B,
        10u32.to_be_bytes().to_vec(),
        Some(20u32.to_be_bytes().to_vec()),
    );
    b.commit(&batch).unwrap();
    let mut batch = WriteBatch::new();
    batch.delete_range(&B, 90u32.to_be_bytes().to_vec(), None);
    b.commit(&batch).unwrap();
    let check = |b: &FileBackend| {
        let txn = b.read_txn().unwrap();
        let keys: Vec<u32> = txn
            .range(&B, &5u32.to_be_bytes(), Some(&25u32.to_be_bytes()))
            .unwrap()
            .map(|r| u32::from_be_bytes(r.unwrap().0.try_into().unwrap()))
            .collect();
        let want: Vec<u32> = (5..10).chain(20..25).collect();
        assert_eq!(keys, want);
        assert_eq!(txn.range(&B, &[], None).unwrap().count(), 80);
        assert_eq!(txn.range(&B, &[9], Some(&[1])).unwrap().count(), 0);
    };
    check(&b);
    drop(b);
    let b = open(dir.path(), &small());
    check(&b);
}

#[test]
fn many_segments_reclaim_and_defragment() {
    let dir = tempfile::tempdir().unwrap();
    let b = open(dir.path(), &small());
    for round in 0..5u8 {
        for chunk in 0..10u32 {
            let mut batch = WriteBatch::new();
            for i in 0..100u32 {
                let k = chunk * 100 + i;
                batch.put(&B, k.to_be_bytes().to_vec(), vec![round; 100]);
            }
            b.commit(&batch).unwrap();
        }
    }
    let before = dump(&b);
    let size = b.size().unwrap();
    assert!(size.on_disk > 4 * size.in_use, "{size:?}");
    assert!(b.reclaim().unwrap());
    assert_eq!(dump(&b), before);
    b.check_integrity().unwrap();
    b.defragment().unwrap();
    assert_eq!(dump(&b), before);
    let after = b.size().unwrap();
    assert!(after.on_disk < size.in_use * 12 / 10, "{after:?}");
    let files = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_str()
                .unwrap()
                .ends_with(".seg")
        })
        .count();
    assert!(files <= 3, "{files} segment files left");
    b.check_integrity().unwrap();
    drop(b);
    let b = open(dir.path(), &small());
    assert_eq!(dump(&b), before);
    b.check_integrity().unwrap();
}
