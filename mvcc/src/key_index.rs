//! The in-memory key index: for every key, the revisions of its changes grouped in
//! generations (etcd `key_index.go`).
//!
//! A generation is one lifetime of a key: it starts with the put that creates the key and ends
//! with the tombstone that deletes it; the tombstone is the last revision of the generation and
//! a new, empty generation follows it. The last generation is the live one (empty when the key
//! is deleted). Compaction at revision `c` keeps, per key, the last revision `<= c` (unless it
//! is a tombstone) and everything after it, and drops keys left with nothing.
//!
//! The index is rebuilt on open from the `key` bucket; it lives behind one `RwLock` in the
//! store, and readers hold the read lock only for short chunks of a scan. Each key's history
//! has a lock of its own ([`Slot`]): a write that changes keys already in the index takes the
//! read lock too, and so never waits for a scan, however long the scan's thread keeps the
//! read lock (it may lose its CPU in the middle of a chunk); only adding and removing keys
//! (a new key's put, rolling one back, compaction) takes the write lock.

use std::collections::HashSet;
use std::ops::Bound as RangeBound;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

use parking_lot::Mutex;

use crate::request::Bound;
use crate::revision::Revision;

mod leaves;

use leaves::LeafMap;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Generation {
    /// Puts in this generation so far (the tombstone is not counted).
    ver: u64,
    created: u64,
    revs: Vec<Revision>,
}

/// The generations of one key, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Gens {
    gens: Vec<Generation>,
}

/// The history of one key. A key whose history is a single put (the common case for a
/// large, rarely rewritten key space) is kept inline without heap allocations; any other
/// history lives in a vector of generations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum KeyEntry {
    /// One generation holding one put (perhaps the survivor of a compaction) whose sub
    /// revision fits 32 bits (any other lives in [`KeyEntry::Multi`]): the sub revision sits
    /// beside the tag, so an entry takes 32 bytes, and with its lock in the index 40.
    Single {
        /// Puts in the generation.
        ver: u64,
        /// Main revision of the generation's first put.
        created: u64,
        /// The put's main revision.
        main: u64,
        /// The put's sub revision.
        sub: u32,
    },
    /// Any other history.
    Multi(Gens),
}

impl Default for KeyEntry {
    fn default() -> KeyEntry {
        KeyEntry::Multi(Gens::default())
    }
}

impl KeyEntry {
    fn is_empty(&self) -> bool {
        match self {
            KeyEntry::Single { .. } => false,
            KeyEntry::Multi(g) => g.is_empty(),
        }
    }

    /// The live state of the key at `at` (main revision), or `None` if it did not exist then.
    #[inline]
    pub fn get(&self, at: u64) -> Option<KeyAt> {
        match self {
            KeyEntry::Single {
                ver,
                created,
                main,
                sub,
            } => (*main <= at).then_some(KeyAt {
                modified: Revision::new(*main, u64::from(*sub)),
                created: *created,
                version: *ver,
            }),
            KeyEntry::Multi(g) => g.get(at),
        }
    }

    /// The history as generations, whatever its form.
    fn into_gens(self) -> Gens {
        match self {
            KeyEntry::Single {
                ver,
                created,
                main,
                sub,
            } => Gens {
                gens: vec![Generation {
                    ver,
                    created,
                    revs: vec![Revision::new(main, u64::from(sub))],
                }],
            },
            KeyEntry::Multi(g) => g,
        }
    }

    /// Runs `f` on the generations, then stores them back in the most compact form.
    fn edit<R>(&mut self, f: impl FnOnce(&mut Gens) -> R) -> R {
        let mut gens = std::mem::take(self).into_gens();
        let r = f(&mut gens);
        *self = match gens.gens.as_slice() {
            [g] if g.revs.len() == 1 => {
                KeyEntry::single(g.ver, g.created, g.revs[0]).unwrap_or(KeyEntry::Multi(gens))
            }
            _ => KeyEntry::Multi(gens),
        };
        r
    }

    /// One generation of one put, inline if its sub revision fits.
    fn single(ver: u64, created: u64, rev: Revision) -> Option<KeyEntry> {
        let sub = u32::try_from(rev.sub).ok()?;
        Some(KeyEntry::Single {
            ver,
            created,
            main: rev.main,
            sub,
        })
    }

    /// One generation of one put, inline or not.
    fn one_put(ver: u64, created: u64, rev: Revision) -> KeyEntry {
        KeyEntry::single(ver, created, rev).unwrap_or_else(|| {
            KeyEntry::Multi(Gens {
                gens: vec![Generation {
                    ver,
                    created,
                    revs: vec![rev],
                }],
            })
        })
    }

    /// A key whose history is one put.
    fn created_by(rev: Revision) -> KeyEntry {
        KeyEntry::one_put(1, rev.main, rev)
    }

    fn put(&mut self, rev: Revision) {
        match self {
            // The common cases without a round trip through `edit`: a second put of a
            // single-put key, and a put onto a history that is already a vector.
            KeyEntry::Single {
                ver,
                created,
                main,
                sub,
            } => {
                let mut revs = Vec::with_capacity(4);
                revs.extend([Revision::new(*main, u64::from(*sub)), rev]);
                *self = KeyEntry::Multi(Gens {
                    gens: vec![Generation {
                        ver: *ver + 1,
                        created: *created,
                        revs,
                    }],
                });
            }
            KeyEntry::Multi(g) if g.gens.last().is_some_and(|g| !g.revs.is_empty()) => g.put(rev),
            KeyEntry::Multi(g) if g.gens.is_empty() => *self = KeyEntry::created_by(rev),
            KeyEntry::Multi(_) => self.edit(|g| g.put(rev)),
        }
    }

    fn restore(&mut self, created: u64, modified: Revision, ver: u64) {
        self.edit(|g| g.restore(created, modified, ver));
    }

    fn tombstone(&mut self, rev: Revision) -> bool {
        if !self.is_live() {
            return false;
        }
        self.edit(|g| g.tombstone(rev))
    }

