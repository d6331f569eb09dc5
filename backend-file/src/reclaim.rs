//! Giving space back: copying live records forward and dropping whole segments.
//!
//! A pass collects a *prefix* of the segments, all ids below some `floor`: it walks a
//! snapshot of the index in key order and, in steps of about `reclaim_step_bytes`, copies
//! every entry that still points below the floor into the active segment as an ordinary
//! durable frame. Between steps the writer lock is released, so commits wait for at most one
//! step. Then it writes the new floor to META, drops the segments from the index and marks
//! their files dead; each file is removed once the last read transaction mapping it ends.
//!
//! Why a prefix: a delete record only matters while an older put of the same key may still
//! be replayed. Once every segment below the floor is gone, no delete record among them can
//! matter, so they are dropped instead of copied; collecting a segment out of order could
//! resurrect a deleted key. Until META moves, the old segments are still replayed on open,
//! and the copies replay after them with identical values, so a crash at any point of a pass
//! leaves the same data.
//!
//! Which prefix: the one that frees the most dead bytes net of the live bytes it copies; keel
//! writes ever-growing revision keys and compacts the oldest revisions in bulk, so the oldest
//! segments are the emptiest and the copy is small. When no prefix frees more than it copies,
//! all sealed segments are collected (the pass only starts once dead bytes exceed a ratio of
//! the live ones, which bounds the copying per byte written).

use std::sync::mpsc::{RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use keel_mvcc::BackendError;

use crate::format;
use crate::recovery;
use crate::store::Inner;
use crate::version::Loc;

/// How often the reclaimer looks without being nudged.
const IDLE_CHECK: Duration = Duration::from_secs(1);

/// Starts the background reclaimer; dropping the sender stops it.
pub(crate) fn spawn(inner: &Arc<Inner>) -> Result<(SyncSender<()>, JoinHandle<()>), BackendError> {
    let (tx, rx) = sync_channel::<()>(1);
    let weak: Weak<Inner> = Arc::downgrade(inner);
    let handle = std::thread::Builder::new()
        .name("keel-file-reclaim".into())
        .spawn(move || {
            loop {
                match rx.recv_timeout(IDLE_CHECK) {
                    Ok(()) | Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
                let Some(inner) = weak.upgrade() else { return };
                if let Err(e) = inner.reclaim_if_needed() {
                    tracing::warn!(error = %e, "background reclaim failed");
                }
            }
        })
        .map_err(|e| BackendError::io(&inner.dir, "spawn reclaimer thread", e))?;
    Ok((tx, handle))
}

impl Inner {
    /// One pass if the dead bytes in sealed segments cross the configured threshold.
    pub(crate) fn reclaim_if_needed(&self) -> Result<bool, BackendError> {
        let _pass = self.reclaim_lock.lock();
        let floor = {
            let w = self.writer.lock();
            if w.poisoned.is_some() || self.restoring.lock().is_some() {
                // A restore owns the active segment until it ends (its direct writes may
                // hold the block the next frame would start in).
                return Ok(false);
            }
            let (dead, live) = w.garbage();
            if !self.should_reclaim(dead, live) {
                return Ok(false);
            }
            // Best prefix of the sealed segments.
            let active = w.active.seg.id;
            let (mut best, mut best_gain) = (None, 0i128);
            let (mut gain, mut last) = (0i128, None);
            for (&id, s) in w.stats.range(..active) {
                gain += i128::from(s.size.saturating_sub(s.live)) - i128::from(s.live);
                last = Some(id);
                if gain > best_gain {
                    best = Some(id);
                    best_gain = gain;
                }
            }
            match best.or(last) {
                Some(id) => id + 1,
                None => return Ok(false),
            }
        };
        self.collect_below(floor)?;
        Ok(true)
    }

    /// Rewrites every live record into a new segment and drops all older ones.
    pub(crate) fn defragment(&self) -> Result<(), BackendError> {
        let _pass = self.reclaim_lock.lock();
        let floor = {
            let mut w = self.writer.lock();
            Self::check_poison(&w)?;
            if !w.active.fresh {
                self.roll(&mut w)?;
            }
            w.active.seg.id
        };
        self.collect_below(floor)?;
        // The files shrink to the live data: the space prepared ahead goes too.
        let w = self.writer.lock();
        self.prep.trim(w.active.end);
        Ok(())
    }

    /// Copies every live record of segments below `floor` forward, then drops them.
    fn collect_below(&self, floor: u32) -> Result<(), BackendError> {
        let snapshot = self.published.read().clone();
        if floor <= snapshot.base {
            return Ok(());
        }
        let step = self.options.reclaim_step_bytes as usize;
        let mut copied = 0u64;
        for (bucket, map) in snapshot.maps.iter().enumerate() {
            let bucket = bucket as u32;
            let mut entries = map.iter().filter(|(_, loc)| loc.seg < floor).peekable();
            while entries.peek().is_some() {
                let mut w = self.writer.lock();
                self.begin_frame(&mut w, step as u64)?;
                let mut buf = std::mem::take(&mut w.buf);
                let mut batch: Vec<(&[u8], Loc, u64)> = Vec::new();
                while buf.len() < step {
                    let Some((key, old)) = entries.next() else {
                        break;
                    };
                    // Still live? Commits since the snapshot may have replaced or deleted it.
                    if w.version.maps[bucket as usize].get(key) != Some(&old) {
                        continue;
                    }
                    let value = snapshot.value(old).ok_or_else(|| BackendError::Corrupt {
                        path: self.dir.clone(),
                        offset: u64::from(old.off),
                        reason: format!("live value in segment {} is not mapped", old.seg),
                    })?;
                    let at = format::put_put(&mut buf, bucket, key, value) as u64;
                    batch.push((key, old, at));
                }
                w.buf = buf;
                if batch.is_empty() {
                    continue;
                }
                let start = self.finish_frame(&mut w, true)?;
                let seg = w.active.seg.id;
                for (key, old, at) in batch {
                    let loc = Loc {
                        seg,
                        off: (start + at) as u32,
                        len: old.len,
                    };
                    w.applier().put(bucket, key, loc);
                    copied += format::put_len(key.len(), old.len as usize);
                }
                self.publish(&mut w)?;
            }
        }

        let mut w = self.writer.lock();
        Self::check_poison(&w)?;
        if let Err(e) = recovery::write_meta(&self.dir, &self.io, floor) {
            w.poisoned.get_or_insert_with(|| e.to_string());
            return Err(e);
        }
        let drop_count = (floor - w.version.base) as usize;
        let mut freed = 0u64;
        for map in w.version.segs.drain(..drop_count).flatten() {
            map.map.file.mark_dead();
        }
        w.version.base = floor;
        let dead: Vec<u32> = w.stats.range(..floor).map(|(&id, _)| id).collect();
        for id in dead {
            if let Some(s) = w.stats.remove(&id) {
                freed += s.size;
            }
        }
        *self.published.write() = Arc::new(w.version.clone());
        tracing::debug!(floor, copied, freed, "reclaimed segments");
        Ok(())
    }
}
