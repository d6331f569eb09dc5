//! The full integrity check: every frame of every live segment against its checksum and
//! sequence, every record well formed, and every index entry against the put record it
//! points to.

use keel_mvcc::BackendError;

use crate::format::{self, HEADER_LEN, PUT_HEADER, Records, TAG_PUT, u32_at};
use crate::store::FileBackend;

pub(crate) fn check(backend: &FileBackend) -> Result<(), BackendError> {
    let version = backend.inner.published.read().clone();
    let mut expected_seq: Option<u64> = None;
    for map in version.segs.iter().flatten() {
        let path = &map.map.file.path;
        let bytes = map.bytes();
        let bad = |offset: usize, reason: String| BackendError::Corrupt {
            path: path.clone(),
            offset: offset as u64,
            reason,
        };
        let (id, format_version) = format::decode_segment_header(path, bytes)?;
        if id != u64::from(map.map.file.id) {
            return Err(bad(16, format!("header names segment {id:016x}")));
        }
        let header = format::frame_header_len(format_version);
        let mut at = HEADER_LEN;
        while at < bytes.len() {
            let frame = format::read_frame(&bytes[at..], header).map_err(|why| bad(at, why))?;
            let seq = frame.seq;
            if expected_seq.is_some_and(|e| e != seq) {
                return Err(bad(at, format!("frame sequence {seq} out of order")));
            }
            if frame.durable.is_some_and(|d| d >= seq) {
                return Err(bad(at, format!("frame {seq} claims itself durable")));
            }
            let next = seq
                .checked_add(1)
                .ok_or_else(|| bad(at, format!("frame sequence {seq} is out of range")))?;
            expected_seq = Some(next);
            let mut records = Records::new(frame.payload);
            loop {
                match records.next_record() {
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(why) => return Err(bad(at, why)),
                }
            }
            at += frame.len();
        }
    }
    for (name, &id) in version.names.iter() {
        for (key, loc) in version.maps[id as usize].iter() {
            let bad = |reason: &str| BackendError::Corrupt {
                path: backend.path().join(format!("{:016x}.seg", loc.seg)),
                offset: u64::from(loc.off),
                reason: format!("bucket {name}, key {key:?}: {reason}"),
            };
            let map = version
                .seg(loc.seg)
                .ok_or_else(|| bad("segment not live"))?;
            let value_at = loc.off as usize;
            let rec_at = value_at
                .checked_sub(PUT_HEADER + key.len())
                .ok_or_else(|| bad("value offset before any record"))?;
            let bytes = map.bytes();
            let rec = bytes
                .get(rec_at..value_at + loc.len as usize)
                .ok_or_else(|| bad("record past the committed end"))?;
            if rec[0] != TAG_PUT
                || u32_at(rec, 1) != id
                || u32_at(rec, 5) as usize != key.len()
                || u32_at(rec, 9) != loc.len
                || &rec[PUT_HEADER..PUT_HEADER + key.len()] != key
            {
                return Err(bad("index entry does not match its put record"));
            }
        }
    }
    Ok(())
}
