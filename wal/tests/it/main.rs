//! Integration tests of keel-wal, one module per theme.

mod basic;
mod util;
