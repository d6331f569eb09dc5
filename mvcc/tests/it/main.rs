//! Integration tests of keel-mvcc, one module per theme, all over the in-memory backend.

mod common;
mod ops;
