//! Writing records: the active segment's buffered writer, which frames records into an
//! in-memory buffer, keeps the crc chain, and writes the buffer out with positioned writes.
//!
//! A write that a sync follows goes out as a direct write where the file system allows
//! (`O_DIRECT`, [`SegmentWriter::flush_direct`]): whole pages, starting with the bytes
//! already in the file from the last page boundary and ending with zeros, so the kernel
//! neither copies the records into the page cache nor has them to write back inside
//! `fdatasync`, which is left with the disk's cache flush. The write buffer keeps those
//! first bytes in front of the records, at a page-aligned address (the start of a huge page
//! where the kernel gives one, see `pagebuf`), so the pages go out straight from it.
//! Rewriting a page's first bytes with the same bytes leaves them as they were whatever part
//! of the write reaches the disk.

use std::io::{self, IoSlice};
use std::path::PathBuf;
use std::sync::Arc;

use crate::index::Loc;
use crate::io::{DIRECT_ALIGN, WalFile, read_full_at, write_all_at, write_all_vectored_at};
use crate::pagebuf::PageBuf;
use crate::record::{
    self, ENTRY_PREFIX, Entry, HEADER_LEN, HardState, Metadata, SnapshotMarker, padded,
};
use crate::segment::{BATCH_VERSION, SEGMENT_HEADER_LEN, Writes, encode_header_version};

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
    /// `lead` bytes that are not records, then the encoded records not yet written (they
    /// go at `flushed`). `buf[file_from..]` are the file's bytes up to the end of the
    /// records: when they reach back to the page boundary below `flushed`, at a page-aligned
    /// address (as [`SegmentWriter::rebase`] leaves them), a direct write of those pages
    /// goes straight from this buffer.
    buf: PageBuf,
    /// Where the records start in `buf`.
    lead: usize,
    /// Where the file's bytes start in `buf` (see `buf`).
    file_from: usize,
    /// File offset up to which records have been written.
    pub flushed: u64,
    /// Crc of the last record encoded (seed of the next).
    pub crc: u32,
    /// Size the segment was prepared with; the log rotates before an append would cross it.
    pub size: u64,
    /// Offset where the segment's own records (after seed and state records) begin; for the
    /// segment appends continue at open, where they would begin in a segment started with
    /// the state in force. An append that does not fit starts a new segment only past it.
    pub data_start: u64,
    /// Scratch for [`SegmentWriter::write_entries`]: the framing around entry data.
    pub side: Vec<u8>,
    /// The segment opened for direct writes, if the file system allows them.
    pub direct: Option<Arc<dyn WalFile>>,
    /// Scratch for the direct writes `buf` cannot serve in place, aligned in place.
    pages: Vec<u8>,
    /// Format version of the segment: its records are written in that version's format.
    pub version: u32,
}

/// Room the write buffer makes when it starts over after a write: one huge page's worth
/// (see `pagebuf`), so appends up to about that size are written from a single page.
const BUF_RESERVE: usize = 2 << 20;
/// A write buffer grown past this by a large append is given back when it starts over.
const BUF_KEEP: usize = 8 << 20;

/// What a segment writer starts from.
pub(crate) struct WriterStart {
    /// Sequence number of the segment.
    pub seq: u64,
    /// Its path.
    pub path: PathBuf,
    /// Its file.
    pub file: Arc<dyn WalFile>,
    /// The segment opened for direct writes, if the file system allows them.
    pub direct: Option<Arc<dyn WalFile>>,
    /// Offset of the next record.
    pub end: u64,
    /// Crc of the last record in the segment (0 for a new one).
    pub crc: u32,
    /// Size the segment was prepared with.
    pub size: u64,
    /// Format version of the segment.
    pub version: u32,
}

impl SegmentWriter {
    /// A writer appending at `start.end`.
    pub(crate) fn new(start: WriterStart) -> SegmentWriter {
        let mut w = SegmentWriter::bare(start);
        w.after_header();
        w
    }

