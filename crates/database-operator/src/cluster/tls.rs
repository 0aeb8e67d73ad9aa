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

/// The CA's common name: generation 0 is the cluster's first CA, each rotation the next.
/// Distinct names keep two CAs of one bundle apart for every verifier.
fn ca_name(cluster: &str, generation: u32) -> String {
    if generation == 0 {
        format!("{cluster} PostgreSQL CA (Steward)")
    } else {
        format!("{cluster} PostgreSQL CA (Steward) #{generation}")
    }
}

fn ca_params(cluster: &str, generation: u32, today: NaiveDate) -> CertificateParams {
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, ca_name(cluster, generation));
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

/// A new CA for `cluster`, of `generation` (0: its first).
///
/// # Errors
/// When key generation or signing fails.
pub fn new_ca(cluster: &str, generation: u32, today: NaiveDate) -> Result<Issued, rcgen::Error> {
    let key = KeyPair::generate()?;
    let cert = ca_params(cluster, generation, today).self_signed(&key)?;
    Ok(Issued {
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// A server certificate for `names` (DNS names) signed by the CA of `generation` whose key is
/// `ca_key_pem`, valid from yesterday for [`SERVER_DAYS`]; returns it and its last valid day.
///
/// # Errors
/// When the CA key cannot be read or signing fails.
pub fn server(
    cluster: &str,
    generation: u32,
    ca_key_pem: &str,
    names: &[String],
    today: NaiveDate,
) -> Result<(Issued, NaiveDate), rcgen::Error> {
    let ca_key = KeyPair::from_pem(ca_key_pem)?;
    // The issuer is the CA's name and key: re-creating its certificate from the same
    // parameters signs exactly as the stored one would (same subject, same key identifier).
    let ca = ca_params(cluster, generation, today).self_signed(&ca_key)?;
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

/// How long before its end a CA is rotated by itself.
pub const CA_ROTATE_BEFORE_DAYS: u64 = 365;

/// Where a rotation of the cluster's CA stands. A new CA is first trusted beside the one
/// that signs (every client and replica receives both), then signs while the old one is
/// still trusted, then is the only one: at no moment does a peer that has reloaded what it
/// was given meet a certificate it does not trust. Each phase lasts at least the grace
/// period (`--ca-rotation-grace`), the time a client is given to reload its `ca.crt`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaPhase {
    /// One CA signs and is trusted.
    Stable,
    /// The next CA is trusted beside the one that signs.
    Trusting,
    /// The new CA signs; the previous one is still trusted.
    Serving,
}

impl CaPhase {
    pub fn as_str(self) -> &'static str {
        match self {
            CaPhase::Stable => "Stable",
            CaPhase::Trusting => "Trusting",
            CaPhase::Serving => "Serving",
        }
    }

    pub fn parse(s: &str) -> Option<CaPhase> {
        [CaPhase::Stable, CaPhase::Trusting, CaPhase::Serving]
            .into_iter()
            .find(|p| p.as_str() == s)
    }
}

/// The cluster's CAs, as Secret `<cluster>-ca` holds them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Authority {
    /// The signing CA's generation (0: the cluster's first CA).
    pub generation: u32,
    /// The CA that signs the server certificate.
    pub signing: Issued,
    /// Its last valid day.
    pub signing_until: NaiveDate,
    /// During a rotation, the other CA: the next one (`Trusting`, with its key and last day)
    /// or the previous one (`Serving`).
    pub other: Option<(Issued, NaiveDate)>,
    pub phase: CaPhase,
    /// When the phase began.
    pub since: chrono::DateTime<Utc>,
    /// The last rotation request handled (the value of the cluster's `rotate-ca` annotation).
    pub handled: Option<String>,
}

/// What to do with the cluster's CAs now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rotation {
    Keep,
    /// A new CA, trusted beside the signing one.
    Start,
    /// The new CA signs.
    Serve,
    /// The previous CA is no longer trusted.
    Finish,
}

impl Authority {
    /// A first authority: `ca`, valid until `until`, signing since `now`.
    pub fn first(ca: Issued, until: NaiveDate, now: chrono::DateTime<Utc>) -> Authority {
        Authority {
            generation: 0,
            signing: ca,
            signing_until: until,
            other: None,
            phase: CaPhase::Stable,
            since: now,
            handled: None,
        }
    }

    /// What clients and replicas trust (`ca.crt` everywhere): the signing CA, then the other
    /// one during a rotation.
    pub fn bundle(&self) -> String {
        let mut pem = self.signing.cert_pem.clone();
        if let Some((other, _)) = &self.other {
            if !pem.ends_with('\n') {
                pem.push('\n');
            }
            pem.push_str(&other.cert_pem);
        }
        pem
    }