    fn rollback(&mut self, rev: Revision) {
        self.edit(|g| g.rollback(rev));
    }

    /// Compacts the history at `at`; returns the revision `<= at` that stays, if any.
    fn compact(&mut self, at: u64) -> Option<Revision> {
        if let KeyEntry::Single { main, sub, .. } = self {
            // A lone put survives any compaction.
            return (*main <= at).then(|| Revision::new(*main, u64::from(*sub)));
        }
        self.edit(|g| g.compact(at))
    }

    /// The revision `<= at` that compacting at `at` would keep, if any, without compacting.
    fn keep(&self, at: u64) -> Option<Revision> {
        match self {
            KeyEntry::Single { main, sub, .. } => {
                (*main <= at).then(|| Revision::new(*main, u64::from(*sub)))
            }
            KeyEntry::Multi(g) => g.keep(at),
        }
    }

    /// True when the key's latest generation holds a live put.
    fn is_live(&self) -> bool {
        match self {
            KeyEntry::Single { .. } => true,
            KeyEntry::Multi(g) => g.gens.last().is_some_and(|g| !g.revs.is_empty()),
        }
    }
}

/// What a key looks like at a revision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeyAt {
    pub modified: Revision,
    pub created: u64,
    pub version: u64,
}

impl Gens {
    fn is_empty(&self) -> bool {
        self.gens.len() <= 1 && self.gens.first().is_none_or(|g| g.revs.is_empty())
    }

    /// The live state of the key at `at` (main revision), or `None` if it did not exist then.
    pub fn get(&self, at: u64) -> Option<KeyAt> {
        let last = self.gens.len().checked_sub(1)?;
        for (i, g) in self.gens.iter().enumerate().rev() {
            let (Some(first), Some(tail)) = (g.revs.first(), g.revs.last()) else {
                continue;
            };
            if i != last && tail.main <= at {
                // The generation ended (tombstone) at or before `at`.
                return None;
            }
            if first.main <= at {
                let n = g.revs.iter().rposition(|r| r.main <= at)?;
                return Some(KeyAt {
                    modified: g.revs[n],
                    created: g.created,
                    version: g.ver - (g.revs.len() - n - 1) as u64,
                });
            }
        }
        None
    }

    fn put(&mut self, rev: Revision) {
        if self.gens.is_empty() {
            self.gens.push(Generation::default());
        }
        let g = self.gens.last_mut().expect("a generation");
        if g.revs.is_empty() {
            g.created = rev.main;
        }
        g.revs.push(rev);
        g.ver += 1;
    }

    /// Starts a generation from a stored change whose earlier history may be compacted away.
    fn restore(&mut self, created: u64, modified: Revision, ver: u64) {
        if self.gens.last().is_some_and(|g| g.revs.is_empty()) {
            self.gens.pop();
        }
        self.gens.push(Generation {
            ver,
            created,
            revs: vec![modified],
        });
    }

    /// Returns false (and changes nothing) when the key is not live.
    fn tombstone(&mut self, rev: Revision) -> bool {
        match self.gens.last() {
            Some(g) if !g.revs.is_empty() => {}
            _ => return false,
        }
        self.put(rev);
        self.gens.push(Generation::default());
        true
    }

    /// Undoes the change at `rev`, which must be the key's latest.
    fn rollback(&mut self, rev: Revision) {
        let n = self.gens.len();
        if n >= 2 && self.gens[n - 1].revs.is_empty() && self.gens[n - 2].revs.last() == Some(&rev)
        {
            self.gens.pop();
        }
        let Some(g) = self.gens.last_mut() else {
            return;
        };
        if g.revs.last() == Some(&rev) {
            g.revs.pop();
            g.ver = g.ver.saturating_sub(1);
            if g.revs.is_empty() {
                *g = Generation::default();
            }
        }
    }

    /// etcd `doCompact`: the generation index to keep from and the revision index in it;
    /// calls `keep` on the revision that survives.
    fn compact_point(&self, at: u64, keep: &mut impl FnMut(Revision)) -> (usize, Option<usize>) {
        let mut gi = 0;
        while gi + 1 < self.gens.len() {
            let g = &self.gens[gi];
            if g.revs.last().is_some_and(|t| t.main > at) {
                break;
            }
            gi += 1;
        }
        let g = &self.gens[gi];
        let ri = g.revs.iter().rposition(|r| r.main <= at);
        if let Some(ri) = ri {
            keep(g.revs[ri]);
        }
        (gi, ri)
    }

    /// etcd `compact`: drops the revisions before the compaction point at `at`; returns
    /// the revision `<= at` that stays, if any.
    fn compact(&mut self, at: u64) -> Option<Revision> {
        if self.gens.is_empty() {
            return None;
        }
        let mut kept = None;
        let (mut gi, ri) = self.compact_point(at, &mut |r| kept = Some(r));
        let last = self.gens.len() - 1;
        let g = &mut self.gens[gi];
        if !g.revs.is_empty() {
            if let Some(ri) = ri {
                g.revs.drain(..ri);
            }
            // A lone tombstone left in an ended generation goes too.
            if g.revs.len() == 1 && gi != last {
                kept = None;
                gi += 1;
            }
        }
        self.gens.drain(..gi);
        kept
    }

    /// The revision `<= at` that [`compact`](Self::compact) at `at` would keep, if any.
    fn keep(&self, at: u64) -> Option<Revision> {
        if self.gens.is_empty() {
            return None;
        }
        let mut kept = None;
        let (gi, ri) = self.compact_point(at, &mut |r| kept = Some(r));
        let g = &self.gens[gi];
        let ri = ri?;
        let tombstone_alone = g.revs.len() - ri == 1 && gi != self.gens.len() - 1;
        kept.filter(|_| !tombstone_alone)
    }
}

/// Longest key an [`IndexKey`] holds inline.
const INLINE_KEY: usize = 30;

