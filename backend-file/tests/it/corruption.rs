//! Damaged stores: a torn last frame at every byte is cut off and loses nothing committed
//! before it; random and mutated files make open return a typed error or a state that some
//! prefix of the commits produced, never a panic and never wrong data.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use keel_backend_file::format::FRAME_HEADER;
use keel_backend_file::{FileBackend, FileOptions};
use keel_mvcc::{Backend, BackendError, WriteBatch};
use proptest::prelude::*;

use crate::support::{B, Dump, META_B, dump, segments, small, summary};

fn copy_dir(from: &Path, to: &Path) {
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let name = e.file_name();
        if name == "LOCK" {
            continue;
        }
        fs::copy(e.path(), to.join(&name)).unwrap();
    }
}

fn batch(i: u32) -> WriteBatch {
    let mut b = WriteBatch::new();
    for j in 0..40u32 {
        b.put(
            &B,
            format!("k{:03}", (i * 7 + j) % 120).into_bytes(),
            vec![i as u8; 200 + j as usize],
        );
    }
    b.delete(&B, format!("k{:03}", (i * 13) % 120).into_bytes());
    if i.is_multiple_of(5) {
        b.delete_range(&B, b"k05".to_vec(), Some(b"k06".to_vec()));
    }
    b.put(&META_B, b"n".to_vec(), i.to_be_bytes().to_vec());
    b
}

/// A pristine store over several segments, and the state after each commit (index 0: empty).
struct Pristine {
    dir: tempfile::TempDir,
    states: Vec<Dump>,
}

fn pristine() -> &'static Pristine {
    static P: OnceLock<Pristine> = OnceLock::new();
    P.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let b = FileBackend::open(dir.path(), &small()).unwrap();
        let mut states = vec![dump(&b)];
        for i in 0..30 {
            b.commit(&batch(i)).unwrap();
            states.push(dump(&b));
        }
        assert!(
            segments(dir.path()).len() >= 3,
            "the pristine store spans segments"
        );
        Pristine { dir, states }
    })
}

/// Opens a damaged copy: a typed error, or a state that a prefix of the commits produced
/// and that passes the integrity check.
fn open_damaged(dir: &Path) -> Result<usize, String> {
    let options = FileOptions {
        background_reclaim: false,
        ..small()
    };
    match FileBackend::open(dir, &options) {
        Ok(b) => {
            b.check_integrity()
                .expect("a store that opens passes the integrity check");
            let got = dump(&b);
            let k = pristine()
                .states
                .iter()
                .position(|s| *s == got)
                .expect("opened store holds the state of some prefix of the commits");
            // It stays writable and reopens.
            b.commit(&batch(99)).expect("commit after repair");
            drop(b);
            let b = FileBackend::open(dir, &options).expect("reopen after repair");
            b.check_integrity().unwrap();
            Ok(k)
        }
        Err(e @ (BackendError::Corrupt { .. } | BackendError::UnsupportedVersion { .. })) => {
            let text = e.to_string();
            assert!(
                text.contains(dir.to_str().unwrap()),
                "error names the file: {text}"
            );
            Err(text)
        }
        Err(other) => panic!("unexpected error kind: {other:?}"),
    }
}

#[test]
fn torn_last_frame_at_every_byte() {
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), &small()).unwrap();
    b.commit(&batch(0)).unwrap();
    b.commit(&batch(1)).unwrap();
    let seg = segments(dir.path()).pop().unwrap();
    let before = fs::metadata(&seg).unwrap().len();
    let state = dump(&b);
    let mut last = WriteBatch::new();
    last.put(&B, b"k000".to_vec(), b"torn".to_vec());
    last.delete(&B, b"k001".to_vec());
    last.put(&META_B, b"n".to_vec(), 2u32.to_be_bytes().to_vec());
    b.commit(&last).unwrap();
    let after = fs::metadata(&seg).unwrap().len();
    drop(b);
    let full = fs::read(&seg).unwrap();
    for cut in before..after {
        let copy = tempfile::tempdir().unwrap();
        copy_dir(dir.path(), copy.path());
        let target = copy.path().join(seg.file_name().unwrap());
        fs::write(&target, &full[..cut as usize]).unwrap();
        let b = FileBackend::open(copy.path(), &small()).unwrap();
        assert_eq!(dump(&b), state, "cut at {cut}");
        b.check_integrity().unwrap();
        assert_eq!(
            fs::metadata(&target).unwrap().len(),
            before,
            "torn tail cut off"
        );
    }
}

