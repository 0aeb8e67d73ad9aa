//! Where a Database lives ([`resolve`]) and the credentials Secrets handed to applications
//! ([`credentials_secret`]).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Api;

use crate::Error;
use crate::cluster::build::{Names, PORT};
use crate::crd::{DatabaseSpec, PostgresCluster, SslMode};
use crate::password::Password;
use crate::pg::Server;

/// Resolves the server of a Database in namespace `ns`: a `clusterRef` becomes the cluster's
/// read-write Service and superuser Secret; `external` is read as given.
///
/// # Errors
/// [`Error::MissingReference`] when the cluster, the Secret or a key is missing;
/// [`Error::Standby`] when the cluster is a standby that follows its source (its primary is
/// read-only, its roles its source's: nothing can be written until it is promoted);
/// [`Error::Read`] when reading fails.
pub async fn resolve(
    client: &kube::Client,
    ns: &str,
    spec: &DatabaseSpec,
) -> Result<Server, Error> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let read_secret = |name: String| {
        let secrets = secrets.clone();
        async move {
            secrets
                .get_opt(&name)
                .await
                .map_err(|source| Error::Read {
                    what: format!("Secret {name}"),
                    source,
                })?
                .ok_or_else(|| {
                    Error::MissingReference(format!("Secret {name} not found in namespace {ns}"))
                })
        }
    };
    let key = |secret: &Secret, key: &str| -> Result<String, Error> {
        secret_text(secret, key).ok_or_else(|| {
            Error::MissingReference(format!(
                "Secret {} has no key {key:?}",
                secret.metadata.name.as_deref().unwrap_or_default()
            ))
        })
    };
    match (&spec.cluster_ref, &spec.external) {
        (Some(r), None) => {
            let clusters: Api<PostgresCluster> = Api::namespaced(client.clone(), ns);
            let cluster = clusters
                .get_opt(&r.name)
                .await
                .map_err(|source| Error::Read {
                    what: format!("PostgresCluster {}", r.name),
                    source,
                })?
                .ok_or_else(|| {
                    Error::MissingReference(format!(
                        "PostgresCluster {} not found in namespace {ns}",
                        r.name
                    ))
                })?;
            if let Some(source) = crate::cluster::standby::follows(&cluster.spec) {
                return Err(Error::Standby {
                    cluster: r.name.clone(),
                    store: source.url(),
                });
            }
            let names = Names::of(&r.name);
            let secret = read_secret(names.superuser_secret.clone()).await?;
            // The cluster's CA is in its superuser Secret: the operator and the applications
            // verify the server's certificate and name (the -rw Service's is among its SANs).
            let ca_pem = key(&secret, "ca.crt").ok().map(String::into_bytes);
            Ok(Server {
                host: format!("{}.{ns}.svc", names.rw),
                port: PORT as u16,
                ssl_mode: if ca_pem.is_some() {
                    SslMode::VerifyFull
                } else {
                    // Issued by a release before certificates: encrypted, not yet verified.
                    SslMode::Require
                },
                admin_user: key(&secret, "username")?,
                admin_password: Password::from_existing(key(&secret, "password")?),
                admin_database: "postgres".into(),
                ca_pem,
            })
        }
        (None, Some(ext)) => {
            let secret = read_secret(ext.admin_secret_ref.name.clone()).await?;
            let port = u16::try_from(ext.port)
                .map_err(|_| Error::InvalidSpec(format!("port {} is out of range", ext.port)))?;
            Ok(Server {
                host: ext.host.clone(),
                port,
                ssl_mode: ext.ssl_mode,
                admin_user: key(&secret, &ext.admin_secret_ref.username_key)?,
                admin_password: Password::from_existing(key(
                    &secret,
                    &ext.admin_secret_ref.password_key,
                )?),
                admin_database: ext.admin_database.clone(),
                ca_pem: secret
                    .data
                    .as_ref()
                    .and_then(|d| d.get("ca.crt"))
                    .map(|v| v.0.clone()),
            })
        }
        _ => Err(Error::InvalidSpec(
            "exactly one of clusterRef and external must be set".into(),
        )),
    }
}

/// The admin Secret (name, password key) a Job uses to log in like the operator does.
pub fn admin_secret_of(spec: &DatabaseSpec) -> Option<(String, String, String)> {
    match (&spec.cluster_ref, &spec.external) {
        (Some(r), _) => Some((
            Names::of(&r.name).superuser_secret,
            "username".into(),
            "password".into(),
        )),
        (None, Some(ext)) => Some((
            ext.admin_secret_ref.name.clone(),
            ext.admin_secret_ref.username_key.clone(),
            ext.admin_secret_ref.password_key.clone(),
        )),
        _ => None,
    }
}

