//! keel's main job, end to end: a 3-member cluster over TCP on loopback grows to 4 members
//! without an election or a write stall.
//!
//! ```text
//! cargo run --release -p keel-raft-glue --example cluster_demo            # 100 000 keys × 1 KiB
//! cargo run --release -p keel-raft-glue --example cluster_demo -- --keys 20000
//! KEEL_DEMO_KEYS=20000 cargo run --release -p keel-raft-glue --example cluster_demo
//! ```
//!
//! Each member runs in this process with its own data directory under a temporary
//! directory and its own TCP transport. The demo loads the data (1% of the keys under
//! leases) while a client keeps writing, adds a 4th member (a learner, by default), shows
//! the snapshot transfer's progress, lets the leader promote it automatically, and prints a
//! timeline: elections (expected: none), the longest gap between successful writes, the
//! transfer rate and the time to promotion. It exits 0 only when the cluster ends with 4
//! voters whose stores hash the same.

use std::net::TcpListener;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use keel_mvcc::{PutRequest, TxnOp, TxnRequest};
use keel_raft_glue::testing::TestBackend;
use keel_raft_glue::{Mailbox, Member, Node, NodeConfig, NodeOptions, TcpOptions, TcpTransport};

type N = Arc<Node<TestBackend>>;

fn keys_wanted() -> usize {
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--keys"
            && let Some(v) = args.next().and_then(|v| v.parse().ok())
        {
            return v;
        }
    }
    std::env::var("KEEL_DEMO_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000)
}

fn options() -> NodeOptions {
    NodeOptions {
        snapshot_count: 20_000,
        snapshot_catch_up_entries: 5_000,
        ..NodeOptions::default()
    }
}

