//! Watch: revision order, catch-up from the past, prev values, the compacted error,
//! cancellation, slow watchers that neither block writers nor lose events, and watch streams
//! multiplexing many watchers.

use std::time::{Duration, Instant};

use keel_mvcc::{
    DeleteRangeRequest, Event, EventKind, MvccError, PutRequest, RangeRequest, StoreOptions,
    StreamItem, TxnOp, TxnRequest, WatchRequest, Watcher,
};

use crate::common::{fresh_path, open_at, store};

fn collect(w: &Watcher, n: usize) -> Vec<Event> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match w.recv_timeout(left).expect("watch ended") {
            Some(events) => {
                let rev = events[0].mod_revision();
                assert!(
                    events.iter().all(|e| e.mod_revision() == rev),
                    "one response mixes revisions"
                );
                out.extend(events);
            }
            None => panic!("only {} of {n} events arrived", out.len()),
        }
    }
    out
}

#[test]
fn events_arrive_in_revision_order_with_prev_values() {
    let (_d, _p, s) = store();
    let w = s
        .watch(WatchRequest {
            prev_kv: true,
            ..WatchRequest::prefix(b"a".to_vec())
        })
        .unwrap();
    s.put(b"a1", b"x", 0).unwrap();
    s.put(b"b1", b"ignored", 0).unwrap();
    s.put(b"a1", b"y", 0).unwrap();
    s.txn(&TxnRequest {
        success: vec![
            TxnOp::Put(PutRequest::new(b"a2".to_vec(), b"z".to_vec())),
            TxnOp::DeleteRange(DeleteRangeRequest::key(b"a1".to_vec())),
        ],
        ..TxnRequest::default()
    })
    .unwrap();
    let ev = collect(&w, 4);
    let summary: Vec<(EventKind, &[u8], u64)> = ev
        .iter()
        .map(|e| (e.kind(), e.key(), e.mod_revision()))
        .collect();
    assert_eq!(
        summary,
        vec![
            (EventKind::Put, &b"a1"[..], 1),
            (EventKind::Put, &b"a1"[..], 3),
            (EventKind::Put, &b"a2"[..], 4),
            (EventKind::Delete, &b"a1"[..], 4),
        ]
    );
    assert_eq!(ev[0].prev_kv(), None);
    assert_eq!(ev[1].prev_kv().unwrap().value(), b"x");
    assert_eq!(ev[3].prev_kv().unwrap().value(), b"y");
    assert_eq!(w.try_recv().unwrap(), None, "no event for other keys");
}

#[test]
fn past_revisions_are_caught_up_from_the_store() {
    let (_d, _p, s) = store();
    for i in 0..60u32 {
        s.put(
            format!("k{}", i % 5).as_bytes(),
            format!("{i}").as_bytes(),
            0,
        )
        .unwrap();
        if i == 30 {
            s.force_commit().unwrap();
        }
    }
    let w = s
        .watch(WatchRequest {
            prev_kv: true,
            ..WatchRequest::key(b"k2".to_vec()).from(5)
        })
        .unwrap();
    // Revisions 8, 13, ..., 58 touch k2 (put number i at revision i + 1).
    let past = collect(&w, 11);
    let revs: Vec<u64> = past.iter().map(|e| e.mod_revision()).collect();
    assert_eq!(revs, (8..=58).step_by(5).collect::<Vec<u64>>());
    assert_eq!(past[1].prev_kv().unwrap().value(), b"7");
    s.put(b"k2", b"live", 0).unwrap();
    let live = collect(&w, 1);
    assert_eq!(
        (live[0].mod_revision(), live[0].value()),
        (61, &b"live"[..])
    );
}

