//! [`RateLimiter`]: a token bucket for snapshot bytes, shared by every transfer that should
//! count against one budget (the TCP transport's snapshot connections, or the in-memory path
//! calling [`RateLimiter::acquire_unless`] before each chunk).

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// The longest a waiting caller sleeps at a time (see [`RateLimiter::acquire_unless`]):
/// between two sleeps it asks whether it should stop, and takes up a shorter wait when a
/// reservation ahead of it was given back or the rate was changed.
pub const WAIT_SLICE: Duration = Duration::from_millis(10);

/// A token bucket: `rate` bytes per second on average, bursts of up to `burst` bytes.
///
/// A request larger than the tokens available is granted at once and puts the bucket into
/// debt; the caller waits until the debt is paid back. The long-run rate is therefore exact
/// whatever the request sizes. A rate of 0 means unlimited.
///
/// A caller that must wait holds a [`Reservation`]: it may be given back before its bytes
/// are sent (a transfer stopped while it waited), and the bucket then holds what it would
/// hold had those bytes never been reserved, so the callers waiting behind them, and the
/// next ones, do not wait for bytes that are never sent.
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
    /// Reservations not granted yet, oldest first.
    waiting: Vec<Waiting>,
    next_ticket: u64,
}

/// A reservation whose bytes may not be sent yet.
#[derive(Debug)]
struct Waiting {
    ticket: u64,
    /// The bytes reserved.
    bytes: f64,
    /// What giving the reservation back adds to the bucket: its bytes, less the tokens the
    /// bucket could not have held above its burst, had they not been reserved, since.
    refund: f64,
}

/// Bytes taken from a [`RateLimiter`] that may not be sent yet: made by
/// [`RateLimiter::reserve_at`], waited for with [`Reservation::wait_at`] until it is granted,
/// or given back with [`Reservation::give_back_at`]. One dropped before it was granted is
/// given back.
#[derive(Debug)]
#[must_use = "a reservation dropped before it is granted is given back"]
pub struct Reservation<'a> {
    limiter: &'a RateLimiter,
    /// `None` once granted (or when it was granted at once).
    ticket: Option<u64>,
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
                waiting: Vec::new(),
                next_ticket: 0,
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

    /// Changes the rate (0: unlimited) from now on; a current debt is kept, and the
    /// reservations waiting are paid back at the new rate.
    pub fn set_rate(&self, bytes_per_sec: u64) {
        let mut s = self.state.lock();
        s.refill(Instant::now());
        s.rate = bytes_per_sec;
    }

    /// Takes `n` bytes' worth of tokens at `now`. The reservation is granted at once when
    /// the bucket holds them (or the rate is unlimited); otherwise the bucket goes into debt
    /// and [`Reservation::wait_at`] says how long the caller must wait before sending them.
    pub fn reserve_at(&self, n: u64, now: Instant) -> Reservation<'_> {
        let mut s = self.state.lock();
        let mut ticket = None;
        if s.rate != 0 {
            s.refill(now);
            s.tokens -= n as f64;
            if s.tokens < 0.0 {
                let t = s.next_ticket;
                s.next_ticket += 1;
                s.waiting.push(Waiting {
                    ticket: t,
                    bytes: n as f64,
                    refund: n as f64,
                });
                ticket = Some(t);
            }
        }
        Reservation {
            limiter: self,
            ticket,
        }
    }

    /// Takes `n` bytes' worth of tokens and sleeps until they may be sent.
    pub fn acquire(&self, n: u64) {
        self.acquire_unless(n, || false);
    }

    /// Takes `n` bytes' worth of tokens and sleeps until they may be sent, in slices of at
    /// most [`WAIT_SLICE`], calling `stop` after each: when it returns true, the
    /// reservation is given back ([`Reservation::give_back_at`]) and `false` returned.
    /// Returns `true` once the bytes may be sent (at once when no wait is needed, without
    /// calling `stop`).
    pub fn acquire_unless(&self, n: u64, mut stop: impl FnMut() -> bool) -> bool {
        let mut reservation = self.reserve_at(n, Instant::now());
        if !reservation.wait_unless(&mut stop) {
            reservation.give_back_at(Instant::now());
            return false;
        }
        reservation.grant()
    }
}

