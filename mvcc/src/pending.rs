//! The write buffer: changes acknowledged to callers but not yet committed to the backend.
//!
//! Write transactions append to the store's *current* buffer. The committer swaps it for an
//! empty one, commits the old one to the backend in one batch, and then forgets it. A read
//! view clones the `Arc`s of the buffers it may need (current and, while a commit runs, the
//! committing one) before it opens its backend read transaction, so every change at or below
//! its revision is in one of the buffers or in the backend: revisions are immutable, so it does
//! not matter which copy a value is read from. Deletions are tombstones appended like any
//! other change, so a pending delete is never hidden by an older committed value.
//!
//! A buffer keeps its records' bytes in [`Records`]: chunks filled back to back, growing from
//! 1 KiB to 64 KiB, so a thousand changes cost a handful of allocations, not one each, and
//! the last holder of a buffer frees them in as few calls; a buffer of one small change stays
//! small (unless the pool below has chunks to spare). A record over 64 KiB has an allocation of its own, which a transaction's commit
//! moves into the shared buffer instead of copying it; a transaction that staged at least
//! [`MOVE_CHUNKS`] bytes of smaller records has its chunks moved too. The commit runs under
//! the store's state lock, so what it copies there stays small. Watchers get a copy of the
//! records they are sent.
//!
//! The store's buffers take their chunks from a [`ChunkPool`] while it has some, and the last
//! holder of a buffer gives its full-size chunks back, the pool keeping as many as that buffer
//! had at most. Freed instead, a busy writer's tens of megabytes of chunks per batch go back
//! to the operating system (the allocator trims its heap) and return as fresh pages: a page
//! fault and a zeroed page per 4 KiB written, and the allocator's changes to the process's
//! memory map, all slower while another thread of the process (a long read allocating its
//! results) does the same. Pooled, the next buffer writes into pages already mapped; the pool
//! holds at most one buffer's chunks, which a store writing at that rate holds anyway.

use std::collections::BTreeMap;

use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::backend::{BackendError, BatchOpRef, BatchSource, Bucket};
use crate::revision::{REV_KEY_LEN, Revision, TOMBSTONE_MARK};
use crate::store::{KEY_BUCKET, META_BUCKET};

/// Bytes of staged records (in chunks) from which a commit moves a transaction's chunks into
/// the shared buffer instead of copying the records: a copy of up to this much under the
/// state lock costs some tens of microseconds; larger transactions give up their staging
/// chunks, and the next one allocates new ones.
pub(crate) const MOVE_CHUNKS: usize = 256 << 10;

/// One stored change.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PendingRev {
    pub rev: Revision,
    pub tombstone: bool,
    /// Where its record lies in the buffer's [`Records`].
    pub record: RecordAt,
}

/// Where a record lies in a [`Records`]: in `chunks[chunk]` from `start`, or, for a record
/// over [`Records::CHUNK`] bytes, in `big[chunk]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RecordAt {
    chunk: usize,
    start: usize,
    len: usize,
}

/// Record bytes: records of up to [`Records::CHUNK`] bytes appended in chunks that double
/// from [`Records::FIRST_CHUNK`] to [`Records::CHUNK`] bytes (or full-size chunks from its
/// pool, while the pool has some), longer ones each in an allocation of their own.
#[derive(Debug, Default)]
pub(crate) struct Records {
    chunks: Vec<Vec<u8>>,
    big: Vec<Vec<u8>>,
    /// Where full-size chunks come from and go back to, if anywhere.
    pool: Option<Arc<ChunkPool>>,
}

/// Full-size, empty chunks given back by the buffers of one store (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct ChunkPool {
    free: Mutex<Vec<Vec<u8>>>,
}

impl ChunkPool {
    /// A pooled chunk, if any.
    fn take(&self) -> Option<Vec<u8>> {
        self.free.lock().pop()
    }

    /// Keeps the full-size chunks of `chunks`, emptied, and as many pooled chunks as there are
    /// of those at most: the pool holds about one buffer's worth, the last one's.
    fn give(&self, chunks: Vec<Vec<u8>>) {
        let mut full: Vec<Vec<u8>> = chunks
            .into_iter()
            .filter(|c| c.capacity() == Records::CHUNK)
            .collect();
        for c in &mut full {
            c.clear();
        }
        let keep = full.len();
        let mut free = self.free.lock();
        free.append(&mut full);
        // What is over, from the front (the oldest), is freed past the lock.
        let over = free.len().saturating_sub(keep);
        let freed: Vec<Vec<u8>> = free.drain(..over).collect();
        drop(free);
        drop(freed);
    }

