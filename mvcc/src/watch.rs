//! Watch: streams of changes to a key or range, from a revision on.
//!
//! Every watcher owns a bounded channel ([`StoreOptions::watch_channel_capacity`] responses,
//! one response per revision). A watcher is either *synced* — the committing writer hands it
//! the events of each new revision with a non-blocking send — or *unsynced*: it started in the
//! past, or its channel was full when a writer tried to deliver. Writers never wait for a
//! watcher: a full channel just turns the watcher unsynced, remembering the first revision it
//! missed. The syncer thread then reads the missed revisions back from the store (pending
//! buffers and backend, through a read view), for up to 512 unsynced watchers in one scan of
//! at most [`StoreOptions::watch_sync_batch`] revisions, and moves a watcher back to synced
//! once it has everything up to the last revision writers dispatched. Memory therefore stays
//! bounded by the channels, whatever the consumers do.
//!
//! A [`WatchStream`] multiplexes many watchers onto one bounded channel, like etcd's
//! `watchStream` (its `chanBufLen` is our channel capacity): a consumer of thousands of
//! watchers blocks on one channel instead of polling each, and the store keeps one channel
//! per stream, not per watcher. When the shared channel is full, the watcher that could not
//! deliver turns unsynced exactly like a lone watcher with a full channel, and the syncer
//! catches it up once the consumer made room. Watchers ending (compaction) are queued beside
//! the channel, so that news never waits for room.
//!
//! A watcher whose next revision falls below the compaction point receives
//! [`MvccError::Compacted`] and ends (etcd's "required revision has been compacted").
//!
//! [`StoreOptions::watch_channel_capacity`]: crate::StoreOptions::watch_channel_capacity
//! [`StoreOptions::watch_sync_batch`]: crate::StoreOptions::watch_sync_batch

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError, TrySendError};
use parking_lot::Mutex;

use crate::backend::Backend;
use crate::error::MvccError;
use crate::kv::{KeyValue, decode_record};
use crate::options::StoreOptions;
use crate::pending::Pending;
use crate::read::ReadView;
use crate::request::{RangeRequest, check_range};
use crate::revision::Revision;
use crate::store::Inner;

/// Unsynced watchers caught up per store scan (etcd's `maxWatchersPerSync`).
const WATCHERS_PER_SYNC: usize = 512;

/// What to watch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WatchRequest {
    /// The key (or first key).
    pub key: Vec<u8>,
    /// Range end, with the conventions of [`RangeRequest`].
    pub range_end: Option<Vec<u8>>,
    /// First revision to report; 0 means "changes after the current revision". A past
    /// revision is caught up from the store; it must be above the compaction point.
    pub start_revision: u64,
    /// Attach each change's previous pair to its event.
    pub prev_kv: bool,
}

impl WatchRequest {
    /// Watches one key from the next revision on.
    pub fn key(key: impl Into<Vec<u8>>) -> WatchRequest {
        WatchRequest {
            key: key.into(),
            ..WatchRequest::default()
        }
    }

    /// Watches every key starting with `prefix`.
    pub fn prefix(prefix: impl Into<Vec<u8>>) -> WatchRequest {
        let r = RangeRequest::prefix(prefix);
        WatchRequest {
            key: r.key,
            range_end: r.range_end,
            ..WatchRequest::default()
        }
    }

    /// The same request from `revision` on.
    pub fn from(mut self, revision: u64) -> WatchRequest {
        self.start_revision = revision;
        self
    }
}

/// Kind of change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// A put.
    Put,
    /// A deletion; the event's `kv` holds the key and the deleting revision only.
    Delete,
}

/// One change seen by a watcher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// Put or delete.
    pub kind: EventKind,
    /// The pair after the change.
    pub kv: KeyValue,
    /// The pair before it, when the watch asked for it and the key existed (and was not
    /// compacted away by the time the event was read).
    pub prev_kv: Option<KeyValue>,
}

/// An event read back by the syncer, shared by the watchers it catches up.
#[derive(Clone, Debug)]
struct RawEvent {
    kind: EventKind,
    kv: KeyValue,
}

#[derive(Clone, Debug)]
enum KeyBound {
    Single,
    Until(Vec<u8>),
    Unbounded,
}

