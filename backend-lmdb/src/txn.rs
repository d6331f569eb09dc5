//! Snapshot read transactions.
//!
//! An [`LmdbReadTxn`] is an LMDB read-only transaction on the environment of one generation,
//! opened in `MDB_NOTLS` mode so that it can move between threads. It owns an `Arc` of its
//! generation, so it stays valid after the backend handle is dropped or a defragment swaps in a
//! new generation. LMDB read transactions take no lock the writer waits for: a commit never
//! waits for readers, and readers never wait for a commit.
//!
//! Dropping the last read transaction of a generation that defragment or map growth has
//! superseded closes that generation's environment and deletes its directory, on the
//! dropping thread.
//!
//! A long-lived read transaction pins the pages of its snapshot: LMDB cannot reuse them, so the
//! data file grows while it is open. The MVCC store keeps its read transactions short for this
//! reason.

use std::ops::Bound;
use std::path::Path;
use std::sync::Arc;

use heed::types::Bytes;
use heed::{RoRange, RoTxn, WithoutTls};
use keel_mvcc::{BackendError, Bucket, ReadTxn};

use crate::env::{Dbs, Generation};
use crate::error::{LmdbError, from_heed};
use crate::keys;

/// Attempts at opening a read transaction whose snapshot matches its commit stamp: with
/// the back-off below, about ten seconds of a writer that does not publish.
const MAX_OPEN_ATTEMPTS: u32 = 10_000;
/// Attempts that only yield the CPU before the next; later ones sleep, 10 µs doubling up to
/// 1.28 ms.
const SPIN_ATTEMPTS: u32 = 64;

/// Keys up to this many stored bytes are looked up without allocating.
const STACK_KEY: usize = 512;

/// A consistent read-only view of an [`LmdbBackend`](crate::LmdbBackend) as of one commit.
pub struct LmdbReadTxn {
    // Dropped before `generation`: the transaction ends before its environment may close.
    txn: RoTxn<'static, WithoutTls>,
    /// Handles of the bucket databases, every one valid in `txn`, covering its snapshot.
    dbs: Arc<Dbs>,
    max_key: usize,
    generation: Arc<Generation>,
}

impl LmdbReadTxn {
    /// Opens a read transaction on `generation`, retrying until LMDB hands out a snapshot
    /// that is the commit its transaction id names and whose buckets all have handles.
    ///
    /// LMDB (0.9, as bundled by heed) begins a read transaction by reading the last
    /// transaction id `T` and then copying meta page `T & 1`. A reader preempted between the
    /// two can find that page already overwritten by commit `T + 2`, and so see a commit that
    /// had not returned when it began, while a reader opened just after sees `T + 1`: reads
    /// go back in time. Every commit writes its own transaction id under
    /// [`keys::COMMIT_STAMP`], so the snapshot says which commit it is; a mismatch means the
    /// race was hit and the transaction is opened again. The stamp's layout id says which
    /// bucket databases the snapshot has (see `env`): newer than the handles taken before the
    /// transaction began means a commit creating a bucket is being published, and the
    /// transaction is opened again too. This never waits for the writer.
    pub(crate) fn begin(
        generation: Arc<Generation>,
        max_readers: u32,
    ) -> Result<LmdbReadTxn, BackendError> {
        let main = generation.main();
        for attempt in 0..MAX_OPEN_ATTEMPTS {
            // Before the transaction: see the module docs of `env`.
            let dbs = generation.dbs();
            let txn = generation
                .env()
                .clone()
                .static_read_txn()
                .map_err(|e| match e {
                    heed::Error::Mdb(heed::MdbError::ReadersFull) => {
                        BackendError::Other(Box::new(LmdbError::ReadersFull {
                            path: generation.dir().to_path_buf(),
                            max_readers,
                        }))
                    }
                    e => from_heed(generation.dir(), "begin read transaction", e),
                })?;
            let id = txn.id() as u64;
            let stamp = main
                .get(&txn, keys::COMMIT_STAMP)
                .map_err(|e| from_heed(generation.dir(), "read commit stamp", e))?
                .and_then(keys::parse_stamp);
            if let Some((stamped, layout)) = stamp
                && stamped == id
                && layout <= dbs.layout()
            {
                return Ok(LmdbReadTxn {
                    txn,
                    dbs,
                    max_key: generation.max_key(),
                    generation,
                });
            }
            drop(txn);
            tracing::debug!(
                attempt,
                id,
                "read transaction saw a later commit or an unpublished bucket; reopening"
            );
            // The writer publishes within microseconds unless it is descheduled (a loaded
            // machine): yield at first, then back off up to a millisecond per attempt.
            if attempt < SPIN_ATTEMPTS {
                std::thread::yield_now();
            } else {
                let exp = (attempt - SPIN_ATTEMPTS).min(7);
                std::thread::sleep(std::time::Duration::from_micros(10 << exp));
            }
        }
        Err(BackendError::Other(Box::new(
            LmdbError::NoConsistentSnapshot {
                path: generation.dir().to_path_buf(),
                attempts: MAX_OPEN_ATTEMPTS,
            },
        )))
    }

    /// LMDB's id of the commit this transaction sees.
    pub fn commit_id(&self) -> usize {
        self.txn.id()
    }

