//! The log itself: open and recovery, appends with group commit, reads, snapshot markers,
//! release.
//!
//! Concurrency: one mutex guards the in-memory state and the active segment's buffer. An append
//! encodes its records into the buffer under the mutex; without direct writes, a durable append
//! of large entries instead writes them out at once, straight from the entries' own buffers
//! (one vectored write behind whatever was buffered), since its sync follows anyway. A durable
//! request then waits for a sync that started after its bytes were written. The first one that
//! finds no sync running becomes the leader: if the previous sync served several requests, it
//! first waits (briefly, [`WalOptions::group_commit_wait`]) for as many to be pending again,
//! since the appenders that sync released are usually on their way back. The leader writes the
//! buffer out under the mutex (one direct write of whole pages where the file system allows,
//! [`WalOptions::direct_writes`], else one `pwrite`) and runs `fdatasync` with the mutex
//! released, while later requests fill the buffer and wait. A waiting request first spins for
//! the running sync, yielding its CPU ([`WalOptions::durable_spin`]), and parks only if it runs
//! long: then the end of a sync costs no wake-ups, and the released appenders are back for the
//! next group at once. When the sync finishes, the leader unlists exactly the parked requests
//! it made durable and, if any remain, one of them to lead the next sync, and wakes them once
//! the mutex is released (they check an atomic durable mark and return without taking it), so
//! none of them finds the mutex held by the waker. Reads copy the locations they need under the
//! mutex and read the files without it.
//!
//! Release and recycling: released segments are renamed to `<seq>.free` (up to
//! [`WalOptions::recycle_segments`] of them) and become the next prepared segment instead of
//! a new zero-filled file, so a log in steady state (appending while snapshots let it
//! release) overwrites blocks it already owns, as a preallocated file would. A recycled
//! file's old pages are read into the page cache ahead of appends that go through it, and
//! dropped from it when appends write directly (see `segment::Writes`). A `.free` file is
//! reused only once its new name is durable (the release's directory sync, made without the
//! mutex, has ended; at open, a directory sync first), so a crash can never bring back a
//! segment's old name over a file whose header was rewritten for another segment. A release
//! renames or deletes its segments lowest first, each change made durable before the next
//! (releases run one at a time, under their own lock), so the segment files a crash leaves
//! are always consecutive, whatever order the file system makes changes durable in.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions, TryLockError};
use std::io;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};
use tracing::{debug, warn};

use crate::decoder::{Next, SegmentReader};
use crate::encoder::{SegmentWriter, WriterStart};
use crate::error::WalError;
use crate::index::{Loc, LogIndex};
use crate::io::{FileSystem, WalFile, read_full_at};
use crate::options::WalOptions;
use crate::record::{
    self, ENTRY_PREFIX, Entry, HardState, MAX_PAYLOAD, Metadata, Record, SnapshotMarker, record_len,
};
use crate::recovery::{self, LastSegment, Listed, Recovered};
use crate::segment::{
    self, FORMAT_VERSION, Free, Prepared, SEGMENT_HEADER_LEN, SegInfo, Writes, parse_free_name,
    parse_segment_name,
};
use crate::stats::WalStats;

/// Name of the lock file in the WAL directory.
const LOCK_NAME: &str = "LOCK";
/// Where appends go through the page cache (no direct writes), a durable append whose
/// entries hold at least this many bytes of data (and at least [`DIRECT_MIN_ENTRY`] per
/// entry on average) is written at once from the entries' own buffers (one vectored write)
/// instead of being copied into the write buffer first. Those entries are written as entry
/// records, not batches: at 2 KiB or more per entry, a batch would save under 1% of the
/// bytes, and its checksum pass saves little against the copy avoided.
///
/// With direct writes the entries are copied: one direct write from the write buffer's huge
/// page beats the kernel's copy into the page cache and its writeback. Measured
/// (`examples/append_profile.rs`, 256 KiB per durable append, against a raw `pwrite` +
/// `fdatasync`): entries of 4 KiB at 1.03–1.05× copied against 0.66–0.67× written from their
/// buffers (partial pages of a segment primed for direct writes are read in first), 16 KiB
/// at 1.10× against 0.72×.
const DIRECT_MIN_BYTES: usize = 32 << 10;
/// See [`DIRECT_MIN_BYTES`]. Measured (`examples/append_profile.rs`, 256 KiB per durable
/// append, page cache): entries of 4 KiB and 16 KiB cost 9 and 14 µs less CPU per append
/// written from their buffers; entries of 1 KiB cost more (two crc calls per record instead
/// of one, and two iovecs per entry for the kernel to walk outweigh the copy saved), so they
/// are copied.
const DIRECT_MIN_ENTRY: usize = 2 << 10;
/// Most locations one streaming step copies out of the index.
const MAX_RUN: usize = 1 << 16;

/// An entry borrowed from the log while streaming with [`Wal::replay`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryRef<'a> {
    /// Raft index.
    pub index: u64,
    /// Raft term.
    pub term: u64,
    /// Opaque payload.
    pub data: &'a [u8],
}

impl EntryRef<'_> {
    /// An owned copy.
    pub fn to_entry(&self) -> Entry {
        Entry {
            index: self.index,
            term: self.term,
            data: self.data.to_vec(),
        }
    }
}

/// A durable request parked until a sync covers `target`.
struct Waiter {
    target: u64,
    thread: Thread,
}

/// The next segment, being prepared or ready.
enum Prealloc {
    None,
    Running {
        handle: JoinHandle<io::Result<Prepared>>,
        cancel: Arc<AtomicBool>,
    },
    Ready(Prepared),
}

struct Inner {
    /// Why the log refuses writes, once a write or sync failed.
    poisoned: Option<String>,
    index: LogIndex,
    hard_state: Option<HardState>,
    snapshot: Option<SnapshotMarker>,
    metadata: Option<Metadata>,
    writer: SegmentWriter,
    segments: BTreeMap<u64, SegInfo>,
    /// Bytes encoded since open (a log sequence number).
    written: u64,
    /// `written` as of the start of the last successful sync.
    durable: u64,
    /// A leader is syncing (or gathering its group) with the mutex released.
    syncing: bool,
    /// Durable requests that found their bytes not covered by any sync started so far.
    requests: u64,
    /// `requests` when the last sync started: those it covers.
    covered: u64,
    /// `written` when the last sync started.
    started: u64,
    /// `written` once the active segment's seed and state records were encoded: until it is
    /// durable, the segments before it hold the only durable copy of the log's state.
    opened: u64,
    /// Requests the last sync covered: how many a leader expects back.
    last_group: u64,
    /// A leader is waiting on `arrived` for its group to fill.
    gathering: bool,
    /// Durable requests parked until a sync covers them (or one of them must lead).
    waiters: Vec<Waiter>,
    /// Moving average of the `fdatasync` time.
    sync_time: Duration,
    stats: WalStats,
    prealloc: Prealloc,
    /// Released segment files waiting to be recycled.
    free: Vec<Free>,
    /// Released files renamed to `.free` whose new names may not be durable yet, each with
    /// its ticket: they join `free` once a directory sync begun after their rename ends.
    set_aside: Vec<(u64, Free)>,
    /// The next set-aside file's ticket.
    next_ticket: u64,
    /// A rename or deletion a release made may not be durable (a directory sync or the
    /// change itself failed): the next release syncs the directory before making another.
    release_unsynced: bool,
}

