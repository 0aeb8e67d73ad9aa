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

mod config;
mod decide;
mod elector;
mod leadership;

pub use config::{ConfigError, JITTER_FACTOR, LeaseConfig};
pub use elector::{Error, LeaderElector};
pub use leadership::{Leadership, NotLeader, run_while_leader};
