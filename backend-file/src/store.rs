//! [`FileBackend`]: the writer, the published index version, and the `Backend` trait.
//!
//! One mutex serialises writers (commits and the reclaimer's copy steps); it is held across
//! the commit's write and `fdatasync`. Readers never take it: a read transaction clones the
//! `Arc` of the published [`Version`] under a lock that is only ever held for that clone or
//! for the pointer swap that publishes a commit.
//!
//! A commit encodes the batch as one frame (see [`crate::format`]), writes it with one
//! positioned write at the committed end of the active segment — into space prepared ahead
//! ([`crate::prepare`]) that no reader reads — syncs it, applies it to the writer's copy of
//! the index, records the new committed end in that copy (the segment's mapping already
//! covers it, unless the frame outgrew the segment size), and publishes the result.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{SyncSender, TrySendError};
use std::thread::JoinHandle;

use keel_mvcc::backend::snapshot::{MAX_KEY, MAX_VALUE};
use keel_mvcc::{Backend, BackendError, BackendSize, BatchOpRef, BatchSource, Bucket, WriteBatch};
use parking_lot::{Mutex, RwLock};

use crate::direct::{DirectWriter, Frame, Puts};
use crate::fault::{DirectOutcome, Io};
use crate::format::{self, FRAME_HEADER, HEADER_LEN};
use crate::options::FileOptions;
use crate::prepare::Preparer;
use crate::recovery::{self, Active};
use crate::segment::{self, SegFile, SegMap};
use crate::txn::FileReadTxn;
use crate::version::{Applier, Loc, Mapped, SegStat, Version};

/// Name of the lock file inside the store directory.
pub const LOCK_FILE: &str = "LOCK";

/// The error of a commit whose frame was written, and synced unless a restore was loading,
/// but whose batch could not be published: mapping the segment past the frame failed. The
/// batch is in no index version readers see, so the backend is poisoned: no later write
/// proceeds against an index that lacks the batch. After a synced commit the batch is
/// durable and a reopen finds it in the store. A restore's batch fails the restore instead:
/// its marker stays, a reopen refuses the store as incomplete, and the store is to be
/// discarded. Returned inside [`BackendError::Other`]; later writes fail with
/// [`BackendError::Poisoned`], whose reason is this error's text.
#[derive(Debug)]
pub struct UnpublishedCommit {
    /// Sequence number of the batch's frame.
    pub seq: u64,
    /// The segment file holding the frame.
    pub path: PathBuf,
    /// Whether the frame was synced (false only for a restore's batch, synced at its end).
    pub synced: bool,
    /// Why the segment could not be mapped. Told in this error's text, which a poisoned
    /// backend repeats, so not returned as its [`source`](std::error::Error::source) too.
    pub source: BackendError,
}

impl std::fmt::Display for UnpublishedCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (seq, path, source) = (self.seq, self.path.display(), &self.source);
        if self.synced {
            write!(
                f,
                "batch {seq} was written and synced ({path}): it is durable and a reopen finds \
                 it in the store, but it could not be published to readers: {source}"
            )
        } else {
            write!(
                f,
                "batch {seq} of a restore was written without a sync ({path}) but could not be \
                 published to readers: {source}; the restore fails and leaves the store \
                 incomplete, so a reopen refuses it: discard the store"
            )
        }
    }
}

/// The mapping error is part of the text (see the `source` field).
impl std::error::Error for UnpublishedCommit {}

/// How long open waits for a busy lock before reporting it held.
const LOCK_PATIENCE: std::time::Duration = std::time::Duration::from_millis(250);

/// keel's pure-Rust, memory-mapped, log-structured [`Backend`].
///
/// See the crate documentation for the design and [`crate::format`] for the bytes on disk.
pub struct FileBackend {
    pub(crate) inner: Arc<Inner>,
    reclaimer: Option<(SyncSender<()>, JoinHandle<()>)>,
    preparer: Option<JoinHandle<()>>,
}

