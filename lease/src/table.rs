//! The in-memory lease table: leases, attached keys, roles, expiry and checkpoint schedules.
//!
//! [`LeaseTable`] is the lessor's state machine with no storage: every operation takes the
//! current time, so it is deterministic and cheap to test. [`Lessor`](crate::Lessor) wraps it
//! with persistence through the MVCC store and a [`Clock`](crate::Clock).
//!
//! Layout: leases live in a slab of 56-byte slots (freed slots are reused); an [`IdIndex`]
//! maps ids to slots; the expiry queue ([`TimerQueue`]: a min-heap behind a timing wheel),
//! and the retry queue of leases handed out as expired ([`RetryQueue`]) hold 24-byte timers
//! naming a lease, its slot and the slot's expiry generation; the checkpoint queue
//! ([`CheckpointQueue`]) holds 8-byte entries naming a slot and its incarnation. Both generations live in dense arrays
//! beside the slots (4 bytes a slot each), so handing out expired leases reads the timers and
//! that array and never a slot. A renew pushes a new timer and bumps the slot's expiry
//! generation; a revoke frees the slot and bumps both generations; stale timers are skipped
//! when they surface and swept out when they outnumber the live ones.
//!
//! Roles follow etcd. Only the primary has deadlines: on promotion every lease expires at
//! `now + remaining TTL + extension`, where the remaining TTL is the last checkpointed one
//! (or the granted TTL when there is none); on demotion every deadline is dropped.
//!
//! Checkpoints are scheduled every checkpoint interval for each lease whose remaining TTL is
//! longer than the interval. Since the schedule time is always `now + interval` and time
//! never goes backwards, the schedule is a FIFO queue, already sorted ([`CheckpointQueue`],
//! which rounds deadlines up to a whole second). A lease leaves the schedule once its
//! remaining TTL is no longer than the interval, and a renewal puts it back. A renewal asks
//! for its checkpoint to be cleared when one is stored or one was produced since the last
//! clear (it may be applied after the renewal); after a promotion, the first renewal of
//! each lease always asks, for the checkpoints the previous primary produced. A checkpoint
//! never records more than the granted TTL.

use std::time::Duration;

use crate::LeaseId;
use crate::error::LeaseError;
use crate::heap::{RetryQueue, Timer, TimerQueue};
use crate::index::IdIndex;
use crate::keys::KeySet;
use crate::options::LessorOptions;
use crate::schedule::{CheckpointQueue, Scheduled};

const NANOS_PER_SEC: u64 = 1_000_000_000;
/// Expiry of every lease on a non-primary.
const FOREVER: u64 = u64::MAX;
/// Stale timers are swept once they exceed the live leases by this many, and the total
/// exceeds twice the live leases.
const SWEEP_SLACK: usize = 1_024;
/// Mark: a checkpoint of the slot's current lease is on the schedule.
const SCHEDULED: u8 = 1;
/// Mark: a checkpoint of the slot's current lease was produced since its last clear.
const IN_FLIGHT: u8 = 2;

/// A `(lease, remaining TTL)` record the primary hands out for replication. Applying it
/// persists the remaining TTL; 0 clears it (the next primary restores the full TTL).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Checkpoint {
    /// The lease.
    pub id: LeaseId,
    /// Remaining TTL in seconds (rounded up); 0 clears the checkpointed value.
    pub remaining_ttl: i64,
}

/// The result of a renewal on the primary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Renewal {
    /// The lease's TTL in seconds, now its remaining TTL.
    pub ttl: i64,
    /// Set when the lease carries a checkpointed remaining TTL: the caller must replicate
    /// and apply this checkpoint (remaining TTL 0), or a new primary would restore the stale,
    /// shorter remaining TTL instead of the full one.
    pub checkpoint: Option<Checkpoint>,
}

/// What [`LeaseTable::time_to_live`] reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimeToLive {
    /// The lease.
    pub id: LeaseId,
    /// The granted TTL in seconds (after raising it to the minimum).
    pub granted_ttl: i64,
    /// Seconds left, rounded up; 0 once expired. On a non-primary, which has no deadlines,
    /// the last checkpointed remaining TTL, or the granted TTL when there is none.
    pub ttl: i64,
    /// The attached keys in ascending order, when asked for; otherwise empty.
    pub keys: Vec<Vec<u8>>,
}

