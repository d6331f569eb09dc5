//! Options of [`FileBackend`](crate::FileBackend).

use std::fmt;
use std::sync::Arc;

use keel_mvcc::BackendError;

use crate::fault::FaultHook;

/// How the space ahead of the writer is prepared (see [`FileOptions::prepare_ahead`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PrepareWith {
    /// Zeros are written and synced: a commit into them makes its sync flush data only, at
    /// the price of writing every byte twice (in the background, a step of at least 1 MiB at a
    /// time). While a restore runs, space is allocated instead (its direct writes must not
    /// meet zeros written through the page cache).
    Zeros,
    /// Blocks are allocated (`fallocate`) and synced: nothing is written twice, but the blocks
    /// are unwritten extents, so a commit's sync also converts them (on ext4 on a kernel
    /// worker thread, then it writes the inode): on a 16 KiB frame, about 3.5 sleeps and 70 us
    /// of system CPU per `fdatasync` against 2 and 40-46 us over zeros, and 330-360 us against
    /// 120-205 us per sync.
    Allocate,
    /// Zeros while the commits' frames are small (under 64 KiB), where the fixed cost of a
    /// sync into allocated space dominates, and allocation after larger frames, whose bytes
    /// written twice would cost more: 1 000 puts of 1 KiB per commit (1 MiB frames) took
    /// 1.82-3.24 ms per commit over zeros against 1.36-1.80 ms over allocated space; 16 puts
    /// per commit took 0.19-0.26 ms and 60-67 us of CPU over zeros against 0.40-0.43 ms and
    /// 123-138 us over allocated space (commit_profile, 3 and 2 alternating runs).
    Auto,
}

/// How a [`FileBackend`](crate::FileBackend) is opened and runs.
#[derive(Clone)]
pub struct FileOptions {
    /// A segment is sealed and a new one started once it holds this many bytes. Smaller
    /// segments let space come back sooner; each new segment costs two extra syncs.
    /// Default: 64 MiB. Range: 64 KiB to 2 GiB.
    pub segment_size: u64,
    /// Run the background space reclaimer. When off, space only comes back through
    /// [`defragment`](keel_mvcc::Backend::defragment) or
    /// [`FileBackend::reclaim`](crate::FileBackend::reclaim). Default: true.
    pub background_reclaim: bool,
    /// Reclaim sealed segments once their dead bytes exceed this fraction of the live bytes.
    /// Default: 0.5. Range: 0.05 to 100.
    pub reclaim_garbage_ratio: f64,
    /// ... and once there are at least this many dead bytes in sealed segments.
    /// Default: 64 MiB.
    pub reclaim_min_garbage: u64,
    /// The reclaimer copies live data in steps of about this many bytes, each one commit; the
    /// writer waits at most for one step. Default: 2 MiB. Minimum: 4 KiB.
    pub reclaim_step_bytes: u64,
    /// Prepare space ahead of the writer on a background thread: zeros written and synced
    /// past the committed end, and the next segment before the active one fills, so that a
    /// commit's sync flushes only its own bytes. When off, frames are appended and each new
    /// segment is created on the commit path (what fault-injection tests want: every I/O call
    /// then happens on the caller's thread, in a fixed order). Default: true.
    pub prepare_ahead: bool,
    /// How space is prepared ahead. Default: [`PrepareWith::Auto`] (a small commit's sync
    /// then flushes its frame and nothing else: fewer wake-ups of the committing thread, each
    /// of which waits for a CPU on a busy machine, and no kernel worker in the commit's path;
    /// large frames are not written twice).
    pub prepare_with: PrepareWith,
    /// Fault injection for tests: every write and sync of the store goes through this hook.
    /// Default: none.
    pub fault_hook: Option<Arc<dyn FaultHook>>,
}

impl Default for FileOptions {
    fn default() -> FileOptions {
        FileOptions {
            segment_size: 64 << 20,
            background_reclaim: true,
            reclaim_garbage_ratio: 0.5,
            reclaim_min_garbage: 64 << 20,
            reclaim_step_bytes: 2 << 20,
            prepare_ahead: true,
            prepare_with: PrepareWith::Auto,
            fault_hook: None,
        }
    }
}

impl fmt::Debug for FileOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileOptions")
            .field("segment_size", &self.segment_size)
            .field("background_reclaim", &self.background_reclaim)
            .field("reclaim_garbage_ratio", &self.reclaim_garbage_ratio)
            .field("reclaim_min_garbage", &self.reclaim_min_garbage)
            .field("reclaim_step_bytes", &self.reclaim_step_bytes)
            .field("prepare_ahead", &self.prepare_ahead)
            .field("prepare_with", &self.prepare_with)
            .field("fault_hook", &self.fault_hook.is_some())
            .finish()
    }
}

impl FileOptions {
    /// Checks every field against its documented range.
    pub fn validate(&self) -> Result<(), BackendError> {
        if !(64 << 10..=2 << 30).contains(&self.segment_size) {
            return Err(BackendError::InvalidOption(format!(
                "segment_size {} is outside 64 KiB..=2 GiB",
                self.segment_size
            )));
        }
        if !(0.05..=100.0).contains(&self.reclaim_garbage_ratio) {
            return Err(BackendError::InvalidOption(format!(
                "reclaim_garbage_ratio {} is outside 0.05..=100",
                self.reclaim_garbage_ratio
            )));
        }
        if self.reclaim_step_bytes < 4096 {
            return Err(BackendError::InvalidOption(format!(
                "reclaim_step_bytes {} is below 4096",
                self.reclaim_step_bytes
            )));
        }
        Ok(())
    }
}
