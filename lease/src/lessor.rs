//! The lessor: the lease table persisted through the MVCC store.
//!
//! Every operation that changes leases is one [`WriteTxn`]: grant writes the lease record,
//! revoke deletes each attached key and the record, a checkpoint rewrites the records it
//! covers. The in-memory table changes only after that transaction committed, so a refused
//! or failed call changes nothing. When the operation applies a Raft entry, its index is
//! stored as the store's consistent index in the same backend batch, so a replay after a
//! crash can never apply it twice (the store refuses an index it already holds).
//!
//! Attachments are not stored separately: each key carries its lease id in the store.
//! Writes of keys with a lease go through [`Lessor::put`], [`Lessor::delete_range`] and
//! [`Lessor::txn`] (or the caller reports them with [`Lessor::attach`] /
//! [`Lessor::detach`]); on open, the
//! attachments are rebuilt from the keys. A revoke only deletes attached keys whose current
//! lease is still the revoked one, so a stale attachment can never delete a key that was
//! re-written without the lease.
//!
//! Lock order: the lessor's mutex, then the store's writer lock. Do not call the lessor while
//! holding a [`WriteTxn`] of the same store: the call would wait for that transaction.

use std::sync::Arc;

use keel_mvcc::{
    Backend, DeleteRangeRequest, DeleteResponse, PutRequest, PutResponse, RangeRequest, Store,
    TxnOp, TxnOpResponse, TxnRequest, TxnResponse, WriteTxn,
};
use parking_lot::Mutex;

use crate::LeaseId;
use crate::clock::Clock;
use crate::error::LeaseError;
use crate::options::LessorOptions;
use crate::record::{LEASE_BUCKET, LeaseRecord};
use crate::table::{Checkpoint, LeaseTable, Renewal, TimeToLive};

/// What a revoke did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Revoked {
    /// The store revision after the revoke (unchanged when the lease had no keys).
    pub revision: u64,
    /// Number of keys deleted with the lease.
    pub deleted: usize,
}

/// What [`Lessor::open`] found in the store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Recovered {
    /// Leases read back.
    pub leases: usize,
    /// Keys attached back to their lease.
    pub attached_keys: usize,
    /// Keys naming a lease that has no record (they are left alone and logged).
    pub orphan_keys: usize,
}

/// Leases over a [`Store`]; share it with an `Arc`. See the module docs.
pub struct Lessor<B: Backend> {
    store: Arc<Store<B>>,
    clock: Arc<dyn Clock>,
    table: Mutex<LeaseTable>,
    recovered: Recovered,
}

