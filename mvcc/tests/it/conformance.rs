//! The in-memory test backend passes keel's backend conformance suite.

use keel_mvcc::testing::{MemBackend, MemOptions};

keel_mvcc::backend_conformance_tests!(MemBackend, MemOptions::default());
