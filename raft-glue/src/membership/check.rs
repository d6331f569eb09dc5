//! The strict reconfiguration check, and the activity it is computed from.
//!
//! A change is allowed when (1) it can commit: a quorum of the current voters is recently
//! active (otherwise the proposal would hang, as etcd's `member remove` did in the
//! measurements this crate was built against), and (2) after it, the recently active members
//! among the new voters still form a quorum of the new voters. A member that was just added
//! has never been heard from, so it is not active: adding a voter to a 1-member cluster is
//! refused (etcd lets that one through and loses its quorum until the new member starts),
//! while adding a learner never changes the quorum and is always allowed.
//!
//! Activity is the leader's own record of when it last received a message from each member
//! ([`ActivityTracker`]), not raft-rs's `Progress::recent_active`: raft-rs marks a member
//! active the moment it is added, before it has ever answered.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use super::MembershipError;

/// A configuration change, as the strict check sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProposedChange {
    /// A new voting member.
    AddVoter(u64),
    /// A new learner.
    AddLearner(u64),
    /// Remove a voter or a learner.
    Remove(u64),
    /// Make a learner a voter.
    Promote(u64),
}

/// Quorum (majority) of `voters` members.
pub fn quorum(voters: usize) -> usize {
    voters / 2 + 1
}

/// Whether the active members among `voters` form a quorum.
pub fn has_quorum(voters: &BTreeSet<u64>, active: &BTreeSet<u64>) -> bool {
    !voters.is_empty() && voters.intersection(active).count() >= quorum(voters.len())
}

/// The strict reconfiguration check (module docs): `voters` and `learners` are the current
/// configuration, `active` the members recently heard from (the leader included).
pub fn strict_check(
    voters: &BTreeSet<u64>,
    learners: &BTreeSet<u64>,
    active: &BTreeSet<u64>,
    change: ProposedChange,
) -> Result<(), MembershipError> {
    let now_active = voters.intersection(active).count();
    if now_active < quorum(voters.len()) {
        return Err(MembershipError::NotEnoughStartedMembers {
            active: now_active,
            needed: quorum(voters.len()),
        });
    }
    let mut next = voters.clone();
    match change {
        ProposedChange::AddVoter(id) => {
            next.insert(id);
        }
        ProposedChange::AddLearner(_) => {}
        ProposedChange::Remove(id) => {
            next.remove(&id);
        }
        ProposedChange::Promote(id) => {
            if !learners.contains(&id) {
                return Err(if voters.contains(&id) {
                    MembershipError::NotLearner { id }
                } else {
                    MembershipError::MemberNotFound { id }
                });
            }
            next.insert(id);
        }
    }
    let next_active = next.intersection(active).count();
    if next_active < quorum(next.len()) {
        return Err(MembershipError::NotEnoughStartedMembers {
            active: next_active,
            needed: quorum(next.len()),
        });
    }
    Ok(())
}

/// When the leader last heard from each member. Feed it every message received
/// ([`ActivityTracker::heard`]); ask it for the active set when checking a change.
#[derive(Clone, Debug, Default)]
pub struct ActivityTracker {
    last: HashMap<u64, Instant>,
}

impl ActivityTracker {
    /// An empty tracker: nobody has been heard from.
    pub fn new() -> ActivityTracker {
        ActivityTracker::default()
    }

    /// Records a message from `id` received at `now`.
    pub fn heard(&mut self, id: u64, now: Instant) {
        let e = self.last.entry(id).or_insert(now);
        if *e < now {
            *e = now;
        }
    }

    /// Forgets a removed member.
    pub fn forget(&mut self, id: u64) {
        self.last.remove(&id);
    }

    /// When `id` was last heard from.
    pub fn last_heard(&self, id: u64) -> Option<Instant> {
        self.last.get(&id).copied()
    }

    /// Whether `id` was heard from within `window` before `now`.
    pub fn is_active(&self, id: u64, now: Instant, window: Duration) -> bool {
        self.last
            .get(&id)
            .is_some_and(|t| now.saturating_duration_since(*t) <= window)
    }

    /// Members heard from within `window` before `now`, plus `self_id` (a member is always
    /// active to itself).
    pub fn active(&self, self_id: u64, now: Instant, window: Duration) -> BTreeSet<u64> {
        let mut set: BTreeSet<u64> = self
            .last
            .iter()
            .filter(|(_, t)| now.saturating_duration_since(**t) <= window)
            .map(|(id, _)| *id)
            .collect();
        set.insert(self_id);
        set
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[u64]) -> BTreeSet<u64> {
        ids.iter().copied().collect()
    }

