//! The key index's ordered map: entries in sorted leaves of up to [`LEAF`] keys, each leaf
//! found by its first key in a `BTreeMap`.
//!
//! Why not a `BTreeMap` of the entries themselves: its nodes hold at most eleven entries and
//! split in half when full, so keys added in ascending order (sequence numbers, timestamps:
//! what a store typically adds) leave every node about half full, and a scan follows a
//! pointer to a new node every five or six keys, each a wait on memory for a large index.
//! Here a leaf holds up to [`LEAF`] entries side by side, each key beside its value, and a
//! key added after the last key of a full leaf starts a new leaf instead of splitting it:
//! keys added in order fill their leaves, and a scan reads long runs of adjacent memory that
//! the processor fetches ahead. A key added inside a full leaf splits it in half, as a
//! B-tree does, so keys in random order leave leaves between half and wholly full.
//!
//! A leaf is searched block by block (see `Leaf::find`) rather than by halves: lookups of
//! keys in random order among a million, out of the cache, then cost about what the
//! `BTreeMap`'s do, where a binary search of the leaf took twice as long.
//!
//! The top map is ordered by *descending* first key, and scans walk it backwards. A
//! `BTreeMap` node is searched from its first key on, so a key above every key of a node is
//! compared with each of them: in ascending order, the keys a store typically adds (each
//! above the last) would walk the right spine and cost every comparison of every node on
//! the way; in descending order they walk the left spine, one comparison per level. Keys in
//! random order cost the same either way. The leaf that may hold a key is the first one, in
//! the map's order, whose first key is at or below it.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::ops::Bound;

use super::IndexKey;

/// Most keys a leaf holds.
pub(crate) const LEAF: usize = 32;

/// Entries a leaf search steps over at once (see `Leaf::find`).
const BLOCK: usize = 8;

/// One leaf: entries sorted by key, each key beside its value (a lookup's last probe reads
/// both); never empty in a map.
#[derive(Debug)]
struct Leaf<V> {
    entries: Vec<(IndexKey, V)>,
}

impl<V> Leaf<V> {
    fn new() -> Leaf<V> {
        Leaf {
            entries: Vec::with_capacity(LEAF),
        }
    }

    /// A leaf of one entry.
    fn of(key: IndexKey, value: V) -> Leaf<V> {
        let mut leaf = Leaf::new();
        leaf.entries.push((key, value));
        leaf
    }

    /// Where `key` is (`Ok`) or would go (`Err`).
    ///
    /// Past the last key (where keys added in ascending order go) is checked first. Then the
    /// search steps over blocks of [`BLOCK`] entries by their last keys and walks the block
    /// that holds the key: the next comparison's load does not wait on the last one's
    /// outcome (the branch is predicted), as a binary search's does, so a leaf out of the
    /// cache costs about one wait on memory instead of one per probe; and about a quarter of
    /// the leaf is compared, not half.
    #[inline]
    fn find(&self, key: &IndexKey) -> Result<usize, usize> {
        let e = &self.entries;
        let n = e.len();
        match e.last() {
            Some((last, _)) if last < key => return Err(n),
            None => return Err(0),
            _ => {}
        }
        let mut i = 0;
        while i + BLOCK < n && e[i + BLOCK - 1].0 < *key {
            i += BLOCK;
        }
        for (j, (k, _)) in e[i..].iter().enumerate() {
            match k.cmp(key) {
                std::cmp::Ordering::Less => {}
                std::cmp::Ordering::Equal => return Ok(i + j),
                std::cmp::Ordering::Greater => return Err(i + j),
            }
        }
        Err(n)
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    fn key(&self, i: usize) -> &IndexKey {
        &self.entries[i].0
    }

    /// The top map's key of the leaf.
    fn first(&self) -> Reverse<IndexKey> {
        Reverse(self.entries[0].0.clone())
    }

    /// The second half of the leaf, split off.
    fn split(&mut self) -> Leaf<V> {
        let mut right = Leaf::new();
        right.entries.extend(self.entries.drain(LEAF / 2..));
        right
    }
}

/// A leaf taken out of the top map to be changed: put back, keyed by its first key, when
/// dropped (on unwinding too), unless it was emptied.
struct Taken<'a, V> {
    top: &'a mut BTreeMap<Reverse<IndexKey>, Leaf<V>>,
    leaf: Leaf<V>,
}

