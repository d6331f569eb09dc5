//! The failures of the learner design's figures 1–9, each run under a steady client load
//! once adding the new member as a voter (etcd's flow, strict check off unless said) and
//! once as a learner (keel's defaults: learner by default, strict check, automatic
//! promotion): the learner flow never loses quorum and stays reversible; the voter flow
//! loses quorum exactly where etcd documents it; the strict check refuses those adds.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use keel_raft_glue::membership::MembershipOptions;
use keel_raft_glue::testing::{Cluster, TestBackend, fast_options};
use keel_raft_glue::{Node, NodeError, NodeOptions};

const T: Duration = Duration::from_secs(10);

type N = Arc<Node<TestBackend>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flow {
    Voter,
    Learner,
}

fn options() -> NodeOptions {
    NodeOptions {
        tick_interval: Duration::from_millis(20),
        request_timeout: Duration::from_millis(800),
        snapshot_count: 300,
        snapshot_catch_up_entries: 50,
        snapshot_chunk_bytes: 16 * 1024,
        ..fast_options()
    }
}

/// Options of a scenario that asserts that no election happens although one side of a
/// partition holds exactly a quorum (figure 4's 3–1 split), so that its leader keeps leading
/// only while it hears from every other voter of its side within each check-quorum window
/// (an election timeout, not randomised), and its followers only while they hear from it
/// within theirs. With [`options`]'s 10 ticks of 20 ms that window is 200 ms, and on a loaded
/// 2-core machine a member's threads go unscheduled that long (its Raft thread, or its
/// persist thread, whose fsync its replies to the leader wait for under the client load):
/// the leader then logs "stepped down to follower since quorum is not active" and another
/// member is elected. 50 ticks make the window 1 s, with heartbeats still every tick.
fn steady_options() -> NodeOptions {
    NodeOptions {
        election_ticks: 50,
        ..options()
    }
}

/// The shortest election timeout of `o` (the leader's check-quorum window); a follower's is
/// drawn from this to twice this.
fn election_timeout(o: &NodeOptions) -> Duration {
    o.tick_interval * o.election_ticks as u32
}

fn membership(flow: Flow, strict: bool) -> MembershipOptions {
    match flow {
        Flow::Voter => MembershipOptions {
            learner_by_default: false,
            auto_promote: false,
            strict_reconfig_check: strict,
            active_window: Duration::from_millis(400),
            ..MembershipOptions::default()
        },
        Flow::Learner => MembershipOptions {
            auto_promote_after: Duration::from_millis(200),
            active_window: Duration::from_millis(400),
            ..MembershipOptions::default()
        },
    }
}

fn cluster(n: u64, flow: Flow, strict: bool, seed: u64) -> Cluster<TestBackend> {
    crate::init_tracing();
    let c = Cluster::<TestBackend>::with_membership(n, options(), membership(flow, strict), seed)
        .expect("cluster");
    c.wait_leader(T).expect("leader");
    c
}

/// A cluster with [`steady_options`]; member 1 is asked to campaign at once rather than
/// waiting out its first election timeout.
fn steady_cluster(n: u64, flow: Flow, seed: u64) -> Cluster<TestBackend> {
    crate::init_tracing();
    let c =
        Cluster::<TestBackend>::with_membership(n, steady_options(), membership(flow, false), seed)
            .expect("cluster");
    c.node(1).expect("1 runs").campaign().expect("campaign");
    c.wait_leader(T).expect("leader");
    c
}

/// A client writing as fast as it can, moving to another member when one fails.
struct Load {
    stop: Arc<AtomicBool>,
    handle: JoinHandle<LoadStats>,
}

#[derive(Debug)]
struct LoadStats {
    ok: u64,
    longest_gap: Duration,
}

