//! The promotion gate: may this learner become a voter now?
//!
//! etcd 3.4 looks only at the Raft log (matched index ≥ 90% of the leader's), and so
//! promotes learners that have not yet applied the snapshot they received. Here a learner is
//! promotable only when every rule holds, checked in this order:
//!
//! 1. it is a member ("member not found") and a learner ("can only promote a learner
//!    member");
//! 2. no snapshot is in flight to it (raft-rs progress state is not `Snapshot`);
//! 3. it reported an applied index, and that index covers the last snapshot sent to it
//!    (installed **and** applied);
//! 4. the leader heard from it recently;
//! 5. its matched index is at least [`promote_match_percent`] of the leader's last index,
//! 6. and at most [`max_promote_lag`] entries behind it.
//!
//! Rules 2–6 fail with "can only promote a learner member which is in sync with leader",
//! the [`NotReady`] reason saying which rule.
//!
//! [`promote_match_percent`]: super::MembershipOptions::promote_match_percent
//! [`max_promote_lag`]: super::MembershipOptions::max_promote_lag

use super::{MembershipError, MembershipOptions};

/// The leader's view of one member, as the gate needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LearnerProgress {
    /// The member.
    pub id: u64,
    /// Whether it is in the configuration at all (`ProgressTracker::get(id).is_some()`).
    pub exists: bool,
    /// Whether it is a learner (`ConfState::learners` contains it).
    pub is_learner: bool,
    /// raft-rs `Progress::matched`.
    pub matched: u64,
    /// raft-rs `Progress::state == ProgressState::Snapshot`: a snapshot is in flight.
    pub snapshot_in_flight: bool,
    /// Index of the last snapshot the leader sent it and the learner acknowledged, if any.
    pub snapshot_index: Option<u64>,
    /// The applied index the learner last reported, if it ever did.
    pub applied: Option<u64>,
    /// Whether the leader heard from it within the active window.
    pub recently_active: bool,
}

impl LearnerProgress {
    /// Reads the leader's view of `id` from raft-rs's tracker (`raw.raft.prs()`);
    /// `snapshot_index`, `applied` and `recently_active` come from the node (the last
    /// acknowledged snapshot sent to `id`, the applied index `id` reported, and the
    /// [`ActivityTracker`](super::ActivityTracker)).
    pub fn from_tracker(
        id: u64,
        prs: &raft::ProgressTracker,
        snapshot_index: Option<u64>,
        applied: Option<u64>,
        recently_active: bool,
    ) -> LearnerProgress {
        let pr = prs.get(id);
        LearnerProgress {
            id,
            exists: pr.is_some(),
            is_learner: prs.conf().learners().contains(&id),
            matched: pr.map_or(0, |p| p.matched),
            snapshot_in_flight: pr.is_some_and(|p| p.state == raft::ProgressState::Snapshot),
            snapshot_index,
            applied,
            recently_active,
        }
    }
}

/// Which rule of the gate failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NotReady {
    /// A snapshot is still being sent or installed.
    SnapshotInFlight,
    /// The learner never reported an applied index.
    NoAppliedReport,
    /// The learner's applied index is below the snapshot it received.
    SnapshotNotApplied {
        /// The snapshot's index.
        snapshot: u64,
        /// The learner's applied index.
        applied: u64,
    },
    /// The leader has not heard from it within the active window.
    NotRecentlyActive,
    /// The matched index is below the required share of the leader's index.
    BelowMatchRatio {
        /// The learner's matched index.
        matched: u64,
        /// The leader's last index.
        leader: u64,
    },
    /// The learner is further behind than the absolute bound.
    LagTooLarge {
        /// Entries behind.
        lag: u64,
        /// The bound.
        max: u64,
    },
}

