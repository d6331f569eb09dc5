//! keel requests as they travel in Raft entries.
//!
//! A proposal is an [`Envelope`]: who proposed it (so that member can hand the result back to
//! the waiting caller when the entry is applied) and the [`Request`]. Normal entries carry the
//! envelope in their data; configuration-change entries carry raft-rs's `ConfChangeV2` in
//! their data and the envelope (with a [`Request::ConfChange`]) in their context.
//!
//! # Encoding (version 1)
//!
//! Integers are little-endian. `bytes` is a `u32` length then that many bytes; `opt<bytes>` is
//! a `u8` flag (0 absent, 1 present) then `bytes`; `bool` is a `u8` 0 or 1; `list<T>` is a
//! `u32` count then the items. Every length and count is checked against the bytes left
//! before anything is allocated, nesting of transactions is bounded by [`MAX_TXN_DEPTH`], and
//! trailing bytes are an error.
//!
//! ```text
//! envelope  = version:u8 (=1) | origin:u64 | seq:u64 | kind:u8 | body
//! kind 1 put            key:bytes | value:bytes | lease:i64 | prev_kv:bool
//! kind 2 delete range   key:bytes | range_end:opt<bytes> | prev_kv:bool
//! kind 3 txn            txn
//! kind 4 compact        revision:u64
//! kind 5 lease grant    id:i64 | ttl:i64
//! kind 6 lease revoke   id:i64
//! kind 7 checkpoint     list<id:i64 | remaining_ttl:i64>
//! kind 8 conf change    list<change:u8 | member:u64>   (1 add voter, 2 remove, 3 add learner)
//! kind 9 member op      the rest: a membership operation (MemberOp encoding, with its CRC)
//! txn       = list<compare> | list<op> (success) | list<op> (failure)
//! compare   = key:bytes | range_end:opt<bytes> | result:u8 (1 =, 2 !=, 3 >, 4 <)
//!             | target:u8 (1 value, 2 version, 3 create, 4 mod, 5 lease) | operand
//!             operand: bytes for value, u64 for version/create/mod, i64 for lease
//! op        = tag:u8 | body   1 range: key:bytes | range_end:opt<bytes> | revision:u64
//!                                       | limit:u64 | count_only:bool | keys_only:bool
//!                             2 put, 3 delete range: as kinds 1 and 2;  4 txn: txn
//! ```
//!
//! `origin` is the proposing member (0: nobody waits for the result), `seq` the proposer's
//! request number; together they identify the waiting caller.

use keel_mvcc::{
    Compare, CompareResult, CompareTarget, DeleteRangeRequest, DeleteResponse, PutRequest,
    PutResponse, RangeRequest, TxnOp, TxnRequest, TxnResponse,
};

use crate::error::NodeError;
use crate::membership::MemberOp;

/// Encoding version written by this build.
pub const REQUEST_VERSION: u8 = 1;
/// Deepest nesting of transactions accepted: the store's own limit, so a request that
/// decodes is never refused for its depth when applied.
pub use keel_mvcc::MAX_TXN_DEPTH;

/// A lease's remaining TTL, replicated by the leader so a leader change neither renews nor
/// immortalises it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseCheckpoint {
    /// The lease.
    pub id: i64,
    /// Remaining TTL in seconds; 0 clears the checkpoint.
    pub remaining_ttl: i64,
}

/// One membership change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberChange {
    /// Add a voting member.
    AddVoter(u64),
    /// Remove a member.
    Remove(u64),
    /// Add a non-voting learner.
    AddLearner(u64),
}

