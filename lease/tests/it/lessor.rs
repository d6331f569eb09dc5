//! The lessor over an MVCC store: persistence of grants and checkpoints, atomic revoke,
//! recovery of leases and attached keys after reopen, the consistent index, and the
//! Kubernetes case (a 1-hour lease survives a leader change with its remaining TTL).

use std::sync::Arc;
use std::time::Duration;

use keel_lease::{Checkpoint, LeaseError, Lessor, LessorOptions, ManualClock};
use keel_mvcc::MvccError;

use crate::common::{keys_with_leases, mem_path, open_lessor, open_store, run_checkpoints, secs};

#[test]
fn grant_put_revoke_deletes_keys_and_record_together() {
    let path = mem_path("revoke");
    let store = open_store(&path);
    let clock = Arc::new(ManualClock::new());
    let lessor = open_lessor(&store, &clock);
    assert_eq!(lessor.grant(7, 60, None).unwrap(), 60);
    lessor.put(b"a", b"1", 7, None).unwrap();
    lessor.put(b"b", b"2", 7, None).unwrap();
    lessor.put(b"c", b"3", 0, None).unwrap();
    assert_eq!(
        lessor.time_to_live(7, true).unwrap().keys,
        vec![b"a".to_vec(), b"b".to_vec()]
    );
    let before = store.current_revision();
    let revoked = lessor.revoke(7, None).unwrap();
    assert_eq!(revoked.deleted, 2);
    assert_eq!(
        revoked.revision,
        before + 1,
        "one revision for the whole revoke"
    );
    assert_eq!(keys_with_leases(&store), vec![(b"c".to_vec(), 0)]);
    assert_eq!(
        store.aux_scan(&keel_lease::record::LEASE_BUCKET).unwrap(),
        vec![]
    );
    assert!(lessor.leases().is_empty());
    let err = lessor.revoke(7, None).unwrap_err();
    assert!(matches!(err, LeaseError::NotFound { id: 7 }), "{err}");
}

#[test]
fn rewritten_keys_move_between_leases_and_survive_the_old_lease() {
    let store = open_store(&mem_path("move"));
    let clock = Arc::new(ManualClock::new());
    let lessor = open_lessor(&store, &clock);
    lessor.grant(1, 60, None).unwrap();
    lessor.grant(2, 60, None).unwrap();
    lessor.put(b"k", b"v", 1, None).unwrap();
    lessor.put(b"j", b"v", 1, None).unwrap();
    lessor.put(b"k", b"v2", 2, None).unwrap();
    lessor.put(b"j", b"v2", 0, None).unwrap();
    assert!(lessor.time_to_live(1, true).unwrap().keys.is_empty());
    assert_eq!(
        lessor.time_to_live(2, true).unwrap().keys,
        vec![b"k".to_vec()]
    );
    assert_eq!(lessor.revoke(1, None).unwrap().deleted, 0);
    // A stale attachment reported by a caller cannot delete a key that moved on.
    lessor.attach(2, &[b"j"]).unwrap();
    assert_eq!(lessor.revoke(2, None).unwrap().deleted, 1);
    assert_eq!(keys_with_leases(&store), vec![(b"j".to_vec(), 0)]);
    // Deleting a key detaches it.
    lessor.grant(3, 60, None).unwrap();
    lessor.put(b"x", b"v", 3, None).unwrap();
    lessor.put(b"y", b"v", 3, None).unwrap();
    lessor.delete_range(b"x", None, None).unwrap();
    assert_eq!(
        lessor.time_to_live(3, true).unwrap().keys,
        vec![b"y".to_vec()]
    );
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let store = open_store(&mem_path("bad"));
    let clock = Arc::new(ManualClock::new());
    let lessor = open_lessor(&store, &clock);
    lessor.grant(1, 60, Some(10)).unwrap();
    let rev = store.current_revision();
    let cases: Vec<(LeaseError, &str)> = vec![
        (lessor.grant(0, 60, None).unwrap_err(), "reserved"),
        (
            lessor.grant(1, 60, None).unwrap_err(),
            "lease already exists",
        ),
        (lessor.grant(2, 0, None).unwrap_err(), "at least 1 s"),
        (
            lessor.grant(2, 9_000_000_001, None).unwrap_err(),
            "too large lease TTL",
        ),
        (
            lessor.put(b"k", b"v", 9, None).unwrap_err(),
            "requested lease not found",
        ),
        (
            lessor.attach(9, &[b"k"]).unwrap_err(),
            "requested lease not found",
        ),
        (
            lessor.revoke(9, None).unwrap_err(),
            "requested lease not found",
        ),
        (lessor.renew(1).unwrap_err(), "not leader"),
    ];
    for (err, text) in cases {
        assert!(
            err.to_string().contains(text),
            "{err:?} should say {text:?}"
        );
    }
    let unknown = Checkpoint {
        id: 9,
        remaining_ttl: 5,
    };
    assert_eq!(lessor.apply_checkpoints(&[unknown], None).unwrap(), 0);
    assert_eq!(store.current_revision(), rev);
    assert_eq!(lessor.leases(), vec![1]);
    assert!(keys_with_leases(&store).is_empty());
    assert_eq!(store.consistent_index(), 10);
}

