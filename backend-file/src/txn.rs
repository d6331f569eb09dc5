//! Read transactions: an `Arc` of one published index version.
//!
//! Keys are borrowed from the version's index nodes and values from its mappings; both stay
//! untouched for as long as the transaction holds the version.

use std::sync::Arc;

use keel_mvcc::{BackendError, Bucket, ReadTxn};

use crate::index::Iter;
use crate::version::{Loc, Version};

/// A snapshot read transaction of a [`FileBackend`](crate::FileBackend).
pub struct FileReadTxn {
    version: Arc<Version>,
}

impl FileReadTxn {
    pub(crate) fn new(version: Arc<Version>) -> FileReadTxn {
        FileReadTxn { version }
    }
}

fn missing(loc: Loc) -> BackendError {
    BackendError::Corrupt {
        path: format!("segment {:016x}", loc.seg).into(),
        offset: u64::from(loc.off),
        reason: format!("index points to {} bytes that are not mapped", loc.len),
    }
}

impl ReadTxn for FileReadTxn {
    type Range<'a> = FileRange<'a>;

    fn get(&self, bucket: &Bucket, key: &[u8]) -> Result<Option<&[u8]>, BackendError> {
        let v = &*self.version;
        let Some(&id) = v.names.get(bucket) else {
            return Ok(None);
        };
        match v.maps[id as usize].get(key) {
            None => Ok(None),
            Some(&loc) => v.value(loc).map(Some).ok_or_else(|| missing(loc)),
        }
    }

    fn range<'a>(
        &'a self,
        bucket: &Bucket,
        start: &[u8],
        end: Option<&[u8]>,
    ) -> Result<FileRange<'a>, BackendError> {
        let v = &*self.version;
        let iter = match v.names.get(bucket) {
            Some(&id) => Some(v.maps[id as usize].range(start, end)),
            _ => None,
        };
        Ok(FileRange { version: v, iter })
    }

    fn buckets(&self) -> Result<Vec<Bucket>, BackendError> {
        let v = &*self.version;
        Ok(v.names
            .iter()
            .filter(|(_, id)| !v.maps[**id as usize].is_empty())
            .map(|(b, _)| b.clone())
            .collect())
    }
}

/// Iterator of [`FileReadTxn::range`].
pub struct FileRange<'a> {
    version: &'a Version,
    iter: Option<Iter<'a>>,
}

impl<'a> Iterator for FileRange<'a> {
    type Item = Result<(&'a [u8], &'a [u8]), BackendError>;

    fn next(&mut self) -> Option<Self::Item> {
        let (k, loc) = self.iter.as_mut()?.next()?;
        Some(match self.version.value(loc) {
            Some(v) => Ok((k, v)),
            None => Err(missing(loc)),
        })
    }
}
