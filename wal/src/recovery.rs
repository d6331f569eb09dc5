//! Recovery at open: every segment is read and checked, several at a time, and what the
//! segments hold is applied to the rebuilt state in segment order on the opening thread.
//!
//! A segment can be checked on its own. Its records chain from a seed derived from its
//! sequence number (see [`segment::chain_seed`]), and its first record, the seed record,
//! names the crc the segment before it ends with and the index it continues from. So a
//! worker thread reads a whole segment and checks every record against the chain, and hands
//! over a [`Scan`]: the seed, the effects of the records after it in order (entry locations,
//! hard states, snapshot markers, metadata), the crc the segment ends with, and how it ends:
//! at its end, at a record that fails its checks, at damage no crash leaves, or at a read
//! error. Scanning changes nothing on disk.
//!
//! The opening thread takes the scans in segment order. It checks each seed against the
//! segment before it, applies the effects, then judges how the segment ended, as one
//! sequential pass does record by record: a torn tail of the last segment is repaired, and
//! damage anywhere else, or a read error, is an error. So the error reported is the one a
//! sequential pass meets first, and nothing is repaired before every earlier segment was
//! found whole. A worker that panics hands over its panic, which goes on only if the
//! opening thread reaches that segment.
//!
//! Workers run at most `workers + 1` segments ahead of the segment being applied (applying
//! is much faster than reading), which bounds what finished scans hold while they wait:
//! about 56 bytes per entry, against the index's 40. With one thread
//! ([`WalOptions::recovery_threads`]), or one segment, the opening thread scans each segment
//! itself, one at a time.

use std::any::Any;
use std::collections::BTreeMap;
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Condvar, Mutex};
use tracing::warn;

use crate::decoder::{Next, SegmentReader};
use crate::error::WalError;
use crate::index::{Loc, LogIndex};
use crate::io::{FileSystem, WalFile, read_full_at};
use crate::options::WalOptions;
use crate::record::{HardState, Metadata, Record, SnapshotMarker};
use crate::repair;
use crate::segment::{
    self, BATCH_VERSION, FORMAT_VERSION, HeaderError, SEGMENT_HEADER_LEN, SegInfo,
};

/// A segment file found in the directory.
pub(crate) struct Listed {
    /// Sequence number, from the name.
    pub seq: u64,
    /// First index, from the name.
    pub first: u64,
    /// File name.
    pub name: String,
}

/// The state rebuilt from the segments.
pub(crate) struct Replay {
    /// Where every entry held is.
    pub index: LogIndex,
    /// The last hard state recorded.
    pub hard_state: Option<HardState>,
    /// The last snapshot marker recorded.
    pub snapshot: Option<SnapshotMarker>,
    /// The last metadata recorded.
    pub metadata: Option<Metadata>,
    /// Crc of the last record applied: the chain appends continue.
    pub crc: u32,
}

/// The last segment kept, which appends continue.
pub(crate) struct LastSegment {
    /// Its sequence number.
    pub seq: u64,
    /// Its path.
    pub path: PathBuf,
    /// Its file.
    pub file: Arc<dyn WalFile>,
    /// Offset where its records end.
    pub end: u64,
    /// Whether its seed record was found.
    pub seeded: bool,
    /// Its format version.
    pub version: u32,
}

/// What recovery found.
pub(crate) struct Recovered {
    /// The state the segments rebuilt.
    pub state: Replay,
    /// The segments kept, by sequence number.
    pub segments: BTreeMap<u64, SegInfo>,
    /// The last segment kept, if any.
    pub last: Option<LastSegment>,
    /// `(seq, first index)` for a fresh first segment, when no segment was kept.
    pub fresh: (u64, u64),
}

/// What one record after a segment's seed does to the rebuilt state.
enum Effect {
    /// Entry `index` (of an entry record, or of a batch) is at `loc`.
    Entry { index: u64, loc: Loc },
    /// A hard state record.
    HardState(HardState),
    /// A snapshot marker record.
    Snapshot(SnapshotMarker),
    /// A metadata record.
    Metadata(Metadata),
}

/// A segment's seed record.
struct Seed {
    /// Offset of the record.
    offset: u64,
    /// Crc the previous segment ends with, as this one says.
    prev_crc: u32,
    /// Index of the first entry this segment may hold.
    first_index: u64,
}

/// How a segment's records end.
enum Ending {
    /// The written part ends at this offset (a zero header, or the end of the file).
    End(u64),
    /// A record at `offset` fails its checks: a torn tail, if this is the last segment.
    Bad { offset: u64, reason: String },
    /// Damage that no crash leaves behind: always an error.
    Corrupt { offset: u64, reason: String },
    /// Reading the file failed.
    Failed(WalError),
}