impl Load {
    fn start(nodes: Vec<N>) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let handle = thread::spawn(move || {
            let mut cur = 0usize;
            let mut last = Instant::now();
            let mut stats = LoadStats {
                ok: 0,
                longest_gap: Duration::ZERO,
            };
            let mut i = 0u64;
            while !s.load(Ordering::Relaxed) {
                let n = &nodes[cur % nodes.len()];
                i += 1;
                match n.put(format!("load-{}", i % 500).as_bytes(), &[1u8; 64]) {
                    Ok(_) => {
                        let now = Instant::now();
                        stats.longest_gap = stats.longest_gap.max(now - last);
                        last = now;
                        stats.ok += 1;
                    }
                    Err(NodeError::NotLeader {
                        leader: Some(l), ..
                    }) => {
                        cur = nodes.iter().position(|x| x.id() == l).unwrap_or(cur + 1);
                    }
                    Err(_) => {
                        cur += 1;
                        thread::sleep(Duration::from_millis(2));
                    }
                }
            }
            stats.longest_gap = stats.longest_gap.max(last.elapsed());
            stats
        });
        Load { stop, handle }
    }

    fn finish(self) -> LoadStats {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.join().expect("load thread")
    }
}

fn nodes(c: &Cluster<TestBackend>, ids: &[u64]) -> Vec<N> {
    ids.iter().filter_map(|&i| c.node(i)).collect()
}

fn max_term(c: &Cluster<TestBackend>) -> u64 {
    c.running()
        .iter()
        .map(|n| n.status().term)
        .max()
        .unwrap_or(0)
}

fn leader_of(c: &Cluster<TestBackend>, among: &[u64]) -> Option<N> {
    among.iter().filter_map(|&i| c.node(i)).find(|n| {
        let s = n.status();
        s.leader == Some(n.id()) && s.role == keel_raft_glue::Role::Leader
    })
}

fn wait_leader_among(c: &Cluster<TestBackend>, among: &[u64]) -> N {
    let deadline = Instant::now() + T;
    loop {
        if let Some(l) = leader_of(c, among) {
            return l;
        }
        assert!(Instant::now() < deadline, "no leader among {among:?}");
        thread::sleep(Duration::from_millis(10));
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + T;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        thread::sleep(Duration::from_millis(10));
    }
}

/// Adds member `id` through `via` with the flow's kind.
fn add(via: &N, id: u64, flow: Flow) -> Result<(Vec<u64>, Vec<u64>), NodeError> {
    match flow {
        Flow::Voter => via.add_voter(id),
        Flow::Learner => via.add_learner(id),
    }
}

/// Whether a write commits within `within` through any of `nodes`.
fn writes_commit(nodes: &[N], within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        for n in nodes {
            if n.put(b"probe", b"x").is_ok() {
                return true;
            }
        }
    }
    false
}

fn report(fig: u32, flow: Flow, elections: u64, s: &LoadStats) {
    eprintln!(
        "figure {fig} {flow:?}: elections {elections}, writes {}, longest write gap {} ms",
        s.ok,
        s.longest_gap.as_millis()
    );
}

fn voters_of(n: &N) -> Vec<u64> {
    n.status().voters
}

/// Figure 1: a new member catches up under load; no election, and in the learner flow it
/// is promoted automatically once it has applied the snapshot.
fn figure1(flow: Flow) {
    let mut c = cluster(3, flow, false, 11);
    let load = Load::start(nodes(&c, &[1, 2, 3]));
    thread::sleep(Duration::from_millis(400));
    let t0 = max_term(&c);
    let leader = leader_of(&c, &[1, 2, 3]).expect("leader");
    c.add_dir(4);
    add(&leader, 4, flow).expect("add");
    c.start(4).expect("start 4");
    wait_until("4 voters", || voters_of(&leader).len() == 4);
    thread::sleep(Duration::from_millis(300));
    let stats = load.finish();
    let elections = max_term(&c) - t0;
    report(1, flow, elections, &stats);
    assert_eq!(
        elections, 0,
        "{flow:?}: a member catching up caused an election"
    );
    assert!(stats.longest_gap < Duration::from_millis(700), "{stats:?}");
    let n4 = c.node(4).expect("4 runs");
    if flow == Flow::Learner {
        assert!(n4.status().snapshots_installed >= 1, "{:?}", n4.status());
    }
    c.wait_converged(1, T).expect("converged");
    let h = c.node(1).expect("1").hash_kv(0).expect("hash").hash;
    wait_until("same hash on 4", || n4.hash_kv(0).expect("hash").hash == h);
}

