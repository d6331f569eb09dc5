//! Pins down next entry records (format version 3): which entries are written compact and
//! which in full (within and across appends, at term changes, after state records, at
//! segment starts, after conflict truncations), that they read back through every path and
//! across reopen, that version-2 segments are read and continued in their own format, and
//! that a next entry record where none can be is a typed corruption error.

use std::ops::ControlFlow;
use std::path::Path;

use keel_wal::{Entry, HardState, Wal, WalError, WalOptions};

use crate::util::{data, entry, files, segments, small};

const ENTRY: u32 = 2;
const HARD_STATE: u32 = 3;
const NEXT_ENTRY: u32 = 6;

/// `(offset, type, payload length)` of each record of a segment file, up to its end marker.
fn walk(bytes: &[u8]) -> Vec<(usize, u32, usize)> {
    let mut out = Vec::new();
    let mut at = 32;
    while at + 8 <= bytes.len() {
        let word = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap());
        let crc = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        if word == 0 && crc == 0 {
            break;
        }
        let len = (word & 0x00ff_ffff) as usize;
        out.push((at, word >> 24, len));
        at += 8 + len.next_multiple_of(8);
    }
    out
}

/// Record types of the entries in a segment file, in file order.
fn entry_types(path: &Path) -> Vec<u32> {
    walk(&std::fs::read(path).unwrap())
        .into_iter()
        .map(|(_, t, _)| t)
        .filter(|&t| t == ENTRY || t == NEXT_ENTRY)
        .collect()
}

/// Every next entry record of every segment directly follows an entry record.
fn check_layout(dir: &Path) {
    for seg in segments(dir) {
        let recs = walk(&std::fs::read(&seg).unwrap());
        for w in recs.windows(2) {
            if w[1].1 == NEXT_ENTRY {
                assert!(
                    w[0].1 == ENTRY || w[0].1 == NEXT_ENTRY,
                    "{}: next entry record at {} follows a record of type {}",
                    seg.display(),
                    w[1].0,
                    w[0].1
                );
            }
        }
        assert_ne!(recs.first().map(|r| r.1), Some(NEXT_ENTRY));
    }
}

/// Reads `want` (consecutive, from `want[0].index`) back every way: as a whole, from every
/// index, one entry at a time, and by replay from every tenth index.
fn check_reads(wal: &Wal, want: &[Entry], ctx: &str) {
    let lo = want[0].index;
    let hi = lo + want.len() as u64;
    assert_eq!(wal.entries(lo, hi, None).unwrap(), want, "{ctx}");
    for (k, e) in want.iter().enumerate() {
        let i = e.index;
        assert_eq!(
            wal.entries(i, hi, None).unwrap(),
            want[k..],
            "{ctx}: from {i}"
        );
        assert_eq!(
            wal.entries(i, i + 1, None).unwrap(),
            std::slice::from_ref(e),
            "{ctx}: entry {i}"
        );
        assert_eq!(wal.term(i).unwrap(), Some(e.term), "{ctx}: term {i}");
        if k % 10 == 0 {
            let mut got = Vec::new();
            wal.replay(i, |r| {
                got.push(r.to_entry());
                ControlFlow::Continue(())
            })
            .unwrap();
            assert_eq!(got, want[k..], "{ctx}: replay from {i}");
        }
    }
}

fn ents(lo: u64, hi: u64, term: u64) -> Vec<Entry> {
    (lo..hi).map(|i| entry(i, term)).collect()
}

/// Entries with 4000 bytes of data: a durable batch of them is written straight from their
/// buffers.
fn large(lo: u64, hi: u64, term: u64) -> Vec<Entry> {
    (lo..hi)
        .map(|i| Entry {
            index: i,
            term,
            data: {
                let mut d = data(i, term, 100);
                d.resize(4000, i as u8 | 1);
                d
            },
        })
        .collect()
}

fn roomy() -> WalOptions {
    WalOptions {
        segment_size: 1 << 20,
        ..WalOptions::default()
    }
}