pub(crate) struct Inner {
    pub(crate) dir: PathBuf,
    pub(crate) options: FileOptions,
    pub(crate) io: Io,
    /// Space prepared ahead of the writer (see [`crate::prepare`]).
    pub(crate) prep: Arc<Preparer>,
    _lock: File,
    pub(crate) published: RwLock<Arc<Version>>,
    pub(crate) writer: Mutex<Writer>,
    /// Serialises reclaim passes and defragments.
    pub(crate) reclaim_lock: Mutex<()>,
    /// The thread running a restore, whose commits write without syncing.
    pub(crate) restoring: Mutex<Option<std::thread::ThreadId>>,
}

pub(crate) struct Writer {
    /// The writer's copy of the index: equal to the published version between commits.
    pub(crate) version: Version,
    pub(crate) stats: BTreeMap<u32, SegStat>,
    pub(crate) active: Active,
    pub(crate) next_seq: u64,
    /// The highest sequence number known durable: every frame up to it has been synced
    /// (every frame found at open is: open syncs the last segment). Written into each frame's
    /// header (see [`crate::format`], section "Frame").
    pub(crate) durable_seq: u64,
    pub(crate) bucket_names: Vec<Bucket>,
    pub(crate) buf: Vec<u8>,
    pub(crate) poisoned: Option<String>,
    /// Direct writes of a restore's frames to the active segment (see `direct`).
    pub(crate) direct: Option<DirectWriter>,
    /// The file system refused `O_DIRECT`: restores write through the page cache.
    pub(crate) direct_refused: bool,
    /// Put records that follow `buf` in the frame being built, still to be encoded (a
    /// restore's batch, see `restore`): encoded by the direct writer's threads where it
    /// writes the frame, else appended to `buf` before it is written.
    pub(crate) puts: Option<Puts>,
}

impl Writer {
    /// The id of `bucket`: its own, or its place among the buckets `new` a frame being built
    /// creates (`first` is the first one's id).
    pub(crate) fn bucket_id(&self, bucket: &Bucket, first: u32, new: &[Bucket]) -> Option<u32> {
        self.version.names.get(bucket).copied().or_else(|| {
            new.iter()
                .position(|n| n == bucket)
                .map(|i| first + i as u32)
        })
    }

    /// Names the buckets a written frame created (`first` is the first one's id) in the
    /// writer's index.
    pub(crate) fn add_buckets(&mut self, first: u32, new: Vec<Bucket>) {
        if new.is_empty() {
            return;
        }
        let names = Arc::make_mut(&mut self.version.names);
        for (i, b) in new.iter().enumerate() {
            names.insert(b.clone(), first + i as u32);
        }
        for b in new {
            self.bucket_names.push(b);
            self.version.maps.push(Default::default());
        }
    }

    pub(crate) fn applier(&mut self) -> Applier<'_> {
        Applier {
            maps: &mut self.version.maps,
            stats: &mut self.stats,
        }
    }

    /// Dead bytes in sealed segments, and live bytes in total.
    pub(crate) fn garbage(&self) -> (u64, u64) {
        let active = self.active.seg.id;
        let mut dead = 0;
        let mut live = 0;
        for (&id, s) in &self.stats {
            live += s.live;
            if id != active {
                dead += s.size.saturating_sub(s.live);
            }
        }
        (dead, live)
    }
}

/// Fills in a frame's checksum (over its sequence number, durable field and payload); its
/// length, sequence number and durable field are already in place.
fn seal_frame(frame: &mut [u8]) {
    let crc = format::frame_crc(&frame[8..]);
    frame[4..8].copy_from_slice(&crc.to_le_bytes());
}

