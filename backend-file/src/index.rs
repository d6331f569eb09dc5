//! The per-bucket ordered index: a two-level, copy-on-write B+tree.
//!
//! Keys live in sorted leaves of at most [`LEAF_MAX`] entries; a top level holds the first
//! key of every leaf in one contiguous array, small enough to stay in cache (8 000 keys for a
//! million entries), so a lookup is a binary search there and one in a single leaf.
//!
//! Cloning a map is O(1) (two `Arc`s). A published version is never changed: the writer's
//! copy shares everything with it, and its first change in a commit copies the top level
//! (pointers and first keys) and each leaf it touches, once per commit; later changes in the
//! same commit find them unshared and change them in place (`Arc::make_mut`).
//!
//! Appending past the last key (keel's revision keys) fills the last leaf completely and
//! starts a new one, so such data ends up in full leaves; other splits are halves. A leaf that
//! becomes empty is removed.

use std::cmp::Ordering;
use std::sync::Arc;

use crate::key::Key;
use crate::version::Loc;

/// Most entries in a leaf.
const LEAF_MAX: usize = 128;

/// The first 8 bytes of a key as a big-endian integer (zero-padded): comparing prefixes
/// orders keys correctly except between keys with equal prefixes, which then compare in full.
/// Searching the compact prefix arrays touches a quarter of the cache lines the keys would.
fn prefix(key: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    let n = key.len().min(8);
    b[..n].copy_from_slice(&key[..n]);
    u64::from_be_bytes(b)
}