/// A replicated keel request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// Put a key.
    Put(PutRequest),
    /// Delete a key or a range.
    DeleteRange(DeleteRangeRequest),
    /// A transaction.
    Txn(TxnRequest),
    /// Compact the history up to a revision.
    Compact {
        /// Revisions below this one are removed.
        revision: u64,
    },
    /// Grant a lease.
    LeaseGrant {
        /// The lease id (chosen by the proposer, never 0).
        id: i64,
        /// TTL in seconds.
        ttl: i64,
    },
    /// Revoke a lease and delete its keys.
    LeaseRevoke {
        /// The lease id.
        id: i64,
    },
    /// Persist remaining TTLs.
    LeaseCheckpoint(Vec<LeaseCheckpoint>),
    /// Change the membership (carried in the context of a `ConfChangeV2` entry). Once
    /// applied, a member the configuration lists for the first time is listed among the
    /// members, as [`MemberOp::Add`] lists one, with its role in the configuration and, by
    /// default, the name `member-<id>`, the peer URL `mem://<id>` and no client URLs (as
    /// [`Node::add_voter`](crate::Node::add_voter) describes it). A conf change entry whose
    /// `ConfChangeV2` (or `ConfChange`) context holds an encoded [`Member`](crate::Member)
    /// of that id, which this request leaves empty, describes it instead, unless its peer
    /// URLs are another member's. An id removed before is not listed again. A listed member
    /// whose role the configuration now gives otherwise (a learner added as a voter, a voter
    /// added as a learner) is listed with that role, a learner unless it is an (incoming)
    /// voter. A member the configuration no longer lists at all is removed from the members
    /// for good, as by [`MemberOp::Remove`].
    ///
    /// A learner added this way, or a voter demoted this way, is held from automatic
    /// promotion (see [`MembershipOptions::auto_promote`]): it stays a learner, however
    /// caught up, until it is promoted explicitly, by [`MemberOp::Promote`] (as
    /// [`Node::member_promote`](crate::Node::member_promote) proposes it) or by a conf
    /// change like this one adding it as a voter, which ends the hold.
    ///
    /// [`MembershipOptions::auto_promote`]: crate::membership::MembershipOptions::auto_promote
    ConfChange(Vec<MemberChange>),
    /// A membership operation with etcd's semantics (carried in the context of a
    /// `ConfChangeV2` entry, or in a normal entry for an update of peer URLs).
    Member(MemberOp),
}

/// The result of an applied [`Request`], handed back to its proposer.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Response {
    /// From [`Request::Put`].
    Put(PutResponse),
    /// From [`Request::DeleteRange`].
    DeleteRange(DeleteResponse),
    /// From [`Request::Txn`].
    Txn(TxnResponse),
    /// From [`Request::Compact`]: the store revision when the compaction was recorded.
    Compact {
        /// Current revision.
        revision: u64,
    },
    /// From [`Request::LeaseGrant`].
    LeaseGrant {
        /// The lease id.
        id: i64,
        /// The granted TTL in seconds (raised to the minimum TTL).
        ttl: i64,
    },
    /// From [`Request::LeaseRevoke`]: the store revision after the attached keys were deleted.
    LeaseRevoke {
        /// Current revision.
        revision: u64,
    },
    /// From [`Request::LeaseCheckpoint`].
    LeaseCheckpoint,
    /// From [`Request::ConfChange`]: the voters and learners after the change.
    ConfChange {
        /// Voting members.
        voters: Vec<u64>,
        /// Learners.
        learners: Vec<u64>,
    },
}

/// The envelope kind of [`Request::Member`].
pub const MEMBER_KIND: u8 = 9;

/// Whether `data` is an encoded envelope of a [`Request::Member`] (checked without decoding).
pub fn is_member_request(data: &[u8]) -> bool {
    data.len() > 17 && data[0] == REQUEST_VERSION && data[17] == MEMBER_KIND
}

/// A request with the identity of its proposer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// The proposing member, 0 when nobody waits for the result.
    pub origin: u64,
    /// The proposer's request number.
    pub seq: u64,
    /// The request.
    pub request: Request,
}

