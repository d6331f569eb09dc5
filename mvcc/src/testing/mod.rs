//! Test support shared by every backend crate: the backend conformance suite, an in-memory
//! backend, the model-based store test and a chunked snapshot source. Compiled with the
//! `testing` feature.

pub mod chunks;
pub mod conformance;
pub mod crash;
pub mod mem;
pub mod model;

pub use chunks::ChunkCuts;
pub use mem::{MemBackend, MemOptions};
