//! The backend-independent snapshot stream.
//!
//! A consistent copy of a whole backend, written by [`fn@write`] from one [`ReadTxn`] and loaded
//! by [`restore`]. All integers are little-endian.
//!
//! ```text
//! header  = "KEELSNAP" (8 bytes) | version u32 (= 1) | flags u32 (= 0)
//! frame   = bucket | pair | end
//! bucket  = 0x01 | name_len u16 | name            -- pairs that follow belong to it
//! pair    = 0x02 | key_len u32 | value_len u32 | key | value
//! end     = 0xFF | pairs u64 | crc u32
//! ```
//!
//! Buckets appear in ascending name order, each once; pairs within a bucket in strictly
//! ascending key order. `crc` is CRC-32 (IEEE, as computed by `crc32fast`)
//! over every byte of the stream before the `crc` field itself. A key may be at most
//! [`MAX_KEY`] bytes and a value at most [`MAX_VALUE`] bytes; a reader rejects larger lengths
//! before allocating. Nothing may follow the end frame.

use std::io::{self, Read, Write};
use std::sync::Arc;

use super::{
    Backend, BackendError, BatchOpRef, BatchSource, Bucket, ChunkSource, ReadTxn, WriteBatch,
};

/// Stream magic.
pub const MAGIC: &[u8; 8] = b"KEELSNAP";
/// Stream format version written and read by this build.
pub const VERSION: u32 = 1;
/// Largest key a stream may carry.
pub const MAX_KEY: usize = 1 << 20;
/// Largest value a stream may carry.
pub const MAX_VALUE: usize = 64 << 20;

const TAG_BUCKET: u8 = 0x01;
const TAG_PAIR: u8 = 0x02;
const TAG_END: u8 = 0xFF;

/// [`restore`] commits a batch once it holds this many payload bytes.
pub const RESTORE_BATCH_BYTES: usize = 8 << 20;
/// ... or this many pairs.
pub const RESTORE_BATCH_PAIRS: usize = 50_000;

/// Writes the whole content visible to `txn` to `out` in the format above; returns the bytes
/// written. The stream's checksum is computed here, over each piece as it is written; a sink
/// that checksums the bytes anyway (a transport sending them in checksummed chunks) should
/// use [`write_checksummed`] instead, so that the stream is hashed once.
pub fn write<T: ReadTxn + ?Sized>(txn: &T, out: &mut dyn Write) -> Result<u64, BackendError> {
    write_checksummed(
        txn,
        &mut HashingWriter {
            out,
            crc: crc32fast::Hasher::new(),
        },
    )
}

/// A sink that keeps the CRC-32 of every byte written to it, for [`write_checksummed`].
pub trait ChecksummedWrite: Write {
    /// CRC-32 (IEEE, as computed by `crc32fast`) of every byte written so far.
    fn crc(&mut self) -> u32;
}

/// As [`fn@write`], taking the stream's checksum from the sink ([`ChecksummedWrite::crc`],
/// asked once, just before the `crc` field is written) instead of hashing the stream itself.
pub fn write_checksummed<T: ReadTxn + ?Sized>(
    txn: &T,
    out: &mut dyn ChecksummedWrite,
) -> Result<u64, BackendError> {
    let mut w = CountingWriter { out, written: 0 };
    let mut header = [0u8; 16];
    header[..8].copy_from_slice(MAGIC);
    header[8..12].copy_from_slice(&VERSION.to_le_bytes());
    w.put(&header)?;
    let mut pairs = 0u64;
    for bucket in txn.buckets()? {
        let name = bucket.name().as_bytes();
        w.put(&[TAG_BUCKET])?;
        w.put(&(name.len() as u16).to_le_bytes())?;
        w.put(name)?;
        for item in txn.range(&bucket, &[], None)? {
            let (key, value) = item?;
            if key.len() > MAX_KEY || value.len() > MAX_VALUE {
                return Err(BackendError::TooLarge {
                    what: if key.len() > MAX_KEY { "key" } else { "value" },
                    len: key.len().max(value.len()),
                    limit: if key.len() > MAX_KEY {
                        MAX_KEY
                    } else {
                        MAX_VALUE
                    },
                });
            }
            let mut frame = [0u8; 9];
            frame[0] = TAG_PAIR;
            frame[1..5].copy_from_slice(&(key.len() as u32).to_le_bytes());
            frame[5..9].copy_from_slice(&(value.len() as u32).to_le_bytes());
            w.put(&frame)?;
            w.put(key)?;
            w.put(value)?;
            pairs += 1;
        }
    }
    let mut end = [0u8; 9];
    end[0] = TAG_END;
    end[1..].copy_from_slice(&pairs.to_le_bytes());
    w.put(&end)?;
    let crc = w.out.crc();
    w.put(&crc.to_le_bytes())?;
    w.out.flush().map_err(|e| stream_io(w.written, e))?;
    Ok(w.written)
}

/// Loads a stream into `backend`, which must hold no data; returns the number of pairs loaded.
///
/// Every frame is checked as it arrives (lengths bounded before allocation, ordering, tags),
/// and the checksum at the end. The pairs are committed with [`Backend::commit`] in batches
/// (see [`restore_with`]). On error the backend holds a partial copy: discard it.
pub fn restore<B: Backend>(backend: &B, input: &mut dyn Read) -> Result<u64, BackendError> {
    if !backend.read_txn()?.buckets()?.is_empty() {
        return Err(BackendError::RestoreNotEmpty);
    }
    restore_from(input, |batch| backend.commit_from(batch))
}

