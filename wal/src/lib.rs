//! keel's write-ahead log: the durable source of truth for a Raft log.

#![forbid(unsafe_code)]
