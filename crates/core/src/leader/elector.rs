//! [`LeaderElector`]: the loop that acquires, renews and releases the Lease.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::{Client, Resource};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::config::{ConfigError, LeaseConfig};
use super::decide::{Decision, Observation, Write, decide, next_spec, released_spec};
use super::leadership::Leadership;
use crate::events::{EventType, Recorder};

/// A failed step of the election. The loop logs these and retries; only a failed release
/// is returned from [`LeaderElector::run`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading the Lease failed.
    #[error("failed to get Lease {lease}")]
    GetLease {
        /// `namespace/name` of the Lease.
        lease: String,
        #[source]
        /// The API server's answer.
        source: kube::Error,
    },
    /// Creating the missing Lease failed (409 Conflict: another candidate created it first).
    #[error("failed to create Lease {lease}")]
    CreateLease {
        /// `namespace/name` of the Lease.
        lease: String,
        #[source]
        /// The API server's answer.
        source: kube::Error,
    },
    /// Writing an acquired or renewed Lease failed (409 Conflict: another candidate wrote it
    /// since we read it).
    #[error("failed to update Lease {lease}")]
    UpdateLease {
        /// `namespace/name` of the Lease.
        lease: String,
        #[source]
        /// The API server's answer.
        source: kube::Error,
    },
    /// Writing the released Lease on shutdown failed.
    #[error("failed to release Lease {lease}")]
    ReleaseLease {
        /// `namespace/name` of the Lease.
        lease: String,
        #[source]
        /// The API server's answer.
        source: kube::Error,
    },
    /// The API server did not answer within the renew deadline.
    #[error("failed to {step} Lease {lease} within {timeout:?}")]
    Timeout {
        /// What was being done (`acquire`, `renew`, `release`).
        step: &'static str,
        /// `namespace/name` of the Lease.
        lease: String,
        /// How long the API server had.
        timeout: Duration,
    },
}

impl Error {
    /// Whether the API server answered 409 Conflict: another candidate wrote first.
    pub fn is_conflict(&self) -> bool {
        match self {
            Self::GetLease { source, .. }
            | Self::CreateLease { source, .. }
            | Self::UpdateLease { source, .. }
            | Self::ReleaseLease { source, .. } => api_code(source) == Some(409),
            Self::Timeout { .. } => false,
        }
    }
}

fn api_code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// Elects one leader among the candidates sharing a `coordination.k8s.io/v1` Lease, with
/// client-go's `leaderelection` algorithm, so Rust and Go candidates can share a Lease.
///
/// # Guarantees
/// - Every write is a PUT carrying the resourceVersion last read: of two racing candidates
///   one gets 409 Conflict, never two leaders.
/// - A Lease held by another candidate is taken over only after its spec stayed unchanged
///   for its `leaseDurationSeconds` on this process's monotonic clock; the Lease's
///   timestamps are never compared with the local wall clock.
/// - A leader that has not renewed within the renew deadline (measured from when its last
///   successful renewal was sent) steps down before any other candidate may take over.
///
/// # Caveats
/// Needs `get`, `create` and `update` on `leases` in `coordination.k8s.io` and `create`,
/// `patch` on `events` in `events.k8s.io`, in the Lease's namespace.
pub struct LeaderElector {
    client: Client,
    config: LeaseConfig,
    reporter: String,
    leadership: Leadership,
    candidacy: Option<watch::Receiver<bool>>,
    lease_check: Option<LeaseCheck>,
    hand_over: bool,
}

/// See [`LeaderElector::with_lease_check`].
pub type LeaseCheck = std::sync::Arc<dyn Fn(&Lease) -> bool + Send + Sync>;

impl LeaderElector {
    /// Validates `config` and prepares an elector; nothing is sent until [`LeaderElector::run`].
    ///
    /// Events are reported as controller `config.lease_name` unless
    /// [`LeaderElector::with_reporter`] names another.
    ///
    /// # Errors
    /// [`ConfigError`] from [`LeaseConfig::validate`].
    pub fn new(client: Client, config: LeaseConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        Ok(Self {
            client,
            reporter: config.lease_name.clone(),
            leadership: Leadership::new(&config),
            config,
            candidacy: None,
            lease_check: None,
            hand_over: false,
        })
    }

