//! `/healthz` and `/readyz` for the kubelet's probes, and `/metrics` ([`crate::metrics`]).
//!
//! - ready: PostgreSQL answered lately, in the role the Lease gives this instance
//!   (read-write while holding it, in recovery otherwise), and a replica is not known to be
//!   unable to catch up, so the `-rw` and `-ro` Services only route to instances that serve
//!   their role;
//! - live: the manager answers (a paused or hung manager does not) and PostgreSQL, when it
//!   should be running, answers its queries.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio_util::sync::CancellationToken;

use crate::contract::HTTP_PORT;
use crate::metrics::Metrics;

/// What the probes answer, set by the manager's loop.
#[derive(Clone, Debug, Default)]
pub struct Health {
    ready: Arc<AtomicBool>,
    responsive: Arc<AtomicBool>,
    unresponsive_since: Arc<std::sync::Mutex<Option<tokio::time::Instant>>>,
}

/// How long PostgreSQL may fail to answer before the container counts as not live.
const UNRESPONSIVE_GRACE: std::time::Duration = std::time::Duration::from_secs(60);

impl Health {
    pub fn set(&self, ready: bool, responsive: bool) {
        self.ready.store(ready, Ordering::SeqCst);
        self.responsive.store(responsive, Ordering::SeqCst);
        let mut since = self
            .unresponsive_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if responsive {
            *since = None;
        } else if since.is_none() {
            *since = Some(tokio::time::Instant::now());
        }
    }

    fn live(&self) -> bool {
        let since = self
            .unresponsive_since
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        since.is_none_or(|s| s.elapsed() < UNRESPONSIVE_GRACE)
    }
}

/// Serves the probes and the metrics on [`HTTP_PORT`] until `shutdown`.
pub async fn serve(health: Health, metrics: Metrics, shutdown: CancellationToken) {
    let (live, ready) = (health.clone(), health);
    let app = steward_core::server::probes(
        move || live.live(),
        move || ready.ready.load(Ordering::SeqCst),
        move || {
            let metrics = metrics.clone();
            async move { metrics.render().await }
        },
    );
    let listener = match tokio::net::TcpListener::bind(("0.0.0.0", HTTP_PORT)).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, port = HTTP_PORT, "cannot serve the probes");
            return;
        }
    };
    let _ = axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await;
}
