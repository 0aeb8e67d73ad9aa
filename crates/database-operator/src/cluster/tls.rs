//! The cluster's TLS: a CA generated once (Secret `<cluster>-ca`), and a server certificate
//! it signs for every Service name (Secret `<cluster>-tls`, mounted by the pods), renewed
//! a month before it expires or when the names change. Pure functions of their inputs and
//! the date; the reconcile decides when to call them.

use chrono::{Datelike, Days, NaiveDate, Utc};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// A certificate and its private key, PEM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issued {
    pub cert_pem: String,
    pub key_pem: String,
}

/// How long a server certificate is valid, and how long before its end it is renewed.
pub const SERVER_DAYS: u64 = 365;
pub const RENEW_BEFORE_DAYS: u64 = 30;
const CA_DAYS: u64 = 3650;

/// A date as rcgen takes it (`time`'s type, through rcgen's own constructor).
macro_rules! date {
    ($d:expr) => {{
        let d: NaiveDate = $d;
        // Month and day always fit in a u8.
        rcgen::date_time_ymd(d.year(), d.month() as u8, d.day() as u8)
    }};
}

fn ca_params(cluster: &str, today: NaiveDate) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        format!("{cluster} PostgreSQL CA (Steward)"),
    );
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = date!(today - Days::new(1));
    params.not_after = date!(today + Days::new(CA_DAYS));
    params
}

/// A new CA for `cluster`.
///
/// # Errors
/// When key generation or signing fails.
pub fn new_ca(cluster: &str, today: NaiveDate) -> Result<Issued, rcgen::Error> {
    let key = KeyPair::generate()?;
    let cert = ca_params(cluster, today).self_signed(&key)?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A server certificate for `names` (DNS names) signed by the CA whose key is `ca_key_pem`,
/// valid from yesterday for [`SERVER_DAYS`]; returns it and its last valid day.
///
/// # Errors
/// When the CA key cannot be read or signing fails.
pub fn server(
    cluster: &str,
    ca_key_pem: &str,
    names: &[String],
    today: NaiveDate,
) -> Result<(Issued, NaiveDate), rcgen::Error> {
    let ca_key = KeyPair::from_pem(ca_key_pem)?;
    // The issuer is the CA's name and key: re-creating its certificate from the same
    // parameters signs exactly as the stored one would (same subject, same key identifier).
    let ca = ca_params(cluster, today).self_signed(&ca_key)?;
    let mut params = CertificateParams::new(names.to_vec())?;
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        names
            .first()
            .cloned()
            .unwrap_or_else(|| cluster.to_string()),
    );
    params.distinguished_name = dn;
    params.use_authority_key_identifier_extension = true;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let not_after = today + Days::new(SERVER_DAYS);
    params.not_before = date!(today - Days::new(1));
    params.not_after = date!(not_after);
    let key = KeyPair::generate()?;
    let cert = params.signed_by(&key, &ca, &ca_key)?;
    Ok((
        Issued {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        },
        not_after,
    ))
}

/// Whether a server certificate valid until `not_after` (for `issued_for`) must be renewed
/// today for `names`.
pub fn needs_renewal(
    not_after: Option<NaiveDate>,
    issued_for: &str,
    names: &[String],
    today: NaiveDate,
) -> bool {
    match not_after {
        None => true,
        Some(end) => issued_for != names.join(",") || today + Days::new(RENEW_BEFORE_DAYS) >= end,
    }
}

/// The names clients and replicas use: the three Services, short and qualified, and each
/// pod through the headless Service.
pub fn server_names(cluster: &str, namespace: &str) -> Vec<String> {
    let mut names = Vec::new();
    for service in [
        format!("{cluster}-rw"),
        format!("{cluster}-ro"),
        format!("{cluster}-hl"),
    ] {
        names.push(service.clone());
        names.push(format!("{service}.{namespace}"));
        names.push(format!("{service}.{namespace}.svc"));
        names.push(format!("{service}.{namespace}.svc.cluster.local"));
    }
    names.push(format!("*.{cluster}-hl.{namespace}.svc"));
    names.push(format!("*.{cluster}-hl.{namespace}.svc.cluster.local"));
    names
}

/// Today (UTC).
pub fn today() -> NaiveDate {
    Utc::now().date_naive()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn day(y: i32, m: u32, d: u32) -> NaiveDate {
        NaiveDate::from_ymd_opt(y, m, d).unwrap()
    }

    #[test]
    fn the_server_certificate_chains_to_the_stored_ca_and_names_every_service() {
        let today = day(2026, 12, 1);
        let ca = new_ca("pg", today).unwrap();
        let names = server_names("pg", "ns");
        assert!(names.contains(&"pg-rw.ns.svc".to_string()));
        let (server, not_after) = server("pg", &ca.key_pem, &names, today).unwrap();
        assert_eq!(not_after, day(2027, 12, 1));
        assert!(server.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(server.key_pem.contains("PRIVATE KEY"));

        // rustls, as a client with only the CA, accepts it for pg-rw.ns.svc.
        use rustls::client::danger::ServerCertVerifier;
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.cert_pem.as_bytes()).unwrap())
            .unwrap();
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots.into(), provider)
                .build()
                .unwrap();
        let leaf = CertificateDer::from_pem_slice(server.cert_pem.as_bytes()).unwrap();
        let now = UnixTime::since_unix_epoch(std::time::Duration::from_secs(1_796_000_000));
        verifier
            .verify_server_cert(
                &leaf,
                &[],
                &ServerName::try_from("pg-rw.ns.svc").unwrap(),
                &[],
                now,
            )
            .expect("valid for the Service name, signed by the CA");
        assert!(
            verifier
                .verify_server_cert(
                    &leaf,
                    &[],
                    &ServerName::try_from("other.ns.svc").unwrap(),
                    &[],
                    now
                )
                .is_err(),
            "not for other names"
        );
    }

    #[test]
    fn renewal_a_month_before_the_end_or_when_the_names_change() {
        let names = vec!["a".to_string(), "b".to_string()];
        let end = day(2027, 12, 1);
        assert!(needs_renewal(None, "", &names, day(2026, 12, 1)));
        assert!(!needs_renewal(Some(end), "a,b", &names, day(2027, 10, 31)));
        assert!(needs_renewal(Some(end), "a,b", &names, day(2027, 11, 1)));
        assert!(needs_renewal(Some(end), "a", &names, day(2026, 12, 1)));
    }
}
