//! The checkpoint schedule: a FIFO of `(slot, incarnation)` entries, 8 bytes each, under
//! run-length coded deadlines.
//!
//! A checkpoint is always scheduled at `now + checkpoint interval`, so the schedule is a FIFO
//! already sorted by deadline. Deadlines are rounded up to a whole [`ROUND_NANOS`] (one
//! second, against an interval of minutes) and consecutive entries with the same deadline
//! share one run record `(deadline, count)`, so the deadlines cost at most one 16-byte record
//! per second of the interval however many leases there are, instead of 8 bytes per lease.

use std::collections::VecDeque;

/// Deadlines are rounded up to a multiple of this: one second.
pub(crate) const ROUND_NANOS: u64 = 1_000_000_000;

/// One scheduled checkpoint of a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Scheduled {
    /// Index of the lease slot.
    pub slot: u32,
    /// The slot's incarnation when scheduled; stale when it differs from the slot's.
    pub tag: u32,
}

/// The checkpoint schedule; see the module docs.
#[derive(Debug, Default)]
pub(crate) struct CheckpointQueue {
    entries: VecDeque<Scheduled>,
    /// `(deadline, number of entries)`, in the order of `entries`; no count is 0.
    runs: VecDeque<(u64, u32)>,
}

impl CheckpointQueue {
    /// Number of entries, stale ones included.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Schedules `entry` at `deadline` rounded up to a whole second (or at the last deadline
    /// scheduled, if later: the queue stays a FIFO).
    pub fn push(&mut self, deadline: u64, entry: Scheduled) {
        let mut deadline = deadline.div_ceil(ROUND_NANOS).saturating_mul(ROUND_NANOS);
        match self.runs.back_mut() {
            Some((last, count)) if *last >= deadline && *count < u32::MAX => *count += 1,
            last => {
                if let Some((d, _)) = last {
                    deadline = deadline.max(*d);
                }
                self.runs.push_back((deadline, 1));
            }
        }
        self.entries.push_back(entry);
    }

    /// The deadline of the first entry.
    pub fn front_deadline(&self) -> Option<u64> {
        self.runs.front().map(|&(d, _)| d)
    }

    /// Removes and returns the first entry with its deadline.
    pub fn pop_front(&mut self) -> Option<(u64, Scheduled)> {
        let entry = self.entries.pop_front()?;
        let (deadline, count) = self.runs.front_mut()?;
        let deadline = *deadline;
        *count -= 1;
        if *count == 0 {
            self.runs.pop_front();
        }
        Some((deadline, entry))
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.runs.clear();
    }

    /// Keeps only the entries `keep` accepts, in order: O(n).
    pub fn retain(&mut self, mut keep: impl FnMut(&Scheduled) -> bool) {
        let mut runs = VecDeque::with_capacity(self.runs.len());
        let mut entries = VecDeque::with_capacity(self.entries.len());
        let mut it = self.entries.iter();
        for &(deadline, count) in &self.runs {
            let kept = it
                .by_ref()
                .take(count as usize)
                .filter(|e| keep(e))
                .fold(0u32, |n, e| {
                    entries.push_back(*e);
                    n + 1
                });
            if kept > 0 {
                runs.push_back((deadline, kept));
            }
        }
        self.entries = entries;
        self.runs = runs;
    }

    /// Bytes allocated.
    pub fn allocated_bytes(&self) -> usize {
        self.entries.capacity() * std::mem::size_of::<Scheduled>()
            + self.runs.capacity() * std::mem::size_of::<(u64, u32)>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    #[test]
    fn fifo_with_rounded_deadlines_matches_a_model() {
        let mut rng = StdRng::seed_from_u64(11);
        let mut q = CheckpointQueue::default();
        let mut model: VecDeque<(u64, Scheduled)> = VecDeque::new();
        let mut now = 0u64;
        for round in 0..5_000u32 {
            match rng.random_range(0..4) {
                0 | 1 => {
                    now += rng.random_range(0..ROUND_NANOS / 2);
                    let e = Scheduled {
                        slot: round,
                        tag: rng.random_range(0..3),
                    };
                    let rounded = now.div_ceil(ROUND_NANOS) * ROUND_NANOS;
                    let d = model.back().map_or(rounded, |&(d, _)| d.max(rounded));
                    q.push(now, e);
                    model.push_back((d, e));
                }
                2 => {
                    assert_eq!(q.front_deadline(), model.front().map(|&(d, _)| d));
                    assert_eq!(q.pop_front(), model.pop_front(), "round {round}");
                }
                _ if round % 97 == 0 => {
                    q.retain(|e| e.tag != 0);
                    model.retain(|(_, e)| e.tag != 0);
                }
                _ => {}
            }
            assert_eq!(q.len(), model.len());
            assert!(q.runs.iter().all(|&(_, c)| c > 0));
            assert_eq!(
                q.runs.iter().map(|&(_, c)| c as usize).sum::<usize>(),
                q.len()
            );
        }
        while let Some(x) = model.pop_front() {
            assert_eq!(q.pop_front(), Some(x));
        }
        assert_eq!(q.pop_front(), None);
        assert_eq!(q.front_deadline(), None);
    }
}
