//! System packages the tests need, installed on a fresh machine.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Debian packages the real node needs (runc, the CNI plugins, iptables), busybox for its
/// test images, unzip/xz for the second PostgreSQL major's bundle, Prometheus for the
/// monitoring tests, Java for the backup tests' S3 server and PgBouncer's build dependencies,
/// each with a file that shows it is installed.
const NODE_PACKAGES: &[(&str, &str)] = &[
    ("runc", "/usr/sbin/runc"),
    ("containernetworking-plugins", "/usr/lib/cni/bridge"),
    ("iptables", "/usr/sbin/iptables"),
    ("busybox-static", "/bin/busybox"),
    // Prometheus and promtool for the monitoring tests (instead of a build from Go modules).
    ("prometheus", "/usr/bin/promtool"),
    // Unpacking the PostgreSQL bundles from Maven Central (a jar holding a .txz).
    ("unzip", "/usr/bin/unzip"),
    ("xz-utils", "/usr/bin/xz"),
    // Java for the backup tests' S3 server (S3Proxy's jar from Maven Central).
    (
        "openjdk-17-jre-headless",
        "/usr/lib/jvm/java-17-openjdk-amd64/bin/java",
    ),
    // PgBouncer is built from Debian's source for the pooler tests (TLS and c-ares required).
    ("make", "/usr/bin/make"),
    ("pkg-config", "/usr/bin/pkg-config"),
    ("libevent-dev", "/usr/include/event2/event.h"),
    ("libc-ares-dev", "/usr/include/ares.h"),
    ("libssl-dev", "/usr/include/openssl/ssl.h"),
];

/// The real node's Debian packages ([`NODE_PACKAGES`]); installs the missing ones with apt-get.
pub fn ensure_node_packages() -> Result<()> {
    let missing: Vec<&str> = NODE_PACKAGES
        .iter()
        .filter(|(_, file)| !Path::new(file).exists())
        .map(|(package, _)| *package)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!(
        "xtask: the real node needs Debian packages {}; installing",
        missing.join(" ")
    );
    apt_install(&missing)
}

/// PostgreSQL server binaries (Debian's `postgresql` package) for the database operator's
/// tests against a real server. Installs them with apt-get when missing.
pub fn ensure_postgres() -> Result<()> {
    if postgres_installed() {
        return Ok(());
    }
    eprintln!("xtask: PostgreSQL server binaries missing; installing Debian's postgresql package");
    apt_install(&["postgresql", "postgresql-contrib"])?;
    if !postgres_installed() {
        bail!("postgresql installed but no /usr/lib/postgresql/*/bin/postgres found");
    }
    Ok(())
}

/// `apt-get update` and `apt-get install` of `packages` (as root; else says what to run).
fn apt_install(packages: &[&str]) -> Result<()> {
    let is_root = Command::new("id")
        .arg("-u")
        .output()
        .map(|o| o.stdout.starts_with(b"0"))
        .unwrap_or(false);
    if !is_root {
        bail!(
            "missing Debian packages; run `sudo apt-get install -y {}` and retry",
            packages.join(" ")
        );
    }
    let mut install = vec!["install", "-y", "-qq", "--no-install-recommends"];
    install.extend_from_slice(packages);
    for args in [vec!["update", "-qq"], install] {
        let status = Command::new("apt-get")
            .args(&args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .context("running apt-get")?;
        if !status.success() {
            bail!("apt-get {} failed ({status})", args.join(" "));
        }
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
