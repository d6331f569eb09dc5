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

use super::{Backend, BackendError, Bucket, PairObserver, ReadTxn, WriteBatch};

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
/// written.
pub fn write<T: ReadTxn + ?Sized>(txn: &T, out: &mut dyn Write) -> Result<u64, BackendError> {
    let mut w = CrcWriter::new(out);
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
    w.put(&[TAG_END])?;
    w.put(&pairs.to_le_bytes())?;
    let crc = w.crc.clone().finalize();
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
    restore_with(input, |batch| backend.commit(batch))
}

/// Hands every `Put` of `batch` to `observe`, for [`Backend::restore_observed`]
/// implementations built on [`restore_with`].
pub fn observe_batch(batch: &WriteBatch, observe: &mut PairObserver<'_>) {
    for op in batch.ops() {
        if let super::BatchOp::Put { bucket, key, value } = op {
            observe(bucket, key, value);
        }
    }
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
pub fn restore_with<F>(input: &mut dyn Read, mut apply: F) -> Result<u64, BackendError>
where
    F: FnMut(&WriteBatch) -> Result<(), BackendError>,
{
    let mut r = CrcReader::new(input);
    let mut header = [0u8; 16];
    r.take(&mut header)?;
    if &header[..8] != MAGIC {
        return Err(bad(0, "not a keel snapshot stream (bad magic)"));
    }
    let version = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
    if version != VERSION {
        return Err(bad(
            8,
            format!("unsupported stream version {version} (this build reads {VERSION})"),
        ));
    }

    let mut batch = WriteBatch::new();
    let mut bucket: Option<Bucket> = None;
    let mut last_key: Vec<u8> = Vec::new();
    let mut have_last = false;
    let mut pairs = 0u64;
    loop {
        let at = r.offset();
        let mut tag = [0u8; 1];
        r.take(&mut tag)?;
        match tag[0] {
            TAG_BUCKET => {
                let mut len = [0u8; 2];
                r.take(&mut len)?;
                let len = u16::from_le_bytes(len) as usize;
                if len == 0 || len > super::MAX_BUCKET_NAME {
                    return Err(bad(at, format!("bucket name length {len} out of range")));
                }
                let mut name = vec![0u8; len];
                r.take(&mut name)?;
                let name =
                    String::from_utf8(name).map_err(|_| bad(at, "bucket name is not UTF-8"))?;
                let next = Bucket::from_name(name).map_err(|e| bad(at, e.to_string()))?;
                if bucket.as_ref().is_some_and(|prev| *prev >= next) {
                    return Err(bad(at, "buckets out of order"));
                }
                bucket = Some(next);
                have_last = false;
            }
            TAG_PAIR => {
                let Some(current) = bucket.as_ref() else {
                    return Err(bad(at, "pair before any bucket"));
                };
                let mut lens = [0u8; 8];
                r.take(&mut lens)?;
                let klen = u32::from_le_bytes(lens[..4].try_into().expect("4 bytes")) as usize;
                let vlen = u32::from_le_bytes(lens[4..].try_into().expect("4 bytes")) as usize;
                if klen > MAX_KEY || vlen > MAX_VALUE {
                    return Err(bad(at, format!("pair lengths {klen}/{vlen} exceed limits")));
                }
                let mut key = vec![0u8; klen];
                r.take(&mut key)?;
                let mut value = vec![0u8; vlen];
                r.take(&mut value)?;
                if have_last && last_key >= key {
                    return Err(bad(at, "keys out of order"));
                }
                last_key.clear();
                last_key.extend_from_slice(&key);
                have_last = true;
                batch.put(current, key, value);
                pairs += 1;
                if batch.payload_bytes() >= RESTORE_BATCH_BYTES
                    || batch.len() >= RESTORE_BATCH_PAIRS
                {
                    // Held back while the next frame is read: if the stream ends here, this
                    // is the last batch, and it must follow the checksum.
                    let mut next = [0u8; 1];
                    r.take(&mut next)?;
                    r.unread(next[0]);
                    if next[0] != TAG_END {
                        apply(&batch)?;
                        batch.clear();
                    }
                }
            }
            TAG_END => {
                let mut count = [0u8; 8];
                r.take(&mut count)?;
                let expected_crc = r.crc.clone().finalize();
                let mut crc = [0u8; 4];
                r.take(&mut crc)?;
                if u32::from_le_bytes(crc) != expected_crc {
                    return Err(bad(at, "checksum mismatch"));
                }
                if u64::from_le_bytes(count) != pairs {
                    return Err(bad(at, "pair count mismatch"));
                }
                let mut extra = [0u8; 1];
                match r.input.read(&mut extra) {
                    Ok(0) => {}
                    Ok(_) => return Err(bad(r.read, "bytes after the end frame")),
                    Err(e) => return Err(stream_io(r.read, e)),
                }
                if !batch.is_empty() {
                    apply(&batch)?;
                }
                return Ok(pairs);
            }
            other => return Err(bad(at, format!("unknown frame tag {other:#04x}"))),
        }
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

struct CrcWriter<'a> {
    out: &'a mut dyn Write,
    crc: crc32fast::Hasher,
    written: u64,
}

impl<'a> CrcWriter<'a> {
    fn new(out: &'a mut dyn Write) -> Self {
        CrcWriter {
            out,
            crc: crc32fast::Hasher::new(),
            written: 0,
        }
    }

    fn put(&mut self, bytes: &[u8]) -> Result<(), BackendError> {
        self.out
            .write_all(bytes)
            .map_err(|e| stream_io(self.written, e))?;
        self.crc.update(bytes);
        self.written += bytes.len() as u64;
        Ok(())
    }
}

struct CrcReader<'a> {
    input: &'a mut dyn Read,
    crc: crc32fast::Hasher,
    read: u64,
    /// One byte already read (and counted in `crc` and `read`), handed out first.
    pushed_back: Option<u8>,
}

impl<'a> CrcReader<'a> {
    fn new(input: &'a mut dyn Read) -> Self {
        CrcReader {
            input,
            crc: crc32fast::Hasher::new(),
            read: 0,
            pushed_back: None,
        }
    }

    fn take(&mut self, buf: &mut [u8]) -> Result<(), BackendError> {
        let mut rest = &mut buf[..];
        if let Some(byte) = self.pushed_back.take() {
            match rest.split_first_mut() {
                Some((first, tail)) => {
                    *first = byte;
                    rest = tail;
                }
                None => {
                    self.pushed_back = Some(byte);
                    return Ok(());
                }
            }
        }
        self.input
            .read_exact(rest)
            .map_err(|e| stream_io(self.read, e))?;
        self.crc.update(rest);
        self.read += rest.len() as u64;
        Ok(())
    }

    /// Stream offset of the next byte `take` hands out.
    fn offset(&self) -> u64 {
        self.read - u64::from(self.pushed_back.is_some())
    }

    /// Gives back the one byte just taken: the next `take` starts with it. It stays counted
    /// in the checksum and the offset, where it was when first read.
    fn unread(&mut self, byte: u8) {
        debug_assert!(self.pushed_back.is_none());
        self.pushed_back = Some(byte);
    }
}
