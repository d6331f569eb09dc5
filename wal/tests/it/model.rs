//! Pins down the log against an in-memory model: random sequences of appends (small entries
//! through the write buffer, large ones written from their own buffers), conflict
//! truncations (to a new term or the same one), hard states, snapshot markers, releases and reopens, compared after every
//! step. `KEEL_WAL_MODEL_SEEDS=<n>` runs more seeds.

use std::collections::BTreeMap;

use keel_wal::{Entry, HardState, Metadata, SnapshotMarker, Wal, WalOptions};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::util::data;

#[derive(Debug, Default)]
struct Model {
    entries: BTreeMap<u64, Entry>,
    first: u64,
    last: u64,
    hard_state: Option<HardState>,
    snapshot: Option<SnapshotMarker>,
    metadata: Option<Metadata>,
}

impl Model {
    fn lowest_writable(&self) -> u64 {
        self.first.max(self.snapshot.map_or(1, |s| s.index + 1))
    }
    fn check(&self, wal: &Wal, ctx: &str) {
        assert_eq!(wal.first_index(), self.first, "{ctx}: first index");
        assert_eq!(wal.last_index(), self.last, "{ctx}: last index");
        assert_eq!(wal.hard_state(), self.hard_state, "{ctx}: hard state");
        assert_eq!(wal.snapshot_marker(), self.snapshot, "{ctx}: snapshot");
        assert_eq!(wal.metadata(), self.metadata, "{ctx}: metadata");
        if self.first <= self.last {
            let got = wal.entries(self.first, self.last + 1, None).unwrap();
            let want: Vec<Entry> = self
                .entries
                .range(self.first..)
                .map(|(_, e)| e.clone())
                .collect();
            assert_eq!(got.len(), want.len(), "{ctx}: entry count");
            assert!(got == want, "{ctx}: entries differ");
            assert_eq!(
                wal.term(self.last).unwrap(),
                Some(want[want.len() - 1].term),
                "{ctx}"
            );
            // A read starting in the middle (often at a next entry record).
            let mid = self.first + (self.last - self.first) / 2;
            let got = wal.entries(mid, self.last + 1, None).unwrap();
            assert!(
                got == want[(mid - self.first) as usize..],
                "{ctx}: entries from {mid}"
            );
        }
    }
}

fn opts() -> WalOptions {
    WalOptions {
        segment_size: 64 << 10,
        ..WalOptions::default()
    }
}

fn run(seed: u64, steps: usize) {
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let mut wal = Wal::open(dir.path(), opts()).unwrap();
    let mut m = Model {
        first: 1,
        last: 0,
        ..Model::default()
    };
    let mut term = 1u64;
    for step in 0..steps {
        let ctx = format!("seed {seed} step {step}");
        let op = rng.random_range(0..100);
        let make = |i: u64, t: u64, rng: &mut StdRng| Entry {
            index: i,
            term: t,
            data: data(i, t, rng.random_range(1..600)),
        };
        if op < 45 {
            // Now and then a durable batch of large entries, which goes out straight from
            // the entries' buffers rather than through the write buffer.
            let large = rng.random_bool(0.1);
            let n = if large {
                rng.random_range(8..14u64)
            } else {
                rng.random_range(1..20u64)
            };
            let es: Vec<Entry> = (m.last + 1..m.last + 1 + n)
                .map(|i| {
                    let mut e = make(i, term, &mut rng);
                    if large {
                        e.data.resize(e.data.len() + 4096, i as u8 | 1);
                    }
                    e
                })
                .collect();
            let hs = rng.random_bool(0.3).then_some(HardState {
                term,
                vote: 1,
                commit: m.last,
            });
            wal.append(&es, hs.as_ref(), large || rng.random_bool(0.5))
                .unwrap();
            for e in es {
                m.entries.insert(e.index, e);
            }
            m.last += n;
            if hs.is_some() {
                m.hard_state = hs;
            }
        } else if op < 60 {
            let lo = m.lowest_writable();
            if lo > m.last {
                continue;
            }
            // Mostly a new term; sometimes the same one, so the replacing entry follows
            // (in the file) an entry of its own term at a higher index.
            if rng.random_bool(0.75) {
                term += 1;
            }
            let start = rng.random_range(lo..=m.last);
            let n = rng.random_range(1..10u64);
            let es: Vec<Entry> = (start..start + n)
                .map(|i| make(i, term, &mut rng))
                .collect();
            wal.append(&es, None, true).unwrap();
            m.entries.split_off(&start);
            for e in es {
                m.entries.insert(e.index, e);
            }
            m.last = start + n - 1;
        } else if op < 67 {
            let hs = HardState {
                term,
                vote: rng.random_range(0..5),
                commit: m.last,
            };
            wal.append(&[], Some(&hs), true).unwrap();
            m.hard_state = Some(hs);
        } else if op < 74 {
            let lo = m
                .snapshot
                .map_or(0, |s| s.index)
                .max(m.first.saturating_sub(1));
            let index = rng.random_range(lo..=m.last + 3);
            let t = m.entries.get(&index).map_or(term, |e| e.term);
            let mk = SnapshotMarker { index, term: t };
            wal.save_snapshot_marker(&mk).unwrap();
            m.snapshot = Some(mk);
            if index >= m.last {
                m.entries.clear();
                m.first = index + 1;
                m.last = index;
            } else {
                m.first = m.first.max(index + 1);
                m.entries = m.entries.split_off(&m.first);
            }
        } else if op < 82 {
            let at = rng.random_range(m.first.saturating_sub(1)..=m.last + 2);
            wal.release_to(at).unwrap();
            let f = wal.first_index();
            assert!(f >= m.first, "{ctx}: release moved first index down");
            if at >= m.first && at <= m.last {
                assert!(f <= at, "{ctx}: release_to({at}) released entry {at}");
            }
            m.first = f;
            m.entries = m.entries.split_off(&f);
        } else if op < 85 {
            let meta = Metadata {
                cluster_id: rng.random(),
                member_id: rng.random_range(1..9),
            };
            wal.set_metadata(&meta).unwrap();
            m.metadata = Some(meta);
        } else {
            drop(wal);
            // Both ways of recovering: on the opening thread, or on several.
            let threads = rng.random_range(1..=4);
            wal = Wal::open(
                dir.path(),
                WalOptions {
                    recovery_threads: threads,
                    ..opts()
                },
            )
            .unwrap();
            m.check(
                &wal,
                &format!("{ctx} after reopen with {threads} recovery threads"),
            );
        }
        m.check(&wal, &ctx);
    }
    drop(wal);
    let wal = Wal::open(dir.path(), opts()).unwrap();
    m.check(&wal, &format!("seed {seed}: final reopen"));
}

#[test]
fn random_operations_match_the_model() {
    let seeds: u64 = std::env::var("KEEL_WAL_MODEL_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6);
    for seed in 0..seeds {
        println!("model seed {seed}");
        run(seed, 400);
    }
}