#[test]
fn entries_following_an_entry_of_their_term_are_next_entry_records() {
    let dir = tempfile::tempdir().unwrap();
    let hs = HardState {
        term: 2,
        vote: 1,
        commit: 20,
    };
    let mut want = Vec::new();
    {
        let wal = Wal::open(dir.path(), roomy()).unwrap();
        let mut add = |es: Vec<Entry>, hs: Option<&HardState>, sync: bool| {
            wal.append(&es, hs, sync).unwrap();
            want.extend(es);
        };
        add(ents(1, 11, 1), None, true);
        add(ents(11, 16, 1), None, false);
        let mut mixed = ents(16, 18, 1);
        mixed.extend(ents(18, 21, 2));
        add(mixed, None, true);
        add(ents(21, 23, 2), Some(&hs), true);
        add(ents(23, 24, 2), None, true);
        add(large(24, 34, 2), None, true);
        let mut mixed = large(34, 37, 2);
        mixed.extend(large(37, 44, 3));
        add(mixed, Some(&HardState { term: 3, ..hs }), true);
        add(ents(44, 46, 3), None, true);
        check_reads(&wal, &want, "before reopen");
    }
    let seg = segments(dir.path())[0].clone();
    let (f, c) = (ENTRY, NEXT_ENTRY);
    let mut expect = vec![f];
    expect.extend([c; 14]); // 2..=15, across two appends
    expect.extend([c, c, f, c, c]); // 16..=20: the term changes at 18
    expect.extend([c, c]); // 21, 22, then the hard state
    expect.push(f); // 23 follows the hard state
    expect.extend([c; 10]); // 24..=33, from the entries' buffers
    expect.extend([c, c, c, f, c, c, c, c, c, c]); // 34..=43: the term changes at 37
    expect.extend([f, c]); // 44 follows the hard state
    assert_eq!(entry_types(&seg), expect);
    check_layout(dir.path());

    let wal = Wal::open(dir.path(), roomy()).unwrap();
    check_reads(&wal, &want, "after reopen");
    assert_eq!(wal.hard_state(), Some(HardState { term: 3, ..hs }));
    // The first append after a reopen continues the last entry's run.
    wal.append(&ents(46, 48, 3), None, true).unwrap();
    want.extend(ents(46, 48, 3));
    expect.extend([c, c]);
    assert_eq!(entry_types(&seg), expect);
    drop(wal);
    let wal = Wal::open(dir.path(), roomy()).unwrap();
    check_reads(&wal, &want, "after the second reopen");
}

#[test]
fn each_segment_starts_with_a_full_entry_record() {
    let dir = tempfile::tempdir().unwrap();
    let want = ents(1, 1001, 1);
    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        for chunk in want.chunks(13) {
            wal.append(chunk, None, true).unwrap();
        }
    }
    let segs = segments(dir.path());
    assert!(segs.len() >= 3, "{segs:?}");
    for seg in &segs {
        let types = entry_types(seg);
        assert_eq!(types[0], ENTRY, "{}", seg.display());
        assert!(
            types[1..].iter().all(|&t| t == NEXT_ENTRY),
            "{}",
            seg.display()
        );
        let version = u32::from_le_bytes(std::fs::read(seg).unwrap()[8..12].try_into().unwrap());
        assert_eq!(version, keel_wal::FORMAT_VERSION);
    }
    check_layout(dir.path());
    let wal = Wal::open(dir.path(), small()).unwrap();
    check_reads(&wal, &want, "reopened");
}

#[test]
fn conflict_truncation_onto_next_entry_records() {
    let dir = tempfile::tempdir().unwrap();
    let mut want = ents(1, 11, 1);
    let (f, c) = (ENTRY, NEXT_ENTRY);
    {
        let wal = Wal::open(dir.path(), roomy()).unwrap();
        wal.append(&want, None, true).unwrap();
        // Replaces 6..=10; the entry before the point, 5, is a next entry record.
        wal.append(&ents(6, 9, 2), None, true).unwrap();
        want.truncate(5);
        want.extend(ents(6, 9, 2));
        check_reads(&wal, &want, "first truncation");
        // Replaces 8 on; 7 before it is a next entry record of the same term as 8.
        wal.append(&ents(8, 13, 2), None, false).unwrap();
        want.truncate(7);
        want.extend(ents(8, 13, 2));
        check_reads(&wal, &want, "second truncation");
        // The same term again from 11: in the file it follows entry 12 of its term.
        let again: Vec<Entry> = (11..13)
            .map(|i| Entry {
                index: i,
                term: 2,
                data: vec![i as u8; 50],
            })
            .collect();
        wal.append(&again, None, true).unwrap();
        want.truncate(10);
        want.extend(again);
        wal.append(&ents(13, 15, 2), None, true).unwrap();
        want.extend(ents(13, 15, 2));
        check_reads(&wal, &want, "third truncation");
        // Onto a full entry record: replaces from 11 (the full record of the last one).
        wal.append(&large(11, 20, 3), None, true).unwrap();
        want.truncate(10);
        want.extend(large(11, 20, 3));
        check_reads(&wal, &want, "fourth truncation");
    }
    let seg = segments(dir.path())[0].clone();
    let mut expect = vec![f];
    expect.extend([c; 9]); // 1..=10
    expect.extend([f, c, c]); // 6..=8
    expect.extend([f, c, c, c, c]); // 8..=12
    expect.extend([f, c, c, c]); // 11, 12, then 13, 14
    expect.push(f); // 11 of term 3
    expect.extend([c; 8]); // 12..=19
    assert_eq!(entry_types(&seg), expect);
    check_layout(dir.path());
    let wal = Wal::open(dir.path(), roomy()).unwrap();
    assert_eq!(wal.last_index(), 19);
    check_reads(&wal, &want, "after reopen");
}