    /// Takes the Lease (creates it, or takes over a released or expired one) only while
    /// `eligible` holds `true`; a Lease this candidate already holds is renewed regardless.
    /// Without it every candidate is eligible, as in client-go.
    ///
    /// The expiry clock keeps running while ineligible: a candidate that becomes eligible
    /// after the holder stopped renewing takes over at its next retry, not a lease duration
    /// later. (The PostgreSQL instance manager gates on "I am the most advanced replica".)
    #[must_use]
    pub fn with_candidacy(mut self, eligible: watch::Receiver<bool>) -> Self {
        self.candidacy = Some(eligible);
        self
    }

    /// Takes over a released or expired Lease only if `check` also accepts the Lease as just
    /// read (its annotations, say). With [`LeaderElector::with_candidacy`] alone the gate is
    /// the candidate's last decision, made on what it read before: a Lease released with a new
    /// record on it (the PostgreSQL instance manager's clean-stop record: "wait for the last
    /// primary unless you have its WAL") would be taken before the candidate decided on that
    /// record. Creating a missing Lease and renewing a held one are not checked.
    #[must_use]
    pub fn with_lease_check(mut self, check: LeaseCheck) -> Self {
        self.lease_check = Some(check);
        self
    }

    /// With [`LeaderElector::with_candidacy`]: a leader that becomes ineligible steps down
    /// and releases the Lease (its work is cancelled first, as on shutdown), then stands again
    /// as a candidate. Shards are handed to the replica the ring prefers this way
    /// ([`crate::shard`]).
    #[must_use]
    pub fn handing_over_when_ineligible(mut self) -> Self {
        self.hand_over = true;
        self
    }

    /// Names the reporting controller of the Events this elector records on the Lease.
    #[must_use]
    pub fn with_reporter(mut self, controller: impl Into<String>) -> Self {
        self.reporter = controller.into();
        self
    }

    /// A handle on this elector's leadership (cheap to clone).
    pub fn leadership(&self) -> Leadership {
        self.leadership.clone()
    }

    /// Acquires and renews the Lease until `shutdown` is cancelled, then releases it if held
    /// (holder cleared, `leaseDurationSeconds: 1`), so a follower takes over at its next retry.
    ///
    /// API errors are logged and retried every retry period. Leadership changes are logged
    /// (`tracing::info!`), published through [`Leadership::subscribe`] and recorded as
    /// `LeaderElection` Events on the Lease.
    ///
    /// # Errors
    /// [`Error::ReleaseLease`], [`Error::GetLease`] or [`Error::Timeout`] when the release on
    /// shutdown failed; followers then take over after the lease duration.
    ///
    /// # Caveats
    /// Cancel the work guarded by this leadership first (see
    /// [`super::run_while_leader`]) and `shutdown` after it finished.
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), Error> {
        let config = self.config;
        let api: Api<Lease> = Api::namespaced(self.client.clone(), &config.namespace);
        let (released_tx, released) = watch::channel(());
        let watching = AbortOnDrop(tokio::spawn(watch_releases(
            api.clone(),
            config.lease_name.clone(),
            released_tx,
        )));
        let mut election = Election {
            api,
            released,
            lease_ref: format!("{}/{}", config.namespace, config.lease_name),
            recorder: Recorder::new(self.client, &self.reporter, Some(config.identity.clone())),
            leadership: self.leadership,
            config,
            lease: None,
            observed: None,
            events: Vec::new(),
            candidacy: self.candidacy,
            lease_check: self.lease_check,
            hand_over: self.hand_over,
        };
        let result = election.run(&shutdown).await;
        drop(watching);
        election.flush_events().await;
        result
    }
}

