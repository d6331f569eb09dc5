//! Watch: streams of changes to a key or range, from a revision on.
//!
//! Every watcher is either *synced* — the notifier hands it the events of each new revision
//! with a non-blocking send — or *unsynced*: it started in the past, or its channel was full
//! when the notifier tried to deliver. Nobody waits for a watcher: a full channel just turns
//! the watcher unsynced, remembering the first revision it missed.
//!
//! A committing writer does not match, copy or send anything: it appends its revision (a
//! reference to the write buffer its changes went to, where they start, and their previous
//! revisions) to the hub's queue — no allocation for a one-change revision — and wakes the
//! notifier thread only if it is parked. The notifier takes the whole queue at once, lets
//! commits gather for a moment between batches (so busy writers find it asleep rather than
//! waiting to be woken), and dispatches the batch in revision order. Should it fall a whole
//! queue behind, the writer dispatches the queue itself, in order, so the queue, and the
//! buffers it holds on to, stay bounded.
//!
//! Matching is by key, not by watcher: every watcher sits in one [`index::Matcher`] (single
//! keys in a hash map with a random seed per map, ranges in an interval index), so a change is
//! matched with one lookup plus one stab, whatever the number of watchers. A matched record is
//! copied out of the write buffer once, and shared: the records of revisions with one change
//! (puts, single deletes) are gathered, for a run of them, into one buffer sent to every
//! watcher that matched any of them, each with where its record lies (one allocation for the
//! run; the record is copied out under the write buffer's read lock and matched after, so
//! a writer committing meanwhile is not kept waiting); a revision
//! with more gathers its matched records once into a shared [`RevChanges`] sent with the
//! positions each watcher should see. Every [`Event`] holds its record and reads its key and
//! value from it, so a revision costs one channel send per matching watcher and the receiver
//! no copy of any key or value.
//!
//! The syncer thread ([`sync`]) catches unsynced watchers up: each round takes every unsynced
//! watcher whose channel has room, reads the revisions from the lowest revision any of them
//! still needs from the store in one scan (pending buffers and backend, through a read view),
//! decodes each change once, matches it through a matcher built over those watchers, and
//! sends every watcher its whole share of the round in one message. A round reads
//! [`StoreOptions::watch_sync_batch`] revisions, or as many as there are watchers in it if
//! that is more (so the per-watcher setup of a round stays small against its scan). A watcher
//! that has everything up to the last revision the notifier dispatched goes back to synced.
//! Memory therefore stays bounded by the channels (each message holds at most one round's
//! share, or a gathered buffer of at most 18 KiB) and the dispatch queue, whatever the
//! consumers do.
//!
//! A [`WatchStream`] multiplexes many watchers onto one bounded channel, like etcd's
//! `watchStream` (its `chanBufLen` is our channel capacity): a consumer of thousands of
//! watchers blocks on one channel instead of polling each, and the store keeps one channel
//! per stream, not per watcher. When the shared channel is full, the watcher that could not
//! deliver turns unsynced exactly like a lone watcher with a full channel, and the syncer
//! catches it up once the consumer made room. Watchers ending (compaction) are queued beside
//! the channel, so that news never waits for room.
//!
//! Receivers always see one response per revision: a batch message is split on receipt.
//!
//! A watcher whose next revision falls below the compaction point receives
//! [`MvccError::Compacted`] and ends (etcd's "required revision has been compacted").
//!
//! [`StoreOptions::watch_sync_batch`]: crate::StoreOptions::watch_sync_batch

mod index;
mod stream;
mod sync;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError, TrySendError};
use parking_lot::Mutex;

use crate::backend::Backend;
use crate::error::MvccError;
use crate::kv::{KeyValue, LeaseId, RECORD_CRC, RecordRef, decode_record_unchecked};
use crate::options::StoreOptions;
use crate::pending::Pending;
use crate::read::ReadView;
use crate::request::{RangeRequest, check_range};
use crate::revision::Revision;
use crate::store::Inner;

use index::{End, FxMap, FxSet, Matcher};
pub use stream::{StreamItem, WatchStream};
pub(crate) use sync::syncer_loop;

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
    /// A deletion; the event carries the key and the deleting revision only (empty value,
    /// zero create revision and version).
    Delete,
}

/// One change seen by a watcher.
///
/// An event shares a copy of the stored record of its change with every other watcher that saw
/// the same change (and, for revisions of one change dispatched together, with the events of
/// the others: their records are copied into one buffer of at most 16 KiB):
/// delivering it to many watchers copies no key or value, and [`key`](Event::key) and
/// [`value`](Event::value) are slices into that record. [`kv`](Event::kv) copies the pair out
/// for a caller that keeps it.
#[derive(Clone)]
pub struct Event {
    kind: EventKind,
    /// The buffer holding the change's record, in the layout of [`crate::kv`], at
    /// `start..end`; checked when the event was made.
    bytes: Arc<[u8]>,
    start: u32,
    /// Where the key starts (after the record's header) in `bytes`.
    key_start: u32,
    /// Where the key ends (and the value starts) in `bytes`.
    key_end: u32,
    end: u32,
    prev: Option<Arc<KeyValue>>,
}

