//! Raft log storage: raft-rs's [`Storage`] over keel's WAL, with the whole live log cached in
//! memory.
//!
//! # What lives where
//!
//! - **Entries and the hard state** are written to the WAL by [`RaftStorage::persist`] as one
//!   append, then mirrored in memory; raft-rs reads entries and terms from memory only. The
//!   node appends without syncing on its Raft thread and makes the appends durable with
//!   [`RaftStorage::sync`] on its persist thread, so the memory copy may run ahead of the
//!   durable log, never behind it. On open, every entry the WAL still holds is read back, so
//!   the cache is exactly the durable log.
//! - **The compaction point** (the index before the first entry held, with its term) is the
//!   WAL's snapshot marker. [`RaftStorage::compact`] moves it forward after the node records a
//!   snapshot point, always keeping `snapshot_catch_up_entries` entries behind the applied
//!   index, and releases the WAL segments wholly below it.
//! - **The conf state** belongs to the state machine: it is stored in the backend with the
//!   consistent index, so it is always the conf state as of the applied index, and it is
//!   handed to [`RaftStorage::open`] and updated through [`RaftStorage::set_applied`].
//! - **Snapshots** are not stored here: [`Storage::snapshot`] returns metadata for the state
//!   machine as it is now (applied index, its term, conf state), and the node streams the
//!   backend as of exactly that index (see [`crate::snapshot`]).
//!
//! # Entry encoding in the WAL
//!
//! The WAL stores `(index, term, data)`; `data` is the raft entry as
//! `entry_type:u8 | context_len:u32 LE | context | data`.

use std::collections::VecDeque;
use std::sync::Arc;

use keel_wal::{SnapshotMarker, Wal};
use parking_lot::RwLock;
use raft::eraftpb::{ConfState, Entry, EntryType, HardState, Snapshot};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

use crate::error::NodeError;

struct Inner {
    hard_state: HardState,
    conf_state: ConfState,
    /// Last applied index (the state machine's consistent index) and its term.
    applied: (u64, u64),
    /// Compaction point: `first_index() - 1` and its term.
    offset: (u64, u64),
    /// Entries `offset.0 + 1 ..= last_index()`.
    entries: VecDeque<Entry>,
    /// Bytes of entry data in `entries`.
    bytes: u64,
}

