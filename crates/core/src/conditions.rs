//! Status conditions following `metav1.Condition`.
//!
//! `lastTransitionTime` changes only when a condition's status changes, so a reconcile that
//! finds nothing new computes the same status as before and [`crate::status`] skips the write.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

/// Standard condition types.
pub const READY: &str = "Ready";
/// Condition type: work toward the desired state is under way.
pub const PROGRESSING: &str = "Progressing";
/// Condition type: the object works, but not as well as desired.
pub const DEGRADED: &str = "Degraded";

/// A condition a decide step wants: a value its unit tests compare, set by [`set_wanted`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Wanted {
    /// `True` or `False`.
    pub status: bool,
    /// Why, in one CamelCase word.
    pub reason: &'static str,
    /// For a person.
    pub message: String,
}

impl Wanted {
    /// The condition holds (`True`).
    pub fn holds(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: true,
            reason,
            message: message.into(),
        }
    }

    /// The condition does not hold (`False`).
    pub fn fails(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: false,
            reason,
            message: message.into(),
        }
    }
}

/// Sets condition `type_` as `wanted` says, or removes it (`None`: it does not apply);
/// returns whether anything changed.
pub fn set_wanted(
    conditions: &mut Vec<Condition>,
    type_: &str,
    wanted: Option<&Wanted>,
    observed_generation: Option<i64>,
) -> bool {
    match wanted {
        Some(w) => set(
            conditions,
            type_,
            w.status,
            w.reason,
            w.message.clone(),
            observed_generation,
        ),
        None => {
            let before = conditions.len();
            conditions.retain(|c| c.type_ != type_);
            conditions.len() != before
        }
    }
}

/// Sets condition `type_` in `conditions`, returning whether anything changed.
///
/// # Guarantees
/// `last_transition_time` is kept when the status is unchanged, set to now otherwise.
/// Reason must be CamelCase (as the API server requires); an empty reason becomes `Unknown`.
pub fn set(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: impl Into<String>,
    observed_generation: Option<i64>,
) -> bool {
    set_at(
        conditions,
        type_,
        status,
        reason,
        message.into(),
        observed_generation,
        now(),
    )
}

/// Sets `Ready` to false saying why a reconcile failed: `error`'s reason
/// ([`crate::ReconcileError::reason`]) and its message with its sources ([`crate::chain`]).
/// Returns whether anything changed.
pub fn failed<E: crate::ReconcileError>(
    conditions: &mut Vec<Condition>,
    error: &E,
    observed_generation: Option<i64>,
) -> bool {
    set(
        conditions,
        READY,
        false,
        error.reason(),
        crate::chain(error),
        observed_generation,
    )
}

/// [`set`] with an explicit time (for tests).
pub fn set_at(
    conditions: &mut Vec<Condition>,
    type_: &str,
    status: bool,
    reason: &str,
    message: String,
    observed_generation: Option<i64>,
    at: Time,
) -> bool {
    let status = if status { "True" } else { "False" }.to_string();
    let reason = if reason.is_empty() {
        "Unknown".to_string()
    } else {
        reason.to_string()
    };
    match conditions.iter_mut().find(|c| c.type_ == type_) {
        Some(existing) => {
            let transition = existing.status != status;
            let changed = transition
                || existing.reason != reason
                || existing.message != message
                || existing.observed_generation != observed_generation;
            if transition {
                existing.last_transition_time = at;
            }
            existing.status = status;
            existing.reason = reason;
            existing.message = message;
            existing.observed_generation = observed_generation;
            changed
        }
        None => {
            conditions.push(Condition {
                type_: type_.to_string(),
                status,
                reason,
                message,
                observed_generation,
                last_transition_time: at,
            });
            true
        }
    }
}

/// The condition of `type_`, if present.
pub fn get<'a>(conditions: &'a [Condition], type_: &str) -> Option<&'a Condition> {
    conditions.iter().find(|c| c.type_ == type_)
}

/// Whether condition `type_` is present with status `True`.
pub fn is_true(conditions: &[Condition], type_: &str) -> bool {
    get(conditions, type_).is_some_and(|c| c.status == "True")
}

/// Now, truncated to seconds (as `metav1.Time` serializes), so a re-read compares equal.
pub fn now() -> Time {
    use k8s_openapi::jiff::Timestamp;
    let now = Timestamp::now();
    Time(Timestamp::from_second(now.as_second()).unwrap_or(now))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A wanted condition is set, and taken away when it no longer applies.
    #[test]
    fn a_wanted_condition_is_set_or_removed() {
        let mut conditions = Vec::new();
        let serving = Wanted::holds("Serving", "2 pods ready");
        assert!(set_wanted(
            &mut conditions,
            "PoolerReady",
            Some(&serving),
            Some(1)
        ));
        assert!(!set_wanted(
            &mut conditions,
            "PoolerReady",
            Some(&serving),
            Some(1)
        ));
        assert!(is_true(&conditions, "PoolerReady"));
        let down = Wanted::fails("PodsNotReady", "0 of 2");
        assert!(set_wanted(
            &mut conditions,
            "PoolerReady",
            Some(&down),
            Some(1)
        ));
        assert_eq!(
            get(&conditions, "PoolerReady").unwrap().reason,
            "PodsNotReady"
        );
        assert!(set_wanted(&mut conditions, "PoolerReady", None, Some(2)));
        assert!(conditions.is_empty());
        assert!(!set_wanted(&mut conditions, "PoolerReady", None, Some(2)));
    }

    fn t(secs: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(secs).unwrap())
    }

    #[test]
    fn transition_time_changes_only_with_status() {
        let mut c = Vec::new();
        assert!(set_at(
            &mut c,
            READY,
            false,
            "Creating",
            "wait".into(),
            Some(1),
            t(10)
        ));
        assert!(!set_at(
            &mut c,
            READY,
            false,
            "Creating",
            "wait".into(),
            Some(1),
            t(20)
        ));
        assert_eq!(c[0].last_transition_time, t(10));
        assert!(set_at(
            &mut c,
            READY,
            false,
            "Still",
            "wait more".into(),
            Some(2),
            t(30)
        ));
        assert_eq!(
            c[0].last_transition_time,
            t(10),
            "reason change is not a transition"
        );
        assert!(set_at(
            &mut c,
            READY,
            true,
            "Ready",
            "ok".into(),
            Some(2),
            t(40)
        ));
        assert_eq!(c[0].last_transition_time, t(40));
        assert!(is_true(&c, READY));
        assert_eq!(c.len(), 1);
    }

    #[test]
    fn empty_reason_is_unknown() {
        let mut c = Vec::new();
        set_at(&mut c, DEGRADED, true, "", "x".into(), None, t(1));
        assert_eq!(c[0].reason, "Unknown");
    }
}
