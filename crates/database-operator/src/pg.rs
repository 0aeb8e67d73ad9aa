//! Connecting to PostgreSQL servers and running plans.
//!
//! A [`Server`] is where a Database lives and how to log in as its admin, resolved from a
//! `clusterRef` (the cluster's read-write Service and superuser Secret) or from `external`
//! (host, port, sslmode, admin Secret): both take the same path from here on.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, Error as TlsError, SignatureScheme};
use steward_core::Leadership;
use tokio_postgres::{Client, NoTls};

use crate::crd::SslMode;
use crate::password::Password;

/// How long connecting may take before the server counts as unreachable.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A PostgreSQL server and the admin credentials to manage it.
#[derive(Clone)]
pub struct Server {
    pub host: String,
    pub port: u16,
    pub ssl_mode: SslMode,
    pub admin_user: String,
    pub admin_password: Password,
    /// The database the admin connects to for server-wide statements.
    pub admin_database: String,
    /// PEM CA bundle for `verify-ca`/`verify-full` (system roots when `None`).
    pub ca_pem: Option<Vec<u8>>,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("ssl_mode", &self.ssl_mode)
            .field("admin_user", &self.admin_user)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// `host:port`.
    pub fn address(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

/// What went wrong talking to the server.
#[derive(Debug, thiserror::Error)]
pub enum PgError {
    /// No connection could be made (network, TLS, authentication).
    #[error("failed to connect to {address} as {user} (database {database})")]
    Connect {
        address: String,
        user: String,
        database: String,
        #[source]
        source: tokio_postgres::Error,
    },
    /// The server accepted the connection but did not finish the handshake (TLS, startup,
    /// authentication) within [`CONNECT_TIMEOUT`]: a postmaster that is paused or overloaded.
    #[error(
        "connecting to {address} as {user} (database {database}) did not finish within {after:?}"
    )]
    ConnectTimedOut {
        address: String,
        user: String,
        database: String,
        after: Duration,
    },
    /// The TLS configuration could not be built (bad CA bundle).
    #[error("failed to set up TLS for {address}: {message}")]
    Tls { address: String, message: String },
    /// A query or statement failed.
    #[error("failed to run `{what}`")]
    Statement {
        what: String,
        #[source]
        source: tokio_postgres::Error,
    },
    /// This process no longer leads (or its last renewal is too old): the statement was not
    /// sent.
    #[error("did not run `{what}`: {reason}")]
    NotLeader { what: String, reason: String },
    /// Sessions of other instances of this operator (a SIGKILLed replica's last statement) were
    /// terminated but still ran after the wait: a cleanup that decided now could miss what they
    /// commit, so it waits for the next attempt.
    #[error(
        "{left} sessions of other operator instances still ran {after:?} after they were terminated"
    )]
    StaleSessions { left: i64, after: Duration },
}

impl PgError {
    /// Whether the failure is about reaching the server (vs. a statement it refused).
    pub fn is_connect(&self) -> bool {
        matches!(
            self,
            PgError::Connect { .. } | PgError::ConnectTimedOut { .. } | PgError::Tls { .. }
        ) || matches!(self, PgError::Statement { source, .. } if source.is_closed() || source.as_db_error().is_none())
    }

    /// The SQLSTATE of a statement error, if the server sent one.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            PgError::Statement { source, .. } => source.code().map(|c| c.code()),
            _ => None,
        }
    }
}

/// Connects to `database` on `server` as its admin.
///
/// # Errors
/// [`PgError::Connect`], [`PgError::ConnectTimedOut`] or [`PgError::Tls`].
pub async fn connect(
    server: &Server,
    database: &str,
    fence: &Leadership,
) -> Result<Client, PgError> {
    connect_as(
        server,
        database,
        &server.admin_user,
        &server.admin_password,
        statement_budget(fence),
        &application_name(fence.identity()),
    )
    .await
}

/// `database-operator <identity>`, cut to PostgreSQL's 63 bytes: the server's logs and
/// `pg_stat_activity` tell which replica sent a statement.
pub fn application_name(identity: &str) -> String {
    let mut name = format!("database-operator {identity}");
    while name.len() > 63 {
        name.pop();
    }
    name
}

/// How long one statement may run (`statement_timeout`; `lock_timeout` is half of it): 80 % of
/// the leader's renew deadline, at least 1 s (8 s with the default 15 s / 10 s / 2 s leases), so
/// that a statement a leader sent cannot still be running long after it could have lost the
/// Lease. Without leader election, 30 s.
pub fn statement_budget(fence: &Leadership) -> Duration {
    fence.renew_deadline().map_or(Duration::from_secs(30), |d| {
        d.mul_f64(0.8).max(Duration::from_secs(1))
    })
}

