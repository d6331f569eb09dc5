//! Keys as the in-memory index holds them: short keys inline, long keys shared.
//!
//! keel's hottest bucket is keyed by 17-byte revisions, so keys up to [`INLINE`] bytes (revisions, and the 24-byte keys of common benchmarks) live
//! inside the index node itself: comparing them touches no other cache line and copying an
//! index node (copy-on-write, once per node per commit) allocates nothing for them.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::sync::Arc;

/// Longest key stored inline.
pub(crate) const INLINE: usize = 30;

/// An index key: compares, hashes and borrows as its bytes.
#[derive(Clone)]
pub(crate) enum Key {
    /// `len` bytes in `bytes`.
    Inline { len: u8, bytes: [u8; INLINE] },
    /// A longer key.
    Heap(Arc<[u8]>),
}

impl Key {
    pub(crate) fn new(key: &[u8]) -> Key {
        if key.len() <= INLINE {
            let mut bytes = [0u8; INLINE];
            bytes[..key.len()].copy_from_slice(key);
            Key::Inline {
                len: key.len() as u8,
                bytes,
            }
        } else {
            Key::Heap(Arc::from(key))
        }
    }

    pub(crate) fn as_bytes(&self) -> &[u8] {
        match self {
            Key::Inline { len, bytes } => &bytes[..*len as usize],
            Key::Heap(b) => b,
        }
    }
}

impl Borrow<[u8]> for Key {
    fn borrow(&self) -> &[u8] {
        self.as_bytes()
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for Key {}

impl PartialOrd for Key {
    fn partial_cmp(&self, other: &Key) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Key {
    fn cmp(&self, other: &Key) -> Ordering {
        self.as_bytes().cmp(other.as_bytes())
    }
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Key({:?})", self.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inline_and_heap_keys_order_as_bytes() {
        let keys: Vec<Vec<u8>> = vec![
            vec![],
            vec![0],
            vec![1; 30],
            vec![1; 31],
            vec![2],
            vec![255; 40],
        ];
        for a in &keys {
            for b in &keys {
                assert_eq!(Key::new(a).cmp(&Key::new(b)), a.cmp(b), "{a:?} vs {b:?}");
                assert_eq!(Key::new(a).as_bytes(), &a[..]);
            }
        }
        assert_eq!(std::mem::size_of::<Key>(), 32);
    }
}
