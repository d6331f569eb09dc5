//! Recovery at open: every segment is read and checked, several at a time, and what the
//! segments hold is applied to the rebuilt state in segment order on the opening thread.
//!
//! A segment can be checked on its own. Its records chain from a seed derived from its
//! sequence number (see [`segment::chain_seed`]), and its first record, the seed record,
//! names the crc the segment before it ends with and the index it continues from. So a
//! worker thread reads a whole segment and checks every record against the chain, and hands
//! over a [`Scan`]: the seed, the effects of the records after it in order (entry locations,
//! hard states, snapshot markers, metadata), the crc the segment ends with, and how it ends.
//!
//! The opening thread takes the scans in segment order. It checks each seed against the
//! segment before it and applies the effects, exactly as one sequential pass would. Damage is
//! judged there too: a torn tail of the last segment is repaired, and damage anywhere else is
//! an error. So the first error in segment order is the one reported, and nothing is repaired
//! before every earlier segment was found whole. Scanning has no side effects.
//!
//! Workers run at most [`AHEAD`] segments per worker ahead of the segment being applied,
//! which bounds the memory held by finished scans waiting their turn. With one thread
//! ([`WalOptions::recovery_threads`]), or one segment, the opening thread scans each segment
//! itself, one at a time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};
use tracing::warn;

use crate::decoder::{Next, SegmentReader};
use crate::error::WalError;
use crate::index::{Loc, LogIndex};
use crate::io::{FileSystem, WalFile, read_full_at};
use crate::options::WalOptions;
use crate::record::{HardState, Metadata, Record, SnapshotMarker};
use crate::repair;
use crate::segment::{self, BATCH_VERSION, FORMAT_VERSION, HeaderError, SEGMENT_HEADER_LEN};
use crate::wal::{SegInfo, corrupt};

/// Segments a worker may have scanned beyond the one being applied, per worker.
pub(crate) const AHEAD: usize = 2;

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
    pub index: LogIndex,
    pub hard_state: Option<HardState>,
    pub snapshot: Option<SnapshotMarker>,
    pub metadata: Option<Metadata>,
    /// Crc of the last record applied.
    pub crc: u32,
}

/// The last segment kept, which appends continue.
pub(crate) struct LastSegment {
    pub seq: u64,
    pub path: PathBuf,
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
    pub state: Replay,
    pub segments: BTreeMap<u64, SegInfo>,
    pub last: Option<LastSegment>,
    /// `(seq, first index)` for a fresh first segment, when no segment was kept.
    pub fresh: (u64, u64),
}

/// What one record after a segment's seed does to the rebuilt state.
enum Effect {
    /// Entry `index` (of an entry record, or of a batch) is at `loc`.
    Entry {
        index: u64,
        loc: Loc,
    },
    HardState(HardState),
    Snapshot(SnapshotMarker),
    Metadata(Metadata),
}

/// A segment's seed record.
struct Seed {
    offset: u64,
    prev_crc: u32,
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
}

/// One segment, read and checked.
struct Scan {
    seq: u64,
    first: u64,
    path: PathBuf,
    file: Arc<dyn WalFile>,
    /// Its format version, or why its header is not a whole one.
    version: Result<u32, String>,
    seed: Option<Seed>,
    effects: Vec<Effect>,
    /// Crc of the last record that passed its checks.
    crc: u32,
    ending: Ending,
}

