//! Integration tests of the replicated node, one module per theme, all in one binary.

mod bad_input;
mod learner_scenarios;
mod lease;
mod linearizability;
mod member_process;
mod membership;
mod replication;
mod restart;
mod snapshot;

use std::sync::Once;

/// Routes `tracing` to the test output when `RUST_LOG` is set.
pub fn init_tracing() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_test_writer()
                .try_init();
        }
    });
}