/// The records of a segment whose header is whole.
struct Records {
    /// The segment's format version.
    version: u32,
    /// Its seed record, if its first record is one.
    seed: Option<Seed>,
    /// What the records after the seed do, in order.
    effects: Vec<Effect>,
    /// Crc of the last record that passed its checks (a seed's own, if only the seed did).
    crc: u32,
    /// How the records end.
    ending: Ending,
}

/// One segment, read and checked.
struct Scan {
    /// Sequence number.
    seq: u64,
    /// First index, from the name.
    first: u64,
    /// Its path.
    path: PathBuf,
    /// Its file.
    file: Arc<dyn WalFile>,
    /// Its records, or why its header is not a whole one.
    body: Result<Records, String>,
}

/// Reads and checks segment `l` of `dir`, with `scratch` as its read buffer; stops early
/// (with a meaningless ending) once `halt` is set. Errors before any record is read (the
/// file cannot be opened or its header read, a foreign format version, a header naming
/// another segment) are returned as such.
fn scan(
    fs: &dyn FileSystem,
    dir: &Path,
    l: &Listed,
    options: &WalOptions,
    scratch: &mut Vec<u8>,
    halt: &AtomicBool,
) -> Result<Scan, WalError> {
    let path = dir.join(&l.name);
    let file = fs
        .open(&path, true)
        .map_err(|e| WalError::io("open segment", &path, e))?;
    let mut h = [0u8; SEGMENT_HEADER_LEN as usize];
    let got = read_full_at(&*file, &mut h, 0).map_err(|e| WalError::io("read", &path, e))?;
    let version = match segment::decode_header(&h[..got]) {
        Ok((seq, v)) if seq == l.seq => v,
        Ok((seq, _)) => {
            return Err(WalError::corrupt(
                &path,
                0,
                format!("header holds sequence number {seq:x}, the name {:x}", l.seq),
            ));
        }
        Err(HeaderError::Version(found)) => {
            return Err(WalError::UnknownVersion {
                path,
                found,
                expected: FORMAT_VERSION,
            });
        }
        Err(HeaderError::Damaged(reason)) => {
            return Ok(Scan {
                seq: l.seq,
                first: l.first,
                path,
                file,
                body: Err(reason),
            });
        }
    };
    let body = match file.len() {
        Ok(len) => scan_records(&*file, &path, l.seq, version, len, options, scratch, halt),
        Err(e) => Records {
            version,
            seed: None,
            effects: Vec::new(),
            crc: 0,
            ending: Ending::Failed(WalError::io("stat", &path, e)),
        },
    };
    Ok(Scan {
        seq: l.seq,
        first: l.first,
        path,
        file,
        body: Ok(body),
    })
}

/// Reads the records of segment `seq` (format `version`, `len` bytes long) up to its end,
/// the first one that fails its checks, or a read error.
#[allow(clippy::too_many_arguments)]
fn scan_records(
    file: &dyn WalFile,
    path: &Path,
    seq: u64,
    version: u32,
    len: u64,
    options: &WalOptions,
    scratch: &mut Vec<u8>,
    halt: &AtomicBool,
) -> Records {
    let mut reader = SegmentReader::with_buffer(
        file,
        SEGMENT_HEADER_LEN,
        len,
        options.read_buffer,
        std::mem::take(scratch),
    );
    reader.allow_batches(version >= BATCH_VERSION);
    let mut r = Records {
        version,
        seed: None,
        effects: Vec::new(),
        crc: segment::chain_seed(seq, version),
        ending: Ending::End(SEGMENT_HEADER_LEN),
    };
    r.ending = loop {
        if halt.load(Ordering::Relaxed) {
            break Ending::End(reader.position());
        }
        let prev = r.crc;
        let (offset, record) = match reader.next(prev) {
            Ok(Next::Record {
                offset,
                crc,
                record,
            }) => {
                r.crc = crc;
                (offset, record)
            }
            Ok(Next::End { offset }) => break Ending::End(offset),
            Ok(Next::Bad { offset, reason }) => break Ending::Bad { offset, reason },
            // Whole (its checksum holds), so no torn write.
            Ok(Next::Invalid { offset, reason }) => break Ending::Corrupt { offset, reason },
            Err(e) => break Ending::Failed(WalError::io("read", path, e)),
        };
        if r.seed.is_none() {
            let Record::Seed {
                prev_crc,
                first_index,
            } = record
            else {
                break Ending::Corrupt {
                    offset,
                    reason: "segment does not start with a seed record".into(),
                };
            };
            r.seed = Some(Seed {
                offset,
                prev_crc,
                first_index,
            });
            continue;
        }
        match record {
            Record::Seed { .. } => {
                break Ending::Corrupt {
                    offset,
                    reason: "seed record inside a segment".into(),
                };
            }
            Record::Entry { index, term, data } => r.effects.push(Effect::Entry {
                index,
                loc: Loc::entry(term, seq, offset, data.len(), prev),
            }),
            Record::Batch(b) => {
                r.effects.reserve(b.len());
                for (index, data_at, data) in b.entries() {
                    let loc = Loc::in_batch(
                        b.term,
                        seq,
                        offset,
                        b.payload_len(),
                        prev,
                        data_at,
                        data.len(),
                    );
                    r.effects.push(Effect::Entry { index, loc });
                }
            }
            Record::HardState(hs) => r.effects.push(Effect::HardState(hs)),
            Record::Snapshot(m) => r.effects.push(Effect::Snapshot(m)),
            Record::Metadata(m) => r.effects.push(Effect::Metadata(m)),
        }
    };
    *scratch = reader.into_buffer();
    r
}

