//! [`NodeOptions`]: every knob of a replicated node, with etcd's defaults.

use std::time::Duration;

use crate::error::NodeError;

/// Options of a [`Node`](crate::Node). `Default` gives the documented defaults; they are
/// checked by [`validate`](NodeOptions::validate) when the node starts.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    /// Wall-clock length of one Raft tick. Default: 100 ms (etcd's heartbeat interval).
    pub tick_interval: Duration,
    /// Ticks without hearing from a leader before a follower campaigns; the randomised
    /// timeout is drawn from `[election_ticks, 2 × election_ticks)`. Default: 10 (1 s, etcd).
    pub election_ticks: usize,
    /// Ticks between leader heartbeats. Default: 1.
    pub heartbeat_ticks: usize,
    /// Pre-vote (Raft thesis 9.6): a partitioned member rejoining cannot disrupt the
    /// cluster by bumping the term. Default: true.
    pub pre_vote: bool,
    /// The leader steps down when it has not heard from a quorum for an election timeout.
    /// Default: true.
    pub check_quorum: bool,
    /// Applied entries between two snapshot points. Default: 100 000 (etcd `--snapshot-count`).
    pub snapshot_count: u64,
    /// Entries kept in the log behind a snapshot point so a slightly slow follower catches up
    /// from the log instead of a snapshot. Default: 5 000 (etcd `SnapshotCatchUpEntries`).
    pub snapshot_catch_up_entries: u64,
    /// Largest encoded request accepted from a proposer. Default: 1.5 MiB (etcd
    /// `--max-request-bytes`).
    pub max_request_bytes: usize,
    /// Largest append message sent to a follower. Default: 1 MiB.
    pub max_size_per_msg: u64,
    /// Append messages in flight to one follower. Default: 256.
    pub max_inflight_msgs: usize,
    /// How long a proposal or a linearizable read waits for its result before failing with
    /// [`NodeError::Timeout`]. Default: 7 s (etcd's request timeout).
    pub request_timeout: Duration,
    /// Bytes per chunk of a streamed snapshot. Default: 1 MiB.
    pub snapshot_chunk_bytes: usize,
    /// How long an outgoing snapshot transfer may go without progress: the sender waits
    /// this long for the receiver to confirm the transfer once its last chunk is sent, and
    /// the leader gives up on a transfer that has handed no chunk to the transport for this
    /// long and has not ended (its sender blocked for good in the transport: a send that
    /// never returns, a peer that never reads). A transfer given up is reported failed to
    /// raft-rs, which sends a fresh snapshot later, and cancelled, so its sender stops should
    /// it ever wake. Must be greater than zero. Default: 60 s.
    pub snapshot_timeout: Duration,
    /// How long an incoming snapshot transfer may go without a chunk before the receiver
    /// drops it: its restore is abandoned and the partial backend directory (or temporary
    /// file) removed, the sender is answered with a refusal, and any later chunk of that
    /// transfer is refused too. Without it, a sender that dies or gives up mid-stream leaves
    /// the receiver holding that disk space, the restore's thread and its buffers until the
    /// next transfer begins. Default: 60 s, as `snapshot_timeout`: far longer than a sender
    /// running at the lowest scheduling priority is kept waiting on a busy machine.
    pub snapshot_idle_timeout: Duration,
    /// Proposals taken from the queue per loop turn, so a flood of proposals cannot starve
    /// ticks and incoming messages. Default: 4 096.
    pub max_proposals_per_turn: usize,
}

impl Default for NodeOptions {
    fn default() -> NodeOptions {
        NodeOptions {
            tick_interval: Duration::from_millis(100),
            election_ticks: 10,
            heartbeat_ticks: 1,
            pre_vote: true,
            check_quorum: true,
            snapshot_count: 100_000,
            snapshot_catch_up_entries: 5_000,
            max_request_bytes: 1536 * 1024,
            max_size_per_msg: 1024 * 1024,
            max_inflight_msgs: 256,
            request_timeout: Duration::from_secs(7),
            snapshot_chunk_bytes: 1024 * 1024,
            snapshot_timeout: Duration::from_secs(60),
            snapshot_idle_timeout: Duration::from_secs(60),
            max_proposals_per_turn: 4096,
        }
    }
}

impl NodeOptions {
    /// Checks every field; the first problem found is returned as
    /// [`NodeError::InvalidOption`].
    pub fn validate(&self) -> Result<(), NodeError> {
        let bad = |what: String| Err(NodeError::InvalidOption(what));
        if self.tick_interval.is_zero() {
            return bad("tick_interval must be greater than zero".into());
        }
        if self.heartbeat_ticks == 0 {
            return bad("heartbeat_ticks must be at least 1".into());
        }
        if self.election_ticks <= self.heartbeat_ticks {
            return bad(format!(
                "election_ticks ({}) must be greater than heartbeat_ticks ({})",
                self.election_ticks, self.heartbeat_ticks
            ));
        }
        if self.snapshot_count == 0 {
            return bad("snapshot_count must be at least 1".into());
        }
        if self.max_request_bytes < 64 {
            return bad(format!(
                "max_request_bytes ({}) must be at least 64",
                self.max_request_bytes
            ));
        }
        if self.max_inflight_msgs == 0 {
            return bad("max_inflight_msgs must be at least 1".into());
        }
        if self.request_timeout.is_zero() {
            return bad("request_timeout must be greater than zero".into());
        }
        if self.snapshot_chunk_bytes == 0 || self.snapshot_chunk_bytes > 64 * 1024 * 1024 {
            return bad(format!(
                "snapshot_chunk_bytes ({}) must be between 1 and 64 MiB",
                self.snapshot_chunk_bytes
            ));
        }
        if self.snapshot_timeout.is_zero() {
            return bad("snapshot_timeout must be greater than zero".into());
        }
        if self.snapshot_idle_timeout.is_zero() {
            return bad("snapshot_idle_timeout must be greater than zero".into());
        }
        if self.max_proposals_per_turn == 0 {
            return bad("max_proposals_per_turn must be at least 1".into());
        }
        Ok(())
    }

    /// The raft-rs configuration for member `id` whose state machine holds index `applied`
    /// (`pre_vote`, `check_quorum` and the tick counts come from these options).
    pub fn raft_config(&self, id: u64, applied: u64) -> raft::Config {
        raft::Config {
            id,
            election_tick: self.election_ticks,
            heartbeat_tick: self.heartbeat_ticks,
            applied,
            max_size_per_msg: self.max_size_per_msg,
            max_inflight_msgs: self.max_inflight_msgs,
            check_quorum: self.check_quorum,
            pre_vote: self.pre_vote,
            ..raft::Config::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_bad_values_are_refused() {
        let o = NodeOptions::default();
        o.validate().expect("defaults are valid");
        o.raft_config(1, 0)
            .validate()
            .expect("raft accepts the defaults");
        let bad = NodeOptions {
            election_ticks: 1,
            ..NodeOptions::default()
        };
        let err = bad.validate().expect_err("election <= heartbeat");
        assert!(err.to_string().contains("election_ticks"), "{err}");
        let bad = NodeOptions {
            tick_interval: Duration::ZERO,
            ..NodeOptions::default()
        };
        assert!(bad.validate().is_err());
    }
}
