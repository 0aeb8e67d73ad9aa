//! The instance manager's loop: decide from the Lease, act on PostgreSQL, report on the pod.
//!
//! Every tick (half a second) it:
//! 1. **fences**: not holding the Lease (or past its renew deadline) while PostgreSQL runs
//!    read-write → immediate shutdown (the [`crate::watchdog`] does the same from outside
//!    this process, so a paused manager is fenced too);
//! 2. **prepares** the data directory if empty: `initdb` when it holds the Lease and no
//!    cluster exists yet, otherwise `pg_basebackup` from the primary;
//! 3. **runs** PostgreSQL in the role the Lease gives it: the holder promotes (or starts
//!    read-write) and moves the `role` labels so the `-rw` Service follows it; every other
//!    instance streams from the holder, and a former primary (or a replica that cannot
//!    stream because its timeline forked) is `pg_rewind`-ed first;
//! 4. **reports** its role, timeline and position on its pod (only when they changed) and
//!    tells steward-core's elector whether it may take a free Lease
//!    ([`crate::election::candidacy`]).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use steward_core::leader::{LeaderElector, Leadership, LeaseConfig};
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::archive::{self, Store, StoreConfig};
use crate::backups;
use crate::contract::{
    self, CLUSTER_LABEL, InstanceStatus, Lsn, PRIMARY, REPLICA, ROLE_LABEL, Role, STATUS_ANNOTATION,
};
use crate::election::{self, Candidacy, Peer};
use crate::metrics::Metrics;
use crate::postgres::{self, Observed, Paths, Postmaster};
use crate::watchdog::Message;
use crate::{conf, http, standby};
use steward_database_api::PostgresCluster;

/// How the instance manager is configured (from the pod's environment; see `main.rs`).
#[derive(Clone, Debug)]
pub struct Settings {
    pub pod: String,
    pub namespace: String,
    pub cluster: String,
    pub paths: Paths,
    pub superuser_password: String,
    pub replication_password: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
    /// How long a replica may fail to stream from the primary before it is rewound.
    pub stream_timeout: Duration,
    /// How long the primary's PostgreSQL may not answer before this instance kills it and
    /// gives up the Lease.
    pub unresponsive_timeout: Duration,
    /// The manager's own executable, started again as the watchdog.
    pub exe: PathBuf,
    /// `spec.backup`'s object store: WAL is archived there (by PostgreSQL's
    /// `archive_command`) and `PostgresBackup`s go there. `Err`: configured but unusable.
    pub backup: Option<Result<StoreConfig, String>>,
    /// Base backups kept by the retention policy (0: all).
    pub backup_keep: usize,
    /// `spec.bootstrap.recovery`: the first instance restores this store's backup instead of
    /// running `initdb`.
    pub recovery: Option<StoreConfig>,
    /// Recover up to this time (RFC 3339), not to the end of the archive.
    pub recovery_target_time: Option<String>,
    /// `spec.replica.source`: the store of the cluster this one follows while
    /// `spec.replica.enabled` (read from the PostgresCluster each tick).
    pub replica_source: Option<StoreConfig>,
}

/// How the first instance of a cluster restores a backup.
#[derive(Clone, Copy, Debug)]
enum Restore {
    /// `spec.bootstrap.recovery`: to its target time (or the archive's end), then promoted.
    ToTarget,
    /// `spec.replica`: as a standby following the source's archive.
    Follow,
}

const TICK: Duration = Duration::from_millis(500);
/// After SIGTERM: how long the step in flight may still take, and the bound on recording the
/// last primary. With PostgreSQL's fast shutdown (30 s, then immediate) and the Lease's
/// release (its renew deadline) this stays within the pod's 60 s grace period.
const STEP_GRACE: Duration = Duration::from_secs(5);
/// Failed starts in a row after which a replica's data directory is cloned afresh.
const MAX_FAILED_STARTS: u32 = 10;
const API_TIMEOUT: Duration = Duration::from_secs(3);
/// A switchover: how long the fast shutdown may take (a checkpoint just before keeps it
/// short) before it is refused, how long the target may take to confirm the last WAL, how
/// lately it must have replied and how far behind it may be to start.
const HANDOVER_SHUTDOWN: Duration = Duration::from_secs(30);
const HANDOVER_CONFIRM: Duration = Duration::from_secs(10);
const REPLY_FRESH: Duration = Duration::from_secs(15);
const MAX_HANDOVER_LAG: u64 = 16 << 20;
/// An instance whose PostgreSQL has not answered for this long is not ready.
const STALE_AFTER: Duration = Duration::from_secs(5);

/// Runs the instance until `shutdown`, then stops PostgreSQL (fast) and releases the Lease.
///
/// # Errors
/// When the run directory, the passfile or the watchdog cannot be set up.
pub async fn run(
    settings: Settings,
    client: Client,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let paths = settings.paths.clone();
    std::fs::create_dir_all(&paths.run_dir)?;
    postgres::write_file(
        &paths.passfile(),
        &conf::pgpass(&settings.replication_password),
        0o600,
    )?;
    if !paths.instance_conf().exists() {
        postgres::write_file(&paths.instance_conf(), &conf::primary_conf(), 0o644)?;
    }
    let installed_major = crate::upgrade::installed_major().await.ok();
    postgres::write_file(
        &paths.defaults_conf(),
        &conf::defaults_conf(installed_major),
        0o644,
    )?;

    let (eligible_tx, eligible_rx) = watch::channel(false);
    let (decided_tx, decided_rx) = watch::channel(election::Decided::default());
    let election = Election::start(&client, &settings, eligible_rx, decided_rx)?;
    let (leadership_tx, leadership_rx) = watch::channel(election.leadership.clone());

    let primary_pid = Arc::new(AtomicI32::new(0));
    let fence = tokio::spawn(heartbeat(
        settings.exe.clone(),
        leadership_rx,
        primary_pid.clone(),
    ));
    let health = http::Health::default();
    let metrics = Metrics::new(
        paths.run_dir.clone(),
        PathBuf::from(steward_database_api::monitoring::QUERIES_DIR),
    );
    let server = tokio::spawn(http::serve(
        health.clone(),
        metrics.clone(),
        shutdown.clone(),
    ));

    let backup_store = settings
        .backup
        .clone()
        .map(|c| c.and_then(|c| Store::open(c).map_err(|e| e.to_string())));
    let archive_to = backup_store.clone().and_then(Result::ok);
    let source = settings
        .replica_source
        .clone()
        .map(Store::open)
        .transpose()?;
    let backups = backups::Runner::new(
        client.clone(),
        &settings.namespace,
        &settings.cluster,
        &settings.pod,
        backup_store,
        settings.backup_keep,
        paths.clone(),
    );
    // A restore interrupted after unpacking: replay on (instance.conf still says how).
    let recovering = paths.recovery_signal().exists() && settings.recovery.is_some();
    let mut instance = Instance {
        backups,
        archive_to,
        source,
        standby: false,
        configured_standby: false,
        source_listed: None,
        fence_checked_at: None,
        announced: false,
        recovering,
        leases: Api::namespaced(client.clone(), &settings.namespace),
        pods: Api::namespaced(client.clone(), &settings.namespace),
        client,
        settings,
        election,
        leadership: leadership_tx,
        eligible: eligible_tx,
        decided: decided_tx,
        primary_pid,
        health,
        metrics,
        postmaster: None,
        observed: None,
        answered_at: None,
        unanswered_since: None,
        switchover_waiting: None,
        following: None,
        installed_major,
        needs_rewind: false,
        not_streaming_since: None,
        roles_ensured: false,
        published: None,
        certificate: None,
        rewind_failures: 0,
        stream_broke: false,
        streamed_timeline: None,
        cannot_catch_up: 0,
        failed_starts: 0,
        analyze: None,
        analyze_retry_at: None,
        failing: None,
    };
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = shutdown.cancelled() => break,
            _ = tick.tick() => {}
        }
        // A step waits on PostgreSQL, the API server, pg_rewind…: SIGTERM must not wait for
        // one that hangs (a SIGSTOPped postmaster, a paused API server). The step in flight
        // gets STEP_GRACE to finish, then is cancelled where it waits, as a kill there would.
        let step = instance.tick();
        tokio::pin!(step);
        let stepped = tokio::select! {
            r = &mut step => Some(r),
            () = shutdown.cancelled() => tokio::time::timeout(STEP_GRACE, &mut step).await.ok(),
        };
        match stepped {
            Some(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), "instance step failed; retrying");
            }
            Some(Ok(())) => {}
            None => {
                tracing::warn!(grace = ?STEP_GRACE, "the step in flight did not finish after SIGTERM; cancelled");
                break;
            }
        }
    }

    tracing::info!("shutting down: stopping PostgreSQL, then releasing the Lease");
    // A stopping instance never takes a free Lease (a replica stopping beside its primary
    // would otherwise take the Lease that primary just released, and be named its last
    // primary without ever running read-write).
    instance.eligible.send_replace(false);
    let ran_read_write = instance.observed.as_ref().is_some_and(|o| !o.in_recovery);
    instance.primary_pid.store(0, Ordering::SeqCst);
    if let Some(pm) = instance.postmaster.take() {
        pm.stop(Duration::from_secs(30)).await;
    }
    if ran_read_write && instance.election.leadership.is_leader() {
        // Stopped cleanly with every write: named on the Lease, so that if the whole cluster
        // stopped, it is the one that starts as the primary again.
        match tokio::time::timeout(STEP_GRACE, instance.record_last_primary()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), "recording this instance as the last primary failed");
            }
            Err(_) => tracing::warn!(
                "recording this instance as the last primary took over {STEP_GRACE:?}; skipped"
            ),
        }
    }
    instance.election.stop().await;
    fence.abort();
    let _ = server.await;
    Ok(())
}

