//! Membership operations with etcd's semantics and error texts: the error cases of etcd's
//! runtime reconfiguration guide, forwarding from a follower, learners refusing what they
//! must, removed members stopping for good, promotion only after the snapshot is applied,
//! transfer progress in member status and paced snapshots, the end of a transfer to a
//! member that is removed or from a leader that steps down (or wins a later term), and
//! additions, removals and changes of role made through raw conf changes.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use keel_mvcc::RangeRequest;
use keel_raft_glue::membership::MembershipOptions;
use keel_raft_glue::testing::{Cluster, TestBackend, fast_options};
use keel_raft_glue::{
    MemberChange, Node, NodeOptions, RateLimiter, ReadConsistency, Request, Response,
};

const T: Duration = Duration::from_secs(10);

type N = Arc<Node<TestBackend>>;

fn options() -> NodeOptions {
    NodeOptions {
        snapshot_count: 100,
        snapshot_catch_up_entries: 20,
        snapshot_chunk_bytes: 8 * 1024,
        ..fast_options()
    }
}

fn manual() -> MembershipOptions {
    MembershipOptions {
        auto_promote: false,
        active_window: Duration::from_millis(500),
        ..MembershipOptions::default()
    }
}

fn cluster(n: u64, m: MembershipOptions, seed: u64) -> (Cluster<TestBackend>, N) {
    crate::init_tracing();
    let c = Cluster::<TestBackend>::with_membership(n, options(), m, seed).expect("cluster");
    let l = c.wait_leader(T).expect("leader");
    let leader = c.node(l).expect("leader runs");
    (c, leader)
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + T;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(10));
    }
}

fn expect_err<T: std::fmt::Debug>(r: Result<T, keel_raft_glue::NodeError>, text: &str) {
    let e = r.expect_err(text);
    assert!(e.to_string().contains(text), "{e} does not say {text:?}");
}

fn follower_of(c: &Cluster<TestBackend>, leader: &N) -> N {
    let id = c.ids().into_iter().find(|&i| i != leader.id()).expect("f");
    c.node(id).expect("follower runs")
}

/// The member that leads now, once one does.
fn current_leader(c: &Cluster<TestBackend>) -> N {
    c.node(c.wait_leader(T).expect("leader"))
        .expect("leader runs")
}

/// Proposes `req` through whichever member leads, retrying on `NotLeader`: on a loaded
/// machine an election may move the lead between finding the leader and proposing.
fn propose_via_leader(c: &Cluster<TestBackend>, req: Request) -> Response {
    for _ in 0..20 {
        match current_leader(c).propose(req.clone()) {
            Err(keel_raft_glue::NodeError::NotLeader { .. }) => {
                thread::sleep(Duration::from_millis(50))
            }
            r => return r.expect("proposal"),
        }
    }
    panic!("no leader took {req:?}");
}

#[test]
fn promote_errors_are_etcds() {
    let (c, leader) = cluster(3, manual(), 1);
    expect_err(leader.member_promote(99), "member not found");
    let f = follower_of(&c, &leader);
    expect_err(
        leader.member_promote(f.id()),
        "can only promote a learner member",
    );
    leader.add_learner(4).expect("learner");
    // Never started: not in sync.
    expect_err(
        leader.member_promote(4),
        "can only promote a learner member which is in sync with leader",
    );
    // The gate holds whatever the request says of itself: a promote marked automatic (as
    // the leader's own are) from a client, or forwarded by a follower, is checked too.
    for n in [&leader, &f] {
        expect_err(
            n.member_op(keel_raft_glue::membership::MemberOp::Promote {
                id: 4,
                automatic: true,
            }),
            "can only promote a learner member which is in sync with leader",
        );
    }
    expect_err(leader.add_learner(5), "too many learner members in cluster");
}

#[test]
fn add_errors_are_etcds() {
    let (c, leader) = cluster(3, manual(), 2);
    let f = follower_of(&c, &leader);
    let m = leader
        .member_add("infra3", vec!["http://10.0.1.13:2380".into()], false)
        .expect("member add");
    assert!(m.is_learner, "learner by default");
    assert_ne!(m.id, 0);
    let listed = leader.member_list();
    assert!(listed.iter().any(|x| x.id == m.id && x.name == "infra3"));
    // Update the peer URLs (from a follower: forwarded), then collide with them.
    f.member_update_peer_urls(m.id, vec!["http://10.0.1.10:2380".into()])
        .expect("update forwarded to the leader");
    wait_until("update applied", || {
        leader
            .member_list()
            .iter()
            .any(|x| x.id == m.id && x.peer_urls == ["http://10.0.1.10:2380"])
    });
    leader.member_remove(m.id).expect("remove");
    expect_err(
        leader.member_add_member(keel_raft_glue::Member {
            id: 77,
            name: "dup".into(),
            peer_urls: vec!["mem://1".into()],
            client_urls: Vec::new(),
            is_learner: true,
        }),
        "peerURL exists",
    );
    expect_err(
        leader.member_add_member(keel_raft_glue::Member {
            id: m.id,
            name: "again".into(),
            peer_urls: vec!["http://10.0.1.20:2380".into()],
            client_urls: Vec::new(),
            is_learner: true,
        }),
        "ID removed",
    );
}

