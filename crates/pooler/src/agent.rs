//! The agent: writes PgBouncer's files, runs it, and drives it through the admin console as
//! the cluster's Lease and pods change.
//!
//! # How it works
//! 1. The auth file (the lookup role's password from its Secret, and a password for the
//!    agent's admin user generated now, known to no one else) and `pgbouncer.ini`, pointing
//!    at the `-rw` Service, are written to the run directory; PgBouncer starts.
//! 2. Once its admin console answers (bounded by [`STARTUP`]), the agent watches the Lease
//!    and the instance pods. On every change, and every second, it observes them
//!    ([`crate::observe`]), decides ([`crate::decide`]) and executes the plan's steps in
//!    order, stopping at the first that fails (the next turn decides again).
//! 3. Each second it also compares the mounted certificates and the lookup role's password
//!    with what PgBouncer loaded, and `RELOAD`s when they changed (renewed certificates, a
//!    rotated password).
//! 4. A separate task asks the console `SHOW VERSION` every second, for `/readyz` (the loop
//!    may be waiting on a `PAUSE`).
//!
//! # Guarantees
//! - PgBouncer is resumed after a pause only once it points at the primary the Lease names,
//!   or when the pause outlived [`MAX_PAUSE`].
//! - A pause is acknowledged only after `PAUSE` returned (every in-flight transaction ended);
//!   a `PAUSE` that does not return within [`AGENT_PAUSE_WAIT`] is undone and not
//!   acknowledged (shorter than the primary's wait, so a late acknowledgement never holds
//!   clients after the primary gave up).
//! - A restarted agent removes whatever its predecessor in the pod acknowledged before it
//!   acknowledges anything.
//!
//! # Caveats
//! PgBouncer is not restarted here: if it exits, [`run`] returns an error and the container
//! restarts. An agent stopped while paused leaves its acknowledgement in the ConfigMap (its
//! PgBouncer stops with no server connection, so it is true to the end).

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::distr::{Alphanumeric, SampleString};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::ack::{self, Acks, Written};
use crate::admin::{self, Console, Login};
use crate::config::{self, Target};
use crate::contract::pooler::{AGENT_PAUSE_WAIT, MAX_PAUSE};
use crate::decide::{self, Acked, Paused, Resume, State, Step};
use crate::http::{self, Health};
use crate::metrics::{Counters, Metrics};
use crate::observe;
use crate::pgbouncer::{self, Process};

/// How long PgBouncer may take to answer on its admin console after it started.
pub const STARTUP: Duration = Duration::from_secs(30);
/// How long `RELOAD` and `RESUME` may take.
const COMMAND_BOUND: Duration = Duration::from_secs(5);
/// How often the loop turns without a change (the pause bound, the files check).
const TICK: Duration = Duration::from_secs(1);

/// What the agent runs with (the command line's flags).
#[derive(Clone, Debug)]
pub struct Settings {
    pub cluster: String,
    pub namespace: String,
    /// This pod's name: its key in the state ConfigMap.
    pub pod: String,
    pub pgbouncer: config::Settings,
    /// The lookup role's password (a mounted Secret key).
    pub auth_password_file: PathBuf,
    /// The `pgbouncer` program (a name on `PATH` or a path).
    pub program: PathBuf,
    /// How long PgBouncer may take to stop before it is killed.
    pub grace: Duration,
}

