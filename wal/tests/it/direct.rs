//! Pins down durable appends large enough to be written straight from the entries' own
//! buffers (one vectored write, no copy): records identical to the copying path's (odd data
//! lengths and their padding, a hard state after the entries, records buffered before them,
//! rotation), short writes completed, a failed write poisoning the log while everything
//! acknowledged before it stays readable, and concurrent appenders of both kinds leaving
//! every record in index order.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use keel_wal::{Entry, HardState, Wal, WalError, WalOptions};

use crate::util::{FaultFs, data};

fn opts(fs: FaultFs) -> WalOptions {
    WalOptions {
        segment_size: 1 << 20,
        fs: Arc::new(fs),
        ..WalOptions::default()
    }
}

/// `n` entries from `lo` whose data lengths run over every remainder mod 8 and average
/// over 2 KiB, so a batch of 16 or more takes the direct path.
fn big(lo: u64, n: u64, term: u64) -> Vec<Entry> {
    (lo..lo + n)
        .map(|i| {
            let mut d = data(i, term, 64);
            d.resize(2100 + (i % 61) as usize, (i as u8) | 1);
            Entry {
                index: i,
                term,
                data: d,
            }
        })
        .collect()
}

#[test]
fn direct_appends_read_back_like_copied_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, _) = FaultFs::new();
    let mut want = Vec::new();
    let hs = HardState {
        term: 3,
        vote: 2,
        commit: 17,
    };
    {
        let wal = Wal::open(dir.path(), opts(fs.clone())).unwrap();
        let mut next = 1;
        for round in 0..40u64 {
            // Small unsynced appends buffered ahead of the direct write.
            let small = big(next, 1 + round % 3, 1)
                .into_iter()
                .map(|mut e| {
                    e.data.truncate(10 + round as usize);
                    e
                })
                .collect::<Vec<_>>();
            wal.append(&small, None, false).unwrap();
            want.extend(small);
            next = want.len() as u64 + 1;
            let batch = big(next, 20 + round % 7, 1);
            let h = (round % 4 == 0).then_some(HardState {
                commit: round,
                ..hs
            });
            wal.append(&batch, h.as_ref(), true).unwrap();
            want.extend(batch);
            next = want.len() as u64 + 1;
            assert_eq!(wal.entries(1, next, None).unwrap(), want, "round {round}");
        }
        assert!(wal.segment_count() > 1, "the test rotates");
        assert_eq!(wal.stats().direct_writes, 40, "{:?}", wal.stats());
        wal.append(&[], Some(&hs), true).unwrap();
    }
    let wal = Wal::open(dir.path(), opts(fs)).unwrap();
    assert_eq!(wal.last_index(), want.len() as u64);
    assert_eq!(wal.entries(1, want.len() as u64 + 1, None).unwrap(), want);
    assert_eq!(wal.hard_state(), Some(hs));
}

#[test]
fn short_direct_writes_are_completed() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    faults.short_writes.store(true, Ordering::SeqCst);
    let want = big(1, 200, 2);
    {
        let wal = Wal::open(dir.path(), opts(fs.clone())).unwrap();
        for c in want.chunks(50) {
            wal.append(c, None, true).unwrap();
        }
        assert_eq!(wal.stats().direct_writes, 4);
    }
    faults.short_writes.store(false, Ordering::SeqCst);
    let wal = Wal::open(dir.path(), opts(fs)).unwrap();
    assert_eq!(wal.entries(1, 201, None).unwrap(), want);
}

#[test]
fn a_failed_direct_write_poisons_and_keeps_what_was_acknowledged() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    let acked = big(1, 100, 1);
    {
        let wal = Wal::open(dir.path(), opts(fs.clone())).unwrap();
        wal.append(&acked, None, true).unwrap();
        // Buffered, not acknowledged: goes out with the direct write that fails.
        wal.append(&big(101, 2, 1), None, false).unwrap();
        faults.enospc_write.store(true, Ordering::SeqCst);
        let err = wal.append(&big(103, 100, 1), None, true).unwrap_err();
        assert!(err.is_disk_full(), "{err}");
        assert_eq!(
            wal.stats().direct_writes,
            1,
            "the failed write was the direct one"
        );
        faults.enospc_write.store(false, Ordering::SeqCst);
        for attempt in [wal.append(&big(103, 100, 1), None, true), wal.sync()] {
            let e = attempt.unwrap_err();
            assert!(matches!(e, WalError::Poisoned { .. }), "{e}");
        }
        // Entries of the failed write are never served.
        assert!(wal.entries(103, 104, None).is_err());
        assert_eq!(wal.entries(1, 101, None).unwrap(), acked);
    }
    let wal = Wal::open(dir.path(), opts(fs)).unwrap();
    assert!(wal.last_index() >= 100);
    assert_eq!(wal.entries(1, 101, None).unwrap(), acked);
}

/// Threads appending single small entries (buffered, then `sync`) and threads appending
/// large batches (written directly) share the log; every record lands in index order with
/// its own data, and the log reopens to exactly the acknowledged sequence.
#[test]
fn concurrent_direct_and_buffered_appends_keep_index_order() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    faults.sync_delay_us.store(300, Ordering::SeqCst);
    let wal = Arc::new(Wal::open(dir.path(), opts(fs.clone())).unwrap());
    let next = parking_lot::Mutex::new(1u64);
    std::thread::scope(|s| {
        for t in 0..6 {
            let (wal, next) = (wal.clone(), &next);
            s.spawn(move || {
                for _ in 0..30 {
                    if t < 2 {
                        let mut n = next.lock();
                        let batch = big(*n, 40, 1);
                        *n += 40;
                        // Durable inside the lock, so indices stay consecutive.
                        wal.append(&batch, None, true).unwrap();
                    } else {
                        {
                            let mut n = next.lock();
                            wal.append(&big(*n, 1, 1), None, false).unwrap();
                            *n += 1;
                        }
                        wal.sync().unwrap();
                    }
                }
            });
        }
    });
    assert_eq!(wal.stats().direct_writes, 2 * 30);
    let last = *next.lock() - 1;
    assert_eq!(last, 2 * 30 * 40 + 4 * 30);
    let want = big(1, last, 1);
    assert_eq!(wal.entries(1, last + 1, None).unwrap(), want);
    drop(wal);
    let wal = Wal::open(dir.path(), opts(fs)).unwrap();
    assert_eq!(wal.entries(1, last + 1, None).unwrap(), want);
}
