//! LMDB's own restore: a snapshot stream loads into a new generation that is swapped in only
//! when whole, so a damaged stream, a full map or a SIGKILL at any moment leaves the store
//! empty (and usable) or wholly restored, and readers of the empty store keep their view.
//!
//! The crash test re-runs this binary as a child in the `restore` role (see `process`); it
//! runs 50 rounds, `KEEL_CRASH_ROUNDS=1000` runs more.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use keel_backend_lmdb::{LmdbBackend, LmdbOptions};
use keel_mvcc::{Backend, BackendError, Bucket, WriteBatch};
use rand::{Rng, SeedableRng};

use crate::common::{Dump, dump, dump_backend, generations, open};

/// Environment variable naming the stream file the `restore` child loads.
const STREAM: &str = "KEEL_LMDB_RESTORE_STREAM";

/// A source store of `pairs` pairs over three buckets with values of `value_len` bytes, and
/// its snapshot stream.
fn source(pairs: u32, value_len: usize) -> (Dump, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let backend = open(&dir.path().join("src"), &LmdbOptions::default());
    let mut batch = WriteBatch::new();
    for i in 0..pairs {
        let bucket = Bucket::new(["key", "lease", "meta"][(i % 3) as usize]);
        let mut value = i.to_be_bytes().to_vec();
        value.resize(value_len, (i % 251) as u8);
        batch.put(&bucket, format!("k{i:09}"), value);
    }
    backend.commit(&batch).unwrap();
    let mut stream = Vec::new();
    backend.snapshot(&mut stream).unwrap();
    (dump_backend(&backend), stream)
}

fn no_temporary_generation(path: &Path) {
    let gens = generations(path);
    assert!(
        gens.iter().all(|g| !g.ends_with(".tmp")),
        "an unfinished restore was left behind: {gens:?}"
    );
}

#[test]
fn damaged_stream_leaves_the_store_empty_and_usable() {
    let (expected, stream) = source(70_000, 16);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("target");
    let backend = open(&path, &LmdbOptions::default());
    for cut in [stream.len() - 1, stream.len() / 2, 100] {
        match backend.restore(&mut &stream[..cut]) {
            Err(BackendError::Snapshot { .. }) => {}
            other => panic!("stream cut to {cut} bytes restored as {other:?}"),
        }
        assert!(
            dump_backend(&backend).is_empty(),
            "cut {cut}: partial copy visible"
        );
        no_temporary_generation(&path);
    }
    let mut flipped = stream.clone();
    let at = flipped.len() - 2;
    flipped[at] ^= 0xff;
    assert!(matches!(
        backend.restore(&mut flipped.as_slice()),
        Err(BackendError::Snapshot { .. })
    ));
    assert!(
        dump_backend(&backend).is_empty(),
        "bad checksum: partial copy visible"
    );

    assert_eq!(backend.restore(&mut stream.as_slice()).unwrap(), 70_000);
    assert!(
        dump_backend(&backend) == expected,
        "restored content differs"
    );
    let mut batch = WriteBatch::new();
    batch.put(&Bucket::new("key"), "after", "restore");
    backend.commit(&batch).unwrap();
    drop(backend);
    let backend = open(&path, &LmdbOptions::default());
    let mut after = expected.clone();
    after
        .get_mut("key")
        .unwrap()
        .insert(b"after".to_vec(), b"restore".to_vec());
    assert!(dump_backend(&backend) == after, "content lost on reopen");
    assert_eq!(generations(&path).len(), 1, "{:?}", generations(&path));
}

#[test]
fn readers_of_the_empty_store_keep_their_view() {
    let (expected, stream) = source(5_000, 100);
    let dir = tempfile::tempdir().unwrap();
    let backend = open(&dir.path().join("target"), &LmdbOptions::default());
    let before = backend.read_txn().unwrap();
    backend.restore(&mut stream.as_slice()).unwrap();
    assert!(dump(&before).is_empty(), "an old reader saw the restore");
    assert!(dump_backend(&backend) == expected);
    drop(before);
    assert_eq!(generations(&dir.path().join("target")).len(), 1);
}

#[test]
fn full_map_fails_cleanly_and_growing_it_lets_the_restore_succeed() {
    let (expected, stream) = source(3_000, 2_000);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("target");
    let options = LmdbOptions {
        map_size: 1 << 20,
        ..LmdbOptions::default()
    };
    let backend = open(&path, &options);
    match backend.restore(&mut stream.as_slice()) {
        Err(BackendError::Full { limit, .. }) => assert_eq!(limit, 1 << 20),
        other => panic!("a 6 MB stream into a 1 MiB map restored as {other:?}"),
    }
    assert!(dump_backend(&backend).is_empty());
    no_temporary_generation(&path);
    backend.grow_map(64 << 20).unwrap();
    assert_eq!(backend.restore(&mut stream.as_slice()).unwrap(), 3_000);
    assert!(dump_backend(&backend) == expected);
}