    /// Chunks pooled now.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.free.lock().len()
    }
}

impl Drop for Records {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.give(std::mem::take(&mut self.chunks));
        }
    }
}

impl Records {
    /// Bytes of a full-size chunk, and the longest record kept in one.
    const CHUNK: usize = 64 << 10;
    /// Bytes of a buffer's first chunk.
    const FIRST_CHUNK: usize = 1 << 10;

    /// No records yet; chunks come from `pool` while it has some, and the full-size ones go
    /// back to it on drop.
    pub fn pooled(pool: Arc<ChunkPool>) -> Records {
        Records {
            chunks: Vec::new(),
            big: Vec::new(),
            pool: Some(pool),
        }
    }

    /// The record at `at`.
    #[inline]
    pub fn get(&self, at: RecordAt) -> &[u8] {
        if at.len > Self::CHUNK {
            &self.big[at.chunk]
        } else {
            &self.chunks[at.chunk][at.start..at.start + at.len]
        }
    }

    /// Appends a record of `len` bytes, which `write` appends to the vector it is given
    /// (and nothing else); returns where the record lies.
    #[inline]
    pub fn append(&mut self, len: usize, write: impl FnOnce(&mut Vec<u8>)) -> RecordAt {
        if len > Self::CHUNK {
            let mut bytes = Vec::with_capacity(len);
            write(&mut bytes);
            debug_assert_eq!(bytes.len(), len, "a record's length as announced");
            return self.push_big(bytes);
        }
        let last = self.chunks.last();
        if last.is_none_or(|c| c.capacity() - c.len() < len) {
            let doubled = last.map_or(0, |c| c.capacity() * 2);
            let size = doubled.clamp(Self::FIRST_CHUNK, Self::CHUNK).max(len);
            let chunk = self
                .pool
                .as_ref()
                .and_then(|p| p.take())
                .unwrap_or_else(|| Vec::with_capacity(size));
            self.chunks.push(chunk);
        }
        let chunk = self.chunks.len() - 1;
        let bytes = &mut self.chunks[chunk];
        let start = bytes.len();
        write(bytes);
        debug_assert_eq!(bytes.len() - start, len, "a record's length as announced");
        RecordAt {
            chunk,
            start,
            len: bytes.len() - start,
        }
    }

    fn push_big(&mut self, bytes: Vec<u8>) -> RecordAt {
        let len = bytes.len();
        self.big.push(bytes);
        RecordAt {
            chunk: self.big.len() - 1,
            start: 0,
            len,
        }
    }

    /// Appends a copy of `record`.
    #[inline]
    pub fn push(&mut self, record: &[u8]) -> RecordAt {
        self.append(record.len(), |out| out.extend_from_slice(record))
    }

    /// Appends the record at `at` in `from`: a copy, or, for a record with an allocation of
    /// its own, that allocation, taken from `from` (which must then be cleared before it is
    /// read again).
    #[inline]
    fn take_from(&mut self, from: &mut Records, at: RecordAt) -> RecordAt {
        if at.len > Self::CHUNK {
            self.push_big(std::mem::take(&mut from.big[at.chunk]))
        } else {
            self.push(from.get(at))
        }
    }

    /// Bytes of the records kept in chunks.
    fn chunked_bytes(&self) -> usize {
        self.chunks.iter().map(Vec::len).sum()
    }

    /// Moves every chunk of `from` behind this buffer's; returns the index the first one
    /// takes here.
    fn take_chunks(&mut self, from: &mut Records) -> usize {
        let base = self.chunks.len();
        self.chunks.append(&mut from.chunks);
        base
    }

    /// Forgets every record, keeping the largest chunk's allocation for the next ones.
    #[inline]
    pub fn clear(&mut self) {
        if !self.big.is_empty() {
            self.big.clear();
        }
        if self.chunks.len() > 1 {
            // Not always the last: chunks moved in from a transaction may sit behind it.
            let largest = (0..self.chunks.len())
                .max_by_key(|&i| self.chunks[i].capacity())
                .unwrap_or(0);
            self.chunks.swap(0, largest);
            self.chunks.truncate(1);
        }
        if let Some(first) = self.chunks.first_mut() {
            first.clear();
        }
    }
}

