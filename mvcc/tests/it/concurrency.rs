//! Read views never block writers or backend commits, writers never block reads, and every
//! view is a consistent snapshot under load.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use keel_mvcc::{PutRequest, RangeRequest, ReadPacing, StoreOptions, TxnOp, TxnRequest};

use crate::common::{fresh_path, open_at, store};

/// Options under which the backend commits only when a batch fills or `force_commit` asks,
/// never on the timer.
fn commits_on_demand() -> StoreOptions {
    StoreOptions {
        batch_interval: Duration::from_secs(3600),
        ..StoreOptions::default()
    }
}

/// etcd `TestConcurrentReadNotBlockingWrite`.
#[test]
fn concurrent_read_not_blocking_write() {
    let (_d, _p, s) = store();
    let s = Arc::new(s);
    s.put(b"foo", b"bar", 0).unwrap();
    // A long read: opened, held, and used later from another thread.
    let read1 = s.read().unwrap();
    let (tx, rx) = mpsc::channel();
    let writer = {
        let s = s.clone();
        std::thread::spawn(move || {
            s.put(b"foo", b"newBar", 0).unwrap();
            s.force_commit().unwrap();
            tx.send(()).unwrap();
        })
    };
    rx.recv_timeout(Duration::from_secs(5))
        .expect("write and backend commit should not be blocked by an open read");
    writer.join().unwrap();
    let read2 = s.read().unwrap();
    let one = RangeRequest {
        limit: 1,
        ..RangeRequest::key(b"foo".to_vec())
    };
    assert_eq!(read2.range(&one).unwrap().kvs[0].value(), b"newBar");
    let old = std::thread::spawn(move || read1.range(&one).unwrap().kvs[0].value().to_vec())
        .join()
        .unwrap();
    assert_eq!(old, b"bar");
}

#[test]
fn pending_deletes_are_never_hidden() {
    let (_d, _p, s) = store();
    s.put(b"k", b"v", 0).unwrap();
    s.force_commit().unwrap();
    let before = s.read().unwrap();
    s.delete_range(b"k", None).unwrap();
    // The delete is only in the write buffer; the backend still holds the value.
    assert_eq!(s.range(&RangeRequest::key(b"k".to_vec())).unwrap().count, 0);
    assert_eq!(
        before
            .range(&RangeRequest::key(b"k".to_vec()))
            .unwrap()
            .count,
        1
    );
    s.force_commit().unwrap();
    assert_eq!(s.range(&RangeRequest::key(b"k".to_vec())).unwrap().count, 0);
    assert_eq!(
        before
            .range(&RangeRequest::key(b"k".to_vec()))
            .unwrap()
            .count,
        1
    );
}

/// Ten accounts; each transaction moves one unit between two of them, so every consistent
/// snapshot sums to the same total. Readers check that, and that a view reads the same twice.
#[test]
fn many_readers_one_writer_keep_invariants() {
    let (_d, path) = fresh_path();
    let options = StoreOptions {
        batch_interval: Duration::from_millis(3),
        batch_limit: 50,
        ..StoreOptions::default()
    };
    let s = Arc::new(open_at(&path, options));
    const ACCOUNTS: u64 = 10;
    for i in 0..ACCOUNTS {
        s.put(format!("acct{i}").as_bytes(), &100u64.to_be_bytes(), 0)
            .unwrap();
    }
    let total = 100 * ACCOUNTS;
    let stop = Arc::new(AtomicBool::new(false));
    let all = RangeRequest::prefix(b"acct".to_vec());
    let sum = |kvs: &[keel_mvcc::KeyValue]| -> u64 {
        kvs.iter()
            .map(|kv| u64::from_be_bytes(kv.value().try_into().unwrap()))
            .sum()
    };
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (s, stop, all) = (s.clone(), stop.clone(), all.clone());
            std::thread::spawn(move || {
                let mut last_rev = 0;
                let mut views = 0;
                while !stop.load(Ordering::Acquire) {
                    let view = s.read().unwrap();
                    assert!(view.revision() >= last_rev, "views went back in time");
                    last_rev = view.revision();
                    let first = view.range(&all).unwrap();
                    assert_eq!(first.kvs.len() as u64, ACCOUNTS);
                    assert_eq!(
                        sum(&first.kvs),
                        total,
                        "inconsistent snapshot at {last_rev}"
                    );
                    assert!(first.kvs.iter().all(|kv| kv.mod_revision <= last_rev));
                    std::thread::yield_now();
                    let again = view.range(&all).unwrap();
                    assert_eq!(first.kvs, again.kvs, "a view changed under its reader");
                    views += 1;
                }
                views
            })
        })
        .collect();
    let mut worst = Duration::ZERO;
    let mut state = vec![100u64; ACCOUNTS as usize];
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < Duration::from_millis(1500) {
        let (a, b) = ((n % ACCOUNTS) as usize, ((n * 7 + 3) % ACCOUNTS) as usize);
        n += 1;
        if a == b || state[a] == 0 {
            continue;
        }
        state[a] -= 1;
        state[b] += 1;
        let t0 = Instant::now();
        s.txn(&TxnRequest {
            success: vec![
                TxnOp::Put(PutRequest::new(
                    format!("acct{a}"),
                    state[a].to_be_bytes().to_vec(),
                )),
                TxnOp::Put(PutRequest::new(
                    format!("acct{b}"),
                    state[b].to_be_bytes().to_vec(),
                )),
            ],
            ..TxnRequest::default()
        })
        .unwrap();
        worst = worst.max(t0.elapsed());
    }
    stop.store(true, Ordering::Release);
    let views: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
    assert!(
        views > 10,
        "readers made too little progress ({views} views)"
    );
    assert!(
        worst < Duration::from_secs(1),
        "a write waited {worst:?} for readers"
    );
    let fin = s.range(&all).unwrap();
    assert_eq!(sum(&fin.kvs), total);
    drop(s);
    let s = open_at(&path, StoreOptions::default());
    let reopened = s.range(&all).unwrap();
    assert_eq!(sum(&reopened.kvs), total);
    assert_eq!(reopened.kvs, fin.kvs);
}

