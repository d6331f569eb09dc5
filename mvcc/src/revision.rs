//! Revisions and the byte form they take as keys of the `key` bucket.
//!
//! Every change to a key gets a revision `{main, sub}`: `main` is the store revision of the
//! write transaction that made it, `sub` numbers the changes inside that transaction from 0.
//!
//! In the `key` bucket a change is stored under its revision, big-endian so that byte order is
//! revision order (etcd's layout):
//!
//! ```text
//! offset 0..8    main  u64 big-endian
//! offset 8       b'_'
//! offset 9..17   sub   u64 big-endian
//! offset 17      b't'  present only when the change is a deletion (a tombstone)
//! ```

use std::fmt;

/// Length of a revision key without the tombstone mark.
pub const REV_KEY_LEN: usize = 17;
/// The byte appended to a revision key when the change is a deletion.
pub const TOMBSTONE_MARK: u8 = b't';

/// A point in the store's history: `main` is the transaction's revision, `sub` the index of the
/// change inside it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Revision {
    /// The store revision of the write transaction.
    pub main: u64,
    /// The change's position inside that transaction, from 0.
    pub sub: u64,
}

impl Revision {
    /// A revision from its two parts.
    pub const fn new(main: u64, sub: u64) -> Revision {
        Revision { main, sub }
    }

    /// The 17-byte key of this revision, with the tombstone mark appended when `tombstone`.
    pub fn to_key(self, tombstone: bool) -> Vec<u8> {
        let mut key = Vec::with_capacity(REV_KEY_LEN + 1);
        key.extend_from_slice(&self.to_bytes());
        if tombstone {
            key.push(TOMBSTONE_MARK);
        }
        key
    }

    /// The 17 bytes `main | '_' | sub`.
    pub fn to_bytes(self) -> [u8; REV_KEY_LEN] {
        let mut b = [0u8; REV_KEY_LEN];
        b[..8].copy_from_slice(&self.main.to_be_bytes());
        b[8] = b'_';
        b[9..].copy_from_slice(&self.sub.to_be_bytes());
        b
    }

    /// Parses a revision key; returns the revision and whether it marks a tombstone, or `None`
    /// when the bytes are not a revision key.
    pub fn from_key(key: &[u8]) -> Option<(Revision, bool)> {
        let tombstone = match key.len() {
            REV_KEY_LEN => false,
            n if n == REV_KEY_LEN + 1 && key[REV_KEY_LEN] == TOMBSTONE_MARK => true,
            _ => return None,
        };
        if key[8] != b'_' {
            return None;
        }
        let main = u64::from_be_bytes(key[..8].try_into().ok()?);
        let sub = u64::from_be_bytes(key[9..17].try_into().ok()?);
        Some((Revision { main, sub }, tombstone))
    }
}

impl fmt::Display for Revision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.main, self.sub)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_round_trip_and_order() {
        let a = Revision::new(1, 300);
        let b = Revision::new(2, 0);
        assert!(a.to_key(false) < b.to_key(false));
        assert!(a.to_key(true) < b.to_key(false));
        assert_eq!(Revision::from_key(&a.to_key(true)), Some((a, true)));
        assert_eq!(Revision::from_key(&b.to_key(false)), Some((b, false)));
        assert_eq!(Revision::from_key(b"short"), None);
    }
}
