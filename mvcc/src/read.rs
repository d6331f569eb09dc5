//! Read views: snapshot reads at a revision, and the lookups shared with write transactions.
//!
//! A view resolves a range in two steps: it walks the key index in chunks of
//! [`INDEX_CHUNK`](crate::store::INDEX_CHUNK) keys (holding the index read lock only per
//! chunk) to find, per key, the revision visible at the view's revision; then it reads those
//! revisions' records from the pending buffers it holds or from its backend read transaction,
//! walking the backend in revision order with one cursor (re-seeking over gaps).
//!
//! A long read does not keep one backend read transaction for its whole life: after every
//! [`REFRESH_RECORDS`] records read from the backend, the view moves to a fresh read
//! transaction (and drops the old one), so a backend whose readers pin space (LMDB cannot
//! reuse pages freed after its oldest reader began) reclaims it while the view keeps reading.
//! The result is the same: revisions are immutable, every revision up to the view's is kept
//! until a compaction above it, and a fresher transaction holds everything an older one held
//! except what compaction deleted. Compaction's physical deletion is what could differ, so a
//! view *pins* its revision while it lives (`Inner::pin_view`), and the compactor does not
//! delete history of a compaction above the oldest pinned revision until that view is gone.
//!
//! A view opens its backend read transaction when it first reads the backend, not when it
//! opens: any transaction opened after the view took its buffers holds what it needs, for
//! the same reasons.
//!
//! A long read through a view gives way to writes: between chunks (of the key index, and
//! every [`INDEX_CHUNK`](crate::store::INDEX_CHUNK) records read from the backend) it pauses
//! as `pace` says, and when it sleeps it first lets go of its backend read transaction and
//! moves to a fresh one after. A write transaction's own reads hold the writer mutex and
//! never pause.

use std::cell::RefCell;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use parking_lot::Mutex;

use crate::backend::{Backend, ReadTxn};
use crate::error::MvccError;
use crate::key_index::KeyAt;
use crate::kv::{KeyValue, KvArena, decode_record};
use crate::pace::Pacer;
use crate::pending::{Changes, Pending, RecordAt, Records};
use crate::request::{Bound, RangeRequest, RangeResponse, bound, check_range};
use crate::revision::{REV_KEY_LEN, Revision};
use crate::store::{INDEX_CHUNK, Inner, KEY_BUCKET};

/// Entries a cursor may skip before a lookup re-seeks instead.
const MAX_SKIP: usize = 16;

/// Lookups of revisions in a write buffer per hold of its lock (see
/// `Sources::find_buffered`).
const LOOKUPS_PER_LOCK: usize = 16;

/// Records a view reads from one backend read transaction before it moves to a fresh one.
pub(crate) const REFRESH_RECORDS: usize = 1024;

/// A consistent read-only view of the store at one revision.
///
/// It sees every write transaction committed before it was opened, whether or not the
/// backend holds it yet, and nothing later. It is `Send + 'static`: keep it on any thread for
/// as long as needed; writers and backend commits never wait for it. A read below the
/// compaction point fails with [`MvccError::Compacted`], also when a compaction overtakes a
/// view that is still open.
pub struct ReadView<B: Backend> {
    pub(crate) inner: Arc<Inner<B>>,
    pub(crate) revision: u64,
    pub(crate) current: Arc<Pending>,
    pub(crate) committing: Option<Arc<Pending>>,
    /// The freshest backend read transaction this view has opened; `None` before its first
    /// backend read and while a paced read sleeps.
    txn: Mutex<Option<Arc<B::ReadTxn>>>,
}

impl<B: Backend> ReadView<B> {
    pub(crate) fn open(inner: &Arc<Inner<B>>) -> Result<ReadView<B>, MvccError> {
        let (revision, current, committing) = {
            let st = inner.state.lock();
            (st.revision, st.current.clone(), st.committing.clone())
        };
        inner.pin_view(revision);
        // Its backend read transaction, opened after the buffers were taken, holds anything
        // that left them since.
        Ok(ReadView {
            inner: inner.clone(),
            revision,
            current,
            committing,
            txn: Mutex::new(None),
        })
    }

    /// The revision this view reads at.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Reads a key or range at `req.revision` (0: the view's revision).
    pub fn range(&self, req: &RangeRequest) -> Result<RangeResponse, MvccError> {
        range(&self.inner, &self.sources(None), req, self.revision)
    }

    pub(crate) fn sources<'a>(&'a self, staged: Option<&'a Changes>) -> Sources<'a, B::ReadTxn> {
        Sources {
            staged,
            current: &self.current,
            committing: self.committing.as_deref(),
            txn: RefCell::new(self.txn.lock().clone()),
            view: self,
            pacer: staged.is_none().then(|| Pacer::new(&*self.inner)),
        }
    }
}