impl Envelope {
    /// Encodes the envelope (format in the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(64);
        w.push(REQUEST_VERSION);
        put_u64(&mut w, self.origin);
        put_u64(&mut w, self.seq);
        match &self.request {
            Request::Put(p) => {
                w.push(1);
                enc_put(&mut w, p);
            }
            Request::DeleteRange(d) => {
                w.push(2);
                enc_delete(&mut w, d);
            }
            Request::Txn(t) => {
                w.push(3);
                enc_txn(&mut w, t);
            }
            Request::Compact { revision } => {
                w.push(4);
                put_u64(&mut w, *revision);
            }
            Request::LeaseGrant { id, ttl } => {
                w.push(5);
                put_i64(&mut w, *id);
                put_i64(&mut w, *ttl);
            }
            Request::LeaseRevoke { id } => {
                w.push(6);
                put_i64(&mut w, *id);
            }
            Request::LeaseCheckpoint(cps) => {
                w.push(7);
                put_u32(&mut w, cps.len() as u32);
                for c in cps {
                    put_i64(&mut w, c.id);
                    put_i64(&mut w, c.remaining_ttl);
                }
            }
            Request::ConfChange(changes) => {
                w.push(8);
                put_u32(&mut w, changes.len() as u32);
                for c in changes {
                    let (tag, id) = match c {
                        MemberChange::AddVoter(id) => (1u8, id),
                        MemberChange::Remove(id) => (2, id),
                        MemberChange::AddLearner(id) => (3, id),
                    };
                    w.push(tag);
                    put_u64(&mut w, *id);
                }
            }
            Request::Member(op) => {
                w.push(MEMBER_KIND);
                w.extend_from_slice(&op.encode());
            }
        }
        w
    }

    /// Decodes an envelope, refusing anything malformed with [`NodeError::Decode`].
    pub fn decode(bytes: &[u8]) -> Result<Envelope, NodeError> {
        let mut r = Reader { buf: bytes, pos: 0 };
        let version = r.u8()?;
        if version != REQUEST_VERSION {
            return Err(r.err(format!(
                "request version {version}; this build reads version {REQUEST_VERSION}"
            )));
        }
        let origin = r.u64()?;
        let seq = r.u64()?;
        let kind = r.u8()?;
        let request = match kind {
            1 => Request::Put(dec_put(&mut r)?),
            2 => Request::DeleteRange(dec_delete(&mut r)?),
            3 => Request::Txn(dec_txn(&mut r, 0)?),
            4 => Request::Compact { revision: r.u64()? },
            5 => Request::LeaseGrant {
                id: r.i64()?,
                ttl: r.i64()?,
            },
            6 => Request::LeaseRevoke { id: r.i64()? },
            7 => {
                let n = r.count(16)?;
                let mut cps = Vec::with_capacity(n);
                for _ in 0..n {
                    cps.push(LeaseCheckpoint {
                        id: r.i64()?,
                        remaining_ttl: r.i64()?,
                    });
                }
                Request::LeaseCheckpoint(cps)
            }
            8 => {
                let n = r.count(9)?;
                let mut changes = Vec::with_capacity(n);
                for _ in 0..n {
                    let tag = r.u8()?;
                    let id = r.u64()?;
                    changes.push(match tag {
                        1 => MemberChange::AddVoter(id),
                        2 => MemberChange::Remove(id),
                        3 => MemberChange::AddLearner(id),
                        t => return Err(r.err(format!("unknown member change {t}"))),
                    });
                }
                Request::ConfChange(changes)
            }
            MEMBER_KIND => {
                let rest = &bytes[r.pos..];
                r.pos = bytes.len();
                Request::Member(MemberOp::decode(rest).map_err(|e| r.err(e.to_string()))?)
            }
            k => return Err(r.err(format!("unknown request kind {k}"))),
        };
        if r.pos != bytes.len() {
            return Err(r.err(format!("{} trailing bytes", bytes.len() - r.pos)));
        }
        Ok(Envelope {
            origin,
            seq,
            request,
        })
    }
}

