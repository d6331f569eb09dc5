//! The snapshot stream parser shared by backends: `snapshot::restore_with` batches, order,
//! and a last batch that is only handed out once the stream is verified.

use keel_mvcc::backend::snapshot::{self, RESTORE_BATCH_BYTES, RESTORE_BATCH_PAIRS};
use keel_mvcc::testing::{MemBackend, MemOptions};
use keel_mvcc::{Backend, BackendError, BatchOp, WriteBatch};

use crate::common::fresh_path;

/// A stream of `pairs` pairs over two buckets, taken from a `MemBackend`.
fn stream_of(pairs: usize, value_len: usize) -> Vec<u8> {
    let (_dir, path) = fresh_path();
    let backend = MemBackend::open(&path, &MemOptions::default()).expect("open");
    let mut batch = WriteBatch::new();
    for i in 0..pairs {
        let bucket = if i % 3 == 0 { "alpha" } else { "beta" };
        batch.put(
            &keel_mvcc::Bucket::new(bucket),
            format!("k{i:08}"),
            vec![(i % 251) as u8; value_len],
        );
    }
    backend.commit(&batch).expect("commit");
    let mut out = Vec::new();
    backend.snapshot(&mut out).expect("snapshot");
    out
}

/// What `restore_with` returned, every `(bucket, key)` handed to `apply` in order, and the
/// batch sizes.
type Collected = (
    Result<u64, BackendError>,
    Vec<(String, Vec<u8>)>,
    Vec<usize>,
);

/// Runs `restore_with` over `stream`, recording what it hands out.
fn collect(stream: &[u8]) -> Collected {
    let mut seen = Vec::new();
    let mut sizes = Vec::new();
    let result = snapshot::restore_with(&mut &stream[..], |batch| {
        assert!(
            batch.len() <= RESTORE_BATCH_PAIRS,
            "batch of {} pairs",
            batch.len()
        );
        sizes.push(batch.len());
        for op in batch.ops() {
            match op {
                BatchOp::Put { bucket, key, .. } => {
                    seen.push((bucket.name().to_owned(), key.clone()))
                }
                other => panic!("restore_with handed out {other:?}"),
            }
        }
        Ok(())
    });
    (result, seen, sizes)
}

#[test]
fn batches_cover_the_stream_in_ascending_order() {
    let pairs = 2 * RESTORE_BATCH_PAIRS + 17;
    let stream = stream_of(pairs, 4);
    let (result, seen, sizes) = collect(&stream);
    assert_eq!(result.expect("intact stream"), pairs as u64);
    assert_eq!(seen.len(), pairs, "pairs handed out");
    assert!(
        sizes.len() >= 3,
        "{pairs} pairs came in {} batches",
        sizes.len()
    );
    assert!(
        seen.windows(2).all(|w| w[0] < w[1]),
        "(bucket, key) not strictly ascending across batches"
    );
}

#[test]
fn byte_limit_splits_batches() {
    let value = 64 << 10;
    let pairs = 2 * RESTORE_BATCH_BYTES / value + 5;
    let stream = stream_of(pairs, value);
    let (result, seen, sizes) = collect(&stream);
    assert_eq!(result.expect("intact stream"), pairs as u64);
    assert_eq!(seen.len(), pairs);
    let per_batch = RESTORE_BATCH_BYTES / value + 1;
    assert!(
        sizes.iter().all(|&n| n <= per_batch),
        "batch sizes {sizes:?}"
    );
    assert!(sizes.len() >= 3, "batch sizes {sizes:?}");
}

