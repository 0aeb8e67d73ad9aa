//! A major-version upgrade of a stopped primary's data directory with `pg_upgrade`, in two
//! containers of the operator's upgrade Job (both run this binary):
//!
//! 1. [`export`], an init container of the **old** major's image: copies that installation
//!    (the directory above the `bin/` that holds `postgres` on `PATH`, and Debian's
//!    `/usr/share/postgresql/<major>` when there is one) into a shared volume at the same
//!    paths under it, so its programs still find `lib/` and `share/` relative to themselves;
//!    copies the shared libraries they link that are not glibc's own (as the image's dynamic
//!    loader resolves them, `ld.so --list`); and writes `bin/<program>` wrappers that run each
//!    program with those libraries first. The new image needs nothing of the old one.
//! 2. [`upgrade`], the main container, in the **new** major's image: `initdb` of the new major
//!    beside the data directory (same encoding, locale and checksums as Steward's `initdb`),
//!    `pg_upgrade` in copy mode — the old data directory is never written, so a failure at
//!    any point leaves the cluster as it was on the old major — then two renames swap the
//!    new directory in and the old copy is removed.
//!
//! [`upgrade`] is idempotent: run again after an interruption it finishes the swap, or starts
//! over from the untouched old directory.
//!
//! `pg_upgrade` does not carry the planner's statistics over: the swap also writes
//! [`analyze_marker`] beside the data directory, and the instance manager, once that data
//! directory first runs read-write as the primary, runs [`analyze`] (`vacuumdb --all
//! --analyze-in-stages`, as `pg_upgrade` itself recommends) and removes the marker.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use tokio::process::Command;

use crate::postgres::run;

/// Failures of an upgrade step; each names what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Program(#[from] crate::postgres::Error),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io { what, source }
}

/// The shared libraries of glibc itself: never copied, since a program must use the dynamic
/// loader's own C library (the new image's; glibc runs programs built against older ones).
const GLIBC: &[&str] = &[
    "ld-linux",
    "libc.so",
    "libm.so",
    "libdl.so",
    "libpthread.so",
    "librt.so",
    "libresolv.so",
    "libutil.so",
    "libanl.so",
    "libnss_",
    "libmvec.so",
];

/// What [`export`] wrote: the wrappers' directory is the `-b` (old bindir) of `pg_upgrade`.
pub const WRAPPERS: &str = "bin";
/// The copied libraries, under the export directory.
pub const LIBRARIES: &str = "lib";
/// The copied installation, under the export directory, at its original absolute paths.
pub const TREE: &str = "tree";

/// The major version `postgres --version` prints (`postgres (PostgreSQL) 15.18 (Debian …)`).
pub fn parse_major(version_output: &str) -> Option<u32> {
    let after = version_output.split("(PostgreSQL)").nth(1)?.trim();
    let number: String = after.chars().take_while(char::is_ascii_digit).collect();
    number.parse().ok()
}

/// The libraries `ld.so --list` printed (`libfoo.so.1 => /path/libfoo.so.1 (0x…)`), without
/// glibc's own and without the loader.
pub fn parse_ld_list(output: &str) -> Vec<PathBuf> {
    output
        .lines()
        .filter_map(|line| {
            let (name, rest) = line.trim().split_once(" => ")?;
            let path = rest.split(" (").next()?.trim();
            if !path.starts_with('/') || GLIBC.iter().any(|g| name.starts_with(g)) {
                return None;
            }
            Some(PathBuf::from(path))
        })
        .collect()
}

/// The wrapper that runs `program` of the exported tree with its libraries first.
pub fn wrapper(export: &Path, program: &Path) -> String {
    let libs = export.join(LIBRARIES);
    format!(
        "#!/bin/sh\n# Written by steward-pg-instance export: the old major's {name}, with its own libraries.\nLD_LIBRARY_PATH='{libs}'${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}} exec '{program}' \"$@\"\n",
        name = program
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        libs = libs.display(),
        program = program.display(),
    )
}

/// `program` on `PATH`.
fn on_path(program: &str) -> Result<PathBuf, Error> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
        .ok_or_else(|| Error::Refused(format!("no {program} on PATH")))
}

