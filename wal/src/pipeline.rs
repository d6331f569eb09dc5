//! The log's write thread: writes the first part of a large durable append (a run of whole
//! pages, as a direct write) while the appending thread encodes the rest, so that encoding
//! and writing overlap and two direct writes over disjoint pages are in flight at once.
//!
//! One long-lived thread per log, started by the first append that needs it and stopped
//! when the log is dropped. A [`Part`] owns the buffer its pages are in: it goes to the
//! thread with the job and comes back with the result, so nothing is shared while the write
//! runs. The appending thread holds the log's mutex from handing a part over until it has
//! its result back, so a part is always written (or has failed) before anything else
//! touches the segment, and before any `fdatasync` is counted on to cover it.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, Sender, TryRecvError};

use crate::io::{WalFile, write_all_at};

/// How long the write thread, woken ahead of a part ([`PartWriter::wake`]), waits for it
/// spinning (yielding its CPU) before it blocks again. Waking a blocked thread costs tens
/// of µs on a virtual machine; the wake-up is sent before the first part is encoded, so it
/// is under way while the appending thread encodes.
const AHEAD_SPIN: Duration = Duration::from_micros(200);

/// How long the appending thread spins for the write thread's result before it parks.
const RESULT_SPIN: Duration = Duration::from_micros(500);

/// A run of whole pages to write directly.
#[derive(Debug)]
pub(crate) struct Part {
    /// The segment's direct-write handle.
    pub file: Arc<dyn WalFile>,
    /// The buffer holding the pages (it is handed back with the result).
    pub buf: Vec<u8>,
    /// Where the pages start in `buf` (a page-aligned address).
    pub from: usize,
    /// Bytes to write: whole pages.
    pub len: usize,
    /// File offset of the first page.
    pub offset: u64,
}

impl Part {
    /// The bytes to write.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.buf[self.from..self.from + self.len]
    }
}

enum Job {
    /// A part will follow shortly: be awake for it.
    Wake,
    Write(Part),
}

/// The log's write thread.
#[derive(Debug)]
pub(crate) struct PartWriter {
    jobs: Option<Sender<Job>>,
    /// The job queue's other end, to take back a part the thread has not started.
    queued: Receiver<Job>,
    done: Receiver<(Part, io::Result<()>)>,
    /// [`IDLE`], [`WAITING`] or [`CALLED_OFF`].
    state: Arc<AtomicU8>,
    handle: Option<JoinHandle<()>>,
}

/// The thread is writing, or blocked for a job.
const IDLE: u8 = 0;
/// The thread is awake (after a wake-up) and spinning for a part.
const WAITING: u8 = 1;
/// The appending thread will send no part after all: stop spinning.
const CALLED_OFF: u8 = 2;

impl PartWriter {
    /// Starts the thread.
    pub(crate) fn start() -> io::Result<PartWriter> {
        let (jobs, rx) = crossbeam_channel::bounded::<Job>(2);
        let (tx, done) = crossbeam_channel::bounded(1);
        let queued = rx.clone();
        let state = Arc::new(AtomicU8::new(IDLE));
        let st = state.clone();
        let handle = std::thread::Builder::new()
            .name("keel-wal-write".into())
            .spawn(move || run(&rx, &tx, &st))?;
        Ok(PartWriter {
            jobs: Some(jobs),
            queued,
            done,
            state,
            handle: Some(handle),
        })
    }

