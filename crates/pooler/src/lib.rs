//! steward-pooler: PID 1 of each PgBouncer pod of a PostgresCluster's pooler
//! (`spec.pooler`).
//!
//! Start with [`agent`]: it writes PgBouncer's configuration, runs PgBouncer as its child and
//! drives it through the admin console as the cluster's Lease and pods change. The pieces:
//! - [`contract`]: what the agent, the instance managers and the operator agree on (the
//!   Lease, the pause annotation, the state ConfigMap), from `steward-database-api`;
//! - [`config`]: `pgbouncer.ini` and the auth file (pure);
//! - [`observe`]: the watches of the Lease and the instance pods, read into an observation;
//! - [`decide`]: where PgBouncer should point and whether it should be paused (pure);
//! - [`admin`]: the admin console (`PAUSE`, `RESUME`, `RELOAD`, `SHOW`);
//! - [`ack`]: the pause acknowledgement in the state ConfigMap;
//! - [`pgbouncer`]: the child process and its files;
//! - [`http`] and [`metrics`]: the kubelet's probes and Prometheus' `/metrics`.
//!
//! # Guarantees
//! Clients reach only the pod the Lease names as primary (or, before the agent has seen one,
//! the `-rw` Service). During a planned switchover PgBouncer is paused before the old primary
//! stops and resumed only after it points at the new one: transactions wait in PgBouncer
//! instead of failing, and none reaches the old primary after its last acknowledged one.
//!
//! # Caveats
//! An unplanned failover is not paused for: transactions in flight on the old primary fail,
//! and PgBouncer points at the new primary as soon as its pod publishes the role `primary`.

#![forbid(unsafe_code)]

pub mod ack;
pub mod admin;
pub mod agent;
pub mod config;
pub use steward_database_api::contract;
pub mod decide;
pub mod http;
pub mod metrics;
pub mod observe;
pub mod pgbouncer;
