//! Pins down segment recycling: released segment files are reused as later segments, the
//! log reads back identically across reopen, and the records a recycled file held in its
//! earlier life are never returned, whether the end marker after the new records is intact
//! or lost, or the recycled segment was put in place before its first record was written;
//! a recycled file's page cache is primed for the way appends will write it; and a release
//! lets appends go on while it syncs the directory, but not another release.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use keel_wal::{Entry, Wal, WalError, WalOptions};

use crate::util::{FaultFs, Faults, entries, files, segments, small};

/// Fixed-size entries (200 bytes of data: 224-byte records), so record boundaries fall at
/// the same offsets in every segment.
fn fixed(lo: u64, hi: u64) -> Vec<Entry> {
    (lo..hi)
        .map(|i| Entry {
            index: i,
            term: 1,
            data: (0..200).map(|b| (b as u64 * 7 + i) as u8 | 1).collect(),
        })
        .collect()
}

/// Offset just past `n` entries of [`fixed`] size after a segment's header and seed record.
fn end_after(n: u64) -> u64 {
    32 + 24 + n * 224
}

/// Appends [`fixed`] entries from `next` one at a time until the active segment, which holds
/// `held` of them, is a quarter full (the background preparation of segment `seq` starts
/// then), and waits for it to leave `<seq>.tmp` in `dir`. No append follows the one that
/// starts it, so a rotation can never rename the file away before it is seen, however late
/// a loaded machine runs the preparation.
fn fill_until_prepared(wal: &Wal, dir: &Path, next: &mut u64, seq: u64, mut held: u64) -> PathBuf {
    let path = dir.join(format!("{seq:016x}.tmp"));
    let quarter = small().segment_size / 4;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        if end_after(held) < quarter {
            wal.append(&fixed(*next, *next + 1), None, true).unwrap();
            *next += 1;
            held += 1;
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // The rename is the preparation's first step; let it finish writing the header.
    std::thread::sleep(Duration::from_millis(50));
    path
}

/// Appends [`fixed`] entries from `next` one at a time until the log has `count` segments.
fn fill_to(wal: &Wal, next: &mut u64, count: usize) {
    while wal.segment_count() < count {
        wal.append(&fixed(*next, *next + 1), None, true).unwrap();
        *next += 1;
    }
}

/// A log of three segments on a fault file system, whose release of all but the last is held
/// up in its directory sync (clear `faults.hold_dir_sync` to let it go on).
struct HeldRelease {
    wal: Arc<Wal>,
    faults: Arc<Faults>,
    /// The next index to append.
    next: u64,
    release: JoinHandle<Result<(), WalError>>,
}

/// Fills a log in `dir` to three segments, starts releasing all but the last on another
/// thread, and returns once that release waits in its directory sync. The hold ends after a
/// minute whatever happens: a release that kept the log's lock through its sync would
/// otherwise hang a test's appends forever.
fn release_held_in_its_directory_sync(dir: &Path) -> HeldRelease {
    let (fs, faults) = FaultFs::new();
    let wal = Arc::new(
        Wal::open(
            dir,
            WalOptions {
                fs: Arc::new(fs),
                ..small()
            },
        )
        .unwrap(),
    );
    let mut next = 1;
    fill_to(&wal, &mut next, 3);
    faults.hold_dir_sync.store(true, Ordering::SeqCst);
    let release = {
        let wal = wal.clone();
        let upto = next - 1;
        std::thread::spawn(move || wal.release_to(upto))
    };
    {
        let faults = faults.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(60));
            faults.hold_dir_sync.store(false, Ordering::SeqCst);
        });
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while faults.dir_syncs_held.load(Ordering::SeqCst) == 0 {
        assert!(
            Instant::now() < deadline,
            "the release never synced the directory"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    HeldRelease {
        wal,
        faults,
        next,
        release,
    }
}

/// A release syncs the directory with the log's lock released: a durable append from
/// another thread completes while that sync is held up, and the release then completes too,
/// its file kept for reuse.
#[test]
fn appends_go_on_while_a_release_syncs_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let HeldRelease {
        wal,
        faults,
        next,
        release,
    } = release_held_in_its_directory_sync(dir.path());
    // One small entry into the segment that just began: no rotation, so no directory sync.
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let (wal, n) = (wal.clone(), next);
        std::thread::spawn(move || {
            let _ = tx.send(wal.append(&fixed(n, n + 1), None, true));
        });
    }
    let appended = rx.recv_timeout(Duration::from_secs(30));
    faults.hold_dir_sync.store(false, Ordering::SeqCst);
    appended
        .expect("a durable append completes while a release syncs the directory")
        .unwrap();
    release.join().unwrap().unwrap();
    assert_eq!(wal.last_index(), next);
    assert_eq!(wal.segment_count(), 1);
    let set_aside = files(dir.path())
        .iter()
        .filter(|n| n.ends_with(".free") || n.ends_with(".tmp"))
        .count();
    assert!(set_aside >= 1, "{:?}", files(dir.path()));
}

