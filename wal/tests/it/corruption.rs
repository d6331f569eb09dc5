//! Pins down damage handling: bit flips and zeroed ranges anywhere in the log give a typed
//! error or a repaired tail, never wrong data and never a panic; a missing middle segment is
//! a typed error.

use keel_wal::{Entry, Wal, WalError, WalOptions};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::util::{entries, records, segments};

fn opts() -> WalOptions {
    WalOptions {
        segment_size: 64 << 10,
        preallocate: false,
        ..WalOptions::default()
    }
}

/// Builds a log over several segments and returns its entries.
fn build(dir: &std::path::Path) -> Vec<Entry> {
    let want = entries(1, 1501, 1);
    let wal = Wal::open(dir, opts()).unwrap();
    for c in want.chunks(20) {
        wal.append(c, None, true).unwrap();
    }
    want
}

/// Copies the segments `segs` into `dir`, lets `damage` change the bytes of one of them
/// (picked by `rng`), writes them back and returns the damaged file's path.
fn damaged_copy(
    segs: &[std::path::PathBuf],
    dir: &std::path::Path,
    rng: &mut StdRng,
    damage: impl FnOnce(&mut Vec<u8>, &mut StdRng),
) -> std::path::PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for s in segs {
        std::fs::copy(s, dir.join(s.file_name().unwrap())).unwrap();
    }
    let victim = dir.join(segs[rng.random_range(0..segs.len())].file_name().unwrap());
    let mut bytes = std::fs::read(&victim).unwrap();
    damage(&mut bytes, rng);
    std::fs::write(&victim, &bytes).unwrap();
    victim
}

/// Opens the damaged log: either a typed error, or a log whose every entry is one of the
/// originals (a prefix of them).
fn check(dir: &std::path::Path, want: &[Entry], what: &str) -> bool {
    match Wal::open(dir, opts()) {
        Err(e) => {
            assert!(
                matches!(
                    e,
                    WalError::Corrupt { .. } | WalError::MissingSegment { .. }
                ),
                "{what}: unexpected error {e}"
            );
            assert!(
                e.to_string().contains(".wal"),
                "{what}: error names no file: {e}"
            );
            false
        }
        Ok(wal) => {
            let last = wal.last_index();
            assert!(last <= 1500, "{what}");
            let got = wal.entries(wal.first_index(), last + 1, None);
            match got {
                Ok(got) => assert_eq!(got, want[..last as usize].to_vec(), "{what}"),
                Err(e) => panic!("{what}: read after open failed: {e}"),
            }
            true
        }
    }
}

#[test]
fn random_bit_flips_never_yield_wrong_data() {
    let seed: u64 = std::env::var("KEEL_WAL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let mut rng = StdRng::seed_from_u64(seed);
    let base = tempfile::tempdir().unwrap();
    let clean = base.path().join("clean");
    let want = build(&clean);
    let segs = segments(&clean);
    assert!(segs.len() >= 3);
    let (mut errors, mut repaired) = (0, 0);
    for round in 0..60 {
        let dir = base.path().join(format!("flip{round}"));
        // Flip inside the written part (the first 60 KiB hold records).
        let at = rng.random_range(0..60_000);
        let victim = damaged_copy(&segs, &dir, &mut rng, |bytes, rng| {
            bytes[at] ^= 1 << rng.random_range(0..8)
        });
        let what = format!(
            "seed {seed} round {round}: flip at {at} of {}",
            victim.display()
        );
        if check(&dir, &want, &what) {
            repaired += 1
        } else {
            errors += 1
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    assert!(errors > 0, "no flip was reported as corruption");
    assert!(repaired > 0, "no flip was repaired as a torn tail");
}

#[test]
fn zeroed_ranges_never_yield_wrong_data() {
    let mut rng = StdRng::seed_from_u64(11);
    let base = tempfile::tempdir().unwrap();
    let clean = base.path().join("clean");
    let want = build(&clean);
    let segs = segments(&clean);
    for round in 0..40 {
        let dir = base.path().join(format!("zero{round}"));
        let at = rng.random_range(0..60_000);
        let mut len = 0;
        let victim = damaged_copy(&segs, &dir, &mut rng, |bytes, rng| {
            len = rng.random_range(1..4096).min(bytes.len() - at);
            bytes[at..at + len].fill(0);
        });
        check(
            &dir,
            &want,
            &format!(
                "round {round}: zeroed {len} at {at} of {}",
                victim.display()
            ),
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_missing_middle_segment_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    build(dir.path());
    let segs = segments(dir.path());
    std::fs::remove_file(&segs[1]).unwrap();
    let err = Wal::open(dir.path(), opts()).unwrap_err();
    assert!(matches!(err, WalError::MissingSegment { .. }), "{err}");
}

#[test]
fn damage_in_an_older_segment_names_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    build(dir.path());
    let segs = segments(dir.path());
    let mut bytes = std::fs::read(&segs[0]).unwrap();
    let holding = records(&bytes)
        .into_iter()
        .find(|r| r.offset <= 1000 && 1000 < r.offset + 8 + r.len)
        .expect("a record holds byte 1000");
    bytes[1000] ^= 0x40;
    std::fs::write(&segs[0], &bytes).unwrap();
    let err = Wal::open(dir.path(), opts()).unwrap_err();
    let WalError::Corrupt { path, offset, .. } = &err else {
        panic!("expected Corrupt, got {err}");
    };
    assert_eq!(path, &segs[0]);
    assert_eq!(*offset, holding.offset as u64);
}