    /// The step due `now`: a rotation starts when `requested` (the cluster's `rotate-ca`
    /// annotation) is new or the signing CA ends within [`CA_ROTATE_BEFORE_DAYS`]; each
    /// later phase once the current one has lasted `grace`. Pure.
    pub fn due(
        &self,
        requested: Option<&str>,
        now: chrono::DateTime<Utc>,
        grace: std::time::Duration,
    ) -> Rotation {
        let lasted = (now - self.since).to_std().unwrap_or_default() >= grace;
        match self.phase {
            CaPhase::Stable => {
                let asked = requested.is_some_and(|r| Some(r) != self.handled.as_deref());
                let ending =
                    now.date_naive() + Days::new(CA_ROTATE_BEFORE_DAYS) >= self.signing_until;
                if asked || ending {
                    Rotation::Start
                } else {
                    Rotation::Keep
                }
            }
            CaPhase::Trusting if lasted => Rotation::Serve,
            CaPhase::Serving if lasted => Rotation::Finish,
            CaPhase::Trusting | CaPhase::Serving => Rotation::Keep,
        }
    }

    /// The authority after `step` (a new CA made for [`Rotation::Start`]). `requested` is
    /// recorded as handled when a rotation starts.
    ///
    /// # Errors
    /// When a new CA cannot be made.
    pub fn after(
        &self,
        step: Rotation,
        cluster: &str,
        requested: Option<&str>,
        now: chrono::DateTime<Utc>,
    ) -> Result<Authority, rcgen::Error> {
        let mut next = self.clone();
        match step {
            Rotation::Keep => return Ok(next),
            Rotation::Start => {
                let today = now.date_naive();
                let ca = new_ca(cluster, self.generation + 1, today)?;
                next.other = Some((ca, today + Days::new(CA_DAYS)));
                next.phase = CaPhase::Trusting;
                if requested.is_some() {
                    next.handled = requested.map(str::to_string);
                }
            }
            Rotation::Serve => {
                let Some((new, until)) = self.other.clone() else {
                    return Ok(Authority {
                        phase: CaPhase::Stable,
                        since: now,
                        ..next
                    });
                };
                next.other = Some((self.signing.clone(), self.signing_until));
                next.signing = new;
                next.signing_until = until;
                next.generation = self.generation + 1;
                next.phase = CaPhase::Serving;
            }
            Rotation::Finish => {
                next.other = None;
                next.phase = CaPhase::Stable;
            }
        }
        next.since = now;
        Ok(next)
    }
}

/// `d` for a person: `24h`, `1h30m`, `90s`.
pub fn span(d: std::time::Duration) -> String {
    let s = d.as_secs();
    let (h, m, sec) = (s / 3600, (s % 3600) / 60, s % 60);
    let mut out = String::new();
    for (n, unit) in [(h, "h"), (m, "m"), (sec, "s")] {
        if n > 0 {
            out.push_str(&format!("{n}{unit}"));
        }
    }
    if out.is_empty() {
        "0s".to_string()
    } else {
        out
    }
}

/// The last valid day of a CA made `today`.
pub fn ca_until(today: NaiveDate) -> NaiveDate {
    today + Days::new(CA_DAYS)
}

/// Today (UTC).
pub fn today() -> NaiveDate {
    Utc::now().date_naive()
}

