//! Filling testenv's cache (`~/.cache/steward`: Go builds, downloads, image archives, unpacked
//! PostgreSQL and PgBouncer trees) when several builders want the same entry at once: test
//! binaries running beside each other, `cargo xtask test`'s Go workers, and the tests of one
//! binary, which run on threads of one process (so a process id alone does not tell two
//! builders apart).
//!
//! [`fill`] builds an entry under an exclusive lock on `<entry>.lock`: the first caller builds,
//! the others wait and find it built. An entry is built beside its place ([`partial`]) and
//! renamed into it only when complete, so a build killed half-way leaves no entry, only a
//! partial the next build removes.

use std::path::{Path, PathBuf};

/// Makes the cache entry `dest` exist: returns at once when `built(dest)` says it does, else
/// takes the lock on `<dest>.lock` (waiting for a build of the same entry by another process or
/// thread), looks again, and runs `build` (which builds into [`partial`]`(dest)` and renames it
/// into place) only if it is still missing.
///
/// # Errors
/// `build`'s error, or `lock_err` of what failed when the lock file could not be created or
/// locked.
pub(crate) fn fill<E>(
    dest: &Path,
    built: impl Fn(&Path) -> bool,
    lock_err: impl FnOnce(String, std::io::Error) -> E,
    build: impl FnOnce() -> Result<(), E>,
) -> Result<(), E> {
    if built(dest) {
        return Ok(());
    }
    let lock_path = with_suffix(dest, ".lock");
    if let Some(parent) = lock_path.parent()
        && let Err(e) = std::fs::create_dir_all(parent)
    {
        return Err(lock_err(format!("create {}", parent.display()), e));
    }
    let lock = match std::fs::File::create(&lock_path) {
        Ok(file) => file,
        Err(e) => return Err(lock_err(format!("create {}", lock_path.display()), e)),
    };
    // `flock`: one holder per open file, so threads of one process wait for each other too.
    if let Err(e) = lock.lock() {
        return Err(lock_err(format!("lock {}", lock_path.display()), e));
    }
    let result = if built(dest) { Ok(()) } else { build() };
    drop(lock);
    result
}

/// [`fill`]'s error, for testenv's own [`crate::Error`], when the lock on an entry cannot be
/// taken.
pub(crate) fn lock_err(what: String, source: std::io::Error) -> crate::Error {
    crate::Error::Io { what, source }
}

/// Where an entry is built before it is renamed to `dest`: `<dest>.partial`, removed first
/// (what a killed build left). Only [`fill`]'s lock holder writes it.
pub(crate) fn partial(dest: &Path) -> PathBuf {
    let partial = with_suffix(dest, ".partial");
    if partial.is_dir() {
        let _ = std::fs::remove_dir_all(&partial);
    } else {
        let _ = std::fs::remove_file(&partial);
    }
    partial
}

/// A path beside `dest` no other writer uses (process id and a counter: the tests of one
/// binary are threads of one process), for writers that do not take [`fill`]'s lock and may
/// overwrite `dest` (an operator's image archive): each renames its own whole file into place.
pub(crate) fn unique_partial(dest: &Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    with_suffix(dest, &format!(".partial-{}-{n}", std::process::id()))
}

/// `path` with `suffix` appended to its file name (not replacing an extension).
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn concurrent_fills_of_one_entry_build_it_once_and_all_find_it() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("entry.tar");
        let builds = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    fill(
                        &dest,
                        |d| d.exists(),
                        |what, e| format!("{what}: {e}"),
                        || {
                            builds.fetch_add(1, Ordering::SeqCst);
                            let partial = partial(&dest);
                            std::fs::write(&partial, b"half").unwrap();
                            std::thread::sleep(std::time::Duration::from_millis(50));
                            std::fs::write(&partial, b"whole").unwrap();
                            std::fs::rename(&partial, &dest).map_err(|e| e.to_string())
                        },
                    )
                    .unwrap();
                    assert_eq!(std::fs::read(&dest).unwrap(), b"whole");
                });
            }
        });
        assert_eq!(builds.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_partial_is_beside_its_entry_and_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("postgresql-15-abc.oci.tar");
        std::fs::write(
            dir.path().join("postgresql-15-abc.oci.tar.partial"),
            b"left",
        )
        .unwrap();
        let p = partial(&dest);
        assert_eq!(p, dir.path().join("postgresql-15-abc.oci.tar.partial"));
        assert!(!p.exists());
    }
}
