//! Writing records: the active segment's buffered writer, which frames records into an
//! in-memory buffer, keeps the crc chain, and writes the buffer out with positioned writes.

use std::io::{self, IoSlice};
use std::path::PathBuf;
use std::sync::Arc;

use crate::io::{WalFile, write_all_at, write_all_vectored_at};
use crate::record::{
    self, ENTRY_PREFIX, Entry, HEADER_LEN, HardState, Metadata, SnapshotMarker, padded,
};

/// Ends the records of every write: a record header of zeros.
const END_MARK: [u8; 8] = [0; 8];
/// Bytes of an entry record before its data.
const HEAD: usize = HEADER_LEN + ENTRY_PREFIX;

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
    /// Scratch for [`SegmentWriter::write_entries`]: the framing around entry data.
    pub side: Vec<u8>,
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

    /// Frames `entries` (and a hard state after them) and writes them at once, behind the
    /// buffered records and followed by an end marker (when it fits), in one vectored write
    /// (split at `IOV_MAX` buffers) that takes each entry's data straight from its own
    /// buffer: only the 24 bytes before each entry's data and its padding are framed in a
    /// side buffer, and each crc is computed over the data where it lies. `locs` receives
    /// each entry's (offset, crc seed). Not synced. On an error nothing changes but the
    /// file's contents past the written records (the caller poisons the log).
    pub(crate) fn write_entries(
        &mut self,
        entries: &[Entry],
        hs: Option<&HardState>,
        locs: &mut Vec<(u64, u32)>,
    ) -> io::Result<()> {
        let mut side = std::mem::take(&mut self.side);
        side.clear();
        locs.clear();
        let mut crc = self.crc;
        let mut at = self.end();
        // Per entry: the previous entry's padding, then this entry's header and prefix.
        let mut pad = 0;
        for e in entries {
            side.extend_from_slice(&END_MARK[..pad]);
            let (head, next) = record::entry_head(e, crc);
            side.extend_from_slice(&head);
            locs.push((at, crc));
            crc = next;
            let len = ENTRY_PREFIX + e.data.len();
            pad = padded(len) - len;
            at += (HEADER_LEN + padded(len)) as u64;
        }
        let tail = side.len();
        side.extend_from_slice(&END_MARK[..pad]);
        if let Some(hs) = hs {
            crc = record::encode_hard_state(&mut side, hs, crc);
        }
        let end = at + (side.len() - tail - pad) as u64;
        if end + END_MARK.len() as u64 <= self.size {
            side.extend_from_slice(&END_MARK);
        }
        let mut iov = Vec::with_capacity(2 * entries.len() + 2);
        if !self.buf.is_empty() {
            iov.push(IoSlice::new(&self.buf));
        }
        let mut from = 0;
        let mut pad = 0;
        for e in entries {
            iov.push(IoSlice::new(&side[from..from + pad + HEAD]));
            from += pad + HEAD;
            iov.push(IoSlice::new(&e.data));
            let len = ENTRY_PREFIX + e.data.len();
            pad = padded(len) - len;
        }
        iov.push(IoSlice::new(&side[from..]));
        let res = write_all_vectored_at(&*self.file, &mut iov, self.flushed);
        drop(iov);
        self.side = side;
        res?;
        self.flushed = end;
        self.buf.clear();
        self.crc = crc;
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
