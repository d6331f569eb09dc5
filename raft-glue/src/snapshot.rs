//! Snapshot transfer: the leader streams a consistent copy of its backend to a follower that
//! is behind the compacted log; the follower verifies, stores and installs it.
//!
//! # Sender
//!
//! When raft-rs asks to send `MsgSnapshot` for index `i`, the state machine holds exactly
//! `i` (the node applies entries on the Raft thread and raft-rs takes the snapshot metadata
//! from the applied index). The node commits the store's pending batch and opens a backend
//! read transaction right there, so the stream is the state as of `i`. A sender thread then
//! writes the backend-independent stream ([`keel_mvcc::backend::snapshot`]) as
//! [`SnapshotChunk`]s of `snapshot_chunk_bytes`, each with its CRC-32, the first carrying the
//! `MsgSnapshot`, the last carrying the stream's length and CRC-32, and waits for the
//! receiver's [`SnapshotAck`]. The stream is hashed once: each chunk's CRC-32 is computed as
//! it is cut, and both the stream's own checksum (its end frame) and the end marker's are
//! combined from those. The outcome is reported to raft-rs (`report_snapshot`); on
//! failure raft-rs probes again and a new transfer starts. A transfer whose sender makes no
//! progress for `snapshot_timeout` (blocked for good in its transport) is reported failed
//! by the Raft thread and cancelled, so raft-rs does not wait for it for ever.
//!
//! # Receiver
//!
//! Chunks are appended to `<dir>/snap/<from>-<transfer>.tmp` in order; a chunk out of order,
//! failing its CRC, or a stream whose length or CRC differs from the end marker aborts the
//! transfer: the temporary file is deleted and a negative ack sent, nothing is installed.
//! (A stream restored while it arrives, below, is hashed once, by the restore: a damaged
//! chunk fails the stream's own checksum, checked before the last batch is loaded, and the
//! transfer is refused when it ends. The restore hashes the stream a block ahead of its parse,
//! and that pass is what brings the bytes into the processor's cache for the parse.
//! Hashing each chunk on the connection's reader thread instead, as its bytes arrive, and
//! handing its CRC on to the restore, which then combined the chunks' CRCs into the
//! stream's (the CRC-32 of a stream through its own CRC field is a constant), measured no
//! less CPU on the restore thread, 76–84 ms against 77–84 ms per 215 MB join, the parse then
//! waiting for the bytes the hash had fetched, while the reader spent the hash's CPU on
//! top: transfer ratio 0.60–0.68× against 0.63–0.68×, four alternating runs each on the
//! shared 2-core machine.) A complete stream is fsynced and renamed to
//! `<dir>/snap/<index>-<term>.snap` (directory fsynced). Normally, though, each accepted
//! chunk is fed, as it arrives, to a `LiveRestore` that rebuilds the next backend generation
//! (`<dir>/backend-<n>`, see [`generation`] and [`crate::apply`]) on its own thread, so the
//! backend is ready soon after the stream ends; such a transfer is not stored in a file at
//! all (the restored backend is its durable copy). The chunks' buffers travel by value from
//! the connection's reader to the restore ([`keel_mvcc::Backend::restore_chunks`]: a backend
//! that parses the stream itself does so inside them), and back to the reader's pool of
//! receive buffers ([`buffers`]) once loaded: the stream's bytes are copied only from the
//! socket into those buffers and from there into the backend's frames. The file is used only
//! when no restore could be started.
//! The key index is built from the pairs as they are loaded, on a thread of its own
//! ([`IndexBuilder::on_thread`]), without recomputing each record's own checksum (the
//! stream's covers those bytes; see [`IndexBuilder::for_checked_stream`]). Only once the
//! whole stream is verified is the restored store opened, completed and synced (the learner
//! then holds the snapshot durably), and only then is the `MsgSnapshot` handed
//! to raft-rs, which makes the node switch to that generation, keeping the same open store.
//! The ack goes back once the switch is done. An aborted transfer drops its restore; the
//! partial directory is never installed and is removed with it.
//!
//! Only the leader's transfer is taken (`check_sender`): a first chunk whose snapshot is
//! of a term already past, or of the member's term from a sender other than the leader it
//! knows there, is refused at once. One transfer runs at a time: a new one replaces the one
//! under way only when it comes from the same sender with a newer transfer, or with a newer
//! term (a leader elected since, whose snapshot is the one raft-rs wants); the replaced
//! transfer's sender is answered with a refusal. Any other first chunk is refused and the
//! transfer under way goes on.
//!
//! A transfer that has had no chunk for `snapshot_idle_timeout` (its sender died, or gave
//! up mid-stream) is dropped as an aborted one is, and the sender is answered with a
//! refusal. The receiver remembers the transfers it refused (dropped, replaced, aborted or
//! not from the leader) so that a late chunk of one, even a first chunk delivered late, is
//! refused rather than taken as the start of a new transfer. A sender stops streaming as
//! soon as its transfer is answered, so a refused transfer costs it at most the chunk under
//! way.

use std::collections::{HashMap, VecDeque};
use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, bounded};
use keel_mvcc::IndexBuilder;
use parking_lot::Mutex;
use raft::eraftpb::Message;

use crate::error::NodeError;
use crate::transport::{SnapshotAck, SnapshotChunk, SnapshotFrame, Transport};

pub(crate) mod buffers;
pub mod generation;

/// Niceness of the threads that move a snapshot: the sender, the receiver's restore (and the
/// threads it starts, such as a backend's writer) and the snapshot connection's reader
/// (Linux; elsewhere they keep the default). The lowest priority: they yield to the Raft
/// threads and the client path whenever those want the CPU, so a large transfer adds little
/// to the members' write latency, and run at full speed otherwise. (Measured on 2 cores with
/// three members and a learner in one process: the leader's put p99 during a 222 MB transfer
/// was 2.4–3.0× its p99 without one at niceness 10, 1.96–2.5× at 19, for about 12% less
/// transfer throughput.)
pub const SNAPSHOT_THREAD_NICE: i32 = 19;

/// Lowers the calling thread's scheduling priority to [`SNAPSHOT_THREAD_NICE`].
pub(crate) fn lower_thread_priority() {
    #[cfg(target_os = "linux")]
    if let Err(e) =
        rustix::process::setpriority_process(Some(rustix::thread::gettid()), SNAPSHOT_THREAD_NICE)
    {
        tracing::debug!(error = %e, "cannot lower a snapshot thread's priority");
    }
}

/// Field `field` of `/proc/thread-self/schedstat` (Linux): 0 is the time the calling thread
/// has run so far, 1 the time it has spent ready to run but waiting for a processor; `None`
/// where that is not readable. Logged by the snapshot threads when they end.
fn thread_schedstat(field: usize) -> Option<Duration> {
    let stat = fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns = stat.split_whitespace().nth(field)?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// CPU time the calling thread has run so far (see [`thread_schedstat`]).
pub(crate) fn thread_cpu() -> Option<Duration> {
    thread_schedstat(0)
}

/// [`thread_cpu`] in milliseconds, for logs (-1 when unknown).
pub(crate) fn thread_cpu_ms() -> f64 {
    thread_cpu().map_or(-1.0, |d| d.as_secs_f64() * 1e3)
}

/// Time the calling thread has spent ready to run but waiting for a processor, in
/// milliseconds, for logs (-1 when unknown). A snapshot thread runs at the lowest priority:
/// beside its CPU time this shows how long the members' other threads (and the other
/// snapshot threads) kept it waiting.
pub(crate) fn thread_run_wait_ms() -> f64 {
    thread_schedstat(1).map_or(-1.0, |d| d.as_secs_f64() * 1e3)
}

/// Waiting senders by transfer id, each with the member its transfer goes to.
pub(crate) type AckWaiters = Arc<Mutex<HashMap<u64, (u64, Sender<SnapshotAck>)>>>;

/// Cuts a stream into chunks and sends them.
///
/// The stream's bytes are copied into the chunk's buffer. Sending keys and values straight
/// from the read transaction instead (vectored writes of the store's mapped pages) measured
/// more CPU on the sending thread, 89–97 ms against 73–92 ms per 215 MB stream: the chunk's
/// CRC, needed before its frame head goes out, then reads the store's cold pages in place of
/// the copy, and the kernel copies two slices per pair more slowly than one buffer.
struct ChunkWriter<'a> {
    transport: &'a dyn Transport,
    from: u64,
    to: u64,
    transfer: u64,
    seq: u32,
    message: Option<Box<Message>>,
    buf: Vec<u8>,
    chunk: usize,
    total: u64,
    /// CRC-32 of the chunks sent so far.
    hasher: crc32fast::Hasher,
    /// CRC-32 of `buf[..hashed]`: the stream's checksum was asked for while the chunk was
    /// being filled, so its start is hashed already.
    chunk_hasher: crc32fast::Hasher,
    hashed: usize,
    /// Paces the stream when the transport does not (the in-memory network).
    limiter: Option<&'a crate::tcp::RateLimiter>,
    /// Told the length of each chunk before it is sent (member status).
    progress: &'a dyn Fn(u64),
    /// Where the transfer's answer arrives; one that arrives before the last chunk went out
    /// stops the stream.
    answers: &'a Receiver<SnapshotAck>,
    /// Why the stream was stopped early, when it was.
    stopped: Option<String>,
}

