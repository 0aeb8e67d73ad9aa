//! `pgbouncer.ini` and its `auth_file` (pure: the agent writes what these return).
//!
//! PgBouncer routes every database (`* = …`) to one host: the primary's pod IP once the agent
//! knows it, the cluster's `-rw` Service until then. Clients log in with SCRAM against the
//! password verifiers PgBouncer looks up in PostgreSQL as [`AUTH_USER`] through
//! [`LOOKUP_FUNCTION`] (which refuses superusers, replication roles and Steward's own roles),
//! and PgBouncer logs into PostgreSQL with the client's SCRAM keys (SCRAM pass-through: the
//! verifier is PostgreSQL's own, so it matches). Only two users are in the auth file: the
//! lookup role and [`ADMIN_USER`], the agent itself on the admin console.

use std::fmt::Write as _;
use std::path::PathBuf;

use crate::contract::pooler::{AUTH_USER, LOOKUP_FUNCTION};

/// The admin console's user: the agent, with a password it generates at start and keeps to
/// itself (it is in the auth file and nowhere else).
pub const ADMIN_USER: &str = "steward_agent";
/// The database `auth_query` runs in ([`LOOKUP_FUNCTION`] is installed there only).
pub const AUTH_DBNAME: &str = "postgres";
/// The admin console's database name.
pub const ADMIN_DBNAME: &str = "pgbouncer";
/// The configuration's file name in the run directory.
pub const INI_FILE: &str = "pgbouncer.ini";
/// The auth file's name in the run directory.
pub const AUTH_FILE: &str = "users.txt";

/// When PgBouncer hands a server connection to another client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PoolMode {
    /// After each transaction: many clients share few server connections; session state
    /// (`SET`, advisory locks, `LISTEN`) does not survive a transaction.
    Transaction,
    /// After the client disconnects: everything works as on a direct connection.
    Session,
}

impl PoolMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PoolMode::Transaction => "transaction",
            PoolMode::Session => "session",
        }
    }
}

/// The certificates PgBouncer uses: its own for clients, the cluster's CA to verify
/// PostgreSQL. Files of a mounted Secret (`tls.crt`, `tls.key`, `ca.crt`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tls {
    pub dir: PathBuf,
}

impl Tls {
    pub fn cert(&self) -> PathBuf {
        self.dir.join("tls.crt")
    }
    pub fn key(&self) -> PathBuf {
        self.dir.join("tls.key")
    }
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }
}

/// What `pgbouncer.ini` is rendered from (everything but the host, which the agent's loop
/// decides).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// `listen_addr` (`*` in a pod: every address).
    pub listen_addr: String,
    /// `listen_port`, also the Unix socket's (`.s.PGSQL.<port>`): [`crate::contract::pooler::PORT`].
    pub listen_port: u16,
    /// PostgreSQL's port on the primary ([`crate::contract::PG_PORT`]).
    pub server_port: u16,
    /// The emptyDir holding the ini, the auth file and the Unix socket.
    pub run_dir: PathBuf,
    pub pool_mode: PoolMode,
    pub default_pool_size: u32,
    pub max_client_conn: u32,
    /// `None`: TLS off on both sides (tests against a local PostgreSQL only).
    pub tls: Option<Tls>,
}

impl Settings {
    pub fn ini_path(&self) -> PathBuf {
        self.run_dir.join(INI_FILE)
    }
    pub fn auth_file_path(&self) -> PathBuf {
        self.run_dir.join(AUTH_FILE)
    }
}

/// Where PgBouncer sends its server connections.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// The cluster's `-rw` Service (`<cluster>-rw.<namespace>.svc`): until the agent has seen
    /// the primary, so a pooler started alone still reaches it.
    Service(String),
    /// The primary's pod, by its IP (no DNS, no Service in between: a switchover takes effect
    /// as soon as the agent reloads, not when endpoints propagate).
    Pod { name: String, ip: String },
}

impl Target {
    /// The `-rw` Service of `cluster` in `namespace`.
    pub fn service(cluster: &str, namespace: &str) -> Self {
        Target::Service(format!("{cluster}-rw.{namespace}.svc"))
    }