/// A segmented, checksummed, group-committed Raft log in one directory.
///
/// `Send + Sync`; every method takes `&self`, so share it with an `Arc`. See the crate
/// documentation for the file format.
pub struct Wal {
    dir: PathBuf,
    options: WalOptions,
    fs: Arc<dyn FileSystem>,
    inner: Mutex<Inner>,
    /// `Inner::durable`, readable without the mutex: a parked request woken by a sync
    /// checks it and returns without queueing for the mutex.
    durable: AtomicU64,
    /// Wakes a gathering leader once its group is complete.
    arrived: Condvar,
    /// Bumped (under the mutex) whenever parked requests are woken: a sync ended, a
    /// rotation made everything durable, or the log was poisoned. A spinning request stops
    /// when it moves.
    wake_rounds: AtomicU64,
    /// [`WalStats::spun`], counted outside the mutex.
    spun: AtomicU64,
    /// Held through a release (taken before `inner`), so releases run one at a time: each
    /// rename or deletion is durable before the next one is made, whichever call makes it.
    releasing: Mutex<()>,
    _lock: File,
}

impl std::fmt::Debug for Wal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wal")
            .field("dir", &self.dir)
            .field("first_index", &self.first_index())
            .field("last_index", &self.last_index())
            .finish_non_exhaustive()
    }
}

/// Segment files a read needs, by sequence number.
type OpenFiles = BTreeMap<u64, (PathBuf, Arc<dyn WalFile>)>;

/// Creates `dir` and its missing parents, and makes each new directory's entry in its parent
/// durable: a crash must not lose the directory, and the log with it, once appends to the
/// log were acknowledged.
fn create_dir_durable(fs: &dyn FileSystem, dir: &Path) -> Result<(), WalError> {
    let mut missing = Vec::new();
    for d in dir.ancestors().filter(|d| !d.as_os_str().is_empty()) {
        match fs.list(d) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(d),
            _ => break,
        }
    }
    fs.create_dir_all(dir)
        .map_err(|e| WalError::io("create directory", dir, e))?;
    for d in missing.iter().rev() {
        let parent = match d.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        fs.sync_dir(parent)
            .map_err(|e| WalError::io("sync directory", parent, e))?;
    }
    Ok(())
}

fn lock_dir(dir: &Path) -> Result<File, WalError> {
    let path = dir.join(LOCK_NAME);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| WalError::io("open lock file", &path, e))?;
    // A lock is briefly held on behalf of a closed log too: a child process forked by
    // another thread shares the descriptor until it execs. So retry for a moment before
    // calling the directory taken.
    let deadline = Instant::now() + Duration::from_millis(500);
    loop {
        match f.try_lock() {
            Ok(()) => return Ok(f),
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(TryLockError::WouldBlock) => {
                return Err(WalError::Locked {
                    path: dir.to_path_buf(),
                });
            }
            Err(TryLockError::Error(e)) => return Err(WalError::io("lock", &path, e)),
        }
    }
}