#[test]
fn last_batch_waits_for_the_checksum() {
    // Exactly one full batch: it is the last one, so it must not be handed out before the
    // end frame is checked.
    for pairs in [RESTORE_BATCH_PAIRS, RESTORE_BATCH_PAIRS + 1, 10] {
        let stream = stream_of(pairs, 1);
        for damage in ["truncated crc", "flipped crc", "trailing byte", "bad count"] {
            let mut bad = stream.clone();
            let n = bad.len();
            match damage {
                "truncated crc" => bad.truncate(n - 1),
                "flipped crc" => bad[n - 1] ^= 0x5a,
                "trailing byte" => bad.push(0),
                _ => bad[n - 12] ^= 1,
            }
            let (result, seen, _) = collect(&bad);
            assert!(
                matches!(result, Err(BackendError::Snapshot { .. })),
                "{damage} ({pairs} pairs): {result:?}"
            );
            assert!(
                seen.len() < pairs,
                "{damage} ({pairs} pairs): all {} pairs handed out before the stream was verified",
                seen.len()
            );
        }
        let (result, seen, _) = collect(&stream);
        assert_eq!(result.expect("intact"), pairs as u64);
        assert_eq!(seen.len(), pairs);
    }
}

#[test]
fn apply_error_stops_the_parse() {
    let stream = stream_of(2 * RESTORE_BATCH_PAIRS, 1);
    let mut calls = 0;
    let result = snapshot::restore_with(&mut &stream[..], |_| {
        calls += 1;
        Err(BackendError::Full { used: 1, limit: 1 })
    });
    assert!(
        matches!(result, Err(BackendError::Full { .. })),
        "{result:?}"
    );
    assert_eq!(calls, 1, "apply called after it failed");
}

/// A reader handing out the stream in pieces of random length (1 byte to 3 MiB).
struct Choppy<'a> {
    data: &'a [u8],
    rng: rand::rngs::StdRng,
}

impl std::io::Read for Choppy<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        use rand::Rng;
        let most = out.len().min(self.data.len());
        if most == 0 {
            return Ok(0);
        }
        let n = if self.rng.random_bool(0.3) {
            self.rng.random_range(1..=most.min(64))
        } else {
            self.rng.random_range(1..=most.min(3 << 20))
        };
        out[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

#[test]
fn borrowed_batches_match_owned_ones_whatever_the_reads() {
    use rand::SeedableRng;
    // Many small pairs, then values larger than the parser's buffer.
    let (_dir, path) = fresh_path();
    let backend = MemBackend::open(&path, &MemOptions::default()).expect("open");
    let mut batch = WriteBatch::new();
    for i in 0..(RESTORE_BATCH_PAIRS + 4_321) {
        batch.put(
            &keel_mvcc::Bucket::new("a"),
            format!("k{i:08}"),
            vec![(i % 251) as u8; i % 40],
        );
    }
    for i in 0..3u8 {
        batch.put(&keel_mvcc::Bucket::new("b"), vec![i], vec![i; 20 << 20]);
    }
    backend.commit(&batch).expect("commit");
    let mut stream = Vec::new();
    backend.snapshot(&mut stream).expect("snapshot");

    let mut owned = Vec::new();
    snapshot::restore_with(&mut &stream[..], |b| {
        owned.push(b.clone());
        Ok(())
    })
    .expect("restore_with");
    for seed in 0..4u64 {
        let mut input = Choppy {
            data: &stream,
            rng: rand::rngs::StdRng::seed_from_u64(seed),
        };
        let mut borrowed = Vec::new();
        let pairs = snapshot::restore_from(&mut input, |b| {
            let mut w = WriteBatch::new();
            for (bucket, key, value) in b.iter() {
                w.put(bucket, key, value);
            }
            borrowed.push(w);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        assert_eq!(
            pairs as usize,
            RESTORE_BATCH_PAIRS + 4_321 + 3,
            "seed {seed}"
        );
        assert!(borrowed == owned, "seed {seed}: batches differ");
    }
    // Damage anywhere is still caught through choppy reads.
    for (i, at) in [17usize, stream.len() / 3, stream.len() - 2]
        .into_iter()
        .enumerate()
    {
        let mut bad = stream.clone();
        bad[at] ^= 0x20;
        let mut input = Choppy {
            data: &bad,
            rng: rand::rngs::StdRng::seed_from_u64(i as u64),
        };
        let result = snapshot::restore_from(&mut input, |_| Ok(()));
        assert!(
            matches!(result, Err(BackendError::Snapshot { .. })),
            "flip at {at}: {result:?}"
        );
    }
}
