//! Matching one changed key against many watchers at once.
//!
//! Single-key watchers sit in a hash map from the key to their ids, so a change costs one
//! lookup whatever the number of watchers; keys of up to 38 bytes are held in the map's own
//! entries, so that lookup compares them without following a pointer. Range watchers sit in an interval index: an array
//! sorted by range start, read as an implicit balanced binary tree whose every node also knows
//! the largest range end below it, so a stabbing query visits `O(log n + matches)` nodes and
//! never a subtree whose ranges all end before the key (etcd's interval tree, static). Added
//! ranges first go to a short unsorted tail and removed ones are only marked; the array is
//! rebuilt once the tail outgrows `16 + √n` or the marks a quarter of it, which keeps every
//! update amortised `O(√n · log n)` and every query `O(log n + √n + matches)`.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::Arc;

/// A fast, non-cryptographic hasher (the word-at-a-time `FxHash` of rustc, with a final
/// avalanche) for watched keys and watcher ids, started from its map's random seed.
#[derive(Default, Clone, Copy)]
pub(crate) struct FxHasher {
    hash: u64,
}

/// Builds [`FxHasher`]s from a seed drawn at random for each map (from the standard
/// library's per-process random keys), so that keys chosen by clients cannot be prepared
/// to collide in advance.
#[derive(Clone, Copy)]
pub(crate) struct FxBuild {
    seed: u64,
}

impl Default for FxBuild {
    fn default() -> FxBuild {
        FxBuild {
            seed: RandomState::new().hash_one(0x6b65_656c_u64),
        }
    }
}

impl BuildHasher for FxBuild {
    type Hasher = FxHasher;

    #[inline]
    fn build_hasher(&self) -> FxHasher {
        FxHasher { hash: self.seed }
    }
}

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl FxHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FxHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ ((rest.len() as u64) << 56));
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    /// The multiply-rotate rounds leave the low bits (hashbrown's bucket index) depending
    /// on the low input bytes only, which keys sharing a long suffix pattern share: a
    /// final avalanche (MurmurHash3's `fmix64`) spreads every input bit over all of them.
    #[inline]
    fn finish(&self) -> u64 {
        let mut h = self.hash;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        h ^ (h >> 33)
    }
}

/// Hash map keyed with [`FxHasher`], randomly seeded.
pub(crate) type FxMap<K, V> = HashMap<K, V, FxBuild>;
/// Hash set keyed with [`FxHasher`], randomly seeded.
pub(crate) type FxSet<K> = HashSet<K, FxBuild>;

/// Where a watched range ends (exclusive).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum End {
    /// Before this key.
    Key(Arc<[u8]>),
    /// After every key (etcd's range end `"\0"`).
    Unbounded,
}

impl End {
    /// True when the range ending here still holds `key`.
    #[inline]
    fn after(&self, key: &[u8]) -> bool {
        match self {
            End::Key(e) => e.as_ref() > key,
            End::Unbounded => true,
        }
    }
}

struct Interval {
    start: Arc<[u8]>,
    end: End,
    id: u64,
}

/// The interval index of the module docs.
#[derive(Default)]
struct Intervals {
    /// Sorted by `(start, id)`.
    sorted: Vec<Interval>,
    /// `max_end[mid]`: position in `sorted` of the largest end among the subtree rooted at
    /// `mid` (the subarray the recursion gives that node).
    max_end: Vec<u32>,
    /// Added since the last rebuild; scanned linearly.
    tail: Vec<Interval>,
    /// Ids in `sorted` that were removed since the last rebuild.
    removed: FxSet<u64>,
}

impl Intervals {
    fn len(&self) -> usize {
        self.sorted.len() - self.removed.len() + self.tail.len()
    }

    fn insert(&mut self, id: u64, start: Arc<[u8]>, end: End) {
        self.tail.push(Interval { start, end, id });
        if self.tail.len() > 16 + self.sorted.len().isqrt() {
            self.rebuild();
        }
    }

    fn remove(&mut self, id: u64) {
        if let Some(i) = self.tail.iter().position(|iv| iv.id == id) {
            self.tail.swap_remove(i);
            return;
        }
        self.removed.insert(id);
        if self.removed.len() > 16 + self.sorted.len() / 4 {
            self.rebuild();
        }
    }

    fn rebuild(&mut self) {
        let removed = std::mem::take(&mut self.removed);
        let mut all = std::mem::take(&mut self.sorted);
        all.retain(|iv| !removed.contains(&iv.id));
        all.append(&mut self.tail);
        all.sort_unstable_by(|a, b| a.start.cmp(&b.start).then(a.id.cmp(&b.id)));
        self.max_end = vec![0; all.len()];
        self.sorted = all;
        self.build_max(0, self.sorted.len());
    }

