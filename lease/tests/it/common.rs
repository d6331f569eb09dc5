//! Shared helpers: stores on the in-memory backend, lessors on a manual clock.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use keel_lease::{Lessor, LessorOptions, ManualClock};
use keel_mvcc::testing::{MemBackend, MemOptions};
use keel_mvcc::{Backend, RangeRequest, Store, StoreOptions};

/// A fresh path for the in-memory backend registry.
pub fn mem_path(tag: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    PathBuf::from(format!(
        "/keel-lease-test/{tag}/{}/{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ))
}

/// Opens (or reopens) the store at `path` on the in-memory backend.
pub fn open_store(path: &Path) -> Arc<Store<MemBackend>> {
    let backend = MemBackend::open(path, &MemOptions::default()).expect("open backend");
    Arc::new(Store::open(backend, StoreOptions::default()).expect("open store"))
}

/// Opens a lessor with default options on `store`.
pub fn open_lessor(store: &Arc<Store<MemBackend>>, clock: &Arc<ManualClock>) -> Lessor<MemBackend> {
    Lessor::open(store.clone(), clock.clone(), LessorOptions::default()).expect("open lessor")
}

/// Every key of the store with its lease id, ascending.
pub fn keys_with_leases<B: Backend>(store: &Store<B>) -> Vec<(Vec<u8>, i64)> {
    let all = RangeRequest {
        keys_only: true,
        ..RangeRequest::range(vec![0u8], vec![0u8])
    };
    store
        .range(&all)
        .expect("range")
        .kvs
        .into_iter()
        .map(|kv| (kv.key().to_vec(), kv.lease))
        .collect()
}

/// Runs every due checkpoint batch and applies it, as the Raft glue would.
pub fn run_checkpoints<B: Backend>(lessor: &Lessor<B>) -> usize {
    let mut total = 0;
    loop {
        let batch = lessor.checkpoint_batch();
        if batch.is_empty() {
            return total;
        }
        total += lessor.apply_checkpoints(&batch, None).expect("apply");
    }
}

pub fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}