    /// [`new`](Self::new) before it looks at where it starts.
    fn bare(start: WriterStart) -> SegmentWriter {
        SegmentWriter {
            seq: start.seq,
            path: start.path,
            file: start.file,
            buf: PageBuf::default(),
            lead: 0,
            file_from: 0,
            flushed: start.end,
            crc: start.crc,
            size: start.size,
            data_start: start.end,
            side: Vec::new(),
            direct: start.direct,
            pages: Vec::new(),
            version: start.version,
        }
    }

    /// Starts over on another segment (after a rotation), keeping the buffers' memory.
    pub(crate) fn restart(&mut self, start: WriterStart) {
        let mut next = SegmentWriter::bare(start);
        next.buf = std::mem::take(&mut self.buf);
        next.side = std::mem::take(&mut self.side);
        next.pages = std::mem::take(&mut self.pages);
        next.buf.clear();
        *self = next;
        self.after_header();
    }

    /// How appends write this segment, and so most likely the next one.
    pub(crate) fn writes(&self) -> Writes {
        if self.direct.is_some() {
            Writes::Direct
        } else {
            Writes::Cached
        }
    }

    /// Offset of the next record.
    pub(crate) fn end(&self) -> u64 {
        self.flushed + self.pending() as u64
    }

    /// Bytes of records encoded and not yet written.
    pub(crate) fn pending(&self) -> usize {
        self.buf.len() - self.lead
    }

    /// Writes the buffered records to the file (not synced), followed by an end marker (a
    /// zero record header, overwritten by the next write) when it fits in the segment.
    pub(crate) fn flush(&mut self) -> io::Result<()> {
        let n = self.pending();
        if n == 0 {
            return Ok(());
        }
        let end = self.buf.len();
        let marked = self.end() + END_MARK.len() as u64 <= self.size;
        if marked {
            self.buf.extend_from_slice(&END_MARK);
        }
        let res = write_all_at(&*self.file, &self.buf[self.lead..], self.flushed);
        self.buf.truncate(end);
        res?;
        self.flushed += n as u64;
        self.rebase();
        Ok(())
    }

    /// Once everything in the buffer is written: starts it over with the file's bytes from
    /// the page boundary below `flushed` (when it holds them and direct writes are on) at a
    /// page-aligned address.
    fn rebase(&mut self) {
        let keep = (self.flushed % DIRECT_ALIGN as u64) as usize;
        if self.direct.is_none() || keep > self.buf.len() - self.file_from {
            self.buf.clear();
            self.lead = 0;
            self.file_from = 0;
            return;
        }
        let mut tail = [0u8; DIRECT_ALIGN];
        tail[..keep].copy_from_slice(&self.buf[self.buf.len() - keep..]);
        self.start_page(&tail[..keep]);
    }

    /// Starts the buffer over with `head`, the file's bytes from the page boundary below
    /// `flushed`, at a page-aligned address.
    fn start_page(&mut self, head: &[u8]) {
        if self.buf.capacity() > BUF_KEEP {
            // Grown by a large append: given back.
            self.buf = PageBuf::default();
        }
        self.buf.clear();
        self.buf.reserve(BUF_RESERVE);
        let pad = self.buf.as_ptr().align_offset(DIRECT_ALIGN);
        self.buf.resize(pad, 0);
        self.buf.extend_from_slice(head);
        self.file_from = pad;
        self.lead = pad + head.len();
    }

    /// A writer starting right after its segment's header knows the file's bytes in front
    /// of the first record, which the first direct write rewrites: the header, as
    /// [`encode_header_version`] makes it (whoever wrote it, or open checked it). Without
    /// them that write would read them back from the file (a disk read, since a segment
    /// prepared for direct writes has no cached pages).
    fn after_header(&mut self) {
        if self.direct.is_some() && self.pending() == 0 && self.flushed == SEGMENT_HEADER_LEN {
            self.start_page(&encode_header_version(self.seq, self.version));
        }
    }

