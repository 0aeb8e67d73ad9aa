//! The PgBouncer process and its files.
//!
//! PgBouncer runs in the foreground as the agent's child, logging to the container's stderr.
//! It is not restarted here: when it exits the agent exits too, and the kubelet restarts the
//! container (a fresh PgBouncer, a fresh agent state). On shutdown it gets `SIGINT`,
//! PgBouncer's safe shutdown (`SHUTDOWN WAIT_FOR_SERVERS`: no new connections, exit once
//! in-flight transactions released their servers), and `SIGKILL` after the grace period.
//! (`SIGTERM` would be the "super safe" shutdown since 1.23, waiting for every client to
//! disconnect, which long-lived application pools never do.)

use std::io::Write as _;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::process::{Child, Command};

/// A failure running PgBouncer or writing its files.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The program could not be started.
    #[error("failed to start {program}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// Waiting on the child failed.
    #[error("failed to wait for PgBouncer")]
    Wait(#[source] std::io::Error),
    /// A file could not be written.
    #[error("failed to write {path}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// The running PgBouncer.
#[derive(Debug)]
pub struct Process {
    child: Child,
    exited: Option<ExitStatus>,
}

/// `pgbouncer <ini>`: `program` found on `PATH` unless it is a path.
pub fn command(program: &Path, ini: &Path) -> Command {
    let mut command = Command::new(program);
    command.arg(ini);
    command
}

impl Process {
    /// Starts `command` (see [`command`]), its output going to the agent's.
    ///
    /// # Errors
    /// [`Error::Spawn`] when the program cannot be run.
    pub fn start(mut command: Command) -> Result<Self, Error> {
        let program = command
            .as_std()
            .get_program()
            .to_string_lossy()
            .into_owned();
        let child = command
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|source| Error::Spawn { program, source })?;
        Ok(Process {
            child,
            exited: None,
        })
    }

    /// Its process id (`None` once reaped).
    pub fn id(&self) -> Option<u32> {
        self.child.id()
    }

    /// Waits until it exits (cancel-safe: a dropped wait loses nothing).
    ///
    /// # Errors
    /// [`Error::Wait`].
    pub async fn wait(&mut self) -> Result<ExitStatus, Error> {
        if let Some(status) = self.exited {
            return Ok(status);
        }
        let status = self.child.wait().await.map_err(Error::Wait)?;
        self.exited = Some(status);
        Ok(status)
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        self.exited.is_none() && matches!(self.child.try_wait(), Ok(None))
    }

    /// Safe shutdown: `SIGINT`, then `SIGKILL` if it has not exited within `grace`.
    ///
    /// # Errors
    /// [`Error::Wait`].
    pub async fn stop(&mut self, grace: Duration) -> Result<ExitStatus, Error> {
        if let Some(status) = self.exited {
            return Ok(status);
        }
        self.signal(Signal::SIGINT);
        match tokio::time::timeout(grace, self.wait()).await {
            Ok(status) => status,
            Err(_) => {
                tracing::warn!(?grace, "PgBouncer did not stop in time; killing it");
                self.signal(Signal::SIGKILL);
                self.wait().await
            }
        }
    }

    fn signal(&self, signal: Signal) {
        let Some(pid) = self.id().and_then(|id| i32::try_from(id).ok()) else {
            return;
        };
        if let Err(e) = kill(Pid::from_raw(pid), signal) {
            tracing::warn!(%signal, error = %e, "cannot signal PgBouncer");
        }
    }
}

/// Writes `text` to `path` through a temporary file and a rename, so PgBouncer never reads
/// half a file; `mode` applies from the start (the auth file is never readable by others,
/// not even for a moment).
///
/// # Errors
/// [`Error::Write`].
pub fn write_file(path: &Path, text: &str, mode: u32) -> Result<(), Error> {
    let fail = |source| Error::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(fail)?;
    file.write_all(text.as_bytes()).map_err(fail)?;
    file.sync_all().map_err(fail)?;
    drop(file);
    // The umask may have narrowed the mode; set it as asked.
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(mode)).map_err(fail)?;
    std::fs::rename(&tmp, path).map_err(fail)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn files_are_replaced_whole_with_their_mode() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("users.txt");
        write_file(&path, "one\n", 0o600).unwrap();
        write_file(&path, "two\n", 0o600).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "two\n");
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        assert!(!dir.path().join("users.txt.tmp").exists());
    }

    #[tokio::test]
    async fn stop_interrupts_and_reports_the_exit() {
        let mut command = Command::new("sleep");
        command.arg("30");
        let mut process = Process::start(command).unwrap();
        assert!(process.running());
        let status = process.stop(Duration::from_secs(5)).await.unwrap();
        assert!(!status.success());
        assert!(!process.running());
    }

    #[tokio::test]
    async fn stop_kills_what_ignores_the_interrupt() {
        let dir = tempfile::tempdir().unwrap();
        let trapped = dir.path().join("trapped");
        let mut command = Command::new("sh");
        command.args(["-c", "trap '' INT; touch \"$0\"; exec sleep 30"]);
        command.arg(&trapped);
        let mut process = Process::start(command).unwrap();
        // The interrupt is ignored once the shell wrote the file.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !trapped.exists() {
            assert!(std::time::Instant::now() < deadline, "the shell never ran");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let started = std::time::Instant::now();
        let status = process.stop(Duration::from_millis(300)).await.unwrap();
        assert!(!status.success());
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
