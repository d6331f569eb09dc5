//! A follower behind the compacted log receives the leader's backend as a checksummed stream,
//! installs it and converges (same `hash_kv`); corrupted transfers are refused and retried.

use std::time::Duration;

use keel_mvcc::RangeRequest;
use keel_raft_glue::testing::{Cluster, TestBackend, fast_options};
use keel_raft_glue::{NodeOptions, ReadConsistency};

const T: Duration = Duration::from_secs(20);

fn options() -> NodeOptions {
    NodeOptions {
        snapshot_count: 40,
        snapshot_catch_up_entries: 10,
        snapshot_chunk_bytes: 2048,
        ..fast_options()
    }
}

fn far_behind(corrupt: u32, seed: u64) {
    crate::init_tracing();
    let mut c = Cluster::<TestBackend>::new(3, options(), seed).expect("cluster");
    let leader = c.wait_leader(T).expect("leader");
    let lagging = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("follower");
    c.put(b"early", b"1", T).expect("put");
    c.wait_converged(1, T).expect("converged");
    c.kill(lagging);
    let value = vec![0xabu8; 200];
    for i in 0..300u32 {
        c.put(format!("key-{i:04}").as_bytes(), &value, T)
            .expect("put");
    }
    let l = c
        .node(c.wait_leader(T).expect("leader"))
        .expect("leader runs");
    let s = l.status();
    assert!(
        s.first_index > 20,
        "the leader compacted its log (first index {})",
        s.first_index
    );
    c.net.corrupt_snapshot_chunks(corrupt);
    c.start(lagging).expect("restart the lagging follower");
    let applied = c.wait_converged(s.applied, T).expect("converged");
    let n = c.node(lagging).expect("runs");
    let st = n.status();
    assert!(
        st.snapshots_installed >= 1,
        "caught up through a snapshot: {st:?}"
    );
    if corrupt > 0 {
        assert!(
            st.snapshots_refused >= 1,
            "a corrupted transfer was refused: {st:?}"
        );
    }
    assert!(st.applied >= applied);
    let r = n
        .range(
            &RangeRequest::prefix(b"key-".to_vec()),
            ReadConsistency::Serializable,
        )
        .expect("range");
    assert_eq!(r.count, 300);
    // It keeps replicating normally afterwards.
    c.put(b"late", b"2", T).expect("put");
    c.wait_converged(applied + 1, T).expect("converged again");
    assert_eq!(c.get(lagging, b"late").expect("read"), Some(b"2".to_vec()));
}

#[test]
fn far_behind_follower_gets_a_snapshot_and_converges() {
    far_behind(0, 21);
}

#[test]
fn corrupted_snapshot_chunks_are_refused_and_the_transfer_retried() {
    far_behind(3, 22);
}

#[test]
fn snapshotted_follower_restarts_from_its_installed_state() {
    crate::init_tracing();
    let mut c = Cluster::<TestBackend>::new(3, options(), 23).expect("cluster");
    let leader = c.wait_leader(T).expect("leader");
    let lagging = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("follower");
    c.kill(lagging);
    for i in 0..200u32 {
        c.put(format!("a{i}").as_bytes(), b"v", T).expect("put");
    }
    c.start(lagging).expect("restart");
    let applied = c.wait_converged(200, T).expect("converged");
    assert!(c.node(lagging).expect("runs").status().snapshots_installed >= 1);
    c.kill(lagging);
    c.start(lagging).expect("second restart");
    c.wait_converged(applied, T)
        .expect("converged after a restart on the snapshot");
    assert_eq!(c.get(lagging, b"a199").expect("read"), Some(b"v".to_vec()));
}
