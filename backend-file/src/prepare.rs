//! Space prepared ahead of the writer, so that a commit's `fdatasync` flushes only its frame.
//!
//! Writing past the end of a file makes `fdatasync` also commit the file system's journal with
//! the new size and newly allocated blocks; on ext4 that costs more than the frame itself. So
//! a background thread, the preparer, keeps space prepared and synced ahead of the committed
//! end of the active segment — blocks allocated with `fallocate`, or zeros written
//! ([`PrepareWith`](crate::PrepareWith)) — and prepares the next segment (`<id>.seg.tmp`: its
//! header and first prepared space, synced) before the active one fills; a roll then only
//! renames it into place and syncs the directory. A frame that fits in the prepared space
//! overwrites it (the fast path: one write and one `fdatasync` that changes no file size and
//! allocates nothing); one that does not (the preparer fell behind, or preparation is off)
//! appends as before. Either way the prepared space reads as zeros, which is what the format
//! expects after a segment's last frame.
//!
//! How far ahead: eight times the last frame, at least [`MIN_AHEAD`], at most [`MAX_AHEAD`], and
//! never past the segment size. Once the writer's want passes the prepared end, the preparer
//! prepares twice that far, so it works once per `ahead` bytes written, not once per commit.
//! Zeros are written in steps of at most [`STEP`], each synced, so the writer's sync never
//! waits behind a large one; an allocation is one call and a sync. With
//! [`PrepareWith::Auto`](crate::PrepareWith::Auto) each step is zeros or an allocation after
//! the size of the writer's last frame ([`SMALL_FRAME`]). While a restore runs, space is
//! allocated whatever the configured way (see [`Preparer::set_restoring`]).
//!
//! The preparer and the writer never write the same bytes. The preparer writes only at or
//! past `zeroed`, and only it advances `zeroed` while it works; the writer's fast path writes
//! below `zeroed`, and its slow path keeps the preparer from starting a step until the frame
//! is written. When the step in progress writes zeros, the slow path first waits for it to
//! end; an allocation never changes bytes already written, so behind one it does not wait.
//! If the file system turns allocation down, the step fails (preparation of that segment
//! stops) and later segments are prepared with zeros.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

use keel_mvcc::BackendError;
use parking_lot::{Condvar, Mutex};

use crate::fault::Io;
use crate::format::{self, HEADER_LEN, SEGMENT_MAGIC};
use crate::options::PrepareWith;
use crate::segment;

/// Least zeroed space kept ahead of the committed end.
pub(crate) const MIN_AHEAD: u64 = 1 << 20;
/// Most zeroed space kept ahead of the committed end.
pub(crate) const MAX_AHEAD: u64 = 32 << 20;
/// Largest single write of zeros.
pub(crate) const STEP: u64 = 1 << 20;
/// With [`PrepareWith::Auto`], frames below this size go into zeros, larger ones into
/// allocated space.
pub(crate) const SMALL_FRAME: u64 = 64 << 10;

static ZEROS: [u8; STEP as usize] = [0u8; STEP as usize];

/// Name of the file a segment is prepared in.
pub(crate) fn tmp_name(id: u32) -> String {
    format!("{}.tmp", segment::file_name(u64::from(id)))
}

/// True for the name of a file a segment was being prepared in.
pub(crate) fn is_tmp_name(name: &str) -> bool {
    name.strip_suffix(".tmp")
        .and_then(segment::parse_name)
        .is_some()
}

/// A segment prepared ahead: header and `len` bytes in all durable, not yet part of the store.
pub(crate) struct Prepared {
    pub(crate) id: u32,
    pub(crate) path: PathBuf,
    pub(crate) file: File,
    pub(crate) len: u64,
}

/// The segment the preparer zeroes ahead of the writer.
#[derive(Clone)]
struct Target {
    id: u32,
    file: Arc<File>,
    path: PathBuf,
}

#[derive(Default)]
struct State {
    active: Option<Target>,
    /// Bytes `[0, zeroed)` of the active segment exist in the file and are durable.
    zeroed: u64,
    /// The writer wants zeros up to here.
    want: u64,
    /// How far ahead the writer last asked for space.
    ahead: u64,
    /// The preparer is preparing space at `zeroed`, this way (zeros or allocation).
    busy: Option<PrepareWith>,
    /// Length of the writer's last frame.
    frame: u64,
    /// The writer is appending past `zeroed`.
    appending: bool,
    /// Preparation of the active segment stopped after an I/O error.
    failed: bool,
    /// The segment to prepare next, and whether that is under way or failed.
    next_want: Option<u32>,
    next_busy: bool,
    next_failed: Option<u32>,
    next: Option<Prepared>,
    stop: bool,
}

