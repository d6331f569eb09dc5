//! Record formats: the store writes the compact format 2 laid out as `kv`'s module doc says,
//! and a store whose records were written in format 1 still opens, reads, watches, hashes
//! and takes new writes, giving the same answers as the same history in format 2.

use keel_mvcc::testing::MemBackend;
use keel_mvcc::{
    Backend, Event, EventKind, KEY_BUCKET, KeyValue, RangeRequest, ReadTxn, Store, StoreOptions,
    WatchRequest, WriteBatch,
};

use crate::common::{fresh_path, open_at};

/// The fields of a record, decoded by hand from the documented layouts.
#[derive(Debug, PartialEq, Eq)]
struct Fields {
    create: u64,
    modified: u64,
    version: u64,
    lease: i64,
    key: Vec<u8>,
    value: Vec<u8>,
}

fn varint(b: &[u8], at: &mut usize) -> u64 {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = b[*at];
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return v;
        }
    }
    panic!("varint longer than 10 bytes");
}

fn be64(b: &[u8]) -> u64 {
    u64::from_be_bytes(b[..8].try_into().expect("8 bytes"))
}

/// Decodes a record of either format by the byte layout of the format doc, checking its CRC.
fn decode(rec: &[u8]) -> Fields {
    let (body, crc) = rec.split_at(rec.len() - 4);
    assert_eq!(crc32fast::hash(body).to_be_bytes(), crc, "record checksum");
    match body[0] {
        1 => {
            let key_len = u32::from_be_bytes(body[33..37].try_into().expect("4 bytes")) as usize;
            Fields {
                create: be64(&body[1..]),
                modified: be64(&body[9..]),
                version: be64(&body[17..]),
                lease: be64(&body[25..]) as i64,
                key: body[37..37 + key_len].to_vec(),
                value: body[37 + key_len..].to_vec(),
            }
        }
        2 => {
            let mut at = 1;
            let modified = varint(body, &mut at);
            let create = modified.wrapping_sub(varint(body, &mut at));
            let version = varint(body, &mut at);
            let zigzag = varint(body, &mut at);
            let key_len = varint(body, &mut at) as usize;
            Fields {
                create,
                modified,
                version,
                lease: ((zigzag >> 1) as i64) ^ -((zigzag & 1) as i64),
                key: body[at..at + key_len].to_vec(),
                value: body[at + key_len..].to_vec(),
            }
        }
        f => panic!("unknown record format {f}"),
    }
}

/// Encodes in format 1, byte by byte as the format doc gives it.
fn encode_1(f: &Fields) -> Vec<u8> {
    let mut out = vec![1u8];
    out.extend_from_slice(&f.create.to_be_bytes());
    out.extend_from_slice(&f.modified.to_be_bytes());
    out.extend_from_slice(&f.version.to_be_bytes());
    out.extend_from_slice(&f.lease.to_be_bytes());
    out.extend_from_slice(&(f.key.len() as u32).to_be_bytes());
    out.extend_from_slice(&f.key);
    out.extend_from_slice(&f.value);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_be_bytes());
    out
}

/// Every record of the `key` bucket: revision key and record.
fn records(store: &Store<MemBackend>) -> Vec<(Vec<u8>, Vec<u8>)> {
    let txn = store.backend().read_txn().expect("read txn");
    txn.range(&KEY_BUCKET, &[], None)
        .expect("range")
        .map(|item| {
            let (k, v) = item.expect("pair");
            (k.to_vec(), v.to_vec())
        })
        .collect()
}

/// A history with new keys, rewrites, a lease, a negative lease and deletions.
fn write_history(s: &Store<MemBackend>) {
    for i in 0..40u64 {
        let key = format!("key-{:02}", i % 15);
        let lease = match i % 5 {
            0 => 0x7a3c_1f00_dead_beef,
            1 => -3,
            _ => 0,
        };
        s.put(key.as_bytes(), format!("value {i}").as_bytes(), lease)
            .expect("put");
        if i % 9 == 8 {
            s.delete_range(key.as_bytes(), None).expect("delete");
        }
    }
    s.force_commit().expect("commit");
}

fn all_at(s: &Store<MemBackend>, revision: u64) -> Vec<KeyValue> {
    s.range(&RangeRequest {
        revision,
        ..RangeRequest::range(b"key-".to_vec(), b"key.".to_vec())
    })
    .expect("range")
    .kvs
}

