//! Rebuilding the in-memory state a store derives from its backend: the key index (key →
//! generations of revisions), the latest revision, and which live keys carry a lease.
//!
//! [`Store::open`](crate::Store::open) feeds it every record of the `key` bucket from one read
//! pass; a caller restoring a snapshot feeds it the pairs as the backend loads them
//! ([`Backend::restore_observed`](crate::Backend::restore_observed)) and opens the store
//! with [`Store::open_rebuilt`](crate::Store::open_rebuilt), so the copy is never read back.
//! For a snapshot stream, [`IndexBuilder::on_thread`] builds the index on a thread of its own
//! from the records' heads, so that the thread loading the pairs does not also build it.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use crate::backend::Bucket;
use crate::error::MvccError;
use crate::key_index::KeyIndex;
use crate::kv::{
    LeaseId, RecordRef, decode_head, decode_record, decode_record_unchecked, head_len,
};
use crate::revision::Revision;
use crate::store::KEY_BUCKET;

/// The key index and lease attachments rebuilt from the `key` bucket's records, fed in
/// ascending revision order.
///
/// ```no_run
/// # use keel_mvcc::{Backend, IndexBuilder, Store, StoreOptions};
/// # fn f<B: Backend>(backend: B, input: &mut dyn std::io::Read) -> Result<(), Box<dyn std::error::Error>> {
/// let mut builder = IndexBuilder::new();
/// backend.restore_observed(input, &mut |bucket, key, value| builder.observe(bucket, key, value))?;
/// let store = Store::open_rebuilt(backend, StoreOptions::default(), builder)?;
/// # Ok(()) }
/// ```
#[derive(Default)]
pub struct IndexBuilder {
    pub(crate) keys: KeyIndex,
    /// Highest main revision seen.
    pub(crate) revision: u64,
    /// Lease of every key whose latest change is a put with a lease.
    pub(crate) leases: HashMap<Vec<u8>, LeaseId>,
    /// Records seen.
    pub(crate) records: u64,
    /// The first record that failed to decode; the rebuild is refused with it.
    pub(crate) error: Option<MvccError>,
    /// The records come out of a checksummed snapshot stream: their own checksums are not
    /// computed again (see [`IndexBuilder::for_checked_stream`]).
    pub(crate) stream_checked: bool,
}

impl IndexBuilder {
    /// An empty builder.
    pub fn new() -> IndexBuilder {
        IndexBuilder::default()
    }

    /// A builder for the pairs of a snapshot stream being restored, whose every byte is covered
    /// by the stream's checksum (checked before its last batch is loaded, see
    /// [`snapshot::restore_from`](crate::backend::snapshot::restore_from); a stream failing
    /// it is discarded with everything built from it). The records' own checksums cover the
    /// same bytes once more, so they are not computed here: only the record's framing is
    /// checked (format, lengths). They stay in the restored records, checked by every read, as
    /// on the member the stream came from.
    pub fn for_checked_stream() -> IndexBuilder {
        IndexBuilder {
            stream_checked: true,
            ..IndexBuilder::default()
        }
    }

