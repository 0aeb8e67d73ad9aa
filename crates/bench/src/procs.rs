//! Operator processes under test: spawning, signals, probes, leader status and memory.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// `GET http://127.0.0.1:{port}{path}` → (status, body).
pub async fn http_get(port: u16, path: &str) -> Result<(u16, String)> {
    Ok(steward_testenv::http_get(([127, 0, 0, 1], port).into(), path).await?)
}

/// How to start one replica of an operator.
#[derive(Clone, Debug)]
pub struct Launch {
    pub binary: PathBuf,
    pub args: Vec<String>,
    pub log_dir: PathBuf,
    pub label: String,
}

/// One running replica.
pub struct Replica {
    pub child: Child,
    pub pid: u32,
    pub metrics_port: u16,
    pub health_port: u16,
    pub started: Instant,
    pub log: PathBuf,
}

impl Replica {
    /// Starts a replica with fresh probe ports. Spawned through `setpriv --pdeathsig KILL` so
    /// no operator outlives the harness.
    pub fn spawn(launch: &Launch, kubeconfig: &Path, index: usize) -> Result<Self> {
        let metrics_port = steward_testenv::free_port()?;
        let health_port = steward_testenv::free_port()?;
        std::fs::create_dir_all(&launch.log_dir)?;
        let log = launch.log_dir.join(format!("{}-{index}.log", launch.label));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let mut cmd = Command::new("setpriv");
        cmd.args(["--pdeathsig", "KILL", "--"])
            .arg(&launch.binary)
            .arg(format!("--kubeconfig={}", kubeconfig.display()))
            .arg(format!("--metrics-bind-address=127.0.0.1:{metrics_port}"))
            .arg(format!(
                "--health-probe-bind-address=127.0.0.1:{health_port}"
            ))
            .args(&launch.args)
            .env_remove("KUBECONFIG")
            .env("POD_NAME", format!("{}-{index}", launch.label))
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file);
        let started = Instant::now();
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", launch.binary.display()))?;
        let pid = child.id();
        Ok(Self {
            child,
            pid,
            metrics_port,
            health_port,
            started,
            log,
        })
    }

    /// Waits until `/readyz` answers 200 (caches synced); returns when that happened.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<Instant> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok((200, _)) = http_get(self.health_port, "/readyz").await {
                return Ok(Instant::now());
            }
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "operator exited ({status}) before it was ready; log: {}",
                    self.log.display()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "operator not ready after {timeout:?}; log: {}",
                    self.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Whether this replica reports `leader_election_master_status 1` (for any Lease).
    pub async fn is_leader(&self) -> bool {
        self.reports_leading(|_| true).await
    }

    /// Whether this replica reports `leader_election_master_status{name="<lease>"} 1`.
    pub async fn holds(&self, lease: &str) -> bool {
        let labels = format!("{{name=\"{lease}\"}}");
        self.reports_leading(|rest| rest.starts_with(&labels)).await
    }

    /// Whether a `leader_election_master_status` sample whose labels pass `labels` is 1.
    async fn reports_leading(&self, labels: impl Fn(&str) -> bool) -> bool {
        match http_get(self.metrics_port, "/metrics").await {
            Ok((200, body)) => body
                .lines()
                .filter_map(|l| l.strip_prefix("leader_election_master_status"))
                .filter(|rest| labels(rest))
                .any(|l| {
                    l.split_whitespace()
                        .last()
                        .and_then(|v| v.parse::<f64>().ok())
                        == Some(1.0)
                }),
            _ => false,
        }
    }

    /// Resident set now and its high-water mark, in bytes (`/proc/<pid>/status`).
    pub fn memory(&self) -> Result<(u64, u64)> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid))?;
        let field = |name: &str| {
            status
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
                .map(|kb| kb * 1024)
        };
        Ok((
            field("VmRSS:").context("VmRSS")?,
            field("VmHWM:").context("VmHWM")?,
        ))
    }

    /// CPU time this replica has used so far (user and system, all threads), in seconds
    /// (`/proc/<pid>/stat`, in clock ticks of 1/100 s: Linux's `USER_HZ`).
    pub fn cpu_secs(&self) -> Result<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid))?;
        // After the command name, which may hold spaces: state is field 3, utime 14, stime 15.
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .map(|(_, rest)| rest.split_whitespace().collect())
            .unwrap_or_default();
        let ticks = |i: usize| -> Result<f64> {
            Ok(fields
                .get(i)
                .context("a short /proc/<pid>/stat")?
                .parse::<u64>()? as f64)
        };
        Ok((ticks(11)? + ticks(12)?) / 100.0)
    }

    /// Sends `signal` (`KILL` or `TERM`) to this replica's pid.
    pub fn signal(&self, signal: &str) -> Result<()> {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid.to_string())
            .status()?;
        if !status.success() {
            bail!("kill -{signal} {} failed", self.pid);
        }
        Ok(())
    }

    /// Waits for the process to exit (after a signal).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while self.child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                self.signal("KILL")?;
                bail!("operator did not exit within {timeout:?}; killed");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }

    /// Graceful stop (SIGTERM), falling back to SIGKILL after 40 s.
    pub async fn stop(mut self) -> Result<()> {
        if self.child.try_wait()?.is_none() {
            self.signal("TERM")?;
            self.wait_exit(Duration::from_secs(40)).await?;
        }
        Ok(())
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