impl FileBackend {
    /// Opens (creating if absent) the store in directory `path`.
    pub fn open(path: &Path, options: &FileOptions) -> Result<FileBackend, BackendError> {
        options.validate()?;
        std::fs::create_dir_all(path).map_err(|e| BackendError::io(path, "create directory", e))?;
        let lock_path = path.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(|e| BackendError::io(&lock_path, "open", e))?;
        // A lock held by a closed handle can linger for a moment: a child process forked
        // by another thread holds a copy of every descriptor until it calls exec. So a busy
        // lock is retried briefly before it counts as held.
        let deadline = std::time::Instant::now() + LOCK_PATIENCE;
        loop {
            match lock.try_lock() {
                Ok(()) => break,
                Err(std::fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(BackendError::Locked {
                        path: path.to_path_buf(),
                    });
                }
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(BackendError::io(&lock_path, "lock", e));
                }
            }
        }
        let io = Io::new(options.fault_hook.clone());
        let r = recovery::recover(path, &io, options.segment_size)?;
        let prep = Preparer::new(path, io.clone(), options.segment_size, options.prepare_with);
        prep.set_active(
            r.active.seg.id,
            r.active.file.clone(),
            r.active.seg.path.clone(),
            r.zeroed,
        );
        let published = RwLock::new(Arc::new(r.version.clone()));
        let inner = Arc::new(Inner {
            dir: path.to_path_buf(),
            options: options.clone(),
            io,
            prep,
            _lock: lock,
            published,
            writer: Mutex::new(Writer {
                version: r.version,
                stats: r.stats,
                active: r.active,
                next_seq: r.next_seq,
                durable_seq: r.durable_seq,
                bucket_names: r.bucket_names,
                buf: Vec::new(),
                poisoned: None,
                direct: None,
                direct_refused: false,
                puts: None,
            }),
            reclaim_lock: Mutex::new(()),
            restoring: Mutex::new(None),
        });
        let preparer = if options.prepare_ahead {
            Some(inner.prep.spawn()?)
        } else {
            None
        };
        let mut backend = FileBackend {
            inner,
            reclaimer: None,
            preparer,
        };
        if options.background_reclaim {
            backend.reclaimer = Some(crate::reclaim::spawn(&backend.inner)?);
        }
        tracing::debug!(path = %path.display(), "opened file backend");
        Ok(backend)
    }

    /// The store's directory.
    pub fn path(&self) -> &Path {
        &self.inner.dir
    }

    /// Runs one reclaim pass now if dead space has crossed the configured threshold; returns
    /// whether it reclaimed anything. The background reclaimer calls the same code.
    pub fn reclaim(&self) -> Result<bool, BackendError> {
        self.inner.reclaim_if_needed()
    }

    /// Checks the whole store: every frame of every segment against its checksum and
    /// sequence, and every index entry against the record it points to.
    pub fn check_integrity(&self) -> Result<(), BackendError> {
        crate::verify::check(self)
    }

    pub(crate) fn nudge_reclaimer(&self) {
        if let Some((tx, _)) = &self.reclaimer {
            match tx.try_send(()) {
                Ok(()) | Err(TrySendError::Full(())) | Err(TrySendError::Disconnected(())) => {}
            }
        }
    }
}

impl Drop for FileBackend {
    fn drop(&mut self) {
        if let Some((tx, handle)) = self.reclaimer.take() {
            drop(tx);
            if handle.join().is_err() {
                tracing::warn!("the background reclaimer panicked");
            }
        }
        self.inner.prep.stop();
        if let Some(handle) = self.preparer.take()
            && handle.join().is_err()
        {
            tracing::warn!("the segment preparer panicked");
        }
    }
}