    /// A builder for a checked stream (as [`for_checked_stream`](Self::for_checked_stream))
    /// run on a thread of its own, named `name`, which first runs `on_start`. The handle's
    /// `observe` takes the pairs as [`observe`](Self::observe) does, keeping only what the
    /// index needs of each record (its revision key, length, header and key) and handing
    /// those to the thread in blocks of 64 KiB; its `finish` returns the builder, or `None`
    /// when the thread failed.
    pub fn on_thread(
        name: String,
        on_start: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<IndexThread> {
        IndexThread::start(name, on_start)
    }

    /// Takes one pair of a backend: records of the `key` bucket are indexed, pairs of other
    /// buckets are ignored. Records must come in ascending revision order (the bucket's key
    /// order). A damaged record is remembered and fails the open.
    pub fn observe(&mut self, bucket: &Bucket, key: &[u8], value: &[u8]) {
        if *bucket == KEY_BUCKET
            && self.error.is_none()
            && let Err(e) = self.add(key, value)
        {
            self.error = Some(e);
        }
    }

    /// Indexes one record of the `key` bucket.
    pub(crate) fn add(&mut self, key: &[u8], value: &[u8]) -> Result<(), MvccError> {
        let Some((rev, tombstone)) = Revision::from_key(key) else {
            return Err(MvccError::Corrupt {
                revision: Revision::default(),
                reason: format!("key bucket holds a non-revision key {key:02x?}"),
            });
        };
        let rec = if self.stream_checked {
            decode_record_unchecked(rev, value)?
        } else {
            decode_record(rev, value)?
        };
        self.add_decoded(rev, tombstone, &rec);
        Ok(())
    }

    /// Indexes one decoded record of revision `rev`.
    fn add_decoded(&mut self, rev: Revision, tombstone: bool, rec: &RecordRef<'_>) {
        if tombstone {
            self.keys.tombstone(rec.key, rev);
        } else {
            self.keys
                .restore_put(rec.key, rec.create_revision, rev, rec.version);
        }
        if rec.lease != 0 && !tombstone {
            self.leases.insert(rec.key.to_vec(), rec.lease);
        } else if !self.leases.is_empty() {
            self.leases.remove(rec.key);
        }
        self.revision = self.revision.max(rev.main);
        self.records += 1;
    }

    /// Indexes one record from what an [`IndexThread`] kept of it: its revision key, its
    /// length and its head (header and key).
    fn add_head(&mut self, key: &[u8], len: usize, head: &[u8]) -> Result<(), MvccError> {
        let Some((rev, tombstone)) = Revision::from_key(key) else {
            return Err(MvccError::Corrupt {
                revision: Revision::default(),
                reason: format!("key bucket holds a non-revision key {key:02x?}"),
            });
        };
        let rec = decode_head(rev, len, head)?;
        self.add_decoded(rev, tombstone, &rec);
        Ok(())
    }

    /// Records indexed so far.
    pub fn records(&self) -> u64 {
        self.records
    }
}

/// Bytes of the blocks an [`IndexThread`] hands to its thread.
const BLOCK: usize = 64 << 10;

/// Builds the key index of a checked snapshot stream (see
/// [`IndexBuilder::for_checked_stream`]) on a thread of its own while another thread loads
/// the pairs: [`observe`](Self::observe) keeps only what the index needs of each record of
/// the `key` bucket (its revision key, its length, its header and key: about 35 bytes of a
/// 1 KiB record with a 24-byte key in record format 2, 70 in format 1) and hands those to
/// the thread in blocks of 64 KiB; the thread indexes them.
/// So the loading thread does not also search and grow the index.
pub struct IndexThread {
    block: Vec<u8>,
    tx: Option<SyncSender<Vec<u8>>>,
    /// Blocks the thread is done with, to fill again.
    spare: Receiver<Vec<u8>>,
    handle: Option<JoinHandle<IndexBuilder>>,
}

impl IndexThread {
    /// Starts the thread (named `name`), which first runs `on_start` (to lower its priority,
    /// say), then indexes what it is handed with a builder for a checked stream.
    fn start(
        name: String,
        on_start: impl FnOnce() + Send + 'static,
    ) -> std::io::Result<IndexThread> {
        let (tx, rx) = sync_channel::<Vec<u8>>(4);
        let (spare_tx, spare) = sync_channel::<Vec<u8>>(8);
        let handle = std::thread::Builder::new().name(name).spawn(move || {
            on_start();
            let mut built = IndexBuilder::for_checked_stream();
            for block in rx {
                index_block(&mut built, &block);
                let _ = spare_tx.try_send(block);
            }
            // CPU time of this thread, and time it spent ready to run but waiting for a
            // processor (Linux schedstat), for the log.
            let schedstat = std::fs::read_to_string("/proc/thread-self/schedstat").ok();
            let ms = |field: usize| {
                schedstat
                    .as_deref()
                    .and_then(|s| s.split_whitespace().nth(field)?.parse::<u64>().ok())
                    .map_or(-1.0, |ns| ns as f64 / 1e6)
            };
            tracing::debug!(
                records = built.records,
                cpu_ms = ms(0),
                run_wait_ms = ms(1),
                "key index built on its thread"
            );
            built
        })?;
        Ok(IndexThread {
            block: Vec::with_capacity(BLOCK),
            tx: Some(tx),
            spare,
            handle: Some(handle),
        })
    }

    /// Takes one pair, as [`IndexBuilder::observe`] does.
    pub fn observe(&mut self, bucket: &Bucket, key: &[u8], value: &[u8]) {
        if *bucket != KEY_BUCKET {
            return;
        }
        let head = &value[..head_len(value.len(), value)];
        // Entry: revision key length u32 | revision key | record length u32 | head length
        // u32 | head (native byte order: it never leaves the process).
        let b = &mut self.block;
        b.extend_from_slice(&(key.len() as u32).to_ne_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&(value.len() as u32).to_ne_bytes());
        b.extend_from_slice(&(head.len() as u32).to_ne_bytes());
        b.extend_from_slice(head);
        if self.block.len() >= BLOCK {
            self.hand_over();
        }
    }

    fn hand_over(&mut self) {
        let next = match self.spare.try_recv() {
            Ok(mut block) => {
                block.clear();
                block
            }
            Err(_) => Vec::with_capacity(BLOCK),
        };
        let block = std::mem::replace(&mut self.block, next);
        if let Some(tx) = &self.tx {
            // A thread that is gone is reported by `finish`.
            let _ = tx.send(block);
        }
    }

