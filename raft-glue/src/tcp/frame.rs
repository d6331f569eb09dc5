//! The wire format of the TCP transport.
//!
//! Every connection carries a sequence of frames; the first is a hello. All integers are
//! little-endian.
//!
//! ```text
//! frame   = magic:4 ("KLTP") | version:u8 (=1) | kind:u8 | reserved:u16 (=0)
//!           | len:u32 (payload bytes, ≤ max_frame_bytes, checked before allocating)
//!           | crc32:u32 (IEEE, over the 12 header bytes before it, then the payload)
//!           | payload:len
//! kind 1  hello:    from:u64 | path:u8 (1 = Raft messages, 2 = snapshot frames)
//! kind 2  raft:     a raft-rs `eraftpb::Message` in protobuf encoding
//!                   (`protobuf::Message::write_to_bytes`)
//! kind 3  chunk:    from:u64 | to:u64 | transfer:u64 | seq:u32
//!                   | flags:u8 (bit 0: message present, bit 1: end present)
//!                   | [msg_len:u32 | MsgSnapshot in protobuf encoding]
//!                   | [stream_len:u64 | stream_crc32:u32]
//!                   | data_crc32:u32 | data (the rest of the payload)
//! kind 4  ack:      from:u64 | to:u64 | transfer:u64 | has_error:u8 | [len:u32 | UTF-8 reason]
//! ```
//!
//! A frame whose magic, version, kind, length or CRC is wrong ends the connection: after a
//! bad frame the stream cannot be resynchronised safely, and the sender reconnects.
//!
//! A chunk's data is read once on each side: its frame CRC is computed (and checked) by
//! combining the CRC of everything before the data with `data_crc32` (CRC-32 combination,
//! the same value as hashing the whole payload when `data_crc32` is right), and the data
//! itself is checked against `data_crc32` by the snapshot receiver, which aborts the transfer
//! on a mismatch. So a chunk frame is sent as its head followed by the data as it is
//! ([`encode_chunk_head`]), without copying it into the frame.

use protobuf::Message as _;
use raft::eraftpb::Message;

use crate::error::NodeError;
use crate::transport::{SnapshotAck, SnapshotChunk};

/// The first bytes of every frame.
pub const MAGIC: [u8; 4] = *b"KLTP";
/// The format version written and accepted.
pub const VERSION: u8 = 1;
/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 16;

const KIND_HELLO: u8 = 1;
const KIND_RAFT: u8 = 2;
const KIND_CHUNK: u8 = 3;
const KIND_ACK: u8 = 4;

/// Which traffic a connection carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// Raft messages.
    Raft,
    /// Snapshot chunks and acks.
    Snapshot,
}

/// One decoded frame.
#[derive(Clone, Debug)]
pub enum Frame {
    /// Opens a connection.
    Hello {
        /// The sending member.
        from: u64,
        /// What the connection carries.
        path: Path,
    },
    /// A Raft message.
    Raft(Message),
    /// A snapshot chunk.
    Chunk(SnapshotChunk),
    /// A snapshot acknowledgement.
    Ack(SnapshotAck),
}

fn bad(offset: usize, reason: impl Into<String>) -> NodeError {
    NodeError::decode("transport frame", offset, reason)
}

/// Refuses a frame whose payload's checksum (`actual`) is not the header's (`stated`).
fn check_crc(stated: u32, actual: u32) -> Result<(), NodeError> {
    if actual == stated {
        return Ok(());
    }
    Err(bad(
        12,
        format!("checksum mismatch: header says {stated:08x}, payload gives {actual:08x}"),
    ))
}

