//! `/healthz` and `/readyz` for the kubelet's probes, and `/metrics` ([`crate::metrics`]), on
//! [`HTTP_PORT`].
//!
//! - live: PgBouncer runs and the agent's loop turned lately (a hung agent would leave a
//!   pause in place or miss a failover);
//! - ready: PgBouncer's admin console answered within [`ANSWERED_WITHIN`] and the agent knows
//!   the primary, so the pooler Service routes only to poolers that send clients to it. A
//!   paused PgBouncer stays ready: its clients wait in it for the switchover to end instead
//!   of failing to connect.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use tokio_util::sync::CancellationToken;

use crate::contract::pooler::HTTP_PORT;
use crate::metrics::Metrics;

/// How recently the console must have answered for the pod to be ready.
pub const ANSWERED_WITHIN: Duration = Duration::from_secs(5);
/// How long the loop may go without a turn before the container counts as not live (beyond
/// the longest step: a bounded `PAUSE` and API calls).
pub const TURNED_WITHIN: Duration = Duration::from_secs(60);

/// What the probes answer, set by the agent.
#[derive(Clone, Debug)]
pub struct Health {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pgbouncer_running: AtomicBool,
    primary_known: AtomicBool,
    stopping: AtomicBool,
    answered: Mutex<Option<Instant>>,
    turned: Mutex<Instant>,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            inner: Arc::new(Inner {
                pgbouncer_running: AtomicBool::new(false),
                primary_known: AtomicBool::new(false),
                stopping: AtomicBool::new(false),
                answered: Mutex::new(None),
                turned: Mutex::new(Instant::now()),
            }),
        }
    }
}

impl Health {
    pub fn set_pgbouncer_running(&self, running: bool) {
        self.inner
            .pgbouncer_running
            .store(running, Ordering::SeqCst);
    }

    pub fn set_primary_known(&self, known: bool) {
        self.inner.primary_known.store(known, Ordering::SeqCst);
    }

    /// The agent stops PgBouncer: no longer ready (no new clients routed here), still live
    /// while PgBouncer finishes its transactions.
    pub fn set_stopping(&self) {
        self.inner.stopping.store(true, Ordering::SeqCst);
    }

    /// The admin console answered just now.
    pub fn console_answered(&self) {
        *self
            .inner
            .answered
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(Instant::now());
    }

    /// The agent's loop turned just now.
    pub fn turned(&self) {
        *self
            .inner
            .turned
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
    }

    pub fn live(&self) -> bool {
        self.inner.pgbouncer_running.load(Ordering::SeqCst)
            && self
                .inner
                .turned
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .elapsed()
                < TURNED_WITHIN
    }

    pub fn ready(&self) -> bool {
        let answered = *self
            .inner
            .answered
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.inner.pgbouncer_running.load(Ordering::SeqCst)
            && !self.inner.stopping.load(Ordering::SeqCst)
            && self.inner.primary_known.load(Ordering::SeqCst)
            && answered.is_some_and(|at| at.elapsed() < ANSWERED_WITHIN)
    }
}

/// The probes' and metrics' routes.
pub fn router(health: Health, metrics: Metrics) -> Router {
    let (live, ready) = (health.clone(), health);
    steward_core::server::probes(
        move || live.live(),
        move || ready.ready(),
        move || {
            let metrics = metrics.clone();
            async move { metrics.render().await }
        },
    )
}

/// A failure serving the probes.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The port is taken or not ours to bind.
    #[error("failed to listen on port {port}")]
    Bind {
        port: u16,
        #[source]
        source: std::io::Error,
    },
    #[error("failed to serve HTTP")]
    Serve(#[source] std::io::Error),
}

/// Serves the probes and the metrics on [`HTTP_PORT`] until `shutdown`.
///
/// # Errors
/// [`Error::Bind`], [`Error::Serve`].
pub async fn serve(
    health: Health,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let listener = tokio::net::TcpListener::bind(("0.0.0.0", HTTP_PORT))
        .await
        .map_err(|source| Error::Bind {
            port: HTTP_PORT,
            source,
        })?;
    axum::serve(listener, router(health, metrics))
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .map_err(Error::Serve)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_needs_the_console_and_the_primary() {
        let health = Health::default();
        assert!(!health.ready());
        assert!(!health.live(), "PgBouncer not started");
        health.set_pgbouncer_running(true);
        assert!(health.live());
        health.console_answered();
        assert!(!health.ready(), "primary unknown");
        health.set_primary_known(true);
        assert!(health.ready());
        health.set_stopping();
        assert!(!health.ready(), "stopping");
        assert!(health.live(), "live while PgBouncer finishes");
        health.set_pgbouncer_running(false);
        assert!(!health.live());
    }
}