impl ChunkWriter<'_> {
    /// Fails if the transfer was answered before its end: refused (a damaged chunk, the
    /// receiver dropped it) or cancelled, so the rest would be refused too.
    fn check_answered(&mut self) -> Result<(), NodeError> {
        let Ok(ack) = self.answers.try_recv() else {
            return Ok(());
        };
        let reason = ack
            .error
            .unwrap_or_else(|| "acknowledged before its last chunk was sent".into());
        self.stopped = Some(reason.clone());
        Err(NodeError::Snapshot {
            from: self.from,
            to: self.to,
            reason,
        })
    }

    fn flush_chunk(&mut self, end: bool) -> Result<(), NodeError> {
        let data = std::mem::take(&mut self.buf);
        // Before the pacing too: a stopped transfer takes none of the shared budget.
        self.check_answered()?;
        if let Some(l) = self.limiter {
            // A transfer answered (cancelled) while it waits for the budget stops within a
            // slice of the wait, and gives back the bytes it reserved: the transfers pacing
            // on the same budget do not wait for a chunk that is never sent.
            let mut answered = Ok(());
            if !l.acquire_unless(data.len() as u64, || {
                answered = self.check_answered();
                answered.is_err()
            }) {
                return answered;
            }
        }
        (self.progress)(data.len() as u64);
        // The data is hashed once; the stream's CRC is extended by combination.
        let mut hasher = std::mem::replace(&mut self.chunk_hasher, crc32fast::Hasher::new());
        hasher.update(&data[self.hashed..]);
        self.hashed = 0;
        let crc = hasher.finalize();
        extend_crc(&mut self.hasher, crc, data.len());
        self.total += data.len() as u64;
        let chunk = SnapshotChunk {
            from: self.from,
            to: self.to,
            transfer: self.transfer,
            seq: self.seq,
            message: self.message.take(),
            crc,
            data,
            end: end.then(|| (self.total, self.hasher.clone().finalize())),
        };
        self.seq += 1;
        // A transport that makes the chunk wait (for its rate limit) stops waiting as soon
        // as the transfer is answered, and gives back the bytes it reserved.
        let transport = self.transport;
        let mut answered = Ok(());
        let sent = transport.send_snapshot(SnapshotFrame::Chunk(chunk), &mut || {
            answered = self.check_answered();
            answered.is_err()
        });
        answered.and(sent)
    }
}

impl Write for ChunkWriter<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let room = self.chunk - self.buf.len();
        let n = room.min(data.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == self.chunk {
            self.flush_chunk(false).map_err(io::Error::other)?;
            self.buf.reserve(self.chunk);
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The stream's own checksum is the one the chunks carry, combined: the stream is hashed
/// once, chunk by chunk (see [`keel_mvcc::backend::snapshot::write_checksummed`]).
impl keel_mvcc::backend::snapshot::ChecksummedWrite for ChunkWriter<'_> {
    fn crc(&mut self) -> u32 {
        self.chunk_hasher.update(&self.buf[self.hashed..]);
        self.hashed = self.buf.len();
        let mut all = self.hasher.clone();
        all.combine(&self.chunk_hasher);
        all.finalize()
    }
}

/// Extends `hasher` by a block of `len` bytes whose CRC-32 is `crc`, without reading it.
fn extend_crc(hasher: &mut crc32fast::Hasher, crc: u32, len: usize) {
    hasher.combine(&crc32fast::Hasher::new_with_initial_len(crc, len as u64));
}

/// Registers the sender of transfer `transfer` to member `to` as waiting for its answer,
/// before the transfer starts (so that [`cancel_to`] finds it from then on), and returns
/// where the answer arrives.
pub(crate) fn expect_answer(acks: &AckWaiters, transfer: u64, to: u64) -> Receiver<SnapshotAck> {
    let (tx, rx) = bounded(1);
    acks.lock().insert(transfer, (to, tx));
    rx
}

/// Streams `txn` to `msg.to` and waits for the ack on `answers` (see [`expect_answer`]); an
/// answer that arrives while the stream is still being sent stops it. Runs on its own
/// thread.
#[allow(clippy::too_many_arguments)]
pub(crate) fn send<T: keel_mvcc::ReadTxn>(
    transport: &dyn Transport,
    acks: &AckWaiters,
    answers: Receiver<SnapshotAck>,
    transfer: u64,
    msg: Message,
    txn: T,
    chunk_bytes: usize,
    timeout: Duration,
    limiter: Option<&crate::tcp::RateLimiter>,
    progress: &dyn Fn(u64),
) -> Result<(), NodeError> {
    lower_thread_priority();
    let started = std::time::Instant::now();
    let (from, to) = (msg.from, msg.to);
    // A panic while streaming (a transport's, a backend's) still ends the transfer with a
    // result: the Raft thread reports it to raft-rs, which otherwise keeps waiting for the
    // snapshot and sends that member nothing.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut w = ChunkWriter {
            transport,
            from,
            to,
            transfer,
            seq: 0,
            message: Some(Box::new(msg)),
            buf: Vec::with_capacity(chunk_bytes),
            chunk: chunk_bytes,
            total: 0,
            hasher: crc32fast::Hasher::new(),
            chunk_hasher: crc32fast::Hasher::new(),
            hashed: 0,
            limiter,
            progress,
            answers: &answers,
            stopped: None,
        };
        keel_mvcc::backend::snapshot::write_checksummed(&txn, &mut w).map_err(|e| {
            NodeError::Snapshot {
                from,
                to,
                reason: match w.stopped.take() {
                    Some(reason) => reason,
                    None => format!("streaming the backend: {e}"),
                },
            }
        })?;
        drop(txn);
        w.flush_chunk(true)?;
        tracing::debug!(
            from,
            to,
            bytes = w.total,
            ms = started.elapsed().as_secs_f64() * 1e3,
            cpu_ms = thread_cpu_ms(),
            run_wait_ms = thread_run_wait_ms(),
            "snapshot streamed"
        );
        match answers.recv_timeout(timeout) {
            Ok(SnapshotAck { error: None, .. }) => Ok(()),
            Ok(SnapshotAck {
                error: Some(reason),
                ..
            }) => Err(NodeError::Snapshot { from, to, reason }),
            Err(_) => Err(NodeError::Snapshot {
                from,
                to,
                reason: format!("no acknowledgement within {} ms", timeout.as_millis()),
            }),
        }
    }))
    .unwrap_or_else(|_| {
        tracing::error!(from, to, transfer, "the snapshot sender panicked");
        Err(NodeError::Snapshot {
            from,
            to,
            reason: "the sender panicked".into(),
        })
    });
    acks.lock().remove(&transfer);
    result
}

/// A verified snapshot stream on disk.
pub(crate) struct Received {
    /// The `MsgSnapshot` to step into raft once the backend is prepared.
    pub message: Message,
    /// The stored stream; `None` when the transfer was taken without a file (it was
    /// restored while it arrived).
    pub path: Option<PathBuf>,
}

struct Incoming {
    /// The term of the `MsgSnapshot` its first chunk carried (its sender led that term).
    term: u64,
    /// `None` when the stream is not stored (it is restored while it arrives).
    file: Option<File>,
    path: PathBuf,
    next: u32,
    len: u64,
    hasher: crc32fast::Hasher,
    message: Option<Message>,
    /// When its last chunk was taken.
    last: Instant,
}

