//! PostgreSQL as the instance manager runs it: the postmaster as a child process, the
//! programs that prepare a data directory (`initdb`, `pg_basebackup`, `pg_rewind`), and the
//! few queries that tell what the instance is doing. The binaries come from the image's
//! `PATH`, so any PostgreSQL image of the right major works.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

use crate::contract::{Archiver, Lsn, PG_PORT, REPLICATION_USER, WalEnd};
use crate::metrics::MONITOR_USER;

/// Failures of PostgreSQL or its programs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{program} could not be started")]
    Spawn {
        program: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{program} failed ({status}): {output}")]
    Failed {
        program: &'static str,
        status: std::process::ExitStatus,
        output: String,
    },
    #[error("writing {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("query failed")]
    Query(#[from] tokio_postgres::Error),
    #[error("PostgreSQL did not answer within {0:?}")]
    Timeout(Duration),
    /// PostgreSQL's own words about a configuration it refuses.
    #[error("{0}")]
    ConfigRefused(String),
}

/// Where this instance keeps its files.
#[derive(Clone, Debug)]
pub struct Paths {
    /// The data directory (on the pod's volume).
    pub pgdata: PathBuf,
    /// The operator's `postgresql.conf` (it includes [`Paths::instance_conf`]).
    pub config_file: PathBuf,
    /// A directory private to this container run: the socket, `instance.conf`, the passfile.
    pub run_dir: PathBuf,
    /// The mounted server certificate Secret (`tls.crt`, `tls.key`, `ca.crt`).
    pub tls_dir: PathBuf,
}

impl Paths {
    pub fn instance_conf(&self) -> PathBuf {
        self.run_dir.join("instance.conf")
    }
    /// [`crate::conf::defaults_conf`], included before the user's parameters.
    pub fn defaults_conf(&self) -> PathBuf {
        self.run_dir.join("defaults.conf")
    }
    pub fn passfile(&self) -> PathBuf {
        self.run_dir.join("pgpass")
    }
    /// The cluster's CA, which replication connections verify the primary against.
    pub fn ca_file(&self) -> PathBuf {
        self.tls_dir.join("ca.crt")
    }
    pub fn recovery_signal(&self) -> PathBuf {
        self.pgdata.join("recovery.signal")
    }
    pub fn standby_signal(&self) -> PathBuf {
        self.pgdata.join("standby.signal")
    }
    /// Whether the data directory holds a cluster.
    pub fn initialized(&self) -> bool {
        self.pgdata.join("PG_VERSION").is_file()
    }
}

/// Writes `contents` to `path` with mode `mode`.
pub fn write_file(path: &Path, contents: &str, mode: u32) -> Result<(), Error> {
    use std::os::unix::fs::PermissionsExt;
    let err = |source| Error::Write {
        path: path.to_path_buf(),
        source,
    };
    std::fs::write(path, contents).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(err)
}

/// Runs a program to completion, its output captured (and returned in the error).
pub(crate) async fn run(program: &'static str, cmd: &mut Command) -> Result<String, Error> {
    tracing::info!(program, "running {cmd:?}");
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .await
        .map_err(|source| Error::Spawn { program, source })?;
    let output = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(output)
    } else {
        Err(Error::Failed {
            program,
            status: out.status,
            output,
        })
    }
}

/// Whether this image's PostgreSQL accepts `config`, a `postgresql.conf` as the operator
/// renders it. The file goes into a scratch directory under `run_dir`, beside this instance
/// manager's `defaults.conf` (which it includes from there), and `postgres -C port` reads it:
/// PostgreSQL parses the configuration files as a starting server does and exits, so every
/// name and value is checked by the major that will run it (an unknown name, a value out of
/// range or not in an enum, a time zone it does not know). Not checked: what a server finds
/// only later at start (a preloaded library that fails to load, limits across settings).
///
/// # Errors
/// [`Error::ConfigRefused`] with PostgreSQL's complaint ([`complaint`]); [`Error::Write`],
/// [`Error::Spawn`].
pub async fn check_config(run_dir: &Path, config: &str) -> Result<(), Error> {
    use std::os::unix::fs::PermissionsExt;
    let major = crate::upgrade::installed_major().await.ok();
    let dir = run_dir.join("check");
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source: std::io::Error| Error::Write { path, source }
    };
    std::fs::create_dir_all(&dir).map_err(err(&dir))?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(err(&dir))?;
    write_file(
        &run_dir.join("defaults.conf"),
        &crate::conf::defaults_conf(major),
        0o600,
    )?;
    write_file(&dir.join("postgresql.conf"), config, 0o600)?;
    let mut cmd = Command::new("postgres");
    cmd.arg("-D").arg(&dir).args(["-C", "port"]);
    match run("postgres", &mut cmd).await {
        Ok(_) => Ok(()),
        Err(Error::Failed { output, .. }) => Err(Error::ConfigRefused(complaint(&output))),
        Err(e) => Err(e),
    }
}