/// Releases run one at a time: while a release's directory sync is held up, another call
/// that would release the next segment renames and deletes nothing (its change could
/// otherwise become durable before the held one's), and goes on once the first is done.
#[test]
fn a_release_waits_for_the_one_running() {
    let dir = tempfile::tempdir().unwrap();
    let HeldRelease {
        wal,
        faults,
        next,
        release,
    } = release_held_in_its_directory_sync(dir.path());
    let before = files(dir.path());
    let second = {
        let wal = wal.clone();
        std::thread::spawn(move || wal.release_to(next - 1))
    };
    std::thread::sleep(Duration::from_millis(200));
    let during = files(dir.path());
    assert_eq!(
        faults.dir_syncs_held.load(Ordering::SeqCst),
        1,
        "{during:?}"
    );
    faults.hold_dir_sync.store(false, Ordering::SeqCst);
    release.join().unwrap().unwrap();
    second.join().unwrap().unwrap();
    assert_eq!(
        during, before,
        "a release changed files while another one synced"
    );
    assert_eq!(wal.segment_count(), 1);
    assert_eq!(segments(dir.path()).len(), 1, "{:?}", files(dir.path()));
}

/// Files a release sets aside are not recycled while its directory sync is held up (their
/// new names may not be durable yet): a segment prepared meanwhile is a new file. Once the
/// sync ends, later rotations recycle them.
#[test]
fn released_files_wait_for_their_directory_sync() {
    let dir = tempfile::tempdir().unwrap();
    let HeldRelease {
        wal,
        faults,
        mut next,
        release,
    } = release_held_in_its_directory_sync(dir.path());
    // Past a quarter of segment 2, segment 3 is prepared in the background.
    let prepared = fill_until_prepared(&wal, dir.path(), &mut next, 3, 1);
    let held = files(dir.path());
    faults.hold_dir_sync.store(false, Ordering::SeqCst);
    release.join().unwrap().unwrap();
    // The file set aside before the held sync is still `.free`, and so is the one set aside
    // after it: the prepared segment is a new file.
    let names = files(dir.path());
    assert_eq!(wal.stats().recycled, 0, "{names:?}");
    assert!(held.contains(&format!("{:016x}.free", 0)), "{held:?}");
    assert_eq!(
        names.iter().filter(|n| n.ends_with(".free")).count(),
        2,
        "{held:?} {names:?}"
    );
    assert!(prepared.exists());
    fill_to(&wal, &mut next, 6);
    assert!(wal.stats().recycled > 0, "{:?}", wal.stats());
}