    /// Fills `max_end` for the subtree over `sorted[lo..hi]`; returns its max position.
    fn build_max(&mut self, lo: usize, hi: usize) -> Option<u32> {
        if lo >= hi {
            return None;
        }
        let mid = lo + (hi - lo) / 2;
        let mut best = mid as u32;
        for child in [self.build_max(lo, mid), self.build_max(mid + 1, hi)]
            .into_iter()
            .flatten()
        {
            if self.sorted[child as usize].end > self.sorted[best as usize].end {
                best = child;
            }
        }
        self.max_end[mid] = best;
        Some(best)
    }

    fn stab(&self, key: &[u8], f: &mut impl FnMut(u64)) {
        self.stab_in(0, self.sorted.len(), key, f);
        for iv in &self.tail {
            if iv.start.as_ref() <= key && iv.end.after(key) {
                f(iv.id);
            }
        }
    }

    fn stab_in(&self, lo: usize, hi: usize, key: &[u8], f: &mut impl FnMut(u64)) {
        if lo >= hi {
            return;
        }
        let mid = lo + (hi - lo) / 2;
        if !self.sorted[self.max_end[mid] as usize].end.after(key) {
            return;
        }
        self.stab_in(lo, mid, key, f);
        let iv = &self.sorted[mid];
        if iv.start.as_ref() <= key {
            if iv.end.after(key) && (self.removed.is_empty() || !self.removed.contains(&iv.id)) {
                f(iv.id);
            }
            self.stab_in(mid + 1, hi, key, f);
        }
    }
}

/// Longest key a [`MapKey`] holds inline.
const INLINE_KEY: usize = 38;

/// A watched key as the map holds it: short keys inline in the map's own entry, so a lookup
/// compares them without following a pointer to another cache line; longer ones shared.
#[derive(Clone)]
enum MapKey {
    Inline { len: u8, bytes: [u8; INLINE_KEY] },
    Shared(Arc<[u8]>),
}

impl MapKey {
    fn new(key: &Arc<[u8]>) -> MapKey {
        if key.len() <= INLINE_KEY {
            let mut bytes = [0u8; INLINE_KEY];
            bytes[..key.len()].copy_from_slice(key);
            MapKey::Inline {
                len: key.len() as u8,
                bytes,
            }
        } else {
            MapKey::Shared(key.clone())
        }
    }

    #[inline]
    fn as_slice(&self) -> &[u8] {
        match self {
            MapKey::Inline { len, bytes } => &bytes[..usize::from(*len)],
            MapKey::Shared(key) => key,
        }
    }
}

// Hashes and compares as the key's bytes, so the map is searched with a `&[u8]`.
impl std::hash::Hash for MapKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state);
    }
}

impl PartialEq for MapKey {
    fn eq(&self, other: &MapKey) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for MapKey {}

impl std::borrow::Borrow<[u8]> for MapKey {
    fn borrow(&self) -> &[u8] {
        self.as_slice()
    }
}

/// The watchers of one key: most keys have one, kept without an allocation of its own (and
/// the entry small: more watchers of one key sit in a boxed slice, rebuilt on change).
enum Ids {
    One(u64),
    Many(Box<[u64]>),
}

impl Ids {
    fn push(&mut self, id: u64) {
        let mut ids = match self {
            Ids::One(first) => vec![*first],
            Ids::Many(ids) => ids.to_vec(),
        };
        ids.push(id);
        *self = Ids::Many(ids.into_boxed_slice());
    }

    /// Removes `id`; true when none is left.
    fn remove(&mut self, id: u64) -> bool {
        match self {
            Ids::One(only) => *only == id,
            Ids::Many(ids) => {
                let left: Box<[u64]> = ids.iter().copied().filter(|&i| i != id).collect();
                *ids = left;
                ids.is_empty()
            }
        }
    }
}

/// Watchers by what they watch: one key, or a range `[key, end)`.
#[derive(Default)]
pub(crate) struct Matcher {
    keys: FxMap<MapKey, Ids>,
    ranges: Intervals,
}

impl Matcher {
    /// Adds watcher `id` of `key` (`end = None`) or of the range `[key, end)`.
    pub fn insert(&mut self, id: u64, key: &Arc<[u8]>, end: Option<&End>) {
        match end {
            None => match self.keys.entry(MapKey::new(key)) {
                Entry::Occupied(mut e) => e.get_mut().push(id),
                Entry::Vacant(e) => {
                    e.insert(Ids::One(id));
                }
            },
            Some(end) => self.ranges.insert(id, key.clone(), end.clone()),
        }
    }

    /// Removes watcher `id`, added with the same `key` and `end`.
    pub fn remove(&mut self, id: u64, key: &[u8], end: Option<&End>) {
        match end {
            None => {
                if let Some(ids) = self.keys.get_mut(key)
                    && ids.remove(id)
                {
                    self.keys.remove(key);
                }
            }
            Some(_) => self.ranges.remove(id),
        }
    }