/// A key as the index holds it: keys of up to [`INLINE_KEY`] bytes inline in the map's own
/// node, so the comparisons of a lookup (some thirty) read the node's cache lines instead of
/// following a pointer to a separate allocation per key, and a new key costs no allocation of
/// its own; longer keys on the heap. Ordered as the key's bytes, so the map is searched with
/// a `&[u8]`.
#[derive(Clone)]
pub(crate) enum IndexKey {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Heap(Box<[u8]>),
}

impl IndexKey {
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        match self {
            IndexKey::Inline { len, bytes } => &bytes[..usize::from(*len)],
            IndexKey::Heap(key) => key,
        }
    }
}

impl From<&[u8]> for IndexKey {
    fn from(key: &[u8]) -> IndexKey {
        if key.len() <= INLINE_KEY {
            let mut bytes = [0u8; INLINE_KEY];
            bytes[..key.len()].copy_from_slice(key);
            IndexKey::Inline {
                len: key.len() as u8,
                bytes,
            }
        } else {
            IndexKey::Heap(key.into())
        }
    }
}

impl std::fmt::Debug for IndexKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.as_slice().fmt(f)
    }
}

// Equality and order are the key's bytes' (as `Borrow` requires).
impl PartialEq for IndexKey {
    #[inline]
    fn eq(&self, other: &IndexKey) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for IndexKey {}

impl PartialOrd for IndexKey {
    #[inline]
    fn partial_cmp(&self, other: &IndexKey) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for IndexKey {
    #[inline]
    fn cmp(&self, other: &IndexKey) -> std::cmp::Ordering {
        match (self, other) {
            // Zero-padded bytes compare as the keys do up to the shorter key's length, and
            // past it the longer key's bytes against zeros: unequal there means the longer
            // key is greater; equal means the rest is zeros, and the length decides. So
            // compare the padded words, then the lengths.
            (IndexKey::Inline { len: la, bytes: a }, IndexKey::Inline { len: lb, bytes: b }) => {
                compare_padded(a, b).then(la.cmp(lb))
            }
            _ => self.as_slice().cmp(other.as_slice()),
        }
    }
}

/// Compares two inline keys' padded bytes as big-endian words (which order as their bytes
/// do). All four words are read at once: keys sharing long prefixes, the common case, would
/// get past most of them anyway, and the straight-line loads beat a loop that stops early.
#[inline]
fn compare_padded(a: &[u8; INLINE_KEY], b: &[u8; INLINE_KEY]) -> std::cmp::Ordering {
    #[inline]
    fn word(k: &[u8; INLINE_KEY], i: usize) -> u64 {
        u64::from_be_bytes([
            k[i],
            k[i + 1],
            k[i + 2],
            k[i + 3],
            k[i + 4],
            k[i + 5],
            k[i + 6],
            k[i + 7],
        ])
    }
    // The last word ends at the array's end (INLINE_KEY = 30): its first two bytes repeat the
    // third word's last two, which were equal if it is reached.
    let words = |k| [word(k, 0), word(k, 8), word(k, 16), word(k, INLINE_KEY - 8)];
    words(a).cmp(&words(b))
}

impl std::borrow::Borrow<[u8]> for IndexKey {
    #[inline]
    fn borrow(&self) -> &[u8] {
        self.as_slice()
    }
}

/// `Slot::seq` bit: a writer is changing the single-put fields.
const BUSY: u32 = 1;
/// `Slot::seq` bit: the key's history is the vector of generations behind the lock.
const MULTI: u32 = 2;
/// `Slot::seq` step of a change (above the two flag bits).
const STEP: u32 = 4;

/// A single-put history as atomics, read by scans without taking a lock (a seqlock). The
/// version and the distance from the creating revision to the put take 32 bits each in one
/// word: a put they do not fit (as one whose sub revision does not) goes to the vector.
#[derive(Debug, Default)]
struct Inline {
    /// Change counter in steps of [`STEP`], with the [`BUSY`] and [`MULTI`] bits.
    seq: AtomicU32,
    sub: AtomicU32,
    main: AtomicU64,
    /// The version in the high 32 bits, `main - created` in the low.
    ver_age: AtomicU64,
}

/// The [`KeyEntry::Single`] of the inline fields.
#[inline]
fn unpack(main: u64, sub: u32, ver_age: u64) -> KeyEntry {
    KeyEntry::Single {
        ver: ver_age >> 32,
        created: main.wrapping_sub(ver_age & u64::from(u32::MAX)),
        main,
        sub,
    }
}

/// The inline `ver_age` word of a single put, if its fields fit.
fn pack(ver: u64, created: u64, main: u64) -> Option<u64> {
    let ver = u32::try_from(ver).ok()?;
    let age = u32::try_from(main.checked_sub(created)?).ok()?;
    Some(u64::from(ver) << 32 | u64::from(age))
}

/// One key's history in the index.
///
/// The index's map is behind the store's `RwLock`, but a change to the history of a key
/// already in the map (a put onto it, a tombstone, a rollback) takes only the map's *read*
/// lock and this entry's lock: such writes do not wait for a long scan holding the read
/// lock, whose thread may have lost its CPU in the middle of a chunk (a wait of a scheduler
/// time slice).
///
/// A history that is a single put (the common case) is kept in atomics that scans read
/// without writing anything: a seqlock, whose counter a writer makes odd ([`BUSY`]) while it
/// stores the fields and moves on once they are stored; a reader loads the counter, the
/// fields and the counter again, and takes the state if the counter was even and unchanged.
/// Any other history is a vector of generations behind the lock (with the [`MULTI`] bit set
/// in the counter), which readers then take. Writers always take the lock, so they never
/// race each other. An entry takes 40 bytes, as with a lock around a [`KeyEntry`].
#[derive(Debug)]
pub(crate) struct Slot {
    inline: Inline,
    multi: Mutex<Option<Box<Gens>>>,
}

impl Slot {
    #[inline]
    fn new(entry: KeyEntry) -> Slot {
        if let KeyEntry::Single {
            ver,
            created,
            main,
            sub,
        } = entry
            && let Some(ver_age) = pack(ver, created, main)
        {
            return Slot {
                inline: Inline {
                    seq: AtomicU32::new(0),
                    sub: AtomicU32::new(sub),
                    main: AtomicU64::new(main),
                    ver_age: AtomicU64::new(ver_age),
                },
                multi: Mutex::new(None),
            };
        }
        Slot::new_vector(entry)
    }

