//! Pins down etcd's semantics of put, range, delete and their metadata.

use keel_mvcc::{DeleteRangeRequest, PutRequest, RangeRequest};

use crate::common::{get, store};

#[test]
fn put_range_delete_follow_etcd_revisions() {
    let (_d, _p, s) = store();
    assert_eq!(s.current_revision(), 0);
    assert_eq!(s.put(b"foo", b"bar", 0).unwrap().revision, 1);
    assert_eq!(s.put(b"foo", b"baz", 7).unwrap().revision, 2);
    assert_eq!(s.put(b"zoo", b"z", 0).unwrap().revision, 3);
    let r = s.range(&RangeRequest::key(b"foo".to_vec())).unwrap();
    assert_eq!(r.count, 1);
    let kv = &r.kvs[0];
    assert_eq!(
        (
            kv.value(),
            kv.create_revision,
            kv.mod_revision,
            kv.version,
            kv.lease
        ),
        (&b"baz"[..], 1, 2, 2, 7)
    );
    let old = s.range(&RangeRequest::key(b"foo".to_vec()).at(1)).unwrap();
    assert_eq!(old.kvs[0].value(), b"bar");
    assert_eq!(old.revision, 1);
    let d = s.delete_range(b"foo", None).unwrap();
    assert_eq!((d.revision, d.deleted), (4, 1));
    assert_eq!(get(&s, b"foo"), None);
    // Deleting nothing keeps the revision.
    let d = s.delete_range(b"foo", None).unwrap();
    assert_eq!((d.revision, d.deleted), (4, 0));
    assert_eq!(s.current_revision(), 4);
    let p = s.put(b"foo", b"again", 0).unwrap();
    assert_eq!(p.revision, 5);
    let kv = &s.range(&RangeRequest::key(b"foo".to_vec())).unwrap().kvs[0];
    assert_eq!((kv.create_revision, kv.version), (5, 1));
    let prev = s
        .put_with(&PutRequest {
            prev_kv: true,
            ..PutRequest::new(b"foo".to_vec(), b"x".to_vec())
        })
        .unwrap();
    assert_eq!(prev.prev_kv.unwrap().value(), b"again");
    let del = s
        .delete_with(&DeleteRangeRequest {
            prev_kv: true,
            ..DeleteRangeRequest::range(b"a".to_vec(), vec![0])
        })
        .unwrap();
    assert_eq!(del.deleted, 2);
    assert_eq!(
        del.prev_kvs
            .iter()
            .map(|kv| kv.key().to_vec())
            .collect::<Vec<_>>(),
        vec![b"foo".to_vec(), b"zoo".to_vec()]
    );
}