/// Resolves when the candidacy gate changes; never without one.
async fn eligibility_changed(
    candidacy: Option<&mut watch::Receiver<bool>>,
) -> Result<(), watch::error::RecvError> {
    match candidacy {
        Some(c) => c.changed().await,
        None => std::future::pending().await,
    }
}

/// The state of one running election.
struct Election {
    api: Api<Lease>,
    /// Ticks when the watch sees the Lease released or deleted: a follower tries at once.
    released: watch::Receiver<()>,
    config: LeaseConfig,
    lease_ref: String,
    leadership: Leadership,
    recorder: Recorder,
    /// The Lease as last read or written: its resourceVersion makes our updates conditional.
    lease: Option<Lease>,
    /// The spec as last read and since when it has not changed (monotonic clock).
    observed: Option<Observation>,
    events: Vec<JoinHandle<()>>,
    /// See [`LeaderElector::with_candidacy`].
    candidacy: Option<watch::Receiver<bool>>,
    /// See [`LeaderElector::with_lease_check`].
    lease_check: Option<LeaseCheck>,
    /// See [`LeaderElector::handing_over_when_ineligible`].
    hand_over: bool,
}

/// The outcome of one attempt to acquire or renew.
enum Attempt {
    /// We hold the Lease; the successful write was sent at this instant.
    Leading { sent: Instant },
    /// Another candidate holds an unexpired Lease.
    Held {
        holder: String,
        expires_in: Duration,
    },
    /// The Lease is free or expired, but this candidate is not eligible to take it.
    Ineligible,
}

/// How the candidate phase ended.
enum Candidacy {
    /// We lead; the successful write was sent at this instant.
    Acquired {
        sent: Instant,
    },
    Shutdown,
}

/// How the leader phase ended.
enum Term {
    Lost {
        reason: String,
    },
    /// No longer eligible, with [`LeaderElector::handing_over_when_ineligible`].
    HandOver,
    Shutdown,
}

impl Drop for Election {
    /// If `run` is dropped while leading, the work it guards must still stop.
    fn drop(&mut self) {
        self.leadership.step_down();
    }
}

impl Election {
    async fn run(&mut self, shutdown: &CancellationToken) -> Result<(), Error> {
        tracing::info!(lease = %self.lease_ref, identity = %self.config.identity, "attempting to acquire leader lease");
        loop {
            match self.acquire(shutdown).await {
                Candidacy::Acquired { sent } => {
                    if self.leadership.renewed_at(sent) {
                        tracing::info!(lease = %self.lease_ref, identity = %self.config.identity, "became leader");
                        self.record_event("became leader");
                    }
                }
                Candidacy::Shutdown => return self.release().await,
            }
            match self.lead(shutdown).await {
                Term::Lost { reason } => {
                    if self.leadership.step_down() {
                        tracing::info!(lease = %self.lease_ref, identity = %self.config.identity, %reason, "stopped leading");
                        self.record_event("stopped leading");
                    }
                }
                Term::HandOver => {
                    tracing::info!(lease = %self.lease_ref, identity = %self.config.identity, "no longer eligible; handing the lease over");
                    if let Err(err) = self.release().await {
                        self.log_failure(&err, "failed to release lease for hand-over");
                    }
                }
                Term::Shutdown => return self.release().await,
            }
        }
    }

