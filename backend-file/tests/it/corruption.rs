//! Damaged stores: a torn last frame at every byte is cut off and loses nothing committed
//! before it; random and mutated files make open return a typed error or a state that some
//! prefix of the commits produced, never a panic and never wrong data.

use std::fs;
use std::path::Path;
use std::sync::OnceLock;

use keel_backend_file::{FileBackend, FileOptions};
use keel_mvcc::{Backend, BackendError, WriteBatch};
use proptest::prelude::*;

use crate::support::{B, Dump, META_B, dump, segments, small};

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
