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