    /// Tries every jittered retry period until this process leads or `shutdown`.
    async fn acquire(&mut self, shutdown: &CancellationToken) -> Candidacy {
        let timeout = self.config.renew_deadline;
        loop {
            if shutdown.is_cancelled() {
                return Candidacy::Shutdown;
            }
            let mut expiry = None;
            // Not raced against `shutdown`: a write in flight must be known, to release it.
            match tokio::time::timeout(timeout, self.attempt(false)).await {
                Ok(Ok(Attempt::Leading { sent })) if self.fresh(sent) => {
                    return if shutdown.is_cancelled() {
                        Candidacy::Shutdown
                    } else {
                        Candidacy::Acquired { sent }
                    };
                }
                Ok(Ok(Attempt::Leading { .. })) => {
                    tracing::debug!(lease = %self.lease_ref, "acquired too late to lead (paused?); retrying");
                }
                Ok(Ok(Attempt::Held { holder, expires_in })) => {
                    tracing::debug!(lease = %self.lease_ref, %holder, ?expires_in, "lease held by another candidate");
                    expiry = Some(expires_in);
                }
                Ok(Ok(Attempt::Ineligible)) => {
                    tracing::debug!(lease = %self.lease_ref, "lease free, but not eligible to take it");
                }
                Ok(Err(err)) => self.log_failure(&err, "failed to acquire lease"),
                Err(_) => {
                    let err = Error::Timeout {
                        step: "acquire",
                        lease: self.lease_ref.clone(),
                        timeout,
                    };
                    self.log_failure(&err, "failed to acquire lease");
                }
            }
            let pause = follower_pause(self.config.retry_period, expiry, rand::random());
            tokio::select! {
                biased;
                () = shutdown.cancelled() => return Candidacy::Shutdown,
                () = tokio::time::sleep(pause) => {}
                Ok(()) = self.released.changed() => {
                    tracing::debug!(lease = %self.lease_ref, "lease released, trying at once");
                }
                Ok(()) = eligibility_changed(self.candidacy.as_mut()) => {
                    tracing::debug!(lease = %self.lease_ref, "eligibility changed, trying at once");
                }
            }
        }
    }

