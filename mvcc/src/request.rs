//! Requests and responses of the store's operations, shaped after etcd's KV API.
//!
//! Range conventions (etcd): `range_end = None` names the single key `key`; `range_end =
//! Some(b"\0")` means every key `>= key`; any other end is exclusive. A prefix range uses
//! [`prefix_end`]. The key must not be empty: "all keys" is `key = b"\0"`, `range_end = b"\0"`.

use crate::error::{MvccError, show};
use crate::kv::{KeyValue, LeaseId};

/// The range end that selects every key starting with `prefix` (etcd's `GetPrefixRangeEnd`);
/// `b"\0"` (every key from `prefix` on) when no such end exists.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// Checks a key and optional range end; returns the exclusive upper bound (`None` = no bound)
/// for ranges, or the key itself for single-key requests (signalled by `single = true`).
pub(crate) fn check_range(key: &[u8], end: Option<&[u8]>) -> Result<(), MvccError> {
    if key.is_empty() {
        return Err(MvccError::EmptyKey);
    }
    if let Some(end) = end
        && end != [0]
        && end < key
    {
        return Err(MvccError::RangeEndBelowKey {
            key: show(key),
            end: show(end),
        });
    }
    Ok(())
}

/// The exclusive upper bound of a checked range: `None` = unbounded.
pub(crate) enum Bound<'a> {
    /// Exactly one key.
    Single,
    /// `[key, end)`.
    Until(&'a [u8]),
    /// `[key, ∞)`.
    Unbounded,
}

pub(crate) fn bound(end: Option<&[u8]>) -> Bound<'_> {
    match end {
        None => Bound::Single,
        Some([0]) => Bound::Unbounded,
        Some(end) => Bound::Until(end),
    }
}

/// A read of a key or range.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeRequest {
    /// First key (or the only key).
    pub key: Vec<u8>,
    /// Range end, see the module docs.
    pub range_end: Option<Vec<u8>>,
    /// Revision to read at; 0 reads the current revision.
    pub revision: u64,
    /// Most keys returned; 0 is no limit.
    pub limit: usize,
    /// Return only the count.
    pub count_only: bool,
    /// Return keys and metadata without values.
    pub keys_only: bool,
}

impl RangeRequest {
    /// A read of one key at the current revision.
    pub fn key(key: impl Into<Vec<u8>>) -> RangeRequest {
        RangeRequest {
            key: key.into(),
            ..RangeRequest::default()
        }
    }

    /// A read of `[key, end)` at the current revision (`end = b"\0"`: every key from `key`).
    pub fn range(key: impl Into<Vec<u8>>, end: impl Into<Vec<u8>>) -> RangeRequest {
        RangeRequest {
            key: key.into(),
            range_end: Some(end.into()),
            ..RangeRequest::default()
        }
    }

    /// A read of every key starting with `prefix`.
    pub fn prefix(prefix: impl Into<Vec<u8>>) -> RangeRequest {
        let key = prefix.into();
        let end = prefix_end(&key);
        RangeRequest {
            key,
            range_end: Some(end),
            ..RangeRequest::default()
        }
    }

    /// The same request at `revision`.
    pub fn at(mut self, revision: u64) -> RangeRequest {
        self.revision = revision;
        self
    }

    pub(crate) fn bytes(&self) -> usize {
        self.key.len() + self.range_end.as_ref().map_or(0, Vec::len)
    }
}

/// The result of a range.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RangeResponse {
    /// Matching keys in ascending order (empty for `count_only`), at most `limit`.
    pub kvs: Vec<KeyValue>,
    /// Number of matching keys, ignoring `limit`.
    pub count: usize,
    /// True when `limit` cut the result.
    pub more: bool,
    /// The revision the range was read at.
    pub revision: u64,
}

/// A put with all its options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PutRequest {
    /// The key.
    pub key: Vec<u8>,
    /// The new value.
    pub value: Vec<u8>,
    /// Lease to attach, 0 for none.
    pub lease: LeaseId,
    /// Return the previous key-value pair.
    pub prev_kv: bool,
}

impl PutRequest {
    /// A put without a lease and without the previous value.
    pub fn new(key: impl Into<Vec<u8>>, value: impl Into<Vec<u8>>) -> PutRequest {
        PutRequest {
            key: key.into(),
            value: value.into(),
            ..PutRequest::default()
        }
    }
}

/// The result of a put.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PutResponse {
    /// The store revision after the put (inside a transaction: the transaction's revision).
    pub revision: u64,
    /// The previous pair, when asked for and the key existed.
    pub prev_kv: Option<KeyValue>,
}

