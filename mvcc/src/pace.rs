//! How a long read gives way to writes.
//!
//! A long read through a [`ReadView`](crate::ReadView) (a range, a watch catch-up) pauses
//! between chunks of [`INDEX_CHUNK`](crate::store::INDEX_CHUNK) keys or records, and at each
//! pause:
//! - while a write transaction waits for the writer mutex or holds it, or callers of
//!   `force_commit` wait for a commit, it yields its CPU;
//! - while writes flow (a write transaction began in the last [`WRITES_FLOW_FOR`] or is
//!   open, or a backend commit runs) and the CPUs are oversubscribed, it also sleeps, long
//!   enough that its time on a CPU stays within [`StoreOptions::long_read_cpu_percent`] of
//!   its elapsed time. It holds no backend read transaction while it sleeps (see `read`), so
//!   a backend whose readers pin space (LMDB) is not made to grow by a read that goes slowly.
//!
//! Why the sleep: the operating system shares CPUs fairly among runnable threads. On a
//! machine with fewer cores than busy threads, a scan running back to back beside a writer
//! and the committer takes a third of two cores, and the writes slow down by as much although
//! no lock is shared; a yield does not change the scan's share over time. Pacing the scan is
//! what keeps long reads from slowing writes: the scan finishes later instead, and runs at
//! full speed again as soon as writes stop.
//!
//! Oversubscribed means no CPU to spare: while writes flow, a read probes for [`PROBE`]
//! what the process's threads did meanwhile: the CPU time its other threads used (the
//! process's, `CLOCK_PROCESS_CPUTIME_ID`, less the read's own), and the time they spent
//! ready to run but waiting for a CPU (their run delay in `/proc/self/task/*/schedstat`),
//! both as an average number of CPUs. Their sum is what the other threads wanted; if that
//! and one CPU more for the read at full speed leave less than one CPU over, of those the
//! process may use (its CPU affinity and its cgroup's CPU quota, as
//! `std::thread::available_parallelism` counts them), the read paces itself for the next
//! [`RECHECK`]; otherwise it runs at full speed as long, after which it probes again. A
//! probe goes on as the verdict before it said, paced or not (the first one unpaced): the
//! read's own time is left out of the sum, so a paced probe finds what one at full speed
//! would, and a paced read takes no unpaced turns. So a process with a CPU to spare for
//! its writers never slows a scan, and one whose writers wait for a CPU, because of the scan
//! or of any other process, paces it. Only the process's own threads are measured: other
//! processes' load (in a container, the whole host's, which is what its `/proc/loadavg`
//! shows) counts only as far as it makes them wait. (The reading thread's own wait for a
//! CPU is no sign: the scheduler may as well keep the scan on its CPU and make the writer
//! and the committer share the other.) The thread that began a probe ends it; another
//! read begins it again if that thread's read ended first.
//!
//! A paced read's time on a CPU comes from its thread's CPU-time clock, read once per
//! [`CHECK_EVERY`] at most. Where these cannot be read, a read paces whenever writes flow
//! and counts its elapsed time as time on a CPU.

use std::cell::Cell;
use std::time::{Duration, Instant};

use crate::options::StoreOptions;

/// How long after a write transaction began a read still counts writes as flowing.
pub(crate) const WRITES_FLOW_FOR: Duration = Duration::from_millis(10);

/// The shortest sleep a paced read takes: a sleep costs a system call and a wake-up of some
/// tens of microseconds, and each wake-up may preempt a writer.
pub(crate) const MIN_SLEEP: Duration = Duration::from_micros(500);

/// The longest sleep a paced read takes at once.
pub(crate) const MAX_SLEEP: Duration = Duration::from_millis(20);

/// The most time on a CPU a paced read may take at full speed on what it earned while off
/// a CPU without sleeping (waiting for a CPU, or for a lock): a read kept waiting by busy
/// CPUs for a while would otherwise run unpaced, once it had a CPU again, for a share of
/// all that while, just when the CPUs are busiest.
pub(crate) const MAX_CREDIT: Duration = Duration::from_micros(500);

/// How often, at most, a paced read reads its time on a CPU to see whether a sleep is due.
pub(crate) const CHECK_EVERY: Duration = Duration::from_micros(500);

