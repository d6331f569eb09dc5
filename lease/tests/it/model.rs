//! Model-based test: random grant / put / delete / txn / renew / revoke / advance-clock /
//! expire / checkpoint / promote / demote / reopen sequences against a trivially correct
//! model.
//!
//! `KEEL_LEASE_MODEL_CASES=500 cargo test -p keel-lease --test it model` runs more cases;
//! `KEEL_LEASE_MODEL_SEED=<seed>` replays the one a failure printed.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use keel_lease::{Checkpoint, LeaseError, Lessor, ManualClock};
use keel_mvcc::testing::MemBackend;
use keel_mvcc::{
    Compare, CompareResult, CompareTarget, DeleteRangeRequest, PutRequest, TxnOp, TxnRequest,
};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::common::{keys_with_leases, mem_path, open_lessor, open_store};

const NANOS: u64 = 1_000_000_000;
const MIN_TTL: i64 = 2;
const EXTENSION: u64 = NANOS;

#[derive(Debug, Clone, Copy)]
enum Op {
    Grant {
        id: i64,
        ttl: i64,
    },
    Put {
        key: u8,
        lease: i64,
    },
    Delete {
        key: u8,
    },
    /// If `key` is missing, put it with `lease`; otherwise delete `other`.
    Txn {
        key: u8,
        lease: i64,
        other: u8,
    },
    Renew {
        id: i64,
    },
    Revoke {
        id: i64,
    },
    Advance {
        millis: u64,
    },
    Expire,
    Checkpoint,
    Promote,
    Demote,
    Reopen,
}

fn random_op(rng: &mut StdRng) -> Op {
    let id = rng.random_range(0..=10i64);
    match rng.random_range(0..100) {
        0..15 => Op::Grant {
            id,
            ttl: rng.random_range(-1..=900),
        },
        15..35 => Op::Put {
            key: rng.random_range(0..16),
            lease: if rng.random_bool(0.2) { 0 } else { id },
        },
        35..38 => Op::Delete {
            key: rng.random_range(0..16),
        },
        38..40 => Op::Txn {
            key: rng.random_range(0..16),
            lease: id,
            other: rng.random_range(0..16),
        },
        40..50 => Op::Renew { id },
        50..56 => Op::Revoke { id },
        56..74 => Op::Advance {
            millis: rng.random_range(0..200_000),
        },
        74..82 => Op::Expire,
        82..90 => Op::Checkpoint,
        90..94 => Op::Promote,
        94..96 => Op::Demote,
        _ => Op::Reopen,
    }
}

#[derive(Debug, Clone, Copy)]
struct ModelLease {
    ttl: i64,
    remaining: i64,
    /// Deadline in nanoseconds; `None` on a non-primary.
    expiry: Option<u64>,
    /// A checkpoint may have been produced since the last clear (by this primary, or by an
    /// earlier one before a promotion): the next renewal asks for a clear.
    in_flight: bool,
}

#[derive(Default)]
struct Model {
    leases: BTreeMap<i64, ModelLease>,
    keys: BTreeMap<Vec<u8>, i64>,
    primary: bool,
    now: u64,
}

impl Model {
    fn base(l: &ModelLease) -> i64 {
        if l.remaining > 0 { l.remaining } else { l.ttl }
    }

    fn expected_ttl(&self, l: &ModelLease) -> i64 {
        match l.expiry {
            Some(e) => e.saturating_sub(self.now).div_ceil(NANOS) as i64,
            None => Model::base(l),
        }
    }
}

fn key_of(k: u8) -> Vec<u8> {
    format!("k{k:02}").into_bytes()
}

struct SeedGuard(u64);

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "lease model test failed with seed {0}; replay with KEEL_LEASE_MODEL_SEED={0}",
                self.0
            );
        }
    }
}

fn check(lessor: &Lessor<MemBackend>, model: &Model, step: usize, op: Op) {
    let ids: Vec<i64> = model.leases.keys().copied().collect();
    assert_eq!(lessor.leases(), ids, "step {step} after {op:?}");
    assert_eq!(lessor.is_primary(), model.primary, "step {step}");
    for (&id, l) in &model.leases {
        let ttl = lessor.time_to_live(id, true).unwrap();
        assert_eq!(ttl.granted_ttl, l.ttl, "step {step} lease {id}");
        assert_eq!(
            ttl.ttl,
            model.expected_ttl(l),
            "step {step} lease {id} after {op:?}"
        );
        let keys: Vec<Vec<u8>> = model
            .keys
            .iter()
            .filter(|&(_, &lease)| lease == id)
            .map(|(k, _)| k.clone())
            .collect();
        assert_eq!(ttl.keys, keys, "step {step} lease {id} keys");
    }
    let stored: Vec<(Vec<u8>, i64)> = model.keys.iter().map(|(k, &l)| (k.clone(), l)).collect();
    assert_eq!(
        keys_with_leases(lessor.store()),
        stored,
        "step {step} store keys"
    );
}

