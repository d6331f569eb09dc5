//! [`RateLimiter`]: a token bucket for snapshot bytes, shared by every transfer that should
//! count against one budget (the TCP transport's snapshot connections, or the in-memory path
//! calling [`RateLimiter::acquire`] before each chunk).

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// A token bucket: `rate` bytes per second on average, bursts of up to `burst` bytes.
///
/// A request larger than the tokens available is granted at once and puts the bucket into
/// debt; the caller waits until the debt is paid back. The long-run rate is therefore exact
/// whatever the request sizes. A rate of 0 means unlimited.
#[derive(Debug)]
pub struct RateLimiter {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    rate: u64,
    burst: u64,
    tokens: f64,
    last: Instant,
}

impl RateLimiter {
    /// A limiter of `bytes_per_sec` (0: unlimited) with a bucket of `burst` bytes, full.
    pub fn new(bytes_per_sec: u64, burst: u64) -> RateLimiter {
        RateLimiter {
            state: Mutex::new(State {
                rate: bytes_per_sec,
                burst,
                tokens: burst as f64,
                last: Instant::now(),
            }),
        }
    }

    /// A limiter that never waits.
    pub fn unlimited() -> RateLimiter {
        RateLimiter::new(0, 0)
    }

    /// The configured rate in bytes per second (0: unlimited).
    pub fn rate(&self) -> u64 {
        self.state.lock().rate
    }

    /// Changes the rate (0: unlimited) from now on; a current debt is kept.
    pub fn set_rate(&self, bytes_per_sec: u64) {
        let mut s = self.state.lock();
        s.refill(Instant::now());
        s.rate = bytes_per_sec;
    }

    /// Takes `n` bytes' worth of tokens at `now` and returns how long the caller must wait
    /// before sending them.
    pub fn reserve_at(&self, n: u64, now: Instant) -> Duration {
        let mut s = self.state.lock();
        if s.rate == 0 {
            return Duration::ZERO;
        }
        s.refill(now);
        s.tokens -= n as f64;
        if s.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-s.tokens / s.rate as f64)
        }
    }

    /// Takes `n` bytes' worth of tokens and sleeps until they may be sent.
    pub fn acquire(&self, n: u64) {
        let wait = self.reserve_at(n, Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
    }
}

impl State {
    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = self.last.max(now);
        self.tokens = (self.tokens + elapsed * self.rate as f64).min(self.burst as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_arithmetic_is_exact() {
        let l = RateLimiter::new(1000, 500);
        let t0 = Instant::now();
        assert_eq!(l.reserve_at(500, t0), Duration::ZERO, "the burst is free");
        assert_eq!(
            l.reserve_at(1000, t0),
            Duration::from_secs(1),
            "then 1000 B at 1000 B/s"
        );
        // one second later the debt is paid; the next 250 B wait a quarter second
        let w = l.reserve_at(250, t0 + Duration::from_secs(1));
        assert!((w.as_secs_f64() - 0.25).abs() < 1e-9, "{w:?}");
        // a long idle refills only up to the burst
        let t = t0 + Duration::from_secs(100);
        assert_eq!(l.reserve_at(500, t), Duration::ZERO);
        assert!(l.reserve_at(1, t) > Duration::ZERO);
    }

    #[test]
    fn unlimited_and_rate_changes() {
        let l = RateLimiter::unlimited();
        assert_eq!(l.reserve_at(u64::MAX, Instant::now()), Duration::ZERO);
        l.set_rate(100);
        assert_eq!(l.rate(), 100);
        assert!(l.reserve_at(100, Instant::now()) >= Duration::from_millis(990));
    }

    #[test]
    fn acquire_sleeps_at_the_rate() {
        let l = RateLimiter::new(1_000_000, 0);
        let start = Instant::now();
        for _ in 0..10 {
            l.acquire(10_000);
        }
        let e = start.elapsed();
        assert!(
            e >= Duration::from_millis(95),
            "100 kB at 1 MB/s took {e:?}"
        );
        assert!(e < Duration::from_secs(2), "{e:?}");
    }
}
