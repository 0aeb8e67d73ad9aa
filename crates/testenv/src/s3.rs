//! A real S3 server for the backup tests and `cargo xtask up`: S3Proxy (its jar from Maven
//! Central, see [`binaries::s3proxy`], on Debian's Java) with its `filesystem-nio2` backend
//! (S3Proxy's own: a deleted object's empty directories go with it, so prefixes list as S3
//! lists them, which jclouds' `filesystem` does not; conditional writes as S3's), on an
//! address of the caller's choice (the real node's bridge address, so pods reach it) and a
//! free port, with one identity whose credentials [`S3Server::ACCESS_KEY`] and
//! [`S3Server::SECRET_KEY`] give and AWS Signature V4 required, as AWS does. The buckets the
//! caller names exist from the start (a bucket is a directory of the backend; the operators
//! never create one, as in production). Stopped (and its data removed) on drop.

use std::path::Path;
use std::time::Duration;

use crate::process::{Process, free_port};
use crate::{Error, binaries};

/// A running S3Proxy.
pub struct S3Server {
    process: Process,
    endpoint: String,
    _dir: tempfile::TempDir,
}

impl S3Server {
    pub const ACCESS_KEY: &'static str = "steward-test";
    pub const SECRET_KEY: &'static str = "steward-test-secret";

    /// Downloads S3Proxy unless cached, starts it listening on `ip` with `buckets` created,
    /// and waits until its port answers (about 3 s).
    ///
    /// # Errors
    /// [`Error::Build`] when the jar cannot be downloaded, [`Error::Other`] when the server
    /// does not come up within a minute (with its log's tail).
    pub async fn start(ip: &str, buckets: &[&str]) -> Result<Self, Error> {
        let jar = tokio::task::spawn_blocking(binaries::s3proxy)
            .await
            .map_err(|e| Error::Other(format!("downloading S3Proxy: {e}")))??;
        let io = |what: String| move |source| Error::Io { what, source };
        let dir = tempfile::Builder::new()
            .prefix("steward-s3-")
            .tempdir()
            .map_err(io("create the S3 server's directory".into()))?;
        let data = dir.path().join("data");
        for bucket in buckets {
            let path = data.join(bucket);
            std::fs::create_dir_all(&path).map_err(io(format!("create {}", path.display())))?;
        }
        let port = free_port()?;
        let endpoint = format!("http://{ip}:{port}");
        let properties = dir.path().join("s3proxy.properties");
        let config = [
            ("s3proxy.endpoint", endpoint.as_str()),
            ("s3proxy.authorization", "aws-v4"),
            ("s3proxy.identity", Self::ACCESS_KEY),
            ("s3proxy.credential", Self::SECRET_KEY),
            ("jclouds.provider", "filesystem-nio2"),
            ("jclouds.filesystem.basedir", &data.display().to_string()),
            // Required by the provider, unused by a local directory.
            ("jclouds.identity", "local"),
            ("jclouds.credential", "local"),
        ]
        .map(|(key, value)| format!("{key}={value}\n"))
        .concat();
        std::fs::write(&properties, config)
            .map_err(io(format!("write {}", properties.display())))?;
        // A small heap and the client compiler: it serves a few tests' WAL, and starts in
        // about 2 s instead of 4.
        let args = [
            "-Xmx256m".to_string(),
            "-XX:+UseSerialGC".into(),
            "-XX:TieredStopAtLevel=1".into(),
            "-jar".into(),
            jar.display().to_string(),
            "--properties".into(),
            properties.display().to_string(),
        ];
        let process = Process::spawn(
            "s3proxy",
            Path::new("java"),
            &args,
            dir.path().join("s3proxy.log"),
        )?;
        let server = Self {
            process,
            endpoint,
            _dir: dir,
        };
        let addr: std::net::SocketAddr = format!("{ip}:{port}")
            .parse()
            .map_err(|e| Error::Other(format!("S3 address {ip}:{port}: {e}")))?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            // Answered (any status, 403 without credentials): it is up.
            if crate::http_get(addr, "/").await.is_ok() {
                return Ok(server);
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Error::Other(format!(
                    "S3Proxy did not answer on {addr} within a minute:\n{}",
                    crate::process::log_tail(&server.process.log, 30)
                )));
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// A Secret `name` in `namespace` with this server's credentials, as a PostgresCluster's
    /// `spec.backup.objectStore.credentialsSecret` names them (`accessKeyId`,
    /// `secretAccessKey`).
    pub fn credentials_secret(name: &str, namespace: &str) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": "v1", "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "stringData": {
                "accessKeyId": Self::ACCESS_KEY,
                "secretAccessKey": Self::SECRET_KEY,
            },
        })
    }

    /// `http://<ip>:<port>`.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The server's log.
    pub fn log(&self) -> &Path {
        &self.process.log
    }
}