    /// Calls `f` with every watcher whose key or range holds `key`.
    #[inline]
    pub fn for_each_match(&self, key: &[u8], mut f: impl FnMut(u64)) {
        match self.keys.get(key) {
            Some(Ids::One(id)) => f(*id),
            Some(Ids::Many(ids)) => ids.iter().for_each(|&id| f(id)),
            None => {}
        }
        if self.ranges.len() > 0 {
            self.ranges.stab(key, &mut f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn key(r: &mut impl Rng) -> Arc<[u8]> {
        let n = r.random_range(0..3);
        (0..n)
            .map(|_| r.random_range(b'a'..=b'e'))
            .collect::<Vec<u8>>()
            .into()
    }

    /// Keys that differ only in their last bytes (counters) still spread over the low bits
    /// hashbrown picks buckets with.
    #[test]
    fn hash_low_bits_spread_counter_keys() {
        let build = FxBuild::default();
        let low: FxSet<u64> = (0..10_000u64)
            .map(|i| build.hash_one(format!("key-{i:020}").as_bytes()) & 0x3fff)
            .collect();
        assert!(low.len() > 7_000, "{} distinct low bits", low.len());
    }

    /// Keys short enough to sit inline and longer shared ones (around the boundary) are
    /// found, told apart and removed alike.
    #[test]
    fn inline_and_shared_keys_match_alike() {
        let mut m = Matcher::default();
        let distinct: std::collections::BTreeSet<Vec<u8>> =
            [0, 1, 2, INLINE_KEY - 1, INLINE_KEY, INLINE_KEY + 1, 100]
                .iter()
                .flat_map(|&n| {
                    [
                        vec![b'k'; n],
                        [vec![b'k'; n.saturating_sub(1)], vec![b'x']].concat(),
                    ]
                })
                .collect();
        let keys: Vec<Arc<[u8]>> = distinct.into_iter().map(Arc::from).collect();
        for (id, k) in keys.iter().enumerate() {
            m.insert(id as u64, k, None);
            m.insert(1_000 + id as u64, k, None);
        }
        for (id, k) in keys.iter().enumerate() {
            let mut got = Vec::new();
            m.for_each_match(k, |i| got.push(i));
            got.sort_unstable();
            assert_eq!(
                got,
                [id as u64, 1_000 + id as u64],
                "key of {} bytes",
                k.len()
            );
            m.remove(id as u64, k, None);
            m.remove(1_000 + id as u64, k, None);
            let mut none = Vec::new();
            m.for_each_match(k, |i| none.push(i));
            assert!(
                none.is_empty(),
                "removed key of {} bytes still matches",
                k.len()
            );
        }
        assert!(m.keys.is_empty());
    }

    /// Each map draws its own seed: the same key hashes apart in two maps, and alike in one.
    #[test]
    fn maps_are_seeded_apart() {
        let (a, b) = (FxBuild::default(), FxBuild::default());
        let key = b"key-00000000000000000042".as_slice();
        assert_eq!(a.hash_one(key), a.hash_one(key));
        assert_ne!(a.hash_one(key), b.hash_one(key));
        let low = |build: FxBuild| build.hash_one(key) & 0xffff;
        let distinct: FxSet<u64> = (0..64).map(|_| low(FxBuild::default())).collect();
        assert!(
            distinct.len() > 48,
            "{} distinct bucket bits",
            distinct.len()
        );
    }

    /// Random inserts and removes of keys and ranges; every query equals a brute-force scan.
    #[test]
    fn matches_equal_a_brute_force_scan() {
        for seed in 0..20u64 {
            let mut r = rand::rngs::StdRng::seed_from_u64(seed);
            let mut m = Matcher::default();
            let mut live: Vec<(u64, Arc<[u8]>, Option<End>)> = Vec::new();
            for id in 0..600u64 {
                if !live.is_empty() && r.random_bool(0.3) {
                    let (rid, k, e) = live.swap_remove(r.random_range(0..live.len()));
                    m.remove(rid, &k, e.as_ref());
                } else {
                    let k = key(&mut r);
                    let e = match r.random_range(0..4) {
                        0 => None,
                        1 => Some(End::Unbounded),
                        _ => Some(End::Key(key(&mut r))),
                    };
                    m.insert(id, &k, e.as_ref());
                    live.push((id, k, e));
                }
                for _ in 0..3 {
                    let q = key(&mut r);
                    let mut got = Vec::new();
                    m.for_each_match(&q, |i| got.push(i));
                    got.sort_unstable();
                    let mut want: Vec<u64> = live
                        .iter()
                        .filter(|(_, k, e)| match e {
                            None => k.as_ref() == q.as_ref(),
                            Some(e) => k.as_ref() <= q.as_ref() && e.after(&q),
                        })
                        .map(|(i, _, _)| *i)
                        .collect();
                    want.sort_unstable();
                    assert_eq!(got, want, "seed {seed}, query {q:?}");
                }
            }
        }
    }
}