#[test]
fn compaction_ends_watches_below_it() {
    let (_d, _p, s) = store();
    for i in 0..10u32 {
        s.put(b"k", format!("{i}").as_bytes(), 0).unwrap();
    }
    s.compact(6).unwrap();
    let e = s
        .watch(WatchRequest::key(b"k".to_vec()).from(6))
        .unwrap_err();
    assert!(
        matches!(
            e,
            MvccError::Compacted {
                requested: 6,
                compacted: 6
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .starts_with("required revision has been compacted")
    );
    let w = s.watch(WatchRequest::key(b"k".to_vec()).from(7)).unwrap();
    assert_eq!(collect(&w, 4).len(), 4);
}

#[test]
fn a_slow_watcher_falls_behind_then_catches_up_without_blocking_writers() {
    let (_d, path) = fresh_path();
    let options = StoreOptions {
        watch_channel_capacity: 4,
        watch_sync_interval: Duration::from_millis(5),
        batch_interval: Duration::from_millis(5),
        batch_limit: 100,
        ..StoreOptions::default()
    };
    let s = open_at(&path, options);
    let w = s.watch(WatchRequest::prefix(b"k".to_vec())).unwrap();
    let fast = s.watch(WatchRequest::key(b"other".to_vec())).unwrap();
    let start = Instant::now();
    for i in 0..2_000u32 {
        s.put(
            format!("k{:04}", i % 50).as_bytes(),
            format!("{i}").as_bytes(),
            0,
        )
        .unwrap();
    }
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "writers were held up by an unread watcher"
    );
    s.put(b"other", b"o", 0).unwrap();
    assert_eq!(collect(&fast, 1)[0].mod_revision(), 2_001);
    // Everything arrives, in order, with no gap and no repeat.
    let got = collect(&w, 2_000);
    let revs: Vec<u64> = got.iter().map(|e| e.mod_revision()).collect();
    assert_eq!(revs, (1..=2_000).collect::<Vec<u64>>());
    for (i, e) in got.iter().enumerate() {
        assert_eq!(e.value(), format!("{i}").into_bytes());
    }
    assert_eq!(w.recv_timeout(Duration::from_millis(50)).unwrap(), None);
}

#[test]
fn a_slow_watcher_overtaken_by_compaction_gets_the_compacted_error() {
    let (_d, path) = fresh_path();
    let options = StoreOptions {
        watch_channel_capacity: 1,
        watch_sync_interval: Duration::from_millis(5),
        ..StoreOptions::default()
    };
    let s = open_at(&path, options);
    let w = s.watch(WatchRequest::key(b"k".to_vec())).unwrap();
    for i in 0..20u32 {
        s.put(b"k", format!("{i}").as_bytes(), 0).unwrap();
    }
    s.compact(15).unwrap();
    let mut seen = Vec::new();
    let err = loop {
        match w.recv_timeout(Duration::from_secs(10)) {
            Ok(Some(events)) => seen.extend(events.into_iter().map(|e| e.mod_revision())),
            Ok(None) => panic!("watcher neither caught up nor failed"),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(err, MvccError::Compacted { compacted: 15, .. }),
        "{err:?}"
    );
    assert!(seen.len() < 20 && seen.iter().all(|&r| r <= 15));
}

#[test]
fn cancel_and_drop_unregister() {
    let (_d, path) = fresh_path();
    let s = open_at(&path, StoreOptions::default());
    let a = s.watch(WatchRequest::key(b"a".to_vec())).unwrap();
    let b = s.watch(WatchRequest::key(b"a".to_vec())).unwrap();
    assert_ne!(a.id(), b.id());
    assert_eq!(s.watcher_count(), 2);
    a.cancel();
    assert_eq!(s.watcher_count(), 1);
    s.put(b"a", b"1", 0).unwrap();
    assert_eq!(collect(&b, 1)[0].value(), b"1");
    drop(s);
    assert!(matches!(b.recv(), Err(MvccError::WatchClosed { .. })));
}

#[test]
fn a_stream_multiplexes_many_watchers_in_order_including_slow_ones() {
    let (_d, path) = fresh_path();
    let options = StoreOptions {
        watch_channel_capacity: 2,
        watch_sync_interval: Duration::from_millis(5),
        ..StoreOptions::default()
    };
    let s = open_at(&path, options);
    let mut stream = s.watch_stream();
    let ids: Vec<u64> = (0..20u32)
        .map(|i| {
            stream
                .watch(WatchRequest::key(format!("k{i:02}").into_bytes()))
                .unwrap()
        })
        .collect();
    let past = stream
        .watch(WatchRequest::key(b"k00".to_vec()).from(1))
        .unwrap();
    assert_eq!(stream.len(), 21);
    assert_eq!(s.watcher_count(), 21);
    // Nobody drains while 200 puts land: channels of 2 overflow, watchers fall behind.
    for i in 0..200u32 {
        s.put(
            format!("k{:02}", i % 20).as_bytes(),
            format!("{i}").as_bytes(),
            0,
        )
        .unwrap();
    }
    let mut per: std::collections::HashMap<u64, Vec<u64>> = Default::default();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut total = 0;
    while total < 210 {
        assert!(
            Instant::now() < deadline,
            "only {total} of 210 events arrived"
        );
        match stream.recv_timeout(Duration::from_millis(200)).unwrap() {
            Some(StreamItem::Events { id, events }) => {
                total += events.len();
                per.entry(id)
                    .or_default()
                    .extend(events.iter().map(|e| e.mod_revision()));
            }
            Some(StreamItem::Ended { id, error }) => panic!("watcher {id} ended: {error}"),
            None => {}
        }
    }
    for (n, id) in ids.iter().enumerate() {
        let want: Vec<u64> = (0..10u64).map(|j| j * 20 + n as u64 + 1).collect();
        assert_eq!(per[id], want, "watcher {n}");
    }
    let want: Vec<u64> = (0..10u64).map(|j| j * 20 + 1).collect();
    assert_eq!(per[&past], want);
    assert!(stream.cancel(ids[0]));
    assert!(!stream.cancel(ids[0]));
    assert_eq!(s.watcher_count(), 20);
    s.put(b"k00", b"x", 0).unwrap();
    s.put(b"k01", b"y", 0).unwrap();
    match stream.recv_timeout(Duration::from_secs(10)).unwrap() {
        Some(StreamItem::Events { id, events }) => {
            assert!(id == past || id == ids[1], "{id}");
            assert!(events[0].mod_revision() >= 201);
        }
        other => panic!("{other:?}"),
    }
    drop(s);
    let mut ended = false;
    for _ in 0..10 {
        match stream.recv_timeout(Duration::from_millis(100)) {
            Err(MvccError::WatchClosed { .. }) => {
                ended = true;
                break;
            }
            Ok(_) => {}
            Err(e) => panic!("{e:?}"),
        }
    }
    assert!(ended, "the stream reports the closed store");
}

#[test]
fn a_stream_reports_a_watcher_overtaken_by_compaction() {
    let (_d, path) = fresh_path();
    let options = StoreOptions {
        watch_channel_capacity: 1,
        watch_sync_interval: Duration::from_millis(5),
        ..StoreOptions::default()
    };
    let s = open_at(&path, options);
    let mut stream = s.watch_stream();
    let id = stream.watch(WatchRequest::key(b"k".to_vec())).unwrap();
    for i in 0..20u32 {
        s.put(b"k", format!("{i}").as_bytes(), 0).unwrap();
    }
    s.compact(15).unwrap();
    let err = loop {
        match stream.recv_timeout(Duration::from_secs(10)).unwrap() {
            Some(StreamItem::Events { id: got, .. }) => assert_eq!(got, id),
            Some(StreamItem::Ended { id: got, error }) => {
                assert_eq!(got, id);
                break error;
            }
            None => panic!("watcher neither caught up nor failed"),
        }
    };
    assert!(
        matches!(err, MvccError::Compacted { compacted: 15, .. }),
        "{err:?}"
    );
    assert!(stream.is_empty());
    assert_eq!(s.watcher_count(), 0);
}

/// What the model expects a watcher to see: `(revision, kind, key, value, prev value)`.
type Seen = (u64, EventKind, Vec<u8>, Vec<u8>, Option<Vec<u8>>);

/// One watcher of the overlap test: what it watches, from where, and where it listens.
struct Spec {
    key: Vec<u8>,
    end: Option<Vec<u8>>,
    /// First revision it should see.
    from: u64,
    prev_kv: bool,
}

impl Spec {
    fn holds(&self, key: &[u8]) -> bool {
        match self.end.as_deref() {
            None => key == self.key.as_slice(),
            Some([0]) => key >= self.key.as_slice(),
            Some(end) => key >= self.key.as_slice() && key < end,
        }
    }

    fn request(&self, start_revision: u64) -> WatchRequest {
        WatchRequest {
            key: self.key.clone(),
            range_end: self.end.clone(),
            start_revision,
            prev_kv: self.prev_kv,
        }
    }
}

fn seen(events: &[Event], prev_kv: bool) -> Vec<Seen> {
    events
        .iter()
        .map(|e| {
            (
                e.mod_revision(),
                e.kind(),
                e.key().to_vec(),
                e.value().to_vec(),
                if prev_kv {
                    e.prev_kv().map(|p| p.value().to_vec())
                } else {
                    None
                },
            )
        })
        .collect()
}

/// Many watchers on overlapping keys and ranges (single keys, ranges, prefixes, "from key"),
/// lone and in a stream, some from past revisions, some with previous values, behind tiny
/// channels and small catch-up batches: each sees exactly the changes of its keys, in
/// revision order, one response per revision, whether delivered by writers or caught up.
#[test]
fn overlapping_watchers_each_see_exactly_their_events_in_order() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = std::env::var("KEEL_WATCH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    println!("seed {seed} (rerun with KEEL_WATCH_SEED={seed})");
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let (_d, path) = fresh_path();
    let options = StoreOptions {
        watch_channel_capacity: 2,
        watch_sync_interval: Duration::from_millis(5),
        watch_sync_batch: 7,
        batch_interval: Duration::from_millis(5),
        batch_limit: 50,
        ..StoreOptions::default()
    };
    let s = open_at(&path, options);
    let key = |r: &mut rand::rngs::StdRng| format!("k{}", r.random_range(0..12u32)).into_bytes();
    let spec = |r: &mut rand::rngs::StdRng, from: u64| {
        let k = key(r);
        let end = match r.random_range(0..4u32) {
            0 => None,
            1 => Some(vec![0]),
            2 => Some(keel_mvcc::prefix_end(&k[..2])),
            _ => Some(key(r)).filter(|e| *e > k).or(Some(b"l".to_vec())),
        };
        Spec {
            key: if end.as_deref() == Some(&keel_mvcc::prefix_end(&k[..2])[..]) {
                k[..2].to_vec()
            } else {
                k
            },
            end,
            from,
            prev_kv: r.random_bool(0.5),
        }
    };
    let mut model: std::collections::BTreeMap<Vec<u8>, Vec<u8>> = Default::default();
    let mut history: Vec<Seen> = Vec::new();
    let apply = |r: &mut rand::rngs::StdRng,
                 model: &mut std::collections::BTreeMap<Vec<u8>, Vec<u8>>,
                 history: &mut Vec<Seen>| {
        match r.random_range(0..10u32) {
            0..=5 => {
                let k = key(r);
                let v = format!("v{}", r.random::<u32>()).into_bytes();
                let rev = s.put(&k, &v, 0).unwrap().revision;
                history.push((
                    rev,
                    EventKind::Put,
                    k.clone(),
                    v.clone(),
                    model.get(&k).cloned(),
                ));
                model.insert(k, v);
            }
            6..=7 => {
                let mut t = s.write();
                let mut keys: Vec<Vec<u8>> = (0..r.random_range(2..5)).map(|_| key(r)).collect();
                keys.dedup();
                let mut staged = Vec::new();
                for k in keys {
                    if staged.iter().any(|(sk, _)| *sk == k) {
                        continue;
                    }
                    let v = format!("t{}", r.random::<u32>()).into_bytes();
                    t.put(&k, &v, 0).unwrap();
                    staged.push((k, v));
                }
                let rev = t.commit().unwrap();
                for (k, v) in staged {
                    history.push((
                        rev,
                        EventKind::Put,
                        k.clone(),
                        v.clone(),
                        model.get(&k).cloned(),
                    ));
                    model.insert(k, v);
                }
            }
            _ => {
                let (a, b) = (key(r), key(r));
                let (a, b) = if a <= b { (a, b) } else { (b, a) };
                let b = [b, vec![0]].concat();
                let resp = s.delete_range(&a, Some(&b)).unwrap();
                let gone: Vec<Vec<u8>> = model
                    .range(a.clone()..b.clone())
                    .map(|(k, _)| k.clone())
                    .collect();
                assert_eq!(resp.deleted, gone.len());
                for k in gone {
                    let prev = model.remove(&k);
                    history.push((resp.revision, EventKind::Delete, k, Vec::new(), prev));
                }
            }
        }
    };
    let mut lone: Vec<(Spec, Watcher)> = Vec::new();
    let mut stream = s.watch_stream();
    let mut in_stream: std::collections::HashMap<u64, Spec> = Default::default();
    let mut add =
        |r: &mut rand::rngs::StdRng, current: u64, stream: &mut keel_mvcc::WatchStream<_>| {
            let past = current > 0 && r.random_bool(0.5);
            let from = if past {
                r.random_range(1..=current)
            } else {
                current + 1
            };
            let sp = spec(r, from);
            let start = if past { from } else { 0 };
            if r.random_bool(0.5) {
                let w = s.watch(sp.request(start)).unwrap();
                lone.push((sp, w));
            } else {
                let id = stream.watch(sp.request(start)).unwrap();
                in_stream.insert(id, sp);
            }
        };
    for _ in 0..30 {
        add(&mut r, s.current_revision(), &mut stream);
    }
    for round in 0..4 {
        for _ in 0..60 {
            apply(&mut r, &mut model, &mut history);
        }
        if round < 3 {
            for _ in 0..15 {
                add(&mut r, s.current_revision(), &mut stream);
            }
        }
    }
    let expect = |sp: &Spec| -> Vec<Seen> {
        history
            .iter()
            .filter(|h| h.0 >= sp.from && sp.holds(&h.2))
            .map(|h| {
                let mut h = h.clone();
                if !sp.prev_kv {
                    h.4 = None;
                }
                h
            })
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut got: std::collections::HashMap<u64, Vec<Seen>> = Default::default();
    let want_total: usize = in_stream.values().map(|sp| expect(sp).len()).sum();
    let mut total = 0;
    while total < want_total {
        assert!(
            Instant::now() < deadline,
            "stream: {total} of {want_total} events"
        );
        match stream.recv_timeout(Duration::from_millis(100)).unwrap() {
            Some(StreamItem::Events { id, events }) => {
                let rev = events[0].mod_revision();
                assert!(
                    events.iter().all(|e| e.mod_revision() == rev),
                    "one response mixes revisions"
                );
                total += events.len();
                got.entry(id)
                    .or_default()
                    .extend(seen(&events, in_stream[&id].prev_kv));
            }
            Some(StreamItem::Ended { id, error }) => panic!("watcher {id} ended: {error}"),
            None => {}
        }
    }
    for (id, sp) in &in_stream {
        assert_eq!(
            got.remove(id).unwrap_or_default(),
            expect(sp),
            "stream watcher {id} of {:?}..{:?} from {}",
            sp.key,
            sp.end,
            sp.from
        );
    }
    for (sp, w) in &lone {
        let want = expect(sp);
        let events = if want.is_empty() {
            Vec::new()
        } else {
            collect(w, want.len())
        };
        assert_eq!(
            seen(&events, sp.prev_kv),
            want,
            "watcher {:?}..{:?} from {}",
            sp.key,
            sp.end,
            sp.from
        );
        assert_eq!(
            w.recv_timeout(Duration::from_millis(20)).unwrap(),
            None,
            "nothing more"
        );
    }
    assert!(
        matches!(stream.try_recv(), Ok(None)),
        "nothing more in the stream"
    );
}

/// A watcher started far in the past, behind a channel of 2 and catch-up batches of 50
/// revisions, while writers keep adding revisions and the consumer pauses: it falls behind
/// again and again during its catch-up, and still gets every revision once, in order, then
/// goes on receiving new ones.
#[test]
fn a_watcher_falling_behind_during_catch_up_gets_everything_in_order() {
    let (_d, path) = fresh_path();
    let options = StoreOptions {
        watch_channel_capacity: 2,
        watch_sync_interval: Duration::from_millis(2),
        watch_sync_batch: 50,
        batch_interval: Duration::from_millis(5),
        batch_limit: 200,
        ..StoreOptions::default()
    };
    let s = std::sync::Arc::new(open_at(&path, options));
    for i in 0..1_500u32 {
        s.put(
            format!("k{}", i % 7).as_bytes(),
            format!("{i}").as_bytes(),
            0,
        )
        .unwrap();
    }
    s.force_commit().unwrap();
    let w = s
        .watch(WatchRequest::prefix(b"k".to_vec()).from(1))
        .unwrap();
    let writer = {
        let s = s.clone();
        std::thread::spawn(move || {
            for i in 1_500..3_000u32 {
                s.put(
                    format!("k{}", i % 7).as_bytes(),
                    format!("{i}").as_bytes(),
                    0,
                )
                .unwrap();
                if i % 100 == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        })
    };
    let mut revs = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while revs.len() < 3_000 {
        assert!(
            Instant::now() < deadline,
            "only {} of 3000 events",
            revs.len()
        );
        if let Some(events) = w.recv_timeout(Duration::from_millis(100)).unwrap() {
            assert_eq!(events.len(), 1);
            let e = &events[0];
            assert_eq!(e.value(), format!("{}", e.mod_revision() - 1).into_bytes());
            revs.push(e.mod_revision());
            if revs.len() % 200 == 0 {
                std::thread::sleep(Duration::from_millis(3));
            }
        }
    }
    writer.join().unwrap();
    assert_eq!(revs, (1..=3_000).collect::<Vec<u64>>());
    s.put(b"k0", b"new", 0).unwrap();
    assert_eq!(collect(&w, 1)[0].mod_revision(), 3_001);
}

/// Watchers cancelled while new ones register in their place (reusing the store's slots):
/// every live watcher gets exactly the events of its own key, cancelled ones nothing.
#[test]
fn watchers_registered_after_cancellations_see_only_their_own_keys() {
    let (_d, _p, s) = store();
    let mut live: Vec<(Vec<u8>, Watcher)> = Vec::new();
    for round in 0..5u32 {
        live = live
            .into_iter()
            .enumerate()
            .filter_map(|(i, kw)| (i % 2 == 0).then_some(kw))
            .collect();
        for j in 0..10u32 {
            let k = format!("r{round}-{j}").into_bytes();
            live.push((k.clone(), s.watch(WatchRequest::key(k)).unwrap()));
        }
        assert_eq!(s.watcher_count(), live.len());
        for (k, _) in &live {
            s.put(k, k, 0).unwrap();
        }
        for (k, w) in &live {
            let ev = collect(w, 1);
            assert_eq!((ev[0].key(), ev[0].value()), (&k[..], &k[..]));
            assert_eq!(w.try_recv().unwrap(), None, "only its own key");
        }
    }
}

/// An event's accessors read the stored change (put and delete, live and caught up from
/// the past), and every watcher of a change shares one record: no key or value is copied
/// per watcher.
#[test]
fn events_share_the_stored_record_and_read_its_fields() {
    let (_d, _p, s) = store();
    s.put(b"k", b"v1", 0).unwrap();
    let a = s.watch(WatchRequest::key(b"k".to_vec())).unwrap();
    let b = s.watch(WatchRequest::prefix(b"k".to_vec())).unwrap();
    s.put(b"k", b"v2", 7).unwrap();
    s.delete_range(b"k", None).unwrap();
    let (ea, eb) = (collect(&a, 2), collect(&b, 2));
    assert_eq!(ea, eb);
    for (x, y) in ea.iter().zip(&eb) {
        assert!(
            std::ptr::eq(x.key().as_ptr(), y.key().as_ptr()),
            "one record shared by both watchers"
        );
    }
    let put = &ea[0];
    assert_eq!(put.kind(), EventKind::Put);
    assert_eq!((put.key(), put.value()), (&b"k"[..], &b"v2"[..]));
    assert_eq!(
        (
            put.create_revision(),
            put.mod_revision(),
            put.version(),
            put.lease()
        ),
        (1, 2, 2, 7)
    );
    assert_eq!(
        put.kv(),
        s.range(&RangeRequest::key(b"k".to_vec()).at(2))
            .unwrap()
            .kvs[0]
    );
    let del = &ea[1];
    assert_eq!(del.kind(), EventKind::Delete);
    assert_eq!((del.key(), del.value()), (&b"k"[..], &b""[..]));
    assert_eq!(
        (del.create_revision(), del.mod_revision(), del.version()),
        (0, 3, 0)
    );
    // Caught up from the past: the same events.
    let past = s.watch(WatchRequest::key(b"k".to_vec()).from(2)).unwrap();
    assert_eq!(collect(&past, 2), ea);
}

/// A burst of commits longer than the notifier's queue (writers then dispatch the queue
/// themselves) reaches a stream complete and in revision order, each watcher its own keys.
#[test]
fn a_burst_longer_than_the_dispatch_queue_arrives_complete_and_in_order() {
    let (_d, _p, s) = store();
    let mut stream = s.watch_stream_with_capacity(30_000);
    let all = stream.watch(WatchRequest::prefix(b"b/".to_vec())).unwrap();
    let one = stream.watch(WatchRequest::key(b"b/7".to_vec())).unwrap();
    let n = 10_000u64;
    for i in 0..n {
        s.put(format!("b/{}", i % 10).as_bytes(), &i.to_be_bytes(), 0)
            .unwrap();
    }
    let (mut got_all, mut got_one) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + Duration::from_secs(20);
    while (got_all.len() as u64) < n || (got_one.len() as u64) < n / 10 {
        assert!(
            Instant::now() < deadline,
            "{} and {} events",
            got_all.len(),
            got_one.len()
        );
        match stream.recv_timeout(Duration::from_millis(100)).unwrap() {
            Some(StreamItem::Events { id, events }) => {
                let target = if id == all {
                    &mut got_all
                } else {
                    &mut got_one
                };
                assert!(id == all || id == one);
                for e in &events {
                    let v = u64::from_be_bytes(e.value().try_into().unwrap());
                    assert_eq!(e.key(), format!("b/{}", v % 10).as_bytes());
                    assert_eq!(e.mod_revision(), v + 1);
                    target.push(v);
                }
            }
            Some(other) => panic!("unexpected {other:?}"),
            None => {}
        }
    }
    assert_eq!(got_all, (0..n).collect::<Vec<u64>>());
    assert_eq!(
        got_one,
        (0..n).filter(|v| v % 10 == 7).collect::<Vec<u64>>()
    );
}

/// Responses already in a stream's channel for a watcher cancelled since are dropped; the
/// other watchers' responses still come out, in order.
#[test]
fn a_stream_drops_queued_responses_of_a_cancelled_watcher() {
    let (_d, _p, s) = store();
    let mut stream = s.watch_stream_with_capacity(1_000);
    let a = stream.watch(WatchRequest::key(b"a".to_vec())).unwrap();
    let b = stream.watch(WatchRequest::key(b"b".to_vec())).unwrap();
    for i in 0..20u32 {
        s.put(if i % 2 == 0 { b"a" } else { b"b" }, &i.to_be_bytes(), 0)
            .unwrap();
    }
    // Let every response reach the channel before cancelling.
    std::thread::sleep(Duration::from_millis(200));
    assert!(stream.cancel(a));
    let mut revs = Vec::new();
    while let Some(item) = stream.recv_timeout(Duration::from_millis(300)).unwrap() {
        match item {
            StreamItem::Events { id, events } => {
                assert_eq!(id, b, "a response of the cancelled watcher");
                revs.extend(events.iter().map(|e| e.mod_revision()));
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(revs, (1..=10u64).map(|i| 2 * i).collect::<Vec<u64>>());
}

/// A revision's events read as a slice and iterate alike whether the revision had one change
/// or several.
#[test]
fn a_revisions_events_read_alike_for_one_change_or_several() {
    let (_d, _p, s) = store();
    let w = s.watch(WatchRequest::prefix(b"k".to_vec())).unwrap();
    s.put(b"k1", b"v", 0).unwrap();
    s.txn(&TxnRequest {
        success: vec![
            TxnOp::Put(PutRequest::new(b"k2".to_vec(), b"x".to_vec())),
            TxnOp::Put(PutRequest::new(b"k3".to_vec(), b"y".to_vec())),
        ],
        ..TxnRequest::default()
    })
    .unwrap();
    let one = w.recv().unwrap();
    let two = w.recv().unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(two.len(), 2);
    let keys = |e: &[Event]| e.iter().map(|e| e.key().to_vec()).collect::<Vec<_>>();
    assert_eq!(keys(&one), [b"k1".to_vec()]);
    assert_eq!(keys(&two), [b"k2".to_vec(), b"k3".to_vec()]);
    // By reference, by value, and as a vector: the same events.
    assert_eq!((&two).into_iter().count(), 2);
    let owned: Vec<Event> = two.clone().into_iter().collect();
    assert_eq!(two, owned);
    assert_eq!(Vec::from(one.clone()), one.to_vec());
    assert_eq!(one.clone().into_iter().len(), 1);
    assert_ne!(one, two);
}

/// Dropping a store does not wait out `watch_sync_interval`: its shutdown wakes the parked
/// watch notifier, which the drop joins.
#[test]
fn dropping_a_store_does_not_wait_for_the_watch_notifier() {
    let (_d, p) = fresh_path();
    let s = open_at(
        &p,
        StoreOptions {
            watch_sync_interval: Duration::from_secs(5),
            ..StoreOptions::default()
        },
    );
    let _w = s.watch(WatchRequest::key(b"k".to_vec())).unwrap();
    s.put(b"k", b"v", 0).unwrap();
    // Let the notifier deliver the event and park again.
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    drop(s);
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "dropping the store took {:?}",
        t.elapsed()
    );
}

/// A write transaction that changes one key several times makes one event per change in one
/// revision, and each change's previous pair is the key's pair just before that change (the
/// change before it in the same revision, none after a delete), whether the watcher was
/// synced when the revision committed or caught it up from the store later.
#[test]
fn a_key_changed_several_times_in_one_revision_has_the_same_prev_values_live_and_caught_up() {
    let (_d, _p, s) = store();
    s.put(b"k", b"v0", 0).unwrap(); // revision 1
    let request = WatchRequest {
        prev_kv: true,
        ..WatchRequest::key(b"k".to_vec())
    };
    let live = s.watch(request.clone()).unwrap();
    let mut t = s.write();
    t.put(b"k", b"v1", 0).unwrap();
    t.put(b"k", b"v2", 0).unwrap();
    t.delete_range(b"k", None).unwrap();
    t.put(b"k", b"v3", 0).unwrap();
    assert_eq!(t.commit().unwrap(), 2);
    let caught = s.watch(request.from(2)).unwrap();
    // Kind, value, version and previous value of each event.
    type Summary = Vec<(EventKind, Vec<u8>, u64, Option<Vec<u8>>)>;
    let summary = |events: Vec<Event>| -> Summary {
        events
            .iter()
            .map(|e| {
                (
                    e.kind(),
                    e.value().to_vec(),
                    e.version(),
                    e.prev_kv().map(|p| p.value().to_vec()),
                )
            })
            .collect()
    };
    let expected = vec![
        (EventKind::Put, b"v1".to_vec(), 2, Some(b"v0".to_vec())),
        (EventKind::Put, b"v2".to_vec(), 3, Some(b"v1".to_vec())),
        (EventKind::Delete, Vec::new(), 0, Some(b"v2".to_vec())),
        (EventKind::Put, b"v3".to_vec(), 1, None),
    ];
    assert_eq!(summary(collect(&live, 4)), expected, "synced watcher");
    assert_eq!(summary(collect(&caught, 4)), expected, "caught-up watcher");
}

/// The previous pairs that watch events and put responses carry are each read alone, and
/// hold a buffer of their own size: a delete of many small keys watched with previous
/// values keeps each deleted pair, not a 16 KiB buffer per pair.
#[test]
fn previous_pairs_read_alone_hold_buffers_of_their_own_size() {
    let held = |kv: keel_mvcc::KeyValue| {
        let (key, value) = kv.into_parts();
        (key, value.len(), value.capacity())
    };
    let (_d, _p, s) = store();
    let w = s
        .watch(WatchRequest {
            prev_kv: true,
            ..WatchRequest::prefix(b"p/".to_vec())
        })
        .unwrap();
    for i in 0..50u32 {
        s.put(format!("p/{i:03}").as_bytes(), b"v", 0).unwrap();
    }
    s.delete_range(b"p/", Some(b"p0")).unwrap();
    let events = collect(&w, 100);
    drop(w);
    let prevs: Vec<_> = events[50..]
        .iter()
        .map(|e| e.prev_kv().expect("a previous pair").clone())
        .collect();
    drop(events);
    for (i, kv) in prevs.into_iter().enumerate() {
        let (key, len, room) = held(kv);
        assert_eq!((key, len), (format!("p/{i:03}").into_bytes(), 1));
        assert!(
            room < 1024,
            "the previous pair of p/{i:03} (6 bytes) holds {room} bytes"
        );
    }

    s.put(b"q", b"w", 0).unwrap();
    let put = s
        .put_with(&PutRequest {
            prev_kv: true,
            ..PutRequest::new(b"q".to_vec(), b"x".to_vec())
        })
        .unwrap();
    let (key, len, room) = held(put.prev_kv.expect("the previous pair"));
    assert_eq!((key.as_slice(), len), (&b"q"[..], 1));
    assert!(
        room < 1024,
        "a put's previous pair of 2 bytes holds {room} bytes"
    );
}
