//! The set of keys attached to one lease.
//!
//! Most leases hold a handful of keys (a lock, a presence key), so small sets are a plain
//! vector searched linearly; past [`SMALL_LIMIT`] keys the set becomes a hash set so attach
//! and detach stay O(1) for leases with many keys. A lease without keys stores nothing.

use std::collections::HashSet;

/// Largest set kept as a vector.
const SMALL_LIMIT: usize = 16;

/// Keys attached to a lease.
#[derive(Debug, Clone)]
pub(crate) enum KeySet {
    Small(Vec<Box<[u8]>>),
    /// Boxed so that the set costs a lease no more than an empty vector (24 bytes).
    #[expect(
        clippy::box_collection,
        reason = "a HashSet inline would make every lease's slot 24 bytes larger"
    )]
    Large(Box<HashSet<Box<[u8]>>>),
}

impl KeySet {
    pub fn new() -> KeySet {
        KeySet::Small(Vec::new())
    }

    /// Adds `key`; returns false if it was already there.
    pub fn insert(&mut self, key: &[u8]) -> bool {
        match self {
            KeySet::Small(v) => {
                if v.iter().any(|k| &k[..] == key) {
                    return false;
                }
                if v.len() < SMALL_LIMIT {
                    // Grow 1, 2, 4, ...: most leases hold one key, and a plain push would
                    // reserve room for four.
                    if v.len() == v.capacity() {
                        v.reserve_exact(v.len().max(1));
                    }
                    v.push(key.into());
                } else {
                    let mut set: HashSet<Box<[u8]>> = v.drain(..).collect();
                    set.insert(key.into());
                    *self = KeySet::Large(Box::new(set));
                }
                true
            }
            KeySet::Large(s) => s.insert(key.into()),
        }
    }

    /// Removes `key`; returns false if it was not there.
    pub fn remove(&mut self, key: &[u8]) -> bool {
        match self {
            KeySet::Small(v) => match v.iter().position(|k| &k[..] == key) {
                Some(i) => {
                    v.swap_remove(i);
                    true
                }
                None => false,
            },
            KeySet::Large(s) => s.remove(key),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            KeySet::Small(v) => v.len(),
            KeySet::Large(s) => s.len(),
        }
    }

    /// The keys, in ascending order.
    pub fn sorted(&self) -> Vec<Vec<u8>> {
        let mut keys: Vec<Vec<u8>> = match self {
            KeySet::Small(v) => v.iter().map(|k| k.to_vec()).collect(),
            KeySet::Large(s) => s.iter().map(|k| k.to_vec()).collect(),
        };
        keys.sort_unstable();
        keys
    }

    /// Heap bytes held (buffers and key bytes), approximately.
    pub fn allocated_bytes(&self) -> usize {
        match self {
            KeySet::Small(v) => {
                v.capacity() * std::mem::size_of::<Box<[u8]>>()
                    + v.iter().map(|k| k.len()).sum::<usize>()
            }
            KeySet::Large(s) => {
                s.capacity() * (std::mem::size_of::<Box<[u8]>>() + 1)
                    + s.iter().map(|k| k.len()).sum::<usize>()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_key_set_is_as_small_as_a_vector() {
        assert_eq!(std::mem::size_of::<KeySet>(), 24);
    }

    #[test]
    fn grows_into_a_hash_set_and_keeps_every_key() {
        let mut set = KeySet::new();
        for i in 0..100u32 {
            assert!(set.insert(&i.to_be_bytes()));
            assert!(!set.insert(&i.to_be_bytes()));
        }
        assert!(matches!(set, KeySet::Large(_)));
        assert_eq!(set.len(), 100);
        for i in (0..100u32).step_by(2) {
            assert!(set.remove(&i.to_be_bytes()));
            assert!(!set.remove(&i.to_be_bytes()));
        }
        let expected: Vec<Vec<u8>> = (1..100u32)
            .step_by(2)
            .map(|i| i.to_be_bytes().to_vec())
            .collect();
        assert_eq!(set.sorted(), expected);
    }
}
