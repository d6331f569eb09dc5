//! Transaction requests: validation (etcd's limits and duplicate-key rule), compares, and
//! execution inside a [`WriteTxn`].
//!
//! As in etcd, every compare of the request, nested ones included, is evaluated against the
//! state at the transaction's start, which fixes the branch taken at every level before any
//! operation runs; operations then run in order, each seeing the earlier ones' writes.

use crate::backend::Backend;
use crate::error::{MvccError, show};
use crate::kv::KeyValue;
use crate::request::{
    Compare, CompareResult, CompareTarget, MAX_TXN_DEPTH, RangeRequest, TxnOp, TxnOpResponse,
    TxnRequest, TxnResponse, check_range,
};
use crate::write::WriteTxn;

/// Runs `req` in `txn`.
pub(crate) fn run<B: Backend>(
    txn: &mut WriteTxn<'_, B>,
    req: &TxnRequest,
) -> Result<TxnResponse, MvccError> {
    validate(txn.options(), req)?;
    let mut path = Vec::new();
    choose(txn, req, &mut path)?;
    let mut path = path.into_iter();
    execute(txn, req, &mut path)
}

/// Validates a whole request before anything runs.
pub(crate) fn validate(
    options: &crate::options::StoreOptions,
    req: &TxnRequest,
) -> Result<(), MvccError> {
    // First, and without recursion: everything after walks the request recursively.
    check_depth(req)?;
    let size = request_bytes(req);
    if size > options.max_request_bytes {
        return Err(MvccError::RequestTooLarge {
            size,
            limit: options.max_request_bytes,
        });
    }
    check_limits(options.max_txn_ops, req)?;
    check_intervals(&req.success)?;
    check_intervals(&req.failure)?;
    Ok(())
}

/// Refuses a request nesting transactions deeper than [`MAX_TXN_DEPTH`] levels, walking it
/// with a stack of its own.
fn check_depth(req: &TxnRequest) -> Result<(), MvccError> {
    let nests = |t: &TxnRequest| {
        t.success
            .iter()
            .chain(&t.failure)
            .any(|op| matches!(op, TxnOp::Txn(_)))
    };
    // Most requests nest nothing: no stack to allocate.
    if !nests(req) {
        return Ok(());
    }
    let mut stack = vec![(req, 1usize)];
    while let Some((t, depth)) = stack.pop() {
        if depth > MAX_TXN_DEPTH {
            return Err(MvccError::TxnTooDeep {
                limit: MAX_TXN_DEPTH,
            });
        }
        for op in t.success.iter().chain(&t.failure) {
            if let TxnOp::Txn(inner) = op {
                stack.push((inner, depth + 1));
            }
        }
    }
    Ok(())
}

fn request_bytes(req: &TxnRequest) -> usize {
    let cmp: usize = req
        .compare
        .iter()
        .map(|c| {
            c.key.len()
                + c.range_end.as_ref().map_or(0, Vec::len)
                + match &c.target {
                    CompareTarget::Value(v) => v.len(),
                    _ => 8,
                }
        })
        .sum();
    let ops = |ops: &[TxnOp]| -> usize {
        ops.iter()
            .map(|op| match op {
                TxnOp::Range(r) => r.bytes(),
                TxnOp::Put(p) => p.key.len() + p.value.len(),
                TxnOp::DeleteRange(d) => d.key.len() + d.range_end.as_ref().map_or(0, Vec::len),
                TxnOp::Txn(t) => request_bytes(t),
            })
            .sum()
    };
    cmp + ops(&req.success) + ops(&req.failure)
}

fn check_limits(max: usize, req: &TxnRequest) -> Result<(), MvccError> {
    let ops = req
        .compare
        .len()
        .max(req.success.len())
        .max(req.failure.len());
    if ops > max {
        return Err(MvccError::TooManyOps { ops, limit: max });
    }
    for c in &req.compare {
        check_range(&c.key, c.range_end.as_deref())?;
    }
    for op in req.success.iter().chain(&req.failure) {
        match op {
            TxnOp::Range(r) => check_range(&r.key, r.range_end.as_deref())?,
            TxnOp::Put(p) => {
                if p.key.is_empty() {
                    return Err(MvccError::EmptyKey);
                }
            }
            TxnOp::DeleteRange(d) => check_range(&d.key, d.range_end.as_deref())?,
            TxnOp::Txn(t) => check_limits(max, t)?,
        }
    }
    Ok(())
}

/// A deleted interval: `[start, end)`, `end = None` unbounded; a single key is `[k, k\0)`.
struct Interval {
    start: Vec<u8>,
    end: Option<Vec<u8>>,
}

impl Interval {
    fn contains(&self, key: &[u8]) -> bool {
        key >= self.start.as_slice() && self.end.as_ref().is_none_or(|e| key < e.as_slice())
    }
}

fn interval(key: &[u8], end: Option<&[u8]>) -> Interval {
    match end {
        None => {
            let mut e = key.to_vec();
            e.push(0);
            Interval {
                start: key.to_vec(),
                end: Some(e),
            }
        }
        Some([0]) => Interval {
            start: key.to_vec(),
            end: None,
        },
        Some(e) => Interval {
            start: key.to_vec(),
            end: Some(e.to_vec()),
        },
    }
}