impl<B: Backend> Refresh<B::ReadTxn> for ReadView<B> {
    fn fresh_txn(&self) -> Result<Arc<B::ReadTxn>, MvccError> {
        // The view's older transaction ends once no running read holds it.
        *self.txn.lock() = None;
        let txn = Arc::new(self.inner.backend.read_txn()?);
        *self.txn.lock() = Some(txn.clone());
        Ok(txn)
    }

    fn release_txn(&self) {
        *self.txn.lock() = None;
    }
}

impl<B: Backend> Drop for ReadView<B> {
    fn drop(&mut self) {
        self.inner.unpin_view(self.revision);
    }
}

/// A view's backend read transaction, as its reads open and drop it (see the module docs).
pub(crate) trait Refresh<T> {
    /// Opens a fresh backend read transaction and makes it the view's.
    fn fresh_txn(&self) -> Result<Arc<T>, MvccError>;
    /// Drops the view's backend read transaction: the next read opens a fresh one.
    fn release_txn(&self);
}

/// Where a reader finds records: a write transaction's own changes, the pending buffers, the
/// backend.
pub(crate) struct Sources<'a, T: ReadTxn> {
    pub staged: Option<&'a Changes>,
    pub current: &'a Pending,
    pub committing: Option<&'a Pending>,
    /// The freshest backend read transaction, opened at the first backend read: replaced
    /// (and the older one released) when a long read moves to a fresh one, so nothing keeps
    /// the first one alive to the end, and dropped while a paced read sleeps.
    txn: RefCell<Option<Arc<T>>>,
    /// The view read through: where fresh read transactions come from.
    view: &'a dyn Refresh<T>,
    /// Paces a long read between chunks; `None` never pauses (a write transaction's reads).
    pacer: Option<Pacer<'a>>,
}

