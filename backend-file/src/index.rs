//! The per-bucket ordered index: a three-level, copy-on-write B+tree.
//!
//! Keys live in sorted leaves of at most [`LEAF_MAX`] entries; a branch holds the first key
//! of each of up to [`BRANCH_MAX`] leaves, and the top the first key of every branch, each in
//! contiguous arrays, so a lookup is three binary searches (the top has 62 entries for a
//! million keys).
//!
//! Cloning a map is O(1) (three `Arc`s). A published version is never changed: the writer's
//! copy shares everything with it, and its first change in a commit copies the top level,
//! and each branch and leaf it touches, once per commit; later changes in the same commit find
//! them unshared and change them in place (`Arc::make_mut`). So a commit of 1 000 appended
//! revisions copies about 10 leaves, one or two branches and a top of one entry per 16 000
//! keys, not an array over every leaf of the bucket.
//!
//! Appending past the last key (keel's revision keys) fills the last leaf and the last branch
//! completely and starts new ones, so such data ends up in full nodes; other splits are
//! halves. A leaf or branch that becomes empty is removed.

use std::cmp::Ordering;
use std::sync::Arc;

use crate::key::Key;
use crate::version::Loc;

/// Most entries in a leaf.
const LEAF_MAX: usize = 128;
/// Most leaves in a branch (few in unit tests, so that they split and merge branches).
const BRANCH_MAX: usize = if cfg!(test) { 4 } else { 128 };

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

/// A run of at most [`BRANCH_MAX`] consecutive leaves with their first keys.
#[derive(Clone, Default)]
struct Branch {
    pre: Vec<u64>,
    firsts: Vec<Key>,
    leaves: Vec<Arc<Leaf>>,
}

impl Branch {
    /// The leaf that holds `key` if anything in this branch does (the first leaf when `key`
    /// is below all of them).
    fn leaf_for(&self, key: &[u8]) -> usize {
        bound(&self.pre, &self.firsts, key, false).saturating_sub(1)
    }

    fn insert_leaf(&mut self, at: usize, leaf: Leaf) {
        self.pre.insert(at, leaf.pre[0]);
        self.firsts.insert(at, leaf.keys[0].clone());
        self.leaves.insert(at, Arc::new(leaf));
    }

    fn remove_leaf(&mut self, at: usize) -> Arc<Leaf> {
        self.pre.remove(at);
        self.firsts.remove(at);
        self.leaves.remove(at)
    }

    /// Records the first key of leaf `l` after it changed.
    fn refresh_first(&mut self, l: usize) {
        let leaf = &self.leaves[l];
        self.pre[l] = leaf.pre[0];
        self.firsts[l] = leaf.keys[0].clone();
    }

    fn split_off(&mut self, at: usize) -> Branch {
        Branch {
            pre: self.pre.split_off(at),
            firsts: self.firsts.split_off(at),
            leaves: self.leaves.split_off(at),
        }
    }
}

/// Position of an entry: (branch, leaf in the branch, entry in the leaf); the end is
/// `(branches, 0, 0)`.
type Pos = (usize, usize, usize);

/// One bucket's ordered map from key to value location.
///
/// Three levels: the top holds the first key of every branch, a branch the first key of each
/// of its leaves. A commit copies the top (one entry per [`BRANCH_MAX`] leaves), and the
/// branches and leaves it touches, so the copying per commit stays small however many keys
/// the bucket holds.
#[derive(Clone, Default)]
pub(crate) struct BucketMap {
    /// `firsts[b]` is the first key of `branches[b]`, `pre[b]` its prefix.
    pre: Arc<Vec<u64>>,
    firsts: Arc<Vec<Key>>,
    branches: Arc<Vec<Arc<Branch>>>,
    len: usize,
}

/// After branch `b` changed: removes it if it is empty, else records its first key.
fn refresh_branch(
    pre: &mut Arc<Vec<u64>>,
    firsts: &mut Arc<Vec<Key>>,
    branches: &mut Vec<Arc<Branch>>,
    b: usize,
) {
    if branches[b].leaves.is_empty() {
        branches.remove(b);
        Arc::make_mut(pre).remove(b);
        Arc::make_mut(firsts).remove(b);
    } else if pre[b] != branches[b].pre[0] || firsts[b] != branches[b].firsts[0] {
        Arc::make_mut(pre)[b] = branches[b].pre[0];
        Arc::make_mut(firsts)[b] = branches[b].firsts[0].clone();
    }
}

