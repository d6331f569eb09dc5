//! Restore from a snapshot stream with one sync at the end.
//!
//! The stream is parsed and checked by keel-mvcc's [`snapshot::restore_from_batched`] (or,
//! handed over as chunks, [`snapshot::restore_chunks_batched`], which parses inside the
//! chunks instead of copying them into a buffer of its own), and each batch of at most
//! [`RESTORE_FRAME_BYTES`] it yields is committed as one frame, encoded straight from the
//! parser's buffer (and shown to the caller's observer, for [`Backend::restore_observed`] and
//! [`Backend::restore_chunks`]). A batch of a stream handed over as chunks is not encoded by
//! the restoring thread at all: its put records go to the writer as places in the chunks,
//! which the direct writer's threads encode straight into the buffers they write from (see
//! `direct`); the chunks go back to the source once those writes are finished. Commits made on the restoring
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

#[cfg(doc)]
use keel_mvcc::Backend;
use keel_mvcc::backend::snapshot::{self, MAX_KEY, MAX_VALUE, PairBatch};
use keel_mvcc::backend::{ChunkSource, PairObserver};
use keel_mvcc::{BackendError, Bucket};

use crate::direct::Puts;
use crate::format::{self, FRAME_HEADER};
use crate::recovery::RESTORING;
use crate::store::{FileBackend, Inner};
use crate::version::Loc;

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
        let inner = &self.inner;
        self.restore_parsed(observe, &mut |apply| {
            // The direct writer's jobs hold chunks until they are encoded: all are done once
            // its writes are finished, and the chunks go back to the source.
            snapshot::restore_chunks_settled(chunks, RESTORE_FRAME_BYTES, apply, || {
                inner.finish_direct()
            })
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
        // No reclaim pass or defragmentation runs while the restore does (they wait): one
        // would roll the segment the restore writes, drop the segments it filled, and
        // publish its batches before it ends.
        let _no_reclaim = inner.reclaim_lock.lock();
        {
            let w = inner.writer.lock();
            Inner::check_poison(&w)?;
            let mut restoring = inner.restoring.lock();
            if restoring.is_some() || w.version.holds_pairs() {
                return Err(BackendError::RestoreNotEmpty);
            }
            *restoring = Some(std::thread::current().id());
        }
        inner.prep.set_restoring(true);
        let result = self.load(observe, parse);
        *inner.restoring.lock() = None;
        match &result {
            Ok(_) => inner.prep.set_restoring(false),
            Err(e) => Inner::poison(&mut inner.writer.lock(), e),
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
            if inner.commit_restored(batch, observe)? {
                self.nudge_reclaimer();
            }
            Ok(())
        })?;
        inner.sync_restored()?;
        inner.share(&inner.writer.lock());
        std::fs::remove_file(&marker).map_err(|e| BackendError::io(&marker, "remove", e))?;
        inner.io.sync_dir(&inner.dir)?;
        Ok(pairs)
    }
}