impl<T: ReadTxn> Sources<'_, T> {
    /// The backend read transaction to read from: the freshest one, or a new one.
    fn txn(&self) -> Result<Arc<T>, MvccError> {
        if let Some(txn) = &*self.txn.borrow() {
            return Ok(txn.clone());
        }
        self.fresh_txn()
    }

    /// Moves to a fresh backend read transaction.
    fn fresh_txn(&self) -> Result<Arc<T>, MvccError> {
        *self.txn.borrow_mut() = None;
        let txn = self.view.fresh_txn()?;
        *self.txn.borrow_mut() = Some(txn.clone());
        Ok(txn)
    }

    /// Between chunks of a long read: the sleep due, if any (see `pace`).
    fn due(&self) -> Option<Duration> {
        self.pacer.as_ref().and_then(Pacer::due)
    }

    /// Takes a sleep [`due`](Self::due) returned, holding no backend read transaction (the
    /// caller holds none either); the next backend read opens a fresh one.
    fn sleep(&self, owed: Duration) {
        *self.txn.borrow_mut() = None;
        self.view.release_txn();
        if let Some(pacer) = &self.pacer {
            pacer.sleep(owed);
        }
    }

    /// Between chunks of a long read that holds no backend read transaction of its own:
    /// pauses as `pace` says.
    pub fn pause(&self) {
        if let Some(owed) = self.due() {
            self.sleep(owed);
        }
    }

    /// The records at `revs` (puts, in any order) as key-values, in the same order.
    pub fn fetch(
        &self,
        compacted: impl Fn() -> u64,
        revs: &[Revision],
        with_value: bool,
    ) -> Result<Vec<KeyValue>, MvccError> {
        self.fetch_into(compacted, revs, None, with_value)
    }

    /// [`fetch`](Self::fetch), given with `keys` the tags of the keys the index names for
    /// the revisions, which each record's key is checked against.
    ///
    /// The entries' keys and values are copied out into buffers they share ([`KvArena`]).
    pub fn fetch_into(
        &self,
        compacted: impl Fn() -> u64,
        revs: &[Revision],
        keys: Option<&KeyTags>,
        with_value: bool,
    ) -> Result<Vec<KeyValue>, MvccError> {
        debug_assert!(keys.is_none_or(|k| k.tags.len() == revs.len()));
        // A buffer only holds revisions from its first one on, and a view only asks for
        // revisions it could see when it opened, so a revision below a buffer's first is not
        // in it. Buffers are locked per lookup, only for revisions that may be there: a long
        // scan of committed data never holds a lock a writer needs.
        let first = |p: &Pending| p.changes.read().revs.first().map(|c| c.rev);
        let buffers: Vec<(&Pending, Revision)> = [Some(self.current), self.committing]
            .into_iter()
            .flatten()
            .filter_map(|p| first(p).map(|f| (p, f)))
            .collect();
        let staged = self.staged.filter(|s| !s.revs.is_empty());
        // The common case of a read of committed data: every revision is below the buffers'
        // and nothing is staged, and the index yielded them in revision order (keys written
        // in key order): the backend is read for `revs` as they are, without a list of misses.
        let below = buffers.iter().map(|(_, lo)| *lo).min();
        let in_order = staged.is_none()
            && revs.is_sorted()
            && below.is_none_or(|lo| revs.last().is_none_or(|r| *r < lo));
        // Results come in order on the common path below, and are pushed; the other path
        // fills them in any order, into entries made up front.
        let mut out: Vec<KeyValue> = Vec::with_capacity(revs.len());
        if !in_order {
            out.resize_with(revs.len(), KeyValue::default);
        }
        let mut arena = KvArena::new(revs.len());
        let mut build = |i: usize, rev: Revision, rec: &[u8]| -> Result<(), MvccError> {
            let r = decode_record(rev, rec)?;
            if keys.is_some_and(|k| !k.matches(i, r.key)) {
                return Err(MvccError::Corrupt {
                    revision: rev,
                    reason: "record key differs from the key index".to_owned(),
                });
            }
            let kv = arena.kv(&r, with_value);
            if i == out.len() {
                out.push(kv);
            } else {
                out[i] = kv;
            }
            Ok(())
        };
        if in_order {
            self.read_backend(&compacted, revs.len(), |m| (revs[m], m), &mut build)?;
            return Ok(out);
        }
        // Revisions below every buffer are read from the backend; the rest are looked up in
        // the buffers in ascending order, each buffer's changes walked once.
        let mut misses: Vec<(Revision, usize)> = Vec::new();
        let mut buffered: Vec<(Revision, usize)> = Vec::new();
        for (i, &rev) in revs.iter().enumerate() {
            if let Some(record) = staged.and_then(|s| s.find(rev)) {
                build(i, rev, record)?;
            } else if below.is_some_and(|lo| rev >= lo) {
                buffered.push((rev, i));
            } else {
                misses.push((rev, i));
            }
        }
        self.find_buffered(&buffers, buffered, &mut misses, &mut build)?;
        sort_misses(&mut misses);
        self.read_backend(&compacted, misses.len(), |m| misses[m], &mut build)?;
        Ok(out)
    }

    /// Looks `wanted` (revisions at or above the first of some buffer of `buffers`, with
    /// their slots) up in the buffers: `build(slot, revision, record)` for those found, and
    /// those not found go to `misses`.
    ///
    /// The revisions are sorted and each buffer's changes walked once in revision order. A
    /// buffer's lock is held for [`LOOKUPS_PER_LOCK`] lookups at most, so a writer appending
    /// to it waits for a few record copies at most; the read pauses as `pace` says every
    /// [`INDEX_CHUNK`] lookups, holding no lock. (Changes are only appended to a buffer, so
    /// positions in it found under one hold of its lock stay good under the next.)
    fn find_buffered(
        &self,
        buffers: &[(&Pending, Revision)],
        mut wanted: Vec<(Revision, usize)>,
        misses: &mut Vec<(Revision, usize)>,
        build: &mut impl FnMut(usize, Revision, &[u8]) -> Result<(), MvccError>,
    ) -> Result<(), MvccError> {
        if wanted.is_empty() {
            return Ok(());
        }
        sort_misses(&mut wanted);
        // Buffers by first revision: a buffer holds revisions from its first one up to the
        // next one's, and every wanted revision is at or above the first buffer's.
        let mut buffers = buffers.to_vec();
        buffers.sort_unstable_by_key(|(_, first)| *first);
        let mut w = 0;
        let mut since_pause = 0;
        for (b, (pending, _)) in buffers.iter().enumerate() {
            let upto = buffers.get(b + 1).map(|(_, first)| *first);
            let in_this = |w: usize| wanted.get(w).filter(|(r, _)| upto.is_none_or(|u| *r < u));
            let mut at = 0;
            while in_this(w).is_some() {
                let changes = pending.changes.read();
                for _ in 0..LOOKUPS_PER_LOCK {
                    let Some(&(rev, slot)) = in_this(w) else {
                        break;
                    };
                    at = changes.seek(at, rev);
                    match changes.revs.get(at) {
                        Some(p) if p.rev == rev => build(slot, rev, changes.record(p))?,
                        _ => misses.push((rev, slot)),
                    }
                    w += 1;
                    since_pause += 1;
                }
                drop(changes);
                if since_pause >= INDEX_CHUNK {
                    since_pause = 0;
                    self.pause();
                }
            }
        }
        Ok(())
    }

    /// Reads `n` revisions from the backend, the `m`th being `miss(m) = (revision, slot)`, in
    /// ascending revision order, with one cursor (re-seeking over gaps of more than
    /// [`MAX_SKIP`] entries): `build(slot, revision, record)` for each.
    fn read_backend(
        &self,
        compacted: &impl Fn() -> u64,
        n: usize,
        miss: impl Fn(usize) -> (Revision, usize),
        build: &mut impl FnMut(usize, Revision, &[u8]) -> Result<(), MvccError>,
    ) -> Result<(), MvccError> {
        if n == 0 {
            return Ok(());
        }
        let mut txn = Some(self.txn()?);
        let mut read = 0usize;
        let mut m = 0;
        while m < n {
            let held = match txn.take() {
                Some(held) if read < REFRESH_RECORDS => held,
                _ => {
                    read = 0;
                    self.fresh_txn()?
                }
            };
            let (mut want, mut slot) = miss(m);
            let start = want.to_bytes();
            let mut skipped = 0;
            let mut due = None;
            let mut iter = held.range(&KEY_BUCKET, &start, None)?;
            loop {
                if read >= REFRESH_RECORDS {
                    break;
                }
                read += 1;
                if read.is_multiple_of(INDEX_CHUNK) {
                    due = self.due();
                    if due.is_some() {
                        break;
                    }
                }
                let Some(item) = iter.next() else {
                    return Err(missing(want, compacted));
                };
                let (k, v) = item?;
                let have = Revision::from_key(k).map(|(r, _)| r);
                match have {
                    Some(r) if r == want && k.len() == REV_KEY_LEN => {
                        build(slot, r, v)?;
                        m += 1;
                        skipped = 0;
                        if m == n {
                            break;
                        }
                        (want, slot) = miss(m);
                    }
                    Some(r) if r < want => {
                        skipped += 1;
                        if skipped > MAX_SKIP {
                            break;
                        }
                    }
                    _ => return Err(missing(want, compacted)),
                }
            }
            drop(iter);
            match due {
                // The next round opens a fresh transaction.
                Some(owed) => {
                    drop(held);
                    self.sleep(owed);
                }
                None => txn = Some(held),
            }
        }
        Ok(())
    }

    /// Visits every stored change with `from <= revision` and `revision.main <= to`, in
    /// revision order: `f(revision, tombstone, revision key, record)`; stops when `f` returns
    /// false.
    pub fn for_each_change(
        &self,
        from: Revision,
        to: u64,
        mut f: impl FnMut(Revision, bool, &[u8], &[u8]) -> Result<bool, MvccError>,
    ) -> Result<(), MvccError> {
        let end = Revision::new(to.saturating_add(1), 0).to_bytes();
        let mut last: Option<Revision> = None;
        let txn = self.txn()?;
        for item in txn.range(&KEY_BUCKET, &from.to_bytes(), Some(&end[..]))? {
            let (k, v) = item?;
            let Some((rev, tomb)) = Revision::from_key(k) else {
                continue;
            };
            last = Some(rev);
            if !f(rev, tomb, k, v)? {
                return Ok(());
            }
        }
        // The backend holds a prefix of the history; the buffers hold the rest (perhaps also
        // some of what the backend holds).
        let buffers = self
            .committing
            .into_iter()
            .chain(std::iter::once(self.current));
        let mut records = Records::default();
        let mut changes: Vec<(Revision, bool, RecordAt)> = Vec::new();
        for p in buffers {
            // The changes in range are copied out, some at a time, and `f` runs with the
            // buffer unlocked: `f` may read the store, and a second read lock of the same
            // buffer would wait behind a writer queued for it, which holds the store's state
            // lock that this thread's reads also need. A batch is bounded, so the lock is
            // held briefly and the copies stay small.
            loop {
                records.clear();
                changes.clear();
                {
                    let buf = p.changes.read();
                    let lo = buf
                        .revs
                        .partition_point(|c| c.rev < from || last.is_some_and(|l| c.rev <= l));
                    let mut bytes = 0;
                    for c in buf.revs[lo..].iter().take_while(|c| c.rev.main <= to) {
                        if changes.len() == COPY_CHANGES || bytes >= COPY_BYTES {
                            break;
                        }
                        let record = buf.record(c);
                        bytes += record.len();
                        changes.push((c.rev, c.tombstone, records.push(record)));
                    }
                }
                if changes.is_empty() {
                    break;
                }
                for &(rev, tombstone, record) in &changes {
                    last = Some(rev);
                    if !f(rev, tombstone, &rev.to_key(tombstone), records.get(record))? {
                        return Ok(());
                    }
                }
            }
        }
        Ok(())
    }
}

