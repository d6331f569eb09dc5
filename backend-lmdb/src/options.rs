//! Options of an [`LmdbBackend`](crate::LmdbBackend).

use keel_mvcc::BackendError;

/// Granularity of the map size: a multiple of every page size LMDB may run with.
pub const MAP_SIZE_UNIT: u64 = 64 << 10;

/// Options for [`LmdbBackend::open`](keel_mvcc::Backend::open).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LmdbOptions {
    /// Largest size the store's data file may reach, in bytes, rounded up to a multiple of
    /// 64 KiB. This much address space is reserved (not written) at open; a commit that
    /// would need more fails with [`BackendError::Full`] and the map can be enlarged with
    /// [`LmdbBackend::grow_map`](crate::LmdbBackend::grow_map) or by reopening with a larger
    /// value. The value applies at each open; one below the size of the data already stored
    /// is raised to that size (LMDB never maps less), which
    /// [`LmdbBackend::map_size`](crate::LmdbBackend::map_size) then reports. Default: 8 GiB.
    pub map_size: u64,
    /// Most read transactions open at once (LMDB reader slots). Opening one more fails
    /// until one is dropped. Default: 1024.
    pub max_readers: u32,
    /// Whether [`commit`](keel_mvcc::Backend::commit) flushes to stable storage before
    /// returning. `false` keeps commits atomic but lets the last ones be lost in a power cut
    /// or OS crash (not in a process crash); meant for bulk loads and benchmarks.
    /// Default: true.
    pub sync_on_commit: bool,
    /// Most buckets the store holds (each is an LMDB named database). A commit creating one
    /// more fails with [`LmdbError::TooManyBuckets`](crate::LmdbError::TooManyBuckets). The
    /// value applies at each open. Default: 128.
    pub max_buckets: u32,
    /// Whether LMDB writes pages in place through a writable memory map (`MDB_WRITEMAP`)
    /// instead of copying each dirty page into the page cache with `writev` at commit; a
    /// synced commit then flushes the map with `msync`. It saves that copy (the bulk of a large
    /// commit's CPU time), at two costs: the map is writable, so a stray write into it (a bug
    /// in unsafe code anywhere in the process) lands in the data file and can corrupt it,
    /// where a read-only map would fault instead; and LMDB extends the data file, sparsely,
    /// to the whole map size at open, so tools that list file lengths show `map_size` bytes
    /// (the backend's on-disk size counts the blocks allocated) and a file system without
    /// sparse files would allocate all of it. Commits stay atomic and, with
    /// `sync_on_commit`, durable in either mode. The value applies at each open.
    /// Default: false.
    pub write_map: bool,
}

impl Default for LmdbOptions {
    fn default() -> Self {
        LmdbOptions {
            map_size: 8 << 30,
            max_readers: 1024,
            sync_on_commit: true,
            max_buckets: 128,
            write_map: false,
        }
    }
}

impl LmdbOptions {
    /// Checks every field; [`open`](keel_mvcc::Backend::open) calls it first.
    pub fn validate(&self) -> Result<(), BackendError> {
        if self.map_size < 1 << 20 {
            return Err(BackendError::InvalidOption(format!(
                "map_size {} is below the 1 MiB minimum",
                self.map_size
            )));
        }
        if usize::try_from(self.map_size.saturating_add(MAP_SIZE_UNIT)).is_err()
            || self.map_size > isize::MAX as u64 / 2
        {
            return Err(BackendError::InvalidOption(format!(
                "map_size {} does not fit this platform's address space",
                self.map_size
            )));
        }
        if self.max_buckets == 0 || self.max_buckets > 32_000 {
            return Err(BackendError::InvalidOption(format!(
                "max_buckets {} is outside 1..=32000",
                self.max_buckets
            )));
        }
        if self.max_readers == 0 {
            return Err(BackendError::InvalidOption(
                "max_readers must be at least 1".to_owned(),
            ));
        }
        Ok(())
    }

    /// The map size in bytes as LMDB gets it: rounded up to a multiple of [`MAP_SIZE_UNIT`].
    pub(crate) fn rounded_map_size(&self) -> usize {
        round_map_size(self.map_size)
    }
}

/// Rounds `bytes` up to a multiple of [`MAP_SIZE_UNIT`]; callers have checked it fits.
pub(crate) fn round_map_size(bytes: u64) -> usize {
    let rounded = bytes.div_ceil(MAP_SIZE_UNIT).saturating_mul(MAP_SIZE_UNIT);
    usize::try_from(rounded).unwrap_or(usize::MAX - (usize::MAX % MAP_SIZE_UNIT as usize))
}