/// The major of the `postgres` at `bin/postgres` (or on `PATH`).
async fn major_of(postgres: &Path) -> Result<u32, Error> {
    let out = run(
        "postgres --version",
        Command::new(postgres).arg("--version"),
    )
    .await?;
    parse_major(&out).ok_or_else(|| Error::Refused(format!("cannot read a version in {out:?}")))
}

/// The major of the `postgres` on `PATH`.
///
/// # Errors
/// No `postgres` on `PATH`, or one that does not say its version.
pub async fn installed_major() -> Result<u32, Error> {
    major_of(&on_path("postgres")?).await
}

/// The image's dynamic loader.
fn loader() -> Result<PathBuf, Error> {
    ["/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .ok_or_else(|| Error::Refused("no dynamic loader in this image".into()))
}

/// Copies `from` (a file, or a directory recursively, symlinks kept) to `to`.
fn copy_tree(from: &Path, to: &Path) -> Result<(), Error> {
    let meta = std::fs::symlink_metadata(from).map_err(io(format!("stat {}", from.display())))?;
    if meta.file_type().is_symlink() {
        let target = std::fs::read_link(from).map_err(io(format!("read {}", from.display())))?;
        let _ = std::fs::remove_file(to);
        std::os::unix::fs::symlink(&target, to).map_err(io(format!("link {}", to.display())))?;
    } else if meta.is_dir() {
        std::fs::create_dir_all(to).map_err(io(format!("create {}", to.display())))?;
        for entry in std::fs::read_dir(from).map_err(io(format!("read {}", from.display())))? {
            let entry = entry.map_err(io(format!("read {}", from.display())))?;
            copy_tree(&entry.path(), &to.join(entry.file_name()))?;
        }
    } else {
        std::fs::copy(from, to).map_err(io(format!("copy {}", from.display())))?;
    }
    Ok(())
}

/// `path` re-rooted under `root` (`/usr/lib/x` → `<root>/usr/lib/x`).
fn under(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// Step 1, in the old major's image: exports its installation into `to` (see the module
/// documentation). Returns the exported major.
///
/// # Errors
/// No `postgres` on `PATH`, no dynamic loader, or a copy that fails.
pub async fn export(to: &Path) -> Result<u32, Error> {
    let postgres = std::fs::canonicalize(on_path("postgres")?).map_err(io("resolve postgres"))?;
    let major = major_of(&postgres).await?;
    let bindir = postgres
        .parent()
        .ok_or_else(|| Error::Refused("postgres has no directory".into()))?
        .to_path_buf();
    let home = bindir.parent().unwrap_or(&bindir).to_path_buf();
    let tree = to.join(TREE);
    copy_tree(&home, &under(&tree, &home))?;
    let debian_share = PathBuf::from(format!("/usr/share/postgresql/{major}"));
    if debian_share.is_dir() && !debian_share.starts_with(&home) {
        copy_tree(&debian_share, &under(&tree, &debian_share))?;
    }

    let loader = loader()?;
    let libs = to.join(LIBRARIES);
    let wrappers = to.join(WRAPPERS);
    for dir in [&libs, &wrappers] {
        std::fs::create_dir_all(dir).map_err(io(format!("create {}", dir.display())))?;
    }
    let mut linked = BTreeSet::new();
    let mut programs = Vec::new();
    for entry in std::fs::read_dir(&bindir).map_err(io(format!("read {}", bindir.display())))? {
        let path = entry.map_err(io("read bin"))?.path();
        let is_elf = std::fs::read(&path).is_ok_and(|b| b.starts_with(b"\x7fELF"));
        if !is_elf {
            continue;
        }
        let listed = Command::new(&loader)
            .arg("--list")
            .arg(&path)
            .output()
            .await
            .map_err(io(format!("run {} --list", loader.display())))?;
        linked.extend(parse_ld_list(&String::from_utf8_lossy(&listed.stdout)));
        programs.push(path);
    }
    for lib in &linked {
        // Libraries of the installation itself are in the tree already (found by rpath).
        if lib.starts_with(&home) {
            continue;
        }
        let Some(name) = lib.file_name() else {
            continue;
        };
        std::fs::copy(lib, libs.join(name)).map_err(io(format!("copy {}", lib.display())))?;
    }
    for program in &programs {
        let Some(name) = program.file_name() else {
            continue;
        };
        let path = wrappers.join(name);
        std::fs::write(&path, wrapper(to, &under(&tree, program)))
            .map_err(io(format!("write {}", path.display())))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .map_err(io(format!("chmod {}", path.display())))?;
    }
    tracing::info!(
        major,
        programs = programs.len(),
        libraries = linked.len(),
        to = %to.display(),
        "exported the old major's installation"
    );
    Ok(major)
}

/// Where an upgrade of `pgdata` keeps its directories.
#[derive(Clone, Debug)]
pub struct Layout {
    pub pgdata: PathBuf,
    /// The new major's cluster while it is being made.
    pub upgrading: PathBuf,
    /// The old data directory between the two renames.
    pub retired: PathBuf,
}

impl Layout {
    pub fn of(pgdata: &Path) -> Self {
        let sibling = |suffix: &str| {
            let mut name = pgdata.file_name().unwrap_or_default().to_os_string();
            name.push(suffix);
            pgdata.with_file_name(name)
        };
        Self {
            pgdata: pgdata.to_path_buf(),
            upgrading: sibling(".upgrading"),
            retired: sibling(".retired"),
        }
    }
}

/// The major a data directory holds (`PG_VERSION`).
pub fn data_major(pgdata: &Path) -> Option<u32> {
    std::fs::read_to_string(pgdata.join("PG_VERSION"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// What [`upgrade`] must do, from what is on the volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Plan {
    /// The data directory already holds `to`: remove what an earlier run left.
    Done,
    /// Interrupted between the two renames: move the upgraded directory in.
    FinishSwap,
    /// Upgrade the old directory (what an earlier attempt left beside it is removed first).
    Upgrade { from: u32 },
}

/// Decides from the majors found: `data` in `pgdata`, `upgraded` in a complete `.upgrading`
/// (one `pg_upgrade` finished, marked by [`DONE_MARKER`]), `retired` in `.retired`.
///
/// # Errors
/// [`Error::Refused`] when there is nothing to upgrade from, or the data is newer than `to`.
pub fn plan(
    to: u32,
    data: Option<u32>,
    upgraded: Option<u32>,
    retired: Option<u32>,
) -> Result<Plan, Error> {
    match (data, upgraded, retired) {
        (Some(d), _, _) if d == to => Ok(Plan::Done),
        (Some(d), _, _) if d > to => Err(Error::Refused(format!(
            "the data directory holds PostgreSQL {d}, newer than this image's {to}"
        ))),
        (Some(d), _, _) => Ok(Plan::Upgrade { from: d }),
        (None, Some(u), Some(_)) if u == to => Ok(Plan::FinishSwap),
        (None, _, Some(r)) => Ok(Plan::Upgrade { from: r }),
        (None, _, None) => Err(Error::Refused(
            "the data directory holds no PostgreSQL cluster".into(),
        )),
    }
}

/// Written into `.upgrading` when `pg_upgrade` succeeded there.
pub const DONE_MARKER: &str = "steward-upgraded";

/// Step 2, in the new major's image, as the data directory's owner: upgrades `pgdata` with
/// the old major's programs exported to `old` (see the module documentation); `work` is a
/// writable scratch directory (`pg_upgrade`'s logs, sockets). Returns `(from, to)`.
///
/// # Errors
/// [`Error::Refused`] for a data directory that is not older than this image's major or
/// an export of another major; [`Error::Program`] with the logs' ends when a program fails.
pub async fn upgrade(pgdata: &Path, old: &Path, work: &Path) -> Result<(u32, u32), Error> {
    let postgres = std::fs::canonicalize(on_path("postgres")?).map_err(io("resolve postgres"))?;
    let to = major_of(&postgres).await?;
    let layout = Layout::of(pgdata);
    let upgraded =
        data_major(&layout.upgrading).filter(|_| layout.upgrading.join(DONE_MARKER).exists());
    let plan = plan(
        to,
        data_major(pgdata),
        upgraded,
        data_major(&layout.retired),
    )?;
    tracing::info!(?plan, to, pgdata = %pgdata.display(), "major upgrade");
    let from = match plan {
        Plan::Done => {
            remove(&layout.upgrading)?;
            remove(&layout.retired)?;
            return Ok((to, to));
        }
        Plan::FinishSwap => {
            let from = data_major(&layout.retired).unwrap_or_default();
            swap_in(&layout)?;
            return Ok((from, to));
        }
        Plan::Upgrade { from } => from,
    };
    if !pgdata.join("PG_VERSION").exists() {
        // Interrupted after the first rename, before pg_upgrade finished: put it back.
        rename(&layout.retired, pgdata)?;
    }
    let old_bin = old.join(WRAPPERS);
    let old_major = major_of(&old_bin.join("postgres")).await?;
    if old_major != from {
        return Err(Error::Refused(format!(
            "the data directory holds PostgreSQL {from} but the old binaries are {old_major}"
        )));
    }
    if from >= to {
        return Err(Error::Refused(format!(
            "cannot upgrade PostgreSQL {from} to {to}"
        )));
    }
    std::fs::create_dir_all(work).map_err(io(format!("create {}", work.display())))?;
    let sockets = work.join("sockets");
    std::fs::create_dir_all(&sockets).map_err(io("create the socket directory"))?;
    std::fs::remove_file(pgdata.join("standby.signal")).ok();
    std::fs::remove_file(pgdata.join("recovery.signal")).ok();
    // One read of the control file: its state (below) and whether pages have checksums (the
    // new cluster must match), which starting and stopping the old cluster does not change.
    let control = run(
        "pg_controldata",
        Command::new(old_bin.join("pg_controldata")).arg(pgdata),
    )
    .await?;
    shut_down_cleanly(pgdata, &old_bin, &sockets, &control).await?;

    remove(&layout.upgrading)?;
    let checksums = control
        .lines()
        .any(|l| l.starts_with("Data page checksum version:") && !l.trim_end().ends_with(": 0"));
    let mut initdb = Command::new("initdb");
    initdb.arg("-D").arg(&layout.upgrading).args([
        "-U",
        "postgres",
        "-E",
        "UTF8",
        "--locale=C",
        "--auth=trust",
    ]);
    if checksums {
        initdb.arg("--data-checksums");
    } else if to >= 18 {
        initdb.arg("--no-data-checksums");
    }
    run("initdb", &mut initdb).await?;
    let new_bin = postgres.parent().map(Path::to_path_buf).unwrap_or_default();
    let result = run(
        "pg_upgrade",
        Command::new(new_bin.join("pg_upgrade"))
            .current_dir(work)
            .env_remove("PGDATA")
            .arg("--old-bindir")
            .arg(&old_bin)
            .arg("--new-bindir")
            .arg(&new_bin)
            .arg("--old-datadir")
            .arg(pgdata)
            .arg("--new-datadir")
            .arg(&layout.upgrading)
            .arg("--socketdir")
            .arg(&sockets)
            .args(["--username", "postgres", "--copy", "--old-port", "50432"])
            .args(["--new-port", "50433"]),
    )
    .await;
    if let Err(crate::postgres::Error::Failed {
        program,
        status,
        mut output,
    }) = result
    {
        output.push_str(&logs_of(&layout.upgrading));
        return Err(crate::postgres::Error::Failed {
            program,
            status,
            output,
        }
        .into());
    }
    result?;
    // The new cluster is a new PostgreSQL system (its own identifier, timeline 1 again): this
    // lets it take over the old system's archive path, its WAL kept apart (archive::claim).
    let previous = crate::archive::system_identifier(pgdata)
        .map_err(|e| Error::Refused(format!("the old cluster's system identifier: {e}")))?;
    std::fs::write(
        layout.upgrading.join(crate::archive::UPGRADED_FROM),
        format!("{previous}\n"),
    )
    .map_err(io("record the system upgraded from"))?;
    std::fs::write(
        layout.upgrading.join(DONE_MARKER),
        format!("{from} -> {to}\n"),
    )
    .map_err(io("mark the upgrade done"))?;
    rename(pgdata, &layout.retired)?;
    swap_in(&layout)?;
    Ok((from, to))
}

/// What `pg_upgrade` left in the new directory's `pg_upgrade_output.d` beyond its own
/// output: the lists of what blocks the upgrade (`*.txt`) and the end of the servers' log.
fn logs_of(upgrading: &Path) -> String {
    let mut out = String::new();
    let mut files = Vec::new();
    let mut dirs = vec![upgrading.join("pg_upgrade_output.d")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "txt")
                || path
                    .file_name()
                    .is_some_and(|n| n == "pg_upgrade_server.log")
            {
                // The lists of what blocks the upgrade, and the servers' log.
                files.push(path);
            }
        }
    }
    files.sort();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(10)..].join("\n");
        if !tail.trim().is_empty() {
            let _ = write!(out, "\n--- {}:\n{tail}", file.display());
        }
    }
    out
}