#[test]
fn figure1_new_member_catches_up_under_load_voter() {
    figure1(Flow::Voter);
}

#[test]
fn figure1_new_member_catches_up_under_load_learner() {
    figure1(Flow::Learner);
}

/// Figures 2 and 3: the leader keeps (2) or loses (3) its quorum; a member is added
/// afterwards on the side that has a quorum.
fn figure2_3(flow: Flow, leader_isolated: bool) {
    let mut c = cluster(3, flow, false, 23);
    let old = leader_of(&c, &[1, 2, 3]).expect("leader").id();
    let followers: Vec<u64> = [1, 2, 3].into_iter().filter(|&i| i != old).collect();
    let load = Load::start(nodes(&c, &[1, 2, 3]));
    thread::sleep(Duration::from_millis(300));
    let t0 = max_term(&c);
    let majority: Vec<u64> = if leader_isolated {
        c.net.isolate(old);
        followers.clone()
    } else {
        c.net.isolate(followers[0]);
        vec![old, followers[1]]
    };
    let leader = wait_leader_among(&c, &majority);
    c.add_dir(4);
    // The member added is reachable from the majority side.
    add(&leader, 4, flow).expect("add on the majority side");
    c.start(4).expect("start 4");
    let n4 = c.node(4).expect("4");
    wait_until("4 applied", || {
        n4.status().applied >= leader.status().commit.saturating_sub(5)
    });
    thread::sleep(Duration::from_millis(300));
    let stats = load.finish();
    let elections = max_term(&c) - t0;
    report(if leader_isolated { 3 } else { 2 }, flow, elections, &stats);
    if leader_isolated {
        assert!(elections >= 1, "the isolated leader was replaced");
    } else {
        assert_eq!(elections, 0, "the leader kept its quorum");
    }
    assert!(writes_commit(&nodes(&c, &majority), Duration::from_secs(2)));
    c.net.heal();
    // Reversible: the new member can be removed again.
    let leader = wait_leader_among(&c, &[1, 2, 3, 4]);
    wait_until("no change pending", || leader.remove_member(4).is_ok());
    wait_until("4 removed", || {
        let s = leader.status();
        !s.voters.contains(&4) && !s.learners.contains(&4)
    });
    assert!(leader.member_list().iter().all(|m| m.id != 4));
}

#[test]
fn figure2_leader_keeps_quorum_voter() {
    figure2_3(Flow::Voter, false);
}

#[test]
fn figure2_leader_keeps_quorum_learner() {
    figure2_3(Flow::Learner, false);
}

#[test]
fn figure3_leader_isolated_voter() {
    figure2_3(Flow::Voter, true);
}

#[test]
fn figure3_leader_isolated_learner() {
    figure2_3(Flow::Learner, true);
}