impl Inner {
    /// Commits one batch of a restore without a sync, on the restoring thread, after
    /// showing its pairs to `observe`. A batch of a stream received in chunks
    /// ([`PairBatch::shared`]) is not encoded here: its put records go to the writer as
    /// places in the chunks ([`Puts`]), for the direct writer's threads to encode where they
    /// write the frame; any other batch is committed as [`commit`](Inner::commit) does.
    /// Returns whether the reclaimer should run.
    fn commit_restored(
        &self,
        batch: &PairBatch<'_>,
        observe: &mut PairObserver<'_>,
    ) -> Result<bool, BackendError> {
        let Some(pairs) = batch.shared() else {
            for (bucket, key, value) in batch.iter() {
                observe(bucket, key, value);
            }
            return self.commit(batch, false);
        };
        if batch.is_empty() {
            return Ok(false);
        }
        let mut w = self.writer.lock();
        Self::check_poison(&w)?;
        // One pass over the pairs shows them to the observer, validates them (the parser
        // bounds keys and values by the same limits; checked again as any commit is), names
        // the batch's new buckets and lists the put records; nothing is written before it has
        // gone through.
        let first_new = w.bucket_names.len() as u32;
        let mut new_buckets: Vec<Bucket> = Vec::new();
        let mut puts = Puts::with_capacity(batch.len());
        // Each put's bucket id, key and value length, and the offset of its value from the
        // start of the records.
        let mut placed: Vec<(u32, &[u8], u32, usize)> = Vec::with_capacity(batch.len());
        let mut last: Option<(&Bucket, u32)> = None;
        for p in pairs {
            for (what, len, limit) in [
                ("key", p.key_len, MAX_KEY),
                ("value", p.value_len, MAX_VALUE),
            ] {
                if len > limit {
                    return Err(BackendError::TooLarge { what, len, limit });
                }
            }
            let id = match last {
                Some((b, id)) if std::ptr::eq(b, p.bucket) || b == p.bucket => id,
                _ => {
                    let id = match w.bucket_id(p.bucket, first_new, &new_buckets) {
                        Some(id) => id,
                        None => {
                            p.bucket.validate()?;
                            new_buckets.push(p.bucket.clone());
                            first_new + new_buckets.len() as u32 - 1
                        }
                    };
                    last = Some((p.bucket, id));
                    id
                }
            };
            let pair = p
                .buf
                .get(p.key_at..p.key_at + p.key_len + p.value_len)
                .ok_or_else(|| {
                    BackendError::Other("restore: a pair lies outside its chunk".into())
                })?;
            let (key, value) = pair.split_at(p.key_len);
            observe(p.bucket, key, value);
            let at = puts.push(id, p.buf, p.key_at, p.key_len, p.value_len);
            placed.push((id, key, p.value_len as u32, at));
        }
        let mut estimate = (FRAME_HEADER + puts.len()) as u64;
        for b in w.bucket_names.iter().chain(&new_buckets) {
            estimate += 6 + b.name().len() as u64;
        }
        self.begin_frame(&mut w, estimate)?;
        for (i, b) in new_buckets.iter().enumerate() {
            format::put_bucket(&mut w.buf, first_new + i as u32, b.name());
        }
        let records_at = w.buf.len();
        w.puts = Some(puts);
        let start = self.finish_frame(&mut w, false)?;

        // Written: apply to the index, a run of one bucket's keys at a time (a restore's
        // keys arrive sorted per bucket, so most go to the end of its last leaf).
        w.add_buckets(first_new, new_buckets);
        let seg = w.active.seg.id;
        let base = start + records_at as u64;
        let mut applier = w.applier();
        for run in placed.chunk_by(|a, b| a.0 == b.0) {
            let entries = run.iter().map(|&(_, key, len, at)| {
                let loc = Loc {
                    seg,
                    off: (base + at as u64) as u32,
                    len,
                };
                (key, loc)
            });
            applier.put_sorted(run[0].0, seg, entries);
        }
        // Published together when the restore succeeds (see the module doc).
        self.record_end(&mut w)?;
        let (dead, live) = w.garbage();
        Ok(self.should_reclaim(dead, live))
    }

    /// True when the calling thread is running a restore, whose commits skip their sync.
    pub(crate) fn restoring_here(&self) -> bool {
        *self.restoring.lock() == Some(std::thread::current().id())
    }

    /// Waits for the direct writer's writes (and writes its held-back block).
    fn finish_direct(&self) -> Result<(), BackendError> {
        let mut w = self.writer.lock();
        Self::check_poison(&w)?;
        if let Some(d) = &mut w.direct
            && let Err(e) = d.finish()
        {
            let e = BackendError::io(&w.active.seg.path, "direct pwrite", e);
            Self::poison(&mut w, &e);
            return Err(e);
        }
        Ok(())
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
            w.durable_seq = w.next_seq - 1;
        }
        Ok(())
    }
}