/// A release whose directory sync fails returns the error, stops there (a later segment's
/// change is never made before an earlier one's is durable) and keeps the file it set aside
/// out of the free list; the next release syncs the directory first, puts that file on the
/// free list, and goes on with the segment left, so rotations recycle both.
#[test]
fn a_failed_directory_sync_is_made_good_by_the_next_release() {
    let dir = tempfile::tempdir().unwrap();
    let (fs, faults) = FaultFs::new();
    let wal = Wal::open(
        dir.path(),
        WalOptions {
            fs: Arc::new(fs),
            preallocate: false,
            ..small()
        },
    )
    .unwrap();
    let mut next = 1;
    fill_to(&wal, &mut next, 3);
    faults.fail_dir_sync.store(true, Ordering::SeqCst);
    let err = wal.release_to(next - 1).unwrap_err();
    assert!(err.to_string().contains("sync directory"), "{err}");
    assert_eq!(wal.segment_count(), 2);
    assert_eq!(
        files(dir.path())
            .iter()
            .filter(|n| n.ends_with(".free"))
            .count(),
        1,
        "{:?}",
        files(dir.path())
    );
    faults.fail_dir_sync.store(false, Ordering::SeqCst);
    faults.record_ops.store(true, Ordering::SeqCst);
    wal.release_to(next - 1).unwrap();
    faults.record_ops.store(false, Ordering::SeqCst);
    let ops: Vec<String> = faults
        .ops
        .lock()
        .iter()
        .map(|op| op.split(' ').next().unwrap().to_owned())
        .collect();
    assert_eq!(ops, ["sync_dir", "rename", "sync_dir"]);
    fill_to(&wal, &mut next, 3);
    let stats = wal.stats();
    assert_eq!(stats.recycled, 2, "{stats:?} {:?}", files(dir.path()));
    let free = files(dir.path())
        .iter()
        .filter(|n| n.ends_with(".free"))
        .count();
    assert_eq!(free, 0, "{:?}", files(dir.path()));
    let first = wal.first_index();
    assert_eq!(wal.entries(first, next, None).unwrap(), fixed(first, next));
}

/// Open makes the names of the released files it finds durable before it may recycle one
/// (the log may have stopped between a release's renames and its directory sync): with the
/// directory sync failing, a log with `.free` files does not open, one without does.
#[test]
fn opening_with_released_files_syncs_the_directory_first() {
    let dir = tempfile::tempdir().unwrap();
    let mut next = 1;
    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        fill_to(&wal, &mut next, 3);
        wal.release_to(next - 1).unwrap();
    }
    assert!(files(dir.path()).iter().any(|n| n.ends_with(".free")));
    let failing = || {
        let (fs, faults) = FaultFs::new();
        faults.fail_dir_sync.store(true, Ordering::SeqCst);
        WalOptions {
            fs: Arc::new(fs),
            ..small()
        }
    };
    let Err(err) = Wal::open(dir.path(), failing()) else {
        panic!("the log opened without syncing its directory");
    };
    assert!(err.to_string().contains("sync directory"), "{err}");
    for n in files(dir.path()).iter().filter(|n| n.ends_with(".free")) {
        std::fs::remove_file(dir.path().join(n)).unwrap();
    }
    let wal = Wal::open(dir.path(), failing()).unwrap();
    assert_eq!(wal.last_index(), next - 1);
}

#[test]
fn released_segments_are_recycled_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let want = entries(1, 4001, 2);
    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        for chunk in want.chunks(9) {
            wal.append(chunk, None, true).unwrap();
            if wal.segment_count() > 3 {
                let keep = wal.last_index().saturating_sub(300).max(wal.first_index());
                wal.release_to(keep).unwrap();
            }
            let free = files(dir.path())
                .iter()
                .filter(|n| n.ends_with(".free"))
                .count();
            assert!(free <= 2, "{free} released files kept");
        }
        let stats = wal.stats();
        assert!(stats.recycled > 0, "{stats:?}");
        assert!(stats.rotations > stats.recycled, "{stats:?}");
        let first = wal.first_index();
        assert_eq!(
            wal.entries(first, 4001, None).unwrap(),
            want[first as usize - 1..]
        );
    }
    let wal = Wal::open(dir.path(), small()).unwrap();
    let first = wal.first_index();
    assert_eq!(wal.last_index(), 4000);
    assert_eq!(
        wal.entries(first, 4001, None).unwrap(),
        want[first as usize - 1..]
    );
    // Reopened, the log goes on recycling the files it kept.
    let more = entries(4001, 6001, 2);
    for chunk in more.chunks(9) {
        wal.append(chunk, None, true).unwrap();
        if wal.segment_count() > 3 {
            wal.release_to(wal.last_index() - 300).unwrap();
        }
    }
    assert!(wal.stats().recycled > 0, "{:?}", wal.stats());
    let first = wal.first_index();
    assert_eq!(
        wal.entries(first, 6001, None).unwrap(),
        more[first as usize - 4001..]
    );
    assert!(
        !files(dir.path()).iter().any(|n| n.contains("broken")),
        "{:?}",
        files(dir.path())
    );
}

