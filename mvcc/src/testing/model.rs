//! The model-based store test, generic over the backend.
//!
//! Random sequences of puts, deletes (single keys and ranges), transactions with compares,
//! compactions, ranges at past revisions, history hashes, forced commits and reopens run
//! against a [`Store`] and against an in-memory model of the whole history (one map per
//! revision); after every step the current state, a random past revision and the revision
//! counters are compared, and after every reopen the full state and the hashes recorded
//! before it. A backend crate runs it with one line:
//!
//! ```ignore
//! keel_mvcc::testing::model::run::<MyBackend>(dir.path(), MyOptions::default(), seed, 400);
//! ```
//!
//! A failure names the seed; replay it by passing the same seed (the
//! [`seeds`] helper reads `KEEL_MODEL_SEED`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::Backend;
use crate::error::MvccError;
use crate::kv::KeyValue;
use crate::request::{
    Compare, CompareResult, CompareTarget, DeleteRangeRequest, PutRequest, RangeRequest, TxnOp,
    TxnOpResponse, TxnRequest,
};
use crate::{Store, StoreOptions};

/// One random operation.
#[derive(Clone, Debug)]
pub enum Op {
    /// Put a key.
    Put {
        /// Key.
        key: Vec<u8>,
        /// Value.
        value: Vec<u8>,
        /// Lease.
        lease: i64,
    },
    /// Delete a key (`end = None`) or a range.
    Delete {
        /// Key.
        key: Vec<u8>,
        /// Range end.
        end: Option<Vec<u8>>,
    },
    /// If `key`'s version equals `version`, put `put` and delete `del`, else put `other`.
    Txn {
        /// Compared key.
        key: Vec<u8>,
        /// Expected version.
        version: u64,
        /// Key put on success.
        put: Vec<u8>,
        /// Key deleted on success.
        del: Vec<u8>,
        /// Key put on failure.
        other: Vec<u8>,
        /// Value of the puts.
        value: Vec<u8>,
    },
    /// Compact at a revision.
    Compact(u64),
    /// Range `[key, end)` at a revision with a limit.
    Range {
        /// Key.
        key: Vec<u8>,
        /// Range end.
        end: Option<Vec<u8>>,
        /// Revision (0: current).
        revision: u64,
        /// Limit (0: none).
        limit: usize,
    },
    /// Hash the history at a revision.
    Hash(u64),
    /// Commit the pending batch.
    ForceCommit,
    /// Drop the store and open it again.
    Reopen,
}

/// A key and its new value and lease, or `None` for a deletion.
type Change = (Vec<u8>, Option<(Vec<u8>, i64)>);

/// The model: the state after every revision.
struct Model {
    history: Vec<BTreeMap<Vec<u8>, KeyValue>>,
    compacted: u64,
    /// Hashes seen, by (revision, compaction point).
    hashes: HashMap<(u64, u64), u32>,
}

impl Model {
    fn current(&self) -> u64 {
        (self.history.len() - 1) as u64
    }

    fn latest(&self) -> &BTreeMap<Vec<u8>, KeyValue> {
        self.history.last().expect("history starts with revision 0")
    }

    fn in_range(key: &[u8], start: &[u8], end: Option<&[u8]>) -> bool {
        match end {
            None => key == start,
            Some([0]) => key >= start,
            Some(e) => key >= start && key < e,
        }
    }

    /// Applies one transaction's changes (puts and deletes in order); returns true when it
    /// changed a key (a new revision).
    fn apply(&mut self, changes: &[Change]) -> bool {
        let rev = self.current() + 1;
        let mut next = self.latest().clone();
        let mut changed = false;
        for (key, change) in changes {
            match change {
                Some((value, lease)) => {
                    let prev = next.get(key);
                    let kv = KeyValue {
                        create_revision: prev.map_or(rev, |p| p.create_revision),
                        mod_revision: rev,
                        version: prev.map_or(1, |p| p.version + 1),
                        lease: *lease,
                        ..KeyValue::new(key, value)
                    };
                    next.insert(key.clone(), kv);
                    changed = true;
                }
                None => changed |= next.remove(key).is_some(),
            }
        }
        if changed {
            self.history.push(next);
        }
        changed
    }

