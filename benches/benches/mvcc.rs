//! The MVCC store over the LMDB backend (the headline also over the file backend), each figure beside its reference in the same run.
//!
//! - put: 1 000 puts (24-byte keys, 150-byte values) then the backend commit that makes them
//!   durable, against raw heed putting the same pairs in one write transaction; with and
//!   without fsync; goal ≥ 0.7× raw heed's throughput. Both sides open LMDB as a store does
//!   by default (`write_map` off); REPORT lines follow with the same pair measured in
//!   alternating batches (both sides meet the same load on a shared machine) and with
//!   `write_map` on both sides (`KEEL_MVCC_BENCH_ONLY=put` runs the alternating batches
//!   alone).
//! - etcd 3.4's headline, as etcd measured it: 16 closed-loop clients, each put (1 KiB values
//!   over 100 000 keys) durable before its client sends the next (the put, then
//!   `force_commit`, which group-commits every client's pending puts with fsync), while a
//!   reader scans the whole key space over and over (it starts before and runs through the
//!   measured window; the scans completed in it and the median time of a scan are printed),
//!   against the same puts without it; on LMDB and, with the `backend-file` feature, on the
//!   append-only file backend; goals: throughput ≥ 0.9×, p99 put latency ≤ 1.5×. Then the
//!   same comparison, same goals, for one writer applying puts in memory back to back
//!   (default batching, the backend committing in the background): alone, that writer and
//!   the committer keep most of a 2-core machine's two cores busy, so a reader taking its
//!   fair share of the CPUs would cost the writer a third of its rate; the store's default
//!   pacing of long reads (`StoreOptions::long_read_cpu_percent`) keeps the reader to
//!   15% of its time on a CPU while writes flow and no CPU is idle, and the reader's share
//!   is printed. Both
//!   parts run each criterion sample's puts half alone and half with the reader, in three
//!   stretches (a quarter, the other kind's half, a quarter; which kind is outside alternates),
//!   so both meet the same machine and the same growth of the store within the sample; each
//!   kind runs at least 0.3 s and two and a half of the reader's median full scans, so the
//!   reader completes scans inside the measured window and the puts meet every phase of a
//!   scan. Each sample's own ratio is printed too. Between samples, untimed,
//!   the store is compacted at its current revision and the deletions waited for, so it
//!   stays about the size of its key space over the millions of puts. A REPORT line follows
//!   with the machine's own figure: raw heed's put throughput with a raw full-scan reader
//!   against raw heed's alone, over the same data.
//! - range of 10 000 keys (owned results) against a raw heed cursor copying the same pairs
//!   out; goal ≤ 1.5× the time.
//! - index memory: anonymous resident memory added by rebuilding the key index of 1 000 000
//!   keys (measured in a child process), per key beyond the key bytes; aim ≤ 128 B.
//! - watch fan-out: 10 000 watchers on distinct keys, in two watch streams (channels of
//!   16 384 responses) drained by one thread each, which reads every event's key and value
//!   (the run checks their byte sums against what was put), while 100 000 puts land;
//!   delivered events per second, the writer's and the whole process's CPU per put reported;
//!   put throughput goal ≥ 0.5× the same puts without watchers
//!   (`KEEL_MVCC_BENCH_ONLY=fanout` runs this part alone).
//!
//! `cargo bench -p keel-benches --bench mvcc` (the headline part alone, about five minutes:
//! `KEEL_MVCC_BENCH_ONLY=headline`); `-- --test` is the smoke run (small sizes).

use std::hint::black_box;
use std::ops::Bound;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};
use keel_backend_lmdb::LmdbBackend;
use keel_benches::{Better, Recorder};
use keel_mvcc::{Backend, RangeRequest, Store, StoreOptions, StreamItem, WatchRequest};

static RECORDER: LazyLock<Recorder> = LazyLock::new(Recorder::new);

const MAP_SIZE: usize = 16 << 30;
const INDEX_CHILD_ENV: &str = "KEEL_BENCH_INDEX_CHILD";

fn smoke() -> bool {
    std::env::args().any(|a| a == "--test")
}

fn key(i: u64) -> Vec<u8> {
    format!("key-{i:020}").into_bytes()
}

fn store(dir: &Path, sync: bool, options: StoreOptions) -> Store<LmdbBackend> {
    let backend = keel_benches::lmdb::backend(dir, MAP_SIZE as u64, sync);
    Store::open(backend, options).expect("open store")
}

/// Options under which only `force_commit` commits: the benchmark decides the batches.
fn manual_batches() -> StoreOptions {
    StoreOptions {
        batch_interval: Duration::from_secs(3600),
        batch_limit: 1_000_000,
        ..StoreOptions::default()
    }
}

fn put_throughput(c: &mut Criterion) {
    for sync in [true, false] {
        let label = if sync { "fsync" } else { "no fsync" };
        // Both sides open LMDB the way a store opens it by default (`write_map` off).
        let (ours, raw) = put_pair(c, label, sync, false);
        RECORDER.ratio(
            &format!("mvcc put throughput vs raw heed, batches of 1000 ({label})"),
            &ours,
            &raw,
            Better::Faster,
            Some(0.7),
        );
    }
    put_interleaved();
    // The other environment mode, both sides writing through the map: for reference.
    for sync in [true, false] {
        let label = if sync { "fsync" } else { "no fsync" };
        let (ours, raw) = put_pair(c, &format!("{label}, write_map"), sync, true);
        let (default_ours, default_raw) = (
            format!("keel put, {label}"),
            format!("raw heed put, {label}"),
        );
        if let (Some(o), Some(r), Some(od), Some(rd)) = (
            RECORDER.median(&ours),
            RECORDER.median(&raw),
            RECORDER.median(&default_ours),
            RECORDER.median(&default_raw),
        ) {
            println!(
                "REPORT mvcc put with write_map on both sides ({label}): keel {:.1} us, raw heed {:.1} us per 1000 puts + commit, throughput ratio {:.3}x (write_map off: keel {:.1} us, raw heed {:.1} us)",
                o * 1e6,
                r * 1e6,
                r / o,
                od * 1e6,
                rd * 1e6
            );
        }
    }
}