/// Work for the preparer thread.
enum Job {
    Zero {
        target: Target,
        from: u64,
        to: u64,
        how: PrepareWith,
    },
    Next {
        id: u32,
        len: u64,
        how: PrepareWith,
    },
}

/// The shared state of the writer and the preparer thread.
pub(crate) struct Preparer {
    state: Mutex<State>,
    cv: Condvar,
    dir: PathBuf,
    io: Io,
    segment_size: u64,
    how: PrepareWith,
    /// Set once an allocation failed as unsupported.
    no_allocate: AtomicBool,
    /// A restore runs: space is allocated, not zeroed, so that its direct writes never meet
    /// zeros written through the page cache.
    restoring: AtomicBool,
}

impl Preparer {
    pub(crate) fn new(dir: &Path, io: Io, segment_size: u64, how: PrepareWith) -> Arc<Preparer> {
        Arc::new(Preparer {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            dir: dir.to_path_buf(),
            io,
            segment_size,
            how,
            no_allocate: AtomicBool::new(false),
            restoring: AtomicBool::new(false),
        })
    }

    /// Starts the preparer thread; [`Preparer::stop`] ends it.
    pub(crate) fn spawn(self: &Arc<Self>) -> Result<JoinHandle<()>, BackendError> {
        let me = self.clone();
        std::thread::Builder::new()
            .name("keel-file-prepare".into())
            .spawn(move || me.run())
            .map_err(|e| BackendError::io(&self.dir, "spawn preparer thread", e))
    }

    /// Ends the thread and removes a prepared segment nobody took.
    pub(crate) fn stop(&self) {
        let next = {
            let mut s = self.state.lock();
            s.stop = true;
            self.cv.notify_all();
            while s.busy.is_some() || s.next_busy {
                self.cv.wait(&mut s);
            }
            s.next.take()
        };
        if let Some(p) = next {
            discard(p);
        }
    }

    /// Points the preparer at a new active segment whose first `zeroed` bytes are durable.
    pub(crate) fn set_active(&self, id: u32, file: Arc<File>, path: PathBuf, zeroed: u64) {
        let mut s = self.state.lock();
        s.active = Some(Target { id, file, path });
        s.zeroed = zeroed;
        s.want = zeroed;
        s.failed = false;
        s.appending = false;
    }

    /// Called by the writer before writing `[start, end)` of the active segment: asks for space
    /// ahead, and returns true when the frame goes into prepared zeros (the fast path). On the
    /// slow path the caller must call [`Preparer::appended`] once its write is over.
    pub(crate) fn before_write(&self, start: u64, end: u64) -> bool {
        let mut s = self.state.lock();
        let ahead = ((end - start) * 8).clamp(MIN_AHEAD, MAX_AHEAD);
        s.ahead = ahead;
        s.frame = end - start;
        let cap = self.segment_size.max(s.zeroed);
        let want = (end + ahead).min(cap);
        let mut work = false;
        if want > s.want {
            s.want = want;
            work = want > s.zeroed && s.busy.is_none();
        }
        if end + ahead >= self.segment_size
            && let Some(t) = &s.active
        {
            let next = t.id + 1;
            if s.next_want != Some(next) {
                s.next_want = Some(next);
                work = true;
            }
        }
        if work {
            self.cv.notify_all();
        }
        if end <= s.zeroed {
            return true;
        }
        // Zeros being written past `zeroed` must not land on the frame.
        while s.busy == Some(PrepareWith::Zeros) {
            self.cv.wait(&mut s);
        }
        // No step starts until the frame is written.
        s.appending = true;
        false
    }

    /// Ends the slow path of [`Preparer::before_write`]: `durable_end` is the active segment's
    /// durable end if the frame's write and sync succeeded.
    pub(crate) fn appended(&self, durable_end: Option<u64>) {
        let mut s = self.state.lock();
        s.appending = false;
        match durable_end {
            Some(end) => s.zeroed = s.zeroed.max(end),
            None => s.failed = true,
        }
        self.cv.notify_all();
    }

    /// A restore starts (`true`: space is allocated from now on, once a step of zeros under
    /// way has ended) or has ended well (`false`: back to the configured way). A restore that
    /// failed is not ended here: its direct writes may still be in flight, and the store is
    /// poisoned anyway.
    pub(crate) fn set_restoring(&self, on: bool) {
        let mut s = self.state.lock();
        self.restoring.store(on, Ordering::Relaxed);
        if on {
            while s.busy.is_some() {
                self.cv.wait(&mut s);
            }
        }
    }