fn duplicate(key: &[u8]) -> MvccError {
    MvccError::DuplicateKey { key: show(key) }
}

/// etcd `checkIntervals`: within one branch, no key is put twice and no put falls in a range
/// the branch deletes (nested transactions included; their two branches exclude each other).
fn check_intervals(ops: &[TxnOp]) -> Result<(Vec<Vec<u8>>, Vec<Interval>), MvccError> {
    let mut dels: Vec<Interval> = ops
        .iter()
        .filter_map(|op| match op {
            TxnOp::DeleteRange(d) => Some(interval(&d.key, d.range_end.as_deref())),
            _ => None,
        })
        .collect();
    let mut puts: Vec<Vec<u8>> = Vec::new();
    for op in ops {
        let TxnOp::Txn(t) = op else { continue };
        let (puts_then, dels_then) = check_intervals(&t.success)?;
        let (puts_else, dels_else) = check_intervals(&t.failure)?;
        for k in &puts_then {
            if puts.contains(k) || dels.iter().any(|d| d.contains(k)) {
                return Err(duplicate(k));
            }
        }
        let before = puts.len();
        puts.extend(puts_then.iter().cloned());
        for k in &puts_else {
            if (puts[..before].contains(k)) || dels.iter().any(|d| d.contains(k)) {
                return Err(duplicate(k));
            }
            if !puts_then.contains(k) {
                puts.push(k.clone());
            }
        }
        dels.extend(dels_then);
        dels.extend(dels_else);
    }
    for op in ops {
        let TxnOp::Put(p) = op else { continue };
        if puts.contains(&p.key) || dels.iter().any(|d| d.contains(&p.key)) {
            return Err(duplicate(&p.key));
        }
        puts.push(p.key.clone());
    }
    Ok((puts, dels))
}

/// Evaluates compares and records the branch taken by this request and every nested one
/// reached, in execution order.
fn choose<B: Backend>(
    txn: &WriteTxn<'_, B>,
    req: &TxnRequest,
    path: &mut Vec<bool>,
) -> Result<(), MvccError> {
    let mut ok = true;
    for c in &req.compare {
        if !compare(txn, c)? {
            ok = false;
            break;
        }
    }
    path.push(ok);
    let branch = if ok { &req.success } else { &req.failure };
    for op in branch {
        if let TxnOp::Txn(t) = op {
            choose(txn, t, path)?;
        }
    }
    Ok(())
}

fn compare<B: Backend>(txn: &WriteTxn<'_, B>, c: &Compare) -> Result<bool, MvccError> {
    let resp = txn.range(&RangeRequest {
        key: c.key.clone(),
        range_end: c.range_end.clone(),
        keys_only: !matches!(c.target, CompareTarget::Value(_)),
        ..RangeRequest::default()
    })?;
    if resp.kvs.is_empty() {
        if matches!(c.target, CompareTarget::Value(_)) {
            // A missing key has no value to compare (etcd).
            return Ok(false);
        }
        return Ok(compare_kv(c, &KeyValue::default()));
    }
    Ok(resp.kvs.iter().all(|kv| compare_kv(c, kv)))
}

fn compare_kv(c: &Compare, kv: &KeyValue) -> bool {
    use std::cmp::Ordering;
    let ord = match &c.target {
        CompareTarget::Value(v) => kv.value().cmp(v.as_slice()),
        CompareTarget::Version(v) => kv.version.cmp(v),
        CompareTarget::CreateRevision(v) => kv.create_revision.cmp(v),
        CompareTarget::ModRevision(v) => kv.mod_revision.cmp(v),
        CompareTarget::Lease(v) => kv.lease.cmp(v),
    };
    match c.result {
        CompareResult::Equal => ord == Ordering::Equal,
        CompareResult::NotEqual => ord != Ordering::Equal,
        CompareResult::Greater => ord == Ordering::Greater,
        CompareResult::Less => ord == Ordering::Less,
    }
}

fn execute<B: Backend>(
    txn: &mut WriteTxn<'_, B>,
    req: &TxnRequest,
    path: &mut std::vec::IntoIter<bool>,
) -> Result<TxnResponse, MvccError> {
    let succeeded = path.next().unwrap_or(false);
    let branch = if succeeded {
        &req.success
    } else {
        &req.failure
    };
    let mut responses = Vec::with_capacity(branch.len());
    for op in branch {
        responses.push(match op {
            TxnOp::Range(r) => TxnOpResponse::Range(txn.range(r)?),
            TxnOp::Put(p) => TxnOpResponse::Put(txn.put_with(p)?),
            TxnOp::DeleteRange(d) => TxnOpResponse::DeleteRange(txn.delete_with(d)?),
            TxnOp::Txn(t) => TxnOpResponse::Txn(execute(txn, t, path)?),
        });
    }
    Ok(TxnResponse {
        succeeded,
        responses,
        revision: txn.revision(),
    })
}

/// Sets the final store revision on a response and its write responses.
pub(crate) fn set_revision(resp: &mut TxnResponse, revision: u64) {
    resp.revision = revision;
    for r in &mut resp.responses {
        match r {
            TxnOpResponse::Put(p) => p.revision = revision,
            TxnOpResponse::DeleteRange(d) => d.revision = revision,
            TxnOpResponse::Txn(t) => set_revision(t, revision),
            TxnOpResponse::Range(_) => {}
        }
    }
}