    fn err(&self, op: &'static str, e: heed::Error) -> BackendError {
        from_heed(self.generation.dir(), op, e)
    }
}

impl ReadTxn for LmdbReadTxn {
    type Range<'a> = LmdbRange<'a>;

    #[inline]
    fn get(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<&[u8]>, BackendError> {
        let Some(db) = self.dbs.get(bucket.name()) else {
            return Ok(None);
        };
        let len = keys::MARK_LEN + key.len();
        if len > self.max_key {
            // Longer than any stored key: absent.
            return Ok(None);
        }
        let found = if len <= STACK_KEY {
            let mut buf = [keys::KEY_MARK; STACK_KEY];
            buf[keys::MARK_LEN..len].copy_from_slice(key);
            db.get(&self.txn, &buf[..len])
        } else {
            let mut buf = Vec::new();
            keys::encode_into(key, &mut buf);
            db.get(&self.txn, &buf)
        };
        found.map_err(|e| self.err("get", e))
    }

    fn range<'a>(
        &'a self,
        bucket: &Bucket,
        start: &[u8],
        end: Option<&[u8]>,
    ) -> Result<LmdbRange<'a>, BackendError> {
        let empty = LmdbRange {
            inner: None,
            last: 0,
            #[cfg(debug_assertions)]
            upper: Bound::Unbounded,
            dir: self.generation.dir(),
        };
        let Some(db) = self.dbs.get(bucket.name()) else {
            return Ok(empty);
        };
        let Some((lower, upper)) = keys::range_bounds(start, end, self.max_key) else {
            return Ok(empty);
        };
        // The last pair of the range is found up front, so each step checks the end with one
        // pointer comparison (keys point into the snapshot's pages, one address per key)
        // instead of comparing key bytes with the end bound.
        let last = match &upper {
            Bound::Excluded(end) => db.get_lower_than(&self.txn, end),
            Bound::Included(end) => db.get_lower_than_or_equal_to(&self.txn, end),
            Bound::Unbounded => db.last(&self.txn),
        }
        .map_err(|e| self.err("seek range end", e))?;
        let Some((last, _)) = last else {
            return Ok(empty);
        };
        let before_start = match &lower {
            Bound::Included(start) => last < start.as_slice(),
            Bound::Excluded(start) => last <= start.as_slice(),
            Bound::Unbounded => false,
        };
        if before_start {
            return Ok(empty);
        }
        let bounds = (as_slice(&lower), Bound::Unbounded);
        let inner = db
            .range(&self.txn, &bounds)
            .map_err(|e| self.err("range", e))?;
        Ok(LmdbRange {
            inner: Some(inner),
            last: last.as_ptr().addr(),
            #[cfg(debug_assertions)]
            upper,
            dir: self.generation.dir(),
        })
    }

    fn buckets(&self) -> Result<Vec<Bucket>, BackendError> {
        let mut out = Vec::new();
        for (name, db) in self.dbs.iter() {
            if db.is_empty(&self.txn).map_err(|e| self.err("stat", e))? {
                continue;
            }
            let bucket = Bucket::from_name(name.to_owned()).map_err(|_| BackendError::Corrupt {
                path: self.generation.dir().join(crate::env::DATA_FILE),
                offset: 0,
                reason: format!("bucket database {name:?} has an invalid bucket name"),
            })?;
            out.push(bucket);
        }
        Ok(out)
    }
}

fn as_slice(bound: &Bound<Vec<u8>>) -> Bound<&[u8]> {
    match bound {
        Bound::Included(v) => Bound::Included(v.as_slice()),
        Bound::Excluded(v) => Bound::Excluded(v.as_slice()),
        Bound::Unbounded => Bound::Unbounded,
    }
}

/// Iterator over a key range of one bucket, in ascending key order.
pub struct LmdbRange<'a> {
    inner: Option<RoRange<'a, Bytes, Bytes>>,
    /// Address of the last stored key in the range.
    last: usize,
    /// Bound on stored keys where the range ends, to check `last` in debug builds.
    #[cfg(debug_assertions)]
    upper: Bound<Vec<u8>>,
    /// The generation directory, for errors.
    dir: &'a Path,
}

impl<'a> Iterator for LmdbRange<'a> {
    type Item = Result<(&'a [u8], &'a [u8]), BackendError>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        let item = self.inner.as_mut()?.next()?;
        Some(match item {
            Ok((stored, value)) => {
                #[cfg(debug_assertions)]
                debug_assert!(
                    match &self.upper {
                        Bound::Excluded(end) => stored < end.as_slice(),
                        Bound::Included(end) => stored <= end.as_slice(),
                        Bound::Unbounded => true,
                    },
                    "range iteration passed its last key"
                );
                if stored.as_ptr().addr() == self.last {
                    self.inner = None;
                }
                match stored.get(keys::MARK_LEN..) {
                    Some(key) => Ok((key, value)),
                    None => Err(BackendError::Corrupt {
                        path: self.dir.join(crate::env::DATA_FILE),
                        offset: 0,
                        reason: "a stored key is shorter than its mark".to_owned(),
                    }),
                }
            }
            Err(e) => {
                self.inner = None;
                Err(from_heed(self.dir, "range next", e))
            }
        })
    }
}
