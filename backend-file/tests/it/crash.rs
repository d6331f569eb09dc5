//! Real crashes: a child process commits batches (rolling segments, reclaiming and
//! defragmenting as it goes, preparing space ahead by allocation, by zeros or by both as the
//! frames' sizes say, in turn from one round to the next; every 17th batch's frame is larger
//! than 64 KiB) and is killed with SIGKILL at a random moment; after reopen every
//! acknowledged batch is there, no batch is partial, and the integrity check passes.
//!
//! 60 rounds by default; `KEEL_CRASH_ROUNDS=1000 cargo test -p keel-backend-file --test it
//! crash::sigkill -- --nocapture` for a long run. The child is this test binary itself,
//! running the ignored `crash::child_writer` test with `KEEL_FILE_CRASH_DIR` set.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use keel_backend_file::{FileBackend, FileOptions, PrepareWith};
use keel_mvcc::{Backend, ReadTxn, WriteBatch};
use rand::{Rng, SeedableRng};

use crate::support::{B, META_B};

const DIR_ENV: &str = "KEEL_FILE_CRASH_DIR";
/// How the child prepares space ahead: rounds take allocation, zeros and both in turn.
const PREPARE_ENV: &str = "KEEL_FILE_CRASH_PREPARE";
/// Batches kept alive: batch `i` deletes the keys of batch `i - KEEP`.
const KEEP: u64 = 5;
const PER_BATCH: u64 = 10;

fn options() -> FileOptions {
    FileOptions {
        segment_size: 128 << 10,
        reclaim_min_garbage: 64 << 10,
        reclaim_step_bytes: 16 << 10,
        ..FileOptions::default()
    }
}

fn key(i: u64, j: u64) -> Vec<u8> {
    format!("d{i:08}-{j:02}").into_bytes()
}

/// Batch `i`'s `j`th value: 180 to 379 bytes, and 7 000 in every 17th batch (a frame over
/// the 64 KiB above which `PrepareWith::Auto` allocates instead of writing zeros).
fn value(i: u64, j: u64) -> Vec<u8> {
    let mut v = format!("{i}:{j}:").into_bytes();
    let len = if i.is_multiple_of(17) {
        7_000
    } else {
        180 + (i as usize * 7 + j as usize) % 200
    };
    v.resize(len, (i + j) as u8);
    v
}

fn last_batch(b: &FileBackend) -> u64 {
    let txn = b.read_txn().unwrap();
    txn.get(&META_B, b"seq")
        .unwrap()
        .map_or(0, |v| u64::from_be_bytes(v.try_into().expect("8-byte seq")))
}

/// The writer role, run in the child process.
#[test]
#[ignore = "the child role of crash::sigkill"]
fn child_writer() {
    let Ok(dir) = std::env::var(DIR_ENV) else {
        return;
    };
    let how = match std::env::var(PREPARE_ENV).as_deref() {
        Ok("zeros") => PrepareWith::Zeros,
        Ok("auto") => PrepareWith::Auto,
        _ => PrepareWith::Allocate,
    };
    let options = FileOptions {
        prepare_with: how,
        ..options()
    };
    let b = FileBackend::open(Path::new(&dir), &options).unwrap();
    let mut out = std::io::stdout().lock();
    let mut i = last_batch(&b);
    loop {
        i += 1;
        let mut batch = WriteBatch::new();
        batch.put(&META_B, b"seq".to_vec(), i.to_be_bytes().to_vec());
        for j in 0..PER_BATCH {
            batch.put(&B, key(i, j), value(i, j));
        }
        if i > KEEP {
            batch.delete_range(&B, key(i - KEEP, 0), Some(key(i - KEEP + 1, 0)));
        }
        b.commit(&batch).unwrap();
        writeln!(out, "ack {i}").unwrap();
        out.flush().unwrap();
        if i.is_multiple_of(41) {
            b.defragment().unwrap();
        }
    }
}

fn verify(dir: &Path, acked: u64) -> u64 {
    let b = FileBackend::open(
        dir,
        &FileOptions {
            background_reclaim: false,
            ..options()
        },
    )
    .unwrap();
    b.check_integrity().unwrap();
    let last = last_batch(&b);
    assert!(
        last >= acked,
        "acknowledged batch {acked} lost (store at {last})"
    );
    assert!(
        last <= acked + 1,
        "store at {last} but only {acked} acknowledged"
    );
    let txn = b.read_txn().unwrap();
    let mut expected = Vec::new();
    for i in last.saturating_sub(KEEP - 1).max(1)..=last {
        for j in 0..PER_BATCH {
            expected.push((key(i, j), value(i, j)));
        }
    }
    let got: Vec<(Vec<u8>, Vec<u8>)> = txn
        .range(&B, &[], None)
        .unwrap()
        .map(|r| {
            let (k, v) = r.unwrap();
            (k.to_vec(), v.to_vec())
        })
        .collect();
    assert_eq!(got.len(), expected.len(), "keys of batches up to {last}");
    assert!(got == expected, "contents of batches up to {last}");
    last
}

#[test]
fn sigkill() {
    let rounds: u64 = std::env::var("KEEL_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let seed: u64 = rand::rng().random();
    println!("crash test seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut acked = 0u64;
    let mut progressed = 0;
    for round in 0..rounds {
        let mut child = Command::new(&exe)
            .args(["--exact", "crash::child_writer", "--ignored", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(DIR_ENV, dir.path())
            .env(
                PREPARE_ENV,
                ["allocate", "zeros", "auto"][round as usize % 3],
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut last = None;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // The harness may print its own text before the first ack on the same line.
                if let Some(at) = line.find("ack ") {
                    last = Some(line[at + 4..].trim().parse::<u64>().unwrap());
                }
            }
            last
        });
        std::thread::sleep(Duration::from_millis(rng.random_range(5..120)));
        child.kill().unwrap();
        child.wait().unwrap();
        if let Some(last) = reader.join().unwrap() {
            assert!(last >= acked, "round {round}: acks go backwards");
            if last > acked {
                progressed += 1;
            }
            acked = last;
        }
        let now = verify(dir.path(), acked);
        // A batch committed but not yet acknowledged counts as acknowledged from now on.
        acked = now;
    }
    assert!(
        progressed >= rounds / 3,
        "the child made progress in only {progressed} of {rounds} rounds"
    );
    println!("{rounds} rounds, {acked} batches, seed {seed}");
}
