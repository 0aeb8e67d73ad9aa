//! The controller runtime: one [`Operator`] per process, any number of controllers in it.
//!
//! ```text
//! Operator::new(name, args)         client, metrics, health, leader elector from the flags
//!   .controller(Controller, data, reconcile)   a steward_core::Controller (kube-runtime's,
//!                                   with per-watch backoff, see crate::controller), wrapped:
//!        - runs always, so followers keep warm caches; reconciles only while leader,
//!          and reconciles everything again when leadership is acquired
//!        - a panicking reconcile is a failed reconcile (Warning Event, backoff), never a
//!          dead controller; a controller task that ends anyway fails /healthz
//!        - queued work without progress, or a watch failing, for longer than
//!          --stall-timeout fails /healthz
//!        - in-flight reconciles are cancelled when leadership is lost
//!        - per-object exponential backoff on errors, reset on success; permanent
//!          errors (invalid spec) wait for a change instead
//!        - a tracing span per reconcile with the object reference; metrics; a Warning
//!          Event on failure
//!   .run()                          serves /metrics /healthz /readyz, elects, runs until
//!                                   SIGTERM/SIGINT, drains (bounded), releases the Lease
//! ```
//!
//! The client handed to reconcilers refuses every write (POST, PUT, PATCH, DELETE) unless
//! [`Leadership::guard`] passes, i.e. this process leads and renewed within RenewDeadline by
//! the monotonic clock, so a process that was paused cannot write after waking.