impl Event {
    /// An event over a record the store wrote (or read back and checked); a tombstone if
    /// `tombstone` says so, or when not given, if the record's version is 0. `None` if the
    /// record is too short for the key length it gives.
    fn new(record: Window, tombstone: Option<bool>, prev: Option<Arc<KeyValue>>) -> Option<Event> {
        let Window { bytes, start, end } = record;
        let (kind, key_start, key_end) = {
            let r = record_fields(bytes.get(start as usize..end as usize)?)?;
            let kind = if tombstone.unwrap_or(r.version == 0) {
                EventKind::Delete
            } else {
                EventKind::Put
            };
            let key_end = end as usize - RECORD_CRC - r.value.len();
            (kind, key_end - r.key.len(), key_end)
        };
        Some(Event {
            kind,
            bytes,
            start,
            key_start: u32::try_from(key_start).ok()?,
            key_end: u32::try_from(key_end).ok()?,
            end,
            prev,
        })
    }

    /// The change's record.
    fn record(&self) -> &[u8] {
        self.bytes
            .get(self.start as usize..self.end as usize)
            .unwrap_or_default()
    }

    /// The record's header fields (its framing was checked when the event was made).
    fn fields(&self) -> Option<RecordRef<'_>> {
        record_fields(self.record())
    }

    /// Put or delete.
    pub fn kind(&self) -> EventKind {
        self.kind
    }

    /// The changed key.
    pub fn key(&self) -> &[u8] {
        self.bytes
            .get(self.key_start as usize..self.key_end as usize)
            .unwrap_or_default()
    }

    /// The value after the change (empty for a delete).
    pub fn value(&self) -> &[u8] {
        let end = (self.end as usize).saturating_sub(RECORD_CRC);
        self.bytes
            .get(self.key_end as usize..end)
            .unwrap_or_default()
    }

    /// Revision of the put that created the key's current generation (0 for a delete).
    pub fn create_revision(&self) -> u64 {
        self.fields().map_or(0, |r| r.create_revision)
    }

    /// The revision of the change.
    pub fn mod_revision(&self) -> u64 {
        self.fields().map_or(0, |r| r.mod_revision)
    }

    /// Number of puts since the key was (re)created, from 1 (0 for a delete).
    pub fn version(&self) -> u64 {
        self.fields().map_or(0, |r| r.version)
    }

    /// The lease attached to the key by the change, 0 for none.
    pub fn lease(&self) -> LeaseId {
        self.fields().map_or(0, |r| r.lease)
    }

    /// The pair after the change, copied out (for a delete: the key and the deleting
    /// revision only).
    pub fn kv(&self) -> KeyValue {
        RecordRef {
            key: self.key(),
            value: self.value(),
            create_revision: self.create_revision(),
            mod_revision: self.mod_revision(),
            version: self.version(),
            lease: self.lease(),
        }
        .to_kv(true)
    }

    /// The pair before the change, when the watch asked for it and the key existed (and
    /// was not compacted away by the time the event was read).
    pub fn prev_kv(&self) -> Option<&KeyValue> {
        self.prev.as_deref()
    }
}

/// The events of one revision for one watcher, in the revision's order. Most revisions
/// have one event, held without an allocation of its own. Reads as a slice of [`Event`]s
/// and iterates by value or by reference.
#[derive(Clone)]
pub struct Events(EventsRepr);

#[derive(Clone)]
enum EventsRepr {
    One(Event),
    Many(Vec<Event>),
}

impl Events {
    /// The events as a vector.
    pub fn into_vec(self) -> Vec<Event> {
        match self.0 {
            EventsRepr::One(e) => vec![e],
            EventsRepr::Many(v) => v,
        }
    }
}

impl std::ops::Deref for Events {
    type Target = [Event];

    fn deref(&self) -> &[Event] {
        match &self.0 {
            EventsRepr::One(e) => std::slice::from_ref(e),
            EventsRepr::Many(v) => v,
        }
    }
}

impl From<Events> for Vec<Event> {
    fn from(events: Events) -> Vec<Event> {
        events.into_vec()
    }
}

impl FromIterator<Event> for Events {
    fn from_iter<I: IntoIterator<Item = Event>>(iter: I) -> Events {
        let mut iter = iter.into_iter();
        match (iter.next(), iter.next()) {
            (Some(one), None) => Events(EventsRepr::One(one)),
            (first, second) => {
                let mut all: Vec<Event> = first.into_iter().chain(second).collect();
                all.extend(iter);
                Events(EventsRepr::Many(all))
            }
        }
    }
}

impl IntoIterator for Events {
    type Item = Event;
    type IntoIter = EventsIter;

    fn into_iter(self) -> EventsIter {
        EventsIter(match self.0 {
            EventsRepr::One(e) => EventsIterRepr::One(Some(e)),
            EventsRepr::Many(v) => EventsIterRepr::Many(v.into_iter()),
        })
    }
}

impl<'a> IntoIterator for &'a Events {
    type Item = &'a Event;
    type IntoIter = std::slice::Iter<'a, Event>;

    fn into_iter(self) -> std::slice::Iter<'a, Event> {
        self.iter()
    }
}

impl PartialEq for Events {
    fn eq(&self, other: &Events) -> bool {
        **self == **other
    }
}

