//! Lease id → slot index.
//!
//! An open-addressing hash table (linear probing, backward-shift deletion) that stores only
//! the 4-byte slot number of each lease; the id itself is read from the slot when probing.
//! At most 80 % full, it costs 5 to 10 bytes per lease, where a `HashMap<i64, u32>` costs 17
//! to 34. Ids may be chosen by clients, so the hash is keyed (SipHash with a random key).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

use crate::LeaseId;

const EMPTY: u32 = u32::MAX;
const MIN_BUCKETS: usize = 16;

/// Maps lease ids to slot numbers; ids are looked up through a caller-supplied `id_of`.
#[derive(Debug)]
pub(crate) struct IdIndex {
    buckets: Vec<u32>,
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
        self.buckets.capacity() * std::mem::size_of::<u32>()
    }

    fn mask(&self) -> usize {
        self.buckets.len() - 1
    }

    fn home(&self, id: LeaseId) -> usize {
        (self.hasher.hash_one(id) as usize) & self.mask()
    }

    /// The slot holding `id`.
    pub fn get(&self, id: LeaseId, id_of: impl Fn(u32) -> LeaseId) -> Option<u32> {
        let mask = self.mask();
        let mut i = self.home(id);
        loop {
            let slot = self.buckets[i];
            if slot == EMPTY {
                return None;
            }
            if id_of(slot) == id {
                return Some(slot);
            }
            i = (i + 1) & mask;
        }
    }

    /// Records `id → slot`; the caller guarantees `id` is absent.
    pub fn insert(&mut self, id: LeaseId, slot: u32, id_of: impl Fn(u32) -> LeaseId) {
        if (self.len + 1) * 5 > self.buckets.len() * 4 {
            self.grow(&id_of);
        }
        let mask = self.mask();
        let mut i = self.home(id);
        while self.buckets[i] != EMPTY {
            i = (i + 1) & mask;
        }
        self.buckets[i] = slot;
        self.len += 1;
    }

    /// Forgets `id`; returns its slot.
    pub fn remove(&mut self, id: LeaseId, id_of: impl Fn(u32) -> LeaseId) -> Option<u32> {
        let mask = self.mask();
        let mut hole = self.home(id);
        loop {
            let slot = self.buckets[hole];
            if slot == EMPTY {
                return None;
            }
            if id_of(slot) == id {
                break;
            }
            hole = (hole + 1) & mask;
        }
        let removed = self.buckets[hole];
        // Backward shift: move later members of the probe run into the hole when their home
        // does not lie (cyclically) in (hole, j], so every probe run stays unbroken.
        let mut j = hole;
        loop {
            j = (j + 1) & mask;
            let slot = self.buckets[j];
            if slot == EMPTY {
                break;
            }
            let home = self.home(id_of(slot));
            let stays = if hole <= j {
                hole < home && home <= j
            } else {
                hole < home || home <= j
            };
            if !stays {
                self.buckets[hole] = slot;
                hole = j;
            }
        }
        self.buckets[hole] = EMPTY;
        self.len -= 1;
        Some(removed)
    }

    fn grow(&mut self, id_of: &impl Fn(u32) -> LeaseId) {
        let doubled = vec![EMPTY; self.buckets.len() * 2];
        let old = std::mem::replace(&mut self.buckets, doubled);
        let mask = self.mask();
        for slot in old.into_iter().filter(|&s| s != EMPTY) {
            let mut i = self.home(id_of(slot));
            while self.buckets[i] != EMPTY {
                i = (i + 1) & mask;
            }
            self.buckets[i] = slot;
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
                let ids_ref = &ids;
                index.insert(id, slot, |s| ids_ref[s as usize]);
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