/// Most changes [`Sources::for_each_change`] copies out of a write buffer per read lock.
const COPY_CHANGES: usize = 256;
/// Bytes of records after which [`Sources::for_each_change`] stops copying for one read lock.
const COPY_BYTES: usize = 1 << 20;

/// Sorts `(revision, slot)` pairs by revision, then slot (slots come in ascending order).
///
/// A whole-key-space read sorts one pair per key, in an order unrelated to revisions once
/// keys were rewritten at random, so long inputs are radix-sorted: one stable counting pass
/// per byte of `(main, sub)` that differs between the pairs (three or four for a store of
/// millions of revisions), instead of a comparison sort's `n log n` comparisons.
fn sort_misses(misses: &mut Vec<(Revision, usize)>) {
    // Reads of keys written in key order find their revisions in order already.
    if misses.is_sorted() {
        return;
    }
    if misses.len() < 512 {
        misses.sort_unstable();
        return;
    }
    let key = |r: &Revision| (u128::from(r.main) << 64) | u128::from(r.sub);
    let (mut any, mut all) = (0u128, u128::MAX);
    for (r, _) in misses.iter() {
        any |= key(r);
        all &= key(r);
    }
    let varying = any ^ all;
    let mut src = std::mem::take(misses);
    let mut dst = src.clone();
    for shift in (0..128).step_by(8) {
        if (varying >> shift) & 0xff == 0 {
            continue;
        }
        let digit = |r: &Revision| ((key(r) >> shift) & 0xff) as usize;
        let mut next = [0usize; 256];
        for (r, _) in &src {
            next[digit(r)] += 1;
        }
        let mut at = 0;
        for slot in &mut next {
            let count = *slot;
            *slot = at;
            at += count;
        }
        for item in &src {
            let d = digit(&item.0);
            dst[next[d]] = *item;
            next[d] += 1;
        }
        std::mem::swap(&mut src, &mut dst);
    }
    *misses = src;
}

