//! [`TcpTransport`]: the [`Transport`] over TCP, on loopback or any address.
//!
//! Each member listens on one address. For every peer it keeps two outgoing connections:
//!
//! - the **Raft connection**, written by a thread of its own from a bounded queue, so
//!   [`Transport::send`] never blocks the Raft loop (a full queue drops the message, which
//!   Raft tolerates);
//! - the **snapshot connection**, written synchronously by [`Transport::send_snapshot`]
//!   (the snapshot sender's thread, which may wait), after taking the frame's bytes from the
//!   shared [`RateLimiter`]. A multi-megabyte transfer therefore occupies its own socket and
//!   its own thread and never queues ahead of a heartbeat.
//!
//! Frames are checksummed and length-bounded ([`frame`] documents the byte layout). An
//! incoming frame that fails its checks closes that connection (counted in
//! [`TcpStats::frames_rejected`]); the sender reconnects. Connection attempts back off
//! exponentially from [`TcpOptions::backoff_min`] to [`TcpOptions::backoff_max`]; while
//! backing off, Raft messages to that peer are dropped and snapshot frames fail with
//! [`NodeError::Unreachable`].
//!
//! Incoming Raft messages and snapshot frames are delivered through a [`Mailbox`], exactly
//! as [`MemTransport`](crate::transport::MemTransport) delivers them, so the node does not
//! know which transport it runs on.

pub mod frame;
pub mod limiter;
pub mod pacer;

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError, bounded, unbounded};
use parking_lot::{Mutex, RwLock};
use raft::eraftpb::{Message, MessageType};

use crate::error::NodeError;
use crate::transport::{Mailbox, SnapshotFrame, Transport};
use frame::{Frame, HEADER_BYTES, Path};
pub use limiter::RateLimiter;
use limiter::Reservation;
use pacer::Pacer;

/// How often blocked threads look at the shutdown flag.
const POLL: Duration = Duration::from_millis(100);
/// Most Raft messages written in one batch.
const BATCH: usize = 256;
/// Snapshot frames received and not yet taken by the member. When it is full, the reader
/// stops reading and TCP flow control holds the sender back: a stream arriving faster than
/// the member restores it waits on the wire instead of piling up in memory. (8, with 16
/// receive buffers pooled, measured no different in the learner bench: 14 alternating runs
/// each on the shared 2-core machine, keel transfer medians within its run-to-run noise,
/// for about 3 200 fewer page faults per 215 MB transfer.)
const SNAPSHOT_QUEUE: usize = 32;

/// Knobs of the TCP transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpOptions {
    /// Time allowed for one connection attempt. Default: 1 s.
    pub connect_timeout: Duration,
    /// First wait after a failed connection attempt; each further failure doubles it.
    /// Default: 50 ms.
    pub backoff_min: Duration,
    /// Longest wait between connection attempts. Default: 2 s.
    pub backoff_max: Duration,
    /// Largest frame payload accepted, checked before allocating. Must hold the largest
    /// snapshot chunk and the largest append message. Default: 64 MiB.
    pub max_frame_bytes: usize,
    /// Raft messages queued per peer before new ones are dropped. Default: 4 096.
    pub raft_queue: usize,
    /// Snapshot bytes per second across all peers; 0 means unlimited. Default: 0.
    pub snapshot_rate: u64,
    /// Bytes the snapshot rate limiter lets through in a burst. Default: 1 MiB.
    pub snapshot_burst: u64,
    /// Time allowed for one write on the snapshot connection. Default: 10 s.
    pub write_timeout: Duration,
    /// Slow snapshot streams down while they make the leader's appends slower (see
    /// [`pacer`]); on top of `snapshot_rate`. It trades transfer rate for the leader's put
    /// latency during a join: with leader and learner on one disk it cut the leader's put p99
    /// during a 222 MB transfer from 3.9–5.0× to 2.6× its idle value, at about one seventh of
    /// the transfer rate.
    /// Default: false (a new member catches up at full speed).
    pub adaptive_snapshot_pacing: bool,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            connect_timeout: Duration::from_secs(1),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            max_frame_bytes: 64 << 20,
            raft_queue: 4096,
            snapshot_rate: 0,
            snapshot_burst: 1 << 20,
            write_timeout: Duration::from_secs(10),
            adaptive_snapshot_pacing: false,
        }
    }
}

impl TcpOptions {
    /// Checks every field.
    pub fn validate(&self) -> Result<(), NodeError> {
        let bad = |s: &str| Err(NodeError::InvalidOption(s.to_owned()));
        if self.connect_timeout.is_zero() || self.write_timeout.is_zero() {
            return bad("connect_timeout and write_timeout must be longer than zero");
        }
        if self.backoff_min.is_zero() || self.backoff_max < self.backoff_min {
            return bad("backoff_min must be above zero and at most backoff_max");
        }
        if self.max_frame_bytes < 4096 || self.max_frame_bytes > u32::MAX as usize {
            return bad("max_frame_bytes must be between 4 KiB and 4 GiB");
        }
        if self.raft_queue == 0 {
            return bad("raft_queue must be at least 1");
        }
        Ok(())
    }
}

/// Counters of a [`TcpTransport`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TcpStats {
    /// Frames written (Raft messages, snapshot chunks and acks).
    pub frames_sent: u64,
    /// Frames received and delivered.
    pub frames_received: u64,
    /// Incoming frames refused (bad magic, version, length or checksum).
    pub frames_rejected: u64,
    /// Outgoing connections established.
    pub connects: u64,
    /// Outgoing connection attempts that failed.
    pub connect_failures: u64,
    /// Raft messages dropped (queue full, peer unreachable, write failed).
    pub raft_dropped: u64,
    /// Snapshot chunk data bytes written.
    pub snapshot_bytes: u64,
    /// The adaptive pacer's current snapshot rate in bytes per second; 0 when unpaced.
    pub snapshot_pacing_rate: u64,
}

