//! The simulation harness: a whole cluster in one process.
//!
//! [`Cluster`] runs N members over a [`MemNetwork`], each with a real WAL and a real backend in
//! its own temporary directory. Members can be killed (threads stopped, files kept) and
//! restarted from their directories; the network can drop, delay, partition and isolate.
//! Compiled with the `testing` feature (the crate's own tests and benchmarks use it).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use keel_lease::{LessorOptions, ManualClock};
use keel_mvcc::{Backend, PutResponse, RangeRequest, StoreOptions};
use keel_wal::WalOptions;

use crate::error::NodeError;
use crate::membership::MembershipOptions;
use crate::node::{Node, NodeConfig, ReadConsistency, Role};
use crate::options::NodeOptions;
use crate::tcp::RateLimiter;
use crate::transport::MemNetwork;

/// The backend the harness uses by default: the pure-Rust file backend when compiled in,
/// LMDB otherwise.
#[cfg(feature = "backend-file")]
pub type TestBackend = keel_backend_file::FileBackend;
/// The backend the harness uses by default: the pure-Rust file backend when compiled in,
/// LMDB otherwise.
#[cfg(all(feature = "backend-lmdb", not(feature = "backend-file")))]
pub type TestBackend = keel_backend_lmdb::LmdbBackend;

/// Options for fast simulated clusters: 10 ms ticks (election after 100–200 ms), 1 MiB WAL
/// segments, short request timeouts.
pub fn fast_options() -> NodeOptions {
    NodeOptions {
        tick_interval: Duration::from_millis(10),
        election_ticks: 10,
        heartbeat_ticks: 1,
        request_timeout: Duration::from_secs(3),
        snapshot_timeout: Duration::from_secs(10),
        ..NodeOptions::default()
    }
}

/// WAL options for simulated clusters: small segments so release is exercised.
pub fn small_wal() -> WalOptions {
    WalOptions {
        segment_size: 1024 * 1024,
        ..WalOptions::default()
    }
}

/// N members in one process.
pub struct Cluster<B: Backend> {
    /// The network between members.
    pub net: MemNetwork,
    /// Options every member starts with.
    pub options: NodeOptions,
    /// Backend options every member starts with.
    pub backend_options: B::Options,
    /// Store options every member starts with.
    pub store_options: StoreOptions,
    /// WAL options every member starts with.
    pub wal_options: WalOptions,
    /// Lessor options every member starts with.
    pub lessor_options: LessorOptions,
    /// Membership options every member starts with (set before starting members).
    pub membership: MembershipOptions,
    /// Snapshot pacing shared by every member (the in-memory network does not pace).
    pub snapshot_limiter: Option<Arc<RateLimiter>>,
    /// The lease clock every member shares; tests advance it by hand.
    pub clock: Arc<ManualClock>,
    _root: Option<tempfile::TempDir>,
    dirs: BTreeMap<u64, PathBuf>,
    nodes: BTreeMap<u64, Option<Arc<Node<B>>>>,
    peers: Vec<u64>,
}

impl<B: Backend> Cluster<B> {
    /// Creates and starts members `1..=n` of a new cluster.
    pub fn new(n: u64, options: NodeOptions, seed: u64) -> Result<Cluster<B>, NodeError> {
        Self::with(n, options, small_wal(), B::Options::default(), seed)
    }

    /// Like [`new`](Self::new) with explicit membership options.
    pub fn with_membership(
        n: u64,
        options: NodeOptions,
        membership: MembershipOptions,
        seed: u64,
    ) -> Result<Cluster<B>, NodeError> {
        let root = tempfile::tempdir().map_err(|e| NodeError::io("tempdir", "create", e))?;
        let path = root.path().to_path_buf();
        Self::build(
            n,
            options,
            small_wal(),
            B::Options::default(),
            seed,
            &path,
            Some(root),
            membership,
        )
    }

    /// Like [`new`](Self::new) with explicit WAL and backend options.
    pub fn with(
        n: u64,
        options: NodeOptions,
        wal_options: WalOptions,
        backend_options: B::Options,
        seed: u64,
    ) -> Result<Cluster<B>, NodeError> {
        let root = tempfile::tempdir().map_err(|e| NodeError::io("tempdir", "create", e))?;
        let path = root.path().to_path_buf();
        Self::build(
            n,
            options,
            wal_options,
            backend_options,
            seed,
            &path,
            Some(root),
            MembershipOptions::default(),
        )
    }

