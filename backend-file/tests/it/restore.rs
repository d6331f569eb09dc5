//! Restore from a snapshot stream: it syncs once at its end rather than once per batch, and a
//! restore that fails or is killed midway leaves a store that refuses to open, never one that
//! passes for a complete copy.
//!
//! The kill test runs 20 rounds by default; `KEEL_RESTORE_CRASH_ROUNDS=200 cargo test -p
//! keel-backend-file --test it restore::killed -- --nocapture` for a long run. The child is
//! this test binary itself, running the ignored `restore::child_restorer` test with
//! `KEEL_FILE_RESTORE_DIR` and `KEEL_FILE_RESTORE_STREAM` set.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use keel_backend_file::{FaultPlan, FileBackend, FileOptions};
use keel_mvcc::testing::ChunkCuts;
use keel_mvcc::{Backend, BackendError, WriteBatch};
use rand::{Rng, SeedableRng};

use crate::support::{B, dump, stream};

const DIR_ENV: &str = "KEEL_FILE_RESTORE_DIR";
const STREAM_ENV: &str = "KEEL_FILE_RESTORE_STREAM";

#[test]
fn restore_syncs_once_at_the_end() {
    // 300 001 pairs arrive in 7 batches of at most 50 000 pairs.
    let stream = stream(300_000, 8);
    let dir = tempfile::tempdir().unwrap();
    let plan = FaultPlan::count_only();
    let options = FileOptions {
        prepare_ahead: false,
        fault_hook: Some(plan.clone()),
        ..FileOptions::default()
    };
    let b = FileBackend::open(dir.path(), &options).unwrap();
    let (ops, writes) = (plan.ops(), plan.writes().len() as u64);
    assert_eq!(b.restore(&mut stream.as_slice()).unwrap(), 300_001);
    let writes = plan.writes().len() as u64 - writes;
    let syncs = plan.ops() - ops - writes;
    assert!(writes >= 7, "one frame per batch: {writes} writes");
    // The marker's directory sync, the segment's sync, the directory sync of its removal.
    assert_eq!(syncs, 3, "syncs during the restore");
    let restored = dump(&b);
    drop(b);
    let b = FileBackend::open(dir.path(), &options).unwrap();
    assert!(dump(&b) == restored, "restored content survives reopen");
    assert_eq!(restored["key"].len(), 300_000);
    b.check_integrity().unwrap();
}

#[test]
fn restore_across_segments_reopens() {
    let stream = stream(20_000, 500);
    let dir = tempfile::tempdir().unwrap();
    let options = FileOptions {
        segment_size: 1 << 20,
        ..FileOptions::default()
    };
    let b = FileBackend::open(dir.path(), &options).unwrap();
    assert_eq!(b.restore(&mut stream.as_slice()).unwrap(), 20_001);
    let restored = dump(&b);
    drop(b);
    let b = FileBackend::open(dir.path(), &options).unwrap();
    assert!(dump(&b) == restored);
    assert_eq!(restored["key"].len(), 20_000);
    b.check_integrity().unwrap();
}

/// A restore from chunks that spans segments loads what a restore from the byte stream
/// loads, is readable as soon as it returns (its batches are published together at its
/// end), and survives a reopen.
#[test]
fn restore_from_chunks_across_segments_reopens() {
    let stream = stream(20_000, 500);
    let options = FileOptions {
        segment_size: 1 << 20,
        ..FileOptions::default()
    };
    let whole = tempfile::tempdir().unwrap();
    let b = FileBackend::open(whole.path(), &options).unwrap();
    b.restore(&mut stream.as_slice()).unwrap();
    let expected = dump(&b);
    drop(b);
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), &options).unwrap();
    let mut chunks = ChunkCuts::new(&stream, [1 << 20, 7, 100_003, 4096]);
    let mut shown = 0u64;
    let pairs = b
        .restore_chunks(&mut chunks, &mut |_, _, _| shown += 1)
        .unwrap();
    assert_eq!((pairs, shown), (20_001, 20_001));
    assert!(dump(&b) == expected, "restored from chunks differs");
    drop(b);
    let b = FileBackend::open(dir.path(), &options).unwrap();
    assert!(
        dump(&b) == expected,
        "restored from chunks differs after reopen"
    );
    b.check_integrity().unwrap();
}

fn assert_refused(dir: &Path) {
    match FileBackend::open(dir, &FileOptions::default()) {
        Err(e @ BackendError::Corrupt { .. }) => {
            let text = e.to_string();
            assert!(text.contains("RESTORING"), "names the marker: {text}");
        }
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn failed_restore_refuses_to_open() {
    let stream = stream(20_000, 500);
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), &FileOptions::default()).unwrap();
    let cut = &stream[..stream.len() - 3];
    match b.restore(&mut &cut[..]) {
        Err(BackendError::Snapshot { .. }) => {}
        other => panic!("expected a snapshot error, got {other:?}"),
    }
    drop(b);
    assert_refused(dir.path());
}