impl Reservation<'_> {
    /// How long, from `now`, the caller must still wait before sending the reserved bytes;
    /// zero once they may be sent, and the reservation is then granted (a later
    /// [`give_back_at`](Self::give_back_at) returns nothing). The wait shortens when a
    /// reservation made before this one is given back, and follows changes of the rate.
    pub fn wait_at(&mut self, now: Instant) -> Duration {
        self.wait(now, true)
    }

    /// How long, from `now`, the caller must still wait before sending the reserved bytes,
    /// as [`wait_at`](Self::wait_at) says, but without granting the reservation once the
    /// wait is over: until [`grant`](Self::grant), it can still be given back in full (its
    /// sender waits for something else too, and may be stopped meanwhile).
    pub fn due_in(&mut self, now: Instant) -> Duration {
        self.wait(now, false)
    }

    /// The wait from `now`; once it is over, the reservation is granted if `grant`.
    fn wait(&mut self, now: Instant, grant: bool) -> Duration {
        let Some(ticket) = self.ticket else {
            return Duration::ZERO;
        };
        let mut s = self.limiter.state.lock();
        s.refill(now);
        let Some(at) = s.waiting.iter().position(|w| w.ticket == ticket) else {
            self.ticket = None;
            return Duration::ZERO;
        };
        // This reservation is paid back once the debt is down to what was reserved after it.
        let behind: f64 = s.waiting[at + 1..].iter().map(|w| w.bytes).sum();
        let debt = -(s.tokens + behind);
        if s.rate == 0 || debt <= 0.0 {
            if grant {
                s.waiting.remove(at);
                self.ticket = None;
            }
            return Duration::ZERO;
        }
        Duration::try_from_secs_f64(debt / s.rate as f64).unwrap_or(Duration::MAX)
    }

    /// Sleeps until the reserved bytes may be sent ([`due_in`](Self::due_in) is zero), in
    /// slices of at most [`WAIT_SLICE`], calling `stop` after each; returns `false` as soon
    /// as it returns true. Either way the reservation is not granted: the caller sends and
    /// calls [`grant`](Self::grant), or gives it back (dropping it does).
    pub fn wait_unless(&mut self, stop: &mut dyn FnMut() -> bool) -> bool {
        loop {
            let wait = self.due_in(Instant::now());
            if wait.is_zero() {
                return true;
            }
            std::thread::sleep(wait.min(WAIT_SLICE));
            if stop() {
                return false;
            }
        }
    }

    /// Grants the reservation if its wait is over ([`due_in`](Self::due_in) is zero):
    /// its bytes are sent and can no longer be given back. Returns whether it is granted;
    /// one whose wait is not over still waits, and is given back when dropped.
    pub fn grant(&mut self) -> bool {
        self.wait(Instant::now(), true).is_zero()
    }

    /// Gives the reservation back at `now`, its bytes not to be sent: the bucket then holds
    /// what it would hold had they never been reserved (never more than its burst), so the
    /// reservations made after it are granted that much sooner. Nothing happens to one
    /// already granted.
    pub fn give_back_at(mut self, now: Instant) {
        self.give_back(now);
    }

    fn give_back(&mut self, now: Instant) {
        let Some(ticket) = self.ticket.take() else {
            return;
        };
        let mut s = self.limiter.state.lock();
        s.refill(now);
        let Some(at) = s.waiting.iter().position(|w| w.ticket == ticket) else {
            return;
        };
        let w = s.waiting.remove(at);
        s.tokens = (s.tokens + w.refund).min(s.burst as f64);
        s.cap_refunds();
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.give_back(Instant::now());
    }
}