use std::collections::HashMap;
use std::fmt::Debug;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use kube::runtime::controller::Action;
use kube::{Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use tracing::field::Empty;

use crate::cli::CommonArgs;
use crate::controller::Controller;
use crate::error::{ReconcileError, chain};
use crate::events::Recorder;
use crate::leader::{LeaderElector, Leadership, LeaseConfig};
use crate::metrics::Metrics;
use crate::server::{self, Health};
use crate::{Error, guard};

/// What every reconcile gets, next to the operator's own `data`.
pub struct Context<T> {
    /// A client whose writes are refused unless this process leads.
    pub client: Client,
    /// Events as this operator.
    pub recorder: Recorder,
    /// This operator's metrics.
    pub metrics: Metrics,
    /// Whether this process leads (check it before side effects outside the API server).
    pub leadership: Leadership,
    /// The server-side-apply field manager of this operator.
    pub field_manager: String,
    /// The operator's own state.
    pub data: T,
    /// What [`Context::apply_status`] wrote recently.
    written: crate::status::Written,
    /// The operator's client configuration, for [`Context::impersonating`] (`None` for a
    /// context built by [`Context::new`]).
    config: Option<kube::Config>,
    /// Impersonating clients by user name, built once each.
    impersonating: std::sync::Mutex<std::collections::HashMap<String, Client>>,
}

impl<T> Context<T> {
    /// A context outside a running [`Operator`], for calling a reconcile function directly
    /// (a test that drives an exact interleaving, a one-shot tool): it always leads, writes
    /// through `client` as field manager `name`, records Events as `name` and counts into
    /// metrics of its own.
    ///
    /// # Caveats
    /// Nothing fences its writes: use it only where no elected replica writes the same
    /// objects, or to reproduce what a stale or late reconcile would do.
    pub fn new(client: Client, name: &str, data: T) -> Self {
        Self::build(
            client,
            None,
            name,
            Leadership::always_leader(),
            Metrics::new(),
            data,
        )
    }

    /// The context of operator `name` writing through `client` (built from `config`) while
    /// `leadership` holds.
    fn build(
        client: Client,
        config: Option<kube::Config>,
        name: &str,
        leadership: Leadership,
        metrics: Metrics,
        data: T,
    ) -> Self {
        Self {
            recorder: Recorder::new(
                client.clone(),
                name,
                Some(leadership.identity().to_string()),
            ),
            client,
            metrics,
            leadership,
            field_manager: name.to_string(),
            data,
            written: crate::status::Written::default(),
            config,
            impersonating: std::sync::Mutex::default(),
        }
    }

    /// A client acting as `user` (Kubernetes impersonation: the API server authorizes each
    /// request as that user, e.g. `system:serviceaccount:<namespace>:<name>`), fenced by
    /// leadership like [`Context::client`]. Built once per user and kept. The operator's own
    /// identity needs the `impersonate` verb on that kind of user (`serviceaccounts`).
    ///
    /// # Errors
    /// [`Error::Config`] for a context without the operator's configuration
    /// ([`Context::new`]) or when the client cannot be built.
    pub fn impersonating(&self, user: &str) -> Result<Client, Error> {
        let mut clients = self
            .impersonating
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(client) = clients.get(user) {
            return Ok(client.clone());
        }
        let mut config = self.config.clone().ok_or_else(|| {
            Error::Config("this context has no client configuration to impersonate with".into())
        })?;
        config.auth_info.impersonate = Some(user.to_string());
        let client = crate::guard::client(config, self.leadership.clone())?;
        clients.insert(user.to_string(), client.clone());
        Ok(client)
    }

    /// The children of `owner`, applied as this operator through the guarded client, their
    /// writes counted in `steward_child_writes_total` under the owner's controller (its kind,
    /// lowercase). Use [`crate::apply::Children::ensure`] to write only what changed.
    pub fn children<P: Resource<DynamicType = ()>>(&self, owner: &P) -> crate::apply::Children {
        crate::apply::Children::new(self.client.clone(), owner, &self.field_manager)
            .counted(self.writes(&P::kind(&()).to_lowercase()))
    }

    /// The write counter of `controller`, for writes made outside [`Context::children`]
    /// (objects without an owner, namespaces created by POST).
    pub fn writes(&self, controller: &str) -> crate::apply::WriteCounter {
        crate::apply::WriteCounter::new(&self.metrics, controller)
    }

    /// Writes `status` by server-side apply under this operator's field manager unless it
    /// equals `current` (see [`crate::status::apply`]) or this process already wrote it on top
    /// of this version of `obj` (see [`crate::status::Written`]), counting writes in
    /// `steward_status_writes_total`. Call it once, at the end of a reconcile.
    ///
    /// # Guarantees
    /// - Nothing is written when `status` equals `current`, or when this process already wrote
    ///   it on top of exactly this version of `obj` (a stale cached copy).
    /// - The write carries `obj`'s resourceVersion: if `obj` changed since it was read (a spec
    ///   edit, or a newer leader's status), nothing is written and `Ok(false)` is returned; the
    ///   change triggers another reconcile. A former leader's late status write therefore
    ///   never overwrites the current leader's.
    ///
    /// # Caveats
    /// `status` must be computed from `obj` as passed (not from a copy read later), or the
    /// precondition checks the wrong version.
    ///
    /// # Errors
    /// [`Error::WriteStatus`] when the API server rejects the patch for another reason.
    pub async fn apply_status<K, S>(
        &self,
        obj: &K,
        current: Option<&S>,
        status: &S,
    ) -> Result<bool, Error>
    where
        K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug,
        K::Scope: crate::apply::ScopeApi,
        S: serde::Serialize + PartialEq,
    {
        let api: kube::Api<K> = <K::Scope as crate::apply::ScopeApi>::api(
            self.client.clone(),
            obj.namespace().as_deref(),
        );
        if self.written.already(obj, status) {
            return Ok(false);
        }
        let written = crate::status::apply(&api, obj, current, status, &self.field_manager).await?;
        if written {
            self.written.remember(obj, status);
            let kind = K::kind(&()).to_lowercase();
            self.metrics
                .status_writes
                .get_or_create(&self.metrics.controller(&kind))
                .inc();
        }
        Ok(written)
    }
}

/// Per-object exponential backoff: `base × 2^(failures-1)`, capped at `max`.
#[derive(Debug)]
pub struct Backoff {
    base: Duration,
    max: Duration,
    failures: Mutex<HashMap<String, u32>>,
}

impl Backoff {
    /// A backoff starting at `base`, doubling, capped at `max`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self {
            base,
            max,
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Records a failure of `key` and returns how long to wait before the next attempt.
    pub fn next_delay(&self, key: &str) -> Duration {
        let mut map = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let n = map.entry(key.to_string()).or_insert(0);
        *n = n.saturating_add(1);
        let factor = 2u32.saturating_pow(n.saturating_sub(1).min(30));
        self.base.saturating_mul(factor).min(self.max)
    }

    /// Forgets the failures of `key` (after a success).
    pub fn reset(&self, key: &str) {
        self.failures
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(key);
    }
}

/// Why a wrapped reconcile did not return the operator's `Action`.
#[derive(Debug, thiserror::Error)]
pub enum RunError<E: std::error::Error + 'static> {
    /// The operator's reconcile failed.
    #[error(transparent)]
    Reconcile(E),
    /// Leadership was lost while reconciling; the reconcile was cancelled.
    #[error("leadership lost during reconcile")]
    LostLeadership,
    /// The operator's reconcile panicked; it is retried with backoff like a failure.
    #[error("reconcile panicked: {0}")]
    Panicked(String),
    /// The reconcile ran longer than `--reconcile-timeout` and was cancelled; it is retried
    /// with backoff like a failure.
    #[error("reconcile did not finish within {0:?} (--reconcile-timeout) and was cancelled")]
    TimedOut(Duration),
}

/// One operator process.
pub struct Operator {
    name: String,
    args: CommonArgs,
    client: Client,
    guarded: Client,
    /// The configuration `guarded` was built from (for impersonating clients).
    config: kube::Config,
    metrics: Metrics,
    health: Health,
    leadership: Leadership,
    elector: Option<LeaderElector>,
    /// With `--shards N > 1`: the ring and one elector, leadership and guarded client per shard.
    sharding: Option<Sharding>,
    shutdown: CancellationToken,
    backoff_base: Duration,
    backoff_max: Duration,
    tasks: Vec<BoxFuture<'static, ()>>,
}

impl Operator {
    /// An operator named `name` (field manager, Lease name, Event reporter), configured by `args`.
    ///
    /// # Errors
    /// [`Error::Config`] without a usable kubeconfig; [`Error::LeaderConfig`] for invalid lease timings.
    pub async fn new(name: &str, args: CommonArgs) -> Result<Self, Error> {
        let config = args.config().await?;
        Self::with_config(name, args, config)
    }

