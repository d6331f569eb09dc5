//! [`AutoPromoter`]: promotes a learner once the promotion gate has held long enough.
//!
//! The leader calls [`AutoPromoter::tick`] on every turn of its loop with the gate's verdict
//! for each learner. A learner becomes due when the gate has held without interruption for
//! [`MembershipOptions::auto_promote_after`]; `tick` then returns its id, once, and the
//! leader proposes `MemberOp::Promote { id, automatic: true }`. Only one change is in
//! flight at a time: nothing is proposed while a conf change is pending in Raft or while the
//! previous automatic promote is unresolved. An automatic promote that loses a race with a
//! manual one applies as a no-op ([`MemberSet::apply`](super::MemberSet::apply)), so either
//! order ends with one promotion. A learner held from automatic promotion
//! ([`MemberSet::is_held`](super::MemberSet::is_held): its role was set by a raw conf
//! change) is left out of the gates the leader passes, so it never becomes due.

use std::collections::HashMap;
use std::time::Instant;

use super::{MembershipError, MembershipOptions};

/// The automatic promotion state machine (module docs).
#[derive(Clone, Debug, Default)]
pub struct AutoPromoter {
    /// Since when the gate has held, per learner.
    ready_since: HashMap<u64, Instant>,
    /// The automatic promote proposed and not yet applied or failed.
    in_flight: Option<u64>,
}

impl AutoPromoter {
    /// A promoter with nothing pending.
    pub fn new() -> AutoPromoter {
        AutoPromoter::default()
    }

    /// The learner whose automatic promote is in flight.
    pub fn in_flight(&self) -> Option<u64> {
        self.in_flight
    }

    /// Since when the gate has held for `id`, if it holds.
    pub fn ready_since(&self, id: u64) -> Option<Instant> {
        self.ready_since.get(&id).copied()
    }

    /// One step, on the leader: `gates` is the gate's verdict for every current learner,
    /// `conf_change_pending` whether Raft has an unapplied conf change (raft-rs:
    /// `raft.pending_conf_index > raft_log.applied`). Returns the learner to promote now.
    pub fn tick(
        &mut self,
        now: Instant,
        gates: &[(u64, Result<(), MembershipError>)],
        conf_change_pending: bool,
        options: &MembershipOptions,
    ) -> Option<u64> {
        self.ready_since
            .retain(|id, _| gates.iter().any(|(g, r)| g == id && r.is_ok()));
        for (id, r) in gates {
            if r.is_ok() {
                self.ready_since.entry(*id).or_insert(now);
            }
        }
        if !options.auto_promote || conf_change_pending || self.in_flight.is_some() {
            return None;
        }
        let due = self
            .ready_since
            .iter()
            .filter(|(_, since)| {
                now.saturating_duration_since(**since) >= options.auto_promote_after
            })
            .min_by_key(|(id, since)| (**since, **id))
            .map(|(id, _)| *id)?;
        self.in_flight = Some(due);
        Some(due)
    }

    /// A membership change about `id` was applied (promote, manual or automatic, or
    /// removal): the in-flight promote, if it was for `id`, is resolved.
    pub fn on_applied(&mut self, id: u64) {
        self.ready_since.remove(&id);
        if self.in_flight == Some(id) {
            self.in_flight = None;
        }
    }

    /// The automatic proposal for `id` was dropped or refused: try again once the gate has
    /// held again for the full duration.
    pub fn on_failed(&mut self, id: u64, now: Instant) {
        if self.in_flight == Some(id) {
            self.in_flight = None;
        }
        self.ready_since.insert(id, now);
    }

    /// This member stopped being the leader: forget everything (the next leader starts its
    /// own clock, as the gate must hold under it).
    pub fn reset(&mut self) {
        self.ready_since.clear();
        self.in_flight = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::NotReady;
    use std::time::Duration;

    fn not_ready(id: u64) -> Result<(), MembershipError> {
        Err(MembershipError::LearnerNotReady {
            id,
            reason: NotReady::NotRecentlyActive,
        })
    }

    #[test]
    fn promotes_after_the_gate_held_continuously() {
        let o = MembershipOptions::default();
        let mut a = AutoPromoter::new();
        let t0 = Instant::now();
        let s = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(a.tick(s(0), &[(4, Ok(()))], false, &o), None);
        assert_eq!(a.tick(s(900), &[(4, Ok(()))], false, &o), None);
        // interruption restarts the clock
        assert_eq!(a.tick(s(950), &[(4, not_ready(4))], false, &o), None);
        assert_eq!(a.tick(s(1000), &[(4, Ok(()))], false, &o), None);
        assert_eq!(a.tick(s(1999), &[(4, Ok(()))], false, &o), None);
        assert_eq!(a.tick(s(2000), &[(4, Ok(()))], false, &o), Some(4));
        // once only, while in flight
        assert_eq!(a.tick(s(3000), &[(4, Ok(()))], false, &o), None);
        assert_eq!(a.in_flight(), Some(4));
        a.on_applied(4);
        assert_eq!(a.in_flight(), None);
        assert_eq!(a.tick(s(3000), &[], false, &o), None);
    }

    #[test]
    fn one_change_at_a_time_and_off_when_disabled() {
        let o = MembershipOptions::default();
        let mut a = AutoPromoter::new();
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(5);
        a.tick(t0, &[(4, Ok(())), (5, Ok(()))], false, &o);
        assert_eq!(
            a.tick(later, &[(4, Ok(())), (5, Ok(()))], true, &o),
            None,
            "conf change pending"
        );
        let first = a.tick(later, &[(4, Ok(())), (5, Ok(()))], false, &o);
        assert_eq!(first, Some(4), "oldest ready first, ties by id");
        assert_eq!(
            a.tick(later, &[(4, Ok(())), (5, Ok(()))], false, &o),
            None,
            "4 in flight"
        );
        a.on_applied(4);
        assert_eq!(a.tick(later, &[(5, Ok(()))], false, &o), Some(5));
        let off = MembershipOptions {
            auto_promote: false,
            ..o
        };
        let mut b = AutoPromoter::new();
        b.tick(t0, &[(4, Ok(()))], false, &off);
        assert_eq!(b.tick(later, &[(4, Ok(()))], false, &off), None);
    }

    #[test]
    fn a_manual_promote_racing_resolves_the_in_flight_one() {
        let o = MembershipOptions::default();
        let mut a = AutoPromoter::new();
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(2);
        a.tick(t0, &[(4, Ok(()))], false, &o);
        assert_eq!(a.tick(later, &[(4, Ok(()))], false, &o), Some(4));
        // the manual promote applied first: 4 is no longer a learner, so it leaves the gates
        a.on_applied(4);
        assert_eq!(a.tick(later, &[], false, &o), None);
        assert_eq!(a.in_flight(), None);
    }

    #[test]
    fn failure_and_leadership_loss_restart_the_clock() {
        let o = MembershipOptions::default();
        let mut a = AutoPromoter::new();
        let t0 = Instant::now();
        let s = |ms| t0 + Duration::from_millis(ms);
        a.tick(s(0), &[(4, Ok(()))], false, &o);
        assert_eq!(a.tick(s(1000), &[(4, Ok(()))], false, &o), Some(4));
        a.on_failed(4, s(1000));
        assert_eq!(a.tick(s(1500), &[(4, Ok(()))], false, &o), None);
        assert_eq!(a.tick(s(2000), &[(4, Ok(()))], false, &o), Some(4));
        a.reset();
        assert_eq!(a.ready_since(4), None);
        assert_eq!(a.tick(s(2500), &[(4, Ok(()))], false, &o), None);
    }
}