    /// [`new`](Self::new) for a history the inline fields do not hold.
    #[cold]
    #[inline(never)]
    fn new_vector(entry: KeyEntry) -> Slot {
        let mut slot = Slot {
            inline: Inline::default(),
            multi: Mutex::new(None),
        };
        slot.update_mut(|e| *e = entry);
        slot
    }

    /// The live state of the key at `at` (main revision), or `None` if it did not exist then.
    #[inline]
    pub fn get(&self, at: u64) -> Option<KeyAt> {
        let i = &self.inline;
        let s1 = i.seq.load(Ordering::Acquire);
        if s1 & (BUSY | MULTI) == 0 {
            let (main, sub) = (
                i.main.load(Ordering::Relaxed),
                i.sub.load(Ordering::Relaxed),
            );
            let ver_age = i.ver_age.load(Ordering::Relaxed);
            fence(Ordering::Acquire);
            if i.seq.load(Ordering::Relaxed) == s1 {
                return unpack(main, sub, ver_age).get(at);
            }
        }
        self.get_locked(at)
    }

    /// [`get`](Self::get) under the lock: a history that is a vector, or a single put being
    /// changed.
    #[cold]
    #[inline(never)]
    fn get_locked(&self, at: u64) -> Option<KeyAt> {
        self.read(|e| e.get(at))
    }

    /// Runs `f` on the history, under the lock (which holds writers off).
    fn read<R>(&self, f: impl FnOnce(EntryRef<'_>) -> R) -> R {
        let multi = self.multi.lock();
        f(self.inline.view(&multi))
    }

    /// Runs `f` on the history as a [`KeyEntry`] under the lock, then stores it back.
    fn update<R>(&self, f: impl FnOnce(&mut KeyEntry) -> R) -> R {
        let mut multi = self.multi.lock();
        self.inline.apply(&mut multi, f)
    }

    /// [`update`](Self::update) without the lock, given the entry to itself.
    fn update_mut<R>(&mut self, f: impl FnOnce(&mut KeyEntry) -> R) -> R {
        let Slot { inline, multi } = self;
        inline.apply(multi.get_mut(), f)
    }

    /// The history as a [`KeyEntry`].
    #[cfg(test)]
    fn entry(&self) -> KeyEntry {
        self.read(|e| match e {
            EntryRef::Single(e) => e,
            EntryRef::Multi(g) => KeyEntry::Multi(g.clone()),
        })
    }
}

/// A history as read under a [`Slot`]'s lock.
enum EntryRef<'a> {
    /// Always a [`KeyEntry::Single`].
    Single(KeyEntry),
    Multi(&'a Gens),
}

impl EntryRef<'_> {
    fn get(&self, at: u64) -> Option<KeyAt> {
        match self {
            EntryRef::Single(e) => e.get(at),
            EntryRef::Multi(g) => g.get(at),
        }
    }

    /// The revision `<= at` that compacting at `at` would keep, if any.
    fn keep(&self, at: u64) -> Option<Revision> {
        match self {
            EntryRef::Single(e) => e.keep(at),
            EntryRef::Multi(g) => g.keep(at),
        }
    }
}

impl Inline {
    /// The single put the fields hold (the caller holds the lock or owns the slot).
    fn single(&self) -> KeyEntry {
        unpack(
            self.main.load(Ordering::Relaxed),
            self.sub.load(Ordering::Relaxed),
            self.ver_age.load(Ordering::Relaxed),
        )
    }

    /// The history, given the slot's vector (the caller holds the lock or owns the slot, so
    /// no writer changes it meanwhile).
    fn view<'a>(&self, multi: &'a Option<Box<Gens>>) -> EntryRef<'a> {
        match multi {
            Some(g) if self.seq.load(Ordering::Relaxed) & MULTI != 0 => EntryRef::Multi(g),
            _ => EntryRef::Single(self.single()),
        }
    }

    /// Runs `f` on the history as a [`KeyEntry`] and stores the result back: a vector in
    /// `multi` (kept allocated while the history stays a vector), a single put in the atomics
    /// under the seqlock protocol. The caller holds the lock or owns the slot.
    fn apply<R>(&self, multi: &mut Option<Box<Gens>>, f: impl FnOnce(&mut KeyEntry) -> R) -> R {
        let seq = self.seq.load(Ordering::Relaxed);
        let mut entry = match multi {
            Some(g) if seq & MULTI != 0 => KeyEntry::Multi(std::mem::take(&mut **g)),
            _ => self.single(),
        };
        let r = f(&mut entry);
        match entry {
            KeyEntry::Single {
                ver,
                created,
                main,
                sub,
            } if let Some(ver_age) = pack(ver, created, main) => {
                let same = seq & MULTI == 0
                    && self.main.load(Ordering::Relaxed) == main
                    && self.sub.load(Ordering::Relaxed) == sub
                    && self.ver_age.load(Ordering::Relaxed) == ver_age;
                if !same {
                    // Readers that see the counter odd, or changed once they read the
                    // fields, take the lock (held by the caller unless it owns the slot).
                    self.seq.store(seq | BUSY, Ordering::Relaxed);
                    fence(Ordering::Release);
                    self.main.store(main, Ordering::Relaxed);
                    self.sub.store(sub, Ordering::Relaxed);
                    self.ver_age.store(ver_age, Ordering::Relaxed);
                    self.seq.store(
                        (seq & !(BUSY | MULTI)).wrapping_add(STEP),
                        Ordering::Release,
                    );
                }
                *multi = None;
            }
            entry => {
                let gens = entry.into_gens();
                match multi {
                    Some(g) => **g = gens,
                    None => *multi = Some(Box::new(gens)),
                }
                if seq & MULTI == 0 {
                    // The vector is in place before readers are sent to it; the single-put
                    // fields are not touched, so a reader that read them reads a state
                    // that was.
                    self.seq
                        .store(seq.wrapping_add(STEP) | MULTI, Ordering::Release);
                }
            }
        }
        r
    }
}