/// Offsets of the frames of a segment file of this build's format, walking the documented
/// layout from the end of the segment header until the bytes stop holding a frame.
fn frame_offsets(bytes: &[u8]) -> Vec<usize> {
    let header = FRAME_HEADER;
    let mut out = Vec::new();
    let mut at = 32;
    while at + header <= bytes.len() && bytes[at..at + header].iter().any(|&b| b != 0) {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        if at + header + len > bytes.len() {
            break;
        }
        out.push(at);
        at += header + len;
    }
    out
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap())
}

/// A store in one segment holding `n` synced commits of `batch`, its segment file, and the
/// state after each commit (index 0: empty).
fn one_segment(n: u32) -> (tempfile::TempDir, PathBuf, Vec<Dump>) {
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), &small()).unwrap();
    let mut states = vec![dump(&b)];
    for i in 0..n {
        b.commit(&batch(i)).unwrap();
        states.push(dump(&b));
    }
    drop(b);
    let segs = segments(dir.path());
    assert_eq!(segs.len(), 1, "the commits fit in one segment");
    let seg = segs[0].clone();
    (dir, seg, states)
}

/// A bit flipped anywhere in a synced frame of the last segment that later synced frames
/// follow is damage, not a torn commit: open fails naming the file and the frame's offset,
/// and the file is left as it is (every later batch is still in it).
#[test]
fn damage_to_a_durable_frame_of_the_last_segment_is_an_error() {
    let (dir, seg, _) = one_segment(4);
    let pristine = fs::read(&seg).unwrap();
    let frames = frame_offsets(&pristine);
    assert_eq!(frames.len(), 4, "four frames");
    let bad = frames[1];
    let payload_len = frames[2] - bad - FRAME_HEADER;
    // The length (low and high byte), the checksum, the sequence number, the durable field
    // and the middle of the payload.
    for (what, at, bit) in [
        ("payload", bad + FRAME_HEADER + payload_len / 2, 0x10u8),
        ("length low byte", bad, 0x02),
        ("length high byte", bad + 3, 0x80),
        ("checksum", bad + 5, 0x01),
        ("sequence number", bad + 9, 0x04),
        ("durable field", bad + FRAME_HEADER - 1, 0x01),
    ] {
        let copy = tempfile::tempdir().unwrap();
        copy_dir(dir.path(), copy.path());
        let target = copy.path().join(seg.file_name().unwrap());
        let mut damaged = pristine.clone();
        damaged[at] ^= bit;
        fs::write(&target, &damaged).unwrap();
        refused_at(copy.path(), &target, bad as u64, what);
        assert!(
            fs::read(&target).unwrap() == damaged,
            "{what}: the damaged segment was changed"
        );
    }
}

/// The last frame written before a reopen counts as durable once the store is open again:
/// the first commit after the reopen records it so, and damage to it is then an error, not
/// a torn commit that would take that batch and the later one with it.
#[test]
fn damage_to_the_last_frame_before_a_reopen_is_an_error() {
    let (dir, seg, _) = one_segment(3);
    let b = FileBackend::open(dir.path(), &small()).unwrap();
    b.commit(&batch(3)).unwrap();
    drop(b);
    assert_eq!(segments(dir.path()).len(), 1, "still one segment");
    let pristine = fs::read(&seg).unwrap();
    let frames = frame_offsets(&pristine);
    assert_eq!(frames.len(), 4, "four frames");
    let (bad, next) = (frames[2], frames[3]);
    let mut damaged = pristine.clone();
    damaged[bad + FRAME_HEADER + 100] ^= 0x08;
    fs::write(&seg, &damaged).unwrap();
    refused_at(dir.path(), &seg, bad as u64, "the damaged frame");
    assert!(
        fs::read(&seg).unwrap() == damaged,
        "the damaged segment was changed"
    );
    assert_eq!(
        u64_at(&pristine, next + 16),
        3,
        "the first frame after the reopen records sequence 3 as durable"
    );
}