/// One lease as seen by [`LeaseTable::iter`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseStatus {
    /// The lease.
    pub id: LeaseId,
    /// The granted TTL in seconds.
    pub ttl: i64,
    /// The last checkpointed remaining TTL in seconds; 0 when none.
    pub checkpointed_ttl: i64,
    /// The deadline on the lessor's clock; `None` on a non-primary.
    pub expiry: Option<Duration>,
    /// Number of attached keys.
    pub keys: usize,
}

#[derive(Debug)]
struct Slot {
    /// 0 when the slot is free.
    id: LeaseId,
    ttl: i64,
    remaining: i64,
    /// Nanoseconds on the lessor's clock; [`FOREVER`] on a non-primary.
    expiry: u64,
    keys: KeySet,
}

/// The lessor's in-memory state. See the module docs.
#[derive(Debug)]
pub struct LeaseTable {
    options: LessorOptions,
    min_ttl: i64,
    extension: u64,
    retry: u64,
    interval: u64,
    slots: Vec<Slot>,
    /// Expiry generation of each slot, bumped by renew, revoke and promote: an expiry timer
    /// is current when its tag equals it. Kept apart from the slots (4 bytes a slot, so a
    /// million leases take 4 MB) so that validating expired timers reads this dense array
    /// rather than one 56-byte slot per lease.
    gens: Vec<u32>,
    /// Incarnation of each slot, bumped when the slot is freed, so checkpoint timers of a
    /// revoked lease never apply to the lease that reuses the slot. Apart from the slots too,
    /// which keeps a slot at 56 bytes.
    incarnations: Vec<u32>,
    /// Checkpoint marks of each slot ([`SCHEDULED`], [`IN_FLIGHT`]), apart from the slots
    /// like the generations.
    marks: Vec<u8>,
    free: Vec<u32>,
    index: IdIndex,
    live: usize,
    expiries: TimerQueue,
    retries: RetryQueue,
    checkpoints: CheckpointQueue,
    primary: bool,
    tokens: f64,
    refilled_at: u64,
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn secs_to_nanos(secs: i64) -> u64 {
    u64::try_from(secs)
        .unwrap_or(0)
        .saturating_mul(NANOS_PER_SEC)
}

fn ceil_secs(nanos: u64) -> i64 {
    i64::try_from(nanos.div_ceil(NANOS_PER_SEC)).unwrap_or(i64::MAX)
}

impl LeaseTable {
    /// An empty, non-primary table.
    pub fn new(options: LessorOptions) -> Result<LeaseTable, LeaseError> {
        options.validate()?;
        Ok(LeaseTable {
            min_ttl: options.effective_min_ttl(),
            extension: nanos(options.effective_promote_extension()),
            retry: nanos(options.expired_retry_interval),
            interval: nanos(options.checkpoint_interval),
            options,
            slots: Vec::new(),
            gens: Vec::new(),
            incarnations: Vec::new(),
            marks: Vec::new(),
            free: Vec::new(),
            index: IdIndex::new(),
            live: 0,
            expiries: TimerQueue::default(),
            retries: RetryQueue::default(),
            checkpoints: CheckpointQueue::default(),
            primary: false,
            tokens: 0.0,
            refilled_at: 0,
        })
    }

    /// The options in force.
    pub fn options(&self) -> &LessorOptions {
        &self.options
    }

    /// Number of leases.
    pub fn len(&self) -> usize {
        self.live
    }

    /// True when there is no lease.
    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// True on the primary.
    pub fn is_primary(&self) -> bool {
        self.primary
    }

    fn find(&self, id: LeaseId) -> Option<u32> {
        if id == 0 {
            return None;
        }
        let slots = &self.slots;
        self.index.get(id, |s| slots[s as usize].id)
    }

    fn slot(&self, id: LeaseId) -> Result<&Slot, LeaseError> {
        self.find(id)
            .map(|s| &self.slots[s as usize])
            .ok_or(LeaseError::NotFound { id })
    }

    fn slot_mut(&mut self, id: LeaseId) -> Result<&mut Slot, LeaseError> {
        match self.find(id) {
            Some(s) => Ok(&mut self.slots[s as usize]),
            None => Err(LeaseError::NotFound { id }),
        }
    }