#[test]
fn follower_forwards_member_requests_and_gets_refusals_back() {
    let (c, leader) = cluster(3, manual(), 3);
    let f = follower_of(&c, &leader);
    let (voters, learners) = f.add_learner(4).expect("forwarded add");
    assert_eq!(voters.len(), 3);
    assert_eq!(learners, vec![4]);
    expect_err(f.member_promote(99), "member not found");
    expect_err(f.add_learner(5), "too many learner members in cluster");
    f.remove_member(4).expect("forwarded remove");
    wait_until("4 gone", || leader.status().learners.is_empty());
}

#[test]
fn learner_serves_serializable_reads_only_and_is_promoted_after_applying_its_snapshot() {
    let (mut c, leader) = cluster(3, manual(), 4);
    for i in 0..300u32 {
        leader
            .put(format!("k{i:04}").as_bytes(), &[9u8; 200])
            .expect("put");
    }
    assert!(leader.status().first_index > 1, "compacted");
    c.add_dir(4);
    leader.add_learner(4).expect("learner");
    c.start(4).expect("start 4");
    let n4 = c.node(4).expect("4");
    wait_until("learner applied", || {
        n4.status().applied >= leader.status().applied && n4.status().snapshots_installed >= 1
    });
    expect_err(n4.put(b"x", b"y"), "rpc not supported for learner");
    expect_err(
        n4.range(
            &RangeRequest::key(b"k0001".to_vec()),
            ReadConsistency::Linearizable,
        ),
        "rpc not supported for learner",
    );
    let r = n4
        .range(
            &RangeRequest::prefix(b"k".to_vec()),
            ReadConsistency::Serializable,
        )
        .expect("serializable read on a learner");
    assert_eq!(r.count, 300);
    // The learner serves reads once installed; its acknowledgement reaches the leader
    // just after.
    wait_until("transfer done in member status", || {
        leader
            .status()
            .transfers
            .iter()
            .any(|t| t.to == 4 && t.done && t.sent > 0)
    });
    // The gate holds once the learner reported its applied index.
    wait_until("promoted", || leader.member_promote(4).is_ok());
    wait_until("4 votes", || leader.status().voters.contains(&4));
    wait_until("4 knows it votes", || n4.status().voters.contains(&4));
    n4.put(b"from-4", b"ok")
        .expect("a promoted member takes writes");
}

#[test]
fn learner_is_promoted_automatically() {
    let m = MembershipOptions {
        auto_promote_after: Duration::from_millis(100),
        ..MembershipOptions::default()
    };
    let (mut c, leader) = cluster(3, m, 5);
    for i in 0..150u32 {
        leader.put(format!("a{i}").as_bytes(), b"v").expect("put");
    }
    c.add_dir(4);
    let (_, learners) = leader
        .add_voter(4)
        .expect("add joins as learner by default");
    assert_eq!(learners, vec![4]);
    c.start(4).expect("start 4");
    wait_until("automatic promotion", || {
        leader.status().voters.contains(&4)
    });
    let n4 = c.node(4).expect("4");
    assert!(n4.status().snapshots_installed >= 1);
    // A manual promote racing the automatic one is refused as etcd would: not a learner.
    expect_err(
        leader.member_promote(4),
        "can only promote a learner member",
    );
}

#[test]
fn removed_member_stops_and_never_runs_on_its_data_again() {
    let (mut c, leader) = cluster(3, manual(), 6);
    let f = follower_of(&c, &leader);
    let id = f.id();
    leader.put(b"before", b"1").expect("put");
    leader.remove_member(id).expect("remove");
    wait_until("removed member stops", || {
        f.put(b"x", b"y").is_err() && f.status().applied > 0 && {
            let e = f.put(b"x", b"y").expect_err("stopped");
            e.to_string()
                .contains("this member has been permanently removed from the cluster")
        }
    });
    drop(f);
    c.kill(id);
    expect_err(
        c.start(id),
        "this member has been permanently removed from the cluster",
    );
    assert!(leader.put(b"after", b"2").is_ok(), "two voters left");
}