/// What PostgreSQL said about a configuration it refused: its messages without the log line
/// prefix, one after another (`invalid value for parameter "TimeZone": "Mars/Olympus"; …`),
/// without the notes that are not complaints (a missing optional include).
pub fn complaint(output: &str) -> String {
    const SEVERITIES: [&str; 5] = ["FATAL:", "ERROR:", "LOG:", "DETAIL:", "HINT:"];
    let said: Vec<&str> = output
        .lines()
        .filter_map(|line| {
            let at = SEVERITIES.iter().filter_map(|s| line.find(s)).min()?;
            let message = line[at..].split_once(':')?.1.trim();
            (!message.is_empty() && !message.starts_with("skipping missing configuration file"))
                .then_some(message)
        })
        .collect();
    if said.is_empty() {
        output.trim().to_string()
    } else {
        said.join("; ")
    }
}

/// `initdb` with data checksums (`pg_rewind` needs them or `wal_log_hints`), the superuser
/// `postgres` with `password` (through a file that is removed again).
pub async fn initdb(paths: &Paths, password: &str) -> Result<(), Error> {
    let pwfile = paths.run_dir.join("initdb.pw");
    write_file(&pwfile, &format!("{password}\n"), 0o600)?;
    let result = run(
        "initdb",
        Command::new("initdb")
            .arg("-D")
            .arg(&paths.pgdata)
            .args([
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "--data-checksums",
            ])
            .args(["--auth-local=trust", "--auth-host=scram-sha-256"])
            .arg(format!("--pwfile={}", pwfile.display())),
    )
    .await;
    let _ = std::fs::remove_file(&pwfile);
    result.map(drop)
}

/// Clones the primary at `host` into the (empty) data directory as [`REPLICATION_USER`].
pub async fn basebackup(paths: &Paths, host: &str) -> Result<(), Error> {
    run(
        "pg_basebackup",
        Command::new("pg_basebackup")
            .arg("-d")
            .arg(format!(
                "host={host} port={PG_PORT} user={REPLICATION_USER} connect_timeout=5"
            ))
            .arg("-D")
            .arg(&paths.pgdata)
            .args(["-X", "stream", "-c", "fast", "--no-password"])
            .env("PGPASSFILE", paths.passfile())
            .env("PGSSLMODE", "verify-ca")
            .env("PGSSLROOTCERT", paths.ca_file()),
    )
    .await
    .map(drop)
}

/// Rewinds this (stopped) data directory to follow the primary at `host`: what it wrote
/// after the timelines forked is discarded. `pg_rewind` first runs crash recovery itself if
/// the instance was not shut down cleanly.
pub async fn rewind(paths: &Paths, host: &str, from_archive: bool) -> Result<String, Error> {
    clear_stale_locks(paths);
    let mut command = Command::new("pg_rewind");
    if from_archive {
        // WAL of its own that the data directory no longer has (a killed primary's crash
        // recovery checkpointed it away once it was archived) comes from the archive,
        // through the restore_command of its configuration.
        command.arg("--restore-target-wal");
    }
    run(
        "pg_rewind",
        command
            .arg("-D")
            .arg(&paths.pgdata)
            .arg(format!(
                "--source-server=host={host} port={PG_PORT} user={REPLICATION_USER} dbname=postgres connect_timeout=5"
            ))
            .arg(format!(
                "--config-file={}",
                paths.config_file.display()
            ))
            .env("PGPASSFILE", paths.passfile())
            .env("PGSSLMODE", "verify-ca")
            .env("PGSSLROOTCERT", paths.ca_file()),
    )
    .await
}

