//! How members reach each other.
//!
//! A [`Transport`] carries two kinds of traffic on separate paths, so a large snapshot never
//! delays heartbeats:
//!
//! - **Raft messages** ([`Transport::send`]): small, best effort, may be dropped, delayed or
//!   reordered; Raft tolerates all three.
//! - **The snapshot stream** ([`Transport::send_snapshot`]): a sequence of
//!   [`SnapshotFrame::Chunk`]s, each with its own CRC-32, the first carrying the Raft
//!   `MsgSnapshot` (metadata only: index, term, conf state), the last carrying the length and
//!   CRC-32 of the whole stream; the receiver answers with one [`SnapshotFrame::Ack`].
//!
//! Each member receives through a [`Mailbox`]: one channel per path.
//!
//! [`MemNetwork`] is the in-memory implementation used by the simulation harness and the
//! benchmarks, with fault injection: a drop rate, a random delay, one-way and two-way
//! partitions, isolating a member, corrupting snapshot chunks in flight, and stalling a
//! snapshot sender inside `send_snapshot` (a peer that never reads).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, unbounded};
use parking_lot::{Mutex, RwLock};
use raft::eraftpb::Message;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::NodeError;

/// One frame of the snapshot path.
#[derive(Clone, Debug)]
pub enum SnapshotFrame {
    /// A piece of a snapshot stream.
    Chunk(SnapshotChunk),
    /// The receiver's verdict on a whole transfer.
    Ack(SnapshotAck),
}

impl SnapshotFrame {
    fn route(&self) -> (u64, u64) {
        match self {
            SnapshotFrame::Chunk(c) => (c.from, c.to),
            SnapshotFrame::Ack(a) => (a.from, a.to),
        }
    }
}

/// A piece of a snapshot stream.
#[derive(Clone, Debug)]
pub struct SnapshotChunk {
    /// Sender (the leader).
    pub from: u64,
    /// Receiver.
    pub to: u64,
    /// Identifies the transfer; unique per sender.
    pub transfer: u64,
    /// Position of this chunk in the transfer, from 0.
    pub seq: u32,
    /// The Raft `MsgSnapshot` (metadata, no data); present in chunk 0 only.
    pub message: Option<Box<Message>>,
    /// Stream bytes.
    pub data: Vec<u8>,
    /// CRC-32 (IEEE) of `data`.
    pub crc: u32,
    /// Present on the last chunk: `(stream length, CRC-32 of the whole stream)`.
    pub end: Option<(u64, u32)>,
}

/// The receiver's verdict on a snapshot transfer.
#[derive(Clone, Debug)]
pub struct SnapshotAck {
    /// The receiver, answering.
    pub from: u64,
    /// The original sender.
    pub to: u64,
    /// The transfer answered.
    pub transfer: u64,
    /// `None` when the snapshot was verified and stored; otherwise why it was refused.
    pub error: Option<String>,
}

/// What a member receives: Raft messages and snapshot frames, on separate channels.
pub struct Mailbox {
    /// Raft messages addressed to this member.
    pub raft: Receiver<Message>,
    /// Snapshot frames addressed to this member.
    pub snapshots: Receiver<SnapshotFrame>,
}

