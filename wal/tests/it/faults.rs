//! Pins down behaviour under injected I/O faults: a failed fdatasync poisons the log, disk
//! full while starting a segment is a clean error that leaves the log readable and usable,
//! disk full on a write poisons with a disk-full error, short writes are completed, and a
//! failed sync under concurrent appenders fails every waiting one (none hangs, none is
//! acknowledged after the failure).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use keel_wal::{Wal, WalError, WalOptions};

use crate::util::{FaultFs, entries, entry};

fn opts(fs: FaultFs) -> WalOptions {
    WalOptions {
        segment_size: 64 << 10,
        fs: Arc::new(fs),
        ..WalOptions::default()
    }
}

#[test]
fn fsync_error_poisons_every_later_write() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    let wal = Wal::open(dir.path(), opts(fs.clone())).unwrap();
    wal.append(&entries(1, 11, 1), None, true).unwrap();
    faults.fail_sync.store(true, Ordering::SeqCst);
    let err = wal.append(&entries(11, 12, 1), None, true).unwrap_err();
    assert!(
        matches!(
            err,
            WalError::Io {
                op: "fdatasync",
                ..
            }
        ),
        "{err}"
    );
    faults.fail_sync.store(false, Ordering::SeqCst);
    // Nothing is retried and acknowledged after a failed sync.
    for attempt in [
        wal.append(&entries(12, 13, 1), None, true),
        wal.append(&[], None, true),
        wal.sync(),
        wal.set_metadata(&keel_wal::Metadata {
            cluster_id: 1,
            member_id: 1,
        }),
    ] {
        let e = attempt.unwrap_err();
        assert!(matches!(e, WalError::Poisoned { .. }), "{e}");
        assert!(
            e.to_string().contains("fdatasync"),
            "poison names its cause: {e}"
        );
    }
    // Synced entries stay readable.
    assert_eq!(wal.entries(1, 11, None).unwrap(), entries(1, 11, 1));
    drop(wal);
    let wal = Wal::open(dir.path(), opts(fs)).unwrap();
    assert!(wal.last_index() >= 10);
    assert_eq!(wal.entries(1, 11, None).unwrap(), entries(1, 11, 1));
}

#[test]
fn a_failed_sync_fails_every_concurrent_waiter() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    faults.sync_delay_us.store(3000, Ordering::SeqCst);
    let wal = Arc::new(Wal::open(dir.path(), opts(fs)).unwrap());
    let next = Arc::new(parking_lot::Mutex::new(1u64));
    let acked = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for t in 0..8 {
        let (wal, next, acked, done) = (wal.clone(), next.clone(), acked.clone(), done_tx.clone());
        std::thread::spawn(move || {
            let mut errors = 0;
            for k in 0..200 {
                let index = {
                    let mut n = next.lock();
                    if wal.append(&[entry(*n, 1)], None, false).is_err() {
                        errors += 1;
                        break;
                    }
                    *n += 1;
                    *n - 1
                };
                // Half the threads wait through `sync`, half through a durable empty append.
                let res = if (t + k) % 2 == 0 {
                    wal.sync()
                } else {
                    wal.append(&[], None, true)
                };
                match res {
                    Ok(()) => acked.lock().push(index),
                    Err(_) => {
                        errors += 1;
                        break;
                    }
                }
            }
            done.send(errors).unwrap();
        });
    }
    std::thread::sleep(std::time::Duration::from_millis(60));
    faults.fail_sync.store(true, Ordering::SeqCst);
    let mut failed = 0;
    for _ in 0..8 {
        let errors = done_rx
            .recv_timeout(std::time::Duration::from_secs(20))
            .expect("an appender hung after a failed sync");
        failed += errors;
    }
    assert_eq!(failed, 8, "every appender saw the failure");
    assert!(matches!(wal.sync(), Err(WalError::Poisoned { .. })));
    let acked = acked.lock().clone();
    assert!(
        !acked.is_empty(),
        "some appends were acknowledged before the failure"
    );
    let last = *acked.iter().max().unwrap();
    assert_eq!(
        wal.entries(1, last + 1, None).unwrap(),
        entries(1, last + 1, 1)
    );
}

