//! A real S3 server for the backup tests: SeaweedFS (`weed server` with its S3 gateway, built
//! from `go/seaweedfs` like the control plane), on an address of the caller's choice (the
//! real node's bridge address, so pods reach it) and free ports, with one identity whose
//! credentials [`S3Server::access_key`] and [`S3Server::secret_key`] give. Buckets are
//! created on first upload. Stopped (and its data removed) on drop.

use std::path::Path;
use std::time::Duration;

use crate::process::{Process, free_port};
use crate::{Error, binaries};

/// A running SeaweedFS with its S3 gateway.
pub struct S3Server {
    process: Process,
    endpoint: String,
    _dir: tempfile::TempDir,
}

impl S3Server {
    pub const ACCESS_KEY: &'static str = "steward-test";
    pub const SECRET_KEY: &'static str = "steward-test-secret";

    /// Builds SeaweedFS unless cached (about 10 minutes cold), starts it listening on `ip`
    /// and waits until the S3 port accepts connections.
    ///
    /// # Errors
    /// [`Error::Build`] when SeaweedFS cannot be built, [`Error::Other`] when it does not
    /// come up within a minute (with its log's tail).
    pub async fn start(ip: &str) -> Result<Self, Error> {
        let weed = tokio::task::spawn_blocking(binaries::seaweedfs)
            .await
            .map_err(|e| Error::Other(format!("building SeaweedFS: {e}")))??;
        let dir = tempfile::Builder::new()
            .prefix("steward-s3-")
            .tempdir()
            .map_err(|source| Error::Io {
                what: "create the S3 server's directory".into(),
                source,
            })?;
        let config = dir.path().join("s3.json");
        let identities = serde_json::json!({"identities": [{
            "name": "steward",
            "credentials": [{"accessKey": Self::ACCESS_KEY, "secretKey": Self::SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]});
        std::fs::write(&config, identities.to_string()).map_err(|source| Error::Io {
            what: format!("write {}", config.display()),
            source,
        })?;
        let data = dir.path().join("data");
        std::fs::create_dir_all(&data).map_err(|source| Error::Io {
            what: format!("create {}", data.display()),
            source,
        })?;
        let s3_port = free_port()?;
        let mut args = vec![
            "server".to_string(),
            format!("-dir={}", data.display()),
            format!("-ip={ip}"),
            format!("-ip.bind={ip}"),
            "-filer".into(),
            "-s3".into(),
            format!("-s3.port={s3_port}"),
            format!("-s3.config={}", config.display()),
            "-s3.port.iceberg=0".into(),
            "-s3.port.lance=0".into(),
            "-volume.max=0".into(),
        ];
        for flag in [
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "s3.port.grpc",
        ] {
            args.push(format!("-{flag}={}", free_port()?));
        }
        let process = Process::spawn("seaweedfs", &weed, &args, dir.path().join("weed.log"))?;
        let server = Self {
            process,
            endpoint: format!("http://{ip}:{s3_port}"),
            _dir: dir,
        };
        let addr: std::net::SocketAddr = format!("{ip}:{s3_port}")
            .parse()
            .map_err(|e| Error::Other(format!("S3 address {ip}:{s3_port}: {e}")))?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            // Answered (any status): the gateway is up; it needs its filer too, which the
            // first upload waits for.
            if crate::http_get(addr, "/").await.is_ok() {
                return Ok(server);
            }
            if tokio::time::Instant::now() > deadline {
                return Err(Error::Other(format!(
                    "SeaweedFS's S3 gateway did not answer on {addr} within a minute:\n{}",
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
