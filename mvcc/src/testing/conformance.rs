//! The backend conformance suite: every [`Backend`](crate::Backend) runs the same tests.
