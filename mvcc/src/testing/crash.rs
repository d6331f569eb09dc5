//! The SIGKILL crash test, generic over the backend.
//!
//! The test binary runs itself as a child (the same test, selected with `--exact`, with
//! [`CHILD_ENV`] naming the store directory). The child opens the store, reads its consistent
//! index `ci`, and applies "Raft entries" `ci + 1, ci + 2, ...`: entry `i` is one write
//! transaction that puts `k{i % 16} = i`, puts `applied/last = i` in an auxiliary bucket and
//! sets the consistent index to `i`; every few entries it calls `force_commit` and then
//! prints `durable i`, and now and then it compacts. The parent kills the child (SIGKILL) at
//! a random moment, reopens the store and checks that it opens, that its consistent index
//! covers every acknowledged entry, that its contents are exactly the effect of entries
//! `1..=ci` (values, versions, revision, auxiliary record), and that applying `ci` again is
//! refused; then the next round's child resumes after `ci`.
//!
//! A backend crate runs it with one test:
//!
//! ```ignore
//! #[test]
//! fn mvcc_survives_sigkill() {
//!     let dir = tempfile::tempdir().unwrap();
//!     keel_mvcc::testing::crash::run::<MyBackend>(
//!         "crash::mvcc_survives_sigkill", // the test's path in its binary
//!         dir.path(),
//!         MyOptions::default(),
//!         keel_mvcc::testing::crash::rounds(),
//!     );
//! }
//! ```

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::backend::{Backend, Bucket};
use crate::request::RangeRequest;
use crate::{Store, StoreOptions};

/// Environment variable that makes the test binary play the writer child; holds the store
/// directory.
pub const CHILD_ENV: &str = "KEEL_MVCC_CRASH_CHILD";
/// Keys the child cycles through.
const KEYS: u64 = 16;
const APPLIED: Bucket = Bucket::new("applied");

/// Rounds to run: `KEEL_CRASH_ROUNDS`, default 50.
pub fn rounds() -> usize {
    std::env::var("KEEL_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50)
}

fn store_options() -> StoreOptions {
    StoreOptions {
        batch_interval: Duration::from_millis(2),
        batch_limit: 20,
        compaction_batch_limit: 5,
        compaction_sleep_interval: Duration::from_millis(1),
        ..StoreOptions::default()
    }
}

/// Runs the crash test (parent role), or the writer (child role) when [`CHILD_ENV`] is set.
/// `test_name` is the exact name of the calling test in its binary.
pub fn run<B: Backend>(test_name: &str, dir: &Path, options: B::Options, rounds: usize) {
    if let Ok(path) = std::env::var(CHILD_ENV) {
        child::<B>(Path::new(&path), &options);
    }
    let path = dir.join("store");
    let seed = std::env::var("KEEL_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(7, |d| d.as_nanos() as u64)
        });
    eprintln!("crash test seed {seed} (replay: KEEL_CRASH_SEED={seed})");
    let mut rng = StdRng::seed_from_u64(seed);
    let mut total_acked = 0u64;
    let mut last_ci = 0u64;
    for round in 0..rounds {
        let acked = Arc::new(AtomicU64::new(0));
        let mut child = Command::new(std::env::current_exe().expect("current exe"))
            .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn writer child");
        let stdout = child.stdout.take().expect("child stdout");
        let reader = {
            let acked = acked.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if let Some(n) = line.strip_prefix("durable ")
                        && let Ok(n) = n.trim().parse::<u64>()
                    {
                        acked.fetch_max(n, Ordering::AcqRel);
                    }
                }
            })
        };
        // Let the child get going, then kill it at a random moment.
        let start = Instant::now();
        while acked.load(Ordering::Acquire) <= last_ci && start.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(0..40)));
        child.kill().expect("SIGKILL the child");
        let _ = child.wait();
        reader.join().expect("stdout reader");
        let acked = acked.load(Ordering::Acquire);
        let ci = verify::<B>(&path, &options, acked, round, seed);
        assert!(ci >= last_ci, "round {round}: consistent index went back");
        total_acked += acked.saturating_sub(last_ci);
        last_ci = ci;
    }
    assert!(
        total_acked > 0,
        "no write was ever acknowledged: the crash test verified nothing"
    );
}

/// Checks the store after a kill; returns its consistent index.
fn verify<B: Backend>(
    path: &Path,
    options: &B::Options,
    acked: u64,
    round: usize,
    seed: u64,
) -> u64 {
    let ctx = format!("seed {seed} round {round}");
    let backend = B::open(path, options).unwrap_or_else(|e| panic!("{ctx}: reopen backend: {e}"));
    let store =
        Store::open(backend, store_options()).unwrap_or_else(|e| panic!("{ctx}: reopen: {e}"));
    let ci = store.consistent_index();
    assert!(
        ci >= acked,
        "{ctx}: acknowledged entry {acked} lost (store holds {ci})"
    );
    assert_eq!(
        store.current_revision(),
        ci,
        "{ctx}: one revision per applied entry"
    );
    let last = store
        .aux_get(&APPLIED, b"last")
        .unwrap_or_else(|e| panic!("{ctx}: aux_get: {e}"));
    let want_last = (ci > 0).then(|| ci.to_string().into_bytes());
    assert_eq!(
        last, want_last,
        "{ctx}: auxiliary record disagrees with the index"
    );
    let all = store
        .range(&RangeRequest::prefix(b"k".to_vec()))
        .unwrap_or_else(|e| panic!("{ctx}: range: {e}"));
    for j in 0..KEYS {
        let key = format!("k{j:02}").into_bytes();
        let got = all.kvs.iter().find(|kv| kv.key() == key);
        let puts: Vec<u64> = (1..=ci).filter(|i| i % KEYS == j).collect();
        match (puts.last(), got) {
            (None, None) => {}
            (Some(&i), Some(kv)) => {
                assert_eq!(
                    kv.value(),
                    i.to_string().into_bytes(),
                    "{ctx}: value of k{j:02}"
                );
                assert_eq!(kv.mod_revision, i, "{ctx}: mod revision of k{j:02}");
                assert_eq!(kv.version, puts.len() as u64, "{ctx}: version of k{j:02}");
                assert_eq!(
                    kv.create_revision, puts[0],
                    "{ctx}: create revision of k{j:02}"
                );
            }
            (want, got) => panic!("{ctx}: k{j:02}: expected put {want:?}, found {got:?}"),
        }
    }
    if ci > 0 {
        let mut t = store.write();
        assert!(
            t.set_consistent_index(ci).is_err(),
            "{ctx}: re-applying entry {ci} was accepted"
        );
    }
    ci
}

fn child<B: Backend>(path: &Path, options: &B::Options) -> ! {
    let backend = B::open(path, options).expect("child: open backend");
    let store = Store::open(backend, store_options()).expect("child: open store");
    let mut i = store.consistent_index();
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        i += 1;
        let mut t = store.write();
        t.put(
            format!("k{:02}", i % KEYS).as_bytes(),
            i.to_string().as_bytes(),
            0,
        )
        .expect("child: put");
        t.put_aux(&APPLIED, b"last", i.to_string().as_bytes())
            .expect("child: put_aux");
        t.set_consistent_index(i).expect("child: consistent index");
        t.commit().expect("child: commit");
        if i % 5 == 0 {
            store.force_commit().expect("child: force_commit");
            println!("durable {i}");
        }
        if i % 97 == 0 && i > KEYS * 2 {
            let _ = store.compact(i - KEYS);
        }
    }
    std::process::exit(0);
}