/// Reads and checks segment `l` of `dir`, with `scratch` as its read buffer. Errors that do
/// not depend on the segment's place (an unreadable file, a foreign format version, a header
/// naming another segment) are returned as such; the rest is judged when the scan is applied.
fn scan(
    fs: &dyn FileSystem,
    dir: &Path,
    l: &Listed,
    options: &WalOptions,
    scratch: &mut Vec<u8>,
) -> Result<Scan, WalError> {
    let path = dir.join(&l.name);
    let file = fs
        .open(&path, true)
        .map_err(|e| WalError::io("open segment", &path, e))?;
    let mut h = [0u8; SEGMENT_HEADER_LEN as usize];
    let got = read_full_at(&*file, &mut h, 0).map_err(|e| WalError::io("read", &path, e))?;
    let mut s = Scan {
        seq: l.seq,
        first: l.first,
        path,
        file,
        version: Ok(FORMAT_VERSION),
        seed: None,
        effects: Vec::new(),
        crc: 0,
        ending: Ending::End(SEGMENT_HEADER_LEN),
    };
    let version = match segment::decode_header(&h[..got]) {
        Ok((seq, v)) if seq == l.seq => v,
        Ok((seq, _)) => {
            return Err(corrupt(
                &s.path,
                0,
                format!("header holds sequence number {seq:x}, the name {:x}", l.seq),
            ));
        }
        Err(HeaderError::Version(found)) => {
            return Err(WalError::UnknownVersion {
                path: s.path,
                found,
                expected: FORMAT_VERSION,
            });
        }
        Err(HeaderError::Damaged(reason)) => {
            s.version = Err(reason);
            return Ok(s);
        }
    };
    s.version = Ok(version);
    let len = s.file.len().map_err(|e| WalError::io("stat", &s.path, e))?;
    let mut reader = SegmentReader::with_buffer(
        &*s.file,
        SEGMENT_HEADER_LEN,
        len,
        options.read_buffer,
        std::mem::take(scratch),
    );
    reader.allow_batches(version >= BATCH_VERSION);
    let mut crc = segment::chain_seed(l.seq, version);
    s.ending = loop {
        let prev = crc;
        let next = reader
            .next(prev)
            .map_err(|e| WalError::io("read", &s.path, e))?;
        let (offset, record) = match next {
            Next::Record {
                offset,
                crc: c,
                record,
            } => {
                crc = c;
                (offset, record)
            }
            Next::End { offset } => break Ending::End(offset),
            Next::Bad { offset, reason } => break Ending::Bad { offset, reason },
            // Whole (its checksum holds), so no torn write.
            Next::Invalid { offset, reason } => break Ending::Corrupt { offset, reason },
        };
        if s.seed.is_none() {
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
            s.seed = Some(Seed {
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
            Record::Entry { index, term, data } => s.effects.push(Effect::Entry {
                index,
                loc: Loc::entry(term, l.seq, offset, data.len(), prev),
            }),
            Record::Batch(b) => {
                s.effects.reserve(b.len());
                for (index, data_at, data) in b.entries() {
                    let loc = Loc::in_batch(
                        b.term,
                        l.seq,
                        offset,
                        b.payload_len(),
                        prev,
                        data_at,
                        data.len(),
                    );
                    s.effects.push(Effect::Entry { index, loc });
                }
            }
            Record::HardState(hs) => s.effects.push(Effect::HardState(hs)),
            Record::Snapshot(m) => s.effects.push(Effect::Snapshot(m)),
            Record::Metadata(m) => s.effects.push(Effect::Metadata(m)),
        }
    };
    // The crc of the last record that passed (a seed's own, if only the seed did).
    s.crc = crc;
    *scratch = reader.into_buffer();
    Ok(s)
}

/// Whether recovery goes on after a segment.
enum Flow {
    Continue,
    /// The segment's header was damaged: it and anything after it are not the log.
    Stop,
}

/// Applies the scans in segment order.
struct Applier<'a> {
    fs: &'a dyn FileSystem,
    strict: bool,
    /// Segments listed.
    n: usize,
    out: Recovered,
}

impl Applier<'_> {
    /// Applies scan `i`: checks its seed against what came before, replays its effects,
    /// and judges how it ends.
    fn apply(&mut self, i: usize, s: Scan) -> Result<Flow, WalError> {
        let is_last = i + 1 == self.n;
        let version = match s.version {
            Ok(v) => v,
            Err(reason) => {
                if !is_last || self.strict {
                    return Err(corrupt(&s.path, 0, reason));
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
        if let Some(seed) = &s.seed {
            if i > 0 && seed.prev_crc != st.crc {
                return Err(corrupt(
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
                return Err(corrupt(
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
            st.crc = s.crc;
        } else if i == 0 {
            st.index = LogIndex::new(s.first);
        }
        for effect in s.effects {
            match effect {
                Effect::Entry { index, loc } => {
                    if let Err(last) = st.index.push(index, loc) {
                        return Err(corrupt(
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
        let end = match s.ending {
            Ending::End(offset) => offset,
            Ending::Corrupt { offset, reason } => return Err(corrupt(&s.path, offset, reason)),
            Ending::Bad { offset, reason } => {
                if !is_last || self.strict {
                    return Err(corrupt(&s.path, offset, reason));
                }
                let kept = repair::truncate_tail(self.fs, &s.path, &*s.file, offset)
                    .map_err(|e| WalError::io("repair", &s.path, e))?;
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
            seeded: s.seed.is_some(),
            version,
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
    if workers <= 1 {
        let mut scratch = Vec::new();
        for (i, l) in listed.iter().enumerate() {
            let s = scan(fs, dir, l, options, &mut scratch)?;
            if let Flow::Stop = applier.apply(i, s)? {
                break;
            }
        }
    } else {
        scan_parallel(fs, dir, listed, options, workers, |i, s| {
            applier.apply(i, s?)
        })?;
    }
    Ok(applier.out)
}

/// Work shared by the scanning workers and the applying thread.
struct Board {
    /// Next segment to scan.
    next: usize,
    /// Segments applied.
    applied: usize,
    /// Set when the applying thread is done (an error, or a segment ending the log).
    stop: bool,
    /// Set by a worker that panicked: the applying thread stops waiting (the panic goes on
    /// once every worker has ended).
    panicked: bool,
    /// Finished scans, by segment, until applied.
    done: Vec<Option<Result<Scan, WalError>>>,
}

/// Tells the applying thread when a worker unwinds, so it does not wait for a scan that
/// will never come.
struct Unwind<'a> {
    board: &'a Mutex<Board>,
    changed: &'a Condvar,
}

impl Drop for Unwind<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let mut b = self.board.lock();
            b.panicked = true;
            b.stop = true;
            drop(b);
            self.changed.notify_all();
        }
    }
}

/// Scans `listed` on `workers` threads, handing each scan to `apply` in segment order on
/// the calling thread.
fn scan_parallel(
    fs: &dyn FileSystem,
    dir: &Path,
    listed: &[Listed],
    options: &WalOptions,
    workers: usize,
    mut apply: impl FnMut(usize, Result<Scan, WalError>) -> Result<Flow, WalError>,
) -> Result<(), WalError> {
    let board = Mutex::new(Board {
        next: 0,
        applied: 0,
        stop: false,
        panicked: false,
        done: (0..listed.len()).map(|_| None).collect(),
    });
    let changed = Condvar::new();
    let ahead = workers * AHEAD;
    std::thread::scope(|scope| {
        for w in 0..workers {
            let (board, changed) = (&board, &changed);
            let spawned = std::thread::Builder::new()
                .name(format!("keel-wal-recover-{w}"))
                .spawn_scoped(scope, move || {
                    let _unwind = Unwind { board, changed };
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
                        let s = scan(fs, dir, &listed[j], options, &mut scratch);
                        board.lock().done[j] = Some(s);
                        changed.notify_all();
                    }
                });
            if let Err(e) = spawned {
                board.lock().stop = true;
                changed.notify_all();
                return Err(WalError::io("start a recovery thread", dir, e));
            }
        }
        let result = (|| {
            for i in 0..listed.len() {
                let s = {
                    let mut b = board.lock();
                    loop {
                        if let Some(s) = b.done[i].take() {
                            break s;
                        }
                        if b.panicked {
                            return Err(WalError::io(
                                "scan segments",
                                dir,
                                std::io::Error::other("a recovery thread panicked"),
                            ));
                        }
                        changed.wait(&mut b);
                    }
                };
                let flow = apply(i, s)?;
                board.lock().applied = i + 1;
                changed.notify_all();
                if let Flow::Stop = flow {
                    break;
                }
            }
            Ok(())
        })();
        board.lock().stop = true;
        changed.notify_all();
        result
    })
}
