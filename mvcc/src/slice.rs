//! A short scheduler slice for the threads that run a backend commit or wait for one.
//!
//! A durable backend commit sleeps in its syncs (LMDB's commit has two: the pages, then the
//! meta page), and every `force_commit` caller of that commit sleeps until it ends. When the
//! disk answers, the committing thread needs a CPU at once, and so does each caller when the
//! commit's end wakes it. On a machine whose CPUs are all busy (a long scan on one core,
//! clients on the other), Linux's fair scheduler (EEVDF) lets the running thread finish its
//! slice first (by default 0.7 ms times 1 + log2 of the CPUs: 1.4 ms on two), so the commit,
//! and every caller behind it, waits that long after each sync has ended. A thread that asks
//! for a shorter slice (`sched_setattr` with `sched_runtime`, Linux 6.12 and later) gets an
//! earlier deadline and, on waking, takes the CPU from a thread with a longer one; fairness
//! is unchanged (the slice is when a thread runs, not how much).
//!
//! [`with_short_slice`] runs a commit that callers wait for, or a caller's wait for one,
//! with the calling thread's slice set to
//! [`StoreOptions::commit_slice`](crate::StoreOptions::commit_slice) and gives the thread its
//! own slice back when it returns, so a caller's thread keeps its scheduling outside the
//! store. A background commit nobody waits for keeps its thread's slice: it can be long, and
//! short slices would only preempt the writers more often.
//!
//! A backend may use [`with_short_slice`] too, around a sync that callers wait on. It touches only threads of the normal policy whose slice is longer,
//! keeps their nice value and flags, and stops asking for good once the kernel refuses (an
//! older kernel ignores the field: then nothing changes). Three system calls per commit and
//! per wait.

use std::time::Duration;

/// Set once the kernel refused a slice: later commits do not ask again.
#[cfg(target_os = "linux")]
static REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs `f` with the calling thread's scheduler slice at most `slice` (zero: as it is), then
/// gives the thread its own slice back.
#[cfg(target_os = "linux")]
pub fn with_short_slice<R>(slice: Duration, f: impl FnOnce() -> R) -> R {
    use std::sync::atomic::Ordering;

    let want = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX);
    if want == 0 || REFUSED.load(Ordering::Relaxed) {
        return f();
    }
    let own = match uapi::sched_getattr(0, 0) {
        Ok(a) if a.sched_policy == uapi::c::SCHED_OTHER as u32 && a.sched_runtime > want => a,
        _ => return f(),
    };
    let mut short = own;
    // Only reset-on-fork is a flag of the thread's own; the others ask for changes.
    short.sched_flags &= uapi::c::SCHED_FLAG_RESET_ON_FORK;
    short.sched_runtime = want;
    if let Err(e) = uapi::sched_setattr(0, &short, 0) {
        REFUSED.store(true, Ordering::Relaxed);
        tracing::debug!(error = %e, "the kernel refuses a short scheduler slice for commits");
        return f();
    }
    let out = f();
    short.sched_runtime = own.sched_runtime;
    if let Err(e) = uapi::sched_setattr(0, &short, 0) {
        tracing::warn!(error = %e, "cannot give a thread its scheduler slice back after a commit");
    }
    out
}

/// Elsewhere than on Linux, runs `f` as it is.
#[cfg(not(target_os = "linux"))]
pub fn with_short_slice<R>(_slice: Duration, f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    fn runtime() -> Option<u64> {
        uapi::sched_getattr(0, 0).ok().map(|a| a.sched_runtime)
    }

    #[test]
    fn the_slice_is_short_inside_and_comes_back_after() {
        let Ok(before) = uapi::sched_getattr(0, 0) else {
            return; // No sched_getattr here: nothing to check.
        };
        let seen = with_short_slice(Duration::from_micros(100), runtime);
        let after = uapi::sched_getattr(0, 0).expect("sched_getattr worked before");
        assert_eq!(after.sched_runtime, before.sched_runtime);
        assert_eq!(after.sched_nice, before.sched_nice);
        assert_eq!(after.sched_policy, before.sched_policy);
        // A kernel with custom slices (6.12 and later) reports a normal thread's slice, longer
        // than 100 µs by default, and the one set while `f` runs; an older one reports
        // none and is left alone.
        let custom = before.sched_policy == uapi::c::SCHED_OTHER as u32
            && before.sched_runtime > 100_000
            && !REFUSED.load(std::sync::atomic::Ordering::Relaxed);
        let expected = if custom {
            100_000
        } else {
            before.sched_runtime
        };
        assert_eq!(seen, Some(expected));
    }

    #[test]
    fn zero_leaves_the_thread_alone() {
        let before = runtime();
        assert_eq!(with_short_slice(Duration::ZERO, runtime), before);
    }
}
