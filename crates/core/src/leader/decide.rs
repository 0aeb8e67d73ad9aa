//! The pure part of the election: what to do with the Lease we read, and what to write.
//!
//! Nothing here reads a clock or calls the API server: the caller passes how long the record
//! has stayed unchanged on its own monotonic clock and the wall-clock time to write.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::LeaseSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use tokio::time::Instant;

/// What a candidate does after reading the Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Write the Lease with us as holder.
    Write(Write),
    /// Another candidate holds a Lease that has not expired on our clock.
    Wait {
        holder: String,
        expires_in: Duration,
    },
}

/// How a candidate writes itself into the Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Write {
    /// There is no Lease: create it.
    Create,
    /// We hold the Lease: renew it, keeping `acquireTime` and `leaseTransitions`.
    Renew,
    /// Nobody holds the Lease, or its holder has not renewed for its `leaseDurationSeconds`:
    /// take it over (`leaseTransitions + 1`).
    TakeOver { previous: Option<String> },
}

/// Decides like client-go's `tryAcquireOrRenew`.
///
/// `unchanged_for` is how long, on this process's monotonic clock, the Lease spec has been
/// exactly `observed` (since we first read it). The Lease's own timestamps are never
/// compared with this process's wall clock.
pub(crate) fn decide(
    observed: Option<&LeaseSpec>,
    unchanged_for: Duration,
    identity: &str,
) -> Decision {
    let Some(spec) = observed else {
        return Decision::Write(Write::Create);
    };
    let holder = spec.holder_identity.as_deref().unwrap_or_default();
    if holder == identity {
        return Decision::Write(Write::Renew);
    }
    if holder.is_empty() {
        return Decision::Write(Write::TakeOver { previous: None });
    }
    let lease_duration =
        Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0));
    match lease_duration.checked_sub(unchanged_for) {
        Some(expires_in) if !expires_in.is_zero() => Decision::Wait {
            holder: holder.to_string(),
            expires_in,
        },
        _ => Decision::Write(Write::TakeOver {
            previous: Some(holder.to_string()),
        }),
    }
}

/// The spec to write, as client-go's `tryAcquireOrRenew` builds it (fields it does not
/// know, such as `preferredHolder` and `strategy`, are cleared as client-go does).
pub(crate) fn next_spec(
    write: &Write,
    observed: Option<&LeaseSpec>,
    identity: &str,
    lease_duration_seconds: i32,
    now: Timestamp,
) -> LeaseSpec {
    let transitions = observed.and_then(|s| s.lease_transitions).unwrap_or(0);
    let (acquire_time, lease_transitions) = match write {
        Write::Create => (MicroTime(now), 0),
        Write::Renew => (
            observed
                .and_then(|s| s.acquire_time.clone())
                .unwrap_or(MicroTime(now)),
            transitions,
        ),
        Write::TakeOver { .. } => (MicroTime(now), transitions.saturating_add(1)),
    };
    LeaseSpec {
        holder_identity: Some(identity.to_string()),
        lease_duration_seconds: Some(lease_duration_seconds),
        acquire_time: Some(acquire_time),
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(lease_transitions),
        ..LeaseSpec::default()
    }
}

/// The spec client-go's `ReleaseOnCancel` writes: no holder, `leaseDurationSeconds: 1`,
/// `acquireTime = renewTime = now`, `leaseTransitions` unchanged. Followers take over at
/// their next retry.
pub(crate) fn released_spec(observed: Option<&LeaseSpec>, now: Timestamp) -> LeaseSpec {
    LeaseSpec {
        holder_identity: Some(String::new()),
        lease_duration_seconds: Some(1),
        acquire_time: Some(MicroTime(now)),
        renew_time: Some(MicroTime(now)),
        lease_transitions: Some(observed.and_then(|s| s.lease_transitions).unwrap_or(0)),
        ..LeaseSpec::default()
    }
}

