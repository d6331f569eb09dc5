//! keel raft-glue.

#![forbid(unsafe_code)]