/// A commit torn by a crash is still cut off wherever the cut falls, inside its header
/// (which records the frame before it as durable) or its payload, and so is one followed by a
/// whole later frame written before it was durable (frames written without a sync, as a
/// restore writes them, may reach the disk in any order).
#[test]
fn torn_final_frame_is_cut_off_even_before_a_frame_not_durable_after_it() {
    let (dir, seg, states) = one_segment(3);
    let full = fs::read(&seg).unwrap();
    let frames = frame_offsets(&full);
    assert_eq!(frames.len(), 3, "three frames");
    let last = frames[2];
    let end =
        last + FRAME_HEADER + u32::from_le_bytes(full[last..last + 4].try_into().unwrap()) as usize;
    assert_eq!(u64_at(&full, last + 8), 3, "the final frame is sequence 3");
    assert_eq!(
        u64_at(&full, last + 16),
        2,
        "the final frame's header records sequence 2 as durable"
    );
    let reopen = |bytes: &[u8], what: &str| {
        let copy = tempfile::tempdir().unwrap();
        copy_dir(dir.path(), copy.path());
        let target = copy.path().join(seg.file_name().unwrap());
        fs::write(&target, bytes).unwrap();
        let b = FileBackend::open(copy.path(), &small())
            .unwrap_or_else(|e| panic!("{what}: a torn commit makes open fail: {e}"));
        assert!(dump(&b) == states[2], "{what}: holds the first two commits");
        b.check_integrity().unwrap();
        assert_eq!(
            fs::metadata(&target).unwrap().len(),
            last as u64,
            "{what}: cut at the torn frame"
        );
    };
    let frame_len = end - last;
    for cut in [
        1,
        4,
        8,
        12,
        16,
        20,
        FRAME_HEADER - 1,
        FRAME_HEADER,
        FRAME_HEADER + 7,
        frame_len / 2,
        frame_len - 1,
    ] {
        reopen(
            &full[..last + cut],
            &format!("cut {cut} bytes into the frame"),
        );
    }
    // Half of sequence 3, then the whole of a sequence 4 that records only 2 as durable.
    let mut next = full[last..end].to_vec();
    next[8..16].copy_from_slice(&4u64.to_le_bytes());
    next[16..24].copy_from_slice(&2u64.to_le_bytes());
    let crc = crc32fast::hash(&next[8..]);
    next[4..8].copy_from_slice(&crc.to_le_bytes());
    let mut bytes = full[..last + frame_len / 2].to_vec();
    bytes.resize(end, 0);
    bytes.extend_from_slice(&next);
    reopen(&bytes, "torn frame before a frame not durable after it");
}

/// A whole version-3 frame of sequence `seq` and durable field `durable`, with a matching
/// checksum, whose payload is one put record in bucket 0.
fn hand_frame(seq: u64, durable: u64) -> Vec<u8> {
    let mut payload = vec![0x01];
    payload.extend_from_slice(&0u32.to_le_bytes());
    payload.extend_from_slice(&1u32.to_le_bytes());
    payload.extend_from_slice(&1u32.to_le_bytes());
    payload.extend_from_slice(b"xy");
    let mut frame = Vec::new();
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(&[0; 4]);
    frame.extend_from_slice(&seq.to_le_bytes());
    frame.extend_from_slice(&durable.to_le_bytes());
    frame.extend_from_slice(&payload);
    let crc = crc32fast::hash(&frame[8..]);
    frame[4..8].copy_from_slice(&crc.to_le_bytes());
    frame
}

/// Two synced commits, then a third whose one value is `value`; returns the store, its
/// segment file, the offset of the third frame and the offset of `value` in the file.
fn third_commit_holding(value: Vec<u8>) -> (tempfile::TempDir, PathBuf, Vec<Dump>, usize, usize) {
    let (dir, seg, states) = one_segment(2);
    let b = FileBackend::open(dir.path(), &small()).unwrap();
    let mut last = WriteBatch::new();
    last.put(&B, b"crafted".to_vec(), value.clone());
    b.commit(&last).unwrap();
    drop(b);
    let full = fs::read(&seg).unwrap();
    let frames = frame_offsets(&full);
    assert_eq!(frames.len(), 3, "three frames");
    let at = full
        .windows(value.len())
        .position(|w| w == value.as_slice())
        .expect("the value is in the segment");
    (dir, seg, states, frames[2], at)
}

