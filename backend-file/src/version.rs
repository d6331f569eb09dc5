//! Index versions: what one read transaction sees.
//!
//! A [`Version`] maps every bucket's keys to the location of their current value ([`Loc`]),
//! and holds the mappings those locations point into. The per-bucket maps are copy-on-write
//! B+trees ([`BucketMap`]): cloning one is O(1), and the writer's changes copy only the nodes
//! they touch (a node already copied in the same commit is changed in place), so publishing a
//! new version per commit costs little, and a version, once published, never changes.

use std::collections::BTreeMap;
use std::sync::Arc;

use keel_mvcc::Bucket;

use crate::format::put_len;
pub(crate) use crate::index::BucketMap;
use crate::segment::SegMap;

/// Where a value lives: `len` bytes at offset `off` of segment `seg`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Loc {
    pub(crate) seg: u32,
    pub(crate) off: u32,
    pub(crate) len: u32,
}

/// An immutable view of the whole store.
#[derive(Clone, Default)]
pub(crate) struct Version {
    /// Every bucket ever declared, by name.
    pub(crate) names: Arc<BTreeMap<Bucket, u32>>,
    /// Per bucket id.
    pub(crate) maps: Vec<BucketMap>,
    /// Id of `segs[0]`.
    pub(crate) base: u32,
    /// Mappings of segments `base..`, one per live segment, with their committed ends.
    pub(crate) segs: Vec<Option<Mapped>>,
}

/// A segment's mapping and its committed end as of one version: the only bytes read.
#[derive(Clone)]
pub(crate) struct Mapped {
    pub(crate) map: Arc<SegMap>,
    pub(crate) end: u64,
}

impl Mapped {
    /// The committed bytes of the segment as of this version.
    pub(crate) fn bytes(&self) -> &[u8] {
        self.map.prefix(self.end).unwrap_or_default()
    }
}

impl Version {
    /// Whether any bucket holds a pair.
    pub(crate) fn holds_pairs(&self) -> bool {
        self.maps.iter().any(|m| !m.is_empty())
    }

    /// The mapping of segment `seg`.
    pub(crate) fn seg(&self, seg: u32) -> Option<&Mapped> {
        let i = seg.checked_sub(self.base)? as usize;
        self.segs.get(i)?.as_ref()
    }

    /// The value bytes at `loc`, `None` if they are not mapped (never for a consistent store).
    pub(crate) fn value(&self, loc: Loc) -> Option<&[u8]> {
        let start = loc.off as usize;
        self.seg(loc.seg)?
            .bytes()
            .get(start..start.checked_add(loc.len as usize)?)
    }
}

/// Live and total bytes of one segment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SegStat {
    pub(crate) size: u64,
    pub(crate) live: u64,
}

/// Applies index changes and keeps the live-byte accounting of segments in step.
pub(crate) struct Applier<'a> {
    pub(crate) maps: &'a mut Vec<BucketMap>,
    pub(crate) stats: &'a mut BTreeMap<u32, SegStat>,
}

impl Applier<'_> {
    fn dead(stats: &mut BTreeMap<u32, SegStat>, key: &[u8], old: Loc) {
        if let Some(s) = stats.get_mut(&old.seg) {
            s.live = s.live.saturating_sub(put_len(key.len(), old.len as usize));
        }
    }

    pub(crate) fn put(&mut self, bucket: u32, key: &[u8], loc: Loc) {
        if let Some(s) = self.stats.get_mut(&loc.seg) {
            s.live += put_len(key.len(), loc.len as usize);
        }
        if let Some(old) = self.maps[bucket as usize].insert(key, loc) {
            Self::dead(self.stats, key, old);
        }
    }

    /// [`put`](Self::put)s each of `entries` into `bucket`, in order, all of them values in
    /// segment `seg`: keys above the bucket's last key are appended a leaf at a time (see
    /// [`BucketMap::extend_sorted`]).
    pub(crate) fn put_sorted<'k>(
        &mut self,
        bucket: u32,
        seg: u32,
        entries: impl IntoIterator<Item = (&'k [u8], Loc)>,
    ) {
        let stats = &mut *self.stats;
        // Added to the segment's live bytes once at the end; the entries a batch replaces in
        // its own segment are taken off after that.
        let (mut live, mut dead_here) = (0, 0);
        self.maps[bucket as usize].extend_sorted(
            entries.into_iter().inspect(|(key, loc)| {
                live += put_len(key.len(), loc.len as usize);
            }),
            |key, old| {
                if old.seg == seg {
                    dead_here += put_len(key.len(), old.len as usize);
                } else {
                    Self::dead(stats, key, old);
                }
            },
        );
        if let Some(s) = stats.get_mut(&seg) {
            s.live = (s.live + live).saturating_sub(dead_here);
        }
    }

    pub(crate) fn delete(&mut self, bucket: u32, key: &[u8]) {
        if let Some(old) = self.maps[bucket as usize].remove(key) {
            Self::dead(self.stats, key, old);
        }
    }

    pub(crate) fn delete_range(&mut self, bucket: u32, start: &[u8], end: Option<&[u8]>) {
        let stats = &mut *self.stats;
        self.maps[bucket as usize].remove_range(start, end, |k, old| Self::dead(stats, k, old));
    }
}
