//! The replicated state machine: committed entries applied to the MVCC store (and the lessor)
//! exactly once.
//!
//! Every entry is applied in one [`WriteTxn`] that also records the
//! entry's index as the store's consistent index, so the effects and the index reach the
//! backend in the same atomic batch. An entry at or below the consistent index is skipped:
//! after a restart the node re-applies only what the backend lacks, and an entry can never be
//! applied twice. A request the store refuses (empty key, compacted revision, ...) still
//! advances the consistent index in a transaction of its own, and its error goes to the
//! proposer.
//!
//! The conf state is stored beside the data in the `raft` bucket (key `conf_state`), written
//! with the consistent index of the conf-change entry that produced it, so it always matches
//! the applied index. The `snapshot` key records the `(index, term)` of the last installed
//! snapshot. Formats, little-endian:
//!
//! ```text
//! conf_state = version:u8 (=1) | auto_leave:u8 | 4 × (count:u32 | count × id:u64)
//!              (voters, learners, voters_outgoing, learners_next) | crc32:u32 of all before
//! snapshot   = index:u64 | term:u64
//! ```
//!
//! # Backend directories
//!
//! The backend lives in the directory of the current generation (see
//! [`crate::snapshot::generation`]: `<dir>/backend` at first, `<dir>/backend-<n>` after the
//! n-th installed snapshot, named by the `CURRENT` pointer file). A snapshot is restored into
//! the next generation's directory (`begin_restore`), completed and synced there
//! (`finish_restore`) and kept open as a prepared store; installing it
//! (`StateMachine::install_prepared`) replaces `CURRENT` atomically and swaps that same open
//! store in, then removes the previous generation; a prepared store raft-rs does not take is
//! closed and its directory removed (`discard_prepared`). Opening repairs a crash at any
//! step: only the generation `CURRENT` names is kept. Directories of an older layout
//! (`backend.new`, `backend.old`, `backend.tmp`) are repaired as before: a lone
//! `backend.new` becomes `backend`, the others are removed.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_lease::{Checkpoint, Clock, LeaseError, Lessor, LessorOptions};
use keel_mvcc::{Backend, Bucket, IndexBuilder, MvccError, Store, StoreOptions, WriteTxn};
use parking_lot::RwLock;
use raft::eraftpb::{ConfState, Entry};

use crate::error::NodeError;
use crate::request::{Envelope, Request, Response};
use crate::snapshot::generation;

/// The bucket holding the Raft state kept with the data.
pub const RAFT_BUCKET: Bucket = Bucket::new("raft");
const CONF_KEY: &[u8] = b"conf_state";
const SNAP_KEY: &[u8] = b"snapshot";
const CONF_VERSION: u8 = 1;

const BACKEND: &str = "backend";
pub(crate) const BACKEND_NEW: &str = "backend.new";
pub(crate) const BACKEND_OLD: &str = "backend.old";
pub(crate) const BACKEND_TMP: &str = "backend.tmp";

/// Encodes a conf state for the `raft` bucket.
pub fn encode_conf_state(cs: &ConfState) -> Vec<u8> {
    let mut w = vec![CONF_VERSION, u8::from(cs.auto_leave)];
    for list in [
        &cs.voters,
        &cs.learners,
        &cs.voters_outgoing,
        &cs.learners_next,
    ] {
        w.extend_from_slice(&(list.len() as u32).to_le_bytes());
        for id in list.iter() {
            w.extend_from_slice(&id.to_le_bytes());
        }
    }
    let crc = crc32fast::hash(&w);
    w.extend_from_slice(&crc.to_le_bytes());
    w
}