/// First index whose key is greater than `key` (`or_equal`: greater or equal).
fn bound(pre: &[u64], keys: &[Key], key: &[u8], or_equal: bool) -> usize {
    let kp = prefix(key);
    let (mut lo, mut hi) = (0, pre.len());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let ord = pre[mid]
            .cmp(&kp)
            .then_with(|| keys[mid].as_bytes().cmp(key));
        let before = match ord {
            Ordering::Less => true,
            Ordering::Equal => !or_equal,
            Ordering::Greater => false,
        };
        if before {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

#[derive(Clone, Default)]
struct Leaf {
    pre: Vec<u64>,
    keys: Vec<Key>,
    locs: Vec<Loc>,
}

impl Leaf {
    fn search(&self, key: &[u8]) -> Result<usize, usize> {
        let i = bound(&self.pre, &self.keys, key, true);
        if self.keys.get(i).is_some_and(|k| k.as_bytes() == key) {
            Ok(i)
        } else {
            Err(i)
        }
    }

    /// Index of the first key >= `key`.
    fn lower_bound(&self, key: &[u8]) -> usize {
        bound(&self.pre, &self.keys, key, true)
    }

    fn insert(&mut self, at: usize, key: &[u8], loc: Loc) {
        self.pre.insert(at, prefix(key));
        self.keys.insert(at, Key::new(key));
        self.locs.insert(at, loc);
    }

    fn remove(&mut self, at: usize) -> Loc {
        self.pre.remove(at);
        self.keys.remove(at);
        self.locs.remove(at)
    }

    fn split_off(&mut self, at: usize) -> Leaf {
        Leaf {
            pre: self.pre.split_off(at),
            keys: self.keys.split_off(at),
            locs: self.locs.split_off(at),
        }
    }
}

/// One bucket's ordered map from key to value location.
#[derive(Clone, Default)]
pub(crate) struct BucketMap {
    /// `firsts[i]` is the first key of `leaves[i]`, `first_pre[i]` its prefix.
    firsts: Arc<Vec<Key>>,
    first_pre: Arc<Vec<u64>>,
    leaves: Arc<Vec<Arc<Leaf>>>,
    len: usize,
}

impl BucketMap {
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The leaf that holds `key` if anything does: the last whose first key is <= `key`.
    fn leaf_for(&self, key: &[u8]) -> Option<usize> {
        bound(&self.first_pre, &self.firsts, key, false).checked_sub(1)
    }

    pub(crate) fn get(&self, key: &[u8]) -> Option<&Loc> {
        let leaf = &self.leaves[self.leaf_for(key)?];
        leaf.search(key).ok().map(|i| &leaf.locs[i])
    }

    /// Position of the first entry >= `key`: (leaf, index), normalised so that the index is
    /// inside the leaf, or `(leaves.len(), 0)` at the end.
    fn lower_bound(&self, key: &[u8]) -> (usize, usize) {
        let li = self.leaf_for(key).unwrap_or(0);
        match self.leaves.get(li) {
            None => (self.leaves.len(), 0),
            Some(leaf) => {
                let i = leaf.lower_bound(key);
                if i == leaf.keys.len() {
                    (li + 1, 0)
                } else {
                    (li, i)
                }
            }
        }
    }

    /// Sets `key` to `loc`; returns the previous location.
    pub(crate) fn insert(&mut self, key: &[u8], loc: Loc) -> Option<Loc> {
        if self.leaves.is_empty() {
            Arc::make_mut(&mut self.firsts).push(Key::new(key));
            Arc::make_mut(&mut self.first_pre).push(prefix(key));
            Arc::make_mut(&mut self.leaves).push(Arc::new(Leaf {
                pre: vec![prefix(key)],
                keys: vec![Key::new(key)],
                locs: vec![loc],
            }));
            self.len = 1;
            return None;
        }
        let li = self.leaf_for(key).unwrap_or(0);
        let leaves = Arc::make_mut(&mut self.leaves);
        let last_leaf = li + 1 == leaves.len();
        let leaf = Arc::make_mut(&mut leaves[li]);
        let at = match leaf.search(key) {
            Ok(i) => return Some(std::mem::replace(&mut leaf.locs[i], loc)),
            Err(i) => i,
        };
        leaf.insert(at, key, loc);
        self.len += 1;
        if at == 0 {
            Arc::make_mut(&mut self.firsts)[li] = Key::new(key);
            Arc::make_mut(&mut self.first_pre)[li] = prefix(key);
        }
        if leaf.keys.len() > LEAF_MAX {
            // Appending at the very end keeps the old leaf full; otherwise split in halves.
            let cut = if last_leaf && at + 1 == leaf.keys.len() {
                leaf.keys.len() - 1
            } else {
                leaf.keys.len() / 2
            };
            let right = leaf.split_off(cut);
            let first = right.keys[0].clone();
            let first_pre = right.pre[0];
            leaves.insert(li + 1, Arc::new(right));
            Arc::make_mut(&mut self.firsts).insert(li + 1, first);
            Arc::make_mut(&mut self.first_pre).insert(li + 1, first_pre);
        }
        None
    }

    /// Removes `key`; returns its location.
    pub(crate) fn remove(&mut self, key: &[u8]) -> Option<Loc> {
        let li = self.leaf_for(key)?;
        let at = self.leaves[li].search(key).ok()?;
        let leaves = Arc::make_mut(&mut self.leaves);
        let leaf = Arc::make_mut(&mut leaves[li]);
        let loc = leaf.remove(at);
        self.len -= 1;
        if leaf.keys.is_empty() {
            leaves.remove(li);
            Arc::make_mut(&mut self.firsts).remove(li);
            Arc::make_mut(&mut self.first_pre).remove(li);
        } else if at == 0 {
            let first = leaf.keys[0].clone();
            Arc::make_mut(&mut self.firsts)[li] = first;
            Arc::make_mut(&mut self.first_pre)[li] = leaf.pre[0];
        }
        Some(loc)
    }

    /// Removes every key in `[start, end)`, calling `removed` for each.
    pub(crate) fn remove_range(
        &mut self,
        start: &[u8],
        end: Option<&[u8]>,
        mut removed: impl FnMut(&[u8], Loc),
    ) {
        if end.is_some_and(|e| e <= start) {
            return;
        }
        let (mut li, mut at) = self.lower_bound(start);
        while li < self.leaves.len() {
            let leaf = &self.leaves[li];
            let stop = match end {
                Some(e) => leaf.lower_bound(e),
                None => leaf.keys.len(),
            };
            if stop <= at {
                break;
            }
            let whole = at == 0 && stop == leaf.keys.len();
            let len = leaf.keys.len();
            let leaves = Arc::make_mut(&mut self.leaves);
            if whole {
                let leaf = leaves.remove(li);
                Arc::make_mut(&mut self.firsts).remove(li);
                Arc::make_mut(&mut self.first_pre).remove(li);
                for (k, l) in leaf.keys.iter().zip(&leaf.locs) {
                    removed(k.as_bytes(), *l);
                }
                self.len -= leaf.keys.len();
            } else {
                let leaf = Arc::make_mut(&mut leaves[li]);
                leaf.pre.drain(at..stop);
                for (k, l) in leaf.keys.drain(at..stop).zip(leaf.locs.drain(at..stop)) {
                    removed(k.as_bytes(), l);
                }
                self.len -= stop - at;
                if at == 0 {
                    let first = leaf.keys[0].clone();
                    Arc::make_mut(&mut self.firsts)[li] = first;
                    Arc::make_mut(&mut self.first_pre)[li] = leaf.pre[0];
                }
                if stop < len {
                    break;
                }
                li += 1;
            }
            at = 0;
        }
    }

    /// Entries with `start <= key < end` in key order.
    pub(crate) fn range(&self, start: &[u8], end: Option<&[u8]>) -> Iter<'_> {
        let from = self.lower_bound(start);
        let to = match end {
            Some(e) if e > start => self.lower_bound(e),
            Some(_) => from,
            None => (self.leaves.len(), 0),
        };
        Iter {
            leaves: &self.leaves,
            at: from,
            to,
        }
    }

    /// Every entry in key order.
    pub(crate) fn iter(&self) -> Iter<'_> {
        self.range(&[], None)
    }
}