/// The changes of one or more write transactions.
#[derive(Debug, Default)]
pub(crate) struct Changes {
    /// Ascending by revision.
    pub revs: Vec<PendingRev>,
    /// The records of `revs`.
    pub records: Records,
    /// Auxiliary writes: `None` deletes.
    pub aux: BTreeMap<Bucket, BTreeMap<Vec<u8>, Option<Vec<u8>>>>,
    /// Writes to the meta bucket.
    pub meta: BTreeMap<&'static [u8], Vec<u8>>,
    /// Number of writes, for the batch limit.
    pub writes: usize,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.writes == 0
    }

    /// The record of the change at `rev`, if it is here.
    pub fn find(&self, rev: Revision) -> Option<&[u8]> {
        let i = self.revs.binary_search_by(|p| p.rev.cmp(&rev)).ok()?;
        Some(self.record(&self.revs[i]))
    }

    /// The first position from `from` on whose revision is not below `rev`, found by
    /// galloping from `from` (so a walk over ascending revisions near each other takes a few
    /// steps each, not a whole binary search); `from` must not be past a change below `rev`.
    pub fn seek(&self, from: usize, rev: Revision) -> usize {
        let (mut from, mut end, mut step) = (from, from, 1);
        while end < self.revs.len() && self.revs[end].rev < rev {
            from = end + 1;
            end += step;
            step *= 2;
        }
        let end = end.min(self.revs.len());
        from + self.revs[from..end].partition_point(|p| p.rev < rev)
    }

    /// The record of `p`, one of this buffer's changes.
    #[inline]
    pub fn record(&self, p: &PendingRev) -> &[u8] {
        self.records.get(p.record)
    }

    /// The auxiliary write to `bucket`/`key`, if any: `Some(None)` is a pending delete.
    pub fn aux(&self, bucket: &Bucket, key: &[u8]) -> Option<Option<&[u8]>> {
        self.aux.get(bucket)?.get(key).map(|v| v.as_deref())
    }

    /// Moves everything of `other` (newer) into `self`, leaving `other` empty with some of
    /// its allocations for reuse: records are copied, but those with an allocation of their
    /// own are moved, and so are the chunks of `other` when they hold [`MOVE_CHUNKS`] bytes
    /// or more.
    pub fn absorb_from(&mut self, other: &mut Changes) {
        let first = self.revs.len();
        self.revs.append(&mut other.revs);
        let moved = (other.records.chunked_bytes() >= MOVE_CHUNKS)
            .then(|| self.records.take_chunks(&mut other.records));
        for p in &mut self.revs[first..] {
            p.record = match moved {
                Some(base) if p.record.len <= Records::CHUNK => RecordAt {
                    chunk: base + p.record.chunk,
                    ..p.record
                },
                _ => self.records.take_from(&mut other.records, p.record),
            };
        }
        other.records.clear();
        if !other.aux.is_empty() {
            for (bucket, writes) in std::mem::take(&mut other.aux) {
                self.aux.entry(bucket).or_default().extend(writes);
            }
        }
        self.meta.append(&mut other.meta);
        self.writes += std::mem::take(&mut other.writes);
    }
}