    fn range(&self, rev: u64, key: &[u8], end: Option<&[u8]>) -> Vec<KeyValue> {
        self.history[rev as usize]
            .values()
            .filter(|kv| Model::in_range(kv.key(), key, end))
            .cloned()
            .collect()
    }
}

fn key(rng: &mut StdRng) -> Vec<u8> {
    format!("k{:02}", rng.random_range(0..12)).into_bytes()
}

fn gen_op(rng: &mut StdRng, model: &Model) -> Op {
    let current = model.current();
    match rng.random_range(0..100) {
        0..35 => Op::Put {
            key: key(rng),
            value: format!("v{}", rng.random_range(0..1000)).into_bytes(),
            lease: rng.random_range(0..3),
        },
        35..45 => {
            let k = key(rng);
            let end = match rng.random_range(0..4) {
                0 => Some(vec![0]),
                1 => Some(key(rng)).filter(|e| *e >= k),
                _ => None,
            };
            Op::Delete { key: k, end }
        }
        45..60 => {
            let k = key(rng);
            let version = model.latest().get(&k).map_or(0, |kv| kv.version);
            let put = key(rng);
            let mut del = key(rng);
            while del == put {
                del = key(rng);
            }
            Op::Txn {
                key: k,
                version: if rng.random_bool(0.7) {
                    version
                } else {
                    version + 1
                },
                put,
                del,
                other: key(rng),
                value: format!("t{}", rng.random_range(0..1000)).into_bytes(),
            }
        }
        60..64 if current > model.compacted => {
            Op::Compact(rng.random_range(model.compacted + 1..=current))
        }
        64..85 => {
            let k = key(rng);
            let end = match rng.random_range(0..3) {
                0 => Some(vec![0]),
                1 => Some(key(rng)).filter(|e| *e >= k),
                _ => None,
            };
            let revision = if rng.random_bool(0.3) || current == 0 {
                0
            } else {
                rng.random_range(0..=current + 1)
            };
            Op::Range {
                key: k,
                end,
                revision,
                limit: rng.random_range(0..4),
            }
        }
        85..90 => Op::Hash(rng.random_range(0..=current)),
        90..95 => Op::ForceCommit,
        95..100 => Op::Reopen,
        _ => Op::ForceCommit,
    }
}

/// Seeds to run: `KEEL_MODEL_SEED` alone when set, else `count` seeds from `base`.
pub fn seeds(base: u64, count: u64) -> Vec<u64> {
    match std::env::var("KEEL_MODEL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
    {
        Some(seed) => vec![seed],
        None => (base..base + count).collect(),
    }
}

/// Store options that make the model exercise batching: tiny batches, short interval.
pub fn small_batches(rng_seed: u64) -> StoreOptions {
    StoreOptions {
        batch_interval: Duration::from_millis(2),
        batch_limit: 1 + (rng_seed % 7) as usize,
        compaction_batch_limit: 2,
        compaction_sleep_interval: Duration::from_millis(1),
        ..StoreOptions::default()
    }
}

struct SeedReport(u64);

impl Drop for SeedReport {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "model test failed with seed {} (replay: KEEL_MODEL_SEED={})",
                self.0, self.0
            );
        }
    }
}

/// Runs `steps` random operations with `seed` on a store over `B` opened in `dir`, with
/// [`small_batches`] store options; panics on the first divergence from the model.
pub fn run<B: Backend>(dir: &Path, options: B::Options, seed: u64, steps: usize) {
    run_with::<B>(dir, options, small_batches(seed), seed, steps);
}