/// Decodes [`encode_conf_state`]'s output.
pub fn decode_conf_state(b: &[u8]) -> Result<ConfState, NodeError> {
    let err = |off: usize, r: &str| NodeError::decode("conf state", off, r.to_owned());
    if b.len() < 2 + 16 + 4 {
        return Err(err(0, "too short"));
    }
    let (body, crc) = b.split_at(b.len() - 4);
    let want = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32fast::hash(body) != want {
        return Err(err(body.len(), "checksum mismatch"));
    }
    if body[0] != CONF_VERSION {
        return Err(err(0, "unknown version"));
    }
    let mut cs = ConfState {
        auto_leave: body[1] == 1,
        ..ConfState::default()
    };
    let mut pos = 2;
    let mut lists: [Vec<u64>; 4] = Default::default();
    for list in lists.iter_mut() {
        let n = body
            .get(pos..pos + 4)
            .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]) as usize)
            .ok_or_else(|| err(pos, "truncated count"))?;
        pos += 4;
        if n.saturating_mul(8) > body.len() - pos {
            return Err(err(pos, "count exceeds the record"));
        }
        for _ in 0..n {
            let mut a = [0u8; 8];
            a.copy_from_slice(&body[pos..pos + 8]);
            list.push(u64::from_le_bytes(a));
            pos += 8;
        }
    }
    if pos != body.len() {
        return Err(err(pos, "trailing bytes"));
    }
    let [voters, learners, voters_outgoing, learners_next] = lists;
    cs.voters = voters;
    cs.learners = learners;
    cs.voters_outgoing = voters_outgoing;
    cs.learners_next = learners_next;
    Ok(cs)
}

/// True for store errors caused by the request itself (the proposer gets them); any other
/// store error is a failure of the member.
fn is_request_error(e: &MvccError) -> bool {
    matches!(
        e,
        MvccError::Compacted { .. }
            | MvccError::FutureRevision { .. }
            | MvccError::EmptyKey
            | MvccError::RangeEndBelowKey { .. }
            | MvccError::RequestTooLarge { .. }
            | MvccError::TooManyOps { .. }
            | MvccError::DuplicateKey { .. }
    )
}

/// Maps a lessor error: refusals go to the proposer, storage failures stop the member.
pub(crate) fn lease_err(e: LeaseError) -> NodeError {
    match e {
        LeaseError::Store(m) => store_err(m),
        LeaseError::CorruptRecord { .. } => NodeError::Lease(e.to_string()),
        refusal => NodeError::InvalidRequest(refusal.to_string()),
    }
}

pub(crate) fn store_err(e: MvccError) -> NodeError {
    if is_request_error(&e) {
        NodeError::InvalidRequest(e.to_string())
    } else {
        NodeError::Store(e.to_string())
    }
}

fn fsync_dir(dir: &Path) -> Result<(), NodeError> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| NodeError::io(dir, "fsync directory", e))
}

/// Opens a store over the backend at `path`.
pub(crate) fn open_store<B: Backend>(
    path: &Path,
    backend_options: &B::Options,
    store_options: &StoreOptions,
) -> Result<Store<B>, NodeError> {
    let backend = B::open(path, backend_options)
        .map_err(|e| NodeError::Store(format!("opening backend {}: {e}", path.display())))?;
    Store::open(backend, store_options.clone()).map_err(|e| NodeError::Store(e.to_string()))
}

/// A restored snapshot: the next generation's backend, whole, synced and open as a store,
/// waiting for raft-rs to take the snapshot it holds.
pub(crate) struct Prepared<B: Backend> {
    /// The generation its directory belongs to.
    pub generation: u64,
    /// The snapshot's index (the store's consistent index).
    pub index: u64,
    /// The store over the restored backend.
    pub store: Store<B>,
}

/// Where the receiver leaves a [`Prepared`] store for the Raft thread to install.
pub(crate) type PreparedSlot<B> = Arc<parking_lot::Mutex<Option<Prepared<B>>>>;

/// Removes leftovers of earlier restores and opens a fresh, empty backend in the next
/// generation's directory to restore a snapshot stream into. The current backend is
/// untouched. Returns the generation and the backend.
pub(crate) fn begin_restore<B: Backend>(
    dir: &Path,
    backend_options: &B::Options,
) -> Result<(u64, B), NodeError> {
    let generation = generation::next(dir)?;
    let path = generation::backend_dir(dir, generation);
    let backend = B::open(&path, backend_options)
        .map_err(|e| NodeError::Store(format!("opening {}: {e}", path.display())))?;
    Ok((generation, backend))
}

