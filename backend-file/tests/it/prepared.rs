//! Space prepared ahead of the writer: commits go into zeros that survive reopen, a torn
//! commit inside them is cut off, bytes other than zeros after a sealed segment's last frame
//! are corruption, a defragment gives the prepared space back, and a failed preparation
//! fails no commit.

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keel_backend_file::format::FRAME_HEADER;
use keel_backend_file::{FaultHook, FileBackend, FileOptions, PrepareWith, WriteFault};
use keel_mvcc::{Backend, BackendError, WriteBatch};

use crate::support::{B, META_B, dump, segments};

const SEGMENT: u64 = 256 << 10;

fn options() -> FileOptions {
    FileOptions {
        segment_size: SEGMENT,
        background_reclaim: false,
        reclaim_min_garbage: 0,
        ..FileOptions::default()
    }
}

/// The options with each way of preparing space.
fn both() -> [FileOptions; 3] {
    [PrepareWith::Allocate, PrepareWith::Zeros, PrepareWith::Auto].map(|how| FileOptions {
        prepare_with: how,
        ..options()
    })
}

fn batch(i: u32) -> WriteBatch {
    let mut b = WriteBatch::new();
    for j in 0..8u32 {
        b.put(
            &B,
            format!("k{:04}", (i * 8 + j) % 300).into_bytes(),
            vec![i as u8; 1500],
        );
    }
    b.put(&META_B, b"n".to_vec(), i.to_be_bytes().to_vec());
    b
}

/// End of the last frame of a segment file, walking the documented frame layout.
fn frames_end(bytes: &[u8]) -> usize {
    let header = FRAME_HEADER;
    let mut at = 32;
    while at + header <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        if bytes[at..at + header].iter().all(|&b| b == 0) || at + header + len > bytes.len() {
            break;
        }
        at += header + len;
    }
    at
}

/// Waits until the last segment holds at least `min` zero bytes after its last frame (fewer
/// when that would pass the segment size, but at least one).
fn wait_for_zeros(dir: &Path, min: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let last = segments(dir).pop().unwrap();
        let bytes = fs::read(&last).unwrap();
        let end = frames_end(&bytes);
        // A nearly full segment is prepared up to the segment size.
        let goal = (end + min).min(SEGMENT as usize);
        if bytes.len() > end && bytes.len() >= goal {
            assert!(
                bytes[end..].iter().all(|&b| b == 0),
                "prepared space is zeros"
            );
            return end;
        }
        assert!(Instant::now() < deadline, "no space was prepared ahead");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn commits_fill_prepared_space_and_survive_reopen() {
    for options in both() {
        fill_and_reopen(&options);
    }
}

fn fill_and_reopen(options: &FileOptions) {
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), options).unwrap();
    for i in 0..60 {
        b.commit(&batch(i)).unwrap();
        if i % 10 == 0 {
            wait_for_zeros(dir.path(), 16 << 10);
        }
    }
    assert!(segments(dir.path()).len() >= 3, "commits rolled segments");
    let before = dump(&b);
    // A preparation step still under way has grown a file before it records the space it
    // prepared: the two agree once it ends.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let size = b.size().unwrap();
        let files: u64 = segments(dir.path())
            .iter()
            .map(|p| fs::metadata(p).unwrap().len())
            .sum();
        if size.on_disk >= files {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "on_disk counts prepared space: {} against {files} in the files",
            size.on_disk
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    drop(b);
    let b = FileBackend::open(dir.path(), options).unwrap();
    assert!(dump(&b) == before, "content after reopen");
    b.check_integrity().unwrap();
    for i in 60..70 {
        b.commit(&batch(i)).unwrap();
    }
    let after = dump(&b);
    drop(b);
    let b = FileBackend::open(dir.path(), options).unwrap();
    assert!(
        dump(&b) == after,
        "commits after reopen go into the prepared zeros"
    );
    b.check_integrity().unwrap();
}

#[test]
fn torn_commit_inside_prepared_space_is_cut_off() {
    for (options, garbage) in both()
        .into_iter()
        .flat_map(|o| [1usize, 17, 300, 5000].map(|g| (o.clone(), g)))
    {
        let dir = tempfile::tempdir().unwrap();
        let b = FileBackend::open(dir.path(), &options).unwrap();
        for i in 0..5 {
            b.commit(&batch(i)).unwrap();
        }
        let end = wait_for_zeros(dir.path(), 64 << 10);
        let state = dump(&b);
        drop(b);
        // A commit torn by a crash: the first bytes of a frame, then nothing.
        let last = segments(dir.path()).pop().unwrap();
        let mut bytes = fs::read(&last).unwrap();
        let frame: Vec<u8> = bytes[32..32 + garbage].to_vec();
        bytes[end..end + garbage].copy_from_slice(&frame);
        fs::write(&last, &bytes).unwrap();
        let b = FileBackend::open(dir.path(), &options).unwrap();
        assert!(
            dump(&b) == state,
            "torn commit of {garbage} bytes is not applied"
        );
        b.check_integrity().unwrap();
        assert_eq!(
            fs::metadata(&last).unwrap().len(),
            end as u64,
            "the torn tail is cut off"
        );
        b.commit(&batch(9)).unwrap();
        let now = dump(&b);
        drop(b);
        let b = FileBackend::open(dir.path(), &options).unwrap();
        assert!(dump(&b) == now);
        b.check_integrity().unwrap();
    }
}