    /// The `host=` PgBouncer connects to.
    pub fn host(&self) -> &str {
        match self {
            Target::Service(host) => host,
            Target::Pod { ip, .. } => ip,
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Service(host) => write!(f, "service {host}"),
            Target::Pod { name, ip } => write!(f, "pod {name} ({ip})"),
        }
    }
}

/// `pgbouncer.ini` routing every database to `target`.
///
/// No `logfile` (PgBouncer logs to stderr, the container's log) and no `pidfile` (it runs in
/// the foreground, the agent's child). `server_login_retry` is short so that clients queued
/// during a failover get a server as soon as the new primary answers.
pub fn render(settings: &Settings, target: &Target) -> String {
    let run_dir = settings.run_dir.display();
    let mut ini = String::new();
    let _ = writeln!(ini, "[databases]");
    let _ = writeln!(
        ini,
        "* = host={} port={}",
        target.host(),
        settings.server_port
    );
    let _ = writeln!(ini);
    let _ = writeln!(ini, "[pgbouncer]");
    let mut set = |key: &str, value: &dyn std::fmt::Display| {
        let _ = writeln!(ini, "{key} = {value}");
    };
    set("listen_addr", &settings.listen_addr);
    set("listen_port", &settings.listen_port);
    set("unix_socket_dir", &run_dir);
    set("auth_type", &"scram-sha-256");
    set("auth_file", &settings.auth_file_path().display());
    set("auth_user", &AUTH_USER);
    set(
        "auth_query",
        &format!("SELECT usename, passwd FROM {LOOKUP_FUNCTION}($1)"),
    );
    set("auth_dbname", &AUTH_DBNAME);
    set("admin_users", &ADMIN_USER);
    set("pool_mode", &settings.pool_mode.as_str());
    set("default_pool_size", &settings.default_pool_size);
    set("max_client_conn", &settings.max_client_conn);
    match &settings.tls {
        Some(tls) => {
            set("server_tls_sslmode", &"verify-ca");
            set("server_tls_ca_file", &tls.ca().display());
            set("client_tls_sslmode", &"prefer");
            set("client_tls_cert_file", &tls.cert().display());
            set("client_tls_key_file", &tls.key().display());
            // No client certificates are asked for, but without a CA file PgBouncer loads
            // the system bundle, which a minimal image lacks ("failed to load CA").
            set("client_tls_ca_file", &tls.ca().display());
        }
        None => {
            set("server_tls_sslmode", &"disable");
            set("client_tls_sslmode", &"disable");
        }
    }
    set("server_login_retry", &1);
    set("server_connect_timeout", &5);
    set("ignore_startup_parameters", &"extra_float_digits");
    ini
}

/// A user name or password that cannot be written to the auth file.
#[derive(Debug, thiserror::Error)]
#[error("the {what} contains a line break or NUL, which PgBouncer's auth file cannot hold")]
pub struct Unquotable {
    pub what: &'static str,
}

/// The auth file: one `"user" "password"` line each for [`AUTH_USER`] and [`ADMIN_USER`],
/// plain-text passwords (PgBouncer derives SCRAM from them, both to check a client and to log
/// into PostgreSQL).
///
/// # Errors
/// [`Unquotable`] when a password has a line break or NUL (the format is one user a line).
pub fn auth_file(auth_password: &str, admin_password: &str) -> Result<String, Unquotable> {
    Ok(format!(
        "{} {}\n{} {}\n",
        quote(AUTH_USER, "user name")?,
        quote(auth_password, "auth user's password")?,
        quote(ADMIN_USER, "user name")?,
        quote(admin_password, "admin password")?,
    ))
}