/// Connects to `database` on `server` as `user`.
///
/// # Errors
/// [`PgError::Connect`], [`PgError::ConnectTimedOut`] or [`PgError::Tls`].
/// [`connect`] to the server's admin database, recording in `reachable` whether the server
/// answered (the `ServerReachable` condition).
///
/// # Errors
/// [`crate::Error::ServerUnreachable`] naming the server.
pub async fn connect_admin(
    server: &Server,
    fence: &Leadership,
    reachable: &mut Option<Result<(), String>>,
) -> Result<Client, crate::Error> {
    match connect(server, &server.admin_database, fence).await {
        Ok(client) => {
            *reachable = Some(Ok(()));
            Ok(client)
        }
        Err(source) => {
            *reachable = Some(Err(steward_core::chain(&source)));
            Err(crate::Error::ServerUnreachable {
                address: server.address(),
                source,
            })
        }
    }
}

pub async fn connect_as(
    server: &Server,
    database: &str,
    user: &str,
    password: &Password,
    budget: Duration,
    application_name: &str,
) -> Result<Client, PgError> {
    let budget_ms = budget.as_millis();
    let mut config = tokio_postgres::Config::new();
    config
        .options(format!(
            "-c statement_timeout={budget_ms} -c lock_timeout={}",
            budget_ms / 2
        ))
        .host(&server.host)
        .port(server.port)
        .user(user)
        .password(password.expose())
        .dbname(database)
        .application_name(application_name)
        .connect_timeout(CONNECT_TIMEOUT)
        // Data the server's kernel does not acknowledge (a partition mid-session) fails the
        // connection after this long instead of the kernel's ~15 minutes of retransmissions.
        .tcp_user_timeout(CONNECT_TIMEOUT)
        .ssl_mode(match server.ssl_mode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        });
    let connect_err = |source| PgError::Connect {
        address: server.address(),
        user: user.to_string(),
        database: database.to_string(),
        source,
    };
    let connect = async {
        if server.ssl_mode == SslMode::Disable {
            let (client, connection) = config.connect(NoTls).await.map_err(connect_err)?;
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, "PostgreSQL connection ended");
                }
            });
            Ok(client)
        } else {
            let tls = tokio_postgres_rustls::MakeRustlsConnect::new(tls_config(server)?);
            let (client, connection) = config.connect(tls).await.map_err(connect_err)?;
            tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::debug!(error = %e, "PostgreSQL connection ended");
                }
            });
            Ok(client)
        }
    };
    // `connect_timeout` bounds the TCP connect only: a server whose kernel accepts the
    // connection while the postmaster never answers (paused, overloaded) would hold the
    // reconcile for ever in the startup handshake.
    tokio::time::timeout(CONNECT_TIMEOUT, connect)
        .await
        .unwrap_or_else(|_| {
            Err(PgError::ConnectTimedOut {
                address: server.address(),
                user: user.to_string(),
                database: database.to_string(),
                after: CONNECT_TIMEOUT,
            })
        })
}

