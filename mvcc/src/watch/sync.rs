//! The syncer: catches unsynced watchers up from the store, one shared scan per round.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crossbeam_channel::{RecvTimeoutError, TrySendError};

use super::index::{End, Matcher};
use super::{Change, Msg, Part, Pick, RevChanges, Shared, Target, Window};
use crate::backend::Backend;
use crate::error::MvccError;
use crate::kv::{KeyValue, decode_record, decode_record_unchecked};
use crate::read::ReadView;
use crate::request::RangeRequest;
use crate::revision::Revision;
use crate::store::Inner;

/// An unsynced watcher's parameters copied out for one catch-up round.
struct SyncTarget {
    id: u64,
    /// First revision it has not received.
    next: u64,
    key: Arc<[u8]>,
    end: Option<End>,
    prev_kv: bool,
    tx: Target,
    /// Its share of the round, ascending revisions.
    parts: Vec<Part>,
}

/// How long the notifier lets commits gather after dispatching a batch. A writer queueing
/// meanwhile finds it asleep rather than waiting on its wake-up channel, so it pays no
/// wake-up per commit while commits keep coming; events wait at most this much longer.
const NOTIFY_LINGER: Duration = Duration::from_millis(1);

/// The watch threads, until the store shuts down: the notifier (dispatching committed
/// revisions to synced watchers) in a thread of its own, and the syncer (catching unsynced
/// watchers up) in this one.
pub(crate) fn syncer_loop<B: Backend>(inner: &Arc<Inner<B>>) {
    std::thread::scope(|scope| {
        let notifier = std::thread::Builder::new()
            .name("keel-mvcc-notify".into())
            .spawn_scoped(scope, || notifier_loop(inner));
        if let Err(e) = notifier {
            // Writers then dispatch themselves whenever the queue fills.
            tracing::error!(error = %e, "cannot start the watch notifier thread");
        }
        sync_loop(inner);
    });
}