/// A torn final commit whose value holds a whole frame (matching checksum, records for a
/// payload, the next sequence number, a durable field recording the torn frame) followed by
/// bytes that are no frame is still a torn commit: the frame does not chain up to the end of
/// the file, so it was never a frame of the store.
#[test]
fn a_frame_inside_a_torn_value_does_not_make_it_durable() {
    let mut value = hand_frame(4, 3);
    let embedded = value.len();
    value.extend(std::iter::repeat_n(0xab, 400));
    let (dir, seg, states, last, at) = third_commit_holding(value);
    let full = fs::read(&seg).unwrap();
    // Torn after the embedded frame and 100 bytes of the value after it.
    fs::write(&seg, &full[..at + embedded + 100]).unwrap();
    let b = FileBackend::open(dir.path(), &small())
        .unwrap_or_else(|e| panic!("a torn commit makes open fail: {e}"));
    assert!(
        dump(&b) == states[2],
        "holds the first two commits: {}",
        summary(&dump(&b))
    );
    b.check_integrity().unwrap();
    drop(b);
    assert_eq!(
        fs::metadata(&seg).unwrap().len(),
        last as u64,
        "cut at the torn frame"
    );
}

/// The scan past a bad place of the last segment checksums a bounded number of bytes: a torn
/// final commit whose value is made of headers that pass every bound but the checksum (each
/// claiming the rest of the file as its payload) makes open stop the scan and refuse the
/// store, naming the bad frame, rather than checksum the rest of the file for each of them.
#[test]
fn the_scan_after_a_bad_frame_is_bounded() {
    let mut value = Vec::new();
    while value.len() < 24 << 10 {
        let mut h = hand_frame(4, 3);
        h.truncate(24);
        h[..4].copy_from_slice(&(8u32 << 10).to_le_bytes());
        value.extend_from_slice(&h);
    }
    let (dir, seg, _, last, at) = third_commit_holding(value);
    let full = fs::read(&seg).unwrap();
    fs::write(&seg, &full[..at + (20 << 10)]).unwrap();
    let reason = refused_at(dir.path(), &seg, last as u64, "the torn frame");
    assert!(reason.contains("stopped"), "{reason}");
}