impl<B: Backend> std::fmt::Debug for Lessor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lessor")
            .field("leases", &self.table.lock().len())
            .field("primary", &self.is_primary())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Lessor<B> {
    /// Opens a lessor on `store`: reads every lease record and re-attaches every key that
    /// carries a lease id (from the list the store made while opening, or, when the store
    /// has been written since, one scan of the current revision). The lessor starts as a
    /// non-primary; call [`promote`](Self::promote) when this member leads.
    pub fn open(
        store: Arc<Store<B>>,
        clock: Arc<dyn Clock>,
        options: LessorOptions,
    ) -> Result<Lessor<B>, LeaseError> {
        let mut table = LeaseTable::new(options)?;
        let now = clock.now();
        let mut recovered = Recovered::default();
        for (key, value) in store.aux_scan(&LEASE_BUCKET)? {
            let record = LeaseRecord::decode(&key, &value)?;
            table.restore(record.id, record.ttl, record.remaining, now)?;
            recovered.leases += 1;
        }
        // The store noted the leased keys while it rebuilt its index; only a store written
        // since it was opened needs the scan of every key.
        let leased = match store.take_opened_leases() {
            Some(leased) => leased,
            None => {
                let all = RangeRequest {
                    keys_only: true,
                    ..RangeRequest::range(vec![0u8], vec![0u8])
                };
                store
                    .range(&all)?
                    .kvs
                    .into_iter()
                    .filter(|kv| kv.lease != 0)
                    .map(|kv| (kv.key().to_vec(), kv.lease))
                    .collect()
            }
        };
        for (key, lease) in leased {
            if table.attach(lease, &key).is_ok() {
                recovered.attached_keys += 1;
            } else {
                recovered.orphan_keys += 1;
            }
        }
        if recovered.orphan_keys > 0 {
            tracing::warn!(
                orphan_keys = recovered.orphan_keys,
                "keys carry the id of a lease that has no record; they will not expire"
            );
        }
        tracing::info!(
            leases = recovered.leases,
            attached_keys = recovered.attached_keys,
            "lessor opened"
        );
        Ok(Lessor {
            store,
            clock,
            table: Mutex::new(table),
            recovered,
        })
    }

    /// What [`open`](Self::open) read back.
    pub fn recovered(&self) -> Recovered {
        self.recovered
    }

    /// The store under the lessor.
    pub fn store(&self) -> &Arc<Store<B>> {
        &self.store
    }

    /// Runs `f` on the in-memory table (read-only), e.g. for metrics.
    pub fn with_table<R>(&self, f: impl FnOnce(&LeaseTable) -> R) -> R {
        f(&self.table.lock())
    }

    fn begin(&self, index: Option<u64>) -> Result<WriteTxn<'_, B>, LeaseError> {
        let mut txn = self.store.write();
        if let Some(index) = index {
            txn.set_consistent_index(index)?;
        }
        Ok(txn)
    }

    /// Grants lease `id` for `ttl` seconds (raised to the minimum TTL) and persists it;
    /// returns the granted TTL. `index` is the Raft index of the entry being applied, stored
    /// as the consistent index in the same batch (`None` outside Raft).
    ///
    /// Refused, changing nothing (not even the consistent index), for id 0, an id in use, a
    /// TTL ≤ 0 or above the maximum, or an `index` the store already holds.
    pub fn grant(&self, id: LeaseId, ttl: i64, index: Option<u64>) -> Result<i64, LeaseError> {
        let mut table = self.table.lock();
        let ttl = table.check_grant(id, ttl)?;
        let mut txn = self.begin(index)?;
        let record = LeaseRecord {
            id,
            ttl,
            remaining: 0,
        };
        txn.put_aux(&LEASE_BUCKET, &LeaseRecord::key(id), &record.encode_value())?;
        txn.commit()?;
        table.grant(id, ttl, self.clock.now())
    }

    /// Revokes lease `id`: deletes every attached key and the lease record in one MVCC
    /// write transaction (so after a crash either all of them remain or none does), then
    /// forgets the lease.
    pub fn revoke(&self, id: LeaseId, index: Option<u64>) -> Result<Revoked, LeaseError> {
        let mut table = self.table.lock();
        let keys = table.keys(id)?;
        let mut txn = self.begin(index)?;
        let mut deleted = 0;
        for key in keys {
            let current = txn.range(&RangeRequest {
                keys_only: true,
                ..RangeRequest::key(key.clone())
            })?;
            if current.kvs.first().is_some_and(|kv| kv.lease == id) {
                deleted += txn.delete_range(&key, None)?.deleted;
            }
        }
        txn.delete_aux(&LEASE_BUCKET, &LeaseRecord::key(id))?;
        let revision = txn.commit()?;
        table.remove(id)?;
        Ok(Revoked { revision, deleted })
    }

    /// Renews lease `id` on the primary (not persisted: only the primary has deadlines).
    /// See [`LeaseTable::renew`]; when the result carries a checkpoint, replicate it and
    /// apply it with [`apply_checkpoints`](Self::apply_checkpoints).
    pub fn renew(&self, id: LeaseId) -> Result<Renewal, LeaseError> {
        self.table.lock().renew(id, self.clock.now())
    }

    /// Notes that the clear a renewal of lease `id` asked for could not be replicated: the
    /// next renewal asks again (see [`LeaseTable::clear_not_replicated`]).
    pub fn clear_not_replicated(&self, id: LeaseId) {
        self.table.lock().clear_not_replicated(id);
    }

    /// The granted and remaining TTL of lease `id`, and its attached keys if `with_keys`.
    pub fn time_to_live(&self, id: LeaseId, with_keys: bool) -> Result<TimeToLive, LeaseError> {
        self.table
            .lock()
            .time_to_live(id, self.clock.now(), with_keys)
    }

    /// Every lease id, ascending.
    pub fn leases(&self) -> Vec<LeaseId> {
        self.table.lock().ids()
    }

    /// Records that `keys` now carry lease `id` (for writes made outside
    /// [`put`](Self::put)). All or nothing: refused if the lease does not exist.
    pub fn attach(&self, id: LeaseId, keys: &[&[u8]]) -> Result<(), LeaseError> {
        let mut table = self.table.lock();
        if !table.contains(id) {
            return Err(LeaseError::NotFound { id });
        }
        for key in keys {
            table.attach(id, key)?;
        }
        Ok(())
    }

    /// Records that `keys` no longer carry lease `id`; returns how many were attached.
    pub fn detach(&self, id: LeaseId, keys: &[&[u8]]) -> Result<usize, LeaseError> {
        let mut table = self.table.lock();
        let mut detached = 0;
        for key in keys {
            detached += usize::from(table.detach(id, key)?);
        }
        Ok(detached)
    }

    /// Puts `key = value` with `lease` (0: none) through the store, attaching the key to the
    /// lease and detaching it from the lease it had before. Refused, changing nothing, when
    /// `lease` does not exist. The response always carries the previous pair.
    pub fn put(
        &self,
        key: &[u8],
        value: &[u8],
        lease: LeaseId,
        index: Option<u64>,
    ) -> Result<PutResponse, LeaseError> {
        let mut table = self.table.lock();
        if lease != 0 && !table.contains(lease) {
            return Err(LeaseError::NotFound { id: lease });
        }
        let mut txn = self.begin(index)?;
        let response = txn.put_with(&PutRequest {
            key: key.to_vec(),
            value: value.to_vec(),
            lease,
            prev_kv: true,
        })?;
        txn.commit()?;
        if let Some(prev) = &response.prev_kv
            && prev.lease != 0
            && prev.lease != lease
        {
            // The previous lease may be gone already; nothing to detach then.
            let _ = table.detach(prev.lease, key);
        }
        if lease != 0 {
            table.attach(lease, key)?;
        }
        Ok(response)
    }

    /// Deletes `key`, or `[key, end)` (etcd range conventions), through the store and
    /// detaches the deleted keys from their leases. The response carries the deleted pairs.
    pub fn delete_range(
        &self,
        key: &[u8],
        end: Option<&[u8]>,
        index: Option<u64>,
    ) -> Result<DeleteResponse, LeaseError> {
        let mut table = self.table.lock();
        let mut txn = self.begin(index)?;
        let response = txn.delete_with(&DeleteRangeRequest {
            key: key.to_vec(),
            range_end: end.map(<[u8]>::to_vec),
            prev_kv: true,
        })?;
        txn.commit()?;
        for kv in &response.prev_kvs {
            if kv.lease != 0 {
                let _ = table.detach(kv.lease, kv.key());
            }
        }
        Ok(response)
    }

    /// Runs an etcd transaction through the store and updates the attachments of every key
    /// the branch that ran put or deleted. Refused, changing nothing, when a put in either
    /// branch (nested transactions included) names a lease that does not exist, as etcd
    /// does. Previous pairs appear in the response only where the request asked for them.
    pub fn txn(&self, req: &TxnRequest, index: Option<u64>) -> Result<TxnResponse, LeaseError> {
        let mut table = self.table.lock();
        check_txn_leases(&table, req)?;
        let mut txn = self.begin(index)?;
        let mut response = txn.txn(&with_prev_kv(req))?;
        txn.commit()?;
        let ops = if response.succeeded {
            &req.success
        } else {
            &req.failure
        };
        track_txn(&mut table, ops, &mut response.responses);
        Ok(response)
    }

    /// Becomes primary: every lease expires at now + its remaining TTL (checkpointed, or
    /// granted when none) + the promotion extension.
    pub fn promote(&self) {
        self.table.lock().promote(self.clock.now());
    }

    /// Stops being primary: no lease expires here until the next promotion.
    pub fn demote(&self) {
        self.table.lock().demote();
    }

    /// True on the primary.
    pub fn is_primary(&self) -> bool {
        self.table.lock().is_primary()
    }

    /// Expired leases for the caller to revoke through consensus, rate-limited; see
    /// [`LeaseTable::expired`]. Empty on a non-primary.
    pub fn expired_leases(&self) -> Vec<LeaseId> {
        self.table.lock().expired(self.clock.now())
    }

    /// The next batch of due checkpoints for the caller to replicate; see
    /// [`LeaseTable::checkpoint_batch`]. Empty on a non-primary.
    pub fn checkpoint_batch(&self) -> Vec<Checkpoint> {
        self.table.lock().checkpoint_batch(self.clock.now())
    }

    /// Applies replicated checkpoints: persists each lease's remaining TTL (0 clears it;
    /// negative values count as 0) in one write transaction. Checkpoints of leases that no
    /// longer exist are skipped. Returns the number applied.
    pub fn apply_checkpoints(
        &self,
        checkpoints: &[Checkpoint],
        index: Option<u64>,
    ) -> Result<usize, LeaseError> {
        let mut table = self.table.lock();
        let mut txn = self.begin(index)?;
        let mut applied = Vec::with_capacity(checkpoints.len());
        for cp in checkpoints {
            let Ok(ttl) = table.granted_ttl(cp.id) else {
                continue;
            };
            let record = LeaseRecord {
                id: cp.id,
                ttl,
                // A checkpoint never records more than the granted TTL.
                remaining: cp.remaining_ttl.clamp(0, ttl),
            };
            txn.put_aux(
                &LEASE_BUCKET,
                &LeaseRecord::key(cp.id),
                &record.encode_value(),
            )?;
            applied.push(record);
        }
        txn.commit()?;
        for record in &applied {
            table.apply_checkpoint(record.id, record.remaining);
        }
        Ok(applied.len())
    }
}

