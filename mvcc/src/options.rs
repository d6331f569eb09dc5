//! Store options.

use std::time::Duration;

use crate::error::MvccError;

/// Options for [`Store::open`](crate::Store::open).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreOptions {
    /// Longest time a write waits in memory before the background committer writes it to the
    /// backend. Default: 100 ms (etcd).
    pub batch_interval: Duration,
    /// Pending writes (changed revisions plus auxiliary writes) that trigger a backend commit
    /// before the interval ends. When the committer falls behind, a write transaction that
    /// leaves four times this many pending waits for the running backend commit to end, and
    /// one that leaves eight times this many commits them itself, so memory stays bounded.
    /// Default: 10 000 (etcd).
    pub batch_limit: usize,
    /// Largest request, counting keys, values and range ends. Default: 1.5 MiB (etcd).
    pub max_request_bytes: usize,
    /// Most operations in one transaction branch, nested transactions included. Default: 128
    /// (etcd).
    pub max_txn_ops: usize,
    /// Revisions deleted per backend batch while compacting. Default: 1 000 (etcd).
    pub compaction_batch_limit: usize,
    /// Pause between two compaction batches, so compaction never hogs the backend.
    /// Default: 10 ms (etcd).
    pub compaction_sleep_interval: Duration,
    /// Tries the background compactor makes at reading one batch of what to delete (a backend
    /// read transaction and a range of the key bucket) before it gives that compaction up
    /// and logs the error; the next compaction, or the next open, deletes what it left.
    /// Failures to commit a batch are not retried: they poison the store. Default: 8.
    pub compaction_read_tries: u32,
    /// The compactor's pause after its first failed read of a batch; each later failure of
    /// the same batch doubles it, up to 1 s (with the default tries, some 1.3 s in all).
    /// Default: 10 ms.
    pub compaction_retry_pause: Duration,
    /// Messages a watcher's channel holds before the watcher is marked slow and catches up
    /// from the store later: one per revision while it keeps up, one per catch-up round (its
    /// share of that round's revisions) while it catches up; the receiver still sees one
    /// response per revision. Default: 128 (etcd's channel length).
    pub watch_channel_capacity: usize,
    /// How often slow watchers and watchers started in the past are caught up.
    /// Default: 100 ms (etcd).
    pub watch_sync_interval: Duration,
    /// Revisions one catch-up round reads at least, for every watcher behind at once; a round
    /// with more watchers than this reads as many revisions as it has watchers. Default: 1 000.
    pub watch_sync_batch: usize,
    /// Long reads (ranges through a view, watch catch-up) give way to writes between chunks
    /// of 64 keys: they yield their CPU while a write transaction waits for the writer mutex
    /// or holds it, or while callers of `force_commit` wait for a commit, and they keep to
    /// [`long_read_cpu_percent`](Self::long_read_cpu_percent) while writes flow on busy
    /// CPUs. So on a machine with fewer cores than busy threads a scan does not take the CPU
    /// the writers and the committer need. Off, long reads never yield nor sleep. Default: true.
    pub yield_reads_to_writers: bool,
    /// The most of its elapsed time a long read spends on a CPU while writes flow (a write
    /// transaction began in the last 10 ms or is open, or a backend commit runs) and the
    /// machine has no CPU to spare (fewer than one idle CPU, sampled for 10 ms every 200 ms),
    /// in percent: between chunks it sleeps for the rest. 100 never sleeps. A scan beside
    /// busy writers on busy CPUs takes up to 100 / this times as long; with no writes
    /// flowing, or a CPU to spare, it runs at full speed. [`Store::read_pacing`] counts the
    /// sleeps. Between 1 and 100. Default: 15.
    ///
    /// [`Store::read_pacing`]: crate::Store::read_pacing
    pub long_read_cpu_percent: u32,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            batch_interval: Duration::from_millis(100),
            batch_limit: 10_000,
            max_request_bytes: 3 * 512 * 1024,
            max_txn_ops: 128,
            compaction_batch_limit: 1_000,
            compaction_sleep_interval: Duration::from_millis(10),
            compaction_read_tries: 8,
            compaction_retry_pause: Duration::from_millis(10),
            watch_channel_capacity: 128,
            watch_sync_interval: Duration::from_millis(100),
            watch_sync_batch: 1_000,
            yield_reads_to_writers: true,
            long_read_cpu_percent: 15,
        }
    }
}

impl StoreOptions {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), MvccError> {
        let bad = |option: &'static str, reason: &str| {
            Err(MvccError::InvalidOption {
                option,
                reason: reason.to_owned(),
            })
        };
        if self.batch_interval.is_zero() {
            return bad("batch_interval", "must be greater than zero");
        }
        if self.batch_limit == 0 {
            return bad("batch_limit", "must be at least 1");
        }
        if self.max_request_bytes == 0 {
            return bad("max_request_bytes", "must be at least 1");
        }
        if self.max_txn_ops == 0 {
            return bad("max_txn_ops", "must be at least 1");
        }
        if self.compaction_batch_limit == 0 {
            return bad("compaction_batch_limit", "must be at least 1");
        }
        if self.compaction_read_tries == 0 {
            return bad("compaction_read_tries", "must be at least 1");
        }
        if self.watch_channel_capacity == 0 {
            return bad("watch_channel_capacity", "must be at least 1");
        }
        if self.watch_sync_interval.is_zero() {
            return bad("watch_sync_interval", "must be greater than zero");
        }
        if !(1..=100).contains(&self.long_read_cpu_percent) {
            return bad("long_read_cpu_percent", "must be between 1 and 100");
        }
        if self.watch_sync_batch == 0 {
            return bad("watch_sync_batch", "must be at least 1");
        }
        Ok(())
    }
}