    /// Renews every retry period until a renewal misses the renew deadline or `shutdown`.
    async fn lead(&mut self, shutdown: &CancellationToken) -> Term {
        let renew_deadline = self.config.renew_deadline;
        loop {
            // Renew every retry period; meanwhile, with hand-over, step down as soon as this
            // candidate is no longer eligible (a change that keeps it eligible does not delay
            // the renewal).
            let renew_at = Instant::now() + self.config.retry_period;
            loop {
                if self.hand_over && !self.eligible() {
                    return Term::HandOver;
                }
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => return Term::Shutdown,
                    () = tokio::time::sleep_until(renew_at) => break,
                    Ok(()) = eligibility_changed(self.candidacy.as_mut()), if self.hand_over => {}
                }
            }
            let Some(renewed) = self.leadership.last_renewal() else {
                return Term::Lost {
                    reason: "not leading".into(),
                };
            };
            let deadline = renewed + renew_deadline;
            loop {
                if Instant::now() >= deadline {
                    return Term::Lost {
                        reason: format!(
                            "no renewal within the renew deadline ({renew_deadline:?})"
                        ),
                    };
                }
                match tokio::time::timeout_at(deadline, self.attempt(true)).await {
                    Ok(Ok(Attempt::Leading { sent })) if self.fresh(sent) => {
                        self.leadership.renewed_at(sent);
                        break;
                    }
                    Ok(Ok(Attempt::Leading { .. })) => {
                        return Term::Lost {
                            reason: "renewed too late (process paused?)".into(),
                        };
                    }
                    Ok(Ok(Attempt::Held { holder, .. })) => {
                        return Term::Lost {
                            reason: format!("the lease is held by {holder}"),
                        };
                    }
                    Ok(Ok(Attempt::Ineligible)) => {
                        return Term::Lost {
                            reason: "the lease is no longer ours".into(),
                        };
                    }
                    Ok(Err(err)) => self.log_failure(&err, "failed to renew lease"),
                    Err(_) => {
                        return Term::Lost {
                            reason: format!(
                                "no renewal within the renew deadline ({renew_deadline:?})"
                            ),
                        };
                    }
                }
                if shutdown.is_cancelled() {
                    return Term::Shutdown;
                }
                let retry = (Instant::now() + self.config.retry_period).min(deadline);
                tokio::select! {
                    biased;
                    () = shutdown.cancelled() => return Term::Shutdown,
                    () = tokio::time::sleep_until(retry) => {}
                }
            }
        }
    }

    /// Whether this candidate may take the Lease now ([`LeaderElector::with_candidacy`]).
    fn eligible(&self) -> bool {
        self.candidacy.as_ref().is_none_or(|c| *c.borrow())
    }

    fn fresh(&self, sent: Instant) -> bool {
        sent.elapsed() < self.config.renew_deadline
    }

    /// One `tryAcquireOrRenew`: a leader first updates the Lease it last wrote (fast path);
    /// otherwise, or if that fails, read the Lease and decide.
    async fn attempt(&mut self, leading: bool) -> Result<Attempt, Error> {
        let identity = self.config.identity.clone();
        if leading && self.holder().as_deref() == Some(identity.as_str()) {
            let sent = Instant::now();
            let spec = next_spec(
                &Write::Renew,
                self.lease_spec().as_ref(),
                &identity,
                self.duration_secs(),
                Timestamp::now(),
            );
            match self.update(spec).await {
                Ok(()) => return Ok(Attempt::Leading { sent }),
                Err(err) => {
                    tracing::debug!(lease = %self.lease_ref, error = %err, "renewal failed, reading the lease again")
                }
            }
        }

        let lease = match self.api.get(&self.config.lease_name).await {
            Ok(lease) => lease,
            Err(err) if api_code(&err) == Some(404) => {
                if !self.eligible() {
                    return Ok(Attempt::Ineligible);
                }
                return self.create().await;
            }
            Err(source) => {
                return Err(Error::GetLease {
                    lease: self.lease_ref.clone(),
                    source,
                });
            }
        };
        let read = Instant::now();
        let spec = lease.spec.clone().unwrap_or_default();
        let observed = Observation::update(self.observed.take(), spec, read);
        let decision = decide(
            Some(&observed.spec),
            read.saturating_duration_since(observed.since),
            &identity,
        );
        let current = observed.spec.clone();
        self.observed = Some(observed);
        let accepted = self.lease_check.as_ref().is_none_or(|check| check(&lease));
        self.lease = Some(lease);
        let write = match decision {
            Decision::Wait { holder, expires_in } => {
                return Ok(Attempt::Held { holder, expires_in });
            }
            Decision::Write(Write::Renew) => Write::Renew,
            Decision::Write(_) if !self.eligible() || !accepted => {
                return Ok(Attempt::Ineligible);
            }
            Decision::Write(write) => write,
        };
        if let Write::TakeOver {
            previous: Some(previous),
        } = &write
        {
            tracing::info!(lease = %self.lease_ref, %previous, "lease expired, taking over");
        }
        let sent = Instant::now();
        let spec = next_spec(
            &write,
            Some(&current),
            &identity,
            self.duration_secs(),
            Timestamp::now(),
        );
        self.update(spec).await?;
        Ok(Attempt::Leading { sent })
    }

    /// Creates the missing Lease with us as holder.
    async fn create(&mut self) -> Result<Attempt, Error> {
        let sent = Instant::now();
        let spec = Some(next_spec(
            &Write::Create,
            None,
            &self.config.identity,
            self.duration_secs(),
            Timestamp::now(),
        ));
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(self.config.lease_name.clone()),
                namespace: Some(self.config.namespace.clone()),
                ..ObjectMeta::default()
            },
            spec,
        };
        let created = self
            .api
            .create(&PostParams::default(), &lease)
            .await
            .map_err(|source| Error::CreateLease {
                lease: self.lease_ref.clone(),
                source,
            })?;
        self.remember(created);
        Ok(Attempt::Leading { sent })
    }

    /// Replaces the Lease's spec, conditional on the resourceVersion last read.
    async fn update(&mut self, spec: LeaseSpec) -> Result<(), Error> {
        let mut lease = self.lease.clone().unwrap_or_default();
        lease.spec = Some(spec);
        match self
            .api
            .replace(&self.config.lease_name, &PostParams::default(), &lease)
            .await
        {
            Ok(updated) => {
                self.remember(updated);
                Ok(())
            }
            Err(source) => Err(Error::UpdateLease {
                lease: self.lease_ref.clone(),
                source,
            }),
        }
    }

    fn remember(&mut self, lease: Lease) {
        self.observed = Some(Observation {
            spec: lease.spec.clone().unwrap_or_default(),
            since: Instant::now(),
        });
        self.lease = Some(lease);
    }

    /// Steps down, then clears the holder if the Lease is still ours (client-go's
    /// `ReleaseOnCancel`). Gives up after the renew deadline.
    async fn release(&mut self) -> Result<(), Error> {
        if self.leadership.step_down() {
            tracing::info!(lease = %self.lease_ref, identity = %self.config.identity, "stopped leading (releasing the lease)");
            self.record_event("stopped leading");
        }
        let timeout = self.config.renew_deadline;
        let deadline = Instant::now() + timeout;
        let lease_ref = self.lease_ref.clone();
        let timed_out = || Error::Timeout {
            step: "release",
            lease: lease_ref.clone(),
            timeout,
        };
        loop {
            if self.holder().as_deref() != Some(self.config.identity.as_str()) {
                return Ok(());
            }
            let spec = released_spec(self.lease_spec().as_ref(), Timestamp::now());
            match tokio::time::timeout_at(deadline, self.update(spec)).await {
                Ok(Ok(())) => {
                    tracing::info!(lease = %self.lease_ref, identity = %self.config.identity, "released lease");
                    return Ok(());
                }
                Ok(Err(err)) if err.is_conflict() => {
                    // Renewed or taken over since we read it: read again and decide.
                    match tokio::time::timeout_at(deadline, self.api.get(&self.config.lease_name))
                        .await
                    {
                        Ok(Ok(lease)) => self.lease = Some(lease),
                        Ok(Err(source)) => {
                            return Err(Error::GetLease {
                                lease: self.lease_ref.clone(),
                                source,
                            });
                        }
                        Err(_) => return Err(timed_out()),
                    }
                }
                Ok(Err(Error::UpdateLease { lease, source })) => {
                    return Err(Error::ReleaseLease { lease, source });
                }
                Ok(Err(err)) => return Err(err),
                Err(_) => return Err(timed_out()),
            }
        }
    }

    fn holder(&self) -> Option<String> {
        self.lease_spec().and_then(|s| s.holder_identity)
    }

    fn lease_spec(&self) -> Option<LeaseSpec> {
        self.lease.as_ref().and_then(|l| l.spec.clone())
    }

    fn duration_secs(&self) -> i32 {
        self.config.lease_duration_seconds()
    }

    fn log_failure(&self, err: &Error, what: &str) {
        let error = error_chain(err);
        if err.is_conflict() {
            tracing::debug!(lease = %self.lease_ref, %error, "{what}: another candidate wrote first");
        } else {
            tracing::warn!(lease = %self.lease_ref, %error, "{what}");
        }
    }

    /// Publishes `<identity> <what>` as a `LeaderElection` Event on the Lease, in the
    /// background; a failure is logged, never fatal.
    fn record_event(&mut self, what: &str) {
        self.events.retain(|task| !task.is_finished());
        let reference = self.lease.as_ref().map_or_else(
            || ObjectReference {
                api_version: Some("coordination.k8s.io/v1".into()),
                kind: Some("Lease".into()),
                name: Some(self.config.lease_name.clone()),
                namespace: Some(self.config.namespace.clone()),
                ..ObjectReference::default()
            },
            |lease| lease.object_ref(&()),
        );
        let note = format!("{} {what}", self.config.identity);
        let action = if what == "became leader" {
            "Acquire"
        } else {
            "Release"
        };
        let recorder = self.recorder.clone();
        self.events.push(tokio::spawn(async move {
            recorder
                .publish(reference, EventType::Normal, "LeaderElection", action, note)
                .await;
        }));
    }

    /// Gives Events still being published a moment to finish before `run` returns.
    async fn flush_events(&mut self) {
        let pending = futures::future::join_all(self.events.drain(..));
        let _ = tokio::time::timeout(self.config.retry_period, pending).await;
    }
}

