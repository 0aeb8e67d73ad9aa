//! Continuous backup to S3-compatible object storage: WAL archiving, base backups, restore
//! and retention, through the `object_store` crate (SigV4, multipart uploads).
//!
//! PostgreSQL archives every finished WAL file with `archive_command =
//! 'steward-pg-instance wal-push %p %f'` ([`push_wal`]) and, restoring, reads them back with
//! `restore_command = 'steward-pg-instance wal-fetch %f %p'` ([`fetch_wal`]). Base backups
//! are `pg_basebackup` tar streams ([`base_backup`]). Under the cluster's `path`:
//!
//! ```text
//! system                              the system identifier archiving here now ([`claim`])
//! wal/<system>/<WAL file name>.gz     every archived file (segments, .history, .backup) of
//!                                     the PostgreSQL system <system>, gzip
//! base/<backup>/data.tar.gz           the data directory (the WAL to make it consistent is
//!                                     archived before the backup ends, read back in restore)
//! base/<backup>/backup.json           [`BaseBackup`]; written last: a backup without it is
//!                                     incomplete and never restored
//! ```
//!
//! WAL is kept per PostgreSQL system (the identifier `initdb` gives a cluster, which its
//! replicas, backups and restores share): `pg_upgrade` makes a new system that starts again
//! on timeline 1, and its timeline history files and segments must never meet the old
//! system's (issue #37, item 1: a promotion after an upgrade wrote `00000002.history` over
//! the old one's and archiving stopped for good; a restore followed the old system's
//! timelines). `system` says which system may archive to the path: another one is refused
//! ([`Error::OtherSystem`]: two clusters writing to one path), except the system a major
//! upgrade made of it ([`UPGRADED_FROM`] in its data directory), which takes the path over.
//! A WAL file is never overwritten with different contents: pushing a name that exists with
//! the same contents succeeds (PostgreSQL retries after a crash), with different contents
//! fails — but for a segment of a timeline older than the server's ([`stale_copy`]): the
//! archive's copy was written by that timeline's primary, and the one a later primary holds
//! (left in `pg_wal` by its own past as that timeline's primary, or by a rewind, and marked
//! for archiving by PostgreSQL at the first checkpoint after a promotion) differs only past
//! where the history left that timeline, which no recovery reads. Refusing it stopped
//! archiving for good (found by the fault campaign: a backup then waited for its WAL for
//! ever).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;

use bytes::Bytes;
use flate2::Compression;
use flate2::read::GzDecoder;
use flate2::write::GzEncoder;
use futures::TryStreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{Certificate, ClientOptions, ObjectStore, ObjectStoreExt, WriteMultipart};
use serde::{Deserialize, Serialize};
use tokio::io::AsyncReadExt;

use crate::contract::{self, Lsn, STORE_FIELDS};
use crate::postgres::Paths;

/// What can go wrong talking to the object store or running the backup programs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("object store configuration: {0}")]
    Config(String),
    #[error("object store {what}: {source}")]
    Store {
        what: String,
        #[source]
        source: object_store::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "WAL file {0} is already archived with different contents: is another cluster archiving to this path?"
    )]
    Conflict(String),
    #[error(
        "the archive belongs to PostgreSQL system {archive}, this data directory to system {ours}: another cluster archives to this path (give each cluster its own path)"
    )]
    OtherSystem { archive: String, ours: String },
    #[error("pg_basebackup failed ({status}): {output}")]
    BaseBackup {
        status: std::process::ExitStatus,
        output: String,
    },
    #[error("no complete base backup {0}")]
    NoBackup(String),
    #[error("{0}")]
    Invalid(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

fn store_err(what: impl Into<String>) -> impl FnOnce(object_store::Error) -> Error {
    let what = what.into();
    move |source| Error::Store { what, source }
}

/// Where a cluster's backups are: read from `<prefix>_ENDPOINT`, `_BUCKET`, `_PATH`,
/// `_REGION`, `_ACCESS_KEY_ID` and `_SECRET_ACCESS_KEY` ([`contract::BACKUP_ENV`] or
/// [`contract::RECOVERY_ENV`]).
#[derive(Clone)]
pub struct StoreConfig {
    pub endpoint: String,
    pub bucket: String,
    pub path: String,
    pub region: String,
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl std::fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.url())
    }
}

impl StoreConfig {
    /// The configuration in the environment under `prefix`: `None` when its endpoint is not
    /// set (no backup configured), an error when it is but another field is missing.
    ///
    /// # Errors
    /// [`Error::Config`] naming the missing variable.
    pub fn from_env(prefix: &str) -> Result<Option<Self>, Error> {
        Self::from_vars(prefix, |name| std::env::var(name).ok())
    }

    /// [`StoreConfig::from_env`] with `var` for the environment.
    ///
    /// # Errors
    /// [`Error::Config`] naming the missing variable.
    pub fn from_vars(
        prefix: &str,
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, Error> {
        let get = |field: &str| var(&contract::store_env(prefix, field));
        if get(STORE_FIELDS[0]).is_none() {
            return Ok(None);
        }
        let mut values = Vec::new();
        for field in STORE_FIELDS {
            let value = match (field, get(field)) {
                ("REGION", None) => "us-east-1".to_string(),
                ("PATH", None) => String::new(),
                (_, Some(v)) => v,
                (_, None) => {
                    return Err(Error::Config(format!(
                        "{} is not set",
                        contract::store_env(prefix, field)
                    )));
                }
            };
            values.push(value);
        }
        let [
            endpoint,
            bucket,
            path,
            region,
            access_key_id,
            secret_access_key,
        ] = <[String; 6]>::try_from(values).map_err(|_| Error::Config("fields".into()))?;
        Ok(Some(Self {
            endpoint,
            bucket,
            path: path.trim_matches('/').to_string(),
            region,
            access_key_id,
            secret_access_key,
        }))
    }

    /// `s3://<bucket>/<path>`.
    pub fn url(&self) -> String {
        format!("s3://{}/{}", self.bucket, self.path)
    }
}

/// TLS trust for `endpoint`: none over plain HTTP; over HTTPS the system's CA store, or
/// Mozilla's roots (built in) when the PostgreSQL image has none (PostgreSQL images often do
/// not install `ca-certificates`, and the client cannot be built without a trust store).
fn client_options(endpoint: &str) -> Result<ClientOptions, Error> {
    let options = ClientOptions::new();
    if endpoint.starts_with("http://") {
        return Ok(options.with_no_system_certificates(true));
    }
    if !rustls_native_certs::load_native_certs().certs.is_empty() {
        return Ok(options);
    }
    let mut options = options.with_no_system_certificates(true);
    for der in webpki_root_certs::TLS_SERVER_ROOT_CERTS {
        let cert = Certificate::from_der(der).map_err(|e| Error::Config(e.to_string()))?;
        options = options.with_root_certificate(cert);
    }
    Ok(options)
}

/// A cluster's backup location.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    config: StoreConfig,
}

/// A complete base backup, as `backup.json` describes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BaseBackup {
    pub name: String,
    pub timeline: u32,
    pub begin_lsn: Lsn,
    /// The WAL file the backup begins in: the oldest one a restore of it needs.
    pub begin_wal: String,
    /// RFC 3339.
    pub started_at: String,
    /// RFC 3339; the backup is consistent at the latest by this time, so any later time is a
    /// valid recovery target.
    pub completed_at: String,
    /// Compressed size in bytes.
    pub size: u64,
    /// The PostgreSQL system it is a copy of, whose WAL (`wal/<system>/`) a restore replays;
    /// absent in backups taken before WAL was kept per system.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_identifier: Option<String>,
    /// The PostgreSQL major of the copy (its `PG_VERSION`): only that major's binaries can
    /// start on it; absent in backups taken before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub major: Option<u32>,
}