/// How long a read probes, while writes flow, whether the CPUs are oversubscribed.
pub(crate) const PROBE: Duration = Duration::from_millis(10);

/// How long a probe's verdict holds.
pub(crate) const RECHECK: Duration = Duration::from_millis(200);

/// The calling thread's time on a CPU, if the system says (`CLOCK_THREAD_CPUTIME_ID`,
/// exact to the call: the thread's `/proc` schedstat counts a running thread's time only at
/// scheduler ticks, some milliseconds apart).
pub(crate) fn thread_on_cpu() -> Option<Duration> {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Some(Duration::new(
        u64::try_from(t.tv_sec).ok()?,
        u32::try_from(t.tv_nsec).ok()?,
    ))
}

/// The time on a CPU between two readings of it, or `elapsed` where either is unknown.
fn on_cpu_since(then: Option<Duration>, now: Option<Duration>, elapsed: Duration) -> Duration {
    match (then, now) {
        (Some(then), Some(now)) => now.saturating_sub(then),
        _ => elapsed,
    }
}

/// What the process's threads have done so far: their time on a CPU, all together, and the
/// time all but the calling thread have waited for one (their run delay), if the system
/// says.
pub(crate) fn process_cpu() -> Option<(Duration, Duration)> {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    let on_cpu = Duration::new(
        u64::try_from(t.tv_sec).ok()?,
        u32::try_from(t.tv_nsec).ok()?,
    );
    let me = rustix::thread::gettid().as_raw_nonzero().get().to_string();
    let mut waited = 0u64;
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let Ok(task) = task else { continue };
        if task.file_name().to_str() == Some(me.as_str()) {
            continue;
        }
        // A thread that ended meanwhile has nothing left to count.
        let Ok(stat) = std::fs::read_to_string(task.path().join("schedstat")) else {
            continue;
        };
        if let Some(delay) = stat
            .split_whitespace()
            .nth(1)
            .and_then(|d| d.parse::<u64>().ok())
        {
            waited = waited.saturating_add(delay);
        }
    }
    Some((on_cpu, Duration::from_nanos(waited)))
}

/// The CPUs this process may use, if the system says.
pub(crate) fn usable_cpus() -> Option<f64> {
    Some(std::thread::available_parallelism().ok()?.get() as f64)
}

/// How a pacer reads the system: see [`thread_on_cpu`], [`process_cpu`] and
/// [`usable_cpus`].
#[derive(Clone, Copy)]
pub(crate) struct Probes {
    pub on_cpu: fn() -> Option<Duration>,
    pub process: fn() -> Option<(Duration, Duration)>,
    pub cpus: fn() -> Option<f64>,
}

/// The system's own.
pub(crate) const SYSTEM: Probes = Probes {
    on_cpu: thread_on_cpu,
    process: process_cpu,
    cpus: usable_cpus,
};

/// Whether reads pace themselves (see the module docs): the store keeps the last verdict,
/// so a read that begins while it holds needs no probe of its own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Verdict {
    /// A probe under way.
    Probing(Probe),
    /// Pacing until the instant.
    Pace(Instant),
    /// Running at full speed until the instant.
    Run(Instant),
}

/// A probe under way: what the process's threads, and the reading thread that began it
/// (the one that ends it), had done when it began.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Probe {
    /// When it began.
    since: Instant,
    /// The thread that began it.
    by: std::thread::ThreadId,
    /// The CPU time the process's threads had used (see [`process_cpu`]).
    used: Duration,
    /// The time the process's other threads had waited for a CPU.
    waited: Duration,
    /// The prober's own time on a CPU, if known.
    own: Option<Duration>,
    /// Whether reads pace meanwhile: as the verdict before it said (a first probe does not).
    pacing: bool,
}

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
    /// A paced read slept for `d`.
    fn slept(&self, d: Duration);
    /// The store's pacing verdict, if any (see [`Verdict`]).
    fn verdict(&self) -> Option<Verdict>;
    /// Sets the store's pacing verdict.
    fn set_verdict(&self, verdict: Verdict);
}

