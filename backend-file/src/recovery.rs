//! Opening a store: the META floor, the segment list, and the replay of every frame into a
//! fresh index, with the torn tail of the last segment cut off (and damage to a durable frame
//! there refused: see the format doc, section "Frame").

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::path::Path;
use std::sync::Arc;

use keel_mvcc::{BackendError, Bucket};

use crate::fault::Io;
use crate::format::{
    self, FRAME_HEADER, HEADER_LEN, META_MAGIC, META_VERSION, Record, Records, SEGMENT_MAGIC,
    VERSION, u32_at, u64_at,
};
use crate::segment::{self, SegFile, SegMap};
use crate::version::{Applier, Loc, Mapped, SegStat, Version};

/// Name of the META file.
pub(crate) const META: &str = "META";
/// Name of the marker of a restore in progress.
pub(crate) const RESTORING: &str = "RESTORING";
const META_TMP: &str = "META.tmp";
/// The first segment of a new store.
const FIRST_SEGMENT: u32 = 1;

/// The segment being appended to.
pub(crate) struct Active {
    pub(crate) seg: Arc<SegFile>,
    pub(crate) file: Arc<File>,
    /// Committed end: every byte before it belongs to a written frame (or the header), durable
    /// unless `dirty`.
    pub(crate) end: u64,
    /// True until the first frame is written to the segment.
    pub(crate) fresh: bool,
    /// Frames were written without a sync since the last one (a restore in progress).
    pub(crate) dirty: bool,
}

/// Everything open rebuilds.
pub(crate) struct Recovered {
    pub(crate) version: Version,
    pub(crate) stats: BTreeMap<u32, SegStat>,
    pub(crate) active: Active,
    pub(crate) next_seq: u64,
    /// The highest sequence number known durable (see [`crate::store::Writer::durable_seq`]).
    pub(crate) durable_seq: u64,
    pub(crate) bucket_names: Vec<Bucket>,
    /// Bytes of the active segment's file, all durable: its frames, then zeros.
    pub(crate) zeroed: u64,
}

fn corrupt(path: &Path, offset: u64, reason: impl Into<String>) -> BackendError {
    BackendError::Corrupt {
        path: path.to_path_buf(),
        offset,
        reason: reason.into(),
    }
}

/// Writes META with `floor`, atomically (temporary file, sync, rename, directory sync).
pub(crate) fn write_meta(dir: &Path, io: &Io, floor: u32) -> Result<(), BackendError> {
    let tmp = dir.join(META_TMP);
    let file = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| BackendError::io(&tmp, "create", e))?;
    io.write_at(
        &file,
        &tmp,
        0,
        &format::encode_header(META_MAGIC, META_VERSION, u64::from(floor)),
    )?;
    io.sync_data(&file, &tmp)?;
    let meta = dir.join(META);
    std::fs::rename(&tmp, &meta).map_err(|e| BackendError::io(&meta, "rename", e))?;
    io.sync_dir(dir)
}

/// Creates segment `id` with its header durable, and the directory entry durable.
pub(crate) fn create_segment(
    dir: &Path,
    io: &Io,
    id: u32,
) -> Result<(Arc<SegFile>, File), BackendError> {
    let path = dir.join(segment::file_name(u64::from(id)));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| BackendError::io(&path, "create", e))?;
    io.write_at(
        &file,
        &path,
        0,
        &format::encode_header(SEGMENT_MAGIC, VERSION, u64::from(id)),
    )?;
    io.sync_data(&file, &path)?;
    io.sync_dir(dir)?;
    Ok((SegFile::new(id, path), file))
}

fn read_meta(dir: &Path) -> Result<Option<u32>, BackendError> {
    let path = dir.join(META);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(BackendError::io(&path, "read", e)),
    };
    if bytes.len() != HEADER_LEN {
        return Err(corrupt(
            &path,
            0,
            format!("META is {} bytes long, not {HEADER_LEN}", bytes.len()),
        ));
    }
    let (floor, _) = format::decode_header(
        &path,
        &bytes,
        META_MAGIC,
        "META file",
        META_VERSION..=META_VERSION,
    )?;
    u32::try_from(floor)
        .ok()
        .filter(|&f| f >= FIRST_SEGMENT)
        .map(Some)
        .ok_or_else(|| corrupt(&path, 16, format!("META floor {floor} is out of range")))
}

