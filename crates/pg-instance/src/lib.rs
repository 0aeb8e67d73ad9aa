//! steward-pg-instance: PID 1 of every PostgreSQL container of a PostgresCluster.
//!
//! Start with [`manager`]: its loop decides from the cluster's Lease which role this
//! instance has, runs PostgreSQL in it, and reports on its pod. The pieces:
//! - [`contract`]: the names the instance manager and the database-operator share (they talk
//!   only through the Kubernetes API), from `steward-database-api` with the `PostgresBackup`
//!   type the manager reads and writes;
//! - [`election`]: which replica should take a free Lease (pure);
//! - [`postgres`]: the postmaster and `initdb`/`pg_basebackup`/`pg_rewind`;
//! - [`conf`]: `instance.conf` and the passfile (pure);
//! - [`watchdog`]: the second process that stops a primary whose right to write ran out;
//! - [`http`]: the kubelet's probes;
//! - [`upgrade`]: a major-version upgrade with `pg_upgrade` (the operator's upgrade Job).
//!
//! # Guarantees
//! Only the holder of the Lease `<cluster>-primary` runs read-write, and only until its last
//! renewal plus the renew deadline (steward-core's [`steward_core::leader::Leadership`]);
//! the watchdog enforces that deadline even when this process is stopped. Another instance
//! can take the Lease only after it saw it unchanged for the Lease duration, which is longer
//! than the renew deadline: the old primary is down before a new one is promoted.
//!
//! # Caveats
//! Replication is asynchronous: WAL the old primary acknowledged but had not sent is lost on
//! failover (the most advanced replica is promoted to keep that small).

pub mod archive;
pub mod backups;
pub mod conf;
pub use steward_database_api::contract;
pub mod election;
pub mod http;
pub mod manager;
pub mod metrics;
pub mod poolers;
pub mod postgres;
pub mod standby;
pub mod upgrade;
pub mod watchdog;
