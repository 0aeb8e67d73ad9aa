//! System packages the tests need, installed on a fresh machine.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// PostgreSQL server binaries (Debian's `postgresql` package) for the database operator's
/// tests against a real server. Installs them with apt-get when missing.
pub fn ensure_postgres() -> Result<()> {
    if postgres_installed() {
        return Ok(());
    }
    eprintln!("xtask: PostgreSQL server binaries missing; installing Debian's postgresql package");
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0"))
        .unwrap_or(false);
    if !is_root {
        bail!(
            "PostgreSQL is not installed; run `sudo apt-get install -y postgresql postgresql-contrib` and retry"
        );
    }
    for args in [
        vec!["update", "-qq"],
        vec![
            "install",
            "-y",
            "-qq",
            "--no-install-recommends",
            "postgresql",
            "postgresql-contrib",
        ],
    ] {
        let status = Command::new("apt-get")
            .args(&args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .context("running apt-get")?;
        if !status.success() {
            bail!("apt-get {} failed ({status})", args.join(" "));
        }
    }
    if !postgres_installed() {
        bail!("postgresql installed but no /usr/lib/postgresql/*/bin/postgres found");
    }
    Ok(())
}

fn postgres_installed() -> bool {
    std::fs::read_dir("/usr/lib/postgresql")
        .map(|dirs| {
            dirs.flatten()
                .any(|d| Path::new(&d.path()).join("bin/postgres").exists())
        })
        .unwrap_or(false)
}
