//! Linearizability: concurrent clients run puts and linearizable gets on a few keys against a
//! cluster under partitions and member restarts; a Wing–Gong checker (with its own tests
//! here) finds zero violations. More rounds: `KEEL_LIN_ROUNDS=20 cargo test -p
//! keel-raft-glue --test it linearizability`. Reads waiting on a leader that steps down fail
//! at once as `NotLeader`.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use keel_mvcc::RangeRequest;
use keel_raft_glue::testing::{Cluster, TestBackend, fast_options};
use keel_raft_glue::{Node, NodeError, NodeOptions, ReadConsistency, Role};
use rand::{Rng, SeedableRng};

/// What an operation on one register did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Wrote the value.
    Put(u64),
    /// Read the value (`None`: absent).
    Get(Option<u64>),
}

/// One operation of a history: invoked at `call`, answered at `ret` (`None`: no answer, it
/// may or may not have taken effect).
#[derive(Clone, Copy, Debug)]
pub struct Op {
    /// The operation.
    pub kind: Kind,
    /// Invocation time (any monotonic unit).
    pub call: u64,
    /// Response time, `None` when unknown.
    pub ret: Option<u64>,
}

/// Wing & Gong's search (with Lowe's memoisation of `(linearized set, state)`): is there an
/// order of the operations, consistent with real time, in which every read returns the last
/// write? Unanswered writes may take effect at any point after their invocation, or never.
pub fn linearizable(ops: &[Op]) -> bool {
    let words = ops.len().div_ceil(64).max(1);
    let mut seen: HashSet<(Vec<u64>, Option<u64>)> = HashSet::new();
    let mut done = vec![0u64; words];
    search(ops, &mut done, None, &mut seen)
}

fn search(
    ops: &[Op],
    done: &mut Vec<u64>,
    state: Option<u64>,
    seen: &mut HashSet<(Vec<u64>, Option<u64>)>,
) -> bool {
    let is_done = |d: &Vec<u64>, i: usize| d[i / 64] & (1 << (i % 64)) != 0;
    // Every answered operation is placed: the rest (unanswered writes) may never happen.
    let mut min_ret = u64::MAX;
    let mut all = true;
    for (i, op) in ops.iter().enumerate() {
        if !is_done(done, i)
            && let Some(r) = op.ret
        {
            all = false;
            min_ret = min_ret.min(r);
        }
    }
    if all {
        return true;
    }
    for (i, op) in ops.iter().enumerate() {
        // Op i can go next only if it was invoked before every remaining answer.
        if is_done(done, i) || op.call > min_ret {
            continue;
        }
        let next = match op.kind {
            Kind::Put(v) => Some(v),
            Kind::Get(v) if v == state => state,
            Kind::Get(_) => continue,
        };
        done[i / 64] |= 1 << (i % 64);
        if seen.insert((done.clone(), next)) && search(ops, done, next, seen) {
            return true;
        }
        done[i / 64] &= !(1 << (i % 64));
    }
    false
}

fn op(kind: Kind, call: u64, ret: Option<u64>) -> Op {
    Op { kind, call, ret }
}

#[test]
fn checker_accepts_linearizable_histories() {
    use Kind::*;
    // Sequential.
    assert!(linearizable(&[
        op(Get(None), 0, Some(1)),
        op(Put(1), 2, Some(3)),
        op(Get(Some(1)), 4, Some(5)),
    ]));
    // Concurrent put and gets: either order is fine while overlapping.
    assert!(linearizable(&[
        op(Put(1), 0, Some(10)),
        op(Get(None), 1, Some(2)),
        op(Get(Some(1)), 3, Some(4)),
    ]));
    // An unanswered put may have happened...
    assert!(linearizable(&[
        op(Put(1), 0, None),
        op(Get(Some(1)), 5, Some(6)),
    ]));
    // ...or not.
    assert!(linearizable(&[
        op(Put(1), 0, None),
        op(Get(None), 5, Some(6))
    ]));
}

#[test]
fn checker_rejects_violations() {
    use Kind::*;
    // Stale read after a completed write.
    assert!(!linearizable(&[
        op(Put(1), 0, Some(1)),
        op(Put(2), 2, Some(3)),
        op(Get(Some(1)), 4, Some(5)),
    ]));
    // A value never written.
    assert!(!linearizable(&[
        op(Put(1), 0, Some(1)),
        op(Get(Some(7)), 2, Some(3))
    ]));
    // Reads going back in time: once 2 was seen, 1 cannot be seen again.
    assert!(!linearizable(&[
        op(Put(1), 0, Some(1)),
        op(Put(2), 2, Some(20)),
        op(Get(Some(2)), 3, Some(4)),
        op(Get(Some(1)), 5, Some(6)),
    ]));
    // A lost acknowledged write: the read after it sees the initial state.
    assert!(!linearizable(&[
        op(Put(1), 0, Some(1)),
        op(Get(None), 2, Some(3))
    ]));
}