impl Eq for Events {}

impl PartialEq<Vec<Event>> for Events {
    fn eq(&self, other: &Vec<Event>) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// [`Events`] by value.
#[derive(Debug)]
pub struct EventsIter(EventsIterRepr);

#[derive(Debug)]
enum EventsIterRepr {
    One(Option<Event>),
    Many(std::vec::IntoIter<Event>),
}

impl Iterator for EventsIter {
    type Item = Event;

    fn next(&mut self) -> Option<Event> {
        match &mut self.0 {
            EventsIterRepr::One(e) => e.take(),
            EventsIterRepr::Many(v) => v.next(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match &self.0 {
            EventsIterRepr::One(e) => {
                let n = usize::from(e.is_some());
                (n, Some(n))
            }
            EventsIterRepr::Many(v) => v.size_hint(),
        }
    }
}

impl ExactSizeIterator for EventsIter {}

// Events are equal when their changes are: where their records are held does not matter.
impl PartialEq for Event {
    fn eq(&self, other: &Event) -> bool {
        self.kind == other.kind && self.record() == other.record() && self.prev == other.prev
    }
}

impl Eq for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("kind", &self.kind)
            .field("key", &String::from_utf8_lossy(self.key()))
            .field("value_len", &self.value().len())
            .field("create_revision", &self.create_revision())
            .field("mod_revision", &self.mod_revision())
            .field("version", &self.version())
            .field("lease", &self.lease())
            .field("prev_kv", &self.prev_kv())
            .finish()
    }
}

/// The key of a record, read without checking its checksum: for records the store holds in
/// memory (written by itself, or read back and checked once). Layout: [`crate::kv`].
fn record_key(record: &[u8]) -> Option<&[u8]> {
    record_fields(record).map(|r| r.key)
}

/// The fields of a record the store holds in memory, read without checking its checksum;
/// `None` when its framing is broken.
fn record_fields(record: &[u8]) -> Option<RecordRef<'_>> {
    decode_record_unchecked(Revision::default(), record).ok()
}

/// One change of a shared revision: its stored record (checked) and, when a watcher asked
/// for it, the previous pair.
struct Change {
    tombstone: bool,
    record: Arc<[u8]>,
    prev: Option<Arc<KeyValue>>,
}

/// The changes of one revision that some watcher matched, shared by all their deliveries.
struct RevChanges {
    changes: Vec<Change>,
}

/// A record in a shared buffer: `bytes[start..end]`.
#[derive(Clone)]
struct Window {
    bytes: Arc<[u8]>,
    start: u32,
    end: u32,
}

impl Window {
    /// The whole of `record`; `None` past 4 GiB.
    fn whole(record: Arc<[u8]>) -> Option<Window> {
        let end = u32::try_from(record.len()).ok()?;
        Some(Window {
            bytes: record,
            start: 0,
            end,
        })
    }
}

/// A revision's matched changes as shared between deliveries.
#[derive(Clone)]
enum Shared {
    /// The common case, one change and no previous pair: its record alone (a tombstone is
    /// the record with version 0, see [`crate::kv`]), in a buffer it may share with the
    /// records of other revisions.
    One(Window),
    /// Anything else.
    Many(Arc<RevChanges>),
}

/// Which changes of a [`Shared::Many`] a delivery holds.
enum Pick {
    All,
    Some(Box<[u32]>),
}

/// One revision for one watcher.
struct Part {
    rev: Shared,
    pick: Pick,
    prev_kv: bool,
}

impl Part {
    /// The watcher's response for this revision (a record held by this part alone moves
    /// into its event).
    fn into_events(self) -> Events {
        let changes = match self.rev {
            // A tombstone is the record with version 0.
            Shared::One(record) => return Event::new(record, None, None).into_iter().collect(),
            Shared::Many(rev) => rev,
        };
        let changes = &changes.changes;
        let one = |c: &Change| -> Option<Event> {
            let prev = if self.prev_kv { c.prev.clone() } else { None };
            Event::new(Window::whole(c.record.clone())?, Some(c.tombstone), prev)
        };
        match &self.pick {
            Pick::All => changes.iter().filter_map(one).collect(),
            Pick::Some(at) => at
                .iter()
                .filter_map(|&i| changes.get(i as usize).and_then(one))
                .collect(),
        }
    }
}

/// What travels in a watcher's channel.
enum Msg {
    /// The writer's delivery of one revision.
    One(Part),
    /// A catch-up batch, ascending revisions.
    Many(Vec<Part>),
    /// Nothing: wakes a stream's consumer to look at its ended watchers.
    Wake,
}

impl Msg {
    /// Appends the message's responses, one per revision, to `out`.
    fn split_into(self, out: &mut VecDeque<Events>) {
        let mut push = |p: Part| {
            let events = p.into_events();
            if !events.is_empty() {
                out.push_back(events);
            }
        };
        match self {
            Msg::One(p) => push(p),
            Msg::Many(parts) => parts.into_iter().for_each(push),
            Msg::Wake => {}
        }
    }
}

/// Where a watcher's responses go.
#[derive(Clone)]
enum Target {
    /// A lone watcher's own channel.
    Own(Sender<Msg>),
    /// The channel of the watcher's stream, shared by all its watchers.
    Stream(Sender<(u64, Msg)>, Arc<stream::StreamShared>),
}