#[derive(Default)]
struct Counters {
    frames_sent: AtomicU64,
    frames_received: AtomicU64,
    frames_rejected: AtomicU64,
    connects: AtomicU64,
    connect_failures: AtomicU64,
    raft_dropped: AtomicU64,
    snapshot_bytes: AtomicU64,
}

struct Inner {
    id: u64,
    addr: SocketAddr,
    options: TcpOptions,
    limiter: Arc<RateLimiter>,
    /// Adaptive snapshot pacing, when enabled.
    pacer: Option<Pacer>,
    peers: RwLock<HashMap<u64, Arc<Peer>>>,
    raft_in: Sender<Message>,
    snap_in: Sender<SnapshotFrame>,
    /// Incoming connections by number, so shutdown can close them; each reader removes
    /// its own when it ends.
    accepted: Mutex<HashMap<u64, TcpStream>>,
    next_conn: AtomicU64,
    shutdown: AtomicBool,
    counters: Counters,
}

struct Peer {
    addr: Arc<Mutex<SocketAddr>>,
    raft: Sender<Message>,
    snapshot: Mutex<Conn>,
}

/// One outgoing connection and its reconnect state.
struct Conn {
    stream: Option<TcpStream>,
    next_attempt: Instant,
    backoff: Duration,
}

impl Conn {
    fn new(backoff: Duration) -> Conn {
        Conn {
            stream: None,
            next_attempt: Instant::now(),
            backoff,
        }
    }

    /// The connection, opening it unless a backoff is running.
    fn get(
        &mut self,
        inner: &Inner,
        to: u64,
        addr: SocketAddr,
        path: Path,
    ) -> Result<&mut TcpStream, NodeError> {
        if self.stream.is_none() {
            let now = Instant::now();
            if now < self.next_attempt {
                return Err(NodeError::Unreachable {
                    to,
                    reason: format!(
                        "reconnecting to {addr}, next attempt in {} ms",
                        (self.next_attempt - now).as_millis()
                    ),
                });
            }
            match connect(inner, addr, path) {
                Ok(s) => {
                    inner.counters.connects.fetch_add(1, Ordering::Relaxed);
                    self.backoff = inner.options.backoff_min;
                    self.stream = Some(s);
                }
                Err(e) => {
                    inner
                        .counters
                        .connect_failures
                        .fetch_add(1, Ordering::Relaxed);
                    self.next_attempt = now + self.backoff;
                    self.backoff = (self.backoff * 2).min(inner.options.backoff_max);
                    return Err(NodeError::Unreachable {
                        to,
                        reason: format!("connecting to {addr}: {e}"),
                    });
                }
            }
        }
        self.stream.as_mut().ok_or(NodeError::Unreachable {
            to,
            reason: "no connection".into(),
        })
    }

    fn write(
        &mut self,
        inner: &Inner,
        to: u64,
        addr: SocketAddr,
        path: Path,
        bytes: &[u8],
    ) -> Result<(), NodeError> {
        self.write_parts(inner, to, addr, path, bytes, &[])
    }

    /// Writes `head` then `tail` (a snapshot chunk's data, sent without copying it into the
    /// frame).
    fn write_parts(
        &mut self,
        inner: &Inner,
        to: u64,
        addr: SocketAddr,
        path: Path,
        head: &[u8],
        tail: &[u8],
    ) -> Result<(), NodeError> {
        let stream = self.get(inner, to, addr, path)?;
        let r = write_two(stream, head, tail).and_then(|()| stream.flush());
        if let Err(e) = r {
            self.stream = None;
            self.next_attempt = Instant::now();
            return Err(NodeError::Unreachable {
                to,
                reason: format!("writing to {addr}: {e}"),
            });
        }
        Ok(())
    }
}

/// Writes `a` then `b`, gathering both into the same system calls.
fn write_two(s: &mut TcpStream, mut a: &[u8], mut b: &[u8]) -> io::Result<()> {
    while !a.is_empty() || !b.is_empty() {
        let n = match s.write_vectored(&[io::IoSlice::new(a), io::IoSlice::new(b)]) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "wrote nothing")),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        let from_a = n.min(a.len());
        a = &a[from_a..];
        b = &b[n - from_a..];
    }
    Ok(())
}

fn connect(inner: &Inner, addr: SocketAddr, path: Path) -> io::Result<TcpStream> {
    let s = TcpStream::connect_timeout(&addr, inner.options.connect_timeout)?;
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(inner.options.write_timeout))?;
    let mut hello = Vec::with_capacity(32);
    frame::encode(
        &Frame::Hello {
            from: inner.id,
            path,
        },
        &mut hello,
    )
    .map_err(io::Error::other)?;
    (&s).write_all(&hello)?;
    Ok(s)
}

/// Stops the transport's threads when the last handle is dropped.
struct Guard(Arc<Inner>);

impl Drop for Guard {
    fn drop(&mut self) {
        shutdown(&self.0);
    }
}

fn shutdown(inner: &Inner) {
    if inner.shutdown.swap(true, Ordering::AcqRel) {
        return;
    }
    inner.peers.write().clear();
    for (_, s) in inner.accepted.lock().drain() {
        let _ = s.shutdown(Shutdown::Both);
    }
}

/// A member's TCP endpoint. Cheap to clone; the last clone dropped stops its threads.
#[derive(Clone)]
pub struct TcpTransport {
    inner: Arc<Inner>,
    _guard: Arc<Guard>,
}