#[test]
fn checker_handles_larger_concurrent_histories() {
    // Five clients on one register, each write seen by a later read: linearizable; then the
    // same history with one read made stale is not.
    let mut ops = Vec::new();
    let mut t = 0;
    for v in 1..=60u64 {
        ops.push(op(Kind::Put(v), t, Some(t + 3)));
        ops.push(op(Kind::Get(Some(v)), t + 4, Some(t + 6)));
        ops.push(op(Kind::Get(Some(v)), t + 1, Some(t + 7)));
        t += 8;
    }
    assert!(linearizable(&ops));
    ops.push(op(Kind::Get(Some(3)), t, Some(t + 1)));
    assert!(!linearizable(&ops));
}

fn rounds() -> u64 {
    std::env::var("KEEL_LIN_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

#[test]
fn cluster_histories_are_linearizable_under_partitions_and_restarts() {
    crate::init_tracing();
    for round in 0..rounds() {
        let seed = 1000 + round;
        let violations = run_round(seed);
        assert_eq!(violations, Vec::<String>::new(), "seed {seed}");
    }
}

fn run_round(seed: u64) -> Vec<String> {
    const KEYS: u64 = 3;
    const CLIENTS: u64 = 4;
    let options = keel_raft_glue::NodeOptions {
        request_timeout: Duration::from_millis(800),
        ..fast_options()
    };
    let cluster = Arc::new(Mutex::new(
        Cluster::<TestBackend>::new(3, options, seed).expect("cluster"),
    ));
    cluster
        .lock()
        .expect("lock")
        .wait_leader(Duration::from_secs(10))
        .expect("leader");
    let origin = Instant::now();
    let now = move || origin.elapsed().as_micros() as u64;
    let stop = Arc::new(AtomicBool::new(false));
    let history: Arc<Mutex<HashMap<u64, Vec<Op>>>> = Arc::new(Mutex::new(HashMap::new()));

    let mut clients = Vec::new();
    for client in 0..CLIENTS {
        let (cluster, stop, history) = (cluster.clone(), stop.clone(), history.clone());
        clients.push(thread::spawn(move || {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed * 100 + client);
            let mut counter = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = rng.random_range(0..KEYS);
                let target = rng.random_range(1..=3u64);
                let Some(node) = cluster.lock().expect("lock").node(target) else {
                    thread::sleep(Duration::from_millis(5));
                    continue;
                };
                let k = format!("key{key}").into_bytes();
                let call = now();
                let op = if rng.random_bool(0.5) {
                    counter += 1;
                    let v = (client << 32) | counter;
                    let r = node.put(&k, &v.to_le_bytes());
                    Some(Op {
                        kind: Kind::Put(v),
                        call,
                        ret: r.is_ok().then(now),
                    })
                } else {
                    match node.range(&RangeRequest::key(k), ReadConsistency::Linearizable) {
                        Ok(r) => {
                            let v = r.kvs.first().map(|kv| {
                                let mut a = [0u8; 8];
                                a.copy_from_slice(kv.value());
                                u64::from_le_bytes(a)
                            });
                            Some(Op {
                                kind: Kind::Get(v),
                                call,
                                ret: Some(now()),
                            })
                        }
                        Err(NodeError::NotLeader { .. })
                        | Err(NodeError::Timeout { .. })
                        | Err(NodeError::Stopped { .. }) => None,
                        Err(e) => panic!("unexpected read error: {e}"),
                    }
                };
                if let Some(op) = op {
                    history
                        .lock()
                        .expect("lock")
                        .entry(key)
                        .or_default()
                        .push(op);
                }
            }
        }));
    }

    // The nemesis: partitions, isolation, a leader kill and restart, then healing.
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    for step in 0..6 {
        thread::sleep(Duration::from_millis(250));
        let mut c = cluster.lock().expect("lock");
        match step % 3 {
            0 => {
                let victim = rng.random_range(1..=3u64);
                c.net.isolate(victim);
            }
            1 => {
                c.net.heal();
                if let Some(l) = c.leader() {
                    c.kill(l);
                    drop(c);
                    thread::sleep(Duration::from_millis(200));
                    c = cluster.lock().expect("lock");
                    c.start(l).expect("restart");
                }
            }
            _ => {
                c.net.heal();
                let a = rng.random_range(1..=3u64);
                let b = a % 3 + 1;
                c.net.cut_one_way(a, b);
            }
        }
    }
    cluster.lock().expect("lock").net.heal();
    thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().expect("client thread");
    }
    let history = history.lock().expect("lock");
    let mut violations = Vec::new();
    let mut total = 0;
    for (key, ops) in history.iter() {
        total += ops.len();
        if !linearizable(ops) {
            violations.push(format!(
                "key{key}: {} operations not linearizable",
                ops.len()
            ));
        }
    }
    let completed_puts: usize = history
        .values()
        .flatten()
        .filter(|o| matches!(o.kind, Kind::Put(_)) && o.ret.is_some())
        .count();
    assert!(
        completed_puts > 10,
        "the cluster made progress ({completed_puts} puts)"
    );
    eprintln!("seed {seed}: {total} operations checked, {completed_puts} acknowledged puts");
    violations
}

