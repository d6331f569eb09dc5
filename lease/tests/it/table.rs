//! The in-memory lease table on an injected clock: expiry times, renew, minimum TTL, rate
//! limiting, roles and checkpoint production.

use std::time::Duration;

use keel_lease::{Checkpoint, LeaseError, LeaseTable, LessorOptions, MAX_LEASE_TTL};

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

fn primary() -> LeaseTable {
    let mut t = LeaseTable::new(LessorOptions::default()).unwrap();
    t.promote(Duration::ZERO);
    t
}

#[test]
fn lease_expires_exactly_at_its_ttl() {
    let mut t = LeaseTable::new(LessorOptions {
        promote_extension: Some(Duration::ZERO),
        ..LessorOptions::default()
    })
    .unwrap();
    t.promote(secs(0));
    assert_eq!(t.grant(1, 10, secs(0)).unwrap(), 10);
    assert_eq!(t.grant(2, 20, secs(0)).unwrap(), 20);
    assert!(t.expired(secs(9)).is_empty());
    assert!(t.expired(Duration::from_millis(9_999)).is_empty());
    assert_eq!(t.expired(secs(10)), vec![1]);
    // Handed out once, then again only after the retry interval (3 s) if still there.
    assert!(t.expired(secs(11)).is_empty());
    assert_eq!(t.expired(secs(13)), vec![1]);
    t.remove(1).unwrap();
    assert!(t.expired(secs(19)).is_empty());
    assert_eq!(t.expired(secs(20)), vec![2]);
    assert_eq!(t.time_to_live(2, secs(20), false).unwrap().ttl, 0);
}

#[test]
fn renew_pushes_expiry_back_by_the_full_ttl() {
    let mut t = primary();
    t.grant(1, 10, secs(0)).unwrap();
    // Default promotion extension is 1 s, but a lease granted on the primary has none.
    let r = t.renew(1, secs(8)).unwrap();
    assert_eq!(r.ttl, 10);
    assert_eq!(r.checkpoint, None);
    assert_eq!(t.time_to_live(1, secs(8), false).unwrap().ttl, 10);
    assert!(
        t.expired(secs(17)).is_empty(),
        "the old deadline must not fire"
    );
    assert_eq!(t.expired(secs(18)), vec![1]);
    // An expired lease cannot be renewed: it is awaiting revocation.
    assert!(matches!(
        t.renew(1, secs(19)),
        Err(LeaseError::NotFound { id: 1 })
    ));
}

