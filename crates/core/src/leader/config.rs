//! [`LeaseConfig`]: which Lease, who we are, and the three timings of client-go.

use std::time::Duration;

/// client-go's `JitterFactor`: candidates retry every `retry_period × (1 + rand × 1.2)`, so the
/// renew deadline must exceed `1.2 × retry_period`.
pub const JITTER_FACTOR: f64 = 1.2;

/// Where and how to elect a leader, with the meaning client-go's `LeaderElectionConfig` gives
/// these fields.
///
/// # Guarantees
/// A configuration that passes [`LeaseConfig::validate`] keeps
/// `lease_duration > renew_deadline > 1.2 × retry_period`: a leader gives up before any other
/// candidate may take its Lease over.
///
/// # Caveats
/// When client-go candidates share the Lease, keep `lease_duration - renew_deadline` at 1 s
/// or more (client-go's defaults leave 5 s): client-go compares Lease records with
/// second-precision timestamps, so with a retry period under 1 s it may miss a renewal made
/// in the same second as the previous one and date the record up to 1 s early.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseConfig {
    /// Name of the `coordination.k8s.io/v1` Lease.
    pub lease_name: String,
    /// Namespace of the Lease.
    pub namespace: String,
    /// This candidate's identity, unique among candidates (see [`LeaseConfig::identity_from_env`]).
    pub identity: String,
    /// How long a non-leader waits, after it last saw the Lease change, before taking it over.
    /// Written to the Lease in whole seconds, rounded up.
    pub lease_duration: Duration,
    /// How long a leader keeps leading without a successful renewal.
    pub renew_deadline: Duration,
    /// Time between attempts to acquire or renew.
    pub retry_period: Duration,
}

impl LeaseConfig {
    /// client-go's default `LeaseDuration`.
    pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);
    /// client-go's default `RenewDeadline`.
    pub const DEFAULT_RENEW_DEADLINE: Duration = Duration::from_secs(10);
    /// client-go's default `RetryPeriod`.
    pub const DEFAULT_RETRY_PERIOD: Duration = Duration::from_secs(2);

    /// A configuration with client-go's default timings: 15 s, 10 s and 2 s.
    pub fn new(
        lease_name: impl Into<String>,
        namespace: impl Into<String>,
        identity: impl Into<String>,
    ) -> Self {
        Self {
            lease_name: lease_name.into(),
            namespace: namespace.into(),
            identity: identity.into(),
            lease_duration: Self::DEFAULT_LEASE_DURATION,
            renew_deadline: Self::DEFAULT_RENEW_DEADLINE,
            retry_period: Self::DEFAULT_RETRY_PERIOD,
        }
    }

    /// Checks the names and `lease_duration > renew_deadline > 1.2 × retry_period > 0`.
    ///
    /// # Errors
    /// The first [`ConfigError`] found.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.lease_name.is_empty() {
            return Err(ConfigError::EmptyLeaseName);
        }
        if self.namespace.is_empty() {
            return Err(ConfigError::EmptyNamespace);
        }
        if self.identity.is_empty() {
            return Err(ConfigError::EmptyIdentity);
        }
        if self.retry_period.is_zero() {
            return Err(ConfigError::ZeroRetryPeriod);
        }
        if self.lease_duration <= self.renew_deadline {
            return Err(ConfigError::LeaseDurationNotAboveRenewDeadline {
                lease_duration: self.lease_duration,
                renew_deadline: self.renew_deadline,
            });
        }
        if self.renew_deadline <= self.retry_period.mul_f64(JITTER_FACTOR) {
            return Err(ConfigError::RenewDeadlineNotAboveJitteredRetryPeriod {
                renew_deadline: self.renew_deadline,
                retry_period: self.retry_period,
            });
        }
        if self.lease_duration > Duration::from_secs(i32::MAX as u64) {
            return Err(ConfigError::LeaseDurationTooLong {
                lease_duration: self.lease_duration,
            });
        }
        Ok(())
    }

    /// `leaseDurationSeconds` as written to the Lease: whole seconds rounded up, so other
    /// candidates never wait less than [`LeaseConfig::lease_duration`].
    pub fn lease_duration_seconds(&self) -> i32 {
        let secs =
            self.lease_duration.as_secs() + u64::from(self.lease_duration.subsec_nanos() > 0);
        i32::try_from(secs).unwrap_or(i32::MAX)
    }

    /// A unique identity for this process: the `POD_NAME` environment variable (set it from
    /// the downward API), else the host name, then `_` and a random suffix, as client-go
    /// users conventionally build it (`hostname_uuid`).
    pub fn identity_from_env() -> String {
        let base = std::env::var("POD_NAME")
            .ok()
            .filter(|name| !name.trim().is_empty())
            .or_else(hostname)
            .unwrap_or_else(|| "steward".to_string());
        format!("{}_{:016x}", base.trim(), rand::random::<u64>())
    }
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|name| name.trim().to_string())
        .filter(|name| !name.is_empty())
}

