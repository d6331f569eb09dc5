//! [`Member`] and [`MemberOp`], and their stored/replicated encodings.
//!
//! All integers little-endian; strings are UTF-8 with a `u32` length prefix.
//!
//! ```text
//! member    = version:u8 (=1) | flags:u8 (bit 0: learner) | id:u64
//!             | name:str | peer_count:u32 | peer_count × url:str
//!             | client_count:u32 | client_count × url:str
//!             | crc32:u32 (IEEE, of every byte before it)
//! str       = len:u32 | len bytes
//! member_op = version:u8 (=1) | tag:u8 | body | crc32:u32 (of every byte before it)
//!   tag 1 add:     member (without its version and crc32)
//!   tag 2 remove:  id:u64
//!   tag 3 update:  id:u64 | peer_count:u32 | peer_count × url:str
//!   tag 4 promote: id:u64 | automatic:u8 (0 or 1)
//! listed    = a member as a member set lists it (the value of the `members` bucket), in
//!             one of two versions:
//!   version 1: a member, byte for byte (flags bit 0: learner)
//!   version 2: version:u8 (=2) | flags:u8 | id:u64
//!             | name:str | peer_count:u32 | peer_count × url:str
//!             | client_count:u32 | client_count × url:str
//!             | crc32:u32 (IEEE, of every byte before it)
//!     flags bit 0: learner
//!     flags bit 1: held from automatic promotion (its role was last set by a conf change
//!                  that carried no membership operation); set only with bit 0
//! ```
//!
//! In a version 1 encoding (a member, a member operation, a listed member) only bit 0 of
//! the flags may be set; any other bit, or any other version, is refused. Version 2 exists
//! for listed members only, and is written only for a held learner: any other listed member
//! is written as version 1, so a build that reads version 1 alone still reads every record
//! that holds nothing it does not know. Both versions are read: [`Member::decode`] reads a
//! listed member of either (without its hold), [`Member::decode_listed`] with its hold.
//!
//! Lengths are checked against [`MAX_NAME_BYTES`], [`MAX_URL_BYTES`] and [`MAX_URLS`] before
//! anything is allocated, so a corrupt length can never make a reader allocate gigabytes.

use rand::Rng;

use super::MembershipError;
use super::check::ProposedChange;

/// Encoding version of [`Member`] and [`MemberOp`], and of a listed member that is not held
/// from automatic promotion.
pub const MEMBER_FORMAT: u8 = 1;
/// Encoding version of a listed member that is held from automatic promotion (module docs).
pub const LISTED_MEMBER_FORMAT: u8 = 2;
/// Longest member name, in bytes.
pub const MAX_NAME_BYTES: usize = 256;
/// Longest URL, in bytes.
pub const MAX_URL_BYTES: usize = 1024;
/// Most peer (or client) URLs of one member.
pub const MAX_URLS: usize = 64;

/// One member of the cluster.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// Random, never 0, never reused after the member is removed.
    pub id: u64,
    /// Human-readable name; empty until the member has started and published it (etcd's
    /// "unstarted" member).
    pub name: String,
    /// Addresses other members reach it at.
    pub peer_urls: Vec<String>,
    /// Addresses clients reach it at.
    pub client_urls: Vec<String>,
    /// A non-voting learner.
    pub is_learner: bool,
}

impl Member {
    /// A member with a fresh random id that is neither 0 nor in `taken` (current and removed
    /// ids).
    pub fn with_random_id(
        name: impl Into<String>,
        peer_urls: Vec<String>,
        client_urls: Vec<String>,
        is_learner: bool,
        taken: impl Fn(u64) -> bool,
    ) -> Member {
        let mut rng = rand::rng();
        let id = loop {
            let id: u64 = rng.random();
            if id != 0 && !taken(id) {
                break id;
            }
        };
        Member {
            id,
            name: name.into(),
            peer_urls,
            client_urls,
            is_learner,
        }
    }

    /// Checks the fields against the encoding's bounds and etcd's rules (at least one peer
    /// URL, id not 0).
    pub fn validate(&self) -> Result<(), MembershipError> {
        let bad = |reason: String| MembershipError::InvalidMember {
            id: self.id,
            reason,
        };
        if self.id == 0 {
            return Err(bad("member id 0 is reserved".into()));
        }
        if self.name.len() > MAX_NAME_BYTES {
            return Err(bad(format!(
                "name is {} bytes, the limit is {MAX_NAME_BYTES}",
                self.name.len()
            )));
        }
        if self.peer_urls.is_empty() {
            return Err(bad("a member needs at least one peer URL".into()));
        }
        for urls in [&self.peer_urls, &self.client_urls] {
            check_urls(urls).map_err(bad)?;
        }
        Ok(())
    }