/// Completes a restore begun by [`begin_restore`] once the whole stream is verified and
/// loaded into `backend`: opens the store over it (with the key index `rebuilt` while the
/// stream was loaded, or by reading the backend when there is none), checks that it holds
/// exactly `index`,
/// records `(index, term)` and `conf_state` in it and syncs it. The store stays open: it is
/// the one [`StateMachine::install_prepared`] swaps in.
pub(crate) fn finish_restore<B: Backend>(
    generation: u64,
    backend: B,
    rebuilt: Option<IndexBuilder>,
    store_options: &StoreOptions,
    index: u64,
    term: u64,
    conf_state: &ConfState,
) -> Result<Prepared<B>, NodeError> {
    let store = match rebuilt {
        Some(built) => Store::open_rebuilt(backend, store_options.clone(), built),
        None => Store::open(backend, store_options.clone()),
    }
    .map_err(|e| NodeError::Store(e.to_string()))?;
    let held = store.consistent_index();
    if held != index {
        return Err(NodeError::Store(format!(
            "snapshot stream holds index {held}, its metadata says {index}"
        )));
    }
    let mut txn = store.write();
    let mut point = index.to_le_bytes().to_vec();
    point.extend_from_slice(&term.to_le_bytes());
    txn.put_aux(&RAFT_BUCKET, SNAP_KEY, &point)
        .map_err(store_err)?;
    txn.put_aux(&RAFT_BUCKET, CONF_KEY, &encode_conf_state(conf_state))
        .map_err(store_err)?;
    txn.commit().map_err(store_err)?;
    store.force_commit().map_err(store_err)?;
    Ok(Prepared {
        generation,
        index,
        store,
    })
}

/// Restores the snapshot stream in `file` into the next generation's directory and
/// completes it with [`finish_restore`]. The current backend is untouched.
pub(crate) fn prepare_snapshot<B: Backend>(
    dir: &Path,
    backend_options: &B::Options,
    store_options: &StoreOptions,
    file: &Path,
    index: u64,
    term: u64,
    conf_state: &ConfState,
) -> Result<Prepared<B>, NodeError> {
    let (generation, backend) = begin_restore::<B>(dir, backend_options)?;
    let restored = (|| {
        let mut input = std::io::BufReader::with_capacity(
            1 << 20,
            fs::File::open(file).map_err(|e| NodeError::io(file, "open", e))?,
        );
        let mut built = IndexBuilder::new();
        backend
            .restore_observed(&mut input, &mut |bucket, key, value| {
                built.observe(bucket, key, value)
            })
            .map_err(|e| NodeError::Store(format!("restoring snapshot: {e}")))?;
        finish_restore(
            generation,
            backend,
            Some(built),
            store_options,
            index,
            term,
            conf_state,
        )
    })();
    // A failed restore's backend is closed by now: its directory goes.
    if restored.is_err() {
        generation::remove(dir, generation);
    }
    restored
}

/// Closes a prepared snapshot that raft-rs did not take and removes its generation's
/// directory. That generation is never the current one: installing a prepared snapshot
/// takes it out of its slot before making its generation current.
pub(crate) fn discard_prepared<B: Backend>(dir: &Path, prepared: Prepared<B>) {
    let generation = prepared.generation;
    // Closed first: closing waits for the backend's background work in that directory.
    drop(prepared);
    generation::remove(dir, generation);
}

/// The store and the lessor over it; both are replaced together when a snapshot is
/// installed.
pub struct Current<B: Backend> {
    /// The MVCC store.
    pub store: Arc<Store<B>>,
    /// The lessor over it.
    pub lessor: Arc<Lessor<B>>,
}

/// Handle shared between the Raft thread and readers.
pub(crate) type SharedCurrent<B> = Arc<RwLock<Arc<Current<B>>>>;

/// Lessor construction parameters.
#[derive(Clone)]
pub(crate) struct LeaseSetup {
    pub clock: Arc<dyn Clock>,
    pub options: LessorOptions,
}