/// Figures 4 and 5: a partition after adding a 4th member, 3–1 with the new member on the
/// leader's side (4) or 2–2 (5).
///
/// The 3–1 split, where no election must happen, runs with [`steady_options`], its
/// partition held for two and a half election timeouts (more than two check-quorum windows
/// of the leader, and more than the longest election timeout of a follower: a side that
/// could not keep its leader would have lost it), and the writes of the leader's side given
/// seconds to commit. The 2–2 split keeps [`options`]: in the learner flow the two voters
/// of one side must elect a leader while the partition lasts.
fn figure4_5(flow: Flow, two_two: bool) {
    let (mut c, partition_for, commit_within) = if two_two {
        let c = cluster(3, flow, false, 45);
        (c, Duration::from_millis(1200), Duration::from_millis(900))
    } else {
        let c = steady_cluster(3, flow, 45);
        let partition_for = election_timeout(&steady_options()) * 5 / 2;
        (c, partition_for, Duration::from_secs(5))
    };
    let old = leader_of(&c, &[1, 2, 3]).expect("leader");
    let lid = old.id();
    let followers: Vec<u64> = [1, 2, 3].into_iter().filter(|&i| i != lid).collect();
    c.add_dir(4);
    // In the learner flow the partition comes before the promotion (automatic promotion
    // waits for the gate to hold 200 ms; the partition is made as soon as 4 has caught up).
    add(&old, 4, flow).expect("add");
    c.start(4).expect("start 4");
    let n4 = c.node(4).expect("4");
    wait_until("4 caught up", || {
        n4.status().applied + 2 >= old.status().commit
    });
    let load = Load::start(nodes(&c, &[1, 2, 3]));
    thread::sleep(Duration::from_millis(200));
    let t0 = max_term(&c);
    let still_learner = old.status().learners.contains(&4);
    let (a, b): (Vec<u64>, Vec<u64>) = if two_two {
        (vec![lid, 4], followers.clone())
    } else {
        (vec![lid, 4, followers[0]], vec![followers[1]])
    };
    c.net.partition(&a, &b);
    thread::sleep(partition_for);
    let a_nodes = nodes(&c, &a);
    let b_nodes = nodes(&c, &b);
    // In the 3–1 split side a, the leader's, must commit: it is given seconds.
    let commits_a = writes_commit(&a_nodes, commit_within);
    let commits_b = writes_commit(&b_nodes, Duration::from_millis(900));
    let commits = commits_a || commits_b;
    for n in c.running() {
        let s = n.status();
        eprintln!(
            "figure {} {flow:?}: member {} role {:?} voters {:?} learners {:?} commit {} (side a {a:?} commits {commits_a}, side b {b:?} commits {commits_b})",
            if two_two { 5 } else { 4 },
            s.id,
            s.role,
            s.voters,
            s.learners,
            s.commit
        );
    }
    c.net.heal();
    thread::sleep(Duration::from_millis(300));
    let stats = load.finish();
    let elections = max_term(&c) - t0;
    report(if two_two { 5 } else { 4 }, flow, elections, &stats);
    if !two_two {
        assert_eq!(elections, 0, "3–1 with the new member beside the leader");
        assert!(commits);
    } else if flow == Flow::Voter || !still_learner {
        // Four voters split 2–2: neither side has the quorum of 3 (etcd's figure 5).
        assert!(!commits, "a 2–2 split of 4 voters committed a write");
    } else {
        // The learner does not count: the side with two of the three voters elects a
        // leader and keeps writing.
        assert!(commits, "the learner flow lost quorum in a 2–2 split");
    }
    let leader = wait_leader_among(&c, &[1, 2, 3, 4]);
    assert!(writes_commit(
        std::slice::from_ref(&leader),
        Duration::from_secs(3)
    ));
    wait_until("remove 4", || {
        leader.remove_member(4).is_ok() || leader.id() == 4
    });
}

#[test]
fn figure4_partition_3_1_after_add_voter() {
    figure4_5(Flow::Voter, false);
}

#[test]
fn figure4_partition_3_1_after_add_learner() {
    figure4_5(Flow::Learner, false);
}

#[test]
fn figure5_partition_2_2_after_add_voter() {
    figure4_5(Flow::Voter, true);
}

#[test]
fn figure5_partition_2_2_after_add_learner() {
    figure4_5(Flow::Learner, true);
}

