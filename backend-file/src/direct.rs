//! Writing a restore's frames around the page cache.
//!
//! A restore writes a whole store's worth of frames that nothing reads until it ends. Written
//! through the page cache, each byte is first copied into a cache page by the kernel (for a
//! large restore, the dearest step of the whole load) and later written back all at once,
//! filling the device queue in front of every other writer's `fdatasync` on the same disk.
//! [`DirectWriter`] writes them with `O_DIRECT` instead: straight from an aligned buffer of
//! ours to the disk, in pieces of at most [`PIECE`] bytes, so at most two pieces of the
//! restore (two frames, of `RESTORE_FRAME_BYTES` each) are ever queued on the device. The
//! copies into those buffers and the writes are made by two threads of the writer's own, two
//! frames in flight while the restore encodes the next: a device takes two writes at a time
//! faster than one twice the size (see [`IN_FLIGHT`]).
//!
//! `O_DIRECT` needs offsets, lengths and buffer addresses aligned to the device's block;
//! [`BLOCK`] (4 KiB) covers the devices keel runs on. A frame starts wherever the previous one
//! ended, so each write starts at the block holding the frame's first byte, with that block's
//! earlier bytes (kept from the previous frame, or read back), and stops short of the block
//! holding its last byte, which the next write starts with: two writes in flight never touch
//! the same block. [`DirectWriter::finish`] writes that last block with zeros up to its end
//! (bytes after a segment's last frame are zeros in the format anyway); the file's size, if
//! the write passed it, ends on that boundary. Durability is unchanged: the frames still
//! count only once the segment is synced.
//!
//! A frame is handed over as its bytes ([`Frame::Bytes`]) or, for a restore's batch of a
//! stream received in chunks, as its first bytes followed by put records still to be encoded
//! ([`Frame::Puts`]): places of keys and values in the received chunks, which the job holds
//! (shared) until its thread has encoded them. The thread then encodes the records straight
//! into its aligned buffer, so the stream's bytes are copied once on their way from the chunks
//! to the disk, by the writer threads, instead of once by the restoring thread into a frame
//! and again by a writer thread into its buffer.
//!
//! A file system that refuses `O_DIRECT` (tmpfs, some network file systems) makes the restore
//! fall back to ordinary writes.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;

use memmap2::{Advice, MmapMut};

use crate::format::{PUT_HEADER, TAG_PUT};

/// Alignment of every direct write: offset, length and buffer address.
pub(crate) const BLOCK: usize = 4096;

/// Largest single direct write: the most a restore ever has queued on the device.
pub(crate) const PIECE: usize = 1 << 20;

/// Size and alignment of a transparent huge page on the platforms keel runs on.
const HUGE: usize = 2 << 20;

/// A zero-initialised buffer in an anonymous mapping, starting on a huge-page boundary (so
/// aligned to [`BLOCK`]) and advised into transparent huge pages where the kernel gives them
/// (`transparent_hugepage` set to `madvise` or `always`). A direct write hands the device
/// the buffer's physical pages, one I/O segment per contiguous run: from one huge page that
/// is one segment instead of one per 4 KiB page. (On a virtio disk, 256 KiB direct writes
/// plus `fdatasync` took 133–156 µs from a huge page against 190–234 µs from small pages;
/// see keel-wal's write buffer.) Without huge pages it works the same in small pages. The
/// mapping has one huge page more of address space than the buffer, never touched, to align
/// it.
struct AlignedBuf {
    /// The mapping, `None` while the buffer is empty.
    map: Option<MmapMut>,
    /// Offset of the huge-page boundary in `map` where the buffer starts.
    start: usize,
    /// Bytes of the buffer.
    cap: usize,
}

impl AlignedBuf {
    const fn empty() -> AlignedBuf {
        AlignedBuf {
            map: None,
            start: 0,
            cap: 0,
        }
    }

    /// Makes room for at least `len` bytes (rounded up to whole huge pages); the content is
    /// lost.
    fn reserve(&mut self, len: usize) -> io::Result<()> {
        if len <= self.cap {
            return Ok(());
        }
        let cap = len
            .checked_next_multiple_of(HUGE)
            .filter(|c| *c <= isize::MAX as usize - HUGE)
            .ok_or_else(|| io::Error::new(io::ErrorKind::OutOfMemory, "buffer too large"))?;
        let map = MmapMut::map_anon(cap + HUGE)?;
        let start = map.as_ptr().align_offset(HUGE).min(HUGE);
        // A hint: without huge pages the buffer works the same.
        let _ = map.advise_range(Advice::HugePage, start, cap);
        self.map = Some(map);
        self.start = start;
        self.cap = cap;
        Ok(())
    }