#[test]
fn member_removed_while_down_is_told_on_restart() {
    let (mut c, leader) = cluster(3, manual(), 7);
    let id = c.ids().into_iter().find(|&i| i != leader.id()).expect("f");
    c.kill(id);
    thread::sleep(Duration::from_millis(600));
    leader.remove_member(id).expect("remove the down member");
    c.start(id).expect("its data still opens");
    let n = c.node(id).expect("runs");
    wait_until("told it was removed", || {
        n.put(b"x", b"y").is_err_and(|e| {
            e.to_string()
                .contains("this member has been permanently removed from the cluster")
        })
    });
    drop(n);
    c.kill(id);
    expect_err(c.start(id), "permanently removed");
}

#[test]
fn start_configuration_must_match_the_cluster() {
    let (mut c, leader) = cluster(3, manual(), 8);
    // Member 3 may be the leader: its handle must be gone before the kill, or its backend
    // stays open and the restarts below fail on the lock instead of on the configuration.
    drop(leader);
    c.kill(3);
    let three: Vec<(String, Vec<String>)> = (1..=3)
        .map(|i| (format!("member-{i}"), vec![format!("mem://{i}")]))
        .collect();
    let mut two = three.clone();
    two.pop();
    let two2 = two.clone();
    expect_err(
        c.start_with(3, move |cfg| cfg.start_config = Some(two2.clone())),
        "the member count is unequal",
    );
    let mut wrong = three.clone();
    wrong[2].1 = vec!["mem://14".into()];
    expect_err(
        c.start_with(3, move |cfg| cfg.start_config = Some(wrong.clone())),
        "unmatched member while checking PeerURLs",
    );
    c.start_with(3, move |cfg| cfg.start_config = Some(three.clone()))
        .expect("matching configuration");
}

#[test]
fn snapshots_are_paced_on_the_in_memory_network() {
    let (mut c, leader) = cluster(3, manual(), 9);
    for i in 0..300u32 {
        leader
            .put(format!("p{i:04}").as_bytes(), &[3u8; 1000])
            .expect("put");
    }
    // Every member restarts with the limiter, so whoever leads paces its snapshots.
    c.snapshot_limiter = Some(Arc::new(RateLimiter::new(2 << 20, 64 * 1024)));
    drop(leader);
    for id in c.ids() {
        c.kill(id);
    }
    for id in c.ids() {
        c.start(id).expect("restart with a limiter");
    }
    let lid = c.wait_leader(T).expect("leader");
    let l = c.node(lid).expect("runs");
    for i in 0..150u32 {
        l.put(format!("q{i:04}").as_bytes(), &[4u8; 1000])
            .expect("put");
    }
    c.add_dir(4);
    l.add_learner(4).expect("learner");
    let start = Instant::now();
    c.start(4).expect("start 4");
    wait_until("snapshot sent", || {
        l.status().transfers.iter().any(|t| t.to == 4 && t.done)
    });
    let t = *l.status().transfers.iter().find(|t| t.to == 4).expect("t");
    let secs = start.elapsed().as_secs_f64();
    let floor = (t.sent.saturating_sub(64 * 1024)) as f64 / f64::from(2u32 << 20);
    assert!(
        secs >= floor * 0.9,
        "{} bytes in {secs:.3} s at 2 MiB/s (floor {floor:.3} s)",
        t.sent
    );
    assert!(t.rate() <= (2u64 << 20) * 3 / 2, "rate {}", t.rate());
}

/// Member `id` played by the test: it refuses the leader's appends (an empty log, so the
/// leader must send it a snapshot), never acknowledges a snapshot, and records the chunks
/// it receives: `(when, whether the chunk ends its stream, sender)`.
struct SnapshotSink {
    chunks: Arc<std::sync::Mutex<Vec<(Instant, bool, u64)>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    handle: Option<thread::JoinHandle<()>>,
}