/// How much long reads have given way to writes since the store opened (see
/// [`Store::read_pacing`](crate::Store::read_pacing)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadPacing {
    /// Sleeps long reads took between chunks.
    pub sleeps: u64,
    /// Their total length.
    pub slept: Duration,
}

/// The pacing state of one long read (see the module docs).
pub(crate) struct Pacer<'a> {
    store: &'a dyn Activity,
    /// Reads the system.
    probes: Probes,
    /// Write transactions begun, as of the last pause.
    writes: Cell<u64>,
    /// When the read last saw that count move.
    wrote_at: Cell<Option<Instant>>,
    /// While pacing: when the read last began to run (the pacing began, or a sleep ended),
    /// with its time on a CPU then, if known.
    running: Cell<Option<(Instant, Option<Duration>)>>,
    /// While pacing: no look at the time on a CPU before this.
    next_check: Cell<Option<Instant>>,
    /// The time on a CPU at the last look, if known.
    on_cpu: Cell<Option<Duration>>,
    /// While pacing: the sleep owed at the last look, whole (a sleep takes
    /// [`MAX_SLEEP`] of it at most).
    owed: Cell<Duration>,
    /// While pacing: what the last sleep left owed, carried into the time since it.
    carried: Cell<Duration>,
}

impl<'a> Pacer<'a> {
    /// The state of a read of `store` that begins now.
    pub(crate) fn new(store: &'a dyn Activity) -> Pacer<'a> {
        Pacer::with_probes(store, SYSTEM)
    }

    /// [`new`](Self::new), reading the system with `probes`.
    pub(crate) fn with_probes(store: &'a dyn Activity, probes: Probes) -> Pacer<'a> {
        Pacer {
            store,
            probes,
            writes: Cell::new(store.write_txns()),
            wrote_at: Cell::new(None),
            running: Cell::new(None),
            next_check: Cell::new(None),
            on_cpu: Cell::new(None),
            owed: Cell::new(Duration::ZERO),
            carried: Cell::new(Duration::ZERO),
        }
    }

    /// Between two chunks of the read: yields the CPU if writers wait, and returns the sleep
    /// now due, if any; the caller lets go of what it holds and calls [`sleep`](Self::sleep).
    /// Neither yields nor sleeps with [`StoreOptions::yield_reads_to_writers`] off.
    pub(crate) fn due(&self) -> Option<Duration> {
        let options = self.store.options();
        if !options.yield_reads_to_writers {
            return None;
        }
        let now = Instant::now();
        let waiting = self.store.writes_waiting();
        let writes = self.store.write_txns();
        if self.writes.replace(writes) != writes {
            self.wrote_at.set(Some(now));
        }
        let flowing = waiting
            || self
                .wrote_at
                .get()
                .is_some_and(|at| now - at < WRITES_FLOW_FOR)
            || self.store.committing();
        let percent = options.long_read_cpu_percent;
        let due = if flowing && percent < 100 && self.contended(now) {
            self.owed(now, percent)
        } else {
            self.running.set(None);
            None
        };
        if due.is_none() && waiting {
            std::thread::yield_now();
        }
        due
    }

    /// While pacing: the sleep that keeps the read's time on a CPU within `percent` of its
    /// elapsed time since it last began to run, with what the sleep before left owed, once
    /// it reaches [`MIN_SLEEP`].
    fn owed(&self, now: Instant, percent: u32) -> Option<Duration> {
        let Some((since, on_cpu_then)) = self.running.get() else {
            self.begin_running(now, (self.probes.on_cpu)(), Duration::ZERO);
            return None;
        };
        if self.next_check.get().is_some_and(|at| now < at) {
            return None;
        }
        self.next_check.set(Some(now + CHECK_EVERY));
        let mut elapsed = now - since;
        let on_cpu_now = (self.probes.on_cpu)();
        self.on_cpu.set(on_cpu_now);
        let on_cpu = on_cpu_since(on_cpu_then, on_cpu_now, elapsed);
        // What the read has earned beyond its time on a CPU is capped at `MAX_CREDIT`: the
        // time it began to run moves up as far as that needs.
        let capped = (on_cpu + MAX_CREDIT) * 100 / percent;
        if elapsed > capped {
            elapsed = capped;
            self.running.set(Some((now - capped, on_cpu_then)));
        }
        let owed = (on_cpu * 100 / percent).saturating_sub(elapsed) + self.carried.get();
        self.owed.set(owed);
        (owed >= MIN_SLEEP).then(|| owed.min(MAX_SLEEP))
    }

    /// Whether the CPUs are oversubscribed, as the last probe found; starts or ends a probe
    /// at `now` when due.
    fn contended(&self, now: Instant) -> bool {
        let me = std::thread::current().id();
        let probe = |pacing: bool| match (self.probes.process)() {
            Some((used, waited)) => Verdict::Probing(Probe {
                since: now,
                by: me,
                used,
                waited,
                own: (self.probes.on_cpu)(),
                pacing,
            }),
            None => Verdict::Pace(now + RECHECK),
        };
        let held = self.store.verdict();
        let verdict = match held {
            None => probe(false),
            Some(Verdict::Probing(p)) if p.by == me && now - p.since >= PROBE => {
                self.judge(now, &p)
            }
            // A probe whose read ended before it did is begun again.
            Some(Verdict::Probing(p)) if p.by != me && now - p.since >= 2 * PROBE => {
                probe(p.pacing)
            }
            Some(Verdict::Pace(until)) if now >= until => probe(true),
            Some(Verdict::Run(until)) if now >= until => probe(false),
            Some(verdict) => verdict,
        };
        if held != Some(verdict) {
            self.store.set_verdict(verdict);
        }
        match verdict {
            Verdict::Pace(_) => true,
            Verdict::Probing(p) => p.pacing,
            Verdict::Run(_) => false,
        }
    }

    /// Ends probe `p` at `now`: the CPUs are oversubscribed when what the process's other
    /// threads used of them and waited for, with one CPU more for the read at full speed,
    /// leaves less than one CPU over. The read's own time on a CPU is left out of what the
    /// others used, so a probe made while pacing finds what a probe at full speed would
    /// (where that time is unknown, the read is taken to have been on a CPU all along).
    fn judge(&self, now: Instant, p: &Probe) -> Verdict {
        let (Some((used, waited)), Some(cpus)) = ((self.probes.process)(), (self.probes.cpus)())
        else {
            return Verdict::Pace(now + RECHECK);
        };
        let span = now - p.since;
        let own = on_cpu_since(p.own, (self.probes.on_cpu)(), span);
        let others = used.saturating_sub(p.used).saturating_sub(own);
        let wanting = waited.saturating_sub(p.waited);
        let demand = (others + wanting).as_secs_f64() / span.as_secs_f64();
        if cpus - demand - 1.0 < 1.0 {
            Verdict::Pace(now + RECHECK)
        } else {
            Verdict::Run(now + RECHECK)
        }
    }

    /// Sleeps for `owed` (from [`due`](Self::due)); the read begins to run again after it
    /// (a sleep takes no time on a CPU to speak of).
    pub(crate) fn sleep(&self, owed: Duration) {
        let start = Instant::now();
        std::thread::sleep(owed);
        let woke = Instant::now();
        self.store.slept(woke - start);
        // A sleep of at most `MAX_SLEEP` leaves the rest of a larger debt (a part of the
        // read that paused seldom) owed.
        let left = self.owed.get().saturating_sub(woke - start);
        self.begin_running(woke, self.on_cpu.get(), left);
    }

    /// The read begins to run at `now`, having been on a CPU for `on_cpu` (if known) and
    /// owing `carried` from before.
    fn begin_running(&self, now: Instant, on_cpu: Option<Duration>, carried: Duration) {
        self.carried.set(carried);
        self.running.set(Some((now, on_cpu)));
        self.next_check.set(Some(now + CHECK_EVERY));
    }
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
        verdict: Cell<Option<Verdict>>,
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
        fn slept(&self, _: Duration) {}
        fn verdict(&self) -> Option<Verdict> {
            self.verdict.get()
        }
        fn set_verdict(&self, verdict: Verdict) {
            self.verdict.set(Some(verdict));
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
            verdict: Cell::new(None),
        }
    }

    /// Nothing can be read: a read paces whenever writes flow, and counts its elapsed time
    /// as time on a CPU.
    const UNKNOWN: Probes = Probes {
        on_cpu: || None,
        process: || None,
        cpus: || None,
    };

    /// Time since the first call of any of these: the CPU time of a process that keeps one
    /// CPU busy, or the wait of a thread always ready to run.
    fn since_start() -> Duration {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        START.get_or_init(Instant::now).elapsed()
    }

    /// CPUs to spare: one busy of four, nobody waiting.
    const IDLE_CPUS: Probes = Probes {
        on_cpu: || None,
        process: || Some((since_start(), Duration::ZERO)),
        cpus: || Some(4.0),
    };

    /// No CPU to spare: one busy of one.
    const BUSY_CPUS: Probes = Probes {
        on_cpu: || None,
        process: || Some((since_start(), Duration::ZERO)),
        cpus: || Some(1.0),
    };

    /// No CPU to spare for the process's writers: one of two used, and a thread waiting
    /// for the other all along (another process has it).
    const TAKEN_CPUS: Probes = Probes {
        on_cpu: || None,
        process: || Some((since_start(), since_start())),
        cpus: || Some(2.0),
    };

    /// Runs "a chunk" of `d` with a write landing in it, and pauses.
    fn chunk(store: &Fake, p: &Pacer<'_>, d: Duration) -> Option<Duration> {
        store.writes.set(store.writes.get() + 1);
        std::thread::sleep(d);
        p.due()
    }

    #[test]
    fn a_read_with_no_writes_flowing_never_sleeps() {
        let store = fake(25);
        let p = Pacer::with_probes(&store, UNKNOWN);
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(2));
            assert_eq!(p.due(), None);
        }
    }

    #[test]
    fn a_read_owes_what_keeps_it_to_its_share_while_writes_flow() {
        let store = fake(25);
        let p = Pacer::with_probes(&store, UNKNOWN);
        // Pacing begins at the first pause that sees writes flow.
        assert_eq!(chunk(&store, &p, Duration::ZERO), None);
        // 2 ms of reading at 25% owe 6 ms of sleep.
        let owed = chunk(&store, &p, Duration::from_millis(2)).expect("a sleep is due");
        assert!(owed >= Duration::from_millis(6), "{owed:?}");
        assert!(owed <= MAX_SLEEP, "{owed:?}");
        // The sleep pays it off; a short chunk after it owes less than a sleep.
        p.sleep(owed);
        assert_eq!(chunk(&store, &p, Duration::ZERO), None);
    }

    #[test]
    fn what_a_sleep_leaves_owed_is_owed_after_it() {
        let store = fake(25);
        let p = Pacer::with_probes(&store, UNKNOWN);
        assert_eq!(chunk(&store, &p, Duration::ZERO), None);
        // 10 ms of reading at 25% owe 30 ms, more than one sleep takes.
        let owed = chunk(&store, &p, Duration::from_millis(10)).expect("a sleep is due");
        assert_eq!(owed, MAX_SLEEP);
        p.sleep(owed);
        // The 10 ms or so left are owed after a chunk that owes little of its own.
        let rest = chunk(&store, &p, CHECK_EVERY).expect("the rest is due");
        assert!(rest >= Duration::from_millis(5), "{rest:?}");
        p.sleep(rest);
        assert_eq!(chunk(&store, &p, Duration::ZERO), None);
    }

    thread_local! {
        /// The reading thread's time on a CPU, as the test sets it.
        static FAKE_ON_CPU: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    }

    /// The read's time on a CPU is [`FAKE_ON_CPU`]; nothing else can be read (so a read
    /// paces whenever writes flow).
    const FAKE_CPU_CLOCK: Probes = Probes {
        on_cpu: || Some(FAKE_ON_CPU.with(Cell::get)),
        process: || None,
        cpus: || None,
    };

    #[test]
    fn waiting_off_a_cpu_earns_no_long_run_at_full_speed() {
        let store = fake(25);
        let p = Pacer::with_probes(&store, FAKE_CPU_CLOCK);
        assert_eq!(chunk(&store, &p, Duration::ZERO), None);
        // 30 ms kept off a CPU (no time on one): at 25% that would earn 7.5 ms at full speed.
        assert_eq!(chunk(&store, &p, Duration::from_millis(30)), None);
        // Then on a CPU all along: a sleep comes due within `MAX_CREDIT` and a check or two.
        let step = CHECK_EVERY + Duration::from_micros(100);
        let mut ran = Duration::ZERO;
        let owed = loop {
            FAKE_ON_CPU.with(|c| c.set(c.get() + step));
            ran += step;
            if let Some(owed) = chunk(&store, &p, step) {
                break owed;
            }
            assert!(ran < Duration::from_millis(20), "no sleep came due");
        };
        assert!(
            ran <= MAX_CREDIT + 2 * step,
            "ran {ran:?} at full speed before a sleep"
        );
        assert!(owed >= MIN_SLEEP, "{owed:?}");
    }

    #[test]
    fn an_open_writer_or_a_running_commit_counts_as_writes_flowing() {
        for (waiting, committing) in [(true, false), (false, true)] {
            let store = Fake {
                waiting,
                committing,
                ..fake(50)
            };
            let p = Pacer::with_probes(&store, UNKNOWN);
            assert_eq!(p.due(), None);
            std::thread::sleep(Duration::from_millis(2));
            assert!(p.due().is_some());
        }
    }

    #[test]
    fn short_chunks_add_up_before_a_sleep() {
        let store = fake(50);
        let p = Pacer::with_probes(&store, UNKNOWN);
        let mut chunks = 0;
        loop {
            chunks += 1;
            if let Some(owed) = chunk(&store, &p, Duration::from_micros(100)) {
                assert!(owed >= MIN_SLEEP, "{owed:?}");
                break;
            }
            assert!(chunks < 100, "no sleep came due");
        }
        // 100 µs chunks at 50% owe 100 µs each: several of them make one sleep.
        assert!(chunks > 2, "a sleep after {chunks} chunks of 100 us");
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
            let p = Pacer::with_probes(store, UNKNOWN);
            for _ in 0..3 {
                assert_eq!(chunk(store, &p, Duration::from_millis(2)), None);
            }
        }
    }

    #[test]
    fn the_process_time_on_a_cpu_counts_every_thread() {
        let (before, _) = process_cpu().expect("process CPU time");
        let spin = || {
            let start = thread_on_cpu().expect("thread CPU time");
            let t = Instant::now();
            while t.elapsed() < Duration::from_millis(30) {
                std::hint::spin_loop();
            }
            thread_on_cpu().expect("thread CPU time") - start
        };
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(spin);
            let b = s.spawn(spin);
            (a.join().unwrap(), b.join().unwrap())
        });
        let used = process_cpu().expect("process CPU time").0 - before;
        // Both spinning threads' time is in the process's, with the scheduler's accounting
        // granularity to spare.
        assert!(
            used + Duration::from_millis(2) >= a + b,
            "process {used:?}, threads {a:?} + {b:?}"
        );
        assert!(usable_cpus().is_some_and(|n| n >= 1.0));
    }

    #[test]
    fn threads_kept_from_a_cpu_count_as_waiting() {
        // One spinning thread more than there are CPUs: some of them wait for one, and their
        // waits are counted while they run (an ended thread no longer counts).
        let n = std::thread::available_parallelism().map_or(1, |n| n.get()) + 1;
        let stop = std::sync::atomic::AtomicBool::new(false);
        let waited = std::thread::scope(|s| {
            for _ in 0..n {
                s.spawn(|| {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                });
            }
            std::thread::sleep(Duration::from_millis(5));
            // Threads of other tests that end meanwhile take their waits out of the sum, so
            // a window can show none: up to ten windows are tried.
            let mut waited = Duration::ZERO;
            for _ in 0..10 {
                let (_, first) = process_cpu().expect("process CPU time");
                std::thread::sleep(Duration::from_millis(60));
                let (_, last) = process_cpu().expect("process CPU time");
                waited = last.saturating_sub(first);
                if waited > Duration::ZERO {
                    break;
                }
            }
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            waited
        });
        assert!(
            waited > Duration::ZERO,
            "no wait counted for {n} spinning threads"
        );
    }

    /// A paced read on one of three CPUs 15% of the time, the process's other threads on
    /// them one and a half CPUs' worth, nobody waiting: a read at full speed would leave
    /// half a CPU (counting the read's own time among what was used would leave 1.35).
    const PACED_BESIDE_A_CPU_AND_A_HALF: Probes = Probes {
        on_cpu: || Some(since_start().mul_f64(0.15)),
        process: || Some((since_start().mul_f64(1.65), Duration::ZERO)),
        cpus: || Some(3.0),
    };

    /// The same read alone: a read at full speed would leave two CPUs (a margin of a whole
    /// CPU, so the instants at which the fakes are read do not matter).
    const PACED_ALONE: Probes = Probes {
        on_cpu: || Some(since_start().mul_f64(0.15)),
        process: || Some((since_start().mul_f64(0.15), Duration::ZERO)),
        cpus: || Some(3.0),
    };

    #[test]
    fn a_probe_after_a_pace_verdict_paces_and_leaves_the_reads_own_time_out() {
        for (probes, paces) in [(PACED_BESIDE_A_CPU_AND_A_HALF, true), (PACED_ALONE, false)] {
            let store = fake(25);
            // The last verdict, to pace, has just run out.
            store.verdict.set(Some(Verdict::Pace(
                Instant::now() - Duration::from_millis(1),
            )));
            let p = Pacer::with_probes(&store, probes);
            assert_eq!(chunk(&store, &p, Duration::ZERO), None);
            let Some(Verdict::Probing(probe)) = store.verdict.get() else {
                panic!("no probe began: {:?}", store.verdict.get());
            };
            assert!(probe.pacing, "a probe after a pace verdict runs unpaced");
            // The probe runs its course paced.
            let begun = Instant::now();
            while Instant::now() - begun < PROBE {
                chunk(&store, &p, PROBE / 4);
            }
            chunk(&store, &p, Duration::from_millis(1));
            match store.verdict.get() {
                Some(Verdict::Pace(_)) => assert!(paces, "paced with a CPU to spare"),
                Some(Verdict::Run(_)) => assert!(!paces, "unpaced with no CPU to spare"),
                other => panic!("the probe did not end: {other:?}"),
            }
        }
    }

    #[test]
    fn only_the_thread_that_began_a_probe_ends_it() {
        let store = fake(25);
        let elsewhere = std::thread::spawn(|| std::thread::current().id())
            .join()
            .unwrap();
        let theirs = Probe {
            since: Instant::now() - PROBE - Duration::from_millis(1),
            by: elsewhere,
            used: Duration::ZERO,
            waited: Duration::ZERO,
            own: None,
            pacing: true,
        };
        store.verdict.set(Some(Verdict::Probing(theirs)));
        let p = Pacer::with_probes(&store, IDLE_CPUS);
        // Over time, but not this thread's to end: reads go on as it says.
        assert_eq!(chunk(&store, &p, Duration::ZERO), None);
        assert_eq!(store.verdict.get(), Some(Verdict::Probing(theirs)));
        assert!(chunk(&store, &p, Duration::from_millis(2)).is_some());
        // Twice over time: its thread is taken to have stopped reading, and this one
        // begins it again.
        std::thread::sleep(PROBE);
        chunk(&store, &p, Duration::ZERO);
        let Some(Verdict::Probing(ours)) = store.verdict.get() else {
            panic!("no probe: {:?}", store.verdict.get());
        };
        assert_eq!(ours.by, std::thread::current().id());
        assert!(ours.pacing);
    }

    #[test]
    fn a_read_paces_only_once_a_probe_finds_it_waiting_for_a_cpu() {
        for (probes, paces) in [(IDLE_CPUS, false), (BUSY_CPUS, true), (TAKEN_CPUS, true)] {
            let store = fake(25);
            let p = Pacer::with_probes(&store, probes);
            // Writes flow throughout; the first chunks run unpaced while the probe lasts.
            let mut slept = false;
            for _ in 0..10 {
                if let Some(owed) = chunk(&store, &p, PROBE / 4) {
                    slept = true;
                    p.sleep(owed.min(Duration::from_millis(1)));
                }
            }
            assert_eq!(slept, paces);
        }
    }
}