#[test]
fn a_lessor_is_shared_between_threads() {
    fn shared<T: Send + Sync + 'static>(_: &T) {}
    let store = open_store(&mem_path("threads"));
    let clock = Arc::new(ManualClock::new());
    let lessor = Arc::new(open_lessor(&store, &clock));
    shared(&lessor);
    let handles: Vec<_> = (0..4i64)
        .map(|t| {
            let lessor = lessor.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    let id = t * 1_000 + i + 1;
                    lessor.grant(id, 60, None).unwrap();
                    lessor
                        .put(format!("{id}").as_bytes(), b"v", id, None)
                        .unwrap();
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(lessor.leases().len(), 200);
    assert_eq!(keys_with_leases(&store).len(), 200);
}

#[test]
fn raft_indices_are_recorded_and_never_applied_twice() {
    let path = mem_path("index");
    let store = open_store(&path);
    let clock = Arc::new(ManualClock::new());
    let lessor = open_lessor(&store, &clock);
    lessor.grant(1, 60, Some(5)).unwrap();
    assert_eq!(store.consistent_index(), 5);
    let err = lessor.grant(2, 60, Some(5)).unwrap_err();
    assert!(
        matches!(
            err,
            LeaseError::Store(MvccError::IndexAlreadyApplied { .. })
        ),
        "{err}"
    );
    assert_eq!(lessor.leases(), vec![1]);
    lessor.put(b"k", b"v", 1, Some(6)).unwrap();
    lessor
        .apply_checkpoints(
            &[Checkpoint {
                id: 1,
                remaining_ttl: 30,
            }],
            Some(7),
        )
        .unwrap();
    assert!(lessor.revoke(1, Some(7)).is_err());
    assert_eq!(lessor.leases(), vec![1]);
    lessor.revoke(1, Some(8)).unwrap();
    assert_eq!(store.consistent_index(), 8);
    store.force_commit().unwrap();
    drop(lessor);
    drop(store);
    let store = open_store(&path);
    assert_eq!(store.consistent_index(), 8);
}

#[test]
fn leases_and_attached_keys_are_recovered_after_reopen() {
    let path = mem_path("recover");
    let clock = Arc::new(ManualClock::new());
    {
        let store = open_store(&path);
        let lessor = open_lessor(&store, &clock);
        lessor.promote();
        for id in 1..=50 {
            lessor.grant(id, 600 + id, None).unwrap();
            for k in 0..(id % 4) {
                let key = format!("key/{id}/{k}");
                lessor.put(key.as_bytes(), b"v", id, None).unwrap();
            }
        }
        lessor.put(b"plain", b"v", 0, None).unwrap();
        lessor.grant(-3, 1, None).unwrap();
        lessor.revoke(10, None).unwrap();
        lessor.revoke(11, None).unwrap();
        clock.advance(secs(300));
        assert!(run_checkpoints(&lessor) >= 48);
        store.force_commit().unwrap();
    }
    let store = open_store(&path);
    let lessor = open_lessor(&store, &clock);
    let rec = lessor.recovered();
    assert_eq!(rec.leases, 49);
    assert_eq!(rec.orphan_keys, 0);
    let mut expected_ids: Vec<i64> = (1..=50).filter(|&id| id != 10 && id != 11).collect();
    expected_ids.insert(0, -3);
    assert_eq!(lessor.leases(), expected_ids);
    let mut attached = 0;
    for id in 1..=50i64 {
        if id == 10 || id == 11 {
            continue;
        }
        let ttl = lessor.time_to_live(id, true).unwrap();
        assert_eq!(ttl.granted_ttl, 600 + id);
        // Non-primary: the checkpointed remaining TTL (granted - 300 s).
        assert_eq!(ttl.ttl, 300 + id, "lease {id}");
        let keys: Vec<Vec<u8>> = (0..(id % 4))
            .map(|k| format!("key/{id}/{k}").into_bytes())
            .collect();
        let mut sorted = keys.clone();
        sorted.sort();
        assert_eq!(ttl.keys, sorted);
        attached += keys.len();
    }
    assert_eq!(rec.attached_keys, attached);
    assert_eq!(lessor.time_to_live(-3, false).unwrap().granted_ttl, 2);
    // Keys of the revoked leases are gone; the plain key is there.
    assert!(
        keys_with_leases(&store)
            .iter()
            .all(|(k, l)| !k.starts_with(b"key/10/")
                && !k.starts_with(b"key/11/")
                && (*l != 0 || k == b"plain"))
    );
}

#[test]
fn corrupt_lease_records_are_reported_on_open() {
    let path = mem_path("corrupt");
    let store = open_store(&path);
    let mut txn = store.write();
    txn.put_aux(
        &keel_lease::record::LEASE_BUCKET,
        &5i64.to_be_bytes(),
        b"garbage",
    )
    .unwrap();
    txn.commit().unwrap();
    let clock = Arc::new(ManualClock::new());
    let err = Lessor::open(store, clock, LessorOptions::default()).unwrap_err();
    assert!(matches!(err, LeaseError::CorruptRecord { .. }), "{err}");
    assert!(err.to_string().contains("corrupt"), "{err}");
}

/// Kubernetes' 1-hour lease: with checkpoints, a leader change 50 minutes in leaves it about
/// 10 minutes, not a fresh hour; a renewed lease keeps its full hour.
#[test]
fn a_one_hour_lease_expires_on_time_across_a_leader_change() {
    let path = mem_path("k8s");
    let clock = Arc::new(ManualClock::new());
    let options = LessorOptions::default();
    let interval = options.checkpoint_interval;
    let extension = options.effective_promote_extension();
    {
        let store = open_store(&path);
        let old = open_lessor(&store, &clock);
        old.promote();
        old.grant(1, 3_600, None).unwrap();
        old.grant(2, 3_600, None).unwrap();
        old.grant(3, 600, None).unwrap();
        old.put(b"/registry/leases/1", b"holder", 1, None).unwrap();
        for _ in 0..50 {
            clock.advance(secs(60));
            run_checkpoints(&old);
        }
        assert_eq!(old.time_to_live(1, false).unwrap().ttl, 600);
        // Lease 2 is renewed at minute 50: its checkpoint must be cleared.
        let renewal = old.renew(2).unwrap();
        let clear = renewal
            .checkpoint
            .expect("a checkpointed lease asks for a clear");
        assert_eq!(clear.remaining_ttl, 0);
        old.apply_checkpoints(&[clear], None).unwrap();
        store.force_commit().unwrap();
    }
    // A fresh lessor on the same backend becomes primary.
    let store = open_store(&path);
    let new = open_lessor(&store, &clock);
    new.promote();
    let left = new.time_to_live(1, false).unwrap().ttl;
    assert_eq!(left as u64, 600 + extension.as_secs());
    assert!(Duration::from_secs(left as u64) <= secs(600) + interval + extension);
    // Lease 3 (10 minutes, checkpointed at minute 5 with 5 minutes left) expired long ago
    // and is handed out at once rather than living another 10 minutes.
    assert_eq!(new.time_to_live(3, false).unwrap().ttl, 301);
    assert_eq!(new.time_to_live(2, false).unwrap().ttl, 3_601);

    clock.advance(secs(300));
    assert!(new.expired_leases().is_empty());
    clock.advance(secs(1));
    assert_eq!(new.expired_leases(), vec![3]);
    new.revoke(3, None).unwrap();
    clock.advance(secs(299));
    assert!(new.expired_leases().is_empty(), "lease 1 has 1 s left");
    clock.advance(secs(1));
    assert_eq!(new.expired_leases(), vec![1]);
    let revoked = new.revoke(1, None).unwrap();
    assert_eq!(revoked.deleted, 1);
    clock.advance(secs(2_999));
    assert!(new.expired_leases().is_empty());
    clock.advance(secs(1));
    assert_eq!(new.expired_leases(), vec![2]);
}

#[test]
fn a_demoted_lessor_expires_nothing_and_refuses_renewals() {
    let store = open_store(&mem_path("demote"));
    let clock = Arc::new(ManualClock::new());
    let lessor = open_lessor(&store, &clock);
    lessor.promote();
    lessor.grant(1, 10, None).unwrap();
    assert_eq!(lessor.renew(1).unwrap().ttl, 10);
    lessor.demote();
    assert!(!lessor.is_primary());
    clock.advance(secs(1_000));
    assert!(lessor.expired_leases().is_empty());
    assert!(lessor.checkpoint_batch().is_empty());
    assert!(matches!(
        lessor.renew(1),
        Err(LeaseError::NotPrimary { id: 1 })
    ));
    lessor.promote();
    clock.advance(secs(10));
    assert!(lessor.expired_leases().is_empty(), "extension of 1 s");
    clock.advance(secs(1));
    assert_eq!(lessor.expired_leases(), vec![1]);
}

#[test]
fn transactions_move_attachments_and_refuse_unknown_leases() {
    use keel_mvcc::{
        Compare, CompareResult, CompareTarget, DeleteRangeRequest, PutRequest, TxnOp,
        TxnOpResponse, TxnRequest,
    };
    let store = open_store(&mem_path("txn"));
    let clock = Arc::new(ManualClock::new());
    let lessor = open_lessor(&store, &clock);
    lessor.grant(1, 60, None).unwrap();
    lessor.grant(2, 60, None).unwrap();
    lessor.put(b"a", b"v", 1, None).unwrap();
    lessor.put(b"b", b"v", 1, None).unwrap();
    let put = |key: &[u8], lease| {
        TxnOp::Put(PutRequest {
            lease,
            ..PutRequest::new(key.to_vec(), b"w".to_vec())
        })
    };
    // An unknown lease in the branch that would not even run is refused, nothing changes.
    let bad = TxnRequest {
        compare: vec![],
        success: vec![put(b"c", 2)],
        failure: vec![put(b"c", 9)],
    };
    let rev = store.current_revision();
    let err = lessor.txn(&bad, None).unwrap_err();
    assert!(matches!(err, LeaseError::NotFound { id: 9 }), "{err}");
    assert_eq!(store.current_revision(), rev);

    // The failure branch runs: "a" moves to lease 2, "b" is deleted, "c" gets lease 2.
    let req = TxnRequest {
        compare: vec![Compare::new(
            b"a".to_vec(),
            CompareResult::Equal,
            CompareTarget::Value(b"nope".to_vec()),
        )],
        success: vec![put(b"z", 1)],
        failure: vec![
            put(b"a", 2),
            TxnOp::DeleteRange(DeleteRangeRequest::key(b"b".to_vec())),
            TxnOp::Txn(TxnRequest {
                compare: vec![],
                success: vec![put(b"c", 2)],
                failure: vec![],
            }),
        ],
    };
    let response = lessor.txn(&req, Some(3)).unwrap();
    assert!(!response.succeeded);
    match &response.responses[0] {
        TxnOpResponse::Put(r) => assert_eq!(r.prev_kv, None, "not asked for"),
        other => panic!("unexpected response {other:?}"),
    }
    assert!(lessor.time_to_live(1, true).unwrap().keys.is_empty());
    assert_eq!(
        lessor.time_to_live(2, true).unwrap().keys,
        vec![b"a".to_vec(), b"c".to_vec()]
    );
    assert_eq!(store.consistent_index(), 3);
    assert_eq!(lessor.revoke(2, None).unwrap().deleted, 2);
    assert!(keys_with_leases(&store).is_empty());
}

/// A checkpoint that claims more than the granted TTL is stored as the granted TTL, so a
/// new leader expires the lease on time.
#[test]
fn a_replicated_checkpoint_is_clamped_to_the_granted_ttl() {
    let path = mem_path("clamp");
    let clock = Arc::new(ManualClock::new());
    let store = open_store(&path);
    let lessor = open_lessor(&store, &clock);
    lessor.grant(1, 10, None).unwrap();
    let cp = Checkpoint {
        id: 1,
        remaining_ttl: i64::MAX,
    };
    assert_eq!(lessor.apply_checkpoints(&[cp], None).unwrap(), 1);
    lessor.promote();
    assert!(lessor.time_to_live(1, false).unwrap().ttl <= 11);
    clock.advance(secs(3600));
    assert_eq!(lessor.expired_leases(), vec![1]);
}

/// A lease renewed after it left the checkpoint schedule keeps being checkpointed: after a
/// leader change, a client that stopped renewing loses it within one checkpoint interval
/// of its real end (the design's bound), not a full TTL later.
#[test]
fn a_renewed_lease_keeps_its_bound_across_a_leader_change() {
    let path = mem_path("renewed");
    let clock = Arc::new(ManualClock::new());
    let store = open_store(&path);
    let options = LessorOptions {
        promote_extension: Some(Duration::ZERO),
        ..LessorOptions::default()
    };
    let lessor = Lessor::open(store.clone(), clock.clone(), options).unwrap();
    lessor.promote();
    lessor.grant(1, 600, None).unwrap();
    clock.advance(secs(300));
    run_checkpoints(&lessor);
    clock.advance(secs(1));
    let renewal = lessor.renew(1).unwrap();
    lessor
        .apply_checkpoints(&[renewal.checkpoint.expect("a clear")], None)
        .unwrap();
    // The client stops renewing at 301 s: the lease really ends at 901 s.
    for _ in 0..549 {
        clock.advance(secs(1));
        run_checkpoints(&lessor);
    }
    // A leader change at 850 s, with 51 s really left.
    lessor.demote();
    lessor.promote();
    let ttl = lessor.time_to_live(1, false).unwrap().ttl;
    assert!(ttl <= 51 + 300, "the new leader gives {ttl} s");
}