#[test]
fn non_empty_store_is_refused() {
    let (_, stream) = source(10, 10);
    let dir = tempfile::tempdir().unwrap();
    let backend = open(&dir.path().join("target"), &LmdbOptions::default());
    let mut batch = WriteBatch::new();
    batch.put(&Bucket::new("other"), "mine", "1");
    backend.commit(&batch).unwrap();
    let before = dump_backend(&backend);
    assert!(matches!(
        backend.restore(&mut stream.as_slice()),
        Err(BackendError::RestoreNotEmpty)
    ));
    assert!(dump_backend(&backend) == before);
}

/// Child role: restores the stream file named by [`STREAM`] into the store at `path`, then
/// prints `restored` (after `restore` returned `Ok`) and waits to be killed.
pub fn restore_until_killed(path: &Path) {
    let file = std::env::var(STREAM).expect("stream path");
    let stream = std::fs::read(file).expect("read stream");
    let backend = LmdbBackend::open(path, &LmdbOptions::default()).expect("child open");
    let mut out = std::io::stdout();
    writeln!(out, "started").unwrap();
    out.flush().unwrap();
    backend
        .restore(&mut stream.as_slice())
        .expect("child restore");
    writeln!(out, "restored").unwrap();
    out.flush().unwrap();
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn killed_restore_leaves_the_store_empty_or_whole() {
    let rounds: u64 = std::env::var("KEEL_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let (expected, stream) = source(20_000, 200);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("stream");
    std::fs::write(&file, &stream).unwrap();
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    // Kill moments spread over about one restore's duration, measured first.
    let mut span = Duration::from_millis(20);
    let (mut empty, mut whole) = (0, 0);
    for round in 0..rounds {
        let path = dir.path().join(format!("store-{round}"));
        let mut proc = crate::process::child("restore", &path)
            .env(STREAM, &file)
            .spawn()
            .expect("spawn restorer");
        let stdout = proc.stdout.take().expect("child stdout");
        let mut lines = BufReader::new(stdout).lines();
        // The test harness prints its own lines first.
        assert!(
            lines.by_ref().any(|l| l.is_ok_and(|l| l == "started")),
            "round {round}: the restorer never started"
        );
        let started = Instant::now();
        let kill_at = if round == 0 {
            None
        } else {
            Some(Duration::from_micros(
                rng.random_range(0..=span.as_micros() as u64 * 5 / 4),
            ))
        };
        let reported = match kill_at {
            None => {
                let line = lines.next().and_then(Result::ok);
                assert_eq!(line.as_deref(), Some("restored"), "round {round}");
                span = started.elapsed();
                true
            }
            Some(at) => {
                std::thread::sleep(at);
                false
            }
        };
        proc.kill().expect("SIGKILL the restorer");
        proc.wait().expect("reap the restorer");
        let reported = reported || lines.any(|l| l.is_ok_and(|l| l == "restored"));

        let backend = LmdbBackend::open(&path, &LmdbOptions::default())
            .unwrap_or_else(|e| panic!("round {round} (seed {seed}): reopen failed: {e}"));
        let got = dump_backend(&backend);
        if got.is_empty() {
            assert!(
                !reported,
                "round {round} (seed {seed}): restore returned Ok but the store is empty"
            );
            empty += 1;
        } else {
            assert!(
                got == expected,
                "round {round} (seed {seed}): a partial restore survived the crash"
            );
            whole += 1;
        }
        assert_eq!(
            generations(&path).len(),
            1,
            "round {round}: {:?}",
            generations(&path)
        );
        drop(backend);
        std::fs::remove_dir_all(&path).unwrap();
    }
    assert!(whole >= 1, "no round restored");
    eprintln!("killed restore: {empty} rounds empty, {whole} whole (seed {seed})");
}

/// A stream with more buckets than the target's `max_buckets` fails whole with
/// `TooManyBuckets` naming the bucket that did not fit, and leaves the store empty.
#[test]
fn too_many_buckets_name_the_bucket_and_leave_the_store_empty() {
    let (_, stream) = source(30, 16);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("target");
    let options = LmdbOptions {
        max_buckets: 2,
        ..LmdbOptions::default()
    };
    let backend = open(&path, &options);
    let err = backend
        .restore(&mut &stream[..])
        .expect_err("three buckets restored into a store of two");
    let BackendError::Other(inner) = &err else {
        panic!("too many buckets returned {err:?}");
    };
    match inner.downcast_ref::<keel_backend_lmdb::LmdbError>() {
        Some(keel_backend_lmdb::LmdbError::TooManyBuckets {
            bucket,
            max_buckets: 2,
            ..
        }) => assert_eq!(bucket, "meta", "{err}"),
        other => panic!("too many buckets returned {other:?}"),
    }
    assert!(err.to_string().contains("bucket meta"), "{err}");
    assert!(dump_backend(&backend).is_empty(), "partial copy visible");
    no_temporary_generation(&path);
}
