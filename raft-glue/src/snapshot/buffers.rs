//! Recycled buffers for the data of incoming snapshot chunks.
//!
//! A transfer's chunks are read from the network into buffers of about
//! `snapshot_chunk_bytes` each, which live until the restore has loaded their bytes. A fresh
//! zeroed allocation per chunk costs the receiving thread the zeroing and, since the
//! allocator gives such large blocks back to the kernel once freed, a page fault and a page
//! clearing for every 4 KiB of the stream (measured on 2 cores: most of the receiving
//! thread's CPU time for a 222 MB transfer). So the receiver takes each chunk's buffer from
//! this process-wide pool ([`take`]) and the restore hands it back once it is done with it
//! ([`give`]): in a steady transfer the same few buffers go round, and their bytes are
//! overwritten by the next chunk without being zeroed first.
//!
//! The pool keeps at most [`POOLED`] buffers of at most [`POOLED_BYTES`] each; others are
//! freed as usual. A buffer's content is never read before it is overwritten: [`take`] only
//! zero-fills bytes beyond what the buffer held before, so whatever it hands out is
//! initialised, and the caller fills all of it.

use parking_lot::Mutex;

/// Buffers kept for reuse at most: enough for the few a steady transfer frees at a time.
pub const POOLED: usize = 8;
/// Larger buffers are not kept.
pub const POOLED_BYTES: usize = 8 << 20;

/// A pool of buffers (see the module doc); the receiver uses the process-wide one through
/// [`take`] and [`give`].
pub struct Pool(Mutex<Vec<Vec<u8>>>);

impl Pool {
    /// An empty pool.
    pub const fn new() -> Pool {
        Pool(Mutex::new(Vec::new()))
    }

    /// A buffer of exactly `len` bytes, whose content is to be overwritten: a recycled one
    /// when the pool has one large enough (only bytes beyond its previous length are
    /// zeroed), else a new zeroed one.
    pub fn take(&self, len: usize) -> Vec<u8> {
        let recycled = {
            let mut pool = self.0.lock();
            pool.iter()
                .rposition(|b| b.capacity() >= len)
                .map(|i| pool.swap_remove(i))
        };
        match recycled {
            Some(mut buf) => {
                if buf.len() > len {
                    buf.truncate(len);
                } else {
                    buf.resize(len, 0);
                }
                buf
            }
            None => vec![0u8; len],
        }
    }

    /// Hands a buffer back for [`take`](Pool::take) to reuse (dropped when the pool is full
    /// or the buffer is too large to keep).
    pub fn give(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > POOLED_BYTES {
            return;
        }
        let mut pool = self.0.lock();
        if pool.len() < POOLED {
            pool.push(buf);
        }
    }
}

impl Default for Pool {
    fn default() -> Pool {
        Pool::new()
    }
}

static POOL: Pool = Pool::new();

/// [`Pool::take`] from the process-wide pool.
pub fn take(len: usize) -> Vec<u8> {
    POOL.take(len)
}

/// [`Pool::give`] to the process-wide pool.
pub fn give(buf: Vec<u8>) {
    POOL.give(buf);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_at_the_length_asked_for() {
        let pool = Pool::new();
        let mut a = pool.take(3000);
        assert_eq!(a.len(), 3000);
        a.fill(7);
        let at = a.as_ptr();
        pool.give(a);
        // The same buffer comes back, cut to the length asked for and not re-zeroed.
        let b = pool.take(1000);
        assert_eq!((b.as_ptr(), b.len()), (at, 1000));
        assert!(b.iter().all(|&x| x == 7), "a recycled buffer was re-zeroed");
        pool.give(b);
        // Grown past what it held: the new bytes are zeros, the old ones are kept.
        let c = pool.take(2000);
        assert_eq!((c.as_ptr(), c.len()), (at, 2000));
        assert!(c[..1000].iter().all(|&x| x == 7) && c[1000..].iter().all(|&x| x == 0));
        pool.give(c);
        // Too small for the request: a new buffer, the small one stays pooled.
        let d = pool.take(5000);
        assert_eq!(d.len(), 5000);
        assert_ne!(d.as_ptr(), at);
        assert_eq!(pool.0.lock().len(), 1);
        // Too large or too many: not kept.
        pool.give(vec![0u8; POOLED_BYTES + 1]);
        assert_eq!(pool.0.lock().len(), 1);
        for _ in 0..2 * POOLED {
            pool.give(vec![0u8; 16]);
        }
        assert_eq!(pool.0.lock().len(), POOLED);
    }
}