/// Tells the watchdog, every 200 ms, until when the primary's postmaster may write; starts it
/// again whenever it is gone ([`keep_watchdog`]).
async fn heartbeat(
    exe: PathBuf,
    leadership: watch::Receiver<Leadership>,
    primary_pid: Arc<AtomicI32>,
) {
    let spawn = || {
        tokio::process::Command::new(&exe)
            .arg("watchdog")
            .stdin(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
    };
    let message = || {
        let pid = primary_pid.load(Ordering::SeqCst);
        if pid == 0 {
            return Message::Standby;
        }
        let deadline = leadership.borrow().deadline();
        let valid_for = match deadline {
            Ok(Some(deadline)) => deadline.saturating_duration_since(Instant::now()),
            Ok(None) => Duration::from_secs(3600),
            Err(_) => Duration::ZERO,
        };
        Message::Primary { valid_for, pid }
    };
    keep_watchdog(spawn, message).await;
}

/// How soon a watchdog that is gone is started again: doubling from the first to the last,
/// back to the first once one has run for [`WATCHDOG_STEADY`].
const WATCHDOG_RESTART: (Duration, Duration) = (Duration::from_millis(100), Duration::from_secs(5));
const WATCHDOG_STEADY: Duration = Duration::from_secs(10);

/// Runs the watchdog `spawn` starts and sends it `message()` every 200 ms, for ever: a
/// watchdog that exits, is killed or cannot be written to is started again (with backoff),
/// since without it nothing fences a primary whose manager is paused.
async fn keep_watchdog<S, M>(mut spawn: S, mut message: M)
where
    S: FnMut() -> std::io::Result<tokio::process::Child>,
    M: FnMut() -> Message,
{
    let mut delay = WATCHDOG_RESTART.0;
    loop {
        let started = Instant::now();
        match spawn() {
            Ok(mut child) => {
                if let Some(mut stdin) = child.stdin.take() {
                    let mut tick = tokio::time::interval(Duration::from_millis(200));
                    loop {
                        tick.tick().await;
                        if stdin
                            .write_all(message().encode().as_bytes())
                            .await
                            .is_err()
                        {
                            break;
                        }
                    }
                }
                // Reaped (killed first if it still runs but no longer reads).
                let _ = child.kill().await;
                tracing::error!(restart_in = ?delay, "the watchdog is gone; starting it again");
            }
            Err(e) => {
                tracing::error!(error = %e, restart_in = ?delay, "the watchdog could not be started: nothing fences a paused manager until it is");
            }
        }
        if started.elapsed() >= WATCHDOG_STEADY {
            delay = WATCHDOG_RESTART.0;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(WATCHDOG_RESTART.1);
    }
}

/// steward-core's elector on the cluster's Lease, running in a task.
struct Election {
    leadership: Leadership,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), steward_core::leader::Error>>,
    /// For a new election after a handover.
    eligible: watch::Receiver<bool>,
    decided: watch::Receiver<election::Decided>,
}

impl Election {
    fn start(
        client: &Client,
        settings: &Settings,
        eligible: watch::Receiver<bool>,
        decided: watch::Receiver<election::Decided>,
    ) -> anyhow::Result<Self> {
        let config = LeaseConfig {
            lease_name: contract::lease_name(&settings.cluster),
            namespace: settings.namespace.clone(),
            identity: settings.pod.clone(),
            lease_duration: settings.lease_duration,
            renew_deadline: settings.renew_deadline,
            retry_period: settings.retry_period,
        };
        let elector = LeaderElector::new(client.clone(), config)?
            .with_reporter(contract::BINARY)
            .with_candidacy(eligible.clone())
            .with_lease_check({
                let decided = decided.clone();
                std::sync::Arc::new(move |lease| decided.borrow().allows(lease))
            });
        let leadership = elector.leadership();
        let stop = CancellationToken::new();
        let task = tokio::spawn(elector.run(stop.clone()));
        Ok(Self {
            leadership,
            stop,
            task,
            eligible,
            decided,
        })
    }

    /// Stops leading and releases the Lease (if held).
    async fn stop(&mut self) {
        self.stop.cancel();
        match (&mut self.task).await {
            Ok(Err(e)) => tracing::warn!(error = %e, "releasing the Lease failed"),
            Err(e) => tracing::warn!(error = %e, "the election task failed"),
            Ok(Ok(())) => {}
        }
    }
}

/// The instance manager's state between ticks.
struct Instance {
    settings: Settings,
    backups: backups::Runner,
    /// Where WAL is archived (`spec.backup`), for what a former primary left unarchived.
    archive_to: Option<Store>,
    /// The store of the cluster this one follows (`spec.replica.source`).
    source: Option<Store>,
    /// This tick: the cluster follows its source (`spec.replica.enabled`), so its leader runs
    /// in recovery.
    standby: bool,
    /// The replica's `instance.conf` was written for a standby cluster (restoring from the
    /// source's archive).
    configured_standby: bool,
    /// As a standby's leader: the source's archive as last listed (its WAL file names, or
    /// why not), and when.
    source_listed: Option<(Instant, Result<Vec<String>, String>)>,
    /// As a standby's leader: it recorded in the source's store that it follows it.
    announced: bool,
    /// As the primary: when the store's fence was last read.
    fence_checked_at: Option<Instant>,
    /// Replaying a restored backup: promoted by PostgreSQL itself at the recovery target,
    /// never by the manager.
    recovering: bool,
    /// The PostgreSQL major of this image (`postgres --version`), to spot a data directory
    /// of an older one (after a major upgrade, on a replica's volume).
    installed_major: Option<u32>,
    client: Client,
    leases: Api<Lease>,
    pods: Api<Pod>,
    election: Election,
    /// The current election's leadership, for the watchdog's heartbeat.
    leadership: watch::Sender<Leadership>,
    eligible: watch::Sender<bool>,
    /// The last eligibility decision with the clean-stop record it was made on, which the
    /// elector checks against the Lease it is about to take ([`election::Decided::allows`]).
    decided: watch::Sender<election::Decided>,
    /// The postmaster's pid while it runs read-write (0 otherwise), for the watchdog.
    primary_pid: Arc<AtomicI32>,
    health: http::Health,
    /// What `/metrics` serves beside its queries: the replicas' lag, on the primary.
    metrics: Metrics,
    postmaster: Option<Postmaster>,
    /// The last observation, kept when a query fails (fencing acts on what was last seen
    /// running read-write).
    observed: Option<Observed>,
    /// When this postmaster last answered the health query (`None`: not since it started).
    answered_at: Option<Instant>,
    /// Since when the health query of a postmaster that had answered fails: time spent in
    /// other steps (a checkpoint, a promotion) does not count, only queries that failed.
    unanswered_since: Option<Instant>,
    /// Why a requested switchover waits (logged when it changes).
    switchover_waiting: Option<String>,
    /// The primary host `instance.conf` points a replica at.
    following: Option<String>,
    /// The data directory ran read-write on a timeline the primary may not have, or failed
    /// to stream: rewind before following.
    needs_rewind: bool,
    /// Since when a replica that should stream does not, and the position it had then.
    not_streaming_since: Option<(Instant, Option<Lsn>)>,
    /// The superuser and replication roles were ensured on this postmaster (as primary).
    roles_ensured: bool,
    published: Option<(InstanceStatus, Instant)>,
    /// The server certificate as last read.
    certificate: Option<Vec<u8>>,
    /// `pg_rewind` failures since this instance last streamed.
    rewind_failures: u32,
    /// Stopped because it did not stream from a reachable primary (not as a former primary).
    stream_broke: bool,
    /// The timeline this replica last streamed on: once its WAL receiver stops (the primary
    /// stopped), PostgreSQL reports only its last restartpoint's, which may be older.
    streamed_timeline: Option<u32>,
    /// Times in a row it stopped streaming and `pg_rewind` then found nothing to undo: the
    /// primary no longer has the WAL it needs (past `wal_keep_size`). Not a candidate for
    /// the Lease meanwhile (its data may be arbitrarily old); cloned afresh at the second.
    cannot_catch_up: u32,
    /// Times in a row PostgreSQL exited before it ever answered (reset once it does).
    failed_starts: u32,
    /// The ANALYZE after a major upgrade, while it runs.
    analyze: Option<tokio::task::JoinHandle<Result<String, crate::upgrade::Error>>>,
    /// After an ANALYZE failed: not tried again before this.
    analyze_retry_at: Option<Instant>,
    /// Why this tick's step failed (published as the instance's `problem`), until one
    /// succeeds.
    failing: Option<String>,
}

/// A failed step's error as an instance's published `problem`: its chain on one line, at
/// most [`PROBLEM_MAX`] bytes (an annotation and a condition message carry it).
fn problem(e: &anyhow::Error) -> String {
    let mut text = format!("{e:#}").replace('\n', " ");
    if text.len() > PROBLEM_MAX {
        let mut end = PROBLEM_MAX;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// The longest `problem` an instance publishes.
const PROBLEM_MAX: usize = 400;

/// The cluster as this tick saw it.
struct World {
    /// `None`: no Lease exists. `Some("")`: released.
    holder: Option<String>,
    /// The switchover target named on the Lease.
    target: Option<String>,
    /// Whether the Lease names a pause of the poolers ([`contract::pooler::PAUSE_ANNOTATION`]).
    poolers_paused: bool,
    /// The instance that released the Lease on its last clean stop, and where its WAL ended.
    clean_stop: election::CleanStopRecord,
    /// `spec.replica.enabled` of the cluster, read only when it has a source to follow.
    follow: Option<bool>,
    /// `spec.replica.promotionToken`: a planned promotion waits until it replayed all of it.
    promotion_token: Option<String>,
    /// This cluster's own demotion token ([`contract::DEMOTION_TOKEN_ANNOTATION`]).
    demotion_token: Option<String>,
    /// The source store a promotion of this cluster fenced
    /// ([`contract::SOURCE_FENCED_ANNOTATION`]).
    source_fenced: Option<String>,
    /// The StatefulSet's replicas, read only while the Lease is released by a last primary
    /// whose pod does not exist: is it coming back, or was it removed?
    instances: Option<u32>,
    pods: Vec<Pod>,
}

impl World {
    fn pod(&self, name: &str) -> Option<&Pod> {
        self.pods.iter().find(|p| p.name_any() == name)
    }

    /// Whether the Lease's holder (another instance) says it runs read-write: it finished its
    /// promotion. A standby is no source to rewind from: its control file may still name the
    /// timeline it is leaving, and `pg_rewind` would rewind to the wrong fork.
    fn holder_is_primary(&self, me: &str) -> bool {
        self.holder_pod(me)
            .and_then(|pod| peer(pod).status)
            .is_some_and(|s| s.role == Role::Primary)
    }

    /// The holder's pod IP, if another instance holds the Lease.
    fn primary_host(&self, me: &str) -> Option<String> {
        self.holder_pod(me)?.status.as_ref()?.pod_ip.clone()
    }

    /// The pod of the Lease's holder, when that is another instance.
    fn holder_pod(&self, me: &str) -> Option<&Pod> {
        let holder = self
            .holder
            .as_deref()
            .filter(|h| !h.is_empty() && *h != me)?;
        self.pod(holder)
    }
}

impl Instance {
    async fn tick(&mut self) -> anyhow::Result<()> {
        self.reap();
        self.reload_renewed_certificate();
        let leading = self.election.leadership.is_leader();
        self.fence(leading).await;
        if leading && self.step_down_if_unresponsive().await? {
            return Ok(()); // a replica from the next tick on
        }

        if !self.settings.paths.initialized() {
            // Never a new cluster (or a clone) where an interrupted major upgrade left the
            // data beside the data directory.
            let pgdata = &self.settings.paths.pgdata;
            if let Some(done) =
                crate::upgrade::recover_interrupted_swap(pgdata, self.installed_major)?
            {
                tracing::warn!(
                    ?done,
                    "recovered the data directory from an interrupted major upgrade"
                );
            }
        }

        let world = match self.observe_world().await {
            Ok(world) => world,
            Err(e) => {
                // Cut off from the API server: what readiness says must still be true (the
                // watchdog may have stopped PostgreSQL, the Lease may have run out).
                self.reap();
                self.observe().await;
                return Err(e);
            }
        };
        self.standby = world.follow == Some(true);
        let paths = self.settings.paths.clone();
        let older = paths
            .initialized()
            .then(|| crate::upgrade::data_major(&paths.pgdata))
            .flatten()
            .zip(self.installed_major)
            .filter(|(data, installed)| data < installed);
        let stepped = if let Some((data, installed)) = older {
            if leading {
                // Only the upgrade Job changes a primary's data to another major.
                Err(anyhow::anyhow!(
                    "the data directory holds PostgreSQL {data} and this image runs {installed}: not starting (a major upgrade runs pg_upgrade first)"
                ))
            } else {
                // A replica's data is a copy: clone the upgraded primary again.
                tracing::info!(
                    data,
                    installed,
                    "the data directory is of an older major: cloning the primary again"
                );
                self.prepare(false, &world).await
            }
        } else if !paths.initialized() {
            self.prepare(leading, &world).await
        } else if leading {
            self.run_primary(&world).await
        } else {
            self.run_replica(&world).await
        };
        self.observe().await;
        // What keeps failing is published, so that the cluster's status can say it.
        self.failing = stepped.as_ref().err().map(problem);
        self.report(&world).await;
        stepped?;
        let read_write = leading && self.observed.as_ref().is_some_and(|o| !o.in_recovery);
        self.backups.tick(read_write && !self.recovering).await?;
        Ok(())
    }

    /// Notices a postmaster that exited on its own (crash, killed): it is restarted in its
    /// role at this tick.
    /// Reloads PostgreSQL when the mounted server certificate changed (the operator renews
    /// it; the kubelet updates the Secret volume).
    fn reload_renewed_certificate(&mut self) {
        let current = std::fs::read(self.settings.paths.tls_dir.join("tls.crt")).ok();
        if current.is_none() {
            return;
        }
        let renewed = self.certificate.is_some() && self.certificate != current;
        if let Some(pm) = self.postmaster.as_ref().filter(|_| renewed) {
            tracing::info!("the server certificate changed: reloading");
            pm.reload();
        }
        self.certificate = current;
    }

    fn reap(&mut self) {
        if let Some(status) = self.postmaster.as_mut().and_then(Postmaster::exited) {
            tracing::warn!(%status, "postgres exited");
            if self.observed.is_none() {
                self.failed_starts += 1;
            }
            self.postmaster = None;
            self.observed = None;
            self.primary_pid.store(0, Ordering::SeqCst);
        }
    }

    /// The primary's PostgreSQL has not answered for longer than `unresponsive_timeout`
    /// (hung, `SIGSTOP`ped: new connections time out while the Lease would renew for ever):
    /// kill it and every backend, then release the Lease so that a replica is elected. It
    /// rejoins as a replica (rewound first). A postmaster that never answered since it
    /// started (crash recovery, a long promotion) is not judged here. Returns whether it
    /// stepped down.
    async fn step_down_if_unresponsive(&mut self) -> anyhow::Result<bool> {
        let silent = match (self.unanswered_since, &self.postmaster) {
            (Some(at), Some(_)) => at.elapsed(),
            _ => return Ok(false),
        };
        if silent <= self.settings.unresponsive_timeout {
            return Ok(false);
        }
        tracing::error!(
            silent_for = ?silent,
            "the primary's PostgreSQL does not answer: killing it and giving up the Lease"
        );
        self.eligible.send_replace(false);
        self.primary_pid.store(0, Ordering::SeqCst);
        if let Some(pm) = self.postmaster.take() {
            pm.kill_all().await;
        }
        self.observed = None;
        self.answered_at = None;
        self.unanswered_since = None;
        self.needs_rewind = true;
        self.following = None;
        self.health.set(false, true);
        self.release_lease().await?;
        Ok(true)
    }

    /// Releases the Lease (if held) and stands again, with whatever eligibility
    /// [`Instance::report`] computes next.
    async fn release_lease(&mut self) -> anyhow::Result<()> {
        // Bounded: with the API server unreachable the release cannot be written (the Lease
        // then expires), and the manager must go on (PostgreSQL is already stopped).
        if tokio::time::timeout(self.settings.renew_deadline, self.election.stop())
            .await
            .is_err()
        {
            tracing::warn!("releasing the Lease took over the renew deadline; it will expire");
        }
        let eligible = self.election.eligible.clone();
        let decided = self.election.decided.clone();
        self.election = Election::start(&self.client, &self.settings, eligible, decided)?;
        self.leadership
            .send_replace(self.election.leadership.clone());
        Ok(())
    }

    /// Not the leader but running read-write: stop at once.
    async fn fence(&mut self, leading: bool) {
        let read_write = self.observed.as_ref().is_some_and(|o| !o.in_recovery);
        if leading || !read_write {
            return;
        }
        if let Some(pm) = self.postmaster.take() {
            tracing::error!(
                "not the primary any more (Lease lost or not renewed in time): immediate shutdown"
            );
            self.primary_pid.store(0, Ordering::SeqCst);
            pm.kill().await;
        }
        self.observed = None;
        self.needs_rewind = true;
        self.following = None;
    }

    /// Names this instance on the Lease as the one that stopped last as the primary, with
    /// where its WAL ends (read from the stopped data directory), so that a replica with all
    /// of it need not wait for this instance to come back.
    async fn record_last_primary(&self) -> anyhow::Result<()> {
        let end = match postgres::clean_wal_end(&self.settings.paths).await {
            Ok(end) => end,
            Err(e) => {
                tracing::warn!(error = %e, "where this instance's WAL ends is unknown: replicas wait for it to come back");
                None
            }
        };
        self.name_last_primary(end).await
    }

    /// Names this instance on the Lease as the last primary, its WAL ending at `end`. Beside
    /// a switchover's target (which confirmed it flushed `end`), this is what makes the
    /// release a confirmed handover ([`election::handed_over`]).
    async fn name_last_primary(&self, end: Option<contract::WalEnd>) -> anyhow::Result<()> {
        let end = end.map(|e| e.to_string());
        self.annotate_lease_all(&[
            (contract::LAST_PRIMARY_ANNOTATION, Some(&self.settings.pod)),
            (contract::LAST_PRIMARY_WAL_ANNOTATION, end.as_deref()),
        ])
        .await
    }

    /// Sets (or, with `None`, removes) an annotation of the cluster's Lease.
    async fn annotate_lease(&self, key: &str, value: Option<&str>) -> anyhow::Result<()> {
        self.annotate_lease_all(&[(key, value)]).await
    }

    /// Sets (or removes) annotations of the cluster's Lease in one write.
    async fn annotate_lease_all(&self, values: &[(&str, Option<&str>)]) -> anyhow::Result<()> {
        let name = contract::lease_name(&self.settings.cluster);
        let annotations: serde_json::Map<String, serde_json::Value> = values
            .iter()
            .map(|(key, value)| (key.to_string(), serde_json::json!(value)))
            .collect();
        let patch = serde_json::json!({"metadata": {"annotations": annotations}});
        tokio::time::timeout(
            API_TIMEOUT,
            self.leases
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch)),
        )
        .await??;
        Ok(())
    }

    async fn observe_world(&self) -> anyhow::Result<World> {
        let name = contract::lease_name(&self.settings.cluster);
        let lease = tokio::time::timeout(API_TIMEOUT, self.leases.get_opt(&name)).await??;
        let target = lease
            .as_ref()
            .and_then(|l| election::named_on(l, contract::TARGET_ANNOTATION));
        let clean_stop = lease
            .as_ref()
            .map(election::CleanStopRecord::of)
            .unwrap_or_default();
        let poolers_paused = lease.as_ref().is_some_and(|l| {
            l.annotations()
                .contains_key(contract::pooler::PAUSE_ANNOTATION)
        });
        let source_fenced = lease
            .as_ref()
            .and_then(|l| election::named_on(l, contract::SOURCE_FENCED_ANNOTATION));
        let demotion_token = lease
            .as_ref()
            .and_then(|l| election::named_on(l, contract::DEMOTION_TOKEN_ANNOTATION));
        let holder = lease.map(|l| l.spec.and_then(|s| s.holder_identity).unwrap_or_default());
        let selector = format!("{CLUSTER_LABEL}={}", self.settings.cluster);
        let pods = tokio::time::timeout(
            API_TIMEOUT,
            self.pods.list(&ListParams::default().labels(&selector)),
        )
        .await??
        .items;
        let absent_last_primary = holder.as_deref() == Some("")
            && clean_stop.last_primary.as_ref().is_some_and(|last| {
                *last != self.settings.pod && !pods.iter().any(|p| p.name_any() == *last)
            });
        let instances = if absent_last_primary {
            // The StatefulSet has the cluster's name.
            let statefulsets: Api<StatefulSet> =
                Api::namespaced(self.client.clone(), &self.settings.namespace);
            tokio::time::timeout(API_TIMEOUT, statefulsets.get_opt(&self.settings.cluster))
                .await??
                .and_then(|s| s.spec.replicas)
                .and_then(|r| u32::try_from(r).ok())
        } else {
            None
        };
        let (follow, promotion_token) = if self.source.is_some() {
            let clusters: Api<PostgresCluster> =
                Api::namespaced(self.client.clone(), &self.settings.namespace);
            let cluster =
                tokio::time::timeout(API_TIMEOUT, clusters.get(&self.settings.cluster)).await??;
            let replica = cluster.spec.replica;
            (
                Some(replica.as_ref().is_some_and(|r| r.enabled)),
                replica.and_then(|r| r.promotion_token),
            )
        } else {
            (None, None)
        };

        Ok(World {
            holder,
            target,
            follow,
            promotion_token,
            demotion_token,
            source_fenced,
            poolers_paused,
            clean_stop,
            instances,
            pods,
        })
    }

    /// An empty data directory: create the cluster, or clone the primary.
    async fn prepare(&mut self, leading: bool, world: &World) -> anyhow::Result<()> {
        let paths = &self.settings.paths;
        if leading
            && self.standby
            && let Some(source) = self.source.clone()
        {
            return self.restore(source, Restore::Follow).await;
        }
        if leading && let Some(source) = self.settings.recovery.clone() {
            return self.restore(Store::open(source)?, Restore::ToTarget).await;
        }
        if leading {
            tracing::info!(
                "holding the Lease with an empty data directory: initializing the cluster"
            );
            postgres::initdb(paths, &self.settings.superuser_password).await?;
            return Ok(());
        }
        if self.standby
            && let Some(source) = self.source.clone()
        {
            // Cloning the leader takes the source's replication password: a copy of the
            // source's base backup instead, following its archive.
            return self.restore(source, Restore::Follow).await;
        }
        let Some(host) = world.primary_host(&self.settings.pod) else {
            tracing::info!(holder = ?world.holder, "empty data directory; waiting for a primary to clone");
            return Ok(());
        };
        tracing::info!(%host, "cloning the primary");
        self.clone_afresh(&host).await
    }

    /// The first instance of a restored cluster: unpacks the newest base backup that
    /// completed before the target into a sibling directory, then moves it into place with
    /// `recovery.signal` (so an interruption never leaves a half-unpacked data directory
    /// that looks initialized). PostgreSQL replays the source's archive when it starts.
    async fn restore(&mut self, store: Store, how: Restore) -> anyhow::Result<()> {
        let paths = self.settings.paths.clone();
        let target = match how {
            Restore::ToTarget => self.settings.recovery_target_time.clone(),
            Restore::Follow => None,
        };
        tracing::info!(from = %store.config().url(), ?target, ?how, "an empty data directory: restoring the cluster from a backup");
        let backups = store.base_backups().await?;
        let backup =
            archive::choose_backup(&backups, target.as_deref(), self.installed_major)?.clone();
        let staging = paths.pgdata.with_extension("restoring");
        let _ = std::fs::remove_dir_all(&staging);
        let staged = Paths {
            pgdata: staging.clone(),
            ..paths.clone()
        };
        tracing::info!(backup = %backup.name, completed = %backup.completed_at, size = backup.size, "downloading the base backup");
        archive::restore(&store, &backup, &staged).await?;
        let (signal, other, conf) = match how {
            Restore::ToTarget => (
                staged.recovery_signal(),
                staged.standby_signal(),
                conf::recovery_conf(&self.settings.exe, target.as_deref()),
            ),
            Restore::Follow => (
                staged.standby_signal(),
                staged.recovery_signal(),
                conf::standby_leader_conf(&self.settings.exe),
            ),
        };
        std::fs::write(signal, "")?;
        let _ = std::fs::remove_file(other);
        postgres::write_file(&paths.instance_conf(), &conf, 0o644)?;
        clear_dir(&paths.pgdata)?;
        std::fs::remove_dir(&paths.pgdata)?;
        std::fs::rename(&staging, &paths.pgdata)?;
        self.recovering = matches!(how, Restore::ToTarget);
        tracing::info!(backup = %backup.name, "base backup restored: replaying the archive");
        Ok(())
    }

    /// Replaying a restored backup: start PostgreSQL with the recovery settings and wait
    /// until it promoted itself at the target; then it is a primary like any other (its
    /// superuser password is this cluster's, not the source's).
    async fn run_recovery(&mut self) -> anyhow::Result<()> {
        let paths = self.settings.paths.clone();
        if self.postmaster.is_none() {
            self.start(&paths)?;
            return Ok(());
        }
        match &self.observed {
            Some(o) if !o.in_recovery => {
                tracing::info!(lsn = %o.lsn, timeline = o.timeline, "recovery reached its target and promoted");
                postgres::write_file(&paths.instance_conf(), &conf::primary_conf(), 0o644)?;
                if let Some(pm) = &self.postmaster {
                    pm.reload();
                }
                // Its superuser password is set to this cluster's as it runs as the primary.
                self.recovering = false;
            }
            _ => {} // starting up or replaying
        }
        Ok(())
    }

    async fn run_primary(&mut self, world: &World) -> anyhow::Result<()> {
        if self.recovering {
            return self.run_recovery().await;
        }
        if self.standby {
            return self.run_standby_leader(world).await;
        }
        self.check_fence().await?;
        let paths = self.settings.paths.clone();
        let leaving_standby = self.source.is_some() && world.source_fenced.is_none();
        if self.postmaster.is_none() && leaving_standby && paths.standby_signal().exists() {
            // Out of standby mode, not running: started as the standby it was, so that it
            // promotes below like a running one, after the promotion token and the fence.
            // Started read-write from here, PostgreSQL would end recovery at the end of its
            // own WAL without them.
            tracing::info!("starting as a standby of the source to promote from there");
            return self.start_standby_leader(&paths);
        }
        if self.postmaster.is_none() {
            postgres::write_file(&paths.instance_conf(), &conf::primary_conf(), 0o644)?;
            let _ = std::fs::remove_file(paths.standby_signal());
            self.start(&paths)?;
            return Ok(());
        }
        let Some(observed) = self.observed.clone() else {
            return Ok(()); // starting up
        };
        let mut promoted_now = false;
        if observed.in_recovery {
            if self.source.is_some() && world.source_fenced.is_none() {
                // Out of standby mode: a planned promotion waits for all of the source's WAL.
                standby::may_promote(
                    world.promotion_token.as_deref(),
                    observed.timeline,
                    observed.lsn,
                )
                .map_err(anyhow::Error::msg)?;
            }
            self.fence_source(&observed, world).await?;
            tracing::info!(lsn = %observed.lsn, "holding the Lease: promoting");
            postgres::write_file(&paths.instance_conf(), &conf::primary_conf(), 0o644)?;
            if let Some(pm) = &self.postmaster {
                pm.reload();
            }
            let client = postgres::connect(&paths).await?;
            let promoted = postgres::promote(&client).await?;
            tracing::info!(promoted, "promotion finished");
            promoted_now = true;
            self.observed = Some(postgres::observe(&client).await?);
            self.following = None;
        }
        if self.observed.as_ref().is_some_and(|o| !o.in_recovery) {
            if let Some(pm) = &self.postmaster {
                self.primary_pid.store(pm.pid(), Ordering::SeqCst);
            }
            self.needs_rewind = false;
            if !self.roles_ensured {
                let client = postgres::connect(&paths).await?;
                postgres::ensure_roles(
                    &client,
                    &self.settings.superuser_password,
                    &self.settings.replication_password,
                )
                .await?;
                if self.observed.as_ref().is_some_and(|o| o.archiver.is_some()) {
                    // Archive what exists now, so a new primary's archiving is proven (and a
                    // new timeline's history reaches the store) without waiting for
                    // archive_timeout.
                    postgres::switch_wal(&client).await?;
                }
                self.roles_ensured = true;
            }
            self.label(world).await?;
            if promoted_now {
                // The control file names the new timeline only after the checkpoint that
                // follows a promotion; until then a former primary's pg_rewind reads the old
                // one from it, finds "no rewind required" and cannot follow (issue #37, item
                // 9). Done (writes already flow) before this tick publishes that this
                // instance runs read-write, which is what a rewind waits for.
                let client = postgres::connect(&paths).await?;
                if let Err(e) = postgres::checkpoint(&client, Duration::from_secs(60)).await {
                    tracing::warn!(error = %e, "the checkpoint after the promotion failed");
                }
            }
            if world.demotion_token.is_some() {
                self.annotate_lease(contract::DEMOTION_TOKEN_ANNOTATION, None)
                    .await?;
            }
            if world.clean_stop.last_primary.is_some() {
                // The record of a clean stop served its purpose: a primary runs. Kept, it
                // would make the others wait for (and the named instance retake) the Lease
                // the next time it is released, say by a primary that hung.
                self.annotate_lease_all(&[
                    (contract::LAST_PRIMARY_ANNOTATION, None),
                    (contract::LAST_PRIMARY_WAL_ANNOTATION, None),
                ])
                .await?;
            }
            self.analyze_after_upgrade().await;
            match world.target.as_deref() {
                Some(target) if target == self.settings.pod => self.clear_target().await?,
                Some(target) => self.hand_over(target, world).await?,
                // A pause nobody lifted (its switchover ended another way, say its primary
                // was killed mid-way): the primary that leads lifts it.
                None if world.poolers_paused => {
                    self.annotate_lease(contract::pooler::PAUSE_ANNOTATION, None)
                        .await?;
                    tracing::info!("lifted a pause of the poolers no switchover holds");
                }
                None => {}
            }
        }
        Ok(())
    }

    /// The leader of a standby cluster: PostgreSQL in recovery, replaying the source's archive
    /// (as the other instances do until the promotion), labelled `primary` so that `-rw`
    /// reaches it (read-only). A primary running read-write is stopped cleanly and demoted.
    async fn run_standby_leader(&mut self, world: &World) -> anyhow::Result<()> {
        let paths = self.settings.paths.clone();
        if self.postmaster.is_none() {
            if !paths.standby_signal().exists() {
                self.demote().await?;
            }
            return self.start_standby_leader(&paths);
        }
        let Some(observed) = self.observed.clone() else {
            return Ok(()); // starting up
        };
        if !observed.in_recovery {
            // Demoted while it runs (a planned switchover): a clean stop, so that its WAL
            // ends at a shutdown checkpoint, then it starts again as a standby from there.
            tracing::info!("spec.replica.enabled: stopping the primary to demote it");
            self.primary_pid.store(0, Ordering::SeqCst);
            if let Some(pm) = self.postmaster.take() {
                pm.stop(HANDOVER_SHUTDOWN).await;
            }
            self.observed = None;
            return Ok(());
        }
        if self.following.is_some() {
            // A replica of the standby cluster that took the Lease: from its leader's stream
            // to the source's archive.
            tracing::info!("leading the standby cluster: following the source's archive");
            self.write_standby_leader_conf()?;
            if let Some(pm) = &self.postmaster {
                pm.reload();
            }
        }
        self.label(world).await?;
        self.list_source().await;
        self.adopt_handover_end(world).await?;
        // A standby again: a clean stop's record is no handover to wait for, and the next
        // promotion fences its source again.
        if world.clean_stop.last_primary.is_some() || world.source_fenced.is_some() {
            self.annotate_lease_all(&[
                (contract::LAST_PRIMARY_ANNOTATION, None),
                (contract::LAST_PRIMARY_WAL_ANNOTATION, None),
                (contract::SOURCE_FENCED_ANNOTATION, None),
            ])
            .await?;
        }
        Ok(())
    }

    /// `instance.conf` of a standby cluster's leader: the source's archive, no primary to
    /// stream from.
    fn write_standby_leader_conf(&mut self) -> anyhow::Result<()> {
        let paths = &self.settings.paths;
        postgres::write_file(
            &paths.instance_conf(),
            &conf::standby_leader_conf(&self.settings.exe),
            0o644,
        )?;
        self.following = None;
        Ok(())
    }

    /// Starts PostgreSQL as a standby cluster's leader (its data directory has
    /// `standby.signal`).
    fn start_standby_leader(&mut self, paths: &Paths) -> anyhow::Result<()> {
        self.write_standby_leader_conf()?;
        self.start(paths)
    }

    /// A cluster made a standby (`spec.replica.enabled`) whose leader last ran read-write: its
    /// data directory, stopped cleanly, becomes a standby at the end of its own WAL. That end
    /// ([`contract::WalEnd`]) is its demotion token, on the Lease; the WAL up to it goes to
    /// this cluster's archive first, where the new primary replays it before it may promote
    /// (`spec.replica.promotionToken`). A directory that did not stop cleanly is refused:
    /// where its WAL ends is unknown, and it may hold writes the new primary never gets.
    async fn demote(&mut self) -> anyhow::Result<()> {
        let paths = self.settings.paths.clone();
        let Some(end) = postgres::clean_wal_end(&paths).await? else {
            anyhow::bail!(
                "spec.replica.enabled, but this data directory last ran read-write and did not stop cleanly: where its WAL ends is unknown, so it cannot follow another cluster (re-create this cluster as a standby)"
            );
        };
        self.publish_demotion(end).await?;
        std::fs::write(paths.standby_signal(), "")?;
        tracing::info!(token = %end, "demoted: this cluster follows its source from the end of its WAL");
        Ok(())
    }

    /// `end` as this cluster's demotion token, on its Lease, once its WAL up to `end` is in
    /// its archive: what PostgreSQL left unarchived, and the segment holding `end` (a stopped
    /// primary never archives its last, unfinished one).
    async fn publish_demotion(&self, end: contract::WalEnd) -> anyhow::Result<()> {
        let Some(store) = &self.archive_to else {
            anyhow::bail!(
                "spec.replica.enabled on a cluster without spec.backup: the new primary replays this cluster's WAL from its archive, and it has none"
            );
        };
        self.archive_leftover_wal().await?;
        let name = archive::wal_file_name(end.timeline, Lsn(end.lsn.0.saturating_sub(1)));
        let file = PathBuf::from("pg_wal").join(&name);
        archive::push_wal(store, &self.settings.paths.pgdata, &file, &name)
            .await
            .map_err(|e| anyhow::anyhow!("archiving {name}, where this cluster's WAL ends: {e}"))?;
        self.annotate_lease(contract::DEMOTION_TOKEN_ANNOTATION, Some(&end.to_string()))
            .await
    }

    /// A standby cluster's leader that took over from a primary stopped by a switchover (a
    /// rolling update that made the cluster a standby: the old primary handed over, its WAL
    /// end on the Lease): that end is the demotion token, and the segment holding it (which
    /// this instance streamed) goes to the archive.
    async fn adopt_handover_end(&mut self, world: &World) -> anyhow::Result<()> {
        if world.demotion_token.is_some() {
            return Ok(());
        }
        let Some(end) = world
            .clean_stop
            .wal_end
            .as_deref()
            .and_then(|e| e.parse::<contract::WalEnd>().ok())
        else {
            return Ok(());
        };
        self.publish_demotion(end).await?;
        tracing::info!(token = %end, "demoted by a handover: the last primary's WAL end is this cluster's demotion token");
        Ok(())
    }

    /// Lists the source's archive (at most every [`standby::SOURCE_LISTING`]) for the lag
    /// this leader publishes.
    async fn list_source(&mut self) {
        let Some(source) = &self.source else {
            return;
        };
        if self
            .source_listed
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < standby::SOURCE_LISTING)
        {
            return;
        }
        if !self.announced {
            let me = format!("{}/{}", self.settings.namespace, self.settings.cluster);
            match source.set_followed(&me).await {
                Ok(()) => self.announced = true,
                Err(e) => {
                    tracing::warn!(error = %e, "recording in the source's store that this cluster follows it failed; trying again")
                }
            }
        }
        let listed = match archive::system_identifier(&self.settings.paths.pgdata) {
            Ok(system) => tokio::time::timeout(API_TIMEOUT, source.wal_files(&system))
                .await
                .map_err(|_| format!("no answer within {API_TIMEOUT:?}"))
                .and_then(|r| r.map_err(|e| e.to_string())),
            Err(e) => Err(e.to_string()),
        };
        self.source_listed = Some((Instant::now(), listed));
    }

    /// Before a standby cluster's first promotion: the fence in its source's store, so that
    /// the source's primary never runs read-write again on the timeline this one leaves.
    /// Refused (no promotion) when the store cannot be written, or another standby of the
    /// source was promoted first.
    async fn fence_source(&mut self, observed: &Observed, world: &World) -> anyhow::Result<()> {
        let Some(source) = self.source.clone() else {
            return Ok(());
        };
        let url = source.config().url();
        if world.source_fenced.as_deref() == Some(url.as_str()) {
            return Ok(());
        }
        let me = format!("{}/{}", self.settings.namespace, self.settings.cluster);
        let existing = source.fence().await.map_err(|e| {
            anyhow::anyhow!("not promoting: reading the fence of the source {url}: {e}")
        })?;
        if standby::may_fence(existing.as_ref(), &me, observed.timeline)
            .map_err(anyhow::Error::msg)?
        {
            let fence = contract::Fence {
                promoted: me,
                timeline: observed.timeline,
                lsn: observed.lsn,
                at: jiff::Timestamp::now().to_string(),
            };
            source
                .set_fence(&fence)
                .await
                .map_err(|e| anyhow::anyhow!("not promoting: fencing the source {url}: {e}"))?;
            tracing::warn!(source = %url, timeline = fence.timeline, lsn = %fence.lsn, "fenced the source: its primary on this timeline never runs read-write again");
        }
        self.annotate_lease(contract::SOURCE_FENCED_ANNOTATION, Some(&url))
            .await?;
        Ok(())
    }

    /// As the primary (about to start or promote, then every [`standby::FENCE_CHECK`]): the
    /// fence in this cluster's own store. Fenced, PostgreSQL is stopped (or not started) and
    /// the step fails saying by whom. Before starting or promoting, a store that cannot be
    /// read also stops it: whether it is fenced is unknown. While it runs, such a failure
    /// only warns (the next check reads again).
    async fn check_fence(&mut self) -> anyhow::Result<()> {
        let Some(store) = self.archive_to.clone() else {
            return Ok(());
        };
        let running =
            self.postmaster.is_some() && self.observed.as_ref().is_some_and(|o| !o.in_recovery);
        if running
            && self
                .fence_checked_at
                .is_some_and(|at| at.elapsed() < standby::FENCE_CHECK)
        {
            return Ok(());
        }
        let marker = self.settings.paths.pgdata.join(standby::FOLLOWED_MARKER);
        // Once seen followed, always: the marker stays, and the store is not asked again.
        let known = marker.exists();
        let read = async {
            let followed = known || store.followed().await?;
            Ok::<_, archive::Error>((store.fence().await?, followed))
        };
        let (fence, followed) = match tokio::time::timeout(API_TIMEOUT, read).await {
            Ok(Ok(read)) => read,
            Ok(Err(e)) => return self.fence_unreadable(running, &marker, &e.to_string()),
            Err(_) => {
                let e = format!("no answer within {API_TIMEOUT:?}");
                return self.fence_unreadable(running, &marker, &e);
            }
        };
        self.fence_checked_at = Some(Instant::now());
        if followed && !known {
            std::fs::write(&marker, "")?;
        }
        let timeline = match &self.observed {
            Some(o) if self.postmaster.is_some() => o.timeline,
            _ => archive::newest_timeline(&self.settings.paths.pgdata),
        };
        if let Some(why) = standby::fenced(fence.as_ref(), timeline) {
            if let Some(pm) = self.postmaster.take() {
                tracing::error!(%why, "stopping PostgreSQL");
                self.primary_pid.store(0, Ordering::SeqCst);
                pm.stop(Duration::from_secs(30)).await;
                self.observed = None;
            }
            anyhow::bail!(why);
        }
        Ok(())
    }

    /// The store's fence could not be read (`why`): a running primary goes on (read again at
    /// the next check); one about to start or promote does so only if no standby was ever
    /// seen following this cluster (`marker`), since only a standby's promotion fences it.
    fn fence_unreadable(
        &self,
        running: bool,
        marker: &std::path::Path,
        why: &str,
    ) -> anyhow::Result<()> {
        let url = self
            .archive_to
            .as_ref()
            .map(|s| s.config().url())
            .unwrap_or_default();
        if running {
            tracing::warn!(error = %why, "reading this cluster's fence from {url} failed; reading it again in {:?}", standby::FENCE_CHECK);
            return Ok(());
        }
        if standby::may_start_unchecked(marker.exists()) {
            tracing::warn!(error = %why, "this cluster's fence could not be read from {url}; no standby was ever seen following it, so none can have fenced it: going on");
            return Ok(());
        }
        anyhow::bail!(
            "not running read-write: a standby follows this cluster, and its fence could not be read from {url}: {why}"
        )
    }

    /// After a major upgrade (the upgrade left [`crate::upgrade::analyze_marker`] beside the
    /// data directory), once it runs read-write: gathers the planner statistics `pg_upgrade`
    /// does not carry over, in a task (on a big database it takes a while, and fencing must
    /// not wait for it), then removes the marker. A failure is retried after 30 s.
    async fn analyze_after_upgrade(&mut self) {
        let marker = crate::upgrade::analyze_marker(&self.settings.paths.pgdata);
        if self
            .analyze
            .as_ref()
            .is_some_and(tokio::task::JoinHandle::is_finished)
            && let Some(task) = self.analyze.take()
        {
            let outcome = task.await.unwrap_or_else(|e| {
                Err(crate::upgrade::Error::Refused(format!(
                    "the ANALYZE task failed: {e}"
                )))
            });
            match outcome.map(|_| std::fs::remove_file(&marker)) {
                Ok(Ok(())) => tracing::info!(
                    "planner statistics gathered after the major upgrade (vacuumdb --all --analyze-in-stages)"
                ),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, marker = %marker.display(), "removing the ANALYZE marker failed")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "ANALYZE after the major upgrade failed; retrying in 30 s");
                    self.analyze_retry_at = Some(Instant::now() + Duration::from_secs(30));
                }
            }
            return;
        }
        let waiting = self.analyze_retry_at.is_some_and(|at| Instant::now() < at);
        if self.analyze.is_some() || waiting || !marker.exists() {
            return;
        }
        tracing::info!(
            "first start read-write after a major upgrade: gathering planner statistics (vacuumdb --all --analyze-in-stages)"
        );
        let socket_dir = self.settings.paths.run_dir.clone();
        self.analyze = Some(tokio::spawn(async move {
            crate::upgrade::analyze(&socket_dir).await
        }));
    }

    /// A planned switchover: once `target` is a ready replica that streams from this primary
    /// ([`may_hand_over`]), checkpoint, shut PostgreSQL down cleanly (a fast shutdown sends
    /// the remaining WAL, up to the shutdown checkpoint, to the connected replicas), and
    /// release the Lease so the target takes it, but only once the target confirms it has
    /// flushed that WAL to its end. Otherwise (the shutdown was not clean, the target does
    /// not confirm) every acknowledged write would not be on the new primary: this instance
    /// starts again as the primary and records the refusal on the Lease
    /// ([`contract::SWITCHOVER_REFUSED_ANNOTATION`]). After a handover it rejoins as a
    /// replica at the next ticks.
    async fn hand_over(&mut self, target: &str, world: &World) -> anyhow::Result<()> {
        let paths = self.settings.paths.clone();
        let ready = world.pods.iter().map(peer).any(|p| {
            p.name == target
                && p.ready
                && p.status.as_ref().is_some_and(|s| s.role == Role::Replica)
        });
        let waiting = if ready {
            let client = postgres::connect(&paths).await?;
            let standby = postgres::standby(&client, target).await?;
            match may_hand_over(standby.as_ref()) {
                Ok(()) => {
                    // Little left for the shutdown checkpoint to write (best effort).
                    if let Err(e) = postgres::checkpoint(&client, HANDOVER_SHUTDOWN).await {
                        tracing::warn!(error = %e, "the checkpoint before the switchover failed");
                    }
                    None
                }
                Err(why) => Some(why),
            }
        } else {
            Some("it is not a ready replica".to_string())
        };
        if let Some(why) = waiting {
            if self.switchover_waiting.as_deref() != Some(why.as_str()) {
                tracing::info!(%target, "switchover requested; waiting: {why}");
                self.switchover_waiting = Some(why);
            }
            return Ok(());
        }
        self.switchover_waiting = None;
        let Some(host) = world
            .pod(target)
            .and_then(|p| p.status.as_ref()?.pod_ip.clone())
        else {
            return Ok(());
        };
        if let Err(why) = self.pause_poolers(target).await {
            // Running on as the primary; the poolers resume as the pause is lifted.
            tracing::warn!(%target, "switchover refused, running on as the primary: {why}");
            return self
                .annotate_lease_all(&[
                    (
                        contract::SWITCHOVER_REFUSED_ANNOTATION,
                        Some(&format!("{target}: {why}")),
                    ),
                    (contract::TARGET_ANNOTATION, None),
                    (contract::pooler::PAUSE_ANNOTATION, None),
                ])
                .await;
        }
        tracing::info!(%target, "switchover: shutting down cleanly, then releasing the Lease once the target confirms the last WAL");
        self.primary_pid.store(0, Ordering::SeqCst);
        let clean = match self.postmaster.take() {
            Some(pm) => pm.stop(HANDOVER_SHUTDOWN).await,
            None => false,
        };
        self.observed = None;
        let confirmed = if clean {
            self.confirm_handover(&host).await
        } else {
            Err(format!(
                "the fast shutdown did not finish within {HANDOVER_SHUTDOWN:?} (its WAL senders waited for a replica that does not answer)"
            ))
        };
        match confirmed {
            Ok(end) => {
                tracing::info!(%target, %end, "the target has every WAL record: releasing the Lease");
                self.needs_rewind = true;
                // The record first, while still holding: a release without it would be
                // decided by the ordinary election, on positions published up to a second
                // ago, and could elect a replica other than the target, which then hands
                // over again (`election::handed_over`). Not written (the API server did not
                // answer): the Lease is released without it, and that election decides.
                if let Err(e) = self.name_last_primary(Some(end)).await {
                    tracing::warn!(error = %format!("{e:#}"), "recording where the WAL ends before the release failed");
                }
                self.release_lease().await
            }
            Err(why) => {
                // Still the holder: run on as the primary, every acknowledged write kept.
                tracing::warn!(%target, "switchover refused, running on as the primary: {why}");
                self.start(&paths)?;
                self.annotate_lease(
                    contract::SWITCHOVER_REFUSED_ANNOTATION,
                    Some(&format!("{target}: {why}")),
                )
                .await?;
                self.annotate_lease_all(&[
                    (contract::TARGET_ANNOTATION, None),
                    (contract::pooler::PAUSE_ANNOTATION, None),
                ])
                .await
            }
        }
    }

    /// Before a switchover's shutdown: pauses the cluster's ready poolers (names a pause on
    /// the Lease, waits for each one's acknowledgement, [`crate::poolers`]), so no client
    /// transaction through them is cut. Without poolers, nothing. Returns why the pause did
    /// not happen in time (the pause is then lifted by the refusal's write).
    async fn pause_poolers(&self, target: &str) -> Result<(), String> {
        let cluster = &self.settings.cluster;
        let awaited = crate::poolers::list(&self.pods, cluster, API_TIMEOUT)
            .await
            .map_err(|e| format!("listing the pooler pods failed: {e:#}"))?;
        if awaited.is_empty() {
            return Ok(());
        }
        let pause = crate::poolers::pause_name(target);
        self.annotate_lease(contract::pooler::PAUSE_ANNOTATION, Some(&pause))
            .await
            .map_err(|e| format!("naming the poolers' pause on the Lease failed: {e:#}"))?;
        let config_maps = Api::namespaced(self.client.clone(), &self.settings.namespace);
        let took =
            crate::poolers::wait_for_acks(&config_maps, cluster, &awaited, &pause, API_TIMEOUT)
                .await?;
        tracing::info!(%target, poolers = awaited.len(), ?took, "the poolers paused: their transactions finished, new ones wait");
        Ok(())
    }

    /// After a clean shutdown for a switchover: waits (up to [`HANDOVER_CONFIRM`]) until the
    /// target at `host` has flushed this instance's WAL up to the end of its shutdown
    /// checkpoint. Returns that end, or why it could not be confirmed.
    async fn confirm_handover(&self, host: &str) -> Result<contract::WalEnd, String> {
        let end = match postgres::clean_wal_end(&self.settings.paths).await {
            Ok(Some(end)) => end,
            Ok(None) => return Err("the data directory was not shut down cleanly".into()),
            Err(e) => return Err(format!("reading where the WAL ends: {e}")),
        };
        let deadline = Instant::now() + HANDOVER_CONFIRM;
        let mut last = String::from("not asked yet");
        while Instant::now() < deadline {
            match postgres::received_lsn(&self.settings.paths, host).await {
                Ok(Some(received)) if received >= end.lsn => return Ok(end),
                Ok(received) => last = format!("it has flushed up to {received:?}"),
                Err(e) => last = format!("asking it failed: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        Err(format!(
            "the target did not confirm the WAL up to {end} within {HANDOVER_CONFIRM:?} ({last})"
        ))
    }

    /// As the switchover's target, once leading: the Lease no longer names a target.
    /// Lifts the poolers' pause with it: they resume on this primary.
    async fn clear_target(&self) -> anyhow::Result<()> {
        self.annotate_lease_all(&[
            (contract::TARGET_ANNOTATION, None),
            (contract::pooler::PAUSE_ANNOTATION, None),
        ])
        .await?;
        tracing::info!("switchover finished: leading");
        Ok(())
    }

    async fn run_replica(&mut self, world: &World) -> anyhow::Result<()> {
        let paths = self.settings.paths.clone();
        let host = world.primary_host(&self.settings.pod);
        if self.postmaster.is_none() {
            if self.needs_rewind || !paths.standby_signal().exists() {
                // It last ran read-write (or its stream broke): it may hold WAL the primary
                // does not have.
                self.archive_leftover_wal().await?;
                let Some(host) = &host else {
                    let released_by_another = world.holder.as_deref() == Some("")
                        && world.clean_stop.last_primary.as_deref()
                            != Some(self.settings.pod.as_str());
                    if released_by_another {
                        // Released on a clean stop by another instance that is not back
                        // yet: run as a standby following nobody (the last primary itself
                        // takes the Lease instead, see `election::after_clean_stop`).
                        // It is ready, so a StatefulSet that starts pods in order creates
                        // the next one; once a primary leads, it follows it, and if its
                        // timeline forked the stream fails and it is rewound then.
                        tracing::info!(
                            last_primary = ?world.clean_stop.last_primary,
                            "a former primary with no primary to follow: starting as a standby"
                        );
                        self.needs_rewind = false;
                        self.configure_replica(None)?;
                        self.start(&paths)?;
                    } else {
                        tracing::info!("a former primary waits for the new primary to rewind from");
                    }
                    return Ok(());
                };
                if !world.holder_is_primary(&self.settings.pod) {
                    tracing::info!(%host, "waiting for the new primary to finish its promotion before rewinding from it");
                    return Ok(());
                }
                tracing::info!(%host, "rewinding to follow the new primary");
                let stream_broke = std::mem::take(&mut self.stream_broke);
                // With an archive, pg_rewind reads from it what it needs of this directory's
                // own WAL, through the restore_command of the replica's configuration
                // (written now; standby.signal only once it is rewound).
                let from_archive = self.archive_to.is_some();
                if from_archive {
                    self.write_replica_conf(Some(host))?;
                }
                match postgres::rewind(&paths, host, from_archive).await {
                    Ok(out) if stream_broke && out.contains("no rewind required") => {
                        self.cannot_catch_up += 1;
                        if self.cannot_catch_up >= 2 {
                            tracing::warn!(%host, "this replica cannot catch up (it stopped streaming twice with nothing to rewind: the primary no longer has the WAL it needs); cloning the primary afresh");
                            self.clone_afresh(host).await?;
                        } else {
                            tracing::warn!(%host, "not streaming, and nothing to rewind: the primary may no longer have the WAL this replica needs; not a candidate until it streams");
                        }
                    }
                    Ok(out) => tracing::info!(output = %out.trim(), "pg_rewind finished"),
                    // It could not reach or log in to the primary (a partition, "too many
                    // clients", a certificate or password problem): nothing is known about
                    // the data, which stays as it is. Tried again at the next tick.
                    Err(e) if postgres::unreachable(&e) => {
                        tracing::warn!(error = %e, "pg_rewind could not reach the primary; trying again");
                        self.stream_broke = stream_broke;
                        return Ok(());
                    }
                    // pg_rewind cannot rewind a data directory whose WAL ends exactly where
                    // the timelines forked (nothing to undo): follow without rewinding. If
                    // the stream then fails too, it is rewound again, and after a second
                    // failure cloned afresh: its divergent WAL is on no live timeline.
                    Err(e) if self.rewind_failures == 0 => {
                        tracing::warn!(error = %e, "pg_rewind failed; following without rewinding (its WAL may end where the timelines forked)");
                        self.rewind_failures += 1;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "pg_rewind failed again; cloning the primary afresh");
                        self.clone_afresh(host).await?;
                    }
                }
                self.needs_rewind = false;
            } else if let Some(host) = host
                .as_deref()
                .filter(|_| self.failed_starts >= MAX_FAILED_STARTS)
            {
                // A replica's data directory PostgreSQL refuses to start from (say, a rewind
                // that went wrong) holds nothing the primary lacks: take a new copy.
                tracing::warn!(%host, failed_starts = self.failed_starts, "PostgreSQL does not start from this replica's data directory; cloning the primary afresh");
                self.clone_afresh(host).await?;
            }
            self.configure_replica(host.as_deref())?;
            self.start(&paths)?;
            return Ok(());
        }
        if host.is_some() && (self.following != host || self.configured_standby != self.standby) {
            tracing::info!(?host, standby = self.standby, "following the primary");
            self.configure_replica(host.as_deref())?;
            if let Some(pm) = &self.postmaster {
                pm.reload();
            }
            self.not_streaming_since = None;
        }
        let streaming = self.observed.as_ref().is_some_and(|o| o.streaming);
        if streaming {
            self.rewind_failures = 0;
            self.cannot_catch_up = 0;
        }
        // A standby cluster's replica follows its source's archive: not streaming is expected
        // (its leader's stream takes the source's replication password).
        if streaming || host.is_none() || self.standby {
            self.not_streaming_since = None;
        } else {
            // Replaying WAL it fetched from the archive is catching up, not a broken stream:
            // the timer runs only while nothing is replayed.
            let lsn = self.observed.as_ref().map(|o| o.lsn);
            let (since, _) = *self.not_streaming_since.insert(stream_timer(
                self.not_streaming_since,
                lsn,
                Instant::now(),
            ));
            if since.elapsed() > self.settings.stream_timeout {
                tracing::warn!(
                    ?host,
                    "not streaming from the primary for {:?}: stopping to rewind",
                    self.settings.stream_timeout
                );
                if let Some(pm) = self.postmaster.take() {
                    pm.stop(Duration::from_secs(30)).await;
                }
                self.observed = None;
                self.needs_rewind = true;
                self.stream_broke = true;
                self.not_streaming_since = None;
            }
        }
        Ok(())
    }

    /// A former primary's WAL that its PostgreSQL had not archived when it stopped (killed,
    /// fenced, or its archiver behind): pushed now, before a rewind can remove it. As a
    /// replica its PostgreSQL never archives, and the new primary does not archive the old
    /// timeline's segments it streamed, so the archive would have a gap. Until the store
    /// takes them, the instance does not rejoin (retried every tick).
    async fn archive_leftover_wal(&self) -> anyhow::Result<()> {
        let Some(store) = &self.archive_to else {
            return Ok(());
        };
        let pushed = archive::push_ready(store, &self.settings.paths.pgdata)
            .await
            .map_err(|e| anyhow::anyhow!("archiving the WAL left by this former primary: {e}"))?;
        if !pushed.is_empty() {
            tracing::info!(files = ?pushed, "archived the WAL this instance had not archived as the primary");
        }
        Ok(())
    }

    /// Replaces the data directory with a new copy of the primary at `host`. The copy is
    /// made beside it (`<pgdata>.cloning`) and swapped in only once complete: a clone that
    /// fails (the primary unreachable, the volume full, a kill) leaves the data directory
    /// as it was, whatever it holds.
    async fn clone_afresh(&mut self, host: &str) -> anyhow::Result<()> {
        let paths = self.settings.paths.clone();
        let staging = sibling(&paths.pgdata, ".cloning");
        let discarded = sibling(&paths.pgdata, ".discarded");
        for leftover in [&staging, &discarded] {
            remove_dir_if_exists(leftover)?;
        }
        clear_dir(&staging)?;
        let staged = Paths {
            pgdata: staging.clone(),
            ..paths.clone()
        };
        if let Err(e) = postgres::basebackup(&staged, host).await {
            remove_dir_if_exists(&staging)?;
            return Err(e.into());
        }
        std::fs::write(staged.standby_signal(), "")?;
        if paths.pgdata.exists() {
            std::fs::rename(&paths.pgdata, &discarded)?;
        }
        std::fs::rename(&staging, &paths.pgdata)?;
        remove_dir_if_exists(&discarded)?;
        self.rewind_failures = 0;
        self.cannot_catch_up = 0;
        self.failed_starts = 0;
        Ok(())
    }

    fn configure_replica(&mut self, host: Option<&str>) -> anyhow::Result<()> {
        self.write_replica_conf(host)?;
        std::fs::write(self.settings.paths.standby_signal(), "")?;
        self.following = host.map(str::to_string);
        self.configured_standby = self.standby;
        Ok(())
    }

    /// `instance.conf` of a replica following `host` (nobody: `None`).
    fn write_replica_conf(&self, host: Option<&str>) -> anyhow::Result<()> {
        let paths = &self.settings.paths;
        let exe = self.settings.exe.as_path();
        // Behind further than the primary keeps WAL, a replica catches up from the archive.
        // In a standby cluster, from the source's: its leader's stream needs the source's
        // replication password, which this cluster does not have until it is promoted.
        let archive = if self.standby && self.source.is_some() {
            Some((exe, conf::Archive::Source))
        } else {
            self.archive_to
                .is_some()
                .then_some((exe, conf::Archive::Own))
        };
        let conf = match host {
            Some(host) => conf::replica_conf(
                host,
                &self.settings.pod,
                &paths.passfile(),
                &paths.ca_file(),
                archive,
            ),
            None => conf::replica_conf(
                "",
                &self.settings.pod,
                &paths.passfile(),
                &paths.ca_file(),
                archive,
            )
            .replace("primary_conninfo", "#primary_conninfo"),
        };
        postgres::write_file(&paths.instance_conf(), &conf, 0o644)?;
        Ok(())
    }

    fn start(&mut self, paths: &Paths) -> anyhow::Result<()> {
        self.postmaster = Some(Postmaster::start(paths)?);
        self.observed = None;
        // A new postmaster's stream is judged from now, not from a timer of the last one.
        self.not_streaming_since = None;
        self.answered_at = None;
        self.unanswered_since = None;
        self.roles_ensured = false;
        Ok(())
    }

    /// Queries the running instance (nothing if it is down or not yet accepting).
    async fn observe(&mut self) {
        if self.postmaster.is_none() {
            self.observed = None;
        } else {
            let answer = match postgres::connect(&self.settings.paths).await {
                Ok(client) => postgres::observe(&client).await,
                Err(e) => Err(e),
            };
            match answer {
                Ok(mut o) => {
                    o.timeline = replica_timeline(&mut self.streamed_timeline, &o);
                    self.observed = Some(o);
                    self.answered_at = Some(Instant::now());
                    self.unanswered_since = None;
                    self.failed_starts = 0;
                }
                Err(e) => {
                    tracing::debug!(error = %e, "PostgreSQL does not answer (yet)");
                    if self.answered_at.is_some() {
                        self.unanswered_since.get_or_insert_with(Instant::now);
                    }
                }
            }
        }
        let answering = self
            .answered_at
            .is_some_and(|at| at.elapsed() < STALE_AFTER);
        let ready = is_ready(
            answering,
            self.observed.as_ref().map(|o| o.in_recovery),
            self.election.leadership.is_leader() && !self.standby,
            self.cannot_catch_up > 0,
        );
        self.health
            .set(ready, self.observed.is_some() || self.postmaster.is_none());
    }

    /// Publishes this instance's status on its pod when it changed (at most once a second),
    /// and whether it may take a free Lease.
    async fn report(&mut self, world: &World) {
        let status = match &self.observed {
            Some(o) => InstanceStatus {
                role: if o.in_recovery {
                    Role::Replica
                } else {
                    Role::Primary
                },
                timeline: o.timeline,
                lsn: o.lsn,
                replay_lag: o.replay_lag,
                archiver: o.archiver.clone(),
                commits_waiting: o.commits_waiting,
                problem: self.failing.clone(),
                following: self.following_source(o, world.demotion_token.as_deref()),
            },
            None => InstanceStatus {
                role: Role::Down,
                timeline: 0,
                lsn: contract::Lsn(0),
                replay_lag: 0,
                archiver: None,
                commits_waiting: 0,
                problem: self.failing.clone(),
                following: None,
            },
        };
        let peers: Vec<Peer> = world.pods.iter().map(peer).collect();
        self.metrics
            .set_member_lag(member_lag(&self.settings.pod, &status, &peers));
        let candidacy = election::after_clean_stop(
            &self.settings.pod,
            Some(&status),
            world.holder.as_deref(),
            world.target.as_deref(),
            world.clean_stop.clean_stop(),
            world.instances,
            &peers,
        )
        .unwrap_or_else(|| {
            election::candidacy(
                &self.settings.pod,
                Some(&status),
                world.holder.as_deref(),
                world.target.as_deref(),
                &peers,
            )
        });
        let eligible = candidacy.eligible()
            && self.cannot_catch_up == 0
            && (self.settings.paths.initialized() || candidacy == Candidacy::Bootstrap);
        // Before the bool the elector wakes on: a take-over it allows is checked on this pair.
        let decided = election::Decided {
            eligible,
            record: world.clean_stop.clone(),
            released: world.holder.as_deref() == Some(""),
        };
        let redecided = self.decided.send_if_modified(|d| {
            let changed = *d != decided;
            *d = decided;
            changed
        });
        self.eligible.send_if_modified(|e| {
            let changed = *e != eligible;
            if changed {
                tracing::info!(?candidacy, "eligible to become primary: {eligible}");
            }
            *e = eligible;
            // Still eligible on a new record: wake the elector, which refused the Lease
            // while the record was new to it.
            changed || (redecided && eligible)
        });

        let due = match &self.published {
            Some((last, at)) => *last != status && at.elapsed() >= Duration::from_secs(1),
            None => true,
        };
        if !due {
            return;
        }
        let patch = serde_json::json!({"metadata": {"annotations": {
            STATUS_ANNOTATION: serde_json::to_string(&status).unwrap_or_default()
        }}});
        match tokio::time::timeout(
            API_TIMEOUT,
            self.pods.patch(
                &self.settings.pod,
                &PatchParams::default(),
                &Patch::Merge(&patch),
            ),
        )
        .await
        {
            Ok(Ok(_)) => self.published = Some((status, Instant::now())),
            Ok(Err(e)) => tracing::warn!(error = %e, "publishing the instance status failed"),
            Err(_) => tracing::warn!("publishing the instance status timed out"),
        }
    }

    /// As a standby cluster's leader in recovery: how far it has followed its source.
    fn following_source(
        &self,
        o: &Observed,
        demotion_token: Option<&str>,
    ) -> Option<contract::Following> {
        let source = self.source.as_ref()?;
        let leading = self.election.leadership.is_leader();
        (self.standby && leading && o.in_recovery).then(|| {
            let listed = self
                .source_listed
                .as_ref()
                .map_or_else(|| Ok(Vec::new()), |(_, l)| l.clone());
            standby::following(
                source,
                o.lsn,
                o.replayed_at.clone(),
                &listed,
                demotion_token.map(str::to_string),
            )
        })
    }

    /// As the primary: this pod is labelled `primary`, every other `replica`, so the `-rw`
    /// Service selects only this instance.
    async fn label(&self, world: &World) -> anyhow::Result<()> {
        // The others first: never two pods labelled primary because of us.
        let mut pods: Vec<&Pod> = world.pods.iter().collect();
        pods.sort_by_key(|p| p.name_any() == self.settings.pod);
        for pod in pods {
            let name = pod.name_any();
            let want = if name == self.settings.pod {
                PRIMARY
            } else {
                REPLICA
            };
            if pod.labels().get(ROLE_LABEL).map(String::as_str) == Some(want) {
                continue;
            }
            tracing::info!(pod = %name, role = want, "moving the role label");
            let patch = serde_json::json!({"metadata": {"labels": {ROLE_LABEL: want}}});
            match tokio::time::timeout(
                API_TIMEOUT,
                self.pods
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch)),
            )
            .await?
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_not_found() => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}