/// Whether recovery goes on after a segment.
enum Flow {
    /// On to the next segment.
    Continue,
    /// The segment's header was damaged: it and anything after it are not the log.
    Stop,
}

/// Applies the scans in segment order.
struct Applier<'a> {
    /// The file system, for repairs.
    fs: &'a dyn FileSystem,
    /// Whether to refuse repairs.
    strict: bool,
    /// Number of segments listed.
    n: usize,
    /// What has been rebuilt so far.
    out: Recovered,
}

impl Applier<'_> {
    /// Applies scan `i`: checks its seed against what came before, replays its effects,
    /// and judges how it ends.
    fn apply(&mut self, i: usize, s: Scan) -> Result<Flow, WalError> {
        let is_last = i + 1 == self.n;
        let r = match s.body {
            Ok(r) => r,
            Err(reason) => {
                if !is_last || self.strict {
                    return Err(WalError::corrupt(&s.path, 0, reason));
                }
                // Headers are synced before a segment is renamed into place, so a bad one in
                // the last segment is a crash in the middle of starting it.
                let kept = repair::set_aside(self.fs, &s.path)
                    .map_err(|e| WalError::io("set aside", &s.path, e))?;
                warn!(segment = %s.path.display(), kept = %kept.display(), %reason,
                    "WAL: last segment has a damaged header; set aside");
                if i == 0 {
                    self.out.fresh = (s.seq, s.first);
                }
                return Ok(Flow::Stop);
            }
        };
        let st = &mut self.out.state;
        if let Some(seed) = &r.seed {
            if i > 0 && seed.prev_crc != st.crc {
                return Err(WalError::corrupt(
                    &s.path,
                    seed.offset,
                    format!(
                        "crc chain broken: segment continues from {:08x}, the previous one \
                         ends with {:08x}",
                        seed.prev_crc, st.crc
                    ),
                ));
            }
            if i > 0 && seed.first_index != st.index.last() + 1 {
                return Err(WalError::corrupt(
                    &s.path,
                    seed.offset,
                    format!(
                        "segment starts at index {}, the previous one ends at {}",
                        seed.first_index,
                        st.index.last()
                    ),
                ));
            }
            if i == 0 {
                st.index = LogIndex::new(seed.first_index);
            }
            st.crc = r.crc;
        } else if i == 0 {
            st.index = LogIndex::new(s.first);
        }
        for effect in r.effects {
            match effect {
                Effect::Entry { index, loc } => {
                    if let Err(last) = st.index.push(index, loc) {
                        return Err(WalError::corrupt(
                            &s.path,
                            loc.offset,
                            format!("entry {index} leaves a gap after entry {last}"),
                        ));
                    }
                }
                Effect::HardState(hs) => st.hard_state = Some(hs),
                Effect::Snapshot(m) => {
                    st.index.apply_snapshot(&m);
                    st.snapshot = Some(m);
                }
                Effect::Metadata(m) => st.metadata = Some(m),
            }
        }
        let end = match r.ending {
            Ending::End(offset) => offset,
            Ending::Failed(e) => return Err(e),
            Ending::Corrupt { offset, reason } => {
                return Err(WalError::corrupt(&s.path, offset, reason));
            }
            Ending::Bad { offset, reason } => {
                if !is_last || self.strict {
                    return Err(WalError::corrupt(&s.path, offset, reason));
                }
                let kept = repair::truncate_tail(self.fs, &s.path, &*s.file, offset)?;
                warn!(segment = %s.path.display(), offset, kept = %kept.display(), %reason,
                    "WAL: torn tail truncated to the last whole record");
                offset
            }
        };
        self.out.segments.insert(
            s.seq,
            SegInfo {
                path: s.path.clone(),
                file: s.file.clone(),
            },
        );
        self.out.last = Some(LastSegment {
            seq: s.seq,
            path: s.path,
            file: s.file,
            end,
            seeded: r.seed.is_some(),
            version: r.version,
        });
        Ok(Flow::Continue)
    }
}

