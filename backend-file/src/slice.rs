//! A short scheduler slice for the thread that waits for a commit's sync.
//!
//! A durable commit sleeps in `fdatasync` and every caller of the commit waits on it. When the
//! disk answers, the committing thread needs a CPU at once; on a machine whose CPUs are all
//! busy (a long scan on one core, clients on the other), Linux's fair scheduler (EEVDF) lets
//! the running thread finish its slice first (the default is 0.7 ms times 1 + log2 of the
//! CPUs: 1.4 ms on two) and the commit waits that long after its sync has ended, every commit.
//! A thread that asks for a shorter slice (`sched_setattr` with `sched_runtime`, Linux 6.12
//! and later) gets an earlier deadline and, on waking, takes the CPU from a thread with a
//! longer one.
//!
//! [`waiting`] runs the sync with the committing thread's slice set to
//! [`FileOptions::commit_sync_slice`](crate::FileOptions::commit_sync_slice) and puts the
//! thread's own slice back when it returns, so a caller's thread keeps its scheduling outside
//! the backend's syncs. It touches only threads of the normal policy whose slice is longer,
//! keeps their nice value and flags, and stops trying for good once the kernel refuses (an
//! older kernel ignores the field: then nothing changes). Three system calls per commit.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Set once the kernel refused a slice: later syncs do not ask again.
static REFUSED: AtomicBool = AtomicBool::new(false);

/// Size of the `sched_attr` layout used here (the first version, without utilisation
/// clamps, which are then left as they are).
const ATTR_SIZE: u32 = std::mem::size_of::<libc::sched_attr>() as u32;

fn get() -> Option<libc::sched_attr> {
    // SAFETY: `sched_attr` is a plain C struct of integers, for which all zeros is a valid value.
    let mut attr: libc::sched_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `sched_getattr(0, attr, size, 0)` writes at most `size` bytes into `attr`, a
    // live, writable `sched_attr` of exactly `size` bytes; 0 is the calling thread.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            0,
            &mut attr as *mut libc::sched_attr,
            ATTR_SIZE,
            0,
        )
    };
    (r == 0).then_some(attr)
}

fn set(attr: &libc::sched_attr) -> bool {
    // SAFETY: `sched_setattr(0, attr, 0)` reads `attr.size` bytes from `attr`, a live
    // `sched_attr` whose `size` field is its own size; 0 is the calling thread.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_setattr,
            0,
            attr as *const libc::sched_attr,
            0,
        )
    };
    r == 0
}

/// Runs `sync` with the calling thread's scheduler slice at most `slice` (zero: as it is),
/// then gives the thread its own slice back.
pub(crate) fn waiting<R>(slice: Duration, sync: impl FnOnce() -> R) -> R {
    let want = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX);
    if want == 0 || REFUSED.load(Ordering::Relaxed) {
        return sync();
    }
    let own = match get() {
        Some(a) if a.sched_policy == libc::SCHED_OTHER as u32 && a.sched_runtime > want => a,
        _ => return sync(),
    };
    let mut short = own;
    short.size = ATTR_SIZE;
    // Only reset-on-fork is a flag of the thread's own; the others ask for changes.
    short.sched_flags &= libc::SCHED_FLAG_RESET_ON_FORK as u64;
    short.sched_runtime = want;
    if !set(&short) {
        REFUSED.store(true, Ordering::Relaxed);
        tracing::debug!(
            error = %std::io::Error::last_os_error(),
            "the kernel refuses a short scheduler slice for commits' syncs"
        );
        return sync();
    }
    let out = sync();
    short.sched_runtime = own.sched_runtime;
    if !set(&short) {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "cannot give the committing thread its scheduler slice back"
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slice_is_short_during_the_sync_and_comes_back_after() {
        let Some(before) = get() else {
            return; // No sched_getattr here: nothing to check.
        };
        let seen = waiting(Duration::from_micros(100), || {
            get().map(|a| a.sched_runtime)
        });
        let after = get().expect("sched_getattr worked before");
        assert_eq!(after.sched_runtime, before.sched_runtime);
        assert_eq!(after.sched_nice, before.sched_nice);
        assert_eq!(after.sched_policy, before.sched_policy);
        if before.sched_policy == libc::SCHED_OTHER as u32
            && before.sched_runtime > 100_000
            && !REFUSED.load(Ordering::Relaxed)
        {
            // A kernel with custom slices reports the one set.
            assert!(seen == Some(100_000) || seen == Some(before.sched_runtime));
        }
    }

    #[test]
    fn zero_leaves_the_thread_alone() {
        let before = get().map(|a| a.sched_runtime);
        let seen = waiting(Duration::ZERO, || get().map(|a| a.sched_runtime));
        assert_eq!(seen, before);
    }
}