/// The key index: each key's [`Slot`] in a [`LeafMap`] (sorted leaves of up to
/// [`LEAF`](leaves::LEAF) keys).
///
/// Methods taking `&self` change keys already in the map in place, under each key's own
/// [`Slot`] lock (the store calls them holding its read lock of the index); those taking
/// `&mut self` add or remove keys.
#[derive(Debug, Default)]
pub(crate) struct KeyIndex {
    map: LeafMap<Slot>,
}

impl KeyIndex {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn get(&self, key: &[u8], at: u64) -> Option<KeyAt> {
        self.map.get(key)?.get(at)
    }

    /// [`get`](Self::get) at `at`, then [`put`](Self::put) of `rev`, in one lookup.
    pub fn get_and_put(&mut self, key: &[u8], at: u64, rev: Revision) -> Option<KeyAt> {
        self.map
            .upsert(
                key,
                || Slot::new(KeyEntry::created_by(rev)),
                |slot| {
                    slot.update_mut(|e| {
                        let prev = e.get(at);
                        e.put(rev);
                        prev
                    })
                },
            )
            .flatten()
    }

    /// [`get_and_put`](Self::get_and_put) for a key already in the index, in place; `None`
    /// (and nothing changed) when the key is not in the index.
    pub fn get_and_put_existing(
        &self,
        key: &[u8],
        at: u64,
        rev: Revision,
    ) -> Option<Option<KeyAt>> {
        let slot = self.map.get(key)?;
        Some(slot.update(|e| {
            let prev = e.get(at);
            e.put(rev);
            prev
        }))
    }

    /// Records a put of `key` at `rev`.
    #[cfg(test)]
    pub fn put(&mut self, key: &[u8], rev: Revision) {
        self.get_and_put(key, 0, rev);
    }

    /// Records a deletion; false when the key is not live.
    pub fn tombstone(&self, key: &[u8], rev: Revision) -> bool {
        self.map
            .get(key)
            .is_some_and(|e| e.update(|e| e.tombstone(rev)))
    }

    /// Undoes the change at `rev` of `key` (its latest) in place; true when the key is left
    /// with no history, for [`remove_if_empty`](Self::remove_if_empty).
    pub fn rollback(&self, key: &[u8], rev: Revision) -> bool {
        self.map.get(key).is_some_and(|e| {
            e.update(|e| {
                e.rollback(rev);
                e.is_empty()
            })
        })
    }

    /// Drops `key` if it has no history.
    pub fn remove_if_empty(&mut self, key: &[u8]) {
        if self
            .map
            .get_mut(key)
            .is_some_and(|e| e.update_mut(|e| e.is_empty()))
        {
            self.map.remove(key);
        }
    }

    /// Rebuild step for a stored put (see [`KeyEntry::restore`] for keys seen first or after a
    /// tombstone).
    pub fn restore_put(&mut self, key: &[u8], created: u64, rev: Revision, ver: u64) {
        self.map.upsert(
            key,
            || Slot::new(KeyEntry::one_put(ver, created, rev)),
            |slot| {
                slot.update_mut(|e| {
                    if e.is_live() {
                        e.put(rev);
                    } else {
                        e.restore(created, rev, ver);
                    }
                });
            },
        );
    }

    /// Visits keys of `[start, bound)` in order, starting after `after` when given, calling
    /// `f(key, slot)` until it returns false. Returns true when the range was exhausted.
    pub fn scan(
        &self,
        start: &[u8],
        bound: &Bound<'_>,
        after: Option<&[u8]>,
        f: impl FnMut(&[u8], &Slot) -> bool,
    ) -> bool {
        let lower = match after {
            Some(a) => RangeBound::Excluded(a),
            None => RangeBound::Included(start),
        };
        let upper = match bound {
            Bound::Single => RangeBound::Included(start),
            Bound::Until(end) => RangeBound::Excluded(*end),
            Bound::Unbounded => RangeBound::Unbounded,
        };
        if let (RangeBound::Excluded(a), RangeBound::Included(b)) = (lower, upper)
            && a >= b
        {
            return true;
        }
        if let (RangeBound::Included(a) | RangeBound::Excluded(a), RangeBound::Excluded(b)) =
            (lower, upper)
            && a >= b
        {
            return true;
        }
        // The checks above rule out inverted bounds.
        self.map.scan(lower, upper, f)
    }

    /// Compacts every key at `at`; returns the revisions `<= at` that stay in the store.
    pub fn compact(&mut self, at: u64) -> HashSet<Revision> {
        let mut available = Vec::new();
        self.compact_some(at, None, usize::MAX, &mut available);
        available.into_iter().collect()
    }

    /// [`compact`](Self::compact) for at most `limit` keys, in key order from `from` (the
    /// first key when `None`) on, adding the revisions `<= at` that stay in the store to
    /// `available` (at most one per key, in key order: the vector's memory is written in
    /// order, a chunk's share of it per call); returns the key to go on from, or `None` once
    /// every key was compacted.
    /// The leaves that removals thin out are packed as the compaction goes (see
    /// [`LeafMap::retain_from`]), so no call, the last one included, does much more than
    /// `limit` keys' work.
    ///
    /// Reads at `at` or later see the same through a partly compacted index as through a
    /// whole one; so may writes, and so a key added or changed between two calls is
    /// compacted or not, alike.
    pub fn compact_some(
        &mut self,
        at: u64,
        from: Option<&[u8]>,
        limit: usize,
        available: &mut Vec<Revision>,
    ) -> Option<Vec<u8>> {
        self.map.retain_from(from, limit, |_, e| {
            e.update_mut(|e| {
                available.extend(e.compact(at));
                !e.is_empty()
            })
        })
    }

