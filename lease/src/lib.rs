//! keel lease.

#![forbid(unsafe_code)]