/// Parses and checks a stream, handing its pairs to `apply` in batches; returns the number of
/// pairs. This is the parser behind [`restore`], for backends that load a stream their own way
/// (without a sync per batch, say, or with an append-only insert).
///
/// What `apply` receives:
///
/// - batches of [`BatchOp::Put`](super::BatchOp::Put) only, each of at most
///   [`RESTORE_BATCH_BYTES`] payload bytes (plus one pair) and [`RESTORE_BATCH_PAIRS`] pairs;
/// - across all batches, every pair of the stream exactly once, in stream order: buckets in
///   ascending name order, and within a bucket keys strictly ascending. So the sequence of
///   `(bucket, key)` is strictly ascending, and a backend may insert it with an
///   append-at-the-end operation (LMDB's `MDB_APPEND`);
/// - the **last** batch only after the end frame, pair count and checksum have been verified
///   and nothing follows the end frame. A stream that ends early or fails its checksum never
///   reaches that call, so a backend may treat the last call, or `restore_with` returning
///   `Ok`, as the point where the copy is known to be whole (the right moment for one final
///   sync). A stream with no pairs makes no call at all.
///
/// An error from `apply` stops the parse and is returned as is. It does not check that the
/// target is empty: that is the caller's business (see [`BackendError::RestoreNotEmpty`]).
///
/// Each batch is copied into a [`WriteBatch`]; [`restore_from`] hands out the same batches
/// without copying them.
pub fn restore_with<F>(input: &mut dyn Read, mut apply: F) -> Result<u64, BackendError>
where
    F: FnMut(&WriteBatch) -> Result<(), BackendError>,
{
    let mut batch = WriteBatch::new();
    restore_from(input, |pairs| {
        batch.clear();
        for (bucket, key, value) in pairs.iter() {
            batch.put(bucket, key, value);
        }
        apply(&batch)
    })
}

/// One batch of pairs handed out by [`restore_from`]: slices of the parser's read buffer,
/// valid for the call. A [`BatchSource`] of puts, for [`Backend::commit_from`].
pub struct PairBatch<'a> {
    /// The buffers the pairs sit in: one, or (a stream read from chunks, see
    /// [`restore_chunks_batched`]) the chunks and pieces the batch spans.
    bufs: &'a [&'a [u8]],
    /// For a stream read from chunks: each of `bufs` as the shared buffer it is a part of,
    /// and where in that buffer it starts (see [`PairBatch::shared`]). Empty otherwise.
    owners: &'a [(&'a Arc<Vec<u8>>, usize)],
    buckets: &'a [Bucket],
    pairs: &'a [PairAt],
}

/// Where one pair of a [`PairBatch`] sits: which of its buffers, and where in it (relative
/// to the batch's start in that buffer).
#[derive(Clone, Copy)]
struct PairAt {
    buf: u32,
    bucket: u32,
    key: u32,
    key_len: u32,
    value: u32,
    value_len: u32,
}

impl<'a> PairBatch<'a> {
    /// The pairs, in stream order: bucket, key, value.
    pub fn iter(&self) -> impl Iterator<Item = (&'a Bucket, &'a [u8], &'a [u8])> + '_ {
        let (bufs, buckets) = (self.bufs, self.buckets);
        self.pairs.iter().map(move |p| {
            let buf = bufs[p.buf as usize];
            let key = &buf[p.key as usize..(p.key + p.key_len) as usize];
            let value = &buf[p.value as usize..(p.value + p.value_len) as usize];
            (&buckets[p.bucket as usize], key, value)
        })
    }

    /// Number of pairs.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// True when the batch holds no pair (never for a batch [`restore_from`] hands out).
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// The pairs, in stream order, as places in buffers the caller may keep (by cloning the
    /// [`Arc`]) past the call: `Some` for a batch of a stream read from chunks
    /// ([`restore_chunks_batched`]), `None` for one read from a byte stream. A chunk whose
    /// `Arc` is still held elsewhere when the parser is done with it is handed back to the
    /// source ([`ChunkSource::recycle`]) only once it is no longer held (the parser looks
    /// again before each chunk it takes), or not at all if it is still held when the parse
    /// ends.
    pub fn shared(&self) -> Option<impl Iterator<Item = SharedPair<'a>> + '_> {
        if self.owners.len() != self.bufs.len() {
            return None;
        }
        let (owners, buckets) = (self.owners, self.buckets);
        Some(self.pairs.iter().map(move |p| {
            let (buf, base) = owners[p.buf as usize];
            SharedPair {
                bucket: &buckets[p.bucket as usize],
                buf,
                key_at: base + p.key as usize,
                key_len: p.key_len as usize,
                value_len: p.value_len as usize,
            }
        }))
    }
}

/// One pair of a [`PairBatch`] as a place in a shared buffer: its key is
/// `buf[key_at..key_at + key_len]` and its value follows the key right away.
pub struct SharedPair<'a> {
    /// The pair's bucket.
    pub bucket: &'a Bucket,
    /// The buffer holding the pair's key and value.
    pub buf: &'a Arc<Vec<u8>>,
    /// Offset of the key in `buf`.
    pub key_at: usize,
    /// Length of the key.
    pub key_len: usize,
    /// Length of the value, which starts at `key_at + key_len`.
    pub value_len: usize,
}

impl BatchSource for PairBatch<'_> {
    fn for_each_op(
        &self,
        sink: &mut dyn FnMut(BatchOpRef<'_>) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        self.iter()
            .try_for_each(|(bucket, key, value)| sink(BatchOpRef::Put { bucket, key, value }))
    }

    fn op_count(&self) -> usize {
        self.pairs.len()
    }
}

/// Bytes read from the input at a time.
const READ_BLOCK: usize = 1 << 20;

/// Bytes the parser hashes at a time, just before parsing them.
const HASH_BLOCK: usize = 64 << 10;

/// Where the parser's bytes come from.
enum Input<'a> {
    /// A byte stream, read into the parser's own buffer.
    Read(&'a mut dyn Read),
    /// Chunks taken by value: the parser works inside each chunk, and copies only the bytes
    /// of a read that spans two chunks (see [`restore_chunks_batched`]).
    Chunks {
        source: &'a mut dyn ChunkSource,
        /// The chunk being taken from, and its next byte.
        next: Vec<u8>,
        at: usize,
    },
}

