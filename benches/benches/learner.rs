//! Learner catch-up over TCP on loopback, each figure beside its reference in the same run:
//!
//! - snapshot transfer throughput to a new learner against a raw loopback TCP copy of the same
//!   bytes written to a file and fsynced (goal ≥ 0.7×). Both sides time the same thing: bytes
//!   moved from the sender's source to durable on the receiver. Keel's transfer starts when
//!   the leader's sender thread starts streaming its backend's consistent copy (checksummed
//!   chunks on the snapshot connection) and ends when the leader receives the learner's
//!   acknowledgement, which the learner sends once the stream is verified, restored into its
//!   next backend generation, synced and switched to (it then holds the snapshot durably).
//!   The reference starts before its connection is opened and ends once the receiver has
//!   written every byte to a file, fsynced it, renamed it and fsynced the directory. The two
//!   alternate, one reference copy beside each join, so both see the same machine;
//! - time from the new member's start until the leader accepts its promotion (gate: snapshot
//!   installed and applied, recently active, in sync), reported;
//! - the leader's put p99 latency while the transfer runs against the p99 in the half second
//!   before the learner is added, with one client writing (goal ≤ 2×).
//!
//! Data: `KEEL_LEARNER_BENCH_KEYS` keys of 1 KiB, default 200 000 (a stream of ~222 MB, the
//! issue's figure; the suite takes about a minute); the smoke run (`-- --test`) defaults to
//! 20 000.
//!
//! `KEEL_LEARNER_BENCH_RATE_MB=<n>` paces snapshots at n MB/s (default: unlimited);
//! `KEEL_LEARNER_BENCH_ADAPTIVE=1` turns the transport's adaptive snapshot pacing on
//! (default: off, as in `TcpOptions::default()`), to see both sides of its trade between
//! transfer rate and the leader's put latency.
//!
//! `KEEL_LEARNER_BENCH_SLOWEST=1` prints each join's five slowest puts with when they started
//! (after the new member's start) beside when the stream ran; `RUST_LOG=keel_raft_glue=debug`
//! shows each join's phases (snapshot started, streamed, restored, prepared, installed).
//!
//! `KEEL_LEARNER_BENCH_CPU=1` prints each join's CPU time from the learner's start to its
//! promotion: the whole process's, and that of each thread alive at both ends, by name
//! (schedstat). Threads that end in between (the snapshot sender, the restore, its key index
//! and direct writer) log theirs at debug level, with the time each spent ready to run but
//! waiting for a processor (`run_wait_ms`):
//! `RUST_LOG=keel_raft_glue=debug,keel_backend_file=debug,keel_mvcc=debug`.
//!
//! Run: `cargo bench -p keel-benches --bench learner`; smoke: `... -- --test`.

// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::fs::File;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use keel_benches::{Better, Recorder};
use keel_mvcc::{PutRequest, TxnOp, TxnRequest};
use keel_raft_glue::membership::MembershipOptions;
use keel_raft_glue::{Member, Node, NodeConfig, NodeOptions, TcpOptions, TcpTransport};
use parking_lot::Mutex;

type B = keel_backend_file::FileBackend;
type N = Arc<Node<B>>;

