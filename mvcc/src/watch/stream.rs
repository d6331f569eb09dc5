//! [`WatchStream`]: many watchers behind one bounded channel (etcd's `watchStream`).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use parking_lot::Mutex;

use super::index::FxMap;
use super::{Events, HubShared, Msg, Target, WatchRequest, Watcher, watch_in};
use crate::backend::Backend;
use crate::error::MvccError;
use crate::store::Inner;

/// What the hub and a [`WatchStream`] share besides the channel.
#[derive(Default)]
pub(super) struct StreamShared {
    /// Watchers of the stream that ended, with why.
    pub ended: Mutex<VecDeque<(u64, MvccError)>>,
    /// Set when a watcher of the stream found the channel full: receiving then wakes the
    /// syncer once the channel has room.
    pub lagging: AtomicBool,
}

/// What a [`WatchStream`] yields.
#[derive(Debug)]
pub enum StreamItem {
    /// The events of one revision for one watcher of the stream.
    Events {
        /// The watcher's id (as returned by [`WatchStream::watch`]).
        id: u64,
        /// The changes, in revision order within the revision.
        events: Events,
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
    tx: Option<Sender<(u64, Msg)>>,
    rx: Receiver<(u64, Msg)>,
    shared: Arc<StreamShared>,
    hub: Weak<HubShared>,
    /// The stream's watchers; their handles carry no channel of their own.
    watchers: FxMap<u64, Watcher>,
    /// Set once a watcher of the stream was cancelled or ended: responses in the channel
    /// are then checked against `watchers` (until then every response is for a live one).
    some_left: bool,
    /// Responses of a received batch not yet handed out, with their watcher.
    ready: VecDeque<(u64, Events)>,
    /// Scratch for splitting a message.
    split: VecDeque<Events>,
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
            watchers: FxMap::default(),
            some_left: false,
            ready: VecDeque::new(),
            split: VecDeque::new(),
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
        let known = self.watchers.remove(&id).is_some();
        self.some_left |= known;
        known
    }

    /// True when `id` is no longer a watcher of the stream.
    fn left(&self, id: u64) -> bool {
        self.some_left && !self.watchers.contains_key(&id)
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
        while let Some((id, error)) = ended.pop_front() {
            if self.watchers.remove(&id).is_some() {
                self.some_left = true;
                return Some(StreamItem::Ended { id, error });
            }
        }
        None
    }

    /// The next response already split from a received message, skipping cancelled
    /// watchers.
    fn next_ready(&mut self) -> Option<StreamItem> {
        while let Some((id, events)) = self.ready.pop_front() {
            if !self.left(id) {
                return Some(StreamItem::Events { id, events });
            }
        }
        None
    }

    /// Turns a received message into an item; `None` for a wake-up or a cancelled watcher.
    fn take(&mut self, (id, msg): (u64, Msg)) -> Option<StreamItem> {
        if self.shared.lagging.load(Ordering::Acquire)
            && self.rx.len() * 2 <= self.rx.capacity().unwrap_or(0)
        {
            self.shared.lagging.store(false, Ordering::Release);
            if let Some(hub) = self.hub.upgrade() {
                let _ = hub.wake.0.try_send(());
            }
        }
        if matches!(msg, Msg::Wake) || self.left(id) {
            return self.next_ended();
        }
        if let Msg::One(part) = msg {
            // The common case: one revision, handed out as is.
            let events = part.into_events();
            return (!events.is_empty()).then_some(StreamItem::Events { id, events });
        }
        msg.split_into(&mut self.split);
        let first = self.split.pop_front();
        self.ready
            .extend(self.split.drain(..).map(|events| (id, events)));
        first.map(|events| StreamItem::Events { id, events })
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
        if let Some(item) = self.next_ready() {
            return Ok(Some(item));
        }
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
        self.some_left = true;
        self.ready.clear();
        Err(MvccError::WatchClosed { id: 0 })
    }
}