impl Inner {
    fn last_index(&self) -> u64 {
        self.offset.0 + self.entries.len() as u64
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        if idx == self.offset.0 {
            return Ok(self.offset.1);
        }
        if idx < self.offset.0 {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        match self.entries.get((idx - self.offset.0 - 1) as usize) {
            Some(e) => Ok(e.term),
            None => Err(raft::Error::Store(StorageError::Unavailable)),
        }
    }
}

/// raft-rs [`Storage`] over a [`Wal`]. Cheap to clone; clones share the log.
#[derive(Clone)]
pub struct RaftStorage {
    inner: Arc<RwLock<Inner>>,
    wal: Arc<Wal>,
}

fn log_err(e: impl std::fmt::Display) -> NodeError {
    NodeError::Log(e.to_string())
}

/// Encodes a raft entry for the WAL (format in the module docs).
pub(crate) fn encode_entry(e: &Entry) -> keel_wal::Entry {
    let mut data = Vec::with_capacity(5 + e.context.len() + e.data.len());
    data.push(e.get_entry_type() as u8);
    data.extend_from_slice(&(e.context.len() as u32).to_le_bytes());
    data.extend_from_slice(&e.context);
    data.extend_from_slice(&e.data);
    keel_wal::Entry {
        index: e.index,
        term: e.term,
        data,
    }
}

/// Decodes a WAL entry written by [`encode_entry`].
pub(crate) fn decode_entry(w: keel_wal::Entry) -> Result<Entry, NodeError> {
    let bad = |r: &str| NodeError::decode("raft entry", 0, format!("index {}: {r}", w.index));
    if w.data.len() < 5 {
        return Err(bad("shorter than its header"));
    }
    let entry_type = match w.data[0] {
        0 => EntryType::EntryNormal,
        1 => EntryType::EntryConfChange,
        2 => EntryType::EntryConfChangeV2,
        t => return Err(bad(&format!("unknown entry type {t}"))),
    };
    let mut len = [0u8; 4];
    len.copy_from_slice(&w.data[1..5]);
    let ctx_len = u32::from_le_bytes(len) as usize;
    if ctx_len > w.data.len() - 5 {
        return Err(bad("context length exceeds the entry"));
    }
    let mut e = Entry::default();
    e.set_entry_type(entry_type);
    e.index = w.index;
    e.term = w.term;
    e.context = w.data[5..5 + ctx_len].to_vec().into();
    e.data = w.data[5 + ctx_len..].to_vec().into();
    Ok(e)
}

impl RaftStorage {
    /// Loads the log held by `wal`. `conf_state` and `applied` come from the state machine
    /// (its stored conf state and consistent index).
    ///
    /// If the state machine is ahead of the log (a snapshot was installed and the process
    /// died before the WAL recorded it), `snapshot_term` must be the term of `applied` as
    /// stored with that snapshot; the WAL's compaction point is then moved to `applied`.
    pub fn open(
        wal: Arc<Wal>,
        conf_state: ConfState,
        applied: u64,
        snapshot_term: Option<u64>,
    ) -> Result<RaftStorage, NodeError> {
        let mut offset = match wal.snapshot_marker() {
            Some(m) => (m.index, m.term),
            None => (wal.first_index().saturating_sub(1), 0),
        };
        if applied > wal.last_index() {
            let term = snapshot_term.ok_or_else(|| {
                NodeError::Log(format!(
                    "the state machine holds index {applied} but the log ends at {} and no \
                     snapshot term is known",
                    wal.last_index()
                ))
            })?;
            wal.save_snapshot_marker(&SnapshotMarker {
                index: applied,
                term,
            })
            .map_err(log_err)?;
            offset = (applied, term);
        }
        let first = offset.0 + 1;
        let last = wal.last_index();
        let mut entries = VecDeque::new();
        let mut bytes = 0u64;
        if last >= first {
            for w in wal.entries(first, last + 1, None).map_err(log_err)? {
                let e = decode_entry(w)?;
                bytes += e.data.len() as u64;
                entries.push_back(e);
            }
        }
        let mut hard_state = HardState::default();
        if let Some(hs) = wal.hard_state() {
            hard_state.term = hs.term;
            hard_state.vote = hs.vote;
            hard_state.commit = hs.commit;
        }
        let mut inner = Inner {
            hard_state,
            conf_state,
            applied: (applied, 0),
            offset,
            entries,
            bytes,
        };
        // The commit index is written lazily (not synced on its own); the state machine's
        // index is committed by definition.
        let last = inner.last_index();
        inner.hard_state.commit = inner.hard_state.commit.max(applied).min(last);
        inner.hard_state.term = inner.hard_state.term.max(offset.1);
        inner.applied.1 = inner.term(applied.min(last)).unwrap_or(offset.1);
        Ok(RaftStorage {
            inner: Arc::new(RwLock::new(inner)),
            wal,
        })
    }

    /// The WAL underneath.
    pub fn wal(&self) -> &Arc<Wal> {
        &self.wal
    }

    /// Appends `entries` and `hard_state` to the WAL (one append; synced when `sync`), then
    /// makes them visible to raft-rs. Entries at or below the last index replace the log's
    /// suffix. Without `sync` they are durable only after a later [`sync`](Self::sync): the
    /// node persists that way off its Raft thread.
    pub fn persist(
        &self,
        entries: &[Entry],
        hard_state: Option<&HardState>,
        sync: bool,
    ) -> Result<(), NodeError> {
        if entries.is_empty() && hard_state.is_none() {
            return Ok(());
        }
        let wal_entries: Vec<keel_wal::Entry> = entries.iter().map(encode_entry).collect();
        let hs = hard_state.map(|h| keel_wal::HardState {
            term: h.term,
            vote: h.vote,
            commit: h.commit,
        });
        self.wal
            .append(&wal_entries, hs.as_ref(), sync)
            .map_err(log_err)?;
        let mut inner = self.inner.write();
        if let Some(first) = entries.first() {
            if first.index <= inner.offset.0 {
                return Err(NodeError::Log(format!(
                    "append at index {} overwrites compacted entries (compacted to {})",
                    first.index, inner.offset.0
                )));
            }
            let keep = (first.index - inner.offset.0 - 1) as usize;
            if keep > inner.entries.len() {
                return Err(NodeError::Log(format!(
                    "append at index {} leaves a gap after last index {}",
                    first.index,
                    inner.last_index()
                )));
            }
            let removed: u64 = inner
                .entries
                .drain(keep..)
                .map(|e| e.data.len() as u64)
                .sum();
            inner.bytes -= removed;
            for e in entries {
                inner.bytes += e.data.len() as u64;
                inner.entries.push_back(e.clone());
            }
        }
        if let Some(hs) = hard_state {
            inner.hard_state = hs.clone();
        }
        Ok(())
    }