    /// Hands over what is left and waits for the thread: the builder holding every record
    /// observed, or `None` when the thread failed.
    pub fn finish(mut self) -> Option<IndexBuilder> {
        if !self.block.is_empty() {
            self.hand_over();
        }
        self.tx = None;
        self.handle.take()?.join().ok()
    }
}

impl Drop for IndexThread {
    fn drop(&mut self) {
        self.tx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Indexes the entries of one block made by [`IndexThread::observe`].
fn index_block(built: &mut IndexBuilder, mut block: &[u8]) {
    fn take<'a>(block: &mut &'a [u8], n: usize) -> &'a [u8] {
        let (a, b) = block.split_at(n.min(block.len()));
        *block = b;
        a
    }
    fn u32_of(block: &mut &[u8]) -> usize {
        match take(block, 4) {
            &[a, b, c, d] => u32::from_ne_bytes([a, b, c, d]) as usize,
            _ => 0,
        }
    }
    while block.len() >= 4 {
        let key_len = u32_of(&mut block);
        let key = take(&mut block, key_len);
        let len = u32_of(&mut block);
        let head_len = u32_of(&mut block);
        let head = take(&mut block, head_len);
        if built.error.is_none()
            && let Err(e) = built.add_head(key, len, head)
        {
            built.error = Some(e);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::{KeyValue, encode_record};

    #[test]
    fn a_checked_stream_skips_record_checksums_but_not_framing() {
        let kv = KeyValue {
            create_revision: 3,
            mod_revision: 7,
            version: 2,
            lease: 5,
            ..KeyValue::new(b"k", b"value")
        };
        let rev = Revision::new(7, 0);
        let key = rev.to_key(false);
        let mut record = encode_record(&kv);
        let last = record.len() - 1;
        record[last] ^= 1;
        // A record whose checksum is wrong: refused when read from a backend, taken from a
        // stream whose own checksum covers it.
        assert!(IndexBuilder::new().add(&key, &record).is_err());
        let mut built = IndexBuilder::for_checked_stream();
        built.add(&key, &record).expect("framing is sound");
        assert_eq!((built.records(), built.revision), (1, 7));
        assert_eq!(built.leases.get(&b"k"[..]), Some(&5));
        // Broken framing is refused either way.
        let mut bad = record.clone();
        bad[0] = 9;
        assert!(IndexBuilder::for_checked_stream().add(&key, &bad).is_err());
        let mut long = record.clone();
        long[33..37].copy_from_slice(&1000u32.to_be_bytes());
        assert!(IndexBuilder::for_checked_stream().add(&key, &long).is_err());
        assert!(
            IndexBuilder::for_checked_stream()
                .add(&key, &record[..20])
                .is_err()
        );
    }

    /// The records of a small history: puts with and without a lease, a tombstone, a put
    /// after it, in revision order.
    fn history() -> Vec<(Vec<u8>, Vec<u8>)> {
        let rec = |key: &[u8], value: &[u8], create: u64, rev: u64, version: u64, lease| {
            let kv = KeyValue {
                create_revision: create,
                mod_revision: rev,
                version,
                lease,
                ..KeyValue::new(key, value)
            };
            (
                Revision::new(rev, 0).to_key(create == 0),
                encode_record(&kv),
            )
        };
        let mut out = Vec::new();
        for i in 0..3000u64 {
            let key = format!("key-{:04}", i % 1000).into_bytes();
            let (create, version) = (i % 1000 + 2, i / 1000 + 1);
            out.push(rec(&key, &[7; 300], create, i + 2, version, (i % 7) as i64));
        }
        out.push(rec(b"key-0001", b"", 0, 3002, 0, 0));
        out.push(rec(b"key-0001", b"again", 3003, 3003, 1, 9));
        out
    }

    #[test]
    fn the_index_thread_builds_what_the_builder_builds() {
        let bucket = KEY_BUCKET;
        let other = Bucket::from_name("meta".to_owned()).expect("bucket");
        let mut direct = IndexBuilder::for_checked_stream();
        let mut threaded = IndexBuilder::on_thread("index-test".into(), || {}).expect("thread");
        for (key, value) in history() {
            direct.observe(&bucket, &key, &value);
            threaded.observe(&bucket, &key, &value);
            // Other buckets are ignored by both.
            direct.observe(&other, b"x", b"y");
            threaded.observe(&other, b"x", b"y");
        }
        let threaded = threaded.finish().expect("thread finished");
        assert!(direct.error.is_none() && threaded.error.is_none());
        assert_eq!(
            (threaded.records, threaded.revision, threaded.keys.len()),
            (direct.records, direct.revision, direct.keys.len())
        );
        assert_eq!(threaded.records, 3002);
        assert_eq!(threaded.leases, direct.leases);
        for i in 0..1000u64 {
            let key = format!("key-{i:04}").into_bytes();
            for at in [1, 500, 1500, 3001, 3002, 3003] {
                assert_eq!(threaded.keys.get(&key, at), direct.keys.get(&key, at));
            }
        }
        assert_eq!(threaded.leases.get(&b"key-0001"[..]), Some(&9));

        // A record with broken framing fails the build, as it does the builder's.
        let mut threaded = IndexBuilder::on_thread("index-test".into(), || {}).expect("thread");
        let (key, mut value) = history().remove(0);
        value[33..37].copy_from_slice(&5000u32.to_be_bytes());
        threaded.observe(&bucket, &key, &value);
        threaded.observe(&bucket, &key, &value[..10]);
        let built = threaded.finish().expect("thread finished");
        assert!(built.error.is_some());
        assert!(
            IndexBuilder::for_checked_stream()
                .add(&key, &value)
                .is_err()
        );
    }
}