/// The put comparison again, batches of keel and raw heed alternating (which goes first
/// alternates too), so both meet the same load on a shared machine, where criterion's groups
/// run one side after the other: medians over 300 batches each (`KEEL_PUT_ROUNDS` sets how
/// many: criterion's own runs reach millions of keys per side), as a REPORT.
fn put_interleaved() {
    const BATCH: u64 = 1_000;
    let rounds = if smoke() {
        4
    } else {
        std::env::var("KEEL_PUT_ROUNDS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(300)
    };
    let value = [7u8; 150];
    for sync in [true, false] {
        let label = if sync { "fsync" } else { "no fsync" };
        let lmdb = keel_benches::lmdb::options(MAP_SIZE as u64, sync);
        let (dir, raw_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let s = Store::open(
            keel_benches::lmdb::backend_with(dir.path(), &lmdb),
            manual_batches(),
        )
        .expect("open store");
        let reference = keel_benches::lmdb::raw_with(raw_dir.path(), &lmdb);
        let (env, db) = (reference.env.clone(), reference.db);
        let (mut next_ours, mut next_raw) = (0u64, 0u64);
        let (o, r) = interleaved(
            rounds,
            || {
                for _ in 0..BATCH {
                    s.put(&key(next_ours), &value, 0).expect("put");
                    next_ours += 1;
                }
                s.force_commit().expect("commit");
            },
            || {
                let mut wtxn = env.write_txn().expect("write txn");
                for _ in 0..BATCH {
                    db.put(&mut wtxn, &key(next_raw), &value).expect("put");
                    next_raw += 1;
                }
                wtxn.commit().expect("commit");
            },
        );
        println!(
            "REPORT mvcc put, keel and raw heed batches interleaved ({label}): throughput ratio {:.3}x  [keel median {o:.1} us, raw heed median {r:.1} us per 1000 puts + commit, {rounds} batches each] (goal >= 0.70x: {})",
            r / o,
            if r / o >= 0.7 { "met" } else { "NOT met" }
        );
    }
}

/// Runs `ours` and `raw` `rounds` times each, alternating (which goes first alternates too),
/// so both meet the same load on a shared machine; returns the median time of each in µs.
fn interleaved(rounds: usize, mut ours: impl FnMut(), mut raw: impl FnMut()) -> (f64, f64) {
    let mut times = [Vec::with_capacity(rounds), Vec::with_capacity(rounds)];
    for round in 0..rounds {
        for side in [round % 2, 1 - round % 2] {
            let t0 = Instant::now();
            if side == 0 {
                ours()
            } else {
                raw()
            }
            times[side].push(t0.elapsed());
        }
    }
    let [o, r] = times.map(|mut v| {
        v.sort_unstable();
        v[v.len() / 2].as_secs_f64() * 1e6
    });
    (o, r)
}

/// One put comparison (1 000 puts then the commit, keel against raw heed in the same
/// environment mode); returns the two recorder names.
fn put_pair(c: &mut Criterion, label: &str, sync: bool, write_map: bool) -> (String, String) {
    const BATCH: u64 = 1_000;
    let value = [7u8; 150];
    let lmdb = keel_benches::lmdb::options_with_write_map(MAP_SIZE as u64, sync, write_map);
    let mut group = c.benchmark_group(format!("mvcc/put 1000 + commit, {label}"));
    group
        .throughput(Throughput::Elements(BATCH))
        .sample_size(20)
        .measurement_time(Duration::from_secs(5));
    let ours = format!("keel put, {label}");
    let raw = format!("raw heed put, {label}");

    let dir = tempfile::tempdir().unwrap();
    let backend = keel_benches::lmdb::backend_with(dir.path(), &lmdb);
    let s = Store::open(backend, manual_batches()).expect("open store");
    let mut next = 0u64;
    group.bench_function("keel", |b| {
        RECORDER.iter(b, &ours, |_| {
            for _ in 0..BATCH {
                s.put(&key(next), &value, 0).expect("put");
                next += 1;
            }
            s.force_commit().expect("commit");
        })
    });
    drop(s);

    let dir = tempfile::tempdir().unwrap();
    let reference = keel_benches::lmdb::raw_with(dir.path(), &lmdb);
    let (env, db) = (reference.env.clone(), reference.db);
    let mut next = 0u64;
    group.bench_function("raw heed", |b| {
        RECORDER.iter(b, &raw, |_| {
            let mut wtxn = env.write_txn().expect("write txn");
            for _ in 0..BATCH {
                db.put(&mut wtxn, &key(next), &value).expect("put");
                next += 1;
            }
            wtxn.commit().expect("commit");
        })
    });
    group.finish();
    (ours, raw)
}

/// CPU time this thread has used (user + system), from `/proc/thread-self/stat`, in clock
/// ticks of 10 ms; `None` where that file is missing.
fn thread_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let (utime, stime): (u64, u64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    Some(Duration::from_millis((utime + stime) * 10))
}

/// Nanoseconds this thread has run on a CPU, from `/proc/thread-self/schedstat` (0 where it
/// is missing).
fn thread_ns() -> u64 {
    sched_self()[0]
}

/// CPU time (ns on CPU, from `/proc/self/task/*/schedstat`) of this process's threads by
/// thread name, summed over threads of the same name; empty where those files are missing.
fn threads_cpu() -> std::collections::BTreeMap<String, u64> {
    sched_all()
        .into_iter()
        .map(|(name, [ns, ..])| (name, ns))
        .collect()
}

/// CPU per `per` units, in µs, of each thread name between two [`threads_cpu`] readings.
fn cpu_split(
    before: &std::collections::BTreeMap<String, u64>,
    after: &std::collections::BTreeMap<String, u64>,
    per: f64,
) -> String {
    after
        .iter()
        .map(|(name, ns)| {
            let used = ns.saturating_sub(before.get(name).copied().unwrap_or(0));
            format!("{name} {:.2}", used as f64 / 1e3 / per.max(1.0))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn p99(lat: &mut [Duration]) -> Duration {
    if lat.is_empty() {
        return Duration::ZERO;
    }
    lat.sort_unstable();
    lat[(lat.len() * 99 / 100).min(lat.len() - 1)]
}

fn headline(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(store(dir.path(), true, headline_options()));
    headline_clients_on(c, "lmdb", &s);
    headline_on(c, "lmdb", &s);
    drop(s);
    drop(dir);
    headline_raw_reference();
    #[cfg(feature = "backend-file")]
    {
        let dir = tempfile::tempdir().unwrap();
        let backend = keel_backend_file::FileBackend::open(
            dir.path(),
            &keel_backend_file::FileOptions::default(),
        )
        .expect("open file backend");
        let s = Arc::new(Store::open(backend, headline_options()).expect("open store"));
        headline_clients_on(c, "file", &s);
        headline_on(c, "file", &s);
    }
}

/// The headline's key space: 100 000 keys (2 000 in the smoke run).
fn headline_keys() -> u64 {
    if smoke() { 2_000 } else { 100_000 }
}

/// Loads the headline's key space (1 KiB values) into `s` unless it is there already.
fn headline_load<B: Backend>(s: &Store<B>) {
    let keys = headline_keys();
    if s.key_count() as u64 >= keys {
        return;
    }
    let value = vec![3u8; 1024];
    for chunk in (0..keys).collect::<Vec<_>>().chunks(5_000) {
        let mut t = s.write();
        for &i in chunk {
            t.put(&key(i), &value, 0).expect("load");
        }
        t.commit().expect("commit");
        s.force_commit().expect("commit");
    }
}

/// What the headline's reader did: the full scans it finished, and how long each took.
#[derive(Default)]
struct Scans {
    done: AtomicU64,
    took: std::sync::Mutex<Vec<Duration>>,
}

impl Scans {
    /// The median time a full scan took, over every scan so far.
    fn median(&self) -> Duration {
        let mut took = self.took.lock().expect("scan times").clone();
        took.sort_unstable();
        took.get(took.len() / 2).copied().unwrap_or_default()
    }

    fn count(&self) -> usize {
        self.took.lock().expect("scan times").len()
    }
}

/// Starts the headline's reader: a thread named "reader" that scans every key back to back,
/// each scan through one read view, until `stop` (a scan under way when it stops finishes);
/// counts finished scans and their times in `scans`. Returns once the first view is open.
/// `KEEL_PROFILE_SCAN=count` or `keys` makes the scans count-only or keys-only (for the
/// profiles; the headline leaves it unset).
fn spawn_scanner<B: Backend + 'static>(
    s: &Arc<Store<B>>,
    stop: &Arc<AtomicBool>,
    scans: &Arc<Scans>,
) -> std::thread::JoinHandle<()> {
    let keys = headline_keys();
    let started = Arc::new(AtomicBool::new(false));
    let (s, stop, scans, started2) = (s.clone(), stop.clone(), scans.clone(), started.clone());
    let reader = std::thread::Builder::new()
        .name("reader".to_owned())
        .spawn(move || {
            let scan = std::env::var("KEEL_PROFILE_SCAN").unwrap_or_default();
            let mut req = RangeRequest::range(b"key-".to_vec(), vec![0]);
            req.count_only = scan == "count";
            req.keys_only = scan == "keys";
            while !stop.load(Ordering::Acquire) {
                let began = Instant::now();
                let view = s.read().expect("view");
                started2.store(true, Ordering::Release);
                let r = view.range(&req).expect("scan");
                assert_eq!(r.count as u64, keys);
                if !req.count_only {
                    assert_eq!(r.kvs.len() as u64, keys, "the scan reads every pair");
                }
                black_box(r);
                scans.took.lock().expect("scan times").push(began.elapsed());
                scans.done.fetch_add(1, Ordering::Relaxed);
            }
        })
        .expect("spawn reader");
    while !started.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(1));
    }
    reader
}

/// Client threads of the durable headline (etcd's own measurement of the change ran 10).
const HEADLINE_CLIENTS: u64 = 16;

/// Durable puts per chunk of a durable headline half: 100 per client (10 in the smoke run).
fn client_chunk() -> u64 {
    HEADLINE_CLIENTS * if smoke() { 10 } else { 100 }
}

/// Puts per chunk of an in-memory headline half: 10 000 (1 000 in the smoke run).
fn memory_chunk() -> u64 {
    if smoke() { 1_000 } else { 10_000 }
}

/// `n` durable puts from [`HEADLINE_CLIENTS`] closed-loop clients on `s`: each client puts
/// (keys from `next`) and calls `force_commit` before its next put. Returns the time they
/// took and every put's latency (put and commit).
fn client_puts<B: Backend>(
    s: &Store<B>,
    n: u64,
    next: &AtomicU64,
    value: &[u8],
) -> (Duration, Vec<Duration>) {
    let keys = headline_keys();
    let start = Instant::now();
    let per_client: Vec<Vec<Duration>> = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..HEADLINE_CLIENTS)
            .map(|client| {
                let n = n / HEADLINE_CLIENTS + u64::from(client < n % HEADLINE_CLIENTS);
                scope.spawn(move || {
                    let mut lat = Vec::with_capacity(n as usize);
                    for _ in 0..n {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let k = key(i.wrapping_mul(7919) % keys);
                        let t0 = Instant::now();
                        s.put(&k, value, 0).expect("put");
                        s.force_commit().expect("commit");
                        lat.push(t0.elapsed());
                    }
                    lat
                })
            })
            .collect();
        clients
            .into_iter()
            .map(|c| c.join().expect("client"))
            .collect()
    });
    (start.elapsed(), per_client.into_iter().flatten().collect())
}

/// How long each half of a headline sample runs at least: 0.3 s, and two and a half of the
/// reader's full scans at the median of those so far (scans take longer beside busier
/// writers), so the puts measured with the reader meet every phase of a scan (the key index,
/// the write buffers, the backend) and not only the start of a fresh one. None in the smoke
/// run.
fn half_time(scans: &Scans) -> Duration {
    if smoke() {
        Duration::ZERO
    } else {
        (scans.median() * 5 / 2).max(Duration::from_millis(300))
    }
}

/// The measurement time criterion is given for a headline group's ten samples. A sample's
/// length is set by [`half_time`], not by its iteration count, so criterion cannot plan it:
/// this is about what ten samples take here (a group whose reader scans slowly takes up to
/// about 40 s, and criterion then warns that its samples overran).
const HEADLINE_TIME: Duration = Duration::from_secs(30);

