//! Counters of what a log has written and synced since it was opened, for tuning group
//! commit and segment preparation ([`crate::Wal::stats`]).

use std::time::Duration;

/// What a [`crate::Wal`] has done since it was opened. A snapshot: the counters keep going.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WalStats {
    /// Calls that wrote records (appends with entries or a changed hard state, snapshot
    /// markers, metadata).
    pub appends: u64,
    /// Calls that had to wait for a sync to make their records durable (durable appends,
    /// [`crate::Wal::sync`], snapshot markers, metadata), counted once each.
    pub durable_requests: u64,
    /// `fdatasync`s run by group commit leaders (not counting the syncs that close a full
    /// segment).
    pub syncs: u64,
    /// Total time group commit leaders spent in `fdatasync` (the disk's share of durable
    /// appends; the rest of their latency is the log's and the scheduler's).
    pub sync_time: Duration,
    /// Durable appends of large entries written straight from the entries' own buffers
    /// (one vectored write through the page cache) rather than copied into the write
    /// buffer; only where direct writes are off.
    pub direct_writes: u64,
    /// Writes ahead of a group commit's `fdatasync` made as direct writes
    /// ([`crate::WalOptions::direct_writes`]).
    pub direct_flushes: u64,
    /// Bytes of records encoded.
    pub bytes: u64,
    /// Times a sync leader waited for the appenders of the previous group to come back.
    pub gathers: u64,
    /// Total time sync leaders spent in those waits.
    pub gather_time: Duration,
    /// Durable requests that waited for another thread's sync by spinning and saw it end
    /// without parking ([`crate::WalOptions::durable_spin`]).
    pub spun: u64,
    /// Segments started since open (rotations).
    pub rotations: u64,
    /// Rotations into a recycled (released, renamed and rewritten) segment file.
    pub recycled: u64,
}

impl WalStats {
    /// Durable requests served per `fdatasync`: how well group commit shares syncs (1.0 for
    /// a single writer; 0 before the first sync).
    pub fn requests_per_sync(&self) -> f64 {
        if self.syncs == 0 {
            0.0
        } else {
            self.durable_requests as f64 / self.syncs as f64
        }
    }
}
