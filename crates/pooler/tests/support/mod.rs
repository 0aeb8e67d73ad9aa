//! What the pooler's tests share: the prerequisites (testenv's PgBouncer build and
//! PostgreSQL), the lookup role and function as the operator creates them, PgBouncer run as
//! an unprivileged user, and waiting for what happened.

// Each test binary uses a part.
#![allow(dead_code)]

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use steward_pooler::contract::pooler::AUTH_USER;
use steward_testenv::postgres::Postgres;
use tokio_postgres::NoTls;

/// The lookup role's password (a quote in it, for the auth file's quoting).
pub const AUTH_PASSWORD: &str = "pooler \"secret\"";
pub const APP_PASSWORD: &str = "apppw";

/// testenv's PgBouncer and a running PostgreSQL with the lookup role, function and a role
/// `app`; `None` (with the reason printed) when either cannot be had.
pub async fn prerequisites() -> Option<(PathBuf, Postgres, tokio_postgres::Client)> {
    let program = tokio::task::spawn_blocking(steward_testenv::images::pgbouncer_tree)
        .await
        .map_err(|e| e.to_string())
        .and_then(|tree| tree.map_err(|e| e.to_string()));
    let program = match program {
        Ok(tree) => tree.join("bin/pgbouncer"),
        Err(why) => {
            eprintln!("SKIPPED: no PgBouncer to test against: {why}");
            return None;
        }
    };
    if !Path::new("/usr/lib/postgresql").is_dir() {
        eprintln!("SKIPPED: PostgreSQL is not installed (apt-get install postgresql)");
        return None;
    }
    let pg = Postgres::start().await.expect("PostgreSQL");
    let (superuser, connection) = tokio_postgres::connect(&pg.url("postgres"), NoTls)
        .await
        .expect("superuser");
    tokio::spawn(connection);
    let quoted = AUTH_PASSWORD.replace('\'', "''");
    // The lookup function exactly as the operator creates it.
    let lookup = steward_pooler::contract::pooler::lookup_sql().join(";\n");
    superuser
        .batch_execute(&format!(
            "CREATE ROLE {AUTH_USER} LOGIN PASSWORD '{quoted}';
             {lookup};
             CREATE ROLE app LOGIN PASSWORD '{APP_PASSWORD}';"
        ))
        .await
        .expect("the lookup role and function");
    Some((program, pg, superuser))
}

/// Whether the tests run as root (PgBouncer refuses to).
pub fn root() -> bool {
    std::fs::metadata("/proc/self").map(|m| m.uid()).ok() == Some(0)
}

/// As root: hands `path` to the `postgres` OS user, as which PgBouncer runs (testenv's
/// PostgreSQL runs as that user too).
pub fn give_to_pgbouncer(path: &Path) {
    if !root() {
        return;
    }
    let status = std::process::Command::new("chown")
        .arg("postgres:postgres")
        .arg(path)
        .status()
        .expect("chown");
    assert!(status.success(), "chown postgres {}", path.display());
}

/// `pgbouncer <ini>`, as the `postgres` OS user when the tests run as root.
pub fn pgbouncer_command(program: &Path, ini: &Path) -> tokio::process::Command {
    if !root() {
        return steward_pooler::pgbouncer::command(program, ini);
    }
    let mut command = tokio::process::Command::new("setpriv");
    command
        .args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
        ])
        .arg(program)
        .arg(ini);
    command
}

/// A program the agent can start as `pgbouncer`: as root, a script that hands the auth file
/// the agent wrote to the `postgres` OS user and runs PgBouncer as that user.
pub fn pgbouncer_program(dir: &Path, program: &Path, auth_file: &Path) -> PathBuf {
    if !root() {
        return program.to_path_buf();
    }
    let script = dir.join("pgbouncer-as-postgres");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nchown postgres:postgres '{}' || exit 1\nexec setpriv --reuid=postgres --regid=postgres --init-groups -- '{}' \"$@\"\n",
            auth_file.display(),
            program.display()
        ),
    )
    .expect("write the PgBouncer wrapper");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))
        .expect("chmod the PgBouncer wrapper");
    script
}

/// Polls `check` every 50 ms until it gives a value; fails the test naming `what` after
/// `bound`.
pub async fn wait_for<T, F, Fut>(what: &str, bound: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + bound;
    loop {
        if let Some(value) = check().await {
            return value;
        }
        assert!(Instant::now() < deadline, "{what}: not within {bound:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A client logged in as `user` through PgBouncer on `port`, database `postgres`.
pub async fn connect(
    port: u16,
    user: &str,
    password: &str,
) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::Config::new()
        .host("127.0.0.1")
        .port(port)
        .user(user)
        .password(password)
        .dbname("postgres")
        .connect_timeout(Duration::from_secs(5))
        .connect(NoTls)
        .await?;
    tokio::spawn(connection);
    Ok(client)
}

/// The first value of `sql`'s answer (simple protocol).
pub async fn one_value(client: &tokio_postgres::Client, sql: &str) -> String {
    let table =
        steward_pooler::admin::Table::from_messages(client.simple_query(sql).await.expect(sql));
    table.rows[0][0].clone().expect("a value")
}