/// Whether a program failed because it could not reach or log in to the server (as opposed
/// to what it found there): libpq's connection errors.
pub fn unreachable(error: &Error) -> bool {
    let Error::Failed { output, .. } = error else {
        return false;
    };
    const CONNECTING: [&str; 7] = [
        "could not connect to server",
        "connection to server at",
        "too many clients already",
        "password authentication failed",
        "no password supplied",
        "SSL error",
        "the database system is",
    ];
    CONNECTING.iter().any(|needle| output.contains(needle))
}

/// The lock files a postmaster leaves when it is killed: `postmaster.pid` in the data
/// directory and the socket's `.s.PGSQL.<port>.lock`.
fn lock_files(paths: &Paths) -> [PathBuf; 2] {
    [
        paths.pgdata.join("postmaster.pid"),
        paths.run_dir.join(format!(".s.PGSQL.{PG_PORT}.lock")),
    ]
}

/// Removes the lock files of a postmaster that is gone. PostgreSQL refuses to start while
/// the PID in one is alive, and in a container that PID soon belongs to another process (a
/// restarted container numbers its processes from 1 again, and the run directory and the data
/// directory outlive it): seen as `FATAL: lock file ".s.PGSQL.5432.lock" already exists` after
/// a primary was killed, the replica never starting again. Only the manager starts postgres
/// in this pod and on this volume, and it calls this only with its own postmaster stopped; a
/// lock whose PID is a running `postgres` (a backend still exiting) is kept, as Patroni does.
fn clear_stale_locks(paths: &Paths) {
    for lock in lock_files(paths) {
        let Ok(text) = std::fs::read_to_string(&lock) else {
            continue;
        };
        let pid = text
            .lines()
            .next()
            .and_then(|l| l.trim().parse::<u32>().ok());
        if pid.is_some_and(is_postgres) {
            continue;
        }
        tracing::warn!(lock = %lock.display(), ?pid, "removing the lock file of a postmaster that is gone");
        if let Err(e) = std::fs::remove_file(&lock) {
            tracing::warn!(lock = %lock.display(), error = %e, "could not remove a stale lock file");
        }
    }
}

/// Whether process `pid` runs and is a `postgres`.
fn is_postgres(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|comm| comm.trim() == "postgres")
}

/// The running postmaster, a child of the manager.
#[derive(Debug)]
pub struct Postmaster {
    child: Child,
    pid: i32,
}

impl Postmaster {
    /// Starts `postgres` on the data directory with the operator's configuration, its
    /// socket in the run directory. Logs go to the container's output.
    pub fn start(paths: &Paths) -> Result<Self, Error> {
        clear_stale_locks(paths);
        let child = Command::new("postgres")
            .arg("-D")
            .arg(&paths.pgdata)
            .arg("-c")
            .arg(format!("config_file={}", paths.config_file.display()))
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                paths.run_dir.display()
            ))
            .stdin(Stdio::null())
            .spawn()
            .map_err(|source| Error::Spawn {
                program: "postgres",
                source,
            })?;
        let pid = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .unwrap_or_default();
        tracing::info!(pid, "started postgres");
        Ok(Self { child, pid })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Whether it exited (reaping it).
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn signal(&self, signal: Signal) {
        let _ = kill(Pid::from_raw(self.pid), signal);
    }

    /// Re-reads the configuration (`instance.conf` included).
    pub fn reload(&self) {
        self.signal(Signal::SIGHUP);
    }

    /// Fast shutdown (SIGINT: sessions are cancelled, the primary's remaining WAL is sent
    /// to connected replicas); immediate (SIGQUIT) if it takes longer than `timeout`.
    /// Returns whether the fast shutdown finished in time (an immediate one writes no
    /// shutdown checkpoint).
    pub async fn stop(mut self, timeout: Duration) -> bool {
        self.signal(Signal::SIGINT);
        let finished = tokio::time::timeout(timeout, self.child.wait()).await;
        if finished.is_err() {
            tracing::warn!(
                pid = self.pid,
                "fast shutdown took over {timeout:?}; immediate shutdown"
            );
            self.signal(Signal::SIGQUIT);
            let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
            let _ = self.child.kill().await;
        }
        matches!(finished, Ok(Ok(status)) if status.success())
    }

    /// Kills the postmaster and every process it started, even when it does not run (a
    /// `SIGSTOP`ped or hung postmaster cannot forward a shutdown signal to its backends,
    /// which would go on serving the sessions they have). The postmaster is stopped first
    /// so that it forks nothing new while its children are listed and killed.
    pub async fn kill_all(mut self) {
        kill_tree(self.pid);
        let _ = self.child.kill().await;
    }

    /// Immediate shutdown: no checkpoint, sessions killed at once (the fence).
    pub async fn kill(mut self) {
        self.signal(Signal::SIGQUIT);
        if tokio::time::timeout(Duration::from_secs(2), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// `SIGSTOP`s process `pid`, `SIGKILL`s each of its children, then `pid` itself.
pub fn kill_tree(pid: i32) {
    let target = Pid::from_raw(pid);
    if kill(target, Signal::SIGSTOP).is_err() {
        return;
    }
    for child in children_of(pid) {
        let _ = kill(Pid::from_raw(child), Signal::SIGKILL);
    }
    let _ = kill(target, Signal::SIGKILL);
}

/// The processes whose parent is `pid` (from `/proc`).
fn children_of(pid: i32) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|stat| parent_in_stat(&stat))
                == Some(pid)
        })
        .collect()
}