/// Compacts `s` at its current revision and waits until the superseded revisions are deleted
/// from the backend: between two headline samples, outside their timed halves, so the store
/// keeps to about its key space's size over however many puts the run makes (millions, at an
/// in-memory writer's rate), as etcd keeps a busy store with its periodic compaction.
fn compact_untimed<B: Backend>(s: &Store<B>) {
    let at = s.current_revision();
    if at <= s.compacted_revision() {
        return;
    }
    s.compact(at).expect("compact");
    while s.physically_compacted_revision() < at {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Options of the headline's stores: the defaults, with compaction deleting in batches of
/// 100 000 and pausing 1 ms between them. Compactions run only between samples, with nothing
/// else running (see [`compact_untimed`]): nothing measured meets them.
fn headline_options() -> StoreOptions {
    StoreOptions {
        compaction_batch_limit: 100_000,
        compaction_sleep_interval: Duration::from_millis(1),
        ..StoreOptions::default()
    }
}

/// A headline comparison as one criterion benchmark in `group`. Each sample runs its puts
/// in three stretches, outer-inner-outer: a quarter, a half and a quarter of the sample
/// (the inner half at least [`half_time`], each quarter at least half that). Alone is outer
/// and the reader inner in one sample, the other way round in the next. The reader scans
/// every key back to back, started before each of its stretches and stopped after it. Puts
/// slow down as the store gathers history between the samples' compactions (on the file
/// backend here, the second half of a sample ran a quarter to a third slower than the
/// first); outer-inner-outer gives both kinds the same mean place in the sample, so a steady
/// drift cancels within each sample instead of favouring whichever half came first.
/// `chunk(with_reader)` runs one chunk of puts and returns the time they took and how many
/// they were; a stretch runs chunks until it is long enough. The sample's time is each
/// kind's mean time per put times half the sample's iterations, and each kind is recorded
/// once per sample under `names[with_reader]`. Adds the scans finished and the time
/// measured with the reader to `window`, and prints each sample's own ratio at the end.
fn bench_alternating<B: Backend + 'static>(
    group: &mut BenchmarkGroup<'_, WallTime>,
    s: &Arc<Store<B>>,
    scans: &Arc<Scans>,
    window: &mut (u64, Duration),
    names: [&str; 2],
    mut chunk: impl FnMut(bool) -> (Duration, u64),
) {
    let mut sample = 0u64;
    // Each sample's own throughput ratio (with the reader / alone), warm-up samples included.
    let mut paired = Vec::new();
    group.bench_function("alone and with a long reader, alternating", |b| {
        b.iter_custom(|iters| {
            sample += 1;
            let n = (iters / 2).max(1);
            let outer = sample.is_multiple_of(2);
            let least = half_time(scans);
            // Time and puts of each kind, alone and with the reader.
            let mut kinds = [(Duration::ZERO, 0u64); 2];
            for (with_reader, least) in [(outer, least / 2), (!outer, least), (outer, least / 2)] {
                let stop = Arc::new(AtomicBool::new(false));
                let reader = with_reader.then(|| spawn_scanner(s, &stop, scans));
                let scans_before = scans.done.load(Ordering::Relaxed);
                let (mut took, mut puts) = (Duration::ZERO, 0u64);
                while puts == 0 || took < least {
                    let (t, p) = chunk(with_reader);
                    took += t;
                    puts += p;
                }
                if with_reader {
                    window.0 += scans.done.load(Ordering::Relaxed) - scans_before;
                    window.1 += took;
                }
                stop.store(true, Ordering::Release);
                if let Some(r) = reader {
                    r.join().expect("reader");
                }
                let kind = &mut kinds[usize::from(with_reader)];
                kind.0 += took;
                kind.1 += puts;
            }
            let mut total = Duration::ZERO;
            let mut per_put = [0.0f64; 2];
            for (with_reader, (took, puts)) in kinds.into_iter().enumerate() {
                RECORDER.record(names[with_reader], took, puts);
                per_put[with_reader] = took.as_secs_f64() / puts as f64;
                total += took.mul_f64(n as f64 / puts as f64);
            }
            paired.push(per_put[0] / per_put[1].max(1e-12));
            compact_untimed(s);
            total
        })
    });
    if paired.is_empty() {
        return;
    }
    let each: Vec<String> = paired.iter().map(|r| format!("{r:.3}")).collect();
    paired.sort_by(f64::total_cmp);
    println!(
        "REPORT {}: per-sample throughput ratio with the reader vs alone (both kinds of one sample): median {:.3}x, min {:.3}x, max {:.3}x; in sample order: {}",
        names[1],
        paired[paired.len() / 2],
        paired[0],
        paired[paired.len() - 1],
        each.join(" ")
    );
}

/// The headline as etcd measures it: closed-loop clients, each put durable before its
/// client sends the next one (see [`client_puts`]), alone and with the reader scanning all
/// keys back to back. Every criterion sample runs puts alone and with the reader (started
/// before that half and running through it), the two halves in alternating order, so both
/// meet the same disk on a shared machine (see [`bench_alternating`]). The goal figures:
/// throughput and p99 latency of these puts with the reader against without it.
fn headline_clients_on<B: Backend + 'static>(c: &mut Criterion, label: &str, s: &Arc<Store<B>>) {
    headline_load(s);
    let value = vec![3u8; 1024];
    let next = AtomicU64::new(0);
    let mut group = c.benchmark_group(format!(
        "mvcc/etcd 3.4 headline ({label}): durable puts from {HEADLINE_CLIENTS} clients, 100k keys of 1 KiB"
    ));
    group
        .throughput(Throughput::Elements(1))
        .sample_size(10)
        .measurement_time(HEADLINE_TIME);
    let alone = format!("durable client puts alone ({label})");
    let with = format!("durable client puts with a long reader ({label})");
    let mut latencies = [Vec::new(), Vec::new()];
    let scans = Arc::new(Scans::default());
    let mut window = (0, Duration::ZERO);
    let names = [alone.as_str(), with.as_str()];
    bench_alternating(&mut group, s, &scans, &mut window, names, |with_reader| {
        let (took, lat) = client_puts(s, client_chunk(), &next, &value);
        latencies[usize::from(with_reader)].extend(lat);
        (took, client_chunk())
    });
    group.finish();
    RECORDER.ratio(
        &format!(
            "etcd 3.4 headline ({label}): durable put throughput of {HEADLINE_CLIENTS} clients with a concurrent full scan vs without"
        ),
        &with,
        &alone,
        Better::Faster,
        Some(0.9),
    );
    let [lat_alone, lat_reader] = &mut latencies;
    if lat_alone.is_empty() || lat_reader.is_empty() {
        // A benchmark filter left this group out: nothing was measured.
        return;
    }
    headline_p99(
        &format!("({label}): p99 durable put latency of {HEADLINE_CLIENTS} clients"),
        lat_alone,
        lat_reader,
        window,
        &scans,
    );
}

/// Prints the headline's p99 put latency with the reader against without it (goal ≤ 1.5×);
/// `window_scans` full scans finished in the `window` measured with the reader, and what
/// `scans` took (each began while the writers ran; the last of each half ended after them).
fn headline_p99(
    what: &str,
    alone: &mut [Duration],
    with_reader: &mut [Duration],
    (window_scans, window): (u64, Duration),
    scans: &Scans,
) {
    let (a, r) = (p99(alone), p99(with_reader));
    let ratio = r.as_secs_f64() / a.as_secs_f64().max(1e-9);
    println!(
        "RATIO etcd 3.4 headline {what} with a concurrent full scan vs without: time ratio {ratio:.3}x  [with reader: p99 {:.1} us over {} puts, alone: p99 {:.1} us over {} puts; {window_scans} full scans of {} keys completed during the {:.1} s measured with the reader, each scan {:.0} ms at the median of {}] (goal <= 1.50x: {})",
        r.as_secs_f64() * 1e6,
        with_reader.len(),
        a.as_secs_f64() * 1e6,
        alone.len(),
        headline_keys(),
        window.as_secs_f64(),
        scans.median().as_secs_f64() * 1e3,
        scans.count(),
        if ratio <= 1.5 { "met" } else { "NOT met" }
    );
}