/// Runs each statement of `plan` on its own (no implicit transaction).
///
/// Each statement is sent only if [`Leadership::guard`] passes right before it, and must
/// finish before leadership could lapse ([`Leadership::deadline`]): the session's
/// `statement_timeout` is set to the time left first, so the server ends a statement that
/// would outlive it, and the client stops waiting at the same instant. A leader that was
/// paused (or lost its Lease) mid-plan sends nothing more. Each statement that succeeded is
/// counted in `counted` (`steward_sql_statements_total`).
///
/// # Errors
/// [`PgError::Statement`] naming the first statement that failed (statements are logged by
/// their first words only; they may hold SCRAM verifiers); [`PgError::NotLeader`] when one
/// was not sent, or was abandoned unanswered (it may or may not have committed).
pub async fn execute(
    client: &Client,
    plan: &[String],
    fence: &Leadership,
    counted: &Counter,
) -> Result<(), PgError> {
    for statement in plan {
        let what = || redact(statement);
        let not_leader = |e: steward_core::leader::NotLeader| PgError::NotLeader {
            what: what(),
            reason: e.to_string(),
        };
        let statement_err = |source| PgError::Statement {
            what: what(),
            source,
        };
        let Some(deadline) = fence.deadline().map_err(not_leader)? else {
            tracing::info!(statement = %what(), "executing");
            client
                .batch_execute(statement)
                .await
                .map_err(statement_err)?;
            counted.inc();
            continue;
        };
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        client
            .batch_execute(&budget_settings(left))
            .await
            .map_err(statement_err)?;
        fence.guard().map_err(not_leader)?;
        tracing::info!(statement = %what(), "executing");
        match tokio::time::timeout_at(deadline, client.batch_execute(statement)).await {
            Ok(result) => {
                result.map_err(statement_err)?;
                counted.inc();
            }
            Err(_) => {
                return Err(PgError::NotLeader {
                    what: what(),
                    reason: format!(
                        "abandoned unanswered when leadership could lapse ({left:?} after it was sent); it may or may not have committed"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// `SET` statements bounding the next statement to `left`: `statement_timeout` (at least 1 ms:
/// 0 would disable it) and `lock_timeout` half of it.
fn budget_settings(left: Duration) -> String {
    let ms = left.as_millis().max(1);
    format!(
        "SET statement_timeout = {ms}; SET lock_timeout = {}",
        (ms / 2).max(1)
    )
}

/// A statement as it may appear in logs, Events and conditions: anything after `PASSWORD`
/// is cut.
pub fn redact(statement: &str) -> String {
    match statement.find(" PASSWORD ") {
        Some(i) => format!("{} PASSWORD <redacted>", &statement[..i]),
        None => statement.to_string(),
    }
}

fn tls_config(server: &Server) -> Result<rustls::ClientConfig, PgError> {
    let tls_err = |message: String| PgError::Tls {
        address: server.address(),
        message,
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| tls_err(e.to_string()))?;
    let config = match server.ssl_mode {
        SslMode::Disable | SslMode::Prefer | SslMode::Require => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerification(provider)))
            .with_no_client_auth(),
        SslMode::VerifyCa | SslMode::VerifyFull => {
            let mut roots = rustls::RootCertStore::empty();
            match &server.ca_pem {
                Some(pem) => {
                    for cert in rustls::pki_types::pem::PemObject::pem_slice_iter(pem) {
                        let cert: CertificateDer<'static> =
                            cert.map_err(|e| tls_err(format!("bad ca.crt: {e}")))?;
                        roots
                            .add(cert)
                            .map_err(|e| tls_err(format!("bad ca.crt: {e}")))?;
                    }
                }
                None => {
                    for cert in rustls_native_certs::load_native_certs().certs {
                        let _ = roots.add(cert);
                    }
                }
            }
            let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots),
                provider,
            )
            .build()
            .map_err(|e| tls_err(e.to_string()))?;
            if server.ssl_mode == SslMode::VerifyFull {
                builder.with_webpki_verifier(webpki).with_no_client_auth()
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(IgnoreHostname(webpki)))
                    .with_no_client_auth()
            }
        }
    };
    Ok(config)
}

/// libpq's `require`/`prefer`: encrypted, certificate not checked.
#[derive(Debug)]
struct NoVerification(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for NoVerification {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, TlsError> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// libpq's `verify-ca`: the chain must verify, the name need not match.
#[derive(Debug)]
struct IgnoreHostname(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for IgnoreHostname {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, TlsError> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(TlsError::InvalidCertificate(rustls::CertificateError::NotValidForName))
            | Err(TlsError::InvalidCertificate(
                rustls::CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_statement_gets_the_time_left_never_an_unbounded_timeout() {
        assert_eq!(
            budget_settings(Duration::from_millis(2500)),
            "SET statement_timeout = 2500; SET lock_timeout = 1250"
        );
        assert_eq!(
            budget_settings(Duration::ZERO),
            "SET statement_timeout = 1; SET lock_timeout = 1",
            "0 would mean no timeout"
        );
    }

    #[test]
    fn redact_cuts_passwords() {
        assert_eq!(
            redact("ALTER ROLE \"a\" WITH PASSWORD 'SCRAM-SHA-256$x'"),
            "ALTER ROLE \"a\" WITH PASSWORD <redacted>"
        );
        assert_eq!(redact("CREATE DATABASE \"a\""), "CREATE DATABASE \"a\"");
    }

    #[test]
    fn debug_hides_the_admin_password() {
        let s = Server {
            host: "h".into(),
            port: 5432,
            ssl_mode: SslMode::Disable,
            admin_user: "admin".into(),
            admin_password: Password::from_existing("topsecret".into()),
            admin_database: "postgres".into(),
            ca_pem: None,
        };
        assert!(!format!("{s:?}").contains("topsecret"));
        assert_eq!(s.address(), "h:5432");
    }
}
