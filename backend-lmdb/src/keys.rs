//! What the backend stores besides the caller's pairs, and key bounds LMDB accepts.
//!
//! Every bucket is an LMDB named database of its own, named after the bucket (bucket names
//! are ASCII letters, digits, `_` and `-`, so they are valid database names). A key `k` is
//! stored as `0x00 | k` ([`KEY_MARK`] then the key; LMDB refuses empty keys, the trait allows
//! them), in the order of `k`. Each bucket is one B+tree whose last page receives keys that
//! sort after all others: keys written in ascending order (the MVCC store's revisions) fill pages
//! to the end, as LMDB packs sequential inserts, instead of splitting pages in the middle
//! around the first keys of the next bucket.
//!
//! LMDB's unnamed database holds the record of each named database under its name, plus one
//! key of the backend's own, [`COMMIT_STAMP`] (it starts with `0x00`, which no bucket name
//! does). Its value, 16 bytes, is:
//!
//! ```text
//! offset 0..8    commit id   u64 big-endian: LMDB transaction id of the commit that wrote it
//! offset 8..16   layout id   u64 big-endian: id of the last commit that created a bucket
//!                            database (or of the open that opened them all)
//! ```
//!
//! LMDB limits a stored key to [`Env::max_key_size`](heed::Env::max_key_size) bytes (511 in
//! the default build), so a bucket's keys can be at most one byte shorter. Range bounds may be longer than that: [`range_bounds`] rewrites them
//! into equivalent bounds LMDB accepts.

use std::ops::Bound;

/// Reserved key of the unnamed database; see the module docs for its value.
pub const COMMIT_STAMP: &[u8] = b"\x00commit";

/// The byte in front of every stored key.
pub const KEY_MARK: u8 = 0x00;

/// Bytes stored in front of every key.
pub const MARK_LEN: usize = 1;

/// Writes `0x00 | key` into `out`, replacing its content.
pub fn encode_into(key: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(MARK_LEN + key.len());
    out.push(KEY_MARK);
    out.extend_from_slice(key);
}

/// Length of the commit stamp's value.
pub const STAMP_LEN: usize = 16;

/// The commit stamp's value for commit `id` with layout id `layout`.
pub fn stamp(id: u64, layout: u64) -> [u8; STAMP_LEN] {
    let mut out = [0u8; STAMP_LEN];
    out[..8].copy_from_slice(&id.to_be_bytes());
    out[8..].copy_from_slice(&layout.to_be_bytes());
    out
}

/// The commit id and layout id of a commit stamp's value, or `None` if it is not one.
pub fn parse_stamp(value: &[u8]) -> Option<(u64, u64)> {
    let value: &[u8; STAMP_LEN] = value.try_into().ok()?;
    let (id, layout) = value.split_at(8);
    Some((
        u64::from_be_bytes(id.try_into().ok()?),
        u64::from_be_bytes(layout.try_into().ok()?),
    ))
}

/// Lower and upper bounds on stored keys.
pub type StoredRange = (Bound<Vec<u8>>, Bound<Vec<u8>>);

/// Stored-key bounds equivalent to the key range `[start, end)` (`end = None`: unbounded),
/// or `None` when the range is empty.
///
/// No stored key is longer than `max_stored`, so a bound longer than that is cut to
/// `max_stored` bytes `c`: for keys of at most `max_stored` bytes, `k >= start` holds exactly
/// when `k > c`, and `k < end` exactly when `k <= c`.
pub fn range_bounds(start: &[u8], end: Option<&[u8]>, max_stored: usize) -> Option<StoredRange> {
    if end.is_some_and(|end| start >= end) {
        return None;
    }
    let mut lower = Vec::new();
    encode_into(start, &mut lower);
    let lower = if lower.len() > max_stored {
        lower.truncate(max_stored);
        Bound::Excluded(lower)
    } else {
        Bound::Included(lower)
    };
    let upper = match end {
        None => Bound::Unbounded,
        Some(end) => {
            let mut upper = Vec::new();
            encode_into(end, &mut upper);
            if upper.len() > max_stored {
                upper.truncate(max_stored);
                Bound::Included(upper)
            } else {
                Bound::Excluded(upper)
            }
        }
    };
    Some((lower, upper))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamp_round_trip() {
        let value = stamp(7, 3);
        assert_eq!(parse_stamp(&value), Some((7, 3)));
        assert_eq!(parse_stamp(&value[..8]), None);
        assert!(value[..8] < stamp(8, 0)[..8], "ids compare in byte order");
    }

    #[test]
    fn long_bounds_are_cut_to_equivalent_ones() {
        let max = 10;
        let long = b"abcdefghijkl";
        let (lower, upper) = range_bounds(long, Some(b"abcdefz"), max).unwrap();
        assert_eq!(lower, Bound::Excluded(b"\x00abcdefghi".to_vec()));
        assert_eq!(upper, Bound::Excluded(b"\x00abcdefz".to_vec()));
        let (lower, upper) = range_bounds(b"a", Some(long), max).unwrap();
        assert_eq!(lower, Bound::Included(b"\x00a".to_vec()));
        assert_eq!(upper, Bound::Included(b"\x00abcdefghi".to_vec()));
        assert_eq!(
            range_bounds(b"", None, max).unwrap().0,
            Bound::Included(b"\x00".to_vec())
        );
        assert!(range_bounds(b"b", Some(b"a"), max).is_none());
        assert!(range_bounds(b"a", Some(b"a"), max).is_none());
        assert_eq!(range_bounds(b"", None, max).unwrap().1, Bound::Unbounded);
    }
}
