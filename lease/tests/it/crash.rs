//! Revoke atomicity under real crashes: a child process grants leases, attaches keys and
//! revokes leases on the file backend while the parent SIGKILLs it at random moments; after
//! every kill, each lease is either whole (record and all its keys) or wholly gone, every
//! acknowledged revoke is complete, and no key names a lease without a record.
//!
//! `KEEL_CRASH_ROUNDS=1000 cargo test -p keel-lease --test it crash -- --nocapture` runs more
//! rounds than the default 50.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use keel_backend_file::{FileBackend, FileOptions};
use keel_lease::record::LEASE_BUCKET;
use keel_lease::{Lessor, LessorOptions, ManualClock};
use keel_mvcc::{Store, StoreOptions};
use rand::{Rng, SeedableRng, rngs::StdRng};

use crate::common::keys_with_leases;

const CHILD_DIR: &str = "KEEL_LEASE_CRASH_DIR";
const CHILD_BASE: &str = "KEEL_LEASE_CRASH_BASE";
const KEYS_PER_LEASE: usize = 5;
const TEST_NAME: &str = "crash::revoke_is_atomic_under_sigkill";

fn open(dir: &Path) -> (Arc<Store<FileBackend>>, Lessor<FileBackend>) {
    let backend_options = FileOptions {
        segment_size: 1 << 20,
        ..FileOptions::default()
    };
    let backend = FileBackend::open(dir, &backend_options).expect("open file backend");
    let store = Arc::new(
        Store::open(
            backend,
            StoreOptions {
                batch_interval: Duration::from_millis(3),
                ..StoreOptions::default()
            },
        )
        .expect("open store"),
    );
    let lessor = Lessor::open(
        store.clone(),
        Arc::new(ManualClock::new()),
        LessorOptions::default(),
    )
    .expect("open lessor");
    (store, lessor)
}

fn key(id: i64, k: usize) -> Vec<u8> {
    format!("lease/{id:08}/{k}").into_bytes()
}

/// The writer: runs until killed. Acknowledges on stdout only after `force_commit` returned.
fn child(dir: &Path, base: i64) {
    let (store, lessor) = open(dir);
    let mut to_revoke: Vec<i64> = lessor.leases();
    let mut rng = StdRng::seed_from_u64(base as u64);
    for id in base.. {
        lessor.grant(id, 60, None).unwrap();
        for k in 0..KEYS_PER_LEASE {
            lessor.put(&key(id, k), b"value", id, None).unwrap();
        }
        store.force_commit().unwrap();
        println!("ACK ready {id}");
        to_revoke.push(id);
        // Revoke a few leases; they reach the backend through the background batch commit
        // (any time) or the force_commit below, and are acknowledged only after it.
        let mut revoked = Vec::new();
        while to_revoke.len() > 3 {
            let victim = to_revoke.swap_remove(rng.random_range(0..to_revoke.len()));
            lessor.revoke(victim, None).unwrap();
            revoked.push(victim);
        }
        if rng.random_bool(0.5) {
            store.force_commit().unwrap();
            for victim in revoked {
                println!("ACK revoked {victim}");
            }
        }
    }
}

#[test]
fn revoke_is_atomic_under_sigkill() {
    if let Ok(dir) = std::env::var(CHILD_DIR) {
        let base = std::env::var(CHILD_BASE)
            .ok()
            .and_then(|b| b.parse().ok())
            .unwrap_or(1);
        child(Path::new(&dir), base);
        return;
    }
    let rounds: i64 = std::env::var("KEEL_CRASH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(50);
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut rng = StdRng::seed_from_u64(0x1ea5e);
    let mut ready: BTreeSet<i64> = BTreeSet::new();
    let mut revoked: BTreeSet<i64> = BTreeSet::new();
    let mut torn_checks = 0usize;
    for round in 0..rounds {
        let base = (round + 1) * 100_000;
        let mut child = Command::new(&exe)
            .args([TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_DIR, dir.path())
            .env(CHILD_BASE, base.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .collect::<Vec<String>>()
        });
        std::thread::sleep(Duration::from_millis(rng.random_range(40..250)));
        child.kill().unwrap();
        child.wait().unwrap();
        for line in reader.join().unwrap() {
            let mut words = line.split_whitespace();
            match (words.next(), words.next(), words.next()) {
                (Some("ACK"), Some("ready"), Some(id)) => {
                    ready.insert(id.parse().unwrap());
                }
                (Some("ACK"), Some("revoked"), Some(id)) => {
                    revoked.insert(id.parse().unwrap());
                }
                _ => {}
            }
        }

        let (store, lessor) = open(dir.path());
        assert_eq!(
            lessor.recovered().orphan_keys,
            0,
            "round {round}: keys without lease"
        );
        let records: BTreeSet<i64> = store
            .aux_scan(&LEASE_BUCKET)
            .unwrap()
            .into_iter()
            .map(|(k, _)| i64::from_be_bytes(k.try_into().unwrap()))
            .collect();
        let mut keys_of: BTreeMap<i64, usize> = BTreeMap::new();
        for (_, lease) in keys_with_leases(&store) {
            *keys_of.entry(lease).or_default() += 1;
        }
        for &id in &ready {
            let keys = keys_of.get(&id).copied().unwrap_or(0);
            if records.contains(&id) {
                assert_eq!(keys, KEYS_PER_LEASE, "round {round}: lease {id} lost keys");
                assert!(
                    !revoked.contains(&id),
                    "round {round}: acked revoke of {id} lost"
                );
            } else {
                assert_eq!(keys, 0, "round {round}: lease {id} revoked but keys remain");
            }
            torn_checks += 1;
        }
        for id in keys_of.keys() {
            assert!(
                records.contains(id),
                "round {round}: keys of missing lease {id}"
            );
        }
        assert_eq!(lessor.leases(), records.iter().copied().collect::<Vec<_>>());
        drop(lessor);
        drop(store);
    }
    assert!(
        !ready.is_empty() && !revoked.is_empty(),
        "the child never got going"
    );
    eprintln!(
        "lease crash test: {rounds} kills, {} leases acknowledged, {} revokes acknowledged, {torn_checks} checks",
        ready.len(),
        revoked.len()
    );
}