/// Appends a record framed as the format doc says to `out`; returns its crc.
fn record(out: &mut Vec<u8>, ty: u32, payload: &[u8], prev: u32) -> u32 {
    let word = (ty << 24) | payload.len() as u32;
    let mut h = crc32fast::Hasher::new_with_initial(prev);
    h.update(&word.to_le_bytes());
    h.update(payload);
    let crc = h.finalize();
    out.extend_from_slice(&crc.to_le_bytes());
    out.extend_from_slice(&word.to_le_bytes());
    out.extend_from_slice(payload);
    out.resize(out.len().next_multiple_of(8), 0);
    crc
}

fn entry_payload(e: &Entry) -> Vec<u8> {
    let mut p = e.index.to_le_bytes().to_vec();
    p.extend_from_slice(&e.term.to_le_bytes());
    p.extend_from_slice(&e.data);
    p
}

/// A segment `seq` of format `version` up to its seed record (first index `first`, previous
/// segment's crc 0), and the crc to chain the next record from.
fn segment_start(seq: u64, version: u32, first: u64) -> (Vec<u8>, u32) {
    let mut out = vec![0u8; 32];
    out[0..8].copy_from_slice(b"KEELWAL\0");
    out[8..12].copy_from_slice(&version.to_le_bytes());
    out[16..24].copy_from_slice(&seq.to_le_bytes());
    let chain = crc32fast::hash(&out[0..28]);
    out[28..32].copy_from_slice(&chain.to_le_bytes());
    let mut seed = [0u8; 16];
    seed[8..].copy_from_slice(&first.to_le_bytes());
    let crc = record(&mut out, 1, &seed, chain);
    (out, crc)
}

/// Writes `bytes` (zero-padded to 64 KiB) as segment 0 starting at index 1 in `dir`.
fn write_segment(dir: &Path, mut bytes: Vec<u8>) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    bytes.resize(64 << 10, 0);
    let path = dir.join(format!("{:016x}-{:016x}.wal", 0, 1));
    std::fs::write(&path, bytes).unwrap();
    path
}

