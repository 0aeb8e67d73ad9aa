//! A real PostgreSQL server for tests: Debian's `postgresql` package, run from a fresh data
//! directory on 127.0.0.1 and a free port, with a generated superuser password (SCRAM over TCP).
//!
//! ```no_run
//! # async fn f() -> Result<(), steward_testenv::Error> {
//! let mut pg = steward_testenv::postgres::Postgres::start().await?;
//! let url = pg.url("postgres"); // postgres://postgres:<password>@127.0.0.1:<port>/postgres
//! pg.stop().await?; // take it down (same data dir and port stay reserved for this server)
//! pg.start_again().await?; // and bring it back
//! # Ok(()) }
//! ```
//!
//! PostgreSQL refuses to run as root, so `initdb` and `postgres` run as the `postgres` OS user
//! through `setpriv --reuid=postgres --regid=postgres --init-groups`; the server also gets
//! `--pdeathsig KILL` *after* the user change (a credential change clears the parent-death
//! signal), so it dies with the test process like the control plane does.
//!
//! # Caveats
//! Needs the `postgresql` Debian package (`/usr/lib/postgresql/<major>/bin`) and a `postgres`
//! OS user; the error says how to install it. Every statement is logged (`log_statement=all`)
//! to [`Postgres::log`], so tests can check that no password reached the server in clear text.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::Error;
use crate::process::{Process, free_port, log_tail};

const OS_USER: &str = "postgres";
/// The superuser created by `initdb`.
pub const SUPERUSER: &str = "postgres";

/// A running (or stopped) PostgreSQL server owned by one test. Dropping it stops the server
/// and removes its data directory.
#[derive(Debug)]
pub struct Postgres {
    process: Option<Process>,
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    password: String,
    major: u32,
    runs: u32,
}

impl Postgres {
    /// Runs `initdb` in a fresh temp dir and starts the server on a free port, waiting until it
    /// accepts connections.
    ///
    /// # Errors
    /// [`Error::Start`] when PostgreSQL is not installed, `initdb` fails or the server does not
    /// come up (naming the log).
    pub async fn start() -> Result<Self, Error> {
        let (bin, major) = find_bin()?;
        let dir = tempfile::Builder::new()
            .prefix("steward-postgres-")
            .tempdir()
            .map_err(|source| Error::Io {
                what: "create the PostgreSQL temp dir".into(),
                source,
            })?;
        chown_to_postgres(dir.path())?;
        let password = random_password();
        let pwfile = dir.path().join("pwfile");
        std::fs::write(&pwfile, &password).map_err(|source| Error::Io {
            what: "write the PostgreSQL password file".into(),
            source,
        })?;
        chown_to_postgres(&pwfile)?;
        let init_log = dir.path().join("initdb.log");
        let data = dir.path().join("data");
        let bin2 = bin.clone();
        let data2 = data.clone();
        let pwfile2 = pwfile.clone();
        let log2 = init_log.clone();
        tokio::task::spawn_blocking(move || run_initdb(&bin2, &data2, &pwfile2, &log2))
            .await
            .map_err(|e| Error::Other(format!("initdb task failed: {e}")))??;
        let _ = std::fs::remove_file(&pwfile);
        let port = free_port()?;
        let mut pg = Self {
            process: None,
            bin,
            dir,
            port,
            password,
            major,
            runs: 0,
        };
        pg.spawn_server().await?;
        Ok(pg)
    }