/// The Lease spec as last read, and since when (monotonic clock) it has been exactly that.
#[derive(Clone, Debug)]
pub(crate) struct Observation {
    pub spec: LeaseSpec,
    pub since: Instant,
}

impl Observation {
    /// Records a read at `now`: the clock restarts only when any field of the spec changed.
    pub fn update(previous: Option<Observation>, spec: LeaseSpec, now: Instant) -> Observation {
        match previous {
            Some(prev) if prev.spec == spec => prev,
            _ => Observation { spec, since: now },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ME: &str = "me_1";

    /// A Lease spec, builder style: `spec().held_by("a").for_secs(3)`.
    fn spec() -> LeaseSpec {
        LeaseSpec::default()
    }

    trait SpecExt {
        fn held_by(self, holder: &str) -> Self;
        fn for_secs(self, secs: i32) -> Self;
        fn transitions(self, n: i32) -> Self;
        fn renewed_at(self, secs: i64) -> Self;
    }

    impl SpecExt for LeaseSpec {
        fn held_by(mut self, holder: &str) -> Self {
            self.holder_identity = Some(holder.into());
            self
        }
        fn for_secs(mut self, secs: i32) -> Self {
            self.lease_duration_seconds = Some(secs);
            self
        }
        fn transitions(mut self, n: i32) -> Self {
            self.lease_transitions = Some(n);
            self
        }
        fn renewed_at(mut self, secs: i64) -> Self {
            let t = at(secs);
            self.acquire_time = Some(MicroTime(t));
            self.renew_time = Some(MicroTime(t));
            self
        }
    }

    fn at(secs: i64) -> Timestamp {
        Timestamp::from_second(secs).expect("valid timestamp")
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn missing_lease_is_created() {
        assert_eq!(
            decide(None, Duration::ZERO, ME),
            Decision::Write(Write::Create)
        );
    }

    #[test]
    fn own_lease_is_renewed_whatever_its_age() {
        let s = spec().held_by(ME).for_secs(3);
        assert_eq!(decide(Some(&s), ms(0), ME), Decision::Write(Write::Renew));
        assert_eq!(
            decide(Some(&s), ms(60_000), ME),
            Decision::Write(Write::Renew)
        );
    }

    #[test]
    fn fresh_foreign_lease_is_waited_for() {
        let s = spec().held_by("other").for_secs(3);
        assert_eq!(
            decide(Some(&s), ms(0), ME),
            Decision::Wait {
                holder: "other".into(),
                expires_in: ms(3000)
            }
        );
        assert_eq!(
            decide(Some(&s), ms(2999), ME),
            Decision::Wait {
                holder: "other".into(),
                expires_in: ms(1)
            }
        );
    }

    #[test]
    fn foreign_lease_unchanged_for_its_duration_is_taken_over() {
        let s = spec().held_by("other").for_secs(3);
        assert_eq!(
            decide(Some(&s), ms(3000), ME),
            Decision::Write(Write::TakeOver {
                previous: Some("other".into())
            })
        );
        assert_eq!(
            decide(Some(&s), ms(9000), ME),
            Decision::Write(Write::TakeOver {
                previous: Some("other".into())
            })
        );
    }

    #[test]
    fn the_holders_lease_duration_counts_not_ours() {
        // A released Lease says 1 s: it expires after 1 s even if we were configured for 15 s.
        let s = spec().held_by("other").for_secs(1);
        assert!(matches!(
            decide(Some(&s), ms(1000), ME),
            Decision::Write(Write::TakeOver { .. })
        ));
    }

    #[test]
    fn released_or_empty_lease_is_taken_over_at_once() {
        let released = released_spec(
            Some(&spec().held_by("other").transitions(4)),
            Timestamp::UNIX_EPOCH,
        );
        assert_eq!(
            decide(Some(&released), ms(0), ME),
            Decision::Write(Write::TakeOver { previous: None })
        );
        assert_eq!(
            decide(Some(&spec()), ms(0), ME),
            Decision::Write(Write::TakeOver { previous: None })
        );
    }

    #[test]
    fn lease_without_duration_is_expired() {
        let s = spec().held_by("other");
        assert!(matches!(
            decide(Some(&s), ms(0), ME),
            Decision::Write(Write::TakeOver { .. })
        ));
    }

    #[test]
    fn wall_clock_timestamps_in_the_lease_do_not_matter() {
        // renewTime far in the past or future: only the local observation age decides.
        for renewed in [0, 4_000_000_000] {
            let s = spec().held_by("other").for_secs(15).renewed_at(renewed);
            assert!(matches!(
                decide(Some(&s), ms(1000), ME),
                Decision::Wait { .. }
            ));
            assert!(matches!(
                decide(Some(&s), ms(15_000), ME),
                Decision::Write(Write::TakeOver { .. })
            ));
        }
    }

    #[test]
    fn create_starts_at_zero_transitions() {
        let now = at(1000);
        let s = next_spec(&Write::Create, None, ME, 15, now);
        assert_eq!(s.holder_identity.as_deref(), Some(ME));
        assert_eq!(s.lease_duration_seconds, Some(15));
        assert_eq!(s.lease_transitions, Some(0));
        assert_eq!(s.acquire_time, Some(MicroTime(now)));
        assert_eq!(s.renew_time, Some(MicroTime(now)));
    }

    #[test]
    fn renew_keeps_acquire_time_and_transitions() {
        let old = spec()
            .held_by(ME)
            .for_secs(15)
            .transitions(7)
            .renewed_at(1000);
        let now = at(1002);
        let s = next_spec(&Write::Renew, Some(&old), ME, 15, now);
        assert_eq!(s.acquire_time, old.acquire_time);
        assert_eq!(s.renew_time, Some(MicroTime(now)));
        assert_eq!(s.lease_transitions, Some(7));
    }

    #[test]
    fn take_over_increments_transitions_and_resets_acquire_time() {
        let old = spec()
            .held_by("other")
            .for_secs(15)
            .transitions(7)
            .renewed_at(1000);
        let now = at(1020);
        let w = Write::TakeOver {
            previous: Some("other".into()),
        };
        let s = next_spec(&w, Some(&old), ME, 3, now);
        assert_eq!(s.holder_identity.as_deref(), Some(ME));
        assert_eq!(s.lease_duration_seconds, Some(3));
        assert_eq!(s.lease_transitions, Some(8));
        assert_eq!(s.acquire_time, Some(MicroTime(now)));
    }

    #[test]
    fn release_clears_holder_like_client_go() {
        let old = spec()
            .held_by(ME)
            .for_secs(15)
            .transitions(2)
            .renewed_at(1000);
        let now = at(1005);
        let s = released_spec(Some(&old), now);
        assert_eq!(s.holder_identity.as_deref(), Some(""));
        assert_eq!(s.lease_duration_seconds, Some(1));
        assert_eq!(s.lease_transitions, Some(2));
        assert_eq!(s.renew_time, Some(MicroTime(now)));
        assert_eq!(s.acquire_time, Some(MicroTime(now)));
    }

    #[test]
    fn observation_clock_restarts_only_on_change() {
        let t0 = Instant::now();
        let t1 = t0 + ms(500);
        let s = spec().held_by("other").for_secs(3).renewed_at(1000);
        let first = Observation::update(None, s.clone(), t0);
        let same = Observation::update(Some(first), s.clone(), t1);
        assert_eq!(
            same.since, t0,
            "an unchanged record keeps its first observation time"
        );
        let changed = Observation::update(Some(same), s.renewed_at(1001), t1);
        assert_eq!(changed.since, t1, "a renewal restarts the clock");
        let transitions = Observation::update(
            Some(changed.clone()),
            changed.spec.clone().transitions(1),
            t1 + ms(1),
        );
        assert_eq!(transitions.since, t1 + ms(1), "any field counts");
    }
}