#[test]
fn disk_full_on_a_new_segment_is_clean_and_the_log_stays_usable() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    let o = WalOptions {
        preallocate: false,
        ..opts(fs)
    };
    let wal = Wal::open(dir.path(), o).unwrap();
    let mut next = 1;
    faults.enospc_new_segment.store(true, Ordering::SeqCst);
    let err = loop {
        match wal.append(&entries(next, next + 10, 1), None, true) {
            Ok(()) => next += 10,
            Err(e) => break e,
        }
        assert!(next < 10_000, "never needed a new segment");
    };
    assert!(err.is_disk_full(), "{err}");
    assert!(err.to_string().contains("disk full"), "{err}");
    // Nothing of the failed call is there; everything before it is readable.
    assert_eq!(wal.last_index(), next - 1);
    assert_eq!(wal.entries(1, next, None).unwrap(), entries(1, next, 1));
    // Once space is back, appends go on.
    faults.enospc_new_segment.store(false, Ordering::SeqCst);
    wal.append(&entries(next, next + 10, 1), None, true)
        .unwrap();
    assert_eq!(wal.segment_count(), 2);
    drop(wal);
    let wal = Wal::open(dir.path(), WalOptions::default()).unwrap();
    assert_eq!(
        wal.entries(1, next + 10, None).unwrap(),
        entries(1, next + 10, 1)
    );
}

#[test]
fn disk_full_at_first_open_is_clean() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    faults.enospc_new_segment.store(true, Ordering::SeqCst);
    // Opening an empty directory needs a first segment: refused cleanly on a full disk.
    let err = Wal::open(dir.path(), opts(fs.clone())).unwrap_err();
    assert!(err.is_disk_full(), "{err}");
    faults.enospc_new_segment.store(false, Ordering::SeqCst);
    let wal = Wal::open(dir.path(), opts(fs)).unwrap();
    wal.append(&entries(1, 3, 1), None, true).unwrap();
    assert_eq!(wal.last_index(), 2);
}

#[test]
fn disk_full_on_write_poisons_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    let wal = Wal::open(dir.path(), opts(fs)).unwrap();
    wal.append(&entries(1, 5, 1), None, true).unwrap();
    faults.enospc_write.store(true, Ordering::SeqCst);
    let err = wal.append(&[entry(5, 1)], None, true).unwrap_err();
    assert!(err.is_disk_full(), "{err}");
    faults.enospc_write.store(false, Ordering::SeqCst);
    let again = wal.append(&[entry(5, 1)], None, true).unwrap_err();
    assert!(matches!(again, WalError::Poisoned { .. }), "{again}");
    assert!(again.to_string().contains("disk full"), "{again}");
    assert_eq!(wal.entries(1, 5, None).unwrap(), entries(1, 5, 1));
}

#[test]
fn short_writes_are_completed() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    faults.short_writes.store(true, Ordering::SeqCst);
    let want = entries(1, 1501, 2);
    {
        let wal = Wal::open(dir.path(), opts(fs.clone())).unwrap();
        for c in want.chunks(30) {
            wal.append(c, None, true).unwrap();
        }
        assert!(wal.segment_count() > 1);
    }
    faults.short_writes.store(false, Ordering::SeqCst);
    let wal = Wal::open(dir.path(), opts(fs)).unwrap();
    assert_eq!(wal.entries(1, 1501, None).unwrap(), want);
}

#[test]
fn a_sync_running_when_another_sync_fails_acknowledges_nothing() {
    // A file reports a writeback error to one fdatasync only: when a rotation's sync fails
    // while a group commit's sync of the same file runs, the error may be the one the
    // group's own bytes met, so the group's sync returning success proves nothing.
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    let o = WalOptions {
        preallocate: false,
        ..opts(fs)
    };
    let wal = Arc::new(Wal::open(dir.path(), o).unwrap());
    wal.append(&entries(1, 11, 1), None, true).unwrap();
    faults.sync_delay_us.store(300_000, Ordering::SeqCst);
    let before = faults.syncs.load(Ordering::SeqCst);
    let leader = {
        let wal = wal.clone();
        std::thread::spawn(move || wal.append(&[entry(11, 1)], None, true))
    };
    while faults.syncs.load(Ordering::SeqCst) == before {
        std::thread::yield_now();
    }
    // The group's sync is running: the next rotation's sync of the same file fails.
    faults.fail_sync.store(true, Ordering::SeqCst);
    let mut next = wal.last_index() + 1;
    let err = loop {
        match wal.append(&entries(next, next + 10, 1), None, false) {
            Ok(()) => next += 10,
            Err(e) => break e,
        }
        assert!(next < 10_000, "never rotated");
    };
    assert!(
        matches!(
            err,
            WalError::Io {
                op: "write and sync",
                ..
            }
        ),
        "{err}"
    );
    let res = leader.join().unwrap();
    assert!(
        matches!(res, Err(WalError::Poisoned { .. })),
        "a sync that ran across another one's failure acknowledged: {res:?}"
    );
}