/// A buffer left while pending pairs still sit in it (chunk input only).
struct Held {
    buf: Arc<Vec<u8>>,
    /// The offset its pending pairs' offsets are relative to.
    base: usize,
    /// A chunk of the source (handed back to it once the pairs are handed out).
    chunk: bool,
}

/// The stream being parsed: a buffer holding the pending batch's frames and what follows
/// them, with the running checksum over every byte parsed so far.
struct Parser<'a> {
    input: Input<'a>,
    /// Shared only with the batches handed out of a stream read from chunks (a byte stream's
    /// buffer is never shared, so it is written in place).
    buf: Arc<Vec<u8>>,
    /// `buf` is a chunk of the source, to be handed back when left.
    buf_is_chunk: bool,
    /// Start of the pending batch's frames in `buf`; pair offsets are relative to it.
    base: usize,
    /// Next byte to parse.
    pos: usize,
    /// End of the bytes read into `buf`.
    filled: usize,
    /// Bytes of `buf` before `hashed` are in `crc`. The parser hashes a block ahead of
    /// where it parses (see [`HASH_BLOCK`]), so `hashed` may be past `pos`.
    hashed: usize,
    crc: crc32fast::Hasher,
    /// Where the block being parsed starts in `buf` (at or before `pos` whenever `hashed` is
    /// past it), and `crc` there: the checksum up to any byte of the block is recomputed
    /// from it.
    block: (usize, crc32fast::Hasher),
    /// Stream offset of `buf[0]`.
    origin: u64,
    eof: bool,
    /// Pairs parsed and not yet handed out.
    pending: Vec<PairAt>,
    /// Buffers left behind that pending pairs sit in; `buf` is buffer `held.len()`.
    held: Vec<Held>,
    /// Chunks done with but still held by a batch's consumer, handed back to the source once
    /// they are not.
    lent: Vec<Arc<Vec<u8>>>,
}

