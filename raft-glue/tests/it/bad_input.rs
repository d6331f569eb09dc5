//! Bad input reaches the proposer as a typed error, and the cluster keeps serving.

use std::time::Duration;

use keel_mvcc::{DeleteRangeRequest, PutRequest, RangeRequest};
use keel_raft_glue::testing::{Cluster, TestBackend, fast_options};
use keel_raft_glue::{LeaseCheckpoint, NodeError, ReadConsistency, Request};

const T: Duration = Duration::from_secs(10);

#[test]
fn bad_requests_get_typed_errors_and_the_cluster_keeps_serving() {
    crate::init_tracing();
    let c = Cluster::<TestBackend>::new(3, fast_options(), 41).expect("cluster");
    let leader = c.wait_leader(T).expect("leader");
    let follower = c
        .ids()
        .into_iter()
        .find(|&i| i != leader)
        .expect("follower");
    for id in [leader, follower] {
        let n = c.node(id).expect("runs");
        let limit = n.options().max_request_bytes;

        let err = n.put(b"", b"v").expect_err("empty key");
        assert!(matches!(err, NodeError::InvalidRequest(_)), "{err}");

        let err = n.put(b"big", &vec![0; limit + 1]).expect_err("too large");
        assert!(
            matches!(err, NodeError::RequestTooLarge { size, limit: l } if size > limit && l == limit),
            "{err}"
        );

        let err = n
            .delete_range(DeleteRangeRequest::range(b"z".to_vec(), b"a".to_vec()))
            .expect_err("end below key");
        assert!(matches!(err, NodeError::InvalidRequest(_)), "{err}");

        let err = n
            .put_with(PutRequest {
                lease: 12345,
                ..PutRequest::new(b"k".to_vec(), b"v".to_vec())
            })
            .expect_err("unknown lease");
        assert!(err.to_string().contains("lease not found"), "{err}");

        let err = n.compact(1_000_000).expect_err("future revision");
        assert!(err.to_string().contains("future revision"), "{err}");

        let err = n.lease_grant(0).expect_err("ttl 0");
        assert!(matches!(err, NodeError::InvalidRequest(_)), "{err}");

        let err = n
            .range(
                &RangeRequest::range(b"z".to_vec(), b"a".to_vec()),
                ReadConsistency::Linearizable,
            )
            .expect_err("bad range");
        assert!(matches!(err, NodeError::InvalidRequest(_)), "{err}");

        let err = n.remove_member(0).expect_err("member 0");
        assert!(matches!(err, NodeError::Membership(_)), "{err}");

        // Only the leader's lessor produces lease checkpoints: one from outside could set
        // any lease's remaining TTL.
        let err = n
            .propose(Request::LeaseCheckpoint(vec![LeaseCheckpoint {
                id: 1,
                remaining_ttl: i64::MAX,
            }]))
            .expect_err("a lease checkpoint from a client");
        assert!(matches!(err, NodeError::InvalidRequest(_)), "{err}");

        // The cluster keeps serving.
        let r = n
            .put(b"after", format!("{id}").as_bytes())
            .expect("put after bad input");
        assert!(r.revision > 0);
    }
    let applied = c.wait_converged(1, T).expect("converged");
    for n in c.running() {
        assert_eq!(n.status().applied, applied);
        assert_eq!(
            c.get(n.id(), b"after").expect("read"),
            Some(format!("{follower}").into_bytes())
        );
    }
}