    /// Makes everything [`persist`](Self::persist)ed so far durable (one `fdatasync`, shared
    /// with concurrent callers; none when nothing new was written).
    pub fn sync(&self) -> Result<(), NodeError> {
        self.wal.sync().map_err(log_err)
    }

    /// Installs a snapshot received from the leader: the log restarts after its index. The
    /// state machine must already hold the snapshot's state.
    pub fn apply_snapshot(&self, snap: &Snapshot) -> Result<(), NodeError> {
        let meta = snap.get_metadata();
        self.wal
            .save_snapshot_marker(&SnapshotMarker {
                index: meta.index,
                term: meta.term,
            })
            .map_err(log_err)?;
        let mut inner = self.inner.write();
        inner.entries.clear();
        inner.bytes = 0;
        inner.offset = (meta.index, meta.term);
        inner.applied = (meta.index, meta.term);
        inner.conf_state = meta.get_conf_state().clone();
        inner.hard_state.commit = inner.hard_state.commit.max(meta.index);
        inner.hard_state.term = inner.hard_state.term.max(meta.term);
        let hs = keel_wal::HardState {
            term: inner.hard_state.term,
            vote: inner.hard_state.vote,
            commit: inner.hard_state.commit,
        };
        drop(inner);
        self.wal.append(&[], Some(&hs), true).map_err(log_err)
    }

    /// Records that the state machine has applied `index` (with `conf_state` as of it).
    pub fn set_applied(&self, index: u64, conf_state: Option<&ConfState>) {
        let mut inner = self.inner.write();
        let term = inner.term(index).unwrap_or(inner.applied.1);
        inner.applied = (index, term);
        if let Some(cs) = conf_state {
            inner.conf_state = cs.clone();
        }
    }

    /// Drops entries up to `index` (which must be applied) from memory and the WAL, moving
    /// the compaction point there and releasing WAL segments wholly below it.
    pub fn compact(&self, index: u64) -> Result<(), NodeError> {
        let (term, applied) = {
            let inner = self.inner.read();
            if index <= inner.offset.0 {
                return Ok(());
            }
            (inner.term(index), inner.applied.0)
        };
        if index > applied {
            return Err(NodeError::Log(format!(
                "cannot compact to {index}: only {applied} is applied"
            )));
        }
        let term = term.map_err(|e| NodeError::Log(format!("term of {index}: {e}")))?;
        self.wal
            .save_snapshot_marker(&SnapshotMarker { index, term })
            .map_err(log_err)?;
        {
            let mut inner = self.inner.write();
            let n = (index - inner.offset.0) as usize;
            let removed: u64 = inner.entries.drain(..n).map(|e| e.data.len() as u64).sum();
            inner.bytes -= removed;
            inner.offset = (index, term);
        }
        self.wal.release_to(index + 1).map_err(log_err)
    }

    /// `(first index, last index, bytes of entry data held in memory)`.
    pub fn bounds(&self) -> (u64, u64, u64) {
        let inner = self.inner.read();
        (inner.offset.0 + 1, inner.last_index(), inner.bytes)
    }

    /// The conf state as of the applied index.
    pub fn conf_state(&self) -> ConfState {
        self.inner.read().conf_state.clone()
    }

    /// The hard state last persisted.
    pub fn hard_state(&self) -> HardState {
        self.inner.read().hard_state.clone()
    }
}

impl Storage for RaftStorage {
    fn initial_state(&self) -> raft::Result<RaftState> {
        let inner = self.inner.read();
        Ok(RaftState::new(
            inner.hard_state.clone(),
            inner.conf_state.clone(),
        ))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        let inner = self.inner.read();
        if low <= inner.offset.0 {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > inner.last_index() + 1 || low > high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let max = max_size.into().unwrap_or(u64::MAX);
        let start = (low - inner.offset.0 - 1) as usize;
        let end = (high - inner.offset.0 - 1) as usize;
        let mut out = Vec::with_capacity(end - start);
        let mut size = 0u64;
        for e in inner.entries.range(start..end) {
            size += (e.data.len() + e.context.len() + 16) as u64;
            if !out.is_empty() && size > max {
                break;
            }
            out.push(e.clone());
        }
        Ok(out)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        self.inner.read().term(idx)
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.inner.read().offset.0 + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.inner.read().last_index())
    }

