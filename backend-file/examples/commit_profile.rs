//! A driver for profiling one workload of the file backend: `commits` durable commits of
//! 1 000 puts each (`KEEL_PUTS` sets how many) in keel's pattern (17-byte revision keys,
//! 1 KiB values), with the median, 10th and 90th percentile commit time and the committing
//! thread's CPU time per commit printed at the end.
//!
//! `cargo run --release -p keel-backend-file --example commit_profile -- [commits] [dir]`,
//! with `KEEL_PREPARE=off`, `allocate`, `zeros` or `auto` (the default) to change how
//! space is prepared ahead, and `KEEL_HOG=1` to keep a thread spinning on the CPU beside the
//! commits (as a long scan does); run it under `strace -c -f` or `perf record -g` to see
//! where a commit goes.

use std::time::Instant;

use keel_backend_file::{FileBackend, FileOptions, PrepareWith};
use keel_mvcc::{Backend, Bucket, WriteBatch};

fn main() {
    let mut args = std::env::args().skip(1);
    let commits: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(500);
    let tmp = tempfile_dir(args.next());
    let mut options = FileOptions::default();
    match std::env::var("KEEL_PREPARE").as_deref() {
        Ok("off") => options.prepare_ahead = false,
        Ok("allocate") => options.prepare_with = PrepareWith::Allocate,
        Ok("zeros") => options.prepare_with = PrepareWith::Zeros,
        Ok("auto") => options.prepare_with = PrepareWith::Auto,
        _ => {}
    }
    let puts: u64 = std::env::var("KEEL_PUTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hog = std::env::var("KEEL_HOG").is_ok_and(|v| v == "1").then(|| {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut x = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for i in 0..10_000u64 {
                    x = x.wrapping_mul(31).wrapping_add(i);
                }
                std::hint::black_box(x);
            }
        })
    });
    let backend = FileBackend::open(&tmp, &options).expect("open");
    let bucket = Bucket::new("key");
    let value = vec![0x5au8; 1024];
    let mut times = Vec::with_capacity(commits);
    let mut cpu = 0.0;
    for rev in 1..=commits as u64 {
        let mut batch = WriteBatch::new();
        for sub in 0..puts {
            let mut k = Vec::with_capacity(17);
            k.extend_from_slice(&rev.to_be_bytes());
            k.push(b'_');
            k.extend_from_slice(&sub.to_be_bytes());
            batch.put(&bucket, k, value.clone());
        }
        let t = Instant::now();
        let c = thread_cpu();
        backend.commit(&batch).expect("commit");
        cpu += thread_cpu() - c;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    let at = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
    println!(
        "{commits} commits: median {:.3} ms, p10 {:.3} ms, p90 {:.3} ms, max {:.3} ms; \
         committing thread's CPU {:.3} ms per commit",
        at(0.5),
        at(0.1),
        at(0.9),
        at(1.0),
        cpu * 1e3 / commits as f64
    );
    drop(backend);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    if let Some(h) = hog {
        h.join().expect("hog");
    }
    let _ = std::fs::remove_dir_all(&tmp);
}

fn tempfile_dir(arg: Option<String>) -> std::path::PathBuf {
    let dir = match arg {
        Some(d) => std::path::PathBuf::from(d),
        None => std::env::temp_dir().join(format!("keel-commit-profile-{}", std::process::id())),
    };
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// CPU seconds the calling thread has run (Linux: the first field of its schedstat).
fn thread_cpu() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |ns| ns * 1e-9)
}
