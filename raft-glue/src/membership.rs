//! Cluster membership with etcd's semantics, and the rules that make changing it safe.
//!
//! How the pieces fit:
//!
//! - [`Member`] ([`member`]): a member's random 64-bit id (never reused), name, peer and
//!   client URLs and learner flag, with the versioned, checksummed encoding stored in the
//!   `members` aux bucket (with, for a learner, whether it is held from automatic
//!   promotion); [`MemberOp`] is one membership operation (add, remove, update peer URLs,
//!   promote) with its own encoding, carried in the conf-change entry.
//! - [`MemberSet`] ([`set`]): the cluster's members, the learners among them held from
//!   automatic promotion, and the ids of removed members, loaded from the store and changed
//!   through [`keel_mvcc::WriteTxn::put_aux`] in the same transaction that records the conf
//!   change's consistent index, so membership and applied index never disagree. It
//!   validates every operation with etcd's error texts.
//! - [`strict_check`] ([`check`]): the strict reconfiguration check, a pure function of the
//!   voters, the learners, the members recently heard from ([`ActivityTracker`]) and the
//!   proposed change.
//! - [`promotion_gate`] ([`gate`]): whether a learner may be promoted, a pure function of the
//!   leader's progress view of it ([`LearnerProgress`]).
//! - [`AutoPromoter`] ([`auto`]): promotes a learner once the gate has held for
//!   [`MembershipOptions::auto_promote_after`], one change at a time.
//! - [`TransferProgress`] ([`progress`]): bytes sent, rate and estimated time left of a
//!   snapshot transfer, for member status.
//!
//! Every refusal is a [`MembershipError`] whose text is etcd's, so operators recognise it.
//!
//! # Wiring into the node
//!
//! - **Start**: `MemberSet::load(&store)`; `check_not_removed(id)` (refuse to start on a
//!   removed member's data); for a member joining with a start configuration,
//!   `check_start_config(&local)`; on bootstrap, `MemberSet::bootstrap(members)` then
//!   `persist_all(&mut txn)` in the first write transaction.
//! - **Every message received** (`Driver::step`): `activity.heard(m.from, Instant::now())`.
//! - **Proposing** a [`MemberOp`] on the leader: `members.validate(&op, &options)`, then, when
//!   `options.strict_reconfig_check`, `strict_check(&voters, &learners, &activity.active(id,
//!   now, options.active_window), change)` with `change = op.proposed_change()`, then for a
//!   manual promote `promotion_gate(&LearnerProgress::from_tracker(..), last_index, &options)`;
//!   propose the Raft conf change with `op.encode()` in the entry context.
//! - **Applying** the conf-change entry: decode the op, `members.apply(&op, index, &options,
//!   &mut txn)` in the transaction that sets the consistent index; on `Ok(Changed)` apply the
//!   Raft conf change, on `Ok(NoOp)` or `Err` skip it (do not apply an empty `ConfChangeV2`:
//!   that means "leave joint"); then `auto.on_applied(op.id())`.
//! - **Applying a raw conf change** (a [`Request::ConfChange`](crate::Request), no
//!   operation), in the transaction that records the entry's index and the conf state:
//!   every member the applied configuration no longer lists (in its voters, learners or
//!   outgoing voters) is removed with `members.remove_departed(id, index, &mut txn)`, then
//!   forgotten (its transfer cancelled, no gate state kept); an outgoing voter of a joint
//!   configuration stays until the configuration leaves it. Every member it lists for the
//!   first time is listed with `members.add_joined(member, &mut txn)`, and every listed
//!   member whose role it changes takes that role with `members.set_role(id, is_learner,
//!   &mut txn)`. A learner so added, or a voter so demoted, is held from automatic promotion
//!   ([`MemberSet::is_held`]) until it stops being a learner: the operator who made it a
//!   learner that way promotes it.
//! - **Each loop turn on the leader**: build the gate verdict of every learner that is not
//!   held from automatic promotion and call
//!   `auto.tick(now, &gates, raft.pending_conf_index > raft_log.applied, &options)`; propose
//!   `MemberOp::Promote { id, automatic: true }` for the id it returns (`auto.on_failed` if
//!   the proposal is dropped); `auto.reset()` when leadership is lost.
//! - **Requests on a learner**: `refuse_on_learner(is_learner, write_or_linearizable)?`.

pub mod auto;
pub mod check;
pub mod gate;
pub mod member;
pub mod progress;
pub mod set;

use std::time::Duration;

pub use auto::AutoPromoter;
pub use check::{ActivityTracker, ProposedChange, quorum, strict_check};
pub use gate::{LearnerProgress, NotReady, promotion_gate};
pub use member::{Member, MemberOp};
pub use progress::TransferProgress;
pub use set::{MEMBERS_BUCKET, MemberSet, REMOVED_BUCKET};