    fn snapshot(&self, _request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let inner = self.inner.read();
        let mut snap = Snapshot::default();
        let meta = snap.mut_metadata();
        meta.index = inner.applied.0;
        meta.term = inner.applied.1;
        meta.set_conf_state(inner.conf_state.clone());
        if meta.index == 0 {
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        Ok(snap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_wal::WalOptions;

    fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
        Entry {
            index,
            term,
            data: data.to_vec().into(),
            context: vec![index as u8].into(),
            ..Entry::default()
        }
    }

    fn open(dir: &std::path::Path, applied: u64) -> RaftStorage {
        let opts = WalOptions {
            segment_size: 64 * 1024,
            ..WalOptions::default()
        };
        let wal = Arc::new(Wal::open(dir, opts).expect("wal"));
        let cs = ConfState {
            voters: vec![1, 2, 3],
            ..ConfState::default()
        };
        RaftStorage::open(wal, cs, applied, None).expect("storage")
    }

    fn all(s: &RaftStorage) -> Vec<Entry> {
        let (first, last, _) = s.bounds();
        s.entries(first, last + 1, None, GetEntriesContext::empty(false))
            .expect("entries")
    }

    #[test]
    fn restart_recovers_entries_hard_state_and_compaction_exactly() {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = open(dir.path(), 0);
        let hs = HardState {
            term: 2,
            vote: 1,
            commit: 3,
            ..HardState::default()
        };
        let ents: Vec<Entry> = (1..=5).map(|i| entry(i, 1 + i / 3, b"x")).collect();
        s.persist(&ents, Some(&hs), true).expect("persist");
        // Conflict: the suffix from 4 is replaced.
        let repl = vec![entry(4, 3, b"y"), entry(5, 3, b"z"), entry(6, 3, b"w")];
        s.persist(&repl, None, true).expect("persist");
        let before = all(&s);
        assert_eq!(before.len(), 6);
        assert_eq!(before[3].data.as_ref(), b"y");
        drop(s);

        let s = open(dir.path(), 0);
        assert_eq!(all(&s), before, "reopened log is identical");
        assert_eq!(s.hard_state(), hs);
        assert_eq!(s.term(4).expect("term"), 3);
        assert_eq!(
            s.initial_state().expect("state").conf_state.voters,
            vec![1, 2, 3]
        );

        // Compaction moves the first index and survives a restart.
        s.set_applied(5, None);
        s.compact(3).expect("compact");
        assert_eq!(s.first_index().expect("first"), 4);
        assert_eq!(s.term(3).expect("term of the compaction point"), 2);
        assert!(matches!(
            s.term(2),
            Err(raft::Error::Store(StorageError::Compacted))
        ));
        assert!(
            s.compact(6).is_err(),
            "cannot compact beyond the applied index"
        );
        drop(s);
        let s = open(dir.path(), 5);
        assert_eq!(s.first_index().expect("first"), 4);
        assert_eq!(s.last_index().expect("last"), 6);
        assert_eq!(all(&s), before[3..].to_vec());
        let snap = s.snapshot(0, 2).expect("snapshot metadata");
        assert_eq!(snap.get_metadata().index, 5);
        assert_eq!(snap.get_metadata().term, 3);
    }

    #[test]
    fn entry_encoding_round_trips_and_refuses_garbage() {
        let mut e = entry(9, 4, b"payload");
        e.set_entry_type(EntryType::EntryConfChangeV2);
        let back = decode_entry(encode_entry(&e)).expect("decode");
        assert_eq!(back, e);
        let mut bad = encode_entry(&e);
        bad.data[0] = 9;
        assert!(decode_entry(bad).is_err());
        let mut bad = encode_entry(&e);
        bad.data[1] = 0xff;
        assert!(decode_entry(bad).is_err());
        let mut bad = encode_entry(&e);
        bad.data.truncate(3);
        assert!(decode_entry(bad).is_err());
    }
}