/// Figure 6: a follower is already partitioned when a member is added that has not
/// started yet. As a voter the quorum becomes 3 of 4 with 2 up: writes stop until the new
/// member starts. As a learner nothing changes, and the strict check refuses the voter.
fn figure6(flow: Flow) {
    let mut c = cluster(3, flow, false, 66);
    let leader = leader_of(&c, &[1, 2, 3]).expect("leader");
    let lid = leader.id();
    let gone = [1, 2, 3].into_iter().find(|&i| i != lid).expect("follower");
    let up: Vec<u64> = [1, 2, 3].into_iter().filter(|&i| i != gone).collect();
    c.net.isolate(gone);
    let load = Load::start(nodes(&c, &up));
    thread::sleep(Duration::from_millis(300));
    c.add_dir(4);
    add(&leader, 4, flow).expect("add");
    let up_nodes = nodes(&c, &up);
    let commits = writes_commit(&up_nodes, Duration::from_millis(1200));
    match flow {
        Flow::Voter => assert!(!commits, "2 of 4 voters committed"),
        Flow::Learner => assert!(commits, "adding a learner cost the quorum"),
    }
    c.start(4).expect("start 4");
    assert!(writes_commit(&up_nodes, Duration::from_secs(5)));
    let stats = load.finish();
    report(6, flow, 0, &stats);
    if flow == Flow::Learner {
        assert!(stats.longest_gap < Duration::from_millis(800), "{stats:?}");
    }
}

#[test]
fn figure6_add_while_partitioned_voter() {
    figure6(Flow::Voter);
}

#[test]
fn figure6_add_while_partitioned_learner() {
    figure6(Flow::Learner);
}

#[test]
fn figure6_strict_check_refuses_the_voter() {
    let c = cluster(3, Flow::Voter, true, 67);
    let leader = leader_of(&c, &[1, 2, 3]).expect("leader");
    let gone = [1, 2, 3]
        .into_iter()
        .find(|&i| i != leader.id())
        .expect("f");
    c.net.isolate(gone);
    thread::sleep(Duration::from_millis(600));
    let err = leader.add_voter(4).expect_err("strict check");
    assert!(
        err.to_string()
            .contains("re-configuration failed due to not enough started members"),
        "{err}"
    );
    // The learner does not change the quorum: allowed even with the strict check.
    leader.add_learner(4).expect("learner add");
}

/// Figures 7 and 8: a 1-member cluster gets a member that has not started (7) or never
/// starts because it is misconfigured (8).
fn figure7_8(flow: Flow, never_starts: bool) {
    let mut c = cluster(1, flow, false, 78);
    let n1 = c.node(1).expect("1");
    let load = Load::start(vec![n1.clone()]);
    thread::sleep(Duration::from_millis(200));
    c.add_dir(2);
    add(&n1, 2, flow).expect("add");
    let commits = writes_commit(std::slice::from_ref(&n1), Duration::from_millis(800));
    match flow {
        Flow::Voter => assert!(!commits, "1 of 2 voters committed"),
        Flow::Learner => assert!(commits, "adding a learner stopped the writes"),
    }
    if !never_starts {
        c.start(2).expect("start 2");
        wait_until("2 voters", || voters_of(&n1).len() == 2);
        let stats = load.finish();
        report(7, flow, 0, &stats);
        assert!(writes_commit(
            std::slice::from_ref(&n1),
            Duration::from_secs(3)
        ));
        return;
    }
    let stats = load.finish();
    report(8, flow, 0, &stats);
    match flow {
        Flow::Learner => {
            // Never promoted (it never applied anything), and reversible.
            thread::sleep(Duration::from_millis(400));
            assert_eq!(voters_of(&n1), vec![1]);
            let err = n1.member_promote(2).expect_err("not in sync");
            assert!(
                err.to_string()
                    .contains("can only promote a learner member which is in sync with leader"),
                "{err}"
            );
            n1.remove_member(2)
                .expect("remove the misconfigured learner");
            assert_eq!(n1.status().learners, Vec::<u64>::new());
            assert!(writes_commit(
                std::slice::from_ref(&n1),
                Duration::from_secs(1)
            ));
        }
        Flow::Voter => {
            // etcd: no way back but --force-new-cluster.
            assert!(n1.remove_member(2).is_err(), "remove without quorum");
            drop(n1);
            c.kill(1);
            c.start_with(1, |cfg| cfg.force_new_cluster = true)
                .expect("force new cluster");
            let n1 = c.node(1).expect("1");
            wait_until("single voter", || n1.status().voters == vec![1]);
            assert!(writes_commit(
                std::slice::from_ref(&n1),
                Duration::from_secs(5)
            ));
            assert!(n1.member_list().iter().all(|m| m.id == 1));
            // The removed id is never reused.
            let err = n1.add_learner(2).expect_err("removed id");
            assert!(err.to_string().contains("ID removed"), "{err}");
        }
    }
}

