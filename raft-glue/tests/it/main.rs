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

/// Runs the `#[ignore]`d test `role` of this test binary in a child process with `envs` set,
/// waits until it has printed more than `min_lines` lines and `after` has passed (or `limit`
/// has), kills it with SIGKILL and returns every line it printed. A role prints a line only
/// after what it reports is acknowledged, so the lines are exactly what must survive.
pub fn run_killed(
    role: &str,
    envs: &[(&str, String)],
    min_lines: usize,
    after: std::time::Duration,
    limit: std::time::Duration,
) -> Vec<String> {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(exe)
        .args([
            "--ignored",
            "--exact",
            role,
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the child role");
    let stdout = child.stdout.take().expect("stdout");
    let lines = Arc::new(Mutex::new(Vec::new()));
    let reader = {
        let lines = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                lines.lock().expect("lock").push(line);
            }
        })
    };
    let begun = Instant::now();
    while !(lines.lock().expect("lock").len() > min_lines && begun.elapsed() >= after)
        && begun.elapsed() < limit
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().expect("SIGKILL");
    let _ = child.wait();
    let _ = reader.join();
    std::mem::take(&mut *lines.lock().expect("lock"))
}

/// Asserts that member `n` holds every acknowledged key and lease and applied nothing twice:
/// every key was put exactly once and nothing else changes keys, so each key is at version 1
/// and the store's revision equals the number of keys.
pub fn assert_acknowledged_applied_once(
    n: &keel_raft_glue::Node<keel_raft_glue::testing::TestBackend>,
    keys: &std::collections::BTreeSet<String>,
    leases: &std::collections::BTreeSet<i64>,
) {
    use std::collections::BTreeSet;

    let r = n
        .range(
            &keel_mvcc::RangeRequest::range(b"\0".to_vec(), b"\0".to_vec()),
            keel_raft_glue::ReadConsistency::Serializable,
        )
        .expect("scan");
    let present: BTreeSet<String> = r
        .kvs
        .iter()
        .map(|kv| String::from_utf8_lossy(kv.key()).into_owned())
        .collect();
    let missing: Vec<&String> = keys.difference(&present).take(5).collect();
    assert!(
        missing.is_empty(),
        "member {}: acknowledged keys lost: {missing:?}",
        n.id()
    );
    for kv in &r.kvs {
        assert_eq!(
            kv.version,
            1,
            "member {}: key {:?} was put once, applied once",
            n.id(),
            String::from_utf8_lossy(kv.key())
        );
    }
    assert_eq!(
        n.store().current_revision(),
        r.kvs.len() as u64,
        "member {}: revisions equal the number of puts (no double apply)",
        n.id()
    );
    let known: BTreeSet<i64> = n.lease_list().into_iter().collect();
    let lost: Vec<&i64> = leases.difference(&known).take(5).collect();
    assert!(
        lost.is_empty(),
        "member {}: acknowledged leases lost: {lost:?}",
        n.id()
    );
}
