//! Integration tests of keel-wal, one module per theme.

mod basic;
mod batch;
mod corruption;
mod crash;
mod direct;
mod faults;
mod model;
mod page_bypass;
mod recovery;
mod recycle;
mod release;
mod torn;
mod util;