fn put_u32(w: &mut Vec<u8>, v: u32) {
    w.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(w: &mut Vec<u8>, v: u64) {
    w.extend_from_slice(&v.to_le_bytes());
}
fn put_i64(w: &mut Vec<u8>, v: i64) {
    w.extend_from_slice(&v.to_le_bytes());
}
fn put_bool(w: &mut Vec<u8>, v: bool) {
    w.push(u8::from(v));
}
fn put_bytes(w: &mut Vec<u8>, b: &[u8]) {
    put_u32(w, b.len() as u32);
    w.extend_from_slice(b);
}
fn put_opt(w: &mut Vec<u8>, b: Option<&Vec<u8>>) {
    match b {
        None => w.push(0),
        Some(b) => {
            w.push(1);
            put_bytes(w, b);
        }
    }
}

fn enc_put(w: &mut Vec<u8>, p: &PutRequest) {
    put_bytes(w, &p.key);
    put_bytes(w, &p.value);
    put_i64(w, p.lease);
    put_bool(w, p.prev_kv);
}

fn enc_delete(w: &mut Vec<u8>, d: &DeleteRangeRequest) {
    put_bytes(w, &d.key);
    put_opt(w, d.range_end.as_ref());
    put_bool(w, d.prev_kv);
}

fn enc_range(w: &mut Vec<u8>, q: &RangeRequest) {
    put_bytes(w, &q.key);
    put_opt(w, q.range_end.as_ref());
    put_u64(w, q.revision);
    put_u64(w, q.limit as u64);
    put_bool(w, q.count_only);
    put_bool(w, q.keys_only);
}

fn enc_ops(w: &mut Vec<u8>, ops: &[TxnOp]) {
    put_u32(w, ops.len() as u32);
    for op in ops {
        match op {
            TxnOp::Range(q) => {
                w.push(1);
                enc_range(w, q);
            }
            TxnOp::Put(p) => {
                w.push(2);
                enc_put(w, p);
            }
            TxnOp::DeleteRange(d) => {
                w.push(3);
                enc_delete(w, d);
            }
            TxnOp::Txn(t) => {
                w.push(4);
                enc_txn(w, t);
            }
        }
    }
}

fn enc_txn(w: &mut Vec<u8>, t: &TxnRequest) {
    put_u32(w, t.compare.len() as u32);
    for c in &t.compare {
        put_bytes(w, &c.key);
        put_opt(w, c.range_end.as_ref());
        w.push(match c.result {
            CompareResult::Equal => 1,
            CompareResult::NotEqual => 2,
            CompareResult::Greater => 3,
            CompareResult::Less => 4,
        });
        match &c.target {
            CompareTarget::Value(v) => {
                w.push(1);
                put_bytes(w, v);
            }
            CompareTarget::Version(v) => {
                w.push(2);
                put_u64(w, *v);
            }
            CompareTarget::CreateRevision(v) => {
                w.push(3);
                put_u64(w, *v);
            }
            CompareTarget::ModRevision(v) => {
                w.push(4);
                put_u64(w, *v);
            }
            CompareTarget::Lease(v) => {
                w.push(5);
                put_i64(w, *v);
            }
        }
    }
    enc_ops(w, &t.success);
    enc_ops(w, &t.failure);
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn err(&self, reason: impl Into<String>) -> NodeError {
        NodeError::decode("request", self.pos, reason)
    }

    fn take(&mut self, n: usize) -> Result<&[u8], NodeError> {
        let left = self.buf.len() - self.pos;
        if n > left {
            return Err(self.err(format!("needs {n} bytes, {left} left")));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], NodeError> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self) -> Result<u8, NodeError> {
        Ok(self.array::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, NodeError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64, NodeError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    fn i64(&mut self) -> Result<i64, NodeError> {
        Ok(i64::from_le_bytes(self.array()?))
    }
    fn bool(&mut self) -> Result<bool, NodeError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.err(format!("bool byte {b}"))),
        }
    }
    fn bytes(&mut self) -> Result<Vec<u8>, NodeError> {
        let n = self.u32()? as usize;
        Ok(self.take(n)?.to_vec())
    }
    fn opt(&mut self) -> Result<Option<Vec<u8>>, NodeError> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.bytes()?)),
            b => Err(self.err(format!("option flag {b}"))),
        }
    }
    /// A list count, bounded by the bytes left given the smallest item size.
    fn count(&mut self, min_item: usize) -> Result<usize, NodeError> {
        let n = self.u32()? as usize;
        let left = self.buf.len() - self.pos;
        if n.saturating_mul(min_item) > left {
            return Err(self.err(format!("{n} items cannot fit in {left} bytes")));
        }
        Ok(n)
    }
}