/// Refuses a transaction whose puts (in either branch, at any depth) name a missing lease.
fn check_txn_leases(table: &LeaseTable, req: &TxnRequest) -> Result<(), LeaseError> {
    for op in req.success.iter().chain(&req.failure) {
        match op {
            TxnOp::Put(put) if put.lease != 0 && !table.contains(put.lease) => {
                return Err(LeaseError::NotFound { id: put.lease });
            }
            TxnOp::Txn(nested) => check_txn_leases(table, nested)?,
            _ => {}
        }
    }
    Ok(())
}

/// The same request asking for every previous pair, which the attachments need.
fn with_prev_kv(req: &TxnRequest) -> TxnRequest {
    let branch = |ops: &[TxnOp]| -> Vec<TxnOp> {
        ops.iter()
            .map(|op| match op {
                TxnOp::Put(put) => TxnOp::Put(PutRequest {
                    prev_kv: true,
                    ..put.clone()
                }),
                TxnOp::DeleteRange(del) => TxnOp::DeleteRange(DeleteRangeRequest {
                    prev_kv: true,
                    ..del.clone()
                }),
                TxnOp::Txn(nested) => TxnOp::Txn(with_prev_kv(nested)),
                TxnOp::Range(range) => TxnOp::Range(range.clone()),
            })
            .collect()
    };
    TxnRequest {
        compare: req.compare.clone(),
        success: branch(&req.success),
        failure: branch(&req.failure),
    }
}