#[test]
fn a_version_2_segment_is_read_and_continued_in_its_format() {
    let dir = tempfile::tempdir().unwrap();
    let hs = HardState {
        term: 1,
        vote: 2,
        commit: 3,
    };
    let mut want = ents(1, 6, 1);
    let (mut bytes, mut crc) = segment_start(0, 2, 1);
    for e in &want {
        crc = record(&mut bytes, ENTRY, &entry_payload(e), crc);
    }
    let mut p = Vec::new();
    for x in [hs.term, hs.vote, hs.commit] {
        p.extend_from_slice(&x.to_le_bytes());
    }
    record(&mut bytes, HARD_STATE, &p, crc);
    let seg = write_segment(dir.path(), bytes);

    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        check_reads(&wal, &want, "version 2");
        assert_eq!(wal.hard_state(), Some(hs));
        // Appends to the version-2 segment stay in its format.
        wal.append(&ents(6, 11, 1), None, true).unwrap();
        wal.append(&ents(11, 13, 1), None, false).unwrap();
        want.extend(ents(6, 13, 1));
        check_reads(&wal, &want, "version 2 continued");
    }
    assert_eq!(entry_types(&seg), [ENTRY; 12]);
    assert_eq!(std::fs::read(&seg).unwrap()[8..12], 2u32.to_le_bytes());
    {
        let wal = Wal::open(dir.path(), small()).unwrap();
        check_reads(&wal, &want, "version 2 reopened");
        wal.append(&large(13, 15, 1), None, true).unwrap();
        want.extend(large(13, 15, 1));
        // On into new segments, of the current version.
        for i in (15..1000).step_by(10) {
            let es = ents(i, i + 10, 1);
            wal.append(&es, None, true).unwrap();
            want.extend(es);
        }
        assert!(wal.segment_count() >= 3);
    }
    assert!(entry_types(&seg).iter().all(|&t| t == ENTRY));
    let segs = segments(dir.path());
    for s in &segs[1..] {
        assert_eq!(std::fs::read(s).unwrap()[8..12], 3u32.to_le_bytes());
        assert!(entry_types(s).contains(&NEXT_ENTRY), "{}", s.display());
    }
    check_layout(dir.path());
    let wal = Wal::open(dir.path(), small()).unwrap();
    check_reads(&wal, &want, "both versions");
    assert_eq!(wal.hard_state(), Some(hs));
}

/// Opens `dir` (plain and strict) and expects a corruption error naming `seg` at `offset`,
/// with nothing repaired.
fn expect_misplaced(dir: &Path, seg: &Path, offset: u64, what: &str) {
    for strict in [false, true] {
        let o = WalOptions { strict, ..small() };
        match Wal::open(dir, o) {
            Err(e @ WalError::Corrupt { .. }) => {
                let WalError::Corrupt {
                    path, offset: at, ..
                } = &e
                else {
                    unreachable!()
                };
                assert_eq!((path.as_path(), *at), (seg, offset), "{what}: {e}");
                assert!(e.to_string().contains(what), "{e}");
            }
            other => panic!("{what}: opened: {other:?}"),
        }
    }
    assert!(
        !files(dir).iter().any(|n| n.contains("broken")),
        "{:?}",
        files(dir)
    );
}

#[test]
fn misplaced_next_entry_records_are_typed_corruption() {
    let base = tempfile::tempdir().unwrap();
    let e1 = entry(1, 1);
    let data2 = data(2, 1, 100);

    // Right after the seed record.
    let dir = base.path().join("after-seed");
    let (mut bytes, crc) = segment_start(0, 3, 1);
    let at = bytes.len() as u64;
    record(&mut bytes, NEXT_ENTRY, &data2, crc);
    let seg = write_segment(&dir, bytes);
    expect_misplaced(&dir, &seg, at, "without an entry record before it");

    // After a hard state that follows an entry.
    let dir = base.path().join("after-hard-state");
    let (mut bytes, mut crc) = segment_start(0, 3, 1);
    crc = record(&mut bytes, ENTRY, &entry_payload(&e1), crc);
    crc = record(&mut bytes, HARD_STATE, &[0u8; 24], crc);
    let at = bytes.len() as u64;
    crc = record(&mut bytes, NEXT_ENTRY, &data2, crc);
    record(&mut bytes, NEXT_ENTRY, &data2, crc);
    let seg = write_segment(&dir, bytes);
    expect_misplaced(&dir, &seg, at, "without an entry record before it");

    // In a version-2 segment, even right after an entry.
    let dir = base.path().join("version-2");
    let (mut bytes, mut crc) = segment_start(0, 2, 1);
    crc = record(&mut bytes, ENTRY, &entry_payload(&e1), crc);
    let at = bytes.len() as u64;
    record(&mut bytes, NEXT_ENTRY, &data2, crc);
    let seg = write_segment(&dir, bytes);
    expect_misplaced(&dir, &seg, at, "format version without them");

    // The same record after an entry in a version-3 segment is entry 2.
    let dir = base.path().join("version-3");
    let (mut bytes, mut crc) = segment_start(0, 3, 1);
    crc = record(&mut bytes, ENTRY, &entry_payload(&e1), crc);
    record(&mut bytes, NEXT_ENTRY, &data2, crc);
    write_segment(&dir, bytes);
    let wal = Wal::open(&dir, small()).unwrap();
    let e2 = Entry {
        index: 2,
        term: 1,
        data: data2,
    };
    check_reads(&wal, &[e1, e2], "hand-built");
}