    /// Like [`Operator::new`] with an explicit client configuration (tests run operators
    /// in-process this way, e.g. authenticated as the operator's ServiceAccount).
    ///
    /// # Errors
    /// As [`Operator::new`].
    pub fn with_config(name: &str, args: CommonArgs, config: kube::Config) -> Result<Self, Error> {
        let client = Client::try_from(config.clone()).map_err(|e| Error::Config(e.to_string()))?;
        let (elector, leadership, sharding) = if args.leader_elect {
            let namespace = args
                .leader_election_namespace
                .clone()
                .or_else(|| {
                    std::fs::read_to_string(
                        "/var/run/secrets/kubernetes.io/serviceaccount/namespace",
                    )
                    .ok()
                })
                .unwrap_or_else(|| "default".to_string());
            let mut lease = LeaseConfig::new(
                args.leader_election_id
                    .clone()
                    .unwrap_or_else(|| name.to_string()),
                namespace.trim().to_string(),
                LeaseConfig::identity_from_env(),
            );
            lease.lease_duration = args.leader_election_lease_duration;
            lease.renew_deadline = args.leader_election_renew_deadline;
            lease.retry_period = args.leader_election_retry_period;
            let sharding = if args.shards > 1 {
                Some(Sharding::new(&client, &config, &lease, args.shards)?)
            } else {
                None
            };
            let elector = LeaderElector::new(client.clone(), lease)?;
            let leadership = elector.leadership();
            (Some(elector), leadership, sharding)
        } else if args.shards > 1 {
            return Err(Error::Config(
                "--shards needs leader election (--leader-elect=true): each shard is a Lease"
                    .into(),
            ));
        } else {
            (None, Leadership::always_leader(), None)
        };
        let guarded = guard::client(config.clone(), leadership.clone())?;
        let health = Health::new();
        health.set_stall_timeout(args.stall_timeout);
        Ok(Self {
            name: name.to_string(),
            args,
            client,
            guarded,
            config,
            metrics: Metrics::new(),
            health,
            leadership,
            elector,
            sharding,
            shutdown: CancellationToken::new(),
            backoff_base: Duration::from_secs(1),
            backoff_max: Duration::from_secs(300),
            tasks: Vec::new(),
        })
    }

    /// Sets the per-object backoff (default 1 s doubling up to 5 min).
    pub fn backoff(mut self, base: Duration, max: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_max = max;
        self
    }

    /// The client for reconcilers: reads always, writes only while leading.
    pub fn client(&self) -> Client {
        self.guarded.clone()
    }

    /// A client that is not leader-guarded (for reads and follower-safe writes).
    pub fn unguarded_client(&self) -> Client {
        self.client.clone()
    }

    /// The operator's metrics (shared with `/metrics`).
    pub fn metrics(&self) -> Metrics {
        self.metrics.clone()
    }

    /// What `/healthz` and `/readyz` answer from.
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// This process's leadership.
    pub fn leadership(&self) -> Leadership {
        self.leadership.clone()
    }

    /// The flags the operator runs with.
    pub fn args(&self) -> &CommonArgs {
        &self.args
    }

    /// Cancelled when the operator shuts down; cancel it to stop [`Operator::run`].
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// An `Api` for the operator's own kind, limited to `--watch-namespace` when set.
    pub fn api<K>(&self) -> kube::Api<K>
    where
        K: Resource<DynamicType = ()>,
        K::Scope: crate::apply::ScopeApi,
    {
        <K::Scope as crate::apply::ScopeApi>::api(
            self.guarded.clone(),
            self.args.watch_namespace.as_deref(),
        )
    }