impl<V> Drop for Taken<'_, V> {
    fn drop(&mut self) {
        if self.leaf.len() > 0 {
            let leaf = std::mem::replace(
                &mut self.leaf,
                Leaf {
                    entries: Vec::new(),
                },
            );
            self.top.insert(leaf.first(), leaf);
        }
    }
}

/// An ordered map from byte-string keys to `V` (see the module doc).
#[derive(Debug)]
pub(crate) struct LeafMap<V> {
    /// Leaves by their first key, in descending order.
    top: BTreeMap<Reverse<IndexKey>, Leaf<V>>,
    len: usize,
}

impl<V> Default for LeafMap<V> {
    fn default() -> LeafMap<V> {
        LeafMap {
            top: BTreeMap::new(),
            len: 0,
        }
    }
}

/// The top map's key for `key`.
#[inline]
fn desc(key: &[u8]) -> Reverse<IndexKey> {
    Reverse(IndexKey::from(key))
}

impl<V> LeafMap<V> {
    /// Number of keys.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The value of `key`.
    #[inline]
    pub fn get(&self, key: &[u8]) -> Option<&V> {
        // The leaf that holds `key` if any does: the last one whose first key is at or
        // below it.
        let probe = desc(key);
        let (_, leaf) = self.top.range(&probe..).next()?;
        leaf.find(&probe.0).ok().map(|i| &leaf.entries[i].1)
    }

    /// The value of `key`, to change.
    pub fn get_mut(&mut self, key: &[u8]) -> Option<&mut V> {
        let probe = desc(key);
        let (_, leaf) = self.top.range_mut(&probe..).next()?;
        let i = leaf.find(&probe.0).ok()?;
        Some(&mut leaf.entries[i].1)
    }

    /// Calls `update` on the value of `key`, or adds `key` with the value `insert` makes.
    pub fn upsert<R>(
        &mut self,
        key: &[u8],
        insert: impl FnOnce() -> V,
        update: impl FnOnce(&mut V) -> R,
    ) -> Option<R> {
        let probe = desc(key);
        let Some((first, leaf)) = self.top.range_mut(&probe..).next() else {
            // Below every key (or the map is empty): the key opens the first leaf.
            self.add_first(probe, insert());
            return None;
        };
        let at = match leaf.find(&probe.0) {
            Ok(i) => return Some(update(&mut leaf.entries[i].1)),
            Err(at) => at,
        };
        self.len += 1;
        if leaf.len() < LEAF {
            leaf.entries.insert(at, (probe.0, insert()));
            return None;
        }
        if at == LEAF {
            // After the last key of a full leaf: a new leaf, so keys added in ascending
            // order fill theirs.
            let fresh = Leaf::of(probe.0.clone(), insert());
            self.top.insert(probe, fresh);
            return None;
        }
        let mut right = leaf.split();
        let target = if at <= LEAF / 2 { leaf } else { &mut right };
        let at = if at <= LEAF / 2 { at } else { at - LEAF / 2 };
        target.entries.insert(at, (probe.0, insert()));
        // `first` is unchanged: `at` was not 0 (the leaf's first key is at or below `key`,
        // and not equal to it).
        debug_assert!(first.0.as_slice() < key);
        self.top.insert(right.first(), right);
        None
    }

    /// Adds `key`, below every key in the map, with `value`.
    fn add_first(&mut self, key: Reverse<IndexKey>, value: V) {
        self.len += 1;
        if let Some(mut entry) = self.top.last_entry()
            && entry.get().len() < LEAF
        {
            entry.get_mut().entries.insert(0, (key.0.clone(), value));
            let leaf = entry.remove();
            self.top.insert(key, leaf);
            return;
        }
        let fresh = Leaf::of(key.0.clone(), value);
        self.top.insert(key, fresh);
    }