    /// Members `1..=n` whose directories live under `root` (kept when the cluster is
    /// dropped): a cluster that a later process reopens.
    pub fn at(
        root: &std::path::Path,
        n: u64,
        options: NodeOptions,
        seed: u64,
    ) -> Result<Cluster<B>, NodeError> {
        Self::build(
            n,
            options,
            small_wal(),
            B::Options::default(),
            seed,
            root,
            None,
            MembershipOptions::default(),
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        n: u64,
        options: NodeOptions,
        wal_options: WalOptions,
        backend_options: B::Options,
        seed: u64,
        path: &std::path::Path,
        root: Option<tempfile::TempDir>,
        membership: MembershipOptions,
    ) -> Result<Cluster<B>, NodeError> {
        let peers: Vec<u64> = (1..=n).collect();
        let dirs = peers
            .iter()
            .map(|&id| (id, path.join(format!("member-{id}"))))
            .collect();
        let mut c = Cluster {
            net: MemNetwork::new(seed),
            options,
            backend_options,
            store_options: StoreOptions {
                batch_interval: Duration::from_millis(20),
                ..StoreOptions::default()
            },
            wal_options,
            lessor_options: LessorOptions::default(),
            clock: Arc::new(ManualClock::new()),
            membership,
            snapshot_limiter: None,
            _root: root,
            dirs,
            nodes: BTreeMap::new(),
            peers: peers.clone(),
        };
        for id in peers {
            c.start(id)?;
        }
        Ok(c)
    }

    /// Member ids.
    pub fn ids(&self) -> Vec<u64> {
        self.peers.clone()
    }

    /// The data directory of member `id`.
    pub fn dir(&self, id: u64) -> Option<PathBuf> {
        self.dirs.get(&id).cloned()
    }

    /// Starts (or restarts) member `id` from its directory.
    pub fn start(&mut self, id: u64) -> Result<(), NodeError> {
        self.start_with(id, |_| {})
    }

    /// Gives member `id` a data directory without starting it: a member that will join the
    /// running cluster (it starts with no peers and waits for the leader).
    pub fn add_dir(&mut self, id: u64) -> PathBuf {
        let root = self
            .dirs
            .values()
            .next()
            .and_then(|d| d.parent())
            .map(PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let dir = root.join(format!("member-{id}"));
        self.dirs.insert(id, dir.clone());
        dir
    }

    /// Like [`start`](Self::start), after `configure` has adjusted the configuration (for
    /// instance `force_new_cluster` or `start_config`).
    pub fn start_with(
        &mut self,
        id: u64,
        configure: impl Fn(&mut NodeConfig<B>),
    ) -> Result<(), NodeError> {
        let dir = self
            .dirs
            .get(&id)
            .cloned()
            .ok_or_else(|| NodeError::InvalidOption(format!("no member {id}")))?;
        let mut attempt = 0;
        loop {
            let (transport, mailbox) = self.net.register(id);
            let mut config = NodeConfig {
                id,
                peers: self.peers.clone(),
                dir: dir.clone(),
                options: self.options.clone(),
                wal_options: self.wal_options.clone(),
                backend_options: self.backend_options.clone(),
                store_options: self.store_options.clone(),
                lessor_options: self.lessor_options.clone(),
                clock: self.clock.clone(),
                members: Vec::new(),
                membership: self.membership.clone(),
                start_config: None,
                force_new_cluster: false,
                snapshot_limiter: self.snapshot_limiter.clone(),
            };
            if !self.peers.contains(&id) {
                config.peers = Vec::new();
            }
            configure(&mut config);
            match Node::start(config, Arc::new(transport), mailbox) {
                Ok(node) => {
                    self.nodes.insert(id, Some(Arc::new(node)));
                    return Ok(());
                }
                Err(e @ (NodeError::Member { .. } | NodeError::InvalidOption(_))) => return Err(e),
                // A snapshot sender of the previous incarnation may still hold the backend.
                Err(e) if attempt < 50 => {
                    tracing::debug!(member = id, error = %e, "restart retried");
                    attempt += 1;
                    thread::sleep(Duration::from_millis(100));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Stops member `id` (its files stay) and detaches it from the network.
    pub fn kill(&mut self, id: u64) {
        self.net.unregister(id);
        if let Some(slot) = self.nodes.get_mut(&id)
            && let Some(node) = slot.take()
        {
            node.stop();
        }
    }

    /// Member `id`, when running.
    pub fn node(&self, id: u64) -> Option<Arc<Node<B>>> {
        self.nodes.get(&id).and_then(|n| n.clone())
    }

    /// Running members.
    pub fn running(&self) -> Vec<Arc<Node<B>>> {
        self.nodes.values().flatten().cloned().collect()
    }

    /// The leader a majority of running members agree on, if it is running and thinks it
    /// leads.
    pub fn leader(&self) -> Option<u64> {
        let running = self.running();
        let mut votes: BTreeMap<u64, usize> = BTreeMap::new();
        for n in &running {
            if let Some(l) = n.status().leader {
                *votes.entry(l).or_default() += 1;
            }
        }
        let quorum = self.peers.len() / 2 + 1;
        votes
            .into_iter()
            .filter(|&(_, v)| v >= quorum)
            .map(|(l, _)| l)
            .find(|&l| {
                self.node(l)
                    .is_some_and(|n| n.status().role == Role::Leader)
            })
    }

    /// Waits for [`leader`](Self::leader).
    pub fn wait_leader(&self, timeout: Duration) -> Result<u64, NodeError> {
        let start = Instant::now();
        loop {
            if let Some(l) = self.leader() {
                return Ok(l);
            }
            if start.elapsed() > timeout {
                return Err(NodeError::Timeout {
                    what: "leader election",
                    millis: timeout.as_millis() as u64,
                });
            }
            thread::sleep(Duration::from_millis(10));
        }
    }

    /// Puts through whichever member leads, retrying across leader changes until `timeout`.
    pub fn put(
        &self,
        key: &[u8],
        value: &[u8],
        timeout: Duration,
    ) -> Result<PutResponse, NodeError> {
        let start = Instant::now();
        loop {
            let leader = self.wait_leader(timeout.saturating_sub(start.elapsed()))?;
            let Some(node) = self.node(leader) else {
                continue;
            };
            match node.put(key, value) {
                Ok(r) => return Ok(r),
                Err(e) if start.elapsed() > timeout => return Err(e),
                Err(_) => thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// A linearizable read of one key's value on member `id`; while the member knows no
    /// leader (just restarted, election under way), or when the leader changed while the
    /// read waited for its read index, the read is retried for up to 5 s.
    pub fn get(&self, id: u64, key: &[u8]) -> Result<Option<Vec<u8>>, NodeError> {
        let node = self
            .node(id)
            .ok_or_else(|| NodeError::InvalidOption(format!("member {id} is not running")))?;
        let start = Instant::now();
        loop {
            match node.range(
                &RangeRequest::key(key.to_vec()),
                ReadConsistency::Linearizable,
            ) {
                Ok(r) => return Ok(r.kvs.into_iter().next().map(|kv| kv.value().to_vec())),
                Err(NodeError::NotLeader { .. }) if start.elapsed() < Duration::from_secs(5) => {
                    thread::sleep(Duration::from_millis(10));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits until every running member has applied the same index, at least `min`, and
    /// holds the same `hash_kv`; returns that index.
    pub fn wait_converged(&self, min: u64, timeout: Duration) -> Result<u64, NodeError> {
        let start = Instant::now();
        loop {
            let running = self.running();
            let applied: Vec<u64> = running.iter().map(|n| n.status().applied).collect();
            let first = applied.first().copied().unwrap_or(0);
            if first >= min && applied.iter().all(|&a| a == first) {
                let hashes: Result<Vec<_>, _> = running.iter().map(|n| n.hash_kv(0)).collect();
                if let Ok(h) = hashes
                    && h.windows(2).all(|w| w[0] == w[1])
                {
                    return Ok(first);
                }
            }
            if start.elapsed() > timeout {
                let detail: Vec<String> = running
                    .iter()
                    .map(|n| {
                        let s = n.status();
                        format!(
                            "member {}: applied {} commit {} term {}",
                            s.id, s.applied, s.commit, s.term
                        )
                    })
                    .collect();
                return Err(NodeError::Timeout {
                    what: Box::leak(
                        format!("convergence ({})", detail.join("; ")).into_boxed_str(),
                    ),
                    millis: timeout.as_millis() as u64,
                });
            }
            thread::sleep(Duration::from_millis(20));
        }
    }
}

impl<B: Backend> Drop for Cluster<B> {
    fn drop(&mut self) {
        // A snapshot sender stalled in the network ends with its member.
        self.net.release_stalled_snapshot_chunks();
        let ids: Vec<u64> = self.nodes.keys().copied().collect();
        for id in ids {
            self.kill(id);
        }
    }
}
