//! Integration tests of keel-lease, one module per theme.

mod table;