/// The parent pid in a `/proc/<pid>/stat` line: the field after the state, which follows
/// the command in parentheses (a command may itself contain `)` and spaces).
fn parent_in_stat(stat: &str) -> Option<i32> {
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// What a query tells about the running instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    pub in_recovery: bool,
    pub timeline: u32,
    /// Primary: current write position; replica: the larger of received and replayed.
    pub lsn: Lsn,
    pub replay_lag: u64,
    /// A replica's WAL receiver is streaming.
    pub streaming: bool,
    /// The primary's WAL archiving, when `archive_mode` is on.
    pub archiver: Option<Archiver>,
    /// On the primary: commits waiting longer than [`crate::contract::COMMIT_WAIT`] for
    /// synchronous standbys.
    pub commits_waiting: u32,
    /// In recovery: the commit time of the last transaction replayed (RFC 3339).
    pub replayed_at: Option<String>,
}

const QUERY_TIMEOUT: Duration = Duration::from_secs(3);

/// Connects over the run directory's socket as the superuser (local trust).
pub async fn connect(paths: &Paths) -> Result<tokio_postgres::Client, Error> {
    let mut config = tokio_postgres::Config::new();
    config
        .host_path(&paths.run_dir)
        .port(PG_PORT)
        .user("postgres")
        .dbname("postgres")
        .application_name("steward-pg-instance")
        .connect_timeout(QUERY_TIMEOUT);
    let (client, connection) =
        tokio::time::timeout(QUERY_TIMEOUT, config.connect(tokio_postgres::NoTls))
            .await
            .map_err(|_| Error::Timeout(QUERY_TIMEOUT))??;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// Role, timeline and position of the instance.
pub async fn observe(client: &tokio_postgres::Client) -> Result<Observed, Error> {
    const SQL: &str = "select pg_is_in_recovery(), \
        case when pg_is_in_recovery() then null else pg_current_wal_lsn()::text end, \
        case when pg_is_in_recovery() then null else ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int end, \
        pg_last_wal_receive_lsn()::text, pg_last_wal_replay_lsn()::text, \
        (select status from pg_stat_wal_receiver limit 1), \
        coalesce((select nullif(received_tli, 0) from pg_stat_wal_receiver limit 1), \
          greatest((select timeline_id from pg_control_checkpoint()), (select min_recovery_end_timeline from pg_control_recovery()))), \
        current_setting('archive_mode') <> 'off', \
        a.last_archived_wal, to_json(a.last_archived_time) #>> '{}', \
        a.last_failed_wal, to_json(a.last_failed_time) #>> '{}', \
        (select count(*) from pg_stat_activity where wait_event = 'SyncRep' \
           and clock_timestamp() - state_change > make_interval(secs => $1))::int, \
        to_json(pg_last_xact_replay_timestamp()) #>> '{}' \
        from pg_stat_archiver a";
    let waited = crate::contract::COMMIT_WAIT.as_secs_f64();
    let row = tokio::time::timeout(QUERY_TIMEOUT, client.query_one(SQL, &[&waited]))
        .await
        .map_err(|_| Error::Timeout(QUERY_TIMEOUT))??;
    let lsn = |i: usize| -> Lsn {
        row.get::<_, Option<String>>(i)
            .and_then(|s| s.parse().ok())
            .unwrap_or_default()
    };
    let in_recovery: bool = row.get(0);
    Ok(if in_recovery {
        let (received, replayed) = (lsn(3), lsn(4));
        Observed {
            in_recovery,
            timeline: u32::try_from(row.get::<_, Option<i32>>(6).unwrap_or(0)).unwrap_or(0),
            lsn: received.max(replayed),
            replay_lag: received.0.saturating_sub(replayed.0),
            streaming: row.get::<_, Option<String>>(5).as_deref() == Some("streaming"),
            archiver: None,
            commits_waiting: 0,
            replayed_at: row.get(13),
        }
    } else {
        let text = |i: usize| row.get::<_, Option<String>>(i);
        Observed {
            in_recovery,
            timeline: u32::try_from(row.get::<_, Option<i32>>(2).unwrap_or(0)).unwrap_or(0),
            lsn: lsn(1),
            replay_lag: 0,
            streaming: false,
            archiver: row.get::<_, bool>(7).then(|| Archiver {
                last_archived_wal: text(8),
                last_archived_at: text(9),
                last_failed_wal: text(10),
                last_failed_at: text(11),
            }),
            commits_waiting: u32::try_from(row.get::<_, Option<i32>>(12).unwrap_or(0)).unwrap_or(0),
            replayed_at: None,
        }
    })
}

/// Promotes a replica and waits (up to 30 s) until it accepts writes.
pub async fn promote(client: &tokio_postgres::Client) -> Result<bool, Error> {
    let row = tokio::time::timeout(
        Duration::from_secs(35),
        client.query_one("select pg_promote(true, 30)", &[]),
    )
    .await
    .map_err(|_| Error::Timeout(Duration::from_secs(35)))??;
    Ok(row.get(0))
}

/// Ends the current WAL file, so it is archived now.
pub async fn switch_wal(client: &tokio_postgres::Client) -> Result<(), Error> {
    tokio::time::timeout(
        QUERY_TIMEOUT,
        client.batch_execute("select pg_switch_wal()"),
    )
    .await
    .map_err(|_| Error::Timeout(QUERY_TIMEOUT))??;
    Ok(())
}

/// A replica as the primary sees it (`pg_stat_replication`, by `application_name`, which
/// each replica sets to its pod's name).
#[derive(Clone, Debug, PartialEq)]
pub struct Standby {
    /// The WAL sender's state is `streaming`.
    pub streaming: bool,
    /// Bytes of WAL the primary wrote that the replica has not confirmed flushed.
    pub flush_lag: u64,
    /// How long ago the replica last replied (`None`: never).
    pub reply_age: Option<Duration>,
}

/// On the primary: the replica `name`, if it is connected.
pub async fn standby(
    client: &tokio_postgres::Client,
    name: &str,
) -> Result<Option<Standby>, Error> {
    const SQL: &str = "select state = 'streaming', \
        coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), flush_lsn), 0)::float8, \
        extract(epoch from clock_timestamp() - reply_time)::float8 \
        from pg_stat_replication where application_name = $1 \
        order by (state = 'streaming') desc, reply_time desc nulls last limit 1";
    let rows = tokio::time::timeout(QUERY_TIMEOUT, client.query(SQL, &[&name]))
        .await
        .map_err(|_| Error::Timeout(QUERY_TIMEOUT))??;
    Ok(rows.first().map(|row| Standby {
        streaming: row.get(0),
        // Whole bytes, never negative (a replica may confirm past a stale read).
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        flush_lag: row.get::<_, f64>(1).max(0.0) as u64,
        reply_age: row
            .get::<_, Option<f64>>(2)
            .map(|s| Duration::from_secs_f64(s.max(0.0))),
    }))
}

/// A `CHECKPOINT`, so that a shutdown right after has little left to write.
pub async fn checkpoint(client: &tokio_postgres::Client, timeout: Duration) -> Result<(), Error> {
    tokio::time::timeout(timeout, client.batch_execute("checkpoint"))
        .await
        .map_err(|_| Error::Timeout(timeout))??;
    Ok(())
}

/// Where the WAL of this stopped data directory ends, if it was shut down cleanly: its
/// timeline and the position just after its shutdown checkpoint record (`pg_controldata`
/// locates it, `pg_waldump` gives its length). `None`: not shut down cleanly (no shutdown
/// checkpoint: the end is unknown).
pub async fn clean_wal_end(paths: &Paths) -> Result<Option<WalEnd>, Error> {
    let control = run(
        "pg_controldata",
        Command::new("pg_controldata").arg(&paths.pgdata),
    )
    .await?;
    let field = |name: &str| {
        control
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or_default()
            .to_string()
    };
    if field("Database cluster state:") != "shut down" {
        return Ok(None);
    }
    let checkpoint = field("Latest checkpoint location:");
    // Its timeline's WAL files (pg_waldump reads timeline 1 unless told).
    let timeline = field("Latest checkpoint's TimeLineID:");
    let dump = run(
        "pg_waldump",
        Command::new("pg_waldump")
            .arg("-p")
            .arg(paths.pgdata.join("pg_wal"))
            .args(["-t", &timeline, "-s", &checkpoint, "-n", "1"]),
    )
    .await?;
    let failed = |output: String| Error::Failed {
        program: "pg_waldump",
        status: std::process::ExitStatus::default(),
        output,
    };
    let start: Lsn = checkpoint.parse().map_err(|_| {
        failed(format!(
            "no checkpoint location in pg_controldata: {control}"
        ))
    })?;
    let timeline = timeline.parse().map_err(|_| {
        failed(format!(
            "no checkpoint timeline in pg_controldata: {control}"
        ))
    })?;
    let length = record_length(&dump).ok_or_else(|| failed(dump.clone()))?;
    Ok(Some(WalEnd {
        timeline,
        lsn: Lsn(start.0 + length),
    }))
}

/// The total length of the first record `pg_waldump` printed (`len (rec/tot): 114/ 114`).
fn record_length(dump: &str) -> Option<u64> {
    let (_, rest) = dump.split_once("len (rec/tot):")?;
    let (_, total) = rest.split_once('/')?;
    total.split(',').next()?.trim().parse().ok()
}

/// The WAL a replica at `host` has received and flushed (`pg_last_wal_receive_lsn()`),
/// asked as [`REPLICATION_USER`] over verified TLS.
pub async fn received_lsn(paths: &Paths, host: &str) -> Result<Option<Lsn>, Error> {
    let out = run(
        "psql",
        Command::new("psql")
            .arg(format!(
                "host={host} port={PG_PORT} user={REPLICATION_USER} dbname=postgres connect_timeout=3"
            ))
            .args(["-XAtc", "select pg_last_wal_receive_lsn()"])
            .env("PGPASSFILE", paths.passfile())
            .env("PGSSLMODE", "verify-ca")
            .env("PGSSLROOTCERT", paths.ca_file()),
    )
    .await?;
    Ok(out.trim().parse().ok())
}

/// On the primary, each time it starts read-write: the superuser has the password this
/// cluster's Secret holds (a restored cluster's data has the source's, and a restart right
/// after the promotion must not keep it), and the replication role exists, can log in with
/// its password, and may run what `pg_rewind` needs (PostgreSQL's documented grants), so
/// neither cloning nor rewinding uses the superuser. From PostgreSQL 16 on it may also use
/// the `reserved_connections` ([`crate::conf::defaults_conf`]): clients that fill
/// `max_connections` (say, commits waiting for a missing synchronous standby, abandoned and
/// retried) do not lock out a rewind or a switchover's confirmation. The metrics role
/// ([`MONITOR_USER`]) exists with `pg_monitor` and no password: it logs in only through the
/// pod's own socket (`local … trust`; every network entry asks for a password).
pub async fn ensure_roles(
    client: &tokio_postgres::Client,
    superuser_password: &str,
    replication_password: &str,
) -> Result<(), Error> {
    let sql = roles_sql(superuser_password, replication_password);
    tokio::time::timeout(Duration::from_secs(10), client.batch_execute(&sql))
        .await
        .map_err(|_| Error::Timeout(Duration::from_secs(10)))??;
    Ok(())
}

/// The statements of [`ensure_roles`]. Passwords are sent as SCRAM-SHA-256 verifiers,
/// never in clear text: a statement can be logged (`log_statement`, errors) and shows in
/// `pg_stat_activity`.
fn roles_sql(superuser_password: &str, replication_password: &str) -> String {
    // The verifier's alphabet (base64, `$`, `:`, digits) needs no quoting.
    let verifier = |password: &str| postgres_protocol::password::scram_sha_256(password.as_bytes());
    // `synchronous_commit = local`: with synchronous replication configured and no replica
    // yet (bootstrap), a commit would wait for a replica that cannot clone without this role.
    format!(
        "set local synchronous_commit = local; \
         alter role postgres with password '{}'; \
         do $$ begin \
           if not exists (select from pg_roles where rolname = '{REPLICATION_USER}') then \
             create role {REPLICATION_USER} with login replication; \
           end if; end $$; \
         alter role {REPLICATION_USER} with login replication password '{}'; \
         grant execute on function pg_catalog.pg_ls_dir(text, boolean, boolean) to {REPLICATION_USER}; \
         grant execute on function pg_catalog.pg_stat_file(text, boolean) to {REPLICATION_USER}; \
         grant execute on function pg_catalog.pg_read_binary_file(text) to {REPLICATION_USER}; \
         grant execute on function pg_catalog.pg_read_binary_file(text, bigint, bigint, boolean) to {REPLICATION_USER}; \
         do $$ begin \
           if exists (select from pg_roles where rolname = 'pg_use_reserved_connections') then \
             grant pg_use_reserved_connections to {REPLICATION_USER}; \
           end if; end $$; \
         do $$ begin \
           if not exists (select from pg_roles where rolname = '{MONITOR_USER}') then \
             create role {MONITOR_USER} with login; \
           end if; end $$; \
         alter role {MONITOR_USER} with login nosuperuser nocreatedb nocreaterole noreplication password null connection limit 5; \
         grant pg_monitor to {MONITOR_USER};",
        verifier(superuser_password),
        verifier(replication_password),
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_configuration_is_told_in_postgresql_s_words() {
        let output = "\
2026-12-04 20:10:00.000 UTC [12] LOG:  skipping missing configuration file \"/steward/run/instance.conf\"
2026-12-04 20:10:00.000 UTC [12] LOG:  invalid value for parameter \"TimeZone\": \"Mars/Olympus\"
2026-12-04 20:10:00.000 UTC [12] FATAL:  configuration file \"/steward/run/check/postgresql.conf\" contains errors
";
        assert_eq!(
            complaint(output),
            "invalid value for parameter \"TimeZone\": \"Mars/Olympus\"; configuration file \"/steward/run/check/postgresql.conf\" contains errors"
        );
        assert_eq!(complaint("postgres: oops\n"), "postgres: oops");
    }

    /// A lock file whose PID is not a running postgres (this test process, a PID that does
    /// not exist) is removed, and so is one naming no PID; the data directory's and the
    /// socket's are both handled.
    #[test]
    fn stale_lock_files_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let paths = Paths {
            pgdata: dir.path().join("pgdata"),
            config_file: dir.path().join("postgresql.conf"),
            run_dir: dir.path().join("run"),
            tls_dir: dir.path().join("tls"),
        };
        std::fs::create_dir_all(&paths.pgdata).unwrap();
        std::fs::create_dir_all(&paths.run_dir).unwrap();
        for first_line in [std::process::id().to_string(), "4194303".into(), "x".into()] {
            for lock in lock_files(&paths) {
                std::fs::write(&lock, format!("{first_line}\n/var/lib/postgresql/data\n")).unwrap();
            }
            clear_stale_locks(&paths);
            for lock in lock_files(&paths) {
                assert!(!lock.exists(), "{} kept for {first_line}", lock.display());
            }
        }
        assert!(!is_postgres(std::process::id()));
    }

    /// Issue #37, item 8: the passwords were sent as `PASSWORD '<clear text>'`, which the
    /// server logs with `log_statement`.
    #[test]
    fn roles_are_given_scram_verifiers_never_the_passwords() {
        let sql = roles_sql("super'secret", "repl-secret");
        assert!(!sql.contains("secret"), "{sql}");
        assert_eq!(
            sql.matches("password 'SCRAM-SHA-256$4096:").count(),
            2,
            "{sql}"
        );
        // Each verifier has its own salt.
        assert_ne!(roles_sql("a", "b"), roles_sql("a", "b"));
    }

    #[test]
    fn the_length_of_a_shutdown_checkpoint_is_read_from_pg_waldump() {
        let dump = "rmgr: XLOG        len (rec/tot):    114/   114, tx:          0, lsn: 0/03000028, prev 0/03000000, desc: CHECKPOINT_SHUTDOWN redo 0/3000028; tli 1\n";
        assert_eq!(record_length(dump), Some(114));
        assert_eq!(
            record_length("pg_waldump: error: could not find a valid record"),
            None
        );
    }

    /// Issue #37, item 3: a replica erased itself after two `pg_rewind` failures of any
    /// cause; one that could not reach the primary proves nothing about the data.
    #[test]
    fn a_rewind_that_could_not_connect_is_told_from_one_that_found_divergent_data() {
        let failed = |output: &str| Error::Failed {
            program: "pg_rewind",
            status: std::process::ExitStatus::default(),
            output: output.into(),
        };
        for output in [
            "pg_rewind: error: could not connect to server: connection to server at \"198.18.0.5\", port 5432 failed: Connection timed out",
            "pg_rewind: error: connection to server at \"198.18.0.5\", port 5432 failed: FATAL:  sorry, too many clients already",
            "connection to server at \"198.18.0.5\", port 5432 failed: FATAL:  password authentication failed for user \"steward_replication\"",
            "connection to server at \"198.18.0.5\", port 5432 failed: SSL error: certificate verify failed",
            "FATAL:  the database system is starting up",
        ] {
            assert!(unreachable(&failed(output)), "{output}");
        }
        for output in [
            "pg_rewind: error: could not find common ancestor of the source and target cluster's timelines",
            "pg_rewind: error: target server needs to use either data checksums or \"wal_log_hints = on\"",
        ] {
            assert!(!unreachable(&failed(output)), "{output}");
        }
        assert!(!unreachable(&Error::Timeout(Duration::from_secs(1))));
    }

    #[test]
    fn the_parent_is_read_after_the_last_parenthesis() {
        assert_eq!(parent_in_stat("42 (postgres) S 7 42 42 0 -1"), Some(7));
        assert_eq!(parent_in_stat("43 (a) b (c) R 9 1 1"), Some(9));
        assert_eq!(parent_in_stat("garbage"), None);
    }

    /// A stopped parent and its child are both killed: the child first, while the
    /// parent (frozen) cannot start another.
    #[tokio::test]
    async fn kill_tree_kills_a_stopped_parent_and_its_children() {
        let mut parent = Command::new("sh")
            .args(["-c", "sleep 300 & wait"])
            .spawn()
            .unwrap();
        let pid = i32::try_from(parent.id().unwrap()).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        let child = loop {
            if let Some(c) = children_of(pid).first() {
                break *c;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "sh never started sleep"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        kill(Pid::from_raw(pid), Signal::SIGSTOP).unwrap();
        kill_tree(pid);
        let status = tokio::time::timeout(Duration::from_secs(5), parent.wait())
            .await
            .expect("the stopped parent was killed")
            .unwrap();
        assert!(!status.success());
        // The child is gone or a zombie (a SIGKILL takes effect when it is next scheduled).
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let state = std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|s| s.rsplit_once(')')?.1.trim().chars().next());
            if matches!(state, None | Some('Z')) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the child {child} still runs: {state:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}