/// The promotion gate (module docs). `leader_index` is the leader's last log index
/// (`raft_log.last_index()`, which is also the leader's own `Progress::matched`).
pub fn promotion_gate(
    p: &LearnerProgress,
    leader_index: u64,
    options: &MembershipOptions,
) -> Result<(), MembershipError> {
    let id = p.id;
    if !p.exists {
        return Err(MembershipError::MemberNotFound { id });
    }
    if !p.is_learner {
        return Err(MembershipError::NotLearner { id });
    }
    let not_ready = |reason| Err(MembershipError::LearnerNotReady { id, reason });
    if p.snapshot_in_flight {
        return not_ready(NotReady::SnapshotInFlight);
    }
    let Some(applied) = p.applied else {
        return not_ready(NotReady::NoAppliedReport);
    };
    if let Some(snapshot) = p.snapshot_index
        && applied < snapshot
    {
        return not_ready(NotReady::SnapshotNotApplied { snapshot, applied });
    }
    if !p.recently_active {
        return not_ready(NotReady::NotRecentlyActive);
    }
    let pct = u128::from(options.promote_match_percent);
    if u128::from(p.matched) * 100 < u128::from(leader_index) * pct {
        return not_ready(NotReady::BelowMatchRatio {
            matched: p.matched,
            leader: leader_index,
        });
    }
    let lag = leader_index.saturating_sub(p.matched);
    if lag > options.max_promote_lag {
        return not_ready(NotReady::LagTooLarge {
            lag,
            max: options.max_promote_lag,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(id: u64) -> LearnerProgress {
        LearnerProgress {
            id,
            exists: true,
            is_learner: true,
            matched: 1000,
            snapshot_in_flight: false,
            snapshot_index: Some(900),
            applied: Some(950),
            recently_active: true,
        }
    }

    fn reason(r: Result<(), MembershipError>) -> NotReady {
        match r {
            Err(MembershipError::LearnerNotReady { reason, .. }) => reason,
            other => panic!("expected LearnerNotReady, got {other:?}"),
        }
    }

    #[test]
    fn a_caught_up_learner_passes() {
        let o = MembershipOptions::default();
        assert_eq!(promotion_gate(&ready(4), 1000, &o), Ok(()));
        assert_eq!(
            promotion_gate(&ready(4), 1100, &o),
            Ok(()),
            "exactly 1000/1100 ≥ 90%"
        );
    }

    #[test]
    fn each_rule_refuses_with_etcds_text() {
        let o = MembershipOptions::default();
        let p = LearnerProgress {
            exists: false,
            ..ready(4)
        };
        assert_eq!(
            promotion_gate(&p, 1000, &o),
            Err(MembershipError::MemberNotFound { id: 4 })
        );
        let p = LearnerProgress {
            is_learner: false,
            ..ready(4)
        };
        assert_eq!(
            promotion_gate(&p, 1000, &o),
            Err(MembershipError::NotLearner { id: 4 })
        );
        let p = LearnerProgress {
            snapshot_in_flight: true,
            ..ready(4)
        };
        let e = promotion_gate(&p, 1000, &o);
        assert_eq!(
            e.clone().map_err(|e| e.to_string()),
            Err("can only promote a learner member which is in sync with leader".to_string())
        );
        assert_eq!(reason(e), NotReady::SnapshotInFlight);
        let p = LearnerProgress {
            applied: None,
            ..ready(4)
        };
        assert_eq!(
            reason(promotion_gate(&p, 1000, &o)),
            NotReady::NoAppliedReport
        );
        // etcd's failure: log matched, snapshot received but not applied yet
        let p = LearnerProgress {
            applied: Some(10),
            snapshot_index: Some(900),
            ..ready(4)
        };
        assert_eq!(
            reason(promotion_gate(&p, 1000, &o)),
            NotReady::SnapshotNotApplied {
                snapshot: 900,
                applied: 10
            }
        );
        let p = LearnerProgress {
            recently_active: false,
            ..ready(4)
        };
        assert_eq!(
            reason(promotion_gate(&p, 1000, &o)),
            NotReady::NotRecentlyActive
        );
        let p = LearnerProgress {
            matched: 899,
            ..ready(4)
        };
        assert_eq!(
            reason(promotion_gate(&p, 1000, &o)),
            NotReady::BelowMatchRatio {
                matched: 899,
                leader: 1000
            }
        );
        // 95% matched but 50 000 entries behind: the absolute bound refuses it
        let p = LearnerProgress {
            matched: 950_000,
            ..ready(4)
        };
        assert_eq!(
            reason(promotion_gate(&p, 1_000_000, &o)),
            NotReady::LagTooLarge {
                lag: 50_000,
                max: 10_000
            }
        );
    }

    #[test]
    fn reads_the_raft_rs_tracker() {
        let mut prs = raft::ProgressTracker::new(256);
        for (id, learner) in [(1, false), (2, false), (3, false), (4, true)] {
            let mut c = raft::eraftpb::ConfChangeSingle {
                node_id: id,
                ..Default::default()
            };
            c.set_change_type(if learner {
                raft::eraftpb::ConfChangeType::AddLearnerNode
            } else {
                raft::eraftpb::ConfChangeType::AddNode
            });
            let (conf, changes) = raft::Changer::new(&prs)
                .simple(&[c])
                .expect("config change");
            prs.apply_conf(conf, changes, 10);
        }
        if let Some(p) = prs.get_mut(4) {
            p.matched = 950;
            p.become_snapshot(900);
        }
        let v = LearnerProgress::from_tracker(4, &prs, Some(900), Some(900), true);
        assert!(v.exists && v.is_learner && v.snapshot_in_flight);
        assert_eq!(v.matched, 950);
        let o = MembershipOptions::default();
        assert_eq!(
            reason(promotion_gate(&v, 1000, &o)),
            NotReady::SnapshotInFlight
        );
        if let Some(p) = prs.get_mut(4) {
            p.become_probe();
            p.matched = 950;
        }
        let v = LearnerProgress::from_tracker(4, &prs, Some(900), Some(900), true);
        assert_eq!(promotion_gate(&v, 1000, &o), Ok(()));
        let v = LearnerProgress::from_tracker(2, &prs, None, Some(0), true);
        assert_eq!(
            promotion_gate(&v, 1000, &o),
            Err(MembershipError::NotLearner { id: 2 })
        );
        let v = LearnerProgress::from_tracker(9, &prs, None, None, false);
        assert_eq!(
            promotion_gate(&v, 1000, &o),
            Err(MembershipError::MemberNotFound { id: 9 })
        );
    }

    #[test]
    fn learner_without_snapshot_needs_only_an_applied_report() {
        let o = MembershipOptions::default();
        let p = LearnerProgress {
            snapshot_index: None,
            applied: Some(0),
            matched: 5,
            ..ready(4)
        };
        assert_eq!(promotion_gate(&p, 5, &o), Ok(()));
    }

    #[test]
    fn ratio_is_exact_on_huge_indexes() {
        let o = MembershipOptions {
            max_promote_lag: u64::MAX,
            ..Default::default()
        };
        let leader = u64::MAX;
        let need = (u128::from(leader) * 90).div_ceil(100) as u64;
        let p = LearnerProgress {
            matched: need,
            applied: Some(need),
            snapshot_index: None,
            ..ready(4)
        };
        assert_eq!(promotion_gate(&p, leader, &o), Ok(()));
        let p = LearnerProgress {
            matched: need - 1,
            ..p
        };
        assert!(promotion_gate(&p, leader, &o).is_err());
    }
}