fn dec_put(r: &mut Reader<'_>) -> Result<PutRequest, NodeError> {
    Ok(PutRequest {
        key: r.bytes()?,
        value: r.bytes()?,
        lease: r.i64()?,
        prev_kv: r.bool()?,
    })
}

fn dec_delete(r: &mut Reader<'_>) -> Result<DeleteRangeRequest, NodeError> {
    Ok(DeleteRangeRequest {
        key: r.bytes()?,
        range_end: r.opt()?,
        prev_kv: r.bool()?,
    })
}

fn dec_range(r: &mut Reader<'_>) -> Result<RangeRequest, NodeError> {
    let key = r.bytes()?;
    let range_end = r.opt()?;
    let revision = r.u64()?;
    let limit = usize::try_from(r.u64()?).map_err(|_| r.err("limit does not fit usize"))?;
    Ok(RangeRequest {
        key,
        range_end,
        revision,
        limit,
        count_only: r.bool()?,
        keys_only: r.bool()?,
    })
}

fn dec_ops(r: &mut Reader<'_>, depth: usize) -> Result<Vec<TxnOp>, NodeError> {
    let n = r.count(2)?;
    let mut ops = Vec::with_capacity(n);
    for _ in 0..n {
        ops.push(match r.u8()? {
            1 => TxnOp::Range(dec_range(r)?),
            2 => TxnOp::Put(dec_put(r)?),
            3 => TxnOp::DeleteRange(dec_delete(r)?),
            4 => TxnOp::Txn(dec_txn(r, depth + 1)?),
            t => return Err(r.err(format!("unknown txn op {t}"))),
        });
    }
    Ok(ops)
}