/// The headline's machine reference, no keel involved: raw heed's own put throughput over the
/// same data (100 000 keys of 1 KiB, the same key sequence, write transactions of 10 000 puts,
/// etcd's batch limit, each committed with fsync) alone and with a thread scanning all keys
/// back to back through raw heed read transactions (copying every pair out, as a range
/// does), printed as a REPORT: how much a full-scan reader costs a writer on this machine's
/// cores and disk by itself.
fn headline_raw_reference() {
    const TXN_PUTS: u64 = 10_000;
    if RECORDER.median("puts alone (lmdb)").is_none() {
        // A criterion filter left the keel headline out: nothing to set this beside.
        return;
    }
    let keys = headline_keys();
    let run_for = if smoke() {
        Duration::from_millis(300)
    } else {
        Duration::from_secs(4)
    };
    let value = vec![3u8; 1024];
    let dir = tempfile::tempdir().unwrap();
    let reference = keel_benches::lmdb::raw(dir.path(), MAP_SIZE as u64, true);
    let (env, db) = (reference.env.clone(), reference.db);
    for chunk in (0..keys).collect::<Vec<_>>().chunks(5_000) {
        let mut wtxn = env.write_txn().expect("write txn");
        for &i in chunk {
            db.put(&mut wtxn, &key(i), &value).expect("load");
        }
        wtxn.commit().expect("commit");
    }
    let mut next = 0u64;
    let mut rates = [0.0f64; 2];
    let mut window_scans = 0;
    for with_reader in [false, true] {
        let stop = Arc::new(AtomicBool::new(false));
        let started = Arc::new(AtomicBool::new(false));
        let scans = Arc::new(AtomicU64::new(0));
        let reader = with_reader.then(|| {
            let (env, stop, started, scans) =
                (env.clone(), stop.clone(), started.clone(), scans.clone());
            std::thread::Builder::new()
                .name("raw-reader".to_owned())
                .spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        let txn = env.clone().static_read_txn().expect("read txn");
                        started.store(true, Ordering::Release);
                        let mut out = Vec::with_capacity(keys as usize);
                        for item in db.iter(&txn).expect("scan") {
                            let (k, v) = item.expect("pair");
                            out.push((k.to_vec(), v.to_vec()));
                        }
                        assert_eq!(out.len() as u64, keys, "the scan reads every pair");
                        black_box(out);
                        scans.fetch_add(1, Ordering::Relaxed);
                    }
                })
                .expect("spawn raw reader")
        });
        while with_reader && !started.load(Ordering::Acquire) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let scans_before = scans.load(Ordering::Relaxed);
        let start = Instant::now();
        let mut puts = 0u64;
        while start.elapsed() < run_for {
            let mut wtxn = env.write_txn().expect("write txn");
            for _ in 0..TXN_PUTS {
                db.put(&mut wtxn, &key(next.wrapping_mul(7919) % keys), &value)
                    .expect("put");
                next += 1;
            }
            wtxn.commit().expect("commit");
            puts += TXN_PUTS;
        }
        rates[usize::from(with_reader)] = puts as f64 / start.elapsed().as_secs_f64();
        if with_reader {
            window_scans = scans.load(Ordering::Relaxed) - scans_before;
        }
        stop.store(true, Ordering::Release);
        if let Some(r) = reader {
            r.join().expect("raw reader");
        }
    }
    let keel = |name: &str| RECORDER.median(name).map_or(0.0, |s| 1.0 / s.max(1e-12));
    println!(
        "REPORT etcd 3.4 headline reference (raw heed, no keel, this machine): put throughput with a concurrent raw full scan vs without: {:.3}x  [with the reader {:.0} puts/s ({window_scans} full scans of {keys} keys in {:.1} s), alone {:.0} puts/s; write transactions of {TXN_PUTS} puts committed with fsync, 1 KiB values; keel on lmdb in this run: {:.0} puts/s with its reader, {:.0} alone]",
        rates[1] / rates[0].max(1e-9),
        rates[1],
        run_for.as_secs_f64(),
        rates[0],
        keel("puts with a long reader (lmdb)"),
        keel("puts alone (lmdb)"),
    );
}

/// The in-memory headline's writer: `n` puts of `value` back to back, to keys of the
/// headline's key space from `next` on (advanced past them), each put's latency pushed to
/// `lat`; returns the time they took.
fn timed_puts<B: Backend>(
    s: &Store<B>,
    n: u64,
    next: &mut u64,
    value: &[u8],
    lat: &mut Vec<Duration>,
) -> Duration {
    let keys = headline_keys();
    let start = Instant::now();
    for _ in 0..n {
        let t0 = Instant::now();
        s.put(&key(next.wrapping_mul(7919) % keys), value, 0)
            .expect("put");
        lat.push(t0.elapsed());
        *next += 1;
    }
    start.elapsed()
}

/// The headline comparison on one backend (`label`): the same puts alone, then with a reader
/// that scans all keys back to back for the whole measured window.
fn headline_on<B: Backend + 'static>(c: &mut Criterion, label: &str, s: &Arc<Store<B>>) {
    headline_load(s);
    let value = vec![3u8; 1024];
    let scans = Arc::new(Scans::default());
    let mut group = c.benchmark_group(format!(
        "mvcc/etcd 3.4 headline ({label}): puts, 100k keys of 1 KiB"
    ));
    group
        .throughput(Throughput::Elements(1))
        .sample_size(10)
        .measurement_time(HEADLINE_TIME);
    let mut latencies = [Vec::new(), Vec::new()];
    let mut next = 0u64;
    let alone = format!("puts alone ({label})");
    let with = format!("puts with a long reader ({label})");
    let mut window = (0, Duration::ZERO);
    // Writer CPU in the timed loops, with and without the reader: equal figures mean the
    // reader costs the writer CPU time (cores), not waiting.
    let mut writer_ns = [0u64; 2];
    // Every other thread's CPU, summed over each phase's halves.
    let mut threads: [std::collections::BTreeMap<String, u64>; 2] = Default::default();
    let me = std::thread::current().name().map(str::to_owned);
    let names = [alone.as_str(), with.as_str()];
    bench_alternating(&mut group, s, &scans, &mut window, names, |with_reader| {
        let half = memory_chunk();
        let phase = usize::from(with_reader);
        let threads0 = threads_cpu();
        let ns0 = thread_ns();
        let took = timed_puts(s, half, &mut next, &value, &mut latencies[phase]);
        writer_ns[phase] += thread_ns().saturating_sub(ns0);
        for (name, ns) in threads_cpu() {
            let used = ns.saturating_sub(threads0.get(&name).copied().unwrap_or(0));
            *threads[phase].entry(name).or_insert(0) += used;
        }
        (took, half)
    });
    group.finish();
    let puts = latencies.each_ref().map(|l| l.len().max(1) as f64);
    let cpu_per_put = [0, 1].map(|phase| writer_ns[phase] as f64 / 1e3 / puts[phase]);
    let split = [0, 1].map(|phase| {
        let mut used = threads[phase].clone();
        // The writer (this thread) is reported above, from its timed loops only.
        if let Some(me) = &me {
            used.remove(me);
        }
        let reader_ns = used.remove("reader").unwrap_or(0);
        used.retain(|name, _| !name.starts_with("mvcc-"));
        let mut line = cpu_split(&Default::default(), &used, puts[phase]);
        if phase == 1 {
            line.push_str(&format!(
                "; reader on a CPU {:.0}% of the time measured with it",
                reader_ns as f64 / 1e7 / window.1.as_secs_f64().max(1e-9)
            ));
        }
        line
    });
    let [lat_alone, lat_reader] = &mut latencies;
    if lat_alone.is_empty() || lat_reader.is_empty() {
        // A benchmark filter left this group out: nothing was measured.
        return;
    }
    // Alone, the writer and the committer keep most of both cores of a 2-core machine busy;
    // the reader keeps to its paced share (see the module doc).
    RECORDER.ratio(
        &format!(
            "etcd 3.4 headline ({label}), one writer applying puts in memory back to back: put throughput with a concurrent full scan vs without"
        ),
        &with,
        &alone,
        Better::Faster,
        Some(0.9),
    );
    headline_p99(
        &format!("({label}), one writer applying puts in memory back to back: p99 put latency"),
        lat_alone,
        lat_reader,
        window,
        &scans,
    );
    println!(
        "REPORT etcd 3.4 headline ({label}): writer thread CPU per put (timed loops only): {:.2} us alone, {:.2} us with the reader",
        cpu_per_put[0], cpu_per_put[1]
    );
    println!(
        "REPORT etcd 3.4 headline ({label}): CPU per put in us by background thread (schedstat), alone: {}; with the reader: {}",
        split[0], split[1]
    );
}

fn range_10k(c: &mut Criterion) {
    const N: u64 = 10_000;
    let value = [5u8; 150];
    let dir = tempfile::tempdir().unwrap();
    let s = store(dir.path(), false, manual_batches());
    let mut t = s.write();
    for i in 0..N {
        t.put(&key(i), &value, 0).expect("put");
    }
    t.commit().expect("commit");
    s.force_commit().expect("commit");
    let raw_dir = tempfile::tempdir().unwrap();
    let reference = keel_benches::lmdb::raw(raw_dir.path(), MAP_SIZE as u64, false);
    let (env, db) = (reference.env.clone(), reference.db);
    let mut wtxn = env.write_txn().expect("write txn");
    for i in 0..N {
        db.put(&mut wtxn, &key(i), &value).expect("put");
    }
    wtxn.commit().expect("commit");

    let mut group = c.benchmark_group("mvcc/range 10k keys");
    group
        .throughput(Throughput::Elements(N))
        .sample_size(30)
        .measurement_time(Duration::from_secs(4));
    let req = RangeRequest::range(b"key-".to_vec(), vec![0]);
    let ours = || {
        let r = s.range(&req).expect("range");
        assert_eq!(r.kvs.len() as u64, N);
        black_box(r);
    };
    let raw = || {
        let txn = env.clone().static_read_txn().expect("read txn");
        let bounds: (Bound<&[u8]>, Bound<&[u8]>) = (Bound::Unbounded, Bound::Unbounded);
        let mut out = Vec::new();
        for item in db.range(&txn, &bounds).expect("range") {
            let (k, v) = item.expect("item");
            out.push((k.to_vec(), v.to_vec()));
        }
        assert_eq!(out.len() as u64, N);
        black_box(out);
    };
    group.bench_function("keel", |b| RECORDER.iter(b, "keel range", |_| ours()));
    group.bench_function("raw heed", |b| {
        RECORDER.iter(b, "raw heed cursor", |_| raw())
    });
    group.finish();
    RECORDER.ratio(
        "mvcc range of 10k keys vs raw heed cursor (both copy the pairs out)",
        "keel range",
        "raw heed cursor",
        Better::LowerTime,
        Some(1.5),
    );
    // The same pair alternating range by range (which side goes first alternates too), so
    // both meet the same load on a shared machine, where criterion's groups run one side
    // after the other.
    let rounds = if smoke() { 4 } else { 400 };
    let (o, r) = interleaved(rounds, ours, raw);
    println!(
        "REPORT mvcc range of 10k keys vs raw heed cursor, ranges interleaved: time ratio {:.3}x  [keel median {o:.1} us, raw heed median {r:.1} us, {rounds} ranges each] (goal <= 1.50x: {})",
        o / r,
        if o / r <= 1.5 { "met" } else { "NOT met" }
    );
}

