//! A store opened over a restored backend with the key index built while the stream loaded
//! (`Store::open_rebuilt`) is the store `Store::open` makes from the same data, and the leased
//! keys noted at open are exactly the live keys that carry a lease.

use keel_mvcc::testing::{MemBackend, MemOptions};
use keel_mvcc::{Backend, IndexBuilder, RangeRequest, ReadTxn, Store, StoreOptions};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::{fresh_path, open_at};

/// Key, value, create and mod revision, version, lease.
type Row = (Vec<u8>, Vec<u8>, u64, u64, u64, i64);

fn all(store: &Store<MemBackend>, revision: u64) -> Vec<Row> {
    let req = RangeRequest {
        revision,
        ..RangeRequest::range(vec![0u8], vec![0u8])
    };
    store
        .range(&req)
        .expect("range")
        .kvs
        .into_iter()
        .map(|kv| {
            (
                kv.key().to_vec(),
                kv.value().to_vec(),
                kv.create_revision,
                kv.mod_revision,
                kv.version,
                kv.lease,
            )
        })
        .collect()
}

fn leased(store: &Store<MemBackend>) -> Vec<(Vec<u8>, i64)> {
    let mut v: Vec<_> = all(store, 0)
        .into_iter()
        .filter(|kv| kv.5 != 0)
        .map(|kv| (kv.0, kv.5))
        .collect();
    v.sort();
    v
}

#[test]
fn rebuilt_store_matches_a_reopened_one() {
    let seed = std::env::var("KEEL_REBUILD_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_0b11);
    let mut rng = StdRng::seed_from_u64(seed);
    let (_dir, path) = fresh_path();
    let source = open_at(&path, StoreOptions::default());
    for i in 0..3_000u32 {
        let key = format!("k{:04}", rng.random_range(0..400u32)).into_bytes();
        match rng.random_range(0..10u32) {
            0 => {
                source.delete_range(&key, None).expect("delete");
            }
            1..=3 => {
                source
                    .put(&key, &i.to_le_bytes(), rng.random_range(1..5i64))
                    .expect("put with lease");
            }
            _ => {
                source.put(&key, &i.to_le_bytes(), 0).expect("put");
            }
        }
        if i == 2_000 {
            source
                .compact(source.current_revision() - 500)
                .expect("compact");
        }
    }
    source.force_commit().expect("commit");
    let mut stream = Vec::new();
    source.snapshot(&mut stream).expect("snapshot");
    let expected_leases = leased(&source);
    assert!(!expected_leases.is_empty(), "seed {seed}: no leased keys");

    let (_dir2, path2) = fresh_path();
    let backend = MemBackend::open(&path2, &MemOptions::default()).expect("open");
    let mut built = IndexBuilder::new();
    backend
        .restore_observed(&mut stream.as_slice(), &mut |b, k, v| {
            built.observe(b, k, v)
        })
        .expect("restore");
    assert!(built.records() > 0, "no records observed");
    let rebuilt = Store::open_rebuilt(backend, StoreOptions::default(), built).expect("open");

    assert_eq!(
        rebuilt.current_revision(),
        source.current_revision(),
        "seed {seed}"
    );
    assert_eq!(rebuilt.compacted_revision(), source.compacted_revision());
    for rev in [
        0,
        source.current_revision() - 300,
        source.current_revision() - 1,
    ] {
        assert!(
            all(&rebuilt, rev) == all(&source, rev),
            "seed {seed}: content at revision {rev} differs"
        );
    }
    let mut got = rebuilt.take_opened_leases().expect("leases noted at open");
    got.sort();
    assert_eq!(got, expected_leases, "seed {seed}: leased keys");
    assert!(rebuilt.take_opened_leases().is_none(), "taken twice");
    drop(rebuilt);

    // A plain reopen notes the same leases; after a write they are no longer offered.
    let reopened = open_at(&path2, StoreOptions::default());
    reopened.put(b"fresh", b"v", 0).expect("put");
    assert!(
        reopened.take_opened_leases().is_none(),
        "leases offered after a write"
    );
}

#[test]
fn damaged_record_fails_the_rebuilt_open() {
    let (_dir, path) = fresh_path();
    let source = open_at(&path, StoreOptions::default());
    source.put(b"a", b"1", 0).expect("put");
    source.force_commit().expect("commit");
    let mut built = IndexBuilder::new();
    let txn = source.backend().read_txn().expect("txn");
    for item in txn.range(&keel_mvcc::KEY_BUCKET, &[], None).expect("range") {
        let (k, v) = item.expect("pair");
        let mut v = v.to_vec();
        let last = v.len() - 1;
        v[last] ^= 0x40;
        built.observe(&keel_mvcc::KEY_BUCKET, k, &v);
    }
    drop(txn);
    let (_dir2, path2) = fresh_path();
    let backend = MemBackend::open(&path2, &MemOptions::default()).expect("open");
    match Store::open_rebuilt(backend, StoreOptions::default(), built) {
        Err(keel_mvcc::MvccError::Corrupt { .. }) => {}
        Err(e) => panic!("damaged record failed the open with {e}"),
        Ok(_) => panic!("a damaged record was indexed"),
    }
}
