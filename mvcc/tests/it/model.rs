//! The store against an in-memory model of its whole history, over the in-memory backend.

use keel_mvcc::testing::model;
use keel_mvcc::testing::{MemBackend, MemOptions};

#[test]
fn model_based_history_matches() {
    let dir = tempfile::tempdir().expect("tempdir");
    let steps = std::env::var("KEEL_MODEL_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    for seed in model::seeds(1, 12) {
        model::run::<MemBackend>(dir.path(), MemOptions::default(), seed, steps);
    }
}