/// A store whose segment is of format version 2 (frames without the durable field, as
/// documented for it) opens and reads, its torn tail is still cut off, and commits go on in
/// a new segment of this build's version, leaving the old one as it was.
#[test]
fn a_version_2_segment_is_read_and_sealed() {
    fn header(magic: &[u8; 8], value: u64) -> Vec<u8> {
        let mut h = vec![0u8; 32];
        h[..8].copy_from_slice(magic);
        h[8..12].copy_from_slice(&2u32.to_le_bytes());
        h[16..24].copy_from_slice(&value.to_le_bytes());
        let crc = crc32fast::hash(&h[..24]);
        h[24..28].copy_from_slice(&crc.to_le_bytes());
        h
    }
    fn frame(out: &mut Vec<u8>, seq: u64, payload: &[u8]) {
        let mut f = Vec::new();
        f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        f.extend_from_slice(&[0; 4]);
        f.extend_from_slice(&seq.to_le_bytes());
        f.extend_from_slice(payload);
        let crc = crc32fast::hash(&f[8..]);
        f[4..8].copy_from_slice(&crc.to_le_bytes());
        out.extend_from_slice(&f);
    }
    fn put(out: &mut Vec<u8>, bucket: u32, key: &[u8], value: &[u8]) {
        out.push(0x01);
        out.extend_from_slice(&bucket.to_le_bytes());
        out.extend_from_slice(&(key.len() as u32).to_le_bytes());
        out.extend_from_slice(&(value.len() as u32).to_le_bytes());
        out.extend_from_slice(key);
        out.extend_from_slice(value);
    }
    let mut first = Vec::new();
    for (id, name) in [(0u32, "key"), (1, "meta")] {
        first.push(0x04);
        first.extend_from_slice(&id.to_le_bytes());
        first.push(name.len() as u8);
        first.extend_from_slice(name.as_bytes());
    }
    put(&mut first, 0, b"a", b"one");
    put(&mut first, 0, b"b", b"two");
    put(&mut first, 1, b"n", b"1");
    let mut second = Vec::new();
    second.push(0x02);
    second.extend_from_slice(&0u32.to_le_bytes());
    second.extend_from_slice(&1u32.to_le_bytes());
    second.extend_from_slice(b"a");
    put(&mut second, 0, b"c", b"three");
    put(&mut second, 1, b"n", b"2");
    let mut seg = header(b"KEELSEG\0", 1);
    frame(&mut seg, 1, &first);
    frame(&mut seg, 2, &second);
    let end = seg.len();
    let mut want = Dump::new();
    want.entry("key".into()).or_default().extend([
        (b"b".to_vec(), b"two".to_vec()),
        (b"c".to_vec(), b"three".to_vec()),
    ]);
    want.entry("meta".into())
        .or_default()
        .insert(b"n".to_vec(), b"2".to_vec());

    // Prepared zeros after the frames, or the first bytes of a torn third commit.
    let mut torn = seg.clone();
    frame(&mut torn, 3, &second);
    torn.truncate(end + 30);
    let mut zeros = seg.clone();
    zeros.resize(end + 4096, 0);
    for (what, bytes) in [("zeros after it", zeros), ("a torn tail", torn)] {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("META"), header(b"KEELMETA", 1)).unwrap();
        let old = dir.path().join("0000000000000001.seg");
        fs::write(&old, &bytes).unwrap();
        let b = FileBackend::open(dir.path(), &small()).unwrap();
        assert!(dump(&b) == want, "{what}: {}", summary(&dump(&b)));
        b.check_integrity().unwrap();
        let mut more = WriteBatch::new();
        more.put(&B, b"d".to_vec(), b"four".to_vec());
        b.commit(&more).unwrap();
        drop(b);
        let kept = &bytes[..if what == "a torn tail" {
            end
        } else {
            bytes.len()
        }];
        assert!(
            fs::read(&old).unwrap() == kept,
            "{what}: the old segment is kept as it was"
        );
        let segs = segments(dir.path());
        assert_eq!(segs.len(), 2, "{what}: the commit went into a new segment");
        let new = fs::read(&segs[1]).unwrap();
        assert_eq!(
            u32::from_le_bytes(new[8..12].try_into().unwrap()),
            keel_backend_file::format::VERSION,
            "{what}: the new segment is of this build's version"
        );
        let b = FileBackend::open(dir.path(), &small()).unwrap();
        want.get_mut("key")
            .unwrap()
            .insert(b"d".to_vec(), b"four".to_vec());
        assert!(
            dump(&b) == want,
            "{what} after reopen: {}",
            summary(&dump(&b))
        );
        want.get_mut("key").unwrap().remove(&b"d"[..]);
        b.check_integrity().unwrap();
    }
}

/// A hand-written store of one version-3 segment holding one frame of sequence `seq` and
/// durable field `seq - 1` (declaring buckets `key` and `meta`, putting `a` = `one` in `key`),
/// then zeros; returns its directory and segment file.
fn one_hand_written_frame(seq: u64) -> (tempfile::TempDir, PathBuf) {
    fn header(magic: &[u8; 8], version: u32, value: u64) -> Vec<u8> {
        let mut h = vec![0u8; 32];
        h[..8].copy_from_slice(magic);
        h[8..12].copy_from_slice(&version.to_le_bytes());
        h[16..24].copy_from_slice(&value.to_le_bytes());
        let crc = crc32fast::hash(&h[..24]);
        h[24..28].copy_from_slice(&crc.to_le_bytes());
        h
    }
    let mut payload = Vec::new();
    for (id, name) in [(0u32, "key"), (1, "meta")] {
        payload.push(0x04);
        payload.extend_from_slice(&id.to_le_bytes());
        payload.push(name.len() as u8);
        payload.extend_from_slice(name.as_bytes());
    }
    payload.push(0x01);
    payload.extend_from_slice(&0u32.to_le_bytes());
    payload.extend_from_slice(&1u32.to_le_bytes());
    payload.extend_from_slice(&3u32.to_le_bytes());
    payload.extend_from_slice(b"aone");
    let mut frame = Vec::new();
    frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    frame.extend_from_slice(&[0; 4]);
    frame.extend_from_slice(&seq.to_le_bytes());
    frame.extend_from_slice(&(seq - 1).to_le_bytes());
    frame.extend_from_slice(&payload);
    let crc = crc32fast::hash(&frame[8..]);
    frame[4..8].copy_from_slice(&crc.to_le_bytes());
    let mut seg = header(b"KEELSEG\0", 3, 1);
    seg.extend_from_slice(&frame);
    seg.resize(4096, 0);
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("META"), header(b"KEELMETA", 2, 1)).unwrap();
    let path = dir.path().join("0000000000000001.seg");
    fs::write(&path, seg).unwrap();
    (dir, path)
}