impl Target {
    /// Hands `msg` to the channel; on a full stream channel the stream is marked lagging so
    /// its consumer wakes the syncer.
    fn try_send(&self, id: u64, msg: Msg) -> Result<(), TrySendError<()>> {
        match self {
            Target::Own(tx) => tx.try_send(msg).map_err(|e| match e {
                TrySendError::Full(_) => TrySendError::Full(()),
                TrySendError::Disconnected(_) => TrySendError::Disconnected(()),
            }),
            Target::Stream(tx, shared) => tx.try_send((id, msg)).map_err(|e| match e {
                TrySendError::Full(_) => {
                    shared.lagging.store(true, Ordering::Release);
                    TrySendError::Full(())
                }
                TrySendError::Disconnected(_) => TrySendError::Disconnected(()),
            }),
        }
    }

    /// True when a send would fail for want of room.
    fn is_full(&self) -> bool {
        match self {
            Target::Own(tx) => tx.is_full(),
            Target::Stream(tx, _) => tx.is_full(),
        }
    }
}

struct WatcherState {
    id: u64,
    key: Arc<[u8]>,
    /// `None` for a single key.
    end: Option<End>,
    prev_kv: bool,
    tx: Target,
    info: Arc<WatchEnd>,
    /// First revision this watcher has not received (for a synced watcher: the lowest
    /// revision it may still receive).
    next_rev: u64,
    synced: bool,
}

impl WatcherState {
    /// Records why the watcher ended: in its stream's queue, or for its own receiver.
    fn ended(&self, id: u64, error: MvccError) {
        match &self.tx {
            Target::Stream(tx, shared) => {
                shared.ended.lock().push_back((id, error));
                // A wake-up for a blocked consumer; a full channel wakes it anyway.
                let _ = tx.try_send((id, Msg::Wake));
            }
            Target::Own(_) => *self.info.error.lock() = Some(error),
        }
    }
}

/// Why a watcher ended, read by its receiver once the channel is drained.
#[derive(Default)]
struct WatchEnd {
    error: Mutex<Option<MvccError>>,
    /// Set while the watcher is unsynced: receiving then wakes the syncer.
    lagging: AtomicBool,
}

/// Watchers in a dense slab with their ids mapped to slots: the matcher hands out slots, so
/// the writer reaches a matched watcher by index instead of a second hash lookup.
#[derive(Default)]
struct Watchers {
    slots: Vec<Option<WatcherState>>,
    free: Vec<u32>,
    by_id: FxMap<u64, u32>,
}

impl Watchers {
    fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Stores `w` and returns its slot.
    fn insert(&mut self, w: WatcherState) -> u32 {
        let id = w.id;
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(w);
                slot
            }
            None => {
                self.slots.push(Some(w));
                (self.slots.len() - 1) as u32
            }
        };
        self.by_id.insert(id, slot);
        slot
    }

    fn at(&self, slot: u64) -> Option<&WatcherState> {
        self.slots.get(slot as usize)?.as_ref()
    }

    fn get(&self, id: u64) -> Option<&WatcherState> {
        self.at(u64::from(*self.by_id.get(&id)?))
    }

    fn get_mut(&mut self, id: u64) -> Option<&mut WatcherState> {
        let slot = *self.by_id.get(&id)?;
        self.slots.get_mut(slot as usize)?.as_mut()
    }

    /// Takes watcher `id` out, with the slot it had.
    fn remove(&mut self, id: u64) -> Option<(u32, WatcherState)> {
        let slot = self.by_id.remove(&id)?;
        let w = self.slots.get_mut(slot as usize)?.take()?;
        self.free.push(slot);
        Some((slot, w))
    }
}

#[derive(Default)]
struct HubState {
    watchers: Watchers,
    /// Every watcher, synced or not, by what it watches (by slot in `watchers`).
    matcher: Matcher,
    unsynced: FxSet<u64>,
    /// Last revision whose events writers dispatched.
    last_notified: u64,
    /// The writer's scratch list of `(watcher slot, change)` matches, kept to spare allocations.
    scratch: Vec<(u64, u32)>,
    /// The short path's scratch (see [`WatchHub::drain_locked`]), kept likewise.
    gathered: Gathered,
}

impl HubState {
    fn set_synced(&mut self, id: u64) {
        if let Some(w) = self.watchers.get_mut(id) {
            w.synced = true;
            w.info.lagging.store(false, Ordering::Release);
            self.unsynced.remove(&id);
        }
    }

    /// Turns a synced watcher unsynced from `next` on.
    fn set_unsynced(&mut self, id: u64, next: u64) {
        if let Some(w) = self.watchers.get_mut(id) {
            w.synced = false;
            w.next_rev = next;
            w.info.lagging.store(true, Ordering::Release);
            self.unsynced.insert(id);
        }
    }

