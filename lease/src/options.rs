//! Lessor configuration.

use std::time::Duration;

use crate::error::LeaseError;

/// The largest TTL a lease may be granted, in seconds (etcd's `MaxLeaseTTL`).
pub const MAX_LEASE_TTL: i64 = 9_000_000_000;

/// Options for a [`Lessor`](crate::Lessor) (and a [`LeaseTable`](crate::LeaseTable)).
///
/// `Default` gives the documented defaults, which are etcd's; [`validate`](Self::validate)
/// checks a set of options before the lessor uses them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LessorOptions {
    /// The Raft election timeout. It sets the default minimum TTL (1.5 × this, rounded up to
    /// whole seconds) and the default extension given to every lease on promotion.
    /// Default: 1 s.
    pub election_timeout: Duration,
    /// Minimum TTL in seconds: a grant asking for less is raised to it. `None` derives it from
    /// the election timeout (1.5 × `election_timeout`, rounded up to a whole second).
    /// Default: `None` (2 s with the default election timeout).
    pub min_ttl: Option<i64>,
    /// Maximum TTL in seconds: a grant asking for more is refused.
    /// Default: [`MAX_LEASE_TTL`] (9 000 000 000 s), which is also the highest value allowed.
    pub max_ttl: i64,
    /// Time added to every lease's remaining TTL when the lessor becomes primary, so that
    /// clients have time to find the new leader and renew. `None` uses `election_timeout`.
    /// Default: `None` (1 s with the default election timeout).
    pub promote_extension: Option<Duration>,
    /// Expired leases handed out for revocation per second (a token bucket holding at most
    /// one second's worth). Default: 1 000.
    pub expiry_rate: u32,
    /// After an expired lease is handed out, it is handed out again this long later if it has
    /// not been revoked by then (the revoke proposal may have been lost). Default: 3 s.
    pub expired_retry_interval: Duration,
    /// How often the primary checkpoints each long lease's remaining TTL. Leases whose
    /// remaining TTL is not longer than this are not checkpointed. Default: 5 min.
    pub checkpoint_interval: Duration,
    /// Largest number of `(lease, remaining TTL)` records in one checkpoint batch.
    /// Default: 1 000.
    pub checkpoint_batch_limit: usize,
}

impl Default for LessorOptions {
    fn default() -> LessorOptions {
        LessorOptions {
            election_timeout: Duration::from_secs(1),
            min_ttl: None,
            max_ttl: MAX_LEASE_TTL,
            promote_extension: None,
            expiry_rate: 1_000,
            expired_retry_interval: Duration::from_secs(3),
            checkpoint_interval: Duration::from_secs(5 * 60),
            checkpoint_batch_limit: 1_000,
        }
    }
}

impl LessorOptions {
    /// The minimum TTL in effect, in seconds.
    pub fn effective_min_ttl(&self) -> i64 {
        match self.min_ttl {
            Some(ttl) => ttl,
            None => {
                let nanos = self.election_timeout.as_nanos().saturating_mul(3) / 2;
                let secs = nanos.div_ceil(1_000_000_000);
                i64::try_from(secs).unwrap_or(i64::MAX).max(1)
            }
        }
    }

    /// The promotion extension in effect.
    pub fn effective_promote_extension(&self) -> Duration {
        self.promote_extension.unwrap_or(self.election_timeout)
    }

    /// Checks every field; the first problem found is returned as
    /// [`LeaseError::InvalidOption`].
    pub fn validate(&self) -> Result<(), LeaseError> {
        let invalid = |reason: String| Err(LeaseError::InvalidOption(reason));
        if self.election_timeout.is_zero() {
            return invalid("election_timeout must be greater than zero".into());
        }
        if self.max_ttl <= 0 || self.max_ttl > MAX_LEASE_TTL {
            return invalid(format!(
                "max_ttl must be between 1 and {MAX_LEASE_TTL} seconds, got {}",
                self.max_ttl
            ));
        }
        let min = self.effective_min_ttl();
        if min <= 0 || min > self.max_ttl {
            return invalid(format!(
                "min_ttl must be between 1 and max_ttl ({} s), got {min}",
                self.max_ttl
            ));
        }
        if self.expiry_rate == 0 {
            return invalid("expiry_rate must be at least 1 lease per second".into());
        }
        if self.expired_retry_interval.is_zero() {
            return invalid("expired_retry_interval must be greater than zero".into());
        }
        if self.checkpoint_interval < Duration::from_secs(1) {
            return invalid(format!(
                "checkpoint_interval must be at least 1 s, got {:?}",
                self.checkpoint_interval
            ));
        }
        if self.checkpoint_batch_limit == 0 {
            return invalid("checkpoint_batch_limit must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_etcds_and_valid() {
        let o = LessorOptions::default();
        o.validate().unwrap();
        assert_eq!(o.effective_min_ttl(), 2);
        assert_eq!(o.effective_promote_extension(), Duration::from_secs(1));
        let o = LessorOptions {
            election_timeout: Duration::from_secs(10),
            ..LessorOptions::default()
        };
        assert_eq!(o.effective_min_ttl(), 15);
    }

    #[test]
    fn bad_options_are_refused() {
        let bad = [
            LessorOptions {
                election_timeout: Duration::ZERO,
                ..Default::default()
            },
            LessorOptions {
                max_ttl: MAX_LEASE_TTL + 1,
                ..Default::default()
            },
            LessorOptions {
                min_ttl: Some(0),
                ..Default::default()
            },
            LessorOptions {
                min_ttl: Some(100),
                max_ttl: 10,
                ..Default::default()
            },
            LessorOptions {
                expiry_rate: 0,
                ..Default::default()
            },
            LessorOptions {
                checkpoint_interval: Duration::from_millis(10),
                ..Default::default()
            },
            LessorOptions {
                checkpoint_batch_limit: 0,
                ..Default::default()
            },
            LessorOptions {
                expired_retry_interval: Duration::ZERO,
                ..Default::default()
            },
        ];
        for o in bad {
            let err = o.validate().unwrap_err();
            assert!(matches!(err, LeaseError::InvalidOption(_)), "{o:?}: {err}");
        }
    }
}