/// A view scanning a large range does not hold writers up: the writer keeps landing puts
/// while scans run back to back.
#[test]
fn long_scans_do_not_block_writes() {
    let (_d, _p, s) = store();
    let s = Arc::new(s);
    let mut t = s.write();
    for i in 0..20_000u32 {
        t.put(format!("key{i:06}").as_bytes(), b"value", 0).unwrap();
    }
    t.commit().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let scanner = {
        let (s, stop) = (s.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut scans = 0;
            while !stop.load(Ordering::Acquire) {
                let view = s.read().unwrap();
                let r = view
                    .range(&RangeRequest::range(b"key".to_vec(), vec![0]))
                    .unwrap();
                assert_eq!(r.count, 20_000);
                scans += 1;
            }
            scans
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let mut worst = Duration::ZERO;
    for i in 0..300u32 {
        let t0 = Instant::now();
        s.put(format!("key{:06}", i * 7).as_bytes(), b"new", 0)
            .unwrap();
        worst = worst.max(t0.elapsed());
    }
    stop.store(true, Ordering::Release);
    let scans = scanner.join().unwrap();
    assert!(scans >= 1);
    // A full scan takes far longer than this in a debug build; the index lock is only held
    // per chunk.
    assert!(worst < Duration::from_millis(500), "a put waited {worst:?}");
}

/// While writes flow on oversubscribed CPUs, a long read keeps its time on a CPU within
/// about `long_read_cpu_percent` of its elapsed time: it sleeps between chunks (the store
/// counts the sleeps). With no writes it runs without sleeping.
#[cfg(target_os = "linux")]
#[test]
fn a_long_read_keeps_to_its_cpu_share_while_writes_flow() {
    const KEYS: usize = 100_000;
    // One CPU for this thread and every thread started from it (the store's and the
    // writer): the CPUs are oversubscribed whatever the machine.
    let mine = rustix::thread::sched_getaffinity(None).unwrap();
    let cpu = (0..rustix::thread::CpuSet::MAX_CPU)
        .find(|&c| mine.is_set(c))
        .unwrap();
    let mut one = rustix::thread::CpuSet::new();
    one.set(cpu);
    rustix::thread::sched_setaffinity(None, &one).unwrap();
    let (_d, path) = fresh_path();
    let s = Arc::new(open_at(
        &path,
        StoreOptions {
            long_read_cpu_percent: 20,
            ..commits_on_demand()
        },
    ));
    let mut t = s.write();
    for i in 0..KEYS {
        t.put(format!("key{i:06}").as_bytes(), &[7; 100], 0)
            .unwrap();
    }
    t.commit().unwrap();
    s.force_commit().unwrap();
    // This thread's time on a CPU.
    let on_cpu = || {
        let sched = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
        Duration::from_nanos(sched.split_whitespace().next().unwrap().parse().unwrap())
    };
    let scan = || {
        let (cpu0, t0) = (on_cpu(), Instant::now());
        let view = s.read().unwrap();
        let r = view.range(&RangeRequest::prefix(b"key".to_vec())).unwrap();
        assert_eq!(r.kvs.len(), KEYS);
        (t0.elapsed(), on_cpu() - cpu0)
    };
    scan();
    assert_eq!(
        s.read_pacing(),
        ReadPacing::default(),
        "a read with no writes flowing slept"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (s, stop) = (s.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0;
            // A write, then 200 µs of work of its own on the CPU, as an application would.
            while !stop.load(Ordering::Acquire) {
                s.put(format!("key{:06}", i % KEYS).as_bytes(), b"new", 0)
                    .unwrap();
                i += 1;
                let t0 = Instant::now();
                while t0.elapsed() < Duration::from_micros(200) {
                    std::hint::spin_loop();
                }
            }
        })
    };
    let (elapsed, cpu) = scan();
    stop.store(true, Ordering::Release);
    writer.join().unwrap();
    let paced = s.read_pacing();
    assert!(paced.sleeps > 0, "a read beside a busy writer never slept");
    assert!(paced.slept <= elapsed, "{paced:?} in {elapsed:?}");
    assert!(
        cpu.as_secs_f64() <= 0.3 * elapsed.as_secs_f64(),
        "a read beside a busy writer ran {cpu:?} of {elapsed:?} (20% asked)"
    );
}

/// A backend slower than the writers: writes wait for running commits instead of piling up
/// in memory, and keep going while the committer works.
#[test]
fn writes_wait_for_a_slow_backend_instead_of_piling_up() {
    const LIMIT: usize = 5;
    let (_dir, path) = fresh_path();
    let s = open_at(
        &path,
        StoreOptions {
            batch_limit: LIMIT,
            ..commits_on_demand()
        },
    );
    s.backend().set_commit_delay(Duration::from_millis(20));
    let key_bucket = keel_mvcc::KEY_BUCKET;
    let mut most_pending = 0;
    for i in 0..400u32 {
        s.put(format!("k{i}").as_bytes(), b"v", 0).unwrap();
        let committed = s.backend().len(&key_bucket);
        let pending = (i as usize + 1).saturating_sub(committed);
        most_pending = most_pending.max(pending);
        // Eight limits in the buffer writers fill, and at most as many in the one being
        // committed.
        assert!(
            pending <= 16 * LIMIT,
            "{pending} writes wait in memory after put {i}; a limit of {LIMIT} bounds them at {}",
            16 * LIMIT
        );
    }
    assert!(
        most_pending > LIMIT,
        "the backend was never behind ({most_pending} pending at most): the test tests nothing"
    );
    s.force_commit().unwrap();
    assert_eq!(s.backend().len(&key_bucket), 400);
}

/// Clients that each put and then wait for durability (`force_commit`) share backend
/// commits: a caller whose writes another caller's commit already covered returns without a
/// commit of its own. Every write acknowledged before a `force_commit` call is in the backend
/// when that call returns.
#[test]
fn concurrent_force_commits_share_backend_commits() {
    const CLIENTS: u64 = 8;
    const ROUNDS: u64 = 10;
    let (_d, path) = fresh_path();
    let s = open_at(&path, commits_on_demand());
    s.backend().set_commit_delay(Duration::from_millis(3));
    let s = Arc::new(s);
    let (before, base) = (s.backend().commits(), s.current_revision());
    let start = Arc::new(std::sync::Barrier::new(CLIENTS as usize));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (s, start) = (s.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                for r in 0..ROUNDS {
                    let rev = s.put(format!("c{c}-r{r}").as_bytes(), b"v", 0).unwrap().revision;
                    s.force_commit().unwrap();
                    // One record per put: every revision up to this one (all acknowledged
                    // before the call) is durable now.
                    let durable = s.backend().len(&keel_mvcc::KEY_BUCKET) as u64;
                    assert!(
                        durable >= rev - base,
                        "client {c} round {r}: revision {rev} acknowledged, {durable} records durable"
                    );
                }
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    let commits = s.backend().commits() - before;
    assert_eq!(
        s.backend().len(&keel_mvcc::KEY_BUCKET) as u64,
        CLIENTS * ROUNDS
    );
    assert!(
        commits <= CLIENTS * ROUNDS / 2,
        "{commits} backend commits for {} durable puts from {CLIENTS} clients",
        CLIENTS * ROUNDS
    );
}

/// Callers waiting in `force_commit` when the backend commit fails all return an error: none
/// waits on for a commit that will never come, and none reports a write durable that the
/// backend never took.
#[test]
fn a_failed_commit_fails_every_waiting_force_commit() {
    const CLIENTS: usize = 8;
    let (_d, path) = fresh_path();
    let s = open_at(&path, commits_on_demand());
    s.backend().set_commit_delay(Duration::from_millis(20));
    s.backend().set_fail_commits(true);
    let s = Arc::new(s);
    let start = Arc::new(std::sync::Barrier::new(CLIENTS));
    let (tx, rx) = mpsc::channel();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (s, start, tx) = (s.clone(), start.clone(), tx.clone());
            std::thread::spawn(move || {
                start.wait();
                // A put after the failure is refused (the store is poisoned): nothing to wait for.
                let outcome = match s.put(format!("c{c}").as_bytes(), b"v", 0) {
                    Ok(_) => Some(s.force_commit().is_ok()),
                    Err(_) => None,
                };
                tx.send((c, outcome)).unwrap();
            })
        })
        .collect();
    let mut waited = 0;
    for _ in 0..CLIENTS {
        let (c, outcome) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("every force_commit returns once the commit failed");
        assert_ne!(
            outcome,
            Some(true),
            "client {c}: force_commit succeeded, no commit did"
        );
        waited += usize::from(outcome.is_some());
    }
    assert!(waited > 0, "no client reached force_commit");
    for c in clients {
        c.join().unwrap();
    }
    assert_eq!(s.backend().len(&keel_mvcc::KEY_BUCKET), 0);
}