#[test]
fn records_of_a_recycled_files_earlier_life_are_never_returned() {
    let dir = tempfile::tempdir().unwrap();
    let mut next = 1u64;
    let (old, recycled_path, last) = {
        // Through the page cache: a direct write zeroes the rest of its last page, and this
        // test needs the old records right behind the end marker.
        let o = WalOptions {
            direct_writes: false,
            ..small()
        };
        let wal = Wal::open(dir.path(), o).unwrap();
        fill_to(&wal, &mut next, 3);
        // Segment 0 is full of entries; keep its bytes, release it, and let the log reuse
        // its file for segment 3.
        let seg0 = segments(dir.path())[0].clone();
        let old = std::fs::read(&seg0).unwrap();
        let first1 = wal.last_index() - 10;
        wal.release_to(first1).unwrap();
        assert_eq!(wal.segment_count(), 2);
        fill_until_prepared(&wal, dir.path(), &mut next, 3, 1);
        fill_to(&wal, &mut next, 3);
        let stats = wal.stats();
        assert_eq!(stats.recycled, 1, "{stats:?}");
        // Ten entries into segment 3, then a clean close.
        for _ in 0..9 {
            wal.append(&fixed(next, next + 1), None, true).unwrap();
            next += 1;
        }
        (old, segments(dir.path()).pop().unwrap(), wal.last_index())
    };
    let first_in_3 = last - 9;
    let bytes = std::fs::read(&recycled_path).unwrap();
    assert_eq!(bytes.len(), old.len());
    let end = end_after(10) as usize;
    assert_eq!(
        bytes[end..end + 8],
        [0u8; 8],
        "end marker after the new records"
    );
    // The old records are still there after the marker, and one starts right at the end.
    assert_eq!(bytes[end + 8..], old[end + 8..]);
    let word = u32::from_le_bytes(old[end + 4..end + 8].try_into().unwrap());
    assert_eq!(
        word >> 24,
        2,
        "an old entry record starts at the end offset"
    );

    // Intact: a clean reopen serves exactly the new entries and repairs nothing.
    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        assert_eq!(wal.last_index(), last);
        assert_eq!(
            wal.entries(first_in_3, last + 1, None).unwrap(),
            fixed(first_in_3, last + 1)
        );
    }
    assert!(!files(dir.path()).iter().any(|n| n.contains("broken")));

    // The end marker lost (a torn write): the old record behind it does not chain.
    let mut torn = bytes.clone();
    torn[end..end + 8].copy_from_slice(&old[end..end + 8]);
    std::fs::write(&recycled_path, &torn).unwrap();
    let strict = WalOptions {
        strict: true,
        ..small()
    };
    match Wal::open(dir.path(), strict) {
        Err(WalError::Corrupt { offset, .. }) => assert_eq!(offset, end as u64),
        other => panic!("strict open accepted stale records: {other:?}"),
    }
    let wal = Wal::open(dir.path(), small()).unwrap();
    assert_eq!(wal.last_index(), last);
    assert_eq!(
        wal.entries(first_in_3, last + 1, None).unwrap(),
        fixed(first_in_3, last + 1)
    );
    assert!(files(dir.path()).iter().any(|n| n.contains("broken")));
    // The log continues past the repaired end.
    wal.append(&fixed(last + 1, last + 3), None, true).unwrap();
    drop(wal);
    let wal = Wal::open(dir.path(), small()).unwrap();
    assert_eq!(
        wal.entries(first_in_3, last + 3, None).unwrap(),
        fixed(first_in_3, last + 3)
    );
}

