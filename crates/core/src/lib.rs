#![warn(missing_docs)]
//! steward-core: the machinery every Steward operator shares, built on kube-runtime.
//!
//! Start with [`runtime::Operator`]: it wires a kube-runtime `Controller` with leader
//! election ([`leader`]), per-object backoff, bounded concurrency, graceful shutdown,
//! metrics and health endpoints ([`server`]). Inside a reconcile, use [`finalizer`] for safe
//! deletion, [`apply`] for owned children by server-side apply, [`conditions`] and
//! [`status`] for one status write per reconcile, and [`events`] to tell users what happened.
//! To find an owner's objects in a watch cache without scanning it, use [`index::Indexed`].
//! To spread one controller's objects over several replicas, use
//! [`Operator::sharded_controller`] with `--shards N` ([`shard`]: one Lease per shard).
//! Operator binaries flatten [`cli::CommonArgs`] into their own clap parser; [`telemetry`]
//! turns its logging and `--otlp-endpoint` flags into logs and traces.

pub mod apply;
mod cache;
pub mod cli;
pub mod conditions;
pub mod controller;
mod error;
pub mod events;
pub mod fields;
pub mod finalizer;
pub mod guard;
pub mod index;
pub mod leader;
pub mod metrics;
pub mod object;
pub mod operator;
pub mod reconcile;
pub mod runtime;
pub mod server;
pub mod shard;
pub mod status;
pub mod telemetry;

pub use controller::Controller;
pub use error::{Error, ReconcileError, chain};
pub use leader::{LeaderElector, Leadership, LeaseConfig};
pub use runtime::{Context, Operator};

pub use k8s_openapi;
/// Re-exports operator crates need, so their versions always match steward-core's.
pub use kube;
