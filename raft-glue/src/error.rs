//! [`NodeError`]: every failure a replicated node reports to its callers.

use std::io;
use std::path::PathBuf;

/// Errors of a replicated node, its Raft storage, snapshot transfer and request decoding.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The request needs the leader and this member is not it.
    #[error("member {id} is not the leader{}", match .leader { Some(l) => format!(" (the leader is member {l})"), None => " (no leader is known)".to_owned() })]
    NotLeader {
        /// This member.
        id: u64,
        /// The leader this member knows of, if any.
        leader: Option<u64>,
    },
    /// The request did not complete in time; it may still be applied later.
    #[error("{what} timed out after {millis} ms")]
    Timeout {
        /// What timed out ("proposal", "linearizable read", ...).
        what: &'static str,
        /// The timeout.
        millis: u64,
    },
    /// The node has stopped (shut down, or removed from the cluster).
    #[error("member {id} has stopped{}", .reason.as_ref().map(|r| format!(": {r}")).unwrap_or_default())]
    Stopped {
        /// This member.
        id: u64,
        /// Why, when known.
        reason: Option<String>,
    },
    /// The encoded request exceeds `max_request_bytes`.
    #[error("request is too large: {size} bytes exceeds the limit of {limit} bytes")]
    RequestTooLarge {
        /// Encoded size.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// Raft dropped the proposal (no leader, leadership transfer, uncommitted size limit).
    #[error("member {id} dropped the proposal: no leader can accept it right now")]
    ProposalDropped {
        /// This member.
        id: u64,
    },
    /// An option failed validation.
    #[error("invalid node option: {0}")]
    InvalidOption(String),
    /// The request is malformed (empty key, bad range, unknown lease, ...) and was refused
    /// before or while being applied.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Bytes that should hold an encoded request, snapshot header or chunk are malformed.
    #[error("cannot decode {what} at byte {offset}: {reason}")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// Byte offset of the problem.
        offset: usize,
        /// What is wrong.
        reason: String,
    },
    /// The MVCC store refused or failed an operation.
    #[error("store error: {0}")]
    Store(String),
    /// The lessor refused or failed an operation.
    #[error("lease error: {0}")]
    Lease(String),
    /// The Raft log storage (the WAL) failed.
    #[error("raft log storage failed: {0}")]
    Log(String),
    /// raft-rs returned an error.
    #[error("raft error on member {id}: {source}")]
    Raft {
        /// This member.
        id: u64,
        /// The raft-rs error.
        #[source]
        source: raft::Error,
    },
    /// A snapshot could not be produced, transferred, verified or installed.
    #[error("snapshot from member {from} to member {to} failed: {reason}")]
    Snapshot {
        /// Sender.
        from: u64,
        /// Receiver.
        to: u64,
        /// What went wrong.
        reason: String,
    },
    /// The transport could not deliver to a member.
    #[error("transport cannot reach member {to}: {reason}")]
    Unreachable {
        /// Destination.
        to: u64,
        /// Why.
        reason: String,
    },
    /// A membership change was refused.
    #[error("membership change refused: {0}")]
    Membership(String),
    /// The member may not run: it was removed from the cluster, or its start configuration
    /// does not match the cluster's (`source` says which, in etcd's words).
    #[error("member {id} cannot run: {source}")]
    Member {
        /// This member.
        id: u64,
        /// The membership rule that stops it.
        source: crate::membership::MembershipError,
    },
    /// An operating-system I/O call failed.
    #[error("I/O error on {path}: {op} failed: {source}")]
    Io {
        /// File or directory involved.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

impl NodeError {
    /// Builds a [`NodeError::Io`].
    pub fn io(path: impl Into<PathBuf>, op: &'static str, source: io::Error) -> NodeError {
        NodeError::Io {
            path: path.into(),
            op,
            source,
        }
    }

    /// Builds a [`NodeError::Decode`].
    pub(crate) fn decode(
        what: &'static str,
        offset: usize,
        reason: impl Into<String>,
    ) -> NodeError {
        NodeError::Decode {
            what,
            offset,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_member_and_the_leader() {
        let e = NodeError::NotLeader {
            id: 2,
            leader: Some(1),
        };
        assert_eq!(
            e.to_string(),
            "member 2 is not the leader (the leader is member 1)"
        );
        let e = NodeError::NotLeader {
            id: 2,
            leader: None,
        };
        assert_eq!(
            e.to_string(),
            "member 2 is not the leader (no leader is known)"
        );
        let e = NodeError::RequestTooLarge { size: 10, limit: 5 };
        assert!(e.to_string().contains("10 bytes exceeds the limit of 5"));
    }
}