/// A key's value, create and mod revisions and version.
type KeyState<'a> = (&'a [u8], u64, u64, u64);

/// Full scans running while a writer puts onto existing keys (which change the key index in
/// place, under the index's read lock, concurrently with the scans), deletes keys and puts new
/// ones each see exactly the store at their view's revision: every pair, with its create and
/// mod revisions and version, matches a model replayed from the writer's log up to it.
#[test]
fn scans_concurrent_with_puts_see_their_revision() {
    let (_d, _p, s) = store();
    let s = Arc::new(s);
    const KEYS: u64 = 1_500;
    let key = |i: u64| format!("key{i:05}").into_bytes();
    // (revision, key, value: None for a delete) of every change, in revision order.
    let mut log: Vec<(u64, Vec<u8>, Option<Vec<u8>>)> = Vec::new();
    let mut t = s.write();
    for i in 0..KEYS {
        t.put(&key(i), b"v0", 0).unwrap();
    }
    let rev = t.commit().unwrap();
    log.extend((0..KEYS).map(|i| (rev, key(i), Some(b"v0".to_vec()))));
    let stop = Arc::new(AtomicBool::new(false));
    let scanner = {
        let (s, stop) = (s.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut scans = Vec::new();
            while !stop.load(Ordering::Acquire) || scans.len() < 3 {
                let view = s.read().unwrap();
                let r = view
                    .range(&RangeRequest::range(b"key".to_vec(), vec![0]))
                    .unwrap();
                scans.push((view.revision(), r.kvs));
            }
            scans
        })
    };
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(800) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Existing keys mostly; some deletes, and keys beyond the loaded ones (new ones).
        let i = x % (KEYS + KEYS / 10);
        let k = key(i);
        if x.is_multiple_of(11) {
            let r = s.delete_range(&k, None).unwrap();
            if r.deleted > 0 {
                log.push((r.revision, k, None));
            }
        } else {
            let value = format!("v{}", x % 1000).into_bytes();
            let r = s.put(&k, &value, 0).unwrap();
            log.push((r.revision, k, Some(value)));
        }
    }
    stop.store(true, Ordering::Release);
    let scans = scanner.join().unwrap();
    assert!(scans.len() >= 3);
    for (at, kvs) in &scans {
        // key -> (value, create, mod, version) at `at`.
        let mut model: std::collections::BTreeMap<&[u8], KeyState<'_>> =
            std::collections::BTreeMap::new();
        for (rev, k, v) in log.iter().take_while(|(rev, _, _)| rev <= at) {
            match v {
                Some(v) => {
                    let e = model.entry(k).or_insert((v, *rev, *rev, 0));
                    *e = (v, e.1, *rev, e.3 + 1);
                }
                None => {
                    model.remove(&k[..]);
                }
            }
        }
        let got: Vec<(&[u8], KeyState<'_>)> = kvs
            .iter()
            .map(|kv| {
                let state = (kv.value(), kv.create_revision, kv.mod_revision, kv.version);
                (kv.key(), state)
            })
            .collect();
        let want: Vec<(&[u8], KeyState<'_>)> = model.into_iter().collect();
        assert_eq!(got, want, "the scan at revision {at}");
    }
}

/// Many callers of `force_commit` on quick commits: a commit wakes only a few of the callers
/// it made durable and each woken caller wakes more, and none is left asleep (a missed wake
/// hangs a client, caught by the deadline).
#[test]
fn every_force_commit_caller_made_durable_wakes() {
    const CLIENTS: u64 = 16;
    const ROUNDS: u64 = 150;
    let (_d, path) = fresh_path();
    let s = Arc::new(open_at(&path, commits_on_demand()));
    let (done_tx, done) = mpsc::channel();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (s, done_tx) = (s.clone(), done_tx.clone());
            std::thread::spawn(move || {
                for r in 0..ROUNDS {
                    s.put(format!("c{c}-r{}", r % 7).as_bytes(), b"v", 0)
                        .unwrap();
                    s.force_commit().unwrap();
                }
                done_tx.send(()).unwrap();
            })
        })
        .collect();
    for _ in 0..CLIENTS {
        done.recv_timeout(Duration::from_secs(60))
            .expect("a force_commit caller was never woken");
    }
    for c in clients {
        c.join().unwrap();
    }
    assert_eq!(s.current_revision(), CLIENTS * ROUNDS);
    assert_eq!(
        s.backend().len(&keel_mvcc::KEY_BUCKET) as u64,
        CLIENTS * ROUNDS
    );
}

