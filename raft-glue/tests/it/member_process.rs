//! One member runs in a process of its own, talking to the other two over TCP, and is killed
//! with SIGKILL under load again and again while the others keep serving: after each kill it
//! restarts from its WAL, snapshot and backend, and at the end all three members hold the same
//! data (`hash_kv`), every acknowledged write and lease, and no entry applied twice (each key
//! was put once, so its version is 1 and the revision equals the number of keys). Rounds:
//! `KEEL_CRASH_ROUNDS` (default 10); the member's role runs in a child process started from
//! this test binary (`member_process::member_child`, ignored otherwise).

use std::collections::BTreeSet;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use keel_raft_glue::testing::{TestBackend, fast_options};
use keel_raft_glue::{Member, Node, NodeConfig, NodeOptions, TcpOptions, TcpTransport};
use rand::{Rng, SeedableRng};

const T: Duration = Duration::from_secs(20);
const DIR_VAR: &str = "KEEL_MEMBER_PROC_DIR";
const ADDRS_VAR: &str = "KEEL_MEMBER_PROC_ADDRS";
const ROUND_VAR: &str = "KEEL_MEMBER_PROC_ROUND";
/// The member that runs in the child process.
const CHILD: u64 = 3;

type N = Arc<Node<TestBackend>>;

fn options() -> NodeOptions {
    NodeOptions {
        snapshot_count: 300,
        snapshot_catch_up_entries: 50,
        ..fast_options()
    }
}

fn members(addrs: &[String]) -> Vec<Member> {
    addrs
        .iter()
        .enumerate()
        .map(|(i, a)| Member {
            id: i as u64 + 1,
            name: format!("member-{}", i + 1),
            peer_urls: vec![format!("http://{a}")],
            client_urls: Vec::new(),
            is_learner: false,
        })
        .collect()
}

/// Starts member `id` of the three over TCP, listening on its address in `addrs`.
fn start(root: &Path, id: u64, addrs: &[String]) -> N {
    let (t, mailbox) =
        TcpTransport::bind(id, addrs[id as usize - 1].as_str(), TcpOptions::default())
            .expect("bind the member's address");
    let mut cfg = NodeConfig::<TestBackend>::new(id, vec![1, 2, 3], member_dir(root, id));
    cfg.options = options();
    cfg.members = members(addrs);
    Arc::new(Node::start(cfg, Arc::new(t), mailbox).expect("start member"))
}

fn member_dir(root: &Path, id: u64) -> PathBuf {
    root.join(format!("member-{id}"))
}

/// Puts unique keys (and grants a lease now and then) through `node` until `stop`, calling
/// `ack` after each acknowledged one.
fn write_load(node: &N, prefix: &str, stop: &AtomicBool, mut ack: impl FnMut(String)) {
    for i in 0u64.. {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        if i % 50 == 7 {
            let id = (fxhash(prefix) << 24 | i) as i64 & i64::MAX;
            if node.lease_grant_id(id, 3600).is_ok() {
                ack(format!("lease {id}"));
            }
            continue;
        }
        let key = format!("{prefix}-{i:06}");
        if node.put(key.as_bytes(), b"v").is_ok() {
            ack(format!("ack {key}"));
        }
    }
}

/// A small, stable hash of a prefix, so lease ids of different writers never collide.
fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    }) >> 24
}

/// The member's role: restarts member 3 on its data and writes through it (its proposals are
/// forwarded to the leader), printing `ack <key>` / `lease <id>` after each acknowledged one,
/// until killed.
#[test]
#[ignore]
fn member_child() {
    let (Some(dir), Some(addrs)) = (std::env::var_os(DIR_VAR), std::env::var_os(ADDRS_VAR)) else {
        return;
    };
    let round = std::env::var(ROUND_VAR).unwrap_or_default();
    let addrs: Vec<String> = addrs
        .to_string_lossy()
        .split(',')
        .map(str::to_owned)
        .collect();
    let node = start(Path::new(&dir), CHILD, &addrs);
    let stop = AtomicBool::new(false);
    write_load(&node, &format!("c{round}"), &stop, |line| {
        println!("{line}")
    });
}

fn rounds() -> u64 {
    std::env::var("KEEL_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

fn free_addr() -> String {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").to_string()
}

#[test]
fn a_sigkilled_member_process_restarts_and_converges_while_the_others_serve() {
    crate::init_tracing();
    let root = tempfile::tempdir().expect("tempdir");
    let addrs: Vec<String> = (0..3).map(|_| free_addr()).collect();
    let nodes: Vec<N> = (1..=2).map(|id| start(root.path(), id, &addrs)).collect();

    // The two in-process members write all along, through whichever of them serves.
    let acked = Arc::new(Mutex::new(BTreeSet::<String>::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = nodes
        .iter()
        .map(|n| {
            let (n, acked, stop) = (n.clone(), acked.clone(), stop.clone());
            thread::spawn(move || {
                let prefix = format!("p{}", n.id());
                write_load(&n, &prefix, &stop, |line| {
                    acked.lock().expect("lock").insert(line);
                });
            })
        })
        .collect();

    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let mut child_acks = 0usize;
    for round in 0..rounds() {
        // Kill it at a random moment once its own writes are acknowledged.
        let wait = Duration::from_millis(rng.random_range(200..800));
        let lines = crate::run_killed(
            "member_process::member_child",
            &[
                (DIR_VAR, root.path().display().to_string()),
                (ADDRS_VAR, addrs.join(",")),
                (ROUND_VAR, round.to_string()),
            ],
            5,
            wait,
            T,
        );
        child_acks += lines.len();
        acked.lock().expect("lock").extend(lines.iter().cloned());
    }
    assert!(child_acks > 0, "member 3's own writes were acknowledged");

    // Member 3 once more, in this process, then a barrier every member must apply.
    let third = start(root.path(), CHILD, &addrs);
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.join().expect("writer");
    }
    let all = [nodes[0].clone(), nodes[1].clone(), third];
    let barrier = all
        .iter()
        .find_map(|n| n.put(b"barrier", b"b").ok())
        .or_else(|| {
            thread::sleep(Duration::from_secs(1));
            all.iter().find_map(|n| n.put(b"barrier", b"b").ok())
        })
        .expect("barrier write");
    let deadline = Instant::now() + T;
    while all
        .iter()
        .any(|n| n.store().current_revision() < barrier.revision)
    {
        assert!(Instant::now() < deadline, "members converge on the barrier");
        thread::sleep(Duration::from_millis(10));
    }

    let acked = acked.lock().expect("lock");
    let keys: BTreeSet<String> = acked
        .iter()
        .filter_map(|l| l.strip_prefix("ack ").map(str::to_owned))
        .collect();
    let leases: BTreeSet<i64> = acked
        .iter()
        .filter_map(|l| l.strip_prefix("lease ").and_then(|v| v.parse().ok()))
        .collect();
    assert!(
        keys.len() > 100,
        "writes were acknowledged ({})",
        keys.len()
    );
    let hash = all[0].hash_kv(barrier.revision).expect("hash").hash;
    for n in &all {
        crate::assert_acknowledged_applied_once(n, &keys, &leases);
        assert_eq!(
            n.hash_kv(barrier.revision).expect("hash").hash,
            hash,
            "member {} holds the same data",
            n.id()
        );
    }
    eprintln!(
        "{} kills of member 3: {} acknowledged puts ({child_acks} lines from member 3) and {} leases on all three members",
        rounds(),
        keys.len(),
        leases.len()
    );
}
