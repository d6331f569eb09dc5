//! Reading records back: a streaming reader over one segment that verifies every record's
//! checksum against the chain before handing it out, and bounds every length by the bytes
//! left before reading or allocating.

use std::io;

use crate::io::{WalFile, read_full_at};
use crate::record::{HEADER_LEN, Header, Record, RecordType, padded, record_len};

/// The next thing in a segment.
#[derive(Debug)]
pub(crate) enum Next<'a> {
    /// A record that passed its checks.
    Record {
        /// Offset of its header in the file.
        offset: u64,
        /// Its crc: the seed of the next record.
        crc: u32,
        /// The decoded record.
        record: Record<'a>,
    },
    /// A header of zeros (the unwritten, preallocated part) or the end of the range.
    End {
        /// Offset where the written part ends.
        offset: u64,
    },
    /// Something that is not a valid record.
    Bad {
        /// Offset of the bad record's header.
        offset: u64,
        /// What check failed.
        reason: String,
    },
    /// A whole record (its checksum holds) that cannot be: a batch whose lengths do not add
    /// up, or a batch in a segment of a version without them. Never a torn write.
    Invalid {
        /// Offset of the record's header.
        offset: u64,
        /// What is wrong with it.
        reason: String,
    },
}

/// Reads the records of `[from, limit)` of a file in chunks of about `chunk` bytes.
pub(crate) struct SegmentReader<'f> {
    file: &'f dyn WalFile,
    limit: u64,
    buf: Vec<u8>,
    buf_off: u64,
    start: usize,
    end: usize,
    chunk: usize,
    /// Whether batch records may appear (the segment's version has them).
    batches: bool,
}

impl<'f> SegmentReader<'f> {
    pub(crate) fn new(file: &'f dyn WalFile, from: u64, limit: u64, chunk: usize) -> Self {
        Self::with_buffer(file, from, limit, chunk, Vec::new())
    }

    /// Like [`SegmentReader::new`], reusing `buf`'s allocation.
    pub(crate) fn with_buffer(
        file: &'f dyn WalFile,
        from: u64,
        limit: u64,
        chunk: usize,
        buf: Vec<u8>,
    ) -> Self {
        SegmentReader {
            file,
            limit,
            buf,
            buf_off: from,
            start: 0,
            end: 0,
            chunk: chunk.max(4096),
            batches: true,
        }
    }

    /// Whether batch records may appear: false for a segment of a version without them,
    /// where one is [`Next::Invalid`]. Default: true.
    pub(crate) fn allow_batches(&mut self, allow: bool) {
        self.batches = allow;
    }

    /// Gives the buffer back for reuse.
    pub(crate) fn into_buffer(self) -> Vec<u8> {
        self.buf
    }

    /// File offset of the next record.
    pub(crate) fn position(&self) -> u64 {
        self.buf_off + self.start as u64
    }

    /// Makes at least `n` bytes available from `start` (the caller checked they exist before
    /// `limit`); returns false if the file is shorter than it said.
    fn ensure(&mut self, n: usize) -> io::Result<bool> {
        if self.end - self.start >= n {
            return Ok(true);
        }
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.buf_off += self.start as u64;
            self.end -= self.start;
            self.start = 0;
        }
        let left_in_range = self.limit - self.buf_off - self.end as u64;
        let want = n
            .max(self.chunk)
            .min(self.end + left_in_range as usize)
            .max(n);
        if self.buf.len() < want {
            self.buf.resize(want, 0);
        }
        let to_read = (want - self.end).min(left_in_range as usize);
        let got = read_full_at(
            self.file,
            &mut self.buf[self.end..self.end + to_read],
            self.buf_off + self.end as u64,
        )?;
        self.end += got;
        Ok(self.end - self.start >= n)
    }

    /// Reads and checks the next record, whose crc must chain from `prev_crc`.
    pub(crate) fn next(&mut self, prev_crc: u32) -> io::Result<Next<'_>> {
        let offset = self.position();
        let left = self.limit.saturating_sub(offset);
        if left == 0 {
            return Ok(Next::End { offset });
        }
        if left < HEADER_LEN as u64 {
            if !self.ensure(left as usize)? {
                return Ok(Next::Bad {
                    offset,
                    reason: "file shorter than its length".into(),
                });
            }
            let rest = &self.buf[self.start..self.start + left as usize];
            return Ok(if rest.iter().all(|&b| b == 0) {
                Next::End { offset }
            } else {
                Next::Bad {
                    offset,
                    reason: "partial record header at the end of the file".into(),
                }
            });
        }
        if !self.ensure(HEADER_LEN)? {
            return Ok(Next::Bad {
                offset,
                reason: "file shorter than its length".into(),
            });
        }
        let header = Header::parse(&self.buf[self.start..self.start + HEADER_LEN]);
        if header.is_zero() {
            return Ok(Next::End { offset });
        }
        let ty = match header.checked_type() {
            Ok(t) => t,
            Err(reason) => return Ok(Next::Bad { offset, reason }),
        };
        let plen = header.payload_len();
        let len = record_len(plen);
        if len as u64 > left {
            return Ok(Next::Bad {
                offset,
                reason: format!("record length {len} runs past the end ({left} bytes left)"),
            });
        }
        if !self.ensure(len)? {
            return Ok(Next::Bad {
                offset,
                reason: "file shorter than its length".into(),
            });
        }
        let body = self.start + HEADER_LEN;
        if !header.verify(prev_crc, &self.buf[self.start + 4..body + plen]) {
            return Ok(Next::Bad {
                offset,
                reason: "record checksum mismatch".into(),
            });
        }
        if self.buf[body + plen..body + padded(plen)]
            .iter()
            .any(|&b| b != 0)
        {
            return Ok(Next::Bad {
                offset,
                reason: "non-zero record padding".into(),
            });
        }
        if ty == RecordType::Batch && !self.batches {
            return Ok(Next::Invalid {
                offset,
                reason: "batch record in a segment of a format version without them".into(),
            });
        }
        let payload = &self.buf[body..body + plen];
        let record = match Record::decode(ty, payload) {
            Ok(r) => r,
            Err(reason) => return Ok(Next::Invalid { offset, reason }),
        };
        self.start += len;
        Ok(Next::Record {
            offset,
            crc: header.crc,
            record,
        })
    }
}