    /// The revisions `<= at` that compacting at `at` would keep, without compacting.
    #[cfg(test)]
    pub fn keep(&self, at: u64) -> HashSet<Revision> {
        let mut kept = Vec::new();
        self.keep_some(at, None, usize::MAX, &mut kept);
        kept.into_iter().collect()
    }

    /// [`keep`](Self::keep) for at most `limit` keys, in key order after `after` (from the
    /// first key when `None`), adding to `kept` the revision `<= at` that each would keep (at
    /// most one per key: `kept` grows in order, a page of memory at a time); returns the key
    /// to go on after, or `None` once every key was visited.
    ///
    /// Between two calls the index may change, but not what is kept at `at`: writes of
    /// revisions above `at` append to a key's history, or start one, or roll such a revision
    /// back, none of which moves a key's compaction point at `at` (the generation and the
    /// revision in it); a compaction at or below `at`, however far it got, keeps for each
    /// key its last revision at or below its own point and every later one, so the revision
    /// kept at `at` too, and drops only keys with nothing to keep at `at`. So calls made
    /// beside them add what one walk of an unchanging index would. Keys added before the key
    /// to go on after are not visited, and have nothing to keep at `at`.
    pub fn keep_some(
        &self,
        at: u64,
        after: Option<&[u8]>,
        limit: usize,
        kept: &mut Vec<Revision>,
    ) -> Option<Vec<u8>> {
        let lower = after.map_or(RangeBound::Unbounded, RangeBound::Excluded);
        let mut visited = 0;
        let mut last = None;
        let done = self.map.scan(lower, RangeBound::Unbounded, |key, e| {
            kept.extend(e.read(|e| e.keep(at)));
            visited += 1;
            if visited < limit {
                return true;
            }
            last = Some(key.to_vec());
            false
        });
        if done { None } else { last }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(main: u64) -> Revision {
        Revision::new(main, 0)
    }

    #[test]
    fn index_keys_order_as_their_bytes() {
        let mut next = crate::xorshift(0x2545_f491_4f6c_dd1d);
        // A small alphabet with zero bytes (the inline padding) and lengths on both sides of
        // the inline limit: shared prefixes, keys that are prefixes of others, zero tails.
        let mut key = || -> Vec<u8> {
            let len = (next() % (INLINE_KEY as u64 + 6)) as usize;
            (0..len)
                .map(|_| [0u8, b'a', 0xff][(next() % 3) as usize])
                .collect()
        };
        for _ in 0..50_000 {
            let (a, b) = (key(), key());
            let (ka, kb) = (IndexKey::from(&a[..]), IndexKey::from(&b[..]));
            assert_eq!(ka.cmp(&kb), a.cmp(&b), "{a:?} vs {b:?}");
            assert_eq!(ka == kb, a == b, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn inline_and_heap_keys_sort_and_match_alike() {
        // Lengths around the inline limit, sharing prefixes, in a scrambled order.
        let mut keys: Vec<Vec<u8>> = Vec::new();
        for len in INLINE_KEY - 2..=INLINE_KEY + 2 {
            for last in [0u8, b'a', 0xff] {
                let mut k = vec![b'k'; len];
                k[len - 1] = last;
                keys.push(k);
            }
        }
        keys.push(Vec::new());
        let mut idx = KeyIndex::default();
        for (i, k) in keys.iter().enumerate().rev() {
            idx.put(k, r(i as u64 + 1));
        }
        let mut sorted = keys.clone();
        sorted.sort();
        let mut seen = Vec::new();
        idx.scan(b"", &Bound::Unbounded, None, |k, _| {
            seen.push(k.to_vec());
            true
        });
        assert_eq!(seen, sorted);
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(
                idx.get(k, u64::MAX).map(|a| a.modified),
                Some(r(i as u64 + 1))
            );
            assert_eq!(
                IndexKey::from(&k[..]).cmp(&IndexKey::from(&keys[0][..])),
                k.cmp(&keys[0])
            );
        }
        assert!(matches!(
            IndexKey::from(&keys[0][..]),
            IndexKey::Inline { .. }
        ));
        assert!(matches!(
            IndexKey::from(&vec![0u8; INLINE_KEY + 1][..]),
            IndexKey::Heap(_)
        ));
    }

    #[test]
    fn scans_yield_their_bounds_keys_in_ascending_order() {
        use std::ops::RangeBounds;
        let mut next = crate::xorshift(0x2545_f491_4f6c_dd1d);
        let key = |next: &mut dyn FnMut() -> u64| -> Vec<u8> {
            let len = (next() % 5) as usize;
            (0..len)
                .map(|_| b"\0ab\xff"[(next() % 4) as usize])
                .collect()
        };
        let mut idx = KeyIndex::default();
        let mut model = std::collections::BTreeSet::new();
        for i in 0..300 {
            let k = key(&mut next);
            idx.put(&k, r(i + 1));
            model.insert(k);
        }
        for _ in 0..2_000 {
            let (start, end, after) = (key(&mut next), key(&mut next), key(&mut next));
            let stop = 1 + (next() % 40) as usize;
            let (b, upper) = match next() % 3 {
                0 => (Bound::Single, RangeBound::Included(start.clone())),
                1 => (Bound::Until(&end), RangeBound::Excluded(end.clone())),
                _ => (Bound::Unbounded, RangeBound::Unbounded),
            };
            let resume = next().is_multiple_of(2);
            let lower = if resume {
                RangeBound::Excluded(after.clone())
            } else {
                RangeBound::Included(start.clone())
            };
            let all: Vec<Vec<u8>> = model
                .iter()
                .filter(|k| (lower.as_ref(), upper.as_ref()).contains(k))
                .cloned()
                .collect();
            let expected = &all[..all.len().min(stop)];
            let mut seen = Vec::new();
            let done = idx.scan(&start, &b, resume.then_some(&after[..]), |k, _| {
                seen.push(k.to_vec());
                seen.len() < stop
            });
            assert_eq!(seen, expected, "{start:?} {upper:?} after {after:?}");
            assert_eq!(done, all.len() < stop);
        }
    }

    #[test]
    fn single_put_entries_stay_small() {
        // Index memory per key depends on this (BTreeMap leaves store entries inline).
        assert!(std::mem::size_of::<KeyEntry>() <= 32);
        assert!(std::mem::size_of::<Slot>() <= 40);
        let mut idx = KeyIndex::default();
        idx.put(b"a", r(1));
        assert!(matches!(
            idx.map.get(b"a").map(Slot::entry),
            Some(KeyEntry::Single { .. })
        ));
        idx.put(b"a", r(2));
        assert!(matches!(
            idx.map.get(b"a").map(Slot::entry),
            Some(KeyEntry::Multi(_))
        ));
        assert_eq!(idx.compact(2), HashSet::from([r(2)]));
        assert!(matches!(
            idx.map.get(b"a").map(Slot::entry),
            Some(KeyEntry::Single { ver: 2, .. })
        ));
    }

    /// Readers of a slot rewritten in place over and over, now as a single put, now as a
    /// vector, see only states that were written (no mix of two writes' fields), in the
    /// order they were written.
    #[test]
    fn lock_free_reads_never_see_a_torn_single_put() {
        // State `n`: every field a function of `n`, so a mix of two states shows.
        fn state(n: u64) -> KeyEntry {
            let rev = Revision::new(n, u64::from(n as u32 ^ 0x5a5a));
            if n.is_multiple_of(5) {
                KeyEntry::Multi(Gens {
                    gens: vec![Generation {
                        ver: n,
                        created: n / 3,
                        revs: vec![rev],
                    }],
                })
            } else {
                KeyEntry::single(n, n / 3, rev).expect("fits")
            }
        }
        let slot = Slot::new(state(1));
        let done = std::sync::atomic::AtomicBool::new(false);
        let seen = std::thread::scope(|s| {
            let readers: Vec<_> = (0..2)
                .map(|_| {
                    s.spawn(|| {
                        let (mut last, mut reads) = (0, 0u64);
                        while !done.load(Ordering::Relaxed) {
                            let at = slot.get(u64::MAX).expect("a live key");
                            let n = at.modified.main;
                            assert_eq!(
                                (at.version, at.created, at.modified.sub),
                                (n, n / 3, u64::from(n as u32 ^ 0x5a5a)),
                                "a torn state"
                            );
                            assert!(n >= last, "state {n} read after {last}");
                            last = n;
                            reads += 1;
                        }
                        reads
                    })
                })
                .collect();
            for n in 2..300_000 {
                slot.update(|e| *e = state(n));
            }
            done.store(true, Ordering::Relaxed);
            readers
                .into_iter()
                .map(|r| r.join().expect("reader"))
                .sum::<u64>()
        });
        assert!(seen > 0);
        assert_eq!(slot.entry(), state(299_999));
    }

    /// A put whose sub revision does not fit the inline entry's 32 bits is kept all the same.
    #[test]
    fn a_put_with_a_large_sub_revision_is_kept_whole() {
        let big = Revision::new(7, u64::from(u32::MAX) + 5);
        let mut idx = KeyIndex::default();
        idx.put(b"a", big);
        assert!(matches!(
            idx.map.get(b"a").map(Slot::entry),
            Some(KeyEntry::Multi(_))
        ));
        assert_eq!(idx.get(b"a", 7).map(|a| a.modified), Some(big));
        assert_eq!(idx.compact(7), HashSet::from([big]));
        assert_eq!(
            idx.get(b"a", 9).map(|a| (a.modified, a.version)),
            Some((big, 1))
        );
        idx.restore_put(b"b", 3, Revision::new(3, u64::MAX), 4);
        let at = idx.get(b"b", 3).expect("restored");
        assert_eq!((at.modified.sub, at.created, at.version), (u64::MAX, 3, 4));
        // A version, or a distance from the creating put, over 32 bits: kept whole too.
        let far = Revision::new(1 << 40, 2);
        idx.restore_put(b"c", 5, far, 1 << 33);
        idx.restore_put(b"d", 5, Revision::new(9, 0), 1 << 33);
        for (k, at) in [(&b"c"[..], far), (b"d", Revision::new(9, 0))] {
            let got = idx.get(k, at.main).expect("restored");
            assert_eq!((got.modified, got.created, got.version), (at, 5, 1 << 33));
        }
        idx.restore_put(b"e", 5, Revision::new(6, 1), 7);
        assert!(matches!(
            idx.map.get(b"e").map(Slot::entry),
            Some(KeyEntry::Single {
                ver: 7,
                created: 5,
                main: 6,
                sub: 1
            })
        ));
    }

    /// Compacting a few keys at a time, from where the last chunk stopped, keeps what a
    /// whole compaction keeps, leaves the same answers at and after the point (also midway,
    /// for the keys either side of the chunk), and packs leaves that removals thinned out.
    #[test]
    fn compacting_in_chunks_matches_a_whole_compaction() {
        let mut next = crate::xorshift(0x9e37_79b9_7f4a_7c15);
        let keys: Vec<Vec<u8>> = (0..500).map(|i| format!("k{i:04}").into_bytes()).collect();
        let (mut whole, mut chunked) = (KeyIndex::default(), KeyIndex::default());
        for main in 1..=4000 {
            let k = &keys[(next() % 500) as usize];
            let delete = next().is_multiple_of(4);
            for idx in [&mut whole, &mut chunked] {
                if delete {
                    idx.tombstone(k, r(main));
                } else {
                    idx.put(k, r(main));
                }
            }
        }
        let answers = |idx: &KeyIndex, at: u64| -> Vec<Option<KeyAt>> {
            keys.iter().map(|k| idx.get(k, at)).collect()
        };
        let at = 3000;
        let want: Vec<_> = (at..=4000)
            .step_by(97)
            .map(|a| answers(&whole, a))
            .collect();
        let kept = whole.compact(at);
        let mut available = Vec::new();
        let mut from: Option<Vec<u8>> = None;
        let mut chunks = 0;
        loop {
            from = chunked.compact_some(at, from.as_deref(), 7, &mut available);
            chunks += 1;
            if chunks % 10 == 0 {
                let midway: Vec<_> = (at..=4000)
                    .step_by(97)
                    .map(|a| answers(&chunked, a))
                    .collect();
                assert!(midway == want, "answers midway, chunk {chunks}");
            }
            if from.is_none() {
                break;
            }
        }
        assert!(chunks > 10, "{chunks} chunks");
        assert_eq!(available.len(), kept.len(), "a revision kept twice");
        assert_eq!(available.into_iter().collect::<HashSet<_>>(), kept);
        assert_eq!(chunked.len(), whole.len());
        let got: Vec<_> = (at..=4000)
            .step_by(97)
            .map(|a| answers(&chunked, a))
            .collect();
        assert_eq!(got, want);
        chunked.map.check();
        chunked.map.check_packed(None);
    }

    /// Walking for what a compaction keeps a few keys at a time, with writes of later
    /// revisions (puts, deletions, new keys, rolled back changes) and chunks of compactions
    /// at or below the walk's revision between the chunks, finds what one walk of the index
    /// left alone finds, each revision once.
    #[test]
    fn keeping_in_chunks_beside_writes_and_compactions_matches_a_whole_walk() {
        let mut next = crate::xorshift(0x2545_f491_4f6c_dd1d);
        let keys: Vec<Vec<u8>> = (0..500).map(|i| format!("k{i:04}").into_bytes()).collect();
        let mut idx = KeyIndex::default();
        for main in 1..=4000 {
            let k = &keys[(next() % 500) as usize];
            if next().is_multiple_of(4) {
                idx.tombstone(k, r(main));
            } else {
                idx.put(k, r(main));
            }
        }
        let at = 3500;
        let want = idx.keep(at);
        assert!(want.len() > 100, "{} kept", want.len());
        let mut main = 4000;
        let mut kept = Vec::new();
        let mut after: Option<Vec<u8>> = None;
        // Two compactions, each a few keys per step: one well below the walk's revision,
        // then one at it.
        let mut compactions = [(2000, None::<Vec<u8>>, false), (at, None, false)];
        let mut available = Vec::new();
        let mut chunks = 0;
        loop {
            after = idx.keep_some(at, after.as_deref(), 7, &mut kept);
            chunks += 1;
            if after.is_none() {
                break;
            }
            for _ in 0..3 {
                main += 1;
                let k = keys[(next() % 500) as usize].clone();
                match next() % 5 {
                    0 => {
                        idx.tombstone(&k, r(main));
                    }
                    1 => {
                        // A new key beside an old one.
                        let mut new = k.clone();
                        new.push(b'+');
                        idx.put(&new, r(main));
                    }
                    2 => {
                        // A new key's put, rolled back: the key goes again.
                        let mut new = k.clone();
                        new.push(b'-');
                        idx.put(&new, r(main));
                        assert!(idx.rollback(&new, r(main)));
                        idx.remove_if_empty(&new);
                    }
                    _ => idx.put(&k, r(main)),
                }
            }
            if let Some((point, from, done)) = compactions.iter_mut().find(|c| !c.2) {
                *from = idx.compact_some(*point, from.as_deref(), 20, &mut available);
                *done = from.is_none();
            }
        }
        assert!(chunks > 50, "{chunks} chunks");
        assert!(
            compactions.iter().all(|c| c.2),
            "the compactions did not finish during the walk"
        );
        let got: HashSet<Revision> = kept.iter().copied().collect();
        assert_eq!(got.len(), kept.len(), "a revision kept twice");
        assert_eq!(got, want);
        assert_eq!(idx.keep(at), want, "after the writes and compactions");
    }

    #[test]
    fn generations_follow_etcd() {
        let mut idx = KeyIndex::default();
        idx.put(b"foo", r(2));
        idx.put(b"foo", r(4));
        assert!(idx.tombstone(b"foo", r(6)));
        idx.put(b"foo", r(8));
        idx.put(b"foo", r(10));
        assert!(idx.tombstone(b"foo", r(12)));
        idx.put(b"foo", r(14));
        assert_eq!(idx.get(b"foo", 1), None);
        let at = idx.get(b"foo", 5).unwrap();
        assert_eq!((at.modified, at.created, at.version), (r(4), 2, 2));
        assert_eq!(idx.get(b"foo", 6), None);
        assert_eq!(idx.get(b"foo", 7), None);
        let at = idx.get(b"foo", 11).unwrap();
        assert_eq!((at.modified, at.created, at.version), (r(10), 8, 2));
        assert_eq!(idx.get(b"foo", 13), None);
        assert_eq!(idx.get(b"foo", 14).unwrap().modified, r(14));
        assert!(!idx.tombstone(b"bar", r(15)));

        let keep = idx.keep(7);
        let avail = idx.compact(7);
        assert_eq!(keep, avail);
        // Generation one ended at 6 <= 7: gone; nothing of it survives.
        assert!(avail.is_empty());
        assert_eq!(idx.get(b"foo", 11).unwrap().modified, r(10));
        let avail = idx.compact(10);
        assert_eq!(avail, HashSet::from([r(10)]));
        assert_eq!(idx.get(b"foo", 10).unwrap().version, 2);
        let avail = idx.compact(13);
        assert!(avail.is_empty());
        assert_eq!(idx.get(b"foo", 14).unwrap().created, 14);
        assert_eq!(idx.len(), 1);
        assert!(idx.tombstone(b"foo", r(16)));
        let keep = idx.keep(16);
        assert!(keep.is_empty());
        assert!(idx.compact(16).is_empty());
        assert_eq!(idx.len(), 0);
    }
}