impl TcpTransport {
    /// Listens on `addr` (port 0: an ephemeral port, see [`TcpTransport::local_addr`]) as
    /// member `id`; returns the transport and the mailbox incoming traffic is delivered to.
    pub fn bind(
        id: u64,
        addr: impl ToSocketAddrs,
        options: TcpOptions,
    ) -> Result<(TcpTransport, Mailbox), NodeError> {
        options.validate()?;
        let listener =
            TcpListener::bind(addr).map_err(|e| NodeError::io("tcp listener", "bind", e))?;
        let local = listener
            .local_addr()
            .map_err(|e| NodeError::io("tcp listener", "local_addr", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| NodeError::io("tcp listener", "set_nonblocking", e))?;
        let (raft_in, raft_rx) = unbounded();
        let (snap_in, snap_rx) = bounded(SNAPSHOT_QUEUE);
        let inner = Arc::new(Inner {
            id,
            addr: local,
            limiter: Arc::new(RateLimiter::new(
                options.snapshot_rate,
                options.snapshot_burst,
            )),
            pacer: options.adaptive_snapshot_pacing.then(Pacer::new),
            options,
            peers: RwLock::new(HashMap::new()),
            raft_in,
            snap_in,
            accepted: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(0),
            shutdown: AtomicBool::new(false),
            counters: Counters::default(),
        });
        let accept_inner = inner.clone();
        thread::Builder::new()
            .name(format!("keel-tcp-accept-{id}"))
            .spawn(move || accept_loop(accept_inner, listener))
            .map_err(|e| NodeError::io("tcp listener", "spawn accept thread", e))?;
        tracing::info!(member = id, addr = %local, "tcp transport listening");
        Ok((
            TcpTransport {
                _guard: Arc::new(Guard(inner.clone())),
                inner,
            },
            Mailbox {
                raft: raft_rx,
                snapshots: snap_rx,
            },
        ))
    }

    /// The address this member listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// Adds peer `id` at `addr`, or changes the address of a known peer (its connections
    /// are reopened on the next send).
    pub fn add_peer(&self, id: u64, addr: SocketAddr) -> Result<(), NodeError> {
        let inner = &self.inner;
        if let Some(p) = inner.peers.read().get(&id) {
            let mut a = p.addr.lock();
            if *a != addr {
                *a = addr;
                p.snapshot.lock().stream = None;
            }
            return Ok(());
        }
        let (tx, rx) = bounded(inner.options.raft_queue);
        let peer_addr = Arc::new(Mutex::new(addr));
        let peer = Arc::new(Peer {
            addr: peer_addr.clone(),
            raft: tx,
            snapshot: Mutex::new(Conn::new(inner.options.backoff_min)),
        });
        let writer_inner = inner.clone();
        thread::Builder::new()
            .name(format!("keel-tcp-send-{}-{id}", inner.id))
            .spawn(move || raft_writer(writer_inner, id, peer_addr, rx))
            .map_err(|e| NodeError::io("tcp transport", "spawn writer thread", e))?;
        inner.peers.write().insert(id, peer);
        Ok(())
    }

    /// Forgets peer `id`, closing its connections.
    pub fn remove_peer(&self, id: u64) {
        self.inner.peers.write().remove(&id);
    }

    /// The limiter snapshot bytes are taken from; change its rate at run time with
    /// [`RateLimiter::set_rate`].
    pub fn limiter(&self) -> Arc<RateLimiter> {
        self.inner.limiter.clone()
    }

    /// The transport's counters.
    pub fn stats(&self) -> TcpStats {
        let c = &self.inner.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TcpStats {
            frames_sent: l(&c.frames_sent),
            frames_received: l(&c.frames_received),
            frames_rejected: l(&c.frames_rejected),
            connects: l(&c.connects),
            connect_failures: l(&c.connect_failures),
            raft_dropped: l(&c.raft_dropped),
            snapshot_bytes: l(&c.snapshot_bytes),
            snapshot_pacing_rate: self.inner.pacer.as_ref().map_or(0, Pacer::rate),
        }
    }

    /// Stops listening, closes every connection and stops the threads (within about
    /// 100 ms). Later sends are dropped. Idempotent; dropping the last clone does the same.
    pub fn shutdown(&self) {
        shutdown(&self.inner);
    }
}

/// Parses a peer URL such as `http://10.0.1.13:2380` or `127.0.0.1:2380` into an address.
pub fn resolve_peer_url(url: &str) -> Result<SocketAddr, NodeError> {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let hostport = rest.split('/').next().unwrap_or(rest);
    hostport
        .to_socket_addrs()
        .map_err(|e| NodeError::InvalidOption(format!("peer URL {url:?}: {e}")))?
        .next()
        .ok_or_else(|| NodeError::InvalidOption(format!("peer URL {url:?} resolves to nothing")))
}

impl Transport for TcpTransport {
    fn send(&self, msg: Message) {
        let inner = &self.inner;
        let peers = inner.peers.read();
        let Some(peer) = peers.get(&msg.to) else {
            inner.counters.raft_dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if let Some(pacer) = &inner.pacer
            && msg.get_msg_type() == MessageType::MsgAppend
            && let Some(last) = msg.entries.last()
        {
            pacer.append_sent(msg.to, last.index, Instant::now());
        }
        match peer.raft.try_send(msg) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                inner.counters.raft_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// A chunk waits for its bytes in the shared [`RateLimiter`], then in the adaptive
    /// pacer's, asking `cancelled` every [`WAIT_SLICE`](limiter::WAIT_SLICE): a chunk whose
    /// transfer is cancelled meanwhile is not written, and gives back what it reserved in
    /// both.
    fn send_snapshot(
        &self,
        frame: SnapshotFrame,
        cancelled: &mut dyn FnMut() -> bool,
    ) -> Result<(), NodeError> {
        let inner = &self.inner;
        let (to, data_len) = match &frame {
            SnapshotFrame::Chunk(c) => (c.to, c.data.len()),
            SnapshotFrame::Ack(a) => (a.to, 0),
        };
        if inner.shutdown.load(Ordering::Acquire) {
            return Err(NodeError::Unreachable {
                to,
                reason: "the transport is shut down".into(),
            });
        }
        let Some(peer) = inner.peers.read().get(&to).cloned() else {
            return Err(NodeError::Unreachable {
                to,
                reason: "unknown member".into(),
            });
        };
        // A chunk goes out as its frame head followed by its data, never copied.
        let mut head = Vec::with_capacity(256);
        let data: &[u8] = match &frame {
            SnapshotFrame::Chunk(c) => {
                frame::encode_chunk_head(c, &mut head)?;
                &c.data
            }
            SnapshotFrame::Ack(a) => {
                frame::encode(&Frame::Ack(a.clone()), &mut head)?;
                &[]
            }
        };
        let payload = head.len() - HEADER_BYTES + data.len();
        if payload > inner.options.max_frame_bytes {
            return Err(NodeError::Snapshot {
                from: inner.id,
                to,
                reason: format!(
                    "a frame of {} bytes exceeds max_frame_bytes {}",
                    payload + HEADER_BYTES,
                    inner.options.max_frame_bytes
                ),
            });
        }
        if data_len > 0 && !pace(inner, data_len as u64, cancelled) {
            return Err(NodeError::Snapshot {
                from: inner.id,
                to,
                reason: "cancelled while its chunk waited for the snapshot rate limit".into(),
            });
        }
        let addr = *peer.addr.lock();
        peer.snapshot
            .lock()
            .write_parts(inner, to, addr, Path::Snapshot, &head, data)?;
        inner.counters.frames_sent.fetch_add(1, Ordering::Relaxed);
        inner
            .counters
            .snapshot_bytes
            .fetch_add(data_len as u64, Ordering::Relaxed);
        Ok(())
    }

    fn peer_added(&self, id: u64, peer_urls: &[String]) {
        if id == self.inner.id {
            return;
        }
        let resolved = peer_urls.iter().find_map(|u| resolve_peer_url(u).ok());
        match resolved {
            Some(addr) => {
                if let Err(e) = self.add_peer(id, addr) {
                    tracing::warn!(member = self.inner.id, peer = id, error = %e, "cannot add peer");
                }
            }
            None => {
                tracing::warn!(member = self.inner.id, peer = id, urls = ?peer_urls, "no peer URL resolves; the member stays unreachable");
            }
        }
    }

    fn peer_removed(&self, id: u64) {
        TcpTransport::remove_peer(self, id);
    }
}

/// Waits until a chunk of `n` bytes may be sent: for its bytes in the shared limiter, then
/// in the adaptive pacer's. Returns `false`, with both reservations given back (dropped),
/// as soon as `cancelled` says its transfer is no longer wanted; the shared budget is
/// granted only once the pacer lets the chunk go too, so a chunk cancelled while the pacer
/// holds it back gives that budget back as well.
fn pace(inner: &Inner, n: u64, cancelled: &mut dyn FnMut() -> bool) -> bool {
    let chunk = |n| inner.pacer.as_ref().map(|p| p.chunk(n));
    pace_with(&inner.limiter, &chunk, n, cancelled)
}

/// [`pace`] with the shared `limiter` and `paced`, which reserves a chunk's bytes in the
/// pacer (`None`: no pacer).
///
/// A rate can change while a chunk waits for the other one: a shared rate set to unlimited
/// lets the budget's wait end at once, and set back while the pacer holds the chunk, it
/// leaves the budget due later again. So each reservation is granted only once it is due
/// at that moment, and a chunk whose reservation fell due later again waits for it again,
/// instead of being dropped as if its transfer had been cancelled.
fn pace_with<'p>(
    limiter: &RateLimiter,
    paced: &dyn Fn(u64) -> Option<Reservation<'p>>,
    n: u64,
    cancelled: &mut dyn FnMut() -> bool,
) -> bool {
    let mut budget = limiter.reserve_at(n, Instant::now());
    if !budget.wait_unless(cancelled) {
        return false;
    }
    if let Some(mut paced) = paced(n) {
        loop {
            if !paced.wait_unless(cancelled) {
                return false;
            }
            if paced.grant() {
                break;
            }
        }
    }
    loop {
        if budget.grant() {
            return true;
        }
        if !budget.wait_unless(cancelled) {
            return false;
        }
    }
}

fn raft_writer(inner: Arc<Inner>, to: u64, addr: Arc<Mutex<SocketAddr>>, rx: Receiver<Message>) {
    let mut conn = Conn::new(inner.options.backoff_min);
    let mut current = *addr.lock();
    let mut buf = Vec::new();
    loop {
        let first = match rx.recv_timeout(POLL) {
            Ok(m) => m,
            Err(RecvTimeoutError::Timeout) => {
                if inner.shutdown.load(Ordering::Acquire) {
                    return;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let now_addr = *addr.lock();
        if now_addr != current {
            current = now_addr;
            conn.stream = None;
        }
        buf.clear();
        let mut n = 0u64;
        for m in std::iter::once(first).chain(rx.try_iter().take(BATCH - 1)) {
            match frame::encode(&Frame::Raft(m), &mut buf) {
                Ok(()) => n += 1,
                Err(e) => {
                    tracing::warn!(member = inner.id, to, error = %e, "raft message not sent");
                    inner.counters.raft_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        match conn.write(&inner, to, current, Path::Raft, &buf) {
            Ok(()) => {
                inner.counters.frames_sent.fetch_add(n, Ordering::Relaxed);
            }
            Err(e) => {
                tracing::debug!(member = inner.id, to, error = %e, "raft messages dropped");
                inner.counters.raft_dropped.fetch_add(n, Ordering::Relaxed);
            }
        }
    }
}

fn accept_loop(inner: Arc<Inner>, listener: TcpListener) {
    while !inner.shutdown.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, peer)) => {
                let setup = stream
                    .set_nonblocking(false)
                    .and_then(|()| stream.set_read_timeout(Some(POLL)))
                    .and_then(|()| stream.set_nodelay(true))
                    .and_then(|()| stream.try_clone());
                let clone = match setup {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(member = inner.id, %peer, error = %e, "cannot set up an incoming connection");
                        continue;
                    }
                };
                let conn = inner.next_conn.fetch_add(1, Ordering::Relaxed);
                inner.accepted.lock().insert(conn, clone);
                let reader_inner = inner.clone();
                let spawned = thread::Builder::new()
                    .name(format!("keel-tcp-recv-{}", inner.id))
                    .spawn(move || {
                        read_loop(&reader_inner, stream, peer);
                        reader_inner.accepted.lock().remove(&conn);
                    });
                if let Err(e) = spawned {
                    inner.accepted.lock().remove(&conn);
                    tracing::warn!(member = inner.id, error = %e, "cannot start a reader thread");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(10))
            }
            Err(e) => {
                tracing::warn!(member = inner.id, error = %e, "accept failed");
                thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Fills `buf`, waiting through read timeouts; `Ok(false)` on a clean end of stream before
/// the first byte, or on shutdown.
fn read_full(inner: &Inner, s: &mut TcpStream, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        if inner.shutdown.load(Ordering::Acquire) {
            return Ok(false);
        }
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "truncated frame",
                ));
            }
            Ok(n) => got += n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

enum ReadOutcome {
    Frame(Frame),
    Closed,
}

fn read_frame(inner: &Inner, s: &mut TcpStream) -> Result<ReadOutcome, NodeError> {
    let mut hb = [0u8; HEADER_BYTES];
    let io_err = |e| NodeError::io("tcp connection", "read", e);
    if !read_full(inner, s, &mut hb).map_err(io_err)? {
        return Ok(ReadOutcome::Closed);
    }
    let h = frame::parse_header(hb, inner.options.max_frame_bytes)?;
    if frame::is_chunk(&h) {
        return read_chunk(inner, s, &h);
    }
    let mut payload = vec![0u8; h.len];
    if !read_full(inner, s, &mut payload).map_err(io_err)? && h.len > 0 {
        return Ok(ReadOutcome::Closed);
    }
    Ok(ReadOutcome::Frame(frame::decode_owned(&h, payload)?))
}

/// Reads a chunk frame's payload: its head, then its data straight into a buffer of its own
/// (a recycled one, see [`crate::snapshot::buffers`]), which becomes the chunk's.
fn read_chunk(
    inner: &Inner,
    s: &mut TcpStream,
    h: &frame::Header,
) -> Result<ReadOutcome, NodeError> {
    let io_err = |e| NodeError::io("tcp connection", "read", e);
    let short = || {
        NodeError::decode(
            "transport frame",
            frame::HEADER_BYTES + h.len,
            "chunk payload too short",
        )
    };
    let mut head = Vec::with_capacity(64);
    let data_at = loop {
        let need = match frame::chunk_head(&head) {
            frame::ChunkHead::Need(n) => n,
            frame::ChunkHead::DataAt(at) => break at,
        };
        if need > h.len {
            return Err(short());
        }
        let from = head.len();
        head.resize(need, 0);
        if !read_full(inner, s, &mut head[from..]).map_err(io_err)? {
            return Ok(ReadOutcome::Closed);
        }
    };
    if data_at > h.len {
        return Err(short());
    }
    let from = head.len();
    head.resize(data_at, 0);
    if !read_full(inner, s, &mut head[from..]).map_err(io_err)? {
        return Ok(ReadOutcome::Closed);
    }
    let mut data = crate::snapshot::buffers::take(h.len - data_at);
    if !read_full(inner, s, &mut data).map_err(io_err)? && !data.is_empty() {
        return Ok(ReadOutcome::Closed);
    }
    Ok(ReadOutcome::Frame(frame::decode_chunk(h, &head, data)?))
}

/// Hands a snapshot frame to the member, waiting while its queue is full; false once the
/// member is gone or the transport shuts down.
fn deliver_snapshot(inner: &Inner, mut frame: SnapshotFrame) -> bool {
    loop {
        match inner.snap_in.send_timeout(frame, POLL) {
            Ok(()) => return true,
            Err(crossbeam_channel::SendTimeoutError::Timeout(f)) => {
                if inner.shutdown.load(Ordering::Acquire) {
                    return false;
                }
                frame = f;
            }
            Err(crossbeam_channel::SendTimeoutError::Disconnected(_)) => return false,
        }
    }
}

fn read_loop(inner: &Inner, mut s: TcpStream, peer: SocketAddr) {
    let mut from = None;
    loop {
        let f = match read_frame(inner, &mut s) {
            Ok(ReadOutcome::Frame(f)) => f,
            Ok(ReadOutcome::Closed) => break,
            Err(e @ NodeError::Decode { .. }) => {
                inner
                    .counters
                    .frames_rejected
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(member = inner.id, %peer, from, error = %e, "bad frame, closing the connection");
                break;
            }
            Err(e) => {
                tracing::debug!(member = inner.id, %peer, from, error = %e, "connection ended");
                break;
            }
        };
        let delivered = match (f, from) {
            (Frame::Hello { from: f, path }, None) => {
                from = Some(f);
                if path == Path::Snapshot {
                    crate::snapshot::lower_thread_priority();
                }
                continue;
            }
            (Frame::Raft(m), Some(_)) => {
                if let Some(pacer) = &inner.pacer
                    && m.get_msg_type() == MessageType::MsgAppendResponse
                    && !m.reject
                {
                    pacer.append_acked(m.from, m.index, Instant::now());
                }
                inner.raft_in.send(m).is_ok()
            }
            (Frame::Chunk(c), Some(_)) => deliver_snapshot(inner, SnapshotFrame::Chunk(c)),
            (Frame::Ack(a), Some(_)) => deliver_snapshot(inner, SnapshotFrame::Ack(a)),
            (other, _) => {
                inner
                    .counters
                    .frames_rejected
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(member = inner.id, %peer, frame = ?std::mem::discriminant(&other), "frame out of order, closing the connection");
                break;
            }
        };
        if !delivered {
            break;
        }
        inner
            .counters
            .frames_received
            .fetch_add(1, Ordering::Relaxed);
    }
    let _ = s.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::SnapshotChunk;
    use raft::eraftpb::MessageType;

    fn opts() -> TcpOptions {
        TcpOptions {
            backoff_min: Duration::from_millis(10),
            backoff_max: Duration::from_millis(100),
            ..TcpOptions::default()
        }
    }

    fn heartbeat(from: u64, to: u64, n: u64) -> Message {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgHeartbeat);
        m.from = from;
        m.to = to;
        m.commit = n;
        m
    }

    fn chunk(from: u64, to: u64, seq: u32, data: Vec<u8>) -> SnapshotFrame {
        SnapshotFrame::Chunk(SnapshotChunk {
            from,
            to,
            transfer: 1,
            seq,
            message: None,
            crc: crc32fast::hash(&data),
            data,
            end: None,
        })
    }

    fn pair(o: TcpOptions) -> ((TcpTransport, Mailbox), (TcpTransport, Mailbox)) {
        let a = TcpTransport::bind(1, "127.0.0.1:0", o.clone()).expect("bind 1");
        let b = TcpTransport::bind(2, "127.0.0.1:0", o).expect("bind 2");
        a.0.add_peer(2, b.0.local_addr()).expect("peer");
        b.0.add_peer(1, a.0.local_addr()).expect("peer");
        (a, b)
    }

    /// A shared rate set to unlimited while a chunk's budget waited, and back while the
    /// pacer held the chunk, left the budget due later again: the chunk was dropped as if
    /// its transfer had been cancelled. It now waits for its budget again and goes.
    #[test]
    fn a_chunk_waits_again_for_a_budget_that_fell_due_later() {
        // The shared limiter owes 100 bytes at once: its chunk is due in 100 ms.
        let shared = RateLimiter::new(1_000, 0);
        // The pacer holds the chunk back for 20 ms.
        let pacer = RateLimiter::new(5_000, 0);
        let paced = |n| Some(pacer.reserve_at(n, Instant::now()));
        let mut calls = 0;
        let mut toggle = || {
            calls += 1;
            match calls {
                // The budget's first wait slice: the shared rate goes unlimited, so the
                // budget is due at once.
                1 => shared.set_rate(0),
                // The pacer's first wait slice: the shared rate comes back, and the budget,
                // still owing, is due later again.
                2 => shared.set_rate(1_000),
                _ => {}
            }
            false
        };
        let start = Instant::now();
        assert!(
            pace_with(&shared, &paced, 100, &mut toggle),
            "the chunk goes: its transfer was never cancelled"
        );
        assert!(
            start.elapsed() >= Duration::from_millis(100),
            "the chunk waited for its budget, whatever the rate did meanwhile"
        );
    }

    #[test]
    fn messages_and_snapshot_frames_are_delivered_both_ways() {
        let ((ta, ma), (tb, mb)) = pair(opts());
        for n in 0..100 {
            ta.send(heartbeat(1, 2, n));
        }
        for n in 0..100 {
            let m = mb
                .raft
                .recv_timeout(Duration::from_secs(5))
                .expect("delivered");
            assert_eq!(
                (m.from, m.to, m.commit),
                (1, 2, n),
                "in order on one connection"
            );
        }
        tb.send(heartbeat(2, 1, 7));
        assert_eq!(
            ma.raft
                .recv_timeout(Duration::from_secs(5))
                .map(|m| m.commit)
                .ok(),
            Some(7)
        );
        ta.send_snapshot(chunk(1, 2, 0, vec![5; 4096]), &mut || false)
            .expect("chunk");
        match mb.snapshots.recv_timeout(Duration::from_secs(5)) {
            Ok(SnapshotFrame::Chunk(c)) => {
                assert_eq!(c.data, vec![5; 4096]);
                assert_eq!(c.crc, crc32fast::hash(&c.data));
            }
            other => panic!("expected a chunk, got {other:?}"),
        }
        tb.send_snapshot(
            SnapshotFrame::Ack(crate::transport::SnapshotAck {
                from: 2,
                to: 1,
                transfer: 1,
                error: None,
            }),
            &mut || false,
        )
        .expect("ack");
        assert!(matches!(
            ma.snapshots.recv_timeout(Duration::from_secs(5)),
            Ok(SnapshotFrame::Ack(a)) if a.transfer == 1 && a.error.is_none()
        ));
        assert!(
            ta.send_snapshot(chunk(1, 9, 0, vec![1]), &mut || false)
                .is_err(),
            "unknown member"
        );
        assert_eq!(tb.stats().frames_received, 101);
        assert_eq!(ta.stats().frames_sent, 101);
    }

    #[test]
    fn reconnects_after_the_peer_restarts() {
        let ((ta, _ma), (tb, mb)) = pair(opts());
        ta.send(heartbeat(1, 2, 1));
        assert!(mb.raft.recv_timeout(Duration::from_secs(5)).is_ok());
        let addr = tb.local_addr();
        tb.shutdown();
        drop(tb);
        drop(mb);
        // while it is down, sends are dropped, not blocked
        let start = Instant::now();
        for n in 0..50 {
            ta.send(heartbeat(1, 2, n));
        }
        assert!(
            start.elapsed() < Duration::from_millis(100),
            "send never blocks"
        );
        thread::sleep(Duration::from_millis(300));
        let (tb2, mb2) = TcpTransport::bind(2, addr, opts()).expect("rebind the same port");
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut got = None;
        let mut n = 1000;
        while Instant::now() < deadline && got.is_none() {
            ta.send(heartbeat(1, 2, n));
            n += 1;
            got = mb2.raft.recv_timeout(Duration::from_millis(50)).ok();
        }
        let got = got.expect("delivered after the restart");
        assert!(got.commit >= 1000);
        let s = ta.stats();
        assert!(s.connects >= 2, "{s:?}");
        drop(tb2);
    }

    #[test]
    fn corrupt_frames_are_rejected_and_close_the_connection() {
        let (tb, mb) = TcpTransport::bind(2, "127.0.0.1:0", opts()).expect("bind");
        let mut good = Vec::new();
        frame::encode(
            &Frame::Hello {
                from: 1,
                path: Path::Raft,
            },
            &mut good,
        )
        .expect("hello");
        let hello_len = good.len();
        frame::encode(&Frame::Raft(heartbeat(1, 2, 1)), &mut good).expect("raft");
        let mut bad = good.clone();
        let last = bad.len() - 1;
        bad[last] ^= 0x10;
        frame::encode(&Frame::Raft(heartbeat(1, 2, 2)), &mut bad).expect("raft");
        let mut s = TcpStream::connect(tb.local_addr()).expect("connect");
        s.write_all(&bad).expect("write");
        assert!(
            mb.raft.recv_timeout(Duration::from_millis(300)).is_err(),
            "neither the corrupt frame nor the one after it is delivered"
        );
        let deadline = Instant::now() + Duration::from_secs(5);
        while tb.stats().frames_rejected == 0 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(tb.stats().frames_rejected, 1);
        // the receiver closed the connection
        let mut buf = [0u8; 1];
        s.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        assert!(matches!(s.read(&mut buf), Ok(0) | Err(_)));
        // a frame with an oversized length is refused from its header
        let mut s2 = TcpStream::connect(tb.local_addr()).expect("connect");
        let mut huge = good[..hello_len].to_vec();
        let mut h = good[hello_len..hello_len + HEADER_BYTES].to_vec();
        h[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        huge.extend_from_slice(&h);
        s2.write_all(&huge).expect("write");
        while tb.stats().frames_rejected < 2 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(tb.stats().frames_rejected, 2);
        // a fresh, intact connection is served
        let mut s3 = TcpStream::connect(tb.local_addr()).expect("connect");
        s3.write_all(&good).expect("write");
        let m = mb
            .raft
            .recv_timeout(Duration::from_secs(5))
            .expect("intact frame delivered");
        assert_eq!(m.commit, 1);
        // the refused connections were released; the intact one is still held
        drop((s, s2));
        while tb.inner.accepted.lock().len() > 1 && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(tb.inner.accepted.lock().len(), 1);
        drop(s3);
    }

    /// A heartbeat is not delayed behind a multi-megabyte snapshot: 8 MiB stream at
    /// 16 MiB/s (about half a second) while heartbeats go out every 5 ms.
    #[test]
    fn heartbeats_flow_during_a_snapshot_stream() {
        let o = TcpOptions {
            snapshot_rate: 16 << 20,
            snapshot_burst: 256 << 10,
            ..opts()
        };
        let ((ta, _ma), (_tb, mb)) = pair(o);
        let ta2 = ta.clone();
        let sender = thread::spawn(move || {
            for seq in 0..32u32 {
                ta2.send_snapshot(chunk(1, 2, seq, vec![seq as u8; 256 << 10]), &mut || false)
                    .expect("chunk");
            }
        });
        let sent: Arc<Mutex<HashMap<u64, Instant>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let hb = {
            let (ta, sent, stop) = (ta.clone(), sent.clone(), stop.clone());
            thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Acquire) {
                    sent.lock().insert(n, Instant::now());
                    ta.send(heartbeat(1, 2, n));
                    n += 1;
                    thread::sleep(Duration::from_millis(5));
                }
            })
        };
        let mut first_chunk = None;
        let mut last_chunk = None;
        let mut chunks = 0;
        let mut latencies = Vec::new();
        let mut during = 0;
        let deadline = Instant::now() + Duration::from_secs(20);
        while chunks < 32 && Instant::now() < deadline {
            crossbeam_channel::select! {
                recv(mb.raft) -> m => {
                    let m = m.expect("raft channel");
                    let now = Instant::now();
                    if let Some(t) = sent.lock().get(&m.commit) {
                        latencies.push(now - *t);
                    }
                    if first_chunk.is_some() {
                        during += 1;
                    }
                }
                recv(mb.snapshots) -> f => {
                    assert!(matches!(f, Ok(SnapshotFrame::Chunk(_))));
                    chunks += 1;
                    let now = Instant::now();
                    first_chunk.get_or_insert(now);
                    last_chunk = Some(now);
                }
                default(Duration::from_millis(100)) => {}
            }
        }
        stop.store(true, Ordering::Release);
        hb.join().expect("heartbeat thread");
        sender.join().expect("snapshot thread");
        assert_eq!(chunks, 32, "the whole stream arrived");
        let span = last_chunk
            .zip(first_chunk)
            .map(|(l, f)| l - f)
            .unwrap_or_default();
        assert!(
            span >= Duration::from_millis(300),
            "the stream took {span:?}"
        );
        assert!(
            during >= 20,
            "only {during} heartbeats arrived during the stream"
        );
        latencies.sort();
        let max = latencies.last().copied().unwrap_or_default();
        let p50 = latencies[latencies.len() / 2];
        // Bounds far below the stream's length, loose enough for a loaded machine.
        assert!(
            p50 < Duration::from_millis(50) && max < Duration::from_millis(300) && max < span,
            "heartbeat latency median {p50:?}, max {max:?} during a {span:?} stream"
        );
    }

    /// The snapshot rate limit is honoured within tolerance: 4 MiB at 8 MiB/s with a
    /// 256 KiB burst takes about 0.47 s.
    #[test]
    fn snapshot_rate_limit_is_honoured() {
        let o = TcpOptions {
            snapshot_rate: 8 << 20,
            snapshot_burst: 256 << 10,
            ..opts()
        };
        let ((ta, _ma), (_tb, mb)) = pair(o);
        let start = Instant::now();
        for seq in 0..16u32 {
            ta.send_snapshot(chunk(1, 2, seq, vec![1; 256 << 10]), &mut || false)
                .expect("chunk");
        }
        for _ in 0..16 {
            assert!(mb.snapshots.recv_timeout(Duration::from_secs(10)).is_ok());
        }
        let took = start.elapsed().as_secs_f64();
        let expected = ((4 << 20) - (256 << 10)) as f64 / (8 << 20) as f64;
        assert!(
            took >= expected * 0.9,
            "took {took:.3} s, expected about {expected:.3} s"
        );
        assert!(
            took <= expected * 1.5 + 0.3,
            "took {took:.3} s, expected about {expected:.3} s"
        );
        assert_eq!(ta.stats().snapshot_bytes, 4 << 20);
    }

    /// Three nodes over TCP elect a leader and replicate; a learner added afterwards joins
    /// through a snapshot streamed on the snapshot connection and converges.
    #[test]
    fn a_cluster_runs_over_tcp_and_a_learner_joins_through_a_snapshot() {
        use crate::testing::{TestBackend, fast_options};
        use crate::{Node, NodeConfig, NodeOptions, ReadConsistency};
        use keel_mvcc::RangeRequest;

        let dir = tempfile::tempdir().expect("tempdir");
        let options = NodeOptions {
            snapshot_count: 40,
            snapshot_catch_up_entries: 10,
            snapshot_chunk_bytes: 4096,
            ..fast_options()
        };
        let ids = [1u64, 2, 3, 4];
        let eps: Vec<(TcpTransport, Mailbox)> = ids
            .iter()
            .map(|&id| {
                // Paced, so the join also runs the adaptive pacer end to end.
                let o = TcpOptions {
                    adaptive_snapshot_pacing: true,
                    ..opts()
                };
                TcpTransport::bind(id, "127.0.0.1:0", o).expect("bind")
            })
            .collect();
        for (i, (t, _)) in eps.iter().enumerate() {
            for (j, (u, _)) in eps.iter().enumerate() {
                if i != j {
                    t.add_peer(ids[j], u.local_addr()).expect("peer");
                }
            }
        }
        let mut nodes = Vec::new();
        let mut joiner = None;
        for (i, (t, m)) in eps.into_iter().enumerate() {
            let id = ids[i];
            let peers = if id == 4 { Vec::new() } else { vec![1, 2, 3] };
            let mut config =
                NodeConfig::<TestBackend>::new(id, peers, dir.path().join(format!("m{id}")));
            config.options = options.clone();
            if id == 4 {
                joiner = Some((config, t, m));
            } else {
                nodes.push(Arc::new(
                    Node::start(config, Arc::new(t), m).expect("start"),
                ));
            }
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        let leader = loop {
            if let Some(l) = nodes.iter().find(|n| n.status().leader == Some(n.id())) {
                break l.clone();
            }
            assert!(Instant::now() < deadline, "no leader elected over TCP");
            thread::sleep(Duration::from_millis(20));
        };
        for i in 0..200u32 {
            leader
                .put(format!("key-{i:04}").as_bytes(), &[7u8; 300])
                .expect("put");
        }
        assert!(
            leader.status().first_index > 20,
            "the leader compacted its log"
        );
        leader.add_learner(4).expect("add learner");
        let (config, t, m) = joiner.expect("joiner");
        let learner = Node::start(config, Arc::new(t), m).expect("start learner");
        let target = leader.status().applied;
        while learner.status().applied < target {
            assert!(
                Instant::now() < deadline,
                "learner stuck at {:?}",
                learner.status()
            );
            thread::sleep(Duration::from_millis(20));
        }
        let st = learner.status();
        assert!(
            st.snapshots_installed >= 1,
            "joined through a snapshot: {st:?}"
        );
        assert!(st.learners.contains(&4), "{st:?}");
        let r = learner
            .range(
                &RangeRequest::prefix(b"key-".to_vec()),
                ReadConsistency::Serializable,
            )
            .expect("range");
        assert_eq!(r.count, 200);
        learner.stop();
        for n in &nodes {
            n.stop();
        }
    }

    #[test]
    fn options_validate_and_urls_resolve() {
        assert!(TcpOptions::default().validate().is_ok());
        let bad = TcpOptions {
            backoff_max: Duration::from_millis(1),
            ..TcpOptions::default()
        };
        assert!(bad.validate().is_err());
        assert_eq!(
            resolve_peer_url("http://127.0.0.1:2380").ok(),
            Some("127.0.0.1:2380".parse().expect("addr"))
        );
        assert!(resolve_peer_url("http://nowhere").is_err());
    }
}