impl Store {
    /// # Errors
    /// [`Error::Config`] for an endpoint or credentials the S3 client refuses.
    pub fn open(config: StoreConfig) -> Result<Self, Error> {
        // reqwest's rustls takes the process's provider; kube's is ring too.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let inner = AmazonS3Builder::new()
            .with_client_options(client_options(&config.endpoint)?)
            .with_endpoint(&config.endpoint)
            .with_allow_http(config.endpoint.starts_with("http://"))
            .with_bucket_name(&config.bucket)
            .with_region(&config.region)
            .with_access_key_id(&config.access_key_id)
            .with_secret_access_key(&config.secret_access_key)
            .with_virtual_hosted_style_request(false)
            .build()
            .map_err(|e| Error::Config(e.to_string()))?;
        Ok(Self {
            inner: Arc::new(inner),
            config,
        })
    }

    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    fn path(&self, rest: &str) -> ObjectPath {
        if self.config.path.is_empty() {
            ObjectPath::from(rest)
        } else {
            ObjectPath::from(format!("{}/{rest}", self.config.path))
        }
    }

    async fn get(&self, path: &ObjectPath) -> Result<Option<Bytes>, Error> {
        match self.inner.get(path).await {
            Ok(got) => Ok(Some(
                got.bytes()
                    .await
                    .map_err(store_err(format!("read {path}")))?,
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(store_err(format!("get {path}"))(e)),
        }
    }

    async fn put(&self, path: &ObjectPath, body: impl Into<Bytes>) -> Result<(), Error> {
        self.inner
            .put(path, body.into().into())
            .await
            .map_err(store_err(format!("put {path}")))?;
        Ok(())
    }

    /// One level under `dir/`: the objects' names and the "directories'" names, relative.
    async fn listing(&self, dir: &str) -> Result<(Vec<String>, Vec<String>), Error> {
        let prefix = self.path(dir);
        let listed = self
            .inner
            .list_with_delimiter(Some(&prefix))
            .await
            .map_err(store_err(format!("list {prefix}")))?;
        let name = |p: &ObjectPath| p.filename().map(str::to_string);
        Ok((
            listed
                .objects
                .iter()
                .filter_map(|o| name(&o.location))
                .collect(),
            listed.common_prefixes.iter().filter_map(name).collect(),
        ))
    }

    /// Names of everything under `dir/` (one level, relative).
    async fn list(&self, dir: &str) -> Result<Vec<String>, Error> {
        let (objects, dirs) = self.listing(dir).await?;
        Ok(objects.into_iter().chain(dirs).collect())
    }

    async fn delete(&self, path: &ObjectPath) -> Result<(), Error> {
        match self.inner.delete(path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(store_err(format!("delete {path}"))(e)),
        }
    }

    /// Every complete base backup, oldest first.
    ///
    /// # Errors
    /// When the store cannot be listed or a `backup.json` is unreadable.
    pub async fn base_backups(&self) -> Result<Vec<BaseBackup>, Error> {
        let mut backups = Vec::new();
        for name in self.list("base").await? {
            let manifest = self.path(&format!("base/{name}/backup.json"));
            let Some(bytes) = self.get(&manifest).await? else {
                continue; // incomplete
            };
            let backup: BaseBackup = serde_json::from_slice(&bytes)
                .map_err(|e| Error::Invalid(format!("{manifest}: {e}")))?;
            backups.push(backup);
        }
        backups.sort_by(|a, b| a.completed_at.cmp(&b.completed_at));
        Ok(backups)
    }
}

impl Store {
    /// The names of the WAL files archived for `system` (segments, `.partial`, `.history`,
    /// `.backup`), without `.gz`, sorted.
    ///
    /// # Errors
    /// When the store cannot be listed.
    pub async fn wal_files(&self, system: &str) -> Result<Vec<String>, Error> {
        let mut names: Vec<String> = self
            .list(&wal_dir(system))
            .await?
            .into_iter()
            .map(|n| n.trim_end_matches(".gz").to_string())
            .collect();
        names.sort();
        Ok(names)
    }

    /// The system identifier the archive's `system` object names, if any.
    ///
    /// # Errors
    /// When the store cannot be read.
    pub async fn system(&self) -> Result<Option<String>, Error> {
        Ok(self
            .get(&self.path(SYSTEM))
            .await?
            .map(|b| String::from_utf8_lossy(&b).trim().to_string()))
    }
}

impl Store {
    /// The fence a cluster promoted from this path's archive wrote ([`contract::FENCE_OBJECT`]).
    ///
    /// # Errors
    /// When the store cannot be read or the fence is not one.
    pub async fn fence(&self) -> Result<Option<contract::Fence>, Error> {
        let path = self.path(contract::FENCE_OBJECT);
        self.get(&path)
            .await?
            .map(|bytes| {
                serde_json::from_slice(&bytes).map_err(|e| Error::Invalid(format!("{path}: {e}")))
            })
            .transpose()
    }

    /// Whether a standby follows (or followed) this path ([`contract::FOLLOWED_OBJECT`]).
    ///
    /// # Errors
    /// When the store cannot be read.
    pub async fn followed(&self) -> Result<bool, Error> {
        Ok(self
            .get(&self.path(contract::FOLLOWED_OBJECT))
            .await?
            .is_some())
    }

    /// Records that the standby `by` follows this path ([`contract::FOLLOWED_OBJECT`]).
    ///
    /// # Errors
    /// When the store refuses it.
    pub async fn set_followed(&self, by: &str) -> Result<(), Error> {
        let path = self.path(contract::FOLLOWED_OBJECT);
        let body = serde_json::json!({"by": by, "at": jiff::Timestamp::now().to_string()});
        self.put(&path, body.to_string()).await
    }

    /// Writes `fence` ([`contract::FENCE_OBJECT`]) under this path.
    ///
    /// # Errors
    /// When the store refuses it.
    pub async fn set_fence(&self, fence: &contract::Fence) -> Result<(), Error> {
        let path = self.path(contract::FENCE_OBJECT);
        let body = serde_json::to_vec(fence).map_err(|e| Error::Invalid(e.to_string()))?;
        self.put(&path, body).await
    }
}

/// The object naming the system that archives to a path.
const SYSTEM: &str = "system";

/// A file a major upgrade writes into the new data directory: the system identifier of the
/// cluster it was made from, which lets the new system take over that system's archive path.
pub const UPGRADED_FROM: &str = "steward-upgraded-from-system";

fn wal_dir(system: &str) -> String {
    format!("wal/{system}")
}

/// The system identifier of the PostgreSQL cluster in `pgdata`: the first field of
/// `global/pg_control` (a `uint64` in the machine's byte order), as `pg_controldata` prints
/// it ("Database system identifier").
///
/// # Errors
/// When `global/pg_control` cannot be read or is too short.
pub fn system_identifier(pgdata: &Path) -> Result<String, Error> {
    let control = pgdata.join("global/pg_control");
    let bytes = std::fs::read(&control).map_err(io(format!("read {}", control.display())))?;
    let first: [u8; 8] = bytes
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| Error::Invalid(format!("{} is too short", control.display())))?;
    Ok(u64::from_ne_bytes(first).to_string())
}

/// Whether the system `ours` may archive to a path whose `system` object names `archive`
/// (`None`: nobody archives there yet), given the system it was upgraded from, if any.
fn may_archive(archive: Option<&str>, ours: &str, upgraded_from: Option<&str>) -> bool {
    match archive {
        None => true,
        Some(a) => a == ours || upgraded_from == Some(a),
    }
}

/// The system of `pgdata`, once the archive's `system` object names it: written when there
/// is none, and when it names the system a major upgrade made this one of.
///
/// # Errors
/// [`Error::OtherSystem`] when another system archives there; when the store fails.
pub async fn claim(store: &Store, pgdata: &Path) -> Result<String, Error> {
    let ours = system_identifier(pgdata)?;
    let archive = store.system().await?;
    if archive.as_deref() == Some(ours.as_str()) {
        return Ok(ours);
    }
    let upgraded_from = std::fs::read_to_string(pgdata.join(UPGRADED_FROM))
        .ok()
        .map(|s| s.trim().to_string());
    if !may_archive(archive.as_deref(), &ours, upgraded_from.as_deref()) {
        return Err(Error::OtherSystem {
            archive: archive.unwrap_or_default(),
            ours,
        });
    }
    if let Some(previous) = &archive {
        tracing::info!(%previous, system = %ours, "this cluster was upgraded from the system that archived here: its WAL goes to wal/{ours}/ from now on");
    }
    let path = store.path(SYSTEM);
    store.put(&path, format!("{ours}\n")).await?;
    Ok(ours)
}

/// Bytes in a WAL segment (PostgreSQL's default).
pub const SEGMENT_SIZE: u64 = 16 * 1024 * 1024;
const SEGMENTS_PER_ID: u64 = 0x1_0000_0000 / SEGMENT_SIZE;

/// `(timeline, segment number)` of a WAL segment's file name; `None` for any other file.
pub fn parse_segment(name: &str) -> Option<(u32, u64)> {
    if name.len() != 24 || !name.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let timeline = u32::from_str_radix(&name[..8], 16).ok()?;
    let log = u64::from_str_radix(&name[8..16], 16).ok()?;
    let seg = u64::from_str_radix(&name[16..24], 16).ok()?;
    Some((timeline, log * SEGMENTS_PER_ID + seg))
}

fn segment_name(timeline: u32, segment: u64) -> String {
    format!(
        "{timeline:08X}{:08X}{:08X}",
        segment / SEGMENTS_PER_ID,
        segment % SEGMENTS_PER_ID
    )
}

/// The `(parent timeline, switch point)` lines of a timeline history file
/// (`1\t0/5000060\tno recovery target specified`), oldest first.
pub fn parse_history(history: &str) -> Vec<(u32, Lsn)> {
    history
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let timeline = fields.next()?.parse().ok()?;
            let lsn = fields.next()?.parse().ok()?;
            Some((timeline, lsn))
        })
        .collect()
}