    fn remove(&mut self, id: u64) -> Option<WatcherState> {
        let (slot, w) = self.watchers.remove(id)?;
        self.matcher.remove(u64::from(slot), &w.key, w.end.as_ref());
        self.unsynced.remove(&id);
        Some(w)
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

/// Revisions the notifier dispatches per hold of the watcher lock.
const DISPATCH_BATCH: usize = 256;
/// Committed revisions queued for the notifier before the writer dispatches them itself.
const DISPATCH_QUEUE: usize = 16_384;
/// Changes of a revision matched or copied per read lock of its write buffer.
const LOCKED_CHANGES: usize = 64;

/// Largest record the short path of [`WatchHub::drain_locked`] gathers; a larger one goes
/// through [`WatchHub::dispatch_one`], in an allocation of its own.
const GATHER_RECORD: usize = 2 << 10;
/// Bytes of records gathered before they are sent. An event keeps the whole buffer its
/// record is in alive, so this (plus one record of at most [`GATHER_RECORD`]) bounds what
/// one event held by a consumer keeps, however small its own record: up to 18 KiB, where
/// an event with a record of its own would keep the record alone.
const GATHER_BYTES: usize = 16 << 10;
/// Deliveries gathered before they are sent (each revision adds one per matching
/// watcher, so many watchers of one prefix fill this long before the records fill
/// [`GATHER_BYTES`]); also what the gathering keeps allocated between batches.
const GATHER_SENDS: usize = 4096;

/// Deliveries of revisions of one change, gathered while a batch is dispatched and sent
/// together: their records are copied into one buffer that every event made from them
/// shares, one allocation for many revisions instead of one each.
#[derive(Default)]
struct Gathered {
    /// The records, back to back.
    bytes: Vec<u8>,
    /// Per delivery: the watcher's slot, the revision, and where its record lies in
    /// `bytes`.
    sends: Vec<(u64, u64, u32, u32)>,
}

impl Gathered {
    /// Matches the one change of `d` and gathers its deliveries; false if the revision
    /// needs the general path instead: a matched watcher wants previous pairs, or the
    /// record is over [`GATHER_RECORD`].
    ///
    /// The record is copied out first, under a read lock of the write buffer held for
    /// that alone: the writer takes that buffer's write lock for every commit, and a
    /// notifier matching under the read lock (a hash lookup into a large table, a cache
    /// miss) would make it wait, and often sleep, at every other commit.
    fn gather(&mut self, st: &mut HubState, d: &Dispatch) -> bool {
        st.last_notified = st.last_notified.max(d.revision);
        let at = self.bytes.len();
        {
            let changes = d.buf.changes.read();
            debug_assert!(changes.revs.len() > d.start, "a queued revision's change");
            let Some(record) = changes.revs.get(d.start).map(|p| changes.record(p)) else {
                return true;
            };
            if record.len() > GATHER_RECORD {
                return false;
            }
            self.bytes.extend_from_slice(record);
        }
        let record = &self.bytes[at..];
        let Some(key) = record_key(record) else {
            self.bytes.truncate(at);
            return true;
        };
        let first = self.sends.len();
        // At most GATHER_BYTES + GATHER_RECORD.
        let start = at as u32;
        let end = self.bytes.len() as u32;
        let mut any_prev = false;
        let watchers = &st.watchers;
        st.matcher.for_each_match(key, |slot| {
            if let Some(w) = watchers.at(slot)
                && w.synced
                && w.next_rev <= d.revision
            {
                any_prev |= w.prev_kv;
                self.sends.push((slot, d.revision, start, end));
            }
        });
        if any_prev {
            self.sends.truncate(first);
        }
        if self.sends.len() == first {
            self.bytes.truncate(at);
        }
        !any_prev
    }
}

/// Per change of a queued revision, the key's revision before it: one inline, as a put has.
enum QueuedPrevs {
    One(Option<Revision>),
    Many(Box<[Option<Revision>]>),
}

impl QueuedPrevs {
    fn as_slice(&self) -> &[Option<Revision>] {
        match self {
            QueuedPrevs::One(p) => std::slice::from_ref(p),
            QueuedPrevs::Many(ps) => ps,
        }
    }
}

/// A committed revision waiting for the notifier: its changes are `buf`'s from `start` on,
/// one per entry of `prevs` (a buffer's changes never move, and it lives as long as this).
struct Dispatch {
    revision: u64,
    buf: Arc<Pending>,
    start: usize,
    prevs: QueuedPrevs,
}

/// The store's registry of watchers.
pub(crate) struct WatchHub {
    shared: Arc<HubShared>,
    next_id: AtomicU64,
    capacity: usize,
    /// Committed revisions in order, for the notifier. Writers append under a lock the
    /// notifier takes once per batch, so it mostly stays in the writer's cache.
    queue: Mutex<Vec<Dispatch>>,
    /// Set while the notifier waits for a kick; writers kick only then.
    pub(crate) parked: AtomicBool,
    /// Wakes a parked notifier.
    pub(crate) kick: (Sender<()>, Receiver<()>),
    /// Held while dispatching from the queue, so revisions go out in order whoever
    /// dispatches them; holds the batch being dispatched (its allocation is swapped with
    /// the queue's).
    dispatching: Mutex<Vec<Dispatch>>,
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
            queue: Mutex::new(Vec::new()),
            parked: AtomicBool::new(false),
            kick: crossbeam_channel::bounded(1),
            dispatching: Mutex::new(Vec::new()),
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
        // The notifier may be parked for up to `watch_sync_interval`: wake it to see the
        // shutdown, so a store's drop, which joins it, does not wait that long.
        let _ = self.kick.0.try_send(());
    }

    /// Queues the events of `revision` for the notifier thread; called by the committing
    /// writer, in revision order, with the buffer its changes went to (`buf.revs[start..]`,
    /// one entry of `prev_revs` each). The writer neither matches nor sends nor copies: it
    /// queues a reference to the buffer and wakes the notifier only if it is parked. Only
    /// when the notifier is a whole queue behind does the writer dispatch the queue itself,
    /// in order; it never waits for a watcher.
    pub fn notify<B: Backend>(
        &self,
        inner: &Arc<Inner<B>>,
        revision: u64,
        buf: Arc<Pending>,
        start: usize,
        prev_revs: &[Option<Revision>],
    ) {
        let prevs = match prev_revs {
            [one] => QueuedPrevs::One(*one),
            many => QueuedPrevs::Many(many.into()),
        };
        let d = Dispatch {
            revision,
            buf,
            start,
            prevs,
        };
        {
            let mut queue = self.queue.lock();
            if queue.len() < DISPATCH_QUEUE {
                queue.push(d);
                drop(queue);
                if self.parked.load(Ordering::SeqCst) {
                    let _ = self.kick.0.try_send(());
                }
                return;
            }
        }
        // The notifier is a whole queue behind: dispatch here, after everything queued.
        let mut batch = self.dispatching.lock();
        self.drain_locked(inner, &mut batch);
        let mut st = self.shared.state.lock();
        self.dispatch_one(inner, &mut st, &d);
    }

    /// True when nothing waits for dispatch.
    pub(crate) fn queue_is_empty(&self) -> bool {
        self.queue.lock().is_empty()
    }

    /// Dispatches everything queued, in order.
    pub(crate) fn drain<B: Backend>(&self, inner: &Arc<Inner<B>>) {
        let mut batch = self.dispatching.lock();
        self.drain_locked(inner, &mut batch);
    }

    /// [`drain`](WatchHub::drain) with `dispatching` held by the caller (`batch` is its
    /// empty vector): takes the queue whole, then dispatches it holding the watcher lock
    /// for at most [`DISPATCH_BATCH`] revisions at a time.
    ///
    /// Revisions of one change (a put, a delete of one key) take a short path: their
    /// matched records are gathered into one buffer ([`Gathered`]) and sent once it is full
    /// or the batch ends. A revision of several changes, or one a watcher wants previous
    /// pairs for, sends what was gathered first, then goes through
    /// [`dispatch_one`](WatchHub::dispatch_one).
    fn drain_locked<B: Backend>(&self, inner: &Arc<Inner<B>>, batch: &mut Vec<Dispatch>) {
        std::mem::swap(&mut *self.queue.lock(), batch);
        for chunk in batch.chunks(DISPATCH_BATCH) {
            let mut st = self.shared.state.lock();
            let mut gathered = std::mem::take(&mut st.gathered);
            for d in chunk {
                if let QueuedPrevs::One(_) = d.prevs
                    && gathered.gather(&mut st, d)
                {
                    if gathered.bytes.len() >= GATHER_BYTES || gathered.sends.len() >= GATHER_SENDS
                    {
                        self.send_gathered(&mut st, &mut gathered);
                    }
                    continue;
                }
                self.send_gathered(&mut st, &mut gathered);
                self.dispatch_one(inner, &mut st, d);
            }
            self.send_gathered(&mut st, &mut gathered);
            st.gathered = gathered;
        }
        batch.clear();
    }

    /// Sends what `gathered` holds, its records shared in one buffer, and empties it.
    fn send_gathered(&self, st: &mut HubState, gathered: &mut Gathered) {
        if gathered.sends.is_empty() {
            return;
        }
        let bytes: Arc<[u8]> = Arc::from(gathered.bytes.as_slice());
        gathered.bytes.clear();
        let mut gone = Vec::new();
        for &(slot, revision, start, end) in &gathered.sends {
            let Some(w) = st.watchers.at(slot) else {
                continue;
            };
            // A send before this one may have found the watcher's channel full: the
            // syncer now catches it up from there.
            if !w.synced || w.next_rev > revision {
                continue;
            }
            let part = Part {
                rev: Shared::One(Window {
                    bytes: bytes.clone(),
                    start,
                    end,
                }),
                pick: Pick::All,
                prev_kv: false,
            };
            let id = w.id;
            match w.tx.try_send(id, Msg::One(part)) {
                Ok(()) => {}
                Err(TrySendError::Full(())) => st.set_unsynced(id, revision),
                Err(TrySendError::Disconnected(())) => gone.push(id),
            }
        }
        gathered.sends.clear();
        // One revision matched by very many watchers may have grown the list far past
        // GATHER_SENDS: do not keep that.
        gathered.sends.shrink_to(GATHER_SENDS);
        for id in gone {
            if st.remove(id).is_some() {
                self.shared.count.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Hands the events of one queued revision to synced watchers. Never blocks on a
    /// watcher. A change no watcher matches costs one key lookup; a matched change's record
    /// is copied out of the write buffer once and shared by every delivery.
    ///
    /// The buffer is read-locked for [`LOCKED_CHANGES`] changes at a time, to match or to
    /// copy, and never while resolving previous pairs: a committing writer waits for the
    /// buffer's write lock holding the store's state lock, which every read view's opening
    /// (a previous pair's, any reader's) takes.
    fn dispatch_one<B: Backend>(&self, inner: &Arc<Inner<B>>, st: &mut HubState, d: &Dispatch) {
        let &Dispatch {
            revision,
            ref buf,
            start,
            ref prevs,
        } = d;
        st.last_notified = st.last_notified.max(revision);
        let prevs = prevs.as_slice();
        let mut matches = std::mem::take(&mut st.scratch);
        matches.clear();
        let mut any_prev = false;
        // The record of a one-change revision someone matched, copied under the same lock.
        let mut only: Option<Arc<[u8]>> = None;
        for first in (0..prevs.len()).step_by(LOCKED_CHANGES) {
            let changes = buf.changes.read();
            let end = prevs.len().min(first + LOCKED_CHANGES);
            debug_assert!(
                changes.revs.len() >= start + end,
                "a queued revision's changes"
            );
            let revs = changes
                .revs
                .get(start + first..start + end)
                .unwrap_or_default();
            for (i, p) in (first..).zip(revs) {
                let record = changes.record(p);
                let Some(key) = record_key(record) else {
                    continue;
                };
                let watchers = &st.watchers;
                st.matcher.for_each_match(key, |slot| {
                    if let Some(w) = watchers.at(slot)
                        && w.synced
                        && w.next_rev <= revision
                    {
                        matches.push((slot, i as u32));
                        any_prev |= w.prev_kv;
                    }
                });
                if prevs.len() == 1 && !matches.is_empty() {
                    only = Some(Arc::from(record));
                }
            }
        }
        if matches.is_empty() {
            st.scratch = matches;
            return;
        }
        // Matched changes are in the buffer (it only grows).
        let rev_changes = match only {
            // One change, watchers not asking for its previous pair: share the record alone.
            Some(record) if !any_prev => match Window::whole(record) {
                Some(window) => Shared::One(window),
                None => {
                    st.scratch = matches;
                    return;
                }
            },
            _ => {
                if matches.len() > 1 {
                    matches.sort_unstable();
                }
                // The changes someone matched, ascending, each copied once; previous pairs only
                // for changes a prev_kv watcher matched.
                let mut used: Vec<(u32, bool)> = matches
                    .iter()
                    .map(|&(slot, i)| (i, st.watchers.at(slot).is_some_and(|w| w.prev_kv)))
                    .collect();
                used.sort_unstable();
                // One entry per change, wanting the previous pair if any of its watchers does.
                used.dedup_by(|later, earlier| {
                    if later.0 == earlier.0 {
                        earlier.1 |= later.1;
                        true
                    } else {
                        false
                    }
                });
                let mut changes: Vec<Change> = Vec::with_capacity(used.len());
                for part in used.chunks(LOCKED_CHANGES) {
                    let buffered = buf.changes.read();
                    changes.extend(part.iter().map(|&(i, _)| {
                        let p = &buffered.revs[start + i as usize];
                        Change {
                            tombstone: p.tombstone,
                            record: Arc::from(buffered.record(p)),
                            prev: None,
                        }
                    }));
                }
                // With the buffer unlocked (see above).
                let mut view: Option<Option<ReadView<B>>> = None;
                for (change, &(i, want_prev)) in changes.iter_mut().zip(&used) {
                    let prev = prevs[i as usize];
                    if want_prev && prev.is_some() {
                        let v = view.get_or_insert_with(|| ReadView::open(inner).ok());
                        change.prev = resolve_prev(inner, v.as_ref(), prev).map(Arc::new);
                    }
                }
                for m in matches.iter_mut() {
                    m.1 = used.partition_point(|u| u.0 < m.1) as u32;
                }
                Shared::Many(Arc::new(RevChanges { changes }))
            }
        };
        let total = match &rev_changes {
            Shared::One(_) => 1,
            Shared::Many(rev) => rev.changes.len(),
        };
        let mut gone = Vec::new();
        // The last watcher takes the shared changes themselves, the others a new reference.
        let mut groups = matches.chunk_by(|a, b| a.0 == b.0).count();
        let mut rev_changes = Some(rev_changes);
        for group in matches.chunk_by(|a, b| a.0 == b.0) {
            groups -= 1;
            let Some(w) = st.watchers.at(group[0].0) else {
                continue;
            };
            let rev = if groups == 0 {
                rev_changes.take()
            } else {
                rev_changes.clone()
            };
            let Some(rev) = rev else {
                break;
            };
            let id = w.id;
            let pick = if group.len() == total {
                Pick::All
            } else {
                Pick::Some(group.iter().map(|m| m.1).collect())
            };
            let part = Part {
                rev,
                pick,
                prev_kv: w.prev_kv,
            };
            match w.tx.try_send(id, Msg::One(part)) {
                Ok(()) => {}
                Err(TrySendError::Full(())) => st.set_unsynced(id, revision),
                Err(TrySendError::Disconnected(())) => gone.push(id),
            }
        }
        st.scratch = matches;
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
    rx: Receiver<Msg>,
    /// Responses of a received batch not yet handed out.
    ready: Mutex<VecDeque<Events>>,
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

    /// The next response already split from a received message.
    fn pop_ready(&self) -> Option<Events> {
        self.ready.lock().pop_front()
    }

    /// Splits `msg` and returns its first response, keeping the rest.
    fn unpack(&self, msg: Msg) -> Option<Events> {
        self.received();
        match msg {
            // The common case: one revision, handed out as is.
            Msg::One(part) => Some(part.into_events()).filter(|e| !e.is_empty()),
            msg => {
                let mut ready = self.ready.lock();
                msg.split_into(&mut ready);
                ready.pop_front()
            }
        }
    }

    /// Waits for the events of the next revision that touched the watched keys. Fails with
    /// [`MvccError::Compacted`] when the watcher fell below the compaction point, or
    /// [`MvccError::WatchClosed`] after the store was dropped.
    pub fn recv(&self) -> Result<Events, MvccError> {
        loop {
            if let Some(events) = self.pop_ready() {
                return Ok(events);
            }
            let msg = self.rx.recv().map_err(|_| self.ended())?;
            if let Some(events) = self.unpack(msg) {
                return Ok(events);
            }
        }
    }

    /// Like [`recv`](Watcher::recv) but gives up after `timeout` with `Ok(None)`.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<Option<Events>, MvccError> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(events) = self.pop_ready() {
                return Ok(Some(events));
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(msg) => {
                    if let Some(events) = self.unpack(msg) {
                        return Ok(Some(events));
                    }
                }
                Err(RecvTimeoutError::Timeout) => return Ok(None),
                Err(RecvTimeoutError::Disconnected) => return Err(self.ended()),
            }
        }
    }

    /// The next revision's events if already delivered.
    pub fn try_recv(&self) -> Result<Option<Events>, MvccError> {
        loop {
            if let Some(events) = self.pop_ready() {
                return Ok(Some(events));
            }
            match self.rx.try_recv() {
                Ok(msg) => {
                    if let Some(events) = self.unpack(msg) {
                        return Ok(Some(events));
                    }
                }
                Err(TryRecvError::Empty) => return Ok(None),
                Err(TryRecvError::Disconnected) => return Err(self.ended()),
            }
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
    let end = match req.range_end.as_deref() {
        None => None,
        Some([0]) => Some(End::Unbounded),
        Some(e) => Some(End::Key(e.into())),
    };
    let (tx, rx) = match stream {
        Some(t) => (t, crossbeam_channel::never()),
        None => {
            let (tx, rx) = crossbeam_channel::bounded(hub.capacity);
            (Target::Own(tx), rx)
        }
    };
    let info = Arc::new(WatchEnd::default());
    let id = hub.next_id.fetch_add(1, Ordering::Relaxed);
    let key: Arc<[u8]> = req.key.into();
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
    let synced = start > current;
    let mut st = hub.shared.state.lock();
    st.last_notified = st.last_notified.max(current);
    let slot = st.watchers.insert(WatcherState {
        id,
        key: key.clone(),
        end: end.clone(),
        prev_kv: req.prev_kv,
        tx,
        info: info.clone(),
        next_rev: start,
        synced,
    });
    st.matcher.insert(u64::from(slot), &key, end.as_ref());
    hub.shared.count.fetch_add(1, Ordering::AcqRel);
    if !synced {
        info.lagging.store(true, Ordering::Release);
        st.unsynced.insert(id);
        let _ = hub.shared.wake.0.try_send(());
    }
    Ok(Watcher {
        id,
        rx,
        ready: Mutex::new(VecDeque::new()),
        end: info,
        hub: Arc::downgrade(&hub.shared),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::mem_store;

    /// A run of puts matched by many watchers of one prefix is sent in parts, and the
    /// gathering keeps no more than [`GATHER_SENDS`] deliveries' room between batches.
    #[test]
    fn gathering_for_many_watchers_stays_bounded() {
        let (_d, s) = mem_store(StoreOptions {
            watch_channel_capacity: 512,
            ..StoreOptions::default()
        });
        let watchers: Vec<_> = (0..2_000)
            .map(|_| s.watch(WatchRequest::prefix(b"p".to_vec())).unwrap())
            .collect();
        let hub = &s.inner.watch;
        {
            // Held, the notifier cannot dispatch: the puts queue up as one batch.
            let _hold = hub.dispatching.lock();
            for i in 0..256u32 {
                s.put(format!("p{i}").as_bytes(), b"v", 0).unwrap();
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !hub.queue_is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "the queue never drained"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        drop(hub.dispatching.lock());
        let kept = hub.shared.state.lock().gathered.sends.capacity();
        assert!(kept <= GATHER_SENDS, "{kept} deliveries' room kept");
        // Every watcher still got every put, in order.
        for w in &watchers {
            let mut seen = 0u32;
            while let Some(events) = w.try_recv().unwrap() {
                for e in &events {
                    assert_eq!(e.key(), format!("p{seen}").as_bytes());
                    seen += 1;
                }
            }
            assert_eq!(seen, 256);
        }
    }
}
