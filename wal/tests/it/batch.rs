//! Pins down batch records: runs of one term written as one record read back through every
//! path (ranges and replays starting inside a batch, reopen, conflict truncation into one),
//! entries that cannot share a batch get records of their own, a version-2 segment is read
//! and continued in its own format, and an impossible batch is damage, never a torn tail.

use std::ops::ControlFlow;
use std::path::Path;

use keel_wal::{Entry, FORMAT_VERSION, OLDEST_VERSION, SnapshotMarker, Wal, WalError, WalOptions};

use crate::util::{Rec, entries, entry, records, segments};

fn opts() -> WalOptions {
    WalOptions {
        segment_size: 1 << 20,
        preallocate: false,
        ..WalOptions::default()
    }
}

/// Rewrites a segment's header to format `version` and recomputes its crc chain, as a
/// writer of that version would have left it.
fn rewrite(bytes: &mut [u8], version: u32) {
    bytes[8..12].copy_from_slice(&version.to_le_bytes());
    let crc = crc32fast::hash(&bytes[0..28]);
    bytes[28..32].copy_from_slice(&crc.to_le_bytes());
    let mut prev = crc;
    for r in records(bytes) {
        let mut h = crc32fast::Hasher::new_with_initial(prev);
        h.update(&bytes[r.offset + 4..r.offset + 8 + r.len]);
        prev = h.finalize();
        bytes[r.offset..r.offset + 4].copy_from_slice(&prev.to_le_bytes());
    }
}

/// Entries `lo..hi` of `term` with `size` bytes of data each.
fn sized(lo: u64, hi: u64, term: u64, size: usize) -> Vec<Entry> {
    (lo..hi)
        .map(|index| Entry {
            index,
            term,
            data: (0..size).map(|b| (b as u64 * 7 + index) as u8).collect(),
        })
        .collect()
}

/// Every way to read `want` (entries from index 1 on) back: whole, from every index, in
/// short ranges, and by replay.
fn read_back(wal: &Wal, want: &[Entry], what: &str) {
    let last = want.len() as u64;
    assert_eq!(wal.last_index(), last, "{what}");
    assert_eq!(wal.entries(1, last + 1, None).unwrap(), want, "{what}");
    for lo in 1..=last {
        let hi = (lo + 3).min(last + 1);
        assert_eq!(
            wal.entries(lo, hi, None).unwrap(),
            &want[lo as usize - 1..hi as usize - 1],
            "{what}: entries {lo}..{hi}"
        );
        assert_eq!(wal.term(lo).unwrap(), Some(want[lo as usize - 1].term));
    }
    for from in [1, last / 2, last] {
        let mut got = Vec::new();
        wal.replay(from, |e| {
            got.push(e.to_entry());
            ControlFlow::Continue(())
        })
        .unwrap();
        assert_eq!(
            got,
            &want[from as usize - 1..],
            "{what}: replay from {from}"
        );
    }
}

#[test]
fn runs_of_one_term_are_written_as_batches_and_read_back_every_way() {
    let dir = tempfile::tempdir().unwrap();
    // One append: 5 entries of term 1, 4 of term 2, one entry too large to share a batch,
    // 300 small entries of term 2 (more than one batch holds), then one of term 3 alone.
    let mut want = sized(1, 6, 1, 100);
    want.extend(sized(6, 10, 2, 2000));
    want.extend(sized(10, 11, 2, 70_000));
    want.extend(sized(11, 311, 2, 300));
    want.extend(sized(311, 312, 3, 10));
    let wal = Wal::open(dir.path(), opts()).unwrap();
    wal.append(&want, None, true).unwrap();
    read_back(&wal, &want, "as appended");

    let bytes = std::fs::read(&segments(dir.path())[0]).unwrap();
    let types: Vec<u8> = records(&bytes).iter().map(|r| r.ty).collect();
    // Seed; batches of 5 and 4; the large entry alone; 300 x 304 bytes in two batches of at
    // most 64 KiB (215 + 85); the last entry alone.
    assert_eq!(types, [1, 6, 6, 2, 6, 6, 2], "{:?}", records(&bytes));
    let data: u64 = want.iter().map(|e| e.data.len() as u64).sum();
    let per_entry = (wal.stats().bytes - data) as f64 / want.len() as f64;
    assert!(
        per_entry < 8.0,
        "{per_entry:.1} bytes of framing per entry (an entry record alone takes 24)"
    );
    drop(wal);

    let wal = Wal::open(dir.path(), opts()).unwrap();
    read_back(&wal, &want, "after reopen");
}

#[test]
fn a_conflicting_append_replaces_the_suffix_from_inside_a_batch() {
    let dir = tempfile::tempdir().unwrap();
    let wal = Wal::open(dir.path(), opts()).unwrap();
    let mut want = entries(1, 41, 1);
    wal.append(&want, None, true).unwrap();
    // Entries 1..=40 are one batch; a new leader replaces 26 on.
    let newer = entries(26, 31, 2);
    wal.append(&newer, None, true).unwrap();
    want.truncate(25);
    want.extend(newer);
    read_back(&wal, &want, "after the conflict");
    // And once more inside the new batch, by a single entry.
    wal.append(&[entry(28, 3)], None, true).unwrap();
    want.truncate(27);
    want.push(entry(28, 3));
    read_back(&wal, &want, "after the second conflict");
    drop(wal);
    let wal = Wal::open(dir.path(), opts()).unwrap();
    read_back(&wal, &want, "after reopen");
    wal.append(&entries(29, 35, 3), None, true).unwrap();
    want.extend(entries(29, 35, 3));
    read_back(&wal, &want, "appended after reopen");
}