    /// Adds a controller. `reconcile` runs only while this process leads.
    ///
    /// # Guarantees
    /// - `reconcile` runs only while this process leads; every cached object is reconciled
    ///   again each time leadership is acquired; a reconcile in flight is cancelled when
    ///   leadership is lost.
    /// - A failed or panicking reconcile is retried with per-object exponential backoff and
    ///   reported as a Warning Event; a permanent error waits for a change of the object.
    /// - A watch error never pauses another watch (see [`crate::controller`]).
    ///
    /// # Caveats
    /// A reconcile that panics while holding a lock of the operator's own `data` may leave it
    /// poisoned; the runtime only guarantees that the controller keeps running.
    pub fn controller<K, T, F, Fut, E>(
        &mut self,
        controller: Controller<K>,
        data: T,
        reconcile: F,
    ) -> &mut Self
    where
        K: Resource<DynamicType = ()>
            + Clone
            + DeserializeOwned
            + serde::Serialize
            + Debug
            + Send
            + Sync
            + 'static,
        T: Send + Sync + 'static,
        F: Fn(Arc<K>, Arc<Context<T>>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: ReconcileError,
    {
        let ready = self.health.register_cache();
        let run = self.runner().run(
            controller,
            data,
            Arc::new(reconcile),
            self.leadership.clone(),
            self.guarded.clone(),
            self.shutdown.clone(),
            Some(Box::new(ready)),
            false,
        );
        self.tasks.push(Box::pin(run));
        self
    }

    fn runner(&self) -> Runner {
        Runner {
            name: self.name.clone(),
            config: self.config.clone(),
            metrics: self.metrics.clone(),
            health: self.health.clone(),
            concurrency: self.args.concurrency,
            reconcile_timeout: self.args.reconcile_timeout,
            backoff_base: self.backoff_base,
            backoff_max: self.backoff_max,
        }
    }

    /// How many shards the sharded controllers of this process spread their objects over
    /// (`--shards`; 1: not sharded).
    pub fn shards(&self) -> u32 {
        self.sharding
            .as_ref()
            .map_or(1, |s| s.leaderships.len() as u32)
    }

    /// The leadership of each shard this process may hold (empty when not sharded).
    pub fn shard_leaderships(&self) -> Vec<Leadership> {
        self.sharding
            .as_ref()
            .map(|s| s.leaderships.iter().map(|(l, _)| l.clone()).collect())
            .unwrap_or_default()
    }

    /// Adds a controller whose objects are spread over `--shards` shards (see [`crate::shard`]).
    /// `build(shard)` builds the controller and its data: for `Some(i)`, every watch of it must
    /// select only shard `i`'s objects (add [`crate::shard::selector`], e.g. with
    /// [`crate::shard::narrow`]). Without sharding it is called once with `None` and the
    /// controller runs as [`Operator::controller`] runs it.
    ///
    /// # Guarantees
    /// Those of [`Operator::controller`], per shard: shard `i`'s controller (its watches, stores
    /// and queue) runs only while this process holds shard `i`'s Lease, is built anew for each
    /// term and dropped when it ends, and its reconciles write through a client guarded by that
    /// Lease.
    ///
    /// # Caveats
    /// The objects must carry [`crate::shard::SHARD_LABEL`]: call [`Operator::shard_labels`]
    /// for the kind and for children users create. Children applied through
    /// [`Context::children`] are labelled with their owner's shard.
    pub fn sharded_controller<K, T, B, F, Fut, E>(&mut self, build: B, reconcile: F) -> &mut Self
    where
        K: Resource<DynamicType = ()>
            + Clone
            + DeserializeOwned
            + serde::Serialize
            + Debug
            + Send
            + Sync
            + 'static,
        T: Send + Sync + 'static,
        B: Fn(Option<u32>) -> (Controller<K>, T) + Send + Sync + 'static,
        F: Fn(Arc<K>, Arc<Context<T>>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: ReconcileError,
    {
        let Some(sharding) = &self.sharding else {
            let (controller, data) = build(None);
            return self.controller(controller, data, reconcile);
        };
        let build = Arc::new(build);
        let reconcile = Arc::new(reconcile);
        let terms: Vec<_> = sharding
            .leaderships
            .iter()
            .enumerate()
            .map(|(shard, (leadership, guarded))| {
                let (runner, build, reconcile) = (self.runner(), build.clone(), reconcile.clone());
                let (leadership, guarded) = (leadership.clone(), guarded.clone());
                let shard = u32::try_from(shard).unwrap_or(u32::MAX);
                crate::leader::run_while_leader(
                    leadership.clone(),
                    self.shutdown.clone(),
                    move |stop| {
                        tracing::info!(shard, "holding the shard: starting its controller");
                        let (controller, data) = build(Some(shard));
                        runner.run(
                            controller,
                            data,
                            reconcile.clone(),
                            leadership.clone(),
                            guarded.clone(),
                            stop,
                            None,
                            true,
                        )
                    },
                )
            })
            .collect();
        self.tasks
            .push(Box::pin(futures::future::join_all(terms).map(|_| ())));
        self
    }

    /// With `--shards N > 1`: while this process leads (the operator's main Lease), keeps
    /// [`crate::shard::SHARD_LABEL`] on every `K` matching `labels` right, for the shard of
    /// `key(metadata)` (`None`: leave the object alone). For the sharded kind itself pass
    /// [`crate::shard::key_of`]; for children users create, the key of the owner named by
    /// their label. Does nothing without sharding.
    pub fn shard_labels<K>(
        &mut self,
        labels: Option<&str>,
        key: impl Fn(&k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Option<String>
        + Send
        + Sync
        + 'static,
    ) -> &mut Self
    where
        K: crate::object::Object,
        K::Scope: crate::apply::ScopeApi,
    {
        let shards = self.shards();
        if shards <= 1 {
            return self;
        }
        let (client, namespace) = (self.guarded.clone(), self.args.watch_namespace.clone());
        let labels = labels.map(str::to_string);
        let key: crate::shard::ShardKey = Arc::new(key);
        self.singleton(move |stop| {
            crate::shard::label::<K>(
                client.clone(),
                namespace.clone(),
                labels.clone(),
                shards,
                key.clone(),
                stop,
            )
        })
    }

    /// Adds a singleton task: `f(token)` runs each time this process becomes leader; the token
    /// is cancelled when leadership is lost or the operator shuts down.
    pub fn singleton<F, Fut>(&mut self, f: F) -> &mut Self
    where
        F: Fn(CancellationToken) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let leadership = self.leadership.clone();
        let shutdown = self.shutdown.clone();
        self.tasks.push(Box::pin(crate::leader::run_while_leader(
            leadership, shutdown, f,
        )));
        self
    }

    /// Serves the endpoints, runs leader election and every controller until SIGTERM/SIGINT
    /// or [`Operator::shutdown_token`] is cancelled; then stops taking work, lets in-flight
    /// reconciles finish until the drain deadline (`--shutdown-timeout` minus the release
    /// reserve), cancels what is still running, releases the Lease and returns, all within
    /// `--shutdown-timeout`.
    ///
    /// # Errors
    /// [`Error::Bind`] when an endpoint cannot bind; [`Error::ShutdownTimeout`] when the Lease
    /// could not be released within the bound (it then expires on its own).
    pub async fn run(self) -> Result<(), Error> {
        let Operator {
            name,
            args,
            metrics,
            health,
            leadership,
            elector,
            sharding,
            shutdown,
            tasks,
            ..
        } = self;
        let server_stop = CancellationToken::new();
        let metrics_addr = args.metrics_addr()?;
        let health_addr = args.health_addr()?;
        let mut servers = Vec::new();
        let addrs: Vec<SocketAddr> = match (metrics_addr, health_addr) {
            (Some(m), Some(h)) if m == h => vec![m],
            (m, h) => m.into_iter().chain(h).collect(),
        };
        for addr in addrs {
            let (bound, task) =
                server::serve(addr, metrics.clone(), health.clone(), server_stop.clone()).await?;
            tracing::info!(%bound, "serving /metrics, /healthz and /readyz");
            servers.push(task);
        }

        let elector_stop = CancellationToken::new();
        let elector_task = elector.map(|e| tokio::spawn(e.run(elector_stop.clone())));
        let mut shard_tasks = Vec::new();
        if let Some(Sharding {
            ring,
            electors,
            leases,
            ..
        }) = sharding
        {
            let ready = health.register_cache();
            let mut settled = ring.settled();
            shard_tasks.push(tokio::spawn(async move {
                if settled.wait_for(|s| *s).await.is_ok() {
                    ready();
                }
            }));
            shard_tasks.push(tokio::spawn(ring.run(elector_stop.clone())));
            for (shard, (elector, lease)) in electors.into_iter().zip(leases).enumerate() {
                let gauge = metrics
                    .leader
                    .get_or_create(&crate::metrics::LeaseLabels { name: lease })
                    .clone();
                let leading = elector.leadership().subscribe();
                let stop = elector_stop.clone();
                shard_tasks.push(tokio::spawn(async move {
                    let election = elector.run(stop);
                    tokio::pin!(election);
                    let ended = tokio::select! {
                        ended = &mut election => ended,
                        () = mirror(gauge.clone(), leading) => election.await,
                    };
                    gauge.set(0);
                    if let Err(e) = ended {
                        tracing::warn!(shard, error = %chain(&e), "shard election ended with an error");
                    }
                }));
            }
        }
        let gauge = metrics
            .leader
            .get_or_create(&crate::metrics::LeaseLabels { name: name.clone() })
            .clone();
        let gauge_task = tokio::spawn(mirror(gauge, leadership.subscribe()));

        let work = tokio::spawn(futures::future::join_all(tasks));
        tracing::info!(operator = %name, identity = leadership.identity(), "started");
        let signal_stop = shutdown.clone();
        tokio::select! {
            () = wait_for_signal() => tracing::info!("shutdown signal received"),
            () = signal_stop.cancelled() => tracing::info!("shutdown requested"),
        }
        // The bound holds by construction: in-flight work gets until `drain_until` to finish,
        // then its futures are dropped (every reconcile, with its API requests, SQL and
        // port-forwards, is polled inside them: dropping cancels them where they wait, as a
        // crash at that line would); the Lease is released in what is left.
        let stopping = tokio::time::Instant::now();
        let drain = args.shutdown_timeout - release_reserve(&args);
        let (drain_until, deadline) = (stopping + drain, stopping + args.shutdown_timeout);
        shutdown.cancel();
        let mut work = work;
        let cancelled = match tokio::time::timeout_at(drain_until, &mut work).await {
            Ok(_) => false,
            Err(_) => {
                tracing::warn!(
                    ?drain,
                    "in-flight work did not finish in time; cancelling it"
                );
                work.abort();
                let _ = tokio::time::timeout_at(deadline, work).await;
                true
            }
        };
        elector_stop.cancel();
        let mut released = true;
        if let Some(task) = elector_task {
            match tokio::time::timeout_at(deadline, task).await {
                Ok(Ok(Err(e))) => {
                    released = false;
                    tracing::warn!(error = %chain(&e), "leader election ended with an error")
                }
                Ok(Err(e)) => {
                    released = false;
                    tracing::warn!(error = %e, "leader election task failed")
                }
                Ok(Ok(Ok(()))) => {}
                Err(_) => {
                    released = false;
                    tracing::warn!(
                        "the Lease was not released within the shutdown bound; it expires on its own"
                    );
                }
            }
        }
        for task in shard_tasks {
            if tokio::time::timeout_at(deadline, task).await.is_err() {
                released = false;
            }
        }
        gauge_task.abort();
        server_stop.cancel();
        for s in servers {
            let _ = tokio::time::timeout_at(deadline, s).await;
        }
        if cancelled {
            tracing::info!("stopped (in-flight work cancelled at the drain deadline)");
        }
        tracing::info!("stopped");
        if released {
            Ok(())
        } else {
            Err(Error::ShutdownTimeout(args.shutdown_timeout))
        }
    }
}

/// How much of `--shutdown-timeout` is kept for releasing the Lease (and the shard Leases)
/// after in-flight work is drained or cancelled: a release takes one API request, given up
/// after the renew deadline; never more than half the bound, so the drain gets the rest.
fn release_reserve(args: &CommonArgs) -> Duration {
    if !args.leader_elect && args.shards <= 1 {
        return args.shutdown_timeout / 10;
    }
    args.leader_election_renew_deadline
        .min(args.shutdown_timeout / 2)
}

/// The shards of one process: the ring deciding which it stands for, and per shard an elector,
/// its leadership and the client that leadership guards.
struct Sharding {
    ring: crate::shard::Ring,
    electors: Vec<LeaderElector>,
    /// The shard Leases' names, by shard.
    leases: Vec<String>,
    leaderships: Vec<(Leadership, Client)>,
}

impl Sharding {
    /// `shards` shard Leases `<lease>-shard-<i>` next to the operator's `lease`, for the same
    /// candidate.
    fn new(
        client: &Client,
        config: &kube::Config,
        lease: &LeaseConfig,
        shards: u32,
    ) -> Result<Self, Error> {
        let ring =
            crate::shard::Ring::new(client.clone(), lease.clone(), &lease.lease_name, shards);
        let mut electors = Vec::new();
        let mut leases = Vec::new();
        let mut leaderships = Vec::new();
        for shard in 0..shards {
            let mut config_i = lease.clone();
            config_i.lease_name = format!("{}-shard-{shard}", lease.lease_name);
            leases.push(config_i.lease_name.clone());
            let elector = LeaderElector::new(client.clone(), config_i)?
                .with_candidacy(ring.candidacy(shard))
                .handing_over_when_ineligible()
                .with_reporter(lease.lease_name.clone());
            let leadership = elector.leadership();
            leaderships.push((
                leadership.clone(),
                guard::client(config.clone(), leadership)?,
            ));
            electors.push(elector);
        }
        Ok(Self {
            ring,
            electors,
            leases,
            leaderships,
        })
    }
}

/// What running a controller needs from its [`Operator`] (cheap to clone).
#[derive(Clone)]
struct Runner {
    name: String,
    config: kube::Config,
    metrics: Metrics,
    health: Health,
    concurrency: u16,
    reconcile_timeout: Duration,
    backoff_base: Duration,
    backoff_max: Duration,
}

impl Runner {
    /// The future that runs `controller` (see [`Operator::controller`]) with `leadership` and
    /// its `guarded` client until `stop`; `ready` is called when its cache synced. With
    /// `shard_term`, the run is one shard's term: its liveness is forgotten when it ends.
    #[allow(clippy::too_many_arguments)]
    fn run<K, T, F, Fut, E>(
        &self,
        controller: Controller<K>,
        data: T,
        reconcile: Arc<F>,
        leadership: Leadership,
        guarded: Client,
        stop: CancellationToken,
        ready: Option<Box<dyn FnOnce() + Send>>,
        shard_term: bool,
    ) -> impl Future<Output = ()> + Send + 'static + use<K, T, F, Fut, E>
    where
        K: Resource<DynamicType = ()>
            + Clone
            + DeserializeOwned
            + serde::Serialize
            + Debug
            + Send
            + Sync
            + 'static,
        T: Send + Sync + 'static,
        F: Fn(Arc<K>, Arc<Context<T>>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Action, E>> + Send + 'static,
        E: ReconcileError,
    {
        let kind = K::kind(&()).to_string();
        let name = kind.to_lowercase();
        let ctx = Arc::new(Context::build(
            guarded,
            Some(self.config.clone()),
            &self.name,
            leadership.clone(),
            self.metrics.clone(),
            data,
        ));
        let backoff = Arc::new(Backoff::new(self.backoff_base, self.backoff_max));
        let metrics = self.metrics.clone();
        metrics
            .max_concurrent
            .get_or_create(&metrics.controller(&name))
            .set(i64::from(self.concurrency));

        let (controller, store, tracker) = controller.into_parts();
        tracker.attach(&name, &self.metrics, leadership.clone());
        let liveness: Arc<dyn crate::controller::Liveness> = tracker.clone();
        self.health.watch_controller(liveness.clone());
        let resync = {
            let (tracker, store) = (tracker.clone(), store.clone());
            leadership_acquired(leadership.clone()).flat_map(move |()| {
                tracker.triggered_all();
                changed_first(store.state())
            })
        };
        let shutdown = stop.clone();
        let controller = controller
            .with_config(kube::runtime::controller::Config::default().concurrency(self.concurrency))
            .reconcile_on(resync)
            .graceful_shutdown_on(async move { shutdown.cancelled_owned().await });

        let reconcile_timeout = self.reconcile_timeout;
        let wrapped = {
            let backoff = backoff.clone();
            let metrics = metrics.clone();
            let name = name.clone();
            let tracker = tracker.clone();
            move |obj: Arc<K>, ctx: Arc<Context<T>>| {
                let reconcile = reconcile.clone();
                let backoff = backoff.clone();
                let metrics = metrics.clone();
                let name = name.clone();
                let tracker = tracker.clone();
                let key = object_key(obj.as_ref());
                let span = tracing::info_span!(
                    "reconcile",
                    controller = %name,
                    object = %key,
                    result = Empty,
                    error = Empty,
                    otel.status_code = Empty,
                );
                let traced = span.clone();
                async move {
                    let leadership = ctx.leadership.clone();
                    if !leadership.is_leader() {
                        traced.record("result", "skipped");
                        metrics.reconcile_total.get_or_create(&metrics.result(&name, "skipped")).inc();
                        return Ok(Action::await_change());
                    }
                    tracker.started(obj.as_ref());
                    let labels = metrics.controller(&name);
                    metrics.active_workers.get_or_create(&labels).inc();
                    let started = Instant::now();
                    // Building the future may panic as well as polling it.
                    let attempt = std::panic::AssertUnwindSafe(async {
                        reconcile(obj.clone(), ctx.clone()).await
                    })
                    .catch_unwind();
                    let result = tokio::select! {
                        r = attempt => match r {
                            Ok(r) => r.map_err(RunError::Reconcile),
                            Err(panic) => Err(RunError::Panicked(panic_message(panic.as_ref()))),
                        },
                        () = leadership.lost() => Err(RunError::LostLeadership),
                        () = tokio::time::sleep(reconcile_timeout) => Err(RunError::TimedOut(reconcile_timeout)),
                    };
                    metrics.active_workers.get_or_create(&labels).dec();
                    metrics.reconcile_time.get_or_create(&labels).observe(started.elapsed().as_secs_f64());
                    match &result {
                        Ok(_) => {
                            traced.record("result", "success");
                            backoff.reset(&key);
                            metrics.reconcile_total.get_or_create(&metrics.result(&name, "success")).inc();
                        }
                        Err(RunError::LostLeadership) => {
                            traced.record("result", "skipped");
                            metrics.reconcile_total.get_or_create(&metrics.result(&name, "skipped")).inc();
                        }
                        Err(RunError::Panicked(message)) => {
                            metrics.reconcile_total.get_or_create(&metrics.result(&name, "error")).inc();
                            metrics.reconcile_errors.get_or_create(&labels).inc();
                            metrics.reconcile_panics.get_or_create(&labels).inc();
                            tracing::error!(panic = %message, "reconcile panicked; retrying with backoff");
                            // After the log line, which already says it.
                            traced.record("result", "panicked");
                            traced.record("error", message.as_str());
                            traced.record("otel.status_code", "ERROR");
                            ctx.recorder
                                .warning(obj.as_ref(), "ReconcilePanicked", "Reconcile", format!("reconcile panicked: {message}"))
                                .await;
                        }
                        Err(failed @ (RunError::Reconcile(_) | RunError::TimedOut(_))) => {
                            let (reason, message) = match failed {
                                RunError::Reconcile(e) => {
                                    let e: &E = e;
                                    (e.reason(), chain(e))
                                }
                                timed_out => ("ReconcileTimedOut", timed_out.to_string()),
                            };
                            metrics.reconcile_total.get_or_create(&metrics.result(&name, "error")).inc();
                            metrics.reconcile_errors.get_or_create(&labels).inc();
                            tracing::warn!(reason, error = %message, "reconcile failed");
                            // After the log line, which already says it.
                            traced.record("result", "error");
                            traced.record("error", message.as_str());
                            traced.record("otel.status_code", "ERROR");
                            ctx.recorder.warning(obj.as_ref(), reason, "Reconcile", message).await;
                        }
                    }
                    result
                }
                .instrument(span)
            }
        };
        let error_policy = move |obj: Arc<K>, err: &RunError<E>, _ctx: Arc<Context<T>>| match err {
            RunError::LostLeadership => Action::await_change(),
            RunError::Reconcile(e) if e.is_permanent() => Action::await_change(),
            RunError::Reconcile(e) => {
                let delay = backoff.next_delay(&object_key(obj.as_ref()));
                Action::requeue(e.max_backoff().map_or(delay, |cap| delay.min(cap)))
            }
            RunError::Panicked(_) | RunError::TimedOut(_) => {
                Action::requeue(backoff.next_delay(&object_key(obj.as_ref())))
            }
        };

        let cache_stop = stop.clone();
        let synced = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let synced_flag = synced.clone();
        let cache = async move {
            // A cache that never lists (a watch that keeps failing) must not hold up shutdown.
            tokio::select! {
                listed = store.listed() => {
                    if listed {
                        synced_flag.store(true, std::sync::atomic::Ordering::SeqCst);
                        if let Some(ready) = ready {
                            ready();
                        }
                    }
                }
                () = cache_stop.cancelled() => {}
            }
        };
        let health = self.health.clone();
        let stopping = stop;
        let run = async move {
            let run = controller
                .run(wrapped, error_policy, ctx)
                .for_each(|result| async move {
                    if let Err(e) = result {
                        tracing::debug!(error = %e, "controller event");
                    }
                });
            // kube-runtime holds the reconcile runner until the cache syncs, and its graceful
            // shutdown waits for it; a cache that never synced has nothing in flight, so
            // shutdown does not wait for it.
            let unsynced_stop = {
                let stopping = stopping.clone();
                async move {
                    stopping.cancelled().await;
                    if synced.load(std::sync::atomic::Ordering::SeqCst) {
                        std::future::pending::<()>().await;
                    }
                }
            };
            let ended = tokio::select! {
                ended = std::panic::AssertUnwindSafe(run).catch_unwind() => ended,
                () = unsynced_stop => Ok(()),
            };
            if !stopping.is_cancelled() {
                let why = match ended {
                    Ok(()) => format!("controller {name} stopped"),
                    Err(panic) => format!(
                        "controller {name} panicked: {}",
                        panic_message(panic.as_ref())
                    ),
                };
                tracing::error!(reason = %why, "controller is dead; /healthz fails");
                health.set_dead(why);
            }
            if shard_term {
                health.unwatch_controller(&liveness);
            }
        };
        async move {
            futures::future::join(cache, run).await;
        }
    }
}

/// Keeps `gauge` (`leader_election_master_status`) at 1 while `leading` says so, until the
/// leadership is dropped.
async fn mirror(
    gauge: prometheus_client::metrics::gauge::Gauge,
    mut leading: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        gauge.set(i64::from(*leading.borrow_and_update()));
        if leading.changed().await.is_err() {
            return;
        }
    }
}

/// The message of a panic payload (`panic!` with a string or a format).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic payload".into())
}

/// `namespace/name` (or `name` for cluster-scoped objects).
pub fn object_key<K: Resource>(obj: &K) -> String {
    match obj.namespace() {
        Some(ns) => format!("{ns}/{}", obj.name_any()),
        None => obj.name_any(),
    }
}

/// Whether `obj`'s status does not yet reflect its spec: no `status.observedGeneration`, or
/// one below `metadata.generation` (a spec changed since it was last reconciled, e.g. while
/// no replica led). Objects without a generation are settled.
fn unsettled<K: serde::Serialize>(obj: &K) -> bool {
    let Ok(value) = serde_json::to_value(obj) else {
        return false;
    };
    let Some(generation) = value["metadata"]["generation"].as_i64() else {
        return false;
    };
    value["status"]["observedGeneration"]
        .as_i64()
        .is_none_or(|observed| observed < generation)
}

/// The reconcile-all on acquiring leadership, in an order that does not make a changed object
/// wait behind every other: the [`unsettled`] objects first, then the rest in small batches a
/// millisecond apart, so the scheduler (which starts due requests in the order they fell due)
/// runs them after the changed ones, and a change arriving meanwhile joins the queue behind a
/// batch, not behind all of them.
fn changed_first<K>(
    objects: Vec<Arc<K>>,
) -> impl futures::Stream<Item = kube::runtime::reflector::ObjectRef<K>> + Send + 'static
where
    K: Resource<DynamicType = ()> + serde::Serialize + Send + Sync + 'static,
{
    const BATCH: usize = 32;
    let (changed, rest): (Vec<_>, Vec<_>) =
        objects.into_iter().partition(|o| unsettled(o.as_ref()));
    let first = futures::stream::iter(
        changed
            .iter()
            .map(|o| kube::runtime::reflector::ObjectRef::from_obj(o.as_ref()))
            .collect::<Vec<_>>(),
    );
    let batches: Vec<Vec<_>> = rest
        .chunks(BATCH)
        .map(|c| {
            c.iter()
                .map(|o| kube::runtime::reflector::ObjectRef::from_obj(o.as_ref()))
                .collect()
        })
        .collect();
    let later = futures::stream::iter(batches).then(|batch| async move {
        tokio::time::sleep(Duration::from_millis(1)).await;
        futures::stream::iter(batch)
    });
    first.chain(later.flatten())
}

/// A stream that yields once each time leadership goes from false to true (and once at
/// start if already leading).
fn leadership_acquired(leadership: Leadership) -> impl futures::Stream<Item = ()> + Send + 'static {
    let rx = leadership.subscribe();
    futures::stream::unfold((rx, false), |(mut rx, mut was)| async move {
        loop {
            let now = *rx.borrow_and_update();
            if now && !was {
                return Some(((), (rx, true)));
            }
            was = now;
            if rx.changed().await.is_err() {
                return None;
            }
        }
    })
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {},
                    _ = tokio::signal::ctrl_c() => {},
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deployment(
        name: &str,
        generation: i64,
        observed: Option<i64>,
    ) -> Arc<k8s_openapi::api::apps::v1::Deployment> {
        let mut d = k8s_openapi::api::apps::v1::Deployment::default();
        d.metadata.name = Some(name.into());
        d.metadata.namespace = Some("ns".into());
        d.metadata.generation = Some(generation);
        d.status = observed.map(|o| k8s_openapi::api::apps::v1::DeploymentStatus {
            observed_generation: Some(o),
            ..Default::default()
        });
        Arc::new(d)
    }

