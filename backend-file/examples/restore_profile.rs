//! A driver for timing restores: a snapshot stream of `pairs` pairs of 1 KiB values, restored
//! into fresh stores in turn through the file backend's own restore (one sync at the end),
//! through the same from 1 MiB chunks (`restore_chunks`, as a snapshot transfer does), and
//! through keel-mvcc's generic restore (a durable commit every 8 MiB); prints each one's time,
//! and the CPU time of the restoring thread and of the whole process (Linux; the direct
//! writer's thread logs its own at debug level).
//!
//! `cargo run --release -p keel-backend-file --example restore_profile -- [pairs] [rounds] [ways]`
//!
//! `ways` is a comma-separated list of `own`, `chunks` and `generic` (default: all three), to
//! profile one of them alone.

use std::time::Instant;

use keel_backend_file::{FileBackend, FileOptions};
use keel_mvcc::{Backend, Bucket, WriteBatch};

fn main() {
    let mut args = std::env::args().skip(1);
    let pairs: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(48_000);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(3);
    let ways: Vec<String> = args
        .next()
        .unwrap_or_else(|| "own,chunks,generic".to_owned())
        .split(',')
        .map(str::to_owned)
        .collect();
    let root = std::env::temp_dir().join(format!("keel-restore-profile-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let bucket = Bucket::new("key");
    let stream = {
        let source =
            FileBackend::open(&root.join("source"), &FileOptions::default()).expect("open source");
        let mut batch = WriteBatch::new();
        for i in 0..pairs {
            batch.put(
                &bucket,
                i.to_be_bytes().to_vec(),
                vec![(i % 251) as u8; 1024],
            );
            if batch.len() == 1000 {
                source.commit(&batch).expect("commit");
                batch.clear();
            }
        }
        source.commit(&batch).expect("commit");
        let mut out = Vec::new();
        source.snapshot(&mut out).expect("snapshot");
        out
    };
    println!("stream of {} bytes", stream.len());
    for round in 0..rounds {
        for how in ["own    ", "chunks ", "generic"] {
            if !ways.iter().any(|w| w == how.trim()) {
                continue;
            }
            let dir = root.join(format!("target-{round}-{}", how.trim()));
            let target = FileBackend::open(&dir, &FileOptions::default()).expect("open target");
            let chunks: Vec<Vec<u8>> = stream.chunks(1 << 20).map(<[u8]>::to_vec).collect();
            let (thread0, process0) = (thread_cpu_ms(), process_cpu_ms());
            let t = Instant::now();
            let n = match how {
                "generic" => keel_mvcc::backend::snapshot::restore(&target, &mut stream.as_slice()),
                "chunks " => {
                    target.restore_chunks(&mut Chunks(chunks.into_iter()), &mut |_, _, _| {})
                }
                _ => target.restore(&mut stream.as_slice()),
            }
            .expect("restore");
            let took = t.elapsed();
            assert_eq!(n, pairs);
            println!(
                "round {round}: {how} restore {:.1} ms, restoring thread {:.0} ms CPU, process {:.0} ms CPU",
                took.as_secs_f64() * 1e3,
                thread_cpu_ms() - thread0,
                process_cpu_ms() - process0,
            );
            drop(target);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

/// Hands out owned chunks.
struct Chunks(std::vec::IntoIter<Vec<u8>>);

impl keel_mvcc::backend::ChunkSource for Chunks {
    fn next_chunk(&mut self) -> Option<Vec<u8>> {
        self.0.next()
    }
}

/// CPU time of the calling thread in milliseconds (schedstat; 0 where unreadable).
fn thread_cpu_ms() -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |ns| ns / 1e6)
}

/// CPU time of the whole process in milliseconds (user + system, 10 ms ticks).
fn process_cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) * 10.0
}