impl Wal {
    /// Opens the log in `dir`, creating the directory (and its missing parents, each made
    /// durable in its parent) and an empty log if needed.
    ///
    /// Every record of every segment is read and checked. A torn tail in the last segment
    /// is repaired (what the repair changes is kept in `<name>.broken`) unless
    /// [`WalOptions::strict`] is set; any other damage is an error naming the file and
    /// offset. Fails with [`WalError::Locked`] if another `Wal` has the directory open.
    pub fn open(dir: &Path, options: WalOptions) -> Result<Wal, WalError> {
        options.validate()?;
        let fs = options.fs.clone();
        create_dir_durable(&*fs, dir)?;
        let lock = lock_dir(dir)?;
        let names = fs
            .list(dir)
            .map_err(|e| WalError::io("list directory", dir, e))?;
        let mut segs: Vec<Listed> = Vec::new();
        let mut tmps = Vec::new();
        let mut frees = Vec::new();
        for name in names {
            if let Some((seq, first)) = parse_segment_name(&name) {
                segs.push(Listed { seq, first, name });
            } else if name.ends_with(".tmp") {
                tmps.push(name);
            } else if parse_free_name(&name).is_some() {
                frees.push(name);
            }
        }
        segs.sort_by(|a, b| (a.seq, a.first, &a.name).cmp(&(b.seq, b.first, &b.name)));
        for w in segs.windows(2) {
            if w[1].seq != w[0].seq + 1 {
                return Err(WalError::MissingSegment {
                    dir: dir.to_path_buf(),
                    reason: format!(
                        "segment {} is followed by {}: sequence numbers {:x}..{:x} are missing",
                        w[0].name,
                        w[1].name,
                        w[0].seq + 1,
                        w[1].seq - 1
                    ),
                });
            }
        }

        let Recovered {
            state: mut st,
            mut segments,
            last,
            fresh,
        } = recovery::recover(&*fs, dir, &segs, &options)?;

        let size = options.segment_size;
        let (writer, seeded) = match last {
            Some(LastSegment {
                seq,
                path,
                file,
                end,
                seeded,
                version,
            }) => {
                let flen = file.len().map_err(|e| WalError::io("stat", &path, e))?;
                let direct = direct_handle(&*fs, &options, &path);
                let start = WriterStart {
                    seq,
                    path,
                    file,
                    direct,
                    end,
                    crc: st.crc,
                    size: flen.max(size),
                    version,
                };
                (SegmentWriter::new(start), seeded)
            }
            None => {
                let (seq, first) = fresh;
                st.index = LogIndex::new(first);
                let never = AtomicBool::new(false);
                let p = segment::prepare(
                    &*fs,
                    dir,
                    seq,
                    size,
                    options.zero_fill,
                    Writes::Cached,
                    &never,
                )
                .map_err(|e| WalError::io("create segment", dir.join(segment::tmp_name(seq)), e))?;
                let path = segment::activate(&*fs, dir, &p, first)
                    .map_err(|e| WalError::io("rename segment", &p.path, e))?;
                segments.insert(
                    seq,
                    SegInfo {
                        path: path.clone(),
                        file: p.file.clone(),
                    },
                );
                let direct = direct_handle(&*fs, &options, &path);
                let start = WriterStart {
                    seq,
                    path,
                    file: p.file,
                    direct,
                    end: SEGMENT_HEADER_LEN,
                    crc: 0,
                    size,
                    version: FORMAT_VERSION,
                };
                (SegmentWriter::new(start), false)
            }
        };
        let next_seq = writer.seq + 1;
        let mut inner = Inner {
            poisoned: None,
            index: st.index,
            hard_state: st.hard_state,
            snapshot: st.snapshot,
            metadata: st.metadata,
            writer,
            segments,
            written: 0,
            durable: 0,
            syncing: false,
            requests: 0,
            covered: 0,
            started: 0,
            opened: 0,
            last_group: 0,
            gathering: false,
            waiters: Vec::new(),
            sync_time: Duration::ZERO,
            stats: WalStats::default(),
            prealloc: Prealloc::None,
            free: Vec::new(),
            set_aside: Vec::new(),
            next_ticket: 0,
            release_unsynced: false,
        };
        if seeded {
            // Where a segment started now would begin its entries, so that an append that
            // does not fit starts one unless this segment holds nothing more than a new one
            // would open with.
            inner.writer.data_start = SEGMENT_HEADER_LEN + opening_len(&inner);
        } else {
            // The last segment was renamed into place but nothing of it reached the disk:
            // start it now, with the state in force.
            let first = inner.index.last() + 1;
            let prev = inner.writer.crc;
            inner.writer.seed(prev, first);
            write_state(&mut inner);
            inner.writer.data_start = inner.writer.end();
            let w = &mut inner.writer;
            w.flush()
                .and_then(|()| w.file.sync_data())
                .map_err(|e| WalError::io("write", &w.path, e))?;
        }

        let mut ready = None;
        for name in tmps {
            let path = dir.join(&name);
            if ready.is_none()
                && options.preallocate
                && name == segment::tmp_name(next_seq)
                && let Some(p) = adopt(&*fs, &path, next_seq, size)
            {
                ready = Some(p);
                continue;
            }
            // A stale `<seq>.tmp` of the first segment was already replaced above.
            match fs.remove(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(WalError::io("remove stale file", &path, e)),
            }
        }
        let mut free = Vec::new();
        for name in frees {
            let path = dir.join(&name);
            let keep = free.len() < options.recycle_segments;
            let file = match fs.open(&path, true) {
                Ok(f) if keep && f.len().ok() == Some(size) => Some(f),
                _ => None,
            };
            match file {
                Some(file) => free.push(Free { path, file }),
                None => match fs.remove(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(WalError::io("remove stale file", &path, e)),
                },
            }
        }
        if !free.is_empty() {
            // A `.free` name may not be durable (the log stopped between a release's rename
            // and its directory sync): made so before any of these files is rewritten.
            fs.sync_dir(dir)
                .map_err(|e| WalError::io("sync directory", dir, e))?;
        }
        inner.free = free;
        let wal = Wal {
            dir: dir.to_path_buf(),
            fs,
            inner: Mutex::new(inner),
            durable: AtomicU64::new(0),
            arrived: Condvar::new(),
            wake_rounds: AtomicU64::new(0),
            spun: AtomicU64::new(0),
            releasing: Mutex::new(()),
            _lock: lock,
            options,
        };
        {
            let mut g = wal.inner.lock();
            if let Some(p) = ready {
                g.prealloc = Prealloc::Ready(p);
            }
            wal.maybe_prealloc(&mut g);
        }
        debug!(dir = %dir.display(), first = wal.first_index(), last = wal.last_index(), "WAL opened");
        Ok(wal)
    }

    /// The directory of the log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Starts preparing the next segment once the active one is a quarter full: early
    /// enough to be ready at rotation, late enough that a short-lived or idle log never pays
    /// for a second segment.
    fn maybe_prealloc(&self, g: &mut Inner) {
        if self.options.preallocate
            && matches!(g.prealloc, Prealloc::None)
            && g.writer.end() >= g.writer.size / 4
        {
            g.prealloc = self.spawn_prealloc(g);
        }
    }

    /// Prepares the segment after the active one on a background thread: a recycled file if
    /// one is free, else a new one.
    fn spawn_prealloc(&self, g: &mut Inner) -> Prealloc {
        if !self.options.preallocate {
            return Prealloc::None;
        }
        let seq = g.writer.seq + 1;
        let fs = self.fs.clone();
        let dir = self.dir.clone();
        let size = self.options.segment_size;
        let zero_fill = self.options.zero_fill;
        let cancel = Arc::new(AtomicBool::new(false));
        let c = cancel.clone();
        let free = g.free.pop();
        let writes = g.writer.writes();
        match std::thread::Builder::new()
            .name("keel-wal-prealloc".into())
            .spawn(move || match free {
                Some(free) => segment::recycle(&*fs, &dir, free, seq, writes),
                None => segment::prepare(&*fs, &dir, seq, size, zero_fill, writes, &c),
            }) {
            Ok(handle) => Prealloc::Running { handle, cancel },
            Err(e) => {
                warn!(error = %e, "WAL: cannot start the preallocation thread; segments will be made on rotation");
                Prealloc::None
            }
        }
    }

    /// Closes the full active segment and starts the next one. Nothing of the calling
    /// append is encoded yet, so a failure to make the new segment leaves the log as it was.
    fn rotate(&self, g: &mut Inner) -> Result<(), WalError> {
        // Older segments are whole and durable: only the last one can have a torn tail. (A
        // log whose every record is durable already, say after a durable append, has
        // nothing to write or sync.)
        if g.durable < g.written || g.writer.pending() > 0 {
            let w = &mut g.writer;
            if let Err(e) = w.flush().and_then(|()| w.file.sync_data()) {
                let err = WalError::io("write and sync", &w.path, e);
                g.poisoned = Some(err.to_string());
                return Err(err);
            }
        }
        g.durable = g.written;
        g.started = g.written;
        g.covered = g.requests;
        self.wake(g);
        let seq = g.writer.seq + 1;
        let tmp = self.dir.join(segment::tmp_name(seq));
        let background = match std::mem::replace(&mut g.prealloc, Prealloc::None) {
            Prealloc::Ready(p) => Some(Ok(p)),
            Prealloc::Running { handle, .. } => Some(
                handle
                    .join()
                    .unwrap_or_else(|_| Err(io::Error::other("preallocation thread panicked"))),
            ),
            Prealloc::None => None,
        };
        let prepared = match background {
            Some(Ok(p)) if p.seq == seq => p,
            other => {
                if let Some(Err(e)) = other {
                    debug!(error = %e, "WAL: background preparation failed; retrying in line");
                }
                let writes = g.writer.writes();
                let recycled = match g.free.pop() {
                    Some(free) => match segment::recycle(&*self.fs, &self.dir, free, seq, writes) {
                        Ok(p) => Some(p),
                        Err(e) => {
                            debug!(error = %e, "WAL: recycling a released segment failed");
                            None
                        }
                    },
                    None => None,
                };
                match recycled {
                    Some(p) => p,
                    None => {
                        let never = AtomicBool::new(false);
                        segment::prepare(
                            &*self.fs,
                            &self.dir,
                            seq,
                            self.options.segment_size,
                            self.options.zero_fill,
                            writes,
                            &never,
                        )
                        .map_err(|e| WalError::io("create segment", &tmp, e))?
                    }
                }
            }
        };
        let first = g.index.last() + 1;
        let path = match segment::activate(&*self.fs, &self.dir, &prepared, first) {
            Ok(p) => p,
            Err(e) => {
                let err = WalError::io("rename segment", &prepared.path, e);
                g.poisoned = Some(err.to_string());
                return Err(err);
            }
        };
        // That synced the directory: every file set aside so far has its new name for good.
        let upto = g.next_ticket;
        self.adopt_set_aside(g, upto);
        let prev = g.writer.crc;
        let direct = direct_handle(&*self.fs, &self.options, &path);
        g.writer.restart(WriterStart {
            seq,
            path: path.clone(),
            file: prepared.file.clone(),
            direct,
            end: SEGMENT_HEADER_LEN,
            crc: 0,
            size: self.options.segment_size,
            version: FORMAT_VERSION,
        });
        g.writer.seed(prev, first);
        write_state(g);
        g.writer.data_start = g.writer.end();
        g.written += g.writer.pending() as u64;
        g.opened = g.written;
        g.segments.insert(
            seq,
            SegInfo {
                path,
                file: prepared.file,
            },
        );
        g.stats.rotations += 1;
        g.stats.recycled += u64::from(prepared.recycled);
        debug!(seq, first, "WAL rotated to a new segment");
        Ok(())
    }