/// A transfer [`Assembler::drop_idle`] dropped.
pub(crate) struct Dropped {
    /// `(from, transfer)`.
    pub key: (u64, u64),
    /// Chunks taken before it went idle.
    pub chunks: u32,
    /// Bytes taken before it went idle.
    pub bytes: u64,
}

/// Refused transfers remembered, so that their late chunks are refused. Transfer numbers
/// are not reused by a sender, and a late chunk follows its transfer's refusal within the
/// sender's own timeout: a short memory suffices.
const REFUSED_KEPT: usize = 64;

/// What this member knows when a transfer's first chunk arrives, to tell whether its sender
/// may be sending it a snapshot: its id, its term, the leader it knows in that term, and the
/// members of its configuration (voters and learners; none before it joined).
pub(crate) struct ReceiverView {
    /// This member.
    pub id: u64,
    /// Its current term.
    pub term: u64,
    /// The leader it knows in that term.
    pub leader: Option<u64>,
    /// The members of its configuration.
    pub members: Vec<u64>,
}

/// Whether the transfer whose first chunk is `c` comes from a member that may be this
/// member's leader, as raft-rs would judge its `MsgSnapshot`: only a leader sends one, and
/// there is one leader per term. A snapshot of a term already past is refused (raft-rs
/// would ignore it), as is one of the current term from a sender that is not the leader
/// known in it, or, while no leader is known, from a sender outside the configuration. A
/// snapshot of a newer term is taken from any sender: it comes from a leader elected since
/// this member last heard from the cluster, which a member behind the log may not know as a
/// member yet (added after what it applied), and raft-rs follows that leader.
pub(crate) fn check_sender(view: &ReceiverView, c: &SnapshotChunk) -> Result<(), String> {
    let Some(m) = c.message.as_deref() else {
        return Err("its first chunk carries no snapshot message".into());
    };
    if m.get_msg_type() != raft::eraftpb::MessageType::MsgSnapshot
        || m.from != c.from
        || m.to != view.id
    {
        return Err(format!(
            "its first chunk carries a {:?} from member {} to member {}, not a snapshot from \
             member {} to member {}",
            m.get_msg_type(),
            m.from,
            m.to,
            c.from,
            view.id
        ));
    }
    if m.term < view.term {
        return Err(format!(
            "a snapshot of term {} from member {}: this member is at term {}",
            m.term, c.from, view.term
        ));
    }
    if m.term > view.term {
        return Ok(());
    }
    match view.leader {
        Some(leader) if leader != c.from => Err(format!(
            "member {} is not the leader of term {} (member {leader} is)",
            c.from, m.term
        )),
        Some(_) => Ok(()),
        None if view.members.is_empty() || view.members.contains(&c.from) => Ok(()),
        None => Err(format!(
            "member {} is not the leader of term {}: it is not a member, and no leader is \
             known in that term",
            c.from, m.term
        )),
    }
}

/// Reassembles incoming transfers, one at a time: the first chunk of a new transfer replaces
/// the one under way only when it comes from the same sender with a newer transfer, or with
/// a newer term (a new leader; see [`admit`](Assembler::admit)). A transfer left without
/// chunks is dropped by [`drop_idle`](Assembler::drop_idle).
pub(crate) struct Assembler {
    dir: PathBuf,
    /// The transfer under way, if any (never more than one).
    incoming: HashMap<(u64, u64), Incoming>,
    /// The latest transfers refused, with what their late chunks are told, oldest first.
    refused: VecDeque<((u64, u64), String)>,
    /// Transfers replaced by a newer one, whose senders have not been told yet.
    replaced: Vec<((u64, u64), String)>,
}

fn fsync_dir(dir: &Path) -> Result<(), NodeError> {
    File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(|e| NodeError::io(dir, "fsync directory", e))
}

impl Assembler {
    /// Stores transfers under `dir` (created if needed); removes leftovers of earlier runs.
    pub fn new(dir: PathBuf) -> Result<Assembler, NodeError> {
        fs::create_dir_all(&dir).map_err(|e| NodeError::io(&dir, "create directory", e))?;
        let entries = fs::read_dir(&dir).map_err(|e| NodeError::io(&dir, "read directory", e))?;
        for entry in entries.flatten() {
            let p = entry.path();
            if p.extension().is_some_and(|x| x == "tmp" || x == "snap") {
                let _ = fs::remove_file(&p);
            }
        }
        Ok(Assembler {
            dir,
            incoming: HashMap::new(),
            refused: VecDeque::new(),
            replaced: Vec::new(),
        })
    }

    /// Whether transfer `key` (`(from, transfer)`) was refused (dropped by
    /// [`drop_idle`](Self::drop_idle), replaced, or aborted): its chunks are refused.
    pub fn was_refused(&self, key: (u64, u64)) -> bool {
        self.refused.iter().any(|(k, _)| *k == key)
    }

    /// Refuses transfer `key` for `e`: drops it if it is under way (its temporary file is
    /// removed) and refuses its later chunks. Returns whether it was not refused before.
    pub fn refuse(&mut self, key: (u64, u64), e: &NodeError) -> bool {
        let reason = match e {
            NodeError::Snapshot { reason, .. } => reason.clone(),
            other => other.to_string(),
        };
        let late = if reason.starts_with("transfer ") {
            reason
        } else {
            format!("transfer {} was refused: {reason}", key.1)
        };
        self.remember(key, late)
    }

    /// Drops transfer `key` if it is under way and refuses its later chunks with `late`.
    /// Returns whether it was not refused before.
    fn remember(&mut self, key: (u64, u64), late: String) -> bool {
        if let Some(inc) = self.incoming.remove(&key)
            && inc.file.is_some()
        {
            let _ = fs::remove_file(&inc.path);
        }
        if self.was_refused(key) {
            return false;
        }
        if self.refused.len() == REFUSED_KEPT {
            self.refused.pop_front();
        }
        self.refused.push_back((key, late));
        true
    }

    /// The transfers a newer one replaced since the last call, with the reason to tell
    /// their senders.
    pub fn take_replaced(&mut self) -> Vec<((u64, u64), String)> {
        std::mem::take(&mut self.replaced)
    }

    /// Admits the transfer whose first chunk is `c`, if it may start: it was not refused
    /// before, and no transfer is under way that it may not replace. It replaces the one
    /// under way when it comes from the same sender with a newer transfer of the same term,
    /// or with a newer term, whoever sends it (a leader elected since, whose snapshot raft-rs
    /// wants; the old leader's is of no use any more): the replaced transfer is refused
    /// and listed by [`take_replaced`](Self::take_replaced). Otherwise the newcomer is
    /// refused: a sender of the same term that is not the one under way's is no leader, and
    /// an older transfer of the same sender is a late one. Admitting does not start it: its
    /// first chunk goes to [`chunk`](Self::chunk).
    pub fn admit(&mut self, c: &SnapshotChunk) -> Result<(), NodeError> {
        let key = (c.from, c.transfer);
        let fail = |reason: String| NodeError::Snapshot {
            from: c.from,
            to: c.to,
            reason,
        };
        if let Some((_, late)) = self.refused.iter().find(|(k, _)| *k == key) {
            return Err(fail(late.clone()));
        }
        let term = c
            .message
            .as_deref()
            .map(|m| m.term)
            .ok_or_else(|| fail("first chunk carries no snapshot message".into()))?;
        let rivals: Vec<((u64, u64), u64)> = self
            .incoming
            .iter()
            .filter(|(k, _)| **k != key)
            .map(|(k, inc)| (*k, inc.term))
            .collect();
        for ((from, transfer), cur_term) in rivals {
            let newer =
                term > cur_term || (from == c.from && term == cur_term && c.transfer > transfer);
            if !newer {
                return Err(fail(format!(
                    "transfer {} (term {term}) refused: transfer {transfer} from member {from} \
                     (term {cur_term}) is under way",
                    c.transfer
                )));
            }
            let reason = format!(
                "replaced by transfer {} from member {} (term {term})",
                c.transfer, c.from
            );
            self.remember(
                (from, transfer),
                format!("transfer {transfer} was {reason}"),
            );
            self.replaced.push(((from, transfer), reason));
        }
        Ok(())
    }

