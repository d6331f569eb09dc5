//! Writes replicate to every member; a killed leader is replaced without losing an
//! acknowledged write; a partitioned minority cannot commit and its stale leader steps down.

use std::time::Duration;

use keel_mvcc::RangeRequest;
use keel_raft_glue::testing::{Cluster, TestBackend, fast_options};
use keel_raft_glue::{NodeError, ReadConsistency, Role};

const T: Duration = Duration::from_secs(10);

fn replicate(n: u64) {
    crate::init_tracing();
    let c = Cluster::<TestBackend>::new(n, fast_options(), n).expect("cluster");
    let leader = c.wait_leader(T).expect("leader");
    let node = c.node(leader).expect("leader runs");
    let mut last = 0;
    for i in 0..50u32 {
        let r = node
            .put(format!("k{i}").as_bytes(), format!("v{i}").as_bytes())
            .expect("put");
        assert!(r.revision > last, "revision {} after {last}", r.revision);
        last = r.revision;
    }
    // Proposals made on a follower reach the leader.
    let follower = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("a follower");
    c.node(follower)
        .expect("follower runs")
        .put(b"from-follower", b"yes")
        .expect("forwarded put");
    let applied = c.wait_converged(1, T).expect("converged");
    for n in c.running() {
        let r = n
            .range(
                &RangeRequest::prefix(b"k".to_vec()),
                ReadConsistency::Serializable,
            )
            .expect("range");
        assert_eq!(r.count, 50, "member {} holds every key", n.id());
        let s = n.status();
        assert_eq!(s.applied, applied);
        assert_eq!(s.voters, c.ids());
    }
    assert_eq!(
        c.get(follower, b"from-follower").expect("read"),
        Some(b"yes".to_vec())
    );
}

#[test]
fn three_members_replicate() {
    replicate(3);
}

#[test]
fn five_members_replicate() {
    replicate(5);
}

#[test]
fn killed_leader_is_replaced_and_no_acknowledged_write_is_lost() {
    crate::init_tracing();
    let mut c = Cluster::<TestBackend>::new(3, fast_options(), 7).expect("cluster");
    let mut acked = Vec::new();
    for round in 0..3u32 {
        let leader = c.wait_leader(T).expect("leader");
        for i in 0..20u32 {
            let key = format!("r{round}-{i}");
            c.put(key.as_bytes(), b"x", T).expect("put");
            acked.push(key);
        }
        c.kill(leader);
        let new_leader = c.wait_leader(T).expect("a new leader");
        assert_ne!(new_leader, leader);
        for key in &acked {
            assert_eq!(
                c.get(new_leader, key.as_bytes()).expect("read"),
                Some(b"x".to_vec()),
                "acknowledged {key} survives the leader's death"
            );
        }
        c.start(leader).expect("restart");
    }
    c.wait_converged(1, T).expect("converged after restarts");
}

#[test]
fn minority_cannot_commit_and_its_stale_leader_steps_down() {
    crate::init_tracing();
    let c = Cluster::<TestBackend>::new(5, fast_options(), 11).expect("cluster");
    let old = c.wait_leader(T).expect("leader");
    c.put(b"before", b"1", T).expect("put");
    let others: Vec<u64> = c.ids().into_iter().filter(|&i| i != old).collect();
    let minority = vec![old, others[0]];
    let majority: Vec<u64> = others[1..].to_vec();
    c.net.partition(&minority, &majority);

    // The majority elects a leader of its own.
    let start = std::time::Instant::now();
    let new = loop {
        let l = majority
            .iter()
            .filter_map(|&i| c.node(i))
            .find(|n| n.status().role == Role::Leader);
        if let Some(l) = l {
            break l;
        }
        assert!(start.elapsed() < T, "majority elects a leader");
        std::thread::sleep(Duration::from_millis(10));
    };
    new.put(b"after", b"2").expect("majority commits");

    // The old leader steps down (check_quorum) and cannot commit.
    let old_node = c.node(old).expect("old leader runs");
    let start = std::time::Instant::now();
    while old_node.status().role == Role::Leader {
        assert!(start.elapsed() < T, "stale leader steps down");
        std::thread::sleep(Duration::from_millis(10));
    }
    let err = old_node
        .put(b"lost", b"3")
        .expect_err("minority cannot commit");
    assert!(
        matches!(
            err,
            NodeError::NotLeader { .. }
                | NodeError::Timeout { .. }
                | NodeError::ProposalDropped { .. }
        ),
        "{err}"
    );
    let err = old_node
        .range(
            &RangeRequest::key(b"after".to_vec()),
            ReadConsistency::Linearizable,
        )
        .expect_err("no linearizable read in the minority");
    assert!(
        matches!(err, NodeError::NotLeader { .. } | NodeError::Timeout { .. }),
        "{err}"
    );

    c.net.heal();
    c.wait_converged(1, T).expect("converged after healing");
    assert_eq!(c.get(old, b"after").expect("read"), Some(b"2".to_vec()));
    assert_eq!(
        c.get(old, b"lost").expect("read"),
        None,
        "the minority write never committed"
    );
}
