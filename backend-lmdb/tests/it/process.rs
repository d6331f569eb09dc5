//! Other processes: the directory lock holds across processes, and a writer killed with
//! SIGKILL at random moments (also while defragmenting) loses no acknowledged commit and
//! leaves a consistent store.
//!
//! Both re-run this test binary as a child in a role given by `KEEL_LMDB_CHILD`
//! (`cargo test -p keel-backend-lmdb --test it -- --ignored --exact process::child_role`
//! runs it by hand). The crash test runs 50 rounds; `KEEL_CRASH_ROUNDS=1000` runs more.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use keel_backend_lmdb::{LmdbBackend, LmdbOptions};
use keel_mvcc::{Backend, BackendError, Bucket, ReadTxn, WriteBatch};
use rand::{Rng, SeedableRng};

use crate::common::open;

const ROLE: &str = "KEEL_LMDB_CHILD";
const PATH: &str = "KEEL_LMDB_CHILD_PATH";
const KEY: Bucket = Bucket::new("key");
const META: Bucket = Bucket::new("meta");
/// Keys older than this many commits are deleted by later commits.
const WINDOW: u64 = 50;

pub(crate) fn child(role: &str, path: &Path) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("test binary path"));
    cmd.args(["--ignored", "--exact", "process::child_role", "--nocapture"])
        .env(ROLE, role)
        .env(PATH, path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    cmd
}

/// The child side; does nothing unless started by a test of this module.
#[test]
#[ignore = "child role of the process tests"]
fn child_role() {
    let (Ok(role), Ok(path)) = (std::env::var(ROLE), std::env::var(PATH)) else {
        return;
    };
    let path = Path::new(&path);
    match role.as_str() {
        "open" => match LmdbBackend::open(path, &LmdbOptions::default()) {
            Ok(_) => println!("result opened"),
            Err(BackendError::Locked { .. }) => println!("result locked"),
            Err(e) => println!("result error {e}"),
        },
        "writer" => write_until_killed(path),
        "restore" => crate::restore::restore_until_killed(path),
        other => panic!("unknown child role {other}"),
    }
}

fn value_of(i: u64) -> Vec<u8> {
    let len = (i * 7919 % 6000) as usize + 8;
    let mut v = i.to_be_bytes().to_vec();
    v.resize(len, (i % 251) as u8);
    v
}

fn last_commit<T: ReadTxn>(txn: &T) -> u64 {
    txn.get(&META, b"last")
        .unwrap()
        .map_or(0, |v| u64::from_be_bytes(v.try_into().expect("8 bytes")))
}

fn write_until_killed(path: &Path) {
    let backend = LmdbBackend::open(path, &LmdbOptions::default()).expect("child open");
    let mut i = last_commit(&backend.read_txn().unwrap());
    let stdout = std::io::stdout();
    loop {
        i += 1;
        let mut batch = WriteBatch::new();
        batch.put(&KEY, i.to_be_bytes(), value_of(i));
        if i > WINDOW {
            batch.delete(&KEY, (i - WINDOW).to_be_bytes());
        }
        batch.put(&META, b"last", i.to_be_bytes());
        backend.commit(&batch).expect("child commit");
        let mut out = stdout.lock();
        writeln!(out, "ack {i}").unwrap();
        out.flush().unwrap();
        if i.is_multiple_of(40) {
            backend.defragment().expect("child defragment");
        }
    }
}

#[test]
fn lock_holds_across_processes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let run = || {
        let out = child("open", &path).output().expect("run child");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("result ").map(str::to_owned))
            .unwrap_or_else(|| "no result".to_owned())
    };
    let backend = open(&path, &LmdbOptions::default());
    assert_eq!(run(), "locked", "another process opened a locked store");
    let txn = backend.read_txn().unwrap();
    drop(backend);
    assert_eq!(
        run(),
        "locked",
        "the lock was released while a read txn lives"
    );
    drop(txn);
    assert_eq!(run(), "opened", "the lock outlived every handle");
}

#[test]
fn killed_writer_loses_no_acknowledged_commit() {
    let rounds: u64 = std::env::var("KEEL_CRASH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(50);
    let seed: u64 = rand::random();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let mut acked_total = 0u64;
    for round in 0..rounds {
        let mut proc = child("writer", &path).spawn().expect("spawn writer");
        let stdout = proc.stdout.take().expect("child stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut last = None;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if let Some(n) = line.strip_prefix("ack ") {
                    let n: u64 = n.parse().expect("ack number");
                    if last.is_none() {
                        let _ = tx.send(());
                    }
                    last = Some(n);
                }
            }
            last
        });
        // Kill at a random moment after the first acknowledgement.
        rx.recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| panic!("round {round}: the writer never acknowledged"));
        std::thread::sleep(Duration::from_micros(rng.random_range(0..60_000)));
        proc.kill().expect("SIGKILL the writer");
        proc.wait().expect("reap the writer");
        let acked = reader.join().unwrap().expect("at least one ack");

        let backend = LmdbBackend::open(&path, &LmdbOptions::default())
            .unwrap_or_else(|e| panic!("round {round} (seed {seed}): reopen failed: {e}"));
        let txn = backend.read_txn().unwrap();
        let last = last_commit(&txn);
        assert!(
            last == acked || last == acked + 1,
            "round {round} (seed {seed}): acknowledged {acked} but the store ends at {last}"
        );
        let keys: Vec<(u64, Vec<u8>)> = txn
            .range(&KEY, b"", None)
            .unwrap()
            .map(|item| {
                let (k, v) = item.unwrap();
                (
                    u64::from_be_bytes(k.try_into().expect("8-byte key")),
                    v.to_vec(),
                )
            })
            .collect();
        let first = last.saturating_sub(WINDOW) + 1;
        let expected: Vec<u64> = (first..=last).collect();
        assert_eq!(
            keys.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            expected,
            "round {round} (seed {seed}): keys do not match commit {last}"
        );
        for (k, v) in &keys {
            assert!(
                *v == value_of(*k),
                "round {round}: value of key {k} is wrong"
            );
        }
        let gens = crate::common::generations(&path);
        assert_eq!(
            gens.len(),
            1,
            "round {round}: leftover generations {gens:?}"
        );
        acked_total = last;
    }
    assert!(acked_total > rounds, "the writers made too little progress");
}