/// A range over keys whose latest revisions lie, in no order, some in the backend, some in
/// the buffer being committed and some in the one writes fill meanwhile, finds every key's
/// value at the view's revision, and at an older one.
#[test]
fn a_range_reads_keys_scattered_over_the_backend_and_both_write_buffers() {
    const KEYS: u64 = 2000;
    let (_d, path) = fresh_path();
    let s = Arc::new(open_at(&path, commits_on_demand()));
    let key = |i: u64| format!("k{i:05}").into_bytes();
    // Every key's value, as the model sees it after each step.
    let mut model: Vec<String> = (0..KEYS).map(|i| format!("base-{i}")).collect();
    for i in 0..KEYS {
        s.put(&key(i), model[i as usize].as_bytes(), 0).unwrap();
    }
    s.force_commit().unwrap();
    // Keys in scattered order into the buffer that the next commit takes.
    for n in 0..KEYS / 2 {
        let i = n * 7919 % KEYS;
        model[i as usize] = format!("first-{n}");
        s.put(&key(i), model[i as usize].as_bytes(), 0).unwrap();
    }
    let after_first = (s.current_revision(), model.clone());
    s.backend().set_commit_delay(Duration::from_millis(400));
    let committed_before = s.backend().len(&keel_mvcc::KEY_BUCKET);
    let committer = {
        let s = s.clone();
        std::thread::spawn(move || s.force_commit().unwrap())
    };
    std::thread::sleep(Duration::from_millis(50));
    // More, some of the same keys again, into the buffer after it.
    for n in 0..KEYS / 3 {
        let i = n * 104_729 % KEYS;
        model[i as usize] = format!("second-{n}");
        s.put(&key(i), model[i as usize].as_bytes(), 0).unwrap();
    }
    let view = s.read().unwrap();
    assert_eq!(
        s.backend().len(&keel_mvcc::KEY_BUCKET),
        committed_before,
        "the commit of the first buffer ended before the view opened: the test tests nothing"
    );
    let all = |revision: u64| {
        let mut req = RangeRequest::range(b"k".to_vec(), b"l".to_vec());
        req.revision = revision;
        view.range(&req).unwrap().kvs
    };
    for (revision, expected) in [(0, &model), (after_first.0, &after_first.1)] {
        let kvs = all(revision);
        assert_eq!(kvs.len() as u64, KEYS);
        for (i, kv) in kvs.iter().enumerate() {
            assert_eq!(kv.key(), &key(i as u64)[..]);
            assert_eq!(
                kv.value(),
                expected[i].as_bytes(),
                "key {i} at revision {revision}"
            );
        }
    }
    committer.join().unwrap();
}
