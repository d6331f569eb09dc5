//! Lease id → slot index.
//!
//! An open-addressing hash table (linear probing, backward-shift deletion, at most 80 %
//! full) whose 8-byte buckets hold a lease's slot number and the low 32 bits of its id's
//! hash. Probing compares hash bits and reads a slot only on a match, so a lookup touches
//! one or two cache lines; the home bucket comes from the stored bits, so growing and
//! deleting never rehash. It costs 10 to 20 bytes per lease, where a `HashMap<i64, u32>`
//! costs 17 to 34. Ids may be chosen by clients, so the hash is keyed (SipHash, random key).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

use crate::LeaseId;

const EMPTY: u64 = u64::MAX;
const MIN_BUCKETS: usize = 16;

fn pack(hash: u32, slot: u32) -> u64 {
    (u64::from(hash) << 32) | u64::from(slot)
}

fn hash_of(bucket: u64) -> u32 {
    (bucket >> 32) as u32
}

fn slot_of(bucket: u64) -> u32 {
    bucket as u32
}

/// Maps lease ids to slot numbers; ids are read through a caller-supplied `id_of`.
#[derive(Debug)]
pub(crate) struct IdIndex {
    buckets: Vec<u64>,
    len: usize,
    hasher: RandomState,
}

impl IdIndex {
    pub fn new() -> IdIndex {
        IdIndex {
            buckets: vec![EMPTY; MIN_BUCKETS],
            len: 0,
            hasher: RandomState::new(),
        }
    }

    pub fn allocated_bytes(&self) -> usize {
        self.buckets.capacity() * std::mem::size_of::<u64>()
    }

    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    fn hash(&self, id: LeaseId) -> u32 {
        self.hasher.hash_one(id) as u32
    }

    /// Position of `id`'s bucket, if present.
    fn position(&self, id: LeaseId, id_of: impl Fn(u32) -> LeaseId) -> Option<usize> {
        let mask = self.mask();
        let hash = self.hash(id);
        let mut i = hash as usize & mask;
        loop {
            let bucket = self.buckets[i];
            if bucket == EMPTY {
                return None;
            }
            if hash_of(bucket) == hash && id_of(slot_of(bucket)) == id {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    /// The slot holding `id`.
    pub fn get(&self, id: LeaseId, id_of: impl Fn(u32) -> LeaseId) -> Option<u32> {
        self.position(id, id_of).map(|i| slot_of(self.buckets[i]))
    }

    /// Records `id → slot`; the caller guarantees `id` is absent.
    pub fn insert(&mut self, id: LeaseId, slot: u32) {
        if (self.len + 1) * 5 > self.buckets.len() * 4 {
            self.grow();
        }
        let hash = self.hash(id);
        self.place(pack(hash, slot));
        self.len += 1;
    }

    fn place(&mut self, bucket: u64) {
        let mask = self.mask();
        let mut i = hash_of(bucket) as usize & mask;
        while self.buckets[i] != EMPTY {
            i = (i + 1) & mask;
        }
        self.buckets[i] = bucket;
    }

    /// Forgets `id`; returns its slot.
    pub fn remove(&mut self, id: LeaseId, id_of: impl Fn(u32) -> LeaseId) -> Option<u32> {
        let mut hole = self.position(id, id_of)?;
        let removed = slot_of(self.buckets[hole]);
        let mask = self.mask();
        // Backward shift: move later members of the probe run into the hole when their home
        // does not lie (cyclically) in (hole, j], so every probe run stays unbroken.
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let bucket = self.buckets[j];
            if bucket == EMPTY {
                break;
            }
            let home = hash_of(bucket) as usize & mask;
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.buckets[hole] = bucket;
                hole = j;
            }
        }
        self.buckets[hole] = EMPTY;
        self.len -= 1;
        Some(removed)
    }

    fn grow(&mut self) {
        let doubled = vec![EMPTY; self.buckets.len() * 2];
        let old = std::mem::replace(&mut self.buckets, doubled);
        for bucket in old.into_iter().filter(|&b| b != EMPTY) {
            self.place(bucket);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};
    use std::collections::HashMap;

    #[test]
    fn agrees_with_a_hash_map_under_random_churn() {
        let mut rng = StdRng::seed_from_u64(11);
        // Slot s holds id ids[s]; ids are drawn from a small range to force collisions.
        let mut ids: Vec<LeaseId> = Vec::new();
        let mut free: Vec<u32> = Vec::new();
        let mut model: HashMap<LeaseId, u32> = HashMap::new();
        let mut index = IdIndex::new();
        for step in 0..20_000 {
            let id = rng.random_range(1..3_000i64);
            if let Some(&slot) = model.get(&id) {
                let removed = {
                    let ids = &ids;
                    index.remove(id, |s| ids[s as usize])
                };
                assert_eq!(removed, Some(slot), "step {step}");
                model.remove(&id);
                ids[slot as usize] = 0;
                free.push(slot);
            } else {
                let slot = free.pop().unwrap_or_else(|| {
                    ids.push(0);
                    (ids.len() - 1) as u32
                });
                ids[slot as usize] = id;
                index.insert(id, slot);
                model.insert(id, slot);
            }
            if step % 97 == 0 {
                for probe in 1..3_000i64 {
                    assert_eq!(
                        index.get(probe, |s| ids[s as usize]),
                        model.get(&probe).copied(),
                        "step {step}, id {probe}"
                    );
                }
            }
        }
    }
}
