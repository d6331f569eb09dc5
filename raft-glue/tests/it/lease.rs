//! Leases through consensus: grant, attach, revoke and expiry reach every member; renew
//! works on the leader only.

use std::time::Duration;

use keel_mvcc::{PutRequest, RangeRequest, TxnOp, TxnRequest};
use keel_raft_glue::testing::{Cluster, TestBackend, fast_options};
use keel_raft_glue::{NodeError, ReadConsistency};

const T: Duration = Duration::from_secs(10);

fn count_everywhere(c: &Cluster<TestBackend>, key: &[u8]) -> Vec<usize> {
    c.running()
        .iter()
        .map(|n| {
            n.range(
                &RangeRequest::key(key.to_vec()),
                ReadConsistency::Serializable,
            )
            .map(|r| r.count)
            .unwrap_or(usize::MAX)
        })
        .collect()
}

#[test]
fn grant_attach_revoke_and_renew() {
    crate::init_tracing();
    let c = Cluster::<TestBackend>::new(3, fast_options(), 31).expect("cluster");
    let leader = c.wait_leader(T).expect("leader");
    let follower = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("follower");
    let f = c.node(follower).expect("runs");
    let (id, ttl) = f.lease_grant(60).expect("grant through a follower");
    assert!(id > 0);
    assert_eq!(ttl, 60);
    f.put_with(PutRequest {
        lease: id,
        ..PutRequest::new(b"leased".to_vec(), b"v".to_vec())
    })
    .expect("put with the lease");
    let r = f
        .txn(TxnRequest {
            success: vec![TxnOp::Put(PutRequest {
                lease: id,
                ..PutRequest::new(b"txn-leased".to_vec(), b"v".to_vec())
            })],
            ..TxnRequest::default()
        })
        .expect("txn with a leased put");
    assert!(r.succeeded);
    let ttl = f.lease_time_to_live(id, true).expect("ttl");
    assert_eq!(ttl.keys, vec![b"leased".to_vec(), b"txn-leased".to_vec()]);
    let err = f.lease_renew(id).expect_err("renew on a follower");
    assert!(
        matches!(err, NodeError::NotLeader { leader: Some(l), .. } if l == leader),
        "{err}"
    );
    assert_eq!(
        c.node(leader)
            .expect("runs")
            .lease_renew(id)
            .expect("renew"),
        60
    );
    c.wait_converged(1, T).expect("converged");
    for n in c.running() {
        assert_eq!(
            n.lease_list(),
            vec![id],
            "member {} knows the lease",
            n.id()
        );
    }
    f.lease_revoke(id).expect("revoke");
    c.wait_converged(1, T).expect("converged");
    assert_eq!(
        count_everywhere(&c, b"leased"),
        vec![0, 0, 0],
        "keys go with the lease"
    );
    for n in c.running() {
        assert!(n.lease_list().is_empty());
    }
    let err = f.lease_revoke(id).expect_err("revoked twice");
    assert!(err.to_string().contains("lease not found"), "{err}");
}

#[test]
fn expired_lease_is_revoked_by_the_leader_everywhere() {
    crate::init_tracing();
    let c = Cluster::<TestBackend>::new(3, fast_options(), 32).expect("cluster");
    c.wait_leader(T).expect("leader");
    let n = c.node(c.wait_leader(T).expect("leader")).expect("runs");
    let (id, _) = n.lease_grant_id(77, 5).expect("grant");
    n.put_with(PutRequest {
        lease: id,
        ..PutRequest::new(b"ephemeral".to_vec(), b"v".to_vec())
    })
    .expect("put");
    c.wait_converged(1, T).expect("converged");
    assert_eq!(count_everywhere(&c, b"ephemeral"), vec![1, 1, 1]);
    c.clock.advance(Duration::from_secs(3));
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        count_everywhere(&c, b"ephemeral"),
        vec![1, 1, 1],
        "not expired yet"
    );
    c.clock.advance(Duration::from_secs(10));
    let start = std::time::Instant::now();
    while count_everywhere(&c, b"ephemeral") != vec![0, 0, 0] {
        assert!(start.elapsed() < T, "expired lease revoked on every member");
        std::thread::sleep(Duration::from_millis(20));
    }
    c.wait_converged(1, T).expect("converged");
    for n in c.running() {
        assert!(
            n.lease_list().is_empty(),
            "member {} dropped the lease",
            n.id()
        );
    }
}

/// A leader cut off from the others does not renew a lease: it still believes it leads
/// until its check-quorum timeout, but the renewal waits for a quorum to confirm its
/// leadership, which never comes, while the others elect a new leader.
#[test]
fn a_leader_cut_off_from_the_others_does_not_renew() {
    crate::init_tracing();
    let c = Cluster::<TestBackend>::new(3, fast_options(), 47).expect("cluster");
    let leader = c.wait_leader(T).expect("leader");
    let old = c.node(leader).expect("runs");
    let (id, _) = old.lease_grant(60).expect("grant");
    assert_eq!(old.lease_renew(id).expect("renew while connected"), 60);
    c.net.isolate(leader);
    let err = old
        .lease_renew(id)
        .expect_err("a renewal on a leader cut off from the others");
    assert!(
        matches!(err, NodeError::NotLeader { .. } | NodeError::Timeout { .. }),
        "{err}"
    );
    c.net.heal();
}
