//! Integration tests of keel-lease, one module per theme.

mod common;
mod crash;
mod lessor;
mod model;
mod table;