    /// A failed fast-path write: stop preparing the active segment (the store is poisoned).
    pub(crate) fn failed(&self) {
        self.state.lock().failed = true;
    }

    /// Bytes prepared and not yet committed: past `end` in the active segment, and the
    /// prepared next segment.
    pub(crate) fn prepared_bytes(&self, end: u64) -> u64 {
        let s = self.state.lock();
        s.zeroed.saturating_sub(end) + s.next.as_ref().map_or(0, |p| p.len)
    }

    /// The prepared segment `id`, waiting for its preparation if it is under way.
    pub(crate) fn take_next(&self, id: u32) -> Option<Prepared> {
        let stale = {
            let mut s = self.state.lock();
            while s.next_busy {
                self.cv.wait(&mut s);
            }
            s.next_want = None;
            match s.next.take() {
                Some(p) if p.id == id => return Some(p),
                other => other,
            }
        };
        if let Some(p) = stale {
            discard(p);
        }
        None
    }

    /// Gives prepared space back after a defragment: waits for the preparer, cuts the active
    /// segment back to its committed `end` and removes a prepared next segment.
    pub(crate) fn trim(&self, end: u64) {
        let (target, next) = {
            let mut s = self.state.lock();
            while s.busy.is_some() || s.next_busy {
                self.cv.wait(&mut s);
            }
            s.next_want = None;
            if s.zeroed > end {
                s.zeroed = end;
            }
            s.want = s.zeroed;
            (s.active.clone(), s.next.take())
        };
        if let Some(t) = target {
            let len = t.file.metadata().map(|m| m.len()).unwrap_or(0);
            if len > end
                && let Err(e) = self.io.truncate(&t.file, &t.path, end)
            {
                tracing::warn!(error = %e, "cannot give back space prepared ahead");
            }
        }
        if let Some(p) = next {
            discard(p);
        }
    }

    fn pick(&self, s: &mut State) -> Option<Job> {
        if let Some(t) = &s.active
            && !s.failed
            && !s.appending
            && s.zeroed < s.want
        {
            // Twice as far as asked, so preparation and its sync come once per `ahead` bytes
            // written rather than once per commit; zeros go in steps of at most `STEP`.
            let far = (s.want + s.ahead).min(self.segment_size.max(s.want));
            let how = self.how(s.frame);
            let to = match how {
                PrepareWith::Allocate => far,
                _ => far.min(s.zeroed + STEP),
            };
            let job = Job::Zero {
                target: t.clone(),
                from: s.zeroed,
                to,
                how,
            };
            s.busy = Some(how);
            return Some(job);
        }
        if let Some(id) = s.next_want
            && s.next.is_none()
            && s.next_failed != Some(id)
        {
            s.next_busy = true;
            let len = (HEADER_LEN as u64 + s.ahead).min(self.segment_size);
            return Some(Job::Next {
                id,
                len,
                how: self.how(s.frame),
            });
        }
        None
    }