/// Why a membership operation was refused. The texts of the variants that etcd also reports
/// are etcd's, word for word.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MembershipError {
    /// The member named by the operation is not in the cluster.
    #[error("member not found")]
    MemberNotFound {
        /// The member asked for.
        id: u64,
    },
    /// Promote of a member that is already a voter.
    #[error("can only promote a learner member")]
    NotLearner {
        /// The member asked for.
        id: u64,
    },
    /// Promote of a learner that has not caught up; `reason` says which rule failed.
    #[error("can only promote a learner member which is in sync with leader")]
    LearnerNotReady {
        /// The learner.
        id: u64,
        /// The rule of the promotion gate that failed.
        reason: NotReady,
    },
    /// Adding a learner would exceed [`MembershipOptions::max_learners`].
    #[error("too many learner members in cluster")]
    TooManyLearners {
        /// The configured limit.
        limit: usize,
    },
    /// Another member already uses one of the peer URLs.
    #[error("peerURL exists")]
    PeerUrlExists {
        /// The URL in use.
        url: String,
    },
    /// The id belongs to a member that was removed; ids are never reused.
    #[error("ID removed")]
    IdRemoved {
        /// The removed id.
        id: u64,
    },
    /// The id is already a member.
    #[error("member ID already exist")]
    IdExists {
        /// The id.
        id: u64,
    },
    /// The strict reconfiguration check refused the change.
    #[error("re-configuration failed due to not enough started members")]
    NotEnoughStartedMembers {
        /// Members recently active that would count towards the new quorum.
        active: usize,
        /// The quorum of the configuration (the new one, or the current one when it has
        /// already lost its quorum).
        needed: usize,
    },
    /// A learner refuses writes and linearizable reads.
    #[error("rpc not supported for learner")]
    RpcNotSupportedForLearner,
    /// This member was removed from the cluster and must not run on its old data.
    #[error("this member has been permanently removed from the cluster")]
    PermanentlyRemoved {
        /// This member.
        id: u64,
    },
    /// The configuration a member was started with lists a different number of members
    /// than the cluster has.
    #[error("the member count is unequal")]
    MemberCountUnequal {
        /// Members in the start configuration.
        local: usize,
        /// Members in the cluster.
        cluster: usize,
    },
    /// The configuration a member was started with names a member whose peer URLs differ
    /// from the cluster's.
    #[error("unmatched member while checking PeerURLs")]
    UnmatchedPeerUrls {
        /// The member whose URLs differ.
        name: String,
    },
    /// A member description is unusable (no peer URL, a field too long, id 0).
    #[error("invalid member {id:016x}: {reason}")]
    InvalidMember {
        /// The member.
        id: u64,
        /// What is wrong.
        reason: String,
    },
    /// Stored or transmitted membership bytes are malformed.
    #[error("cannot decode {what}: {reason}")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// An option failed validation.
    #[error("invalid membership option: {0}")]
    InvalidOption(String),
    /// The store refused or failed reading or writing the membership buckets.
    #[error("membership store error: {0}")]
    Store(String),
}

impl From<MembershipError> for crate::NodeError {
    fn from(e: MembershipError) -> crate::NodeError {
        crate::NodeError::Membership(e.to_string())
    }
}

/// Refuses, on a learner, what a learner must not serve: writes and linearizable reads
/// (`needs_leader_path`). Serializable reads and member status are always allowed.
pub fn refuse_on_learner(is_learner: bool, needs_leader_path: bool) -> Result<(), MembershipError> {
    if is_learner && needs_leader_path {
        Err(MembershipError::RpcNotSupportedForLearner)
    } else {
        Ok(())
    }
}

