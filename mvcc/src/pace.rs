//! How a long read gives way to writes.
//!
//! A long read through a [`ReadView`](crate::ReadView) (a range, a watch catch-up) pauses
//! between chunks of [`INDEX_CHUNK`](crate::store::INDEX_CHUNK) keys or records, and at each
//! pause:
//! - while a write transaction waits for the writer mutex or holds it, or callers of
//!   `force_commit` wait for a commit, it yields its CPU;
//! - while writes flow (a write transaction began since the last pause or is open, or a
//!   backend commit runs), it also sleeps, long enough that its running time stays within
//!   [`StoreOptions::long_read_cpu_percent`] of its elapsed time. It holds no backend read
//!   transaction while it sleeps (see `read`), so a backend whose readers pin space (LMDB)
//!   is not made to grow by a read that goes slowly.
//!
//! Why the sleep: the operating system shares CPUs fairly among runnable threads. On a
//! machine with fewer cores than busy threads, a scan running back to back beside a writer
//! and the committer takes a third of two cores, and the writes slow down by as much although
//! no lock is shared; a yield does not change the scan's share over time. Pacing the scan is
//! what keeps long reads from slowing writes: the scan finishes later instead, and runs at
//! full speed again as soon as writes stop.
//!
//! Sleeps shorter than [`MIN_SLEEP`] are not taken one by one: what each chunk owes adds up
//! until it reaches [`MIN_SLEEP`], and an oversleep counts against what is owed next.

use std::cell::Cell;
use std::time::{Duration, Instant};

use crate::options::StoreOptions;

/// The shortest sleep a paced read takes: a sleep costs a system call and a wake-up of some
/// tens of microseconds, and each wake-up may preempt a writer.
pub(crate) const MIN_SLEEP: Duration = Duration::from_micros(500);

/// The most sleep a paced read owes at once: a chunk that took long (its thread waited for a
/// CPU, or for the backend) does not stall the read for longer.
pub(crate) const MAX_OWED: Duration = Duration::from_millis(20);

/// What a paced read watches of its store.
pub(crate) trait Activity {
    /// The store's options.
    fn options(&self) -> &StoreOptions;
    /// A write transaction waits for the writer mutex or holds it, or callers of
    /// `force_commit` wait for a commit.
    fn writes_waiting(&self) -> bool;
    /// Write transactions begun since the store opened.
    fn write_txns(&self) -> u64;
    /// A backend commit is running.
    fn committing(&self) -> bool;
}

/// The pacing state of one long read (see the module docs).
pub(crate) struct Pacer<'a> {
    store: &'a dyn Activity,
    /// When the read began or last paused.
    last: Cell<Instant>,
    /// Write transactions begun, as of the last pause.
    writes: Cell<u64>,
    /// Sleep owed and not yet taken, in nanoseconds; below zero, what the last sleep took
    /// beyond what was owed.
    owed: Cell<i64>,
}

impl<'a> Pacer<'a> {
    /// The state of a read of `store` that begins now.
    pub(crate) fn new(store: &'a dyn Activity) -> Pacer<'a> {
        Pacer {
            store,
            last: Cell::new(Instant::now()),
            writes: Cell::new(store.write_txns()),
            owed: Cell::new(0),
        }
    }

    /// Between two chunks of the read: yields the CPU if writers wait, and returns the sleep
    /// now due, if any; the caller lets go of what it holds and calls [`sleep`](Self::sleep).
    /// Neither yields nor sleeps with
    /// [`StoreOptions::yield_reads_to_writers`] off.
    pub(crate) fn due(&self) -> Option<Duration> {
        let options = self.store.options();
        if !options.yield_reads_to_writers {
            return None;
        }
        let waiting = self.store.writes_waiting();
        let writes = self.store.write_txns();
        let flowing = waiting || self.writes.replace(writes) != writes || self.store.committing();
        let now = Instant::now();
        let ran = now - self.last.replace(now);
        let percent = options.long_read_cpu_percent;
        if flowing && percent < 100 {
            let due = nanos(ran * (100 - percent) / percent);
            let owed = self.owed.get().saturating_add(due).min(nanos(MAX_OWED));
            self.owed.set(owed);
            if owed >= nanos(MIN_SLEEP) {
                return Some(Duration::from_nanos(owed.unsigned_abs()));
            }
        } else {
            self.owed.set(0);
        }
        if waiting {
            std::thread::yield_now();
        }
        None
    }

    /// Sleeps for `owed` (from [`due`](Self::due)), and counts an oversleep against what is
    /// owed next.
    pub(crate) fn sleep(&self, owed: Duration) {
        let start = Instant::now();
        std::thread::sleep(owed);
        let woke = Instant::now();
        let left = self.owed.get() - nanos(woke - start);
        self.owed.set(left.max(-nanos(MAX_OWED)));
        self.last.set(woke);
    }
}

/// `d` in nanoseconds, saturating.
fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    struct Fake {
        options: StoreOptions,
        waiting: bool,
        writes: Cell<u64>,
        committing: bool,
    }