impl SnapshotSink {
    fn start(c: &Cluster<TestBackend>, id: u64) -> SnapshotSink {
        use keel_raft_glue::{SnapshotFrame, Transport};
        use raft::eraftpb::{Message, MessageType};

        let (transport, mailbox) = c.net.register(id);
        let chunks = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (seen, done) = (chunks.clone(), stop.clone());
        let handle = thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                crossbeam_channel::select! {
                    recv(mailbox.raft) -> m => {
                        let Ok(m) = m else { return };
                        if m.get_msg_type() == MessageType::MsgAppend {
                            let mut r = Message::default();
                            r.set_msg_type(MessageType::MsgAppendResponse);
                            r.from = id;
                            r.to = m.from;
                            r.term = m.term;
                            r.index = m.index;
                            r.reject = true;
                            transport.send(r);
                        }
                    }
                    recv(mailbox.snapshots) -> f => {
                        if let Ok(SnapshotFrame::Chunk(c)) = f {
                            seen.lock().expect("lock").push((Instant::now(), c.end.is_some(), c.from));
                        }
                    }
                    default(Duration::from_millis(10)) => {}
                }
            }
        });
        SnapshotSink {
            chunks,
            stop,
            handle: Some(handle),
        }
    }

    /// Every chunk received: `(when, whether it ends its stream)`.
    fn chunks(&self) -> Vec<(Instant, bool)> {
        self.chunks_where(|_| true)
    }

    /// The chunks received from member `from`.
    fn chunks_from(&self, from: u64) -> Vec<(Instant, bool)> {
        self.chunks_where(|f| f == from)
    }

    fn chunks_where(&self, keep: impl Fn(u64) -> bool) -> Vec<(Instant, bool)> {
        let chunks = self.chunks.lock().expect("lock");
        chunks
            .iter()
            .filter(|(_, _, from)| keep(*from))
            .map(|(at, end, _)| (*at, *end))
            .collect()
    }
}