/// The WAL segments a recovery from segment `start` (a file name) to the newest archived
/// segment of the newest timeline reads that are not in `archived`: on each timeline of the
/// newest one's `history` ([`parse_history`]), from where the recovery enters it up to the
/// segment before the one holding its switch point (which it reads from the next timeline,
/// whose copy holds the old timeline's WAL up to the switch). Empty: the archive has no gap.
pub fn wal_gaps(archived: &[String], start: &str, history: &[(u32, Lsn)]) -> Vec<String> {
    let Some((start_timeline, mut next)) = parse_segment(start) else {
        return vec![start.to_string()];
    };
    let segments: Vec<(u32, u64)> = archived.iter().filter_map(|n| parse_segment(n)).collect();
    let Some(newest) = segments.iter().map(|(t, _)| *t).max() else {
        return vec![start.to_string()];
    };
    let Some(end) = segments
        .iter()
        .filter(|(t, _)| *t == newest)
        .map(|(_, s)| *s)
        .max()
    else {
        return Vec::new();
    };
    // Each timeline with the segment its successor starts at; the newest runs to the end.
    let mut path: Vec<(u32, u64)> = history
        .iter()
        .map(|(t, lsn)| (*t, lsn.0 / SEGMENT_SIZE))
        .filter(|(t, _)| *t >= start_timeline)
        .collect();
    path.push((newest, end + 1));
    let mut missing = Vec::new();
    for (timeline, until) in path {
        while next < until {
            let name = segment_name(timeline, next);
            if !archived.contains(&name) {
                missing.push(name);
            }
            next += 1;
        }
    }
    missing
}

/// A former primary's WAL files that PostgreSQL had not archived when it stopped
/// (`pg_wal/archive_status/<file>.ready` under `pgdata`): pushed to `store`, oldest first,
/// and marked `.done`. A replica's PostgreSQL does not archive, and the new primary never
/// archives the old timeline's segments it received by streaming, so without this a primary
/// killed while its archiver was behind leaves a gap in the archive. Returns what was pushed.
/// A file the archive holds with other contents is left there and reported as an error in the
/// log (it is not this cluster's history to overwrite).
///
/// # Errors
/// When a file cannot be read or the store fails (nothing is marked done for it: tried again).
pub async fn push_ready(store: &Store, pgdata: &Path) -> Result<Vec<String>, Error> {
    let status = pgdata.join("pg_wal/archive_status");
    let mut ready: Vec<String> = match std::fs::read_dir(&status) {
        Ok(entries) => entries
            .flatten()
            .filter_map(|e| {
                e.file_name()
                    .to_string_lossy()
                    .strip_suffix(".ready")
                    .map(str::to_string)
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(format!("read {}", status.display()))(e)),
    };
    ready.sort();
    let mut pushed = Vec::new();
    for name in ready {
        let file = pgdata.join("pg_wal").join(&name);
        if file.exists() {
            match push_wal(store, pgdata, &file, &name).await {
                Ok(()) => pushed.push(name.clone()),
                Err(Error::Conflict(n)) => {
                    tracing::error!(file = %n, "a WAL file left by the former primary is archived already with other contents: kept the archived one");
                }
                Err(e @ Error::OtherSystem { .. }) => {
                    // A system the cluster left behind (a major upgrade made a new one):
                    // its WAL is no restore's any more, and this copy is replaced by a clone.
                    tracing::warn!(error = %e, "not archiving the WAL left by a former primary of another system");
                    return Ok(pushed);
                }
                Err(e) => return Err(e),
            }
        }
        let flag = status.join(format!("{name}.ready"));
        std::fs::rename(&flag, status.join(format!("{name}.done")))
            .map_err(io(format!("rename {}", flag.display())))?;
    }
    Ok(pushed)
}

/// `wal-push`: archives the WAL file `file` (PostgreSQL's `%p`, relative to the data
/// directory `pgdata`) as `name` (`%f`), under the data directory's system ([`claim`]).
///
/// # Errors
/// When it cannot be read or stored, [`Error::Conflict`] or [`Error::OtherSystem`].
pub async fn push_wal(store: &Store, pgdata: &Path, file: &Path, name: &str) -> Result<(), Error> {
    let system = claim(store, pgdata).await?;
    let file = pgdata.join(file);
    let data = tokio::fs::read(&file)
        .await
        .map_err(io(format!("read {}", file.display())))?;
    let compressed = tokio::task::spawn_blocking(move || gzip(&data))
        .await
        .map_err(|e| Error::Invalid(e.to_string()))??;
    let path = store.path(&format!("{}/{name}.gz", wal_dir(&system)));
    if let Some(existing) = store.get(&path).await? {
        if gunzip(&existing).ok() == gunzip(&compressed).ok() {
            return Ok(());
        }
        let newest = newest_timeline(pgdata);
        if stale_copy(name, newest) {
            tracing::warn!(
                file = name,
                timeline = newest,
                "the archive holds this segment of an earlier timeline as its primary wrote it; this server's copy differs past where the history left that timeline: the archived one is kept"
            );
            return Ok(());
        }
        return Err(Error::Conflict(name.to_string()));
    }
    store.put(&path, compressed).await
}

/// Whether WAL file `name` is a segment of a timeline older than `timeline` (the server's):
/// a copy of it that differs from the archived one is stale, not a second writer (see the
/// module's documentation). History files, `.partial` and `.backup` files and segments of
/// the server's own timeline are never stale: two different copies of those are a conflict.
pub fn stale_copy(name: &str, timeline: u32) -> bool {
    name.len() == 24
        && name.bytes().all(|b| b.is_ascii_hexdigit())
        && u32::from_str_radix(&name[..8], 16).is_ok_and(|t| t < timeline)
}

/// The newest timeline whose history file is in the data directory `pgdata`'s `pg_wal` (a
/// primary's own timeline: its promotion wrote it there), 1 when there is none.
pub fn newest_timeline(pgdata: &Path) -> u32 {
    std::fs::read_dir(pgdata.join("pg_wal"))
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let tli = name.strip_suffix(".history")?;
                    (tli.len() == 8)
                        .then(|| u32::from_str_radix(tli, 16).ok())
                        .flatten()
                })
                .max()
                .unwrap_or(1)
        })
        .unwrap_or(1)
}