struct WatcherState {
    key: Vec<u8>,
    bound: KeyBound,
    prev_kv: bool,
    tx: Target,
    end: Arc<WatchEnd>,
    /// First revision this watcher has not received (for a synced watcher: the lowest
    /// revision it may still receive).
    next_rev: u64,
    synced: bool,
}

impl WatcherState {
    /// Hands `out` to the watcher's channel (its own or its stream's); on a full stream
    /// channel the stream is marked lagging so its consumer wakes the syncer.
    fn try_send(&self, id: u64, out: Vec<Event>) -> Result<(), TrySendError<()>> {
        match &self.tx {
            Target::Own(tx) => tx.try_send(out).map_err(|e| match e {
                TrySendError::Full(_) => TrySendError::Full(()),
                TrySendError::Disconnected(_) => TrySendError::Disconnected(()),
            }),
            Target::Stream(tx, shared) => tx.try_send((id, out)).map_err(|e| match e {
                TrySendError::Full(_) => {
                    shared.lagging.store(true, Ordering::Release);
                    TrySendError::Full(())
                }
                TrySendError::Disconnected(_) => TrySendError::Disconnected(()),
            }),
        }
    }

    /// Records why the watcher ended: in its stream's queue, or for its own receiver.
    fn ended(&self, id: u64, error: MvccError) {
        match &self.tx {
            Target::Stream(tx, shared) => {
                shared.ended.lock().push((id, error));
                // A wake-up for a blocked consumer; a full channel wakes it anyway.
                let _ = tx.try_send((id, Vec::new()));
            }
            Target::Own(_) => *self.end.error.lock() = Some(error),
        }
    }

    fn matches(&self, key: &[u8]) -> bool {
        match &self.bound {
            KeyBound::Single => key == self.key.as_slice(),
            KeyBound::Until(end) => key >= self.key.as_slice() && key < end.as_slice(),
            KeyBound::Unbounded => key >= self.key.as_slice(),
        }
    }
}

/// Where a watcher's responses go.
#[derive(Clone)]
enum Target {
    /// A lone watcher's own channel.
    Own(Sender<Vec<Event>>),
    /// The channel of the watcher's stream, shared by all its watchers.
    Stream(Sender<(u64, Vec<Event>)>, Arc<StreamShared>),
}

/// What the hub and a [`WatchStream`] share besides the channel.
#[derive(Default)]
struct StreamShared {
    /// Watchers of the stream that ended, with why.
    ended: Mutex<Vec<(u64, MvccError)>>,
    /// Set when a watcher of the stream found the channel full: receiving then wakes the
    /// syncer once the channel has room.
    lagging: AtomicBool,
}

/// Why a watcher ended, read by its receiver once the channel is drained.
#[derive(Default)]
struct WatchEnd {
    error: Mutex<Option<MvccError>>,
    /// Set while the watcher is unsynced: receiving then wakes the syncer.
    lagging: AtomicBool,
}

#[derive(Default)]
struct HubState {
    watchers: HashMap<u64, WatcherState>,
    synced_keys: HashMap<Vec<u8>, Vec<u64>>,
    synced_ranges: HashSet<u64>,
    unsynced: HashSet<u64>,
    /// Last revision whose events writers dispatched.
    last_notified: u64,
}

impl HubState {
    fn add_synced(&mut self, id: u64) {
        let Some(w) = self.watchers.get_mut(&id) else {
            return;
        };
        w.synced = true;
        w.end.lagging.store(false, Ordering::Release);
        match w.bound {
            KeyBound::Single => self.synced_keys.entry(w.key.clone()).or_default().push(id),
            _ => {
                self.synced_ranges.insert(id);
            }
        }
        self.unsynced.remove(&id);
    }

    fn remove_synced(&mut self, id: u64) {
        let Some(w) = self.watchers.get_mut(&id) else {
            return;
        };
        if !w.synced {
            return;
        }
        w.synced = false;
        w.end.lagging.store(true, Ordering::Release);
        match w.bound {
            KeyBound::Single => {
                if let Some(ids) = self.synced_keys.get_mut(&w.key) {
                    ids.retain(|&i| i != id);
                    if ids.is_empty() {
                        self.synced_keys.remove(&w.key);
                    }
                }
            }
            _ => {
                self.synced_ranges.remove(&id);
            }
        }
    }

