//! The in-memory index of the log: for every entry held, where its record is and its term;
//! and the Raft rules (conflict truncation, snapshot markers, release) applied to it, the same
//! way when appending and when replaying at open.

use std::collections::VecDeque;

use crate::record::SnapshotMarker;

/// Where an entry is: its record (an entry record, or a batch record it shares with the
/// entries around it) and its data in that record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Loc {
    /// Term of the entry.
    pub term: u64,
    /// Segment sequence number.
    pub seq: u64,
    /// Offset of the record header in the segment.
    pub offset: u64,
    /// Payload length of the record.
    pub len: u32,
    /// Crc of the record before it (the chain seed to verify it).
    pub prev_crc: u32,
    /// Offset of the entry's data in the record's payload.
    pub data_at: u32,
    /// Bytes of entry data.
    pub data_len: u32,
}

impl Loc {
    /// An entry with a record of its own.
    pub(crate) fn entry(term: u64, seq: u64, offset: u64, data_len: usize, prev_crc: u32) -> Loc {
        let prefix = crate::record::ENTRY_PREFIX;
        Loc {
            term,
            seq,
            offset,
            len: (prefix + data_len) as u32,
            prev_crc,
            data_at: prefix as u32,
            data_len: data_len as u32,
        }
    }

    /// An entry of a batch record of `payload_len` bytes, its data at `data_at` of the
    /// payload.
    pub(crate) fn in_batch(
        term: u64,
        seq: u64,
        offset: u64,
        payload_len: usize,
        prev_crc: u32,
        data_at: usize,
        data_len: usize,
    ) -> Loc {
        Loc {
            term,
            seq,
            offset,
            len: payload_len as u32,
            prev_crc,
            data_at: data_at as u32,
            data_len: data_len as u32,
        }
    }

    /// Offset just past the record.
    pub(crate) fn end(&self) -> u64 {
        self.offset + crate::record::record_len(self.len as usize) as u64
    }

    /// Bytes of entry data.
    pub(crate) fn data_len(&self) -> u64 {
        u64::from(self.data_len)
    }
}

/// Entries `[base, base + locs.len())`.
#[derive(Debug)]
pub(crate) struct LogIndex {
    base: u64,
    locs: VecDeque<Loc>,
}

impl LogIndex {
    pub(crate) fn new(base: u64) -> LogIndex {
        LogIndex {
            base: base.max(1),
            locs: VecDeque::new(),
        }
    }

    /// First index held (or the one the next append would have if none is held).
    pub(crate) fn first(&self) -> u64 {
        self.base
    }

    /// Last index held (`first() - 1` if none).
    pub(crate) fn last(&self) -> u64 {
        self.base + self.locs.len() as u64 - 1
    }

    pub(crate) fn get(&self, index: u64) -> Option<&Loc> {
        let i = index.checked_sub(self.base)?;
        self.locs.get(usize::try_from(i).ok()?)
    }

    /// Records entry `index` at `loc`: an index at or below the last replaces that suffix;
    /// an index below the first held restarts the log there. Refuses a gap after the last
    /// (returns the last index).
    pub(crate) fn push(&mut self, index: u64, loc: Loc) -> Result<(), u64> {
        if index > self.last() + 1 {
            return Err(self.last());
        }
        if index < self.base {
            self.locs.clear();
            self.base = index;
        } else {
            self.locs.truncate((index - self.base) as usize);
        }
        self.locs.push_back(loc);
        Ok(())
    }

    /// Drops entries at or below the marker; if the marker is past the last entry, the log
    /// restarts after it.
    pub(crate) fn apply_snapshot(&mut self, m: &SnapshotMarker) {
        if m.index >= self.last() {
            self.locs.clear();
            self.base = m.index + 1;
        } else {
            while self.base <= m.index {
                self.locs.pop_front();
                self.base += 1;
            }
        }
    }

    /// Drops the leading entries stored in segments below `seq`.
    pub(crate) fn release_below(&mut self, seq: u64) {
        // Segments hold ascending indices: the entries below `seq` are a prefix.
        let n = self.locs.partition_point(|l| l.seq < seq);
        self.locs.drain(..n);
        self.base += n as u64;
    }

    /// Locations of `[lo, hi)` (the caller checked the range is held).
    pub(crate) fn range(&self, lo: u64, hi: u64) -> impl Iterator<Item = &Loc> {
        let a = (lo - self.base) as usize;
        let b = (hi - self.base) as usize;
        self.locs.range(a..b)
    }
}
