//! Bad input is refused with etcd's wording, and refusing it changes nothing.

use keel_mvcc::{
    Compare, CompareResult, CompareTarget, DeleteRangeRequest, MAX_TXN_DEPTH, MvccError,
    PutRequest, RangeRequest, StoreOptions, TxnOp, TxnRequest, WatchRequest,
};

use crate::common::{fresh_path, open_at, store};

fn put(k: &str) -> TxnOp {
    TxnOp::Put(PutRequest::new(k.as_bytes().to_vec(), b"v".to_vec()))
}

#[test]
fn every_bad_input_is_a_typed_error_and_changes_nothing() {
    let (_d, _p, s) = store();
    s.put(b"a", b"1", 0).unwrap();
    s.put(b"b", b"2", 0).unwrap();
    s.put(b"c", b"3", 0).unwrap();
    let state = |s: &keel_mvcc::Store<_>| {
        (
            s.current_revision(),
            s.range(&RangeRequest::range(vec![0], vec![0])).unwrap().kvs,
        )
    };
    let before = state(&s);
    let check = |e: MvccError, text: &str| {
        assert!(
            e.to_string().contains(text),
            "error {e:?} renders as {:?}, expected it to contain {text:?}",
            e.to_string()
        );
    };

    check(s.put(b"", b"v", 0).unwrap_err(), "key is not provided");
    check(
        s.range(&RangeRequest::key(Vec::new())).unwrap_err(),
        "key is not provided",
    );
    check(
        s.delete_range(b"", None).unwrap_err(),
        "key is not provided",
    );
    check(
        s.watch(WatchRequest::key(Vec::new())).unwrap_err(),
        "key is not provided",
    );
    check(
        s.range(&RangeRequest::range(b"b".to_vec(), b"a".to_vec()))
            .unwrap_err(),
        "is below the key",
    );
    check(
        s.delete_range(b"b", Some(b"a")).unwrap_err(),
        "is below the key",
    );

    let big = vec![0u8; 3 * 512 * 1024 + 1];
    check(s.put(b"k", &big, 0).unwrap_err(), "request is too large");
    let e = s
        .txn(&TxnRequest {
            success: vec![TxnOp::Put(PutRequest::new(b"k".to_vec(), big.clone()))],
            ..TxnRequest::default()
        })
        .unwrap_err();
    check(e, "request is too large");

    let many: Vec<TxnOp> = (0..129).map(|i| put(&format!("k{i}"))).collect();
    let e = s
        .txn(&TxnRequest {
            success: many,
            ..TxnRequest::default()
        })
        .unwrap_err();
    assert!(
        matches!(
            e,
            MvccError::TooManyOps {
                ops: 129,
                limit: 128
            }
        ),
        "{e:?}"
    );
    check(e, "too many operations in txn request");

    for ops in [
        vec![put("x"), put("x")],
        vec![
            TxnOp::DeleteRange(DeleteRangeRequest::range(b"w".to_vec(), b"z".to_vec())),
            put("x"),
        ],
        vec![
            put("x"),
            TxnOp::Txn(TxnRequest {
                success: vec![put("x")],
                ..TxnRequest::default()
            }),
        ],
    ] {
        let e = s
            .txn(&TxnRequest {
                failure: ops,
                ..TxnRequest::default()
            })
            .unwrap_err();
        check(e, "duplicate key given in txn request");
    }
    // Mutually exclusive branches of a nested txn may put the same key.
    s.txn(&TxnRequest {
        success: vec![TxnOp::Txn(TxnRequest {
            compare: vec![Compare::new(
                b"a".to_vec(),
                CompareResult::Equal,
                CompareTarget::Value(b"1".to_vec()),
            )],
            success: vec![put("n")],
            failure: vec![put("n")],
        })],
        ..TxnRequest::default()
    })
    .unwrap();
    let before = {
        let _ = before;
        state(&s)
    };

    check(
        s.range(&RangeRequest::key(b"a".to_vec()).at(100))
            .unwrap_err(),
        "required revision is a future revision",
    );
    // A failing op inside a txn undoes the ops before it.
    let e = s
        .txn(&TxnRequest {
            success: vec![
                put("y"),
                TxnOp::Range(RangeRequest::key(b"a".to_vec()).at(100)),
            ],
            ..TxnRequest::default()
        })
        .unwrap_err();
    check(e, "required revision is a future revision");
    assert_eq!(state(&s), before, "a failed txn left changes");

    check(
        s.compact(100).unwrap_err(),
        "required revision is a future revision",
    );
    s.compact(2).unwrap();
    check(
        s.compact(2).unwrap_err(),
        "required revision has been compacted",
    );
    check(
        s.compact(1).unwrap_err(),
        "required revision has been compacted",
    );
    check(
        s.range(&RangeRequest::key(b"a".to_vec()).at(1))
            .unwrap_err(),
        "required revision has been compacted",
    );
    check(
        s.watch(WatchRequest::key(b"a".to_vec()).from(2))
            .unwrap_err(),
        "required revision has been compacted",
    );
    check(
        s.hash_kv(1).unwrap_err(),
        "required revision has been compacted",
    );
    assert_eq!(state(&s), before, "bad input changed the store");
    assert_eq!(s.compacted_revision(), 2);

    let lease = keel_mvcc::Bucket::new("key");
    let mut t = s.write();
    check(t.put_aux(&lease, b"x", b"y").unwrap_err(), "reserved");
}

