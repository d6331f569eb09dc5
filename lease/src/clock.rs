//! Where the lessor gets the time from.
//!
//! Lease deadlines are computed from a [`Clock`], never from the system clock directly, so
//! that tests advance time by hand ([`ManualClock`]) instead of sleeping. Production code uses
//! [`SystemClock`], a monotonic clock that never jumps backwards when the wall clock is set.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic clock: the time elapsed since an arbitrary fixed origin.
///
/// Implementations must never go backwards: two successive calls on any threads return
/// non-decreasing values. Only differences between readings of the same clock mean anything.
pub trait Clock: Send + Sync + 'static {
    /// The time elapsed since the clock's origin.
    fn now(&self) -> Duration;
}

/// The process's monotonic clock ([`Instant`]), with its origin at construction.
#[derive(Clone, Copy, Debug)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    /// A clock whose origin is now.
    pub fn new() -> SystemClock {
        SystemClock {
            origin: Instant::now(),
        }
    }
}

impl Default for SystemClock {
    fn default() -> SystemClock {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
}

/// A clock that only moves when told to: tests share one (in an `Arc`) with the lessor and
/// call [`advance`](ManualClock::advance).
#[derive(Debug, Default)]
pub struct ManualClock {
    nanos: AtomicU64,
}

impl ManualClock {
    /// A clock reading zero.
    pub fn new() -> ManualClock {
        ManualClock::default()
    }

    /// Moves the clock forward by `by` (saturating at about 584 years).
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        let mut current = self.nanos.load(Ordering::Acquire);
        loop {
            let next = current.saturating_add(by);
            match self.nanos.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(seen) => current = seen,
            }
        }
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Ordering::Acquire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_advanced() {
        let clock = ManualClock::new();
        assert_eq!(clock.now(), Duration::ZERO);
        clock.advance(Duration::from_millis(1500));
        assert_eq!(clock.now(), Duration::from_millis(1500));
        clock.advance(Duration::MAX);
        assert_eq!(clock.now(), Duration::from_nanos(u64::MAX));
    }

    #[test]
    fn system_clock_is_monotonic() {
        let clock = SystemClock::new();
        let a = clock.now();
        let b = clock.now();
        assert!(b >= a);
    }
}
