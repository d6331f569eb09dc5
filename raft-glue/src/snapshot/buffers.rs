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

static POOL: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

/// A buffer of exactly `len` bytes, whose content is to be overwritten: a recycled one when
/// the pool has one large enough (only bytes beyond its previous length are zeroed), else a
/// new zeroed one.
pub fn take(len: usize) -> Vec<u8> {
    let recycled = {
        let mut pool = POOL.lock();
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

/// Hands a buffer back for [`take`] to reuse (dropped when the pool is full or the buffer
/// is too large to keep).
pub fn give(buf: Vec<u8>) {
    if buf.capacity() == 0 || buf.capacity() > POOLED_BYTES {
        return;
    }
    let mut pool = POOL.lock();
    if pool.len() < POOLED {
        pool.push(buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_at_the_length_asked_for() {
        // The pool is process-wide: other tests may take from it meanwhile, so only what
        // holds for any buffer handed out is asserted, plus reuse of a uniquely sized one.
        let mut a = take(3000);
        assert_eq!(a.len(), 3000);
        a.fill(7);
        let at = a.as_ptr() as usize;
        give(a);
        let b = take(1000);
        assert_eq!(b.len(), 1000);
        if b.as_ptr() as usize == at {
            assert!(
                b.iter().all(|&x| x == 7),
                "a recycled buffer is not re-zeroed"
            );
        }
        give(b);
        let c = take(5000);
        assert_eq!(c.len(), 5000);
        give(vec![0u8; POOLED_BYTES + 1]);
        assert!(POOL.lock().iter().all(|b| b.capacity() <= POOLED_BYTES));
        assert!(POOL.lock().len() <= POOLED);
    }
}
