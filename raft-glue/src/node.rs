//! [`Node`]: one replicated keel member.
//!
//! # Threads
//!
//! - The **Raft thread** owns the `RawNode`, the Raft log storage and the state machine. It
//!   waits on five sources — client commands, Raft messages, ticks, snapshot events and the
//!   persist thread's reports — takes every proposal queued in one turn into one append, and
//!   handles the `Ready` with raft-rs's asynchronous persistence: send messages (the leader
//!   before persisting, so replication overlaps its own fsync), append entries and hard
//!   state to the WAL without syncing, hand the ready to the persist thread
//!   (`advance_append_async`), apply committed entries (raft-rs hands out only entries this
//!   member has persisted), answer read-index requests. A ready carrying a snapshot is
//!   handled synchronously once nothing else is in flight: install, persist, `advance`.
//! - The **persist thread** makes the handed readies durable with one `fdatasync` per group,
//!   then sends the messages that had to wait for persistence (followers' and candidates':
//!   a member never acknowledges or votes on what is not durable) and reports the last
//!   ready's number, which the Raft thread passes to `on_persist_ready`.
//! - The **snapshot receiver thread** reassembles incoming snapshot streams, prepares the
//!   backend, and hands the `MsgSnapshot` to the Raft thread (see [`crate::snapshot`]).
//! - A **snapshot sender thread** per outgoing transfer.
//!
//! # Requests
//!
//! A write is encoded as an [`Envelope`] with this member's id and a fresh sequence number,
//! proposed, and answered when its entry is applied on this member; a proposal made on a
//! follower is forwarded to the leader by raft-rs. Linearizable reads go through ReadIndex
//! (batched: one read-index round serves every read queued in one loop turn) and wait until
//! the member has applied the read index; serializable reads read the local store. A change
//! of leader or of term (this member stepping down included, or its leader found again in a
//! later term, having stepped down and won again) fails the reads whose round in flight can
//! no longer be answered with [`NodeError::NotLeader`], as etcd fails them with "leader
//! changed": raft-rs drops those rounds. A follower that pre-campaigns and hears from the
//! same leader again in the same term keeps its rounds (asked again), unless it stays
//! without a leader for an election timeout.

use std::collections::{BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, bounded, select, unbounded};
use keel_lease::{Clock, LeaseError, Lessor, LessorOptions, SystemClock, TimeToLive};
use keel_mvcc::{
    Backend, DeleteRangeRequest, DeleteResponse, HashKv, PutRequest, PutResponse, RangeRequest,
    RangeResponse, Store, StoreOptions, TxnRequest, TxnResponse, WatchRequest, Watcher,
};
use keel_wal::{Wal, WalOptions};
use parking_lot::{Mutex, RwLock};
use protobuf::Message as _;
use raft::eraftpb::{
    ConfChangeSingle, ConfChangeTransition, ConfChangeType, ConfChangeV2, ConfState, Entry,
    EntryType, Message, MessageType, Snapshot,
};
use raft::{RawNode, SnapshotStatus, StateRole};
use raft_proto::ConfChangeI;

use crate::apply::{self, LeaseSetup, SharedCurrent, StateMachine, lease_err, store_err};
use crate::control::Control;
use crate::error::NodeError;
use crate::logger::raft_logger;
use crate::membership::set::Applied;
use crate::membership::{
    ActivityTracker, AutoPromoter, LearnerProgress, Member, MemberOp, MemberSet, MembershipError,
    MembershipOptions, ProposedChange, TransferProgress, promotion_gate, refuse_on_learner,
    strict_check,
};
use crate::options::NodeOptions;
use crate::request::{Envelope, MemberChange, Request, Response, is_member_request};
use crate::snapshot::{self, AckWaiters, Assembler, Received};
use crate::storage::RaftStorage;
use crate::tcp::RateLimiter;
use crate::transport::{Mailbox, SnapshotAck, SnapshotFrame, Transport};

/// The file a removed member leaves in its data directory so it never runs on it again.
pub const REMOVED_MARKER: &str = "removed";

/// Everything a member needs to start.
pub struct NodeConfig<B: Backend> {
    /// This member's id (never 0).
    pub id: u64,
    /// The voters of a new cluster. Used only when the data directory holds no state yet;
    /// empty for a member that joins an existing cluster (it waits for a snapshot).
    pub peers: Vec<u64>,
    /// Data directory: `wal/`, `backend/` and `snap/` live under it.
    pub dir: PathBuf,
    /// Node options.
    pub options: NodeOptions,
    /// WAL options.
    pub wal_options: WalOptions,
    /// Backend options.
    pub backend_options: B::Options,
    /// Store options.
    pub store_options: StoreOptions,
    /// Lessor options. `election_timeout` is overwritten with the node's election timeout
    /// (`tick_interval × election_ticks`).
    pub lessor_options: LessorOptions,
    /// Where lease time comes from. Default: the system's monotonic clock.
    pub clock: Arc<dyn Clock>,
    /// The members of a new cluster with their addresses, used with `peers` on bootstrap
    /// (their ids must be `peers`). Default: empty, meaning one voter per id of `peers`,
    /// named `member-<id>` with peer URL `mem://<id>`.
    pub members: Vec<Member>,
    /// Membership options (strict check, learner by default, automatic promotion, learner
    /// limit, promotion gate). Default: [`MembershipOptions::default`].
    pub membership: MembershipOptions,
    /// The cluster this member was told at start (name and peer URLs of every member),
    /// checked against the cluster's membership as soon as it is known (etcd's
    /// `--initial-cluster` with `--initial-cluster-state existing`): a mismatch stops the
    /// member with etcd's error. Default: None (not checked).
    pub start_config: Option<Vec<(String, Vec<String>)>>,
    /// Restart this member's data as a single-member cluster (etcd's
    /// `--force-new-cluster`), for recovery after permanent quorum loss: every other member
    /// is removed, this one becomes the only voter. Default: false.
    pub force_new_cluster: bool,
    /// Paces outgoing snapshot streams on a transport that does not pace them itself (the
    /// in-memory network; [`TcpTransport`](crate::TcpTransport) has its own limiter).
    /// Default: None (unlimited).
    pub snapshot_limiter: Option<Arc<RateLimiter>>,
}

impl<B: Backend> NodeConfig<B> {
    /// A configuration with default options.
    pub fn new(id: u64, peers: Vec<u64>, dir: impl Into<PathBuf>) -> NodeConfig<B> {
        NodeConfig {
            id,
            peers,
            dir: dir.into(),
            options: NodeOptions::default(),
            wal_options: WalOptions::default(),
            backend_options: B::Options::default(),
            store_options: StoreOptions::default(),
            lessor_options: LessorOptions::default(),
            clock: Arc::new(SystemClock::new()),
            members: Vec::new(),
            membership: MembershipOptions::default(),
            start_config: None,
            force_new_cluster: false,
            snapshot_limiter: None,
        }
    }
}

/// The member description the node uses for an id given without addresses.
pub fn default_member(id: u64, is_learner: bool) -> Member {
    Member {
        id,
        name: format!("member-{id}"),
        peer_urls: vec![format!("mem://{id}")],
        client_urls: Vec::new(),
        is_learner,
    }
}

/// The member recorded for `id`, which joined the configuration through a conf change that
/// carried no membership operation (a raw one), when `context` (the conf change's context)
/// describes it: an encoded [`Member`] of that id, as a membership operation encodes the
/// member it adds (and as etcd puts a member in a conf change's context). Its role comes
/// from the configuration, not from the context. `None` when the context is empty, does
/// not decode, or names another member; the caller then records [`default_member`].
fn joined_member_from_context(id: u64, is_learner: bool, context: &[u8]) -> Option<Member> {
    if context.is_empty() {
        return None;
    }
    let m = Member::decode(context).ok().filter(|m| m.id == id)?;
    Some(Member { is_learner, ..m })
}

/// A member's role in Raft.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Follows a leader (or waits for one).
    Follower,
    /// Asking for votes before a real election (pre-vote).
    PreCandidate,
    /// Asking for votes.
    Candidate,
    /// The leader.
    Leader,
}

impl From<StateRole> for Role {
    fn from(r: StateRole) -> Role {
        match r {
            StateRole::Follower => Role::Follower,
            StateRole::PreCandidate => Role::PreCandidate,
            StateRole::Candidate => Role::Candidate,
            StateRole::Leader => Role::Leader,
        }
    }
}

/// A snapshot of a member's Raft state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeStatus {
    /// This member.
    pub id: u64,
    /// The leader this member knows of.
    pub leader: Option<u64>,
    /// This member's role.
    pub role: Role,
    /// Current term.
    pub term: u64,
    /// Highest index known committed.
    pub commit: u64,
    /// Highest index applied to the store.
    pub applied: u64,
    /// Voting members.
    pub voters: Vec<u64>,
    /// Learners.
    pub learners: Vec<u64>,
    /// First index still in the log.
    pub first_index: u64,
    /// Last index in the log.
    pub last_index: u64,
    /// Snapshots installed since start.
    pub snapshots_installed: u64,
    /// Snapshots sent successfully since start.
    pub snapshots_sent: u64,
    /// Incoming snapshot transfers refused (corrupt, incomplete, unusable, not from the
    /// leader, replaced by a newer one) since start, each counted once however many of its
    /// chunks were refused.
    pub snapshots_refused: u64,
    /// Snapshot transfers this member sent or is sending, one per receiver (the latest):
    /// bytes sent, rate, estimated time left.
    pub transfers: Vec<TransferProgress>,
}

/// How a read is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadConsistency {
    /// Reflects every write acknowledged before the read started, cluster-wide (ReadIndex).
    Linearizable,
    /// The local store as it is; may be stale on a follower.
    Serializable,
}

type Reply = ReplyTx<Result<Response, NodeError>>;
type ReadReply = ReplyTx<Result<u64, NodeError>>;

/// A read-index round in flight: the reads it serves, and whom it was asked of.
struct ReadRound {
    /// When it was first asked: its reads' callers wait from then, and the sweep keeps it
    /// for twice their request timeout from then, however often it was asked again.
    first_asked: Instant,
    /// When it was last asked (first, or again by the sweep or once its leader was found
    /// again): the next batch waits a tick after it, the sweep asks again half a second
    /// after it.
    asked: Instant,
    /// The leader it was asked of (this member's leader then; this member, as the leader).
    leader: u64,
    /// This member's term then.
    term: u64,
    replies: Vec<ReadReply>,
}

/// A round unanswered this long since it was asked is asked again by the sweep.
const READ_ASK_AGAIN: Duration = Duration::from_millis(500);

impl ReadRound {
    /// A round asked at `now` of `leader` in `term`.
    fn new(now: Instant, leader: u64, term: u64, replies: Vec<ReadReply>) -> ReadRound {
        ReadRound {
            first_asked: now,
            asked: now,
            leader,
            term,
            replies,
        }
    }

    /// The round is asked again at `now` (by the sweep, or as its leader was found again).
    /// Its retention still runs from its first ask.
    fn asked_again(&mut self, now: Instant) {
        self.asked = now;
    }

    /// Whether the round is still kept at `now`: for `limit` from its first ask (by then its
    /// reads' callers have given up), however often it was asked again since.
    fn kept_at(&self, now: Instant, limit: Duration) -> bool {
        now.saturating_duration_since(self.first_asked) < limit
    }

    /// Whether the round, asked less than `tick` before `now`, holds the next batch back.
    fn holds_back_at(&self, now: Instant, tick: Duration) -> bool {
        now.saturating_duration_since(self.asked) < tick
    }

    /// Whether the sweep asks the round again at `now`.
    fn due_again_at(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.asked) >= READ_ASK_AGAIN
    }
}

/// One answer from the Raft thread to a caller: a slot and a condition variable. The caller
/// sleeps on the condition variable until the answer (or the sender's drop) arrives, without
/// the spinning and yielding of a channel receive: with many callers waiting, those would
/// take CPU from the Raft threads.
struct ReplySlot<T> {
    state: Mutex<(Option<T>, bool)>,
    ready: parking_lot::Condvar,
}

/// The Raft thread's end of a [`ReplySlot`]; dropping it unanswered tells the caller the
/// member stopped.
struct ReplyTx<T>(Arc<ReplySlot<T>>);

/// The caller's end of a [`ReplySlot`].
struct ReplyRx<T>(Arc<ReplySlot<T>>);

fn reply_slot<T>() -> (ReplyTx<T>, ReplyRx<T>) {
    let slot = Arc::new(ReplySlot {
        state: Mutex::new((None, false)),
        ready: parking_lot::Condvar::new(),
    });
    (ReplyTx(slot.clone()), ReplyRx(slot))
}

impl<T> ReplyTx<T> {
    /// Hands the answer to the caller (who may have given up already).
    fn send(self, value: T) -> Result<(), ()> {
        self.0.state.lock().0 = Some(value);
        self.0.ready.notify_one();
        Ok(())
    }
}

impl<T> Drop for ReplyTx<T> {
    fn drop(&mut self) {
        self.0.state.lock().1 = true;
        self.0.ready.notify_one();
    }
}

impl<T> ReplyRx<T> {
    /// The answer; `Err(true)` on timeout, `Err(false)` when the sender was dropped.
    fn recv_timeout(&self, timeout: Duration) -> Result<T, bool> {
        let deadline = Instant::now() + timeout;
        let mut g = self.0.state.lock();
        loop {
            if let Some(v) = g.0.take() {
                return Ok(v);
            }
            if g.1 {
                return Err(false);
            }
            if self.0.ready.wait_until(&mut g, deadline).timed_out() {
                return g.0.take().ok_or(true);
            }
        }
    }
}

enum Cmd {
    Propose {
        seq: u64,
        data: Vec<u8>,
        reply: Reply,
    },
    ConfChange {
        seq: u64,
        cc: ConfChangeV2,
        context: Vec<u8>,
        reply: Reply,
    },
    Read {
        reply: ReadReply,
    },
    Member {
        seq: u64,
        op: MemberOp,
        reply: Reply,
    },
    Campaign,
    Stop,
}