/// Sends messages from one member to its peers.
///
/// Implementations must be cheap to call from the Raft thread: `send` must not block on
/// the network.
pub trait Transport: Send + Sync + 'static {
    /// Sends a Raft message to `msg.to`, best effort: it may be lost, delayed or reordered.
    fn send(&self, msg: Message);

    /// Sends one frame of the snapshot path to its destination. An error means the frame
    /// surely did not arrive (unknown or unreachable member); `Ok` promises nothing more
    /// than [`send`](Transport::send) does.
    ///
    /// `cancelled` says whether the frame's transfer is still wanted. A transport that makes
    /// the frame wait before writing it (for a rate limit, as
    /// [`TcpTransport`](crate::TcpTransport) does) asks it at least every
    /// [`WAIT_SLICE`](crate::tcp::limiter::WAIT_SLICE) of the wait: once it returns true,
    /// the frame is not sent, the budget it had reserved is given back, and the call fails
    /// at once with [`NodeError::Snapshot`]. A transport that does not wait need not ask it.
    /// Senders of frames that are always wanted (acks) pass `&mut || false`.
    fn send_snapshot(
        &self,
        frame: SnapshotFrame,
        cancelled: &mut dyn FnMut() -> bool,
    ) -> Result<(), NodeError>;

    /// A member was added, or its peer URLs changed, in the applied membership: a transport
    /// that dials addresses learns where to reach it. Default: nothing (the in-memory
    /// network routes by id).
    fn peer_added(&self, id: u64, peer_urls: &[String]) {
        let _ = (id, peer_urls);
    }

    /// A member was removed from the applied membership. Default: nothing.
    fn peer_removed(&self, id: u64) {
        let _ = id;
    }
}

/// Faults currently injected into a [`MemNetwork`].
#[derive(Clone, Debug, Default)]
struct Faults {
    drop_rate: f64,
    delay: Option<(Duration, Duration)>,
    /// Directed links that lose everything: `(from, to)`.
    cut: HashSet<(u64, u64)>,
    corrupt_chunks: u32,
}

struct Endpoint {
    raft: Sender<Message>,
    snapshots: Sender<SnapshotFrame>,
}

enum Payload {
    Raft(Message),
    Snapshot(SnapshotFrame),
}

struct Delayed {
    at: Instant,
    seq: u64,
    to: u64,
    payload: Payload,
}