fn keys() -> usize {
    let smoke = std::env::args().any(|a| a == "--test");
    std::env::var("KEEL_LEARNER_BENCH_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if smoke { 20_000 } else { 200_000 })
}

/// Snapshot pacing of the members' transports: `KEEL_LEARNER_BENCH_RATE_MB` MB/s (default
/// unlimited), adaptive only with `KEEL_LEARNER_BENCH_ADAPTIVE=1`.
fn tcp_options() -> TcpOptions {
    let rate = std::env::var("KEEL_LEARNER_BENCH_RATE_MB")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    let adaptive = std::env::var("KEEL_LEARNER_BENCH_ADAPTIVE").is_ok_and(|v| v == "1");
    TcpOptions {
        snapshot_rate: rate * 1_000_000,
        adaptive_snapshot_pacing: adaptive,
        ..TcpOptions::default()
    }
}

fn options() -> NodeOptions {
    NodeOptions {
        snapshot_count: 20_000,
        snapshot_catch_up_entries: 5_000,
        request_timeout: Duration::from_secs(30),
        snapshot_timeout: Duration::from_secs(120),
        ..NodeOptions::default()
    }
}

fn membership() -> MembershipOptions {
    MembershipOptions {
        auto_promote: false,
        ..MembershipOptions::default()
    }
}

fn config(id: u64, peers: Vec<u64>, dir: PathBuf, members: Vec<Member>) -> NodeConfig<B> {
    let mut c = NodeConfig::<B>::new(id, peers, dir);
    c.options = options();
    c.membership = membership();
    c.members = members;
    c
}

struct Setup {
    root: tempfile::TempDir,
    members: Vec<Member>,
    nodes: Vec<N>,
    leader: N,
}

fn setup(keys: usize) -> Setup {
    let root = tempfile::tempdir().expect("tempdir");
    let eps: Vec<_> = (1..=3u64)
        .map(|id| {
            let (t, m) = TcpTransport::bind(id, "127.0.0.1:0", tcp_options()).expect("bind");
            (id, t, m)
        })
        .collect();
    let members: Vec<Member> = eps
        .iter()
        .map(|(id, t, _)| Member {
            id: *id,
            name: format!("member-{id}"),
            peer_urls: vec![format!("http://{}", t.local_addr())],
            client_urls: Vec::new(),
            is_learner: false,
        })
        .collect();
    let nodes: Vec<N> = eps
        .into_iter()
        .map(|(id, t, m)| {
            let cfg = config(
                id,
                vec![1, 2, 3],
                root.path().join(format!("member-{id}")),
                members.clone(),
            );
            Arc::new(Node::start(cfg, Arc::new(t), m).expect("start"))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(20);
    let leader = loop {
        if let Some(l) = nodes.iter().find(|n| n.status().leader == Some(n.id())) {
            break l.clone();
        }
        assert!(Instant::now() < deadline, "no leader");
        thread::sleep(Duration::from_millis(20));
    };
    let value = vec![b'v'; 1024];
    thread::scope(|s| {
        let per = keys.div_ceil(4);
        for l in 0..4 {
            let (leader, value) = (leader.clone(), value.clone());
            s.spawn(move || {
                let mut k = l * per;
                let to = ((l + 1) * per).min(keys);
                while k < to {
                    let end = (k + 128).min(to);
                    let success = (k..end)
                        .map(|j| {
                            TxnOp::Put(PutRequest::new(
                                format!("key-{j:08}").into_bytes(),
                                value.clone(),
                            ))
                        })
                        .collect();
                    leader
                        .txn(TxnRequest {
                            compare: Vec::new(),
                            success,
                            failure: Vec::new(),
                        })
                        .expect("load");
                    k = end;
                }
            });
        }
    });
    Setup {
        root,
        members,
        nodes,
        leader,
    }
}

/// One client writing to the leader, recording `(start, latency)` of every put.
struct Client {
    stop: Arc<AtomicBool>,
    lat: Arc<Mutex<Vec<(Instant, Duration)>>>,
    handle: Option<thread::JoinHandle<()>>,
}

impl Client {
    fn start(leader: N) -> Client {
        let stop = Arc::new(AtomicBool::new(false));
        let lat = Arc::new(Mutex::new(Vec::new()));
        let (s, l) = (stop.clone(), lat.clone());
        let handle = thread::spawn(move || {
            let mut i = 0u64;
            while !s.load(Ordering::Relaxed) {
                i += 1;
                let t = Instant::now();
                if leader
                    .put(format!("client-{}", i % 1000).as_bytes(), &[1u8; 128])
                    .is_ok()
                {
                    l.lock().push((t, t.elapsed()));
                }
                thread::sleep(Duration::from_millis(1));
            }
        });
        Client {
            stop,
            lat,
            handle: Some(handle),
        }
    }

    fn p99(&self, from: Instant, to: Instant) -> Option<Duration> {
        let mut v: Vec<Duration> = self
            .lat
            .lock()
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|(_, d)| *d)
            .collect();
        if v.len() < 10 {
            return None;
        }
        v.sort();
        Some(v[(v.len() * 99 / 100).min(v.len() - 1)])
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

struct Join {
    bytes: u64,
    transfer: Duration,
    to_promotable: Duration,
    p99_during: Option<Duration>,
    p99_before: Option<Duration>,
}

/// CPU time of every thread of this process: `tid -> (name, ns)` (Linux schedstat).
fn thread_cpu() -> std::collections::HashMap<u64, (String, u64)> {
    let mut out = std::collections::HashMap::new();
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return out;
    };
    for t in tasks.flatten() {
        let Some(tid) = t.file_name().to_str().and_then(|s| s.parse::<u64>().ok()) else {
            continue;
        };
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        let ns = std::fs::read_to_string(t.path().join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
        if let Some(ns) = ns {
            out.insert(tid, (comm.trim().to_owned(), ns));
        }
    }
    out
}

/// CPU time of the whole process (user + system), from `/proc/self/stat`, in clock ticks of
/// 10 ms.
fn process_cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name, which ends with the last ')'.
    let rest = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    (ticks(11) + ticks(12)) * 10.0
}

/// Prints the CPU each thread used between two [`thread_cpu`] samples, summed by name.
fn print_cpu(n: u64, before: &std::collections::HashMap<u64, (String, u64)>, process_ms: f64) {
    let after = thread_cpu();
    let mut by_name: std::collections::BTreeMap<String, u64> = Default::default();
    for (tid, (name, ns)) in &after {
        let was = before.get(tid).map_or(0, |(_, ns)| *ns);
        *by_name.entry(name.clone()).or_default() += ns.saturating_sub(was);
    }
    let mut v: Vec<(String, u64)> = by_name.into_iter().filter(|(_, ns)| *ns > 0).collect();
    v.sort_by_key(|(_, ns)| std::cmp::Reverse(*ns));
    let list: Vec<String> = v
        .iter()
        .take(12)
        .map(|(name, ns)| format!("{name} {:.0}", *ns as f64 / 1e6))
        .collect();
    println!(
        "CPU join {n}: process {process_ms:.0} ms; threads alive throughout (ms): {}",
        list.join(", ")
    );
}

/// Adds a learner, starts it, waits for the transfer and the promotion gate, then removes
/// it again (so the next join starts from the same cluster).
fn join(s: &Setup, client: &Client, n: u64) -> Join {
    let leader = &s.leader;
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").expect("port");
        l.local_addr().expect("addr")
    };
    let before_from = Instant::now();
    thread::sleep(Duration::from_millis(500));
    let m = leader
        .member_add(
            &format!("learner-{n}"),
            vec![format!("http://{addr}")],
            true,
        )
        .expect("member add");
    let (t, mb) = TcpTransport::bind(m.id, addr, TcpOptions::default()).expect("bind learner");
    for p in &s.members {
        t.add_peer(
            p.id,
            keel_raft_glue::tcp::resolve_peer_url(&p.peer_urls[0]).expect("url"),
        )
        .expect("peer");
    }
    let dir = s.root.path().join(format!("learner-{n}"));
    let cpu = std::env::var_os("KEEL_LEARNER_BENCH_CPU").map(|_| (thread_cpu(), process_cpu_ms()));
    let start = Instant::now();
    let learner = Node::start(
        config(m.id, Vec::new(), dir.clone(), Vec::new()),
        Arc::new(t),
        mb,
    )
    .expect("start learner");
    let deadline = start + Duration::from_secs(300);
    let progress = loop {
        if let Some(p) = leader
            .status()
            .transfers
            .iter()
            .find(|p| p.to == m.id && p.done)
        {
            break *p;
        }
        assert!(Instant::now() < deadline, "transfer did not finish");
        thread::sleep(Duration::from_millis(1));
    };
    let transfer_end = Instant::now();
    let promotable = loop {
        match leader.member_promote(m.id) {
            Ok(_) => break Instant::now(),
            Err(e) if e.to_string().contains("in sync") => {
                assert!(Instant::now() < deadline, "never promotable: {e}");
                thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("promote: {e}"),
        }
    };
    if let Some((before, process_before)) = &cpu {
        print_cpu(n, before, process_cpu_ms() - process_before);
    }
    if std::env::var_os("KEEL_LEARNER_BENCH_SLOWEST").is_some() {
        // The slowest puts of the join, by when they started after the learner did.
        let mut v: Vec<(Instant, Duration)> = client
            .lat
            .lock()
            .iter()
            .filter(|(t, _)| *t >= start && *t < transfer_end)
            .copied()
            .collect();
        v.sort_by_key(|(_, d)| std::cmp::Reverse(*d));
        let slowest: Vec<String> = v
            .iter()
            .take(5)
            .map(|(t, d)| {
                format!(
                    "{:.1} ms at +{:.0} ms",
                    d.as_secs_f64() * 1e3,
                    t.duration_since(start).as_secs_f64() * 1e3
                )
            })
            .collect();
        println!(
            "SLOWEST join {n}: {} puts, stream from +{:.0} to +{:.0} ms: {}",
            v.len(),
            progress.started.duration_since(start).as_secs_f64() * 1e3,
            progress.last.duration_since(start).as_secs_f64() * 1e3,
            slowest.join(", ")
        );
    }
    let j = Join {
        bytes: progress.sent,
        transfer: progress.last.duration_since(progress.started),
        to_promotable: promotable.duration_since(start),
        p99_during: client.p99(start, transfer_end),
        p99_before: client.p99(before_from, start),
    };
    leader.member_remove(m.id).expect("remove");
    learner.stop();
    drop(learner);
    let _ = std::fs::remove_dir_all(&dir);
    j
}

/// The reference: `bytes` over a fresh loopback TCP connection in 1 MiB writes, written to a
/// file by the receiver, fsynced, renamed, directory fsynced.
fn raw_copy(dir: &Path, bytes: u64) -> Duration {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let tmp = dir.join("raw.tmp");
    let fin = dir.join("raw.snap");
    let start = Instant::now();
    let receiver = thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut f = File::create(&tmp).expect("create");
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = s.read(&mut buf).expect("read");
            if n == 0 {
                break;
            }
            f.write_all(&buf[..n]).expect("write");
        }
        f.sync_all().expect("fsync");
        std::fs::rename(&tmp, &fin).expect("rename");
        if let Some(parent) = fin.parent() {
            File::open(parent)
                .and_then(|d| d.sync_all())
                .expect("fsync dir");
        }
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    let chunk = vec![0x5au8; 1 << 20];
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        s.write_all(&chunk[..n]).expect("send");
        left -= n as u64;
    }
    drop(s);
    receiver.join().expect("receiver");
    let d = start.elapsed();
    let _ = std::fs::remove_file(dir.join("raw.snap"));
    d
}

fn bench_learner(c: &mut Criterion, rec: &Recorder) {
    let keys = keys();
    let s = setup(keys);
    let client = Client::start(s.leader.clone());
    let ref_dir = s.root.path().join("raw");
    std::fs::create_dir_all(&ref_dir).expect("dir");
    let mut n = 0u64;
    let last_bytes = Mutex::new(0u64);
    let mut g = c.benchmark_group("learner");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(100))
        .measurement_time(Duration::from_secs(1));
    g.bench_function(format!("join {keys} keys"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                n += 1;
                // The reference copy alternates before and after the join.
                let raw_first = n.is_multiple_of(2);
                let known = *last_bytes.lock();
                let mut raw = None;
                if raw_first && known > 0 {
                    raw = Some(raw_copy(&ref_dir, known));
                }
                let j = join(&s, &client, n);
                if raw.is_none() {
                    raw = Some(raw_copy(&ref_dir, j.bytes));
                }
                rec.record("keel learner snapshot transfer", j.transfer, j.bytes.max(1));
                if let Some(d) = raw {
                    rec.record("raw tcp copy + disk write", d, j.bytes.max(1));
                }
                rec.record("start to promotable", j.to_promotable, 1);
                if let (Some(d), Some(b)) = (j.p99_during, j.p99_before) {
                    rec.record("put p99 during transfer", d, 1);
                    rec.record("put p99 without transfer", b, 1);
                }
                *last_bytes.lock() = j.bytes;
                total += j.transfer;
            }
            total
        })
    });
    g.finish();
    let bytes = *last_bytes.lock();
    rec.ratio(
        &format!("learner snapshot transfer of {:.1} MB", bytes as f64 / 1e6),
        "keel learner snapshot transfer",
        "raw tcp copy + disk write",
        Better::Faster,
        Some(0.7),
    );
    if let (Some(k), Some(r)) = (
        rec.median("keel learner snapshot transfer"),
        rec.median("raw tcp copy + disk write"),
    ) {
        println!(
            "THROUGHPUT keel transfer {:.1} MB/s, raw copy + write {:.1} MB/s",
            1.0 / k / 1e6,
            1.0 / r / 1e6
        );
    }
    if let Some(p) = rec.median("start to promotable") {
        println!("REPORT new member start to promotable: median {:.3} s", p);
    }
    rec.ratio(
        "leader put p99 during a learner's snapshot transfer",
        "put p99 during transfer",
        "put p99 without transfer",
        Better::LowerTime,
        Some(2.0),
    );
    drop(client);
    for node in &s.nodes {
        node.stop();
    }
}

fn benches(c: &mut Criterion) {
    // `RUST_LOG=keel_raft_glue=debug` shows each join's phases (stream, restore, install).
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    let rec = Recorder::new();
    bench_learner(c, &rec);
}

criterion_group!(learner, benches);
criterion_main!(learner);
