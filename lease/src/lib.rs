//! etcd-style leases for keel, with checkpoints so that a leader change neither renews nor
//! immortalises a lease.
//!
//! - [`Clock`] is where time comes from: [`SystemClock`] in production, [`ManualClock`] in
//!   tests, so no test sleeps.
//! - [`LeaseTable`] is the in-memory state machine: leases, attached keys, the primary /
//!   non-primary role, the expiry queue (a timing wheel feeding a sorted run, in `heap`)
//!   with rate-limited hand-out of expired leases, and the checkpoint schedule (`schedule`).
//! - [`Lessor`] puts the table over a [`keel_mvcc::Store`]: grants and checkpoints are
//!   persisted as records in the `lease` bucket (format in [`record`]), a revoke deletes
//!   every attached key and the record in one MVCC write, and opening a lessor rebuilds the
//!   leases and their attached keys from the store. Key writes that carry leases go through
//!   [`Lessor::put`], [`Lessor::delete_range`] and [`Lessor::txn`], which keep the
//!   attachments right and refuse unknown leases.
//!
//! The Raft glue drives it: it applies grant, revoke and checkpoint entries with their Raft
//! index, promotes the lessor when its member becomes leader and demotes it when it stops
//! being one, and on the leader periodically proposes the revocation of
//! [`Lessor::expired_leases`] and the replication of [`Lessor::checkpoint_batch`].

#![forbid(unsafe_code)]

mod clock;
mod error;
mod heap;
mod index;
mod keys;
mod lessor;
mod options;
pub mod record;
mod schedule;
mod table;

pub use clock::{Clock, ManualClock, SystemClock};
pub use error::LeaseError;
pub use lessor::{Lessor, Recovered, Revoked};
pub use options::{LessorOptions, MAX_LEASE_TTL};
pub use table::{Checkpoint, LeaseStatus, LeaseTable, MemoryUsage, Renewal, TimeToLive};

/// A lease id; 0 means "no lease".
pub use keel_mvcc::LeaseId;
