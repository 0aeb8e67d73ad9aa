//! Child processes that die with the test process.
//!
//! A test binary keeps its control plane in a `static`, which is never dropped. So that no
//! etcd or kube-apiserver outlives the test process, every component is started through
//! `setpriv --pdeathsig KILL`, which asks the kernel to kill it when its parent thread
//! ends. The parent thread is one long-lived spawner thread, so the children live exactly
//! as long as the process (a tokio blocking thread would end after idling and take the
//! children with it).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock, mpsc};

use crate::Error;

type Request = (Command, mpsc::Sender<std::io::Result<Child>>);

fn spawner() -> &'static Mutex<mpsc::Sender<Request>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Request>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Request>();
        std::thread::Builder::new()
            .name("steward-testenv-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
                // The sender lives in a static, so this loop never ends while the process runs.
            })
            .expect("spawning a thread at startup");
        Mutex::new(tx)
    })
}

/// A running component; killed and reaped on drop.
#[derive(Debug)]
pub struct Process {
    pub name: &'static str,
    pub log: PathBuf,
    binary: PathBuf,
    args: Vec<String>,
    child: Child,
}

impl Process {
    /// Starts `binary args…` with stdout and stderr going to `log`.
    pub fn spawn(
        name: &'static str,
        binary: &Path,
        args: &[String],
        log: PathBuf,
    ) -> Result<Self, Error> {
        let child = start(name, binary, args, &log, false)?;
        Ok(Self {
            name,
            log,
            binary: binary.to_path_buf(),
            args: args.to_vec(),
            child,
        })
    }

    /// Whether the process has exited, with its status.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// SIGKILLs the process and reaps it (a crash, as far as anyone else can tell).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts the process again with the same arguments (after [`Process::kill`]); its log
    /// is appended to.
    pub fn restart(&mut self) -> Result<(), Error> {
        self.kill();
        self.child = start(self.name, &self.binary, &self.args, &self.log, true)?;
        Ok(())
    }

    /// Sends `signal` (`STOP`, `CONT`, …) to the process.
    pub fn signal(&self, signal: &str) -> Result<(), Error> {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .map_err(|source| Error::Io {
                what: format!("send SIG{signal} to {}", self.name),
                source,
            })?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::Other(format!(
                "kill -{signal} {} ({}) failed: {status}",
                self.child.id(),
                self.name
            )))
        }
    }
}

fn start(
    name: &'static str,
    binary: &Path,
    args: &[String],
    log: &Path,
    append: bool,
) -> Result<Child, Error> {
    let start_err = |reason: String| Error::Start {
        component: name,
        log: log.to_path_buf(),
        reason,
    };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(append)
        .truncate(!append)
        .open(log)
        .map_err(|e| start_err(format!("cannot create log: {e}")))?;
    let file_err = file
        .try_clone()
        .map_err(|e| start_err(format!("cannot open log: {e}")))?;
    let mut cmd = Command::new("setpriv");
    cmd.arg("--pdeathsig")
        .arg("KILL")
        .arg("--")
        .arg(binary)
        .args(args)
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(file_err);
    let (tx, rx) = mpsc::channel();
    spawner()
        .lock()
        .map_err(|_| start_err("spawner lock poisoned".into()))?
        .send((cmd, tx))
        .map_err(|_| start_err("spawner thread is gone".into()))?;
    let child = rx
        .recv()
        .map_err(|_| start_err("spawner thread is gone".into()))?
        .map_err(|e| {
            start_err(format!(
                "cannot run {} (through setpriv): {e}",
                binary.display()
            ))
        })?;
    Ok(child)
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `check` every 100 ms until it succeeds. Fails at once, with the last log lines, if any
/// of `processes` exited, and after `timeout` naming `processes[index]` and its log.
pub(crate) async fn wait_healthy<F, Fut>(
    processes: &mut [Process],
    index: usize,
    timeout: std::time::Duration,
    check: F,
) -> Result<(), Error>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    let deadline = std::time::Instant::now() + timeout;
    loop {
        for proc in processes.iter_mut() {
            if let Some(status) = proc.exited() {
                return Err(Error::Start {
                    component: proc.name,
                    log: proc.log.clone(),
                    reason: format!(
                        "exited with {status}; last log lines:\n{}",
                        log_tail(&proc.log, 15)
                    ),
                });
            }
        }
        let last = match check().await {
            Ok(()) => return Ok(()),
            Err(e) => e,
        };
        if std::time::Instant::now() > deadline {
            let proc = &processes[index];
            return Err(Error::Unhealthy {
                component: proc.name,
                log: proc.log.clone(),
                waited_secs: timeout.as_secs(),
                reason: format!("{last}; last log lines:\n{}", log_tail(&proc.log, 15)),
            });
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// A free TCP port on 127.0.0.1 for a server a test starts (bound and released).
///
/// Chosen at random *below* the kernel's ephemeral range (`ip_local_port_range`): a port the
/// kernel hands out for `bind(0)` is from the range every outgoing connection takes its source
/// port from, so between the release here and the server's own bind, a client connection
/// (to an API server, say) could take it ("address already in use"). Falls back to the
/// kernel's choice when the range leaves no room below it.
pub fn free_port() -> Result<u16, Error> {
    let bind = |port: u16| std::net::TcpListener::bind(("127.0.0.1", port));
    let ephemeral_start = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    const LOWEST: u16 = 20000;
    // Never the same port twice in this process (two servers of one control plane are
    // started before either binds).
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    if ephemeral_start > LOWEST + 1000 {
        let mut handed_out = HANDED_OUT
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for _ in 0..64 {
            let port = rand::random_range(LOWEST..ephemeral_start);
            if !handed_out.contains(&port) && bind(port).is_ok() {
                handed_out.push(port);
                return Ok(port);
            }
        }
    }
    let listener = bind(0).map_err(|source| Error::Io {
        what: "bind a free port".into(),
        source,
    })?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|source| Error::Io {
            what: "read a bound port".into(),
            source,
        })
}

/// Last lines of a log, for error messages.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// `GET path` over plain HTTP/1.0 from `addr` (a metrics or health port): the status code and
/// the body. Connecting may take 2 s and the whole response 5 s.
///
/// # Errors
/// [`Error::Io`] when the connection, the request or the response fails or times out, or the
/// response has no status code.
pub async fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<(u16, String), Error> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let io = |what: &str, source: std::io::Error| Error::Io {
        what: format!("GET http://{addr}{path}: {what}"),
        source,
    };
    let timed_out = || std::io::Error::from(std::io::ErrorKind::TimedOut);
    let mut stream = tokio::time::timeout(
        std::time::Duration::from_secs(2),
        tokio::net::TcpStream::connect(addr),
    )
    .await
    .map_err(|_| io("connect", timed_out()))?
    .map_err(|e| io("connect", e))?;
    let exchange = async {
        stream
            .write_all(
                format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
        let mut buf = Vec::new();
        stream.read_to_end(&mut buf).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&buf).into_owned())
    };
    let response = tokio::time::timeout(std::time::Duration::from_secs(5), exchange)
        .await
        .map_err(|_| io("response", timed_out()))?
        .map_err(|e| io("response", e))?;
    let code = response
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| {
            io(
                "response",
                std::io::Error::new(std::io::ErrorKind::InvalidData, "no HTTP status"),
            )
        })?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}