/// Whether the primary may shut down for a switchover to a replica it sees as `standby`
/// (`None`: not connected): it must stream, have replied lately (a replica whose WAL
/// receiver hangs is still listed as streaming until `wal_sender_timeout`), and be close
/// behind. Otherwise the reason to wait. The shutdown is still confirmed afterwards
/// ([`Instance::confirm_handover`]): this only avoids stopping when it would be refused.
fn may_hand_over(standby: Option<&postgres::Standby>) -> Result<(), String> {
    let Some(standby) = standby else {
        return Err("it is not connected to this primary".into());
    };
    if !standby.streaming {
        return Err("it is connected but not streaming".into());
    }
    match standby.reply_age {
        Some(age) if age <= REPLY_FRESH => {}
        age => {
            return Err(format!(
                "it has not replied for {age:?} (a replica replies at least every 10 s)"
            ));
        }
    }
    if standby.flush_lag > MAX_HANDOVER_LAG {
        return Err(format!(
            "it is {} bytes behind (at most {MAX_HANDOVER_LAG} to hand over)",
            standby.flush_lag
        ));
    }
    Ok(())
}

/// The not-streaming timer of a replica whose position is `lsn` now: started at `now` when
/// none runs, or started again when the position moved on since it started (WAL fetched from
/// the archive is being replayed: the replica is catching up, its stream is not broken).
fn stream_timer(
    timer: Option<(Instant, Option<Lsn>)>,
    lsn: Option<Lsn>,
    now: Instant,
) -> (Instant, Option<Lsn>) {
    match timer {
        Some((since, at)) if lsn <= at => (since, at),
        _ => (now, lsn),
    }
}

