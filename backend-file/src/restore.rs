//! Restore from a snapshot stream with one sync at the end.
//!
//! The stream is parsed and checked by keel-mvcc's [`snapshot::restore_from_batched`] (or,
//! handed over as chunks, [`snapshot::restore_chunks_batched`], which parses inside the
//! chunks instead of copying them into a buffer of its own), and each batch of at most
//! [`RESTORE_FRAME_BYTES`] it yields is committed through [`Backend::commit_from`], encoded
//! straight from the parser's buffer or the chunks (and shown to the caller's observer, for
//! [`Backend::restore_observed`] and [`Backend::restore_chunks`]). Commits made on the restoring
//! thread write their frames without syncing them: straight to the disk where the file
//! system allows it (see `direct`: no copy into the page cache, at most two frames queued on
//! the device ahead of other writers' syncs), otherwise through the page cache, starting
//! their writeback. A segment
//! that fills is synced when it is sealed, and the active one once the whole stream has been
//! checked, before `restore` returns `Ok`. So a restore costs about one sync per segment
//! instead of one per batch, and that sync finds the data already written.
//!
//! The batches' index changes are published together, once the stream is whole and synced
//! (a version shared with readers after each batch would make the next one copy the index
//! nodes it changes); nothing reads a store while it is restored.
//!
//! A `RESTORING` marker file, durable before the first frame and removed only after the final
//! sync, makes a store whose restore did not finish (killed, or failed on a damaged stream)
//! refuse to open: a partial copy is never taken for a complete one.

use std::fs::OpenOptions;
use std::io::Read;

use keel_mvcc::backend::snapshot::{self, PairBatch};
use keel_mvcc::backend::{ChunkSource, PairObserver};
use keel_mvcc::{Backend, BackendError};

use crate::recovery::RESTORING;
use crate::store::{FileBackend, Inner};

/// Payload bytes of the batches a restore commits, one frame each. Small enough that a batch
/// is still in the processor's cache while it is parsed, shown to the observer, encoded into
/// its frame and copied into the direct writer's buffer. (Measured on 2 cores, restoring a
/// 222 MB stream of 1 KiB values while it arrives: the restoring thread's CPU time was about
/// 250 ms with 8 MiB batches, 200 ms with 1 MiB and 165 ms with 512 KiB; the direct writer's
/// 75, 58 and 55 ms.)
pub(crate) const RESTORE_FRAME_BYTES: usize = 512 << 10;

/// What a restore does with each batch the parser hands out.
type ApplyBatch<'a> = dyn FnMut(&PairBatch<'_>) -> Result<(), BackendError> + 'a;

impl FileBackend {
    pub(crate) fn restore_stream(
        &self,
        input: &mut dyn Read,
        observe: &mut PairObserver<'_>,
    ) -> Result<u64, BackendError> {
        self.restore_parsed(observe, &mut |apply| {
            snapshot::restore_from_batched(input, RESTORE_FRAME_BYTES, apply)
        })
    }

    /// [`restore_stream`](Self::restore_stream) from chunks, parsed inside them.
    pub(crate) fn restore_chunked(
        &self,
        chunks: &mut dyn ChunkSource,
        observe: &mut PairObserver<'_>,
    ) -> Result<u64, BackendError> {
        self.restore_parsed(observe, &mut |apply| {
            snapshot::restore_chunks_batched(chunks, RESTORE_FRAME_BYTES, apply)
        })
    }

    /// Runs `parse`, which parses the stream and hands its batches to the `apply` it is
    /// given, committing each batch (shown to `observe` first) without a sync, then syncs
    /// once.
    ///
    /// The store must hold no pairs, as the writer sees it (the batches of a restore are not
    /// published until it succeeds). While the restore runs, commits of other threads are
    /// refused; a restore that fails leaves the backend poisoned, so that nothing is
    /// committed or restored on top of the part of the stream it loaded (the `RESTORING`
    /// marker then keeps the store from opening again).
    fn restore_parsed(
        &self,
        observe: &mut PairObserver<'_>,
        parse: &mut dyn FnMut(&mut ApplyBatch<'_>) -> Result<u64, BackendError>,
    ) -> Result<u64, BackendError> {
        let inner = &self.inner;
        {
            let w = inner.writer.lock();
            Inner::check_poison(&w)?;
            let mut restoring = inner.restoring.lock();
            if restoring.is_some() || w.version.holds_pairs() {
                return Err(BackendError::RestoreNotEmpty);
            }
            *restoring = Some(std::thread::current().id());
        }
        let result = self.load(observe, parse);
        *inner.restoring.lock() = None;
        if let Err(e) = &result {
            Inner::poison(&mut inner.writer.lock(), e);
        }
        result
    }

    /// The body of [`restore_parsed`](Self::restore_parsed), run with the restore flagged.
    fn load(
        &self,
        observe: &mut PairObserver<'_>,
        parse: &mut dyn FnMut(&mut ApplyBatch<'_>) -> Result<u64, BackendError>,
    ) -> Result<u64, BackendError> {
        let inner = &self.inner;
        let marker = inner.dir.join(RESTORING);
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&marker)
            .map_err(|e| BackendError::io(&marker, "create", e))?;
        inner.io.sync_dir(&inner.dir)?;
        let pairs = parse(&mut |batch| {
            for (bucket, key, value) in batch.iter() {
                observe(bucket, key, value);
            }
            self.commit_from(batch)
        })?;
        inner.sync_restored()?;
        inner.share(&inner.writer.lock());
        std::fs::remove_file(&marker).map_err(|e| BackendError::io(&marker, "remove", e))?;
        inner.io.sync_dir(&inner.dir)?;
        Ok(pairs)
    }
}

impl Inner {
    /// True when the calling thread is running a restore, whose commits skip their sync.
    pub(crate) fn restoring_here(&self) -> bool {
        *self.restoring.lock() == Some(std::thread::current().id())
    }

    /// Makes every frame a restore wrote durable.
    fn sync_restored(&self) -> Result<(), BackendError> {
        let mut w = self.writer.lock();
        Self::check_poison(&w)?;
        if let Some(mut d) = w.direct.take()
            && let Err(e) = d.finish()
        {
            let e = BackendError::io(&w.active.seg.path, "direct pwrite", e);
            Self::poison(&mut w, &e);
            return Err(e);
        }
        if w.active.dirty {
            if let Err(e) = self.io.sync_data(&w.active.file, &w.active.seg.path) {
                Self::poison(&mut w, &e);
                return Err(e);
            }
            w.active.dirty = false;
        }
        Ok(())
    }
}