/// `wal-fetch`: restores the WAL file `name` archived for `system` (the data directory's
/// [`system_identifier`]: a restored copy reads its own system's WAL, never a later system's
/// of the same path) to `dest`. `Ok(false)` when the archive does not have it (PostgreSQL
/// asks for files that may not exist).
///
/// # Errors
/// When the store fails or the file cannot be written.
pub async fn fetch_wal(
    store: &Store,
    system: &str,
    name: &str,
    dest: &Path,
) -> Result<bool, Error> {
    let path = store.path(&format!("{}/{name}.gz", wal_dir(system)));
    let Some(compressed) = store.get(&path).await? else {
        return Ok(false);
    };
    let data = tokio::task::spawn_blocking(move || gunzip(&compressed))
        .await
        .map_err(|e| Error::Invalid(e.to_string()))??;
    let partial = dest.with_extension("steward-partial");
    tokio::fs::write(&partial, data)
        .await
        .map_err(io(format!("write {}", partial.display())))?;
    tokio::fs::rename(&partial, dest)
        .await
        .map_err(io(format!("rename to {}", dest.display())))?;
    Ok(true)
}

fn gzip(data: &[u8]) -> Result<Vec<u8>, Error> {
    let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
    encoder.write_all(data).map_err(io("compress"))?;
    encoder.finish().map_err(io("compress"))
}

fn gunzip(data: &[u8]) -> Result<Vec<u8>, Error> {
    let mut out = Vec::new();
    GzDecoder::new(data)
        .read_to_end(&mut out)
        .map_err(io("decompress"))?;
    Ok(out)
}

/// The WAL file name of `lsn` on `timeline` (16 MiB segments, PostgreSQL's default).
pub fn wal_file_name(timeline: u32, lsn: Lsn) -> String {
    const SEGMENT: u64 = 16 * 1024 * 1024;
    let segments_per_id = 0x1_0000_0000 / SEGMENT;
    let segment = lsn.0 / SEGMENT;
    format!(
        "{timeline:08X}{:08X}{:08X}",
        segment / segments_per_id,
        segment % segments_per_id
    )
}

/// How many of a base backup's first bytes are kept to read its `backup_label` from.
const HEAD: usize = 64 * 1024;

/// The start of base backup `label` (its WAL location and timeline) from its `backup_label`,
/// which the server sends as the first member of the tar `pg_basebackup` streams (`head`: the
/// tar's first bytes). `pg_basebackup -X none` does not print the start, and the backup
/// history file in `pg_wal` ([`backup_start`]) can be gone by the time it is read: once
/// archived, the end of any other base backup (a replica cloning the primary) removes it.
fn label_start(head: &[u8], label: &str) -> Option<(Lsn, u32)> {
    let mut archive = tar::Archive::new(head);
    let mut first = archive.entries().ok()?.next()?.ok()?;
    if first.path().ok()?.as_os_str() != "backup_label" {
        return None;
    }
    let mut text = String::new();
    first.read_to_string(&mut text).ok()?;
    parse_backup_history(&text, label)
}

/// The start of base backup `label` (its WAL location and timeline), from the backup history
/// file PostgreSQL writes into `pg_wal` when a backup ends (`<segment>.<offset>.backup`, kept
/// there until the next backup ends): `pg_basebackup -X none` does not print it. The newest
/// if several carry the label (an earlier attempt under the same name).
///
/// # Errors
/// [`Error::Invalid`] when no history file names `label`.
fn backup_start(pgdata: &Path, label: &str) -> Result<(Lsn, u32), Error> {
    let dir = pgdata.join("pg_wal");
    let entries = std::fs::read_dir(&dir).map_err(io(format!("list {}", dir.display())))?;
    entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".backup"))
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|text| parse_backup_history(&text, label))
        .max()
        .ok_or_else(|| {
            Error::Invalid(format!(
                "no backup history file in {} names the backup {label}",
                dir.display()
            ))
        })
}

/// `START WAL LOCATION: 0/2000028 (file …)` and `START TIMELINE: 1` of a backup history file
/// whose `LABEL:` is `label`.
fn parse_backup_history(text: &str, label: &str) -> Option<(Lsn, u32)> {
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .map(str::trim)
    };
    if field("LABEL:")? != label {
        return None;
    }
    let lsn = field("START WAL LOCATION:")?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let timeline = field("START TIMELINE:")?.parse().ok()?;
    Some((lsn, timeline))
}