#[test]
fn a_recycled_segment_put_in_place_before_its_first_record_opens_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let mut next = 1u64;
    let (tmp, last) = {
        let wal = Wal::open(dir.path(), small()).unwrap();
        // The append that started segment 2 is its only entry.
        fill_to(&wal, &mut next, 3);
        wal.release_to(wal.last_index() - 10).unwrap();
        // Fill segment 2 past a quarter so segment 3 is prepared from the released file.
        let tmp = fill_until_prepared(&wal, dir.path(), &mut next, 3, 1);
        assert!(!dir.path().join(format!("{:016x}.free", 0)).exists());
        (tmp, wal.last_index())
    };
    // A crash right after the rename into place, before the seed record was written.
    let to = dir.path().join(format!("{:016x}-{:016x}.wal", 3, last + 1));
    std::fs::rename(&tmp, &to).unwrap();
    let wal = Wal::open(dir.path(), small()).unwrap();
    assert_eq!(wal.last_index(), last);
    let first = wal.first_index();
    assert_eq!(
        wal.entries(first, last + 1, None).unwrap(),
        fixed(first, last + 1)
    );
    wal.append(&fixed(last + 1, last + 21), None, true).unwrap();
    drop(wal);
    let wal = Wal::open(
        dir.path(),
        WalOptions {
            strict: true,
            ..small()
        },
    )
    .unwrap();
    assert_eq!(wal.last_index(), last + 20);
    assert_eq!(
        wal.entries(first, last + 21, None).unwrap(),
        fixed(first, last + 21)
    );
    assert!(!files(dir.path()).iter().any(|n| n.contains("broken")));
}

/// A recycled file is made ready for the way appends will write it: with direct writes its
/// cached pages are dropped (nothing of its old contents is read in, and no direct write has
/// to drop pages itself), and through the page cache its old pages are read in ahead.
#[test]
fn recycled_files_are_primed_for_the_way_appends_write_them() {
    let probe = tempfile::tempdir().unwrap();
    let direct_works = {
        let p = probe.path().join("probe");
        std::fs::write(&p, [0u8; 4096]).unwrap();
        keel_wal::FileSystem::open_direct(&keel_wal::RealFs, &p).is_some()
    };
    for direct in [true, false] {
        if direct && !direct_works {
            eprintln!("direct writes are not supported here; checking the page-cache side only");
            continue;
        }
        let dir = tempfile::tempdir().unwrap();
        let (fs, faults) = FaultFs::new();
        faults.direct.store(direct, Ordering::SeqCst);
        // New segments are reserved, not zero-filled: a zero-filled one is primed too, and
        // would give hints of its own.
        let opts = WalOptions {
            direct_writes: direct,
            zero_fill: false,
            fs: Arc::new(fs),
            ..small()
        };
        let wal = Wal::open(dir.path(), opts).unwrap();
        let mut next = 1;
        while wal.stats().recycled < 3 {
            wal.append(&fixed(next, next + 8), None, true).unwrap();
            next += 8;
            if wal.segment_count() > 2 {
                wal.release_to(next - 100).unwrap();
            }
            assert!(next < 100_000, "no segment recycled: {:?}", wal.stats());
        }
        assert!(
            wal.stats().direct_flushes > 0 || !direct,
            "{:?}",
            wal.stats()
        );
        let hints = faults.hints.lock().clone();
        let (want, other) = if direct {
            ("dont_need", "will_need")
        } else {
            ("will_need", "dont_need")
        };
        assert!(
            hints.iter().filter(|(_, h)| *h == want).count() >= 3,
            "direct {direct}: {hints:?}"
        );
        assert!(
            !hints.iter().any(|(_, h)| *h == other),
            "direct {direct}: {hints:?}"
        );
        assert_eq!(
            wal.entries(wal.first_index(), next, None).unwrap(),
            fixed(wal.first_index(), next)
        );
    }
}