    /// Encodes the member (format in the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = vec![MEMBER_FORMAT];
        self.encode_body(&mut w, u8::from(self.is_learner));
        seal(w)
    }

    /// Encodes the member as a member set lists it (`listed` in the module docs): `held`
    /// says that it is held from automatic promotion, which only a learner can be. A member
    /// that is not held is encoded exactly as [`encode`](Self::encode) encodes it (version
    /// 1); a held one as version 2.
    pub fn encode_listed(&self, held: bool) -> Vec<u8> {
        debug_assert!(!held || self.is_learner, "only a learner is held");
        if !(held && self.is_learner) {
            return self.encode();
        }
        let mut w = vec![LISTED_MEMBER_FORMAT];
        self.encode_body(&mut w, FLAG_LEARNER | FLAG_HELD);
        seal(w)
    }

    fn encode_body(&self, w: &mut Vec<u8>, flags: u8) {
        w.push(flags);
        w.extend_from_slice(&self.id.to_le_bytes());
        put_str(w, &self.name);
        put_urls(w, &self.peer_urls);
        put_urls(w, &self.client_urls);
    }

    /// Decodes a member, refusing anything malformed. A listed member of either version is
    /// read too, without what only its listing says (see
    /// [`decode_listed`](Self::decode_listed)).
    pub fn decode(bytes: &[u8]) -> Result<Member, MembershipError> {
        Member::decode_listed(bytes).map(|(m, _)| m)
    }

    /// Decodes a member as a member set lists it (`listed` in the module docs, either
    /// version), refusing anything malformed: the member, and whether it is held from
    /// automatic promotion (never, in version 1).
    pub fn decode_listed(bytes: &[u8]) -> Result<(Member, bool), MembershipError> {
        let (version, body) = unseal("member", bytes, LISTED_MEMBER_FORMAT)?;
        let mut r = Reader::new("member", body);
        let (member, flags) = Member::decode_body(&mut r, version)?;
        r.finish()?;
        Ok((member, flags & FLAG_HELD != 0))
    }

    /// Decodes a member's body of encoding `version`; returns it with its flags.
    fn decode_body(r: &mut Reader<'_>, version: u8) -> Result<(Member, u8), MembershipError> {
        let flags = r.u8()?;
        let known = match version {
            MEMBER_FORMAT => FLAG_LEARNER,
            _ => FLAG_LEARNER | FLAG_HELD,
        };
        if flags & !known != 0 {
            return Err(r.err(format!(
                "unknown flags {flags:#x} in a version {version} encoding"
            )));
        }
        if flags & FLAG_HELD != 0 && flags & FLAG_LEARNER == 0 {
            return Err(r.err(format!(
                "flags {flags:#x}: only a learner is held from automatic promotion"
            )));
        }
        let id = r.u64()?;
        let name = r.string(MAX_NAME_BYTES)?;
        let peer_urls = r.urls()?;
        let client_urls = r.urls()?;
        let member = Member {
            id,
            name,
            peer_urls,
            client_urls,
            is_learner: flags & FLAG_LEARNER != 0,
        };
        Ok((member, flags))
    }
}

/// Flags bit 0: a learner.
const FLAG_LEARNER: u8 = 1;
/// Flags bit 1 (version 2 of a listed member only): held from automatic promotion.
const FLAG_HELD: u8 = 2;

fn check_urls(urls: &[String]) -> Result<(), String> {
    if urls.len() > MAX_URLS {
        return Err(format!("{} URLs, the limit is {MAX_URLS}", urls.len()));
    }
    for u in urls {
        if u.is_empty() || u.len() > MAX_URL_BYTES {
            return Err(format!("URL {u:?} must be 1 to {MAX_URL_BYTES} bytes long"));
        }
    }
    Ok(())
}

/// One membership operation, as proposed and as replicated in the conf-change entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemberOp {
    /// Add a member (voter or learner, by its flag).
    Add(Member),
    /// Remove a member; its id is remembered and never reused.
    Remove(u64),
    /// Replace a member's peer URLs.
    UpdatePeerUrls {
        /// The member.
        id: u64,
        /// Its new peer URLs.
        peer_urls: Vec<String>,
    },
    /// Promote a learner to a voter.
    Promote {
        /// The learner.
        id: u64,
        /// Proposed by the [`AutoPromoter`](super::AutoPromoter): applying it to a member
        /// that is already a voter (a manual promote won the race) is a no-op, not an error.
        automatic: bool,
    },
}

