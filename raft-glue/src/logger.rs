//! raft-rs logs through `slog`; keel logs through `tracing`. [`TracingDrain`] is the bridge:
//! every slog record becomes a `tracing` event at the matching level, with the record's
//! key-value pairs appended to the message, under the target `keel_raft_glue::raft`.

use std::fmt::{self, Write as _};

use slog::{Drain, KV, Key, OwnedKVList, Record, Serializer};

/// A slog [`Drain`] that forwards every record to `tracing`.
#[derive(Clone, Copy, Debug, Default)]
pub struct TracingDrain;

struct KvLine(String);

impl Serializer for KvLine {
    fn emit_arguments(&mut self, key: Key, val: &fmt::Arguments<'_>) -> slog::Result {
        let _ = write!(self.0, " {key}={val}");
        Ok(())
    }
}

impl Drain for TracingDrain {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, record: &Record<'_>, values: &OwnedKVList) -> Result<(), slog::Never> {
        let mut kv = KvLine(String::new());
        // Serialising into a String cannot fail; a failure would only lose the pairs.
        let _ = record.kv().serialize(record, &mut kv);
        let _ = values.serialize(record, &mut kv);
        let msg = record.msg();
        match record.level() {
            slog::Level::Critical | slog::Level::Error => {
                tracing::error!(target: "keel_raft_glue::raft", "{msg}{}", kv.0)
            }
            slog::Level::Warning => tracing::warn!(target: "keel_raft_glue::raft", "{msg}{}", kv.0),
            slog::Level::Info => tracing::info!(target: "keel_raft_glue::raft", "{msg}{}", kv.0),
            slog::Level::Debug => tracing::debug!(target: "keel_raft_glue::raft", "{msg}{}", kv.0),
            slog::Level::Trace => tracing::trace!(target: "keel_raft_glue::raft", "{msg}{}", kv.0),
        }
        Ok(())
    }
}

/// The slog logger handed to raft-rs for member `id`.
pub fn raft_logger(id: u64) -> slog::Logger {
    slog::Logger::root(TracingDrain.fuse(), slog::o!("member" => id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serializer_collects_pairs() {
        let mut kv = KvLine(String::new());
        kv.emit_arguments("term", &format_args!("{}", 7))
            .unwrap_or(());
        kv.emit_arguments("to", &format_args!("{}", 2))
            .unwrap_or(());
        assert_eq!(kv.0, " term=7 to=2");
        // The drain itself never fails.
        let logger = raft_logger(3);
        slog::info!(logger, "hello"; "x" => 1);
    }
}