#[test]
fn short_ttls_are_raised_to_the_minimum_and_huge_ones_refused() {
    let mut t = primary();
    assert_eq!(
        t.grant(1, 1, secs(0)).unwrap(),
        2,
        "1.5 x 1 s election timeout"
    );
    let mut t15 = LeaseTable::new(LessorOptions {
        election_timeout: secs(10),
        ..LessorOptions::default()
    })
    .unwrap();
    assert_eq!(t15.grant(1, 5, secs(0)).unwrap(), 15);
    let mut custom = LeaseTable::new(LessorOptions {
        min_ttl: Some(30),
        ..LessorOptions::default()
    })
    .unwrap();
    assert_eq!(custom.grant(1, 29, secs(0)).unwrap(), 30);
    assert_eq!(custom.grant(2, 31, secs(0)).unwrap(), 31);

    assert_eq!(t.grant(2, MAX_LEASE_TTL, secs(0)).unwrap(), MAX_LEASE_TTL);
    let err = t.grant(3, MAX_LEASE_TTL + 1, secs(0)).unwrap_err();
    assert!(
        matches!(err, LeaseError::TtlTooLarge { id: 3, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("too large lease TTL"), "{err}");
    for ttl in [0, -1] {
        let err = t.grant(3, ttl, secs(0)).unwrap_err();
        assert!(matches!(err, LeaseError::TtlNotPositive { .. }), "{err}");
    }
    let err = t.grant(0, 10, secs(0)).unwrap_err();
    assert!(matches!(err, LeaseError::ReservedId), "{err}");
    let err = t.grant(1, 10, secs(0)).unwrap_err();
    assert!(err.to_string().contains("lease already exists"), "{err}");
    assert_eq!(t.len(), 2);
    assert!(!t.contains(3));
    // The far-future lease never expires in any reasonable time, and does not overflow.
    assert!(t.expired(Duration::from_secs(1 << 40)).contains(&1));
    assert!(!t.expired(Duration::from_secs(1 << 40)).contains(&2));
}

#[test]
fn unknown_leases_are_typed_errors() {
    let mut t = primary();
    for err in [
        t.renew(9, secs(0)).unwrap_err(),
        t.time_to_live(9, secs(0), true).unwrap_err(),
        t.attach(9, b"k").unwrap_err(),
        t.remove(9).unwrap_err(),
        t.keys(9).unwrap_err(),
    ] {
        assert!(matches!(err, LeaseError::NotFound { id: 9 }), "{err}");
        assert!(
            err.to_string().contains("requested lease not found"),
            "{err}"
        );
    }
    assert!(!t.apply_checkpoint(9, 5));
}

#[test]
fn expiry_hand_out_is_rate_limited() {
    let mut t = LeaseTable::new(LessorOptions {
        expiry_rate: 100,
        promote_extension: Some(Duration::ZERO),
        ..LessorOptions::default()
    })
    .unwrap();
    t.promote(secs(0));
    for id in 1..=1_000 {
        t.grant(id, 10, secs(0)).unwrap();
    }
    let mut seen = std::collections::BTreeSet::new();
    let first = t.expired(secs(10));
    assert_eq!(first.len(), 100, "one second's worth of tokens at most");
    assert!(t.expired(secs(10)).is_empty(), "no tokens left");
    let half = t.expired(Duration::from_millis(10_500));
    assert_eq!(half.len(), 50);
    for id in first.into_iter().chain(half) {
        assert!(seen.insert(id), "lease {id} handed out twice");
        t.remove(id).unwrap();
    }
    // A long pause refills at most one second's worth.
    let burst = t.expired(secs(12));
    assert_eq!(burst.len(), 100);
    for id in burst {
        assert!(seen.insert(id));
        t.remove(id).unwrap();
    }
    assert_eq!(t.len(), 750);
}

#[test]
fn only_the_primary_expires_and_renews() {
    let mut t = LeaseTable::new(LessorOptions::default()).unwrap();
    t.grant(1, 10, secs(0)).unwrap();
    assert!(!t.is_primary());
    assert!(t.expired(secs(1_000)).is_empty());
    let err = t.renew(1, secs(0)).unwrap_err();
    assert!(matches!(err, LeaseError::NotPrimary { id: 1 }), "{err}");
    assert!(err.to_string().contains("not leader"), "{err}");
    assert!(t.checkpoint_batch(secs(10_000)).is_empty());

    // Promotion at 100 s: deadline = now + TTL + extension (1 s).
    t.promote(secs(100));
    assert!(t.expired(secs(110)).is_empty());
    assert_eq!(t.expired(secs(111)), vec![1]);
    // Demotion: nothing fires any more.
    t.demote();
    assert!(t.expired(secs(10_000)).is_empty());
    assert!(matches!(
        t.renew(1, secs(0)),
        Err(LeaseError::NotPrimary { .. })
    ));
    assert_eq!(t.iter().next().unwrap().expiry, None);
}

#[test]
fn promotion_uses_the_checkpointed_remaining_ttl() {
    let mut t = LeaseTable::new(LessorOptions::default()).unwrap();
    t.grant(1, 3_600, secs(0)).unwrap();
    t.grant(2, 3_600, secs(0)).unwrap();
    assert!(t.apply_checkpoint(1, 600));
    assert_eq!(t.time_to_live(1, secs(0), false).unwrap().ttl, 600);
    t.promote(secs(1_000));
    assert!(t.expired(secs(1_600)).is_empty());
    assert_eq!(t.expired(secs(1_601)), vec![1]);
    t.remove(1).unwrap();
    assert!(t.expired(secs(4_600)).is_empty());
    assert_eq!(t.expired(secs(4_601)), vec![2]);
}

#[test]
fn checkpoints_come_every_interval_in_bounded_batches() {
    let mut t = LeaseTable::new(LessorOptions {
        checkpoint_batch_limit: 40,
        promote_extension: Some(Duration::ZERO),
        ..LessorOptions::default()
    })
    .unwrap();
    t.promote(secs(0));
    for id in 1..=100 {
        t.grant(id, 3_600, secs(0)).unwrap();
    }
    // Short lease: never checkpointed (its TTL is below the 5 min interval).
    t.grant(1_000, 200, secs(0)).unwrap();
    assert!(t.checkpoint_batch(secs(299)).is_empty());
    let mut all = Vec::new();
    loop {
        let batch = t.checkpoint_batch(secs(300));
        assert!(batch.len() <= 40);
        if batch.is_empty() {
            break;
        }
        all.extend(batch);
    }
    all.sort_by_key(|c| c.id);
    let expected: Vec<Checkpoint> = (1..=100)
        .map(|id| Checkpoint {
            id,
            remaining_ttl: 3_300,
        })
        .collect();
    assert_eq!(all, expected);
    // Next round only one interval later.
    assert!(t.checkpoint_batch(secs(599)).is_empty());
    assert_eq!(t.checkpoint_batch(secs(600)).len(), 40);
    // A renewal of a checkpointed lease asks for the checkpoint to be cleared.
    assert!(t.apply_checkpoint(5, 3_000));
    let r = t.renew(5, secs(600)).unwrap();
    assert_eq!(
        r.checkpoint,
        Some(Checkpoint {
            id: 5,
            remaining_ttl: 0
        })
    );
    // A revoked lease is never checkpointed again, even when its slot is reused.
    t.remove(7).unwrap();
    t.grant(7_000, 3_600, secs(600)).unwrap();
    let mut ids = Vec::new();
    for now in [600, 900] {
        loop {
            let batch = t.checkpoint_batch(secs(now));
            if batch.is_empty() {
                break;
            }
            ids.extend(batch.into_iter().map(|c| c.id));
        }
    }
    assert!(!ids.contains(&7));
    assert!(ids.contains(&7_000));
}

#[test]
fn attach_detach_and_list() {
    let mut t = primary();
    t.grant(1, 60, secs(0)).unwrap();
    t.grant(-4, 60, secs(0)).unwrap();
    t.attach(1, b"b").unwrap();
    t.attach(1, b"a").unwrap();
    t.attach(1, b"a").unwrap();
    assert_eq!(t.keys(1).unwrap(), vec![b"a".to_vec(), b"b".to_vec()]);
    assert!(t.detach(1, b"a").unwrap());
    assert!(!t.detach(1, b"a").unwrap());
    let ttl = t.time_to_live(1, secs(1), true).unwrap();
    assert_eq!((ttl.granted_ttl, ttl.ttl), (60, 59));
    assert_eq!(ttl.keys, vec![b"b".to_vec()]);
    assert_eq!(t.ids(), vec![-4, 1]);
    assert_eq!(t.remove(1).unwrap(), vec![b"b".to_vec()]);
    assert_eq!(t.ids(), vec![-4]);
}

#[test]
fn heavy_renewal_churn_keeps_the_heap_bounded() {
    let mut t = primary();
    for id in 1..=100 {
        t.grant(id, 60, secs(0)).unwrap();
    }
    let before = t.allocated_bytes().structure;
    for round in 0..200u64 {
        for id in 1..=100 {
            t.renew(id, Duration::from_millis(round)).unwrap();
        }
    }
    // 20 000 renewals left 20 000 stale timers behind; sweeping keeps a few thousand.
    let usage = t.allocated_bytes();
    assert!(
        usage.structure < before + 100_000,
        "{usage:?} (before: {before})"
    );
    // All leases still expire once, at their last renewal + 60 s.
    let last = Duration::from_millis(199) + secs(60);
    assert!(t.expired(last - Duration::from_nanos(1)).is_empty());
    let mut fired = t.expired(last);
    fired.sort_unstable();
    assert_eq!(fired, (1..=100).collect::<Vec<_>>());
}

fn no_extension() -> LessorOptions {
    LessorOptions {
        promote_extension: Some(Duration::ZERO),
        ..LessorOptions::default()
    }
}

/// A lease that left the checkpoint schedule (its remaining TTL fell to the interval) and
/// is then renewed to a TTL longer than the interval is checkpointed again.
#[test]
fn a_renewed_lease_is_checkpointed_again() {
    let mut t = LeaseTable::new(no_extension()).unwrap();
    t.promote(secs(0));
    t.grant(1, 600, secs(0)).unwrap();
    let cps = t.checkpoint_batch(secs(300));
    assert_eq!(
        cps,
        vec![Checkpoint {
            id: 1,
            remaining_ttl: 300
        }]
    );
    assert!(t.apply_checkpoint(1, 300));
    let r = t.renew(1, secs(301)).unwrap();
    assert_eq!(
        r.checkpoint,
        Some(Checkpoint {
            id: 1,
            remaining_ttl: 0
        })
    );
    assert!(t.apply_checkpoint(1, 0));
    // 600 s left, more than the 300 s interval: checkpointed one interval after the renewal.
    assert!(t.checkpoint_batch(secs(600)).is_empty());
    assert_eq!(
        t.checkpoint_batch(secs(601)),
        vec![Checkpoint {
            id: 1,
            remaining_ttl: 300
        }]
    );
}

/// A checkpoint produced before a renewal but applied after it must not hand a new primary
/// the remaining TTL from before the renewal: the renewal asks for a clear, which Raft
/// applies after the checkpoint.
#[test]
fn a_checkpoint_applied_after_a_renewal_is_cleared() {
    let mut t = LeaseTable::new(no_extension()).unwrap();
    t.promote(secs(0));
    t.grant(1, 600, secs(0)).unwrap();
    let in_flight = t.checkpoint_batch(secs(300));
    assert_eq!(in_flight.len(), 1);
    let r = t.renew(1, secs(300)).unwrap();
    let clear = r.checkpoint.expect("a clear, though nothing is stored yet");
    assert_eq!(clear.remaining_ttl, 0);
    // In log order: the checkpoint, then the clear.
    t.apply_checkpoint(1, in_flight[0].remaining_ttl);
    t.apply_checkpoint(1, clear.remaining_ttl);
    t.demote();
    t.promote(secs(301));
    // Nothing stored: the new primary gives the full TTL, not the 300 s of the old checkpoint.
    assert_eq!(t.time_to_live(1, secs(301), false).unwrap().ttl, 600);
    // After a promotion the first renewal always asks for a clear: the previous primary may
    // have produced checkpoints that are not applied yet.
    assert!(t.renew(1, secs(302)).unwrap().checkpoint.is_some());
    assert!(t.renew(1, secs(303)).unwrap().checkpoint.is_none());
}

/// A checkpoint never records more than the granted TTL.
#[test]
fn a_checkpoint_never_extends_a_lease_beyond_its_ttl() {
    let mut t = LeaseTable::new(no_extension()).unwrap();
    t.grant(1, 10, secs(0)).unwrap();
    assert!(t.apply_checkpoint(1, i64::MAX));
    assert_eq!(t.checkpointed_ttl(1).unwrap(), 10);
    t.promote(secs(0));
    assert_eq!(t.time_to_live(1, secs(0), false).unwrap().ttl, 10);
    assert_eq!(t.expired(secs(10)), vec![1]);
}

/// A clear that could not be replicated is asked for again by the next renewal: the
/// checkpoint produced before the first renewal may still be applied.
#[test]
fn a_clear_that_was_not_replicated_is_asked_for_again() {
    let mut t = LeaseTable::new(no_extension()).unwrap();
    t.promote(secs(0));
    t.grant(1, 600, secs(0)).unwrap();
    assert_eq!(t.checkpoint_batch(secs(300)).len(), 1);
    assert!(t.renew(1, secs(300)).unwrap().checkpoint.is_some());
    assert!(t.renew(1, secs(301)).unwrap().checkpoint.is_none());
    t.clear_not_replicated(1);
    assert!(t.renew(1, secs(302)).unwrap().checkpoint.is_some());
    assert!(t.renew(1, secs(303)).unwrap().checkpoint.is_none());
    t.clear_not_replicated(99);
}