impl Drop for SnapshotSink {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Removing a member ends the snapshot transfer running to it: the leader sends it nothing
/// more once the removal is applied, instead of streaming the rest of the backend (and
/// holding a read transaction on it) for a member it no longer has.
#[test]
fn removing_a_member_stops_the_snapshot_transfer_to_it() {
    crate::init_tracing();
    let opts = NodeOptions {
        snapshot_chunk_bytes: 4 * 1024,
        ..options()
    };
    let mut c = Cluster::<TestBackend>::with_membership(1, opts, manual(), 10).expect("cluster");
    let l = c.node(c.wait_leader(T).expect("leader")).expect("runs");
    for i in 0..200u32 {
        l.put(format!("r{i:04}").as_bytes(), &[5u8; 1000])
            .expect("put");
    }
    // Restarted with a limiter: the stream (over 200 kB) takes about 3 s.
    c.snapshot_limiter = Some(Arc::new(RateLimiter::new(64 * 1024, 4 * 1024)));
    drop(l);
    c.kill(1);
    c.start(1).expect("restart with a limiter");
    let leader = c.node(c.wait_leader(T).expect("leader")).expect("runs");
    let sink = SnapshotSink::start(&c, 4);
    leader.add_learner(4).expect("learner");
    wait_until("the transfer to 4 under way", || sink.chunks().len() >= 3);
    let (_, learners) = leader.remove_member(4).expect("remove");
    assert!(learners.is_empty(), "{learners:?}");
    let at_removal = sink.chunks();
    assert!(
        !at_removal.iter().any(|(_, end)| *end),
        "the stream ended before the removal: it is too short for this test"
    );
    wait_until("a second without chunks", || {
        sink.chunks()
            .last()
            .is_some_and(|(at, _)| at.elapsed() >= Duration::from_secs(1))
    });
    let all = sink.chunks();
    let after = all.len() - at_removal.len();
    assert!(
        !all.iter().any(|(_, end)| *end),
        "the whole stream was sent to member 4 after its removal ({after} more chunks)"
    );
    assert!(
        after <= 2,
        "{after} chunks were sent to member 4 after its removal"
    );
    assert!(
        leader.status().transfers.iter().all(|t| t.to != 4),
        "{:?}",
        leader.status().transfers
    );
    leader.put(b"after", b"1").expect("the leader goes on");
}

/// A leader that loses its leadership stops the snapshot transfers it was sending: the
/// receiver gets nothing more from it once it has stepped down, instead of the rest of a
/// stream that raft-rs, no longer leading, has no use for (the new leader sends its own).
#[test]
fn a_leader_that_steps_down_stops_its_snapshot_transfers() {
    crate::init_tracing();
    let opts = NodeOptions {
        snapshot_chunk_bytes: 4 * 1024,
        ..options()
    };
    let mut c = Cluster::<TestBackend>::with_membership(3, opts, manual(), 11).expect("cluster");
    let l = c.node(c.wait_leader(T).expect("leader")).expect("runs");
    for i in 0..300u32 {
        l.put(format!("s{i:04}").as_bytes(), &[6u8; 1000])
            .expect("put");
    }
    drop(l);
    // Restarted with a limiter: a stream (over 300 kB) takes about 5 s.
    c.snapshot_limiter = Some(Arc::new(RateLimiter::new(64 * 1024, 4 * 1024)));
    for id in c.ids() {
        c.kill(id);
        c.start(id).expect("restart with a limiter");
    }
    let old = c.node(c.wait_leader(T).expect("leader")).expect("runs");
    let sink = SnapshotSink::start(&c, 4);
    old.add_learner(4).expect("learner");
    wait_until("the transfer to 4 under way", || {
        sink.chunks_from(old.id()).len() >= 3
    });
    // Cut off from the voters, the leader steps down (check quorum); 4 still hears it.
    let others: Vec<u64> = c.ids().into_iter().filter(|&i| i != old.id()).collect();
    c.net.partition(&[old.id()], &others);
    wait_until("the leader steps down", || {
        old.status().role != keel_raft_glue::Role::Leader
    });
    let at_step_down = sink.chunks_from(old.id());
    assert!(
        !at_step_down.iter().any(|(_, end)| *end),
        "the stream ended before the leader stepped down: it is too short for this test"
    );
    wait_until("a second without chunks from the old leader", || {
        sink.chunks_from(old.id())
            .last()
            .is_some_and(|(at, _)| at.elapsed() >= Duration::from_secs(1))
    });
    let all = sink.chunks_from(old.id());
    let after = all.len() - at_step_down.len();
    assert!(
        !all.iter().any(|(_, end)| *end),
        "the whole stream was sent to member 4 after the leader stepped down ({after} more \
         chunks)"
    );
    assert!(
        after <= 2,
        "{after} chunks were sent to member 4 after the leader stepped down"
    );
}

/// A leader that loses its leadership and wins a later term before its next ready is
/// handled (here, the only voter, told by a message of a later term to campaign at once: it
/// steps down into that term and wins the next one within one step) shows no soft-state
/// change, only a new term: the snapshot transfer it began in the earlier term, which
/// raft-rs forgot with that term, stops as on a step-down, instead of streaming the rest of
/// the backend to a receiver whose progress the new term tracks afresh.
#[test]
fn a_leader_that_wins_a_later_term_within_one_ready_stops_its_earlier_transfers() {
    use keel_raft_glue::{SnapshotFrame, Transport};
    use raft::eraftpb::{Message, MessageType};

    crate::init_tracing();
    let opts = NodeOptions {
        snapshot_chunk_bytes: 4 * 1024,
        ..options()
    };
    let mut c = Cluster::<TestBackend>::with_membership(1, opts, manual(), 13).expect("cluster");
    let l = c.node(c.wait_leader(T).expect("leader")).expect("runs");
    for i in 0..300u32 {
        l.put(format!("w{i:04}").as_bytes(), &[8u8; 1000])
            .expect("put");
    }
    drop(l);
    // Restarted with a limiter: the stream (over 300 kB) takes about 5 s.
    c.snapshot_limiter = Some(Arc::new(RateLimiter::new(64 * 1024, 4 * 1024)));
    c.kill(1);
    c.start(1).expect("restart with a limiter");
    let leader = c.node(c.wait_leader(T).expect("leader")).expect("runs");
    let first_term = leader.status().term;

    // Member 4, played here: it refuses the appends of the first term only (so that term's
    // leader sends it a snapshot, and the later term's does not replace that transfer), and
    // records the chunks it receives: (when, transfer, whether the chunk ends its stream).
    let (transport, mailbox) = c.net.register(4);
    let chunks = Arc::new(std::sync::Mutex::new(Vec::<(Instant, u64, bool)>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sink = {
        let (seen, done, transport) = (chunks.clone(), stop.clone(), transport.clone());
        thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                crossbeam_channel::select! {
                    recv(mailbox.raft) -> m => {
                        let Ok(m) = m else { return };
                        if m.get_msg_type() == MessageType::MsgAppend && m.term == first_term {
                            let mut r = Message::default();
                            r.set_msg_type(MessageType::MsgAppendResponse);
                            (r.from, r.to, r.term, r.index) = (4, m.from, m.term, m.index);
                            r.reject = true;
                            transport.send(r);
                        }
                    }
                    recv(mailbox.snapshots) -> f => {
                        if let Ok(SnapshotFrame::Chunk(c)) = f {
                            let chunk = (Instant::now(), c.transfer, c.end.is_some());
                            seen.lock().expect("lock").push(chunk);
                        }
                    }
                    default(Duration::from_millis(10)) => {}
                }
            }
        })
    };
    let of = |transfer: u64| -> Vec<(Instant, bool)> {
        let chunks = chunks.lock().expect("lock");
        chunks
            .iter()
            .filter(|(_, t, _)| *t == transfer)
            .map(|(at, _, end)| (*at, *end))
            .collect()
    };
    leader.add_learner(4).expect("learner");
    wait_until("the transfer to 4 under way", || {
        chunks.lock().expect("lock").len() >= 3
    });
    let transfer = chunks.lock().expect("lock")[0].1;