#[test]
fn figure7_add_to_one_member_cluster_voter() {
    figure7_8(Flow::Voter, false);
}

#[test]
fn figure7_add_to_one_member_cluster_learner() {
    figure7_8(Flow::Learner, false);
}

#[test]
fn figure8_misconfigured_member_voter() {
    figure7_8(Flow::Voter, true);
}

#[test]
fn figure8_misconfigured_member_learner() {
    figure7_8(Flow::Learner, true);
}

#[test]
fn figure7_8_strict_check_refuses_the_voter() {
    let c = cluster(1, Flow::Voter, true, 79);
    let n1 = c.node(1).expect("1");
    let err = n1.add_voter(2).expect_err("strict");
    assert!(
        err.to_string().contains("not enough started members"),
        "{err}"
    );
    assert!(writes_commit(&[n1], Duration::from_secs(1)));
}

/// Figure 9: four members, one failed and one misconfigured.
fn figure9(flow: Flow) {
    let mut c = cluster(3, flow, false, 99);
    let leader = leader_of(&c, &[1, 2, 3]).expect("leader");
    let failed = [1, 2, 3]
        .into_iter()
        .find(|&i| i != leader.id())
        .expect("f");
    let up: Vec<u64> = [1, 2, 3].into_iter().filter(|&i| i != failed).collect();
    c.kill(failed);
    let load = Load::start(nodes(&c, &up));
    thread::sleep(Duration::from_millis(200));
    c.add_dir(4);
    add(&leader, 4, flow).expect("add the misconfigured member");
    let commits = writes_commit(&nodes(&c, &up), Duration::from_millis(1000));
    let stats = load.finish();
    report(9, flow, 0, &stats);
    match flow {
        Flow::Voter => {
            assert!(!commits, "2 of 4 voters committed");
            assert!(leader.remove_member(4).is_err(), "removal needs 3 votes");
        }
        Flow::Learner => {
            assert!(commits);
            // Reversible (retried only while another change is still being applied).
            for id in [4, failed] {
                wait_until("remove", || match leader.remove_member(id) {
                    Ok(_) => true,
                    Err(e) if e.to_string().contains("still being applied") => false,
                    Err(e) => panic!("remove {id}: {e}"),
                });
            }
            wait_until("2 voters", || voters_of(&leader).len() == 2);
        }
    }
}

#[test]
fn figure9_failed_and_misconfigured_voter() {
    figure9(Flow::Voter);
}

#[test]
fn figure9_failed_and_misconfigured_learner() {
    figure9(Flow::Learner);
}

#[test]
fn figure9_strict_check_refuses_the_voter() {
    let mut c = cluster(3, Flow::Voter, true, 98);
    let leader = leader_of(&c, &[1, 2, 3]).expect("leader");
    let failed = [1, 2, 3]
        .into_iter()
        .find(|&i| i != leader.id())
        .expect("f");
    c.kill(failed);
    thread::sleep(Duration::from_millis(600));
    let err = leader.add_voter(4).expect_err("strict");
    assert!(
        err.to_string().contains("not enough started members"),
        "{err}"
    );
}
