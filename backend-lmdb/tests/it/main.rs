//! Integration tests of the LMDB backend: the shared backend conformance suite, and what is
//! specific to LMDB (map size, growth, generations, the directory lock).

mod conformance;