impl State {
    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = self.last.max(now);
        self.tokens = (self.tokens + elapsed * self.rate as f64).min(self.burst as f64);
        self.cap_refunds();
    }

    /// Without a waiting reservation's bytes the bucket would hold `tokens + refund`, but
    /// never more than the burst: the tokens above it are lost for the refund too. (The
    /// tokens only grow by refills, each followed by this call, so the cap is kept exactly.)
    fn cap_refunds(&mut self) {
        let room = self.burst as f64 - self.tokens;
        for w in &mut self.waiting {
            w.refund = w.refund.min(room);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reserves `n` bytes at `at` and returns the wait; the reservation is neither waited
    /// for nor given back, as by a caller that sleeps the wait and sends.
    fn take(l: &RateLimiter, n: u64, at: Instant) -> Duration {
        let mut r = l.reserve_at(n, at);
        let wait = r.wait_at(at);
        std::mem::forget(r);
        wait
    }

    fn secs(d: Duration) -> f64 {
        d.as_secs_f64()
    }

    #[test]
    fn bucket_arithmetic_is_exact() {
        let l = RateLimiter::new(1000, 500);
        let t0 = Instant::now();
        assert_eq!(take(&l, 500, t0), Duration::ZERO, "the burst is free");
        assert_eq!(
            take(&l, 1000, t0),
            Duration::from_secs(1),
            "then 1000 B at 1000 B/s"
        );
        // one second later the debt is paid; the next 250 B wait a quarter second
        let w = take(&l, 250, t0 + Duration::from_secs(1));
        assert!((secs(w) - 0.25).abs() < 1e-9, "{w:?}");
        // a long idle refills only up to the burst
        let t = t0 + Duration::from_secs(100);
        assert_eq!(take(&l, 500, t), Duration::ZERO);
        assert!(take(&l, 1, t) > Duration::ZERO);
    }

    #[test]
    fn unlimited_and_rate_changes() {
        let l = RateLimiter::unlimited();
        assert_eq!(take(&l, u64::MAX, Instant::now()), Duration::ZERO);
        l.set_rate(100);
        assert_eq!(l.rate(), 100);
        assert!(take(&l, 100, Instant::now()) >= Duration::from_millis(990));
    }

    /// A waiting reservation follows the rate: doubled, its wait halves; made unlimited, it
    /// is granted.
    #[test]
    fn a_waiting_reservation_follows_rate_changes() {
        let l = RateLimiter::new(1000, 0);
        let t0 = Instant::now();
        let mut r = l.reserve_at(1000, t0);
        assert_eq!(r.wait_at(t0), Duration::from_secs(1));
        l.set_rate(2000);
        let w = r.wait_at(t0);
        assert!(w <= Duration::from_millis(500), "{w:?}");
        l.set_rate(0);
        assert_eq!(r.wait_at(t0), Duration::ZERO);
    }

    /// A reservation given back before it is granted leaves the bucket as it would be had
    /// it never been made: the one waiting behind it, and the next, are granted that much
    /// sooner; the bucket never holds more than its burst; one granted gives nothing back.
    #[test]
    fn a_reservation_given_back_returns_what_it_did_not_use() {
        let l = RateLimiter::new(1000, 500);
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(take(&l, 500, t0), Duration::ZERO, "the burst is spent");
        let mut a = l.reserve_at(1000, t0);
        let mut b = l.reserve_at(250, t0);
        assert_eq!(a.wait_at(t0), ms(1000));
        assert_eq!(b.wait_at(t0), ms(1250), "b waits behind a");
        // Half a second on, a gives its 1000 B back: b's 250 B are paid, as they would be
        // had a never reserved (250 B owed at t0, 500 B refilled since).
        a.give_back_at(t0 + ms(500));
        assert_eq!(b.wait_at(t0 + ms(500)), Duration::ZERO, "b is granted");
        // The bucket holds the 250 B left: 500 B more wait a quarter second, no longer.
        let w = take(&l, 500, t0 + ms(500));
        assert!((secs(w) - 0.25).abs() < 1e-9, "{w:?}");

        // A refund never fills the bucket past its burst, even counting the refill of the
        // time the reservation waited: 1500 B reserved from a full bucket of 500 B, given
        // back 0.8 s later (200 B still owed), leave 500 B, not 1300 B.
        let l = RateLimiter::new(1000, 500);
        let t0 = Instant::now();
        let a = l.reserve_at(1500, t0);
        a.give_back_at(t0 + ms(800));
        assert_eq!(take(&l, 500, t0 + ms(800)), Duration::ZERO);
        let w = take(&l, 100, t0 + ms(800));
        assert!((secs(w) - 0.1).abs() < 1e-9, "{w:?}");

        // Tokens the bucket could not have held meanwhile are not refunded either: with
        // 1500 B reserved from a full bucket, a second reservation made when the bucket
        // would have been full without the first is charged against an empty one.
        let l = RateLimiter::new(1000, 500);
        let t0 = Instant::now();
        let a = l.reserve_at(1500, t0);
        // At 0.8 s the bucket owes 200 B; without a it would hold 500 B (capped).
        let mut c = l.reserve_at(300, t0 + ms(800));
        assert_eq!(c.wait_at(t0 + ms(800)), ms(500));
        a.give_back_at(t0 + ms(800));
        // As if a had never been: 500 B, less c's 300 B.
        assert_eq!(c.wait_at(t0 + ms(800)), Duration::ZERO);
        assert_eq!(take(&l, 200, t0 + ms(800)), Duration::ZERO);
        assert!(take(&l, 1, t0 + ms(800)) > Duration::ZERO);

        // A granted reservation gives nothing back; nor does one granted at once.
        let l = RateLimiter::new(1000, 0);
        let t0 = Instant::now();
        let mut a = l.reserve_at(1000, t0);
        assert_eq!(a.wait_at(t0 + ms(1000)), Duration::ZERO);
        a.give_back_at(t0 + ms(1000));
        assert_eq!(take(&l, 1000, t0 + ms(1000)), ms(1000));
        let l = RateLimiter::new(1000, 1000);
        let t0 = Instant::now();
        l.reserve_at(1000, t0).give_back_at(t0);
        assert_eq!(take(&l, 1, t0), ms(1));
    }

    /// A caller that stops while it waits returns at once, its reservation given back.
    #[test]
    fn acquire_unless_stops_and_gives_back() {
        let l = RateLimiter::new(1000, 0);
        let start = Instant::now();
        let mut asked = 0;
        let granted = l.acquire_unless(10_000, || {
            asked += 1;
            asked == 3
        });
        assert!(!granted);
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "{:?}",
            start.elapsed()
        );
        // The 10 kB are back: 10 B wait about 10 ms, not 10 s.
        let w = take(&l, 10, Instant::now());
        assert!(w <= Duration::from_millis(10), "{w:?}");
        // No wait: granted without asking.
        let l = RateLimiter::new(1000, 1000);
        assert!(l.acquire_unless(1000, || panic!("asked")));
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