/// Takes a base backup of the local instance (over its socket, as the superuser) named
/// `name`, streams it compressed into the store and writes its `backup.json` last.
///
/// # Errors
/// When `pg_basebackup` fails or the upload does; an incomplete upload is removed.
pub async fn base_backup(store: &Store, paths: &Paths, name: &str) -> Result<BaseBackup, Error> {
    let started_at = jiff::Timestamp::now().to_string();
    let data_path = store.path(&format!("base/{name}/data.tar.gz"));
    let mut child = tokio::process::Command::new("pg_basebackup")
        .arg("-h")
        .arg(&paths.run_dir)
        .args(["-p", &contract::PG_PORT.to_string(), "-U", "postgres"])
        // `-X none`: the WAL that makes the copy consistent is archived, and pg_basebackup
        // ends only once it is (`pg_backup_stop` waits for the archiver); a restore reads it
        // back through `restore_command`. `-X fetch` (the only other choice writing a tar to
        // stdout) fetches that WAL at the end, from `pg_wal`, which a busy primary may have
        // recycled by then: the backup failed.
        .args(["-D", "-", "-F", "tar", "-X", "none", "-c", "fast", "-v"])
        .args(["-l", name, "--no-password"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(io("start pg_basebackup"))?;
    let (Some(mut stdout), Some(mut stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(Error::Invalid("pg_basebackup has no output pipes".into()));
    };
    let stderr_task = tokio::spawn(async move {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text).await;
        text
    });
    let upload = store
        .inner
        .put_multipart(&data_path)
        .await
        .map_err(store_err(format!("start upload {data_path}")))?;
    let mut writer = WriteMultipart::new(upload);
    let mut encoder = GzEncoder::new(Vec::new(), Compression::fast());
    let mut buf = vec![0u8; 256 * 1024];
    let mut size = 0u64;
    // The tar's first bytes, for its `backup_label` (the start of the backup).
    let mut head: Vec<u8> = Vec::with_capacity(HEAD);
    let streamed: Result<(), Error> = async {
        loop {
            let n = stdout
                .read(&mut buf)
                .await
                .map_err(io("read pg_basebackup's output"))?;
            if n == 0 {
                break;
            }
            if head.len() < HEAD {
                head.extend_from_slice(&buf[..n.min(HEAD - head.len())]);
            }
            encoder.write_all(&buf[..n]).map_err(io("compress"))?;
            let out = std::mem::take(encoder.get_mut());
            size += out.len() as u64;
            writer
                .wait_for_capacity(4)
                .await
                .map_err(store_err("upload"))?;
            writer.write(&out);
        }
        Ok(())
    }
    .await;
    let status = child.wait().await.map_err(io("wait for pg_basebackup"))?;
    let output = stderr_task.await.unwrap_or_default();
    let failed = match (&streamed, status.success()) {
        (Ok(()), true) => None,
        (Err(e), _) => Some(Error::Invalid(e.to_string())),
        (Ok(()), false) => Some(Error::BaseBackup {
            status,
            output: output.clone(),
        }),
    };
    if let Some(e) = failed {
        let _ = writer.abort().await;
        return Err(e);
    }
    let rest = encoder.finish().map_err(io("compress"))?;
    size += rest.len() as u64;
    writer.write(&rest);
    writer
        .finish()
        .await
        .map_err(store_err(format!("finish upload {data_path}")))?;
    let (begin_lsn, timeline) = match label_start(&head, name) {
        Some(start) => start,
        None => backup_start(&paths.pgdata, name)?,
    };
    let backup = BaseBackup {
        name: name.to_string(),
        timeline,
        begin_lsn,
        begin_wal: wal_file_name(timeline, begin_lsn),
        started_at,
        completed_at: jiff::Timestamp::now().to_string(),
        size,
        system_identifier: Some(system_identifier(&paths.pgdata)?),
        major: crate::upgrade::data_major(&paths.pgdata),
    };
    let manifest = store.path(&format!("base/{name}/backup.json"));
    let json = serde_json::to_vec_pretty(&backup).map_err(|e| Error::Invalid(e.to_string()))?;
    store.put(&manifest, json).await?;
    Ok(backup)
}

/// The backup to restore for a recovery to `target` (RFC 3339; `None`: the end of the
/// archive) by the binaries of PostgreSQL `major` (`None`: any): the newest that completed
/// before it, of that major. A backup of another major is never chosen (PostgreSQL would
/// refuse its data directory): across a major upgrade, a time before it is restored by the
/// old major, a time after it only once the new major's first backup completed.
///
/// # Errors
/// [`Error::NoBackup`] when none qualifies, saying which major the newest backup before the
/// target is of when that is what excludes it; [`Error::Invalid`] for a bad target.
pub fn choose_backup<'a>(
    backups: &'a [BaseBackup],
    target: Option<&str>,
    major: Option<u32>,
) -> Result<&'a BaseBackup, Error> {
    let target = target
        .map(|t| {
            t.parse::<jiff::Timestamp>()
                .map_err(|e| Error::Invalid(format!("recovery target time {t:?}: {e}")))
        })
        .transpose()?;
    let before_target = |b: &&BaseBackup| {
        let completed = b.completed_at.parse::<jiff::Timestamp>().ok();
        match (target, completed) {
            (None, _) => true,
            (Some(t), Some(c)) => c < t,
            (Some(_), None) => false,
        }
    };
    let of_major = |b: &&BaseBackup| match (major, b.major) {
        (Some(wanted), Some(copy)) => wanted == copy,
        _ => true,
    };
    let newest = |a: &&BaseBackup, b: &&BaseBackup| a.completed_at.cmp(&b.completed_at);
    let when = match target {
        Some(t) => format!("completed before {t}"),
        None => "in the object store".to_string(),
    };
    match backups
        .iter()
        .filter(before_target)
        .filter(of_major)
        .max_by(newest)
    {
        Some(chosen) => Ok(chosen),
        None => Err(Error::NoBackup(
            match (major, backups.iter().filter(before_target).max_by(newest)) {
                (Some(wanted), Some(other)) => format!(
                    "of PostgreSQL {wanted} {when} (the newest, {}, is of PostgreSQL {}: restore it with spec.version {})",
                    other.name,
                    other.major.unwrap_or_default(),
                    other.major.unwrap_or_default()
                ),
                _ => when,
            },
        )),
    }
}

/// Downloads `backup` and unpacks it into the (empty) data directory.
///
/// # Errors
/// When the download or the unpacking fails.
pub async fn restore(store: &Store, backup: &BaseBackup, paths: &Paths) -> Result<(), Error> {
    let path = store.path(&format!("base/{}/data.tar.gz", backup.name));
    let download = paths.run_dir.join("restore.tar.gz");
    let got = store
        .inner
        .get(&path)
        .await
        .map_err(store_err(format!("get {path}")))?;
    let mut stream = got.into_stream();
    let mut file = tokio::fs::File::create(&download)
        .await
        .map_err(io(format!("create {}", download.display())))?;
    while let Some(chunk) = stream
        .try_next()
        .await
        .map_err(store_err(format!("read {path}")))?
    {
        tokio::io::AsyncWriteExt::write_all(&mut file, &chunk)
            .await
            .map_err(io(format!("write {}", download.display())))?;
    }
    drop(file);
    let pgdata = paths.pgdata.clone();
    let archive = download.clone();
    let unpacked = tokio::task::spawn_blocking(move || -> Result<(), Error> {
        use std::os::unix::fs::PermissionsExt;
        let file = std::fs::File::open(&archive).map_err(io("open the downloaded backup"))?;
        let mut tar = tar::Archive::new(GzDecoder::new(std::io::BufReader::new(file)));
        tar.set_preserve_permissions(true);
        tar.unpack(&pgdata)
            .map_err(io(format!("unpack into {}", pgdata.display())))?;
        std::fs::set_permissions(&pgdata, std::fs::Permissions::from_mode(0o700))
            .map_err(io("chmod the data directory"))
    })
    .await
    .map_err(|e| Error::Invalid(e.to_string()))?;
    let _ = std::fs::remove_file(&download);
    unpacked
}