/// `pg_upgrade` needs the old cluster shut down cleanly; a primary whose pod was killed
/// was not (its `pg_controldata` output, `control`, says so): start it once without
/// connections and stop it.
async fn shut_down_cleanly(
    pgdata: &Path,
    old_bin: &Path,
    sockets: &Path,
    control: &str,
) -> Result<(), Error> {
    let state = control
        .lines()
        .find_map(|l| l.strip_prefix("Database cluster state:"))
        .map(str::trim)
        .unwrap_or_default();
    if state == "shut down" {
        return Ok(());
    }
    tracing::info!(%state, "the old cluster was not shut down cleanly: starting and stopping it once");
    let options = format!(
        "-c listen_addresses='' -c unix_socket_directories='{}' -c archive_mode=off",
        sockets.display()
    );
    run(
        "pg_ctl start",
        Command::new(old_bin.join("pg_ctl"))
            .arg("-D")
            .arg(pgdata)
            .arg("-l")
            // The server's log in a file: it must not hold the captured output open.
            .arg(sockets.with_file_name("old-start.log"))
            .args(["-w", "-t", "600", "-o", &options, "start"]),
    )
    .await?;
    run(
        "pg_ctl stop",
        Command::new(old_bin.join("pg_ctl"))
            .arg("-D")
            .arg(pgdata)
            .args(["-w", "-t", "600", "-m", "fast", "stop"]),
    )
    .await
    .map(drop)
    .map_err(Error::from)
}

