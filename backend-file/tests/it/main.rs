//! Integration tests of keel-backend-file: one binary, one module per theme.

mod basic;
mod conformance;
mod corruption;
mod crash;
mod faults;
mod mvcc;
mod prepared;
mod restore;
mod restore_races;
mod support;
