//! Lease-based leader election, compatible with client-go's
//! `k8s.io/client-go/tools/leaderelection` on the same `coordination.k8s.io/v1` Lease.
//!
//! Start with [`LeaderElector`]: build it from a [`LeaseConfig`], take a [`Leadership`]
//! handle, then `run` it until shutdown. Guard leader-only work with
//! [`run_while_leader`] and every leader-only write with [`Leadership::guard`].
//!
//! ```no_run
//! # async fn demo(client: kube::Client) -> Result<(), Box<dyn std::error::Error>> {
//! use steward_core::leader::{LeaderElector, LeaseConfig, run_while_leader};
//! use tokio_util::sync::CancellationToken;
//!
//! let config = LeaseConfig::new("database-operator", "steward-system", LeaseConfig::identity_from_env());
//! let elector = LeaderElector::new(client, config)?;
//! let leadership = elector.leadership();
//! let (work_stop, election_stop) = (CancellationToken::new(), CancellationToken::new());
//! let election = tokio::spawn(elector.run(election_stop.clone()));
//! let work = run_while_leader(leadership.clone(), work_stop.clone(), |token| async move {
//!     token.cancelled().await; // reconcile until cancelled
//! });
//! // On SIGTERM: work_stop.cancel(), then election_stop.cancel() so the Lease is released
//! // only after the work has stopped.
//! # work.await; election.await??; Ok(()) }
//! ```
//!
//! # How it works
//! The algorithm is client-go's `tryAcquireOrRenew`: get the Lease (create it on 404); take
//! it over only when nobody holds it or its spec has not changed for its
//! `leaseDurationSeconds`, measured on this process's monotonic clock since we first read
//! that spec; write with a PUT carrying the resourceVersion read, so racing candidates get
//! 409 Conflict. The decision is a pure function (`decide.rs`); the loop (`elector.rs`) only
//! sequences API calls and timers; [`Leadership`] (`leadership.rs`) answers "may I write?".
//!
//! A leader steps down when it has not renewed within `renew_deadline` of the instant its
//! last successful renewal was sent. Other candidates read that renewal after it was
//! written and wait `lease_duration > renew_deadline` from then, so the old leader's work
//! is cancelled before anyone else can acquire. [`Leadership::guard`] applies the same
//! deadline at every call, so a process that was paused does not write when it wakes.
//!
//! Followers also watch the Lease (one watch, field selector on its name) and try at once
//! when it is released or deleted, so a graceful handover takes a watch event's latency
//! rather than up to 1.5 retry periods; polling remains the fallback when the watch fails.
//!
//! # What is guaranteed, and under which assumptions
//! Let `R` be the instant a leader sent its last successful renewal, on its monotonic clock.
//! - **The leader** treats itself as leader only before `R + renew_deadline`
//!   ([`Leadership::deadline`]): its guard refuses writes from then on, the guarded client
//!   ([`crate::guard`]) releases a write's body only before then and abandons any write still
//!   unanswered at that instant (the caller gets an error saying it may or may not have
//!   landed), and the database-operator's SQL statements carry a `statement_timeout` ending
//!   then.
//! - **Another candidate** takes over only after it has seen the same Lease spec unchanged
//!   for `lease_duration`, on its own monotonic clock, starting when it *read* that spec,
//!   which is after `R`. So it cannot lead before `R + lease_duration`.
//! - So every write the leader saw answered was committed before anybody else could lead, as
//!   long as the two processes' clocks advance at rates that differ by less than
//!   `lease_duration / renew_deadline` (1.5 with the defaults: far beyond any real clock).
//!   No wall clock is compared across machines, so wall-clock skew and jumps do not matter.
//!
//! What is not guaranteed:
//! - **A write already on the wire.** Bytes the leader handed to the kernel before its
//!   deadline can reach the API server later (a congested network, a proxy). Such a write
//!   lands unless it arrives more than `lease_duration - renew_deadline` (5 s by default)
//!   after the deadline *and* something makes the server refuse it: the API server has no
//!   fencing tokens. Steward's status writes carry the resourceVersion they were computed
//!   from, so they fail once the new leader has written (see [`crate::status`]); desired-state
//!   writes of children do not, and a late one is put right by the new leader's next
//!   reconcile of the owner.
//! - **A process paused between the last check and the system call that sends** (a few
//!   instructions in the connection task) sends when it wakes; the same margin applies.
//! - **A caller that ignores the guard**: an unguarded client writes whenever it is told to.
//!
//! These match client-go's `leaderelection` (which states that it does not guarantee only one
//! client acts as leader, "a.k.a. fencing"), with the write deadline and body fence added.

mod config;
mod decide;
mod elector;
mod leadership;

pub use config::{ConfigError, JITTER_FACTOR, LeaseConfig};
pub use elector::{Error, LeaderElector, LeaseCheck};
pub use leadership::{Leadership, NotLeader, run_while_leader};