/// A frame whose sequence number is the largest a u64 holds (its checksum matching) is
/// corruption: no sequence can follow it, and this build never writes it.
#[test]
fn a_frame_of_the_largest_sequence_number_is_corruption() {
    let (dir, seg) = one_hand_written_frame(u64::MAX);
    let bytes = fs::read(&seg).unwrap();
    refused_at(dir.path(), &seg, 32, "the frame");
    assert!(fs::read(&seg).unwrap() == bytes, "the segment was changed");
}

/// A store whose last frame has the sequence number just below the largest opens and reads,
/// but refuses a commit (it would need that largest number) with a typed error, writing
/// nothing.
#[test]
fn a_commit_past_the_last_sequence_number_is_refused() {
    let (dir, seg) = one_hand_written_frame(u64::MAX - 1);
    let bytes = fs::read(&seg).unwrap();
    let b = FileBackend::open(dir.path(), &small()).unwrap();
    let held = dump(&b);
    assert_eq!(summary(&held), "[key: 1 keys] n=None");
    let mut more = WriteBatch::new();
    more.put(&B, b"b".to_vec(), b"two".to_vec());
    match b.commit(&more) {
        Err(BackendError::Corrupt { path, reason, .. }) => {
            assert_eq!(path, seg, "the error names the segment");
            assert!(reason.contains("exhausted"), "{reason}");
        }
        other => panic!("expected a Corrupt error, got {other:?}"),
    }
    assert!(dump(&b) == held, "readers see no change");
    drop(b);
    assert!(fs::read(&seg).unwrap() == bytes, "the segment was changed");
    let b = FileBackend::open(dir.path(), &small()).unwrap();
    assert!(dump(&b) == held, "after reopen: {}", summary(&dump(&b)));
    b.check_integrity().unwrap();
}

#[test]
fn flip_in_sealed_segment_is_an_error() {
    let p = pristine();
    let copy = tempfile::tempdir().unwrap();
    copy_dir(p.dir.path(), copy.path());
    let first = segments(copy.path()).remove(0);
    let mut bytes = fs::read(&first).unwrap();
    bytes[100] ^= 0x40;
    fs::write(&first, bytes).unwrap();
    let err = open_damaged(copy.path()).expect_err("damage in a sealed segment");
    assert!(err.contains("checksum"), "{err}");
}