    fn as_slice(&self) -> &[u8] {
        match &self.map {
            Some(map) => &map[self.start..self.start + self.cap],
            None => &[],
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.map {
            Some(map) => &mut map[self.start..self.start + self.cap],
            None => &mut [],
        }
    }
}

/// Put records whose keys and values sit in shared buffers (the chunks of a received
/// snapshot stream), encoded where they are written (see the module doc).
#[derive(Default)]
pub(crate) struct Puts {
    recs: Vec<Put>,
    bufs: Vec<Arc<Vec<u8>>>,
    /// Encoded length of all the records.
    len: usize,
}

/// One put record of [`Puts`]: its key at `key_at` of buffer `buf`, its value right after.
struct Put {
    bucket: u32,
    buf: u32,
    key_at: usize,
    key_len: u32,
    value_len: u32,
}

impl Puts {
    /// Room for `n` records.
    pub(crate) fn with_capacity(n: usize) -> Puts {
        Puts {
            recs: Vec::with_capacity(n),
            bufs: Vec::new(),
            len: 0,
        }
    }

    /// Adds a put of the key at `key_at` of `buf`, followed there by its value, to `bucket`;
    /// returns the offset of its value from the start of the records.
    pub(crate) fn push(
        &mut self,
        bucket: u32,
        buf: &Arc<Vec<u8>>,
        key_at: usize,
        key_len: usize,
        value_len: usize,
    ) -> usize {
        if !self.bufs.last().is_some_and(|b| Arc::ptr_eq(b, buf)) {
            self.bufs.push(buf.clone());
        }
        self.recs.push(Put {
            bucket,
            buf: (self.bufs.len() - 1) as u32,
            key_at,
            key_len: key_len as u32,
            value_len: value_len as u32,
        });
        let value = self.len + PUT_HEADER + key_len;
        self.len = value + value_len;
        value
    }

    /// Encoded length of the records.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Writes the encoded records' bytes from offset `from` (of the records) into `out`,
    /// which must not reach past their end.
    fn copy_to(&self, from: usize, out: &mut [u8]) {
        let mut at = 0usize;
        let mut put = 0usize;
        let mut header = [0u8; PUT_HEADER];
        for r in &self.recs {
            let data = r.key_len as usize + r.value_len as usize;
            let rec_len = PUT_HEADER + data;
            if at + rec_len <= from {
                at += rec_len;
                continue;
            }
            if put >= out.len() {
                break;
            }
            header[0] = TAG_PUT;
            header[1..5].copy_from_slice(&r.bucket.to_le_bytes());
            header[5..9].copy_from_slice(&r.key_len.to_le_bytes());
            header[9..13].copy_from_slice(&r.value_len.to_le_bytes());
            let bytes = &self.bufs[r.buf as usize][r.key_at..r.key_at + data];
            for piece in [&header[..], bytes] {
                let skip = from.saturating_sub(at).min(piece.len());
                let n = (piece.len() - skip).min(out.len() - put);
                out[put..put + n].copy_from_slice(&piece[skip..skip + n]);
                put += n;
                at += piece.len();
            }
        }
    }

    /// Appends the encoded records to `out`.
    pub(crate) fn append_to(&self, out: &mut Vec<u8>) {
        let at = out.len();
        out.resize(at + self.len, 0);
        self.copy_to(0, &mut out[at..]);
    }
}

/// A frame for [`DirectWriter::write_frame`].
pub(crate) enum Frame {
    /// The whole frame.
    Bytes(Vec<u8>),
    /// The frame's first bytes, then put records encoded by the thread writing it.
    Puts(Vec<u8>, Puts),
}

impl Frame {
    fn len(&self) -> usize {
        match self {
            Frame::Bytes(b) => b.len(),
            Frame::Puts(head, puts) => head.len() + puts.len(),
        }
    }

    /// Writes the frame's bytes from offset `from` into `out` (not past the frame's end).
    fn copy_to(&self, from: usize, out: &mut [u8]) {
        match self {
            Frame::Bytes(b) => out.copy_from_slice(&b[from..from + out.len()]),
            Frame::Puts(head, puts) => {
                let mut put = 0;
                if from < head.len() {
                    put = (head.len() - from).min(out.len());
                    out[..put].copy_from_slice(&head[from..from + put]);
                }
                if put < out.len() {
                    puts.copy_to(from + put - head.len(), &mut out[put..]);
                }
            }
        }
    }

