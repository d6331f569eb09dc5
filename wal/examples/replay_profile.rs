//! Where a replay's time goes: writes a log of `KEEL_PROFILE_MIB` MiB (default 64) of
//! 1 KiB entries in appends of 256, then opens it (reading and checking every record)
//! `KEEL_PROFILE_ROUNDS` times (default 5) and prints the wall time per open and per entry.
//! `KEEL_PROFILE_THREADS` sets [`WalOptions::recovery_threads`] (default: its default).
//! For an instruction count of the open alone:
//! `valgrind --tool=callgrind --toggle-collect='keel_wal::wal::Wal::open' <binary>` with
//! `KEEL_PROFILE_ROUNDS=1` (the first, empty, open is negligible).
//!
//! Run: `cargo run --release -p keel-wal --example replay_profile`.

use std::time::{Duration, Instant};

use keel_wal::{Entry, Wal, WalOptions};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let mib = env("KEEL_PROFILE_MIB", 64);
    let rounds = env("KEEL_PROFILE_ROUNDS", 5).max(1);
    let open_opts = WalOptions {
        recovery_threads: env(
            "KEEL_PROFILE_THREADS",
            WalOptions::default().recovery_threads as u64,
        ) as usize,
        ..WalOptions::default()
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("wal");
    let entries = mib * (1 << 20) / 1048;
    {
        let wal = Wal::open(&path, WalOptions::default()).expect("open");
        let mut es: Vec<Entry> = (0..256)
            .map(|k| Entry {
                index: 0,
                term: 1,
                data: (0..1024).map(|b| (b * 31 + k * 7) as u8).collect(),
            })
            .collect();
        let mut next = 1u64;
        while next <= entries {
            for (k, e) in es.iter_mut().enumerate() {
                e.index = next + k as u64;
            }
            wal.append(&es, None, false).expect("append");
            next += es.len() as u64;
        }
        wal.sync().expect("sync");
    }
    let mut each = Vec::new();
    let mut held = 0;
    for _ in 0..rounds {
        let t = Instant::now();
        let wal = Wal::open(&path, open_opts.clone()).expect("reopen");
        each.push(t.elapsed());
        held = wal.last_index() - wal.first_index() + 1;
    }
    each.sort();
    let median: Duration = each[each.len() / 2];
    println!(
        "open of {mib} MiB ({held} entries), {rounds} rounds, {} recovery threads: median {:.2} ms, {:.1} ns per entry",
        open_opts.recovery_threads,
        median.as_secs_f64() * 1e3,
        median.as_secs_f64() * 1e9 / held as f64
    );
}
