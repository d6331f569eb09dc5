//! Tuning knobs of the WAL, validated in one place.

use std::sync::Arc;
use std::time::Duration;

use crate::error::WalError;
use crate::io::{FileSystem, RealFs};
use crate::record::MAX_PAYLOAD;

/// Options for [`crate::Wal::open`].
#[derive(Clone)]
pub struct WalOptions {
    /// Size of a segment file; a segment is closed when the next record does not fit (a
    /// single record larger than this gets a segment of its own). Between 64 KiB and 1 GiB.
    /// Default: 64 MiB.
    pub segment_size: u64,
    /// Refuse to repair anything at open: a torn tail is reported as
    /// [`WalError::Corrupt`] instead of being truncated. Default: false.
    pub strict: bool,
    /// Prepare the next segment (create, size, write and sync its header) on a background
    /// thread, started once the active segment is a quarter full, so rotation only renames
    /// it. Default: true.
    pub preallocate: bool,
    /// Write zeros over a new segment's whole length (instead of only reserving it with
    /// `fallocate`), so later overwrites are pure data writes and `fdatasync` has no block
    /// allocation or extent conversion to journal. Costs one sequential write of
    /// `segment_size` per segment (synced a MiB at a time, so it never floods the disk's
    /// queue), done in the background when `preallocate` is on. Default: true.
    pub zero_fill: bool,
    /// Released segment files kept (as `<seq>.free`) to be recycled as later segments
    /// instead of deleted: their blocks are already written, so reusing one needs no zeroing
    /// and its `fdatasync`s journal no block allocation. Only files of exactly
    /// `segment_size` bytes are kept. Zero deletes released segments. Default: 2.
    pub recycle_segments: usize,
    /// Pending (not yet written) bytes of non-durable appends are written to the file once
    /// they exceed this many bytes. Default: 1 MiB.
    pub write_buffer: usize,
    /// Size of the reads that scan a segment at open and stream entries. Default: 4 MiB.
    pub read_buffer: usize,
    /// Threads that read and check segments at open, each one segment at a time (each with
    /// a read buffer of `read_buffer` bytes), while the opening thread applies what they
    /// found in segment order. Reading a log held in the page cache is the kernel's copy to
    /// user space plus the checksums, which several CPUs do faster than one. One scans on
    /// the opening thread alone. Between 1 and 64. Default: the CPUs available to the
    /// process, at most 4.
    pub recovery_threads: usize,
    /// Group commit: longest time a sync leader waits for the durable appenders released by
    /// the previous `fdatasync` to come back, so that they share the next one instead of
    /// splitting into alternating half groups. The leader waits only while fewer appenders
    /// are pending than the previous sync served (never when it served one, so a single
    /// writer never waits), and never longer than half the recent `fdatasync` time. Zero
    /// disables the wait. At most 100 ms. Default: 1 ms.
    pub group_commit_wait: Duration,
    /// Group commit: longest time a durable request that finds another thread's sync
    /// running spins for it (yielding the CPU between checks) before parking. A parked
    /// request costs the leader a wake-up call and itself a trip through the scheduler once
    /// the sync ends (tens of µs each on a virtual machine, where an idle CPU must first be
    /// woken), which the next group waits for; a spinning one sees the sync end at once and
    /// leaves its CPU to any other runnable thread meanwhile. The spin also ends at twice
    /// the recent `fdatasync` time, and whenever a sync ends without covering the request.
    /// Zero parks at once. At most 100 ms. Default: 1 ms.
    pub durable_spin: Duration,
    /// Write the records a sync is about to make durable with a direct write (`O_DIRECT`)
    /// of whole pages, where the file system allows it, instead of through the page cache:
    /// the kernel neither copies them into the cache nor writes them back inside
    /// `fdatasync`, which is left with the disk's cache flush. The write buffer sits in a
    /// transparent huge page where the kernel gives one (`transparent_hugepage` set to
    /// `madvise` or `always`), so a write of up to about 2 MiB reaches the device as one
    /// piece instead of one per 4 KiB page. Appends that are not synced at once still go
    /// through the page cache. Off, durable appends of large entries are written straight
    /// from the entries' own buffers (one vectored write). Default: true.
    pub direct_writes: bool,
    /// The file-system seam every file operation goes through. Default: the real file
    /// system ([`RealFs`]); tests inject faults through their own implementation.
    pub fs: Arc<dyn FileSystem>,
}

impl Default for WalOptions {
    fn default() -> WalOptions {
        WalOptions {
            segment_size: 64 << 20,
            strict: false,
            preallocate: true,
            zero_fill: true,
            recycle_segments: 2,
            write_buffer: 1 << 20,
            read_buffer: 4 << 20,
            recovery_threads: std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
            group_commit_wait: Duration::from_millis(1),
            durable_spin: Duration::from_millis(1),
            direct_writes: true,
            fs: Arc::new(RealFs),
        }
    }
}

impl std::fmt::Debug for WalOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalOptions")
            .field("segment_size", &self.segment_size)
            .field("strict", &self.strict)
            .field("preallocate", &self.preallocate)
            .field("zero_fill", &self.zero_fill)
            .field("recycle_segments", &self.recycle_segments)
            .field("write_buffer", &self.write_buffer)
            .field("read_buffer", &self.read_buffer)
            .field("recovery_threads", &self.recovery_threads)
            .field("group_commit_wait", &self.group_commit_wait)
            .field("durable_spin", &self.durable_spin)
            .field("direct_writes", &self.direct_writes)
            .finish_non_exhaustive()
    }
}

impl WalOptions {
    /// Checks every field, naming the first one out of range.
    pub fn validate(&self) -> Result<(), WalError> {
        if !(64 << 10..=1 << 30).contains(&self.segment_size) {
            return Err(WalError::InvalidOption {
                field: "segment_size",
                reason: format!("{} bytes is outside [64 KiB, 1 GiB]", self.segment_size),
            });
        }
        if !self.segment_size.is_multiple_of(8) {
            return Err(WalError::InvalidOption {
                field: "segment_size",
                reason: format!("{} bytes is not a multiple of 8", self.segment_size),
            });
        }
        if self.write_buffer == 0 || self.write_buffer > 256 << 20 {
            return Err(WalError::InvalidOption {
                field: "write_buffer",
                reason: format!("{} bytes is outside [1, 256 MiB]", self.write_buffer),
            });
        }
        if self.read_buffer < 4096 || self.read_buffer > MAX_PAYLOAD * 4 {
            return Err(WalError::InvalidOption {
                field: "read_buffer",
                reason: format!("{} bytes is outside [4 KiB, 64 MiB]", self.read_buffer),
            });
        }
        if !(1..=64).contains(&self.recovery_threads) {
            return Err(WalError::InvalidOption {
                field: "recovery_threads",
                reason: format!("{} threads is outside [1, 64]", self.recovery_threads),
            });
        }
        if self.recycle_segments > 64 {
            return Err(WalError::InvalidOption {
                field: "recycle_segments",
                reason: format!("{} files is more than 64", self.recycle_segments),
            });
        }
        if self.group_commit_wait > Duration::from_millis(100) {
            return Err(WalError::InvalidOption {
                field: "group_commit_wait",
                reason: format!("{:?} is longer than 100 ms", self.group_commit_wait),
            });
        }
        if self.durable_spin > Duration::from_millis(100) {
            return Err(WalError::InvalidOption {
                field: "durable_spin",
                reason: format!("{:?} is longer than 100 ms", self.durable_spin),
            });
        }
        Ok(())
    }
}