fn missing(rev: Revision, compacted: &impl Fn() -> u64) -> MvccError {
    let c = compacted();
    if rev.main <= c {
        MvccError::Compacted {
            requested: rev.main,
            compacted: c,
        }
    } else {
        MvccError::Corrupt {
            revision: rev,
            reason: "the key index names a revision the store does not hold".to_owned(),
        }
    }
}

/// The revision a request reads at, checked against the compaction point and `current`.
pub(crate) fn read_revision<B: Backend>(
    inner: &Inner<B>,
    requested: u64,
    current: u64,
) -> Result<u64, MvccError> {
    if requested > current {
        return Err(MvccError::FutureRevision { requested, current });
    }
    let rev = if requested == 0 { current } else { requested };
    let compacted = inner.index.read().compacted;
    if rev < compacted {
        return Err(MvccError::Compacted {
            requested: rev,
            compacted,
        });
    }
    Ok(rev)
}

/// Runs a range for a view (or a write transaction) whose revision is `current`.
pub(crate) fn range<B: Backend>(
    inner: &Inner<B>,
    src: &Sources<'_, B::ReadTxn>,
    req: &RangeRequest,
    current: u64,
) -> Result<RangeResponse, MvccError> {
    check_range(&req.key, req.range_end.as_deref())?;
    if req.bytes() > inner.options.max_request_bytes {
        return Err(MvccError::RequestTooLarge {
            size: req.bytes(),
            limit: inner.options.max_request_bytes,
        });
    }
    let rev = read_revision(inner, req.revision, current)?;
    let b = bound(req.range_end.as_deref());
    let limit = if req.limit == 0 {
        usize::MAX
    } else {
        req.limit
    };
    // Per key, its revision and its tag, to check the record read for it.
    let mut tags = KeyTags::new();
    let mut revs: Vec<Revision> = Vec::new();
    let count = scan_live(inner, &req.key, &b, rev, &|| src.pause(), |key, at| {
        if !req.count_only && revs.len() < limit {
            tags.push(key);
            revs.push(at.modified);
        }
    })?;
    let mut resp = RangeResponse {
        kvs: Vec::new(),
        count,
        more: count > revs.len() && !req.count_only,
        revision: rev,
    };
    if req.count_only {
        resp.more = false;
        return Ok(resp);
    }
    // The results are built once the scan is done, so their vector is allocated once at
    // its size instead of being grown (and copied) while the scan runs.
    let compacted = || inner.index.read().compacted;
    resp.kvs = src.fetch_into(compacted, &revs, Some(&tags), !req.keys_only)?;
    Ok(resp)
}