    /// The whole frame as bytes.
    fn into_bytes(self) -> Vec<u8> {
        match self {
            Frame::Bytes(b) => b,
            Frame::Puts(mut head, puts) => {
                puts.append_to(&mut head);
                head
            }
        }
    }

    /// A buffer to encode the next frame into (the shared buffers are let go of here).
    fn into_buffer(self) -> Vec<u8> {
        match self {
            Frame::Bytes(b) | Frame::Puts(b, _) => b,
        }
    }
}

/// A write for the writer threads: the first `len` bytes of `head` then `frame`, at `offset`
/// of `file`, encoded into `buf` first. `offset` and `len` are multiples of [`BLOCK`]; when
/// `len` passes the end of `head` and `frame`, the rest is zeros.
struct Job {
    file: Arc<File>,
    offset: u64,
    len: usize,
    head: Vec<u8>,
    frame: Frame,
    /// Run on the frame first (it fills in the frame's checksum).
    seal: Option<fn(&mut [u8])>,
    buf: AlignedBuf,
}

/// What a writer thread hands back after a write: the buffers, and how the write went.
type Done = (AlignedBuf, Vec<u8>, io::Result<()>);

/// Writes in flight at most, and threads making them: the device takes two at a time (a
/// virtual disk measured here wrote 1.2 GB/s with two 512 KiB direct writes in flight, 0.9
/// GB/s with one 1 MiB write at a time, the same bytes queued ahead of other writers' syncs).
/// Not three: in the learner bench (12 alternating pairs on the shared 2-core VM) three made
/// the transfer faster (ratio about 0.68-0.71x against 0.61-0.65x) but the leader's put p99
/// during the transfer unsteady (4.1-8.5 ms against 4.0-4.2 ms with two), past its goal.
const IN_FLIGHT: usize = 2;

/// Direct writes to a segment file, handed over in append order and made by
/// [`IN_FLIGHT`] threads of the writer's own (so they may complete in any order; no two
/// of them write the same block): the caller hands over the frame it encoded and goes on
/// with the next while a thread copies it into an aligned buffer and the disk takes it. A
/// write's failure is reported by a later
/// [`write`](Self::write) or by [`finish`](Self::finish), which must be called (and succeed)
/// before the segment is synced. One writer serves every segment of a restore in turn
/// ([`retarget`](Self::retarget)), keeping its buffers.
pub(crate) struct DirectWriter {
    /// Segment written to.
    pub(crate) segment: u32,
    /// Aligned buffers not in flight.
    spare: Vec<AlignedBuf>,
    /// Frame buffers handed back, for the caller to encode into.
    frames: Vec<Vec<u8>>,
    /// Writes handed to the threads and not yet back.
    in_flight: usize,
    jobs: Option<std::sync::mpsc::SyncSender<Job>>,
    back: std::sync::mpsc::Receiver<Done>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// The segment written to.
    file: Arc<File>,
    /// File offset of the block holding the end of the last write, and that block's bytes
    /// before the end. The writes in flight stop short of that block (so that no two of them
    /// write the same block): it is written by the next write, which starts with it, or by
    /// [`finish`](DirectWriter::finish), zero-padded.
    tail: Option<(u64, Vec<u8>)>,
    /// The block in `tail` is on its way to the disk already (the first write went through
    /// it).
    tail_written: bool,
    /// The first write that failed.
    failed: Option<io::Error>,
    /// The first write is waited for, so that a file system refusing direct writes is found
    /// out while the frame can still be written the ordinary way.
    probed: bool,
    /// The first write's frame, after the file system refused that write (`EINVAL`).
    refused: Option<Vec<u8>>,
    /// Time the caller spent waiting for writes to come back (logged when the writer ends).
    waited: std::time::Duration,
}

fn open_direct(path: &Path) -> io::Result<Option<File>> {
    match OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(file) => Ok(Some(file)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Field `field` of `/proc/thread-self/schedstat` in milliseconds (Linux; -1 where
/// unreadable), for the writer's closing log: 0 is the CPU time the calling thread has run
/// so far, 1 the time it has spent ready to run but waiting for a processor.
fn thread_schedstat_ms(field: usize) -> f64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().nth(field)?.parse::<u64>().ok())
        .map_or(-1.0, |ns| ns as f64 / 1e6)
}

fn writer_thread(
    jobs: Arc<std::sync::Mutex<std::sync::mpsc::Receiver<Job>>>,
    back: std::sync::mpsc::Sender<Done>,
) {
    let mut written = 0u64;
    loop {
        let job = match jobs.lock() {
            Ok(rx) => rx.recv(),
            Err(_) => break,
        };
        let Ok(Job {
            file,
            offset,
            len,
            head,
            frame,
            seal,
            mut buf,
        }) = job
        else {
            break;
        };
        // The whole frame is encoded (its checksum covers all of it), even past `len`.
        let from_head = head.len();
        let end = from_head + frame.len();
        let result = buf.reserve(len.max(end)).and_then(|()| {
            let bytes = buf.as_mut_slice();
            bytes[..from_head].copy_from_slice(&head[..from_head]);
            frame.copy_to(0, &mut bytes[from_head..end]);
            if let Some(seal) = seal {
                seal(&mut bytes[from_head..end]);
            }
            if len > end {
                bytes[end..len].fill(0);
            }
            write_pieces(&file, offset, &buf.as_slice()[..len])
        });
        written += len as u64;
        if back.send((buf, frame.into_buffer(), result)).is_err() {
            break;
        }
    }
    tracing::debug!(
        bytes = written,
        cpu_ms = thread_schedstat_ms(0),
        run_wait_ms = thread_schedstat_ms(1),
        "restore's direct writer done"
    );
}

impl DirectWriter {
    /// Opens `path` (segment `segment`) for direct writes; `Ok(None)` when the file system
    /// refuses `O_DIRECT`.
    pub(crate) fn open(path: &Path, segment: u32) -> io::Result<Option<DirectWriter>> {
        let Some(file) = open_direct(path)? else {
            return Ok(None);
        };
        let (jobs, rx) = std::sync::mpsc::sync_channel::<Job>(IN_FLIGHT);
        let rx = Arc::new(std::sync::Mutex::new(rx));
        let (tx, back) = std::sync::mpsc::channel();
        let mut threads = Vec::with_capacity(IN_FLIGHT);
        for _ in 0..IN_FLIGHT {
            let (rx, tx) = (rx.clone(), tx.clone());
            let spawned = std::thread::Builder::new()
                .name("keel-file-direct".to_owned())
                .spawn(move || writer_thread(rx, tx));
            match spawned {
                Ok(t) => threads.push(t),
                // The threads started end once `jobs` is dropped.
                Err(e) => return Err(e),
            }
        }
        Ok(Some(DirectWriter {
            segment,
            spare: (0..IN_FLIGHT).map(|_| AlignedBuf::empty()).collect(),
            frames: Vec::new(),
            in_flight: 0,
            jobs: Some(jobs),
            back,
            threads,
            file: Arc::new(file),
            tail: None,
            tail_written: false,
            failed: None,
            probed: false,
            refused: None,
            waited: std::time::Duration::ZERO,
        }))
    }

    fn send(&self, job: Job) -> io::Result<()> {
        self.jobs
            .as_ref()
            .ok_or_else(|| io::Error::other("the direct writer is finished"))?
            .send(job)
            .map_err(|_| io::Error::other("the direct writer thread is gone"))
    }

    /// Waits for every write in flight, then writes to segment `segment` at `path` from now
    /// on. `Ok(false)` when that file refuses `O_DIRECT`.
    pub(crate) fn retarget(&mut self, path: &Path, segment: u32) -> io::Result<bool> {
        self.finish()?;
        let Some(file) = open_direct(path)? else {
            return Ok(false);
        };
        self.file = Arc::new(file);
        self.segment = segment;
        self.tail = None;
        Ok(true)
    }

    /// Takes back one write from the threads, noting its outcome.
    fn take_back(&mut self) -> io::Result<()> {
        let waiting = std::time::Instant::now();
        let (buf, frame, result) = self
            .back
            .recv()
            .map_err(|_| io::Error::other("the direct writer thread is gone"))?;
        self.waited += waiting.elapsed();
        self.in_flight -= 1;
        self.spare.push(buf);
        self.frames.push(frame);
        if let Err(e) = result {
            self.failed.get_or_insert(e);
        }
        Ok(())
    }

    fn check(&self) -> io::Result<()> {
        match &self.failed {
            Some(e) => Err(match e.raw_os_error() {
                Some(code) => io::Error::from_raw_os_error(code),
                None => io::Error::new(e.kind(), e.to_string()),
            }),
            None => Ok(()),
        }
    }

    /// Starts writing `frame` at `offset` of the segment, whose bytes before `offset` are
    /// already written (or being written by this writer), and returns an empty buffer to
    /// encode the next frame into. `file` is the segment's ordinary handle, used to read back
    /// the start of the first block when this writer has not written it. `Err` with `EINVAL`
    /// from the first write means the file system took the open but refuses the writes:
    /// [`take_refused`](Self::take_refused) then gives that frame back, to write through the
    /// page cache instead.
    ///
    /// The write stops short of the block holding the frame's end, which the next write
    /// starts with (or [`finish`](Self::finish) writes): two writes in flight never share a
    /// block.
    ///
    /// `seal` is run on the frame before it is written: on a writer thread when the frame
    /// is long enough that its last block does not hold the frame's first bytes (which `seal`
    /// may change, and which the next write's first block would repeat), else right here.
    pub(crate) fn write(
        &mut self,
        file: &File,
        offset: u64,
        frame: Vec<u8>,
        seal: fn(&mut [u8]),
    ) -> io::Result<Vec<u8>> {
        self.write_frame(file, offset, Frame::Bytes(frame), seal)
    }

    /// [`write`](Self::write) of a [`Frame`]: put records of a [`Frame::Puts`] are encoded
    /// on the writer thread, straight into its aligned buffer (a frame too short for `seal`
    /// to run there, or the first one, whose bytes must stay at hand in case the write is
    /// refused, is encoded here). The frame's shared buffers are held until it is encoded.
    pub(crate) fn write_frame(
        &mut self,
        file: &File,
        offset: u64,
        mut frame: Frame,
        seal: fn(&mut [u8]),
    ) -> io::Result<Vec<u8>> {
        if matches!(frame, Frame::Puts(..)) && (!self.probed || frame.len() < 2 * BLOCK) {
            frame = Frame::Bytes(frame.into_bytes());
        }
        let block = offset - offset % BLOCK as u64;
        let head_len = (offset - block) as usize;
        if self.tail.as_ref().is_some_and(|(at, tail)| {
            let append = *at == block && tail.len() == head_len;
            !(append || tail.is_empty() || self.tail_written)
        }) {
            // Not an append to the last write: that write's last block goes out first.
            self.finish()?;
        }
        while self.spare.is_empty() {
            self.take_back()?;
        }
        self.check()?;
        let head = match self.tail.take() {
            _ if head_len == 0 => Vec::new(),
            Some((at, tail)) if at == block && tail.len() == head_len => tail,
            _ => {
                // Not written by this writer, so not in flight: read it back.
                let mut head = vec![0u8; head_len];
                file.read_exact_at(&mut head, block)?;
                head
            }
        };
        let seal = match &mut frame {
            Frame::Bytes(bytes) if bytes.len() < 2 * BLOCK => {
                seal(bytes);
                None
            }
            _ => Some(seal),
        };
        // The bytes of the block where this write ends, for the next write's head (past the
        // frame's first block, so not changed by `seal`).
        let end = head_len + frame.len();
        let last = end - end % BLOCK;
        let mut tail = vec![0u8; end - last];
        if last >= head_len {
            frame.copy_to(last - head_len, &mut tail);
        } else {
            tail[..head_len - last].copy_from_slice(&head[last..]);
            frame.copy_to(0, &mut tail[head_len - last..]);
        }
        self.tail = Some((block + last as u64, tail));
        // The first write goes through its last block (zero-padded) and is waited for: a
        // refusal is found out while the frame is still at hand.
        let len = if self.probed {
            last
        } else {
            end.div_ceil(BLOCK) * BLOCK
        };
        self.tail_written = len > last;
        if len == 0 {
            // All of it is in the block the next write starts with.
            self.frames.push(frame.into_buffer());
        } else {
            let buf = self.spare.pop().unwrap_or_else(AlignedBuf::empty);
            self.send(Job {
                file: self.file.clone(),
                offset: block,
                len,
                head,
                frame,
                seal,
                buf,
            })?;
            self.in_flight += 1;
        }
        if !self.probed {
            self.probed = true;
            if let Err(e) = self.finish() {
                if e.raw_os_error() == Some(libc::EINVAL) {
                    // The only write made so far: its frame is the one handed back.
                    self.refused = self.frames.pop();
                }
                return Err(e);
            }
        }
        let mut next = self.frames.pop().unwrap_or_default();
        next.clear();
        Ok(next)
    }

    /// After [`write`](Self::write) failed with `EINVAL` because the file system refused
    /// this writer's first write: that write's frame, to be written the ordinary way. `None`
    /// after any other failure, whose frame is lost.
    pub(crate) fn take_refused(&mut self) -> Option<Vec<u8>> {
        self.refused.take()
    }

    /// Waits for every write in flight and writes the block holding the end of the last one
    /// (zero-padded); the first failure of any write, if one failed.
    pub(crate) fn finish(&mut self) -> io::Result<()> {
        while self.in_flight > 0 {
            self.take_back()?;
        }
        self.check()?;
        if let Some((at, tail)) = &self.tail
            && !tail.is_empty()
            && !self.tail_written
        {
            let job = Job {
                file: self.file.clone(),
                offset: *at,
                len: BLOCK,
                head: tail.clone(),
                frame: Frame::Bytes(Vec::new()),
                seal: None,
                buf: self.spare.pop().unwrap_or_else(AlignedBuf::empty),
            };
            self.send(job)?;
            self.in_flight += 1;
            self.take_back()?;
            self.check()?;
            self.tail_written = true;
        }
        Ok(())
    }
}

impl Drop for DirectWriter {
    fn drop(&mut self) {
        tracing::debug!(
            waited_ms = self.waited.as_secs_f64() * 1e3,
            "restore's direct writes waited for"
        );
        self.jobs = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Writes `buf` at `offset` in pieces of at most [`PIECE`] bytes, one after the other.
fn write_pieces(file: &File, offset: u64, buf: &[u8]) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let n = (buf.len() - done).min(PIECE);
        file.write_all_at(&buf[done..done + n], offset + done as u64)?;
        done += n;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format;

    /// Put records encoded from shared buffers are the bytes `format::put_put` writes, read
    /// from any offset; and frames of them written through the writer threads land byte for
    /// byte as the same frames handed over whole, sealed alike.
    #[test]
    fn puts_encode_as_put_put_and_land_alike() {
        let chunks: Vec<Arc<Vec<u8>>> = (0..3)
            .map(|c| Arc::new((0..70_000).map(|j| (c * 17 + j * 13) as u8).collect()))
            .collect();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n) as usize
        };
        // Frames of random puts (some long enough to be encoded on a writer thread, some
        // not), each with a head of a few bytes, as a restore builds them.
        let mut frames: Vec<(Vec<u8>, Puts, Vec<u8>)> = Vec::new();
        for f in 0..12 {
            let head: Vec<u8> = (0..16 + f).map(|i| (i * 3 + f) as u8).collect();
            let mut puts = Puts::with_capacity(0);
            let mut whole = head.clone();
            for _ in 0..[1, 3, 40][f % 3] {
                let chunk = &chunks[next(3) as u64 as usize];
                let (klen, vlen) = (1 + next(40), next(3000));
                let at = next((chunk.len() - klen - vlen) as u64);
                let bucket = next(5) as u32;
                let value = puts.push(bucket, chunk, at, klen, vlen);
                let want = format::put_put(
                    &mut whole,
                    bucket,
                    &chunk[at..at + klen],
                    &chunk[at + klen..at + klen + vlen],
                );
                assert_eq!(head.len() + value, want, "value offset");
            }
            assert_eq!(head.len() + puts.len(), whole.len(), "encoded length");
            let mut appended = head.clone();
            puts.append_to(&mut appended);
            assert!(
                appended == whole,
                "frame {f}: records differ from put_put's"
            );
            for _ in 0..20 {
                let from = next(puts.len() as u64 + 1);
                let n = next((puts.len() - from) as u64 + 1);
                let mut out = vec![0u8; n];
                puts.copy_to(from, &mut out);
                let at = head.len() + from;
                assert!(
                    out == whole[at..at + n],
                    "frame {f}: bytes {from}+{n} differ"
                );
            }
            frames.push((head, puts, whole));
        }
        let seal: fn(&mut [u8]) = |frame| {
            let crc = crc32fast::hash(&frame[8..]);
            frame[4..8].copy_from_slice(&crc.to_le_bytes());
        };
        let Some((_dir, file, mut w)) = scratch_segment(&[7u8; 100]) else {
            return;
        };
        let mut expected = vec![7u8; 100];
        let mut offset = expected.len() as u64;
        for (head, puts, whole) in frames {
            let mut sealed = whole.clone();
            seal(&mut sealed);
            expected.extend_from_slice(&sealed);
            w.write_frame(&file, offset, Frame::Puts(head, puts), seal)
                .expect("write");
            offset += whole.len() as u64;
        }
        w.finish().expect("finish");
        let mut got = vec![0u8; expected.len()];
        file.read_exact_at(&mut got, 0).expect("read back");
        assert!(got == expected, "frames of shared puts landed differently");
        drop(w);
        assert!(
            chunks.iter().all(|c| Arc::strong_count(c) == 1),
            "the writer kept a shared buffer after its writes finished"
        );
    }

    /// A segment file in a temporary directory holding `header`, and a direct writer on it
    /// with one thread; `None` where the file system refuses `O_DIRECT` (nothing to check).
    fn scratch_segment(header: &[u8]) -> Option<(tempfile::TempDir, std::fs::File, DirectWriter)> {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("seg");
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("create");
        file.write_all_at(header, 0).expect("header");
        let w = DirectWriter::open(&path, 1).expect("open")?;
        Some((dir, file, w))
    }

    #[test]
    fn unaligned_appends_land_byte_for_byte() {
        let header = vec![0xAB; 37];
        let Some((_dir, file, mut w)) = scratch_segment(&header) else {
            return;
        };
        let mut expected = header.clone();
        let mut offset = header.len() as u64;
        for (i, len) in [1usize, 4095, 4096, 5000, PIECE + 3, 17, 3 * PIECE, 1]
            .into_iter()
            .enumerate()
        {
            let data: Vec<u8> = (0..len).map(|j| (i * 31 + j * 7) as u8).collect();
            expected.extend_from_slice(&data);
            w.write(&file, offset, data, |_| {}).expect("write");
            offset += len as u64;
        }
        w.finish().expect("finish");
        let mut got = vec![0u8; expected.len()];
        file.read_exact_at(&mut got, 0).expect("read back");
        assert!(
            got == expected,
            "file content differs from what was written"
        );
        let size = file.metadata().expect("metadata").len();
        assert_eq!(size % BLOCK as u64, 0, "file ends off a block boundary");
        let mut rest = vec![1u8; (size - offset) as usize];
        file.read_exact_at(&mut rest, offset).expect("read padding");
        assert!(rest.iter().all(|&b| b == 0), "padding is not zeros");

        // A write elsewhere than at the end of the last one: the last one's final block,
        // held back for an append, is written first.
        let data = vec![0x5Au8; 3 * BLOCK + 10];
        w.write(&file, offset, data.clone(), |_| {}).expect("write");
        let far = (offset + 10 * BLOCK as u64) / BLOCK as u64 * BLOCK as u64 + 100;
        // The space is there (as a store prepares it), so that the far block reads back.
        file.set_len(far + BLOCK as u64).expect("extend");
        w.write(&file, far, vec![0xA5; 50], |_| {})
            .expect("write far");
        w.finish().expect("finish");
        let mut got = vec![0u8; data.len()];
        file.read_exact_at(&mut got, offset).expect("read back");
        assert!(got == data, "the last block of a write was lost");
        let mut got = vec![0u8; 50];
        file.read_exact_at(&mut got, far).expect("read back far");
        assert!(got.iter().all(|&b| b == 0xA5), "the far write did not land");

        // A write in the block the last one ended in, but past a gap after it: the held-back
        // block is written first (else its bytes would be lost), and the new write starts
        // from the block as the file then holds it.
        let at = far + 50;
        let data = vec![0x3Cu8; 2 * BLOCK + 7];
        w.write(&file, at, data.clone(), |_| {}).expect("write");
        let next = at + data.len() as u64 + 9;
        w.write(&file, next, vec![0x11; 20], |_| {})
            .expect("write past a gap");
        w.finish().expect("finish");
        let mut got = vec![0xFFu8; data.len() + 9 + 20];
        file.read_exact_at(&mut got, at).expect("read back");
        let mut want = data;
        want.extend_from_slice(&[0; 9]);
        want.extend_from_slice(&[0x11; 20]);
        assert!(
            got == want,
            "a write into the held-back block lost bytes before it"
        );
    }
}