/// Transactions nested `levels` deep (the outermost counted), the innermost one putting `k`.
fn nested(levels: usize) -> TxnRequest {
    let mut req = TxnRequest {
        success: vec![put("k")],
        ..TxnRequest::default()
    };
    for _ in 1..levels {
        req = TxnRequest {
            success: vec![TxnOp::Txn(req)],
            ..TxnRequest::default()
        };
    }
    req
}

/// Takes a deeply nested request apart without recursion (its drop would recurse).
fn dismantle(mut req: TxnRequest) {
    while let Some(TxnOp::Txn(inner)) = req.success.pop() {
        req = inner;
    }
}

/// Nesting is bounded before anything walks a request recursively: a request nested far
/// deeper than a thread's stack allows is refused with a typed error, not a stack overflow
/// that aborts the process; the deepest nesting allowed runs.
#[test]
fn transactions_nested_too_deep_are_refused_without_recursion() {
    let (_d, _p, s) = store();
    let s = std::sync::Arc::new(s);
    let deep = s.clone();
    // A small stack: before the bound, validation recursed once per level and overflowed.
    let refused = std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(move || {
            let req = nested(50_000);
            let r = deep.txn(&req).map(|_| ());
            dismantle(req);
            r
        })
        .unwrap()
        .join()
        .expect("no stack overflow");
    let err = refused.unwrap_err();
    assert!(
        matches!(err, MvccError::TxnTooDeep { limit } if limit == MAX_TXN_DEPTH),
        "{err}"
    );
    assert!(err.to_string().contains("deeper than"), "{err}");
    let err = s.txn(&nested(MAX_TXN_DEPTH + 1)).unwrap_err();
    assert!(matches!(err, MvccError::TxnTooDeep { .. }), "{err}");
    assert!(
        s.range(&RangeRequest::key(b"k".to_vec()))
            .unwrap()
            .kvs
            .is_empty()
    );
    s.txn(&nested(MAX_TXN_DEPTH)).unwrap();
    assert_eq!(
        s.range(&RangeRequest::key(b"k".to_vec()))
            .unwrap()
            .kvs
            .len(),
        1
    );
}

#[test]
fn options_are_validated() {
    let (_d, path) = fresh_path();
    let backend =
        <keel_mvcc::testing::MemBackend as keel_mvcc::Backend>::open(&path, &Default::default())
            .unwrap();
    let bad = StoreOptions {
        batch_limit: 0,
        ..StoreOptions::default()
    };
    let e = keel_mvcc::Store::open(backend, bad).err().expect("refused");
    assert!(e.to_string().contains("batch_limit"), "{e}");
    for percent in [0, 101] {
        let bad = StoreOptions {
            long_read_cpu_percent: percent,
            ..StoreOptions::default()
        };
        let e = bad.validate().expect_err("refused");
        assert!(e.to_string().contains("long_read_cpu_percent"), "{e}");
    }
    // The refused open released the backend.
    let s = open_at(&path, StoreOptions::default());
    assert_eq!(s.current_revision(), 0);
}