/// Beside the data directory `pgdata`: written when an upgraded data directory is swapped in,
/// removed once [`analyze`] ran on it (an upgraded cluster has no planner statistics).
pub fn analyze_marker(pgdata: &Path) -> PathBuf {
    let mut name = pgdata.file_name().unwrap_or_default().to_os_string();
    name.push(".analyze-pending");
    pgdata.with_file_name(name)
}

/// Gathers planner statistics in every database of the instance whose socket is in
/// `socket_dir` (as the superuser): `vacuumdb --all --analyze-in-stages`, which makes coarse
/// statistics first so that plans are sane within seconds, then complete ones. Returns its
/// output.
///
/// # Errors
/// [`Error::Program`] when `vacuumdb` cannot be started or fails.
pub async fn analyze(socket_dir: &Path) -> Result<String, Error> {
    Ok(run(
        "vacuumdb",
        Command::new("vacuumdb")
            .arg("--host")
            .arg(socket_dir)
            .args(["--port", &crate::contract::PG_PORT.to_string()])
            .args(["--username", "postgres", "--no-password"])
            .args(["--all", "--analyze-in-stages"]),
    )
    .await?)
}

/// What [`recover_interrupted_swap`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Recovered {
    /// The upgraded directory (complete, of the installed major) was moved in.
    FinishedSwap,
    /// The old directory was moved back: the upgrade did not complete.
    PutBack,
}