/// 64-bit tags of keys, for checking that the record a range reads for a key of the index
/// holds that key without keeping a copy of every key: different keys get different tags
/// but for a chance of about 2^-64.
///
/// The length, then each 8-byte word of a key (the last one zero-padded), goes into the
/// state through a folded multiply (the 128-bit product of `state ^ word` with an odd
/// constant, its high half xored into its low half: the fold foldhash and wyhash are built
/// on), and a last fold spreads the last word over every bit. The state starts from a seed
/// drawn at random once per process, so keys cannot be chosen to share a tag (a word equal to
/// the state would wipe what came before it, but the state cannot be known).
pub(crate) struct KeyTags {
    seed: u64,
    tags: Vec<u64>,
}

impl KeyTags {
    /// No tags yet.
    pub fn new() -> KeyTags {
        static SEED: LazyLock<u64> =
            LazyLock::new(|| RandomState::new().hash_one(0x6b65_656c_2d74_6167_u64));
        KeyTags {
            seed: *SEED,
            tags: Vec::new(),
        }
    }

    /// Adds the tag of `key`.
    #[inline]
    pub fn push(&mut self, key: &[u8]) {
        let tag = self.tag(key);
        self.tags.push(tag);
    }

    /// Whether `key` has the `i`th tag.
    #[inline]
    pub fn matches(&self, i: usize, key: &[u8]) -> bool {
        self.tags.get(i) == Some(&self.tag(key))
    }

    /// The tag of `key`.
    #[inline]
    fn tag(&self, key: &[u8]) -> u64 {
        const K: u64 = 0x9e37_79b9_7f4a_7c15;
        const LAST: u64 = 0xbf58_476d_1ce4_e5b9;
        let fold = |a: u64, b: u64| {
            let m = u128::from(a) * u128::from(b);
            (m as u64) ^ ((m >> 64) as u64)
        };
        let mut h = fold(self.seed ^ key.len() as u64, K);
        let mut words = key.chunks_exact(8);
        for w in &mut words {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            h = fold(h ^ u64::from_le_bytes(b), K);
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut b = [0u8; 8];
            b[..rest.len()].copy_from_slice(rest);
            h = fold(h ^ u64::from_le_bytes(b), K);
        }
        fold(h ^ LAST, K)
    }
}