impl PartialEq for Delayed {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for Delayed {}
impl PartialOrd for Delayed {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Delayed {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// Snapshot chunks made to stall (see [`MemNetwork::stall_snapshot_chunks`]).
#[derive(Default)]
struct Stalls {
    /// Per receiver, how many of its next chunks stall.
    pending: HashMap<u64, u32>,
    /// Chunks that have stalled so far.
    stalled: u64,
    /// Bumped by each release: a sender stalled before it goes on.
    epoch: u64,
}

struct Inner {
    endpoints: RwLock<HashMap<u64, Endpoint>>,
    faults: Mutex<Faults>,
    stalls: Mutex<Stalls>,
    released: parking_lot::Condvar,
    rng: Mutex<StdRng>,
    delayer: Sender<Delayed>,
    seq: AtomicU64,
    sent: AtomicU64,
    dropped: AtomicU64,
}

/// An in-memory network of members with fault injection. Cheap to clone; clones share the
/// network.
#[derive(Clone)]
pub struct MemNetwork {
    inner: Arc<Inner>,
}

impl Default for MemNetwork {
    fn default() -> Self {
        MemNetwork::new(0)
    }
}

impl MemNetwork {
    /// An empty network with no faults; `seed` drives the drop and delay choices.
    pub fn new(seed: u64) -> MemNetwork {
        let (tx, rx) = unbounded::<Delayed>();
        let inner = Arc::new(Inner {
            endpoints: RwLock::new(HashMap::new()),
            faults: Mutex::new(Faults::default()),
            stalls: Mutex::new(Stalls::default()),
            released: parking_lot::Condvar::new(),
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            delayer: tx,
            seq: AtomicU64::new(0),
            sent: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&inner);
        thread::Builder::new()
            .name("keel-memnet-delay".into())
            .spawn(move || delay_loop(weak, rx))
            .map(drop)
            .unwrap_or_else(|e| tracing::error!("cannot start the delay thread: {e}"));
        MemNetwork { inner }
    }

    /// Attaches member `id`: returns its transport and its mailbox. Re-registering an id
    /// (a restarted member) replaces the old mailbox.
    pub fn register(&self, id: u64) -> (MemTransport, Mailbox) {
        let (raft_tx, raft_rx) = unbounded();
        let (snap_tx, snap_rx) = unbounded();
        self.inner.endpoints.write().insert(
            id,
            Endpoint {
                raft: raft_tx,
                snapshots: snap_tx,
            },
        );
        (
            MemTransport {
                id,
                net: self.clone(),
            },
            Mailbox {
                raft: raft_rx,
                snapshots: snap_rx,
            },
        )
    }

    /// Detaches member `id` (it crashed): messages to it are lost.
    pub fn unregister(&self, id: u64) {
        self.inner.endpoints.write().remove(&id);
    }

    /// Loses each message (and snapshot frame) with probability `rate` in `[0, 1]`.
    pub fn set_drop_rate(&self, rate: f64) {
        self.inner.faults.lock().drop_rate = rate.clamp(0.0, 1.0);
    }

    /// Delays each delivery by a uniformly random time in `[min, max]` (`None`: no delay).
    /// Random delays reorder messages.
    pub fn set_delay(&self, delay: Option<(Duration, Duration)>) {
        self.inner.faults.lock().delay = delay;
    }

    /// Cuts the link from `from` to `to` only.
    pub fn cut_one_way(&self, from: u64, to: u64) {
        self.inner.faults.lock().cut.insert((from, to));
    }

    /// Cuts every link between a member of `a` and a member of `b`, both ways.
    pub fn partition(&self, a: &[u64], b: &[u64]) {
        let mut f = self.inner.faults.lock();
        for &x in a {
            for &y in b {
                f.cut.insert((x, y));
                f.cut.insert((y, x));
            }
        }
    }

    /// Cuts member `id` from every other registered member, both ways.
    pub fn isolate(&self, id: u64) {
        let others: Vec<u64> = self.inner.endpoints.read().keys().copied().collect();
        self.partition(&[id], &others);
    }

    /// Removes every partition and cut link (drop rate and delay stay).
    pub fn heal(&self) {
        self.inner.faults.lock().cut.clear();
    }

    /// Removes every fault, and releases the stalled snapshot senders (see
    /// [`release_stalled_snapshot_chunks`](Self::release_stalled_snapshot_chunks)).
    pub fn clear_faults(&self) {
        *self.inner.faults.lock() = Faults::default();
        self.release_stalled_snapshot_chunks();
    }

    /// Makes each of the next `n` snapshot chunks addressed to member `to` (while it is
    /// attached) stall: its sender blocks inside `send_snapshot`, as on a connection whose
    /// peer never reads, until
    /// [`release_stalled_snapshot_chunks`](Self::release_stalled_snapshot_chunks), and the
    /// chunk is then lost.
    pub fn stall_snapshot_chunks(&self, to: u64, n: u32) {
        self.inner.stalls.lock().pending.insert(to, n);
    }

    /// Snapshot chunks that have stalled so far.
    pub fn stalled_snapshot_chunks(&self) -> u64 {
        self.inner.stalls.lock().stalled
    }

    /// Wakes every sender stalled in `send_snapshot` (its chunk is lost) and cancels the
    /// stalls not begun yet.
    pub fn release_stalled_snapshot_chunks(&self) {
        let mut stalls = self.inner.stalls.lock();
        stalls.pending.clear();
        stalls.epoch += 1;
        self.inner.released.notify_all();
    }

    /// Blocks the caller if a chunk to `to` is due to stall, until it is released; returns
    /// whether it stalled.
    fn stall(&self, to: u64) -> bool {
        let mut stalls = self.inner.stalls.lock();
        match stalls.pending.get_mut(&to) {
            Some(n) if *n > 0 => *n -= 1,
            _ => return false,
        }
        stalls.stalled += 1;
        let epoch = stalls.epoch;
        while stalls.epoch == epoch {
            self.inner.released.wait(&mut stalls);
        }
        true
    }

    /// Flips one byte in each of the next `n` snapshot chunks that carry data.
    pub fn corrupt_snapshot_chunks(&self, n: u32) {
        self.inner.faults.lock().corrupt_chunks = n;
    }

    /// `(messages and frames handed to the network, of which lost)`.
    pub fn stats(&self) -> (u64, u64) {
        (
            self.inner.sent.load(Ordering::Relaxed),
            self.inner.dropped.load(Ordering::Relaxed),
        )
    }

    /// Decides the fate of one delivery: `None` = lost, `Some(None)` = now, `Some(Some(d))` =
    /// after `d`.
    fn fate(&self, from: u64, to: u64) -> Option<Option<Duration>> {
        self.inner.sent.fetch_add(1, Ordering::Relaxed);
        let f = self.inner.faults.lock();
        if f.cut.contains(&(from, to)) {
            self.inner.dropped.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let mut rng = self.inner.rng.lock();
        if f.drop_rate > 0.0 && rng.random_bool(f.drop_rate) {
            self.inner.dropped.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(f.delay.map(|(lo, hi)| {
            if hi <= lo {
                lo
            } else {
                rng.random_range(lo..=hi)
            }
        }))
    }

    fn deliver(&self, to: u64, payload: Payload, delay: Option<Duration>) -> bool {
        if let Some(d) = delay.filter(|d| !d.is_zero()) {
            let item = Delayed {
                at: Instant::now() + d,
                seq: self.inner.seq.fetch_add(1, Ordering::Relaxed),
                to,
                payload,
            };
            return self.inner.delayer.send(item).is_ok();
        }
        deliver_now(&self.inner, to, payload)
    }
}

fn deliver_now(inner: &Inner, to: u64, payload: Payload) -> bool {
    let endpoints = inner.endpoints.read();
    let Some(ep) = endpoints.get(&to) else {
        return false;
    };
    match payload {
        Payload::Raft(m) => ep.raft.send(m).is_ok(),
        Payload::Snapshot(f) => ep.snapshots.send(f).is_ok(),
    }
}

fn delay_loop(inner: Weak<Inner>, rx: Receiver<Delayed>) {
    let mut heap: BinaryHeap<Reverse<Delayed>> = BinaryHeap::new();
    loop {
        let timeout = heap
            .peek()
            .map(|Reverse(d)| d.at.saturating_duration_since(Instant::now()))
            .unwrap_or(Duration::from_millis(200));
        match rx.recv_timeout(timeout) {
            Ok(d) => heap.push(Reverse(d)),
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        }
        let now = Instant::now();
        while heap.peek().is_some_and(|Reverse(d)| d.at <= now) {
            let Some(Reverse(d)) = heap.pop() else { break };
            let Some(inner) = inner.upgrade() else { return };
            deliver_now(&inner, d.to, d.payload);
        }
    }
}

/// One member's handle on a [`MemNetwork`].
#[derive(Clone)]
pub struct MemTransport {
    id: u64,
    net: MemNetwork,
}

impl Transport for MemTransport {
    fn send(&self, msg: Message) {
        let to = msg.to;
        if let Some(delay) = self.net.fate(self.id, to) {
            self.net.deliver(to, Payload::Raft(msg), delay);
        }
    }

    /// Never waits but in a stall, which stands for a write blocked on a peer that does not
    /// read and so does not ask `cancelled` either.
    fn send_snapshot(
        &self,
        mut frame: SnapshotFrame,
        _cancelled: &mut dyn FnMut() -> bool,
    ) -> Result<(), NodeError> {
        let (from, to) = frame.route();
        if !self.net.inner.endpoints.read().contains_key(&to) {
            return Err(NodeError::Unreachable {
                to,
                reason: "not attached to the network".into(),
            });
        }
        if matches!(frame, SnapshotFrame::Chunk(_)) && self.net.stall(to) {
            return Ok(());
        }
        let Some(delay) = self.net.fate(from, to) else {
            return Ok(());
        };
        if let SnapshotFrame::Chunk(c) = &mut frame
            && !c.data.is_empty()
        {
            let mut f = self.net.inner.faults.lock();
            if f.corrupt_chunks > 0 {
                f.corrupt_chunks -= 1;
                let at = c.data.len() / 2;
                c.data[at] ^= 0x5a;
            }
        }
        self.net.deliver(to, Payload::Snapshot(frame), delay);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use raft::eraftpb::MessageType;

    fn msg(from: u64, to: u64) -> Message {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgHeartbeat);
        m.from = from;
        m.to = to;
        m
    }

    #[test]
    fn partitions_cut_exactly_the_named_links() {
        let net = MemNetwork::new(1);
        let (t1, _m1) = net.register(1);
        let (t2, m2) = net.register(2);
        let (_t3, m3) = net.register(3);
        net.cut_one_way(1, 2);
        t1.send(msg(1, 2));
        t1.send(msg(1, 3));
        assert!(m2.raft.try_recv().is_err(), "1 -> 2 is cut");
        assert_eq!(m3.raft.try_recv().map(|m| m.from).ok(), Some(1));
        t2.send(msg(2, 3));
        assert!(m3.raft.try_recv().is_ok(), "2 -> 3 still works");
        net.isolate(3);
        t2.send(msg(2, 3));
        assert!(m3.raft.try_recv().is_err());
        net.heal();
        t2.send(msg(2, 3));
        assert!(m3.raft.try_recv().is_ok());
    }

    #[test]
    fn drop_rate_and_delay_apply() {
        let net = MemNetwork::new(7);
        let (t1, _m1) = net.register(1);
        let (_t2, m2) = net.register(2);
        net.set_drop_rate(1.0);
        for _ in 0..10 {
            t1.send(msg(1, 2));
        }
        assert!(m2.raft.try_recv().is_err());
        assert_eq!(net.stats(), (10, 10));
        net.set_drop_rate(0.0);
        net.set_delay(Some((Duration::from_millis(30), Duration::from_millis(30))));
        let start = Instant::now();
        t1.send(msg(1, 2));
        assert!(
            m2.raft.try_recv().is_err(),
            "not delivered before the delay"
        );
        let got = m2.raft.recv_timeout(Duration::from_secs(2));
        assert!(got.is_ok());
        assert!(start.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn snapshot_chunks_can_be_corrupted_and_unknown_members_are_errors() {
        let net = MemNetwork::new(3);
        let (t1, _m1) = net.register(1);
        let (_t2, m2) = net.register(2);
        net.corrupt_snapshot_chunks(1);
        let data = vec![1u8; 64];
        let chunk = SnapshotChunk {
            from: 1,
            to: 2,
            transfer: 1,
            seq: 0,
            message: None,
            crc: crc32fast::hash(&data),
            data,
            end: None,
        };
        t1.send_snapshot(SnapshotFrame::Chunk(chunk.clone()), &mut || false)
            .unwrap_or(());
        t1.send_snapshot(SnapshotFrame::Chunk(chunk), &mut || false)
            .unwrap_or(());
        let a = m2.snapshots.try_recv();
        let b = m2.snapshots.try_recv();
        match (a, b) {
            (Ok(SnapshotFrame::Chunk(a)), Ok(SnapshotFrame::Chunk(b))) => {
                assert_ne!(crc32fast::hash(&a.data), a.crc, "first chunk corrupted");
                assert_eq!(crc32fast::hash(&b.data), b.crc, "second chunk intact");
            }
            other => panic!("expected two chunks, got {other:?}"),
        }
        let ack = SnapshotFrame::Ack(SnapshotAck {
            from: 1,
            to: 9,
            transfer: 1,
            error: None,
        });
        assert!(t1.send_snapshot(ack, &mut || false).is_err());
    }
}