    /// Drops every transfer that has had no chunk for `idle` at `now`: its temporary file is
    /// removed, and its later chunks are refused. Returns the transfers dropped.
    pub fn drop_idle(&mut self, now: Instant, idle: Duration) -> Vec<Dropped> {
        let stale: Vec<(u64, u64)> = self
            .incoming
            .iter()
            .filter(|(_, inc)| now.saturating_duration_since(inc.last) >= idle)
            .map(|(key, _)| *key)
            .collect();
        let mut dropped = Vec::with_capacity(stale.len());
        for key in stale {
            let Some(inc) = self.incoming.remove(&key) else {
                continue;
            };
            if inc.file.is_some() {
                let _ = fs::remove_file(&inc.path);
            }
            self.remember(
                key,
                format!(
                    "transfer {} was dropped after {} ms without a chunk",
                    key.1,
                    idle.as_millis()
                ),
            );
            dropped.push(Dropped {
                key,
                chunks: inc.next,
                bytes: inc.len,
            });
        }
        dropped
    }

    /// Takes one chunk. Returns `Ok(Some(_))` when a transfer completed and verified,
    /// `Ok(None)` when more chunks are expected, `Err` when the transfer is refused (its
    /// temporary file is gone, and its later chunks are refused too). A first chunk starts
    /// its transfer only as [`admit`](Self::admit) allows. `store` (read on a transfer's
    /// first chunk) says whether the stream is kept in a file; without one only its order
    /// and checksums are checked.
    pub fn chunk(&mut self, c: &SnapshotChunk, store: bool) -> Result<Option<Received>, NodeError> {
        let key = (c.from, c.transfer);
        let fail = |reason: String| NodeError::Snapshot {
            from: c.from,
            to: c.to,
            reason,
        };
        let res = self.take(key, c, store, &fail);
        if let Err(e) = &res {
            self.refuse(key, e);
        }
        res
    }

    fn take(
        &mut self,
        key: (u64, u64),
        c: &SnapshotChunk,
        store: bool,
        fail: &dyn Fn(String) -> NodeError,
    ) -> Result<Option<Received>, NodeError> {
        if let Some((_, late)) = self.refused.iter().find(|(k, _)| *k == key) {
            return Err(fail(late.clone()));
        }
        if c.seq == 0 {
            if let Some(inc) = self.incoming.get(&key) {
                return Err(fail(format!(
                    "chunk 0 arrived again, {} expected",
                    inc.next
                )));
            }
            self.admit(c)?;
            let path = self.dir.join(format!("{}-{}.tmp", c.from, c.transfer));
            let file = if store {
                Some(File::create(&path).map_err(|e| NodeError::io(&path, "create", e))?)
            } else {
                None
            };
            let message = c
                .message
                .as_deref()
                .cloned()
                .ok_or_else(|| fail("first chunk carries no snapshot message".into()))?;
            self.incoming.insert(
                key,
                Incoming {
                    term: message.term,
                    file,
                    path,
                    next: 0,
                    len: 0,
                    hasher: crc32fast::Hasher::new(),
                    message: Some(message),
                    last: Instant::now(),
                },
            );
        }
        let inc = self
            .incoming
            .get_mut(&key)
            .ok_or_else(|| fail(format!("chunk {} of an unknown transfer", c.seq)))?;
        if c.seq != inc.next {
            return Err(fail(format!(
                "chunk {} arrived, {} expected",
                c.seq, inc.next
            )));
        }
        let crc = match &mut inc.file {
            Some(file) => {
                let crc = crc32fast::hash(&c.data);
                if crc != c.crc {
                    return Err(fail(format!("chunk {} fails its checksum", c.seq)));
                }
                file.write_all(&c.data)
                    .map_err(|e| NodeError::io(&inc.path, "write", e))?;
                crc
            }
            // Restored while it arrives: the restore checks the stream's own checksum over
            // these same bytes before it loads the last batch, and the transfer is refused
            // when that fails, so they are not hashed here as well. The chunks' order, their
            // lengths and the end marker (against the chunks' CRCs) are still checked.
            None => c.crc,
        };
        extend_crc(&mut inc.hasher, crc, c.data.len());
        inc.len += c.data.len() as u64;
        inc.next += 1;
        inc.last = Instant::now();
        let Some((len, crc)) = c.end else {
            return Ok(None);
        };
        if len != inc.len || crc != inc.hasher.clone().finalize() {
            return Err(fail(format!(
                "stream of {} bytes fails its end marker ({len} bytes expected, checksum {})",
                inc.len,
                if crc == inc.hasher.clone().finalize() {
                    "matches"
                } else {
                    "differs"
                }
            )));
        }
        if let Some(file) = &inc.file {
            file.sync_all()
                .map_err(|e| NodeError::io(&inc.path, "fsync", e))?;
        }
        let message = inc
            .message
            .take()
            .ok_or_else(|| fail("transfer already completed".into()))?;
        let meta = message.get_snapshot().get_metadata();
        let path = self.dir.join(format!("{}-{}.snap", meta.index, meta.term));
        let inc = self
            .incoming
            .remove(&key)
            .ok_or_else(|| fail("transfer vanished".into()))?;
        if inc.file.is_none() {
            return Ok(Some(Received {
                message,
                path: None,
            }));
        }
        fs::rename(&inc.path, &path).map_err(|e| NodeError::io(&inc.path, "rename", e))?;
        fsync_dir(&self.dir)?;
        Ok(Some(Received {
            message,
            path: Some(path),
        }))
    }
}

/// Chunks queued for a [`LiveRestore`] before the receiver waits for it.
const LIVE_QUEUE: usize = 16;

/// The chunks of one transfer, in order, as the restore takes them (by value: the backend
/// parses inside them); ends when the sender is gone. Chunks the restore is done with go back
/// to the receive buffers' pool ([`buffers`]).
struct ChunkFeed {
    rx: Receiver<Vec<u8>>,
    /// Time spent waiting for chunks (for the closing log).
    waited: Duration,
}

impl keel_mvcc::backend::ChunkSource for ChunkFeed {
    fn next_chunk(&mut self) -> Option<Vec<u8>> {
        if let Ok(chunk) = self.rx.try_recv() {
            return Some(chunk);
        }
        let waiting = std::time::Instant::now();
        let chunk = self.rx.recv().ok();
        self.waited += waiting.elapsed();
        chunk
    }

    fn recycle(&mut self, chunk: Vec<u8>) {
        buffers::give(chunk);
    }
}

/// A stream restored by a [`LiveRestore`].
pub(crate) struct Restored<B> {
    /// The generation whose directory holds it.
    pub generation: u64,
    /// The backend holding the whole stream.
    pub backend: B,
    /// The store's key index, built while the pairs were loaded.
    pub index: IndexBuilder,
}

/// Restores one incoming transfer into the next backend generation's directory while its
/// chunks arrive, on a thread of its own, so that the backend is rebuilt by the time the
/// stream ends. Only chunks the [`Assembler`] accepted are fed to it; the result is handed
/// on ([`finish`](Self::finish)) only once the whole stream is verified, and installing it
/// still goes through [`crate::apply::finish_restore`]. Dropping it abandons the restore and
/// removes the partial directory.
pub(crate) struct LiveRestore<B: keel_mvcc::Backend> {
    /// `(from, transfer)` of the transfer being restored.
    pub key: (u64, u64),
    tx: Option<Sender<Vec<u8>>>,
    handle: Option<std::thread::JoinHandle<Result<Restored<B>, NodeError>>>,
    /// The member's data directory.
    dir: PathBuf,
    /// The generation being restored into, once the restore has begun (0 before: a restored
    /// generation is never 0).
    generation: Arc<AtomicU64>,
}