/// Moves attachments after the branch `ops` ran with `responses`, and drops the previous
/// pairs the caller did not ask for.
fn track_txn(table: &mut LeaseTable, ops: &[TxnOp], responses: &mut [TxnOpResponse]) {
    for (op, response) in ops.iter().zip(responses.iter_mut()) {
        match (op, response) {
            (TxnOp::Put(put), TxnOpResponse::Put(r)) => {
                if let Some(prev) = &r.prev_kv
                    && prev.lease != 0
                    && prev.lease != put.lease
                {
                    let _ = table.detach(prev.lease, &put.key);
                }
                if put.lease != 0 {
                    let _ = table.attach(put.lease, &put.key);
                }
                if !put.prev_kv {
                    r.prev_kv = None;
                }
            }
            (TxnOp::DeleteRange(del), TxnOpResponse::DeleteRange(r)) => {
                for kv in &r.prev_kvs {
                    if kv.lease != 0 {
                        let _ = table.detach(kv.lease, kv.key());
                    }
                }
                if !del.prev_kv {
                    r.prev_kvs.clear();
                }
            }
            (TxnOp::Txn(nested), TxnOpResponse::Txn(r)) => {
                let branch = if r.succeeded {
                    &nested.success
                } else {
                    &nested.failure
                };
                track_txn(table, branch, &mut r.responses);
            }
            _ => {}
        }
    }
}