impl BucketMap {
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The leaf that holds `key` if anything does: the last whose first key is <= `key`.
    fn leaf_for(&self, key: &[u8]) -> Option<(usize, usize)> {
        let b = bound(&self.pre, &self.firsts, key, false).checked_sub(1)?;
        Some((b, self.branches[b].leaf_for(key)))
    }

    pub(crate) fn get(&self, key: &[u8]) -> Option<&Loc> {
        let (b, l) = self.leaf_for(key)?;
        let leaf = &self.branches[b].leaves[l];
        leaf.search(key).ok().map(|i| &leaf.locs[i])
    }

    /// The position after the last entry of leaf `(b, l)`.
    fn after_leaf(&self, b: usize, l: usize) -> Pos {
        if l + 1 < self.branches[b].leaves.len() {
            (b, l + 1, 0)
        } else {
            (b + 1, 0, 0)
        }
    }

    /// Position of the first entry >= `key`, normalised so that it names an entry, or is the
    /// end.
    fn lower_bound(&self, key: &[u8]) -> Pos {
        let (b, l) = self.leaf_for(key).unwrap_or((0, 0));
        match self.branches.get(b) {
            None => (self.branches.len(), 0, 0),
            Some(br) => {
                let leaf = &br.leaves[l];
                let i = leaf.lower_bound(key);
                if i == leaf.keys.len() {
                    self.after_leaf(b, l)
                } else {
                    (b, l, i)
                }
            }
        }
    }

    /// The largest key, if any.
    fn last_key(&self) -> Option<&[u8]> {
        let leaf = self.branches.last()?.leaves.last()?;
        leaf.keys.last().map(Key::as_bytes)
    }

    /// Sets `key` to `loc`; returns the previous location.
    pub(crate) fn insert(&mut self, key: &[u8], loc: Loc) -> Option<Loc> {
        if self.branches.is_empty() {
            let leaf = Leaf {
                pre: vec![prefix(key)],
                keys: vec![Key::new(key)],
                locs: vec![loc],
            };
            let mut branch = Branch::default();
            branch.insert_leaf(0, leaf);
            Arc::make_mut(&mut self.pre).push(prefix(key));
            Arc::make_mut(&mut self.firsts).push(Key::new(key));
            Arc::make_mut(&mut self.branches).push(Arc::new(branch));
            self.len = 1;
            return None;
        }
        // A key past the last one (a restore's, keel's revision keys) goes at the end of the
        // last leaf without a search.
        let append = self.last_key().is_some_and(|last| last < key);
        let (b, l) = if append {
            let b = self.branches.len() - 1;
            (b, self.branches[b].leaves.len() - 1)
        } else {
            self.leaf_for(key).unwrap_or((0, 0))
        };
        let last_branch = b + 1 == self.branches.len();
        let branches = Arc::make_mut(&mut self.branches);
        let br = Arc::make_mut(&mut branches[b]);
        let last_leaf = last_branch && l + 1 == br.leaves.len();
        let leaf = Arc::make_mut(&mut br.leaves[l]);
        let at = if append {
            leaf.keys.len()
        } else {
            match leaf.search(key) {
                Ok(i) => return Some(std::mem::replace(&mut leaf.locs[i], loc)),
                Err(i) => i,
            }
        };
        leaf.insert(at, key, loc);
        self.len += 1;
        let overfull = leaf.keys.len() > LEAF_MAX;
        if overfull {
            // Appending at the very end keeps the old leaf full; otherwise split in halves.
            let cut = if last_leaf && at + 1 == leaf.keys.len() {
                leaf.keys.len() - 1
            } else {
                leaf.keys.len() / 2
            };
            let right = leaf.split_off(cut);
            br.insert_leaf(l + 1, right);
        }
        if at == 0 {
            br.refresh_first(l);
        }
        if br.leaves.len() > BRANCH_MAX {
            let cut = if last_branch && l + 2 == br.leaves.len() {
                br.leaves.len() - 1
            } else {
                br.leaves.len() / 2
            };
            let right = br.split_off(cut);
            Arc::make_mut(&mut self.pre).insert(b + 1, right.pre[0]);
            Arc::make_mut(&mut self.firsts).insert(b + 1, right.firsts[0].clone());
            branches.insert(b + 1, Arc::new(right));
        }
        if at == 0 && l == 0 {
            refresh_branch(&mut self.pre, &mut self.firsts, branches, b);
        }
        None
    }

