//! A follower behind the compacted log receives the leader's backend as a checksummed stream,
//! installs it and converges (same `hash_kv`); corrupted transfers are refused and retried;
//! a transfer abandoned mid-stream is dropped after its idle timeout.

use std::thread;
use std::time::{Duration, Instant};

use keel_mvcc::{Backend, RangeRequest};
use keel_raft_glue::testing::{Cluster, TestBackend, fast_options};
use keel_raft_glue::{
    NodeOptions, ReadConsistency, SnapshotAck, SnapshotChunk, SnapshotFrame, Transport,
};

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

/// An incoming transfer whose sender goes silent mid-stream is dropped once it has had no
/// chunk for `snapshot_idle_timeout`: its restore is abandoned and the next generation's
/// directory removed, the sender is answered with a refusal, and later chunks of it, the
/// first one included, are refused instead of starting it again.
#[test]
fn an_abandoned_incoming_transfer_is_dropped_and_its_late_chunks_refused() {
    crate::init_tracing();
    let opts = NodeOptions {
        snapshot_idle_timeout: Duration::from_millis(300),
        ..options()
    };
    let c = Cluster::<TestBackend>::new(1, opts, 24).expect("cluster");
    c.wait_leader(T).expect("leader");
    for i in 0..50u32 {
        c.put(format!("s{i:03}").as_bytes(), &[7u8; 100], T)
            .expect("put");
    }
    let n = c.node(1).expect("runs");
    // A real stream: the receiver's restore parses its first half and waits for the rest.
    let mut stream = Vec::new();
    let txn = n.store().backend().read_txn().expect("read txn");
    keel_mvcc::backend::snapshot::write(&txn, &mut stream).expect("stream");
    drop(txn);
    let (head, tail) = stream.split_at(stream.len() / 2);
    // Member 9 plays a leader that dies after its first chunk.
    let (sender, mailbox) = c.net.register(9);
    let chunk = |seq: u32, data: &[u8]| {
        SnapshotFrame::Chunk(SnapshotChunk {
            from: 9,
            to: 1,
            transfer: 77,
            seq,
            message: (seq == 0).then(Box::default),
            data: data.to_vec(),
            crc: crc32fast::hash(data),
            end: None,
        })
    };
    let answer = || -> SnapshotAck {
        match mailbox.snapshots.recv_timeout(T) {
            Ok(SnapshotFrame::Ack(a)) => a,
            other => panic!("expected an answer to the transfer, got {other:?}"),
        }
    };
    let restore_dir = c.dir(1).expect("dir").join("backend-1");
    sender.send_snapshot(chunk(0, head)).expect("send");
    let deadline = Instant::now() + T;
    while !restore_dir.exists() {
        assert!(Instant::now() < deadline, "the restore never began");
        thread::sleep(Duration::from_millis(10));
    }

    let ack = answer();
    assert_eq!((ack.from, ack.to, ack.transfer), (1, 9, 77));
    let error = ack.error.expect("a refusal");
    assert!(error.contains("no chunk for"), "{error}");
    assert!(
        !restore_dir.exists(),
        "the abandoned restore's directory is removed"
    );
    assert_eq!(n.status().snapshots_refused, 1);

    // The rest of the stream, late, and its first chunk again: both refused.
    sender.send_snapshot(chunk(1, tail)).expect("send");
    let error = answer().error.expect("a refusal");
    assert!(error.contains("was dropped"), "{error}");
    sender.send_snapshot(chunk(0, head)).expect("send");
    let error = answer().error.expect("a refusal");
    assert!(error.contains("was dropped"), "{error}");
    assert!(
        !restore_dir.exists(),
        "the dropped transfer did not restart"
    );
    assert_eq!(n.status().snapshots_refused, 3);
    c.put(b"after", b"1", T).expect("the member goes on");
}