    // A message of a later term telling member 1 to campaign: it becomes a follower of
    // that term and, the only voter, wins the next one within the same step.
    let mut m = Message::default();
    m.set_msg_type(MessageType::MsgTimeoutNow);
    (m.from, m.to, m.term) = (4, leader.id(), first_term + 1);
    transport.send(m);
    wait_until("member 1 leads a later term", || {
        let s = leader.status();
        s.term > first_term && s.role == keel_raft_glue::Role::Leader
    });
    assert_eq!(
        leader.status().term,
        first_term + 2,
        "{:?}",
        leader.status()
    );
    let at_new_term = of(transfer);
    assert!(
        !at_new_term.iter().any(|(_, end)| *end),
        "the stream ended before the term changed: it is too short for this test"
    );
    wait_until(
        "a second without chunks of the earlier term's transfer",
        || {
            of(transfer)
                .last()
                .is_some_and(|(at, _)| at.elapsed() >= Duration::from_secs(1))
        },
    );
    let all = of(transfer);
    let after = all.len() - at_new_term.len();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = sink.join();
    assert!(
        !all.iter().any(|(_, end)| *end),
        "the whole stream of term {first_term} was sent to member 4 once member 1 led term {} \
         ({after} more chunks)",
        first_term + 2
    );
    assert!(
        after <= 2,
        "{after} chunks of term {first_term}'s transfer were sent to member 4 once member 1 \
         led term {}",
        first_term + 2
    );
    leader.put(b"after", b"1").expect("the leader goes on");
}

/// A member added through a raw conf change (a [`Request::ConfChange`], not a membership
/// operation) is listed among the members by every member, as one added by `add_learner`
/// is: a learner described by default (`member-<id>`, peer URL `mem://<id>`, no client
/// URLs). The membership checks then know it: its id cannot be added again, and promoting
/// it is gated as a learner's promotion is.
#[test]
fn a_member_added_by_a_raw_conf_change_is_listed() {
    let (c, leader) = cluster(3, manual(), 14);
    let raw = Request::ConfChange(vec![MemberChange::AddLearner(4)]);
    match leader.propose(raw).expect("raw conf change") {
        Response::ConfChange { learners, .. } => assert_eq!(learners, vec![4]),
        other => panic!("unexpected answer {other:?}"),
    }
    let expected = keel_raft_glue::Member {
        id: 4,
        name: "member-4".into(),
        peer_urls: vec!["mem://4".into()],
        client_urls: Vec::new(),
        is_learner: true,
    };
    for n in c.running() {
        wait_until("the learner in the configuration", || {
            n.status().learners.contains(&4)
        });
        let listed = n.member_list();
        assert_eq!(
            listed.iter().find(|m| m.id == 4),
            Some(&expected),
            "member {} lists {listed:?}",
            n.id()
        );
    }
    expect_err(leader.add_learner(4), "member ID already exist");
    expect_err(
        leader.member_promote(4),
        "can only promote a learner member which is in sync with leader",
    );
}

/// A raw conf change (a [`Request::ConfChange`], not a membership operation) that changes
/// the role of a listed member changes it in the members too, on every member: a learner
/// added by `add_learner` and promoted by a raw `AddVoter` is listed as a voter (and cannot
/// be promoted again), and demoted by a raw `AddLearner` it is listed as a learner again.
#[test]
fn a_raw_conf_change_of_a_listed_members_role_lists_its_new_role() {
    let (c, leader) = cluster(3, manual(), 15);
    leader.add_learner(4).expect("learner");
    let listed_role = |n: &N| {
        n.member_list()
            .iter()
            .find(|m| m.id == 4)
            .map(|m| m.is_learner)
    };
    for (change, is_learner, role) in [
        (MemberChange::AddVoter(4), false, "a voter"),
        (MemberChange::AddLearner(4), true, "a learner"),
    ] {
        match propose_via_leader(&c, Request::ConfChange(vec![change])) {
            Response::ConfChange { voters, learners } => {
                assert_eq!(voters.contains(&4), !is_learner, "{voters:?}");
                assert_eq!(learners.contains(&4), is_learner, "{learners:?}");
            }
            other => panic!("unexpected answer {other:?}"),
        }
        for n in c.running() {
            // Both sides: a member that has not applied the change at all has 4 in neither.
            wait_until("the configuration's change", || {
                let st = n.status();
                st.learners.contains(&4) == is_learner && st.voters.contains(&4) != is_learner
            });
            assert_eq!(
                listed_role(&n),
                Some(is_learner),
                "after {change:?}, member {} lists member 4 as {} instead of {role}: {:?}",
                n.id(),
                if listed_role(&n) == Some(true) {
                    "a learner"
                } else {
                    "a voter"
                },
                n.member_list()
            );
        }
        if !is_learner {
            expect_err(
                current_leader(&c).member_promote(4),
                "can only promote a learner member",
            );
        }
    }
}