/// Appends the encoding of `frame` to `out`.
pub fn encode(frame: &Frame, out: &mut Vec<u8>) -> Result<(), NodeError> {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(0);
    out.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    let kind = match frame {
        Frame::Hello { from, path } => {
            out.extend_from_slice(&from.to_le_bytes());
            out.push(match path {
                Path::Raft => 1,
                Path::Snapshot => 2,
            });
            KIND_HELLO
        }
        Frame::Raft(m) => {
            let bytes = m
                .write_to_bytes()
                .map_err(|e| bad(0, format!("cannot encode a raft message: {e}")))?;
            out.extend_from_slice(&bytes);
            KIND_RAFT
        }
        Frame::Chunk(c) => {
            out.truncate(start);
            encode_chunk_head(c, out)?;
            out.extend_from_slice(&c.data);
            return Ok(());
        }
        Frame::Ack(a) => {
            out.extend_from_slice(&a.from.to_le_bytes());
            out.extend_from_slice(&a.to.to_le_bytes());
            out.extend_from_slice(&a.transfer.to_le_bytes());
            match &a.error {
                None => out.push(0),
                Some(e) => {
                    out.push(1);
                    out.extend_from_slice(&(e.len() as u32).to_le_bytes());
                    out.extend_from_slice(e.as_bytes());
                }
            }
            KIND_ACK
        }
    };
    let len = out.len() - start - HEADER_BYTES;
    let len32 = u32::try_from(len).map_err(|_| bad(0, format!("payload of {len} bytes")))?;
    out[start + 5] = kind;
    out[start + 8..start + 12].copy_from_slice(&len32.to_le_bytes());
    let mut h = crc32fast::Hasher::new();
    h.update(&out[start..start + 12]);
    h.update(&out[start + HEADER_BYTES..]);
    let crc = h.finalize();
    out[start + 12..start + 16].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// Appends a chunk frame's header and payload up to its data; the data follows on the wire
/// as it is. The frame CRC covers the data through `c.crc` (see the module doc).
pub fn encode_chunk_head(c: &SnapshotChunk, out: &mut Vec<u8>) -> Result<(), NodeError> {
    let start = out.len();
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(KIND_CHUNK);
    out.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    out.extend_from_slice(&c.from.to_le_bytes());
    out.extend_from_slice(&c.to.to_le_bytes());
    out.extend_from_slice(&c.transfer.to_le_bytes());
    out.extend_from_slice(&c.seq.to_le_bytes());
    let flags = u8::from(c.message.is_some()) | (u8::from(c.end.is_some()) << 1);
    out.push(flags);
    if let Some(m) = &c.message {
        let bytes = m
            .write_to_bytes()
            .map_err(|e| bad(0, format!("cannot encode a snapshot message: {e}")))?;
        out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
        out.extend_from_slice(&bytes);
    }
    if let Some((len, crc)) = c.end {
        out.extend_from_slice(&len.to_le_bytes());
        out.extend_from_slice(&crc.to_le_bytes());
    }
    out.extend_from_slice(&c.crc.to_le_bytes());
    let len = out.len() - start - HEADER_BYTES + c.data.len();
    let len32 = u32::try_from(len).map_err(|_| bad(0, format!("payload of {len} bytes")))?;
    out[start + 8..start + 12].copy_from_slice(&len32.to_le_bytes());
    let mut h = crc32fast::Hasher::new();
    h.update(&out[start..start + 12]);
    h.update(&out[start + HEADER_BYTES..]);
    h.combine(&crc32fast::Hasher::new_with_initial_len(
        c.crc,
        c.data.len() as u64,
    ));
    let crc = h.finalize();
    out[start + 12..start + 16].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// Where a chunk payload's data starts (bounds checked, nothing parsed).
fn chunk_data_offset(payload: &[u8]) -> Result<usize, NodeError> {
    let short = |at: usize| bad(HEADER_BYTES + at, "chunk payload too short");
    match chunk_head(payload) {
        ChunkHead::Need(_) => Err(short(payload.len())),
        ChunkHead::DataAt(pos) if pos > payload.len() => Err(short(payload.len())),
        ChunkHead::DataAt(pos) => Ok(pos),
    }
}

/// Bytes of a chunk payload that are always part of its head: from, to, transfer, seq and
/// flags.
pub const CHUNK_HEAD_MIN: usize = 8 + 8 + 8 + 4 + 1;

/// What the first bytes of a chunk payload say about where its data starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkHead {
    /// The first this many bytes are needed to tell.
    Need(usize),
    /// The data starts at this offset (which may lie beyond the payload: the caller checks).
    DataAt(usize),
}

/// Where the data of the chunk payload starting with `prefix` starts, or how much of the
/// payload is needed to tell: a reader reads a chunk's head first and its data straight into
/// a buffer of its own (see [`is_chunk`] and [`decode_chunk`]).
pub fn chunk_head(prefix: &[u8]) -> ChunkHead {
    let mut pos = CHUNK_HEAD_MIN;
    let Some(&flags) = prefix.get(pos - 1) else {
        return ChunkHead::Need(pos);
    };
    if flags & 1 != 0 {
        let Some(b) = prefix.get(pos..pos + 4) else {
            return ChunkHead::Need(pos + 4);
        };
        let len = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        pos = pos.saturating_add(4).saturating_add(len);
    }
    if flags & 2 != 0 {
        pos = pos.saturating_add(12);
    }
    ChunkHead::DataAt(pos.saturating_add(4))
}

/// True when the frame is a snapshot chunk.
pub fn is_chunk(h: &Header) -> bool {
    h.kind == KIND_CHUNK
}

/// Verifies and decodes a chunk frame read in two parts: `head`, the payload up to its
/// data (as [`chunk_head`] found it), and `data`, the rest, which becomes the chunk's buffer
/// as it is. Same checks as [`decode`].
pub fn decode_chunk(h: &Header, head: &[u8], data: Vec<u8>) -> Result<Frame, NodeError> {
    if !is_chunk(h) || head.len() + data.len() != h.len {
        return Err(bad(0, "not a chunk frame of that length"));
    }
    if chunk_head(head) != ChunkHead::DataAt(head.len()) {
        return Err(bad(HEADER_BYTES, "chunk head of the wrong length"));
    }
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&h.bytes[0..12]);
    hasher.update(head);
    let c = &head[head.len() - 4..];
    let data_crc = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    hasher.combine(&crc32fast::Hasher::new_with_initial_len(
        data_crc,
        data.len() as u64,
    ));
    check_crc(h.crc, hasher.finalize())?;
    let mut frame = parse(h, head, head.len(), |_| Vec::new())?;
    if let Frame::Chunk(c) = &mut frame {
        c.data = data;
    }
    Ok(frame)
}