    /// True when lease `id` exists.
    pub fn contains(&self, id: LeaseId) -> bool {
        self.find(id).is_some()
    }

    /// Checks a grant without making it: returns the TTL that would be granted (raised to
    /// the minimum), or why the grant is refused.
    pub fn check_grant(&self, id: LeaseId, ttl: i64) -> Result<i64, LeaseError> {
        if id == 0 {
            return Err(LeaseError::ReservedId);
        }
        if ttl <= 0 {
            return Err(LeaseError::TtlNotPositive { id, ttl });
        }
        if ttl > self.options.max_ttl {
            return Err(LeaseError::TtlTooLarge {
                id,
                ttl,
                max: self.options.max_ttl,
            });
        }
        if self.contains(id) {
            return Err(LeaseError::AlreadyExists { id });
        }
        Ok(ttl.max(self.min_ttl))
    }

    /// Grants lease `id` for `ttl` seconds (raised to the minimum TTL); returns the TTL
    /// granted. On the primary the lease expires `ttl` from `now`.
    pub fn grant(&mut self, id: LeaseId, ttl: i64, now: Duration) -> Result<i64, LeaseError> {
        let ttl = self.check_grant(id, ttl)?;
        self.insert(id, ttl, 0, nanos(now));
        Ok(ttl)
    }

    /// Re-creates a lease read back from storage, with its stored TTLs.
    pub fn restore(
        &mut self,
        id: LeaseId,
        ttl: i64,
        remaining: i64,
        now: Duration,
    ) -> Result<(), LeaseError> {
        if id == 0 {
            return Err(LeaseError::ReservedId);
        }
        if self.contains(id) {
            return Err(LeaseError::AlreadyExists { id });
        }
        self.insert(id, ttl.max(1), remaining.max(0), nanos(now));
        Ok(())
    }