/// A deletion of a key or range, with all its options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeleteRangeRequest {
    /// First key (or the only key).
    pub key: Vec<u8>,
    /// Range end, see the module docs.
    pub range_end: Option<Vec<u8>>,
    /// Return the deleted pairs.
    pub prev_kv: bool,
}

impl DeleteRangeRequest {
    /// Deletes one key.
    pub fn key(key: impl Into<Vec<u8>>) -> DeleteRangeRequest {
        DeleteRangeRequest {
            key: key.into(),
            ..DeleteRangeRequest::default()
        }
    }

    /// Deletes `[key, end)`.
    pub fn range(key: impl Into<Vec<u8>>, end: impl Into<Vec<u8>>) -> DeleteRangeRequest {
        DeleteRangeRequest {
            key: key.into(),
            range_end: Some(end.into()),
            prev_kv: false,
        }
    }
}

/// The result of a deletion.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeleteResponse {
    /// The store revision after the deletion.
    pub revision: u64,
    /// Number of keys deleted.
    pub deleted: usize,
    /// The deleted pairs, when asked for.
    pub prev_kvs: Vec<KeyValue>,
}

/// What a [`Compare`] looks at, with the operand.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CompareTarget {
    /// The value; a missing key never matches.
    Value(Vec<u8>),
    /// The version (0 for a missing key).
    Version(u64),
    /// The create revision (0 for a missing key).
    CreateRevision(u64),
    /// The mod revision (0 for a missing key).
    ModRevision(u64),
    /// The lease (0 for a missing key or no lease).
    Lease(LeaseId),
}

/// How a [`Compare`] relates the key's field to the operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompareResult {
    /// field == operand
    Equal,
    /// field != operand
    NotEqual,
    /// field > operand
    Greater,
    /// field < operand
    Less,
}

/// One guard of a transaction: true when it holds for every key in the range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Compare {
    /// The key (or first key).
    pub key: Vec<u8>,
    /// Range end, see the module docs.
    pub range_end: Option<Vec<u8>>,
    /// Field and operand.
    pub target: CompareTarget,
    /// Relation.
    pub result: CompareResult,
}

impl Compare {
    /// A compare on one key.
    pub fn new(key: impl Into<Vec<u8>>, result: CompareResult, target: CompareTarget) -> Compare {
        Compare {
            key: key.into(),
            range_end: None,
            target,
            result,
        }
    }
}

/// One operation of a transaction branch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOp {
    /// A read; sees the branch's earlier writes.
    Range(RangeRequest),
    /// A put.
    Put(PutRequest),
    /// A deletion.
    DeleteRange(DeleteRangeRequest),
    /// A nested transaction.
    Txn(TxnRequest),
}

/// Deepest nesting of transactions a request may hold, the outermost one counted: deeper
/// requests are refused with [`MvccError::TxnTooDeep`](crate::MvccError::TxnTooDeep) before
/// anything walks them recursively.
pub const MAX_TXN_DEPTH: usize = 16;

/// A transaction: if every compare holds, run `success`, else `failure`; atomically, as one
/// revision. Nested transactions ([`TxnOp::Txn`]) go at most [`MAX_TXN_DEPTH`] levels deep.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TxnRequest {
    /// Guards, all evaluated at the transaction's start.
    pub compare: Vec<Compare>,
    /// Operations when every guard holds.
    pub success: Vec<TxnOp>,
    /// Operations otherwise.
    pub failure: Vec<TxnOp>,
}

/// The result of one [`TxnOp`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOpResponse {
    /// From [`TxnOp::Range`].
    Range(RangeResponse),
    /// From [`TxnOp::Put`].
    Put(PutResponse),
    /// From [`TxnOp::DeleteRange`].
    DeleteRange(DeleteResponse),
    /// From [`TxnOp::Txn`].
    Txn(TxnResponse),
}

/// The result of a transaction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TxnResponse {
    /// True when the compares held and `success` ran.
    pub succeeded: bool,
    /// One response per operation of the branch that ran.
    pub responses: Vec<TxnOpResponse>,
    /// The store revision after the transaction.
    pub revision: u64,
}

/// Hash of the store's history up to a revision, for cross-member consistency checks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HashKv {
    /// CRC-32 (IEEE) over the bucket name and every stored change up to `revision`, skipping
    /// changes that compaction removes.
    pub hash: u32,
    /// The compaction point when the hash was taken.
    pub compact_revision: u64,
    /// The revision hashed.
    pub revision: u64,
}