/// [`run`] with explicit store options.
pub fn run_with<B: Backend>(
    dir: &Path,
    options: B::Options,
    store_options: StoreOptions,
    seed: u64,
    steps: usize,
) {
    let _report = SeedReport(seed);
    let path = dir.join(format!("model-{seed}"));
    let open = |opts: &StoreOptions| {
        let backend = B::open(&path, &options).expect("open backend");
        Store::open(backend, opts.clone()).expect("open store")
    };
    let mut store = open(&store_options);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut model = Model {
        history: vec![BTreeMap::new()],
        compacted: 0,
        hashes: HashMap::new(),
    };
    for step in 0..steps {
        let op = gen_op(&mut rng, &model);
        let ctx = format!("seed {seed} step {step} op {op:?}");
        match op {
            Op::Put { key, value, lease } => {
                let resp = store
                    .put_with(&PutRequest {
                        key: key.clone(),
                        value: value.clone(),
                        lease,
                        prev_kv: true,
                    })
                    .unwrap_or_else(|e| panic!("{ctx}: {e}"));
                let prev = model.latest().get(&key).cloned();
                model.apply(&[(key, Some((value, lease)))]);
                assert_eq!(resp.revision, model.current(), "{ctx}: put revision");
                assert_eq!(resp.prev_kv, prev, "{ctx}: put prev_kv");
            }
            Op::Delete { key, end } => {
                let resp = store
                    .delete_with(&DeleteRangeRequest {
                        key: key.clone(),
                        range_end: end.clone(),
                        prev_kv: true,
                    })
                    .unwrap_or_else(|e| panic!("{ctx}: {e}"));
                let victims = model.range(model.current(), &key, end.as_deref());
                let changes: Vec<_> = victims.iter().map(|kv| (kv.key().to_vec(), None)).collect();
                model.apply(&changes);
                assert_eq!(resp.deleted, victims.len(), "{ctx}: deleted count");
                assert_eq!(resp.prev_kvs, victims, "{ctx}: deleted pairs");
                assert_eq!(resp.revision, model.current(), "{ctx}: delete revision");
            }
            Op::Txn {
                key,
                version,
                put,
                del,
                other,
                value,
            } => {
                let req = TxnRequest {
                    compare: vec![Compare::new(
                        key.clone(),
                        CompareResult::Equal,
                        CompareTarget::Version(version),
                    )],
                    success: vec![
                        TxnOp::Put(PutRequest::new(put.clone(), value.clone())),
                        TxnOp::DeleteRange(DeleteRangeRequest::key(del.clone())),
                        TxnOp::Range(RangeRequest::key(put.clone())),
                    ],
                    failure: vec![TxnOp::Put(PutRequest::new(other.clone(), value.clone()))],
                };
                let resp = store.txn(&req).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                let ok = model.latest().get(&key).map_or(0, |kv| kv.version) == version;
                assert_eq!(resp.succeeded, ok, "{ctx}: txn branch");
                if ok {
                    model.apply(&[(put.clone(), Some((value, 0))), (del, None)]);
                    let TxnOpResponse::Range(r) = &resp.responses[2] else {
                        panic!("{ctx}: third response is not a range");
                    };
                    assert_eq!(
                        r.kvs.first(),
                        model.latest().get(&put),
                        "{ctx}: range in txn sees the txn's put"
                    );
                } else {
                    model.apply(&[(other, Some((value, 0)))]);
                }
                assert_eq!(resp.revision, model.current(), "{ctx}: txn revision");
            }
            Op::Compact(rev) => {
                store.compact(rev).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                model.compacted = rev;
                let again = store.compact(rev);
                assert!(
                    matches!(again, Err(MvccError::Compacted { .. })),
                    "{ctx}: compacting twice at {rev} gave {again:?}"
                );
            }
            Op::Range {
                key,
                end,
                revision,
                limit,
            } => {
                let req = RangeRequest {
                    key: key.clone(),
                    range_end: end.clone(),
                    revision,
                    limit,
                    ..RangeRequest::default()
                };
                let got = store.range(&req);
                let current = model.current();
                let at = if revision == 0 { current } else { revision };
                if revision > current {
                    assert!(
                        matches!(got, Err(MvccError::FutureRevision { .. })),
                        "{ctx}: future read gave {got:?}"
                    );
                } else if at < model.compacted {
                    assert!(
                        matches!(got, Err(MvccError::Compacted { .. })),
                        "{ctx}: compacted read gave {got:?}"
                    );
                } else {
                    let got = got.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    let want = model.range(at, &key, end.as_deref());
                    let n = if limit == 0 {
                        want.len()
                    } else {
                        limit.min(want.len())
                    };
                    assert_eq!(got.count, want.len(), "{ctx}: count");
                    assert_eq!(got.kvs, want[..n], "{ctx}: kvs");
                    assert_eq!(got.more, n < want.len(), "{ctx}: more");
                    assert_eq!(got.revision, at, "{ctx}: revision");
                }
            }
            Op::Hash(rev) => {
                let got = store.hash_kv(rev);
                let at = if rev == 0 { model.current() } else { rev };
                if at < model.compacted {
                    assert!(
                        matches!(got, Err(MvccError::Compacted { .. })),
                        "{ctx}: compacted hash gave {got:?}"
                    );
                } else {
                    let h = got.unwrap_or_else(|e| panic!("{ctx}: {e}"));
                    assert_eq!((h.revision, h.compact_revision), (at, model.compacted));
                    let seen = *model.hashes.entry((at, model.compacted)).or_insert(h.hash);
                    assert_eq!(seen, h.hash, "{ctx}: hash changed for the same history");
                }
            }
            Op::ForceCommit => store
                .force_commit()
                .unwrap_or_else(|e| panic!("{ctx}: {e}")),
            Op::Reopen => {
                drop(store);
                store = open(&store_options);
                check_all(&store, &model, &ctx);
            }
        }
        assert_eq!(
            store.current_revision(),
            model.current(),
            "{ctx}: current revision"
        );
        assert_eq!(
            store.compacted_revision(),
            model.compacted,
            "{ctx}: compacted revision"
        );
        let all = RangeRequest::range(vec![0], vec![0]);
        let got = store.range(&all).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let want: Vec<KeyValue> = model.latest().values().cloned().collect();
        assert_eq!(got.kvs, want, "{ctx}: current state");
        if model.current() >= 1 {
            let past = rng.random_range(model.compacted.max(1)..=model.current());
            let got = store
                .range(&all.clone().at(past))
                .unwrap_or_else(|e| panic!("{ctx}: read at {past}: {e}"));
            assert_eq!(
                got.kvs,
                model.range(past, &[0], Some(&[0])),
                "{ctx}: state at revision {past}"
            );
        }
    }
    drop(store);
    let store = open(&store_options);
    check_all(&store, &model, &format!("seed {seed} final reopen"));
}

fn check_all<B: Backend>(store: &Store<B>, model: &Model, ctx: &str) {
    assert_eq!(
        store.current_revision(),
        model.current(),
        "{ctx}: revision after reopen"
    );
    assert_eq!(
        store.compacted_revision(),
        model.compacted,
        "{ctx}: compaction after reopen"
    );
    for rev in model.compacted.max(1)..=model.current() {
        let req = RangeRequest::range(vec![0], vec![0]).at(rev);
        let got = store
            .range(&req)
            .unwrap_or_else(|e| panic!("{ctx}: at {rev}: {e}"));
        assert_eq!(
            got.kvs,
            model.range(rev, &[0], Some(&[0])),
            "{ctx}: state at {rev}"
        );
    }
    for (&(rev, compacted), &hash) in &model.hashes {
        if compacted == model.compacted && rev >= compacted {
            let h = store
                .hash_kv(rev)
                .unwrap_or_else(|e| panic!("{ctx}: hash {rev}: {e}"));
            assert_eq!(h.hash, hash, "{ctx}: hash at {rev} changed across reopen");
        }
    }
}