/// `value` as a field of the auth file: in double quotes, each `"` doubled.
fn quote(value: &str, what: &'static str) -> Result<String, Unquotable> {
    if value.contains(['\n', '\r', '\0']) {
        return Err(Unquotable { what });
    }
    Ok(format!("\"{}\"", value.replace('"', "\"\"")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(tls: Option<Tls>) -> Settings {
        Settings {
            listen_addr: "*".into(),
            listen_port: 5432,
            server_port: 5432,
            run_dir: "/steward/run".into(),
            pool_mode: PoolMode::Transaction,
            default_pool_size: 20,
            max_client_conn: 1000,
            tls,
        }
    }

    fn lines(ini: &str) -> Vec<&str> {
        ini.lines().collect()
    }

    #[test]
    fn every_database_goes_to_the_target() {
        let s = settings(None);
        let pod = Target::Pod {
            name: "pg-1".into(),
            ip: "10.1.2.3".into(),
        };
        let ini = render(&s, &pod);
        assert_eq!(
            lines(&ini)[..2],
            ["[databases]", "* = host=10.1.2.3 port=5432"]
        );
        let ini = render(&s, &Target::service("pg", "team-a"));
        assert!(
            ini.contains("* = host=pg-rw.team-a.svc port=5432\n"),
            "{ini}"
        );
    }

    #[test]
    fn the_pgbouncer_section_has_the_agreed_settings() {
        let s = settings(Some(Tls {
            dir: "/etc/steward-tls".into(),
        }));
        let ini = render(&s, &Target::service("pg", "ns"));
        let l = lines(&ini);
        let at = l.iter().position(|l| *l == "[pgbouncer]").unwrap();
        assert_eq!(
            l[at + 1..],
            [
                "listen_addr = *",
                "listen_port = 5432",
                "unix_socket_dir = /steward/run",
                "auth_type = scram-sha-256",
                "auth_file = /steward/run/users.txt",
                "auth_user = steward_pooler",
                "auth_query = SELECT usename, passwd FROM steward_pooler.lookup($1)",
                "auth_dbname = postgres",
                "admin_users = steward_agent",
                "pool_mode = transaction",
                "default_pool_size = 20",
                "max_client_conn = 1000",
                "server_tls_sslmode = verify-ca",
                "server_tls_ca_file = /etc/steward-tls/ca.crt",
                "client_tls_sslmode = prefer",
                "client_tls_cert_file = /etc/steward-tls/tls.crt",
                "client_tls_key_file = /etc/steward-tls/tls.key",
                "client_tls_ca_file = /etc/steward-tls/ca.crt",
                "server_login_retry = 1",
                "server_connect_timeout = 5",
                "ignore_startup_parameters = extra_float_digits",
            ]
        );
        assert!(!ini.contains("logfile"), "PgBouncer logs to stderr");
        assert!(!ini.contains("pidfile"));
    }

    #[test]
    fn without_tls_both_sides_are_plain_and_nothing_names_a_certificate() {
        let mut s = settings(None);
        s.pool_mode = PoolMode::Session;
        s.listen_addr = "127.0.0.1".into();
        s.listen_port = 6543;
        s.server_port = 15432;
        let ini = render(
            &s,
            &Target::Pod {
                name: "pg-0".into(),
                ip: "127.0.0.1".into(),
            },
        );
        for line in [
            "* = host=127.0.0.1 port=15432",
            "listen_addr = 127.0.0.1",
            "listen_port = 6543",
            "pool_mode = session",
            "server_tls_sslmode = disable",
            "client_tls_sslmode = disable",
        ] {
            assert!(lines(&ini).contains(&line), "{line} missing in\n{ini}");
        }
        assert!(!ini.contains("_file = /etc"), "{ini}");
        assert!(!ini.contains("tls_ca_file"), "{ini}");
    }

    #[test]
    fn the_auth_file_quotes_and_doubles_quotes() {
        let file = auth_file("se\"cr et", "x\"\"y").unwrap();
        assert_eq!(
            file,
            "\"steward_pooler\" \"se\"\"cr et\"\n\"steward_agent\" \"x\"\"\"\"y\"\n"
        );
    }

    #[test]
    fn a_password_with_a_line_break_is_refused() {
        assert!(auth_file("a\nb", "x").is_err());
        assert!(auth_file("a", "x\r").is_err());
        assert!(auth_file("a\0", "x").is_err());
    }
}