/// Before anything decides that an empty data directory is a new cluster (and runs `initdb`
/// there, or clones into it): a major upgrade interrupted between its two renames leaves
/// `pgdata` missing or empty and the data in `.retired`. The swap is finished when the
/// upgraded directory is complete and of `installed` (this image's major), else the old
/// directory is put back (the next upgrade attempt starts over from it). `None`: there
/// was nothing to recover.
///
/// # Errors
/// When a rename fails: the caller must then not touch the data directory.
pub fn recover_interrupted_swap(
    pgdata: &Path,
    installed: Option<u32>,
) -> Result<Option<Recovered>, Error> {
    let layout = Layout::of(pgdata);
    if data_major(pgdata).is_some() || data_major(&layout.retired).is_none() {
        return Ok(None);
    }
    let upgraded =
        data_major(&layout.upgrading).filter(|_| layout.upgrading.join(DONE_MARKER).exists());
    // An empty directory may stand where the old one was (a volume's mount point is never
    // renamed; a half-done rename leaves none): out of the way first.
    if pgdata.exists() {
        std::fs::remove_dir(pgdata).map_err(io(format!(
            "remove the empty {} (an interrupted upgrade left the data in {})",
            pgdata.display(),
            layout.retired.display()
        )))?;
    }
    if upgraded.is_some() && upgraded == installed {
        swap_in(&layout)?;
        return Ok(Some(Recovered::FinishedSwap));
    }
    rename(&layout.retired, pgdata)?;
    Ok(Some(Recovered::PutBack))
}