/// A failed restore leaves the backend refusing commits and restores, which would land on
/// top of the part of the stream it loaded, until it is reopened (which the marker refuses).
#[test]
fn failed_restore_refuses_later_commits_and_restores() {
    let stream = stream(20_000, 500);
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), &FileOptions::default()).unwrap();
    let cut = &stream[..stream.len() - 3];
    assert!(matches!(
        b.restore(&mut &cut[..]),
        Err(BackendError::Snapshot { .. })
    ));
    match b.restore(&mut stream.as_slice()) {
        Err(BackendError::Poisoned { .. }) => {}
        other => panic!("a second restore after a failed one: {other:?}"),
    }
    let mut batch = WriteBatch::new();
    batch.put(&B, b"x".to_vec(), b"y".to_vec());
    match b.commit(&batch) {
        Err(BackendError::Poisoned { .. }) => {}
        other => panic!("a commit after a failed restore: {other:?}"),
    }
    drop(b);
    assert_refused(dir.path());
}

/// While a restore runs, a commit from another thread is refused (it would land between
/// the restore's frames); once the restore is done, commits from any thread go through.
#[test]
fn commits_of_other_threads_are_refused_during_a_restore() {
    let stream = stream(5_000, 100);
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), &FileOptions::default()).unwrap();
    let mut batch = WriteBatch::new();
    batch.put(&B, b"x".to_vec(), b"y".to_vec());
    let commit_elsewhere = || std::thread::scope(|s| s.spawn(|| b.commit(&batch)).join().unwrap());
    let mut during = None;
    let loaded = b
        .restore_observed(&mut stream.as_slice(), &mut |_, _, _| {
            if during.is_none() {
                during = Some(commit_elsewhere());
            }
        })
        .unwrap();
    assert_eq!(loaded, 5_001);
    match during {
        Some(Err(BackendError::Other(e))) => {
            assert!(e.to_string().contains("restore"), "{e}");
        }
        other => panic!("a commit during the restore: {other:?}"),
    }
    commit_elsewhere().unwrap();
    assert_eq!(dump(&b)["key"].len(), 5_001);
}

#[test]
fn restore_into_non_empty_leaves_no_marker() {
    let stream = stream(10, 8);
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), &FileOptions::default()).unwrap();
    let mut batch = WriteBatch::new();
    batch.put(&B, b"x".to_vec(), b"y".to_vec());
    b.commit(&batch).unwrap();
    assert!(matches!(
        b.restore(&mut stream.as_slice()),
        Err(BackendError::RestoreNotEmpty)
    ));
    drop(b);
    let b = FileBackend::open(dir.path(), &FileOptions::default()).unwrap();
    assert_eq!(dump(&b)["key"].len(), 1);
}

/// The restoring role, run in the child process.
#[test]
#[ignore = "the child role of restore::killed_restore_never_opens_as_complete"]
fn child_restorer() {
    let (Ok(dir), Ok(stream)) = (std::env::var(DIR_ENV), std::env::var(STREAM_ENV)) else {
        return;
    };
    let stream = std::fs::read(stream).unwrap();
    let options = FileOptions {
        segment_size: 1 << 20,
        ..FileOptions::default()
    };
    let b = FileBackend::open(Path::new(&dir), &options).unwrap();
    println!("streaming");
    let pairs = b.restore(&mut stream.as_slice()).unwrap();
    println!("restored {pairs}");
}

/// Runs the child on a fresh directory, killing it `kill_after` after it starts streaming
/// (never, if `None`); returns the directory, whether it reported success, and how long the
/// restore ran.
fn run_child(stream: &Path, kill_after: Option<Duration>) -> (tempfile::TempDir, bool, Duration) {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "restore::child_restorer",
            "--ignored",
            "--nocapture",
        ])
        .args(["--test-threads", "1"])
        .env(DIR_ENV, dir.path())
        .env(STREAM_ENV, stream)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        if line.unwrap().contains("streaming") {
            break;
        }
    }
    let started = Instant::now();
    let reader = std::thread::spawn(move || lines.any(|l| l.is_ok_and(|l| l.contains("restored"))));
    if let Some(after) = kill_after {
        std::thread::sleep(after);
        let _ = child.kill();
    }
    child.wait().unwrap();
    let done = reader.join().unwrap();
    (dir, done, started.elapsed())
}

#[test]
fn killed_restore_never_opens_as_complete() {
    let rounds: u64 = std::env::var("KEEL_RESTORE_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let source = tempfile::tempdir().unwrap();
    let path = source.path().join("stream");
    std::fs::write(&path, stream(30_000, 300)).unwrap();
    let (dir, done, took) = run_child(&path, None);
    assert!(done, "an undisturbed restore finishes");
    let complete = {
        let b = FileBackend::open(dir.path(), &FileOptions::default()).unwrap();
        dump(&b)
    };
    assert_eq!(complete["key"].len(), 30_000);

    let seed: u64 = rand::rng().random();
    println!("restore kill seed {seed}, an undisturbed restore takes {took:?}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut refused = 0;
    for round in 0..rounds {
        let after = took.mul_f64(rng.random_range(0.0..1.0));
        let (dir, done, _) = run_child(&path, Some(after));
        match FileBackend::open(dir.path(), &FileOptions::default()) {
            Ok(b) => {
                let got = dump(&b);
                assert!(
                    got.is_empty() || got == complete,
                    "round {round} (seed {seed}): a killed restore opened with {} keys",
                    got.get("key").map_or(0, |m| m.len())
                );
                if !got.is_empty() {
                    b.check_integrity().unwrap();
                }
            }
            Err(_) => {
                assert!(!done, "round {round}: a finished restore refuses to open");
                assert_refused(dir.path());
                refused += 1;
            }
        }
    }
    assert!(
        refused >= rounds / 4,
        "only {refused} of {rounds} kills landed inside the restore"
    );
}
