//! Buckets as key prefixes inside LMDB's one unnamed database.
//!
//! A key `k` of bucket `name` is stored as `name | 0x00 | k`. Bucket names are ASCII letters,
//! digits, `_` and `-` (never `0x00`), so:
//!
//! - the keys of one bucket are contiguous and in the order of `k`;
//! - buckets follow each other in name order (`"ab" | 0x00` sorts before `"abc" | 0x00`
//!   because `0x00` is below every name byte);
//! - the first stored key at or after `name | 0x01` belongs to the next bucket.
//!
//! Stored keys starting with `0x00` are reserved for the backend itself (no bucket name
//! starts with it): [`COMMIT_STAMP`] is the only one.
//!
//! LMDB limits a stored key to [`Env::max_key_size`](heed::Env::max_key_size) bytes (511 in
//! the default build), so a bucket's keys can be at most `511 - name length - 1` bytes. Range
//! bounds may be longer than that: [`range_bounds`] rewrites them into equivalent bounds LMDB
//! accepts.

use std::ops::Bound;

use keel_mvcc::Bucket;

/// Reserved key whose value is the LMDB transaction id (`u64`, big-endian) of the commit that
/// wrote it; every commit rewrites it, so a snapshot states which commit it is.
pub const COMMIT_STAMP: &[u8] = b"\x00commit";

/// The smallest stored key that can belong to a bucket.
pub const FIRST_BUCKET_KEY: &[u8] = &[0x01];

/// Separator between the bucket name and the key.
pub const SEPARATOR: u8 = 0x00;

/// Length of the prefix `name | 0x00` of `bucket`'s keys.
pub fn prefix_len(bucket: &Bucket) -> usize {
    bucket.name().len() + 1
}

/// Writes `bucket | 0x00 | key` into `out`, replacing its content.
pub fn encode_into(bucket: &Bucket, key: &[u8], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(prefix_len(bucket) + key.len());
    out.extend_from_slice(bucket.name().as_bytes());
    out.push(SEPARATOR);
    out.extend_from_slice(key);
}

/// The longest key `bucket` can hold when stored keys are at most `max_stored` bytes.
pub fn max_key_len(bucket: &Bucket, max_stored: usize) -> usize {
    max_stored.saturating_sub(prefix_len(bucket))
}

/// The bucket name at the front of a stored key, or `None` if the key has no separator.
pub fn bucket_of(stored: &[u8]) -> Option<&[u8]> {
    let at = stored.iter().position(|&b| b == SEPARATOR)?;
    Some(&stored[..at])
}

/// The smallest stored key after every key of the bucket named `name`.
pub fn after_bucket(name: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(name.len() + 1);
    out.extend_from_slice(name);
    out.push(SEPARATOR + 1);
    out
}

/// Lower and upper bounds on stored keys.
pub type StoredRange = (Bound<Vec<u8>>, Bound<Vec<u8>>);

/// Stored-key bounds equivalent to the user range `[start, end)` of `bucket`, or `None` when
/// the range is empty.
///
/// No stored key is longer than `max_stored`, so a bound longer than that is cut to
/// `max_stored` bytes `c`: for keys of at most `max_stored` bytes, `k >= start` holds exactly
/// when `k > c`, and `k < end` exactly when `k <= c`.
pub fn range_bounds(
    bucket: &Bucket,
    start: &[u8],
    end: Option<&[u8]>,
    max_stored: usize,
) -> Option<StoredRange> {
    if end.is_some_and(|end| start >= end) {
        return None;
    }
    let mut lower = Vec::new();
    encode_into(bucket, start, &mut lower);
    let lower = if lower.len() > max_stored {
        lower.truncate(max_stored);
        Bound::Excluded(lower)
    } else {
        Bound::Included(lower)
    };
    let upper = match end {
        None => Bound::Excluded(after_bucket(bucket.name().as_bytes())),
        Some(end) => {
            let mut upper = Vec::new();
            encode_into(bucket, end, &mut upper);
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
    fn bucket_order_follows_name_order() {
        let names = ["0", "B", "a", "a-b", "a_b", "aa", "ab", "abc", "b"];
        let mut stored: Vec<(Vec<u8>, &str)> = Vec::new();
        for name in names {
            let bucket = Bucket::from_name(name.to_owned()).unwrap();
            for key in [&b""[..], b"\x00", b"\xFF\xFF", b"zz"] {
                let mut out = Vec::new();
                encode_into(&bucket, key, &mut out);
                stored.push((out, name));
            }
        }
        stored.sort();
        let order: Vec<&str> = stored.iter().map(|(_, n)| *n).collect();
        let mut expected: Vec<&str> = names.iter().flat_map(|n| [*n; 4]).collect();
        expected.sort();
        assert_eq!(order, expected);
        for (key, name) in &stored {
            assert_eq!(bucket_of(key), Some(name.as_bytes()));
            assert!(after_bucket(name.as_bytes()) > *key);
        }
    }

    #[test]
    fn long_bounds_are_cut_to_equivalent_ones() {
        let bucket = Bucket::new("kv");
        let max = 10;
        let long = b"abcdefghij";
        let (lower, upper) = range_bounds(&bucket, long, Some(b"abcdefz"), max).unwrap();
        assert_eq!(lower, Bound::Excluded(b"kv\x00abcdefg".to_vec()));
        assert_eq!(upper, Bound::Excluded(b"kv\x00abcdefz".to_vec()));
        let (lower, upper) = range_bounds(&bucket, b"a", Some(long), max).unwrap();
        assert_eq!(lower, Bound::Included(b"kv\x00a".to_vec()));
        assert_eq!(upper, Bound::Included(b"kv\x00abcdefg".to_vec()));
        assert!(range_bounds(&bucket, b"b", Some(b"a"), max).is_none());
        assert!(range_bounds(&bucket, b"a", Some(b"a"), max).is_none());
        assert_eq!(
            range_bounds(&bucket, b"", None, max).unwrap().1,
            Bound::Excluded(b"kv\x01".to_vec())
        );
    }
}
