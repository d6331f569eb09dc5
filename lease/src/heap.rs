//! The expiry min-heap.
//!
//! A 4-ary min-heap of 16-byte timers ordered by deadline. Four children of a node are 64
//! contiguous bytes, so a sift-down touches one cache line per level and the depth is
//! log4(n) (10 levels for a million leases): popping the k earliest deadlines among n costs
//! O(k log n) with few cache misses.
//!
//! Timers are never removed from the middle. A timer names a lease slot and a tag (the slot's
//! generation when the timer was pushed); the lease table discards a popped timer whose tag no
//! longer matches (lazy deletion), which keeps renew and revoke at O(log n) and O(1).

/// One scheduled deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timer {
    /// Deadline in nanoseconds of the lessor's clock.
    pub deadline: u64,
    /// Index of the lease slot.
    pub slot: u32,
    /// Generation of the slot when pushed; stale when it differs from the slot's.
    pub tag: u32,
}

const ARITY: usize = 4;

/// A 4-ary min-heap of [`Timer`]s keyed by deadline.
#[derive(Debug, Default)]
pub(crate) struct TimerHeap {
    items: Vec<Timer>,
}

impl TimerHeap {
    /// Number of timers, stale ones included.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Bytes allocated.
    pub fn allocated_bytes(&self) -> usize {
        self.items.capacity() * std::mem::size_of::<Timer>()
    }

    /// The earliest timer.
    pub fn peek(&self) -> Option<&Timer> {
        self.items.first()
    }

    /// Adds a timer: O(log n).
    pub fn push(&mut self, timer: Timer) {
        self.items.push(timer);
        self.sift_up(self.items.len() - 1);
    }

    /// Removes and returns the earliest timer: O(log n).
    pub fn pop(&mut self) -> Option<Timer> {
        let last = self.items.pop()?;
        if self.items.is_empty() {
            return Some(last);
        }
        let top = std::mem::replace(&mut self.items[0], last);
        self.sift_down(0);
        Some(top)
    }

    /// Removes every timer.
    pub fn clear(&mut self) {
        self.items.clear();
    }

    /// Keeps only the timers `keep` accepts and restores the heap order: O(n).
    pub fn retain(&mut self, keep: impl FnMut(&Timer) -> bool) {
        self.items.retain(keep);
        self.heapify();
    }

    /// Replaces the contents with `timers`: O(n).
    pub fn rebuild(&mut self, timers: Vec<Timer>) {
        self.items = timers;
        self.heapify();
    }

    fn heapify(&mut self) {
        let n = self.items.len();
        if n < 2 {
            return;
        }
        let last_parent = (n - 2) / ARITY;
        for i in (0..=last_parent).rev() {
            self.sift_down(i);
        }
    }

    fn sift_up(&mut self, mut i: usize) {
        let item = self.items[i];
        while i > 0 {
            let parent = (i - 1) / ARITY;
            if self.items[parent].deadline <= item.deadline {
                break;
            }
            self.items[i] = self.items[parent];
            i = parent;
        }
        self.items[i] = item;
    }

    fn sift_down(&mut self, mut i: usize) {
        let n = self.items.len();
        let item = self.items[i];
        loop {
            let first = i * ARITY + 1;
            if first >= n {
                break;
            }
            let end = (first + ARITY).min(n);
            let mut best = first;
            let mut best_deadline = self.items[first].deadline;
            for c in first + 1..end {
                let d = self.items[c].deadline;
                if d < best_deadline {
                    best = c;
                    best_deadline = d;
                }
            }
            if best_deadline >= item.deadline {
                break;
            }
            self.items[i] = self.items[best];
            i = best;
        }
        self.items[i] = item;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn timer(deadline: u64) -> Timer {
        Timer {
            deadline,
            slot: deadline as u32,
            tag: 0,
        }
    }

    #[test]
    fn pops_in_deadline_order() {
        let mut rng = StdRng::seed_from_u64(7);
        let mut heap = TimerHeap::default();
        let mut model = Vec::new();
        for round in 0..2_000 {
            if rng.random_bool(0.6) {
                let d = rng.random_range(0..500);
                heap.push(timer(d));
                model.push(d);
            } else {
                model.sort_unstable();
                let expected = (!model.is_empty()).then(|| model.remove(0));
                assert_eq!(heap.pop().map(|t| t.deadline), expected, "round {round}");
            }
            assert_eq!(heap.len(), model.len());
        }
        heap.retain(|t| t.deadline % 2 == 0);
        model.retain(|d| d % 2 == 0);
        model.sort_unstable();
        let mut popped = Vec::new();
        while let Some(t) = heap.pop() {
            popped.push(t.deadline);
        }
        assert_eq!(popped, model);
    }

    #[test]
    fn rebuild_orders_any_input() {
        let mut heap = TimerHeap::default();
        heap.rebuild((0..1_000).rev().map(timer).collect());
        for d in 0..1_000 {
            assert_eq!(heap.peek().map(|t| t.deadline), Some(d));
            assert_eq!(heap.pop().map(|t| t.deadline), Some(d));
        }
        assert!(heap.pop().is_none());
    }
}
