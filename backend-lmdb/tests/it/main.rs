//! Integration tests of the LMDB backend: the shared backend conformance suite, and what is
//! specific to LMDB (map size and growth, generations and recovery, the directory lock across
//! processes, poisoning, crashes).

mod buckets;
mod common;
mod conformance;
mod map;
mod poison;
mod process;
mod recovery;
mod restore;
mod size;
mod snapshot;
mod write_map;