enum Event {
    /// Transfer number `transfer`, begun as the leader of `term`, ended; `ok` when the
    /// receiver acknowledged it.
    SnapshotSent {
        to: u64,
        transfer: u64,
        index: u64,
        term: u64,
        ok: bool,
    },
    SnapshotReceived {
        received: Box<Received>,
        done: Sender<bool>,
    },
}

struct Shared<B: Backend> {
    id: u64,
    options: NodeOptions,
    cmds: Sender<Cmd>,
    seq: AtomicU64,
    status: RwLock<NodeStatus>,
    current: SharedCurrent<B>,
    snapshots_refused: AtomicU64,
    stopped: AtomicBool,
    stop_reason: Mutex<Option<String>>,
    membership: MembershipOptions,
    is_learner: AtomicBool,
    members: RwLock<Listed>,
    transfers: Mutex<HashMap<u64, TransferProgress>>,
}

/// The members as last applied, published by the Raft thread for the callers.
struct Listed {
    members: Vec<Member>,
    /// The learners held from automatic promotion ([`MemberSet::is_held`]).
    held: Vec<u64>,
}

impl Listed {
    fn of(set: &MemberSet) -> Listed {
        Listed {
            members: set.members().cloned().collect(),
            held: set.held_learners().into_iter().collect(),
        }
    }
}

/// One replicated keel member. Share it between threads with `Arc`.
pub struct Node<B: Backend> {
    shared: Arc<Shared<B>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn bootstrap_conf_state(peers: &[u64]) -> ConfState {
    ConfState {
        voters: peers.to_vec(),
        ..ConfState::default()
    }
}

impl<B: Backend> Node<B> {
    /// Opens (or creates) the member's data directory and starts its threads.
    ///
    /// On restart the member recovers its log from the WAL and its state from the backend,
    /// and re-applies only the committed entries the backend lacks.
    pub fn start(
        config: NodeConfig<B>,
        transport: Arc<dyn Transport>,
        mailbox: Mailbox,
    ) -> Result<Node<B>, NodeError> {
        config.options.validate()?;
        config.membership.validate()?;
        let id = config.id;
        if id == 0 {
            return Err(NodeError::InvalidOption("member id 0 is reserved".into()));
        }
        fs::create_dir_all(&config.dir)
            .map_err(|e| NodeError::io(&config.dir, "create directory", e))?;
        if config.dir.join(REMOVED_MARKER).exists() {
            return Err(NodeError::Member {
                id,
                source: MembershipError::PermanentlyRemoved { id },
            });
        }
        let mut lessor_options = config.lessor_options.clone();
        lessor_options.election_timeout =
            config.options.tick_interval * config.options.election_ticks as u32;
        let sm = StateMachine::<B>::open(
            &config.dir,
            config.backend_options.clone(),
            config.store_options.clone(),
            LeaseSetup {
                clock: config.clock.clone(),
                options: lessor_options,
            },
        )?;
        let wal = Arc::new(
            Wal::open(&config.dir.join("wal"), config.wal_options.clone())
                .map_err(|e| NodeError::Log(e.to_string()))?,
        );
        let member_err = |source| NodeError::Member { id, source };
        let mut members = MemberSet::load(&sm.store()).map_err(member_err)?;
        members.check_not_removed(id).map_err(member_err)?;
        let conf_state = match sm.conf_state()? {
            Some(_) if config.force_new_cluster => {
                let cs = bootstrap_conf_state(&[id]);
                members = members.forced_single(id, sm.applied(), default_member(id, false));
                sm.bootstrap(&cs, &members)?;
                tracing::warn!(
                    member = id,
                    "forced a new single-member cluster from this member's data"
                );
                cs
            }
            Some(cs) => cs,
            None if !config.peers.is_empty() => {
                let list = if config.members.is_empty() {
                    config
                        .peers
                        .iter()
                        .map(|&p| default_member(p, false))
                        .collect()
                } else {
                    config.members.clone()
                };
                let mut ids: Vec<u64> = list.iter().map(|m| m.id).collect();
                let mut peers = config.peers.clone();
                ids.sort_unstable();
                peers.sort_unstable();
                if ids != peers {
                    return Err(NodeError::InvalidOption(format!(
                        "the members' ids {ids:?} are not the peers {peers:?}"
                    )));
                }
                members = MemberSet::bootstrap(list).map_err(member_err)?;
                let cs = bootstrap_conf_state(&config.peers);
                sm.bootstrap(&cs, &members)?;
                cs
            }
            None => ConfState::default(),
        };
        let mut start_checked = false;
        if let Some(local) = &config.start_config
            && members.members().next().is_some()
        {
            members.check_start_config(local).map_err(member_err)?;
            start_checked = true;
        }
        let applied = sm.applied();
        let snap_term = sm
            .snapshot_point()?
            .filter(|(i, _)| *i == applied)
            .map(|(_, t)| t);
        let storage = RaftStorage::open(wal, conf_state, applied, snap_term)?;
        let (_, last, _) = storage.bounds();
        let raft_applied = applied.min(last);
        let cfg = config.options.raft_config(id, raft_applied);
        cfg.validate()
            .map_err(|e| NodeError::InvalidOption(e.to_string()))?;
        let logger = raft_logger(id);
        let raw = RawNode::new(&cfg, storage.clone(), &logger)
            .map_err(|source| NodeError::Raft { id, source })?;

        let (cmd_tx, cmd_rx) = unbounded();
        let (ev_tx, ev_rx) = unbounded();
        let shared = Arc::new(Shared {
            id,
            options: config.options.clone(),
            cmds: cmd_tx,
            // Sequence numbers and read contexts start at a random point in each incarnation,
            // so a replayed entry or a late read-index answer addressed to a previous
            // incarnation of this member cannot complete a new caller's request.
            seq: AtomicU64::new(incarnation_base()),
            status: RwLock::new(NodeStatus {
                id,
                leader: None,
                role: Role::Follower,
                term: 0,
                commit: 0,
                applied,
                voters: Vec::new(),
                learners: Vec::new(),
                first_index: 0,
                last_index: 0,
                snapshots_installed: 0,
                snapshots_sent: 0,
                snapshots_refused: 0,
                transfers: Vec::new(),
            }),
            current: sm.shared(),
            snapshots_refused: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
            stop_reason: Mutex::new(None),
            membership: config.membership.clone(),
            is_learner: AtomicBool::new(false),
            members: RwLock::new(Listed::of(&members)),
            transfers: Mutex::new(HashMap::new()),
        });
        let acks: AckWaiters = Arc::new(Mutex::new(HashMap::new()));
        let assembler = Assembler::new(config.dir.join("snap"))?;
        let Mailbox {
            raft: raft_rx,
            snapshots: snap_rx,
        } = mailbox;

        let mut threads = Vec::new();
        {
            let transport = transport.clone();
            let acks = acks.clone();
            let shared2 = shared.clone();
            let ev_tx = ev_tx.clone();
            let dir = config.dir.clone();
            let bopts = config.backend_options.clone();
            let sopts = config.store_options.clone();
            let prepared = sm.prepared_slot();
            threads.push(spawn(&format!("keel-snap-recv-{id}"), move || {
                receive_loop::<B>(
                    shared2, snap_rx, transport, acks, assembler, ev_tx, dir, bopts, sopts,
                    prepared,
                )
            })?);
        }
        let (job_tx, job_rx) = unbounded();
        let (persisted_tx, persisted_rx) = unbounded();
        {
            let storage = storage.clone();
            let transport = transport.clone();
            threads.push(spawn(&format!("keel-persist-{id}"), move || {
                persist_loop(storage, transport, job_rx, persisted_tx)
            })?);
        }
        let last_term = raw.raft.term;
        let mut driver = Driver {
            id,
            shared: shared.clone(),
            raw,
            storage,
            persist_jobs: job_tx,
            persisted_rx,
            handed: 0,
            persisted: 0,
            proposals: Vec::new(),
            proposals_held: None,
            deferred_members: Vec::new(),
            sm,
            transport,
            acks,
            events: ev_tx,
            waiters: HashMap::new(),
            reads: HashMap::new(),
            leaderless_since: None,
            last_term,
            read_batch: Vec::new(),
            read_ctx: incarnation_base(),
            applied_waits: Vec::new(),
            last_snapshot_point: applied,
            // Numbers from a random base, so a late ack of an earlier run's transfer is
            // unlikely to name one of this run's.
            transfer: incarnation_base(),
            latest_transfer: HashMap::new(),
            snapshots_installed: 0,
            snapshots_sent: 0,
            dir: config.dir.clone(),
            was_leader: false,
            last_lease_check: Instant::now(),
            members,
            mopts: config.membership.clone(),
            activity: ActivityTracker::new(),
            auto: AutoPromoter::new(),
            snap_idx: HashMap::new(),
            applied_reports: HashMap::new(),
            last_member_turn: Instant::now(),
            was_member_leader: false,
            start_config: config.start_config.clone(),
            start_checked,
            limiter: config.snapshot_limiter.clone(),
            removed: false,
        };
        for m in driver.members.members() {
            driver.transport.peer_added(m.id, &m.peer_urls);
        }
        driver.update_status();
        threads.push(spawn(&format!("keel-raft-{id}"), move || {
            driver.run(cmd_rx, raft_rx, ev_rx)
        })?);
        Ok(Node {
            shared,
            threads: Mutex::new(threads),
        })
    }

    /// This member's id.
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// Raft status: leader, term, commit and applied index, members.
    pub fn status(&self) -> NodeStatus {
        let mut s = self.shared.status.read().clone();
        s.snapshots_refused = self.shared.snapshots_refused.load(Ordering::Relaxed);
        s
    }

    /// The options the node runs with.
    pub fn options(&self) -> &NodeOptions {
        &self.shared.options
    }

    /// The current store (replaced when a snapshot is installed): serializable reads, hashes,
    /// watches.
    pub fn store(&self) -> Arc<Store<B>> {
        self.shared.current.read().store.clone()
    }

    /// The current lessor (replaced with the store when a snapshot is installed).
    pub fn lessor(&self) -> Arc<Lessor<B>> {
        self.shared.current.read().lessor.clone()
    }

    fn refuse_on_learner(&self) -> Result<(), NodeError> {
        refuse_on_learner(self.shared.is_learner.load(Ordering::Acquire), true)?;
        Ok(())
    }

    fn check_running(&self) -> Result<(), NodeError> {
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err(self.stopped_error());
        }
        Ok(())
    }

    fn stopped_error(&self) -> NodeError {
        NodeError::Stopped {
            id: self.shared.id,
            reason: self.shared.stop_reason.lock().clone(),
        }
    }