    fn refused(r: Result<(), MembershipError>) -> bool {
        match r {
            Err(e) => {
                assert_eq!(
                    e.to_string(),
                    "re-configuration failed due to not enough started members"
                );
                true
            }
            Ok(()) => false,
        }
    }

    #[test]
    fn quorum_arithmetic() {
        assert_eq!(quorum(1), 1);
        assert_eq!(quorum(2), 2);
        assert_eq!(quorum(3), 2);
        assert_eq!(quorum(4), 3);
        assert_eq!(quorum(5), 3);
        assert!(!has_quorum(&set(&[]), &set(&[1])));
    }

    /// Figure 4: a 4th member joins a 3-member cluster, then a 3–1 partition leaves the new
    /// member on the leader's side: the leader keeps its quorum of 3.
    #[test]
    fn figure_4_partition_3_1_after_adding_a_voter() {
        let voters = set(&[1, 2, 3]);
        assert!(!refused(strict_check(
            &voters,
            &set(&[]),
            &set(&[1, 2, 3]),
            ProposedChange::AddVoter(4)
        )));
        let after = set(&[1, 2, 3, 4]);
        assert!(
            has_quorum(&after, &set(&[1, 2, 4])),
            "leader side {{1,2,4}} keeps quorum 3"
        );
        assert!(!has_quorum(&after, &set(&[3])));
    }

    /// Figure 5: the same cluster partitioned 2–2: with the 4th as a voter neither side has
    /// a quorum (election); with the 4th as a learner the side with two voters keeps one.
    #[test]
    fn figure_5_partition_2_2() {
        let voter_flow = set(&[1, 2, 3, 4]);
        assert!(!has_quorum(&voter_flow, &set(&[1, 4])));
        assert!(!has_quorum(&voter_flow, &set(&[2, 3])));
        let learner_flow = set(&[1, 2, 3]);
        assert!(!refused(strict_check(
            &learner_flow,
            &set(&[]),
            &set(&[1, 2, 3]),
            ProposedChange::AddLearner(4)
        )));
        assert!(
            has_quorum(&learner_flow, &set(&[2, 3])),
            "voters 2,3 of 3 keep quorum"
        );
        assert!(!has_quorum(&learner_flow, &set(&[1, 4])));
    }

    /// Figure 6: one follower already partitioned, then a member is added: as a voter the
    /// quorum becomes 3 with only 2 active, so the strict check refuses; as a learner the
    /// quorum stays 2 of 3 and it is allowed.
    #[test]
    fn figure_6_add_while_a_member_is_partitioned() {
        let voters = set(&[1, 2, 3]);
        let active = set(&[1, 2]);
        assert!(refused(strict_check(
            &voters,
            &set(&[]),
            &active,
            ProposedChange::AddVoter(4)
        )));
        assert!(
            !has_quorum(&set(&[1, 2, 3, 4]), &active),
            "what etcd without the check loses"
        );
        assert!(!refused(strict_check(
            &voters,
            &set(&[]),
            &active,
            ProposedChange::AddLearner(4)
        )));
        assert!(has_quorum(&voters, &active));
    }

    /// Figure 7: adding a voter to a 1-member cluster makes the quorum 2 before the new
    /// member starts: refused (etcd lets it through); a learner is allowed, and removing it
    /// again is allowed even if it never starts.
    #[test]
    fn figure_7_add_to_a_single_member_cluster() {
        let voters = set(&[1]);
        let active = set(&[1]);
        assert!(refused(strict_check(
            &voters,
            &set(&[]),
            &active,
            ProposedChange::AddVoter(2)
        )));
        assert!(!refused(strict_check(
            &voters,
            &set(&[]),
            &active,
            ProposedChange::AddLearner(2)
        )));
        assert!(!refused(strict_check(
            &voters,
            &set(&[2]),
            &active,
            ProposedChange::Remove(2)
        )));
        // promoting the learner that never started is refused too
        assert!(refused(strict_check(
            &voters,
            &set(&[2]),
            &active,
            ProposedChange::Promote(2)
        )));
        // once it is heard from, the promotion passes the check
        assert!(!refused(strict_check(
            &voters,
            &set(&[2]),
            &set(&[1, 2]),
            ProposedChange::Promote(2)
        )));
    }