/// Opens the store in `dir` (which exists and is locked) and rebuilds its index; segments are
/// mapped at `segment_size` bytes or their length, whichever is larger.
pub(crate) fn recover(dir: &Path, io: &Io, segment_size: u64) -> Result<Recovered, BackendError> {
    let marker = dir.join(RESTORING);
    if marker.exists() {
        return Err(corrupt(
            &marker,
            0,
            "a restore into this store did not finish; the store is incomplete: discard it",
        ));
    }
    let meta = read_meta(dir)?;
    let mut ids = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| BackendError::io(dir, "read directory", e))?;
    for entry in entries {
        let entry = entry.map_err(|e| BackendError::io(dir, "read directory", e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if name == META_TMP || crate::prepare::is_tmp_name(name) {
            let p = entry.path();
            std::fs::remove_file(&p).map_err(|e| BackendError::io(&p, "remove", e))?;
        } else if let Some(id) = segment::parse_name(name) {
            ids.push(id);
        }
    }
    ids.sort_unstable();

    let floor = match meta {
        Some(f) => f,
        None if ids.is_empty() => {
            write_meta(dir, io, FIRST_SEGMENT)?;
            FIRST_SEGMENT
        }
        None => {
            return Err(corrupt(
                &dir.join(META),
                0,
                "META is missing but segment files exist",
            ));
        }
    };

    // Segments below the floor are dead: their live data was copied before META moved.
    let mut removed = false;
    ids.retain(|&id| {
        if id < u64::from(floor) {
            let p = dir.join(segment::file_name(id));
            if let Err(e) = std::fs::remove_file(&p) {
                tracing::warn!(path = %p.display(), error = %e, "cannot remove dead segment");
            }
            removed = true;
            false
        } else {
            true
        }
    });
    if removed {
        io.sync_dir(dir)?;
    }
    for (i, &id) in ids.iter().enumerate() {
        let expected = u64::from(floor) + i as u64;
        if id != expected {
            let p = dir.join(segment::file_name(expected));
            return Err(corrupt(
                &p,
                0,
                format!("segment {expected:016x} is missing (next present: {id:016x})"),
            ));
        }
        if id >= u64::from(u32::MAX) {
            return Err(corrupt(
                &dir.join(segment::file_name(id)),
                0,
                "segment id out of range",
            ));
        }
    }

    let mut r = Replay {
        version: Version {
            base: floor,
            ..Version::default()
        },
        stats: BTreeMap::new(),
        names: Vec::new(),
        expected_seq: None,
    };
    let mut active: Option<Active> = None;
    let mut zeroed = HEADER_LEN as u64;
    let count = ids.len();
    for (i, &id) in ids.iter().enumerate() {
        let id = id as u32;
        let last = i + 1 == count;
        let path = dir.join(segment::file_name(u64::from(id)));
        let file = OpenOptions::new()
            .read(true)
            .write(last)
            .open(&path)
            .map_err(|e| BackendError::io(&path, "open", e))?;
        let size = file
            .metadata()
            .map_err(|e| BackendError::io(&path, "stat", e))?
            .len();
        if last && torn_creation(&file, &path, size)? {
            // The crash hit while the segment was being created: its header never became
            // durable, so no frame was ever written to it.
            drop(file);
            std::fs::remove_file(&path).map_err(|e| BackendError::io(&path, "remove", e))?;
            io.sync_dir(dir)?;
            break;
        }
        let seg = SegFile::new(id, path.clone());
        let map = SegMap::map(io, &seg, &file, &path, size, segment_size)?;
        let bytes = map.prefix(size).unwrap_or_default();
        let (hid, version) = format::decode_segment_header(&path, bytes)?;
        if hid != u64::from(id) {
            return Err(corrupt(
                &path,
                16,
                format!("header names segment {hid:016x}"),
            ));
        }
        r.stats.insert(id, SegStat { size, live: 0 });
        let (end, frames) = r.replay_segment(id, &path, bytes, version, last)?;
        // Past the last frame: zeros prepared ahead, or the torn write of a commit that never
        // returned (only in the last segment: `replay_segment` refuses it elsewhere).
        let clean = bytes[end as usize..].iter().all(|&b| b == 0);
        if clean {
            zeroed = size;
        } else {
            tracing::warn!(path = %path.display(), end, size, "cutting off a torn commit");
            io.truncate(&file, &path, end)?;
            io.sync_data(&file, &path)?;
            zeroed = end;
        }
        if let Some(s) = r.stats.get_mut(&id) {
            s.size = end;
        }
        r.version.segs.push(Some(Mapped { map, end }));
        if last && version < VERSION {
            // Frames are only ever appended in this build's format: the old segment is
            // sealed as it is (durable first, as every sealed segment is) and the next one
            // is started below.
            tracing::info!(path = %path.display(), version, "sealing a segment of an older format");
            io.sync_data(&file, &path)?;
        } else if last {
            if clean {
                // Its frames may be only in the page cache (the process crashed, not the
                // machine): synced now, every frame replayed is durable, and the next frame
                // says so (see the format doc, section "Frame").
                io.sync_data(&file, &path)?;
            }
            active = Some(Active {
                seg,
                file: Arc::new(file),
                end,
                fresh: frames == 0,
                dirty: false,
            });
        }
    }

    // Every segment replayed is durable now: sealed ones always are, and the last one was
    // synced above (after its torn tail was cut off, if it had one).
    let next_seq = r.expected_seq.unwrap_or(1);
    let active = match active {
        Some(a) => a,
        None => {
            // No segment left open for writing: a new store, a last segment that was a torn
            // creation (then the previous one, sealed, stays sealed), or one of an older
            // format, sealed above.
            let id = floor + r.version.segs.len() as u32;
            let (seg, file) = create_segment(dir, io, id)?;
            let path = seg.path.clone();
            let map = SegMap::map(io, &seg, &file, &path, HEADER_LEN as u64, segment_size)?;
            r.version.segs.push(Some(Mapped {
                map,
                end: HEADER_LEN as u64,
            }));
            zeroed = HEADER_LEN as u64;
            r.stats.insert(
                id,
                SegStat {
                    size: HEADER_LEN as u64,
                    live: 0,
                },
            );
            Active {
                seg,
                file: Arc::new(file),
                end: HEADER_LEN as u64,
                fresh: true,
                dirty: false,
            }
        }
    };
    let mut names = BTreeMap::new();
    for (id, b) in r.names.iter().enumerate() {
        names.insert(b.clone(), id as u32);
    }
    r.version.names = Arc::new(names);
    Ok(Recovered {
        version: r.version,
        stats: r.stats,
        active,
        next_seq,
        durable_seq: next_seq - 1,
        bucket_names: r.names,
        zeroed,
    })
}

/// True when the last segment is shorter than a header or its header is all zeros.
fn torn_creation(file: &File, path: &Path, size: u64) -> Result<bool, BackendError> {
    if size < HEADER_LEN as u64 {
        return Ok(true);
    }
    let mut h = [0u8; HEADER_LEN];
    std::os::unix::fs::FileExt::read_exact_at(file, &mut h, 0)
        .map_err(|e| BackendError::io(path, "read", e))?;
    Ok(h.iter().all(|&b| b == 0))
}

struct Replay {
    version: Version,
    stats: BTreeMap<u32, SegStat>,
    names: Vec<Bucket>,
    expected_seq: Option<u64>,
}

impl Replay {
    /// Replays the frames of one segment of format `version`; returns the end of its last
    /// valid frame and the number of frames.
    fn replay_segment(
        &mut self,
        id: u32,
        path: &Path,
        bytes: &[u8],
        version: u32,
        last: bool,
    ) -> Result<(u64, u64), BackendError> {
        let header = format::frame_header_len(version);
        let mut at = HEADER_LEN;
        let mut frames = 0;
        while at < bytes.len() {
            let rest = &bytes[at..];
            let why = match format::read_frame(rest, header) {
                Err(why) => why,
                Ok(frame) => {
                    // A whole frame with a valid checksum is never the product of a torn
                    // write: a frame out of sequence means frames or segments went missing.
                    if let Some(e) = self.expected_seq.filter(|&e| e != frame.seq) {
                        return Err(corrupt(
                            path,
                            at as u64,
                            format!("frame sequence {} where {e} was expected", frame.seq),
                        ));
                    }
                    // This build never writes the largest sequence number (no sequence could
                    // follow it): only damage or a foreign writer puts it there.
                    let Some(next) = frame.seq.checked_add(1) else {
                        return Err(corrupt(
                            path,
                            at as u64,
                            format!("frame sequence {} is out of range", frame.seq),
                        ));
                    };
                    if let Some(d) = frame.durable.filter(|&d| d >= frame.seq) {
                        return Err(corrupt(
                            path,
                            at as u64,
                            format!(
                                "frame {} claims sequence {d} durable before it was written",
                                frame.seq
                            ),
                        ));
                    }
                    self.apply_payload(id, path, at + frame.header, frame.payload)?;
                    self.expected_seq = Some(next);
                    at += frame.len();
                    frames += 1;
                    continue;
                }
            };
            if rest.iter().all(|&b| b == 0) {
                // Zeros prepared ahead of the writer: the segment's log ends here.
                return Ok((at as u64, frames));
            }
            if !last {
                return Err(corrupt(path, at as u64, why));
            }
            if version >= VERSION {
                match durable_frame_after(bytes, at, self.expected_seq) {
                    Scan::Durable {
                        offset,
                        seq,
                        durable,
                    } => {
                        // Written after this frame was durable: this frame was whole once.
                        return Err(corrupt(
                            path,
                            at as u64,
                            format!(
                                "{why}, in a frame that was durable: the frame at offset \
                                 {offset} (sequence {seq}) was written once sequence {durable} \
                                 was"
                            ),
                        ));
                    }
                    Scan::GaveUp(checked) => {
                        // Changing nothing is safe; cutting off a frame that was durable
                        // is not.
                        return Err(corrupt(
                            path,
                            at as u64,
                            format!(
                                "{why}; the scan for later frames that would show it durable \
                                 stopped after {checked} bytes, so it is not known to be a \
                                 torn commit"
                            ),
                        ));
                    }
                    Scan::Torn => {}
                }
            }
            tracing::warn!(path = %path.display(), offset = at, reason = %why, "torn tail");
            return Ok((at as u64, frames));
        }
        Ok((at as u64, frames))
    }

    fn apply_payload(
        &mut self,
        seg: u32,
        path: &Path,
        base: usize,
        payload: &[u8],
    ) -> Result<(), BackendError> {
        let mut records = Records::new(payload);
        loop {
            let (at, rec) = match records.next_record() {
                Ok(Some(r)) => r,
                Ok(None) => return Ok(()),
                Err(why) => return Err(corrupt(path, base as u64, why)),
            };
            let offset = (base + at) as u64;
            let known = self.names.len() as u32;
            let check = |b: u32| {
                if b < known {
                    Ok(b)
                } else {
                    Err(corrupt(
                        path,
                        offset,
                        format!("record names undeclared bucket {b}"),
                    ))
                }
            };
            match rec {
                Record::Bucket { id, name } => {
                    let name = std::str::from_utf8(name)
                        .ok()
                        .and_then(|n| Bucket::from_name(n.to_owned()).ok())
                        .ok_or_else(|| corrupt(path, offset, "invalid bucket name"))?;
                    if id == known {
                        self.names.push(name);
                        self.version.maps.push(Default::default());
                    } else if id > known || self.names[id as usize] != name {
                        return Err(corrupt(
                            path,
                            offset,
                            format!(
                                "bucket {id} declared as {name} conflicts with earlier records"
                            ),
                        ));
                    }
                }
                Record::Put {
                    bucket,
                    key,
                    value_at,
                    value_len,
                } => {
                    let b = check(bucket)?;
                    let off = u32::try_from(base + value_at)
                        .map_err(|_| corrupt(path, offset, "value offset out of range"))?;
                    let loc = Loc {
                        seg,
                        off,
                        len: value_len,
                    };
                    self.applier().put(b, key, loc);
                }
                Record::Delete { bucket, key } => {
                    let b = check(bucket)?;
                    self.applier().delete(b, key);
                }
                Record::Range { bucket, start, end } => {
                    let b = check(bucket)?;
                    self.applier().delete_range(b, start, end);
                }
            }
        }
    }

    fn applier(&mut self) -> Applier<'_> {
        Applier {
            maps: &mut self.version.maps,
            stats: &mut self.stats,
        }
    }
}