/// The changes as a backend batch (revisions in order, then auxiliary writes, then meta
/// writes), without copying the records.
impl BatchSource for Changes {
    fn for_each_op(
        &self,
        sink: &mut dyn FnMut(BatchOpRef<'_>) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let mut key = [0u8; REV_KEY_LEN + 1];
        for p in &self.revs {
            key[..REV_KEY_LEN].copy_from_slice(&p.rev.to_bytes());
            let len = if p.tombstone {
                key[REV_KEY_LEN] = TOMBSTONE_MARK;
                REV_KEY_LEN + 1
            } else {
                REV_KEY_LEN
            };
            sink(BatchOpRef::Put {
                bucket: &KEY_BUCKET,
                key: &key[..len],
                value: self.records.get(p.record),
            })?;
        }
        for (bucket, writes) in &self.aux {
            for (key, value) in writes {
                sink(match value {
                    Some(value) => BatchOpRef::Put { bucket, key, value },
                    None => BatchOpRef::Delete { bucket, key },
                })?;
            }
        }
        for (key, value) in &self.meta {
            sink(BatchOpRef::Put {
                bucket: &META_BUCKET,
                key,
                value,
            })?;
        }
        Ok(())
    }

    fn op_count(&self) -> usize {
        self.revs.len() + self.aux.values().map(BTreeMap::len).sum::<usize>() + self.meta.len()
    }
}

/// A shared, append-only buffer of changes.
///
/// Aligned to a cache line, so that in its `Arc` the reference counts, which readers and the
/// watch queue change from other threads, sit apart from the lock the writer takes.
#[derive(Debug, Default)]
#[repr(align(64))]
pub(crate) struct Pending {
    pub changes: RwLock<Changes>,
}

impl Pending {
    /// An empty buffer with room for `revs` changes, its chunks from `pool`.
    pub fn with_capacity(revs: usize, pool: Arc<ChunkPool>) -> Pending {
        Pending {
            changes: RwLock::new(Changes {
                revs: Vec::with_capacity(revs),
                records: Records::pooled(pool),
                ..Changes::default()
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pooled buffer's full-size chunks go back to the pool when it drops, at most as many
    /// as it had, and the next buffer writes into them.
    #[test]
    fn full_chunks_go_back_to_the_pool_and_are_written_again() {
        let pool = Arc::new(ChunkPool::default());
        let fill = |records: &mut Records, n: usize| {
            let value = vec![7u8; 1000];
            (0..n).map(|_| records.push(&value)).collect::<Vec<_>>()
        };
        let mut big = Records::pooled(pool.clone());
        fill(&mut big, 1000);
        let full: Vec<*const u8> = big
            .chunks
            .iter()
            .filter(|c| c.capacity() == Records::CHUNK)
            .map(|c| c.as_ptr())
            .collect();
        assert!(full.len() >= 10, "{} full chunks", full.len());
        drop(big);
        assert_eq!(pool.len(), full.len());

        // The next buffer takes pooled chunks from its first record on, and reads back what
        // it wrote into them.
        let mut next = Records::pooled(pool.clone());
        let at = fill(&mut next, 200);
        assert!(full.contains(&next.chunks[0].as_ptr()));
        assert!(at.iter().all(|&a| next.get(a) == [7u8; 1000].as_slice()));
        let taken = next.chunks.len();
        assert_eq!(pool.len(), full.len() - taken);

        // A smaller buffer given back leaves the pool at its own size.
        drop(next);
        assert_eq!(pool.len(), taken);

        // Records outside the pool keep their chunks to themselves.
        let mut staged = Records::default();
        fill(&mut staged, 200);
        drop(staged);
        assert_eq!(pool.len(), taken);
    }

    /// Records of every size, across chunk ends and larger than a chunk, read back as
    /// written, before and after a copy into another buffer; chunks grow from the first
    /// one's size; a cleared buffer keeps its largest chunk and nothing else.
    #[test]
    fn records_read_back_as_written_across_chunks() {
        let record = |i: usize| -> Vec<u8> {
            let len = match i % 7 {
                3 => Records::CHUNK + 3,
                1 => 0,
                _ => (i * 997) % 9_000,
            };
            (0..len).map(|b| (b ^ i) as u8).collect()
        };
        let mut records = Records::default();
        let first = records.push(b"small");
        assert_eq!(records.chunks[0].capacity(), Records::FIRST_CHUNK);
        let at: Vec<RecordAt> = (0..200).map(|i| records.push(&record(i))).collect();
        assert!(records.chunks.len() > 10, "{} chunks", records.chunks.len());
        assert_eq!(records.big.len(), 200 / 7 + 1);
        assert!(
            records
                .chunks
                .iter()
                .all(|c| c.capacity() <= Records::CHUNK)
        );
        assert_eq!(records.get(first), b"small");
        for (i, at) in at.iter().enumerate() {
            assert_eq!(records.get(*at), record(i).as_slice(), "record {i}");
        }
        let mut copy = Records::default();
        let copied: Vec<RecordAt> = at.iter().map(|a| copy.push(records.get(*a))).collect();
        for (i, at) in copied.iter().enumerate() {
            assert_eq!(copy.get(*at), record(i).as_slice(), "copied record {i}");
        }

        records.clear();
        assert_eq!(records.chunks.len(), 1);
        assert!(records.big.is_empty());
        assert!(records.chunks[0].is_empty());
        assert_eq!(records.chunks[0].capacity(), Records::CHUNK);
        let at = records.push(b"again");
        assert_eq!(records.get(at), b"again");
    }

    /// A buffer absorbing another's changes copies their records, moves those with an
    /// allocation of their own, and leaves the other empty, ready for reuse.
    #[test]
    fn absorbing_copies_small_records_and_moves_big_ones() {
        let big = vec![9u8; Records::CHUNK + 1];
        let mut into = Changes::default();
        let mut from = Changes::default();
        for (changes, main) in [(&mut into, 1), (&mut from, 2)] {
            for sub in 0..3u64 {
                let bytes = format!("record {main}.{sub}");
                let record = changes.records.push(bytes.as_bytes());
                changes.revs.push(PendingRev {
                    rev: Revision::new(main, sub),
                    tombstone: false,
                    record,
                });
                changes.writes += 1;
            }
        }
        let record = from.records.push(&big);
        let big_at = from.records.get(record).as_ptr();
        from.revs.push(PendingRev {
            rev: Revision::new(2, 3),
            tombstone: false,
            record,
        });
        from.writes += 1;
        into.absorb_from(&mut from);
        assert!(from.is_empty() && from.revs.is_empty() && from.records.big.is_empty());
        assert_eq!(into.writes, 7);
        assert_eq!(into.find(Revision::new(2, 1)), Some(&b"record 2.1"[..]));
        assert_eq!(into.find(Revision::new(1, 2)), Some(&b"record 1.2"[..]));
        let moved = into.find(Revision::new(2, 3)).expect("the big record");
        assert_eq!(moved, big.as_slice());
        assert_eq!(moved.as_ptr(), big_at, "moved, not copied");
        assert_eq!(into.find(Revision::new(2, 4)), None);
    }

    /// A transaction that staged [`MOVE_CHUNKS`] bytes or more of small records has its
    /// chunks moved, not copied; the records read back as staged, beside those already in
    /// the buffer and a big one, and the buffer keeps taking records after it. Clearing
    /// keeps a full-size chunk.
    #[test]
    fn absorbing_a_large_transaction_moves_its_chunks() {
        let mut into = Changes::default();
        let mut from = Changes::default();
        let record = |main: u64, sub: u64| -> Vec<u8> {
            let mut r = format!("record {main}.{sub} ").into_bytes();
            r.resize(r.len() + (sub as usize * 131) % 3000, sub as u8);
            r
        };
        let add = |changes: &mut Changes, main: u64, sub: u64, bytes: &[u8]| {
            let at = changes.records.push(bytes);
            changes.revs.push(PendingRev {
                rev: Revision::new(main, sub),
                tombstone: false,
                record: at,
            });
            changes.writes += 1;
        };
        for sub in 0..5 {
            add(&mut into, 1, sub, &record(1, sub));
        }
        let mut staged = 0;
        let mut sub = 0;
        while staged < MOVE_CHUNKS + 1000 {
            let r = record(2, sub);
            staged += r.len();
            add(&mut from, 2, sub, &r);
            sub += 1;
        }
        add(&mut from, 2, sub, &vec![3u8; Records::CHUNK + 7]);
        let staged_chunk = from.records.chunks[0].as_ptr();
        into.absorb_from(&mut from);
        assert!(from.records.chunks.is_empty(), "the chunks moved");
        assert!(
            into.records
                .chunks
                .iter()
                .any(|c| c.as_ptr() == staged_chunk),
            "moved, not copied"
        );
        for s in 0..5 {
            assert_eq!(
                into.find(Revision::new(1, s)),
                Some(record(1, s).as_slice())
            );
        }
        for s in 0..sub {
            assert_eq!(
                into.find(Revision::new(2, s)),
                Some(record(2, s).as_slice())
            );
        }
        assert_eq!(
            into.find(Revision::new(2, sub)),
            Some(vec![3u8; Records::CHUNK + 7].as_slice())
        );
        // A small transaction after it is copied, behind the moved chunks.
        add(&mut from, 3, 0, b"after");
        into.absorb_from(&mut from);
        assert_eq!(into.find(Revision::new(3, 0)), Some(&b"after"[..]));
        assert_eq!(
            into.find(Revision::new(2, 1)),
            Some(record(2, 1).as_slice())
        );
        into.records.clear();
        assert_eq!(into.records.chunks.len(), 1);
        assert_eq!(into.records.chunks[0].capacity(), Records::CHUNK);
    }
}