fn config(
    id: u64,
    peers: Vec<u64>,
    dir: std::path::PathBuf,
    members: Vec<Member>,
) -> NodeConfig<TestBackend> {
    let mut c = NodeConfig::<TestBackend>::new(id, peers, dir);
    c.options = options();
    c.members = members;
    c
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("demo failed: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let keys = keys_wanted();
    let t0 = Instant::now();
    let at = |t: Instant| format!("{:>7.3} s", t.duration_since(t0).as_secs_f64());
    let root = tempfile::tempdir()?;
    println!("keel cluster demo: 3 members over TCP on loopback, {keys} keys × 1 KiB");

    // Three members, each with its own transport and data directory.
    let mut eps: Vec<(u64, TcpTransport, Mailbox)> = Vec::new();
    for id in 1..=3u64 {
        let (t, m) = TcpTransport::bind(id, "127.0.0.1:0", TcpOptions::default())?;
        eps.push((id, t, m));
    }
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
    let mut nodes: Vec<N> = Vec::new();
    for (id, t, m) in eps {
        let cfg = config(
            id,
            vec![1, 2, 3],
            root.path().join(format!("member-{id}")),
            members.clone(),
        );
        nodes.push(Arc::new(Node::start(cfg, Arc::new(t), m)?));
    }
    let leader = wait_leader(&nodes, Duration::from_secs(10))?;
    let term0 = leader.status().term;
    println!(
        "{}  leader is member {} (term {term0})",
        at(Instant::now()),
        leader.id()
    );

    // A client that keeps writing through the whole run.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let stop = stop.clone();
        let nodes = nodes.clone();
        thread::spawn(move || {
            let (mut ok, mut longest, mut last, mut cur, mut i) =
                (0u64, Duration::ZERO, Instant::now(), 0usize, 0u64);
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let n = &nodes[cur % nodes.len()];
                match n.put(format!("client-{}", i % 1000).as_bytes(), b"tick") {
                    Ok(_) => {
                        let now = Instant::now();
                        longest = longest.max(now - last);
                        last = now;
                        ok += 1;
                    }
                    Err(_) => cur += 1,
                }
                thread::sleep(Duration::from_millis(2));
            }
            (ok, longest.max(last.elapsed()))
        })
    };

    // Load the data: transactions of 128 puts, ten leases holding 1% of the keys.
    let load_start = Instant::now();
    let mut leases = Vec::new();
    for _ in 0..10 {
        leases.push(leader.lease_grant(3600)?.0);
    }
    let value = vec![b'v'; 1024];
    let batch = 128;
    let mut i = 0;
    let loaders = 4;
    let per = keys.div_ceil(loaders);
    thread::scope(|s| -> Result<(), String> {
        let mut hs = Vec::new();
        for l in 0..loaders {
            let leader = leader.clone();
            let value = value.clone();
            let leases = leases.clone();
            hs.push(s.spawn(move || -> Result<(), String> {
                let (from, to) = (l * per, ((l + 1) * per).min(keys));
                let mut k = from;
                while k < to {
                    let end = (k + batch).min(to);
                    let ops = (k..end)
                        .map(|j| {
                            let lease = if j % 100 == 0 {
                                leases[j / 100 % leases.len()]
                            } else {
                                0
                            };
                            TxnOp::Put(PutRequest {
                                key: format!("key-{j:08}").into_bytes(),
                                value: value.clone(),
                                lease,
                                prev_kv: false,
                            })
                        })
                        .collect();
                    leader
                        .txn(TxnRequest {
                            compare: Vec::new(),
                            success: ops,
                            failure: Vec::new(),
                        })
                        .map_err(|e| e.to_string())?;
                    k = end;
                }
                Ok(())
            }));
        }
        for h in hs {
            h.join().map_err(|_| "loader panicked".to_string())??;
        }
        Ok(())
    })?;
    i += keys;
    let load_secs = load_start.elapsed().as_secs_f64();
    println!(
        "{}  loaded {i} keys ({:.1} MB) in {load_secs:.2} s, {} of them under {} leases",
        at(Instant::now()),
        (i * 1024) as f64 / 1e6,
        keys.div_ceil(100),
        leases.len()
    );

    // The 4th member: pick its address, add it (a learner by default), start it.
    let addr4 = {
        let l = TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?
    };
    let add_at = Instant::now();
    let m4 = leader.member_add("member-4", vec![format!("http://{addr4}")], false)?;
    println!(
        "{}  member add: id {:016x} joins as {}",
        at(add_at),
        m4.id,
        if m4.is_learner {
            "a learner"
        } else {
            "a voter"
        }
    );
    let (t4, mb4) = TcpTransport::bind(m4.id, addr4.to_string(), TcpOptions::default())?;
    for m in &members {
        t4.add_peer(
            m.id,
            keel_raft_glue::tcp::resolve_peer_url(&m.peer_urls[0])?,
        )?;
    }
    let mut cfg4 = config(m4.id, Vec::new(), root.path().join("member-4"), Vec::new());
    let mut start_config: Vec<(String, Vec<String>)> = members
        .iter()
        .map(|m| (m.name.clone(), m.peer_urls.clone()))
        .collect();
    start_config.push((m4.name.clone(), m4.peer_urls.clone()));
    cfg4.start_config = Some(start_config);
    let start4 = Instant::now();
    let n4: N = Arc::new(Node::start(cfg4, Arc::new(t4), mb4)?);
    println!("{}  member 4 started", at(start4));

    // Progress until promotion.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last_print = Instant::now() - Duration::from_secs(1);
    let mut transfer = None;
    let promoted_at = loop {
        let st = leader.status();
        if let Some(t) = st.transfers.iter().find(|t| t.to == m4.id) {
            let changed = transfer.is_none_or(|p: keel_raft_glue::membership::TransferProgress| {
                p.sent != t.sent || p.done != t.done
            });
            transfer = Some(*t);
            if changed && last_print.elapsed() >= Duration::from_millis(100) {
                last_print = Instant::now();
                println!(
                    "{}  snapshot to member 4: {:.1} MB sent, {:.1} MB/s{}",
                    at(Instant::now()),
                    t.sent as f64 / 1e6,
                    t.rate() as f64 / 1e6,
                    if t.done {
                        ", done".to_string()
                    } else {
                        t.eta()
                            .map(|d| format!(", about {:.2} s left", d.as_secs_f64()))
                            .unwrap_or_default()
                    }
                );
            }
        }
        if st.voters.contains(&m4.id) {
            break Instant::now();
        }
        if Instant::now() > deadline {
            return Err("member 4 was not promoted within 60 s".into());
        }
        thread::sleep(Duration::from_millis(5));
    };
    println!(
        "{}  member 4 promoted to voter (automatically)",
        at(promoted_at)
    );

    thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let (writes, longest_gap) = writer.join().map_err(|_| "writer panicked")?;

    // Converge and compare.
    let mut all = nodes.clone();
    all.push(n4.clone());
    let target = leader.status().commit;
    let conv = Instant::now() + Duration::from_secs(20);
    while all.iter().any(|n| n.status().applied < target) {
        if Instant::now() > conv {
            return Err("members did not converge".into());
        }
        thread::sleep(Duration::from_millis(10));
    }
    let hashes: Vec<u32> = all
        .iter()
        .map(|n| n.hash_kv(0).map(|h| h.hash))
        .collect::<Result<_, _>>()?;
    let voters = leader.status().voters;
    let elections = all.iter().map(|n| n.status().term).max().unwrap_or(0) - term0;
    let t = transfer.ok_or("no snapshot transfer was seen")?;

    println!();
    println!("timeline");
    println!("  elections during the run:        {elections} (expected: none)");
    println!(
        "  longest gap between writes:      {} ms ({writes} client writes)",
        longest_gap.as_millis()
    );
    println!(
        "  snapshot transfer:               {:.1} MB in {:.3} s = {:.1} MB/s",
        t.sent as f64 / 1e6,
        t.last.duration_since(t.started).as_secs_f64(),
        t.rate() as f64 / 1e6
    );
    println!(
        "  member 4 start to promotion:     {:.3} s (add to promotion {:.3} s)",
        promoted_at.duration_since(start4).as_secs_f64(),
        promoted_at.duration_since(add_at).as_secs_f64()
    );
    println!("  voters:                          {}", voters.len());
    println!("  hash_kv of the 4 members:        {hashes:08x?}");
    println!(
        "  total run time:                  {:.2} s",
        t0.elapsed().as_secs_f64()
    );
    let ok = voters.len() == 4 && hashes.windows(2).all(|w| w[0] == w[1]);
    println!("checks {}", if ok { "passed" } else { "FAILED" });
    n4.stop();
    for n in &nodes {
        n.stop();
    }
    Ok(ok)
}

fn wait_leader(nodes: &[N], timeout: Duration) -> Result<N, String> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(l) = nodes.iter().find(|n| n.status().leader == Some(n.id())) {
            return Ok(l.clone());
        }
        if Instant::now() > deadline {
            return Err("no leader elected".into());
        }
        thread::sleep(Duration::from_millis(20));
    }
}