impl Parser<'_> {
    fn offset(&self) -> u64 {
        self.origin + self.pos as u64
    }

    /// Makes `n` bytes from `pos` available, reading more input (and moving the pending
    /// batch's bytes to the front, or growing the buffer, when it is full). `n` is bounded by
    /// the caller's checks, never read from the stream unchecked.
    fn need(&mut self, n: usize) -> Result<(), BackendError> {
        if matches!(self.input, Input::Chunks { .. }) {
            return self.need_chunks(n);
        }
        while self.filled - self.pos < n {
            if self.eof {
                return Err(bad(self.offset(), "stream ends early"));
            }
            if self.buf.len() - self.filled < READ_BLOCK {
                self.hash_to(self.pos);
                self.block = (self.hashed, self.crc.clone());
                if self.base > 0 {
                    Arc::make_mut(&mut self.buf).copy_within(self.base..self.filled, 0);
                    self.origin += self.base as u64;
                    self.pos -= self.base;
                    self.filled -= self.base;
                    self.hashed -= self.base;
                    self.block.0 -= self.base;
                    self.base = 0;
                }
                let want = (self.pos + n).max(self.filled + READ_BLOCK);
                if self.buf.len() < want {
                    Arc::make_mut(&mut self.buf).resize(want.next_power_of_two(), 0);
                }
            }
            let Input::Read(input) = &mut self.input else {
                unreachable!("chunk input is handled above");
            };
            match input.read(&mut Arc::make_mut(&mut self.buf)[self.filled..]) {
                Ok(0) => self.eof = true,
                Ok(k) => self.filled += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(stream_io(self.origin + self.filled as u64, e)),
            }
        }
        Ok(())
    }

    /// [`need`](Self::need) for chunk input. When the current buffer runs out, the parser
    /// moves on to the next chunk itself if the read starts there and fits in it (no copy);
    /// otherwise the read's bytes, from the end of the current buffer and from the chunks
    /// after it, are copied into a buffer of their own. A buffer left behind is kept while
    /// pending pairs sit in it.
    fn need_chunks(&mut self, n: usize) -> Result<(), BackendError> {
        if self.filled - self.pos >= n {
            return Ok(());
        }
        self.next_chunk_with_bytes()?;
        let have = self.filled - self.pos;
        let left = match &self.input {
            Input::Chunks { next, at, .. } => next.len() - at,
            Input::Read(_) => 0,
        };
        // Everything parsed in the current buffer is hashed before it is left.
        self.hash_to(self.pos);
        let start = self.offset();
        let in_place = have == 0 && left >= n;
        let (buf, base) = if in_place {
            let Input::Chunks { next, at, .. } = &mut self.input else {
                unreachable!("chunk input");
            };
            let at = std::mem::replace(at, 0);
            (Arc::new(std::mem::take(next)), at)
        } else {
            let mut carry = Vec::with_capacity(n);
            carry.extend_from_slice(&self.buf[self.pos..self.filled]);
            while carry.len() < n {
                self.next_chunk_with_bytes()?;
                let Input::Chunks { next, at, .. } = &mut self.input else {
                    unreachable!("chunk input");
                };
                let k = (n - carry.len()).min(next.len() - *at);
                carry.extend_from_slice(&next[*at..*at + k]);
                *at += k;
            }
            (Arc::new(carry), 0)
        };
        let old = std::mem::replace(&mut self.buf, buf);
        let old_is_chunk = std::mem::replace(&mut self.buf_is_chunk, in_place);
        let current = self.held.len() as u32;
        if self.pending.last().is_some_and(|p| p.buf == current) {
            self.held.push(Held {
                buf: old,
                base: self.base,
                chunk: old_is_chunk,
            });
        } else if old_is_chunk {
            self.recycle(old);
        }
        self.origin = start - base as u64;
        self.base = base;
        self.pos = base;
        self.hashed = base;
        self.block = (base, self.crc.clone());
        self.filled = self.buf.len();
        Ok(())
    }

    /// Makes the chunk being taken from hold a byte, taking the next chunks from the source
    /// (and handing used ones back).
    fn next_chunk_with_bytes(&mut self) -> Result<(), BackendError> {
        let offset = self.offset();
        let Input::Chunks { source, next, at } = &mut self.input else {
            return Ok(());
        };
        while *at >= next.len() {
            let used = std::mem::take(next);
            if used.capacity() > 0 {
                source.recycle(used);
            }
            // Chunks lent to a batch's consumer and since let go of go back as well.
            let mut i = 0;
            while i < self.lent.len() {
                if Arc::strong_count(&self.lent[i]) == 1 {
                    if let Ok(chunk) = Arc::try_unwrap(self.lent.swap_remove(i)) {
                        source.recycle(chunk);
                    }
                } else {
                    i += 1;
                }
            }
            match source.next_chunk() {
                Some(chunk) => {
                    *next = chunk;
                    *at = 0;
                }
                None => {
                    self.eof = true;
                    return Err(bad(offset, "stream ends early"));
                }
            }
        }
        Ok(())
    }

    /// Hands a chunk back to the source, or keeps it until a batch's consumer lets go of it.
    fn recycle(&mut self, buf: Arc<Vec<u8>>) {
        if let Input::Chunks { source, .. } = &mut self.input {
            match Arc::try_unwrap(buf) {
                Ok(chunk) => source.recycle(chunk),
                Err(lent) => self.lent.push(lent),
            }
        }
    }

    /// Checks that nothing follows the end frame (whose last byte is at `pos`).
    fn expect_end(&mut self) -> Result<(), BackendError> {
        if self.filled > self.pos {
            return Err(bad(self.offset(), "bytes after the end frame"));
        }
        match &mut self.input {
            Input::Read(input) => {
                let mut extra = [0u8; 1];
                loop {
                    match input.read(&mut extra) {
                        Ok(0) => return Ok(()),
                        Ok(_) => return Err(bad(self.offset(), "bytes after the end frame")),
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) => return Err(stream_io(self.offset(), e)),
                    }
                }
            }
            Input::Chunks { source, next, at } => {
                let mut extra = next.len() > *at;
                while !extra && let Some(chunk) = source.next_chunk() {
                    extra = !chunk.is_empty();
                    source.recycle(chunk);
                }
                if extra {
                    Err(bad(self.offset(), "bytes after the end frame"))
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Takes `n` bytes (made available by `need`), returning their offset in `buf`.
    #[inline]
    fn take(&mut self, n: usize) -> Result<usize, BackendError> {
        // Three takes a pair: `need` is called only when the buffer runs short.
        if self.filled - self.pos < n {
            self.need(n)?;
        }
        if self.pos >= self.hashed && self.hashed < self.filled {
            // Hash the next block before parsing it: one sequential pass brings it into the
            // processor's cache (bytes just received land in another core's cache or in
            // memory), and the parse, which jumps from frame to frame, then finds it there.
            self.block = (self.hashed, self.crc.clone());
            let end = self.filled.min(self.hashed + HASH_BLOCK);
            self.crc.update(&self.buf[self.hashed..end]);
            self.hashed = end;
        }
        let at = self.pos;
        self.pos += n;
        Ok(at)
    }

    /// Makes `crc` cover exactly the bytes of `buf` before `end` (at or past the start of
    /// the block being parsed).
    fn hash_to(&mut self, end: usize) {
        if self.hashed > end {
            let (at, crc) = self.block.clone();
            debug_assert!(at <= end, "hashed ahead of a block start past {end}");
            self.crc = crc;
            self.hashed = at;
        }
        if end > self.hashed {
            self.crc.update(&self.buf[self.hashed..end]);
            self.hashed = end;
        }
    }

    /// The key of a pending pair.
    fn key_of(&self, pair: &PairAt) -> &[u8] {
        let (buf, base) = match self.held.get(pair.buf as usize) {
            Some(h) => (&h.buf, h.base),
            None => (&self.buf, self.base),
        };
        let from = base + pair.key as usize;
        &buf[from..from + pair.key_len as usize]
    }

    fn u8_at(&self, at: usize) -> u8 {
        self.buf[at]
    }

    fn u16_at(&self, at: usize) -> u16 {
        u16::from_le_bytes([self.buf[at], self.buf[at + 1]])
    }

    fn u32_at(&self, at: usize) -> u32 {
        let mut b = [0u8; 4];
        b.copy_from_slice(&self.buf[at..at + 4]);
        u32::from_le_bytes(b)
    }

    fn u64_at(&self, at: usize) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.buf[at..at + 8]);
        u64::from_le_bytes(b)
    }
}

/// True when `key` sorts after `previous`: decided by their first 8 bytes when both have
/// that many and they differ (a compare of two integers), else byte by byte.
fn ascending(previous: &[u8], key: &[u8]) -> bool {
    if let (Some(a), Some(b)) = (previous.first_chunk::<8>(), key.first_chunk::<8>()) {
        let (a, b) = (u64::from_be_bytes(*a), u64::from_be_bytes(*b));
        if a != b {
            return a < b;
        }
    }
    previous < key
}