/// Reads, checks and applies the segments `listed` (sorted by sequence number, without
/// gaps) of `dir`, repairing a torn tail of the last one unless `options.strict`.
pub(crate) fn recover(
    fs: &dyn FileSystem,
    dir: &Path,
    listed: &[Listed],
    options: &WalOptions,
) -> Result<Recovered, WalError> {
    let mut applier = Applier {
        fs,
        strict: options.strict,
        n: listed.len(),
        out: Recovered {
            state: Replay {
                index: LogIndex::new(1),
                hard_state: None,
                snapshot: None,
                metadata: None,
                crc: 0,
            },
            segments: BTreeMap::new(),
            last: None,
            fresh: (0, 1),
        },
    };
    let workers = options.recovery_threads.min(listed.len());
    scan_all(fs, dir, listed, options, workers, |i, s| {
        applier.apply(i, s)
    })?;
    Ok(applier.out)
}

/// A worker's scan of one segment: its result, or the panic it raised.
type Outcome = Result<Result<Scan, WalError>, Box<dyn Any + Send>>;

/// Work shared by the scanning workers and the applying thread.
struct Board {
    /// Next segment to scan.
    next: usize,
    /// Segments applied.
    applied: usize,
    /// Set when the applying thread is done (an error, a panic, or a segment ending the
    /// log): workers take no more segments.
    stop: bool,
    /// Finished scans, by segment, until applied.
    done: Vec<Option<Outcome>>,
}

/// Ends the workers when the applying thread leaves, whether it returns or unwinds.
struct StopOnDrop<'a> {
    board: &'a Mutex<Board>,
    changed: &'a Condvar,
    halt: &'a AtomicBool,
}

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.halt.store(true, Ordering::Relaxed);
        self.board.lock().stop = true;
        self.changed.notify_all();
    }
}

/// Scans `listed` on up to `workers` threads (on the calling thread alone if one, or if no
/// thread can be started), handing each scan to `apply` in segment order on the calling
/// thread.
fn scan_all(
    fs: &dyn FileSystem,
    dir: &Path,
    listed: &[Listed],
    options: &WalOptions,
    workers: usize,
    mut apply: impl FnMut(usize, Scan) -> Result<Flow, WalError>,
) -> Result<(), WalError> {
    let sequential = |apply: &mut dyn FnMut(usize, Scan) -> Result<Flow, WalError>| {
        let mut scratch = Vec::new();
        let never = AtomicBool::new(false);
        for (i, l) in listed.iter().enumerate() {
            let s = scan(fs, dir, l, options, &mut scratch, &never)?;
            if let Flow::Stop = apply(i, s)? {
                break;
            }
        }
        Ok(())
    };
    if workers <= 1 {
        return sequential(&mut apply);
    }
    let board = Mutex::new(Board {
        next: 0,
        applied: 0,
        stop: false,
        done: (0..listed.len()).map(|_| None).collect(),
    });
    let changed = Condvar::new();
    let halt = AtomicBool::new(false);
    let ahead = workers + 1;
    std::thread::scope(|scope| {
        let stop = StopOnDrop {
            board: &board,
            changed: &changed,
            halt: &halt,
        };
        let mut started = 0;
        for w in 0..workers {
            let (board, changed, halt) = (&board, &changed, &halt);
            let spawned = std::thread::Builder::new()
                .name(format!("keel-wal-recover-{w}"))
                .spawn_scoped(scope, move || {
                    let mut scratch = Vec::new();
                    loop {
                        let j = {
                            let mut b = board.lock();
                            loop {
                                if b.stop || b.next >= listed.len() {
                                    return;
                                }
                                if b.next < b.applied + ahead {
                                    break;
                                }
                                changed.wait(&mut b);
                            }
                            b.next += 1;
                            b.next - 1
                        };
                        let outcome = panic::catch_unwind(AssertUnwindSafe(|| {
                            scan(fs, dir, &listed[j], options, &mut scratch, halt)
                        }));
                        board.lock().done[j] = Some(outcome);
                        changed.notify_all();
                    }
                });
            match spawned {
                Ok(_) => started += 1,
                Err(e) => {
                    warn!(error = %e, started, "WAL: could not start a recovery thread");
                    break;
                }
            }
        }
        if started == 0 {
            drop(stop);
            return sequential(&mut apply);
        }
        for i in 0..listed.len() {
            let outcome = {
                let mut b = board.lock();
                loop {
                    if let Some(o) = b.done[i].take() {
                        break o;
                    }
                    changed.wait(&mut b);
                }
            };
            let s = match outcome {
                Ok(s) => s?,
                Err(payload) => panic::resume_unwind(payload),
            };
            let flow = apply(i, s)?;
            board.lock().applied = i + 1;
            changed.notify_all();
            if let Flow::Stop = flow {
                break;
            }
        }
        drop(stop);
        Ok(())
    })
}
