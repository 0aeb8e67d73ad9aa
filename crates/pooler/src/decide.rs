//! What the agent does next (pure): from what it observed of the cluster ([`Observed`]) and
//! what it did so far ([`State`]), the ordered steps of a [`Plan`].
//!
//! # How it works
//! - **Where to connect.** The primary is the pod the Lease names as holder, if that pod
//!   publishes the role `primary` and has an IP ([`Observed::primary`]). While it is not known
//!   (a failover in progress, the Lease just released) PgBouncer stays where it points.
//! - **Pause.** A primary about to hand over writes [`PAUSE_ANNOTATION`] on the Lease. The
//!   agent `PAUSE`s PgBouncer (in-flight transactions finish, new ones wait in PgBouncer) and
//!   acknowledges that pause in the state ConfigMap; once the annotation is gone and the new
//!   primary is known, it points PgBouncer there *before* `RESUME`, so no transaction reaches
//!   the old primary.
//! - **Bounds.** A pause lasts at most [`MAX_PAUSE`]: then the agent resumes whatever the
//!   Lease says and will not pause again for that annotation value (a primary killed
//!   mid-switchover never lifts it). A `PAUSE` that does not finish within its bound is
//!   undone by the executor and that value is given up too (no acknowledgement: the primary
//!   refuses the switchover).
//!
//! The executor ([`crate::agent`]) runs the steps in order and stops at the first that fails;
//! the next turn decides again from what then holds.
//!
//! [`PAUSE_ANNOTATION`]: crate::contract::pooler::PAUSE_ANNOTATION

use std::collections::BTreeMap;
use std::time::Instant;

use crate::config::Target;
use crate::contract::Role;
use crate::contract::pooler::MAX_PAUSE;

/// One instance pod as the agent sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Instance {
    /// `status.podIP`.
    pub ip: Option<String>,
    /// The role its instance manager published (`None`: nothing readable published).
    pub role: Option<Role>,
}

/// The cluster as the watches last saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// The Lease's `spec.holderIdentity` (`None`: no Lease, or released).
    pub holder: Option<String>,
    /// The Lease's pause annotation: the pause a primary asks for.
    pub pause: Option<String>,
    /// The cluster's instance pods by name.
    pub pods: BTreeMap<String, Instance>,
}

impl Observed {
    /// The primary's pod: named by the Lease, publishing the role `primary`, with an IP.
    pub fn primary(&self) -> Option<Target> {
        let name = self.holder.as_deref().filter(|h| !h.is_empty())?;
        let pod = self.pods.get(name)?;
        if pod.role != Some(Role::Primary) {
            return None;
        }
        let ip = pod.ip.as_deref().filter(|ip| !ip.is_empty())?;
        Some(Target::Pod {
            name: name.to_string(),
            ip: ip.to_string(),
        })
    }
}

/// A pause PgBouncer is in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paused {
    /// The annotation value it is for.
    pub nonce: String,
    /// When the `PAUSE` was issued.
    pub since: Instant,
}

/// What the agent's key in the state ConfigMap says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Acked {
    /// No key of this agent's.
    Nothing,
    /// This pause acknowledged.
    Pause(String),
    /// Not known: a container restarted in this pod may have left a key its PgBouncer no
    /// longer honours. Removed first thing.
    Unknown,
}

/// What the agent did so far (its executor's record).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct State {
    /// Where `pgbouncer.ini` points PgBouncer now.
    pub target: Target,
    pub paused: Option<Paused>,
    pub acked: Acked,
    /// A pause value this agent will not pause for (again): it outlived [`MAX_PAUSE`] or its
    /// `PAUSE` did not finish in time.
    pub given_up: Option<String>,
}

impl State {
    /// A fresh agent: PgBouncer not paused, pointing at `target`, its key in the ConfigMap
    /// unknown.
    pub fn new(target: Target) -> Self {
        State {
            target,
            paused: None,
            acked: Acked::Unknown,
            given_up: None,
        }
    }
}

/// Why PgBouncer resumes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resume {
    /// The pause was lifted (the new primary leads) and PgBouncer points at the primary.
    Lifted,
    /// The pause outlived [`MAX_PAUSE`].
    Expired,
}

