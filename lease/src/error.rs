//! The lease error type.

use crate::LeaseId;

/// Everything a lessor operation can refuse or fail with.
///
/// Refusals (bad input, wrong role) change nothing. The texts keep etcd's wording ("lease
/// already exists", "requested lease not found", "too large lease TTL", "not leader") so that
/// operators recognise them.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LeaseError {
    /// Lease id 0 means "no lease" on a key and cannot be granted.
    #[error("invalid lease id 0: id 0 is reserved for keys without a lease")]
    ReservedId,
    /// A grant named an id that is already in use.
    #[error("lease already exists: lease {id} is already granted")]
    AlreadyExists {
        /// The id asked for.
        id: LeaseId,
    },
    /// The lease does not exist (never granted, revoked, or expired and awaiting revocation).
    #[error("requested lease not found: lease {id} does not exist")]
    NotFound {
        /// The id asked for.
        id: LeaseId,
    },
    /// A grant asked for a TTL of zero or less.
    #[error("invalid lease TTL {ttl} s for lease {id}: the TTL must be at least 1 s")]
    TtlNotPositive {
        /// The lease id.
        id: LeaseId,
        /// The TTL asked for, in seconds.
        ttl: i64,
    },
    /// A grant asked for a TTL above the maximum.
    #[error("too large lease TTL: {ttl} s asked for lease {id}, the maximum is {max} s")]
    TtlTooLarge {
        /// The lease id.
        id: LeaseId,
        /// The TTL asked for, in seconds.
        ttl: i64,
        /// The configured maximum, in seconds.
        max: i64,
    },
    /// Only the primary lessor (the Raft leader's) renews leases.
    #[error("not leader: lessor is not primary, so lease {id} cannot be renewed here")]
    NotPrimary {
        /// The lease id.
        id: LeaseId,
    },
    /// A stored lease record could not be decoded.
    #[error("lease record {key:02x?} in bucket \"lease\" is corrupt: {reason}")]
    CorruptRecord {
        /// The record's key bytes.
        key: Vec<u8>,
        /// What is wrong with it.
        reason: String,
    },
    /// Options failed validation.
    #[error("invalid lessor option: {0}")]
    InvalidOption(String),
    /// The MVCC store under the lessor refused or failed the write; nothing the failing call
    /// changed is kept.
    #[error("lease storage failed: {0}")]
    Store(#[from] keel_mvcc::MvccError),
}