    fn insert(&mut self, id: LeaseId, ttl: i64, remaining: i64, now: u64) {
        let slot = match self.free.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot {
                    id: 0,
                    ttl: 0,
                    remaining: 0,
                    expiry: FOREVER,
                    keys: KeySet::new(),
                });
                self.gens.push(0);
                self.incarnations.push(0);
                self.marks.push(0);
                (self.slots.len() - 1) as u32
            }
        };
        {
            let s = &mut self.slots[slot as usize];
            s.id = id;
            s.ttl = ttl;
            // A checkpoint never holds more than the granted TTL.
            s.remaining = remaining.clamp(0, ttl);
            s.expiry = FOREVER;
        }
        self.marks[slot as usize] = 0;
        self.index.insert(id, slot);
        self.live += 1;
        if self.primary {
            let s = &mut self.slots[slot as usize];
            let base = secs_to_nanos(if s.remaining > 0 { s.remaining } else { ttl });
            s.expiry = now.saturating_add(base);
            self.expiries.push(Timer {
                deadline: s.expiry,
                id,
                slot,
                tag: self.gens[slot as usize],
            });
            if base > self.interval {
                self.schedule(slot, now);
            }
        }
    }

    /// The keys attached to lease `id`, in ascending order.
    pub fn keys(&self, id: LeaseId) -> Result<Vec<Vec<u8>>, LeaseError> {
        Ok(self.slot(id)?.keys.sorted())
    }

    /// Removes lease `id` and returns its attached keys (ascending).
    pub fn remove(&mut self, id: LeaseId) -> Result<Vec<Vec<u8>>, LeaseError> {
        let slots = &self.slots;
        let slot = self
            .index
            .remove(id, |s| slots[s as usize].id)
            .ok_or(LeaseError::NotFound { id })?;
        let s = &mut self.slots[slot as usize];
        let keys = std::mem::replace(&mut s.keys, KeySet::new()).sorted();
        s.id = 0;
        s.expiry = FOREVER;
        let generation = &mut self.gens[slot as usize];
        *generation = generation.wrapping_add(1);
        let incarnation = &mut self.incarnations[slot as usize];
        *incarnation = incarnation.wrapping_add(1);
        self.marks[slot as usize] = 0;
        self.free.push(slot);
        self.live -= 1;
        self.sweep();
        Ok(keys)
    }

    /// Attaches `key` to lease `id` (no effect if already attached).
    pub fn attach(&mut self, id: LeaseId, key: &[u8]) -> Result<(), LeaseError> {
        self.slot_mut(id)?.keys.insert(key);
        Ok(())
    }

    /// Detaches `key` from lease `id`; returns whether it was attached.
    pub fn detach(&mut self, id: LeaseId, key: &[u8]) -> Result<bool, LeaseError> {
        Ok(self.slot_mut(id)?.keys.remove(key))
    }

    /// Renews lease `id` on the primary: it now expires its full TTL from `now`.
    ///
    /// Refused with [`LeaseError::NotPrimary`] on a non-primary, and with
    /// [`LeaseError::NotFound`] for an unknown lease or one that has already expired (it is
    /// awaiting revocation).
    pub fn renew(&mut self, id: LeaseId, now: Duration) -> Result<Renewal, LeaseError> {
        if !self.primary {
            return Err(LeaseError::NotPrimary { id });
        }
        let now = nanos(now);
        let slot = self.find(id).ok_or(LeaseError::NotFound { id })?;
        let s = &mut self.slots[slot as usize];
        if s.expiry <= now {
            return Err(LeaseError::NotFound { id });
        }
        let full = secs_to_nanos(s.ttl);
        s.expiry = now.saturating_add(full);
        let generation = &mut self.gens[slot as usize];
        *generation = generation.wrapping_add(1);
        self.expiries.push(Timer {
            deadline: s.expiry,
            id,
            slot,
            tag: *generation,
        });
        // A clear is needed when a checkpoint is stored, and also when one was produced and
        // may not be applied yet: applied after this renewal, it would hand a new primary a
        // remaining TTL from before it.
        let marks = &mut self.marks[slot as usize];
        let clear = s.remaining > 0 || *marks & IN_FLIGHT != 0;
        *marks &= !IN_FLIGHT;
        let renewal = Renewal {
            ttl: s.ttl,
            checkpoint: clear.then_some(Checkpoint {
                id,
                remaining_ttl: 0,
            }),
        };
        // Back on the schedule if it had left it (its remaining TTL had fallen to the
        // interval or below), so a long renewed lease is checkpointed again.
        if *marks & SCHEDULED == 0 && full > self.interval {
            self.schedule(slot, now);
        }
        self.sweep();
        Ok(renewal)
    }

    /// Notes that the clear a renewal of lease `id` asked for could not be replicated: a
    /// checkpoint produced before it may still be applied, so the next renewal asks for a
    /// clear again. No effect on an unknown lease.
    pub fn clear_not_replicated(&mut self, id: LeaseId) {
        if let Some(slot) = self.find(id) {
            self.marks[slot as usize] |= IN_FLIGHT;
        }
    }

    /// The granted and remaining TTL of lease `id`, with its keys if `with_keys`.
    pub fn time_to_live(
        &self,
        id: LeaseId,
        now: Duration,
        with_keys: bool,
    ) -> Result<TimeToLive, LeaseError> {
        let s = self.slot(id)?;
        let ttl = if self.primary {
            ceil_secs(s.expiry.saturating_sub(nanos(now)))
        } else if s.remaining > 0 {
            s.remaining
        } else {
            s.ttl
        };
        Ok(TimeToLive {
            id,
            granted_ttl: s.ttl,
            ttl,
            keys: if with_keys {
                s.keys.sorted()
            } else {
                Vec::new()
            },
        })
    }

    /// Every lease id, in ascending order.
    pub fn ids(&self) -> Vec<LeaseId> {
        let mut ids: Vec<LeaseId> = self.iter().map(|l| l.id).collect();
        ids.sort_unstable();
        ids
    }

    /// Every lease, in slot order (no particular id order): O(n).
    pub fn iter(&self) -> impl Iterator<Item = LeaseStatus> + '_ {
        self.slots
            .iter()
            .filter(|s| s.id != 0)
            .map(|s| LeaseStatus {
                id: s.id,
                ttl: s.ttl,
                checkpointed_ttl: s.remaining,
                expiry: (s.expiry != FOREVER).then(|| Duration::from_nanos(s.expiry)),
                keys: s.keys.len(),
            })
    }

    /// Becomes primary: every lease expires at `now + remaining TTL + extension`, where the
    /// remaining TTL is the checkpointed one or, without a checkpoint, the granted TTL.
    pub fn promote(&mut self, now: Duration) {
        let now = nanos(now);
        let start = now.saturating_add(self.extension);
        self.expiries.clear();
        self.retries.clear();
        self.checkpoints.clear();
        for i in 0..self.slots.len() {
            let s = &mut self.slots[i];
            if s.id == 0 {
                self.marks[i] = 0;
                continue;
            }
            let base = secs_to_nanos(if s.remaining > 0 { s.remaining } else { s.ttl });
            s.expiry = start.saturating_add(base);
            let generation = &mut self.gens[i];
            *generation = generation.wrapping_add(1);
            self.expiries.push(Timer {
                deadline: s.expiry,
                id: s.id,
                slot: i as u32,
                tag: *generation,
            });
            // The previous primary may have produced checkpoints not applied yet: the first
            // renewal here asks for a clear whatever is stored.
            self.marks[i] = IN_FLIGHT;
            if base > self.interval {
                self.schedule(i as u32, now);
            }
        }
        self.primary = true;
        self.tokens = f64::from(self.options.expiry_rate);
        self.refilled_at = now;
    }

    /// Stops being primary: no lease expires and no checkpoint is produced until the next
    /// promotion.
    pub fn demote(&mut self) {
        self.primary = false;
        for s in &mut self.slots {
            s.expiry = FOREVER;
        }
        self.expiries.clear();
        self.retries.clear();
        self.checkpoints.clear();
        self.marks.fill(0);
    }

    /// Puts `slot`'s lease on the checkpoint schedule, due one interval from `now`.
    fn schedule(&mut self, slot: u32, now: u64) {
        self.checkpoints.push(
            now.saturating_add(self.interval),
            Scheduled {
                slot,
                tag: self.incarnations[slot as usize],
            },
        );
        self.marks[slot as usize] |= SCHEDULED;
    }

    /// Expired leases for the caller to revoke, at most as many as the expiry rate allows
    /// since the last call (a token bucket holding one second's worth), earliest first.
    ///
    /// A lease handed out stays until revoked and is handed out again after the retry
    /// interval if it is still there (revoking it cancels that at no cost). Empty on a
    /// non-primary. Costs O(k log n) for k leases.
    pub fn expired(&mut self, now: Duration) -> Vec<LeaseId> {
        if !self.primary {
            return Vec::new();
        }
        let now = nanos(now);
        let rate = f64::from(self.options.expiry_rate);
        let elapsed = now.saturating_sub(self.refilled_at) as f64 / NANOS_PER_SEC as f64;
        self.tokens = (self.tokens + elapsed * rate).min(rate);
        self.refilled_at = now;
        let budget = self.tokens as usize;
        let mut out = Vec::with_capacity(budget);
        let mut due = Vec::with_capacity(budget);
        let mut current: Vec<bool> = Vec::with_capacity(budget);
        while out.len() < budget {
            // Pop first, then check the generations.
            due.clear();
            while due.len() < budget - out.len() {
                match self.retries.pop_due(now) {
                    Some(t) => due.push(t),
                    None => break,
                }
            }
            while due.len() < budget - out.len() {
                match self.expiries.pop_due(now) {
                    Some(t) => due.push(t),
                    None => break,
                }
            }
            if due.is_empty() {
                break;
            }
            // A timer carries its lease id and the generations are a dense array, so no lease
            // slot is read here. A tight loop of independent loads first, so that their misses
            // overlap; the bookkeeping, with its calls, comes after.
            let gens = &self.gens;
            current.clear();
            current.extend(due.iter().map(|t| gens[t.slot as usize] == t.tag));
            for (t, _) in due.iter().zip(&current).filter(|(_, c)| **c) {
                out.push(t.id);
                self.retries.push(Timer {
                    deadline: now.saturating_add(self.retry),
                    ..*t
                });
            }
        }
        self.tokens -= out.len() as f64;
        out
    }

    /// The next batch (at most `checkpoint_batch_limit`) of due checkpoints on the primary;
    /// empty when none is due or on a non-primary. Callers loop until it is empty.
    ///
    /// A lease is checkpointed every checkpoint interval while its remaining TTL is shorter
    /// than its granted TTL and it has not expired; it leaves the schedule once its
    /// remaining TTL is no longer than the interval.
    pub fn checkpoint_batch(&mut self, now: Duration) -> Vec<Checkpoint> {
        if !self.primary {
            return Vec::new();
        }
        let now = nanos(now);
        let limit = self.options.checkpoint_batch_limit;
        let mut out = Vec::new();
        while out.len() < limit {
            match self.checkpoints.front_deadline() {
                Some(deadline) if deadline <= now => {}
                _ => break,
            }
            let Some((_, t)) = self.checkpoints.pop_front() else {
                break;
            };
            let s = &self.slots[t.slot as usize];
            if self.incarnations[t.slot as usize] != t.tag || s.id == 0 || s.expiry <= now {
                // An expired lease keeps its SCHEDULED mark with nothing queued: it is never
                // renewed again, and only a revoke (freeing the slot) or a promotion (which
                // resets every mark) touches it next.
                continue;
            }
            let left = s.expiry - now;
            let remaining = ceil_secs(left);
            if remaining < s.ttl {
                out.push(Checkpoint {
                    id: s.id,
                    remaining_ttl: remaining,
                });
                self.marks[t.slot as usize] |= IN_FLIGHT;
            }
            if left > self.interval {
                self.checkpoints.push(now.saturating_add(self.interval), t);
            } else {
                self.marks[t.slot as usize] &= !SCHEDULED;
            }
        }
        out
    }

    /// Applies a replicated checkpoint: records lease `id`'s remaining TTL (0 clears it),
    /// at most its granted TTL. Returns false, changing nothing, when the lease does not
    /// exist (it was revoked after the checkpoint was produced).
    pub fn apply_checkpoint(&mut self, id: LeaseId, remaining_ttl: i64) -> bool {
        match self.slot_mut(id) {
            Ok(s) => {
                s.remaining = remaining_ttl.clamp(0, s.ttl);
                true
            }
            Err(_) => false,
        }
    }

    /// The checkpointed remaining TTL of lease `id` (0 when none).
    pub fn checkpointed_ttl(&self, id: LeaseId) -> Result<i64, LeaseError> {
        Ok(self.slot(id)?.remaining)
    }

    /// The granted TTL of lease `id`.
    pub fn granted_ttl(&self, id: LeaseId) -> Result<i64, LeaseError> {
        Ok(self.slot(id)?.ttl)
    }

    /// Heap bytes the table holds: slots, index, timers and attached keys.
    pub fn allocated_bytes(&self) -> MemoryUsage {
        let keys = self.slots.iter().map(|s| s.keys.allocated_bytes()).sum();
        MemoryUsage {
            structure: self.slots.capacity() * std::mem::size_of::<Slot>()
                + self.gens.capacity() * std::mem::size_of::<u32>()
                + self.free.capacity() * std::mem::size_of::<u32>()
                + self.index.allocated_bytes()
                + self.expiries.allocated_bytes()
                + self.retries.allocated_bytes()
                + self.incarnations.capacity() * std::mem::size_of::<u32>()
                + self.marks.capacity()
                + self.checkpoints.allocated_bytes(),
            keys,
        }
    }

    /// Drops stale timers once they outnumber live leases (amortised O(1) per operation).
    fn sweep(&mut self) {
        let bound = self.live.saturating_mul(2).saturating_add(SWEEP_SLACK);
        let (slots, gens, incarnations) = (&self.slots, &self.gens, &self.incarnations);
        if self.expiries.len() > bound {
            // Freeing a slot bumps its generation, so the generation alone tells.
            self.expiries.retain(|t| gens[t.slot as usize] == t.tag);
        }
        if self.checkpoints.len() > bound {
            self.checkpoints.retain(|t| {
                let s = &slots[t.slot as usize];
                s.id != 0 && incarnations[t.slot as usize] == t.tag
            });
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_slot_is_56_bytes_and_a_scheduled_checkpoint_8() {
        assert_eq!(std::mem::size_of::<super::Slot>(), 56);
        assert_eq!(std::mem::size_of::<super::Scheduled>(), 8);
    }
}

/// Bytes held by a [`LeaseTable`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Slots, id index, expiry heap and checkpoint queue (allocated capacity).
    pub structure: usize,
    /// Attached keys: their bytes and the per-lease key lists.
    pub keys: usize,
}