/// A member removed through a raw conf change (a [`Request::ConfChange`], not a membership
/// operation) leaves the members as one removed by `member_remove` does, once the
/// configuration no longer lists it at all. Removing it along with two additions goes
/// through a joint configuration, held here until one of the added voters runs (the
/// incoming voters 1, 2, 5 and 6 have no quorum before): meanwhile it is an outgoing voter,
/// still replicated to, and the snapshot transfer under way to it goes on. Once the
/// configuration leaves it, no member lists it, the leader keeps no transfer to it, its id
/// cannot be added again, and it stops for good.
#[test]
fn a_member_removed_by_a_raw_conf_change_leaves_the_members() {
    crate::init_tracing();
    let opts = NodeOptions {
        snapshot_count: 40,
        snapshot_catch_up_entries: 10,
        snapshot_chunk_bytes: 4 * 1024,
        // The leader keeps leading while the incoming voters have no quorum.
        check_quorum: false,
        ..fast_options()
    };
    let mut c = Cluster::<TestBackend>::with_membership(3, opts, manual(), 12).expect("cluster");
    // Restarted with a limiter: a stream (over 100 kB) takes more than a second.
    c.snapshot_limiter = Some(Arc::new(RateLimiter::new(64 * 1024, 4 * 1024)));
    for id in c.ids() {
        c.kill(id);
        c.start(id).expect("restart with a limiter");
    }
    let leader = c.node(c.wait_leader(T).expect("leader")).expect("runs");
    let gone = follower_of(&c, &leader).id();
    leader.put(b"early", b"1").expect("put");
    c.wait_converged(1, T).expect("converged");
    c.kill(gone);
    for i in 0..120u32 {
        leader
            .put(format!("g{i:04}").as_bytes(), &[7u8; 1000])
            .expect("put");
    }
    c.start(gone).expect("restart the lagging member");
    wait_until("the transfer to the lagging member under way", || {
        leader
            .status()
            .transfers
            .iter()
            .any(|t| t.to == gone && t.sent > 0 && !t.done)
    });
    let changed_at = Instant::now();
    let raw = Request::ConfChange(vec![
        MemberChange::Remove(gone),
        MemberChange::AddVoter(5),
        MemberChange::AddVoter(6),
    ]);
    match leader.propose(raw).expect("raw conf change") {
        Response::ConfChange { voters, .. } => {
            assert!(!voters.contains(&gone), "{voters:?}");
        }
        other => panic!("unexpected answer {other:?}"),
    }
    // Joint: the removed member is an outgoing voter, and the transfer to it goes on.
    wait_until("the transfer to the outgoing voter done", || {
        leader
            .status()
            .transfers
            .iter()
            .any(|t| t.to == gone && t.done)
    });
    let t = *leader
        .status()
        .transfers
        .iter()
        .find(|t| t.to == gone)
        .expect("transfer");
    assert!(
        t.started < changed_at,
        "the transfer under way at the change was replaced by one begun {:?} after it",
        t.started.saturating_duration_since(changed_at)
    );
    let listed = leader.member_list().into_iter().find(|m| m.id == gone);
    assert_eq!(
        listed.map(|m| m.is_learner),
        Some(false),
        "an outgoing voter is still a member, and still a voter"
    );

    // Member 5 runs: the incoming voters have a quorum, and the configuration leaves the
    // removed member.
    c.add_dir(5);
    c.start(5).expect("start 5");
    let running: Vec<N> = c.running().into_iter().filter(|n| n.id() != gone).collect();
    for n in &running {
        wait_until("no member lists the removed member", || {
            n.member_list().iter().all(|m| m.id != gone)
        });
    }
    assert!(
        leader.status().transfers.iter().all(|t| t.to != gone),
        "{:?}",
        leader.status().transfers
    );
    expect_err(leader.add_voter(gone), "ID removed");
    let removed = c.node(gone).expect("handle");
    wait_until("the removed member stops", || {
        removed.put(b"x", b"y").is_err_and(|e| {
            e.to_string()
                .contains("this member has been permanently removed from the cluster")
        })
    });
    drop(removed);
    c.kill(gone);
    expect_err(c.start(gone), "permanently removed");
    leader.put(b"after", b"1").expect("the leader goes on");
}

/// Automatic promotion after 200 ms: a learner that is not held is promoted well within
/// the [`HOLD`] these tests watch a held one for.
fn auto_promoting() -> MembershipOptions {
    MembershipOptions {
        auto_promote_after: Duration::from_millis(200),
        ..MembershipOptions::default()
    }
}