impl MemberOp {
    /// The member the operation is about.
    pub fn id(&self) -> u64 {
        match self {
            MemberOp::Add(m) => m.id,
            MemberOp::Remove(id)
            | MemberOp::UpdatePeerUrls { id, .. }
            | MemberOp::Promote { id, .. } => *id,
        }
    }

    /// The configuration change this operation makes, as the strict check sees it and as
    /// it maps onto a Raft conf change (`AddVoter`/`AddLearner`/`Remove` one to one,
    /// `Promote` as raft-rs's `AddNode` on a learner); `None` for an update of peer URLs,
    /// an ordinary entry since Raft's configuration does not hold addresses.
    pub fn proposed_change(&self) -> Option<ProposedChange> {
        match self {
            MemberOp::Add(m) if m.is_learner => Some(ProposedChange::AddLearner(m.id)),
            MemberOp::Add(m) => Some(ProposedChange::AddVoter(m.id)),
            MemberOp::Remove(id) => Some(ProposedChange::Remove(*id)),
            MemberOp::UpdatePeerUrls { .. } => None,
            MemberOp::Promote { id, .. } => Some(ProposedChange::Promote(*id)),
        }
    }

    /// Encodes the operation (format in the module docs).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = vec![MEMBER_FORMAT];
        match self {
            MemberOp::Add(m) => {
                w.push(1);
                m.encode_body(&mut w, u8::from(m.is_learner));
            }
            MemberOp::Remove(id) => {
                w.push(2);
                w.extend_from_slice(&id.to_le_bytes());
            }
            MemberOp::UpdatePeerUrls { id, peer_urls } => {
                w.push(3);
                w.extend_from_slice(&id.to_le_bytes());
                put_urls(&mut w, peer_urls);
            }
            MemberOp::Promote { id, automatic } => {
                w.push(4);
                w.extend_from_slice(&id.to_le_bytes());
                w.push(u8::from(*automatic));
            }
        }
        seal(w)
    }

    /// Decodes an operation, refusing anything malformed.
    pub fn decode(bytes: &[u8]) -> Result<MemberOp, MembershipError> {
        let (version, body) = unseal("member operation", bytes, MEMBER_FORMAT)?;
        let mut r = Reader::new("member operation", body);
        let op = match r.u8()? {
            1 => MemberOp::Add(Member::decode_body(&mut r, version)?.0),
            2 => MemberOp::Remove(r.u64()?),
            3 => MemberOp::UpdatePeerUrls {
                id: r.u64()?,
                peer_urls: r.urls()?,
            },
            4 => {
                let id = r.u64()?;
                let automatic = match r.u8()? {
                    0 => false,
                    1 => true,
                    b => return Err(r.err(format!("bad automatic flag {b}"))),
                };
                MemberOp::Promote { id, automatic }
            }
            t => return Err(r.err(format!("unknown operation tag {t}"))),
        };
        r.finish()?;
        Ok(op)
    }
}

fn put_str(w: &mut Vec<u8>, s: &str) {
    w.extend_from_slice(&(s.len() as u32).to_le_bytes());
    w.extend_from_slice(s.as_bytes());
}

fn put_urls(w: &mut Vec<u8>, urls: &[String]) {
    w.extend_from_slice(&(urls.len() as u32).to_le_bytes());
    for u in urls {
        put_str(w, u);
    }
}

fn seal(mut w: Vec<u8>) -> Vec<u8> {
    let crc = crc32fast::hash(&w);
    w.extend_from_slice(&crc.to_le_bytes());
    w
}

/// Checks the CRC and that the version is one of `MEMBER_FORMAT..=newest`; returns the
/// version and the bytes between it and the CRC.
fn unseal<'a>(
    what: &'static str,
    bytes: &'a [u8],
    newest: u8,
) -> Result<(u8, &'a [u8]), MembershipError> {
    let err = |reason: String| MembershipError::Decode { what, reason };
    if bytes.len() < 5 {
        return Err(err(format!("{} bytes is too short", bytes.len())));
    }
    let (data, crc) = bytes.split_at(bytes.len() - 4);
    let stored = u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]);
    let actual = crc32fast::hash(data);
    if stored != actual {
        return Err(err(format!(
            "checksum mismatch: stored {stored:08x}, computed {actual:08x}"
        )));
    }
    if !(MEMBER_FORMAT..=newest).contains(&data[0]) {
        let reads = if newest == MEMBER_FORMAT {
            format!("{MEMBER_FORMAT}")
        } else {
            format!("{MEMBER_FORMAT} to {newest}")
        };
        return Err(err(format!(
            "unknown version {} (this build reads {reads})",
            data[0]
        )));
    }
    Ok((data[0], &data[1..]))
}

