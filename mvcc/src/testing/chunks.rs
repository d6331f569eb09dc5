//! A snapshot stream handed out in chunks of chosen sizes, the way a network transfer hands
//! it to [`Backend::restore_chunks`](crate::Backend::restore_chunks).

use crate::backend::ChunkSource;

/// Hands out a stream's bytes as chunks of the given sizes, taken in turn (a size of 0 gives
/// an empty chunk), and counts the chunks handed back. Handing back an empty buffer, or more
/// chunks than were handed out, panics.
pub struct ChunkCuts<'a> {
    rest: &'a [u8],
    sizes: Vec<usize>,
    next: usize,
    /// Non-empty chunks handed out so far (an empty one holds no buffer to hand back).
    pub handed: usize,
    /// Chunks handed back so far.
    pub recycled: usize,
}

impl<'a> ChunkCuts<'a> {
    /// Cuts `stream` into chunks of `sizes`, cycled; `sizes` must not be empty.
    pub fn new(stream: &'a [u8], sizes: impl Into<Vec<usize>>) -> ChunkCuts<'a> {
        let sizes = sizes.into();
        assert!(!sizes.is_empty(), "no chunk sizes given");
        ChunkCuts {
            rest: stream,
            sizes,
            next: 0,
            handed: 0,
            recycled: 0,
        }
    }
}

impl ChunkSource for ChunkCuts<'_> {
    fn next_chunk(&mut self) -> Option<Vec<u8>> {
        if self.rest.is_empty() {
            return None;
        }
        let n = self.sizes[self.next % self.sizes.len()].min(self.rest.len());
        self.next += 1;
        let (chunk, rest) = self.rest.split_at(n);
        self.rest = rest;
        self.handed += usize::from(n > 0);
        Some(chunk.to_vec())
    }

    fn recycle(&mut self, chunk: Vec<u8>) {
        assert!(chunk.capacity() > 0, "an empty buffer handed back");
        assert!(
            self.recycled < self.handed,
            "more chunks handed back than handed out"
        );
        self.recycled += 1;
    }
}