/// How long a learner held from automatic promotion is watched: ten times
/// `auto_promote_after` of [`auto_promoting`].
const HOLD: Duration = Duration::from_secs(2);

/// Asserts that member `id` is a learner, held from automatic promotion, on every running
/// member throughout `hold`; `what` says how it became a learner.
fn stays_a_held_learner(c: &Cluster<TestBackend>, id: u64, hold: Duration, what: &str) {
    let since = Instant::now();
    loop {
        for n in c.running() {
            let s = n.status();
            assert!(
                s.learners.contains(&id) && !s.voters.contains(&id),
                "member {id}, {what}, was promoted automatically: {:?} into the hold, member {} \
                 has voters {:?} and learners {:?}",
                since.elapsed(),
                n.id(),
                s.voters,
                s.learners
            );
            assert_eq!(
                n.held_learners(),
                vec![id],
                "member {} lists the learners held from automatic promotion",
                n.id()
            );
            assert_eq!(
                n.member_list()
                    .iter()
                    .find(|m| m.id == id)
                    .map(|m| m.is_learner),
                Some(true),
                "member {} lists member {id} as a learner",
                n.id()
            );
        }
        if since.elapsed() >= hold {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// Promotes learner `id` explicitly (once the promotion gate holds) and waits until every
/// running member lists it as a voter held by nothing.
fn promote_explicitly(c: &Cluster<TestBackend>, id: u64) {
    wait_until("the explicit promotion", || {
        current_leader(c).member_promote(id).is_ok()
    });
    for n in c.running() {
        wait_until("the promotion applied", || {
            n.status().voters.contains(&id)
                && n.member_list().iter().any(|m| m.id == id && !m.is_learner)
        });
        assert_eq!(n.held_learners(), Vec::<u64>::new(), "member {}", n.id());
    }
}

/// A caught-up voter demoted by a raw conf change (a [`Request::ConfChange`] adding it as a
/// learner) stays a learner with automatic promotion on, for ten times
/// `auto_promote_after`, on every member, and after every member restarted (the hold is
/// stored with the members); an explicit promotion still promotes it.
#[test]
fn a_voter_demoted_by_a_raw_conf_change_is_not_promoted_automatically() {
    let (mut c, leader) = cluster(3, auto_promoting(), 16);
    leader.put(b"before", b"1").expect("put");
    c.wait_converged(1, T).expect("converged");
    let demoted = follower_of(&c, &leader).id();
    match propose_via_leader(
        &c,
        Request::ConfChange(vec![MemberChange::AddLearner(demoted)]),
    ) {
        Response::ConfChange { learners, .. } => assert_eq!(learners, vec![demoted]),
        other => panic!("unexpected answer {other:?}"),
    }
    for n in c.running() {
        wait_until("the demotion applied", || {
            n.status().learners.contains(&demoted)
        });
    }
    stays_a_held_learner(&c, demoted, HOLD, "demoted by a raw conf change");

    // Every member restarted, one after the other: the hold is read back with the members.
    drop(leader);
    for id in c.ids() {
        c.kill(id);
        c.start(id).expect("restart");
        c.wait_leader(T).expect("leader");
    }
    current_leader(&c).put(b"after", b"1").expect("put");
    c.wait_converged(2, T).expect("converged");
    stays_a_held_learner(&c, demoted, HOLD, "demoted by a raw conf change, restarted");

    promote_explicitly(&c, demoted);
}

/// A learner added by a raw conf change (a [`Request::ConfChange`]) is not promoted
/// automatically once it has caught up, on every member, itself included, which learns the
/// hold from the snapshot it joined with; an explicit promotion still promotes it.
#[test]
fn a_learner_added_by_a_raw_conf_change_is_not_promoted_automatically() {
    let (mut c, leader) = cluster(3, auto_promoting(), 17);
    for i in 0..150u32 {
        leader.put(format!("a{i}").as_bytes(), b"v").expect("put");
    }
    c.add_dir(4);
    match propose_via_leader(&c, Request::ConfChange(vec![MemberChange::AddLearner(4)])) {
        Response::ConfChange { learners, .. } => assert_eq!(learners, vec![4]),
        other => panic!("unexpected answer {other:?}"),
    }
    c.start(4).expect("start 4");
    let n4 = c.node(4).expect("4");
    wait_until("4 caught up from a snapshot", || {
        let s = n4.status();
        s.snapshots_installed >= 1 && s.applied + 2 >= current_leader(&c).status().commit
    });
    stays_a_held_learner(&c, 4, HOLD, "added by a raw conf change");

    promote_explicitly(&c, 4);
    n4.put(b"from-4", b"ok")
        .expect("a promoted member takes writes");
}
