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

use crate::contract::{Archiver, Lsn, PG_PORT, REPLICATION_USER};

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
            .args([
                "-h",
                host,
                "-p",
                &PG_PORT.to_string(),
                "-U",
                REPLICATION_USER,
            ])
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
pub async fn rewind(paths: &Paths, host: &str) -> Result<String, Error> {
    clear_stale_locks(paths);
    run(
        "pg_rewind",
        Command::new("pg_rewind")
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
    pub async fn stop(mut self, timeout: Duration) {
        self.signal(Signal::SIGINT);
        if tokio::time::timeout(timeout, self.child.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                pid = self.pid,
                "fast shutdown took over {timeout:?}; immediate shutdown"
            );
            self.signal(Signal::SIGQUIT);
            let _ = tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await;
            let _ = self.child.kill().await;
        }
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
        coalesce((select received_tli from pg_stat_wal_receiver limit 1), (select timeline_id from pg_control_checkpoint())), \
        current_setting('archive_mode') <> 'off', \
        a.last_archived_wal, to_json(a.last_archived_time) #>> '{}', \
        a.last_failed_wal, to_json(a.last_failed_time) #>> '{}' \
        from pg_stat_archiver a";
    let row = tokio::time::timeout(QUERY_TIMEOUT, client.query_one(SQL, &[]))
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

/// Sets the superuser's password (a restored cluster's data has the source's).
pub async fn set_superuser_password(
    client: &tokio_postgres::Client,
    password: &str,
) -> Result<(), Error> {
    let literal = format!("'{}'", password.replace('\'', "''"));
    let sql = format!(
        "set local synchronous_commit = local; alter role postgres with password {literal}"
    );
    tokio::time::timeout(Duration::from_secs(10), client.batch_execute(&sql))
        .await
        .map_err(|_| Error::Timeout(Duration::from_secs(10)))??;
    Ok(())
}

/// On the primary: the replication role exists, can log in with `password`, and may run
/// what `pg_rewind` needs (PostgreSQL's documented grants), so neither cloning nor
/// rewinding uses the superuser.
pub async fn ensure_replication_role(
    client: &tokio_postgres::Client,
    password: &str,
) -> Result<(), Error> {
    let literal = format!("'{}'", password.replace('\'', "''"));
    // `synchronous_commit = local`: with synchronous replication configured and no replica
    // yet (bootstrap), a commit would wait for a replica that cannot clone without this role.
    let sql = format!(
        "set local synchronous_commit = local; \
         do $$ begin \
           if not exists (select from pg_roles where rolname = '{REPLICATION_USER}') then \
             create role {REPLICATION_USER} with login replication; \
           end if; end $$; \
         alter role {REPLICATION_USER} with login replication password {literal}; \
         grant execute on function pg_catalog.pg_ls_dir(text, boolean, boolean) to {REPLICATION_USER}; \
         grant execute on function pg_catalog.pg_stat_file(text, boolean) to {REPLICATION_USER}; \
         grant execute on function pg_catalog.pg_read_binary_file(text) to {REPLICATION_USER}; \
         grant execute on function pg_catalog.pg_read_binary_file(text, bigint, bigint, boolean) to {REPLICATION_USER};"
    );
    tokio::time::timeout(Duration::from_secs(10), client.batch_execute(&sql))
        .await
        .map_err(|_| Error::Timeout(Duration::from_secs(10)))??;
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

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
}
