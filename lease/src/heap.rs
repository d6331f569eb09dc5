//! The expiry queue: a sorted run of near deadlines fed by a timing wheel of far ones.
//!
//! [`TimerQueue`] files a timer, unsorted, in the wheel slot of its deadline's bucket
//! (granule [`GRANULE_NANOS`], about 17 s; 65 536 slots, so a slot comes round every 13 days
//! and a longer timer is looked at once per turn). Only when time reaches a bucket are its
//! timers moved to the end of a run and sorted there: every timer of a newly opened bucket is
//! due after every timer of an earlier one, so the run stays sorted and popping the earliest
//! timer is reading the next element. A timer pushed into a bucket already opened (a short
//! TTL) goes to a small [`TimerHeap`] of late arrivals, a 4-ary min-heap of 24-byte timers;
//! a pop takes the earlier of the run's head and the heap's top. So the k earliest timers
//! cost O(k) plus O(m log m) to sort the m timers of the buckets opened (about one
//! granule's worth), where one heap of a million leases misses the cache on every level.
//!
//! Timers are never removed from the middle. A timer names a lease slot and a tag (the slot's
//! generation when the timer was pushed); the lease table discards a popped timer whose tag no
//! longer matches (lazy deletion), which keeps renew and revoke at O(log n) and O(1).

/// One scheduled deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Timer {
    /// Deadline in nanoseconds of the lessor's clock.
    pub deadline: u64,
    /// The lease, carried so that handing out an expired lease reads only the timer and the
    /// dense generation array, never the lease's slot.
    pub id: crate::LeaseId,
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

/// Width of a calendar bucket: 2^34 ns, about 17.2 s.
pub(crate) const GRANULE_NANOS: u64 = 1 << 34;
/// Buckets on the wheel: 65 536 × 17.2 s ≈ 13 days before a slot comes round again.
const WHEEL_SLOTS: usize = 65_536;

/// A timing wheel of far timers in front of a sorted run of near ones and a [`TimerHeap`] of
/// late arrivals; see the module docs.
#[derive(Debug)]
pub(crate) struct TimerQueue {
    /// Timers of opened buckets, ascending by deadline from `head` on.
    run: Vec<Timer>,
    /// Position of the earliest timer of `run` not yet popped.
    head: usize,
    /// Timers pushed into an already opened bucket.
    late: TimerHeap,
    /// Slot `b % WHEEL_SLOTS` holds the unopened timers of bucket `b` (deadline / granule),
    /// and those of buckets a whole number of turns later.
    wheel: Vec<Vec<Timer>>,
    /// Buckets below this one have been opened: their timers go straight to `late`.
    opened: u64,
    far_len: usize,
}

impl Default for TimerQueue {
    fn default() -> TimerQueue {
        TimerQueue {
            run: Vec::new(),
            head: 0,
            late: TimerHeap::default(),
            wheel: (0..WHEEL_SLOTS).map(|_| Vec::new()).collect(),
            opened: 0,
            far_len: 0,
        }
    }
}

impl TimerQueue {
    /// Number of timers, stale ones included.
    pub fn len(&self) -> usize {
        self.run.len() - self.head + self.late.len() + self.far_len
    }

    /// Bytes allocated.
    pub fn allocated_bytes(&self) -> usize {
        self.run.capacity() * std::mem::size_of::<Timer>()
            + self.late.allocated_bytes()
            + self.wheel.capacity() * std::mem::size_of::<Vec<Timer>>()
            + self
                .wheel
                .iter()
                .map(|v| v.capacity() * std::mem::size_of::<Timer>())
                .sum::<usize>()
    }

    /// Files a timer: O(1) amortised on the wheel, O(log h) into the heap of late arrivals
    /// when its bucket is already open.
    pub fn push(&mut self, timer: Timer) {
        let bucket = timer.deadline / GRANULE_NANOS;
        if bucket < self.opened {
            self.late.push(timer);
        } else {
            self.wheel[(bucket % WHEEL_SLOTS as u64) as usize].push(timer);
            self.far_len += 1;
        }
    }

    /// Removes and returns the earliest timer whose deadline is `<= now`, if any.
    pub fn pop_due(&mut self, now: u64) -> Option<Timer> {
        // Open every bucket up to the one holding `now`: afterwards every timer due by `now`
        // is in the run or the heap, since the wheel keeps only timers of later buckets.
        let due = now / GRANULE_NANOS;
        if due >= self.opened {
            if self.head > 0 && self.head * 2 >= self.run.len() {
                self.run.drain(..self.head);
                self.head = 0;
            }
            let start = self.run.len();
            if due - self.opened >= WHEEL_SLOTS as u64 {
                for slot in 0..WHEEL_SLOTS {
                    self.open(slot, due);
                }
            } else {
                for bucket in self.opened..=due {
                    self.open((bucket % WHEEL_SLOTS as u64) as usize, due);
                }
            }
            // Every timer just opened is due no earlier than every timer already in the run
            // (those are of earlier buckets), so sorting the new tail keeps the run sorted.
            self.run[start..].sort_unstable_by_key(|t| t.deadline);
            self.opened = due + 1;
        }
        let from_run = self.run.get(self.head).filter(|t| t.deadline <= now);
        let from_late = self.late.peek().filter(|t| t.deadline <= now);
        match (from_run, from_late) {
            (Some(r), Some(l)) if l.deadline < r.deadline => self.late.pop(),
            (Some(r), _) => {
                let r = *r;
                self.head += 1;
                Some(r)
            }
            (None, Some(_)) => self.late.pop(),
            (None, None) => None,
        }
    }