fn rss_anon() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Child role: open the store at `path` (rebuilding its index) and print the memory it took.
fn index_child(path: &str) {
    let backend = keel_benches::lmdb::backend(Path::new(path), MAP_SIZE as u64, true);
    let before = rss_anon();
    let s = Store::open(backend, StoreOptions::default()).expect("open store");
    let after = rss_anon();
    println!("INDEX {} {}", s.key_count(), after.saturating_sub(before));
}

fn index_memory() {
    let keys: u64 = if smoke() { 10_000 } else { 1_000_000 };
    let dir = tempfile::tempdir().unwrap();
    {
        let s = store(dir.path(), false, manual_batches());
        for chunk in (0..keys).collect::<Vec<_>>().chunks(50_000) {
            let mut t = s.write();
            for &i in chunk {
                t.put(&key(i), b"v", 0).expect("put");
            }
            t.commit().expect("commit");
            s.force_commit().expect("commit");
        }
    }
    let out = std::process::Command::new(std::env::current_exe().expect("exe"))
        .env(INDEX_CHILD_ENV, dir.path())
        .output()
        .expect("run child");
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(line) = text.lines().find(|l| l.starts_with("INDEX ")) else {
        println!(
            "index memory: child failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    };
    let parts: Vec<u64> = line[6..]
        .split(' ')
        .filter_map(|p| p.parse().ok())
        .collect();
    let (n, bytes) = (parts[0], parts[1]);
    let per_key = bytes as f64 / n as f64;
    let key_len = key(0).len() as f64;
    println!(
        "REPORT index memory: {n} keys, {bytes} bytes of anonymous memory added by the rebuild = {per_key:.1} B per key, {:.1} B over the {key_len} key bytes (aim <= 128 B: {})",
        per_key - key_len,
        if per_key - key_len <= 128.0 {
            "met"
        } else {
            "NOT met"
        }
    );
}

fn fan_out() {
    let (watchers, puts): (u64, u64) = if smoke() {
        (200, 2_000)
    } else {
        (10_000, 100_000)
    };
    let value = [1u8; 150];
    // Keys are formatted before the clock starts: only the puts are timed.
    let keys: Vec<Vec<u8>> = (0..watchers).map(key).collect();
    let byte_sum = |b: &[u8]| b.iter().map(|&x| u64::from(x)).sum::<u64>();
    // What the consumers' byte sums over every key and value add up to.
    let expected_sum: u64 = (0..puts)
        .map(|i| byte_sum(&keys[(i % watchers) as usize]) + byte_sum(&value))
        .sum();
    let rounds = if smoke() { 1 } else { 3 };
    let mut delivered_rates = Vec::new();
    // Writer CPU µs per put: [without watchers, with].
    let mut writer_cpu: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    // CPU µs per put of the whole process (writer, committer, consumers, catch-up), from the
    // first put until the puts are done and (with watchers) every event was consumed.
    let mut process_cpu: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    // CPU µs per put by thread name (schedstat), over the same span: [without, with].
    let mut thread_cpu: [std::collections::BTreeMap<String, Vec<f64>>; 2] = Default::default();
    for round in 0..rounds {
        for with_watchers in [false, true] {
            let dir = tempfile::tempdir().unwrap();
            let s = Arc::new(store(dir.path(), false, StoreOptions::default()));
            let delivered = Arc::new(AtomicU64::new(0));
            let checksum = Arc::new(AtomicU64::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            let mut consumers = Vec::new();
            // `KEEL_FANOUT_LATE_CONSUMERS=1` starts draining only after the puts, to separate
            // the writer's cost from the consumers' CPU.
            let late = std::env::var("KEEL_FANOUT_LATE_CONSUMERS").is_ok();
            // Watchers go to two watch streams (one per consumer thread), as etcd's watch
            // streams multiplex many watchers: consumers block on one wake-up each.
            let mut parked = Vec::new();
            if with_watchers {
                for part in 0..2u64 {
                    // A stream channel sized for bursts (etcd's gRPC stream buffers too);
                    // past it, watchers fall behind and are caught up from the store.
                    let mut stream = s.watch_stream_with_capacity(16_384);
                    for i in (0..watchers).filter(|i| i % 2 == part) {
                        stream.watch(WatchRequest::key(key(i))).expect("watch");
                    }
                    parked.push(stream);
                }
            }
            let spawn_consumers =
                |all: Vec<keel_mvcc::WatchStream<LmdbBackend>>,
                 consumers: &mut Vec<std::thread::JoinHandle<()>>| {
                    for mut stream in all {
                        let (delivered, checksum, stop) =
                            (delivered.clone(), checksum.clone(), stop.clone());
                        // Named, so a profile tells the consumers from the writer.
                        let consume = move || {
                            loop {
                                match stream.recv_timeout(Duration::from_millis(20)) {
                                    Ok(Some(StreamItem::Events { events, .. })) => {
                                        // Every event's key and value are read (summed
                                        // byte by byte), as a sender encoding them would.
                                        let mut got = read_events(&events);
                                        while let Ok(Some(StreamItem::Events { events, .. })) =
                                            stream.try_recv()
                                        {
                                            got = got.add(read_events(&events));
                                        }
                                        checksum.fetch_add(got.bytes_sum, Ordering::Relaxed);
                                        delivered.fetch_add(got.events, Ordering::Relaxed);
                                        // Drain in batches, as a network sender would: a
                                        // consumer blocking again at once is woken by
                                        // nearly every put.
                                        std::thread::sleep(Duration::from_millis(1));
                                    }
                                    Ok(Some(StreamItem::Ended { id, error })) => {
                                        panic!("watcher {id} ended: {error}")
                                    }
                                    Ok(None) if stop.load(Ordering::Acquire) => return,
                                    Ok(None) => {}
                                    Err(e) => panic!("stream: {e}"),
                                }
                            }
                        };
                        let consumer = std::thread::Builder::new().name("fanout-consumer".into());
                        consumers.push(consumer.spawn(consume).expect("spawn a consumer"));
                    }
                };
            if with_watchers && !late {
                spawn_consumers(std::mem::take(&mut parked), &mut consumers);
            }
            let cpu_before = thread_run_ns();
            let process_before = process_cpu_time();
            let threads_before = sched_all();
            let start = Instant::now();
            for i in 0..puts {
                s.put(&keys[(i % watchers) as usize], &value, 0)
                    .expect("put");
            }
            let put_time = start.elapsed();
            // The writer's own CPU per put: what notifying costs it, whatever else runs on
            // the machine.
            if let (Some(a), Some(b)) = (cpu_before, thread_run_ns()) {
                writer_cpu[usize::from(with_watchers)]
                    .push(b.saturating_sub(a) as f64 / 1e3 / puts as f64);
            }
            let name = if with_watchers {
                "puts with 10k watchers"
            } else {
                "puts without watchers"
            };
            RECORDER.record(name, put_time, puts);
            if !with_watchers && let (Some(a), Some(b)) = (process_before, process_cpu_time()) {
                process_cpu[0].push((b - a).as_secs_f64() * 1e6 / puts as f64);
            }
            let mut note_threads = |with: bool| {
                for (name, after) in sched_all() {
                    let before = threads_before.get(&name).map_or(0, |b| b[0]);
                    thread_cpu[usize::from(with)]
                        .entry(name)
                        .or_default()
                        .push(after[0].saturating_sub(before) as f64 / 1e3 / puts as f64);
                }
            };
            if !with_watchers {
                note_threads(false);
            }
            if with_watchers && late {
                spawn_consumers(std::mem::take(&mut parked), &mut consumers);
            }
            if with_watchers {
                let deadline = Instant::now() + Duration::from_secs(60);
                while delivered.load(Ordering::Relaxed) < puts && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                let all_time = start.elapsed();
                let got = delivered.load(Ordering::Relaxed);
                let rate = got as f64 / all_time.as_secs_f64();
                delivered_rates.push(rate);
                println!(
                    "fan-out round {round}: {got} of {puts} events delivered to {watchers} watchers in {:.3} s ({rate:.0} events/s); puts took {:.3} s",
                    all_time.as_secs_f64(),
                    put_time.as_secs_f64()
                );
                assert_eq!(got, puts, "every event is delivered");
                if let (Some(a), Some(b)) = (process_before, process_cpu_time()) {
                    process_cpu[1].push((b - a).as_secs_f64() * 1e6 / puts as f64);
                }
                note_threads(true);
                assert_eq!(
                    checksum.load(Ordering::Relaxed),
                    expected_sum,
                    "every event's key and value are read"
                );
            }
            stop.store(true, Ordering::Release);
            for c in consumers {
                c.join().expect("consumer");
            }
        }
    }
    delivered_rates.sort_by(f64::total_cmp);
    println!(
        "REPORT watch fan-out: median {:.0} delivered events/s ({watchers} watchers, {puts} puts)",
        delivered_rates[delivered_rates.len() / 2]
    );
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let [without, with] = writer_cpu.map(median);
    if with > 0.0 && without > 0.0 {
        println!(
            "REPORT watch fan-out: writer thread CPU per put, median {with:.3} us with {watchers} watchers, {without:.3} us without (without/with {:.2}x)",
            without / with
        );
    }
    let [without, with] = process_cpu.map(median);
    // Short runs fit in one clock tick: nothing to report.
    if with > 0.0 && without > 0.0 {
        println!(
            "REPORT watch fan-out: process CPU per put, all threads (10 ms ticks), median {with:.2} us with {watchers} watchers (events consumed), {without:.2} us without (without/with {:.2}x)",
            without / with
        );
    }
    let by_thread = |m: &std::collections::BTreeMap<String, Vec<f64>>| {
        m.iter()
            .map(|(name, v)| format!("{name} {:.3}", median(v.clone())))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if !thread_cpu[1].is_empty() {
        println!(
            "REPORT watch fan-out: CPU per put in us by thread (schedstat, medians; the main thread puts), with {watchers} watchers until every event was consumed: {}; without: {}",
            by_thread(&thread_cpu[1]),
            by_thread(&thread_cpu[0])
        );
    }
    RECORDER.ratio(
        "watch fan-out: put throughput with 10k watchers vs without",
        "puts with 10k watchers",
        "puts without watchers",
        Better::Faster,
        Some(0.5),
    );
}

/// Nanoseconds this thread has spent runnable but waiting for a CPU (the second field of
/// `/proc/thread-self/schedstat`; 0 where it is missing).
fn thread_run_delay_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// CPU time this thread has run, in nanoseconds (`/proc/thread-self/schedstat`); `None`
/// where that file is missing.
fn thread_run_ns() -> Option<u64> {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// CPU time of the whole process, every thread including finished ones (user + system),
/// from `/proc/self/stat`, in clock ticks of 10 ms; `None` where that file is missing.
fn process_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let (utime, stime): (u64, u64) = (f.get(11)?.parse().ok()?, f.get(12)?.parse().ok()?);
    Some(Duration::from_millis((utime + stime) * 10))
}

/// What a fan-out consumer read from some events.
#[derive(Clone, Copy, Default)]
struct ReadSum {
    events: u64,
    /// Sum of every key and value byte.
    bytes_sum: u64,
}

impl ReadSum {
    fn add(self, other: ReadSum) -> ReadSum {
        ReadSum {
            events: self.events + other.events,
            bytes_sum: self.bytes_sum.wrapping_add(other.bytes_sum),
        }
    }
}

/// Reads every key and value byte of `events`.
fn read_events(events: &[keel_mvcc::Event]) -> ReadSum {
    let sum = |b: &[u8]| b.iter().map(|&x| u64::from(x)).sum::<u64>();
    let bytes_sum = events
        .iter()
        .map(|e| sum(e.key()) + sum(e.value()))
        .fold(0u64, u64::wrapping_add);
    ReadSum {
        events: events.len() as u64,
        bytes_sum,
    }
}

/// Schedstat of this thread: (ns on CPU, ns runnable waiting for a CPU, timeslices).
fn sched_self() -> [u64; 3] {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let mut f = s.split_whitespace().map(|x| x.parse::<u64>().unwrap_or(0));
    [
        f.next().unwrap_or(0),
        f.next().unwrap_or(0),
        f.next().unwrap_or(0),
    ]
}

/// This thread's migrations between CPUs and its voluntary and involuntary context
/// switches so far, from `/proc/thread-self/sched` (zeros where it is missing).
fn sched_moves() -> [u64; 3] {
    let text = std::fs::read_to_string("/proc/thread-self/sched").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.split(':').next().is_some_and(|k| k.trim() == name))
            .and_then(|l| l.split(':').nth(1)?.trim().parse().ok())
            .unwrap_or(0)
    };
    [
        field("se.nr_migrations"),
        field("nr_voluntary_switches"),
        field("nr_involuntary_switches"),
    ]
}

/// Schedstat of every thread of this process, summed by thread name.
fn sched_all() -> std::collections::BTreeMap<String, [u64; 3]> {
    let mut out = std::collections::BTreeMap::new();
    for task in std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
    {
        let path = task.path();
        let name = std::fs::read_to_string(path.join("comm")).unwrap_or_default();
        let s = std::fs::read_to_string(path.join("schedstat")).unwrap_or_default();
        let mut f = s.split_whitespace().map(|x| x.parse::<u64>().unwrap_or(0));
        let e: &mut [u64; 3] = out.entry(name.trim().to_owned()).or_insert([0; 3]);
        for slot in e.iter_mut() {
            *slot += f.next().unwrap_or(0);
        }
    }
    out
}

fn median_of(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The number in the environment variable `name`, or `default`.
fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `profile-clients`: the durable clients' headline on LMDB, instrumented. `KEEL_PROFILE_ROUNDS`
/// rounds (6) of `KEEL_PROFILE_PUTS` puts (4 000) alone and the same with the reader, in
/// alternating order; per half: throughput, p50/p99, the clients' CPU, time waiting for a
/// CPU and times scheduled per put (schedstat), the put and `force_commit` parts of a put's
/// latency, and the committer thread's and the reader's share; then the medians.
fn profile_clients<B: Backend + 'static>(s: &Arc<Store<B>>) {
    headline_load(s);
    let rounds = env_u64("KEEL_PROFILE_ROUNDS", 6);
    let per_client = env_u64("KEEL_PROFILE_PUTS", 4_000) / HEADLINE_CLIENTS;
    let puts = (per_client * HEADLINE_CLIENTS) as f64;
    let keys = headline_keys();
    let value = vec![3u8; 1024];
    let next = AtomicU64::new(0);
    let scans = Arc::new(Scans::default());
    const NAMES: [&str; 11] = [
        "puts/s",
        "p50 us",
        "p99 us",
        "client cpu us/put",
        "client runq us/put",
        "client slices/put",
        "put us",
        "force_commit us",
        "committer cpu us/put",
        "committer runq us/put",
        "reader cpu share",
    ];
    let mut figures: [Vec<Vec<f64>>; 2] = std::array::from_fn(|_| vec![Vec::new(); NAMES.len()]);
    for round in 0..rounds {
        let first = round % 2 == 0;
        for with_reader in [first, !first] {
            let stop = Arc::new(AtomicBool::new(false));
            let reader = with_reader.then(|| spawn_scanner(s, &stop, &scans));
            let all0 = sched_all();
            let start = Instant::now();
            type Client = ([u64; 3], u64, u64, Vec<Duration>);
            let per: Vec<Client> = std::thread::scope(|scope| {
                let clients: Vec<_> = (0..HEADLINE_CLIENTS)
                    .map(|_| {
                        let (next, value) = (&next, &value);
                        std::thread::Builder::new()
                            .name("client".into())
                            .spawn_scoped(scope, move || {
                                let a = sched_self();
                                let (mut put_ns, mut commit_ns) = (0u64, 0u64);
                                let mut lat = Vec::with_capacity(per_client as usize);
                                for _ in 0..per_client {
                                    let i = next.fetch_add(1, Ordering::Relaxed);
                                    let k = key(i.wrapping_mul(7919) % keys);
                                    let t0 = Instant::now();
                                    s.put(&k, value, 0).expect("put");
                                    let t1 = Instant::now();
                                    s.force_commit().expect("commit");
                                    let t2 = Instant::now();
                                    put_ns += (t1 - t0).as_nanos() as u64;
                                    commit_ns += (t2 - t1).as_nanos() as u64;
                                    lat.push(t2 - t0);
                                }
                                let b = sched_self();
                                (
                                    [b[0] - a[0], b[1] - a[1], b[2] - a[2]],
                                    put_ns,
                                    commit_ns,
                                    lat,
                                )
                            })
                            .expect("spawn client")
                    })
                    .collect();
                clients
                    .into_iter()
                    .map(|c| c.join().expect("client"))
                    .collect()
            });
            let took = start.elapsed();
            let all1 = sched_all();
            stop.store(true, Ordering::Release);
            if let Some(r) = reader {
                r.join().expect("reader");
            }
            let mut lat: Vec<Duration> = per.iter().flat_map(|p| p.3.iter().copied()).collect();
            let p99v = p99(&mut lat).as_secs_f64() * 1e6;
            let p50v = lat[lat.len() / 2].as_secs_f64() * 1e6;
            let mut clients = [0u64; 3];
            let (mut put_ns, mut commit_ns) = (0u64, 0u64);
            for p in &per {
                for (sum, x) in clients.iter_mut().zip(p.0) {
                    *sum += x;
                }
                put_ns += p.1;
                commit_ns += p.2;
            }
            // Thread names are cut to 15 bytes.
            let delta = |name: &str| {
                let a = all0.get(name).copied().unwrap_or([0; 3]);
                let b = all1.get(name).copied().unwrap_or([0; 3]);
                [0, 1, 2].map(|j| b[j].saturating_sub(a[j]) as f64)
            };
            let committer = delta("keel-mvcc-commi");
            let reader = delta("reader");
            let row = [
                puts / took.as_secs_f64(),
                p50v,
                p99v,
                clients[0] as f64 / 1e3 / puts,
                clients[1] as f64 / 1e3 / puts,
                clients[2] as f64 / puts,
                put_ns as f64 / 1e3 / puts,
                commit_ns as f64 / 1e3 / puts,
                committer[0] / 1e3 / puts,
                committer[1] / 1e3 / puts,
                reader[0] / took.as_nanos() as f64,
            ];
            println!(
                "{} round {round}: {}",
                if with_reader {
                    "with the reader"
                } else {
                    "alone"
                },
                NAMES
                    .iter()
                    .zip(row)
                    .map(|(n, v)| format!("{n} {v:.2}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            for (j, v) in row.iter().enumerate() {
                figures[usize::from(with_reader)][j].push(*v);
            }
        }
    }
    for (j, name) in NAMES.iter().enumerate() {
        let a = median_of(&mut figures[0][j]);
        let w = median_of(&mut figures[1][j]);
        println!(
            "profile-clients median {name}: alone {a:.2}, with the reader {w:.2} (with/alone {:.3})",
            w / a.max(1e-9)
        );
    }
}

/// The control for [`profile_memp99`]'s reader: a thread named "reader" that shares nothing
/// with the store and keeps a CPU busy (arithmetic on its own registers) for 500 µs of every
/// 3.3 ms, the paced reader's 15%, until `stop`. What it costs the writer's latency is what
/// one more busy thread costs on this machine, whatever it runs.
fn spawn_spinner(stop: &Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    let stop = stop.clone();
    std::thread::Builder::new()
        .name("reader".to_owned())
        .spawn(move || {
            let mut x = 1u64;
            while !stop.load(Ordering::Acquire) {
                let began = Instant::now();
                while began.elapsed() < Duration::from_micros(500) {
                    for _ in 0..100 {
                        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    }
                }
                std::thread::sleep(Duration::from_micros(2_800));
            }
            black_box(x);
        })
        .expect("spawn spinner")
}

/// `profile-memp99`: the in-memory headline on LMDB (one writer applying puts back to
/// back), measured for its p99 over many more halves than the criterion run gives it:
/// `KEEL_PROFILE_ROUNDS` rounds (10) of `KEEL_PROFILE_PUTS` puts (200 000) alone and as many
/// with the reader (a reader of its own per half, as in the headline), in alternating order.
/// Prints each round's throughput and p99 ratios, the share of puts slower than twice the
/// half's median, the latency at seven quantiles, and the writer's schedstat (CPU, waiting
/// for a CPU, migrations, switches) per half; then the medians and the p99 ratio of all the
/// rounds' latencies pooled. `KEEL_PROFILE_SCAN` picks the reader: `count` (count-only
/// scans: the key index alone), `keys` (keys-only scans), `spin` (the control of
/// [`spawn_spinner`], which shares nothing with the store), else full scans.
fn profile_memp99<B: Backend + 'static>(s: &Arc<Store<B>>) {
    headline_load(s);
    let rounds = env_u64("KEEL_PROFILE_ROUNDS", 10);
    let puts = env_u64("KEEL_PROFILE_PUTS", 200_000);
    let value = vec![3u8; 1024];
    let scans = Arc::new(Scans::default());
    let mut next = 0u64;
    let mut pooled: [Vec<Duration>; 2] = Default::default();
    let (mut throughput, mut p99s) = (Vec::new(), Vec::new());
    let mut slow_share: [Vec<f64>; 2] = Default::default();
    let control = std::env::var("KEEL_PROFILE_SCAN").is_ok_and(|v| v == "spin");
    for round in 0..rounds {
        let first = round % 2 == 0;
        let mut took = [Duration::ZERO; 2];
        let mut p = [0f64; 2];
        // Share of the half's puts slower than twice its median: the slow mode whose size
        // against 1% decides where the p99 falls.
        let mut slow = [0f64; 2];
        let mut quantiles: [String; 2] = Default::default();
        // The writer's own schedstat over each half.
        let mut writer: [String; 2] = Default::default();
        for with_reader in [first, !first] {
            let stop = Arc::new(AtomicBool::new(false));
            let reader = with_reader.then(|| {
                if control {
                    spawn_spinner(&stop)
                } else {
                    spawn_scanner(s, &stop, &scans)
                }
            });
            let mut lat = Vec::with_capacity(puts as usize);
            let sched0 = sched_self();
            let moves0 = sched_moves();
            took[usize::from(with_reader)] = timed_puts(s, puts, &mut next, &value, &mut lat);
            let sched1 = sched_self();
            let moves1 = sched_moves();
            writer[usize::from(with_reader)] = format!(
                "{:.2} us on a CPU and {:.3} us waiting for one per put, {} timeslices, {} migrations, {} voluntary and {} involuntary switches",
                sched1[0].saturating_sub(sched0[0]) as f64 / 1e3 / puts.max(1) as f64,
                sched1[1].saturating_sub(sched0[1]) as f64 / 1e3 / puts.max(1) as f64,
                sched1[2].saturating_sub(sched0[2]),
                moves1[0].saturating_sub(moves0[0]),
                moves1[1].saturating_sub(moves0[1]),
                moves1[2].saturating_sub(moves0[2]),
            );
            stop.store(true, Ordering::Release);
            if let Some(r) = reader {
                r.join().expect("reader");
            }
            p[usize::from(with_reader)] = p99(&mut lat).as_secs_f64() * 1e6;
            let median = lat[lat.len() / 2];
            let at = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
            quantiles[usize::from(with_reader)] = [0.5, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999]
                .map(|q| format!("{:.2}", at(q).as_secs_f64() * 1e6))
                .join("/");
            slow[usize::from(with_reader)] =
                lat.iter().filter(|l| **l > 2 * median).count() as f64 / lat.len().max(1) as f64;
            pooled[usize::from(with_reader)].extend(lat);
        }
        let t = took[0].as_secs_f64() / took[1].as_secs_f64().max(1e-9);
        let q = p[1] / p[0].max(1e-9);
        println!(
            "profile-memp99 round {round}: throughput with/alone {t:.3}, p99 {:.2} us alone, {:.2} us with the reader ({q:.3}x); puts over twice the median {:.2}% alone, {:.2}% with the reader",
            p[0],
            p[1],
            slow[0] * 100.0,
            slow[1] * 100.0
        );
        println!(
            "profile-memp99 round {round}: latency in us at p50/p90/p95/p98/p99/p99.5/p99.9: {} alone, {} with the reader",
            quantiles[0], quantiles[1]
        );
        println!(
            "profile-memp99 round {round}: writer {} alone; {} with the reader",
            writer[0], writer[1]
        );
        slow_share[0].push(slow[0] * 100.0);
        slow_share[1].push(slow[1] * 100.0);
        throughput.push(t);
        p99s.push(q);
    }
    let [alone, with_reader] = &mut pooled;
    let pooled_ratio = p99(with_reader).as_secs_f64() / p99(alone).as_secs_f64().max(1e-9);
    println!(
        "profile-memp99: median throughput with/alone {:.3}, median p99 ratio {:.3}, pooled p99 ratio {pooled_ratio:.3}, median share of puts over twice the median {:.2}% alone, {:.2}% with the reader, over {rounds} rounds of {puts} puts per half",
        median_of(&mut throughput),
        median_of(&mut p99s),
        median_of(&mut slow_share[0]),
        median_of(&mut slow_share[1])
    );
}

/// Fixed workloads for an instruction counter: 20 batches (`KEEL_PROFILE_BATCHES`) of 1 000
/// puts plus a commit (no fsync, or with it for the `-fsync` variants, to trace system calls)
/// on the store or on raw heed, printing the median time per batch, or 20 ranges of 10 000
/// keys (`KEEL_PROFILE_BATCHES` sets how many too); `KEEL_PROFILE_WRITE_MAP=1` opens LMDB
/// with `write_map` on either side.
fn profile(what: &str) {
    let dir = tempfile::tempdir().unwrap();
    let value = [7u8; 150];
    let batches: usize = std::env::var("KEEL_PROFILE_BATCHES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let mut took = Vec::with_capacity(batches);
    // `KEEL_PROFILE_WRITE_MAP=1` opens LMDB (keel's backend or raw) with `write_map`.
    let write_map = std::env::var("KEEL_PROFILE_WRITE_MAP").is_ok_and(|v| v == "1");
    let lmdb = |sync| keel_benches::lmdb::options_with_write_map(MAP_SIZE as u64, sync, write_map);
    let store = |dir: &Path, sync, options| {
        Store::open(keel_benches::lmdb::backend_with(dir, &lmdb(sync)), options)
            .expect("open store")
    };
    match what {
        "profile-put" | "profile-put-fsync" => {
            let s = store(dir.path(), what.ends_with("fsync"), manual_batches());
            let mut next = 0u64;
            for _ in 0..batches {
                let t0 = Instant::now();
                for _ in 0..1_000 {
                    s.put(&key(next), &value, 0).expect("put");
                    next += 1;
                }
                s.force_commit().expect("commit");
                took.push(t0.elapsed());
            }
        }
        "profile-raw-put" | "profile-raw-put-fsync" => {
            let reference =
                keel_benches::lmdb::raw_with(dir.path(), &lmdb(what.ends_with("fsync")));
            let (env, db) = (reference.env.clone(), reference.db);
            let mut next = 0u64;
            for _ in 0..batches {
                let t0 = Instant::now();
                let mut wtxn = env.write_txn().expect("write txn");
                for _ in 0..1_000 {
                    db.put(&mut wtxn, &key(next), &value).expect("put");
                    next += 1;
                }
                wtxn.commit().expect("commit");
                took.push(t0.elapsed());
            }
        }
        "profile-range" => {
            let s = store(dir.path(), false, manual_batches());
            let mut t = s.write();
            for i in 0..10_000 {
                t.put(&key(i), &value, 0).expect("put");
            }
            t.commit().expect("commit");
            s.force_commit().expect("commit");
            let req = RangeRequest::range(b"key-".to_vec(), vec![0]);
            for _ in 0..batches {
                black_box(s.range(&req).expect("range"));
            }
        }
        "profile-raw-range" => {
            let reference = keel_benches::lmdb::raw(dir.path(), MAP_SIZE as u64, false);
            let (env, db) = (reference.env.clone(), reference.db);
            let mut wtxn = env.write_txn().expect("write txn");
            for i in 0..10_000 {
                db.put(&mut wtxn, &key(i), &value).expect("put");
            }
            wtxn.commit().expect("commit");
            for _ in 0..batches {
                let txn = env.clone().static_read_txn().expect("read txn");
                let bounds: (Bound<&[u8]>, Bound<&[u8]>) = (Bound::Unbounded, Bound::Unbounded);
                let mut out = Vec::new();
                for item in db.range(&txn, &bounds).expect("range") {
                    let (k, v) = item.expect("item");
                    out.push((k.to_vec(), v.to_vec()));
                }
                black_box(out);
            }
        }
        "profile-headline" | "profile-headline-alone" => {
            // The headline's writer (200 000 puts of 1 KiB over 100 000 keys, fsync, default
            // batching; `KEEL_PROFILE_PUTS` sets how many), with the full-scan reader on a thread named "reader" unless alone.
            let s = Arc::new(store(dir.path(), true, StoreOptions::default()));
            headline_load(&s);
            let keys = headline_keys();
            let value = vec![3u8; 1024];
            let stop = Arc::new(AtomicBool::new(false));
            let scanned = Arc::new(AtomicU64::new(0));
            let reader = (what == "profile-headline").then(|| {
                let (s, stop, scanned) = (s.clone(), stop.clone(), scanned.clone());
                std::thread::Builder::new()
                    .name("reader".to_owned())
                    .spawn(move || {
                        let mut scans = 0u64;
                        // The reader's time on a CPU in its range calls and in dropping
                        // their results, and its wall time in both.
                        let (mut in_range, mut in_drop, mut wall) = (0u64, 0u64, Duration::ZERO);
                        while !stop.load(Ordering::Acquire) {
                            let (t0, c0) = (Instant::now(), thread_ns());
                            let r = s
                                .range(&RangeRequest::range(b"key-".to_vec(), vec![0]))
                                .expect("scan");
                            let c1 = thread_ns();
                            assert_eq!(r.kvs.len() as u64, keys);
                            drop(r);
                            let c2 = thread_ns();
                            wall += t0.elapsed();
                            in_range += c1 - c0;
                            in_drop += c2 - c1;
                            scans += 1;
                            scanned.fetch_add(1, Ordering::Relaxed);
                        }
                        (scans, in_range, in_drop, wall)
                    })
                    .expect("spawn reader")
            });
            std::thread::sleep(Duration::from_millis(200));
            let split0 = threads_cpu();
            let scans0 = scanned.load(Ordering::Relaxed);
            let cpu0 = thread_cpu();
            let delay0 = thread_run_delay_ns();
            let start = Instant::now();
            let puts: u64 = std::env::var("KEEL_PROFILE_PUTS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(200_000);
            for n in 0..puts {
                s.put(&key(n.wrapping_mul(7919) % keys), &value, 0)
                    .expect("put");
            }
            let took = start.elapsed();
            let cpu = thread_cpu()
                .zip(cpu0)
                .map_or(0.0, |(b, a)| (b - a).as_secs_f64() * 1e6 / puts as f64);
            let split1 = threads_cpu();
            // Time the writer was runnable but waiting for a CPU: the rest of its wall time
            // beyond its CPU time it spent blocked (locks, the commit back-pressure).
            let queued = thread_run_delay_ns().saturating_sub(delay0) as f64 / 1e3 / puts as f64;
            let scanned_keys = (scanned.load(Ordering::Relaxed) - scans0) * keys;
            stop.store(true, Ordering::Release);
            let (scans, in_range, in_drop, wall) =
                reader.map_or((0, 0, 0, Duration::ZERO), |r| r.join().expect("reader"));
            if scans > 0 {
                let pacing = s.read_pacing();
                println!(
                    "{what}: reader on a CPU {:.1}% of its {:.3} s in range calls and {:.1}% in dropping their results; {} sleeps of {:.3} s in all",
                    in_range as f64 / 1e7 / wall.as_secs_f64(),
                    wall.as_secs_f64(),
                    in_drop as f64 / 1e7 / wall.as_secs_f64(),
                    pacing.sleeps,
                    pacing.slept.as_secs_f64()
                );
            }
            println!(
                "{what}: {puts} puts in {:.3} s ({:.2} us each, writer CPU {cpu:.2} us per put, waiting for a CPU {queued:.2} us per put), {scans} scans",
                took.as_secs_f64(),
                took.as_secs_f64() * 1e6 / puts as f64
            );
            let mut per_put = split1.clone();
            let reader_ns = per_put.remove("reader").unwrap_or(0);
            println!(
                "{what}: CPU per put in us by thread: {}",
                cpu_split(&split0, &per_put, puts as f64)
            );
            if scanned_keys > 0 {
                println!(
                    "{what}: reader CPU per scanned key: {:.2} us over {scanned_keys} keys",
                    reader_ns.saturating_sub(split0.get("reader").copied().unwrap_or(0)) as f64
                        / 1e3
                        / scanned_keys as f64
                );
            }
        }
        "profile-clients" => {
            let s = Arc::new(store(dir.path(), true, StoreOptions::default()));
            profile_clients(&s);
        }
        "profile-memp99" => {
            let s = Arc::new(store(dir.path(), true, StoreOptions::default()));
            profile_memp99(&s);
        }
        #[cfg(feature = "backend-file")]
        "profile-clients-file" => {
            // The same on the file backend, opened as the headline opens it.
            let backend = keel_backend_file::FileBackend::open(
                dir.path(),
                &keel_backend_file::FileOptions::default(),
            )
            .expect("open file backend");
            let s = Arc::new(Store::open(backend, StoreOptions::default()).expect("open store"));
            profile_clients(&s);
        }
        other => panic!("unknown profile {other}"),
    }
    if !took.is_empty() {
        took.sort_unstable();
        println!(
            "{what}: {} batches, median {:.3} ms per batch of 1000 puts and its commit",
            took.len(),
            took[took.len() / 2].as_secs_f64() * 1e3
        );
    }
}

fn main() {
    if let Ok(path) = std::env::var(INDEX_CHILD_ENV) {
        index_child(&path);
        return;
    }
    // `KEEL_MVCC_BENCH_ONLY=fanout` (or `index`, `criterion`, `headline`, `range`) runs one part;
    // `put` runs only the put comparison's interleaved REPORT;
    // `profile-put`, `profile-raw-put` and `profile-range` run a fixed amount of one workload
    // for an instruction counter (`valgrind --tool=callgrind`); `profile-clients` measures
    // where the durable clients' time goes, alone and with the reader (see `profile_clients`);
    // `profile-memp99` measures the in-memory headline's p99 over many rounds.
    let only = std::env::var("KEEL_MVCC_BENCH_ONLY").unwrap_or_default();
    if only.starts_with("profile-") {
        profile(&only);
        return;
    }
    if only.is_empty() || only == "criterion" || only == "headline" {
        let mut c = Criterion::default().configure_from_args();
        if only != "headline" {
            put_throughput(&mut c);
            range_10k(&mut c);
        }
        headline(&mut c);
        c.final_summary();
    }
    if only == "put" {
        put_interleaved();
    }
    if only == "range" {
        let mut c = Criterion::default().configure_from_args();
        range_10k(&mut c);
        c.final_summary();
    }
    if only.is_empty() || only == "index" {
        index_memory();
    }
    if only.is_empty() || only == "fanout" {
        fan_out();
    }
}