/// Ready: PostgreSQL answered lately (`answering`), in the role the Lease gives this instance
/// (in recovery unless `leading`) and, as a replica, not known to be unable to catch up (it
/// stopped streaming with nothing to rewind: the primary no longer has the WAL it needs, and
/// through `-ro` it would serve data arbitrarily old; issue #37, item 5) until it streams
/// again or is cloned afresh.
fn is_ready(
    answering: bool,
    in_recovery: Option<bool>,
    leading: bool,
    cannot_catch_up: bool,
) -> bool {
    answering && in_recovery.is_some_and(|r| r != leading && !(r && cannot_catch_up))
}

/// On the primary (`mine`), how far behind each replica among `peers` is, in bytes of WAL,
/// by the position it last published (published at most once a second; a replica that
/// stopped receiving falls further behind with each write). Empty elsewhere.
fn member_lag(me: &str, mine: &InstanceStatus, peers: &[Peer]) -> BTreeMap<String, u64> {
    if mine.role != Role::Primary {
        return BTreeMap::new();
    }
    peers
        .iter()
        .filter(|p| p.name != me)
        .filter_map(|p| {
            let status = p.status.as_ref().filter(|s| s.role == Role::Replica)?;
            Some((p.name.clone(), mine.lsn.0.saturating_sub(status.lsn.0)))
        })
        .collect()
}