/// Calls `f(key, state)` for every key of `[start, bound)` live at `rev`, in key order, holding
/// the index lock one chunk at a time and calling `pause` between chunks; returns how many
/// there were.
pub(crate) fn scan_live<B: Backend>(
    inner: &Inner<B>,
    start: &[u8],
    b: &Bound<'_>,
    rev: u64,
    pause: &dyn Fn(),
    mut f: impl FnMut(&[u8], KeyAt),
) -> Result<usize, MvccError> {
    let mut count = 0;
    // The last key of the previous chunk: the next chunk starts after it.
    let mut after: Option<Vec<u8>> = None;
    let mut last: Vec<u8> = Vec::new();
    loop {
        let idx = inner.index.read();
        if rev < idx.compacted {
            return Err(MvccError::Compacted {
                requested: rev,
                compacted: idx.compacted,
            });
        }
        let mut seen = 0;
        let done = idx.keys.scan(start, b, after.as_deref(), |key, slot| {
            if let Some(at) = slot.get(rev) {
                count += 1;
                f(key, at);
            }
            seen += 1;
            if seen >= INDEX_CHUNK {
                last.clear();
                last.extend_from_slice(key);
                return false;
            }
            true
        });
        if done {
            return Ok(count);
        }
        drop(idx);
        pause();
        // The buffers swap: `after` is read by the next chunk's scan, `last` written.
        let buf = after.get_or_insert_default();
        std::mem::swap(buf, &mut last);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;
    use crate::store::mem_store;
    use crate::testing::MemBackend;
    use crate::{RangeRequest, Store, StoreOptions};

    /// Buffered changes are visited in revision order, every one once, across the bounded
    /// batches they are copied out in (by count with small records, by bytes with 600 KiB
    /// ones), from any starting revision; the history hash over them matches the one over
    /// the same changes committed.
    #[test]
    fn visiting_buffered_changes_in_batches_sees_each_once_in_order() {
        let (_dir, s) = mem_store(StoreOptions {
            batch_interval: Duration::from_secs(3600),
            batch_limit: 1_000_000,
            ..StoreOptions::default()
        });
        let mut expected = Vec::new();
        for i in 0..(3 * COPY_CHANGES as u32) {
            let value = vec![i as u8; if i % 100 < 3 { 600 << 10 } else { 10 }];
            let key = format!("k{i:05}");
            let rev = s.put(key.as_bytes(), &value, 0).expect("put").revision;
            expected.push((rev, key, value));
        }
        let hash_buffered = s.hash_kv(0).expect("hash");
        let view = s.read().expect("view");
        for from in [1, 2, COPY_CHANGES as u64 + 7] {
            let mut seen = Vec::new();
            view.sources(None)
                .for_each_change(
                    Revision::new(from, 0),
                    view.revision(),
                    |rev, tomb, _, r| {
                        assert!(!tomb);
                        let kv = decode_record(rev, r)?.to_kv(true);
                        let (key, value) = kv.into_parts();
                        seen.push((rev.main, String::from_utf8(key).expect("key"), value));
                        Ok(true)
                    },
                )
                .expect("visit");
            let want: Vec<_> = expected
                .iter()
                .filter(|(r, ..)| *r >= from)
                .cloned()
                .collect();
            assert_eq!(seen.len(), want.len(), "from {from}");
            assert!(seen == want, "changes from {from} as put, in order");
        }
        drop(view);
        s.force_commit().expect("commit");
        assert_eq!(s.hash_kv(0).expect("hash"), hash_buffered);
    }

    /// Keys that differ only in their length (zero padding included), in one or two bits
    /// anywhere, or in the order of their words get different tags; equal keys the same one.
    #[test]
    fn different_keys_get_different_tags() {
        let mut keys: Vec<Vec<u8>> = vec![
            b"".to_vec(),
            b"\0".to_vec(),
            b"\0\0\0\0\0\0\0\0".to_vec(),
            b"\0\0\0\0\0\0\0\0\0".to_vec(),
            b"a".to_vec(),
            b"a\0".to_vec(),
            b"abcdefghABCDEFGH".to_vec(),
            b"ABCDEFGHabcdefgh".to_vec(),
        ];
        let base = b"key-0000000000000042-value".to_vec();
        let bits = base.len() * 8;
        for one in 0..bits {
            for two in one..bits {
                let mut k = base.clone();
                k[one / 8] ^= 1 << (one % 8);
                if two != one {
                    k[two / 8] ^= 1 << (two % 8);
                }
                keys.push(k);
            }
        }
        keys.push(base.clone());
        for n in 0..2_000u32 {
            keys.push(format!("key-{n:016}").into_bytes());
        }
        let tagger = KeyTags::new();
        let mut tags = std::collections::HashMap::new();
        for k in &keys {
            if let Some(other) = tags.insert(tagger.tag(k), k.clone()) {
                panic!("{k:?} and {other:?} share a tag");
            }
        }
        assert_eq!(tagger.tag(&base), tagger.tag(&base.clone()));
        let mut pushed = KeyTags::new();
        pushed.push(&base);
        assert!(pushed.matches(0, &base));
        assert!(!pushed.matches(0, b"key-0000000000000043-value"));
        assert!(!pushed.matches(1, &base), "past the last tag");
    }

    /// Tags spread evenly over their high bits too, for keys whose last word varies in its
    /// high bytes (big-endian integers at the end of a key): 2^16 such keys share the top
    /// 24 bits of their tags about as often as random values would (some 128 pairs), not
    /// far more or far less.
    #[test]
    fn tags_of_keys_ending_in_big_endian_integers_spread_evenly() {
        let n = 1u64 << 16;
        let tagger = KeyTags::new();
        let top: std::collections::HashSet<u64> = (0..n)
            .map(|i| {
                let mut k = b"user/id:".to_vec();
                k.extend_from_slice(&i.to_be_bytes());
                tagger.tag(&k) >> 40
            })
            .collect();
        // Random values: about 128 (a Poisson count, deviation about 11). Far fewer means
        // structure as much as far more does.
        let shared = n - top.len() as u64;
        assert!(
            (128 / 3..3 * 128).contains(&shared),
            "{shared} keys share their tag's top 24 bits"
        );
    }

    /// A record whose checksum holds but whose key is not the one the index names for its
    /// revision fails the range with a typed error instead of returning the pair.
    #[test]
    fn a_record_under_another_keys_revision_fails_the_range() {
        use crate::backend::{Backend, ReadTxn, WriteBatch};
        let (_dir, s) = mem_store(StoreOptions::default());
        s.put(b"a", b"1", 0).expect("put");
        s.put(b"b", b"2", 0).expect("put");
        s.force_commit().expect("commit");
        let whole = RangeRequest::range(b"a".to_vec(), b"c".to_vec());
        let before = s.range(&whole).expect("range").kvs;
        assert_eq!(before.len(), 2);
        // Swap the two records: each is well formed, under the other's revision.
        let txn = s.backend().read_txn().expect("txn");
        let pairs: Vec<(Vec<u8>, Vec<u8>)> = txn
            .range(&KEY_BUCKET, &[], None)
            .expect("range")
            .map(|p| p.map(|(k, v)| (k.to_vec(), v.to_vec())).expect("pair"))
            .collect();
        drop(txn);
        assert_eq!(pairs.len(), 2);
        let mut batch = WriteBatch::new();
        batch.put(&KEY_BUCKET, pairs[0].0.clone(), pairs[1].1.clone());
        batch.put(&KEY_BUCKET, pairs[1].0.clone(), pairs[0].1.clone());
        s.backend().commit(&batch).expect("commit");
        match s.range(&whole) {
            Err(MvccError::Corrupt { revision, reason }) => {
                assert_eq!(
                    revision.main, before[0].mod_revision,
                    "the first record read"
                );
                assert!(reason.contains("differs from the key index"), "{reason}");
            }
            other => panic!("range over swapped records: {other:?}"),
        }
    }

    #[test]
    fn radix_sorted_misses_match_a_comparison_sort() {
        let mut next = crate::xorshift(0x9e37_79b9_7f4a_7c15);
        for (len, main_range, sub_range) in [(100, 50, 3), (5_000, 1 << 20, 1), (5_000, 300, 70)] {
            let mut misses: Vec<(Revision, usize)> = (0..len)
                .map(|i| {
                    let rev = Revision::new(next() % main_range + 1, next() % sub_range);
                    (rev, i)
                })
                .collect();
            misses.push((Revision::new(u64::MAX, u64::MAX), len));
            let mut expected = misses.clone();
            expected.sort_unstable();
            sort_misses(&mut misses);
            assert_eq!(misses, expected, "{len} pairs");
        }
    }

    /// Long reads yield while write transactions are open: the count of open ones goes up
    /// while one waits for the writer mutex or holds it, and back to zero however it ends
    /// (committed, dropped, failed), so reads do not keep yielding to writers gone.
    #[test]
    fn open_write_transactions_are_counted_until_they_end() {
        let (_dir, s) = mem_store(StoreOptions::default());
        let s = Arc::new(s);
        let writers =
            |s: &Store<MemBackend>| s.inner.writers.load(std::sync::atomic::Ordering::Relaxed);
        let mut t = s.write();
        t.put(b"a", b"v", 0).expect("put");
        assert_eq!(writers(&s), 1);
        let waiting = {
            let s = s.clone();
            std::thread::spawn(move || {
                let mut t = s.write();
                t.put(b"b", b"v", 0).expect("put");
                drop(t);
            })
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while writers(&s) < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "the waiting writer is not counted"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        t.commit().expect("commit");
        waiting.join().expect("writer");
        assert_eq!(writers(&s), 0);
        let mut t = s.write();
        assert!(t.put(b"", b"v", 0).is_err());
        drop(t);
        s.put(b"c", b"v", 0).expect("put");
        assert_eq!(writers(&s), 0);
        assert_eq!(s.current_revision(), 2);
    }

    /// A visit of buffered changes may read the store from its callback (as watch catch-up
    /// does) while a writer waits to add to the same buffer: the visit holds no buffer lock
    /// across the callback, so neither waits for the other.
    #[test]
    fn visiting_buffered_changes_reads_the_store_while_a_writer_waits() {
        let (_dir, s) = mem_store(StoreOptions {
            batch_interval: Duration::from_secs(3600),
            ..StoreOptions::default()
        });
        let s = Arc::new(s);
        for i in 0..4u8 {
            s.put(&[b'k', i], b"v", 0).expect("put");
        }
        let view = s.read().expect("view");
        let (done_tx, done) = mpsc::channel();
        let visitor = {
            let s = s.clone();
            std::thread::spawn(move || {
                let mut writer = None;
                let mut reads = 0;
                let visited = view.sources(None).for_each_change(
                    Revision::new(1, 0),
                    view.revision(),
                    |_, _, _, _| {
                        if writer.is_none() {
                            // A writer queues for the buffer being visited.
                            let s = s.clone();
                            writer = Some(std::thread::spawn(move || {
                                s.put(b"late", b"v", 0).expect("put");
                            }));
                            std::thread::sleep(Duration::from_millis(100));
                        }
                        let req = RangeRequest::key(b"k\x01".to_vec());
                        let r = range(&view.inner, &view.sources(None), &req, view.revision())?;
                        reads += r.kvs.len();
                        Ok(true)
                    },
                );
                let _ = done_tx.send((visited.is_ok(), reads));
                if let Some(w) = writer {
                    w.join().expect("writer");
                }
            })
        };
        let (ok, reads) = done
            .recv_timeout(Duration::from_secs(10))
            .expect("the visit and the writer wait for each other");
        assert!(ok, "the visit failed");
        assert_eq!(reads, 4, "every visited change read the pair back");
        visitor.join().expect("visitor");
        assert_eq!(s.current_revision(), 5);
    }
}