/// A leader cut off from the others steps down (check quorum). The linearizable read and the
/// lease renewal waiting on its read index then fail at once as `NotLeader` (etcd: "leader
/// changed"), so that their clients go to another member, instead of waiting out their
/// request timeout: raft-rs drops the read-index requests of a leader that steps down.
#[test]
fn reads_waiting_on_a_leader_that_steps_down_fail_as_not_leader() {
    crate::init_tracing();
    let options = NodeOptions {
        // The leader steps down 0.3 to 0.6 s after it is cut off: the reads below are asked
        // of it while it still leads.
        election_ticks: 30,
        // Far longer than that, so that waiting it out cannot pass for failing at once.
        request_timeout: Duration::from_secs(20),
        ..fast_options()
    };
    let c = Cluster::<TestBackend>::new(3, options, 42).expect("cluster");
    let id = c.wait_leader(Duration::from_secs(10)).expect("leader");
    let leader = c.node(id).expect("runs");
    let (lease, _) = leader.lease_grant(60).expect("grant");
    leader.read_index().expect("a read on the leader");
    leader.lease_renew(lease).expect("a renewal on the leader");

    c.net.isolate(id);
    let started = Instant::now();
    let read = {
        let n = leader.clone();
        thread::spawn(move || n.read_index().map(drop))
    };
    let renew = {
        let n = leader.clone();
        thread::spawn(move || n.lease_renew(lease).map(drop))
    };
    let results = [
        ("linearizable read", read.join().expect("caller thread")),
        ("lease renewal", renew.join().expect("caller thread")),
    ];
    let elapsed = started.elapsed();
    for (what, result) in &results {
        assert!(
            matches!(result, Err(NodeError::NotLeader { id: m, .. }) if *m == id),
            "{what} on the leader cut off: {result:?} after {elapsed:?} ({results:?})"
        );
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "failed at the step-down, not at the request timeout: {:?}",
        started.elapsed()
    );
    assert_ne!(leader.status().role, Role::Leader);
}

/// A cluster of three members run with `options` (seeded with `seed`), the id of its
/// leader, and a follower of it that has completed a read while connected.
fn a_follower_that_read(
    options: NodeOptions,
    seed: u64,
) -> (Cluster<TestBackend>, u64, Arc<Node<TestBackend>>) {
    let c = Cluster::<TestBackend>::new(3, options, seed).expect("cluster");
    let leader = c.wait_leader(Duration::from_secs(10)).expect("leader");
    let id = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("a follower");
    let node = c.node(id).expect("runs");
    node.read_index().expect("a read while connected");
    (c, leader, node)
}

/// A follower cut off from the others, its read asked of a leader it then stops hearing from,
/// fails the read with `NotLeader` once it has no leader (it campaigns, or pre-campaigns):
/// the old leader's answer would be dropped, and nothing asks again until a leader is known.
#[test]
fn reads_of_a_follower_that_loses_its_leader_fail_as_not_leader() {
    crate::init_tracing();
    for pre_vote in [true, false] {
        let options = NodeOptions {
            request_timeout: Duration::from_secs(20),
            pre_vote,
            ..fast_options()
        };
        let (c, _, node) = a_follower_that_read(options, 7);
        let id = node.id();
        c.net.isolate(id);
        let started = Instant::now();
        let r = node.read_index();
        assert!(
            matches!(r, Err(NodeError::NotLeader { .. })),
            "pre_vote {pre_vote}: {r:?} after {:?}",
            started.elapsed()
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "pre_vote {pre_vote}: failed only after {:?}",
            started.elapsed()
        );
    }
}