    /// [`SegmentWriter::flush`] as one direct write of whole pages; `Ok(false)` (nothing
    /// written) where there is nothing to write or a direct write cannot serve: no direct
    /// handle, the last page would pass the segment's end, or the file system refused
    /// (`EINVAL`; direct writes are then off for this segment).
    pub(crate) fn flush_direct(&mut self) -> io::Result<bool> {
        let Some(direct) = self.direct.clone() else {
            return Ok(false);
        };
        let n = self.pending();
        if n == 0 {
            return Ok(false);
        }
        let start = self.flushed - self.flushed % DIRECT_ALIGN as u64;
        let head = (self.flushed - start) as usize;
        let len = (head + n + END_MARK.len()).next_multiple_of(DIRECT_ALIGN);
        if start + len as u64 > self.size {
            return Ok(false);
        }
        let end = self.buf.len();
        let res = if self.lead - self.file_from >= head {
            // The page's first bytes are in the buffer: in place if it is aligned there.
            let from = self.lead - head;
            self.buf.resize(from + len, 0);
            let block = &self.buf[from..];
            if block.as_ptr().align_offset(DIRECT_ALIGN) == 0 {
                write_all_at(&*direct, block, start)
            } else {
                let copy = aligned(&mut self.pages, len);
                copy.copy_from_slice(block);
                write_all_at(&*direct, copy, start)
            }
        } else {
            let copy = aligned(&mut self.pages, len);
            if read_full_at(&*self.file, &mut copy[..head], start)? < head {
                return Ok(false);
            }
            copy[head..head + n].copy_from_slice(&self.buf[self.lead..]);
            copy[head + n..].fill(0);
            write_all_at(&*direct, copy, start)
        };
        self.buf.truncate(end);
        match res {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
                tracing::debug!(path = %self.path.display(), error = %e,
                    "WAL: direct write refused; writing through the page cache");
                self.direct = None;
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
        self.flushed += n as u64;
        if self.lead - self.file_from < head {
            // The page's first bytes came from the file: the buffer holds only the records.
            self.file_from = self.lead;
        }
        self.rebase();
        Ok(true)
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
        if self.pending() > 0 {
            iov.push(IoSlice::new(&self.buf[self.lead..]));
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
        self.lead = 0;
        self.file_from = 0;
        self.crc = crc;
        Ok(())
    }

    /// Makes room for `bytes` more bytes of records in the write buffer.
    pub(crate) fn reserve(&mut self, bytes: usize) {
        self.buf.reserve(bytes);
    }

    /// Encodes `entries` (consecutive indices), each run of one term that fits as a batch
    /// record (see [`record::batch_run`]) and each other entry as an entry record, and
    /// hands each entry's index and location to `each`, in order.
    pub(crate) fn entries(&mut self, entries: &[Entry], mut each: impl FnMut(u64, Loc)) {
        let batches = self.version >= BATCH_VERSION;
        let mut rest = entries;
        while !rest.is_empty() {
            let n = if batches { record::batch_run(rest) } else { 1 };
            let (run, after) = rest.split_at(n);
            rest = after;
            let at = self.end();
            let prev = self.crc;
            if n == 1 {
                let e = &run[0];
                self.crc = record::encode_entry(&mut self.buf, e, prev);
                each(
                    e.index,
                    Loc::entry(e.term, self.seq, at, e.data.len(), prev),
                );
                continue;
            }
            self.crc = record::encode_batch(&mut self.buf, run, prev);
            let len = record::batch_payload_len(run);
            let mut data_at = record::BATCH_PREFIX + 4 * n;
            for e in run {
                let loc = Loc::in_batch(e.term, self.seq, at, len, prev, data_at, e.data.len());
                data_at += e.data.len();
                each(e.index, loc);
            }
        }
    }

    pub(crate) fn seed(&mut self, prev_crc: u32, first_index: u64) {
        let chain = crate::segment::chain_seed(self.seq, self.version);
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

/// `len` bytes of `pages` at a page-aligned address (growing it as needed).
fn aligned(pages: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if pages.len() < len + DIRECT_ALIGN {
        *pages = vec![0; (len + DIRECT_ALIGN).next_power_of_two()];
    }
    let at = pages.as_ptr().align_offset(DIRECT_ALIGN);
    &mut pages[at..at + len]
}