    /// Appends entries (consecutive indices) and optionally a hard state, as one durability
    /// point.
    ///
    /// If `entries[0].index <= last_index()`, the log suffix from that index is replaced
    /// (Raft conflict truncation). With `sync`, returns only once these bytes and everything
    /// appended before them are durable; concurrent callers share one `fdatasync`. Without,
    /// the records are buffered and written later (raft-rs: `!Ready::must_sync()`).
    ///
    /// On an error nothing of this call is acknowledged. A failed write or sync poisons the
    /// log ([`WalError::Poisoned`] for every later write); running out of space while
    /// starting a new segment ([`WalError::DiskFull`]) leaves the log as it was and usable.
    pub fn append(
        &self,
        entries: &[Entry],
        hard_state: Option<&HardState>,
        sync: bool,
    ) -> Result<(), WalError> {
        let mut g = self.inner.lock();
        check_poison(&g)?;
        if let Some(first) = entries.first() {
            self.check_append(&g, entries, first)?;
        }
        let hs = hard_state.filter(|hs| g.hard_state.as_ref() != Some(hs));
        if !entries.is_empty() || hs.is_some() {
            let bytes: u64 = entries
                .iter()
                .map(|e| record_len(ENTRY_PREFIX + e.data.len()) as u64)
                .sum::<u64>()
                + if hs.is_some() {
                    record_len(24) as u64
                } else {
                    0
                };
            if g.writer.end() + bytes > g.writer.size && g.writer.end() > g.writer.data_start {
                self.rotate(&mut g)?;
            }
            let before = g.writer.end();
            let seq = g.writer.seq;
            let data: usize = entries.iter().map(|e| e.data.len()).sum();
            if sync
                && g.writer.writes() == Writes::Cached
                && data >= DIRECT_MIN_BYTES
                && data >= DIRECT_MIN_ENTRY * entries.len()
            {
                // Written now anyway (the sync follows): straight from the entries' buffers.
                let mut locs = Vec::with_capacity(entries.len());
                if let Err(e) = g.writer.write_entries(entries, hs, &mut locs) {
                    let err = WalError::io("write", &g.writer.path, e);
                    g.poisoned = Some(err.to_string());
                    return Err(err);
                }
                g.stats.direct_writes += 1;
                for (e, (offset, prev_crc)) in entries.iter().zip(locs) {
                    // Checked above: consecutive and not past last + 1.
                    let loc = Loc::entry(e.term, seq, offset, e.data.len(), prev_crc);
                    let _ = g.index.push(e.index, loc);
                }
            } else {
                g.writer.reserve(bytes as usize);
                let Inner { writer, index, .. } = &mut *g;
                writer.entries(entries, |i, loc| {
                    // Checked above: consecutive and not past last + 1.
                    let _ = index.push(i, loc);
                });
                if let Some(hs) = hs {
                    g.writer.hard_state(hs);
                }
            }
            if let Some(hs) = hs {
                g.hard_state = Some(*hs);
            }
            g.written += g.writer.end() - before;
            g.stats.appends += 1;
            g.stats.bytes += g.writer.end() - before;
            self.maybe_prealloc(&mut g);
            if g.writer.pending() >= self.options.write_buffer {
                flush(&mut g)?;
            }
        }
        if sync {
            let target = g.written;
            self.wait_durable(g, target)?;
        }
        Ok(())
    }

    fn check_append(&self, g: &Inner, entries: &[Entry], first: &Entry) -> Result<(), WalError> {
        let lowest = g
            .snapshot
            .map_or(1, |s| s.index + 1)
            .max(g.index.first())
            .max(1);
        if first.index < lowest {
            return Err(WalError::InvalidAppend {
                reason: format!(
                    "entry {} is below the first index that can be written ({lowest}: \
                     earlier ones are in the snapshot or released)",
                    first.index
                ),
            });
        }
        if first.index > g.index.last() + 1 {
            return Err(WalError::InvalidAppend {
                reason: format!(
                    "entry {} leaves a gap after the last index {}",
                    first.index,
                    g.index.last()
                ),
            });
        }
        for (i, e) in entries.iter().enumerate() {
            if e.index != first.index + i as u64 {
                return Err(WalError::InvalidAppend {
                    reason: format!(
                        "entry {} follows entry {}: indices must be consecutive",
                        e.index,
                        first.index + i as u64 - 1
                    ),
                });
            }
            if e.data.len() > MAX_PAYLOAD - ENTRY_PREFIX {
                return Err(WalError::InvalidAppend {
                    reason: format!(
                        "entry {} has {} bytes of data, the limit is {}",
                        e.index,
                        e.data.len(),
                        MAX_PAYLOAD - ENTRY_PREFIX
                    ),
                });
            }
        }
        Ok(())
    }

