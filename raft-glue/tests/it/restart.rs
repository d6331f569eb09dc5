//! A process running members is killed with SIGKILL under load and restarted: every
//! acknowledged write and lease is there, the members converge, and no entry was applied
//! twice (each key was put once, so its version is 1 and the store revision equals the number
//! of keys). Rounds: `KEEL_CRASH_ROUNDS` (default 50); the writer role runs in a child
//! process started from this test binary (`restart::crash_writer_child`, ignored otherwise).

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use keel_raft_glue::NodeOptions;
use keel_raft_glue::testing::{Cluster, TestBackend, fast_options};
use rand::{Rng, SeedableRng};

const T: Duration = Duration::from_secs(20);
const DIR_VAR: &str = "KEEL_RAFT_CRASH_DIR";
const ROUND_VAR: &str = "KEEL_RAFT_CRASH_ROUND";

fn options() -> NodeOptions {
    NodeOptions {
        snapshot_count: 200,
        snapshot_catch_up_entries: 50,
        ..fast_options()
    }
}

/// The writer role: reopens the cluster under the given directory and writes unique keys
/// from 4 threads, printing `ack <key>` after each put returned, and `lease <id>` after
/// each grant, until killed.
#[test]
#[ignore]
fn crash_writer_child() {
    let Some(dir) = std::env::var_os(DIR_VAR) else {
        return;
    };
    let round: u64 = std::env::var(ROUND_VAR)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let c = Arc::new(Mutex::new(
        Cluster::<TestBackend>::at(Path::new(&dir), 3, options(), round).expect("cluster"),
    ));
    let leader = c.lock().expect("lock").wait_leader(T).expect("leader");
    let mut threads = Vec::new();
    for t in 0..4u64 {
        let c = c.clone();
        threads.push(thread::spawn(move || {
            for i in 0.. {
                let node = {
                    let c = c.lock().expect("lock");
                    c.node(1 + (t + i) % 3).or_else(|| c.node(leader))
                };
                let Some(node) = node else { continue };
                if i % 50 == 7 {
                    let id = ((round + 1) << 32 | t << 24 | i) as i64;
                    if node.lease_grant_id(id, 3600).is_ok() {
                        println!("lease {id}");
                    }
                    continue;
                }
                let key = format!("r{round:03}-t{t}-{i:06}");
                if node.put(key.as_bytes(), b"v").is_ok() {
                    println!("ack {key}");
                }
            }
        }));
    }
    for t in threads {
        let _ = t.join();
    }
}

fn rounds() -> u64 {
    std::env::var("KEEL_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50)
}

#[test]
fn sigkilled_members_restart_converge_and_never_apply_twice() {
    crate::init_tracing();
    let root = tempfile::tempdir().expect("tempdir");
    let mut acked: BTreeSet<String> = BTreeSet::new();
    let mut leases: BTreeSet<i64> = BTreeSet::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for round in 0..rounds() {
        // Kill at a random moment once writes flow.
        let wait = Duration::from_millis(rng.random_range(100..600));
        let lines = crate::run_killed(
            "restart::crash_writer_child",
            &[
                (DIR_VAR, root.path().display().to_string()),
                (ROUND_VAR, round.to_string()),
            ],
            0,
            wait,
            T,
        );
        for line in &lines {
            if let Some(k) = line.strip_prefix("ack ") {
                acked.insert(k.to_owned());
            } else if let Some(id) = line.strip_prefix("lease ") {
                leases.insert(id.parse().expect("lease id"));
            }
        }
        if round % 4 == 3 || round + 1 == rounds() {
            verify(root.path(), &acked, &leases, round);
        }
    }
    assert!(
        acked.len() > 50,
        "writes were acknowledged ({})",
        acked.len()
    );
    assert!(!leases.is_empty(), "leases were acknowledged");
    eprintln!(
        "{} rounds: {} acknowledged puts and {} leases verified",
        rounds(),
        acked.len(),
        leases.len()
    );
}

/// Reopens the cluster in this process and checks every acknowledged write and lease, and
/// that nothing was applied twice.
fn verify(root: &Path, acked: &BTreeSet<String>, leases: &BTreeSet<i64>, round: u64) {
    let c = Cluster::<TestBackend>::at(root, 3, options(), 9_000 + round).expect("reopen");
    c.wait_leader(T).expect("leader");
    // Commit a barrier write so every member applies everything before checking.
    let barrier = format!("barrier-{round}");
    c.put(barrier.as_bytes(), b"b", T).expect("barrier");
    c.wait_converged(1, T).expect("converged after SIGKILL");
    for n in c.running() {
        crate::assert_acknowledged_applied_once(&n, acked, leases);
    }
}