fn events_from_start(s: &Store<MemBackend>, n: usize) -> Vec<(EventKind, KeyValue)> {
    let w = s
        .watch(WatchRequest::prefix(b"key-".to_vec()).from(1))
        .expect("watch");
    let mut out: Vec<Event> = Vec::new();
    while out.len() < n {
        out.extend(w.recv().expect("events"));
    }
    out.iter().map(|e| (e.kind(), e.kv())).collect()
}

#[test]
fn new_records_are_format_2_with_a_short_header() {
    let (_dir, path) = fresh_path();
    let s = open_at(&path, StoreOptions::default());
    let key = b"key-00000000000000000001";
    s.put(key, &[7; 150], 0).expect("put");
    s.put(key, &[8; 150], -9).expect("put again");
    s.delete_range(key, None).expect("delete");
    s.force_commit().expect("commit");
    let recs = records(&s);
    assert_eq!(recs.len(), 3);
    let fields: Vec<Fields> = recs.iter().map(|(_, r)| decode(r)).collect();
    assert!(recs.iter().all(|(_, r)| r[0] == 2));
    assert_eq!(
        fields,
        vec![
            Fields {
                create: 1,
                modified: 1,
                version: 1,
                lease: 0,
                key: key.to_vec(),
                value: vec![7; 150],
            },
            Fields {
                create: 1,
                modified: 2,
                version: 2,
                lease: -9,
                key: key.to_vec(),
                value: vec![8; 150],
            },
            Fields {
                create: 0,
                modified: 3,
                version: 0,
                lease: 0,
                key: key.to_vec(),
                value: Vec::new(),
            },
        ]
    );
    // Header and checksum of the first put: 6 bytes of header, 4 of CRC.
    assert_eq!(recs[0].1.len(), key.len() + 150 + 10);
}

#[test]
fn a_store_written_in_format_1_reads_watches_hashes_and_writes_as_in_format_2() {
    // The same history twice: left in format 2 in one store, rewritten to format 1 in the
    // other (as a store written before format 2 holds it).
    let (_d2, path2) = fresh_path();
    let (_d1, path1) = fresh_path();
    let v2 = open_at(&path2, StoreOptions::default());
    let written = open_at(&path1, StoreOptions::default());
    write_history(&v2);
    write_history(&written);
    let mut batch = WriteBatch::new();
    for (k, rec) in records(&written) {
        batch.put(&KEY_BUCKET, k, encode_1(&decode(&rec)));
    }
    written
        .backend()
        .commit(&batch)
        .expect("rewrite in format 1");
    drop(written);
    let v1 = open_at(&path1, StoreOptions::default());
    assert!(records(&v1).iter().all(|(_, r)| r[0] == 1));

    let current = v2.current_revision();
    assert_eq!(v1.current_revision(), current);
    assert_eq!(v1.key_count(), v2.key_count());
    for rev in 1..=current {
        assert_eq!(
            all_at(&v1, rev),
            all_at(&v2, rev),
            "range at revision {rev}"
        );
        assert_eq!(
            v1.hash_kv(rev).expect("hash").hash,
            v2.hash_kv(rev).expect("hash").hash,
            "history hash at revision {rev}"
        );
    }
    let n = records(&v2).len();
    assert_eq!(events_from_start(&v1, n), events_from_start(&v2, n));

    // New writes over format 1 records: format 2 beside format 1, the same answers.
    for s in [&v1, &v2] {
        s.put(b"key-03", b"after", 0).expect("put");
        s.delete_range(b"key-04", None).expect("delete");
        s.force_commit().expect("commit");
    }
    let after = v1.current_revision();
    assert_eq!(all_at(&v1, after), all_at(&v2, after));
    assert_eq!(
        v1.hash_kv(after).expect("hash").hash,
        v2.hash_kv(after).expect("hash").hash
    );
    let formats: Vec<u8> = records(&v1).iter().map(|(_, r)| r[0]).collect();
    assert!(formats.contains(&1) && formats.contains(&2), "{formats:?}");
    drop(v1);
    let reopened = open_at(&path1, StoreOptions::default());
    assert_eq!(all_at(&reopened, after), all_at(&v2, after));
    assert_eq!(all_at(&reopened, current / 2), all_at(&v2, current / 2));
}