    impl Activity for Fake {
        fn options(&self) -> &StoreOptions {
            &self.options
        }
        fn writes_waiting(&self) -> bool {
            self.waiting
        }
        fn write_txns(&self) -> u64 {
            self.writes.get()
        }
        fn committing(&self) -> bool {
            self.committing
        }
    }

    fn fake(percent: u32) -> Fake {
        Fake {
            options: StoreOptions {
                long_read_cpu_percent: percent,
                ..StoreOptions::default()
            },
            waiting: false,
            writes: Cell::new(0),
            committing: false,
        }
    }

    /// Runs "a chunk" of `d` and pauses.
    fn chunk(p: &Pacer<'_>, d: Duration) -> Option<Duration> {
        std::thread::sleep(d);
        p.due()
    }

    #[test]
    fn a_read_with_no_writes_flowing_never_sleeps() {
        let store = fake(25);
        let p = Pacer::new(&store);
        for _ in 0..3 {
            assert_eq!(chunk(&p, Duration::from_millis(2)), None);
        }
    }

    #[test]
    fn a_read_owes_what_keeps_it_to_its_share_while_writes_flow() {
        let store = fake(25);
        let p = Pacer::new(&store);
        store.writes.set(1);
        // 2 ms of reading at 25% owe 6 ms of sleep (capped at MAX_OWED).
        let owed = chunk(&p, Duration::from_millis(2)).expect("a sleep is due");
        assert!(owed >= Duration::from_millis(6), "{owed:?}");
        assert!(owed <= MAX_OWED, "{owed:?}");
        // The sleep pays it off; with no new write the next chunk owes nothing.
        p.sleep(owed);
        assert_eq!(chunk(&p, Duration::from_millis(2)), None);
    }

    #[test]
    fn an_open_writer_or_a_running_commit_counts_as_writes_flowing() {
        for (waiting, committing) in [(true, false), (false, true)] {
            let store = Fake {
                waiting,
                committing,
                ..fake(50)
            };
            let p = Pacer::new(&store);
            assert!(chunk(&p, Duration::from_millis(1)).is_some());
        }
    }

    #[test]
    fn short_chunks_add_up_before_a_sleep() {
        let store = fake(50);
        let p = Pacer::new(&store);
        let mut chunks = 0;
        loop {
            store.writes.set(store.writes.get() + 1);
            chunks += 1;
            if let Some(owed) = chunk(&p, Duration::from_micros(100)) {
                assert!(owed >= MIN_SLEEP, "{owed:?}");
                break;
            }
            assert!(chunks < 100, "no sleep came due");
        }
        // 100 µs chunks at 50% owe 100 µs each: several of them make one sleep.
        assert!(chunks > 1, "a sleep after one chunk of 100 us");
    }

    #[test]
    fn full_share_or_pacing_off_never_sleeps() {
        let full = fake(100);
        let off = Fake {
            options: StoreOptions {
                yield_reads_to_writers: false,
                long_read_cpu_percent: 10,
                ..StoreOptions::default()
            },
            ..fake(10)
        };
        for store in [&full, &off] {
            let p = Pacer::new(store);
            store.writes.set(store.writes.get() + 1);
            assert_eq!(chunk(&p, Duration::from_millis(2)), None);
        }
    }
}