/// What retention deletes when `keep` base backups are kept, given the WAL files archived
/// for each system (`wal`: system → file names) and the system archiving now (`current`):
/// the older backups; in each system with a kept backup, every WAL segment (and `.backup`
/// file) before the oldest kept backup's first WAL file, on any timeline (timeline history
/// files are kept: they are small and every restore needs them); a system with no kept
/// backup that is not `current` (one a major upgrade left behind), all of its WAL, since no
/// restore can start from it. WAL files are returned as `<system>/<file>`.
pub fn retention_plan(
    backups: &[BaseBackup],
    wal: &BTreeMap<String, Vec<String>>,
    current: Option<&str>,
    keep: usize,
) -> (Vec<String>, Vec<String>) {
    let mut newest_first: Vec<&BaseBackup> = backups.iter().collect();
    newest_first.sort_by(|a, b| b.completed_at.cmp(&a.completed_at));
    if keep == 0 || newest_first.len() <= keep {
        return (Vec::new(), Vec::new());
    }
    let (kept, dropped) = newest_first.split_at(keep);
    // A kept backup that does not say its system could need any system's WAL.
    let all_known = kept.iter().all(|b| b.system_identifier.is_some());
    // Compare log and segment numbers (the name without its timeline).
    let position = |name: &str| name.get(8..24).map(str::to_string);
    let mut old_wal = Vec::new();
    for (system, files) in wal {
        let oldest_kept = kept
            .iter()
            .rev()
            .find(|b| b.system_identifier.as_deref() == Some(system.as_str()));
        let horizon = match oldest_kept {
            Some(backup) => match position(&backup.begin_wal) {
                Some(horizon) => Some(horizon),
                None => continue,
            },
            None if all_known && current != Some(system.as_str()) => None,
            None => continue,
        };
        old_wal.extend(
            files
                .iter()
                .filter(|w| {
                    let Some(horizon) = &horizon else {
                        return true; // a system left behind: all of it
                    };
                    let file = w.trim_end_matches(".gz");
                    // `get`, not an index: any object can be put under `wal/`, and a name whose
                    // 24th byte is inside a multi-byte character must not panic the backup task.
                    let is_segment_or_label = file
                        .get(..24)
                        .is_some_and(|prefix| prefix.chars().all(|c| c.is_ascii_hexdigit()))
                        && !file.ends_with(".history");
                    is_segment_or_label && position(file).is_some_and(|p| &p < horizon)
                })
                .map(|f| format!("{system}/{f}")),
        );
    }
    (dropped.iter().map(|b| b.name.clone()).collect(), old_wal)
}

/// Applies [`retention_plan`]: the chosen backups' manifests first (so a half-deleted
/// backup is never taken for complete), then their data, then the WAL. Objects directly
/// under `wal/` (the layout before WAL was kept per system) are left alone.
///
/// # Errors
/// When listing or deleting fails (what was deleted stays deleted; the next run goes on).
pub async fn apply_retention(store: &Store, keep: usize) -> Result<(Vec<String>, usize), Error> {
    let backups = store.base_backups().await?;
    let mut wal = BTreeMap::new();
    for system in store.listing("wal").await?.1 {
        let files = store.list(&wal_dir(&system)).await?;
        wal.insert(system, files);
    }
    let current = store.system().await?;
    let (old_backups, old_wal) = retention_plan(&backups, &wal, current.as_deref(), keep);
    for name in &old_backups {
        store
            .delete(&store.path(&format!("base/{name}/backup.json")))
            .await?;
        store
            .delete(&store.path(&format!("base/{name}/data.tar.gz")))
            .await?;
    }
    for file in &old_wal {
        store.delete(&store.path(&format!("wal/{file}"))).await?;
    }
    Ok((old_backups, old_wal.len()))
}

#[cfg(test)]
mod tests {
    /// Found by the fault campaign (seed 201, step 27): after many failovers the primary of
    /// timeline 22 was refused `000000110000000000000020` (timeline 17) for ever, its archive
    /// stuck behind it, a base backup waiting for its WAL.
    #[test]
    fn only_an_earlier_timelines_segment_can_be_a_stale_copy() {
        assert!(stale_copy("000000110000000000000020", 0x16));
        for (name, timeline) in [
            ("000000160000000000000020", 0x16),
            ("000000170000000000000020", 0x16),
            ("00000011.history", 0x16),
            ("000000110000000000000020.partial", 0x16),
            ("000000110000000000000020.00000028.backup", 0x16),
            ("00000001000000000000000G", 0x16),
            ("000000010000000000000003", 1),
        ] {
            assert!(!stale_copy(name, timeline), "{name} on timeline {timeline}");
        }
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(newest_timeline(dir.path()), 1, "no pg_wal");
        std::fs::create_dir(dir.path().join("pg_wal")).unwrap();
        assert_eq!(newest_timeline(dir.path()), 1, "no history: timeline 1");
        for f in [
            "00000002.history",
            "00000016.history",
            "00000009.history",
            "000000170000000000000001",
            "00000020.history.partial",
        ] {
            std::fs::write(dir.path().join("pg_wal").join(f), "").unwrap();
        }
        assert_eq!(newest_timeline(dir.path()), 0x16);
    }

    use super::*;

    fn backup(name: &str, begin_wal: &str, completed_at: &str) -> BaseBackup {
        BaseBackup {
            name: name.into(),
            timeline: 1,
            begin_lsn: Lsn(0),
            begin_wal: begin_wal.into(),
            started_at: completed_at.into(),
            completed_at: completed_at.into(),
            size: 1,
            system_identifier: Some(SYS.into()),
            major: None,
        }
    }

    #[test]
    fn wal_file_names_are_postgresqls() {
        assert_eq!(
            wal_file_name(1, "0/2000028".parse().unwrap()),
            "000000010000000000000002"
        );
        assert_eq!(
            wal_file_name(3, "16/B374D848".parse().unwrap()),
            "0000000300000016000000B3"
        );
    }

    #[test]
    fn the_start_point_is_read_from_the_backup_history_file_of_its_label() {
        let history = "START WAL LOCATION: 0/2000028 (file 000000010000000000000002)\n\
                       STOP WAL LOCATION: 0/2000100 (file 000000010000000000000002)\n\
                       CHECKPOINT LOCATION: 0/2000060\n\
                       BACKUP METHOD: streamed\n\
                       BACKUP FROM: primary\n\
                       START TIME: 2026-12-04 20:16:59 UTC\n\
                       LABEL: nightly-1\n\
                       START TIMELINE: 3\n\
                       STOP TIME: 2026-12-04 20:17:02 UTC\n\
                       STOP TIMELINE: 3\n";
        assert_eq!(
            parse_backup_history(history, "nightly-1"),
            Some((Lsn(0x2000028), 3))
        );
        assert_eq!(
            parse_backup_history(history, "nightly"),
            None,
            "another label"
        );
        assert_eq!(parse_backup_history("nothing", "nightly-1"), None);
        let dir = tempfile::tempdir().unwrap();
        let wal = dir.path().join("pg_wal");
        std::fs::create_dir(&wal).unwrap();
        std::fs::write(
            wal.join("000000030000000000000002.00000028.backup"),
            history,
        )
        .unwrap();
        std::fs::write(
            wal.join("000000030000000000000005.00000028.backup"),
            history.replace("0/2000028", "0/5000028"),
        )
        .unwrap();
        std::fs::write(wal.join("000000030000000000000005"), "segment").unwrap();
        assert_eq!(
            backup_start(dir.path(), "nightly-1").unwrap(),
            (Lsn(0x5000028), 3),
            "the newest of the label"
        );
        assert!(backup_start(dir.path(), "other").is_err());
    }