/// As [`restore_with`], with each batch handed out as slices of the parser's read buffer
/// instead of a [`WriteBatch`]: no allocation or copy per pair. Same batches, same order,
/// same rule for the last one, same checks.
pub fn restore_from<F>(input: &mut dyn Read, apply: F) -> Result<u64, BackendError>
where
    F: FnMut(&PairBatch<'_>) -> Result<(), BackendError>,
{
    restore_from_batched(input, RESTORE_BATCH_BYTES, apply)
}

/// As [`restore_from`], with batches of at most `batch_bytes` payload bytes (plus one pair;
/// at least one pair each) instead of [`RESTORE_BATCH_BYTES`]. Smaller batches stay in the
/// processor's cache while they are parsed, observed and copied on into the backend (a
/// backend that copies each batch into a write of its own anyway); larger ones mean fewer
/// commits (a backend that syncs each). The parser's buffer is `batch_bytes` plus 2 MiB.
pub fn restore_from_batched<F>(
    input: &mut dyn Read,
    batch_bytes: usize,
    apply: F,
) -> Result<u64, BackendError>
where
    F: FnMut(&PairBatch<'_>) -> Result<(), BackendError>,
{
    let batch_bytes = batch_bytes.max(1);
    parse(
        &mut Parser::new(
            Input::Read(input),
            Arc::new(vec![0u8; batch_bytes + 2 * READ_BLOCK]),
        ),
        batch_bytes,
        apply,
    )
}

/// As [`restore_from_batched`], for a stream handed over as chunks of bytes by value (the
/// chunks of a network transfer, say): the stream is the chunks' bytes in order, cut
/// anywhere. The parser works inside the chunks instead of copying them into a buffer of
/// its own (only the bytes of a frame field that spans two chunks are copied), and hands
/// each chunk back to the source ([`ChunkSource::recycle`]) once no pending pair sits in it.
/// A batch may span several chunks. Same batches' rule, same order, same rule for the last
/// one, same checks: the stream's checksum is verified over its bytes before the last batch
/// is handed out.
pub fn restore_chunks_batched<F>(
    source: &mut dyn ChunkSource,
    batch_bytes: usize,
    apply: F,
) -> Result<u64, BackendError>
where
    F: FnMut(&PairBatch<'_>) -> Result<(), BackendError>,
{
    restore_chunks_settled(source, batch_bytes, apply, || Ok(()))
}

/// As [`restore_chunks_batched`], for a consumer that keeps chunks past the batches
/// ([`PairBatch::shared`]): once the last batch is applied, `settle` is called, and must let
/// go of every chunk kept; the chunks are then handed back to the source. (Chunks still kept
/// when a failed parse ends are not handed back.) An error from `settle` is returned as is.
pub fn restore_chunks_settled<F, S>(
    source: &mut dyn ChunkSource,
    batch_bytes: usize,
    apply: F,
    settle: S,
) -> Result<u64, BackendError>
where
    F: FnMut(&PairBatch<'_>) -> Result<(), BackendError>,
    S: FnOnce() -> Result<(), BackendError>,
{
    let input = Input::Chunks {
        source,
        next: Vec::new(),
        at: 0,
    };
    let mut p = Parser::new(input, Arc::new(Vec::new()));
    let pairs = parse(&mut p, batch_bytes.max(1), apply)?;
    settle()?;
    for chunk in std::mem::take(&mut p.lent) {
        p.recycle(chunk);
    }
    Ok(pairs)
}

impl<'a> Parser<'a> {
    fn new(input: Input<'a>, buf: Arc<Vec<u8>>) -> Parser<'a> {
        Parser {
            input,
            buf,
            buf_is_chunk: false,
            base: 0,
            pos: 0,
            filled: 0,
            hashed: 0,
            crc: crc32fast::Hasher::new(),
            block: (0, crc32fast::Hasher::new()),
            origin: 0,
            eof: false,
            pending: Vec::new(),
            held: Vec::new(),
            lent: Vec::new(),
        }
    }
}

fn parse<F>(p: &mut Parser<'_>, batch_bytes: usize, mut apply: F) -> Result<u64, BackendError>
where
    F: FnMut(&PairBatch<'_>) -> Result<(), BackendError>,
{
    let at = p.take(16)?;
    if &p.buf[at..at + 8] != MAGIC {
        return Err(bad(0, "not a keel snapshot stream (bad magic)"));
    }
    let version = p.u32_at(at + 8);
    if version != VERSION {
        return Err(bad(
            8,
            format!("unsupported stream version {version} (this build reads {VERSION})"),
        ));
    }

    let mut buckets: Vec<Bucket> = Vec::new();
    let mut payload = 0usize;
    // The last key of the previous batch, once that batch is handed out (its bytes may be
    // gone from the buffer); within a batch the previous pair is compared in place.
    let mut last_key: Vec<u8> = Vec::new();
    let mut have_last = false;
    let mut pairs = 0u64;
    p.base = p.pos;
    loop {
        // The read buffer has no room for another read and is nearly all parsed: the next
        // read will move the pending pairs and what follows them to the front (or, reading
        // chunks, go on in the next chunk). Hand a sizeable pending batch out first (the next
        // frame has started and is not the end frame), so that little is moved or kept.
        if p.pos - p.base >= EARLY_HAND_OUT_MIN
            && p.buf.len() - p.filled < READ_BLOCK
            && p.filled > p.pos
            && p.filled - p.pos < EARLY_HAND_OUT
            && p.u8_at(p.pos) != TAG_END
        {
            let end = p.pos;
            hand_out(p, end, &buckets, &mut last_key, &mut apply)?;
            payload = 0;
        }
        let at = p.offset();
        let tag_at = p.take(1)?;
        let tag = p.u8_at(tag_at);
        match tag {
            TAG_BUCKET => {
                let len_at = p.take(2)?;
                let len = p.u16_at(len_at) as usize;
                if len == 0 || len > super::MAX_BUCKET_NAME {
                    return Err(bad(at, format!("bucket name length {len} out of range")));
                }
                let name_at = p.take(len)?;
                let name = std::str::from_utf8(&p.buf[name_at..name_at + len])
                    .map_err(|_| bad(at, "bucket name is not UTF-8"))?;
                let next =
                    Bucket::from_name(name.to_owned()).map_err(|e| bad(at, e.to_string()))?;
                if buckets.last().is_some_and(|prev| *prev >= next) {
                    return Err(bad(at, "buckets out of order"));
                }
                buckets.push(next);
                have_last = false;
            }
            TAG_PAIR => {
                if buckets.is_empty() {
                    return Err(bad(at, "pair before any bucket"));
                }
                let lens = p.take(8)?;
                let klen = p.u32_at(lens) as usize;
                let vlen = p.u32_at(lens + 4) as usize;
                if klen > MAX_KEY || vlen > MAX_VALUE {
                    return Err(bad(at, format!("pair lengths {klen}/{vlen} exceed limits")));
                }
                // Key and value together, so that the key is not moved away by a refill.
                let key_at = p.take(klen + vlen)?;
                let key = &p.buf[key_at..key_at + klen];
                if have_last {
                    let previous = match p.pending.last() {
                        Some(prev) if prev.bucket as usize == buckets.len() - 1 => p.key_of(prev),
                        _ => last_key.as_slice(),
                    };
                    if !ascending(previous, key) {
                        return Err(bad(at, "keys out of order"));
                    }
                }
                have_last = true;
                let rel = key_at - p.base;
                let pair = PairAt {
                    buf: p.held.len() as u32,
                    bucket: (buckets.len() - 1) as u32,
                    key: rel as u32,
                    key_len: klen as u32,
                    value: (rel + klen) as u32,
                    value_len: vlen as u32,
                };
                p.pending.push(pair);
                payload += klen + vlen;
                pairs += 1;
                if payload >= batch_bytes || p.pending.len() >= RESTORE_BATCH_PAIRS {
                    // Held back while the next frame's tag is read: if the stream ends here,
                    // this is the last batch, and it must follow the checksum.
                    p.need(1)?;
                    if p.u8_at(p.pos) != TAG_END {
                        let end = p.pos;
                        hand_out(p, end, &buckets, &mut last_key, &mut apply)?;
                        payload = 0;
                    }
                }
            }
            TAG_END => {
                let count_at = p.take(8)?;
                let count = p.u64_at(count_at);
                p.hash_to(p.pos);
                let expected_crc = p.crc.clone().finalize();
                let crc_at = p.take(4)?;
                let crc = p.u32_at(crc_at);
                if crc != expected_crc {
                    return Err(bad(at, "checksum mismatch"));
                }
                if count != pairs {
                    return Err(bad(at, "pair count mismatch"));
                }
                p.expect_end()?;
                if !p.pending.is_empty() {
                    let end = p.filled;
                    hand_out(p, end, &buckets, &mut last_key, &mut apply)?;
                }
                return Ok(pairs);
            }
            other => return Err(bad(at, format!("unknown frame tag {other:#04x}"))),
        }
    }
}

/// Within this many unparsed bytes of a full read buffer, the pending pairs are handed out
/// before the buffer is compacted ...
const EARLY_HAND_OUT: usize = 64 << 10;
/// ... when they span at least this many bytes (so at most one early batch per compaction:
/// fewer bytes than this are left to parse).
const EARLY_HAND_OUT_MIN: usize = 2 * EARLY_HAND_OUT;

/// Hands the pending pairs (the last of which end before `end` in the current buffer) to
/// `apply`, remembering the last key for the order check, and starts the next batch at `end`.
/// Buffers left behind are handed back to the source.
fn hand_out<F>(
    p: &mut Parser<'_>,
    end: usize,
    buckets: &[Bucket],
    last_key: &mut Vec<u8>,
    apply: &mut F,
) -> Result<(), BackendError>
where
    F: FnMut(&PairBatch<'_>) -> Result<(), BackendError>,
{
    if let Some(last) = p.pending.last() {
        last_key.clear();
        last_key.extend_from_slice(p.key_of(last));
        let mut bufs: Vec<&[u8]> = Vec::with_capacity(p.held.len() + 1);
        bufs.extend(p.held.iter().map(|h| &h.buf[h.base..]));
        bufs.push(&p.buf[p.base..end]);
        let mut owners: Vec<(&Arc<Vec<u8>>, usize)> = Vec::new();
        if matches!(p.input, Input::Chunks { .. }) {
            owners.reserve(p.held.len() + 1);
            owners.extend(p.held.iter().map(|h| (&h.buf, h.base)));
            owners.push((&p.buf, p.base));
        }
        apply(&PairBatch {
            bufs: &bufs,
            owners: &owners,
            buckets,
            pairs: &p.pending,
        })?;
    }
    p.pending.clear();
    for h in std::mem::take(&mut p.held) {
        if h.chunk {
            p.recycle(h.buf);
        }
    }
    p.base = end;
    Ok(())
}

/// Reads the chunks of a [`ChunkSource`] as one byte stream, copying them out (handing each
/// back once it is read): what [`Backend::restore_chunks`] does by default.
pub struct ChunkRead<'a> {
    source: &'a mut dyn ChunkSource,
    chunk: Vec<u8>,
    at: usize,
}

impl<'a> ChunkRead<'a> {
    /// Reads the chunks of `source`.
    pub fn new(source: &'a mut dyn ChunkSource) -> ChunkRead<'a> {
        ChunkRead {
            source,
            chunk: Vec::new(),
            at: 0,
        }
    }
}

impl Read for ChunkRead<'_> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.at == self.chunk.len() {
            match self.source.next_chunk() {
                Some(next) => {
                    let used = std::mem::replace(&mut self.chunk, next);
                    if used.capacity() > 0 {
                        self.source.recycle(used);
                    }
                    self.at = 0;
                }
                None => return Ok(0),
            }
        }
        let n = out.len().min(self.chunk.len() - self.at);
        out[..n].copy_from_slice(&self.chunk[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

fn bad(offset: u64, reason: impl Into<String>) -> BackendError {
    BackendError::Snapshot {
        offset,
        reason: reason.into(),
    }
}

fn stream_io(offset: u64, e: io::Error) -> BackendError {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        bad(offset, "stream ends early")
    } else {
        bad(offset, format!("I/O error: {e}"))
    }
}

/// Counts the bytes written to a sink.
struct CountingWriter<'a> {
    out: &'a mut dyn ChecksummedWrite,
    written: u64,
}

impl CountingWriter<'_> {
    fn put(&mut self, bytes: &[u8]) -> Result<(), BackendError> {
        self.out
            .write_all(bytes)
            .map_err(|e| stream_io(self.written, e))?;
        self.written += bytes.len() as u64;
        Ok(())
    }
}

/// A plain sink, hashing what is written to it.
struct HashingWriter<'a> {
    out: &'a mut dyn Write,
    crc: crc32fast::Hasher,
}

impl Write for HashingWriter<'_> {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        let n = self.out.write(bytes)?;
        self.crc.update(&bytes[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }
}

impl ChecksummedWrite for HashingWriter<'_> {
    fn crc(&mut self) -> u32 {
        self.crc.clone().finalize()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream of `n` pairs over three buckets, values of varied lengths (some larger than
    /// a chunk).
    fn stream(n: u32) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        let mut pairs = 0u64;
        for bucket in ["a", "bb", "ccc"] {
            out.push(TAG_BUCKET);
            out.extend_from_slice(&(bucket.len() as u16).to_le_bytes());
            out.extend_from_slice(bucket.as_bytes());
            for i in 0..n {
                let key = format!("key-{i:06}");
                let len = match i % 50 {
                    0 => 70_000,
                    1 => 0,
                    _ => (i as usize * 37) % 3000,
                };
                let value: Vec<u8> = (0..len).map(|j| (i as usize + j) as u8).collect();
                out.push(TAG_PAIR);
                out.extend_from_slice(&(key.len() as u32).to_le_bytes());
                out.extend_from_slice(&(value.len() as u32).to_le_bytes());
                out.extend_from_slice(key.as_bytes());
                out.extend_from_slice(&value);
                pairs += 1;
            }
        }
        out.push(TAG_END);
        out.extend_from_slice(&pairs.to_le_bytes());
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    type Seen = (Result<u64, String>, Vec<(String, Vec<u8>, Vec<u8>)>, usize);

    /// A stream of `keys` in one bucket, in the order given, each with a 100-byte value.
    fn stream_of(keys: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.push(TAG_BUCKET);
        out.extend_from_slice(&1u16.to_le_bytes());
        out.push(b'k');
        for key in keys {
            out.push(TAG_PAIR);
            out.extend_from_slice(&(key.len() as u32).to_le_bytes());
            out.extend_from_slice(&100u32.to_le_bytes());
            out.extend_from_slice(key);
            out.extend_from_slice(&[7; 100]);
        }
        out.push(TAG_END);
        out.extend_from_slice(&(keys.len() as u64).to_le_bytes());
        let crc = crc32fast::hash(&out);
        out.extend_from_slice(&crc.to_le_bytes());
        out
    }

    /// Keys must rise strictly within a bucket, whether they differ in their first 8 bytes
    /// or only after them, within a batch or across two.
    #[test]
    fn keys_out_of_order_are_refused() {
        let sorted: &[&[u8]] = &[
            b"",
            b"a",
            b"abcdefg",
            b"abcdefgh",
            b"abcdefgh\x00",
            b"abcdefghij",
            b"abcdefgi",
            b"b",
            b"bbbbbbbbbbbbbbbb1",
            b"bbbbbbbbbbbbbbbb2",
            b"c",
        ];
        for batch in [1, 4096] {
            let (r, seen, _) = by_reading(&stream_of(sorted), batch);
            assert_eq!(r, Ok(sorted.len() as u64), "batch {batch}");
            assert_eq!(seen.len(), sorted.len());
            let (r, _, _) = by_chunks(&stream_of(sorted), &[150, 7, 1 << 20], batch);
            assert_eq!(r, Ok(sorted.len() as u64), "batch {batch}, chunks");
        }
        let unsorted: &[&[&[u8]]] = &[
            &[b"a", b"a"],
            &[b"b", b"a"],
            &[b"abcdefgh", b"abcdefgh"],
            &[b"abcdefgi", b"abcdefgh"],
            &[b"abcdefghij", b"abcdefgh"],
            &[b"abcdefgh\x01", b"abcdefgh\x00"],
            &[b"bbbbbbbbbbbbbbbb2", b"bbbbbbbbbbbbbbbb1"],
            &[b"abcdefghi", b"abc"],
            &[b"abc", b""],
        ];
        for keys in unsorted {
            for batch in [1, 4096] {
                let (r, _, _) = by_reading(&stream_of(keys), batch);
                let e = r.expect_err("an unsorted stream restored");
                assert!(
                    e.contains("keys out of order"),
                    "{keys:?}, batch {batch}: {e}"
                );
                let (r, _, _) = by_chunks(&stream_of(keys), &[150, 7, 1 << 20], batch);
                let e = r.expect_err("an unsorted stream restored from chunks");
                assert!(
                    e.contains("keys out of order"),
                    "{keys:?}, batch {batch}: {e}"
                );
            }
        }
    }

    fn by_reading(bytes: &[u8], batch: usize) -> Seen {
        let mut seen = Vec::new();
        let mut batches = 0;
        let r = restore_from_batched(&mut &bytes[..], batch, |b| {
            batches += 1;
            seen.extend(
                b.iter()
                    .map(|(bk, k, v)| (bk.name().to_owned(), k.to_vec(), v.to_vec())),
            );
            Ok(())
        });
        (r.map_err(|e| e.to_string()), seen, batches)
    }

    fn by_chunks(bytes: &[u8], sizes: &[usize], batch: usize) -> Seen {
        let mut seen = Vec::new();
        let mut batches = 0;
        let mut cut = crate::testing::ChunkCuts::new(bytes, sizes);
        let r = restore_chunks_batched(&mut cut, batch, |b| {
            batches += 1;
            assert!(!b.is_empty(), "an empty batch");
            seen.extend(
                b.iter()
                    .map(|(bk, k, v)| (bk.name().to_owned(), k.to_vec(), v.to_vec())),
            );
            Ok(())
        });
        (r.map_err(|e| e.to_string()), seen, batches)
    }

    /// A batch of a stream read from chunks shows each pair as a place in a shared buffer
    /// holding its key and value (none for a byte stream); chunks a consumer keeps past its
    /// batches go back to the source once `settle` let go of them, and `settle` runs only
    /// for a whole stream.
    #[test]
    fn shared_pairs_point_at_their_bytes_and_kept_chunks_go_back() {
        let bytes = stream(300);
        let mut none = true;
        restore_from_batched(&mut &bytes[..], 4096, |b| {
            none &= b.shared().is_none();
            Ok(())
        })
        .expect("read");
        assert!(none, "a byte stream's batch offered shared pairs");
        for sizes in [
            &[1 << 20][..],
            &[3, 1, 8, 2, 16_384, 5],
            &[9, 70_001, 13, 1000],
        ] {
            let mut cut = crate::testing::ChunkCuts::new(&bytes, sizes);
            let kept: std::cell::RefCell<Vec<Arc<Vec<u8>>>> = Default::default();
            let mut seen = 0usize;
            let mut settled = false;
            let n = restore_chunks_settled(
                &mut cut,
                4096,
                |b| {
                    let shared = b
                        .shared()
                        .expect("a chunked stream's batch has shared pairs");
                    for (p, (bucket, key, value)) in shared.zip(b.iter()) {
                        assert_eq!(p.bucket, bucket);
                        assert_eq!(&p.buf[p.key_at..p.key_at + p.key_len], key);
                        let v = p.key_at + p.key_len;
                        assert_eq!(&p.buf[v..v + p.value_len], value);
                        let mut kept = kept.borrow_mut();
                        if !kept.last().is_some_and(|k| Arc::ptr_eq(k, p.buf)) {
                            kept.push(p.buf.clone());
                        }
                        seen += 1;
                    }
                    Ok(())
                },
                || {
                    kept.borrow_mut().clear();
                    settled = true;
                    Ok(())
                },
            )
            .expect("restore");
            assert_eq!(n, 900);
            assert_eq!(seen, 900, "cut {sizes:?}");
            assert!(settled, "settle was not called");
            assert!(
                cut.handed - cut.recycled <= 2,
                "cut {sizes:?}: {} of {} chunks never handed back",
                cut.handed - cut.recycled,
                cut.handed
            );
        }
        let mut damaged = bytes.clone();
        let at = damaged.len() - 5;
        damaged[at] ^= 1;
        let mut cut = crate::testing::ChunkCuts::new(&damaged, [4096]);
        let mut settled = false;
        let r = restore_chunks_settled(
            &mut cut,
            4096,
            |_| Ok(()),
            || {
                settled = true;
                Ok(())
            },
        );
        assert!(r.is_err(), "a damaged stream was accepted");
        assert!(!settled, "settle ran for a damaged stream");
    }

    /// Parsing inside chunks hands out exactly the pairs reading the stream does, in the
    /// same order, for any cut and batch size, and fails on the same damage with the same
    /// error, never handing out the last batch of a stream that fails its checksum.
    #[test]
    fn chunks_parse_like_a_read_stream() {
        let bytes = stream(400);
        let cuts: [&[usize]; 6] = [
            &[bytes.len()],
            &[1 << 20],
            &[1],
            &[3, 1, 8, 2, 16_384, 5],
            &[0, 65_536, 0, 4096],
            &[9, 70_001, 13, 1000],
        ];
        for batch in [1, 700, 64 << 10, 512 << 10] {
            let read = by_reading(&bytes, batch);
            assert_eq!(read.0, Ok(1200));
            for sizes in cuts {
                let got = by_chunks(&bytes, sizes, batch);
                assert_eq!(got.0, read.0, "cut {sizes:?}, batch {batch}");
                assert!(
                    got.1 == read.1,
                    "pairs differ: cut {sizes:?}, batch {batch}"
                );
                if batch == 1 {
                    assert_eq!(got.2, 1200, "one pair per batch");
                }
            }
        }
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for round in 0..40 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut damaged = bytes.clone();
            let at = match round {
                0 => bytes.len() - 1,
                1 => bytes.len() - 13,
                _ => (state % bytes.len() as u64) as usize,
            };
            damaged[at] ^= 0x10;
            let read = by_reading(&damaged, 4096);
            let got = by_chunks(&damaged, &[3, 1, 8, 2, 16_384, 5], 4096);
            assert!(read.0.is_err(), "flip at {at} accepted by the reader");
            assert_eq!(got.0, read.0, "flip at {at}");
            assert!(
                got.1.len() < 1200,
                "flip at {at}: the last batch was handed out"
            );
        }
        for len in [0, 10, 16, bytes.len() / 3, bytes.len() - 4, bytes.len() - 1] {
            let read = by_reading(&bytes[..len], 4096);
            let got = by_chunks(&bytes[..len], &[4096, 7], 4096);
            assert!(read.0.is_err());
            assert_eq!(got.0, read.0, "cut to {len}");
        }
        let mut extended = bytes.clone();
        extended.extend_from_slice(&[0, 0]);
        let got = by_chunks(&extended, &[bytes.len()], 4096);
        assert!(got.0.is_err_and(|e| e.contains("after the end frame")));
        let got = by_chunks(&extended, &[bytes.len() + 1, 1], 4096);
        assert!(got.0.is_err_and(|e| e.contains("after the end frame")));
    }
}
