//! The shared backend conformance suite, run on the file backend with small segments (so
//! rolling, reclaiming and defragmenting cross segment boundaries) and with the defaults.

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
}
