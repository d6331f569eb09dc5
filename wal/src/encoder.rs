//! Writing records: the active segment's buffered writer, which frames records into an
//! in-memory buffer, keeps the crc chain, and writes the buffer out with positioned writes.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use crate::io::{WalFile, write_all_at};
use crate::record::{self, Entry, HardState, Metadata, SnapshotMarker};

/// Ends the records of every write: a record header of zeros.
const END_MARK: [u8; 8] = [0; 8];

/// The segment being appended to.
#[derive(Debug)]
pub(crate) struct SegmentWriter {
    /// Sequence number of the segment.
    pub seq: u64,
    /// Its path.
    pub path: PathBuf,
    /// Its file.
    pub file: Arc<dyn WalFile>,
    /// Encoded records not yet written; they go at `flushed`.
    pub buf: Vec<u8>,
    /// File offset up to which records have been written.
    pub flushed: u64,
    /// Crc of the last record encoded (seed of the next).
    pub crc: u32,
    /// Size the segment was prepared with; the log rotates before an append would cross it.
    pub size: u64,
    /// Offset where the segment's own records (after seed and state records) begin.
    pub data_start: u64,
}

impl SegmentWriter {
    /// Offset of the next record.
    pub(crate) fn end(&self) -> u64 {
        self.flushed + self.buf.len() as u64
    }

    /// Writes the buffered records to the file (not synced), followed by an end marker (a
    /// zero record header, overwritten by the next write) when it fits in the segment.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let n = self.buf.len();
        let marked = self.end() + END_MARK.len() as u64 <= self.size;
        if marked {
            self.buf.extend_from_slice(&END_MARK);
        }
        let res = write_all_at(&*self.file, &self.buf, self.flushed);
        self.buf.truncate(n);
        res?;
        self.flushed += n as u64;
        self.buf.clear();
        Ok(())
    }

    /// Encodes an entry; returns (offset, crc seed it was chained from).
    pub(crate) fn entry(&mut self, e: &Entry) -> (u64, u32) {
        let at = self.end();
        let prev = self.crc;
        self.crc = record::encode_entry(&mut self.buf, e, prev);
        (at, prev)
    }

    pub(crate) fn seed(&mut self, prev_crc: u32, first_index: u64) {
        let chain = crate::segment::chain_seed(self.seq);
        self.crc = record::encode_seed(&mut self.buf, chain, prev_crc, first_index);
    }

    pub(crate) fn hard_state(&mut self, hs: &HardState) {
        self.crc = record::encode_hard_state(&mut self.buf, hs, self.crc);
    }

    pub(crate) fn snapshot(&mut self, m: &SnapshotMarker) {
        self.crc = record::encode_snapshot(&mut self.buf, m, self.crc);
    }

    pub(crate) fn metadata(&mut self, m: &Metadata) {
        self.crc = record::encode_metadata(&mut self.buf, m, self.crc);
    }
}