#[test]
fn ranges_follow_etcd_conventions() {
    let (_d, _p, s) = store();
    for k in ["a", "ab", "abc", "b", "c"] {
        s.put(k.as_bytes(), b"v", 0).unwrap();
    }
    let keys = |r: keel_mvcc::RangeResponse| {
        r.kvs
            .into_iter()
            .map(|kv| String::from_utf8(kv.key().to_vec()).unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        keys(s.range(&RangeRequest::prefix(b"ab".to_vec())).unwrap()),
        ["ab", "abc"]
    );
    assert_eq!(
        keys(
            s.range(&RangeRequest::range(b"ab".to_vec(), vec![0]))
                .unwrap()
        ),
        ["ab", "abc", "b", "c"]
    );
    assert_eq!(
        keys(s.range(&RangeRequest::range(vec![0], vec![0])).unwrap()).len(),
        5
    );
    assert_eq!(
        keys(
            s.range(&RangeRequest::range(b"a".to_vec(), b"b".to_vec()))
                .unwrap()
        ),
        ["a", "ab", "abc"]
    );
    let limited = s
        .range(&RangeRequest {
            limit: 2,
            ..RangeRequest::range(b"a".to_vec(), vec![0])
        })
        .unwrap();
    assert_eq!(
        (limited.kvs.len(), limited.count, limited.more),
        (2, 5, true)
    );
    let counted = s
        .range(&RangeRequest {
            count_only: true,
            ..RangeRequest::range(b"a".to_vec(), vec![0])
        })
        .unwrap();
    assert_eq!((counted.kvs.len(), counted.count), (0, 5));
    let keys_only = s
        .range(&RangeRequest {
            keys_only: true,
            ..RangeRequest::key(b"a".to_vec())
        })
        .unwrap();
    assert_eq!(keys_only.kvs[0].value(), b"");
    assert_eq!(keys_only.kvs[0].mod_revision, 1);
}

#[test]
fn aux_writes_and_consistent_index_ride_with_the_txn() {
    let (_d, path, s) = store();
    let lease = keel_mvcc::Bucket::new("lease");
    let mut t = s.write();
    t.put(b"k", b"v", 5).unwrap();
    t.put_aux(&lease, b"5", b"ttl=10").unwrap();
    t.set_consistent_index(3).unwrap();
    assert_eq!(t.commit().unwrap(), 1);
    assert_eq!(s.consistent_index(), 3);
    assert_eq!(s.aux_get(&lease, b"5").unwrap(), Some(b"ttl=10".to_vec()));
    // A txn that changes no key keeps the revision but keeps its aux writes and index.
    let mut t = s.write();
    t.delete_aux(&lease, b"5").unwrap();
    t.put_aux(&lease, b"6", b"x").unwrap();
    assert!(t.set_consistent_index(3).is_err());
    t.set_consistent_index(4).unwrap();
    assert_eq!(t.commit().unwrap(), 1);
    assert_eq!(s.aux_get(&lease, b"5").unwrap(), None);
    assert_eq!(
        s.aux_scan(&lease).unwrap(),
        vec![(b"6".to_vec(), b"x".to_vec())]
    );
    // Dropping a txn discards it, index and all.
    let mut t = s.write();
    t.put(b"k", b"gone", 0).unwrap();
    t.put(b"new", b"gone", 0).unwrap();
    t.delete_range(b"k", None).unwrap();
    assert_eq!(
        t.range(&RangeRequest::key(b"new".to_vec())).unwrap().count,
        1
    );
    drop(t);
    assert_eq!(get(&s, b"k"), Some(b"v".to_vec()));
    assert_eq!(get(&s, b"new"), None);
    assert_eq!(s.put(b"k", b"v2", 0).unwrap().revision, 2);
    drop(s);
    let s = crate::common::open_at(&path, keel_mvcc::StoreOptions::default());
    assert_eq!(s.consistent_index(), 4);
    assert_eq!(s.current_revision(), 2);
    assert_eq!(get(&s, b"k"), Some(b"v2".to_vec()));
    let kv = &s.range(&RangeRequest::key(b"k".to_vec())).unwrap().kvs[0];
    assert_eq!((kv.create_revision, kv.version), (1, 2));
    assert_eq!(
        s.aux_scan(&lease).unwrap(),
        vec![(b"6".to_vec(), b"x".to_vec())]
    );
    let mut t = s.write();
    assert!(matches!(
        t.set_consistent_index(4),
        Err(keel_mvcc::MvccError::IndexAlreadyApplied {
            index: 4,
            applied: 4
        })
    ));
}

#[test]
fn handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send_static<T: Send + 'static>() {}
    send_sync::<keel_mvcc::Store<keel_mvcc::testing::MemBackend>>();
    send_static::<keel_mvcc::ReadView<keel_mvcc::testing::MemBackend>>();
    send_static::<keel_mvcc::Watcher>();
    let (_d, _p, s) = store();
    s.put(b"k", b"v", 0).unwrap();
    let view = s.read().unwrap();
    let got = std::thread::spawn(move || view.range(&RangeRequest::key(b"k".to_vec())).unwrap())
        .join()
        .unwrap();
    assert_eq!(got.kvs[0].value(), b"v");
}