fn swap_in(layout: &Layout) -> Result<(), Error> {
    // Before the swap: an interrupted swap is finished by the next run, which writes it again.
    std::fs::write(analyze_marker(&layout.pgdata), "")
        .map_err(io("mark the upgraded cluster for ANALYZE"))?;
    std::fs::remove_file(layout.upgrading.join(DONE_MARKER)).ok();
    rename(&layout.upgrading, &layout.pgdata)?;
    remove(&layout.retired)
}

fn rename(from: &Path, to: &Path) -> Result<(), Error> {
    std::fs::rename(from, to).map_err(io(format!("rename {} to {}", from.display(), to.display())))
}

fn remove(dir: &Path) -> Result<(), Error> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(io(format!("remove {}", dir.display()))(e))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue #37, item 2: after an upgrade stopped between its renames, the data is in
    /// `.retired` and `pgdata` is empty; the instance manager ran `initdb` there.
    #[test]
    fn an_interrupted_swap_is_finished_or_undone_never_left_empty() {
        let dir = tempfile::tempdir().unwrap();
        let pgdata = dir.path().join("pgdata");
        let layout = Layout::of(&pgdata);
        let cluster = |path: &Path, major: &str| {
            std::fs::create_dir_all(path).unwrap();
            std::fs::write(path.join("PG_VERSION"), format!("{major}\n")).unwrap();
        };
        // Nothing to recover: a data directory in place, or nothing retired.
        cluster(&pgdata, "15");
        assert_eq!(recover_interrupted_swap(&pgdata, Some(17)).unwrap(), None);
        std::fs::remove_dir_all(&pgdata).unwrap();
        assert_eq!(recover_interrupted_swap(&pgdata, Some(17)).unwrap(), None);

        // pg_upgrade finished (marked): the upgraded directory goes in.
        cluster(&layout.retired, "15");
        cluster(&layout.upgrading, "17");
        std::fs::write(layout.upgrading.join(DONE_MARKER), "15 -> 17\n").unwrap();
        std::fs::create_dir_all(&pgdata).unwrap(); // empty, as initdb would find it
        assert_eq!(
            recover_interrupted_swap(&pgdata, Some(17)).unwrap(),
            Some(Recovered::FinishedSwap)
        );
        assert_eq!(data_major(&pgdata), Some(17));
        assert!(!layout.retired.exists() && !layout.upgrading.exists());

        // Not finished (no marker), or for another image: the old directory goes back.
        std::fs::remove_dir_all(&pgdata).unwrap();
        cluster(&layout.retired, "15");
        cluster(&layout.upgrading, "17");
        assert_eq!(
            recover_interrupted_swap(&pgdata, Some(17)).unwrap(),
            Some(Recovered::PutBack)
        );
        assert_eq!(data_major(&pgdata), Some(15));
        assert!(!layout.retired.exists());
        std::fs::remove_dir_all(&pgdata).unwrap();
        cluster(&layout.retired, "15");
        std::fs::write(layout.upgrading.join(DONE_MARKER), "15 -> 17\n").unwrap();
        assert_eq!(
            recover_interrupted_swap(&pgdata, Some(16)).unwrap(),
            Some(Recovered::PutBack)
        );
        assert_eq!(data_major(&pgdata), Some(15));
    }

    #[test]
    fn majors_are_read_from_version_output_and_pg_version() {
        assert_eq!(
            parse_major("postgres (PostgreSQL) 15.18 (Debian 15.18-0+deb12u1)\n"),
            Some(15)
        );
        assert_eq!(parse_major("postgres (PostgreSQL) 17.11\n"), Some(17));
        assert_eq!(parse_major("pg_ctl (PostgreSQL) 9.6.24"), Some(9));
        assert_eq!(parse_major("something else"), None);
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(data_major(dir.path()), None);
        std::fs::write(dir.path().join("PG_VERSION"), "15\n").unwrap();
        assert_eq!(data_major(dir.path()), Some(15));
    }

    #[test]
    fn the_loaders_list_gives_the_libraries_to_copy_without_glibc() {
        let listed = "\tlinux-vdso.so.1 (0x00007ffd)\n\
            \tlibpq.so.5 => /usr/lib/x86_64-linux-gnu/libpq.so.5 (0x00007f01)\n\
            \tlibssl.so.3 => /lib/x86_64-linux-gnu/libssl.so.3 (0x00007f02)\n\
            \tlibm.so.6 => /lib/x86_64-linux-gnu/libm.so.6 (0x00007f03)\n\
            \tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x00007f04)\n\
            \tlibnotthere.so.1 => not found\n\
            \t/lib64/ld-linux-x86-64.so.2 (0x00007f05)\n";
        assert_eq!(
            parse_ld_list(listed),
            [
                PathBuf::from("/usr/lib/x86_64-linux-gnu/libpq.so.5"),
                PathBuf::from("/lib/x86_64-linux-gnu/libssl.so.3"),
            ]
        );
    }

    #[test]
    fn a_wrapper_runs_the_program_with_its_libraries_first() {
        let w = wrapper(
            Path::new("/old"),
            Path::new("/old/tree/usr/lib/postgresql/15/bin/pg_ctl"),
        );
        assert!(w.starts_with("#!/bin/sh\n"), "{w}");
        assert!(
            w.contains("LD_LIBRARY_PATH='/old/lib'${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec '/old/tree/usr/lib/postgresql/15/bin/pg_ctl' \"$@\""),
            "{w}"
        );
    }

    #[test]
    fn the_plan_finishes_or_restarts_an_interrupted_upgrade_and_refuses_a_downgrade() {
        // Also with a half-made new cluster next to the old one: it is made again.
        assert_eq!(
            plan(17, Some(15), None, None).unwrap(),
            Plan::Upgrade { from: 15 }
        );
        assert_eq!(
            plan(17, Some(15), Some(17), None).unwrap(),
            Plan::Upgrade { from: 15 }
        );
        assert_eq!(plan(17, Some(17), None, Some(15)).unwrap(), Plan::Done);
        // Between the renames: the complete new cluster goes in.
        assert_eq!(
            plan(17, None, Some(17), Some(15)).unwrap(),
            Plan::FinishSwap
        );
        // After the first rename without a complete new cluster: the old one comes back.
        assert_eq!(
            plan(17, None, None, Some(15)).unwrap(),
            Plan::Upgrade { from: 15 }
        );
        assert!(
            matches!(plan(15, Some(17), None, None), Err(Error::Refused(m)) if m.contains("newer"))
        );
        assert!(matches!(plan(17, None, None, None), Err(Error::Refused(_))));
        let layout = Layout::of(Path::new("/var/lib/postgresql/data/pgdata"));
        assert_eq!(
            layout.upgrading,
            Path::new("/var/lib/postgresql/data/pgdata.upgrading")
        );
        assert_eq!(
            layout.retired,
            Path::new("/var/lib/postgresql/data/pgdata.retired")
        );
        assert_eq!(
            analyze_marker(&layout.pgdata),
            Path::new("/var/lib/postgresql/data/pgdata.analyze-pending")
        );
    }
}