#[test]
fn foreign_and_future_files_are_refused() {
    let p = pristine();
    let copy = tempfile::tempdir().unwrap();
    copy_dir(p.dir.path(), copy.path());
    fs::write(copy.path().join("META"), b"definitely not a keel meta file").unwrap();
    let err = open_damaged(copy.path()).unwrap_err();
    assert!(err.contains("META"), "{err}");

    let copy = tempfile::tempdir().unwrap();
    copy_dir(p.dir.path(), copy.path());
    let first = segments(copy.path()).remove(0);
    let mut bytes = fs::read(&first).unwrap();
    bytes[8] = 9; // version 9
    let crc = crc32fast::hash(&bytes[..24]);
    bytes[24..28].copy_from_slice(&crc.to_le_bytes());
    fs::write(&first, bytes).unwrap();
    match FileBackend::open(copy.path(), &small()) {
        Err(BackendError::UnsupportedVersion {
            found: 9,
            supported: keel_backend_file::format::VERSION,
            path,
        }) => {
            assert_eq!(path, first)
        }
        other => panic!("expected UnsupportedVersion, got {:?}", other.map(|_| ())),
    }

    // A version older than any this build reads names the oldest it reads.
    let mut bytes = fs::read(&first).unwrap();
    bytes[8] = 1;
    let crc = crc32fast::hash(&bytes[..24]);
    bytes[24..28].copy_from_slice(&crc.to_le_bytes());
    fs::write(&first, bytes).unwrap();
    match FileBackend::open(copy.path(), &small()) {
        Err(BackendError::UnsupportedVersion {
            found: 1,
            supported,
            ..
        }) => assert_eq!(
            supported,
            keel_backend_file::format::OLDEST_VERSION,
            "an older file names the oldest version read"
        ),
        other => panic!("expected UnsupportedVersion, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn missing_segment_is_an_error() {
    let p = pristine();
    let copy = tempfile::tempdir().unwrap();
    copy_dir(p.dir.path(), copy.path());
    let segs = segments(copy.path());
    fs::remove_file(&segs[1]).unwrap();
    let err = open_damaged(copy.path()).unwrap_err();
    assert!(err.contains("missing"), "{err}");
}

#[derive(Debug, Clone)]
enum Damage {
    Flip { file: usize, at: usize, bit: u8 },
    Truncate { file: usize, at: usize },
    Append { file: usize, bytes: Vec<u8> },
    Replace { file: usize, bytes: Vec<u8> },
    Zero { file: usize, at: usize, len: usize },
}

fn damage() -> impl Strategy<Value = Vec<Damage>> {
    let file = 0usize..8;
    let one = prop_oneof![
        (file.clone(), any::<usize>(), 0u8..8).prop_map(|(file, at, bit)| Damage::Flip {
            file,
            at,
            bit
        }),
        (file.clone(), any::<usize>()).prop_map(|(file, at)| Damage::Truncate { file, at }),
        (file.clone(), proptest::collection::vec(any::<u8>(), 1..64))
            .prop_map(|(file, bytes)| Damage::Append { file, bytes }),
        (file.clone(), proptest::collection::vec(any::<u8>(), 0..96))
            .prop_map(|(file, bytes)| Damage::Replace { file, bytes }),
        (file, any::<usize>(), 1usize..600).prop_map(|(file, at, len)| Damage::Zero {
            file,
            at,
            len
        }),
    ];
    proptest::collection::vec(one, 1..4)
}

fn apply(dir: &Path, d: &Damage) {
    let mut files = segments(dir);
    files.push(dir.join("META"));
    let pick = |i: usize| files[i % files.len()].clone();
    match d {
        Damage::Flip { file, at, bit } => {
            let p = pick(*file);
            let mut b = fs::read(&p).unwrap();
            if !b.is_empty() {
                let i = at % b.len();
                b[i] ^= 1 << bit;
                fs::write(&p, b).unwrap();
            }
        }
        Damage::Truncate { file, at } => {
            let p = pick(*file);
            let b = fs::read(&p).unwrap();
            fs::write(&p, &b[..at % (b.len() + 1)]).unwrap();
        }
        Damage::Append { file, bytes } => {
            let p = pick(*file);
            let mut b = fs::read(&p).unwrap();
            b.extend_from_slice(bytes);
            fs::write(&p, b).unwrap();
        }
        Damage::Replace { file, bytes } => fs::write(pick(*file), bytes).unwrap(),
        Damage::Zero { file, at, len } => {
            let p = pick(*file);
            let mut b = fs::read(&p).unwrap();
            if !b.is_empty() {
                let i = at % b.len();
                let end = (i + len).min(b.len());
                b[i..end].fill(0);
                fs::write(&p, b).unwrap();
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn damaged_files_never_panic_nor_lie(damage in damage()) {
        let p = pristine();
        let copy = tempfile::tempdir().unwrap();
        copy_dir(p.dir.path(), copy.path());
        for d in &damage {
            apply(copy.path(), d);
        }
        // Either outcome is fine; open_damaged asserts that each is well formed.
        let _ = open_damaged(copy.path());
    }
}

/// Opens the store in `dir`, which must be refused as corrupt at `offset` of segment `seg`;
/// returns the reason given. `what` names the case in a failure.
fn refused_at(dir: &Path, seg: &Path, offset: u64, what: &str) -> String {
    match FileBackend::open(dir, &small()) {
        Err(BackendError::Corrupt {
            path,
            offset: at,
            reason,
        }) => {
            assert_eq!(path, seg, "{what}: the error names the segment");
            assert_eq!(at, offset, "{what}: the error names the frame ({reason})");
            reason
        }
        Err(other) => panic!("{what}: expected a Corrupt error, got {other}"),
        Ok(b) => panic!(
            "{what}: expected a Corrupt error, but the store opened holding {}",
            summary(&dump(&b))
        ),
    }
}
