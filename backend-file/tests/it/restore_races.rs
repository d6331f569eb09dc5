//! A restore meeting other work on the store: a defragmentation asked for while it runs
//! waits for it to end, and a restore whose writes switch from direct to the page cache in
//! the middle of a segment keeps every frame whole.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;

use keel_backend_file::{FileBackend, FileOptions};
use keel_mvcc::{Backend, ReadTxn};

use crate::support::{B, dump, stream};

/// A reader of `data` that runs `hook` once, after `after` bytes have been read.
struct Hooked<'a, F: FnMut()> {
    data: &'a [u8],
    at: usize,
    after: usize,
    hook: Option<F>,
}

impl<F: FnMut()> Read for Hooked<'_, F> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.at >= self.after
            && let Some(mut h) = self.hook.take()
        {
            h();
        }
        let n = buf.len().min(self.data.len() - self.at).min(64 << 10);
        buf[..n].copy_from_slice(&self.data[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// A defragmentation asked for halfway through a restore waits for the restore to end: it
/// neither drops the segments the restore filled nor publishes its batches early, and every
/// pair is there after the restore and after a reopen.
#[test]
fn a_defragmentation_during_a_restore_waits_for_it() {
    let pairs = 20_000u32;
    let data = stream(pairs, 200);
    let dir = tempfile::tempdir().unwrap();
    let options = FileOptions {
        background_reclaim: false,
        ..FileOptions::default()
    };
    let b = FileBackend::open(dir.path(), &options).unwrap();
    let mut seen_during = None;
    std::thread::scope(|scope| {
        let b = &b;
        let mut defrag = None;
        let mut input = Hooked {
            data: &data,
            at: 0,
            after: data.len() / 2,
            hook: Some(|| {
                defrag = Some(scope.spawn(|| b.defragment()));
                // Give it time to get in the restore's way, if it could.
                std::thread::sleep(std::time::Duration::from_millis(100));
                seen_during = Some(b.read_txn().unwrap().range(&B, &[], None).unwrap().count());
            }),
        };
        assert_eq!(
            b.restore(&mut input).unwrap(),
            u64::from(pairs) + 1,
            "the pairs and their count"
        );
        defrag
            .expect("the hook ran")
            .join()
            .unwrap()
            .expect("defragment after the restore");
    });
    assert_eq!(seen_during, Some(0), "an unfinished restore was published");
    let txn = b.read_txn().unwrap();
    let read = txn.range(&B, &[], None).unwrap();
    let (ok, errors): (Vec<_>, Vec<_>) = read.partition(|r| r.is_ok());
    assert_eq!((ok.len(), errors.len()), (pairs as usize, 0));
    drop(ok);
    drop(txn);
    drop(b);
    let b = FileBackend::open(dir.path(), &options).unwrap();
    assert_eq!(dump(&b).get("key").map_or(0, |m| m.len()), pairs as usize);
}

mod no_allocate {
    use std::path::Path;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, Ordering};

    use keel_backend_file::{FaultHook, WriteFault};

    /// Fails the preparer's first write as unsupported (as a file system without
    /// `fallocate` makes it fall back to writing zeros ahead) once the restore has handed
    /// two frames to the direct writer; counts the frames written.
    #[derive(Debug, Default)]
    pub struct AfterTwoFrames {
        offsets: Mutex<Vec<u64>>,
        pub failed: AtomicBool,
    }

    impl AfterTwoFrames {
        pub fn frames(&self) -> usize {
            self.offsets.lock().unwrap().len()
        }
    }

    impl FaultHook for AfterTwoFrames {
        fn before_write(&self, _path: &Path, offset: u64, _len: usize) -> WriteFault {
            if std::thread::current().name() == Some("keel-file-prepare") {
                while self.frames() < 2 {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                self.failed.store(true, Ordering::SeqCst);
                return WriteFault::Fail(std::io::ErrorKind::Unsupported.into());
            }
            let mut o = self.offsets.lock().unwrap();
            if offset > 0 && o.last() != Some(&offset) {
                o.push(offset);
            }
            WriteFault::Proceed
        }
        fn before_sync(&self, _: &Path) -> std::io::Result<()> {
            Ok(())
        }
        fn before_truncate(&self, _: &Path, _: u64) -> std::io::Result<()> {
            Ok(())
        }
    }
}

/// A restore whose writes go through the page cache from the middle of a segment on (the
/// space ahead can no longer be allocated, so zeros are written ahead) first lets the direct
/// writer write the block it held back: the next frame is not overwritten by its padding,
/// every value reads back, and a reopen finds every pair.
#[test]
fn a_restore_that_leaves_direct_writes_midway_keeps_every_frame() {
    let pairs = 20_000u32;
    let data = stream(pairs, 200);
    let hook = Arc::new(no_allocate::AfterTwoFrames::default());
    let dir = tempfile::tempdir().unwrap();
    // The case needs a restore that starts with direct writes.
    let probe = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .custom_flags(libc::O_DIRECT)
        .open(dir.path().join("direct-probe"));
    if probe.is_err() {
        eprintln!("skipped: the temporary directory refuses O_DIRECT");
        return;
    }
    std::fs::remove_file(dir.path().join("direct-probe")).unwrap();
    let options = FileOptions {
        background_reclaim: false,
        fault_hook: Some(hook.clone() as _),
        ..FileOptions::default()
    };
    let b = FileBackend::open(dir.path(), &options).unwrap();
    /// Holds the restore, once two frames are out, until the preparer has failed.
    struct Gate<'a> {
        data: &'a [u8],
        at: usize,
        hook: &'a no_allocate::AfterTwoFrames,
        done: bool,
    }
    impl Read for Gate<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if !self.done && self.hook.frames() >= 2 {
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
                while !self.hook.failed.load(std::sync::atomic::Ordering::SeqCst)
                    && std::time::Instant::now() < deadline
                {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
                self.done = true;
            }
            let n = buf.len().min(self.data.len() - self.at).min(64 << 10);
            buf[..n].copy_from_slice(&self.data[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }
    let mut gate = Gate {
        data: &data,
        at: 0,
        hook: &hook,
        done: false,
    };
    assert_eq!(
        b.restore(&mut gate).unwrap(),
        u64::from(pairs) + 1,
        "the pairs and their count"
    );
    let txn = b.read_txn().unwrap();
    let mut wrong = 0;
    for (i, r) in txn.range(&B, &[], None).unwrap().enumerate() {
        match r {
            Ok((_, v)) if v[..4] == (i as u32).to_be_bytes() => {}
            _ => wrong += 1,
        }
    }
    drop(txn);
    drop(b);
    assert_eq!(wrong, 0, "values read back wrong after the restore");
    let b = FileBackend::open(
        dir.path(),
        &FileOptions {
            background_reclaim: false,
            ..FileOptions::default()
        },
    )
    .unwrap();
    assert_eq!(dump(&b).get("key").map_or(0, |m| m.len()), pairs as usize);
}