/// The notifier: dispatches what writers queued, a batch at a time.
fn notifier_loop<B: Backend>(inner: &Arc<Inner<B>>) {
    let hub = &inner.watch;
    let stopped =
        || hub.shared.closed.load(Ordering::Acquire) || inner.shutdown.load(Ordering::Acquire);
    loop {
        if stopped() {
            return;
        }
        if hub.queue_is_empty() {
            // Park: announce it, then look again, so a writer queueing in between either
            // is seen here or sees the flag and kicks.
            hub.parked.store(true, Ordering::SeqCst);
            if hub.queue_is_empty() {
                match hub.kick.1.recv_timeout(inner.options.watch_sync_interval) {
                    Ok(()) | Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            hub.parked.store(false, Ordering::SeqCst);
        }
        hub.drain(inner);
        std::thread::sleep(NOTIFY_LINGER);
    }
}

/// The syncer: catches unsynced watchers up until the store shuts down.
fn sync_loop<B: Backend>(inner: &Arc<Inner<B>>) {
    let hub = &inner.watch;
    let stopped =
        || hub.shared.closed.load(Ordering::Acquire) || inner.shutdown.load(Ordering::Acquire);
    loop {
        match hub
            .shared
            .wake
            .1
            .recv_timeout(inner.options.watch_sync_interval)
        {
            Ok(()) | Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        // Keep going while rounds make progress; a round with only full channels waits.
        loop {
            if stopped() {
                return;
            }
            match sync_round(inner) {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "watch catch-up failed; retrying later");
                    break;
                }
            }
        }
    }
}

/// The revision being gathered during a scan: its matched changes and who matched them.
#[derive(Default)]
struct Gather {
    main: u64,
    changes: Vec<Change>,
    /// `(target, change)` pairs.
    hits: Vec<(u32, u32)>,
    /// Per change: the key, and whether a prev_kv watcher matched it.
    keys: Vec<(Vec<u8>, bool)>,
}

/// One catch-up pass; true when some watcher made progress and more work may remain.
fn sync_round<B: Backend>(inner: &Arc<Inner<B>>) -> Result<bool, MvccError> {
    let hub = &inner.watch;
    let view = ReadView::open(inner)?;
    let compacted = inner.compacted.load(Ordering::Acquire);
    let mut targets = Vec::new();
    {
        let mut st = hub.shared.state.lock();
        let mut overtaken = Vec::new();
        for &id in &st.unsynced {
            let Some(w) = st.watchers.get(id) else {
                continue;
            };
            if w.next_rev <= compacted {
                overtaken.push(id);
                continue;
            }
            // A full channel cannot take a batch; its receiver wakes the syncer on draining.
            if w.tx.is_full() {
                continue;
            }
            targets.push(SyncTarget {
                id,
                next: w.next_rev,
                key: w.key.clone(),
                end: w.end.clone(),
                prev_kv: w.prev_kv,
                tx: w.tx.clone(),
                parts: Vec::new(),
            });
        }
        for id in overtaken {
            if let Some(w) = st.remove(id) {
                hub.shared.count.fetch_sub(1, Ordering::AcqRel);
                let error = MvccError::Compacted {
                    requested: w.next_rev,
                    compacted,
                };
                w.ended(id, error);
            }
        }
    }
    if targets.is_empty() {
        return Ok(false);
    }
    let min_next = targets.iter().map(|t| t.next).min().unwrap_or(u64::MAX);
    // A round costs a setup per watcher and a decode per revision: with many watchers
    // behind, read as many revisions as there are watchers, so the setup stays a fraction.
    let span = inner.options.watch_sync_batch.max(targets.len()) as u64;
    let upto = view.revision().min(min_next.saturating_add(span - 1));
    if min_next <= upto {
        let mut matcher = Matcher::default();
        for (i, t) in targets.iter().enumerate() {
            matcher.insert(i as u64, &t.key, t.end.as_ref());
        }
        let mut cur = Gather::default();
        view.sources(None).for_each_change(
            Revision::new(min_next, 0),
            upto,
            |rev, tomb, _, rec| {
                if rev.main != cur.main {
                    flush(inner, &view, &mut cur, &mut targets);
                    cur.main = rev.main;
                }
                let r = decode_record(rev, rec)?;
                let at = cur.changes.len() as u32;
                let mut hit = false;
                let mut want_prev = false;
                matcher.for_each_match(r.key, |ti| {
                    let t = &targets[ti as usize];
                    if t.next <= rev.main {
                        cur.hits.push((ti as u32, at));
                        hit = true;
                        want_prev |= t.prev_kv;
                    }
                });
                if hit {
                    cur.keys.push((
                        if want_prev {
                            r.key.to_vec()
                        } else {
                            Vec::new()
                        },
                        want_prev,
                    ));
                    cur.changes.push(Change {
                        tombstone: tomb,
                        record: rec.into(),
                        prev: None,
                    });
                }
                Ok(true)
            },
        )?;
        flush(inner, &view, &mut cur, &mut targets);
    }
    // The compaction point read above is older than the backend read transactions the scan
    // used, and the compactor does not wait for this view (it reads at the current revision,
    // at or above any compaction point), so a compaction may have deleted part of what the
    // scan read. Read the point again now that the scan is done: a compaction's deletions
    // follow its `compacted` store (the compactor takes the job after `compact` stored it,
    // and commits through the backend, which every read transaction opened later sees), so
    // if the scan saw any deletion of a compaction at `c`, this load sees `c` or more. A
    // target whose next revision is above the point read here saw only revisions no
    // compaction up to it deletes, so its share is whole; any other may have been read with
    // holes and ends with `Compacted` instead of getting it.
    let compacted = inner.compacted.load(Ordering::Acquire);
    let mut progressed = false;
    for t in &mut targets {
        if t.next <= compacted {
            t.parts.clear();
            continue;
        }
        if !t.parts.is_empty() {
            let parts = std::mem::take(&mut t.parts);
            let msg = if parts.len() == 1 {
                Msg::One(parts.into_iter().next().expect("one part"))
            } else {
                Msg::Many(parts)
            };
            match t.tx.try_send(t.id, msg) {
                Ok(()) => {}
                // Retried from `t.next` once the receiver made room (or the watcher is gone).
                Err(TrySendError::Full(())) | Err(TrySendError::Disconnected(())) => continue,
            }
        }
        if t.next <= upto {
            t.next = upto + 1;
            progressed = true;
        }
    }
    let mut st = hub.shared.state.lock();
    let last = st.last_notified;
    for t in targets {
        let Some(w) = st.watchers.get_mut(t.id) else {
            continue;
        };
        if w.synced {
            continue;
        }
        if t.next <= compacted {
            if let Some(w) = st.remove(t.id) {
                hub.shared.count.fetch_sub(1, Ordering::AcqRel);
                w.ended(
                    t.id,
                    MvccError::Compacted {
                        requested: t.next,
                        compacted,
                    },
                );
                progressed = true;
            }
            continue;
        }
        w.next_rev = t.next;
        if t.next > last {
            st.set_synced(t.id);
            progressed = true;
        }
    }
    // Writers went past the view: the next round reads on with a newer one.
    Ok(!st.unsynced.is_empty() && (progressed || upto < last))
}

/// Shares the gathered revision with the targets that matched it.
fn flush<B: Backend>(
    inner: &Inner<B>,
    view: &ReadView<B>,
    cur: &mut Gather,
    targets: &mut [SyncTarget],
) {
    if cur.changes.is_empty() {
        return;
    }
    // A write transaction may change a key more than once in its revision: the pair before a
    // later change is the earlier change (none after a delete), as the notifier gives it,
    // not the pair before the revision. Every change of one key in one revision is matched
    // by the same watchers, so the earlier ones are here. `latest` maps a key to its latest
    // change so far (a revision of a delete_range may hold a great many keys).
    let several = cur.changes.len() > 1;
    let mut latest: HashMap<&[u8], usize> = HashMap::new();
    for (i, (key, want_prev)) in cur.keys.iter().enumerate() {
        if !want_prev {
            continue;
        }
        let earlier = if several { latest.insert(key, i) } else { None };
        let prev = match earlier.map(|j| &cur.changes[j]) {
            Some(c) if c.tombstone => None,
            Some(c) => decode_record_unchecked(Revision::new(cur.main, 0), &c.record)
                .ok()
                .map(|r| r.to_kv(true)),
            None => prev_at(inner, view, key.clone(), cur.main),
        };
        cur.changes[i].prev = prev.map(Arc::new);
    }
    cur.keys.clear();
    let total = cur.changes.len();
    let single = match cur.changes.as_slice() {
        [c] if c.prev.is_none() && !cur.hits.iter().any(|h| targets[h.0 as usize].prev_kv) => {
            Window::whole(c.record.clone())
        }
        _ => None,
    };
    let rev = match single {
        Some(one) => {
            cur.changes.clear();
            Shared::One(one)
        }
        None => Shared::Many(Arc::new(RevChanges {
            changes: std::mem::take(&mut cur.changes),
        })),
    };
    cur.hits.sort_unstable();
    for group in cur.hits.chunk_by(|a, b| a.0 == b.0) {
        let t = &mut targets[group[0].0 as usize];
        let pick = if group.len() == total {
            Pick::All
        } else {
            Pick::Some(group.iter().map(|h| h.1).collect())
        };
        t.parts.push(Part {
            rev: rev.clone(),
            pick,
            prev_kv: t.prev_kv,
        });
    }
    cur.hits.clear();
}

/// The pair `key` had just before revision `main`, read through `view`.
fn prev_at<B: Backend>(
    inner: &Inner<B>,
    view: &ReadView<B>,
    key: Vec<u8>,
    main: u64,
) -> Option<KeyValue> {
    let at = main.checked_sub(1).filter(|&r| r > 0)?;
    let req = RangeRequest::key(key).at(at);
    crate::read::range(inner, &view.sources(None), &req, view.revision())
        .ok()?
        .kvs
        .pop()
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::error::MvccError;
    use crate::options::StoreOptions;
    use crate::store::{KEY_BUCKET, mem_store};
    use crate::watch::WatchRequest;

    fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// A catch-up round that read the compaction point just before a compaction, and opens
    /// its backend read transaction after the compactor deleted part of the history it reads,
    /// does not deliver that history with holes: the watcher ends with `Compacted`.
    #[test]
    fn catch_up_racing_a_compaction_ends_the_watcher_with_compacted() {
        let (_d, s) = mem_store(StoreOptions {
            watch_channel_capacity: 1,
            watch_sync_interval: Duration::from_millis(500),
            compaction_sleep_interval: Duration::from_millis(1),
            ..StoreOptions::default()
        });
        let w = s.watch(WatchRequest::key(b"k".to_vec())).unwrap();
        s.put(b"k", b"1", 0).unwrap(); // rev 1: fills the channel of capacity 1
        s.put(b"k", b"2", 0).unwrap(); // rev 2: the watcher turns unsynced from 2
        let hub = &s.inner.watch;
        wait_for("the watcher to fall behind", || {
            hub.shared.state.lock().unsynced.contains(&w.id())
        });
        for i in 3..=10u32 {
            s.put(b"k", i.to_string().as_bytes(), 0).unwrap();
        }
        s.force_commit().unwrap();
        // Stall the syncer's next round right after it read the compaction point (0).
        let held = hub.shared.state.lock();
        let first = w.try_recv().unwrap().expect("rev 1 is in the channel");
        assert_eq!(first[0].mod_revision(), 1);
        // Receiving made room: the syncer's round opens its view (pinned at 10) and reads the
        // compaction point, then waits for the hub lock.
        wait_for("the syncer's view", || s.inner.oldest_view() == Some(10));
        std::thread::sleep(Duration::from_millis(50));
        s.compact(8).unwrap();
        // Revisions 1..=7 of "k" are deleted (the syncer's view at 10 does not hold them back).
        wait_for("physical compaction", || s.backend().len(&KEY_BUCKET) == 3);
        drop(held);
        let mut got = Vec::new();
        loop {
            match w.recv_timeout(Duration::from_secs(2)) {
                Ok(Some(events)) => got.extend(events.iter().map(|e| e.mod_revision())),
                Ok(None) => break,
                Err(MvccError::Compacted { .. }) => {
                    assert!(
                        got.is_empty() || got[0] == 2,
                        "events before the error: {got:?}"
                    );
                    return;
                }
                Err(e) => panic!("{e}"),
            }
        }
        panic!(
            "the watcher from revision 2 received revisions {got:?} and no Compacted error: \
             revisions 2..=7 were lost silently"
        );
    }
}