    /// Figure 8: a misconfigured member that never starts. As a voter in a healthy
    /// 3-member cluster the check lets it in (3 of 4 active), leaving no margin; as a learner
    /// the quorum is unchanged and it can always be removed.
    #[test]
    fn figure_8_misconfigured_member() {
        let voters = set(&[1, 2, 3]);
        let all = set(&[1, 2, 3]);
        assert!(!refused(strict_check(
            &voters,
            &set(&[]),
            &all,
            ProposedChange::AddVoter(4)
        )));
        let after = set(&[1, 2, 3, 4]);
        // one more failure and the voter flow has lost quorum
        assert!(!has_quorum(&after, &set(&[1, 2])));
        // the learner flow keeps the quorum through the same failure and removes it
        assert!(has_quorum(&voters, &set(&[1, 2])));
        assert!(!refused(strict_check(
            &voters,
            &set(&[4]),
            &set(&[1, 2]),
            ProposedChange::Remove(4)
        )));
    }

    /// Figure 9: 4 voters, one failed and one misconfigured: only 2 of 4 active, so no
    /// change can commit and the check refuses all of them (removal needs force-new-cluster,
    /// as in etcd). The check would have refused the add in the first place, and in the
    /// learner flow the same failures leave the quorum intact.
    #[test]
    fn figure_9_one_failed_one_misconfigured() {
        let voters = set(&[1, 2, 3, 4]);
        let active = set(&[1, 2]);
        assert!(refused(strict_check(
            &voters,
            &set(&[]),
            &active,
            ProposedChange::Remove(4)
        )));
        assert!(refused(strict_check(
            &voters,
            &set(&[]),
            &active,
            ProposedChange::Remove(3)
        )));
        assert!(refused(strict_check(
            &set(&[1, 2, 3]),
            &set(&[]),
            &active,
            ProposedChange::AddVoter(4)
        )));
        let learner_flow = set(&[1, 2, 3]);
        assert!(has_quorum(&learner_flow, &active));
        assert!(!refused(strict_check(
            &learner_flow,
            &set(&[4]),
            &active,
            ProposedChange::Remove(4)
        )));
        // removing the failed voter keeps 2 of 2 active: allowed
        assert!(!refused(strict_check(
            &learner_flow,
            &set(&[]),
            &active,
            ProposedChange::Remove(3)
        )));
    }

    #[test]
    fn remove_of_an_active_voter_from_two_is_allowed_only_if_the_rest_is_active() {
        // voters {1,2}: removing 2 leaves {1}, active
        assert!(!refused(strict_check(
            &set(&[1, 2]),
            &set(&[]),
            &set(&[1, 2]),
            ProposedChange::Remove(2)
        )));
        // voters {1,2,3}, 3 down: removing active 2 leaves {1,3} with 1 active of quorum 2
        assert!(refused(strict_check(
            &set(&[1, 2, 3]),
            &set(&[]),
            &set(&[1, 2]),
            ProposedChange::Remove(2)
        )));
        // removing the last voter is refused
        assert!(refused(strict_check(
            &set(&[1]),
            &set(&[]),
            &set(&[1]),
            ProposedChange::Remove(1)
        )));
    }

    #[test]
    fn promote_of_non_learners_names_the_etcd_error() {
        let voters = set(&[1, 2, 3]);
        let active = set(&[1, 2, 3]);
        assert_eq!(
            strict_check(&voters, &set(&[]), &active, ProposedChange::Promote(2)),
            Err(MembershipError::NotLearner { id: 2 })
        );
        assert_eq!(
            strict_check(&voters, &set(&[]), &active, ProposedChange::Promote(9)),
            Err(MembershipError::MemberNotFound { id: 9 })
        );
    }

    #[test]
    fn activity_window() {
        let mut t = ActivityTracker::new();
        let t0 = Instant::now();
        t.heard(2, t0);
        t.heard(3, t0 + Duration::from_secs(4));
        let w = Duration::from_secs(5);
        assert_eq!(t.active(1, t0 + Duration::from_secs(5), w), set(&[1, 2, 3]));
        assert_eq!(t.active(1, t0 + Duration::from_secs(6), w), set(&[1, 3]));
        assert!(!t.is_active(2, t0 + Duration::from_secs(6), w));
        // an older report does not move the time back
        t.heard(3, t0);
        assert_eq!(t.last_heard(3), Some(t0 + Duration::from_secs(4)));
        t.forget(3);
        assert_eq!(t.active(1, t0 + Duration::from_secs(6), w), set(&[1]));
    }
}