fn dec_txn(r: &mut Reader<'_>, depth: usize) -> Result<TxnRequest, NodeError> {
    if depth >= MAX_TXN_DEPTH {
        return Err(r.err(format!("transactions nested deeper than {MAX_TXN_DEPTH}")));
    }
    let n = r.count(7)?;
    let mut compare = Vec::with_capacity(n);
    for _ in 0..n {
        let key = r.bytes()?;
        let range_end = r.opt()?;
        let result = match r.u8()? {
            1 => CompareResult::Equal,
            2 => CompareResult::NotEqual,
            3 => CompareResult::Greater,
            4 => CompareResult::Less,
            b => return Err(r.err(format!("unknown compare result {b}"))),
        };
        let target = match r.u8()? {
            1 => CompareTarget::Value(r.bytes()?),
            2 => CompareTarget::Version(r.u64()?),
            3 => CompareTarget::CreateRevision(r.u64()?),
            4 => CompareTarget::ModRevision(r.u64()?),
            5 => CompareTarget::Lease(r.i64()?),
            b => return Err(r.err(format!("unknown compare target {b}"))),
        };
        compare.push(Compare {
            key,
            range_end,
            target,
            result,
        });
    }
    let success = dec_ops(r, depth)?;
    let failure = dec_ops(r, depth)?;
    Ok(TxnRequest {
        compare,
        success,
        failure,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn samples() -> Vec<Request> {
        let txn = TxnRequest {
            compare: vec![
                Compare::new(
                    b"a".to_vec(),
                    CompareResult::Equal,
                    CompareTarget::Version(3),
                ),
                Compare {
                    key: b"b".to_vec(),
                    range_end: Some(b"c".to_vec()),
                    target: CompareTarget::Value(b"v".to_vec()),
                    result: CompareResult::Less,
                },
                Compare::new(
                    b"l".to_vec(),
                    CompareResult::NotEqual,
                    CompareTarget::Lease(-4),
                ),
            ],
            success: vec![
                TxnOp::Put(PutRequest::new(b"a".to_vec(), b"1".to_vec())),
                TxnOp::Range(RangeRequest {
                    limit: 10,
                    keys_only: true,
                    ..RangeRequest::prefix(b"p".to_vec())
                }),
            ],
            failure: vec![
                TxnOp::DeleteRange(DeleteRangeRequest::range(b"x".to_vec(), b"y".to_vec())),
                TxnOp::Txn(TxnRequest::default()),
            ],
        };
        vec![
            Request::Put(PutRequest {
                key: b"k".to_vec(),
                value: vec![7; 300],
                lease: 42,
                prev_kv: true,
            }),
            Request::DeleteRange(DeleteRangeRequest::key(b"k".to_vec())),
            Request::Txn(txn),
            Request::Compact { revision: 99 },
            Request::LeaseGrant { id: 5, ttl: 60 },
            Request::LeaseRevoke { id: 5 },
            Request::LeaseCheckpoint(vec![LeaseCheckpoint {
                id: 5,
                remaining_ttl: 17,
            }]),
            Request::ConfChange(vec![MemberChange::AddLearner(4), MemberChange::Remove(2)]),
            Request::Member(MemberOp::Promote {
                id: 4,
                automatic: true,
            }),
            Request::Member(MemberOp::UpdatePeerUrls {
                id: 4,
                peer_urls: vec!["http://127.0.0.1:2380".into()],
            }),
        ]
    }

    #[test]
    fn every_request_round_trips() {
        for (i, request) in samples().into_iter().enumerate() {
            let env = Envelope {
                origin: 3,
                seq: i as u64 + 1,
                request,
            };
            let bytes = env.encode();
            assert_eq!(bytes[0], REQUEST_VERSION);
            assert_eq!(Envelope::decode(&bytes).ok(), Some(env));
        }
    }

    #[test]
    fn truncation_garbage_and_bit_flips_are_typed_errors() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for request in samples() {
            let bytes = Envelope {
                origin: 1,
                seq: 1,
                request,
            }
            .encode();
            for cut in 0..bytes.len() {
                let err = Envelope::decode(&bytes[..cut]).expect_err("truncated");
                assert!(matches!(err, NodeError::Decode { .. }), "{err}");
            }
            let mut long = bytes.clone();
            long.push(0);
            assert!(Envelope::decode(&long).is_err(), "trailing byte");
            for _ in 0..200 {
                let mut b = bytes.clone();
                let at = rng.random_range(0..b.len());
                b[at] ^= 1 << rng.random_range(0..8);
                // Either an error or some request: never a panic or a huge allocation.
                let _ = Envelope::decode(&b);
            }
        }
        let mut huge = vec![REQUEST_VERSION];
        huge.extend_from_slice(&[0; 16]);
        huge.push(7);
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        let err = Envelope::decode(&huge).expect_err("count bounded by bytes left");
        assert!(err.to_string().contains("cannot fit"), "{err}");
        assert!(Envelope::decode(&[2]).is_err(), "unknown version");
    }

    #[test]
    fn nesting_is_bounded() {
        let mut t = TxnRequest::default();
        for _ in 0..MAX_TXN_DEPTH + 1 {
            t = TxnRequest {
                success: vec![TxnOp::Txn(t)],
                ..TxnRequest::default()
            };
        }
        let bytes = Envelope {
            origin: 0,
            seq: 0,
            request: Request::Txn(t),
        }
        .encode();
        let err = Envelope::decode(&bytes).expect_err("too deep");
        assert!(err.to_string().contains("nested"), "{err}");
    }
}
