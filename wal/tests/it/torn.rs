//! Pins down torn-tail repair: a write cut at every byte offset of the final record (an
//! entry record, or a batch record), or of
//! the final segment's header, reopens to the last whole record (keeping a `.broken` copy),
//! and strict mode refuses instead.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use keel_wal::{Entry, Wal, WalError, WalOptions};

use crate::util::{FaultFs, entries, entry, files, records, segments};

fn opts() -> WalOptions {
    WalOptions {
        segment_size: 64 << 10,
        preallocate: false,
        ..WalOptions::default()
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn torn_final_record_at_every_offset() {
    // An entry record of its own.
    torn_final_append_at_every_offset(&[entry(21, 1)]);
}

#[test]
fn torn_final_batch_record_at_every_offset() {
    // A batch record of three entries.
    torn_final_append_at_every_offset(&entries(21, 24, 1));
}

/// Appends `last` (entries from 21 on, of term 1, written as one record) after 20 entries,
/// then reopens copies of the log with that record's write cut at every byte.
fn torn_final_append_at_every_offset(last: &[Entry]) {
    let base = tempfile::tempdir().unwrap();
    let before_dir = base.path().join("before");
    let want = entries(1, 21, 1);
    {
        let wal = Wal::open(&before_dir, opts()).unwrap();
        wal.append(&want, None, true).unwrap();
    }
    let seg = segments(&before_dir)[0].clone();
    let before = std::fs::read(&seg).unwrap();
    let after_dir = base.path().join("after");
    copy_dir(&before_dir, &after_dir);
    {
        let wal = Wal::open(&after_dir, opts()).unwrap();
        wal.append(last, None, true).unwrap();
    }
    let after = std::fs::read(after_dir.join(seg.file_name().unwrap())).unwrap();
    let first_diff = before.iter().zip(&after).position(|(a, b)| a != b).unwrap();
    let start = first_diff & !7;
    let data: usize = last.iter().map(|e| e.data.len()).sum();
    let payload = if last.len() == 1 {
        16 + data
    } else {
        24 + 4 * last.len() + data
    };
    let rec_len = 8 + payload.div_ceil(8) * 8;
    // From here on only zero padding is missing, and the padding is zeros already.
    let whole = 8 + payload;
    let new_last = 20 + last.len() as u64;
    assert!(
        after[start + rec_len..start + rec_len + 64]
            .iter()
            .all(|&b| b == 0)
    );

    for cut in 0..=rec_len {
        let dir = base.path().join(format!("cut{cut}"));
        copy_dir(&before_dir, &dir);
        let mut bytes = before.clone();
        bytes[start..start + cut].copy_from_slice(&after[start..start + cut]);
        let path = dir.join(seg.file_name().unwrap());
        std::fs::write(&path, &bytes).unwrap();

        if cut > 0 && cut < whole {
            let err = Wal::open(
                &dir,
                WalOptions {
                    strict: true,
                    ..opts()
                },
            )
            .unwrap_err();
            assert!(matches!(err, WalError::Corrupt { .. }), "cut {cut}: {err}");
            assert!(
                err.to_string()
                    .contains(&seg.file_name().unwrap().to_string_lossy().to_string())
            );
        }
        let wal = Wal::open(&dir, opts()).unwrap();
        let expect_last = if cut >= whole { new_last } else { 20 };
        assert_eq!(wal.last_index(), expect_last, "cut {cut}");
        let mut expect = want.clone();
        if cut >= whole {
            expect.extend_from_slice(last);
        }
        assert_eq!(
            wal.entries(1, expect_last + 1, None).unwrap(),
            expect,
            "cut {cut}"
        );
        let broken = files(&dir).iter().any(|n| n.contains(".broken"));
        assert_eq!(
            broken,
            cut > 0 && cut < whole,
            "cut {cut}: {:?}",
            files(&dir)
        );
        // The repaired log takes new appends and keeps them.
        wal.append(&[entry(expect_last + 1, 2)], None, true)
            .unwrap();
        drop(wal);
        let wal = Wal::open(&dir, opts()).unwrap();
        assert_eq!(wal.last_index(), expect_last + 1, "cut {cut}");
        assert_eq!(
            wal.entries(expect_last + 1, expect_last + 2, None).unwrap(),
            vec![entry(expect_last + 1, 2)]
        );
        drop(wal);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

fn header(seq: u64) -> [u8; 32] {
    let mut h = [0u8; 32];
    h[0..8].copy_from_slice(b"KEELWAL\0");
    h[8..12].copy_from_slice(&keel_wal::FORMAT_VERSION.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    let crc = crc32fast::hash(&h[0..28]);
    h[28..32].copy_from_slice(&crc.to_le_bytes());
    h
}

#[test]
fn torn_final_segment_header_at_every_offset() {
    let base = tempfile::tempdir().unwrap();
    let good = base.path().join("good");
    let want = entries(1, 101, 1);
    {
        let wal = Wal::open(&good, opts()).unwrap();
        wal.append(&want, None, true).unwrap();
    }
    assert_eq!(segments(&good).len(), 1);
    let h = header(1);
    for cut in 0..=32usize {
        let dir = base.path().join(format!("hcut{cut}"));
        copy_dir(&good, &dir);
        let mut bytes = vec![0u8; 64 << 10];
        bytes[..cut].copy_from_slice(&h[..cut]);
        let name = format!("{:016x}-{:016x}.wal", 1, 101);
        std::fs::write(dir.join(&name), &bytes).unwrap();
        if cut < 32 {
            let err = Wal::open(
                &dir,
                WalOptions {
                    strict: true,
                    ..opts()
                },
            )
            .unwrap_err();
            assert!(
                matches!(err, WalError::Corrupt { offset: 0, .. }),
                "cut {cut}: {err}"
            );
        }
        let wal = Wal::open(&dir, opts()).unwrap();
        assert_eq!(wal.last_index(), 100, "cut {cut}");
        assert_eq!(wal.entries(1, 101, None).unwrap(), want, "cut {cut}");
        let broken = files(&dir).iter().any(|n| n.contains(".broken"));
        assert_eq!(broken, cut < 32, "cut {cut}");
        wal.append(&entries(101, 111, 2), None, true).unwrap();
        drop(wal);
        let wal = Wal::open(&dir, opts()).unwrap();
        assert_eq!(wal.last_index(), 110, "cut {cut}");
        assert_eq!(wal.entries(95, 111, None).unwrap().len(), 16);
        drop(wal);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn unknown_version_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    {
        let wal = Wal::open(dir.path(), opts()).unwrap();
        wal.append(&entries(1, 5, 1), None, true).unwrap();
    }
    let seg = segments(dir.path())[0].clone();
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[8..12].copy_from_slice(&7u32.to_le_bytes());
    let crc = crc32fast::hash(&bytes[0..28]);
    bytes[28..32].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&seg, &bytes).unwrap();
    let err = Wal::open(dir.path(), opts()).unwrap_err();
    assert!(
        matches!(err, WalError::UnknownVersion { found: 7, .. }),
        "{err}"
    );
}

/// A log of entries 1..=20 in one segment whose last record (entry 20) has a damaged byte:
/// a torn tail.
/// Returns the segment's path and the offset of the damaged record.
fn torn_log(dir: &Path) -> (PathBuf, usize) {
    {
        let wal = Wal::open(dir, opts()).unwrap();
        wal.append(&entries(1, 20, 1), None, true).unwrap();
        wal.append(&[entry(20, 1)], None, true).unwrap();
    }
    let seg = segments(dir)[0].clone();
    let mut bytes = std::fs::read(&seg).unwrap();
    let last = records(&bytes).pop().unwrap();
    bytes[last.offset + 8 + last.len / 2] ^= 0x40;
    std::fs::write(&seg, &bytes).unwrap();
    (seg, last.offset)
}

#[test]
fn the_copy_of_a_torn_segment_is_durable_before_the_segment_changes() {
    let dir = tempfile::tempdir().unwrap();
    let (seg, _) = torn_log(dir.path());
    let seg_name = seg.file_name().unwrap().to_string_lossy().into_owned();
    let (fs, faults) = FaultFs::new();
    faults.record_ops.store(true, Ordering::SeqCst);
    let wal = Wal::open(
        dir.path(),
        WalOptions {
            fs: Arc::new(fs),
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(wal.last_index(), 19);
    let ops = faults.ops.lock().clone();
    let names = |op: &str| op.split(' ').skip(1).map(str::to_owned).collect::<Vec<_>>();
    let touches_copy = |op: &str| names(op).iter().any(|n| n.contains(".broken"));
    let changes_seg = |op: &str| {
        (op.starts_with("write ") || op.starts_with("set_len ")) && names(op) == [seg_name.clone()]
    };
    let first_change = ops
        .iter()
        .position(|op| changes_seg(op))
        .unwrap_or_else(|| panic!("the segment was never repaired: {ops:?}"));
    let copy_done = ops[..first_change]
        .iter()
        .rposition(|op| touches_copy(op))
        .unwrap_or_else(|| panic!("no copy before the repair: {ops:?}"));
    assert!(
        ops[copy_done].starts_with("sync "),
        "the copy is not synced before the repair: {ops:?}"
    );
    assert!(
        ops[copy_done..first_change]
            .iter()
            .any(|op| op.starts_with("sync_dir ")),
        "the directory holding the copy is not synced before the segment changes: {ops:?}"
    );
}

#[test]
fn a_repair_on_a_nearly_full_disk_keeps_only_the_damaged_part() {
    let dir = tempfile::tempdir().unwrap();
    let (seg, offset) = torn_log(dir.path());
    let before = std::fs::read(&seg).unwrap();
    let (fs, faults) = FaultFs::new();
    // Room for the header and the pages from the damaged record on, not for the segment.
    *faults.broken_space.lock() = Some(16 << 10);
    let wal = Wal::open(
        dir.path(),
        WalOptions {
            fs: Arc::new(fs),
            ..opts()
        },
    )
    .unwrap_or_else(|e| panic!("open with 16 KiB free: {e}"));
    assert_eq!(wal.last_index(), 19);
    drop(wal);
    let mut copy_path = seg.clone().into_os_string();
    copy_path.push(".broken");
    let copy = std::fs::read(&copy_path).unwrap();
    assert_eq!(copy.len(), before.len());
    assert_eq!(copy[..32], before[..32], "the header is kept");
    assert!(
        copy[32..offset].iter().all(|&b| b == 0),
        "the whole records are left out"
    );
    assert_eq!(copy[offset..], before[offset..], "the damaged part is kept");
    let repaired = std::fs::read(&seg).unwrap();
    assert_eq!(repaired[..offset], before[..offset]);
}

#[test]
fn a_repair_without_room_for_the_copy_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (seg, _) = torn_log(dir.path());
    let before = std::fs::read(&seg).unwrap();
    let (fs, faults) = FaultFs::new();
    *faults.broken_space.lock() = Some(1 << 10);
    let o = WalOptions {
        fs: Arc::new(fs),
        ..opts()
    };
    let err = Wal::open(dir.path(), o.clone()).unwrap_err();
    assert!(err.is_disk_full(), "{err}");
    assert!(err.to_string().contains("copy"), "{err}");
    assert!(
        err.to_string()
            .contains(&seg.file_name().unwrap().to_string_lossy().to_string()),
        "{err}"
    );
    assert_eq!(std::fs::read(&seg).unwrap(), before, "the segment changed");
    assert!(
        !files(dir.path()).iter().any(|n| n.contains(".broken")),
        "{:?}",
        files(dir.path())
    );
    // Once there is room, the log opens.
    *faults.broken_space.lock() = None;
    let wal = Wal::open(dir.path(), o).unwrap();
    assert_eq!(wal.last_index(), 19);
}