    fn remove(&mut self, id: u64) -> Option<WatcherState> {
        self.remove_synced(id);
        self.unsynced.remove(&id);
        self.watchers.remove(&id)
    }
}

struct HubShared {
    state: Mutex<HubState>,
    count: AtomicUsize,
    closed: AtomicBool,
    wake: (Sender<()>, Receiver<()>),
}

impl HubShared {
    fn cancel(&self, id: u64) {
        if self.state.lock().remove(id).is_some() {
            self.count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The store's registry of watchers.
pub(crate) struct WatchHub {
    shared: Arc<HubShared>,
    next_id: AtomicU64,
    capacity: usize,
}

impl WatchHub {
    pub fn new(options: &StoreOptions) -> WatchHub {
        WatchHub {
            shared: Arc::new(HubShared {
                state: Mutex::new(HubState::default()),
                count: AtomicUsize::new(0),
                closed: AtomicBool::new(false),
                wake: crossbeam_channel::bounded(1),
            }),
            next_id: AtomicU64::new(1),
            capacity: options.watch_channel_capacity,
        }
    }

    pub fn count(&self) -> usize {
        self.shared.count.load(Ordering::Acquire)
    }

    pub fn has_watchers(&self) -> bool {
        self.shared.count.load(Ordering::Acquire) > 0
    }

    /// Closes every watcher (their receivers then report [`MvccError::WatchClosed`]).
    pub fn shutdown(&self) {
        self.shared.closed.store(true, Ordering::Release);
        let mut st = self.shared.state.lock();
        let n = st.watchers.len();
        *st = HubState::default();
        self.shared.count.fetch_sub(n, Ordering::AcqRel);
        drop(st);
        let _ = self.shared.wake.0.try_send(());
    }

    /// Hands the events of `revision` to synced watchers; called by the committing writer,
    /// in revision order, with the buffer its changes went to (`buf.revs[start..]`, one
    /// entry of `prev_revs` each). Never blocks on a watcher; allocates only for matches.
    pub fn notify<B: Backend>(
        &self,
        inner: &Arc<Inner<B>>,
        revision: u64,
        buf: &Pending,
        start: usize,
        prev_revs: &[Option<Revision>],
    ) {
        let mut st = self.shared.state.lock();
        st.last_notified = revision;
        let changes = buf.changes.read();
        let end = (start + prev_revs.len()).min(changes.revs.len());
        let revs = &changes.revs[start.min(end)..end];
        let mut matches: Vec<(u64, usize)> = Vec::new();
        for (i, p) in revs.iter().enumerate() {
            let Ok(rec) = decode_record(p.rev, &p.record) else {
                continue;
            };
            if let Some(ids) = st.synced_keys.get(rec.key) {
                matches.extend(ids.iter().map(|&id| (id, i)));
            }
            for &id in &st.synced_ranges {
                if st.watchers.get(&id).is_some_and(|w| w.matches(rec.key)) {
                    matches.push((id, i));
                }
            }
        }
        if matches.is_empty() {
            return;
        }
        matches.sort_unstable();
        let mut prevs: HashMap<usize, Option<KeyValue>> = HashMap::new();
        let mut view: Option<Option<ReadView<B>>> = None;
        let mut gone = Vec::new();
        for group in matches.chunk_by(|a, b| a.0 == b.0) {
            let id = group[0].0;
            let Some(w) = st.watchers.get(&id) else {
                continue;
            };
            if revision < w.next_rev {
                continue;
            }
            let mut out = Vec::with_capacity(group.len());
            for &(_, i) in group {
                let p = &revs[i];
                let Ok(rec) = decode_record(p.rev, &p.record) else {
                    continue;
                };
                let prev_kv = if w.prev_kv {
                    prevs
                        .entry(i)
                        .or_insert_with(|| {
                            let v = view.get_or_insert_with(|| ReadView::open(inner).ok());
                            resolve_prev(inner, v.as_ref(), prev_revs.get(i).copied().flatten())
                        })
                        .clone()
                } else {
                    None
                };
                out.push(Event {
                    kind: if p.tombstone {
                        EventKind::Delete
                    } else {
                        EventKind::Put
                    },
                    kv: rec.to_kv(true),
                    prev_kv,
                });
            }
            match w.try_send(id, out) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => {
                    st.remove_synced(id);
                    if let Some(w) = st.watchers.get_mut(&id) {
                        w.next_rev = revision;
                    }
                    st.unsynced.insert(id);
                }
                Err(TrySendError::Disconnected(_)) => gone.push(id),
            }
        }
        for id in gone {
            if st.remove(id).is_some() {
                self.shared.count.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

fn resolve_prev<B: Backend>(
    inner: &Inner<B>,
    view: Option<&ReadView<B>>,
    prev: Option<Revision>,
) -> Option<KeyValue> {
    let (view, prev) = (view?, prev?);
    let compacted = || inner.index.read().compacted;
    view.sources(None)
        .fetch(compacted, &[prev], true)
        .ok()?
        .pop()
}

/// A stream of changes; see the module docs. Dropping it cancels the watch.
pub struct Watcher {
    id: u64,
    rx: Receiver<Vec<Event>>,
    end: Arc<WatchEnd>,
    hub: Weak<HubShared>,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher").field("id", &self.id).finish()
    }
}

impl Watcher {
    /// The watch id, unique within its store.
    pub fn id(&self) -> u64 {
        self.id
    }

    fn ended(&self) -> MvccError {
        self.end
            .error
            .lock()
            .take()
            .unwrap_or(MvccError::WatchClosed { id: self.id })
    }

    /// After a receive: a lagging watcher with room again asks the syncer to catch it up.
    fn received(&self) {
        if self.end.lagging.load(Ordering::Acquire)
            && self.rx.len() * 2 <= self.rx.capacity().unwrap_or(0)
            && let Some(hub) = self.hub.upgrade()
        {
            let _ = hub.wake.0.try_send(());
        }
    }

    /// Waits for the events of the next revision that touched the watched keys. Fails with
    /// [`MvccError::Compacted`] when the watcher fell below the compaction point, or
    /// [`MvccError::WatchClosed`] after the store was dropped.
    pub fn recv(&self) -> Result<Vec<Event>, MvccError> {
        let events = self.rx.recv().map_err(|_| self.ended())?;
        self.received();
        Ok(events)
    }

    /// Like [`recv`](Watcher::recv) but gives up after `timeout` with `Ok(None)`.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<Vec<Event>>, MvccError> {
        match self.rx.recv_timeout(timeout) {
            Ok(events) => {
                self.received();
                Ok(Some(events))
            }
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(self.ended()),
        }
    }

    /// The next revision's events if already delivered.
    pub fn try_recv(&self) -> Result<Option<Vec<Event>>, MvccError> {
        match self.rx.try_recv() {
            Ok(events) => {
                self.received();
                Ok(Some(events))
            }
            Err(TryRecvError::Empty) => Ok(None),
            Err(TryRecvError::Disconnected) => Err(self.ended()),
        }
    }

    /// Stops the watch; events not yet received are dropped.
    pub fn cancel(self) {}
}

impl Drop for Watcher {
    fn drop(&mut self) {
        if let Some(hub) = self.hub.upgrade() {
            hub.cancel(self.id);
        }
    }
}

/// Registers a watcher.
pub(crate) fn watch<B: Backend>(
    inner: &Arc<Inner<B>>,
    req: WatchRequest,
) -> Result<Watcher, MvccError> {
    watch_in(inner, req, None)
}

/// Registers a watcher; `stream` gives its stream's channel, or `None` for a lone watcher.
fn watch_in<B: Backend>(
    inner: &Arc<Inner<B>>,
    req: WatchRequest,
    stream: Option<Target>,
) -> Result<Watcher, MvccError> {
    check_range(&req.key, req.range_end.as_deref())?;
    let size = req.key.len() + req.range_end.as_ref().map_or(0, Vec::len);
    if size > inner.options.max_request_bytes {
        return Err(MvccError::RequestTooLarge {
            size,
            limit: inner.options.max_request_bytes,
        });
    }
    let hub = &inner.watch;
    let bound = match req.range_end.as_deref() {
        None => KeyBound::Single,
        Some([0]) => KeyBound::Unbounded,
        Some(e) => KeyBound::Until(e.to_vec()),
    };
    let (tx, rx) = match stream {
        Some(t) => (t, crossbeam_channel::never()),
        None => {
            let (tx, rx) = crossbeam_channel::bounded(hub.capacity);
            (Target::Own(tx), rx)
        }
    };
    let end = Arc::new(WatchEnd::default());
    let id = hub.next_id.fetch_add(1, Ordering::Relaxed);
    // The write lock orders registration against commits: nothing is published meanwhile.
    let _w = inner.write_lock.lock();
    let current = inner.state.lock().revision;
    let compacted = inner.compacted.load(Ordering::Acquire);
    if req.start_revision != 0 && req.start_revision <= compacted {
        return Err(MvccError::Compacted {
            requested: req.start_revision,
            compacted,
        });
    }
    let start = if req.start_revision == 0 {
        current + 1
    } else {
        req.start_revision
    };
    let mut st = hub.shared.state.lock();
    st.last_notified = st.last_notified.max(current);
    st.watchers.insert(
        id,
        WatcherState {
            key: req.key,
            bound,
            prev_kv: req.prev_kv,
            tx,
            end: end.clone(),
            next_rev: start,
            synced: false,
        },
    );
    hub.shared.count.fetch_add(1, Ordering::AcqRel);
    if start > current {
        st.add_synced(id);
    } else {
        end.lagging.store(true, Ordering::Release);
        st.unsynced.insert(id);
        let _ = hub.shared.wake.0.try_send(());
    }
    Ok(Watcher {
        id,
        rx,
        end,
        hub: Arc::downgrade(&hub.shared),
    })
}

/// A watcher's parameters copied out for one catch-up round.
struct SyncTarget {
    id: u64,
    next: u64,
    matcher: WatcherState,
}

/// The syncer thread: catches unsynced watchers up until the store shuts down.
pub(crate) fn syncer_loop<B: Backend>(inner: &Arc<Inner<B>>) {
    let hub = &inner.watch;
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
        if hub.shared.closed.load(Ordering::Acquire) || inner.shutdown.load(Ordering::Acquire) {
            return;
        }
        // Keep going while rounds make progress; a round with only full channels waits.
        for _ in 0..64 {
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

/// One catch-up pass; true when some watcher made progress and more work may remain.
fn sync_round<B: Backend>(inner: &Arc<Inner<B>>) -> Result<bool, MvccError> {
    let hub = &inner.watch;
    let view = ReadView::open(inner)?;
    let compacted = inner.compacted.load(Ordering::Acquire);
    let mut targets = Vec::new();
    {
        let mut st = hub.shared.state.lock();
        let ids: Vec<u64> = st
            .unsynced
            .iter()
            .copied()
            .take(WATCHERS_PER_SYNC)
            .collect();
        for id in ids {
            let Some(w) = st.watchers.get(&id) else {
                continue;
            };
            if w.next_rev <= compacted {
                if let Some(w) = st.remove(id) {
                    hub.shared.count.fetch_sub(1, Ordering::AcqRel);
                    let error = MvccError::Compacted {
                        requested: w.next_rev,
                        compacted,
                    };
                    w.ended(id, error);
                }
                continue;
            }
            targets.push(SyncTarget {
                id,
                next: w.next_rev,
                matcher: WatcherState {
                    key: w.key.clone(),
                    bound: w.bound.clone(),
                    prev_kv: w.prev_kv,
                    tx: w.tx.clone(),
                    end: w.end.clone(),
                    next_rev: w.next_rev,
                    synced: false,
                },
            });
        }
    }
    if targets.is_empty() {
        return Ok(false);
    }
    let min_next = targets.iter().map(|t| t.next).min().unwrap_or(u64::MAX);
    let upto = view
        .revision()
        .min(min_next.saturating_add(inner.options.watch_sync_batch as u64 - 1));
    // Events of [min_next, upto], grouped by revision.
    let mut revs: Vec<(u64, Vec<RawEvent>)> = Vec::new();
    if min_next <= upto {
        view.sources(None).for_each_change(
            Revision::new(min_next, 0),
            upto,
            |rev, tomb, _, rec| {
                let kv = decode_record(rev, rec)?.to_kv(true);
                let ev = RawEvent {
                    kind: if tomb {
                        EventKind::Delete
                    } else {
                        EventKind::Put
                    },
                    kv,
                };
                match revs.last_mut() {
                    Some((main, evs)) if *main == rev.main => evs.push(ev),
                    _ => revs.push((rev.main, vec![ev])),
                }
                Ok(true)
            },
        )?;
    }
    let mut progressed = false;
    for t in &mut targets {
        let start = revs.partition_point(|(main, _)| *main < t.next);
        let mut blocked = false;
        for (main, evs) in &revs[start..] {
            let out: Vec<Event> = evs
                .iter()
                .filter(|e| t.matcher.matches(&e.kv.key))
                .map(|e| Event {
                    kind: e.kind,
                    kv: e.kv.clone(),
                    prev_kv: if t.matcher.prev_kv {
                        prev_at(inner, &view, &e.kv.key, *main)
                    } else {
                        None
                    },
                })
                .collect();
            if out.is_empty() {
                continue;
            }
            match t.matcher.try_send(t.id, out) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => {
                    t.next = *main;
                    blocked = true;
                    break;
                }
                Err(TrySendError::Disconnected(_)) => {
                    blocked = true;
                    break;
                }
            }
            t.next = main + 1;
            progressed = true;
        }
        if !blocked && t.next <= upto {
            t.next = upto + 1;
            progressed = true;
        }
    }
    let mut st = hub.shared.state.lock();
    let last = st.last_notified;
    for t in targets {
        let Some(w) = st.watchers.get_mut(&t.id) else {
            continue;
        };
        if w.synced {
            continue;
        }
        w.next_rev = t.next;
        if t.next > last {
            st.add_synced(t.id);
            progressed = true;
        }
    }
    Ok(progressed && !st.unsynced.is_empty())
}

/// The pair `key` had just before revision `main`, read through `view`.
fn prev_at<B: Backend>(
    inner: &Inner<B>,
    view: &ReadView<B>,
    key: &[u8],
    main: u64,
) -> Option<KeyValue> {
    let at = main.checked_sub(1).filter(|&r| r > 0)?;
    let req = RangeRequest::key(key.to_vec()).at(at);
    crate::read::range(inner, &view.sources(None), &req, view.revision())
        .ok()?
        .kvs
        .pop()
}

/// What a [`WatchStream`] yields.
#[derive(Debug)]
pub enum StreamItem {
    /// The events of one revision for one watcher of the stream.
    Events {
        /// The watcher's id (as returned by [`WatchStream::watch`]).
        id: u64,
        /// The changes, in revision order within the revision.
        events: Vec<Event>,
    },
    /// A watcher of the stream ended (e.g. [`MvccError::Compacted`]); it is removed from the
    /// stream.
    Ended {
        /// The watcher's id.
        id: u64,
        /// Why it ended.
        error: MvccError,
    },
}

/// Many watchers behind one channel (etcd's `watchStream`); see the module docs. Dropping
/// the stream cancels its watchers.
pub struct WatchStream<B: Backend> {
    inner: Weak<Inner<B>>,
    tx: Option<Sender<(u64, Vec<Event>)>>,
    rx: Receiver<(u64, Vec<Event>)>,
    shared: Arc<StreamShared>,
    hub: Weak<HubShared>,
    /// The stream's watchers; their handles carry no channel of their own.
    watchers: HashMap<u64, Watcher>,
}

impl<B: Backend> std::fmt::Debug for WatchStream<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WatchStream")
            .field("watchers", &self.watchers.len())
            .finish()
    }
}

impl<B: Backend> WatchStream<B> {
    pub(crate) fn new(inner: &Arc<Inner<B>>, capacity: usize) -> WatchStream<B> {
        let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
        WatchStream {
            inner: Arc::downgrade(inner),
            tx: Some(tx),
            rx,
            shared: Arc::new(StreamShared::default()),
            hub: Arc::downgrade(&inner.watch.shared),
            watchers: HashMap::new(),
        }
    }

    /// Adds a watcher to the stream and returns its id; its events come out of
    /// [`recv`](WatchStream::recv). Fails like [`Store::watch`](crate::Store::watch), or with
    /// [`MvccError::WatchClosed`] once the store is gone.
    pub fn watch(&mut self, req: WatchRequest) -> Result<u64, MvccError> {
        let (Some(inner), Some(tx)) = (self.inner.upgrade(), self.tx.as_ref()) else {
            return Err(MvccError::WatchClosed { id: 0 });
        };
        if inner.watch.shared.closed.load(Ordering::Acquire) {
            return Err(MvccError::WatchClosed { id: 0 });
        }
        let target = Target::Stream(tx.clone(), self.shared.clone());
        let w = watch_in(&inner, req, Some(target))?;
        let id = w.id();
        self.watchers.insert(id, w);
        Ok(id)
    }

    /// Cancels one watcher of the stream; false if the stream has no such watcher. Responses
    /// of it still in the channel are dropped.
    pub fn cancel(&mut self, id: u64) -> bool {
        self.watchers.remove(&id).is_some()
    }

    /// Number of watchers in the stream.
    pub fn len(&self) -> usize {
        self.watchers.len()
    }

    /// True when the stream has no watcher.
    pub fn is_empty(&self) -> bool {
        self.watchers.is_empty()
    }

    /// The next ended watcher, if any.
    fn next_ended(&mut self) -> Option<StreamItem> {
        let mut ended = self.shared.ended.lock();
        while let Some((id, error)) = (!ended.is_empty()).then(|| ended.remove(0)) {
            if self.watchers.remove(&id).is_some() {
                return Some(StreamItem::Ended { id, error });
            }
        }
        None
    }

    /// Turns a received message into an item; `None` for a wake-up or a cancelled watcher.
    fn take(&mut self, (id, events): (u64, Vec<Event>)) -> Option<StreamItem> {
        if self.shared.lagging.load(Ordering::Acquire)
            && self.rx.len() * 2 <= self.rx.capacity().unwrap_or(0)
        {
            self.shared.lagging.store(false, Ordering::Release);
            if let Some(hub) = self.hub.upgrade() {
                let _ = hub.wake.0.try_send(());
            }
        }
        if events.is_empty() || !self.watchers.contains_key(&id) {
            return self.next_ended();
        }
        Some(StreamItem::Events { id, events })
    }

    /// Waits for the next response of any watcher of the stream. Fails with
    /// [`MvccError::WatchClosed`] once the store is gone and everything was received.
    pub fn recv(&mut self) -> Result<StreamItem, MvccError> {
        loop {
            if let Some(item) = self.recv_timeout(Duration::from_millis(100))? {
                return Ok(item);
            }
        }
    }

    /// Like [`recv`](WatchStream::recv) but gives up after `timeout` with `Ok(None)`.
    pub fn recv_timeout(&mut self, timeout: Duration) -> Result<Option<StreamItem>, MvccError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(item) = self.try_recv()? {
                return Ok(Some(item));
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            // Short waits so a closed store is noticed even with no message.
            match self.rx.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok(msg) => {
                    if let Some(item) = self.take(msg) {
                        return Ok(Some(item));
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return self.closed_out(),
            }
        }
    }

    /// A response already delivered to the stream, if any.
    pub fn try_recv(&mut self) -> Result<Option<StreamItem>, MvccError> {
        loop {
            match self.rx.try_recv() {
                Ok(msg) => {
                    if let Some(item) = self.take(msg) {
                        return Ok(Some(item));
                    }
                }
                Err(TryRecvError::Empty) => {
                    if let Some(item) = self.next_ended() {
                        return Ok(Some(item));
                    }
                    if self
                        .inner
                        .upgrade()
                        .is_none_or(|i| i.watch.shared.closed.load(Ordering::Acquire))
                    {
                        return self.closed_out();
                    }
                    return Ok(None);
                }
                Err(TryRecvError::Disconnected) => return self.closed_out(),
            }
        }
    }

    /// The store closed and the channel is drained.
    fn closed_out(&mut self) -> Result<Option<StreamItem>, MvccError> {
        self.tx = None;
        self.watchers.clear();
        Err(MvccError::WatchClosed { id: 0 })
    }
}