    /// The start comes from the tar's own `backup_label`: the history file in `pg_wal` was
    /// removed by a replica's clone ending at the same time (seen in a test run).
    #[test]
    fn the_start_point_is_read_from_the_backup_label_the_tar_begins_with() {
        let label = "START WAL LOCATION: 0/10000028 (file 000000020000000000000010)\n\
                     CHECKPOINT LOCATION: 0/10000080\n\
                     BACKUP METHOD: streamed\n\
                     BACKUP FROM: primary\n\
                     START TIME: 2026-12-04 23:30:57 UTC\n\
                     LABEL: pg-after-pg17\n\
                     START TIMELINE: 2\n";
        let mut tar = tar::Builder::new(Vec::new());
        for (name, data) in [
            ("backup_label", label.as_bytes()),
            ("PG_VERSION", b"17\n".as_slice()),
        ] {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o600);
            header.set_cksum();
            tar.append_data(&mut header, name, data).unwrap();
        }
        let bytes = tar.into_inner().unwrap();
        assert_eq!(
            label_start(&bytes, "pg-after-pg17"),
            Some((Lsn(0x1000_0028), 2))
        );
        assert_eq!(label_start(&bytes, "other"), None, "another label");
        assert_eq!(
            label_start(&bytes[..300], "pg-after-pg17"),
            None,
            "cut short"
        );
        assert_eq!(label_start(b"", "pg-after-pg17"), None);
    }

    #[test]
    fn recovery_takes_the_newest_backup_completed_before_the_target() {
        let backups = [
            backup("a", "000000010000000000000002", "2026-12-01T10:00:00Z"),
            backup("b", "000000010000000000000005", "2026-12-01T12:00:00Z"),
        ];
        assert_eq!(choose_backup(&backups, None, None).unwrap().name, "b");
        assert_eq!(
            choose_backup(&backups, Some("2026-12-01T11:00:00Z"), None)
                .unwrap()
                .name,
            "a"
        );
        assert_eq!(
            choose_backup(&backups, Some("2026-12-01T12:00:01+00:00"), None)
                .unwrap()
                .name,
            "b"
        );
        assert!(matches!(
            choose_backup(&backups, Some("2026-12-01T09:00:00Z"), None),
            Err(Error::NoBackup(_))
        ));
        assert!(matches!(
            choose_backup(&backups, Some("yesterday"), None),
            Err(Error::Invalid(_))
        ));
        assert!(matches!(
            choose_backup(&[], None, None),
            Err(Error::NoBackup(_))
        ));
    }

    /// Across a major upgrade (15 before it, 17 from its first backup on): each major
    /// restores only its own copies, and a time after the upgrade but before the new major's
    /// first backup is refused naming the backup and its major, not handed to PostgreSQL 17
    /// as a data directory of 15.
    #[test]
    fn recovery_takes_a_backup_of_the_major_that_restores_it() {
        let of = |name: &str, completed: &str, major: Option<u32>| BaseBackup {
            major,
            ..backup(name, "000000010000000000000002", completed)
        };
        let backups = [
            of("on-15", "2026-12-01T10:00:00Z", Some(15)),
            of("pg-after-pg17", "2026-12-01T12:00:00Z", Some(17)),
        ];
        let chosen = |target: Option<&str>, major| {
            choose_backup(&backups, target, major).map(|b| b.name.clone())
        };
        assert_eq!(chosen(None, Some(17)).unwrap(), "pg-after-pg17");
        assert_eq!(chosen(None, Some(15)).unwrap(), "on-15");
        assert_eq!(chosen(None, None).unwrap(), "pg-after-pg17");
        assert_eq!(
            chosen(Some("2026-12-01T11:00:00Z"), Some(15)).unwrap(),
            "on-15"
        );
        // A backup that does not say its major may be of either (taken before it was kept).
        let legacy = [of("legacy", "2026-12-01T09:00:00Z", None)];
        assert_eq!(
            choose_backup(&legacy, None, Some(17)).unwrap().name,
            "legacy"
        );
        match chosen(Some("2026-12-01T11:00:00Z"), Some(17)) {
            Ok(name) => panic!("{name} chosen for PostgreSQL 17"),
            Err(Error::NoBackup(reason)) => assert!(
                reason.contains("on-15") && reason.contains("spec.version 15"),
                "{reason}"
            ),
            Err(e) => panic!("{e}"),
        }
    }

    /// One system's WAL, as `apply_retention` hands it to `retention_plan`.
    fn one_system(files: &[&str]) -> BTreeMap<String, Vec<String>> {
        BTreeMap::from([(
            SYS.to_string(),
            files.iter().map(|f| f.to_string()).collect(),
        )])
    }

    const SYS: &str = "7312345678901234567";

    #[test]
    fn retention_keeps_the_newest_backups_and_the_wal_they_need() {
        let backups = [
            backup("old", "000000010000000000000002", "2026-12-01T10:00:00Z"),
            backup("mid", "000000010000000000000005", "2026-12-01T11:00:00Z"),
            backup("new", "000000020000000000000009", "2026-12-01T12:00:00Z"),
        ];
        let files = [
            "000000010000000000000002.gz",
            "000000010000000000000002.00000028.backup.gz",
            "000000010000000000000004.gz",
            "000000010000000000000005.gz",
            "00000002.history.gz",
            "000000020000000000000006.gz",
        ];
        let wal = one_system(&files);
        let (old, old_wal) = retention_plan(&backups, &wal, Some(SYS), 2);
        assert_eq!(old, ["old"]);
        assert_eq!(
            old_wal,
            [
                format!("{SYS}/000000010000000000000002.gz"),
                format!("{SYS}/000000010000000000000002.00000028.backup.gz"),
                format!("{SYS}/000000010000000000000004.gz"),
            ]
        );
        assert_eq!(
            retention_plan(&backups, &wal, Some(SYS), 3),
            (vec![], vec![])
        );
        assert_eq!(
            retention_plan(&backups, &wal, Some(SYS), 0),
            (vec![], vec![])
        );
        let (old, old_wal) = retention_plan(&backups, &wal, Some(SYS), 1);
        assert_eq!(old, ["mid", "old"]);
        assert_eq!(
            old_wal.len(),
            5,
            "everything but the history file: {old_wal:?}"
        );
        // Issue #37, item 11: an object under wal/ whose 24th byte falls inside a multi-byte
        // character panicked the backup task; it is not WAL and is left alone.
        let mut odd = files.map(String::from).to_vec();
        odd.push(format!("{}é.gz", "0".repeat(23))); // 'é' is bytes 23 and 24
        odd.push("é".into());
        let odd = BTreeMap::from([(SYS.to_string(), odd)]);
        let (_, old_wal) = retention_plan(&backups, &odd, Some(SYS), 1);
        assert_eq!(old_wal.len(), 5, "{old_wal:?}");
    }

    /// Issue #37, item 1: after a major upgrade the new system starts again on timeline 1.
    /// Its WAL lives apart from the old system's, and once no kept backup is of the old system,
    /// all of the old system's WAL goes, history files too (none of it can be restored); the
    /// system archiving now is never emptied, and a kept backup that does not say its system
    /// keeps every system's WAL.
    #[test]
    fn retention_drops_the_wal_of_a_system_an_upgrade_left_behind() {
        let new_system = "7399999999999999999";
        let mut before = backup("before", "000000030000000000000010", "2026-12-01T10:00:00Z");
        before.system_identifier = Some(SYS.into());
        let mut after = backup("after", "000000010000000000000002", "2026-12-01T12:00:00Z");
        after.system_identifier = Some(new_system.into());
        let mut later = backup("later", "000000020000000000000007", "2026-12-01T13:00:00Z");
        later.system_identifier = Some(new_system.into());
        let wal = BTreeMap::from([
            (
                SYS.to_string(),
                vec![
                    "00000003.history.gz".to_string(),
                    "000000030000000000000011.gz".into(),
                ],
            ),
            (
                new_system.to_string(),
                vec![
                    "000000010000000000000002.gz".to_string(),
                    "00000002.history.gz".into(),
                    "000000020000000000000007.gz".into(),
                ],
            ),
        ]);
        // Both systems have a kept backup: each keeps what its backup needs.
        let (old, old_wal) = retention_plan(
            &[before.clone(), after.clone(), later.clone()],
            &wal,
            Some(new_system),
            3,
        );
        assert!(old.is_empty() && old_wal.is_empty(), "{old:?} {old_wal:?}");
        let (old, old_wal) = retention_plan(
            &[before.clone(), after.clone(), later.clone()],
            &wal,
            Some(new_system),
            2,
        );
        assert_eq!(old, ["before"]);
        assert_eq!(
            old_wal,
            [
                format!("{SYS}/00000003.history.gz"),
                format!("{SYS}/000000030000000000000011.gz"),
            ],
            "the old system's WAL, all of it; the new system's from its oldest kept backup"
        );
        let (_, old_wal) = retention_plan(
            &[before.clone(), after.clone(), later.clone()],
            &wal,
            Some(new_system),
            1,
        );
        assert_eq!(old_wal.len(), 3, "{old_wal:?}");
        assert!(old_wal.contains(&format!("{new_system}/000000010000000000000002.gz")));
        // The system archiving now keeps its WAL even with no kept backup of its own.
        let (_, old_wal) = retention_plan(
            &[before.clone(), after.clone(), later.clone()],
            &wal,
            Some(SYS),
            1,
        );
        assert!(old_wal.iter().all(|f| !f.starts_with(SYS)), "{old_wal:?}");
        // A kept backup from before systems were recorded could need any of them.
        let mut unknown = later.clone();
        unknown.system_identifier = None;
        let (_, old_wal) = retention_plan(&[before, after, unknown], &wal, Some(new_system), 1);
        assert!(old_wal.is_empty(), "{old_wal:?}");
    }

    #[test]
    fn a_path_is_archived_to_by_one_system_or_the_one_upgraded_from_it() {
        assert!(may_archive(None, SYS, None), "an empty path is taken");
        assert!(may_archive(Some(SYS), SYS, None));
        assert!(
            !may_archive(Some(SYS), "7399999999999999999", None),
            "another cluster's path"
        );
        assert!(
            may_archive(Some(SYS), "7399999999999999999", Some(SYS)),
            "the system a major upgrade made of it"
        );
        assert!(!may_archive(Some(SYS), "7399999999999999999", Some("1")));
    }

    #[test]
    fn the_system_identifier_is_read_from_pg_control() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("global")).unwrap();
        let mut control = 7_312_345_678_901_234_567_u64.to_ne_bytes().to_vec();
        control.extend([0u8; 64]);
        std::fs::write(dir.path().join("global/pg_control"), control).unwrap();
        assert_eq!(
            system_identifier(dir.path()).unwrap(),
            "7312345678901234567"
        );
        std::fs::write(dir.path().join("global/pg_control"), [1u8; 4]).unwrap();
        assert!(system_identifier(dir.path()).is_err());
    }

    #[test]
    fn a_gap_is_a_segment_on_the_recovery_path_the_archive_lacks() {
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // Timeline 2 starts in segment 5 (at 0/5000060), timeline 3 exactly at segment 8.
        let history = parse_history(
            "1\t0/5000060\tno recovery target specified\n\n2\t0/8000000\tno recovery target specified\n",
        );
        assert_eq!(
            history,
            [
                (1, "0/5000060".parse().unwrap()),
                (2, "0/8000000".parse().unwrap())
            ]
        );
        let whole = names(&[
            "000000010000000000000003",
            "000000010000000000000003.00000028.backup",
            "000000010000000000000004",
            "000000010000000000000005.partial",
            "00000002.history",
            "000000020000000000000005",
            "000000020000000000000006",
            "000000020000000000000007",
            "00000003.history",
            "000000030000000000000008",
            "000000030000000000000009",
        ]);
        assert!(wal_gaps(&whole, "000000010000000000000003", &history).is_empty());
        // Timeline 1's segment 4 was never archived (the primary was killed with it ready).
        let mut gap = whole.clone();
        gap.retain(|n| n != "000000010000000000000004" && n != "000000020000000000000007");
        assert_eq!(
            wal_gaps(&gap, "000000010000000000000003", &history),
            ["000000010000000000000004", "000000020000000000000007"]
        );
        // From a backup on timeline 2: timeline 1 does not matter.
        assert!(
            wal_gaps(&gap[3..], "000000020000000000000005", &history)
                .contains(&"000000020000000000000007".to_string())
        );
        let from_two = names(&[
            "000000020000000000000006",
            "000000020000000000000007",
            "000000030000000000000008",
        ]);
        assert!(wal_gaps(&from_two, "000000020000000000000006", &history).is_empty());
        assert_eq!(parse_segment("0000000A00000001000000FF"), Some((10, 0x1FF)));
        assert_eq!(parse_segment("00000002.history"), None);
    }

    #[tokio::test]
    async fn leftover_ready_files_without_their_wal_file_are_just_marked_done() {
        // No archive_status directory: nothing to do, without a store being reached.
        let dir = tempfile::tempdir().unwrap();
        let config = StoreConfig::from_vars("S", |name| match name {
            "S_ENDPOINT" => Some("http://127.0.0.1:9".into()),
            "S_BUCKET" => Some("b".into()),
            "S_ACCESS_KEY_ID" | "S_SECRET_ACCESS_KEY" => Some("x".into()),
            _ => None,
        })
        .unwrap()
        .unwrap();
        let store = Store::open(config).unwrap();
        assert!(push_ready(&store, dir.path()).await.unwrap().is_empty());
        // A .ready flag whose file is gone (removed after a checkpoint): just marked done.
        let status = dir.path().join("pg_wal/archive_status");
        std::fs::create_dir_all(&status).unwrap();
        std::fs::write(status.join("000000010000000000000004.ready"), "").unwrap();
        assert!(push_ready(&store, dir.path()).await.unwrap().is_empty());
        assert!(status.join("000000010000000000000004.done").exists());
    }

    #[test]
    fn the_store_configuration_comes_from_the_environment() {
        let vars = |pairs: &[(&str, &str)]| {
            let map: std::collections::HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (format!("STEWARD_BACKUP_{k}"), (*v).to_string()))
                .collect();
            move |name: &str| map.get(name).cloned()
        };
        assert!(
            StoreConfig::from_vars("STEWARD_BACKUP", vars(&[]))
                .unwrap()
                .is_none()
        );
        let partial = [
            ("ENDPOINT", "http://198.18.0.1:8333"),
            ("BUCKET", "backups"),
        ];
        let err = StoreConfig::from_vars("STEWARD_BACKUP", vars(&partial))
            .unwrap_err()
            .to_string();
        assert!(err.contains("STEWARD_BACKUP_ACCESS_KEY_ID"), "{err}");
        let full = [
            ("ENDPOINT", "http://198.18.0.1:8333"),
            ("BUCKET", "backups"),
            ("ACCESS_KEY_ID", "id"),
            ("SECRET_ACCESS_KEY", "secret"),
            ("PATH", "/prod/pg/"),
        ];
        let config = StoreConfig::from_vars("STEWARD_BACKUP", vars(&full))
            .unwrap()
            .unwrap();
        assert_eq!(config.region, "us-east-1");
        assert_eq!(config.url(), "s3://backups/prod/pg");
        assert_eq!(
            format!("{config:?}"),
            "s3://backups/prod/pg",
            "no secret in Debug"
        );
    }
}