    fn wait<T>(
        &self,
        rx: ReplyRx<Result<T, NodeError>>,
        what: &'static str,
    ) -> Result<T, NodeError> {
        let timeout = self.shared.options.request_timeout;
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(true) => Err(NodeError::Timeout {
                what,
                millis: timeout.as_millis() as u64,
            }),
            Err(false) => Err(self.stopped_error()),
        }
    }

    /// Replicates `request` and returns its result once applied on this member.
    ///
    /// A learner refuses every proposal ("rpc not supported for learner"). Lease checkpoints
    /// are refused ([`NodeError::InvalidRequest`]): only the leader's lessor produces them
    /// (see [`Node::lease_renew`]), and one proposed from outside could set any lease's
    /// remaining TTL.
    pub fn propose(&self, request: Request) -> Result<Response, NodeError> {
        if matches!(request, Request::LeaseCheckpoint(_)) {
            return Err(NodeError::InvalidRequest(
                "lease checkpoints are produced by the leader's lessor, not proposed".to_owned(),
            ));
        }
        self.replicate(request)
    }

    /// [`propose`](Node::propose) without the refusal of lease checkpoints.
    fn replicate(&self, request: Request) -> Result<Response, NodeError> {
        self.check_running()?;
        self.refuse_on_learner()?;
        let seq = self.shared.seq.fetch_add(1, Ordering::Relaxed);
        let env = Envelope {
            origin: self.shared.id,
            seq,
            request,
        };
        let data = env.encode();
        let limit = self.shared.options.max_request_bytes;
        if data.len() > limit {
            return Err(NodeError::RequestTooLarge {
                size: data.len(),
                limit,
            });
        }
        let (tx, rx) = reply_slot();
        let cmd = match env.request {
            Request::ConfChange(changes) => Cmd::ConfChange {
                seq,
                cc: conf_change(&changes),
                context: data,
                reply: tx,
            },
            Request::Member(op) => Cmd::Member { seq, op, reply: tx },
            _ => Cmd::Propose {
                seq,
                data,
                reply: tx,
            },
        };
        self.shared
            .cmds
            .send(cmd)
            .map_err(|_| self.stopped_error())?;
        self.wait(rx, "proposal")
    }

    /// Puts `key` = `value`.
    pub fn put(&self, key: &[u8], value: &[u8]) -> Result<PutResponse, NodeError> {
        self.put_with(PutRequest::new(key.to_vec(), value.to_vec()))
    }

    /// A put with all its options.
    pub fn put_with(&self, req: PutRequest) -> Result<PutResponse, NodeError> {
        match self.propose(Request::Put(req))? {
            Response::Put(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }

    /// Deletes a key or range.
    pub fn delete_range(&self, req: DeleteRangeRequest) -> Result<DeleteResponse, NodeError> {
        match self.propose(Request::DeleteRange(req))? {
            Response::DeleteRange(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }

    /// Runs a transaction.
    pub fn txn(&self, req: TxnRequest) -> Result<TxnResponse, NodeError> {
        match self.propose(Request::Txn(req))? {
            Response::Txn(r) => Ok(r),
            other => Err(unexpected(other)),
        }
    }

    /// Compacts the history below `revision` on every member.
    pub fn compact(&self, revision: u64) -> Result<(), NodeError> {
        match self.propose(Request::Compact { revision })? {
            Response::Compact { .. } => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    /// Grants a lease of `ttl` seconds with a fresh id; returns `(id, granted TTL)`.
    pub fn lease_grant(&self, ttl: i64) -> Result<(i64, i64), NodeError> {
        let id = loop {
            let id = rand::random::<i64>() & i64::MAX;
            if id != 0 {
                break id;
            }
        };
        self.lease_grant_id(id, ttl)
    }

    /// Grants lease `id` (never 0) of `ttl` seconds; returns `(id, granted TTL)`.
    pub fn lease_grant_id(&self, id: i64, ttl: i64) -> Result<(i64, i64), NodeError> {
        match self.propose(Request::LeaseGrant { id, ttl })? {
            Response::LeaseGrant { id, ttl } => Ok((id, ttl)),
            other => Err(unexpected(other)),
        }
    }

    /// Revokes lease `id`, deleting its keys; returns the store revision after it.
    pub fn lease_revoke(&self, id: i64) -> Result<u64, NodeError> {
        match self.propose(Request::LeaseRevoke { id })? {
            Response::LeaseRevoke { revision } => Ok(revision),
            other => Err(unexpected(other)),
        }
    }

    /// Renews lease `id` on the leader, once a quorum has confirmed its leadership; returns
    /// its TTL. On a follower, or a leader that steps down before the quorum confirms it:
    /// [`NodeError::NotLeader`] with the leader's id when one is known. When the lease
    /// carried a checkpointed remaining TTL, or a checkpoint of it may not be applied yet, a
    /// clear is replicated before returning (after any such checkpoint in the log), so a new
    /// leader restores the full TTL.
    pub fn lease_renew(&self, id: i64) -> Result<i64, NodeError> {
        self.check_running()?;
        let status = self.status();
        if status.role != Role::Leader {
            return Err(NodeError::NotLeader {
                id: self.shared.id,
                leader: status.leader,
            });
        }
        // Leadership confirmed by a quorum first (a read index): a leader cut off from the
        // others still believes it leads until its check-quorum timeout, while a new leader
        // may already have let the lease expire.
        self.read_index()?;
        let renewal = self.lessor().renew(id).map_err(|e| match e {
            // Just elected, its lessor not yet promoted: not the leader for leases yet.
            LeaseError::NotPrimary { .. } => NodeError::NotLeader {
                id: self.shared.id,
                leader: self.status().leader,
            },
            e => lease_err(e),
        })?;
        if let Some(cp) = renewal.checkpoint {
            let cleared = self.replicate(Request::LeaseCheckpoint(vec![
                crate::request::LeaseCheckpoint {
                    id: cp.id,
                    remaining_ttl: cp.remaining_ttl,
                },
            ]));
            if let Err(e) = cleared {
                // The next renewal asks for the clear again.
                self.lessor().clear_not_replicated(id);
                return Err(e);
            }
        }
        Ok(renewal.ttl)
    }

    /// Remaining TTL of lease `id` (and its keys when `with_keys`), after a linearizable
    /// barrier so a lease granted or revoked before the call is seen.
    pub fn lease_time_to_live(&self, id: i64, with_keys: bool) -> Result<TimeToLive, NodeError> {
        self.read_index()?;
        self.lessor().time_to_live(id, with_keys).map_err(lease_err)
    }

    /// Ids of every lease this member knows.
    pub fn lease_list(&self) -> Vec<i64> {
        self.lessor().leases()
    }

    /// Adds member `id` (peer URL `mem://<id>`) as a voter, or as a learner when
    /// [`MembershipOptions::learner_by_default`] is on; returns `(voters, learners)` after
    /// the change.
    pub fn add_voter(&self, id: u64) -> Result<(Vec<u64>, Vec<u64>), NodeError> {
        Self::check_id(id)?;
        self.member_op(MemberOp::Add(default_member(id, false)))
    }

    /// Adds member `id` (peer URL `mem://<id>`) as a learner; returns `(voters, learners)`
    /// after the change.
    pub fn add_learner(&self, id: u64) -> Result<(Vec<u64>, Vec<u64>), NodeError> {
        Self::check_id(id)?;
        self.member_op(MemberOp::Add(default_member(id, true)))
    }

    /// Removes a member; returns `(voters, learners)` after the change.
    pub fn remove_member(&self, id: u64) -> Result<(Vec<u64>, Vec<u64>), NodeError> {
        Self::check_id(id)?;
        self.member_op(MemberOp::Remove(id))
    }

    fn check_id(id: u64) -> Result<(), NodeError> {
        if id == 0 {
            return Err(NodeError::Membership("member id 0 is reserved".into()));
        }
        Ok(())
    }

    /// Adds a member with a fresh random id (etcd `member add`): a learner when
    /// `as_learner` or when [`MembershipOptions::learner_by_default`] is on. Returns the
    /// member as added. Works on any voter: a follower forwards it to the leader.
    pub fn member_add(
        &self,
        name: &str,
        peer_urls: Vec<String>,
        as_learner: bool,
    ) -> Result<Member, NodeError> {
        let taken: Vec<u64> = self
            .shared
            .members
            .read()
            .members
            .iter()
            .map(|m| m.id)
            .collect();
        let m = Member::with_random_id(
            name,
            peer_urls,
            Vec::new(),
            as_learner || self.shared.membership.learner_by_default,
            |id| taken.contains(&id),
        );
        self.member_add_member(m)
    }

    /// Adds `member` with its own id (a removed id is refused with "ID removed").
    pub fn member_add_member(&self, mut member: Member) -> Result<Member, NodeError> {
        if self.shared.membership.learner_by_default {
            member.is_learner = true;
        }
        self.member_op(MemberOp::Add(member.clone()))?;
        Ok(member)
    }

    /// Removes member `id` (etcd `member remove`); the member stops when it learns it.
    pub fn member_remove(&self, id: u64) -> Result<(Vec<u64>, Vec<u64>), NodeError> {
        self.member_op(MemberOp::Remove(id))
    }

    /// Promotes learner `id` to a voter (etcd `member promote`), if the promotion gate
    /// holds.
    pub fn member_promote(&self, id: u64) -> Result<(Vec<u64>, Vec<u64>), NodeError> {
        self.member_op(MemberOp::Promote {
            id,
            automatic: false,
        })
    }

    /// Replaces the peer URLs of member `id` (etcd `member update`).
    pub fn member_update_peer_urls(
        &self,
        id: u64,
        peer_urls: Vec<String>,
    ) -> Result<(Vec<u64>, Vec<u64>), NodeError> {
        self.member_op(MemberOp::UpdatePeerUrls { id, peer_urls })
    }

    /// The members as this member last applied them (etcd `member list`).
    pub fn member_list(&self) -> Vec<Member> {
        self.shared.members.read().members.clone()
    }

    /// The learners held from automatic promotion, as this member last applied them, by id:
    /// those whose role was last set by a raw conf change ([`Request::ConfChange`], or any
    /// conf change entry that carries no membership operation) that added them as learners
    /// or demoted them. The leader never promotes them automatically (see
    /// [`MembershipOptions::auto_promote`]); [`member_promote`](Self::member_promote), or a
    /// raw conf change making one a voter, still does, and ends its hold.
    pub fn held_learners(&self) -> Vec<u64> {
        self.shared.members.read().held.clone()
    }

    /// Runs one membership operation through the leader.
    pub fn member_op(&self, op: MemberOp) -> Result<(Vec<u64>, Vec<u64>), NodeError> {
        match self.propose(Request::Member(op))? {
            Response::ConfChange { voters, learners } => Ok((voters, learners)),
            other => Err(unexpected(other)),
        }
    }

    /// Waits until this member has applied everything committed before the call (ReadIndex)
    /// and returns that index.
    ///
    /// A learner refuses ("rpc not supported for learner"): it serves serializable reads only.
    /// When the leader changes (this member steps down, say) while the read waits for its
    /// read index, it fails at once with [`NodeError::NotLeader`] (etcd: "leader changed"):
    /// retry it, here or on another member.
    pub fn read_index(&self) -> Result<u64, NodeError> {
        self.check_running()?;
        self.refuse_on_learner()?;
        let (tx, rx) = reply_slot();
        self.shared
            .cmds
            .send(Cmd::Read { reply: tx })
            .map_err(|_| self.stopped_error())?;
        self.wait(rx, "linearizable read")
    }

    /// Reads a key or range.
    pub fn range(
        &self,
        req: &RangeRequest,
        consistency: ReadConsistency,
    ) -> Result<RangeResponse, NodeError> {
        if consistency == ReadConsistency::Linearizable {
            self.read_index()?;
        } else {
            self.check_running()?;
        }
        self.store().range(req).map_err(store_err)
    }

    /// The history hash at `revision` (0: current), for cross-member comparison.
    pub fn hash_kv(&self, revision: u64) -> Result<HashKv, NodeError> {
        self.store().hash_kv(revision).map_err(store_err)
    }

    /// Watches a key or range on this member's store.
    pub fn watch(&self, req: WatchRequest) -> Result<Watcher, NodeError> {
        self.store().watch(req).map_err(store_err)
    }

    /// Asks this member to start an election now.
    pub fn campaign(&self) -> Result<(), NodeError> {
        self.check_running()?;
        self.shared
            .cmds
            .send(Cmd::Campaign)
            .map_err(|_| self.stopped_error())
    }

    /// Stops the member's threads and waits for them. Idempotent.
    pub fn stop(&self) {
        let _ = self.shared.cmds.send(Cmd::Stop);
        self.shared.stopped.store(true, Ordering::Release);
        let threads: Vec<_> = self.threads.lock().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
    }

    /// The WAL directory of a member whose data directory is `dir` (for tools and tests).
    pub fn wal_dir(dir: &Path) -> PathBuf {
        dir.join("wal")
    }
}

impl<B: Backend> Drop for Node<B> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A random starting point for per-incarnation counters, leaving room for 2^32 increments.
fn incarnation_base() -> u64 {
    (rand::random::<u64>() >> 1) & !0xffff_ffff | 1
}

fn unexpected(r: Response) -> NodeError {
    NodeError::Store(format!("unexpected response {r:?}"))
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, NodeError> {
    thread::Builder::new()
        .name(name.to_owned())
        .spawn(f)
        .map_err(|e| NodeError::io(name, "spawn thread", e))
}

/// Every member configuration `cs` lists: its voters, its learners and, in a joint
/// configuration, its outgoing voters (with the learners-to-be among them).
fn configured(cs: &ConfState) -> BTreeSet<u64> {
    cs.voters
        .iter()
        .chain(&cs.learners)
        .chain(&cs.voters_outgoing)
        .chain(&cs.learners_next)
        .copied()
        .collect()
}

fn conf_change(changes: &[MemberChange]) -> ConfChangeV2 {
    let mut cc = ConfChangeV2::default();
    cc.set_transition(ConfChangeTransition::Auto);
    let singles: Vec<ConfChangeSingle> = changes
        .iter()
        .map(|c| {
            let (ty, id) = match *c {
                MemberChange::AddVoter(id) => (ConfChangeType::AddNode, id),
                MemberChange::Remove(id) => (ConfChangeType::RemoveNode, id),
                MemberChange::AddLearner(id) => (ConfChangeType::AddLearnerNode, id),
            };
            let mut s = ConfChangeSingle::default();
            s.set_change_type(ty);
            s.node_id = id;
            s
        })
        .collect();
    cc.set_changes(singles.into());
    cc
}

#[allow(clippy::too_many_arguments)]
fn receive_loop<B: Backend>(
    shared: Arc<Shared<B>>,
    rx: Receiver<SnapshotFrame>,
    transport: Arc<dyn Transport>,
    acks: AckWaiters,
    mut assembler: Assembler,
    events: Sender<Event>,
    dir: PathBuf,
    backend_options: B::Options,
    store_options: StoreOptions,
    prepared_slot: apply::PreparedSlot<B>,
) {
    let id = shared.id;
    // The transfer being restored while it arrives, if any.
    let mut live: Option<snapshot::LiveRestore<B>> = None;
    loop {
        if rx.is_empty() {
            // Nothing is queued, so every chunk that has arrived was taken: a transfer idle
            // now was really left without chunks, not kept waiting behind this loop.
            drop_idle_transfers(&shared, &*transport, &mut assembler, &mut live);
        }
        let frame = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(f) => f,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                if shared.stopped.load(Ordering::Acquire) {
                    return;
                }
                continue;
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        };
        let chunk = match frame {
            SnapshotFrame::Ack(a) => {
                snapshot::route_ack(&acks, a);
                continue;
            }
            SnapshotFrame::Chunk(c) => c,
        };
        let (from, transfer) = (chunk.from, chunk.transfer);
        let key = (from, transfer);
        if chunk.seq == 0 {
            // A transfer left without chunks is not in the way of a new one.
            drop_idle_transfers(&shared, &*transport, &mut assembler, &mut live);
            let admitted = snapshot::check_sender(&receiver_view(&shared), &chunk)
                .map_err(|reason| NodeError::Snapshot {
                    from,
                    to: id,
                    reason,
                })
                .and_then(|()| assembler.admit(&chunk));
            for (old, reason) in assembler.take_replaced() {
                if live.as_ref().is_some_and(|l| l.key == old) {
                    live = None;
                }
                tracing::info!(
                    member = id,
                    from = old.0,
                    transfer = old.1,
                    "incoming snapshot transfer {reason}"
                );
                shared.snapshots_refused.fetch_add(1, Ordering::Relaxed);
                answer_transfer(&*transport, id, old, Some(reason));
            }
            if let Err(e) = admitted {
                // A late first chunk of a transfer refused before is not counted again.
                if assembler.refuse(key, &e) {
                    tracing::warn!(member = id, from, transfer, error = %e, "snapshot transfer refused");
                    shared.snapshots_refused.fetch_add(1, Ordering::Relaxed);
                }
                answer_transfer(&*transport, id, key, Some(e.to_string()));
                continue;
            }
            // One restore at a time: the admitted transfer replaces the one in progress
            // (refused above). The old restore ends, and a prepared snapshot raft-rs did not
            // take is discarded, before the new restore begins.
            drop(live.take());
            let stale = prepared_slot.lock().take();
            if let Some(stale) = stale {
                apply::discard_prepared(&dir, stale);
            }
            live = match snapshot::LiveRestore::<B>::start(key, &dir, &backend_options) {
                Ok(l) => Some(l),
                Err(e) => {
                    tracing::warn!(member = id, from, error = %e, "snapshot restore not started; restoring from the file at the end");
                    None
                }
            };
        }
        // A transfer restored while it arrives is not stored in a file as well.
        let store = live.as_ref().is_none_or(|l| l.key != key);
        // A transfer refused before has its late chunks refused, not counted again.
        let refused_before = assembler.was_refused(key);
        let accepted = assembler.chunk(&chunk, store);
        match (&accepted, live.as_ref()) {
            (Ok(_), Some(l)) if l.key == key => l.feed(chunk.data),
            (Err(_), Some(l)) if l.key == key => live = None,
            _ => {}
        }
        let outcome = accepted.and_then(|done| {
            let Some(received) = done else {
                return Ok(false);
            };
            let meta = received.message.get_snapshot().get_metadata().clone();
            let stream_end = Instant::now();
            let prepared = match live.take() {
                Some(l) if l.key == key => l.finish().and_then(|restored| {
                    let generation = restored.generation;
                    apply::finish_restore(
                        generation,
                        restored.backend,
                        Some(restored.index),
                        &store_options,
                        meta.index,
                        meta.term,
                        meta.get_conf_state(),
                    )
                    // Refused (it holds another index than its metadata says): the store
                    // over it is closed by now, and its directory goes.
                    .inspect_err(|_| snapshot::generation::remove(&dir, generation))
                }),
                other => {
                    drop(other);
                    match &received.path {
                        Some(path) => apply::prepare_snapshot::<B>(
                            &dir,
                            &backend_options,
                            &store_options,
                            path,
                            meta.index,
                            meta.term,
                            meta.get_conf_state(),
                        ),
                        None => Err(NodeError::Snapshot {
                            from,
                            to: id,
                            reason: "its restore was abandoned".into(),
                        }),
                    }
                }
            };
            if let Some(path) = &received.path {
                let _ = fs::remove_file(path);
            }
            *prepared_slot.lock() = Some(prepared?);
            let prepared_at = Instant::now();
            let (done_tx, done_rx) = bounded(1);
            events
                .send(Event::SnapshotReceived {
                    received: Box::new(received),
                    done: done_tx,
                })
                .map_err(|_| NodeError::Stopped { id, reason: None })?;
            let installed = done_rx.recv().unwrap_or(false);
            if !installed {
                // Not taken by raft-rs: close it and remove its generation's directory.
                let refused = prepared_slot.lock().take();
                if let Some(refused) = refused {
                    apply::discard_prepared(&dir, refused);
                }
            }
            tracing::info!(
                member = id,
                from,
                index = meta.index,
                installed,
                prepare_ms = prepared_at.duration_since(stream_end).as_secs_f64() * 1e3,
                install_ms = prepared_at.elapsed().as_secs_f64() * 1e3,
                "snapshot received (prepare: from the stream's last chunk to the restored store open and synced; install: switched to by the Raft thread)"
            );
            Ok(true)
        });
        let error = match outcome {
            Ok(false) => continue,
            Ok(true) => None,
            Err(e) => {
                // Refused as it ended (it could not be prepared) or by its chunk (the
                // assembler refused it already); its later chunks, if any, are refused.
                assembler.refuse(key, &e);
                if refused_before {
                    tracing::debug!(member = id, from, transfer, error = %e, "late chunk of a refused snapshot transfer");
                } else {
                    tracing::warn!(member = id, from, error = %e, "snapshot transfer refused");
                    shared.snapshots_refused.fetch_add(1, Ordering::Relaxed);
                }
                Some(e.to_string())
            }
        };
        answer_transfer(&*transport, id, key, error);
    }
}

/// What this member knows of its term, leader and configuration, for
/// [`snapshot::check_sender`].
fn receiver_view<B: Backend>(shared: &Shared<B>) -> snapshot::ReceiverView {
    let s = shared.status.read();
    snapshot::ReceiverView {
        id: shared.id,
        term: s.term,
        leader: s.leader,
        members: s.voters.iter().chain(&s.learners).copied().collect(),
    }
}

/// Answers the sender of transfer `key` (`(from, transfer)`): installed when `error` is
/// `None`, refused for `error` otherwise.
fn answer_transfer(transport: &dyn Transport, id: u64, key: (u64, u64), error: Option<String>) {
    let _ = transport.send_snapshot(
        SnapshotFrame::Ack(SnapshotAck {
            from: id,
            to: key.0,
            transfer: key.1,
            error,
        }),
        &mut || false,
    );
}

/// Drops every incoming transfer that has had no chunk for `snapshot_idle_timeout` (its
/// restore with it) and answers its sender with a refusal.
fn drop_idle_transfers<B: Backend>(
    shared: &Shared<B>,
    transport: &dyn Transport,
    assembler: &mut Assembler,
    live: &mut Option<snapshot::LiveRestore<B>>,
) {
    let id = shared.id;
    let idle = shared.options.snapshot_idle_timeout;
    for dropped in assembler.drop_idle(Instant::now(), idle) {
        let (from, transfer) = dropped.key;
        if live.as_ref().is_some_and(|l| l.key == dropped.key) {
            *live = None;
        }
        let reason = format!(
            "no chunk for {} ms: the transfer was dropped after {} chunks ({} bytes)",
            idle.as_millis(),
            dropped.chunks,
            dropped.bytes
        );
        tracing::warn!(
            member = id,
            from,
            transfer,
            "incoming snapshot transfer dropped: {reason}"
        );
        shared.snapshots_refused.fetch_add(1, Ordering::Relaxed);
        answer_transfer(transport, id, dropped.key, Some(reason));
    }
}

type DeferredMember = (u64, u64, MemberOp, Option<Reply>, Instant);

/// A ready handed to the persist thread: its entries and hard state are already appended to
/// the WAL (not synced).
struct PersistJob {
    number: u64,
    /// raft-rs's `must_sync`.
    sync: bool,
    /// Messages to send once the ready is durable.
    messages: Vec<Message>,
}

/// The persist thread's report: every ready up to `number` is durable (or the sync failed).
struct Persisted {
    number: u64,
    result: Result<(), NodeError>,
    /// Messages the Raft thread sends itself (snapshots).
    held: Vec<Message>,
}

/// The persist thread: takes every queued ready, makes them durable with one `fdatasync`,
/// sends the messages that waited for them, and reports the last ready's number.
fn persist_loop(
    storage: RaftStorage,
    transport: Arc<dyn Transport>,
    jobs: Receiver<PersistJob>,
    done: Sender<Persisted>,
) {
    while let Ok(first) = jobs.recv() {
        let mut batch = vec![first];
        while let Ok(j) = jobs.try_recv() {
            batch.push(j);
        }
        let number = batch.last().map_or(0, |j| j.number);
        let result = if batch.iter().any(|j| j.sync) {
            storage.sync()
        } else {
            Ok(())
        };
        let failed = result.is_err();
        let mut held = Vec::new();
        if !failed {
            for m in batch.into_iter().flat_map(|j| j.messages) {
                if m.get_msg_type() == MessageType::MsgSnapshot {
                    held.push(m);
                } else {
                    transport.send(m);
                }
            }
        }
        if done
            .send(Persisted {
                number,
                result,
                held,
            })
            .is_err()
            || failed
        {
            return;
        }
    }
}

/// The last snapshot transfer begun to a member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LatestTransfer {
    /// Its number.
    transfer: u64,
    /// The term this member led when it began it.
    term: u64,
    /// When it began.
    began: Instant,
}

struct Driver<B: Backend> {
    id: u64,
    shared: Arc<Shared<B>>,
    raw: RawNode<RaftStorage>,
    storage: RaftStorage,
    /// Readies handed to the persist thread.
    persist_jobs: Sender<PersistJob>,
    /// Its reports.
    persisted_rx: Receiver<Persisted>,
    /// Number of the last ready handed to the persist thread.
    handed: u64,
    /// Number of the last ready the persist thread reported durable.
    persisted: u64,
    /// Proposals taken in this loop turn, proposed together in one message.
    proposals: Vec<(u64, Vec<u8>, Reply)>,
    /// Since when `proposals` wait for a leader to be known.
    proposals_held: Option<Instant>,
    /// Membership operations held back until the leader commits in its term:
    /// `(origin, seq, op, local caller, since)`.
    deferred_members: Vec<DeferredMember>,
    sm: StateMachine<B>,
    transport: Arc<dyn Transport>,
    acks: AckWaiters,
    events: Sender<Event>,
    /// Proposals made on this member, by sequence number.
    waiters: HashMap<u64, (Instant, Reply)>,
    /// Read-index rounds in flight, by context.
    reads: HashMap<u64, ReadRound>,
    /// Since when no leader has been known, while read-index rounds sent under the last one
    /// wait to hear from it again (see [`Driver::fail_reads_in_flight`]).
    leaderless_since: Option<Instant>,
    /// The term of the last ready: raft-rs's soft state has no term, so a leader found again
    /// in a later term (it stepped down and won again) changes no soft state, and only this
    /// tells the read-index rounds of the earlier term from the others.
    last_term: u64,
    /// Reads queued in this loop turn.
    read_batch: Vec<ReadReply>,
    read_ctx: u64,
    /// Reads whose index is known, waiting for the apply to reach it.
    applied_waits: Vec<(u64, ReadReply)>,
    last_snapshot_point: u64,
    transfer: u64,
    /// Per member, the last transfer begun to it: raft-rs tracks one snapshot per member,
    /// and only that transfer's end is reported to it (or its stall, see
    /// [`give_up_stalled_transfers`](Self::give_up_stalled_transfers)).
    latest_transfer: HashMap<u64, LatestTransfer>,
    snapshots_installed: u64,
    snapshots_sent: u64,
    dir: PathBuf,
    was_leader: bool,
    last_lease_check: Instant,
    /// The applied membership.
    members: MemberSet,
    mopts: MembershipOptions,
    /// When each member was last heard from (strict check, promotion gate).
    activity: ActivityTracker,
    auto: AutoPromoter,
    /// Index of the last snapshot each member acknowledged (leader).
    snap_idx: HashMap<u64, u64>,
    /// The applied index each learner last reported (leader).
    applied_reports: HashMap<u64, u64>,
    last_member_turn: Instant,
    was_member_leader: bool,
    start_config: Option<Vec<(String, Vec<String>)>>,
    start_checked: bool,
    limiter: Option<Arc<RateLimiter>>,
    /// A member told this one that it was removed.
    removed: bool,
}

impl<B: Backend> Driver<B> {
    fn run(mut self, cmds: Receiver<Cmd>, msgs: Receiver<Message>, events: Receiver<Event>) {
        let ticker = crossbeam_channel::tick(self.shared.options.tick_interval);
        let persisted = self.persisted_rx.clone();
        let mut last_sweep = Instant::now();
        let result: Result<(), NodeError> = (|| {
            loop {
                let mut pending_snapshot_done = None;
                select! {
                    recv(cmds) -> c => match c {
                        Ok(Cmd::Stop) | Err(_) => return Ok(()),
                        Ok(c) => self.command(c),
                    },
                    recv(msgs) -> m => if let Ok(m) = m { self.step(m) },
                    recv(ticker) -> _ => {
                        self.raw.tick();
                        self.give_up_stalled_transfers();
                    },
                    recv(events) -> e => if let Ok(e) = e {
                        pending_snapshot_done = self.event(e);
                    },
                    recv(persisted) -> p => match p {
                        Ok(p) => self.on_persisted(p)?,
                        Err(_) => return Err(NodeError::Stopped {
                            id: self.id,
                            reason: Some("the persist thread ended".into()),
                        }),
                    },
                }
                while let Ok(p) = persisted.try_recv() {
                    self.on_persisted(p)?;
                }
                // Take what else is queued, bounded, so one turn persists a batch.
                let max = self.shared.options.max_proposals_per_turn;
                for _ in 0..max {
                    match cmds.try_recv() {
                        Ok(Cmd::Stop) => return Ok(()),
                        Ok(c) => self.command(c),
                        Err(_) => break,
                    }
                }
                self.flush_proposals();
                for _ in 0..max {
                    match msgs.try_recv() {
                        Ok(m) => self.step(m),
                        Err(_) => break,
                    }
                }
                self.flush_reads();
                let installed_before = self.snapshots_installed;
                self.on_ready()?;
                if !self.read_batch.is_empty() && self.reads.is_empty() {
                    // The round in flight was answered: the reads held behind it go now.
                    self.flush_reads();
                    self.on_ready()?;
                }
                self.expire_leaderless_reads();
                self.retry_deferred_members();
                self.member_duties();
                if self.removed {
                    return Err(self.removed_self());
                }
                if let Some(done) = pending_snapshot_done {
                    // The receiver discards a prepared snapshot raft-rs did not take.
                    let _ = done.send(self.snapshots_installed > installed_before);
                }
                if last_sweep.elapsed() >= Duration::from_secs(1) {
                    self.sweep();
                    last_sweep = Instant::now();
                }
            }
        })();
        let reason = match &result {
            Ok(()) => None,
            Err(e) => {
                tracing::error!(member = self.id, error = %e, "member stopped on a failure");
                Some(e.to_string())
            }
        };
        self.stop(reason);
    }

    fn stop(&mut self, reason: Option<String>) {
        if reason.is_some() {
            *self.shared.stop_reason.lock() = reason.clone();
        }
        self.shared.stopped.store(true, Ordering::Release);
        let err = || NodeError::Stopped {
            id: self.id,
            reason: reason.clone(),
        };
        for (_, (_, r)) in self.waiters.drain() {
            let _ = r.send(Err(err()));
        }
        for (_, round) in self.reads.drain() {
            for r in round.replies {
                let _ = r.send(Err(err()));
            }
        }
        for (_, r) in self.applied_waits.drain(..) {
            let _ = r.send(Err(err()));
        }
        for r in self.read_batch.drain(..) {
            let _ = r.send(Err(err()));
        }
        for (_, _, r) in self.proposals.drain(..) {
            let _ = r.send(Err(err()));
        }
        for (_, _, _, r, _) in self.deferred_members.drain(..) {
            if let Some(r) = r {
                let _ = r.send(Err(err()));
            }
        }
        // Outgoing transfers stop too: nothing would route their acks any more, and their
        // read transactions hold the store being closed.
        snapshot::cancel_all(&self.acks, self.id, "the member is stopping");
        if let Err(e) = self.sm.store().force_commit() {
            tracing::warn!(member = self.id, error = %e, "final backend commit failed");
        }
    }

    /// Drops waiters and read-index rounds whose callers have given up (a round counts from
    /// its first ask), and asks again for the read index of rounds still unanswered (a
    /// leader that had not committed in its term yet, or a lost message, drops them
    /// silently).
    fn sweep(&mut self) {
        let limit = self.shared.options.request_timeout * 2;
        self.waiters.retain(|_, (t, _)| t.elapsed() < limit);
        let now = Instant::now();
        self.reads.retain(|_, round| round.kept_at(now, limit));
        if self.leader().is_some() {
            let (leader, term) = (self.raw.raft.leader_id, self.raw.raft.term);
            let mut stale = Vec::new();
            for (ctx, round) in &mut self.reads {
                if round.due_again_at(now) {
                    // Asked again, of the leader known now.
                    (round.leader, round.term) = (leader, term);
                    round.asked_again(now);
                    stale.push(*ctx);
                }
            }
            for ctx in stale {
                self.raw.read_index(ctx.to_le_bytes().to_vec());
            }
        }
    }

    fn leader(&self) -> Option<u64> {
        let l = self.raw.raft.leader_id;
        (l != raft::INVALID_ID).then_some(l)
    }

    fn command(&mut self, c: Cmd) {
        match c {
            Cmd::Propose { seq, data, reply } => self.proposals.push((seq, data, reply)),
            Cmd::ConfChange {
                seq,
                cc,
                context,
                reply,
            } => {
                if self.raw.raft.state != StateRole::Leader {
                    let _ = reply.send(Err(NodeError::NotLeader {
                        id: self.id,
                        leader: self.leader(),
                    }));
                    return;
                }
                match self.raw.propose_conf_change(context, cc) {
                    Ok(()) => {
                        self.waiters.insert(seq, (Instant::now(), reply));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(self.propose_error(e)));
                    }
                }
            }
            Cmd::Read { reply } => self.read_batch.push(reply),
            Cmd::Member { seq, op, reply } => {
                if self.raw.raft.state == StateRole::Leader {
                    self.leader_member_op(self.id, seq, op, Some(reply), Instant::now());
                } else if let Some(leader) = self.leader() {
                    let fwd = Control::Forward {
                        origin: self.id,
                        seq,
                        op,
                    };
                    self.transport.send(fwd.to_message(self.id, leader));
                    self.waiters.insert(seq, (Instant::now(), reply));
                } else {
                    // No leader known yet: held until one is (at most a request timeout).
                    self.deferred_members
                        .push((self.id, seq, op, Some(reply), Instant::now()));
                }
            }
            Cmd::Campaign => {
                if let Err(e) = self.raw.campaign() {
                    tracing::warn!(member = self.id, error = %e, "campaign refused");
                }
            }
            Cmd::Stop => {}
        }
    }

    /// Proposes every proposal taken in this loop turn as one message: one append on the
    /// leader, one message to each follower.
    fn flush_proposals(&mut self) {
        if self.proposals.is_empty() {
            return;
        }
        if self.raw.raft.state != StateRole::Leader && self.leader().is_none() {
            // No leader known (an election is under way, or this member has not heard from
            // the new leader yet): hold the proposals for up to an election timeout rather
            // than have raft-rs drop them.
            let since = *self.proposals_held.get_or_insert_with(Instant::now);
            let o = &self.shared.options;
            if since.elapsed() < o.tick_interval * o.election_ticks as u32 {
                return;
            }
        }
        self.proposals_held = None;
        let batch = std::mem::take(&mut self.proposals);
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgPropose);
        m.from = self.id;
        let mut seqs = Vec::with_capacity(batch.len());
        let mut entries = Vec::with_capacity(batch.len());
        for (seq, data, reply) in batch {
            let e = Entry {
                data: data.into(),
                ..Entry::default()
            };
            entries.push(e);
            seqs.push((seq, reply));
        }
        m.set_entries(entries.into());
        match self.raw.step(m) {
            Ok(()) => {
                let now = Instant::now();
                for (seq, reply) in seqs {
                    self.waiters.insert(seq, (now, reply));
                }
            }
            Err(e) => {
                // Every entry of the batch shares the fate of the one message.
                let dropped = matches!(e, raft::Error::ProposalDropped);
                let mut first = Some(e);
                for (_, reply) in seqs {
                    let e = match first.take() {
                        Some(e) => e,
                        None if dropped => raft::Error::ProposalDropped,
                        None => raft::Error::ConfChangeError(
                            "an earlier proposal of the same batch was refused".into(),
                        ),
                    };
                    let _ = reply.send(Err(self.propose_error(e)));
                }
            }
        }
    }

    /// Takes the persist thread's report: the readies up to its number are durable.
    fn on_persisted(&mut self, p: Persisted) -> Result<(), NodeError> {
        p.result?;
        self.persisted = self.persisted.max(p.number);
        self.raw.on_persist_ready(p.number);
        self.send_messages(p.held);
        Ok(())
    }

    /// Waits until every ready handed to the persist thread is durable.
    fn wait_persisted(&mut self) -> Result<(), NodeError> {
        while self.persisted < self.handed {
            let p = self.persisted_rx.recv().map_err(|_| NodeError::Stopped {
                id: self.id,
                reason: Some("the persist thread ended".into()),
            })?;
            self.on_persisted(p)?;
        }
        Ok(())
    }

    fn propose_error(&self, e: raft::Error) -> NodeError {
        match e {
            raft::Error::ProposalDropped => match self.leader() {
                None => NotLeaderNone(self.id).into(),
                Some(_) => NodeError::ProposalDropped { id: self.id },
            },
            source => NodeError::Raft {
                id: self.id,
                source,
            },
        }
    }

    fn step(&mut self, m: Message) {
        if m.from != 0 && m.from != self.id && self.members.is_removed(m.from) {
            // etcd: a removed member that contacts the cluster learns it and exits. Nothing
            // it says counts: not as activity, nor its reports (the promotion gate keeps no
            // state for a member that is gone).
            if !matches!(Control::from_message(&m), Some(Control::Removed)) {
                self.transport
                    .send(Control::Removed.to_message(self.id, m.from));
            }
            return;
        }
        if m.from != 0 && m.from != self.id {
            self.activity.heard(m.from, Instant::now());
        }
        if let Some(c) = Control::from_message(&m) {
            self.control(m.from, c);
            return;
        }
        if let Err(e) = self.raw.step(m) {
            tracing::debug!(member = self.id, error = %e, "message refused by raft");
        }
    }

    fn flush_reads(&mut self) {
        if self.read_batch.is_empty() {
            return;
        }
        if self.raw.raft.state == StateRole::Leader && !self.raw.raft.commit_to_current_term() {
            // raft-rs drops a read index asked of a leader that has not committed an entry
            // of its term yet: wait for that commit (it comes within a round trip).
            return;
        }
        // One round at a time: reads that arrive while a round is out join the next one,
        // issued as soon as it is answered (or after a tick, should it be lost), so a busy
        // member sends one heartbeat round per batch of reads rather than per loop turn.
        let (now, tick) = (Instant::now(), self.shared.options.tick_interval);
        if self
            .reads
            .values()
            .any(|round| round.holds_back_at(now, tick))
        {
            return;
        }
        let batch = std::mem::take(&mut self.read_batch);
        if self.leader().is_none() {
            for r in batch {
                let _ = r.send(Err(NodeError::NotLeader {
                    id: self.id,
                    leader: None,
                }));
            }
            return;
        }
        self.read_ctx += 1;
        let ctx = self.read_ctx;
        self.raw.read_index(ctx.to_le_bytes().to_vec());
        let round = ReadRound::new(now, self.raw.raft.leader_id, self.raw.raft.term, batch);
        self.reads.insert(ctx, round);
    }

    fn event(&mut self, e: Event) -> Option<Sender<bool>> {
        match e {
            Event::SnapshotSent {
                to,
                transfer,
                index,
                term,
                ok,
            } => {
                let latest = self
                    .latest_transfer
                    .get(&to)
                    .is_some_and(|l| l.transfer == transfer);
                if latest {
                    self.latest_transfer.remove(&to);
                }
                let leading =
                    self.raw.raft.state == StateRole::Leader && self.raw.raft.term == term;
                if !latest || !leading {
                    // Replaced by a later transfer to `to` (which cancelled it), given up for
                    // want of progress (reported failed and cancelled then), or begun under a
                    // leadership that has ended (cancelled then): raft-rs tracks the later
                    // transfer, or none of this leadership's, and this end reported would act
                    // on the progress of another transfer (a failure would make raft-rs start
                    // yet another, which would replace the one under way, and so on).
                    if ok {
                        self.snapshots_sent += 1;
                    }
                    let why = if latest {
                        "begun under a leadership that has ended"
                    } else {
                        "replaced by a later one, or given up as stalled"
                    };
                    tracing::debug!(
                        member = self.id,
                        to,
                        transfer,
                        term,
                        ok,
                        "snapshot transfer ended, not reported: {why}"
                    );
                    return None;
                }
                if self.raw.raft.prs().get(to).is_none() {
                    // Removed while the transfer ran (it was cancelled): raft-rs has nothing
                    // to be told, and the promotion gate keeps no state for a member that
                    // is gone.
                    tracing::debug!(
                        member = self.id,
                        to,
                        ok,
                        "snapshot transfer to a removed member ended"
                    );
                    return None;
                }
                if ok {
                    self.snapshots_sent += 1;
                    self.note_snapshot_index(to, index);
                }
                let status = if ok {
                    SnapshotStatus::Finish
                } else {
                    SnapshotStatus::Failure
                };
                self.raw.report_snapshot(to, status);
                None
            }
            Event::SnapshotReceived { received, done } => {
                self.step(received.message);
                Some(done)
            }
        }
    }

    fn send_messages(&mut self, msgs: Vec<Message>) {
        for m in msgs {
            if m.get_msg_type() == MessageType::MsgSnapshot {
                self.send_snapshot(m);
            } else {
                self.transport.send(m);
            }
        }
    }

    /// Starts streaming the backend as of the applied index to `m.to`.
    fn send_snapshot(&mut self, m: Message) {
        let to = m.to;
        let index = m.get_snapshot().get_metadata().index;
        if self.raw.raft.state != StateRole::Leader || self.raw.raft.term != m.term {
            // Made before this member stepped down (raft-rs keeps the messages it queued):
            // its transfers were cancelled then, and raft-rs tracks none of it any more.
            tracing::debug!(
                member = self.id,
                to,
                index,
                term = m.term,
                "snapshot of a leadership that ended not sent"
            );
            return;
        }
        if self.raw.raft.prs().get(to).is_none() || self.members.is_removed(to) {
            // Made before member `to` left the configuration (held until the ready that
            // carried it was durable): it was forgotten then, and gets no new transfer.
            tracing::debug!(
                member = self.id,
                to,
                index,
                "snapshot to a member that left the configuration not sent"
            );
            return;
        }
        let store = self.sm.store();
        let began = Instant::now();
        let txn = (|| {
            if store.consistent_index() != index {
                return Err(NodeError::Snapshot {
                    from: self.id,
                    to,
                    reason: format!(
                        "the store holds index {}, the snapshot message says {index}",
                        store.consistent_index()
                    ),
                });
            }
            store.force_commit().map_err(store_err)?;
            store
                .backend()
                .read_txn()
                .map_err(|e| NodeError::Store(e.to_string()))
        })();
        let txn = match txn {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(member = self.id, to, error = %e, "cannot start a snapshot");
                self.raw.report_snapshot(to, SnapshotStatus::Failure);
                return;
            }
        };
        tracing::debug!(
            member = self.id,
            to,
            index,
            ms = began.elapsed().as_secs_f64() * 1e3,
            "snapshot started (pending writes committed, read transaction open)"
        );
        // The promotion gate's rule 3 (the learner applied the snapshot) needs the snapshot's
        // index from now on: raft-rs may leave the snapshot state on the learner's answer
        // before this transfer's end is reported.
        self.note_snapshot_index(to, index);
        self.transfer += 1;
        let transfer = self.transfer;
        // raft-rs asks for a new snapshot only once it has given up on the last one (or
        // moved past it): a transfer to `to` still running is stale, and stopped.
        let latest = LatestTransfer {
            transfer,
            term: self.raw.raft.term,
            began: Instant::now(),
        };
        if self.latest_transfer.insert(to, latest).is_some() {
            let cancelled = snapshot::cancel_to(
                &self.acks,
                self.id,
                to,
                "replaced by a later snapshot transfer to the same member",
            );
            if cancelled > 0 {
                tracing::debug!(
                    member = self.id,
                    to,
                    transfer,
                    cancelled,
                    "earlier snapshot transfer replaced"
                );
            }
        }
        // Registered here, not on the sender's thread, so that a removal of `to` applied
        // from now on finds the transfer and cancels it.
        let answers = snapshot::expect_answer(&self.acks, transfer, to);
        let transport = self.transport.clone();
        let acks = self.acks.clone();
        let events = self.events.clone();
        let chunk = self.shared.options.snapshot_chunk_bytes;
        let timeout = self.shared.options.snapshot_timeout;
        let id = self.id;
        let limiter = self.limiter.clone();
        let shared = self.shared.clone();
        let term = self.raw.raft.term;
        // The stream is about as long as the live data: the estimate behind the ETA.
        let expected = store.backend().size().ok().map(|s| s.in_use);
        shared
            .transfers
            .lock()
            .insert(to, TransferProgress::new(to, expected, Instant::now()));
        let spawned = spawn(&format!("keel-snap-send-{id}-{to}"), move || {
            let progress = |n: u64| {
                if let Some(p) = shared.transfers.lock().get_mut(&to) {
                    p.record(n, Instant::now());
                }
            };
            let r = snapshot::send(
                &*transport,
                &acks,
                answers,
                transfer,
                m,
                txn,
                chunk,
                timeout,
                limiter.as_deref(),
                &progress,
            );
            match &r {
                Ok(()) => {
                    if let Some(p) = shared.transfers.lock().get_mut(&to) {
                        p.done = true;
                        p.last = Instant::now();
                    }
                }
                Err(e) => {
                    tracing::warn!(member = id, to, error = %e, "snapshot transfer failed");
                }
            }
            let _ = events.send(Event::SnapshotSent {
                to,
                transfer,
                index,
                term,
                ok: r.is_ok(),
            });
        });
        if spawned.is_err() {
            self.acks.lock().remove(&transfer);
            self.latest_transfer.remove(&to);
            self.raw.report_snapshot(to, SnapshotStatus::Failure);
        }
    }

    fn on_ready(&mut self) -> Result<(), NodeError> {
        if self.handed > self.persisted && self.raw.snap().is_some_and(|s| !s.is_empty()) {
            // A snapshot is installed with nothing else in flight.
            self.wait_persisted()?;
        }
        if !self.raw.has_ready() {
            self.update_status();
            self.lease_duties();
            return Ok(());
        }
        let rd = self.raw.ready();
        // The leader known from this ready on, when this member's role, its leader or its
        // term changed. The soft state does not hold the term: a member that hears from its
        // leader again in a later term (the leader stepped down and won again, or this member
        // lost it and found it again within one ready) sees no soft-state change, though its
        // leader dropped the read-index rounds of the earlier term.
        let term = self.raw.raft.term;
        let new_term = std::mem::replace(&mut self.last_term, term) != term;
        let changed = rd
            .ss()
            .map(|ss| {
                tracing::debug!(member = self.id, leader = ss.leader_id, role = ?ss.raft_state, term, "soft state changed");
                (ss.leader_id != raft::INVALID_ID).then_some(ss.leader_id)
            })
            .or_else(|| {
                new_term.then(|| {
                    tracing::debug!(member = self.id, leader = ?self.leader(), term, "term changed");
                    self.leader()
                })
            });
        if rd.ss().is_some_and(|ss| ss.raft_state != StateRole::Leader) {
            self.cancel_outgoing_transfers();
        } else if new_term {
            // A leader that lost its leadership and won a later term within one ready (or
            // whose term changed while it led, by the ready's account) shows no soft-state
            // change: the transfers of its earlier term end as a step-down ends them.
            self.cancel_transfers_of_earlier_terms();
        }
        if rd.snapshot().is_empty() {
            self.on_ready_async(rd)?;
        } else {
            self.on_ready_snapshot(rd)?;
        }
        if let Some(leader) = changed {
            // After the ready's read states: a round answered in it stands.
            self.fail_reads_in_flight(leader);
        }
        Ok(())
    }

    /// Handles a ready carrying a snapshot, synchronously: install, persist, `advance`.
    fn on_ready_snapshot(&mut self, mut rd: raft::Ready) -> Result<(), NodeError> {
        // The leader sends before persisting (Raft thesis 10.2.1).
        let msgs = rd.take_messages();
        self.send_messages(msgs);
        if !rd.snapshot().is_empty() {
            self.install_snapshot(rd.snapshot().clone())?;
        }
        self.storage
            .persist(rd.entries(), rd.hs(), rd.must_sync())?;
        let msgs = rd.take_persisted_messages();
        self.send_messages(msgs);
        let committed = rd.take_committed_entries();
        self.apply(committed)?;
        let reads = rd.take_read_states();
        self.read_states(reads);
        self.handed = rd.number();
        self.persisted = rd.number();
        let mut light = self.raw.advance(rd);
        let msgs = light.take_messages();
        self.send_messages(msgs);
        let committed = light.take_committed_entries();
        self.apply(committed)?;
        self.raw.advance_apply();
        self.after_apply()
    }

    /// Handles a ready without a snapshot: its entries and hard state are appended to the
    /// WAL here and made durable by the persist thread, which then sends the messages that
    /// had to wait for them (followers' and candidates'); meanwhile this thread applies what
    /// is committed and goes on stepping messages and taking proposals. raft-rs hands out
    /// committed entries only up to what this member has persisted.
    fn on_ready_async(&mut self, mut rd: raft::Ready) -> Result<(), NodeError> {
        // The leader sends before persisting (Raft thesis 10.2.1).
        let msgs = rd.take_messages();
        self.send_messages(msgs);
        let number = rd.number();
        let sync = rd.must_sync();
        // Everything before this ready is durable and it needs no sync itself (no entries,
        // no new term or vote; at most a commit index, written lazily): it is finished here
        // and the messages that waited for persistence go out now, without a thread hop.
        let needs_persist = sync || self.handed > self.persisted;
        self.storage.persist(rd.entries(), rd.hs(), false)?;
        let persisted_msgs = rd.take_persisted_messages();
        let committed = rd.take_committed_entries();
        let reads = rd.take_read_states();
        self.raw.advance_append_async(rd);
        if needs_persist {
            self.handed = number;
            self.persist_jobs
                .send(PersistJob {
                    number,
                    sync,
                    messages: persisted_msgs,
                })
                .map_err(|_| NodeError::Stopped {
                    id: self.id,
                    reason: Some("the persist thread ended".into()),
                })?;
        } else {
            self.handed = number;
            self.persisted = number;
            self.raw.on_persist_ready(number);
            self.send_messages(persisted_msgs);
        }
        self.apply(committed)?;
        self.raw.advance_apply();
        self.read_states(reads);
        self.after_apply()
    }

    fn after_apply(&mut self) -> Result<(), NodeError> {
        self.maybe_snapshot_point()?;
        self.complete_reads();
        self.update_status();
        self.lease_duties();
        Ok(())
    }

    /// Keeps the lessor's role in step with leadership, and on the leader proposes the
    /// revocation of expired leases and the replication of due checkpoints.
    fn lease_duties(&mut self) {
        let leader = self.raw.raft.state == StateRole::Leader;
        if leader != self.was_leader {
            self.was_leader = leader;
            let lessor = self.sm.lessor();
            if leader {
                lessor.promote();
            } else {
                lessor.demote();
            }
        }
        if !leader || self.last_lease_check.elapsed() < self.shared.options.tick_interval {
            return;
        }
        self.last_lease_check = Instant::now();
        let lessor = self.sm.lessor();
        for id in lessor.expired_leases() {
            self.propose_internal(Request::LeaseRevoke { id });
        }
        let cps = lessor.checkpoint_batch();
        if !cps.is_empty() {
            let cps = cps
                .into_iter()
                .map(|c| crate::request::LeaseCheckpoint {
                    id: c.id,
                    remaining_ttl: c.remaining_ttl,
                })
                .collect();
            self.propose_internal(Request::LeaseCheckpoint(cps));
        }
    }

    /// Proposes a request nobody waits for (origin 0).
    fn propose_internal(&mut self, request: Request) {
        let data = Envelope {
            origin: 0,
            seq: 0,
            request,
        }
        .encode();
        if let Err(e) = self.raw.propose(Vec::new(), data) {
            tracing::debug!(member = self.id, error = %e, "internal proposal dropped");
        }
    }

    fn install_snapshot(&mut self, snap: Snapshot) -> Result<(), NodeError> {
        let meta = snap.get_metadata();
        self.sm.install_prepared(meta.index)?;
        self.storage.apply_snapshot(&snap)?;
        self.last_snapshot_point = meta.index;
        self.snapshots_installed += 1;
        self.members = MemberSet::load(&self.sm.store()).map_err(NodeError::from)?;
        let member_err = |source| NodeError::Member {
            id: self.id,
            source,
        };
        self.members
            .check_not_removed(self.id)
            .map_err(member_err)?;
        if !self.start_checked
            && let Some(local) = &self.start_config
        {
            self.members.check_start_config(local).map_err(member_err)?;
            self.start_checked = true;
        }
        for m in self.members.members() {
            self.transport.peer_added(m.id, &m.peer_urls);
        }
        self.publish_members();
        tracing::info!(
            member = self.id,
            index = meta.index,
            term = meta.term,
            "snapshot installed"
        );
        Ok(())
    }

    fn apply(&mut self, entries: Vec<Entry>) -> Result<(), NodeError> {
        // The applied index of a run of normal entries is recorded once, at its end.
        let mut applied_normal = None;
        for e in entries {
            if (e.get_entry_type() != EntryType::EntryNormal || is_member_request(&e.data))
                && let Some(index) = applied_normal.take()
            {
                self.storage.set_applied(index, None);
            }
            match e.get_entry_type() {
                EntryType::EntryNormal if is_member_request(&e.data) => {
                    match Envelope::decode(&e.data) {
                        Ok(env) => self.apply_member(&e, env, None)?,
                        Err(err) => {
                            tracing::warn!(member = self.id, index = e.index, error = %err, "undecodable member request skipped");
                            self.sm
                                .apply_conf_state(e.index, &self.storage.conf_state())?;
                            self.storage.set_applied(e.index, None);
                        }
                    }
                }
                EntryType::EntryNormal => {
                    if let Some((origin, seq, result)) = self.sm.apply_normal(&e)? {
                        self.answer(origin, seq, result);
                    }
                    applied_normal = Some(e.index);
                }
                EntryType::EntryConfChangeV2 | EntryType::EntryConfChange => {
                    self.apply_conf_change(&e)?;
                }
            }
        }
        if let Some(index) = applied_normal {
            self.storage.set_applied(index, None);
        }
        Ok(())
    }

    fn answer(&mut self, origin: u64, seq: u64, result: Result<Response, NodeError>) {
        if origin != self.id {
            return;
        }
        if let Some((_, reply)) = self.waiters.remove(&seq) {
            let _ = reply.send(result);
        }
    }

    fn apply_conf_change(&mut self, e: &Entry) -> Result<(), NodeError> {
        let env = Envelope::decode(&e.context).ok();
        if e.index <= self.sm.applied() {
            if let Some(Envelope {
                request: Request::Member(op),
                ..
            }) = &env
            {
                self.auto.on_applied(op.id());
            }
            // Already in the stored conf state that raft-rs was started with.
            return Ok(());
        }
        let cc = if e.get_entry_type() == EntryType::EntryConfChangeV2 {
            ConfChangeV2::parse_from_bytes(&e.data)
        } else {
            raft::eraftpb::ConfChange::parse_from_bytes(&e.data).map(ConfChangeI::into_v2)
        };
        let cc = match cc {
            Ok(cc) => cc,
            Err(err) => {
                tracing::warn!(member = self.id, index = e.index, error = %err, "undecodable conf change skipped");
                let cs = self.storage.conf_state();
                self.sm.apply_conf_state(e.index, &cs)?;
                self.storage.set_applied(e.index, None);
                return Ok(());
            }
        };
        if let Some(env) = &env
            && matches!(env.request, Request::Member(_))
        {
            return self.apply_member(e, env.clone(), Some(cc));
        }
        let before = self.raw.raft.prs().conf().to_conf_state();
        let result = self.raw.apply_conf_change(&cc);
        let (cs, answer, departed, joined, roles) = match result {
            Ok(cs) => {
                let answer = Ok(Response::ConfChange {
                    voters: cs.voters.clone(),
                    learners: cs.learners.clone(),
                });
                // Only a member the configuration no longer lists at all has left: one
                // removed in a joint configuration is still an outgoing voter, counted in
                // its quorum and replicated to, until the configuration leaves it.
                let (was, now) = (configured(&before), configured(&cs));
                let departed: Vec<u64> =
                    was.iter().filter(|id| !now.contains(id)).copied().collect();
                // A voter of either half of a joint configuration still votes: it is a
                // learner only once neither half lists it as a voter.
                let learner =
                    |id: &u64| !cs.voters.contains(id) && !cs.voters_outgoing.contains(id);
                // A member the configuration lists for the first time has joined: a learner
                // unless it is a voter, and then held from automatic promotion (the operator
                // who added it that way promotes it).
                let joined: Vec<(u64, bool)> = now
                    .iter()
                    .filter(|id| !was.contains(id))
                    .map(|&id| (id, learner(&id)))
                    .collect();
                // A listed member whose role the configuration now gives otherwise (a
                // learner promoted, a voter demoted, by this conf change) takes that role,
                // by the same rule: a voter demoted is held from automatic promotion (else
                // the leader would undo the demotion once it caught up), a learner promoted
                // no longer is.
                let roles: Vec<(u64, bool)> = now
                    .iter()
                    .map(|&id| (id, learner(&id)))
                    .filter(|&(id, is_learner)| {
                        self.members
                            .get(id)
                            .is_some_and(|m| m.is_learner != is_learner)
                    })
                    .collect();
                (cs, answer, departed, joined, roles)
            }
            Err(err) => (
                self.storage.conf_state(),
                Err(NodeError::Membership(err.to_string())),
                Vec::new(),
                Vec::new(),
                Vec::new(),
            ),
        };
        let mut added: Vec<(Member, bool)> = Vec::new();
        let mut changed_roles: Vec<u64> = Vec::new();
        if departed.is_empty() && joined.is_empty() && roles.is_empty() {
            self.sm.apply_conf_state(e.index, &cs)?;
        } else {
            // Added to and removed from the members, promoted and demoted, as membership
            // operations add, remove and promote them, in the transaction that records the
            // entry's index and the conf state.
            let store = self.sm.store();
            let mut txn = store.write();
            txn.set_consistent_index(e.index).map_err(store_err)?;
            let mut members = self.members.clone();
            for &id in &departed {
                members.remove_departed(id, e.index, &mut txn)?;
            }
            // A committed addition is never refused for the learner limit, which members
            // may set differently: every member must list the same.
            let lenient = MembershipOptions {
                max_learners: usize::MAX,
                ..self.mopts.clone()
            };
            for &(id, is_learner) in &joined {
                let named = joined_member_from_context(id, is_learner, cc.get_context())
                    .filter(|m| members.validate_add(m, &lenient).is_ok());
                let from_context = named.is_some();
                let m = named.unwrap_or_else(|| default_member(id, is_learner));
                if let Err(err) = members.validate_add(&m, &lenient) {
                    tracing::warn!(
                        member = self.id,
                        index = e.index,
                        joined = id,
                        error = %err,
                        "a member that joined through a conf change is not listed"
                    );
                    continue;
                }
                if members.add_joined(m.clone(), &mut txn)? {
                    added.push((m, from_context));
                }
            }
            for &(id, is_learner) in &roles {
                if members.set_role(id, is_learner, &mut txn)? {
                    changed_roles.push(id);
                }
            }
            StateMachine::<B>::stage_conf_state(&mut txn, &cs)?;
            txn.commit().map_err(store_err)?;
            self.members = members;
        }
        self.storage.set_applied(e.index, Some(&cs));
        for &id in &departed {
            self.forget_member(id);
        }
        for (m, from_context) in &added {
            // Only the conf change's context says where to reach the member: the default
            // peer URL is the in-memory network's, which routes by id anyway.
            if *from_context {
                self.transport.peer_added(m.id, &m.peer_urls);
            }
        }
        if !departed.is_empty() || !added.is_empty() || !changed_roles.is_empty() {
            self.publish_members();
            let joined: Vec<u64> = added.iter().map(|(m, _)| m.id).collect();
            tracing::info!(
                member = self.id,
                index = e.index,
                ?departed,
                ?joined,
                changed_roles = ?changed_roles,
                held_from_auto_promotion = ?self.members.held_learners(),
                "members joined, left or changed role in the configuration through a conf change"
            );
        }
        if let Some(env) = env {
            self.answer(env.origin, env.seq, answer);
        }
        if departed.contains(&self.id) {
            return Err(self.removed_self());
        }
        if !configured(&cs).contains(&self.id) && !cs.voters.is_empty() {
            return Err(NodeError::Stopped {
                id: self.id,
                reason: Some("this member was removed from the cluster".into()),
            });
        }
        Ok(())
    }

    /// A membership operation on the leader, held back (at most a request timeout) while
    /// [`member_op_must_wait`](Self::member_op_must_wait).
    fn leader_member_op(
        &mut self,
        origin: u64,
        seq: u64,
        op: MemberOp,
        reply: Option<Reply>,
        since: Instant,
    ) {
        if self.member_op_must_wait() && since.elapsed() < self.shared.options.request_timeout {
            self.deferred_members.push((origin, seq, op, reply, since));
            return;
        }
        match self.propose_member(origin, seq, op) {
            Ok(()) => {
                if let Some(reply) = reply {
                    self.waiters.insert(seq, (since, reply));
                }
            }
            Err(e) => self.member_refused(origin, seq, reply, e),
        }
    }

    /// Whether a membership operation on the leader must wait a moment rather than be
    /// refused: the leader has not applied an entry of its term yet (raft-rs counts every
    /// earlier entry as a possibly pending configuration change until then), or the pending
    /// change is committed and only this member's own apply of it is behind (its entries are
    /// still being persisted here while a quorum of followers has them).
    fn member_op_must_wait(&self) -> bool {
        let raft = &self.raw.raft;
        let log = &raft.raft_log;
        let in_term = log.term(log.applied).is_ok_and(|t| t == raft.term);
        !in_term
            || (raft.pending_conf_index > log.applied && log.committed >= raft.pending_conf_index)
    }

    /// Answers a refused membership operation: to the local caller, or to the member that
    /// forwarded it.
    fn member_refused(&mut self, origin: u64, seq: u64, reply: Option<Reply>, e: NodeError) {
        match reply {
            Some(reply) => {
                let _ = reply.send(Err(e));
            }
            None => {
                let error = match e {
                    NodeError::Membership(text) => text,
                    other => other.to_string(),
                };
                self.transport
                    .send(Control::Refused { seq, error }.to_message(self.id, origin));
            }
        }
    }

    /// Proposes the membership operations held back on the leader, forwards those a
    /// follower held while it knew no leader, and refuses what waited a request timeout or
    /// was held on a leader that no longer leads.
    fn retry_deferred_members(&mut self) {
        if self.deferred_members.is_empty() {
            return;
        }
        let leader = self.raw.raft.state == StateRole::Leader;
        let timeout = self.shared.options.request_timeout;
        if (self.leader().is_none() || (leader && self.member_op_must_wait()))
            && self
                .deferred_members
                .iter()
                .all(|d| d.4.elapsed() < timeout)
        {
            return;
        }
        for (origin, seq, op, reply, since) in std::mem::take(&mut self.deferred_members) {
            match (leader, self.leader(), reply) {
                (true, _, reply) => self.leader_member_op(origin, seq, op, reply, since),
                (false, Some(to), Some(reply)) if origin == self.id => {
                    let fwd = Control::Forward { origin, seq, op };
                    self.transport.send(fwd.to_message(self.id, to));
                    self.waiters.insert(seq, (since, reply));
                }
                (false, None, reply) if since.elapsed() < timeout => {
                    self.deferred_members.push((origin, seq, op, reply, since));
                }
                (false, known, reply) => {
                    let e = NodeError::NotLeader {
                        id: self.id,
                        leader: known,
                    };
                    self.member_refused(origin, seq, reply, e);
                }
            }
        }
    }

    /// Checks a membership operation on the leader and proposes it: the operation itself
    /// (etcd's validation, learner limit), the strict reconfiguration check, the promotion
    /// gate for a manual promote, one change at a time.
    fn propose_member(&mut self, origin: u64, seq: u64, mut op: MemberOp) -> Result<(), NodeError> {
        if let MemberOp::Add(m) = &mut op
            && self.mopts.learner_by_default
        {
            m.is_learner = true;
        }
        self.members.validate(&op, &self.mopts)?;
        let env = Envelope {
            origin,
            seq,
            request: Request::Member(op.clone()),
        }
        .encode();
        let Some(change) = op.proposed_change() else {
            // Raft's configuration holds no addresses: an update of peer URLs is an
            // ordinary entry.
            return self
                .raw
                .propose(Vec::new(), env)
                .map_err(|e| self.propose_error(e));
        };
        let raft = &self.raw.raft;
        if raft.pending_conf_index > raft.raft_log.applied {
            return Err(NodeError::Membership(
                "another membership change is still being applied".into(),
            ));
        }
        let now = Instant::now();
        // etcd's order: a promote is first checked for being in sync. An automatic one was
        // checked when it was chosen, but the flag comes with the request (a client's, or a
        // follower's forward), so it is checked here again whatever it says.
        if let MemberOp::Promote { id, .. } = op {
            promotion_gate(
                &self.learner_progress(id, now),
                raft.raft_log.last_index(),
                &self.mopts,
            )?;
        }
        if self.mopts.strict_reconfig_check {
            let cs = raft.prs().conf().to_conf_state();
            let voters: BTreeSet<u64> = cs.voters.iter().copied().collect();
            let learners: BTreeSet<u64> = cs.learners.iter().copied().collect();
            let active = self.activity.active(self.id, now, self.mopts.active_window);
            strict_check(&voters, &learners, &active, change)?;
        }
        let (ty, id) = match change {
            ProposedChange::AddVoter(id) | ProposedChange::Promote(id) => {
                (ConfChangeType::AddNode, id)
            }
            ProposedChange::AddLearner(id) => (ConfChangeType::AddLearnerNode, id),
            ProposedChange::Remove(id) => (ConfChangeType::RemoveNode, id),
        };
        let mut single = ConfChangeSingle::default();
        single.set_change_type(ty);
        single.node_id = id;
        let mut cc = ConfChangeV2::default();
        cc.set_transition(ConfChangeTransition::Auto);
        cc.set_changes(vec![single].into());
        self.raw
            .propose_conf_change(env, cc)
            .map_err(|e| self.propose_error(e))
    }

    /// Records, for the promotion gate, that member `to` was sent a snapshot at `index`,
    /// keeping the highest. Nothing is kept for a member the configuration no longer lists.
    fn note_snapshot_index(&mut self, to: u64, index: u64) {
        if self.raw.raft.prs().get(to).is_none() {
            return;
        }
        let known = self.snap_idx.entry(to).or_insert(index);
        *known = (*known).max(index);
    }

    /// The leader's view of learner `id` for the promotion gate at `now`: its progress in
    /// raft-rs's tracker, the highest snapshot index it was sent, the applied index it last
    /// reported, and whether it was heard from within the active window.
    fn learner_progress(&self, id: u64, now: Instant) -> LearnerProgress {
        LearnerProgress::from_tracker(
            id,
            self.raw.raft.prs(),
            self.snap_idx.get(&id).copied(),
            self.applied_reports.get(&id).copied(),
            self.activity.is_active(id, now, self.mopts.active_window),
        )
    }

    /// Handles a control frame from member `from`.
    fn control(&mut self, from: u64, c: Control) {
        match c {
            Control::Forward { origin, seq, op } => {
                if self.raw.raft.state == StateRole::Leader {
                    self.leader_member_op(origin, seq, op, None, Instant::now());
                } else {
                    let e = NodeError::NotLeader {
                        id: self.id,
                        leader: self.leader(),
                    };
                    self.member_refused(origin, seq, None, e);
                }
            }
            Control::Refused { seq, error } => {
                if let Some((_, reply)) = self.waiters.remove(&seq) {
                    let _ = reply.send(Err(NodeError::Membership(error)));
                }
            }
            Control::Applied { index } => {
                self.applied_reports.insert(from, index);
            }
            Control::Removed => {
                if self.members.get(from).is_some() || self.members.members().next().is_none() {
                    self.removed = true;
                }
            }
        }
    }

    /// Applies a membership entry: the members, the entry's index and the conf state in one
    /// write transaction; the Raft conf change only when the membership changed.
    fn apply_member(
        &mut self,
        e: &Entry,
        env: Envelope,
        cc: Option<ConfChangeV2>,
    ) -> Result<(), NodeError> {
        let Request::Member(op) = &env.request else {
            return Err(NodeError::Membership(format!(
                "entry {} is not a membership operation",
                e.index
            )));
        };
        if e.index <= self.sm.applied() {
            self.auto.on_applied(op.id());
            return Ok(());
        }
        let store = self.sm.store();
        let mut txn = store.write();
        txn.set_consistent_index(e.index).map_err(store_err)?;
        let verdict = self.members.apply(op, e.index, &self.mopts, &mut txn);
        let staged = matches!(verdict, Ok(Applied::Changed));
        let mut cs = self.storage.conf_state();
        let answer: Result<Applied, NodeError> = match verdict {
            Ok(Applied::Changed) => match &cc {
                Some(cc) => match self.raw.apply_conf_change(cc) {
                    Ok(new) => {
                        cs = new;
                        Ok(Applied::Changed)
                    }
                    Err(err) => Err(NodeError::Membership(err.to_string())),
                },
                None => Ok(Applied::Changed),
            },
            Ok(Applied::NoOp) => Ok(Applied::NoOp),
            Err(err) => Err(err.into()),
        };
        if answer.is_err() && staged {
            // Raft refused what the member set accepted: keep neither.
            drop(txn);
            self.members = MemberSet::load(&store).map_err(NodeError::from)?;
            self.sm.apply_conf_state(e.index, &cs)?;
        } else {
            StateMachine::<B>::stage_conf_state(&mut txn, &cs)?;
            txn.commit().map_err(store_err)?;
        }
        self.storage.set_applied(e.index, Some(&cs));
        self.auto.on_applied(op.id());
        let mut removed_self = false;
        if answer.as_ref().is_ok_and(|a| *a == Applied::Changed) {
            match op {
                MemberOp::Add(m) => self.transport.peer_added(m.id, &m.peer_urls),
                MemberOp::UpdatePeerUrls { id, peer_urls } => {
                    self.transport.peer_added(*id, peer_urls)
                }
                MemberOp::Remove(id) => {
                    // The transport keeps the removed member's address so the member can be
                    // told it was removed if it calls again.
                    self.forget_member(*id);
                    removed_self = *id == self.id;
                }
                MemberOp::Promote { .. } => {}
            }
            tracing::info!(member = self.id, index = e.index, op = ?op, "membership changed");
        }
        self.publish_members();
        // The caller sees the new membership in the status as soon as it has its answer.
        self.update_status();
        let mut voters = cs.voters.clone();
        voters.sort_unstable();
        let mut learners = cs.learners.clone();
        learners.sort_unstable();
        self.answer(
            env.origin,
            env.seq,
            answer.map(|_| Response::ConfChange { voters, learners }),
        );
        if removed_self {
            return Err(self.removed_self());
        }
        Ok(())
    }

    /// Drops what this member keeps about member `id`, removed from the configuration: its
    /// activity, its promotion gate state (snapshot index, applied index reported), its
    /// transfer progress, and any snapshot transfer running to it, which is cancelled.
    fn forget_member(&mut self, id: u64) {
        self.activity.forget(id);
        self.snap_idx.remove(&id);
        self.applied_reports.remove(&id);
        self.shared.transfers.lock().remove(&id);
        let reason = format!("member {id} was removed from the cluster");
        if snapshot::cancel_to(&self.acks, self.id, id, &reason) > 0 {
            tracing::info!(
                member = self.id,
                to = id,
                "snapshot transfer to a removed member cancelled"
            );
        }
    }

    /// Once per tick on the leader: gives up on each latest transfer of this leadership that
    /// has made no progress for `snapshot_timeout` (no chunk handed to the transport since,
    /// and its sender has not ended: no answer ended it either). Its sender is blocked for
    /// good in the transport (a send that never returns, a peer that never reads), and
    /// raft-rs, never told the transfer ended, would keep the member paused in its snapshot
    /// state until the leadership changes. The transfer is reported failed to raft-rs, once
    /// (it is no longer the latest, so its late end, should its sender ever wake, is not
    /// reported again), and cancelled, so a sender that wakes stops at its next chunk;
    /// raft-rs then sends a fresh snapshot. A transfer to a member raft-rs no longer tracks
    /// (removed: its transfer was cancelled then) is left alone.
    fn give_up_stalled_transfers(&mut self) {
        if self.latest_transfer.is_empty() || self.raw.raft.state != StateRole::Leader {
            return;
        }
        let timeout = self.shared.options.snapshot_timeout;
        let term = self.raw.raft.term;
        let now = Instant::now();
        let running: Vec<(u64, LatestTransfer)> = {
            // A sender that has ended is no longer waiting for its answer: its end is on its
            // way to this thread and is reported from there.
            let acks = self.acks.lock();
            let prs = self.raw.raft.prs();
            self.latest_transfer
                .iter()
                .filter(|(to, l)| {
                    l.term == term && acks.contains_key(&l.transfer) && prs.get(**to).is_some()
                })
                .map(|(&to, &l)| (to, l))
                .collect()
        };
        let stalled: Vec<(u64, u64, Duration)> = {
            let progress = self.shared.transfers.lock();
            running
                .into_iter()
                .filter_map(|(to, l)| {
                    let last = progress.get(&to).map_or(l.began, |p| p.last.max(l.began));
                    let idle = now.saturating_duration_since(last);
                    (idle >= timeout).then_some((to, l.transfer, idle))
                })
                .collect()
        };
        for (to, transfer, idle) in stalled {
            self.latest_transfer.remove(&to);
            let idle_ms = idle.as_millis() as u64;
            let reason = format!("no progress for {idle_ms} ms");
            snapshot::cancel_to(&self.acks, self.id, to, &reason);
            tracing::warn!(
                member = self.id,
                to,
                transfer,
                idle_ms,
                "snapshot transfer made no progress for snapshot_timeout: reported failed to \
                 raft-rs and cancelled"
            );
            self.raw.report_snapshot(to, SnapshotStatus::Failure);
        }
    }

    /// Cancels every snapshot transfer this member is sending, once it no longer leads: only a
    /// leader's snapshot is of use to raft-rs (the new leader sends its own), and the
    /// senders would otherwise stream the rest of the backend, holding a read transaction on
    /// it, and wait for acks nobody will report.
    fn cancel_outgoing_transfers(&mut self) {
        let reason = format!(
            "member {} is no longer the leader (term {})",
            self.id, self.raw.raft.term
        );
        let cancelled = snapshot::cancel_all(&self.acks, self.id, &reason);
        if cancelled > 0 {
            tracing::info!(
                member = self.id,
                cancelled,
                "snapshot transfers of a leadership that ended cancelled"
            );
        }
    }

    /// Cancels every snapshot transfer this member began as the leader of a term earlier than
    /// its current one, as [`cancel_outgoing_transfers`](Self::cancel_outgoing_transfers)
    /// does once it no longer leads: raft-rs forgot those transfers when the term changed
    /// (their ends are not reported to it), and the senders would
    /// otherwise stream the rest of the backend, holding a read transaction on it. The
    /// transfers of the current term go on.
    fn cancel_transfers_of_earlier_terms(&mut self) {
        let term = self.raw.raft.term;
        // The latest transfer to a member is the one begun last: those before it were
        // cancelled when it replaced them, so the transfers to a member whose latest one is
        // of an earlier term are all of an earlier term.
        let earlier: Vec<(u64, u64)> = self
            .latest_transfer
            .iter()
            .filter(|(_, l)| l.term < term)
            .map(|(&to, l)| (to, l.term))
            .collect();
        for (to, began) in earlier {
            let reason = format!(
                "begun by member {} as the leader of term {began}, which it no longer leads (term \
                 {term})",
                self.id
            );
            let cancelled = snapshot::cancel_to(&self.acks, self.id, to, &reason);
            if cancelled > 0 {
                tracing::info!(
                    member = self.id,
                    to,
                    cancelled,
                    began_in = began,
                    term,
                    "snapshot transfers of an earlier term cancelled"
                );
            }
        }
    }

    /// Leaves the marker that keeps this member from running on its data again, and returns
    /// the error it stops with.
    fn removed_self(&mut self) -> NodeError {
        let marker = self.dir.join(REMOVED_MARKER);
        let text = MembershipError::PermanentlyRemoved { id: self.id }.to_string();
        let written = fs::write(&marker, format!("{text}\n"))
            .and_then(|()| fs::File::open(&marker)?.sync_all())
            .and_then(|()| fs::File::open(&self.dir)?.sync_all());
        if let Err(e) = written {
            tracing::error!(member = self.id, error = %e, "cannot write the removal marker");
        }
        tracing::warn!(member = self.id, "{text}");
        NodeError::Member {
            id: self.id,
            source: MembershipError::PermanentlyRemoved { id: self.id },
        }
    }

    fn publish_members(&self) {
        *self.shared.members.write() = Listed::of(&self.members);
    }

    /// Once per tick: a learner reports its applied index to the leader; the leader runs
    /// the automatic promotion.
    fn member_duties(&mut self) {
        let now = Instant::now();
        if now.saturating_duration_since(self.last_member_turn) < self.shared.options.tick_interval
        {
            return;
        }
        self.last_member_turn = now;
        let leader = self.raw.raft.state == StateRole::Leader;
        if leader != self.was_member_leader {
            self.was_member_leader = leader;
            self.auto.reset();
        }
        if !leader {
            let is_learner = self.raw.raft.prs().conf().learners().contains(&self.id);
            if is_learner && let Some(l) = self.leader() {
                let report = Control::Applied {
                    index: self.sm.applied(),
                };
                self.transport.send(report.to_message(self.id, l));
            }
            return;
        }
        // A learner held from automatic promotion (its role was last set by a raw conf
        // change) is left out: the operator who made it a learner that way promotes it. Only
        // the proposal is left out, not the apply of an automatic promote, which every
        // member must apply alike whatever its build or its view of the holds.
        let learners: Vec<u64> = self
            .raw
            .raft
            .prs()
            .conf()
            .learners()
            .iter()
            .copied()
            .filter(|&l| !self.members.is_held(l))
            .collect();
        if learners.is_empty() {
            return;
        }
        let last = self.raw.raft.raft_log.last_index();
        let gates: Vec<(u64, Result<(), MembershipError>)> = learners
            .iter()
            .map(|&l| {
                (
                    l,
                    promotion_gate(&self.learner_progress(l, now), last, &self.mopts),
                )
            })
            .collect();
        let pending = self.raw.raft.pending_conf_index > self.raw.raft.raft_log.applied;
        if let Some(id) = self.auto.tick(now, &gates, pending, &self.mopts) {
            let op = MemberOp::Promote {
                id,
                automatic: true,
            };
            match self.propose_member(0, 0, op) {
                Ok(()) => tracing::info!(
                    member = self.id,
                    learner = id,
                    "automatic promotion proposed"
                ),
                Err(e) => {
                    tracing::debug!(member = self.id, learner = id, error = %e, "automatic promotion refused");
                    self.auto.on_failed(id, now);
                }
            }
        }
    }

    fn read_states(&mut self, states: Vec<raft::ReadState>) {
        for rs in states {
            if rs.request_ctx.len() != 8 {
                continue;
            }
            let mut a = [0u8; 8];
            a.copy_from_slice(&rs.request_ctx);
            let ctx = u64::from_le_bytes(a);
            if let Some(round) = self.reads.remove(&ctx) {
                for r in round.replies {
                    self.applied_waits.push((rs.index, r));
                }
            }
        }
    }

    /// Fails with [`NodeError::NotLeader`] (naming `leader`, the leader now known) every read
    /// whose read-index round in flight can no longer be answered, once this member's role,
    /// its leader or its term has changed: raft-rs drops the read-index requests of a leader
    /// that steps down, and the answers of a leader of an earlier term, so those reads would
    /// otherwise wait out their request timeout. As etcd ("leader changed"), the caller may retry at
    /// once, here or on another member. Reads not yet sent wait for the next round (to the
    /// new leader, or refused at once while none is known), and reads whose index is already
    /// confirmed complete as the apply reaches it.
    ///
    /// A round can still be answered while this member is in the term it was sent in and
    /// the leader it was sent to is the one known, or no leader is known and it was not
    /// this member: a pre-candidate (pre-vote) stays in its term, and becomes that leader's
    /// follower again when it hears from it. Such a round waits: asked again when the leader
    /// is heard from again (raft-rs drops an answer that reached a pre-candidate), it fails
    /// if no leader is known for an election timeout (see
    /// [`expire_leaderless_reads`](Self::expire_leaderless_reads)). Every other round
    /// fails: sent in an earlier term (this member campaigned, or heard of a later term),
    /// to another leader, or by this member as the leader it no longer is.
    fn fail_reads_in_flight(&mut self, leader: Option<u64>) {
        let regained = match leader {
            Some(_) => self.leaderless_since.take().is_some(),
            None => {
                self.leaderless_since.get_or_insert_with(Instant::now);
                false
            }
        };
        if self.reads.is_empty() {
            return;
        }
        let (id, term) = (self.id, self.raw.raft.term);
        let answerable = |round: &ReadRound| {
            round.term == term
                && match leader {
                    Some(l) => round.leader == l,
                    None => round.leader != id,
                }
        };
        let stale: Vec<u64> = self
            .reads
            .iter()
            .filter(|(_, round)| !answerable(round))
            .map(|(ctx, _)| *ctx)
            .collect();
        self.fail_reads(stale, leader, "leader changed");
        if regained {
            // Its answer may have come while this member was a pre-candidate, which drops it.
            let now = Instant::now();
            for (ctx, round) in &mut self.reads {
                round.asked_again(now);
                self.raw.read_index(ctx.to_le_bytes().to_vec());
            }
        }
    }

    /// Fails the reads of every round in flight once no leader has been known for an
    /// election timeout (`tick_interval × election_ticks`): this member, cut off from the
    /// leader they were sent to, keeps campaigning (as a pre-candidate, in the rounds' term)
    /// rather than waiting for it, and nothing asks again until a leader is known.
    fn expire_leaderless_reads(&mut self) {
        let Some(since) = self.leaderless_since else {
            return;
        };
        let o = &self.shared.options;
        if self.reads.is_empty() || since.elapsed() < o.tick_interval * o.election_ticks as u32 {
            return;
        }
        let all: Vec<u64> = self.reads.keys().copied().collect();
        self.fail_reads(all, None, "no leader for an election timeout");
    }

    /// Fails the reads of the rounds `ctxs` with [`NodeError::NotLeader`] naming `leader`.
    fn fail_reads(&mut self, ctxs: Vec<u64>, leader: Option<u64>, why: &str) {
        let id = self.id;
        let mut failed = 0;
        for ctx in ctxs {
            let Some(round) = self.reads.remove(&ctx) else {
                continue;
            };
            for r in round.replies {
                failed += 1;
                let _ = r.send(Err(NodeError::NotLeader { id, leader }));
            }
        }
        if failed == 0 {
            return;
        }
        tracing::debug!(
            member = self.id,
            ?leader,
            failed,
            why,
            "linearizable reads in flight failed"
        );
    }

    fn complete_reads(&mut self) {
        if self.applied_waits.is_empty() {
            return;
        }
        let applied = self.sm.applied();
        let mut i = 0;
        while i < self.applied_waits.len() {
            if self.applied_waits[i].0 <= applied {
                let (idx, r) = self.applied_waits.swap_remove(i);
                let _ = r.send(Ok(idx));
            } else {
                i += 1;
            }
        }
    }

    /// Every `snapshot_count` applied entries: make the backend durable and compact the log,
    /// keeping `snapshot_catch_up_entries` behind.
    fn maybe_snapshot_point(&mut self) -> Result<(), NodeError> {
        let applied = self.sm.applied();
        let (first, _, _) = self.storage.bounds();
        if first == 1 && applied >= 1 {
            // The bootstrap configuration is in no entry: a member that joins must start
            // from a snapshot (which carries it), never replay the log from index 1. With
            // entry 1 compacted, raft-rs sends a new member a snapshot.
            self.sm.store().force_commit().map_err(store_err)?;
            self.storage.compact(1)?;
        }
        let o = &self.shared.options;
        if applied < self.last_snapshot_point + o.snapshot_count {
            return Ok(());
        }
        let store = self.sm.store();
        store.force_commit().map_err(store_err)?;
        self.last_snapshot_point = applied;
        let compact_to = applied.saturating_sub(o.snapshot_catch_up_entries);
        let (first, _, _) = self.storage.bounds();
        if compact_to >= first {
            self.storage.compact(compact_to)?;
            tracing::info!(
                member = self.id,
                applied,
                compact_to,
                "log compacted at a snapshot point"
            );
        }
        Ok(())
    }

    fn update_status(&mut self) {
        let raft = &self.raw.raft;
        let (first, last, _) = self.storage.bounds();
        let cs = raft.prs().conf().to_conf_state();
        let mut voters = cs.voters;
        voters.sort_unstable();
        let mut learners = cs.learners;
        learners.sort_unstable();
        let status = NodeStatus {
            id: self.id,
            leader: self.leader(),
            role: raft.state.into(),
            term: raft.term,
            commit: raft.raft_log.committed,
            applied: self.sm.applied(),
            voters,
            learners,
            first_index: first,
            last_index: last,
            snapshots_installed: self.snapshots_installed,
            snapshots_sent: self.snapshots_sent,
            snapshots_refused: 0,
            transfers: {
                let mut t: Vec<TransferProgress> =
                    self.shared.transfers.lock().values().copied().collect();
                t.sort_by_key(|p| p.to);
                t
            },
        };
        self.shared
            .is_learner
            .store(status.learners.contains(&self.id), Ordering::Release);
        *self.shared.status.write() = status;
    }
}

struct NotLeaderNone(u64);

impl From<NotLeaderNone> for NodeError {
    fn from(n: NotLeaderNone) -> NodeError {
        NodeError::NotLeader {
            id: n.0,
            leader: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round asked again (its leader found again, over and over) is kept for the limit
    /// from its first ask, when its reads' callers have all given up, not from its last; the
    /// next batch is held back only for a tick after its last ask, and the sweep asks it
    /// again half a second after that.
    #[test]
    fn a_round_asked_again_is_kept_from_its_first_ask() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let (limit, tick) = (ms(2000), ms(100));
        let mut round = ReadRound::new(t0, 1, 1, Vec::new());
        // A follower that loses and finds its leader every 300 ms asks again each time.
        let mut last = t0;
        for i in 1..=6 {
            last = t0 + ms(300 * i);
            round.asked_again(last);
        }
        let expired = t0 + limit;
        assert!(
            !round.kept_at(expired, limit),
            "a round first asked {limit:?} ago, asked again {:?} ago, is still kept",
            expired.saturating_duration_since(last)
        );
        assert!(round.kept_at(expired - ms(1), limit));
        assert!(round.holds_back_at(last + ms(99), tick));
        assert!(
            !round.holds_back_at(last + tick, tick),
            "held back past a tick"
        );
        assert!(!round.due_again_at(last + ms(499)));
        assert!(round.due_again_at(last + READ_ASK_AGAIN));
    }
}