    /// Waits until `written` up to `target` is durable, leading a sync if none is running.
    ///
    /// The leader writes out the buffer and runs `fdatasync` with the mutex released; every
    /// request whose bytes were written before it started returns when it ends. Before
    /// starting, a leader whose previous group had several members waits (briefly, see
    /// [`WalOptions::group_commit_wait`]) until as many requests are pending again: the
    /// appenders that sync released are usually on their way back, and without the wait the
    /// first of them would sync alone while the rest queue for the sync after.
    fn wait_durable<'a>(
        &'a self,
        mut g: MutexGuard<'a, Inner>,
        target: u64,
    ) -> Result<(), WalError> {
        if g.durable >= target {
            return Ok(());
        }
        check_poison(&g)?;
        if target > g.started {
            g.requests += 1;
            g.stats.durable_requests += 1;
            if g.gathering && g.requests - g.covered >= g.last_group {
                self.arrived.notify_one();
            }
        }
        let me = std::thread::current();
        let mut parked = false;
        loop {
            if g.durable >= target {
                if parked {
                    // Woken by something else than the sync that covered it: still listed.
                    g.waiters.retain(|w| w.thread.id() != me.id());
                }
                return Ok(());
            }
            check_poison(&g)?;
            if g.syncing {
                if !g.waiters.iter().any(|w| w.thread.id() == me.id()) {
                    g.waiters.push(Waiter {
                        target,
                        thread: me.clone(),
                    });
                }
                parked = true;
                let spin = self.options.durable_spin.min(g.sync_time * 2);
                let round = self.wake_rounds.load(Ordering::Acquire);
                drop(g);
                if !self.spin_until_woken(target, round, spin) {
                    std::thread::park();
                }
                if self.durable.load(Ordering::Acquire) >= target {
                    // The sync that covered this request unlisted it when it woke it.
                    return Ok(());
                }
                g = self.inner.lock();
                continue;
            }
            if parked {
                g.waiters.retain(|w| w.thread.id() != me.id());
                parked = false;
            }
            g.syncing = true;
            self.gather(&mut g);
            if g.durable >= g.written || g.poisoned.is_some() {
                // A rotation made everything durable (or failed) meanwhile.
                g.syncing = false;
                self.wake(&mut g);
                continue;
            }
            let upto = g.written;
            g.started = upto;
            g.last_group = (g.requests - g.covered).max(1);
            g.covered = g.requests;
            if let Err(e) = flush_for_sync(&mut g) {
                g.syncing = false;
                self.wake(&mut g);
                return Err(e);
            }
            let file = g.writer.file.clone();
            let path = g.writer.path.clone();
            let t = Instant::now();
            let res = MutexGuard::unlocked(&mut g, || file.sync_data());
            let took = t.elapsed();
            g.sync_time = if g.sync_time.is_zero() {
                took
            } else {
                (g.sync_time * 7 + took) / 8
            };
            g.stats.syncs += 1;
            g.stats.sync_time += took;
            g.syncing = false;
            let res = match (res, g.poisoned.clone()) {
                (Ok(()), None) => {
                    g.durable = g.durable.max(upto);
                    Ok(())
                }
                // A rotation's write or sync of this file failed while this sync ran. A
                // file reports a writeback error to one `fdatasync` only, so the error that
                // one met may have been this sync's bytes': this success proves nothing.
                (Ok(()), Some(reason)) => Err(WalError::Poisoned { reason }),
                (Err(e), _) => {
                    let err = WalError::io("fdatasync", &path, e);
                    g.poisoned = Some(err.to_string());
                    Err(err)
                }
            };
            // `upto` covers this request: done either way. Wake the others once the mutex
            // is free, so none of them finds it held by this thread.
            let wakes = self.take_wakes(&mut g);
            drop(g);
            for t in wakes {
                t.unpark();
            }
            return res;
        }
    }

    /// Spins (yielding the CPU) for at most `limit` until `target` is durable or the
    /// parked requests are woken after `round`; false if the time ran out first.
    fn spin_until_woken(&self, target: u64, round: u64, limit: Duration) -> bool {
        if limit.is_zero() {
            return false;
        }
        let start = Instant::now();
        loop {
            if self.durable.load(Ordering::Acquire) >= target {
                self.spun.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            if self.wake_rounds.load(Ordering::Acquire) != round {
                return true;
            }
            if start.elapsed() >= limit {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// After `durable` moved (or the log was poisoned, or a leader stepped down): wakes every
    /// parked request it covers (all of them once poisoned), and, if requests remain and no
    /// sync is running, one of them to lead the next.
    fn wake(&self, g: &mut Inner) {
        for t in self.take_wakes(g) {
            t.unpark();
        }
    }

    /// [`Wal::wake`] without the unparking: unlists the requests to wake and returns their
    /// threads, for the caller to unpark once it has released the mutex.
    fn take_wakes(&self, g: &mut Inner) -> Vec<Thread> {
        self.durable.store(g.durable, Ordering::Release);
        self.wake_rounds.fetch_add(1, Ordering::Release);
        let durable = g.durable;
        let all = g.poisoned.is_some();
        let mut need_leader = !g.syncing;
        let mut out = Vec::new();
        g.waiters.retain(|w| {
            if all || w.target <= durable {
                out.push(w.thread.clone());
                false
            } else if need_leader {
                // It relists itself if it finds a leader after all.
                need_leader = false;
                out.push(w.thread.clone());
                false
            } else {
                true
            }
        });
        out
    }

    /// As a sync leader (`syncing` set), waits until as many requests are pending as the
    /// previous sync served, or its time is up.
    fn gather(&self, g: &mut MutexGuard<'_, Inner>) {
        let expected = g.last_group;
        if expected <= 1 || g.requests - g.covered >= expected {
            return;
        }
        let budget = self.options.group_commit_wait.min(g.sync_time / 2);
        if budget.is_zero() {
            return;
        }
        let t = Instant::now();
        let deadline = t + budget;
        g.gathering = true;
        while g.requests - g.covered < expected && g.durable < g.written && g.poisoned.is_none() {
            if self.arrived.wait_until(g, deadline).timed_out() {
                break;
            }
        }
        g.gathering = false;
        g.stats.gathers += 1;
        g.stats.gather_time += t.elapsed();
    }

    /// Makes everything appended so far durable (no sync if it already is).
    pub fn sync(&self) -> Result<(), WalError> {
        let g = self.inner.lock();
        let target = g.written;
        self.wait_durable(g, target)
    }

    /// Records that the state up to `marker.index` is held by a snapshot; durable on return.
    ///
    /// Entries at or below `marker.index` are no longer served (and their segments can be
    /// released); the next append may start at `marker.index + 1` even if that leaves a gap
    /// after the old last index. A marker below the recorded one, or at index `u64::MAX`, is
    /// refused.
    pub fn save_snapshot_marker(&self, marker: &SnapshotMarker) -> Result<(), WalError> {
        if marker.index == u64::MAX {
            return Err(WalError::InvalidAppend {
                reason: "a snapshot marker at index u64::MAX leaves no index for the next entry"
                    .into(),
            });
        }
        let mut g = self.inner.lock();
        check_poison(&g)?;
        if let Some(cur) = g.snapshot
            && marker.index < cur.index
        {
            return Err(WalError::StaleSnapshot {
                index: marker.index,
                current: cur.index,
            });
        }
        self.append_state(&mut g, |w| w.snapshot(marker))?;
        g.index.apply_snapshot(marker);
        g.snapshot = Some(*marker);
        let target = g.written;
        self.wait_durable(g, target)
    }

    /// Records the member's identity; durable on return.
    pub fn set_metadata(&self, meta: &Metadata) -> Result<(), WalError> {
        let mut g = self.inner.lock();
        check_poison(&g)?;
        self.append_state(&mut g, |w| w.metadata(meta))?;
        g.metadata = Some(*meta);
        let target = g.written;
        self.wait_durable(g, target)
    }

    fn append_state(
        &self,
        g: &mut Inner,
        encode: impl FnOnce(&mut SegmentWriter),
    ) -> Result<(), WalError> {
        if g.writer.end() + record_len(24) as u64 > g.writer.size
            && g.writer.end() > g.writer.data_start
        {
            self.rotate(g)?;
        }
        let before = g.writer.end();
        encode(&mut g.writer);
        g.written += g.writer.end() - before;
        g.stats.appends += 1;
        g.stats.bytes += g.writer.end() - before;
        self.maybe_prealloc(g);
        Ok(())
    }

    /// Entries `[lo, hi)`, stopping once their data exceeds `max_bytes` (but always at least
    /// one entry if `lo < hi`: raft-rs semantics). Every record read is checked against its
    /// checksum.
    pub fn entries(
        &self,
        lo: u64,
        hi: u64,
        max_bytes: Option<u64>,
    ) -> Result<Vec<Entry>, WalError> {
        let (locs, file) = {
            let mut g = self.inner.lock();
            let (first, last) = (g.index.first(), g.index.last());
            if lo < first {
                return Err(WalError::Compacted { index: lo, first });
            }
            if hi > last + 1 || lo > hi {
                return Err(WalError::Unavailable {
                    lo,
                    hi,
                    first,
                    last,
                });
            }
            let mut locs = Vec::new();
            let mut total = 0u64;
            for l in g.index.range(lo, hi) {
                total += l.data_len();
                if !locs.is_empty() && max_bytes.is_some_and(|m| total > m) {
                    break;
                }
                locs.push(*l);
            }
            let files = self.prepare_read(&mut g, &locs)?;
            (locs, files)
        };
        let mut out = Vec::with_capacity(locs.len());
        self.read_locs(lo, &locs, &file, |e| {
            out.push(e.to_entry());
            ControlFlow::Continue(())
        })
        .map_err(|e| self.released_meanwhile(lo, e))?;
        Ok(out)
    }

    /// Streams the entries from `from` to the last index to `f`, in order, one segment at a
    /// time, until `f` breaks. Only segments holding entries at or after `from` are read, and
    /// memory stays bounded by one segment's worth of locations and one read buffer.
    pub fn replay<F>(&self, from: u64, mut f: F) -> Result<(), WalError>
    where
        F: FnMut(EntryRef<'_>) -> ControlFlow<()>,
    {
        let mut next = from;
        loop {
            let (locs, files) = {
                let mut g = self.inner.lock();
                let first = g.index.first();
                if next < first {
                    return Err(WalError::Compacted { index: next, first });
                }
                if next > g.index.last() {
                    return Ok(());
                }
                let hi = (g.index.last() + 1).min(next + MAX_RUN as u64);
                let mut it = g.index.range(next, hi).peekable();
                let seq = it.peek().map(|l| l.seq);
                let locs: Vec<Loc> = it.take_while(|l| Some(l.seq) == seq).copied().collect();
                let files = self.prepare_read(&mut g, &locs)?;
                (locs, files)
            };
            let n = locs.len() as u64;
            let mut stop = false;
            self.read_locs(next, &locs, &files, |e| {
                let flow = f(e);
                stop = flow.is_break();
                flow
            })
            .map_err(|e| self.released_meanwhile(next, e))?;
            if stop {
                return Ok(());
            }
            next += n;
        }
    }

    /// A read from `lo` failed with `err`: if `lo` was released while the files were read
    /// (a released segment's file may be recycled under a reader), the failure is that.
    fn released_meanwhile(&self, lo: u64, err: WalError) -> WalError {
        let first = self.inner.lock().index.first();
        if lo < first {
            WalError::Compacted { index: lo, first }
        } else {
            err
        }
    }

    /// Under the mutex: writes out buffered records the read needs and returns the files of
    /// the segments it touches (in the order of `locs`' runs).
    fn prepare_read(&self, g: &mut Inner, locs: &[Loc]) -> Result<OpenFiles, WalError> {
        if locs
            .iter()
            .any(|l| l.seq == g.writer.seq && l.end() > g.writer.flushed)
        {
            check_poison(g)?;
            flush(g)?;
        }
        let mut files = OpenFiles::new();
        for l in locs {
            if let std::collections::btree_map::Entry::Vacant(v) = files.entry(l.seq) {
                let Some(s) = g.segments.get(&l.seq) else {
                    return Err(WalError::MissingSegment {
                        dir: self.dir.clone(),
                        reason: format!("segment {:x} holding entries was released", l.seq),
                    });
                };
                v.insert((s.path.clone(), s.file.clone()));
            }
        }
        Ok(files)
    }

    /// Reads the entries at `locs` (indices `lo..`), verifying each record and the chain
    /// between them.
    fn read_locs<F>(
        &self,
        lo: u64,
        locs: &[Loc],
        files: &OpenFiles,
        mut f: F,
    ) -> Result<(), WalError>
    where
        F: FnMut(EntryRef<'_>) -> ControlFlow<()>,
    {
        let mut i = 0;
        while i < locs.len() {
            // A run: consecutive entries of one segment (their offsets grow with the index).
            let start = i;
            let seq = locs[i].seq;
            while i + 1 < locs.len() && locs[i + 1].seq == seq {
                i += 1;
            }
            i += 1;
            let run = &locs[start..i];
            let Some((path, file)) = files.get(&seq) else {
                return Err(WalError::MissingSegment {
                    dir: self.dir.clone(),
                    reason: format!("segment {seq:x} is not open"),
                });
            };
            let from = run[0].offset;
            let to = run[run.len() - 1].end();
            let chunk = ((to - from) as usize).min(self.options.read_buffer);
            let mut reader = SegmentReader::new(&**file, from, to, chunk);
            let mut prev = run[0].prev_crc;
            let mut want = 0usize;
            while want < run.len() {
                let next = reader
                    .next(prev)
                    .map_err(|e| WalError::io("read", path, e))?;
                match next {
                    Next::Record {
                        offset,
                        crc,
                        record,
                        ..
                    } => {
                        prev = crc;
                        if offset < run[want].offset {
                            continue;
                        }
                        let index = lo + (start + want) as u64;
                        let expected = || {
                            WalError::corrupt(
                                path,
                                offset,
                                format!("expected entry {index} at offset {}", run[want].offset),
                            )
                        };
                        match record {
                            Record::Entry {
                                index: x,
                                term,
                                data,
                            } if offset == run[want].offset
                                && x == index
                                && term == run[want].term =>
                            {
                                want += 1;
                                if f(EntryRef { index, term, data }).is_break() {
                                    return Ok(());
                                }
                            }
                            Record::Batch(b)
                                if offset == run[want].offset
                                    && b.term == run[want].term
                                    && (b.first_index..=b.last_index()).contains(&index) =>
                            {
                                // The wanted entries this batch holds, from `index` on.
                                let skip = (index - b.first_index) as usize;
                                for (x, data_at, data) in b.entries().skip(skip) {
                                    let Some(loc) = run.get(want).filter(|l| l.offset == offset)
                                    else {
                                        break;
                                    };
                                    let index = lo + (start + want) as u64;
                                    if x != index
                                        || data_at != loc.data_at as usize
                                        || data.len() != loc.data_len as usize
                                    {
                                        return Err(WalError::corrupt(
                                            path,
                                            offset,
                                            format!("batch does not hold entry {index} as indexed"),
                                        ));
                                    }
                                    want += 1;
                                    let term = b.term;
                                    if f(EntryRef { index, term, data }).is_break() {
                                        return Ok(());
                                    }
                                }
                            }
                            _ => return Err(expected()),
                        }
                    }
                    Next::Invalid { offset, reason } => {
                        return Err(WalError::corrupt(path, offset, reason));
                    }
                    Next::End { offset } => {
                        return Err(WalError::corrupt(
                            path,
                            offset,
                            "record expected, found zeros",
                        ));
                    }
                    Next::Bad { offset, reason } => {
                        return Err(WalError::corrupt(path, offset, reason));
                    }
                }
            }
        }
        Ok(())
    }

    /// Term of entry `index` if it is held, or of the snapshot marker's index; `Some(0)` for
    /// index 0 of a log without a snapshot marker; `None` otherwise.
    pub fn term(&self, index: u64) -> Result<Option<u64>, WalError> {
        let g = self.inner.lock();
        if let Some(l) = g.index.get(index) {
            return Ok(Some(l.term));
        }
        match g.snapshot {
            Some(s) if s.index == index => Ok(Some(s.term)),
            None if index == 0 => Ok(Some(0)),
            _ => Ok(None),
        }
    }

    /// First entry held (`snapshot index + 1` when none after the marker is held).
    pub fn first_index(&self) -> u64 {
        self.inner.lock().index.first()
    }

    /// Last entry held (the snapshot marker's index if none after it is held).
    pub fn last_index(&self) -> u64 {
        self.inner.lock().index.last()
    }

    /// The last hard state appended.
    pub fn hard_state(&self) -> Option<HardState> {
        self.inner.lock().hard_state
    }

    /// The last snapshot marker saved.
    pub fn snapshot_marker(&self) -> Option<SnapshotMarker> {
        self.inner.lock().snapshot
    }

    /// The metadata last set.
    pub fn metadata(&self) -> Option<Metadata> {
        self.inner.lock().metadata
    }

    /// Counters of appends, syncs and rotations since open.
    pub fn stats(&self) -> WalStats {
        let mut s = self.inner.lock().stats;
        s.spun = self.spun.load(Ordering::Relaxed);
        s
    }

    /// Number of segment files in the log.
    pub fn segment_count(&self) -> usize {
        self.inner.lock().segments.len()
    }

    /// Deletes the segments wholly below the one holding entry `index` (never that one, nor
    /// the active segment); entries in them are no longer served and `first_index()` moves
    /// up. An `index` past the last entry releases every segment but the active one; one
    /// below the first entry held (say, covered by the snapshot marker) releases the segments
    /// below the first entry held. The caller makes sure the released entries are covered by
    /// a snapshot.
    ///
    /// When only the active segment would be left and the seed and state records it opens
    /// with are not durable yet (the rotation to it came from appends not yet synced), they
    /// are synced first, like a durable append: the state (hard state, snapshot marker,
    /// metadata) is never durable only in deleted segments. On a poisoned log that sync
    /// fails with [`WalError::Poisoned`] and nothing is deleted.
    ///
    /// The segments are renamed or deleted lowest first, and each change is made durable by
    /// a directory sync before the next is made. A file system may make changes not yet
    /// synced durable in any order, so with one sync for them all a crash could keep a later
    /// segment's deletion and lose an earlier one's, leaving a hole in the sequence that open
    /// refuses as a missing segment; this way, whatever a crash keeps, the segment files left
    /// are consecutive, and the log opens with every entry it had not released. That costs
    /// one directory sync per released segment. Releases run one at a time (a call waits for
    /// the one running; one that finds nothing to release returns at once), and every
    /// directory sync is made with the log's lock released, so appends go on meanwhile; once
    /// this returns `Ok`, the renames and deletions it made are durable.
    ///
    /// Released files kept for reuse join the free list only once their new names are
    /// durable: a rotation never rewrites the header of a file whose old name a crash could
    /// bring back. If a rename, deletion or sync fails, the error is returned and the release
    /// stops there: the segments not yet renamed or deleted stay on disk (their entries are
    /// no longer served) and the next call, which first syncs the directory, goes on with
    /// them; files already set aside wait for that sync (or a rotation's).
    pub fn release_to(&self, index: u64) -> Result<(), WalError> {
        {
            // Files a running release set aside are its to adopt; those of a release that
            // failed are this call's (`release_unsynced` is set then).
            let g = self.inner.lock();
            if g.segments.range(..keep_for(&g, index)).next().is_none() && !g.release_unsynced {
                return Ok(());
            }
        }
        let _one = self.releasing.lock();
        let mut g = self.inner.lock();
        let keep = loop {
            let keep = keep_for(&g, index);
            // The active segment's seed and state records are the state's only copy once
            // the segments before it are gone: made durable first. (Older segments were
            // made durable by the rotation that ended them.)
            if keep == g.writer.seq
                && g.durable < g.opened
                && g.segments.range(..keep).next().is_some()
            {
                let target = g.opened;
                self.wait_durable(g, target)?;
                g = self.inner.lock();
                continue;
            }
            break keep;
        };
        let doomed: Vec<u64> = g.segments.range(..keep).map(|(s, _)| *s).collect();
        // A change an earlier release could not make durable is made so by this call's first
        // sync, and the files it set aside are adopted then.
        if doomed.is_empty() && g.set_aside.is_empty() && !g.release_unsynced {
            return Ok(());
        }
        // The index forgets first, so a failed delete never leaves a hole that reads reach.
        if !doomed.is_empty() {
            g.index.release_below(keep);
        }
        if g.release_unsynced || !g.set_aside.is_empty() {
            g = self.sync_release(g)?;
        }
        // A segment leaves the list only once its file is renamed or deleted: after a
        // failure part way, the next release starts again from the lowest one left.
        for seq in doomed {
            let Some(s) = g.segments.get(&seq) else {
                continue;
            };
            let (path, file) = (s.path.clone(), s.file.clone());
            if g.free.len() + g.set_aside.len() < self.options.recycle_segments
                && file.len().ok() == Some(self.options.segment_size)
            {
                let to = self.dir.join(segment::free_name(seq));
                if let Err(e) = self.fs.rename(&path, &to) {
                    g.release_unsynced = true;
                    return Err(WalError::io("set aside released segment", &path, e));
                }
                let ticket = g.next_ticket;
                g.next_ticket += 1;
                g.set_aside.push((ticket, Free { path: to, file }));
            } else if let Err(e) = self.fs.remove(&path) {
                g.release_unsynced = true;
                return Err(WalError::io("delete segment", &path, e));
            }
            g.segments.remove(&seq);
            g = self.sync_release(g)?;
        }
        Ok(())
    }

    /// Syncs the directory for a release, with the log's lock (`g`) released, and takes the
    /// lock again; then moves the files set aside before the sync began to the free list.
    /// If the sync fails, the next release syncs again before changing anything.
    fn sync_release<'a>(
        &'a self,
        g: MutexGuard<'a, Inner>,
    ) -> Result<MutexGuard<'a, Inner>, WalError> {
        let upto = g.next_ticket;
        drop(g);
        let synced = self.fs.sync_dir(&self.dir);
        let mut g = self.inner.lock();
        if let Err(e) = synced {
            g.release_unsynced = true;
            return Err(WalError::io("sync directory", &self.dir, e));
        }
        g.release_unsynced = false;
        self.adopt_set_aside(&mut g, upto);
        Ok(g)
    }

    /// Moves the files set aside with a ticket below `upto` (renamed before a directory sync
    /// that has ended) to the free list. Any beyond what the free list keeps (a release
    /// counts the free list and the files set aside together, so none should be) are
    /// deleted, best effort (a deletion that fails or that a crash undoes leaves a `.free`
    /// file, which the next open deals with).
    fn adopt_set_aside(&self, g: &mut Inner, upto: u64) {
        if g.set_aside.is_empty() {
            return;
        }
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut g.set_aside)
            .into_iter()
            .partition(|(ticket, _)| *ticket < upto);
        g.set_aside = waiting;
        for (_, f) in ready {
            if g.free.len() < self.options.recycle_segments {
                g.free.push(f);
            } else if let Err(e) = self.fs.remove(&f.path) {
                warn!(error = %e, path = %f.path.display(), "WAL: cannot delete a spare released segment");
            }
        }
    }
}

impl Drop for Wal {
    fn drop(&mut self) {
        let g = self.inner.get_mut();
        if let Prealloc::Running { handle, cancel, .. } =
            std::mem::replace(&mut g.prealloc, Prealloc::None)
        {
            cancel.store(true, Ordering::Relaxed);
            let _ = handle.join();
        }
        if g.poisoned.is_none()
            && let Err(e) = g.writer.flush()
        {
            warn!(error = %e, "WAL: writing buffered records at close failed");
        }
    }
}

/// The lowest segment a release up to entry `index` keeps: the one holding that entry, or
/// the active one if none does. Below the first entry held (released, or covered by the
/// snapshot marker), the segment holding the first entry held is the lowest one still
/// needed.
fn keep_for(g: &Inner, index: u64) -> u64 {
    let probe = index.max(g.index.first());
    match g.index.get(probe) {
        Some(l) => l.seq,
        None => g.writer.seq,
    }
}

fn check_poison(g: &Inner) -> Result<(), WalError> {
    match &g.poisoned {
        Some(reason) => Err(WalError::Poisoned {
            reason: reason.clone(),
        }),
        None => Ok(()),
    }
}

/// The active segment's handle for direct writes, when they are on and the file system
/// takes them.
fn direct_handle(
    fs: &dyn FileSystem,
    options: &WalOptions,
    path: &Path,
) -> Option<Arc<dyn WalFile>> {
    if options.direct_writes {
        fs.open_direct(path)
    } else {
        None
    }
}

/// Writes the buffer out; a failure poisons the log.
fn flush(g: &mut Inner) -> Result<(), WalError> {
    if let Err(e) = g.writer.flush() {
        let err = WalError::io("write", &g.writer.path, e);
        g.poisoned = Some(err.to_string());
        return Err(err);
    }
    Ok(())
}

/// Writes the buffer out for a sync that follows at once: directly where it can (see the
/// encoder), else through the page cache; a failure poisons the log.
fn flush_for_sync(g: &mut Inner) -> Result<(), WalError> {
    match g.writer.flush_direct() {
        Ok(true) => {
            g.stats.direct_flushes += 1;
            Ok(())
        }
        Ok(false) => flush(g),
        Err(e) => {
            let err = WalError::io("direct write", &g.writer.path, e);
            g.poisoned = Some(err.to_string());
            Err(err)
        }
    }
}

/// Encodes the state records that open a segment.
fn write_state(g: &mut Inner) {
    if let Some(m) = g.metadata {
        g.writer.metadata(&m);
    }
    if let Some(s) = g.snapshot {
        g.writer.snapshot(&s);
    }
    if let Some(hs) = g.hard_state {
        g.writer.hard_state(&hs);
    }
}

/// Bytes of the seed and state records a segment started with the state in `g` opens with.
fn opening_len(g: &Inner) -> u64 {
    let mut buf = Vec::new();
    record::encode_seed(&mut buf, 0, 0, 0);
    if let Some(m) = &g.metadata {
        record::encode_metadata(&mut buf, m, 0);
    }
    if let Some(s) = &g.snapshot {
        record::encode_snapshot(&mut buf, s, 0);
    }
    if let Some(hs) = &g.hard_state {
        record::encode_hard_state(&mut buf, hs, 0);
    }
    buf.len() as u64
}

/// Takes over a segment prepared before the last close, if it is whole.
fn adopt(fs: &dyn FileSystem, path: &Path, seq: u64, size: u64) -> Option<Prepared> {
    let file = fs.open(path, true).ok()?;
    if file.len().ok()? < size {
        return None;
    }
    let mut h = [0u8; SEGMENT_HEADER_LEN as usize];
    if read_full_at(&*file, &mut h, 0).ok()? != h.len()
        || segment::decode_header(&h) != Ok((seq, FORMAT_VERSION))
    {
        return None;
    }
    // No record may follow the header yet: an end marker (zeros) must.
    let mut mark = [0u8; 8];
    if read_full_at(&*file, &mut mark, SEGMENT_HEADER_LEN).ok()? != mark.len()
        || mark.iter().any(|&b| b != 0)
    {
        return None;
    }
    file.sync_all().ok()?;
    Some(Prepared {
        seq,
        path: path.to_path_buf(),
        file,
        recycled: false,
    })
}
