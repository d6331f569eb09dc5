//! Pure-Rust memory-mapped backend for keel-mvcc.

#![deny(unsafe_op_in_unsafe_fn)]