#[test]
fn a_version_2_segment_is_read_and_continued_in_its_own_format() {
    assert_eq!((OLDEST_VERSION, FORMAT_VERSION), (2, 3));
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_size: 64 << 10,
        ..opts()
    };
    let mut want = Vec::new();
    {
        // Single-entry appends write entry records only: the records of version 2.
        let wal = Wal::open(dir.path(), options.clone()).unwrap();
        for e in entries(1, 11, 1) {
            wal.append(std::slice::from_ref(&e), None, true).unwrap();
            want.push(e);
        }
    }
    let seg = segments(dir.path())[0].clone();
    let mut bytes = std::fs::read(&seg).unwrap();
    rewrite(&mut bytes, 2);
    std::fs::write(&seg, &bytes).unwrap();

    let wal = Wal::open(dir.path(), options.clone()).unwrap();
    read_back(&wal, &want, "version 2");
    // Appended to the version-2 segment as entry records, then on into a new segment.
    let more = entries(11, 400, 1);
    for c in more.chunks(50) {
        wal.append(c, None, true).unwrap();
    }
    want.extend(more);
    read_back(&wal, &want, "continued");
    drop(wal);

    let segs = segments(dir.path());
    assert!(segs.len() > 1, "{segs:?}");
    let first = std::fs::read(&segs[0]).unwrap();
    assert_eq!(u32::from_le_bytes(first[8..12].try_into().unwrap()), 2);
    let recs = records(&first);
    assert!(recs.iter().all(|r| r.ty != 6), "{recs:?}");
    assert!(recs.iter().filter(|r| r.ty == 2).count() > 10);
    let next = std::fs::read(&segs[1]).unwrap();
    assert_eq!(u32::from_le_bytes(next[8..12].try_into().unwrap()), 3);
    assert!(records(&next).iter().any(|r| r.ty == 6));

    let wal = Wal::open(dir.path(), options).unwrap();
    read_back(&wal, &want, "reopened");
}

/// A log of one segment whose last record is a batch, with `damage` applied to that
/// segment's bytes; returns the open's error.
fn open_damaged_batch(dir: &Path, damage: impl FnOnce(&mut Vec<u8>, &Rec)) -> WalError {
    {
        let wal = Wal::open(dir, opts()).unwrap();
        wal.append(&entries(1, 11, 1), None, true).unwrap();
    }
    let seg = segments(dir)[0].clone();
    let mut bytes = std::fs::read(&seg).unwrap();
    let recs = records(&bytes);
    let batch = recs.last().unwrap();
    assert_eq!(batch.ty, 6);
    damage(&mut bytes, batch);
    std::fs::write(&seg, &bytes).unwrap();
    let err = Wal::open(dir, opts()).unwrap_err();
    assert!(
        err.to_string()
            .contains(&*seg.file_name().unwrap().to_string_lossy()),
        "{err}"
    );
    err
}

#[test]
fn an_impossible_batch_is_damage_even_at_the_tail() {
    // Lengths that do not add up to the payload, with a checksum that holds.
    let dir = tempfile::tempdir().unwrap();
    let err = open_damaged_batch(dir.path(), |bytes, batch| {
        let at = batch.offset + 8 + 24;
        let n = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        bytes[at..at + 4].copy_from_slice(&(n + 1).to_le_bytes());
        rewrite(bytes, FORMAT_VERSION);
    });
    let WalError::Corrupt { offset, reason, .. } = &err else {
        panic!("expected Corrupt, got {err}");
    };
    assert!(reason.contains("batch lengths"), "{reason}");
    assert!(*offset > 32, "{offset}");

    // A batch in a segment of version 2, which has none.
    let dir = tempfile::tempdir().unwrap();
    let err = open_damaged_batch(dir.path(), |bytes, _| rewrite(bytes, 2));
    let WalError::Corrupt { reason, .. } = &err else {
        panic!("expected Corrupt, got {err}");
    };
    assert!(reason.contains("format version without them"), "{reason}");
    // Nothing was cut away or set aside.
    assert!(
        crate::util::files(dir.path())
            .iter()
            .all(|n| !n.contains(".broken"))
    );
}

#[test]
fn replay_steps_and_snapshot_markers_may_cut_through_a_batch() {
    let dir = tempfile::tempdir().unwrap();
    let options = WalOptions {
        segment_size: 4 << 20,
        ..opts()
    };
    // 70 000 entries of 8 bytes, in batches of about 5 500: a replay step (65 536 entries)
    // ends inside one.
    let want = sized(1, 70_001, 1, 8);
    let wal = Wal::open(dir.path(), options.clone()).unwrap();
    for c in want.chunks(10_000) {
        wal.append(c, None, false).unwrap();
    }
    wal.sync().unwrap();
    assert_eq!(wal.segment_count(), 1);
    let mut n = 0;
    wal.replay(1, |e| {
        assert_eq!(e.to_entry(), want[n]);
        n += 1;
        ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(n, want.len());

    // A snapshot marker inside a batch: the entries after it stay readable.
    wal.save_snapshot_marker(&SnapshotMarker {
        index: 100,
        term: 1,
    })
    .unwrap();
    let check = |wal: &Wal| {
        assert_eq!(wal.first_index(), 101);
        assert_eq!(wal.entries(101, 105, None).unwrap(), &want[100..104]);
        assert!(matches!(
            wal.entries(100, 105, None),
            Err(WalError::Compacted { .. })
        ));
    };
    check(&wal);
    drop(wal);
    check(&Wal::open(dir.path(), options).unwrap());
}