fn peer(pod: &Pod) -> Peer {
    let ready = contract::pod_ready(pod);
    let status = pod
        .annotations()
        .get(STATUS_ANNOTATION)
        .and_then(|s| serde_json::from_str(s).ok());
    Peer {
        name: pod.name_any(),
        ready: ready && pod.metadata.deletion_timestamp.is_none(),
        status,
    }
}

/// `<dir><suffix>` beside `dir`.
fn sibling(dir: &std::path::Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}

fn remove_dir_if_exists(dir: &std::path::Path) -> std::io::Result<()> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Empties a directory, keeping it.
fn clear_dir(dir: &std::path::Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            std::fs::remove_dir_all(&path)?;
        } else {
            std::fs::remove_file(&path)?;
        }
    }
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// The timeline `o` runs on, remembering it in `streamed` while a replica streams: a replica
/// whose stream ended reports the newest it streamed on (a clean-stop record it must match is
/// on that timeline), never an older one. A primary forgets it.
fn replica_timeline(streamed: &mut Option<u32>, o: &postgres::Observed) -> u32 {
    if !o.in_recovery {
        *streamed = None;
        return o.timeline;
    }
    if o.streaming {
        *streamed = Some(o.timeline);
    }
    streamed.map_or(o.timeline, |t| t.max(o.timeline))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue #37, item 5: a replica replaying WAL from the archive is catching up; only one
    /// whose position stands still is stopped to rewind after the stream timeout.
    #[test]
    fn the_stream_timer_runs_only_while_nothing_is_replayed() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(5);
        let started = stream_timer(None, Some(Lsn(100)), t0);
        assert_eq!(started, (t0, Some(Lsn(100))));
        assert_eq!(
            stream_timer(Some(started), Some(Lsn(100)), later),
            started,
            "standing still: the timer runs on"
        );
        assert_eq!(
            stream_timer(Some(started), None, later),
            started,
            "not observed: the timer runs on"
        );
        assert_eq!(
            stream_timer(Some(started), Some(Lsn(200)), later),
            (later, Some(Lsn(200))),
            "replayed more: started again from here"
        );
    }

    #[tokio::test]
    async fn a_watchdog_that_is_gone_is_started_again() {
        // A "watchdog" that reads one message and exits, as if it crashed.
        let spawned = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = spawned.clone();
        let spawn = move || {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::process::Command::new("sh")
                .args(["-c", "read line"])
                .stdin(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
        };
        let task = tokio::spawn(keep_watchdog(spawn, || Message::Standby));
        let deadline = Instant::now() + Duration::from_secs(20);
        while spawned.load(Ordering::SeqCst) < 3 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        task.abort();
        assert!(
            spawned.load(Ordering::SeqCst) >= 3,
            "started {} times",
            spawned.load(Ordering::SeqCst)
        );
    }

    /// The item-7 rule broke after a failover: a replica whose stream from the new primary
    /// ended reported its last restartpoint's timeline (the old one), did not match the
    /// stopped primary's record, and waited for it.
    #[test]
    fn a_replica_reports_the_timeline_it_streamed_on_after_its_stream_ended() {
        let observed = |in_recovery, streaming, timeline| postgres::Observed {
            in_recovery,
            timeline,
            lsn: contract::Lsn(1),
            replay_lag: 0,
            streaming,
            archiver: None,
            commits_waiting: 0,
            replayed_at: None,
        };
        let mut streamed = None;
        assert_eq!(
            replica_timeline(&mut streamed, &observed(true, false, 1)),
            1
        );
        assert_eq!(replica_timeline(&mut streamed, &observed(true, true, 2)), 2);
        // The primary stopped: PostgreSQL now says 1 (its last restartpoint).
        assert_eq!(
            replica_timeline(&mut streamed, &observed(true, false, 1)),
            2
        );
        assert_eq!(
            replica_timeline(&mut streamed, &observed(true, false, 3)),
            3
        );
        // Promoted: its own timeline, and nothing remembered.
        assert_eq!(
            replica_timeline(&mut streamed, &observed(false, false, 4)),
            4
        );
        assert_eq!(streamed, None);
    }

    #[test]
    fn the_primary_reports_each_replica_s_lag_by_its_published_position() {
        let status = |role, lsn| InstanceStatus {
            role,
            ..election::tests::replica(lsn)
        };
        let peer = |name: &str, s: Option<InstanceStatus>| Peer {
            name: name.into(),
            ready: true,
            status: s,
        };
        let peers = [
            peer("pg-0", Some(status(Role::Primary, 1000))),
            peer("pg-1", Some(status(Role::Replica, 400))),
            // Ahead of what the primary published (published a second ago): no lag.
            peer("pg-2", Some(status(Role::Replica, 1200))),
            peer("pg-3", Some(status(Role::Down, 0))),
            peer("pg-4", None),
        ];
        let primary = status(Role::Primary, 1000);
        assert_eq!(
            member_lag("pg-0", &primary, &peers),
            BTreeMap::from([("pg-1".to_string(), 600), ("pg-2".to_string(), 0)])
        );
        assert!(member_lag("pg-1", &status(Role::Replica, 400), &peers).is_empty());
    }

    #[test]
    fn ready_in_the_role_the_lease_gives_and_never_as_a_replica_that_cannot_catch_up() {
        // (answering, in recovery, leading, cannot catch up) -> ready
        assert!(is_ready(true, Some(false), true, false), "the primary");
        assert!(is_ready(true, Some(true), false, false), "a replica");
        assert!(
            is_ready(true, Some(false), true, true),
            "a primary is never a replica that cannot catch up"
        );
        assert!(
            !is_ready(true, Some(true), false, true),
            "a replica the primary no longer has the WAL for serves stale data"
        );
        assert!(
            !is_ready(true, Some(true), true, false),
            "leading, still in recovery"
        );
        assert!(
            !is_ready(true, Some(false), false, false),
            "read-write without the Lease"
        );
        assert!(
            !is_ready(false, Some(true), false, false),
            "not answering lately"
        );
        assert!(!is_ready(true, None, false, false), "nothing observed");
    }
    use postgres::Standby;

    fn standby(streaming: bool, flush_lag: u64, reply_age: Option<u64>) -> Standby {
        Standby {
            streaming,
            flush_lag,
            reply_age: reply_age.map(Duration::from_secs),
        }
    }

    #[test]
    fn a_switchover_starts_only_to_a_streaming_replica_that_replied_lately_and_is_close() {
        assert_eq!(may_hand_over(Some(&standby(true, 0, Some(1)))), Ok(()));
        assert_eq!(
            may_hand_over(Some(&standby(true, MAX_HANDOVER_LAG, Some(15)))),
            Ok(())
        );
        for (s, why) in [
            (None, "not connected"),
            (Some(standby(false, 0, Some(1))), "not streaming"),
            (Some(standby(true, 0, Some(16))), "not replied"),
            (Some(standby(true, 0, None)), "not replied"),
            (Some(standby(true, MAX_HANDOVER_LAG + 1, Some(1))), "behind"),
        ] {
            let refused = may_hand_over(s.as_ref()).unwrap_err();
            assert!(refused.contains(why), "{s:?}: {refused}");
        }
    }
}