/// Knobs of membership changes.
#[derive(Clone, Debug, PartialEq)]
pub struct MembershipOptions {
    /// Refuse an add, remove or promote after which fewer members than a quorum of the new
    /// configuration would be recently active (etcd `--strict-reconfig-check`).
    /// Default: true.
    pub strict_reconfig_check: bool,
    /// Every member add joins as a learner, whatever the request says, so a misconfigured
    /// or never-started member never changes the quorum and can always be removed.
    /// Default: true.
    pub learner_by_default: bool,
    /// The leader promotes a learner by itself once the promotion gate has held for
    /// `auto_promote_after`. Default: true.
    ///
    /// A learner whose role was set by a raw conf change (a
    /// [`Request::ConfChange`](crate::Request), or any conf change entry that carries no
    /// membership operation) is never promoted automatically: one that such a change added
    /// as a learner, or a voter that such a change demoted, stays a learner, caught up or
    /// not, until it is promoted explicitly, by [`MemberOp::Promote`]
    /// ([`Node::member_promote`](crate::Node::member_promote), through the promotion gate) or
    /// by a raw conf change that makes it a voter. A demotion made that way is meant, and
    /// automatic promotion would undo it. That hold is part of the member set
    /// ([`MemberSet::is_held`], [`Node::held_learners`](crate::Node::held_learners)): it is
    /// replicated, persisted and carried by snapshots with it, so it survives restarts and a
    /// change of leader.
    pub auto_promote: bool,
    /// How long the gate must hold without interruption before an automatic promotion.
    /// Default: 1 s.
    pub auto_promote_after: Duration,
    /// Most learners a cluster may have at once (etcd: 1). Default: 1.
    pub max_learners: usize,
    /// A learner is promotable only when its matched index is at least this percentage of
    /// the leader's last index (etcd's rule). Default: 90.
    pub promote_match_percent: u8,
    /// A learner is promotable only when it is at most this many entries behind the
    /// leader's last index. Default: 10 000 (etcd's 1/10 of the default snapshot count).
    pub max_promote_lag: u64,
    /// A member counts as started (recently active) when the leader heard from it within
    /// this window (etcd's health interval). Default: 5 s.
    pub active_window: Duration,
}

impl Default for MembershipOptions {
    fn default() -> Self {
        MembershipOptions {
            strict_reconfig_check: true,
            learner_by_default: true,
            auto_promote: true,
            auto_promote_after: Duration::from_secs(1),
            max_learners: 1,
            promote_match_percent: 90,
            max_promote_lag: 10_000,
            active_window: Duration::from_secs(5),
        }
    }
}

impl MembershipOptions {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), MembershipError> {
        if self.promote_match_percent == 0 || self.promote_match_percent > 100 {
            return Err(MembershipError::InvalidOption(format!(
                "promote_match_percent is {}, it must be in 1..=100",
                self.promote_match_percent
            )));
        }
        if self.active_window.is_zero() {
            return Err(MembershipError::InvalidOption(
                "active_window must be longer than zero".into(),
            ));
        }
        if self.auto_promote && !self.learner_by_default && self.max_learners == 0 {
            return Err(MembershipError::InvalidOption(
                "auto_promote needs learners, but max_learners is 0".into(),
            ));
        }
        if self.learner_by_default && self.max_learners == 0 {
            return Err(MembershipError::InvalidOption(
                "learner_by_default needs max_learners of at least 1".into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_texts_are_etcds() {
        let cases: Vec<(MembershipError, &str)> = vec![
            (
                MembershipError::MemberNotFound { id: 1 },
                "member not found",
            ),
            (
                MembershipError::NotLearner { id: 1 },
                "can only promote a learner member",
            ),
            (
                MembershipError::LearnerNotReady {
                    id: 1,
                    reason: NotReady::NoAppliedReport,
                },
                "can only promote a learner member which is in sync with leader",
            ),
            (
                MembershipError::TooManyLearners { limit: 1 },
                "too many learner members in cluster",
            ),
            (
                MembershipError::PeerUrlExists { url: "x".into() },
                "peerURL exists",
            ),
            (MembershipError::IdRemoved { id: 1 }, "ID removed"),
            (
                MembershipError::NotEnoughStartedMembers {
                    active: 1,
                    needed: 2,
                },
                "re-configuration failed due to not enough started members",
            ),
            (
                MembershipError::RpcNotSupportedForLearner,
                "rpc not supported for learner",
            ),
            (
                MembershipError::PermanentlyRemoved { id: 1 },
                "this member has been permanently removed from the cluster",
            ),
            (
                MembershipError::MemberCountUnequal {
                    local: 3,
                    cluster: 4,
                },
                "the member count is unequal",
            ),
            (
                MembershipError::UnmatchedPeerUrls { name: "a".into() },
                "unmatched member while checking PeerURLs",
            ),
        ];
        for (e, text) in cases {
            assert_eq!(e.to_string(), text);
        }
    }

    #[test]
    fn learners_refuse_leader_path_requests_only() {
        assert_eq!(
            refuse_on_learner(true, true),
            Err(MembershipError::RpcNotSupportedForLearner)
        );
        assert_eq!(refuse_on_learner(true, false), Ok(()));
        assert_eq!(refuse_on_learner(false, true), Ok(()));
    }

    #[test]
    fn options_validate() {
        assert!(MembershipOptions::default().validate().is_ok());
        let bad = MembershipOptions {
            promote_match_percent: 101,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = MembershipOptions {
            max_learners: 0,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let bad = MembershipOptions {
            active_window: Duration::ZERO,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
        let ok = MembershipOptions {
            max_learners: 0,
            learner_by_default: false,
            auto_promote: false,
            ..Default::default()
        };
        assert!(ok.validate().is_ok());
    }
}