    /// Removes `key`, returning its value.
    pub fn remove(&mut self, key: &[u8]) -> Option<V> {
        let probe = desc(key);
        let (first, leaf) = self.top.range_mut(&probe..).next()?;
        let i = leaf.find(&probe.0).ok()?;
        let (_, value) = leaf.entries.remove(i);
        self.len -= 1;
        if i == 0 {
            // The leaf's first key changed (or it is empty): it moves in the top map.
            let first = first.clone();
            let leaf = self.top.remove(&first).expect("the leaf just found");
            if leaf.len() > 0 {
                self.top.insert(leaf.first(), leaf);
            }
        }
        Some(value)
    }

    /// Keeps the entries for which `keep` returns true, in key order; the leaves are packed
    /// full again.
    ///
    /// Should `keep` panic, the map still holds every entry it had not yet refused, with its
    /// leaves packed: the leaves are filtered in place, and packed by a guard that runs on
    /// unwinding too.
    #[cfg(test)]
    pub fn retain(&mut self, mut keep: impl FnMut(&[u8], &mut V) -> bool) {
        /// Packs the leaves however the filtering ends.
        struct Pack<'a, V>(&'a mut LeafMap<V>);
        impl<V> Drop for Pack<'_, V> {
            fn drop(&mut self) {
                self.0.pack();
            }
        }
        let map = Pack(self);
        for leaf in map.0.top.values_mut().rev() {
            leaf.entries.retain_mut(|(k, v)| keep(k.as_slice(), v));
        }
    }

    /// [`retain`](Self::retain) for at most `limit` entries, in key order from `from` (the
    /// first key when `None`) on; returns the key to go on from, or `None` once the last
    /// entry was visited. Between two calls the map may change; keys added before the key to
    /// go on from are not visited.
    ///
    /// The leaves are packed as the retain goes, never in a pass over the whole map: a leaf
    /// left empty is dropped, one whose first key went is keyed by its new one, and one that
    /// fits in the leaf before it (with that leaf's entries) goes into it. A call moves only
    /// entries of the leaves it visits, at most `limit` and two leaves' more, so its cost
    /// stays bounded however many leaves removals thinned out; and once a retain has visited
    /// every entry with the map left alone meanwhile, no two neighbouring leaves would fit in
    /// one, so the leaves are on average more than half full.
    ///
    /// Should `keep` panic, the map still holds every entry it had not yet refused: the leaf
    /// being filtered is put back by a guard that runs on unwinding too.
    pub fn retain_from(
        &mut self,
        from: Option<&[u8]>,
        limit: usize,
        mut keep: impl FnMut(&[u8], &mut V) -> bool,
    ) -> Option<Vec<u8>> {
        // The key to go on from, as the top map orders keys.
        let mut cursor: Option<Reverse<IndexKey>> = from.map(desc);
        let mut visited = 0;
        loop {
            // The leaf that may hold the cursor (the last whose first key is at or below
            // it), or the first leaf.
            let held = cursor.as_ref().and_then(|c| self.top.range(c..).next());
            let first = match held {
                Some((first, _)) => first.clone(),
                None => self.top.keys().next_back()?.clone(),
            };
            let leaf = self.top.remove(&first).expect("the leaf just found");
            // Put back however the filtering ends, should `keep` panic.
            let mut taken = Taken {
                top: &mut self.top,
                leaf,
            };
            let leaf = &mut taken.leaf;
            let mut i = cursor
                .as_ref()
                .map_or(0, |c| leaf.find(&c.0).unwrap_or_else(|at| at));
            while i < leaf.len() && visited < limit {
                visited += 1;
                let (k, v) = &mut leaf.entries[i];
                if keep(k.as_slice(), v) {
                    i += 1;
                } else {
                    leaf.entries.remove(i);
                    self.len -= 1;
                }
            }
            let next = if i < leaf.len() {
                Some(Reverse(leaf.key(i).clone()))
            } else {
                // The first key of the next leaf in key order (the map is descending).
                taken
                    .top
                    .range(..&first)
                    .next_back()
                    .map(|(f, _)| f.clone())
            };
            // Into the leaf before it in key order (after `first` in the descending top
            // map), whose first key stays, when both fit in one; left empty, it is dropped by
            // the guard. The key to go on from may now be in that leaf, where the next call
            // finds it as the last leaf whose first key is at or below it.
            if let Some((_, before)) = taken
                .top
                .range_mut((Bound::Excluded(&first), Bound::Unbounded))
                .next()
                && before.len() + taken.leaf.len() <= LEAF
            {
                before.entries.append(&mut taken.leaf.entries);
            }
            drop(taken);
            match next {
                Some(next) if visited >= limit => return Some(next.0.as_slice().to_vec()),
                Some(next) => cursor = Some(next),
                None => return None,
            }
        }
    }

    /// Moves the entries into full leaves (the last one excepted), dropping empty leaves and
    /// keying each leaf by its first key again; counts the entries.
    #[cfg(test)]
    fn pack(&mut self) {
        let old = std::mem::take(&mut self.top);
        let mut packed: Vec<(Reverse<IndexKey>, Leaf<V>)> = Vec::new();
        let mut leaf = Leaf::new();
        let mut len = 0;
        for (k, v) in old.into_values().rev().flat_map(|l| l.entries) {
            if leaf.len() == LEAF {
                let full = std::mem::replace(&mut leaf, Leaf::new());
                packed.push((full.first(), full));
            }
            leaf.entries.push((k, v));
            len += 1;
        }
        if leaf.len() > 0 {
            packed.push((leaf.first(), leaf));
        }
        // In descending order, as the map keeps them: built in one pass.
        packed.reverse();
        self.top = packed.into_iter().collect();
        self.len = len;
    }

    /// Every value, in key order.
    #[cfg(test)]
    pub fn values(&self) -> impl Iterator<Item = &V> {
        self.top
            .values()
            .rev()
            .flat_map(|l| l.entries.iter().map(|(_, v)| v))
    }

    /// Calls `f(key, value)` for the keys within `(lower, upper)`, in ascending order, until
    /// it returns false; true when the range was exhausted. The bounds must not be
    /// inverted.
    pub fn scan(
        &self,
        lower: Bound<&[u8]>,
        upper: Bound<&[u8]>,
        mut f: impl FnMut(&[u8], &V) -> bool,
    ) -> bool {
        // The leaves from the one holding the lower bound (walked backwards: in ascending
        // order), and where to start in the first.
        let all = || self.top.range::<Reverse<IndexKey>, _>(..);
        let (leaves, mut from) = match lower {
            Bound::Unbounded => (all(), 0),
            Bound::Included(a) | Bound::Excluded(a) => {
                let probe = desc(a);
                match self.top.range(&probe..).next() {
                    Some((first, leaf)) => {
                        let from = match (leaf.find(&probe.0), lower) {
                            (Ok(i), Bound::Excluded(_)) => i + 1,
                            (Ok(i) | Err(i), _) => i,
                        };
                        (self.top.range(..=first), from)
                    }
                    None => (all(), 0),
                }
            }
        };
        for (_, leaf) in leaves.rev() {
            // Where the range ends in this leaf: one comparison settles a leaf wholly
            // inside it.
            let last = leaf.key(leaf.len() - 1).as_slice();
            let (to, done) = match upper {
                Bound::Unbounded => (leaf.len(), false),
                Bound::Excluded(b) if last < b => (leaf.len(), false),
                Bound::Included(b) if last <= b => (leaf.len(), false),
                Bound::Excluded(b) => (leaf.find(&b.into()).unwrap_or_else(|i| i), true),
                Bound::Included(b) => (leaf.find(&b.into()).map_or_else(|i| i, |i| i + 1), true),
            };
            for (k, v) in leaf.entries.get(from..to).unwrap_or_default() {
                if !f(k.as_slice(), v) {
                    return false;
                }
            }
            if done {
                return true;
            }
            from = 0;
        }
        true
    }

    /// Number of leaves.
    #[cfg(test)]
    pub fn leaf_count(&self) -> usize {
        self.top.len()
    }

    /// Each leaf's first key and number of entries, in key order (tests).
    #[cfg(test)]
    pub fn leaf_sizes(&self) -> Vec<(Vec<u8>, usize)> {
        self.top
            .iter()
            .rev()
            .map(|(first, leaf)| (first.0.as_slice().to_vec(), leaf.len()))
            .collect()
    }

    /// Checks that no two neighbouring leaves would fit in one, for the leaves whose first
    /// key is below `to` (all of them when `None`): leaves are more than half full on
    /// average (tests).
    #[cfg(test)]
    pub fn check_packed(&self, to: Option<&[u8]>) {
        let sizes = self.leaf_sizes();
        for pair in sizes.windows(2) {
            let [(a, n), (b, m)] = pair else { continue };
            if to.is_some_and(|to| b.as_slice() >= to) {
                break;
            }
            assert!(
                n + m > LEAF,
                "neighbouring leaves {:?} and {:?} hold {n} and {m} entries: they fit in one \
                 ({} leaves for {} entries)",
                String::from_utf8_lossy(a),
                String::from_utf8_lossy(b),
                sizes.len(),
                self.len
            );
        }
    }

    /// Checks the map's invariants (tests).
    #[cfg(test)]
    pub fn check(&self) {
        let mut prev: Option<&[u8]> = None;
        let mut len = 0;
        for (first, leaf) in self.top.iter().rev() {
            assert!(leaf.len() > 0, "an empty leaf");
            assert!(leaf.len() <= LEAF, "an overfull leaf");
            assert_eq!(first.0, *leaf.key(0), "leaf filed under another key");
            for (k, _) in &leaf.entries {
                if let Some(p) = prev {
                    assert!(p < k.as_slice(), "keys out of order");
                }
                prev = Some(k.as_slice());
                len += 1;
            }
        }
        assert_eq!(len, self.len, "length");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random adds, updates, removals, retains and scans against a `BTreeMap`, with keys
    /// short and long (on the heap), dense and sparse.
    #[test]
    fn behaves_as_an_ordered_map() {
        for (seed, space, ops) in [(1u64, 50u64, 3_000), (2, 5_000, 20_000), (3, 400, 20_000)] {
            let mut next = crate::xorshift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
            let key = |n: u64| -> Vec<u8> {
                if n.is_multiple_of(7) {
                    format!("a-long-key-that-lives-on-the-heap-{n:08}").into_bytes()
                } else {
                    format!("k{n:06}").into_bytes()
                }
            };
            let mut map: LeafMap<u64> = LeafMap::default();
            let mut model: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
            for op in 0..ops {
                let k = key(next() % space);
                match next() % 10 {
                    0..=4 => {
                        let v = next();
                        let updated = map.upsert(&k, || v, |old| std::mem::replace(old, v));
                        assert_eq!(updated, model.insert(k.clone(), v), "upsert {op}");
                    }
                    5 | 6 => assert_eq!(map.remove(&k), model.remove(&k), "remove {op}"),
                    7 => {
                        if let Some(v) = map.get_mut(&k) {
                            *v += 1;
                        }
                        if let Some(v) = model.get_mut(&k) {
                            *v += 1;
                        }
                        assert_eq!(map.get(&k), model.get(&k), "get {op}");
                    }
                    8 => {
                        let k2 = key(next() % space);
                        let (lo, hi) = if k <= k2 { (k, k2) } else { (k2, k) };
                        let lower = match next() % 3 {
                            0 => Bound::Included(lo.as_slice()),
                            1 => Bound::Excluded(lo.as_slice()),
                            _ => Bound::Unbounded,
                        };
                        let upper = match next() % 3 {
                            0 => Bound::Included(hi.as_slice()),
                            1 if lo != hi || lower == Bound::Unbounded => {
                                Bound::Excluded(hi.as_slice())
                            }
                            _ => Bound::Unbounded,
                        };
                        let stop = (next() % 40) as usize;
                        let mut got = Vec::new();
                        let done = map.scan(lower, upper, |k, v| {
                            got.push((k.to_vec(), *v));
                            got.len() < stop
                        });
                        let want: Vec<(Vec<u8>, u64)> = model
                            .range::<[u8], _>((lower, upper))
                            .map(|(k, v)| (k.clone(), *v))
                            .collect();
                        let n = want.len().min(stop.max(1));
                        assert_eq!(got, want[..n.min(want.len())], "scan {op}");
                        assert_eq!(done, want.len() < stop.max(1), "scan {op} exhausted");
                    }
                    _ => {
                        if next().is_multiple_of(50) {
                            // A third of the entries go, or all but a tenth.
                            let cut = next() % 3;
                            let most = next().is_multiple_of(2);
                            let keep = move |v: u64| {
                                if most { v % 10 == cut } else { v % 3 != cut }
                            };
                            if next().is_multiple_of(2) {
                                map.retain(|_, v| keep(*v));
                            } else {
                                // In chunks: every key visited once, in order.
                                let limit = 1 + (next() % 100) as usize;
                                let mut seen = Vec::new();
                                let mut from: Option<Vec<u8>> = None;
                                loop {
                                    from = map.retain_from(from.as_deref(), limit, |k, v| {
                                        seen.push(k.to_vec());
                                        keep(*v)
                                    });
                                    map.check();
                                    // Packed up to where it goes on from: the leaves
                                    // are packed as the retain goes, not at its end.
                                    map.check_packed(from.as_deref());
                                    if from.is_none() {
                                        break;
                                    }
                                }
                                let keys: Vec<Vec<u8>> = model.keys().cloned().collect();
                                assert_eq!(seen, keys, "retain_from {op} visits");
                            }
                            model.retain(|_, v| keep(*v));
                        }
                    }
                }
                assert_eq!(map.len(), model.len(), "len {op}");
            }
            map.check();
            let all: Vec<u64> = map.values().copied().collect();
            assert_eq!(all, model.values().copied().collect::<Vec<_>>());
        }
    }

    /// The map of the panicking retain tests: the values 0..n, each under its key `k{v:08}`.
    fn panic_test_map() -> (u64, LeafMap<u64>) {
        let n = 10 * LEAF as u64 + 3;
        let mut map: LeafMap<u64> = LeafMap::default();
        for i in 0..n {
            map.upsert(format!("k{i:08}").as_bytes(), || i, |_| ());
        }
        (n, map)
    }

    /// Checks that a map from [`panic_test_map`], filtered for even values by a predicate
    /// that panicked at 150, is well formed and holds the even values below 150 and every
    /// value from 150 on; returns how many it holds.
    fn check_after_panic(map: &LeafMap<u64>, n: u64) -> usize {
        map.check();
        let want: Vec<u64> = (0..n).filter(|v| *v >= 150 || v % 2 == 0).collect();
        assert_eq!(map.values().copied().collect::<Vec<_>>(), want);
        assert_eq!(map.len(), want.len());
        for v in [0, 1, 148, 149, 150, 151, n - 1] {
            let k = format!("k{v:08}");
            assert_eq!(
                map.get(k.as_bytes()),
                want.contains(&v).then_some(&v),
                "{k}"
            );
        }
        want.len()
    }

    /// A chunked retain whose predicate panics part way leaves a well-formed map too: the
    /// leaf being filtered goes back into the map with every entry not yet refused.
    #[test]
    fn a_panicking_retain_from_leaves_a_well_formed_map() {
        let (n, mut map) = panic_test_map();
        let from = map.retain_from(None, 100, |_, v| *v % 2 == 0);
        assert_eq!(from.as_deref(), Some(&b"k00000100"[..]));
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            map.retain_from(from.as_deref(), 1000, |_, v| {
                assert!(*v < 150, "the predicate fails at {v}");
                *v % 2 == 0
            })
        }));
        assert!(result.is_err());
        check_after_panic(&map, n);
    }

    /// A chunked retain that removes most entries packs the leaves it thinned out as it
    /// goes: after each call the leaves before the key it goes on from are packed (no two
    /// neighbours fit in one) and the leaves after it are as they were, so no call does more
    /// than its share of the packing, and none is left for the end.
    #[test]
    fn a_chunked_retain_packs_the_leaves_it_thins_out_as_it_goes() {
        let n = 300 * LEAF as u64;
        let mut map: LeafMap<u64> = LeafMap::default();
        for i in 0..n {
            map.upsert(format!("k{i:08}").as_bytes(), || i, |_| ());
        }
        assert_eq!(map.leaf_count(), 300);
        let mut from: Option<Vec<u8>> = None;
        let mut calls = 0;
        loop {
            from = map.retain_from(from.as_deref(), 100, |_, v| *v % 10 == 0);
            calls += 1;
            map.check();
            map.check_packed(from.as_deref());
            let Some(at) = from.as_deref() else { break };
            // The leaves wholly above the key to go on from, not yet reached: still the full
            // leaves the keys were added in (those whose first key is above the last key
            // visited).
            let untouched: Vec<(Vec<u8>, usize)> = map
                .leaf_sizes()
                .into_iter()
                .filter(|(first, _)| first.as_slice() > at)
                .collect();
            let visited = calls * 100;
            assert_eq!(
                untouched.len(),
                300 - visited / LEAF - 1,
                "call {calls}: leaves above {}",
                String::from_utf8_lossy(at)
            );
            assert!(
                untouched.iter().all(|(_, len)| *len == LEAF),
                "call {calls}"
            );
        }
        assert_eq!(calls, n.div_ceil(100) as usize);
        let want: Vec<u64> = (0..n).filter(|v| v % 10 == 0).collect();
        assert_eq!(map.values().copied().collect::<Vec<_>>(), want);
        assert!(
            map.leaf_count() <= 2 * want.len().div_ceil(LEAF),
            "{} leaves for {} entries",
            map.leaf_count(),
            want.len()
        );
    }

    /// Keys added in ascending order fill their leaves; keys added in descending order too;
    /// random ones leave leaves at least half full.
    #[test]
    fn keys_added_in_order_fill_their_leaves() {
        let n = 100 * LEAF as u64 + 5;
        let mut up: LeafMap<u64> = LeafMap::default();
        let mut down: LeafMap<u64> = LeafMap::default();
        for i in 0..n {
            up.upsert(format!("k{i:08}").as_bytes(), || i, |_| ());
            down.upsert(format!("k{:08}", n - i).as_bytes(), || i, |_| ());
        }
        up.check();
        down.check();
        let full = (n as usize).div_ceil(LEAF);
        assert_eq!(up.leaf_count(), full, "ascending");
        assert_eq!(down.leaf_count(), full, "descending");
        let mut random: LeafMap<u64> = LeafMap::default();
        let mut next = crate::xorshift(0x2545_f491_4f6c_dd1d);
        for i in 0..n {
            random.upsert(format!("k{:016}", next()).as_bytes(), || i, |_| ());
        }
        random.check();
        assert!(
            random.leaf_count() <= 2 * full,
            "{} leaves",
            random.leaf_count()
        );
        // A retain packs them again.
        random.retain(|_, _| true);
        random.check();
        assert_eq!(random.leaf_count(), full);
    }

    /// A retain whose predicate panics part way leaves a well-formed map: the entries it
    /// refused before the panic are gone, every other one is still there, in order.
    #[test]
    fn a_panicking_retain_leaves_a_well_formed_map() {
        let (n, mut map) = panic_test_map();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            map.retain(|_, v| {
                assert!(*v < 150, "the predicate fails at {v}");
                *v % 2 == 0
            })
        }));
        assert!(result.is_err());
        let want = check_after_panic(&map, n);
        assert_eq!(map.leaf_count(), want.div_ceil(LEAF));
    }
}
