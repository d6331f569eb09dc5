//! Same-run ratios between keel and its reference.
//!
//! Criterion reports each benchmark on its own; keel's claims are ratios ("≥ 0.9× the raw
//! disk"), and on a shared machine only a ratio measured in one run means anything. So every
//! comparison times its closures through [`Recorder::iter`], which records the time per
//! element of every sample criterion takes, and then prints the ratio of medians with
//! [`Recorder::ratio`].

use std::collections::HashMap;
use std::time::{Duration, Instant};

use criterion::Bencher;
use parking_lot::Mutex;

/// Which direction of a ratio is good.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Better {
    /// A higher ratio of throughputs (reference time / keel time) is better.
    Faster,
    /// A lower ratio of times (keel time / reference time) is better.
    LowerTime,
}

/// Collects per-element sample times by name for one bench binary.
#[derive(Default)]
pub struct Recorder {
    samples: Mutex<HashMap<String, Vec<f64>>>,
}

impl Recorder {
    /// An empty recorder.
    pub fn new() -> Recorder {
        Recorder::default()
    }

    /// Runs `routine` the number of times criterion asks for, timing the whole run, and
    /// records the time per call under `name`. `routine` gets the call number.
    pub fn iter<F: FnMut(u64)>(&self, b: &mut Bencher<'_>, name: &str, mut routine: F) {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for i in 0..iters {
                routine(i);
            }
            let elapsed = start.elapsed();
            self.record(name, elapsed, iters);
            elapsed
        });
    }

    /// Records a sample measured elsewhere: `elapsed` for `iters` calls.
    pub fn record(&self, name: &str, elapsed: Duration, iters: u64) {
        if iters == 0 {
            return;
        }
        self.samples
            .lock()
            .entry(name.to_owned())
            .or_default()
            .push(elapsed.as_secs_f64() / iters as f64);
    }

    /// Median seconds per call recorded under `name`.
    pub fn median(&self, name: &str) -> Option<f64> {
        let samples = self.samples.lock();
        let mut v = samples.get(name)?.clone();
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }

    /// Prints (to stdout, for the bench log) and returns the ratio of `ours` to `reference`:
    /// reference time / our time for [`Better::Faster`], our time / reference time for
    /// [`Better::LowerTime`]. `goal` is the target the claim states, printed beside it.
    pub fn ratio(
        &self,
        claim: &str,
        ours: &str,
        reference: &str,
        better: Better,
        goal: Option<f64>,
    ) -> Option<f64> {
        let (o, r) = (self.median(ours)?, self.median(reference)?);
        let ratio = match better {
            Better::Faster => r / o,
            Better::LowerTime => o / r,
        };
        let smoke = std::env::args().any(|a| a == "--test");
        let verdict = match (goal, better) {
            _ if smoke => " (smoke run: one sample each, not a measurement)".to_owned(),
            (Some(g), Better::Faster) if ratio >= g => format!(" (goal >= {g:.2}x: met)"),
            (Some(g), Better::Faster) => format!(" (goal >= {g:.2}x: NOT met)"),
            (Some(g), Better::LowerTime) if ratio <= g => format!(" (goal <= {g:.2}x: met)"),
            (Some(g), Better::LowerTime) => format!(" (goal <= {g:.2}x: NOT met)"),
            (None, _) => String::new(),
        };
        let what = match better {
            Better::Faster => "throughput ratio",
            Better::LowerTime => "time ratio",
        };
        println!(
            "RATIO {claim}: {what} {ratio:.3}x  [{ours}: median {}, {reference}: median {}]{verdict}",
            per_call(o),
            per_call(r)
        );
        Some(ratio)
    }
}

/// A time per call in microseconds, or in nanoseconds below one microsecond (a transfer's
/// time per byte), to three decimals.
fn per_call(secs: f64) -> String {
    if secs < 1e-6 {
        format!("{:.3} ns", secs * 1e9)
    } else {
        format!("{:.3} us", secs * 1e6)
    }
}
