//! Member-to-member control messages that ride the Raft message path.
//!
//! Some traffic between members is not Raft: a follower forwarding a membership request to
//! the leader, the leader refusing it, a learner reporting its applied index (the promotion
//! gate needs it), and a member telling a removed member that it was removed. These travel
//! as Raft `Message`s of type `MsgPropose` (a type raft-rs never sends between members)
//! whose `context` holds the control frame below; the receiving node takes them out before
//! raft-rs sees them.
//!
//! # Encoding (version 1)
//!
//! ```text
//! context = magic "keelctl" | version:u8 (=1) | kind:u8 | body | crc32:u32 LE (of everything before)
//! kind 1 forward   origin:u64 LE | seq:u64 LE | member operation (MemberOp encoding)
//! kind 2 refused   seq:u64 LE | error text (UTF-8, the rest)
//! kind 3 applied   index:u64 LE
//! kind 4 removed   (empty)
//! ```

use raft::eraftpb::{Message, MessageType};

use crate::membership::MemberOp;

const MAGIC: &[u8; 7] = b"keelctl";
const VERSION: u8 = 1;

/// One control frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Control {
    /// A membership request made on a follower, for the leader to check and propose.
    Forward {
        /// The member whose caller waits.
        origin: u64,
        /// The caller's request number on `origin`.
        seq: u64,
        /// The operation.
        op: MemberOp,
    },
    /// The leader refused a forwarded request.
    Refused {
        /// The caller's request number on the receiving member.
        seq: u64,
        /// Why, as the error's text.
        error: String,
    },
    /// The sender's applied index (learners report it to the leader).
    Applied {
        /// Highest index the sender applied to its store.
        index: u64,
    },
    /// The receiver was removed from the cluster.
    Removed,
}

impl Control {
    /// Wraps the frame in a message from `from` to `to`.
    pub(crate) fn to_message(&self, from: u64, to: u64) -> Message {
        let mut w = MAGIC.to_vec();
        w.push(VERSION);
        match self {
            Control::Forward { origin, seq, op } => {
                w.push(1);
                w.extend_from_slice(&origin.to_le_bytes());
                w.extend_from_slice(&seq.to_le_bytes());
                w.extend_from_slice(&op.encode());
            }
            Control::Refused { seq, error } => {
                w.push(2);
                w.extend_from_slice(&seq.to_le_bytes());
                w.extend_from_slice(error.as_bytes());
            }
            Control::Applied { index } => {
                w.push(3);
                w.extend_from_slice(&index.to_le_bytes());
            }
            Control::Removed => w.push(4),
        }
        let crc = crc32fast::hash(&w);
        w.extend_from_slice(&crc.to_le_bytes());
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgPropose);
        m.from = from;
        m.to = to;
        m.context = w.into();
        m
    }

    /// The control frame in `m`, if it carries one (a malformed frame is `None`: dropped).
    pub(crate) fn from_message(m: &Message) -> Option<Control> {
        if m.get_msg_type() != MessageType::MsgPropose {
            return None;
        }
        let b: &[u8] = m.context.as_ref();
        if b.len() < MAGIC.len() + 6 || &b[..MAGIC.len()] != MAGIC {
            return None;
        }
        let (data, crc) = b.split_at(b.len() - 4);
        if crc32fast::hash(data).to_le_bytes() != crc {
            return None;
        }
        let data = &data[MAGIC.len()..];
        if data[0] != VERSION {
            return None;
        }
        let body = &data[2..];
        let u64_at = |at: usize| -> Option<u64> {
            let s = body.get(at..at + 8)?;
            let mut a = [0u8; 8];
            a.copy_from_slice(s);
            Some(u64::from_le_bytes(a))
        };
        match data[1] {
            1 => Some(Control::Forward {
                origin: u64_at(0)?,
                seq: u64_at(8)?,
                op: MemberOp::decode(body.get(16..)?).ok()?,
            }),
            2 => Some(Control::Refused {
                seq: u64_at(0)?,
                error: String::from_utf8_lossy(body.get(8..)?).into_owned(),
            }),
            3 if body.len() == 8 => Some(Control::Applied { index: u64_at(0)? }),
            4 if body.is_empty() => Some(Control::Removed),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_corruption_is_dropped() {
        let frames = vec![
            Control::Forward {
                origin: 3,
                seq: 77,
                op: MemberOp::Remove(9),
            },
            Control::Refused {
                seq: 5,
                error: "member not found".into(),
            },
            Control::Applied { index: 1234 },
            Control::Removed,
        ];
        for f in frames {
            let m = f.to_message(1, 2);
            assert_eq!((m.from, m.to), (1, 2));
            assert_eq!(Control::from_message(&m), Some(f.clone()));
            let mut bad = m.clone();
            let mut ctx = bad.context.to_vec();
            let n = ctx.len();
            ctx[n - 5] ^= 0x40;
            bad.context = ctx.into();
            assert_eq!(Control::from_message(&bad), None, "{f:?}");
        }
        let mut plain = Message::default();
        plain.set_msg_type(MessageType::MsgHeartbeat);
        assert_eq!(Control::from_message(&plain), None);
    }
}