impl Inner {
    /// Refuses writes after a durability failure.
    pub(crate) fn check_poison(w: &Writer) -> Result<(), BackendError> {
        match &w.poisoned {
            Some(reason) => Err(BackendError::Poisoned {
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    pub(crate) fn poison(w: &mut Writer, e: &BackendError) {
        tracing::error!(error = %e, "file backend poisoned");
        w.poisoned.get_or_insert_with(|| e.to_string());
    }

    /// Seals the active segment and starts the next one: the one prepared ahead if there is
    /// one (renamed into place), else a new file. Any failure once the id is chosen poisons
    /// the backend.
    pub(crate) fn roll(&self, w: &mut Writer) -> Result<(), BackendError> {
        let id = w
            .active
            .seg
            .id
            .checked_add(1)
            .filter(|&id| id < u32::MAX)
            .ok_or_else(|| BackendError::Corrupt {
                path: self.dir.clone(),
                offset: 0,
                reason: "segment ids exhausted".into(),
            })?;
        let started = (|| {
            if let Some(d) = &mut w.direct {
                d.finish()
                    .map_err(|e| BackendError::io(&w.active.seg.path, "direct pwrite", e))?;
            }
            if w.active.dirty {
                // Frames written without a sync (a restore): a sealed segment is durable.
                self.io.sync_data(&w.active.file, &w.active.seg.path)?;
                w.active.dirty = false;
                w.durable_seq = w.next_seq - 1;
            }
            match self.prep.take_next(id) {
                Some(p) => {
                    let path = self.dir.join(segment::file_name(u64::from(id)));
                    std::fs::rename(&p.path, &path)
                        .map_err(|e| BackendError::io(&path, "rename", e))?;
                    self.io.sync_dir(&self.dir)?;
                    Ok((SegFile::new(id, path), p.file, p.len))
                }
                None => recovery::create_segment(&self.dir, &self.io, id)
                    .map(|(seg, file)| (seg, file, HEADER_LEN as u64)),
            }
        })();
        let (seg, file, zeroed) = match started {
            Ok(x) => x,
            Err(e) => {
                Self::poison(w, &e);
                return Err(e);
            }
        };
        let file = Arc::new(file);
        let path = seg.path.clone();
        // The new segment's file exists from here on: should its mapping fail, no later
        // commit may go on in the segment before it, which is sealed (a commit torn there
        // would lie in a sealed segment, and the next roll would find the file in its way).
        let map = match SegMap::map(
            &self.io,
            &seg,
            &file,
            &path,
            HEADER_LEN as u64,
            self.options.segment_size.max(zeroed),
        ) {
            Ok(map) => map,
            Err(e) => {
                Self::poison(w, &e);
                return Err(e);
            }
        };
        w.version.segs.push(Some(Mapped {
            map,
            end: HEADER_LEN as u64,
        }));
        w.stats.insert(
            id,
            SegStat {
                size: HEADER_LEN as u64,
                live: 0,
            },
        );
        self.prep.set_active(id, file.clone(), path, zeroed);
        w.active = Active {
            seg,
            file,
            end: HEADER_LEN as u64,
            fresh: true,
            dirty: false,
        };
        Ok(())
    }

    /// Starts a frame in `w.buf`: rolls to a new segment if a frame of about `estimate` bytes
    /// would not fit in the active one, reserves the frame header, and declares every bucket
    /// when the segment is fresh.
    pub(crate) fn begin_frame(&self, w: &mut Writer, estimate: u64) -> Result<(), BackendError> {
        Self::check_poison(w)?;
        if !w.active.fresh && w.active.end + estimate > self.options.segment_size {
            self.roll(w)?;
        }
        let mut buf = std::mem::take(&mut w.buf);
        buf.clear();
        buf.resize(FRAME_HEADER, 0);
        if w.active.fresh {
            for (id, name) in w.bucket_names.iter().enumerate() {
                format::put_bucket(&mut buf, id as u32, name.name());
            }
        }
        w.buf = buf;
        Ok(())
    }

    /// Writes the frame in `w.buf` and, with `sync`, syncs it; returns its offset in the active
    /// segment. On failure the frame is cut off again (best effort) and the backend is
    /// poisoned.
    pub(crate) fn finish_frame(&self, w: &mut Writer, sync: bool) -> Result<u64, BackendError> {
        if sync && let Some(puts) = w.puts.take() {
            puts.append_to(&mut w.buf);
        }
        let frame_len = w.buf.len() + w.puts.as_ref().map_or(0, Puts::len);
        let start = w.active.end;
        let len = frame_len - FRAME_HEADER;
        let end = start + frame_len as u64;
        if end > u64::from(u32::MAX) || len > u32::MAX as usize {
            w.puts = None;
            return Err(BackendError::TooLarge {
                what: "batch",
                len: frame_len,
                limit: (u32::MAX as u64).saturating_sub(start) as usize,
            });
        }
        let seq = w.next_seq;
        if seq == u64::MAX {
            // Never written: no sequence could follow it, so open takes it for damage. Only
            // a store whose frames carry a number no run of commits reaches gets here.
            w.puts = None;
            return Err(BackendError::Corrupt {
                path: w.active.seg.path.clone(),
                offset: start,
                reason: format!(
                    "commit sequence numbers exhausted (the last was {})",
                    seq - 1
                ),
            });
        }
        w.buf[..4].copy_from_slice(&(len as u32).to_le_bytes());
        w.buf[8..16].copy_from_slice(&seq.to_le_bytes());
        w.buf[16..24].copy_from_slice(&w.durable_seq.to_le_bytes());
        let fast = self.prep.before_write(start, end);
        let result = if sync {
            seal_frame(&mut w.buf);
            let path = &w.active.seg.path;
            // A restore's direct writes may still hold the block this frame starts in: they
            // all go out first (nothing is pending once a restore has ended).
            let direct_done = match &mut w.direct {
                Some(d) => d
                    .finish()
                    .map_err(|e| BackendError::io(path, "direct pwrite", e)),
                None => Ok(()),
            };
            direct_done
                .and_then(|()| self.io.write_at(&w.active.file, path, start, &w.buf))
                .and_then(|()| self.io.sync_data(&w.active.file, path))
        } else {
            let written = self.write_unsynced(w, start, fast);
            w.puts = None;
            written
        };
        let path = &w.active.seg.path;
        if !fast {
            self.prep.appended(result.as_ref().ok().map(|()| end));
        }
        if let Err(e) = result {
            // The frame may be partly or wholly in the file: cut it off, durably, so that a
            // restart does not find it. No mapping is read past `start`. Should that fail
            // too, a restart may find the batch whole (its checksum holds), with the
            // consistent index it carries.
            self.prep.failed();
            let cut = self
                .io
                .truncate(&w.active.file, path, start)
                .and_then(|()| self.io.sync_data(&w.active.file, path));
            if let Err(t) = cut {
                tracing::error!(error = %t, "cannot cut off a failed commit: a restart may find it");
            }
            Self::poison(w, &e);
            return Err(e);
        }
        w.active.dirty |= !sync;
        if sync {
            // The sync covers every frame written before this one too.
            w.durable_seq = seq;
        }
        w.next_seq += 1;
        w.active.end = end;
        w.active.fresh = false;
        let id = w.active.seg.id;
        if let Some(s) = w.stats.get_mut(&id) {
            s.size = end;
        }
        Ok(start)
    }

    /// Writes the frame in `w.buf` at `start` without syncing it (a restore): straight to the
    /// disk where the file system allows (`direct`), so the kernel copies nothing into its
    /// cache and at most two frames are queued ahead of other writers' syncs; otherwise through
    /// the page cache, starting its writeback so that the one sync at the end has little left
    /// to wait for.
    fn write_unsynced(
        &self,
        w: &mut Writer,
        start: u64,
        prepared: bool,
    ) -> Result<(), BackendError> {
        let id = w.active.seg.id;
        // Zeros written ahead through the page cache could meet a direct write's last block.
        let zeros_ahead = self.options.prepare_ahead && self.prep.writes_zeros();
        let frame_len = w.buf.len() + w.puts.as_ref().map_or(0, Puts::len);
        // Records to encode go to the direct writer as they are, unless a fault hook must see
        // the frame's bytes.
        if (w.direct_refused || zeros_ahead || self.options.fault_hook.is_some())
            && let Some(puts) = w.puts.take()
        {
            puts.append_to(&mut w.buf);
        }
        if !w.direct_refused && !zeros_ahead {
            let path = w.active.seg.path.clone();
            let targeted = match &mut w.direct {
                Some(d) if d.segment == id => Ok(true),
                Some(d) => d.retarget(&path, id),
                None => DirectWriter::open(&path, id).map(|d| {
                    w.direct = d;
                    w.direct.is_some()
                }),
            };
            match targeted {
                Ok(true) => {}
                Ok(false) => {
                    w.direct = None;
                    w.direct_refused = true;
                }
                Err(e) => return Err(BackendError::io(&path, "open for direct writes", e)),
            }
            if let Some(d) = &mut w.direct {
                if !prepared {
                    // The write lands in the background, but the frame is mapped as soon as
                    // it is published: the file must already reach that far.
                    self.io
                        .allocate(&w.active.file, &path, start, frame_len as u64)?;
                }
                let frame = std::mem::take(&mut w.buf);
                let outcome = match w.puts.take() {
                    // No fault hook (see above): straight to the direct writer.
                    Some(puts) => {
                        match d.write_frame(
                            &w.active.file,
                            start,
                            Frame::Puts(frame, puts),
                            seal_frame,
                        ) {
                            Ok(next) => DirectOutcome::Written(next),
                            Err(e) => match d.take_refused() {
                                Some(f) if e.raw_os_error() == Some(libc::EINVAL) => {
                                    DirectOutcome::Refused(f)
                                }
                                _ => return Err(BackendError::io(&path, "direct pwrite", e)),
                            },
                        }
                    }
                    None => {
                        self.io
                            .write_direct(d, &w.active.file, &path, start, frame, seal_frame)?
                    }
                };
                match outcome {
                    DirectOutcome::Written(next) => {
                        w.buf = next;
                        return Ok(());
                    }
                    DirectOutcome::Refused(frame) => {
                        tracing::info!(path = %path.display(), "direct writes refused; restoring through the page cache");
                        w.buf = frame;
                        w.direct = None;
                        w.direct_refused = true;
                    }
                }
            }
        }
        if let Some(puts) = w.puts.take() {
            puts.append_to(&mut w.buf);
        }
        seal_frame(&mut w.buf);
        let path = &w.active.seg.path;
        // Earlier frames of this restore may have gone to the direct writer, which holds back
        // the block where the last one ends (this frame's first block): it goes out first, or
        // it would later overwrite this frame's first bytes with its zero padding.
        if let Some(d) = &mut w.direct {
            d.finish()
                .map_err(|e| BackendError::io(path, "direct pwrite", e))?;
        }
        self.io.write_at(&w.active.file, path, start, &w.buf)?;
        self.io
            .start_writeback(&w.active.file, path, start, w.buf.len() as u64);
        Ok(())
    }

    /// Records the active segment's new committed end (mapping it anew only when it has
    /// outgrown its mapping) and publishes the writer's version.
    pub(crate) fn publish(&self, w: &mut Writer) -> Result<(), BackendError> {
        self.record_end(w)?;
        self.share(w);
        Ok(())
    }

    /// Makes the writer's version the published one.
    pub(crate) fn share(&self, w: &Writer) {
        *self.published.write() = Arc::new(w.version.clone());
    }

    /// The first half of [`publish`](Self::publish): records the active segment's committed
    /// end in the writer's version, without publishing it.
    ///
    /// Called once the commit's frame is written (and, unless a restore is loading, synced):
    /// should the segment's new mapping fail, the batch is in the file but in no index
    /// version readers or later commits see, so the backend is poisoned with an
    /// [`UnpublishedCommit`] saying so.
    pub(crate) fn record_end(&self, w: &mut Writer) -> Result<(), BackendError> {
        let seg = w.active.seg.clone();
        let end = w.active.end;
        let i = (seg.id - w.version.base) as usize;
        let current = w.version.segs.get(i).and_then(|m| m.as_ref());
        let map = match current {
            Some(m) if m.map.capacity() >= end => m.map.clone(),
            _ => {
                // The segment's size, or the whole file if it has grown past it: the next
                // commits land inside this mapping.
                let map_len = self.options.segment_size;
                match SegMap::map(&self.io, &seg, &w.active.file, &seg.path, end, map_len) {
                    Ok(m) => m,
                    Err(source) => {
                        let e = BackendError::Other(Box::new(UnpublishedCommit {
                            seq: w.next_seq - 1,
                            path: seg.path.clone(),
                            synced: !w.active.dirty,
                            source,
                        }));
                        Self::poison(w, &e);
                        return Err(e);
                    }
                }
            }
        };
        w.version.segs[i] = Some(Mapped { map, end });
        Ok(())
    }

    /// Commits `batch` as one frame; with `sync` false the frame is written but not synced
    /// (a restore syncs once at its end). The operations are encoded straight from the
    /// caller's buffers. Returns whether the reclaimer should run.
    pub(crate) fn commit(&self, batch: &dyn BatchSource, sync: bool) -> Result<bool, BackendError> {
        let mut w = self.writer.lock();
        Self::check_poison(&w)?;
        if self
            .restoring
            .lock()
            .is_some_and(|t| t != std::thread::current().id())
        {
            return Err(BackendError::Other(
                "a snapshot restore is loading this backend: commits of other threads are \
                 refused until it ends"
                    .into(),
            ));
        }
        // Validate everything before writing anything.
        let mut new_buckets: Vec<Bucket> = Vec::new();
        let mut estimate = FRAME_HEADER as u64;
        batch.for_each_op(&mut |op| {
            let (bucket, sizes) = match op {
                BatchOpRef::Put { bucket, key, value } => (bucket, [key.len(), value.len()]),
                BatchOpRef::Delete { bucket, key } => (bucket, [key.len(), 0]),
                BatchOpRef::DeleteRange { bucket, start, end } => {
                    (bucket, [start.len(), end.map_or(0, <[u8]>::len)])
                }
            };
            if sizes[0] > MAX_KEY {
                return Err(BackendError::TooLarge {
                    what: "key",
                    len: sizes[0],
                    limit: MAX_KEY,
                });
            }
            if sizes[1] > MAX_VALUE {
                return Err(BackendError::TooLarge {
                    what: "value",
                    len: sizes[1],
                    limit: MAX_VALUE,
                });
            }
            if !w.version.names.contains_key(bucket) && !new_buckets.contains(bucket) {
                bucket.validate()?;
                if matches!(op, BatchOpRef::Put { .. }) {
                    new_buckets.push(bucket.clone());
                }
            }
            estimate += match op {
                BatchOpRef::Put { key, value, .. } => format::put_len(key.len(), value.len()),
                BatchOpRef::Delete { key, .. } => 9 + key.len() as u64,
                BatchOpRef::DeleteRange { start, end, .. } => {
                    13 + (start.len() + end.map_or(0, <[u8]>::len)) as u64
                }
            };
            Ok(())
        })?;
        let ops = batch.op_count();
        if ops == 0 {
            return Ok(false);
        }
        for b in w.bucket_names.iter().chain(&new_buckets) {
            estimate += 6 + b.name().len() as u64;
        }
        self.begin_frame(&mut w, estimate)?;
        let first_new = w.bucket_names.len() as u32;
        let mut buf = std::mem::take(&mut w.buf);
        buf.reserve(estimate as usize);
        for (i, b) in new_buckets.iter().enumerate() {
            format::put_bucket(&mut buf, first_new + i as u32, b.name());
        }
        let id_of = |w: &Writer, b: &Bucket| w.bucket_id(b, first_new, &new_buckets);
        // Value offsets of the puts, relative to the frame start, in batch order.
        let mut value_at = Vec::with_capacity(ops);
        batch.for_each_op(&mut |op| {
            match op {
                BatchOpRef::Put { bucket, key, value } => {
                    if let Some(id) = id_of(&w, bucket) {
                        value_at.push(format::put_put(&mut buf, id, key, value) as u64);
                    }
                }
                BatchOpRef::Delete { bucket, key } => {
                    if let Some(id) = id_of(&w, bucket) {
                        format::put_delete(&mut buf, id, key);
                    }
                }
                BatchOpRef::DeleteRange { bucket, start, end } => {
                    if let Some(id) = id_of(&w, bucket) {
                        format::put_range(&mut buf, id, start, end);
                    }
                }
            }
            Ok(())
        })?;
        w.buf = buf;
        let start = self.finish_frame(&mut w, sync)?;

        // Durable: apply to the index.
        w.add_buckets(first_new, new_buckets);
        let seg = w.active.seg.id;
        let mut puts = value_at.into_iter();
        batch.for_each_op(&mut |op| {
            match op {
                BatchOpRef::Put { bucket, key, value } => {
                    let (Some(id), Some(at)) = (w.version.names.get(bucket).copied(), puts.next())
                    else {
                        return Ok(());
                    };
                    let loc = Loc {
                        seg,
                        off: (start + at) as u32,
                        len: value.len() as u32,
                    };
                    w.applier().put(id, key, loc);
                }
                BatchOpRef::Delete { bucket, key } => {
                    if let Some(id) = w.version.names.get(bucket).copied() {
                        w.applier().delete(id, key);
                    }
                }
                BatchOpRef::DeleteRange { bucket, start, end } => {
                    if let Some(id) = w.version.names.get(bucket).copied() {
                        w.applier().delete_range(id, start, end);
                    }
                }
            }
            Ok(())
        })?;
        if sync {
            self.publish(&mut w)?;
        } else {
            // A restore's batches are published together when it succeeds: a version shared
            // with readers would make the next batch copy the index nodes it changes.
            self.record_end(&mut w)?;
        }
        let (dead, live) = w.garbage();
        Ok(self.should_reclaim(dead, live))
    }

    pub(crate) fn should_reclaim(&self, dead: u64, live: u64) -> bool {
        dead >= self.options.reclaim_min_garbage
            && dead as f64 >= live as f64 * self.options.reclaim_garbage_ratio
    }

    fn size(&self) -> BackendSize {
        let w = self.writer.lock();
        let mut size = BackendSize {
            on_disk: HEADER_LEN as u64 + self.prep.prepared_bytes(w.active.end),
            in_use: 0,
        };
        for s in w.stats.values() {
            size.on_disk += s.size;
            size.in_use += s.live;
        }
        size
    }
}

impl Backend for FileBackend {
    type Options = FileOptions;
    type ReadTxn = FileReadTxn;

    fn open(path: &Path, options: &FileOptions) -> Result<FileBackend, BackendError> {
        FileBackend::open(path, options)
    }

    fn read_txn(&self) -> Result<FileReadTxn, BackendError> {
        Ok(FileReadTxn::new(self.inner.published.read().clone()))
    }

    fn commit(&self, batch: &WriteBatch) -> Result<(), BackendError> {
        self.commit_from(batch)
    }

    /// Encodes the operations straight from the caller's buffers into the frame.
    fn commit_from(&self, batch: &dyn BatchSource) -> Result<(), BackendError> {
        let sync = !self.inner.restoring_here();
        if self.inner.commit(batch, sync)? {
            self.nudge_reclaimer();
        }
        Ok(())
    }

    fn size(&self) -> Result<BackendSize, BackendError> {
        Ok(self.inner.size())
    }

    fn defragment(&self) -> Result<(), BackendError> {
        self.inner.defragment()
    }

    /// Loads a snapshot stream, syncing once at the end instead of once per batch; see
    /// the `restore` module. On error the store is incomplete and refuses to open again.
    fn restore(&self, input: &mut dyn std::io::Read) -> Result<u64, BackendError> {
        self.restore_stream(input, &mut |_, _, _| {})
    }

    /// As [`restore`](Backend::restore), showing each batch's pairs as it is loaded.
    fn restore_observed(
        &self,
        input: &mut dyn std::io::Read,
        observe: &mut keel_mvcc::backend::PairObserver<'_>,
    ) -> Result<u64, BackendError> {
        self.restore_stream(input, observe)
    }

    /// As [`restore_observed`](Backend::restore_observed), parsing the stream inside its
    /// chunks (no copy of them) and handing each back once its pairs are loaded.
    fn restore_chunks(
        &self,
        chunks: &mut dyn keel_mvcc::backend::ChunkSource,
        observe: &mut keel_mvcc::backend::PairObserver<'_>,
    ) -> Result<u64, BackendError> {
        self.restore_chunked(chunks, observe)
    }
}

#[cfg(test)]
mod tests {
    use keel_mvcc::ReadTxn;

    use super::*;

    /// The active segment is mapped once at the segment size: commits that fill it, past the
    /// space prepared at its start, are read through the same mapping.
    #[test]
    fn commits_filling_a_segment_are_read_through_one_mapping() {
        let dir = tempfile::tempdir().expect("tempdir");
        let options = FileOptions::default();
        let backend = FileBackend::open(dir.path(), &options).expect("open");
        let bucket = Bucket::new("b");
        let active_map = |b: &FileBackend| {
            let v = b.inner.published.read().clone();
            let m = v
                .segs
                .iter()
                .rev()
                .flatten()
                .next()
                .expect("a mapped segment");
            (m.map.clone(), m.end)
        };
        let value = vec![7u8; 32 << 10];
        let mut first: Option<Arc<SegMap>> = None;
        for i in 0..256u32 {
            let mut batch = WriteBatch::new();
            batch.put(&bucket, i.to_be_bytes().to_vec(), value.clone());
            backend.commit(&batch).expect("commit");
            let (map, end) = active_map(&backend);
            assert!(
                map.capacity() >= options.segment_size,
                "mapped at the segment size"
            );
            match &first {
                None => first = Some(map),
                Some(f) => assert!(Arc::ptr_eq(f, &map), "remapped at commit {i} (end {end})"),
            }
        }
        let (_, end) = active_map(&backend);
        assert!(
            end > 8 << 20,
            "the commits reached {end} bytes of the segment"
        );
        let txn = backend.read_txn().expect("txn");
        for i in 0..256u32 {
            assert_eq!(
                txn.get(&bucket, &i.to_be_bytes()).expect("get"),
                Some(value.as_slice())
            );
        }
    }
}
