//! Pins down durability under real crashes: a child process appending with sync is killed
//! with SIGKILL at random moments; after reopen every entry whose append returned Ok is
//! present and identical. 50 rounds by default; `KEEL_CRASH_ROUNDS=1000` for more. The child
//! releases old segments as it goes, so crashes also land in the middle of releasing and
//! recycling segment files; every other round it appends from 4 threads sharing syncs
//! (group commit), each acknowledging its entry once its own durable wait returned.
//!
//! The child is this test binary re-run as `crash::writer_child --ignored --exact` with
//! `KEEL_WAL_CRASH_DIR` set.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use keel_wal::{HardState, Wal, WalOptions};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::util::entry;

fn opts() -> WalOptions {
    WalOptions {
        segment_size: 64 << 10,
        ..WalOptions::default()
    }
}

/// The writer role: appends batches durably and reports each acknowledged last index on
/// stdout after `append` returned. Does nothing unless run by the crash test.
#[test]
#[ignore]
fn writer_child() {
    let Ok(dir) = std::env::var("KEEL_WAL_CRASH_DIR") else {
        return;
    };
    let wal = Wal::open(std::path::Path::new(&dir), opts()).unwrap();
    let threads: usize = std::env::var("KEEL_WAL_CRASH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    if threads > 1 {
        // Indices are taken and entries buffered under one lock (so they stay consecutive);
        // the durable wait is shared.
        let next = parking_lot::Mutex::new(wal.last_index() + 1);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    loop {
                        let index = {
                            let mut n = next.lock();
                            wal.append(&[entry(*n, 1)], None, false).unwrap();
                            *n += 1;
                            *n - 1
                        };
                        wal.sync().unwrap();
                        println!("ack {index}");
                        if index % 50 == 0 && wal.segment_count() > 3 {
                            wal.release_to(index.saturating_sub(300)).unwrap();
                        }
                    }
                });
            }
        });
    }
    let mut next = wal.last_index() + 1;
    let mut k = 0u64;
    loop {
        let n = 1 + (k % 7);
        let es: Vec<_> = (next..next + n).map(|i| entry(i, 1)).collect();
        let hs = HardState {
            term: 1,
            vote: 1,
            commit: next + n - 1,
        };
        wal.append(&es, Some(&hs), true).unwrap();
        next += n;
        k += 1;
        println!("ack {}", next - 1);
        if wal.segment_count() > 3 {
            wal.release_to(next.saturating_sub(300)).unwrap();
        }
    }
}

#[test]
fn sigkill_loses_no_acknowledged_append() {
    let rounds: u64 = std::env::var("KEEL_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let seed = rand::random::<u64>();
    println!("crash test seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    // Highest index an append acknowledged (hard state included), and highest index known
    // present (acknowledged, or found after a reopen).
    let mut acked = 0u64;
    let mut present = 0u64;
    // Highest hard state commit an append acknowledged.
    let mut hs_acked = 0u64;
    let start = Instant::now();
    for round in 0..rounds {
        let mut child = Command::new(&exe)
            .args([
                "crash::writer_child",
                "--ignored",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("KEEL_WAL_CRASH_DIR", dir.path())
            .env(
                "KEEL_WAL_CRASH_THREADS",
                if round % 2 == 1 { "4" } else { "1" },
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut last = 0u64;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(n) = line.strip_prefix("ack ") {
                    last = last.max(n.parse().unwrap());
                }
            }
            last
        });
        std::thread::sleep(Duration::from_millis(rng.random_range(20..120)));
        child.kill().unwrap();
        child.wait().unwrap();
        let round_acked = reader.join().unwrap();
        acked = acked.max(round_acked);
        if round % 2 == 0 {
            // Single-threaded rounds write a hard state with each append.
            hs_acked = hs_acked.max(round_acked);
        }

        let wal = Wal::open(dir.path(), opts())
            .unwrap_or_else(|e| panic!("seed {seed} round {round}: reopen failed: {e}"));
        let last = wal.last_index();
        assert!(
            last >= acked.max(present),
            "seed {seed} round {round}: last index {last} < acknowledged {acked}"
        );
        let first = wal.first_index();
        assert!(
            first <= acked.max(present) + 1,
            "seed {seed} round {round}: first index {first} past everything acknowledged"
        );
        let got = wal.entries(first, last + 1, None).unwrap();
        for e in &got {
            assert_eq!(
                *e,
                entry(e.index, 1),
                "seed {seed} round {round}: entry {} differs",
                e.index
            );
        }
        let hs = wal.hard_state().unwrap_or_default();
        assert!(
            hs.commit >= hs_acked,
            "seed {seed} round {round}: hard state {hs:?} < {hs_acked}"
        );
        // Everything that survived must stay from now on.
        present = last;
    }
    assert!(acked > 0, "the child never acknowledged an append");
    println!("{rounds} rounds, {acked} entries, {:?}", start.elapsed());
}