/// One step of a plan, executed in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Rewrite `pgbouncer.ini` for this target and `RELOAD`.
    PointAt(Target),
    /// `PAUSE`, bounded by [`crate::contract::pooler::AGENT_PAUSE_WAIT`] (undone and given up if it
    /// does not finish).
    Pause(String),
    /// Already paused: the pause is now for this (newer) value.
    Adopt(String),
    /// `RESUME`.
    Resume(Resume),
    /// Write this pause value under the agent's key in the state ConfigMap.
    Ack(String),
    /// Remove the agent's key from the state ConfigMap.
    Unack,
}

/// The steps of one turn, in order (empty: nothing to do).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub steps: Vec<Step>,
}

/// The next steps from what the agent observed and did, at `now`.
pub fn decide(observed: &Observed, state: &State, now: Instant) -> Plan {
    let mut steps = Vec::new();
    let primary = observed.primary();
    let moved = primary.as_ref().filter(|p| **p != state.target);
    let wanted = observed
        .pause
        .as_ref()
        .filter(|n| !n.is_empty() && state.given_up.as_ref() != Some(*n));
    match (&state.paused, wanted) {
        (None, Some(nonce)) => {
            // A failover seen only now goes first: the pause ends on the right server.
            steps.extend(moved.cloned().map(Step::PointAt));
            steps.push(Step::Pause(nonce.clone()));
            steps.push(Step::Ack(nonce.clone()));
        }
        (Some(paused), _) if now.saturating_duration_since(paused.since) >= MAX_PAUSE => {
            // Resume first, whatever else: the next turn points at the primary once it is
            // known, as after any failover.
            steps.push(Step::Resume(Resume::Expired));
            steps.push(Step::Unack);
        }
        (Some(paused), Some(nonce)) => {
            if paused.nonce != *nonce {
                steps.push(Step::Adopt(nonce.clone()));
                steps.push(Step::Ack(nonce.clone()));
            } else if state.acked != Acked::Pause(nonce.clone()) {
                steps.push(Step::Ack(nonce.clone()));
            }
        }
        (Some(_), None) => {
            // Lifted: resume once PgBouncer points at the primary; until it is known, stay
            // paused (bounded above).
            if let Some(primary) = primary {
                if primary != state.target {
                    steps.push(Step::PointAt(primary));
                }
                steps.push(Step::Resume(Resume::Lifted));
                steps.push(Step::Unack);
            }
        }
        (None, None) => {
            steps.extend(moved.cloned().map(Step::PointAt));
            if state.acked != Acked::Nothing {
                steps.push(Step::Unack);
            }
        }
    }
    Plan { steps }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A cluster: chainable, so a test reads as a sentence.
    #[derive(Clone, Default)]
    struct Cluster(Observed);

    impl Cluster {
        fn new() -> Self {
            Cluster::default()
                .pod("pg-0", "10.0.0.10", Role::Primary)
                .pod("pg-1", "10.0.0.11", Role::Replica)
                .held_by("pg-0")
        }
        fn pod(mut self, name: &str, ip: &str, role: Role) -> Self {
            self.0.pods.insert(
                name.into(),
                Instance {
                    ip: Some(ip.into()).filter(|ip: &String| !ip.is_empty()),
                    role: Some(role),
                },
            );
            self
        }
        fn held_by(mut self, holder: &str) -> Self {
            self.0.holder = Some(holder.into());
            self
        }
        fn released(mut self) -> Self {
            self.0.holder = None;
            self
        }
        fn pausing(mut self, nonce: &str) -> Self {
            self.0.pause = Some(nonce.into());
            self
        }
    }

    fn pod(name: &str, ip: &str) -> Target {
        Target::Pod {
            name: name.into(),
            ip: ip.into(),
        }
    }

    fn at(target: Target) -> State {
        State {
            acked: Acked::Nothing,
            ..State::new(target)
        }
    }

    fn paused(mut state: State, nonce: &str, since: Instant) -> State {
        state.paused = Some(Paused {
            nonce: nonce.into(),
            since,
        });
        state.acked = Acked::Pause(nonce.into());
        state
    }

    fn steps(observed: &Cluster, state: &State, now: Instant) -> Vec<Step> {
        decide(&observed.0, state, now).steps
    }

    #[test]
    fn the_primary_is_the_holder_publishing_primary_with_an_ip() {
        assert_eq!(Cluster::new().0.primary(), Some(pod("pg-0", "10.0.0.10")));
        assert_eq!(Cluster::new().released().0.primary(), None);
        assert_eq!(Cluster::new().held_by("").0.primary(), None);
        assert_eq!(Cluster::new().held_by("pg-9").0.primary(), None, "no pod");
        assert_eq!(
            Cluster::new().held_by("pg-1").0.primary(),
            None,
            "the holder still publishes replica (promotion not done)"
        );
        let no_ip = Cluster::new().pod("pg-0", "", Role::Primary);
        assert_eq!(no_ip.0.primary(), None);
    }

    #[test]
    fn a_fresh_agent_points_at_the_primary_and_removes_a_predecessors_ack() {
        let now = Instant::now();
        let state = State::new(Target::service("pg", "ns"));
        assert_eq!(
            steps(&Cluster::new(), &state, now),
            [Step::PointAt(pod("pg-0", "10.0.0.10")), Step::Unack]
        );
    }

    #[test]
    fn nothing_to_do_when_pointing_at_the_primary_unpaused() {
        let state = at(pod("pg-0", "10.0.0.10"));
        assert_eq!(steps(&Cluster::new(), &state, Instant::now()), []);
    }

    #[test]
    fn a_failover_moves_pgbouncer_to_the_new_primary() {
        let state = at(pod("pg-0", "10.0.0.10"));
        let failed_over = Cluster::new()
            .pod("pg-1", "10.0.0.11", Role::Primary)
            .held_by("pg-1");
        assert_eq!(
            steps(&failed_over, &state, Instant::now()),
            [Step::PointAt(pod("pg-1", "10.0.0.11"))]
        );
        // The same pod back with another IP is another target.
        let moved = Cluster::new().pod("pg-0", "10.0.0.99", Role::Primary);
        assert_eq!(
            steps(&moved, &state, Instant::now()),
            [Step::PointAt(pod("pg-0", "10.0.0.99"))]
        );
    }

    #[test]
    fn an_unknown_primary_keeps_the_current_host() {
        let state = at(pod("pg-0", "10.0.0.10"));
        let now = Instant::now();
        assert_eq!(steps(&Cluster::new().released(), &state, now), []);
        let promoting = Cluster::new()
            .pod("pg-0", "10.0.0.10", Role::Down)
            .held_by("pg-1");
        assert_eq!(steps(&promoting, &state, now), []);
    }

    #[test]
    fn a_wanted_pause_pauses_then_acknowledges() {
        let state = at(pod("pg-0", "10.0.0.10"));
        assert_eq!(
            steps(&Cluster::new().pausing("pg-1/1700"), &state, Instant::now()),
            [
                Step::Pause("pg-1/1700".into()),
                Step::Ack("pg-1/1700".into())
            ]
        );
    }

    #[test]
    fn paused_and_acknowledged_while_wanted_is_steady() {
        let now = Instant::now();
        let state = paused(at(pod("pg-0", "10.0.0.10")), "pg-1/1700", now);
        let cluster = Cluster::new().pausing("pg-1/1700");
        assert_eq!(steps(&cluster, &state, now + MAX_PAUSE / 2), []);
        // An acknowledgement that failed is written again.
        let mut unacked = state.clone();
        unacked.acked = Acked::Nothing;
        assert_eq!(
            steps(&cluster, &unacked, now),
            [Step::Ack("pg-1/1700".into())]
        );
    }

    #[test]
    fn lifted_with_a_new_primary_reloads_before_resuming() {
        let now = Instant::now();
        let state = paused(at(pod("pg-0", "10.0.0.10")), "pg-1/1700", now);
        let switched = Cluster::new()
            .pod("pg-0", "10.0.0.10", Role::Replica)
            .pod("pg-1", "10.0.0.11", Role::Primary)
            .held_by("pg-1");
        assert_eq!(
            steps(&switched, &state, now + Duration::from_secs(3)),
            [
                Step::PointAt(pod("pg-1", "10.0.0.11")),
                Step::Resume(Resume::Lifted),
                Step::Unack
            ]
        );
    }

    #[test]
    fn lifted_on_the_same_primary_resumes_without_reloading() {
        // A refused switchover: the primary lifts its own pause and runs on.
        let now = Instant::now();
        let state = paused(at(pod("pg-0", "10.0.0.10")), "pg-1/1700", now);
        assert_eq!(
            steps(&Cluster::new(), &state, now),
            [Step::Resume(Resume::Lifted), Step::Unack]
        );
    }

    #[test]
    fn lifted_while_the_primary_is_unknown_stays_paused_until_the_bound() {
        let now = Instant::now();
        let state = paused(at(pod("pg-0", "10.0.0.10")), "pg-1/1700", now);
        let promoting = Cluster::new()
            .pod("pg-0", "10.0.0.10", Role::Down)
            .held_by("pg-1");
        assert_eq!(steps(&promoting, &state, now + Duration::from_secs(5)), []);
        assert_eq!(
            steps(&promoting, &state, now + MAX_PAUSE),
            [Step::Resume(Resume::Expired), Step::Unack]
        );
    }

    #[test]
    fn a_pause_outliving_the_bound_resumes_and_is_not_taken_again() {
        let now = Instant::now();
        let state = paused(at(pod("pg-0", "10.0.0.10")), "pg-1/1700", now);
        let stuck = Cluster::new().pausing("pg-1/1700");
        assert_eq!(
            steps(&stuck, &state, now + MAX_PAUSE - Duration::from_millis(1)),
            []
        );
        assert_eq!(
            steps(&stuck, &state, now + MAX_PAUSE),
            [Step::Resume(Resume::Expired), Step::Unack]
        );
        // After the executor's record: resumed, this value given up.
        let resumed = State {
            paused: None,
            acked: Acked::Nothing,
            given_up: Some("pg-1/1700".into()),
            ..state.clone()
        };
        assert_eq!(steps(&stuck, &resumed, now + MAX_PAUSE * 2), []);
        // A later switchover is another value: paused for.
        assert_eq!(
            steps(&stuck.pausing("pg-1/1800"), &resumed, now + MAX_PAUSE * 2),
            [
                Step::Pause("pg-1/1800".into()),
                Step::Ack("pg-1/1800".into())
            ]
        );
    }

    #[test]
    fn a_newer_pause_while_paused_is_adopted_and_acknowledged() {
        let now = Instant::now();
        let state = paused(at(pod("pg-0", "10.0.0.10")), "pg-1/1700", now);
        assert_eq!(
            steps(&Cluster::new().pausing("pg-1/1800"), &state, now),
            [
                Step::Adopt("pg-1/1800".into()),
                Step::Ack("pg-1/1800".into())
            ]
        );
    }

    #[test]
    fn a_pause_seen_after_a_failover_points_at_the_primary_first() {
        let state = at(Target::service("pg", "ns"));
        assert_eq!(
            steps(&Cluster::new().pausing("pg-1/1700"), &state, Instant::now()),
            [
                Step::PointAt(pod("pg-0", "10.0.0.10")),
                Step::Pause("pg-1/1700".into()),
                Step::Ack("pg-1/1700".into())
            ]
        );
    }

    #[test]
    fn an_empty_annotation_asks_for_nothing() {
        let state = at(pod("pg-0", "10.0.0.10"));
        assert_eq!(
            steps(&Cluster::new().pausing(""), &state, Instant::now()),
            []
        );
    }

    #[test]
    fn a_leftover_ack_is_removed_when_not_paused() {
        let mut state = at(pod("pg-0", "10.0.0.10"));
        state.acked = Acked::Pause("pg-1/1700".into());
        assert_eq!(
            steps(&Cluster::new(), &state, Instant::now()),
            [Step::Unack]
        );
    }
}