/// A follower that loses its leader for a moment (cut off until it pre-campaigns, which
/// keeps it in its term) and hears from that same leader again in that term keeps the read
/// it had asked of it: the round can still be answered, and the read completes rather than
/// failing with `NotLeader`.
#[test]
fn a_read_outlives_a_follower_losing_and_finding_its_leader_in_the_same_term() {
    crate::init_tracing();
    let options = NodeOptions {
        // An election timeout of 500 ms at least: time to heal once the follower has
        // pre-campaigned, before it gives the round up.
        tick_interval: Duration::from_millis(50),
        request_timeout: Duration::from_secs(20),
        pre_vote: true,
        ..fast_options()
    };
    let (c, leader, node) = a_follower_that_read(options, 11);
    let id = node.id();
    let term = node.status().term;
    c.net.isolate(id);
    let started = Instant::now();
    let reader = {
        let node = node.clone();
        thread::spawn(move || node.read_index())
    };
    while node.status().leader.is_some() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the cut-off follower still follows its leader"
        );
        thread::sleep(Duration::from_millis(2));
    }
    let lost = node.status();
    assert_eq!(
        (lost.role, lost.term),
        (Role::PreCandidate, term),
        "a pre-candidate in its term"
    );
    c.net.heal();
    let r = reader.join().expect("reader");
    let healed = Instant::now();
    while node.status().leader.is_none() && healed.elapsed() < Duration::from_secs(5) {
        thread::sleep(Duration::from_millis(2));
    }
    let found = node.status();
    assert_eq!(
        (found.leader, found.term),
        (Some(leader), term),
        "the same leader in the same term"
    );
    assert!(
        r.is_ok(),
        "the read asked of member {leader} before member {id} lost it and found it again \
         in term {term}: {r:?} after {:?}",
        started.elapsed()
    );
}

/// A follower that hears from its leader again in a later term, that leader having stepped
/// down and won again meanwhile, fails at once the read it had asked of it in the earlier
/// term: the leader's new term dropped the round, and nothing in the follower's own state
/// (still a follower of the same leader) changed for it to notice otherwise.
///
/// Without pre-vote or check-quorum, so that a campaign of member `o` makes the leader `l`
/// step down into a new term, and `l`'s campaign right after wins the next: `l` refuses
/// `o` its vote, holding an entry `o` lacks. The follower `m` is cut off throughout, for far
/// less than its election timeout (so it never campaigns), and first hears of the new terms
/// from `l` as the leader.
#[test]
fn a_read_fails_when_its_leader_is_found_again_in_a_later_term() {
    crate::init_tracing();
    let options = NodeOptions {
        // An election timeout of 1 s at least: far longer than the re-election takes.
        tick_interval: Duration::from_millis(50),
        election_ticks: 20,
        request_timeout: Duration::from_secs(20),
        pre_vote: false,
        check_quorum: false,
        ..fast_options()
    };
    let (c, l, member) = a_follower_that_read(options, 13);
    let m = member.id();
    let o = c
        .ids()
        .into_iter()
        .find(|&i| i != l && i != m)
        .expect("the other follower");
    let (leader, other) = (c.node(l).expect("runs"), c.node(o).expect("runs"));
    let term = member.status().term;
    let wait = |what: &str, done: &dyn Fn() -> bool| {
        let started = Instant::now();
        while !done() {
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "{what}: {:?} {:?} {:?}",
                leader.status(),
                member.status(),
                other.status()
            );
            thread::sleep(Duration::from_millis(1));
        }
    };

    // The follower's read goes to the leader and is lost.
    c.net.isolate(m);
    let cut = Instant::now();
    let reader = {
        let member = member.clone();
        thread::spawn(move || (member.read_index(), Instant::now()))
    };
    // The leader appends an entry that `o` does not get.
    c.net.cut_one_way(l, o);
    let last = leader.status().last_index;
    let writer = {
        let leader = leader.clone();
        thread::spawn(move || leader.put(b"k", b"v").map(drop))
    };
    wait("the leader appends", &|| leader.status().last_index > last);
    // `o` campaigns: the leader steps down into term + 1 and refuses its vote.
    other.campaign().expect("campaign");
    wait("the leader steps down", &|| {
        let s = leader.status();
        s.term > term && s.role == Role::Follower
    });
    // The leader campaigns and wins the next term with `o`'s vote.
    c.net.heal();
    c.net.isolate(m);
    leader.campaign().expect("campaign");
    wait("the leader wins again", &|| {
        leader.status().role == Role::Leader
    });
    let new_term = leader.status().term;
    assert!(new_term >= term + 2, "{new_term}");
    assert!(
        cut.elapsed() < Duration::from_millis(800),
        "the follower was cut off for {:?}, near its election timeout",
        cut.elapsed()
    );
    // The follower hears from the same leader, in the new term.
    c.net.heal();
    let healed = Instant::now();
    wait("the follower hears from the leader", &|| {
        member.status().term == new_term
    });
    let found = member.status();
    assert_eq!(
        (found.leader, found.role),
        (Some(l), Role::Follower),
        "the follower of the same leader"
    );
    let (r, at) = reader.join().expect("reader");
    let after = at.saturating_duration_since(healed);
    assert!(
        matches!(r, Err(NodeError::NotLeader { id, leader: Some(x) }) if id == m && x == l)
            && after < Duration::from_millis(300),
        "the read asked of member {l} in term {term}, when member {m} heard from it in term \
         {new_term}: {r:?} {after:?} after it did"
    );
    writer
        .join()
        .expect("writer")
        .expect("the entry is committed");
}
