//! The shared backend conformance suite, run on the file backend with small segments (so
//! rolling, reclaiming and defragmenting cross segment boundaries) and with the defaults.

use std::time::Duration;

use keel_backend_file::{FileBackend, FileOptions};

keel_mvcc::backend_conformance_tests!(
    keel_backend_file::FileBackend,
    keel_backend_file::FileOptions {
        segment_size: 64 << 10,
        reclaim_min_garbage: 256 << 10,
        reclaim_step_bytes: 16 << 10,
        ..keel_backend_file::FileOptions::default()
    }
);

mod defaults {
    keel_mvcc::backend_conformance_tests!(
        keel_backend_file::FileBackend,
        keel_backend_file::FileOptions::default()
    );
}

#[test]
fn options_are_validated() {
    let bad = FileOptions {
        segment_size: 1,
        ..FileOptions::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let err = FileBackend::open(dir.path(), &bad).err().expect("rejected");
    assert!(err.to_string().contains("segment_size"), "{err}");
    assert!(FileOptions::default().validate().is_ok());
    for (slice, ok) in [
        (Duration::ZERO, true),
        (Duration::from_micros(100), true),
        (Duration::from_millis(100), true),
        (Duration::from_micros(99), false),
        (Duration::from_millis(101), false),
    ] {
        let options = FileOptions {
            commit_sync_slice: slice,
            ..FileOptions::default()
        };
        match options.validate() {
            Ok(()) => assert!(ok, "{slice:?} accepted"),
            Err(e) => {
                assert!(!ok, "{slice:?} refused: {e}");
                assert!(e.to_string().contains("commit_sync_slice"), "{e}");
            }
        }
    }
}