    /// Sets each key of `entries` to its location, in order, calling `replaced` with the
    /// previous location of a key that was present. A run of keys each above the one before
    /// and above the map's last key (a restore's keys, which arrive sorted per bucket) is
    /// appended to the last leaf, with one copy-on-write check per leaf rather than per key;
    /// any other key is [`insert`](Self::insert)ed. The map ends up as the same inserts one by
    /// one would leave it.
    pub(crate) fn extend_sorted<'k>(
        &mut self,
        entries: impl IntoIterator<Item = (&'k [u8], Loc)>,
        mut replaced: impl FnMut(&[u8], Loc),
    ) {
        let mut entries = entries.into_iter().peekable();
        while let Some((key, loc)) = entries.next() {
            if self.last_key().is_some_and(|last| last < key) {
                self.append_run(key, loc, &mut entries);
            } else if let Some(old) = self.insert(key, loc) {
                replaced(key, old);
            }
        }
    }

    /// Appends `key` (above the map's last key, which the map has) and then each next entry
    /// of `rest` while its key is above the one before, filling the last leaf and branch and
    /// starting new ones as appends one by one do.
    fn append_run<'k, I: Iterator<Item = (&'k [u8], Loc)>>(
        &mut self,
        mut key: &'k [u8],
        mut loc: Loc,
        rest: &mut std::iter::Peekable<I>,
    ) {
        let branches = Arc::make_mut(&mut self.branches);
        let Some(mut br) = branches.last_mut().map(Arc::make_mut) else {
            return;
        };
        let Some(mut leaf) = br.leaves.last_mut().map(Arc::make_mut) else {
            return;
        };
        let mut pre = prefix(key);
        loop {
            if leaf.keys.len() >= LEAF_MAX {
                let b = branches.len() - 1;
                // The last leaf is full: start a new one, in a new branch if the last is full.
                if branches[b].leaves.len() >= BRANCH_MAX {
                    Arc::make_mut(&mut self.pre).push(pre);
                    Arc::make_mut(&mut self.firsts).push(Key::new(key));
                    branches.push(Arc::new(Branch::default()));
                }
                let Some(last) = branches.last_mut() else {
                    return;
                };
                br = Arc::make_mut(last);
                br.pre.push(pre);
                br.firsts.push(Key::new(key));
                br.leaves.push(Arc::new(Leaf {
                    pre: Vec::with_capacity(LEAF_MAX),
                    keys: Vec::with_capacity(LEAF_MAX),
                    locs: Vec::with_capacity(LEAF_MAX),
                }));
                let Some(last) = br.leaves.last_mut() else {
                    return;
                };
                leaf = Arc::make_mut(last);
            }
            leaf.pre.push(pre);
            leaf.keys.push(Key::new(key));
            leaf.locs.push(loc);
            self.len += 1;
            // Above the key before: decided by the prefixes unless they are equal.
            let last = pre;
            match rest.next_if(|(next, _)| {
                pre = prefix(next);
                pre > last || (pre == last && *next > key)
            }) {
                Some((k, l)) => (key, loc) = (k, l),
                None => return,
            }
        }
    }

    /// Removes `key`; returns its location.
    pub(crate) fn remove(&mut self, key: &[u8]) -> Option<Loc> {
        let (b, l) = self.leaf_for(key)?;
        let at = self.branches[b].leaves[l].search(key).ok()?;
        let branches = Arc::make_mut(&mut self.branches);
        let br = Arc::make_mut(&mut branches[b]);
        let leaf = Arc::make_mut(&mut br.leaves[l]);
        let loc = leaf.remove(at);
        self.len -= 1;
        if leaf.keys.is_empty() {
            br.remove_leaf(l);
        } else if at == 0 {
            br.refresh_first(l);
        }
        refresh_branch(&mut self.pre, &mut self.firsts, branches, b);
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
        let (mut b, mut l, mut at) = self.lower_bound(start);
        while b < self.branches.len() {
            let leaf = &self.branches[b].leaves[l];
            let stop = match end {
                Some(e) => leaf.lower_bound(e),
                None => leaf.keys.len(),
            };
            if stop <= at {
                break;
            }
            let len = leaf.keys.len();
            let branches = Arc::make_mut(&mut self.branches);
            let br = Arc::make_mut(&mut branches[b]);
            if at == 0 && stop == len {
                let leaf = br.remove_leaf(l);
                for (k, loc) in leaf.keys.iter().zip(&leaf.locs) {
                    removed(k.as_bytes(), *loc);
                }
                self.len -= len;
                let left = br.leaves.len();
                refresh_branch(&mut self.pre, &mut self.firsts, branches, b);
                // The next leaf now sits at `(b, l)`, or starts the next branch.
                if left == 0 {
                    l = 0;
                } else if l == left {
                    (b, l) = (b + 1, 0);
                }
            } else {
                let leaf = Arc::make_mut(&mut br.leaves[l]);
                leaf.pre.drain(at..stop);
                for (k, loc) in leaf.keys.drain(at..stop).zip(leaf.locs.drain(at..stop)) {
                    removed(k.as_bytes(), loc);
                }
                self.len -= stop - at;
                if at == 0 {
                    br.refresh_first(l);
                    refresh_branch(&mut self.pre, &mut self.firsts, branches, b);
                }
                if stop < len {
                    break;
                }
                (b, l, _) = self.after_leaf(b, l);
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
            None => (self.branches.len(), 0, 0),
        };
        Iter {
            branches: &self.branches,
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
    branches: &'a [Arc<Branch>],
    at: Pos,
    to: Pos,
}

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a [u8], Loc);

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.to {
            return None;
        }
        let (b, l, i) = self.at;
        let br = self.branches.get(b)?;
        let leaf = br.leaves.get(l)?;
        let item = (leaf.keys[i].as_bytes(), leaf.locs[i]);
        self.at = if i + 1 < leaf.keys.len() {
            (b, l, i + 1)
        } else if l + 1 < br.leaves.len() {
            (b, l + 1, 0)
        } else {
            (b + 1, 0, 0)
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

    /// Asserts the map's structural invariants: node sizes, and first keys and prefixes
    /// matching the nodes they name.
    fn check_shape(m: &BucketMap) {
        assert_eq!(m.pre.len(), m.branches.len());
        assert_eq!(m.firsts.len(), m.branches.len());
        for (bi, br) in m.branches.iter().enumerate() {
            assert!(!br.leaves.is_empty() && br.leaves.len() <= BRANCH_MAX);
            assert_eq!(m.firsts[bi], br.firsts[0]);
            assert_eq!(m.pre[bi], br.pre[0]);
            assert_eq!(br.firsts.len(), br.leaves.len());
            assert_eq!(br.pre.len(), br.leaves.len());
            for (i, leaf) in br.leaves.iter().enumerate() {
                assert!(!leaf.keys.is_empty() && leaf.keys.len() <= LEAF_MAX);
                assert_eq!(br.firsts[i], leaf.keys[0]);
                assert_eq!(br.pre[i], leaf.pre[0]);
                assert_eq!(leaf.pre.len(), leaf.keys.len());
                for (p, k) in leaf.pre.iter().zip(&leaf.keys) {
                    assert_eq!(*p, prefix(k.as_bytes()));
                }
            }
        }
    }

    /// Entries per leaf, per branch: the map's shape.
    fn shape(m: &BucketMap) -> Vec<Vec<usize>> {
        m.branches
            .iter()
            .map(|b| b.leaves.iter().map(|l| l.keys.len()).collect())
            .collect()
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
                check_shape(m);
            }
        }
    }

    #[test]
    fn appends_fill_leaves() {
        let mut map = BucketMap::default();
        for i in 0..100_000u32 {
            map.insert(&i.to_be_bytes(), loc(i));
        }
        let leaves: usize = map.branches.iter().map(|b| b.leaves.len()).sum();
        assert_eq!(leaves, 100_000usize.div_ceil(LEAF_MAX));
        assert_eq!(map.branches.len(), leaves.div_ceil(BRANCH_MAX));
        assert!(
            map.iter()
                .map(|(k, l)| (k.to_vec(), l))
                .eq((0..100_000u32).map(|i| (i.to_be_bytes().to_vec(), loc(i)))),
            "appended entries read back in order"
        );
        // Appending the last key again replaces its location; a key below it is inserted.
        assert_eq!(
            map.insert(&99_999u32.to_be_bytes(), loc(1)),
            Some(loc(99_999))
        );
        assert_eq!(map.insert(&[0, 0, 0, 0, 0], loc(2)), None);
        assert_eq!(map.get(&[0, 0, 0, 0, 0]), Some(&loc(2)));
        assert_eq!(map.len, 100_001);
    }

    #[test]
    fn sorted_batches_match_inserts_one_by_one() {
        for seed in 0..40u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            // Keys of 8 to 40 bytes (some sharing their 8-byte prefix, some stored on the heap).
            let key = |n: u32, long: bool| {
                let mut k = format!("k{n:07}").into_bytes();
                if long {
                    k.extend_from_slice(&[b'x'; 32]);
                }
                k
            };
            let mut batched = BucketMap::default();
            let mut single = BucketMap::default();
            let mut model: BTreeMap<Vec<u8>, Loc> = BTreeMap::new();
            // A start of random inserts leaves the last leaf and branch partly full (or the
            // map empty).
            for step in 0..rng.random_range(0..700u32) {
                let k = key(rng.random_range(0..4000), rng.random_bool(0.1));
                batched.insert(&k, loc(step));
                single.insert(&k, loc(step));
                model.insert(k, loc(step));
            }
            let mut step = 1_000_000u32;
            for _ in 0..12 {
                let kept = (batched.clone(), model.clone());
                // A batch: mostly runs of keys above everything so far, with keys that are
                // not above the one before (below the last key, present already, repeated)
                // mixed in.
                let mut next = model.keys().next_back().map_or(0, |k| {
                    std::str::from_utf8(&k[1..8]).unwrap().parse().unwrap()
                });
                let mut entries: Vec<(Vec<u8>, Loc)> = Vec::new();
                for _ in 0..rng.random_range(1..1500) {
                    step += 1;
                    let k = match rng.random_range(0..40) {
                        0 => key(rng.random_range(0..next + 1), rng.random_bool(0.5)),
                        1 => entries
                            .last()
                            .map_or_else(|| key(next, false), |e| e.0.clone()),
                        _ => {
                            next += rng.random_range(1..3);
                            key(next, rng.random_bool(0.1))
                        }
                    };
                    entries.push((k, loc(step)));
                }
                let mut replaced = Vec::new();
                batched.extend_sorted(entries.iter().map(|(k, l)| (&k[..], *l)), |k, old| {
                    replaced.push((k.to_vec(), old))
                });
                let mut want = Vec::new();
                for (k, l) in &entries {
                    let old = single.insert(k, *l);
                    assert_eq!(old, model.insert(k.clone(), *l), "seed {seed}");
                    if let Some(old) = old {
                        want.push((k.clone(), old));
                    }
                }
                assert_eq!(replaced, want, "seed {seed}: replaced locations");
                assert_eq!(batched.len, model.len(), "seed {seed}");
                check_shape(&batched);
                assert_eq!(
                    shape(&batched),
                    shape(&single),
                    "seed {seed}: a batch leaves the shape inserts one by one leave"
                );
                assert!(
                    batched
                        .iter()
                        .map(|(k, l)| (k.to_vec(), l))
                        .eq(model.iter().map(|(k, l)| (k.clone(), *l))),
                    "seed {seed}: batched entries read back"
                );
                for (k, _) in entries.iter().step_by(7) {
                    assert_eq!(batched.get(k), model.get(k), "seed {seed}");
                }
                let (old_map, old_model) = kept;
                assert!(
                    old_map
                        .iter()
                        .map(|(k, l)| (k.to_vec(), l))
                        .eq(old_model.iter().map(|(k, l)| (k.clone(), *l))),
                    "seed {seed}: a version kept from before the batch is unchanged"
                );
            }
            assert!(
                batched.branches.len() > 1,
                "seed {seed}: the batches split branches"
            );
        }
    }

    #[test]
    fn a_sorted_batch_fills_the_last_leaf_then_starts_new_ones() {
        let mut map = BucketMap::default();
        // Two half leaves: the last one has room for LEAF_MAX / 2 - 1 more.
        for i in (0..=LEAF_MAX as u32).rev() {
            map.insert(&i.to_be_bytes(), loc(i));
        }
        assert_eq!(shape(&map), vec![vec![LEAF_MAX / 2, LEAF_MAX / 2 + 1]]);
        let keys: Vec<[u8; 4]> = (LEAF_MAX as u32 + 1..LEAF_MAX as u32 * 7)
            .map(u32::to_be_bytes)
            .collect();
        let mut replaced = 0;
        map.extend_sorted(keys.iter().map(|k| (&k[..], loc(7))), |_, _| replaced += 1);
        assert_eq!(replaced, 0);
        check_shape(&map);
        let full = LEAF_MAX;
        assert_eq!(
            shape(&map),
            vec![
                vec![LEAF_MAX / 2, full, full, full],
                vec![full, full, full, LEAF_MAX / 2]
            ]
        );
        assert_eq!(map.len, LEAF_MAX * 7);
        assert_eq!(
            map.get(&(LEAF_MAX as u32 * 7 - 1).to_be_bytes()),
            Some(&loc(7))
        );
        assert_eq!(map.get(&5u32.to_be_bytes()), Some(&loc(5)));
    }
}