/// A checked header: the frame's kind, payload length and CRC.
#[derive(Clone, Copy, Debug)]
pub struct Header {
    bytes: [u8; HEADER_BYTES],
    kind: u8,
    /// Payload bytes that follow.
    pub len: usize,
    crc: u32,
}

/// Checks a header before its payload is read (and allocated).
pub fn parse_header(bytes: [u8; HEADER_BYTES], max_payload: usize) -> Result<Header, NodeError> {
    if bytes[0..4] != MAGIC {
        return Err(bad(0, format!("bad magic {:02x?}", &bytes[0..4])));
    }
    if bytes[4] != VERSION {
        return Err(bad(
            4,
            format!("unknown version {} (this build speaks {VERSION})", bytes[4]),
        ));
    }
    let kind = bytes[5];
    if !(KIND_HELLO..=KIND_ACK).contains(&kind) {
        return Err(bad(5, format!("unknown frame kind {kind}")));
    }
    if bytes[6] != 0 || bytes[7] != 0 {
        return Err(bad(6, "reserved bytes are not zero"));
    }
    let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
    if len > max_payload {
        return Err(bad(
            8,
            format!("payload of {len} bytes exceeds the limit of {max_payload}"),
        ));
    }
    let crc = u32::from_le_bytes([bytes[12], bytes[13], bytes[14], bytes[15]]);
    Ok(Header {
        bytes,
        kind,
        len,
        crc,
    })
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], NodeError> {
        if self.buf.len() - self.pos < n {
            return Err(bad(
                HEADER_BYTES + self.pos,
                format!("needs {n} more bytes, {} left", self.buf.len() - self.pos),
            ));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, NodeError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, NodeError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64, NodeError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }
    fn done(&self) -> Result<(), NodeError> {
        if self.pos == self.buf.len() {
            Ok(())
        } else {
            Err(bad(HEADER_BYTES + self.pos, "trailing bytes"))
        }
    }
}

fn parse_message(bytes: &[u8], offset: usize) -> Result<Message, NodeError> {
    Message::parse_from_bytes(bytes).map_err(|e| bad(offset, format!("bad raft message: {e}")))
}

/// Verifies the payload against the header's CRC and decodes the frame.
pub fn decode(h: &Header, payload: &[u8]) -> Result<Frame, NodeError> {
    let data_at = check(h, payload)?;
    parse(h, payload, data_at, |d| d.to_vec())
}

