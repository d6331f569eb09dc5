//! The mvcc store on the file backend: its model-based history test and its SIGKILL crash
//! test (`KEEL_CRASH_ROUNDS` raises the rounds, `KEEL_MODEL_SEED` replays one model seed).

use keel_backend_file::{FileBackend, FileOptions};
use keel_mvcc::testing::{crash, model};

fn options() -> FileOptions {
    FileOptions {
        segment_size: 64 << 10,
        reclaim_min_garbage: 32 << 10,
        reclaim_step_bytes: 8 << 10,
        ..FileOptions::default()
    }
}

#[test]
fn model_based_history_matches() {
    let steps = std::env::var("KEEL_MODEL_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    for seed in model::seeds(1, 6) {
        let dir = tempfile::tempdir().unwrap();
        model::run::<FileBackend>(dir.path(), options(), seed, steps);
    }
}

#[test]
fn mvcc_survives_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    crash::run::<FileBackend>(
        "mvcc::mvcc_survives_sigkill",
        dir.path(),
        options(),
        crash::rounds(),
    );
}
