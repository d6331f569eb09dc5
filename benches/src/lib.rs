//! Shared pieces of keel's criterion suites: the references every keel figure is measured
//! against in the same run (raw disk `write` + `fdatasync`, raw LMDB through heed), workload
//! generators, and the ratio report printed after each comparison.

#![forbid(unsafe_code)]

#[cfg(feature = "backend-lmdb")]
pub mod lmdb;
pub mod report;

pub use report::{Better, Recorder};