    /// Moves the timers of wheel slot `slot` whose bucket is `<= due` to the end of the run.
    fn open(&mut self, slot: usize, due: u64) {
        let run = &mut self.run;
        let bucket = &mut self.wheel[slot];
        let before = bucket.len();
        bucket.retain(|t| {
            if t.deadline / GRANULE_NANOS <= due {
                run.push(*t);
                false
            } else {
                true
            }
        });
        self.far_len -= before - bucket.len();
    }

    /// Removes every timer.
    pub fn clear(&mut self) {
        self.run = Vec::new();
        self.head = 0;
        self.late.clear();
        for bucket in &mut self.wheel {
            *bucket = Vec::new();
        }
        self.far_len = 0;
    }

    /// Keeps only the timers `keep` accepts: O(n).
    pub fn retain(&mut self, mut keep: impl FnMut(&Timer) -> bool) {
        self.run.drain(..self.head);
        self.head = 0;
        self.run.retain(&mut keep);
        self.late.retain(&mut keep);
        for bucket in &mut self.wheel {
            bucket.retain(&mut keep);
        }
        self.far_len = self.wheel.iter().map(Vec::len).sum();
    }
}

/// Leases handed out as expired, waiting for their retry deadline.
///
/// Retry deadlines are `now + retry interval` with a fixed interval, so the queue is a FIFO,
/// already sorted. It holds at most the leases handed out during one retry interval (the
/// expiry rate bounds that), so it stays small. Revoking a lease leaves its entry in place:
/// the revoke bumped the slot's expiry generation, so the entry is discarded, like any stale
/// timer, by a check of the dense generation array when its deadline comes (no read of the
/// slot, and no bookkeeping on the revoke or the hand-out).
#[derive(Debug, Default)]
pub(crate) struct RetryQueue {
    queue: std::collections::VecDeque<Timer>,
}

impl RetryQueue {
    /// Queues `timer` (deadline = its retry time).
    pub fn push(&mut self, timer: Timer) {
        self.queue.push_back(timer);
    }

    /// Removes and returns the next entry whose retry deadline is `<= now`; the caller
    /// checks its tag.
    pub fn pop_due(&mut self, now: u64) -> Option<Timer> {
        match self.queue.front() {
            Some(t) if t.deadline <= now => self.queue.pop_front(),
            _ => None,
        }
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.queue.clear();
    }

    /// Bytes allocated.
    pub fn allocated_bytes(&self) -> usize {
        self.queue.capacity() * std::mem::size_of::<Timer>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn timer(deadline: u64) -> Timer {
        Timer {
            deadline,
            id: deadline as i64 + 1,
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
    fn queue_pops_every_due_timer_in_order_and_nothing_else() {
        let mut rng = StdRng::seed_from_u64(9);
        let mut queue = TimerQueue::default();
        let mut model: Vec<u64> = Vec::new();
        let mut now = 0u64;
        for round in 0..3_000 {
            match rng.random_range(0..3) {
                0 => {
                    let d = now + rng.random_range(0..GRANULE_NANOS * 8);
                    queue.push(timer(d));
                    model.push(d);
                }
                1 => now += rng.random_range(0..GRANULE_NANOS),
                _ => {
                    model.sort_unstable();
                    let expected = model.first().copied().filter(|&d| d <= now);
                    if expected.is_some() {
                        model.remove(0);
                    }
                    assert_eq!(
                        queue.pop_due(now).map(|t| t.deadline),
                        expected,
                        "round {round}"
                    );
                }
            }
            assert_eq!(queue.len(), model.len());
        }
        queue.retain(|t| t.deadline % 3 == 0);
        model.retain(|d| d % 3 == 0);
        assert_eq!(queue.len(), model.len());
        model.sort_unstable();
        let mut popped = Vec::new();
        while let Some(t) = queue.pop_due(u64::MAX) {
            popped.push(t.deadline);
        }
        assert_eq!(popped, model);
    }

    #[test]
    fn retry_queue_pops_in_deadline_order_up_to_now() {
        let mut q = RetryQueue::default();
        for slot in 0..10u32 {
            q.push(Timer {
                deadline: u64::from(slot),
                id: i64::from(slot) + 1,
                slot,
                tag: 0,
            });
        }
        let mut popped = Vec::new();
        while let Some(t) = q.pop_due(6) {
            popped.push(t.slot);
        }
        assert_eq!(popped, vec![0, 1, 2, 3, 4, 5, 6]);
        assert_eq!(q.pop_due(6), None);
        assert_eq!(q.pop_due(9).map(|t| t.id), Some(8));
        q.clear();
        assert_eq!(q.pop_due(u64::MAX), None);
    }

    #[test]
    fn retain_reorders_any_input() {
        let mut heap = TimerHeap::default();
        for d in (0..1_000).rev() {
            heap.push(timer(d));
        }
        heap.items.reverse();
        heap.retain(|_| true);
        for d in 0..1_000 {
            assert_eq!(heap.peek().map(|t| t.deadline), Some(d));
            assert_eq!(heap.pop().map(|t| t.deadline), Some(d));
        }
        assert!(heap.pop().is_none());
    }
}