    /// Tells the thread a part is coming, so that it is awake when it arrives. A hint.
    pub(crate) fn wake(&self) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.try_send(Job::Wake);
        }
    }

    /// Whether the thread is awake and waiting for a part: handed one now, it starts
    /// writing at once.
    pub(crate) fn ready(&self) -> bool {
        self.state.load(Ordering::Acquire) == WAITING
    }

    /// [`PartWriter::ready`], spinning for it for at most `limit` (and waking the thread
    /// again if it stopped waiting meanwhile).
    pub(crate) fn ready_within(&self, limit: Duration) -> bool {
        if self.ready() {
            return true;
        }
        if limit.is_zero() {
            return false;
        }
        let until = Instant::now() + limit;
        loop {
            match self.state.load(Ordering::Acquire) {
                WAITING => return true,
                IDLE if self.queued.is_empty() => self.wake(),
                _ => {}
            }
            if Instant::now() >= until {
                return false;
            }
            // Yielding: on a machine with more runnable threads than CPUs, the thread
            // waited for may need this one's CPU.
            std::thread::yield_now();
        }
    }

    /// No part follows the last wake-up after all: the thread stops waiting for one.
    pub(crate) fn call_off(&self) {
        // A wake-up the thread has not seen yet is taken back, then one it is acting on is
        // called off.
        let _ = self.take_back();
        let _ =
            self.state
                .compare_exchange(WAITING, CALLED_OFF, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// Hands `part` to the thread; false if the thread is gone (the part is dropped: the
    /// caller treats it as a failed write).
    pub(crate) fn send(&self, part: Part) -> bool {
        self.jobs
            .as_ref()
            .is_some_and(|jobs| jobs.send(Job::Write(part)).is_ok())
    }

    /// Takes back the part handed over last if the thread has not started it (it is busy,
    /// or not yet scheduled on a loaded machine): the caller then writes it itself rather
    /// than waiting for the thread, and gets no result from [`PartWriter::wait`].
    pub(crate) fn take_back(&self) -> Option<Part> {
        loop {
            match self.queued.try_recv() {
                Ok(Job::Write(part)) => return Some(part),
                Ok(Job::Wake) => {}
                Err(_) => return None,
            }
        }
    }

    /// Waits for the part handed over last: it and the result of its write, or `None` if
    /// the thread is gone (then the part is lost: the caller treats it as a failed write).
    pub(crate) fn wait(&self) -> Option<(Part, io::Result<()>)> {
        // The two writes were started together, so the part is usually done or nearly:
        // spinning for it (yielding the CPU, which the thread may need to finish) saves the
        // wake-up of a parked thread.
        let until = Instant::now() + RESULT_SPIN;
        loop {
            match self.done.try_recv() {
                Ok(done) => return Some(done),
                Err(TryRecvError::Empty) if Instant::now() < until => std::thread::yield_now(),
                Err(TryRecvError::Empty) => return self.done.recv().ok(),
                Err(TryRecvError::Disconnected) => return None,
            }
        }
    }
}

impl Drop for PartWriter {
    fn drop(&mut self) {
        // Closing the channel ends the thread once it has finished its job.
        self.jobs = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

fn run(rx: &Receiver<Job>, tx: &Sender<(Part, io::Result<()>)>, state: &AtomicU8) {
    while let Ok(job) = rx.recv() {
        let part = match job {
            Job::Write(part) => part,
            Job::Wake => match spin_for_part(rx, state) {
                Some(part) => part,
                None => continue,
            },
        };
        let res = write_all_at(&*part.file, part.bytes(), part.offset);
        if tx.send((part, res)).is_err() {
            return;
        }
    }
}

/// After a wake-up: the next part, if it arrives within [`AHEAD_SPIN`] and is not called
/// off.
fn spin_for_part(rx: &Receiver<Job>, state: &AtomicU8) -> Option<Part> {
    state.store(WAITING, Ordering::Release);
    let until = Instant::now() + AHEAD_SPIN;
    let part = loop {
        match rx.try_recv() {
            Ok(Job::Write(part)) => break Some(part),
            Ok(Job::Wake) => {}
            Err(TryRecvError::Empty)
                if Instant::now() < until && state.load(Ordering::Acquire) == WAITING =>
            {
                std::hint::spin_loop()
            }
            Err(_) => break None,
        }
    };
    state.store(IDLE, Ordering::Release);
    part
}
