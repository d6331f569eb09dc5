//! keel's replicated node: raft-rs consensus glued to keel's WAL and MVCC store.
//!
//! How the pieces fit:
//!
//! - [`Node`] ([`node`]) runs one member: a thread drives raft-rs's `RawNode`, persists its
//!   log through [`RaftStorage`] ([`storage`], raft-rs `Storage` over `keel_wal::Wal`),
//!   applies committed entries to the MVCC store exactly once ([`apply`]), serves reads
//!   (linearizable through ReadIndex, or serializable), and reports its [`NodeStatus`].
//! - Requests travel in Raft entries as [`Envelope`]s ([`request`]: an explicit, versioned,
//!   bounded binary format).
//! - Members talk through a [`Transport`] ([`transport`]): Raft messages on one path, snapshot
//!   streams on another; [`MemNetwork`] is the in-memory implementation with fault injection
//!   used by the simulation harness.
//! - Membership ([`membership`]) follows etcd's rules; membership requests made on a
//!   follower, refusals, learners' applied-index reports and removal notices travel between
//!   members as control frames on the Raft message path (`control`).
//! - A follower behind the compacted log receives the leader's backend as a checksummed,
//!   chunked stream that it verifies, stores and installs ([`snapshot`]).
//! - [`NodeOptions`] ([`options`]) holds every knob with etcd's defaults; [`NodeError`]
//!   ([`error`]) every failure; raft-rs's logs reach `tracing` through [`logger`].

#![forbid(unsafe_code)]

pub mod apply;
mod control;
pub mod error;
pub mod logger;
pub mod membership;
pub mod node;
pub mod options;
pub mod request;
pub mod snapshot;
pub mod storage;
pub mod tcp;
pub mod transport;

#[cfg(feature = "testing")]
pub mod testing;

pub use error::NodeError;
pub use membership::{Member, MemberOp, MemberSet, MembershipError, MembershipOptions};
pub use node::{Node, NodeConfig, NodeStatus, ReadConsistency, Role};
pub use options::NodeOptions;
pub use request::{Envelope, LeaseCheckpoint, MemberChange, Request, Response};
pub use storage::RaftStorage;
pub use tcp::{RateLimiter, TcpOptions, TcpTransport};
pub use transport::{
    Mailbox, MemNetwork, MemTransport, SnapshotAck, SnapshotChunk, SnapshotFrame, Transport,
};
