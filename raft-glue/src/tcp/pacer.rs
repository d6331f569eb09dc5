//! Adaptive snapshot pacing keyed to the leader's replication latency.
//!
//! A snapshot stream competes with the write path for CPU and, above all, for the disk: the
//! receiver writes the whole backend while the members sync their logs. The pacer watches
//! the round trip of the leader's appends (an append carrying entries sent to a peer, until
//! that peer's success response covers its last index: the peer's log sync included), which
//! tracks the commit latency clients see.
//!
//! - While no snapshot is streaming, the last [`BASELINE_SAMPLES`] round trips make the
//!   baseline: their 95th percentile, what the write path sees when nothing competes.
//! - While one streams, every [`WINDOW`] the worst round trip of the window is compared with
//!   [`SLOWDOWN`] × the baseline (plus [`SLACK`]): above it, the stream's rate is cut to
//!   [`BACKOFF`] of itself (of the rate actually achieved in the window when it was unpaced
//!   or slower than its pace), never below
//!   [`MIN_RATE`]; at or below it, the rate grows by a quarter, and past [`MAX_RATE`] the
//!   stream is unpaced again. A window without samples (no client writes) changes nothing.
//! - A new transfer starts at the last rate that kept the latency in bounds.
//!
//! So a transfer runs at full speed while the write path does not suffer, and backs off
//! within one window when it does. A rate set by hand ([`TcpOptions::snapshot_rate`]) still
//! applies on top.
//!
//! [`TcpOptions::snapshot_rate`]: super::TcpOptions::snapshot_rate

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::RateLimiter;
use super::limiter::Reservation;

/// How often the rate is reconsidered while a snapshot streams.
pub const WINDOW: Duration = Duration::from_millis(50);
/// The worst round trip of a window may be this many times the baseline.
pub const SLOWDOWN: f64 = 1.5;
/// ... plus this much, so a sub-millisecond baseline does not make noise look like harm.
pub const SLACK: Duration = Duration::from_millis(2);
/// What is left of the rate after a slow window.
pub const BACKOFF: f64 = 0.5;
/// The pacer never slows a stream below this many bytes per second.
pub const MIN_RATE: u64 = 32 << 20;
/// Above this many bytes per second the stream is unpaced.
pub const MAX_RATE: u64 = 2 << 30;
/// A stream counts as running for this long after its last chunk.
const STREAM_GAP: Duration = Duration::from_millis(200);
/// Appends remembered per peer.
const PENDING: usize = 256;
/// Round trips the baseline is taken from.
pub const BASELINE_SAMPLES: usize = 512;

/// The pacer of one transport.
#[derive(Debug)]
pub struct Pacer {
    state: Mutex<State>,
    limiter: RateLimiter,
}

#[derive(Debug)]
struct State {
    /// Appends in flight per peer: `(last index, sent)`.
    pending: HashMap<u64, VecDeque<(u64, Instant)>>,
    /// The last round trips while no snapshot streamed.
    idle: VecDeque<Duration>,
    /// When the last chunk went out.
    last_chunk: Option<Instant>,
    window_start: Instant,
    window_bytes: u64,
    window_worst: Option<Duration>,
    /// Current rate; 0 = unpaced.
    rate: u64,
    /// The last rate that kept the latency in bounds, for the next transfer.
    good_rate: u64,
}

impl Default for Pacer {
    fn default() -> Self {
        Pacer::new()
    }
}

impl Pacer {
    /// A pacer with no history: unpaced until it learns a baseline and sees harm.
    pub fn new() -> Pacer {
        Pacer {
            state: Mutex::new(State {
                pending: HashMap::new(),
                idle: VecDeque::with_capacity(BASELINE_SAMPLES),
                last_chunk: None,
                window_start: Instant::now(),
                window_bytes: 0,
                window_worst: None,
                rate: 0,
                good_rate: 0,
            }),
            limiter: RateLimiter::new(0, 1 << 20),
        }
    }

    /// An append whose last entry is `index` was sent to `to`.
    pub fn append_sent(&self, to: u64, index: u64, now: Instant) {
        let mut s = self.state.lock();
        let q = s.pending.entry(to).or_default();
        if q.len() == PENDING {
            q.pop_front();
        }
        q.push_back((index, now));
    }

    /// `from` acknowledged its log up to `index`.
    pub fn append_acked(&self, from: u64, index: u64, now: Instant) {
        let mut s = self.state.lock();
        let Some(q) = s.pending.get_mut(&from) else {
            return;
        };
        let mut oldest = None;
        while let Some(&(i, sent)) = q.front() {
            if i > index {
                break;
            }
            oldest.get_or_insert(sent);
            q.pop_front();
        }
        let Some(sent) = oldest else {
            return;
        };
        let rtt = now.saturating_duration_since(sent);
        s.sample(rtt, now);
    }

    /// The current rate in bytes per second; 0 = unpaced.
    pub fn rate(&self) -> u64 {
        self.state.lock().rate
    }

