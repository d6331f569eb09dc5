//! [`TransferProgress`]: what member status shows of a snapshot transfer to a learner —
//! bytes sent, rate, estimated time left.

use std::time::{Duration, Instant};

/// Progress of one snapshot transfer, fed by the sender after each chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferProgress {
    /// The receiving member.
    pub to: u64,
    /// The expected stream length (the backend's size when the transfer started), if known.
    pub expected: Option<u64>,
    /// Bytes sent so far.
    pub sent: u64,
    /// When the transfer started.
    pub started: Instant,
    /// When the last chunk was sent.
    pub last: Instant,
    /// Set when the receiver acknowledged the whole stream.
    pub done: bool,
}

impl TransferProgress {
    /// A transfer to `to` starting at `now`.
    pub fn new(to: u64, expected: Option<u64>, now: Instant) -> TransferProgress {
        TransferProgress {
            to,
            expected,
            sent: 0,
            started: now,
            last: now,
            done: false,
        }
    }

    /// Records `bytes` more sent at `now`.
    pub fn record(&mut self, bytes: u64, now: Instant) {
        self.sent = self.sent.saturating_add(bytes);
        self.last = self.last.max(now);
    }

    /// Average rate since the start, in bytes per second (0 before any time has passed).
    pub fn rate(&self) -> u64 {
        let secs = self
            .last
            .saturating_duration_since(self.started)
            .as_secs_f64();
        if secs <= 0.0 {
            0
        } else {
            (self.sent as f64 / secs) as u64
        }
    }

    /// Estimated time left at the average rate; `None` when the length or the rate is not
    /// known yet. Zero once done or once the expected length has been sent.
    pub fn eta(&self) -> Option<Duration> {
        if self.done {
            return Some(Duration::ZERO);
        }
        let expected = self.expected?;
        let left = expected.saturating_sub(self.sent);
        if left == 0 {
            return Some(Duration::ZERO);
        }
        let rate = self.rate();
        (rate > 0).then(|| Duration::from_secs_f64(left as f64 / rate as f64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_and_eta_follow_the_bytes_sent() {
        let t0 = Instant::now();
        let mut p = TransferProgress::new(4, Some(10_000_000), t0);
        assert_eq!((p.rate(), p.eta()), (0, None));
        p.record(2_000_000, t0 + Duration::from_secs(1));
        p.record(2_000_000, t0 + Duration::from_secs(2));
        assert_eq!(p.rate(), 2_000_000);
        assert_eq!(p.eta(), Some(Duration::from_secs(3)));
        p.record(6_000_000, t0 + Duration::from_secs(3));
        assert_eq!(p.eta(), Some(Duration::ZERO));
        let mut q = TransferProgress::new(4, None, t0);
        q.record(1, t0 + Duration::from_secs(1));
        assert_eq!(q.eta(), None, "unknown length");
        q.done = true;
        assert_eq!(q.eta(), Some(Duration::ZERO));
    }
}