impl<B: keel_mvcc::Backend> LiveRestore<B> {
    /// Opens a fresh backend in `dir` and starts restoring transfer `key` into it.
    pub fn start(
        key: (u64, u64),
        dir: &Path,
        backend_options: &B::Options,
    ) -> Result<LiveRestore<B>, NodeError> {
        let (tx, rx) = bounded(LIVE_QUEUE);
        let options = backend_options.clone();
        let begun = Arc::new(AtomicU64::new(0));
        let (thread_dir, thread_begun) = (dir.to_path_buf(), begun.clone());
        let handle = std::thread::Builder::new()
            .name(format!("keel-snap-restore-{}", key.0))
            .spawn(move || {
                lower_thread_priority();
                let (generation, backend) =
                    crate::apply::begin_restore::<B>(&thread_dir, &options)?;
                thread_begun.store(generation, Ordering::Release);
                let mut input = ChunkFeed {
                    rx,
                    waited: Duration::ZERO,
                };
                let started = std::time::Instant::now();
                // The key index is built on a thread of its own, from the records' heads; the
                // stream's checksum covers the records: their own are not recomputed.
                let mut index =
                    IndexBuilder::on_thread(format!("keel-snap-index-{}", key.0), || {
                        lower_thread_priority();
                    })
                    .map_err(|e| {
                        NodeError::io(PathBuf::from("keel-snap-index"), "spawn thread", e)
                    })?;
                let pairs = backend
                    .restore_chunks(&mut input, &mut |bucket, key, value| {
                        index.observe(bucket, key, value)
                    })
                    .map_err(|e| NodeError::Store(format!("restoring snapshot: {e}")))?;
                let index = index.finish().ok_or_else(|| {
                    NodeError::Store("the snapshot's key index thread failed".into())
                })?;
                tracing::debug!(
                    from = key.0,
                    pairs,
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    cpu_ms = thread_cpu_ms(),
                    run_wait_ms = thread_run_wait_ms(),
                    waited_for_chunks_ms = input.waited.as_secs_f64() * 1e3,
                    "snapshot stream restored"
                );
                Ok(Restored {
                    generation,
                    backend,
                    index,
                })
            })
            .map_err(|e| NodeError::io(PathBuf::from("keel-snap-restore"), "spawn thread", e))?;
        Ok(LiveRestore {
            key,
            tx: Some(tx),
            handle: Some(handle),
            dir: dir.to_path_buf(),
            generation: begun,
        })
    }

    /// Hands on the data of one accepted chunk. A restore that already failed ignores it;
    /// [`finish`](Self::finish) reports the failure.
    pub fn feed(&self, data: Vec<u8>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(data);
        }
    }

    /// Ends the stream and waits for the restore: the generation and the backend holding the
    /// whole stream, checked against its own end frame and checksum, with the store's key
    /// index built from the pairs as they were loaded. A restore that failed leaves no
    /// generation directory behind.
    pub fn finish(mut self) -> Result<Restored<B>, NodeError> {
        self.tx = None;
        let result = match self.handle.take().map(|h| h.join()) {
            Some(Ok(result)) => result,
            _ => Err(NodeError::Store(
                "the snapshot restore thread did not complete".into(),
            )),
        };
        // The thread has ended, and with it (on failure) the backend it restored into.
        let generation = self.generation.load(Ordering::Acquire);
        if result.is_err() && generation != 0 {
            generation::remove(&self.dir, generation);
        }
        result
    }
}

impl<B: keel_mvcc::Backend> Drop for LiveRestore<B> {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(h) = self.handle.take() {
            // The restore ends (a stream without its end frame fails) and closes its backend;
            // its generation was never handed on, so it is not the current one.
            let _ = h.join();
            let generation = self.generation.load(Ordering::Acquire);
            if generation != 0 {
                generation::remove(&self.dir, generation);
            }
        }
    }
}

/// Routes an ack to the sender waiting for it.
pub(crate) fn route_ack(acks: &AckWaiters, ack: SnapshotAck) {
    // Only from the member the transfer went to: another's ack for a transfer of the same
    // number (a late one, from before a restart) answers nothing here.
    if let Some((to, tx)) = acks.lock().get(&ack.transfer)
        && *to == ack.from
    {
        let _ = tx.try_send(ack);
    }
}

/// Cancels every transfer from member `from` to member `to` that is under way: each sender
/// is answered with a refusal saying `reason`, as if from the receiver, so it stops before
/// its next chunk (or stops waiting for the ack) and ends, releasing its read transaction.
/// Returns how many transfers were cancelled.
pub(crate) fn cancel_to(acks: &AckWaiters, from: u64, to: u64, reason: &str) -> usize {
    cancel(acks, from, Some(to), reason)
}

/// Cancels every transfer from member `from` that is under way, whoever it goes to, as
/// [`cancel_to`] does.
pub(crate) fn cancel_all(acks: &AckWaiters, from: u64, reason: &str) -> usize {
    cancel(acks, from, None, reason)
}

fn cancel(acks: &AckWaiters, from: u64, to: Option<u64>, reason: &str) -> usize {
    let waiters = acks.lock();
    let mut cancelled = 0;
    let chosen = waiters
        .iter()
        .filter(|(_, (member, _))| to.is_none_or(|to| *member == to));
    for (&transfer, (member, tx)) in chosen {
        // A full channel holds the receiver's own answer, which ends the sender as well.
        let _ = tx.try_send(SnapshotAck {
            from: *member,
            to: from,
            transfer,
            error: Some(format!("cancelled: {reason}")),
        });
        cancelled += 1;
    }
    cancelled
}