    fn run(&self) {
        loop {
            let job = {
                let mut s = self.state.lock();
                loop {
                    if s.stop {
                        return;
                    }
                    if let Some(job) = self.pick(&mut s) {
                        break job;
                    }
                    self.cv.wait(&mut s);
                }
            };
            match job {
                Job::Zero {
                    target,
                    from,
                    to,
                    how,
                } => {
                    let result = self.zero(&target.file, &target.path, from, to, how);
                    let mut s = self.state.lock();
                    s.busy = None;
                    if s.active.as_ref().is_some_and(|a| a.id == target.id) {
                        match result {
                            Ok(()) => s.zeroed = s.zeroed.max(to),
                            Err(e) => {
                                tracing::warn!(error = %e, "cannot prepare space ahead");
                                s.failed = true;
                            }
                        }
                    }
                    self.cv.notify_all();
                }
                Job::Next { id, len, how } => {
                    let result = self.prepare(id, len, how);
                    let mut s = self.state.lock();
                    s.next_busy = false;
                    match result {
                        Ok(p) if s.next_want == Some(id) && !s.stop => s.next = Some(p),
                        Ok(p) => discard(p),
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot prepare the next segment");
                            s.next_failed = Some(id);
                        }
                    }
                    self.cv.notify_all();
                }
            }
        }
    }

    /// True when space ahead may be prepared by writing zeros through the page cache, which
    /// must not meet a direct write in flight on the same block.
    pub(crate) fn writes_zeros(&self) -> bool {
        self.how(0) == PrepareWith::Zeros
    }

    /// How space is prepared now, after frames of `frame` bytes: zeros or allocation (never
    /// [`PrepareWith::Auto`]). A restore allocates; allocation falls back to zeros for good
    /// once the file system turns it down.
    fn how(&self, frame: u64) -> PrepareWith {
        if self.no_allocate.load(Ordering::Relaxed) {
            PrepareWith::Zeros
        } else if self.restoring.load(Ordering::Relaxed) {
            PrepareWith::Allocate
        } else {
            match self.how {
                PrepareWith::Auto if frame < SMALL_FRAME => PrepareWith::Zeros,
                PrepareWith::Auto => PrepareWith::Allocate,
                how => how,
            }
        }
    }

    /// Prepares `[from, to)` of a file (zeros written, or blocks allocated) and syncs it.
    fn zero(
        &self,
        file: &File,
        path: &Path,
        from: u64,
        to: u64,
        how: PrepareWith,
    ) -> Result<(), BackendError> {
        if how == PrepareWith::Allocate && to > from {
            match self.io.allocate(file, path, from, to - from) {
                Ok(()) => return self.io.sync_data(file, path),
                Err(e) => {
                    if let BackendError::Io { source, .. } = &e
                        && source.kind() == std::io::ErrorKind::Unsupported
                    {
                        // Later steps write zeros. Not this one: a frame may be being
                        // appended over these bytes right now.
                        tracing::info!(
                            path = %path.display(),
                            "the file system cannot allocate ahead; zeros from the next segment on"
                        );
                        self.no_allocate.store(true, Ordering::Relaxed);
                    }
                    return Err(e);
                }
            }
        }
        let mut at = from;
        while at < to {
            let n = (to - at).min(STEP) as usize;
            self.io.write_at(file, path, at, &ZEROS[..n])?;
            at += n as u64;
        }
        self.io.sync_data(file, path)
    }

    /// Creates `<id>.seg.tmp` with its header and zeros up to `len`, synced.
    fn prepare(&self, id: u32, len: u64, how: PrepareWith) -> Result<Prepared, BackendError> {
        let path = self.dir.join(tmp_name(id));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(|e| BackendError::io(&path, "create", e))?;
        let result = self
            .io
            .write_at(
                &file,
                &path,
                0,
                &format::encode_header(SEGMENT_MAGIC, format::VERSION, u64::from(id)),
            )
            .and_then(|()| self.zero(&file, &path, HEADER_LEN as u64, len, how));
        match result {
            Ok(()) => Ok(Prepared {
                id,
                path,
                file,
                len: len.max(HEADER_LEN as u64),
            }),
            Err(e) => {
                discard(Prepared {
                    id,
                    path,
                    file,
                    len,
                });
                Err(e)
            }
        }
    }
}

/// Removes a prepared segment that will not be used.
fn discard(p: Prepared) {
    drop(p.file);
    if let Err(e) = std::fs::remove_file(&p.path) {
        tracing::warn!(path = %p.path.display(), error = %e, "cannot remove a prepared segment");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preparer(how: PrepareWith) -> Arc<Preparer> {
        Preparer::new(Path::new("."), Io::new(None), 64 << 20, how)
    }

    #[test]
    fn auto_zeroes_after_small_frames_and_allocates_after_large_ones() {
        let p = preparer(PrepareWith::Auto);
        assert_eq!(p.how(16 << 10), PrepareWith::Zeros);
        assert_eq!(p.how(SMALL_FRAME - 1), PrepareWith::Zeros);
        assert_eq!(p.how(SMALL_FRAME), PrepareWith::Allocate);
        assert_eq!(p.how(1 << 20), PrepareWith::Allocate);
        assert!(p.writes_zeros());
        // A restore allocates, so that its direct writes meet no zeros written meanwhile.
        p.set_restoring(true);
        assert_eq!(p.how(16 << 10), PrepareWith::Allocate);
        assert!(!p.writes_zeros());
        p.set_restoring(false);
        assert_eq!(p.how(16 << 10), PrepareWith::Zeros);
        // Where allocation is refused, zeros whatever the frames.
        p.no_allocate.store(true, Ordering::Relaxed);
        assert_eq!(p.how(1 << 20), PrepareWith::Zeros);
    }

    #[test]
    fn fixed_ways_ignore_the_frame_size() {
        for how in [PrepareWith::Zeros, PrepareWith::Allocate] {
            let p = preparer(how);
            assert_eq!(p.how(1), how);
            assert_eq!(p.how(8 << 20), how);
        }
    }
}