/// libpq's spelling of an sslmode.
pub fn sslmode_str(mode: SslMode) -> &'static str {
    match mode {
        SslMode::Disable => "disable",
        SslMode::Prefer => "prefer",
        SslMode::Require => "require",
        SslMode::VerifyCa => "verify-ca",
        SslMode::VerifyFull => "verify-full",
    }
}

/// `host`, `port`, `dbname`, `user`, `password`, `uri` and `jdbc-uri` for `user` on `dbname`,
/// and `ca.crt` when the server's CA is known (a PostgresCluster's always is: its `uri` says
/// `sslmode=verify-full`, and clients point `sslrootcert`/`PGSSLROOTCERT` at the mounted
/// `ca.crt`). Names are `[a-z0-9_]` and generated passwords URL-safe, so nothing needs
/// escaping; other characters are percent-encoded anyway.
pub fn credentials(
    server: &Server,
    dbname: &str,
    user: &str,
    password: &Password,
) -> BTreeMap<String, String> {
    let host = if server.host.contains(':') {
        format!("[{}]", server.host)
    } else {
        server.host.clone()
    };
    let ssl = sslmode_str(server.ssl_mode);
    let (u, p, d) = (encode(user), encode(password.expose()), encode(dbname));
    let ca = server.ca_pem.as_ref().map(|pem| {
        (
            "ca.crt".to_string(),
            String::from_utf8_lossy(pem).into_owned(),
        )
    });
    let mut out = BTreeMap::from([
        ("host".to_string(), server.host.clone()),
        ("port".to_string(), server.port.to_string()),
        ("dbname".to_string(), dbname.to_string()),
        ("user".to_string(), user.to_string()),
        ("password".to_string(), password.expose().to_string()),
        (
            "uri".to_string(),
            format!(
                "postgresql://{u}:{p}@{host}:{}/{d}?sslmode={ssl}",
                server.port
            ),
        ),
        (
            "jdbc-uri".to_string(),
            format!(
                "jdbc:postgresql://{host}:{}/{d}?user={u}&password={p}&sslmode={ssl}",
                server.port
            ),
        ),
    ]);
    out.extend(ca);
    out
}

/// A credentials Secret named `name` in `ns` (owner reference added when applied).
pub fn credentials_secret(
    name: &str,
    ns: &str,
    data: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            namespace: Some(ns.to_string()),
            annotations: (!annotations.is_empty()).then_some(annotations),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(
            data.into_iter()
                .map(|(k, v)| (k, ByteString(v.into_bytes())))
                .collect(),
        ),
        ..Default::default()
    }
}

/// The text in key `key` of `secret`, if it is there, UTF-8 and not empty.
pub fn secret_text(secret: &Secret, key: &str) -> Option<String> {
    secret
        .data
        .as_ref()?
        .get(key)
        .and_then(|v| String::from_utf8(v.0.clone()).ok())
        .filter(|v| !v.is_empty())
}

/// The password in a Secret's `password` key, if any.
pub fn password_of(secret: &Secret) -> Option<Password> {
    secret_text(secret, "password").map(Password::from_existing)
}

fn encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An external server with `sslmode=require` and no CA.
    fn external() -> Server {
        Server {
            host: "db.example".into(),
            port: 5433,
            ssl_mode: SslMode::Require,
            admin_user: "admin".into(),
            admin_password: Password::from_existing("x".into()),
            admin_database: "postgres".into(),
            ca_pem: None,
        }
    }

    #[test]
    fn credentials_have_every_key() {
        let server = external();
        let c = credentials(
            &server,
            "app",
            "app_owner",
            &Password::from_existing("p-w_d".into()),
        );
        assert_eq!(
            c.keys().cloned().collect::<Vec<_>>(),
            [
                "dbname", "host", "jdbc-uri", "password", "port", "uri", "user"
            ]
        );
        assert_eq!(
            c["uri"],
            "postgresql://app_owner:p-w_d@db.example:5433/app?sslmode=require"
        );
        assert_eq!(
            c["jdbc-uri"],
            "jdbc:postgresql://db.example:5433/app?user=app_owner&password=p-w_d&sslmode=require"
        );
        assert_eq!(c["port"], "5433");
        assert_eq!(encode("a b/c"), "a%20b%2Fc");
    }

    #[test]
    fn a_known_ca_is_handed_to_clients_with_verify_full() {
        let server = Server {
            host: "pg-rw.ns.svc".into(),
            port: 5432,
            ssl_mode: SslMode::VerifyFull,
            ca_pem: Some(b"-----BEGIN CERTIFICATE-----\n".to_vec()),
            ..external()
        };
        let c = credentials(&server, "app", "app", &Password::from_existing("p".into()));
        assert_eq!(c["ca.crt"], "-----BEGIN CERTIFICATE-----\n");
        assert!(c["uri"].ends_with("?sslmode=verify-full"), "{}", c["uri"]);
        assert!(
            c["jdbc-uri"].ends_with("&sslmode=verify-full"),
            "{}",
            c["jdbc-uri"]
        );
    }
}