/// Why the agent stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The lookup role's password could not be read.
    #[error("failed to read the auth user's password from {path}")]
    ReadPassword {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The password cannot be written to the auth file.
    #[error("failed to write the auth file")]
    AuthFile(#[source] config::Unquotable),
    /// PgBouncer's files could not be written.
    #[error("failed to write PgBouncer's files")]
    WriteFiles(#[source] pgbouncer::Error),
    /// PgBouncer could not be started.
    #[error("failed to start PgBouncer")]
    Start(#[source] pgbouncer::Error),
    /// PgBouncer's console did not answer after it started.
    #[error("PgBouncer's admin console did not answer within {after:?}")]
    NeverAnswered {
        after: Duration,
        #[source]
        source: admin::Error,
    },
    /// PgBouncer exited: the container restarts.
    #[error("PgBouncer exited ({0})")]
    Exited(ExitStatus),
    /// Waiting on PgBouncer failed.
    #[error("failed to supervise PgBouncer")]
    Supervise(#[source] pgbouncer::Error),
}

/// Runs the agent until `shutdown` (then stops PgBouncer safely and returns `Ok`) or until
/// PgBouncer exits (an error).
///
/// # Errors
/// See [`Error`]; each is fatal to the container.
pub async fn run(
    settings: Settings,
    client: kube::Client,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let auth_password = read_password(&settings.auth_password_file)?;
    let admin_password = Alphanumeric.sample_string(&mut rand::rng(), 32);
    let files = &settings.pgbouncer;
    write_auth_file(files, &auth_password, &admin_password)?;
    let target = Target::service(&settings.cluster, &settings.namespace);
    pgbouncer::write_file(&files.ini_path(), &config::render(files, &target), 0o644)
        .map_err(Error::WriteFiles)?;
    let mut process = Process::start(pgbouncer::command(&settings.program, &files.ini_path()))
        .map_err(Error::Start)?;
    tracing::info!(pid = ?process.id(), %target, "PgBouncer started");

    let health = Health::default();
    health.set_pgbouncer_running(true);
    let login = Login {
        socket_dir: files.run_dir.clone(),
        port: files.listen_port,
        password: admin_password,
    };
    let counters = Arc::new(Counters::default());
    let metrics = Metrics::new(login.clone(), counters.clone());
    let serving = shutdown.child_token();
    let http = tokio::spawn({
        let (health, serving) = (health.clone(), serving.clone());
        async move {
            if let Err(e) = http::serve(health, metrics, serving).await {
                tracing::error!(error = %e, "cannot serve the probes and metrics");
            }
        }
    });

    let agent = Agent {
        acks: Acks::new(
            client.clone(),
            &settings.namespace,
            &settings.cluster,
            &settings.pod,
        ),
        state: State::new(target),
        console: None,
        login: login.clone(),
        counters,
        health: health.clone(),
        files: Fingerprint::of(&settings),
        auth_password,
        warned_missing: None,
        settings: settings.clone(),
    };
    let body = async {
        wait_for_console(&login).await?;
        tracing::info!("PgBouncer's admin console answers");
        let _prober = Prober::start(login.clone(), health.clone());
        let changed = Arc::new(Notify::new());
        let watches = observe::watch(
            client,
            &settings.namespace,
            &settings.cluster,
            changed.clone(),
        );
        agent.run(&watches, &changed).await
    };
    let outcome = tokio::select! {
        status = process.wait() => match status {
            Ok(status) => Err(Error::Exited(status)),
            Err(e) => Err(Error::Supervise(e)),
        },
        _ = shutdown.cancelled() => Ok(()),
        result = body => result,
    };
    health.set_stopping();
    let stopped = process.stop(settings.grace).await;
    health.set_pgbouncer_running(false);
    serving.cancel();
    let _ = http.await;
    match stopped {
        Ok(status) if outcome.is_ok() => tracing::info!(%status, "PgBouncer stopped"),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "PgBouncer's stop not seen"),
    }
    outcome
}

fn read_password(path: &Path) -> Result<String, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::ReadPassword {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(text.trim_end_matches(['\n', '\r']).to_string())
}

fn write_auth_file(files: &config::Settings, auth: &str, admin: &str) -> Result<(), Error> {
    let text = config::auth_file(auth, admin).map_err(Error::AuthFile)?;
    pgbouncer::write_file(&files.auth_file_path(), &text, 0o600).map_err(Error::WriteFiles)
}

/// Waits until the console answers, at most [`STARTUP`].
async fn wait_for_console(login: &Login) -> Result<(), Error> {
    let deadline = Instant::now() + STARTUP;
    loop {
        let answer = match Console::connect(login).await {
            Ok(console) => console.show("SHOW VERSION", COMMAND_BOUND).await.map(drop),
            Err(e) => Err(e),
        };
        match answer {
            Ok(()) => return Ok(()),
            Err(source) if Instant::now() >= deadline => {
                return Err(Error::NeverAnswered {
                    after: STARTUP,
                    source,
                });
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Asks the console every second whether it answers, in a session of its own; stops when
/// dropped.
struct Prober(tokio::task::JoinHandle<()>);

impl Prober {
    fn start(login: Login, health: Health) -> Self {
        Prober(tokio::spawn(async move {
            let mut console: Option<Console> = None;
            let mut tick = tokio::time::interval(TICK);
            loop {
                tick.tick().await;
                if console.as_ref().is_none_or(Console::is_closed) {
                    console = Console::connect(&login).await.ok();
                }
                let Some(session) = console.as_ref() else {
                    continue;
                };
                match session
                    .show("SHOW VERSION", http::ANSWERED_WITHIN / 2)
                    .await
                {
                    Ok(_) => health.console_answered(),
                    Err(e) => {
                        tracing::debug!(error = %e, "the admin console did not answer");
                        console = None;
                    }
                }
            }
        }))
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A step that failed.
#[derive(Debug, thiserror::Error)]
enum StepError {
    #[error("failed to write pgbouncer.ini")]
    WriteConfig(#[source] pgbouncer::Error),
    #[error("failed to reload PgBouncer")]
    Reload(#[source] admin::Error),
    #[error("failed to pause PgBouncer; resumed it and gave this pause up")]
    Pause(#[source] admin::Error),
    #[error("failed to resume PgBouncer")]
    Resume(#[source] admin::Error),
    #[error("failed to write the acknowledgement")]
    Ack(#[source] ack::Error),
    #[error("the state ConfigMap does not exist; nothing acknowledged")]
    Missing,
    #[error("failed to rewrite the auth file")]
    AuthFile(#[source] Box<Error>),
}

/// The executor: carries out plans and keeps the record they are decided from.
struct Agent {
    settings: Settings,
    login: Login,
    console: Option<Console>,
    acks: Acks,
    state: State,
    counters: Arc<Counters>,
    health: Health,
    files: Fingerprint,
    auth_password: String,
    /// The pause for which the missing ConfigMap was reported (once each).
    warned_missing: Option<String>,
}

impl Agent {
    async fn run(mut self, watches: &observe::Watches, changed: &Notify) -> Result<(), Error> {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            self.turn(watches.observed()).await;
            self.reload_changed_files().await;
            self.health
                .set_primary_known(matches!(self.state.target, Target::Pod { .. }));
            self.health.turned();
            tokio::select! {
                _ = changed.notified() => {}
                _ = tick.tick() => {}
            }
        }
    }

    async fn turn(&mut self, observed: decide::Observed) {
        let plan = decide::decide(&observed, &self.state, Instant::now());
        for step in plan.steps {
            let what = format!("{step:?}");
            if let Err(e) = self.execute(step).await {
                match e {
                    StepError::Missing => {}
                    e => {
                        tracing::warn!(step = %what, error = %e, "step failed; deciding again next turn")
                    }
                }
                break;
            }
        }
    }

    async fn execute(&mut self, step: Step) -> Result<(), StepError> {
        match step {
            Step::PointAt(target) => {
                let ini = config::render(&self.settings.pgbouncer, &target);
                pgbouncer::write_file(&self.settings.pgbouncer.ini_path(), &ini, 0o644)
                    .map_err(StepError::WriteConfig)?;
                self.command("RELOAD").await.map_err(StepError::Reload)?;
                tracing::info!(from = %self.state.target, to = %target, "PgBouncer points at the primary");
                if matches!(target, Target::Pod { .. }) {
                    self.counters.primary_changed();
                }
                self.state.target = target;
            }
            Step::Pause(nonce) => {
                let since = Instant::now();
                match self.pause().await {
                    Ok(()) => {
                        tracing::info!(pause = %nonce, took = ?since.elapsed(), "PgBouncer paused");
                        self.counters.paused();
                        self.state.paused = Some(Paused { nonce, since });
                    }
                    Err(e) => {
                        // PgBouncer is in pause mode from the moment it got the command:
                        // undo it, and not for this pause again (the primary refuses the
                        // switchover without our acknowledgement).
                        self.state.given_up = Some(nonce.clone());
                        if let Err(resume) = self.resume().await {
                            tracing::warn!(error = %resume, "cannot resume after the failed pause; retrying");
                            self.state.paused = Some(Paused { nonce, since });
                        }
                        return Err(StepError::Pause(e));
                    }
                }
            }
            Step::Adopt(nonce) => {
                tracing::info!(pause = %nonce, "still paused, now for a newer pause");
                self.state.paused = Some(Paused {
                    nonce,
                    since: Instant::now(),
                });
            }
            Step::Resume(why) => {
                self.resume().await.map_err(StepError::Resume)?;
                if let Some(paused) = self.state.paused.take() {
                    let lasted = paused.since.elapsed();
                    self.counters.resumed(lasted);
                    match why {
                        Resume::Lifted => {
                            tracing::info!(pause = %paused.nonce, ?lasted, "PgBouncer resumed");
                        }
                        Resume::Expired => {
                            tracing::warn!(
                                pause = %paused.nonce, ?lasted, max = ?MAX_PAUSE,
                                "PgBouncer resumed: the pause outlived its bound (not pausing for it again)"
                            );
                            self.state.given_up = Some(paused.nonce);
                        }
                    }
                }
            }
            Step::Ack(nonce) => match self.acks.write(Some(&nonce)).await {
                Ok(Written::Done) => {
                    tracing::info!(pause = %nonce, "pause acknowledged");
                    self.state.acked = Acked::Pause(nonce);
                }
                Ok(Written::Missing) => {
                    if self.warned_missing.as_ref() != Some(&nonce) {
                        tracing::warn!(
                            pause = %nonce,
                            configmap = %crate::contract::pooler::state_config_map(&self.settings.cluster),
                            "cannot acknowledge the pause: no state ConfigMap (the operator creates it); retrying"
                        );
                        self.warned_missing = Some(nonce);
                    }
                    return Err(StepError::Missing);
                }
                Err(e) => return Err(StepError::Ack(e)),
            },
            Step::Unack => match self.acks.write(None).await {
                Ok(_) => self.state.acked = Acked::Nothing,
                Err(e) => return Err(StepError::Ack(e)),
            },
        }
        Ok(())
    }

    /// The console session, opened if needed.
    async fn console(&mut self) -> Result<&Console, admin::Error> {
        let console = match self.console.take() {
            Some(console) if !console.is_closed() => console,
            _ => Console::connect(&self.login).await?,
        };
        Ok(self.console.insert(console))
    }

    async fn command(&mut self, command: &str) -> Result<(), admin::Error> {
        let result = self.console().await?.command(command, COMMAND_BOUND).await;
        if matches!(result, Err(admin::Error::Timeout { .. })) {
            // The session still waits for that answer.
            self.console = None;
        }
        result
    }

    /// `PAUSE`, bounded by [`AGENT_PAUSE_WAIT`] (it returns once every server connection was
    /// released: in transaction mode, when in-flight transactions ended).
    async fn pause(&mut self) -> Result<(), admin::Error> {
        let result = self
            .console()
            .await?
            .command("PAUSE", AGENT_PAUSE_WAIT)
            .await;
        if result.is_err() {
            // A session waiting on PAUSE takes no other command: RESUME goes in a new one.
            self.console = None;
        }
        result
    }

    /// `RESUME`; already running counts as resumed.
    async fn resume(&mut self) -> Result<(), admin::Error> {
        match self.command("RESUME").await {
            Err(e) if e.message() == Some("pooler is not paused/suspended") => Ok(()),
            other => other,
        }
    }

    /// `RELOAD` when the certificates or the lookup role's password changed on disk.
    async fn reload_changed_files(&mut self) {
        let now = Fingerprint::of(&self.settings);
        if now == self.files {
            return;
        }
        match self.reload_files().await {
            Ok(()) => {
                tracing::info!(
                    "certificates or the auth user's password changed: PgBouncer reloaded"
                );
                self.files = now;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot reload the changed certificates or password; retrying")
            }
        }
    }

    async fn reload_files(&mut self) -> Result<(), StepError> {
        let password = read_password(&self.settings.auth_password_file)
            .map_err(|e| StepError::AuthFile(Box::new(e)))?;
        if password != self.auth_password {
            write_auth_file(&self.settings.pgbouncer, &password, &self.login.password)
                .map_err(|e| StepError::AuthFile(Box::new(e)))?;
            self.auth_password = password;
        }
        self.command("RELOAD").await.map_err(StepError::Reload)
    }
}

/// A hash of the files PgBouncer reads at `RELOAD` from mounted Secrets (certificates, the
/// lookup role's password): a change means a reload. Not a security measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Fingerprint(u64);

impl Fingerprint {
    fn of(settings: &Settings) -> Self {
        let mut paths = vec![settings.auth_password_file.clone()];
        if let Some(tls) = &settings.pgbouncer.tls {
            paths.extend([tls.cert(), tls.key(), tls.ca()]);
        }
        let mut hasher = DefaultHasher::new();
        for path in paths {
            match std::fs::read(&path) {
                Ok(bytes) => bytes.hash(&mut hasher),
                Err(e) => e.kind().hash(&mut hasher),
            }
        }
        Fingerprint(hasher.finish())
    }
}