/// A [`LeaseConfig`] that cannot elect a leader safely.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// `lease_name` is empty.
    #[error("invalid leader election config: the Lease name is empty")]
    EmptyLeaseName,
    /// `namespace` is empty.
    #[error("invalid leader election config: the Lease namespace is empty")]
    EmptyNamespace,
    /// `identity` is empty.
    #[error("invalid leader election config: the candidate identity is empty")]
    EmptyIdentity,
    /// `retry_period` is zero.
    #[error("invalid leader election config: the retry period must be greater than zero")]
    ZeroRetryPeriod,
    /// A leader could still believe it leads when another candidate takes over.
    #[error(
        "invalid leader election config: the lease duration ({lease_duration:?}) must be greater than the renew deadline ({renew_deadline:?})"
    )]
    LeaseDurationNotAboveRenewDeadline {
        /// The configured lease duration.
        lease_duration: Duration,
        /// The configured renew deadline.
        renew_deadline: Duration,
    },
    /// A leader could miss its renew deadline between two jittered retries.
    #[error(
        "invalid leader election config: the renew deadline ({renew_deadline:?}) must be greater than 1.2 × the retry period ({retry_period:?})"
    )]
    RenewDeadlineNotAboveJitteredRetryPeriod {
        /// The configured renew deadline.
        renew_deadline: Duration,
        /// The configured retry period.
        retry_period: Duration,
    },
    /// `leaseDurationSeconds` is an int32.
    #[error(
        "invalid leader election config: the lease duration ({lease_duration:?}) does not fit leaseDurationSeconds"
    )]
    LeaseDurationTooLong {
        /// The configured lease duration.
        lease_duration: Duration,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(lease: u64, renew: u64, retry: u64) -> LeaseConfig {
        LeaseConfig {
            lease_duration: Duration::from_millis(lease),
            renew_deadline: Duration::from_millis(renew),
            retry_period: Duration::from_millis(retry),
            ..LeaseConfig::new("lock", "ns", "me")
        }
    }

    #[test]
    fn defaults_are_client_go_defaults_and_valid() {
        let c = LeaseConfig::new("lock", "ns", "me");
        assert_eq!(
            (c.lease_duration, c.renew_deadline, c.retry_period),
            (
                Duration::from_secs(15),
                Duration::from_secs(10),
                Duration::from_secs(2)
            )
        );
        assert_eq!(c.validate(), Ok(()));
        assert_eq!(c.lease_duration_seconds(), 15);
    }

    #[test]
    fn short_test_timings_are_valid() {
        assert_eq!(config(3000, 2000, 500).validate(), Ok(()));
    }

    #[test]
    fn lease_duration_must_exceed_renew_deadline() {
        assert!(matches!(
            config(10_000, 10_000, 2000).validate(),
            Err(ConfigError::LeaseDurationNotAboveRenewDeadline { .. })
        ));
        assert!(matches!(
            config(5000, 10_000, 2000).validate(),
            Err(ConfigError::LeaseDurationNotAboveRenewDeadline { .. })
        ));
    }

    #[test]
    fn renew_deadline_must_exceed_jittered_retry_period() {
        // 1.2 × 2 s = 2.4 s: 2.4 s is too short, 2.401 s is enough.
        assert!(matches!(
            config(15_000, 2400, 2000).validate(),
            Err(ConfigError::RenewDeadlineNotAboveJitteredRetryPeriod { .. })
        ));
        assert_eq!(config(15_000, 2401, 2000).validate(), Ok(()));
    }

    #[test]
    fn zero_retry_period_and_empty_names_are_rejected() {
        assert_eq!(
            config(3000, 2000, 0).validate(),
            Err(ConfigError::ZeroRetryPeriod)
        );
        let mut c = config(3000, 2000, 500);
        c.identity.clear();
        assert_eq!(c.validate(), Err(ConfigError::EmptyIdentity));
        c = config(3000, 2000, 500);
        c.lease_name.clear();
        assert_eq!(c.validate(), Err(ConfigError::EmptyLeaseName));
        c = config(3000, 2000, 500);
        c.namespace.clear();
        assert_eq!(c.validate(), Err(ConfigError::EmptyNamespace));
    }

    #[test]
    fn error_messages_name_the_values() {
        let msg = config(2000, 2000, 500)
            .validate()
            .expect_err("invalid")
            .to_string();
        assert!(
            msg.contains("lease duration (2s)") && msg.contains("renew deadline (2s)"),
            "{msg}"
        );
    }

    #[test]
    fn lease_duration_seconds_round_up() {
        assert_eq!(config(2500, 2000, 500).lease_duration_seconds(), 3);
        assert_eq!(config(3000, 2000, 500).lease_duration_seconds(), 3);
        assert_eq!(config(400, 300, 100).lease_duration_seconds(), 1);
    }

    #[test]
    fn identity_has_a_random_suffix() {
        let a = LeaseConfig::identity_from_env();
        let b = LeaseConfig::identity_from_env();
        assert_ne!(a, b);
        let (base, suffix) = a.rsplit_once('_').expect("a suffix");
        assert!(!base.is_empty());
        assert_eq!(suffix.len(), 16);
    }
}