/// [`decode`] taking the payload by value: a chunk's data becomes the chunk's buffer without
/// a copy of its own.
pub fn decode_owned(h: &Header, mut payload: Vec<u8>) -> Result<Frame, NodeError> {
    let data_at = check(h, &payload)?;
    let mut frame = parse(h, &payload, data_at, |_| Vec::new())?;
    if let Frame::Chunk(c) = &mut frame {
        payload.drain(..data_at);
        c.data = payload;
    }
    Ok(frame)
}

/// Checks the frame CRC; returns where a chunk's data starts (the payload's end for other
/// kinds).
fn check(h: &Header, payload: &[u8]) -> Result<usize, NodeError> {
    let mut hasher = crc32fast::Hasher::new();
    hasher.update(&h.bytes[0..12]);
    let data_at = if h.kind == KIND_CHUNK {
        let at = chunk_data_offset(payload)?;
        hasher.update(&payload[..at]);
        let c = &payload[at - 4..at];
        let data_crc = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        hasher.combine(&crc32fast::Hasher::new_with_initial_len(
            data_crc,
            (payload.len() - at) as u64,
        ));
        at
    } else {
        hasher.update(payload);
        payload.len()
    };
    check_crc(h.crc, hasher.finalize())?;
    Ok(data_at)
}

fn parse(
    h: &Header,
    payload: &[u8],
    data_at: usize,
    data: impl FnOnce(&[u8]) -> Vec<u8>,
) -> Result<Frame, NodeError> {
    let mut r = Reader {
        buf: payload,
        pos: 0,
    };
    let frame = match h.kind {
        KIND_HELLO => {
            let from = r.u64()?;
            let path = match r.u8()? {
                1 => Path::Raft,
                2 => Path::Snapshot,
                p => return Err(bad(HEADER_BYTES + 8, format!("unknown path {p}"))),
            };
            Frame::Hello { from, path }
        }
        KIND_RAFT => Frame::Raft(parse_message(r.rest(), HEADER_BYTES)?),
        KIND_CHUNK => {
            let from = r.u64()?;
            let to = r.u64()?;
            let transfer = r.u64()?;
            let seq = r.u32()?;
            let flags = r.u8()?;
            if flags > 3 {
                return Err(bad(
                    HEADER_BYTES + 28,
                    format!("unknown chunk flags {flags:#x}"),
                ));
            }
            let message = if flags & 1 != 0 {
                let len = r.u32()? as usize;
                let at = HEADER_BYTES + r.pos;
                Some(Box::new(parse_message(r.take(len)?, at)?))
            } else {
                None
            };
            let end = if flags & 2 != 0 {
                Some((r.u64()?, r.u32()?))
            } else {
                None
            };
            let crc = r.u32()?;
            debug_assert_eq!(r.pos, data_at);
            let data = data(r.rest());
            Frame::Chunk(SnapshotChunk {
                from,
                to,
                transfer,
                seq,
                message,
                data,
                crc,
                end,
            })
        }
        _ => {
            let from = r.u64()?;
            let to = r.u64()?;
            let transfer = r.u64()?;
            let error = match r.u8()? {
                0 => None,
                1 => {
                    let len = r.u32()? as usize;
                    let b = r.take(len)?;
                    Some(String::from_utf8_lossy(b).into_owned())
                }
                f => return Err(bad(HEADER_BYTES + 24, format!("bad error flag {f}"))),
            };
            Frame::Ack(SnapshotAck {
                from,
                to,
                transfer,
                error,
            })
        }
    };
    r.done()?;
    Ok(frame)
}

#[cfg(test)]
mod tests {
    use super::*;
    use raft::eraftpb::{MessageType, Snapshot};

    fn roundtrip(f: &Frame) -> Frame {
        let mut out = Vec::new();
        encode(f, &mut out).expect("encode");
        let mut hb = [0u8; HEADER_BYTES];
        hb.copy_from_slice(&out[..HEADER_BYTES]);
        let h = parse_header(hb, 1 << 20).expect("header");
        assert_eq!(h.len, out.len() - HEADER_BYTES);
        decode(&h, &out[HEADER_BYTES..]).expect("decode")
    }

