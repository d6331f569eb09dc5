//! keel's revisioned (MVCC) key-value store.

#![forbid(unsafe_code)]

pub mod backend;

pub use backend::{Backend, BackendError, BackendSize, BatchOp, Bucket, ReadTxn, WriteBatch};

#[cfg(feature = "testing")]
pub mod testing;
