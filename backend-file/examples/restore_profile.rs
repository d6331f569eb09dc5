//! A driver for timing restores: a snapshot stream of `pairs` pairs of 1 KiB values, restored
//! into fresh stores in turn through the file backend's own restore (one sync at the end) and
//! through keel-mvcc's generic restore (a durable commit every 8 MiB); prints each time.
//!
//! `cargo run --release -p keel-backend-file --example restore_profile -- [pairs] [rounds]`

use std::time::Instant;

use keel_backend_file::{FileBackend, FileOptions};
use keel_mvcc::{Backend, Bucket, WriteBatch};

fn main() {
    let mut args = std::env::args().skip(1);
    let pairs: u64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(48_000);
    let rounds: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(3);
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
        for generic in [false, true] {
            let dir = root.join(format!("target-{round}-{generic}"));
            let target = FileBackend::open(&dir, &FileOptions::default()).expect("open target");
            let t = Instant::now();
            let n = if generic {
                keel_mvcc::backend::snapshot::restore(&target, &mut stream.as_slice())
            } else {
                target.restore(&mut stream.as_slice())
            }
            .expect("restore");
            let took = t.elapsed();
            assert_eq!(n, pairs);
            println!(
                "round {round}: {} restore {:.1} ms",
                if generic { "generic" } else { "own    " },
                took.as_secs_f64() * 1e3
            );
            drop(target);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}