    #[test]
    fn every_kind_round_trips() {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgAppend);
        m.from = 1;
        m.to = 2;
        m.term = 7;
        m.commit = 99;
        match roundtrip(&Frame::Raft(m.clone())) {
            Frame::Raft(got) => assert_eq!(got, m),
            other => panic!("{other:?}"),
        }
        let mut sm = Message::default();
        sm.set_msg_type(MessageType::MsgSnapshot);
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = 42;
        sm.set_snapshot(snap);
        let chunk = SnapshotChunk {
            from: 1,
            to: 2,
            transfer: 3,
            seq: 0,
            message: Some(Box::new(sm.clone())),
            data: vec![9; 1000],
            crc: crc32fast::hash(&[9; 1000]),
            end: Some((1000, 0xdead_beef)),
        };
        match roundtrip(&Frame::Chunk(chunk.clone())) {
            Frame::Chunk(c) => {
                assert_eq!(c.message.as_deref(), Some(&sm));
                assert_eq!((c.from, c.to, c.transfer, c.seq), (1, 2, 3, 0));
                assert_eq!(c.data, chunk.data);
                assert_eq!((c.crc, c.end), (chunk.crc, chunk.end));
            }
            other => panic!("{other:?}"),
        }
        let ack = SnapshotAck {
            from: 2,
            to: 1,
            transfer: 3,
            error: Some("bad chunk".into()),
        };
        match roundtrip(&Frame::Ack(ack)) {
            Frame::Ack(a) => assert_eq!((a.transfer, a.error.as_deref()), (3, Some("bad chunk"))),
            other => panic!("{other:?}"),
        }
        match roundtrip(&Frame::Hello {
            from: 5,
            path: Path::Snapshot,
        }) {
            Frame::Hello { from, path } => assert_eq!((from, path), (5, Path::Snapshot)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_flipped_byte_is_rejected() {
        let mut out = Vec::new();
        let ack = SnapshotAck {
            from: 2,
            to: 1,
            transfer: 3,
            error: None,
        };
        encode(&Frame::Ack(ack), &mut out).expect("encode");
        for i in 0..out.len() {
            let mut b = out.clone();
            b[i] ^= 0x01;
            let mut hb = [0u8; HEADER_BYTES];
            hb.copy_from_slice(&b[..HEADER_BYTES]);
            let ok = parse_header(hb, 1 << 20)
                .and_then(|h| {
                    if h.len != b.len() - HEADER_BYTES {
                        return Err(bad(8, "length"));
                    }
                    decode(&h, &b[HEADER_BYTES..])
                })
                .is_ok();
            assert!(!ok, "flip at byte {i} accepted");
        }
    }

    /// A chunk read in two parts (its head as `chunk_head` finds it, then its data into a
    /// buffer of its own), as the receiver reads it.
    fn read_in_two_parts(frame: &[u8]) -> Result<Frame, NodeError> {
        let mut hb = [0u8; HEADER_BYTES];
        hb.copy_from_slice(&frame[..HEADER_BYTES]);
        let h = parse_header(hb, 1 << 20)?;
        let payload = &frame[HEADER_BYTES..];
        if h.len != payload.len() || !is_chunk(&h) {
            return Err(bad(8, "length or kind"));
        }
        let mut have = 0;
        let at = loop {
            match chunk_head(&payload[..have]) {
                ChunkHead::Need(n) if n <= payload.len() => have = n,
                ChunkHead::Need(_) => return Err(bad(8, "short")),
                ChunkHead::DataAt(at) if at <= payload.len() => break at,
                ChunkHead::DataAt(_) => return Err(bad(8, "short")),
            }
        };
        decode_chunk(&h, &payload[..at], payload[at..].to_vec())
    }

    /// A chunk read in two parts decodes as the whole payload does, and is refused alike when
    /// any byte before its data is flipped.
    #[test]
    fn chunks_read_head_then_data_decode_and_check_alike() {
        let data: Vec<u8> = (0..3000u32).map(|i| (i * 13) as u8).collect();
        let mut m = Message::default();
        m.mut_snapshot().mut_metadata().index = 77;
        for (message, end) in [
            (None, None),
            (Some(Box::new(m)), None),
            (None, Some((99u64, 5u32))),
        ] {
            let chunk = SnapshotChunk {
                from: 1,
                to: 2,
                transfer: 3,
                seq: 4,
                message,
                crc: crc32fast::hash(&data),
                data: data.clone(),
                end,
            };
            let mut out = Vec::new();
            encode(&Frame::Chunk(chunk.clone()), &mut out).expect("encode");
            match read_in_two_parts(&out).expect("decode") {
                Frame::Chunk(c) => {
                    assert_eq!(c.data, chunk.data);
                    assert_eq!((c.seq, c.crc, c.end), (4, chunk.crc, chunk.end));
                    assert_eq!(c.message.is_some(), chunk.message.is_some());
                }
                other => panic!("{other:?}"),
            }
            let data_at = out.len() - data.len();
            for i in 0..data_at {
                let mut b = out.clone();
                b[i] ^= 0x01;
                assert!(
                    read_in_two_parts(&b).is_err(),
                    "flip at head byte {i} accepted"
                );
            }
            // A head that claims a different length than it has is refused.
            let mut hb = [0u8; HEADER_BYTES];
            hb.copy_from_slice(&out[..HEADER_BYTES]);
            let h = parse_header(hb, 1 << 20).expect("header");
            let payload = &out[HEADER_BYTES..];
            let at = data_at - HEADER_BYTES;
            assert!(decode_chunk(&h, &payload[..at - 1], payload[at - 1..].to_vec()).is_err());
        }
    }

    /// A chunk frame: any flipped byte before the data fails the frame check; a flipped data
    /// byte passes it but no longer matches the chunk's own CRC, which the receiver checks.
    #[test]
    fn chunk_frames_check_their_head_and_carry_their_data_crc() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let chunk = SnapshotChunk {
            from: 1,
            to: 2,
            transfer: 3,
            seq: 4,
            message: None,
            crc: crc32fast::hash(&data),
            data,
            end: Some((4096, 0x1234_5678)),
        };
        let mut out = Vec::new();
        encode(&Frame::Chunk(chunk.clone()), &mut out).expect("encode");
        // The combined frame CRC equals hashing the whole frame.
        let mut h = crc32fast::Hasher::new();
        h.update(&out[..12]);
        h.update(&out[HEADER_BYTES..]);
        assert_eq!(out[12..16], h.finalize().to_le_bytes());
        let data_at = out.len() - chunk.data.len();
        for i in 0..out.len() {
            let mut b = out.clone();
            b[i] ^= 0x01;
            let mut hb = [0u8; HEADER_BYTES];
            hb.copy_from_slice(&b[..HEADER_BYTES]);
            let got = parse_header(hb, 1 << 20).and_then(|h| {
                if h.len != b.len() - HEADER_BYTES {
                    return Err(bad(8, "length"));
                }
                decode_owned(&h, b[HEADER_BYTES..].to_vec())
            });
            match got {
                Ok(Frame::Chunk(c)) if i >= data_at => {
                    assert_ne!(crc32fast::hash(&c.data), c.crc, "flip at data byte {i}");
                }
                Ok(other) => panic!("flip at byte {i} accepted: {other:?}"),
                Err(_) => assert!(i < data_at, "data flip at {i} must reach the receiver"),
            }
        }
        let mut hb = [0u8; HEADER_BYTES];
        hb.copy_from_slice(&out[..HEADER_BYTES]);
        let h = parse_header(hb, 1 << 20).expect("header");
        match decode_owned(&h, out[HEADER_BYTES..].to_vec()).expect("decode") {
            Frame::Chunk(c) => {
                assert_eq!(c.data, chunk.data);
                assert_eq!((c.seq, c.crc, c.end), (4, chunk.crc, chunk.end));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn oversized_lengths_are_refused_from_the_header() {
        let mut out = Vec::new();
        encode(&Frame::Raft(Message::default()), &mut out).expect("encode");
        out[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        let mut hb = [0u8; HEADER_BYTES];
        hb.copy_from_slice(&out[..HEADER_BYTES]);
        let e = parse_header(hb, 16 << 20).expect_err("refused");
        assert!(e.to_string().contains("exceeds the limit"), "{e}");
    }
}