    #[test]
    fn an_object_is_unsettled_until_its_generation_is_observed() {
        assert!(unsettled(deployment("a", 2, Some(1)).as_ref()));
        assert!(
            unsettled(deployment("a", 1, None).as_ref()),
            "never reconciled"
        );
        assert!(!unsettled(deployment("a", 2, Some(2)).as_ref()));
        assert!(
            !unsettled(&k8s_openapi::api::core::v1::ConfigMap::default()),
            "no generation: nothing to compare"
        );
    }

    #[tokio::test]
    async fn the_resync_starts_with_the_changed_objects() {
        let mut objects: Vec<_> = (0..100)
            .map(|i| deployment(&format!("d{i}"), 1, Some(1)))
            .collect();
        objects.insert(70, deployment("changed", 3, Some(2)));
        objects.insert(5, deployment("new", 1, None));
        let order: Vec<String> = changed_first(objects).map(|r| r.name).collect().await;
        assert_eq!(order.len(), 102);
        assert_eq!(&order[..2], ["new", "changed"]);
        assert_eq!(order[2], "d0");
    }

    #[test]
    fn backoff_doubles_caps_and_resets() {
        let b = Backoff::new(Duration::from_millis(100), Duration::from_millis(700));
        let delays: Vec<_> = (0..5).map(|_| b.next_delay("ns/a").as_millis()).collect();
        assert_eq!(delays, vec![100, 200, 400, 700, 700]);
        assert_eq!(
            b.next_delay("ns/b").as_millis(),
            100,
            "objects back off independently"
        );
        b.reset("ns/a");
        assert_eq!(b.next_delay("ns/a").as_millis(), 100);
    }
}