/// How many times the bytes from the bad place to the end of the segment the scan past it
/// may checksum (and look through for zeros) before it gives up.
const SCAN_BUDGET: u64 = 4;

/// What the scan past a bad place of the last segment found.
#[derive(Debug, PartialEq, Eq)]
enum Scan {
    /// A frame written after the bad frame was durable, at this offset with this sequence
    /// number and durable field, and the frames after it chaining up to the end.
    Durable {
        offset: usize,
        seq: u64,
        durable: u64,
    },
    /// No such frame: a torn commit.
    Torn,
    /// The budget ran out after this many bytes, before the scan could tell.
    GaveUp(u64),
}

/// Looks past the bad place at `at` of a version-3 segment's `bytes`, where the frame of
/// sequence `expected` was due (`None`: no frame came before it), for a later whole frame
/// written after that frame was durable: a sequence number above it (by no more than frames
/// fit in the bytes from `at`) and a durable field at or above it, a matching checksum, a
/// payload of well-formed records, and after it only frames of the same kind with the next
/// sequence numbers, up to zeros or the end of the file. Every later offset is tried, since a
/// damaged length says nothing of where the next frame starts; the checksum is computed only
/// for headers that pass those bounds, and no more than [`SCAN_BUDGET`] times the bytes from
/// `at` are checksummed or looked through for zeros in all.
///
/// Only run on the error path of open, for the last segment.
fn durable_frame_after(bytes: &[u8], at: usize, expected: Option<u64>) -> Scan {
    let left = (bytes.len() - at) as u64;
    let mut budget = left.saturating_mul(SCAN_BUDGET);
    let most_frames = left / FRAME_HEADER as u64;
    for p in at + 1..bytes.len().saturating_sub(FRAME_HEADER - 1) {
        let rest = &bytes[p..];
        let seq = u64_at(rest, 8);
        let durable = u64_at(rest, 16);
        // The bad frame's sequence number; with no frame before it, the most it can be.
        let Some(bad) = expected.or_else(|| seq.checked_sub(1).filter(|&b| b > 0)) else {
            continue;
        };
        let plausible = seq > bad
            && seq - bad <= most_frames
            && durable >= bad
            && durable < seq
            && u32_at(rest, 0) as usize <= rest.len() - FRAME_HEADER;
        if !plausible {
            continue;
        }
        match chains_to_end(bytes, p, &mut budget) {
            Some(true) => {
                return Scan::Durable {
                    offset: p,
                    seq,
                    durable,
                };
            }
            Some(false) => {}
            None => return Scan::GaveUp(left.saturating_mul(SCAN_BUDGET)),
        }
    }
    Scan::Torn
}