struct Reader<'a> {
    what: &'static str,
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn new(what: &'static str, buf: &'a [u8]) -> Reader<'a> {
        Reader { what, buf, pos: 0 }
    }

    fn err(&self, reason: String) -> MembershipError {
        MembershipError::Decode {
            what: self.what,
            reason: format!("at byte {}: {reason}", self.pos + 1),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], MembershipError> {
        if self.buf.len() - self.pos < n {
            return Err(self.err(format!(
                "needs {n} more bytes, {} left",
                self.buf.len() - self.pos
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, MembershipError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, MembershipError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, MembershipError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn string(&mut self, max: usize) -> Result<String, MembershipError> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(self.err(format!("string of {len} bytes exceeds {max}")));
        }
        let b = self.take(len)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.err("string is not UTF-8".into()))
    }

    fn urls(&mut self) -> Result<Vec<String>, MembershipError> {
        let n = self.u32()? as usize;
        if n > MAX_URLS {
            return Err(self.err(format!("{n} URLs exceeds {MAX_URLS}")));
        }
        (0..n).map(|_| self.string(MAX_URL_BYTES)).collect()
    }

    fn finish(&self) -> Result<(), MembershipError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(self.err(format!("{} trailing bytes", self.buf.len() - self.pos)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: u64, learner: bool) -> Member {
        Member {
            id,
            name: format!("m{id}"),
            peer_urls: vec![format!("http://10.0.0.{id}:2380")],
            client_urls: vec![format!("http://10.0.0.{id}:2379")],
            is_learner: learner,
        }
    }

    #[test]
    fn member_round_trips_and_rejects_every_corruption() {
        let m = member(0xa826_6ecf_0316_71f3, true);
        let bytes = m.encode();
        assert_eq!(Member::decode(&bytes), Ok(m.clone()));
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            assert!(Member::decode(&b).is_err(), "flip at byte {i} accepted");
        }
        for n in 0..bytes.len() {
            assert!(Member::decode(&bytes[..n]).is_err(), "prefix {n} accepted");
        }
    }

    /// `m` encoded by hand as the module docs lay a member out, with `version` and `flags`
    /// as given: independent of the encoder, as a build before version 2 wrote it.
    fn by_hand(version: u8, flags: u8, m: &Member) -> Vec<u8> {
        let mut w = vec![version, flags];
        w.extend_from_slice(&m.id.to_le_bytes());
        let s = |w: &mut Vec<u8>, s: &str| {
            w.extend_from_slice(&(s.len() as u32).to_le_bytes());
            w.extend_from_slice(s.as_bytes());
        };
        s(&mut w, &m.name);
        for urls in [&m.peer_urls, &m.client_urls] {
            w.extend_from_slice(&(urls.len() as u32).to_le_bytes());
            for u in urls {
                s(&mut w, u);
            }
        }
        let crc = crc32fast::hash(&w);
        w.extend_from_slice(&crc.to_le_bytes());
        w
    }

    #[test]
    fn listed_members_of_both_versions_are_read_and_version_2_is_written_only_when_held() {
        let learner = member(7, true);
        let voter = member(8, false);
        // Version 1, as every store written before version 2 holds it: read, never held,
        // and still what a member that is not held is written as.
        for m in [&learner, &voter] {
            let v1 = by_hand(1, u8::from(m.is_learner), m);
            assert_eq!(m.encode(), v1);
            assert_eq!(m.encode_listed(false), v1);
            assert_eq!(Member::decode_listed(&v1), Ok((m.clone(), false)));
            assert_eq!(Member::decode(&v1), Ok(m.clone()));
        }
        // Version 2: a held learner, flags bits 0 and 1.
        let v2 = by_hand(2, 0b11, &learner);
        assert_eq!(learner.encode_listed(true), v2);
        assert_eq!(Member::decode_listed(&v2), Ok((learner.clone(), true)));
        assert_eq!(
            Member::decode(&v2),
            Ok(learner.clone()),
            "read without its hold"
        );
        assert_eq!(
            Member::decode_listed(&by_hand(2, 0b01, &learner)),
            Ok((learner.clone(), false))
        );
        for i in 0..v2.len() {
            let mut b = v2.clone();
            b[i] ^= 0x40;
            assert!(
                Member::decode_listed(&b).is_err(),
                "flip at byte {i} accepted"
            );
        }
        let refused = [
            (
                by_hand(1, 0b11, &learner),
                "unknown flags 0x3 in a version 1 encoding",
            ),
            (
                by_hand(2, 0b111, &learner),
                "unknown flags 0x7 in a version 2 encoding",
            ),
            (by_hand(2, 0b10, &voter), "only a learner is held"),
            (
                by_hand(3, 0b01, &learner),
                "unknown version 3 (this build reads 1 to 2)",
            ),
            (
                by_hand(0, 0b01, &learner),
                "unknown version 0 (this build reads 1 to 2)",
            ),
        ];
        for (bytes, text) in refused {
            let e = Member::decode_listed(&bytes).expect_err(text);
            assert!(e.to_string().contains(text), "{e} does not say {text:?}");
        }
        // A member operation is version 1 only, its member's flags bit 0 only.
        let op = MemberOp::Add(learner.clone()).encode();
        let mut v2_op = op[..op.len() - 4].to_vec();
        v2_op[0] = LISTED_MEMBER_FORMAT;
        let e = MemberOp::decode(&seal(v2_op)).expect_err("version 2 operation");
        assert!(e.to_string().contains("this build reads 1)"), "{e}");
        let mut held_op = op[..op.len() - 4].to_vec();
        held_op[2] = 0b11;
        let e = MemberOp::decode(&seal(held_op)).expect_err("held flag in an operation");
        assert!(e.to_string().contains("unknown flags 0x3"), "{e}");
    }

    #[test]
    fn huge_lengths_are_refused_before_allocating() {
        let mut w = vec![MEMBER_FORMAT, 0];
        w.extend_from_slice(&7u64.to_le_bytes());
        w.extend_from_slice(&u32::MAX.to_le_bytes());
        let bytes = seal(w);
        let e = Member::decode(&bytes).unwrap_err();
        assert!(e.to_string().contains("exceeds"), "{e}");
    }

    #[test]
    fn ops_round_trip() {
        let ops = [
            MemberOp::Add(member(3, false)),
            MemberOp::Remove(9),
            MemberOp::UpdatePeerUrls {
                id: 4,
                peer_urls: vec!["http://a:1".into(), "http://b:2".into()],
            },
            MemberOp::Promote {
                id: 5,
                automatic: true,
            },
        ];
        for op in ops {
            assert_eq!(MemberOp::decode(&op.encode()), Ok(op.clone()));
        }
        let mut bad = MemberOp::Remove(1).encode();
        bad[0] = 9;
        assert!(MemberOp::decode(&bad).is_err());
    }

    #[test]
    fn changes_follow_the_operation() {
        assert_eq!(
            MemberOp::Add(member(3, true)).proposed_change(),
            Some(ProposedChange::AddLearner(3))
        );
        assert_eq!(
            MemberOp::Add(member(3, false)).proposed_change(),
            Some(ProposedChange::AddVoter(3))
        );
        assert_eq!(
            MemberOp::Promote {
                id: 3,
                automatic: false
            }
            .proposed_change(),
            Some(ProposedChange::Promote(3))
        );
        assert_eq!(
            MemberOp::Remove(3).proposed_change(),
            Some(ProposedChange::Remove(3))
        );
        assert_eq!(
            MemberOp::UpdatePeerUrls {
                id: 3,
                peer_urls: vec![]
            }
            .proposed_change(),
            None
        );
    }

    #[test]
    fn random_ids_avoid_taken_ones_and_zero() {
        for _ in 0..100 {
            let m = Member::with_random_id("x", vec!["http://x:1".into()], vec![], false, |id| {
                id % 2 == 0
            });
            assert_eq!(m.id % 2, 1);
        }
    }

    #[test]
    fn validation_refuses_bad_members() {
        assert!(member(1, false).validate().is_ok());
        assert!(member(0, false).validate().is_err());
        let mut m = member(1, false);
        m.peer_urls.clear();
        assert!(m.validate().is_err());
        let mut m = member(1, false);
        m.name = "n".repeat(MAX_NAME_BYTES + 1);
        assert!(m.validate().is_err());
    }
}