    /// `127.0.0.1`.
    pub fn host(&self) -> &'static str {
        "127.0.0.1"
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The superuser's name, `postgres`.
    pub fn superuser(&self) -> &'static str {
        SUPERUSER
    }

    /// The superuser's password (URL-safe characters only).
    pub fn password(&self) -> &str {
        &self.password
    }

    /// The server's major version (`15` for Debian 12's package).
    pub fn major_version(&self) -> u32 {
        self.major
    }

    /// `postgres://postgres:<password>@127.0.0.1:<port>/<database>`.
    pub fn url(&self, database: &str) -> String {
        format!(
            "postgres://{SUPERUSER}:{}@127.0.0.1:{}/{database}",
            self.password, self.port
        )
    }

    /// A libpq/tokio-postgres key-value connection string for `user`/`password` on `database`.
    pub fn conn_str(&self, database: &str, user: &str, password: &str) -> String {
        format!(
            "host=127.0.0.1 port={} dbname='{}' user='{}' password='{}' connect_timeout=5",
            self.port,
            database.replace('\\', "\\\\").replace('\'', "\\'"),
            user.replace('\\', "\\\\").replace('\'', "\\'"),
            password.replace('\\', "\\\\").replace('\'', "\\'"),
        )
    }

    /// The log of the server's current (or last) run (every statement is logged).
    pub fn log(&self) -> PathBuf {
        self.log_of_run(self.runs)
    }

    fn log_of_run(&self, run: u32) -> PathBuf {
        self.dir.path().join(format!("postgres-{run}.log"))
    }

    /// The server's logs of every run so far, as text.
    pub fn log_text(&self) -> String {
        (1..=self.runs)
            .map(|run| std::fs::read_to_string(self.log_of_run(run)).unwrap_or_default())
            .collect()
    }

    /// Whether the server process is running.
    pub fn is_running(&mut self) -> bool {
        self.process.as_mut().is_some_and(|p| p.exited().is_none())
    }

    /// Stops the server (fast shutdown: open connections are terminated) and waits until it
    /// is down. The data directory and port stay this server's; [`Postgres::start_again`]
    /// brings it back. Stopping a stopped server does nothing.
    ///
    /// # Errors
    /// [`Error::Other`] when `pg_ctl stop` fails.
    pub async fn stop(&mut self) -> Result<(), Error> {
        if self.process.is_none() {
            return Ok(());
        }
        let bin = self.bin.clone();
        let data = self.data_dir();
        let out = tokio::task::spawn_blocking(move || pg_ctl_stop(&bin, &data, "fast"))
            .await
            .map_err(|e| Error::Other(format!("pg_ctl task failed: {e}")))?;
        // Reap the postmaster (it has exited; the kill in Drop is then a no-op).
        self.process = None;
        out
    }

    /// Sends `signal` (`STOP`, `CONT`, …) to the postmaster: `STOP` makes a server that
    /// accepts TCP connections (the kernel's backlog) and never answers them.
    ///
    /// # Errors
    /// [`Error::Other`] when the server is not running or `kill` fails.
    pub fn signal(&self, signal: &str) -> Result<(), Error> {
        self.process
            .as_ref()
            .ok_or_else(|| Error::Other("the server is not running".into()))?
            .signal(signal)
    }

    /// Starts a stopped server again on the same port and data directory.
    ///
    /// # Errors
    /// As [`Postgres::start`].
    pub async fn start_again(&mut self) -> Result<(), Error> {
        if self.is_running() {
            return Ok(());
        }
        self.process = None;
        self.spawn_server().await
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    async fn spawn_server(&mut self) -> Result<(), Error> {
        self.runs += 1;
        let log = self.log();
        let postgres = self.bin.join("postgres");
        let args: Vec<String> = vec![
            format!("--reuid={OS_USER}"),
            format!("--regid={OS_USER}"),
            "--init-groups".into(),
            "--pdeathsig".into(),
            "KILL".into(),
            "--".into(),
            postgres.display().to_string(),
            "-D".into(),
            self.data_dir().display().to_string(),
            "-p".into(),
            self.port.to_string(),
            "-c".into(),
            "listen_addresses=127.0.0.1".into(),
            "-c".into(),
            format!("unix_socket_directories={}", self.dir.path().display()),
            "-c".into(),
            "fsync=off".into(),
            "-c".into(),
            "full_page_writes=off".into(),
            "-c".into(),
            "log_statement=all".into(),
            "-c".into(),
            "log_min_error_statement=error".into(),
            // Epoch time with milliseconds and the client's application_name, so a test can
            // tell who sent a statement and when.
            "-c".into(),
            "log_line_prefix=%n [%a] ".into(),
            "-c".into(),
            "max_connections=200".into(),
        ];
        let process = Process::spawn("postgres", Path::new("setpriv"), &args, log.clone())?;
        self.process = Some(process);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(p) = self.process.as_mut()
                && let Some(status) = p.exited()
            {
                return Err(Error::Start {
                    component: "postgres",
                    log: log.clone(),
                    reason: format!("exited with {status}: {}", log_tail(&log, 20)),
                });
            }
            if self.accepts_connections().await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(Error::Unhealthy {
                    component: "postgres",
                    log: log.clone(),
                    waited_secs: 60,
                    reason: log_tail(&log, 20),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn accepts_connections(&self) -> bool {
        let isready = self.bin.join("pg_isready");
        let port = self.port.to_string();
        tokio::process::Command::new(isready)
            .args([
                "-q",
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-d",
                "postgres",
                "-U",
                SUPERUSER,
                "-t",
                "2",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .await
            .is_ok_and(|s| s.success())
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if self.process.is_some() {
            // Immediate shutdown lets the backends exit before the data dir is removed.
            let _ = pg_ctl_stop(&self.bin, &self.data_dir(), "immediate");
        }
        self.process = None;
    }
}

/// `/usr/lib/postgresql/<newest major>/bin` and that major version.
pub(crate) fn find_bin() -> Result<(PathBuf, u32), Error> {
    let not_installed = |reason: String| Error::Start {
        component: "postgres",
        log: PathBuf::from("/usr/lib/postgresql"),
        reason: format!(
            "{reason}; install it with `apt-get update && apt-get install -y postgresql postgresql-contrib`"
        ),
    };
    let root = Path::new("/usr/lib/postgresql");
    let entries = std::fs::read_dir(root)
        .map_err(|e| not_installed(format!("cannot read {}: {e}", root.display())))?;
    let best = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|major| root.join(major.to_string()).join("bin/postgres").exists())
        .max()
        .ok_or_else(|| not_installed("no /usr/lib/postgresql/<major>/bin/postgres".into()))?;
    Ok((root.join(best.to_string()).join("bin"), best))
}

fn chown_to_postgres(path: &Path) -> Result<(), Error> {
    // `chown` resolves the user by name, so no passwd parsing here.
    let status = Command::new("chown")
        .arg(format!("{OS_USER}:{OS_USER}"))
        .arg(path)
        .status()
        .map_err(|source| Error::Io {
            what: format!("run chown on {}", path.display()),
            source,
        })?;
    if !status.success() {
        return Err(Error::Other(format!(
            "chown {OS_USER} {} failed ({status}); is there a `{OS_USER}` OS user (Debian's postgresql package creates it)?",
            path.display()
        )));
    }
    let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700));
    Ok(())
}

fn as_postgres(program: &Path) -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.arg(format!("--reuid={OS_USER}"))
        .arg(format!("--regid={OS_USER}"))
        .arg("--init-groups")
        .arg("--")
        .arg(program)
        .stdin(Stdio::null());
    cmd
}

fn run_initdb(bin: &Path, data: &Path, pwfile: &Path, log: &Path) -> Result<(), Error> {
    let file = std::fs::File::create(log).map_err(|source| Error::Io {
        what: "create the initdb log".into(),
        source,
    })?;
    let file_err = file.try_clone().map_err(|source| Error::Io {
        what: "open the initdb log".into(),
        source,
    })?;
    let status = as_postgres(&bin.join("initdb"))
        .arg("-D")
        .arg(data)
        .arg(format!("--username={SUPERUSER}"))
        .arg(format!("--pwfile={}", pwfile.display()))
        .args([
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--encoding=UTF8",
            "--no-locale",
            "--no-sync",
        ])
        .stdout(file)
        .stderr(file_err)
        .status()
        .map_err(|source| Error::Io {
            what: "run initdb through setpriv".into(),
            source,
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::Start {
            component: "postgres",
            log: log.to_path_buf(),
            reason: format!("initdb exited with {status}: {}", log_tail(log, 20)),
        })
    }
}

fn pg_ctl_stop(bin: &Path, data: &Path, mode: &str) -> Result<(), Error> {
    let out = as_postgres(&bin.join("pg_ctl"))
        .arg("stop")
        .arg("-D")
        .arg(data)
        .args(["-m", mode, "-w", "-t", "60"])
        .output()
        .map_err(|source| Error::Io {
            what: "run pg_ctl stop through setpriv".into(),
            source,
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(Error::Other(format!(
            "pg_ctl stop -m {mode} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )))
    }
}

/// 32 characters of `[A-Za-z0-9_-]`: 192 bits.
fn random_password() -> String {
    use rand::Rng;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut rng = rand::rng();
    (0..32)
        .map(|_| char::from(ALPHABET[rng.random_range(0..ALPHABET.len())]))
        .collect()
}