/// Whether `bytes` hold, from `p` on, whole version-3 frames with matching checksums, payloads
/// of well-formed records, durable fields below their sequence numbers and consecutive
/// sequence numbers, then only zeros up to the end (or nothing). Every byte checksummed or
/// looked through for zeros is taken from `budget`; `None` when it runs out.
fn chains_to_end(bytes: &[u8], mut p: usize, budget: &mut u64) -> Option<bool> {
    let mut prev: Option<u64> = None;
    loop {
        let rest = &bytes[p..];
        if prev.is_some() {
            let zeros = rest.iter().take_while(|&&b| b == 0).count();
            *budget = budget.checked_sub(zeros as u64)?;
            if zeros == rest.len() {
                return Some(true);
            }
        }
        if rest.len() < FRAME_HEADER {
            return Some(false);
        }
        let len = u32_at(rest, 0) as usize;
        let seq = u64_at(rest, 8);
        let durable = u64_at(rest, 16);
        let follows = prev.is_none_or(|s| s.checked_add(1) == Some(seq));
        if !follows || durable >= seq || len > rest.len() - FRAME_HEADER {
            return Some(false);
        }
        *budget = budget.checked_sub((FRAME_HEADER - 8 + len) as u64)?;
        let Ok(frame) = format::read_frame(rest, FRAME_HEADER) else {
            return Some(false);
        };
        let mut records = Records::new(frame.payload);
        loop {
            match records.next_record() {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(_) => return Some(false),
            }
        }
        prev = Some(seq);
        p += frame.len();
    }
}