#[test]
fn bytes_after_a_sealed_segments_frames_are_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), &options()).unwrap();
    for i in 0..40 {
        b.commit(&batch(i)).unwrap();
        // Let the preparer keep ahead, so that sealed segments end in zeros.
        wait_for_zeros(dir.path(), 1);
    }
    drop(b);
    let sealed = segments(dir.path()).remove(0);
    let mut bytes = fs::read(&sealed).unwrap();
    let end = frames_end(&bytes);
    assert!(
        end < bytes.len(),
        "the sealed segment ends in prepared zeros"
    );
    let at = bytes.len() - 1;
    bytes[at] = 1;
    fs::write(&sealed, &bytes).unwrap();
    match FileBackend::open(dir.path(), &options()) {
        Err(e @ BackendError::Corrupt { .. }) => {
            assert!(
                e.to_string().contains(sealed.to_str().unwrap()),
                "names the file: {e}"
            )
        }
        other => panic!("expected Corrupt, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn defragment_gives_prepared_space_back() {
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), &options()).unwrap();
    for i in 0..30 {
        b.commit(&batch(i)).unwrap();
    }
    wait_for_zeros(dir.path(), 16 << 10);
    let before = dump(&b);
    b.defragment().unwrap();
    let on_disk = b.size().unwrap().on_disk;
    let files: u64 = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum();
    assert_eq!(files, on_disk, "on_disk is what the files take");
    let last = segments(dir.path()).pop().unwrap();
    let bytes = fs::read(&last).unwrap();
    assert_eq!(
        frames_end(&bytes),
        bytes.len(),
        "no zeros left after defragment"
    );
    assert!(dump(&b) == before);
    drop(b);
    let b = FileBackend::open(dir.path(), &options()).unwrap();
    assert!(dump(&b) == before);
    b.check_integrity().unwrap();
}

/// Fails every write and sync of a segment being prepared.
#[derive(Debug)]
struct FailPreparation;

fn preparing(path: &Path) -> bool {
    path.to_string_lossy().ends_with(".seg.tmp")
}

impl FaultHook for FailPreparation {
    fn before_write(&self, path: &Path, _offset: u64, _len: usize) -> WriteFault {
        if preparing(path) {
            WriteFault::Fail(std::io::Error::other("injected fault"))
        } else {
            WriteFault::Proceed
        }
    }

    fn before_sync(&self, path: &Path) -> std::io::Result<()> {
        if preparing(path) {
            Err(std::io::Error::other("injected fault"))
        } else {
            Ok(())
        }
    }

    fn before_truncate(&self, _path: &Path, _len: u64) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn failed_preparation_is_not_a_failed_commit() {
    for options in both() {
        let options = FileOptions {
            fault_hook: Some(Arc::new(FailPreparation)),
            ..options
        };
        let dir = tempfile::tempdir().unwrap();
        let b = FileBackend::open(dir.path(), &options).unwrap();
        for i in 0..60 {
            b.commit(&batch(i))
                .expect("a commit does not depend on preparation");
        }
        assert!(segments(dir.path()).len() >= 3, "commits rolled segments");
        let state = dump(&b);
        drop(b);
        let left = fs::read_dir(dir.path())
            .unwrap()
            .filter(|e| preparing(&e.as_ref().unwrap().path()))
            .count();
        assert_eq!(left, 0, "failed preparations leave no file behind");
        let b = FileBackend::open(dir.path(), &options).unwrap();
        assert!(dump(&b) == state);
        b.check_integrity().unwrap();
    }
}

/// Counts the syncs of segment files (not of prepared ones or of the directory).
#[derive(Debug, Default)]
struct CountSyncs {
    syncs: std::sync::atomic::AtomicU64,
}

impl FaultHook for CountSyncs {
    fn before_write(&self, _path: &Path, _offset: u64, _len: usize) -> WriteFault {
        WriteFault::Proceed
    }
    fn before_sync(&self, path: &Path) -> std::io::Result<()> {
        if path.extension().is_some_and(|e| e == "seg") {
            self.syncs
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(())
    }
    fn before_truncate(&self, _path: &Path, _len: u64) -> std::io::Result<()> {
        Ok(())
    }
}

/// Zeros are written ahead once per prepared stretch, not once per commit: 300 commits of
/// about 12 KiB (3.6 MiB, one segment) sync the segment once each and the preparer's steps
/// add a few syncs (a step per commit added one sync per commit).
#[test]
fn zeros_are_prepared_in_stretches_not_per_commit() {
    for how in [PrepareWith::Zeros, PrepareWith::Auto] {
        zeros_in_stretches(how);
    }
}

fn zeros_in_stretches(how: PrepareWith) {
    const COMMITS: u64 = 300;
    let hook = Arc::new(CountSyncs::default());
    let options = FileOptions {
        segment_size: 64 << 20,
        prepare_with: how,
        fault_hook: Some(hook.clone()),
        ..options()
    };
    let dir = tempfile::tempdir().unwrap();
    let b = FileBackend::open(dir.path(), &options).unwrap();
    for i in 0..COMMITS {
        b.commit(&batch(i as u32)).unwrap();
        // Lets the preparer keep up, as it does between durable commits on a disk.
        std::thread::sleep(Duration::from_micros(200));
    }
    drop(b);
    let syncs = hook.syncs.load(std::sync::atomic::Ordering::Relaxed);
    assert!(syncs >= COMMITS, "{syncs} syncs for {COMMITS} commits");
    assert!(
        syncs <= COMMITS + COMMITS / 10,
        "{syncs} syncs of the segment for {COMMITS} commits ({how:?})"
    );
}