/// The Event of a CA rotation's step (none while the CA is kept): the new CA trusted beside
/// the signing one, then signing, then alone; `grace` is how long each phase lasts.
pub fn rotation_event(
    step: Rotation,
    authority: &Authority,
    grace: std::time::Duration,
) -> Option<steward_core::events::Wanted> {
    let note = match step {
        Rotation::Keep => return None,
        Rotation::Start => format!(
            "CA rotation started: a new CA (#{}) is trusted beside the one that signs; every ca.crt of the cluster now holds both, and the new one signs in {}",
            authority.generation + 1,
            span(grace)
        ),
        Rotation::Serve => format!(
            "CA rotation: the new CA (#{}) signs the server certificate; the previous one stays trusted for {}",
            authority.generation,
            span(grace)
        ),
        Rotation::Finish => format!(
            "CA rotation done: only CA #{} is trusted",
            authority.generation
        ),
    };
    Some(steward_core::events::Wanted::normal(
        "CARotation",
        "RotateCA",
        note,
    ))
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
        let ca = new_ca("pg", 0, today).unwrap();
        let names = server_names("pg", "ns");
        assert!(names.contains(&"pg-rw.ns.svc".to_string()));
        let (server, not_after) = server("pg", 0, &ca.key_pem, &names, today).unwrap();
        assert_eq!(not_after, day(2027, 12, 1));
        assert!(server.cert_pem.starts_with("-----BEGIN CERTIFICATE-----"));
        assert!(server.key_pem.contains("PRIVATE KEY"));

        // rustls, as a client with only the CA, accepts it for pg-rw.ns.svc.
        assert!(
            trusted(&ca.cert_pem, &server.cert_pem, "pg-rw.ns.svc"),
            "valid for the Service name, signed by the CA"
        );
        assert!(
            !trusted(&ca.cert_pem, &server.cert_pem, "other.ns.svc"),
            "not for other names"
        );
    }

    /// Whether a client trusting `roots` (PEM, one or more CAs) accepts `leaf` for `name`.
    fn trusted(roots: &str, leaf: &str, name: &str) -> bool {
        use rustls::client::danger::ServerCertVerifier;
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
        let mut store = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(roots.as_bytes()) {
            store.add(cert.unwrap()).unwrap();
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(store.into(), provider)
                .build()
                .unwrap();
        let leaf = CertificateDer::from_pem_slice(leaf.as_bytes()).unwrap();
        let now = UnixTime::since_unix_epoch(std::time::Duration::from_secs(1_796_000_000));
        verifier
            .verify_server_cert(
                &leaf,
                &[],
                &ServerName::try_from(name.to_string()).unwrap(),
                &[],
                now,
            )
            .is_ok()
    }

    /// Issue #37, item 11: the cluster CA was never rotated. A rotation trusts the new CA
    /// beside the old before it signs, and drops the old only after the new signs: a client
    /// holding the `ca.crt` of the phase before, or of the phase it is in, trusts the server
    /// at every step.
    #[test]
    fn a_ca_rotation_never_leaves_a_client_of_the_previous_phase_untrusting() {
        use chrono::TimeZone;
        const RW: &str = "pg-rw.ns.svc";
        let grace = std::time::Duration::from_secs(3600);
        let t0 = Utc.with_ymd_and_hms(2026, 12, 1, 0, 0, 0).unwrap();
        let at = |secs: i64| t0 + chrono::Duration::seconds(secs);
        let names = server_names("pg", "ns");
        let leaf = |a: &Authority| {
            server(
                "pg",
                a.generation,
                &a.signing.key_pem,
                &names,
                t0.date_naive(),
            )
            .unwrap()
            .0
            .cert_pem
        };
        let first = Authority::first(
            new_ca("pg", 0, t0.date_naive()).unwrap(),
            ca_until(t0.date_naive()),
            t0,
        );
        assert_eq!(first.due(None, at(10), grace), Rotation::Keep);
        assert_eq!(first.due(Some("r1"), at(10), grace), Rotation::Start);
        // Ten years on, less a year: by itself.
        assert_eq!(
            first.due(None, t0 + chrono::Duration::days(3650 - 365), grace),
            Rotation::Start
        );
        let old_bundle = first.bundle();
        let trusting = first
            .after(Rotation::Start, "pg", Some("r1"), at(10))
            .unwrap();
        assert_eq!(trusting.phase, CaPhase::Trusting);
        assert_eq!(trusting.handled.as_deref(), Some("r1"));
        assert_eq!(
            trusting.due(Some("r1"), at(20), grace),
            Rotation::Keep,
            "before the grace"
        );
        assert!(
            trusted(&old_bundle, &leaf(&trusting), RW),
            "the old CA still signs"
        );
        assert!(trusted(&trusting.bundle(), &leaf(&trusting), RW));
        assert_eq!(trusting.due(Some("r1"), at(3610), grace), Rotation::Serve);
        let serving = trusting
            .after(Rotation::Serve, "pg", Some("r1"), at(3610))
            .unwrap();
        assert_eq!((serving.phase, serving.generation), (CaPhase::Serving, 1));
        assert!(
            !trusted(&old_bundle, &leaf(&serving), RW),
            "a client that never reloaded would not trust the new CA: hence the grace"
        );
        assert!(
            trusted(&trusting.bundle(), &leaf(&serving), RW),
            "the bundle it was given does"
        );
        assert!(
            trusted(&serving.bundle(), &leaf(&trusting), RW),
            "and the old server is still trusted"
        );
        assert_eq!(serving.due(Some("r1"), at(3620), grace), Rotation::Keep);
        let done = serving
            .after(Rotation::Finish, "pg", Some("r1"), at(7210))
            .unwrap();
        assert_eq!((done.phase, done.other.is_none()), (CaPhase::Stable, true));
        assert!(trusted(&serving.bundle(), &leaf(&done), RW));
        assert!(trusted(&done.bundle(), &leaf(&done), RW));
        assert!(
            !trusted(&done.bundle(), &leaf(&first), RW),
            "the old CA is gone"
        );
        // The same request does not start another; a new one does.
        assert_eq!(done.due(Some("r1"), at(7220), grace), Rotation::Keep);
        assert_eq!(done.due(Some("r2"), at(7220), grace), Rotation::Start);
        assert_eq!(span(grace), "1h");
        assert_eq!(span(std::time::Duration::from_secs(5430)), "1h30m30s");
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