/// The receiving side of an ack channel, for tests.
#[allow(dead_code)]
pub(crate) type AckReceiver = Receiver<SnapshotAck>;

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(seq: u32, data: &[u8], end: Option<(u64, u32)>) -> SnapshotChunk {
        let mut m = Message {
            from: 1,
            to: 2,
            ..Message::default()
        };
        m.mut_snapshot().mut_metadata().index = 10;
        m.mut_snapshot().mut_metadata().term = 2;
        SnapshotChunk {
            from: 1,
            to: 2,
            transfer: 5,
            seq,
            message: (seq == 0).then(|| Box::new(m)),
            data: data.to_vec(),
            crc: crc32fast::hash(data),
            end,
        }
    }

    /// An ack reaches the transfer it names only when it comes from the member that
    /// transfer went to.
    #[test]
    fn an_ack_from_another_member_answers_nothing() {
        let acks: AckWaiters = Arc::new(Mutex::new(HashMap::new()));
        let (tx, rx) = bounded(1);
        acks.lock().insert(7, (2, tx));
        let ack = |from| SnapshotAck {
            from,
            to: 1,
            transfer: 7,
            error: None,
        };
        route_ack(&acks, ack(3));
        assert!(
            rx.try_recv().is_err(),
            "an ack from member 3 for a transfer to 2"
        );
        route_ack(&acks, ack(2));
        assert_eq!(rx.try_recv().expect("the ack").from, 2);
    }

    /// Cancelling the transfers to a member answers each of them with a refusal, and no
    /// other transfer.
    #[test]
    fn cancelling_answers_only_the_transfers_to_that_member() {
        let acks: AckWaiters = Arc::new(Mutex::new(HashMap::new()));
        let to_2 = expect_answer(&acks, 7, 2);
        let to_3 = expect_answer(&acks, 8, 3);
        assert_eq!(cancel_to(&acks, 1, 2, "member 2 was removed"), 1);
        let ack = to_2.try_recv().expect("answered");
        assert_eq!((ack.transfer, ack.to), (7, 1));
        let error = ack.error.expect("a refusal");
        assert_eq!(error, "cancelled: member 2 was removed");
        assert!(to_3.try_recv().is_err(), "the transfer to 3 goes on");
        assert_eq!(cancel_all(&acks, 1, "member 1 no longer leads"), 2);
        let ack = to_3.try_recv().expect("answered");
        assert_eq!((ack.from, ack.to, ack.transfer), (3, 1, 8));
        assert_eq!(
            ack.error.as_deref(),
            Some("cancelled: member 1 no longer leads")
        );
    }

    /// Chunk `seq` of transfer `transfer` (a sender never reuses a transfer's number).
    fn chunk_of(transfer: u64, seq: u32, data: &[u8], end: Option<(u64, u32)>) -> SnapshotChunk {
        SnapshotChunk {
            transfer,
            ..chunk(seq, data, end)
        }
    }

    #[test]
    fn assembles_verifies_and_refuses_damage() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut a = Assembler::new(dir.path().join("snap")).expect("assembler");
        let all = b"hello world".to_vec();
        let end = Some((all.len() as u64, crc32fast::hash(&all)));
        assert!(
            a.chunk(&chunk(0, &all[..5], None), true)
                .expect("ok")
                .is_none()
        );
        let got = a
            .chunk(&chunk(1, &all[5..], end), true)
            .expect("ok")
            .expect("done");
        let path = got.path.expect("stored");
        assert_eq!(fs::read(&path).expect("read"), all);
        assert!(path.ends_with("10-2.snap"));

        // A corrupted chunk aborts and leaves no temporary file; the rest of the transfer
        // is refused.
        let mut bad = chunk_of(6, 0, &all[..5], None);
        bad.data[0] ^= 1;
        assert!(a.chunk(&bad, true).is_err());
        assert!(
            a.chunk(&chunk_of(6, 1, &all[5..], end), true).is_err(),
            "refused transfer"
        );
        // A missing chunk aborts.
        assert!(
            a.chunk(&chunk_of(7, 0, &all[..5], None), true)
                .expect("ok")
                .is_none()
        );
        assert!(a.chunk(&chunk_of(7, 2, &all[5..], end), true).is_err());
        // A wrong end marker aborts.
        assert!(
            a.chunk(&chunk_of(8, 0, &all[..5], None), true)
                .expect("ok")
                .is_none()
        );
        assert!(
            a.chunk(&chunk_of(8, 1, &all[5..], Some((11, 0))), true)
                .is_err()
        );
        let tmp: Vec<_> = fs::read_dir(dir.path().join("snap"))
            .expect("dir")
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "tmp"))
            .collect();
        assert!(tmp.is_empty(), "aborted transfers leave nothing behind");

        // Without a file, a transfer's chunks are still checked for order, and their CRCs
        // against the end marker (their data is checked by the restore).
        fs::remove_file(&path).expect("remove");
        assert!(
            a.chunk(&chunk_of(9, 0, &all[..5], None), false)
                .expect("ok")
                .is_none()
        );
        assert!(
            a.chunk(&chunk_of(9, 1, &all[5..], Some((11, 0))), false)
                .is_err()
        );
        assert!(
            a.chunk(&chunk_of(10, 0, &all[..5], None), false)
                .expect("ok")
                .is_none()
        );
        let got = a
            .chunk(&chunk_of(10, 1, &all[5..], end), false)
            .expect("ok")
            .expect("done");
        assert!(got.path.is_none());
        assert_eq!(
            fs::read_dir(dir.path().join("snap")).expect("dir").count(),
            0,
            "nothing stored"
        );
    }

    /// A first chunk of `transfer` from `from`, of a snapshot of `term`.
    fn first(from: u64, transfer: u64, term: u64) -> SnapshotChunk {
        let mut c = chunk(0, b"hello", None);
        c.from = from;
        c.transfer = transfer;
        if let Some(m) = c.message.as_deref_mut() {
            m.set_msg_type(raft::eraftpb::MessageType::MsgSnapshot);
            m.from = from;
            m.term = term;
        }
        c
    }

    /// One transfer at a time: a newer transfer of the same sender and term, or any
    /// transfer of a newer term, replaces the one under way (listed for its sender to be
    /// told, and its late chunks refused); another sender of the same term, or an older
    /// transfer of the same sender, is refused and changes nothing.
    #[test]
    fn a_transfer_is_replaced_only_by_its_senders_newer_one_or_a_newer_terms() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut a = Assembler::new(dir.path().join("snap")).expect("assembler");
        a.chunk(&first(1, 5, 3), false).expect("starts");
        for (c, why) in [
            (first(3, 9, 3), "another sender of the same term"),
            (first(1, 4, 3), "an older transfer of the same sender"),
            (first(3, 9, 2), "an older term"),
        ] {
            match a.chunk(&c, false) {
                Err(e) => assert!(e.to_string().contains("under way"), "{why}: {e}"),
                Ok(_) => panic!("{why} was taken"),
            }
        }
        assert!(a.take_replaced().is_empty());
        let next = |a: &mut Assembler, c: SnapshotChunk| a.chunk(&c, false).map(|_| ());
        next(&mut a, chunk(1, b" ", None)).expect("transfer 5 goes on");

        a.chunk(&first(1, 6, 3), false)
            .expect("a newer transfer of the same sender");
        let replaced = a.take_replaced();
        assert_eq!(replaced.len(), 1);
        assert_eq!(replaced[0].0, (1, 5));
        assert!(
            replaced[0]
                .1
                .contains("replaced by transfer 6 from member 1")
        );
        let late = SnapshotChunk {
            seq: 2,
            ..chunk(2, b"w", None)
        };
        match a.chunk(&late, false) {
            Err(e) => assert!(e.to_string().contains("was replaced"), "{e}"),
            Ok(_) => panic!("a late chunk of a replaced transfer was taken"),
        }

        a.chunk(&first(2, 1, 4), false)
            .expect("a new leader's transfer");
        let replaced = a.take_replaced();
        assert_eq!(replaced.len(), 1);
        assert_eq!(replaced[0].0, (1, 6));
        assert!(a.was_refused((1, 6)));
        let mut c = first(2, 1, 4);
        c.seq = 1;
        c.message = None;
        next(&mut a, c).expect("the new leader's transfer goes on");
    }

    /// A snapshot comes from the leader of its term: one of a past term, or of this
    /// member's term from anyone but the leader it knows there (from a non-member while it
    /// knows none), is refused; a newer term's is taken from any sender, and a member that
    /// knows no configuration yet (it is joining) takes one from any sender.
    #[test]
    fn only_a_leader_of_the_current_or_a_newer_term_may_send_a_snapshot() {
        let view = |term, leader: Option<u64>, members: &[u64]| ReceiverView {
            id: 2,
            term,
            leader,
            members: members.to_vec(),
        };
        let to_2 = |from, term| {
            let mut c = first(from, 1, term);
            c.to = 2;
            if let Some(m) = c.message.as_deref_mut() {
                m.to = 2;
            }
            c
        };
        let cases = [
            (view(5, Some(1), &[1, 2, 3]), to_2(1, 5), Ok(())),
            (
                view(5, Some(1), &[1, 2, 3]),
                to_2(3, 5),
                Err("not the leader"),
            ),
            (view(5, Some(1), &[1, 2, 3]), to_2(1, 4), Err("at term 5")),
            (view(5, Some(1), &[1, 2, 3]), to_2(9, 6), Ok(())),
            (view(5, None, &[1, 2, 3]), to_2(3, 5), Ok(())),
            (view(5, None, &[1, 2, 3]), to_2(9, 5), Err("not a member")),
            (view(0, None, &[]), to_2(9, 0), Ok(())),
        ];
        for (v, c, want) in cases {
            let got = check_sender(&v, &c);
            match (want, &got) {
                (Ok(()), Ok(())) => {}
                (Err(text), Err(e)) => assert!(e.contains(text), "{e}"),
                _ => panic!(
                    "from {} at term {:?} to a member at term {} (leader {:?}): {got:?}",
                    c.from,
                    c.message.as_ref().map(|m| m.term),
                    v.term,
                    v.leader
                ),
            }
        }
        let mut wrong = to_2(1, 5);
        if let Some(m) = wrong.message.as_deref_mut() {
            m.from = 3;
        }
        let e = check_sender(&view(5, Some(1), &[1, 2, 3]), &wrong).expect_err("mismatch");
        assert!(e.contains("not a snapshot from member 1"), "{e}");
    }

    /// A transfer without a chunk for the idle timeout is dropped (its temporary file with
    /// it) and its late chunks, a first chunk too, are refused; a fresh transfer is not.
    #[test]
    fn idle_transfers_are_dropped_and_their_late_chunks_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let snap = dir.path().join("snap");
        let mut a = Assembler::new(snap.clone()).expect("assembler");
        let all = b"hello world".to_vec();
        let end = Some((all.len() as u64, crc32fast::hash(&all)));
        assert!(
            a.chunk(&chunk(0, &all[..5], None), true)
                .expect("ok")
                .is_none()
        );
        let tmp = snap.join("1-5.tmp");
        assert!(tmp.exists());
        let idle = Duration::from_secs(60);
        assert!(
            a.drop_idle(Instant::now(), idle).is_empty(),
            "a transfer that just had a chunk is kept"
        );
        let dropped = a.drop_idle(Instant::now() + idle, idle);
        assert_eq!(dropped.len(), 1);
        assert_eq!(
            (dropped[0].key, dropped[0].chunks, dropped[0].bytes),
            ((1, 5), 1, 5)
        );
        assert!(!tmp.exists(), "its temporary file is removed");
        assert!(a.was_refused((1, 5)));
        for c in [chunk(1, &all[5..], end), chunk(0, &all[..5], None)] {
            match a.chunk(&c, true) {
                Err(e) => assert!(e.to_string().contains("was dropped after 60000 ms"), "{e}"),
                Ok(_) => panic!("chunk {} of a dropped transfer was taken", c.seq),
            }
        }
        assert!(!tmp.exists(), "not started again");
        // Another transfer from the same sender goes through.
        let other = |mut c: SnapshotChunk| {
            c.transfer = 6;
            c
        };
        assert!(
            a.chunk(&other(chunk(0, &all[..5], None)), true)
                .expect("ok")
                .is_none()
        );
        let got = a
            .chunk(&other(chunk(1, &all[5..], end)), true)
            .expect("ok")
            .expect("done");
        assert_eq!(fs::read(got.path.expect("stored")).expect("read"), all);
    }

    /// A file backend in a new temporary folder (returned with it, to be kept as long as
    /// the backend) holding `pairs` pairs of 100-byte values: a stream to send.
    #[cfg(feature = "backend-file")]
    fn source_of(pairs: u32) -> (tempfile::TempDir, keel_backend_file::FileBackend) {
        use keel_mvcc::{Backend, Bucket, WriteBatch};
        let dir = tempfile::tempdir().expect("tempdir");
        let source =
            keel_backend_file::FileBackend::open(dir.path(), &Default::default()).expect("open");
        let bucket = Bucket::from_name("data".to_owned()).expect("bucket");
        let mut batch = WriteBatch::new();
        for i in 0..pairs {
            batch.put(&bucket, format!("k{i:05}").into_bytes(), vec![1; 100]);
        }
        source.commit(&batch).expect("commit");
        (dir, source)
    }

    /// Streams `source` as transfer `transfer` from member 1 to member 2 in 1 KiB chunks,
    /// its answer awaited on `answers` (see [`expect_answer`]) for up to a minute.
    #[cfg(feature = "backend-file")]
    fn send_from(
        source: &keel_backend_file::FileBackend,
        transport: &dyn Transport,
        acks: &AckWaiters,
        answers: Receiver<SnapshotAck>,
        transfer: u64,
        limiter: Option<&crate::tcp::RateLimiter>,
    ) -> Result<(), NodeError> {
        use keel_mvcc::Backend;
        let msg = Message {
            from: 1,
            to: 2,
            ..Message::default()
        };
        let txn = source.read_txn().expect("txn");
        send(
            transport,
            acks,
            answers,
            transfer,
            msg,
            txn,
            1024,
            Duration::from_secs(60),
            limiter,
            &|_| {},
        )
    }

    /// A transport for the sender's tests: it drops Raft messages and calls its closure with
    /// every snapshot chunk handed to it.
    #[cfg(feature = "backend-file")]
    struct OnChunk<F>(F);

    #[cfg(feature = "backend-file")]
    impl<F: Fn(&SnapshotChunk) + Send + Sync + 'static> Transport for OnChunk<F> {
        fn send(&self, _: Message) {}
        fn send_snapshot(
            &self,
            frame: SnapshotFrame,
            _: &mut dyn FnMut() -> bool,
        ) -> Result<(), NodeError> {
            if let SnapshotFrame::Chunk(c) = frame {
                (self.0)(&c);
            }
            Ok(())
        }
    }

    /// A transport that drops everything handed to it.
    #[cfg(feature = "backend-file")]
    fn nowhere() -> OnChunk<impl Fn(&SnapshotChunk) + Send + Sync + 'static> {
        OnChunk(|_: &SnapshotChunk| {})
    }

    /// Member 2's refusal of `transfer` from member 1, with `error`, as a receiver that
    /// dropped it answers.
    #[cfg(feature = "backend-file")]
    fn refuse(acks: &AckWaiters, transfer: u64, error: &str) {
        route_ack(
            acks,
            SnapshotAck {
                from: 2,
                to: 1,
                transfer,
                error: Some(error.into()),
            },
        );
    }

    /// A sender stops streaming once its transfer is refused: the chunk after the refusal
    /// is not sent, and the refusal is its result.
    #[cfg(feature = "backend-file")]
    #[test]
    fn a_refused_transfer_stops_its_sender() {
        let (_dir, source) = source_of(200);
        let acks: AckWaiters = Arc::new(Mutex::new(HashMap::new()));
        // Refuses transfer 7 when its chunk 2 arrives, as a receiver that dropped it.
        let seqs = Arc::new(Mutex::new(Vec::<u32>::new()));
        let transport = OnChunk({
            let (acks, seqs) = (acks.clone(), seqs.clone());
            move |c: &SnapshotChunk| {
                seqs.lock().push(c.seq);
                if c.seq == 2 {
                    refuse(&acks, 7, "dropped by the receiver");
                }
            }
        });
        let answers = expect_answer(&acks, 7, 2);
        let result = send_from(&source, &transport, &acks, answers, 7, None);
        match result {
            Err(e) => assert!(e.to_string().contains("dropped by the receiver"), "{e}"),
            Ok(()) => panic!("a refused transfer succeeded"),
        }
        assert_eq!(*seqs.lock(), [0, 1, 2], "nothing sent after the refusal");
        assert!(acks.lock().is_empty(), "the sender no longer waits");
    }

    /// A sender whose transport panics ends with an error, its answer no longer awaited.
    #[cfg(feature = "backend-file")]
    #[test]
    fn a_panicking_sender_ends_with_an_error() {
        let panicking = OnChunk(|_: &SnapshotChunk| panic!("transport bug"));
        let (_dir, source) = source_of(10);
        let acks: AckWaiters = Arc::new(Mutex::new(HashMap::new()));
        let answers = expect_answer(&acks, 3, 2);
        let result = send_from(&source, &panicking, &acks, answers, 3, None);
        match result {
            Err(e) => assert!(e.to_string().contains("panicked"), "{e}"),
            Ok(()) => panic!("a panicking transfer succeeded"),
        }
        assert!(acks.lock().is_empty(), "the sender no longer waits");
    }

    /// A transfer cancelled before its next chunk stops without waiting for, or taking, the
    /// pacing budget that chunk would have needed.
    #[cfg(feature = "backend-file")]
    #[test]
    fn a_cancelled_transfer_takes_no_pacing_budget() {
        let (_dir, source) = source_of(50);
        // A budget of 1 KiB/s, already spent: a chunk of 1 KiB waits about a second for it.
        let limiter = crate::tcp::RateLimiter::new(1024, 1024);
        limiter.acquire(1024);
        let acks: AckWaiters = Arc::new(Mutex::new(HashMap::new()));
        let answers = expect_answer(&acks, 9, 2);
        assert_eq!(cancel_to(&acks, 1, 2, "replaced"), 1);
        let started = Instant::now();
        let result = send_from(&source, &nowhere(), &acks, answers, 9, Some(&limiter));
        assert!(result.is_err(), "a cancelled transfer succeeded");
        assert!(
            started.elapsed() < Duration::from_millis(500),
            "the cancelled sender waited {:?} for pacing",
            started.elapsed()
        );
    }

    /// A transfer cancelled while it waits for its pacing budget stops within a slice of
    /// the wait, and gives the budget it reserved back: a transfer begun right after it (to
    /// the same member, as one replacing it) waits for its own chunk only.
    #[cfg(feature = "backend-file")]
    #[test]
    fn a_transfer_cancelled_while_paced_stops_and_gives_its_budget_back() {
        let (_dir, source) = source_of(50);
        // 512 B/s without a burst: each chunk of 1 KiB waits 2 s for its budget.
        let limiter = crate::tcp::RateLimiter::new(512, 0);
        let acks: AckWaiters = Arc::new(Mutex::new(HashMap::new()));
        let answers = expect_answer(&acks, 9, 2);
        let (cancelled, first_chunk, first_ended) = std::thread::scope(|scope| {
            let first = scope.spawn(|| {
                let result = send_from(&source, &nowhere(), &acks, answers, 9, Some(&limiter));
                (result, Instant::now())
            });
            // The first transfer is waiting for its first chunk's budget.
            std::thread::sleep(Duration::from_millis(200));
            assert_eq!(cancel_to(&acks, 1, 2, "replaced"), 1);
            let cancelled = Instant::now();
            let answers = expect_answer(&acks, 10, 2);
            // Notes when the first chunk goes out, and refuses the transfer then.
            let sent = Arc::new(Mutex::new(None::<Instant>));
            let next = OnChunk({
                let (acks, sent) = (acks.clone(), sent.clone());
                move |c: &SnapshotChunk| {
                    sent.lock().get_or_insert_with(Instant::now);
                    refuse(&acks, c.transfer, "enough");
                }
            });
            let result = send_from(&source, &next, &acks, answers, 10, Some(&limiter));
            assert!(result.is_err(), "refused at its first chunk");
            let (result, ended) = first.join().expect("first sender");
            assert!(result.is_err(), "a cancelled transfer succeeded");
            let first_chunk = sent.lock().expect("a chunk was sent");
            (cancelled, first_chunk, ended)
        });
        let stopped = first_ended.saturating_duration_since(cancelled);
        let waited = first_chunk.saturating_duration_since(cancelled);
        assert!(
            stopped < Duration::from_millis(500),
            "the cancelled sender ended {stopped:?} after its cancellation, with 1.8 s of its \
             wait left (the next transfer's first chunk went {waited:?} after it)"
        );
        assert!(
            waited < Duration::from_secs(3),
            "the next transfer's first chunk went {waited:?} after the cancellation: it waited \
             for the cancelled chunk's budget too"
        );
    }

    /// Over TCP, where the transport paces the chunks with its own limiter: a transfer
    /// cancelled while its chunk waits there stops within a slice of the wait, its chunk is
    /// never written, and the budget it reserved is given back, so the transfer replacing
    /// it waits for its own chunk only.
    #[cfg(feature = "backend-file")]
    #[test]
    fn a_tcp_transfer_cancelled_in_the_transport_limiter_stops_and_gives_its_budget_back() {
        use crate::tcp::{TcpOptions, TcpTransport};

        let (_dir, source) = source_of(50);
        // 512 B/s without a burst: each chunk of 1 KiB waits 2 s in the transport's limiter.
        let options = TcpOptions {
            snapshot_rate: 512,
            snapshot_burst: 0,
            ..TcpOptions::default()
        };
        let (leader, _leader_mailbox) =
            TcpTransport::bind(1, "127.0.0.1:0", options.clone()).expect("bind 1");
        let (follower, mailbox) = TcpTransport::bind(2, "127.0.0.1:0", options).expect("bind 2");
        leader.add_peer(2, follower.local_addr()).expect("peer");
        let acks: AckWaiters = Arc::new(Mutex::new(HashMap::new()));
        let answers = expect_answer(&acks, 9, 2);
        let (cancelled, first_ended, arrived) = std::thread::scope(|scope| {
            let first = scope.spawn(|| {
                let result = send_from(&source, &leader, &acks, answers, 9, None);
                (result, Instant::now())
            });
            // The first transfer's first chunk is waiting in the transport's limiter.
            std::thread::sleep(Duration::from_millis(200));
            assert_eq!(cancel_to(&acks, 1, 2, "replaced"), 1);
            let cancelled = Instant::now();
            let answers = expect_answer(&acks, 10, 2);
            let next = scope.spawn(|| send_from(&source, &leader, &acks, answers, 10, None));
            // Every chunk that arrives until the replacing transfer's first one.
            let mut arrived = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(20);
            while arrived
                .last()
                .is_none_or(|&(transfer, _, _)| transfer != 10)
            {
                let left = deadline.saturating_duration_since(Instant::now());
                match mailbox.snapshots.recv_timeout(left) {
                    Ok(SnapshotFrame::Chunk(c)) => {
                        arrived.push((c.transfer, c.seq, Instant::now()))
                    }
                    Ok(SnapshotFrame::Ack(_)) => {}
                    Err(_) => panic!("no chunk of the next transfer arrived: {arrived:?}"),
                }
            }
            refuse(&acks, 10, "enough");
            assert!(
                next.join().expect("next sender").is_err(),
                "refused at its first chunk"
            );
            let (result, ended) = first.join().expect("first sender");
            assert!(result.is_err(), "a cancelled transfer succeeded");
            (cancelled, ended, arrived)
        });
        let stopped = first_ended.saturating_duration_since(cancelled);
        let waited = arrived
            .last()
            .map(|&(_, _, at)| at.saturating_duration_since(cancelled))
            .unwrap_or_default();
        let written: Vec<(u64, u32)> = arrived.iter().map(|&(t, s, _)| (t, s)).collect();
        assert!(
            stopped < Duration::from_millis(500),
            "the cancelled sender ended {stopped:?} after its cancellation, with 1.8 s of its \
             wait left (chunks written: {written:?}; the next transfer's first chunk arrived \
             {waited:?} after it)"
        );
        assert_eq!(
            written,
            [(10, 0)],
            "the cancelled transfer's chunk was written"
        );
        assert!(
            waited < Duration::from_secs(3),
            "the next transfer's first chunk arrived {waited:?} after the cancellation: it \
             waited for the cancelled chunk's budget too"
        );
    }

    /// A transfer restored while it arrives is hashed once, by the restore: a damaged chunk
    /// the assembler passes on fails the stream's own checksum, and nothing is loaded past
    /// the last batch; the same chunks undamaged restore completely.
    #[cfg(feature = "backend-file")]
    #[test]
    fn a_damaged_chunk_fails_the_live_restore() {
        use keel_mvcc::{Backend, Bucket, ReadTxn, WriteBatch};
        type Fb = keel_backend_file::FileBackend;
        let dir = tempfile::tempdir().expect("tempdir");
        let source = Fb::open(&dir.path().join("source"), &Default::default()).expect("open");
        let bucket = Bucket::from_name("data".to_owned()).expect("bucket");
        let mut batch = WriteBatch::new();
        for i in 0..2000u32 {
            batch.put(&bucket, format!("k{i:05}").into_bytes(), vec![i as u8; 100]);
        }
        source.commit(&batch).expect("commit");
        let mut stream = Vec::new();
        keel_mvcc::backend::snapshot::write(&source.read_txn().expect("txn"), &mut stream)
            .expect("stream");
        let pieces: Vec<&[u8]> = stream.chunks(4096).collect();
        let end = Some((stream.len() as u64, crc32fast::hash(&stream)));
        for damaged in [None, Some(pieces.len() / 2)] {
            let node_dir = dir.path().join(format!("node-{damaged:?}"));
            fs::create_dir_all(&node_dir).expect("dir");
            let mut a = Assembler::new(node_dir.join("snap")).expect("assembler");
            let live =
                LiveRestore::<Fb>::start((1, 5), &node_dir, &Default::default()).expect("start");
            for (seq, piece) in pieces.iter().enumerate() {
                let last = seq + 1 == pieces.len();
                let mut c = chunk(seq as u32, piece, if last { end } else { None });
                if damaged == Some(seq) {
                    c.data[100] ^= 0x40;
                }
                let done = a.chunk(&c, false).expect("accepted");
                assert_eq!(done.is_some(), last);
                live.feed(c.data);
            }
            match (damaged, live.finish()) {
                (None, Ok(restored)) => {
                    let txn = restored.backend.read_txn().expect("txn");
                    let pairs = txn.range(&bucket, &[], None).expect("range").count();
                    assert_eq!(pairs, 2000);
                }
                (Some(_), Err(e)) => {
                    assert!(e.to_string().contains("snapshot"), "{e}");
                    // The failed generation's directory is gone at once, not at the next
                    // restore or restart.
                    let left: Vec<_> = fs::read_dir(&node_dir)
                        .expect("read dir")
                        .map(|e| e.expect("entry").file_name())
                        .filter(|n| n.to_string_lossy().starts_with("backend"))
                        .collect();
                    assert!(left.is_empty(), "left behind: {left:?}");
                }
                (d, r) => panic!("damaged {d:?}: restore {:?}", r.map(|_| ())),
            }
        }
    }
}
