//! Integration tests of keel-mvcc, one module per theme, all over the in-memory backend.

mod bad_input;
mod common;
mod compaction;
mod concurrency;
mod conformance;
mod crash;
mod long_read;
mod model;
mod ops;
mod rebuild;
mod record_format;
mod snapshot;
mod watch;
