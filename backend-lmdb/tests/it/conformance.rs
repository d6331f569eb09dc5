//! The LMDB backend passes keel's backend conformance suite.

use keel_backend_lmdb::{LmdbBackend, LmdbOptions};

keel_mvcc::backend_conformance_tests!(LmdbBackend, LmdbOptions::default());