/// How often the interesting paths were taken, so the test proves it covered them.
#[derive(Debug, Default)]
struct Coverage {
    expired: usize,
    checkpoints: usize,
    renewals_cleared: usize,
    revoked_keys: usize,
    reopened_with_leases: usize,
}

fn run(seed: u64, steps: usize, cov: &mut Coverage) {
    let _guard = SeedGuard(seed);
    let mut rng = StdRng::seed_from_u64(seed);
    let path = mem_path("model");
    let clock = Arc::new(ManualClock::new());
    let mut store = open_store(&path);
    let mut lessor = open_lessor(&store, &clock);
    let mut model = Model::default();
    for step in 0..steps {
        let op = random_op(&mut rng);
        match op {
            Op::Grant { id, ttl } => {
                let got = lessor.grant(id, ttl, None);
                if id == 0 {
                    assert!(matches!(got, Err(LeaseError::ReservedId)), "{got:?}");
                } else if ttl <= 0 {
                    assert!(
                        matches!(got, Err(LeaseError::TtlNotPositive { .. })),
                        "{got:?}"
                    );
                } else if model.leases.contains_key(&id) {
                    assert!(
                        matches!(got, Err(LeaseError::AlreadyExists { .. })),
                        "{got:?}"
                    );
                } else {
                    let ttl = ttl.max(MIN_TTL);
                    assert_eq!(got.unwrap(), ttl);
                    let expiry = model.primary.then(|| model.now + ttl as u64 * NANOS);
                    model.leases.insert(
                        id,
                        ModelLease {
                            ttl,
                            remaining: 0,
                            expiry,
                            in_flight: false,
                        },
                    );
                }
            }
            Op::Put { key, lease } => {
                let got = lessor.put(&key_of(key), b"v", lease, None);
                if lease != 0 && !model.leases.contains_key(&lease) {
                    assert!(matches!(got, Err(LeaseError::NotFound { .. })), "{got:?}");
                } else {
                    let prev = got.unwrap().prev_kv.map(|kv| kv.lease);
                    assert_eq!(prev, model.keys.insert(key_of(key), lease));
                }
            }
            Op::Delete { key } => {
                let got = lessor.delete_range(&key_of(key), None, None).unwrap();
                let existed = model.keys.remove(&key_of(key)).is_some();
                assert_eq!(got.deleted, usize::from(existed));
            }
            Op::Txn { key, lease, other } => {
                let req = TxnRequest {
                    compare: vec![Compare::new(
                        key_of(key),
                        CompareResult::Equal,
                        CompareTarget::Version(0),
                    )],
                    success: vec![TxnOp::Put(PutRequest {
                        lease,
                        ..PutRequest::new(key_of(key), b"t".to_vec())
                    })],
                    failure: vec![TxnOp::DeleteRange(DeleteRangeRequest::key(key_of(other)))],
                };
                let got = lessor.txn(&req, None);
                if lease != 0 && !model.leases.contains_key(&lease) {
                    assert!(matches!(got, Err(LeaseError::NotFound { .. })), "{got:?}");
                } else {
                    let missing = !model.keys.contains_key(&key_of(key));
                    assert_eq!(got.unwrap().succeeded, missing);
                    if missing {
                        model.keys.insert(key_of(key), lease);
                    } else {
                        model.keys.remove(&key_of(other));
                    }
                }
            }
            Op::Renew { id } => {
                let got = lessor.renew(id);
                let now = model.now;
                match model.leases.get_mut(&id) {
                    _ if !model.primary => {
                        assert!(matches!(got, Err(LeaseError::NotPrimary { .. })), "{got:?}")
                    }
                    Some(l) if l.expiry.is_some_and(|e| e > now) => {
                        let renewal = got.unwrap();
                        assert_eq!(renewal.ttl, l.ttl);
                        l.expiry = Some(now + l.ttl as u64 * NANOS);
                        let clear = renewal.checkpoint;
                        assert_eq!(
                            clear.is_some(),
                            l.remaining > 0 || l.in_flight,
                            "step {step}"
                        );
                        l.in_flight = false;
                        if let Some(cp) = clear {
                            cov.renewals_cleared += 1;
                            assert_eq!(
                                cp,
                                Checkpoint {
                                    id,
                                    remaining_ttl: 0
                                }
                            );
                            assert_eq!(lessor.apply_checkpoints(&[cp], None).unwrap(), 1);
                            l.remaining = 0;
                        }
                    }
                    _ => assert!(matches!(got, Err(LeaseError::NotFound { .. })), "{got:?}"),
                }
            }
            Op::Revoke { id } => {
                let got = lessor.revoke(id, None);
                if model.leases.remove(&id).is_some() {
                    let before = model.keys.len();
                    model.keys.retain(|_, &mut l| l != id);
                    let deleted = got.unwrap().deleted;
                    assert_eq!(deleted, before - model.keys.len());
                    cov.revoked_keys += deleted;
                } else {
                    assert!(matches!(got, Err(LeaseError::NotFound { .. })), "{got:?}");
                }
            }
            Op::Advance { millis } => {
                clock.advance(Duration::from_millis(millis));
                model.now += millis * 1_000_000;
            }
            Op::Expire => {
                let mut got = lessor.expired_leases();
                got.sort_unstable();
                let now = model.now;
                let expected: Vec<i64> = model
                    .leases
                    .iter()
                    .filter(|(_, l)| l.expiry.is_some_and(|e| e <= now))
                    .map(|(&id, _)| id)
                    .collect();
                assert_eq!(got, expected, "step {step}: expired leases");
                for id in got {
                    cov.expired += 1;
                    lessor.revoke(id, None).unwrap();
                    model.leases.remove(&id);
                    model.keys.retain(|_, &mut l| l != id);
                }
            }
            Op::Checkpoint => loop {
                let batch = lessor.checkpoint_batch();
                if batch.is_empty() {
                    break;
                }
                assert!(model.primary);
                for cp in &batch {
                    let l = model
                        .leases
                        .get_mut(&cp.id)
                        .expect("checkpoint of a live lease");
                    let expiry = l.expiry.expect("primary");
                    assert!(expiry > model.now);
                    let left = (expiry - model.now).div_ceil(NANOS) as i64;
                    assert_eq!(cp.remaining_ttl, left, "step {step} lease {}", cp.id);
                    assert!(left < l.ttl);
                    l.remaining = left;
                    l.in_flight = true;
                }
                assert_eq!(lessor.apply_checkpoints(&batch, None).unwrap(), batch.len());
                cov.checkpoints += batch.len();
            },
            Op::Promote => {
                lessor.promote();
                model.primary = true;
                let now = model.now;
                for l in model.leases.values_mut() {
                    l.expiry = Some(now + EXTENSION + Model::base(l) as u64 * NANOS);
                    l.in_flight = true;
                }
            }
            Op::Demote => {
                lessor.demote();
                model.primary = false;
                for l in model.leases.values_mut() {
                    l.expiry = None;
                }
            }
            Op::Reopen => {
                store.force_commit().unwrap();
                drop(lessor);
                drop(store);
                store = open_store(&path);
                lessor = open_lessor(&store, &clock);
                model.primary = false;
                for l in model.leases.values_mut() {
                    l.expiry = None;
                }
                if !model.leases.is_empty() {
                    cov.reopened_with_leases += 1;
                }
            }
        }
        check(&lessor, &model, step, op);
    }
}

#[test]
fn random_sequences_match_the_model() {
    if let Some(seed) = std::env::var("KEEL_LEASE_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        run(seed, 400, &mut Coverage::default());
        return;
    }
    let cases: u64 = std::env::var("KEEL_LEASE_MODEL_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let mut cov = Coverage::default();
    for seed in 0..cases {
        run(seed, 200, &mut cov);
    }
    assert!(
        cov.expired > 0
            && cov.checkpoints > 0
            && cov.renewals_cleared > 0
            && cov.revoked_keys > 0
            && cov.reopened_with_leases > 0,
        "the random sequences missed a path: {cov:?}"
    );
    eprintln!("lease model coverage over {cases} cases: {cov:?}");
}