/// Watches the Lease and ticks `released` whenever it is seen without a holder or deleted,
/// so a follower takes a released Lease within a watch event's latency instead of at its
/// next poll. Polling stays the fallback: a watch that fails (no `list`/`watch` permission,
/// API server down) is retried with backoff and only logged.
async fn watch_releases(api: Api<Lease>, name: String, released: watch::Sender<()>) {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};

    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut events = std::pin::pin!(watcher(api, config).default_backoff());
    let mut failing = false;
    while let Some(event) = events.next().await {
        let is_released = |lease: &Lease| {
            lease
                .spec
                .as_ref()
                .and_then(|s| s.holder_identity.as_deref())
                .is_none_or(str::is_empty)
        };
        match event {
            Ok(watcher::Event::Apply(lease) | watcher::Event::InitApply(lease)) => {
                failing = false;
                if is_released(&lease) {
                    released.send_replace(());
                }
            }
            Ok(watcher::Event::Delete(_)) => {
                failing = false;
                released.send_replace(());
            }
            Ok(watcher::Event::Init | watcher::Event::InitDone) => {}
            Err(error) => {
                if !failing {
                    tracing::debug!(lease = %name, %error, "cannot watch the lease; polling only");
                }
                failing = true;
            }
        }
    }
}

/// Aborts a task when dropped, also when `run` itself is dropped.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// How long a candidate that does not lead waits before its next attempt: a retry period
/// with jitter (`random` in 0..1) so candidates do not move in step, but never past the moment
/// the observed Lease expires, so an abandoned Lease is taken when it expires and not up to
/// a retry period later.
///
/// client-go jitters followers by up to 1.2 × RetryPeriod; Steward by up to 0.5 ×, so a
/// released Lease (which a follower can take at once) is noticed within 1.5 × RetryPeriod. The
/// Lease protocol is unchanged: this is only when to look.
fn follower_pause(retry_period: Duration, expires_in: Option<Duration>, random: f64) -> Duration {
    let jittered = retry_period.mul_f64(1.0 + random.clamp(0.0, 1.0) * FOLLOWER_JITTER);
    match expires_in {
        Some(left) => jittered.min(left.max(Duration::from_millis(1))),
        None => jittered,
    }
}