fn open_current<B: Backend>(
    path: &Path,
    backend_options: &B::Options,
    store_options: &StoreOptions,
    lease: &LeaseSetup,
) -> Result<Current<B>, NodeError> {
    let store = Arc::new(open_store::<B>(path, backend_options, store_options)?);
    let lessor = Lessor::open(store.clone(), lease.clock.clone(), lease.options.clone())
        .map_err(|e| NodeError::Lease(format!("opening the lessor: {e}")))?;
    Ok(Current {
        store,
        lessor: Arc::new(lessor),
    })
}

/// An applied request's proposer `(origin, seq)` and its result.
pub(crate) type Applied = (u64, u64, Result<Response, NodeError>);

/// The MVCC store and lessor of one member and how entries reach them.
pub(crate) struct StateMachine<B: Backend> {
    dir: PathBuf,
    lease: LeaseSetup,
    /// The current store and lessor, shared with readers.
    current: SharedCurrent<B>,
    /// The generation of the current backend's directory.
    generation: parking_lot::Mutex<u64>,
    /// A restored snapshot waiting to be installed.
    prepared: PreparedSlot<B>,
    /// The thread closing the store a snapshot install replaced and removing its directory.
    retiring: parking_lot::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl<B: Backend> StateMachine<B> {
    /// Opens the backend in `dir`, repairing an interrupted snapshot install first.
    pub fn open(
        dir: &Path,
        backend_options: B::Options,
        store_options: StoreOptions,
        lease: LeaseSetup,
    ) -> Result<StateMachine<B>, NodeError> {
        // An older layout's interrupted install (before generations).
        let cur = dir.join(BACKEND);
        let new = dir.join(BACKEND_NEW);
        if new.exists() {
            if cur.exists() {
                fs::remove_dir_all(&new).map_err(|e| NodeError::io(&new, "remove", e))?;
            } else {
                fs::rename(&new, &cur).map_err(|e| NodeError::io(&new, "rename", e))?;
                fsync_dir(dir)?;
            }
        }
        for stale in [BACKEND_OLD, BACKEND_TMP] {
            let p = dir.join(stale);
            if p.exists() {
                fs::remove_dir_all(&p).map_err(|e| NodeError::io(&p, "remove", e))?;
            }
        }
        // A crash at any step of a generation switch leaves the old or the new one whole.
        let current_gen = generation::repair(dir)?;
        let current = open_current::<B>(
            &generation::backend_dir(dir, current_gen),
            &backend_options,
            &store_options,
            &lease,
        )?;
        Ok(StateMachine {
            dir: dir.to_path_buf(),
            lease,
            current: Arc::new(RwLock::new(Arc::new(current))),
            generation: parking_lot::Mutex::new(current_gen),
            prepared: Arc::new(parking_lot::Mutex::new(None)),
            retiring: parking_lot::Mutex::new(None),
        })
    }

    /// Where the snapshot receiver leaves a restored snapshot for
    /// [`install_prepared`](Self::install_prepared).
    pub fn prepared_slot(&self) -> PreparedSlot<B> {
        self.prepared.clone()
    }

    /// The shared handle readers use.
    pub fn shared(&self) -> SharedCurrent<B> {
        self.current.clone()
    }

    /// The current store.
    pub fn store(&self) -> Arc<Store<B>> {
        self.current.read().store.clone()
    }

    /// The current lessor.
    pub fn lessor(&self) -> Arc<Lessor<B>> {
        self.current.read().lessor.clone()
    }

    /// The last applied index.
    pub fn applied(&self) -> u64 {
        self.current.read().store.consistent_index()
    }

    /// The stored conf state, if any conf change or snapshot was applied.
    pub fn conf_state(&self) -> Result<Option<ConfState>, NodeError> {
        let store = self.store();
        match store.aux_get(&RAFT_BUCKET, CONF_KEY).map_err(store_err)? {
            None => Ok(None),
            Some(v) => decode_conf_state(&v).map(Some),
        }
    }

    /// `(index, term)` of the last installed snapshot, if any.
    pub fn snapshot_point(&self) -> Result<Option<(u64, u64)>, NodeError> {
        let store = self.store();
        match store.aux_get(&RAFT_BUCKET, SNAP_KEY).map_err(store_err)? {
            Some(v) if v.len() == 16 => {
                let mut a = [0u8; 8];
                let mut b = [0u8; 8];
                a.copy_from_slice(&v[..8]);
                b.copy_from_slice(&v[8..]);
                Ok(Some((u64::from_le_bytes(a), u64::from_le_bytes(b))))
            }
            Some(_) => Err(NodeError::decode("snapshot point", 0, "expected 16 bytes")),
            None => Ok(None),
        }
    }

    /// Records the bootstrap conf state of a new cluster (index 0: no entry applied) and its
    /// members, in one transaction. Also used by force-new-cluster to rewrite both.
    pub fn bootstrap(
        &self,
        cs: &ConfState,
        members: &crate::membership::MemberSet,
    ) -> Result<(), NodeError> {
        let store = self.store();
        let mut txn = store.write();
        txn.put_aux(&RAFT_BUCKET, CONF_KEY, &encode_conf_state(cs))
            .map_err(store_err)?;
        members.persist_all(&mut txn)?;
        txn.commit().map_err(store_err)?;
        store.force_commit().map_err(store_err)
    }

    /// Applies one committed normal entry. Returns the proposer's envelope and result, or
    /// `None` when the entry was already applied or is an empty leader entry. An `Err` is a
    /// failure of the member: it must stop.
    pub fn apply_normal(&self, e: &Entry) -> Result<Option<Applied>, NodeError> {
        let store = self.store();
        if e.index <= store.consistent_index() {
            return Ok(None);
        }
        if e.data.is_empty() {
            self.advance_index(&store, e.index)?;
            return Ok(None);
        }
        let env = match Envelope::decode(&e.data) {
            Ok(env) => env,
            Err(err) => {
                tracing::warn!(index = e.index, error = %err, "undecodable entry skipped");
                self.advance_index(&store, e.index)?;
                return Ok(None);
            }
        };
        let lessor = self.lessor();
        let result = self.apply_request(&store, &lessor, e.index, &env.request);
        let result = match result {
            Ok(r) => Ok(r),
            Err(NodeError::InvalidRequest(msg)) => {
                self.advance_index(&store, e.index)?;
                Err(NodeError::InvalidRequest(msg))
            }
            Err(fatal) => return Err(fatal),
        };
        Ok(Some((env.origin, env.seq, result)))
    }

    /// Applies a conf-change entry: stores the new conf state with the entry's index.
    pub fn apply_conf_state(&self, index: u64, cs: &ConfState) -> Result<bool, NodeError> {
        let store = self.store();
        if index <= store.consistent_index() {
            return Ok(false);
        }
        let mut txn = store.write();
        txn.set_consistent_index(index).map_err(store_err)?;
        txn.put_aux(&RAFT_BUCKET, CONF_KEY, &encode_conf_state(cs))
            .map_err(store_err)?;
        txn.commit().map_err(store_err)?;
        Ok(true)
    }

    /// Stages `cs` as the stored conf state into `txn` (the transaction of a membership
    /// change, which also records the entry's index and the members).
    pub fn stage_conf_state(txn: &mut WriteTxn<'_, B>, cs: &ConfState) -> Result<(), NodeError> {
        txn.put_aux(&RAFT_BUCKET, CONF_KEY, &encode_conf_state(cs))
            .map_err(store_err)
    }

    fn advance_index(&self, store: &Store<B>, index: u64) -> Result<(), NodeError> {
        let mut txn = store.write();
        txn.set_consistent_index(index).map_err(store_err)?;
        txn.commit().map_err(store_err)?;
        Ok(())
    }

    fn apply_request(
        &self,
        store: &Store<B>,
        lessor: &Lessor<B>,
        index: u64,
        request: &Request,
    ) -> Result<Response, NodeError> {
        let idx = Some(index);
        match request {
            // Every put and delete goes through the lessor, which keeps key attachments.
            Request::Put(p) => {
                let mut r = lessor
                    .put(&p.key, &p.value, p.lease, idx)
                    .map_err(lease_err)?;
                if !p.prev_kv {
                    r.prev_kv = None;
                }
                Ok(Response::Put(r))
            }
            Request::DeleteRange(d) => {
                let mut r = lessor
                    .delete_range(&d.key, d.range_end.as_deref(), idx)
                    .map_err(lease_err)?;
                if !d.prev_kv {
                    r.prev_kvs.clear();
                }
                Ok(Response::DeleteRange(r))
            }
            Request::Txn(t) => {
                let r = lessor.txn(t, idx).map_err(lease_err)?;
                Ok(Response::Txn(r))
            }
            Request::Compact { revision } => {
                // The store records the compaction point durably on its own; re-applying it
                // after a crash is refused as already compacted, which is harmless.
                match store.compact(*revision) {
                    Ok(()) => {}
                    Err(e) if is_request_error(&e) => {
                        return Err(NodeError::InvalidRequest(e.to_string()));
                    }
                    Err(e) => return Err(NodeError::Store(e.to_string())),
                }
                self.advance_index(store, index)?;
                Ok(Response::Compact {
                    revision: store.current_revision(),
                })
            }
            Request::LeaseGrant { id, ttl } => {
                let ttl = lessor.grant(*id, *ttl, idx).map_err(lease_err)?;
                Ok(Response::LeaseGrant { id: *id, ttl })
            }
            Request::LeaseRevoke { id } => {
                let r = lessor.revoke(*id, idx).map_err(lease_err)?;
                Ok(Response::LeaseRevoke {
                    revision: r.revision,
                })
            }
            Request::LeaseCheckpoint(cps) => {
                let cps: Vec<Checkpoint> = cps
                    .iter()
                    .map(|c| Checkpoint {
                        id: c.id,
                        remaining_ttl: c.remaining_ttl,
                    })
                    .collect();
                lessor.apply_checkpoints(&cps, idx).map_err(lease_err)?;
                Ok(Response::LeaseCheckpoint)
            }
            Request::ConfChange(_) | Request::Member(_) => Err(NodeError::InvalidRequest(
                "a membership change must travel in a conf-change entry".into(),
            )),
        }
    }

    /// Installs the snapshot for `index` restored by [`finish_restore`] and left in the
    /// [`prepared_slot`](Self::prepared_slot): makes its generation current (the `CURRENT`
    /// switch is the commit point), swaps its open store in with a lessor over it, and
    /// retires the previous generation. Fails (and changes nothing) when none is prepared for
    /// that index.
    pub fn install_prepared(&self, index: u64) -> Result<(), NodeError> {
        let prepared = self.prepared.lock().take();
        let none = || {
            NodeError::Store(format!(
                "no verified snapshot is prepared for index {index}"
            ))
        };
        let Some(prepared) = prepared else {
            return Err(none());
        };
        if prepared.index != index {
            // Prepared for another index: raft-rs will not take it now.
            discard_prepared(&self.dir, prepared);
            return Err(none());
        }
        let Prepared {
            generation: new_gen,
            store,
            ..
        } = prepared;
        let store = Arc::new(store);
        let lessor = match Lessor::open(
            store.clone(),
            self.lease.clock.clone(),
            self.lease.options.clone(),
        ) {
            Ok(lessor) => lessor,
            Err(e) => {
                // Before the switch the current generation is as it was: the new one's
                // directory goes, once its store is closed.
                drop(store);
                generation::remove(&self.dir, new_gen);
                return Err(NodeError::Lease(format!("opening the lessor: {e}")));
            }
        };
        // A failed switch may have got past its commit point (the rename) before failing to
        // sync the directory: the new generation may be the current one after a restart,
        // so its directory stays.
        generation::switch(&self.dir, new_gen, None)?;
        let current = Current {
            store,
            lessor: Arc::new(lessor),
        };
        let previous = std::mem::replace(&mut *self.current.write(), Arc::new(current));
        let old_gen = std::mem::replace(&mut *self.generation.lock(), new_gen);
        self.retire(previous, old_gen);
        Ok(())
    }

    /// Closes the replaced store and removes its generation's directory on a thread of its
    /// own: closing waits for the backend's background work (space being prepared and
    /// synced, tens of milliseconds on a busy disk), which the Raft thread installing a
    /// snapshot has no reason to wait for. Dropping the state machine waits for it.
    fn retire(&self, previous: Arc<Current<B>>, generation: u64) {
        let mut retiring = self.retiring.lock();
        if let Some(h) = retiring.take() {
            let _ = h.join();
        }
        let dir = self.dir.clone();
        let retire = move || {
            drop(previous);
            generation::remove(&dir, generation);
        };
        match std::thread::Builder::new()
            .name("keel-retire".into())
            .spawn(retire)
        {
            Ok(h) => *retiring = Some(h),
            Err(e) => {
                // The failed spawn dropped the closure, and the store with it.
                tracing::debug!(error = %e, "cannot start a thread to retire a store");
                generation::remove(&self.dir, generation);
            }
        }
    }
}

impl<B: Backend> Drop for StateMachine<B> {
    fn drop(&mut self) {
        if let Some(h) = self.retiring.get_mut().take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conf_state_round_trips_and_damage_is_detected() {
        let cs = ConfState {
            voters: vec![1, 2, 3],
            learners: vec![4],
            auto_leave: true,
            ..ConfState::default()
        };
        let b = encode_conf_state(&cs);
        assert_eq!(decode_conf_state(&b).ok(), Some(cs));
        for i in 0..b.len() {
            let mut d = b.clone();
            d[i] ^= 0x10;
            assert!(decode_conf_state(&d).is_err(), "flip at {i}");
        }
        assert!(decode_conf_state(&b[..b.len() - 1]).is_err());
    }

    /// A snapshot prepared for another index than the one raft-rs installs is refused and
    /// its generation's directory removed; the current one is untouched.
    #[cfg(feature = "backend-file")]
    #[test]
    fn a_prepared_snapshot_of_another_index_is_discarded_with_its_directory() {
        type Fb = keel_backend_file::FileBackend;
        let dir = tempfile::tempdir().expect("tempdir");
        let lease = || LeaseSetup {
            clock: Arc::new(keel_lease::SystemClock::new()),
            options: LessorOptions::default(),
        };
        let sm = StateMachine::<Fb>::open(
            dir.path(),
            Default::default(),
            StoreOptions::default(),
            lease(),
        )
        .expect("open");
        sm.store().put(b"k", b"v", 0).expect("put");
        sm.store().force_commit().expect("commit");
        // A stream of another store, prepared for index 7.
        let source = tempfile::tempdir().expect("tempdir");
        let other = StateMachine::<Fb>::open(
            source.path(),
            Default::default(),
            StoreOptions::default(),
            lease(),
        )
        .expect("open");
        {
            let store = other.store();
            let mut w = store.write();
            w.put(b"x", b"y", 0).expect("put");
            w.set_consistent_index(7).expect("index");
            w.commit().expect("commit");
            store.force_commit().expect("commit");
        }
        let file = source.path().join("stream");
        let mut stream = Vec::new();
        other.store().snapshot(&mut stream).expect("stream");
        fs::write(&file, &stream).expect("write");
        // Prepared for an index the stream does not hold: refused, and nothing left behind.
        let backends = || {
            fs::read_dir(dir.path())
                .expect("read dir")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("backend"))
                .count()
        };
        let prepare = |index| {
            prepare_snapshot::<Fb>(
                dir.path(),
                &Default::default(),
                &StoreOptions::default(),
                &file,
                index,
                1,
                &ConfState::default(),
            )
        };
        let before = backends();
        assert!(prepare(8).is_err());
        assert_eq!(backends(), before, "a refused restore's directory is left");
        let prepared = prepare(7).expect("prepare");
        let generation = prepared.generation;
        assert!(generation::backend_dir(dir.path(), generation).exists());
        *sm.prepared_slot().lock() = Some(prepared);
        assert!(sm.install_prepared(8).is_err());
        assert!(
            !generation::backend_dir(dir.path(), generation).exists(),
            "the prepared generation's directory is left"
        );
        assert!(sm.prepared_slot().lock().is_none());
        let kv = sm
            .store()
            .range(&keel_mvcc::RangeRequest::key(b"k".to_vec()));
        assert_eq!(kv.expect("range").kvs[0].value(), b"v");
    }
}