    /// Paces a chunk of `n` bytes: updates the rate, then reserves the chunk's bytes at it.
    /// The caller waits on the reservation ([`Reservation::wait_unless`]) before sending
    /// the chunk, then grants it; one dropped before it was granted (the transfer was
    /// cancelled while it waited) is given back.
    pub fn chunk(&self, n: u64) -> Reservation<'_> {
        let now = Instant::now();
        let rate = self.state.lock().chunk(n, now);
        if rate != self.limiter.rate() {
            self.limiter.set_rate(rate);
        }
        self.limiter.reserve_at(n, now)
    }
}

impl State {
    fn streaming(&self, now: Instant) -> bool {
        self.last_chunk
            .is_some_and(|t| now.saturating_duration_since(t) < STREAM_GAP)
    }

    fn sample(&mut self, rtt: Duration, now: Instant) {
        if self.streaming(now) {
            self.window_worst = Some(self.window_worst.map_or(rtt, |w| w.max(rtt)));
        } else {
            if self.idle.len() == BASELINE_SAMPLES {
                self.idle.pop_front();
            }
            self.idle.push_back(rtt);
        }
    }

    /// The 95th percentile of the idle round trips, once there are a few.
    fn baseline(&self) -> Option<Duration> {
        if self.idle.len() < 8 {
            return None;
        }
        let mut v: Vec<Duration> = self.idle.iter().copied().collect();
        v.sort_unstable();
        Some(v[(v.len() * 95 / 100).min(v.len() - 1)])
    }

    /// Takes a chunk of `n` bytes into the current window; returns the rate to send it at.
    fn chunk(&mut self, n: u64, now: Instant) -> u64 {
        if !self.streaming(now) {
            // A new transfer: start from what last worked.
            self.rate = self.good_rate;
            self.window_start = now;
            self.window_bytes = 0;
            self.window_worst = None;
        }
        self.last_chunk = Some(now);
        let elapsed = now.saturating_duration_since(self.window_start);
        if elapsed >= WINDOW {
            if let (Some(worst), Some(base)) = (self.window_worst, self.baseline()) {
                let limit = base.mul_f64(SLOWDOWN) + SLACK;
                if worst > limit {
                    let achieved = (self.window_bytes as f64 / elapsed.as_secs_f64()) as u64;
                    let from = if self.rate == 0 {
                        achieved
                    } else {
                        self.rate.min(achieved.max(MIN_RATE))
                    };
                    self.rate = ((from as f64 * BACKOFF) as u64).max(MIN_RATE);
                } else {
                    if self.rate != 0 {
                        self.rate += self.rate / 4;
                        if self.rate > MAX_RATE {
                            self.rate = 0;
                        }
                    }
                    self.good_rate = self.rate;
                }
            }
            self.window_start = now;
            self.window_bytes = 0;
            self.window_worst = None;
        }
        self.window_bytes += n;
        self.rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// The baseline is learnt while idle; a stream that slows appends past the bound is
    /// slowed, one that does not grows back to unpaced; a new transfer starts at the last
    /// good rate.
    #[test]
    fn backs_off_on_slow_appends_and_recovers() {
        let p = Pacer::new();
        let mut s = p.state.lock();
        let t0 = Instant::now();
        // Idle: round trips of 2 ms make the baseline.
        for i in 0..50u64 {
            let t = t0 + ms(i);
            drop(s);
            p.append_sent(2, i + 1, t);
            p.append_acked(2, i + 1, t + ms(2));
            s = p.state.lock();
        }
        assert_eq!(s.baseline(), Some(ms(2)));
        // A stream starts unpaced: 10 MB in the first window, appends at 20 ms.
        let mut t = t0 + ms(1000);
        assert_eq!(s.chunk(1 << 20, t), 0);
        for _ in 0..9 {
            t += ms(5);
            assert_eq!(s.chunk(1 << 20, t), 0);
        }
        s.sample(ms(40), t);
        t += ms(10);
        let r = s.chunk(1 << 20, t);
        assert!(r > 0, "paced after a slow window");
        assert!(r >= MIN_RATE);
        // 10 MiB in 55 ms is ~190 MB/s; half of it.
        assert!(r < 100 << 20 && r > 85 << 20, "{r}");
        // Slow again: slowed again, not below the floor.
        s.sample(ms(40), t + ms(1));
        let r2 = s.chunk(1 << 20, t + ms(60));
        assert!(r2 < r && r2 >= MIN_RATE, "{r2}");
        // Fast windows: grows by a quarter each.
        s.sample(ms(3), t + ms(61));
        let r3 = s.chunk(1 << 20, t + ms(120));
        assert_eq!(r3, r2 + r2 / 4);
        // A window without samples changes nothing.
        let r4 = s.chunk(1 << 20, t + ms(180));
        assert_eq!(r4, r3);
        // After a pause a new transfer starts at the last good rate.
        let r5 = s.chunk(1 << 20, t + ms(1000));
        assert_eq!(r5, r3);
    }

    #[test]
    fn acks_match_the_oldest_covered_append() {
        let p = Pacer::new();
        let t0 = Instant::now();
        p.append_sent(3, 10, t0);
        p.append_sent(3, 11, t0 + ms(1));
        p.append_sent(3, 12, t0 + ms(2));
        p.append_acked(3, 11, t0 + ms(5));
        let s = p.state.lock();
        assert_eq!(s.idle, [ms(5)], "the oldest covered append");
        assert_eq!(s.pending.get(&3).map(VecDeque::len), Some(1));
    }
}
