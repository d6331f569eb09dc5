//! Test support shared by every backend crate: the backend conformance suite, an in-memory
//! backend and the model-based store test. Compiled with the `testing` feature.

pub mod conformance;
pub mod crash;
pub mod mem;
pub mod model;

pub use mem::{MemBackend, MemOptions};