/// Followers poll every RetryPeriod × (1 + rand × this).
const FOLLOWER_JITTER: f64 = 0.5;

/// The error and its sources, `: `-separated, for one log line.
fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn followers_wait_a_jittered_retry_period_but_wake_when_the_lease_expires() {
        let retry = Duration::from_secs(2);
        assert_eq!(follower_pause(retry, None, 0.0), retry);
        assert_eq!(follower_pause(retry, None, 1.0), Duration::from_secs(3));
        assert_eq!(
            follower_pause(retry, None, 7.0),
            Duration::from_secs(3),
            "clamped"
        );
        assert_eq!(
            follower_pause(retry, Some(Duration::from_millis(700)), 0.9),
            Duration::from_millis(700),
            "the Lease expires before the next retry"
        );
        assert_eq!(
            follower_pause(retry, Some(Duration::from_secs(9)), 0.5),
            Duration::from_millis(2500)
        );
        assert_eq!(
            follower_pause(retry, Some(Duration::ZERO), 0.5),
            Duration::from_millis(1),
            "never a busy loop"
        );
    }

    #[test]
    fn error_chain_includes_sources() {
        let err = Error::UpdateLease {
            lease: "ns/lock".into(),
            source: kube::Error::Api(Box::new(kube::core::Status {
                code: 409,
                message: "the object has been modified".into(),
                ..Default::default()
            })),
        };
        assert!(err.is_conflict());
        let text = error_chain(&err);
        assert!(
            text.starts_with("failed to update Lease ns/lock: "),
            "{text}"
        );
        assert!(text.contains("the object has been modified"), "{text}");
    }
}