/// Iterator over a [`BucketMap`] range.
pub(crate) struct Iter<'a> {
    leaves: &'a [Arc<Leaf>],
    at: (usize, usize),
    to: (usize, usize),
}

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a [u8], Loc);

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.to {
            return None;
        }
        let (li, i) = self.at;
        let leaf = self.leaves.get(li)?;
        let item = (leaf.keys[i].as_bytes(), leaf.locs[i]);
        self.at = if i + 1 == leaf.keys.len() {
            (li + 1, 0)
        } else {
            (li, i + 1)
        };
        Some(item)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;

    fn loc(n: u32) -> Loc {
        Loc {
            seg: n,
            off: n,
            len: n,
        }
    }

    #[test]
    fn matches_a_btreemap_under_random_operations() {
        for seed in 0..20u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut map = BucketMap::default();
            let mut model: BTreeMap<Vec<u8>, Loc> = BTreeMap::new();
            let mut versions = Vec::new();
            let key = |rng: &mut rand::rngs::StdRng| {
                let n: u32 = rng.random_range(0..2000);
                let mut k = format!("{n:05}").into_bytes();
                if n.is_multiple_of(7) {
                    k.extend_from_slice(&[b'x'; 30]);
                }
                if n.is_multiple_of(5) {
                    // Keys sharing their 8-byte prefix, and one that is only that prefix.
                    k = format!("sharedpf{}", n % 300).into_bytes();
                    k.truncate(8 + (n as usize % 4));
                }
                k
            };
            for step in 0..3000u32 {
                match rng.random_range(0..10) {
                    0..=5 => {
                        let k = key(&mut rng);
                        assert_eq!(map.insert(&k, loc(step)), model.insert(k, loc(step)));
                    }
                    6..=7 => {
                        let k = key(&mut rng);
                        assert_eq!(map.remove(&k), model.remove(&k));
                    }
                    8 => {
                        let (a, b) = (key(&mut rng), key(&mut rng));
                        let end = if rng.random_bool(0.2) {
                            None
                        } else {
                            Some(&b[..])
                        };
                        let mut gone = Vec::new();
                        map.remove_range(&a, end, |k, l| gone.push((k.to_vec(), l)));
                        let doomed: Vec<Vec<u8>> = model
                            .keys()
                            .filter(|k| **k >= a && end.is_none_or(|e| &k[..] < e))
                            .cloned()
                            .collect();
                        let want: Vec<(Vec<u8>, Loc)> = doomed
                            .iter()
                            .map(|k| (k.clone(), model.remove(k).unwrap()))
                            .collect();
                        assert_eq!(gone, want);
                    }
                    _ => versions.push((map.clone(), model.clone())),
                }
                assert_eq!(map.len, model.len());
                let k = key(&mut rng);
                assert_eq!(map.get(&k), model.get(&k));
            }
            let (a, b) = (b"00500".to_vec(), b"01200".to_vec());
            for (m, model) in versions.iter().chain([(map.clone(), model.clone())].iter()) {
                let got: Vec<(Vec<u8>, Loc)> = m.iter().map(|(k, l)| (k.to_vec(), l)).collect();
                let want: Vec<(Vec<u8>, Loc)> =
                    model.iter().map(|(k, l)| (k.clone(), *l)).collect();
                assert_eq!(got, want, "seed {seed}: a kept version is unchanged");
                let got: Vec<Vec<u8>> = m.range(&a, Some(&b)).map(|(k, _)| k.to_vec()).collect();
                let want: Vec<Vec<u8>> = model
                    .range(a.clone()..b.clone())
                    .map(|(k, _)| k.clone())
                    .collect();
                assert_eq!(got, want);
                assert_eq!(m.range(&b, Some(&a)).count(), 0);
                for (i, leaf) in m.leaves.iter().enumerate() {
                    assert!(!leaf.keys.is_empty() && leaf.keys.len() <= LEAF_MAX);
                    assert_eq!(m.firsts[i], leaf.keys[0]);
                    assert_eq!(m.first_pre[i], leaf.pre[0]);
                    assert_eq!(leaf.pre.len(), leaf.keys.len());
                    for (p, k) in leaf.pre.iter().zip(&leaf.keys) {
                        assert_eq!(*p, prefix(k.as_bytes()));
                    }
                }
            }
        }
    }

    #[test]
    fn appends_fill_leaves() {
        let mut map = BucketMap::default();
        for i in 0..10_000u32 {
            map.insert(&i.to_be_bytes(), loc(i));
        }
        assert_eq!(map.leaves.len(), 10_000usize.div_ceil(LEAF_MAX));
    }
}
